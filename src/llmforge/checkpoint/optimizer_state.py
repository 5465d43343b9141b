"""Optimizer state on resume: a checkpoint holds state only for parameters that had a gradient
before the save (frozen or later-trained ones have none); the load target and the optimizer are
made to match that, so the resumed optimizer is exactly the saving run's.

Used by :func:`llmforge.checkpoint.dcp.load_training_state`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from llmforge.checkpoint.safe_load import load_metadata

__all__ = ["drop_empty_optimizer_state", "forget_optimizer_state", "saved_flat_optimizer",
           "saved_optimizer_state"]


def saved_optimizer_state(optim_sd: dict[str, Any], fqns: set[str],
                           path: Path, flat: bool) -> tuple[dict[str, Any], set[str]]:
    """``(target, absent)``: the load target ``optim_sd`` (from ``get_state_dict``, which gives
    every parameter state) without the state of the parameters the checkpoint holds none for,
    and those parameters' names. ``fqns``: the model's state-dict keys; ``flat``: ``optim_sd``
    is keyed ``state.<fqn>.<name>``, else nested ``{"state": {fqn: {name: ...}}, ...}``."""
    saved = load_metadata(path / ".metadata").state_dict_metadata.keys()
    prefixes = set()  # every dotted prefix of "<fqn>.<name>" of the saved optimizer state
    for key in saved:
        if key.startswith("optim.state."):
            parts = key[len("optim.state."):].split(".")
            prefixes.update(".".join(parts[:end]) for end in range(1, len(parts)))

    def has_saved_state(fqn: str) -> bool:
        return fqn in prefixes

    if not flat:
        states = optim_sd.get("state", {})
        absent = {fqn for fqn in states if not has_saved_state(fqn)}
        return {**optim_sd, "state": {f: v for f, v in states.items() if f not in absent}}, absent

    def owner(key: str) -> str:  # the longest parameter name that prefixes "<fqn>.<name>"
        parts = key.split(".")
        for end in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:end]) in fqns:
                return ".".join(parts[:end])
        return key.rsplit(".", 1)[0]

    owners = {k: owner(k[len("state."):]) for k in optim_sd if k.startswith("state.")}
    absent = {f for f in owners.values() if not has_saved_state(f)}
    return {k: v for k, v in optim_sd.items() if owners.get(k) not in absent}, absent



def forget_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                            absent: set[str]) -> None:
    """Remove the optimizer's state of the parameters named in ``absent`` (``get_state_dict``
    created it to build the load target). torch's loading of a per-parameter
    (``flatten_optimizer``) state dict asks every state name the optimizer holds for a
    parameter; with none held, a parameter without saved state loads as ``{}``: fresh, as in
    the run that saved the checkpoint. The names are the ones DCP uses, from the nested state
    dict's groups (same order as ``optimizer.param_groups``)."""
    if not absent:
        return
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    for group, named in zip(optimizer.param_groups, groups):
        for param, fqn in zip(group["params"], named["params"]):
            if fqn in absent:
                optimizer.state.pop(param, None)



def drop_empty_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Remove the ``{}`` states a load leaves for parameters without saved state: absent,
    they are what they were in the run that saved the checkpoint (the optimizer treats both
    alike; the next save then holds no keys for them either)."""
    for param, st in list(optimizer.state.items()):
        if not st:
            del optimizer.state[param]



def saved_flat_optimizer(path: Path) -> bool:
    """Whether the checkpoint's optimizer state is keyed per parameter (``save_checkpoint(...,
    flatten_optimizer=True)``): it then has no ``optim.param_groups.<i>.params`` lists."""
    names = load_metadata(path / ".metadata").state_dict_metadata.keys()
    groups = [n for n in names if n.startswith("optim.param_groups.")]
    return bool(groups) and not any(n.endswith(".params") for n in groups)
