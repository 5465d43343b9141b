"""Name -> object registries for models, algorithms, callbacks and loggers.

YAML names either a registered name (``llama3``, ``compile``, ``jsonl``) or an import path
(``my_lab.models.build_model`` or ``my_lab.models:build_model``). Built-ins and user code are
equal: research code registers with the decorators below, and installed packages may register
through the entry-point groups ``llmforge.models``, ``llmforge.algorithms``,
``llmforge.callbacks``, ``llmforge.loggers`` and ``llmforge.backends`` (launch backends,
:mod:`llmforge.runs.backend`).

Example::

    from llmforge.registry import models

    @models.register("my_llama")
    def build(cfg):  # cfg: the model: section; returns an nn.Module
        ...
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from typing import Any, Callable, Dict, Iterable

from llmforge.errors import ConfigError


def _cwd_on_path() -> None:
    """Research code is imported from the working directory too (as ``python -m`` would)."""
    import os
    import sys

    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def import_object(path: str, *, key: str = "") -> Any:
    """Import ``pkg.module.attr`` or ``pkg.module:attr`` (from PYTHONPATH or the working directory).

    Raises:
        ConfigError: the module or the attribute does not exist (names ``key`` and ``path``).
    """
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    where = f"{key}: " if key else ""
    if not module_name or not attr:
        raise ConfigError(f"{where}'{path}' is not an import path; write 'package.module.Name'")
    _cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}cannot import module '{module_name}' for '{path}': {exc}. "
            "Check the spelling, that the package is installed, or add its folder to PYTHONPATH."
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{where}module '{module_name}' has no attribute '{attr}'") from None


def import_modules(names: Iterable[str]) -> None:
    """Import research modules named in the YAML's ``imports:`` list so that they register."""
    _cwd_on_path()
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"imports: cannot import '{name}': {exc}. Add its folder to PYTHONPATH "
                "or install the package."
            ) from exc


class Registry:
    """A name -> object table for one kind of component (models, algorithms, ...)."""

    def __init__(self, kind: str, builtins: str = "") -> None:
        self.kind = kind
        self.builtins = builtins  # module that registers the built-ins, imported on first use
        self._items: Dict[str, Any] = {}
        self._entry_points_loaded = False

    def register(self, name: str, obj: Any = None) -> Callable[[Any], Any] | Any:
        """Register ``obj`` under ``name``; usable as ``@registry.register("name")``."""

        def deco(o: Any) -> Any:
            self._items[name] = o
            return o

        return deco(obj) if obj is not None else deco

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        if self.builtins:
            importlib.import_module(self.builtins)
        for ep in importlib.metadata.entry_points(group=f"llmforge.{self.kind}"):
            self._items.setdefault(ep.name, ep)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._items)

    def get(self, name: str, *, key: str = "") -> Any:
        """Return the object registered as ``name``, or import it when ``name`` is a path.

        Raises:
            ConfigError: unknown name; the message lists the closest registered names.
        """
        self._load_entry_points()
        if name in self._items:
            obj = self._items[name]
            if isinstance(obj, importlib.metadata.EntryPoint):
                obj = self._items[name] = obj.load()
            return obj
        if "." in name or ":" in name:
            return import_object(name, key=key)
        close = difflib.get_close_matches(name, self._items, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        where = f"{key}: " if key else ""
        raise ConfigError(
            f"{where}unknown {self.kind[:-1] if self.kind.endswith('s') else self.kind} "
            f"'{name}'.{hint} Known: {', '.join(self.names()) or 'none'}; "
            "or give an import path such as 'my_pkg.module.Name'."
        )


models = Registry("models", "llmforge.models")
algorithms = Registry("algorithms", "llmforge.algorithms")
callbacks = Registry("callbacks", "llmforge.callbacks")
loggers = Registry("loggers", "llmforge.loggers")
backends = Registry("backends", "llmforge.runs.backend")
