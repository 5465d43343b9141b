"""Metric loggers: thin adapters with one stable set of metric names.

A logger entry in YAML is ``{name: NAME, **kwargs}``; the registered builder is called as
``builder(run_dir, **kwargs)`` and returns a Lightning ``Logger``.
"""

from llmforge.loggers.jsonl import JsonlLogger, read_metrics
from llmforge.registry import loggers

loggers.register("jsonl", JsonlLogger)

__all__ = ["JsonlLogger", "read_metrics"]
