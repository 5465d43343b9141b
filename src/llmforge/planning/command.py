"""``llmforge plan CONFIG [key=value ...] --gpus N [--gpu NAME | --cluster NAME] [--layout K=V,...] [--json] [--top K]``:
the parser of :func:`llmforge.planning.planner.plan`'s command (the handler is
:func:`llmforge.runs.auto_layout.plan_command`: a cluster's GPU type lives on the launcher side)."""

from __future__ import annotations

from typing import Any

from llmforge.planning.gpus import GPU_KINDS


def add_parser(sub: Any) -> None:
    """Add ``plan`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("plan", help="choose the parallel layout for N GPUs (simulated on the CPU)")
    p.add_argument("config", help="YAML file (e.g. yamls/llama3_8b.yaml)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.global_batch_size=64")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs (world size)")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help=f"GPU kind: {', '.join(GPU_KINDS)} (default: H100-SXM-80GB, or the cluster's)")
    p.add_argument("--cluster", default=None, metavar="NAME",
                   help="take the GPU kind and GPUs per node from this cluster of clusters.yaml "
                        "(its gpu_type, instance_type or accelerator)")
    p.add_argument("--layout", default=None, metavar="K=V,...",
                   help="predict one layout instead of planning: dp_shard=8,tp=8,pp=8[,dp_replicate=..,"
                        "cp=..,ac=none|selective|full,mbs=..] (the calibrated analytic model, no simulation)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int, default=8, metavar="K", help="layouts to print (default 8)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
