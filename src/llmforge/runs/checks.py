"""What a launched job checks when it starts, checked by ``llmforge launch`` before it submits.

A job that would stop at once with exit 2 should never be queued: :func:`check_job` resolves the
config (read once by ``launch``) again in the environment the job will have (:meth:`Backend.job_environment`: an
``${oc.env:NAME}`` whose variable is not forwarded fails here) and builds its loggers there (an
online tracker whose key is not forwarded fails) and its callbacks (a non-class, a wrong
keyword), refuses API keys written in the config (every logger refuses them), and runs the
training command's own static checks (research imports, batch arithmetic, strategy,
algorithms) at the job's world size. :func:`check_restart`
refuses a restart that could train nothing, or that the job would refuse at resume.
"""

from __future__ import annotations

import copy
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from llmforge import registry
from llmforge.checkpoint.resume_changes import check_resume_changes, resume_changes
from llmforge.config import config_to_dict, redact
from llmforge.config.loader import resolve_config
from llmforge.config.redaction import is_secret_key
from llmforge.preflight.resolve import resolve_run
from llmforge.errors import ConfigError


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` is exactly ``env`` inside the block, and as before after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def inline_keys(cfg: Any) -> list[str]:
    """``loggers.N.KEY`` of every secret-looking logger setting that holds a value (``api_key``)."""
    out = []
    for i, entry in enumerate(cfg.loggers or []):
        for key, value in (entry or {}).items():
            if is_secret_key(key) and value not in (None, ""):
                out.append(f"loggers.{i}.{key}")
    return out


def check_job(raw: Any, cfg: Any, spec: dict[str, Any], backend: Any, *, local_files: bool = True) -> None:
    """Run the job's start-up checks here (see the module doc); nothing is written.

    Args:
        raw: the job's YAML with its overrides, read once and not resolved
            (:func:`llmforge.config.loader.read_config`; not changed).
        cfg: ``raw`` resolved here (not changed).
        spec: the launch spec (secrets, world size, nodes, procs per node).
        backend: the cluster's :class:`~llmforge.runs.backend.Backend`.
        local_files: the job reads this machine's files (``model.init_from`` folders are
            checked); False for jobs that run elsewhere (a missing folder is only noted).

    Raises:
        ConfigError: what the job would exit 2 with, naming the key and how to fix it.
    """
    keys = inline_keys(cfg)
    if keys:
        raise ConfigError(f"{', '.join(keys)}: API keys are not read from config files (the job refuses "
                          "them: configs are saved with the run); export the key (e.g. WANDB_API_KEY) and "
                          "forward it by name with --secret NAME or compute.secrets")
    # the checks `llmforge train` runs before training; heavy (torch, Lightning), so imported
    # after the config's own errors are reported
    from llmforge.training.preflight import build_callbacks, job_checks

    env = backend.job_environment(spec)
    try:
        with environment(env):
            loaded = resolve_config(raw)  # ${oc.env:...} as the job will resolve it
            build_loggers(loaded, spec, strict=local_files)
            build_callbacks(loaded)  # a non-class, a wrong keyword: as the job would refuse it
    except ConfigError as exc:
        found = re.search(r"Environment variable '([^']+)' not found|\b([A-Z_][A-Z0-9_]*) is not set", str(exc))
        if not found:  # not about the environment (e.g. a logger setting): as the job would say it
            raise
        var = found.group(1) or found.group(2)
        raise ConfigError(f"{exc} -- the job on cluster {backend.cluster.name!r} will not have {var}: forward "
                          f"it by name with --secret {var} (or compute.secrets), or set it in the cluster's "
                          "setup") from None
    job_cfg = copy.deepcopy(cfg)
    job_cfg.trainer.devices, job_cfg.trainer.num_nodes = int(spec["procs_per_node"]), int(spec["nodes"])
    job_checks(job_cfg, int(spec["gpus"]), dry_run=not local_files)


def build_loggers(cfg: Any, spec: dict[str, Any], *, strict: bool) -> None:
    """Instantiate ``loggers:`` as the job does before training (an online tracker needs its key
    in the environment); building writes nothing and contacts no server.

    Args:
        strict: a tracker SDK missing here is an error too (the job runs here); else it is
            left to the job's machine.

    Raises:
        ConfigError: what the loggers refuse (a key not in the environment, a bad setting).
    """
    from lightning.pytorch.loggers import Logger  # heavy: only once the config's own errors are out

    try:
        registry.build_entries(registry.loggers, "loggers", cfg.loggers, base=Logger, run_dir=Path(spec["run_dir"]),
                      run=cfg.run, config=redact(config_to_dict(cfg)))
    except ConfigError as exc:
        if strict or not isinstance(exc.__cause__, ImportError):
            raise


def newest_checkpoint_step(folder: Path) -> Optional[int]:
    """The step of the newest complete checkpoint (``step_N/COMPLETE``) in ``folder``, or None."""
    steps = []
    for child in folder.glob("step_*") if folder.is_dir() else []:
        if (child / "COMPLETE").exists() and child.name[5:].isdigit():
            steps.append(int(child.name[5:]))
    return max(steps) if steps else None


def check_restart(run: Any, cfg: Any) -> None:
    """A restart resumes from the newest checkpoint: it must have steps left to train, and the
    job's own resume check (:func:`llmforge.checkpoint.resume_changes.check_resume_changes`)
    must pass, so a job that would exit 2 is never submitted.

    Raises:
        ConfigError: the newest checkpoint is at or past ``trainer.max_steps`` (names both and
            an override that works), the overrides change what training computes without
            ``checkpoint.allow_config_changes=true`` (names each key), or ``model:`` keys change
            a parameter's shape (allowed or not: the checkpoint cannot load; names it).
    """
    run_dir = Path(run.run_dir or ".")
    folder = Path(cfg.checkpoint.dir) if cfg.checkpoint.get("dir") else run_dir / "checkpoints"
    step = newest_checkpoint_step(folder)
    if step is None and run.last_step is not None and run.status == "completed":
        step = int(run.last_step)  # the checkpoints live where this machine cannot see them
    limit = int(cfg.trainer.max_steps)
    if step is not None and step >= limit:
        # a longer cosine/linear schedule changes every later step's learning rate: the job
        # refuses it unless allowed (docs/resume.md); a constant one does not depend on it
        allow = "" if cfg.scheduler.name == "constant" else " checkpoint.allow_config_changes=true"
        raise ConfigError(f"run {run.id} is already at step {step} (newest checkpoint in {folder}) and "
                          f"trainer.max_steps={limit}: the restart would train nothing; restart with "
                          f"trainer.max_steps above {step} (e.g. llmforge runs restart {run.id} "
                          f"trainer.max_steps={step + limit}{allow}), or launch a new run")
    ckpt = folder / f"step_{step:08d}" if step is not None else None
    if ckpt is not None and ckpt.is_dir():
        job_cfg = resolve_run(cfg, check_dir=False, dry_run=True, environ={}).cfg  # as the job resolves it
        changes = resume_changes(ckpt, redact(config_to_dict(job_cfg)), None)
        model_keys = [(key, old) for key, old, _ in changes.breaking if key.startswith("model.")]
        try:
            if model_keys:  # a model of another shape loads nothing, allowed or not: say that, not "allow it"
                from llmforge.training.preflight import resume_shapes  # heavy (torch): model changes only

                try:
                    resume_shapes(job_cfg, ckpt)
                except ConfigError as exc:
                    back = " ".join(f"{key}={json.dumps(old)}" for key, old in model_keys)
                    raise ConfigError(f"{exc} (e.g. llmforge runs restart {run.id} {back})") from None
            check_resume_changes(changes, bool(cfg.checkpoint.allow_config_changes))
        except ConfigError as exc:
            raise ConfigError(f"run {run.id}: the restarted job would stop at once: {exc}") from None
