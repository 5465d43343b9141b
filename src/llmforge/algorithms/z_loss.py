"""``z_loss``: PaLM's auxiliary loss on the softmax normalizer.

YAML::

    algorithms:
      - name: z_loss
        coef: 1.0e-4     # weight of the term (PaLM's value)

For each target token the loss gains ``coef * log(Z)^2`` with ``log(Z) = logsumexp(logits)``,
which keeps the normalizer near 1 and the logits from drifting (Chowdhery et al. 2022, "PaLM:
Scaling Language Modeling with Pathways", arXiv:2204.02311, sec. 5 "Training instability").
It acts at ``AFTER_LOSS`` of training micro-batches only: ``eval/loss`` stays the pure
cross-entropy. ``train/loss`` is the optimized total; ``train/z_loss`` is the added term per
target token (``coef * mean(log(Z)^2)``), so ``train/loss - train/z_loss`` is the cross-entropy.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmforge.errors import ConfigError
from llmforge.plugin import Algorithm, CheckContext

IGNORE_INDEX = -100


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``sum over target tokens of logsumexp(logits)^2`` (fp32 scalar).

    Args:
        logits: ``[b, T, V]``.
        labels: ``[b, T]``; -100 marks positions without a target (left out).
    """
    keep = labels != IGNORE_INDEX
    lse = torch.logsumexp(logits[keep].float(), dim=-1)
    return (lse * lse).sum()


class ZLoss(Algorithm):
    """Adds ``coef * logsumexp(logits)^2`` per target token to the training loss.

    Args:
        coef: weight of the term, finite and >= 0 (PaLM: 1e-4).

    Raises:
        ConfigError: a bad ``coef``, or combined with ``chunked_cross_entropy`` (which never
            materializes the logits this term needs).
    """

    name = "z_loss"
    summary = "PaLM's z-loss: coef * logsumexp(logits)^2 per target token (train/z_loss)"

    def __init__(self, coef: float = 1e-4) -> None:
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not (
                math.isfinite(coef) and coef >= 0):
            raise ConfigError(f"algorithms: z_loss.coef={coef!r} must be a finite number >= 0 (e.g. 1e-4)")
        self.coef = float(coef)
        self._sum: Any = 0.0

    def check(self, run: CheckContext) -> None:
        if any(a.name == "chunked_cross_entropy" for a in run.algorithms):
            raise ConfigError("algorithms: z_loss needs the logits, which chunked_cross_entropy never "
                              "materializes; drop one of them")

    def batch_start(self, state: Any) -> None:
        self._sum = 0.0

    def after_loss(self, state: Any) -> None:
        if not state.training:
            return
        z = z_loss_sum(state.outputs, state.labels)
        state.loss = state.loss + self.coef * z
        self._sum = self._sum + z.detach()

    def before_optimizer_step(self, state: Any) -> None:
        total = torch.as_tensor(self._sum, dtype=torch.float32, device=state.total_targets.device)
        state.metrics["train/z_loss"] = self.coef * state.dp_sum(total) / state.total_targets
