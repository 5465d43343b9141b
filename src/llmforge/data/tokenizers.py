"""Tokenizers: text to token ids and back, behind one small interface.

Three implementations share :class:`Tokenizer`:

* :class:`HFTokenizer` — a Hugging Face ``tokenizers`` ``tokenizer.json``;
* :class:`TiktokenTokenizer` — a tiktoken BPE rank file in the Llama 3 ``tokenizer.model``
  format, with Llama 3's split pattern and its 256 special tokens;
* :func:`train_bpe_tokenizer` — a byte-level BPE trained on the training text and cached.

:func:`build_tokenizer` picks one from a ``tokenizer:`` config; :func:`check_vocab` checks it
against the model's embedding rows. Ids are plain ``int``; ``vocab_size`` counts every id,
special tokens included (max id + 1). Special-token text inside ordinary text is encoded as
ordinary text, never as a special id; ``decode`` renders special ids as their text.

Each kind has its module (``tokenizer_base``, ``tokenizer_hf``, ``tokenizer_tiktoken``,
``tokenizer_bpe``); this one picks and loads them, and every name stays importable from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from llmforge.config.schema import TOKENIZER_TYPES  # listed once, with its key
from llmforge.data.tokenizer_base import META_FILE, Tokenizer, text_pieces, utf8_len
from llmforge.data.tokenizer_bpe import BPE_SPECIAL_TOKENS, TRAIN_PIECE_CHARS, train_bpe_tokenizer
from llmforge.data.tokenizer_hf import HFTokenizer
from llmforge.data.tokenizer_tiktoken import LLAMA3_PAT_STR, LLAMA3_SPECIAL_TOKENS, TiktokenTokenizer
from llmforge.errors import ConfigError
from llmforge.paths import is_special_file

__all__ = ["Tokenizer", "HFTokenizer", "TiktokenTokenizer", "train_bpe_tokenizer",
           "build_tokenizer", "check_vocab", "load_saved", "LLAMA3_PAT_STR",
           "LLAMA3_SPECIAL_TOKENS", "BPE_SPECIAL_TOKENS", "TOKENIZER_TYPES", "META_FILE"]


def _regular(path: Path) -> None:
    """Raises ConfigError when ``path`` exists but is not a regular file (a named pipe in a
    shared run's tokenizer folder would make reading it block for ever)."""
    if is_special_file(path):
        raise ConfigError(f"{path} is not a regular file (a named pipe, device or folder); save "
                          "the tokenizer again")


def load_saved(directory: str | os.PathLike) -> Tokenizer:
    """Rebuild the tokenizer that :meth:`Tokenizer.save` wrote into ``directory``.

    Raises:
        ConfigError: ``directory`` holds no (valid) ``llmforge_tokenizer.json`` or its files.
    """
    d = Path(directory)
    meta_path = d / META_FILE
    try:
        _regular(meta_path)
        meta = json.loads(meta_path.read_text())
        kind, file = meta["type"], d / meta["file"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{d} does not hold a saved llmforge tokenizer ({meta_path} is missing "
                          f"or invalid: {e}); save one with Tokenizer.save") from e
    # a crafted meta file must not make llmforge read a file outside the tokenizer's folder
    if (not isinstance(meta["file"], str) or Path(meta["file"]).name != meta["file"]
            or meta["file"] in ("", ".", "..") or not file.resolve().is_relative_to(d.resolve())):
        raise ConfigError(f"{meta_path}: file={meta['file']!r} is not a file of {d}; refused (a saved "
                          "tokenizer only reads its own folder): save the tokenizer again")
    _regular(file)
    if kind == "huggingface":
        return HFTokenizer(file, bos_token=meta.get("bos_token"),
                           eos_token=meta.get("eos_token"), pad_token=meta.get("pad_token"))
    if kind == "tiktoken":
        return TiktokenTokenizer(file)
    raise ConfigError(f"{meta_path}: unknown tokenizer type {kind!r}; expected huggingface "
                      "or tiktoken")


def _lazy_texts(factory: Callable[[], Iterable[str]] | None,
                max_bytes: int | None) -> Iterator[str]:
    """Texts of ``factory()`` up to ``max_bytes`` UTF-8 bytes, a long text in the pieces of
    :func:`text_pieces` (:data:`TRAIN_PIECE_CHARS`), so neither the count nor the cut copies a
    whole document; being a generator, it calls the factory only when first iterated (a cache
    hit never reads the data)."""
    if factory is None:
        raise ValueError("build_tokenizer: tokenizer.type train_bpe needs texts_factory "
                         "when the tokenizer is not cached yet")
    left = max_bytes
    for text in factory():
        for piece in text_pieces(text, TRAIN_PIECE_CHARS):
            if left is not None:
                size = utf8_len(piece)
                if size >= left:
                    yield piece[:left] if piece.isascii() else \
                        piece.encode("utf-8")[:left].decode("utf-8", errors="ignore")
                    return
                left -= size
            yield piece


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    try:
        return getattr(cfg, key, default)
    except Exception:
        return default


def build_tokenizer(cfg: Any, texts_factory: Callable[[], Iterable[str]] | None,
                    cache_dir: str | os.PathLike, fingerprint: str = "") -> Tokenizer:
    """Build the tokenizer a ``tokenizer:`` config (TokenizerConfig or DictConfig) asks for.

    ``texts_factory`` returns the training text for ``train_bpe``; it is called only when the
    BPE is not cached, and at most ``tokenizer.train_max_bytes`` UTF-8 bytes of it are used
    (0 or null: all of it).
    ``fingerprint`` names the cache entry (see :func:`train_bpe_tokenizer`).

    Raises:
        ConfigError: unknown ``tokenizer.type``, missing/nonexistent/unparsable
            ``tokenizer.path``, or ``tokenizer.vocab_size`` < 259 for train_bpe.
    """
    kind = _cfg_get(cfg, "type")
    if kind not in TOKENIZER_TYPES:
        raise ConfigError(f"tokenizer.type: unknown tokenizer type {kind!r}; use one of "
                          f"{', '.join(TOKENIZER_TYPES)}")
    if kind == "train_bpe":
        vocab_size = int(_cfg_get(cfg, "vocab_size", 8192))
        max_bytes = _cfg_get(cfg, "train_max_bytes", None)
        texts = _lazy_texts(texts_factory, int(max_bytes) if max_bytes else None)
        return train_bpe_tokenizer(texts, vocab_size, cache_dir, fingerprint)
    path = _cfg_get(cfg, "path")
    what = "a Hugging Face tokenizer.json" if kind == "huggingface" else \
        "a Llama 3 tokenizer.model (tiktoken BPE)"
    if not path:
        raise ConfigError(f"tokenizer.path: required for tokenizer.type: {kind}; set it to "
                          f"{what}, or use tokenizer.type: train_bpe")
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise ConfigError(f"tokenizer.path: {path} does not exist (resolved to {p.absolute()}); "
                          f"set it to {what}")
    try:
        return HFTokenizer(p) if kind == "huggingface" else TiktokenTokenizer(p)
    except ConfigError as e:
        raise ConfigError(f"tokenizer.path: {e}") from e


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Check the model has an embedding row for every token id.

    Raises:
        ConfigError: ``tokenizer.vocab_size`` > ``model_vocab_size``.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model_vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} ids, tokenizer.type {tokenizer.type}); set "
            f"model.vocab_size to at least {tokenizer.vocab_size} or change the tokenizer "
            "settings (tokenizer:)")
