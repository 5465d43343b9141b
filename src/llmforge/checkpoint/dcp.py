"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout of a checkpoint root (``<run_dir>/checkpoints``)::

    step_00000100/           one complete checkpoint
        .metadata, __*.distcp   DCP files: {"model": ..., "optim": ...}, sharded per rank
        trainer_state.json   step, tokens seen, scheduler state, data position
        meta.json            step, tokens, world size, llmforge version, config hash
        COMPLETE             written last; a folder without it is never loaded
    .tmp-step_00000200/      a save in progress (ignored by readers)

A save writes into ``.tmp-<name>``, waits for every rank, writes ``COMPLETE`` and renames the
folder in one ``os.replace``: an interrupted save leaves the previous checkpoints intact.
Loading goes through DCP's ``FileSystemReader``; tensors are read, no pickled code is run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict)

COMPLETE = "COMPLETE"
PREFIX = "step_"


def step_name(step: int) -> str:
    """``step_00000100`` for step 100 (sorts by name)."""
    return f"{PREFIX}{step:08d}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_checkpoint(root: str | Path, step: int, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer], trainer_state: dict[str, Any],
                    meta: dict[str, Any]) -> Path:
    """Save model (and optimizer) state sharded by DCP, plus JSON state, atomically.

    Every rank must call it. Returns the final checkpoint folder.
    """
    root = Path(root)
    final, tmp = root / step_name(step), root / f".tmp-{step_name(step)}"
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _is_rank0():
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        (tmp / COMPLETE).write_text("ok\n")
        if final.exists():  # a stale checkpoint of the same step (e.g. a re-run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and (p / COMPLETE).exists())


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or ``None``."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: str | Path, keep_last_n: Optional[int]) -> list[Path]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints (rank 0 only)."""
    if not keep_last_n or not _is_rank0():
        return []
    old = list_checkpoints(root)[:-keep_last_n]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load the ``model`` part of a checkpoint into ``model`` (materialized, any sharding)."""
    sd = get_model_state_dict(model)
    state = {"model": sd}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def read_json(path: str | Path, name: str) -> dict[str, Any]:
    """Read ``trainer_state.json`` or ``meta.json`` of a checkpoint."""
    return json.loads((Path(path) / name).read_text())
