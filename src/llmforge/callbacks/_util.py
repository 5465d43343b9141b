"""Small helpers shared by the callbacks: where the run directory is, one-line messages."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def run_dir(trainer: Any) -> Path:
    """The run directory (the Trainer passes it to Lightning as ``default_root_dir``)."""
    return Path(trainer.default_root_dir)


def say(trainer: Any, message: str) -> None:
    """Print one line on stderr, on the global rank zero only."""
    if getattr(trainer, "is_global_zero", True):
        print(message, file=sys.stderr, flush=True)
