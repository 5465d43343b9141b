"""The Lightning data module: documents -> tokens -> packed windows -> per-rank batches.

A training batch is ``LongTensor[local_batch_size, seq_len + 1]`` with ``local_batch_size =
micro_batch_size * gradient_accumulation_steps``: everything one rank consumes in one optimizer
step (the module splits it into micro-batches). A validation batch is
``LongTensor[micro_batch_size, seq_len + 1]``.

Validation batches come from :meth:`LLMDataModule.eval_dataloader` (the module runs its own
evaluation at fixed optimizer steps, not Lightning's validation loop).

Non-streaming sources are tokenized once in :meth:`LLMDataModule.setup` (the ``tokenizers``
batch encoder runs on all cores) and sampled by :class:`ShardedSampler` in background workers;
streaming sources are tokenized inside the DataLoader workers by :class:`StreamingWindows`,
through torchdata's ``StatefulDataLoader``: :meth:`LLMDataModule.state_dict` is the position of
every worker of this rank, saved in each checkpoint (``data/rank<R>.json``) and restored at
resume without replaying the stream.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
from torch.utils.data import ConcatDataset, DataLoader

from llmforge.data.loader import PositionedLoader
from llmforge.data.notices import notice
from llmforge.data.mixture import (MixtureSampler, MixtureStream, MixtureWindows, PreparedMixture,
                                   mixture_windows)
from llmforge.data.packing import (PIECE_CHARS, PackedWindows, ShardedSampler, check_split_sizes,
                                   encode_packed, token_dtype)
from llmforge.data.prepared import PreparedSplits, PreparedWindows
from llmforge.data.file_identity import file_identities
from llmforge.data.documents import DocumentSplits, is_stream
from llmforge.data.streaming import StreamingWindows
from llmforge.data.token_cache import Splits, lookup, write_entry
from llmforge.errors import DataError
from llmforge.parallel.lightning_private import strategy_mesh
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


def in_memory_tokens(docs: DocumentSplits, tokenizer: Any, token_cache: Optional[Path]) -> Splits:
    """The packed ids ``(train, val)`` of in-memory documents (``val`` ``None``: no validation
    split), read from the token cache (:mod:`llmforge.data.token_cache`) when it holds them,
    else tokenized and stored there (``token_cache`` ``None``: tokenized, not stored)."""
    name, hit = lookup(token_cache, getattr(docs, "key", ""), tokenizer, getattr(docs, "has_val", None))
    if hit is not None:
        return hit
    notice("data: tokenizing the documents" + (f" (once: the ids are cached in {token_cache})"
                                               if name is not None else ""))
    train = tokenize_documents(docs.train, tokenizer)
    val = None if docs.val is None else tokenize_documents(docs.val, tokenizer)
    if name is not None:
        write_entry(token_cache, name, train, val)
    return train, val


def tokenize_documents(ds: Any, tokenizer: Any, batch_size: int = 512,
                       max_chars: int = PIECE_CHARS) -> np.ndarray:
    """Tokenize every document of a map-style dataset and pack it (``[BOS] doc [EOS]`` each).

    Each call of the batch encoder gets at most ``max_chars`` characters
    (:func:`llmforge.data.packing.encode_packed`): its per-token objects are ~150 bytes a
    token, so encoding the 39 plays of the demo in one call held ~330 MiB at once, the peak of
    the whole run (issue 18.9); 1 MiB of text holds ~60 MiB. A longer document is encoded in
    pieces cut at spaces (issue 26.4)."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts = [encode_packed(tokenizer, batch["text"], dtype, max_chars)
             for batch in ds.iter(batch_size=batch_size)]
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
        resume_dir: the checkpoint resumed from; a streaming source continues at the loader
            position saved there (``data/rank<R>.json``).
        allow_source_changes: when a streaming source's files differ from those the position
            was saved with, restart that stream (``checkpoint.allow_config_changes``) instead
            of raising.
        token_cache: the folder of the token cache of in-memory sources (``data.token_cache``;
            :mod:`llmforge.data.token_cache`); ``None`` tokenizes at every start.
        cached_tokens: ``(train, val)`` ids of ``docs`` the caller already has
            (:func:`in_memory_tokens`: the trainer reads or tokenizes them once and checks
            their size before the run directory is written); ``None`` gets them at ``setup``.

    Raises:
        DataError (at ``setup``): the training split holds fewer windows per rank than one
        optimizer step needs, or the validation split less than one window per rank
        (:func:`llmforge.data.packing.check_split_sizes`). (At the first
        batch of a resume:) a streaming source's files changed since the checkpoint.
    """

    def __init__(self, docs: DocumentSplits, tokenizer: Any, *, seq_len: int, local_batch_size: int,
                 micro_batch_size: int, eval_batches: int, seed: int, num_workers: int = 1,
                 dp_rank: Optional[int] = None, dp_size: Optional[int] = None,
                 start_step: int = 0, resume_dir: Optional[str | Path] = None,
                 allow_source_changes: bool = False, token_cache: Optional[Path] = None,
                 cached_tokens: Optional[Splits] = None) -> None:
        super().__init__()
        self.token_cache, self.cached_tokens = token_cache, cached_tokens
        self.docs, self.tokenizer = docs, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.micro_batch_size, self.eval_batches = micro_batch_size, eval_batches
        self.seed, self.num_workers = seed, num_workers
        self.dp_rank, self.dp_size, self.start_step = dp_rank, dp_size, start_step
        self.resume_dir = Path(resume_dir) if resume_dir else None
        self.allow_source_changes = allow_source_changes
        self.positioned: Optional[PositionedLoader] = None
        self._stats: Optional[dict[str, list[list]]] = None  # see _stream_stats
        self.train_windows: Any = None
        self.val_windows: Any = None
        self.train_tokens = 0

    def _coords(self) -> tuple[int, int]:
        if self.dp_rank is not None and self.dp_size is not None:
            return self.dp_rank, self.dp_size
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return dp_coordinates(strategy_mesh(trainer.strategy))

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_windows is not None:
            return
        rank, world = self._coords()
        self.dp_rank, self.dp_size = rank, world
        # documents with a token-cache key are read whole (and maybe not at all: cached)
        if not getattr(self.docs, "key", "") and is_stream(getattr(self.docs, "train", None)):
            files = getattr(self.docs, "files", ())
            self.train_windows = StreamingWindows(self.docs.train, self.tokenizer, self.seq_len,
                                                  rank, world, self.seed, files=files)
            if self.docs.val is not None:
                self.val_windows = StreamingWindows(self.docs.val, self.tokenizer, self.seq_len,
                                                    rank, world, self.seed, shuffle=False,
                                                    repeat=False, files=files)
            return
        val_tokens = None  # in-memory documents' validation ids
        if isinstance(self.docs, PreparedMixture):
            self.train_windows, n_tokens = mixture_windows(
                self.docs, self.tokenizer, seq_len=self.seq_len, rank=rank, world=world,
                seed=self.seed, start_step=self.start_step, local_batch=self.local_batch_size,
                num_workers=self.num_workers)
            self.train_tokens = n_tokens
        elif isinstance(self.docs, PreparedSplits):  # memory-mapped token shards, no tokenizing
            self.train_windows = PreparedWindows(self.docs, "train", self.seq_len)
            self.train_windows.check_size(world, self.local_batch_size)
            n_tokens = self.train_tokens = self.train_windows.tokens
        else:
            tokens, val_tokens = self._in_memory_tokens()
            n_tokens = self.train_tokens = len(tokens)
            self.train_windows = PackedWindows(tokens, self.seq_len)
        # a stream has no length (each prepared entry was checked to hold a window)
        if not isinstance(self.train_windows, MixtureStream):
            check_split_sizes(n_tokens, self.seq_len, world, self.local_batch_size,
                              train_windows=len(self.train_windows),
                              val_tokens=None if val_tokens is None else len(val_tokens))
        if isinstance(self.docs, (PreparedSplits, PreparedMixture)):
            # a mixture evaluates on its prepared entries' val windows only (docs/data.md)
            parts = self.docs.prepared if isinstance(self.docs, PreparedMixture) else [self.docs]
            val = ConcatDataset([PreparedWindows(p, "val", self.seq_len) for p in parts]) if parts else []
            self.val_windows = val if len(val) >= world else None  # too few: no evaluation
            if self.val_windows is None and rank == 0:
                import sys

                print("data.mixture: evaluation reads the prepared entries' validation windows "
                      "only; this mixture has too few, so the run does not evaluate"
                      if isinstance(self.docs, PreparedMixture) else
                      f"data.path: the prepared corpus holds {len(val)} validation windows, fewer "
                      f"than one per rank ({world}), so the run does not evaluate; prepare it again "
                      "with a larger data.val_fraction", file=sys.stderr, flush=True)
        elif val_tokens is not None:
            self.val_windows = PackedWindows(val_tokens, self.seq_len)

    def _in_memory_tokens(self) -> Splits:
        if self.cached_tokens is not None:
            return self.cached_tokens
        return in_memory_tokens(self.docs, self.tokenizer, self.token_cache)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._coords()
        common = dict(num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                      prefetch_factor=4 if self.num_workers > 0 else None,
                      worker_init_fn=ignore_stop_signals if self.num_workers > 0 else None)
        if isinstance(self.train_windows, (StreamingWindows, MixtureStream)):
            return self._streaming_loader(common)
        if isinstance(self.train_windows, MixtureWindows):
            entries = self.docs.entries
            sampler: Any = MixtureSampler([e["share"] for e in entries],
                                          [len(p) for p in self.train_windows.parts], rank, world,
                                          self.seed, self.start_step, self.local_batch_size)
        else:
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

    # ------------------------------------------------- streaming position (checkpoints)
    def _streaming_loader(self, common: dict) -> PositionedLoader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(self.train_windows, batch_size=self.local_batch_size, **common)
        start = self._saved_position()
        if start is not None:
            loader.load_state_dict(start)
        self.positioned = PositionedLoader(loader, start)
        return self.positioned

    def _saved_position(self) -> Optional[dict]:
        """This rank's loader state from the resume checkpoint, or ``None`` (fresh stream) when
        there is none or it was saved with another data-parallel size or worker count."""
        if self.resume_dir is None:
            return None
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        path = self.resume_dir / "data" / f"rank{rank}.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        if saved.get("loader") is not None and not self._same_files(saved, path, rank):
            return None
        now = {"dp_size": self.dp_size, "num_workers": self.num_workers}
        then = {k: saved.get(k) for k in now}
        if saved.get("loader") is not None and then == now:
            return saved["loader"]
        if rank == 0:
            import sys

            why = (f"it was saved with data-parallel size {then['dp_size']} and data.num_workers="
                   f"{then['num_workers']}, this run has {now['dp_size']} and {now['num_workers']}"
                   if saved else "it holds no streaming position (saved by an older llmforge)")
            what = ("every rank restarts the mixture's streaming entries from their beginning "
                    "(disjoint between ranks), so their documents already trained on are seen "
                    f"again; its prepared entries continue exactly at step {self.start_step}"
                    if isinstance(self.train_windows, MixtureStream) else
                    "every rank restarts the stream from its beginning, so documents already "
                    "trained on are seen again (disjoint between ranks)")
            print(f"data: {self.resume_dir} cannot restore the streaming position ({why}); {what}",
                  file=sys.stderr, flush=True)
        return None

    def _stream_sources(self) -> dict[str, Any]:
        """The documents of each streaming source (``data``, or a mixture entry's name)."""
        if isinstance(self.docs, PreparedMixture):
            return {e["name"]: p for e, p in zip(self.docs.entries, self.docs.parts)
                    if e["source"] != "prepared"}
        return {"data": self.docs}

    def _stream_files(self) -> dict[str, list[str]]:
        """The file names of each streaming source (no directories, no URL credentials; a
        URL glob as written): a saved position is a shard index and an offset in these."""
        return {k: [os.path.basename(str(f)) for f in getattr(d, "files", ())]
                for k, d in self._stream_sources().items()}

    def _stream_stats(self) -> dict[str, Optional[list[list]]]:
        """``[name, bytes, version]`` of each file of each streaming source
        (:func:`llmforge.data.file_identity.file_identities`: a local file's head hash, an object's
        ETag or modification time, a URL glob expanded), computed once per run: a checkpoint
        records it, and a file rewritten under its name or a glob that lists other objects is
        noticed at resume. ``None`` for a source whose store could not be listed (not compared)."""
        if self._stats is None:
            self._stats = {}
            for k, d in self._stream_sources().items():
                try:
                    self._stats[k] = file_identities(getattr(d, "files", ()),
                                                     getattr(d, "storage_options", None))
                except Exception as exc:  # any driver's error: a checkpoint must not fail on a listing
                    print(f"data: cannot list the files of {k} ({type(exc).__name__}); a resume "
                          "will not check them for changes", file=sys.stderr, flush=True)
                    self._stats[k] = None
        return self._stats

    def _same_files(self, saved: dict, path: Path, rank: int) -> bool:
        """Whether the streaming sources read the files ``saved`` was written with (a position
        in other files would silently skip or repeat documents).

        Raises:
            DataError: they differ and ``allow_source_changes`` is off.
        """
        then, now = saved.get("files"), self._stream_files()
        if then is None:  # saved by an older llmforge
            return True
        stats_then, stats_now = saved.get("file_stats") or {}, self._stream_stats()
        # a URL glob is one name in ``files``: the objects it lists are compared by their stats
        # (a source without saved stats, or with none listed by an older llmforge, is not)
        listed = {k: (old, new) for k, new in stats_now.items()
                  if (old := stats_then.get(k)) and new is not None}
        then = {**then, **{k: [e[0] for e in old] for k, (old, _) in listed.items()}}
        now = {**now, **{k: [e[0] for e in new] for k, (_, new) in listed.items()}}
        if then == now:
            rewritten = [f"{k}: {new[0]} ({old[1]:,} -> {new[1]:,} bytes"
                         + (", other content)" if old[1] == new[1] else ")")
                         for k, (entries_then, entries) in listed.items()
                         for old, new in zip(entries_then, entries) if old != new]
            if not rewritten:
                return True
            msg = (f"data: a streaming file changed since {path} was saved ({'; '.join(rewritten)}): "
                   "the saved offsets in it would skip or repeat documents")
        else:
            changed = ", ".join(f"{k}: {len(then.get(k) or [])} -> {len(v)} files"
                                + (" (other names)" if len(then.get(k) or []) == len(v) else "")
                                for k, v in now.items() if then.get(k) != v)
            msg = f"data: the streaming files differ from those {path} was saved with ({changed})"
        if not self.allow_source_changes:
            raise DataError(f"{msg}; the saved position does not fit them: restore the files, or "
                            "pass checkpoint.allow_config_changes=true to restart the stream from its "
                            "beginning")
        if rank == 0:
            rest = (" (the prepared entries continue exactly)" if isinstance(self.docs, PreparedMixture) else "")
            print(f"{msg}; checkpoint.allow_config_changes=true: the stream restarts from its "
                  f"beginning{rest}", file=sys.stderr, flush=True)
        return False

    def teardown(self, stage: Optional[str] = None) -> None:
        if self.positioned is not None:
            self.positioned.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's streaming position after the optimizer steps done so far (what a
        checkpoint saves as ``data/rank<R>.json``): ``{"dp_rank", "dp_size", "num_workers",
        "loader": StatefulDataLoader state}``. Empty for in-memory sources, whose position is
        the step (:class:`ShardedSampler`)."""
        if self.positioned is None:
            return {}
        trainer = getattr(self, "trainer", None)
        step = trainer.global_step if trainer is not None else self.start_step
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "num_workers": self.num_workers,
                "step": step, "files": self._stream_files(), "file_stats": self._stream_stats(),
                "loader": self.positioned.position(step - self.start_step)}
