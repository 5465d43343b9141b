"""LoRA adapters in PEFT's adapter format (``adapter_config.json`` + ``adapter_model.safetensors``).

``PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(BASE), OUT)`` loads the folder.
Key names follow PEFT's saved layout (no adapter name in the keys)::

    layers.N.attention.wq.lora_A.weight -> base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
    output.lora_B.weight                -> base_model.model.lm_head.lora_B.weight

Names and layouts come from the model family's Hugging Face adapter (``ModelSpec.hf_adapter``):
for Llama, HF stores q/k projections with the rotary pairs in halves per head and llmforge
interleaves them; since ``P (B A) = (P B) A``, the row permutation applies to ``lora_B`` of
``wq``/``wk`` and ``lora_A`` is unchanged (Qwen3 keeps HF's layout: no permutation). PEFT scales by
``lora_alpha / r`` like llmforge (``use_rslora: false``). Source of the format: PEFT
``src/peft/utils/save_and_load.py`` and ``tuners/lora/config.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from llmforge.algorithms.lora.layers import lora_modules
from llmforge.errors import LLMForgeError
from llmforge.models.llama3.hf import LlamaHFAdapter


def peft_state_dict(model: nn.Module, adapter: Any = None) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor for every adapter of an unsharded llmforge model with LoRA.

    Args:
        adapter: the model family's Hugging Face adapter
            (:class:`llmforge.models.hf_adapter.HFAdapter`: key names, and the heads whose rows
            HF stores in another layout); ``None``: Llama 3's.

    Raises:
        LLMForgeError: a LoRA layer has no Hugging Face name.
    """
    if adapter is None:
        adapter = LlamaHFAdapter()
    out: dict[str, torch.Tensor] = {}
    for fqn, m in lora_modules(model):
        hf = adapter.key_to_hf(fqn + ".weight")
        if hf is None:
            raise LLMForgeError(f"LoRA layer {fqn} has no Hugging Face name in the "
                                f"{adapter.family or 'model'} adapter; PEFT export covers the "
                                "layers Hugging Face has")
        prefix = "base_model.model." + hf[: -len(".weight")]
        lora_a, lora_b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        heads = adapter.permuted_heads(model, fqn + ".weight")
        if heads:  # P (B A) = (P B) A: HF's row permutation applies to B only
            lora_b = adapter.to_hf_rows(lora_b, heads)
        out[prefix + ".lora_A.weight"] = lora_a.contiguous()
        out[prefix + ".lora_B.weight"] = lora_b.contiguous()
    return out


def peft_config(model: nn.Module, options: dict[str, Any], base: Optional[str],
                adapter: Any = None) -> dict[str, Any]:
    """``adapter_config.json`` for PEFT's ``LoraConfig``."""
    targets = sorted({k.rsplit(".", 3)[-3] for k in peft_state_dict(model, adapter)
                      if k.endswith("lora_A.weight")})
    ranks = {m.lora_rank for _, m in lora_modules(model)}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(),
        "lora_alpha": options["alpha"], "lora_dropout": options["dropout"],
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base,
    }


def save_peft(model: nn.Module, out: str | Path, options: dict[str, Any],
              base: Optional[str] = None, dtype: Optional[torch.dtype] = None,
              adapter: Any = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` to ``out``.

    Args:
        model: an unsharded llmforge Llama with LoRA adapters (not merged).
        options: the lora entry's keys (:meth:`llmforge.algorithms.lora.LoRA.options`).
        base: ``base_model_name_or_path`` (the HF folder of ``model.init_from``, or ``None``).
        dtype: cast the adapter tensors (default: as trained, float32).
        adapter: the family's Hugging Face adapter (default: Llama 3's).

    Raises:
        LLMForgeError: the model has no adapters.
    """
    from safetensors.torch import save_file

    tensors = peft_state_dict(model, adapter)
    if not tensors:
        raise LLMForgeError("the model has no LoRA adapters to export")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if dtype else v) for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(model, options, base, adapter), indent=1))
    return out
