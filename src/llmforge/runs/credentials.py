"""Credentials a job may need, by name only: what the environment provides and what is forwarded.

``llmforge secrets`` lists the known credentials (W&B, Comet, Hugging Face, AWS, ...) that this
environment provides and where from (an environment variable or a file), never the value.
``llmforge launch`` forwards only the variables named by ``--secret NAME`` or
``compute.secrets``: a local job's environment has every other credential variable removed;
SLURM gets the names in ``--export`` (values come from the submitting environment); SkyPilot
and SageMaker get the values at submit time, in memory. No value is ever written to the
registry, the run directory or a generated script.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional

from llmforge.config.redaction import is_secret_key, is_secret_variable
from llmforge.errors import ConfigError

KNOWN: dict[str, str] = {
    "WANDB_API_KEY": "Weights & Biases",
    "COMET_API_KEY": "Comet",
    "NEPTUNE_API_TOKEN": "Neptune",
    "MLFLOW_TRACKING_TOKEN": "MLflow",
    "HF_TOKEN": "Hugging Face Hub",
    "HUGGING_FACE_HUB_TOKEN": "Hugging Face Hub",
    "AWS_ACCESS_KEY_ID": "AWS",
    "AWS_SECRET_ACCESS_KEY": "AWS",
    "AWS_SESSION_TOKEN": "AWS",
    "AWS_PROFILE": "AWS",
    "GOOGLE_APPLICATION_CREDENTIALS": "Google Cloud",
    "AZURE_STORAGE_CONNECTION_STRING": "Azure Storage",
}
_FILES = {  # credentials that live in files (listed, not forwarded: the job's machine needs its own)
    "Hugging Face Hub": "~/.cache/huggingface/token",
    "AWS": "~/.aws/credentials",
    "Weights & Biases": "~/.netrc",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_secret_name(name: str) -> bool:
    """A known credential variable, or a name that looks like one (``*_API_KEY``, ``*_TOKEN``,
    ``*SECRET*``, ``*PASSWORD*``, ...): the one rule of
    :func:`llmforge.config.redaction.is_secret_variable` (not PWD)."""
    return name in KNOWN or is_secret_variable(name)


def available(env: Optional[Mapping[str, str]] = None) -> list[dict[str, str]]:
    """The credentials this environment provides: ``[{name, service, source}]``, values never
    read beyond "is it set". Files are reported as ``file ~/...`` (not forwarded)."""
    env = os.environ if env is None else env
    rows = []
    for name in sorted(env):
        if env.get(name) and is_secret_name(name):
            rows.append({"name": name, "service": KNOWN.get(name, "-"), "source": "environment"})
    for service, path in _FILES.items():
        p = Path(path).expanduser()
        if p.is_file() and (service != "Weights & Biases" or "api.wandb.ai" in _safe_read(p)):
            rows.append({"name": path, "service": service, "source": "file (not forwarded)"})
    return rows


def _safe_read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def check_names(names: Iterable[str], env: Optional[Mapping[str, str]] = None) -> list[str]:
    """Validate the names to forward; returns them de-duplicated in order.

    Raises:
        ConfigError: a name is not a valid variable name or is not set in the environment.
    """
    env = os.environ if env is None else env
    out: list[str] = []
    for name in names:
        if not _NAME.match(name):
            raise ConfigError(f"--secret/compute.secrets: {name!r} is not an environment variable name")
        if not env.get(name):
            raise ConfigError(f"secret {name} is not set in this environment (export {name}=... first; "
                              "`llmforge secrets` lists what is available)")
        if name not in out:
            out.append(name)
    return out


def job_environment(forward: Iterable[str], env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """This environment without credential variables, except those in ``forward`` (for local jobs)."""
    env = dict(os.environ if env is None else env)
    keep = set(forward)
    return {k: v for k, v in env.items() if k in keep or not is_secret_name(k)}


def secret_overrides(overrides: Iterable[str]) -> list[str]:
    """Overrides that set a secret-looking key (``loggers.0.api_key=...``); launch refuses them
    so that no value reaches the registry or a script."""
    bad = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if any(is_secret_key(part) for part in key.split(".")):
            bad.append(key)
    return bad
