"""Comet: a thin Lightning ``Logger`` over the ``comet_ml`` SDK (``pip install 'llmforge[comet]'``).

YAML::

    loggers:
      - name: comet
        project: my-project        # workspace, name, tags, mode, connect_timeout: see below
        mode: offline              # online (needs COMET_API_KEY in the environment) or offline

Offline experiments are written by comet_ml's own ``OfflineExperiment`` (Lightning's
``CometLogger(online=False)`` writes nothing, a known Lightning bug) as a zip archive in
``<run_dir>/comet/`` when the run ends; upload it with ``comet upload <zip>``.

A resumed run continues the same experiment (``ExistingExperiment`` online,
``ExistingOfflineExperiment`` offline; its key is kept in ``<run_dir>/comet/llmforge-resume.json``)
and skips the steps already sent, so each step shows once (:mod:`llmforge.loggers._resume`).

Parameters are sent flat, as Comet's schema wants them (a number, string, boolean or null per
name): nested sections become ``trainer|max_steps``, a list of sections ``loggers|0|name``, and
a list of plain values one JSON string (``optimizer|betas`` = ``"[0.9, 0.95]"``).

Online, the adapter first asks the server for its version with a ``connect_timeout`` (comet_ml
itself retries for 20-30 s when the server is unreachable and then logs nothing); when the
server does not answer, or the experiment does not come alive, the run continues offline with
one :class:`~llmforge.loggers._common.TrackerOfflineWarning`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from llmforge.loggers._common import (check_mode, import_sdk, numeric_metrics, require_api_key,
                                      redacted_argv, run_identity, say, unreachable, warn_offline)
from llmforge.loggers._resume import TrackerState

# comet_ml must not capture stdout, hook into torch or upload code, git state or the environment.
_QUIET = dict(log_code=False, log_graph=False, auto_param_logging=False, auto_metric_logging=False,
              auto_output_logging=False, log_env_details=False, log_git_metadata=False,
              log_git_patch=False, log_env_gpu=False, log_env_host=False, log_env_cpu=False,
              log_env_network=False, log_env_disk=False, parse_args=False, auto_log_co2=False,
              display_summary_level=0)


def _accepted(cls: Any) -> dict[str, Any]:
    """The :data:`_QUIET` settings ``cls`` takes (``ExistingOfflineExperiment`` has no
    ``**kwargs`` and lacks a few of them)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(_QUIET)
    return {k: v for k, v in _QUIET.items() if k in params}


def server_url() -> str:
    """The URL comet_ml answers its version on (``COMET_URL_OVERRIDE`` or comet.com)."""
    try:
        from comet_ml.config import get_backend_address

        return get_backend_address().rstrip("/") + "/isAlive/ver"
    except Exception:  # an SDK whose config API moved
        return "https://www.comet.com/clientlib/isAlive/ver"


def comet_parameters(params: Any, prefix: str = "") -> dict[str, Any]:
    """``params`` flattened to ``{name: number | string | bool | None}`` (Comet's parameter
    schema): mappings and lists of mappings by ``|``-joined keys, other lists as JSON text."""
    import json

    out: dict[str, Any] = {}
    items = params.items() if isinstance(params, dict) else enumerate(params)
    for key, value in items:
        name = f"{prefix}|{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(comet_parameters(value, name))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value):
            out.update(comet_parameters(list(value), name))
        elif isinstance(value, (dict, list, tuple)):
            out[name] = json.dumps(value, default=str)
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


class CometLogger(Logger):
    """Logs metrics, the resolved config and text samples to a Comet experiment.

    Args:
        run_dir: the run directory; offline archives go to ``<run_dir>/comet``.
        run: the ``run:`` section (name and tags are taken from it unless given here; the run
            group becomes the ``group`` "other" value).
        config: the resolved config (secrets redacted), logged as parameters (nested keys are
            joined with ``|`` by Comet).
        project: Comet project name.
        workspace: Comet workspace; ``None`` = the key's default.
        name, tags: override ``run.name`` and ``run.tags``.
        mode: ``online`` or ``offline``.
        connect_timeout: seconds to wait for the server (online) before going offline.
        api_key: refused; the key comes from ``COMET_API_KEY`` only.

    Raises:
        ConfigError: ``comet_ml`` not installed, a bad ``mode``, or ``mode: online`` without
            ``COMET_API_KEY`` (all at build time, before training).
    """

    def __init__(self, run_dir: str | Path, run: Any = None, config: Optional[dict] = None,
                 project: str = "llmforge", workspace: Optional[str] = None,
                 name: Optional[str] = None, tags: Optional[list] = None, mode: str = "online",
                 connect_timeout: float = 10.0, api_key: Any = None) -> None:
        super().__init__()
        self.mode = check_mode(mode, "comet")
        require_api_key("COMET_API_KEY", "comet", self.mode, api_key)
        # comet_ml must not patch torch for automatic logging (it would log twice, and it warns
        # when imported after torch): llmforge logs every metric explicitly.
        # Nor send its own error reports to Sentry from a training job (set it to true to allow).
        os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
        os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")
        self._comet = import_sdk("comet_ml", "comet", "comet")
        self.dir = Path(run_dir) / "comet"
        self.project, self.workspace = project, workspace
        self.run_name, self.group, self.tags = run_identity(run, name, None, tags)
        self.connect_timeout = float(connect_timeout)
        self._config: dict = dict(config or {})
        self._exp: Any = None
        self._state = TrackerState(self.dir)
        self.fell_back = False

    @property
    def name(self) -> str:
        return "comet"

    @property
    def version(self) -> str:
        return self._exp.get_key() if self._exp is not None else ""

    @property
    def save_dir(self) -> str:
        return str(self.dir)

    def _offline(self) -> Any:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._state.id:  # a resumed run: the same experiment, continued
            cls = self._comet.ExistingOfflineExperiment
            return cls(experiment_key=self._state.id, project_name=self.project,
                       workspace=self.workspace, offline_directory=str(self.dir), **_accepted(cls))
        return self._comet.OfflineExperiment(project_name=self.project, workspace=self.workspace,
                                             offline_directory=str(self.dir), **_QUIET)

    def _online(self) -> Any:
        key = os.environ["COMET_API_KEY"]
        reason = unreachable(server_url(), self.connect_timeout)
        if reason is None:
            if self._state.id:
                exp = self._comet.ExistingExperiment(api_key=key, experiment_key=self._state.id,
                                                     **_QUIET)
            else:
                exp = self._comet.Experiment(api_key=key, project_name=self.project,
                                             workspace=self.workspace, **_QUIET)
            if exp.alive:
                return exp
            exp.end()
            reason = "the experiment did not start"
        self.fell_back = True
        exp = self._offline()
        warn_offline("comet", reason, f"{self.dir} (upload the zip with `comet upload`)")
        return exp

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The comet_ml experiment, started on first use (rank zero only)."""
        if self._exp is None:
            self._state.load()
            with redacted_argv():  # Comet records the command line with the experiment
                self._exp = self._online() if self.mode == "online" else self._offline()
            if self.mode == "offline":
                say(f"comet: offline experiment; archive in {self.dir} when the run ends")
            if self.run_name:
                self._exp.set_name(self.run_name)
            if self.tags:
                self._exp.add_tags(self.tags)
            if self.group:
                self._exp.log_other("group", self.group)
            if self._config:
                self._exp.log_parameters(comet_parameters(self._config))
        return self._exp

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Store the config; it is sent when the experiment starts (or now, if it has)."""
        params = dict(params)
        self._config.update(params)
        if self._exp is not None:
            self._exp.log_parameters(comet_parameters(params))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Send one record, unless Comet has this step already (a resumed run logs again)."""
        exp = self.experiment
        if not self._state.is_new(step):
            return
        exp.log_metrics(numeric_metrics(metrics), step=step)
        self._state.save(exp.get_key(), step)

    @rank_zero_only
    def log_text(self, key: str, columns: list[str], data: list[list[Any]],
                 step: Optional[int] = None) -> None:
        """One Comet text sample per row: the last column is the text, the others metadata."""
        exp = self.experiment
        if not self._state.is_new(step):
            return
        for row in data:
            meta = {"key": key, **{c: v for c, v in zip(columns[:-1], row[:-1])}}
            exp.log_text(str(row[-1]), step=step, metadata=meta)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """End the experiment (offline: writes the zip archive); safe to call twice."""
        if self._exp is not None:
            self._exp.end()
            self._exp = None
