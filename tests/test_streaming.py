"""Streaming sources resume exactly and at once: the position of every loader worker is saved
(datasets' IterableDataset.state_dict through torchdata's StatefulDataLoader), never replayed."""

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli


class ByteTokenizer:
    """Bytes as ids (offset 2), BOS=0, EOS=1; ``delay`` seconds per document (a slow tokenizer)."""

    vocab_size, bos_id, eos_id = 258, 0, 1

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def encode_batch(self, texts):
        if self.delay:
            time.sleep(self.delay * len(texts))
        return [[b + 2 for b in t.encode()] for t in texts]


def write_corpus(folder: Path, files: int, docs: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part{f}.jsonl", "w") as fh:
            for d in range(docs):
                fh.write(json.dumps({"text": f"file {f} document {d} " + "word " * (d % 17 + 3)}) + "\n")
    return str(folder / "*.jsonl")


def stream(path: str, *, num_workers: int, tokenizer=None, block_docs: int = 8, seq_len: int = 15,
           batch: int = 4, val_fraction: float = 0):
    from omegaconf import OmegaConf

    from llmforge.config.schema import DataConfig
    from llmforge.data.datamodule import LLMDataModule
    from llmforge.data.sources import load_documents

    cfg = OmegaConf.structured(DataConfig(source="files", path=path, streaming=True,
                                         val_fraction=val_fraction))
    dm = LLMDataModule(load_documents(cfg, 0), tokenizer or ByteTokenizer(), seq_len=seq_len,
                       local_batch_size=batch, micro_batch_size=batch, eval_batches=1, seed=3,
                       num_workers=num_workers, dp_rank=0, dp_size=1)
    dm.setup()
    dm.train_windows.block_docs = block_docs
    return dm


@pytest.mark.parametrize("files,num_workers", [(3, 0), (3, 1), (3, 2), (3, 3), (1, 2)])
def test_loader_position_resumes_exactly(tmp_path, files, num_workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from llmforge.data.loader import PositionedLoader

    path = write_corpus(tmp_path / "c", files, 30)  # several passes over the source in 60 batches
    dm = stream(path, num_workers=num_workers)
    loader = dm.train_dataloader()
    it = iter(loader)
    straight = [next(it) for _ in range(37)]
    saved = loader.position(36)  # Lightning has fetched batch 37 already: the position is 36's
    straight += [next(it) for _ in range(23)]
    loader.close()

    again = stream(path, num_workers=num_workers)
    resumed = StatefulDataLoader(again.train_windows, batch_size=4, num_workers=num_workers)
    resumed.load_state_dict(json.loads(json.dumps(saved)))  # through JSON, as in a checkpoint
    positioned = PositionedLoader(resumed, saved)
    rest = [b for _, b in zip(range(23), positioned)]
    positioned.close()
    for i, b in enumerate(rest):
        assert torch.equal(b, straight[36 + i]), i
    assert positioned.position(0) == saved


def test_resume_far_into_the_stream_does_not_replay(tmp_path):
    path = write_corpus(tmp_path / "big", 4, 5_000)
    fast = stream(path, num_workers=0, block_docs=256, seq_len=63, batch=8)
    loader = fast.train_dataloader()
    it = iter(loader)
    for _ in range(3_000):  # 24,000 windows, about 15,000 documents
        next(it)
    saved = loader.position(3_000)
    # with a tokenizer of 10 ms per document, replaying 15,000 documents would take 150 s
    slow = stream(path, num_workers=0, tokenizer=ByteTokenizer(delay=0.01), block_docs=256,
                  seq_len=63, batch=8)
    slow.resume_dir = tmp_path / "ckpt"
    (slow.resume_dir / "data").mkdir(parents=True)
    (slow.resume_dir / "data" / "rank0.json").write_text(json.dumps(
        {"dp_rank": 0, "dp_size": 1, "num_workers": 0, "step": 3_000, "loader": saved}))
    start = time.perf_counter()
    first = next(iter(slow.train_dataloader()))
    took = time.perf_counter() - start
    assert torch.equal(first, next(it))
    assert took < 15, f"resume took {took:.1f}s (at most one block of 256 documents is re-read)"


def test_changed_world_size_restarts_the_stream_and_says_so(tmp_path, capsys):
    path = write_corpus(tmp_path / "c", 2, 10)
    dm = stream(path, num_workers=1)
    dm.resume_dir = tmp_path / "ckpt"
    (dm.resume_dir / "data").mkdir(parents=True)
    (dm.resume_dir / "data" / "rank0.json").write_text(json.dumps(
        {"dp_rank": 0, "dp_size": 2, "num_workers": 1, "step": 5, "loader": {}}))
    assert dm._saved_position() is None
    err = capsys.readouterr().err
    assert "data-parallel size 2" in err and "this run has 1" in err and "seen again" in err


@pytest.mark.parametrize("rewrite", ["longer", "same size"])
def test_a_file_rewritten_under_its_name_is_refused_at_resume(tmp_path, capsys, rewrite):
    from llmforge.errors import DataError

    path = write_corpus(tmp_path / "c", 2, 10)
    dm = stream(path, num_workers=0)
    saved = {"dp_rank": 0, "dp_size": 1, "num_workers": 0, "step": 3, "files": dm._stream_files(),
             "file_stats": dm._stream_stats(), "loader": {"saved": True}}
    (tmp_path / "ckpt" / "data").mkdir(parents=True)
    (tmp_path / "ckpt" / "data" / "rank0.json").write_text(json.dumps(saved))
    part = tmp_path / "c" / "part1.jsonl"
    old = part.read_text()
    part.write_text(old + old if rewrite == "longer" else old.replace("file 1", "file 9"))
    again = stream(path, num_workers=0)
    again.resume_dir = tmp_path / "ckpt"
    with pytest.raises(DataError) as err:
        again._saved_position()
    size = f"{len(old):,} -> {len(old) * 2:,} bytes)" if rewrite == "longer" else \
        f"{len(old):,} -> {len(old):,} bytes, other content)"
    assert str(err.value).startswith(f"data: a streaming file changed since {tmp_path / 'ckpt' / 'data' / 'rank0.json'} "
                                     f"was saved (data: part1.jsonl ({size}"), str(err.value)
    assert "checkpoint.allow_config_changes=true" in str(err.value)
    again.allow_source_changes = True  # the stream restarts, and says so
    assert again._saved_position() is None
    assert "part1.jsonl" in capsys.readouterr().err
    part.write_text(old)  # the file as it was: the position applies again
    assert stream(path, num_workers=0)._same_files(saved, tmp_path, 0)


# ------------------------------------------------- past the first pass (issue 26.1)
def write_tagged(folder: Path, files: int, docs: int) -> str:
    """Documents ``<f.d>`` repeated: every window names the file and document it came from."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part{f}.jsonl", "w") as fh:
            for d in range(docs):
                fh.write(json.dumps({"text": f"<{f}.{d}>" * (3 + (f + d) % 4)}) + "\n")
    return str(folder / "*.jsonl")


def tags(window) -> set[tuple[int, int]]:
    """The ``(file, document)`` of every whole tag in a window of ByteTokenizer ids."""
    import re

    text = bytes(max(0, int(i) - 2) for i in window).decode()
    return {(int(f), int(d)) for f, d in re.findall(r"<(\d+)\.(\d+)>", text)}


def who(state: dict) -> tuple[int, int]:
    """``(worker, pass)`` of the batch a StatefulDataLoader state was taken after."""
    if "_snapshot" not in state:  # num_workers=0
        return 0, state["dataset_state"]["epoch"]
    snap = state["_snapshot"]
    w = snap["_last_yielded_worker_id"]
    return w, snap["_worker_snapshots"][f"worker_{w}"]["dataset_state"]["epoch"]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_later_passes_resume_exactly_hold_out_and_keep_workers_disjoint(tmp_path, num_workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from llmforge.data.loader import PositionedLoader

    path = write_tagged(tmp_path / "c", 3, 5)  # about 9 windows of 16 tokens per file and pass
    dm = stream(path, num_workers=num_workers, block_docs=2, batch=2, val_fraction=0.25)
    held = {t for row in dm.docs.val for t in tags([b + 2 for b in row["text"].encode()])}
    assert 1 <= len(held) < 15, held
    loader = dm.train_dataloader()
    it = iter(loader)
    straight, states, where = [], [], []
    reached = dict.fromkeys(range(max(1, num_workers)), 0)
    while min(reached.values()) < 3:  # every worker into its fourth pass
        straight.append(next(it))
        states.append(loader.loader.state_dict())  # the position after this batch
        where.append(who(states[-1]))
        reached[where[-1][0]] = where[-1][1]
    loader.close()
    # no held-out document in any training window, in any pass of any worker
    assert not held & {t for batch in straight for window in batch for t in tags(window)}
    # every pass: each worker reads its own files, and the workers' files are disjoint
    files: dict[tuple[int, int], set[int]] = {}
    for batch, (w, p) in zip(straight, where):
        files.setdefault((p, w), set()).update(f for window in batch for f, _ in tags(window))
    passes = sorted({p for p, _ in files})
    for p in passes:
        ws = [files[(p, w)] for w in range(max(1, num_workers)) if (p, w) in files]
        assert sum(len(f) for f in ws) == len(set().union(*ws)), (p, ws)
    # resume inside the second and the third pass of a worker: the same batches follow
    targets = [next(n for n, (_, p) in enumerate(where, 1) if p == k and n > 2) for k in (1, 2)]
    for n in targets:
        saved = json.loads(json.dumps(states[n - 1]))  # through JSON, as in a checkpoint
        again = stream(path, num_workers=num_workers, block_docs=2, batch=2, val_fraction=0.25)
        resumed = StatefulDataLoader(again.train_windows, batch_size=2, num_workers=num_workers)
        resumed.load_state_dict(saved)
        positioned = PositionedLoader(resumed, saved)
        rest = [b for _, b in zip(range(6), positioned)]
        positioned.close()
        for i, b in enumerate(rest):
            assert torch.equal(b, straight[n + i]), (n, i)


# ------------------------------------------------------------ end to end, after SIGKILL
BASE = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.eval_batches=1", "data.source=files", "data.streaming=true",
        "checkpoint.save_every=3"]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("stream-corpus"), 4, 120)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,num_workers", [(1, 3), (2, 2)])
def test_sigkill_then_resume_is_bit_exact(tmp_path, corpus, nproc, num_workers):
    extra = [f"data.path={corpus}", f"data.num_workers={num_workers}",
             f"run.output_dir={tmp_path}"] + (["--nproc", "2", "strategy.name=fsdp2"] if nproc > 1 else [])
    ref = run_cli("train", DEMO, *BASE, *extra, "run.name=ref", cwd=REPO)
    assert ref.returncode == 0, ref.stderr[-3000:]
    kill = "callbacks=[{name: tests.helpers.killers.KillAt, step: 5, sig: SIGKILL}]"
    killed = run_cli("train", DEMO, *BASE, *extra, "run.name=k", kill, cwd=REPO)
    assert killed.returncode != 0
    if nproc == 1:
        assert killed.returncode == -signal.SIGKILL
    saved = tmp_path / "k" / "checkpoints" / "step_00000003" / "data"
    assert sorted(p.name for p in saved.iterdir()) == [f"rank{r}.json" for r in range(nproc)]
    resumed = run_cli("train", DEMO, *BASE, *extra, "run.name=k", "checkpoint.resume=auto", cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = losses(tmp_path / "ref"), losses(tmp_path / "k")
    assert sorted(b) == list(range(1, 7))
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
