"""``llmforge train CONFIG --dry-run``: what a run would be, with nothing allocated.

The model is built on the meta device (no memory), so an 8B or 405B config is inspected on a
laptop. Memory per device counts parameters, gradients and AdamW state only; activations,
temporary buffers and framework overhead come on top.

Each algorithm may add lines (``Algorithm.dry_run_lines``): e.g. an adapter plugin reports
trainable vs frozen parameters and a per-device budget compared with the device memory
(``--device-memory-gib``; default: 80 and 192 GiB, an H100/H200-class and a
B200/MI300X-class accelerator).

With ``strategy.pp > 1`` the memory line counts the busiest pipeline rank's parameters, and two
lines give the stages (blocks and parameters of each) and the schedule's bubble fraction
(:func:`llmforge.parallel.pipeline.bubble_fraction`, with its sources).
"""

from __future__ import annotations

from typing import Any, Optional


from llmforge.config.validate import BatchPlan
from llmforge.data.mixture import mixture_report
from llmforge.models.memory_estimate import (GIB, _fmt_count, bf16_param_dtype, estimate_activations,
                                             estimate_memory, gathered_block_bytes)
from llmforge.models.spec import get_spec
from llmforge.parallel.mesh import ParallelDims
from llmforge.parallel.pipeline import stage_params
from llmforge.parallel.transforms import pipeline_layout
from llmforge.plugin import meta_model


def _dp_words(plan: BatchPlan, dims: ParallelDims) -> str:
    """``dp N``, with HSDP's split: ``dp 64 = 4 replicas x 16 shards (HSDP)``, so the memory
    line's ``sharded Sx`` (shards x tp) reads against it."""
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        return (f"dp {plan.dp_size} = {dims.dp_replicate} replicas x {dims.dp_shard} shards "
                "(HSDP)")
    return f"dp {plan.dp_size}"


_BUBBLE_SOURCES = {
    "1f1b": "(p-1)/(m+p-1), Narayanan et al. 2021 sec. 2.2.1",
    "gpipe": "(p-1)/(m+p-1), Narayanan et al. 2021 sec. 2.2.1",
    "interleaved_1f1b": "(p-1)/(v*m+p-1), Narayanan et al. 2021 sec. 2.2.2",
    "zbv": "0 for m >= 2p with equal F/B/W times, Qi et al. 2023 (arXiv:2401.10241) sec. 6",
    "dualpipev": "0 for m >= 2p with equal F/B/W times, as ZB-V (Qi et al. 2023, arXiv:2401.10241)",
}


def _pipeline_lines(cfg: Any, dims: ParallelDims, model: Any, spec: Any) -> tuple[list[str], int, float]:
    """The ``pp stages`` and ``pp schedule`` lines, the parameters of the busiest pp rank and
    the largest share of the blocks one pp rank holds."""
    layout = pipeline_layout(cfg, dims, model)
    per_stage = stage_params(model, layout, spec.stage_ends, spec.model_blocks(model))
    per_rank = [sum(per_stage[s] for s in layout.stages_of_rank(r)) for r in range(layout.pp)]
    first, last = spec.stage_ends

    def words(s: int) -> str:
        b = layout.split[s]
        ends = (["+ " + ", ".join(first)] if s == 0 else []) + (
            ["+ " + ", ".join(last)] if s == layout.num_stages - 1 else [])
        return " ".join([f"{s}: blocks {b[0]}-{b[-1]}", *ends, f"({_fmt_count(per_stage[s])})"])

    stages = "; ".join(words(s) for s in range(layout.num_stages))
    m, p, v = layout.microbatches, layout.pp, layout.stages_per_rank
    return [
        f"pp stages       {stages}; busiest rank {_fmt_count(max(per_rank))} parameters",
        f"pp schedule     {layout.schedule}, {p} ranks x {v} stage(s), {m} micro-batches: bubble "
        f"{layout.bubble():.1%} of the step ({_BUBBLE_SOURCES[layout.schedule]})",
    ], max(per_rank), max(sum(len(layout.split[s]) for s in layout.stages_of_rank(r))
                          for r in range(layout.pp)) / len(spec.model_blocks(model))


def dry_run_report(run: Any, algorithms: list[Any], device_memory_gib: Optional[float] = None) -> str:
    """Describe the run's model on meta (:func:`llmforge.plugin.meta_model`): parameters,
    FLOPs, batch and memory, then each algorithm's own lines
    (:meth:`llmforge.plugin.Algorithm.dry_run_lines`).

    Args:
        run: the :class:`~llmforge.preflight.resolve.ResolvedRun` (its ``cfg``, ``plan``
            and ``dims``: nothing is derived again here).
        algorithms: the run's algorithm instances (``Trainer.algorithms``, already checked).
        device_memory_gib: memory of one device, GiB, for algorithms' fit verdicts (``None``:
            80 and 192).
    """
    cfg, plan, dims = run.cfg, run.plan, run.dims
    spec = get_spec(cfg.model.name)
    model = meta_model(cfg)
    n_params, n_active = spec.num_params(model)
    seq = cfg.trainer.seq_len
    flops = spec.flops(model, seq)
    pp_lines, device_params, block_share = _pipeline_lines(cfg, dims, model, spec) if dims.pp > 1 \
        else ([], n_params, 1.0)
    mem = estimate_memory(device_params, cfg.trainer.precision, cfg.strategy, plan.world_size // dims.pp)
    lines = [
        f"model           {cfg.model.name} (preset {cfg.model.preset})",
        f"parameters      {_fmt_count(n_params)} ({n_params:,})" + (
            f", active {_fmt_count(n_active)} ({n_active:,}) per token" if n_active != n_params else ""),
        f"vocab_size      {model.vocab_size:,}",
        f"flops/token     {flops:.4g} (training, at seq_len {seq})",
        f"world size      {plan.world_size} ({cfg.strategy.name}, {_dp_words(plan, dims)}, tp {cfg.strategy.tp}"
        + (f", pp {dims.pp}" if dims.pp > 1 else "")
        + (f", ep {cfg.strategy.ep})" if cfg.strategy.ep > 1 else ")"),
        *pp_lines,
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
    ft = cfg.get("fault_tolerance")
    if ft is not None and ft.enabled:  # docs/fault_tolerance.md
        lines.insert(lines.index(next(x for x in lines if x.startswith("global batch"))) + 1,
                     f"replica group   {ft.replica_id} of {ft.replica_groups} (torchft, lighthouse "
                     f"{ft.lighthouse}): {plan.local_batch_size * plan.dp_size} of the "
                     f"{plan.global_batch_size} sequences per step; commits with >= {ft.min_replicas} "
                     "group(s)")
    extra = [(a, a.dry_run_lines(cfg, plan, device_memory_gib)) for a in algorithms]
    if any(lines_ and getattr(a, "replaces_memory_estimate", False) for a, lines_ in extra):
        lines = [x for x in lines if not x.startswith("memory/device")]
        return "\n".join(lines + [x for _, lines_ in extra for x in lines_])
    lines += [x for _, lines_ in extra for x in lines_]
    lines += _expert_lines(cfg, model, spec)
    act = estimate_activations(model, plan.micro_batch_size, seq, cfg.trainer.precision,
                               max(1, cfg.strategy.tp), spec=spec, bf16_weights=bf16_param_dtype(cfg))
    if act is not None:
        # a pipeline rank runs only its blocks, but keeps several micro-batches in flight
        # (1F1B: up to pp on the first stage)
        where = f" on the busiest pp rank ({block_share:.1%} of the blocks)" if dims.pp > 1 else ""
        lines.append(f"activations     {act[0] * block_share / GIB:.2f} GiB per micro-batch{where} "
                     f"without activation checkpointing, {act[1] * block_share / GIB:.2f} GiB with full "
                     "checkpointing (estimate" + ("; the schedule keeps several in flight)" if where else ")"))
    return "\n".join(lines)


def _expert_lines(cfg: Any, model: Any, spec: Any) -> list[str]:
    """A mixture of experts: experts per device under ``strategy.ep`` and one block's
    all-gathered weights (:func:`~llmforge.models.memory_estimate.gathered_block_bytes`)."""
    ep, tp = int(cfg.strategy.ep), max(1, int(cfg.strategy.tp))
    width = 2 if cfg.trainer.precision == "bf16-true" or str(
        cfg.strategy.mixed_precision.param_dtype) in ("bfloat16", "bf16", "float16", "fp16") else 4
    got = gathered_block_bytes(model, spec, width, tp, ep)
    if got is None:
        return []
    block, experts, per_device = got
    at_ep1 = gathered_block_bytes(model, spec, width, tp, 1)
    assert at_ep1 is not None
    return [f"experts         {per_device * ep} per layer, ep {ep}: {per_device} per device; one block's "
            f"all-gathered weights {_size(block)} (experts {_size(experts)}"
            + (f"; {_size(at_ep1[0])} at ep 1)" if ep > 1 else ")")]


def _size(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f} GiB" if n_bytes >= 0.1 * GIB else f"{n_bytes / 1024**2:.2f} MiB"
