"""Weighted mixtures of prepared sources: shares held within 1%, deterministic, exact on resume
and on another world size, per-source tokens in the metrics, bad weights exit 2."""

import json
import shutil

import numpy as np
import pytest

from conftest import DEMO, TINY_OVERRIDES
from llmforge.cli import main
from llmforge.data.mixture import MixtureSampler


def take(sampler: MixtureSampler, steps: int) -> list:
    it = iter(sampler)
    return [next(it) for _ in range(steps * sampler.local)]


def test_shares_within_one_percent_over_10000_windows_and_fixed_by_seed():
    shares = [0.5, 0.3, 0.15, 0.05]
    got = take(MixtureSampler(shares, [97, 50, 31, 7], seed=3, local_batch=100), 100)
    counts = np.bincount([s for s, _ in got], minlength=4) / len(got)
    assert len(got) == 10_000 and np.abs(counts - shares).max() < 0.01, counts
    assert got == take(MixtureSampler(shares, [97, 50, 31, 7], seed=3, local_batch=100), 100)
    assert got != take(MixtureSampler(shares, [97, 50, 31, 7], seed=4, local_batch=100), 100)
    # each source is read without repeats within its own epoch
    first = [w for s, w in got if s == 3][:7]
    assert sorted(first) == list(range(7))


def test_resume_on_other_world_sizes_is_exact():
    args = dict(shares=[0.7, 0.3], sizes=[40, 13], seed=5)
    straight = take(MixtureSampler(**args, local_batch=8), 12)

    def ranks(world, start, stop):
        out = []
        for step in range(start, stop):  # all ranks' samples of each step, in rank order
            for r in range(world):
                s = MixtureSampler(**args, rank=r, world_size=world, start_step=step,
                                   local_batch=8 // world)
                out += take(s, 1)
        return out

    assert ranks(2, 0, 4) + ranks(1, 4, 8) + ranks(4, 8, 12) == straight


@pytest.mark.parametrize("weight", ["0", "-1", "nan"])
def test_bad_weight_exits_2_naming_the_key(tmp_path, capsys, weight):
    code = main(["train", DEMO, "data.source=prepared",
                 f"data.mixture=[{{path: a, weight: 1}}, {{path: b, weight: {weight}}}]", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: data.mixture[1].weight="), err
    assert "finite number > 0" in err


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two prepared corpora written with one tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    for name, word in (("books", "page"), ("code", "def")):
        (root / name).mkdir()
        rows = [{"text": f"{name} {d}: " + " ".join(f"{word}{(d + i) % 50}" for i in range(30))}
                for d in range(80)]
        (root / name / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = ["tokenizer.vocab_size=1024"]
    assert main(["data", "prepare", str(root / "books" / "a.jsonl"), str(root / "p-books"), *tok,
                 "--workers", "1"]) == 0
    shared = f"tokenizer.path={root / 'p-books' / 'tokenizer' / 'tokenizer.json'}"
    assert main(["data", "prepare", str(root / "code" / "a.jsonl"), str(root / "p-code"),
                 "tokenizer.type=huggingface", shared, "--workers", "1"]) == 0
    return root


def test_mixture_trains_logs_tokens_per_source_and_dry_run_shows_shares(two_sources, tmp_path, capsys):
    mix = (f"data.mixture=[{{path: {two_sources / 'p-books'}, weight: 3, name: books}}, "
           f"{{path: {two_sources / 'p-code'}, weight: 1, name: code}}]")
    common = [DEMO, *TINY_OVERRIDES, "data.source=prepared", mix, f"run.output_dir={tmp_path}",
              "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
              "trainer.eval_batches=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"]
    capsys.readouterr()
    assert main(["train", *common, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mixture         books: 75.0% share, ~384 tokens per step" in out
    assert "mixture         code: 25.0% share, ~128 tokens per step" in out
    # seq_length_warmup trains fewer tokens of each window: the per-source counts follow
    warmup = "algorithms=[{name: seq_length_warmup, duration: 2, min_seq_len: 16, step_size: 8}]"
    assert main(["train", *common, "run.name=m", warmup, "trainer.max_steps=3",
                 "checkpoint.save_every=2"]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["train/tokens_seen"] for r in steps] == [8 * 16, 8 * 16 + 8 * 40, 8 * 16 + 8 * 40 + 8 * 64]
    for r in steps:  # at every step, not only at the end
        assert r["data/books/tokens_seen"] + r["data/code/tokens_seen"] == r["train/tokens_seen"], r
    assert steps[-1]["data/books/tokens_seen"] >= steps[-1]["data/code/tokens_seen"]
    # a resume continues the counts saved in the checkpoint (not windows x seq_len)
    shutil.rmtree(tmp_path / "m" / "checkpoints" / "step_00000003")
    assert main(["train", *common, "run.name=m", warmup, "trainer.max_steps=3",
                 "checkpoint.save_every=2", "checkpoint.resume=auto"]) == 0, capsys.readouterr().err
    again = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in again if "train/loss" in r][-1]
    keys = ["train/tokens_seen", "data/books/tokens_seen", "data/code/tokens_seen"]
    assert last["step"] == 3 and [last[k] for k in keys] == [steps[-1][k] for k in keys]


def test_entries_prepared_with_two_tokenizers_exit_2_naming_the_entry(two_sources, tmp_path, capsys):
    other = tmp_path / "p-other"  # the code corpus with its own BPE, not the books' one
    assert main(["data", "prepare", str(two_sources / "code" / "a.jsonl"), str(other),
                 "tokenizer.vocab_size=1024", "--workers", "1", "--no-progress"]) == 0
    capsys.readouterr()
    code = main(["train", DEMO, *TINY_OVERRIDES, "data.source=prepared", f"run.output_dir={tmp_path / 'runs'}",
                 f"data.mixture=[{{path: {two_sources / 'p-books'}, weight: 1}}, {{path: {other}, weight: 1}}]"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: data.mixture[1].path: {other} was prepared with another "), err
    assert f"tokenizer.path={two_sources / 'p-books' / 'tokenizer' / 'tokenizer.json'}" in err
    assert not (tmp_path / "runs").exists()


def test_weights_near_the_float_limits_keep_their_shares_or_exit_2(capsys):
    assert main(["train", DEMO, "data.source=prepared", "--dry-run",
                 "data.mixture=[{path: a, weight: 1e308, name: a}, {path: b, weight: 3e307, name: b}]"]) == 0
    out = capsys.readouterr().out
    assert "a: 76.9% share" in out and "b: 23.1% share" in out
    code = main(["train", DEMO, "data.source=prepared", "--dry-run",
                 "data.mixture=[{path: a, weight: 1e308, name: a}, {path: b, weight: 1e-308, name: b}]"])
    assert code == 2 and "data.mixture[1].weight=1e-308: its share 0 is too small" in capsys.readouterr().err
