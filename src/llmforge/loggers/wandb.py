"""Weights & Biases: a thin Lightning ``Logger`` over the ``wandb`` SDK (``pip install 'llmforge[wandb]'``).

YAML::

    loggers:
      - name: wandb
        project: my-project        # entity, name, group, tags, mode, init_timeout: see below
        mode: offline              # online (needs WANDB_API_KEY in the environment) or offline

Files go to ``<run_dir>/wandb/`` (offline runs: ``wandb sync <run_dir>/wandb/offline-run-*``).
A resumed run continues the same W&B run (its id is kept in ``<run_dir>/wandb/llmforge-resume.json``,
started again with ``resume="allow"``) and skips the steps W&B already has, so each step shows
once (:mod:`llmforge.loggers._resume`).
Online, the adapter first checks that the server answers at all (``connect_timeout``), then
starts the run (``init_timeout``); when either fails (unreachable, timed out, key refused) the
run continues offline with one :class:`~llmforge.loggers._common.TrackerOfflineWarning`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from llmforge.loggers._common import (check_mode, import_sdk, numeric_metrics, require_api_key,
                                      redacted_argv, run_identity, say, unreachable, warn_offline)
from llmforge.loggers._resume import TrackerState


class WandbLogger(Logger):
    """Logs metrics, the resolved config and text samples to a W&B run.

    Args:
        run_dir: the run directory; W&B writes under ``<run_dir>/wandb``.
        run: the ``run:`` section (name, group and tags are taken from it unless given here).
        config: the resolved config (secrets redacted), logged as the run's config.
        project: W&B project.
        entity: W&B team or user; ``None`` = the key's default entity.
        name, group, tags: override ``run.name``, ``run.group``, ``run.tags``.
        mode: ``online`` or ``offline``.
        init_timeout: seconds to wait for the server to start the run (online) before falling
            back to offline.
        connect_timeout: seconds to wait for any answer of the server (``WANDB_BASE_URL`` or
            W&B's default) before trying to start an online run; no answer = offline.
        notes: a description shown by W&B.
        api_key: refused; the key comes from ``WANDB_API_KEY`` only.

    Raises:
        ConfigError: ``wandb`` not installed, a bad ``mode``, or ``mode: online`` without
            ``WANDB_API_KEY`` (all at build time, before training).
    """

    def __init__(self, run_dir: str | Path, run: Any = None, config: Optional[dict] = None,
                 project: str = "llmforge", entity: Optional[str] = None, name: Optional[str] = None,
                 group: Optional[str] = None, tags: Optional[list] = None, mode: str = "online",
                 init_timeout: float = 30.0, connect_timeout: float = 10.0,
                 notes: Optional[str] = None, api_key: Any = None) -> None:
        super().__init__()
        self.mode = check_mode(mode, "wandb")
        require_api_key("WANDB_API_KEY", "wandb", self.mode, api_key)
        self._wandb = import_sdk("wandb", "wandb", "wandb")
        self.dir = Path(run_dir)
        self.project, self.entity, self.notes = project, entity, notes
        self.run_name, self.group, self.tags = run_identity(run, name, group, tags)
        self.init_timeout, self.connect_timeout = float(init_timeout), float(connect_timeout)
        self._config: dict = dict(config or {})
        self._run: Any = None
        self._state = TrackerState(self.dir / "wandb")
        self.fell_back = False

    # ----------------------------------------------------------------- identity
    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> str:
        return self._run.id if self._run is not None else ""

    @property
    def save_dir(self) -> str:
        return str(self.dir)

    # ------------------------------------------------------------------- the run
    def _init(self, mode: str) -> Any:
        wandb = self._wandb
        settings = wandb.Settings(init_timeout=self.init_timeout, console="off", quiet=True,
                                  silent=True, x_disable_stats=True)
        resume = dict(id=self._state.id, resume="allow") if self._state.id else {}
        with redacted_argv():  # W&B records the command line as the run's args
            return wandb.init(project=self.project, entity=self.entity, name=self.run_name,
                              group=self.group, tags=self.tags or None, notes=self.notes,
                              config=self._config, dir=str(self.dir), mode=mode, settings=settings,
                              **resume)

    @staticmethod
    def _no_analytics() -> None:
        """Offline means no network: turn off the SDK's own usage analytics (recent wandb sends
        them with OpenTelemetry even for offline runs, and waits about 10 s per exporter at exit
        for a server that does not answer). A private API of wandb (0.31); ignored where it
        does not exist."""
        try:
            from wandb.analytics.opentelemetry import opentelemetry_proxy

            opentelemetry_proxy.disable()
        except Exception:
            pass

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``wandb.Run``, started on first use (rank zero only)."""
        if self._run is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._state.load()  # a resumed run: the same W&B run, continued
            reason = None
            if self.mode == "online":
                base_url = self._wandb.setup().settings.base_url  # env and settings files applied
                reason = unreachable(base_url, self.connect_timeout)
            if reason is None:
                try:
                    self._run = self._init(self.mode)
                except Exception as exc:  # CommError, timeouts, auth errors: never kill the run
                    if self.mode != "online":
                        raise
                    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if reason is not None or self.mode == "offline":
                self._no_analytics()
            if reason is not None:
                self.fell_back = True
                self._run = self._init("offline")
                where = Path(self._run.dir).parent
                warn_offline("wandb", reason, f"{where}; upload later with `wandb sync {where}`")
            if self.mode == "offline":
                say(f"wandb: offline run in {Path(self._run.dir).parent} "
                    f"(upload with `wandb sync {Path(self._run.dir).parent}`)")
        return self._run

    # ------------------------------------------------------------------- logging
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Store the config; it is sent when the run starts (or now, if it has started)."""
        params = dict(params) if not isinstance(params, dict) else params
        self._config.update(params)
        if self._run is not None:
            self._run.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Send one record, unless W&B has this step already (a resumed run logs again)."""
        run = self.experiment
        if not self._state.is_new(step):
            return
        run.log(numeric_metrics(metrics), step=step)
        self._state.save(run.id, step)

    @rank_zero_only
    def log_text(self, key: str, columns: list[str], data: list[list[Any]],
                 step: Optional[int] = None) -> None:
        """Log rows of text as a W&B table (same signature as Lightning's ``WandbLogger``)."""
        run = self.experiment
        if not self._state.is_new(step):
            return
        table = self._wandb.Table(columns=list(columns), data=[list(r) for r in data])
        run.log({key: table}, step=step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Finish the run (exit code 0 on success, 1 otherwise); safe to call twice."""
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None
