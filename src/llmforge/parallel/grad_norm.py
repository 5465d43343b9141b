"""The gradient norm of a model whose parameters lie on several meshes or ranks: expert
parallelism (expert weights on ``(efsdp, ep)``, the rest on ``dp_shard``) and pipeline stages
(each ``pp`` rank holds other parameters). Used by :mod:`llmforge.training.gradients`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(params: list[torch.Tensor], max_norm: Optional[float],
                    combine: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` (returned, a plain scalar tensor),
    clipped to ``max_norm`` when it is not ``None``.

    Gradients may be DTensors on different meshes (expert weights on (efsdp, ep), the rest on
    dp_shard), which one ``torch.nn.utils.clip_grad_norm_`` cannot combine: the norm is taken per
    mesh (``get_total_norm``, reduced with ``full_tensor``) and the parts combined as
    ``sqrt(sum n_i^2)``; with one mesh this is exactly ``clip_grad_norm_``. ``combine`` maps
    this rank's norm to the global one when the parameters are spread over ranks that hold
    different parameters (pipeline stages: a sum of squares over the ``pp`` group).
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    if len(groups) <= 1 and combine is None:
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm
    parts = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group)
        parts.append(n.full_tensor() if isinstance(n, DTensor) else n)
    norm = torch.linalg.vector_norm(torch.stack(parts)) if parts else torch.zeros(())
    if combine is not None:
        norm = combine(norm)
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:  # each rank scales its own shard
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm
