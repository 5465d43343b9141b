"""Llama 3 shape presets and the ``model:`` config -> :class:`LlamaArgs` conversion.

Shapes are those of Meta's published ``params.json`` files (Llama 3.1 8B/70B/405B, Llama 3.2
1B/3B). Parameter counts (all parameters, tied weights once):

==============  ===============  =====  ======  ====  ===  ======  =====  ====
preset          params           dim    layers  H     K    ffn     tied   rope factor
==============  ===============  =====  ======  ====  ===  ======  =====  ====
debug           7,145,728        256    4       8     4    704     no     none
llama3_1b       1,235,814,400    2048   16      32    8    8192    yes    32
llama3_3b       3,212,749,824    3072   28      24    8    8192    yes    32
llama3_8b       8,030,261,248    4096   32      32    8    14336   no     8
llama3_70b      70,553,706,496   8192   80      64    8    28672   no     8
llama3_405b     405,853,388,800  16384  126     128   8    53248   no     8
==============  ===============  =====  ======  ====  ===  ======  =====  ====
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Mapping, Optional

from llmforge.errors import ConfigError
from llmforge.models.llama import ROPE_SCALING_KEYS, LlamaArgs

__all__ = ["PRESETS", "llama_args_from_config", "OVERRIDABLE_FIELDS"]


def _rope_scaling(factor: float) -> Dict[str, Any]:
    return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


_LLAMA3 = dict(vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072)

PRESETS: Dict[str, LlamaArgs] = {
    "debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                       multiple_of=64, max_seq_len=2048, rope_theta=500000.0),
    "llama3_1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                           ffn_dim_multiplier=1.5, multiple_of=256, tie_embeddings=True,
                           rope_scaling=_rope_scaling(32.0), **_LLAMA3),
    "llama3_3b": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                           ffn_dim_multiplier=1.0, multiple_of=256, tie_embeddings=True,
                           rope_scaling=_rope_scaling(32.0), **_LLAMA3),
    "llama3_8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_dim_multiplier=1.3, multiple_of=1024,
                           rope_scaling=_rope_scaling(8.0), **_LLAMA3),
    "llama3_70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            ffn_dim_multiplier=1.3, multiple_of=4096,
                            rope_scaling=_rope_scaling(8.0), **_LLAMA3),
    "llama3_405b": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                             ffn_dim_multiplier=1.2, multiple_of=4096,
                             rope_scaling=_rope_scaling(8.0), **_LLAMA3),
}
"""Preset name -> shape. Treat as read-only; :func:`llama_args_from_config` copies."""

OVERRIDABLE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                      "ffn_dim_multiplier", "multiple_of", "norm_eps", "rope_theta",
                      "rope_scaling", "max_seq_len", "tie_embeddings", "init_std")
"""``model:`` keys copied onto the preset when not null."""

_REQUIRED_WITHOUT_PRESET = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                            "multiple_of", "max_seq_len")


def _plain(value: Any) -> Any:
    """OmegaConf containers -> plain Python (dict/list); other values unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _get(cfg: Any, key: str) -> Any:
    if isinstance(cfg, Mapping):
        return _plain(cfg.get(key))
    return _plain(getattr(cfg, key, None))


def _check_rope_scaling(value: Any) -> Optional[Dict[str, Any]]:
    if value is None or (isinstance(value, Mapping) and not value):
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.rope_scaling must be a mapping with keys "
                          f"{', '.join(ROPE_SCALING_KEYS)} (or {{}} to disable); got {value!r}")
    value = dict(value)
    value.pop("rope_type", None)  # Hugging Face spelling: rope_type: llama3
    missing = [k for k in ROPE_SCALING_KEYS if k not in value]
    extra = [k for k in value if k not in ROPE_SCALING_KEYS]
    if missing or extra:
        raise ConfigError(
            f"model.rope_scaling needs exactly the keys {', '.join(ROPE_SCALING_KEYS)}; "
            f"missing: {', '.join(missing) or 'none'}; unknown: {', '.join(extra) or 'none'}")
    try:
        out = {k: float(value[k]) for k in ROPE_SCALING_KEYS}
    except (TypeError, ValueError):
        raise ConfigError(f"model.rope_scaling values must be numbers; got {value!r}") from None
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    if out["factor"] <= 0 or out["original_max_position_embeddings"] <= 0:
        raise ConfigError(f"model.rope_scaling.factor and original_max_position_embeddings "
                          f"must be > 0; got {value!r}")
    if not 0 < out["low_freq_factor"] < out["high_freq_factor"]:
        raise ConfigError(
            "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor; got "
            f"low_freq_factor={out['low_freq_factor']}, "
            f"high_freq_factor={out['high_freq_factor']}")
    return out


def llama_args_from_config(cfg: Any) -> LlamaArgs:
    """Build :class:`LlamaArgs` from the ``model:`` section (a ``ModelConfig``, an OmegaConf
    ``DictConfig`` of it, or a plain mapping).

    Starts from ``PRESETS[cfg.preset]`` (or, with ``preset: null``, from the shape fields, all
    of which must then be set), then copies every non-null field of :data:`OVERRIDABLE_FIELDS`.
    A null ``rope_scaling`` keeps the preset's scaling; ``rope_scaling: {}`` disables it.

    Raises:
        ConfigError: unknown preset, missing shape field, or an invalid shape; the message names
            the ``model.*`` keys and values.
    """
    preset = _get(cfg, "preset")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset '{preset}'. "
                              f"Valid presets: {', '.join(PRESETS)}; or null with every shape "
                              "field set.")
        base: Dict[str, Any] = dataclasses.asdict(PRESETS[preset])
    else:
        missing = [k for k in _REQUIRED_WITHOUT_PRESET if _get(cfg, k) is None]
        if missing:
            raise ConfigError(
                "model.preset is null, so every shape field must be set; missing: "
                + ", ".join(f"model.{k}" for k in missing))
        base = {}
    for key in OVERRIDABLE_FIELDS:
        value = _get(cfg, key)
        if value is not None:
            base[key] = value
    base["rope_scaling"] = _check_rope_scaling(base.get("rope_scaling"))

    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                "max_seq_len"):
        v = base[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"model.{key} must be a positive integer; got {v!r}")
    for key in ("norm_eps", "rope_theta", "init_std"):
        v = base.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"model.{key} must be a positive number; got {v!r}")
    fm = base.get("ffn_dim_multiplier")
    if fm is not None and (isinstance(fm, bool) or not isinstance(fm, (int, float)) or fm <= 0):
        raise ConfigError(f"model.ffn_dim_multiplier must be a positive number or null; got {fm!r}")
    dim, nh, nkv = base["dim"], base["n_heads"], base["n_kv_heads"]
    if dim % nh:
        raise ConfigError(f"model.dim ({dim}) must be divisible by model.n_heads ({nh})")
    if nh % nkv:
        raise ConfigError(
            f"model.n_heads ({nh}) must be divisible by model.n_kv_heads ({nkv})")
    if (dim // nh) % 2:
        raise ConfigError(f"head dim model.dim / model.n_heads = {dim}/{nh} = {dim // nh} must "
                          "be even for RoPE")
    return LlamaArgs(**copy.deepcopy(base))
