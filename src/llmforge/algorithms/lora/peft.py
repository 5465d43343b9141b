"""LoRA adapters in PEFT's adapter format (``adapter_config.json`` + ``adapter_model.safetensors``).

``PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(BASE), OUT)`` loads the folder.
Key names follow PEFT's saved layout (no adapter name in the keys)::

    layers.N.attention.wq.lora_A.weight -> base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
    output.lora_B.weight                -> base_model.model.lm_head.lora_B.weight

HF stores q/k projections with the rotary pairs in halves per head, llmforge interleaves them
(:func:`llmforge.checkpoint.hf.permute_to_hf`); since ``P (B A) = (P B) A``, the row permutation
applies to ``lora_B`` of ``wq``/``wk`` and ``lora_A`` is unchanged. PEFT scales by
``lora_alpha / r`` like llmforge (``use_rslora: false``). Source of the format: PEFT
``src/peft/utils/save_and_load.py`` and ``tuners/lora/config.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from llmforge.errors import LLMForgeError


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor for every adapter of an unsharded llmforge Llama with LoRA."""
    from llmforge.algorithms.lora.layers import lora_modules
    from llmforge.checkpoint.hf import our_key_to_hf, permute_to_hf

    a = model.args
    out: dict[str, torch.Tensor] = {}
    for fqn, m in lora_modules(model):
        hf = our_key_to_hf(fqn + ".weight")
        if hf is None:
            raise LLMForgeError(f"LoRA layer {fqn} has no Hugging Face name; PEFT export covers "
                                "wq wk wv wo w1 w2 w3 output")
        prefix = "base_model.model." + hf[: -len(".weight")]
        lora_a, lora_b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        if fqn.endswith("attention.wq"):
            lora_b = permute_to_hf(lora_b, a.n_heads)
        elif fqn.endswith("attention.wk"):
            lora_b = permute_to_hf(lora_b, a.n_kv_heads)
        out[prefix + ".lora_A.weight"] = lora_a.contiguous()
        out[prefix + ".lora_B.weight"] = lora_b.contiguous()
    return out


def peft_config(model: nn.Module, options: dict[str, Any], base: Optional[str]) -> dict[str, Any]:
    """``adapter_config.json`` for PEFT's ``LoraConfig``."""
    from llmforge.algorithms.lora.layers import lora_modules

    targets = sorted({k.rsplit(".", 3)[-3] for k in peft_state_dict(model) if k.endswith("lora_A.weight")})
    ranks = {m.lora_rank for _, m in lora_modules(model)}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(),
        "lora_alpha": options["alpha"], "lora_dropout": options["dropout"],
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base,
    }


def save_peft(model: nn.Module, out: str | Path, options: dict[str, Any],
              base: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` to ``out``.

    Args:
        model: an unsharded llmforge Llama with LoRA adapters (not merged).
        options: the lora entry's keys (:meth:`llmforge.algorithms.lora.LoRA.options`).
        base: ``base_model_name_or_path`` (the HF folder of ``model.init_from``, or ``None``).
        dtype: cast the adapter tensors (default: as trained, float32).

    Raises:
        LLMForgeError: the model has no adapters.
    """
    from safetensors.torch import save_file

    tensors = peft_state_dict(model)
    if not tensors:
        raise LLMForgeError("the model has no LoRA adapters to export")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if dtype else v) for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(model, options, base), indent=1))
    return out
