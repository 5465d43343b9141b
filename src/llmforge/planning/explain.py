"""Why ``llmforge plan`` chose its winner: the winner, the runner-up, the config's own layout
(:func:`config_candidate`) and the published recipe for the model and GPU count (when one is
known), each with its memory and time and the step term that decides between them; "within
the model's error" where the predicted difference is below the calibrated model's held-out
error of a comparison (:func:`llmforge.planning.calibration.comparison_error`), and whether any
published run of a model of that size used the winner's degrees
(:func:`~llmforge.planning.published.unmeasured_degrees`).
And the progress of a plan as it simulates (:class:`Progress`).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

from llmforge.errors import ConfigError
from llmforge.models.memory_estimate import ac_mode
from llmforge.parallel.mesh import ParallelDims
from llmforge.parallel.pipeline import min_microbatches
from llmforge.planning.calibration import comparison_error
from llmforge.planning.layout_arg import at_layout, calibrated_setting
from llmforge.planning.published import published_layout, unmeasured_degrees
from llmforge.planning.whatif import assess, deciding_term

GIB = 1024**3


def _layout(lo: Any) -> str:
    parts = [f"dp_shard {lo.dp_shard}"] + [f"{k} {getattr(lo, k)}" for k in ("dp_replicate", "tp", "pp", "cp")
                                           if getattr(lo, k, 1) > 1]
    return " x ".join(parts) + f", AC {lo.activation_checkpointing}, mbs {lo.micro_batch_size}"


def _decides(a: Optional[dict], b: Optional[dict], within: bool = False) -> str:
    """What decides for ``a`` (the winner's terms) against ``b``: the term it saves most seconds
    on; ``within`` the model's error, the term where they differ most either way."""
    if not a or not b:
        return ""
    k = deciding_term(a, b, within)
    if a[k] == b.get(k, 0.0):
        return ""
    how = "they differ most in" if within else "decided by"
    return f"; {how} {k} ({a[k]:.3g} s against {b.get(k, 0.0):.3g} s per step)"


def _compare(name: str, tps: float, peak: float, terms: Optional[dict], win: Any, error: float) -> str:
    gap = win.tokens_per_second_per_gpu / tps - 1
    within = abs(gap) <= error
    verdict = (f"within the model's error of a comparison ({error:.1%}): no winner between them" if within
               else f"winner {gap:+.0%} tokens/s per GPU")
    more = round((win.peak_bytes - peak) / GIB, 1) + 0.0  # no "-0.0"
    return (f"{name}: {tps:.0f} tokens/s per GPU, {peak / GIB:.1f} GiB ({more:+.1f} "
            f"GiB for the winner); {verdict}{_decides(win.terms, terms, within)}")


def config_candidate(p: Any, cfg: Any) -> Optional[Any]:
    """The candidate of plan ``p`` at ``cfg``'s own layout (the hand layout: its ``strategy``
    degrees on the plan's GPU count, its activation checkpointing and micro-batch), or ``None``
    where the config names none (``strategy.name`` auto or single) or the plan has no such
    candidate (degrees that do not make the GPU count, per-layer checkpointing)."""
    if cfg.strategy.name not in ("fsdp2", "ddp"):
        return None
    try:
        d = ParallelDims.from_config(cfg, p.world_size)
    except ConfigError:
        return None
    want = (d.dp_replicate, d.dp_shard, d.tp, d.pp, d.ep, d.cp, ac_mode(cfg.algorithms)[0])
    mbs = int(cfg.trainer.micro_batch_size)
    return next((c for c in p.candidates if _degrees(c.layout) == want and c.layout.micro_batch_size == mbs),
                None)


def _degrees(lo: Any) -> tuple:
    """A layout's degrees and activation checkpointing (its micro-batch aside)."""
    return lo.dp_replicate, lo.dp_shard, lo.tp, lo.pp, lo.ep, lo.cp, lo.activation_checkpointing


def explain(p: Any, cfg: Any) -> list[str]:
    """Lines on the winner of plan ``p`` of ``cfg``, its runner-up and the published recipe."""
    win = p.chosen
    if win is None:
        return []
    error = comparison_error()
    limit = max(win.terms, key=win.terms.get) if win.terms else "compute"
    lines = [f"winner: {_layout(win.layout)}: {win.tokens_per_second_per_gpu:.0f} tokens/s per GPU, "
             f"{win.peak_bytes / GIB:.1f} GiB, limited by {limit}"]
    base = calibrated_setting(cfg, p.world_size, p.gpu) if p.calibrated else None
    unmeasured = base and unmeasured_degrees(base.shape, win.layout.tp, win.layout.pp, win.layout.cp,
                                              win.layout.dp_replicate)
    if unmeasured:
        lines.append(f"winner's degrees: {unmeasured}")
    # the best other layout (a micro-batch size alone is no alternative worth a line)
    # (a candidate not timed, e.g. one process with nothing to communicate, is no runner-up)
    runner = next((c for c in p.candidates if c.status == "slower" and _degrees(c.layout) != _degrees(win.layout)
                   and c.tokens_per_second_per_gpu and c.peak_bytes is not None), None)
    own = config_candidate(p, cfg)
    if runner is not None:
        mine = ", this config's layout" if own is runner else ""
        lines.append(_compare(f"runner-up{mine}: {_layout(runner.layout)}", runner.tokens_per_second_per_gpu,
                              runner.peak_bytes, runner.terms, win, error))
    if own is win:
        lines.append("this config's layout: the winner")
    elif own is not None and own is not runner:
        name = f"this config's layout: {_layout(own.layout)}"
        if own.tokens_per_second_per_gpu and own.peak_bytes is not None:
            fits = "" if own.status != "does not fit" else "; it does not fit"
            lines.append(_compare(name, own.tokens_per_second_per_gpu, own.peak_bytes, own.terms, win, error) + fits)
        else:
            lines.append(f"{name}: {own.status}{': ' + own.reason if own.reason else ''}")
    pub = published_layout(base.shape, p.world_size, base.seq_len) if base is not None else None
    if pub is not None:
        s = pub.setting
        where = f"published ({pub.source}, {pub.table}, measured {pub.tokens_per_second_per_gpu:.0f} tokens/s per GPU)"
        dp = s.dp_replicate * s.dp_shard
        local = base.global_batch_size // dp
        # the published micro-batch, or the largest below it that splits this batch evenly and
        # gives each pipeline stage one at least
        need = min_microbatches(s.schedule, s.pp) if s.pp > 1 else 1
        mbs = max((m for m in range(1, min(s.micro_batch_size, local) + 1)
                   if local % m == 0 and local // m >= need), default=None)
        if base.global_batch_size % dp:
            lines.append(f"{where}: dp_shard {s.dp_shard} x tp {s.tp} x pp {s.pp} does not divide this "
                         f"config's trainer.global_batch_size={base.global_batch_size}")
        elif mbs is None:
            lines.append(f"{where}: this config's trainer.global_batch_size={base.global_batch_size} leaves "
                         f"{local} sequences per data-parallel rank, fewer than the {need} micro-batches "
                         f"its {s.schedule} on {s.pp} stages runs")
        else:
            v = assess(at_layout(base, s.dp_replicate, s.dp_shard, s.tp, s.pp, s.cp, s.ac, mbs))
            same = (win.layout.dp_replicate, win.layout.dp_shard, win.layout.tp, win.layout.pp, win.layout.cp) == \
                (s.dp_replicate, s.dp_shard, s.tp, s.pp, s.cp)
            cp = f" x cp {s.cp}" if s.cp > 1 else ""
            name = (f"{where}: dp_shard {s.dp_shard} x tp {s.tp} x pp {s.pp}{cp}, AC {s.ac}"
                    + (" (the winner's degrees)" if same else ""))
            lines.append(_compare(name + " at this config's batch (analytic memory)",
                                  v.prediction.tokens_per_second_per_gpu, v.memory["total"],
                                  v.prediction.terms, win, error))
    return lines


class Progress:
    """``progress(done, total, what)`` for :func:`llmforge.planning.planner.plan`: a bar
    rewritten in place on a terminal, one line per group otherwise, with the time left
    (the mean time of the groups simulated so far times the groups left)."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self.stream, self.t0 = stream or sys.stderr, time.perf_counter()
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int, what: str) -> None:
        spent = time.perf_counter() - self.t0
        left = f", about {spent / done * (total - done):.0f} s left" if done else ""
        if self.tty:
            bar = "#" * (20 * done // max(1, total))
            end = "\n" if done >= total else ""
            self.stream.write(f"\rplan: [{bar:<20}] {done}/{total} groups, {spent:.0f} s{left}: {what}\033[K{end}")
        else:
            self.stream.write(f"plan: group {min(done + 1, total)} of {total}: {what} ({spent:.0f} s so far{left})\n")
        self.stream.flush()
