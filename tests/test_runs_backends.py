"""The backend protocol and the registry around it, without a scheduler or a network: a
registered backend is a cluster type like the built-ins; an old runs.db gains the new column; a
SLURM-requeued run shows pending; runs delete/restart refuse what would orphan a job or train
nothing (exit 2); the SageMaker SDK message, channels and entry script."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DEMO, REPO
from llmforge.cli import main
from llmforge.job.records import SCHEMA_VERSION, RegistryError, RunRegistry
from llmforge.runs.slurm import SlurmBackend


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    return tmp_path


def test_a_registered_backend_is_a_cluster_type_like_the_builtins(home, capsys):
    from llmforge.registry import backends
    from llmforge.runs.backend import Backend
    from llmforge.runs.cluster_types import Cluster
    from llmforge.runs.clusters import load_clusters

    @dataclass
    class LabCluster(Cluster):
        queue: str = "default"
        """The lab queue."""

    class LabBackend(Backend):
        type = "lab"
        cluster_class = LabCluster

        def where(self):
            return f"queue {self.cluster.queue}"

    backends.register("lab", LabBackend)
    try:
        (home / "clusters.yaml").write_text("mine: {type: lab, queue: fast, gpus_per_node: 4}\n")
        assert load_clusters(detect=False)["mine"] == LabCluster(name="mine", type="lab", queue="fast",
                                                                 gpus_per_node=4)
        assert main(["clusters"]) == 0 and "queue fast" in capsys.readouterr().out
        (home / "clusters.yaml").write_text("mine: {type: lab, qeue: fast}\n")
        assert main(["clusters"]) == 2
        assert "mine.qeue: unknown key for a lab cluster (did you mean 'queue'?)" in capsys.readouterr().err
    finally:
        backends._items.pop("lab")


OLD_SCHEMA = """CREATE TABLE runs (id TEXT PRIMARY KEY, name TEXT NOT NULL, cluster TEXT NOT NULL,
kind TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL, ended_at REAL,
config TEXT, spec TEXT, run_dir TEXT, pgid INTEGER, job_id TEXT, last_step INTEGER, last_loss REAL,
resumptions INTEGER NOT NULL DEFAULT 0, retries INTEGER NOT NULL DEFAULT 0, exit_code INTEGER,
stop_requested INTEGER NOT NULL DEFAULT 0, message TEXT);
CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, time REAL NOT NULL,
kind TEXT NOT NULL, detail TEXT);
INSERT INTO runs (id, name, cluster, kind, status, created_at, spec, last_step)
VALUES ('old-abc123', 'old', 'big', 'slurm', 'completed', 1.0, '{"gpus": 16}', 200);
INSERT INTO events (run_id, time, kind, detail) VALUES ('old-abc123', 1.0, 'created', 'on big (slurm)');
"""


def test_an_old_schema_registry_opens_and_gains_the_new_column(tmp_path):
    db = tmp_path / "runs.db"
    con = sqlite3.connect(db)
    con.executescript(OLD_SCHEMA)
    con.close()
    reg = RunRegistry(db)
    run = reg.get("old-abc123")
    assert (run.status, run.spec, run.last_step, run.backend_state) == ("completed", {"gpus": 16}, 200, None)
    reg.update(run.id, backend_state="gone")
    assert reg.get(run.id).backend_state == "gone" and [e["kind"] for e in reg.events(run.id)] == ["created"]
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    assert "backend_state" in [r[1] for r in con.execute("PRAGMA table_info(runs)")]
    RunRegistry(db)  # opening it again changes nothing
    con.execute("PRAGMA user_version = 99")
    con.commit()
    with pytest.raises(RegistryError, match="schema 99 is newer than this llmforge's") as info:
        RunRegistry(db)
    assert info.value.exit_code == 2


def _fake(tmp_path, monkeypatch, name, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_run_requeued_by_slurm_shows_pending_while_slurm_holds_it(home, tmp_path, monkeypatch, capsys):
    from llmforge.runs.launch import refresh

    reg = RunRegistry()
    mine = reg.create("pre", "big", "slurm", job_id="4242")
    reg.set_status(mine.id, "stopped", "received SIGUSR1: saved the checkpoint of step 30", exit_code=75)
    user = reg.create("usr", "big", "slurm", job_id="4343", stop_requested=1)
    reg.set_status(user.id, "stopped", "stopped by llmforge runs stop")
    _fake(tmp_path, monkeypatch, "squeue", 'echo "PENDING"')
    assert refresh(reg) == []
    now = reg.get(mine.id)
    assert (now.status, now.ended_at, now.exit_code, now.backend_state) == ("pending", None, None, "pending")
    assert reg.events(mine.id)[-1]["detail"] == "requeued: SLURM holds job 4242 (PENDING)"
    assert reg.get(user.id).status == "stopped"  # a stop the user asked for is never undone
    assert main(["runs", "list", "--status", "pending"]) == 0 and mine.id in capsys.readouterr().out

    _fake(tmp_path, monkeypatch, "squeue", "exit 0")  # the job left the queue, unreported
    assert refresh(reg) == [mine.id] and reg.get(mine.id).status == "failed"
    reg.set_status(mine.id, "stopped", "again")
    refresh(reg)
    assert reg.get(mine.id).backend_state == "gone"  # known gone: not asked about again


def test_delete_of_a_running_run_needs_force_which_stops_it_first(home, capsys):
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        reg = RunRegistry()
        run = reg.create("busy", "local", "local", pgid=job.pid)
        reg.set_status(run.id, "running", "training started")
        assert main(["runs", "delete", run.id]) == 2
        assert capsys.readouterr().err == (f"error: run {run.id} is running: stop it first (llmforge runs "
                                           f"stop {run.id}), or pass --force to stop it and then delete it\n")
        assert reg.get(run.id).status == "running" and job.poll() is None  # nothing happened
        assert main(["runs", "delete", run.id, "--force", "--timeout", "20"]) == 0
        assert job.wait(timeout=5) == -15 and reg.list() == []
        assert capsys.readouterr().out == f"{run.id}: stopped\ndeleted record {run.id}\n"
    finally:
        if job.poll() is None:
            job.kill()


def test_restart_with_nothing_left_to_train_exits_2_saying_why(home, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "done"
    for step in (100, 200):
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE").write_text("")
    (run_dir / "checkpoints" / "step_00000300").mkdir()  # torn: no COMPLETE
    reg = RunRegistry()
    spec = {"config_path": DEMO, "overrides": ["trainer.max_steps=200"], "workdir": str(REPO), "secrets": []}
    run = reg.create("done", "local", "local", spec=spec, run_dir=str(run_dir))
    reg.set_status(run.id, "completed", "done", exit_code=0)
    assert main(["runs", "restart", run.id, "trainer.max_steps=12"]) == 2
    assert capsys.readouterr().err == (
        f"error: run {run.id} is already at step 200 (newest checkpoint in {run_dir / 'checkpoints'}) and "
        "trainer.max_steps=12: the restart would train nothing; restart with trainer.max_steps above 200 "
        f"(e.g. llmforge runs restart {run.id} trainer.max_steps=212 checkpoint.allow_config_changes=true), "
        "or launch a new run\n")
    assert main(["runs", "restart", run.id, "trainer.max_stepz=400"]) == 2
    assert "trainer.max_stepz" in capsys.readouterr().err
    after = reg.get(run.id)
    assert (after.status, after.resumptions, after.spec) == ("completed", 0, spec)  # untouched


def test_restart_runs_the_jobs_resume_check_first(home, tmp_path, capsys, monkeypatch):
    """A longer cosine schedule is refused before submitting (the job would exit 2, issue 27.4);
    the suggested override, with checkpoint.allow_config_changes=true, is submitted."""
    import llmforge.runs.launch as launch
    from llmforge.config import config_to_dict, load_config, redact

    ckpt = tmp_path / "runs" / "done" / "checkpoints" / "step_00000050"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    saved = redact(config_to_dict(load_config(DEMO, ["trainer.max_steps=50"])))
    (ckpt / "meta.json").write_text(json.dumps({"step": 50, "world_size": 1, "config": saved}))
    reg = RunRegistry()
    spec = {"config_path": DEMO, "overrides": ["trainer.max_steps=50"], "workdir": str(REPO), "secrets": []}
    run = reg.create("done", "local", "local", spec=spec, run_dir=str(ckpt.parent.parent))
    reg.set_status(run.id, "completed", "done", exit_code=0)
    submitted = []
    monkeypatch.setattr(launch, "submit", lambda record, target, registry: submitted.append(record) or record)
    assert main(["runs", "restart", run.id, "trainer.max_steps=100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run {run.id}: the restarted job would stop at once: checkpoint.resume: ")
    assert "trainer.max_steps 50 -> 100 (the learning-rate schedule's length)" in err
    assert "checkpoint.allow_config_changes=true" in err and not submitted
    assert reg.get(run.id).resumptions == 0
    assert main(["runs", "restart", run.id, "trainer.max_steps=100", "checkpoint.allow_config_changes=true"]) == 0
    assert len(submitted) == 1 and submitted[0].spec["overrides"][-1] == "checkpoint.allow_config_changes=true"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's one-process save
def test_restart_into_a_model_of_another_shape_is_refused_even_when_allowed(home, tmp_path, capsys, monkeypatch):
    """Issue 27.4: checkpoint.allow_config_changes=true (given now, or kept from an earlier
    restart) let a model.dim change through, and the job failed at load; the restart now loads
    the checkpoint's metadata into the model built on meta and refuses with both shapes. A model
    key that keeps the shapes is still the resume check's to allow."""
    import torch.distributed.checkpoint as dcp

    import llmforge.runs.launch as launch
    from conftest import TINY_OVERRIDES
    from llmforge.config import config_to_dict, load_config, redact
    from llmforge.registry import models

    ckpt = tmp_path / "runs" / "done" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    overrides = [*TINY_OVERRIDES, "trainer.max_steps=4"]
    cfg = load_config(DEMO, overrides)
    dcp.save({"model": models.get("llama3")(cfg.model).state_dict()}, checkpoint_id=str(ckpt))
    (ckpt / "meta.json").write_text(json.dumps({"step": 4, "world_size": 1,
                                                "config": redact(config_to_dict(cfg))}))
    reg = RunRegistry()
    spec = {"config_path": DEMO, "overrides": [*overrides, "checkpoint.allow_config_changes=true"],
            "workdir": str(REPO), "secrets": []}
    run = reg.create("done", "local", "local", spec=spec, run_dir=str(ckpt.parent.parent))
    reg.set_status(run.id, "completed", "done", exit_code=0)
    submitted = []
    monkeypatch.setattr(launch, "submit", lambda record, target, registry: submitted.append(record) or record)
    assert main(["runs", "restart", run.id, "trainer.max_steps=8", "model.dim=128"]) == 2
    assert capsys.readouterr().err == (
        f"error: run {run.id}: the restarted job would stop at once: checkpoint.resume: {ckpt}: parameter "
        "tok_embeddings.weight has shape (1024, 64) in the checkpoint, but this model's is (1024, 128); it "
        "was saved by a model of another size or architecture; resume with the settings it was saved "
        f"with, or start a new run (e.g. llmforge runs restart {run.id} model.dim=64)\n")
    assert not submitted and reg.get(run.id).spec == spec
    assert main(["runs", "restart", run.id, "trainer.max_steps=8", "model.rope_theta=1000.0"]) == 0  # same shapes
    assert len(submitted) == 1


def test_sagemaker_sdk_message_names_the_installed_version(monkeypatch):
    import importlib.metadata

    from llmforge.errors import LLMForgeError
    from llmforge.runs.sagemaker import SDK, sdk_estimator

    monkeypatch.setitem(sys.modules, "sagemaker", None)  # importing it fails, as for SDK 3.x's layout
    monkeypatch.setitem(sys.modules, "sagemaker.pytorch", None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.27.0")
    with pytest.raises(LLMForgeError) as info:
        sdk_estimator()
    assert str(info.value) == ("the sagemaker cluster type cannot submit: sagemaker 3.27.0 is installed, but SDK "
                               "3.x has no sagemaker.pytorch (llmforge submits through SDK 2.x's "
                               f"sagemaker.pytorch.PyTorch); pip install '{SDK}' (or pip install "
                               "'llmforge[sagemaker]'); --dry-run prints the definition without it")
    assert SDK in (REPO / "pyproject.toml").read_text()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(LLMForgeError, match="the SageMaker Python SDK is not installed; pip install"):
        sdk_estimator()


def test_sagemaker_channels_become_data_paths():
    from llmforge.cli.sagemaker_entry import train_argv

    env = {"SM_CHANNEL_TRAIN": "/opt/ml/input/data/train", "SM_CHANNEL_EXTRA": "/opt/ml/input/data/extra"}
    argv = ["--config", "yamls/demo_cpu.yaml", "--overrides", "trainer.max_steps=5 run.name=sm",
            "--channel_keys", json.dumps({"train": "data.path", "extra": "variables.extra_dir"})]
    assert train_argv(argv, env) == [
        "train", "yamls/demo_cpu.yaml", "trainer.max_steps=5", "run.name=sm",
        "variables.extra_dir=/opt/ml/input/data/extra/**/*.*", "data.path=/opt/ml/input/data/train/**/*.*",
        "run.output_dir=/opt/ml/checkpoints", "checkpoint.resume=auto"]
    mine = train_argv([*argv[:3], "data.path=/mine/*.txt", *argv[4:]], env)
    assert "data.path=/mine/*.txt" in mine and not any(a.startswith("data.path=/opt") for a in mine)


def test_sagemaker_entry_runs_train_as_its_process_own_command(monkeypatch):
    """The job's entry script is its process: a stop during startup ends it at once, as under
    `llmforge train` (llmforge.signals; raised inside torch's import it could abort: exit 134)."""
    import llmforge.cli
    from llmforge.cli import sagemaker_entry

    seen = []
    monkeypatch.setattr(llmforge.cli, "main", lambda argv, **kw: seen.append((argv, kw)) or 0)
    assert sagemaker_entry.main(["--config", "c.yaml"]) == 0
    assert seen == [(["train", "c.yaml", "run.output_dir=/opt/ml/checkpoints", "checkpoint.resume=auto"],
                     {"own_process": True})]


def test_sagemaker_entry_runs_as_a_script_and_nothing_beside_it_shadows_a_module(tmp_path):
    from llmforge.cli import sagemaker_entry

    here = Path(sagemaker_entry.__file__).parent
    shadowing = sorted(p.stem for p in here.glob("*.py") if p.stem in sys.stdlib_module_names)
    assert shadowing == []  # runs/secrets.py once hid the stdlib's secrets from numpy
    env = {**os.environ, "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train"}
    out = subprocess.run([sys.executable, str(here / "sagemaker_entry.py"), "--config", "yamls/demo_cpu.yaml",
                          "--channel_keys", '{"train": "data.path"}', "--print-command"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("llmforge train yamls/demo_cpu.yaml 'data.path=/opt/ml/input/data/train/**/*.*' "
                          "run.output_dir=/opt/ml/checkpoints checkpoint.resume=auto\n")


def test_the_backend_example_in_docs_runs(home, monkeypatch, capsys):
    from llmforge.registry import backends

    text = (REPO / "docs" / "backends.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(REPO)
    try:
        with pytest.raises(SystemExit) as info:
            exec(compile(code, "lab_queue.py", "exec"), {"__name__": "__main__"})
    finally:
        backends._items.pop("lab", None)
    assert info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# 1 CPU processes = 1 node(s) x 1 on mine")
    assert out[1].startswith("lab-submit --queue fast --name demo_cpu-") and out[1].endswith(
        f"-- python -m llmforge.job.torchrun --nproc-per-node=1 -m llmforge train {DEMO} "
        "checkpoint.resume=auto")


def test_default_cancel_calls_stop_job_and_scheduler_variables_join_the_environment():
    from llmforge.runs.backend import Backend
    from llmforge.job.records import RunRecord

    stopped = []

    class Queue(Backend):
        def stop_job(self, job_id):
            stopped.append(job_id)

        def scheduler_variables(self):
            return {"QUEUE_RANK": "<set by the queue>"}

    record = RunRecord(id="r1", name="r", cluster="q", kind="train", status="running",
                       created_at=0.0, job_id="q-7")
    assert Queue().cancel(record) is True and stopped == ["q-7"]
    env = Queue().job_environment({"secrets": ["HF_TOKEN"]}, {"HF_TOKEN": "x"})
    assert env == {"HF_TOKEN": "x", "LLMFORGE_RUN_ID": "<set by the job>",
                   "LLMFORGE_HOME": "<set by the job>", "PYTHONUNBUFFERED": "<set by the job>",
                   "QUEUE_RANK": "<set by the queue>"}


def test_stop_escalates_to_sigkill_for_a_process_that_ignores_sigterm(home, capsys):
    # a local run's process that ignores SIGTERM (sh's `trap '' TERM` is inherited by sleep)
    job = subprocess.Popen(["sh", "-c", "trap '' TERM; echo trapped; sleep 60 & wait; sleep 60"],
                           start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        reg = RunRegistry()
        run = reg.create("stuck", "local", "local", pgid=job.pid)
        reg.set_status(run.id, "running", "training started")
        assert job.stdout.readline() == "trapped\n"  # sh has set its trap (a sleep raced a loaded machine)
        assert main(["runs", "stop", run.id, "--timeout", "1"]) == 0
        assert job.wait(timeout=5) == -9  # SIGTERM ignored, SIGKILL after the 1 s grace period
        now = reg.get(run.id)
        assert now.status == "stopped" and now.message is None
        kill = [e for e in reg.events(run.id) if e["kind"] == "kill"]
        assert len(kill) == 1 and str(job.pid) in kill[0]["detail"] and "within 1s of SIGTERM" in kill[0]["detail"]
        assert capsys.readouterr().out == f"{run.id}: stopped\n"
    finally:
        if job.poll() is None:
            job.kill()
        job.stdout.close()


@pytest.mark.parametrize("fault_tolerant", [False, True])
def test_logs_follow_prints_every_line_across_a_restart_and_the_end(home, capsys, monkeypatch, fault_tolerant):
    import llmforge.runs.launch as launch

    logs = home / "runs" / "f" / "logs"
    logs.mkdir(parents=True)
    reg = RunRegistry()
    # a fault-tolerant run's replica group appends its restarts to its one log (group-0.log)
    spec = {"fault_tolerance": {"groups": [{"name": "f-g0"}]}} if fault_tolerant else {}
    run = reg.create("f", "local", "local", spec=spec, run_dir=str(logs.parent))
    reg.set_status(run.id, "running", "training started")
    first, second = (("group-0.log",) * 2 if fault_tolerant else ("resumption-0.log", "resumption-1.log"))
    (logs / first).write_bytes("r0 step 1 \u2588\n".encode()[:-2])  # a read cuts the bar's block in two
    polls = []

    def supervisor_writes(registry):  # what lands between `--follow`'s read and its next poll
        polls.append(1)
        if len(polls) == 1:  # the first run's last line, then the restart
            with open(logs / first, "ab") as f:
                f.write("\u2588\nr0 step 2, its last\n".encode()[2:])
            registry.increment(run.id, "resumptions")
            with open(logs / second, "a") as f:
                f.write("r1 step 3\n")
        else:  # the run's last line, then its end
            with open(logs / second, "a") as f:
                f.write("r1 done\n")
            registry.set_status(run.id, "completed", "done")
        return []

    monkeypatch.setattr(launch, "refresh", supervisor_writes)
    assert main(["runs", "logs", run.id, "--follow"]) == 0
    # nothing lost at the switch or the end, nothing printed twice from the one log
    assert capsys.readouterr().out == "r0 step 1 \u2588\nr0 step 2, its last\nr1 step 3\nr1 done\n"
    assert len(polls) == 2


def test_logs_follow_of_an_ended_run_without_a_log_exits_2(home, capsys, monkeypatch, tmp_path):
    run_dir = home / "runs" / "gone"
    run = RunRegistry().create("gone", "local", "local", run_dir=str(run_dir))
    RunRegistry().set_status(run.id, "failed", "exited before its log")
    assert main(["runs", "logs", run.id, "--follow"]) == 2
    assert capsys.readouterr().err == (f"error: no log {run_dir}/logs/resumption-0.log: run {run.id} is failed "
                                       f"and wrote none (resumptions of this run: 0..0)\n")
    # a record without a run directory printed logs/resumption-0.log of the current directory
    bare = RunRegistry().create("bare", "local", "local")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "resumption-0.log").write_text("someone else's\n")
    assert main(["runs", "logs", bare.id]) == 2
    assert capsys.readouterr().err == f"error: run {bare.id} has no run directory here, so no log to show\n"


def test_logs_of_a_fault_tolerant_run_by_replica_group(home, capsys):
    run_dir = home / "runs" / "ft"
    (run_dir / "logs").mkdir(parents=True)
    spec = {"fault_tolerance": {"groups": [{"name": "ft-g0"}, {"name": "ft-g1"}]}}
    run = RunRegistry().create("ft", "local", "local", spec=spec, run_dir=str(run_dir))
    assert main(["runs", "logs", run.id]) == 2
    assert capsys.readouterr().err == (f"error: no log {run_dir}/logs/group-0.log (resumptions of this run: 0..0); "
                                       f"replica group 0's log; the other groups': {run_dir}/logs/group-1.log "
                                       f"(--group G); the lighthouse's: {run_dir}/logs/lighthouse.log\n")
    for name, text in (("group-0", "step 1\n"), ("group-1", "g1 step 1\n"), ("lighthouse", "quorum\n")):
        (run_dir / "logs" / f"{name}.log").write_text(text)
    assert main(["runs", "logs", run.id]) == 0 and capsys.readouterr().out == "step 1\n"
    for group, text in (("1", "g1 step 1\n"), ("ft-g1", "g1 step 1\n"), ("lighthouse", "quorum\n")):
        assert main(["runs", "logs", run.id, "--group", group]) == 0 and capsys.readouterr().out == text
    # bad input: exit 2 naming what the run has; a group's restarts append to its one log
    assert main(["runs", "logs", run.id, "--group", "2"]) == 2
    assert capsys.readouterr().err == (f"error: --group 2: run {run.id} has replica groups 0..1 (ft-g0, ft-g1) "
                                       "and the lighthouse; name one of them\n")
    assert main(["runs", "logs", run.id, "--resumption", "1"]) == 2
    assert "each replica group restarts alone" in capsys.readouterr().err
    assert main(["runs", "logs", run.id, "--group", "\u00b2"]) == 2  # isdigit(), but not a number
    assert capsys.readouterr().err.startswith("error: --group \u00b2: run ")
    assert main(["runs", "logs", run.id, "--resumption", "-1"]) == 2
    assert capsys.readouterr().err == "error: --resumption -1: resumptions count from 0 (this run's: 0..0)\n"
    plain = RunRegistry().create("plain", "local", "local", run_dir=str(run_dir))
    assert main(["runs", "logs", plain.id, "--group", "0"]) == 2
    assert "has no replica groups (it is not a fault-tolerant run)" in capsys.readouterr().err
    # SLURM: each group is its own job, writing resumption logs into its own run directory
    g1 = home / "runs" / "ft-g1"
    (g1 / "logs").mkdir(parents=True)
    (g1 / "logs" / "resumption-0.log").write_text("slurm g1\n")
    spec = {"fault_tolerance": {"groups": [{"name": "s-g0", "run_dir": str(home / "runs" / "ft-g0")},
                                           {"name": "s-g1", "run_dir": str(g1)}]}}
    slurm = RunRegistry().create("s", "cluster", "slurm", spec=spec, run_dir=str(run_dir))
    assert SlurmBackend().logs(slurm, 0, "1") == (g1 / "logs" / "resumption-0.log",
                                                                "; replica group 1's log")
