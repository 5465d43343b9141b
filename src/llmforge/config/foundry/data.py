"""``train_loader`` / ``eval_loader`` of an LLM Foundry YAML.

- ``text`` (MDS shards, ``dataset.local`` / ``dataset.remote``): llmforge trains on prepared
  token shards; the report gives the ``llmforge data prepare`` command that reads the MDS
  folder (:mod:`llmforge.data.mds`) and the output reads ``data.source: prepared``.
- ``finetuning`` (``dataset.hf_name``: a Hub dataset, a local folder or file, or ``json`` with
  ``hf_kwargs.data_files``): ``data.task: sft`` on those files or that Hub dataset.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from llmforge.config.foundry.context import Conversion
from llmforge.errors import ConfigError

_LOADER_KNOBS = ("drop_last", "pin_memory", "prefetch_factor", "persistent_workers", "timeout")


def _loader_knobs(c: Conversion, loader: str) -> None:
    if c.has(f"{loader}.num_workers"):
        c.map(f"{loader}.num_workers", "data.num_workers", int(c.take(f"{loader}.num_workers")))
    for key in _LOADER_KNOBS:
        if c.has(f"{loader}.{key}"):
            c.drop(f"{loader}.{key}", "llmforge's DataLoader settings are its own (pinned memory and "
                   "prefetch on; an incomplete last batch never happens: windows are packed)",
                   "data.num_workers")


def convert_text(c: Conversion, prepared: str | None, tokenizer: dict) -> None:
    ds = "train_loader.dataset"
    source = c.take(f"{ds}.remote") or c.take(f"{ds}.local")
    c.used.update({f"{ds}.remote", f"{ds}.local"})
    if not source:
        if c.has(f"{ds}.streams"):
            c.drop(f"{ds}.streams", "several MDS streams: prepare each into its own folder",
                   "data.mixture with prepared entries (docs/data.md)")
            return
        raise ConfigError(f"{ds}.local: a text loader needs dataset.local or dataset.remote (the MDS folder)")
    source = str(source).rstrip("/")
    split = c.take(f"{ds}.split", "train")
    out = prepared or f"{source}-llmforge"
    c.set("data.source", "prepared")
    c.map(f"{ds}.local", "data.path", out, f"the MDS folder is prepared once into llmforge token "
          f"shards at {out} (the command is below)")
    args = ["llmforge", "data", "prepare", source, out, f"data.split={split}"]
    val_split = None
    if c.peek("eval_loader.name") == "text":
        eds = "eval_loader.dataset"
        eval_source = c.take(f"{eds}.remote") or c.take(f"{eds}.local")
        c.used.update({f"{eds}.remote", f"{eds}.local", "eval_loader.name", f"{eds}.max_seq_len"})
        val_split = c.take(f"{eds}.split", "val")
        if eval_source and str(eval_source).rstrip("/") == source:
            c.change(f"{eds}.split", f"data prepare ... data.val_split={val_split}",
                     "the validation split is prepared beside the training split")
            args.append(f"data.val_split={val_split}")
        else:
            c.drop("eval_loader.dataset", "evaluation reads the prepared folder's val split, which "
                   "comes from the same source", "data.val_split when preparing, or data.val_fraction")
        for key in c.peek(eds, {}) or {}:
            if not c.touched(f"{eds}.{key}"):
                c.drop(f"{eds}.{key}", "evaluation windows are read in order", "none")
        _loader_knobs(c, "eval_loader")
    if val_split is None:
        args.append("data.val_fraction=0.01")
    args += [f"tokenizer.{k}={v}" for k, v in tokenizer.items()]
    c.todo.append("prepare the MDS data once: " + " ".join(shlex.quote(a) for a in args))
    for key, (why, nearest) in {
            "shuffle": ("prepared windows are shuffled by run.seed", "run.seed"),
            "shuffle_seed": ("prepared windows are shuffled by run.seed", "run.seed"),
            "shuffle_algo": ("one shuffle (exact on resume)", "none"),
            "eos_token_id": ("the prepared shards put EOS after each document", "none needed"),
            "download_retry": ("the prepared folder is copied once per node", "data.cache_dir"),
            "predownload": ("the prepared folder is copied once per node", "data.cache_dir"),
            "cache_limit": ("the prepared folder is copied once per node", "data.cache_dir"),
            "num_canonical_nodes": ("no MDS shuffle in training", "none")}.items():
        if c.has(f"{ds}.{key}"):
            c.drop(f"{ds}.{key}", why, nearest)
    for key in c.peek(ds, {}) or {}:
        if not c.touched(f"{ds}.{key}"):
            c.drop(f"{ds}.{key}", "a StreamingTextDataset setting llmforge does not have", "data.*")


def _files_of(hf_name: str, split: str, data_files: Any) -> str | None:
    """The local files a Foundry ``hf_name`` names for ``split``, or None for a Hub dataset."""
    if hf_name in ("json", "csv", "parquet", "text") and data_files:
        files = data_files.get(split) if isinstance(data_files, dict) else data_files
        return files if isinstance(files, str) else (files[0] if files else None)
    path = Path(hf_name).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir():  # datasets' folder loader: files named after the split
        return str(path / f"{split}*.jsonl")
    return None


def convert_finetuning(c: Conversion) -> None:
    ds = "train_loader.dataset"
    c.set("data.task", "sft")
    c.changed.append(("train_loader.name", "data.task: sft", "prompt/response (or chat messages) "
                      "examples, loss on the response tokens"))
    hf_name = c.take(f"{ds}.hf_name")
    if not hf_name:
        if c.has(f"{ds}.remote") or c.has(f"{ds}.local"):
            c.drop(ds, "fine-tuning from MDS shards: llmforge's SFT reads jsonl files or Hub datasets",
                   "export the examples to jsonl (prompt, response) and set data.path")
            return
        raise ConfigError(f"{ds}.hf_name: a finetuning loader needs dataset.hf_name (a Hub dataset, "
                          "a folder or a jsonl file)")
    split = c.take(f"{ds}.split", "train")
    files = _files_of(str(hf_name), split, c.take(f"{ds}.hf_kwargs.data_files"))
    c.used.add(f"{ds}.hf_kwargs.data_files")
    if files:
        c.set("data.source", "files")
        c.map(f"{ds}.hf_name", "data.path", files)
    else:
        c.set("data.source", "hub")
        c.map(f"{ds}.hf_name", "data.path", hf_name)
        c.map(f"{ds}.split", "data.split", split)
    packing = c.take(f"{ds}.packing_ratio")
    c.map(f"{ds}.packing_ratio", "data.packed", packing is not None and packing != 1,
          "" if packing in (None, 1) else "llmforge packs as many examples as fit (attention restarts "
          "per example), not a fixed ratio")
    prompts = c.take(f"{ds}.target_prompts", "none")
    c.map(f"{ds}.target_prompts", "data.train_on_input", prompts == "all",
          "" if prompts in ("none", "all") else f"target_prompts {prompts!r}: nearest is all or none")
    responses = c.take(f"{ds}.target_responses", "last")
    if responses != "last":
        c.change(f"{ds}.target_responses", "every assistant turn is a target",
                 "llmforge trains on every assistant turn of a chat")
    if c.take(f"{ds}.decoder_only_format", True) is not True:
        c.drop(f"{ds}.decoder_only_format", "llmforge trains decoder-only models", "none")
    if c.has(f"{ds}.preprocessing_fn"):
        c.drop(f"{ds}.preprocessing_fn", "llmforge runs no code from a config to shape examples",
               "data.prompt_field / data.response_field / data.messages_field")
    if c.peek("eval_loader.name") == "finetuning":
        eval_split = c.take("eval_loader.dataset.split")
        c.used.add("eval_loader.name")
        same = c.take("eval_loader.dataset.hf_name") == hf_name
        if same and not files and eval_split:
            c.map("eval_loader.dataset.split", "data.val_split", eval_split)
        else:
            c.drop("eval_loader.dataset", "llmforge evaluates on a share of the training examples "
                   "(or a Hub dataset's named split)", "data.val_fraction")
        for key in c.peek("eval_loader.dataset", {}) or {}:
            if not c.touched(f"eval_loader.dataset.{key}"):
                c.drop(f"eval_loader.dataset.{key}", "set by the training loader's mapping", "data.*")
        _loader_knobs(c, "eval_loader")
    if c.has(f"{ds}.shuffle") or c.has(f"{ds}.shuffle_seed"):
        for key in ("shuffle", "shuffle_seed"):
            if c.has(f"{ds}.{key}"):
                c.drop(f"{ds}.{key}", "the order of the examples is fixed by run.seed", "run.seed")
    for key in c.peek(ds, {}) or {}:
        if not c.touched(f"{ds}.{key}"):
            c.drop(f"{ds}.{key}", "a Foundry finetuning setting llmforge does not have", "data.* (docs/sft.md)")


def convert_loaders(c: Conversion, prepared: str | None) -> None:
    """``train_loader`` and ``eval_loader`` (``eval_loaders``: one entry is kept per kind).

    Raises:
        ConfigError: a loader name other than text or finetuning, or a loader without its data."""
    name = c.take("train_loader.name")
    tokenizer = {k: v for k, v in (c.out.get("tokenizer") or {}).items() if k in ("type", "path")}
    if name == "text":
        c.mapped.append(("train_loader.name", "data.source: prepared", ""))
        convert_text(c, prepared, tokenizer)
    elif name == "finetuning":
        convert_finetuning(c)
    else:
        raise ConfigError(f"train_loader.name: {name!r} is not a loader llmforge converts; use text "
                          "(MDS shards) or finetuning")
    _loader_knobs(c, "train_loader")
    if c.has("eval_loader") and "eval_loader.name" not in c.used:
        c.drop("eval_loader", "an evaluation set of another kind than the training loader's",
               "data.val_split / data.val_fraction")
    if c.has("eval_loaders"):
        c.drop("eval_loaders", "llmforge evaluates one validation split", "data.val_split; "
               "`llmforge eval RUN --tasks ...` for benchmarks")
