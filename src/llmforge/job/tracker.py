"""``RunTracker``: the training process reports to the runs registry.

:meth:`llmforge.training.trainer.Trainer.build_callbacks` adds it on rank 0 when the
environment has ``LLMFORGE_RUN_ID`` (set by ``llmforge launch`` for every backend). It marks
the run ``running`` when training starts, records the last step and ``train/loss`` at every
logged step, and at the end marks it ``completed``, ``stopped`` (the run saved and exits 75 on
SIGTERM/SIGUSR1: :class:`~llmforge.signals.StopRequested`) or ``failed`` (any other
exception, with its message). Registry errors are reported once and never stop training.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from llmforge.job.records import RunRegistry
from llmforge.signals import StopRequested


class RunTracker(Callback):
    """Writes a run's progress into the registry.

    Args:
        run_id: the registry id (``LLMFORGE_RUN_ID``).
        db_path: the registry file; default ``$LLMFORGE_HOME/runs.db``.
    """

    def __init__(self, run_id: str, db_path: Optional[str] = None) -> None:
        self.run_id = run_id
        self.registry = RunRegistry(db_path)
        self._seen = 0
        self._warned = False

    def _safe(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # the registry must never break a training run
            if not self._warned:
                print(f"warning: runs registry {self.registry.path}: {exc}", file=sys.stderr)
                self._warned = True

    def _progress(self, pl_module: Any) -> dict[str, Any]:
        history = getattr(pl_module, "history", [])
        new = history[self._seen:]
        self._seen = len(history)
        out: dict[str, Any] = {}
        for record in new:
            out["last_step"] = int(record.get("step", 0))
            if "train/loss" in record:
                out["last_loss"] = float(record["train/loss"])
        return out

    def fit_start(self, state: Any) -> None:
        self._safe(self._start, state.trainer)

    def _start(self, trainer: Any) -> None:
        fields: dict[str, Any] = {"last_step": int(trainer.global_step)}
        base = os.environ.get("LLMFORGE_BASE_RESUMPTION")
        if base is not None:  # a scheduler job: each SLURM requeue is a new resumption
            fields["resumptions"] = int(base) + int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        run = self.registry.get(self.run_id)
        if run.started_at is None:
            import time

            fields["started_at"] = time.time()
        if run.status != "running":
            self.registry.set_status(self.run_id, "running", f"training started at step "
                                     f"{trainer.global_step}", **fields)
        else:
            self.registry.update(self.run_id, **fields)

    def step_recorded(self, state: Any) -> None:
        fields = self._progress(state.module)  # records up to this step's
        if fields:
            self._safe(self.registry.update, self.run_id, **fields)

    def fit_end(self, state: Any) -> None:
        trainer = state.trainer
        fields = {**self._progress(state.module), "last_step": int(trainer.global_step)}
        self._safe(self.registry.set_status, self.run_id, "completed",
                   f"training finished at step {trainer.global_step}", **fields)

    def fit_exception(self, state: Any) -> None:
        trainer, exception = state.trainer, state.exception
        fields = {**self._progress(state.module), "last_step": int(trainer.global_step)}  # steps done
        if isinstance(exception, StopRequested):  # saved and exits 75, or stopped before training
            self._safe(self.registry.set_status, self.run_id, "stopped", str(exception)[:500], **fields)
        else:
            msg = f"{type(exception).__name__}: {exception}"[:500]
            self._safe(self.registry.set_status, self.run_id, "failed", msg, message=msg, **fields)
