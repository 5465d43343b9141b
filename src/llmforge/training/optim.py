"""AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter, "Decoupled Weight
Decay Regularization", 2019), or Muon for the blocks' matrices plus AdamW for the rest
(:mod:`llmforge.training.muon`).

Parameters with two or more dimensions (linear and embedding weights) decay; 1-D parameters
(RMSNorm scales, biases) do not. Frozen parameters (``requires_grad=False``, e.g. an adapter run's base
weights) are left out of the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmforge.config.schema import OPTIMIZERS
from llmforge.errors import ConfigError
from llmforge.training.muon import MuonAdamW


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that require a gradient, each once (tied embeddings share
    one), in ``named_parameters`` order."""
    out, seen = [], set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: ``decay`` (ndim >= 2) with ``weight_decay`` and ``no_decay`` with 0.

    Shared parameters (tied embeddings) appear once.
    """
    decay, no_decay = [], []
    for p in trainable_parameters(model):
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def muon_param_groups(model: nn.Module, cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``([muon], [decay, no_decay])``: the trainable 2-D weights inside ``model.blocks()`` for
    Muon (lr ``optimizer.muon_lr``, or ``optimizer.lr`` when null), everything else for AdamW
    (lr ``optimizer.lr``) split as :func:`param_groups` does. Empty groups are left out.

    Raises:
        ConfigError: the model has no ``blocks()`` (Muon needs to know its hidden layers).
    """
    if not callable(getattr(model, "blocks", None)):
        raise ConfigError("optimizer.name: muon needs the model's repeated blocks (model.blocks()) to "
                          "tell hidden matrices from embeddings and output; use adamw for this model")
    hidden = {id(p) for block in model.blocks() for p in block.parameters() if p.ndim == 2}
    muon, rest = [], []
    for p in trainable_parameters(model):
        (muon if id(p) in hidden else rest).append(p)
    muon_lr = cfg.lr if cfg.muon_lr is None else cfg.muon_lr
    muon_groups = [{"params": muon, "lr": muon_lr, "weight_decay": cfg.weight_decay, "name": "muon"}]
    decay = [p for p in rest if p.ndim >= 2]
    no_decay = [p for p in rest if p.ndim < 2]
    adamw_groups = [{"params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "decay"},
                    {"params": no_decay, "lr": cfg.lr, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in muon_groups if g["params"]], [g for g in adamw_groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The ``optimizer:`` section's optimizer: ``adamw`` over :func:`param_groups`, or ``muon``
    (:class:`~llmforge.training.muon.MuonAdamW` over :func:`muon_param_groups`).

    Raises:
        ConfigError: unknown optimizer name, or no trainable parameter.
    """
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: '{cfg.name}' is not built in; use one of {', '.join(OPTIMIZERS)}")
    if cfg.name == "muon":
        muon, adamw = muon_param_groups(model, cfg)
        if not muon and not adamw:
            raise ConfigError("optimizer: the model has no trainable parameter")
        return MuonAdamW(muon, adamw, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                         ns_steps=cfg.muon_ns_steps, betas=tuple(cfg.betas), eps=cfg.eps)
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("optimizer: the model has no trainable parameter")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
