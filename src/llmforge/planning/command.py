"""``llmforge plan CONFIG [key=value ...] --gpus N [--gpu NAME] [--json] [--top K]``: the CLI of
:func:`llmforge.planning.planner.plan` (parser and handler; the ``cli`` package only registers
them)."""

from __future__ import annotations

from typing import Any

from llmforge.errors import ConfigError
from llmforge.planning.gpus import GPU_KINDS, gpu_kind


def add_parser(sub: Any) -> None:
    """Add ``plan`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("plan", help="choose the parallel layout for N GPUs (simulated on the CPU)")
    p.add_argument("config", help="YAML file (e.g. yamls/llama3_8b.yaml)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.global_batch_size=64")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs (world size)")
    p.add_argument("--gpu", default="H100-SXM-80GB", metavar="NAME",
                   help=f"GPU kind: {', '.join(GPU_KINDS)} (default: H100-SXM-80GB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int, default=8, metavar="K", help="layouts to print (default 8)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def cmd_plan(args: Any) -> int:
    """Handler of ``llmforge plan``; returns the exit code (2: bad input or nothing fits)."""
    gpu = gpu_kind(args.gpu)
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    # torch, Lightning and the model code: imported when the command runs, so that the CLI
    # (imported by every command) starts without them
    from llmforge.planning.report import run_plan  # heavy (torch): off the CLI's fast path

    return run_plan(args.config, list(args.overrides), args.gpus, gpu, as_json=args.json, top=args.top)
