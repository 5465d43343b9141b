"""``llmforge generate``: load a trained run (or one checkpoint) and sample text from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from llmforge import registry
from llmforge.checkpoint import COMPLETE, latest_checkpoint, load_model_weights, read_json
from llmforge.config import load_config
from llmforge.data.tokenizers import Tokenizer, load_saved
from llmforge.errors import LLMForgeError
from llmforge.models.sampling import generate


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` for a run directory or a checkpoint folder.

    Raises:
        LLMForgeError: the path is neither, or the run has no complete checkpoint.
    """
    p = Path(path)
    if not p.exists():
        raise LLMForgeError(f"{p}: no such run directory or checkpoint")
    if (p / COMPLETE).exists():
        for run_dir in (p.parent.parent, p.parent):
            if (run_dir / "config.yaml").exists():
                return run_dir, p
        raise LLMForgeError(f"{p}: checkpoint found, but no config.yaml in its run directory")
    if not (p / "config.yaml").exists():
        raise LLMForgeError(f"{p}: not a run directory (no config.yaml) and not a checkpoint (no {COMPLETE})")
    cfg = load_config(p / "config.yaml")
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else p / "checkpoints"
    ckpt = latest_checkpoint(ckpt_root)
    if ckpt is None:
        raise LLMForgeError(f"{p}: the run has no complete checkpoint under {ckpt_root}")
    return p, ckpt


def load_model(path: str | Path, device: str = "cpu") -> tuple[Any, Any, Path]:
    """Return ``(model, cfg, run_dir)`` of a run directory or checkpoint, model in eval mode.

    A LoRA run's checkpoint (``adapters_only`` in meta.json) gives the base model rebuilt from
    its pointer with the adapters loaded, not merged
    (:func:`llmforge.algorithms.lora.load_lora_model`)."""
    run_dir, ckpt = resolve_checkpoint(path)
    cfg = load_config(run_dir / "config.yaml")
    registry.import_modules(cfg.imports)
    if (ckpt / "meta.json").exists() and read_json(ckpt, "meta.json").get("adapters_only"):
        # a LoRA run: the base from its pointer, then the adapters (unmerged; see merge_lora)
        from llmforge.algorithms.lora import load_lora_model

        return load_lora_model(cfg, ckpt, device), cfg, run_dir
    factory = registry.models.get(cfg.model.name, key="model.name")
    with torch.device("meta"):
        model = factory(cfg.model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # buffers (e.g. RoPE tables); weights come from the checkpoint
    load_model_weights(ckpt, model)
    return model.eval(), cfg, run_dir


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[Any, Tokenizer, Any]:
    """Return ``(model, tokenizer, cfg)`` of a run directory or checkpoint, model in eval mode."""
    model, cfg, run_dir = load_model(path, device)
    return model, load_saved(run_dir / "tokenizer"), cfg


def sample_text(path: str | Path, prompt: str, *, max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: Optional[int] = 50, seed: int = 0,
                chat: bool = False) -> str:
    """Sample a continuation of ``prompt`` (the returned text excludes the prompt).

    ``chat``: ``prompt`` is one user turn, rendered with the run's ``data.chat_template``
    (Llama 3 by default) and followed by the assistant header; sampling stops at the template's
    end-of-turn token (``<|eot_id|>``), which is left out of the returned answer.

    Raises:
        ConfigError: ``chat`` and the run's tokenizer lacks the template's special tokens.
    """
    model, tok, cfg = load_for_inference(path)
    gen = torch.Generator().manual_seed(seed)
    stop = tok.eos_id
    if chat:
        from llmforge.data.chat import build_chat_template

        template = build_chat_template(cfg.data.get("chat_template") or "llama3", tok)
        ids, stop = template.prompt_ids([{"role": "user", "content": prompt}]), template.stop_id
    else:
        ids = tok.encode(prompt, bos=True)
    new = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                   eos_id=stop, generator=gen)
    return tok.decode([i for i in new if i not in (tok.eos_id, stop)])
