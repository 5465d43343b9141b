"""Gradient and data-parallel steps of :class:`llmforge.training.module.LLMModule` (a mixin):
the sum over data-parallel ranks, when FSDP2 reduces gradients during accumulation, the global
gradient-norm clip (over meshes and pipeline stages) and the model's after-step hook."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from llmforge.parallel.grad_norm import clip_grad_norm_


class GradientSteps:
    """Needs ``self.mesh``, ``self.model``, ``self.cfg`` and the pipeline mixin's
    ``pp_schedule`` / ``pp_total_norm`` (:class:`llmforge.training.pipeline_steps.PipelineSteps`)."""

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the data-parallel ranks (the mesh's ``dp`` dim); identity in one
        process. Ranks of one tensor-parallel group hold the same data and are not summed."""
        mesh = self.mesh
        if mesh is None or mesh["dp"].size() == 1:
            return t
        t = t.detach().clone()
        torch.distributed.all_reduce(t, group=mesh["dp"].get_group())
        return t

    def no_sync(self, last_micro_batch: bool) -> Any:
        """Skip the gradient reduction for all but the last micro-batch where that costs no
        memory: replicated weights (DDP) keep whole gradients anyway. Sharded weights (FSDP2 /
        HSDP, ``dp_shard > 1``) reduce-scatter every micro-batch, as torchtitan does: skipping
        it would keep every gradient unsharded until the last micro-batch (32.6 GiB per GPU
        for the 70B yaml, docs/scale.md)."""
        setter = getattr(self.model, "set_requires_gradient_sync", None)
        if setter is not None:
            mesh = self.mesh
            sharded = mesh is not None and "dp_shard" in (mesh.mesh_dim_names or ()) \
                and mesh["dp_shard"].size() > 1
            setter(last_micro_batch or sharded)
        return nullcontext()

    def model_after_optimizer_step(self) -> None:
        """The model's optional ``after_optimizer_step(all_reduce)`` (the model factory contract
        of :mod:`llmforge.models`) with :meth:`dp_all_reduce`."""
        fn = getattr(self.model, "after_optimizer_step", None)
        if fn is not None:
            fn(self.dp_all_reduce)

    def clip_gradients_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Clip the global L2 norm of all gradients to ``trainer.gradient_clip_val`` (once per
        optimizer step) and return the norm before clipping (a scalar tensor). With pipeline
        stages the norm is over all stages (reduced across the ``pp`` ranks)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        combine = self.pp_total_norm if self.pp_schedule is not None else None
        return clip_grad_norm_(params, self.cfg.trainer.gradient_clip_val, combine)
