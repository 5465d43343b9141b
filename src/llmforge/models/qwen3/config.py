"""Qwen3's ``model:`` YAML keys (:class:`Qwen3Config`), its shape (:class:`Qwen3Args`), the
presets of the published dense models and the config -> shape conversion. Imports no torch.

Shapes are those of the ``config.json`` files of Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B (vocabulary
151,936, RoPE theta 1,000,000, RMSNorm eps 1e-6, 40,960 positions, head dim 128). Parameter
counts (all parameters, tied weights once; equal to transformers' ``Qwen3ForCausalLM``):

==========  ==============  =====  ======  ===  ===  ======  ====
preset      params          dim    layers  H    K    ffn     tied
==========  ==============  =====  ======  ===  ===  ======  ====
debug       6,032,128       256    4       8    4    768     yes
qwen3_0_6b  596,049,920     1024   28      16   8    3072    yes
qwen3_1_7b  1,720,574,976   2048   28      16   8    6144    yes
qwen3_4b    4,022,468,096   2560   36      32   8    9728    yes
qwen3_8b    8,190,735,360   4096   36      32   8    12288   no
qwen3_14b   14,768,307,200  5120   40      40   8    17408   no
qwen3_32b   32,762,123,264  5120   64      64   8    25600   no
==========  ==============  =====  ======  ===  ===  ======  ====
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from llmforge.config.schema import ModelConfig
from llmforge.errors import ConfigError
from llmforge.models.spec import MemoryShape, cfg_get, check_shape_int

__all__ = ["Qwen3Config", "Qwen3Args", "PRESETS", "qwen3_args_from_config", "memory_shape"]


@dataclass
class Qwen3Args:
    """Shape and init hyperparameters of a Qwen3 dense model (names as torchtitan's qwen3)."""

    dim: int
    """Hidden size D (HF ``hidden_size``)."""
    n_layers: int
    """Transformer blocks L."""
    n_heads: int
    """Query heads H."""
    n_kv_heads: int
    """Key/value heads K; ``n_heads % n_kv_heads == 0``."""
    head_dim: int
    """Per-head width hd, decoupled from ``dim`` (128 for every published size)."""
    hidden_dim: int
    """SwiGLU hidden width F (HF ``intermediate_size``)."""
    vocab_size: int = 151936
    """Embedding rows V."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (block norms and the per-head QK-norms)."""
    rope_theta: float = 1_000_000.0
    """RoPE base: freq_i = rope_theta ** (-2i / hd)."""
    max_seq_len: int = 40960
    """Positions covered by the RoPE table (tokens)."""
    tie_embeddings: bool = False
    """``output.weight`` is ``tok_embeddings.weight`` (0.6B, 1.7B, 4B)."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""


def _q(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool) -> Qwen3Args:
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                     hidden_dim=hidden_dim, tie_embeddings=tie)


PRESETS: Dict[str, Qwen3Args] = {
    "debug": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                       vocab_size=8192, max_seq_len=2048, tie_embeddings=True),
    "qwen3_0_6b": _q(1024, 28, 16, 3072, True),
    "qwen3_1_7b": _q(2048, 28, 16, 6144, True),
    "qwen3_4b": _q(2560, 36, 32, 9728, True),
    "qwen3_8b": _q(4096, 36, 32, 12288, False),
    "qwen3_14b": _q(5120, 40, 40, 17408, False),
    "qwen3_32b": _q(5120, 64, 64, 25600, False),
}
"""Preset name -> shape. Treat as read-only; :func:`qwen3_args_from_config` copies."""


@dataclass
class Qwen3Config(ModelConfig):
    """``model:`` with ``name: qwen3`` — a Qwen3 shape preset, each field overridable."""

    preset: Optional[str] = "debug"
    """Qwen3 shape preset: debug, qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b, qwen3_14b, qwen3_32b."""
    dim: Optional[int] = None
    """Hidden size (overrides the preset)."""
    n_layers: Optional[int] = None
    """Number of transformer blocks."""
    n_heads: Optional[int] = None
    """Number of query heads."""
    n_kv_heads: Optional[int] = None
    """Number of key/value heads; must divide n_heads."""
    head_dim: Optional[int] = None
    """Width of one attention head (not tied to dim / n_heads; even, for RoPE)."""
    hidden_dim: Optional[int] = None
    """SwiGLU hidden width."""
    vocab_size: Optional[int] = None
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    norm_eps: Optional[float] = None
    """RMSNorm epsilon."""
    rope_theta: Optional[float] = None
    """RoPE base frequency (Qwen3: 1000000)."""
    max_seq_len: Optional[int] = None
    """Longest sequence the RoPE table covers (tokens)."""
    tie_embeddings: Optional[bool] = None
    """Share the input embedding and output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights."""


_INTS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",
         "max_seq_len")
_FIELDS = _INTS + ("norm_eps", "rope_theta", "tie_embeddings", "init_std")


def qwen3_args_from_config(cfg: Any, *, family: str = "qwen3", presets: Optional[Dict[str, Any]] = None,
                           fields: tuple = (), args_cls: type = Qwen3Args) -> Any:
    """:class:`Qwen3Args` from the ``model:`` section: ``PRESETS[cfg.preset]`` (or, with
    ``preset: null``, the shape fields, all of which must be set) with every non-null field
    copied over. A family built on Qwen3 (``qwen3_moe``) passes its ``presets``, its extra
    ``fields`` (copied when not null, checked by the caller) and its ``args_cls`` (a subclass).

    Raises:
        ConfigError: unknown preset, missing or invalid shape field (names the ``model.*`` key).
    """
    presets = PRESETS if presets is None else presets
    preset = cfg_get(cfg, "preset")
    if preset is not None:
        if preset not in presets:
            raise ConfigError(f"model.preset: unknown {family} preset '{preset}'. Valid presets: "
                              f"{', '.join(presets)}; or null with every shape field set.")
        base: Dict[str, Any] = dataclasses.asdict(presets[preset])
    else:
        missing = [k for k in _INTS if k != "max_seq_len" and cfg_get(cfg, k) is None]
        if missing:
            raise ConfigError("model.preset is null, so every shape field must be set; missing: "
                              + ", ".join(f"model.{k}" for k in missing))
        base = {}
    for key in _FIELDS + tuple(fields):
        value = cfg_get(cfg, key)
        if value is not None:
            base[key] = value
    for key in _INTS:
        check_shape_int(key, base.get(key, 1))
    for key in ("norm_eps", "rope_theta", "init_std"):
        v = base.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"model.{key} must be a positive number; got {v!r}")
    if base["n_heads"] % base["n_kv_heads"]:
        raise ConfigError(f"model.n_heads ({base['n_heads']}) must be divisible by "
                          f"model.n_kv_heads ({base['n_kv_heads']})")
    if base["head_dim"] % 2:
        raise ConfigError(f"model.head_dim ({base['head_dim']}) must be even for RoPE")
    return args_cls(**base)


def memory_shape(model: Any) -> MemoryShape:
    """The widths of a Qwen3 block for the dry run (QK-norm outputs as ``extra``)."""
    a = model.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return MemoryShape(dim=a.dim, n_layers=a.n_layers, q_dim=q, kv_dim=kv, ffn_dim=a.hidden_dim,
                       vocab_size=a.vocab_size, extra=q + kv)
