"""A rich progress bar: step, loss, learning rate, tokens/s, elapsed time and ETA.

On a terminal it draws a live bar; elsewhere (CI logs, files) it prints one line per logged
step instead. Evaluation results are always printed as a line.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch.callbacks.progress import ProgressBar
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def format_record(record: dict[str, Any]) -> str:
    """``step 10 | loss 5.1234 | lr 3.00e-04 | 12,345 tok/s`` from a logged record."""
    parts = [f"step {record.get('step', '?')}"]
    if "train/loss" in record:
        parts.append(f"loss {record['train/loss']:.4f}")
    if "train/lr" in record:
        parts.append(f"lr {record['train/lr']:.2e}")
    if "throughput/tokens_per_second" in record:
        parts.append(f"{record['throughput/tokens_per_second']:,.0f} tok/s")
    if "eval/loss" in record:
        parts.append(f"eval/loss {record['eval/loss']:.4f} (ppl {record['eval/perplexity']:.1f})")
    return " | ".join(parts)


class RichProgress(ProgressBar):
    """A progress bar drawn with rich (one bar for the optimizer steps), on llmforge's events.

    It is a Lightning ``ProgressBar`` only so that Lightning, told ``enable_progress_bar``,
    adds no bar of its own; it overrides none of Lightning's hooks.
    """

    def __init__(self, console: Optional[Console] = None) -> None:
        super().__init__()
        self._enabled = True
        self._console = console
        self._progress: Optional[Progress] = None
        self._task: Any = None
        self._printed = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def _live(self) -> bool:
        return self._progress is not None and self._progress.console.is_terminal

    def fit_start(self, state: Any) -> None:
        trainer, pl_module = state.trainer, state.module
        if not (self._enabled and trainer.is_global_zero):
            return
        console = self._console or Console(file=sys.stderr)
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), TextColumn("eta"),
            TimeRemainingColumn(), console=console, disable=not console.is_terminal)
        self._task = self._progress.add_task("train", total=trainer.max_steps,
                                             completed=trainer.global_step, metrics="")
        self._progress.start()
        self._print_new(pl_module)

    def _print_new(self, pl_module: Any) -> None:
        assert self._progress is not None
        for record in pl_module.history[self._printed:]:
            if not self._live() or any(k.startswith("eval/") for k in record):
                self._progress.console.print(format_record(record), highlight=False, soft_wrap=True)
        self._printed = len(pl_module.history)

    def step_recorded(self, state: Any) -> None:
        """Event ``STEP_RECORDED``: print the new records, move the bar to this step."""
        if self._progress is None:
            return
        self._print_new(state.module)
        self._update(state.module, state.step)

    def _update(self, pl_module: Any, step: int) -> None:
        assert self._progress is not None
        last = next((r for r in reversed(pl_module.history) if "train/loss" in r), {})
        summary = format_record({k: v for k, v in last.items() if not k.startswith("eval/")})
        self._progress.update(self._task, completed=step,
                              metrics=summary.split(" | ", 1)[-1] if "|" in summary else "")

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def fit_end(self, state: Any) -> None:
        if self._progress is not None:
            self._print_new(state.module)  # e.g. a record eval_harness wrote at the end
            self._update(state.module, state.trainer.global_step)
        self._stop()

    def fit_exception(self, state: Any) -> None:
        self._stop()
