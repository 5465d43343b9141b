"""``key=value`` overrides: parsing (values read as YAML, as in a file) and applying them to a
structured config, with list indices, unknown-key suggestions and type checks. A secret-looking
key's value is never echoed in a message.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmforge.config.keycheck import _check, _fields, _kind, _omega_message, _schema_type, _unknown, _unwrap
from llmforge.config.redaction import is_secret_key, redact_argv
from llmforge.config.yaml_files import _Loader, _yaml_error
from llmforge.errors import ConfigError


def _parse_override(item: str) -> tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(
            f"override {item!r} must have the form key=value (e.g. trainer.max_steps=5)"
        )
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: bad key {key!r}; expected key=value (e.g. trainer.max_steps=5)")
    if raw.strip() == "":
        return key, ""
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, f"the value of override {item!r}") from None
    if isinstance(value, dict) and len(value) == 1 and str(next(iter(value))).startswith("${"):
        # '${oc.env:' ends in a colon, which YAML reads as a mapping's key: it is an interpolation
        # left open, which OmegaConf then names as such
        value = raw.strip()
    return key, value


def _apply_override(cfg: DictConfig, item: str) -> None:
    key, value = _parse_override(item)
    secret = any(is_secret_key(p) for p in key.split("."))
    # never echo a secret: a secret key's value, nor a signed URL's query or a header mapping
    source = f"override '{key}=***'" if secret else f"override '{redact_argv([item])[0]}'"
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        here, parent = ".".join(parts[: i + 1]), ".".join(parts[:i])
        if isinstance(node, ListConfig):
            if not re.fullmatch(r"-?\d+", part):
                raise ConfigError(f"{source}: '{parent}' is a list; address its items by index, e.g. '{parent}.0'")
            k: Any = int(part)
            if not 0 <= k < len(node):
                raise ConfigError(
                    f"{source}: index {k} of '{here}' is out of range; list '{parent}' has length {len(node)}"
                )
        elif isinstance(node, DictConfig):
            k = part
            dc = OmegaConf.get_type(node)
            if dataclasses.is_dataclass(dc) and k not in _fields(dc):
                raise _unknown(here, source, dc, parent)
        else:
            raise ConfigError(f"{source}: '{parent}' is {_kind(node)}, not a section; cannot set '{key}'")
        exists = isinstance(node, ListConfig) or k in node
        try:
            if i == len(parts) - 1:
                if _unwrap(_schema_type(parts))[0] is str and isinstance(value, (bool, int, float)):
                    value = item.split("=", 1)[1].strip()  # run.name=1e3 is the text '1e3'
                value = _check(value, _schema_type(parts), key, source)
                current = node._get_node(k) if exists else None
                if isinstance(value, dict) and isinstance(current, DictConfig) and not current._is_none():
                    current.merge_with(value)
                else:
                    node[k] = value
                return
            if not exists or node._get_node(k)._is_none():
                node[k] = {}
            node = node[k]
        except ConfigError:
            raise
        except OmegaConfBaseException as exc:
            if isinstance(value, str) and "${" in value and value.count("{") > value.count("}"):
                # OmegaConf's grammar lists the tokens it expected; say what is missing instead
                raise ConfigError(f"{source}: cannot set '{here}': its value opens an interpolation "
                                  "'${' that it does not close; end it with '}' (e.g. ${oc.env:NAME})") from None
            raise ConfigError(f"{source}: cannot set '{here}': {_omega_message(exc)}") from None

