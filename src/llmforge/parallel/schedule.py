"""The ``torch.distributed.pipelining`` schedule of a rank's pipeline stages
(:mod:`llmforge.parallel.pipeline` cuts the model): each stage's module as ``PipelineStage``
runs it (FSDP2 root, the auxiliary-loss statistics that ride with the hidden states), the
metadata pass kept out of the model's state, and forward-only evaluation for every schedule.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _runtime

from llmforge.parallel.pipeline import (
    MULTI_STAGE,
    SCHEDULE_CLASSES,
    PipelineLayout,
    stage_view,
)

__all__ = ["build_schedule", "forward_only"]


class _StageModule(nn.Module):
    """What ``PipelineStage`` runs for one stage's module ``stage``.

    * An ``FSDPModule`` stage behind a plain module: ``PipelineStage`` treats an FSDP module
      its own way (every micro-batch's gradients kept unsharded, one reduce-scatter after the
      last), which costs the whole stage's unsharded gradients; llmforge reduce-scatters every
      micro-batch, as in gradient accumulation without stages (``MicroBatchStep.no_sync``).
    * ``carry`` (a model with ``aux_carry()``, the auxiliary-loss channel of
      :mod:`llmforge.models`): the stage returns ``(output, carry)``, its own ``aux_carry()``
      plus the one the stage before sent (none on the first stage), so the last stage's loss
      sees the whole model's router statistics and their gradients flow back through the
      schedule's sends like the hidden states' (DeepSeek's and Megatron's auxiliary-loss
      pattern, here with the statistics instead of the loss).
    * ``on_forward(stage)``: called after each forward (e.g. to record the stage's metrics).
    """

    def __init__(self, stage: nn.Module, carry: bool = False, first: bool = True,
                 on_forward: Optional[Callable[[nn.Module], None]] = None) -> None:
        super().__init__()
        self.stage = stage
        self.carry, self.first, self.on_forward = carry, first, on_forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        carry_in = None
        if self.carry and not self.first:
            *args, carry_in = args
        out = self.stage(*args, **kwargs)
        if self.on_forward is not None:
            self.on_forward(self.stage)
        if not self.carry:
            return out
        carry = self.stage.aux_carry()
        return out, (carry if carry_in is None else carry_in + carry)


def _unless(flag: list, fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    return lambda stage: None if flag[0] else fn(stage)


def build_schedule(model: nn.Module, layout: PipelineLayout, pp_mesh: Any, device: Any,
                   loss_fn: Callable[..., Any], ends: tuple[Sequence[str], Sequence[str]],
                   stage_root: Optional[Callable[[nn.Module], Any]] = None, carry: bool = False,
                   on_forward: Optional[Callable[[nn.Module], None]] = None) -> Any:
    """The ``torch.distributed.pipelining`` schedule of this rank's stages of the pruned ``model``.

    ``loss_fn(output, target) -> scalar`` runs on the last stage once per micro-batch, in
    micro-batch order; its value is what the backward starts from (``scale_grads=False``: the
    caller scales it). Micro-batches split dim 0 of the inputs and targets passed to ``step``
    (and of keyword tensors, which reach every stage's forward, e.g. ``doc_ids``).
    ``stage_root(stage_module)``: applied to each stage's module (the FSDP2 root of the stage,
    :func:`llmforge.parallel.transforms.fsdp_stage_root`). ``carry``: the model has
    ``aux_carry()``; the last stage's ``output`` is then ``(logits, carry summed over all
    stages)`` (:class:`_StageModule`). ``on_forward(stage_module)`` runs after each stage
    forward.
    """
    rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    inferring = [False]
    stages = []
    for s in layout.stages_of_rank(rank):
        view = stage_view(model, layout.split[s], s == 0, s == layout.num_stages - 1, ends)
        if stage_root is not None:
            stage_root(view)
        if stage_root is not None or carry or on_forward is not None:
            view = _StageModule(view, carry, s == 0, on_forward and _unless(inferring, on_forward))
        stage = PipelineStage(view, s, layout.num_stages, device, group=group)
        _mark_inference(stage, inferring)
        stages.append(stage)

    def schedule_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        # the stage's shape inference calls the loss once on placeholder tensors (uninitialized
        # values) before the first step: only its gradient's shape matters, so the caller's loss
        # (and its events and sums) sees real micro-batches only
        if inferring[0]:  # ones as the output's gradient: the sends' buffers follow its layout
            outs = output if isinstance(output, tuple) else (output,)  # (an expanded one is not
            return sum((o.float() * torch.ones_like(o, dtype=torch.float32)).sum() for o in outs)  # contiguous)
        return loss_fn(output, target)

    cls = getattr(pipelining, SCHEDULE_CLASSES[layout.schedule])
    return cls(stages if layout.schedule in MULTI_STAGE else stages[0], n_microbatches=layout.microbatches,
               loss_fn=schedule_loss, scale_grads=False)


@contextlib.contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """Within it, ``schedule.eval`` runs forwards only. torch 2.13's zero-bubble V runtimes
    (``zbv``, ``dualpipev``) keep their backward actions in ``eval`` and fail on the first
    one ("can't steal_bwd_input if this stage doesn't have backward"), so they get a copy of
    their compute actions with the forwards alone (an overlapped forward-backward pair keeps its
    forward), lowered with its sends and receives, for the time of the evaluation; the other
    schedules are left alone."""
    if not isinstance(schedule, (getattr(pipelining, "ScheduleZBVZeroBubble", ()),
                                 getattr(pipelining, "ScheduleDualPipeV", ()))):
        yield
        return
    def forwards(action: Any) -> list:
        if action.computation_type == _runtime._ComputationType.FORWARD:
            return [action]
        return [a for a in (action.sub_actions or ()) if a.computation_type == _runtime._ComputationType.FORWARD]

    def rank_of(stage_index: int) -> int:
        return schedule.stage_index_to_group_rank[stage_index]

    lowered = schedule.pipeline_order_with_comms
    fwd = {rank: [f for a in actions if a is not None for f in forwards(a)]
           for rank, actions in schedule.pipeline_order.items()}
    # the lowering of _prepare_schedule_with_comms without its checks (which want backwards)
    comms = _runtime._add_send_recv(fwd, stage_to_rank=rank_of, num_stages=schedule._num_stages)
    if getattr(schedule, "_defer_pp_recv", False):
        comms = _runtime._defer_recv_ops(comms, stage_to_rank=rank_of)
    schedule.pipeline_order_with_comms = comms
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = lowered


def _mark_inference(stage: Any, flag: list) -> None:
    """Set ``flag[0]`` while ``stage`` infers its forward and backward metadata (torch 2.13's
    private ``_prepare_forward_infra`` / ``_prepare_backward_infra``, which run the stage and
    the loss on placeholders; nothing to do where a torch version lacks them), and put the
    stage module's buffers back afterwards: an inference forward must leave no trace in the
    model (e.g. a router's expert-load counter)."""
    for name in ("_prepare_forward_infra", "_prepare_backward_infra"):
        prepare = getattr(stage, name, None)
        if prepare is not None:
            setattr(stage, name, _marked(prepare, stage.submod, flag))


def _marked(prepare: Callable[..., Any], module: nn.Module, flag: list) -> Callable[..., Any]:
    def marked(*args: Any, **kwargs: Any) -> Any:
        saved = [(b, b.detach().clone()) for b in module.buffers()]
        flag[0] = True
        try:
            return prepare(*args, **kwargs)
        finally:
            flag[0] = False
            with torch.no_grad():  # only what changed: the backward's inference needs the
                for buf, value in saved:  # forward's saved buffers (e.g. RoPE) unmodified
                    if not torch.equal(buf, value):
                        buf.copy_(value)

    return marked
