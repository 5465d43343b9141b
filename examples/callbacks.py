"""A research callback: a smoothed loss and a loss-spike counter, added to every record.

Named in YAML by its import path (see ``examples/custom_callback.yaml``)::

    callbacks:
      - name: examples.callbacks.LossEMA
        beta: 0.9

The pattern for any metric of your own: handle an llmforge event (``after_optimizer_step``:
the step is done, its record not yet written) and put the metric into ``state.metrics`` on a
logging step; the module writes that dict to every logger (metrics.jsonl, W&B, TensorBoard,
...) after the step's events (docs/algorithms/README.md, "One bus").
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback


class LossEMA(Callback):
    """Adds ``train/loss_ema`` (exponential moving average of ``train/loss``) and
    ``train/loss_spikes`` (steps whose loss exceeded the EMA by more than ``spike_ratio``).

    Args:
        beta: EMA decay per optimizer step (0 < beta < 1).
        spike_ratio: a step is a spike when ``loss > ema * (1 + spike_ratio)``.
    """

    def __init__(self, beta: float = 0.9, spike_ratio: float = 0.5) -> None:
        if not 0 < beta < 1:
            raise ValueError(f"beta must be in (0, 1); got {beta}")
        self.beta, self.spike_ratio = float(beta), float(spike_ratio)
        self.ema: Optional[float] = None
        self.spikes = 0

    def after_optimizer_step(self, state: Any) -> None:
        loss = float(state.metrics["train/loss"])
        if self.ema is not None and loss > self.ema * (1 + self.spike_ratio):
            self.spikes += 1
        self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
        if state.module.is_log_step(state.step):
            state.metrics.update({"train/loss_ema": self.ema, "train/loss_spikes": self.spikes})
