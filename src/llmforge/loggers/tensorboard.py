"""TensorBoard: a thin Lightning ``Logger`` over ``torch.utils.tensorboard.SummaryWriter``
(``pip install 'llmforge[tensorboard]'``).

YAML::

    loggers:
      - name: tensorboard          # event files in <run_dir>/tensorboard
        dir: tensorboard           # optional: a folder inside the run directory

View with ``tensorboard --logdir runs/`` (one run per run directory). Scalars are stored as
float32 (TensorBoard's format); the resolved config is a text entry ``config`` at the first
step logged, and text samples (``generate_samples``) appear under the Text tab.

Each attempt's event file starts with TensorBoard's restart marker (what ``purge_step``
writes) at its first logged step: after a resume, the values an earlier attempt wrote at or
after that step are hidden, so each step shows once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from llmforge.errors import ConfigError
from llmforge.loggers._common import import_sdk, numeric_metrics


def _markdown_table(columns: list[str], data: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files into the run directory.

    Args:
        run_dir: the run directory.
        run, config: the ``run:`` section and the resolved config (secrets redacted); the config
            is written as the text entry ``config``.
        dir: folder for the event files, relative to ``run_dir`` (must stay inside it).
        flush_secs: seconds between flushes of pending events to disk.

    Raises:
        ConfigError: ``tensorboard`` not installed, or ``dir`` outside the run directory.
    """

    def __init__(self, run_dir: str | Path, run: Any = None, config: Optional[dict] = None,
                 dir: str = "tensorboard", flush_secs: int = 10) -> None:
        super().__init__()
        import_sdk("tensorboard", "tensorboard", "tensorboard")
        if Path(dir).is_absolute() or ".." in Path(dir).parts:
            raise ConfigError(f"loggers: tensorboard: dir must be a folder inside the run "
                              f"directory (e.g. 'tensorboard'); got {dir!r}")
        self.dir = Path(run_dir) / dir
        self.flush_secs = int(flush_secs)
        self._writer: Any = None
        self._first_step: Optional[int] = None  # the step of the first record, once there is one
        self._config_text: Optional[str] = None

    @property
    def name(self) -> str:
        return "tensorboard"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.dir)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``SummaryWriter``, created on first use (rank zero only; Lightning asks for it
        when fit starts, before any step is known)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.dir), flush_secs=self.flush_secs)
        return self._writer

    def _at(self, step: Optional[int]) -> Any:
        """The writer, for a record at ``step``. The first record of every attempt first writes
        what ``SummaryWriter(purge_step=step)`` writes: a ``SessionLog.START`` event at
        ``step``, on which TensorBoard hides an earlier attempt's events at or after ``step``.
        (The writer exists before the step is known, so its ``purge_step`` cannot be used; and
        TensorBoard's server reader takes the first START of a run as its beginning, not a
        restart, so a fresh run writes one too.)"""
        writer = self.experiment
        if self._first_step is None:
            self._first_step = step or 0
            if step is not None:
                from tensorboard.compat.proto.event_pb2 import Event, SessionLog

                writer.file_writer.add_event(
                    Event(step=step, session_log=SessionLog(status=SessionLog.START)))
            if self._config_text is not None:
                writer.add_text("config", self._config_text, self._first_step)
                self._config_text = None
        return writer

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The config as YAML in a text entry (indented: Markdown shows it as code), written with
        the first record, at its step (building a logger writes nothing)."""
        import yaml

        text = yaml.safe_dump(dict(params), sort_keys=False, allow_unicode=True)
        self._config_text = "\n".join("    " + line for line in text.splitlines())
        if self._first_step is not None:
            self.experiment.add_text("config", self._config_text, self._first_step)
            self._config_text = None

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        writer = self._at(step)
        for k, v in numeric_metrics(metrics).items():
            writer.add_scalar(k, v, global_step=step)

    @rank_zero_only
    def log_text(self, key: str, columns: list[str], data: list[list[Any]],
                 step: Optional[int] = None) -> None:
        """Rows of text as one Markdown table under ``key`` (TensorBoard's Text tab)."""
        self._at(step).add_text(key, _markdown_table(list(columns), data), global_step=step)

    @rank_zero_only
    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
