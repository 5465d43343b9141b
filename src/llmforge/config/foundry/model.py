"""``model:`` and ``tokenizer:`` of an LLM Foundry YAML.

``hf_causal_lm`` with a Llama 3 or Qwen3 checkpoint becomes that family with
``model.init_from: hf:PATH`` (the folder's config.json fixes the shape when the run starts;
:func:`llmforge.checkpoint.init_from.apply_hf_shape`). ``mpt_causal_lm`` becomes a Llama 3
model of the same width, depth, heads, vocabulary and MLP parameter count; every architectural
difference is reported.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from llmforge import registry
from llmforge.config.foundry.context import Conversion
from llmforge.errors import ConfigError

MODEL_NAMES = ("hf_causal_lm", "mpt_causal_lm")
"""``model.name`` values the converter reads (LLM Foundry's registry names)."""
_HF_TYPES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_SWIGLU_MULTIPLE = 64  # hidden size rounded to a multiple of 64: matmul-friendly, <= 64 off


def _family(path: str) -> tuple[str, str]:
    """(llmforge family, how it was found) of an HF checkpoint name or folder.

    Raises:
        ConfigError: neither a Llama nor a Qwen3 checkpoint."""
    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.pretrained_model_name_or_path: cannot read {config} ({exc})") from None
        if model_type in _HF_TYPES:
            return _HF_TYPES[model_type], f"{config}: model_type {model_type}"
        raise ConfigError(f"model.pretrained_model_name_or_path: {config} has model_type {model_type!r}; "
                          f"llmforge trains {', '.join(_HF_TYPES)} checkpoints (Llama 3, Qwen3, Qwen3-MoE)")
    low = path.lower()
    if "qwen3" in low:  # Qwen3-30B-A3B, Qwen3-235B-A22B: mixture of experts
        return ("qwen3_moe" if "-a" in low.split("qwen3", 1)[1] else "qwen3"), "the checkpoint's name"
    if "llama-3" in low or "llama3" in low:
        return "llama3", "the checkpoint's name"
    raise ConfigError(f"model.pretrained_model_name_or_path: {path!r} is neither a local Hugging Face "
                      "folder (config.json) nor a Llama 3 or Qwen3 checkpoint name; llmforge fine-tunes "
                      "Llama 3 and Qwen3 weights (download the folder and give its path)")


def convert_hf_model(c: Conversion) -> None:
    path = c.take("model.pretrained_model_name_or_path")
    if not isinstance(path, str) or not path:
        raise ConfigError("model.pretrained_model_name_or_path: hf_causal_lm needs the checkpoint "
                          "(a Hugging Face name or folder)")
    family, how = _family(path)
    c.map("model.name", "model.name", family, "" if "config.json" in how else f"family from {how}")
    pretrained = c.take("model.pretrained", True)
    if pretrained is False:
        c.drop("model.pretrained", "false trains the architecture from random weights; llmforge "
               "takes the shape from config.json only together with the weights",
               f"model.name: {family} with the shape keys of config.json (docs/models.md)")
    else:
        c.map("model.pretrained_model_name_or_path", "model.init_from", f"hf:{path}")
        if not Path(path).expanduser().is_dir():
            c.todo.append(f"download {path} (huggingface-cli download {path} --local-dir DIR) and set "
                          "model.init_from: hf:DIR; llmforge reads local folders only")
    for key, why, nearest in (
            ("use_flash_attention_2", "llmforge uses torch's scaled_dot_product_attention, which "
             "picks FlashAttention kernels on GPUs itself", "none needed"),
            ("use_auth_token", "llmforge reads local folders", "download the checkpoint first"),
            ("trust_remote_code", "no model code is imported from a checkpoint", "none"),
            ("init_device", "llmforge always builds on the meta device and loads rank-locally", "none needed"),
            ("config_overrides", "the architecture is the checkpoint's", "model.* keys of the family")):
        if c.has(f"model.{key}"):
            c.drop(f"model.{key}", why, nearest)
    if c.has("model.peft_config"):
        convert_peft(c, c.peek("model.peft_config") or {})


def convert_peft(c: Conversion, peft: Any) -> None:
    """``model.peft_config`` becomes the ``algorithms:`` entry of the first registered plugin
    whose :meth:`~llmforge.plugin.Algorithm.from_peft_config` takes it (no plugin is named here).

    Raises:
        ConfigError: ``peft`` is not a mapping, or the entry it becomes is one its plugin
            refuses (e.g. ``r: "8"``), naming ``model.peft_config``.
    """
    if not isinstance(peft, Mapping):
        raise ConfigError(f"model.peft_config must be a mapping of PEFT's settings (the keys of its "
                          f"adapter_config.json: peft_type, r, ...), got a {type(peft).__name__}")
    for plugin in registry.algorithms.matching(lambda a: callable(getattr(a, "from_peft_config", None))):
        alg = plugin.from_peft_config(peft)
        if alg is not None:
            try:  # the plugin checks its own arguments: refuse now, not at the first train
                plugin(**{k: v for k, v in alg.items() if k != "name"})
            except (ConfigError, TypeError, ValueError) as exc:
                raise ConfigError(f"model.peft_config becomes algorithms: [{alg}], which its plugin "
                                  f"refuses ({exc}); fix that value in model.peft_config") from exc
            c.out.setdefault("algorithms", []).append(alg)
            c.change("model.peft_config", f"algorithms: {alg}", f"PEFT's adapter becomes llmforge's "
                     f"{alg['name']} algorithm; target modules are llmforge's defaults (docs/algorithms)")
            return
    c.drop("model.peft_config", f"no llmforge algorithm takes peft_type {peft.get('peft_type')!r}",
           "an algorithm plugin with from_peft_config (docs/algorithms)")


def convert_mpt_model(c: Conversion) -> None:
    dim, layers, heads = (c.take(f"model.{k}") for k in ("d_model", "n_layers", "n_heads"))
    for key, value in (("d_model", dim), ("n_layers", layers), ("n_heads", heads)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{key}: mpt_causal_lm needs a positive integer; got {value!r}")
    c.set("model.name", "llama3")
    c.change("model.name", "model.name: llama3", "MPT becomes a Llama 3 model of the same shape: "
             "RMSNorm, RoPE, SwiGLU, no biases (the differences are listed by key)")
    c.set("model.preset", None)
    c.map("model.d_model", "model.dim", dim)
    c.map("model.n_layers", "model.n_layers", layers)
    c.map("model.n_heads", "model.n_heads", heads)
    attn_type = c.take("model.attn_config.attn_type", "multihead_attention")
    kv = heads
    if attn_type == "grouped_query_attention":
        kv = c.take("model.attn_config.kv_n_heads", heads)
    elif attn_type == "multiquery_attention":
        kv = 1
    c.map("model.attn_config.attn_type", "model.n_kv_heads", kv)
    c.map("model.vocab_size", "model.vocab_size", c.take("model.vocab_size", 50368))
    c.set("model.max_seq_len", c.take("model.max_seq_len", 2048))
    c.mapped.append(("model.max_seq_len", f"model.max_seq_len: {c.out['model']['max_seq_len']}", ""))
    ratio = c.take("model.expansion_ratio", 4)
    ffn_type = c.take("model.ffn_config.ffn_type", "mptmlp")
    act = c.take("model.ffn_config.ffn_act_fn", {"name": "gelu"})
    # GELU MLP: 2 * ratio * d^2 weights; SwiGLU with hidden h: 3 * d * h, so h = 2/3 * ratio * d
    # keeps the count; llmforge's h = int(multiplier * int(8d/3)) rounded up
    multiplier = ratio / 4 if ffn_type != "mptglu" else ratio * 3 / 8
    c.set("model.ffn_dim_multiplier", multiplier)
    c.set("model.multiple_of", _SWIGLU_MULTIPLE)
    hidden = int(multiplier * int(8 * dim / 3))
    hidden = _SWIGLU_MULTIPLE * -(-hidden // _SWIGLU_MULTIPLE)
    c.change("model.expansion_ratio", f"model.ffn_dim_multiplier: {multiplier}, multiple_of: "
             f"{_SWIGLU_MULTIPLE} (SwiGLU hidden {hidden})",
             f"MPT's {ffn_type} ({act.get('name', 'gelu') if isinstance(act, dict) else act}, "
             f"{ratio} x d_model) becomes a SwiGLU MLP of about the same parameter count")
    c.used.update({"model.ffn_config.ffn_act_fn", "model.ffn_config.ffn_type"})
    alibi = c.take("model.attn_config.alibi", False)
    rope = c.take("model.attn_config.rope", False)
    learned = c.take("model.learned_pos_emb", True)
    if rope:
        c.map("model.attn_config.rope_theta", "model.rope_theta", c.take("model.attn_config.rope_theta", 10000))
    else:
        c.set("model.rope_theta", 10000.0)
        c.change("model.attn_config.alibi" if alibi else "model.learned_pos_emb", "model.rope_theta: 10000.0",
                 ("ALiBi attention biases" if alibi else "learned position embeddings" if learned
                  else "no position encoding") + " become RoPE (llmforge has no ALiBi or learned "
                  "positions); length extrapolation beyond max_seq_len differs")
    norm = c.take("model.norm_type", "low_precision_layernorm")
    c.change("model.norm_type", "RMSNorm", f"MPT's {norm} (mean and bias) becomes RMSNorm (no mean, no bias)")
    if c.take("model.no_bias", True) is False:
        c.change("model.no_bias", "no biases", "MPT with biases: llmforge's Llama has none")
    tie = c.take("model.tie_word_embeddings", True)
    c.map("model.tie_word_embeddings", "model.tie_embeddings", bool(tie))
    init = c.peek("model.init_config", {}) or {}
    if init:
        c.used.add("model.init_config")
        c.changed.append(("model.init_config", "model.init_std: 0.02",
                          f"MPT's {init.get('name', 'init')} init becomes a normal(0, 0.02) init "
                          "with depth-scaled output projections"))
    dropped = {
        "attn_config.attn_impl": ("attention kernel choice", "torch SDPA picks flash/efficient kernels"),
        "attn_config.attn_pdrop": ("llmforge has no dropout (pretraining at scale uses none)", "none"),
        "attn_config.clip_qkv": ("no QKV clipping in llmforge's Llama", "trainer.gradient_clip_val"),
        "attn_config.qk_ln": ("no QK LayerNorm in llmforge's Llama", "model.name: qwen3 (QK RMSNorm)"),
        "attn_config.softmax_scale": ("fixed 1/sqrt(head_dim)", "none"),
        "attn_config.sliding_window_size": ("full attention only", "none"),
        "attn_config.alibi_bias_max": ("no ALiBi (see model.attn_config.alibi)", "none"),
        "attn_config.rope_impl": ("llmforge's RoPE is Llama's", "model.rope_theta"),
        "emb_pdrop": ("no dropout", "none"), "resid_pdrop": ("no dropout", "none"),
        "logit_scale": ("no logit scaling", "none"),
        "init_device": ("llmforge builds on the meta device and materializes per rank", "none needed"),
        "fc_type": ("llmforge's Linear layers are torch's (FP8: algorithms float8)", "algorithms: [{name: float8}]"),
        "loss_fn": ("llmforge's cross-entropy is chosen by the run", "algorithms: [{name: chunked_cross_entropy}]"),
        "use_cache": ("generation only", "llmforge generate uses a KV cache by default"),
        "use_pad_tok_in_ffn": ("no padding in pretraining", "none"),
    }
    for key, (why, nearest) in dropped.items():
        if c.has(f"model.{key}"):
            c.drop(f"model.{key}", why, nearest)


def convert_model(c: Conversion) -> None:
    """The ``model:`` section.

    Raises:
        ConfigError: ``model.name`` is not hf_causal_lm or mpt_causal_lm."""
    name = c.take("model.name")
    if name not in MODEL_NAMES:
        raise ConfigError(f"model.name: {name!r} is not a model llmforge converts; use hf_causal_lm "
                          "(a Llama 3 or Qwen3 checkpoint) or mpt_causal_lm")
    if name == "hf_causal_lm":
        convert_hf_model(c)
    else:
        convert_mpt_model(c)


def convert_tokenizer(c: Conversion) -> None:
    """``tokenizer.name`` (a Hugging Face name or folder) -> ``tokenizer: {type, path}``."""
    name = c.take("tokenizer.name")
    if not name:
        return
    folder = Path(str(name)).expanduser()
    if (folder / "tokenizer.json").is_file():
        c.map("tokenizer.name", "tokenizer.path", str(folder / "tokenizer.json"))
        c.set("tokenizer.type", "huggingface")
    elif (folder / "tokenizer.model").is_file() or (folder / "original" / "tokenizer.model").is_file():
        model = folder / "tokenizer.model"
        model = model if model.is_file() else folder / "original" / "tokenizer.model"
        c.map("tokenizer.name", "tokenizer.path", str(model))
        c.set("tokenizer.type", "tiktoken")
    else:
        c.set("tokenizer.type", "huggingface")
        c.map("tokenizer.name", "tokenizer.path", f"{name}/tokenizer.json")
        c.todo.append(f"{folder} has no tokenizer.json: save one there (transformers' AutoTokenizer"
                      ".save_pretrained) or set tokenizer.path" if folder.is_dir() else
                      f"download the tokenizer {name} (huggingface-cli download {name} tokenizer.json "
                      "--local-dir DIR) and set tokenizer.path: DIR/tokenizer.json")
    kwargs = c.peek("tokenizer.kwargs") or {}
    for key in kwargs:
        c.drop(f"tokenizer.kwargs.{key}", "the tokenizer file's own settings are used; sequence length "
               "is trainer.seq_len", "trainer.seq_len" if key == "model_max_length" else "none")
