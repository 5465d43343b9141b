"""What ``llmforge plan`` needs of a mixture of experts to derive ``strategy.ep`` layouts from
the ``ep=1`` simulation (step 4 of :mod:`llmforge.planning.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from llmforge.models.memory_estimate import gathered_block_bytes
from llmforge.models.spec import get_spec
from llmforge.plugin import meta_model

__all__ = ["ExpertShape", "ep_degrees"]


@dataclass(frozen=True)
class ExpertShape:
    """What the ep estimate needs of a mixture of experts (module docstring, step 4).

    Attributes:
        num_experts: experts per sparse layer (the ``ep`` degrees divide it).
        sparse_layers: layers with experts.
        top_k: experts per token, from the parameter counts: ``E - (total - active) /
            (parameters of one expert x sparse_layers)``.
        dim: the width of the rows the all-to-all moves (the expert layers' input).
        expert_fraction: expert parameters / all parameters (the share of the FSDP traffic
            that ``ep`` divides).
        gathered_experts: parameters (elements) of the experts of the largest block, all
            experts (``ep=1``): times the compute width, what FSDP2 gathers for it.
    """

    num_experts: int
    sparse_layers: int
    top_k: int
    dim: int
    expert_fraction: float
    gathered_experts: float

    @staticmethod
    def of(cfg: Any) -> Optional["ExpertShape"]:
        """The shape of ``cfg``'s model (built on the meta device); ``None`` without experts."""
        spec = get_spec(cfg.model.name)
        model = meta_model(cfg)
        experts = spec.expert_modules(model)
        if not experts:
            return None
        e = int(experts[0].num_experts)
        total, active = spec.num_params(model)
        expert_params = sum(p.numel() for m in experts for p in m.parameters())
        per_expert = expert_params / (e * len(experts))
        top_k = round(e - (total - active) / (per_expert * len(experts)))
        dim = int(min(p.shape[-1] for p in experts[0].parameters() if p.ndim == 3))
        dim = int(getattr(getattr(model, "args", None), "dim", dim))
        gathered = gathered_block_bytes(model, spec, 1)
        return ExpertShape(e, len(experts), top_k, dim, expert_params / max(1, total),
                           gathered[1] if gathered else 0.0)


def ep_degrees(shape: Optional[ExpertShape], dp_shard: int) -> list[int]:
    """``[1]`` for a dense model; else every divisor of ``dp_shard`` that divides the number
    of experts."""
    if shape is None:
        return [1]
    both = math.gcd(dp_shard, shape.num_experts)  # the common divisors: few steps at any world size
    return [d for d in range(1, both + 1) if both % d == 0]
