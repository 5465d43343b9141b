"""Clusters: where ``llmforge launch`` can run a job, named in ``$LLMFORGE_HOME/clusters.yaml``.

``local`` (this machine) is always there: its GPUs as ``torch.cuda`` sees them, else CPU
processes on gloo. The file adds named clusters of four types::

    big-slurm:                       # a name of your choice
      type: slurm
      partition: gpu
      account: my-project
      gpus_per_node: 8
      gpu_type: h100
      time_limit: "24:00:00"
      sbatch: ["--qos=high"]          # extra #SBATCH lines
      setup: "source ~/venv/bin/activate"
    sky-aws:
      type: skypilot
      cloud: aws                     # or kubernetes (with context: my-k8s-context)
      accelerator: H100
      gpus_per_node: 8
      spot: true
      region: us-east-1
    sm:
      type: sagemaker
      instance_type: ml.p5.48xlarge
      image_uri: 123456789012.dkr.ecr.us-east-1.amazonaws.com/llmforge:latest
      role: arn:aws:iam::123456789012:role/SageMakerRole
      channels: {train: s3://my-bucket/data}

Errors in the file (YAML syntax, unknown type or key, wrong value type, missing required key)
raise :class:`ClusterError` (exit code 2) naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, get_type_hints

from llmforge.errors import ConfigError
from llmforge.runs.registry import llmforge_home

SAGEMAKER_GPUS = {  # instance type -> (GPUs, GPU type)
    "ml.p3.16xlarge": (8, "V100"), "ml.p3dn.24xlarge": (8, "V100"), "ml.p4d.24xlarge": (8, "A100"),
    "ml.p4de.24xlarge": (8, "A100-80GB"), "ml.p5.48xlarge": (8, "H100"), "ml.p5e.48xlarge": (8, "H200"),
    "ml.p5en.48xlarge": (8, "H200"), "ml.g5.xlarge": (1, "A10G"), "ml.g5.12xlarge": (4, "A10G"),
    "ml.g5.48xlarge": (8, "A10G"), "ml.g6.12xlarge": (4, "L4"), "ml.g6.48xlarge": (8, "L4"),
}


class ClusterError(ConfigError):
    """A clusters file or a cluster name is invalid. Exit code 2."""


@dataclass
class Cluster:
    """Fields every cluster has."""

    name: str = ""
    """The name in clusters.yaml (``local`` for this machine)."""
    type: str = "local"
    """local, slurm, skypilot or sagemaker."""
    gpus_per_node: int = 0
    """GPUs per node; 0 = CPU-only nodes (processes_per_node CPU processes each)."""
    gpu_type: str = ""
    """GPU model shown by ``llmforge clusters`` (e.g. h100)."""
    processes_per_node: int = 1
    """CPU-only nodes: most training processes per node."""

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


@dataclass
class SlurmCluster(Cluster):
    """A SLURM cluster reached through ``sbatch`` on this machine."""

    partition: Optional[str] = None
    """Partition (``#SBATCH --partition``); null = the cluster's default."""
    account: Optional[str] = None
    """Account to charge (``#SBATCH --account``)."""
    time_limit: Optional[str] = None
    """Wall-time limit, e.g. ``24:00:00`` (``#SBATCH --time``)."""
    cpus_per_task: Optional[int] = None
    """CPUs per node task (``#SBATCH --cpus-per-task``)."""
    sbatch: List[str] = field(default_factory=list)
    """Extra ``#SBATCH`` options, e.g. ``--qos=high``."""
    setup: str = ""
    """Shell lines run before training (e.g. ``module load cuda``, activating a venv)."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SLURM sends SIGUSR1 (checkpoint, exit 75, requeue)."""
    port: int = 29500
    """Rendezvous port on the first node."""
    python: Optional[str] = None
    """Python interpreter on the nodes; null = the one running ``llmforge launch``."""


@dataclass
class SkyPilotCluster(Cluster):
    """A cloud or Kubernetes cluster provisioned by SkyPilot (``pip install 'llmforge[launch]'``)."""

    cloud: Optional[str] = None
    """aws, gcp, azure, lambda, kubernetes, ... (null = SkyPilot chooses)."""
    context: Optional[str] = None
    """Kubernetes context (cloud: kubernetes)."""
    accelerator: Optional[str] = None
    """SkyPilot accelerator name, e.g. H100, A100-80GB."""
    spot: bool = False
    """Use spot/preemptible instances (SkyPilot recovers them)."""
    region: Optional[str] = None
    """Cloud region."""
    cluster_name: Optional[str] = None
    """SkyPilot cluster name; null = the run id."""
    setup: str = "pip install ."
    """Setup commands of the task (run once per node)."""


@dataclass
class SageMakerCluster(Cluster):
    """Amazon SageMaker training jobs (the ``sagemaker`` SDK, if installed, submits them)."""

    instance_type: str = ""
    """e.g. ml.p5.48xlarge; sets gpus_per_node and gpu_type for known types."""
    instance_count: int = 1
    """Default number of instances (nodes) when compute.nodes and compute.gpus do not say."""
    image_uri: str = ""
    """Training image (build it from docker/Dockerfile and push it to ECR)."""
    role: str = ""
    """IAM role ARN of the training job."""
    channels: Dict[str, str] = field(default_factory=dict)
    """Data channels: name -> s3:// URI (mounted under /opt/ml/input/data/NAME)."""
    checkpoint_s3_uri: Optional[str] = None
    """S3 prefix that /opt/ml/checkpoints (the run directory) is synced to."""
    max_run_seconds: int = 86400
    """Time limit of the job (seconds)."""
    region: Optional[str] = None
    """AWS region."""


TYPES: dict[str, type] = {"local": LocalCluster, "slurm": SlurmCluster, "skypilot": SkyPilotCluster,
                          "sagemaker": SageMakerCluster}
REQUIRED = {"sagemaker": ("instance_type", "image_uri", "role")}


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


def _check_value(value: Any, tp: Any, where: str) -> Any:
    origin = getattr(tp, "__origin__", None)
    args = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
    if origin is not None and type(None) in getattr(tp, "__args__", ()):  # Optional[X]
        return None if value is None else _check_value(value, args[0], where)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        value = str(value) if ok else value
    elif origin in (list, List):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif origin in (dict, Dict):
        ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    else:
        ok = True
    if not ok:
        name = {bool: "true or false", int: "an integer", str: "a string"}.get(tp, str(tp).replace("typing.", ""))
        raise ClusterError(f"{where}: expected {name}, got {value!r}")
    return value


def parse_cluster(name: str, spec: Any, source: str) -> Cluster:
    """Build one cluster from its mapping in a clusters file (``source`` is named in errors).

    Raises:
        ClusterError: not a mapping, unknown type or key (with the closest valid key), a wrong
            value type, a missing required key, or a non-positive size.
    """
    where = f"{source}: {name}"
    if not isinstance(spec, dict):
        raise ClusterError(f"{where}: expected a mapping with a 'type' key, got {spec!r}")
    kind = spec.get("type")
    if kind not in TYPES or kind == "local":
        allowed = ", ".join(t for t in TYPES if t != "local")
        raise ClusterError(f"{where}.type: expected one of {allowed}, got {kind!r}")
    cls = TYPES[kind]
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    values: dict[str, Any] = {}
    for key, value in spec.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(names)}"
            raise ClusterError(f"{where}.{key}: unknown key for a {kind} cluster{hint}")
        values[key] = _check_value(value, hints[key], f"{where}.{key}")
    for key in REQUIRED.get(kind, ()):
        if not values.get(key):
            raise ClusterError(f"{where}: a {kind} cluster needs '{key}'")
    cluster = cls(name=name, **values)
    if isinstance(cluster, SageMakerCluster) and cluster.instance_type in SAGEMAKER_GPUS:
        gpus, gpu_type = SAGEMAKER_GPUS[cluster.instance_type]
        cluster.gpus_per_node = cluster.gpus_per_node or gpus
        cluster.gpu_type = cluster.gpu_type or gpu_type
    if isinstance(cluster, SkyPilotCluster) and not cluster.gpu_type and cluster.accelerator:
        cluster.gpu_type = cluster.accelerator
    for key in ("gpus_per_node", "processes_per_node", "instance_count"):
        if getattr(cluster, key, 1) < (0 if key == "gpus_per_node" else 1):
            raise ClusterError(f"{where}.{key}: must be >= {0 if key == 'gpus_per_node' else 1}")
    if isinstance(cluster, SkyPilotCluster) and cluster.gpus_per_node and not cluster.accelerator:
        raise ClusterError(f"{where}: a skypilot cluster with gpus_per_node needs 'accelerator' (e.g. H100)")
    return cluster


def load_clusters(path: Optional[str | Path] = None, *, detect: bool = True) -> dict[str, Cluster]:
    """``local`` plus every cluster of the clusters file (missing file: only ``local``).

    Args:
        path: the file; default :func:`clusters_file`.
        detect: look for local GPUs (imports torch); ``False`` describes local as CPU-only.

    Raises:
        ClusterError: the file is not valid YAML or a cluster in it is invalid.
    """
    import yaml

    path = Path(path) if path else clusters_file()
    local = detect_local() if detect else LocalCluster(name="local", gpu_type="cpu")
    out: dict[str, Cluster] = {"local": local}
    if not path.exists():
        return out
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ClusterError(f"{path}{at}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if isinstance(data, dict) and set(data) == {"clusters"}:
        data = data["clusters"] or {}
    if not isinstance(data, dict):
        raise ClusterError(f"{path}: expected a mapping of cluster names to settings")
    for name, spec in data.items():
        if name == "local":
            raise ClusterError(f"{path}: local: the name 'local' is reserved for this machine")
        out[str(name)] = parse_cluster(str(name), spec, str(path))
    return out


def get_cluster(name: Optional[str], path: Optional[str | Path] = None) -> Cluster:
    """The cluster called ``name`` (None: ``local``).

    Raises:
        ClusterError: the name is unknown (the message lists the known ones) or the file is bad.
    """
    name = name or "local"
    clusters = load_clusters(path, detect=name == "local" or os.environ.get("LLMFORGE_DETECT_GPUS") == "1")
    if name not in clusters:
        known = ", ".join(clusters)
        raise ClusterError(f"unknown cluster {name!r}: known clusters are {known} "
                           f"(define others in {Path(path) if path else clusters_file()})")
    return clusters[name]


def describe(cluster: Cluster) -> dict[str, str]:
    """One row for ``llmforge clusters``: name, type, GPU type, GPUs per node, where."""
    c: Any = cluster
    if c.type == "local":
        where = "this machine" + ("" if c.gpus_per_node else " (CPU processes, gloo)")
    elif c.type == "slurm":
        where = " ".join(f"{k}={getattr(c, k)}" for k in ("partition", "account", "time_limit") if getattr(c, k))
    elif c.type == "skypilot":
        where = "/".join(str(x) for x in (c.cloud, c.context, c.region) if x) + (" spot" if c.spot else "")
    else:
        where = f"{c.instance_type} (SageMaker)"
    if c.gpus_per_node:
        gpus = str(c.gpus_per_node)
    elif c.type == "local":
        gpus = f"0 (CPU, {os.cpu_count()} cores)"
    else:
        gpus = f"0 (CPU, {c.processes_per_node} processes)"
    return {"name": c.name, "type": c.type, "gpu_type": c.gpu_type or "-", "gpus_per_node": gpus,
            "where": where or "-"}
