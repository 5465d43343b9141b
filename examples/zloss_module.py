"""Research example: an ``LLMModule`` subclass that adds an auxiliary z-loss on the logits.

z-loss = ``weight * mean over targets of logsumexp(logits)^2`` keeps the softmax normalizer near
1 and stabilizes large-scale training (PaLM, Chowdhery et al. 2022, sec. 5). Run it with::

    llmforge train examples/zloss.yaml

from the repository root (``examples`` is imported from the working directory).
"""

from __future__ import annotations

import torch

from llmforge import LLMModule
from llmforge.training.module import IGNORE_INDEX


class ZLossModule(LLMModule):
    """``LLMModule`` whose loss adds ``z_loss_weight * logsumexp(logits)**2`` per target token.

    Args:
        z_loss_weight: weight of the auxiliary term (PaLM uses 1e-4); YAML
            ``trainer.module_kwargs.z_loss_weight``.
    """

    def __init__(self, cfg, plan, z_loss_weight: float = 1e-4, **kwargs) -> None:
        super().__init__(cfg, plan, **kwargs)
        self.z_loss_weight = z_loss_weight

    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor):
        loss_sum, n = super().compute_loss(logits, labels)
        keep = (labels != IGNORE_INDEX).flatten()
        lse = torch.logsumexp(logits.flatten(0, 1).float()[keep], dim=-1)
        return loss_sum + self.z_loss_weight * (lse**2).sum(), n
