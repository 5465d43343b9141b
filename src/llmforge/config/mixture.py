"""``data.mixture`` checked: each entry's keys, source, path, weight and name, and its share.

An entry is a prepared folder (``{source: prepared, path, weight, name}``) or a streaming
document source whose keys are those of ``data:`` (``source: files|hub|shakespeare``, ``path``,
``paths``, ``format``, ``text_field``, ``split``, ``storage_options``, ``max_documents``;
``hub_name`` is ``data.name``, the Hub configuration, since ``name`` names the entry), merged
over the run's ``data:`` section. An entry without ``source`` takes ``data.source``. Opening
the entries is :mod:`llmforge.data.mixture_sources`.
"""

from __future__ import annotations

import glob
import math
import re
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from llmforge.errors import ConfigError

_COMMON = {"source", "name", "weight"}
_PREPARED_KEYS = _COMMON | {"path"}
_STREAM_KEYS = _COMMON | {"path", "paths", "format", "text_field", "hub_name", "split",
                          "storage_options", "streaming", "max_documents"}
_STREAM_SOURCES = ("files", "hub", "shakespeare")


def _default_name(entry: dict[str, Any], i: int) -> str:
    """From the path: ``allenai/c4`` -> ``c4``, ``web/part*.jsonl`` -> ``part``, ``corpus/*.jsonl``
    -> ``corpus`` (the last component, a glob's without its wildcards and extension)."""
    path = str(entry.get("path") or (list(entry.get("paths") or []) or [""])[0] or entry.get("source"))
    for part in reversed([p for p in path.rstrip("/").split("/") if p]):
        if glob.has_magic(part):
            part = re.sub(r"\[.*?\]|[*?]", "", part).split(".")[0]
        if part:
            return part
    return f"source{i}"


def _check_keys(key: str, entry: dict[str, Any], source: str) -> None:
    allowed = _PREPARED_KEYS if source == "prepared" else _STREAM_KEYS
    unknown = set(entry) - allowed
    if not unknown:
        return
    if unknown & {"val_split", "val_fraction"}:
        raise ConfigError(f"{key}: {sorted(unknown & {'val_split', 'val_fraction'})} cannot be set "
                          "per entry: evaluation reads the validation windows of the prepared "
                          "entries only, a streaming entry trains on all its documents (docs/data.md)")
    what = "a prepared entry" if source == "prepared" else f"a {source} (streaming) entry"
    # `{path:/x,weight:1}` in an override is YAML for the keys 'path:/x' and 'weight:1'
    glued = [k for k in unknown if ":" in str(k) and entry[k] is None]
    hint = (f" ({glued[0]!r} reads as one key: write a space after each colon, as in "
            "{path: DIR, weight: 1})") if glued else ""
    raise ConfigError(f"{key}: unknown key(s) {sorted(map(str, unknown))}; {what} has "
                      f"{', '.join(sorted(allowed))}{hint}")


def _check_types(key: str, entry: dict[str, Any]) -> None:
    """``path`` and ``name`` are strings and ``paths`` a string or a list of strings: a list
    or a mapping there would otherwise be turned into its ``repr`` and read as a folder name."""
    for k, want in (("path", "a string (a folder, file, glob or URL; several files go in paths)"),
                    ("name", "a string (it names the metric data/<name>/tokens_seen)")):
        if entry.get(k) is not None and not isinstance(entry[k], str):
            raise ConfigError(f"{key}.{k}={entry[k]!r}: must be {want}")
    if entry.get("name") is not None and (not entry["name"].strip() or "/" in entry["name"]):
        raise ConfigError(f"{key}.name={entry['name']!r}: must be a non-empty name without '/' (it "
                          "names the metric data/<name>/tokens_seen)")
    paths = entry.get("paths")
    if paths is not None and not isinstance(paths, str) and (
            not isinstance(paths, Sequence) or not all(isinstance(p, str) for p in paths)):  # ListConfig too
        raise ConfigError(f"{key}.paths={paths!r}: must be a string or a list of strings")


def _check_weight(key: str, w: Any) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        raise ConfigError(f"{key}.weight={w!r}: must be a finite number > 0 (weights are "
                          "normalized to shares; drop an entry to leave it out)")
    return float(w)


def _stream_config(cfg: Any, key: str, entry: dict[str, Any], source: str) -> Any:
    """The entry's keys merged over ``data:``: what :func:`load_documents` reads."""
    if entry.get("streaming", True) is not True:
        raise ConfigError(f"{key}.streaming={entry['streaming']!r}: a {source} entry of a mixture is "
                          "read streaming (in-memory sources are not mixed); drop the key, or "
                          "`llmforge data prepare` it and use source: prepared")
    has_path = bool(entry.get("path") or entry.get("paths"))
    if source == "shakespeare" and has_path:
        raise ConfigError(f"{key}.path: a shakespeare entry (the embedded corpus; an entry "
                          f"without source takes data.source) takes no path; set {key}.source "
                          "to prepared or files")
    if source != "shakespeare" and not has_path:
        what = "the dataset name (e.g. allenai/c4)" if source == "hub" else "a file, glob or URL"
        raise ConfigError(f"{key}.path: required for a {source} entry ({what})")
    over = {k: v for k, v in entry.items() if k in _STREAM_KEYS - _COMMON - {"hub_name"}}
    paths = entry.get("paths") or []
    over.update(source=source, streaming=True, path=entry.get("path"),
                paths=[paths] if isinstance(paths, str) else list(paths),
                val_split=None, val_fraction=0.0, mixture=[])
    if "hub_name" in entry:
        over["name"] = entry["hub_name"]
    try:
        merged = OmegaConf.merge(cfg.data, over)
    except Exception as exc:  # a value of the wrong type for its data: key
        where = f".{exc.key}" if getattr(exc, "key", None) else ""
        raise ConfigError(f"{key}{where}: {str(exc).splitlines()[0]}") from exc
    if merged.max_documents is not None and merged.max_documents <= 0:  # as data.max_documents
        raise ConfigError(f"{key}.max_documents must be > 0 or null, got {merged.max_documents}")
    return merged


def mixture_entries(cfg: Any) -> list[dict[str, Any]]:
    """``data.mixture`` checked: ``[{name, source, path, weight, share, data}]`` (``data``: the
    merged ``data:`` config of a streaming entry, ``None`` for a prepared one); ``[]`` without one.

    Raises:
        ConfigError: an unknown key, a missing path, a weight that is not a finite number > 0,
            an unknown source or a repeated name (the message names the key).
    """
    raw = list(cfg.data.get("mixture") or [])
    out, names = [], set()
    for i, entry in enumerate(raw):
        key = f"data.mixture[{i}]"
        entry = dict(entry)
        source = str(entry.get("source") or cfg.data.source)
        if source != "prepared" and source not in _STREAM_SOURCES:
            raise ConfigError(f"{key}.source={source!r}: one of prepared, {', '.join(_STREAM_SOURCES)}")
        _check_keys(key, entry, source)
        _check_types(key, entry)
        w = _check_weight(key, entry.get("weight"))
        if source == "prepared" and not entry.get("path"):
            raise ConfigError(f"{key}.path: required (a folder written by `llmforge data prepare`)")
        data = None if source == "prepared" else _stream_config(cfg, key, entry, source)
        name = str(entry.get("name") or _default_name(entry, i))
        if name in names:
            raise ConfigError(f"{key}.name={name!r}: another entry has this name; names must differ")
        names.add(name)
        path = entry.get("path") or ", ".join(map(str, entry.get("paths") or [])) or source
        out.append({"name": name, "source": source, "path": str(path), "weight": w, "data": data})
    # divided by the largest first: weights near the float maximum (1e308) must not sum to inf
    top = max((e["weight"] for e in out), default=1.0)
    total = sum(e["weight"] / top for e in out)
    for i, e in enumerate(out):
        e["share"] = e["weight"] / top / total
        if e["share"] < 2.0**-53:  # below float resolution next to 1: the sampler never draws it
            raise ConfigError(f"data.mixture[{i}].weight={e['weight']!r}: its share "
                              f"{e['share']:.3g} is too small next to the largest weight ({top!r}) "
                              "for this source ever to be drawn; raise it or drop the entry")
    return out
