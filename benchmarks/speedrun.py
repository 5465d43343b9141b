"""Time to quality: the demo and the speedrun recipe side by side, to the demo's final eval loss.

Runs ``yamls/demo_cpu.yaml`` and ``yamls/demo_cpu_fast.yaml`` (same model, tokenizer, data,
held-out windows and seed; only optimizer, schedule and algorithm settings differ) as CLI
subprocesses, **interleaved**: one process runs at a time for ``--slice`` seconds while the
others are stopped (``SIGSTOP`` / ``SIGCONT`` to their process group), so a change of the
machine's load falls on all of them alike. Each run's clock counts only its own slices. Both
evaluate every ``--eval-every`` steps on the same windows; the target is the demo's final
``eval/loss``; for each run the first evaluation at or below it gives the time (from the end of
the step-0 evaluation, so start-up is left out; with start-up in brackets) and the tokens
trained to reach it. Then, with ``--ablation``, the recipe with each of its speed-ups removed
in turn (interleaved with each other; each stops at the target, or after ``--cap`` times the
recipe's seconds to it). Prints a table, writes it
to ``--out`` (markdown) and ends with the line::

    wall-time ratio R (token ratio T)

(recipe / demo). ``--smoke``: the tiny model, a few steps, seconds (checks the script runs;
the ratio means nothing there).

    python benchmarks/speedrun.py --ablation            # the measurement (about 1.5x the demo's time)
    python benchmarks/speedrun.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "yamls" / "demo_cpu.yaml"
RECIPE = REPO / "yamls" / "demo_cpu_fast.yaml"
SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=32",
         "tokenizer.vocab_size=512", "tokenizer.train_max_bytes=500000", "variables.seq_len=64",
         "trainer.eval_batches=1", "data.num_workers=0"]


@dataclass
class Run:
    """One training subprocess and what the driver saw of it."""

    name: str
    args: list[str]
    run_dir: Path
    proc: Optional[subprocess.Popen] = None
    active: float = 0.0  # seconds it was allowed to run
    start_active: Optional[float] = None  # active time when the step-0 evaluation was written
    evals: list[tuple[int, float, float, int]] = field(default_factory=list)  # step, loss, active s, tokens
    seen_lines: int = 0
    done: bool = False
    returncode: Optional[int] = None

    def poll_records(self) -> None:
        """Read new lines of the run's metrics.jsonl; an evaluation is stamped with the run's
        active time now (the driver polls right after each slice and during it)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        complete = lines if path.read_text().endswith("\n") else lines[:-1]
        for line in complete[self.seen_lines:]:
            rec = json.loads(line)
            if "eval/loss" in rec:
                if rec["step"] == 0:
                    self.start_active = self.active
                self.evals.append((rec["step"], rec["eval/loss"], self.active,
                                   int(rec.get("train/tokens_seen", 0))))
        self.seen_lines = len(complete)

    def reached(self, target: float) -> Optional[tuple[int, float, float, int]]:
        """``(step, eval loss, seconds since the step-0 evaluation, tokens)`` of the first
        evaluation at or below ``target`` (step 0 excluded), or None."""
        for step, loss, t, tokens in self.evals:
            if step > 0 and loss <= target:
                return step, loss, t - (self.start_active or 0.0), tokens
        return None


def group_signal(run: Run, sig: int) -> None:
    try:
        os.killpg(run.proc.pid, sig)
    except ProcessLookupError:
        pass


def interleave(runs: list[Run], slice_s: float, stop_when=None) -> None:
    """Run ``runs`` one slice at a time until each exits (or ``stop_when(run)`` says so)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    while any(not r.done for r in runs):
        for run in runs:
            if run.done:
                continue
            t0 = time.perf_counter()
            if run.proc is None:
                run.proc = subprocess.Popen([sys.executable, "-m", "llmforge", "train", *run.args], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                            start_new_session=True)
            else:
                group_signal(run, signal.SIGCONT)
            before = run.active
            while time.perf_counter() - t0 < slice_s and run.proc.poll() is None:
                time.sleep(0.2)
                run.active = before + time.perf_counter() - t0  # records written now get this stamp
                run.poll_records()
            run.active = before + time.perf_counter() - t0
            if run.proc.poll() is None:
                group_signal(run, signal.SIGSTOP)
            run.poll_records()
            if run.proc.poll() is not None:
                run.done, run.returncode = True, run.proc.returncode
                if run.returncode != 0:
                    sys.exit(f"error: {run.name} exited {run.returncode}: {run.proc.stderr.read()[-3000:]}")
            elif stop_when is not None and stop_when(run):
                group_signal(run, signal.SIGCONT)
                group_signal(run, signal.SIGKILL)
                run.proc.wait()
                run.done = True


def recipe_algorithms() -> list[dict]:
    return OmegaConf.to_container(OmegaConf.load(RECIPE).get("algorithms", []))


def ablations() -> dict[str, list[str]]:
    """The recipe with one speed-up removed: each algorithm, then Muon (AdamW with the recipe's
    learning rate and schedule)."""
    algos = recipe_algorithms()
    out = {}
    for a in algos:
        rest = [b for b in algos if b is not a]
        out[f"recipe - {a['name']}"] = [f"algorithms={json.dumps(rest)}"]
    optimizer = OmegaConf.load(RECIPE).optimizer
    if optimizer.get("name") == "muon":
        out["recipe - muon (adamw)"] = ["optimizer.name=adamw"]
    return out


def fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eval-every", type=int, default=25, help="evaluation interval of every run (steps)")
    p.add_argument("--slice", type=float, default=10.0, help="seconds each process runs in turn")
    p.add_argument("--ablation", action="store_true", help="also the recipe minus each speed-up")
    p.add_argument("--cap", type=float, default=1.5,
                   help="an ablation run stops after this many times the recipe's seconds to the target")
    p.add_argument("--ablation-minutes", type=float, default=None,
                   help="stop the ablation runs after this many minutes in all (they report their best)")
    p.add_argument("--threads", type=int, default=1, help="trainer.num_threads of every run")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps (seconds)")
    args = p.parse_args(argv)
    load_before = Path("/proc/loadavg").read_text().strip()
    work = Path(tempfile.mkdtemp(prefix="speedrun-"))
    common = [f"run.output_dir={work}", f"trainer.eval_every={args.eval_every}", "trainer.progress_bar=false",
              "checkpoint.save_final=false", f"trainer.log_every={args.eval_every}",
              f"trainer.num_threads={args.threads}"]
    demo_extra, recipe_extra = [], []
    if args.smoke:
        common += SMOKE
        demo_extra, recipe_extra = ["trainer.max_steps=4"], ["trainer.max_steps=2"]

    def make(name: str, yaml: Path, *extra: str) -> Run:
        slug = name.replace(" ", "").replace("(", "").replace(")", "").replace("-", "_minus_")
        return Run(name, [str(yaml), *common, f"run.name={slug}", *extra], work / slug)

    demo, recipe = make("demo", DEMO, *demo_extra), make("recipe", RECIPE, *recipe_extra)
    interleave([demo, recipe], args.slice)
    target = demo.evals[-1][1]
    rows = [demo, recipe]
    if args.ablation:
        variants = [make(n, RECIPE, *recipe_extra, *o) for n, o in ablations().items()]
        recipe_hit = recipe.reached(target)
        limit = args.cap * (recipe_hit[2] if recipe_hit else demo.reached(target)[2])

        end = time.monotonic() + 60 * args.ablation_minutes if args.ablation_minutes else float("inf")

        def stop(r: Run) -> bool:
            return (r.reached(target) is not None or r.active - (r.start_active or 0.0) > limit
                    or time.monotonic() > end)

        interleave(variants, args.slice, stop_when=stop)
        rows += variants
    load_after = Path("/proc/loadavg").read_text().strip()

    base = demo.reached(target)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, {os.cpu_count()} CPUs",
             f"target: the demo's final eval/loss {target:.4f} (step {demo.evals[-1][0]}); evaluation every "
             f"{args.eval_every} steps on the same windows; interleaved slices of {args.slice:g} s; "
             f"trainer.num_threads={args.threads}",
             f"load average before: {load_before}", f"load average after:  {load_after}", "",
             "| run | first eval <= target (step) | eval/loss | seconds to it | tokens to it | wall-time ratio | token ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in rows:
        hit = run.reached(target)
        if hit is None:
            best = min((e[1] for e in run.evals if e[0] > 0), default=None)
            secs = run.active - (run.start_active or 0.0)
            lines.append(f"| {run.name} | not reached in {secs:.0f} s (best {fmt(best, '.4f')}) | | | | | |")
            continue
        step, loss, secs, tokens = hit
        lines.append(f"| {run.name} | {step} | {loss:.4f} | {secs:.1f} | {tokens:,} | "
                     f"{secs / base[2]:.3f} | {tokens / base[3]:.3f} |")
    report = "\n".join(lines)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d-%H%M")
    name = "speedrun-smoke.md" if args.smoke else f"speedrun-{stamp}.md"
    (args.out / name).write_text(f"# benchmarks/speedrun.py {' '.join(argv or sys.argv[1:])}\n\n{report}\n")
    shutil.rmtree(work, ignore_errors=True)
    hit = recipe.reached(target)
    if hit is None:
        # the ratio at the best loss the recipe reached: the demo's first evaluation at or below it
        best = min((e for e in recipe.evals if e[0] > 0), key=lambda e: e[1], default=None)
        demo_hit = demo.reached(best[1]) if best else None
        if demo_hit is None:
            print("wall-time ratio n/a (token ratio n/a): the recipe did not reach the target")
            return 0 if args.smoke else 1
        mine = recipe.reached(best[1])
        print(f"the recipe did not reach the target; at its best eval/loss {best[1]:.4f} (step {best[0]}) "
              f"against the demo's first eval at or below it (step {demo_hit[0]}):")
        print(f"wall-time ratio {mine[2] / demo_hit[2]:.3f} (token ratio {mine[3] / demo_hit[3]:.3f})")
        return 0 if args.smoke else 1
    print(f"wall-time ratio {hit[2] / base[2]:.3f} (token ratio {hit[3] / base[3]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
