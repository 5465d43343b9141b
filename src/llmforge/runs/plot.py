"""``llmforge runs plot``: draw metrics of one or several runs from their ``metrics.jsonl``.

    llmforge runs plot runs/a runs/b --metric train/loss --metric eval/loss --out loss.png

One panel per metric, one line per run (labelled with the run directory's name), x = the
optimizer step (or ``train/tokens_seen`` with ``--x tokens``). Records without the metric, and
non-finite values (written as strings in metrics.jsonl), are skipped. matplotlib draws off
screen (the Agg backend), so no display is needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from llmforge.errors import ConfigError

X_KEYS = {"step": "step", "tokens": "train/tokens_seen"}


def metrics_file(run: str | Path) -> Path:
    """``metrics.jsonl`` of a run directory (or the file itself).

    Raises:
        ConfigError: neither exists.
    """
    p = Path(run)
    path = p if p.is_file() else p / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{p}: no metrics.jsonl (not a run directory of llmforge train)")
    return path


def series(run: str | Path, metric: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of ``metric`` in a run, sorted by x (records of one step keep their file
    order); non-finite values are left out.

    Args:
        run: a run directory or a metrics.jsonl file.
        metric: a metric name such as ``train/loss``.
        x: ``step`` (optimizer steps) or ``tokens`` (``train/tokens_seen``; a record without
            it, such as the evaluation at step 0, takes that of its step, 0 at step 0).
    """
    from llmforge.loggers.jsonl import read_metrics  # heavy (torch via Lightning): off the fast path

    records = read_metrics(metrics_file(run))
    tokens_at = {0: 0, **{r["step"]: r["train/tokens_seen"] for r in records if "train/tokens_seen" in r}}
    xs, ys = [], []
    for rec in records:
        xv = rec.get("step") if x == "step" else tokens_at.get(rec.get("step"))  # eval-only records
        yv = rec.get(metric)
        if isinstance(xv, (int, float)) and isinstance(yv, (int, float)) and math.isfinite(yv):
            xs.append(float(xv))
            ys.append(float(yv))
    order = sorted(range(len(xs)), key=xs.__getitem__)  # stable: `llmforge eval` of an older
    return [xs[i] for i in order], [ys[i] for i in order]  # checkpoint appends a lower step


def plot_runs(runs: Sequence[str | Path], metrics: Sequence[str] = ("train/loss",),
              out: str | Path = "plot.png", x: str = "step", width: int = 1000, height: int = 600,
              log_y: bool = False, labels: Optional[Sequence[str]] = None) -> Path:
    """Draw ``metrics`` of ``runs`` into a PNG of ``width`` x ``height`` pixels.

    Args:
        runs: run directories (or metrics.jsonl files).
        metrics: metric names, one panel each (stacked vertically).
        out: the PNG file to write (parent folders are created).
        x: ``step`` or ``tokens``.
        width, height: image size in pixels.
        log_y: logarithmic y axes.
        labels: legend labels, one per run; default: the run directory names.

    Returns:
        The path written.

    Raises:
        ConfigError: no runs, a run without metrics.jsonl, an unknown ``x``, bad labels, or
            no run having any value of a metric.
    """
    if not runs:
        raise ConfigError("runs plot: give at least one run directory")
    if x not in X_KEYS:
        raise ConfigError(f"runs plot: --x must be one of {', '.join(X_KEYS)}; got {x!r}")
    if labels is not None and len(labels) != len(runs):
        raise ConfigError(f"runs plot: {len(labels)} labels for {len(runs)} runs")
    data = {m: [series(r, m, x) for r in runs] for m in metrics}
    for m, per_run in data.items():
        if not any(xs for xs, _ in per_run):
            raise ConfigError(f"runs plot: no run has values of {m!r}; metrics.jsonl names "
                                "look like train/loss, eval/loss, throughput/tokens_per_second")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dpi = 100
    fig, axes = plt.subplots(len(metrics), 1, figsize=(width / dpi, height / dpi), dpi=dpi,
                             squeeze=False, sharex=True)
    names = list(labels) if labels is not None else [Path(r).resolve().name if Path(r).is_dir()
                                                     else Path(r).resolve().parent.name for r in runs]
    for ax, m in zip(axes[:, 0], metrics):
        for name, (xs, ys) in zip(names, data[m]):
            if xs:
                ax.plot(xs, ys, label=name, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_ylabel(m)
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("optimizer step" if x == "step" else "tokens seen")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return out
