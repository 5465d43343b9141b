"""Callbacks, loggers, evaluation, checkpointing and the run's identity of an LLM Foundry YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmforge.config.foundry.context import Clock, Conversion, parse_time

_SDK_LOGGERS = {"wandb": "wandb", "comet_ml": "comet", "mlflow": "mlflow", "tensorboard": "tensorboard"}
# Foundry logger kwargs -> llmforge logger kwargs
# (composer.loggers: WandBLogger, CometMLLogger, MLFlowLogger, TensorboardLogger; wandb's
# init_kwargs and comet's exp_kwargs are read as if they were top-level kwargs)
_LOGGER_KEYS = {"wandb": {"project": "project", "entity": "entity", "name": "name", "group": "group",
                          "tags": "tags", "mode": "mode", "notes": "notes"},
                "comet_ml": {"project_name": "project", "workspace": "workspace", "name": "name",
                             "tags": "tags", "online": None},
                "mlflow": {"experiment_name": "experiment", "tracking_uri": "tracking_uri",
                           "run_name": "run_name"},
                "tensorboard": {}}


def convert_callbacks(c: Conversion, clock: Clock) -> None:
    """``callbacks:`` (a mapping of name -> kwargs)."""
    callbacks = c.peek("callbacks") or {}
    if not isinstance(callbacks, dict):
        c.drop("callbacks", "expected LLM Foundry's mapping of callback name -> kwargs", "callbacks:")
        return
    for name, kwargs in callbacks.items():
        key, kwargs = f"callbacks.{name}", dict(kwargs or {})
        out = c.out.setdefault("callbacks", [])
        if name == "speed_monitor":
            entry = {"name": "speed_monitor"}
            flops = kwargs.pop("gpu_flops_available", None)
            if flops:
                entry["peak_tflops"] = float(flops) / 1e12
            out.append(entry)
            c.used.add(key)
            note = ("throughput is averaged over trainer.log_every steps, not window_size batches"
                    if kwargs else "")
            (c.changed if note else c.mapped).append((key, f"callbacks: {entry}", note))
        elif name in ("lr_monitor", "memory_monitor"):
            out.append({"name": name})
            c.mapped.append((key, f"callbacks: {{name: {name}}}", ""))
            c.used.add(key)
        elif name == "runtime_estimator":
            c.drop(key, "no separate estimator callback", "the progress bar's time remaining "
                   "(trainer.progress_bar) and `llmforge runs describe`")
        elif name == "hf_checkpointer":
            interval = kwargs.get("save_interval")
            c.drop(key, "llmforge writes its own sharded checkpoints; HF weights are exported from "
                   "any of them", "`llmforge convert to-hf RUN_DIR OUT [--dtype bfloat16]` after training"
                   + (f" (Foundry saved every {interval})" if interval else ""))
        elif name == "scheduled_gc":
            c.map(key, "trainer.gc_every", int(kwargs.get("batch_interval", 1000)))
        elif name == "optimizer_monitor":
            c.drop(key, "train/grad_norm is logged at every logged step already",
                   "callbacks: [{name: lr_monitor}] for lr; per-layer norms have no built-in")
        elif name == "early_stopper":
            out.append({"name": "early_stopping"})
            c.change(key, "callbacks: [{name: early_stopping}]", "monitors eval/loss with patience 3")
        else:
            c.drop(key, f"no llmforge callback '{name}'", "`callbacks:` names (docs/callbacks.md)")


def convert_loggers(c: Conversion) -> None:
    """``loggers:`` (a mapping of name -> kwargs); llmforge's jsonl metrics file stays on."""
    loggers = c.peek("loggers") or {}
    out = [{"name": "jsonl"}]
    c.set("loggers", out)
    if not isinstance(loggers, dict):
        c.drop("loggers", "expected LLM Foundry's mapping of logger name -> kwargs", "loggers:")
        return
    for name, kwargs in loggers.items():
        key, kwargs = f"loggers.{name}", dict(kwargs or {})
        if name not in _SDK_LOGGERS:
            c.drop(key, f"no llmforge logger '{name}'", "loggers: jsonl, console, tensorboard, wandb, "
                   "comet, mlflow")
            continue
        entry = {"name": _SDK_LOGGERS[name]}
        notes = []
        for nested in ("init_kwargs", "exp_kwargs"):
            kwargs.update(kwargs.pop(nested, None) or {})
        for k, v in kwargs.items():
            dst = _LOGGER_KEYS[name].get(k)
            if name == "comet_ml" and k == "online":
                entry["mode"] = "online" if v else "offline"
            elif name == "tensorboard" and k == "log_dir":
                if v and not Path(str(v)).is_absolute() and ".." not in Path(str(v)).parts:
                    entry["dir"] = v
                else:
                    notes.append(f"log_dir {v} becomes <run_dir>/tensorboard")
            elif dst:
                entry[dst] = v
            else:
                notes.append(f"{k} has no llmforge equivalent")
        out.append(entry)
        c.used.add(key)
        (c.changed if notes else c.mapped).append((key, f"loggers: {entry}", "; ".join(notes)))
    c.set("loggers", out)


def _interval(c: Conversion, clock: Clock, key: str, dst: str, fallback: Any, what: str) -> None:
    """An interval in steps; in epochs without ``--steps-per-epoch``, ``fallback`` (reported)."""
    value = c.take(key)
    if parse_time(value, key)[1] == "ep" and clock.steps_per_epoch is None:
        c.map(key, dst, fallback, f"{value!r} is in epochs, whose length the converter does not know: "
              f"llmforge {what} (pass --steps-per-epoch N to convert it)")
        return
    steps, how = clock.steps(value, key)
    c.map(key, dst, steps, how)


def convert_checkpoints(c: Conversion, clock: Clock) -> None:
    """``save_folder``, ``save_interval``, ``save_num_checkpoints_to_keep``, ``autoresume``,
    ``load_path``; evaluation (``eval_interval``, ``eval_subset_num_batches``, ...)."""
    if c.has("save_folder"):
        folder = str(c.take("save_folder"))
        folder = folder.replace("{run_name}", str(c.out.get("run", {}).get("name", "llmforge")))
        c.map("save_folder", "checkpoint.dir", folder, "llmforge's sharded (DCP) checkpoints, not "
              "Composer's" if "://" not in folder else "object-store checkpoint folders: mount the "
              "bucket or save locally; llmforge writes checkpoints to a filesystem path")
    if c.has("save_interval"):
        _interval(c, clock, "save_interval", "checkpoint.save_every", None, "saves at the end only")
    keep = c.take("save_num_checkpoints_to_keep")
    if keep is not None:
        c.map("save_num_checkpoints_to_keep", "checkpoint.keep_last_n", None if keep < 0 else max(1, keep),
              "" if keep != 0 else "0 keeps none in Composer; llmforge keeps at least the newest")
    if c.take("autoresume", False):
        c.map("autoresume", "checkpoint.resume", "auto")
    elif c.has("autoresume"):
        c.mapped.append(("autoresume", "checkpoint.resume: null", ""))
    if c.has("load_path"):
        c.drop("load_path", "a Composer checkpoint is not readable by llmforge", "convert it to Hugging "
               "Face weights (LLM Foundry's scripts/inference/convert_composer_to_hf.py), then "
               "model.init_from: hf:DIR")
    for key, why, nearest in (
            ("save_overwrite", "llmforge never overwrites a run by a setting", "llmforge train --overwrite"),
            ("save_weights_only", "checkpoints always hold the optimizer (to resume)",
             "llmforge checkpoint consolidate / convert to-hf for weights"),
            ("load_weights_only", "see load_path", "model.init_from"),
            ("load_strict_model_weights", "see load_path", "model.init_from"),
            ("save_filename", "llmforge names checkpoints step-N", "none"),
            ("save_latest_filename", "llmforge names checkpoints step-N", "none")):
        if c.has(key):
            c.drop(key, why, nearest)
    if c.has("eval_interval"):
        _interval(c, clock, "eval_interval", "trainer.eval_every", 0, "evaluates at step 0 and at the end only")
    if c.has("eval_first"):
        c.change("eval_first", "evaluation at step 0", "llmforge always evaluates at step 0 and at the end")
    n = c.take("eval_subset_num_batches")
    if n is not None and n > 0:
        c.map("eval_subset_num_batches", "trainer.eval_batches", int(n))
    elif n is not None:
        c.drop("eval_subset_num_batches", "-1 evaluates the whole set; llmforge evaluates a fixed "
               "number of micro-batches", "trainer.eval_batches")
    if c.has("device_eval_batch_size"):
        c.drop("device_eval_batch_size", "evaluation uses the training micro-batch size",
               "trainer.micro_batch_size")
    if c.has("console_log_interval"):
        steps, how = clock.steps(c.take("console_log_interval"), "console_log_interval")
        c.map("console_log_interval", "trainer.log_every", max(1, steps), how)
    if c.has("progress_bar"):
        c.map("progress_bar", "trainer.progress_bar", bool(c.take("progress_bar")))
    for key in ("log_to_console", "python_log_level", "dist_timeout", "compile_config", "metadata",
                "code_paths", "icl_tasks", "eval_gauntlet", "icl_subset_num_batches",
                "icl_seq_len", "spin_dataloaders", "log_config", "run_name"):
        if c.has(key) and key not in c.used:
            c.drop(key, _MISC.get(key, "no llmforge setting"), _NEAREST.get(key, "none"))


_MISC = {"log_to_console": "metrics go to the loggers and the progress bar",
         "python_log_level": "llmforge prints one line per event", "dist_timeout": "torch's default",
         "compile_config": "compilation is an algorithm", "icl_tasks": "in-context evaluation runs "
         "after training", "eval_gauntlet": "in-context evaluation runs after training",
         "code_paths": "llmforge imports modules named in imports:", "metadata": "free-form"}
_NEAREST = {"log_to_console": "loggers: [{name: console}]", "compile_config": "algorithms: [{name: compile}]",
            "icl_tasks": "llmforge eval RUN --tasks hellaswag,...", "eval_gauntlet": "llmforge eval RUN --tasks ...",
            "code_paths": "imports: [module]", "metadata": "run.tags"}


def convert_identity(c: Conversion) -> None:
    """``run_name``, ``seed`` / ``global_seed``."""
    if c.has("run_name"):
        c.map("run_name", "run.name", str(c.take("run_name")))
    seed = c.take("seed", c.take("global_seed"))
    if seed is not None:
        c.used.update({"seed", "global_seed"})
        c.map("seed" if c.has("seed") else "global_seed", "run.seed", int(seed))
