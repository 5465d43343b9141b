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

from typing import Any, Optional

import torch

from llmforge.algorithms.loading import build_algorithms
from llmforge.config.validate import BatchPlan
from llmforge.data.mixture import mixture_report
from llmforge.models.memory_estimate import (GIB, _fmt_count, bf16_param_dtype, estimate_activations,
                                             estimate_memory)
from llmforge.models.spec import get_spec
from llmforge.parallel.mesh import ParallelDims


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
    algorithm's own lines (:meth:`llmforge.plugin.Algorithm.dry_run_lines`).

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
    lines += mixture_report(cfg, plan.tokens_per_step)  # data.mixture: share and tokens per source
    if algorithms is None:
        algorithms = build_algorithms(cfg)
    extra = [(a, a.dry_run_lines(cfg, plan, device_memory_gib)) for a in algorithms]
    if any(lines_ and getattr(a, "replaces_memory_estimate", False) for a, lines_ in extra):
        lines = [x for x in lines if not x.startswith("memory/device")]
        return "\n".join(lines + [x for _, lines_ in extra for x in lines_])
    lines += [x for _, lines_ in extra for x in lines_]
    act = estimate_activations(model, plan.micro_batch_size, seq, cfg.trainer.precision,
                               max(1, cfg.strategy.tp), spec=spec, bf16_weights=bf16_param_dtype(cfg))
    if act is not None:
        lines.append(f"activations     {act[0] / GIB:.2f} GiB per micro-batch without activation "
                     f"checkpointing, {act[1] / GIB:.2f} GiB with full checkpointing (estimate)")
    return "\n".join(lines)
