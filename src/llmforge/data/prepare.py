"""``llmforge data prepare``: tokenize a corpus once into token shards (see
:mod:`llmforge.data.prepared` for the layout and how runs read them).

Documents are read lazily (``datasets`` streaming) in the order a run would read them, the
validation documents held out as the run's ``data.val_fraction`` / ``data.val_split`` would,
and cut into shards of ``docs_per_shard`` documents. Shards are tokenized by a pool of
processes (one per core), each writing its shard to a temporary file that is renamed when
whole; ``progress.json`` is written before anything else and lists the finished shards, so a
prepare interrupted at any moment (SIGKILL included) and started again keeps them and re-reads
(without tokenizing) only their documents. ``manifest.json`` is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from llmforge.data.packing import token_dtype
from llmforge.data.prepare_pool import ShardPool
from llmforge.data.prepared import tokenizer_fingerprint
from llmforge.data.prepared_checks import FORMAT, MANIFEST, parse_manifest
from llmforge.data.file_identity import describe_files, local_stats
from llmforge.data.mds import mds_documents, mds_files
from llmforge.data.remote import _check_store_out, _remote_size, _upload, open_store
from llmforge.data.shakespeare import cache_root
from llmforge.data.shard_writer import init_worker, pool_shard, write_shard
from llmforge.data.sources import (_resolve_files, iter_texts, load_documents, read_rows,
                                   tokenizer_cache_key)
from llmforge.data.tokenizers import build_tokenizer
from llmforge.errors import DataError
from llmforge.host_malloc import release_free_heap
from llmforge.paths import write_failed

PROGRESS = "progress.json"

def _blocks(ds: Any, size: int, files: Any = ()) -> Iterator[list[str]]:
    block: list[str] = []
    for row in read_rows(ds, files):  # an unreadable file: DataError naming it
        block.append(row["text"] if "text" in row else row["tokens"])  # MDS token rows
        if len(block) == size:
            yield block
            block = []
    if block:
        yield block


def source_files(cfg: Any) -> list[dict[str, Any]]:
    """``[{path, bytes, sha256}]`` of a ``files`` source (a hub dataset: its name)."""
    if cfg.data.source != "files":
        return [{"path": f"{cfg.data.source}:{cfg.data.path or ''}:{cfg.data.name or ''}"}]
    if cfg.data.format == "mds":  # the split indexes name and size every shard
        return describe_files(mds_files(cfg.data))
    return describe_files(_resolve_files(cfg.data))


def _source_stats(cfg: Any) -> list[tuple[str, int, int]]:
    """:func:`local_stats` of a ``files`` source's local files (``[]`` for a hub dataset)."""
    if cfg.data.source != "files":
        return []
    return local_stats(mds_files(cfg.data) if cfg.data.format == "mds" else _resolve_files(cfg.data))


def _atomic_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(value, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: the previous version of the file stays
        tmp.unlink(missing_ok=True)
        raise write_failed(exc, tmp, f"{path.name} keeps its previous content: free space and run "
                                     "the same command again to continue") from None


def _check_out(out: Path, key: dict[str, Any]) -> dict[str, list]:
    """Finished shards of an interrupted prepare of the same source and tokenizer, or ``{}``.

    Raises:
        DataError: OUT holds something else (another corpus, another tokenizer, other files).
    """
    # a *.tmp beside: a kill between writing and renaming progress.json (nothing else yet)
    if not out.exists() or all(p.suffix == ".tmp" for p in out.iterdir()):
        return {}
    progress = out / PROGRESS
    if progress.exists():
        try:
            saved = json.loads(progress.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise DataError(f"{progress} is damaged ({exc or 'nested too deeply'}); delete {out} and "
                            "prepare again") from exc
        if not isinstance(saved, dict) or not isinstance(saved.get("splits"), dict):
            raise DataError(f"{progress} is not a progress file of `llmforge data prepare`; delete "
                            f"{out} and prepare again")
        if saved.get("key") == key:
            return saved["splits"]
        raise DataError(f"{out} holds an interrupted prepare of another source, tokenizer or "
                        "--docs-per-shard; choose another folder or delete it")
    if (out / MANIFEST).exists():
        raise DataError(f"{out} already holds a prepared corpus ({out / MANIFEST}); choose "
                        "another folder or delete it")
    raise DataError(f"{out} exists and is not empty; choose an empty or new folder")


def _finished(out: Path, key: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The manifest of a prepare of the same inputs that completed in ``out`` (a rerun of the
    same command, e.g. after a stop signal that came as it finished), or ``None``."""
    if (out / PROGRESS).exists() or not (out / MANIFEST).exists():
        return None
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return None  # _check_out refuses the folder
    same = isinstance(manifest, dict) and manifest.get("complete") and manifest.get("key") == key
    return manifest if same else None


def _progress_bar(total_bytes: Optional[int]) -> Any:
    from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                    TextColumn("{task.fields[docs]:,} docs  {task.fields[tokens]:,} tokens  "
                               "{task.fields[mbps]:.1f} MB/s"),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    transient=False)


def prepare(cfg: Any, out: str | Path, *, workers: Optional[int] = None,
            docs_per_shard: int = 10_000, show_progress: bool = True,
            on_shard: Optional[Callable[[Path, dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Tokenize ``cfg.data`` with the run's tokenizer (``cfg.tokenizer``) into ``out``.

    Args:
        cfg: a resolved run config (:func:`llmforge.config.load_config`).
        out: output folder (new, empty, or an interrupted prepare of the same inputs), or an
            fsspec URL (``s3://bucket/out``: prepared in a local staging folder and uploaded, see
            :func:`prepare_to_store`).
        workers: tokenizing processes; ``None`` = every core; 1 = in this process.
        docs_per_shard: documents per shard file.
        show_progress: draw a rich progress bar (documents, tokens, MB/s, ETA) on stderr.
        on_shard: called with ``(out, entry)`` for each shard once it is written and listed in
            ``progress.json`` (``entry``: as :func:`write_shard` returns).

    Returns:
        The manifest (also written as ``out/manifest.json``).

    Raises:
        DataError: the source is empty or unreadable, ``out`` holds something else, or
            ``docs_per_shard < 1``.
        WriteError: a shard could not be written (a full disk): its partial file is removed,
            the finished shards are kept and the same command continues from them.
    """
    if docs_per_shard < 1:
        raise DataError(f"--docs-per-shard must be >= 1, got {docs_per_shard}")
    if "://" in str(out):
        return prepare_to_store(cfg, str(out), workers=workers, docs_per_shard=docs_per_shard,
                                show_progress=show_progress)
    out = Path(out)
    cfg.data.streaming = True  # read lazily: a corpus never sits in memory
    read = _source_stats(cfg)  # a file written while it is read: refused before the manifest
    if cfg.data.format == "mds":  # LLM Foundry's MDS shards (llmforge.data.mds)
        docs = mds_documents(cfg.data, cfg.run.seed)
        if docs.train.kind == "tokens" and cfg.tokenizer.type == "train_bpe":
            raise DataError(f"tokenizer.type: {cfg.data.path} holds token ids (an MDS 'tokens' "
                            "column); name the tokenizer that wrote them (tokenizer.type=huggingface "
                            "tokenizer.path=.../tokenizer.json) instead of train_bpe")
    else:
        docs = load_documents(cfg.data, cfg.run.seed, by_line=True)
    if next(read_rows(docs.train, docs.files), None) is None:
        held = docs.val is not None and next(read_rows(docs.val, docs.files), None) is not None
        why = (f": every document was held out for validation (data.val_fraction={cfg.data.val_fraction}); "
               "add documents or set data.val_fraction=0" if held else " holds no non-empty document")
        raise DataError(f"data: the source ({cfg.data.source} {cfg.data.path or ''}){why}; nothing was "
                        f"written to {out}")
    tok = build_tokenizer(cfg.tokenizer, lambda: iter_texts(docs.train, cfg.tokenizer.train_max_bytes, docs.files),
                          cache_dir=cache_root() / "tokenizers", fingerprint=tokenizer_cache_key(cfg, docs))
    release_free_heap()  # what the BPE trainer's threads freed, before tokenizing allocates more
    sources = source_files(cfg)
    fp = tokenizer_fingerprint(tok)
    key = {"fingerprint": fp, "sources": sources, "docs_per_shard": docs_per_shard,
           "seed": cfg.run.seed, "val_fraction": cfg.data.val_fraction, "split": cfg.data.split,
           "val_split": cfg.data.val_split, "max_documents": cfg.data.max_documents}
    finished = _finished(out, key)
    if finished is not None:  # the same command again after it completed: nothing to do
        return finished
    done = _check_out(out, key)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / PROGRESS).exists():  # first, so a kill at any later moment can be rerun
        _atomic_json(out / PROGRESS, {"key": key, "splits": {"train": [], "val": []}})
    tok.save(out / "tokenizer")
    total = sum(s.get("bytes", 0) for s in sources) or None
    workers = workers or os.cpu_count() or 1
    splits: dict[str, list] = {"train": list(done.get("train", [])), "val": list(done.get("val", []))}
    bar = _progress_bar(total) if show_progress else None
    start = time.perf_counter()
    seen = {"docs": 0, "tokens": 0, "bytes": 0}
    pool = None
    try:
        if workers > 1:  # no multiprocessing.Pool: a SIGTERM to the group hung its terminate()
            pool = ShardPool(workers, init_worker, (str(out / "tokenizer"),), pool_shard)
        if bar is not None:
            bar.start()
            task = bar.add_task("prepare", total=total, docs=0, tokens=0, mbps=0.0)

        def record(entry: dict[str, Any], split: str) -> None:
            splits[split].append(entry)
            _atomic_json(out / PROGRESS, {"key": key, "splits": splits})
            if on_shard is not None:
                on_shard(out, entry)
            for k, v in (("docs", entry["documents"]), ("tokens", entry["tokens"]), ("bytes", entry["bytes"])):
                seen[k] += v
            if bar is not None:
                mbps = seen["bytes"] / 1e6 / max(time.perf_counter() - start, 1e-9)
                bar.update(task, completed=seen["bytes"], docs=seen["docs"], tokens=seen["tokens"], mbps=mbps)

        for split, ds in (("train", docs.train), ("val", docs.val)):
            if ds is None:
                continue
            release_free_heap()  # the train split's encoder objects, before val re-reads a long line
            (out / split).mkdir(exist_ok=True)
            for stale in (out / split).glob("shard_*.tmp"):  # of a killed run: rewritten below
                stale.unlink(missing_ok=True)
            finished = len(splits[split])
            pending = 0  # shards sent to the pool, not yet recorded
            for k, texts in enumerate(_blocks(ds, docs_per_shard, docs.files)):
                if k < finished:
                    continue  # written by the interrupted run: its documents are only re-read
                path = out / split / f"shard_{k:05d}.bin"
                if pool is None:
                    record(write_shard(tok, texts, path), split)
                    continue
                pool.submit((texts, str(path)))
                pending += 1
                del texts  # sent: the block's documents go with the next one read
                while pending >= 2 * workers or (pending and pool.ready()):
                    record(pool.result(), split)  # in order: progress lists a prefix
                    pending -= 1
            for _ in range(pending):
                record(pool.result(), split)
            texts = []  # the last block is not kept while the next split is read
    finally:
        if bar is not None:
            bar.stop()
        if pool is not None:
            pool.close()
    if not sum(s["tokens"] for s in splits["train"]):
        raise DataError(f"data: the source gave no training tokens; {out} is not usable")
    now = {path: (size, mtime) for path, size, mtime in _source_stats(cfg)}
    for path, size, mtime in read:
        if now.get(path) != (size, mtime):
            raise DataError(f"data: {path} changed while data prepare read it ({size:,} bytes before); the "
                            f"shards in {out} would not match the manifest's sources: delete {out} and run the "
                            "same command again once the file is complete")
    manifest = {
        "format": FORMAT, "complete": True, "dtype": token_dtype(tok.vocab_size).name,
        "tokenizer": {"fingerprint": fp, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                      "eos_id": tok.eos_id, "type": cfg.tokenizer.type, "path": cfg.tokenizer.path},
        "sources": sources, "seed": cfg.run.seed,
        "splits": {name: {"documents": sum(s["documents"] for s in shards),
                          "tokens": sum(s["tokens"] for s in shards),
                          "shards": [{k: s[k] for k in ("file", "tokens", "sha256")} for s in shards]}
                   for name, shards in splits.items() if shards},
        "seconds": round(time.perf_counter() - start, 3),
        "key": key,  # what a rerun of the same command compares (_finished)
    }
    _atomic_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def prepare_to_store(cfg: Any, url: str, **kwargs: Any) -> dict[str, Any]:
    """``llmforge data prepare SOURCE URL``: prepare into a local staging folder
    (``$LLMFORGE_CACHE/staging/<hash of URL>``) and upload to ``url`` with fsspec (credentials:
    ``data.storage_options`` or the environment): each shard when written (then deleted
    locally), the tokenizer, and the manifest last. Started again after an interruption, the
    staging folder's ``progress.json`` keeps the finished shards and those already uploaded
    whole (same size) are not sent again.

    Args:
        kwargs: as :func:`llmforge.data.prepare.prepare` (``workers``, ``docs_per_shard``,
            ``show_progress``).

    Returns:
        The manifest (also at ``url/manifest.json``).

    Raises:
        DataError: ``url`` already holds a prepared corpus or other files, the driver is
            missing, the store cannot be written, or as :func:`llmforge.data.prepare.prepare`.
    """
    fs, root = open_store(url, cfg.data.storage_options, "OUT")
    url = url.rstrip("/")
    _check_store_out(fs, root, url)
    staging = cache_root() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]
    uploaded: set[str] = set()

    def upload(out: Path, entry: dict[str, Any]) -> None:
        _upload(fs, out / entry["file"], f"{root}/{entry['file']}", url)
        uploaded.add(entry["file"])
        (out / entry["file"]).unlink()  # the staging folder holds only shards in flight

    if (staging / MANIFEST).exists():  # prepared and partly uploaded before an interruption
        manifest = parse_manifest((staging / MANIFEST).read_bytes(), staging)
    else:
        manifest = prepare(cfg, staging, on_shard=upload, **kwargs)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for info in manifest["splits"].values():  # shards finished before an interruption
        for s in info["shards"]:
            if s["file"] in uploaded or _remote_size(fs, f"{root}/{s['file']}") == s["tokens"] * itemsize:
                continue
            local = staging / s["file"]
            if not local.exists():
                raise DataError(f"OUT: {url}/{s['file']} is missing or partial and its local copy is "
                                f"gone; delete {staging} and run the prepare again")
            _upload(fs, local, f"{root}/{s['file']}", url)
    for path in sorted((staging / "tokenizer").rglob("*")):
        if path.is_file():
            _upload(fs, path, f"{root}/{path.relative_to(staging).as_posix()}", url)
    try:
        fs.pipe_file(f"{root}/{MANIFEST}", (staging / MANIFEST).read_bytes())  # last: marks it whole
    except OSError as exc:
        raise DataError(f"OUT: cannot write {url}/{MANIFEST} ({exc}); run the prepare again "
                        "(the uploaded shards are kept)") from exc
    shutil.rmtree(staging, ignore_errors=True)
    return manifest
