"""Checking config values against the schema's types: unknown keys (with the closest valid
key), wrong types (with what was expected), empty sections; the key path's schema type for
overrides and interpolations.

:data:`_ROOT` is the schema being loaded (:class:`~llmforge.config.schema.TrainConfig` with
``model`` typed as the family's dataclass, see :mod:`llmforge.config.model_typing`).
Every problem is a :class:`~llmforge.errors.ConfigError` naming the key path and the source.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import typing
from typing import Any, Union

from omegaconf import BooleanNode, FloatNode, IntegerNode, StringNode
from omegaconf.errors import OmegaConfBaseException

from llmforge.config.schema import ModelConfig, TrainConfig
from llmforge.errors import ConfigError

_ROOT: contextvars.ContextVar = contextvars.ContextVar("llmforge_config_root", default=TrainConfig)
"""The schema being loaded: :class:`TrainConfig` with ``model`` typed as the family's config."""


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
_NODES = {int: IntegerNode, float: FloatNode, bool: BooleanNode, str: StringNode}


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list"}.get(type(value), f"{value!r} ({type(value).__name__})")


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(type without Optional, whether None is allowed)."""
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), True
    return tp, False


def _describe(tp: Any) -> str:
    inner, optional = _unwrap(tp)
    origin = typing.get_origin(inner)
    if dataclasses.is_dataclass(inner) or origin in (dict, typing.Dict):
        word = "a mapping"
    elif origin in (list, typing.List):
        word = "a list"
    else:
        word = _TYPE_WORDS.get(inner, getattr(inner, "__name__", str(inner)))
    return f"{word} or null" if optional else word


@functools.lru_cache(maxsize=None)
def _fields(dc: Any) -> dict:
    return typing.get_type_hints(dc)


def _is_interp(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _suggest(full: str, dc: Any, parent: str) -> str:
    siblings = [_join(parent, k) for k in _fields(dc)]
    every = _all_paths(_ROOT.get())
    leaf = full.rsplit(".", 1)[-1]
    hits = (
        [p for p in every if p.rsplit(".", 1)[-1] == leaf]
        or difflib.get_close_matches(full, siblings, n=1, cutoff=0.6)
        or difflib.get_close_matches(full, every, n=1, cutoff=0.6)
    )
    if hits:
        return f"did you mean '{hits[0]}'?"
    where = f"'{parent}'" if parent else "the top level"
    return f"valid keys of {where}: {', '.join(_fields(dc))}"


def _all_paths(dc: Any, prefix: str = "") -> list:
    out = []
    for name, tp in _fields(dc).items():
        out.append(_join(prefix, name))
        inner, _ = _unwrap(tp)
        if dataclasses.is_dataclass(inner):
            out += _all_paths(inner, _join(prefix, name))
    return out


def _unknown(full: str, source: str, dc: Any, parent: str) -> ConfigError:
    if parent == "model" and dc is ModelConfig:  # a bare factory: only the generic keys
        leaf = full.rsplit(".", 1)[-1]
        return ConfigError(
            f"unknown key '{full}' in {source}; model.name is a plain function, whose model: keys "
            f"are only {', '.join(_fields(dc))} (its own arguments go in model.kwargs, e.g. "
            f"model.kwargs.{leaf}); to take shape keys such as model.{leaf} (those of a base: "
            "file like yamls/demo_cpu.yaml), register a ModelSpec whose config_cls has them "
            "(docs/models.md, 'A model in your own package')")
    return ConfigError(f"unknown key '{full}' in {source}; {_suggest(full, dc, parent)}")


def _bad_type(path: str, tp: Any, value: Any, source: str, word: str = "in") -> ConfigError:
    return ConfigError(f"{path}: expected {_describe(tp)}, got {_kind(value)} {word} {source}")


def _check(value: Any, tp: Any, path: str, source: str) -> Any:
    """Check ``value`` against schema type ``tp``; return it with empty sections as ``{}``."""
    inner, optional = _unwrap(tp)
    if value is None:
        if dataclasses.is_dataclass(inner):
            return {}
        if optional or inner is Any:
            return None
        raise _bad_type(path, tp, value, source)
    if inner is Any or _is_interp(value):
        return value
    origin = typing.get_origin(inner)
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            raise _bad_type(path, tp, value, source)
        hints = _fields(inner)
        for key in list(value):
            if key not in hints:
                raise _unknown(_join(path, key), source, inner, path)
            value[key] = _check(value[key], hints[key], _join(path, key), source)
        return value
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            raise _bad_type(path, tp, value, source)
        return value
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise _bad_type(path, tp, value, source)
        (item_tp,) = typing.get_args(inner) or (Any,)
        return [_check(v, item_tp, f"{path}.{i}", source) for i, v in enumerate(value)]
    node = _NODES.get(inner)
    if node is not None:
        if isinstance(value, (dict, list)):
            raise _bad_type(path, tp, value, source)
        try:
            value = node(value)._value()  # the schema's type (e.g. 1 -> 1.0 for a float field)
        except OmegaConfBaseException:
            raise _bad_type(path, tp, value, source) from None
    return value


def _schema_type(parts: list) -> Any:
    """Schema type at a key path, Any where the schema is free-form."""
    tp: Any = _ROOT.get()
    for part in parts:
        inner, _ = _unwrap(tp)
        origin = typing.get_origin(inner)
        if dataclasses.is_dataclass(inner):
            tp = _fields(inner).get(part, Any)
        elif origin in (list, typing.List, dict, typing.Dict):
            args = typing.get_args(inner)
            tp = args[-1] if args else Any
        else:
            return Any
    return tp


def _omega_message(exc: OmegaConfBaseException) -> str:
    msg = getattr(exc, "msg", None) or str(exc)
    return msg.split("\n")[0]
