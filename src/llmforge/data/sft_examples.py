"""Supervised fine-tuning examples: reading and validating conversations for ``data.task: sft``.

Input: jsonl files (``data.path`` / ``data.paths``, globs; ``.jsonl``, optionally ``.gz``; local
or fsspec URLs), one example per line, or parquet files or a Hugging Face Hub dataset
(``data.source: hub``) with the same fields per row; each example is either

* ``{"prompt": "...", "response": "..."}`` (LLM Foundry's fields; names set by
  ``data.prompt_field`` / ``data.response_field``) -- a user turn and an assistant turn, or
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (OpenAI /
  HF chat format; ``data.messages_field``).

Bad lines raise :class:`~llmforge.errors.DataError` naming ``file:line`` (``file row N`` for
parquet and Hub rows): invalid JSON, neither format's fields, a field that is not text, an unknown role, an empty response (or no assistant
message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from llmforge.data.chat import ROLES
from llmforge.data.remote import plain_options
from llmforge.data.documents import hf_datasets
from llmforge.data.sources import _resolve_files, clean_text, hash_str
from llmforge.errors import DataError

__all__ = ["Conversation", "ConversationSplits", "parse_example", "read_jsonl", "read_rows",
           "load_conversations"]


@dataclass
class Conversation:
    """One example: its messages and where it came from (``file:line``)."""

    messages: list[dict[str, str]]
    where: str

    @property
    def text(self) -> str:
        """The contents joined by blank lines (for training a BPE on the data)."""
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass
class ConversationSplits:
    """Train and validation conversations, and a fingerprint of the files they came from."""

    train: list[Conversation]
    val: Optional[list[Conversation]]
    fingerprint: str


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__} "
                        f"({str(value)[:40]!r})")
    return clean_text(value)


def parse_example(row: Any, where: str, cfg: Any) -> Conversation:
    """Validate one decoded json line into a :class:`Conversation`.

    Args:
        row: the decoded value.
        where: ``file:line`` for messages.
        cfg: the ``data:`` section (field names).

    Raises:
        DataError: not an object; neither ``messages_field`` nor ``prompt_field`` +
            ``response_field``; a non-text field; an unknown role; an empty response or no
            assistant message with content.
    """
    pf, rf, mf = cfg.prompt_field, cfg.response_field, cfg.messages_field
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if mf in row:
        raw = row[mf]
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: field '{mf}' must be a non-empty list of "
                            "{role, content} objects")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: {mf}[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise DataError(f"{where}: {mf}[{i}].role {m['role']!r} is not one of "
                                f"{', '.join(ROLES)}")
            content = _text(m["content"], f"{mf}[{i}].content", where)
            if m["role"] == "assistant" and not content.strip():
                raise DataError(f"{where}: {mf}[{i}] is an assistant message with empty content "
                                "(an empty response teaches nothing); remove or fill it")
            messages.append({"role": m["role"], "content": content})
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: '{mf}' has no assistant message, so nothing would be "
                            "trained on; add the response")
        return Conversation(messages, where)
    if pf in row or rf in row:
        missing = [k for k in (pf, rf) if k not in row]
        if missing:
            raise DataError(f"{where}: missing field {missing[0]!r} (an example needs "
                            f"'{pf}' and '{rf}', or '{mf}'); found keys {sorted(row)}")
        prompt = _text(row[pf], pf, where)
        response = _text(row[rf], rf, where)
        if not response.strip():
            raise DataError(f"{where}: empty '{rf}' (an empty response teaches nothing); "
                            "remove the line or fill it")
        return Conversation([{"role": "user", "content": prompt},
                             {"role": "assistant", "content": response}], where)
    raise DataError(f"{where}: needs '{mf}' (a list of {{role, content}}) or '{pf}' and "
                    f"'{rf}'; found keys {sorted(row)} (set data.prompt_field, "
                    "data.response_field or data.messages_field for other names)")


def read_jsonl(path: str, cfg: Any) -> Iterator[Conversation]:
    """Conversations of one jsonl file (blank lines skipped), validated line by line.

    Raises:
        DataError: the file cannot be read, a line is not valid JSON, or
            :func:`parse_example` rejects it; messages name ``path:line``.
    """
    import fsspec

    try:
        f = fsspec.open(path, "rt", encoding="utf-8-sig", errors="replace", compression="infer",
                        **plain_options(cfg.storage_options)).open()
    except (OSError, ValueError) as exc:
        raise DataError(f"data.path: cannot open {path}: {exc}") from exc
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                "data.task=sft reads one JSON object per line") from exc
            yield parse_example(row, where, cfg)


def read_rows(ds: Any, label: str, cfg: Any) -> Iterator[Conversation]:
    """Conversations of a ``datasets`` split (parquet files, Hub datasets), validated row by
    row; messages name ``LABEL row N`` (1-based).

    Raises:
        DataError: :func:`parse_example` rejects a row.
    """
    for i, row in enumerate(ds, 1):
        yield parse_example(row, f"{label} row {i}", cfg)


def _file_kind(path: str, fmt: Optional[str]) -> str:
    if fmt:
        kind = {"jsonl": "json"}.get(fmt, fmt)
        if kind not in ("json", "parquet"):
            raise DataError(f"data.format: data.task=sft reads jsonl or parquet; got {fmt!r}")
        return kind
    base = path.removesuffix(".gz").removesuffix(".zst")
    if base.endswith((".jsonl", ".json")):
        return "json"
    if base.endswith(".parquet"):
        return "parquet"
    raise DataError(f"data.path: {path} is not a .jsonl or .parquet file; data.task=sft reads "
                    "jsonl (one JSON object per line) or parquet (set data.format for another "
                    "extension)")


def _take(it: Iterator[Conversation], limit: Optional[int], out: list[Conversation]) -> None:
    for c in it:
        if limit and len(out) >= limit:
            return
        out.append(c)


def _hold_out(convs: list[Conversation], fraction: float,
              seed: int) -> tuple[list[Conversation], Optional[list[Conversation]]]:
    if fraction <= 0:
        return convs, None
    if len(convs) < 2:
        raise DataError(f"data: {len(convs)} example(s) cannot be split into train and "
                        "validation; add examples or set data.val_fraction=0")
    perm = np.random.default_rng(seed).permutation(len(convs))
    n_val = min(len(convs) - 1, max(1, round(fraction * len(convs))))
    val_idx = set(perm[:n_val].tolist())
    return ([c for i, c in enumerate(convs) if i not in val_idx],
            [c for i, c in enumerate(convs) if i in val_idx])


def load_conversations(cfg: Any, seed: int) -> ConversationSplits:
    """Read the SFT examples of ``data:`` and split off validation.

    ``source: files``: every file of ``data.path``/``data.paths`` (jsonl, read line by line, or
    parquet); ``source: hub``: the Hub dataset ``data.path`` (config ``data.name``), split
    ``data.split``. Validation is ``data.val_split`` (hub only), else ``data.val_fraction`` of
    the examples (at least one, chosen by ``seed``). ``data.max_documents`` caps the examples
    read per split.

    Raises:
        DataError: another ``data.source``, a file that is neither jsonl nor parquet, no file
            matches, a bad line or row (see :func:`read_jsonl`, :func:`read_rows`), no example
            at all, or too few to hold out.
    """
    import os

    datasets = hf_datasets()
    limit = cfg.max_documents
    convs: list[Conversation] = []
    val: Optional[list[Conversation]] = None
    if cfg.source == "files":
        files = _resolve_files(cfg)
        kinds = [_file_kind(f, cfg.format) for f in files]
        for f, kind in zip(files, kinds):
            if kind == "json":
                _take(read_jsonl(f, cfg), limit, convs)
            else:
                ds = datasets.load_dataset("parquet", data_files=[f], split="train",
                                           storage_options=plain_options(cfg.storage_options) or None)
                _take(read_rows(ds, f, cfg), limit, convs)
        stats = [(f, os.path.getsize(f), int(os.path.getmtime(f))) if os.path.exists(f) else (f,)
                 for f in files]
        origin = f"files {files}"
        fingerprint = hash_str(f"sft-{stats}-{limit}")
    elif cfg.source == "hub":
        if not cfg.path:
            raise DataError("data.source=hub needs data.path, the dataset name")

        def split(name: str) -> Any:
            try:
                return datasets.load_dataset(cfg.path, cfg.name, split=name)
            except Exception as exc:  # hub errors come in many types
                raise DataError(f"data.path: cannot load hub dataset '{cfg.path}' split "
                                f"'{name}': {exc}") from exc

        _take(read_rows(split(cfg.split), f"{cfg.path}[{cfg.split}]", cfg), limit, convs)
        if cfg.val_split:
            val = []
            _take(read_rows(split(cfg.val_split), f"{cfg.path}[{cfg.val_split}]", cfg), limit, val)
        origin = f"hub dataset {cfg.path} split {cfg.split}"
        fingerprint = hash_str(f"sft-hub-{cfg.path}-{cfg.name}-{cfg.split}-{cfg.val_split}-{limit}")
    else:
        raise DataError(f"data.task=sft reads jsonl/parquet files (data.source=files) or a Hub "
                        f"dataset (data.source=hub); got data.source={cfg.source}")
    if not convs:
        raise DataError(f"data: {origin} hold no examples")
    if val is None:
        convs, val = _hold_out(convs, cfg.val_fraction, seed)
    return ConversationSplits(convs, val or None, fingerprint)
