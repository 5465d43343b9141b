"""Qwen3 dense decoder in plain PyTorch (no ranks, no trainer), numerically the same as
transformers' ``Qwen3ForCausalLM`` (``transformers/models/qwen3/modeling_qwen3.py``).

Module names follow llmforge's Llama (and torchtitan's qwen3), so adapter targets, float8 filters
and the tensor-parallel plan carry over::

    tok_embeddings                          nn.Embedding(V, D)
    layers.{i}.attention_norm / ffn_norm    RMSNorm(D)
    layers.{i}.attention.wq|wk|wv|wo        nn.Linear, no bias; wq: D -> H*hd, wo: H*hd -> D
    layers.{i}.attention.q_norm|k_norm      RMSNorm(hd), per head, before RoPE (QK-norm)
    layers.{i}.feed_forward.w1|w2|w3        SwiGLU: w2(silu(w1 x) * w3 x), hidden F
    norm, output                            RMSNorm(D), nn.Linear(D, V) (tied for small sizes)

Differences from Llama 3: the head dim ``hd`` is its own setting (``H * hd != D`` in general),
queries and keys are RMS-normalized per head, RoPE uses the "rotate half" layout of HF (pairs
``(x_i, x_{i + hd/2})``; so HF weights load without a permutation) with theta 1e6. Shapes: ``B``
batch, ``T`` tokens, ``D`` dim, ``H``/``K`` query/kv heads, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmforge.models.decoder import DecoderLM, GQAttention, PreNormBlock, SwiGLU
from llmforge.models.qwen3.config import qwen3_args_from_config, Qwen3Args
from llmforge.models.spec import reject_factory_kwargs

__all__ = ["Qwen3", "build_qwen3", "rope_cos_sin", "apply_rope"]


def rope_cos_sin(head_dim: int, max_seq_len: int, theta: float,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """``[max_seq_len, hd/2, 2]`` float32 (cos, sin) of ``pos * freq_i``, ``freq_i = theta **
    (-2i / hd)`` (HF's ``_compute_default_rope_parameters``)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    ang = torch.outer(pos, inv)
    return torch.stack((ang.cos(), ang.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, heads, hd]`` by ``rope [T, hd/2, 2]`` or ``[B, T, hd/2, 2]`` in the
    rotate-half layout: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` with ``x1, x2`` the
    two halves of each head (HF ``apply_rotary_pos_emb``). Computed in ``x.dtype``."""
    cos, sin = rope[..., 0].to(x.dtype), rope[..., 1].to(x.dtype)
    cos = cos[:, :, None, :] if rope.dim() == 4 else cos[None, :, None, :]
    sin = sin[:, :, None, :] if rope.dim() == 4 else sin[None, :, None, :]
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(GQAttention):
    """Grouped-query causal self-attention with per-head QK-norm and rotate-half RoPE."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__(a.dim, a.n_heads, a.n_kv_heads, a.head_dim)
        self.q_norm = nn.RMSNorm(a.head_dim, eps=a.norm_eps)
        self.k_norm = nn.RMSNorm(a.head_dim, eps=a.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cache: Any = None) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; ``mask [B, 1, T, T]`` bool (True = may attend) or
        causal; ``cache``: a KV cache layer (:class:`llmforge.models.sampling.KVCache`) for
        incremental decoding (see :func:`~llmforge.models.decoder.attend`)."""
        q, k, v = self.project(x)
        q, k = self.q_norm(q), self.k_norm(k)  # Qwen3's QK-norm: RMSNorm per head, before RoPE
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return self.attend(q, k, v, mask, cache)


class Qwen3(DecoderLM, nn.Module):
    """Qwen3 decoder: ``forward(tokens [B, T], doc_ids [B, T] | None, cache=None) -> logits
    [B, T, V]`` (:meth:`~llmforge.models.decoder.DecoderLM.forward`).

    Built on the meta device and materialized once, with the init scheme, tying, blocks,
    parameter and FLOP counts of :class:`~llmforge.models.decoder.DecoderLM` (as
    :class:`llmforge.models.llama3.model.Llama`). The RoPE table (:func:`rope_cos_sin`) is the
    non-persistent buffer ``rope_cache [max_seq_len, hd/2, 2]``.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self._build(args, lambda i: PreNormBlock(Attention(args), SwiGLU(args.dim, args.hidden_dim),
                                                 args.dim, args.norm_eps))

    def rope_table(self, device: torch.device) -> torch.Tensor:
        return rope_cos_sin(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device)


def build_qwen3(cfg: Any, **kwargs: Any) -> Qwen3:
    """The ``model:`` section (``name: qwen3``) -> :class:`Qwen3` on the current default device.

    Raises:
        ConfigError: invalid shape, or ``model.kwargs`` (the built-in factory takes none).
    """
    reject_factory_kwargs("qwen3", cfg, kwargs)
    return Qwen3(qwen3_args_from_config(cfg))
