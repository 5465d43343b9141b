"""Packed-sequence helpers shared by the decoder families: document runs, per-document
positions and the block-diagonal causal mask (no family-specific code)."""

from __future__ import annotations

import torch

__all__ = ["document_runs", "document_positions", "document_causal_mask"]


def document_runs(doc_ids: torch.Tensor) -> torch.Tensor:
    """Run index ``[B, T]`` int64 of ``doc_ids [B, T]``: a new run starts wherever the id changes
    from the previous position (so ids need only differ between neighbours; values are not
    compared across runs). Position 0 starts run 0."""
    start = torch.ones_like(doc_ids, dtype=torch.long)
    start[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return start.cumsum(dim=1) - 1


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document, ``[B, T]`` int64 (0 at every document start):
    the per-document position ids of packed sequences, so RoPE restarts for each document."""
    bsz, seqlen = doc_ids.shape
    idx = torch.arange(seqlen, device=doc_ids.device).expand(bsz, seqlen)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal attention mask ``[B, 1, T, T]`` bool (True = may attend): query ``i``
    sees key ``j`` iff ``j <= i`` and both lie in the same document run (:func:`document_runs`).
    Memory: ``B * T * T`` bytes (e.g. 64 MiB for B=1, T=8192)."""
    runs = document_runs(doc_ids)
    seqlen = doc_ids.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=doc_ids.device).tril()
    return ((runs[:, :, None] == runs[:, None, :]) & causal)[:, None]
