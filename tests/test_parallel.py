"""Distributed strategies on real processes (gloo, CPU): the same training at every world size.

Every run goes through the CLI (`--nproc N` = torchrun's launcher), so Lightning's process
management is the real one; nothing of torch.distributed is mocked.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO, TINY_OVERRIDES, run_cli
from llmforge.cli import main
from helpers.dist import torchrun

COMMON = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
          "trainer.max_steps=5", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.eval_batches=2", "scheduler.warmup_steps=2",
          # Adam divides by sqrt(v) + eps: with eps 1e-8, an embedding row whose gradient is
          # ~1e-8 (a token seen once, far from the loss) turns reduction-order noise into an
          # lr-sized step (one row off by 1.4e-4 after 5 steps under FSDP2 x TP); 1e-6 keeps the
          # comparison about the parallel math rather than about that amplification
          "optimizer.eps=1e-6"]
# TP alone on 2 processes is not repeated here: fsdp2_tp2 runs the same TP plan on a 2-D mesh,
# and test_qwen3_parallel.py (examples/ model, tp 2) and test_sft.py (tp 2) run it on 2 processes
RUNS = {
    "single": ([], 1),
    "ddp2": (["strategy.name=ddp"], 2),
    "fsdp2": (["strategy.name=fsdp2"], 2),
    "fsdp2_tp2": (["strategy.name=fsdp2", "strategy.tp=2"], 4),
    "hsdp2x2": (["strategy.name=fsdp2", "strategy.dp_replicate=2"], 4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    results = {}
    for name, (extra, nproc) in RUNS.items():
        args = ["train", DEMO, *COMMON, *extra, f"run.output_dir={out}", f"run.name={name}"]
        if nproc == 1:  # the reference in this process (no interpreter start)
            assert main(args) == 0, name
        else:
            proc = run_cli(*args, "--nproc", str(nproc), timeout=900)
            assert proc.returncode == 0, (name, proc.stderr[-4000:])
        results[name] = out / name
    return results


def losses(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in recs if "train/loss" in r]


def grad_norms(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/grad_norm"] for r in recs if "train/grad_norm" in r]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from llmforge.checkpoint.run_dir import load_for_inference

    model, _, _ = load_for_inference(run_dir, trust_code=True)  # the tests' own runs (examples/ code too)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_same_losses_and_weights_at_every_world_size(runs):
    ref_losses, ref_norms = losses(runs["single"]), grad_norms(runs["single"])
    ref_w = final_weights(runs["single"])
    assert len(ref_losses) == 5
    for name in RUNS:
        if name == "single":
            continue
        got = losses(runs[name])
        assert got == pytest.approx(ref_losses, abs=1e-5), name
        assert grad_norms(runs[name]) == pytest.approx(ref_norms, abs=1e-5), name
        w = final_weights(runs[name])
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], atol=1e-4, rtol=0, msg=f"{name}: {k}")


@pytest.mark.slow
def test_wrong_mesh_fails_fast_with_exit_2(tmp_path):
    proc = run_cli("train", DEMO, *COMMON, "strategy.name=fsdp2", "strategy.dp_shard=3",
                   f"run.output_dir={tmp_path}", "--nproc", "2", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "strategy.dp_shard (3)" in proc.stderr and "world size (2)" in proc.stderr


@pytest.mark.slow
def test_wrong_mesh_under_torchrun_errors_on_every_rank(tmp_path):

    # torchrun stops the other workers as soon as it sees one fail (it polls every 0.1 s): give
    # the slower rank time to print its own error, which is what this test looks for
    proc = torchrun("-m", "llmforge", "train", DEMO, *COMMON, "strategy.name=fsdp2", "strategy.dp_shard=3",
                    f"run.output_dir={tmp_path}", timeout=120, launcher_args=("--monitor-interval", "5"))
    assert proc.returncode != 0
    assert proc.stderr.count("error: strategy.dp_replicate (1) x strategy.dp_shard (3)") == 2
