"""`llmforge plan` of every shipped GPU yaml at its real world size: the 8B on 8 and 64 H100,
the 70B on 256, the 405B on 512, the Qwen3-0.6B SFT yaml on its one GPU (6-35 s of CPU each)
and the seeds' 405B LoRA setup (about 22 s per plan). The simulation completes and the winner
fits; the answers and times are in docs/scale.md (``benchmarks/plan_time.py``). And the dry
run's analytic estimate against the simulation, for the yamls that simulate in seconds."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from conftest import REPO

from llmforge import cli
from llmforge.planning.published import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, unmeasured_degrees

YAMLS = REPO / "yamls"


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _plan(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_405b_lora_fits_8_mi300x_and_not_8_h100(capsys):
    """The Felafax seed: Llama 3.1 405B LoRA in bf16 on 8 x MI300X (192 GB) fits, with FSDP 8 and
    full activation checkpointing (135.9 GiB simulated against 160.9 usable); on 8 x H100 80 GB
    nothing fits and the error gives the smallest GPU count that would (32)."""
    chosen = _plan(capsys, str(YAMLS / "llama3_405b_lora.yaml"), "--gpus", "8", "--gpu", "MI300X")["chosen"]
    assert chosen["fits"] and (chosen["dp_shard"], chosen["tp"], chosen["pp"]) == (8, 1, 1)
    assert chosen["activation_checkpointing"] == "full"
    assert 120 * 2**30 < chosen["peak_bytes_per_rank"] < 0.9 * 192e9
    assert cli.main(["plan", str(YAMLS / "llama3_405b_lora.yaml"), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "no layout fits in H100-SXM-80GB memory on 8 GPUs" in err
    assert "the smallest GPU count that would fit is 32" in err


@pytest.mark.parametrize("yaml, gpus", [("llama3_8b.yaml", 8), ("llama3_8b.yaml", 64),
                                        ("llama3_70b.yaml", 256), ("llama3_405b.yaml", 512),
                                        ("qwen3_0_6b_sft.yaml", 1)])
def test_shipped_yaml_plans_and_fits(capsys, yaml, gpus):
    """The winner was simulated with its own degrees and fits in 90 % of an H100's 80 GB; its
    degrees make up the GPU count."""
    out = _plan(capsys, str(YAMLS / yaml), "--gpus", str(gpus))
    chosen = out["chosen"]
    assert chosen["fits"] and chosen["simulated"], chosen
    assert 0 < chosen["peak_bytes_per_rank"] <= 0.9 * 80e9
    assert chosen["dp_replicate"] * chosen["dp_shard"] * chosen["tp"] * chosen["pp"] == gpus
    # the explanation says when no published run of the model's size used the winner's degrees
    shape = {"llama3_8b.yaml": LLAMA3_8B, "llama3_70b.yaml": LLAMA3_70B, "llama3_405b.yaml": LLAMA3_405B}.get(yaml)
    if shape is not None:
        said = unmeasured_degrees(shape, chosen["tp"], chosen["pp"], chosen["cp"], chosen["dp_replicate"])
        assert out["why"][0].startswith("winner: ")
        assert (f"winner's degrees: {said}" in out["why"]) if said else \
            not any(w.startswith("winner's degrees") for w in out["why"]), out["why"]
    if (yaml, gpus) == ("llama3_8b.yaml", 8):  # the yaml's FSDP 8, selective AC, mbs 1 beside the winner
        assert any("this config's layout" in w for w in out["why"]), out["why"]



@pytest.mark.parametrize("yaml", ["demo_cpu.yaml", "demo_cpu_fast.yaml", "demo_cpu_qwen3.yaml",
                                  "demo_cpu_qwen3_moe.yaml", "qwen3_0_6b_sft.yaml", "llama3_8b.yaml"])
def test_analytic_estimate_within_10_percent_of_the_simulation(yaml):
    """The dry run's analytic peak per rank against the simulation of the yaml at its own world
    size and layout (issue 29). The 70B, 405B and LoRA yamls, which take 40-180 s of CPU each,
    are measured by ``benchmarks/plan_time.py estimates`` and ``--dry-run --simulate``
    (docs/scale.md: every shipped yaml within 10 %)."""
    from llmforge.config import load_config
    from llmforge.config.validate import validate
    from llmforge.models.memory_estimate import analytic_peak
    from llmforge.parallel.mesh import ParallelDims
    from llmforge.planning.depth import simulate_scaled
    from llmforge.planning.layout import KEEP_AC, Layout

    cfg = load_config(YAMLS / yaml)
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    if cfg.strategy.name == "auto":
        cfg.strategy.name = "fsdp2" if world > 1 else "single"
    batch = validate(cfg, world)
    dims = ParallelDims.from_config(cfg, world)
    m = simulate_scaled(cfg, Layout(dims.dp_replicate, dims.dp_shard, dims.tp, KEEP_AC,
                                    batch.micro_batch_size))
    est = analytic_peak(cfg, batch, dims)["total"]
    assert abs(est - m.peak_bytes) <= 0.10 * m.peak_bytes, (est / 2**30, m.peak_bytes / 2**30)
