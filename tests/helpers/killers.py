"""Test callbacks (named in YAML by import path) that interrupt a run like the outside world does."""

import os
import signal

from lightning.pytorch.callbacks import Callback


class KillAt(Callback):
    """Send ``sig`` (a signal name) to this process at the start of optimizer step ``step``
    (1-based: ``step=6`` fires after 5 steps are done)."""

    def __init__(self, step: int, sig: str = "SIGKILL") -> None:
        self.step, self.sig = step, getattr(signal, sig)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.sig)

