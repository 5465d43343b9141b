"""Llama 3 / 3.1 / 3.2 decoder in plain PyTorch (no ranks, no trainer, no Lightning).

The module layout and parameter names follow torchtitan's ``llama3`` model (and therefore Meta's
reference checkpoints)::

    tok_embeddings                    nn.Embedding(vocab_size, dim)
    layers.{i}.attention_norm         RMSNorm(dim)
    layers.{i}.attention.wq|wk|wv|wo  nn.Linear, no bias
    layers.{i}.ffn_norm               RMSNorm(dim)
    layers.{i}.feed_forward.w1|w2|w3  nn.Linear, no bias (SwiGLU: w2(silu(w1 x) * w3 x))
    norm                              RMSNorm(dim)
    output                            nn.Linear(dim, vocab_size), no bias

Notation for shapes: ``B`` batch, ``T`` sequence length (tokens), ``D`` = ``dim``, ``H`` =
``n_heads``, ``K`` = ``n_kv_heads``, ``hd`` = ``D // H`` (head dim), ``V`` = ``vocab_size``.

RoPE uses Meta's *interleaved* pair layout: features ``(x[2i], x[2i+1])`` of each head are
rotated by angle ``pos * freq_i``. Hugging Face checkpoints store ``wq``/``wk`` permuted for the
"rotate half" layout; an importer must undo HF's ``permute`` on those two weights.

Parameters are allocated uninitialized (on the meta device) and initialized exactly once by
:meth:`Llama.init_weights`, so ``torch.manual_seed(s); Llama(args)`` on CPU equals building
under ``torch.device("meta")``, ``to_empty(device="cpu")`` and ``init_weights()`` with the same
seed, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from torch import nn

from llmforge.models.decoder import DecoderLM, GQAttention, PreNormBlock, SwiGLU
from llmforge.models.llama3.config import ffn_hidden_dim, llama_args_from_config, LlamaArgs
from llmforge.models.masks import document_causal_mask, document_positions, document_runs
from llmforge.models.spec import reject_factory_kwargs

__all__ = [
    "build_llama",
    "LlamaArgs",
    "Llama",
    "TransformerBlock",
    "Attention",
    "FeedForward",
    "ffn_hidden_dim",
    "rope_frequencies",
    "precompute_rope",
    "apply_rotary_emb",
    "rotate_pairs",
    "document_runs",
    "document_positions",
    "document_causal_mask",
]

def rope_frequencies(head_dim: int, theta: float, scaling: Optional[Dict[str, Any]] = None,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """RoPE angular frequencies, float32 ``[head_dim // 2]``, in radians per token.

    ``freq_i = 1 / theta ** (2i / head_dim)``. With ``scaling`` (Llama 3.1), each frequency is
    rescaled by wavelength ``w = 2*pi / freq`` as in ``apply_scaling`` of Meta's llama-models
    (``models/llama3/reference_impl/model.py``) and Hugging Face's
    ``_compute_llama3_parameters`` (``transformers/modeling_rope_utils.py``)::

        low_w = orig / low_freq_factor;  high_w = orig / high_freq_factor
        w < high_w  -> freq                                  (high frequency: unchanged)
        w > low_w   -> freq / factor                         (low frequency: interpolated)
        otherwise   -> (1 - s) * freq / factor + s * freq,
                       s = (orig / w - low_freq_factor) / (high_freq_factor - low_freq_factor)

    where ``orig`` = ``original_max_position_embeddings``.
    """
    idx = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float()
    freqs = 1.0 / (theta ** (idx / head_dim))
    if not scaling:
        return freqs
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    orig = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > low_wavelen, freqs / factor, smoothed)
    return torch.where(wavelen < high_wavelen, freqs, out)


def precompute_rope(head_dim: int, max_seq_len: int, theta: float,
                    scaling: Optional[Dict[str, Any]] = None,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """RoPE table, float32 ``[max_seq_len, head_dim // 2, 2]``: ``[..., 0]`` = cos, ``[..., 1]``
    = sin of ``pos * freq_i`` (the real form of Meta's complex ``freqs_cis``)."""
    freqs = rope_frequencies(head_dim, theta, scaling, device=device)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor, heads_first: bool = False) -> torch.Tensor:
    """Rotate pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x [B, T, nh, hd]`` (or, with
    ``heads_first``, ``x [B, nh, T, hd]``) by the table ``rope [T, hd // 2, 2]`` (one position
    per time step, shared by the batch) or ``rope [B, T, hd // 2, 2]`` (per-row positions, e.g.
    restarting at every packed document). Computed in float32, returned in ``x.dtype`` and
    contiguous in ``x``'s logical layout.

    The pairs are multiplied as complex numbers (``view_as_complex``, as in Meta's reference
    Llama code): the same products and sums as the real-valued rotation, bit for bit, in 2
    kernels instead of 8 (about 10x faster forward plus backward on the CPU). Under
    ``torch.compile`` the real-valued rotation (:func:`rotate_pairs`) instead: inductor cannot
    generate code for complex operators and would run each one eager between its kernels."""
    if torch.compiler.is_compiling():
        return rotate_pairs(x, rope, heads_first)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    freqs = torch.view_as_complex(rope.float().contiguous())  # [T, hd/2] or [B, T, hd/2]
    if heads_first:
        freqs = freqs[:, None, :, :] if rope.dim() == 4 else freqs[None, None, :, :]
    else:
        freqs = freqs[:, :, None, :] if rope.dim() == 4 else freqs[None, :, None, :]
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def rotate_pairs(x: torch.Tensor, rope: torch.Tensor, heads_first: bool = False) -> torch.Tensor:
    """:func:`apply_rotary_emb` in real arithmetic (same arguments, shapes and result up to
    rounding): ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`` for each pair, in float32."""
    cos, sin = rope[..., 0].float(), rope[..., 1].float()  # [T, hd/2] or [B, T, hd/2]
    if heads_first:
        cos, sin = ((t[:, None] if rope.dim() == 4 else t[None, None]) for t in (cos, sin))
    else:
        cos, sin = ((t[:, :, None] if rope.dim() == 4 else t[None, :, None]) for t in (cos, sin))
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(GQAttention):
    """Causal grouped-query self-attention with Meta's interleaved RoPE (see
    :class:`~llmforge.models.decoder.GQAttention` and :func:`~llmforge.models.decoder.attend`:
    query head ``h`` uses kv head ``h // (H // K)``, as Meta's ``repeat_kv``)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Any = None) -> torch.Tensor:
        """``x [B, T, D]``, ``rope [T, hd/2, 2]`` or ``[B, T, hd/2, 2]`` -> ``[B, T, D]``.

        ``mask``: None = plain causal attention; else a boolean ``[B, 1, T, T]`` mask (True =
        may attend, e.g. :func:`document_causal_mask`). ``cache``: one layer of a generation KV
        cache (:class:`llmforge.models.sampling.KVCache`); several new tokens only on an empty
        cache."""
        q, k, v = self.project(x)
        # rotated in the head-major layout SDPA reads ([B, H, T, hd], contiguous there; the
        # transposes are views): a compiled CPU block ~0.5 % faster than rotating [B, T, H, hd]
        q, k = (apply_rotary_emb(t.transpose(1, 2), rope, heads_first=True).transpose(1, 2)
                for t in (q, k))
        return self.attend(q, k, v, mask, cache)


class FeedForward(SwiGLU):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` with hidden size :func:`ffn_hidden_dim`."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))


class TransformerBlock(PreNormBlock):
    """Pre-norm block: ``h = x + attn(norm(x))``; ``out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: LlamaArgs) -> None:
        super().__init__(Attention(args), FeedForward(args), args.dim, args.norm_eps)
        self.layer_id = layer_id


class Llama(DecoderLM, nn.Module):
    """Llama 3 decoder-only language model.

    ``forward(tokens [B, T] int64, doc_ids [B, T] | None, cache=None) -> logits [B, T, V]``
    (packed documents and the KV cache as in :meth:`DecoderLM.forward`); meta-device build,
    :meth:`~DecoderLM.init_weights` and embedding tying from
    :class:`~llmforge.models.decoder.DecoderLM`. Attributes ``args``, ``vocab_size``,
    ``max_seq_len``; the RoPE table (:func:`precompute_rope`, Llama 3.1 scaling included) is
    the non-persistent buffer ``rope_cache [max_seq_len, hd/2, 2]``.

    Raises:
        ValueError: ``dim`` not divisible by ``n_heads``, ``n_heads`` by ``n_kv_heads``, or an
            odd head dim.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or args.head_dim % 2:
            raise ValueError(
                f"need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head dim; got "
                f"dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}")
        self._build(args, lambda i: TransformerBlock(i, args))

    def rope_table(self, device: torch.device) -> torch.Tensor:
        a = self.args
        return precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)


def build_llama(cfg: Any, **kwargs: Any) -> Llama:
    """Build a :class:`Llama` from the ``model:`` section (preset plus per-field overrides,
    see :func:`llama_args_from_config`). Parameters are created on the current default device
    (``meta`` inside ``with torch.device("meta"):``) and initialized by ``init_weights``.

    Raises:
        ConfigError: invalid shape, or extra keyword arguments (``model.kwargs``), which the
            built-in factory does not take.
    """
    reject_factory_kwargs("llama3", cfg, kwargs)
    return Llama(llama_args_from_config(cfg))
