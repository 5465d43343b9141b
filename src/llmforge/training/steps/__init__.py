"""The training step as an object: one class per execution plan of an optimizer step.

:class:`~llmforge.training.module.LLMModule` chooses one in ``configure_model`` from the
resolved mesh (:func:`choose_step`) and its ``training_step``, ``forward_backward`` and
``evaluate`` call into it::

    Step (base.py)             the optimizer step around forward_backward, the loss events,
    |                          clipping, data-parallel sums, the evaluation's frame, fires
    +-- MicroBatchStep         strategy.pp = 1: forward/backward per micro-batch, no_sync
    +-- PipelineStep           strategy.pp > 1: the rank's stages run by a pipeline schedule

Each declares the events it fires (``Step.fires``; the table is in :mod:`llmforge.events`); at
fit start a plugin handling an event its run's step never fires is refused
(:meth:`llmforge.events.Dispatcher.check_fires`). A step that changes how the sequence is
split (context parallelism) wraps one of these and keeps its ``fires`` or narrows it.
"""

from __future__ import annotations

from typing import Any

from llmforge.training.steps.aux import AuxRecords, model_aux_losses
from llmforge.training.steps.base import EVERY_EVENT, Step
from llmforge.training.steps.micro_batch import MicroBatchStep
from llmforge.training.steps.pipeline import PipelineStep

__all__ = ["AuxRecords", "EVERY_EVENT", "MicroBatchStep", "PipelineStep", "Step", "choose_step",
           "model_aux_losses"]


def choose_step(module: Any, ctx: Any) -> Step:
    """The step of the run's layout: :class:`PipelineStep` when the mesh has pipeline stages
    (``ctx.dims.pp > 1``), else :class:`MicroBatchStep`. ``module.model`` is materialized."""
    if ctx.dims.pp > 1:
        return PipelineStep(module, ctx)
    return MicroBatchStep(module)
