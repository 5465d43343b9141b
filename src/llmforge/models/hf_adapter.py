"""Hugging Face state-dict adapter: the family-specific half of HF import and export.

A family's adapter (``models/<family>/hf.py``) says how its parameter names map to HF's (a
regex table, the layer index as the only group; a parameter HF stores as several keys, one per
expert, through :meth:`HFAdapter.stacked_keys`), which weights HF stores in another layout
(Llama's rotary pairs in halves per head), and how ``config.json`` maps to the family's
``model:`` keys both ways. The generic half — reading safetensors shard by shard, writing
shards, tokenizer files, ``generation_config.json`` — is :mod:`llmforge.checkpoint.hf`.
Anchor: torchtitan's ``StateDictAdapter`` (``torchtitan/protocols/state_dict_adapter.py``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from llmforge.errors import ConfigError

__all__ = ["HFAdapter", "invert_table", "map_key"]


def map_key(key: str, table: list[tuple[str, str]]) -> Optional[str]:
    """The first row of ``table`` (``(regex, replacement)``) that matches ``key``, applied."""
    for pattern, repl in table:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    return None


def invert_table(table: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Swap the rows of an HF -> ours table (the layer index ``(\\d+)`` as the only group)."""
    out = []
    for pattern, repl in table:
        hf = pattern.strip("^$").replace(r"(\d+)", r"\1").replace(r"\.", ".")
        ours = "^" + re.escape(repl).replace(re.escape(r"\1"), r"(\d+)") + "$"
        out.append((ours, hf))
    return out


class HFAdapter:
    """Base adapter. Subclasses set ``family`` (llmforge spec name), ``model_type``,
    ``architecture`` and ``config_class`` (HF's), ``key_table`` (HF regex -> our name) and
    implement :meth:`config_from_hf` / :meth:`config_to_hf` (reading the config through
    :meth:`with_defaults`)."""

    family = ""
    model_type = ""
    architecture = ""
    config_class = ""  # transformers' config class (``LlamaConfig``): the defaults of absent keys
    key_table: list[tuple[str, str]] = []
    training_keys: tuple[str, ...] = ()
    """Keys of :meth:`config_from_hf` that are training settings, not shapes (e.g. a router's
    loss weight): with ``model.init_from: hf:PATH`` a value set in the YAML wins over them."""

    def __init__(self) -> None:
        self.inverse_table = invert_table(self.key_table)

    # -- config.json -----------------------------------------------------------------------
    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` as transformers reads it: built into the installed transformers'
        :attr:`config_class` and returned by its ``to_dict()``, so every absent key has the
        value transformers uses (Qwen3's ``head_dim`` 128 and ``rope_theta`` 10,000 in
        transformers 5.x, not a guess), and ``rope_theta``/``rope_scaling`` are folded into
        ``rope_parameters``. Without transformers, ``hf`` unchanged (the adapter's fallbacks,
        transformers 5.24's defaults, apply).

        Raises:
            ConfigError: transformers refuses a value (e.g. ``head_dim: null``).
        """
        try:
            import transformers
        except ImportError:
            return hf
        cls = getattr(transformers, self.config_class, None)
        if cls is None:
            return hf
        given = {k: v for k, v in hf.items()
                 if k not in ("architectures", "model_type", "transformers_version")}
        try:
            return {**cls(**given).to_dict(), "model_type": self.model_type}
        except Exception as exc:  # transformers' strict dataclass and rope validators
            cause = exc.__cause__ or exc
            raise ConfigError(f"config.json: transformers' {self.config_class} refuses it "
                              f"({type(cause).__name__}: {str(cause).strip().splitlines()[-1][:200]})") from exc

    # -- names ----------------------------------------------------------------------------
    def key_from_hf(self, key: str) -> Optional[str]:
        """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.attention.wq.weight``."""
        return map_key(key, self.key_table)

    def key_to_hf(self, key: str) -> Optional[str]:
        """Inverse of :meth:`key_from_hf` (``None`` for names HF does not have)."""
        return map_key(key, self.inverse_table)

    # -- tensors --------------------------------------------------------------------------
    def tied(self, model: Any) -> bool:
        """Whether ``output.weight`` is the embedding (HF then stores it once)."""
        return bool(getattr(model.args, "tie_embeddings", False))

    def stacked_keys(self, model: Any, name: str) -> Optional[list[str]]:
        """The HF keys whose tensors, stacked on a new dim 0, make our parameter ``name`` (a
        mixture of experts' ``[E, ...]`` weights, which HF stores one key per expert); ``None``
        for a parameter stored under one key (:meth:`key_to_hf`)."""
        return None

    v4_expert_modules: tuple[str, ...] = ()
    """HF module names of one expert's projections in transformers 4 (one module per expert:
    ``gate_proj up_proj down_proj`` for Qwen3-MoE). PEFT (0.19+) reads these names in a model of
    this ``model_type`` as the experts' and moves them to the fused parameters, so a dense
    layer's Linear of such a name cannot be addressed by an adapter file."""

    runtime_expert_params: tuple[str, ...] = ()
    """Names of the 3-D expert parameters of transformers' runtime expert module, in the order
    it registers them (``("gate_up_proj", "down_proj")`` for Qwen3-MoE); adapter formats that
    wrap them one by one (PEFT's ``target_parameters``) nest in this order."""

    def runtime_expert_param(self, name: str) -> Optional[tuple[str, str, int, int]]:
        """Where our expert weight ``name`` (``layers.0.feed_forward.experts.w1``, ``[E, out,
        in]``) lives in transformers' runtime model, which may fuse several of ours on dim 1:
        ``(module path, parameter name, part, parts)``, the parameter being ``[E, parts * out,
        in]`` with ours at rows ``part * out .. (part + 1) * out``; ``None`` when HF has no
        such parameter."""
        return None

    def permuted_heads(self, model: Any, name: str) -> Optional[int]:
        """Number of heads whose rows HF stores permuted for parameter ``name`` (``None``: the
        same layout). The reader then reads whole heads and applies :meth:`from_hf_rows`."""
        return None

    def to_hf_rows(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """Our row layout -> HF's for a tensor of :meth:`permuted_heads` heads."""
        return t

    def from_hf_rows(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """HF's row layout -> ours; the inverse of :meth:`to_hf_rows`."""
        return t

    # -- config.json ----------------------------------------------------------------------
    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """``model:`` keys (``name`` included) that reproduce an HF ``config.json``.

        Raises:
            ConfigError: a setting the family cannot represent."""
        raise NotImplementedError

    def config_to_hf(self, model: Any) -> dict[str, Any]:
        """The HF ``config.json`` fields of a built model (without dtype and token ids)."""
        raise NotImplementedError
