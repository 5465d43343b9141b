"""Fault-tolerant replica groups (``fault_tolerance:``, torchft): overhead and kill-and-rejoin.

    python benchmarks/ft.py             # the demo model (yamls/demo_cpu.yaml), 2 x 1 process
    python benchmarks/ft.py --smoke     # a tiny model and few steps, for the test suite

(1) Overhead: tokens/s of 2 replica groups x 1 process (fault tolerance on: a lighthouse, a
quorum and a commit vote per step, gradients through torchft's gloo group) against a plain
2-rank DDP run (off), same global batch and steps; the median over the steps after
``--warmup`` of the run's tokens per step over the step's seconds; R = on / off.
(2) Kill and rejoin: a lighthouse (min_replicas 1), groups 0 and 1; the group that did not start
the run (the survivor is the one holding step 1) is SIGKILLed after its ``--kill-at``-th step and
restarted once the survivor has committed 2 steps alone; S = seconds from the restart to the
killed group's first committed step (its first new record). "Survivor never stopped": it
recorded every step 1..N, exited 0, and none of its steps took as long as the restart did.
"Rejoined bit-equal": from its rejoin on, the restarted group's loss, gradient norm and lr equal
the survivor's at every step, and both final checkpoints hold the same weights bit for bit. On
the demo model a step is slow enough for the survivor to outlast the restart; ``--pace`` (0.5 s
in ``--smoke``) slows every step of the kill run by that much (``tests.helpers.slow``).

Ends with one line: ``survivor never stopped: yes|no; rejoined bit-equal: yes|no; overhead R;
rejoin S s``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from llmforge.parallel.lighthouse import start_lighthouse  # noqa: E402  (after the path)

DEMO = str(REPO / "yamls" / "demo_cpu.yaml")
BASE = ["trainer.progress_bar=false", "trainer.eval_every=0", "trainer.eval_batches=1",
        "trainer.log_every=1", "data.num_workers=0", "scheduler.warmup_steps=2"]
SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64",
         "data.max_documents=4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, nproc: int = 1) -> subprocess.Popen:
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
           if nproc > 1 else [sys.executable]) + ["-m", "llmforge", "train", DEMO, *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)


def group_args(common: list[str], port: int, group: int, work: Path, *extra: str) -> list[str]:
    return [*common, f"run.output_dir={work}", f"run.name=g{group}", "fault_tolerance.enabled=true",
            f"fault_tolerance.replica_id={group}", f"fault_tolerance.lighthouse=http://127.0.0.1:{port}",
            "fault_tolerance.timeout_s=30", "fault_tolerance.quorum_timeout_s=120", *extra]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r]


def finish(procs: list[subprocess.Popen], timeout: float, work: Path) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            logs = "".join(f.read_text()[-2000:] for f in sorted(work.glob("*.log")))
            raise SystemExit(f"a run failed (exit {p.returncode}):\n{logs}")


def tokens_per_second(run_dir: Path, warmup: int) -> float:
    """Median over the steps after ``warmup`` of the run's tokens per step (the growth of
    ``train/tokens_seen``: every participating group's, or every DDP rank's) over the step's
    seconds. (A group's ``throughput/tokens_per_second`` counts that group's tokens only.)"""
    recs = records(run_dir)
    return statistics.median((b["train/tokens_seen"] - a["train/tokens_seen"]) / b["time/step_seconds"]
                             for a, b in zip(recs, recs[1:]) if b["step"] > warmup)


def overhead(common: list[str], work: Path, warmup: int) -> tuple[float, float]:
    """(tokens/s off, tokens/s on): 2-rank DDP, then 2 replica groups x 1 process."""
    finish([start([*common, f"run.output_dir={work}", "run.name=ddp", "strategy.name=ddp",
                   "trainer.devices=2"], work / "ddp.log", nproc=2)], 1800, work)
    port = free_port()
    house = start_lighthouse(port, min_replicas=2)  # both groups in every step
    try:
        finish([start(group_args(common, port, g, work / "on"), work / f"on{g}.log") for g in (0, 1)],
               1800, work)
    finally:
        house.kill()
    return tokens_per_second(work / "ddp", warmup), tokens_per_second(work / "on" / "g0", warmup)


def final_weights(run_dir: Path) -> dict:
    from llmforge.checkpoint.run_dir import load_model

    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return load_model(last, trust_code=True)[0].state_dict()


def kill_and_rejoin(common: list[str], work: Path, kill_at: int, steps: int) -> dict:
    """Start groups 0 and 1; SIGKILL the one that did not start the run (the other holds step
    1) after its ``kill_at``-th step, restart it once the survivor committed 2 steps alone."""
    import torch

    port = free_port()
    house = start_lighthouse(port, min_replicas=1)
    try:
        procs = [start(group_args(common, port, g, work), work / f"g{g}.log") for g in (0, 1)]
        while min(len(records(work / f"g{g}")) for g in (0, 1)) < kill_at:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a group ended before the kill; see " + str(work))
            time.sleep(0.05)
        survivor = 0 if records(work / "g0")[0]["step"] == 1 else 1
        victim = 1 - survivor
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        last = records(work / f"g{victim}")[-1]["step"]  # the restart drops these records
        at_kill = len(records(work / f"g{survivor}"))
        while len(records(work / f"g{survivor}")) < at_kill + 2 and procs[survivor].poll() is None:
            time.sleep(0.05)
        restarted = time.monotonic()
        procs[victim] = start(group_args(common, port, victim, work, "checkpoint.resume=auto"),
                              work / f"g{victim}.log")
        while (max((r["step"] for r in records(work / f"g{victim}")), default=0) <= last
               and all(p.poll() is None for p in procs)):
            time.sleep(0.05)
        rejoin_s = time.monotonic() - restarted
        finish(procs, 1800, work)
    finally:
        house.kill()
    kept, rejoined = records(work / f"g{survivor}"), records(work / f"g{victim}")
    rejoined = [r for r in rejoined if r["step"] > last]
    by_step = {r["step"]: r for r in kept}
    keys = ("train/loss", "train/grad_norm", "train/lr")
    same_steps = bool(rejoined) and all(
        r["step"] in by_step and all(r[k] == by_step[r["step"]][k] for k in keys) for r in rejoined)
    a, b = final_weights(work / "g0"), final_weights(work / "g1")
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    slowest = max(r["time/step_seconds"] for r in kept)
    never_stopped = [r["step"] for r in kept] == list(range(1, steps + 1)) and slowest < rejoin_s
    return {"never_stopped": never_stopped, "bit_equal": same_steps and same_weights,
            "rejoin_s": rejoin_s, "rejoined_at": rejoined[0]["step"] if rejoined else None,
            "killed_after": last, "alone_steps": sum(r["ft/participants"] == 1 for r in kept if r["step"] > last),
            "max_survivor_step_s": slowest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (test suite)")
    ap.add_argument("--steps", type=int, default=None, help="steps of each run (default 30; smoke 12)")
    ap.add_argument("--kill-steps", type=int, default=None,
                    help="steps of the kill-and-rejoin run (default 80; smoke 50)")
    ap.add_argument("--kill-at", type=int, default=3, help="steps the killed group records before the kill")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the tokens/s median")
    ap.add_argument("--pace", type=float, default=None,
                    help="seconds each group sleeps after each step of the kill run, so the survivor "
                         "outlasts the restart (default 0; smoke 0.5)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    opts = ap.parse_args()
    steps = opts.steps or (12 if opts.smoke else 30)
    kill_steps = opts.kill_steps or (50 if opts.smoke else 80)
    pace = opts.pace if opts.pace is not None else (0.5 if opts.smoke else 0.0)
    common = [*BASE, *(SMOKE if opts.smoke else [])]
    work = Path(tempfile.mkdtemp(prefix="llmforge-ft-"))
    try:
        off, on = overhead([*common, f"trainer.max_steps={steps}"], work / "overhead", opts.warmup)
        ratio = on / off
        print(f"tokens/s: fault tolerance off (2-rank DDP) {off:,.0f}, on (2 groups x 1) {on:,.0f}; "
              f"on/off {ratio:.2f} (median over steps {opts.warmup + 1}..{steps})", flush=True)
        kill_common = [*common, f"trainer.max_steps={kill_steps}"]
        if pace > 0:
            kill_common.append(f"callbacks=[{{name: tests.helpers.slow.SlowSteps, seconds: {pace}}}]")
        res = kill_and_rejoin(kill_common, work / "kill", opts.kill_at, kill_steps)
        print(f"killed after step {res['killed_after']} of {kill_steps}: the survivor alone for "
              f"{res['alone_steps']} steps "
              f"(slowest step {res['max_survivor_step_s']:.2f} s); the killed group restarted, first committed "
              f"step {res['rejoined_at']} after {res['rejoin_s']:.1f} s", flush=True)
        yes = {True: "yes", False: "no"}
        print(f"survivor never stopped: {yes[res['never_stopped']]}; rejoined bit-equal: "
              f"{yes[res['bit_equal']]}; overhead {ratio:.2f}; rejoin {res['rejoin_s']:.1f} s")
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
