"""Loading a run directory (or one checkpoint folder of it): what ``llmforge generate``,
``llmforge eval``, ``llmforge convert to-hf`` and ``model.init_from: RUN_DIR`` share.

:func:`resolve_checkpoint` finds the run directory and its newest complete checkpoint,
:func:`load_model` builds the run's model (meta device, the run's inference plugins, seeded
init) and loads the weights, :func:`load_for_inference` adds the saved tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmforge import registry
from llmforge.checkpoint.dcp import load_model_weights, read_json
from llmforge.checkpoint.init_from import load_initial_weights
from llmforge.checkpoint.layout import COMPLETE, latest_checkpoint
from llmforge.config import load_config
from llmforge.data.tokenizers import Tokenizer, load_saved
from llmforge.errors import LLMForgeError
from llmforge.parallel.init import seeded_init
from llmforge.plugin import Algorithm, meta_model

__all__ = ["inference_plugins", "load_for_inference", "load_model", "resolve_checkpoint"]


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
    run_dir, ckpt = resolve_checkpoint(path)
    cfg = load_config(run_dir / "config.yaml")
    registry.import_modules(cfg.imports)
    meta = read_json(ckpt, "meta.json") if (ckpt / "meta.json").exists() else {}
    plugins = inference_plugins(cfg)
    model = meta_model(cfg)
    for plugin in plugins:
        model = plugin.inference_model(model, cfg, meta)
    model.to_empty(device=device)
    seeded_init(model, cfg.run.seed)  # buffers (RoPE tables); the base of an adapter run
    adapters_only = bool(meta.get("adapters_only"))
    if adapters_only and cfg.model.get("init_from"):
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
