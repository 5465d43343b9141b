"""The simulation (fake process group, fake tensors) against real gloo runs, shipped yamls at their
world size, and ``llmforge plan``'s bad input. See docs/scale.md."""

import json

import pytest
import torch.distributed as dist
from conftest import REPO
from helpers.dist import torchrun, worker

from llmforge import cli
from llmforge.config import load_config
from llmforge.planning.simulate import Layout, simulate, simulate_scaled

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
DEMO = str(REPO / "yamls" / "demo_cpu.yaml")


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_simulated_peak_within_5_percent_of_real_gloo_fsdp2(tmp_path):
    """2 real processes (gloo, FSDP2, 2 micro-batches of accumulation) measured by the tracker,
    against the simulation of rank 0 on a fake process group with fake tensors."""
    out = tmp_path / "real.json"
    proc = torchrun(worker("simulate_worker.py"), str(out), DEMO, "2", "1", "none", "2", *TINY)
    assert proc.returncode == 0, proc.stderr[-4000:]
    real = json.loads(out.read_text())
    sim = simulate(load_config(DEMO, TINY), Layout(1, 2, 1, "none", 2))
    assert real["peak_bytes_per_rank"] > 1e5
    assert abs(sim.peak_bytes - real["peak_bytes_per_rank"]) <= 0.05 * real["peak_bytes_per_rank"]
    assert sim.breakdown["optimizer"] == pytest.approx(real["breakdown"]["optimizer"], rel=0.05)
    kinds = {(c.kind, c.mesh_dim) for c in sim.collectives}
    assert {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard")} <= kinds
    assert sim.flops == pytest.approx(real["flops_per_rank"], rel=1e-6)


def test_scaling_by_layer_count_matches_full_depth():
    """2- and 3-block simulations extrapolated to 4 blocks equal the 4-block simulation (the
    peak stays in the same phase of the step; docs/scale.md gives a case where it does not)."""
    cfg = load_config(DEMO, TINY)
    lo = Layout(1, 4, 2, "full", 2)
    full = simulate(cfg, lo, n_layers=4)
    scaled = simulate_scaled(cfg, lo, full_depth=4)
    assert scaled.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-3)
    assert scaled.breakdown["optimizer"] == pytest.approx(full.breakdown["optimizer"], rel=1e-3)
    assert scaled.flops == pytest.approx(full.flops, rel=1e-6)


def test_unknown_gpu_lists_known_ones(capsys):
    assert cli.main(["plan", DEMO, "--gpus", "8", "--gpu", "V100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --gpu: unknown GPU kind 'V100'") and "H100-SXM-80GB" in err
    assert "MI300X-192GB" in err and "Traceback" not in err


def test_world_size_that_divides_nothing_names_key_and_nearest_sizes(capsys):
    # 6 GPUs: tp 1 (dp 6) and tp 2 (dp 3) do not divide 8 sequences; tp 3, 6 do not divide a node
    assert cli.main(["plan", DEMO, *TINY, "--gpus", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --gpus 6: no layout divides trainer.global_batch_size=8")
    assert err.endswith("nearest GPU counts that do: 4, 8")


def test_heads_not_divisible_by_tp_names_the_key(capsys):
    # 8 GPUs, batch 2: only tp 4 or 8 would divide it, and 2 key/value heads refuse both
    assert cli.main(["plan", DEMO, *TINY, "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
                     "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "tp=4 refused" in err and "n_kv_heads" in err and "nearest GPU counts that do: 2, 4" in err


def test_layout_that_fits_nowhere_gives_smallest_gpu_count(capsys):
    """A 3-block model with dim 8192 and a 128K vocabulary (4.6B parameters, 74 GB of fp32 state
    with AdamW) on one A100 80GB: nothing fits; two GPUs would."""
    big = [*TINY, "model.dim=8192", "model.n_layers=3", "model.n_heads=64", "model.n_kv_heads=8",
           "model.multiple_of=1024", "tokenizer.vocab_size=128256", "trainer.global_batch_size=2",
           "trainer.micro_batch_size=1", "strategy.name=fsdp2"]
    assert cli.main(["plan", DEMO, *big, "--gpus", "1", "--gpu", "a100", "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["chosen"] is None and out["smallest_fitting_gpus"] == 2
    assert "the smallest GPU count that would fit is 2" in captured.err
    assert all(c["status"] in ("does not fit", "does not divide") for c in out["candidates"])
