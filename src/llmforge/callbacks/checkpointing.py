"""Checkpointing: when to save, resuming, and preemption signals.

Saves every ``checkpoint.save_every`` steps, every ``checkpoint.save_every_minutes`` minutes,
after the last step, and on request: SIGTERM or SIGUSR1 (what schedulers send before
preemption or a time limit) make the trainer finish the current optimizer step, save, and exit
with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: "try again"), on which a scheduler can
requeue; ``checkpoint.resume=auto`` then continues from that step. Ctrl-C (SIGINT) does the
same and exits 130; a second Ctrl-C stops at once without saving. The handlers are
:mod:`llmforge.signals`' (installed when ``llmforge train`` starts; before training a signal
stops at once with nothing to save). See :mod:`llmforge.checkpoint.dcp` for the layout and the
atomic write.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from llmforge import __version__, signals
from llmforge.callbacks._util import say
from llmforge.checkpoint import latest_checkpoint
from llmforge.checkpoint.dcp import PendingSave, load_training_state, prune_checkpoints, save_checkpoint
from llmforge.checkpoint.plugins import (check_resume, checkpoint_meta, dropped_states, plain_states,
                                         restore_plain_states, restore_sharded_states, sharded_states)
from llmforge.checkpoint.rng import capture_rng, restore_rng
from llmforge.checkpoint.safe_load import CheckpointShapeError, resume_shape_error
from llmforge.errors import ConfigError, TrainingDiverged
from llmforge.parallel.lightning_private import optimizer_step_progress
from llmforge.signals import StopRequested


def agreed_stop_code(device: Any = None) -> int:
    """The exit code every rank stops with at this step: 0 if no rank received a stop signal, else
    the largest of their :func:`~llmforge.signals.exit_code_for` codes (130 where any rank got
    SIGINT, else 75), so one signalled rank stops the run with its own code on every rank.
    A collective (``all_reduce``, on ``device`` for NCCL) when a process group of several ranks
    is up; the local code otherwise."""
    sig = signals.received()
    code = torch.tensor(float(signals.exit_code_for(sig) if sig is not None else 0))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if device is not None:
            code = code.to(device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    return int(code.item())


class Preempted(StopRequested):
    """Training stopped on a signal after saving a checkpoint: exit code 75 for SIGTERM and
    SIGUSR1 (requeue), 130 for SIGINT (Ctrl-C)."""


def set_global_step(trainer: Any, step: int) -> None:
    """Make Lightning count ``step`` optimizer steps done (manual optimization)."""
    progress = optimizer_step_progress(trainer)
    progress.ready = progress.completed = step


class Checkpointer(Callback):
    """Writes ``<dir>/step_NNNNNNNN`` checkpoints and resumes from one.

    Acts on llmforge's events (:mod:`llmforge.events`): loads the resume checkpoint as the
    first handler of ``FIT_START`` (``order`` -1000), saves at ``STEP_RECORDED`` and
    ``FIT_END``. One Lightning hook stays: ``setup``, because Lightning installs its own SIGTERM
    handler during ``fit`` before any llmforge event (:func:`llmforge.signals.own`).

    Args:
        dir: checkpoint root folder.
        save_every: steps between saves; ``None`` = none.
        save_every_minutes: minutes between saves (checked after each step); ``None`` = none.
        save_final: save after the last step.
        keep_last_n: delete older checkpoints once a new one is complete.
        async_save: write through DCP's async save; training continues while files are written.
        resume_from: a complete checkpoint to load at the start of training.
        config: the resolved config, secrets redacted (into ``meta.json`` with its hash; a
            resume compares it, see :mod:`llmforge.checkpoint.resume_changes`).
        finite_only: before each save, check that every weight is finite (all ranks agree);
            if not, raise :class:`~llmforge.errors.TrainingDiverged` instead of writing, so the
            last finite checkpoint stays the newest (on with ``trainer.nan_guard``).
    """

    order = -1000  # first at FIT_START: the others see the resumed state

    def __init__(self, dir: str | Path, save_every: Optional[int] = None,
                 save_every_minutes: Optional[float] = None, save_final: bool = True,
                 keep_last_n: Optional[int] = None, async_save: bool = False,
                 resume_from: Optional[str | Path] = None, config: Optional[dict] = None,
                 on_resumed: Optional[Callable[[], None]] = None, finite_only: bool = False) -> None:
        self.dir = Path(dir)
        self.finite_only = finite_only
        self.on_resumed = on_resumed  # called once the resume checkpoint has loaded
        self.save_every, self.save_every_minutes = save_every, save_every_minutes
        self.save_final, self.keep_last_n, self.async_save = save_final, keep_last_n, async_save
        self.resume_from = Path(resume_from) if resume_from else None
        self.config = config or {}
        blob = json.dumps(self.config, sort_keys=True, default=str).encode()
        self.config_hash = hashlib.sha256(blob).hexdigest()[:16]
        self.last_saved_step: Optional[int] = None
        self.last_path: Optional[Path] = None
        self.pending: Optional[PendingSave] = None
        self.save_seconds: list[float] = []  # time the training thread spent in each save
        self._last_save_time = time.monotonic()
        self._awaiting_record: Optional[int] = None  # a step whose STEP_RECORDED is due
        self._owns_signals = False  # installed llmforge's handlers itself (not started by the CLI)

    # ------------------------------------------------------------------ saving
    def _finish_pending(self) -> None:
        if self.pending is not None:
            self.last_path = self.pending.finish()
            self.pending = None
            prune_checkpoints(self.dir, self.keep_last_n)

    def _check_finite(self, step: int, model: Any) -> None:
        """Raise :class:`TrainingDiverged` when a weight of any rank is not finite."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        checks = [torch.isfinite(t).all() for t in local if t.numel()]
        flag = torch.stack(checks).all().float() if checks else torch.tensor(1.0)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank refuses the same save
        if bool(flag.item()):
            return
        last = latest_checkpoint(self.dir)
        where = f"the last complete checkpoint, {last}, stays the newest" if last else "no checkpoint was written"
        raise TrainingDiverged(
            f"training diverged at step {step}: its update made weights non-finite; their checkpoint "
            f"was not written ({where}). {TrainingDiverged.hint}")

    def save(self, trainer: Any, pl_module: Any) -> Path:
        """Save now (every rank must call it); returns the checkpoint folder.

        Raises:
            TrainingDiverged: ``finite_only`` and a weight is NaN or infinite (nothing written).
        """
        start = time.perf_counter()
        self._finish_pending()  # at most one save in flight
        step = trainer.global_step
        if self.finite_only:
            self._check_finite(step, pl_module.model)
        opt = trainer.optimizers[0] if trainer.optimizers else None
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        dims = pl_module.model_context().dims
        state = {"step": step, "tokens_seen": pl_module.tokens_seen,
                 "global_batch_size": pl_module.plan.global_batch_size,
                 "samples_consumed": step * pl_module.plan.global_batch_size,
                 "scheduler": sched.state_dict() if sched is not None else None,
                 "callbacks": plain_states(trainer.callbacks, self)}
        meta = {"tokens_seen": pl_module.tokens_seen, "world_size": trainer.world_size,
                "mesh": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                         "tp": dims.tp},
                "config_hash": self.config_hash, "llmforge_version": __version__,
                "config": self.config}
        cfg = getattr(pl_module, "cfg", None)
        meta.update(checkpoint_meta(trainer.callbacks, cfg, pl_module.model) if cfg is not None else {})
        # data position (issue 16): each rank's datamodule.state_dict(), as data/rank<R>.json
        data_state = trainer.datamodule.state_dict() if getattr(trainer, "datamodule", None) else {}
        self.pending = save_checkpoint(self.dir, step, pl_module.model, opt, state, meta,
                                       rng=capture_rng(), async_save=self.async_save,
                                       adapters_only=bool(meta.get("adapters_only")),
                                       plugin_state=sharded_states(trainer.callbacks),
                                       rank_state={"data": data_state},
                                       # stages hold different parameters: per-parameter groups
                                       flatten_optimizer=dims.pp > 1)
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
        if not self.async_save:
            self._finish_pending()
        self.save_seconds.append(time.perf_counter() - start)
        return self.pending.final if self.pending is not None else self.last_path  # type: ignore[return-value]

    def save_now(self, trainer: Any, pl_module: Any) -> Optional[Path]:
        """Save the current step unless it is saved already, and wait for the write (a run
        about to exit, e.g. a replica group that lost its quorum); returns the checkpoint."""
        if self.last_saved_step != trainer.global_step:
            self.save(trainer, pl_module)
        self._finish_pending()
        return self.last_path

    # ---------------------------------------------------------------- resuming
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        signals.own(trainer)  # before fit installs Lightning's SIGTERM handler

    def fit_start(self, state: Any) -> None:
        """Event ``FIT_START`` (first): install the stop-signal handlers, load the resume
        checkpoint."""
        trainer, pl_module = state.trainer, state.module
        self._install_signal_handlers()
        if self.resume_from is None:
            return
        opt = trainer.optimizers[0] if trainer.optimizers else None
        if getattr(pl_module, "cfg", None) is not None:
            check_resume(self.resume_from, trainer.callbacks, pl_module.cfg, pl_module.model)
        from torch.distributed.checkpoint.api import CheckpointException

        templates = sharded_states(trainer.callbacks)
        try:
            state = load_training_state(self.resume_from, pl_module.model, opt, plugin_state=templates)
        except CheckpointShapeError as exc:
            raise resume_shape_error(exc) from exc
        except (ValueError, RuntimeError, KeyError, CheckpointException) as exc:  # shapes/keys differ

            lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
            # DCP's CheckpointException carries each rank's traceback; its last line is the cause
            first = (lines[-1] if isinstance(exc, CheckpointException) else lines[0]) if lines \
                else type(exc).__name__
            raise ConfigError(
                f"checkpoint.resume: {self.resume_from} does not fit this run's model or "
                f"optimizer ({first[:300]}); resume with the settings it was saved with (model "
                "shape, algorithms) or start a new run") from exc
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        if sched is not None and state.get("scheduler"):
            sched.load_state_dict(state["scheduler"])
        pl_module.tokens_seen = int(state.get("tokens_seen", 0))
        restore_plain_states(trainer.callbacks, state.get("callbacks") or {})
        for key in dropped_states(self.resume_from, trainer.callbacks, state.get("callbacks") or {}):
            say(trainer, f"checkpoint.resume: {self.resume_from} holds state of {key}, which this run "
                         "does not have: it is dropped (list the algorithm again to keep it)")
        for key in restore_sharded_states(trainer.callbacks, templates, state.get("plugins_loaded") or []):
            say(trainer, f"checkpoint.resume: {self.resume_from} has no state of {key}; it starts fresh")
        set_global_step(trainer, int(state["step"]))
        if "rng" in state:
            restore_rng(state["rng"])
        self.last_saved_step = int(state["step"])
        say(trainer, f"resumed from {self.resume_from} at step {int(state['step'])} "
                     f"({int(state.get('tokens_seen', 0)):,} tokens seen)")
        if self.on_resumed is not None:
            self.on_resumed()

    # ------------------------------------------------------------ when to save
    def _install_signal_handlers(self) -> None:
        self._owns_signals = signals.install()  # a no-op under `llmforge train` (installed at start)
        signals.training_started()

    def _restore_signal_handlers(self) -> None:
        signals.training_ended()
        if self._owns_signals:
            signals.uninstall()
            self._owns_signals = False

    def after_optimizer_step(self, state: Any) -> None:
        self._awaiting_record = state.step  # the step's STEP_RECORDED comes next

    def step_recorded(self, state: Any) -> None:
        """The last event of a step (``STEP_RECORDED``): save after the step's evaluation and
        record."""
        self._awaiting_record = None
        self.end_of_step(state.trainer, state.module)

    def batch_start(self, state: Any) -> None:
        # a module subclass whose on_train_batch_end skipped super(): save the last step now
        if self._awaiting_record is not None:
            self._awaiting_record = None
            self.end_of_step(state.trainer, state.module)

    def end_of_step(self, trainer: Any, pl_module: Any) -> None:
        """Save when due, or when a stop signal arrived (then raise :class:`Preempted`)."""
        step = trainer.global_step
        due = bool(self.save_every and step % self.save_every == 0)
        if self.save_every_minutes and time.monotonic() - self._last_save_time >= 60 * self.save_every_minutes:
            due = True
        nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
        code = agreed_stop_code(pl_module.device if nccl else None)
        if code:
            # not a logging step: write this last step's record anyway before stopping
            history = getattr(pl_module, "history", None)
            recorded = bool(history) and history[-1].get("step") == step
            if getattr(pl_module, "step_metrics", None) and hasattr(pl_module, "log_record") and not recorded:
                pl_module.log_record(step, pl_module.step_metrics)
            if self.last_saved_step != step:
                self.save(trainer, pl_module)
            self._finish_pending()
            sig = signals.received()
            name = signal.Signals(sig).name if sig else "a stop signal on another rank"
            raise Preempted(f"received {name}: saved the checkpoint of step {step} in {self.dir}; "
                            f"exit code {code} (continue with checkpoint.resume=auto)", code)
        if due:
            self.save(trainer, pl_module)

    def fit_end(self, state: Any) -> None:
        trainer, pl_module = state.trainer, state.module
        if self._awaiting_record is not None:
            self._awaiting_record = None
            self.end_of_step(trainer, pl_module)
        if self.save_final and self.last_saved_step != trainer.global_step:
            self.save(trainer, pl_module)
        self._finish_pending()
        self._restore_signal_handlers()

    def fit_exception(self, state: Any) -> None:
        self._restore_signal_handlers()
