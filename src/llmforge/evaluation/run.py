"""``llmforge eval``: lm-evaluation-harness tasks on a finished run or a checkpoint.

Scores are written to the run directory: one line ``{"step", "checkpoint", "tasks",
"scores", "results", "time"}`` appended to ``eval_harness.jsonl``, and one record ``{"step",
"eval/harness/<task>/<metric>": value, ...}`` appended to ``metrics.jsonl`` (what the ``jsonl``
logger writes and ``llmforge runs plot`` reads). Trackers (W&B, Comet, TensorBoard) receive the
same keys when the ``eval_harness`` callback runs the tasks during training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from llmforge.checkpoint.dcp import read_json
from llmforge.checkpoint.run_dir import confine_run_files, load_for_inference, resolve_checkpoint
from llmforge.evaluation.harness import evaluate_harness, import_lm_eval
from llmforge.generate import use_inference_threads
from llmforge.loggers.jsonl import JsonlLogger
from llmforge.run_guard import refuse_file_link

PREFIX = "eval/harness/"


def evaluate_run(path: str | Path, tasks: Sequence[str], *, include_path: Sequence[str] = (),
                 limit: Optional[int | float] = None, num_fewshot: Optional[int] = None,
                 batch_size: int = 8, max_gen_toks: int = 256, seed: int = 0,
                 device: str = "cpu", trust_code: bool = False) -> dict[str, Any]:
    """Evaluate the newest complete checkpoint of a run directory (or the given checkpoint); on
    the CPU with the compute threads :func:`llmforge.generate.use_inference_threads` chooses.

    Returns ``{"scores": {"<task>/<metric>": value}, "step", "path"}`` (``path``: the
    ``eval_harness.jsonl`` written to).

    ``trust_code``: import the research code the run's config names (``--trust-code``; see
    :mod:`llmforge.checkpoint.run_dir`).

    Raises:
        ConfigError: lm-eval missing, unknown tasks, bad task data (see
            :func:`llmforge.evaluation.harness.evaluate_harness`); the run's config names code
            and ``trust_code`` is False; ``eval_harness.jsonl`` or ``metrics.jsonl`` in the
            run directory is a symbolic link or not a file (a shared run must not make eval
            append to a file elsewhere).
        LLMForgeError: the path is not a run directory or checkpoint.
    """
    import_lm_eval()  # say which extra is missing before loading weights
    tasks = [t.strip() for t in tasks if t and t.strip()]
    run_dir, ckpt = resolve_checkpoint(path)
    if not trust_code:  # before meta.json is read
        confine_run_files(path, run_dir, ckpt)
    for name in ("eval_harness.jsonl", "metrics.jsonl"):  # appended to: never through a link
        refuse_file_link(run_dir / name)
    if device == "cpu":  # training's thread rule (a busy machine's cores are not all free)
        use_inference_threads()
    step = int(read_json(ckpt, "meta.json").get("step", 0))
    model, tokenizer, _ = load_for_inference(ckpt, device=device, trust_code=trust_code)
    out = evaluate_harness(model, tokenizer, tasks, include_path=include_path, limit=limit,
                           num_fewshot=num_fewshot, batch_size=batch_size,
                           max_gen_toks=max_gen_toks, seed=seed)
    line = {"step": step, "checkpoint": str(ckpt), "tasks": list(tasks), "scores": out["scores"],
            "results": out["results"], "time": time.time()}
    target = run_dir / "eval_harness.jsonl"
    with open(target, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, default=str) + "\n")
    metrics = JsonlLogger(run_dir)  # the run's metrics.jsonl, as training writes it
    metrics.log_metrics({PREFIX + k: v for k, v in out["scores"].items()}, step=step)
    metrics.finalize("success")
    return {"scores": out["scores"], "step": step, "path": target}
