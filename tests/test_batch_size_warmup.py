"""``batch_size_warmup``: the batch of every step of a ramp equals the hand computation, a real
run trains exactly those sequences with the learning rate on tokens, and a run killed (SIGKILL)
in the middle of the ramp resumes with ``checkpoint.resume=auto`` bit-exact. The runs use
``optimizer.name=muon``, so the kill and resume also show Muon's state is restored exactly
(issue 25). The reference and the resumed run go in-process; the killed run is a real process."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli
from llmforge.algorithms.batch_size_warmup import BatchSizeWarmup
from llmforge.checkpoint.run_dir import load_for_inference
from llmforge.cli import main
from llmforge.errors import ConfigError
from llmforge.events import State
from llmforge.plugin import CheckContext
from llmforge.training.schedule import lr_multiplier

# global batch 16 = 8 micro-batches of 2; the ramp 4 -> 16 over 40 sequences of 64 tokens
BASE = [*TINY_OVERRIDES, "trainer.global_batch_size=16", "trainer.micro_batch_size=2",
        "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1",
        "scheduler.warmup_steps=2", "optimizer.lr=3e-3", "checkpoint.save_every=3", "optimizer.name=muon"]
RAMP = ("algorithms=[{name: batch_size_warmup, start_global_batch_size: 4, "
        f"duration_tokens: {40 * 64}}}]")
# B(s) by hand: T = sequences before s; B = 4 + 12 * T / 40 rounded down to a multiple of 2
#   s=1 T=0 -> 4; s=2 T=4 -> 5.2 -> 4; s=3 T=8 -> 6.4 -> 6; s=4 T=14 -> 8.2 -> 8;
#   s=5 T=22 -> 10.6 -> 10; s=6 T=32 -> 13.6 -> 12; s=7 T=44 >= 40 -> 16; s=8 -> 16
HAND = [4, 4, 6, 8, 10, 12, 16, 16]


def warmup(**kw):
    w = BatchSizeWarmup(**kw)
    w.configure(micro_batch_size=2, dp_size=1, global_batch_size=16, seq_len=64)
    return w


def test_batch_and_accumulation_of_every_step_equal_the_hand_computation():
    w = warmup(start_global_batch_size=4, duration_tokens=40 * 64)
    assert [w.global_batch(s) for s in range(1, 9)] == HAND
    assert [w.accumulation_steps(s) for s in range(1, 9)] == [b // 2 for b in HAND]
    # step ramp, 2 stages: 4 until 20 sequences, then 4 + 12/2 = 10, then 16 from 40 on
    s = warmup(start_global_batch_size=4, duration_tokens=40 * 64, ramp="step", stages=2)
    assert [s.global_batch(i) for i in range(1, 12)] == [4, 4, 4, 4, 4, 10, 10, 16, 16, 16, 16]
    # 2 data-parallel ranks: multiples of 2 x 2; start 3 is rounded up to 4 (whole micro-batches)
    # T = 0, 4, 8, 12 -> 3 + 13 T / 40 = 3, 4.3, 5.6, 6.9 -> 4; T = 16 -> 8.2 -> 8
    dp = warmup(start_global_batch_size=3, duration_tokens=40 * 64)
    dp.configure(micro_batch_size=2, dp_size=2, global_batch_size=16, seq_len=64)
    assert [dp.global_batch(i) for i in range(1, 6)] == [4, 4, 4, 4, 8]
    # the schedule position after k updates: the fraction of the run's sequences, x max_steps
    total = sum(HAND)
    assert [w.schedule_position(k, 8) for k in range(9)] == pytest.approx(
        [8 * sum(HAND[:k]) / total for k in range(9)])
    # BATCH_START keeps the first B(s) / dp_size windows of this rank; dicts too
    st = State(batch=torch.arange(16 * 65).view(16, 65), step=3, module=SimpleNamespace())
    w.batch_start(st)
    assert torch.equal(st.batch, torch.arange(6 * 65).view(6, 65))
    assert st.metrics["train/global_batch_size"] == 6
    st = State(batch={"input_ids": torch.zeros(16, 64), "labels": torch.zeros(16, 64)}, step=1)
    w.batch_start(st)
    assert all(v.shape == (4, 64) for v in st.batch.values())


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="batch_size_warmup.ramp='cubic'"):
        BatchSizeWarmup(ramp="cubic")
    with pytest.raises(ConfigError, match="batch_size_warmup.duration_tokens=0"):
        BatchSizeWarmup(duration_tokens=0)
    cfg = SimpleNamespace(trainer=SimpleNamespace(global_batch_size=8), data=SimpleNamespace(mixture=[]))
    with pytest.raises(ConfigError, match="start_global_batch_size=32 exceeds trainer.global_batch_size=8"):
        BatchSizeWarmup(start_global_batch_size=32).check(CheckContext(SimpleNamespace(cfg=cfg), []))


def train(out: Path, name: str, *extra: str) -> Path:
    assert main(["train", DEMO, *BASE, RAMP, f"run.output_dir={out}", f"run.name={name}", *extra]) == 0
    return out / name


def series(run_dir: Path, key: str) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in recs if key in r}


@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("bsw"), "ramp")


def test_a_run_trains_the_ramp_with_tokens_and_lr_on_tokens(ramp_run):
    assert [series(ramp_run, "train/global_batch_size")[s] for s in range(1, 9)] == HAND
    tokens = series(ramp_run, "train/tokens_seen")  # counted by the module from the trained inputs
    assert [tokens[s] for s in range(1, 9)] == [64 * sum(HAND[:s]) for s in range(1, 9)]
    w = BatchSizeWarmup(start_global_batch_size=4, duration_tokens=40 * 64)
    w.configure(2, 1, 16, 64)
    lr = series(ramp_run, "train/lr")
    hand = [3e-3 * lr_multiplier(w.schedule_position(s - 1, 8), name="cosine", max_steps=8,
                                 warmup_steps=2, min_lr_ratio=0.1) for s in range(1, 9)]
    assert [lr[s] for s in range(1, 9)] == pytest.approx(hand, rel=1e-6)
    assert lr[3] != pytest.approx(3e-3 * lr_multiplier(2, name="cosine", max_steps=8, warmup_steps=2,
                                                       min_lr_ratio=0.1))  # not the step schedule


def test_sigkill_in_the_middle_of_the_ramp_then_resume_auto_is_bit_exact(ramp_run):
    out = ramp_run.parent
    killed = run_cli("train", DEMO, *BASE, RAMP, f"run.output_dir={out}", "run.name=killed",
                     "callbacks=[{name: tests.helpers.killers.KillAt, step: 5}]", cwd=REPO)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (out / "killed" / "checkpoints").iterdir()) == ["step_00000003"]
    resumed = train(out, "killed", "checkpoint.resume=auto")
    for key in ("train/loss", "train/lr", "train/global_batch_size", "train/grad_norm", "train/tokens_seen"):
        a, b = series(ramp_run, key), series(resumed, key)
        assert sorted(b) == list(range(1, 9)) and a == b, (key, a, b)
    wa = load_for_inference(ramp_run)[0].state_dict()
    wb = load_for_inference(resumed)[0].state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
