"""Reading MDS folders (mosaicml-streaming's format, what LLM Foundry trains on) for
``llmforge data prepare``.

mosaicml-streaming 0.13.0 cannot be installed beside this stack (it pins ``transformers<5`` and
``numpy<2.2`` and pulls torchvision, which moves torch), so this module reads the documented
format itself (streaming's ``docs/source/preparing_datasets/dataset_format.md`` and
``streaming/base/format/mds``):

- ``FOLDER/index.json``: ``{"version": 2, "shards": [{"format": "mds", "column_names",
  "column_encodings", "column_sizes" (bytes, null = variable), "compression" (null, ``gz``,
  ``bz2``, ``zstd``, ``br``, ``snappy``, with an optional ``:level``), "raw_data": {"basename"},
  "zip_data": {"basename"} | null, "samples"}, ...]}``.
- a raw shard: ``uint32 n``, ``n + 1`` uint32 byte offsets (absolute; sample ``i`` is
  ``[off[i], off[i+1])``), then the samples. A sample is the uint32 sizes of its variable-size
  columns, then each column's bytes in ``column_names`` order.
- encodings read: ``str`` (UTF-8), ``bytes``, ``int`` (int64), the numpy scalars (``int32``,
  ``uint16``, ...), ``str_int``, ``json``, ``ndarray[:DTYPE[:SHAPE]]`` (dynamic dtype: one byte
  code; dynamic shape: one byte ``ndim << 2 | shape dtype code``, then the shape). Other
  columns (images, ``pkl``) are skipped unread, never unpickled.

A folder is one split (``index.json`` in it) or a parent of split folders (``train/index.json``,
``val/index.json``: LLM Foundry's layout, ``data.split`` / ``data.val_split`` choose).
"""

from __future__ import annotations

import bz2
import gzip
import json
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional

import fsspec
import numpy as np

from llmforge.data.documents import DocumentSplits
from llmforge.data.remote import plain_options
from llmforge.data.sources import hash_str, held_out
from llmforge.errors import DataError

INDEX = "index.json"

_NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                   33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
_SCALARS = {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "float32", "float64"}
TOKENS_BYTES_DTYPE = np.int64
"""dtype of a ``bytes``-encoded ``tokens`` column (LLM Foundry's ``concat_tokens`` wrote
``np.int64`` ids as bytes before it switched to ``ndarray:int32``)."""


def _read(path: str, storage_options: Optional[dict] = None) -> bytes:
    if "://" in path:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            return f.read()
    return Path(path).read_bytes()


def _exists(path: str, storage_options: Optional[dict] = None) -> bool:
    if "://" in path:
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        return fs.exists(root)
    return Path(path).is_file()


def is_mds(path: Any, storage_options: Optional[dict] = None) -> bool:
    """Whether ``path`` (a folder or URL) is an MDS split (``index.json`` in it) or holds MDS
    split folders (``*/index.json``, local folders only)."""
    if not isinstance(path, str) or not path:
        return False
    base = path.rstrip("/")
    try:
        if _exists(f"{base}/{INDEX}", storage_options):
            return True
    except (OSError, ValueError, ImportError):
        return False
    return "://" not in path and Path(path).is_dir() and any(Path(path).glob(f"*/{INDEX}"))


def split_folder(root: str, split: str, storage_options: Optional[dict] = None) -> str:
    """The MDS folder of ``split``: ``root`` itself when it holds ``index.json`` (one split;
    only ``train`` is then known), else ``root/split``.

    Raises:
        DataError: no such split (names the splits there).
    """
    base = root.rstrip("/")
    if _exists(f"{base}/{INDEX}", storage_options):
        if split != "train":
            raise DataError(f"data.val_split: {root} is one MDS split (index.json in it), so it has "
                            f"no '{split}' split; unset data.val_split (data.val_fraction holds out)")
        return base
    if _exists(f"{base}/{split}/{INDEX}", storage_options):
        return f"{base}/{split}"
    known = sorted(p.parent.name for p in Path(root).glob(f"*/{INDEX}")) if "://" not in root else []
    raise DataError(f"data.split: {root} has no MDS split '{split}' ({split}/{INDEX}); splits there: "
                    f"{', '.join(known) or 'none'}")


def _decompress(algo: Optional[str], data: bytes, where: str) -> bytes:
    name = (algo or "").split(":")[0]
    if not name:
        return data
    if name == "gz":
        return gzip.decompress(data)
    if name == "bz2":
        return bz2.decompress(data)
    modules = {"zstd": ("zstd", "zstd"), "br": ("brotli", "Brotli"), "snappy": ("snappy", "python-snappy")}
    if name not in modules:
        raise DataError(f"{where}: unknown MDS compression '{algo}' (known: gz, bz2, zstd, br, snappy)")
    module, package = modules[name]
    try:
        lib = __import__(module)
    except ImportError:
        raise DataError(f"{where}: its shards are {name}-compressed; pip install {package} "
                        "(or write the MDS folder with compression gz or none)") from None
    return lib.decompress(data)


def decode(encoding: str, data: bytes, where: str) -> Any:
    """One MDS column value from its bytes.

    Raises:
        DataError: an encoding this reader does not read (names the column)."""
    if encoding == "str":
        return data.decode("utf-8")
    if encoding == "bytes":
        return data
    if encoding == "int":
        return int(np.frombuffer(data, np.int64)[0])
    if encoding in _SCALARS:
        return np.frombuffer(data, encoding)[0].item()
    if encoding in ("str_int", "str_float", "str_decimal"):
        return data.decode("utf-8")
    if encoding == "json":
        return json.loads(data.decode("utf-8"))
    if encoding.startswith("ndarray"):
        parts = encoding.split(":")
        pos, dtype = 0, parts[1] if len(parts) > 1 and parts[1] else None
        if dtype is None:
            dtype, pos = _NDARRAY_DTYPES[data[0]], 1
        if len(parts) > 2:
            shape = tuple(int(x) for x in parts[2].split(","))
        else:
            byte = data[pos]
            ndim, code = byte >> 2, byte % 4
            size = ndim * (1 << code)
            shape = tuple(int(x) for x in np.frombuffer(data[pos + 1:pos + 1 + size], _SHAPE_DTYPES[code]))
            pos += 1 + size
        return np.frombuffer(data[pos:], dtype).reshape(shape)
    raise DataError(f"{where}: MDS encoding '{encoding}' is not read by llmforge (text columns: str; "
                    "token columns: ndarray or bytes)")


def iter_samples(folder: str, columns: tuple[str, ...], storage_options: Optional[dict] = None
                 ) -> Iterator[dict[str, Any]]:
    """The samples of the MDS split ``folder`` in shard order, with only ``columns`` decoded.

    Raises:
        DataError: index.json missing or damaged, a shard missing, a column absent."""
    where = folder.rstrip("/")
    try:
        index = json.loads(_read(f"{where}/{INDEX}", storage_options))
        shards = index["shards"]
        if not isinstance(shards, list):
            raise TypeError("'shards' is not a list")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise DataError(f"data.path: {where}/{INDEX} is not a readable MDS index ({exc})") from None
    for k, shard in enumerate(shards):
        names, encodings, sizes, name, compression = _shard_entry(shard, k, where)
        missing = [c for c in columns if c not in names]
        if missing:
            raise DataError(f"data.text_field: {where} has no column {', '.join(missing)}; its columns "
                            f"are {', '.join(names)} (text: data.text_field; pre-tokenised: 'tokens')")
        path = _shard_path(where, name, k)
        try:
            raw = _decompress(compression, _read(path, storage_options), path)
        except (OSError, EOFError, ValueError, zlib.error) as exc:  # gzip/bz2: truncated or damaged
            raise DataError(f"data.path: cannot read MDS shard {path} ({exc})") from None
        offsets = _offsets(raw, path)
        for i in range(len(offsets) - 1):
            try:
                row = _sample(raw[offsets[i]:offsets[i + 1]], names, encodings, sizes, columns, where)
            except (ValueError, IndexError, KeyError, TypeError, RecursionError) as exc:
                raise DataError(f"data.path: MDS shard {path} is damaged: sample {i} does not decode "
                                f"({type(exc).__name__}: {exc}); write the shard again") from None
            yield row


def _shard_entry(shard: Any, k: int, where: str) -> tuple[list, list, list, str, Optional[str]]:
    """``(column_names, column_encodings, column_sizes, shard file name, compression)`` of
    index.json's shard ``k``, checked.

    Raises:
        DataError: not an MDS shard entry, or a field missing or of the wrong kind (names it)."""
    bad = f"data.path: {where}/{INDEX} shard {k}"
    if not isinstance(shard, dict):
        raise DataError(f"{bad} is not a mapping; write the MDS folder again")
    if shard.get("format", "mds") != "mds":
        raise DataError(f"{bad} has format '{shard.get('format')}'; llmforge reads MDS shards only "
                        "(convert xsv/json shards with streaming's tools)")
    names, encodings, sizes = (shard.get(f) for f in ("column_names", "column_encodings", "column_sizes"))
    if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
            and len(names) == len(encodings) == len(sizes) and all(isinstance(x, str) for x in names + encodings)
            and all(x is None or (isinstance(x, int) and x >= 0) for x in sizes)):
        raise DataError(f"{bad}: column_names, column_encodings and column_sizes must be lists of one "
                        "length (names and encodings text, sizes a byte count or null); write the MDS "
                        "folder again")
    zipped = shard.get("zip_data")
    if zipped and not isinstance(shard.get("compression"), str):
        raise DataError(f"{bad} has zip_data but its compression is {shard.get('compression')!r}, not a "
                        "name (gz, bz2, zstd, br, snappy); write the MDS folder again")
    entry = zipped or shard.get("raw_data")
    if not isinstance(entry, dict) or not isinstance(entry.get("basename"), str):
        raise DataError(f"{bad} has no {'zip_data' if zipped else 'raw_data'}.basename (the shard's file "
                        "name); write the MDS folder again")
    return names, encodings, sizes, entry["basename"], shard.get("compression") if zipped else None


def _shard_path(where: str, name: str, k: int) -> str:
    """``where/name``, refused when ``name`` leaves the folder: an absolute path, a ``..``
    part, or (local folders) a link that resolves outside it; an index.json someone shared
    must not make ``data prepare`` read (and tokenize into shards) a file elsewhere.

    Raises:
        DataError: names the shard and its basename."""
    parts = name.replace("\\", "/").split("/")
    outside = not name or name.startswith("/") or ".." in parts or "://" in name or "\0" in name
    if not outside and "://" not in where:
        root = Path(where).resolve()
        outside = not Path(where, name).resolve().is_relative_to(root)
    if outside:
        raise DataError(f"data.path: {where}/{INDEX} shard {k} names the file {name!r}, which is outside "
                        "the MDS folder (a '..' or absolute path, or a link out of it); llmforge reads "
                        "shards from the folder only")
    return f"{where}/{name}"


def _offsets(raw: bytes, path: str) -> list[int]:
    """The ``n + 1`` byte offsets of a decompressed shard's ``n`` samples (sample ``i`` is
    ``raw[off[i]:off[i + 1]]``), after checking that its header fits: ascending, within the file.

    Raises:
        DataError: a header that does not fit the file (a truncated or damaged shard)."""
    n = int(np.frombuffer(raw[:4], np.uint32)[0]) if len(raw) >= 4 else -1
    if n >= 0 and len(raw) >= 8 + 4 * n:
        offsets = np.frombuffer(raw[4:8 + 4 * n], np.uint32).astype(np.int64)
        if bool(np.all(np.diff(offsets) >= 0)) and int(offsets[-1]) <= len(raw):
            return offsets.tolist()
    raise DataError(f"data.path: MDS shard {path} is damaged (its header does not fit its {len(raw)} "
                    "bytes: a truncated or overwritten file); write the shard again")


def _sample(sample: bytes, names: list, encodings: list, sizes: list, columns: tuple[str, ...],
            where: str) -> dict[str, Any]:
    """One sample's bytes as ``{column: value}``, only ``columns`` decoded.

    Raises:
        ValueError: its column sizes need more bytes than it has."""
    pos, lengths = 0, []
    for size in sizes:
        if size is None:
            lengths.append(int(np.frombuffer(sample[pos:pos + 4], np.uint32)[0]))
            pos += 4
        else:
            lengths.append(size)
    if pos + sum(lengths) > len(sample):
        raise ValueError(f"its columns need {pos + sum(lengths)} bytes, the sample has {len(sample)}")
    row = {}
    for col, enc, length in zip(names, encodings, lengths):
        if col in columns:
            row[col] = decode(enc, sample[pos:pos + length], f"{where} column {col}")
        pos += length
    return row


class MDSSplit:
    """An MDS split as documents, re-iterable: rows ``{"text": str}`` from a text column, or
    ``{"tokens": 1-D int64 array}`` from a pre-tokenised one (``ndarray`` or ``bytes`` of
    :data:`TOKENS_BYTES_DTYPE`), each optionally filtered by ``keep(row) -> bool``."""

    def __init__(self, folder: str, column: str, storage_options: Optional[dict] = None,
                 keep: Any = None, limit: Optional[int] = None) -> None:
        self.folder, self.column, self.storage_options = folder, column, storage_options
        self.keep, self.limit = keep, limit
        self.kind = "tokens" if column == "tokens" else "text"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        seen = 0
        for sample in iter_samples(self.folder, (self.column,), self.storage_options):
            if self.limit is not None and seen >= self.limit:
                return
            seen += 1
            value = sample[self.column]
            if self.kind == "tokens":
                try:
                    ids = (np.frombuffer(value, TOKENS_BYTES_DTYPE) if isinstance(value, bytes)
                           else np.asarray(value).reshape(-1))
                except ValueError as exc:  # bytes whose length is no multiple of 8
                    raise DataError(f"data.path: a 'tokens' value of {self.folder} is not int64 ids "
                                    f"({exc})") from None
                if ids.dtype.kind not in "iu":  # float ids would be truncated into other tokens
                    raise DataError(f"data.path: the 'tokens' column of {self.folder} holds {ids.dtype} "
                                    "values; token ids are integers (ndarray:int32/int64, or bytes of "
                                    "int64): write the MDS folder again")
                row: dict[str, Any] = {"tokens": ids.astype(np.int64)}
            else:
                if not isinstance(value, str):
                    raise DataError(f"data.text_field: column '{self.column}' of {self.folder} is not "
                                    "text (str); for token ids name the column 'tokens'")
                row = {"text": value}
            if self.keep is None or self.keep(row):
                yield row


def token_column(folder: str, text_field: str, storage_options: Optional[dict] = None) -> str:
    """The column to read: ``text_field`` when the split has it, else ``tokens`` when it has
    that (LLM Foundry's pre-tokenised ``concat_tokens`` output).

    Raises:
        DataError: neither column is there."""
    try:
        index = json.loads(_read(f"{folder.rstrip('/')}/{INDEX}", storage_options))
        names = index["shards"][0]["column_names"] if index["shards"] else []
        if not isinstance(names, list):
            raise TypeError("column_names is not a list")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise DataError(f"data.path: {folder}/{INDEX} is not a readable MDS index ({exc})") from None
    if text_field in names:
        return text_field
    if "tokens" in names:
        return "tokens"
    raise DataError(f"data.text_field: {folder} has no column '{text_field}' nor 'tokens'; its "
                    f"columns are {', '.join(names) or 'none'}")


def mds_files(cfg: Any) -> list[str]:
    """The ``index.json`` of each split a prepare of ``cfg`` (the ``data:`` section) reads:
    what identifies the source in the prepared manifest (a shard's name and size are in it)."""
    so = plain_options(cfg.storage_options) or None
    splits = [cfg.split] + ([cfg.val_split] if cfg.val_split else [])
    return [f"{split_folder(cfg.path, s, so)}/{INDEX}" for s in splits]


def mds_documents(cfg: Any, seed: int) -> DocumentSplits:
    """``data:`` with ``format: mds`` as train and validation documents for ``data prepare``:
    ``data.split`` (and ``data.val_split``) folders of ``data.path``, or, without a
    ``val_split``, ``data.val_fraction`` of the documents held out by their content
    (:func:`llmforge.data.sources.held_out`; token rows by their bytes).

    Raises:
        DataError: the split or the column is missing (names them)."""
    so = plain_options(cfg.storage_options) or None
    train_dir = split_folder(cfg.path, cfg.split, so)
    column = token_column(train_dir, cfg.text_field, so)

    def held(row: dict[str, Any]) -> bool:
        text = row["text"] if "text" in row else row["tokens"].tobytes().hex()
        return held_out(text, cfg.val_fraction, seed)

    if cfg.val_split:
        train = MDSSplit(train_dir, column, so, limit=cfg.max_documents)
        val: Optional[MDSSplit] = MDSSplit(split_folder(cfg.path, cfg.val_split, so), column, so)
    elif cfg.val_fraction > 0:
        train = MDSSplit(train_dir, column, so, keep=lambda row: not held(row), limit=cfg.max_documents)
        val = MDSSplit(train_dir, column, so, keep=held, limit=cfg.max_documents)
    else:
        train, val = MDSSplit(train_dir, column, so, limit=cfg.max_documents), None
    return DocumentSplits(train, val, fingerprint=hash_str(f"mds-{cfg.path}-{cfg.split}-{column}"),
                          files=(train_dir,))
