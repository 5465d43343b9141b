"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM``: key names and ``config.json``.

The keys are Llama's plus the per-head QK-norms (``self_attn.q_norm``/``k_norm``); no tensor is
permuted, since llmforge's Qwen3 uses HF's rotate-half RoPE layout.
"""

from __future__ import annotations

from typing import Any

from llmforge.errors import ConfigError
from llmforge.models.hf_adapter import HFAdapter
from llmforge.models.llama3.hf import HF_TO_OURS

__all__ = ["Qwen3HFAdapter"]


class Qwen3HFAdapter(HFAdapter):
    """``Qwen3ForCausalLM`` (``model_type: qwen3``)."""

    family = "qwen3"
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    config_class = "Qwen3Config"
    key_table = HF_TO_OURS + [
        (r"^model\.layers\.(\d+)\.self_attn\.q_norm\.weight$", r"layers.\1.attention.q_norm.weight"),
        (r"^model\.layers\.(\d+)\.self_attn\.k_norm\.weight$", r"layers.\1.attention.k_norm.weight"),
    ]

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``model:`` keys of an HF Qwen3 ``config.json``; absent keys take the installed
        transformers' ``Qwen3Config`` defaults (:meth:`HFAdapter.with_defaults`).

        Raises:
            ConfigError: sliding-window attention, attention biases or a scaled RoPE, which
                llmforge's Qwen3 does not implement.
        """
        hf = self.with_defaults(hf)  # absent keys: transformers' defaults (fallbacks: 5.24's)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10_000.0)
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        unsupported = [f"{k}={hf[k]!r}" for k in ("use_sliding_window", "attention_bias") if hf.get(k)]
        if rope_type != "default":
            unsupported.append(f"rope_type={rope_type!r}")
        if unsupported:
            raise ConfigError(f"model.init_from: Qwen3 config with {', '.join(unsupported)} is not "
                              "supported (llmforge's qwen3 has full attention, no biases, plain RoPE)")
        n_heads = int(hf["num_attention_heads"])
        return {
            "name": "qwen3", "preset": None, "dim": int(hf["hidden_size"]),
            "n_layers": int(hf["num_hidden_layers"]), "n_heads": n_heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or 32),
            "head_dim": int(hf.get("head_dim") or 128),
            "hidden_dim": int(hf["intermediate_size"]), "vocab_size": int(hf["vocab_size"]),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": theta,
            "max_seq_len": int(hf.get("max_position_embeddings", 32768)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }

    def config_to_hf(self, model: Any) -> dict[str, Any]:
        """A ``Qwen3ForCausalLM`` config.json for an llmforge Qwen3."""
        a = model.args
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_act": "silu", "hidden_size": a.dim, "intermediate_size": a.hidden_dim,
            "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
            "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
            "tie_word_embeddings": a.tie_embeddings, "attention_bias": False,
            "use_sliding_window": False, "attention_dropout": 0.0,
        }
