"""Initialization that gives the same full weights for any world size and seed.

In one process the model's own ``init_weights()`` runs after ``torch.manual_seed(seed)``. With
several ranks, rank 0 builds the same model on the CPU, initializes it the same way and the
full weights are broadcast into every rank's shards (``set_model_state_dict`` with
``broadcast_from_rank0``), so 1, 2 or 8 processes start from identical weights. Models whose
fp32 weights exceed ``max_full_init_bytes`` are initialized shard by shard instead (DTensor
random init: the same distribution, not the same numbers as one process).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from llmforge.plugin import has_adapters

DEFAULT_MAX_FULL_INIT_BYTES = 64 * 1024**3


def seeded_init(model: nn.Module, seed: int) -> None:
    """``init_weights()`` under ``seed`` without disturbing the global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()


def init_parallel_model(model: nn.Module, build: Callable[[], nn.Module], seed: int,
                        max_full_init_bytes: int = DEFAULT_MAX_FULL_INIT_BYTES,
                        every_rank_builds: bool = False) -> str:
    """Initialize a materialized (possibly sharded) ``model``; returns the method used.

    Args:
        model: materialized on its device; parameters may be DTensors.
        build: builds the same model unsharded on the current device (called on rank 0 under
            ``torch.device("cpu")``).
        seed: ``run.seed``.
        every_rank_builds: a pipeline stage (``model`` holds a part of the whole model's
            parameters, different on each stage): every rank builds the whole model on the CPU
            and takes its own parameters from it (``"full-local"``), as rank 0's broadcast
            covers only rank 0's own names.
    """
    seeded_init(model, seed)  # buffers (RoPE tables) and a valid init whatever happens next
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return "local"
    n_bytes = sum(p.numel() for p in model.parameters()) * 4  # numel of a DTensor is global
    if n_bytes > max_full_init_bytes:
        return "sharded"
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, Any] = {}
    if every_rank_builds:
        with torch.device("cpu"):
            ref = build()
        seeded_init(ref, seed)
        own = set(model.state_dict())
        full = {k: v for k, v in ref.state_dict().items() if k in own}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   strict=not has_adapters(model)))
        return "full-local"
    if dist.get_rank() == 0:
        with torch.device("cpu"):
            ref = build()
        seeded_init(ref, seed)
        full = ref.state_dict()
    # a plugin's adapters are not in the plain build's state dict; they are initialized (the
    # same on every rank) by init_weights above, so they are left out of the broadcast
    extra = has_adapters(model)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True,
                                                               strict=not extra))
    return "full-broadcast"
