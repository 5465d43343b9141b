"""``trainer.module``: the LightningModule class a YAML names, imported and checked; ``callbacks:``
built (loggers and algorithms are built by :func:`llmforge.registry.build_entries` too)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from llmforge import registry
from llmforge.errors import ConfigError

__all__ = ["build_callbacks", "module_class"]


def build_callbacks(cfg: DictConfig) -> list[Any]:
    """``callbacks:`` instantiated (registered names or import paths to Lightning ``Callback``
    subclasses); what the Trainer adds to its own and what ``llmforge launch`` checks before
    submitting (:mod:`llmforge.runs.checks`).

    Raises:
        ConfigError: see :func:`llmforge.registry.build_entries` (not a class, not a Callback, a
            wrong keyword).
    """
    return registry.build_entries(registry.callbacks, "callbacks", cfg.callbacks or [], base=Callback)


def module_class(cfg: DictConfig) -> type:
    """The class named by ``trainer.module``, imported (research code may be in ``imports:``).

    Raises:
        ConfigError: the path does not import, or names something that is not a
            ``lightning.LightningModule`` subclass (e.g. a function or a module).
    """
    path = cfg.trainer.module
    obj = registry.import_object(path, key="trainer.module")
    if not (isinstance(obj, type) and issubclass(obj, L.LightningModule)):
        what = f"a {type(obj).__name__}" if not isinstance(obj, type) else "a class that is not a LightningModule"
        raise ConfigError(f"trainer.module: '{path}' is {what}; name an LLMModule subclass, e.g. "
                          "trainer.module=llmforge.training.module.LLMModule")
    return obj
