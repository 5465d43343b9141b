"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout of a checkpoint root (``<run_dir>/checkpoints``)::

    step_00000100/           one complete checkpoint
        .metadata, __*.distcp   DCP files: {"model": ..., "optim": ...}, sharded per rank
        trainer_state.json   step, tokens seen, scheduler state, data position
        rng/rank<R>.json     RNG states of every rank (Python, NumPy, torch CPU/CUDA)
        data/rank<R>.json    each rank's streaming data position (loader workers' states)
        meta.json            step, tokens, world size and mesh, llmforge version, the config
                             (secrets redacted) and its hash,
                             ``plugins`` (each plugin's checkpoint_meta); adapter runs:
                             ``adapters_only: true``, ``adapters_by`` and ``base`` (its pointer)
        COMPLETE             written last; a folder without it is never loaded
    .tmp-step_00000200/      a save in progress (ignored by readers)

A save writes into ``.tmp-<name>``, waits for every rank, writes ``COMPLETE`` and renames the
folder in one ``os.replace``: an interrupted save leaves the previous checkpoints intact.
Loading goes through :mod:`llmforge.checkpoint.safe_load` (DCP metadata unpickled with an
allow-list, non-tensor entries read with ``torch.load(weights_only=True)``) and JSON: no
checkpoint can run code.

``save_checkpoint(..., async_save=True)`` writes through ``dcp.async_save`` and returns a
:class:`PendingSave`; the folder becomes visible when :meth:`PendingSave.finish` has run (the
next save calls it first, so at most one save is in flight; :mod:`llmforge.checkpoint.atomic_save`).

A run whose plugin declares ``adapters_only`` (:class:`llmforge.plugin.Algorithm`)
saves and loads only the adapter tensors (parameters of modules marked with
:data:`~llmforge.plugin.ADAPTER_CHILDREN`) and their optimizer state: the frozen base is
rebuilt from its pointer (``model.init_from`` or the seeded init) when the model is built.
Plugins' own tensors (``Algorithm.sharded_state_dict``) are saved under ``plugins.<key>``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from llmforge.checkpoint.atomic_save import (PendingSave, _barrier,
                                             _crash_point, _is_rank0, _write_failed)
from llmforge.checkpoint.layout import COMPLETE, list_checkpoints, step_name
from llmforge.checkpoint.optimizer_state import (drop_empty_optimizer_state, forget_optimizer_state,
                                                  saved_flat_optimizer, saved_optimizer_state)
from llmforge.checkpoint.safe_load import CheckpointReadError, SafeReader, check_regular, load_metadata, safe_load
from llmforge.checkpoint.state_files import check_meta, check_rng, check_trainer_state
from llmforge.errors import ConfigError
from llmforge.plugin import adapter_key_filter, has_adapters


def _adapter_filter(model: nn.Module, model_sd: dict[str, Any],
                    adapters_only: Optional[bool] = None) -> tuple[dict[str, Any], bool]:
    """``(state dict to save/load, adapters_only)``: only the adapter entries when
    ``adapters_only`` (``None``: when the model has adapters), else ``model_sd`` unchanged."""
    if adapters_only is None:
        adapters_only = has_adapters(model)
    if not adapters_only:
        return model_sd, False
    is_adapter = adapter_key_filter(model)
    return {k: v for k, v in model_sd.items() if is_adapter(k)}, True


def save_checkpoint(root: str | Path, step: int, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer], trainer_state: dict[str, Any],
                    meta: dict[str, Any], rng: Optional[dict[str, Any]] = None,
                    async_save: bool = False, adapters_only: Optional[bool] = None,
                    plugin_state: Optional[dict[str, Any]] = None,
                    rank_state: Optional[dict[str, dict]] = None,
                    flatten_optimizer: bool = False) -> PendingSave:
    """Save model (and optimizer) state sharded by DCP, plus JSON state, atomically.

    Every rank must call it (with its own ``rng`` and ``rank_state``). Returns a
    :class:`PendingSave`: already finished unless ``async_save``.

    Args:
        adapters_only: save only the model's adapter parameters (``None``: if it has any).
        plugin_state: ``{state_key: {name: tensor}}`` of plugins' own tensors, saved under
            ``plugins`` (sharded like the weights).
        rank_state: ``{name: dict}`` of this rank's JSON state (e.g. ``data``: the data
            module's position), written as ``<name>/rank<R>.json``; empty dicts are skipped.
        flatten_optimizer: key the optimizer's hyperparameters per parameter
            (``optim.param_groups.<fqn>.lr``) instead of per group index: needed when ranks
            hold different parameters (pipeline stages), as DCP keeps one rank's copy of each
            group's ``params`` list (torchtitan flattens for the same reason). The load
            detects which form a checkpoint holds.

    Raises:
        CheckpointWriteError: a file could not be written (e.g. the disk is full); the
            unfinished ``.tmp-*`` folder is removed and earlier checkpoints stay as they were.
    """
    root = Path(root)
    final, tmp = root / step_name(step), root / f".tmp-{step_name(step)}"
    try:
        return _save(root, tmp, final, step, model, optimizer, trainer_state, meta, rng, async_save,
                     adapters_only, plugin_state, rank_state, flatten_optimizer)
    except (OSError, RuntimeError, CheckpointException) as exc:  # DCP wraps each rank's error
        error = _write_failed(exc, tmp, root)
        if error is None:
            raise
        raise error from None


def _save(root: Path, tmp: Path, final: Path, step: int, model: nn.Module,
          optimizer: Optional[torch.optim.Optimizer], trainer_state: dict[str, Any],
          meta: dict[str, Any], rng: Optional[dict[str, Any]], async_save: bool,
          adapters_only: Optional[bool], plugin_state: Optional[dict[str, Any]],
          rank_state: Optional[dict[str, dict]], flatten_optimizer: bool) -> PendingSave:
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rng is not None:
        (tmp / "rng" / f"rank{rank}.json").write_text(json.dumps(rng))
    for name, value in (rank_state or {}).items():
        if value:
            (tmp / name).mkdir(exist_ok=True)
            (tmp / name / f"rank{rank}.json").write_text(json.dumps(value))
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer))
        model_sd, adapters_only = _adapter_filter(model, model_sd, adapters_only)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        model_sd, adapters_only = _adapter_filter(model, get_model_state_dict(model), adapters_only)
        state = {"model": model_sd}
    if plugin_state:
        state["plugins"] = plugin_state
    if adapters_only:
        meta = {**meta, "adapters_only": True}
    future = None
    if async_save:
        future = dcp.async_save(state, checkpoint_id=str(tmp))
    else:
        dcp.save(state, checkpoint_id=str(tmp))
    _crash_point("after_dcp_write")
    pending = PendingSave(future, tmp, final, trainer_state, {"step": step, **meta})
    if not async_save:
        pending.finish()
    return pending


def load_training_state(path: str | Path, model: nn.Module,
                        optimizer: Optional[torch.optim.Optimizer],
                        plugin_state: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Load model and optimizer state (resharded to the current layout) from a checkpoint and
    return its ``trainer_state.json`` plus this rank's RNG state under ``"rng"`` (if saved).

    Optimizer state the checkpoint lacks for a parameter (one that had no gradient before the
    save: frozen, or trained later) stays absent, as it was when the
    checkpoint was saved: the optimizer creates it at the parameter's first step, exactly as
    the uninterrupted run does. A parameter whose state was saved must have all of it.

    Args:
        plugin_state: ``{state_key: {name: tensor}}`` templates of plugins' own tensors; the
            entries the checkpoint holds are loaded into them in place, and the returned dict
            lists under ``"plugins_loaded"`` the state keys that were found.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    if optimizer is not None:
        flat = saved_flat_optimizer(path)
        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        optim_sd, absent = saved_optimizer_state(optim_sd, set(model_sd), path, flat)
        model_sd, adapters_only = _adapter_filter(model, model_sd, _saved_adapters_only(path))
        state = {"model": model_sd, "optim": optim_sd}
        found = _saved_plugin_keys(path, plugin_state or {})
        if found:
            state["plugins"] = {k: plugin_state[k] for k in found}  # type: ignore[index]
        safe_load(state, str(path))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not adapters_only))
        forget_optimizer_state(model, optimizer, absent)
        # not strict: parameters without saved state get none (saved_optimizer_state)
        set_optimizer_state_dict(model, optimizer, state["optim"],
                                 options=StateDictOptions(strict=False, flatten_optimizer_state_dict=flat))
        drop_empty_optimizer_state(optimizer)
    else:
        load_model_weights(path, model, adapters_only=None)
    out = read_json(path, "trainer_state.json")
    if optimizer is not None:
        out["plugins_loaded"] = found
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    rng_file = path / "rng" / f"rank{rank}.json"
    if rng_file.exists():
        out["rng"] = read_json(path, f"rng/{rng_file.name}")
    return out


def _saved_adapters_only(path: Path) -> Optional[bool]:
    """``meta.json``'s ``adapters_only`` (``None`` without a meta.json: decide by the model)."""
    if not (path / "meta.json").exists():
        return None
    return bool(read_json(path, "meta.json").get("adapters_only"))


def _saved_plugin_keys(path: Path, templates: dict[str, Any]) -> list[str]:
    """The plugin state keys of ``templates`` that the checkpoint holds (a plugin added since
    the save starts fresh)."""
    if not templates:
        return []
    names = load_metadata(path / ".metadata").state_dict_metadata.keys()
    return [k for k in templates if any(n.startswith(f"plugins.{k}.") for n in names)]


def check_checkpoint(path: str | Path) -> None:
    """Read what a resume reads before any tensor: ``trainer_state.json``, ``meta.json`` (if
    present), the RNG states (each checked by type and range,
    :mod:`llmforge.checkpoint.state_files`) and the DCP metadata, whose shards must all be
    there and long enough. Cheap (no tensor is read), so a damaged checkpoint fails before data
    and model are built.

    Raises:
        CheckpointReadError: a file is missing, truncated or corrupt (named in the message).
        UnsafeCheckpointError: the metadata refers to code outside the allow-list.
    """
    path = Path(path)
    read_json(path, "trainer_state.json")
    if (path / "meta.json").exists():
        read_json(path, "meta.json")
    for rng in sorted((path / "rng").glob("rank*.json")):
        read_json(path, f"rng/{rng.name}")
    SafeReader(str(path)).read_metadata()


def prune_checkpoints(root: str | Path, keep_last_n: Optional[int]) -> list[Path]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints (rank 0 only)."""
    if not keep_last_n or not _is_rank0():
        return []
    old = list_checkpoints(root)[:-keep_last_n]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def load_model_weights(path: str | Path, model: nn.Module, adapters_only: Optional[bool] = False) -> None:
    """Load the ``model`` part of a checkpoint into ``model`` (materialized, any sharding).

    Args:
        adapters_only: ``True``: load only the adapter tensors (the checkpoint of an adapter
            run); ``False``: every tensor of ``model`` except adapters (e.g.
            ``model.init_from`` of a full checkpoint into a model with adapters); ``None``:
            adapters only if ``model`` has adapters.

    Raises:
        ConfigError: a full load from a checkpoint that holds only adapters.
    """
    path = Path(path)
    sd = full = get_model_state_dict(model)
    is_adapter = adapter_key_filter(model)
    if adapters_only is None:
        adapters_only = has_adapters(model)
    if adapters_only:
        sd = {k: v for k, v in sd.items() if is_adapter(k)}
        _check_adapters(path, sd)
    else:
        meta = read_json(path, "meta.json") if (path / "meta.json").exists() else {}
        if meta.get("adapters_only"):
            raise ConfigError(f"{path} holds only the adapters of "
                              f"{', '.join(meta.get('adapters_by') or ['a plugin'])} (its base is "
                              f"{meta.get('base', {}).get('description', '?')}); "
                              "load the run with `llmforge generate`/`convert to-hf` (merged), "
                              "or export merged weights with `llmforge convert to-hf` and use "
                              "model.init_from=hf:OUT")
        sd = {k: v for k, v in sd.items() if not is_adapter(k)}
    partial = len(sd) != len(full)
    state = {"model": sd}
    safe_load(state, str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not partial))


def _check_adapters(path: Path, adapters: dict[str, Any]) -> None:
    """An adapters-only load has adapters to load, and the checkpoint holds them (else the
    model would run on its base, or random weights, without a word).

    Raises:
        CheckpointReadError: the model has no adapters, or the checkpoint none of them."""
    if not adapters:
        raise CheckpointReadError(
            f"{path / 'meta.json'}: says adapters_only, but this run's algorithms add no adapters "
            "to the model; the checkpoint's meta.json is damaged or belongs to another run")
    saved = load_metadata(path / ".metadata").state_dict_metadata
    if not any(f"model.{k}" in saved for k in adapters):
        raise CheckpointReadError(
            f"{path / 'meta.json'}: says adapters_only, but {path / '.metadata'} holds no adapter "
            "tensor; the checkpoint is damaged or belongs to another run")


def read_json(path: str | Path, name: str) -> dict[str, Any]:
    """Read ``trainer_state.json``, ``meta.json`` (or another JSON file) of a checkpoint.

    ``trainer_state.json``, ``meta.json`` and ``rng/*.json`` are also checked by type and
    range (:mod:`llmforge.checkpoint.state_files`).

    Raises:
        CheckpointReadError: the file is missing, unreadable, not UTF-8 JSON or not an object,
            or an entry has the wrong type or range; the message names the file (exit code 2).
    """
    file = Path(path) / name
    check_regular(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointReadError(f"{file} is missing; the checkpoint is incomplete or damaged: "
                                  "use an older one (checkpoint.resume=PATH)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointReadError(f"{file} cannot be read ({type(exc).__name__}: {exc}); the "
                                  "checkpoint is damaged: use an older one "
                                  "(checkpoint.resume=PATH)") from None
    except (RecursionError, MemoryError) as exc:  # nested deeper than json's recursion allows
        raise CheckpointReadError(f"{file} cannot be read ({type(exc).__name__}: nested too deeply "
                                  "or too large); the checkpoint is damaged: use an older one "
                                  "(checkpoint.resume=PATH)") from None
    if not isinstance(data, dict):
        raise CheckpointReadError(f"{file} holds {type(data).__name__}, not a JSON object; the "
                                  "checkpoint is damaged")
    check = _STATE_CHECKS.get(name if not name.startswith("rng/") else "rng/")
    return check(data, file) if check is not None else data


# the type and range checks of the state files (llmforge.checkpoint.state_files)
_STATE_CHECKS = {"trainer_state.json": check_trainer_state, "meta.json": check_meta, "rng/": check_rng}
