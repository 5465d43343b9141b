"""The planner on the launcher side: a cluster's GPU type selects the GPU row
(:func:`cluster_gpu`), ``llmforge plan --cluster NAME`` (:func:`plan_command`), and
``strategy.name: auto`` set by the config at ``llmforge launch`` (:func:`auto_overrides`; the
unset default does not plan): the planner's winner
becomes the job's overrides, so the run's config.yaml records the chosen layout.

Imports torch (the simulation) when imported: :mod:`llmforge.runs.launch` and the ``plan``
handler import this module only when they need it.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Optional

from omegaconf import OmegaConf

from llmforge.config import load_config
from llmforge.config.batch_plan import check_positive_sizes
from llmforge.errors import ConfigError
from llmforge.planning.gpus import GPUKind, gpu_kind, gpu_kind_of_type
from llmforge.planning.layout_arg import run_layout
from llmforge.planning.layout_settings import layout_overrides
from llmforge.planning.planner import check_gpus, plan
from llmforge.planning.report import run_plan
from llmforge.preflight.resolve import hf_shape
from llmforge.runs.cluster_types import Cluster
from llmforge.runs.clusters import get_cluster


def cluster_gpu(cluster: Cluster) -> GPUKind:
    """The GPU row of ``cluster`` (its ``gpu_type``; SageMaker and SkyPilot clusters derive it
    from ``instance_type`` / ``accelerator``), with the cluster's own ``gpus_per_node``.

    Raises:
        ConfigError: a CPU-only cluster, or a GPU type that names no row (the message lists the
            known ones).
    """
    if not cluster.gpus_per_node:
        raise ConfigError(f"cluster {cluster.name!r} has no GPUs (gpus_per_node: 0); "
                          "pass --gpu NAME to plan for a GPU kind")
    if not cluster.gpu_type:
        raise ConfigError(f"cluster {cluster.name!r} sets no gpu_type; set it in the clusters file "
                          "or pass --gpu NAME")
    row = gpu_kind_of_type(cluster.gpu_type, f"cluster {cluster.name!r} gpu_type")
    return replace(row, gpus_per_node=int(cluster.gpus_per_node))


def plan_command(args: Any) -> int:
    """``llmforge plan``: the GPU row from ``--gpu`` (default H100), else from ``--cluster``."""
    check_gpus(args.gpus)  # at once: a divisor search over 2**31 GPUs took minutes
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: the number of layouts to print must be >= 1 (default 8)")
    if args.cluster and args.gpu:
        raise ConfigError("--gpu and --cluster both name the GPU kind; pass one of them")
    gpu = cluster_gpu(get_cluster(args.cluster)) if args.cluster else gpu_kind(args.gpu or "H100-SXM-80GB")
    cfg = load_config(args.config, list(args.overrides))
    for note in hf_shape(cfg, dry_run=True):  # an imported model is planned at its own shape
        print(f"note: {note}", file=sys.stderr)
    check_positive_sizes(cfg)  # every layout divides by them
    if getattr(args, "layout", None) is not None:  # --layout "" is an error, not a plan of minutes
        return run_layout(cfg, args.config, args.gpus, gpu, args.layout, as_json=args.json)
    return run_plan(args.config, list(args.overrides), args.gpus, gpu, as_json=args.json, top=args.top, cfg=cfg)


def auto_overrides(cfg: Any, cluster: Cluster, world: int) -> Optional[tuple[list[str], str]]:
    """``strategy.name: auto`` on a GPU cluster with more than one GPU: plan ``cfg`` on
    ``world`` GPUs of the cluster's kind and return ``(overrides of the winner, one summary
    line)``; ``None`` where there is nothing to plan (another strategy, one process, CPU
    processes: ``auto`` then keeps its rule, one process alone and FSDP2 over all of them).

    Raises:
        ConfigError: an unknown GPU type, or no layout fits (the smallest GPU count that would).
    """
    if cfg.strategy.name != "auto" or world <= 1 or not cluster.gpus_per_node:
        return None
    gpu = cluster_gpu(cluster)
    result = plan(cfg, world, gpu)
    if result.chosen is None:
        where = (f"the smallest GPU count that would fit is {result.min_gpus}" if result.min_gpus
                 else "it fits at no GPU count")
        raise ConfigError(f"strategy.name=auto: no layout fits in {gpu.name} memory on {world} GPUs; "
                          f"{where} (llmforge plan shows why)")
    c = result.chosen
    algorithms = OmegaConf.to_container(cfg.algorithms, resolve=False)
    lo = c.layout
    line = (f"strategy auto: planned dp_replicate {lo.dp_replicate} x dp_shard {lo.dp_shard} x tp "
            f"{lo.tp}{f' x pp {lo.pp}' if lo.pp > 1 else ''}{f' (ep {lo.ep})' if lo.ep > 1 else ''}, "
            f"activation_checkpointing "
            f"{lo.activation_checkpointing}, micro_batch_size "
            f"{lo.micro_batch_size} on {world} x {gpu.name} (peak {c.peak_bytes / 2**30:.1f} GiB per "
            f"GPU, {c.tokens_per_second_per_gpu:.0f} tokens/s per GPU by the step model)")
    return layout_overrides(c, algorithms), line


__all__ = ["auto_overrides", "cluster_gpu", "plan_command"]
