"""Checks of what a prepared folder's ``manifest.json`` says before anything acts on it.

A manifest is input like any other: edited by hand, truncated, or crafted. These checks make
every field the reader uses the type it must be (one ``error:`` line naming the file and the
field instead of a ``KeyError`` or ``TypeError``), and keep every shard path inside the
folder: a ``file`` that is absolute, holds ``..``, or is a symlink resolving outside the folder
is refused, so a manifest can never make llmforge read (or stat, or hash) another file.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from pathlib import Path, PurePosixPath
from typing import Any

from llmforge.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "llmforge-tokens/1"
DTYPES = ("uint16", "uint32")  # what ``data prepare`` writes (packing.token_dtype)


def _short(value: Any) -> str:
    """``repr(value)`` cut to 80 characters and 6 levels: a value nested hundreds deep that
    ``json`` still parsed would make ``repr`` recurse past the limit (issue 26.7)."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()  # Python 3.11: no keyword arguments
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 6, 80, 80


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_manifest(path: str | Path, manifest: Any) -> None:
    """Refuse a manifest whose fields have the wrong type or value.

    Args:
        path: the manifest file (named in the message).
        manifest: its parsed JSON (``format`` and ``complete`` already checked by the caller).

    Raises:
        DataError: names ``path`` and the field, e.g. ``splits.train.shards[0].tokens``.
    """
    def bad(field: str, want: str, got: Any) -> DataError:
        return DataError(f"data.path: {path}: {field} must be {want}, got {_short(got)}; the manifest "
                         "was edited or damaged: run `llmforge data prepare` again into an empty folder")

    if manifest.get("dtype") not in DTYPES:
        raise bad("dtype", " or ".join(DTYPES), manifest.get("dtype"))
    tok = manifest.get("tokenizer")
    if not isinstance(tok, dict):
        raise bad("tokenizer", "an object", tok)
    if not isinstance(tok.get("fingerprint"), str):
        raise bad("tokenizer.fingerprint", "a string", tok.get("fingerprint"))
    if not _is_count(tok.get("vocab_size")):
        raise bad("tokenizer.vocab_size", "an integer >= 0", tok.get("vocab_size"))
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        raise bad("splits", "an object of splits (train, val)", splits)
    for name, info in splits.items():
        where = f"splits.{name}"
        if not isinstance(info, dict) or not isinstance(info.get("shards"), list):
            raise bad(f"{where}.shards", "a list", info.get("shards") if isinstance(info, dict) else info)
        if not _is_count(info.get("tokens", 0)):
            raise bad(f"{where}.tokens", "an integer >= 0", info.get("tokens"))
        for i, shard in enumerate(info["shards"]):
            key = f"{where}.shards[{i}]"
            if not isinstance(shard, dict):
                raise bad(key, "an object {file, tokens, sha256}", shard)
            if not isinstance(shard.get("file"), str):
                raise bad(f"{key}.file", "a path relative to the folder", shard.get("file"))
            if not _is_count(shard.get("tokens")):
                raise bad(f"{key}.tokens", "an integer >= 0", shard.get("tokens"))
            if not isinstance(shard.get("sha256"), str):
                raise bad(f"{key}.sha256", "a hex string", shard.get("sha256"))


def shard_path(root: Path, file: str, manifest: str | None = None) -> Path:
    """``root / file``, refused unless it stays inside ``root`` (symlinks followed).

    Args:
        manifest: the manifest named in the message (default ``root/manifest.json``; a URL for
            a corpus copied from an object store).

    Raises:
        DataError: ``file`` is absolute, holds ``..``, or resolves outside ``root``.
    """
    rel = PurePosixPath(file)
    path = root / file
    if rel.is_absolute() or Path(file).is_absolute() or ".." in rel.parts:
        raise DataError(f"data.path: {manifest or root / 'manifest.json'} lists the shard {file!r}, "
                        f"which is not a path inside its folder; refused (a manifest only names files of its "
                        "own folder): run `llmforge data prepare` again into an empty folder")
    if path.exists() and not path.resolve().is_relative_to(root.resolve()):
        raise DataError(f"data.path: shard {path} is a link to {path.resolve()}, outside {root}; "
                        "refused (a prepared folder only reads its own files): replace the link "
                        "with the file, or run `llmforge data prepare` again")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in 4 MiB chunks (no copy of the file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a prepared folder.

    Raises:
        DataError: no manifest (not prepared), an unreadable one, or an interrupted prepare.
    """
    root = Path(root)
    path = root / MANIFEST
    if not path.exists():
        raise DataError(f"data.path: {root} has no {MANIFEST}, so it is not a prepared corpus; "
                        f"create it with `llmforge data prepare CONFIG_OR_SOURCE {root}`")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"data.path: cannot read {path} ({exc}); check its permissions") from exc
    return parse_manifest(data, root)


def parse_manifest(data: bytes, root: str | Path) -> dict[str, Any]:
    """Parse and check the bytes of ``root``'s manifest (a folder or a URL).

    Raises:
        DataError: not JSON, another format, or an interrupted prepare (``complete`` unset).
    """
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply to parse
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise DataError(f"data.path: {root}/{MANIFEST} is not valid JSON ({why}); run `llmforge "
                        "data prepare` again into an empty folder") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"data.path: {root}/{MANIFEST} has format {_short(got)}, expected "
                        f"{FORMAT!r}; prepare the corpus again with this llmforge")
    if not manifest.get("complete"):
        raise DataError(f"data.path: {root} is an interrupted `llmforge data prepare`; run the "
                        "same command again to finish it (finished shards are kept)")
    check_manifest(f"{root}/{MANIFEST}", manifest)
    return manifest
