"""``batch_size_warmup``: start with a small global batch and grow it to ``trainer.global_batch_size``.

YAML::

    algorithms:
      - name: batch_size_warmup
        start_global_batch_size: 4   # sequences per optimizer step at step 1
        duration_tokens: 200000      # the batch reaches trainer.global_batch_size after this many tokens
        ramp: linear                 # linear | step
        stages: 4                    # step ramp only: equal token intervals of constant batch

Early in training the gradient noise scale is small, so small batches make as much progress per
token as large ones in fewer tokens (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", arXiv:1812.06162); GPT-3 ramped its batch over the first 4-12 billion tokens (Brown
et al. 2020, arXiv:2005.14165, appendix B), and Ai2's batch-size warmup trained OLMo 1B to the
same loss with 43% fewer gradient steps (Merrill et al. 2025, "Critical Batch Size Revisited",
arXiv:2505.23971).

With ``T(s)`` the tokens of the steps before step ``s`` (``seq_len`` x their sequences), the
global batch of step ``s`` is::

    linear:  B(s) = start + (final - start) * T(s) / duration_tokens
    step:    B(s) = start + (final - start) * floor(stages * T(s) / duration_tokens) / stages

and ``final`` once ``T(s) >= duration_tokens``; rounded down to a multiple of
``micro_batch_size x dp_size`` (each rank accumulates whole micro-batches) and kept within
``[start, final]`` (``start`` itself rounded up to that multiple). Only the number of
accumulated micro-batches changes, ``B(s) / (micro_batch_size x dp_size)``: the micro-batch
shape never does (nothing recompiles).

How: the loader delivers the full batch of every step as without warmup; at ``BATCH_START``
each rank keeps its first ``B(s) / dp_size`` windows and the rest of that step's windows are
not trained on (like ``seq_length_warmup``'s truncation). The data order and position are those
of the run without warmup and ``B(s)`` is a function of the step, so a resume mid-ramp is exact.
The learning-rate schedule runs on tokens: schedule step ``k`` (``k`` updates done) is taken at
``max_steps x T(k + 1) / T(max_steps + 1)``, the same fraction of the run's tokens, so warmup
and decay keep their share of the tokens and the last step ends the schedule (with a constant
batch this is ``k`` itself). ``train/tokens_seen`` counts the tokens trained;
``train/global_batch_size`` logs ``B(s)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from llmforge.errors import ConfigError
from llmforge.plugin import Algorithm, CheckContext

RAMPS = ("linear", "step")


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"algorithms: batch_size_warmup.{key}={value!r} must be an integer >= 1")
    return int(value)


class BatchSizeWarmup(Algorithm):
    """Trains step ``s`` on :meth:`global_batch` sequences, growing over ``duration_tokens``.

    Args:
        start_global_batch_size: sequences per optimizer step at step 1 (>= 1, at most
            ``trainer.global_batch_size``).
        duration_tokens: tokens (``seq_len`` x sequences, all ranks) after which the batch is
            ``trainer.global_batch_size`` (>= 1).
        ramp: ``linear`` or ``step``.
        stages: equal token intervals of constant batch for ``ramp: step`` (>= 1).

    Raises:
        ConfigError: a bad value; ``start_global_batch_size`` above ``trainer.global_batch_size``;
            with ``data.mixture`` (its per-source token counts assume every window of a step is
            trained); with ``strategy.pp > 1`` (the pipeline schedule takes a fixed batch).
    """

    name = "batch_size_warmup"
    order = -20  # first at BATCH_START: later handlers (seq_length_warmup, ...) see the kept windows
    summary = "batch size warmup: global batch grows from start_global_batch_size over duration_tokens"

    def __init__(self, start_global_batch_size: int = 1, duration_tokens: int = 1_000_000,
                 ramp: str = "linear", stages: int = 4) -> None:
        self.start = _positive_int(start_global_batch_size, "start_global_batch_size")
        self.duration_tokens = _positive_int(duration_tokens, "duration_tokens")
        if ramp not in RAMPS:
            raise ConfigError(f"algorithms: batch_size_warmup.ramp={ramp!r} must be one of {', '.join(RAMPS)}")
        self.ramp = ramp
        self.stages = _positive_int(stages, "stages")
        # set by configure() from the run's batch plan
        self.final = self.unit = self.seq_len = self.dp_size = 0
        self._sizes: list[int] = []  # B(1), B(2), ...
        self._before: list[int] = [0]  # sequences of the steps before step s: _before[s - 1]

    def check(self, run: CheckContext) -> None:
        cfg = run.cfg
        if self.start > int(cfg.trainer.global_batch_size):
            raise ConfigError(f"algorithms: batch_size_warmup.start_global_batch_size={self.start} exceeds "
                              f"trainer.global_batch_size={cfg.trainer.global_batch_size}; lower it")
        pp = int(getattr(run.dims, "pp", 1))
        if pp > 1:
            # the pipeline schedule splits a fixed batch into pipeline.microbatches; a truncated
            # one fails in torch's schedule at the first step
            raise ConfigError(f"algorithms: batch_size_warmup changes the batch of each step, which "
                              f"strategy.pp={pp}'s pipeline schedule (a fixed pipeline.microbatches) "
                              "does not follow yet; drop batch_size_warmup or set strategy.pp=1")
        if getattr(getattr(cfg, "data", None), "mixture", None):
            raise ConfigError("algorithms: batch_size_warmup trains part of each step's windows, which "
                              "data.mixture's per-source token counts do not follow yet; drop one of them")

    # ------------------------------------------------------------------ schedule
    def configure(self, micro_batch_size: int, dp_size: int, global_batch_size: int, seq_len: int) -> None:
        """Set the run's batch arithmetic (from :class:`llmforge.config.batch_plan.BatchPlan`)."""
        self.unit, self.dp_size = int(micro_batch_size) * int(dp_size), int(dp_size)
        self.final, self.seq_len = int(global_batch_size), int(seq_len)
        self._sizes, self._before = [], [0]

    def _size_after(self, tokens: int) -> int:
        if tokens >= self.duration_tokens:
            return self.final
        frac = tokens / self.duration_tokens
        if self.ramp == "step":
            frac = math.floor(self.stages * frac) / self.stages
        start = -(-self.start // self.unit) * self.unit  # rounded up to whole micro-batches
        grown = self.start + (self.final - self.start) * frac
        return max(start, min(self.final, int(grown) // self.unit * self.unit))

    def _extend(self, step: int) -> None:
        while len(self._sizes) < step:
            size = self._size_after(self._before[-1] * self.seq_len)
            self._sizes.append(size)
            self._before.append(self._before[-1] + size)

    def global_batch(self, step: int) -> int:
        """Sequences (all data-parallel ranks) of optimizer step ``step`` (1-based)."""
        self._extend(step)
        return self._sizes[step - 1]

    def accumulation_steps(self, step: int) -> int:
        """Micro-batches each rank accumulates in step ``step``."""
        return self.global_batch(step) // self.unit

    def sequences_before(self, step: int) -> int:
        """Sequences (all ranks) of the steps before ``step`` (1-based); x ``seq_len`` = tokens."""
        self._extend(step)
        return self._before[step - 1]

    def schedule_position(self, k: float, max_steps: int) -> float:
        """The step of the step-based LR schedule to use after ``k`` updates: the same fraction
        of the run's tokens (``max_steps`` steps), ``max_steps * T(k + 1) / T(max_steps + 1)``."""
        k = int(k)
        return max_steps * self.sequences_before(k + 1) / self.sequences_before(max_steps + 1)

    def token_schedule(self, fn: Callable[[int], float], max_steps: int) -> Callable[[int], float]:
        """``fn`` (a ``LambdaLR`` multiplier of the schedule step) evaluated at :meth:`schedule_position`."""
        return lambda k: fn(self.schedule_position(k, max_steps))

    # -------------------------------------------------------------------- events
    def fit_start(self, state: Any) -> None:
        plan = state.module.plan
        self.configure(plan.micro_batch_size, plan.dp_size, plan.global_batch_size, plan.seq_len)
        trainer = state.trainer
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        for config in configs:  # the step-based schedule, now read at the tokens' position
            sched = config.scheduler
            if hasattr(sched, "lr_lambdas"):
                max_steps = int(state.cfg.trainer.max_steps)
                sched.lr_lambdas = [self.token_schedule(f, max_steps) for f in sched.lr_lambdas]

    def batch_start(self, state: Any) -> None:
        size = self.global_batch(state.step)
        keep = size // self.dp_size  # this rank's windows: accumulation_steps x micro_batch_size
        batch = state.batch
        if isinstance(batch, dict):
            state.batch = {k: (v[:keep] if hasattr(v, "shape") else v) for k, v in batch.items()}
        else:
            state.batch = batch[:keep]
        state.metrics["train/global_batch_size"] = size
