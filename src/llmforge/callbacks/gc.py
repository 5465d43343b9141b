"""``gc``: Python's garbage collector on a schedule instead of at random moments.

Python's cyclic garbage collector starts a collection whenever enough objects were allocated;
in a training process that holds Lightning, datasets and a model, a full collection walks
millions of objects and stalls the step it lands in (tens of milliseconds on a CPU, and on a
GPU every rank at a different step, so the others wait in the next collective). Like
torchtitan (``torchtitan/components/gc.py``), llmforge turns the automatic collector off for
the training loop and collects the young generation every ``trainer.gc_every`` optimizer steps
(``0`` leaves Python's collector as it is); reference counting still frees everything that is
not in a cycle at once. The collector is switched back on when training ends.
"""

from __future__ import annotations

import gc
from typing import Any

from lightning.pytorch.callbacks import Callback


class GarbageCollection(Callback):
    """Disable automatic GC during training; ``gc.collect(1)`` every ``every`` steps.

    Args:
        every: optimizer steps between collections (>= 1).
    """

    def __init__(self, every: int = 50) -> None:
        self.every = int(every)
        self._was_enabled = True

    def fit_start(self, state: Any) -> None:
        self._was_enabled = gc.isenabled()
        gc.collect()  # start clean: setup left garbage behind
        gc.disable()

    def step_recorded(self, state: Any) -> None:
        """Event ``STEP_RECORDED``: the step is over (record written, checkpoint saved)."""
        if state.step % self.every == 0:
            gc.collect(1)

    def fit_end(self, state: Any) -> None:
        self._restore()

    def fit_exception(self, state: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
