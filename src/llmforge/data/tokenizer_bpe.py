"""The ``train_bpe`` tokenizer kind: a byte-level BPE trained (with HF ``tokenizers``) on the
training text, cached by fingerprint."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable

from llmforge.data.notices import notice
from llmforge.data.tokenizer_base import _atomic_write, text_pieces
from llmforge.data.tokenizer_hf import HFTokenizer
from llmforge.errors import ConfigError

__all__ = ["train_bpe_tokenizer", "BPE_SPECIAL_TOKENS", "TRAIN_PIECE_CHARS"]

#: Characters per text the BPE trainer is given: its pre-tokenizer holds ~100 bytes of objects
#: per word of a text, and its input buffer 256 texts, so one 54 MB document peaked at 4.9 GB
#: (issue 50.7); longer texts go in :func:`text_pieces` (cut before a space: the same words).
TRAIN_PIECE_CHARS = 1 << 16

#: Special tokens of a trained BPE (ids 0..5): bos, eos, pad, then the Llama 3 chat-template
#: tokens (header start/end, end of turn), each a single id so SFT data can use the template.
BPE_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>",
                      "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


_SAFE_FP = re.compile(r"[A-Za-z0-9._-]{1,64}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, cache_dir: str | os.PathLike,
                        fingerprint: str) -> HFTokenizer:
    """Train (or load from cache) a byte-level BPE with ``vocab_size`` ids in all.

    Special tokens :data:`BPE_SPECIAL_TOKENS` get ids 0..5 (``<|begin_of_text|>``,
    ``<|end_of_text|>``, ``<|pad|>``, then the Llama 3 chat tokens ``<|start_header_id|>``,
    ``<|end_header_id|>``, ``<|eot_id|>``), the 256 byte symbols follow, then merges. The vocabulary has exactly ``vocab_size`` ids unless
    the text is too small to learn that many merges (then fewer). Training is deterministic.

    The result is cached as ``cache_dir/bpe-<vocab_size>-<fingerprint>/tokenizer.json``
    (written atomically); a later call with the same fingerprint loads it without iterating
    ``texts``. A text longer than :data:`TRAIN_PIECE_CHARS` is given to the trainer in pieces
    cut before a space (:func:`text_pieces`: the byte-level pre-tokenizer's words are the same,
    so the merges are too, unless a piece had to be cut inside a run of that many characters
    without a space). ``fingerprint`` should identify the training text; one that is not a safe file
    name (``[A-Za-z0-9._-]``, at most 64 chars) is replaced by its SHA-256 prefix, and ``""``
    disables the cache (always train, write nothing).

    Raises:
        ConfigError: ``vocab_size`` < 262 (256 bytes + 6 special tokens).
    """
    if vocab_size < 256 + len(BPE_SPECIAL_TOKENS):
        raise ConfigError(f"tokenizer.vocab_size: {vocab_size} is too small for a byte-level BPE; "
                          f"set it to at least {256 + len(BPE_SPECIAL_TOKENS)} (256 bytes + "
                          f"{len(BPE_SPECIAL_TOKENS)} special tokens), e.g. 8192")
    bos, eos, pad = BPE_SPECIAL_TOKENS[:3]
    cache_file = None
    if fingerprint:
        fp = fingerprint if _SAFE_FP.fullmatch(fingerprint) else \
            hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        cache_file = Path(cache_dir) / f"bpe-{vocab_size}-{fp}" / "tokenizer.json"
        if cache_file.is_file():
            try:
                cached = HFTokenizer(cache_file, bos_token=bos, eos_token=eos, pad_token=pad)
                if all(cached.token_id(t) == i for i, t in enumerate(BPE_SPECIAL_TOKENS)):
                    return cached
            except ConfigError:
                pass  # a corrupt or outdated cache entry: train again and overwrite it

    from tokenizers import Tokenizer as _HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    notice(f"tokenizer: training a byte-level BPE of {vocab_size} ids on the training text"
           + (f" (once: cached in {cache_file.parent})" if cache_file else ""))

    tok = _HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((p for text in texts for p in text_pieces(text, TRAIN_PIECE_CHARS)),
                            trainer=trainer)
    data = tok.to_str(pretty=True).encode()
    if cache_file is None:
        return _uncached(data)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(cache_file, data)
    except OSError as exc:  # a read-only or full cache: the run goes on with the tokenizer in hand
        notice(f"warning: cannot cache the trained tokenizer in {cache_file.parent} "
               f"({exc.strerror or exc}); going on uncached (it is trained again at the next start)")
        return _uncached(data)
    return HFTokenizer(cache_file, bos_token=bos, eos_token=eos, pad_token=pad)


def _uncached(data: bytes) -> HFTokenizer:
    """An :class:`HFTokenizer` of the ``tokenizer.json`` bytes ``data``, through a temporary
    file (it reads the file when built)."""
    bos, eos, pad = BPE_SPECIAL_TOKENS[:3]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        path.write_bytes(data)
        return HFTokenizer(path, bos_token=bos, eos_token=eos, pad_token=pad)
