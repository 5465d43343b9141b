"""Components named in YAML (callbacks, loggers, algorithms, ``trainer.module``): imported,
checked against the base class their section needs, and built with the arguments they accept."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from llmforge import registry
from llmforge.errors import ConfigError

__all__ = ["accepted", "build_entries", "build_callbacks", "module_class"]


def accepted(factory: Any, inject: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``inject`` that ``factory``'s signature accepts (all of them when it takes
    ``**kwargs``): llmforge's loggers get ``run_dir``/``run``/``config``, Lightning's own (e.g.
    ``lightning.pytorch.loggers.MLFlowLogger``) only what they declare."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: inject nothing
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(inject)
    return {k: v for k, v in inject.items() if k in params}


def build_entries(reg: registry.Registry, section: str, entries: Any, *, base: Any = None,
                  **inject: Any) -> list[Any]:
    """Instantiate ``[{name: ..., **kwargs}]`` entries from a registry; ``inject`` (e.g. the run
    directory) goes to the factories whose signature accepts it (:func:`accepted`), and the
    entry's own keys win over it.

    An import path must name a class (a subclass of ``base`` when given), checked before it is
    called: ``{name: os.system, command: ...}`` must not run anything; it gets plain dicts and
    lists (e.g. Lightning's ``Timer(duration={seconds: 30})``), not OmegaConf nodes.

    Raises:
        ConfigError: unknown name, an import path that is not such a class, or keyword
            arguments the class does not accept.
    """
    out = []
    for i, entry in enumerate(entries):
        kwargs = dict(entry)
        name = kwargs.pop("name")
        key = f"{section}[{i}]"
        factory = reg.get(name, key=f"{key}.name")
        registered = name in reg.names()
        if not registered and not isinstance(factory, type):
            raise ConfigError(f"{key}.name: '{name}' is a {type(factory).__name__}, not a class; "
                              f"name a class (e.g. 'my_pkg.module.MyClass')")
        if base is not None and isinstance(factory, type) and not issubclass(factory, base):
            raise ConfigError(f"{key} ({name}): {factory.__name__} is not a subclass of "
                              f"{base.__module__}.{base.__name__}; subclass it")
        if not registered:  # a class by import path (Lightning's Timer) checks for dict, not DictConfig
            kwargs = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                      for k, v in kwargs.items()}
        try:
            out.append(factory(**{**accepted(factory, inject), **kwargs}))
        except TypeError as exc:
            raise ConfigError(f"{key} ({name}): {exc}; check the keys of this entry") from exc
    return out


def build_callbacks(cfg: DictConfig) -> list[Any]:
    """``callbacks:`` instantiated (registered names or import paths to Lightning ``Callback``
    subclasses); what the Trainer adds to its own and what ``llmforge launch`` checks before
    submitting (:mod:`llmforge.runs.checks`).

    Raises:
        ConfigError: see :func:`build_entries` (not a class, not a Callback, a wrong keyword).
    """
    return build_entries(registry.callbacks, "callbacks", cfg.callbacks or [], base=Callback)


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
