"""``nan_guard``: stop at the first non-finite loss or gradient norm, before the update.

On by default (``trainer.nan_guard: true`` adds one with the defaults below; ``false`` is the
explicit opt-out). An entry in ``callbacks:`` configures it instead::

    callbacks:
      - name: nan_guard
        check_grad_norm: true   # also stop on a non-finite train/grad_norm
        max_loss: null          # also stop when train/loss exceeds this (nats per token)

The module fills ``state.metrics`` (``train/loss``, ``train/grad_norm``) before
``optimizer.step()``; this callback checks them at the event ``BEFORE_OPTIMIZER_STEP``, as its
last handler (a step another handler skipped, e.g. by ``loss_spike_guard``, is not
checked: it changes nothing), and raises
:class:`llmforge.errors.TrainingDiverged` (``llmforge train`` exits with code 3). The bad
update is never applied and no checkpoint is written from that state: the last complete
checkpoint stays as it was; with the guard on, the checkpointer also refuses to write
non-finite weights (:class:`llmforge.callbacks.checkpointing.Checkpointer`, ``finite_only``).
Cost: one host sync of one scalar per step (the loss and the norm are checked together).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.callbacks.checkpointing import Checkpointer
from llmforge.checkpoint import latest_checkpoint
from llmforge.errors import ConfigError, TrainingDiverged


def _value(v: Any) -> Optional[float]:
    if v is None:
        return None
    return float(v.item()) if hasattr(v, "item") else float(v)


class NaNGuard(Callback):
    """Raises :class:`~llmforge.errors.TrainingDiverged` at the first bad optimizer step.

    Args:
        check_grad_norm: also check ``train/grad_norm`` (the norm before clipping).
        max_loss: also stop when ``train/loss`` is above this many nats per token; ``None`` =
            only non-finite values stop the run.

    Raises:
        ConfigError: ``max_loss`` <= 0.
        TrainingDiverged: during training, at the first bad step (exit code 3).
    """

    order = 200  # after loss_spike_guard (100), which may skip the step instead

    def __init__(self, check_grad_norm: bool = True, max_loss: Optional[float] = None) -> None:
        if max_loss is not None and not float(max_loss) > 0:
            raise ConfigError(f"callbacks: nan_guard: max_loss must be > 0; got {max_loss!r}")
        self.check_grad_norm = bool(check_grad_norm)
        self.max_loss = float(max_loss) if max_loss is not None else None

    def problems(self, metrics: dict[str, Any]) -> list[str]:
        """What is wrong with one step's metrics (empty when the step is fine)."""
        out = []
        loss = _value(metrics.get("train/loss"))
        if loss is not None and not math.isfinite(loss):
            out.append(f"train/loss = {loss}")
        elif loss is not None and self.max_loss is not None and loss > self.max_loss:
            out.append(f"train/loss = {loss:.4f} > max_loss {self.max_loss:g}")
        norm = _value(metrics.get("train/grad_norm")) if self.check_grad_norm else None
        if norm is not None and not math.isfinite(norm):
            out.append(f"train/grad_norm = {norm}")
        return out

    def _all_finite(self, metrics: dict[str, Any]) -> bool:
        """One host sync for the usual case: the loss and the norm finite together."""
        values = [metrics.get("train/loss")] + ([metrics.get("train/grad_norm")] if self.check_grad_norm else [])
        tensors = [torch.as_tensor(v, dtype=torch.float32).reshape(())
                   for v in values if v is not None]
        if not tensors:
            return True
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        return bool(torch.isfinite(torch.stack([t.to(device) for t in tensors])).all())

    def before_optimizer_step(self, state: Any) -> None:
        if state.skip_step or (self.max_loss is None and self._all_finite(state.metrics)):
            return
        bad = self.problems(state.metrics)
        if not bad:
            return
        trainer, step = state.trainer, state.step
        ckpt = self._last_checkpoint(trainer)
        where = f"the last complete checkpoint, {ckpt}, is intact" if ckpt else "no checkpoint was written before it"
        raise TrainingDiverged(
            f"training diverged at step {step}: {', '.join(bad)}; stopped before the update of this "
            f"step (nothing was saved from it; {where}). {TrainingDiverged.hint}")

    @staticmethod
    def _last_checkpoint(trainer: Any) -> Optional[str]:
        for cb in trainer.callbacks:
            if isinstance(cb, Checkpointer):
                path = latest_checkpoint(cb.dir)
                return str(path) if path is not None else None
        return None
