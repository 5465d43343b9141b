"""The context-parallel step: the micro-batch step with every row's sequence split over the
``cp`` ranks of a data-parallel rank (``strategy.cp > 1``; :mod:`llmforge.parallel.context_parallel`).

The cp ranks read the same rows. Before ``BEFORE_FORWARD`` each keeps its load-balanced slice
(chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``) of the inputs, labels, document ids and padding
mask; the model runs on the slice with the tokens' global RoPE positions (per document in
packed rows) and an attention hook that crosses the slices (``context_parallel.mode``). So the
events see this rank's slice in ``state.inputs`` / ``state.labels`` (a plugin that hands the
labels to the output layer, chunked cross-entropy, acts on the slice) and ``state.loss`` is
the slice's summed loss; the target count and the loss are summed over ``dp x cp``, and the
gradients equal those of one process on the whole batch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from llmforge.errors import ConfigError
from llmforge.models.masks import document_positions
from llmforge.parallel.context_parallel import ContextParallelAttention, install_attention
from llmforge.training.steps.base import EVERY_EVENT, optional
from llmforge.training.steps.micro_batch import MicroBatchStep
from llmforge.training.steps.pipeline import PipelineStep

__all__ = ["ContextParallelPipelineStep", "ContextParallelStep"]


class _Slices:
    """What both context-parallel steps share: the cp groups, the attention hook installed on
    the model's attention modules, the sums over cp and the gradient scale."""

    cp: int

    def setup_slices(self, module: Any, ctx: Any) -> None:
        self.dims = ctx.dims
        self.cp = ctx.dims.cp
        self.cp_group = ctx.mesh["cp"].get_group()
        self.attention = ContextParallelAttention(self.cp_group, module.cfg.context_parallel.mode)
        install_attention(module.model, self.attention)
        self.positions: Optional[torch.Tensor] = None

    def cp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the cp ranks (a data-parallel rank's slices)."""
        t = t.detach().clone()
        torch.distributed.all_reduce(t, group=self.cp_group)
        return t

    def aux_step_metrics(self, total_targets: torch.Tensor) -> dict[str, Any]:
        """:meth:`Step.aux_step_metrics` over ``dp x cp``: each cp rank holds its slice's
        auxiliary terms (summed over the slice's targets), which ``total_targets`` (whole rows)
        divides only once summed over the slices; model metrics average over every rank."""
        return self.aux.step_metrics(total_targets, lambda t: self.dp_all_reduce(self.cp_sum(t)),
                                     self.module.plan.dp_size * self.cp)  # type: ignore[attr-defined]

    def gradient_ranks(self) -> int:
        """FSDP2 averages over ``dp_shard x cp`` (and ``dp_replicate``): ``dp_size x cp``."""
        return self.module.plan.dp_size * self.cp  # type: ignore[attr-defined]

    def slice_rows(self, inputs: torch.Tensor, doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's global token indices of rows like ``inputs [b, T]``; sets
        :attr:`positions` (``[b, t]``, per document with ``doc_ids``) and prepares the hook."""
        seq_len = inputs.shape[1]
        idx = self.attention.local_index(seq_len, inputs.device)
        if doc_ids is None:
            self.positions = idx.expand(inputs.shape[0], -1)
        else:
            self.positions = document_positions(doc_ids)[:, idx]
        self.attention.prepare(seq_len, doc_ids, inputs.device)
        return idx


class ContextParallelStep(_Slices, MicroBatchStep):
    """:class:`MicroBatchStep` on this rank's slice of every sequence; fires every event as
    the micro-batch step does, the forward and loss events on the slice (module docs).

    Args:
        module: the module (its ``model`` materialized).
        ctx: the :class:`~llmforge.plugin.ModelContext` (``dims.cp > 1``, the mesh's ``cp`` and
            ``dp_cp`` dims).

    Attributes:
        attention: the :class:`~llmforge.parallel.context_parallel.ContextParallelAttention`
            installed on the model's attention modules.
    """

    kind = "context-parallel"
    fires = EVERY_EVENT

    def __init__(self, module: Any, ctx: Any) -> None:
        super().__init__(module)
        self.setup_slices(module, ctx)

    @classmethod
    def layout_of(cls, dims: Any) -> str:
        return f"the context-parallel step (strategy.cp={dims.cp if dims is not None else '>1'})"

    def micro_batch_loss(self, index: int, inputs: torch.Tensor, labels: torch.Tensor,
                         doc_ids: Optional[torch.Tensor],
                         token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`MicroBatchStep.micro_batch_loss` on this rank's slice of the whole rows
        ``inputs``, ``labels``, ``doc_ids``, ``token_mask`` (``[b, T]``); ``state.loss`` is the
        slice's summed loss."""
        cut = slice(None), self.slice_rows(inputs, doc_ids)
        return super().micro_batch_loss(index, inputs[cut], labels[cut], optional(doc_ids, cut),
                                        optional(token_mask, cut))

    def model_outputs(self) -> torch.Tensor:
        """The model on the slice with its global positions (the attention hook masks),
        called through the module as the micro-batch step does (so module hooks, e.g. the
        simulation's memory tracker, see the same parent)."""
        st = self.state
        return self.module(st.inputs, token_mask=st.token_mask, positions=self.positions)

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`MicroBatchStep.forward_backward`; the returned loss is summed over the cp
        ranks (the data-parallel rank's whole rows), the target count counts whole rows."""
        loss_total, total_targets = super().forward_backward(batch)
        return self.cp_sum(loss_total), total_targets

    def eval_sums(self, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`MicroBatchStep.eval_sums` of the slices, summed over the cp ranks."""
        loss_sum, count = super().eval_sums(loader)
        return self.cp_sum(loss_sum), self.cp_sum(count.float())


class ContextParallelPipelineStep(_Slices, PipelineStep):
    """:class:`PipelineStep` on this rank's slice of every row (``strategy.pp > 1`` and
    ``strategy.cp > 1``): the schedule gets the slices of the inputs and labels and every stage
    the slice's global positions; fires what the pipeline step fires. Rows without documents
    only: packed rows would need each micro-batch's document mask inside the schedule.

    Raises:
        ConfigError: a batch with ``doc_ids`` (packed SFT rows).
    """

    kind = "context-parallel pipeline"

    def __init__(self, module: Any, ctx: Any) -> None:
        super().__init__(module, ctx)
        self.setup_slices(module, ctx)

    @classmethod
    def layout_of(cls, dims: Any) -> str:
        if dims is None:
            return "the context-parallel pipeline step"
        return f"the pipeline step (strategy.pp={dims.pp}, strategy.cp={dims.cp})"

    def run_schedule(self, inputs: torch.Tensor, labels: torch.Tensor, train: bool,
                     doc_ids: Any = None, token_mask: Any = None, positions: Any = None) -> None:
        """:meth:`PipelineStep.run_schedule` on this rank's slices, with their positions."""
        if doc_ids is not None:
            raise ConfigError("strategy.cp > 1 with strategy.pp > 1 takes rows without documents; "
                              "packed rows (data.packed=true) need strategy.pp=1 or strategy.cp=1")
        cut = slice(None), self.slice_rows(inputs, None)
        super().run_schedule(inputs[cut], labels[cut], train, None, optional(token_mask, cut),
                             positions=self.positions.contiguous())

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss_total, total_targets = super().forward_backward(batch)
        return self.cp_sum(loss_total), total_targets

    def eval_sums(self, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, count = super().eval_sums(loader)
        return self.cp_sum(loss_sum), self.cp_sum(count.float())
