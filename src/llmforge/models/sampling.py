"""Autoregressive text generation from a model that maps ``tokens [B, T] -> logits [B, T, V]``.

No KV cache: every step re-runs the model on the (cropped) context, which is O(n^2) in the
generated length but exact and works for any model following the factory contract.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

__all__ = ["generate"]


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def generate(model: nn.Module, prompt_ids: List[int], max_new_tokens: int,
             temperature: float = 0.8, top_k: Optional[int] = 50, eos_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None) -> List[int]:
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
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                ctx = tokens[-max_len:] if max_len is not None else tokens
                x = torch.tensor([ctx], dtype=torch.long, device=device)
                logits = model(x)[0, -1].float()  # [V]
                if temperature == 0:
                    nxt = int(torch.argmax(logits).item())
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.numel():
                        kth = torch.topk(logits, top_k).values[-1]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = torch.softmax(logits, dim=-1)
                    if generator is not None:
                        probs = probs.to(generator.device)
                    nxt = int(torch.multinomial(probs, 1, generator=generator).item())
                tokens.append(nxt)
                new.append(nxt)
                if eos_id is not None and nxt == eos_id:
                    break
    finally:
        model.train(was_training)
    return new
