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
   not divide the global batch, the fewest stages that make it divide, both pipeline ranks);
   a heavier checkpointing mode only where it can beat the lighter one (a layout the lighter
   does not fit, timed faster than the lighter one's fastest that fits).
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
   calibrated model (:func:`llmforge.planning.step_model.context_parallel_seconds`). A ``cp``
   winner is confirmed by simulating its own layout (the runtime's context-parallel step on the
   fake process group); its label gives the twin's estimate beside the simulated peak.

Where each step lives: enumeration (step 1) in :mod:`llmforge.planning.search`, the
derivation from a reference simulation (steps 2, 4, 5) in :mod:`llmforge.planning.derive`,
the ranking and the confirmation (step 3) here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from llmforge.config.validate import check_parallel_keys
from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.planning.gpus import GPUKind
from llmforge.planning.depth import simulate_scaled
from llmforge.planning.derive import EFFICIENCY, P2P_LATENCY, derive
from llmforge.planning.experts import ExpertShape
from llmforge.planning.calibration import FITTED
from llmforge.planning.context import ESTIMATED, SIMULATED, fitting_cp, peak_delta, per_token_bytes, twin
from llmforge.planning.layout import AC_MODES, Layout
from llmforge.planning.layout_arg import at_layout, built_algorithms, calibrated_setting, check_float8
from llmforge.planning.setting import Setting
from llmforge.planning.search import (MAX_GPUS, Candidate, _divisors, check_gpus, enumerate_layouts,
                                      tp_degrees)
from llmforge.planning.simulate import StepMeasurement, frozen_heap
from llmforge.planning.stages import StageShape, simulate_layout
from llmforge.planning.step_model import Prediction, predict
from llmforge.plugin import meta_model

__all__ = ["EFFICIENCY", "HEADROOM", "MAX_CONFIRM", "MAX_GPUS", "P2P_LATENCY", "Candidate", "Plan",
           "_divisors", "check_gpus", "derive", "enumerate_layouts", "plan", "smallest_fitting",
           "tp_degrees"]

HEADROOM = 0.10
"""Share of GPU memory kept free: the CUDA context, NCCL buffers and the caching allocator's
fragmentation, none of which the simulation sees."""

MAX_CONFIRM = 3
"""Layouts simulated with their own degrees after the ranking, best first, until one fits."""


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


def _timed(base: Setting, lo: Layout, ac: Optional[str] = None) -> Prediction:
    """The calibrated model's step of layout ``lo`` (with activation checkpointing ``ac``, default
    its own) in the recipe ``base``."""
    return predict(at_layout(base, lo.dp_replicate, lo.dp_shard, lo.tp, lo.pp, lo.cp,
                             ac or lo.activation_checkpointing, lo.micro_batch_size), FITTED)


def _score(cand: Candidate, peak: float, step: float, cfg: Any, world: int, gpu: GPUKind,
           flops_per_token: float, base: Optional[Setting] = None) -> None:
    tokens = int(cfg.trainer.global_batch_size) * int(cfg.trainer.seq_len)
    if base is not None:
        pr = _timed(base, cand.layout)
        step, cand.terms, cand.traffic = pr.step_seconds, pr.terms, pr.overlapped
    cand.peak_bytes, cand.step_seconds = peak, step
    cand.tokens_per_second_per_gpu = tokens / step / world
    cand.mfu = flops_per_token * cand.tokens_per_second_per_gpu / gpu.bf16_flops


@frozen_heap()  # the simulations' garbage passes walk their own objects only
def plan(cfg: Any, world: int, gpu: GPUKind, *, simulate_fn: Any = simulate_scaled,
         progress: Optional[Any] = None) -> Plan:
    """Plan ``cfg`` on ``world`` GPUs of kind ``gpu`` (module docstring). ``progress(done, total,
    what)`` is called before each ``(tp, activation checkpointing)`` group is simulated and once
    at the end (``done == total``).

    Raises:
        ConfigError: no layout divides the batch or the model (see :func:`enumerate_layouts`),
            or every layout refused by the config's own checks (the first refusal), or
            ``world`` outside 1..MAX_GPUS, float8 on a GPU kind without it, an unknown
            pipeline schedule or split or attention mode
            (:func:`~llmforge.config.validate.check_parallel_keys`), an ``algorithms:`` entry its
            class refuses.
    """
    check_gpus(world, "the world size")
    # a bad pipeline, attention or algorithm key is refused before minutes of search
    check_parallel_keys(cfg)
    algos = built_algorithms(cfg)
    check_float8(algos, gpu)
    experts = ExpertShape.of(cfg)
    base = None if experts is not None else calibrated_setting(cfg, world, gpu, algos)
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

    def derived(ref: StepMeasurement, lo: Layout) -> tuple[float, float]:
        # peak and step of ``lo`` from its group's measurement (cp > 1: its cp=1 twin's plus cp's terms)
        peak, step, _ = derive(ref, twin(lo), gbs, gpu, **moe)
        if lo.cp > 1:
            peak += peak_delta(ref, lo, base.shape, moe["seq_len"], base.cp_mode, width)
        return peak, step

    refs: dict[tuple[int, str], StepMeasurement] = {}
    skipped: dict[tuple[int, str], Candidate] = {}  # groups not simulated, with the reason
    groups = sorted({lo.tp for lo in layouts})
    for g, tp in enumerate(groups):
        # the reference: no pipeline stages where the batch divides, else the fewest that do
        pp = min((lo.pp for lo in layouts if lo.tp == tp and lo.cp == 1), default=1)
        mbs = min(lo.micro_batch_size for lo in layouts if lo.tp == tp and lo.pp == pp)

        def reference(ac: str) -> Layout:
            return Layout(1, world // tp // pp, tp, ac, mbs, pp=pp)

        def worth(lighter: str, ac: str) -> bool:
            # ``ac`` recomputes more than ``lighter``, so it is slower on any layout both fit: it
            # can win only on a layout ``lighter`` does not fit (a larger micro-batch, fewer
            # stages), and, timed by the calibrated model, only if faster there than the
            # fastest layout ``lighter`` fits
            fit, over = [], []
            for lo in (lo for lo in layouts if lo.tp == tp and lo.activation_checkpointing == lighter):
                (fit if derived(refs[tp, lighter], lo)[0] <= budget else over).append(lo)
            if not over or base is None:
                return bool(over)
            fastest = min((_timed(base, lo).step_seconds for lo in fit), default=float("inf"))
            return any(_timed(base, lo, ac).step_seconds < fastest for lo in over)

        for i, ac in enumerate(AC_MODES):
            lighter = AC_MODES[i - 1] if i else None
            if lighter and (tp, lighter) in refs and not worth(lighter, ac):
                skipped[tp, ac] = Candidate(reference(ac), "slower",
                                            f"not simulated: more recomputation than {lighter} could only speed "
                                            f"up layouts that {lighter} does not fit at tp={tp}, and none of them "
                                            f"would beat {lighter}'s fastest")
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
        peak, step = derived(refs[key], lo)
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
        lo = cand.layout  # cp > 1: its own layout simulated, the runtime's cp step included
        own = replace(lo, ep=1)  # ep > 1: derived from its ep=1 layout's simulation
        exact = ref.layout == own or gbs % (own.dp_replicate * own.dp_shard) == 0
        m = ref if ref.layout == own or not exact else simulate_layout(simulate_fn, cfg, own, gbs)
        estimate = cand.peak_bytes  # the ranking's: for cp, the twin's plus the cp terms
        peak, step, _ = derive(m, lo, gbs, gpu, exact=exact, **moe)
        if lo.cp > 1:
            if not exact:  # the batch does not divide the cp layout's data ranks: estimated
                peak = estimate
            cand.reason = (SIMULATED if exact else ESTIMATED).format(
                cp=lo.cp, twin=lo.dp_shard * lo.cp, mode=base.cp_mode, estimate=estimate / 2**30)
        _score(cand, peak, step, cfg, world, gpu, flops_per_token, base)
        cand.simulated = exact or lo.cp == 1
        if peak <= budget:
            chosen = cand
            break
        cand.status, cand.reason = "does not fit", (f"{'simulated' if cand.simulated else 'estimated'} peak "
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
