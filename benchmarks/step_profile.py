"""Where one optimizer step's CPU time goes: llmforge against a peer, same work, under torch.profiler.

    python benchmarks/step_profile.py                                   # llmforge vs LitGPT, compiled
    python benchmarks/step_profile.py --variants llmforge:eager,lightning:eager
    python benchmarks/step_profile.py --llmforge-compile '{name: compile, per_block: false}'
    python benchmarks/step_profile.py --smoke                           # tiny, eager, llmforge vs lightning
    python benchmarks/step_profile.py --shapes aten::mm,aten::addmm     # also those ops by input shapes

Each variant is one run of ``benchmarks/peers.py``'s worker (the demo model, data, batch,
optimizer; llmforge compiled = ``algorithms=[<--llmforge-compile>]``, LitGPT compiled = its
whole-model ``torch.compile``) in a fresh subprocess with the same ``OMP_NUM_THREADS``. A global
``torch.optim`` step post-hook starts ``torch.profiler`` (CPU activities, no stacks; input
shapes only with ``--shapes``, which makes every op cost more) after the
``--warmup``-th optimizer step and stops it after the last, so the window is the
timed span of ``peers.py``: steps, the loop and everything the trainer does between them.

Printed per variant: process CPU seconds per step (``time.process_time``, all threads: unlike
wall time it hardly moves with the machine's load), wall seconds per step, and the profiler's
self CPU time per step of the top operators, side by side, with the difference. Reading it:
``aten::*`` rows are the model's and optimizer's kernels (equal work should give equal rows);
``## Call CompiledFxGraph`` / ``CompiledFunction*`` rows hold inductor's fused kernels; rows
that only one side has are that trainer's own host work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import REPO, SMOKE  # noqa: E402

TOP = 22  # operators per variant in the table


def worker(variant: str, overrides: list[str], steps: int, warmup: int, shapes: str = "") -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import peers

    trainer, mode = variant.split(":")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=bool(shapes))
    marks: list[tuple[float, float]] = []

    def on_step(*args, **kwargs) -> None:
        marks.append((time.perf_counter(), time.process_time()))
        if len(marks) == warmup:
            prof.start()
        elif len(marks) == steps:
            prof.stop()

    register_optimizer_step_post_hook(on_step)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if trainer == "llmforge":
            peers.worker_llmforge(overrides, steps, warmup, work)
        elif trainer == "lightning":
            peers.worker_lightning(overrides, steps, warmup, work)
        else:
            peers.worker_litgpt(overrides, steps, warmup, work, mode == "compiled")
    n = steps - warmup
    rows = sorted(((e.key, e.self_cpu_time_total / 1e6 / n, e.count / n)
                   for e in prof.key_averages()), key=lambda r: -r[1])
    by_shape = sorted(((e.key, str(e.input_shapes), e.self_cpu_time_total / 1e6 / n, e.count / n)
                       for e in prof.key_averages(group_by_input_shape=True)
                       if e.key in shapes.split(",")), key=lambda r: -r[2]) if shapes else []
    return {"cpu_s_per_step": (marks[-1][1] - marks[warmup - 1][1]) / n,
            "wall_s_per_step": (marks[-1][0] - marks[warmup - 1][0]) / n,
            "profiled_cpu_s_per_step": sum(r[1] for r in rows), "ops": rows, "by_shape": by_shape}


def run(variant: str, overrides: list[str], steps: int, warmup: int, threads: int,
        shapes: str = "") -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--steps", str(steps), "--warmup",
           str(warmup), "--overrides", json.dumps(overrides), "--shapes", shapes]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="llmforge:compiled,litgpt:compiled",
                    help="comma-separated trainer:mode (trainer llmforge, lightning, litgpt; "
                         "mode eager or compiled); the first is compared with each other")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()))
    ap.add_argument("--llmforge-compile", default="{name: compile}", metavar="YAML",
                    help="the algorithm entry of llmforge's compiled variant")
    ap.add_argument("--shapes", default="", metavar="OPS",
                    help="also list these operators' time by input shapes, e.g. aten::mm,aten::addmm")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # no harness import of HF datasets (peers.worker_main says why)
        print(json.dumps(worker(args.worker, json.loads(args.overrides), args.steps, args.warmup,
                                args.shapes)))
        return 0
    if not 1 <= args.warmup < args.steps:
        ap.error(f"need 1 <= --warmup < --steps; got {args.warmup} and {args.steps}")
    base = ["trainer.eval_batches=1"] + (SMOKE + ["data.max_documents=8"] if args.smoke else [])
    if args.smoke:
        args.variants, args.steps, args.warmup, args.threads = "llmforge:eager,lightning:eager", 4, 2, 1
    variants = [v for v in args.variants.split(",") if v]
    out = {}
    for v in variants:
        extra = [f"algorithms=[{args.llmforge_compile}]"] if v == "llmforge:compiled" else []
        out[v] = run(v, base + extra, args.steps, args.warmup, args.threads, args.shapes)
    print(f"model: {'smoke' if args.smoke else 'demo'}; {args.steps - args.warmup} profiled steps "
          f"after {args.warmup}; OMP_NUM_THREADS={args.threads}; llmforge compiled = "
          f"algorithms=[{args.llmforge_compile}]; load average {os.getloadavg()[0]:.1f}")
    for v, r in out.items():
        print(f"{v:20s} CPU {r['cpu_s_per_step']:.3f} s/step (profiled self CPU "
              f"{r['profiled_cpu_s_per_step']:.3f}), wall {r['wall_s_per_step']:.3f} s/step")
    ref = variants[0]
    for v in variants[1:]:
        print(f"CPU per step {ref} / {v}: {out[ref]['cpu_s_per_step'] / out[v]['cpu_s_per_step']:.3f}")
        a = {k: (t, c) for k, t, c in out[ref]["ops"]}
        b = {k: (t, c) for k, t, c in out[v]["ops"]}
        keys = sorted(set([k for k, *_ in out[ref]["ops"][:TOP]] + [k for k, *_ in out[v]["ops"][:TOP]]),
                      key=lambda k: -max(a.get(k, (0, 0))[0], b.get(k, (0, 0))[0]))
        print(f"\nself CPU ms per step (calls per step)   {ref:>22s} {v:>22s}   difference")
        for k in keys:
            (ta, ca), (tb, cb) = a.get(k, (0.0, 0.0)), b.get(k, (0.0, 0.0))
            print(f"  {k[:44]:44s} {ta * 1e3:9.1f} ({ca:6.1f}) {tb * 1e3:9.1f} ({cb:6.1f}) {(ta - tb) * 1e3:+9.1f}")
        rest_a = sum(t for k, t, _ in out[ref]["ops"] if k not in keys)
        rest_b = sum(t for k, t, _ in out[v]["ops"] if k not in keys)
        print(f"  {'(all other operators)':44s} {rest_a * 1e3:9.1f}          {rest_b * 1e3:9.1f}          "
              f"{(rest_a - rest_b) * 1e3:+9.1f}")
    for v, r in out.items():
        if r["by_shape"]:
            print(f"\n{v}: self CPU ms per step (calls per step) by input shapes")
            for key, shape, t, c in r["by_shape"]:
                print(f"  {key:14s} {t * 1e3:8.1f} ({c:5.1f})  {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
