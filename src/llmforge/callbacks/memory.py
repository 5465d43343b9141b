"""``memory_monitor``: peak memory per logging step.

YAML::

    callbacks:
      - name: memory_monitor
        reset_peak: false    # GPU: reset the peak after each logging step (per-window peaks)

Metrics:

- ``memory/peak_gib``: on a GPU, the peak memory allocated by tensors on this rank's device
  (``torch.cuda.max_memory_allocated``); on the CPU, the peak resident set size of the process
  (``ru_maxrss``, since the process started). GiB = 2^30 bytes.
- ``memory/reserved_gib`` (GPU only): the peak memory held by PyTorch's caching allocator
  (``torch.cuda.max_memory_reserved``), what ``nvidia-smi`` roughly shows.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

GIB = 2**30


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is KiB on Linux, bytes
    on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def memory_metrics(device: torch.device) -> dict[str, float]:
    """``memory/peak_gib`` (and ``memory/reserved_gib`` on a GPU) for ``device``."""
    if device.type == "cuda":
        return {"memory/peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "memory/reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
    return {"memory/peak_gib": peak_rss_bytes() / GIB}


class MemoryMonitor(Callback):
    """Adds peak-memory metrics to the record of every logging step (this rank's values).

    Args:
        reset_peak: on a GPU, reset the peak statistics after each logging step, so each value is
            the peak of its window; ``False`` = peak since training started. (No effect on the
            CPU: the process's peak RSS cannot be reset.)
    """

    def __init__(self, reset_peak: bool = False) -> None:
        self.reset_peak = bool(reset_peak)

    def fit_start(self, state: Any) -> None:
        if state.module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(state.module.device)

    def after_optimizer_step(self, state: Any) -> None:
        pl_module = state.module
        if not pl_module.is_log_step(state.step):
            return
        state.metrics.update(memory_metrics(pl_module.device))
        if self.reset_peak and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
