"""The ``sagemaker`` backend: a SageMaker PyTorch estimator (``torch_distributed``).

:func:`estimator_definition` gives the keyword arguments of ``sagemaker.pytorch.PyTorch``:
the training image (``image_uri``, built from ``docker/Dockerfile``), ``instance_type`` and
``instance_count`` (= nodes), ``distribution={"torch_distributed": {"enabled": True}}``
(SageMaker runs torchrun on every instance), the project folder as ``source_dir`` with
``src/llmforge/cli/sagemaker_entry.py`` as the entry point, and the data channels. The run
directory is ``/opt/ml/checkpoints/<run.name>``, synced to ``checkpoint_s3_uri``. Secret values
are added to ``environment`` in memory at submit time only; the definition printed or written
lists their names. Each data channel SageMaker mounts (``SM_CHANNEL_<NAME>``) becomes the config
key that ``channel_keys`` names (``train`` -> ``data.path`` by default). Submitting needs the
SageMaker Python SDK 2.x (``pip install 'llmforge[sagemaker]'``, which pins ``sagemaker<3``: 3.x
has no ``sagemaker.pytorch``); printing the definition needs nothing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.job.records import RunRecord
from llmforge.runs.backend import Backend
from llmforge.runs.cluster_types import Cluster

ENTRY = Path(__file__).parents[1] / "cli" / "sagemaker_entry.py"  # a script file, not imported
SECRET_PLACEHOLDER = "<from the submitting environment>"
SDK = "sagemaker>=2.200,<3"  # the pyproject extra; 3.x removed sagemaker.pytorch.PyTorch
SAGEMAKER_GPUS = {  # instance type -> (GPUs, GPU type)
    "ml.p3.16xlarge": (8, "V100"), "ml.p3dn.24xlarge": (8, "V100"), "ml.p4d.24xlarge": (8, "A100"),
    "ml.p4de.24xlarge": (8, "A100-80GB"), "ml.p5.48xlarge": (8, "H100"), "ml.p5e.48xlarge": (8, "H200"),
    "ml.p5en.48xlarge": (8, "H200"), "ml.g5.xlarge": (1, "A10G"), "ml.g5.12xlarge": (4, "A10G"),
    "ml.g5.48xlarge": (8, "A10G"), "ml.g6.12xlarge": (4, "L4"), "ml.g6.48xlarge": (8, "L4"),
}


@dataclass
class SageMakerCluster(Cluster):
    """Amazon SageMaker training jobs (the ``sagemaker`` SDK 2.x, if installed, submits them)."""

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
    channel_keys: Dict[str, str] = field(default_factory=lambda: {"train": "data.path"})
    """Channel name -> config key set to the files of its mounted folder (``<dir>/**/*.*``)."""
    checkpoint_s3_uri: Optional[str] = None
    """S3 prefix that /opt/ml/checkpoints (the run directory) is synced to."""
    max_run_seconds: int = 86400
    """Time limit of the job (seconds)."""
    region: Optional[str] = None
    """AWS region."""

    required = ("instance_type", "image_uri", "role")

    def finish(self, where: str) -> None:
        super().finish(where)
        if self.instance_type in SAGEMAKER_GPUS:
            gpus, gpu_type = SAGEMAKER_GPUS[self.instance_type]
            self.gpus_per_node = self.gpus_per_node or gpus
            self.gpu_type = self.gpu_type or gpu_type

    def default_world_size(self, cfg: Any, nodes: Optional[int]) -> int:
        return self.slots_per_node * (nodes or self.instance_count)


def estimator_definition(run_id: str, name: str, spec: dict[str, Any], cluster: SageMakerCluster) -> dict:
    """Keyword arguments for ``sagemaker.pytorch.PyTorch`` plus ``inputs`` (the channels for
    ``fit``); secrets appear as :data:`SECRET_PLACEHOLDER`.

    Raises:
        ConfigError: the launch folder does not contain the llmforge sources (the entry point
            must be inside ``source_dir``).
    """
    workdir = Path(spec["workdir"])
    try:
        entry = ENTRY.resolve().relative_to(workdir.resolve())
    except ValueError as exc:
        raise ConfigError(f"sagemaker: run llmforge launch from the llmforge project folder (it is "
                          f"uploaded as source_dir and must contain {ENTRY.name}); now in {workdir}") from exc
    env = {"LLMFORGE_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"}
    env.update({n: SECRET_PLACEHOLDER for n in spec.get("secrets", [])})
    definition: dict[str, Any] = {
        "entry_point": str(entry),
        "source_dir": str(workdir),
        "image_uri": cluster.image_uri,
        "role": cluster.role,
        "instance_type": cluster.instance_type,
        "instance_count": int(spec["nodes"]),
        "distribution": {"torch_distributed": {"enabled": True}},
        "hyperparameters": {"config": spec["config_path"],
                            "overrides": shlex.join(spec.get("overrides", [])),
                            "channel_keys": json.dumps({k: v for k, v in cluster.channel_keys.items()
                                                        if k in cluster.channels}, sort_keys=True)},
        "environment": env,
        "base_job_name": "".join(c if c.isalnum() else "-" for c in name)[:50].strip("-") or "llmforge",
        "max_run": cluster.max_run_seconds,
        "checkpoint_local_path": "/opt/ml/checkpoints",
        "inputs": dict(cluster.channels),
    }
    if cluster.checkpoint_s3_uri:
        definition["checkpoint_s3_uri"] = cluster.checkpoint_s3_uri.rstrip("/") + f"/{run_id}"
    return definition


def sdk_estimator() -> Any:
    """``sagemaker.pytorch.PyTorch`` of the installed SDK.

    Raises:
        LLMForgeError: the SDK is missing, or it is 3.x (no ``sagemaker.pytorch``): the message
            names the installed version and the install command that works.
    """
    try:
        from sagemaker.pytorch import PyTorch

        return PyTorch
    except ImportError as exc:
        try:
            version: Optional[str] = importlib.metadata.version("sagemaker")
        except importlib.metadata.PackageNotFoundError:
            version = None
        fix = (f"pip install '{SDK}' (or pip install 'llmforge[sagemaker]'); --dry-run prints the "
               "definition without it")
        if version is None:
            why = "the SageMaker Python SDK is not installed"
        elif int(version.split(".")[0]) >= 3:
            why = (f"sagemaker {version} is installed, but SDK 3.x has no sagemaker.pytorch (llmforge "
                   "submits through SDK 2.x's sagemaker.pytorch.PyTorch)")
        else:
            why = f"sagemaker {version} is installed, but sagemaker.pytorch does not import ({exc})"
        raise LLMForgeError(f"the sagemaker cluster type cannot submit: {why}; {fix}") from exc


def submit(definition: dict, cluster: SageMakerCluster) -> str:
    """Build the estimator with the ``sagemaker`` SDK and start the job (no waiting); returns
    the training job name.

    Raises:
        LLMForgeError: the SDK is not installed, or SageMaker refuses the job.
    """
    PyTorch = sdk_estimator()
    kwargs = {k: v for k, v in definition.items() if k != "inputs"}
    kwargs["environment"] = {k: (os.environ[k] if v == SECRET_PLACEHOLDER else v)
                             for k, v in kwargs["environment"].items()}
    try:
        estimator = PyTorch(**kwargs)
        estimator.fit(inputs=definition.get("inputs") or None, wait=False)
        return str(estimator.latest_training_job.name)
    except Exception as exc:
        raise LLMForgeError(f"SageMaker refused the job: {exc}") from exc


def stop(job_name: str) -> None:
    """Stop a SageMaker training job (SageMaker sends SIGTERM, then kills).

    Raises:
        LLMForgeError: boto3 is missing or the call fails.
    """
    try:
        import boto3

        boto3.client("sagemaker").stop_training_job(TrainingJobName=job_name)
    except ImportError as exc:
        raise LLMForgeError("pip install sagemaker (boto3) to stop SageMaker runs") from exc
    except Exception as exc:
        raise LLMForgeError(f"stopping SageMaker job {job_name} failed: {exc}") from exc


class SageMakerBackend(Backend):
    """``sagemaker``: a PyTorch estimator (:func:`estimator_definition`) started with the SDK 2.x."""

    type = "sagemaker"
    cluster_class = SageMakerCluster
    uploads_workdir = True
    job_label = "SageMaker job"
    definition_file = "estimator.json"

    def render(self, run_id: str, name: str, spec: dict[str, Any], resumption: int = 0) -> str:
        definition = estimator_definition(run_id, name, spec, self.cluster)  # type: ignore[arg-type]
        return json.dumps(definition, indent=2) + "\n"

    def scheduler_variables(self) -> dict[str, str]:
        return {f"SM_CHANNEL_{n.upper()}": f"/opt/ml/input/data/{n}"
                for n in getattr(self.cluster, "channels", {})}

    def start(self, path: Any, run: RunRecord) -> str:
        return submit(json.loads(Path(path).read_text(encoding="utf-8")), self.cluster)  # type: ignore[arg-type]

    def stop_job(self, job_id: str) -> None:
        stop(job_id)

    def logs_hint(self, run: RunRecord) -> str:
        return "; see the job's CloudWatch logs"

    def where(self) -> str:
        return f"{self.cluster.instance_type} (SageMaker)"
