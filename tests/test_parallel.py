"""Distributed strategies on real processes (gloo, CPU): the same training at every world size.

Llama under DDP, FSDP2, FSDP2 x TP and HSDP; Qwen3 (tied embeddings, per-head QK-norm: the TP
plan's QK-norm gradient reduction) and the research model of examples/parallel_block_tp.yaml
under FSDP2 x TP: the losses, gradient norms and final weights of one process. The one-process
references run in this process; every parallel run is `llmforge train` (its CLI entry point,
Lightning's real process management, nothing of torch.distributed mocked) in ONE 4-process
torchrun launch whose worker (tests/dist/train_worker.py) runs them in sequence: each launch
costs ~8 s of imports per process. DDP and plain FSDP2 use micro-batch 1 there, so both still
accumulate gradients over 2 micro-batches per rank (as on 2 processes before).

TP alone on a 1-D mesh is not repeated here: test_sft.py runs it (tp 2, 2 processes). HSDP is
not repeated for Qwen3: replication wraps the same per-block FSDP2 units whatever the family.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO, REPO, TINY_OVERRIDES
from llmforge.cli import main
from helpers.dist import torchrun, worker
from test_qwen3 import QWEN_DEMO, QWEN_TINY

COMMON = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
          "trainer.max_steps=5", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.eval_batches=2", "scheduler.warmup_steps=2",
          # Adam divides by sqrt(v) + eps: with eps 1e-8, an embedding row whose gradient is
          # ~1e-8 (a token seen once, far from the loss) turns reduction-order noise into an
          # lr-sized step (one row off by 1.4e-4 after 5 steps under FSDP2 x TP); 1e-6 keeps the
          # comparison about the parallel math rather than about that amplification
          "optimizer.eps=1e-6"]
QWEN_COMMON = [o for o in COMMON if not o.startswith("model.")] + [
    o for o in QWEN_TINY if o.startswith("model.")]
# 6 of Shakespeare's 42 texts: every process of every run tokenizes its data (all 42: ~4.5 s of
# CPU each time, 27 times here); 5 steps read 2,560 of their ~200,000 tokens
DATA = ["data.max_documents=6"]
EXAMPLE = str(REPO / "examples" / "parallel_block_tp.yaml")
FSDP2_TP2 = ["strategy.name=fsdp2", "strategy.tp=2"]
REFERENCES = {  # name: (yaml, overrides); one process, in this process
    "single": (DEMO, COMMON + DATA),
    "qwen3_single": (QWEN_DEMO, QWEN_COMMON + DATA),
    "example_single": (EXAMPLE, COMMON + DATA + ["strategy.tp=1", "strategy.name=auto"]),
}
PARALLEL = {  # name: (yaml, overrides, its reference); 4 processes, one launch, in this order
    "ddp": (DEMO, COMMON + DATA + ["strategy.name=ddp", "trainer.micro_batch_size=1"], "single"),
    "fsdp2": (DEMO, COMMON + DATA + ["strategy.name=fsdp2", "trainer.micro_batch_size=1"], "single"),
    "fsdp2_tp2": (DEMO, COMMON + DATA + FSDP2_TP2, "single"),
    "hsdp2x2": (DEMO, COMMON + DATA + ["strategy.name=fsdp2", "strategy.dp_replicate=2"], "single"),
    "qwen3_fsdp2_tp2": (QWEN_DEMO, QWEN_COMMON + DATA + FSDP2_TP2, "qwen3_single"),
    "example_fsdp2_tp2": (EXAMPLE, COMMON + DATA, "example_single"),  # the YAML's own fsdp2 + tp 2
}
WRONG_MESH = ["strategy.name=fsdp2", "strategy.dp_shard=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The run folders by name, and every rank's report of the launch (exit code, output)."""
    out = tmp_path_factory.mktemp("parallel")
    for name, (yaml, extra) in REFERENCES.items():
        assert main(["train", yaml, *extra, f"run.output_dir={out}", f"run.name={name}"]) == 0, name
    argv = {"fail_wrong_mesh": ["train", DEMO, *COMMON, *WRONG_MESH, f"run.output_dir={out}"]}
    for name, (yaml, extra, _) in PARALLEL.items():
        argv[name] = ["train", yaml, *extra, f"run.output_dir={out}", f"run.name={name}"]
    (out / "runs.json").write_text(json.dumps(argv))
    proc = torchrun(worker("train_worker.py"), str(out), str(out / "runs.json"), nproc=4, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return out, reports


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
@pytest.mark.parametrize("name", list(PARALLEL))
def test_parallel_run_equals_one_process(runs, name):
    out, _ = runs
    ref = out / PARALLEL[name][2]
    assert len(losses(ref)) == 5
    assert losses(out / name) == pytest.approx(losses(ref), abs=1e-5)
    assert grad_norms(out / name) == pytest.approx(grad_norms(ref), abs=1e-5)
    want, got = final_weights(ref), final_weights(out / name)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0, msg=f"{name}: {k}")


def test_wrong_mesh_fails_fast_with_exit_2(tmp_path, capsys):
    """`--nproc 2` checks the mesh in the launcher, before any worker starts (in this process)."""
    code = main(["train", DEMO, *COMMON, *WRONG_MESH, f"run.output_dir={tmp_path}", "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "strategy.dp_shard (3)" in err and "world size (2)" in err
    assert not any(tmp_path.iterdir())  # nothing was started or written


@pytest.mark.slow
def test_wrong_mesh_under_torchrun_errors_on_every_rank(runs):
    """Under torchrun (no launcher check before) every rank says what is wrong, exit 2."""
    _, reports = runs
    for rank in reports:
        got = rank["fail_wrong_mesh"]
        assert got["code"] == 2 and "Traceback" not in got["stderr"]
        assert got["stderr"].count("error: strategy.dp_replicate (1) x strategy.dp_shard (3)") == 1
        assert "world size (4)" in got["stderr"]
