"""Scaling a simulated step by layer count: run :func:`llmforge.planning.simulate.simulate` with 2
and 3 blocks and extrapolate every measured quantity linearly to the real block count.

Blocks are identical, so parameters, gradients, optimizer state, saved activations, FLOPs and
collective bytes are affine in the block count. The peak is affine per phase (forward, loss,
backward, optimizer) as long as its moment within the phase does not move with depth; in the
backward it does move (from the last block to a middle one), so the backward's peak is
extrapolated per block position (:func:`_backward_peak`). docs/scale.md gives the measured error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from llmforge.models.spec import get_spec
from llmforge.parallel.pipeline import rank_stages
from llmforge.planning.measure import CATEGORIES, Collective
from llmforge.planning.layout import Layout
from llmforge.planning.simulate import StepMeasurement, frozen_heap, simulate
from llmforge.plugin import meta_model


def model_layers(cfg: Any) -> int:
    """Number of repeated blocks of the run's model (built on the meta device)."""
    return len(get_spec(cfg.model.name).model_blocks(meta_model(cfg)))


def _by_dim(colls: list[Collective]) -> dict[tuple[str, str], Collective]:
    """``colls`` summed per ``(kind, mesh_dim)``: two process groups over the same ranks (e.g. a
    sub-mesh sliced again under ``pp``) are one dim, and must not be extrapolated apart."""
    out: dict[tuple[str, str], Collective] = {}
    for c in colls:
        prev = out.get((c.kind, c.mesh_dim))
        out[c.kind, c.mesh_dim] = c if prev is None else replace(
            prev, count=prev.count + c.count, bytes=prev.bytes + c.bytes)
    return out


Peak = tuple  # (bytes, breakdown by CATEGORIES, sharded state bytes)


def _along(x: Peak, y: Peak, k: float, base: Optional[Peak] = None) -> Peak:
    """``base + k (y - x)`` per field (``base`` defaults to ``x``): a peak moved along a line."""
    z = x if base is None else base
    return (z[0] + k * (y[0] - x[0]), {key: z[1][key] + k * (y[1][key] - x[1][key]) for key in CATEGORIES},
            z[2] + k * (y[2] - x[2]))


def _backward_peak(a: StepMeasurement, b: StepMeasurement, k: float, phase: Peak) -> Peak:
    """The backward phase's peak at ``k`` blocks (per stage) beyond ``a``'s, from the block
    positions.

    Why not one line through the two phase peaks: while a middle block runs its backward, the
    blocks after it have passed theirs, so buffers that only exist then (FSDP2 keeps the last
    reduce-scatter's input, one block's unsharded gradients, until the next one) add to the
    saved activations of the blocks before it. The 2-block step has no middle block, so the
    phase's peak moves from the last block (2 blocks) to a middle one (3 blocks) and a line
    through them takes the move for a slope (Qwen3-30B-A3B on 16 ranks: +1.45 GiB per block
    where the state and activations add 0.35). So each position gets its line: the first and
    the last block through their 2- and 3-block peaks, and the phase's own line where the peak
    lies outside every block (the loss and output layer) in both steps. Only the 3-block step
    has a middle block; at block ``i`` of ``N`` its peak is a constant plus the state of ``N``
    blocks, the gradients of the ``N - 1 - i`` blocks after it and the saved activations of
    the ``i`` before it, so over the middle blocks it is highest at ``i = 1`` (it then grows
    with ``N`` as the first block's peak does) or at ``i = N - 2`` (as the last block's does):
    two lines through the 3-block middle peak. Where the shorter step has more than 2 blocks
    (a rank with several virtual pipeline stages: 4 and 6), the blocks at ``i = 1`` and
    ``i = N - 2`` exist in both steps and get their own lines. The deep model's peak is the
    highest line. ``phase`` (the one-line answer) stands when the tracker saw no block's
    backward.
    """
    xa, xb = a.block_backward, b.block_backward
    if len(xa) < 2 or len(xb) <= len(xa) or None in xa or None in xb:
        return phase
    lines = [_along(xa[0], xb[0], k), _along(xa[-1], xb[-1], k)]  # the first, the last block
    if len(xa) == 2:  # the middle block of the 3-block step, with the first's and last's slopes
        lines += [_along(xa[0], xb[0], k - 1, base=xb[1]), _along(xa[1], xb[2], k - 1, base=xb[1])]
    else:
        lines += [_along(xa[1], xb[1], k), _along(xa[-2], xb[-2], k)]
    if (a.phases["backward"][0] > max(p[0] for p in xa)
            and b.phases["backward"][0] > max(p[0] for p in xb)):
        lines.append(phase)
    return max(lines, key=lambda p: p[0])


@frozen_heap()
def simulate_scaled(cfg: Any, layout: Layout, *, full_depth: Optional[int] = None,
                    last_stage: bool = False) -> StepMeasurement:
    """:func:`simulate` with 2 and 3 blocks, every quantity extrapolated linearly to the real
    block count ``full_depth`` (default: the config's). Configs of at most 3 blocks are
    simulated whole. With ``pp > 1``: 2 and 3 blocks per pipeline stage (``pp x stages per
    rank`` stages), extrapolated to ``full_depth / stages`` blocks per stage (rank 0: the first
    stage, which also holds the embedding; with ``last_stage`` the last stage's first rank, which
    holds the output layer and the loss instead)."""
    n = full_depth if full_depth is not None else model_layers(cfg)
    stages = layout.pp * (rank_stages(cfg.pipeline.schedule, cfg.pipeline.stages_per_rank)
                          if layout.pp > 1 else 1)
    if n <= 3 * stages:
        m = simulate(cfg, layout, last_stage=last_stage)
        return replace(m, simulated_layers=(n,))
    a = simulate(cfg, layout, n_layers=2 * stages, last_stage=last_stage)
    b = simulate(cfg, layout, n_layers=3 * stages, last_stage=last_stage)
    k = n / stages - 2

    def lin(x: float, y: float) -> float:
        return x + k * (y - x)

    colls = _by_dim(a.collectives)
    scaled = []
    for c in _by_dim(b.collectives).values():
        c0 = colls.get((c.kind, c.mesh_dim), Collective(c.kind, c.mesh_dim, c.group_size))
        scaled.append(Collective(c.kind, c.mesh_dim, c.group_size, int(round(lin(c0.count, c.count))),
                                 lin(c0.bytes, c.bytes)))
    phases = {name: _along(peak, b.phases[name], k) for name, peak in a.phases.items()}
    phases["backward"] = _backward_peak(a, b, k, phases["backward"])
    total, breakdown, sharded = max(phases.values(), key=lambda p: p[0])
    return StepMeasurement(
        layout=layout, world_size=a.world_size, n_layers=n, peak_bytes=total, breakdown=breakdown,
        flops=lin(a.flops, b.flops), formula_flops=lin(a.formula_flops, b.formula_flops),
        collectives=scaled, seconds=a.seconds + b.seconds, simulated_layers=(2 * stages, 3 * stages),
        phases=phases, sharded_state=sharded, rank=a.rank)


__all__ = ["model_layers", "simulate_scaled"]
