"""The ``sagemaker`` backend: a SageMaker PyTorch estimator (``torch_distributed``).

:func:`estimator_definition` gives the keyword arguments of ``sagemaker.pytorch.PyTorch``:
the training image (``image_uri``, built from ``docker/Dockerfile``), ``instance_type`` and
``instance_count`` (= nodes), ``distribution={"torch_distributed": {"enabled": True}}``
(SageMaker runs torchrun on every instance), the project folder as ``source_dir`` with
``src/llmforge/runs/sagemaker_entry.py`` as the entry point, and the data channels. The run
directory is ``/opt/ml/checkpoints/<run.name>``, synced to ``checkpoint_s3_uri``. Secret values
are added to ``environment`` in memory at submit time only; the definition printed or written
lists their names. The ``sagemaker`` SDK is needed to submit (``pip install sagemaker``), not to
print the definition.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.runs.clusters import SageMakerCluster

ENTRY = Path(__file__).with_name("sagemaker_entry.py")
SECRET_PLACEHOLDER = "<from the submitting environment>"


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
                            "overrides": shlex.join(spec.get("overrides", []))},
        "environment": env,
        "base_job_name": "".join(c if c.isalnum() else "-" for c in name)[:50].strip("-") or "llmforge",
        "max_run": cluster.max_run_seconds,
        "checkpoint_local_path": "/opt/ml/checkpoints",
        "inputs": dict(cluster.channels),
    }
    if cluster.checkpoint_s3_uri:
        definition["checkpoint_s3_uri"] = cluster.checkpoint_s3_uri.rstrip("/") + f"/{run_id}"
    return definition


def submit(definition: dict, cluster: SageMakerCluster) -> str:
    """Build the estimator with the ``sagemaker`` SDK and start the job (no waiting); returns
    the training job name.

    Raises:
        LLMForgeError: the SDK is not installed, or SageMaker refuses the job.
    """
    try:
        from sagemaker.pytorch import PyTorch
    except ImportError as exc:
        raise LLMForgeError("the sagemaker cluster type needs the SageMaker SDK to submit: "
                            "pip install sagemaker (--dry-run prints the definition without it)") from exc
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
