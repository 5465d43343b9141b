"""Compute threads per process: llmforge's choice against the alternatives, side by side.

    python benchmarks/threads.py             # the machine as it is (~2 min on 2 idle cores)
    python benchmarks/threads.py --burner    # beside one CPU-burning process (a loaded machine)
    python benchmarks/threads.py --rounds 3  # more rounds, less noise (3x the time)
    python benchmarks/threads.py --smoke     # tiny, for the test suite

Trains the demo (yamls/demo_cpu.yaml: model, batch, seq_len and data worker as the quick start;
``data.max_documents=8`` so a start tokenizes 8 plays, not 42: the steps cost the same) for
``--steps`` steps in a fresh subprocess per variant, interleaved (one of each per round), and
measures tokens/s over the steps after ``--warmup``. Variants:

- "default": ``trainer.num_threads: null``, :func:`llmforge.parallel.threads.choose_num_threads`
  (the cores less those other processes keep busy when it starts; the demo's data worker slices
  windows in memory and takes no core);
- "N threads": one thread per core whatever else runs (torch's own default; N = the cores);
- "no worker": ``data.num_workers=0`` with llmforge's choice;
- "old rule": the rule before issue 27, the cores less one per data worker (1 thread on 2 cores).

``--burner`` runs the same beside one CPU-burning process and leaves out "N threads" (there it
took 5.9x the time of 1 thread: minutes per run). Prints each run's threads, tokens/s and the
1-minute load average before it; then the medians, their ratios to the best, and one summary
line ``default/best ... default/old rule ...`` with the load averages and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from overhead import DEMO, SMOKE  # noqa: E402

# every variant trains the same steps on the same data: 8 plays tokenize in a fraction of the
# 42's time and still hold more windows than the steps read (train/eval sizes do not matter here)
FAST_START = ["data.max_documents=8"]


def worker(overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    """Train ``steps`` steps; tokens/s over the steps after ``warmup``, the threads used and why."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from llmforge import Trainer, load_config

    cfg = load_config(DEMO, [*overrides, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                             "trainer.progress_bar=false", "scheduler.warmup_steps=1",
                             f"run.output_dir={work}", "checkpoint.save_final=false"])
    marks: dict[int, float] = {}

    class Clock(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks[trainer.global_step] = time.perf_counter()

    trainer = Trainer(cfg, overwrite=True)
    trainer.setup()
    trainer.lightning.callbacks.append(Clock())
    trainer.lightning.fit(trainer.module, datamodule=trainer.datamodule)
    seconds = marks[steps] - marks[warmup]
    return {"tokens_per_second": (steps - warmup) * trainer.plan.tokens_per_step / seconds,
            "threads": torch.get_num_threads(), "why": trainer.run.threads_reason}


def run(overrides: list[str], steps: int, warmup: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--steps", str(steps), "--warmup", str(warmup),
           "--overrides", json.dumps(overrides)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO / "src")})
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def burner() -> subprocess.Popen:
    """A process that keeps one core busy (pure Python spin) until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def variants(cores: int, smoke: bool, burning: bool) -> dict[str, list[str]]:
    """name -> overrides (the demo has one data worker)."""
    out = {"default": [], "no worker": ["data.num_workers=0"]}
    if smoke:
        return out
    if not burning:
        out[f"{cores} threads"] = [f"trainer.num_threads={cores}"]
    out["old rule"] = [f"trainer.num_threads={max(1, cores - 1)}"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--burner", action="store_true", help="one CPU-burning process beside")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(worker(json.loads(args.overrides), args.steps, args.warmup, Path(tmp))))
        return 0
    if not (args.rounds >= 1 and 1 <= args.warmup < args.steps):
        ap.error("need --rounds >= 1 and 1 <= --warmup < --steps")
    base = [*SMOKE, "data.max_documents=8"] if args.smoke else FAST_START
    if args.smoke:
        args.steps, args.warmup = 2, 1
    cores = len(os.sched_getaffinity(0))
    kinds = variants(cores, args.smoke, args.burner)
    cond = "burner" if args.burner else "as is"
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    print(f"cores available {cores}; {'smoke model' if args.smoke else 'demo'}, {args.steps} steps "
          f"({args.warmup} warm-up) per run, {args.rounds} round(s), "
          f"{'one CPU-burning process beside' if args.burner else 'the machine as it is'}; "
          f"load average now {load_before:.1f}", flush=True)
    spin = burner() if args.burner else None
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        if spin is not None:
            time.sleep(2.0)  # the burner is running before the run looks at the machine
        for i in range(args.rounds):
            for name, extra in kinds.items():
                load = os.getloadavg()[0]
                r = run([*base, *extra], args.steps, args.warmup)
                got[name].append(r)
                print(f"{cond} round {i + 1} {name:9s} {r['threads']} thread"
                      f"{'s' * (r['threads'] != 1)} {r['tokens_per_second']:9,.1f} tokens/s  "
                      f"(load average {load:.1f}; {r['why']})", flush=True)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    med = {k: statistics.median(r["tokens_per_second"] for r in v) for k, v in got.items()}
    best = max(med.values())
    for name, value in med.items():
        print(f"{cond} {name:9s} median {value:9,.1f} tokens/s  ratio to best {value / best:.3f}")
    others = ", ".join(f"default/{k} {med['default'] / v:.3f}" for k, v in med.items()
                       if k != "default")
    print(f"{cond}: default/best {med['default'] / best:.3f} ({others}); load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
