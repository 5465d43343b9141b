"""Qwen3-MoE <-> Hugging Face ``Qwen3MoeForCausalLM``: key names and ``config.json``.

The keys are Qwen3's (:mod:`llmforge.models.qwen3.hf`; a dense layer's ``mlp.*_proj`` too),
plus the router ``mlp.gate.weight`` and the experts, which HF checkpoints store one key per
expert (``mlp.experts.{e}.gate_proj.weight`` ``[I, D]``, ``up_proj`` ``[I, D]``,
``down_proj`` ``[D, I]``; transformers 5 fuses them on load) and llmforge as ``[E, ...]``
parameters: :meth:`Qwen3MoeHFAdapter.stacked_keys` lists them, the generic reader stacks them
(reading only the experts of a rank's shard) and the writer splits them.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from llmforge.errors import ConfigError
from llmforge.models.qwen3.hf import Qwen3HFAdapter

__all__ = ["Qwen3MoeHFAdapter"]

_EXPERT = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w1|w2|w3)$")
_HF_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class Qwen3MoeHFAdapter(Qwen3HFAdapter):
    """``Qwen3MoeForCausalLM`` (``model_type: qwen3_moe``)."""

    family = "qwen3_moe"
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    training_keys = ("router_aux_loss_coef",)
    key_table = Qwen3HFAdapter.key_table + [
        (r"^model\.layers\.(\d+)\.mlp\.gate\.weight$", r"layers.\1.feed_forward.router.weight"),
    ]

    def stacked_keys(self, model: Any, name: str) -> Optional[list[str]]:
        """``layers.{i}.feed_forward.experts.w1`` -> ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``
        for ``e`` in ``0..E-1`` (w3: ``up_proj``, w2: ``down_proj``)."""
        m = _EXPERT.match(name)
        if m is None:
            return None
        layer, proj = m.group(1), _HF_PROJ[m.group(2)]
        return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                for e in range(model.args.num_experts)]

    v4_expert_modules = ("gate_proj", "up_proj", "down_proj")
    runtime_expert_params = ("gate_up_proj", "down_proj")  # Qwen3MoeExperts' registration order
    _RUNTIME = {"w1": ("gate_up_proj", 0, 2), "w3": ("gate_up_proj", 1, 2), "w2": ("down_proj", 0, 1)}

    def runtime_expert_param(self, name: str) -> Optional[tuple[str, str, int, int]]:
        """``layers.{i}.feed_forward.experts.w1`` -> ``("model.layers.{i}.mlp.experts",
        "gate_up_proj", 0, 2)``: transformers 5's ``Qwen3MoeExperts`` fuses gate (w1) and up
        (w3) as ``gate_up_proj [E, 2I, D]`` (gate rows first: its forward ``chunk(2)``s the
        product), and keeps ``down_proj [E, D, I]`` (w2)."""
        m = _EXPERT.match(name)
        if m is None:
            return None
        param, part, parts = self._RUNTIME[m.group(2)]
        return f"model.layers.{m.group(1)}.mlp.experts", param, part, parts

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``model:`` keys of an HF Qwen3-MoE ``config.json`` (Qwen3's, plus the experts').

        Raises:
            ConfigError: sliding-window attention, attention biases or a scaled RoPE.
        """
        out = super().config_from_hf(hf)
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        out.update({
            "name": "qwen3_moe", "num_experts": int(experts),
            "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
            "mlp_only_layers": [int(i) for i in hf.get("mlp_only_layers") or []],
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        })
        return out

    def config_to_hf(self, model: Any) -> dict[str, Any]:
        """A ``Qwen3MoeForCausalLM`` config.json for an llmforge Qwen3-MoE.

        Raises:
            ConfigError: the model routes with a loss-free balancing bias
                (``router_bias_update_rate > 0``), which ``Qwen3MoeForCausalLM`` has no place for.
        """
        a = model.args
        if a.router_bias_update_rate > 0:
            raise ConfigError("model.router_bias_update_rate > 0: the routing bias of loss-free "
                              "balancing has no place in Qwen3MoeForCausalLM, whose router would "
                              "choose other experts; export a run trained without it")
        return {
            **super().config_to_hf(model),
            "architectures": [self.architecture], "model_type": self.model_type,
            "num_experts": a.num_experts, "num_experts_per_tok": a.num_experts_per_tok,
            "moe_intermediate_size": a.moe_intermediate_size, "norm_topk_prob": a.norm_topk_prob,
            "decoder_sparse_step": a.decoder_sparse_step, "mlp_only_layers": list(a.mlp_only_layers),
            "router_aux_loss_coef": a.router_aux_loss_coef, "output_router_logits": False,
        }
