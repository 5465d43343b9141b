"""Load a run's YAML into a typed, resolved :class:`~llmforge.config.schema.TrainConfig`.

A file may start with ``base: other.yaml`` (relative to the file) to extend another file;
the child's keys merge onto the base (mappings merge deeply, lists replace). ``variables:``
holds shared values for ``${variables.NAME}``; any OmegaConf interpolation works. Overrides
are ``key=value`` strings (``trainer.max_steps=5``, ``algorithms.0.name=compile``,
``run.tags=[a,b]``, ``checkpoint.dir=null``) merged after the files.

Every problem raises :class:`~llmforge.errors.ConfigError` with one message naming the key
path, the file (or override) and a fix.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import functools
import re
import typing
from pathlib import Path
from typing import Any, Sequence, Union

import yaml
from omegaconf import BooleanNode, DictConfig, FloatNode, IntegerNode, ListConfig, OmegaConf, StringNode
from omegaconf.errors import InterpolationKeyError, InterpolationValidationError, OmegaConfBaseException

from llmforge.config.schema import TrainConfig
from llmforge.errors import ConfigError

__all__ = ["load_config", "save_config", "redact", "config_to_dict", "structured_config"]


# ---------------------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader whose floats include ``1e-4`` / ``1E5`` (YAML 1.2 style), with dates left as
    strings, duplicate keys rejected and merge keys (``<<: *anchor``) merged."""

    def construct_mapping(self, node, deep=False):  # noqa: D102
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # SafeLoader.flatten_mapping merges it below
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_FLOAT_TAG, "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes every string :class:`_Loader` (or a YAML 1.1 reader) would read
    as another type: ``'1e3'`` stays a string when ``config.yaml`` is loaded back."""


_Dumper.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _yaml_error(exc: yaml.YAMLError, where: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    ctx = getattr(exc, "context", None)
    text = f"{ctx}: {problem}" if ctx and problem and ctx not in problem else problem
    pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ConfigError(f"malformed YAML in {where}{pos}: {text}")


def _read_yaml(path: Path, shown: str, referrer: str | None) -> dict:
    if not path.is_file():
        by = f" (the base of {referrer})" if referrer else ""
        what = "is a directory, not a file" if path.is_dir() else "not found"
        raise ConfigError(f"config file {shown}{by} {what}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, shown) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {shown}: {exc}") from None
    if data is None:  # an empty file would silently train the defaults
        by = f" (the base of {referrer})" if referrer else ""
        raise ConfigError(f"config file {shown}{by} is empty; write at least one section (e.g. "
                          "'base: yamls/demo_cpu.yaml' or 'trainer:') or pass the file you meant")
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top of {shown} must be a mapping of sections (e.g. 'trainer:'), "
            f"got {_kind(data)}"
        )
    return data


def _read_chain(path: Path, shown: str, referrer: str | None, stack: list) -> list:
    """Return ``[(shown_name, data), ...]`` with the deepest base first."""
    real = path.expanduser().resolve()
    names = [n for _, n in stack]
    if real in [p for p, _ in stack]:
        start = [p for p, _ in stack].index(real)
        raise ConfigError("base cycle: " + " -> ".join(names[start:] + [shown]))
    data = _read_yaml(path.expanduser(), shown, referrer)
    base = data.pop("base", None)
    chain = []
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(f"base in {shown} must be a file path, got {base!r}")
        base_path = Path(base).expanduser()
        if not base_path.is_absolute():
            base_path = path.expanduser().parent / base_path
        chain = _read_chain(base_path, str(base_path), shown, stack + [(real, shown)])
    return chain + [(shown, data)]


# -------------------------------------------------------------------------------- schema check
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


# ------------------------------------------------------------------------------- model family
_ROOT: contextvars.ContextVar = contextvars.ContextVar("llmforge_config_root", default=TrainConfig)
"""The schema being loaded: :class:`TrainConfig` with ``model`` typed as the family's config."""


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
    from llmforge.models.spec import model_config_class

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
        from llmforge.registry import import_modules

        import_modules([str(m) for m in imports])
    return model_config_class(name)


# ------------------------------------------------------------------------------------ overrides
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
    return key, value


def _apply_override(cfg: DictConfig, item: str) -> None:
    key, value = _parse_override(item)
    secret = any(_is_secret(p) for p in key.split("."))
    source = f"override '{key}=***'" if secret else f"override '{item}'"  # never echo a secret
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
            raise ConfigError(f"{source}: cannot set '{here}': {_omega_message(exc)}") from None


# ------------------------------------------------------------------------------- interpolation
def _check_interpolations(node: Any, root: Any, path: str = "") -> None:
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for k in keys:
        here = _join(path, k)
        if OmegaConf.is_interpolation(node, k):
            text = node._get_node(k)._value()
            try:
                node[k]
            except InterpolationKeyError as exc:
                m = re.search(r"key '([^']*)'", _omega_message(exc))
                missing = m.group(1) if m else text
                raise ConfigError(
                    f"{here}: interpolation '{text}' refers to missing key '{missing}'"
                ) from None
            except InterpolationValidationError as exc:
                try:  # the value the interpolation gives, resolved without the schema's types
                    plain = OmegaConf.create(OmegaConf.to_container(root))
                    got = OmegaConf.select(plain, here)
                except OmegaConfBaseException:
                    raise ConfigError(f"{here}: interpolation '{text}': {_omega_message(exc)}") from None
                tp = _schema_type(here.split("."))
                raise _bad_type(here, tp, got, f"interpolation '{text}'", "from") from None
            except OmegaConfBaseException as exc:
                raise ConfigError(f"{here}: cannot resolve interpolation '{text}': {_omega_message(exc)}") from None
            continue
        child = node._get_node(k)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none():
            _check_interpolations(child, root, here)


# ------------------------------------------------------------------------------------ public
def structured_config(model: Union[str, type, None] = None) -> DictConfig:
    """The defaults as a structured :class:`TrainConfig` ``DictConfig`` whose ``model:`` section
    is the family's dataclass (``model``: a registered name such as ``qwen3``, the dataclass
    itself, or ``None`` for the default ``llama3``).

    Raises:
        ConfigError: unknown model name.
    """
    cfg = OmegaConf.structured(TrainConfig)
    if model is None:
        return cfg
    if isinstance(model, str):
        from llmforge.models.spec import model_config_class

        model_cls = model_config_class(model)
        name = model
    else:
        model_cls, name = model, None
    if OmegaConf.get_type(cfg.model) is not model_cls:
        cfg.model = OmegaConf.structured(model_cls)
    if name is not None:
        cfg.model.name = name
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Load ``path`` (following ``base:`` chains), apply ``key=value`` overrides, and return a
    resolved structured :class:`TrainConfig` ``DictConfig``.

    Raises:
        ConfigError: missing or unreadable file (naming the file that referred to it for a
            ``base:``), malformed YAML (file, line, column), a file whose top is not a mapping,
            a ``base:`` cycle, an unknown key (with the closest valid key), a value of the
            wrong type, an override without ``=`` or with a list index out of range, or an
            interpolation to a missing key.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    chain = _read_chain(Path(path), str(path), None, [])
    model_cls = _model_class(chain, overrides)
    token = _ROOT.set(_root_for(model_cls))
    try:
        cfg = structured_config(model_cls)
        for shown, data in chain:
            data = _check(data, _ROOT.get(), "", shown)
            try:
                cfg.merge_with(data)
            except OmegaConfBaseException as exc:
                raise ConfigError(f"{shown}: {_omega_message(exc)}") from None
        for item in overrides:
            _apply_override(cfg, item)
        _check_interpolations(cfg, cfg)
    finally:
        _ROOT.reset(token)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve the config: {_omega_message(exc)}") from None
    return cfg


_SECRET = re.compile(r"(?i)(api_?key|secret|passw(or)?d|passwd|access_key|private_key|credential|"
                     r"auth|bearer|_pat$|^pat$|^key$|_key$|^token$|_token$)")
_NOT_SECRET = re.compile(r"(?i)(_tokens$|^(bos|eos|pad|unk|sep|cls|mask|start|end)_token$)")


def _is_secret(key: Any) -> bool:
    return isinstance(key, str) and bool(_SECRET.search(key)) and not _NOT_SECRET.search(key)


_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def _env_names(key: Any, value: Any) -> bool:
    """``secrets: [WANDB_API_KEY, ...]`` lists environment variable NAMES, not values."""
    return key == "secrets" and isinstance(value, (list, tuple, ListConfig)) and all(
        isinstance(x, str) and _ENV_NAME.match(x) for x in value)


def _secret_values(container: Any, out: set) -> set:
    """Every non-trivial string held under a secret-looking key, at any depth."""
    if isinstance(container, dict):
        for k, v in container.items():
            if _is_secret(k) and not _env_names(k, v):
                for item in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(item, (str, int)) and len(str(item)) >= 6:
                        out.add(str(item))
            _secret_values(v, out)
    elif isinstance(container, (list, tuple)):
        for v in container:
            _secret_values(v, out)
    return out


def _env_secret_values() -> set:
    """Values of the environment's credential variables (``*_API_KEY``, ``*_TOKEN``, ...)."""
    import os

    return {v for k, v in os.environ.items() if _is_secret(k.lower()) and v and len(v) >= 6}


_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@:]+:[^/\s@]+@")


def scrub_url_credentials(text: str) -> str:
    """``scheme://user:password@host/...`` -> ``scheme://***@host/...`` anywhere in ``text``."""
    return _URL_USERINFO.sub(r"\1***@", text)


def _scrub(container: Any, values: set) -> Any:
    if isinstance(container, dict):
        return {k: _scrub(v, values) for k, v in container.items()}
    if isinstance(container, list):
        return [_scrub(v, values) for v in container]
    if isinstance(container, str):
        for secret in values:
            if secret in container:
                container = container.replace(secret, "***")
        container = scrub_url_credentials(container)
    return container


def redact(container: Any) -> Any:
    """Return a copy of a (nested) dict/list, or a config, with secret-looking keys' values
    (``api_key``, ``wandb_api_key``, ``secret``, ``password``, ``passwd``, ``access_key``,
    ``private_key``, ``credentials``, ``key``, ``*_key``, ``*_pat``, ``token``, ``hf_token``; not
    ``max_tokens`` or ``eos_token``) replaced by ``"***"``. None stays None. Those values, and
    the values of the environment's credential variables (``WANDB_API_KEY``, ``HF_TOKEN``, ...),
    are also replaced wherever else they appear (e.g. interpolated into ``run.tags``), and so is
    the ``user:password@`` part of URLs (``https://user:pw@host/x`` -> ``https://***@host/x``)."""
    if isinstance(container, (DictConfig, ListConfig)) or dataclasses.is_dataclass(container):
        container = config_to_dict(container)
    values = _secret_values(container, set()) | _env_secret_values()
    return _scrub(_redact_keys(container), values)


def _redact_keys(container: Any) -> Any:
    if isinstance(container, dict):
        return {
            k: ("***" if _is_secret(k) and v is not None and not _env_names(k, v) else _redact_keys(v))
            for k, v in container.items()
        }
    if isinstance(container, (list, tuple)):
        return [_redact_keys(v) for v in container]
    return container


def config_to_dict(cfg: Any) -> Any:
    """Resolved plain container (dicts and lists) of a config, dataclass or dict.

    Raises:
        ConfigError: an interpolation cannot be resolved.
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = OmegaConf.structured(cfg)
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"cannot resolve the config: {_omega_message(exc)}") from None
    return copy.deepcopy(cfg)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML with secrets redacted (see :func:`redact`); creates
    parent folders and returns the path. ``load_config`` reads the file back.

    Raises:
        ConfigError: an interpolation cannot be resolved.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(redact(config_to_dict(cfg)), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    path.write_text(text, encoding="utf-8")
    return path
