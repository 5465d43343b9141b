"""Mixtures with streaming entries: prepared and streaming windows in the sampler's proportions,
exact resume of the whole mixture through StatefulDataLoader with 0 and 2 workers, a changed
worker count said plainly, and bad entries exit 2 naming the key."""

import hashlib
import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import DEMO, REPO, run_cli
from llmforge.cli import main
from test_streaming import ByteTokenizer, write_corpus

PREPARED_ID = 300  # prepared windows hold ids >= 300; ByteTokenizer's are < 258


def write_prepared(root: Path, windows: int, seq_len: int) -> str:
    """A prepared folder by hand: one shard of ``windows`` windows, window ``i`` all ``300 + i``."""
    (root / "train").mkdir(parents=True)
    ids = np.repeat(np.arange(PREPARED_ID, PREPARED_ID + windows, dtype=np.uint16), seq_len + 1)
    (root / "train" / "shard_00000.bin").write_bytes(ids.tobytes())
    shard = {"file": "train/shard_00000.bin", "tokens": int(ids.size),
             "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}
    (root / "manifest.json").write_text(json.dumps({
        "format": "llmforge-tokens/1", "complete": True, "dtype": "uint16",
        "tokenizer": {"fingerprint": "x", "vocab_size": 1024, "bos_id": 0, "eos_id": 1, "type": "t"},
        "splits": {"train": {"documents": windows, "tokens": int(ids.size), "shards": [shard]}}}))
    return str(root)


def mixture_cfg(entries: list, **data):
    from omegaconf import OmegaConf

    from llmforge.config.schema import DataConfig

    return OmegaConf.create({"data": OmegaConf.structured(DataConfig(mixture=entries, **data)),
                             "run": {"seed": 0}})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixstream")
    (root / "marked").mkdir()
    for f in range(4):  # every window of file f holds only the digit f (and BOS/EOS)
        (root / "marked" / f"m{f}.jsonl").write_text(f'{{"text": "{str(f) * 40}"}}\n' * 20)
    return {"prepared": write_prepared(root / "p", 40, 15),
            "web": write_corpus(root / "web", 4, 30), "marked": str(root / "marked" / "*.jsonl")}


def module(sources, *, num_workers: int, batch: int = 4, start_step: int = 0, resume_dir=None,
           shares=(3, 1), rank: int = 0, world: int = 1, allow_source_changes: bool = False):
    from llmforge.data.datamodule import LLMDataModule
    from llmforge.data.mixture_sources import open_mixture

    cfg = mixture_cfg([{"source": "prepared", "path": sources["prepared"], "weight": shares[0], "name": "books"},
                       {"source": "files", "path": sources["web"], "weight": shares[1], "name": "web"}])
    dm = LLMDataModule(open_mixture(cfg), ByteTokenizer(), seq_len=15, local_batch_size=batch,
                       micro_batch_size=batch, eval_batches=1, seed=3, num_workers=num_workers,
                       dp_rank=rank, dp_size=world, start_step=start_step, resume_dir=resume_dir,
                       allow_source_changes=allow_source_changes)
    dm.setup()
    for w in dm.train_windows.streams.values():
        w.block_docs = 8  # several blocks and passes within the test
    return dm


def is_prepared(batch: torch.Tensor) -> list[bool]:
    return [bool(row.min() >= PREPARED_ID) for row in batch]


@pytest.mark.parametrize("num_workers,at", [(0, 7), (2, 7), (3, 1)])
def test_mixture_with_a_stream_resumes_exactly(sources, tmp_path, num_workers, at):
    from llmforge.data.mixture import MixtureSampler

    dm = module(sources, num_workers=num_workers)
    loader = dm.train_dataloader()
    it = iter(loader)
    straight = [next(it) for _ in range(at + 6)]
    saved = loader.position(at)  # the loader has fetched more (at 1: workers 1, 2 none taken)
    straight += [next(it) for _ in range(14 - at)]
    loader.close()
    # the sampler decides which source each window comes from; prepared windows are its picks
    smp = MixtureSampler([0.75, 0.25], [40, 1], seed=3, local_batch=4)
    picks = [p for _, p in zip(range(80), smp)]
    got = [x for b in straight for x in b]
    assert [s == 0 for s, _ in picks] == [bool(x.min() >= PREPARED_ID) for x in got]
    assert [int(x[0]) - PREPARED_ID for x, (s, _) in zip(got, picks) if s == 0] == \
        [w for s, w in picks if s == 0]
    stream = [x for x in got if x.max() < PREPARED_ID]
    assert len(stream) == sum(s == 1 for s, _ in picks)

    resume = tmp_path / "ckpt"
    (resume / "data").mkdir(parents=True)
    (resume / "data" / "rank0.json").write_text(json.dumps(  # through JSON, as a checkpoint
        {"dp_rank": 0, "dp_size": 1, "num_workers": num_workers, "step": at, "loader": saved}))
    again = module(sources, num_workers=num_workers, start_step=at, resume_dir=resume)
    loader = again.train_dataloader()
    rest = [b for _, b in zip(range(20 - at), loader)]
    loader.close()
    for i, b in enumerate(rest):
        assert torch.equal(b, straight[at + i]), i
    # the same seed gives the same windows
    fresh = module(sources, num_workers=num_workers)
    loader = fresh.train_dataloader()
    first = [b for _, b in zip(range(3), loader)]
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(first, straight))


def test_two_ranks_take_their_slice_of_each_step_and_disjoint_streams(sources):
    from llmforge.data.mixture import MixtureSampler

    got = {}
    for rank in (0, 1):
        loader = module({**sources, "web": sources["marked"]}, num_workers=2, batch=2, rank=rank,
                        world=2).train_dataloader()
        got[rank] = [x for _, b in zip(range(10), loader) for x in b]
        loader.close()
        picks = [p for _, p in zip(range(20), MixtureSampler([0.75, 0.25], [40, 1], rank, 2, seed=3,
                                                              local_batch=2))]
        assert [int(x[0]) - PREPARED_ID if s == 0 else -1 for x, (s, _) in zip(got[rank], picks)] == \
            [w if s == 0 else -1 for s, w in picks]
    # datasets gives each rank 2 of the 4 files, each of its 2 workers one
    files = [{chr(i - 2) for x in got[r] if x.max() < PREPARED_ID for i in x.tolist() if i > 1}
             for r in (0, 1)]
    assert files[0] and files[1] and files[0] <= {"0", "2"} and files[1] <= {"1", "3"}, files


def test_changed_worker_count_continues_disjoint_and_says_so(sources, tmp_path, capsys):
    resume = tmp_path / "ckpt"
    (resume / "data").mkdir(parents=True)
    (resume / "data" / "rank0.json").write_text(json.dumps(
        {"dp_rank": 0, "dp_size": 1, "num_workers": 2, "step": 5, "loader": {"x": 1}}))
    dm = module(sources, num_workers=0, start_step=5, resume_dir=resume)
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    loader.close()
    err = capsys.readouterr().err
    assert "data.num_workers=2, this run has 1 and 0" in err
    assert "restarts the mixture's streaming entries" in err and "continue exactly at step 5" in err
    # prepared samples are those of step 5 (the sampler by step), the streaming ones start again
    from llmforge.data.mixture import MixtureSampler

    want = [p for _, p in zip(range(4), MixtureSampler([0.75, 0.25], [40, 1], seed=3, start_step=5,
                                                        local_batch=4))]
    assert [int(x[0]) - PREPARED_ID for x, (s, _) in zip(batch, want) if s == 0] == \
        [w for s, w in want if s == 0]


@pytest.mark.parametrize("allow", [False, True])
def test_streaming_files_that_changed_since_the_checkpoint_are_refused_or_restart(sources, tmp_path, capsys, allow):
    from llmforge.errors import DataError

    resume = tmp_path / "ckpt"
    (resume / "data").mkdir(parents=True)
    (resume / "data" / "rank0.json").write_text(json.dumps(  # saved when web/ held 5 files
        {"dp_rank": 0, "dp_size": 1, "num_workers": 0, "step": 5, "loader": {"x": 1},
         "files": {"web": [f"part{f}.jsonl" for f in range(5)]}}))
    dm = module(sources, num_workers=0, start_step=5, resume_dir=resume, allow_source_changes=allow)
    assert dm.state_dict() == {} and dm._stream_files() == {"web": [f"part{f}.jsonl" for f in range(4)]}
    if not allow:
        with pytest.raises(DataError, match=r"streaming files differ .*rank0.json was saved with \(web: 5 -> 4 "
                                             r"files\).*restore the files, or pass checkpoint.allow_config_changes"):
            dm.train_dataloader()
        return
    loader = dm.train_dataloader()
    next(iter(loader))
    loader.close()
    assert "the stream restarts from its beginning (the prepared entries continue exactly)" in capsys.readouterr().err


def test_shares_hold_within_one_percent_over_10000_windows(sources):
    dm = module(sources, num_workers=0, batch=100, shares=(0.7, 0.3))
    it = iter(dm.train_windows)
    flags = [bool(next(it).min() >= PREPARED_ID) for _ in range(10_000)]
    assert abs(sum(flags) / 10_000 - 0.7) < 0.01


def test_too_many_workers_for_the_shards_exits_early_naming_the_entry(sources):
    from llmforge.errors import DataError

    with pytest.raises(DataError, match=r"data.mixture\[1\] \(web\).*4 shard\(s\).*data.num_workers=5"):
        module(sources, num_workers=5)


@pytest.mark.parametrize("entry,want", [
    ("{source: files, path: x.jsonl, weight: 1, colour: red}", "data.mixture[1]: unknown key(s) ['colour']"),
    ("{source: files, weight: 1}", "data.mixture[1].path: required for a files entry"),
    ("{source: hub, weight: 1}", "data.mixture[1].path: required for a hub entry"),
    ("{source: files, path: x.jsonl, weight: 1, streaming: false}", "data.mixture[1].streaming=False"),
    ("{source: files, path: x.jsonl, weight: 1, val_fraction: 0.1}", "evaluation reads the validation"),
    ("{source: prepared, path: p, weight: 1, text_field: t}", "data.mixture[1]: unknown key(s) ['text_field']"),
    ("{source: ftp, path: p, weight: 1}", "data.mixture[1].source='ftp'"),
    ("{source: files, path: x.jsonl, weight: .nan}", "data.mixture[1].weight=nan"),
    ("{source: files, path: x.jsonl, weight: 1, max_documents: abc}", "data.mixture[1].max_documents: Value 'abc'"),
    ("{source: shakespeare, path: x.jsonl, weight: 1}", "data.mixture[1].path: a shakespeare entry"),
    ("{path: [p], weight: 1}", "data.mixture[1].path=['p']: must be a string"),
    ("{path: p, weight: 1, name: {a: 1}}", "data.mixture[1].name={'a': 1}: must be a string"),
    ("{path: p, weight: 1, name: a/b}", "data.mixture[1].name='a/b': must be a non-empty name without '/'"),
    ("{source: files, paths: {a: 1}, weight: 1}", "data.mixture[1].paths={'a': 1}: must be a string or a list"),
    ("{path:p,weight:1}", "write a space after each colon"),
    ("{source: files, path: x.jsonl, weight: 1, max_documents: -1}", "data.mixture[1].max_documents must be > 0"),
])
def test_bad_entry_exits_2_naming_the_key(capsys, entry, want):
    code = main(["train", DEMO, "data.source=prepared",
                 f"data.mixture=[{{path: a, weight: 1}}, {entry}]", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and want in err, err
    assert len(err.strip().splitlines()) == 1


def test_dry_run_hides_url_credentials_of_an_entry(capsys):
    assert main(["train", DEMO, "data.source=prepared", "--dry-run", "data.mixture=[{path: a, weight: 1}, "
                 "{source: files, path: 's3://AKIA:SECRET@bucket/*.jsonl', weight: 1, name: web}]"]) == 0
    out = capsys.readouterr().out
    assert "(s3://***@bucket/*.jsonl, files streaming)" in out and "SECRET" not in out


def test_a_worker_whose_shards_give_no_window_fails_in_one_line(sources, tmp_path):
    from llmforge.errors import DataError

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.jsonl").write_text(Path(sources["web"].replace("*", "part0")).read_text())
    (tmp_path / "s" / "b.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    loader = module({**sources, "web": str(tmp_path / "s" / "*.jsonl")}, num_workers=2).train_dataloader()
    with pytest.raises(DataError) as err:
        [b for _, b in zip(range(20), loader)]
    loader.close()
    assert str(err.value) == ("data.mixture (web): the shards loader worker 1 reads give no complete "
                              "window of seq_len+1=16 tokens; lower data.num_workers or drop the small files")


def test_missing_streaming_files_name_the_entry(sources, tmp_path):
    from llmforge.data.mixture_sources import open_mixture
    from llmforge.errors import DataError

    cfg = mixture_cfg([{"source": "prepared", "path": sources["prepared"], "weight": 1},
                       {"source": "files", "path": str(tmp_path / "none*.jsonl"), "weight": 1}])
    with pytest.raises(DataError, match=r"^data.mixture\[1\].path: no file matches"):
        open_mixture(cfg)


# ------------------------------------------------------------ end to end, through the CLI
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A prepared corpus (its own trained BPE) and a streaming jsonl corpus in 4 files."""
    root = tmp_path_factory.mktemp("mixcli")
    rows = [{"text": f"book {d}: " + " ".join(f"page{(d + i) % 50}" for i in range(30))} for d in range(80)]
    (root / "books.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "prepare", str(root / "books.jsonl"), str(root / "p-books"),
                 "tokenizer.vocab_size=1024", "--workers", "1"]) == 0
    (root / "web").mkdir()
    for f in range(4):
        (root / "web" / f"part{f}.jsonl").write_text("".join(
            json.dumps({"text": f"web {f} {d}: " + " ".join(f"def{(f + d + i) % 40}" for i in range(25))}) + "\n"
            for d in range(40)))
    return root


def series(run: Path, key: str) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.slow
def test_cli_mixture_with_a_stream_sigkill_then_resume_is_bit_exact(corpora, tiny_overrides, tmp_path, capsys):
    mix = (f"data.mixture=[{{path: {corpora / 'p-books'}, weight: 3, name: books}}, "
           f"{{source: files, path: '{corpora / 'web'}/*.jsonl', weight: 1, name: web}}]")
    common = [DEMO, *tiny_overrides, "data.source=prepared", mix, "data.num_workers=2",
              "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
              "trainer.eval_batches=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
              "checkpoint.save_every=3"]
    capsys.readouterr()
    assert main(["train", *common, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mixture         books: 75.0% share, ~384 tokens per step" in out
    assert f"mixture         web: 25.0% share, ~128 tokens per step ({corpora / 'web'}/*.jsonl, files streaming)" in out
    assert main(["train", *common, "run.name=ref"]) == 0, capsys.readouterr().err
    runs = tmp_path / "runs"
    saved = runs / "ref" / "checkpoints" / "step_00000003"
    state = json.loads((saved / "data" / "rank0.json").read_text())
    assert state["num_workers"] == 2 and state["step"] == 3
    # SIGKILLed at step 5 with its 2 loader workers running, resumed from its step-3 checkpoint
    kill = "callbacks=[{name: tests.helpers.killers.KillAt, step: 5, sig: SIGKILL}]"
    killed = run_cli("train", *common, "run.name=k", kill, cwd=REPO)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert main(["train", *common, "run.name=k", "checkpoint.resume=auto"]) == 0, capsys.readouterr().err
    a, b = series(runs / "ref", "train/loss"), series(runs / "k", "train/loss")
    assert sorted(b) == list(range(1, 7)) and [a[s] for s in b] == [b[s] for s in b]
    books, web = series(runs / "ref", "data/books/tokens_seen"), series(runs / "ref", "data/web/tokens_seen")
    seen = series(runs / "ref", "train/tokens_seen")
    assert all(books[s] + web[s] == seen[s] for s in seen) and web[6] > 0 and books[6] > web[6]
    assert series(runs / "k", "data/web/tokens_seen")[6] == web[6]


def test_cli_mixture_of_streams_only_trains_its_own_bpe(corpora, tiny_overrides, tmp_path, capsys):
    mix = (f"data.mixture=[{{path: '{corpora / 'web'}/part[01].jsonl', weight: 1}}, "
           f"{{path: '{corpora / 'web'}/part[23].jsonl', weight: 1, name: more}}]")
    assert main(["train", DEMO, *tiny_overrides, "data.source=files", mix, "trainer.max_steps=2",
                 "trainer.log_every=1", "trainer.eval_every=1", "tokenizer.vocab_size=300",
                 "trainer.global_batch_size=4", "trainer.micro_batch_size=4", "run.name=s"]) == 0
    err = capsys.readouterr().err
    assert "evaluation reads the prepared entries' validation windows only" in err
    run = tmp_path / "runs" / "s"
    part, more = series(run, "data/part/tokens_seen"), series(run, "data/more/tokens_seen")
    assert part[2] + more[2] == series(run, "train/tokens_seen")[2] == 2 * 4 * 64
    assert not series(run, "eval/loss")


def test_the_documented_streaming_mixture_dry_runs(capsys):
    import yaml

    from conftest import REPO

    text = (REPO / "docs" / "data.md").read_text().split("### Streaming entries", 1)[1]
    data = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])["data"]
    assert main(["train", DEMO, f"data.source={data['source']}",
                 f"data.mixture={json.dumps(data['mixture'])}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mixture         c4: 20.0% share" in out and "(allenai/c4, hub streaming)" in out
    assert "mixture         web: 20.0% share" in out and "(corpus/*.jsonl, files streaming)" in out


def test_streaming_entry_without_a_window_exits_2_before_training(corpora, tiny_overrides, tmp_path, capsys):
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    mix = (f"data.mixture=[{{path: {corpora / 'p-books'}, weight: 1}}, "
           f"{{source: files, path: {tmp_path / 'tiny.jsonl'}, weight: 1, name: web}}]")
    code = main(["train", DEMO, *tiny_overrides, "data.source=prepared", mix, "run.name=e"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: data.mixture[1] (web): "), err
    assert "no complete window of seq_len+1=65 tokens" in err[-1]
    assert not list((tmp_path / "runs" / "e").glob("checkpoints/*"))


@pytest.mark.parametrize("second,breaks", [({"source": "files", "path": "x"}, True), ({"path": "q"}, False)])
def test_changed_workers_or_world_size_of_a_mixture_with_a_stream_need_allowing(tmp_path, second, breaks):
    from llmforge.checkpoint.resume_changes import resume_changes

    def config(workers):
        return {"data": {"source": "prepared", "num_workers": workers, "streaming": False,
                         "mixture": [{"path": "p", "weight": 1}, {**second, "weight": 1}]}}

    (tmp_path / "meta.json").write_text(json.dumps({"world_size": 1, "config": config(0)}))
    changes = resume_changes(tmp_path, config(2), world_size=2)
    assert {k for k, _, _ in (changes.breaking if breaks else changes.safe)} == {"world size", "data.num_workers"}
