"""What a resume changes: this run's resolved config against the checkpoint's.

A checkpoint's ``meta.json`` holds the resolved config it was trained with (secrets redacted;
older checkpoints: the run directory's ``config.yaml``) and its world size. At resume,
:func:`resume_changes` lists every key that differs. Keys in :data:`MAY_CHANGE` leave an exact
resume exact (logging, checkpointing, the world size and mesh, the pipeline's stages and
schedule: DCP reshards the state, parameters keep the model's own names under every split, and
the global batch stays the same); every other difference (the schedule's length, the batch size,
the optimizer, data, model, seed) changes what training computes, so the run is refused unless
``checkpoint.allow_config_changes=true``. docs/resume.md lists the keys for users. Read
without torch, so ``llmforge train`` refuses before its heavy imports.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmforge.config.schema import TrainConfig
from llmforge.errors import ConfigError

__all__ = ["MAY_CHANGE", "ResumeChanges", "checkpoint_run_dir", "resume_changes", "check_resume_changes"]

MAY_CHANGE = (
    "run.name", "run.output_dir", "run.group", "run.tags",
    "trainer.micro_batch_size", "trainer.devices", "trainer.num_nodes", "trainer.accelerator",
    "trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "trainer.progress_bar",
    "trainer.num_threads", "trainer.gc_every", "trainer.malloc_tuning", "trainer.nan_guard",
    "strategy.", "pipeline.", "checkpoint.", "compute.", "scheduling.", "loggers", "callbacks", "imports",
    "data.num_workers", "data.token_cache", "optimizer.implementation", "variables.",
)
"""Keys (or ``section.`` prefixes) that may differ at resume without changing the result.
``trainer.max_steps`` may change too when ``scheduler.name=constant`` (no schedule depends on
it); with the other schedules the learning rate of every later step moves."""

_NOT_COMPARED = ("checkpoint.resume", "checkpoint.allow_config_changes")  # how to resume, not what

_WHY = {"trainer.max_steps": "the learning-rate schedule's length",
        "trainer.global_batch_size": "the samples per step and the data position",
        "trainer.seq_len": "the data windows", "run.seed": "the data order"}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


_STREAM_POSITION = ("world size", "data.num_workers", "trainer.devices", "trainer.num_nodes", "strategy.")
"""A streaming source's saved position is per rank and loader worker: exact only when these
stay (docs/data.md)."""


def _matches(key: str, names: tuple[str, ...]) -> bool:
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in names)


def _streams(now: dict[str, Any]) -> bool:
    """Whether the run reads a streaming source: ``data.streaming``, or a ``data.mixture`` entry
    that is not prepared (an entry without ``source`` takes ``data.source``)."""
    entries = now.get("data.mixture") or []
    return bool(now.get("data.streaming")) or any(
        isinstance(e, dict) and (e.get("source") or now.get("data.source")) != "prepared" for e in entries)


def _may_change(key: str, now: dict[str, Any]) -> bool:
    if key == "trainer.max_steps":
        return now.get("scheduler.name") == "constant"
    if _streams(now) and _matches(key, _STREAM_POSITION):
        return False
    return key == "world size" or _matches(key, MAY_CHANGE)


def _schema_default(key: str) -> Any:
    """The schema's default of a dotted key (``optimizer.muon_lr``), or ``_UNKNOWN``."""
    node: Any = TrainConfig
    value: Any = _UNKNOWN
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return _UNKNOWN
        f = {f.name: f for f in dataclasses.fields(node)}.get(part)
        if f is None:
            return _UNKNOWN
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        node = value
    return value


_UNKNOWN = object()


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class ResumeChanges:
    """The differences of one resume: ``(key, checkpoint value, this run's value)`` triples."""

    checkpoint: Path
    safe: tuple[tuple[str, Any, Any], ...]
    """Differences that keep the resume exact."""
    breaking: tuple[tuple[str, Any, Any], ...]
    """Differences that change what training computes."""
    compared_with: str
    """Where the checkpoint's config came from (``meta.json`` or a ``config.yaml``)."""

    def line(self) -> Optional[str]:
        """``resume: changed vs <checkpoint>: key old -> new, ...``, or ``None`` when equal."""
        items = [*self.breaking, *self.safe]
        if not items:
            return None
        parts = ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, a, b in items)
        return f"resume: changed vs {self.checkpoint} ({self.compared_with}): {parts}"


def _saved_config(ckpt: Path) -> tuple[Optional[dict], str]:
    meta_file = ckpt / "meta.json"
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8")) if meta_file.exists() else {}
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        raise ConfigError(f"checkpoint.resume: {meta_file} cannot be read ({type(exc).__name__}: {exc}); "
                          "resume from another checkpoint (checkpoint.resume=PATH)") from None
    world = {"_world_size": meta["world_size"]} if meta.get("world_size") else {}
    if isinstance(meta.get("config"), dict):
        return {**meta["config"], **world}, "meta.json"
    run_config = ckpt.parent.parent / "config.yaml"  # <run_dir>/checkpoints/step_N
    if run_config.exists():
        import yaml

        try:
            data = yaml.safe_load(run_config.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError, ValueError, RecursionError, MemoryError):
            data = None  # compared by world size only; loading the run reads it and says why
        if isinstance(data, dict):
            return {**data, **world}, str(run_config)
    return (world or None), "no saved config"


def checkpoint_run_dir(ckpt: Path) -> Optional[Path]:
    """The run directory (``run.output_dir / run.name``, as the run resolved them) that wrote
    the checkpoint ``ckpt``, from its saved config; ``None`` when it names none.

    Raises:
        ConfigError: the checkpoint's ``meta.json`` exists but cannot be read.
    """
    run = (_saved_config(ckpt)[0] or {}).get("run")
    if not isinstance(run, dict) or not isinstance(run.get("name"), str):
        return None
    return Path(str(run.get("output_dir") or "runs")) / run["name"]


def resume_changes(ckpt: str | Path, config: dict[str, Any], world_size: Optional[int]) -> ResumeChanges:
    """Compare this run's resolved ``config`` (a plain, redacted dict) and ``world_size`` with
    the checkpoint's. A checkpoint without a saved config compares the world size only;
    ``world_size=None`` (not known yet: ``runs restart`` on its launcher) compares the config only.

    Raises:
        ConfigError: the checkpoint's ``meta.json`` exists but cannot be read.
    """
    ckpt = Path(ckpt)
    saved, where = _saved_config(ckpt)
    if saved is None:
        return ResumeChanges(ckpt, (), (), where)
    old_world = saved.pop("_world_size", None)
    old = _flatten(json.loads(json.dumps(saved, default=str))) if saved else {}
    now = _flatten(json.loads(json.dumps(config, default=str)))
    safe, breaking = [], []
    if old_world is not None and world_size is not None and int(old_world) != world_size:
        (safe if _may_change("world size", now) else breaking).append(
            ("world size", int(old_world), world_size))
    for key in sorted(set(old) | set(now)) if old else ():
        if key.startswith("variables.") or key in _NOT_COMPARED or old.get(key) == now.get(key):
            continue  # variables reach the run only through the keys they fill in
        if key not in old and now[key] == _schema_default(key):
            continue  # a key added to llmforge after the save, at its default: the old behaviour
        (safe if _may_change(key, now) else breaking).append((key, old.get(key), now.get(key)))
    return ResumeChanges(ckpt, tuple(safe), tuple(breaking), where)


def check_resume_changes(changes: ResumeChanges, allow: bool) -> None:
    """Refuse a resume whose changes break exactness, unless ``allow``.

    Raises:
        ConfigError: names each breaking key with both values and the flag that allows it.
    """
    if not changes.breaking or allow:
        return
    parts = []
    for key, old, new in changes.breaking:
        why = f" ({_WHY[key]})" if key in _WHY else ""
        parts.append(f"{key} {_short(old)} -> {_short(new)}{why}")
    # weights of another shape load under no flag (the load names the parameter)
    shapes = (" (a model: key only where every parameter keeps its shape)"
              if any(key.startswith("model.") for key, _, _ in changes.breaking) else "")
    raise ConfigError(
        f"checkpoint.resume: this run differs from {changes.checkpoint} in settings that change "
        f"what training computes: {'; '.join(parts)}; set them back, or pass "
        f"checkpoint.allow_config_changes=true to resume with them{shapes} (see docs/resume.md)")
