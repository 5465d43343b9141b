"""The model pipeline and the ``Algorithm`` base class (Composer-style).

A model is built on the meta device and passes through one ordered pipeline of transforms
before it is materialized (the order torchtitan uses and documents)::

    CONVERT (lora, float8: swap module types)
      -> TENSOR_PARALLEL -> ACTIVATION_CHECKPOINTING -> COMPILE
      -> DATA_PARALLEL (FSDP2 per block, then root; or DDP)
      -> materialize + initialize (LLMModule.configure_model)

Algorithms declare the stage they act in; the strategy owns the two parallel stages. The
pipeline sorts transforms by stage (stable within a stage), so the order of the YAML list never
changes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, Optional, Sequence

from lightning.pytorch.callbacks import Callback
from torch import nn


class Stage(IntEnum):
    """Pipeline stages, in the order they run."""

    CONVERT = 10
    TENSOR_PARALLEL = 20
    ACTIVATION_CHECKPOINTING = 30
    COMPILE = 40
    DATA_PARALLEL = 50


@dataclass
class ModelContext:
    """What a transform may need: the run config, the device mesh and parallel sizes.

    Attributes:
        cfg: the resolved run config.
        mesh: the ``DeviceMesh`` (dims ``dp_replicate``, ``dp_shard``, ``tp``) or ``None`` in one
            process.
        dims: :class:`llmforge.parallel.mesh.ParallelDims`.
        device: the device the model will be materialized on.
    """

    cfg: Any
    mesh: Any
    dims: Any
    device: Any


@dataclass
class Transform:
    """One pipeline step: ``fn(model, ctx) -> model`` at ``stage``; within a stage, lower
    ``priority`` runs first (``lora`` has 1, so ``float8`` converts the base layers before LoRA
    adds its adapters)."""

    stage: Stage
    name: str
    fn: Callable[[nn.Module, ModelContext], nn.Module]
    priority: int = 0

    def sort_key(self) -> tuple[int, int]:
        return int(self.stage), int(self.priority)


def run_pipeline(model: nn.Module, transforms: Sequence[Transform], ctx: ModelContext) -> nn.Module:
    """Apply ``transforms`` sorted by stage, then priority (stable), returning the model."""
    for t in sorted(transforms, key=lambda t: t.sort_key()):
        model = t.fn(model, ctx)
    return model


class Algorithm(Callback):
    """A Lightning ``Callback`` that may also transform the model at one pipeline stage.

    Subclasses set ``stage`` and override :meth:`apply`; they may also override any Lightning
    hook (``on_before_optimizer_step``, ``on_train_batch_start``, ...) and :meth:`check`, which
    sees every configured algorithm before any weight is allocated and raises
    :class:`llmforge.errors.ConfigError` for combinations that cannot work.
    """

    name: str = "algorithm"
    stage: Optional[Stage] = None
    priority: int = 0

    def apply(self, model: nn.Module, ctx: ModelContext) -> nn.Module:
        """Transform the (meta-device) model; return it (or a wrapper)."""
        return model

    def check(self, cfg: Any, algorithms: Sequence["Algorithm"]) -> None:
        """Reject impossible combinations before anything is allocated."""

    def transform(self) -> Optional[Transform]:
        """This algorithm's pipeline step, or ``None`` if it only acts on training events."""
        if self.stage is None:
            return None
        return Transform(self.stage, self.name, self.apply, int(self.priority))
