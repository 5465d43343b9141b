"""Scaling by config: ``compute.gpus`` (or ``--gpus``) -> nodes, processes per node, batch plan.

The global batch stays fixed: gradient accumulation is derived from the new data-parallel size
(:func:`llmforge.config.batch_plan.plan_batch`), so one YAML trains the same model on 1 CPU
process, 2 CPU processes, 8 or 128 GPUs. A GPU count that cannot divide the batch, or cannot
fill whole nodes, is a :class:`~llmforge.errors.ConfigError` (exit 2) that lists counts that work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmforge.config.validate import BatchPlan, validate
from llmforge.errors import ConfigError
from llmforge.runs.cluster_types import Cluster


@dataclass
class ComputePlan:
    """Where and how wide a launched job runs."""

    cluster: str
    """Cluster name."""
    device: str
    """``gpu`` or ``cpu``."""
    world_size: int
    """Training processes in the job (GPUs, or CPU processes)."""
    nodes: int
    """Nodes (SLURM nodes, SkyPilot nodes, SageMaker instances; 1 on local)."""
    procs_per_node: int
    """Processes (GPUs) per node: torchrun's ``--nproc-per-node``."""
    batch: BatchPlan
    """The batch arithmetic at this world size."""
    layout_note: str = ""
    """``strategy.name: auto`` on GPUs: the layout the planner chose (``llmforge launch``)."""

    def summary(self) -> str:
        b = self.batch
        unit = "GPUs" if self.device == "gpu" else "CPU processes"
        return (f"{self.world_size} {unit} = {self.nodes} node(s) x {self.procs_per_node} on "
                f"{self.cluster}; global batch {b.global_batch_size} = micro {b.micro_batch_size} x "
                f"data-parallel {b.dp_size} x accumulation {b.gradient_accumulation_steps}"
                + (f"; {self.layout_note}" if self.layout_note else ""))


def _layout(gpus: int, nodes: Optional[int], cluster: Cluster) -> tuple[int, int]:
    """``(nodes, per_node)`` for ``gpus`` processes on ``cluster``, or raise ConfigError."""
    slots = cluster.slots_per_node
    unit = "GPUs" if cluster.gpus_per_node else "processes"
    if nodes is not None:
        if nodes < 1:
            raise ConfigError(f"compute.nodes must be >= 1, got {nodes}")
        if gpus % nodes or gpus // nodes > slots:
            ok = [n for n in range(1, gpus + 1) if gpus % n == 0 and gpus // n <= slots]
            raise ConfigError(f"compute.gpus={gpus} cannot be spread evenly over compute.nodes={nodes} "
                              f"with at most {slots} {unit} per node on cluster {cluster.name!r}; "
                              f"use compute.nodes in {ok[:8]} or compute.nodes=null")
        per_node = gpus // nodes
    elif gpus <= slots:
        nodes, per_node = 1, gpus
    elif gpus % slots == 0:
        nodes, per_node = gpus // slots, slots
    else:
        lo = (gpus // slots) * slots
        raise ConfigError(f"compute.gpus={gpus} does not fill whole nodes of {slots} {unit} on cluster "
                          f"{cluster.name!r}; use {lo} or {lo + slots}, or set compute.nodes")
    if cluster.max_nodes is not None and nodes > cluster.max_nodes:
        raise ConfigError(f"cluster {cluster.name!r} is {cluster.max_nodes} machine(s) with {slots} {unit} "
                          f"each; compute.nodes={nodes} needs a slurm, skypilot or sagemaker cluster")
    return nodes, per_node


def working_counts(cfg: Any, cluster: Cluster, limit: int = 4096, show: int = 10) -> list[int]:
    """GPU counts (up to ``limit``) that divide the batch and fill whole nodes of ``cluster``."""
    out = []
    for g in range(1, limit + 1):
        try:
            _layout(g, None, cluster)
            validate(cfg, g)
        except ConfigError:
            continue
        out.append(g)
        if len(out) >= show:
            break
    return out


def plan_compute(cfg: Any, cluster: Cluster, gpus: Optional[int] = None,
                 nodes: Optional[int] = None) -> ComputePlan:
    """Resolve the job's size: ``gpus``/``nodes`` arguments, else ``compute.gpus``/``compute.nodes``,
    else ``trainer.devices`` processes on ``local`` (1 by default) and one full node
    elsewhere; then check the batch arithmetic.

    Raises:
        ConfigError: a non-positive size, a count that does not fill whole nodes, or one that
            cannot divide ``trainer.global_batch_size`` (the message lists counts that work).
    """
    comp = cfg.compute
    gpus = gpus if gpus is not None else comp.gpus
    nodes = nodes if nodes is not None else comp.nodes
    if gpus is None:
        gpus = cluster.default_world_size(cfg, nodes)
    if gpus < 1:
        raise ConfigError(f"compute.gpus must be >= 1, got {gpus}")
    n_nodes, per_node = _layout(gpus, nodes, cluster)
    try:
        batch = validate(cfg, gpus)
    except ConfigError as exc:
        if "global_batch_size" not in str(exc) and "world size" not in str(exc):
            raise
        counts = working_counts(cfg, cluster)
        t = cfg.trainer
        hint = (f"GPU counts that work on {cluster.name!r}: {', '.join(map(str, counts))}"
                if counts else "no GPU count works on this cluster")
        raise ConfigError(f"compute.gpus={gpus} cannot divide the batch (trainer.global_batch_size="
                          f"{t.global_batch_size}, micro_batch_size={t.micro_batch_size}): {exc}. "
                          f"{hint}; or change trainer.global_batch_size/micro_batch_size") from exc
    return ComputePlan(cluster=cluster.name, device=cluster.device, world_size=gpus, nodes=n_nodes,
                       procs_per_node=per_node, batch=batch)


def check_scheduling(cfg: Any) -> int:
    """``scheduling.max_retries`` (>= 0).

    Raises:
        ConfigError: a negative value.
    """
    k = int(cfg.scheduling.max_retries)
    if k < 0:
        raise ConfigError(f"scheduling.max_retries must be >= 0, got {k}")
    return k
