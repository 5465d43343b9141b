"""What every built-in decoder family shares (Llama 3, Qwen3): grouped-query attention's
projections and its SDPA core (:class:`GQAttention`; each family's forward adds its own RoPE
layout, and Qwen3 its QK-norm), the SwiGLU MLP, the pre-norm block around a family's
attention, and :class:`DecoderLM` (meta-device build, init, forward over packed documents and a
KV cache, tied output projection, repeated blocks, parameter and FLOP counts) for models with
``args`` (``dim``, ``n_layers``, ``n_heads``, ``head_dim``, ``vocab_size``, ``max_seq_len``,
``norm_eps``, ``init_std``, ``tie_embeddings``). No ranks, no trainer.
Shapes: ``B`` batch, ``T`` tokens, ``D`` width, ``H``/``K`` query/kv heads, ``hd`` head dim."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.models.masks import document_causal_mask, document_positions

__all__ = ["DecoderLM", "GQAttention", "SwiGLU", "PreNormBlock", "RMSNorm", "attend"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int,
           mask: Optional[torch.Tensor] = None, cache: Any = None) -> torch.Tensor:
    """Causal scaled dot-product attention of rotated ``q [B, T, H, hd]`` over ``k, v [B, T, K,
    hd]`` -> ``[B, T, H * hd]``; scale ``1/sqrt(hd)`` (SDPA's default).

    Each of the K key/value heads serves ``n_rep = H // K`` consecutive query heads (query head
    ``h`` uses kv head ``h // n_rep``): K/V are expanded with ``repeat_interleave``, as Meta's
    ``repeat_kv`` and HF's ``repeat_kv`` do. ``mask``: None = causal (SDPA ``is_causal``); else a
    boolean ``[B, 1, T, T]`` mask (True = may attend; every query must see a key). ``cache``: one
    layer of a generation KV cache (``update(k, v) -> (k, v)`` with the past prepended,
    :class:`llmforge.models.sampling.KVCache`).

    Raises:
        ValueError: several new tokens on a cache that already holds some.
    """
    bsz, seqlen = q.shape[0], q.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
    causal = True
    if cache is not None:
        k, v = cache.update(k, v)
        causal = k.shape[2] == seqlen  # a prefill is causal; one new token sees every key
        if seqlen > 1 and not causal:
            raise ValueError("a KV cache takes several new tokens only when it is empty")
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(bsz, seqlen, -1)


class GQAttention(nn.Module):
    """Grouped-query self-attention's parameters: ``wq: D -> H*hd``, ``wk, wv: D -> K*hd``,
    ``wo: H*hd -> D`` (no biases). A family's ``forward(x [B, T, D], rope, mask=None,
    cache=None) -> [B, T, D]`` is ``q, k, v = self.project(x)``, its own RoPE (and norms), then
    ``self.attend(q, k, v, mask, cache)``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, D]`` -> ``q [B, T, H, hd]``, ``k, v [B, T, K, hd]``.

        When ``wq, wk, wv`` are plain ``nn.Linear`` with plain parameters, the three are one
        matmul over their concatenated weights (``[(H + 2K) * hd, D]``, LitGPT's fused ``qkv``
        computed on the fly, so parameter names and checkpoints stay torchtitan's): a compiled
        CPU block 0.5-1 % faster (``benchmarks/results/peers-issue30-2026-12-03d.md``). Wrapped
        projections (adapters, float8) and sharded ones (tensor-parallel DTensors) run one by one."""
        bsz, seqlen, _ = x.shape
        lins = (self.wq, self.wk, self.wv)
        if all(type(w) is nn.Linear and type(w.weight) is nn.Parameter for w in lins):
            weight = torch.cat([w.weight for w in lins])
            qkv = F.linear(x, weight).split([w.weight.shape[0] for w in lins], dim=-1)
        else:
            qkv = tuple(w(x) for w in lins)
        # -1 heads: under tensor parallelism each rank holds H/tp and K/tp heads
        return tuple(t.view(bsz, seqlen, -1, self.head_dim) for t in qkv)

    context_attention: Optional[Callable[..., torch.Tensor]] = None
    """A hook that replaces :func:`attend` when the sequence is split over ranks (context
    parallelism installs one: :mod:`llmforge.parallel.context_parallel`):
    ``hook(q, k, v, n_rep) -> [B, T, H * hd]`` with the rotated local ``q, k, v``; it builds its
    own mask. None (the default) = :func:`attend`."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor], cache: Any) -> torch.Tensor:
        """Rotated ``q, k, v`` -> ``wo(attend(...))`` ``[B, T, D]`` (see :func:`attend`, or the
        :attr:`context_attention` hook when one is installed; not with a KV cache)."""
        if self.context_attention is not None and cache is None:
            return self.wo(self.context_attention(q, k, v, self.n_rep))
        return self.wo(attend(q, k, v, self.n_rep, mask=mask, cache=cache))


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
                mask: Optional[torch.Tensor] = None, cache: Any = None,
                token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [B, T, D]``, ``rope [T, hd/2, 2]`` (or ``[B, T, hd/2, 2]``), optional attention
        ``mask [B, 1, T, T]`` and KV ``cache`` layer (see the attention's forward) ->
        ``[B, T, D]``. ``token_mask [B, T]`` bool (True = real token, False = padding) goes to a
        feed-forward that declares ``takes_token_mask`` (a router), else it is unused."""
        if mask is None and cache is None:
            h = x + self.attention(self.attention_norm(x), rope)
        else:
            h = x + self.attention(self.attention_norm(x), rope, mask=mask, cache=cache)
        if token_mask is not None and getattr(self.feed_forward, "takes_token_mask", False):
            return h + self.feed_forward(self.ffn_norm(h), token_mask=token_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters, same ``F.rms_norm``) whose ``forward`` is a frame of
    llmforge: dynamo skips torch.nn's own frames at the top of a compiled call, so only this
    one can be compiled alone (the final norm, outside the blocks, under per-block compile).
    ``x [..., D] -> [..., D]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class DecoderLM:
    """Mixin: ``class MyModel(DecoderLM, nn.Module)``; the family's ``__init__`` calls
    :meth:`_build` with its block and defines :meth:`rope_table`.

    ``forward(tokens [B, T] int64, doc_ids [B, T] | None, cache) -> logits [B, T, V]`` (in the
    parameters' compute dtype). Attributes ``args``, ``vocab_size``, ``max_seq_len``; the RoPE
    table is the non-persistent buffer ``rope_cache [max_seq_len, hd/2, 2]`` (not in the state
    dict), recomputed by :meth:`init_weights`.

    Tied embeddings: ``output.weight`` *is* ``tok_embeddings.weight`` (one Parameter). Module
    conversions such as ``to_empty`` from the meta device create new Parameter objects per module
    and would break the tie, so :meth:`_apply` (behind ``to``/``to_empty``/``cuda``) re-ties;
    :meth:`init_weights` calls :meth:`_tie` too. The state dict holds both keys (one tensor).
    """

    def _build(self, args: Any, block: Callable[[int], nn.Module]) -> None:
        """Create ``tok_embeddings``, ``layers`` (``block(i)`` for each of ``n_layers``),
        ``norm``, ``output`` and ``rope_cache``, then materialize and initialize them once.

        Allocated on meta, then materialized on the requested device (default device or an
        enclosing ``with torch.device(...)``), so nothing is initialized twice and
        ``torch.manual_seed(s); Model(args)`` equals the meta -> ``to_empty`` ->
        ``init_weights`` path bit for bit."""
        self.args, self.vocab_size, self.max_seq_len = args, args.vocab_size, args.max_seq_len
        target = torch.empty(0).device
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(block(i) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, eps=args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
            self.register_buffer("rope_cache", torch.empty(args.max_seq_len, args.head_dim // 2, 2,
                                                           dtype=torch.float32), persistent=False)
        self._tie()
        if target.type != "meta":
            self.to_empty(device=target)
        self.init_weights()

    def rope_table(self, device: torch.device) -> torch.Tensor:
        """The family's RoPE table, float32 ``[max_seq_len, hd/2, 2]`` (cos, sin) on ``device``."""
        raise NotImplementedError

    @torch.no_grad()
    def init_weights(self, std: Optional[float] = None) -> None:
        """(Re)initialize every parameter and recompute the RoPE buffer, in place.

        * ``tok_embeddings``, ``output`` and ``wq, wk, wv, w1, w3``: normal(0, ``std``)
          (``std`` defaults to ``args.init_std``; a tied output is initialized once, as the
          embedding).
        * ``wo`` and ``w2`` (the projections that write into the residual stream):
          normal(0, ``std / sqrt(2 * n_layers)``), the GPT-2 / Megatron-style scaling so the
          residual stream's variance does not grow with depth (2 residual adds per block).
        * RMSNorm weights (block norms, QK-norms): ones.

        Order is fixed, so the result is deterministic given torch's seed. Works on meta
        (no-op) and on DTensor (FSDP2-sharded) parameters.
        """
        std = self.args.init_std if std is None else float(std)
        out_std = std / math.sqrt(2 * self.args.n_layers)
        self._tie()
        buf = self.rope_cache
        # computed on CPU (or meta) so the table is identical whatever the device
        dev = buf.device if buf.device.type == "meta" else torch.device("cpu")
        self.register_buffer("rope_cache", self.rope_table(dev).to(buf.device), persistent=False)
        if self.tok_embeddings is not None:  # None: a pipeline stage without the embedding
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.blocks():
            layer.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if not self.args.tie_embeddings and self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    takes_token_mask = False
    """Whether :meth:`forward` uses ``token_mask`` (a family with routers sets it True; the
    trainer passes the batch's padding mask only to such a model)."""

    takes_positions = True
    """Whether :meth:`forward` takes ``positions`` (what context parallelism needs)."""

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Any = None, token_mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens [B, T]`` (int64 ids < V) -> logits ``[B, T, V]``.

        ``doc_ids [B, T]`` (optional, any integer dtype): the document each token belongs to in
        a packed row (a new document starts wherever the id changes). With it, positions
        restart at 0 for every document (:func:`~llmforge.models.masks.document_positions`, so
        RoPE sees each document as if it were alone) and attention is block-diagonal causal
        (:func:`~llmforge.models.masks.document_causal_mask`): no token attends across a
        document boundary. Without it (pretraining), every block runs ``layer(h, rope)`` with
        causal SDPA.

        ``cache``: a :class:`llmforge.models.sampling.KVCache` (generation): positions continue
        after the cached ones and every layer attends to its cached keys/values too.

        ``token_mask [B, T]`` bool (optional; True = real token, False = padding of unpacked or
        packed SFT rows): reaches every block when :attr:`takes_token_mask` (a mixture of
        experts leaves padding out of its routing and router statistics), else ignored.
        Attention does not need it: padding lies after a row's real tokens (causal) or in a
        document of its own (``doc_ids``).

        ``positions [B, T]`` int64 (optional, not with ``doc_ids`` or ``cache``): each token's
        RoPE position, for a slice of a longer sequence (context parallelism); attention is
        then the attention modules' ``context_attention`` hook, which knows the slice's mask.

        Raises:
            ValueError: more than ``max_seq_len`` positions, or ``doc_ids`` of another shape.
        """
        seqlen = tokens.shape[1]
        start = cache.length if cache is not None else 0
        if start + seqlen > self.max_seq_len:
            raise ValueError(f"sequence length {start + seqlen} exceeds max_seq_len={self.max_seq_len}")
        # a pipeline stage (llmforge.parallel.pipeline) may lack the embedding (it then gets the
        # hidden states [B, T, D] of the stage before), the norm and the output
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = None
        if positions is not None:  # a slice of the sequence: the attention hook masks
            rope = self.rope_cache[positions]
        elif doc_ids is None:
            rope = self.rope_cache[start:start + seqlen]
        else:
            if doc_ids.shape != tokens.shape[:2]:  # a later pipeline stage gets [B, T, D]
                raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from tokens shape "
                                 f"{tuple(tokens.shape[:2])}")
            rope, mask = self.rope_cache[document_positions(doc_ids)], document_causal_mask(doc_ids)
        for i, layer in enumerate(self.blocks()):
            if cache is not None:
                h = layer(h, rope, mask=mask, cache=cache.layer(i))
            elif token_mask is not None and self.takes_token_mask:
                h = layer(h, rope, mask=mask, token_mask=token_mask)
            else:  # the plain call when nothing else is passed (what compile and AC wrap)
                h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
        if cache is not None:
            cache.advance(seqlen)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _tie(self) -> None:
        if self.tok_embeddings is None or self.output is None:
            return  # a pipeline stage holds at most one of the two (llmforge.parallel.pipeline)
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self._tie()
        return out

    def blocks(self) -> list[nn.Module]:
        """The repeated transformer blocks (units for FSDP2, activation checkpointing, compile).
        ``layers`` is an ``nn.ModuleList``, or in a pipeline stage an ``nn.ModuleDict`` keyed by
        the blocks' indices in the whole model (so parameter names stay the model's own)."""
        layers = self.layers
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, each shared Parameter counted once (tied weights once).

        ``exclude_embeddings``: leave out ``tok_embeddings.weight`` (a lookup table, not a
        matmul). For a tied model this also removes the output projection, as it is the same
        tensor. Global counts for DTensor (sharded) parameters.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.tok_embeddings is not None:
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
        if self.args.tie_embeddings and self.output is not None:
            n += self.output.weight.numel()
        a = self.args
        return float(6 * n + 12 * a.n_layers * a.n_heads * a.head_dim * int(seq_len))
