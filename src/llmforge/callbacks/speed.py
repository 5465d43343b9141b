"""Throughput and step timing, measured per logging window.

Metrics (added to the step's record at each logging step):

- ``throughput/tokens_per_second``: tokens of all ranks per wall-clock second over the window.
- ``throughput/tokens_per_second_per_device``: the same divided by the world size.
- ``throughput/tflops_per_device``: ``tokens_per_second_per_device * flops_per_token / 1e12``
  with the model's ``flops_per_token(seq_len)`` (training FLOPs, 6N + attention, PaLM app. B).
- ``time/step_seconds``: mean seconds per optimizer step (data wait included).
- ``time/data_seconds``: mean seconds per step spent waiting for the next batch (time from the
  end of one step to the start of the next).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback


class SpeedMonitor(Callback):
    """Adds throughput and timing metrics to ``pl_module.step_metrics`` on logging steps."""

    def __init__(self) -> None:
        self._last_end: Optional[float] = None
        self._window_start: Optional[float] = None
        self._window_steps = 0
        self._window_data = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_end = self._window_start = time.perf_counter()
        self._window_steps, self._window_data = 0, 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._window_data += now - self._last_end

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._window_steps += 1
        step = trainer.global_step
        if not pl_module.is_log_step(step):
            self._last_end = time.perf_counter()
            return
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        elapsed = max(now - (self._window_start or now), 1e-9)
        tokens = self._window_steps * pl_module.plan.tokens_per_step
        tps = tokens / elapsed
        per_device = tps / max(1, trainer.world_size)
        metrics = {
            "throughput/tokens_per_second": tps,
            "throughput/tokens_per_second_per_device": per_device,
            "time/step_seconds": elapsed / self._window_steps,
            "time/data_seconds": self._window_data / self._window_steps,
        }
        flops = getattr(pl_module.model, "flops_per_token", None)
        if callable(flops):
            metrics["throughput/tflops_per_device"] = per_device * flops(pl_module.plan.seq_len) / 1e12
        pl_module.step_metrics.update(metrics)
        self._window_start = self._last_end = time.perf_counter()
        self._window_steps, self._window_data = 0, 0.0
