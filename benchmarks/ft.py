"""Fault-tolerant replica groups (``fault_tolerance:``, torchft): overhead and kill-and-rejoin.

    python benchmarks/ft.py             # the demo model (yamls/demo_cpu.yaml), 2 x 1 process
    python benchmarks/ft.py --smoke     # a tiny model and few steps, for the test suite

(1) Overhead: tokens/s of 2 replica groups x 1 process (fault tolerance on: a lighthouse, a
quorum and a commit vote per step, gradients through torchft's gloo group) against a plain
2-rank DDP run (off), same global batch and steps; the median of
``throughput/tokens_per_second`` over the steps after ``--warmup``; R = on / off.
(2) Kill and rejoin: a lighthouse (min_replicas 1), groups 0 and 1; group 1 is SIGKILLed at step
``--kill-at``, restarted once group 0 has committed 2 steps alone; S = seconds from the
restart to group 1's first committed step (its first record). "Survivor never stopped": group
0 recorded every step 1..N, exited 0, and none of its steps took as long as the restart did.
"Rejoined bit-equal": from its rejoin on, group 1's loss, gradient norm and lr equal group 0's
at every step, and both final checkpoints hold the same weights bit for bit.

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


def lighthouse(port: int, min_replicas: int) -> subprocess.Popen:
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    proc = subprocess.Popen([exe, "--min_replicas", str(min_replicas), "--join_timeout_ms", "1000",
                             "--heartbeat_timeout_ms", "2000", "--quorum_tick_ms", "100",
                             "--bind", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"torchft_lighthouse did not start on port {port}")


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
    return statistics.median(r["throughput/tokens_per_second"] for r in records(run_dir)
                             if r["step"] > warmup)


def overhead(common: list[str], work: Path, warmup: int) -> tuple[float, float]:
    """(tokens/s off, tokens/s on): 2-rank DDP, then 2 replica groups x 1 process."""
    finish([start([*common, f"run.output_dir={work}", "run.name=ddp", "strategy.name=ddp",
                   "trainer.devices=2"], work / "ddp.log", nproc=2)], 1800, work)
    port = free_port()
    house = lighthouse(port, min_replicas=2)  # both groups in every step
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
    import torch

    port = free_port()
    house = lighthouse(port, min_replicas=1)
    try:
        g0 = start(group_args(common, port, 0, work), work / "g0.log")
        while not records(work / "g0") and g0.poll() is None:
            time.sleep(0.05)  # group 0 first: it holds every step (a later group heals from it)
        g1 = start(group_args(common, port, 1, work), work / "g1.log")
        while len(records(work / "g1")) < kill_at:
            if g1.poll() is not None or g0.poll() is not None:
                raise SystemExit("a group ended before the kill; see " + str(work))
            time.sleep(0.05)
        os.kill(g1.pid, signal.SIGKILL)
        g1.wait()
        last = max(r["step"] for r in records(work / "g1"))  # the restart drops these records
        at_kill = len(records(work / "g0"))
        while len(records(work / "g0")) < at_kill + 2 and g0.poll() is None:
            time.sleep(0.05)
        restarted = time.monotonic()
        g1 = start(group_args(common, port, 1, work, "checkpoint.resume=auto"), work / "g1.log")
        while (max((r["step"] for r in records(work / "g1")), default=0) <= last
               and g1.poll() is None and g0.poll() is None):
            time.sleep(0.05)
        rejoin_s = time.monotonic() - restarted
        finish([g0, g1], 1800, work)
    finally:
        house.kill()
    survivor, rejoined = records(work / "g0"), records(work / "g1")
    by_step = {r["step"]: r for r in survivor}
    keys = ("train/loss", "train/grad_norm", "train/lr")
    same_steps = bool(rejoined) and all(
        r["step"] in by_step and all(r[k] == by_step[r["step"]][k] for k in keys) for r in rejoined)
    a, b = final_weights(work / "g0"), final_weights(work / "g1")
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    never_stopped = ([r["step"] for r in survivor] == list(range(1, steps + 1))
                     and max(r["time/step_seconds"] for r in survivor) < rejoin_s)
    return {"never_stopped": never_stopped, "bit_equal": same_steps and same_weights,
            "rejoin_s": rejoin_s, "rejoined_at": rejoined[0]["step"] if rejoined else None,
            "alone_steps": sum(r["ft/participants"] == 1 for r in survivor),
            "max_survivor_step_s": max(r["time/step_seconds"] for r in survivor)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (test suite)")
    ap.add_argument("--steps", type=int, default=None, help="steps of each run (default 30; smoke 12)")
    ap.add_argument("--kill-steps", type=int, default=None,
                    help="steps of the kill-and-rejoin run (default 80; smoke 40)")
    ap.add_argument("--kill-at", type=int, default=3, help="group 1's step at which it is killed")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the tokens/s median")
    ap.add_argument("--pace", type=float, default=None,
                    help="seconds group 0 sleeps after each step of the kill run, so it outlasts "
                         "the restart (default 0; smoke 0.5)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    opts = ap.parse_args()
    steps = opts.steps or (12 if opts.smoke else 30)
    kill_steps = opts.kill_steps or (40 if opts.smoke else 80)
    pace = opts.pace if opts.pace is not None else (0.5 if opts.smoke else 0.0)
    common = [*BASE, *(SMOKE if opts.smoke else [])]
    work = Path(tempfile.mkdtemp(prefix="llmforge-ft-"))
    try:
        off, on = overhead([*common, f"trainer.max_steps={steps}"], work / "overhead", opts.warmup)
        ratio = on / off
        print(f"tokens/s: fault tolerance off (2-rank DDP) {off:,.0f}, on (2 groups x 1) {on:,.0f}; "
              f"on/off {ratio:.2f} (median over steps {opts.warmup + 1}..{steps})", flush=True)
        kill_common = [*common, f"trainer.max_steps={kill_steps}"]
        if pace > 0:  # the survivor's pace only; the rejoined group follows it through the quorum
            kill_common.append(f"callbacks=[{{name: tests.helpers.slow.SlowSteps, seconds: {pace}}}]")
        res = kill_and_rejoin(kill_common, work / "kill", opts.kill_at, kill_steps)
        print(f"kill at step {opts.kill_at} of {kill_steps}: group 0 alone for {res['alone_steps']} steps "
              f"(slowest step {res['max_survivor_step_s']:.2f} s); group 1 restarted, first committed "
              f"step {res['rejoined_at']} after {res['rejoin_s']:.1f} s", flush=True)
        yes = {True: "yes", False: "no"}
        print(f"survivor never stopped: {yes[res['never_stopped']]}; rejoined bit-equal: "
              f"{yes[res['bit_equal']]}; overhead {ratio:.2f}; rejoin {res['rejoin_s']:.1f} s")
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
