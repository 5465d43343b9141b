"""Compute threads per process: llmforge's choice against the alternatives, side by side.

    python benchmarks/threads.py             # demo model, 30 steps each, 1 round per condition
    python benchmarks/threads.py --rounds 3  # more rounds, less noise
    python benchmarks/threads.py --smoke     # tiny, the machine as it is only, for the test suite

Variants, each a fresh subprocess, interleaved (one of each per round):
"default" = ``trainer.num_threads: null``, :func:`llmforge.parallel.threads.choose_num_threads`
(the cores less those other processes keep busy now; the demo's data worker slices windows in
memory and takes no core); "old rule" = the rule before issue 27 (the cores less one per data
worker: 1 thread on 2 cores); "all cores" = one thread per core whatever else runs;
"no worker" = ``data.num_workers=0`` with llmforge's choice. Conditions: "as is" (the machine as
it is) and "burner" (one CPU-burning process beside it, as a busy laptop would). Prints each
run's tokens/s, threads and the 1-minute load average before it; per condition the medians and
their ratio to the best. Say the load next to the numbers.
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


def worker(overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    """Train ``steps`` steps; tokens/s over the steps after ``warmup``, and the threads used."""
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
            "threads": torch.get_num_threads()}


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


def variants(cores: int, smoke: bool) -> dict[str, list[str]]:
    """name -> overrides (the demo has one data worker)."""
    out = {"default": [], "no worker": ["data.num_workers=0"]}
    if not smoke:
        out["old rule"] = [f"trainer.num_threads={max(1, cores - 1)}"]
        out["all cores"] = [f"trainer.num_threads={cores}"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    base = [*SMOKE, "data.max_documents=8"] if args.smoke else []
    if args.smoke:
        args.steps, args.warmup = 2, 1
    cores = len(os.sched_getaffinity(0))
    kinds = variants(cores, args.smoke)
    conditions = ["as is"] if args.smoke else ["as is", "burner"]
    print(f"cores available {cores}; model {'smoke' if args.smoke else 'demo'}, {args.steps} "
          f"steps ({args.warmup} warm-up), {args.rounds} round(s), load average now "
          f"{os.getloadavg()[0]:.1f}")
    for cond in conditions:
        spin = burner() if cond == "burner" else None
        try:
            if spin is not None:
                time.sleep(2.0)  # the burner is running before the run looks at the machine
            got: dict[str, list[dict]] = {k: [] for k in kinds}
            for i in range(args.rounds):
                for name, extra in kinds.items():
                    load = os.getloadavg()[0]
                    r = run([*base, *extra], args.steps, args.warmup)
                    got[name].append(r)
                    print(f"{cond:6s} round {i + 1} {name:9s} {r['threads']} threads "
                          f"{r['tokens_per_second']:9.1f} tokens/s  (load average {load:.1f})",
                          flush=True)
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
        med = {k: statistics.median(r["tokens_per_second"] for r in v) for k, v in got.items()}
        best = max(med.values())
        for name, value in med.items():
            print(f"{cond:6s} {name:9s} median {value:9.1f} tokens/s  ratio to best "
                  f"{value / best:.3f}")
        if "old rule" in med:
            print(f"{cond:6s} ratio default/old rule: {med['default'] / med['old rule']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
