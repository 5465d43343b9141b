"""Layouts derived from a reference simulation (steps 2, 4 and 5 of
:mod:`llmforge.planning.planner`): the peak memory and the step time of a layout from the
measurement of its ``(tp, activation checkpointing)`` group, without simulating it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from llmforge.planning.gpus import GPUKind
from llmforge.planning.measure import Collective
from llmforge.planning.experts import ExpertShape
from llmforge.planning.layout import Layout
from llmforge.planning.simulate import StepMeasurement
from llmforge.planning.stages import StageShape, forward_activations

EFFICIENCY = 0.5
"""Fraction of the dense bf16 peak that the step's FLOPs are assumed to run at (a well-tuned
FSDP2 Llama step on H100 reaches 40-55 % MFU: torchtitan's published benchmarks)."""

P2P_LATENCY = 10e-6
"""Seconds a point-to-point send between pipeline stages costs at least (a small NCCL message
between nodes takes about 5-20 microseconds): what keeps a tiny model off pipeline stages."""


def _seconds(c: Collective, n_ranks: int, world: int, gpu: GPUKind, span: int) -> float:
    if n_ranks <= 1:
        return 0.0
    bw = gpu.intra_node_bw if span <= gpu.gpus_per_node or world <= gpu.gpus_per_node else gpu.inter_node_bw
    factor = 2.0 if c.kind == "all_reduce" else 1.0
    return factor * c.bytes * (n_ranks - 1) / n_ranks / bw


def derive(ref: StepMeasurement, layout: Layout, gbs: int, gpu: GPUKind, exact: bool = False,
           experts: Optional[ExpertShape] = None, seq_len: int = 0, width: int = 2,
           stages: Optional[StageShape] = None) -> tuple[float, float, float]:
    """``(peak_bytes, step_seconds, flops_per_rank)`` of ``layout`` from the reference
    measurement of its ``(tp, activation checkpointing)`` group (module docstring, step 2);
    ``exact``: ``ref`` is the layout's own simulation (at ``ep=1``: no memory scaling). With
    ``experts`` (a mixture of experts): FLOPs from the active parameters and, for ``ep > 1``,
    step 4 of the module docstring (``seq_len`` tokens per sequence, ``width`` bytes per
    activation and gathered weight element). ``stages``: the pipeline schedule of ``pp``
    layouts (step 5)."""
    lo, r = layout, ref.layout
    dp = lo.dp_replicate * lo.dp_shard
    n_micro = gbs // dp // lo.micro_batch_size
    n_micro_ref = gbs // (r.dp_replicate * r.dp_shard) // r.micro_batch_size
    if exact:
        peak = ref.peak_bytes
    else:
        rest = ref.peak_bytes - ref.sharded_state
        ratio = lo.micro_batch_size / r.micro_batch_size
        # a rank holds 1 / pp of the blocks, sharded dp_shard ways
        peak = ref.sharded_state * (r.dp_shard * r.pp) / (lo.dp_shard * lo.pp)
        if lo.pp == r.pp:
            peak += rest * ratio
        else:  # one micro-batch's activations of the rank's blocks, times those in flight
            act = forward_activations(ref)
            held = stages.in_flight(lo.pp, n_micro) if stages is not None else 1.0
            peak += (rest - act) * ratio + act * ratio * r.pp / lo.pp * held
    world = lo.world_size
    fsdp = replicas = exposed = 0.0
    for c in ref.collectives:
        if c.mesh_dim.startswith("dp_shard"):
            # FSDP2 all-gathers and reduce-scatters every micro-batch (MicroBatchStep.no_sync), the
            # rank's 1 / pp of the blocks; replicated weights (dp_shard 1) all-reduce once
            c2 = c if exact else replace(c, bytes=c.bytes * n_micro / n_micro_ref * r.pp / lo.pp)
            fsdp += _seconds(c2, lo.dp_shard, world, gpu, lo.dp_shard * lo.tp)
            if not exact and lo.dp_replicate > 1 and c.kind == "reduce_scatter":
                syncs = n_micro if lo.dp_shard > 1 else 1
                ar = Collective("all_reduce", "dp_replicate", lo.dp_replicate, 1,
                                c.bytes / n_micro_ref * r.pp / lo.pp * syncs / lo.dp_shard)
                replicas += _seconds(ar, lo.dp_replicate, world, gpu, world)
        elif c.mesh_dim == "dp_replicate":
            replicas += _seconds(c, lo.dp_replicate, world, gpu, world)
        elif c.mesh_dim == "tp":
            exposed += _seconds(c, lo.tp, world, gpu, lo.tp)
    flops = ref.flops if experts is None else ref.formula_flops
    if experts is not None and lo.ep > 1:
        ep = lo.ep
        peak -= 2 * experts.gathered_experts * width * (1 - 1 / ep)
        fsdp *= 1 - experts.expert_fraction * (1 - 1 / ep)  # a rank gathers its E / ep experts
        exchanges = (6 if lo.activation_checkpointing == "full" else 4) * experts.sparse_layers * n_micro
        rows = lo.micro_batch_size * seq_len * experts.top_k
        a2a = Collective("all_to_all", "ep", ep, exchanges, exchanges * rows * experts.dim * width)
        exposed += _seconds(a2a, ep, world, gpu, ep * lo.tp)  # sends (ep - 1) / ep of the rows
    compute = flops / (gpu.bf16_flops * EFFICIENCY)
    if lo.pp > 1 and stages is not None:
        # the bubble stretches the compute; neighbouring stages are world / pp ranks apart
        compute /= 1 - stages.bubble(lo.pp, n_micro)
        bw = gpu.intra_node_bw if world // lo.pp < gpu.gpus_per_node else gpu.inter_node_bw
        sends = 2 * n_micro * stages.stages_per_rank  # each virtual stage's, forward and backward
        exposed += sends * (stages.p2p_bytes(lo.micro_batch_size, seq_len, width) / bw + P2P_LATENCY)
    return peak, max(compute, fsdp + replicas) + exposed, flops
