"""A research logger: every metric as a ``step,name,value`` row of ``<run_dir>/metrics.csv``.

Named in YAML by its import path (see ``examples/custom_callback.yaml``)::

    loggers:
      - name: jsonl
      - name: examples.csv_logger.CsvLogger
        filename: metrics.csv

A logger is a Lightning ``Logger``; llmforge calls it as ``CsvLogger(run_dir=..., run=...,
config=..., **yaml_kwargs)``, then ``log_hyperparams(config)`` once and ``log_metrics(record,
step)`` once per logged optimizer step (metric names: train/loss, eval/loss, ...).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only


class CsvLogger(Logger):
    """Appends ``step,name,value`` rows (long format: new metrics need no new columns)."""

    def __init__(self, run_dir: str | Path, run: Any = None, config: Optional[dict] = None,
                 filename: str = "metrics.csv") -> None:
        super().__init__()
        self.path = Path(run_dir) / filename
        self.run_name = getattr(run, "name", None)

    @property
    def name(self) -> str:
        return "csv"

    @property
    def version(self) -> str:
        return self.run_name or ""

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the resolved config is already in <run_dir>/config.yaml

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "name", "value"])
            for k, v in metrics.items():
                w.writerow([step, k, v])
