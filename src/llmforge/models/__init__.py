"""Model factories and the built-in Llama 3 model.

Model factory contract
----------------------
A model factory is a callable registered in :data:`llmforge.registry.models` (or named by
import path in ``model.name``). It is called as ``factory(cfg)`` with the ``model:`` config
section (a :class:`llmforge.config.schema.ModelConfig`, usually as an OmegaConf ``DictConfig``)
and returns an ``nn.Module`` with:

* ``forward(tokens: LongTensor[B, T]) -> logits: Tensor[B, T, V]`` (next-token logits);
* ``blocks() -> list[nn.Module]``: the repeated blocks that FSDP2, activation checkpointing
  and ``torch.compile`` wrap one by one;
* ``init_weights()``: (re)initializes every parameter and buffer in place, so that a model
  built under ``with torch.device("meta"):`` then ``to_empty(device=...)`` is fully valid
  after it (deterministic given torch's seed);
* ``flops_per_token(seq_len) -> float``: training FLOPs per token (forward + backward);
* ``num_params() -> int``: parameter count, shared weights once;
* attribute ``vocab_size`` (embedding rows; must cover the tokenizer).

The factory must work when called under ``with torch.device("meta"):`` (no data-dependent
work, no host copies of parameters).

Built in: ``llama3`` -> :func:`build_llama`.
"""

from __future__ import annotations

from typing import Any

from llmforge.errors import ConfigError
from llmforge.models.llama import Llama, LlamaArgs
from llmforge.models.presets import PRESETS, llama_args_from_config
from llmforge.registry import models

__all__ = ["Llama", "LlamaArgs", "PRESETS", "build_llama", "llama_args_from_config"]


def build_llama(cfg: Any, **kwargs: Any) -> Llama:
    """Build a :class:`Llama` from the ``model:`` section (preset plus per-field overrides,
    see :func:`llama_args_from_config`). Parameters are created on the current default device
    (``meta`` inside ``with torch.device("meta"):``) and initialized by ``init_weights``.

    Raises:
        ConfigError: invalid shape, or extra keyword arguments (``model.kwargs``), which the
            built-in factory does not take.
    """
    extra = dict(kwargs)
    cfg_kwargs = cfg.get("kwargs") if hasattr(cfg, "get") else getattr(cfg, "kwargs", None)
    if cfg_kwargs:
        extra.update(dict(cfg_kwargs))
    if extra:
        raise ConfigError(
            f"model.kwargs: the built-in 'llama3' factory takes no extra arguments (got "
            f"{', '.join(sorted(extra))}); set the model: shape fields instead.")
    return Llama(llama_args_from_config(cfg))


models.register("llama3", build_llama)
