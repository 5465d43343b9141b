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

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.models.decoder import DecoderLM, PreNormBlock, SwiGLU
from llmforge.models.masks import document_causal_mask, document_positions
from llmforge.models.qwen3.config import Qwen3Args

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


class Attention(nn.Module):
    """Grouped-query causal self-attention with per-head QK-norm and RoPE."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.head_dim, self.n_rep = a.head_dim, a.n_heads // a.n_kv_heads
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.q_norm = nn.RMSNorm(a.head_dim, eps=a.norm_eps)
        self.k_norm = nn.RMSNorm(a.head_dim, eps=a.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cache: Any = None) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; ``mask [B, 1, T, T]`` bool (True = may attend) or
        causal; ``cache``: a KV cache layer (``update(k, v) -> (k, v)``, see
        :class:`llmforge.models.sampling.KVCache`) for incremental decoding."""
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds H/tp and K/tp heads
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        causal = True
        if cache is not None:
            k, v = cache.update(k, v)
            causal = seqlen > 1 and k.shape[2] == seqlen
            if seqlen > 1 and not causal:
                raise ValueError("a KV cache takes several new tokens only on an empty cache")
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class Qwen3(DecoderLM, nn.Module):
    """Qwen3 decoder: ``forward(tokens [B, T], doc_ids [B, T] | None) -> logits [B, T, V]``.

    Built on the meta device and materialized once, as :class:`llmforge.models.llama3.model.Llama`
    (same init scheme: normal(0, init_std), residual projections scaled by 1/sqrt(2L), norms
    ones; tying, blocks, parameter and FLOP counts from :class:`~llmforge.models.decoder.DecoderLM`).
    The RoPE table is the non-persistent buffer ``rope_cache [max_seq_len, hd/2, 2]``.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.args, self.vocab_size, self.max_seq_len = args, args.vocab_size, args.max_seq_len
        target = torch.empty(0).device
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(
                PreNormBlock(Attention(args), SwiGLU(args.dim, args.hidden_dim), args.dim, args.norm_eps)
                for _ in range(args.n_layers))
            self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
            self.register_buffer("rope_cache", torch.empty(args.max_seq_len, args.head_dim // 2, 2),
                                 persistent=False)
        self._tie()
        if target.type != "meta":
            self.to_empty(device=target)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: Optional[float] = None) -> None:
        """(Re)initialize every parameter and the RoPE buffer in place (deterministic given
        torch's seed; a no-op on meta; works on DTensor parameters)."""
        std = self.args.init_std if std is None else float(std)
        out_std = std / math.sqrt(2 * self.args.n_layers)
        self._tie()
        buf = self.rope_cache
        dev = buf.device if buf.device.type == "meta" else torch.device("cpu")
        table = rope_cos_sin(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, dev)
        self.register_buffer("rope_cache", table.to(buf.device), persistent=False)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers:
            layer.init_weights(std, out_std)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Any = None) -> torch.Tensor:
        """``tokens [B, T]`` -> logits ``[B, T, V]``.

        ``doc_ids [B, T]``: packed documents (positions restart, attention block-diagonal, as
        :meth:`llmforge.models.llama3.model.Llama.forward`). ``cache``: a
        :class:`llmforge.models.sampling.KVCache`; positions continue after its length.
        """
        seqlen = tokens.shape[1]
        start = cache.length if cache is not None else 0
        if start + seqlen > self.max_seq_len:
            raise ValueError(f"sequence length {start + seqlen} exceeds max_seq_len={self.max_seq_len}")
        h = self.tok_embeddings(tokens)
        mask = None
        if doc_ids is None:
            rope = self.rope_cache[start:start + seqlen]
        else:
            if doc_ids.shape != tokens.shape:
                raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from tokens shape "
                                 f"{tuple(tokens.shape)}")
            rope, mask = self.rope_cache[document_positions(doc_ids)], document_causal_mask(doc_ids)
        for i, layer in enumerate(self.layers):
            if cache is None:
                h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
            else:
                h = layer(h, rope, mask=mask, cache=cache.layer(i))
        if cache is not None:
            cache.advance(seqlen)
        return self.output(self.norm(h))


def build_qwen3(cfg: Any, **kwargs: Any) -> Qwen3:
    """The ``model:`` section (``name: qwen3``) -> :class:`Qwen3` on the current default device.

    Raises:
        ConfigError: invalid shape, or ``model.kwargs`` (the built-in factory takes none).
    """
    from llmforge.errors import ConfigError
    from llmforge.models.qwen3.config import qwen3_args_from_config
    from llmforge.models.spec import cfg_get

    extra = {**dict(cfg_get(cfg, "kwargs") or {}), **kwargs}
    if extra:
        raise ConfigError(f"model.kwargs: the built-in 'qwen3' factory takes no extra arguments "
                          f"(got {', '.join(sorted(extra))}); set the model: shape fields instead.")
    return Qwen3(qwen3_args_from_config(cfg))
