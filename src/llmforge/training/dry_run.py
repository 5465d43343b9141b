"""``llmforge train CONFIG --dry-run``: what a run would be, with nothing allocated.

The model is built on the meta device (no memory), so an 8B or 405B config is inspected on a
laptop. Memory per device counts parameters, gradients and AdamW state only; activations,
temporary buffers and framework overhead come on top.

Each algorithm may add lines (``Algorithm.dry_run_lines``): e.g. an adapter plugin reports
trainable vs frozen parameters and a per-device budget compared with the device memory
(``--device-memory-gib``; default: 80 and 192 GiB, an H100/H200-class and a
B200/MI300X-class accelerator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from llmforge.config.validate import BatchPlan
from llmforge.parallel.mesh import ParallelDims
from llmforge.models.spec import get_spec

GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per device for the model state (``*_bytes``) and the sharding degree used."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    shards: int

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def estimate_memory(n_params: int, precision: str, strategy: Any, world_size: int,
                    n_trainable: int | None = None) -> MemoryEstimate:
    """Parameters, gradients and AdamW state per device, in bytes.

    Bytes per parameter: ``fp32`` and ``bf16-mixed`` keep fp32 weights and gradients (4 + 4)
    and two fp32 Adam moments (8); ``bf16-true`` keeps everything in bf16 (2 + 2 + 4). FSDP2
    divides model state by ``dp_shard * tp``; DDP and one process by ``tp`` only.
    """
    trainable = n_params if n_trainable is None else n_trainable
    width = 2 if precision == "bf16-true" else 4
    tp = max(1, strategy.tp)
    if strategy.name == "fsdp2":
        dp_shard = strategy.dp_shard if strategy.dp_shard > 0 else world_size // (strategy.dp_replicate * tp)
        shards = max(1, dp_shard) * tp
    else:
        shards = tp
    return MemoryEstimate(n_params * width / shards, trainable * width / shards,
                          2 * trainable * width / shards, shards)


def estimate_activations(model: Any, micro_batch_size: int, seq_len: int, precision: str,
                         tp: int = 1, spec: Any = None) -> Optional[tuple[float, float]]:
    """Activation bytes per device for one micro-batch: ``(no checkpointing, full checkpointing)``.

    Counts the tensors a decoder block saves for backward, per token (method of Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4, adapted
    to RMSNorm, GQA, SwiGLU and fused SDPA attention, which saves no T x T scores):
    ``5 D + 3 q + 3 kv + 4 F + extra`` elements (two norms' inputs and outputs, q/k/v and their
    rotated copies, the attention output, the SwiGLU's four F-wide tensors; ``extra`` from the
    family, e.g. QK-norm outputs; for Llama ``q = D`` and this is ``8 D + 3 kv + 4 F``), in the
    activation dtype (2 bytes for bf16 precisions, 4 for fp32), divided by ``tp`` (sequence
    parallel). Full activation checkpointing keeps only each block's input (``D`` per token per
    layer) plus one block recomputed at a time. The fp32 logits and their gradient (``2 x 4 V``
    bytes per token) come on top in both cases. The widths come from the family's
    ``ModelSpec.memory_shape`` (``spec``, or the registered spec of the model's class);
    ``None`` for models without one.
    """
    from llmforge.models.spec import spec_for_model

    spec = spec if spec is not None else spec_for_model(model)
    fn = spec.get("memory_shape") if spec is not None else None
    if fn is None:
        return None
    m = fn(model)
    width = 4 if precision == "fp32" else 2
    tokens = micro_batch_size * seq_len
    per_layer = tokens * (5 * m.dim + 3 * m.q_dim + 3 * m.kv_dim + 4 * m.ffn_dim + m.extra) * width / tp
    logits = tokens * m.vocab_size * 4 * 2 / tp
    no_ac = m.n_layers * per_layer + logits
    full_ac = m.n_layers * tokens * m.dim * width / tp + per_layer + logits
    return no_ac, full_ac


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


USABLE_FRACTION = 0.9
"""Share of device memory counted as usable (the CUDA context, allocator fragmentation and
NCCL buffers take the rest)."""


def _dp_words(cfg: Any, plan: BatchPlan) -> str:
    """``dp N``, with HSDP's split: ``dp 64 = 4 replicas x 16 shards (HSDP)``, so the memory
    line's ``sharded Sx`` (shards x tp) reads against it."""
    dims = ParallelDims.from_config(cfg, plan.world_size)
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        return (f"dp {plan.dp_size} = {dims.dp_replicate} replicas x {dims.dp_shard} shards "
                "(HSDP)")
    return f"dp {plan.dp_size}"


def dry_run_report(cfg: Any, plan: BatchPlan, device_memory_gib: Optional[float] = None,
                   algorithms: Optional[list[Any]] = None) -> str:
    """Build the model on meta and describe parameters, FLOPs, batch and memory, then each
    algorithm's own lines (:meth:`llmforge.algorithms.base.Algorithm.dry_run_lines`).

    Args:
        device_memory_gib: memory of one device, GiB, for algorithms' fit verdicts (``None``:
            80 and 192).
        algorithms: the run's algorithm instances (default: built from ``cfg.algorithms``).
    """
    spec = get_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec(cfg.model)
    n_params, n_active = spec.num_params(model)
    seq = cfg.trainer.seq_len
    flops = spec.flops(model, seq)
    mem = estimate_memory(n_params, cfg.trainer.precision, cfg.strategy, plan.world_size)
    lines = [
        f"model           {cfg.model.name} (preset {cfg.model.preset})",
        f"parameters      {_fmt_count(n_params)} ({n_params:,})" + (
            f", active {_fmt_count(n_active)} ({n_active:,}) per token" if n_active != n_params else ""),
        f"vocab_size      {model.vocab_size:,}",
        f"flops/token     {flops:.4g} (training, at seq_len {seq})",
        f"world size      {plan.world_size} ({cfg.strategy.name}, {_dp_words(cfg, plan)}, tp {cfg.strategy.tp})",
        f"micro batch     {plan.micro_batch_size} sequences x {seq} tokens",
        f"grad accum      {plan.gradient_accumulation_steps} steps",
        f"global batch    {plan.global_batch_size} sequences = {plan.tokens_per_step:,} tokens/step",
        f"training        {cfg.trainer.max_steps:,} steps = {cfg.trainer.max_steps * plan.tokens_per_step:,} tokens"
        f", {flops * plan.tokens_per_step * cfg.trainer.max_steps:.3g} FLOPs",
        f"memory/device   params {mem.params_bytes / GIB:.2f} GiB + grads {mem.grads_bytes / GIB:.2f} GiB"
        f" + AdamW {mem.optimizer_bytes / GIB:.2f} GiB = {mem.total_bytes / GIB:.2f} GiB"
        f" ({cfg.trainer.precision}, sharded {mem.shards}x; activations not included)",
    ]
    from llmforge.data.mixture import mixture_report

    lines += mixture_report(cfg, plan.tokens_per_step)  # data.mixture: share and tokens per source
    if algorithms is None:
        from llmforge.algorithms.loading import build_algorithms

        algorithms = build_algorithms(cfg)
    extra = [(a, a.dry_run_lines(cfg, plan, device_memory_gib)) for a in algorithms]
    if any(lines_ and getattr(a, "replaces_memory_estimate", False) for a, lines_ in extra):
        lines = [x for x in lines if not x.startswith("memory/device")]
        return "\n".join(lines + [x for _, lines_ in extra for x in lines_])
    lines += [x for _, lines_ in extra for x in lines_]
    act = estimate_activations(model, plan.micro_batch_size, seq, cfg.trainer.precision,
                               max(1, cfg.strategy.tp), spec=spec)
    if act is not None:
        lines.append(f"activations     {act[0] / GIB:.2f} GiB per micro-batch without activation "
                     f"checkpointing, {act[1] / GIB:.2f} GiB with full checkpointing (estimate)")
    return "\n".join(lines)
