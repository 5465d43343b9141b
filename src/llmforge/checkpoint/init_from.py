"""``model.init_from``: start training from existing weights.

``hf:PATH`` is a Hugging Face folder of a family with an HF adapter (Llama, Qwen3): its
``config.json`` fixes the model's shape (see
:func:`apply_hf_shape`; weights are read rank-locally by :func:`llmforge.checkpoint.hf.load_hf_weights`);
anything else is an llmforge checkpoint folder or run directory whose model weights are loaded
through DCP (resharded to the current layout). Optimizer, schedule and data start fresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from llmforge.checkpoint.dcp import load_model_weights
from llmforge.checkpoint.hf import adapter_for_hf, load_hf_weights, model_overrides_from_hf, read_hf_config
from llmforge.checkpoint.safe_load import CheckpointShapeError, check_model_shapes
from llmforge.checkpoint.tools import resolve
from llmforge.errors import ConfigError, LLMForgeError
from llmforge.models.spec import check_shape_int

HF_PREFIX = "hf:"


HF_SHAPE_KEYS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "head_dim", "max_seq_len",
                 "moe_intermediate_size", "num_experts"}
"""``model:`` shape keys a config.json sets that must be positive integers within the limits."""


def apply_hf_shape(cfg: Any) -> None:
    """For ``model.init_from: hf:PATH``, set the ``model:`` shape fields from its config.json
    (they must match the weights, so they win over the YAML's); the adapter's
    ``training_keys`` (e.g. a router loss weight) only where the YAML leaves them null.

    Raises:
        ConfigError: the folder's family is not ``model.name``'s (names the one to set); a shape
            in it that is no positive integer within llmforge's limits (names the file and key)."""
    spec = cfg.model.init_from
    if spec and spec.startswith(HF_PREFIX):
        hf = read_hf_config(spec[len(HF_PREFIX):])
        fields = model_overrides_from_hf(hf)
        for key in adapter_for_hf(hf).training_keys:  # settings, not shapes: the YAML's win
            if cfg.model.get(key) is not None:
                fields.pop(key, None)
        family = fields.pop("name")
        if cfg.model.name != family:
            raise ConfigError(f"model.init_from: {spec[len(HF_PREFIX):]} holds a Hugging Face "
                              f"'{hf.get('model_type')}' model, but model.name is "
                              f"'{cfg.model.name}'; set model.name: {family}")
        for key in HF_SHAPE_KEYS & fields.keys():  # the config.json's fault, not a YAML key's
            if fields[key] is not None:
                try:
                    check_shape_int(key, fields[key])
                except ConfigError as exc:
                    raise ConfigError(f"model.init_from: {spec[len(HF_PREFIX):]}/config.json: {exc}") from None
        for key, value in fields.items():
            cfg.model[key] = value


def load_initial_weights(model: nn.Module, spec: str) -> str:
    """Load ``spec`` into a materialized model; returns a short description of what was loaded.

    Raises:
        ConfigError: the path holds no usable weights, or a tensor of another shape.
    """
    if spec.startswith(HF_PREFIX):
        n = load_hf_weights(model, spec[len(HF_PREFIX):])
        return f"{n} tensors from Hugging Face folder {spec[len(HF_PREFIX):]}"
    ckpt = _checkpoint(spec)
    try:
        load_model_weights(ckpt, model)
    except CheckpointShapeError as exc:
        raise ConfigError(f"model.init_from: {exc}") from exc
    return f"model weights of {ckpt}"


def _checkpoint(spec: str) -> Path:
    try:
        return Path(resolve(spec))
    except LLMForgeError as exc:
        raise ConfigError(f"model.init_from: {exc}") from exc


def check_initial_weights(model: nn.Module, spec: str) -> None:
    """Before anything is written: the llmforge checkpoint ``spec`` names is readable and each
    of its model tensors that ``model`` has (built on the meta device; no weights read) has the
    same shape. ``hf:`` sources fix the model's shape themselves and are not checked here.

    Raises:
        ConfigError: no checkpoint there, or a parameter of another shape (named, both shapes).
        CheckpointReadError: its metadata is missing or damaged (the file named).
    """
    if not spec or spec.startswith(HF_PREFIX):
        return
    ckpt = _checkpoint(spec)
    try:
        check_model_shapes(model, str(ckpt))
    except CheckpointShapeError as exc:
        raise ConfigError(f"model.init_from: {exc}") from exc
