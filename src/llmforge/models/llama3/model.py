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
import torch.nn.functional as F
from torch import nn

from llmforge.models.decoder import DecoderLM, PreNormBlock, SwiGLU
from llmforge.models.llama3.config import ROPE_SCALING_KEYS, LlamaArgs, ffn_hidden_dim
from llmforge.models.masks import document_causal_mask, document_positions, document_runs

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


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x [B, T, nh, hd]`` by the table
    ``rope [T, hd // 2, 2]`` (one position per time step, shared by the batch) or
    ``rope [B, T, hd // 2, 2]`` (per-row positions, e.g. restarting at every packed document).
    Computed in float32, returned in ``x.dtype``.

    The pairs are multiplied as complex numbers (``view_as_complex``, as in Meta's reference
    Llama code): the same products and sums as the real-valued rotation, bit for bit, in 2
    kernels instead of 8 (about 10x faster forward plus backward on the CPU)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    freqs = torch.view_as_complex(rope.float().contiguous())
    freqs = freqs[:, :, None, :] if rope.dim() == 4 else freqs[None, :, None, :]
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    Each of the K key/value heads serves ``H // K`` consecutive query heads (query head ``h``
    uses kv head ``h // (H // K)``): K/V are expanded with ``repeat_interleave`` on the head dim,
    the same as Meta's ``repeat_kv``.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: Optional[torch.Tensor] = None, cache: Any = None) -> torch.Tensor:
        """``x [B, T, D]``, ``rope [T, hd/2, 2]`` or ``[B, T, hd/2, 2]`` -> ``[B, T, D]``.

        ``mask``: None = plain causal attention (SDPA ``is_causal``); else a boolean
        ``[B, 1, T, T]`` mask (True = may attend, e.g. :func:`document_causal_mask`) passed to
        SDPA as ``attn_mask`` (every query must see at least one key). ``cache``: one layer of
        a generation KV cache (``update(k, v) -> (k, v)`` with the past keys/values prepended,
        :class:`llmforge.models.sampling.KVCache`); several new tokens only on an empty cache."""
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/tp and n_kv_heads/tp heads
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, rope), apply_rotary_emb(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, nh, T, hd]
        causal = True
        if cache is not None:
            k, v = cache.update(k, v)
            causal = k.shape[2] == seqlen  # a prefill is causal; one new token sees every key
            if seqlen > 1 and not causal:
                raise ValueError("a KV cache takes several new tokens only when it is empty")
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # scale 1/sqrt(hd)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


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

    ``forward(tokens [B, T] int64, doc_ids [B, T] | None) -> logits [B, T, V]`` (in the
    parameters' compute dtype; upcast for the loss if needed); ``doc_ids`` marks the documents
    of packed rows (per-document positions, block-diagonal causal attention). Attributes
    ``args``, ``vocab_size``, ``max_seq_len``.

    The RoPE table is the non-persistent buffer ``rope_cache [max_seq_len, hd/2, 2]`` (not in the
    state dict); :meth:`init_weights` recomputes it.

    Tied embeddings: ``output.weight`` *is* ``tok_embeddings.weight`` (one Parameter). Module
    conversions such as ``to_empty`` from the meta device create new Parameter objects per
    module and would break the tie, so :meth:`_apply` (behind ``to``/``to_empty``/``cuda``) and
    :meth:`init_weights` re-tie. The state dict still holds both keys (same tensor).
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or args.head_dim % 2:
            raise ValueError(
                f"need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head dim; got "
                f"dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}")
        self.args = args
        self.vocab_size = args.vocab_size
        self.max_seq_len = args.max_seq_len
        # Allocate on meta, then materialize on the requested device (default device or an
        # enclosing ``with torch.device(...)``) so nothing is initialized twice and the RNG
        # stream equals the meta -> to_empty -> init_weights path.
        target = torch.empty(0).device
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
            self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
            self.register_buffer(
                "rope_cache", torch.empty(args.max_seq_len, args.head_dim // 2, 2,
                                          dtype=torch.float32), persistent=False)
        self._tie()
        if target.type != "meta":
            self.to_empty(device=target)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: Optional[float] = None) -> None:
        """(Re)initialize every parameter and recompute the RoPE buffer, in place.

        * ``tok_embeddings``, ``output`` and ``wq, wk, wv, w1, w3``: normal(0, ``std``)
          (``std`` defaults to ``args.init_std``; a tied output is initialized once, as the
          embedding).
        * ``wo`` and ``w2`` (the projections that write into the residual stream):
          normal(0, ``std / sqrt(2 * n_layers)``), the GPT-2 / Megatron-style scaling so the
          residual stream's variance does not grow with depth (2 residual adds per block).
        * RMSNorm weights: ones.

        Order is fixed, so the result is deterministic given torch's seed. Works on meta
        (no-op) and on DTensor (FSDP2-sharded) parameters.
        """
        std = self.args.init_std if std is None else float(std)
        out_std = std / math.sqrt(2 * self.args.n_layers)
        self._tie()
        self._init_rope()
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers:
            layer.init_weights(std, out_std)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def _init_rope(self) -> None:
        buf = self.rope_cache
        # Computed on CPU (or meta) so the table is identical whatever the device.
        dev = buf.device if buf.device.type == "meta" else torch.device("cpu")
        table = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta,
                                self.args.rope_scaling, device=dev)
        self.register_buffer("rope_cache", table.to(buf.device), persistent=False)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Any = None) -> torch.Tensor:
        """``tokens [B, T]`` (int64 ids < V, ``T <= max_seq_len``) -> logits ``[B, T, V]``.

        ``doc_ids [B, T]`` (optional, any integer dtype): the document each token belongs to in
        a packed row (a new document starts wherever the id changes). With it, positions
        restart at 0 for every document (:func:`document_positions`, so RoPE sees each
        document as if it were alone) and attention is block-diagonal causal
        (:func:`document_causal_mask`): no token attends across a document boundary. Without
        it (pretraining), every block runs ``layer(h, rope)`` with causal SDPA, unchanged.

        ``cache``: a :class:`llmforge.models.sampling.KVCache` (generation): positions continue
        after the cached ones and every layer attends to its cached keys/values too.
        """
        seqlen = tokens.shape[1]
        if cache is not None:
            return self._forward_cached(tokens, cache)
        if seqlen > self.max_seq_len:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len={self.max_seq_len}")
        h = self.tok_embeddings(tokens)
        if doc_ids is None:
            rope = self.rope_cache[:seqlen]
            for layer in self.layers:
                h = layer(h, rope)
            return self.output(self.norm(h))
        if doc_ids.shape != tokens.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from tokens shape "
                             f"{tuple(tokens.shape)}")
        rope = self.rope_cache[document_positions(doc_ids)]  # [B, T, hd/2, 2]
        mask = document_causal_mask(doc_ids)
        for layer in self.layers:
            h = layer(h, rope, mask=mask)
        return self.output(self.norm(h))

    def _forward_cached(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        start, seqlen = cache.length, tokens.shape[1]
        if start + seqlen > self.max_seq_len:
            raise ValueError(f"sequence length {start + seqlen} exceeds max_seq_len={self.max_seq_len}")
        h = self.tok_embeddings(tokens)
        rope = self.rope_cache[start:start + seqlen]
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, cache=cache.layer(i))
        cache.advance(seqlen)
        return self.output(self.norm(h))


def build_llama(cfg: Any, **kwargs: Any) -> Llama:
    """Build a :class:`Llama` from the ``model:`` section (preset plus per-field overrides,
    see :func:`llama_args_from_config`). Parameters are created on the current default device
    (``meta`` inside ``with torch.device("meta"):``) and initialized by ``init_weights``.

    Raises:
        ConfigError: invalid shape, or extra keyword arguments (``model.kwargs``), which the
            built-in factory does not take.
    """
    from llmforge.errors import ConfigError
    from llmforge.models.llama3.config import llama_args_from_config

    extra = dict(kwargs)
    cfg_kwargs = cfg.get("kwargs") if hasattr(cfg, "get") else getattr(cfg, "kwargs", None)
    if cfg_kwargs:
        extra.update(dict(cfg_kwargs))
    if extra:
        raise ConfigError(
            f"model.kwargs: the built-in 'llama3' factory takes no extra arguments (got "
            f"{', '.join(sorted(extra))}); set the model: shape fields instead.")
    return Llama(llama_args_from_config(cfg))
