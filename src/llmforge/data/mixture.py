"""Weighted mixtures (``data.mixture``) of prepared and streaming sources: which source each
training window comes from, deterministic for a seed, exact on resume.

Global sample ``j`` (step ``t`` holds samples ``[t*G, (t+1)*G)``, ``G = global_batch_size``;
rank ``r`` takes its ``r``-th contiguous slice) is assigned to a source by a Weyl sequence
``u_j = frac(j * (sqrt(5) - 1) / 2 + offset(seed))`` (exact 64-bit fixed point) falling into the
cumulative weights: a low-discrepancy sequence, so after ``n`` samples every source's count is
within ``O(log n)`` of ``n * weight`` (Weyl's equidistribution; Kuipers & Niederreiter,
"Uniform Distribution of Sequences", ch. 1, for the golden-ratio bound). The ``c``-th window
drawn from source ``s`` is window ``perm[c mod N_s]`` of its epoch ``c // N_s``, ``perm``
seeded by ``(seed, s, epoch)``: each source is read without repeats within its own epoch.

Resuming at step ``t`` counts each source's samples before ``t * G`` (vectorized, about 10 ns
per sample already trained on); nothing is read or tokenized again. A prepared source's
windows depend on the step only, so they are exact on any data-parallel size. A streaming
source's window is the next one of its :class:`llmforge.data.streaming.StreamingWindows` in
the loader worker that produces the step (:class:`MixtureStream`), whose position the
checkpoint saves: exact on the same data-parallel size and ``data.num_workers``.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Dataset, Sampler

from llmforge.data.mixture_sources import PreparedMixture, mixture_entries, mixture_report
from llmforge.data.prepared import PreparedWindows
from llmforge.data.streaming import StreamingWindows
from llmforge.errors import DataError

__all__ = ["MixtureSampler", "MixtureStream", "MixtureTokens", "MixtureWindows", "PreparedMixture",
           "mixture_entries", "mixture_report", "mixture_windows"]

_PHI = np.uint64(0x9E3779B97F4A7C15)  # frac((sqrt(5) - 1) / 2) * 2**64, odd
_CHUNK = 1 << 20


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

    def rank_samples(self, step: int, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's samples of global batch ``step``: ``(source[local], c[local], counts)``,
        ``c`` the source's running count of each sample given ``base`` (each source's samples
        before the step) and ``counts`` the step's samples of each source (all ranks)."""
        lo = step * self.global_batch
        src = self.sources(lo, lo + self.global_batch)
        nth = np.empty(len(src), dtype=np.int64)
        for s in range(len(self.sizes)):
            mask = src == s
            nth[mask] = base[s] + np.arange(int(mask.sum()))
        mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
        return src[mine], nth[mine], np.bincount(src, minlength=len(self.sizes))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        step = self.start_step
        base = self.counts_before(step * self.global_batch)
        while True:
            src, nth, counts = self.rank_samples(step, base)
            base += counts
            for s, c in zip(src, nth):
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


class MixtureStream(torch.utils.data.IterableDataset):
    """Training windows ``LongTensor[seq_len + 1]`` of a mixture with streaming entries, one
    optimizer step's local batch after another, resumable exactly.

    Loader worker ``w`` of ``k`` (``StatefulDataLoader`` hands out its batches ``w, w+k, ...``)
    produces the steps ``start_step + w, start_step + w + k, ...``: for each it asks the sampler
    which source each of this rank's samples comes from; a prepared sample is window
    ``window(s, c)`` of that folder (as :class:`MixtureSampler`), a streaming one the next
    window of that source's :class:`StreamingWindows` in this worker (its own shards).

    Args:
        sampler: the mixture's :class:`MixtureSampler` (this rank, ``start_step``).
        prepared: source index -> :class:`llmforge.data.prepared.PreparedWindows`.
        streams: source index -> :class:`StreamingWindows` (split by data-parallel rank).
        names: every entry's name (the keys of the saved stream positions).
        num_workers: ``data.num_workers`` (0 = one worker, the training process).

    Raises:
        DataError (while iterating): a worker with no shard of a streaming source.
    """

    def __init__(self, sampler: MixtureSampler, prepared: dict[int, Any],
                 streams: dict[int, StreamingWindows], names: list[str], num_workers: int) -> None:
        self.sampler, self.prepared, self.streams, self.names = sampler, prepared, streams, names
        self.every = max(1, num_workers)
        self._pos: Optional[tuple[int, int]] = None  # (step, windows of it yielded)
        self._starts: dict[int, Any] = {}  # each stream's position at this iteration's start
        self._drawn: set[int] = set()
        self._resume: Optional[dict[str, Any]] = None

    # torchdata's Stateful protocol: StatefulDataLoader calls these in each worker
    def state_dict(self) -> dict[str, Any]:
        """``{"step", "yielded", "streams": {name: StreamingWindows state}}`` after the last
        window this worker yielded (JSON-serializable)."""
        if self._pos is None:  # nothing yielded yet (torchdata asks at worker start)
            if self._resume:
                return copy.deepcopy(self._resume)
            # a worker whose first batch is not consumed before a checkpoint resumes from this:
            # its first step, which a resumed loader's start_step + worker would miss
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            return {"step": self.sampler.start_step + (info.id if info is not None else 0),
                    "yielded": 0, "streams": {self.names[s]: w.state_dict() for s, w in self.streams.items()}}
        # a stream not drawn from since the start is still where it started (its generator
        # has not run, so its own state_dict would say "fresh")
        streams = {self.names[s]: w.state_dict() if s in self._drawn else copy.deepcopy(self._starts[s])
                   for s, w in self.streams.items()}
        return {"step": self._pos[0], "yielded": self._pos[1], "streams": streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the position :meth:`state_dict` returned (at the next ``iter``)."""
        self._resume = copy.deepcopy(state)

    def __iter__(self) -> Iterator[torch.Tensor]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = info.id if info is not None else 0
        smp, k = self.sampler, self.every
        saved, self._resume = self._resume or {}, None
        step, done = saved.get("step"), int(saved.get("yielded") or 0)
        if step is None:
            step, done = smp.start_step + worker, 0
        if done >= smp.local:
            step, done = step + k, 0
        starts = saved.get("streams") or {}
        for s, w in self.streams.items():
            if starts.get(self.names[s]) is not None:
                w.load_state_dict(starts[self.names[s]])
            self._starts[s] = starts.get(self.names[s]) or w.state_dict()
        self._drawn.clear()
        its = {s: iter(w) for s, w in self.streams.items()}
        base = smp.counts_before(step * smp.global_batch)
        while True:
            src, nth, _ = smp.rank_samples(step, base)
            for i in range(done, smp.local):
                s = int(src[i])
                if s in its:
                    try:
                        x = next(its[s], None)
                    except DataError as exc:  # this worker's shards hold no window
                        raise DataError(f"data.mixture ({self.names[s]}): the shards loader worker "
                                        f"{worker} reads give no complete window of seq_len+1="
                                        f"{self.streams[s].seq_len + 1} tokens; lower "
                                        "data.num_workers or drop the small files") from exc
                    if x is None:
                        raise DataError(f"data.mixture ({self.names[s]}): loader worker {worker} has "
                                        "no shard; lower data.num_workers or split it into more files")
                    self._drawn.add(s)
                else:
                    x = self.prepared[s][smp.window(s, int(nth[i]))]
                self._pos = (step, i + 1)
                yield x
            done = 0
            lo = step * smp.global_batch  # skip the steps the other workers produce
            base += np.bincount(smp.sources(lo, lo + k * smp.global_batch), minlength=len(smp.sizes))
            step += k


def mixture_windows(docs: PreparedMixture, tokenizer: Any, *, seq_len: int, rank: int, world: int,
                    seed: int, start_step: int, local_batch: int, num_workers: int) -> tuple[Any, int]:
    """The training windows of a mixture and its prepared training tokens: a map-style
    :class:`MixtureWindows` (indexed by :class:`MixtureSampler`) when every entry is prepared,
    else a :class:`MixtureStream`.

    Raises:
        DataError: a prepared entry with no window, a streaming entry with fewer shards on this
            rank than ``num_workers`` or one whose whole pass gives no window (names the entry).
    """
    prepared, streams = {}, {}
    for i, (e, part) in enumerate(zip(docs.entries, docs.parts)):
        key = f"data.mixture[{i}]"
        if e["source"] == "prepared":
            prepared[i] = PreparedWindows(part, "train", seq_len)
            if not len(prepared[i]):
                raise DataError(f"{key}.path: {part.root} holds fewer tokens than one window of "
                                f"seq_len+1={seq_len + 1} per shard")
            continue
        streams[i] = _checked_stream(key, e, part, tokenizer, seq_len, rank, world, seed + i,
                                     num_workers)
    n_tokens = sum(p.tokens for p in prepared.values())
    sizes = [len(prepared[i]) if i in prepared else 1 for i in range(len(docs.entries))]
    sampler = MixtureSampler([e["share"] for e in docs.entries], sizes, rank, world, seed,
                             start_step, local_batch)
    if not streams:
        return MixtureWindows([prepared[i] for i in range(len(sizes))]), n_tokens
    return MixtureStream(sampler, prepared, streams, [e["name"] for e in docs.entries],
                         num_workers), n_tokens


def _checked_stream(key: str, entry: dict[str, Any], docs: Any, tokenizer: Any, seq_len: int,
                    rank: int, world: int, seed: int, num_workers: int) -> StreamingWindows:
    """A streaming entry's windows on this rank, checked before training (a worker's error
    would reach the user wrapped in a traceback): enough shards for every loader worker, and
    a first window (reads and tokenizes one block)."""
    probe = StreamingWindows(docs.train, tokenizer, seq_len, rank, world, seed, files=docs.files)
    shards = probe.docs.num_shards
    if num_workers > shards:
        raise DataError(f"{key} ({entry['name']}): {entry['path']} has {shards} shard(s) on this "
                        f"rank, fewer than data.num_workers={num_workers}: a worker without a shard "
                        "cannot give this source its windows; lower data.num_workers or split the "
                        "source into more files")
    first = iter(probe)
    try:
        next(first)
    except DataError as exc:
        raise DataError(f"{key} ({entry['name']}): {entry['path']}: "
                        f"{str(exc).removeprefix('data: ')}") from exc
    finally:
        first.close()
    return StreamingWindows(docs.train, tokenizer, seq_len, rank, world, seed, files=docs.files)  # at its start


class MixtureTokens(Callback):
    """Adds ``data/<name>/tokens_seen`` (tokens trained from each source, all ranks) to the
    step's metrics on logging steps, so every logger records them.

    A step's windows are all trained on the same number of tokens, ``step_tokens /
    global_batch_size`` (``seq_len``, or fewer where an algorithm truncates them:
    ``seq_length_warmup``), so the per-source counts sum to ``train/tokens_seen`` at every
    step. The counts are saved in every checkpoint (:meth:`state_dict`); a checkpoint without
    them (an older llmforge) restarts them at ``seq_len`` tokens per window drawn before."""

    def __init__(self, names: list[str], shares: list[float], seed: int, global_batch_size: int,
                 seq_len: int) -> None:
        # the assignment depends on the shares, the seed and the global batch only
        self.sampler = MixtureSampler(shares, [1] * len(shares), seed=seed, local_batch=global_batch_size)
        self.names, self.seq_len = names, seq_len
        self.tokens: Optional[np.ndarray] = None  # int64[n_sources], after self.step
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "tokens": {name: tokens}}`` (plain JSON, in ``trainer_state.json``)."""
        if self.tokens is None:
            return {}
        return {"step": self.step, "tokens": dict(zip(self.names, map(int, self.tokens)))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("tokens") and list(state["tokens"]) == self.names:
            self.tokens = np.asarray(list(state["tokens"].values()), dtype=np.int64)
            self.step = int(state["step"])

    def after_optimizer_step(self, state: Any) -> None:
        """Event ``AFTER_OPTIMIZER_STEP``: count the step's tokens per source; into the record
        of a logging step."""
        pl_module = state.module
        step, g = state.step, self.sampler.global_batch
        if self.tokens is None or self.step != step - 1:  # a resume without saved counts
            self.tokens = self.sampler.counts_before((step - 1) * g).astype(np.int64) * self.seq_len
        per_window = pl_module.step_tokens // g  # this step's trained tokens of one window
        self.tokens += np.bincount(self.sampler.sources((step - 1) * g, step * g),
                                   minlength=len(self.names)) * per_window
        self.step = step
        if pl_module.is_log_step(step):
            state.metrics.update({f"data/{n}/tokens_seen": int(c)
                                           for n, c in zip(self.names, self.tokens)})
