"""Test modules (named in YAML by import path as trainer.module)."""

from llmforge.training.module import LLMModule


class NoSuperModule(LLMModule):
    """A research module whose on_train_batch_end forgets super(): no evaluation, no record,
    no STEP_RECORDED event; the checkpointer must still save when due."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass
