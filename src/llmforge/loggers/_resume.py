"""What a tracker needs to continue its own run when a training run resumes.

A resumed run logs again the steps after its checkpoint. Each tracker then shows every step
once through its SDK's own mechanism: TensorBoard's ``purge_step`` (events at or after the first
step logged again are hidden), W&B's run id with ``resume="allow"`` and Comet's
``ExistingExperiment``/``ExistingOfflineExperiment``. W&B and Comet keep what they received
first (W&B drops a step lower than its last one), so the adapters skip the steps already sent:
:class:`TrackerState` keeps the tracker's run id and the last step it was sent in
``<folder>/llmforge-resume.json`` (no secret: an id and a number).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional


class TrackerState:
    """The run id and the last step sent to one tracker, in ``<folder>/llmforge-resume.json``.

    Read when the tracker starts (after the run directory is prepared: ``--overwrite`` has
    deleted an old one by then), written after every record.
    """

    FILE = "llmforge-resume.json"

    def __init__(self, folder: str | Path) -> None:
        self.file = Path(folder) / self.FILE
        self.id: Optional[str] = None
        self.last_step: Optional[int] = None  # the last step sent, by this attempt or an earlier one
        self.sent_before: Optional[int] = None  # the last step an earlier attempt sent

    def load(self) -> "TrackerState":
        """Read the file if there is one; a damaged file counts as none (a new tracker run)."""
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
            self.id = str(data["id"]) if data.get("id") else None
            self.last_step = int(data["step"]) if data.get("step") is not None else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            self.id, self.last_step = None, None
        self.sent_before = self.last_step
        return self

    def is_new(self, step: Optional[int]) -> bool:
        """Whether an earlier attempt did not send ``step`` (steps without a number are new;
        several records of one step in this attempt all are)."""
        return step is None or self.sent_before is None or step > self.sent_before

    def save(self, run_id: str, step: Optional[int]) -> None:
        """Remember ``run_id`` and ``step`` (written to a temporary file, then renamed)."""
        if step is not None:
            self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.id = run_id
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": run_id, "step": self.last_step}), encoding="utf-8")
        os.replace(tmp, self.file)
