"""Tokens of an in-memory source, tokenized once and memory-mapped at later starts.

A run on ``data.source: shakespeare`` or local ``files`` (not streaming) tokenizes its whole
train and validation splits at every start: the demo's 39 plays take ~3 s of two cores, and the
``tokenizers`` threads' freed heap and the documents' tables stay in the process's peak memory
(issue 30, measured: about 70 MiB of the demo's peak). Like the trained-BPE cache, the packed
ids are kept under ``$LLMFORGE_CACHE/tokens`` (default ``~/.cache/llmforge/tokens``) and a later
run memory-maps them (``np.load(mmap_mode="r")``) without reading the documents at all. LitGPT's
and LLM Foundry's answer to the same cost is an offline prepare step; ``llmforge data prepare``
stays the tool for corpora too large to tokenize at start. ``data.token_cache: false`` turns
the cache off.

An entry is named by the documents' key (:class:`llmforge.data.sources.DocumentSplits`: the
files' paths, sizes and modification times in nanoseconds, the split, the hold-out settings
and seed, ``max_documents``, the format and text field, the ``datasets`` version), the
tokenizer's fingerprint (:func:`llmforge.data.prepared.tokenizer_fingerprint`: vocabulary,
BOS/EOS and probe encodings), the id dtype and the encoder's piece size. It is three files,
``<name>.train.npy``, ``<name>.val.npy`` (when there is a validation split) and
``<name>.json``, written last: an entry without its json is incomplete and is written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llmforge.data.packing import PIECE_CHARS, token_dtype
from llmforge.data.prepared import tokenizer_fingerprint

FORMAT = 1  # raise when cleaning or packing changes (clean_text, BOS/EOS, pieces): old entries miss

Splits = tuple[np.ndarray, Optional[np.ndarray]]

_MAX_JSON_BYTES = 4096  # an entry's json is ~60 bytes; anything far larger was not written here


def entry_name(docs_key: str, tokenizer: Any) -> str:
    """The entry of the documents named ``docs_key`` tokenized by ``tokenizer`` (24 hex)."""
    blob = json.dumps([FORMAT, docs_key, tokenizer_fingerprint(tokenizer),
                       token_dtype(tokenizer.vocab_size).str, PIECE_CHARS])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def lookup(cache_dir: Optional[Path], docs_key: str, tokenizer: Any,
           has_val: Optional[bool] = None) -> tuple[Optional[str], Optional[Splits]]:
    """``(name, ids)``: the entry of the documents ``docs_key`` tokenized by ``tokenizer`` and
    its ids (:func:`read_entry`, checked against the tokenizer's vocabulary and ``has_val``:
    whether the documents have a validation split, ``None`` unknown), ``ids`` ``None`` on a
    miss; ``(None, None)`` when nothing is cached (no cache folder, or documents without a key:
    hub, streaming and URL sources)."""
    if not docs_key or cache_dir is None:
        return None, None
    name = entry_name(docs_key, tokenizer)
    return name, read_entry(cache_dir, name, token_dtype(tokenizer.vocab_size),
                            vocab_size=tokenizer.vocab_size, has_val=has_val)


def read_entry(cache_dir: Path, name: str, dtype: np.dtype, *, vocab_size: Optional[int] = None,
               has_val: Optional[bool] = None) -> Optional[Splits]:
    """The entry's ``(train, val)`` ids as read-only memory maps (``val`` is ``None`` for a run
    without a validation split), or ``None`` when the entry is missing, incomplete or damaged
    (then the caller tokenizes and :func:`write_entry` replaces it). Damaged includes an edited
    json: a validation split present or absent against ``has_val`` (``None``: not checked), and
    an id at or past ``vocab_size`` (one pass over the memory map: an id past the embedding
    would fail training as an ``IndexError``)."""
    files = {s: cache_dir / f"{name}.{s}" for s in ("json", "train.npy", "val.npy")}
    try:
        # regular files only (a FIFO would block the read, /dev/zero never end it), and a json
        # of the size write_entry writes (a crafted deep one raised RecursionError, exit 1)
        if not files["json"].is_file() or files["json"].stat().st_size > _MAX_JSON_BYTES:
            return None
        meta = json.loads(files["json"].read_text())
        splits = [None if meta["tokens"][s] is None else _ids(files[f"{s}.npy"])
                  for s in ("train", "val")]
    except (OSError, ValueError, KeyError, TypeError, EOFError, RecursionError):  # EOFError: an empty .npy
        return None
    if splits[0] is None or (has_val is not None and (splits[1] is not None) != has_val):
        return None
    for ids, s in zip(splits, ("train", "val")):
        if ids is not None and (ids.ndim != 1 or ids.dtype != dtype or len(ids) != meta["tokens"][s]):
            return None
        if ids is not None and vocab_size is not None and len(ids) and int(ids.max()) >= vocab_size:
            return None
    return splits[0], splits[1]


def _ids(path: Path) -> np.ndarray:
    """A memory map of the ids in ``path``, a regular file (np.load of a FIFO would block).

    Raises:
        OSError: ``path`` is missing or not a regular file.
    """
    if not path.is_file():
        raise OSError(f"{path} is not a regular file")
    return np.load(path, mmap_mode="r", allow_pickle=False)


def write_entry(cache_dir: Path, name: str, train: np.ndarray, val: Optional[np.ndarray]) -> None:
    """Store an entry: each file goes to a temporary name renamed into place, the json last,
    so ranks that miss together never read a partial entry. A folder that cannot be written
    leaves the run uncached: this never fails a run."""
    parts: list[Path] = []
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for split, ids in (("train", train), ("val", val)):
            if ids is not None:
                part = cache_dir / f"{name}.{split}.{os.getpid()}.part"
                parts.append(part)
                with open(part, "wb") as f:
                    np.save(f, ids, allow_pickle=False)
                os.replace(part, cache_dir / f"{name}.{split}.npy")
        part = cache_dir / f"{name}.json.{os.getpid()}.part"
        parts.append(part)
        part.write_text(json.dumps({"format": FORMAT, "tokens": {
            "train": len(train), "val": None if val is None else len(val)}}))
        os.replace(part, cache_dir / f"{name}.json")
    except OSError:
        for part in parts:  # best effort: on a read-only mount even this unlink raises
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
