"""Streaming sources: tokenize and pack a ``datasets.IterableDataset`` inside the loader workers,
with an exact, O(1) resume position.

Each data-parallel rank reads a disjoint part of the documents
(``datasets.distributed.split_dataset_by_node``) and each DataLoader worker a disjoint set of
the source's shards (``datasets`` assigns them; a worker beyond the shard count idles), the
same set in every pass. Within a worker, documents are read in blocks of ``block_docs``; a
block's tokens (with the tail the previous block left) are cut into windows of ``seq_len + 1``
tokens and yielded in an order permuted by ``(seed, rank, worker, epoch, block)``, ``epoch``
being this worker's own pass number (workers end their passes at different times).

The position (:meth:`StreamingWindows.state_dict`) is ``datasets``' own
``IterableDataset.state_dict()`` at the start of the current block, the tail carried into it
(< seq_len + 1 ids) and how many of the block's windows were yielded. Resuming re-reads and
re-tokenizes at most one block, never the stream: exact and independent of how far the run
got. torchdata's ``StatefulDataLoader`` collects this state from every worker (see
:class:`llmforge.data.loader.PositionedLoader`).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from llmforge.data.packing import encode_packed
from llmforge.data.sources import read_rows
from llmforge.errors import DataError


def _fresh_state(epoch: int = 0, tail: Optional[list[int]] = None) -> dict[str, Any]:
    return {"epoch": epoch, "block": 0, "docs": None, "tail": tail or [], "yielded": 0}


class StreamingWindows(IterableDataset):
    """Windows ``LongTensor[seq_len + 1]`` from a streaming document source, resumable exactly.

    Args:
        docs: a ``datasets.IterableDataset`` with a ``text`` column.
        tokenizer: a :class:`llmforge.data.tokenizers.Tokenizer`.
        seq_len: tokens per training sequence (windows hold ``seq_len + 1``).
        rank, world_size: this rank's data-parallel coordinate.
        seed: fixes the order of windows within each block.
        shuffle: permute the windows of each block (validation keeps the order).
        repeat: start a new pass (epoch) when the source ends; else stop.
        block_docs: documents per block (the most a resume re-tokenizes).
        files: the source's files, named when one cannot be read.

    Raises:
        DataError (while iterating): a whole pass over this worker's shards gave no window, or
            a file is not UTF-8 or does not parse (:func:`llmforge.data.sources.read_rows`).
    """

    def __init__(self, docs: Any, tokenizer: Any, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, repeat: bool = True,
                 block_docs: int = 256, files: Any = ()) -> None:
        from datasets.distributed import split_dataset_by_node

        self.docs = split_dataset_by_node(docs, rank=rank, world_size=world_size)
        self.tokenizer, self.seq_len, self.repeat = tokenizer, seq_len, repeat
        self.rank, self.seed, self.shuffle, self.block_docs = rank, seed, shuffle, block_docs
        self.files = tuple(files)
        self._state = _fresh_state()
        self._resume: Optional[dict[str, Any]] = None

    # torchdata's Stateful protocol: StatefulDataLoader calls these in each worker
    def state_dict(self) -> dict[str, Any]:
        """This worker's position after the last window it yielded (JSON-serializable)."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the position :meth:`state_dict` returned (at the next ``iter``)."""
        self._resume = copy.deepcopy(state)

    def _pack(self, texts: list[str], tail: list[int]) -> tuple[np.ndarray, list[int]]:
        """``(windows[n, seq_len + 1], new tail)`` of ``tail + [BOS] doc [EOS] ...``."""
        w, int64 = self.seq_len + 1, np.dtype(np.int64)
        ids = np.concatenate([np.asarray(tail, dtype=int64),
                              encode_packed(self.tokenizer, texts, int64)])  # long texts in pieces
        n = len(ids) // w
        return ids[:n * w].reshape(n, w), ids[n * w:].tolist()

    def _order(self, n: int, worker: int, epoch: int, block: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.rank, worker, epoch, block]).permutation(n)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and worker >= self.docs.num_shards:
            return  # datasets gives this worker no shard (more workers than shards)
        state = self._resume or _fresh_state()
        self._resume = None
        while True:
            epoch = state["epoch"]
            # the pass number lives in this worker's own state only, never in datasets'
            # set_epoch: datasets keeps its epoch in memory shared by every loader worker, so
            # workers in different passes would overwrite each other's (a resume then dropped
            # its saved position, and two workers read the same file for the rest of a pass).
            # datasets' epoch stays 0: every pass splits the files between workers the same way
            self.docs.load_state_dict(state["docs"] if state["docs"] is not None else None)
            whole_pass = state["docs"] is None and state["block"] == 0 and state["yielded"] == 0
            produced = 0
            rows = read_rows(self.docs, self.files)
            while True:
                texts = [row["text"] for _, row in zip(range(self.block_docs), rows)]
                if not texts:
                    break
                windows, tail = self._pack(texts, state["tail"])
                order = self._order(len(windows), worker, epoch, state["block"])
                for i in range(state["yielded"], len(windows)):
                    state["yielded"] = i + 1
                    self._state = state
                    produced += 1
                    yield torch.from_numpy(windows[order[i]].copy())
                # the next block starts here: datasets' position after this block's documents
                state = {"epoch": epoch, "block": state["block"] + 1, "docs": self.docs.state_dict(),
                         "tail": tail, "yielded": 0}
                self._state = state
            if whole_pass and produced == 0:
                raise DataError(f"data: one pass over the streaming source gave no complete window "
                                f"of seq_len+1={self.seq_len + 1} tokens; the source is empty or "
                                "too small")
            if not self.repeat:
                return
            state = _fresh_state(epoch + 1, state["tail"])
            self._state = state
