"""The :class:`Tokenizer` interface every tokenizer kind implements (ids, encode/decode, save),
and the atomic file write their ``save`` and caches use."""

from __future__ import annotations

import json
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Iterator

__all__ = ["Tokenizer", "META_FILE", "text_pieces", "utf8_len"]

#: File written by :meth:`Tokenizer.save` that says how to load the directory.
META_FILE = "llmforge_tokenizer.json"


def text_pieces(text: Any, max_chars: int = 1 << 20) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``max_chars`` characters, each cut just before a
    space that follows a non-space character (searched back from ``max_chars`` to half of it;
    a hard cut at ``max_chars`` when there is none). Regex pre-tokenizers (byte-level BPE:
    GPT-2, Llama 3, tiktoken) start a new pre-token there, so encoding the pieces gives the ids
    of encoding the whole text.

    ``text``: a ``str``, or a text read as a stream (:class:`llmforge.data.jsonl_lines.LongText`:
    anything with ``pieces()``), cut at the same places as its whole string would be (a cut
    looks only at the ``max_chars`` characters after the previous one), holding at most about
    ``max_chars`` plus one of its pieces."""
    parts = (text,) if isinstance(text, str) else text.pieces()
    rest = ""
    for part in parts:
        text = rest + part if rest else part
        start = 0
        while len(text) - start > max_chars:
            end = start + max_chars
            cut = text.rfind(" ", start + max_chars // 2, end)
            while cut > start and text[cut - 1].isspace():
                cut = text.rfind(" ", start + max_chars // 2, cut)
            cut = cut if cut > start else end
            yield text[start:cut]
            start = cut
        rest = text[start:]
    yield rest


def utf8_len(text: Any, chunk: int = 1 << 20) -> int:
    """The UTF-8 byte length of ``text`` (lone surrogates counted as ``?``), encoded ``chunk``
    characters at a time so a long document is never copied whole as bytes; a streamed text
    (:class:`llmforge.data.jsonl_lines.LongText`) gives its counted ``utf8_bytes``."""
    if not isinstance(text, str):
        return text.utf8_bytes
    if text.isascii():
        return len(text)
    return sum(len(text[i:i + chunk].encode("utf-8", "replace")) for i in range(0, len(text), chunk))


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
