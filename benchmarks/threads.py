"""Compute threads per process: torch's default pool against llmforge's choice, idle and loaded.

    python benchmarks/threads.py             # demo model (1 data worker), 1 pair per condition
    python benchmarks/threads.py --pairs 3   # more pairs, less noise
    python benchmarks/threads.py --smoke     # tiny, the machine as it is only, for the test suite

"before": ``trainer.num_threads`` = torch's default (one thread per core of the machine);
"after": ``trainer.num_threads: null``, :func:`llmforge.parallel.threads.choose_num_threads`
(the cores of ``os.sched_getaffinity`` less the data workers). "loaded": one CPU-burning
process runs beside the training process, as a busy laptop or a shared machine would. Each run
is a fresh subprocess; before and after alternate. Prints tokens/s of each and the ratio
after/before per condition. The numbers depend on what else the machine runs: say its load
next to them.
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

    default_threads = torch.get_num_threads()
    overrides = [x.replace("DEFAULT", str(default_threads)) for x in overrides]
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
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def burner() -> subprocess.Popen:
    """A process that keeps one core busy (pure Python spin) until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(worker(json.loads(args.overrides), args.steps, args.warmup, Path(tmp))))
        return 0
    if not (args.pairs >= 1 and 1 <= args.warmup < args.steps):
        ap.error("need --pairs >= 1 and 1 <= --warmup < --steps")
    base = [*SMOKE, "data.num_workers=1", "data.max_documents=8"] if args.smoke else []
    if args.smoke:
        args.steps, args.warmup = 2, 1
    # smoke: no burner (beside one, torch's default pool is what makes the run slow)
    conditions = ["idle"] if args.smoke else ["idle", "loaded"]
    print(f"cores available {len(os.sched_getaffinity(0))}, load average before "
          f"{os.getloadavg()[0]:.1f}; model {'smoke' if args.smoke else 'demo'}, "
          f"{args.steps} steps ({args.warmup} warm-up), {args.pairs} pair(s)")
    for cond in conditions:
        spin = burner() if cond == "loaded" else None
        try:
            got: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(args.pairs):
                got["before"].append(run([*base, "trainer.num_threads=DEFAULT"], args.steps, args.warmup))
                got["after"].append(run(base, args.steps, args.warmup))
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
        tps = {k: [r["tokens_per_second"] for r in v] for k, v in got.items()}
        ratios = [a / b for a, b in zip(tps["after"], tps["before"])]
        for k in ("before", "after"):
            print(f"{cond:6s} {k:6s} {got[k][0]['threads']} threads  median "
                  f"{statistics.median(tps[k]):9.1f} tokens/s")
        print(f"{cond:6s} ratio after/before: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
