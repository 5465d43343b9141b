"""Qwen3-MoE's tensor-parallel plan: Qwen3's attention plan (:mod:`llmforge.models.qwen3.parallelize`:
Megatron-style with sequence parallelism and per-head QK-norms) and, in the sparse layers, the
mixture of experts computed whole on every rank of the tp group.

The MoE's input is all-gathered from the sequence-sharded residual (``Shard(1)`` ->
``Replicate``), the router and the experts run on all tokens with unsplit weights, and each rank
keeps its sequence slice of the output (``Replicate`` -> ``Shard(1)``: no communication). The
ranks of a tp group therefore compute the same expert gradients (nothing to reduce over tp) and
the same router statistics. This is torchtitan's layout for MoE layers without expert tensor
parallelism, minus its token split over tp; expert parallelism (``strategy.ep``) splits the
experts over ``dp_shard`` ranks instead. Dense layers (``mlp_only_layers``) take the SwiGLU plan.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from llmforge.models.llama3.parallelize import apply_decoder_tp, check_decoder_tp, swiglu_plan
from llmforge.models.qwen3.parallelize import qk_norm_plan
from llmforge.models.qwen3_moe.moe import MoE
from llmforge.models.tp_styles import TPStyles

__all__ = ["apply_tp", "check_tp"]


def moe_plan(block: nn.Module, styles: Optional[TPStyles] = None) -> dict:
    """The feed-forward entries of a block: the MoE whole on every tp rank (module docstring),
    or the SwiGLU plan of a dense layer (with ``styles``)."""
    if not isinstance(block.feed_forward, MoE):
        return swiglu_plan(block, styles)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return {"feed_forward": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)}


def apply_tp(model: nn.Module, mesh: Any, styles: Optional[TPStyles] = None) -> nn.Module:
    """Apply the plan on the tp mesh with ``styles`` for the attention's and dense layers' linear
    layers (torch's by default); a tied output stays tied (see ``apply_decoder_tp``)."""
    return apply_decoder_tp(model, mesh, extra_block_plan=qk_norm_plan(), ffn_plan=moe_plan, styles=styles)


check_tp = check_decoder_tp  # tied embeddings stay tied under TP (as Qwen3): only the head counts
