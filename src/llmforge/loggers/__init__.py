"""Metric loggers: thin adapters with one stable set of metric names.

A logger entry in YAML is ``{name: NAME_OR_IMPORT_PATH, **kwargs}``; the registered builder is
called as ``builder(run_dir=Path, run=<cfg.run redacted>, config=<resolved config, secrets redacted>,
**kwargs)`` and returns a Lightning ``Logger``; the trainer then calls ``log_hyperparams(config)``.

Built in: ``jsonl`` (``metrics.jsonl``), ``console``, ``tensorboard``, ``wandb``, ``comet``,
``mlflow``. Lightning's own loggers work too, named by import path
(``lightning.pytorch.loggers.CSVLogger``): a builder gets only the keyword arguments its
signature accepts.
The tracker SDKs are optional extras, imported only when their logger is built. Loggers that
also have ``log_text(key, columns, data, step)`` receive text samples (``generate_samples``).
"""

from llmforge.loggers._common import TrackerOfflineWarning
from llmforge.loggers.comet import CometLogger
from llmforge.loggers.console import ConsoleLogger
from llmforge.loggers.jsonl import JsonlLogger, read_metrics
from llmforge.loggers.mlflow import MLflowLogger
from llmforge.loggers.tensorboard import TensorBoardLogger
from llmforge.loggers.wandb import WandbLogger
from llmforge.registry import loggers

loggers.register("jsonl", JsonlLogger)
loggers.register("console", ConsoleLogger)
loggers.register("tensorboard", TensorBoardLogger)
loggers.register("wandb", WandbLogger)
loggers.register("comet", CometLogger)
loggers.register("mlflow", MLflowLogger)

__all__ = ["CometLogger", "ConsoleLogger", "JsonlLogger", "MLflowLogger", "TensorBoardLogger",
           "TrackerOfflineWarning", "WandbLogger", "read_metrics"]
