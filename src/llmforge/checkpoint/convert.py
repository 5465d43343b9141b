"""``llmforge convert to-hf`` and ``llmforge convert from-hf``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from llmforge.checkpoint.dcp import save_checkpoint
from llmforge.checkpoint.hf import load_hf_weights, model_overrides_from_hf, read_hf_config, save_hf
from llmforge.checkpoint.run_dir import export_order, load_model
from llmforge.config import save_config, structured_config
from llmforge.data.tokenizers import HFTokenizer
from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.paths import all_or_nothing
from llmforge.run_guard import (EXPORT_MARK, LOCK, MARK, RunLock, check_export_dir, check_run_dir,
                                clear_run_dir, refuse_overlap)


def to_hf(path: str | Path, out: str | Path, dtype: Optional[str] = None,
          adapters_only: bool = False, trust_code: bool = False, overwrite: bool = False) -> Path:
    """A run directory or checkpoint -> a Hugging Face folder (config, generation config,
    safetensors, tokenizer) that the family's ``*ForCausalLM.from_pretrained`` loads.

    Each of the run's algorithms shapes the export (``Algorithm.export_model``): an adapter run
    is written merged (computed in float32; written in float32 unless ``dtype`` is given, since
    a bf16 base would round small adapter updates away). With ``adapters_only`` the first
    algorithm that exports adapters (``Algorithm.export_adapters``, e.g. PEFT's folder) writes
    them instead. The hooks run in :func:`~llmforge.checkpoint.run_dir.export_order` (declared
    by the plugins, never the YAML list). ``trust_code``: see
    :mod:`llmforge.checkpoint.run_dir`.

    ``out`` must be new or empty, or (with ``overwrite``) a folder an earlier ``to_hf`` wrote
    (:data:`~llmforge.run_guard.EXPORT_MARK`); the new export is written beside it and swapped in
    only once complete, so a failed export leaves the earlier one as it was.

    Raises:
        ConfigError: the model's family has no HF adapter, ``adapters_only`` for a run without
            adapters (exit 2), the run's config names code and ``trust_code`` is False, ``out``
            is not empty without ``overwrite``, is a folder llmforge did not export, or holds
            ``path`` (:func:`llmforge.run_guard.check_export_dir`, ``refuse_overlap``).
        LLMForgeError: the path has no checkpoint.
        WriteError: a file could not be written (e.g. a full disk); nothing of ``out`` that this
            call created is left.
    """
    out = Path(os.path.abspath(out))  # "." and "e1/sub/.." name their folder: the swap needs a name
    replace = check_export_dir(out, "OUT", overwrite)
    if replace:
        refuse_overlap([("OUT", out)], [("PATH", str(path))])
    model, cfg, run_dir, plugins, ckpt, meta = load_model(path, with_plugins=True, trust_code=trust_code)
    plugins = export_order(plugins)
    adapter = get_spec(cfg.model.name).adapter()  # by name: a derived research spec may have none
    if adapter is None:
        raise ConfigError(f"{path}: model '{cfg.model.name}' has no Hugging Face adapter "
                            "(ModelSpec.hf_adapter, docs/models.md), so it cannot be exported")
    cast = getattr(torch, dtype) if dtype else None
    target = out.with_name(f".{out.name}.tmp-{os.getpid()}") if replace else out
    with all_or_nothing(target):
        if adapters_only:
            if all(p.export_adapters(model, target, cfg, meta, dtype=cast) is None for p in plugins):
                raise ConfigError(f"{path}: --adapters-only needs a run whose algorithms add "
                                  "adapters (see `llmforge algorithms`); this checkpoint has none")
        else:
            for plugin in plugins:
                model = plugin.export_model(model, ckpt)
            tok_dir = run_dir / "tokenizer"
            save_hf(model, target, tokenizer_dir=tok_dir if tok_dir.is_dir() else None, dtype=cast,
                    adapter=adapter)
        (target / EXPORT_MARK).write_text('{"made_by": "llmforge convert to-hf"}\n', encoding="utf-8")
    if replace:  # swap the complete new export in; the earlier one goes only now
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        target.rename(out)
        shutil.rmtree(old)
    return out


def from_hf(path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """A Hugging Face folder (any family with an HF adapter: Llama, Qwen3) -> an llmforge run
    directory (``config.yaml``, ``tokenizer/``, ``checkpoints/step_00000000``) usable by
    ``llmforge generate`` and ``model.init_from``. ``overwrite``: an llmforge run already in
    ``out`` is deleted first (once the HF weights have loaded), as ``train --overwrite`` does;
    its newer checkpoints would otherwise be what ``generate`` loads. The run's lock is held
    while writing.

    Raises:
        ConfigError: ``out`` is a symbolic link, or a non-empty folder llmforge did not make
            (:func:`llmforge.run_guard.check_run_dir`): marking it a run would let a later
            ``llmforge train --overwrite`` delete its files; a used run without ``overwrite``;
            with ``overwrite``, ``path`` inside ``out`` (the source would be deleted before it
            is read: :func:`llmforge.run_guard.refuse_overlap`).
        RunDirBusy: another process writes the run in ``out``.
    """
    src, out = Path(path), Path(out)
    check_run_dir(out, "OUT")
    used = out.is_dir() and any(p.name not in (MARK, LOCK) for p in out.iterdir())
    if used and not overwrite:
        raise ConfigError(f"{out} already holds a run; choose another output folder or pass "
                          "--overwrite to replace it")
    if used:  # a round trip (convert from-hf RUN/hf RUN) would delete its own source first
        refuse_overlap([("OUT", out)], [("PATH", str(src))])
    fields = model_overrides_from_hf(read_hf_config(src, key="PATH"))
    cfg = structured_config(fields["name"])
    for key, value in fields.items():
        cfg.model[key] = value
    cfg.run.name, cfg.run.output_dir = out.name, str(out.parent)
    model = get_spec(cfg.model.name)(cfg.model)
    model.init_weights()
    load_hf_weights(model, src)
    with RunLock(out):  # marks it: a run llmforge made, train/--overwrite may use it
        if used:
            clear_run_dir(out)
        if (src / "tokenizer.json").exists():
            cfg.tokenizer.type, cfg.tokenizer.path = "huggingface", str((src / "tokenizer.json").resolve())
            HFTokenizer(src / "tokenizer.json").save(out / "tokenizer")
        save_config(cfg, out / "config.yaml")
        save_checkpoint(out / "checkpoints", 0, model, None, {"step": 0, "tokens_seen": 0},
                        {"source": str(src), "world_size": 1})
    return out
