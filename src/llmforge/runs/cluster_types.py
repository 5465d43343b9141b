"""What a cluster is: :class:`Cluster` (the keys every cluster has) and :class:`LocalCluster`
(this machine); each backend's cluster dataclass subclasses :class:`Cluster`; where the clusters
file is (:func:`clusters_file`). Reading ``clusters.yaml`` is :mod:`llmforge.runs.clusters`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from llmforge.errors import ConfigError
from llmforge.job.records import llmforge_home


class ClusterError(ConfigError):
    """A clusters file or a cluster name is invalid. Exit code 2."""


@dataclass
class Cluster:
    """Fields every cluster has."""

    name: str = ""
    """The name in clusters.yaml (``local`` for this machine)."""
    type: str = "local"
    """The backend: local, slurm, skypilot, sagemaker, or a registered/import-path one."""
    gpus_per_node: int = 0
    """GPUs per node; 0 = CPU-only nodes (processes_per_node CPU processes each)."""
    gpu_type: str = ""
    """GPU model shown by ``llmforge clusters`` (e.g. h100)."""
    processes_per_node: int = 1
    """CPU-only nodes: most training processes per node."""

    required: ClassVar[tuple[str, ...]] = ()  # keys a clusters.yaml entry must set
    max_nodes: ClassVar[Optional[int]] = None  # None: any number of nodes

    def finish(self, where: str) -> None:
        """Derive and check fields after parsing (``where`` names the entry in errors).

        Raises:
            ClusterError: a value out of range.
        """
        for key in ("gpus_per_node", "processes_per_node", "instance_count"):
            low = 0 if key == "gpus_per_node" else 1
            if getattr(self, key, low) < low:
                raise ClusterError(f"{where}.{key}: must be >= {low}")

    def default_world_size(self, cfg: Any, nodes: Optional[int]) -> int:
        """Training processes when neither ``--gpus`` nor ``compute.gpus`` says: full nodes."""
        return self.slots_per_node * (nodes or 1)

    @property
    def slots_per_node(self) -> int:
        """Training processes one node can hold (GPUs, or CPU processes on CPU-only nodes)."""
        return self.gpus_per_node or self.processes_per_node

    @property
    def device(self) -> str:
        """``gpu`` or ``cpu`` (what the training processes run on)."""
        return "gpu" if self.gpus_per_node else "cpu"


@dataclass
class LocalCluster(Cluster):
    """This machine: ``torch.cuda`` GPUs, else any number of CPU processes (gloo)."""

    processes_per_node: int = 1024
    max_nodes: ClassVar[Optional[int]] = 1

    def default_world_size(self, cfg: Any, nodes: Optional[int]) -> int:
        return int(cfg.trainer.devices)


def clusters_file() -> Path:
    """``$LLMFORGE_HOME/clusters.yaml``."""
    return llmforge_home() / "clusters.yaml"


def detect_local() -> LocalCluster:
    """``local``: the GPUs ``torch.cuda`` sees (type from the first one), else CPU processes."""
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        kind = torch.cuda.get_device_name(0) if n else ""
    except Exception:  # a broken CUDA setup is a CPU machine here
        n, kind = 0, ""
    return LocalCluster(name="local", type="local", gpus_per_node=n, gpu_type=kind or ("" if n else "cpu"))
