"""Supervised fine-tuning data (``data.task: sft``): jsonl conversations -> masked, packed rows.

Examples are read and validated by :mod:`llmforge.data.sft_examples` (jsonl, parquet, Hub;
prompt/response or messages); their names are importable from here too.

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
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from llmforge.data.chat import ChatTemplate
from llmforge.data.datamodule import LLMDataModule
from llmforge.data.sft_examples import (Conversation, ConversationSplits, load_conversations,
                                        parse_example, read_jsonl, read_rows)
from llmforge.errors import DataError
from llmforge.events import IGNORE_INDEX

__all__ = ["Conversation", "ConversationSplits", "SFTStats", "parse_example", "read_jsonl",
           "load_conversations", "read_rows", "encode_examples", "build_rows", "SFTRows", "SFTDataModule",
           "resolve_pad_id", "OVERLONG"]

from llmforge.config.schema import OVERLONG  # noqa: E402  (listed once, with its key)
from llmforge.data.packing import token_dtype


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
        ``{"input_ids", "labels", "token_mask"}`` (and ``"doc_ids"`` when ``packed``), each
        ``[rows, seq_len]``, stored compactly (input ids uint16 or uint32 by the largest id;
        labels and doc ids int32; :class:`SFTRows` hands out int64; ``token_mask`` bool, False
        on padding: what a mixture of experts keeps out of its router statistics). Padding:
        input ``pad_id``, label -100, and (packed) a doc id of its own (one past the row's last
        example), so no example attends to it.
    """
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
    token_mask = np.zeros(shape, dtype=bool)
    for r, row in enumerate(rows):
        pos = 0
        for d, (ids, lab) in enumerate(row):
            input_ids[r, pos:pos + len(ids)] = ids
            labels[r, pos:pos + len(ids)] = lab
            doc_ids[r, pos:pos + len(ids)] = d
            pos += len(ids)
        doc_ids[r, pos:] = len(row)
        token_mask[r, :pos] = True
    out = {"input_ids": input_ids, "labels": labels, "token_mask": token_mask}
    if packed:
        out["doc_ids"] = doc_ids
    return out


class SFTRows(Dataset):
    """Map-style dataset over :func:`build_rows` output: item ``i`` is a dict of
    ``LongTensor[seq_len]`` (``input_ids``, ``labels``, and ``doc_ids`` when packed) and
    ``BoolTensor[seq_len]`` ``token_mask``."""

    def __init__(self, rows: dict[str, np.ndarray]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return {k: torch.from_numpy(v[i] if v.dtype == bool else v[i].astype(np.int64))
                for k, v in self.rows.items()}


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
    ``LongTensor[B, seq_len]``, -100 = no target, ``token_mask`` ``BoolTensor[B, seq_len]``,
    False = padding, and ``doc_ids`` when packed).

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
                f"{self.packed}), {per_rank} per data-parallel rank ({world} rank{'s' * (world != 1)}), but one "
                f"optimizer step needs {self.local_batch_size} per rank; "
                + ("most examples were dropped as too long: raise trainer.seq_len or set "
                   "data.overlong=truncate" if s.dropped_overlong + s.dropped_no_target > s.kept else
                   "add examples or lower trainer.global_batch_size"
                   + (" (or trainer.seq_len: rows are packed)" if self.packed else "")))
        if self.docs.val:
            self.val_windows = self._rows(self.docs.val, "val")
            if len(self.val_windows) < world:
                raise DataError(f"data: the SFT validation split gives {len(self.val_windows)} "
                                f"rows, fewer than one per rank ({world} rank{'s' * (world != 1)}); raise "
                                "data.val_fraction or set it to 0")
