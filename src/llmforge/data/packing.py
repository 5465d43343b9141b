"""Packing documents into fixed windows, and the rank-sharded, seeded, resumable sampler.

Each document becomes ``[BOS] tokens [EOS]``; documents are concatenated in order and the
stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (the tail that does not
fill a window is dropped). A window ``w`` is one training sequence: inputs ``w[:-1]`` and
labels ``w[1:]`` (the label shift), both ``seq_len`` tokens long.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from llmforge.data.tokenizer_base import text_pieces  # noqa: F401 (its home before)
from llmforge.errors import DataError


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 below 65536, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def pack_documents(token_lists: Iterable[list[int]], bos_id: int, eos_id: int,
                   dtype: np.dtype = np.dtype(np.uint32)) -> np.ndarray:
    """Concatenate ``[BOS] doc [EOS]`` for each non-empty document.

    Returns:
        A 1-D array of ``sum(len(doc) + 2)`` token ids.
    """
    parts: list[np.ndarray] = []
    for ids in token_lists:
        if not ids:
            continue
        arr = np.empty(len(ids) + 2, dtype=dtype)
        arr[0], arr[-1] = bos_id, eos_id
        arr[1:-1] = ids
        parts.append(arr)
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


PIECE_CHARS = 1 << 20  # characters per call of a tokenizer's batch encoder


def _by_size(texts: list[str], max_chars: int) -> Iterator[list[str]]:
    """Consecutive runs of ``texts`` of at most ``max_chars`` characters (one longer text alone)."""
    run: list[str] = []
    size = 0
    for text in texts:
        if run and size + len(text) > max_chars:
            yield run
            run, size = [], 0
        run.append(text)
        size += len(text)
    if run:
        yield run


def iter_packed(tokenizer: Any, texts: Iterable[str], dtype: np.dtype,
                max_chars: int = PIECE_CHARS) -> Iterator[np.ndarray]:
    """The ids of :func:`encode_packed`, in consecutive 1-D ``dtype`` arrays of at most about
    ``max_chars`` characters' tokens each (plus the ``[BOS]``/``[EOS]`` around a long text), so a
    writer holds one piece at a time whatever a document's length (``data prepare``'s shards).

    The encoder's per-token objects (``tokenizers`` Encodings, Python int lists) cost ~150-200
    bytes a token, so one call on a 100 MB document held ~20 GB (issue 26.4); a text longer than
    ``max_chars`` is encoded in :func:`text_pieces`, each piece turned into ``dtype`` ids at once.
    A text read as a stream (:class:`llmforge.data.jsonl_lines.LongText`) is cut in the same
    pieces as it is read (one no longer than ``max_chars`` is joined, as it is encoded whole).
    """
    for run in _by_size(list(texts), max_chars):
        if len(run) > 1 or len(run[0]) <= max_chars:
            run = [t if isinstance(t, str) else "".join(t.pieces()) for t in run]
            packed = pack_documents(tokenizer.encode_batch(run), tokenizer.bos_id, tokenizer.eos_id, dtype)
            if len(packed):
                yield packed
            continue
        started = False
        for piece in text_pieces(run[0], max_chars):
            ids = np.asarray(tokenizer.encode_batch([piece])[0], dtype=dtype)
            if len(ids) and not started:  # [BOS] only before a text that has tokens
                yield np.asarray([tokenizer.bos_id], dtype)
                started = True
            if len(ids):
                yield ids
        if started:
            yield np.asarray([tokenizer.eos_id], dtype)


def encode_packed(tokenizer: Any, texts: Iterable[str], dtype: np.dtype,
                  max_chars: int = PIECE_CHARS) -> np.ndarray:
    """``[BOS] doc [EOS]`` of every non-empty text (as :func:`pack_documents`), with at most
    about ``max_chars`` characters per call of ``tokenizer.encode_batch`` (:func:`iter_packed`):
    the peak is the texts and their ids plus one piece's encoder objects.

    Returns:
        A 1-D ``dtype`` array of the packed ids.
    """
    parts = list(iter_packed(tokenizer, texts, dtype, max_chars))
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens in a stream of ``n_tokens``: ``n_tokens // (seq_len + 1)``."""
    return n_tokens // (seq_len + 1)


def check_split_sizes(train_tokens: int, seq_len: int, world: int, local_batch_size: int, *,
                      train_windows: Optional[int] = None, val_tokens: Optional[int] = None) -> None:
    """Check that a training split of ``train_tokens`` tokens (``train_windows`` windows of
    ``seq_len + 1``; default: packed, :func:`num_windows`) feeds one optimizer step of
    ``local_batch_size`` windows on each of ``world`` data-parallel ranks, and that a packed
    validation split of ``val_tokens`` (``None``: none) holds a window per rank.

    Raises:
        DataError: either split is too small; the message gives the token and window counts
            and the keys that fix it.
    """
    n = num_windows(train_tokens, seq_len) if train_windows is None else train_windows
    ranks = f"{world} rank{'s' * (world != 1)}"
    if n // world < local_batch_size:
        raise DataError(
            f"data: the training split has {train_tokens:,} tokens = {n} window{'s' * (n != 1)} of "
            f"seq_len+1={seq_len + 1} tokens, {n // world} per data-parallel rank ({ranks}), "
            f"but one optimizer step needs {local_batch_size} per rank; use more text, a smaller "
            "trainer.seq_len or trainer.global_batch_size")
    if val_tokens is not None and num_windows(val_tokens, seq_len) < world:
        raise DataError(
            f"data: the validation split has {val_tokens:,} tokens, fewer than one window of "
            f"{seq_len + 1} tokens per rank ({ranks}); raise data.val_fraction or set "
            "data.val_fraction=0 to skip validation")


class PackedWindows(Dataset):
    """Map-style dataset over a packed token array.

    Item ``i`` is ``LongTensor[seq_len + 1]`` = ``tokens[i*(seq_len+1) : (i+1)*(seq_len+1)]``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = num_windows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        w = self.seq_len + 1
        return torch.from_numpy(self.tokens[i * w:(i + 1) * w].astype(np.int64))


class ShardedSampler(Sampler[int]):
    """Infinite, seeded sampler in global batches, split between data-parallel ranks.

    Epoch ``e`` permutes ``range(num_samples)`` with ``seed + e`` (identity order when
    ``shuffle`` is false) and cuts it into global batches of ``local_batch * world_size``
    samples (the tail that does not fill one is dropped). Global batch ``j`` is
    ``perm[j*G:(j+1)*G]``; rank ``r`` takes its ``r``-th contiguous slice of ``local_batch``.
    Which samples a step sees depends only on the step and the global batch, not on the number
    of ranks: a run resumed with another data-parallel size continues exactly where it stopped.

    Args:
        num_samples: windows in the dataset.
        rank, world_size: this rank's data-parallel coordinate and the data-parallel size.
        seed: fixes the permutation of each epoch.
        shuffle: permute each epoch (else keep the order).
        start_step: global batches already consumed (resume).
        infinite: repeat epochs forever (training) or stop after one (evaluation).
        local_batch: samples per rank per global batch.

    Raises:
        ValueError: fewer samples than one global batch.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, start_step: int = 0, infinite: bool = True,
                 local_batch: int = 1) -> None:
        self.global_batch = local_batch * world_size
        if num_samples < self.global_batch:
            raise ValueError(f"{num_samples} samples do not fill one global batch of {self.global_batch}")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        self.local_batch, self.start_step = local_batch, start_step
        self.steps_per_epoch = num_samples // self.global_batch

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError("ShardedSampler is infinite")
        return max(0, self.steps_per_epoch - self.start_step) * self.local_batch

    def global_indices(self, step: int) -> np.ndarray:
        """All ranks' samples of global batch ``step`` (0-based over epochs)."""
        epoch, j = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        else:
            perm = np.arange(self.num_samples)
        return perm[j * self.global_batch:(j + 1) * self.global_batch]

    def __iter__(self) -> Iterator[int]:
        step = self.start_step
        lo = self.rank * self.local_batch
        perm_epoch, perm = -1, None
        while self.infinite or step < self.steps_per_epoch:
            epoch, j = divmod(step, self.steps_per_epoch)
            if epoch != perm_epoch:
                perm_epoch = epoch
                perm = (np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
                        if self.shuffle else np.arange(self.num_samples))
            start = j * self.global_batch + lo
            for i in perm[start:start + self.local_batch]:
                yield int(i)
            step += 1
