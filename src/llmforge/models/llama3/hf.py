"""Llama 3 <-> Hugging Face ``LlamaForCausalLM``: key names, rotary layout, ``config.json``.

HF's ``LlamaForCausalLM`` stores each query/key projection with the rotary pairs split in
halves (``[x_0..x_{d/2-1}, x_{d/2}..x_{d-1}]`` per head), llmforge (like Meta's reference code)
interleaves them (``[x_0, x_{d/2}, x_1, ...]``); HF's ``convert_llama_weights_to_hf.py``
applies :func:`permute_to_hf` when converting and :func:`permute_from_hf` undoes it.
"""

from __future__ import annotations

from typing import Any

import torch

from llmforge.errors import ConfigError
from llmforge.models.hf_adapter import HFAdapter
from llmforge.models.llama3.config import ffn_hidden_dim

__all__ = ["HF_TO_OURS", "LlamaHFAdapter", "permute_to_hf", "permute_from_hf"]

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
"""HF key regex -> llmforge name, shared by the decoder families with Llama's module names."""


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved rotary pairs (ours, Meta) -> HF halves, per head. ``w: [n_heads*hd, D]``."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF halves -> interleaved rotary pairs; inverse of :func:`permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaHFAdapter(HFAdapter):
    """``LlamaForCausalLM`` (``model_type: llama``)."""

    family = "llama3"
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_class = "LlamaConfig"
    key_table = HF_TO_OURS

    def permuted_heads(self, model: Any, name: str) -> int | None:
        if name.endswith("attention.wq.weight"):
            return model.args.n_heads
        if name.endswith("attention.wk.weight"):
            return model.args.n_kv_heads
        return None

    def to_hf_rows(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return permute_to_hf(t, heads)

    def from_hf_rows(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return permute_from_hf(t, heads)

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``model:`` fields that reproduce an HF Llama config; absent keys take the installed
        transformers' ``LlamaConfig`` defaults (:meth:`HFAdapter.with_defaults`).

        The SwiGLU width is matched exactly: ``multiple_of = intermediate_size`` and a multiplier
        that keeps the unrounded width in ``(0, intermediate_size]``.

        Raises:
            ConfigError: a rope type other than ``llama3`` or ``default``.
        """
        hf = self.with_defaults(hf)  # absent keys: transformers' defaults (fallbacks: 5.24's)
        dim, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])
        base = int(2 * (4 * dim) / 3)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ("llama3", "default"):
            raise ConfigError(f"model.init_from: rope type {rope_type!r} is not supported (llama3 or default)")
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")} if rope_type == "llama3" else {}
        return {
            "name": "llama3", "preset": None, "dim": dim, "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": int(hf["num_attention_heads"]),
            "n_kv_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            "vocab_size": int(hf["vocab_size"]), "multiple_of": inter,
            "ffn_dim_multiplier": None if base <= inter else inter / base,
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": theta,
            "rope_scaling": scaling, "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }

    def config_to_hf(self, model: Any) -> dict[str, Any]:
        """A ``LlamaForCausalLM`` config.json for an llmforge Llama."""
        a = model.args
        cfg: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_act": "silu",
            "hidden_size": a.dim, "intermediate_size": ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier),
            "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta, "tie_word_embeddings": a.tie_embeddings,
            "attention_bias": False, "mlp_bias": False,
        }
        if a.rope_scaling:
            cfg["rope_scaling"] = {"rope_type": "llama3", **a.rope_scaling}
        return cfg
