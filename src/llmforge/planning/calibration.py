"""Calibration of the step-time model (:mod:`llmforge.planning.step_model`) on the published
runs (:mod:`llmforge.planning.published`), and its error on runs held out of the fit.

* :func:`fit`: the :class:`~llmforge.planning.step_model.CostParams` that minimise the mean
  squared log error of tokens/s per GPU over the given rows, plus a weak pull towards the
  defaults (``PRIOR_WEIGHT``: what keeps a constant that no row informs, e.g. rowwise float8
  when its only source is held out, at its default). Nelder-Mead on each constant mapped
  to an open interval (``BOUNDS``); seconds on one CPU core.
* Held-out error: leave one **source** out (every row of a source comes from one cluster and
  one software version; holding out single rows would let the rest of its table leak in):
  for each source, fit on the others and predict its rows. :func:`held_out` recomputes these
  errors from the stored per-fold constants without fitting; :func:`comparison_errors` the
  errors of the ratios between held-out rows of one source and one model, what a comparison of
  two layouts is off by (:func:`comparison_error`, the planner's "within the model's error").

The stored constants (all rows: :data:`FITTED`; each fold's: :data:`FOLDS`) and the held-out
summary the fidelity benchmark printed (:data:`HELD_OUT`) live in
:mod:`llmforge.planning.fitted`, written by ``python benchmarks/planner_fidelity.py --refit``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence

from llmforge.planning.fitted import FITTED_VALUES, FOLD_VALUES, HELD_OUT
from llmforge.planning.published import RUNS, SOURCES, Run
from llmforge.planning.step_model import CostParams, predict

BOUNDS: dict[str, tuple[float, float]] = {
    "matmul_efficiency": (0.2, 0.9), "narrow_width": (1.0, 4096.0),
    "attention_efficiency": (0.1, 1.5), "compile_speedup": (0.9, 1.6),
    "fp8_tensorwise_speedup": (0.8, 2.0), "fp8_rowwise_speedup": (0.6, 2.0),
    "power_limited_clock": (0.6, 1.0), "nvlink_latency": (1e-6, 500e-6),
    "network_latency": (1e-6, 2e-3), "nvlink_efficiency": (0.2, 1.0),
    "network_efficiency": (0.1, 1.0), "fsdp_overlap": (0.0, 1.0), "tp_exposed": (0.05, 2.0),
    "async_tp_exposed": (0.0, 1.0), "elementwise_passes": (0.0, 200.0), "compile_fusion": (0.05, 1.0),
    "nvlink_contention": (0.0, 1.0), "narrow_power": (0.3, 4.0)}
"""Open interval of each constant: physical limits (a share of a peak below 1, an overlap
between 0 and 1), generous elsewhere. Each default lies inside its interval: the fit maps a
constant through a logistic, which cannot leave a value started on its bound (``tp_exposed``,
whose prior 1 was its bound until its interval reached 2: TP traffic costing more than its bytes)."""

PRIOR_WEIGHT = 0.002
"""Weight of the pull towards :class:`CostParams`' defaults, per constant, in the objective's
units (mean squared log error); small: a row moves a constant, its absence leaves it alone."""

FITTED = CostParams(**FITTED_VALUES)
"""The constants fitted on every published row: what the planner uses."""

FOLDS = {src: CostParams(**v) for src, v in FOLD_VALUES.items()}
"""Per held-out source: the constants fitted without it."""


def _to_unit(name: str, value: float) -> float:
    lo, hi = BOUNDS[name]
    x = min(max((value - lo) / (hi - lo), 1e-6), 1 - 1e-6)
    return math.log(x / (1 - x))


def _from_unit(name: str, u: float) -> float:
    lo, hi = BOUNDS[name]
    return lo + (hi - lo) / (1 + math.exp(-u))


def log_error(rows: Sequence[Run], p: CostParams) -> float:
    """Mean squared ``log(predicted / measured)`` of tokens/s per GPU over ``rows``."""
    return statistics.fmean(
        math.log(predict(r.setting, p).tokens_per_second_per_gpu / r.tokens_per_second_per_gpu) ** 2
        for r in rows)


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], *, steps: int = 4000,
                scale: float = 0.5, tol: float = 1e-10) -> list[float]:
    """Minimise ``f`` from ``x0`` (Nelder and Mead 1965, standard coefficients 1, 2, 0.5, 0.5)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (scale if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(steps):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        refl = toward(-1.0)
        fr = f(refl)
        if fr < values[0]:
            exp = toward(-2.0)
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = toward(0.5)
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs)] for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(rows: Sequence[Run], start: Optional[CostParams] = None, restarts: int = 3) -> CostParams:
    """The constants that fit ``rows`` (module docstring); ``restarts`` Nelder-Mead runs, each
    from the last one's end."""
    names = [f.name for f in fields(CostParams)]
    prior = [_to_unit(n, getattr(CostParams(), n)) for n in names]

    def objective(u: list[float]) -> float:
        p = CostParams(**{n: _from_unit(n, x) for n, x in zip(names, u)})
        pull = sum((x - x0) ** 2 for x, x0 in zip(u, prior))
        return log_error(rows, p) + PRIOR_WEIGHT * pull

    u = [_to_unit(n, getattr(start or CostParams(), n)) for n in names]
    for _ in range(restarts):
        u = nelder_mead(objective, u)
    return CostParams(**{n: _from_unit(n, x) for n, x in zip(names, u)})


@dataclass(frozen=True)
class RowError:
    run: Run
    predicted: float
    error: float  # predicted / measured - 1


def held_out(folds: Optional[dict[str, CostParams]] = None) -> list[RowError]:
    """Each published row predicted with the constants fitted without its source."""
    folds = FOLDS if folds is None else folds
    out = []
    for r in RUNS:
        pred = predict(r.setting, folds[r.source]).tokens_per_second_per_gpu
        out.append(RowError(r, pred, pred / r.tokens_per_second_per_gpu - 1))
    return out


def summary(errors: Sequence[RowError]) -> dict[str, float]:
    """``median`` and ``max`` absolute relative error over ``errors`` and their number ``n``."""
    a = sorted(abs(e.error) for e in errors)
    return {"median": statistics.median(a), "max": a[-1], "n": len(a)}


def comparison_errors(errors: Sequence[RowError]) -> list[float]:
    """The error of each predicted ratio of two held-out rows of one source and one model,
    ``|(1 + e_a) / (1 + e_b) - 1|``: what a comparison of two layouts or recipes of one model on
    one cluster is off by, the claim the planner makes when it names a winner. A bias the two
    rows share (the cluster, the software) cancels in the ratio; the rest adds up, so it can
    be larger or smaller than one row's error."""
    out = []
    for i, a in enumerate(errors):
        for b in errors[i + 1:]:
            if (a.run.source, a.run.setting.shape) == (b.run.source, b.run.setting.shape):
                out.append(abs((1 + a.error) / (1 + b.error) - 1))
    return out


def comparison_summary(errors: Sequence[RowError]) -> dict[str, float]:
    """``comparison``: the median of :func:`comparison_errors` over ``errors``, and their number
    ``pairs`` (what :data:`HELD_OUT` stores beside :func:`summary`)."""
    pairs = comparison_errors(errors)
    return {"comparison": statistics.median(pairs), "pairs": len(pairs)}


def fit_folds() -> dict[str, CostParams]:
    """Leave-one-source-out: per source, the constants fitted on every other source's rows."""
    return {src: fit([r for r in RUNS if r.source != src]) for src in SOURCES}


def model_error() -> float:
    """The held-out median relative error of one prediction (tokens/s per GPU), stated with a
    predicted step."""
    return float(HELD_OUT["median"])


def comparison_error() -> float:
    """The held-out median error of a predicted ratio of two runs of one model on one cluster
    (:func:`comparison_errors`): below it, a comparison of two layouts is "within the model's
    error" and names no winner."""
    return float(HELD_OUT["comparison"])


__all__ = ["BOUNDS", "FITTED", "FOLDS", "HELD_OUT", "RowError", "comparison_error", "comparison_errors",
           "comparison_summary", "fit", "fit_folds", "held_out", "log_error", "model_error", "nelder_mead", "summary"]
