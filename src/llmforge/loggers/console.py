"""Console: one line per logged record, e.g. ``step 10 | train/loss 5.1234 | train/lr 0.0003``.

YAML::

    loggers:
      - name: console
        keys: [train/loss, eval/loss]   # optional: only these metrics (default: all)
        stream: stdout                  # or stderr
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, TextIO

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from llmforge.errors import ConfigError


def format_value(v: Any) -> str:
    """Integers as they are, floats with 5 significant digits (``0.00030000`` -> ``0.0003``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.5g}"


class ConsoleLogger(Logger):
    """Prints each record as ``step N | name value | ...`` (rank zero only).

    Args:
        run_dir, run, config: given to every logger; not used.
        keys: metric names to print (in this order); ``None`` = every metric of the record.
        stream: ``stdout`` or ``stderr``.

    Raises:
        ConfigError: an unknown ``stream``.
    """

    def __init__(self, run_dir: str | Path | None = None, run: Any = None,
                 config: Optional[dict] = None, keys: Optional[list[str]] = None,
                 stream: str = "stdout") -> None:
        super().__init__()
        if stream not in ("stdout", "stderr"):
            raise ConfigError(f"loggers: console: stream must be stdout or stderr; got {stream!r}")
        self.keys = list(keys) if keys is not None else None
        self.stream = stream

    @property
    def name(self) -> str:
        return "console"

    @property
    def version(self) -> str:
        return ""

    def _out(self) -> TextIO:
        return sys.stdout if self.stream == "stdout" else sys.stderr

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the config is in ``<run_dir>/config.yaml``."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        names = [k for k in self.keys if k in metrics] if self.keys is not None else list(metrics)
        if not names:
            return
        parts = [f"step {step}"] + [f"{k} {format_value(metrics[k])}" for k in names]
        print(" | ".join(parts), file=self._out(), flush=True)

    @rank_zero_only
    def log_text(self, key: str, columns: list[str], data: list[list[Any]],
                 step: Optional[int] = None) -> None:
        """Each row as ``step N | key | col: value | ...``."""
        for row in data:
            cells = " | ".join(f"{c}: {v!r}" for c, v in zip(columns, row))
            print(f"step {step} | {key} | {cells}", file=self._out(), flush=True)
