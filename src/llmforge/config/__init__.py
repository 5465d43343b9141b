"""Run configuration: the typed schema, the YAML loader and the checks.

``load_config(path, overrides)`` returns a resolved structured :class:`TrainConfig`;
``validate(cfg, world_size)`` checks it and returns the :class:`BatchPlan`.
"""

from llmforge.config.loader import load_config, save_config, structured_config
from llmforge.config.redaction import config_to_dict, redact
from llmforge.config.schema import TrainConfig
from llmforge.config.validate import BatchPlan, data_parallel_size, plan_batch, validate

__all__ = [
    "TrainConfig",
    "load_config",
    "save_config",
    "structured_config",
    "redact",
    "config_to_dict",
    "validate",
    "plan_batch",
    "BatchPlan",
    "data_parallel_size",
]
