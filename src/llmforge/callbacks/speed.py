"""Throughput, MFU and step timing, measured per logging window.

Always added by the Trainer; a ``speed_monitor`` entry under ``callbacks:`` configures this
one instead of adding a second::

    callbacks:
      - name: speed_monitor
        peak_tflops: 989.4          # per device; default: looked up from the GPU's name
        precision_for_mfu: auto     # auto (fp8 if float8 layers are present), bf16 or fp8

Metrics (added to the step's record at each logging step):

- ``throughput/tokens_per_second``: target tokens (labels != -100; padding and masked
  positions are not counted) of all data-parallel ranks per wall-clock second over the window.
- ``throughput/tokens_per_second_per_device``: the same divided by the world size.
- ``throughput/tflops_per_device``: ``tokens_per_second_per_device * flops_per_token / 1e12``
  with the model's ``flops_per_token(seq_len)`` (training FLOPs per token, ``6 N + 12 L H
  hd seq_len``, PaLM appendix B).
- ``throughput/mfu``: ``tflops_per_device / peak_tflops`` (a fraction, 0..1), when the peak is
  known (:mod:`llmforge.callbacks.peak_flops`) or given.
- ``time/step_seconds``: mean seconds per optimizer step (data wait included).
- ``time/data_seconds``: mean seconds per step spent waiting for the next batch (time from the
  end of one step to the start of the next).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.callbacks._util import say
from llmforge.callbacks.peak_flops import PRECISIONS, peak_tflops
from llmforge.errors import ConfigError
from llmforge.events import IGNORE_INDEX
from llmforge.models.spec import get_spec


def uses_float8(model: Any) -> bool:
    """True if any submodule is a float8 layer (torchao ``Float8Linear`` and the like)."""
    if model is None:
        return False
    return any(type(m).__name__.startswith("Float8") for m in model.modules())


def count_targets(pl_module: Any, batch: Any) -> torch.Tensor:
    """Target tokens of one local batch (labels != -100), as a tensor on the batch's device;
    ``batch``: the one the step really trained on (``state.batch``, after ``BATCH_START``
    handlers such as ``seq_length_warmup`` replaced it)."""
    _, labels = pl_module.split_batch(batch)
    return (labels != IGNORE_INDEX).sum()


class SpeedMonitor(Callback):
    """Adds throughput, MFU and timing metrics to ``pl_module.step_metrics`` on logging steps.

    Args:
        peak_tflops: peak dense TFLOPs per device to compute MFU against; ``None`` = look the
            GPU up by name (no MFU on the CPU or an unknown device unless given).
        precision_for_mfu: which peak to use: ``bf16``, ``fp8``, or ``auto`` (``fp8`` when the
            model holds float8 layers, else ``bf16``). The choice is printed once at start.

    Raises:
        ConfigError: ``precision_for_mfu`` not auto/bf16/fp8, or ``peak_tflops`` <= 0.
    """

    def __init__(self, peak_tflops: Optional[float] = None, precision_for_mfu: str = "auto") -> None:
        if precision_for_mfu not in ("auto", *PRECISIONS):
            raise ConfigError(f"callbacks: speed_monitor: precision_for_mfu must be auto, bf16 or "
                              f"fp8; got {precision_for_mfu!r}")
        if peak_tflops is not None and not float(peak_tflops) > 0:
            raise ConfigError(f"callbacks: speed_monitor: peak_tflops must be > 0; got {peak_tflops!r}")
        self.peak_override = float(peak_tflops) if peak_tflops is not None else None
        self.precision_for_mfu = precision_for_mfu
        self.peak: Optional[float] = None  # TFLOPs per device used for MFU
        self.peak_source = ""
        self._last_end: Optional[float] = None
        self._window_start: Optional[float] = None
        self._window_steps = 0
        self._window_data = 0.0
        self._window_tokens: Any = 0

    # ------------------------------------------------------------------ setup
    def resolve_peak(self, pl_module: Any) -> str:
        """Set :attr:`peak` for the module's device and return the line that says which
        (empty on a CPU without ``peak_tflops``: MFU is not logged and there is nothing to do)."""
        precision = self.precision_for_mfu
        if precision == "auto":
            precision = "fp8" if uses_float8(getattr(pl_module, "model", None)) else "bf16"
        device = pl_module.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        if self.peak_override is not None:
            self.peak, self.peak_source = self.peak_override, f"peak_tflops={self.peak_override:g} (given)"
        else:
            found = peak_tflops(name, precision) if device.type == "cuda" else None
            if found is None:
                self.peak = None
                if device.type == "cpu":
                    return ""  # CPUs have no peak table: nothing to act on, nothing said
                return (f"speed_monitor: no peak TFLOPs known for {name}; throughput/mfu is not "
                        "logged (set peak_tflops in a speed_monitor entry under callbacks:)")
            self.peak, used = found
            note = "" if used == precision else f" ({name} has no {precision} units)"
            self.peak_source = f"{used} dense peak of {name}{note}"
            precision = used
        return (f"speed_monitor: MFU against {self.peak:g} TFLOPs per device, {self.peak_source}; "
                f"precision for MFU: {precision}")

    def fit_start(self, state: Any) -> None:
        line = self.resolve_peak(state.module)
        if line:
            say(state.trainer, line)
        self._last_end = self._window_start = time.perf_counter()
        self._window_steps, self._window_data, self._window_tokens = 0, 0.0, 0

    # ------------------------------------------------------------------ steps
    def batch_start(self, state: Any) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._window_data += now - self._last_end

    def after_optimizer_step(self, state: Any) -> None:
        """Event ``AFTER_OPTIMIZER_STEP``: count the step; on a logging step add the window's
        metrics to the step's record."""
        pl_module, trainer = state.module, state.trainer
        self._window_steps += 1
        self._window_tokens = self._window_tokens + count_targets(pl_module, state.batch)  # no sync
        if not pl_module.is_log_step(state.step):
            self._last_end = time.perf_counter()
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        start = self._window_start if self._window_start is not None else now
        elapsed = max(now - start, 1e-9)
        tokens = self._window_tokens
        if isinstance(tokens, torch.Tensor):
            tokens = float(pl_module.dp_all_reduce(tokens.float()).item())
        state.metrics.update(self.window_metrics(
            float(tokens), elapsed, self._window_steps, self._window_data, max(1, trainer.world_size),
            _flops_fn(pl_module), pl_module.plan.seq_len))
        self._window_start = self._last_end = time.perf_counter()
        self._window_steps, self._window_data, self._window_tokens = 0, 0.0, 0

    def after_evaluation(self, state: Any) -> None:
        """Leave the evaluation's time out of the step and data times (event ``AFTER_EVALUATION``)."""
        now = time.perf_counter()
        if self._last_end is not None and self._window_start is not None:
            self._window_start += now - self._last_end
            self._last_end = now

    def window_metrics(self, tokens: float, seconds: float, steps: int, data_seconds: float,
                       world_size: int, flops_per_token: Any, seq_len: int) -> dict[str, float]:
        """The metrics of one window.

        Args:
            tokens: target tokens of all ranks in the window.
            seconds: wall-clock seconds of the window.
            steps: optimizer steps in the window.
            data_seconds: seconds spent waiting for batches in the window.
            world_size: devices (processes).
            flops_per_token: the model's ``flops_per_token(seq_len)`` or ``None``.
            seq_len: tokens per sequence.
        """
        tps = tokens / seconds
        per_device = tps / world_size
        metrics = {
            "throughput/tokens_per_second": tps,
            "throughput/tokens_per_second_per_device": per_device,
            "time/step_seconds": seconds / steps,
            "time/data_seconds": data_seconds / steps,
        }
        if callable(flops_per_token):
            tflops = per_device * flops_per_token(seq_len) / 1e12
            metrics["throughput/tflops_per_device"] = tflops
            if self.peak:
                metrics["throughput/mfu"] = tflops / self.peak
        return metrics


def _flops_fn(pl_module: Any) -> Any:
    """``seq_len -> FLOPs per token``: the family spec's ``flops_per_token`` when it has one
    (docs/models.md), else the model's own method (or ``None``)."""
    whole = getattr(pl_module, "model_flops_per_token", None)
    if whole is not None:  # a pipeline stage's model is a part of the model
        return whole
    model = pl_module.model
    name = getattr(getattr(getattr(pl_module, "cfg", None), "model", None), "name", None)
    if name:
        spec = get_spec(name)
        if spec.flops_per_token is not None:
            return lambda seq_len: spec.flops(model, seq_len)
    return getattr(model, "flops_per_token", None)
