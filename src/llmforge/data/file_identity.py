"""What identifies a source's files: ``describe_files`` for a prepared corpus's manifest (path,
bytes, sha256) and ``file_identities`` for a streaming position (bytes and a head hash of a
local file, the listed version of an object), so a file rewritten under its name is noticed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Optional

import fsspec

from llmforge.config.redaction import scrub_url_credentials
from llmforge.data.prepared_checks import file_sha256
from llmforge.data.remote import plain_options

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
"""A path with a scheme (``s3://``, ``https://``, ``memory://``) rather than a local file."""


def describe_files(files: list[str]) -> list[dict[str, Any]]:
    """``[{path, bytes, sha256}]`` of local files; a URL's files (its glob expanded by fsspec)
    get ``{path, bytes}`` only (hashing would read an object store twice) and their credentials
    (``user:password@``) are never recorded."""
    out: list[dict[str, Any]] = []
    for f in files:
        if not URL.match(f):
            out.append({"path": f, "bytes": os.path.getsize(f), "sha256": file_sha256(Path(f))})
            continue
        fs, _, paths = fsspec.get_fs_token_paths(f)
        for p in paths:
            out.append({"path": scrub_url_credentials(fs.unstrip_protocol(p)), "bytes": fs.size(p)})
    return out


def local_stats(files: list[str]) -> list[tuple[str, int, int]]:
    """``(path, bytes, modification time in ns)`` of the local files among ``files`` (URLs
    left out): compared before and after a long read, it tells a file written meanwhile."""
    out = []
    for f in files:
        if not URL.match(f):
            st = os.stat(f)
            out.append((f, st.st_size, st.st_mtime_ns))
    return out


def file_identity(path: str, head: int = 1 << 16) -> tuple[int, str]:
    """``(bytes, sha256 hex of the first head bytes)`` of a local file: tells a file rewritten
    under its name (another size or beginning) from the one a streaming position was saved in,
    reading 64 KiB whatever its size. Unlike the modification time, it survives a copy."""
    with open(path, "rb") as fh:
        return os.fstat(fh.fileno()).st_size, hashlib.sha256(fh.read(head)).hexdigest()


# what an object store reports of an object's version, first found wins: s3/gcs/azure ETag
# (changes with the content), gcs md5Hash, then modification times (file://, azure, gcs, memory)
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated",
                 "created")


def file_identities(files: Any, storage_options: Optional[dict] = None) -> list[list]:
    """``[name, bytes, version]`` of every file a streaming source reads, in its order.

    A local file's ``version`` is the sha256 of its first 64 KiB (:func:`file_identity`). A URL
    is expanded by fsspec (a glob in sorted order) and each object's ``version`` is what the
    store lists (:data:`_VERSION_KEYS`: its ETag, else its modification time; ``""`` when it
    lists neither), one listing per URL, no object read. ``name`` is a local file's base name
    (a copy of the corpus elsewhere keeps its positions), an object's URL (without
    ``user:password@``).

    Raises:
        OSError (or a driver's own error): a store that cannot be listed; callers decide
            whether that is an error.
    """
    out: list[list] = []
    for f in map(str, files):
        if not URL.match(f):
            if os.path.isfile(f):
                out.append([os.path.basename(f), *file_identity(f)])
            continue
        fs, path = fsspec.core.url_to_fs(f, **plain_options(storage_options))
        infos = fs.glob(path, detail=True) if glob.has_magic(path) else {path: fs.info(path)}
        for name in sorted(infos):
            info = infos[name]
            if info.get("type", "file") != "file":
                continue
            version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), "")
            out.append([scrub_url_credentials(fs.unstrip_protocol(name)), int(info.get("size") or 0),
                        version])
    return out
