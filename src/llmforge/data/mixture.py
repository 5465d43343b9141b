"""Weighted mixtures of prepared sources (``data.mixture``): which source each training window
comes from, deterministic for a seed, exact on resume and on any data-parallel size.

Global sample ``j`` (step ``t`` holds samples ``[t*G, (t+1)*G)``, ``G = global_batch_size``;
rank ``r`` takes its ``r``-th contiguous slice) is assigned to a source by a Weyl sequence
``u_j = frac(j * (sqrt(5) - 1) / 2 + offset(seed))`` (exact 64-bit fixed point) falling into the
cumulative weights: a low-discrepancy sequence, so after ``n`` samples every source's count is
within ``O(log n)`` of ``n * weight`` (Weyl's equidistribution; Kuipers & Niederreiter,
"Uniform Distribution of Sequences", ch. 1, for the golden-ratio bound). The ``c``-th window
drawn from source ``s`` is window ``perm[c mod N_s]`` of its epoch ``c // N_s``, ``perm``
seeded by ``(seed, s, epoch)``: each source is read without repeats within its own epoch.

Resuming at step ``t`` counts each source's samples before ``t * G`` (vectorized, about 10 ns
per sample already trained on); nothing is read or tokenized again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Dataset, Sampler

from llmforge.errors import ConfigError

_PHI = np.uint64(0x9E3779B97F4A7C15)  # frac((sqrt(5) - 1) / 2) * 2**64, odd
_CHUNK = 1 << 20


def mixture_entries(cfg: Any) -> list[dict[str, Any]]:
    """``data.mixture`` checked: ``[{name, path, weight (normalized)}]``; ``[]`` without one.

    Raises:
        ConfigError: an entry that is not prepared, has no path, a weight that is not a
            finite number > 0, or a repeated name (the message names the key).
    """
    raw = list(cfg.data.get("mixture") or [])
    out, names = [], set()
    for i, entry in enumerate(raw):
        key = f"data.mixture[{i}]"
        entry = dict(entry)
        unknown = set(entry) - {"source", "path", "weight", "name"}
        if unknown:
            raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)}; an entry has source, path, "
                              "weight and name")
        if entry.get("source", "prepared") != "prepared":
            raise ConfigError(f"{key}.source={entry['source']!r}: mixtures read prepared token shards "
                              "only; prepare it with `llmforge data prepare` and use source: prepared")
        if not entry.get("path"):
            raise ConfigError(f"{key}.path: required (a folder written by `llmforge data prepare`)")
        w = entry.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{key}.weight={w!r}: must be a finite number > 0 (weights are "
                              "normalized to shares; drop an entry to leave it out)")
        name = str(entry.get("name") or str(entry["path"]).rstrip("/").rsplit("/", 1)[-1])
        if name in names:
            raise ConfigError(f"{key}.name={name!r}: another entry has this name; names must differ")
        names.add(name)
        out.append({"name": name, "path": str(entry["path"]), "weight": float(w)})
    total = sum(e["weight"] for e in out)
    for e in out:
        e["share"] = e["weight"] / total
    return out


@dataclass
class PreparedMixture:
    """The data module's input for ``data.mixture``: the checked entries and their opened
    prepared folders (:func:`llmforge.data.prepared.open_prepared`), in order."""

    entries: list[dict[str, Any]]
    parts: list[Any]


def mixture_report(cfg: Any, tokens_per_step: int) -> list[str]:
    """``--dry-run`` lines: each source's share and tokens per optimizer step."""
    return [f"mixture         {e['name']}: {e['share']:.1%} share, ~{e['share'] * tokens_per_step:,.0f} "
            f"tokens per step ({e['path']})" for e in mixture_entries(cfg)]


class MixtureSampler(Sampler):
    """Infinite sampler of ``(source, window)`` pairs in global batches, split between ranks.

    Args:
        shares: each source's share (sums to 1).
        sizes: windows in each source.
        rank, world_size, local_batch: as :class:`llmforge.data.packing.ShardedSampler`.
        seed: fixes the assignment and each source's permutations.
        start_step: global batches already consumed (resume).
    """

    def __init__(self, shares: list[float], sizes: list[int], rank: int = 0, world_size: int = 1,
                 seed: int = 0, start_step: int = 0, local_batch: int = 1) -> None:
        self.cum = np.cumsum(shares)[:-1]
        self.sizes, self.rank, self.world = list(sizes), rank, world_size
        self.seed, self.start_step, self.local = seed, start_step, local_batch
        self.global_batch = local_batch * world_size
        self.offset = np.uint64(np.random.default_rng([seed, 1]).integers(0, 2**63)) * np.uint64(2)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def sources(self, lo: int, hi: int) -> np.ndarray:
        """Source index of global samples ``[lo, hi)``."""
        j = np.arange(lo, hi, dtype=np.uint64)
        with np.errstate(over="ignore"):  # wrapping mod 2**64 is the fixed-point fraction
            u = (j * _PHI + self.offset).astype(np.float64) / 2.0**64
        return np.searchsorted(self.cum, u, side="right")

    def counts_before(self, n: int) -> np.ndarray:
        """Samples of each source among global samples ``[0, n)``."""
        counts = np.zeros(len(self.sizes), dtype=np.int64)
        for lo in range(0, n, _CHUNK):
            counts += np.bincount(self.sources(lo, min(n, lo + _CHUNK)), minlength=len(self.sizes))
        return counts

    def window(self, s: int, c: int) -> int:
        epoch, pos = divmod(c, self.sizes[s])
        perm = self._perms.get((s, epoch))
        if perm is None:
            if len(self._perms) > 2 * len(self.sizes):
                self._perms.clear()
            perm = self._perms[(s, epoch)] = np.random.default_rng(
                [self.seed, s, epoch]).permutation(self.sizes[s])
        return int(perm[pos])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        step = self.start_step
        base = self.counts_before(step * self.global_batch)
        while True:
            lo = step * self.global_batch
            src = self.sources(lo, lo + self.global_batch)
            nth = np.empty(len(src), dtype=np.int64)  # c: the source's running count
            for s in range(len(self.sizes)):
                mask = src == s
                nth[mask] = base[s] + np.arange(int(mask.sum()))
            base += np.bincount(src, minlength=len(self.sizes))
            mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
            for s, c in zip(src[mine], nth[mine]):
                yield int(s), self.window(int(s), int(c))
            step += 1


class MixtureWindows(Dataset):
    """Map-style dataset indexed by ``(source, window)``: ``LongTensor[seq_len + 1]``."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        s, w = key
        return self.parts[s][w]


class MixtureTokens(Callback):
    """Adds ``data/<name>/tokens_seen`` (tokens of windows drawn from each source, all ranks) to
    the step's metrics on logging steps, so every logger records them."""

    def __init__(self, names: list[str], shares: list[float], seed: int, global_batch_size: int,
                 seq_len: int) -> None:
        # the assignment depends on the shares, the seed and the global batch only
        self.sampler = MixtureSampler(shares, [1] * len(shares), seed=seed, local_batch=global_batch_size)
        self.names, self.seq_len = names, seq_len
        self.counts: Optional[np.ndarray] = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, g = trainer.global_step, self.sampler.global_batch
        if self.counts is None:  # first step of this process (maybe a resume)
            self.counts = self.sampler.counts_before(step * g)
        else:
            self.counts += np.bincount(self.sampler.sources((step - 1) * g, step * g),
                                       minlength=len(self.names))
        if pl_module.is_log_step(step):
            pl_module.step_metrics.update({f"data/{n}/tokens_seen": int(c) * self.seq_len
                                           for n, c in zip(self.names, self.counts)})
