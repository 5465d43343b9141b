"""Qwen3-MoE's ``model:`` YAML keys (:class:`Qwen3MoeConfig`), its shape (:class:`Qwen3MoeArgs`),
the presets of the published models and the config -> shape conversion. Imports no torch.

The attention and every dense key are Qwen3's (:mod:`llmforge.models.qwen3.config`); the
mixture-of-experts keys carry transformers' ``Qwen3MoeConfig`` names (``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
``mlp_only_layers``, ``router_aux_loss_coef``). Shapes of the presets are those of the
``config.json`` files of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B. Parameter counts on the
meta device (equal to transformers' ``Qwen3MoeForCausalLM``; "active" = what one token's forward
uses: every parameter except the ``num_experts - num_experts_per_tok`` unused experts per layer):

===============  ================  ===============  ====  ======  ===  ===  =======  =====
preset           params            active           dim   layers  H    K    experts  top-k
===============  ================  ===============  ====  ======  ===  ===  =======  =====
debug            9,972,480         5,253,888        256   4       8    4    8        2
qwen3_30b_a3b    30,532,122,624    3,353,032,704    2048  48      32   4    128      8
qwen3_235b_a22b  235,093,634,560   22,190,763,520   4096  94      64   4    128      8
===============  ================  ===============  ====  ======  ===  ===  =======  =====
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from llmforge.errors import ConfigError
from llmforge.models.qwen3.config import Qwen3Args, Qwen3Config, qwen3_args_from_config
from llmforge.models.spec import MemoryShape, check_shape_int

__all__ = ["Qwen3MoeConfig", "Qwen3MoeArgs", "PRESETS", "qwen3_moe_args_from_config", "memory_shape",
           "is_sparse_layer", "check_tokens"]


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    """Qwen3's shape plus the sparse feed-forward (names as transformers' ``Qwen3MoeConfig``).
    ``hidden_dim`` is the width of the dense SwiGLU of the layers that have one
    (``mlp_only_layers``, ``decoder_sparse_step``); HF ``intermediate_size``."""

    num_experts: int = 8
    """Experts per sparse layer E."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k), ``1 <= k <= E``."""
    moe_intermediate_size: int = 256
    """SwiGLU hidden width of one expert."""
    norm_topk_prob: bool = True
    """Renormalize the k selected routing probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` (and not in mlp_only_layers)."""
    mlp_only_layers: List[int] = field(default_factory=list)
    """Layer indices with a dense SwiGLU instead of experts."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the optimized loss."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE); 0 = off."""
    capacity_factor: Optional[float] = None
    """Tokens an expert takes per batch, as a multiple of an even share; None = dropless."""
    router_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: update speed of the per-expert routing
    bias after each optimizer step; 0 = off."""


def is_sparse_layer(a: Qwen3MoeArgs, i: int) -> bool:
    """Whether layer ``i`` has experts (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    return i not in a.mlp_only_layers and a.num_experts > 0 and (i + 1) % a.decoder_sparse_step == 0


def _m(dim: int, n_layers: int, n_heads: int, hidden_dim: int, moe: int) -> Qwen3MoeArgs:
    return Qwen3MoeArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128,
                        hidden_dim=hidden_dim, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=moe, norm_topk_prob=True)


PRESETS: Dict[str, Qwen3MoeArgs] = {
    "debug": Qwen3MoeArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                          vocab_size=8192, max_seq_len=2048, tie_embeddings=True, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=256),
    "qwen3_30b_a3b": _m(2048, 48, 32, 6144, 768),
    "qwen3_235b_a22b": _m(4096, 94, 64, 12288, 1536),
}
"""Preset name -> shape. Treat as read-only; :func:`qwen3_moe_args_from_config` copies."""


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """``model:`` with ``name: qwen3_moe`` — a Qwen3-MoE shape preset, each field overridable."""

    preset: Optional[str] = "debug"
    """Qwen3-MoE shape preset: debug, qwen3_30b_a3b, qwen3_235b_a22b."""
    num_experts: Optional[int] = None
    """Experts per sparse layer (HF num_experts)."""
    num_experts_per_tok: Optional[int] = None
    """Experts per token, top-k; 1 <= k <= num_experts."""
    moe_intermediate_size: Optional[int] = None
    """SwiGLU hidden width of one expert."""
    norm_topk_prob: Optional[bool] = None
    """Renormalize the top-k routing probabilities to sum to 1 (Qwen3-MoE: true)."""
    decoder_sparse_step: Optional[int] = None
    """Every decoder_sparse_step-th layer is sparse (1 = all)."""
    mlp_only_layers: Optional[List[int]] = None
    """Layer indices that keep a dense SwiGLU of width hidden_dim."""
    router_aux_loss_coef: Optional[float] = None
    """Load-balancing loss weight (Switch Transformer / HF router_aux_loss_coef; default 0.001; 0 = off)."""
    router_z_loss_coef: Optional[float] = None
    """Router z-loss weight (ST-MoE, e.g. 0.001; default 0 = off)."""
    capacity_factor: Optional[float] = None
    """Expert capacity as a multiple of an even share of the tokens (e.g. 1.25); null = dropless."""
    router_bias_update_rate: Optional[float] = None
    """DeepSeek-V3 auxiliary-loss-free balancing: per-expert routing bias moved by this much after each step (e.g. 0.001); default 0 = off."""


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
               "router_z_loss_coef", "capacity_factor", "router_bias_update_rate")


def qwen3_moe_args_from_config(cfg: Any) -> Qwen3MoeArgs:
    """:class:`Qwen3MoeArgs` from the ``model:`` section (preset, then every non-null field).

    Raises:
        ConfigError: unknown preset, invalid shape, ``num_experts_per_tok`` outside
            ``1..num_experts``, a ``capacity_factor`` <= 0, a negative loss weight, or an
            ``mlp_only_layers`` index outside ``0..n_layers-1``; the message names the key and
            the valid values.
    """
    a = qwen3_args_from_config(cfg, family="qwen3_moe", presets=PRESETS, fields=_MOE_FIELDS,
                               args_cls=Qwen3MoeArgs)
    for key in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
        check_shape_int(key, getattr(a, key))
    k = a.num_experts_per_tok
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= a.num_experts:
        raise ConfigError(f"model.num_experts_per_tok must be an integer from 1 to model.num_experts "
                          f"({a.num_experts}); got {k!r}")
    if not isinstance(a.norm_topk_prob, bool):
        raise ConfigError(f"model.norm_topk_prob must be true or false; got {a.norm_topk_prob!r}")
    for key in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
        v = getattr(a, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"model.{key} must be a finite number >= 0 (0 = off); got {v!r}")
    cf = a.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                           or not (math.isfinite(cf) and cf > 0)):
        raise ConfigError(f"model.capacity_factor must be a number > 0 (e.g. 1.25) or null for "
                          f"dropless routing; got {cf!r}")
    layers = a.mlp_only_layers
    if not isinstance(layers, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < a.n_layers for i in layers):
        raise ConfigError(f"model.mlp_only_layers must be a list of layer indices from 0 to "
                          f"{a.n_layers - 1}; got {layers!r}")
    a.mlp_only_layers = list(layers)
    if not any(is_sparse_layer(a, i) for i in range(a.n_layers)):
        if a.decoder_sparse_step > a.n_layers:
            why = (f"model.decoder_sparse_step={a.decoder_sparse_step} is larger than the "
                   f"{a.n_layers} layers (layer i has experts when i + 1 is a multiple of it); "
                   f"use 1 to {a.n_layers}")
        else:
            why = (f"model.mlp_only_layers={a.mlp_only_layers} makes every layer that "
                   f"model.decoder_sparse_step={a.decoder_sparse_step} would give experts dense; "
                   "leave at least one out")
        raise ConfigError(f"model: this Qwen3-MoE has no layer with experts: {why}, or use "
                          "model.name=qwen3 for a dense model")
    return a


def check_tokens(model_cfg: Any, tokens: int) -> None:
    """The spec's ``check_tokens`` hook: refuse a ``capacity_factor`` that leaves less than one
    token per expert in a forward of ``tokens`` tokens on one rank (a micro-batch: rows x
    seq_len). An expert takes ``ceil(capacity_factor x tokens x k / E)`` assignments
    (:class:`llmforge.models.qwen3_moe.moe.MoE`): below 1 nearly every token is dropped.

    Raises:
        ConfigError: names ``model.capacity_factor``, the tokens per expert it leaves and the
            smallest factor that gives one.
    """
    a = qwen3_moe_args_from_config(model_cfg)
    cf = a.capacity_factor
    if cf is None:
        return
    per_expert = cf * tokens * a.num_experts_per_tok / a.num_experts
    if per_expert < 1:
        least = a.num_experts / (tokens * a.num_experts_per_tok)
        raise ConfigError(
            f"model.capacity_factor={cf:g} leaves {per_expert:.3g} tokens per expert in a forward "
            f"of {tokens:,} tokens (capacity_factor x tokens x num_experts_per_tok / num_experts = "
            f"{cf:g} x {tokens} x {a.num_experts_per_tok} / {a.num_experts}): nearly every token "
            f"would be dropped; use at least {least:.3g} (one token per expert), typically 1.0 to "
            "2.0, or null for dropless routing")


def memory_shape(model: Any) -> MemoryShape:
    """The widths of a Qwen3-MoE block for the dry run, per token: the k routed experts' SwiGLU
    widths as ``ffn_dim``; as ``extra`` the QK-norm outputs, the k dispatched copies of the
    input and of the expert outputs (``2 k D``) and the router's logits and probabilities
    (``2 E``)."""
    a = model.args
    q, kv, k = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.num_experts_per_tok
    return MemoryShape(dim=a.dim, n_layers=a.n_layers, q_dim=q, kv_dim=kv,
                       ffn_dim=k * a.moe_intermediate_size, vocab_size=a.vocab_size,
                       extra=q + kv + 2 * k * a.dim + 2 * a.num_experts)
