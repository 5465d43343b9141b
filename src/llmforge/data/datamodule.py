"""The Lightning data module: documents -> tokens -> packed windows -> per-rank batches.

A training batch is ``LongTensor[local_batch_size, seq_len + 1]`` with ``local_batch_size =
micro_batch_size * gradient_accumulation_steps``: everything one rank consumes in one optimizer
step (the module splits it into micro-batches). A validation batch is
``LongTensor[micro_batch_size, seq_len + 1]``.

Validation batches come from :meth:`LLMDataModule.eval_dataloader` (the module runs its own
evaluation at fixed optimizer steps, not Lightning's validation loop).

Non-streaming sources are tokenized once in :meth:`LLMDataModule.setup` (the ``tokenizers``
batch encoder runs on all cores) and sampled by :class:`ShardedSampler` in background workers;
streaming sources are tokenized inside the DataLoader workers by :class:`StreamingWindows`.
"""

from __future__ import annotations

from typing import Any, Optional

import datasets
import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from llmforge.data.packing import (PackedWindows, ShardedSampler, StreamingWindows, pack_documents,
                                   token_dtype)
from llmforge.data.sources import DocumentSplits
from llmforge.errors import DataError
from llmforge.parallel.mesh import dp_coordinates


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: loader workers ignore SIGTERM/SIGUSR1/SIGINT, which a
    scheduler or ``llmforge runs stop`` sends to the whole process group; the training process
    handles them (save, exit 75) and its workers end with it. Seeds the worker as Lightning's
    own ``worker_init_fn`` would (``seed_everything(workers=True)``)."""
    import os
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if os.environ.get("PL_SEED_WORKERS") == "1":
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id)


def tokenize_documents(ds: Any, tokenizer: Any, batch_size: int = 512) -> np.ndarray:
    """Tokenize every document of a map-style dataset and pack it (see :func:`pack_documents`)."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts = []
    for batch in ds.iter(batch_size=batch_size):
        parts.append(pack_documents(tokenizer.encode_batch(batch["text"]), tokenizer.bos_id,
                                    tokenizer.eos_id, dtype))
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


class LLMDataModule(L.LightningDataModule):
    """Train and validation loaders for causal-LM training.

    Args:
        docs: train and validation documents (:func:`llmforge.data.sources.load_documents`).
        tokenizer: a :class:`llmforge.data.tokenizers.Tokenizer`.
        seq_len: tokens per sequence (windows hold ``seq_len + 1``).
        local_batch_size: sequences per optimizer step on one data-parallel rank.
        micro_batch_size: sequences per validation batch.
        eval_batches: validation batches per evaluation (fewer if the split is smaller).
        seed: fixes the order of windows.
        num_workers: background DataLoader workers.
        dp_rank, dp_size: this rank's data-parallel coordinate; ``None`` = read from the
            strategy's device mesh at ``setup`` (its ``dp`` dim; ranks of one tensor-parallel
            group read the same data).
        start_step: optimizer steps already done (resume): the sampler continues at that
            global batch, whatever the data-parallel size was before.

    Raises:
        DataError (at ``setup``): the training split holds fewer windows per rank than one
        optimizer step needs; the message gives the token and window counts.
    """

    def __init__(self, docs: DocumentSplits, tokenizer: Any, *, seq_len: int, local_batch_size: int,
                 micro_batch_size: int, eval_batches: int, seed: int, num_workers: int = 1,
                 dp_rank: Optional[int] = None, dp_size: Optional[int] = None,
                 start_step: int = 0) -> None:
        super().__init__()
        self.docs, self.tokenizer = docs, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.micro_batch_size, self.eval_batches = micro_batch_size, eval_batches
        self.seed, self.num_workers = seed, num_workers
        self.dp_rank, self.dp_size, self.start_step = dp_rank, dp_size, start_step
        self.train_windows: Any = None
        self.val_windows: Any = None
        self.train_tokens = 0

    def _coords(self) -> tuple[int, int]:
        if self.dp_rank is not None and self.dp_size is not None:
            return self.dp_rank, self.dp_size
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return dp_coordinates(getattr(trainer.strategy, "_device_mesh", None))

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_windows is not None:
            return
        rank, world = self._coords()
        self.dp_rank, self.dp_size = rank, world
        if isinstance(self.docs.train, datasets.IterableDataset):
            self.train_windows = StreamingWindows(self.docs.train, self.tokenizer, self.seq_len,
                                                  rank, world, self.seed)
            if self.docs.val is not None:
                self.val_windows = StreamingWindows(self.docs.val, self.tokenizer, self.seq_len,
                                                    rank, world, self.seed, shuffle_buffer=None,
                                                    repeat=False)
            return
        tokens = tokenize_documents(self.docs.train, self.tokenizer)
        self.train_tokens = len(tokens)
        self.train_windows = PackedWindows(tokens, self.seq_len)
        per_rank = len(self.train_windows) // world
        if per_rank < self.local_batch_size:
            raise DataError(
                f"data: the training split has {len(tokens):,} tokens = {len(self.train_windows)} "
                f"windows of seq_len+1={self.seq_len + 1} tokens, {per_rank} per data-parallel "
                f"rank ({world} ranks), but one optimizer step needs {self.local_batch_size} per "
                "rank; use more text, a smaller trainer.seq_len or trainer.global_batch_size"
            )
        if self.docs.val is not None:
            val_tokens = tokenize_documents(self.docs.val, self.tokenizer)
            self.val_windows = PackedWindows(val_tokens, self.seq_len)
            if len(self.val_windows) < world:
                raise DataError(
                    f"data: the validation split has {len(val_tokens):,} tokens, fewer than one "
                    f"window of {self.seq_len + 1} tokens per rank ({world} ranks); raise "
                    "data.val_fraction or set data.val_fraction=0 to skip validation"
                )

    def train_dataloader(self) -> DataLoader:
        rank, world = self._coords()
        common = dict(num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                      prefetch_factor=4 if self.num_workers > 0 else None,
                      worker_init_fn=ignore_stop_signals if self.num_workers > 0 else None)
        if isinstance(self.train_windows, StreamingWindows):
            self.train_windows.skip = self.start_step * self.local_batch_size
            return DataLoader(self.train_windows, batch_size=self.local_batch_size, **common)
        sampler = ShardedSampler(len(self.train_windows), rank, world, self.seed,
                                 start_step=self.start_step, local_batch=self.local_batch_size)
        return DataLoader(self.train_windows, batch_size=self.local_batch_size, sampler=sampler,
                          drop_last=True, **common)

    def eval_dataloader(self) -> Optional[DataLoader]:
        """The fixed evaluation set: the first ``eval_batches * micro_batch_size`` validation
        windows (rounded down to a multiple of the data-parallel size), shared between ranks,
        so every world size evaluates the same windows. Finite; batches of micro_batch_size."""
        if self.val_windows is None:
            return None
        rank, world = self._coords()
        if isinstance(self.val_windows, StreamingWindows):
            return DataLoader(self.val_windows, batch_size=self.micro_batch_size)
        n = min(len(self.val_windows), self.eval_batches * self.micro_batch_size)
        n = max(world, n // world * world)
        sampler = ShardedSampler(n, rank, world, shuffle=False, infinite=False,
                                 local_batch=n // world)
        return DataLoader(self.val_windows, batch_size=self.micro_batch_size, sampler=sampler)
