"""Names of a checkpoint root's folders, read without torch (see :mod:`llmforge.checkpoint.dcp`
for what is inside them): the CLI checks a run directory before the heavy imports."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

COMPLETE = "COMPLETE"
PREFIX = "step_"


def step_name(step: int) -> str:
    """``step_00000100`` for step 100 (sorts by name)."""
    return f"{PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and (p / COMPLETE).exists())


# files only llmforge's checkpoint folders hold (see llmforge.checkpoint.dcp)
CHECKPOINT_FILES = (COMPLETE, ".metadata", "meta.json", "trainer_state.json")


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder llmforge wrote, complete or not (``step_*`` or an
    unfinished ``.tmp-step_*`` holding one of :data:`CHECKPOINT_FILES`, or empty): what
    ``--overwrite`` may delete in a ``checkpoint.dir`` outside the run directory."""
    if path.is_symlink() or not path.is_dir():
        return False
    if not (path.name.startswith(PREFIX) or path.name.startswith(".tmp-" + PREFIX)):
        return False
    return not any(path.iterdir()) or any((path / name).exists() for name in CHECKPOINT_FILES)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or ``None``."""
    found = list_checkpoints(root)
    return found[-1] if found else None
