"""Checks and repairs of a run's files at start: the metrics file cut back to a resume's step,
a damaged resume checkpoint named before anything is built, the run directory checked again
under its lock, the tokenizer cache key and the tokenizer check of ``model.init_from``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from llmforge.checkpoint.dcp import check_checkpoint
from llmforge.checkpoint.layout import latest_checkpoint
from llmforge.checkpoint.run_dir import resolve_checkpoint
from llmforge.checkpoint.safe_load import CheckpointReadError
from llmforge.data.tokenizers import load_saved, Tokenizer
from llmforge.errors import ConfigError, LLMForgeError

__all__ = ["check_init_from_tokenizer", "check_resumable", "recheck_run_dir", "truncate_metrics"]


def _inside(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def truncate_metrics(path: Path, step: int) -> int:
    """Drop records after ``step`` from a metrics file (they are redone after a resume), and
    lines that are not JSON records (torn by a killed process); ``step=-1`` drops every record.
    Returns how many lines were dropped. The file is replaced atomically."""
    if not path.exists():
        return 0
    import json

    def kept(line: str) -> bool:
        try:
            record = json.loads(line)
        except ValueError:
            return False  # a line torn by a killed process: its step is redone anyway
        return isinstance(record, dict) and record.get("step", 0) <= step

    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = [x for x in lines if x.strip() and kept(x)]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
        os.replace(tmp, path)
    return len(lines) - len(keep)


TOKENIZER_PROBE = "ROMEO. But, soft! what light through yonder window breaks? 0123456789 \u00e9\n"


def check_init_from_tokenizer(tok: Tokenizer, init_from: Optional[str]) -> None:
    """Refuse to start from an llmforge run's weights with a tokenizer that maps text to other
    ids than the one that run trained with (its embeddings would be read with the wrong rows).

    Compares the vocabulary size, the special ids and the encoding of a probe text with the
    tokenizer saved in that run (``<run>/tokenizer``); ``hf:`` sources and runs without a
    saved tokenizer are not checked.

    Raises:
        ConfigError: they differ; the message names the tokenizer to use.
    """
    if not init_from or init_from.startswith("hf:"):
        return
    try:
        run_dir, _ = resolve_checkpoint(init_from)
    except LLMForgeError:
        return  # reported when the weights are loaded
    if not (run_dir / "tokenizer").is_dir():
        return
    saved = load_saved(run_dir / "tokenizer")
    same = (saved.vocab_size == tok.vocab_size and saved.bos_id == tok.bos_id
            and saved.eos_id == tok.eos_id and saved.encode(TOKENIZER_PROBE) == tok.encode(TOKENIZER_PROBE))
    if not same:
        path = run_dir / "tokenizer" / "tokenizer.json"
        hint = (f"tokenizer.type=huggingface tokenizer.path={path}" if path.exists()
                else f"the tokenizer saved in {run_dir / 'tokenizer'}")
        raise ConfigError(
            f"model.init_from: {run_dir} was trained with another tokenizer than this run's "
            f"(vocabulary {saved.vocab_size} vs {tok.vocab_size}, or other ids for the same text); "
            f"its embeddings would be read with the wrong rows; use {hint}")


def check_resumable(path: Path, complete: list[Path]) -> None:
    """A damaged resume checkpoint fails before data and model are built, naming the file and
    the newest older complete checkpoint (from ``complete``) to resume from instead.

    Raises:
        CheckpointReadError: see :func:`llmforge.checkpoint.dcp.check_checkpoint`.
    """
    try:
        check_checkpoint(path)
    except CheckpointReadError as exc:
        older = [p for p in complete if p.name < path.name]
        if not older:
            raise
        raise CheckpointReadError(f"{exc}; the previous checkpoint is "
                                  f"checkpoint.resume={older[-1]}") from None


def recheck_run_dir(run_dir: Path, checkpoint_dir: Path, used: bool, resume_from: Optional[Path],
                    auto: bool) -> None:
    """Under the run directory's lock, before the first write: the directory is still as it was
    when the run was resolved (before the lock was taken, while data, tokenizer and model were
    prepared). Another process may have trained into it meanwhile; writing now would replace its
    config, metrics and tokenizer.

    Args:
        used: whether it held a run then (``metrics.jsonl`` or a complete checkpoint).
        resume_from: the checkpoint chosen then (``checkpoint.resume``), or None.
        auto: ``checkpoint.resume=auto`` without ``--overwrite`` (the newest complete
            checkpoint is compared too).

    Raises:
        ConfigError: it changed; nothing was written, running the command again decides anew.
    """
    newest = latest_checkpoint(checkpoint_dir)
    now_used = (run_dir / "metrics.jsonl").exists() or newest is not None
    if now_used != used or (auto and newest != resume_from):
        if auto and newest != resume_from:
            was, now = (f"the newest checkpoint was {resume_from or 'none'}",
                        f"it is {newest or 'none'}")
        else:
            was, now = ("it held a run", "it holds none") if used else ("it held no run", "it holds one")
        raise ConfigError(f"run directory {run_dir} changed while this command prepared ({was}, now "
                          f"{now}): another process wrote it before this one took its lock; nothing "
                          "was written: run the command again")
