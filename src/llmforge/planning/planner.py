"""``llmforge plan``: choose dp_replicate, dp_shard, tp, pp, activation checkpointing and the
micro-batch size for a GPU count and a GPU kind.

1. Enumerate: ``tp`` among the divisors of the GPUs per node (tensor parallel stays inside a
   node) that the model allows (heads divisible by ``tp``), ``pp`` among the divisors of the
   rest that the config's pipeline schedule and split can cut the blocks into
   (:mod:`llmforge.planning.stages`; none with tied embeddings), every ``dp_replicate x
   dp_shard`` of the rest, activation checkpointing none / selective (per operator) / full,
   every micro-batch size dividing the per-rank batch (and giving the schedule enough
   micro-batches).
   A mixture of experts (``ModelSpec.experts``) also gets every ``ep`` that divides
   ``dp_shard`` and the number of experts. Layouts whose data-parallel size does not divide
   ``global_batch_size`` are dropped.
2. Measure: one simulation (:func:`llmforge.planning.depth.simulate_scaled`) per
   ``(tp, activation checkpointing)`` at the reference layout ``dp_replicate=1``,
   ``dp_shard = world / tp``, ``micro_batch_size=1`` (``pp=1``; where ``world / tp`` does
   not divide the global batch, the fewest stages that make it divide, both pipeline ranks).
   Every other layout of that group is derived from it: the sharded model state at the peak
   scales with ``1 / dp_shard``, the activations and temporaries with the micro-batch size (an
   over-estimate: the all-gather buffers in the temporaries do not grow), the FSDP all-gathers
   and reduce-scatters with the number of micro-batches, HSDP's all-reduce over ``dp_replicate`` is the sharded gradient
   (every micro-batch; once per step for replicated weights, ``dp_shard=1``); FLOPs and
   tensor-parallel bytes per rank are the same for the whole group. The winner (and, when it
   does not fit after all, the next ones) is then simulated with its own layout.
3. Keep the layouts whose peak fits in ``(1 - HEADROOM)`` of the GPU memory and rank them by
   the calibrated step-time model (:mod:`llmforge.planning.step_model`, its constants fitted
   on published measured runs: :mod:`llmforge.planning.calibration`; equal times: less traffic
   first). Mixtures of experts and adapter training (which that model does not cover) keep the
   older one: compute at ``EFFICIENCY`` of the dense bf16 peak, FSDP / HSDP traffic
   overlapped with compute (prefetch), tensor-parallel traffic not overlapped; a collective
   over ``n`` ranks moves ``(n-1)/n`` of its payload per rank (twice for an all-reduce) at the
   intra-node bandwidth when its group fits in a node, else the inter-node one.
4. Expert parallelism is derived from the ``ep=1`` layout with the same ``dp_shard`` (the
   simulation cannot dispatch tokens on a fake process group; :class:`ExpertShape`): the
   sharded state is the same (the experts stay sharded over ``efsdp x ep = dp_shard`` ranks),
   the all-gathered experts of the two blocks in flight (current and prefetched) shrink to
   ``1 / ep``, the expert part of the FSDP traffic too, and four all-to-alls per sparse layer
   and micro-batch (dispatch and combine, forward and backward; six with full activation
   checkpointing) of ``tokens x top_k x dim`` activations move ``(ep - 1) / ep`` of their rows,
   not overlapped. FLOPs of a mixture of experts come from the active parameters (the spec's
   formula: the step's FlopCounterMode does not count ``torch._grouped_mm``).
5. Pipeline stages (``pp > 1``): a rank holds ``1 / pp`` of the blocks (its sharded state and
   FSDP traffic per micro-batch shrink by ``pp``, its micro-batches grow by ``pp``), the first
   stage keeps the activations of the micro-batches in flight
   (:func:`llmforge.planning.stages.in_flight`), the schedule's bubble stretches the compute
   (``compute / (1 - bubble)``, :func:`llmforge.parallel.pipeline.bubble_fraction`), and every
   micro-batch's hidden states and their gradients cross to the neighbouring stage at every
   virtual stage, not overlapped (inter-node when a node holds fewer than ``world / pp`` GPUs;
   whole under TP), each send at least :data:`P2P_LATENCY`. A ``pp`` winner is
   confirmed by simulating its first and its last stage's rank.
6. Context parallelism (``cp``, :mod:`llmforge.planning.context`): searched without pipeline
   stages for dense decoders the calibrated model covers, when sequences are long enough
   (:data:`~llmforge.planning.context.MIN_TOKENS_PER_RANK` tokens per rank). A ``cp`` layout
   is estimated from its ``cp=1`` twin (``dp_shard x cp`` shards, the same model state): the
   twin's per-token memory ``/ cp`` plus the attention mode's buffers; its step time by the
   calibrated model (:func:`llmforge.planning.step_model.context_parallel_seconds`). The
   simulation does not run ``cp > 1``: a ``cp`` winner is reported as estimated, not simulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional


from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.planning.gpus import GPUKind
from llmforge.planning.measure import Collective
from llmforge.planning.depth import simulate_scaled
from llmforge.planning.experts import ExpertShape, ep_degrees
from llmforge.planning.calibration import FITTED
from llmforge.planning.context import (ESTIMATED, cp_degrees, cp_of, fitting_cp, peak_delta, per_token_bytes,
                                       twin)
from llmforge.planning.layout import AC_MODES, Layout
from llmforge.planning.layout_arg import at_layout, calibrated_setting
from llmforge.planning.published import Setting
from llmforge.planning.simulate import StepMeasurement
from llmforge.planning.stages import StageShape, forward_activations, pp_allowed, simulate_layout
from llmforge.planning.step_model import predict
from llmforge.plugin import meta_model

HEADROOM = 0.10
"""Share of GPU memory kept free: the CUDA context, NCCL buffers and the caching allocator's
fragmentation, none of which the simulation sees."""

EFFICIENCY = 0.5
"""Fraction of the dense bf16 peak that the step's FLOPs are assumed to run at (a well-tuned
FSDP2 Llama step on H100 reaches 40-55 % MFU: torchtitan's published benchmarks)."""

P2P_LATENCY = 10e-6

MAX_GPUS = 131_072
"""The most GPUs the planner takes (2**17, above the largest clusters built so far, about
100,000 GPUs): the simulation's fake process group and meshes grow with the world size."""


def check_gpus(world: int, what: str = "--gpus") -> None:
    """Refuse a world size outside ``1..MAX_GPUS`` at once, before any config is read.

    Raises:
        ConfigError: names ``what`` and the value, and the range that works.
    """
    if not 1 <= world <= MAX_GPUS:
        raise ConfigError(f"{what} {world}: the planner takes 1 to {MAX_GPUS:,} GPUs (above the largest "
                          f"clusters built); pass a GPU count in that range")
"""Seconds a point-to-point send between pipeline stages costs at least (a small NCCL message
between nodes takes about 5-20 microseconds): what keeps a tiny model off pipeline stages."""

MAX_CONFIRM = 3
"""Layouts simulated with their own degrees after the ranking, best first, until one fits."""


@dataclass
class Candidate:
    """A layout and the planner's verdict. Times in seconds, memory in bytes."""

    layout: Layout
    status: str = "fits"  # chosen | fits | does not fit | does not divide | refused | not measured | slower
    reason: str = ""
    peak_bytes: Optional[float] = None
    step_seconds: Optional[float] = None
    tokens_per_second_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    simulated: bool = False
    terms: Optional[dict[str, float]] = None  # seconds per step by term (calibrated model)
    traffic: float = 0.0  # FSDP / CP / HSDP seconds before overlap: the tie-break

    def as_dict(self) -> dict[str, Any]:
        lo = self.layout
        return {"dp_replicate": lo.dp_replicate, "dp_shard": lo.dp_shard, "tp": lo.tp, "pp": lo.pp,
                "ep": lo.ep, "cp": lo.cp,
                "activation_checkpointing": lo.activation_checkpointing,
                "micro_batch_size": lo.micro_batch_size, "fits": self.status in ("chosen", "fits", "slower"),
                "peak_bytes_per_rank": self.peak_bytes, "step_seconds": self.step_seconds,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu, "mfu": self.mfu,
                "simulated": self.simulated, "status": self.status, "reason": self.reason,
                "terms_seconds": self.terms}


@dataclass
class Plan:
    """The planner's answer: the winner (``None`` when nothing fits) and every candidate."""

    world_size: int
    gpu: GPUKind
    chosen: Optional[Candidate]
    candidates: list[Candidate]
    references: dict[tuple[int, str], StepMeasurement]
    min_gpus: Optional[int] = None
    calibrated: bool = False  # ranked by the calibrated step-time model

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "gpu": self.gpu.name, "headroom": HEADROOM,
                "step_model": "calibrated" if self.calibrated else "fixed efficiency",
                "efficiency": None if self.calibrated else EFFICIENCY, "compile": "not simulated",
                "chosen": self.chosen.as_dict() if self.chosen else None,
                "candidates": [c.as_dict() for c in self.candidates if c is not self.chosen],
                "simulations": {f"tp{tp}_{ac}": m.as_dict() for (tp, ac), m in self.references.items()},
                "smallest_fitting_gpus": self.min_gpus}


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt(n)) steps (``--gpus 2**31``: 46,341)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_degrees(cfg: Any, world: int, gpus_per_node: int) -> tuple[list[int], dict[int, str]]:
    """Tensor-parallel degrees that divide both the node and the world and that the model
    allows; the refused ones with the reason (from the family's ``check_tp``)."""
    spec = get_spec(cfg.model.name)
    model = meta_model(cfg)
    ok, refused = [], {}
    for tp in _divisors(math.gcd(world, gpus_per_node)):
        check = spec.get("check_tp") if tp > 1 else None
        try:
            if tp > 1 and spec.tp_plan is None:
                raise ConfigError(f"model '{cfg.model.name}' has no tensor-parallel plan")
            if check is not None:
                check(model, tp)
        except ConfigError as exc:
            refused[tp] = str(exc)
            continue
        ok.append(tp)
    return ok, refused


def enumerate_layouts(cfg: Any, world: int, gpus_per_node: int,
                      experts: Optional[ExpertShape] = None,
                      search_cp: bool = False) -> tuple[list[Layout], list[Candidate]]:
    """Every layout of ``world`` GPUs (with ``experts``: every ``ep`` too; pipeline degrees
    ``pp`` that the model's blocks, the schedule and the micro-batches allow, none with tied
    embeddings; with ``search_cp``, every ``cp`` of :func:`llmforge.planning.context.cp_degrees`
    without pipeline stages), and the dropped ones (status ``does not divide``).

    Raises:
        ConfigError: no tensor-parallel degree divides the model and the node (names the key
            and the nearest world sizes that work).
    """
    gbs = int(cfg.trainer.global_batch_size)
    tps, refused = tp_degrees(cfg, world, gpus_per_node)
    model = meta_model(cfg)
    n_blocks = len(get_spec(cfg.model.name).model_blocks(model))
    tied = bool(getattr(getattr(model, "args", None), "tie_embeddings", False))
    seq, mode = int(cfg.trainer.seq_len), cp_of(cfg)[1]
    heads = int(getattr(getattr(model, "args", None), "n_heads", 1))
    out, dropped = [], []
    for tp, pp in ((tp, pp) for tp in tps for pp in (_divisors(world // tp) if not tied else [1])):
        for cp in cp_degrees(seq, world // tp, heads // tp, mode) if search_cp and pp == 1 else [1]:
            dp = world // (tp * pp * cp)
            if gbs % dp:
                if pp == 1 and cp == 1:
                    dropped.append(Candidate(Layout(1, dp, tp, "none", 1), "does not divide",
                                             f"trainer.global_batch_size={gbs} is not a multiple of dp={dp}"
                                             f"{' without pipeline stages' if n_blocks > 1 and not tied else ''}"))
                continue
            mbs_ok = [mbs for mbs in _divisors(gbs // dp)
                      if pp == 1 or pp_allowed(cfg, pp, n_blocks, gbs // dp, mbs, world) is None]
            for rep in _divisors(dp):
                for ep in ep_degrees(experts, dp // rep):
                    for ac in AC_MODES:
                        for mbs in mbs_ok:
                            out.append(Layout(rep, dp // rep, tp, ac, mbs, pp=pp, ep=ep, cp=cp))
    for tp, why in refused.items():
        dropped.append(Candidate(Layout(1, world // tp if world % tp == 0 else 1, tp, "none", 1),
                                 "does not divide", why))
    if not out:
        near = [n for n in range(max(1, world - 64), world + 65) if n != world
                and any(gbs % (n // tp) == 0 for tp in _divisors(math.gcd(n, gpus_per_node)) if tp in tps or tp == 1)]
        nearest = sorted(near, key=lambda n: abs(n - world))[:2]
        why = "".join(f"; tp={tp} refused: {r}" for tp, r in refused.items())
        hint = (f"nearest GPU counts that do: {', '.join(map(str, sorted(nearest)))}" if nearest else
                f"no GPU count within 64 of {world} does: raise trainer.global_batch_size to a "
                f"multiple of the data-parallel size (e.g. {world})")
        raise ConfigError(f"--gpus {world}: no layout divides trainer.global_batch_size={gbs} "
                          f"(tp within a node of {gpus_per_node}: {tps or 'none allowed'}{why}); {hint}")
    return out, dropped


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


def _score(cand: Candidate, peak: float, step: float, cfg: Any, world: int, gpu: GPUKind,
           flops_per_token: float, base: Optional[Setting] = None) -> None:
    tokens = int(cfg.trainer.global_batch_size) * int(cfg.trainer.seq_len)
    if base is not None:
        lo = cand.layout
        pr = predict(at_layout(base, lo.dp_replicate, lo.dp_shard, lo.tp, lo.pp, lo.cp,
                               lo.activation_checkpointing, lo.micro_batch_size), FITTED)
        step, cand.terms, cand.traffic = pr.step_seconds, pr.terms, pr.overlapped
    cand.peak_bytes, cand.step_seconds = peak, step
    cand.tokens_per_second_per_gpu = tokens / step / world
    cand.mfu = flops_per_token * cand.tokens_per_second_per_gpu / gpu.bf16_flops


def plan(cfg: Any, world: int, gpu: GPUKind, *, simulate_fn: Any = simulate_scaled,
         progress: Optional[Any] = None) -> Plan:
    """Plan ``cfg`` on ``world`` GPUs of kind ``gpu`` (module docstring). ``progress(done, total,
    what)`` is called before each ``(tp, activation checkpointing)`` group is simulated and once
    at the end (``done == total``).

    Raises:
        ConfigError: no layout divides the batch or the model (see :func:`enumerate_layouts`),
            or every layout refused by the config's own checks (the first refusal), or
            ``world`` outside 1..MAX_GPUS.
    """
    check_gpus(world, "the world size")
    experts = ExpertShape.of(cfg)
    base = None if experts is not None else calibrated_setting(cfg, world, gpu)
    # context parallelism: dense decoders that the calibrated model covers (module docstring, 6)
    layouts, dropped = enumerate_layouts(cfg, world, gpu.gpus_per_node, experts, search_cp=base is not None)
    width = 4 if cfg.trainer.precision == "fp32" else 2
    model = meta_model(cfg)
    moe = {"experts": experts, "seq_len": int(cfg.trainer.seq_len), "width": width,
           "stages": StageShape.of(cfg, model)}
    gbs = int(cfg.trainer.global_batch_size)
    budget = gpu.memory_bytes * (1 - HEADROOM)
    spec = get_spec(cfg.model.name)
    flops_per_token = float(spec.flops(model, int(cfg.trainer.seq_len)))
    refs: dict[tuple[int, str], StepMeasurement] = {}
    skipped: dict[tuple[int, str], Candidate] = {}  # groups not simulated, with the reason
    groups = sorted({lo.tp for lo in layouts})
    for g, tp in enumerate(groups):
        # the reference: no pipeline stages where the batch divides, else the fewest that do
        pp = min((lo.pp for lo in layouts if lo.tp == tp and lo.cp == 1), default=1)
        mbs = min(lo.micro_batch_size for lo in layouts if lo.tp == tp and lo.pp == pp)

        def reference(ac: str) -> Layout:
            return Layout(1, world // tp // pp, tp, ac, mbs, pp=pp)

        for i, ac in enumerate(AC_MODES):
            if i and (tp, AC_MODES[i - 1]) in refs and refs[tp, AC_MODES[i - 1]].peak_bytes <= budget:
                # a lighter mode already fits at this tp: more recomputation is only slower
                skipped[tp, ac] = Candidate(reference(ac), "slower",
                                            f"not simulated: activation_checkpointing "
                                            f"{AC_MODES[i - 1]} already fits at tp={tp} and recomputes less")
                continue
            if (tp, AC_MODES[max(0, i - 1)]) in skipped and i:
                skipped[tp, ac] = replace(skipped[tp, AC_MODES[i - 1]], layout=reference(ac))
                continue
            if progress is not None:
                progress(g * len(AC_MODES) + i, len(groups) * len(AC_MODES), f"tp={tp} activation_checkpointing={ac}")
            try:
                refs[tp, ac] = simulate_layout(simulate_fn, cfg, reference(ac), gbs)
            except ConfigError as exc:  # e.g. float8's FSDP all-gather without sharding
                skipped[tp, ac] = Candidate(reference(ac), "refused", str(exc))
            except NotImplementedError as exc:  # MemTracker (no FSDP2: tp = world) and accumulation
                skipped[tp, ac] = Candidate(reference(ac), "not measured",
                                            f"the memory tracker refuses this step: {exc}")
    if not refs and skipped:
        # nothing measured: a config error, not memory ("fits at no GPU count" would mislead)
        first = next(iter(skipped.values()))
        if first.status == "refused":
            raise ConfigError(first.reason)
    cands = []
    for lo in layouts:
        key = (lo.tp, lo.activation_checkpointing)
        if key not in refs:
            continue
        peak, step, _ = derive(refs[key], twin(lo), gbs, gpu, **moe)
        peak += peak_delta(refs[key], lo, base.shape, moe["seq_len"], base.cp_mode, width) if lo.cp > 1 else 0.0
        cand = Candidate(lo)
        _score(cand, peak, step, cfg, world, gpu, flops_per_token, base)
        if peak > budget:
            cand.status, cand.reason = "does not fit", (f"peak {peak / 2**30:.1f} GiB > "
                                                        f"{budget / 2**30:.1f} GiB usable")
        cands.append(cand)
    dropped += list(skipped.values())
    if progress is not None:
        n = len(groups) * len(AC_MODES)
        progress(n, n, "ranking")
    fitting = sorted((c for c in cands if c.status == "fits"), key=lambda c: (c.step_seconds, c.traffic))
    chosen = None
    for cand in fitting[:MAX_CONFIRM]:  # the winner's own simulation, not a derived one
        ref = refs[cand.layout.tp, cand.layout.activation_checkpointing]
        own = replace(twin(cand.layout), ep=1)  # ep > 1: derived from its ep=1 layout's simulation
        lo = cand.layout  # cp > 1: its cp=1 twin simulated (where the batch divides it), cp estimated
        exact = ref.layout == own or gbs % (own.dp_replicate * own.dp_shard) == 0
        m = ref if ref.layout == own or not exact else simulate_layout(simulate_fn, cfg, own, gbs)
        peak, step, _ = derive(m, twin(lo), gbs, gpu, exact=exact, **moe)
        if lo.cp > 1:
            peak += peak_delta(m, lo, base.shape, moe["seq_len"], base.cp_mode, width)
            cand.reason = ESTIMATED.format(cp=lo.cp, twin=own.dp_shard, mode=base.cp_mode)
        _score(cand, peak, step, cfg, world, gpu, flops_per_token, base)
        cand.simulated = lo.cp == 1
        if peak <= budget:
            chosen = cand
            break
        cand.status, cand.reason = "does not fit", (f"{'simulated' if lo.cp == 1 else 'estimated'} peak "
                                                    f"{peak / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB usable")
    if chosen is not None:
        chosen.status = "chosen"
        chosen.reason = "fastest layout that fits" + (f"; {chosen.reason}" if chosen.layout.cp > 1 else "")
        for c in cands:
            if c.status == "fits" and c is not chosen:
                c.status = "slower"
                c.reason = f"{c.step_seconds / chosen.step_seconds:.3f}x the winner's step time"
    ordered = sorted(cands, key=lambda c: (c.status != "chosen", c.status == "does not fit",
                                           c.step_seconds or 0.0, c.traffic))
    out = Plan(world, gpu, chosen, ordered + dropped, refs, calibrated=base is not None)
    if chosen is None:
        out.min_gpus = smallest_fitting(out, moe["seq_len"] if base is not None else 0)
    return out


def smallest_fitting(p: Plan, seq_len: int = 0) -> Optional[int]:
    """The smallest GPU count (whole nodes beyond one node) at which some measured
    ``(tp, activation checkpointing)`` group fits at ``micro_batch_size=1``, from the
    references of ``p``: only the sharded model state shrinks with more GPUs (``dp_shard``
    grows), the rest of the peak stays. Memory only: ``global_batch_size`` may have to grow to
    divide the larger data-parallel size. ``None``: nothing fits at any size (the unsharded
    rest alone exceeds the GPU). ``seq_len`` (configs whose plan searches ``cp``): where the
    rest does not fit, the smallest ``cp`` that slices it to fit
    (:func:`llmforge.planning.context.fitting_cp`; the attention mode's buffers left out)."""
    budget = p.gpu.memory_bytes * (1 - HEADROOM)
    best = None
    for (tp, _), m in p.references.items():
        rest = m.peak_bytes - m.sharded_state
        cp = fitting_cp(m, budget, seq_len) if rest >= budget and m.layout.pp == 1 else 1
        if cp is None or rest - per_token_bytes(m) * (1 - 1 / cp) >= budget:
            continue
        rest -= per_token_bytes(m) * (1 - 1 / cp)
        shard = max(1, math.ceil(m.sharded_state * m.layout.dp_shard / (budget - rest)))
        n = math.ceil(shard / cp) * cp * tp * m.layout.pp  # FSDP2 shards over dp_shard x cp
        if n > p.gpu.gpus_per_node:
            n = math.ceil(n / p.gpu.gpus_per_node) * p.gpu.gpus_per_node
        best = n if best is None else min(best, n)
    return best
