"""The ``skypilot`` backend: a SkyPilot task YAML, submitted through SkyPilot's Python API.

The task runs on ``num_nodes`` nodes with ``resources.accelerators: <GPU>:<per node>``; its
``run`` starts torchrun (:mod:`llmforge.job.torchrun`) on every node with SkyPilot's variables
``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS`` (first line = the rendezvous host),
``SKYPILOT_NUM_NODES`` and ``SKYPILOT_NUM_GPUS_PER_NODE``, and always
``checkpoint.resume=auto`` (a recovered spot job continues). ``workdir`` (the folder of the
launch) is synced to every node; ``setup`` installs llmforge there. Credentials appear in the
file only as ``secrets: {NAME: null}``; their values are set on the task in memory at submit
time. ``sky`` is imported lazily: ``pip install 'llmforge[launch]'``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Any, Optional

from llmforge.errors import LLMForgeError
from llmforge.job.records import RunRecord
from llmforge.runs.backend import Backend, train_args
from llmforge.runs.cluster_types import Cluster, ClusterError

# Task fields SkyPilot documents (docs: "SkyPilot YAML"); tests check the task uses only these.
TASK_FIELDS = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup",
               "run", "config", "volumes", "event_callback"}
RESOURCE_FIELDS = {"infra", "cloud", "region", "zone", "accelerators", "accelerator_args", "cpus",
                   "memory", "instance_type", "use_spot", "disk_size", "disk_tier", "ports", "image_id",
                   "labels", "any_of", "ordered", "job_recovery", "autostop", "network_tier"}
PORT = 29500


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

    def finish(self, where: str) -> None:
        super().finish(where)
        if not self.gpu_type and self.accelerator:
            self.gpu_type = self.accelerator
        if self.gpus_per_node and not self.accelerator:
            raise ClusterError(f"{where}: a skypilot cluster with gpus_per_node needs 'accelerator' (e.g. H100)")


def task_dict(run_id: str, spec: dict[str, Any], cluster: SkyPilotCluster) -> dict[str, Any]:
    """The SkyPilot task as a mapping (what :func:`task_yaml` writes)."""
    resources: dict[str, Any] = {}
    if cluster.cloud:
        place = "k8s" if cluster.cloud in ("kubernetes", "k8s") else cluster.cloud
        where = cluster.context if place == "k8s" else cluster.region
        resources["infra"] = f"{place}/{where}" if where else place
    if cluster.gpus_per_node:
        resources["accelerators"] = f"{cluster.accelerator}:{spec['procs_per_node']}"
    if cluster.spot:
        resources["use_spot"] = True
    torchrun = ("python -m llmforge.job.torchrun --nnodes=\"$SKYPILOT_NUM_NODES\" "
                "--node-rank=\"$SKYPILOT_NODE_RANK\" --nproc-per-node=\"$NPROC\" "
                f"--master-addr=\"$HEAD_IP\" --master-port={PORT} \\\n  "
                + " ".join(shlex.quote(a) for a in train_args(spec)))
    per_node = ('NPROC="${SKYPILOT_NUM_GPUS_PER_NODE:-0}"; '
                f'if [ "$NPROC" -eq 0 ]; then NPROC={int(spec["procs_per_node"])}; fi')
    run = "\n".join([
        "set -uo pipefail",
        'HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
        per_node,
        torchrun, ""])
    task: dict[str, Any] = {
        "name": run_id,
        "num_nodes": int(spec["nodes"]),
        "resources": resources,
        "workdir": spec["workdir"],
        "envs": {"LLMFORGE_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"},
        "setup": cluster.setup,
        "run": run,
    }
    if spec.get("secrets"):
        task["secrets"] = {name: None for name in spec["secrets"]}
    return task


def task_yaml(run_id: str, spec: dict[str, Any], cluster: SkyPilotCluster) -> str:
    """The task file text (names of secrets only)."""
    import yaml

    header = f"# llmforge launch: run {run_id} on cluster {cluster.name}: {spec.get('summary', '')}\n"
    return header + yaml.safe_dump(task_dict(run_id, spec, cluster), sort_keys=False, width=1000)


def submit(task_path: str, run_id: str, spec: dict[str, Any], cluster: SkyPilotCluster) -> str:
    """Load the task with SkyPilot's parser, add secret values in memory, ``sky.launch`` it;
    returns ``<sky cluster>/<job id>``.

    Raises:
        LLMForgeError: SkyPilot is not installed, or SkyPilot refuses or fails the launch.
    """
    try:
        import sky
    except ImportError as exc:
        raise LLMForgeError("the skypilot cluster type needs SkyPilot: pip install 'llmforge[launch]'") from exc
    name = cluster.cluster_name or run_id
    try:
        task = sky.Task.from_yaml(task_path)
        if spec.get("secrets"):
            task.update_secrets({n: os.environ[n] for n in spec["secrets"]})
        request = sky.launch(task, cluster_name=name)
        result = sky.stream_and_get(request) if hasattr(sky, "stream_and_get") else request
    except Exception as exc:
        raise LLMForgeError(f"SkyPilot launch failed: {exc}") from exc
    job_id = result[0] if isinstance(result, tuple) else result
    return f"{name}/{job_id}"


def cancel(job: str) -> None:
    """Cancel the SkyPilot job ``<cluster>/<job id>`` (SkyPilot stops its processes).

    Raises:
        LLMForgeError: SkyPilot is not installed or the cancel fails.
    """
    try:
        import sky
    except ImportError as exc:
        raise LLMForgeError("pip install 'llmforge[launch]' to stop SkyPilot runs") from exc
    name, _, job_id = job.partition("/")
    try:
        request = sky.cancel(name, job_ids=[int(job_id)] if job_id.isdigit() else None)
        if hasattr(sky, "stream_and_get"):
            sky.stream_and_get(request)
    except Exception as exc:
        raise LLMForgeError(f"SkyPilot cancel of {job} failed: {exc}") from exc


class SkyPilotBackend(Backend):
    """``skypilot``: a task YAML (:func:`task_yaml`) launched through SkyPilot's Python API."""

    type = "skypilot"
    cluster_class = SkyPilotCluster
    uploads_workdir = True
    job_label = "SkyPilot job"
    definition_file = "task.yaml"

    def render(self, run_id: str, name: str, spec: dict[str, Any], resumption: int = 0) -> str:
        return task_yaml(run_id, spec, self.cluster)  # type: ignore[arg-type]

    def scheduler_variables(self) -> dict[str, str]:
        return dict.fromkeys(("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES",
                              "SKYPILOT_NUM_GPUS_PER_NODE"), "<set by SkyPilot>")

    def start(self, path: Any, run: RunRecord) -> str:
        return submit(str(path), run.id, run.spec, self.cluster)  # type: ignore[arg-type]

    def stop_job(self, job_id: str) -> None:
        cancel(job_id)

    def logs_hint(self, run: RunRecord) -> str:
        return f"; SkyPilot keeps its own: sky logs {str(run.job_id).split('/')[0]}"

    def where(self) -> str:
        c = self.cluster
        return "/".join(str(x) for x in (c.cloud, c.context, c.region) if x) + (" spot" if c.spot else "")
