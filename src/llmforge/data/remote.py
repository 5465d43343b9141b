"""Prepared corpora on an object store: ``data.path`` (or the OUT of ``llmforge data prepare``)
an fsspec URL: ``s3://`` (s3fs), ``gs://`` (gcsfs), ``az://`` (adlfs), ``file://``,
``memory://``, ...

Reading (:func:`fetch_prepared`): shards are memory-mapped, so a run reads a node-local copy.
The first process of a node to take the file lock ``<cache>/<key>.lock`` copies the corpus into
``<cache>/<key>`` (``<cache>``: ``data.cache_dir``, else ``$LLMFORGE_CACHE/prepared``; ``<key>``:
a hash of the URL and the manifest's bytes, so a re-prepared corpus gets a new copy); the other
ranks of the node wait on the lock and then find the copy. Each shard is streamed through
sha256 into ``NAME.<host>-<pid>.tmp`` and renamed only when its size and hash match the
manifest, and the manifest is written last: a killed copy never leaves a shard or a folder
that looks whole, and the next start copies only the shards still missing. A later start finds
the manifest and copies nothing.

Writing (:func:`llmforge.data.prepare.prepare_to_store`): the corpus is prepared into a local staging folder and each
shard is uploaded as soon as it is written (then deleted locally); the tokenizer and the
manifest follow, the manifest last. A resumed prepare skips the shards already uploaded whole.

Credentials come from the environment (the drivers' own variables, e.g. ``AWS_PROFILE``,
``GOOGLE_APPLICATION_CREDENTIALS``) or ``data.storage_options``; neither is written to the
cache, the staging folder or a message.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import socket
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from llmforge.config.redaction import scrub_url_credentials
from llmforge.data.prepared_checks import MANIFEST, parse_manifest
from llmforge.data.prepared_checks import shard_path
from llmforge.data.shakespeare import cache_root
from llmforge.errors import DataError

CHUNK = 1 << 22  # 4 MiB reads: large enough for object-store throughput, small in memory
COPY_THREADS = 8  # parallel shard downloads (object stores serve one stream at ~100 MB/s)


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local or mounted folder."""
    return "://" in str(path)


def plain_options(options: Any) -> dict[str, Any]:
    """``data.storage_options`` as plain, mutable containers at every depth (``{headers:
    {...}}``, s3's ``client_kwargs``): fsspec drivers and ``datasets`` update nested options in
    place (the https driver adds headers), which a read-only OmegaConf node refuses ("Cannot
    change read-only config container") and a shallow ``dict()`` copy would not reach. Values
    that are neither mappings nor lists are passed as they are.

    Returns:
        A new ``dict`` (``{}`` for ``None``); nested mappings are new ``dict``s, lists new ``list``s.
    """
    def plain(value: Any) -> Any:
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(options or {})


def open_store(url: str, storage_options: Any, what: str) -> tuple[Any, str]:
    """The fsspec filesystem and the path inside it of ``url``.

    Args:
        what: the key or argument that holds the URL, for messages (``data.path``, ``OUT``).

    Raises:
        DataError: the protocol's driver is not installed (naming the package to install), the
            protocol is unknown, or the driver refuses ``data.storage_options``.
    """
    import fsspec

    proto = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **plain_options(storage_options))
    except ImportError as exc:
        raise missing_driver(url, what) from exc
    except ValueError as exc:
        raise DataError(f"{what}: {url}: {exc}; use a protocol fsspec knows (s3, gs, az, file, "
                        "memory, ...) or a local folder") from exc
    except TypeError as exc:  # an option the driver does not take (keys only: values may be secrets)
        raise DataError(f"data.storage_options: the {proto}:// driver refused them ({exc}); see "
                        "its documentation for the options it takes") from exc
    return fs, path.rstrip("/")


def missing_driver(url: str, what: str) -> DataError:
    """The error for a URL whose fsspec driver is not installed, naming the package
    (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``, ...); credentials in ``url`` are hidden."""
    from fsspec.registry import known_implementations

    proto = url.split("://", 1)[0]
    package = known_implementations.get(proto, {}).get("class", "").split(".")[0]
    return DataError(f"{what}: {scrub_url_credentials(url)} needs the fsspec driver of {proto}://, "
                     f"which is not installed; install it with `pip install {package or proto + 'fs'}`")


def cache_folder(cache_dir: Optional[str | os.PathLike]) -> Path:
    """Where node-local copies go: ``data.cache_dir``, else ``$LLMFORGE_CACHE/prepared``
    (``~/.cache/llmforge/prepared``)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return cache_root() / "prepared"


def _store_error(exc: OSError, where: str) -> DataError:
    return DataError(f"data.path: cannot read {where} ({type(exc).__name__}: {exc}); check the "
                     "URL and the credentials in the environment or data.storage_options")


def fetch_prepared(url: str, *, storage_options: Optional[dict] = None,
                   cache_dir: Optional[str | os.PathLike] = None) -> tuple[Path, bool]:
    """Copy the prepared corpus at ``url`` to this node's cache once, verified.

    Returns:
        ``(folder, copied)``: the local copy, and whether this call copied shards (and so
        already checked every shard's sha256).

    Raises:
        DataError: no or an incomplete manifest at ``url``, a missing, truncated or corrupt
            shard (the message names its URL), a cache folder that cannot be created or lacks
            the room, a missing driver or an unreadable store.
    """
    fs, root = open_store(url, storage_options, "data.path")
    url = url.rstrip("/")
    try:
        data = fs.cat_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        raise DataError(f"data.path: {url} has no {MANIFEST}, so it is not a prepared corpus; "
                        f"create it with `llmforge data prepare CONFIG_OR_SOURCE {url}`") from None
    except OSError as exc:
        raise _store_error(exc, f"{url}/{MANIFEST}") from exc
    manifest = parse_manifest(data, url)
    dest = cache_folder(cache_dir) / hashlib.sha256(url.encode() + b"\n" + data).hexdigest()[:16]
    if (dest / MANIFEST).exists():
        return dest, False
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"data.cache_dir: cannot create {dest} ({exc}); set data.cache_dir to a "
                        "writable node-local folder") from exc
    from filelock import FileLock, Timeout

    lock = FileLock(f"{dest}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"data.path: waiting for another process copying {url} to {dest}",
              file=sys.stderr, flush=True)
        lock.acquire()
    try:
        if (dest / MANIFEST).exists():  # the process that held the lock copied it
            return dest, False
        _copy(fs, root, url, manifest, dest)
        tmp = _tmp(dest / MANIFEST)
        tmp.write_bytes(data)
        os.replace(tmp, dest / MANIFEST)  # last: marks the copy whole
    finally:
        lock.release()
    return dest, True


def _copy(fs: Any, root: str, url: str, manifest: dict, dest: Path) -> None:
    """Copy the tokenizer and every shard not yet whole in ``dest`` (under the lock)."""
    import time

    for stale in dest.rglob("*.tmp"):  # left by a killed copy
        stale.unlink()
    itemsize = np.dtype(manifest["dtype"]).itemsize
    shards = [s for info in manifest["splits"].values() for s in info["shards"]]
    for s in shards:  # the manifest comes from the store: it must not name files outside the copy
        shard_path(dest, s["file"], f"{url}/{MANIFEST}")
    todo = [s for s in shards if not _whole(dest / s["file"], s["tokens"] * itemsize)]
    need = sum(s["tokens"] * itemsize for s in todo)
    free = shutil.disk_usage(dest).free
    if need > free:
        raise DataError(f"data.cache_dir: {dest.parent} has {free / 1e9:,.1f} GB free, the copy "
                        f"of {url} needs {need / 1e9:,.1f} GB; set data.cache_dir to a node-local "
                        "folder with room")
    start = time.perf_counter()
    try:
        files = fs.find(f"{root}/tokenizer")
    except OSError as exc:
        raise _store_error(exc, f"{url}/tokenizer") from exc
    if not files:
        raise DataError(f"data.path: {url}/tokenizer is missing (the tokenizer that wrote the "
                        f"shards); run `llmforge data prepare` again into {url}")
    for path in files:
        rel = path[len(root):].lstrip("/")
        _download(fs, path, dest / rel, f"{url}/{rel}")
    if todo:
        print(f"data.path: copying {len(todo)} shard(s) ({need / 1e6:,.1f} MB) of {url} to {dest}",
              file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max(1, min(COPY_THREADS, len(todo)))) as pool:
        futures = [pool.submit(_download, fs, f"{root}/{s['file']}", dest / s["file"],
                               f"{url}/{s['file']}", s["tokens"] * itemsize, s["sha256"]) for s in todo]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # stop quickly, then report the first
            raise
    if todo:
        print(f"data.path: copied {need / 1e6:,.1f} MB in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)


def _tmp(target: Path) -> Path:
    # one name per writer: should the lock not hold (a cache on a shared filesystem without
    # locks), two copies never write into one file
    return target.with_name(f"{target.name}.{socket.gethostname()}-{os.getpid()}.tmp")


def _whole(path: Path, size: int) -> bool:
    # a shard gets its final name only after its hash matched: the size guards against damage since
    return path.exists() and path.stat().st_size == size


def _download(fs: Any, src: str, target: Path, where: str, size: Optional[int] = None,
              sha256: Optional[str] = None) -> None:
    """Stream ``src`` into ``target`` through sha256 and rename it when it matches ``size`` and
    ``sha256`` (when given).

    Raises:
        DataError: the file is missing, has another size or hash (naming ``where``, its URL),
            or the store cannot be read.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(target)
    h, n = hashlib.sha256(), 0
    try:
        with fs.open(src, "rb", block_size=CHUNK) as f, open(tmp, "wb") as out:
            while block := f.read(CHUNK):
                h.update(block)
                out.write(block)
                n += len(block)
    except FileNotFoundError:
        tmp.unlink(missing_ok=True)
        raise DataError(f"data.path: {where} is missing; run `llmforge data prepare` again into "
                        f"{where.rsplit('/', 2)[0]} to rewrite it") from None
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _store_error(exc, where) from exc
    fix = f"run `llmforge data prepare` again into {where.rsplit('/', 2)[0]} to rewrite it"
    if size is not None and n != size:
        tmp.unlink()
        raise DataError(f"data.path: shard {where} is truncated or damaged: {n:,} bytes, the "
                        f"manifest says {size:,}; {fix}")
    if sha256 is not None and h.hexdigest() != sha256:
        tmp.unlink()
        raise DataError(f"data.path: shard {where} is corrupt (its sha256 differs from the "
                        f"manifest's); {fix}")
    os.replace(tmp, target)


LAYOUT = (MANIFEST, "tokenizer/", "train/", "val/")


def _check_store_out(fs: Any, root: str, url: str) -> None:
    """Refuse an OUT URL that holds a finished corpus or files not of a prepare's layout (those
    of an interrupted upload are overwritten or kept)."""
    try:
        if fs.exists(f"{root}/{MANIFEST}"):
            raise DataError(f"OUT: {url} already holds a prepared corpus ({url}/{MANIFEST}); "
                            "choose another URL or delete it")
        files = [p[len(root):].lstrip("/") for p in fs.find(root)] if fs.exists(root) else []
    except OSError as exc:
        raise DataError(f"OUT: cannot list {url} ({exc}); check the URL and the credentials in "
                        "the environment or data.storage_options") from exc
    other = [f for f in files if not f.startswith(LAYOUT)]
    if other:
        raise DataError(f"OUT: {url} holds other files ({other[0]}, ...); choose an empty or new URL")


def _remote_size(fs: Any, path: str) -> Optional[int]:
    try:
        return int(fs.info(path)["size"])
    except (FileNotFoundError, KeyError):
        return None


def _upload(fs: Any, local: Path, path: str, url: str) -> None:
    from fsspec.implementations.local import LocalFileSystem

    try:
        if isinstance(fs, LocalFileSystem):  # object stores have no folders to create
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.put_file(str(local), path)
    except OSError as exc:
        raise DataError(f"OUT: cannot write {url} ({type(exc).__name__}: {exc}); check the "
                        "credentials in the environment or data.storage_options, then run the "
                        "prepare again (finished shards are kept)") from exc
