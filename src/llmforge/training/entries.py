"""``trainer.module``: the LightningModule class a YAML names, imported and checked. (Callbacks,
loggers and algorithms are built by :func:`llmforge.registry.build_entries`.)"""

from __future__ import annotations

import lightning as L
from omegaconf import DictConfig

from llmforge import registry
from llmforge.errors import ConfigError

__all__ = ["module_class"]

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
