"""What every training step object shares (:class:`Step`): the optimizer step around the
forward/backward of one batch, the loss events, the gradient clip, the data-parallel sums and
the evaluation's frame. A subclass is one execution plan (:mod:`llmforge.training.steps`)."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional

import torch

from llmforge.events import IGNORE_INDEX, Event
from llmforge.parallel.grad_norm import clip_grad_norm_
from llmforge.parallel.lightning_private import count_optimizer_step
from llmforge.training.steps.aux import AuxRecords, model_aux_losses

__all__ = ["Step", "batch_doc_ids", "batch_token_mask", "split_batch"]

EVERY_EVENT = frozenset(Event)


class Step:
    """One execution plan of an optimizer step of :class:`~llmforge.training.module.LLMModule`.

    Args:
        module: the module whose ``model``, ``state``, ``cfg``, ``plan``, ``mesh``, events and
            overridable methods (``forward``, ``compute_loss``, ``backward_loss``) the step uses.

    Attributes:
        kind: the plan's name in messages (``micro-batch``, ``pipeline``).
        fires: the :class:`~llmforge.events.Event` s this step fires; at fit start a plugin
            handling any other is refused (:meth:`llmforge.events.Dispatcher.check_fires`).
            What each step fires, and how often, is documented in :mod:`llmforge.events`.
        aux: the step's auxiliary losses and records (:class:`AuxRecords`).
        dims: the run's :class:`~llmforge.parallel.mesh.ParallelDims` where a step's messages
            name its degrees (set by the steps that need it; ``None`` otherwise).
    """

    kind: ClassVar[str] = "step"
    fires: ClassVar[frozenset] = EVERY_EVENT
    dims: Any = None

    def __init__(self, module: Any) -> None:
        self.module = module
        self.aux = AuxRecords()

    @property
    def state(self) -> Any:
        return self.module.state

    remedy: ClassVar[str] = ""
    """How a run leaves this step for one that fires every event (for messages)."""

    @classmethod
    def layout_of(cls, dims: Any) -> str:
        """The layout in words, for messages (``the pipeline step (strategy.pp=2)``), from the
        run's :class:`~llmforge.parallel.mesh.ParallelDims`."""
        return f"the {cls.kind} step"

    def layout(self) -> str:
        """:meth:`layout_of` this step's run (:attr:`dims`)."""
        return self.layout_of(self.dims)

    def event(self, event: Event) -> None:
        self.module.event(event)

    # ------------------------------------------------------------ reductions
    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the data-parallel ranks (the mesh's ``dp`` dim); identity in one
        process. Ranks of one tensor-parallel group hold the same data and are not summed."""
        mesh = self.module.mesh
        if mesh is None or mesh["dp"].size() == 1:
            return t
        t = t.detach().clone()
        torch.distributed.all_reduce(t, group=mesh["dp"].get_group())
        return t

    def gradient_ranks(self) -> int:
        """The ranks the data-parallel wrapper averages gradients over (``dp_size``; the
        context-parallel steps' wrapper averages over ``dp_size x cp``): the backward's loss is
        scaled by it over the global target count."""
        return self.module.plan.dp_size

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The global gradient norm from this rank's ``norm`` (identity: every rank holds all
        layers; the pipeline step combines its stages')."""
        return norm

    def clip_gradients_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Clip the global L2 norm of all gradients to ``trainer.gradient_clip_val`` (once per
        optimizer step) and return the norm before clipping (a scalar tensor)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        combine = None if type(self).total_norm is Step.total_norm else self.total_norm
        return clip_grad_norm_(params, self.module.cfg.trainer.gradient_clip_val, combine)

    # ------------------------------------------------------------------ loss
    def outputs_loss(self) -> torch.Tensor:
        """The loss events ``BEFORE_LOSS`` .. ``AFTER_LOSS`` on ``state.outputs`` and
        ``state.labels``; returns ``state.loss`` (summed over the target tokens, plus the
        model's auxiliary losses in training)."""
        st, module = self.state, self.module
        st.loss, st.n_targets = None, (st.labels != IGNORE_INDEX).sum()
        self.event(Event.BEFORE_LOSS)
        if st.loss is None:  # no plugin computed it (e.g. chunked cross-entropy)
            st.loss, _ = module.compute_loss(st.outputs, st.labels)
        if st.training and st.aux_losses:
            st.loss = st.loss + self.aux.loss_sum(st.aux_losses, st.n_targets)
        self.event(Event.AFTER_LOSS)
        module.dispatch.check_loss(st, Event.BEFORE_LOSS, Event.AFTER_LOSS)
        return st.loss

    def model_aux_losses(self) -> dict[str, torch.Tensor]:
        return model_aux_losses(self.module.model)

    def aux_step_metrics(self, total_targets: torch.Tensor) -> dict[str, Any]:
        return self.aux.step_metrics(total_targets, self.dp_all_reduce, self.module.plan.dp_size)

    # ------------------------------------------------------- optimizer step
    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every micro-batch of one optimizer step forward and backward.

        Args:
            batch: windows ``LongTensor[local_batch_size, seq_len + 1]``, or a dict with
                ``input_ids`` and ``labels`` (``LongTensor[local_batch_size, seq_len]``, -100 =
                no target) and optionally ``doc_ids`` (packed SFT rows) and ``token_mask``
                (SFT rows, ``BoolTensor``, False = padding); see :func:`split_batch`.
                ``BATCH_START`` handlers may replace it; the target count is taken after them.

        Returns:
            ``(loss_sum, n_targets)``: this rank's summed loss and the target count over all
            data-parallel ranks; the gradients are those of ``loss_sum / n_targets`` summed over
            all ranks (the mean loss per target token of the whole accumulation window).
        """
        raise NotImplementedError

    def agree_on_step(self, keys: set[str], merged: set[str]) -> None:
        """After ``BEFORE_OPTIMIZER_STEP``: make the step's decision the same on every rank that
        holds a part of the model (nothing to do when each rank holds all of it)."""

    def model_after_optimizer_step(self) -> None:
        """The model's optional ``after_optimizer_step(all_reduce)`` (the model factory contract
        of :mod:`llmforge.models`, e.g. loss-free balancing's bias update) with
        :meth:`dp_all_reduce`."""
        fn = getattr(self.module.model, "after_optimizer_step", None)
        if fn is not None:
            fn(self.dp_all_reduce)

    def train(self, batch: Any, opt: Any, sched: Any) -> None:
        """One optimizer step: :meth:`forward_backward`, clip, optimizer step, schedule step,
        with the events of :mod:`llmforge.events` in between
        (:meth:`~llmforge.training.module.LLMModule.training_step`)."""
        module, st = self.module, self.state
        st.step = module.trainer.global_step + 1
        st.skip_step, st.grad_norm = False, None
        st.metrics = module.step_metrics = {}
        lr = opt.optimizer.param_groups[0]["lr"]
        loss_total, total_targets = module.forward_backward(batch)
        st.grad_norm = grad_norm = module.clip_gradients_(opt.optimizer)
        st.metrics.update({
            "train/loss": self.dp_all_reduce(loss_total) / total_targets,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_seen": module.tokens_seen + module.step_tokens,
        })
        aux = self.aux_step_metrics(total_targets)
        st.metrics.update(aux)
        computed = set(st.metrics)
        self.event(Event.BEFORE_OPTIMIZER_STEP)
        self.agree_on_step(set(st.metrics) - computed, set(aux))
        if st.skip_step:
            opt.zero_grad(set_to_none=True)
            count_optimizer_step(module.trainer)  # the batch is consumed: step numbers stay aligned
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            self.model_after_optimizer_step()
        module.tokens_seen += module.step_tokens
        self.event(Event.AFTER_OPTIMIZER_STEP)

    # ------------------------------------------------------------ evaluation
    def eval_sums(self, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's summed loss and target count over ``trainer.eval_batches`` batches of
        ``loader``, through the events, in eval mode."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, loader: Any) -> dict[str, float]:
        """``BEFORE_EVALUATION``, :meth:`eval_sums` with ``state.training = False``, then
        ``AFTER_EVALUATION`` with ``state.eval_metrics``; returns :meth:`eval_metrics`."""
        st = self.state
        st.training = False
        self.event(Event.BEFORE_EVALUATION)
        try:
            metrics = self.eval_metrics(*self.eval_sums(loader))
        finally:
            st.training = True
        self.module.last_eval = metrics
        st.eval_metrics = dict(metrics)
        self.event(Event.AFTER_EVALUATION)
        return metrics

    def eval_metrics(self, loss_sum: torch.Tensor, count: torch.Tensor) -> dict[str, float]:
        """``{"eval/loss": nats per target token, "eval/perplexity": exp(loss)}`` from this
        rank's summed token losses and target count (scalar tensors), summed over the
        data-parallel ranks first; exp is capped at exp(80) so a diverged run logs a number."""
        loss = (self.dp_all_reduce(loss_sum) / self.dp_all_reduce(count.float()).clamp(min=1)).item()
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 80.0))}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout()})"


def optional(t: Optional[torch.Tensor], sl: slice) -> Optional[torch.Tensor]:
    """``t[sl]``, or None for None."""
    return None if t is None else t[sl]


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)``, each ``LongTensor[B, T]``: a window batch ``[B, T + 1]`` is
    shifted by one (labels = next tokens); a dict gives ``input_ids`` and ``labels``."""
    if isinstance(batch, dict):
        return batch["input_ids"], batch["labels"]
    return batch[:, :-1], batch[:, 1:]


def batch_doc_ids(batch: Any) -> Optional[torch.Tensor]:
    """``LongTensor[B, T]`` document ids of a packed SFT batch (dict key ``doc_ids``), else None."""
    return batch.get("doc_ids") if isinstance(batch, dict) else None


def batch_token_mask(batch: Any) -> Optional[torch.Tensor]:
    """``BoolTensor[B, T]`` real tokens of an SFT batch (dict key ``token_mask``; False =
    padding), else None (windows have no padding)."""
    return batch.get("token_mask") if isinstance(batch, dict) else None
