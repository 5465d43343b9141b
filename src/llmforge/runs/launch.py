"""``llmforge launch``, ``runs stop`` and ``runs restart``: from a YAML to a running, recorded job.

:func:`launch` loads the config with its overrides, picks the cluster (``--cluster``, else
``compute.cluster``), sizes the job (:func:`llmforge.runs.compute.plan_compute`), runs the
checks the job would run at its start (:func:`llmforge.runs.checks.check_job`), writes the run
record (config redacted) and starts the job through the cluster's backend
(:mod:`llmforge.runs.backend`: ``local``, ``slurm``, ``skypilot``, ``sagemaker`` or a registered
one). Generated files go to ``<run_dir>/launch/``. ``dry_run`` returns the definition the
backend would submit without writing or submitting anything. With ``strategy.name: auto`` on a
GPU cluster, the planner (:func:`llmforge.runs.auto_layout.auto_overrides`) chooses the layout
for the cluster's GPU kind and its overrides are added to the job's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from llmforge.config import config_to_dict, load_config, redact
from llmforge.config.loader import read_config, resolve_config
from llmforge.errors import ConfigError, LLMForgeError
from llmforge.job.ft_groups import group_names
from llmforge.job.records import llmforge_home, new_run_id, RunRecord, RunRegistry
from llmforge.run_guard import check_run_dir
from llmforge.runs.backend import Backend, backend_for, backend_of
from llmforge.runs.checks import check_job, check_restart
from llmforge.runs.cluster_types import Cluster
from llmforge.runs.clusters import get_cluster
from llmforge.runs.compute import ComputePlan, check_scheduling, plan_compute
from llmforge.runs.credentials import check_names, secret_overrides


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
    """Load, size and check a launch; returns ``(cfg, cluster, plan, spec)`` (nothing is written).

    Raises:
        ConfigError: invalid config or overrides, a secret value in an override, an unknown or
            invalid cluster, a size that does not fit, a named secret that is not set, or
            anything the job would refuse at its start (:func:`llmforge.runs.checks.check_job`).
    """
    bad = secret_overrides(overrides)
    if bad:
        raise ConfigError(f"{', '.join(bad)}: do not put secret values on the command line (they would "
                          "be recorded); export them and forward them by name with --secret NAME")
    raw = read_config(config_path, list(overrides))  # read once: resolved here and in the job's environment
    cfg = resolve_config(raw)
    target = get_cluster(cluster or cfg.compute.cluster)
    backend = backend_for(target)
    plan = plan_compute(cfg, target, gpus, nodes)
    if plan.world_size > 1 and target.gpus_per_node and _asks_for_auto(config_path, overrides):
        # heavy (torch: the simulation): only a GPU job with strategy auto plans its layout
        from llmforge.runs.auto_layout import auto_overrides

        planned = auto_overrides(cfg, target, plan.world_size)
        if planned is not None:  # the job runs with the winner's overrides: its config.yaml says it
            overrides = [*overrides, *planned[0]]
            cfg = load_config(config_path, list(overrides))
            plan = plan_compute(cfg, target, gpus, nodes)
            plan.layout_note = planned[1]
    max_retries = check_scheduling(cfg)
    names = check_names([*cfg.compute.secrets, *secrets])
    workdir = Path.cwd()
    remote = backend.uploads_workdir  # paths relative to the uploaded folder
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    spec = {
        "config_path": _rel(Path(config_path), workdir) if remote else str(Path(config_path).resolve()),
        "overrides": list(overrides), "workdir": str(workdir),
        "run_dir": str(run_dir) if remote and not run_dir.is_absolute() else str(run_dir.resolve()),
        "home": str(llmforge_home()), "gpus": plan.world_size, "nodes": plan.nodes,
        "procs_per_node": plan.procs_per_node, "device": plan.device, "secrets": names,
        "max_retries": max_retries, "summary": plan.summary(), "cluster_type": target.type,
        "data_workers": int(cfg.data.num_workers),
    }
    ft = cfg.get("fault_tolerance")
    if ft is not None and ft.enabled:
        spec["fault_tolerance"] = ft_spec(cfg, Path(spec["run_dir"]))
    check_job(raw, cfg, spec, backend, local_files=backend.runs_here)
    return cfg, target, plan, spec


def ft_spec(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """The launch of a fault-tolerant run (docs/fault_tolerance.md): the lighthouse the launch
    starts (at ``fault_tolerance.lighthouse``'s port) and one job per replica group, each with
    its own run directory beside ``run_dir`` (``<run.name>-g<G>``: runs never nest)."""
    ft = cfg.fault_tolerance
    names = group_names(str(cfg.run.name), int(ft.replica_groups))
    return {"replica_groups": int(ft.replica_groups), "min_replicas": int(ft.min_replicas),
            "lighthouse": str(ft.lighthouse),
            "groups": [{"name": n, "run_dir": str(run_dir.parent / n)} for n in names]}


def _asks_for_auto(config_path: str, overrides: Sequence[str]) -> bool:
    """Whether the YAML or an override sets ``strategy.name: auto`` itself (the default, unset,
    keeps auto's rule without planning: a launch plans only when asked to)."""
    for o in reversed(list(overrides)):
        if o.split("=", 1)[0].strip() == "strategy.name":
            return o.split("=", 1)[1].strip() == "auto"
    try:
        data = yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return False
    strategy = data.get("strategy") if isinstance(data, dict) else None
    return isinstance(strategy, dict) and strategy.get("name") == "auto"


def definition(run_id: str, name: str, spec: dict[str, Any], cluster: Cluster, resumption: int = 0) -> str:
    """The text the cluster's backend submits (:meth:`Backend.render`)."""
    return backend_for(cluster).render(run_id, name, spec, resumption)


def _check_run_dir(spec: dict[str, Any], cfg: Any, registry: RunRegistry, backend: Backend) -> None:
    if backend.uploads_workdir:  # the run directory is not on this machine
        return
    run_dir = Path(spec["run_dir"])
    check_run_dir(run_dir, "run.name")  # a link, or a folder llmforge did not make
    used = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").is_dir()
    if used and not cfg.checkpoint.resume:
        raise ConfigError(f"run directory {run_dir} already holds a run: choose another run.name "
                          "(e.g. run.name=my-run-2), or continue it with llmforge runs restart RUN")
    for other in registry.list():
        if other.active and other.run_dir == spec["run_dir"]:
            raise ConfigError(f"run {other.id} is {other.status} in {run_dir}; choose another run.name")
    for group in (spec.get("fault_tolerance") or {}).get("groups", []):  # each group's own folder
        folder = Path(group["run_dir"])
        check_run_dir(folder, "run.name")
        if ((folder / "metrics.jsonl").exists() or (folder / "checkpoints").is_dir()) and not cfg.checkpoint.resume:
            raise ConfigError(f"run directory {folder} (replica group {group['name']}) already holds a run: "
                              "choose another run.name, or continue it with llmforge runs restart RUN")


def submit(run: RunRecord, cluster: Cluster, registry: RunRegistry) -> RunRecord:
    """Start (or restart) ``run`` through its backend and record the process group or job id.

    Raises:
        LLMForgeError: the scheduler refused the job (the run is marked failed).
    """
    try:
        fields, detail = backend_for(cluster).submit(run)
    except LLMForgeError as exc:
        registry.set_status(run.id, "failed", f"submit failed: {exc}", message=str(exc))
        raise
    registry.update(run.id, event=("submitted", detail), **fields)
    return registry.get(run.id)


def launch(config_path: str, overrides: Sequence[str] = (), *, cluster: Optional[str] = None,
           gpus: Optional[int] = None, nodes: Optional[int] = None, dry_run: bool = False,
           secrets: Sequence[str] = (), registry: Optional[RunRegistry] = None) -> LaunchResult:
    """Record and start a run (see the module doc); ``dry_run`` only builds the definition.

    Raises:
        ConfigError: see :func:`prepare`; also a run directory that already holds a run.
        LLMForgeError: the backend refused the job.
    """
    cfg, target, plan, spec = prepare(config_path, overrides, cluster=cluster, gpus=gpus, nodes=nodes,
                                      secrets=secrets)
    if dry_run:
        rid = new_run_id(cfg.run.name)
        return LaunchResult(None, definition(rid, cfg.run.name, spec, target), plan, target)
    registry = registry or RunRegistry()
    _check_run_dir(spec, cfg, registry, backend_for(target))
    run = registry.create(cfg.run.name, target.name, target.type, config=redact(config_to_dict(cfg)),
                          spec=spec, run_dir=spec["run_dir"])
    run = submit(run, target, registry)
    return LaunchResult(run, definition(run.id, run.name, spec, target), plan, target)


def refresh(registry: RunRegistry) -> list[str]:
    """Bring the registry in line with what the backends see (:meth:`Backend.poll`): an active
    run whose job is gone without a final status is ``failed``; a run that stopped on its own
    (preempted, exit 75) and that the scheduler holds again (SLURM requeued it) is ``pending``,
    as is a running one the scheduler put back in the queue. Returns the ids marked failed."""
    died = []
    for run in registry.list():
        requeue = run.status == "stopped" and not run.stop_requested and run.backend_state != "gone"
        if not (run.active or requeue):
            continue
        try:
            state, detail = backend_of(run).poll(run)
        except LLMForgeError:
            continue  # its backend is not installed here
        if state is not None and state != run.backend_state:
            registry.update(run.id, backend_state=state)
        if state == "gone" and run.active:
            if registry.set_status(run.id, "failed", detail, only_if_active=True, message=detail):
                died.append(run.id)
        elif state == "pending" and run.status in ("stopped", "running"):
            registry.set_status(run.id, "pending", f"requeued: {detail}", ended_at=None, exit_code=None)
    return died


def stop(ref: str, *, wait: bool = True, timeout: float = 180.0,
         registry: Optional[RunRegistry] = None) -> RunRecord:
    """Stop a run through its backend: SIGTERM to a local run's workers (they save and exit 75),
    SIGKILL to any of its processes still alive ``timeout`` seconds later (the grace period;
    recorded as a ``kill`` event); or cancel the scheduler job (every job of a fault-tolerant
    run: its replica groups and its lighthouse).

    Raises:
        RunNotFound: no such run. ConfigError: the run is not active, or ``timeout`` is not a
        finite number >= 0. LLMForgeError: processes outlived the timeout, or the scheduler refused.
    """
    if not 0 <= timeout < float("inf"):  # nan or < 0 SIGKILLed at once (no save); inf never
        raise ConfigError(f"--timeout {timeout}: the grace period before SIGKILL must be a finite "
                          "number of seconds >= 0 (default 180)")
    registry = registry or RunRegistry()
    refresh(registry)
    run = registry.resolve(ref)
    if not run.active:
        raise ConfigError(f"run {run.id} is already {run.status}; nothing to stop")
    registry.update(run.id, stop_requested=1, event=("stop", "stop requested"))
    backend = backend_of(run)
    if not backend.cancel(run, wait=wait, timeout=timeout):
        return registry.get(run.id)
    killed = getattr(backend, "killed", None)  # the local backend escalates to SIGKILL
    if killed:
        registry.update(run.id, event=("kill", f"processes {', '.join(map(str, killed))} did not exit "
                                               f"within {timeout:.0f}s of SIGTERM: SIGKILLed"))
    registry.set_status(run.id, "stopped", "stopped by llmforge runs stop" +
                        (f" (SIGKILL after {timeout:.0f}s for {len(killed)} processes)" if killed else ""),
                        only_if_active=True)
    return registry.get(run.id)


def restart(ref: str, overrides: Sequence[str] = (), *, registry: Optional[RunRegistry] = None) -> RunRecord:
    """Start a stopped, failed or completed run again from its newest checkpoint
    (``checkpoint.resume=auto``) as a new resumption; ``overrides`` are added to the run's.

    Raises:
        RunNotFound: no such run. ConfigError: the run is still active, a secret override, a
        forwarded secret is no longer set, an override the config refuses, or nothing left to
        train (the newest checkpoint is at or past ``trainer.max_steps``). LLMForgeError: the
        backend refused.
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
    config = Path(spec["workdir"]) / spec["config_path"]  # absolute, or relative to the launch folder
    if config.is_file():  # the job would refuse these overrides, or have nothing left to train
        check_restart(run, load_config(str(config), spec["overrides"]))
    k = registry.increment(run.id, "resumptions")
    registry.update(run.id, spec=spec, status="pending", retries=0, stop_requested=0, exit_code=None,
                    ended_at=None, message=None, pgid=None, backend_state=None,
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
           "definition", "ft_spec"]
