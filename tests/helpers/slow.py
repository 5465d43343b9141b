"""Test callback (named in YAML by import path) that makes every optimizer step last longer, so a
run can be stopped or killed while it trains."""

import time

from lightning.pytorch.callbacks import Callback


class SlowSteps(Callback):
    """Sleep ``seconds`` after each training batch."""

    def __init__(self, seconds: float = 0.5) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class EnvProbe(Callback):
    """Write ``env_probe.json`` into the run directory: which of ``names`` are set (true/false,
    never the values), as the training process sees its environment."""

    def __init__(self, names: list) -> None:
        self.names = list(names)

    def on_train_start(self, trainer, pl_module):
        import json
        import os
        from pathlib import Path

        if trainer.global_rank == 0:
            probe = {n: bool(os.environ.get(n)) for n in self.names}
            (Path(trainer.default_root_dir) / "env_probe.json").write_text(json.dumps(probe))


class StallSetup(Callback):
    """Sleep ``seconds`` in Lightning's ``setup``, which runs before llmforge's FIT_START (where
    training starts for the stop signals): a stop sent during startup lands there however late
    a loaded machine delivers it."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds

    def setup(self, trainer, pl_module, stage):
        time.sleep(self.seconds)
