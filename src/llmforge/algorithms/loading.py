"""Build the YAML's ``algorithms:`` list, check it as a whole, and describe what is available.

``algorithms: [{name: compile, ...}, {name: my_lab.algos.Trick, ...}]``: each ``name`` is a
built-in (``compile``, ``activation_checkpointing``, ``float8``, ``lora``), a name registered in
:data:`llmforge.registry.algorithms` (also through the ``llmforge.algorithms`` entry-point
group of installed packages) or an import path; the other keys are the class's keyword
arguments.
"""

from __future__ import annotations

import difflib
import inspect
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from llmforge import registry
from llmforge.errors import ConfigError
from llmforge.events import Event
from llmforge.parallel.mesh import ParallelDims
from llmforge.plugin import Algorithm, CheckContext
from llmforge.registry import build_entries


def build_algorithms(cfg: Any, run: Optional[Any] = None) -> list[Algorithm]:
    """Instantiate ``cfg.algorithms`` and run :func:`check_algorithms` (nothing is allocated).

    Args:
        cfg: the config (the resolved one, ``run.cfg``, when ``run`` is given).
        run: the :class:`~llmforge.preflight.resolve.ResolvedRun` the checks see; default
            :func:`unresolved_run` (tests, the planner's candidates).

    Raises:
        ConfigError: unknown name or key, a class that is not an :class:`Algorithm`, or an
            impossible combination (see :func:`check_algorithms`).
    """
    algos = build_entries(registry.algorithms, "algorithms", cfg.algorithms, base=Algorithm)
    check_algorithms(cfg, algos, run)
    return algos


def unresolved_run(cfg: Any) -> Any:
    """What :class:`~llmforge.plugin.CheckContext` needs of a run, from a config that was not
    resolved (``trainer.devices x num_nodes`` processes, ``auto`` = ``fsdp2`` with several of
    them, no batch plan): :func:`llmforge.preflight.resolve.resolve_run` sits above this
    floor."""
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    name = str(cfg.strategy.name)
    strategy = ("fsdp2" if world > 1 else "auto") if name == "auto" else name
    return SimpleNamespace(cfg=cfg, world_size=world, dims=ParallelDims.from_config(cfg, world), plan=None,
                           strategy=strategy)


def entry_label(cfg: Any, index: int) -> str:
    return f"algorithms[{index}] ({cfg.algorithms[index]['name']})"


def check_listed_once(cfg: Any, algos: Sequence[Any]) -> None:
    """Every entry is an :class:`Algorithm` and none is listed twice (unless its class sets
    ``allow_multiple = True``): two entries of one algorithm would apply it twice, or the
    second's keys silently.

    Raises:
        ConfigError: naming the entries (``algorithms[i] (name)``).
    """
    seen: dict[type, int] = {}
    for i, algo in enumerate(algos):
        if not isinstance(algo, Algorithm):
            raise ConfigError(f"{entry_label(cfg, i)}: {type(algo).__name__} is not an "
                              "llmforge.algorithms.Algorithm (subclass it; plain callbacks go "
                              "under callbacks:)")
        cls = type(algo)
        if cls in seen and not getattr(cls, "allow_multiple", False):
            raise ConfigError(f"{entry_label(cfg, seen[cls])} and {entry_label(cfg, i)} are the "
                              f"same algorithm; list it once with all its keys")
        seen[cls] = i


def check_algorithms(cfg: Any, algos: Sequence[Any], run: Optional[Any] = None) -> None:
    """Every entry is an :class:`Algorithm`, none is listed twice (unless its class sets
    ``allow_multiple = True``) nor has a misspelled event method (:func:`misspelled_events`),
    then each algorithm's own :meth:`Algorithm.check` with one :class:`CheckContext` (``run``,
    default :func:`unresolved_run`; the meta model is built once for all of them).

    Raises:
        ConfigError: naming the entries (``algorithms[i] (name)``) or keys involved.
    """
    check_listed_once(cfg, algos)
    for i, algo in enumerate(algos):
        misspelled_events(cfg, i, type(algo))
    ctx = CheckContext(run if run is not None else unresolved_run(cfg), list(algos))
    for algo in algos:
        if len(inspect.signature(algo.check).parameters) >= 2:
            algo.check(ctx.cfg, ctx.algorithms)  # the signature before the resolved run (issue 22)
        else:
            algo.check(ctx)


def misspelled_events(cfg: Any, index: int, cls: type) -> None:
    """Refuse a method whose name is close to an event's but is none (``after_los``): it would
    never be called, silently.

    Raises:
        ConfigError: naming the entry, the method and the event it resembles.
    """

    events = [e.value for e in Event]
    known = set(events) | set(dir(Algorithm))
    own = {n for klass in cls.__mro__ if klass not in Algorithm.__mro__ for n in vars(klass)}
    for name in sorted(own - known):
        close = difflib.get_close_matches(name, events, n=1, cutoff=0.85)
        if close and not name.startswith("_") and callable(getattr(cls, name, None)):
            raise ConfigError(f"{entry_label(cfg, index)}: method {cls.__name__}.{name} is not an "
                              f"event and would never be called; did you mean {close[0]}? (events: "
                              "llmforge.events.Event)")


def pipeline_order(cfg: Any, algos: Sequence[Algorithm], strategy: Sequence[Any]) -> list[str]:
    """Names of the model transforms in the order they run (algorithms and strategy)."""
    transforms = [t for t in (a.transform() for a in algos) if t is not None] + list(strategy)
    return [t.name for t in sorted(transforms, key=lambda t: t.sort_key())]


def available() -> list[tuple[str, str, str]]:
    """``(name, stage, summary)`` of every registered algorithm (entry points loaded)."""
    rows = []
    for name in registry.algorithms.names():
        try:
            obj = registry.algorithms.get(name)
        except Exception as exc:  # a broken third-party entry point must not hide the others
            rows.append((name, "?", f"cannot load: {exc}"))
            continue
        stage = getattr(obj, "stage", None)
        summary = getattr(obj, "summary", None) or (obj.__doc__ or "").strip().split("\n")[0]
        rows.append((name, stage.name.lower() if stage is not None else "events", summary))
    return rows
