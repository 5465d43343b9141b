"""`llmforge launch` on the local cluster, end to end: 2 CPU processes under torchrun, the
registry (running -> completed), logs, losses equal to 1 process; `runs stop` (every process
ends, a loadable checkpoint, `stopped`), `runs restart` (continues from that step), a SIGKILLed
run shown `failed`, and `scheduling.max_retries` restarting a killed run that then completes.
Secrets: only the named one reaches the job; no value lands in the registry or the run dir."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import DEMO, REPO, TINY_OVERRIDES, run_main
from llmforge.job import torchrun
from llmforge.runs import local
from llmforge.job.records import RunRegistry

BASE = [*TINY_OVERRIDES, "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1",
        "data.max_documents=6"]
SECRETS = {"WANDB_API_KEY": "wandb-FAKE-secret-1111", "HF_TOKEN": "hf_FAKE_secret_2222"}
SLOW = "{name: tests.helpers.slow.SlowSteps, seconds: 0.4}"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("llmforge-home")
    yield h
    for run in RunRegistry(h / "runs.db").list():  # never leave processes behind
        if run.pgid:
            for pid in local.run_pids(run.pgid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def cli(home, *args):
    """``llmforge ARGS`` in this process (torch is imported once, not per launch), from REPO with
    LLMFORGE_HOME and the secrets set; returns returncode, stdout, stderr like a subprocess."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # as run_cli: tests.helpers
    return run_main(*args, cwd=REPO, env={"LLMFORGE_HOME": str(home), "PYTHONPATH": path, **SECRETS})


def launch(home, out, name, *extra):
    proc = cli(home, "launch", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("launched "), proc.stdout
    return RunRegistry(home / "runs.db").get(proc.stdout.split()[1])


def row(home, run_id):
    proc = cli(home, "runs", "list")
    assert proc.returncode == 0, proc.stderr
    return next(ln for ln in proc.stdout.splitlines() if run_id in ln)


def wait(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_status(home, run_id, statuses, timeout=480):
    """Wait for a final status confirmed by the supervisor (it records the exit code)."""
    reg = RunRegistry(home / "runs.db")
    done = lambda r: r if r.status in statuses and r.exit_code is not None else None  # noqa: E731
    return wait(lambda: done(reg.get(run_id)), timeout, f"{run_id} to be {statuses}")


def records(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def train_losses(run_dir):
    return {r["step"]: r["train/loss"] for r in records(run_dir) if "train/loss" in r}


@pytest.mark.slow
def test_launch_two_cpu_processes_matches_one_process(home, out):
    probe = "{name: tests.helpers.slow.EnvProbe, names: [WANDB_API_KEY, HF_TOKEN]}"
    run = launch(home, out, "two", "trainer.max_steps=6", "--gpus", "2", "--secret", "WANDB_API_KEY",
                 f"callbacks=[{probe}]")
    assert run.spec["procs_per_node"] == 2 and run.pgid
    wait(lambda: "running" in row(home, run.id), 60, "runs list to show running")
    done = wait_status(home, run.id, ("completed", "failed", "stopped"))
    assert done.status == "completed", (done, cli(home, "runs", "logs", run.id).stdout[-3000:])
    assert "completed" in row(home, run.id)
    assert done.last_step == 6 and done.exit_code == 0 and done.resumptions == 0

    logs = cli(home, "runs", "logs", run.id)
    assert logs.returncode == 0 and "done: 6 steps" in logs.stdout and "== exit code 0" in logs.stdout
    assert (Path(run.run_dir) / "logs" / "resumption-0.log").is_file()
    described = cli(home, "runs", "describe", "two")
    assert described.returncode == 0 and "timeline" in described.stdout and "completed" in described.stdout
    assert "train/loss" in described.stdout and "config (secrets redacted)" in described.stdout

    # only the named secret reached the training processes; no value was written anywhere
    assert json.loads((Path(run.run_dir) / "env_probe.json").read_text()) == {"WANDB_API_KEY": True,
                                                                              "HF_TOKEN": False}
    files = [p for p in Path(home).rglob("*") if p.is_file()] + [p for p in Path(run.run_dir).rglob("*")
                                                                 if p.is_file()]
    for p in files:
        blob = p.read_bytes()
        for value in SECRETS.values():
            assert value.encode() not in blob, p

    ref = cli(home, "train", DEMO, *BASE, "trainer.max_steps=6", f"run.output_dir={out}", "run.name=one")
    assert ref.returncode == 0, ref.stderr[-3000:]
    two, one = train_losses(run.run_dir), train_losses(out / "one")
    assert sorted(two) == sorted(one) == list(range(1, 7))
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step


@pytest.mark.slow
def test_stop_restart_and_a_killed_run(home, out):
    run = launch(home, out, "stopme", "trainer.max_steps=60", "--gpus", "2", f"callbacks=[{SLOW}]")
    wait(lambda: len(train_losses(run.run_dir)) >= 3, 300, "3 logged steps")
    pids = local.run_pids(run.pgid)
    assert len(pids) >= 4, pids  # supervisor, torch's agent, 2 workers

    stopped = cli(home, "runs", "stop", run.id)
    assert stopped.returncode == 0, stopped.stderr
    assert local.wait_gone(pids, 10), local.run_pids(run.pgid)  # every process ended
    rec = RunRegistry(home / "runs.db").get(run.id)
    assert rec.status == "stopped" and rec.exit_code == 75, rec
    assert "stopped" in row(home, run.id)
    from llmforge.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(Path(run.run_dir) / "checkpoints")
    assert ckpt is not None and (ckpt / "COMPLETE").exists()
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    assert step >= 3 and step == rec.last_step
    inspect = cli(home, "checkpoint", "inspect", str(ckpt))
    assert inspect.returncode == 0 and f"step         {step}" in inspect.stdout, inspect.stderr

    restarted = cli(home, "runs", "restart", run.id)
    assert restarted.returncode == 0, restarted.stderr
    wait(lambda: max(train_losses(run.run_dir)) > step + 1, 300, "steps after the restart")
    rec = RunRegistry(home / "runs.db").get(run.id)
    assert rec.status == "running" and rec.resumptions == 1
    steps = [r["step"] for r in records(run.run_dir) if "train/loss" in r]
    assert steps == sorted(set(steps)) and step + 1 in steps  # continued from `step`, none twice
    assert (Path(run.run_dir) / "logs" / "resumption-1.log").is_file()

    for pid in local.run_pids(rec.pgid):  # the outside world kills every process of the run
        os.kill(pid, signal.SIGKILL)
    wait(lambda: not local.group_alive(rec.pgid), 30, "the killed processes to go")
    assert "failed" in row(home, run.id)  # found dead by `runs list`
    rec = RunRegistry(home / "runs.db").get(run.id)
    assert rec.status == "failed" and "gone" in rec.message


@pytest.mark.slow
def test_max_retries_restarts_a_killed_run_which_completes(home, out):
    run = launch(home, out, "retry", "trainer.max_steps=10", "checkpoint.save_every=2",
                 "scheduling.max_retries=1", f"callbacks=[{SLOW}]")
    wait(lambda: len(train_losses(run.run_dir)) >= 3, 300, "3 logged steps")
    workers = [p for p in local.run_pids(run.pgid) if os.getpgid(p) != run.pgid]
    assert workers
    for pid in workers:  # a system failure: the training process is killed
        os.kill(pid, signal.SIGKILL)
    done = wait_status(home, run.id, ("completed", "failed"))
    assert done.status == "completed", cli(home, "runs", "describe", run.id).stdout
    assert (done.resumptions, done.retries, done.last_step) == (1, 1, 10)
    kinds = [e["kind"] for e in RunRegistry(home / "runs.db").events(run.id)]
    assert "restart" in kinds
    log1 = (Path(run.run_dir) / "logs" / "resumption-1.log").read_text()
    assert "checkpoint.resume=auto" not in (Path(run.run_dir) / "logs" / "resumption-0.log").read_text()
    assert "checkpoint.resume=auto" in log1.splitlines()[1] and "done: 10 steps" in log1
    assert sorted(train_losses(run.run_dir)) == list(range(1, 11))


@pytest.mark.slow
def test_stop_before_the_first_step_loses_nothing_and_says_stopped(home, out):
    stall = "{name: tests.helpers.slow.StallSetup, seconds: 120}"  # startup lasts until the stop
    run = launch(home, out, "early", "trainer.max_steps=40", f"callbacks=[{SLOW}, {stall}]")

    def workers_listening():  # the training process started and owns its stop signals
        workers = [p for p in local.run_pids(run.pgid) if os.getpgid(p) != run.pgid]
        return workers and all(torchrun.catches(p, signal.SIGTERM) for p in workers)

    wait(workers_listening, 120, "the training process to start")
    assert not train_losses(run.run_dir)  # still starting up: no step yet
    stopped = cli(home, "runs", "stop", run.id)
    assert stopped.returncode == 0, stopped.stderr
    done = wait_status(home, run.id, ("stopped", "completed", "failed"), timeout=120)
    assert (done.status, done.exit_code) == ("stopped", 75), done
    log = (Path(run.run_dir) / "logs" / "resumption-0.log").read_text()
    assert "before training started: nothing to save" in log and "== exit code 75" in log, log[-2000:]
    assert not (Path(run.run_dir) / "checkpoints").exists() and not train_losses(run.run_dir)


def test_stop_refuses_a_grace_period_that_is_not_a_finite_number(tmp_path):
    """``runs stop --timeout nan`` (or -1) SIGKILLed the workers at once, before they saved;
    ``inf`` never escalated. Refused with exit 2 before any run is looked up or signalled."""
    for bad in ("nan", "-1", "inf"):
        r = run_main("runs", "stop", "no-such-run", "--timeout", bad, env={"LLMFORGE_HOME": str(tmp_path)})
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"error: --timeout {float(bad)}: the grace period"), r.stderr
