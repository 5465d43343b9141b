"""Clusters: where ``llmforge launch`` can run a job, named in ``$LLMFORGE_HOME/clusters.yaml``.

``local`` (this machine) is always there: its GPUs as ``torch.cuda`` sees them, else CPU
processes on gloo. The file adds named clusters; ``type`` names the backend that runs their jobs
(:mod:`llmforge.runs.backend`: the built-ins below, or a registered one), whose cluster dataclass
lists the valid keys::

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
from pathlib import Path
from typing import Any, Dict, List, Optional, get_type_hints

from llmforge.errors import ConfigError
from llmforge.registry import backends
from llmforge.runs.backend import backend_class, backend_for
from llmforge.runs.cluster_types import Cluster, ClusterError, LocalCluster, clusters_file, detect_local


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
    known = [t for t in backends.names() if t != "local"]
    if not isinstance(kind, str) or kind == "local" or (kind not in known and "." not in kind):
        raise ClusterError(f"{where}.type: expected one of {', '.join(known)} (or a backend's import "
                           f"path), got {kind!r}")
    try:
        cls = backend_class(kind, key=f"{where}.type").cluster_class
    except ConfigError as exc:
        raise ClusterError(str(exc)) from None
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    values: dict[str, Any] = {}
    for key, value in spec.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(names)}"
            raise ClusterError(f"{where}.{key}: unknown key for a {kind} cluster{hint}")
        values[key] = _check_value(value, hints[key], f"{where}.{key}")
    for key in cls.required:
        if not values.get(key):
            raise ClusterError(f"{where}: a {kind} cluster needs '{key}'")
    cluster = cls(name=name, **values)
    cluster.finish(where)
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
    c = cluster
    if c.gpus_per_node:
        gpus = str(c.gpus_per_node)
    elif isinstance(c, LocalCluster):
        gpus = f"0 (CPU, {os.cpu_count()} cores)"
    else:
        gpus = f"0 (CPU, {c.processes_per_node} processes)"
    return {"name": c.name, "type": c.type, "gpu_type": c.gpu_type or "-", "gpus_per_node": gpus,
            "where": backend_for(c).where() or "-"}
