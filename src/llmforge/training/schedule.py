"""Learning-rate schedules, one value per optimizer step.

Step ``s`` counts optimizer steps from 0 (the first update). All schedules warm up linearly:
``lr(s) = peak * (s + 1) / warmup_steps`` for ``s < warmup_steps`` (with ``warmup_from_zero``:
``peak * s / warmup_steps``, Composer's ``LinearScheduler(alpha_i=0, alpha_f=1, t_max=t_warmup)``
inside its ``*_with_warmup`` schedulers, evaluated at the batch count before the step). After warmup, with
``p = (s - warmup_steps) / (max_steps - warmup_steps)`` in [0, 1) and ``m = min_lr_ratio``:

- ``cosine``: ``peak * (m + (1 - m) * 0.5 * (1 + cos(pi * p)))`` (Loshchilov & Hutter, SGDR, eq. 5)
- ``linear``: ``peak * (1 - (1 - m) * p)``
- ``wsd`` (warmup-stable-decay, Hu et al. 2024, MiniCPM, sec. 4): ``peak`` until the last
  ``decay_fraction`` of the post-warmup steps, then linear to ``m * peak`` at the last step
- ``constant``: ``peak``
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from llmforge.config.schema import SCHEDULES


def lr_multiplier(step: int, *, name: str, max_steps: int, warmup_steps: int,
                  min_lr_ratio: float = 0.0, decay_fraction: float = 0.2,
                  warmup_from_zero: bool = False) -> float:
    """The factor applied to the peak learning rate at optimizer step ``step`` (0-based).

    Raises:
        ValueError: unknown schedule name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"scheduler.name: unknown schedule '{name}'; use one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + (not warmup_from_zero)) / warmup_steps
    if name == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    p = min(1.0, (step - warmup_steps) / span)
    m = min_lr_ratio
    if name == "cosine":
        return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))
    if name == "linear":
        return 1 - (1 - m) * p
    decay_steps = max(1, round(decay_fraction * span))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1 - (1 - m) * min(1.0, (step - decay_start + 1) / decay_steps)


def build_scheduler(optimizer: Optimizer, cfg, max_steps: int) -> LambdaLR:
    """A ``LambdaLR`` over :func:`lr_multiplier` for the ``scheduler:`` section; step it once
    per optimizer step."""
    return LambdaLR(optimizer, lambda s: lr_multiplier(
        s, name=cfg.name, max_steps=max_steps, warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio, decay_fraction=cfg.decay_fraction,
        warmup_from_zero=bool(getattr(cfg, "warmup_from_zero", False))))
