"""The launch backend protocol: one class per cluster type, registered by name like loggers.

A backend turns a sized launch (the ``spec`` of :func:`llmforge.runs.launch.prepare`) into a
running job and answers for it afterwards:

==================  ==========================================================================
method              does
==================  ==========================================================================
``render``          the text that is submitted (a command line, an sbatch script, a task YAML,
                    an estimator definition); ``launch --dry-run`` prints it
``submit``          writes the generated files under ``<run_dir>/launch/``, starts the job and
                    returns ``{"pgid": ...}`` or ``{"job_id": ...}`` plus an event detail
``poll``            the scheduler's view of a recorded job: ``pending``, ``running``, ``gone``
                    (left without a final status) or None (nothing known)
``cancel``          stops the job (the training saves and exits 75 on the signal it gets)
``logs``            the job's log file for a resumption and where else its logs are
``job_environment`` the names and values the job's processes will see (the launch loads the
                    config in it, so an environment interpolation the job lacks is refused)
==================  ==========================================================================

Built-ins: ``local`` (:mod:`llmforge.runs.local`), ``slurm``, ``skypilot``, ``sagemaker``.
Others register with ``@llmforge.registry.backends.register("name")`` or through the
``llmforge.backends`` entry-point group, and a clusters.yaml entry may also name the backend by
import path (``type: my_lab.k8s.KubeBackend``). See docs/backends.md.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

import yaml

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.job.records import RunRecord
from llmforge.registry import backends
from llmforge.run_guard import mark_run_dir
from llmforge.runs.cluster_types import Cluster, clusters_file

BUILTIN = {"local": "llmforge.runs.local:LocalBackend", "slurm": "llmforge.runs.slurm:SlurmBackend",
           "skypilot": "llmforge.runs.skypilot:SkyPilotBackend",
           "sagemaker": "llmforge.runs.sagemaker:SageMakerBackend"}
for _name, _target in BUILTIN.items():  # loaded on first use: no backend imports another's SDK
    backends.register(_name, importlib.metadata.EntryPoint(_name, _target, "llmforge.backends"))

# Set by every backend in the job's environment (never credentials).
JOB_VARIABLES = ("LLMFORGE_RUN_ID", "LLMFORGE_HOME", "PYTHONUNBUFFERED")


class Backend:
    """Base class of launch backends (see the module doc for the protocol).

    Args:
        cluster: the cluster jobs go to; None when only a recorded run is looked after
            (``poll``, ``cancel``, ``logs`` need only the run record).
    """

    type: ClassVar[str] = ""
    """The ``type:`` of its clusters.yaml entries."""
    cluster_class: ClassVar[type] = Cluster
    """The dataclass of its clusters.yaml entries (its fields are the valid keys)."""
    uploads_workdir: ClassVar[bool] = False
    """The launch folder is uploaded (paths in the spec are relative to it; the run directory
    is not on this machine, so it is not checked here)."""
    job_label: ClassVar[str] = "job"
    """How ``runs describe`` names the recorded job id."""
    runs_here: ClassVar[bool] = False
    """The job runs on this machine (its files are the job's files: ``launch`` checks that a
    ``model.init_from`` folder exists; elsewhere a missing one is only noted)."""

    def __init__(self, cluster: Optional[Cluster] = None) -> None:
        self.cluster = cluster

    def render(self, run_id: str, name: str, spec: dict[str, Any], resumption: int = 0) -> str:
        """The definition text of the job (names of secrets only, never values)."""
        raise NotImplementedError

    definition_file: ClassVar[str] = ""
    """Name of the rendered definition under ``<run_dir>/launch/`` (``{resumption}`` is filled)."""

    def submit(self, run: RunRecord) -> tuple[dict[str, Any], str]:
        """Start the job; returns the registry fields to record (``pgid`` or ``job_id``) and the
        detail of the ``submitted`` event. By default: write :meth:`render`'s text to
        ``<run_dir>/launch/<definition_file>`` and hand it to :meth:`start`.

        Raises:
            LLMForgeError: the scheduler or cloud refused the job (its message included).
        """
        path = files_dir(run.spec) / self.definition_file.format(resumption=run.resumptions)
        path.write_text(self.render(run.id, run.name, run.spec, run.resumptions), encoding="utf-8")
        job = self.start(path, run)
        return {"job_id": job}, f"{self.job_label} {job} ({path})"

    def start(self, path: Path, run: RunRecord) -> str:
        """Submit the written definition ``path``; returns the scheduler's job id."""
        raise NotImplementedError

    def poll(self, run: RunRecord) -> tuple[Optional[str], str]:
        """``(state, detail)``: ``pending``/``running`` while the scheduler holds the job,
        ``gone`` when it left without the training recording a final status, None when nothing
        is known (the training's own reports then stand)."""
        return None, ""

    def cancel(self, run: RunRecord, *, wait: bool = True, timeout: float = 180.0) -> bool:
        """Stop the job; returns whether it has ended (False: signalled, not waited for). By
        default: :meth:`stop_job` on the recorded job id, and True (the scheduler stops the
        processes; the training saves and exits 75 on its signal).

        Raises:
            LLMForgeError: the scheduler refused, or processes outlived ``timeout`` seconds.
        """
        self.stop_job(run.job_id or "")
        return True

    def stop_job(self, job_id: str) -> None:
        """Ask the scheduler to stop the job ``job_id`` (what :meth:`cancel` calls).

        Raises:
            LLMForgeError: the scheduler's client is missing or refuses.
        """
        raise NotImplementedError

    def logs(self, run: RunRecord, resumption: int, group: Optional[str] = None) -> tuple[Path, str]:
        """The log file of one resumption (it may not exist yet) and a hint naming where else
        the job's output is (:meth:`logs_hint`). A fault-tolerant run: replica group
        ``group``'s (default 0; ``lighthouse``: the lighthouse job's), each group being its own
        job with its own run directory. ``runs logs`` passes ``group`` only when it is given.

        Raises:
            ConfigError: ``group`` names no replica group of the run, or the run has none.
        """
        ft = run.spec.get("fault_tolerance")
        g = replica_group(run, group)
        if not ft:
            return Path(run.run_dir or "") / "logs" / f"resumption-{resumption}.log", self.logs_hint(run)
        if g == "lighthouse":
            return Path(run.run_dir or "") / "logs" / "lighthouse.log", self.logs_hint(run)
        folder = Path(ft["groups"][g].get("run_dir") or run.run_dir or "")
        return folder / "logs" / f"resumption-{resumption}.log", f"; replica group {g}'s log" + self.logs_hint(run)

    def logs_hint(self, run: RunRecord) -> str:
        """Where else the job's output is (``"; ..."``), or "" when the log file is all there is."""
        return ""

    def job_environment(self, spec: dict[str, Any], env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The environment the job's processes will have, as far as it is known here: the
        forwarded secrets and the backend's own variables (values from ``env``)."""
        env = os.environ if env is None else env
        names = [*spec.get("secrets", []), *JOB_VARIABLES]
        out = {n: env.get(n, "<set by the job>") for n in names}
        out.update(self.scheduler_variables())
        return out

    def scheduler_variables(self) -> dict[str, str]:
        """Variables the scheduler itself sets in the job (name -> value or a placeholder),
        added to :meth:`job_environment`'s; none by default."""
        return {}

    def where(self) -> str:
        """The ``where`` column of ``llmforge clusters``."""
        return "-"


def replica_group(run: RunRecord, group: Optional[str]) -> Any:
    """``group`` (``runs logs --group``) as an index into the run's replica groups (0 when
    ``None``), or ``"lighthouse"``.

    Raises:
        ConfigError: the run is not fault-tolerant and a group was named, or ``group`` is not
            a number below the number of groups, a group's name or ``lighthouse``.
    """
    groups = (run.spec.get("fault_tolerance") or {}).get("groups") or []
    if group is None:
        return 0
    if not groups:
        raise ConfigError(f"--group {group}: run {run.id} has no replica groups (it is not a fault-tolerant "
                          "run); leave --group out")
    # a number is the group's index first, so that every group is reachable whatever its name
    if group.isascii() and group.isdigit() and int(group) < len(groups):
        return int(group)
    if group == "lighthouse":
        return group
    names = [g.get("name") for g in groups]
    if group in names:
        return names.index(group)
    named = f" ({', '.join(str(n) for n in names)})" if all(names) else ""
    raise ConfigError(f"--group {group}: run {run.id} has replica groups 0..{len(groups) - 1}{named} "
                      "and the lighthouse; name one of them")


def train_args(spec: dict[str, Any]) -> list[str]:
    """``-m llmforge train CONFIG OVERRIDES checkpoint.resume=auto``: what every backend runs after
    torchrun's options (a restarted or requeued job continues from its newest checkpoint)."""
    return ["-m", "llmforge", "train", spec["config_path"], *spec.get("overrides", []),
            "checkpoint.resume=auto"]


def files_dir(spec: dict[str, Any]) -> Path:
    """``<run_dir>/launch`` for generated files (``logs/`` too: SLURM opens its output file there);
    the run directory is created marked as llmforge's (:func:`llmforge.run_guard.mark_run_dir`)."""
    out = Path(spec["run_dir"]) / "launch"
    mark_run_dir(out.parent)
    out.mkdir(exist_ok=True)
    (out.parent / "logs").mkdir(exist_ok=True)
    return out


def backend_class(kind: str, *, key: str = "type") -> type[Backend]:
    """The backend class registered as ``kind`` (or at that import path).

    Raises:
        ConfigError: unknown name (the message lists the registered ones).
    """
    cls = backends.get(kind, key=key)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"{key}: {kind!r} is not a llmforge.runs.backend.Backend subclass")
    return cls


def backend_for(cluster: Cluster) -> Backend:
    """The backend that runs jobs on ``cluster``."""
    return backend_class(cluster.type)(cluster)


def record_backend_allowed(run: RunRecord) -> bool:
    """Whether the backend a run record names may be loaded: a registered name (built-in or an
    installed package's ``llmforge.backends`` entry point), or an import path that the user's
    clusters.yaml still gives as the ``type:`` of the run's cluster. ``runs.db`` is data: a row
    alone never makes llmforge import a module (the file is read as YAML; nothing is imported)."""
    if run.kind in backends.names():
        return True
    try:
        data = yaml.safe_load(clusters_file().read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return False
    if isinstance(data, dict) and set(data) == {"clusters"}:
        data = data["clusters"] or {}
    entry = data.get(run.cluster) if isinstance(data, dict) else None
    return isinstance(entry, dict) and entry.get("type") == run.kind


def backend_of(run: RunRecord) -> Backend:
    """The backend of a recorded run (no cluster: clusters.yaml may have changed since).

    Raises:
        ConfigError: the record names a backend that :func:`record_backend_allowed` refuses
            (nothing is imported).
        LLMForgeError: the run's backend is no longer installed.
    """
    if not record_backend_allowed(run):
        raise ConfigError(
            f"run {run.id}: the run registry names backend {run.kind!r}, which is neither a registered "
            f"backend ({', '.join(backends.names())}) nor the type: of cluster {run.cluster!r} in "
            "clusters.yaml; run records are data and never import code: give that cluster its type in "
            "clusters.yaml again, or install the package that registers the backend")
    try:
        return backend_class(run.kind)(None)
    except LLMForgeError as exc:
        raise LLMForgeError(f"run {run.id}: its backend {run.kind!r} is not available here: {exc}") from exc
