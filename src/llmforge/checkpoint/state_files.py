"""Type and range checks of a checkpoint's JSON state files: ``trainer_state.json``,
``meta.json`` and ``rng/rank<R>.json`` (layout in :mod:`llmforge.checkpoint.dcp`).

JSON parses whatever a hand edit or a damaged copy holds: a step written as a string, a negative
step, a scheduler entry that is not a number would otherwise fail deep inside Lightning or torch,
or (worse) resume at a wrong position. Each check raises
:class:`~llmforge.checkpoint.safe_load.CheckpointReadError` (exit code 2) naming the file and
the entry.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmforge.checkpoint.safe_load import CheckpointReadError

__all__ = ["check_meta", "check_rng", "check_trainer_state"]


def _bad(file: Path, what: str) -> CheckpointReadError:
    return CheckpointReadError(f"{file}: {what}; the checkpoint is damaged or was edited: use an "
                               "older one (checkpoint.resume=PATH) or restore the file")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(data: dict, key: str, file: Path, required: bool, least: int = 0) -> None:
    if key not in data:
        if required:
            raise _bad(file, f"{key} is missing")
        return
    value = data[key]
    if not _is_int(value) or value < least:
        raise _bad(file, f"{key} is {value!r}, not an integer >= {least}")


def check_trainer_state(data: dict, file: Path) -> dict:
    """``step`` (an integer >= 0, required), ``tokens_seen`` and ``samples_consumed`` (>= 0),
    ``global_batch_size`` (>= 1), ``scheduler`` (``null`` or an object whose entries are numbers,
    booleans, ``null`` or lists of them: torch's LR scheduler state), ``callbacks`` (an object).
    Returns ``data``."""
    _count(data, "step", file, required=True)
    _count(data, "tokens_seen", file, required=False)
    _count(data, "global_batch_size", file, required=False, least=1)
    _count(data, "samples_consumed", file, required=False)
    sched = data.get("scheduler")
    if sched is not None:
        if not isinstance(sched, dict):
            raise _bad(file, f"scheduler is {type(sched).__name__}, not an object")
        for key, value in sched.items():
            items = value if isinstance(value, list) else [value]
            if not all(v is None or isinstance(v, bool) or _is_number(v) for v in items):
                raise _bad(file, f"scheduler.{key} is {value!r}, not a number")
        for key in ("last_epoch", "_step_count"):
            if key in sched and (not _is_int(sched[key]) or sched[key] < -1):
                raise _bad(file, f"scheduler.{key} is {sched[key]!r}, not an integer >= -1")
    if not isinstance(data.get("callbacks", {}), (dict, type(None))):
        raise _bad(file, f"callbacks is {type(data['callbacks']).__name__}, not an object")
    return data


def check_meta(data: dict, file: Path) -> dict:
    """``step``, ``tokens_seen`` (integers >= 0), ``world_size`` (>= 1), ``adapters_only`` (a
    boolean), ``adapters_by`` (a list of names), ``config``, ``mesh``, ``base`` (objects), where
    present. Returns ``data``."""
    _count(data, "step", file, required=False)
    _count(data, "tokens_seen", file, required=False)
    _count(data, "world_size", file, required=False, least=1)
    if "adapters_only" in data and not isinstance(data["adapters_only"], bool):
        raise _bad(file, f"adapters_only is {data['adapters_only']!r}, not true or false")
    by = data.get("adapters_by")
    if by is not None and not (isinstance(by, list) and all(isinstance(x, str) for x in by)):
        raise _bad(file, f"adapters_by is {by!r}, not a list of names")
    for key in ("config", "mesh", "base", "plugins"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise _bad(file, f"{key} is {type(data[key]).__name__}, not an object")
    return data


def check_rng(data: dict, file: Path) -> dict:
    """The states :func:`llmforge.checkpoint.rng.capture_rng` writes, checked by loading each
    into a fresh generator of its library (Python's ``random``, NumPy's MT19937, a torch CPU
    generator; CUDA states as byte lists). Returns ``data``."""
    for part in ("python", "numpy", "torch"):
        if part not in data:
            raise _bad(file, f"the {part} RNG state is missing")
    try:
        version, state, gauss = data["python"]
        random.Random().setstate((version, tuple(state), gauss))
        name, keys, pos, has_gauss, cached = data["numpy"]
        np.random.RandomState().set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        for states in [[data["torch"]], *([data["cuda"]] if "cuda" in data else [])]:
            for s in states:
                if not (isinstance(s, list) and s and all(_is_int(b) and 0 <= b < 256 for b in s)):
                    raise ValueError("not a list of bytes")
        torch.Generator().set_state(torch.tensor(data["torch"], dtype=torch.uint8))
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError, KeyError) as exc:
        raise _bad(file, f"an RNG state is not valid ({type(exc).__name__}: {str(exc)[:120]})") from None
    return data
