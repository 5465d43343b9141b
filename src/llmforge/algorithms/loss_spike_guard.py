"""``loss_spike_guard``: skip the update of a step whose loss or gradient norm spikes.

YAML::

    algorithms:
      - name: loss_spike_guard
        factor: 4.0        # a spike: value > factor x running median
        window: 100        # the median is over the last `window` kept steps
        min_history: 10    # steps seen before the guard acts
        metric: both       # loss, grad_norm or both
        max_skips: 5       # this many skipped steps in a row stop the run (exit 2)

At ``BEFORE_OPTIMIZER_STEP`` (gradients reduced and clipped) the step's ``train/loss`` and the
global gradient norm before clipping are compared with the median of the last ``window`` steps
that were applied. A spike sets ``state.skip_step``: no optimizer or schedule step, the
gradients are dropped, the batch counts as consumed; a spiking value never enters the median.
``train/skipped_steps`` counts the skipped steps of the run. Anchors: OLMo's spike handling
(Groeneveld et al. 2024, "OLMo: Accelerating the Science of Language Models", sec. 3.2) and LLM
Foundry's ``kill_loss_spike`` callback. The loss and norm are reduced over all ranks before, so
every rank decides the same. The history travels in checkpoints (exact resume).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.plugin import Algorithm

METRICS = ("both", "loss", "grad_norm")


class LossSpikesPersist(LLMForgeError):
    """``max_skips`` steps in a row were spikes: the run stops (exit code 2); the last complete
    checkpoint is left as it was."""

    exit_code = 2


class LossSpikeGuard(Algorithm):
    """Skips optimizer steps whose loss or gradient norm exceeds ``factor`` x the running median.

    Args:
        factor: spike threshold, > 1.
        window: steps in the running median (>= 1).
        min_history: steps observed before the guard may skip (>= 1, <= window).
        metric: ``loss``, ``grad_norm`` or ``both``.
        max_skips: consecutive skips that stop the run (>= 1).

    Raises:
        ConfigError: a bad value (naming ``loss_spike_guard.<key>``).
        LossSpikesPersist: during training, after ``max_skips`` skips in a row.
    """

    name = "loss_spike_guard"
    order = 100  # last at BEFORE_OPTIMIZER_STEP: it sees what the other handlers left
    summary = "skip steps whose loss / grad norm exceed factor x the running median; stop after max_skips"

    def __init__(self, factor: float = 4.0, window: int = 100, min_history: int = 10,
                 metric: str = "both", max_skips: int = 5) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                math.isfinite(factor) and factor > 1):
            raise ConfigError(f"algorithms: loss_spike_guard.factor={factor!r} must be a finite number > 1")
        for key, value in (("window", window), ("min_history", min_history), ("max_skips", max_skips)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"algorithms: loss_spike_guard.{key}={value!r} must be an integer >= 1")
        if min_history > window:
            raise ConfigError(f"algorithms: loss_spike_guard.min_history={min_history} exceeds "
                              f"window={window}; the median could never have that many steps")
        if metric not in METRICS:
            raise ConfigError(f"algorithms: loss_spike_guard.metric={metric!r} must be one of "
                              f"{', '.join(METRICS)}")
        self.factor, self.window, self.min_history = float(factor), int(window), int(min_history)
        self.metric, self.max_skips = metric, int(max_skips)
        self.history: dict[str, deque] = {"loss": deque(maxlen=self.window),
                                          "grad_norm": deque(maxlen=self.window)}
        self.skipped = 0
        self.in_a_row = 0

    def watched(self) -> tuple[str, ...]:
        return ("loss", "grad_norm") if self.metric == "both" else (self.metric,)

    def spike(self, values: dict[str, float]) -> list[str]:
        """The watched values that spike (empty: none, or too little history)."""
        out = []
        for key in self.watched():
            hist = self.history[key]
            if len(hist) >= self.min_history and not values[key] <= self.factor * statistics.median(hist):
                out.append(f"{key} {values[key]:.4g} > {self.factor:g} x median {statistics.median(hist):.4g}")
        return out

    def before_optimizer_step(self, state: Any) -> None:
        values = {"loss": float(state.metrics["train/loss"]), "grad_norm": float(state.grad_norm)}
        spikes = self.spike(values)
        if spikes:
            state.skip_step = True
            self.skipped += 1
            self.in_a_row += 1
            if self.in_a_row >= self.max_skips:
                raise LossSpikesPersist(
                    f"loss_spike_guard: {self.in_a_row} steps in a row spiked (step {state.step}: "
                    f"{'; '.join(spikes)}); stopping. The last complete checkpoint is intact: lower "
                    "optimizer.lr, raise loss_spike_guard.factor or max_skips, and resume with "
                    "checkpoint.resume=auto")
        else:
            self.in_a_row = 0
            for key in ("loss", "grad_norm"):
                self.history[key].append(values[key])
        state.metrics["train/skipped_steps"] = self.skipped

    def state_dict(self) -> dict[str, Any]:
        return {"loss": list(self.history["loss"]), "grad_norm": list(self.history["grad_norm"]),
                "skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("loss", "grad_norm"):
            self.history[key] = deque(state_dict.get(key, []), maxlen=self.window)
        self.skipped = int(state_dict.get("skipped", 0))
        self.in_a_row = int(state_dict.get("in_a_row", 0))
