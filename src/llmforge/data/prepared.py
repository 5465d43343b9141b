"""Prepared token shards (``llmforge data prepare``): read memory-mapped, checked against their
manifest, cut into windows.

Layout of a prepared folder::

    manifest.json        format, dtype, tokenizer fingerprint, documents and tokens per split,
                         source files (size, sha256), shards (file, tokens, sha256), complete
    tokenizer/           the tokenizer that wrote the shards (``Tokenizer.save``)
    train/shard_NNNNN.bin, val/shard_NNNNN.bin
                         raw token ids (``dtype``): ``[BOS] doc [EOS]`` per document, in order

A shard is opened with ``numpy.memmap`` (read-only): the ranks of one node share the page
cache, nothing is copied per rank. Window ``i`` of a split is window ``i - first[s]`` of shard
``s`` (windows never cross shards; each shard's tail shorter than a window is dropped), so the
window count and every window's content depend only on the files and ``seq_len``. The order
and the resume position come from :class:`llmforge.data.packing.ShardedSampler` (global
batches indexed by step): exact, O(1), and the same on any data-parallel size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from llmforge.data.packing import check_split_sizes, num_windows
from llmforge.data.prepared_checks import file_sha256, read_manifest, shard_path
from llmforge.data.remote import fetch_prepared
from llmforge.errors import DataError

FINGERPRINT_PROBE = ["ROMEO. But, soft! what light through yonder window breaks?",
                     " 0123456789 \u00e9\u00e8 \u4e2d\u6587 \U0001f600\t\n  x", "def f(x):\n    return x ** 2\n"]


def tokenizer_fingerprint(tok: Any) -> str:
    """A hex digest of what decides the ids a tokenizer writes: vocabulary size, BOS/EOS ids and
    the encoding of probe texts (ASCII, accents, CJK, emoji, whitespace, code)."""
    ids = [tok.encode(t) for t in FINGERPRINT_PROBE]
    blob = json.dumps([tok.vocab_size, tok.bos_id, tok.eos_id, ids]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class PreparedSplits:
    """A prepared folder as the data module's input (in place of documents)."""

    root: Path
    manifest: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return self.manifest["tokenizer"]["fingerprint"]


def check_tokenizer(prepared: PreparedSplits, tok: Any, what: str) -> None:
    """Refuse a tokenizer that writes other ids than the one that prepared the shards.

    Raises:
        DataError: the fingerprints (:func:`tokenizer_fingerprint`) differ.
    """
    have = tokenizer_fingerprint(tok)
    if have != prepared.fingerprint:
        saved = prepared.manifest["tokenizer"]
        raise DataError(
            f"tokenizer: {what} (fingerprint {have}, vocabulary {tok.vocab_size}) is not the "
            f"tokenizer that prepared {prepared.root} (fingerprint {prepared.fingerprint}, "
            f"vocabulary {saved['vocab_size']}, {saved.get('type')}); use tokenizer.type=train_bpe "
            "to read the one saved with the shards, or prepare the corpus again with this one")


def open_prepared(root: str | Path, verify: bool = True, *, storage_options: Optional[dict] = None,
                  cache_dir: Optional[str | Path] = None) -> PreparedSplits:
    """Read and check a prepared folder: every shard exists with the manifest's size and, with
    ``verify``, its sha256 (one sequential read per shard, at about disk speed).

    ``root`` may be an fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``, ...): the
    corpus is then copied once to a node-local cache (:func:`llmforge.data.remote.fetch_prepared`,
    with ``storage_options`` and ``cache_dir``) and that copy is opened.

    Raises:
        DataError: missing or incomplete manifest, a missing, truncated or corrupt shard, or
            one holding a token id outside the tokenizer's vocabulary (the message names the
            file or URL), no training tokens, or (a URL) a missing fsspec
            driver or an unreadable store.
    """
    if "://" in str(root):
        local, copied = fetch_prepared(str(root), storage_options=storage_options, cache_dir=cache_dir)
        try:  # a fresh copy was hashed on the way in
            return _open_local(local, verify and not copied)
        except DataError as exc:
            raise DataError(f"{exc} (this is the node-local copy of {root}: delete {local} to copy "
                            "it again)") from exc
    return _open_local(Path(root), verify)


def _open_local(root: Path, verify: bool) -> PreparedSplits:
    manifest = read_manifest(root)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            path = shard_path(root, shard["file"])
            want = shard["tokens"] * itemsize
            if not path.exists():
                raise DataError(f"data.path: shard {path} is missing; run `llmforge data prepare` "
                                "again into this folder to rewrite it")
            size = path.stat().st_size
            if size != want:
                raise DataError(f"data.path: shard {path} is truncated or damaged: {size:,} bytes, "
                                f"the manifest says {want:,}; delete it and run `llmforge data "
                                "prepare` again to rewrite it")
            if verify and file_sha256(path) != shard["sha256"]:
                raise DataError(f"data.path: shard {path} is corrupt (its sha256 differs from the "
                                "manifest's); delete it and run `llmforge data prepare` again")
            top = _max_id(path, manifest["dtype"])
            if top is not None and top >= manifest["tokenizer"]["vocab_size"]:
                raise DataError(f"data.path: shard {path} holds token id {top}, outside the tokenizer's "
                                f"vocabulary of {manifest['tokenizer']['vocab_size']} ids (the manifest's "
                                "tokenizer.vocab_size): it was written by another tokenizer or damaged; "
                                "delete the folder and run `llmforge data prepare` again")
    if not manifest["splits"].get("train", {}).get("tokens"):
        raise DataError(f"data.path: {root} holds no training tokens; prepare a non-empty source")
    return PreparedSplits(root, manifest)


def _max_id(path: Path, dtype: str, chunk: int = 1 << 24) -> Optional[int]:
    """The largest token id of a shard (``None``: empty), read memory-mapped in chunks of
    ``chunk`` ids (just hashed: from the page cache). An id past the vocabulary would
    otherwise fail in the embedding lookup, mid-training, as an ``IndexError``."""
    if path.stat().st_size == 0:
        return None
    ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    return max(int(ids[i:i + chunk].max()) for i in range(0, len(ids), chunk))


class PreparedWindows(Dataset):
    """Map-style windows ``LongTensor[seq_len + 1]`` over the memory-mapped shards of one split.

    Args:
        prepared: an opened folder (:func:`open_prepared`).
        split: ``train`` or ``val``.
        seq_len: tokens per training sequence (windows hold ``seq_len + 1``).
    """

    def __init__(self, prepared: PreparedSplits, split: str, seq_len: int) -> None:
        info = prepared.manifest["splits"].get(split) or {"shards": []}
        self.dtype = np.dtype(prepared.manifest["dtype"])
        self.root = prepared.root
        self.paths = [shard_path(prepared.root, s["file"]) for s in info["shards"]]
        self.window = seq_len + 1
        counts = np.array([s["tokens"] // self.window for s in info["shards"]], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)])  # first window of each shard
        self.tokens = int(sum(s["tokens"] for s in info["shards"]))
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.first[-1])

    def check_size(self, world: int, local_batch_size: int) -> None:
        """:func:`~llmforge.data.packing.check_split_sizes` of this split, from the manifest's
        counts (no shard is read); when the tokens would fill a step but windows, which do not
        cross shards, do not, the message names the shards and ``--docs-per-shard``.

        Raises:
            DataError: too few windows for one optimizer step on each of ``world`` ranks.
        """
        seq_len, together = self.window - 1, num_windows(self.tokens, self.window - 1)
        try:
            check_split_sizes(self.tokens, seq_len, world, local_batch_size, train_windows=len(self))
        except DataError as exc:
            if together // world < local_batch_size:
                raise  # too few tokens however they were sharded
            raise DataError(f"{exc}; or prepare the corpus again with a larger --docs-per-shard: "
                            f"the windows of {self.root} do not cross its {len(self.paths)} "
                            f"shards, which hold {together} windows together") from None

    def _shard(self, s: int) -> np.memmap:
        m = self._maps.get(s)
        if m is None:  # opened lazily: each loader worker maps the files itself
            m = self._maps[s] = np.memmap(self.paths[s], dtype=self.dtype, mode="r")
        return m

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = int(np.searchsorted(self.first, i, side="right")) - 1
        lo = (i - int(self.first[s])) * self.window
        return torch.from_numpy(self._shard(s)[lo:lo + self.window].astype(np.int64))

    def __getstate__(self) -> dict:  # loader workers (spawn) map the files again
        return {**self.__dict__, "_maps": {}}
