"""Research example: a third-party algorithm that changes both the batch and the loss.

``LabelSmoothingTokenDrop`` drops a random share of the target tokens of each training batch
(their labels become -100: no loss, no gradient) at the ``BATCH_START`` event, and replaces the
default cross-entropy by a label-smoothed one (Szegedy et al. 2016, "Rethinking the Inception
Architecture for Computer Vision", sec. 7) at ``BEFORE_LOSS``. No llmforge file knows it: YAML
names it by import path. Run it from the repository root::

    PYTHONPATH=. llmforge train examples/label_smoothing.yaml

Evaluation is left alone (``state.training`` is False there), so ``eval/loss`` stays the plain
cross-entropy and runs with and without the algorithm compare directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmforge.algorithms import Algorithm
from llmforge.errors import ConfigError


class LabelSmoothingTokenDrop(Algorithm):
    """Label smoothing ``smoothing`` on the training loss and ``drop`` of the targets dropped.

    Args:
        smoothing: label smoothing in ``[0, 1)``.
        drop: share of target tokens dropped per batch, in ``[0, 1)``.
        seed: the drop pattern is drawn from ``seed`` and the step (exact on resume).
    """

    name = "label_smoothing_token_drop"

    def __init__(self, smoothing: float = 0.1, drop: float = 0.1, seed: int = 0) -> None:
        for key, value in (("smoothing", smoothing), ("drop", drop)):
            if not 0.0 <= float(value) < 1.0:
                raise ConfigError(f"algorithms: {self.name}.{key}={value!r} must be in [0, 1)")
        self.smoothing, self.drop, self.seed = float(smoothing), float(drop), int(seed)

    def batch_start(self, state) -> None:
        inputs, labels = state.module.split_batch(state.batch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + state.step)
        dropped = torch.rand(labels.shape, generator=g) < self.drop
        labels = labels.masked_fill(dropped.to(labels.device), -100)
        state.batch = {"input_ids": inputs, "labels": labels}
        state.metrics["train/dropped_targets"] = int(dropped.sum())

    def before_loss(self, state) -> None:
        if state.training:
            state.loss = F.cross_entropy(state.outputs.flatten(0, 1).float(), state.labels.flatten(),
                                         ignore_index=-100, reduction="sum",
                                         label_smoothing=self.smoothing)
