"""``memory_snapshot``: CUDA memory history, dumped on request and on out-of-memory.

YAML::

    callbacks:
      - name: memory_snapshot
        at_steps: [10]         # dump after these optimizer steps
        on_oom: true           # dump when training fails with torch.OutOfMemoryError
        max_entries: 100000    # allocation events kept in the ring buffer

On request while the run is going: ``touch <run_dir>/memory_snapshot.request`` dumps after the
current step (the file is removed). Snapshots are ``<run_dir>/memory_snapshots/
rank<R>_step<N>.pickle`` (``..._oom.pickle``); drag one into https://pytorch.org/memory_viz.
On the CPU there is no CUDA allocator to record: the callback says so once and does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.callbacks._util import run_dir, say

REQUEST_FILE = "memory_snapshot.request"


class MemorySnapshot(Callback):
    """Records CUDA allocation history and dumps snapshots for ``memory_viz``.

    Args:
        at_steps: optimizer steps after which to dump.
        on_oom: dump when training fails with ``torch.OutOfMemoryError``.
        max_entries: allocation events kept (``torch.cuda.memory._record_memory_history``).
        dir: folder inside the run directory.

    Attributes:
        written: paths of the snapshots written so far.
    """

    def __init__(self, at_steps: Optional[list[int]] = None, on_oom: bool = True,
                 max_entries: int = 100_000, dir: str = "memory_snapshots") -> None:
        self.at_steps = {int(s) for s in (at_steps or [])}
        self.on_oom, self.max_entries, self.dir = bool(on_oom), int(max_entries), dir
        self.active = False
        self.written: list[Path] = []

    def fit_start(self, state: Any) -> None:
        if state.module.device.type != "cuda":
            say(state.trainer, "memory_snapshot: training runs on the CPU, which has no CUDA memory "
                         "history to record; this callback does nothing")
            return
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        self.active = True

    def dump(self, trainer: Any, tag: str) -> Optional[Path]:
        """Write a snapshot now; ``None`` when not recording (CPU)."""
        if not self.active:
            return None
        out = run_dir(trainer) / self.dir
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{trainer.global_rank}_{tag}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        self.written.append(path)
        say(trainer, f"memory_snapshot: wrote {path}")
        return path

    def after_optimizer_step(self, state: Any) -> None:
        if not self.active:
            return
        trainer, step = state.trainer, state.step
        request = run_dir(trainer) / REQUEST_FILE
        if step in self.at_steps or request.exists():
            self.dump(trainer, f"step{step}")
            if trainer.is_global_zero:
                request.unlink(missing_ok=True)

    def fit_exception(self, state: Any) -> None:
        if self.active and self.on_oom and isinstance(state.exception, torch.OutOfMemoryError):
            self.dump(state.trainer, f"step{state.trainer.global_step}_oom")
        self.fit_end(state)

    def fit_end(self, state: Any) -> None:
        if self.active:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.active = False
