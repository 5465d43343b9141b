"""Hugging Face checkpoints <-> llmforge models, for every family with an HF adapter.

The family-specific half (key names, layouts, ``config.json`` fields) is the family's
:class:`~llmforge.models.hf_adapter.HFAdapter` (``models/<family>/hf.py``), found from the
``config.json``'s ``model_type`` on import and from the model's class on export. This module is
the generic half: import reads safetensors shards (``model.safetensors`` or
``model.safetensors.index.json`` + shards) with ``safe_open``; for sharded (DTensor) parameters
each rank reads only the rows and columns of its own shard (whole heads where the adapter
permutes rows), so a model larger than one process's memory loads shard by shard. Export writes
shards, ``config.json`` (with the tokenizer's ``bos_token_id``/``eos_token_id`` and the dtype
under the key the installed transformers reads), ``generation_config.json`` and the tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from llmforge.data.tokenizers import load_saved
from llmforge.errors import ConfigError, LLMForgeError
from llmforge.models.llama3 import hf as llama_hf
from llmforge.models.llama3.hf import LlamaHFAdapter
from llmforge.models.spec import _registered_specs, spec_for_hf_type, spec_for_model
from llmforge.plugin import adapter_key_filter

_LEGACY = ("HF_TO_OURS", "permute_to_hf", "permute_from_hf")


def __getattr__(name: str) -> Any:  # PEP 562: Llama's names at their old home (checkpoint/peft.py)
    if name in _LEGACY:
        return getattr(llama_hf, name)
    raise AttributeError(f"module 'llmforge.checkpoint.hf' has no attribute {name!r}")


def _llama() -> Any:
    return LlamaHFAdapter()


def hf_key_to_ours(key: str) -> Optional[str]:
    """Llama's ``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.attention.wq.weight``
    (old API; families map keys with their adapter)."""
    return _llama().key_from_hf(key)


def our_key_to_hf(key: str) -> Optional[str]:
    """The inverse of :func:`hf_key_to_ours` (old API, used by the PEFT export)."""
    return _llama().key_to_hf(key)


def adapter_for_model(model: nn.Module) -> Any:
    """The HF adapter of a built model's family.

    Raises:
        LLMForgeError: the model's family has no Hugging Face adapter."""
    spec = spec_for_model(model)
    adapter = spec.adapter() if spec is not None else None
    if adapter is None:
        raise LLMForgeError(f"{type(model).__name__}: its model family has no Hugging Face adapter "
                            "(ModelSpec.hf_adapter, docs/models.md); only such models convert")
    return adapter


def adapter_for_hf(hf: dict[str, Any], where: Any = "config.json") -> Any:
    """The HF adapter for a ``config.json``'s ``model_type``.

    Raises:
        ConfigError: no registered family reads that model type."""
    spec = spec_for_hf_type(str(hf.get("model_type")))
    if spec is None:
        known = sorted(s.adapter().model_type for s in _registered_specs() if s.hf_adapter)
        raise ConfigError(f"model.init_from: {where} has model_type={hf.get('model_type')!r}; "
                          f"llmforge reads {', '.join(map(repr, known))}")
    return spec.adapter()


# ----------------------------------------------------------------------------- config
def read_hf_config(path: str | Path, key: str = "model.init_from") -> dict[str, Any]:
    """``config.json`` of an HF checkpoint folder; ``key`` names where the folder came from in
    the messages (``model.init_from``, or ``PATH`` of ``convert from-hf``).

    Raises:
        ConfigError: missing or unreadable file, or a model type no family reads.
    """
    file = Path(path) / "config.json"
    if not file.exists():
        raise ConfigError(f"{key}: {file} not found (expected a Hugging Face model folder)")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read {file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{key}: {file} holds a JSON {type(cfg).__name__}, not the object of a "
                          "Hugging Face config (keys such as model_type, hidden_size)")
    adapter_for_hf(cfg, file)
    return cfg


def model_overrides_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``model:`` keys (``name`` included) that reproduce an HF ``config.json``, by its family's
    adapter (see e.g. :meth:`llmforge.models.llama3.hf.LlamaHFAdapter.config_from_hf`)."""
    return adapter_for_hf(hf).config_from_hf(hf)


def dtype_key() -> str:
    """The ``config.json`` key of the weights' dtype that the installed transformers reads:
    ``dtype`` (transformers >= 4.56, and when it is not installed), else ``torch_dtype``."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("transformers").split(".")[:2])
    except Exception:  # noqa: BLE001 - not installed or an odd version string
        return "dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def hf_config_from_model(model: nn.Module, dtype: str = "float32",
                         token_ids: Optional[dict[str, Optional[int]]] = None,
                         adapter: Any = None) -> dict[str, Any]:
    """The ``config.json`` of a built model (its family's fields, the dtype under
    :func:`dtype_key`, and ``bos_token_id``/``eos_token_id``/``pad_token_id`` when known)."""
    cfg = (adapter or adapter_for_model(model)).config_to_hf(model)
    cfg[dtype_key()] = dtype
    for name, value in (token_ids or {}).items():
        if value is not None:
            cfg[f"{name}_token_id"] = int(value)
    return cfg


# ---------------------------------------------------------------------------- reading
def _shard_files(path: Path) -> dict[str, Path]:
    """HF key -> safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = {str(k): path / v for k, v in weight_map.items()}
        except (OSError, ValueError, RecursionError, MemoryError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"model.init_from: {index} cannot be read ({type(exc).__name__}); "
                              "it is damaged: download the model again") from None
        root = os.path.realpath(path)
        for file in set(files.values()):  # a name like ../x, or a link, must not leave the folder
            if os.path.commonpath([os.path.realpath(file), root]) != root:
                raise ConfigError(f"model.init_from: {index} names {file}, which lies outside {path} "
                                  "(a path or symbolic link out of the folder); refused: a model "
                                  "folder reads only its own files")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise ConfigError(f"model.init_from: no model.safetensors or index in {path}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's part of ``param`` in the full tensor."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                              param.placements)
        return tuple(offset), tuple(shape)
    return (0,) * param.ndim, tuple(param.shape)


def _read_box(f: Any, key: str, offset: tuple, shape: tuple, heads: Optional[int], full_rows: int,
              adapter: Any) -> torch.Tensor:
    """Read rows/cols of ``key``; rows the adapter permutes within heads (Llama's q/k) are read
    as whole heads."""
    sl = f.get_slice(key)
    if len(shape) == 1:
        return sl[offset[0]:offset[0] + shape[0]]
    r0, r1 = offset[0], offset[0] + shape[0]
    c0, c1 = offset[1], offset[1] + shape[1]
    if heads is None:
        return sl[r0:r1, c0:c1]
    hd = full_rows // heads
    h0, h1 = r0 // hd, -(-r1 // hd)
    block = sl[h0 * hd:h1 * hd, c0:c1]
    block = adapter.from_hf_rows(block, h1 - h0)
    return block[r0 - h0 * hd:r1 - h0 * hd]


def _load_stacked(param: torch.Tensor, name: str, keys: list[str], files: dict[str, Path],
                  handles: dict[Path, Any], path: Path) -> None:
    """Fill ``param [len(keys), ...]`` from one HF tensor per index of dim 0 (the experts of a
    mixture), reading only this rank's box of each (rows of dim 0 outside it are not read).

    Raises:
        ConfigError: a key is missing or a tensor has another shape."""
    from safetensors import safe_open

    offset, shape = _local_box(param)
    parts = []
    for i in range(offset[0], offset[0] + shape[0]):
        key = keys[i]
        if key not in files:
            raise ConfigError(f"model.init_from: {path} has no tensor {key} (part {i} of {name})")
        f = handles.get(files[key]) or handles.setdefault(files[key], safe_open(str(files[key]), framework="pt"))
        sl = f.get_slice(key)
        if tuple(sl.get_shape()) != tuple(param.shape[1:]):
            raise ConfigError(f"model.init_from: {key} has shape {tuple(sl.get_shape())}, the model "
                              f"expects {tuple(param.shape[1:])} for each of {name}")
        parts.append(sl[tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))])
    local = param.to_local() if hasattr(param, "to_local") else param
    with torch.no_grad():
        local.copy_(torch.stack(parts).to(local.dtype))


def load_hf_weights(model: nn.Module, path: str | Path) -> int:
    """Copy an HF checkpoint into a materialized llmforge model of the same family (plain or
    sharded); returns the number of tensors loaded.

    Raises:
        ConfigError: a parameter of the model has no tensor in the checkpoint, or shapes differ.
    """
    from safetensors import safe_open

    path = Path(path)
    files = _shard_files(path)
    adapter = adapter_for_model(model)
    ours = {adapter.key_from_hf(k): k for k in files if adapter.key_from_hf(k)}
    tied = adapter.tied(model)
    loaded = 0
    handles: dict[Path, Any] = {}
    is_adapter = adapter_key_filter(model)
    try:
        for name, param in model.named_parameters():
            if is_adapter(name):
                continue  # a plugin's adapters are initialized by the plugin, not loaded
            stacked = adapter.stacked_keys(model, name)
            if stacked is not None:
                _load_stacked(param, name, stacked, files, handles, path)
                loaded += 1
                continue
            hf_key = ours.get(name)
            if hf_key is None:
                if name == "output.weight" and tied:
                    continue
                raise ConfigError(f"model.init_from: {path} has no tensor for {name} "
                                  f"(expected {adapter.key_to_hf(name)})")
            file = files[hf_key]
            f = handles.get(file) or handles.setdefault(file, safe_open(str(file), framework="pt"))
            full_shape = tuple(f.get_slice(hf_key).get_shape())
            if full_shape != tuple(param.shape):
                raise ConfigError(f"model.init_from: {hf_key} has shape {full_shape}, the model "
                                  f"expects {tuple(param.shape)} for {name}")
            heads = adapter.permuted_heads(model, name)
            offset, shape = _local_box(param)
            block = _read_box(f, hf_key, offset, shape, heads, full_shape[0], adapter)
            local = param.to_local() if hasattr(param, "to_local") else param
            with torch.no_grad():
                local.copy_(block.to(local.dtype))
            loaded += 1
    finally:
        handles.clear()
    return loaded


# ---------------------------------------------------------------------------- writing
def hf_state_dict(model: nn.Module, adapter: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_key, tensor)`` for every weight of a plain (unsharded) llmforge model (``adapter``:
    its family's; default: found from the model's class)."""
    adapter = adapter or adapter_for_model(model)
    tied = adapter.tied(model)
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and tied:
            continue
        stacked = adapter.stacked_keys(model, name)
        if stacked is not None:  # one HF key per index of dim 0 (a mixture's experts)
            yield from ((k, part.contiguous()) for k, part in zip(stacked, tensor.detach().unbind(0)))
            continue
        key = adapter.key_to_hf(name)
        if key is None:
            continue
        t = tensor.detach()
        heads = adapter.permuted_heads(model, name)
        if heads is not None:
            t = adapter.to_hf_rows(t, heads)
        yield key, t.contiguous()


def save_hf(model: nn.Module, out: str | Path, tokenizer_dir: Optional[Path] = None,
            max_shard_bytes: int = 5 * 1024**3, dtype: Optional[torch.dtype] = None,
            adapter: Any = None) -> Path:
    """Write ``config.json``, ``generation_config.json``, safetensors shards (+ index when more
    than one) and tokenizer files that ``AutoModelForCausalLM.from_pretrained`` (the family's
    ``*ForCausalLM``) and ``AutoTokenizer`` load; ``generate`` then stops at the tokenizer's EOS.

    Raises:
        LLMForgeError: the model's family has no Hugging Face adapter.
        ConfigError: the adapter refuses the model's config (nothing is written)."""
    from safetensors.torch import save_file

    adapter = adapter or adapter_for_model(model)  # refuse before anything is written
    dt = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    ids = _token_ids(tokenizer_dir)
    config = hf_config_from_model(model, dt, ids, adapter)  # the adapter may refuse the model too
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in hf_state_dict(model, adapter):
        t = t.to(dtype) if dtype is not None else t
        nbytes = t.numel() * t.element_size()
        if size + nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {k: n for n, s in zip(names, shards) for k in s}
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    gen = {"_from_model_config": True, **{f"{k}_token_id": v for k, v in ids.items() if v is not None}}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    if tokenizer_dir is not None:
        _export_tokenizer(tokenizer_dir, out)
    _readable(out)
    return out


def _token_ids(tokenizer_dir: Optional[Path]) -> dict[str, Optional[int]]:
    """``bos``/``eos``/``pad`` ids of a saved llmforge tokenizer ({} without one)."""
    if tokenizer_dir is None:
        return {}
    tok = load_saved(tokenizer_dir)
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}


def _readable(folder: Path) -> None:
    """Give every file in ``folder`` the mode a plain ``open`` would (0666 minus the umask):
    safetensors writes owner-only temporary files and renames them."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def _export_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """Copy a saved llmforge tokenizer as HF files (tokenizer.json + tokenizer_config.json)."""
    tok = load_saved(tokenizer_dir)
    if (tokenizer_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFFastTokenizer
        from tokenizers.processors import TemplateProcessing

        names = {i: getattr(tok, f"{n}_token", None) for i, n in ((0, "bos"), (1, "eos"), (2, "pad"))}
        fast = HFFastTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        bos = names[0]
        if fast.post_processor is None and bos and fast.token_to_id(bos) is not None:
            # llmforge trains every document after BOS; like Meta's Llama 3 tokenizer.json, the
            # exported one adds it (our own loader encodes with add_special_tokens=False)
            fast.post_processor = TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, fast.token_to_id(bos))])
        (out / "tokenizer.json").write_text(fast.to_str(pretty=True))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[0],
               "eos_token": names[1], "pad_token": names[2], "model_max_length": 1 << 30}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    else:  # a tiktoken BPE file: shipped as is (HF's Llama 3 repos carry original/tokenizer.model)
        for f in tokenizer_dir.iterdir():
            if f.is_file():
                (out / "original").mkdir(exist_ok=True)
                shutil.copy(f, out / "original" / f.name)
