"""Plugins (algorithms and callbacks) in checkpoints, without knowing any plugin.

* plain state: each callback's ``state_dict()`` (Lightning's protocol), JSON in
  ``trainer_state.json`` under ``callbacks``; small tensors in it (Lightning's own
  ``EarlyStopping`` keeps its best score as one) are written as ``{"__tensor__": values,
  "dtype": name}`` and come back as tensors;
* sharded state: each plugin's ``sharded_state_dict()`` (tensors, e.g. an EMA of the weights)
  in the DCP checkpoint under ``plugins.<state_key>``, resharded on load;
* ``meta.json``: each algorithm's ``checkpoint_meta(cfg)`` under ``plugins.<name>``; when a
  plugin declares ``adapters_only``: ``adapters_only: true``, ``adapters_by`` (its names) and
  ``base`` (:func:`base_pointer`: what rebuilds the frozen base);
* one key per plugin: :func:`check_state_keys` refuses two plugins with state under one
  ``state_key`` (two instances of one class, unless each sets its own ``state_key``);
* resume: :func:`check_resume` refuses a checkpoint the run cannot continue (adapters vs full,
  another base) and asks each plugin's ``check_resume``; :func:`dropped_states` names the
  saved states of plugins the run no longer has (the checkpointer says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.checkpoint.dcp import read_json
from llmforge.checkpoint.safe_load import load_metadata
from llmforge.errors import ConfigError
from llmforge.plugin import Algorithm, has_adapters

MAX_PLAIN_TENSOR = 65536
"""Largest tensor (elements) a plain state may hold; bigger ones belong in sharded_state_dict."""


def _encode(obj: Any, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.numel() > MAX_PLAIN_TENSOR:
            raise TypeError(f"{where}: a tensor of {obj.numel():,} elements in state_dict(); "
                            "return it from sharded_state_dict() instead")
        return {"__tensor__": obj.detach().cpu().tolist(), "dtype": str(obj.dtype).split(".")[-1]}
    if isinstance(obj, dict):
        return {k: _encode(v, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, where) for v in obj]
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__", "dtype"}:
            dtype = getattr(torch, str(obj["dtype"]), None)
            if isinstance(dtype, torch.dtype):
                return torch.tensor(obj["__tensor__"], dtype=dtype)
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def has_state(plugin: Any) -> bool:
    """Whether ``plugin`` saves anything: its class overrides ``state_dict`` (Lightning's
    ``Callback``) or ``sharded_state_dict`` (:class:`~llmforge.plugin.Algorithm`)."""
    cls = type(plugin)
    plain = getattr(cls, "state_dict", None) is not getattr(Callback, "state_dict", None)
    sharded = getattr(cls, "sharded_state_dict", None) not in (None, Algorithm.sharded_state_dict)
    return plain or sharded


def check_state_keys(callbacks: Iterable[Any]) -> None:
    """Refuse two plugins with state under one ``state_key`` (Lightning's ``Callback.state_key``,
    by default the class name): the second would overwrite the first's state in every
    checkpoint and both would resume with one of them.

    Raises:
        ConfigError: naming the key and how to give each instance its own.
    """
    seen: dict[str, Any] = {}
    for cb in callbacks:
        if not has_state(cb):
            continue
        key = cb.state_key
        if key in seen:
            raise ConfigError(
                f"algorithms/callbacks: two plugins with state save it under one key '{key}' "
                f"({type(seen[key]).__qualname__} and {type(cb).__qualname__}), so one would "
                "overwrite the other in every checkpoint; list the plugin once, or give each "
                "instance its own key with a state_key property (e.g. "
                "return f\"{type(self).__qualname__}[{self.key}]\"; see docs/research.md)")
        seen[key] = cb


def plain_states(callbacks: Iterable[Any], skip: Any = None) -> dict[str, Any]:
    """``{state_key: state_dict()}`` of every callback with a non-empty state, JSON-ready.

    Raises:
        TypeError: a state is not JSON-serializable (at the first save, not at the resume).
    """
    out = {}
    for cb in callbacks:
        if cb is skip:
            continue
        sd = cb.state_dict()
        if sd:
            enc = _encode(sd, cb.state_key)
            json.dumps(enc)
            out[cb.state_key] = enc
    return out


def restore_plain_states(callbacks: Iterable[Any], states: dict[str, Any]) -> None:
    """Give each callback back what :func:`plain_states` saved under its ``state_key``;
    callbacks added or removed since the save are left as they are."""
    for cb in callbacks:
        if cb.state_key in states:
            cb.load_state_dict(_decode(states[cb.state_key]))


def sharded_states(callbacks: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """``{state_key: sharded_state_dict()}`` of the plugins that have tensors to save."""
    out = {}
    for cb in callbacks:
        fn = getattr(cb, "sharded_state_dict", None)
        sd = fn() if callable(fn) else None
        if sd:
            out[cb.state_key] = sd
    return out


def restore_sharded_states(callbacks: Iterable[Any], loaded: dict[str, dict[str, Any]],
                           found: Iterable[str]) -> list[str]:
    """Hand each plugin its loaded tensors; returns the state keys the checkpoint lacked
    (plugins added since the save: they start fresh)."""
    found = set(found)
    missing = []
    for cb in callbacks:
        if cb.state_key not in loaded:
            continue
        if cb.state_key in found:
            cb.load_sharded_state_dict(loaded[cb.state_key])
        else:
            missing.append(cb.state_key)
    return missing


def dropped_states(checkpoint: Path, callbacks: Iterable[Any], plain: dict[str, Any]) -> list[str]:
    """State keys a checkpoint holds that no plugin of this run takes (an algorithm removed
    since the save, e.g. ``ema``: its average would be dropped silently). ``plain`` is the
    checkpoint's ``callbacks`` entry of ``trainer_state.json``; sharded states are read from
    the DCP metadata (``plugins.<state_key>.*``)."""
    keys = {cb.state_key for cb in callbacks}
    dropped = {k for k in plain if k not in keys}
    md = Path(checkpoint) / ".metadata"
    if md.exists():
        for k in load_metadata(md).state_dict_metadata:
            if k.startswith("plugins.") and not any(k.startswith(f"plugins.{s}.") for s in keys):
                dropped.add(k[len("plugins."):].split(".")[0])
    return sorted(dropped)


def base_pointer(cfg: Any) -> dict[str, Any]:
    """What rebuilds the frozen base of an adapter run: ``model.init_from`` when set, else the
    random init of ``run.seed`` (with the model config saved in the run's config.yaml)."""
    init_from = cfg.model.get("init_from")
    if init_from:
        return {"init_from": str(init_from), "description": f"weights of {init_from}"}
    return {"init_from": None, "seed": int(cfg.run.seed),
            "description": f"random init of model '{cfg.model.name}' with run.seed={cfg.run.seed}"}


def adapter_plugins(callbacks: Iterable[Any], model: Any) -> list[str]:
    """Names of the plugins whose checkpoints hold only adapters (``adapters_only``), if
    ``model`` has adapters; else ``[]``."""
    names = [str(getattr(cb, "name", type(cb).__name__)) for cb in callbacks
             if getattr(cb, "adapters_only", False)]
    return names if names and model is not None and has_adapters(model) else []


def checkpoint_meta(callbacks: Iterable[Any], cfg: Any, model: Any) -> dict[str, Any]:
    """The plugins' entries of ``meta.json`` (see the module docstring)."""
    callbacks = list(callbacks)
    plugins = {}
    for cb in callbacks:
        fn = getattr(cb, "checkpoint_meta", None)
        entry = fn(cfg) if callable(fn) else None
        if entry:
            plugins[str(getattr(cb, "name", cb.state_key))] = entry
    meta: dict[str, Any] = {"plugins": plugins} if plugins else {}
    by = adapter_plugins(callbacks, model)
    if by:
        meta.update(adapters_only=True, adapters_by=by, base=base_pointer(cfg))
    return meta


def read_meta(checkpoint: Path) -> Optional[dict[str, Any]]:
    """A checkpoint's ``meta.json``, or ``None`` if it has none."""
    return read_json(checkpoint, "meta.json") if (Path(checkpoint) / "meta.json").exists() else None


def check_resume(checkpoint: Path, callbacks: Iterable[Any], cfg: Any, model: Any) -> None:
    """Refuse a resume the run cannot continue: a checkpoint of adapters into a run without
    that plugin (or the reverse), adapters trained on another base, and whatever each plugin's
    ``check_resume`` refuses.

    Raises:
        ConfigError: naming the checkpoint, what differs and how to resume.
    """
    meta = read_meta(checkpoint)
    if meta is None:
        return
    callbacks = list(callbacks)
    now = adapter_plugins(callbacks, model)
    saved = bool(meta.get("adapters_only"))
    by = ", ".join(meta.get("adapters_by") or ["a plugin"])
    if saved != bool(now):
        if now:
            raise ConfigError(f"checkpoint.resume: {checkpoint} is a full-model checkpoint, but "
                              f"this run trains only the adapters of {', '.join(now)}; start from "
                              f"its weights with model.init_from={checkpoint} (and "
                              "checkpoint.resume=null)")
        raise ConfigError(f"checkpoint.resume: {checkpoint} holds only the adapters of {by}, but "
                          "this run has no such entry under algorithms:; resume with the original "
                          "algorithms")
    for cb in callbacks:
        fn = getattr(cb, "check_resume", None)
        if callable(fn):
            fn(Path(checkpoint), meta, cfg)
    base = meta.get("base")
    if saved and base and base_pointer(cfg) != base:
        raise ConfigError(f"checkpoint.resume: {checkpoint} holds adapters of {by} trained on the "
                          f"base '{base.get('description')}', but this run's base is "
                          f"'{base_pointer(cfg).get('description')}'; set model.init_from (and "
                          "run.seed) as in the original run")
