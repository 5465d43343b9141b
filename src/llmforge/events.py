"""The event contract: what an algorithm or callback may see and change during training.

Composer's ``composer/core/event.py`` is the anchor. One optimizer step of
:class:`llmforge.training.module.LLMModule` under the micro-batch step (``strategy.pp = 1``;
the pipeline step's differences are in the table below) is this fixed sequence (``x n`` = once
per micro-batch)::

    BATCH_START                 state.batch: this rank's windows; may be replaced
    ├─ BEFORE_FORWARD      x n  state.inputs / labels / doc_ids of the micro-batch; may be replaced
    ├─ AFTER_FORWARD       x n  state.outputs: the model's output (logits [b, T, V]); may be replaced;
    │                           state.aux_losses: the model's auxiliary losses of this forward
    ├─ BEFORE_LOSS         x n  may set state.loss: then the default cross-entropy is not computed;
    │                           may change state.aux_losses (e.g. reweight or drop a term)
    ├─ AFTER_LOSS          x n  state.loss: summed loss over the micro-batch's target tokens, the
    │                           auxiliary losses included (training only: n_targets * each term);
    │                           may be replaced or gain terms; state.metrics may gain entries
    ├─ BEFORE_BACKWARD     x n
    ├─ AFTER_BACKWARD      x n
    BEFORE_OPTIMIZER_STEP       gradients reduced and clipped, state.grad_norm; state.step is the
                                step being taken (1-based); may set state.skip_step (no optimizer
                                or schedule step for this batch) or a parameter's grad to None
                                (the optimizer skips it: docs/research.md)
    AFTER_OPTIMIZER_STEP        weights updated (unless skipped)
    BEFORE_EVALUATION / AFTER_EVALUATION   around each evaluation; state.eval_metrics after it
    STEP_RECORDED               the step's record is written (loggers); last event of a step;
                                the checkpointer saves here

plus ``BEFORE_LOAD`` (model materialized, optimizer built, before a resume checkpoint loads:
create the state it restores into), ``FIT_START`` (a resumed checkpoint loaded: the
checkpointer loads it as the first handler of this event), ``FIT_END`` (training is over) and
``FIT_EXCEPTION`` (training stopped on ``state.exception``, a preemption too: release what
``FIT_START`` took; ``FIT_END`` does not follow). Evaluation runs ``BEFORE_FORWARD`` to ``AFTER_LOSS`` too, with
``state.training = False`` (an extra loss term such as z-loss stays out of ``eval/loss``).

What each step fires (:mod:`llmforge.training.steps`; ``Step.fires``)::

    event                    MicroBatchStep (pp = 1)  PipelineStep (pp > 1)
    BATCH_START              once per step            once per step, on every rank
    BEFORE_FORWARD           per micro-batch          never: the first stage's inputs are sent
                                                      before a handler could change them
    AFTER_FORWARD,           per micro-batch          per micro-batch, in order, on the ranks
    BEFORE_LOSS, AFTER_LOSS                           of the last stage (state.inputs is None)
    BEFORE_BACKWARD,         per micro-batch          once per step, around the schedule (its
    AFTER_BACKWARD                                    forwards and backwards interleave)
    BEFORE_OPTIMIZER_STEP    once per step            once per step; afterwards the last stage's
                                                      plugin metrics and any skip on every rank
    AFTER_OPTIMIZER_STEP,    once per step /          the same
    STEP_RECORDED,           per evaluation
    BEFORE/AFTER_EVALUATION
    BEFORE_LOAD, FIT_*       once per fit             the same

The context-parallel step (``strategy.cp > 1``, a micro-batch step on each rank's slice of
every sequence) fires every event as ``MicroBatchStep`` does; from ``BEFORE_FORWARD`` to
``AFTER_BACKWARD`` ``state.inputs``, ``labels``, ``doc_ids`` and ``token_mask`` are the rank's
slice (``[b, T / cp]``: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``), ``state.outputs`` its
logits and ``state.loss`` / ``state.n_targets`` its summed loss and targets;
``state.total_targets`` and ``train/loss`` count the whole rows. ``BATCH_START`` sees the whole
rows, which every cp rank of a data-parallel rank holds.

Before the run starts (:func:`llmforge.training.steps.check_plugins`, on the algorithms) and
at fit start (:meth:`Dispatcher.check_fires`, on every callback) a plugin that handles an event
its run's step never fires is refused with a one-line :class:`~llmforge.errors.ConfigError`
(exit 2) naming the plugin, the event and the layout, rather than sit idle; e.g.
``chunked_cross_entropy`` (which hands the labels to the head at ``BEFORE_FORWARD``) under
``strategy.pp > 1``.

A plugin handles an event by defining the method of the event's name
(``def after_loss(self, state): ...``); :class:`Event` values are those names. Several plugins
on one event run by ascending ``order`` (class attribute, default 0), then by ``name``: never
in the order of the YAML lists. Events nobody handles cost nothing (the handlers of each event
are collected once per fit).

Plugin state: ``state_dict()``/``load_state_dict()`` (Lightning's ``Callback`` protocol; plain
JSON values, in ``trainer_state.json``) and ``sharded_state_dict()``/
``load_sharded_state_dict()`` (tensors, sharded like the weights, in the DCP checkpoint) are
saved in every checkpoint under the plugin's ``state_key`` (the class name unless the class
defines it; two plugins with state under one key are refused) and restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Optional

import torch

from llmforge.errors import ConfigError, LLMForgeError

IGNORE_INDEX = -100
"""The label of a position without a target (padding, prompts of SFT rows, masked tokens):
``torch.nn.functional.cross_entropy``'s default ``ignore_index``; every loss, token count and
data builder of :attr:`State.labels` uses this one value."""


class Event(str, Enum):
    """The points of a run at which plugins act; the value is the handler method's name."""

    BEFORE_LOAD = "before_load"
    FIT_START = "fit_start"
    BATCH_START = "batch_start"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BEFORE_EVALUATION = "before_evaluation"
    AFTER_EVALUATION = "after_evaluation"
    STEP_RECORDED = "step_recorded"
    FIT_END = "fit_end"
    FIT_EXCEPTION = "fit_exception"


@dataclass
class State:
    """What a plugin receives at each event (one object per fit, updated in place).

    Attributes:
        cfg: the resolved run config.
        module: the :class:`~llmforge.training.module.LLMModule`.
        trainer: the ``lightning.Trainer`` (``None`` outside one, e.g. in unit tests).
        step: the optimizer step being computed (1-based; during ``BATCH_START`` ..
            ``STEP_RECORDED`` of step ``n`` it is ``n``; 0 for the evaluation before training).
        training: ``False`` during an evaluation.
        batch: this rank's batch of the step: windows ``LongTensor[local_batch, T + 1]`` or a dict
            with ``input_ids``/``labels`` (``[local_batch, T]``) and optionally ``doc_ids`` and
            ``token_mask``.
        micro_batch: index of the current micro-batch; ``n_micro`` how many the step has.
        inputs, labels, doc_ids: the current micro-batch, ``LongTensor[b, T]`` (labels -100 = no
            target; ``doc_ids`` ``None`` unless packed SFT rows). ``token_mask``: ``BoolTensor[b,
            T]`` of SFT rows (False = padding, which a model's routers leave out), else ``None``.
        outputs: what the model returned for ``inputs`` (logits ``[b, T, V]`` for the built-ins),
            from ``AFTER_FORWARD`` to ``BEFORE_BACKWARD`` of its micro-batch in training, then
            ``None``: backward runs without the logits (as after a Lightning ``training_step``
            returns), and only what the loss's graph saved stays alive.
        aux_losses: the model's auxiliary losses of the current micro-batch's forward
            (``name -> scalar tensor``, a mean per token with its weight, e.g. a router's
            load-balancing loss; ``{}`` for models without: the ``aux_losses()`` method of the
            model factory contract, :mod:`llmforge.models`). In training, after ``BEFORE_LOSS``,
            ``n_targets * sum(aux_losses.values())`` is added to ``loss``; evaluation leaves them
            out, so ``eval/loss`` stays the cross-entropy.
        loss: the micro-batch's loss summed over its target tokens (nats, a scalar tensor),
            set by the default cross-entropy or a plugin in ``BEFORE_LOSS``.
        n_targets: target tokens of the micro-batch (``labels != -100``), a scalar tensor.
        total_targets: target tokens of the whole step on all data-parallel ranks (the loss
            normalizer; the step's mean loss is ``sum(loss) / total_targets``).
        grad_norm: global gradient L2 norm before clipping (``BEFORE_OPTIMIZER_STEP`` on).
        skip_step: set ``True`` in ``BEFORE_OPTIMIZER_STEP`` to drop this batch's update.
        metrics: the step's record (``train/loss``, ...); plugins add ``"name": value``.
        eval_metrics: the last evaluation's metrics (``AFTER_EVALUATION``).
        exception: what stopped training (``FIT_EXCEPTION``), else ``None``.
    """

    cfg: Any = None
    module: Any = None
    trainer: Any = None
    step: int = 0
    training: bool = True
    batch: Any = None
    micro_batch: int = 0
    n_micro: int = 1
    inputs: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    doc_ids: Optional[torch.Tensor] = None
    token_mask: Optional[torch.Tensor] = None
    outputs: Any = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: Optional[torch.Tensor] = None
    n_targets: Optional[torch.Tensor] = None
    total_targets: Optional[torch.Tensor] = None
    grad_norm: Optional[torch.Tensor] = None
    skip_step: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    exception: Optional[BaseException] = None

    @property
    def model(self) -> Any:
        """The (transformed, possibly sharded) ``nn.Module``."""
        return getattr(self.module, "model", None)

    @property
    def optimizer(self) -> Any:
        """The torch optimizer (``None`` before ``configure_optimizers``)."""
        trainer = self.trainer
        if trainer is not None and trainer.optimizers:
            return trainer.optimizers[0]
        return getattr(self.module, "bare_optimizer", None)

    @property
    def mesh(self) -> Any:
        """The device mesh (dims ``dp_replicate``, ``dp_shard``, ``tp``; flattened ``dp``) or
        ``None`` in one process."""
        return getattr(self.module, "mesh", None)

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel ranks (identity in one process)."""
        return self.module.dp_all_reduce(t)


def handles(plugin: Any, event: Event) -> bool:
    """Whether ``plugin`` defines a handler for ``event`` (a callable attribute of its name)."""
    return callable(getattr(plugin, event.value, None))


def plugin_order(plugin: Any) -> tuple[int, str, str]:
    """Sort key of plugins on one event: ``order``, then ``name``, then the class path."""
    cls = type(plugin)
    return (int(getattr(plugin, "order", 0)), str(getattr(plugin, "name", cls.__name__)),
            f"{cls.__module__}.{cls.__qualname__}")


class PluginError(LLMForgeError):
    """A plugin's event handler raised, or left ``state.loss`` not a scalar tensor. Exit code 1;
    the message names the plugin, the event and the step (``--debug`` shows the traceback)."""


def plugin_label(handler: Any) -> str:
    """``module.Class`` of a bound handler's plugin (its ``name`` for the built-ins)."""
    plugin = getattr(handler, "__self__", handler)
    cls = type(plugin)
    return f"{cls.__module__}.{cls.__qualname__}"


class Dispatcher:
    """Calls the handlers of each event in the documented order.

    Args:
        plugins: algorithms and callbacks (objects without any handler are ignored).

    Raises:
        PluginError: from :meth:`__call__`, wrapping what a handler raised (an
            :class:`~llmforge.errors.LLMForgeError` passes unchanged: its message is already
            for the user).
    """

    def __init__(self, plugins: Iterable[Any] = ()) -> None:
        ordered = sorted(plugins, key=plugin_order)
        self.plugins = ordered
        self.handlers: dict[Event, list[Callable[[State], Any]]] = {
            e: [getattr(p, e.value) for p in ordered if handles(p, e)] for e in Event}

    def __call__(self, event: Event, state: State) -> None:
        for handler in self.handlers[event]:
            try:  # free unless it raises (Python 3.11 zero-cost exceptions)
                handler(state)
            except LLMForgeError:
                raise
            except Exception as exc:
                raise PluginError(f"{plugin_label(handler)}.{event.value} (step {state.step}) "
                                  f"raised {type(exc).__name__}: {exc}") from exc

    def check_loss(self, state: State, *events: Event) -> None:
        """Refuse a ``state.loss`` that is not a scalar tensor after ``events``.

        Raises:
            PluginError: naming the handlers of ``events`` (one of them set it).
        """
        loss = state.loss
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return
        what = (f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor)
                else type(loss).__name__)
        who = ", ".join(dict.fromkeys(plugin_label(h) for e in events for h in self.handlers[e]))
        raise PluginError(f"state.loss after {events[-1].value} is {what}, not a scalar tensor "
                          f"(set by one of: {who or 'no plugin'}); keep it a 0-dim tensor, e.g. "
                          "state.loss = state.loss + term.sum()")

    def check_fires(self, fires: Iterable[Event], layout: str, remedy: str = "") -> None:
        """Refuse a plugin whose handler would never run: one that handles an event outside
        ``fires`` (the run's step's ``Step.fires``; ``layout`` names the step in the message,
        ``remedy`` the other way out, e.g. ``set strategy.pp=1``).

        Raises:
            ConfigError: naming the first such plugin, its events and ``layout``.
        """
        fired = set(fires)
        for plugin in self.plugins:
            idle = [e.value for e in Event if e not in fired and handles(plugin, e)]
            if idle:
                cls = type(plugin)
                name = getattr(plugin, "name", None)
                label = name if isinstance(name, str) else f"{cls.__module__}.{cls.__qualname__}"
                raise ConfigError(f"plugin {label} handles {', '.join(idle)}, which {layout} never "
                                  f"fires (llmforge.events): remove {label} from the run"
                                  + (f" or {remedy}" if remedy else ""))

    def has(self, event: Event) -> bool:
        return bool(self.handlers[event])
