"""Qwen3 (tied embeddings, per-head QK-norm) and the research model of examples/ under tensor
parallelism on real gloo processes: the losses, gradient norms and final weights of one process.

Two launches in all: Qwen3 FSDP2 x TP (4 processes: dp_shard 2 x tp 2, so the TP plan with
its QK-norm gradient reduction and FSDP2 on a 2-D mesh) and examples/parallel_block_tp.yaml
(2 processes, tp 2). The one-process references run in this process. HSDP is not repeated for
Qwen3: replication wraps the same per-block FSDP2 units whatever the family, and
tests/test_parallel.py proves it on 4 processes.
"""

import pytest
import torch

from conftest import REPO, run_cli
from llmforge.cli import main
from test_parallel import COMMON, final_weights, grad_norms, losses
from test_qwen3 import QWEN_DEMO, QWEN_TINY

QWEN_COMMON = [o for o in COMMON if not o.startswith("model.")] + [
    o for o in QWEN_TINY if o.startswith("model.")]
EXAMPLE = str(REPO / "examples" / "parallel_block_tp.yaml")
RUNS = {  # name: (yaml, overrides, processes)
    "qwen3_fsdp2_tp2": (QWEN_DEMO, QWEN_COMMON + ["strategy.name=fsdp2", "strategy.tp=2"], 4),
    "example_tp2": (EXAMPLE, COMMON, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_parallel")
    for name, yaml, extra in (("qwen3_single", QWEN_DEMO, QWEN_COMMON),
                              ("example_single", EXAMPLE, COMMON + ["strategy.tp=1", "strategy.name=auto"])):
        assert main(["train", yaml, *extra, f"run.output_dir={out}", f"run.name={name}"]) == 0
    for name, (yaml, extra, nproc) in RUNS.items():
        proc = run_cli("train", yaml, *extra, f"run.output_dir={out}", f"run.name={name}",
                       "--nproc", str(nproc), cwd=REPO, timeout=900)
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_parallel_run_equals_one_process(runs, name):
    ref = runs / ("example_single" if name.startswith("example") else "qwen3_single")
    assert len(losses(ref)) == 5
    assert losses(runs / name) == pytest.approx(losses(ref), abs=1e-5)
    assert grad_norms(runs / name) == pytest.approx(grad_norms(ref), abs=1e-5)
    want, got = final_weights(ref), final_weights(runs / name)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0, msg=f"{name}: {k}")
