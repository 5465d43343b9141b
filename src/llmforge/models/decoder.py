"""What every built-in decoder family shares (Llama 3, Qwen3): the SwiGLU MLP, the pre-norm
block around a family's attention, and :class:`DecoderLM` (tied output projection, repeated
blocks, parameter and FLOP counts) for models with ``args`` (``tie_embeddings``, ``n_layers``,
``n_heads``, ``head_dim``), ``tok_embeddings``, ``layers`` and ``output``. No ranks, no trainer.
Shapes: ``B`` batch, ``T`` tokens, ``D`` width."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DecoderLM", "SwiGLU", "PreNormBlock"]


class SwiGLU(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020), ``x [B, T, D] -> [B, T, D]``, hidden
    width ``hidden_dim``; no biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PreNormBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``; ``out = h + ffn(norm(h))`` (RMSNorm).

    ``attention(x, rope, mask=None, cache=None) -> [B, T, D]`` and ``feed_forward`` are the
    family's modules (each with ``init_weights(std, out_std)``)."""

    def __init__(self, attention: nn.Module, feed_forward: nn.Module, dim: int, norm_eps: float) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Any = None) -> torch.Tensor:
        """``x [B, T, D]``, ``rope [T, hd/2, 2]`` (or ``[B, T, hd/2, 2]``), optional attention
        ``mask [B, 1, T, T]`` and KV ``cache`` layer (see the attention's forward) ->
        ``[B, T, D]``."""
        if mask is None and cache is None:
            h = x + self.attention(self.attention_norm(x), rope)
        else:
            h = x + self.attention(self.attention_norm(x), rope, mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class DecoderLM:
    """Mixin: ``class MyModel(DecoderLM, nn.Module)``.

    Tied embeddings: ``output.weight`` *is* ``tok_embeddings.weight`` (one Parameter). Module
    conversions such as ``to_empty`` from the meta device create new Parameter objects per module
    and would break the tie, so :meth:`_apply` (behind ``to``/``to_empty``/``cuda``) re-ties; the
    model's ``init_weights`` calls :meth:`_tie` too. The state dict holds both keys (one tensor).
    """

    def _tie(self) -> None:
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self._tie()
        return out

    def blocks(self) -> list[nn.Module]:
        """The repeated transformer blocks (units for FSDP2, activation checkpointing, compile)."""
        return list(self.layers)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, each shared Parameter counted once (tied weights once).

        ``exclude_embeddings``: leave out ``tok_embeddings.weight`` (a lookup table, not a
        matmul). For a tied model this also removes the output projection, as it is the same
        tensor. Global counts for DTensor (sharded) parameters.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for MFU.

        ``6 * N + 12 * L * H * hd * seq_len`` — PaLM (Chowdhery et al. 2022), appendix B, as
        in torchtitan's ``get_num_flop_per_token``/``get_nparams_and_flops``: ``6N`` counts the
        matmuls over the ``N`` parameters (2 FLOPs per multiply-add, x3 for forward + backward);
        the second term counts the attention score/value matmuls over a ``seq_len`` context
        (2 matmuls forward + 4 backward, 2 FLOPs each; no discount for the causal mask and no
        recompute). ``N`` = all parameters except the input embedding table (torchtitan's
        choice). Unlike torchtitan, a *tied* output projection is counted in ``N`` (it is
        still a matmul); for untied models the result equals torchtitan's.
        """
        n = self.num_params(exclude_embeddings=True)
        if self.args.tie_embeddings:
            n += self.output.weight.numel()
        a = self.args
        return float(6 * n + 12 * a.n_layers * a.n_heads * a.head_dim * int(seq_len))
