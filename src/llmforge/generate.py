"""``llmforge generate``: load a trained run (or one checkpoint) and sample text from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

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


def inference_plugins(cfg: Any) -> list[Any]:
    """The run's algorithms that take part in loading or exporting its checkpoints (those that
    override :meth:`~llmforge.plugin.Algorithm.inference_model`, ``export_model`` or
    ``export_adapters``), instantiated from ``cfg.algorithms``; the others (e.g. compile) are
    not built, so their optional packages need not be installed to load a run."""
    import llmforge.algorithms  # noqa: F401  (registers the built-ins)
    from llmforge.plugin import Algorithm

    out = []
    for i, entry in enumerate(cfg.algorithms or []):
        kwargs = dict(entry)
        cls = registry.algorithms.get(kwargs.pop("name"), key=f"algorithms[{i}].name")
        if isinstance(cls, type) and any(getattr(cls, h) is not getattr(Algorithm, h)
                                         for h in ("inference_model", "export_model", "export_adapters")):
            out.append(cls(**kwargs))
    return out


def load_model(path: str | Path, device: str = "cpu", with_plugins: bool = False) -> Any:
    """Return ``(model, cfg, run_dir)`` of a run directory or checkpoint, model in eval mode
    (with ``with_plugins``: ``(model, cfg, run_dir, plugins, checkpoint, meta)``).

    The model is built on the meta device, each :func:`inference_plugins` entry's
    ``inference_model`` prepares it (e.g. adds adapter layers), it is materialized with the
    run's seeded init, and the checkpoint is loaded. A checkpoint of adapters only
    (``adapters_only`` in meta.json) gets its base from the run's pointer first
    (``model.init_from``, else the seeded init), then the adapters.
    """
    from llmforge.parallel.init import seeded_init

    run_dir, ckpt = resolve_checkpoint(path)
    cfg = load_config(run_dir / "config.yaml")
    registry.import_modules(cfg.imports)
    meta = read_json(ckpt, "meta.json") if (ckpt / "meta.json").exists() else {}
    plugins = inference_plugins(cfg)
    factory = registry.models.get(cfg.model.name, key="model.name")
    with torch.device("meta"):
        model = factory(cfg.model)
    for plugin in plugins:
        model = plugin.inference_model(model, cfg, meta)
    model.to_empty(device=device)
    seeded_init(model, cfg.run.seed)  # buffers (RoPE tables); the base of an adapter run
    adapters_only = bool(meta.get("adapters_only"))
    if adapters_only and cfg.model.get("init_from"):
        from llmforge.checkpoint.init_from import load_initial_weights

        load_initial_weights(model, cfg.model.init_from)
    load_model_weights(ckpt, model, adapters_only=adapters_only)
    model.eval()
    if with_plugins:
        return model, cfg, run_dir, plugins, ckpt, meta
    return model, cfg, run_dir


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[Any, Tokenizer, Any]:
    """Return ``(model, tokenizer, cfg)`` of a run directory or checkpoint, model in eval mode."""
    model, cfg, run_dir = load_model(path, device)
    return model, load_saved(run_dir / "tokenizer"), cfg


def sample_text(path: str | Path, prompt: str, *, max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: Optional[int] = 50, seed: int = 0,
                chat: bool = False, use_cache: bool = True,
                on_text: Optional[Callable[[str], None]] = None,
                stats: Optional[dict] = None) -> str:
    """Sample a continuation of ``prompt`` (the returned text excludes the prompt).

    ``chat``: ``prompt`` is one user turn, rendered with the run's ``data.chat_template``
    (Llama 3 by default) and followed by the assistant header; sampling stops at the template's
    end-of-turn token (``<|eot_id|>``), which is left out of the returned answer.
    ``use_cache``: decode with a KV cache (:class:`llmforge.models.sampling.KVCache`) when the
    model supports one; same tokens, one position of compute per new token.
    ``on_text``: called with each new piece of text as soon as it decodes (streaming; a piece
    that ends inside a multi-byte character waits for the next token).
    ``stats``: filled with ``tokens`` (generated), ``seconds`` (wall time of generation, model
    load excluded), ``tokens_per_second`` and ``kv_cache`` (whether the cache was used).

    Raises:
        ConfigError: ``chat`` and the run's tokenizer lacks the template's special tokens.
    """
    import time

    from llmforge.models.sampling import supports_kv_cache

    model, tok, cfg = load_for_inference(path)
    gen = torch.Generator().manual_seed(seed)
    stop = tok.eos_id
    if chat:
        from llmforge.data.chat import build_chat_template

        template = build_chat_template(cfg.data.get("chat_template") or "llama3", tok)
        ids, stop = template.prompt_ids([{"role": "user", "content": prompt}]), template.stop_id
    else:
        ids = tok.encode(prompt, bos=True)
    hidden = (tok.eos_id, stop)
    kept: list[int] = []
    shown = [""]

    def emit(token: int) -> None:
        if token in hidden:
            return
        kept.append(token)
        text = tok.decode(kept)
        if on_text is not None and not text.endswith("\ufffd") and len(text) > len(shown[0]):
            on_text(text[len(shown[0]):])
            shown[0] = text

    start = time.perf_counter()
    new = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                   eos_id=stop, generator=gen, use_cache=use_cache, on_token=emit)
    seconds = time.perf_counter() - start
    text = tok.decode([i for i in new if i not in hidden])
    if on_text is not None and len(text) > len(shown[0]):
        on_text(text[len(shown[0]):])
    if stats is not None:
        stats.update(tokens=len(new), seconds=seconds, tokens_per_second=len(new) / max(seconds, 1e-9),
                     kv_cache=use_cache and supports_kv_cache(model))
    return text
