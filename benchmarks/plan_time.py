"""Scale on the CPU: how long ``llmforge plan`` takes, and the analytic ``--dry-run`` estimate
against the simulation for every shipped yaml.

    python benchmarks/plan_time.py plan yamls/llama3_405b.yaml --gpus 512 [--gpu NAME] [key=value ...]
    python benchmarks/plan_time.py estimates [yamls/X.yaml ...]      # default: every yamls/*.yaml
    python benchmarks/plan_time.py --smoke

``plan`` prints wall and CPU seconds (user + system of this process: the idle-machine figure on
a shared machine) of one plan, and the winner. ``estimates`` simulates each yaml at its own
world size (``trainer.devices x trainer.num_nodes``) and layout (its strategy, its activation
checkpointing entry; compile left out) and prints the simulated peak per rank beside the
analytic estimate (:func:`llmforge.models.memory_estimate.analytic_peak`; for a LoRA yaml the
adapter plugin's own estimate, which the dry run prints instead) and the relative error.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from llmforge.config import load_config  # noqa: E402
from llmforge.models.memory_estimate import GIB, analytic_peak  # noqa: E402
from llmforge.parallel.mesh import ParallelDims  # noqa: E402
from llmforge.planning.gpus import gpu_kind  # noqa: E402
from llmforge.planning.planner import plan  # noqa: E402
from llmforge.planning.depth import simulate_scaled  # noqa: E402
from llmforge.planning.layout import KEEP_AC, Layout  # noqa: E402
from llmforge.config.validate import validate  # noqa: E402

SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64",
         "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_plan(config: str, gpus: int, gpu: str, overrides: list[str]) -> None:
    cfg = load_config(config, overrides)
    w0, c0 = time.perf_counter(), cpu_seconds()
    p = plan(cfg, gpus, gpu_kind(gpu))
    wall, cpu = time.perf_counter() - w0, cpu_seconds() - c0
    c = p.chosen
    win = ("nothing fits" if c is None else
           f"dp_replicate {c.layout.dp_replicate} x dp_shard {c.layout.dp_shard} x tp {c.layout.tp} "
           f"x pp {c.layout.pp}, "
           f"AC {c.layout.activation_checkpointing}, mbs {c.layout.micro_batch_size}, "
           f"{c.peak_bytes / GIB:.1f} GiB, {c.tokens_per_second_per_gpu:.0f} tok/s/GPU, MFU {c.mfu:.1%}")
    print(f"plan {config} --gpus {gpus} --gpu {gpu}: {wall:.1f} s wall, {cpu:.1f} s CPU "
          f"(load average {os.getloadavg()[0]:.1f}); {len(p.references)} groups simulated; {win}")


def lora_estimate(cfg, batch) -> float:
    """The adapter plugin's estimate (what the dry run prints for a LoRA yaml)."""
    import torch

    from llmforge.algorithms.lora.memory import lora_memory, parameter_counts
    from llmforge.algorithms.loading import build_algorithms
    from llmforge.plugin import meta_model

    lora = next(a for a in build_algorithms(cfg) if a.name == "lora")
    model = lora.convert(meta_model(cfg), cfg.run.seed)
    trainable, frozen = parameter_counts(model)
    return lora_memory(cfg, batch, model, trainable, frozen, getattr(torch, lora.base_dtype_name)).total_bytes


def estimates(configs: list[str], overrides: list[str]) -> None:
    print(f"{'yaml':<28} {'world':>5} {'layout':>16} {'simulated GiB':>14} {'analytic GiB':>13} "
          f"{'error':>7} {'CPU s':>6}")
    for config in configs:
        cfg = load_config(config, overrides)
        world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
        if cfg.strategy.name == "auto":
            cfg.strategy.name = "fsdp2" if world > 1 else "single"
        batch = validate(cfg, world)
        dims = ParallelDims.from_config(cfg, world)
        c0 = cpu_seconds()
        try:
            m = simulate_scaled(cfg, Layout(dims.dp_replicate, dims.dp_shard, dims.tp, KEEP_AC,
                                            batch.micro_batch_size))
        except Exception as exc:  # e.g. grouped_mm's fake kernel refuses fp32 (MoE in fp32)
            print(f"{Path(config).name:<28} {world:>5} not simulated: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:120]}", flush=True)
            continue
        cpu = cpu_seconds() - c0
        lora = any(a.get("name") == "lora" for a in cfg.algorithms)
        est = lora_estimate(cfg, batch) if lora else analytic_peak(cfg, batch, dims)["total"]
        lay = f"{dims.dp_replicate}x{dims.dp_shard}x{dims.tp} mbs{batch.micro_batch_size}"
        print(f"{Path(config).name:<28} {world:>5} {lay:>16} {m.peak_bytes / GIB:>14.2f} "
              f"{est / GIB:>13.2f} {(est - m.peak_bytes) / m.peak_bytes:>+7.1%} {cpu:>6.1f}"
              f"{'  (adapter estimate)' if lora else ''}", flush=True)
        print("    simulated: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in m.breakdown.items()))
        if not lora:
            a = analytic_peak(cfg, batch, dims)
            print("    analytic:  " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in a.items() if k != "total"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny demo config, both commands")
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("plan")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="H100-SXM-80GB")
    e = sub.add_parser("estimates")
    e.add_argument("configs", nargs="*")
    args = ap.parse_args()
    if args.smoke:
        demo = str(REPO / "yamls" / "demo_cpu.yaml")
        time_plan(demo, 2, "H100-SXM-80GB", SMOKE)
        estimates([demo], SMOKE)
    elif args.cmd == "plan":
        time_plan(args.config, args.gpus, args.gpu, args.overrides)
    elif args.cmd == "estimates":
        estimates(args.configs or sorted(str(p) for p in (REPO / "yamls").glob("*.yaml")), [])
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
