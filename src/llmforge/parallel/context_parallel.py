"""Context parallelism: each of the ``cp`` ranks of a data-parallel rank holds a slice of every
sequence, and attention crosses the slices with plain ``torch.distributed`` collectives (they
run on gloo as on NCCL).

Load balance (:func:`load_balanced_index`): a row of ``T`` tokens is cut into ``2 x cp`` chunks
of ``T / (2 cp)``; rank ``r`` takes chunk ``r`` and chunk ``2 cp - 1 - r``, so under the causal
mask every rank does the same attention work (the head chunks see few keys, their mirrors
many), as Megatron-LM and torchtitan do. A rank's tokens keep their global positions (RoPE) and
global indices (the causal mask); packed rows keep their documents (the document mask is built
from the whole row, which every cp rank holds).

Two modes (``context_parallel.mode``), each an attention hook the step installs on the model's
attention modules (:func:`install_attention`; the model itself knows no ranks):

* ``all_gather`` (Llama 3 paper, Dubey et al. 2024, sec. 3.3.2): every layer all-gathers K and
  V of the whole sequence over cp (backward: their gradients reduce-scattered), then each local
  chunk attends causally to the keys up to its end (packed rows: the document mask).
  Communication per layer: K and V of the whole sequence; memory: K/V of the whole sequence
  (``O(T)``) and the chunks' causal masks; any head count.
* ``ulysses`` (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509): all-to-all from
  sequence- to head-sharded (q, k, v), attention of the whole sequence on ``H / cp`` heads,
  all-to-all back. Communication per layer: four all-to-alls of ``1 / cp`` of the activations
  each; needs the query heads (per tensor-parallel rank) divisible by cp; kv heads that are not
  are repeated to the query heads first (more traffic, same result).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from llmforge.errors import ConfigError
from llmforge.models.decoder import GQAttention, attend
from llmforge.models.masks import document_runs

__all__ = ["ContextParallelAttention", "check_context_parallel", "gathered_index",
           "install_attention", "load_balanced_index"]


def load_balanced_index(seq_len: int, cp: int, rank: int,
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """The global token indices ``LongTensor[seq_len // cp]`` rank ``rank`` of ``cp`` holds:
    chunk ``rank`` and chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks, in that order.

    Raises:
        ValueError: ``2 * cp`` does not divide ``seq_len``.
    """
    if seq_len % (2 * cp):
        raise ValueError(f"2 x cp = {2 * cp} does not divide the sequence length {seq_len}")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail])


def gathered_index(seq_len: int, cp: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """``LongTensor[seq_len]``: the global index of each token in the order an all-gather (or
    all-to-all) over cp lays the slices out (rank 0's, then rank 1's, ...)."""
    return torch.cat([load_balanced_index(seq_len, cp, r, device) for r in range(cp)])


class _GatherSeq(torch.autograd.Function):
    """All-gather ``x [B, t, ...]`` over ``group`` along dim 1 (rank order); backward sums the
    gradient of each slice over the ranks and keeps this rank's (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.t = group, x.shape[1]
        x = x.contiguous()  # empty_like keeps a view's strides; the collectives write dense
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(grad, group=ctx.group)
            rank = dist.get_rank(ctx.group)
            return grad.narrow(1, rank * ctx.t, ctx.t).contiguous(), None
        parts = [p.contiguous() for p in grad.split(ctx.t, dim=1)]
        out = torch.empty_like(parts[0], memory_format=torch.contiguous_format)
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of ``x [cp, ...]`` over ``group``: block ``i`` goes to rank ``i``
    and block ``j`` of the result came from rank ``j``; its own inverse, so also its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # empty_like keeps a view's strides; the collectives write dense
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class ContextParallelAttention:
    """The attention hook of one cp group (``GQAttention.context_attention``).

    Args:
        group: the cp process group (the mesh's ``cp`` dim).
        mode: ``all_gather`` or ``ulysses`` (module docs).

    Before each forward the step calls :meth:`prepare` with the row length and the rows' document
    ids; then every attention layer calls ``hook(q, k, v, n_rep) -> [B, t, H * hd]`` with this
    rank's rotated ``q [B, t, H, hd]``, ``k, v [B, t, K, hd]`` (``t = T / cp``).
    """

    def __init__(self, group: Any, mode: str) -> None:
        self.group, self.mode = group, mode
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mask: Optional[torch.Tensor] = None
        self.ready = False

    def local_index(self, seq_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """This rank's global token indices ``[seq_len / cp]`` (:func:`load_balanced_index`)."""
        return load_balanced_index(seq_len, self.cp, self.rank, device)

    def prepare(self, seq_len: int, doc_ids: Optional[torch.Tensor], device: torch.device) -> None:
        """Get ready for the next forward over rows of ``seq_len`` tokens.

        Without ``doc_ids`` the gathered sequence is put back in global order (``order``):
        ``ulysses`` then runs plain causal SDPA (no mask), ``all_gather`` attends each local
        chunk of ``c = T / (2 cp)`` tokens to the keys up to its end under a lower-right causal
        mask (``chunk_masks``, ``[c, end]`` bool, about ``T^2 / (2 cp)`` in all, built once per
        forward and shared by the layers; torch's ``causal_lower_right`` bias would avoid it
        on GPU kernels, but is a tensor subclass that fails under dispatch modes). With
        ``doc_ids [B, T]`` (packed rows, whole) a boolean mask (True = may attend) is built as
        the one-process model builds its document mask: the local queries against the gathered
        keys ``[B, 1, t, T]`` (``all_gather``) or the gathered sequence against itself
        ``[B, 1, T, T]`` (``ulysses``); a key is visible when its global index is not after the
        query's and it lies in the same document run (:func:`~llmforge.models.masks.document_runs`)."""
        keys = gathered_index(seq_len, self.cp, device)
        self.keys, self.order = keys, torch.argsort(keys)
        self.mask = None
        c = seq_len // (2 * self.cp)
        # each local chunk against the keys up to its end, lower-right causal: [c, end]; only
        # all_gather without documents reads them (ulysses built them too: 5 GiB per rank at
        # 131,072 tokens and cp=2 for nothing, docs/parallelism.md)
        self.chunk_masks = [torch.arange(end, device=device)[None, :]
                            <= torch.arange(end - c, end, device=device)[:, None]
                            for end in ((self.rank + 1) * c, (2 * self.cp - self.rank) * c)] \
            if self.mode == "all_gather" and doc_ids is None else []
        if doc_ids is not None:
            queries = self.local_index(seq_len, device) if self.mode == "all_gather" else keys
            runs = document_runs(doc_ids.to(device))
            self.mask = (keys[None, :] <= queries[:, None])[None, None] \
                & (runs[:, queries][:, None, :, None] == runs[:, keys][:, None, None, :])
        self.ready = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int) -> torch.Tensor:
        assert self.ready, "ContextParallelAttention.prepare() has not run"
        if self.mode == "all_gather":
            k, v = _GatherSeq.apply(k, self.group), _GatherSeq.apply(v, self.group)
            if self.mask is not None:
                return attend(q, k, v, n_rep, mask=self.mask)
            k, v = k.index_select(1, self.order), v.index_select(1, self.order)  # global order
            c = q.shape[1] // 2  # this rank's two chunks: global blocks r and 2 cp - 1 - r
            return torch.cat([attend(q[:, i * c:(i + 1) * c], k[:, :m.shape[1]], v[:, :m.shape[1]],
                                     n_rep, mask=m) for i, m in enumerate(self.chunk_masks)], dim=1)
        if k.shape[2] % self.cp:  # kv heads do not split over cp: repeat them to the query heads
            k, v = (t.repeat_interleave(n_rep, dim=2) for t in (k, v))
            n_rep = 1
        q, k, v = (self._to_heads(t) for t in (q, k, v))
        if self.mask is not None:
            out = attend(q, k, v, n_rep, mask=self.mask)  # [B, T, H/cp * hd]
        else:  # in global order the mask is plain causal
            q, k, v = (t.index_select(1, self.order) for t in (q, k, v))
            out = attend(q, k, v, n_rep).index_select(1, self.keys)  # back to gathered order
        return self._to_sequence(out, q.shape[2], q.shape[3])

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, t, h, hd]`` (sequence-sharded) -> ``[B, T, h / cp, hd]`` (head-sharded; the
        sequence in :func:`gathered_index` order)."""
        b, t, h, hd = x.shape
        blocks = x.reshape(b, t, self.cp, h // self.cp, hd).permute(2, 0, 1, 3, 4)
        out = _AllToAll.apply(blocks.contiguous(), self.group)  # [cp, B, t, h/cp, hd]
        return out.permute(1, 0, 2, 3, 4).reshape(b, self.cp * t, h // self.cp, hd)

    def _to_sequence(self, y: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
        """``[B, T, heads * hd]`` (head-sharded) -> ``[B, t, cp * heads * hd]`` (this rank's
        slice of the sequence, all heads in their original order)."""
        b, seq = y.shape[0], y.shape[1]
        t = seq // self.cp
        blocks = y.reshape(b, self.cp, t, heads, hd).permute(1, 0, 2, 3, 4)
        out = _AllToAll.apply(blocks.contiguous(), self.group)  # [cp, B, t, heads, hd]
        return out.permute(1, 2, 0, 3, 4).reshape(b, t, self.cp * heads * hd)


def attention_modules(model: nn.Module) -> list[GQAttention]:
    """The model's attention modules that take a context-parallel hook."""
    return [m for m in model.modules() if isinstance(m, GQAttention)]


def install_attention(model: nn.Module, hook: Any) -> int:
    """Set ``hook`` as ``context_attention`` of every attention module of ``model`` (``None``
    removes it); returns how many."""
    mods = attention_modules(model)
    for m in mods:
        m.context_attention = hook
    return len(mods)


def check_context_parallel(cfg: Any, dims: Any, model: nn.Module) -> None:
    """``strategy.cp > 1`` against the model (on meta): its attention must take a slice of the
    sequence (attention modules built on :class:`~llmforge.models.decoder.GQAttention` and a
    forward that takes ``positions``); ``ulysses`` needs the query heads per tensor-parallel
    rank divisible by cp.

    Raises:
        ConfigError: naming ``strategy.cp`` or ``context_parallel.mode``.
    """
    cp, mode = dims.cp, cfg.context_parallel.mode
    mods = attention_modules(model)
    if not mods or not getattr(model, "takes_positions", False):
        raise ConfigError(f"strategy.cp={cp}: the attention of model '{cfg.model.name}' cannot take "
                          "a slice of the sequence (it needs llmforge.models.decoder.GQAttention "
                          "modules and a forward with positions, docs/parallelism.md); set strategy.cp=1")
    heads = mods[0].n_heads // max(1, dims.tp)
    if mode == "ulysses" and heads % cp:
        raise ConfigError(f"context_parallel.mode=ulysses splits the {heads} query heads "
                          f"{'per tensor-parallel rank ' if dims.tp > 1 else ''}over strategy.cp={cp}, "
                          f"which does not divide them; use context_parallel.mode=all_gather or a cp "
                          f"that divides {heads}")
