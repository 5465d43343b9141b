"""Reading config YAML safely: the loader (YAML 1.2 floats such as ``1e-4``, dates kept as
strings, duplicate keys refused, merge keys ``<<: *anchor`` merged), the matching dumper, and
``base:`` chains (a file extends another, relative to itself; cycles refused).

Bounded: a file larger than :data:`MAX_BYTES`, or whose aliases and merge keys expand to more
than :data:`MAX_NODES` values (the "billion laughs" shape: 9 levels of 9 references is a 1 KB
file that OmegaConf would expand into 387 million values), is refused before it is built. A
``base:`` of an untrusted file (a run directory someone else wrote) must stay inside its
folder (``confine``). No message quotes a file's content: a top that is not a mapping is named
by its type only (``base: ~/.ssh/id_rsa`` reads as one string).

Raises :class:`~llmforge.errors.ConfigError` naming the file (and line, column) and a fix.
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from llmforge.errors import ConfigError

MAX_BYTES = 4 << 20
"""Largest config file read (4 MiB; the shipped yamls are under 10 KB)."""
MAX_NODES = 200_000
"""Most values (mappings, lists, scalars) a file may expand to once aliases are followed."""

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

    def construct_yaml_int(self, node):  # noqa: D102
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            digits = sum(c.isdigit() for c in str(node.value))
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits (at most {sys.get_int_max_str_digits()} "
                "are read)", node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists a config file may have (the schema's is 4; OmegaConf
recurses once per level and fails near 100)."""


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


def _type_name(value: Any) -> str:
    """A value's kind without its content (a file's text may be a key someone pointed to)."""
    kinds = {dict: "a mapping", list: "a list", str: "a string", int: "an integer", float: "a number",
             bool: "a boolean"}
    return kinds.get(type(value), type(value).__name__)


def _expanded_size(node: yaml.Node, bound: int) -> int:
    """How many values ``node`` becomes once every alias is copied out (what OmegaConf builds),
    counted in time linear in the distinct nodes; stops counting past ``bound``."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:  # iterative: a deeply nested file must not overflow Python's stack here
        n, done = stack.pop()
        if id(n) in sizes:
            continue
        kids = ([x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode) else
                list(n.value) if isinstance(n, yaml.SequenceNode) else [])
        if not done:
            stack.append((n, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
            continue
        sizes[id(n)] = min(bound + 1, 1 + sum(sizes.get(id(k), 0) for k in kids))
    return sizes[id(node)]


def _load(text: str, shown: str) -> Any:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_NODES) > MAX_NODES:
            raise ConfigError(f"{shown}: its aliases (*name) and merge keys (<<) expand to more than "
                              f"{MAX_NODES:,} values; a config repeats a section by an alias, not by "
                              "aliases of aliases: write the values out, or use ${...} interpolation")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _key_at(text: str, index: int) -> str:
    """The dotted key of the value that starts at character ``index`` of a YAML text ('' when
    it is not found)."""
    try:
        todo = [(yaml.compose(text, Loader=_Loader), "")]
    except (yaml.YAMLError, RecursionError):
        return ""
    while todo:
        node, key = todo.pop()
        if node is None:
            continue
        if node.start_mark.index == index and isinstance(node, yaml.ScalarNode):
            return key
        if isinstance(node, yaml.MappingNode):
            todo += [(v, f"{key}.{k.value}".lstrip(".")) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            todo += [(v, f"{key}[{i}]") for i, v in enumerate(node.value)]
    return ""


def _too_deep(data: object) -> str | None:
    """The dotted key of the first value nested deeper than :data:`MAX_DEPTH`, or None."""
    todo = [(data, "", 0)]
    while todo:
        value, key, depth = todo.pop()
        items = (value.items() if isinstance(value, dict) else
                 ((f"[{i}]", v) for i, v in enumerate(value)) if isinstance(value, list) else ())
        for k, v in items:
            sub = f"{key}{k}" if str(k).startswith("[") else f"{key}.{k}".lstrip(".")
            if depth + 1 > MAX_DEPTH:
                return sub
            todo.append((v, sub, depth + 1))
    return None


def _read_yaml(path: Path, shown: str, referrer: str | None) -> dict:
    if not path.is_file():
        by = f" (the base of {referrer})" if referrer else ""
        what = "is a directory, not a file" if path.is_dir() else "not found"
        raise ConfigError(f"config file {shown}{by} {what}")
    text = ""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(f"config file {shown} is larger than {MAX_BYTES >> 20} MiB; a config "
                              "holds settings, not data: give data files under data.path")
        text = path.read_text(encoding="utf-8")
        data = _load(text, shown)
    except yaml.YAMLError as exc:
        error = _yaml_error(exc, shown)
        mark = getattr(exc, "problem_mark", None)
        key = _key_at(text, mark.index) if mark is not None and "digits" in str(exc) else ""
        raise (ConfigError(f"{key}: {error}") if key else error) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {shown}: {exc}") from None
    except (RecursionError, MemoryError):
        raise ConfigError(f"config file {shown} is nested too deeply to read (more than "
                          f"{MAX_DEPTH} levels of mappings and lists are refused); the file is "
                          "damaged or not a config") from None
    deep = _too_deep(data)
    if deep is not None:
        raise ConfigError(f"{deep}: config file {shown} nests more than {MAX_DEPTH} levels of "
                          "mappings and lists; the file is damaged or not a config")
    if data is None:  # an empty file would silently train the defaults
        by = f" (the base of {referrer})" if referrer else ""
        raise ConfigError(f"config file {shown}{by} is empty; write at least one section (e.g. "
                          "'base: yamls/demo_cpu.yaml' or 'trainer:') or pass the file you meant")
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top of {shown} must be a mapping of sections (e.g. 'trainer:'), "
            f"got {_type_name(data)}"
        )
    return data


def _read_chain(path: Path, shown: str, referrer: str | None, stack: list,
                confine: Path | None = None) -> list:
    """Return ``[(shown_name, data), ...]`` with the deepest base first.

    ``confine``: an untrusted file's folder; a ``base:`` that resolves outside it is refused
    before it is opened (a shared run's ``base: ~/.ssh/id_rsa``)."""
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
        if confine is not None and confine.resolve() not in base_path.resolve().parents:
            raise ConfigError(f"base in {shown} names a file outside its run directory {confine}; a "
                              "run directory from elsewhere reads none of your files: pass "
                              "--trust-code if you wrote this run yourself")
        chain = _read_chain(base_path, str(base_path), shown, stack + [(real, shown)], confine)
    return chain + [(shown, data)]

