"""``llmforge launch``, ``runs stop`` and ``runs restart``: from a YAML to a running, recorded job.

:func:`launch` loads the config with its overrides, picks the cluster (``--cluster``, else
``compute.cluster``), sizes the job (:func:`llmforge.runs.compute.plan_compute`), writes the run
record (config redacted) and starts the job on the cluster's backend: ``local`` (a detached
supervisor running torchrun), ``slurm`` (sbatch), ``skypilot`` (``sky.launch``) or ``sagemaker``
(a PyTorch estimator). Generated files go to ``<run_dir>/launch/``. ``dry_run`` returns the
script/task/estimator definition without writing or submitting anything.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.runs import local
from llmforge.runs.clusters import Cluster, get_cluster
from llmforge.runs.compute import ComputePlan, check_scheduling, plan_compute
from llmforge.runs.registry import RunRecord, RunRegistry, llmforge_home
from llmforge.runs.credentials import check_names, job_environment, secret_overrides


@dataclass
class LaunchResult:
    """What :func:`launch` did: the record (None for a dry run), the definition text, the plan."""

    run: Optional[RunRecord]
    definition: str
    plan: ComputePlan
    cluster: Cluster


def _rel(path: Path, workdir: Path) -> str:
    try:
        return str(path.resolve().relative_to(workdir.resolve()))
    except ValueError:
        return str(path.resolve())


def prepare(config_path: str, overrides: Sequence[str] = (), *, cluster: Optional[str] = None,
            gpus: Optional[int] = None, nodes: Optional[int] = None,
            secrets: Sequence[str] = ()) -> tuple[Any, Cluster, ComputePlan, dict[str, Any]]:
    """Load and size a launch; returns ``(cfg, cluster, plan, spec)`` (nothing is written).

    Raises:
        ConfigError: invalid config or overrides, a secret value in an override, an unknown or
            invalid cluster, a size that does not fit, a named secret that is not set.
    """
    from llmforge.config import load_config

    bad = secret_overrides(overrides)
    if bad:
        raise ConfigError(f"{', '.join(bad)}: do not put secret values on the command line (they would "
                          "be recorded); export them and forward them by name with --secret NAME")
    cfg = load_config(config_path, list(overrides))
    target = get_cluster(cluster or cfg.compute.cluster)
    plan = plan_compute(cfg, target, gpus, nodes)
    max_retries = check_scheduling(cfg)
    names = check_names([*cfg.compute.secrets, *secrets])
    workdir = Path.cwd()
    remote = target.type in ("skypilot", "sagemaker")  # paths relative to the synced folder
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    spec = {
        "config_path": _rel(Path(config_path), workdir) if remote else str(Path(config_path).resolve()),
        "overrides": list(overrides), "workdir": str(workdir),
        "run_dir": str(run_dir) if remote and not run_dir.is_absolute() else str(run_dir.resolve()),
        "home": str(llmforge_home()), "gpus": plan.world_size, "nodes": plan.nodes,
        "procs_per_node": plan.procs_per_node, "device": plan.device, "secrets": names,
        "max_retries": max_retries, "summary": plan.summary(), "cluster_type": target.type,
    }
    return cfg, target, plan, spec


def definition(run_id: str, name: str, spec: dict[str, Any], cluster: Cluster, resumption: int = 0) -> str:
    """The text a backend submits: a command line, an sbatch script, a task YAML or an estimator."""
    if cluster.type == "local":
        from llmforge.runs.supervisor import torchrun_command

        cmd = torchrun_command(spec, resume=resumption > 0)
        env = ", ".join(spec["secrets"]) or "none"
        return (f"# local: a detached supervisor runs, in {spec['workdir']} (output in "
                f"{spec['run_dir']}/logs/resumption-{resumption}.log; secrets forwarded: {env}):\n"
                + " ".join(cmd) + "\n")
    if cluster.type == "slurm":
        from llmforge.runs.slurm import sbatch_script

        return sbatch_script(run_id, name, spec, cluster, resumption)  # type: ignore[arg-type]
    if cluster.type == "skypilot":
        from llmforge.runs.skypilot import task_yaml

        return task_yaml(run_id, spec, cluster)  # type: ignore[arg-type]
    from llmforge.runs.sagemaker import estimator_definition

    return json.dumps(estimator_definition(run_id, name, spec, cluster), indent=2) + "\n"  # type: ignore[arg-type]


def _check_run_dir(spec: dict[str, Any], cfg: Any, registry: RunRegistry) -> None:
    if spec["cluster_type"] not in ("local", "slurm"):
        return
    run_dir = Path(spec["run_dir"])
    used = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").is_dir()
    if used and not cfg.checkpoint.resume:
        raise ConfigError(f"run directory {run_dir} already holds a run: choose another run.name "
                          "(e.g. run.name=my-run-2), or continue it with llmforge runs restart RUN")
    for other in registry.list():
        if other.active and other.run_dir == spec["run_dir"]:
            raise ConfigError(f"run {other.id} is {other.status} in {run_dir}; choose another run.name")


def _files_dir(spec: dict[str, Any]) -> Path:
    """``<run_dir>/launch`` for generated files (``logs/`` too: SLURM opens its output file there)."""
    out = Path(spec["run_dir"]) / "launch"
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / "logs").mkdir(exist_ok=True)
    return out


def submit(run: RunRecord, cluster: Cluster, registry: RunRegistry) -> RunRecord:
    """Start (or restart) ``run`` on its backend and record the process group or job id.

    Raises:
        LLMForgeError: the scheduler refused the job (the run is marked failed).
    """
    spec, k = run.spec, run.resumptions
    try:
        if cluster.type == "local":
            env = job_environment(spec["secrets"])
            env.update(LLMFORGE_RUN_ID=run.id, LLMFORGE_HOME=spec["home"], PYTHONUNBUFFERED="1")
            pgid = local.start_supervisor(run, env, spec["workdir"])
            registry.update(run.id, pgid=pgid, event=("submitted", f"supervisor pid/pgid {pgid}"))
        elif cluster.type == "slurm":
            from llmforge.runs import slurm

            path = _files_dir(spec) / f"sbatch-{k}.sh"
            path.write_text(definition(run.id, run.name, spec, cluster, k), encoding="utf-8")
            job = slurm.submit(str(path))
            registry.update(run.id, job_id=job, event=("submitted", f"SLURM job {job} ({path})"))
        elif cluster.type == "skypilot":
            from llmforge.runs import skypilot

            path = _files_dir(spec) / "task.yaml"
            path.write_text(definition(run.id, run.name, spec, cluster, k), encoding="utf-8")
            job = skypilot.submit(str(path), run.id, spec, cluster)  # type: ignore[arg-type]
            registry.update(run.id, job_id=job, event=("submitted", f"SkyPilot job {job}"))
        else:
            from llmforge.runs import sagemaker

            text = definition(run.id, run.name, spec, cluster, k)
            (_files_dir(spec) / "estimator.json").write_text(text, encoding="utf-8")
            job = sagemaker.submit(json.loads(text), cluster)  # type: ignore[arg-type]
            registry.update(run.id, job_id=job, event=("submitted", f"SageMaker job {job}"))
    except LLMForgeError as exc:
        registry.set_status(run.id, "failed", f"submit failed: {exc}", message=str(exc))
        raise
    return registry.get(run.id)


def launch(config_path: str, overrides: Sequence[str] = (), *, cluster: Optional[str] = None,
           gpus: Optional[int] = None, nodes: Optional[int] = None, dry_run: bool = False,
           secrets: Sequence[str] = (), registry: Optional[RunRegistry] = None) -> LaunchResult:
    """Record and start a run (see the module doc); ``dry_run`` only builds the definition.

    Raises:
        ConfigError: see :func:`prepare`; also a run directory that already holds a run.
        LLMForgeError: the backend refused the job.
    """
    from llmforge.config import config_to_dict, redact
    from llmforge.runs.registry import new_run_id

    cfg, target, plan, spec = prepare(config_path, overrides, cluster=cluster, gpus=gpus, nodes=nodes,
                                      secrets=secrets)
    if dry_run:
        rid = new_run_id(cfg.run.name)
        return LaunchResult(None, definition(rid, cfg.run.name, spec, target), plan, target)
    registry = registry or RunRegistry()
    _check_run_dir(spec, cfg, registry)
    run = registry.create(cfg.run.name, target.name, target.type, config=redact(config_to_dict(cfg)),
                          spec=spec, run_dir=spec["run_dir"])
    run = submit(run, target, registry)
    return LaunchResult(run, definition(run.id, run.name, spec, target), plan, target)


def refresh(registry: RunRegistry) -> list[str]:
    """Mark ``failed`` the active runs whose processes died without saying so (local: no live
    process in the group; slurm: the job left the queue). Returns their ids."""
    died = []
    for run in registry.list():
        if not run.active:
            continue
        if run.kind == "local":
            if run.pgid is None and time.time() - run.created_at > 120:
                detail = "the launch did not start a supervisor"
            elif run.pgid is None or local.group_alive(run.pgid):
                continue
            else:
                detail = f"process group {run.pgid} is gone without a final status (killed?)"
        elif run.kind == "slurm" and run.job_id:
            from llmforge.runs.slurm import job_state

            if job_state(run.job_id) != "":
                continue
            detail = f"SLURM job {run.job_id} left the queue without a final status"
        else:
            continue
        if registry.set_status(run.id, "failed", detail, only_if_active=True, message=detail):
            died.append(run.id)
    return died


def stop(ref: str, *, wait: bool = True, timeout: float = 180.0,
         registry: Optional[RunRegistry] = None) -> RunRecord:
    """Stop a run: SIGTERM to a local run's process group and its workers (they save and exit
    75), or cancel the scheduler job; waits up to ``timeout`` seconds for local processes.

    Raises:
        RunNotFound: no such run. LLMForgeError: the run is not active, processes outlived the
        timeout, or the scheduler refused.
    """
    registry = registry or RunRegistry()
    refresh(registry)
    run = registry.resolve(ref)
    if not run.active:
        raise LLMForgeError(f"run {run.id} is already {run.status}")
    registry.update(run.id, stop_requested=1, event=("stop", "stop requested"))
    if run.kind == "local":
        pids = local.signal_run(run.pgid or 0, signal.SIGTERM) if run.pgid else []
        if wait and not local.wait_gone(pids, timeout):
            raise LLMForgeError(f"run {run.id}: processes {local.run_pids(run.pgid or 0)} still alive "
                                f"{timeout:.0f}s after SIGTERM")
        if not wait:
            return registry.get(run.id)
    elif run.kind == "slurm":
        from llmforge.runs.slurm import cancel

        cancel(run.job_id or "")
    elif run.kind == "skypilot":
        from llmforge.runs.skypilot import cancel as sky_cancel

        sky_cancel(run.job_id or "")
    else:
        from llmforge.runs.sagemaker import stop as sm_stop

        sm_stop(run.job_id or "")
    registry.set_status(run.id, "stopped", "stopped by llmforge runs stop", only_if_active=True)
    return registry.get(run.id)


def restart(ref: str, overrides: Sequence[str] = (), *, registry: Optional[RunRegistry] = None) -> RunRecord:
    """Start a stopped, failed or completed run again from its newest checkpoint
    (``checkpoint.resume=auto``) as a new resumption; ``overrides`` are added to the run's.

    Raises:
        RunNotFound: no such run. ConfigError: the run is still active, a secret override, or a
        forwarded secret is no longer set. LLMForgeError: the backend refused.
    """
    registry = registry or RunRegistry()
    refresh(registry)
    run = registry.resolve(ref)
    if run.active:
        raise ConfigError(f"run {run.id} is {run.status}; stop it first (llmforge runs stop {run.id})")
    bad = secret_overrides(overrides)
    if bad:
        raise ConfigError(f"{', '.join(bad)}: forward secrets by name (--secret), not as overrides")
    spec = dict(run.spec)
    check_names(spec.get("secrets", []))
    spec["overrides"] = [*spec.get("overrides", []), *overrides]
    target = get_cluster(run.cluster)
    k = registry.increment(run.id, "resumptions")
    registry.update(run.id, spec=spec, status="pending", retries=0, stop_requested=0, exit_code=None,
                    ended_at=None, message=None, pgid=None,
                    event=("restart", f"manual restart as resumption {k} (checkpoint.resume=auto)"))
    return submit(registry.get(run.id), target, registry)


def wait_for(run_id: str, statuses: Sequence[str], timeout: float,
             registry: Optional[RunRegistry] = None) -> RunRecord:
    """Poll until the run has one of ``statuses`` (refreshing liveness); returns the record.

    Raises:
        LLMForgeError: the timeout (seconds) passed first.
    """
    registry = registry or RunRegistry()
    end = time.monotonic() + timeout
    while True:
        refresh(registry)
        run = registry.get(run_id)
        if run.status in statuses:
            return run
        if time.monotonic() > end:
            raise LLMForgeError(f"run {run_id} is {run.status} after {timeout:.0f}s")
        time.sleep(0.5)


__all__ = ["LaunchResult", "launch", "prepare", "refresh", "restart", "stop", "submit", "wait_for",
           "definition"]
