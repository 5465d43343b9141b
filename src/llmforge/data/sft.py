"""Supervised fine-tuning data (``data.task: sft``): jsonl conversations -> masked, packed rows.

Input: jsonl files (``data.path`` / ``data.paths``, globs; ``.jsonl``, optionally ``.gz``; local
or fsspec URLs), one example per line, or parquet files or a Hugging Face Hub dataset
(``data.source: hub``) with the same fields per row; each example is either

* ``{"prompt": "...", "response": "..."}`` (LLM Foundry's fields; names set by
  ``data.prompt_field`` / ``data.response_field``) -- a user turn and an assistant turn, or
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` (OpenAI /
  HF chat format; ``data.messages_field``).

Each example is rendered with the chat template (:mod:`llmforge.data.chat`, Llama 3 by
default) into ids ``s`` (``len(s) = n``) and a target flag per id. Like a pretraining window, an
example of ``n`` ids gives ``n - 1`` positions: inputs ``s[:-1]``, labels ``s[1:]`` with -100
wherever the predicted id is not a target (prompt, system, user, headers). The ``<|eot_id|>``
after each response is a target. Padding is never recognised by its id: padded positions get
label -100 when the row is built, so a padding id equal to EOS cannot hide a real EOS target.

Rows are ``seq_len`` positions. ``data.packed: true`` (torchtune's ``packed``) fills a row with
consecutive examples (next-fit, in file order) and records ``doc_ids`` (example index within the
row; the padding tail gets its own id), from which the model restarts positions per example and
masks attention block-diagonally; ``packed: false`` puts one example per row, right-padded
(plain causal attention, no ``doc_ids``). An example longer than ``seq_len + 1`` ids follows
``data.overlong``: ``drop`` (default; counted and reported), ``truncate`` (keep the first
``seq_len + 1`` ids; dropped if no target survives) or ``error``.

Bad lines raise :class:`~llmforge.errors.DataError` naming ``file:line`` (``file row N`` for
parquet and Hub rows): invalid JSON, neither
format's fields, a field that is not text, an unknown role, an empty response (or no assistant
message).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from llmforge.data.chat import ROLES, ChatTemplate
from llmforge.data.datamodule import LLMDataModule
from llmforge.data.sources import _resolve_files, clean_text, hash_str
from llmforge.errors import DataError

__all__ = ["Conversation", "ConversationSplits", "SFTStats", "parse_example", "read_jsonl",
           "load_conversations", "read_rows", "encode_examples", "build_rows", "SFTRows", "SFTDataModule",
           "resolve_pad_id", "OVERLONG", "IGNORE_INDEX"]

IGNORE_INDEX = -100
from llmforge.config.schema import OVERLONG  # noqa: E402  (listed once, with its key)


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
                        **(dict(cfg.storage_options) or {})).open()
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

    import datasets

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
                                           storage_options=dict(cfg.storage_options) or None)
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


@dataclass
class SFTStats:
    """What became of the examples of one split."""

    examples: int = 0
    """Conversations read."""
    kept: int = 0
    """Examples in the rows."""
    dropped_overlong: int = 0
    """Longer than ``seq_len + 1`` ids and dropped (``overlong: drop``)."""
    truncated: int = 0
    """Cut to ``seq_len + 1`` ids (``overlong: truncate``)."""
    dropped_no_target: int = 0
    """Truncated until no target id was left, and dropped."""
    rows: int = 0
    positions: int = 0
    """Non-padding positions in the rows."""
    targets: int = 0
    """Positions with a label (loss tokens)."""
    first_overlong: Optional[str] = field(default=None)
    """``file:line`` of the first dropped or truncated example."""

    def summary(self, seq_len: int) -> str:
        fill = self.positions / max(1, self.rows * seq_len)
        parts = [f"{self.examples} examples -> {self.rows} rows of {seq_len} "
                 f"({fill:.0%} filled, {self.targets:,} target tokens)"]
        if self.dropped_overlong:
            parts.append(f"{self.dropped_overlong} longer than seq_len+1={seq_len + 1} dropped "
                         f"(first: {self.first_overlong})")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to {seq_len + 1} ids (first: "
                         f"{self.first_overlong})")
        if self.dropped_no_target:
            parts.append(f"{self.dropped_no_target} dropped: no response token left after "
                         "truncation")
        return "; ".join(parts)


def encode_examples(convs: list[Conversation], template: ChatTemplate, seq_len: int,
                    overlong: str = "drop", train_on_input: bool = False,
                    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], SFTStats]:
    """Tokenize conversations into ``(input_ids, labels)`` pairs (int64, equal length
    ``n - 1 <= seq_len`` for an example of ``n`` ids; labels -100 where the next id is not a
    target).

    Raises:
        DataError: ``overlong='error'`` and an example has more than ``seq_len + 1`` ids (names
            ``file:line`` and the lengths), or an unknown ``overlong``.
    """
    if overlong not in OVERLONG:
        raise DataError(f"data.overlong: expected one of {', '.join(OVERLONG)}; got {overlong!r}")
    stats = SFTStats(examples=len(convs))
    out = []
    for c in convs:
        ids, targets = template.tokenize(c.messages, train_on_input)
        if len(ids) > seq_len + 1:
            if overlong == "error":
                raise DataError(f"{c.where}: the example is {len(ids)} tokens, longer than "
                                f"trainer.seq_len+1 = {seq_len + 1}; shorten it, raise "
                                "trainer.seq_len, or set data.overlong=drop or truncate")
            stats.first_overlong = stats.first_overlong or c.where
            if overlong == "drop":
                stats.dropped_overlong += 1
                continue
            ids, targets = ids[:seq_len + 1], targets[:seq_len + 1]
            if not any(targets[1:]):
                stats.dropped_no_target += 1
                continue
            stats.truncated += 1
        arr = np.asarray(ids, dtype=np.int64)
        labels = np.where(np.asarray(targets[1:], dtype=bool), arr[1:], IGNORE_INDEX)
        out.append((arr[:-1], labels))
        stats.kept += 1
        stats.positions += len(arr) - 1
        stats.targets += int((labels != IGNORE_INDEX).sum())
    return out, stats


def build_rows(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
               packed: bool = True) -> dict[str, np.ndarray]:
    """Lay examples into rows of ``seq_len`` positions.

    Returns:
        ``{"input_ids", "labels"}`` (and ``"doc_ids"`` when ``packed``), each ``[rows,
        seq_len]``, stored compactly (input ids uint16 or uint32 by the largest id;
        labels and doc ids int32; :class:`SFTRows` hands out int64). Padding: input ``pad_id``,
        label -100, and (packed) a doc id of its own (one past the row's last example), so no
        example attends to it.
    """
    from llmforge.data.packing import token_dtype

    top = max([pad_id] + [int(ids.max()) for ids, _ in examples if len(ids)])
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len + 1  # forces a new row at the first example
    for ex in examples:
        n = len(ex[0])
        if not packed or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += n
    shape = (len(rows), seq_len)
    input_ids = np.full(shape, pad_id, dtype=token_dtype(top + 1))
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)
    doc_ids = np.zeros(shape, dtype=np.int32)
    for r, row in enumerate(rows):
        pos = 0
        for d, (ids, lab) in enumerate(row):
            input_ids[r, pos:pos + len(ids)] = ids
            labels[r, pos:pos + len(ids)] = lab
            doc_ids[r, pos:pos + len(ids)] = d
            pos += len(ids)
        doc_ids[r, pos:] = len(row)
    out = {"input_ids": input_ids, "labels": labels}
    if packed:
        out["doc_ids"] = doc_ids
    return out


class SFTRows(Dataset):
    """Map-style dataset over :func:`build_rows` output: item ``i`` is a dict of
    ``LongTensor[seq_len]`` (``input_ids``, ``labels``, and ``doc_ids`` when packed)."""

    def __init__(self, rows: dict[str, np.ndarray]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return {k: torch.from_numpy(v[i].astype(np.int64)) for k, v in self.rows.items()}


def resolve_pad_id(configured: Optional[int], tokenizer: Any, stop_id: int) -> int:
    """The padding input id: ``data.pad_id`` if set, else the tokenizer's pad token, else the
    smallest id that is neither EOS nor the template's stop token. Which id pads does not
    change the loss (padding has label -100 and, packed, its own document)."""
    if configured is not None:
        if not 0 <= configured < tokenizer.vocab_size:
            raise DataError(f"data.pad_id={configured} is outside the vocabulary "
                            f"[0, {tokenizer.vocab_size}); use null (the tokenizer's pad token)")
        return int(configured)
    if tokenizer.pad_id is not None:
        return int(tokenizer.pad_id)
    return min({0, 1, 2} - {tokenizer.eos_id, stop_id})


class SFTDataModule(LLMDataModule):
    """Train and validation loaders of SFT rows (dict batches: ``input_ids``, ``labels``
    ``LongTensor[B, seq_len]``, -100 = no target, and ``doc_ids`` when packed).

    Args:
        docs: :class:`ConversationSplits`.
        tokenizer: a :class:`~llmforge.data.tokenizers.Tokenizer`.
        template: the chat template (:func:`llmforge.data.chat.build_chat_template`).
        packed, overlong, train_on_input, pad_id: ``data.packed``, ``data.overlong``,
            ``data.train_on_input``, ``data.pad_id``.
        other arguments: as :class:`LLMDataModule`.

    Raises:
        DataError (at ``setup``): fewer training rows per data-parallel rank than one optimizer
            step needs, no example left, or an over-long example with ``overlong: error``.
    """

    def __init__(self, docs: ConversationSplits, tokenizer: Any, *, template: ChatTemplate,
                 packed: bool = True, overlong: str = "drop", train_on_input: bool = False,
                 pad_id: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(docs, tokenizer, **kwargs)  # type: ignore[arg-type]
        self.template, self.packed, self.overlong = template, packed, overlong
        self.train_on_input = train_on_input
        self.pad_id = resolve_pad_id(pad_id, tokenizer, template.stop_id)
        self.stats: dict[str, SFTStats] = {}

    def _rows(self, convs: list[Conversation], split: str) -> SFTRows:
        examples, stats = encode_examples(convs, self.template, self.seq_len, self.overlong,
                                          self.train_on_input)
        rows = build_rows(examples, self.seq_len, self.pad_id, self.packed)
        stats.rows = len(rows["input_ids"])
        self.stats[split] = stats
        if self.dp_rank == 0:
            print(f"sft {split}: {stats.summary(self.seq_len)}", file=sys.stderr, flush=True)
        return SFTRows(rows)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_windows is not None:
            return
        rank, world = self._coords()
        self.dp_rank, self.dp_size = rank, world
        self.train_windows = self._rows(self.docs.train, "train")
        self.train_tokens = self.stats["train"].positions
        per_rank = len(self.train_windows) // world
        if per_rank < self.local_batch_size:
            s = self.stats["train"]
            raise DataError(
                f"data: the SFT training split gives {len(self.train_windows)} rows of "
                f"{self.seq_len} tokens ({s.kept} of {s.examples} examples kept, packed="
                f"{self.packed}), {per_rank} per data-parallel rank ({world} ranks), but one "
                f"optimizer step needs {self.local_batch_size} per rank; "
                + ("most examples were dropped as too long: raise trainer.seq_len or set "
                   "data.overlong=truncate" if s.dropped_overlong + s.dropped_no_target > s.kept else
                   "add examples or lower trainer.global_batch_size"
                   + (" (or trainer.seq_len: rows are packed)" if self.packed else "")))
        if self.docs.val:
            self.val_windows = self._rows(self.docs.val, "val")
            if len(self.val_windows) < world:
                raise DataError(f"data: the SFT validation split gives {len(self.val_windows)} "
                                f"rows, fewer than one per rank ({world} ranks); raise "
                                "data.val_fraction or set it to 0")
