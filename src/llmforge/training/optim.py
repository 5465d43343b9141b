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
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from llmforge.config.schema import OPTIMIZERS
from llmforge.errors import ConfigError
from llmforge.training.muon import MuonAdamW, split_matrices


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
    """``([muon, muon_experts], [decay, no_decay])``: the trainable 2-D weights inside
    ``model.blocks()`` for Muon, the blocks' trainable parameters with more dimensions (stacks
    of matrices on the leading dims: a mixture of experts' ``[E, out, in]`` weights and their
    adapters) for Muon matrix by matrix (both lr ``optimizer.muon_lr``, or ``optimizer.lr``
    when null), everything else for AdamW (lr ``optimizer.lr``) split as :func:`param_groups`
    does. Empty groups are left out.

    Raises:
        ConfigError: the model has no ``blocks()`` (Muon needs to know its hidden layers), or
            the parallel layout splits an expert matrix over ranks (naming the parameter).
    """
    if not callable(getattr(model, "blocks", None)):
        raise ConfigError("optimizer.name: muon needs the model's repeated blocks (model.blocks()) to "
                          "tell hidden matrices from embeddings and output; use adamw for this model")
    hidden = {id(p) for block in model.blocks() for p in block.parameters() if p.ndim >= 2}
    muon, stacks, rest = [], [], []
    for p in trainable_parameters(model):
        (rest if id(p) not in hidden else muon if p.ndim == 2 else stacks).append(p)
    names = {id(p): n for n, p in model.named_parameters()}
    for p in stacks:
        why = split_matrices(p)
        if why:
            raise ConfigError(f"optimizer.name: muon orthogonalizes each expert matrix of {names[id(p)]} "
                              f"{tuple(p.shape)} on the rank that holds it, but {why}; use "
                              "optimizer.name=adamw, or a layout that keeps expert matrices whole")
    muon_lr = cfg.lr if cfg.muon_lr is None else cfg.muon_lr
    muon_groups = [{"params": muon, "lr": muon_lr, "weight_decay": cfg.weight_decay, "name": "muon"},
                   {"params": stacks, "lr": muon_lr, "weight_decay": cfg.weight_decay, "name": "muon_experts"}]
    decay = [p for p in rest if p.ndim >= 2]
    no_decay = [p for p in rest if p.ndim < 2]
    adamw_groups = [{"params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "decay"},
                    {"params": no_decay, "lr": cfg.lr, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in muon_groups if g["params"]], [g for g in adamw_groups if g["params"]]


def muon_ns_dtype(cfg: Any, precision: str) -> torch.dtype:
    """``optimizer.muon_ns_dtype`` as a torch dtype; null: float32 for ``fp32`` runs (the update
    then does not depend on the parallel layout), bfloat16 otherwise (the sources' choice)."""
    name = getattr(cfg, "muon_ns_dtype", None) or ("float32" if precision == "fp32" else "bfloat16")
    return getattr(torch, name)


def kernel_flags(params: list[torch.Tensor], implementation: str = "auto") -> dict[str, bool]:
    """``torch.optim.AdamW``'s ``fused``/``foreach`` keywords for ``optimizer.implementation``.

    ``auto`` is ``fused`` (torchtitan's default; one kernel per group and device: on the CPU
    about 3x faster than the for-loop torch picks there, measured on the demo's 4 M parameters)
    when torch has the fused kernel for every parameter's device, the parameters are floating
    point and DTensors share one device mesh (the fused and foreach kernels take one mesh per
    call; expert weights on their own mesh get torch's default instead). The update is the same
    AdamW (within float rounding)."""
    if implementation == "fused":
        return {"fused": True}
    if implementation in ("foreach", "for-loop"):
        return {"foreach": implementation == "foreach"}
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    plain = any(not isinstance(p, DTensor) for p in params)
    fusable = (bool(params) and all(p.is_floating_point() for p in params)
               and {p.device.type for p in params} <= set(_get_fused_kernels_supported_devices())
               and len(meshes) + plain <= 1)
    return {"fused": True} if fusable else {}


def build_optimizer(model: nn.Module, cfg: Any, precision: str = "fp32") -> torch.optim.Optimizer:
    """The ``optimizer:`` section's optimizer: ``adamw`` over :func:`param_groups`, or ``muon``
    (:class:`~llmforge.training.muon.MuonAdamW` over :func:`muon_param_groups`; ``precision``,
    ``trainer.precision``, picks Muon's Newton-Schulz dtype when ``optimizer.muon_ns_dtype`` is null).

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
                         ns_steps=cfg.muon_ns_steps, betas=tuple(cfg.betas), eps=cfg.eps,
                         ns_dtype=muon_ns_dtype(cfg, precision))
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("optimizer: the model has no trainable parameter")
    flags = kernel_flags([p for g in groups for p in g["params"]], getattr(cfg, "implementation", "auto"))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)
