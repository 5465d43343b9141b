"""Load a run's YAML into a typed, resolved :class:`~llmforge.config.schema.TrainConfig`.

A file may start with ``base: other.yaml`` (relative to the file) to extend another file;
the child's keys merge onto the base (mappings merge deeply, lists replace). ``variables:``
holds shared values for ``${variables.NAME}``; any OmegaConf interpolation works. Overrides
are ``key=value`` strings (``trainer.max_steps=5``, ``algorithms.0.name=compile``,
``run.tags=[a,b]``, ``checkpoint.dir=null``) merged after the files.

Every problem raises :class:`~llmforge.errors.ConfigError` with one message naming the key
path, the file (or override) and a fix. The pieces: :mod:`~llmforge.config.yaml_files` (safe
YAML, ``base:`` chains), :mod:`~llmforge.config.keycheck` (schema types),
:mod:`~llmforge.config.model_typing` (the family's ``model:`` keys),
:mod:`~llmforge.config.overrides`, :mod:`~llmforge.config.redaction` (secrets).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Sequence, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationValidationError, OmegaConfBaseException
from omegaconf.resolvers.oc import env as _oc_env

from llmforge.config.keycheck import _ROOT, _bad_type, _check, _describe, _join, _omega_message, _schema_type
from llmforge.config.model_typing import _model_class, _root_for
from llmforge.config.overrides import _apply_override
from llmforge.config.redaction import _secret_values, config_to_dict, redact, remember_secret_values
from llmforge.config.schema import TrainConfig, model_config_class
from llmforge.config.yaml_files import _Dumper, _read_chain, _type_name
from llmforge.errors import ConfigError
from llmforge.paths import resolve_dotdot

__all__ = ["load_config", "read_config", "resolve_config", "save_config", "structured_config"]


# ------------------------------------------------------------------------------- interpolation
def _env(*args: Any) -> Any:
    """OmegaConf's ``oc.env``, remembering the value it gives: no error message prints it
    (a type or choice error would echo a webhook URL or a token under any variable name)."""
    value = _oc_env(*args)
    if isinstance(value, str):
        remember_secret_values([value])
    return value


OmegaConf.register_resolver("oc.env", _env, replace=True, annotation_validation="off")


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
                if _RESOLVER.search(text):  # ${oc.env:...}: the value may be a secret, not shown
                    raise ConfigError(f"{here}: expected {_describe(tp)}, got {_type_name(got)} from "
                                      f"interpolation '{text}'") from None
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
        model_cls = model_config_class(model)
        name = model
    else:
        model_cls, name = model, None
    if OmegaConf.get_type(cfg.model) is not model_cls:
        cfg.model = OmegaConf.structured(model_cls)
    if name is not None:
        cfg.model.name = name
    return cfg


MAX_RESOLVED = 10_000_000
"""Most characters (and values) a config may resolve to: ``${...}`` references of references
(``s1: '${s0}${s0}...'``, ``s2: '${s1}${s1}...'``) grow as fast as YAML aliases do."""
_REF = re.compile(r"\$\{([^${}:\s]+)\}")


def _check_expansion(raw: Any) -> None:
    """Refuse a config whose interpolations would resolve to more than :data:`MAX_RESOLVED`
    characters, counted on the unresolved values in time linear in their number (each
    referenced value's size is computed once).

    Raises:
        ConfigError: naming the first top-level key past the bound.
    """
    memo: dict[str, int] = {}

    def lookup(ref: str) -> Any:
        node: Any = raw
        for part in ref.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def size(value: Any, path: str) -> int:
        if path in memo:
            return memo[path]
        memo[path] = 0  # a cycle counts nothing here (OmegaConf names it)
        if isinstance(value, str):
            total = len(_REF.sub("", value)) + sum(size(lookup(r), r) for r in _REF.findall(value))
        elif isinstance(value, dict):
            total = 1 + sum(size(v, f"{path}.{k}".lstrip(".")) for k, v in value.items())
        elif isinstance(value, list):
            total = 1 + sum(size(v, f"{path}.{i}".lstrip(".")) for i, v in enumerate(value))
        else:
            total = 1
        memo[path] = total = min(total, MAX_RESOLVED + 1)
        return total

    for key, value in raw.items():
        if size(value, str(key)) > MAX_RESOLVED:
            raise ConfigError(f"{key}: its ${{...}} interpolations would resolve to more than "
                              f"{MAX_RESOLVED:,} characters (references of references); write the "
                              "values out instead")


# ${name:...}: a resolver call (oc.env reads the environment); ${a.b} is a plain reference
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:")


def _refuse_resolvers(data: Any, shown: str, path: str = "") -> None:
    """An untrusted file (a run directory from elsewhere) calls no resolver: ``${oc.env:NAME}``
    would copy your environment into its values, and its messages. llmforge saves configs
    resolved, so a run it wrote holds none."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        here = _join(path, k)
        if isinstance(v, str) and (m := _RESOLVER.search(v)):
            raise ConfigError(f"{shown}: {here} calls the resolver '{m.group(1)}' (${{{m.group(1)}:...}}); "
                              "a run directory from elsewhere reads nothing from your environment: "
                              "pass --trust-code if you wrote this run yourself")
        _refuse_resolvers(v, shown, here)


def read_config(path: str | Path, overrides: Sequence[str] = (), *,
                confine: Path | None = None) -> DictConfig:
    """Read ``path`` (following ``base:`` chains) and apply ``key=value`` overrides, checked
    like :func:`load_config` (interpolations are checked to resolve here) but not resolved:
    :func:`resolve_config` resolves a copy, so one read serves several environments
    (``llmforge launch`` resolves it here and in the job's environment).

    ``confine``: the folder of an untrusted file (a run directory someone else wrote): its
    ``base:`` must stay inside it and no value may call a resolver (``${oc.env:...}``).

    Raises:
        ConfigError: as :func:`load_config`.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    chain = _read_chain(Path(path), str(path), None, [], confine)
    if confine is not None:
        for shown, data in chain:
            _refuse_resolvers(data, shown)
    model_cls = _model_class(chain, overrides)
    token = _ROOT.set(_root_for(model_cls))
    try:
        cfg = structured_config(model_cls)
        for shown, data in chain:
            data = _check(data, _ROOT.get(), "", shown)
            try:
                cfg.merge_with(data)
            except OmegaConfBaseException as exc:
                at = f" {exc.full_key}:" if getattr(exc, "full_key", None) else ""
                raise ConfigError(f"{shown}:{at} {_omega_message(exc)}") from None
        for item in overrides:
            _apply_override(cfg, item)
        raw = OmegaConf.to_container(cfg, resolve=False)
        remember_secret_values(_secret_values(raw, set()))
        _check_expansion(raw)  # before anything resolves: references of references explode
        _check_interpolations(cfg, cfg)
    finally:
        _ROOT.reset(token)
    return cfg


def _refuse_literal_braces(node: Any, where: str = "") -> None:
    """Refuse a resolved string that holds the text ``${`` (written ``\\${`` in YAML, an escaped
    interpolation). ``OmegaConf.resolve`` stores it as ``${x}``, which the next read takes for a
    reference; llmforge reads resolved configs again (the run's ``config.yaml`` on resume, eval,
    export), where it would become a missing key or, worse, another key's value.

    Raises:
        ConfigError: naming the key."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in keys:
        child, here = node._get_node(k), f"{where}.{k}" if where else str(k)
        if isinstance(child, (DictConfig, ListConfig)):
            _refuse_literal_braces(child, here)
        elif isinstance(value := child._value(), str) and "${" in value:
            raise ConfigError(f"{here}: its value holds the text '${{' (written '\\${{...}}', or from "
                              "an environment variable's value), which llmforge cannot keep as text: "
                              "the run's config.yaml is read again on resume, where it would become a "
                              "reference; write the value without '${'")


def _unresolvable_key(node: Any, message: str, where: str = "") -> str:
    """The dotted key of the value under ``node`` that fails as ``OmegaConf.resolve`` failed
    with ``message`` (it raises without naming the key), or ``""``: one whose interpolation
    raises that message as it is read, or whose resolved text (an escaped ``\\${``, which
    ``resolve`` parses again) raises it when parsed once more."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in keys:
        here = f"{where}.{k}" if where else str(k)
        try:
            child = node[k]  # a leaf resolves its interpolation as it is read
        except OmegaConfBaseException as exc:
            if _omega_message(exc) == message:
                return here
            continue
        if isinstance(child, str) and "${" in child:
            try:
                OmegaConf.resolve(OmegaConf.create({"v": child}))
            except OmegaConfBaseException as exc:
                if _omega_message(exc) == message:
                    return here
        elif isinstance(child, (DictConfig, ListConfig)) and (found := _unresolvable_key(child, message, here)):
            return found
    return ""


def resolve_config(cfg: DictConfig, *, in_place: bool = False) -> DictConfig:
    """``cfg`` from :func:`read_config` with every interpolation resolved in the current
    environment (``${oc.env:NAME}`` reads ``os.environ`` now): a deep copy, or ``cfg`` itself
    with ``in_place`` (then the interpolations were just checked by :func:`read_config`).

    Raises:
        ConfigError: an interpolation that does not resolve here (names the key).
    """
    if not in_place:
        cfg = copy.deepcopy(cfg)
        token = _ROOT.set(_root_for(OmegaConf.get_type(cfg.model)))
        try:
            _check_interpolations(cfg, cfg)
        finally:
            _ROOT.reset(token)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        key = _unresolvable_key(cfg, _omega_message(exc))
        raise ConfigError(f"cannot resolve the config{f' at {key}' if key else ''}: {_omega_message(exc)}") from None
    _refuse_literal_braces(cfg)
    for key in ("run.output_dir", "checkpoint.dir"):  # one path for every writer: paths.resolve_dotdot
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and ".." in Path(value).parts:
            OmegaConf.update(cfg, key, str(resolve_dotdot(value)))
    # a secret key's value echoed through ${...} into another key's error is not printed either
    remember_secret_values(_secret_values(OmegaConf.to_container(cfg), set()))
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = (), *,
                confine: Path | None = None) -> DictConfig:
    """Load ``path`` (following ``base:`` chains), apply ``key=value`` overrides, and return a
    resolved structured :class:`TrainConfig` ``DictConfig``. ``confine``: see
    :func:`read_config` (a run directory from elsewhere).

    Raises:
        ConfigError: missing or unreadable file (naming the file that referred to it for a
            ``base:``), malformed YAML (file, line, column), a file whose top is not a mapping,
            a ``base:`` cycle, an unknown key (with the closest valid key), a value of the
            wrong type, an override without ``=`` or with a list index out of range, or an
            interpolation to a missing key; with ``confine``, a ``base:`` outside it or a
            resolver call.
    """
    return resolve_config(read_config(path, overrides, confine=confine), in_place=True)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML with secrets redacted (see :func:`redact`); creates
    parent folders and returns the path. ``load_config`` reads the file back.

    Raises:
        ConfigError: an interpolation cannot be resolved.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(redact(config_to_dict(cfg)), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    # temp file + rename: a stop signal during the write (startup raises at once) or a full disk
    # never leaves a torn config.yaml that a later resume or restart would read
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
