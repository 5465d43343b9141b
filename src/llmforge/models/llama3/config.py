"""Llama 3's ``model:`` YAML keys (:class:`Llama3Config`), its shape (:class:`LlamaArgs`), the
presets and the config -> shape conversion. Imports no torch (the loader validates with it).

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
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from llmforge.config.schema import ModelConfig
from llmforge.errors import ConfigError
from llmforge.models.spec import WIDTH_LIMIT, cfg_get as _get, check_shape_int, MemoryShape

__all__ = ["Llama3Config", "LlamaArgs", "PRESETS", "llama_args_from_config", "OVERRIDABLE_FIELDS",
           "ROPE_SCALING_KEYS", "ffn_hidden_dim"]

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


@dataclass
class LlamaArgs:
    """Shape and init hyperparameters of a Llama 3 model (names as in Meta's ``params.json``)."""

    dim: int
    """Hidden size D."""
    n_layers: int
    """Number of transformer blocks L."""
    n_heads: int
    """Query heads H; ``dim % n_heads == 0``, head dim = dim // n_heads."""
    n_kv_heads: int
    """Key/value heads K (grouped-query attention); ``n_heads % n_kv_heads == 0``."""
    vocab_size: int
    """Embedding rows V."""
    ffn_dim_multiplier: Optional[float] = None
    """Multiplier of the SwiGLU hidden size (see :func:`ffn_hidden_dim`)."""
    multiple_of: int = 256
    """SwiGLU hidden size is rounded up to a multiple of this."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base: freq_i = rope_theta ** (-2i / hd)."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """Llama 3.1 frequency scaling {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}; None (or {}) = plain RoPE."""
    max_seq_len: int = 2048
    """Positions covered by the RoPE table (tokens); longer inputs raise ValueError."""
    tie_embeddings: bool = False
    """``output.weight`` is ``tok_embeddings.weight`` (Llama 3.2 1B/3B)."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """SwiGLU hidden size, as in Meta's ``FeedForward.__init__`` (llama-models / torchtitan).

    ``h = int(2 * (4 * dim) / 3)``; if ``ffn_dim_multiplier``: ``h = int(ffn_dim_multiplier * h)``;
    then ``h`` is rounded up to a multiple of ``multiple_of``. E.g. 8B (4096, 1024, 1.3) -> 14336.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)



@dataclass
class Llama3Config(ModelConfig):
    """``model:`` with ``name: llama3`` — a Llama 3 shape preset, each field overridable."""

    preset: Optional[str] = "debug"
    """Llama 3 shape preset: debug, llama3_1b, llama3_3b, llama3_8b, llama3_70b, llama3_405b."""
    dim: Optional[int] = None
    """Hidden size (overrides the preset)."""
    n_layers: Optional[int] = None
    """Number of transformer blocks."""
    n_heads: Optional[int] = None
    """Number of query heads."""
    n_kv_heads: Optional[int] = None
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    vocab_size: Optional[int] = None
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    ffn_dim_multiplier: Optional[float] = None
    """Multiplier of the SwiGLU hidden size (Llama 3: 1.3 for 8B/70B, 1.2 for 405B)."""
    multiple_of: Optional[int] = None
    """SwiGLU hidden size is rounded up to a multiple of this."""
    norm_eps: Optional[float] = None
    """RMSNorm epsilon."""
    rope_theta: Optional[float] = None
    """RoPE base frequency (Llama 3: 500000)."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """Llama 3.1 RoPE scaling: {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}; null keeps the preset's, ``{}`` disables scaling."""
    max_seq_len: Optional[int] = None
    """Longest sequence the RoPE table covers (tokens)."""
    tie_embeddings: Optional[bool] = None
    """Share the input embedding and output projection (Llama 3.2 1B/3B)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights."""


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
        check_shape_int(key, base[key])
    for key in ("norm_eps", "rope_theta", "init_std"):
        v = base.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"model.{key} must be a positive number; got {v!r}")
    fm = base.get("ffn_dim_multiplier")
    if fm is not None and (isinstance(fm, bool) or not isinstance(fm, (int, float)) or not 0 < fm < math.inf):
        raise ConfigError(f"model.ffn_dim_multiplier must be a positive finite number or null; got {fm!r}")
    width = ffn_hidden_dim(base["dim"], base["multiple_of"], fm)
    if not 1 <= width <= WIDTH_LIMIT:  # int() of a small multiplier is 0; a huge one overflows torch
        shown = f"{width:,}" if width < 10**30 else f"a {len(str(width))}-digit number"
        raise ConfigError(f"model.ffn_dim_multiplier={fm} with model.dim={base['dim']} gives a feed-forward "
                          f"width of {shown}; llmforge builds 1 to {WIDTH_LIMIT:,}: choose another multiplier")
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


def memory_shape(model: Any) -> Any:
    """The widths of a Llama block for the dry run's activation estimate."""
    a = model.args
    return MemoryShape(dim=a.dim, n_layers=a.n_layers, q_dim=a.n_heads * a.head_dim,
                       kv_dim=a.n_kv_heads * a.head_dim,
                       ffn_dim=ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier),
                       vocab_size=a.vocab_size)
