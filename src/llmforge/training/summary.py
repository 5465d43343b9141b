"""The closing summary of a run (what ``llmforge train`` prints last and ``Trainer.fit`` returns):
steps, tokens, seconds, first and last losses, what stopped the run early, paths."""

from __future__ import annotations

import json
from typing import Any, Optional

from lightning.pytorch.callbacks import EarlyStopping as LightningEarlyStopping
from lightning.pytorch.callbacks import Timer

from llmforge.callbacks import Checkpointer

__all__ = ["earlier_eval", "run_summary", "stopped_by"]


def earlier_eval(trainer: Any) -> dict[str, Any]:
    """After a resume: the run's first evaluation record (step 0 of the first attempt) from
    ``metrics.jsonl``, the closing line's baseline; ``{}`` for a fresh run, without a jsonl
    logger or when the file cannot be read."""
    path = trainer.run_dir / "metrics.jsonl"
    if trainer.run.resume_from is None or not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if "eval/loss" in record:
                    return record
    except (OSError, ValueError):
        pass
    return {}


def stopped_by(trainer: Any) -> Optional[str]:
    """What ended the run before ``trainer.max_steps`` (a callback that set
    ``trainer.should_stop``), in words; ``None`` when it reached them."""
    if trainer.lightning.global_step >= trainer.cfg.trainer.max_steps:
        return None
    for cb in trainer.lightning.callbacks:
        left = cb.time_remaining("train") if isinstance(cb, Timer) else None  # None: no duration
        if left is not None and left <= 0.0:
            return "Lightning's Timer: its duration passed"
        if getattr(cb, "stopped_step", None) is not None:  # llmforge's early_stopping
            return f"{type(cb).__name__}: eval/loss stopped improving"
        if isinstance(cb, LightningEarlyStopping) and cb.wait_count >= cb.patience:
            return f"Lightning's EarlyStopping: {cb.monitor} stopped improving"
    return "a callback set trainer.should_stop"


def run_summary(trainer: Any, seconds: float) -> dict[str, Any]:
    """The summary of ``trainer`` (an :class:`llmforge.Trainer` after ``fit``) that ran for
    ``seconds`` (wall clock): steps, tokens, losses (``None`` where not measured), paths."""
    history = trainer.module.history
    train = [r for r in history if "train/loss" in r]
    ckpt = next((c.last_path for c in trainer.lightning.callbacks if isinstance(c, Checkpointer)), None)
    last_eval = trainer.module.last_eval or {}
    evals = [r for r in history if "eval/loss" in r]
    first_eval = earlier_eval(trainer) or (evals[0] if evals else {})
    if evals and first_eval.get("step") == evals[-1]["step"]:
        first_eval = {}  # one evaluation only: nothing to compare it with
    return {
        "steps": trainer.lightning.global_step,
        "max_steps": int(trainer.cfg.trainer.max_steps),
        "resumed_step": trainer.resumed_step,
        "stopped_by": stopped_by(trainer),
        "tokens": trainer.module.tokens_seen,
        "seconds": seconds,
        "final_train_loss": train[-1]["train/loss"] if train else None,
        "initial_eval_loss": first_eval.get("eval/loss"),
        "initial_eval_step": first_eval.get("step"),
        "final_eval_loss": last_eval.get("eval/loss"),
        "run_dir": str(trainer.run_dir),
        "checkpoint": str(ckpt) if ckpt else None,
        "data_task": trainer.cfg.data.task,
    }
