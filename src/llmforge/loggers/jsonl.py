"""``metrics.jsonl``: one JSON object per logged optimizer step, appended and flushed per line.

Each line has ``step`` (optimizer steps done; 0 = before training) and the metrics of that step
under their stable names (``train/loss``, ``train/lr``, ``eval/loss``, ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # NaN/inf are not JSON
    return v


class JsonlLogger(Logger):
    """A Lightning logger that appends metrics to ``<run_dir>/<filename>``.

    ``run`` and ``config`` (passed to every logger builder) are not used: the resolved config is
    already in ``config.yaml`` beside the metrics.
    """

    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl", run: Any = None,
                 config: Optional[dict] = None) -> None:
        super().__init__()
        self.path = Path(run_dir) / filename
        self._file: Optional[Any] = None

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The resolved config is already in ``config.yaml`` beside the metrics."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read every record of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
