"""Pipeline stages in ``llmforge plan``: which ``pp`` degrees a layout may take, how many
micro-batches the first stage holds at once, the point-to-point traffic between stages, and a
pipeline layout's simulation (both pipeline ranks, plus the micro-batches in flight).

The simulation of a ``pp`` layout (:func:`llmforge.planning.simulate.simulate`) runs a rank's
blocks micro-batch after micro-batch, one in flight at a time; a schedule keeps more: with
1F1B the first stage has started the forwards of up to ``pp`` micro-batches before their
backwards come back (Narayanan et al. 2021, §2.2.1), GPipe all ``m`` of them, the zero-bubble
V schedules up to ``2 pp`` on rank 0 (it holds the first and the last stage). Interleaved 1F1B
keeps ``pp`` micro-batches in flight on each of its ``v`` virtual stages, each ``1 / v`` of
the rank's blocks, so the same activations as 1F1B plus a warm-up of ``(pp - 1) / (pp v)``
more (ibid. §2.2.2): counted as ``pp (1 + (pp - 1) / (pp v))``, at most the ``m`` micro-batches
there are (torch's ``_get_warmup_ops`` caps the warm-up at ``m v`` chunk forwards).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from llmforge.errors import ConfigError
from llmforge.models.memory_estimate import StageShare
from llmforge.models.spec import get_spec
from llmforge.parallel.pipeline import bubble_fraction, rank_stages, resolve_layout, stage_params
from llmforge.parallel.transforms import pipeline_layout
from llmforge.planning.setting import Shape
from llmforge.planning.layout import Layout, last_stage_rank, pipeline_settings
from llmforge.planning.simulate import StepMeasurement
from llmforge.plugin import meta_model

__all__ = ["StageShape", "stage_imbalance", "forward_activations", "in_flight", "pp_allowed", "simulate_layout",
           "stage_share"]


def stage_share(cfg: Any, dims: Any, pp_rank: int) -> StageShare:
    """What pipeline rank ``pp_rank`` of the config's own layout holds, for the analytic
    estimate (:func:`llmforge.models.memory_estimate.analytic_peak`): the parameters and blocks
    of its stages, the end modules' parameters among them, and whether it has the loss."""
    model = meta_model(cfg)
    spec = get_spec(cfg.model.name)
    layout = pipeline_layout(cfg, dims, model)
    stages = layout.stages_of_rank(pp_rank)
    per_stage = stage_params(model, layout, spec.stage_ends, spec.model_blocks(model))
    first, last = spec.stage_ends
    ends = [*(first if 0 in stages else ()), *(last if layout.num_stages - 1 in stages else ())]
    end_params = sum(p.numel() for name in ends if getattr(model, name, None) is not None
                     for p in getattr(model, name).parameters())
    return StageShare(sum(per_stage[s] for s in stages), sum(len(layout.split[s]) for s in stages),
                      end_params, layout.num_stages - 1 in stages)


def pp_allowed(cfg: Any, pp: int, n_blocks: int, local_batch: int, mbs: int, world: int) -> Optional[str]:
    """``None`` when ``pp`` stages can run ``local_batch`` sequences per data-parallel rank in
    micro-batches of ``mbs`` (the config's schedule and split,
    :func:`~llmforge.planning.layout.pipeline_settings`),
    else why not (the pipeline checks' message)."""
    s = pipeline_settings(cfg, pp)
    try:
        resolve_layout(s["schedule"], pp, n_blocks, local_batch, s["microbatches"], s["stages_per_rank"],
                       s["split"], local_batch // mbs, world)
    except ConfigError as exc:
        return str(exc)
    return None


def in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Micro-batches whose activations the first stage's rank holds at once (module docstring);
    1 without stages."""
    if pp <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if schedule in ("zbv", "dualpipev"):
        return float(min(2 * pp, microbatches))
    if schedule == "interleaved_1f1b":
        # torch caps the warm-up at every micro-batch's chunks (schedules._get_warmup_ops)
        return min(pp * (1 + (pp - 1) / (pp * stages_per_rank)), float(microbatches))
    return float(min(pp, microbatches))


def forward_activations(m: StepMeasurement) -> float:
    """One micro-batch's activations at the end of its forward (bytes; 0 if not measured)."""
    phase = m.phases.get("forward")
    return float(phase[1].get("activations", 0.0)) if phase else 0.0


def simulate_layout(simulate_fn: Callable[..., StepMeasurement], cfg: Any, layout: Layout,
                    gbs: int) -> StepMeasurement:
    """``simulate_fn(cfg, layout)``; with ``pp > 1`` also the last stage's rank
    (``last_stage=True``), and the first stage's rank's peak raised by the activations of the
    micro-batches in flight beyond the simulated one (:func:`in_flight`). Returns the rank with
    the larger peak."""
    first = simulate_fn(cfg, layout)
    if layout.pp <= 1:
        return first
    s = pipeline_settings(cfg, layout.pp)
    m = s["microbatches"] or gbs // (layout.dp_replicate * layout.dp_shard) // layout.micro_batch_size
    v = rank_stages(s["schedule"], s["stages_per_rank"])
    extra = (in_flight(s["schedule"], layout.pp, m, v) - 1) * forward_activations(first)
    breakdown = dict(first.breakdown)
    breakdown["activations"] = breakdown.get("activations", 0.0) + extra
    first = replace(first, peak_bytes=first.peak_bytes + extra, breakdown=breakdown)
    if last_stage_rank(layout, s["schedule"]) == 0:
        return first
    last = simulate_fn(cfg, layout, last_stage=True)
    return first if first.peak_bytes >= last.peak_bytes else last


@dataclass(frozen=True)
class StageShape:
    """What the step-time model needs of a ``pp`` layout: the config's schedule, its virtual
    stages per rank and the width of the hidden states the stages send (``dim``)."""

    schedule: str
    stages_per_rank: int
    dim: int

    @staticmethod
    def of(cfg: Any, model: Any) -> "StageShape":
        s = cfg.pipeline
        return StageShape(s.schedule, rank_stages(s.schedule, s.stages_per_rank),
                          int(getattr(getattr(model, "args", None), "dim", 0)))

    def bubble(self, pp: int, microbatches: int) -> float:
        """The schedule's idle share of a step (:func:`~llmforge.parallel.pipeline.bubble_fraction`)."""
        return bubble_fraction(self.schedule, pp, microbatches, self.stages_per_rank) if pp > 1 else 0.0

    def in_flight(self, pp: int, microbatches: int) -> float:
        return in_flight(self.schedule, pp, microbatches, self.stages_per_rank)

    def p2p_bytes(self, micro_batch_size: int, seq_len: int, width: int) -> float:
        """Bytes of one send between stages: a micro-batch's hidden states ``[mbs, seq_len,
        dim]`` (forward) or their gradient (backward)."""
        return float(micro_batch_size * seq_len * self.dim * width)


def stage_imbalance(sh: Shape, pp: int, stages_per_rank: int = 1, seq_len: int = 0) -> float:
    """The most loaded pipeline rank's compute over the mean rank's (>= 1; 1 without stages).

    A stage holds whole blocks, and the last one also the output layer, ``w = V d / (P + s d)``
    blocks of FLOPs (``P`` a block's matmul parameters, ``s d`` its causal attention per token;
    :func:`flops_per_token`). The split is the most even one whole blocks allow (an explicit
    ``pipeline.split`` reaches it): the last rank ``k`` blocks and the output, the other
    ``pp - 1`` ranks the rest, ``min over k of max(k + w, ceil((L - k) / (pp - 1)))``, against
    the mean ``(L + w) / pp``; each of a rank's ``stages_per_rank`` stages holds a block at least.
    The schedule runs at the pace of its slowest rank (Narayanan et al. 2021, arXiv 2104.04473,
    section 2.2); Llama 3's 405B has 126 blocks so that its first and last stage hold one fewer
    (Dubey et al. 2024, section 3.3.2): 1.011 on 8 stages, where the 70B's 80 blocks give 1.085.

    Raises:
        ValueError: ``pp``, ``stages_per_rank`` not integers >= 1, ``seq_len`` below 0, more
            stages (``pp x stages_per_rank``) than blocks.
    """
    for name, value in (("pp", pp), ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"stage_imbalance: {name} must be an integer >= 1, got {value!r}")
    if not seq_len >= 0:
        raise ValueError(f"stage_imbalance: seq_len must be >= 0 tokens, got {seq_len!r}")
    if pp == 1:
        return 1.0
    w = sh.vocab_size * sh.dim / (sh.block_params + seq_len * sh.dim)
    v, blocks = stages_per_rank, sh.n_layers
    if pp * v > blocks:
        raise ValueError(f"{pp} x {v} pipeline stages for {blocks} blocks: a stage holds one at least")
    slowest = min(max(k + w, -(-(blocks - k) // (pp - 1))) for k in range(v, blocks - v * (pp - 1) + 1))
    return slowest / ((blocks + w) / pp)
