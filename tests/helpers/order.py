"""A Lightning callback and an llmforge algorithm that record, into one list, when they act
(tests/test_events_train.py checks the order against docs/algorithms/README.md)."""

from lightning.pytorch.callbacks import Callback

from llmforge.algorithms import Algorithm

SEEN: list[str] = []
"""``L.<hook>`` for the Lightning callback, ``A.<event>`` for the algorithm, in call order."""


class LightningHooks(Callback):
    """Records the Lightning hooks a callback named by import path gets."""

    def on_fit_start(self, trainer, pl_module):
        SEEN.append("L.on_fit_start")

    def on_train_start(self, trainer, pl_module):
        SEEN.append("L.on_train_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        SEEN.append("L.on_train_batch_start")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        SEEN.append("L.on_before_optimizer_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        SEEN.append("L.on_train_batch_end")

    def on_validation_end(self, trainer, pl_module):
        SEEN.append("L.on_validation_end")

    def on_train_end(self, trainer, pl_module):
        SEEN.append("L.on_train_end")


def _record(event):
    def handler(self, state):
        SEEN.append(f"A.{event}")
    handler.__name__ = event
    return handler


class EventOrder(Algorithm):
    """Records the llmforge events of a step (not the per-micro-batch ones)."""

    name = "event_order"


for _event in ("before_load", "fit_start", "batch_start", "before_optimizer_step", "after_optimizer_step",
               "before_evaluation", "after_evaluation", "step_recorded", "fit_end"):
    setattr(EventOrder, _event, _record(_event))
