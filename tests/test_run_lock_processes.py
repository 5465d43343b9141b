"""One writer per run directory for the whole process tree (issue 47.2), on real processes:
``--nproc 2`` workers die with a SIGKILLed launcher (alone or with its process group), so an
immediate ``checkpoint.resume=auto`` never trains beside orphans; a crashed run's data-loader
workers do not hold its lock; a run that another process completed while this one prepared is
refused under the lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import DEMO, REPO, TINY_OVERRIDES, run_main
from llmforge.job.torchrun import proc_table
from llmforge.run_guard import LAUNCHER_ENV, LOCK, TOKEN_ENV

# a constant schedule: trainer.max_steps may change on resume without allow_config_changes
LONG = ["scheduler.name=constant", "scheduler.warmup_steps=0", "trainer.log_every=1",
        "checkpoint.save_every=1", "checkpoint.keep_last_n=2", "trainer.eval_every=0"]


def start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """``llmforge train`` in a session of its own (its process group is its pid)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop(TOKEN_ENV, None)
    return subprocess.Popen([sys.executable, "-m", "llmforge", "train", DEMO, *TINY_OVERRIDES, *LONG,
                             f"run.output_dir={tmp_path}", "run.name=r", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def steps(ckpts: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in ckpts.glob("step_*/COMPLETE"))


def wait_for_checkpoint(proc: subprocess.Popen, ckpts: Path, after: int, timeout: float = 240) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = [s for s in steps(ckpts) if s > after]
        if done:
            return done[-1]
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after step {after} within {timeout} s")


def descendants(pid: int) -> list[int]:
    table = proc_table() or {}
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, _, state) in table.items() if pp == parent and state not in "ZX"]
        found += kids
        todo += kids
    return found


def alive(pids: list[int]) -> list[int]:
    table = proc_table() or {}
    return [p for p in pids if p in table and table[p][2] not in "ZX"]


def gone_within(pids: list[int], seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < end:
        time.sleep(0.05)
    return alive(pids)


def test_nproc_workers_die_with_a_killed_launcher_and_resume_agrees(tmp_path):
    """SIGKILL of the launcher, then of a resumed run's whole process group: each time both
    ranks (sessions of their own) end with it, the next resume=auto trains from the newest
    checkpoint, and metrics.jsonl ends where checkpoints/ ends with no step written twice."""
    run, ckpts = tmp_path / "r", tmp_path / "r" / "checkpoints"
    newest = 0
    for how in ("launcher", "group"):
        extra = ["checkpoint.resume=auto"] * (how == "group")
        launcher = start(tmp_path, "--nproc", "2", "trainer.max_steps=100000", *extra)
        try:
            newest = wait_for_checkpoint(launcher, ckpts, newest)
            workers = [p for p in descendants(launcher.pid) if p in (proc_table() or {})]
            ranks = [p for p in workers if (proc_table() or {})[p][0] == launcher.pid]
            assert len(ranks) == 2, workers
            (os.kill(launcher.pid, signal.SIGKILL) if how == "launcher"
             else os.killpg(launcher.pid, signal.SIGKILL))
            launcher.wait()
            assert gone_within(ranks, 5) == [], f"{how}: ranks {ranks} outlived their launcher"
        finally:
            for p in alive(descendants(launcher.pid)):
                os.kill(p, signal.SIGKILL)
            launcher.wait()
        newest = max(steps(ckpts))
    final = newest + 1  # in this process (world size 1 resumes a 2-rank checkpoint exactly)
    got = run_main("train", DEMO, *TINY_OVERRIDES, *LONG, f"run.output_dir={tmp_path}", "run.name=r",
                   "checkpoint.resume=auto", f"trainer.max_steps={final}")
    assert got.returncode == 0 and "took over the lock" in got.stderr, got.stderr
    records = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records == sorted(set(records)) and records[-1] == final, records
    assert max(steps(ckpts)) == final and (run / LOCK).read_text() == ""


def test_a_crashed_runs_loader_workers_do_not_hold_its_lock(tmp_path):
    """SIGKILL of a run with 2 data-loader workers: the workers (forked with the lock's open
    file) would hold the lock for seconds; they closed it, so resume=auto at once trains."""
    proc = start(tmp_path, "trainer.max_steps=100000", "data.num_workers=2")
    ckpts = tmp_path / "r" / "checkpoints"
    loaders: list[int] = []
    try:
        newest = wait_for_checkpoint(proc, ckpts, 0)
        loaders = descendants(proc.pid)
        assert len(loaders) >= 2, loaders
        for p in loaders:  # held alive through the resume (they would notice their parent's
            os.kill(p, signal.SIGSTOP)  # death within 5 s, sooner if a loaded machine stalls us)
        proc.kill()
        proc.wait()
        assert alive(loaders)
        got = run_main("train", DEMO, *TINY_OVERRIDES, *LONG, f"run.output_dir={tmp_path}", "run.name=r",
                       "data.num_workers=2", "checkpoint.resume=auto", f"trainer.max_steps={newest + 1}")
        assert got.returncode == 0, got.stderr
        assert f"took over the lock of {tmp_path / 'r'} left by pid {proc.pid}" in got.stderr
        assert "waiting" not in got.stderr
        assert max(steps(ckpts)) == newest + 1
    finally:
        proc.kill()
        proc.wait()
        for p in alive(loaders):
            os.kill(p, signal.SIGKILL)


def test_a_run_completed_while_this_one_prepared_is_not_written(tmp_path, monkeypatch):
    """The check-then-lock race made deterministic: this ``train`` resolves an empty run
    directory, and another one trains it to the end before this one takes the lock (a hook
    there). Under the lock the directory is checked again: exit 2, the other run's files
    byte-identical. A newer checkpoint appearing before a resume=auto takes the lock is refused
    the same way."""
    from llmforge.training.run_files import recheck_run_dir
    from llmforge.training.trainer import Trainer

    args = ["train", DEMO, *TINY_OVERRIDES, "trainer.max_steps=1", "scheduler.warmup_steps=0",
            f"run.output_dir={tmp_path}", "run.name=r"]
    run = tmp_path / "r"
    lock_run_dir = Trainer.lock_run_dir
    other: dict = {}

    def paused_here(self):  # what another process does while this one is between check and lock
        monkeypatch.setattr(Trainer, "lock_run_dir", lock_run_dir)
        other["result"] = run_main(*args)
        other["files"] = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK}
        lock_run_dir(self)

    monkeypatch.setattr(Trainer, "lock_run_dir", paused_here)
    got = run_main(*args)
    assert other["result"].returncode == 0, other["result"].stderr
    assert got.returncode == 2 and got.stderr.splitlines()[-1] == (
        f"error: run directory {run} changed while this command prepared (it held no run, now it "
        "holds one): another process wrote it before this one took its lock; nothing was written: "
        "run the command again"), got.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK} == other["files"]

    step1 = run / "checkpoints" / "step_00000001"
    newer = run / "checkpoints" / "step_00000002"
    newer.mkdir()
    (newer / "COMPLETE").write_text("")
    try:
        recheck_run_dir(run, run / "checkpoints", True, step1, auto=True)
    except Exception as exc:  # noqa: BLE001 - the message is the point
        assert str(exc) == (f"run directory {run} changed while this command prepared (the newest "
                            f"checkpoint was {step1}, now it is {newer}): another process wrote it "
                            "before this one took its lock; nothing was written: run the command again")
    else:
        raise AssertionError("a newer checkpoint was not noticed")


def test_a_worker_whose_launcher_already_ended_stops():
    """die_with_launcher: under its real launcher it returns True and removes the variable; for a
    launcher that has ended (it died before the prctl call: the worker was re-parented) the
    worker kills itself, as the death signal would have; a live process that is not its parent
    (a variable inherited from further up) is not its launcher: nothing happens."""
    code = ("import os; from llmforge.job.torchrun import die_with_launcher, LAUNCHER_ENV\n"
            "print(die_with_launcher(), LAUNCHER_ENV in os.environ, flush=True)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    ended = subprocess.Popen(["true"])
    ended.wait()
    for launcher, code_out in ((os.getpid(), (0, "True False\n")), (1, (0, "False False\n")),
                               (ended.pid, (-signal.SIGKILL, ""))):
        proc = subprocess.run([sys.executable, "-c", code], env={**env, LAUNCHER_ENV: str(launcher)},
                              capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == code_out, proc.stderr
    assert proc.stderr == f"llmforge: the launcher (pid {ended.pid}) has ended; this worker stops\n"
