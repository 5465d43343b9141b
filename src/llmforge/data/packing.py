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
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


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


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens in a stream of ``n_tokens``: ``n_tokens // (seq_len + 1)``."""
    return n_tokens // (seq_len + 1)


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
    """Infinite, seeded sampler that gives each data-parallel rank a disjoint share of windows.

    Epoch ``e`` permutes ``range(num_samples)`` with ``seed + e`` (or keeps the order when
    ``shuffle`` is false), drops the tail that does not divide by ``world_size`` and gives rank
    ``r`` the items ``perm[r::world_size]``. ``start`` skips that many of this rank's samples
    (resume: samples already consumed).
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, start: int = 0, infinite: bool = True) -> None:
        if num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot be shared by {world_size} ranks")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle, self.start, self.infinite = seed, shuffle, start, infinite
        self.per_rank = num_samples // world_size

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError("ShardedSampler is infinite")
        return self.per_rank - self.start

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices in ``epoch``: ``per_rank`` of them."""
        if self.shuffle:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        else:
            perm = np.arange(self.num_samples)
        return perm[: self.per_rank * self.world_size][self.rank::self.world_size]

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.per_rank)
        while True:
            for i in self.indices(epoch)[offset:]:
                yield int(i)
            if not self.infinite:
                return
            epoch, offset = epoch + 1, 0


class StreamingWindows(IterableDataset):
    """Tokenize and pack a streaming ``datasets.IterableDataset`` on the fly (background workers).

    Documents are split between data-parallel ranks with ``datasets.distributed.
    split_dataset_by_node`` and between DataLoader workers by ``datasets`` itself; each yields
    ``LongTensor[seq_len + 1]`` windows. The epoch repeats when the source ends.
    """

    def __init__(self, docs: Any, tokenizer: Any, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle_buffer: Optional[int] = 1000,
                 repeat: bool = True, encode_batch_size: int = 64) -> None:
        from datasets.distributed import split_dataset_by_node

        self.docs = split_dataset_by_node(docs, rank=rank, world_size=world_size)
        if shuffle_buffer:
            self.docs = self.docs.shuffle(seed=seed, buffer_size=shuffle_buffer)
        self.tokenizer, self.seq_len, self.repeat = tokenizer, seq_len, repeat
        self.encode_batch_size = encode_batch_size

    def _texts(self) -> Iterator[list[str]]:
        epoch = 0
        while True:
            self.docs.set_epoch(epoch)
            batch: list[str] = []
            for row in self.docs:
                batch.append(row["text"])
                if len(batch) == self.encode_batch_size:
                    yield batch
                    batch = []
            if batch:
                yield batch
            if not self.repeat:
                return
            epoch += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        _ = get_worker_info()  # datasets assigns shards to workers itself
        tok, w = self.tokenizer, self.seq_len + 1
        buf: list[int] = []
        for texts in self._texts():
            for ids in tok.encode_batch(texts):
                if ids:
                    buf.append(tok.bos_id)
                    buf.extend(ids)
                    buf.append(tok.eos_id)
            while len(buf) >= w:
                yield torch.tensor(buf[:w], dtype=torch.long)
                del buf[:w]
