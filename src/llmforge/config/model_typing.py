"""Typing the ``model:`` section by family: which family a config names (overrides, then the
last file; interpolations resolved; ``imports:`` loaded first so research families register),
and the :class:`~llmforge.config.schema.TrainConfig` variant whose ``model`` field is that
family's dataclass, so its keys are checked like every other.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmforge import registry
from llmforge.config.keycheck import _fields, _is_interp
from llmforge.config.overrides import _parse_override
from llmforge.config.schema import TrainConfig, model_config_class

@functools.lru_cache(maxsize=None)
def _root_for(model_cls: type) -> type:
    """``TrainConfig`` whose ``model`` field has the family's dataclass (for the key checks)."""
    if model_cls is _fields(TrainConfig)["model"]:
        return TrainConfig
    return dataclasses.make_dataclass(
        f"TrainConfig_{model_cls.__name__}",
        [("model", model_cls, dataclasses.field(default_factory=model_cls))], bases=(TrainConfig,))


def _last_set(chain: list, overrides: Sequence[str], key: str, section: str = "") -> Any:
    """The value of ``section.key`` (or top-level ``key``) that wins: overrides, then the last file."""
    full = f"{section}.{key}" if section else key
    for item in reversed(list(overrides)):
        if isinstance(item, str) and item.split("=", 1)[0].strip() == full:
            return _parse_override(item)[1]
    for _, data in reversed(chain):
        node = data.get(section) if section else data
        if isinstance(node, dict) and key in node:
            return node[key]
    return None


def _model_class(chain: list, overrides: Sequence[str]) -> type:
    """The ``model:`` dataclass of the family that ``model.name`` names (research modules of
    ``imports:`` are imported first, so names they register are found).

    Raises:
        ConfigError: ``model.name`` names no registered model and no importable factory.
    """
    name = _last_set(chain, overrides, "name", "model")
    if _is_interp(name):
        try:  # e.g. name: ${variables.model}
            plain = OmegaConf.merge(*[OmegaConf.create(d) for _, d in chain])
            for item in overrides:
                k, v = _parse_override(item)
                OmegaConf.update(plain, k, v, force_add=True)
            name = OmegaConf.select(plain, "model.name")
        except OmegaConfBaseException:
            name = None
    if not isinstance(name, str) or not name:
        name = "llama3"
    imports = _last_set(chain, overrides, "imports")
    if name != "llama3" and isinstance(imports, list):
        registry.import_modules([str(m) for m in imports])
    return model_config_class(name)
