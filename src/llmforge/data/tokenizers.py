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
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator

from llmforge.errors import ConfigError

__all__ = ["Tokenizer", "HFTokenizer", "TiktokenTokenizer", "train_bpe_tokenizer",
           "build_tokenizer", "check_vocab", "load_saved", "LLAMA3_PAT_STR",
           "LLAMA3_SPECIAL_TOKENS", "BPE_SPECIAL_TOKENS", "TOKENIZER_TYPES", "META_FILE"]

#: Llama 3's pre-tokenizer split pattern (Meta's llama3 ``tokenizer.py``).
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_BASIC_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]
#: Llama 3's 256 special tokens, in id order after the base ranks.
LLAMA3_SPECIAL_TOKENS: list[str] = _LLAMA3_BASIC_SPECIALS + [
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_BASIC_SPECIALS))
]
#: Special tokens of a trained BPE (ids 0..5): bos, eos, pad, then the Llama 3 chat-template
#: tokens (header start/end, end of turn), each a single id so SFT data can use the template.
BPE_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>",
                      "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
from llmforge.config.schema import TOKENIZER_TYPES  # noqa: E402  (listed once, with its key)
#: File written by :meth:`Tokenizer.save` that says how to load the directory.
META_FILE = "llmforge_tokenizer.json"

_BOS_NAMES = ["<|begin_of_text|>", "<s>", "<|bos|>", "<bos>", "[BOS]", "<|startoftext|>",
              "<|endoftext|>"]
_EOS_NAMES = ["<|end_of_text|>", "</s>", "<|eos|>", "<eos>", "[EOS]", "<|endoftext|>"]
_PAD_NAMES = ["<|pad|>", "<pad>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>"]


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set ``type`` (the ``tokenizer.type`` they come from)."""

    type: ClassVar[str] = ""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (max id + 1)."""

    @property
    @abstractmethod
    def bos_id(self) -> int:
        """Id of the beginning-of-text token."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """Id of the end-of-text token."""

    @property
    @abstractmethod
    def pad_id(self) -> int | None:
        """Id of a padding token distinct from ``eos_id``, or None when there is none."""

    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Ids of ``text`` with no special tokens added or parsed."""

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (no bos/eos), using the library's fast batch encoder."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special ids appear as their token text."""

    @abstractmethod
    def _save_files(self, directory: Path) -> dict[str, Any]:
        """Write the tokenizer's files into ``directory``; return the metadata to store."""

    def token_id(self, token: str) -> int | None:
        """Id of the single special (or added) token ``token`` (e.g. ``"<|eot_id|>"``), or None
        when the vocabulary has no such single token."""
        return None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``, optionally framed by ``bos_id``/``eos_id``.

        Special-token text inside ``text`` (e.g. ``"<|end_of_text|>"``) is encoded as ordinary
        text.
        """
        ids = self._encode(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer files and ``llmforge_tokenizer.json`` into ``directory``
        (created if missing); :func:`load_saved` rebuilds an identical tokenizer from it."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta = {"type": self.type, **self._save_files(d)}
        _atomic_write(d / META_FILE, json.dumps(meta, indent=2).encode())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_id}, " \
               f"eos={self.eos_id}, pad={self.pad_id})"


class _StoredIds(Tokenizer):
    """Implements the id properties from ``_vocab_size``, ``_bos``, ``_eos``, ``_pad``."""

    _vocab_size: int
    _bos: int
    _eos: int
    _pad: int | None
    vocab_size = property(lambda self: self._vocab_size, doc=Tokenizer.vocab_size.__doc__)
    bos_id = property(lambda self: self._bos, doc=Tokenizer.bos_id.__doc__)
    eos_id = property(lambda self: self._eos, doc=Tokenizer.eos_id.__doc__)
    pad_id = property(lambda self: self._pad, doc=Tokenizer.pad_id.__doc__)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class HFTokenizer(_StoredIds):
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    BOS/EOS/PAD are found by name among common tokens (``<|begin_of_text|>``/``<|end_of_text|>``,
    ``<s>``/``</s>``, ``<|endoftext|>`` for both, ``<|bos|>``...) unless named by ``bos_token``,
    ``eos_token``, ``pad_token``. Encoding never runs the file's post-processor specials
    (``add_special_tokens=False``) and never parses special-token text.

    Raises:
        ConfigError: the file is missing or not a tokenizer.json, or BOS/EOS cannot be found.
    """

    type = "huggingface"

    def __init__(self, path: str | os.PathLike, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path} does not exist or is not a file; "
                              "point it at a Hugging Face tokenizer.json")
        try:
            self._tok = _HFTok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError(f"{self.path} does not parse as a Hugging Face tokenizer.json "
                              f"(the format tokenizer.type: huggingface expects): {e}; for a "
                              "Llama 3 tokenizer.model use tokenizer.type: tiktoken") from e
        self._tok.encode_special_tokens = True  # special-token text is ordinary text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self.bos_token = self._find(vocab, bos_token, _BOS_NAMES, "BOS", "bos_token")
        self.eos_token = self._find(vocab, eos_token, _EOS_NAMES, "EOS", "eos_token")
        self._bos, self._eos = vocab[self.bos_token], vocab[self.eos_token]
        pad = self._find(vocab, pad_token, _PAD_NAMES, "PAD", "pad_token", required=False)
        self.pad_token = pad if pad is not None and vocab[pad] != self._eos else None
        self._pad = vocab[self.pad_token] if self.pad_token is not None else None

    def _find(self, vocab: dict[str, int], given: str | None, names: list[str], what: str,
              arg: str, required: bool = True) -> str | None:
        if given is not None:
            if given not in vocab:
                raise ConfigError(f"{self.path}: {arg}={given!r} is not in the vocabulary")
            return given
        for name in names:
            if name in vocab:
                return name
        if required:
            raise ConfigError(f"{self.path}: no {what} token found (looked for {names}); use a "
                              f"tokenizer.json that defines one, or pass {arg}= to HFTokenizer")
        return None

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        _atomic_write(directory / "tokenizer.json", self._tok.to_str(pretty=True).encode())
        return {"file": "tokenizer.json", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "pad_token": self.pad_token}


def _parse_tiktoken_bpe(path: Path) -> dict[bytes, int]:
    """Ranks of a ``base64(token) rank`` file, validated so tiktoken can use them.

    Same format and parsing as ``tiktoken.load.load_tiktoken_bpe``, which is not called
    because it caches local files in a temp dir keyed by path only (stale after edits).
    """
    try:
        contents = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e}") from e
    expected = ("the format tokenizer.type: tiktoken expects, a Llama 3 tokenizer.model with "
                "lines 'base64(token_bytes) rank'")
    if contents.lstrip().startswith(b"{"):
        raise ConfigError(f"{path} does not parse as a tiktoken BPE file ({expected}); it looks "
                          "like JSON: use tokenizer.type: huggingface for a tokenizer.json")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(contents.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except Exception as e:
            raise ConfigError(f"{path} does not parse as a tiktoken BPE file ({expected}): "
                              f"line {lineno}: {line[:80]!r} ({e})") from e
    n = len(ranks)
    problem = None
    if n == 0:
        problem = "it holds no ranks"
    elif sorted(ranks.values()) != list(range(n)):
        problem = f"ranks are not the distinct numbers 0..{n - 1} (or a token repeats)"
    elif any(bytes([b]) not in ranks for b in range(256)):
        problem = "not all 256 single bytes have a rank"
    if problem:
        raise ConfigError(f"{path} does not parse as a tiktoken BPE file ({expected}): {problem}")
    return ranks


class TiktokenTokenizer(_StoredIds):
    """A Llama 3 style tiktoken tokenizer from a ``tokenizer.model`` rank file.

    Uses :data:`LLAMA3_PAT_STR` and appends :data:`LLAMA3_SPECIAL_TOKENS` after the base ranks:
    bos = ``<|begin_of_text|>`` (id n_base), eos = ``<|end_of_text|>`` (n_base + 1),
    pad = ``<|finetune_right_pad_id|>`` (n_base + 4); vocab_size = n_base + 256 (128256 for
    Llama 3).

    Raises:
        ConfigError: the file is missing or not a valid rank file.
    """

    type = "tiktoken"

    def __init__(self, path: str | os.PathLike) -> None:
        import tiktoken

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path} does not exist or is not a file; "
                              "point it at a Llama 3 tokenizer.model (tiktoken BPE)")
        self._ranks = _parse_tiktoken_bpe(self.path)
        n_base = len(self._ranks)
        self.special_tokens = {t: n_base + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.encoding = tiktoken.Encoding(
            name=f"llama3-{self.path.name}", pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=self._ranks, special_tokens=self.special_tokens)
        self.n_base = n_base
        self._vocab_size = n_base + len(LLAMA3_SPECIAL_TOKENS)
        self._bos = self.special_tokens["<|begin_of_text|>"]
        self._eos = self.special_tokens["<|end_of_text|>"]
        self._pad: int | None = self.special_tokens["<|finetune_right_pad_id|>"]

    def token_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)

    def _encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(list(ids))

    def _save_files(self, directory: Path) -> dict[str, Any]:
        lines = sorted(self._ranks.items(), key=lambda kv: kv[1])
        data = b"".join(base64.b64encode(tok) + b" %d\n" % r for tok, r in lines)
        _atomic_write(directory / "tokenizer.model", data)
        return {"file": "tokenizer.model"}


def load_saved(directory: str | os.PathLike) -> Tokenizer:
    """Rebuild the tokenizer that :meth:`Tokenizer.save` wrote into ``directory``.

    Raises:
        ConfigError: ``directory`` holds no (valid) ``llmforge_tokenizer.json`` or its files.
    """
    d = Path(directory)
    meta_path = d / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
        kind, file = meta["type"], d / meta["file"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{d} does not hold a saved llmforge tokenizer ({meta_path} is missing "
                          f"or invalid: {e}); save one with Tokenizer.save") from e
    if kind == "huggingface":
        return HFTokenizer(file, bos_token=meta.get("bos_token"),
                           eos_token=meta.get("eos_token"), pad_token=meta.get("pad_token"))
    if kind == "tiktoken":
        return TiktokenTokenizer(file)
    raise ConfigError(f"{meta_path}: unknown tokenizer type {kind!r}; expected huggingface "
                      "or tiktoken")


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
    ``texts``. ``fingerprint`` should identify the training text; one that is not a safe file
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

    tok = _HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(iter(texts), trainer=trainer)
    data = tok.to_str(pretty=True).encode()
    if cache_file is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tokenizer.json"
            path.write_bytes(data)
            return HFTokenizer(path, bos_token=bos, eos_token=eos, pad_token=pad)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(cache_file, data)
    return HFTokenizer(cache_file, bos_token=bos, eos_token=eos, pad_token=pad)


def _lazy_texts(factory: Callable[[], Iterable[str]] | None,
                max_bytes: int | None) -> Iterator[str]:
    """Texts of ``factory()`` up to ``max_bytes`` UTF-8 bytes; being a generator, it calls the
    factory only when first iterated (a cache hit never reads the data)."""
    if factory is None:
        raise ValueError("build_tokenizer: tokenizer.type train_bpe needs texts_factory "
                         "when the tokenizer is not cached yet")
    left = max_bytes
    for text in factory():
        if left is not None:
            raw = text.encode("utf-8")
            if len(raw) >= left:
                yield raw[:left].decode("utf-8", errors="ignore")
                return
            left -= len(raw)
        yield text


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
