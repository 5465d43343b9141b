"""Expert parallelism: the experts of each MoE layer split over the ``ep`` mesh dim, tokens sent
to the rank that holds their expert and back (torchtitan's ``ExpertParallel``,
``torchtitan/distributed/expert_parallel.py``, is the anchor).

What is split comes from the family's spec (``ModelSpec.experts``: the expert layers, each with
``num_experts`` ``E``, parameters ``[E, ...]`` and ``forward(x [M, D] sorted by expert, counts
[E], ...)``); this module knows no family and no YAML. For every expert layer:

* its parameters become DTensors ``Shard(0)`` on the ``ep`` mesh: rank ``r`` of ``ep`` holds
  experts ``r * E/ep .. (r+1) * E/ep - 1``;
* before its forward, the per-expert row counts are exchanged (one ``all_to_all_single`` of
  ``E`` integers), then the rows themselves (``all_to_all_single`` with uneven splits), and the
  received rows, ordered (source rank, expert), are reordered to (expert, source rank) so the
  layer computes its local experts with ``counts [E/ep]``;
* after it, the rows are put back in their received order and returned to their ranks by the
  reverse ``all_to_all_single`` (autograd: the backward runs the opposite exchanges).

:func:`shard_experts` then puts the expert weights under FSDP2 over the rest of ``dp_shard``
(``efsdp``), with the gradient divided by the whole data-parallel degree, because each rank's
expert gradients already sum the tokens of its ``ep`` peers.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from llmforge.errors import ConfigError

__all__ = ["ExpertParallel", "apply_expert_parallel", "check_expert_parallel", "shard_experts"]


class ExpertParallel:
    """Dispatch and combine of one expert layer over a 1-D ``ep`` mesh (see the module docs).

    The splits of the last forward are kept on the instance for the combine that follows it
    (an activation-checkpointing recompute repeats both in order)."""

    def __init__(self) -> None:
        self._state: Optional[tuple[torch.Tensor, list[int], list[int]]] = None

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: Any) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]), requires_grad=p.requires_grad))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        """``(x [M, D] sorted by global expert, counts [E], *rest)`` -> this rank's rows
        ``[M', D]`` sorted by local expert, ``counts [E/ep]``, ``*rest``."""
        x, counts, *rest = inputs
        group, ep = mesh.get_group(), mesh.size()
        counts = counts.to(torch.int64)
        local = counts.numel() // ep
        # the row counts first: recv[s, e] = rows rank s sends to my local expert e
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        recv = recv.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()  # host sync: the row exchange needs the sizes
        rows = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)
        # received rows are grouped (source rank, expert); the experts want (expert, source rank)
        key = (torch.arange(local, device=recv.device) * ep).repeat(ep) + \
            torch.arange(ep, device=recv.device).repeat_interleave(local)
        order = torch.argsort(torch.repeat_interleave(key, recv.reshape(-1)), stable=True)
        self._state = (order, send_splits, recv_splits)
        return (rows[order], recv.sum(0), *rest)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: Any) -> torch.Tensor:
        """The layer's ``[M', D]`` rows back to the ranks and order they came from: ``[M, D]``."""
        assert self._state is not None, "combine without a dispatch"
        order, send_splits, recv_splits = self._state
        back = torch.empty_like(out).index_copy(0, order, out)  # undo the (expert, rank) sort
        return all_to_all_single_autograd(back, send_splits, recv_splits, mesh.get_group())

    def apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Shard ``module``'s parameters on dim 0 over ``mesh`` and hook its forward."""
        return distribute_module(module, mesh, self._partition,
                                 input_fn=self._dispatch, output_fn=self._combine)


def check_expert_parallel(experts: list[nn.Module], ep: int, model_name: str,
                          declared: bool = False) -> None:
    """Raises ConfigError: ``ep > 1`` and the model has no expert layers (``declared``: its
    ModelSpec has an ``experts`` hook, so this configuration left every layer dense), or ``ep``
    does not divide a layer's ``num_experts`` (the message lists the degrees that do)."""
    if ep == 1:
        return
    if not experts:
        why = ("this configuration of it has none: every layer is dense (check the model: keys "
               "that choose the sparse layers)" if declared else "its ModelSpec declares no experts")
        raise ConfigError(f"strategy.ep={ep}: model '{model_name}' has no expert layers ({why}); "
                          "use strategy.ep=1")
    for n in sorted({int(m.num_experts) for m in experts}):
        if n % ep:
            ok = [d for d in range(1, n + 1) if n % d == 0]
            raise ConfigError(f"strategy.ep={ep} must divide model.num_experts ({n}); use "
                              f"strategy.ep in {ok}")


def apply_expert_parallel(experts: Iterable[nn.Module], ep_mesh: Any) -> None:
    """Make every expert layer expert-parallel over the 1-D ``ep_mesh`` (on the meta device or
    materialized)."""
    for module in experts:
        ExpertParallel().apply(module, ep_mesh)


def shard_experts(experts: Iterable[nn.Module], mesh: Any, divide_factor: int, **fsdp_kwargs: Any) -> None:
    """``fully_shard`` each expert layer over ``mesh`` (``efsdp``, or (dp_replicate, efsdp) for
    HSDP), before the blocks that hold them, with the gradient divided by ``divide_factor``
    (the data-parallel degree ``dp``: FSDP2 would divide by the mesh size only, but a rank's
    expert gradients already sum over the tokens of its ``ep`` peers)."""
    for module in experts:
        fully_shard(module, mesh=mesh, **fsdp_kwargs)
        module.set_gradient_divide_factor(float(divide_factor))
        if mesh.device_type == "cpu" and mesh.size(mesh.ndim - 1) > 1:
            # gloo has no PREMUL_SUM: sum, then divide (not on a 1-rank shard group, where
            # torch 2.13's FSDP2 would then divide twice)
            module.set_force_sum_reduction_for_comms(True)
