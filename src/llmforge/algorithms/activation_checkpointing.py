"""``activation_checkpointing``: recompute activations in the backward instead of keeping them.

YAML::

    algorithms:
      - name: activation_checkpointing
        mode: full            # full: every block | selective
        selective: layer      # selective only -- layer: every k-th block | op: per operator
        every: 2              # selective layer: checkpoint blocks k-1, 2k-1, ... (k = every)

* ``full``: each block keeps only its input; everything inside is recomputed in the backward
  (about one extra forward of the blocks, ~+33 % compute).
* ``selective: layer``: full checkpointing of every ``every``-th block only.
* ``selective: op``: inside every block, keep the outputs of the expensive operators (matrix
  multiplies -- every second one, as torchtitan does -- SDPA attention, float8 amax
  reductions, reduce-scatters) and recompute the cheap element-wise rest (norms, RoPE, SiLU,
  casts). Uses ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

Blocks are wrapped in place with ``checkpoint_wrapper`` (non-reentrant): the wrapper replaces
the block in its parent (``model.layers[i]``), so ``model.blocks()`` returns the wrappers and
FSDP2 and compile act on them. State-dict keys are unchanged (the wrapper strips its prefix).

Stage ``ACTIVATION_CHECKPOINTING``: after float8 conversion and tensor parallelism, before
compile and FSDP2 (torchtitan's order). Sources: torchtitan
``torchtitan/distributed/activation_checkpoint.py``; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models".
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from llmforge.errors import ConfigError
from llmforge.plugin import Algorithm, ModelContext, Stage


def _ops(*names: str) -> set:
    """Resolve ``namespace.op.overload`` names that exist in this torch build."""
    out = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None and hasattr(packet, overload):
            out.add(getattr(packet, overload))
    return out


def save_list() -> set:
    """Operators whose outputs ``selective: op`` keeps (torchtitan's list plus the CPU SDPA)."""
    return _ops("aten.mm.default",
                "aten._scaled_dot_product_efficient_attention.default",
                "aten._scaled_dot_product_flash_attention.default",
                "aten._scaled_dot_product_cudnn_attention.default",
                "aten._scaled_dot_product_flash_attention_for_cpu.default",
                "aten._scaled_dot_product_fused_attention_overrideable.default",
                "aten.max.default",  # float8 amax: keeps the scale out of the recompute
                "_c10d_functional.reduce_scatter_tensor.default")


def op_sac_context_fn() -> Any:
    """Contexts for one checkpointed call: save the outputs of :func:`save_list` operators,
    except every second ``mm`` (counted separately in forward and recompute), recompute the rest.
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep, mm = save_list(), torch.ops.aten.mm.default
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[key] += 1
        save = func in keep and not (func == mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def replace_blocks(model: nn.Module, wrap: Callable[[int, nn.Module], nn.Module]) -> int:
    """Replace each block ``b_i`` of ``model.blocks()`` by ``wrap(i, b_i)`` in its parent.

    Returns the number of blocks replaced (``wrap`` returning the block itself leaves it).

    Raises:
        ConfigError: the model has no ``blocks()``, or ``blocks()`` does not return the
            replacements afterwards (it must read the modules from their parent, as Llama's
            ``list(self.layers)`` does).
    """
    if not hasattr(model, "blocks"):
        raise ConfigError("activation_checkpointing needs a model with blocks() (the repeated "
                          "transformer blocks)")
    parents = {id(child): (parent, name) for parent in model.modules()
               for name, child in parent.named_children()}
    replaced = []
    for i, block in enumerate(model.blocks()):
        new = wrap(i, block)
        if new is block:
            continue
        parent, name = parents[id(block)]
        setattr(parent, name, new)
        replaced.append(new)
    now = {id(b) for b in model.blocks()}
    if any(id(r) not in now for r in replaced):
        raise ConfigError("activation_checkpointing: model.blocks() still returns the unwrapped "
                          "blocks; blocks() must return the modules registered in the model")
    return len(replaced)


class ActivationCheckpointing(Algorithm):
    """Wrap transformer blocks in non-reentrant activation checkpointing.

    Args:
        mode: ``full`` (every block) or ``selective``.
        selective: with ``mode: selective``: ``layer`` (every ``every``-th block) or ``op``
            (per-operator policy in every block).
        every: with ``selective: layer``: checkpoint blocks ``every-1, 2*every-1, ...``
            (``1`` = every block).
        preserve_rng_state: replay the RNG state in the recompute (needed only by models with
            dropout; ``false`` is slightly faster).

    Raises:
        ConfigError: unknown ``mode``/``selective``, or ``every < 1``.
    """

    name = "activation_checkpointing"
    stage = Stage.ACTIVATION_CHECKPOINTING
    summary = "recompute activations in backward: full, every k-th block, or per operator (SAC)"

    def __init__(self, mode: str = "full", selective: str = "layer", every: int = 2,
                 preserve_rng_state: bool = True) -> None:
        if mode not in ("full", "selective"):
            raise ConfigError(f"algorithms: activation_checkpointing.mode '{mode}' is not one of "
                              "full, selective")
        if mode == "selective" and selective not in ("layer", "op"):
            raise ConfigError(f"algorithms: activation_checkpointing.selective '{selective}' is "
                              "not one of layer, op")
        if int(every) < 1:
            raise ConfigError(f"algorithms: activation_checkpointing.every must be >= 1, got {every}")
        self.mode, self.selective, self.every = mode, selective, int(every)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.wrapped = 0

    def describe(self) -> str:
        if self.mode == "full":
            return "full"
        if self.selective == "op":
            return "selective op"
        return f"selective layer (every {self.every})"

    def wrap(self, index: int, block: nn.Module) -> nn.Module:
        """The checkpoint wrapper for block ``index``, or the block itself if it is skipped."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        kwargs: dict[str, Any] = {"preserve_rng_state": self.preserve_rng_state}
        if self.mode == "selective" and self.selective == "layer" and (index + 1) % self.every:
            return block
        if self.mode == "selective" and self.selective == "op":
            kwargs["context_fn"] = partial(op_sac_context_fn)
        return checkpoint_wrapper(block, **kwargs)

    def apply(self, model: nn.Module, ctx: ModelContext) -> nn.Module:
        """Wrap the blocks in place; returns ``model``."""
        self.wrapped = replace_blocks(model, self.wrap)
        return model
