"""The run resolved once: world size, strategy, batch plan, parallel degrees, paths, threads,
run-directory state. The CLI's checks, the dry run and the :class:`~llmforge.Trainer` share the
one :class:`ResolvedRun` that :func:`resolve_run` returns.

Nothing here imports torch, Lightning or datasets (``model.init_from: hf:PATH`` aside, whose
config.json reader lives with the HF adapter), so ``llmforge train`` reports a bad config, a
missing file or a used run directory in a fraction of a second.

The user's config is never changed: the resolved values (``trainer.devices``/``num_nodes``
from a launcher, ``strategy.name: auto`` with several processes = ``fsdp2``, the model shape of
an HF folder) go into a read-only copy, :attr:`ResolvedRun.cfg`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from llmforge.checkpoint.layout import COMPLETE, latest_checkpoint, list_checkpoints
from llmforge.checkpoint.resume_changes import check_resume_changes, checkpoint_run_dir, resume_changes
from llmforge.config.redaction import config_to_dict, redact
from llmforge.config.validate import BatchPlan, validate
from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.parallel.mesh import ParallelDims
from llmforge.parallel.threads import choose_num_threads
from llmforge.paths import check_printable
from llmforge.run_guard import (check_run_dir, peek_holder, refuse_link, refuse_nested_runs,
                                refuse_overlap, refuse_run_inside_run)

__all__ = ["ResolvedRun", "detect_world_size", "resolve_run", "check_names_and_paths",
           "check_no_secret_in_folders", "check_run_name", "worker_cores"]

# Names and paths that reach file systems, trackers and job scripts (llmforge.runs renders
# run.name and run.output_dir into sbatch scripts): a control character in one is refused.
NAME_AND_PATH_KEYS = ("run.name", "run.output_dir", "run.group", "checkpoint.dir", "checkpoint.resume",
                      "model.init_from", "tokenizer.path", "data.path", "data.paths", "data.cache_dir")
# Keys whose values become folder names: redaction cannot reach a name on disk (and in every
# path printed or recorded under it), so a secret's value in one is refused.
FOLDER_KEYS = ("run.name", "run.output_dir", "checkpoint.dir")
# Folder keys whose leading ``~`` is the user's home, as a shell would expand it.
HOME_KEYS = ("run.output_dir", "checkpoint.dir", "checkpoint.resume", "model.init_from")
# Keys whose paths a run reads: ``--overwrite`` must not clear them first.
INPUT_KEYS = ("model.init_from", "checkpoint.resume", "tokenizer.path", "data.path", "data.paths")


def input_paths(cfg: DictConfig) -> list[tuple[str, str]]:
    """``(key, path)`` of every path the run reads (:data:`INPUT_KEYS` and each
    ``data.mixture[i].path``/``paths``); ``checkpoint.resume: auto`` names none."""
    found: list[tuple[str, str]] = []
    for key in INPUT_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        for item in value if OmegaConf.is_list(value) else [value]:
            if isinstance(item, str) and item and not (key == "checkpoint.resume" and item == "auto"):
                found.append((key, item))
    for i, entry in enumerate(cfg.data.mixture or []):
        for key in ("path", "paths"):
            value = entry.get(key)
            for item in value if OmegaConf.is_list(value) or isinstance(value, list) else [value]:
                if isinstance(item, str) and item:
                    found.append((f"data.mixture[{i}].{key}", item))
    return found


def worker_cores(data: Any) -> int:
    """Cores the data workers of one process take from its compute threads: each worker that
    tokenizes (a streaming source: ``data.streaming``, or a ``files``/``hub`` entry of
    ``data.mixture``) takes one; workers that slice windows already in memory (tokenized up
    front) or memory-mapped (``prepared``) take none (issue 27: busy 0.06-0.16% of a step)."""
    entries = [e.get("source") or data.source for e in data.mixture or []]
    streams = bool(data.streaming) or any(s in ("files", "hub") for s in entries)
    return int(data.num_workers) if streams else 0


@dataclass(frozen=True)
class ResolvedRun:
    """Everything about a run that follows from its config and the environment."""

    cfg: DictConfig
    """Read-only resolved copy of the config (what the Trainer, plugins and config.yaml see)."""
    world_size: int
    """Processes in the job."""
    local_world_size: int
    """Processes on this node."""
    plan: BatchPlan
    """Batch arithmetic (:func:`llmforge.config.batch_plan.plan_batch`)."""
    dims: ParallelDims
    """dp_replicate x dp_shard x tp degrees."""
    run_dir: Path
    checkpoint_dir: Path
    num_threads: int
    """Compute threads per process (:func:`llmforge.parallel.threads.choose_num_threads`)."""
    threads_reason: str
    """Why that many, for the start-up line."""
    resume_from: Optional[Path] = None
    """The complete checkpoint this run continues from (``checkpoint.resume``), or None."""
    run_dir_used: bool = False
    """The run directory (or checkpoint folder) already holds a run."""
    resume_line: Optional[str] = None
    """One line naming what changed since the checkpoint (None: nothing, or no resume)."""
    notes: tuple[str, ...] = ()
    """Dry-run notes (an HF folder that is not on this machine)."""

    @property
    def strategy(self) -> str:
        """The strategy name after resolution (``auto`` only for one process)."""
        return str(self.cfg.strategy.name)


def detect_world_size(environ: Mapping[str, str], devices: int, num_nodes: int) -> tuple[int, int, int]:
    """``(world_size, devices per node, nodes)`` from a launcher's environment (torchrun's
    ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``; SLURM's ``SLURM_NTASKS``/``SLURM_NTASKS_PER_NODE``),
    else the config's ``devices x num_nodes``: under a launcher the YAML need not repeat them."""
    if environ.get("WORLD_SIZE") and environ.get("LOCAL_WORLD_SIZE"):
        world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
    elif (environ.get("SLURM_NTASKS") and environ.get("SLURM_NTASKS_PER_NODE")
          and not environ.get("WORLD_SIZE")):
        world = int(environ["SLURM_NTASKS"])
        local = int(environ["SLURM_NTASKS_PER_NODE"].split("(")[0])
    else:
        return devices * num_nodes, devices, num_nodes
    return world, local, max(1, world // local)


def check_run_name(name: str) -> None:
    """A run name is one folder name: not empty, not ``.``/``..``, no path separator.

    Raises:
        ConfigError: otherwise (``--overwrite`` deletes the run folder, so it must be one).
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or name != name.strip():
        raise ConfigError(f"run.name={name!r} must be a plain folder name (no '/', not empty, "
                          "not '.' or '..'); use run.output_dir for the parent folder")


def check_names_and_paths(cfg: DictConfig) -> None:
    """No control character (:func:`llmforge.paths.check_printable`) in the names and paths of
    :data:`NAME_AND_PATH_KEYS`: they become folder names, tracker names and lines of job
    scripts, where a newline starts a new shell command.

    Raises:
        ConfigError: naming the key and showing the value with the character escaped.
    """
    for key in NAME_AND_PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        for item in value if OmegaConf.is_list(value) else [value]:
            if isinstance(item, str):
                check_printable(item, key)


def check_no_secret_in_folders(cfg: DictConfig) -> None:
    """No secret's value (:func:`llmforge.config.redaction.redact`: e.g. ``run.name:
    r-${variables.api_key}``) in :data:`FOLDER_KEYS`.

    Raises:
        ConfigError: naming the key and showing the value as redacted.
    """
    shown = OmegaConf.create(redact(cfg))
    for key in FOLDER_KEYS:
        value, safe = OmegaConf.select(cfg, key, default=None), OmegaConf.select(shown, key, default=None)
        if isinstance(value, str) and value != safe:
            raise ConfigError(f"{key}={safe!r} holds a secret (shown as ***): a folder name stays on disk "
                              "and in every path printed or recorded under it, where it cannot be "
                              f"redacted; choose a {key} without it")


def _expand_paths(cfg: DictConfig) -> None:
    """``~`` and ``~user`` at the start of :data:`HOME_KEYS` become the home folder; a relative
    ``checkpoint.dir`` becomes absolute (from the working directory), so that the run's
    ``config.yaml`` finds its checkpoints from any other directory (``eval``, ``export``)."""
    for key in HOME_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value.startswith("~"):
            OmegaConf.update(cfg, key, os.path.expanduser(value), merge=False)
    folder = cfg.checkpoint.dir
    if isinstance(folder, str) and folder and not os.path.isabs(folder):
        OmegaConf.update(cfg, "checkpoint.dir", os.path.abspath(folder), merge=False)


def hf_shape(cfg: DictConfig, dry_run: bool) -> tuple[str, ...]:
    """``model.init_from: hf:PATH`` fixes the model's shape (its config.json wins, in place);
    returns notes. ``dry_run`` (and ``llmforge plan``, which sizes a cluster's config anywhere):
    a folder missing here is a note, and the YAML's shape is used; a folder that is here must
    hold a config.json. ``~`` is the home folder.

    Raises:
        ConfigError: no folder after ``hf:``; the folder's config.json is missing (the folder
            being here), unreadable or of another family."""
    spec = cfg.model.get("init_from") or ""
    if not spec.startswith("hf:"):
        return ()
    if not spec[3:].strip():
        raise ConfigError("model.init_from: 'hf:' names no folder; give hf:/path/to/the/hugging-face/folder")
    if spec.startswith("hf:~"):
        spec = "hf:" + os.path.expanduser(spec[3:])
        cfg.model.init_from = spec
    if dry_run and not os.path.exists(spec[3:]):
        return (f"model.init_from {spec}: no such folder on this machine; the YAML's model "
                "fields are used for the sizes",)
    from llmforge.checkpoint.init_from import apply_hf_shape  # heavy (torch, safetensors): hf: only

    apply_hf_shape(cfg)
    return ()


def _check_files(cfg: DictConfig) -> None:
    """Local files the config names exist (before anything heavy is imported)."""
    tok = cfg.tokenizer
    if tok.type in ("huggingface", "tiktoken") and tok.path and "://" not in tok.path \
            and not os.path.exists(tok.path):
        raise ConfigError(f"tokenizer.path: {tok.path} does not exist; give the {tok.type} "
                          "tokenizer file (or tokenizer.type=train_bpe)")


def _refuse_another_runs_checkpoints(ckpt_dir: Path, found: list[Path], run_dir: Path) -> None:
    """A ``checkpoint.dir`` (holding the complete checkpoints ``found``, oldest first) whose
    newest checkpoint another run wrote, while that run's directory is still there, is refused:
    resuming would continue that run under this name, ``--overwrite`` would delete its
    checkpoints, and a fresh run would mix with them.

    Raises:
        ConfigError: naming the folder, the other run and what to do instead.
    """
    owner = checkpoint_run_dir(found[-1]) if found else None
    if owner is None or not (owner / "config.yaml").is_file():
        return
    if os.path.realpath(owner) != os.path.realpath(run_dir):
        raise ConfigError(f"checkpoint.dir={ckpt_dir} holds the checkpoints of another run, {owner} (its "
                          "config.yaml names this folder); --overwrite replaces this run only: give this run "
                          f"its own checkpoint.dir (start from that run's weights with model.init_from="
                          f"{found[-1]}, or continue it with run.name={owner.name})")


def _run_dir_state(cfg: DictConfig, run_dir: Path, ckpt_dir: Path, overwrite: bool,
                   world_size: int) -> tuple[Optional[Path], bool, Optional[str]]:
    """``(resume_from, used, resume line)``; refuses a used directory without resume or
    overwrite, an incomplete resume path, and a resume whose changes break exactness."""
    ck = cfg.checkpoint
    check_run_dir(run_dir, "run.name")
    refuse_nested_runs(run_dir, "run.name", clearing=overwrite)
    if ck.dir:  # llmforge's checkpoints in it, and nothing else, are what --overwrite deletes
        refuse_link(ckpt_dir, "checkpoint.dir")
        refuse_run_inside_run(ckpt_dir, run_dir, "checkpoint.dir")
    metrics = (run_dir / "metrics.jsonl").exists()
    found = list_checkpoints(ckpt_dir)
    if ck.dir:
        _refuse_another_runs_checkpoints(ckpt_dir, found, run_dir)
    used = metrics or bool(found)
    if used and overwrite:  # what Trainer.prepare_run_dir will clear, before it reads the inputs
        cleared = [("run.name", run_dir)] + ([("checkpoint.dir", ckpt_dir)] if ck.dir else [])
        refuse_overlap(cleared, input_paths(cfg))
    if used and not overwrite and not ck.resume:
        where = run_dir if metrics else ckpt_dir
        raise ConfigError(f"{where} already holds a run; continue it with checkpoint.resume=auto, "
                          "choose another run.name (e.g. run.name=my-run-2) or pass --overwrite "
                          "to delete it")
    resume: Optional[Path] = None
    if ck.resume and not overwrite:
        if ck.resume == "auto":
            resume = latest_checkpoint(ckpt_dir)
        else:
            resume = Path(ck.resume)
            if not resume.exists():
                raise ConfigError(f"checkpoint.resume: {resume} does not exist; give a checkpoint "
                                  "folder (e.g. runs/NAME/checkpoints/step_00000100) or "
                                  "checkpoint.resume=auto for the run's newest complete one")
            if not (resume / COMPLETE).exists():
                raise ConfigError(f"checkpoint.resume: {resume} is not a complete checkpoint (no "
                                  f"{COMPLETE} marker); use checkpoint.resume=auto for the newest "
                                  "complete one")
    line = None
    if resume is not None:
        changes = resume_changes(resume, redact(config_to_dict(cfg)), world_size)
        check_resume_changes(changes, bool(ck.allow_config_changes))
        line = changes.line()
    return resume, used, line


def resolve_run(cfg: DictConfig, *, overwrite: bool = False, check_dir: bool = True,
                dry_run: bool = False, environ: Optional[Mapping[str, str]] = None) -> ResolvedRun:
    """Resolve ``cfg`` (from :func:`llmforge.config.load_config`) for this process.

    Args:
        overwrite: ``--overwrite``: a used run directory will be replaced (no resume).
        check_dir: look at the run directory (used, resume checkpoint, changes since it); the
            dry run does not.
        dry_run: an HF ``model.init_from`` folder missing here is a note, not an error.
        environ: the environment (default ``os.environ``) for a launcher's world size.

    Raises:
        ConfigError: the first invalid setting (see :func:`llmforge.config.validate`), an
            unknown ``model.preset`` or impossible model shape (the family's ``check_config``), a run
            name that is not one folder, a control character in a name or path, a missing
            tokenizer file, a used run directory, a run directory (or ``checkpoint.dir``) that is
            a symbolic link, a non-empty folder that is not an llmforge run
            (:func:`llmforge.run_guard.check_run_dir`), or a resume that changes settings
            exactness depends on.
        RunDirBusy: another process holds the run directory's lock (rank 0 only).
    """
    env = os.environ if environ is None else environ
    out = copy.deepcopy(cfg)  # typed like cfg (a structured TrainConfig)
    t = out.trainer
    world, t.devices, t.num_nodes = detect_world_size(env, int(t.devices), int(t.num_nodes))
    plan = validate(out, world)
    if out.strategy.name == "auto" and world > 1:
        out.strategy.name = "fsdp2"
    dims = ParallelDims.from_config(out, world)
    check_run_name(out.run.name)
    check_names_and_paths(out)
    check_no_secret_in_folders(out)
    _expand_paths(out)
    if not dry_run:  # a dry run sizes a cluster's config anywhere
        _check_files(out)
    notes = hf_shape(out, dry_run)
    get_spec(out.model.name).check(out.model)  # preset and shape, by the family's light check
    run_dir = Path(out.run.output_dir) / out.run.name
    ckpt_dir = Path(out.checkpoint.dir) if out.checkpoint.dir else run_dir / "checkpoints"
    local = int(env.get("LOCAL_WORLD_SIZE") or t.devices)
    threads, why = choose_num_threads(t.num_threads, local, worker_cores(out.data), environ=env)
    if check_dir and env.get("RANK", "0") == "0":  # rank 0 holds the run's lock (Trainer.setup)
        peek_holder(run_dir)
    resume, used, line = (_run_dir_state(out, run_dir, ckpt_dir, overwrite, world) if check_dir
                          else (None, False, None))
    OmegaConf.set_readonly(out, True)
    return ResolvedRun(cfg=out, world_size=world, local_world_size=local, plan=plan, dims=dims,
                       run_dir=run_dir, checkpoint_dir=ckpt_dir, num_threads=threads,
                       threads_reason=why, resume_from=resume, run_dir_used=used,
                       resume_line=line, notes=notes)
