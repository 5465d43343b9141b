"""``early_stopping``: stop when ``eval/loss`` stops improving.

YAML::

    callbacks:
      - name: early_stopping
        patience: 3        # evaluations without improvement before stopping
        min_delta: 0.0     # an improvement must lower eval/loss by more than this (nats/token)

Checked after every evaluation (``trainer.eval_every`` steps, and step 0), through the event
``AFTER_EVALUATION`` (:mod:`llmforge.events`); stopping sets ``trainer.should_stop``, so the run ends after the
current step, writes its final checkpoint and summary as usual. The best value and the count of
evaluations without improvement are saved in every checkpoint (``trainer_state.json``, under
``callbacks``) and restored on resume, so patience is not reset by a preemption.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from llmforge.callbacks._util import say
from llmforge.errors import ConfigError


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` after ``patience`` evaluations without improvement.

    Args:
        monitor: the evaluation metric to watch (lower is better), ``eval/loss`` by default.
        patience: evaluations in a row without an improvement that stop the run (>= 1).
        min_delta: the smallest decrease that counts as an improvement (>= 0).

    Raises:
        ConfigError: ``patience`` < 1 or ``min_delta`` < 0.

    Attributes:
        best: the best value seen; ``stopped_step``: the step that stopped the run, or ``None``.
    """

    def __init__(self, monitor: str = "eval/loss", patience: int = 3, min_delta: float = 0.0) -> None:
        if int(patience) < 1:
            raise ConfigError(f"callbacks: early_stopping: patience must be >= 1; got {patience!r}")
        if float(min_delta) < 0:
            raise ConfigError(f"callbacks: early_stopping: min_delta must be >= 0; got {min_delta!r}")
        self.monitor, self.patience, self.min_delta = monitor, int(patience), float(min_delta)
        self.best: Optional[float] = None
        self.wait = 0
        self.stopped_step: Optional[int] = None

    def after_evaluation(self, state: Any) -> None:
        """Event ``AFTER_EVALUATION``: count an evaluation without improvement, stop after
        ``patience`` of them."""
        trainer = state.trainer
        value = state.eval_metrics.get(self.monitor)
        if value is None:
            return
        value = float(value)
        if self.best is None or (math.isfinite(value) and value < self.best - self.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.should_stop = True
            self.stopped_step = trainer.global_step
            say(trainer, f"early_stopping: {self.monitor} {value:.4f} has not improved on "
                         f"{self.best:.4f} by more than {self.min_delta:g} for {self.wait} "
                         f"evaluation(s); stopping at step {trainer.global_step}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.wait = state_dict.get("best"), int(state_dict.get("wait", 0))
