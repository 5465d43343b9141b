"""Qwen3's tensor-parallel plan: Llama 3's (:mod:`llmforge.models.llama3.parallelize`) plus the
per-head QK-norms.

Under TP each rank holds ``H/tp`` query and ``K/tp`` key heads, so ``q_norm``/``k_norm`` see the
local heads ``[B, T, H/tp, hd]``; their ``[hd]`` weights stay whole and replicated, and their
gradients, computed from different heads on each rank, must be summed — HF's
``replicated_with_grad_allreduce``. ``SequenceParallel(sequence_dim=2)`` does exactly that: the
input becomes a DTensor sharded on the head dim, the weight a replicated DTensor whose gradient
is reduced over the tp mesh (torchtitan's qwen3 plan uses the same style).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from llmforge.models.llama3.parallelize import apply_decoder_tp, check_decoder_tp
from llmforge.models.tp_styles import TPStyles

__all__ = ["apply_tp", "check_tp", "qk_norm_plan"]


def qk_norm_plan() -> dict:
    """The per-head QK-norms' entries of a block's plan (module docstring)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return {"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}


def apply_tp(model: nn.Module, mesh: Any, styles: Optional[TPStyles] = None) -> nn.Module:
    """Apply the plan on the tp mesh with ``styles`` for the linear layers (torch's by default);
    a tied output stays tied (see ``apply_decoder_tp``)."""
    return apply_decoder_tp(model, mesh, extra_block_plan=qk_norm_plan(), styles=styles)


check_tp = check_decoder_tp  # Qwen3 keeps tied embeddings tied under TP: only the head counts
