"""``eval_harness``: lm-evaluation-harness tasks every N optimizer steps during training.

YAML::

    callbacks:
      - name: eval_harness
        tasks: [hellaswag]     # lm-eval task names (or tasks defined in include_path)
        every: 1000            # optimizer steps; also when training ends
        limit: 200             # documents per task (null = all)
        num_fewshot: null
        include_path: []       # folders of task YAMLs (local data)
        batch_size: 8

Scores go into that step's record as ``eval/harness/<task>/<metric>`` (every logger: jsonl,
W&B, Comet, TensorBoard, console) and as a line in ``<run_dir>/eval_harness.jsonl``. Every rank
runs the same requests, so a model sharded by FSDP2 or tensor parallelism evaluates in
lockstep; the cost is the tasks' forward passes (no backward), paid every ``every`` steps.
Needs the ``eval`` extra (``lm_eval``); a missing package or an unknown task is a
configuration error at start, before any training step.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from llmforge.callbacks._util import run_dir, say
from llmforge.errors import ConfigError
from llmforge.evaluation.harness import evaluate_harness, import_lm_eval, parse_limit, task_manager


def _limit_ok(limit: Any) -> bool:
    try:
        parse_limit(limit)
    except ValueError:
        return False
    return True


class EvalHarness(Callback):
    """Runs lm-eval ``tasks`` on the training model every ``every`` steps and at the end.

    Args:
        tasks: lm-eval task names (at least one).
        every: optimizer steps between evaluations (>= 1).
        limit: documents per task (an int), a share (float < 1) or ``None`` for all.
        num_fewshot: few-shot examples (``None``: the task's default).
        include_path: folders of extra task YAMLs.
        batch_size: sequences per forward pass.
        max_gen_toks: cap on generated tokens for generation tasks.

    Raises:
        ConfigError: no tasks, ``every`` < 1, ``lm_eval`` not installed or an unknown task
            (checked when training starts).
    """

    def __init__(self, tasks: list[str], every: int = 1000, limit: Optional[float] = None,
                 num_fewshot: Optional[int] = None, include_path: Optional[list[str]] = None,
                 batch_size: int = 8, max_gen_toks: int = 256) -> None:
        tasks = [tasks] if isinstance(tasks, str) else list(tasks or [])
        if not tasks:
            raise ConfigError("callbacks: eval_harness: give at least one task in tasks: [...]")
        for key, value, ok in [
                ("every", every, isinstance(every, int) and not isinstance(every, bool) and every >= 1),
                ("batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1),
                ("max_gen_toks", max_gen_toks, isinstance(max_gen_toks, int) and max_gen_toks >= 1),
                ("num_fewshot", num_fewshot, num_fewshot is None or (isinstance(num_fewshot, int)
                                                                    and num_fewshot >= 0)),
                ("limit", limit, _limit_ok(limit))]:
            if not ok:
                raise ConfigError(f"callbacks: eval_harness: {key}={value!r} is not valid (every, "
                                  "batch_size, max_gen_toks: integers >= 1; num_fewshot: an integer "
                                  ">= 0; limit: a whole count or a share in (0, 1))")
        self.tasks, self.every = [str(t) for t in tasks], int(every)
        self.limit = parse_limit(limit)
        self.num_fewshot, self.include_path = num_fewshot, list(include_path or [])
        self.batch_size, self.max_gen_toks = int(batch_size), int(max_gen_toks)
        self._last_step: Optional[int] = None
        self.history: list[dict[str, Any]] = []

    def fit_start(self, state: Any) -> None:
        import_lm_eval()
        try:
            task_manager(self.tasks, self.include_path)  # indexed once, reused at each evaluation
        except ConfigError as e:
            raise ConfigError(f"callbacks: eval_harness: {e}") from e

    def evaluate(self, trainer: Any, pl_module: Any) -> dict[str, float]:
        """Run the tasks now on ``pl_module.model``; returns ``{"eval/harness/<task>/<metric>": v}``
        and adds them to ``pl_module.step_metrics``."""
        step = trainer.global_step
        if self._last_step == step:
            return {}
        self._last_step = step
        start = time.perf_counter()
        out = evaluate_harness(pl_module.model, trainer.datamodule.tokenizer, self.tasks,
                               include_path=self.include_path, limit=self.limit,
                               num_fewshot=self.num_fewshot, batch_size=self.batch_size,
                               max_gen_toks=self.max_gen_toks)
        seconds = time.perf_counter() - start
        metrics = {f"eval/harness/{k}": v for k, v in out["scores"].items()}
        pl_module.step_metrics.update(metrics)
        self.history.append({"step": step, **metrics})
        if trainer.is_global_zero:
            with open(run_dir(trainer) / "eval_harness.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "tasks": self.tasks, "scores": out["scores"],
                                    "results": out["results"], "seconds": seconds},
                                   default=str) + "\n")
        say(trainer, f"eval_harness: step {step}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in sorted(out["scores"].items())) + f" ({seconds:.1f} s)")
        return metrics

    def after_optimizer_step(self, state: Any) -> None:
        if state.step % self.every == 0:
            self.evaluate(state.trainer, state.module)

    def fit_end(self, state: Any) -> None:
        trainer, pl_module = state.trainer, state.module
        metrics = self.evaluate(trainer, pl_module)
        if metrics:  # after the last record was written: log these on their own
            pl_module.log_record(trainer.global_step, metrics)
