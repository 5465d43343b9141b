"""The training step as an object: one class per execution plan of an optimizer step.

:class:`~llmforge.training.module.LLMModule` chooses one in ``configure_model`` from the
resolved mesh (:func:`choose_step`) and its ``training_step``, ``forward_backward`` and
``evaluate`` call into it::

    Step (base.py)             the optimizer step around forward_backward, the loss events,
    |                          clipping, data-parallel sums, the evaluation's frame, fires
    +-- MicroBatchStep         strategy.pp = 1: forward/backward per micro-batch, no_sync
    |   +-- ContextParallelStep  strategy.cp > 1: the same on this rank's slice of every sequence
    +-- PipelineStep           strategy.pp > 1: the rank's stages run by a pipeline schedule
        +-- ContextParallelPipelineStep  and strategy.cp > 1: the schedule on the slices

Each declares the events it fires (``Step.fires``; the table is in :mod:`llmforge.events`); at
fit start a plugin handling an event its run's step never fires is refused
(:meth:`llmforge.events.Dispatcher.check_fires`). A step that changes how the sequence is
split (context parallelism) extends one of these and keeps its ``fires`` or narrows it.
"""

from __future__ import annotations

from typing import Any, Sequence

from llmforge.events import Dispatcher

from llmforge.training.steps.aux import AuxRecords, model_aux_losses
from llmforge.training.steps.base import EVERY_EVENT, Step
from llmforge.training.steps.context_parallel import ContextParallelPipelineStep, ContextParallelStep
from llmforge.training.steps.micro_batch import MicroBatchStep
from llmforge.training.steps.pipeline import PipelineStep

__all__ = ["AuxRecords", "ContextParallelPipelineStep", "ContextParallelStep", "EVERY_EVENT", "MicroBatchStep", "PipelineStep", "Step", "check_plugins",
           "choose_step", "model_aux_losses", "step_class"]


def step_class(dims: Any) -> type[Step]:
    """The step class of a layout (:class:`~llmforge.parallel.mesh.ParallelDims`):
    :class:`PipelineStep` with pipeline stages (``dims.pp > 1``), :class:`ContextParallelStep`
    with context parallelism (``dims.cp > 1``), :class:`ContextParallelPipelineStep` with
    both, else :class:`MicroBatchStep`."""
    cp = getattr(dims, "cp", 1) > 1
    if dims.pp > 1:
        return ContextParallelPipelineStep if cp else PipelineStep
    return ContextParallelStep if cp else MicroBatchStep


def choose_step(module: Any, ctx: Any) -> Step:
    """The step of the run's layout (:func:`step_class` of ``ctx.dims``); ``module.model`` is
    materialized."""
    cls = step_class(ctx.dims)
    return cls(module) if cls is MicroBatchStep else cls(module, ctx)


def check_plugins(plugins: Sequence[Any], dims: Any) -> None:
    """Refuse, before anything is built, a plugin that handles an event the layout's step never
    fires (what ``LLMModule.setup_events`` checks again at fit start with every callback).

    Raises:
        ConfigError: naming the plugin, the event and the layout (exit code 2).
    """
    cls = step_class(dims)
    Dispatcher(plugins).check_fires(cls.fires, cls.layout_of(dims), cls.remedy)
