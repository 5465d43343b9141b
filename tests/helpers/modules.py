"""Test modules (named in YAML by import path as trainer.module) and a Lightning callback."""

from lightning.pytorch.callbacks import Callback

from llmforge.training.module import LLMModule


class NoSuperModule(LLMModule):
    """A research module whose on_train_batch_end forgets super(): no evaluation, no record,
    no STEP_RECORDED event; the checkpointer must still save when due."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


class ValidationEnds(Callback):
    """Appends ``[global_step, eval/loss]`` to the JSON list in ``path`` at every
    ``on_validation_end`` (a Lightning callback named by import path)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        import json
        import os

        seen = json.load(open(self.path)) if os.path.exists(self.path) else []
        seen.append([trainer.global_step, float(trainer.callback_metrics["eval/loss"])])
        with open(self.path, "w") as f:
            json.dump(seen, f)
