"""MLflow: a thin Lightning ``Logger`` over the MLflow SDK's ``MlflowClient``
(``pip install 'llmforge[mlflow]'``).

YAML::

    loggers:
      - name: mlflow
        tracking_uri: null        # default: a local SQLite store in the run directory
        experiment: llmforge      # MLflow experiment name
        run_name: null            # default: run.name

With no ``tracking_uri`` (and no ``MLFLOW_TRACKING_URI`` in the environment) the run is written
to ``<run_dir>/mlflow.db`` with artifacts in ``<run_dir>/mlartifacts``: no server, no network;
view it with ``mlflow ui --backend-store-uri sqlite:///runs/NAME/mlflow.db``. (MLflow 3 keeps
its old ``file:`` store in maintenance mode and refuses it by default; SQLite is what MLflow
recommends for a local store.) Metric names are llmforge's (``train/loss``, ...), one value
per optimizer step; the resolved config (secrets redacted) is logged as parameters, nested
keys joined by dots. A name MLflow refuses (it accepts letters, digits and ``_ - . / space :``;
e.g. ``data/code+math/tokens_seen`` of a mixture entry named ``code+math``) is logged under
:func:`mlflow_name`'s spelling, the same for the whole run, with one warning naming it. A
resumed run continues the same MLflow run (its id is kept in ``<run_dir>/mlflow_run_id``), and
the steps after the checkpoint are logged again with the same step numbers:
``get_metric_history`` then holds both values of such a step, the newest last.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from llmforge.errors import ConfigError
from llmforge.loggers._common import (MetricNames, import_sdk, numeric_metrics, redacted_argv,
                                      run_identity)

MAX_PARAM_CHARS = 6000  # MLflow's limit for a parameter value (mlflow.utils.validation)
MAX_NAME_CHARS = 250  # MLflow's MAX_ENTITY_KEY_LENGTH for metric and parameter names
_REFUSED = re.compile(r"[^A-Za-z0-9_\-. /:]")  # mlflow.utils.validation, ASCII letters only


def mlflow_name(name: str) -> str:
    """A metric or parameter name MLflow accepts: characters other than letters, digits and
    ``_ - . / space :`` become ``_``; empty, ``.`` and ``..`` path segments (names must not
    resolve to other paths, ``mlflow.utils.validation.path_not_unique``) become ``_``; names
    over 250 characters are cut and end in a hash of the whole name."""
    fixed = "/".join(p if p not in ("", ".", "..") else "_" for p in _REFUSED.sub("_", name).split("/"))
    if len(fixed) > MAX_NAME_CHARS:
        fixed = fixed[:MAX_NAME_CHARS - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return fixed


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"a.b": "value"}``; lists and dicts inside lists as JSON."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            text = v if isinstance(v, str) else json.dumps(v, default=str)
            out[key] = text[:MAX_PARAM_CHARS]
    return out


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an ``http(s)`` tracking server that does not answer: MLflow's client would
    retry each request with backoff for minutes before failing mid-run. Any HTTP answer (even
    404 from a proxy without ``/health``) counts as reachable.

    Raises:
        ConfigError: no connection within ``timeout_s`` seconds.
    """
    if urlparse(uri).scheme not in ("http", "https"):
        return
    import requests  # an MLflow dependency

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except requests.RequestException as exc:
        raise ConfigError(f"loggers: mlflow.tracking_uri={uri!r} does not answer "
                          f"({type(exc).__name__}); start the server, fix the URI, or drop "
                          "tracking_uri for a local store in the run directory") from exc


class MLflowLogger(Logger):
    """Logs metrics and the config to an MLflow run.

    Args:
        run_dir: the run directory (the default local store lives there).
        run: the ``run:`` section (name and tags).
        config: the resolved config (secrets redacted), logged as parameters.
        tracking_uri: MLflow tracking URI; ``None``: ``MLFLOW_TRACKING_URI`` or
            ``sqlite:///<run_dir>/mlflow.db``.
        experiment: experiment name (created if missing).
        run_name: MLflow run name (default ``run.name``).

    Raises:
        ConfigError: ``mlflow`` is not installed; on first use, a ``tracking_uri`` MLflow cannot
            use or an ``http(s)`` server that does not answer (:func:`check_reachable`).
    """

    def __init__(self, run_dir: str | Path, run: Any = None, config: Optional[dict] = None,
                 tracking_uri: Optional[str] = None, experiment: str = "llmforge",
                 run_name: Optional[str] = None) -> None:
        super().__init__()
        import_sdk("mlflow", "mlflow", "mlflow")
        self.run_dir = Path(run_dir)
        self.tracking_uri = (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                             or f"sqlite:///{self.run_dir.resolve() / 'mlflow.db'}")
        self.experiment_name = experiment
        self.run_name, _, self.tags = run_identity(run, run_name, None, None)
        self.names = MetricNames("mlflow", mlflow_name)
        self._client: Any = None
        self._run_id: Optional[str] = None
        self._params: dict[str, str] = {}

    @property
    def name(self) -> str:
        return "mlflow"

    @property
    def version(self) -> str:
        return self._run_id or ""

    @property
    def run_id(self) -> Optional[str]:
        return self._run_id

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``MlflowClient``, with the run started (or resumed) on first use."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self.run_dir.mkdir(parents=True, exist_ok=True)
            check_reachable(self.tracking_uri)
            try:
                client = MlflowClient(tracking_uri=self.tracking_uri)
                found = client.get_experiment_by_name(self.experiment_name)
            except Exception as exc:  # MlflowException: unknown scheme, unreadable store, ...
                raise ConfigError(f"loggers: mlflow.tracking_uri={self.tracking_uri!r} cannot be "
                                  f"used ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                                  "fix it, or drop it for a local store in the run directory") from exc
            exp_id = found.experiment_id if found is not None else client.create_experiment(
                self.experiment_name, artifact_location=str((self.run_dir / "mlartifacts").resolve()))
            id_file = self.run_dir / "mlflow_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else None
            if run_id:
                client.update_run(run_id, status="RUNNING")
            else:
                tags = {mlflow_name(f"tag.{t}"): "1" for t in self.tags}
                with redacted_argv():
                    run_id = client.create_run(exp_id, run_name=self.run_name, tags=tags).info.run_id
                id_file.write_text(run_id + "\n")
                self._log_params(client, run_id)
            self._client, self._run_id = client, run_id
        return self._client

    def _log_params(self, client: Any, run_id: str) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in self.names(self._params).items()]
        for i in range(0, len(items), 100):  # MLflow's log_batch limit is 100 params
            client.log_batch(run_id, params=items[i:i + 100])

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The config as parameters, written with the first record (building writes nothing)."""
        self._params = flatten(dict(params))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        values = self.names(numeric_metrics(metrics))
        if not values:
            return
        client = self.experiment
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step or 0)) for k, v in values.items()]
        for i in range(0, len(batch), 1000):  # MLflow's log_batch limit is 1000 metrics
            client.log_batch(self._run_id, metrics=batch[i:i + 1000])

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id, "FINISHED" if status == "success" else "FAILED")
