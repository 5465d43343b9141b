"""Autoregressive text generation from a model that maps ``tokens [B, T] -> logits [B, T, V]``.

With a KV cache (:class:`KVCache`, for models whose ``forward`` and blocks take ``cache=``:
the built-in Llama 3 and Qwen3) the prompt is run once and each new token costs one position;
the cache lives here, with generation, and the model only reads and extends it. Other models,
and a context that outgrows ``max_seq_len``, re-run the model on the (cropped) context, which is
O(n^2) in the generated length but exact for any model following the factory contract. Both
give the same greedy tokens.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Callable, List, Optional

import torch
from torch import nn

__all__ = ["generate", "KVCache", "supports_kv_cache"]


class _LayerCache:
    """One layer's keys and values ``[B, K, max_len, hd]``, filled up to the cache's length."""

    def __init__(self, owner: "KVCache") -> None:
        self.owner = owner
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, K, T, hd]`` after the cached positions; return all ``[B, K, n, hd]``."""
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_len, k.shape[3])
            self.k = k.new_empty(shape)
            self.v = v.new_empty(shape)
        if end > self.owner.max_len:
            raise ValueError(f"KV cache full: {end} positions > max_len {self.owner.max_len}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for incremental decoding, preallocated for ``max_len``
    positions on first use (memory: ``2 * L * B * K * max_len * hd`` elements in the model's
    dtype). The model calls ``layer(i).update(k, v)`` in each block and ``advance(T)`` once per
    forward; ``length`` is the number of cached positions (the next token's position)."""

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.max_len, self.length = int(max_len), 0
        self._layers = [_LayerCache(self) for _ in range(n_layers)]

    def layer(self, i: int) -> _LayerCache:
        return self._layers[i]

    def advance(self, n: int) -> None:
        self.length += int(n)


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` and every block's ``forward`` take a ``cache`` argument (a
    research block that overrides ``forward(x, rope)`` does not, so it is run uncached)."""
    blocks = model.blocks() if callable(getattr(model, "blocks", None)) else None
    if not blocks or "cache" not in inspect.signature(model.forward).parameters:
        return False
    return all("cache" in inspect.signature(b.forward).parameters for b in blocks)


_TOLD_UNCACHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Models :func:`generate` has said it decodes uncached (once each, not once per sample)."""


def no_kv_cache_reason(model: nn.Module) -> str:
    """Why :func:`supports_kv_cache` is False for ``model`` (``""`` when it is True): the
    first ``forward`` without a ``cache`` argument, or no ``blocks()``."""
    blocks = model.blocks() if callable(getattr(model, "blocks", None)) else None
    if not blocks:
        return f"{type(model).__name__} has no blocks()"
    for obj in (model, *blocks):
        if "cache" not in inspect.signature(obj.forward).parameters:
            return f"{type(obj).__name__}.forward takes no cache argument"
    return ""


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def generate(model: nn.Module, prompt_ids: List[int], max_new_tokens: int,
             temperature: float = 0.8, top_k: Optional[int] = 50, eos_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None, use_cache: bool = True,
             on_token: Optional[Callable[[int], None]] = None) -> List[int]:
    """Sample up to ``max_new_tokens`` tokens after ``prompt_ids``; returns only the new ids.

    Args:
        model: ``forward(tokens [1, T]) -> logits [1, T, V]``. Run in eval mode under
            ``torch.no_grad`` (its training mode is restored afterwards). If it has an int
            attribute ``max_seq_len``, the context is cropped to the last ``max_seq_len`` tokens.
        prompt_ids: at least one token id.
        max_new_tokens: number of tokens to generate (>= 0).
        temperature: logits are divided by it before the softmax; ``0`` = greedy (argmax).
        top_k: sample only among the ``top_k`` most likely tokens; ``None`` = all.
        eos_id: stop after this id is generated (it is included in the result).
        generator: RNG for sampling (its device is where sampling runs); None = global RNG.
        use_cache: decode with a :class:`KVCache` when the model supports one
            (:func:`supports_kv_cache`); the tokens are the same either way. A model that
            does not is decoded uncached, with one line on stderr saying why (once per model).
        on_token: called with each new id as soon as it is chosen (streaming output).

    Raises:
        ValueError: an argument is out of range (the message names it and its value).
    """
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError(f"prompt_ids must be a non-empty list of token ids; got {prompt_ids!r}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt_ids):
        raise ValueError(f"prompt_ids must hold non-negative ints; got {list(prompt_ids)!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0; got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and max(prompt_ids) >= vocab:
        raise ValueError(f"prompt_ids holds id {max(prompt_ids)} >= model vocab_size {vocab}")
    max_len = getattr(model, "max_seq_len", None)
    max_len = max_len if isinstance(max_len, int) and max_len > 0 else None

    device = _model_device(model)
    tokens = list(prompt_ids)
    new: List[int] = []
    cache = None
    if use_cache and supports_kv_cache(model) and max_len is not None:
        cache = KVCache(len(model.blocks()), max_len)
    elif use_cache and not supports_kv_cache(model) and model not in _TOLD_UNCACHED:
        # the same tokens, but every one recomputes the context: say so once per model
        _TOLD_UNCACHED.add(model)
        print(f"generate: decoding without a KV cache ({no_kv_cache_reason(model)}); a block "
              "whose forward takes (x, rope, mask=None, cache=None) and passes them to its "
              "attention decodes cached (docs/research.md)", file=sys.stderr)
    was_training = model.training
    model.eval()
    try:
        # a compiled model (the compile algorithm, e.g. in a run's sample callback) runs eager
        # here: every decode step has new shapes, so it would recompile once per token and stop
        # at dynamo's recompile limit (an error under fullgraph)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for _ in range(max_new_tokens):
                if cache is not None and len(tokens) > max_len:
                    cache = None  # the window now slides: recompute on the cropped context
                if cache is None:
                    ctx = tokens[-max_len:] if max_len is not None else tokens
                    logits = model(torch.tensor([ctx], dtype=torch.long, device=device))[0, -1]
                else:
                    ctx = tokens[cache.length:]  # the prompt first, then one token per step
                    x = torch.tensor([ctx], dtype=torch.long, device=device)
                    logits = model(x, cache=cache)[0, -1]
                nxt = _choose(logits.float(), temperature, top_k, generator)
                tokens.append(nxt)
                new.append(nxt)
                if on_token is not None:
                    on_token(nxt)
                if eos_id is not None and nxt == eos_id:
                    break
    finally:
        model.train(was_training)
    return new


def _choose(logits: torch.Tensor, temperature: float, top_k: Optional[int],
            generator: Optional[torch.Generator]) -> int:
    """The next id from ``logits [V]``: argmax at temperature 0, else a top-k sample."""
    if temperature == 0:
        return int(torch.argmax(logits).item())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if generator is not None:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())
