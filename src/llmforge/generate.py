"""``llmforge generate``: sample text from a trained run (or one checkpoint), loaded by
:mod:`llmforge.checkpoint.run_dir`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from llmforge.checkpoint.run_dir import load_for_inference
from llmforge.data.chat import build_chat_template
from llmforge.errors import ConfigError
from llmforge.models.sampling import generate, supports_kv_cache
from llmforge.parallel.threads import choose_num_threads


def use_inference_threads() -> int:
    """Set torch's compute threads for ``generate`` and ``eval`` by training's rule
    (:func:`llmforge.parallel.threads.choose_num_threads`: one process, no data worker, the
    cores other processes leave free; ``OMP_NUM_THREADS`` wins) and return the count. Measured
    beside one CPU-burning process on 2 cores: torch's default 2 threads gave 197-201 tokens/s,
    1 thread 607-797 (issue 27; ``benchmarks/generate.py --burner``)."""
    n, _ = choose_num_threads(None, 1, 0)
    torch.set_num_threads(n)
    return n


def sample_text(path: str | Path, prompt: str, *, max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: Optional[int] = 50, seed: int = 0,
                chat: bool = False, use_cache: bool = True,
                on_text: Optional[Callable[[str], None]] = None,
                stats: Optional[dict] = None, trust_code: bool = False) -> str:
    """Sample a continuation of ``prompt`` (the returned text excludes the prompt).

    ``chat``: ``prompt`` is one user turn, rendered with the run's ``data.chat_template``
    (Llama 3 by default) and followed by the assistant header; sampling stops at the template's
    end-of-turn token (``<|eot_id|>``), which is left out of the returned answer.
    ``use_cache``: decode with a KV cache (:class:`llmforge.models.sampling.KVCache`) when the
    model supports one; same tokens, one position of compute per new token.
    ``on_text``: called with each new piece of text as soon as it decodes (streaming; a piece
    that ends inside a multi-byte character waits for the next token).
    ``stats``: filled with ``tokens`` (generated), ``seconds`` (wall time of generation, model
    load excluded), ``tokens_per_second``, ``kv_cache`` (whether the cache was used) and
    ``threads`` (torch's compute threads, set by :func:`use_inference_threads`).
    ``trust_code``: import the research code the run's config names (``--trust-code``; see
    :mod:`llmforge.checkpoint.run_dir`).

    Generation stops at the model's context length (its ``max_seq_len``, the positions its RoPE
    table holds): when the prompt plus ``max_new_tokens`` would pass it, fewer tokens are
    generated and one line on stderr says how many and why (``stats["context_stop"]`` is then
    True).

    Raises:
        ConfigError: ``chat`` and the run's tokenizer lacks the template's special tokens; the
            run's config names code and ``trust_code`` is False; the prompt alone fills the
            model's context.
    """
    import time

    threads = use_inference_threads()
    model, tok, cfg = load_for_inference(path, trust_code=trust_code)
    gen = torch.Generator().manual_seed(seed)
    stop = tok.eos_id
    if chat:
        template = build_chat_template(cfg.data.get("chat_template") or "llama3", tok)
        ids, stop = template.prompt_ids([{"role": "user", "content": prompt}]), template.stop_id
    else:
        ids = tok.encode(prompt, bos=True)
    requested, max_new_tokens = max_new_tokens, _fit_context(model, len(ids), max_new_tokens)
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
                     kv_cache=use_cache and supports_kv_cache(model), threads=threads,
                     context_stop=max_new_tokens < requested)
    return text


def _fit_context(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int) -> int:
    """The new tokens that fit the model's context after the prompt (a line on stderr when
    fewer than asked). A model without an int ``max_seq_len`` has no limit here."""
    max_len = getattr(model, "max_seq_len", None)
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 0:
        return max_new_tokens
    room = max_len - prompt_tokens
    if room <= 0 and max_new_tokens > 0:
        raise ConfigError(f"the prompt is {prompt_tokens} tokens and the model's context is {max_len} "
                          "(its max_seq_len): nothing fits after it; shorten the prompt")
    if max_new_tokens > room:
        print(f"generate: stopping after {room} new tokens, at the model's context length of "
              f"{max_len} (max_seq_len; the prompt takes {prompt_tokens}), not the {max_new_tokens} "
              "asked: its positions (RoPE) go no further", file=sys.stderr, flush=True)
        return room
    return max_new_tokens
