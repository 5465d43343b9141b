"""The text report of ``llmforge plan`` and the command's body (:func:`run_plan`)."""

from __future__ import annotations

import json
import textwrap
import time
from typing import Any, Optional

from omegaconf import OmegaConf

from llmforge.config import load_config
from llmforge.errors import ConfigError
from llmforge.planning.calibration import model_error
from llmforge.planning.explain import Progress, explain
from llmforge.planning.gpus import GPUKind
from llmforge.planning.layout_settings import winner_yaml
from llmforge.planning.planner import EFFICIENCY, HEADROOM, Plan, plan

GIB = 1024**3
WIDTH = 80
"""Columns of the text report (a terminal's default width)."""


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def report(p: Plan, config: str, seconds: float, top: int = 8, algorithms: Optional[list[dict]] = None,
           why: Optional[list[str]] = None) -> str:
    """The text report, :data:`WIDTH` columns wide: header, the best ``top`` layouts (each with
    its status on a second line), how many more ``--json`` lists, the groups refused (one line
    per reason), ``why`` (:func:`llmforge.planning.explain.explain`), the winner's YAML
    (``algorithms``: the config's list, whose activation checkpointing entry it replaces)."""
    g = p.gpu
    timing = (f"step time by the calibrated model (held-out error {model_error():.1%})" if p.calibrated
              else f"compute at {EFFICIENCY:.0%} of {g.bf16_flops / 1e12:.0f} TFLOP/s bf16")
    lines = [f"plan: {config} on {p.world_size} x {g.name}",
             *_wrap(f"{(1 - HEADROOM) * g.memory_bytes / GIB:.1f} GiB usable per GPU ({1 - HEADROOM:.0%} of "
                    f"{g.memory_bytes / 1e9:.0f} GB); {timing}; torch.compile's memory not simulated; "
                    f"{len(p.references)} (tp, activation checkpointing) groups simulated at 2 and 3 "
                    f"layers, scaled to the model's depth, in {seconds:.1f} s (docs/scale.md)", ""),
             f"{'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3} {'ep':>3} {'cp':>3} {'AC':>9} {'mbs':>4} {'GiB':>6} "
             f"{'tok/s/GPU':>10} {'MFU':>6}"]
    measured = [c for c in p.candidates if c.peak_bytes is not None]
    for c in measured[:top]:
        lo = c.layout
        lines.append(f"{lo.dp_replicate:>6} {lo.dp_shard:>8} {lo.tp:>3} {lo.pp:>3} {lo.ep:>3} {lo.cp:>3} "
                     f"{lo.activation_checkpointing:>9} {lo.micro_batch_size:>4} {c.peak_bytes / GIB:>6.1f} "
                     f"{c.tokens_per_second_per_gpu:>10.0f} {c.mfu:>6.1%}")
        lines += _wrap(f"{c.status}{' (simulated)' if c.simulated else ''}"
                       f"{': ' + c.reason if c.reason else ''}", "    ")
    counts: dict[str, int] = {}
    for c in p.candidates:  # a whole group left out is no layout measured
        status = c.status
        if c.peak_bytes is None and status == "slower":
            status = "slower groups not simulated"
        elif status == "does not divide":  # every AC and micro-batch of a tp (and dp)
            status = "groups that do not divide"
        counts[status] = counts.get(status, 0) + 1
    one = {"slower groups not simulated": "slower group not simulated",
           "groups that do not divide": "group that does not divide"}
    said = ", ".join(f"{n} {one.get(s, s) if n == 1 else s}" for s, n in counts.items())
    lines += _wrap("candidates: " + said
                   + (f" ({len(measured) - top} more measured layouts not shown: --json lists every one)"
                      if len(measured) > top else ""), "")
    reasons: dict[tuple[int, str, str], list[str]] = {}  # one line per tp and reason
    for c in p.candidates:
        if c.peak_bytes is None:  # a whole group: refused or not simulated
            reasons.setdefault((c.layout.tp, c.status, c.reason), []).append(c.layout.activation_checkpointing)
    for (tp, status, reason), modes in reasons.items():
        group = "" if status == "does not divide" else f" (activation checkpointing {', '.join(modes)})"
        lines += _wrap(f"tp={tp}{group}: {status}: {reason}", "  ")
    for line in why or []:
        lines += _wrap(line, "")
    if p.chosen is not None:
        lines += ["winner's YAML overrides:", winner_yaml(p.chosen, algorithms or [])]
    return "\n".join(lines)


def run_plan(config: str, overrides: list[str], gpus: int, gpu: GPUKind, *, as_json: bool = False,
             top: int = 8, cfg: Optional[Any] = None) -> int:
    """Load ``config`` with ``overrides`` (or take the loaded ``cfg``), plan it and print the
    report (or one JSON object); returns 0.

    Raises:
        ConfigError: bad config or layout (see :func:`llmforge.planning.planner.plan`), or no
            layout fits (the message gives the smallest GPU count that would).
    """
    cfg = load_config(config, overrides) if cfg is None else cfg
    t0 = time.perf_counter()
    result = plan(cfg, gpus, gpu, progress=Progress())
    seconds = time.perf_counter() - t0
    why = explain(result, cfg)
    if as_json:
        print(json.dumps({**result.as_dict(), "seconds": seconds, "why": why}, indent=1))
    else:
        print(report(result, config, seconds, top, OmegaConf.to_container(cfg.algorithms), why))
    if result.chosen is None:
        where = (f"the smallest GPU count that would fit is {result.min_gpus} (memory only; "
                 f"trainer.global_batch_size may have to grow to divide it)" if result.min_gpus
                 else "it fits at no GPU count (the unsharded part of the peak alone is too big)")
        raise ConfigError(f"{config}: no layout fits in {gpu.name} memory on {gpus} GPUs; {where}")
    return 0
