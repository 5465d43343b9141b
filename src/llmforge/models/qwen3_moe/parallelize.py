"""Qwen3-MoE under tensor parallelism: not yet. Its attention could take Qwen3's plan
(:mod:`llmforge.models.qwen3.parallelize`), but the experts have no plan (they would be split
by expert parallelism, not by TP), so :func:`check_tp` refuses ``strategy.tp > 1`` before
anything is built or written."""

from __future__ import annotations

from typing import Any

from torch import nn

from llmforge.errors import ConfigError
from llmforge.models.qwen3.parallelize import apply_tp  # the spec's tp_plan; reached at tp=1 only

__all__ = ["apply_tp", "check_tp"]


def check_tp(model: nn.Module, tp: int) -> None:
    """Raises ConfigError: ``tp > 1`` (no tensor-parallel plan for the experts yet)."""
    if tp > 1:
        raise ConfigError(f"strategy.tp={tp}: qwen3_moe has no tensor-parallel plan for its experts "
                          "yet; use strategy.tp=1 (fsdp2 or ddp shard the experts' weights)")

