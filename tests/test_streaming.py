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
           batch: int = 4, val_fraction: float = 0, rank: int = 0, world: int = 1):
    from omegaconf import OmegaConf

    from llmforge.config.schema import DataConfig
    from llmforge.data.datamodule import LLMDataModule
    from llmforge.data.sources import load_documents

    cfg = OmegaConf.structured(DataConfig(source="files", path=path, streaming=True,
                                         val_fraction=val_fraction))
    dm = LLMDataModule(load_documents(cfg, 0), tokenizer or ByteTokenizer(), seq_len=seq_len,
                       local_batch_size=batch, micro_batch_size=batch, eval_batches=1, seed=3,
                       num_workers=num_workers, dp_rank=rank, dp_size=world)
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


def test_objects_behind_a_url_glob_that_changed_are_refused_at_resume(tmp_path):
    """A URL glob is one name in ``files``: the objects it lists are recorded with the size and
    version (ETag or modification time) the store lists, so an added or rewritten object is
    noticed (memory:// lists its objects' creation time)."""
    import fsspec

    from llmforge.errors import DataError

    mem, root = fsspec.filesystem("memory"), f"/stream-{tmp_path.name}"
    docs = "".join(json.dumps({"text": f"document {d} " + "word " * 9}) + "\n" for d in range(20))

    def put(name: str, text: str) -> None:
        with mem.open(f"{root}/{name}", "w") as fh:
            fh.write(text)

    put("part0.jsonl", docs)
    put("part1.jsonl", docs)
    url = f"memory:/{root}/*.jsonl"
    try:
        dm = stream(url, num_workers=0)
        stats = dm._stream_stats()
        assert [e[:2] for e in stats["data"]] == [[f"memory://{root}/part{i}.jsonl", len(docs)]
                                                  for i in (0, 1)]
        assert all(e[2] for e in stats["data"]) and dm._stream_files() == {"data": ["*.jsonl"]}
        saved = {"dp_rank": 0, "dp_size": 1, "num_workers": 0, "step": 3, "files": dm._stream_files(),
                 "file_stats": json.loads(json.dumps(stats)), "loader": {"saved": True}}
        ckpt = tmp_path / "rank0.json"
        assert stream(url, num_workers=0)._same_files(saved, ckpt, 0)  # unchanged: resumes
        put("part2.jsonl", docs)  # one more object under the glob
        with pytest.raises(DataError, match=r"^data: the streaming files differ from those .*rank0.json "
                                            r"was saved with \(data: 2 -> 3 files\)"):
            stream(url, num_workers=0)._same_files(saved, ckpt, 0)
        mem.rm(f"{root}/part2.jsonl")
        put("part1.jsonl", docs.replace("document", "Document"))  # rewritten, the same size
        size = f"{len(docs):,}"
        with pytest.raises(DataError, match=rf"^data: a streaming file changed since .*rank0.json was "
                                            rf"saved \(data: memory://{root}/part1.jsonl \({size} -> "
                                            rf"{size} bytes, other content\)\)"):
            stream(url, num_workers=0)._same_files(saved, ckpt, 0)
    finally:
        mem.rm(root, recursive=True)


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


def passes(path: str, *, num_workers: int, rank: int = 0, world: int = 1):
    """Rank ``rank``'s training batches until every loader worker is in its fourth pass, the
    loader state after each and ``(worker, pass)`` of each; and its datamodule."""
    dm = stream(path, num_workers=num_workers, block_docs=2, batch=2, val_fraction=0.25, rank=rank,
                world=world)
    loader = dm.train_dataloader()
    it = iter(loader)
    batches, states, where = [], [], []
    reached = dict.fromkeys(range(max(1, num_workers)), 0)
    while min(reached.values()) < 3:
        batches.append(next(it))
        states.append(loader.loader.state_dict())  # the position after this batch
        where.append(who(states[-1]))
        reached[where[-1][0]] = where[-1][1]
    loader.close()
    return dm, batches, states, where


@pytest.mark.parametrize("num_workers,world", [(0, 1), (2, 1), (3, 1), (2, 2)])
def test_later_passes_resume_exactly_hold_out_and_keep_workers_disjoint(tmp_path, num_workers, world):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from llmforge.data.loader import PositionedLoader

    files = 3 if world == 1 else 4  # about 9 windows of 16 tokens per file and pass
    path = write_tagged(tmp_path / "c", files, 5)
    trained = []
    for rank in range(world):
        dm, straight, states, where = passes(path, num_workers=num_workers, rank=rank, world=world)
        held = {t for row in dm.docs.val for t in tags([b + 2 for b in row["text"].encode()])}
        assert 1 <= len(held) < 5 * files, held
        trained.append({t for batch in straight for window in batch for t in tags(window)})
        # no held-out document in any training window, in any pass of any worker
        assert not held & trained[-1]
        # every pass: each worker reads its own files, and the workers' files are disjoint
        read: dict[tuple[int, int], set[int]] = {}
        for batch, (w, p) in zip(straight, where):
            read.setdefault((p, w), set()).update(f for window in batch for f, _ in tags(window))
        for p in sorted({p for p, _ in read}):
            ws = [read[(p, w)] for w in range(max(1, num_workers)) if (p, w) in read]
            assert sum(len(f) for f in ws) == len(set().union(*ws)), (p, ws)
        # resume in the middle of a worker's second and third pass: every later batch is equal
        for k in (1, 2):
            inside = [n for n, (_, p) in enumerate(where, 1) if p == k]
            n = inside[len(inside) // 2]
            saved = json.loads(json.dumps(states[n - 1]))  # through JSON, as in a checkpoint
            again = stream(path, num_workers=num_workers, block_docs=2, batch=2, val_fraction=0.25,
                           rank=rank, world=world)
            resumed = StatefulDataLoader(again.train_windows, batch_size=2, num_workers=num_workers)
            resumed.load_state_dict(saved)
            positioned = PositionedLoader(resumed, saved)
            rest = [b for _, b in zip(range(len(straight) - n), positioned)]
            positioned.close()
            assert len(rest) == len(straight) - n
            for i, b in enumerate(rest):
                assert torch.equal(b, straight[n + i]), (rank, k, n, i)
    # every document not held out is trained on, by one data-parallel rank only
    everything = {(f, d) for f in range(files) for d in range(5)}
    assert set().union(*trained) == everything - held
    assert sum(map(len, trained)) == len(everything - held)


# ------------------------------------------------- nested data.storage_options (issue 26.6)
def test_nested_storage_options_reach_the_server_and_the_driver(tmp_path):
    """A read-only config's ``{headers: {...}}`` over http (datasets adds a header of its own
    to the nested dict: a shallow copy failed with "Cannot change read-only config
    container"), and a driver that updates its nested options, as ``data prepare ... URL`` opens."""
    import http.server
    import threading

    import fsspec
    from omegaconf import OmegaConf

    from llmforge.config.schema import DataConfig
    from llmforge.data.remote import open_store
    from llmforge.data.sources import load_documents, read_rows
    from test_prepared_remote import HeadersFile

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    got = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

        def send_head(self):
            got.append(self.headers.get("X-Test"))
            return super().send_head()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # loopback only
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = {"headers": {"X-Test": "nested"}, "client_kwargs": {"trust_env": False}}
    cfg = OmegaConf.structured(DataConfig(source="files", streaming=True, val_fraction=0,
                                         storage_options=options,
                                         path=f"http://127.0.0.1:{server.server_port}/a.jsonl"))
    OmegaConf.set_readonly(cfg, True)
    try:
        docs = load_documents(cfg, 0)
        assert [row["text"] for row in read_rows(docs.train)] == ["one", "two"]
    finally:
        server.shutdown()
    assert got and set(got) == {"nested"}
    fsspec.register_implementation("headersfile", HeadersFile, clobber=True)
    HeadersFile.seen.clear()
    open_store(f"headersfile://{tmp_path}", cfg.storage_options, "OUT")
    assert HeadersFile.seen == [(dict, {"X-Test": "nested", "User-Agent": "llmforge-test"}, dict)]
    assert dict(cfg.storage_options.headers) == {"X-Test": "nested"}  # the config is untouched


# ------------------------------------------------------------ end to end, after SIGKILL
BASE = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.eval_batches=1", "data.source=files", "data.streaming=true",
        "checkpoint.save_every=3"]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact_and_a_rewritten_file_exits_2(tmp_path, capsys):
    """One process with 3 loader workers through the CLI (two data-parallel ranks: the test
    above, at the loader level); the reference and the resumed run in-process."""
    from llmforge.cli import main

    corpus = write_corpus(tmp_path / "corpus", 4, 120)
    common = ["train", DEMO, *BASE, f"data.path={corpus}", "data.num_workers=3",
              f"run.output_dir={tmp_path}"]
    assert main([*common, "run.name=ref"]) == 0, capsys.readouterr().err
    kill = "callbacks=[{name: tests.helpers.killers.KillAt, step: 5, sig: SIGKILL}]"
    killed = run_cli(*common, "run.name=k", kill, cwd=REPO)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = tmp_path / "k" / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in (saved / "data").iterdir()) == ["rank0.json"]
    assert main([*common, "run.name=k", "checkpoint.resume=auto"]) == 0, capsys.readouterr().err
    a, b = losses(tmp_path / "ref"), losses(tmp_path / "k")
    assert sorted(b) == list(range(1, 7))
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    # a file rewritten under its name since that checkpoint: exit 2 naming it, nothing saved
    part = tmp_path / "corpus" / "part1.jsonl"
    old = part.read_text()
    part.write_text(old + old)
    capsys.readouterr()
    assert main([*common, "run.name=changed", f"checkpoint.resume={saved}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: data: a streaming file changed since {saved / 'data' / 'rank0.json'} "
                              f"was saved (data: part1.jsonl ({len(old):,} -> {2 * len(old):,} bytes))"), err
    assert not list((tmp_path / "changed").glob("checkpoints/step_*"))
