"""AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter, "Decoupled Weight
Decay Regularization", 2019).

Parameters with two or more dimensions (linear and embedding weights) decay; 1-D parameters
(RMSNorm scales, biases) do not. Frozen parameters (``requires_grad=False``, e.g. an adapter run's base
weights) are left out of the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmforge.errors import ConfigError


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: ``decay`` (ndim >= 2) with ``weight_decay`` and ``no_decay`` with 0.

    Shared parameters (tied embeddings) appear once.
    """
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` from the ``optimizer:`` section.

    Raises:
        ConfigError: unknown optimizer name, or no trainable parameter.
    """
    if cfg.name != "adamw":
        raise ConfigError(f"optimizer.name: '{cfg.name}' is not built in; use adamw")
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("optimizer: the model has no trainable parameter")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
