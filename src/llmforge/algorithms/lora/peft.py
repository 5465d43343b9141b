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

Expert adapters go to PEFT's ``target_parameters`` (its ``ParamWrapper``, PEFT >= 0.17: LoRA on a
3-D parameter ``[E, out, in]`` with ``lora_A [E * R, in]``, rows expert-major, and ``lora_B
[out, R * E]``, columns rank-major: ``delta_e = B[:, r * E + e] A[e * R + r]``, ``tuners/lora/
layer.py``). transformers' runtime module may fuse several of our weights in one parameter
(Qwen3-MoE's ``gate_up_proj`` = gate w1 and up w3, :meth:`HFAdapter.runtime_expert_param`):
their adapters become one of rank ``parts * r`` (``A`` stacked, ``B`` block-diagonal, exact),
with ``rank_pattern``/``alpha_pattern`` keeping the scale ``alpha / r``. PEFT wraps the
parameters of one module in the order the module registers them, the first innermost (its keys
gain ``base_layer.`` once per later wrapper).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from llmforge.algorithms.lora.layers import lora_expert_modules, lora_modules
from llmforge.errors import ConfigError, LLMForgeError
from llmforge.models.llama3.hf import LlamaHFAdapter


def peft_state_dict(model: nn.Module, adapter: Any = None) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor for every adapter of an unsharded llmforge model with LoRA.

    Args:
        adapter: the model family's Hugging Face adapter
            (:class:`llmforge.models.hf_adapter.HFAdapter`: key names, and the heads whose rows
            HF stores in another layout); ``None``: Llama 3's.

    Raises:
        LLMForgeError: a LoRA layer has no Hugging Face name.
        ConfigError: a LoRA layer's HF name is one PEFT reads as an expert's
            (:attr:`HFAdapter.v4_expert_modules`: a dense layer of a mixture of experts).
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
        leaf = prefix.rsplit(".", 1)[-1]
        if leaf in adapter.v4_expert_modules:
            raise ConfigError(f"LoRA layer {fqn} ({leaf}) cannot be exported to PEFT: PEFT reads "
                              f"'{leaf}' in a {adapter.model_type} model as the experts' projection "
                              "(transformers 4's name) and would drop this dense layer's adapters; "
                              "export it merged (convert to-hf without --adapters-only) or train "
                              "without lora.targets on the dense layers")
        lora_a, lora_b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        heads = adapter.permuted_heads(model, fqn + ".weight")
        if heads:  # P (B A) = (P B) A: HF's row permutation applies to B only
            lora_b = adapter.to_hf_rows(lora_b, heads)
        out[prefix + ".lora_A.weight"] = lora_a.contiguous()
        out[prefix + ".lora_B.weight"] = lora_b.contiguous()
    out.update(peft_expert_tensors(model, adapter)[0])
    return out


def peft_expert_tensors(model: nn.Module, adapter: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """PEFT key -> tensor for the expert adapters of an unsharded model, and the rank of each
    runtime parameter (``{"gate_up_proj": 2 * r}``) whose rank is not ``r`` (see the module
    docs).

    Raises:
        LLMForgeError: an expert weight has no parameter in transformers' runtime model.
    """
    groups: dict[tuple[str, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    parts_of: dict[str, int] = {}
    rank = 0
    for fqn, m in lora_expert_modules(model):
        rank = m.lora_rank
        for name, a in m.lora_A.items():
            where = adapter.runtime_expert_param(f"{fqn}.{name}")
            if where is None:
                raise LLMForgeError(f"expert weight {fqn}.{name} has no parameter in transformers' "
                                    f"runtime {adapter.family or 'model'}; PEFT export covers the "
                                    "weights Hugging Face has")
            path, param, part, parts = where
            parts_of[param] = parts
            groups.setdefault((path, param), []).append(
                (part, parts, a.detach().float(), m.lora_B[name].detach().float()))
    out: dict[str, torch.Tensor] = {}
    order = list(adapter.runtime_expert_params)
    for (path, param), found in groups.items():
        parts = found[0][1]
        e, r, inp = found[0][2].shape
        out_rows = found[0][3].shape[1]
        a_full = torch.zeros(e, parts * r, inp)
        b_full = torch.zeros(e, parts * out_rows, parts * r)
        for part, _, a, b in found:
            a_full[:, part * r:(part + 1) * r] = a
            b_full[:, part * out_rows:(part + 1) * out_rows, part * r:(part + 1) * r] = b
        later = sum(1 for p in order[order.index(param) + 1:] if (path, p) in groups)
        prefix = f"base_model.model.{path}." + "base_layer." * later
        out[prefix + "lora_A.weight"] = a_full.reshape(e * parts * r, inp).contiguous()
        out[prefix + "lora_B.weight"] = b_full.permute(1, 2, 0).reshape(parts * out_rows, parts * r * e).contiguous()
    return out, {p: n * rank for p, n in parts_of.items() if n > 1}


def peft_config(model: nn.Module, options: dict[str, Any], base: Optional[str],
                adapter: Any = None) -> dict[str, Any]:
    """``adapter_config.json`` for PEFT's ``LoraConfig``."""
    if adapter is None:
        adapter = LlamaHFAdapter()
    targets = sorted({adapter.key_to_hf(fqn + ".weight").rsplit(".", 2)[-2]
                      for fqn, _ in lora_modules(model)})
    params = sorted({".".join(where[0].rsplit(".", 1)[-1:] + [where[1]])
                     for fqn, m in lora_expert_modules(model) for name in m.lora_A
                     if (where := adapter.runtime_expert_param(f"{fqn}.{name}")) is not None})
    fused = peft_expert_tensors(model, adapter)[1]
    ranks = {m.lora_rank for _, m in [*lora_modules(model), *lora_expert_modules(model)]}
    r = ranks.pop()
    out = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
        "lora_alpha": options["alpha"], "lora_dropout": options["dropout"],
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base,
    }
    if params:  # PEFT >= 0.17; a fused parameter's rank parts * r, its alpha parts * alpha
        out.update({"target_parameters": params, "rank_pattern": fused,
                    "alpha_pattern": {p: n // r * options["alpha"] for p, n in fused.items()}})
    return out


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
