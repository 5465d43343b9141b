"""llmforge: a composable, YAML-driven trainer for Llama-3 models on Lightning.

Public API::

    from llmforge import Trainer, LLMModule, load_config, registry

Names are imported on first use (PEP 562), so ``llmforge --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Trainer": "llmforge.training.trainer",
    "LLMModule": "llmforge.training.module",
    "TrainConfig": "llmforge.config.schema",
    "load_config": "llmforge.config.loader",
    "registry": "llmforge.registry",
}

__all__ = ["LLMModule", "TrainConfig", "Trainer", "__version__", "load_config", "registry"]


def __dir__() -> list[str]:
    """The module's names and the lazily imported public ones (``dir(llmforge)`` lists
    ``Trainer``)."""
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = module if name == "registry" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llmforge' has no attribute {name!r}")
