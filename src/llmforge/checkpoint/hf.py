"""Hugging Face Llama checkpoints <-> llmforge's Llama: config, key names, rotary layout.

HF's ``LlamaForCausalLM`` stores each query/key projection with the rotary pairs split in
halves (``[x_0..x_{d/2-1}, x_{d/2}..x_{d-1}]`` per head), llmforge (like Meta's reference code)
interleaves them (``[x_0, x_{d/2}, x_1, ...]``); HF's ``convert_llama_weights_to_hf.py``
applies :func:`permute_to_hf` when converting and :func:`permute_from_hf` undoes it.

Import reads ``config.json`` and safetensors shards (``model.safetensors`` or
``model.safetensors.index.json`` + shards) with ``safe_open``; for sharded (DTensor) parameters
each rank reads only the rows and columns of its own shard (whole heads for q/k), so a model
larger than one process's memory loads shard by shard.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from llmforge.errors import ConfigError

HF_TO_OURS = [
    (r"^model\.embed_tokens\.weight$", "tok_embeddings.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.weight$", r"layers.\1.attention.wq.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.weight$", r"layers.\1.attention.wk.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.weight$", r"layers.\1.attention.wv.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$", r"layers.\1.attention.wo.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$", r"layers.\1.feed_forward.w1.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", r"layers.\1.feed_forward.w3.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", r"layers.\1.feed_forward.w2.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attention_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
]


def _map(key: str, table: list[tuple[str, str]]) -> Optional[str]:
    for pattern, repl in table:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    return None


def hf_key_to_ours(key: str) -> Optional[str]:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.attention.wq.weight``."""
    return _map(key, HF_TO_OURS)


def _inverse(pattern: str, repl: str) -> tuple[str, str]:
    """Swap one row of :data:`HF_TO_OURS` (layer index as the only group)."""
    hf = pattern.strip("^$").replace(r"(\d+)", r"\1").replace(r"\.", ".")
    ours = "^" + re.escape(repl).replace(re.escape(r"\1"), r"(\d+)") + "$"
    return ours, hf


OURS_TO_HF = [_inverse(p, r) for p, r in HF_TO_OURS]


def our_key_to_hf(key: str) -> Optional[str]:
    """The inverse of :func:`hf_key_to_ours`."""
    return _map(key, OURS_TO_HF)


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved rotary pairs (ours, Meta) -> HF halves, per head. ``w: [n_heads*hd, D]``."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF halves -> interleaved rotary pairs; inverse of :func:`permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------- config
def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF checkpoint folder.

    Raises:
        ConfigError: missing file, or not a Llama config.
    """
    file = Path(path) / "config.json"
    if not file.exists():
        raise ConfigError(f"model.init_from: {file} not found (expected a Hugging Face Llama folder)")
    cfg = json.loads(file.read_text())
    if cfg.get("model_type") != "llama":
        raise ConfigError(f"model.init_from: {file} has model_type={cfg.get('model_type')!r}, not 'llama'")
    return cfg


def model_overrides_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``model:`` fields that reproduce an HF Llama config.

    The SwiGLU width is matched exactly: ``multiple_of = intermediate_size`` and a multiplier
    that keeps the unrounded width in ``(0, intermediate_size]``.
    """
    dim, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])
    base = int(2 * (4 * dim) / 3)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ("llama3", "default"):
        raise ConfigError(f"model.init_from: rope type {rope_type!r} is not supported (llama3 or default)")
    scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                    "original_max_position_embeddings")} if rope_type == "llama3" else {}
    return {
        "preset": None, "dim": dim, "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": int(hf["num_attention_heads"]),
        "n_kv_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        "vocab_size": int(hf["vocab_size"]), "multiple_of": inter,
        "ffn_dim_multiplier": None if base <= inter else inter / base,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)), "rope_theta": theta,
        "rope_scaling": scaling, "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def hf_config_from_model(model: nn.Module, dtype: str = "float32") -> dict[str, Any]:
    """A ``LlamaForCausalLM`` config.json for an llmforge Llama."""
    from llmforge.models.llama import ffn_hidden_dim

    a = model.args
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": a.dim, "intermediate_size": ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier),
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta, "tie_word_embeddings": a.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }
    if a.rope_scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", **a.rope_scaling}
    return cfg


# ---------------------------------------------------------------------------- reading
def _shard_files(path: Path) -> dict[str, Path]:
    """HF key -> safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
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


def _read_box(f: Any, key: str, offset: tuple, shape: tuple, heads: Optional[int], full_rows: int) -> torch.Tensor:
    """Read rows/cols of ``key``; q/k rows are permuted within heads, so whole heads are read."""
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
    block = permute_from_hf(block, h1 - h0)
    return block[r0 - h0 * hd:r1 - h0 * hd]


def load_hf_weights(model: nn.Module, path: str | Path) -> int:
    """Copy an HF Llama checkpoint into a materialized llmforge Llama (plain or sharded);
    returns the number of tensors loaded.

    Raises:
        ConfigError: a parameter of the model has no tensor in the checkpoint, or shapes differ.
    """
    from safetensors import safe_open

    path = Path(path)
    files = _shard_files(path)
    ours = {hf_key_to_ours(k): k for k in files if hf_key_to_ours(k)}
    a = model.args
    loaded = 0
    handles: dict[Path, Any] = {}
    from llmforge.algorithms.base import adapter_key_filter

    is_adapter = adapter_key_filter(model)
    try:
        for name, param in model.named_parameters():
            if is_adapter(name):
                continue  # a plugin's adapters are initialized by the plugin, not loaded
            hf_key = ours.get(name)
            if hf_key is None:
                if name == "output.weight" and a.tie_embeddings:
                    continue
                raise ConfigError(f"model.init_from: {path} has no tensor for {name} "
                                  f"(expected {our_key_to_hf(name)})")
            file = files[hf_key]
            f = handles.get(file) or handles.setdefault(file, safe_open(str(file), framework="pt"))
            full_shape = tuple(f.get_slice(hf_key).get_shape())
            if full_shape != tuple(param.shape):
                raise ConfigError(f"model.init_from: {hf_key} has shape {full_shape}, the model "
                                  f"expects {tuple(param.shape)} for {name}")
            heads = a.n_heads if name.endswith("attention.wq.weight") else (
                a.n_kv_heads if name.endswith("attention.wk.weight") else None)
            offset, shape = _local_box(param)
            block = _read_box(f, hf_key, offset, shape, heads, full_shape[0])
            local = param.to_local() if hasattr(param, "to_local") else param
            with torch.no_grad():
                local.copy_(block.to(local.dtype))
            loaded += 1
    finally:
        handles.clear()
    return loaded


# ---------------------------------------------------------------------------- writing
def hf_state_dict(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_key, tensor)`` for every weight of a plain (unsharded) llmforge Llama."""
    a = model.args
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and a.tie_embeddings:
            continue
        key = our_key_to_hf(name)
        if key is None:
            continue
        t = tensor.detach()
        if name.endswith("attention.wq.weight"):
            t = permute_to_hf(t, a.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = permute_to_hf(t, a.n_kv_heads)
        yield key, t.contiguous()


def save_hf(model: nn.Module, out: str | Path, tokenizer_dir: Optional[Path] = None,
            max_shard_bytes: int = 5 * 1024**3, dtype: Optional[torch.dtype] = None) -> Path:
    """Write ``config.json``, safetensors shards (+ index when more than one) and tokenizer
    files that ``LlamaForCausalLM.from_pretrained`` / ``AutoTokenizer`` load."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in hf_state_dict(model):
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
    dt = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config_from_model(model, dt), indent=1))
    if tokenizer_dir is not None:
        _export_tokenizer(tokenizer_dir, out)
    _readable(out)
    return out


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
    from llmforge.data.tokenizers import load_saved

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
