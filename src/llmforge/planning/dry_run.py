"""``llmforge train CONFIG --dry-run [--simulate]``: the dry run's text.

Without ``--simulate``: the analytic report (:func:`llmforge.planning.dry_run_report.dry_run_report`,
formulas on a meta-device model) and the model pipeline's order. With it, one training step of
rank 0 at the run's own layout and world size is simulated
(:func:`llmforge.planning.depth.simulate_scaled`: fake process group, fake tensors, 2 and 3
blocks scaled to the model's depth) and reported beside the analytic estimate; with pipeline
stages, the first rank of the last stage too.
"""

from __future__ import annotations

from typing import Any, Optional

from llmforge.models.memory_estimate import GIB, analytic_peak
from llmforge.planning.depth import simulate_scaled
from llmforge.planning.layout import KEEP_AC, Layout, last_stage_rank
from llmforge.planning.simulate import StepMeasurement
from llmforge.planning.stages import stage_share
from llmforge.planning.dry_run_report import dry_run_report
from llmforge.training.preflight import pipeline_line


def dry_run_text(trainer: Any, run: Any, device_memory_gib: Optional[float] = None,
                 simulate: bool = False) -> str:
    """The dry run's report for a built ``trainer`` of the resolved ``run``; with ``simulate``
    the simulation's lines (:func:`simulation_lines`) follow."""
    text = [dry_run_report(run, trainer.algorithms, device_memory_gib=device_memory_gib),
            pipeline_line(trainer)]
    if simulate:
        text += simulation_lines(trainer.cfg, run, trainer.algorithms)
    return "\n".join(text)


def run_layout(run: Any) -> Layout:
    """The resolved run's own layout, its activation checkpointing entry kept as configured."""
    d = run.dims
    # strategy.cp > 1: the simulation runs the runtime's context-parallel step
    return Layout(d.dp_replicate, d.dp_shard, d.tp, KEEP_AC, run.plan.micro_batch_size,
                  pp=d.pp, ep=d.ep, cp=int(getattr(d, "cp", 1)))


def simulation_lines(cfg: Any, run: Any, algorithms: list[Any]) -> list[str]:
    """Simulate rank 0 of ``run`` and describe it: the peak and its split, the analytic estimate
    beside it, the collectives per mesh dim and the FLOPs against the spec's formula. With
    pipeline stages the last stage's first rank (the output layer and the loss) too."""
    layout = run_layout(run)
    m = simulate_scaled(cfg, layout)
    own = any(getattr(a, "replaces_memory_estimate", False) for a in algorithms)
    last = last_stage_rank(layout, cfg.pipeline.schedule)

    def analytic(pp_rank: int) -> Optional[dict[str, float]]:  # each pipeline rank its own share
        if own:
            return None
        stage = stage_share(cfg, run.dims, pp_rank) if layout.pp > 1 else None
        return analytic_peak(cfg, run.plan, run.dims, stage)

    lines = format_simulation(m, analytic(0),
                              "the first and the last stage" if layout.pp > 1 and last == 0 else "the first stage")
    if last != 0:
        lines += format_simulation(simulate_scaled(cfg, layout, last_stage=True),
                                   analytic(last // (layout.world_size // layout.pp)), "the last stage")
    return lines


def format_simulation(m: StepMeasurement, analytic: Optional[dict[str, float]],
                      holds: str = "the first stage") -> list[str]:
    """The lines of one measurement; ``analytic``: :func:`analytic_peak` of the simulated rank
    (``None``: a plugin gives its own estimate above); ``holds``: the pipeline stages of the
    simulated rank, in words."""
    depth = (f"simulated {' and '.join(map(str, m.simulated_layers))} blocks, scaled to {m.n_layers}"
             if len(m.simulated_layers) > 1 else f"all {m.n_layers} blocks simulated")
    if m.layout.pp > 1:
        depth += f"; pp {m.layout.pp}: rank {m.rank} holds {holds}"
    b = m.breakdown
    lines = [f"simulation      rank {m.rank} of {m.world_size}: one training step on a fake process group "
             f"with fake tensors ({depth}; torch.compile not simulated; {m.seconds:.1f} s)",
             f"peak/rank       {m.peak_bytes / GIB:.2f} GiB = " + " + ".join(
                 f"{k} {b[k] / GIB:.2f}" for k in b) + " (measured by torch's memory tracker at the peak)"]
    if analytic is not None:
        err = (analytic["total"] - m.peak_bytes) / m.peak_bytes if m.peak_bytes else 0.0
        lines.append(f"analytic        {analytic['total'] / GIB:.2f} GiB = " + " + ".join(
            f"{k} {v / GIB:.2f}" for k, v in analytic.items() if k != "total")
            + f" ({err:+.1%} against the simulation)")
    for c in m.collectives:
        lines.append(f"collective      {c.kind} over {c.mesh_dim} ({c.group_size} ranks): {c.count} "
                     f"calls, {c.bytes / GIB:.3f} GiB per step")
    if m.formula_flops:
        lines.append(f"flops/rank      {m.flops:.4g} per step measured (FlopCounterMode, recompute "
                     f"included) = {m.flops / m.formula_flops:.3f} x the spec's formula {m.formula_flops:.4g}")
    return lines


__all__ = ["dry_run_text", "format_simulation", "run_layout", "simulation_lines"]
