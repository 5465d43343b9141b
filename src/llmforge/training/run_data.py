"""The data half of :class:`llmforge.Trainer`: documents (or prepared shards, a mixture,
conversations), the tokenizer checked against them and the model, and the data module. A
mixin, so a ``Trainer`` subclass still overrides any ``build_*`` method alone."""

from __future__ import annotations

import os

from itertools import islice
from typing import Any, Optional

from torch.utils.data import default_collate

from llmforge.checkpoint import read_json
from llmforge.data.chat import build_chat_template
from llmforge.data.datamodule import LLMDataModule, in_memory_tokens
from llmforge.data.packing import ShardedSampler, check_split_sizes
from llmforge.data.mixture import PreparedMixture
from llmforge.data.mixture_sources import check_one_tokenizer, open_mixture
from llmforge.data.prepared import check_tokenizer, open_prepared, PreparedSplits, PreparedWindows
from llmforge.data.sft import load_conversations, SFTDataModule
from llmforge.data.shakespeare import cache_root
from llmforge.data.sources import DocumentSplits, iter_texts, load_documents, plain_options, tokenizer_cache_key
from llmforge.data.token_cache import Splits
from llmforge.data.tokenizers import build_tokenizer, check_vocab, load_saved, Tokenizer
from llmforge.errors import ConfigError
from llmforge.plugin import meta_model
from llmforge.training.run_files import check_init_from_tokenizer

__all__ = ["DataBuilders"]


class DataBuilders:
    """``build_documents`` -> ``build_tokenizer`` -> ``cached_tokens`` -> ``build_datamodule`` of a
    run; needs the ``cfg``, ``plan`` and ``resume_path`` attributes :class:`llmforge.Trainer`
    sets."""

    cfg: Any
    plan: Any
    resume_path: Any

    def model_vocab_size(self) -> int:
        """Embedding rows of the configured model, read from the run's model on the meta device
        (:func:`llmforge.plugin.meta_model`).

        Raises:
            ConfigError: ``trainer.seq_len`` exceeds the model's ``max_seq_len``.
        """
        model = meta_model(self.cfg)
        limit = getattr(model, "max_seq_len", None)
        if limit is not None and self.cfg.trainer.seq_len > limit:
            raise ConfigError(f"trainer.seq_len={self.cfg.trainer.seq_len} exceeds the model's "
                              f"max_seq_len={limit}; raise model.max_seq_len or lower trainer.seq_len")
        return int(model.vocab_size)

    def build_documents(self) -> Any:
        """Documents (:class:`DocumentSplits`), or conversations for ``data.task: sft``
        (:class:`llmforge.data.sft.ConversationSplits`)."""
        if self.cfg.data.task == "sft":
            return load_conversations(self.cfg.data, self.cfg.run.seed)
        if self.cfg.data.mixture:  # prepared and streaming entries
            return open_mixture(self.cfg)
        if self.cfg.data.source == "prepared":
            if not self.cfg.data.path:
                raise ConfigError("data.source=prepared needs data.path, the folder written by "
                                  "`llmforge data prepare`")
            return open_prepared(self.cfg.data.path, cache_dir=self.cfg.data.cache_dir,
                                 storage_options=plain_options(self.cfg.data.storage_options))
        return load_documents(self.cfg.data, self.cfg.run.seed, lazy=True)

    def token_cache(self) -> Any:
        """The folder of the token cache (``data.token_cache``), or ``None``."""
        return cache_root() / "tokens" if self.cfg.data.token_cache else None

    def cached_tokens(self, docs: Any, tokenizer: Tokenizer) -> Optional[Splits]:
        """The ids ``(train, val)`` of in-memory documents with a token-cache key (local
        files, ``shakespeare``): read from the cache or tokenized (and stored) here, once, and
        handed to :meth:`build_datamodule`, and their splits checked for one optimizer step on
        every data-parallel rank (``--overwrite`` keeps the old run when they are too small);
        ``None`` for other sources (streaming, hub, URL, prepared, sft), whose lazily loaded
        documents are read now (a source that cannot be read fails before the run directory is
        touched) but whose sizes are checked only at the data module's ``setup``; a prepared
        folder (``data.source: prepared``) has its training split checked here too, from the
        token counts of its manifest (``data.task: sft`` and mixtures only at ``setup``).

        Raises:
            DataError: a split is too small (:func:`llmforge.data.packing.check_split_sizes`).
        """
        seq_len, world, local_batch = self.cfg.trainer.seq_len, self.plan.dp_size, self.plan.local_batch_size
        if isinstance(docs, PreparedSplits):  # the manifest's counts: no shard is read
            PreparedWindows(docs, "train", seq_len).check_size(world, local_batch)
            return None
        if not isinstance(docs, DocumentSplits):
            return None
        if not docs.key:
            if not docs.loaded:
                docs.train
            return None
        train, val = in_memory_tokens(docs, tokenizer, self.token_cache())
        check_split_sizes(len(train), seq_len, world, local_batch,
                          val_tokens=None if val is None else len(val))
        return train, val

    def build_tokenizer(self, docs: DocumentSplits) -> Tokenizer:
        """Build (or train and cache) the tokenizer and check it fits the model.

        A trained BPE is cached by :func:`tokenizer_cache_key`; a prepared source reads the
        tokenizer saved with its shards (see :meth:`_prepared_tokenizer`)."""
        if isinstance(docs, PreparedMixture) and docs.prepared:  # the first prepared entry's
            tok = self._prepared_tokenizer(docs.prepared[0])
            check_one_tokenizer(docs, tok)
            return tok
        if isinstance(docs, PreparedSplits):
            return self._prepared_tokenizer(docs)
        max_bytes = self.cfg.tokenizer.train_max_bytes
        key = tokenizer_cache_key(self.cfg, docs)
        if isinstance(docs, PreparedMixture):  # streaming entries only: each by its share
            texts = lambda: docs.texts(max_bytes)  # noqa: E731
        elif self.cfg.data.task == "sft":
            texts = lambda: (c.text for c in docs.train)  # noqa: E731 (sft: conversations)
        else:
            texts = lambda: iter_texts(docs.train, max_bytes, docs.files)  # noqa: E731
        tok = build_tokenizer(self.cfg.tokenizer, texts,
                              cache_dir=cache_root() / "tokenizers", fingerprint=key)
        check_vocab(tok, self.model_vocab_size())
        check_init_from_tokenizer(tok, self.cfg.model.get("init_from"))
        return tok

    def _prepared_tokenizer(self, docs: PreparedSplits) -> Tokenizer:
        """``data.source: prepared``: ``train_bpe`` means the tokenizer saved with the shards;
        any other must write the same ids (fingerprint) as the one that wrote them.

        Raises:
            DataError: the fingerprints differ (the shards would be read with other ids).
        """
        if self.cfg.tokenizer.type == "train_bpe":
            tok = load_saved(docs.root / "tokenizer")
        else:
            tok = build_tokenizer(self.cfg.tokenizer, None, cache_dir=cache_root() / "tokenizers")
        check_tokenizer(docs, tok, f"tokenizer.type={self.cfg.tokenizer.type}")
        check_vocab(tok, self.model_vocab_size())
        check_init_from_tokenizer(tok, self.cfg.model.get("init_from"))
        return tok

    def build_datamodule(self, docs: Any, tokenizer: Tokenizer,
                         cached_tokens: Optional[Splits] = None) -> LLMDataModule:
        """:class:`LLMDataModule` (pretraining windows) or, for ``data.task: sft``,
        :class:`llmforge.data.sft.SFTDataModule` (masked, optionally packed rows).
        ``cached_tokens``: :meth:`cached_tokens`' ids of ``docs``, if any (else the data
        module reads or tokenizes them at ``setup``)."""
        t = self.cfg.trainer
        start_step = int(read_json(self.resume_path, "trainer_state.json")["step"]) if self.resume_path else 0
        common = dict(seq_len=t.seq_len, start_step=start_step,
                      local_batch_size=self.plan.local_batch_size,
                      micro_batch_size=t.micro_batch_size, eval_batches=t.eval_batches,
                      seed=self.cfg.run.seed, num_workers=self.cfg.data.num_workers)
        d, ft = self.cfg.data, self.cfg.fault_tolerance
        if ft.enabled:  # the group's shard of the global batch, cut again by its FSDP2 ranks
            # (validate: FSDP2 alone inside a group, so the data-parallel rank is the rank)
            dp, rank = int(self.plan.dp_size), int(os.environ.get("RANK", 0))
            common.update(dp_rank=int(ft.replica_id) * dp + rank, dp_size=int(ft.replica_groups) * dp)
        if d.task == "sft":
            return SFTDataModule(docs, tokenizer, template=build_chat_template(d.chat_template, tokenizer),
                                 packed=d.packed, overlong=d.overlong,
                                 train_on_input=d.train_on_input, pad_id=d.pad_id, **common)
        return LLMDataModule(docs, tokenizer, resume_dir=self.resume_path,
                             allow_source_changes=self.cfg.checkpoint.allow_config_changes,
                             token_cache=self.token_cache(), cached_tokens=cached_tokens, **common)

    def batch_for_step(self, step: int) -> Any:
        """This rank's training batch of optimizer step ``step`` (1-based): what the loader
        yields at that step (:class:`ShardedSampler`'s slice of global batch ``step - 1``,
        collated), read directly; ``LongTensor[local_batch_size, seq_len + 1]``. A replica
        group that rejoined a fault-tolerant run at another step than its loader's reads its
        batches here (:class:`llmforge.parallel.fault_tolerance.ReplicaGroup`)."""
        dm = self.datamodule
        windows = dm.train_windows
        sampler = ShardedSampler(len(windows), dm.dp_rank, dm.dp_size, dm.seed,
                                 start_step=step - 1, local_batch=dm.local_batch_size)
        rows = [windows[i] for i in islice(iter(sampler), dm.local_batch_size)]
        return default_collate(rows)
