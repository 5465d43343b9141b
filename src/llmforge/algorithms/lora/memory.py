"""The dry run's report for a LoRA run: rank, trainable and frozen parameters, memory per device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from llmforge.models.memory_estimate import (GIB, USABLE_FRACTION, _fmt_count, bf16_param_dtype,
                                             estimate_activations, estimate_memory)
from llmforge.plugin import build_meta_model


@dataclass
class LoRAMemory:
    """Bytes per device of a LoRA run (see :func:`lora_memory`)."""

    base_bytes: float
    adapter_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    gathered_bytes: float
    activation_bytes: float
    shards: int
    offload: bool

    @property
    def total_bytes(self) -> float:
        return (self.base_bytes + self.adapter_bytes + self.grads_bytes + self.optimizer_bytes
                + self.gathered_bytes + self.activation_bytes)


def lora_memory(cfg: Any, plan: Any, model: Any, trainable: int, frozen: int,
                base_dtype: torch.dtype) -> LoRAMemory:
    """Per-device memory of a LoRA run, in bytes (an estimate).

    * base: ``frozen`` parameters x bytes of ``base_dtype``, divided by the FSDP2 shard degree
      (0 on the device with ``strategy.cpu_offload``);
    * adapters, their gradients, AdamW's two moments: ``trainable`` x 4 bytes each (2 under
      ``bf16-true``), sharded likewise;
    * FSDP2 (shards > 1): the unsharded parameters being used: two blocks (the current one and
      the prefetched next) plus the root's own parameters (embedding, output, final norm: the
      root is not resharded after forward), in the compute dtype
      (``strategy.mixed_precision.param_dtype``, else ``base_dtype``);
    * activations: :func:`estimate_activations` of one micro-batch, with full checkpointing when
      an ``activation_checkpointing`` entry with ``mode: full`` is configured.
    """
    mem = estimate_memory(1, cfg.trainer.precision, cfg.strategy, plan.world_size)
    shards = mem.shards
    width = 2 if cfg.trainer.precision == "bf16-true" else 4
    base_w = torch.empty((), dtype=base_dtype).element_size()
    offload = bool(cfg.strategy.get("cpu_offload", False)) and cfg.strategy.name == "fsdp2"
    base = 0.0 if offload else frozen * base_w / shards
    gathered = 0.0
    if shards > 1:
        mp = cfg.strategy.mixed_precision.param_dtype
        comp_w = 2 if mp in ("bfloat16", "bf16", "float16", "fp16") else base_w
        blocks = model.blocks() if hasattr(model, "blocks") else []
        block = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
        root = sum(p.numel() for p in model.parameters()) - block * len(blocks)
        gathered = (2 * block + root) * comp_w
    act = estimate_activations(model, plan.micro_batch_size, cfg.trainer.seq_len,
                               cfg.trainer.precision, max(1, cfg.strategy.tp),
                               bf16_weights=bf16_param_dtype(cfg))
    full_ac = any(e.get("name") == "activation_checkpointing" and e.get("mode", "full") == "full"
                  for e in cfg.algorithms or [])
    activations = 0.0 if act is None else (act[1] if full_ac else act[0])
    return LoRAMemory(base, trainable * width / shards, trainable * width / shards,
                      2 * trainable * width / shards, gathered, activations, shards, offload)


def lora_lines(lora: Any, cfg: Any, plan: Any, device_memory_gib: Optional[float]) -> list[str]:
    """The LoRA part of the dry-run report, for the :class:`~llmforge.algorithms.lora.LoRA`
    entry ``lora`` (its layers are added to a build on the meta device).

    Args:
        device_memory_gib: memory of one device, GiB, for the fit verdict (``None``: 80 and 192).
    """
    model = lora.convert(build_meta_model(cfg), cfg.run.seed)  # a new one: convert changes it
    trainable, frozen = parameter_counts(model)
    m = lora_memory(cfg, plan, model, trainable, frozen, lora.base_dtype)
    where = "on the CPU (strategy.cpu_offload)" if m.offload else f"sharded {m.shards}x"
    lines = [
        f"lora            rank {lora.rank}, alpha {lora.alpha:g} on {len(lora.converted)} Linear "
        f"layers ({', '.join(lora.targets)})",
        f"trainable       {_fmt_count(trainable)} ({trainable:,}) = "
        f"{100 * trainable / max(1, trainable + frozen):.3f}% of all parameters",
        f"frozen          {_fmt_count(frozen)} ({frozen:,}), base in {lora.base_dtype_name}",
        f"memory/device   base {m.base_bytes / GIB:.2f} GiB ({where}) + adapters "
        f"{m.adapter_bytes / GIB:.2f} + grads {m.grads_bytes / GIB:.2f} + AdamW "
        f"{m.optimizer_bytes / GIB:.2f} + FSDP2 unsharded params {m.gathered_bytes / GIB:.2f} + "
        f"activations {m.activation_bytes / GIB:.2f} = {m.total_bytes / GIB:.2f} GiB (estimate)",
    ]
    sizes = [device_memory_gib] if device_memory_gib else [80.0, 192.0]
    for size in sizes:
        usable = size * USABLE_FRACTION
        fits = m.total_bytes / GIB <= usable
        verdict = "fits" if fits else "does NOT fit"
        hint = "" if fits or m.offload else " (try strategy.cpu_offload=true, more GPUs, or a shorter seq_len)"
        lines.append(f"device memory   {verdict} in {size:g} GiB per device ({usable:.0f} GiB usable, "
                     f"{USABLE_FRACTION:.0%}){hint}")
    return lines


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` parameter counts (global for sharded parameters; a tied
    parameter once)."""
    seen: set[int] = set()
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen
