"""The one bridge between Lightning's loop and llmforge's events (:mod:`llmforge.events`).

llmforge's own plugins (algorithms, callbacks, the run tracker) act on llmforge events only;
Lightning callbacks named by import path keep Lightning's hooks. Two pieces turn Lightning's
loop into events, and nothing else does:

- :class:`LLMModule <llmforge.training.module.LLMModule>`'s own hooks: ``training_step`` runs
  ``BATCH_START`` .. ``AFTER_OPTIMIZER_STEP``; ``on_train_batch_end`` (which Lightning calls
  after every callback's) evaluates, writes the record and runs ``STEP_RECORDED``;
- :class:`EventBridge`, a Lightning callback that the module puts first in
  ``trainer.callbacks`` at ``on_fit_start``, for the hooks a module does not get first (or at
  all): ``BEFORE_LOAD`` and ``FIT_START`` on ``on_train_start``, ``FIT_END`` on ``on_train_end``,
  ``FIT_EXCEPTION`` on ``on_exception``.

So in one run, with ``L`` = Lightning callbacks (in their list order)::

    L.on_fit_start
    BEFORE_LOAD, FIT_START (a resume checkpoint loads first)   then L.on_train_start
    evaluation of step 0 (BEFORE_/AFTER_EVALUATION, L.on_validation_end)
    per step:  L.on_train_batch_start
               BATCH_START .. BEFORE_OPTIMIZER_STEP, L.on_before_optimizer_step,
               AFTER_OPTIMIZER_STEP                             (inside training_step)
               L.on_train_batch_end
               evaluation when due (BEFORE_/AFTER_EVALUATION, L.on_validation_end)
               the record to every logger, STEP_RECORDED (the checkpointer saves here)
    FIT_END                                                      then L.on_train_end
    on an exception: FIT_EXCEPTION                               then L.on_exception

(``L.on_before_optimizer_step`` runs inside ``optimizer.step()``, so not for a step that a
``BEFORE_OPTIMIZER_STEP`` handler skipped.) ``tests/test_events_train.py`` checks this order
(docs/algorithms/README.md, "One bus and the Lightning bridge").
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.events import Event

__all__ = ["EventBridge", "evaluate_before_training", "publish_evaluation", "put_first", "record_step"]


class EventBridge(Callback):
    """Runs the fit-level events of ``module`` from Lightning's hooks (see the module doc).

    Args:
        module: the :class:`~llmforge.training.module.LLMModule` whose ``state`` and handlers
            the events use.
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        st = self.module.state
        st.step = trainer.global_step
        self.module.event(Event.BEFORE_LOAD)
        self.module.event(Event.FIT_START)
        st.step = trainer.global_step  # a resume moved it

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.module.event(Event.FIT_END)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.module.state.exception = exception
        self.module.event(Event.FIT_EXCEPTION)


def put_first(trainer: Any, module: Any) -> EventBridge:
    """The trainer's :class:`EventBridge` for ``module`` (made if missing), moved to the front of
    ``trainer.callbacks``: at each Lightning hook, llmforge's events come before the Lightning
    callbacks' hook (``on_fit_start`` is the last hook before ``on_train_start`` and is not
    inside a loop over the callbacks)."""
    bridge = next((c for c in trainer.callbacks if isinstance(c, EventBridge)), None) or EventBridge(module)
    bridge.module = module
    trainer.callbacks[:] = [bridge, *(c for c in trainer.callbacks if c is not bridge)]
    return bridge


def publish_evaluation(module: Any, metrics: dict[str, float], before_training: bool = False) -> None:
    """Hand an evaluation's metrics to Lightning the Lightning way: ``module.log`` (so
    ``trainer.callback_metrics`` holds them) and the callbacks' ``on_validation_end`` hook,
    which Lightning's own ``EarlyStopping``/``ModelCheckpoint(monitor=...)`` check. llmforge
    evaluates outside Lightning's validation loop (a fixed set, every ``trainer.eval_every``
    steps, and step 0), so it calls the hook itself.

    ``before_training``: the step-0 evaluation, from ``on_train_start``, where Lightning allows
    no step-level ``self.log`` (and an epoch-level value would come back at the epoch's end in
    place of the last evaluation's): the values go into ``trainer.callback_metrics`` directly,
    where the next evaluation's ``self.log`` replaces them."""
    trainer = module.trainer
    if before_training:
        trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
    else:
        for key, value in metrics.items():
            module.log(key, float(value), on_step=True, on_epoch=False, logger=False, sync_dist=False)
    for cb in trainer.callbacks:
        if type(cb).on_validation_end is not Callback.on_validation_end:
            cb.on_validation_end(trainer, module)


def evaluate_before_training(module: Any) -> None:
    """``LLMModule.on_train_start``: after ``FIT_START`` (a resumed checkpoint is loaded) and
    the Lightning callbacks' ``on_train_start``, the evaluation of step 0 (a fresh run only)."""
    trainer, st = module.trainer, module.state
    if st.trainer is None:  # a subclass's on_fit_start skipped super()
        bridge = put_first(trainer, module)
        module.setup_events()
        bridge.on_train_start(trainer, module)  # Lightning's loop over the callbacks is past
    st.step = trainer.global_step
    if trainer.global_step == 0:
        metrics = module.evaluate()
        if metrics:
            module.log_record(0, metrics)
            publish_evaluation(module, metrics, before_training=True)


def record_step(module: Any) -> None:
    """``LLMModule.on_train_batch_end`` (after every callback's): evaluate when due, write the
    record, then the event ``STEP_RECORDED`` (the checkpointer saves there, so a checkpoint of
    step N never exists without step N's record in the loggers)."""
    trainer = module.trainer
    step = trainer.global_step
    # a callback that ends the run after this step (Lightning's Timer, ...) gets the final
    # evaluation a run that reaches trainer.max_steps gets (one that stops on an
    # evaluation's result sets should_stop during it, after this check)
    stopping = bool(trainer.should_stop) and step < module.cfg.trainer.max_steps
    if module.is_eval_step(step) or stopping:
        evaluated = module.evaluate() or {}
        module.step_metrics.update(evaluated)
        if evaluated:
            publish_evaluation(module, evaluated)
    if module.is_log_step(step) or any(k.startswith("eval/") for k in module.step_metrics):
        module.log_record(step, module.step_metrics)
    module.state.step = step
    module.event(Event.STEP_RECORDED)
