"""Local JSON Lines read one line at a time for ``llmforge data prepare`` (not ``datasets``),
and a line too long to hold read as a stream (:class:`LongText`).

A line of at most :data:`LONG_LINE_BYTES` is read whole and parsed by ``json.loads`` (its
bytes, text and value: ~2x its size for a moment). A longer one is parsed incrementally
(:class:`llmforge.data.jsonl_parse.LineReader`) and its text becomes a :class:`LongText`: its
size and cleaned length are counted on a first pass, and its characters are read again from
the file, in pieces of about :data:`~llmforge.data.jsonl_parse.READ_CHUNK` characters, each time
it is hashed, trained on or tokenized, so no process holds the document whole (issue 50.7).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from llmforge.data.jsonl_parse import READ_CHUNK, JsonLineError, LineReader
from llmforge.data.tokenizer_base import utf8_len
from llmforge.errors import DataError

__all__ = ["LONG_LINE_BYTES", "LongText", "Rows", "clean_pieces", "jsonl_rows", "no_surrogates", "not_text"]

LONG_LINE_BYTES = 4 << 20  # a longer line is streamed (LongText); a shorter one read whole
_BLANK = object()  # a long line of JSON whitespace: skipped like a blank short line


_SURROGATE = re.compile("[\ud800-\udfff]")


def no_surrogates(text: str) -> str:
    """``text`` with every unpaired surrogate (a JSON ``\\ud800`` escape alone: no UTF-8 for it,
    so no tokenizer takes it) replaced by U+FFFD, as undecodable bytes are."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def clean_pieces(pieces: Iterable[str]) -> Iterator[str]:
    """What :func:`llmforge.data.sources.clean_text` makes of the pieces' concatenation, in
    pieces: a leading BOM removed, CRLF and CR turned into LF (a CR at a piece's end waits for
    the next piece's first character), unpaired surrogates replaced (:func:`no_surrogates`;
    the parser never splits a pair between pieces)."""
    first, carry = True, ""
    for piece in pieces:
        if first and piece:
            first = False
            piece = piece[1:] if piece[0] == "\ufeff" else piece
        piece, carry = carry + piece, ""
        if piece.endswith("\r"):
            piece, carry = piece[:-1], "\r"
        if "\r" in piece:
            piece = piece.replace("\r\n", "\n").replace("\r", "\n")
        if piece:
            yield no_surrogates(piece)
    if carry:
        yield "\n"


@dataclass(frozen=True)
class LongText:
    """The cleaned text of the ``key_index``-th key of line ``number`` (1-based; starting at byte
    ``offset``) of the local jsonl ``path``, read from the file in pieces by :meth:`pieces`.

    Stands for a ``str`` where ``data prepare`` reads documents: ``len()`` (characters),
    ``isspace()``, ``utf8_bytes`` (UTF-8 bytes, as :func:`~llmforge.data.tokenizer_base.utf8_len`);
    :func:`~llmforge.data.tokenizer_base.text_pieces` cuts its pieces as it cuts a ``str``. It
    pickles as these fields, so a tokenizing worker reads the file itself.
    """

    path: str
    offset: int
    number: int
    key_index: int
    chars: int
    utf8_bytes: int
    blank: bool
    stat: tuple[int, int]  # (size, mtime_ns) of the file when it was first read
    chunk: int = READ_CHUNK

    def __len__(self) -> int:
        return self.chars

    def isspace(self) -> bool:
        """Whether the text is all whitespace (``str.isspace``; ``False`` when empty)."""
        return self.blank

    def pieces(self) -> Iterator[str]:
        """The cleaned text in consecutive non-empty pieces of about ``chunk`` characters.

        Raises:
            DataError: the file changed since it was first read.
        """
        with open(self.path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if (st.st_size, st.st_mtime_ns) != self.stat:
                raise DataError(f"data: {self.path} changed while `data prepare` read it; run the "
                                "same command again when it no longer changes")
            fh.seek(self.offset)
            reader = LineReader(fh, self.chunk, bom=self.number == 1)
            for i, _ in enumerate(reader.keys()):  # validated by the first pass
                if i == self.key_index:
                    reader.expect('"')
                    yield from clean_pieces(reader.string_pieces())
                    return
                reader.skip_value()


class Rows:
    """Rows made anew by ``make()`` at each pass (a plain iterable in place of a
    ``datasets.IterableDataset``: the documents of local jsonl that ``data prepare`` reads)."""

    def __init__(self, make: Callable[[], Iterator[dict]]) -> None:
        self._make = make

    def __iter__(self) -> Iterator[dict]:
        return iter(self._make())


def _long_text(fh: Any, name: str, number: int, offset: int, text_field: str, first: bool,
               chunk: int) -> Any:
    """Read line ``number`` (at ``offset``) of ``fh`` incrementally: validate it and count its
    text; the file is left at the next line. Returns its :class:`LongText`, ``None`` (no or a
    null ``text_field``) or ``_BLANK`` (only JSON whitespace; a long line of other Unicode
    spaces, which a short line's ``isspace()`` skips, is not JSON here).

    Raises:
        DataError: as :func:`jsonl_rows`. UnicodeDecodeError: not UTF-8.
    """
    reader = LineReader(fh, chunk, bom=number == 1)
    keys: list[str] = []
    found: Optional[tuple[int, Any]] = None
    try:
        head = reader.peek()
        if not head:
            return _BLANK
        if head != "{":  # valid JSON but not an object is a missing column, as json.loads + check
            kind = reader.skip_value()
            reader.finish()
            raise DataError(f"data.text_field: column '{text_field}' not found in {name} line "
                            f"{number}; it has {kind}")
        for i, key in enumerate(reader.keys()):
            keys.append(key)
            if key != text_field:
                reader.skip_value()
            elif reader.peek() != '"':  # a later duplicate key wins, as in json.loads
                found = (i, reader.skip_value())
            else:
                reader.pos += 1
                chars = size = 0
                blank = True
                for piece in clean_pieces(reader.string_pieces()):
                    chars, size = chars + len(piece), size + utf8_len(piece)
                    blank = blank and piece.isspace()
                found = (i, (chars, size, blank))
        reader.finish()
    except JsonLineError as exc:
        raise DataError(f"data: {name} line {number} is not valid JSON ({exc}); fix or drop the "
                        "line") from None
    except RecursionError:
        raise DataError(f"data: {name} line {number} is not valid JSON (nested too deeply); fix or "
                        "drop the line") from None
    if found is None and first:
        raise DataError(f"data.text_field: column '{text_field}' not found in {name} line {number}; "
                        f"it has {sorted(set(keys))}")
    if found is None or found[1] == "NoneType":
        return None
    if isinstance(found[1], str):  # its type's name: the value was skipped, not kept
        raise not_text(found[1], f"in {name} line {number}")
    chars, size, blank = found[1]
    st = os.fstat(fh.fileno())
    return LongText(name, offset, number, found[0], chars, size, blank or not chars,
                    (st.st_size, st.st_mtime_ns), chunk)


def jsonl_rows(files: list[str], text_field: str, long_line: Optional[int] = None,
               chunk: Optional[int] = None) -> Iterator[dict]:
    """``{text_field: value}`` of each line of ``files``, one line in memory at a time: the raw
    value of a line of at most ``long_line`` bytes (default :data:`LONG_LINE_BYTES`), a
    :class:`LongText` (read ``chunk`` bytes at a time) of a longer one.

    Why not ``datasets``' json builder: for a line of N bytes it holds the bytes, a pre-scan's
    parsed rows, the Arrow table and the Python string together (~4-5 N of peak RSS; issue 26).

    Raises:
        DataError: a line that is not a JSON object, or one without ``text_field`` (named with
            the file, the line and the keys it has), or a long line's non-string value (a
            short line's raw value is checked where it is cleaned, by
            :func:`llmforge.data.sources.clean_text`).
        UnicodeDecodeError: a file that is not UTF-8 (:func:`llmforge.data.sources.read_rows`
            names the line).
    """
    long_line = LONG_LINE_BYTES if long_line is None else long_line
    chunk = READ_CHUNK if chunk is None else chunk
    first = True  # the first row of all: its keys are the columns
    for name in files:
        # bytes split at b"\n" only (a lone \r stays in its line), decoded once the line is
        # whole: a text-mode readline joined its chunks into the str beside them (~2.6x a long
        # line's size at the peak, ~2x this way); utf-8-sig drops a BOM at the file's start
        with open(name, "rb") as fh:
            number = offset = 0
            while raw := fh.readline(long_line + 1):
                number += 1
                if len(raw) > long_line and not raw.endswith(b"\n"):
                    del raw  # too long to hold: read again, incrementally
                    fh.seek(offset)
                    value = _long_text(fh, name, number, offset, text_field, first, chunk)
                    offset = fh.tell()
                    if value is not _BLANK:
                        first = False
                        yield {text_field: value}
                    continue
                offset += len(raw)
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                del raw
                if line.isspace():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
                    why = exc if isinstance(exc, ValueError) else "nested too deeply"
                    raise DataError(f"data: {name} line {number} is not valid JSON ({why}); fix or "
                                    "drop the line") from None
                del line  # the parsed value alone while it is tokenized
                # a key missing from the first row is a missing column (as datasets infers its
                # columns from the first rows); from a later row, a null (dropped) like Arrow's
                if not isinstance(row, dict) or (text_field not in row and first):
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise DataError(f"data.text_field: column '{text_field}' not found in {name} "
                                    f"line {number}; it has {keys}")
                first = False
                value = row.pop(text_field, None)
                del row
                yield {text_field: value}  # checked and cleaned by sources.clean_text


def not_text(kind: str, what: str) -> DataError:
    """The error of a non-string document (``kind``: its type's name; ``what``: a preview of
    the value or where it is), for every reader (:func:`llmforge.data.sources.clean_text`)."""
    return DataError(f"data.text_field: found a {kind} value ({what}) where text was expected; "
                     "point data.text_field at a string column")
