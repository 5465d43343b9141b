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

With ``chunked_cross_entropy`` the logits never exist whole: ``log(Z)`` is at hand per chunk, so
the chunked head adds the term and its gradient itself (``2 coef log(Z) softmax``, as Liger's
fused linear cross-entropy does with its ``lse_square_scale``); at ``FIT_START`` this plugin
hands the head ``coef`` (``chunked_cross_entropy`` passes it on with the labels of training
micro-batches), and ``state.loss`` from ``BEFORE_LOSS`` on already holds the term. It handles
no ``BEFORE_FORWARD`` itself, so it also runs under the pipeline step (``strategy.pp > 1``). Loss and gradients equal the unchunked ones within
1e-6 (float32).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from llmforge.algorithms.chunked_cross_entropy import ChunkedLossHead
from llmforge.errors import ConfigError
from llmforge.events import IGNORE_INDEX
from llmforge.plugin import Algorithm


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``sum over target tokens of logsumexp(logits)^2`` (fp32 scalar).

    Args:
        logits: ``[b, T, V]``.
        labels: ``[b, T]``; -100 marks positions without a target (left out).
    """
    # a mask, not boolean indexing: no data-dependent shape (no host sync on a GPU, and the
    # fake tensors of `--dry-run --simulate` can trace it)
    lse = torch.logsumexp(logits.float(), dim=-1)
    return torch.where(labels != IGNORE_INDEX, lse * lse, 0.0).sum()


class ZLoss(Algorithm):
    """Adds ``coef * logsumexp(logits)^2`` per target token to the training loss.

    Args:
        coef: weight of the term, finite and >= 0 (PaLM: 1e-4).

    Raises:
        ConfigError: a bad ``coef``.
    """

    name = "z_loss"
    summary = "PaLM's z-loss: coef * logsumexp(logits)^2 per target token (train/z_loss)"

    def __init__(self, coef: float = 1e-4) -> None:
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not (
                math.isfinite(coef) and coef >= 0):
            raise ConfigError(f"algorithms: z_loss.coef={coef!r} must be a finite number >= 0 (e.g. 1e-4)")
        self.coef = float(coef)
        self._sum: Any = 0.0
        self.head: Optional[ChunkedLossHead] = None  # chunked_cross_entropy's head, if any

    def fit_start(self, state: Any) -> None:
        model = state.model
        self.head = None if model is None else next(
            (m for m in model.modules() if isinstance(m, ChunkedLossHead)), None)
        if self.head is not None:  # the head adds the term chunk by chunk, in training
            self.head.z_coef = self.coef

    def batch_start(self, state: Any) -> None:
        self._sum = 0.0

    def after_loss(self, state: Any) -> None:
        if not state.training:
            return
        if self.head is not None and state.outputs.dim() == 0:  # already in the chunked loss
            z = self.head.last_z_sum
        else:
            z = z_loss_sum(state.outputs, state.labels)
            state.loss = state.loss + self.coef * z
        self._sum = self._sum + z.detach()

    def before_optimizer_step(self, state: Any) -> None:
        total = torch.as_tensor(self._sum, dtype=torch.float32, device=state.total_targets.device)
        state.metrics["train/z_loss"] = self.coef * state.dp_sum(total) / state.total_targets
