"""Saves checkpoints every ``checkpoint.save_every`` steps and after the last step.

See :mod:`llmforge.checkpoint.dcp` for the layout and the atomic write.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from llmforge.checkpoint.dcp import prune_checkpoints, save_checkpoint


class Checkpointer(Callback):
    """Writes ``<dir>/step_NNNNNNNN`` checkpoints with model, optimizer and trainer state.

    Args:
        dir: checkpoint root folder.
        save_every: steps between saves; ``None`` = only at the end.
        save_final: save after the last step.
        keep_last_n: prune older checkpoints after each complete save.
        config: the resolved config (its hash goes into ``meta.json``).
    """

    def __init__(self, dir: str | Path, save_every: Optional[int] = None, save_final: bool = True,
                 keep_last_n: Optional[int] = None, config: Optional[dict] = None) -> None:
        self.dir = Path(dir)
        self.save_every, self.save_final, self.keep_last_n = save_every, save_final, keep_last_n
        blob = json.dumps(config or {}, sort_keys=True, default=str).encode()
        self.config_hash = hashlib.sha256(blob).hexdigest()[:16]
        self.last_saved_step: Optional[int] = None
        self.last_path: Optional[Path] = None

    def save(self, trainer: Any, pl_module: Any) -> Path:
        """Save now (every rank must call it)."""
        from llmforge import __version__

        step = trainer.global_step
        opt = trainer.optimizers[0] if trainer.optimizers else None
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        state = {"step": step, "tokens_seen": pl_module.tokens_seen,
                 "scheduler": sched.state_dict() if sched is not None else None}
        mesh = {"world_size": trainer.world_size, "dp_size": pl_module.plan.dp_size}
        meta = {"tokens_seen": pl_module.tokens_seen, **mesh, "config_hash": self.config_hash,
                "llmforge_version": __version__}
        self.last_path = save_checkpoint(self.dir, step, pl_module.model, opt, state, meta)
        self.last_saved_step = step
        prune_checkpoints(self.dir, self.keep_last_n)
        return self.last_path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.save_every and step % self.save_every == 0:
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_final and self.last_saved_step != trainer.global_step:
            self.save(trainer, pl_module)
