"""An incremental parser of one JSON Lines line too long to hold (``data prepare``'s long
documents, :mod:`llmforge.data.jsonl_lines`): the line is read from its file ``chunk`` bytes at
a time, a string value comes out as consecutive decoded pieces of about ``chunk`` characters,
and every other value is validated and dropped, so the parser holds one chunk whatever the
line's length.

Each piece is decoded by ``json``'s own string scanner (C), cut where no escape is split: never
inside ``\\n``, ``\\"``, ``\\\\`` or ``\\uXXXX``, and never between the two ``\\uXXXX`` of a
surrogate pair, so the pieces joined are the string ``json.loads`` gives for the whole line.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import IO, Iterator

__all__ = ["JsonLineError", "LineReader", "READ_CHUNK"]

READ_CHUNK = 1 << 20  # bytes read from the file at a time (and about the characters of a piece)

_NON_WS = re.compile(r"[^ \t\r\n]")  # JSON's whitespace
_TOKEN_END = re.compile(r'[ \t\r\n,:\[\]{}"]')  # what ends a number or a literal
_TYPES = {"{": "dict", "[": "list", '"': "str"}


class JsonLineError(ValueError):
    """The line is not valid JSON; the message says what was found (the caller names the file
    and line)."""


def _decode(segment: str) -> str:
    """The characters of a part of a JSON string body that splits no escape (json's scanner).

    Raises:
        JsonLineError: a bad escape or a control character (as ``json.loads`` refuses them).
    """
    try:
        return json.decoder.scanstring(f'"{segment}"', 1, True)[0]
    except ValueError as exc:
        raise JsonLineError(getattr(exc, "msg", str(exc)).removesuffix(" at") + " in a string") from None


def _safe_end(buf: str, lo: int, end: int) -> int:
    """The largest cut ``<= end`` in the string body ``buf[lo:end]`` (``lo``: a cut) that splits
    no escape and does not follow a high-surrogate ``\\uD800``-``\\uDBFF`` (whose low half may
    come next); ``lo`` when there is none yet (read more)."""
    while end > lo:
        b = buf.rfind("\\", max(lo, end - 12), end)  # an escape is <= 6 chars, a pair 12
        if b < 0:
            return end
        run = b
        while run > lo and buf[run - 1] == "\\":
            run -= 1
        if (b - run) % 2 == 1:  # an even run of backslashes: complete "\\" escapes
            return end
        # an escape starts at b: is it whole, and not half of a pair?
        if b + 1 < end and buf[b + 1] != "u":
            return end
        if b + 6 <= end:
            try:
                if not 0xD800 <= int(buf[b + 2:b + 6], 16) <= 0xDBFF:
                    return end
            except ValueError:
                return end  # a bad \u escape: json's scanner names it
        end = b  # cut before this escape; look again at what precedes it
    return lo


class LineReader:
    """The characters of one line of a binary file, from the file's position through its
    ``b"\\n"`` (the file is left just after it) or the file's end, decoded as UTF-8
    (``bom``: a UTF-8 BOM at the start dropped, as ``utf-8-sig``), ``chunk`` bytes at a time.

    Raises (from any method):
        UnicodeDecodeError: bytes that are not UTF-8.
        JsonLineError: the line is not valid JSON where a method expects a value.
    """

    def __init__(self, fh: IO[bytes], chunk: int = READ_CHUNK, bom: bool = False) -> None:
        self.fh, self.chunk = fh, max(1, chunk)
        self._decoder = codecs.getincrementaldecoder("utf-8-sig" if bom else "utf-8")()
        self.buf, self.pos, self.ended = "", 0, False

    def fill(self) -> bool:
        """Append the next chunk's characters to ``buf`` (dropping those before ``pos``);
        ``False`` at the end of the line."""
        while not self.ended:
            raw = self.fh.read(self.chunk)
            newline = raw.find(b"\n")  # the line's end: JSON text holds no raw newline
            if newline >= 0:
                self.fh.seek(newline + 1 - len(raw), 1)
                raw = raw[:newline + 1]
            self.ended = newline >= 0 or not raw
            text = self._decoder.decode(raw, final=self.ended)
            if text:
                self.buf, self.pos = self.buf[self.pos:] + text, 0
                return True
        return False

    def peek(self) -> str:
        """The next character that is not JSON whitespace (consumed up to it), ``""`` at the
        end of the line."""
        while True:
            found = _NON_WS.search(self.buf, self.pos)
            if found:
                self.pos = found.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self.fill():
                return ""

    def expect(self, char: str) -> None:
        """Consume ``char`` after optional whitespace.

        Raises:
            JsonLineError: something else is there."""
        got = self.peek()
        if got != char:
            raise JsonLineError(f"expected {char!r}, found {got[:1] or 'the end of the line'!r}")
        self.pos += 1

    def string_pieces(self) -> Iterator[str]:
        """The decoded pieces of the string whose opening quote was just consumed (each at most
        about ``chunk`` characters; some may be empty), through its closing quote.

        Raises:
            JsonLineError: a bad escape, a control character, or no closing quote."""
        while True:
            buf, lo = self.buf, self.pos
            quote = buf.find('"', lo)
            while quote >= 0:  # the first quote not escaped by an odd run of backslashes
                run = quote
                while run > lo and buf[run - 1] == "\\":
                    run -= 1
                if (quote - run) % 2 == 0:
                    break
                quote = buf.find('"', quote + 1)
            if quote >= 0:
                self.pos = quote + 1
                yield _decode(buf[lo:quote])
                return
            end = _safe_end(buf, lo, len(buf))
            if end > lo:
                self.pos = end
                yield _decode(buf[lo:end])
            if not self.fill():
                raise JsonLineError("a string is not closed before the end of the line")

    def skip_value(self) -> str:
        """Read and validate the next value without keeping it; returns its Python type's name
        (``str``, ``dict``, ``list``, ``int``, ``float``, ``bool``, ``NoneType``).

        Raises:
            JsonLineError: no valid value there. RecursionError: nested too deeply."""
        first = self.peek()
        if not first:
            raise JsonLineError("expected a value, found the end of the line")
        self.pos += 1
        if first == '"':
            for _ in self.string_pieces():
                pass
        elif first in "{[":
            close = "}" if first == "{" else "]"
            if self.peek() == close:
                self.pos += 1
            else:
                while True:
                    if first == "{":
                        self.expect('"')
                        for _ in self.string_pieces():
                            pass
                        self.expect(":")
                    self.skip_value()
                    nxt = self.peek()
                    self.pos += 1
                    if nxt == close:
                        break
                    if nxt != ",":
                        raise JsonLineError(f"expected ',' or {close!r}, found {nxt or 'the end of the line'!r}")
        else:
            self.pos -= 1
            return self._scalar()
        return _TYPES[first]

    def _scalar(self) -> str:
        token = ""
        while True:
            stop = _TOKEN_END.search(self.buf, self.pos)
            token += self.buf[self.pos:stop.start() if stop else len(self.buf)]
            if stop:
                self.pos = stop.start()
                break
            self.pos = len(self.buf)
            if not self.fill():
                break
        if not token:
            found = self.buf[self.pos:self.pos + 1] or "the end of the line"
            raise JsonLineError(f"expected a value, found {found!r}")
        try:
            return type(json.loads(token)).__name__
        except ValueError:
            raise JsonLineError(f"{token[:20]!r} is not a JSON value") from None

    def keys(self) -> Iterator[str]:
        """The keys of the object that starts here, each yielded with the reader at its value
        (which the caller reads before asking for the next key).

        Raises:
            JsonLineError: not an object, or a bad key or separator."""
        self.expect("{")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            self.expect('"')
            key = "".join(self.string_pieces())
            self.expect(":")
            yield key
            nxt = self.peek()
            self.pos += 1
            if nxt == "}":
                return
            if nxt != ",":
                raise JsonLineError(f"expected ',' or '}}', found {nxt or 'the end of the line'!r}")

    def finish(self) -> None:
        """Check that only whitespace is left on the line.

        Raises:
            JsonLineError: extra data after the value."""
        extra = self.peek()
        if extra:
            raise JsonLineError(f"extra data after the value ({extra!r})")

