"""Checkpoints: sharded save/load through torch.distributed.checkpoint, atomic and complete.

Names are imported on first use (PEP 562): :mod:`llmforge.checkpoint.layout` (folder names,
no torch) can be read before the heavy imports."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"COMPLETE": "layout", "latest_checkpoint": "layout", "list_checkpoints": "layout",
         "step_name": "layout", "load_model_weights": "dcp", "prune_checkpoints": "dcp",
         "read_json": "dcp", "save_checkpoint": "dcp"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"llmforge.checkpoint.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llmforge.checkpoint' has no attribute {name!r}")
