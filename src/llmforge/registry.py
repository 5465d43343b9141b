"""Name -> object registries for models, algorithms, callbacks and loggers.

YAML names either a registered name (``llama3``, ``compile``, ``jsonl``) or an import path
(``my_lab.models.build_model`` or ``my_lab.models:build_model``). Built-ins and user code are
equal: research code registers with the decorators below, and installed packages may register
through the entry-point groups ``llmforge.models``, ``llmforge.algorithms``,
``llmforge.callbacks``, ``llmforge.loggers`` and ``llmforge.backends`` (launch backends,
:mod:`llmforge.runs.backend`).

Import paths are found on ``sys.path`` as Python finds them (``PYTHONPATH``; ``python -m
llmforge`` also puts the working directory first, the ``llmforge`` script does not); llmforge
adds nothing to it. Inside :func:`untrusted` (loading a run directory someone else wrote) no
import path and no ``imports:`` module is imported at all: only registered names and
installed entry points resolve.

Example::

    from llmforge.registry import models

    @models.register("my_llama")
    def build(cfg):  # cfg: the model: section; returns an nn.Module
        ...
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import importlib
import importlib.metadata
from typing import Any, Callable, Dict, Iterable, Iterator, Optional

from omegaconf import OmegaConf

from llmforge.errors import ConfigError

# the file whose names are being resolved when it is untrusted (a run directory's config.yaml)
_UNTRUSTED: contextvars.ContextVar[str] = contextvars.ContextVar("llmforge_untrusted", default="")


@contextlib.contextmanager
def untrusted(source: str, trust_code: bool = False) -> Iterator[None]:
    """Inside the block, names read from ``source`` (e.g. ``runs/x/config.yaml``) resolve only
    to registered names and entry points: :func:`import_object` and :func:`import_modules`
    refuse before importing anything. ``trust_code=True`` (``--trust-code``) makes the block
    a no-op. Used by :mod:`llmforge.checkpoint.run_dir` for ``generate``, ``eval`` and
    ``convert``."""
    token = _UNTRUSTED.set("" if trust_code else str(source))
    try:
        yield
    finally:
        _UNTRUSTED.reset(token)


def refuse_untrusted(key: str, what: str) -> None:
    """Raise when an untrusted source names code (see :func:`untrusted`); else nothing.

    Raises:
        ConfigError: naming the source, ``key``, ``what`` it names and ``--trust-code``.
    """
    source = _UNTRUSTED.get()
    if source:
        raise ConfigError(
            f"{source}: {key} names {what!r}, code that is neither built in nor a registered name; "
            "a run directory is data, so loading it imports none of its own code. If you trust "
            "this run, put its code on PYTHONPATH and pass --trust-code")


def import_object(path: str, *, key: str = "", check: Optional[Callable[[Any], str]] = None) -> Any:
    """Import ``pkg.module.attr`` or ``pkg.module:attr`` from ``sys.path`` (``PYTHONPATH``).

    ``check(obj)`` returns "" when ``obj`` is of the kind the caller needs, else what it is
    instead (e.g. "a builtin_function_or_method, not a class"); it runs before the caller
    calls anything.

    Raises:
        ConfigError: the module or the attribute does not exist, ``check`` refuses the object,
            or the config is untrusted (:func:`untrusted`); names ``key`` and ``path``.
    """
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    where = f"{key}: " if key else ""
    if not module_name or not attr:
        raise ConfigError(f"{where}'{path}' is not an import path; write 'package.module.Name'")
    refuse_untrusted(key or "an entry", path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}cannot import module '{module_name}' for '{path}': {exc}. "
            "Check the spelling, that the package is installed, or add its folder to PYTHONPATH."
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{where}module '{module_name}' has no attribute '{attr}'") from None
    wrong = check(obj) if check is not None else ""
    if wrong:
        raise ConfigError(f"{where}'{path}' is {wrong}")
    return obj


def import_modules(names: Iterable[str]) -> None:
    """Import research modules named in the YAML's ``imports:`` list so that they register.

    Raises:
        ConfigError: a module does not import, or the config is untrusted (:func:`untrusted`).
    """
    names = list(names)
    if names:
        refuse_untrusted("imports", names[0] if len(names) == 1 else ", ".join(names))
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
        # what an import path must name (set by the built-ins module: it knows the base class)
        self.check: Optional[Callable[[Any], str]] = None

    def expect(self, check: Callable[[Any], str]) -> None:
        """Objects named by import path must pass ``check`` (``obj -> ""`` when of the right
        kind, else what it is instead) before anyone calls them."""
        self.check = check

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

    def matching(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """The registered objects (entry points loaded) for which ``predicate`` is true, in name
        order; an entry point that fails to load is skipped (a broken third-party package is not
        ours to raise)."""
        out = []
        for n in self.names():
            try:
                obj = self.get(n)
            except Exception:  # noqa: BLE001 - see the docstring
                continue
            if predicate(obj):
                out.append(obj)
        return out

    def get(self, name: str, *, key: str = "", registered_only: bool = False) -> Any:
        """Return the object registered as ``name``, or import it when ``name`` is a path
        (checked by :meth:`expect`'s function before it is returned). ``registered_only``: the
        name comes from data (a run record), so an import path is refused, not imported.

        Raises:
            ConfigError: unknown name (the message lists the closest registered names), an
                import path to an object of the wrong kind, or one refused as untrusted.
        """
        self._load_entry_points()
        if name in self._items:
            obj = self._items[name]
            if isinstance(obj, importlib.metadata.EntryPoint):
                obj = self._items[name] = obj.load()
            return obj
        if ("." in name or ":" in name) and not registered_only:
            return import_object(name, key=key, check=self.check)
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


def build_entries(reg: Registry, section: str, entries: Any, *, base: Any = None,
                  **inject: Any) -> list[Any]:
    """Instantiate ``[{name: ..., **kwargs}]`` entries from a registry; ``inject`` (e.g. the run
    directory) goes to the factories whose signature accepts it (:func:`accepted`), and the
    entry's own keys win over it.

    An import path must name a class (a subclass of ``base`` when given), checked before it is
    called: ``{name: os.system, command: ...}`` must not run anything; it gets plain dicts and
    lists (e.g. Lightning's ``Timer(duration={seconds: 30})``), not OmegaConf nodes.

    Raises:
        ConfigError: unknown name, an import path that is not such a class, keyword
            arguments the class does not accept, or a package it needs that is not installed
            (an ``ImportError`` from building it; its ``__cause__``).
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
        except ImportError as exc:  # Lightning's WandbLogger without wandb: bad input, exit 2
            raise ConfigError(f"{key} ({name}) needs a package that is not installed: {exc}") from exc
    return out
