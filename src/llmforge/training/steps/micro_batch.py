"""The micro-batch step: every rank holds the whole model (or its data- or tensor-parallel
shard) and runs the batch as ``gradient_accumulation_steps`` micro-batches, forward and
backward each, with gradient reduction skipped where that costs no memory."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch

from llmforge.events import IGNORE_INDEX, Event
from llmforge.parallel.mesh import mesh_dims
from llmforge.training.modes import eval_mode, restore_modes
from llmforge.training.steps.base import EVERY_EVENT, Step, optional

__all__ = ["MicroBatchStep"]


class MicroBatchStep(Step):
    """Forward and backward per micro-batch (:meth:`forward_backward`); fires every event
    of :mod:`llmforge.events`, ``BEFORE_FORWARD`` .. ``AFTER_BACKWARD`` once per micro-batch."""

    kind = "micro-batch"
    fires = EVERY_EVENT

    @classmethod
    def layout_of(cls, dims: Any) -> str:
        return "the micro-batch step (strategy.pp=1)"

    def no_sync(self, last_micro_batch: bool) -> Any:
        """Skip the gradient reduction for all but the last micro-batch where that costs no
        memory: replicated weights (DDP) keep whole gradients anyway. Sharded weights (FSDP2 /
        HSDP, ``dp_shard > 1``, or ``dp_shard x cp > 1`` under context parallelism, where FSDP2
        shards over ``dp_shard_cp``) reduce-scatter every micro-batch, as torchtitan does:
        skipping it would keep every gradient unsharded until the last micro-batch (32.6 GiB
        per GPU for the 70B yaml, docs/scale.md; 29.9 GiB for the 128K yaml's dp_shard 1 x cp 8)."""
        setter = getattr(self.module.model, "set_requires_gradient_sync", None)
        if setter is not None:
            dims = mesh_dims(self.module.mesh)  # dp_shard also where it is a flattened dim (ep > 1)
            setter(last_micro_batch or dims.dp_shard * dims.cp > 1)
        return nullcontext()

    def micro_batch_loss(self, index: int, inputs: torch.Tensor, labels: torch.Tensor,
                         doc_ids: Optional[torch.Tensor],
                         token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward and loss of one micro-batch through the events ``BEFORE_FORWARD`` ..
        ``AFTER_LOSS``; returns ``state.loss``: the loss summed over the micro-batch's target
        tokens (a scalar tensor). ``inputs``, ``labels``, ``doc_ids``: ``LongTensor[b, T]``;
        ``token_mask``: ``BoolTensor[b, T]`` or None (:meth:`LLMModule.forward`)."""
        st, module = self.state, self.module
        st.micro_batch, st.inputs, st.labels, st.doc_ids = index, inputs, labels, doc_ids
        st.token_mask = token_mask
        self.event(Event.BEFORE_FORWARD)
        st.outputs = self.model_outputs()
        st.aux_losses = self.model_aux_losses()
        if st.training:
            self.aux.record(module.model)
        self.event(Event.AFTER_FORWARD)
        return self.outputs_loss()

    def model_outputs(self) -> torch.Tensor:
        """The module's forward on ``state.inputs`` (and ``doc_ids``, ``token_mask``)."""
        st, module = self.state, self.module
        if st.doc_ids is None and st.token_mask is None:
            return module(st.inputs)
        return module(st.inputs, st.doc_ids, st.token_mask)

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every micro-batch of one optimizer step forward and backward
        (:meth:`LLMModule.forward_backward` documents ``batch`` and the returns).

        Gradients equal those of the mean loss over all target tokens of the whole
        accumulation window on all data-parallel ranks: each micro-batch's summed loss is
        divided by the global target count (times ``dp_size``, since data parallelism averages
        gradients over ranks)."""
        st, module = self.state, self.module
        st.training, st.batch = True, batch
        self.event(Event.BATCH_START)
        batch = st.batch
        inputs, labels = module.split_batch(batch)
        doc_ids, token_mask = module.doc_ids(batch), module.token_mask(batch)
        mb = module.plan.micro_batch_size
        n_micro = max(1, inputs.shape[0] // mb)
        total_targets = self.dp_all_reduce((labels != IGNORE_INDEX).sum().float()).clamp(min=1)
        st.total_targets, st.n_micro = total_targets, n_micro
        scale = self.gradient_ranks() / total_targets
        loss_total = torch.zeros((), device=inputs.device)
        for i in range(n_micro):
            sl = slice(i * mb, (i + 1) * mb)
            with self.no_sync(i == n_micro - 1):
                self.micro_batch_loss(i, inputs[sl], labels[sl], optional(doc_ids, sl),
                                        optional(token_mask, sl))
                self.event(Event.BEFORE_BACKWARD)
                # the logits [b, T, V] go before backward: the loss's graph keeps what it needs
                # (cross-entropy its log-probabilities), so backward's peak does not hold them too
                st.outputs = None
                module.backward_loss(st.loss * scale)
                # nor may the graph the loss holds outlive the micro-batch: its nodes that
                # backward skipped (frozen weights' branches, e.g. under activation
                # checkpointing) keep their saved tensors until it goes
                st.aux_losses, st.loss = {}, st.loss.detach()
                self.event(Event.AFTER_BACKWARD)
            loss_total += st.loss.detach()
        module.step_tokens = int(inputs.numel()) * module.plan.dp_size  # real tokens, all ranks
        return loss_total, total_targets

    def eval_sums(self, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``BEFORE_FORWARD`` .. ``AFTER_LOSS`` per batch, the module (the model with it) in eval
        mode: an overridden ``compute_loss`` tells an evaluation by ``self.training``;
        :func:`restore_modes` gives each submodule its own mode back."""
        st, module = self.state, self.module
        modes = eval_mode(module)
        loss_sum = torch.zeros((), device=module.device)
        count = torch.zeros((), device=module.device)
        try:
            for i, batch in enumerate(loader):
                if i >= module.cfg.trainer.eval_batches:  # streaming sources have no end
                    break
                inputs, labels = module.split_batch(batch)
                doc_ids = module.doc_ids(batch)
                with module.trainer.precision_plugin.forward_context():
                    s = self.micro_batch_loss(i, inputs.to(module.device), labels.to(module.device),
                                                None if doc_ids is None else doc_ids.to(module.device))
                st.outputs, st.aux_losses = None, {}
                loss_sum += s.float()
                count += st.n_targets
        finally:
            restore_modes(modes)
        return loss_sum, count
