"""Context parallelism (``strategy.cp``) in ``llmforge plan``: the ``cp`` degrees a layout may
take, the memory a ``cp`` layout saves and adds per rank, and bad ``--layout cp=`` values.

Each of ``cp`` ranks holds ``seq_len / cp`` tokens of every sequence (two load-balanced chunks
of ``seq_len / (2 cp)``: one from the head, its mirror from the tail) and FSDP2 shards the
model state over ``dp_shard x cp`` ranks. So a ``cp`` layout holds the model state of its
**twin**, the ``cp=1`` layout with ``dp_shard x cp`` shards (:func:`twin`), and ``1 / cp`` of
the twin's per-token memory (saved activations and the temporaries: activation gradients,
logits and log-probabilities), plus what the attention mode adds
(:func:`attention_extra_bytes`).

The planner ranks every ``cp`` layout by these terms applied to its twin's simulation
(:func:`peak_delta`, "estimated"), then confirms the winner by simulating its own layout (the
runtime's context-parallel step on a fake process group, ``simulate``). The step-time terms of the modes live in
:func:`llmforge.planning.step_model.context_parallel_seconds`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from omegaconf import OmegaConf

from llmforge.errors import ConfigError
from llmforge.planning.layout import Layout
from llmforge.planning.setting import Shape
from llmforge.planning.simulate import StepMeasurement

MODES = ("all_gather", "ulysses")
"""``context_parallel.mode`` values the planner knows (``ring``: the published rows only)."""

MIN_TOKENS_PER_RANK = 8192
"""The planner searches ``cp`` only while each rank keeps at least this many tokens of a
sequence: Llama 3's long-context stage ran 131,072 tokens over ``cp=16``, 8,192 per rank, its
pre-training length (Dubey et al. 2024, §3.3.2). Shorter slices make attention and the K/V
collectives too small to run efficiently, which the step-time model does not see; so ``cp``
enters a plan only when sequences are long enough for their activations to need it."""

ESTIMATED = ("cp={cp} estimated: its cp=1 twin (dp_shard {twin}) simulated, then per-token memory "
             "/ cp and the {mode} buffers added (the runtime's cp is not simulated)")
"""The label of a ``cp > 1`` candidate in the plan's output whose own layout was not simulated."""

SIMULATED = ("cp={cp} simulated ({mode}, the runtime's context-parallel step on a fake process group; "
             "estimated from its cp=1 twin: {estimate:.1f} GiB)")
"""The label of a ``cp > 1`` winner confirmed by its own simulation."""


def cp_of(cfg: Any) -> tuple[int, str]:
    """``(strategy.cp, context_parallel.mode)`` of a run config; ``(1, "all_gather")`` where the
    schema has no such keys."""
    return (int(OmegaConf.select(cfg, "strategy.cp", default=1) or 1),
            str(OmegaConf.select(cfg, "context_parallel.mode", default="all_gather")))


def check_cp(cp: int, seq_len: int, world: int, heads: int, mode: str, key: str = "--layout cp") -> None:
    """Refuse a ``cp`` degree the run cannot take.

    Args:
        heads: attention heads per tensor-parallel rank (``n_heads / tp``; ``ulysses`` splits
            them over ``cp``).

    Raises:
        ConfigError: ``cp`` does not divide ``world``, ``seq_len`` is not a multiple of
            ``2 x cp`` (the load-balanced chunks), or ``ulysses`` with heads not divisible by
            ``cp``; the message names ``key`` and the value.
    """
    if world % cp:
        raise ConfigError(f"{key}={cp}: does not divide the {world} GPUs; use a divisor of {world}")
    if seq_len % (2 * cp):
        raise ConfigError(f"{key}={cp}: trainer.seq_len={seq_len} is not a multiple of 2 x cp = {2 * cp} "
                          f"(each cp rank takes two load-balanced chunks of every sequence)")
    if mode == "ulysses" and heads % cp:
        raise ConfigError(f"{key}={cp}: context_parallel.mode=ulysses needs the {heads} attention heads "
                          f"per tensor-parallel rank divisible by cp")


def cp_degrees(seq_len: int, ranks: int, heads: int, mode: str) -> list[int]:
    """``cp`` degrees to search for ``ranks = world / (tp x pp)``: 1, and the powers of two
    that divide ``ranks`` and ``seq_len / 2``, leave each rank :data:`MIN_TOKENS_PER_RANK`
    tokens, and (``ulysses``) divide ``heads`` (per tensor-parallel rank)."""
    out, cp = [1], 2
    while cp <= ranks and seq_len // cp >= MIN_TOKENS_PER_RANK:
        try:
            check_cp(cp, seq_len, ranks, heads, mode)
            out.append(cp)
        except ConfigError:
            pass
        cp *= 2
    return out


def twin(layout: Layout) -> Layout:
    """The ``cp=1`` layout whose model state a ``cp`` layout holds: ``dp_shard x cp`` shards."""
    return replace(layout, dp_shard=layout.dp_shard * layout.cp, cp=1)


def attention_extra_bytes(shape: Shape, mode: str, mbs: int, seq_len: int, cp: int, tp: int, ac: str,
                          layers: float, width: int = 2) -> float:
    """Bytes per rank the attention mode adds to a ``cp`` layout's per-token memory.

    * ``all_gather``: the K and V of the whole sequence (``mbs x seq_len x 2 n_kv_heads x
      head_dim x width / tp``) in place of the rank's slice, ``(cp - 1) / cp`` of it more; the
      attention saves them for its backward in every block without activation checkpointing
      or with ``selective`` (its inputs), in one block (the one recomputed) under ``full``;
    * ``ulysses``: one block's all-to-all buffers, the rank's ``mbs x seq_len / cp`` tokens of
      q, k, v and the output, ``(2 q + 2 kv) x width / tp`` bytes each; the head-sharded
      tensors the attention saves are the size of the sequence-sharded ones;
    * ``ring`` and ``cp=1``: 0.
    """
    if cp <= 1 or mode == "ring":
        return 0.0
    kv = 2 * shape.n_kv_heads * shape.head_dim
    if mode == "ulysses":
        return mbs * seq_len / cp * (2 * shape.n_heads * shape.head_dim + kv) * width / tp
    full = mbs * seq_len * kv * width / tp
    return full * (cp - 1) / cp * (1 if ac == "full" else layers)


def per_token_bytes(m: StepMeasurement) -> float:
    """The part of a simulated peak that grows with the tokens of a micro-batch: the saved
    activations and the temporaries (activation gradients, logits, log-probabilities; also
    the FSDP collective buffers of one block, a small over-count)."""
    return float(m.breakdown.get("activations", 0.0) + m.breakdown.get("temporaries", 0.0))


def peak_delta(ref: StepMeasurement, layout: Layout, shape: Shape, seq_len: int, mode: str,
               width: int = 2) -> float:
    """Bytes to add to the peak of ``layout``'s twin (derived from ``ref``, the simulation of
    its ``(tp, activation checkpointing)`` group, ``pp=1``) to get ``layout``'s: the per-token
    part at ``layout``'s micro-batch size, times ``1 / cp - 1``, plus
    :func:`attention_extra_bytes`. 0 for ``cp=1``."""
    if layout.cp <= 1:
        return 0.0
    tokens = per_token_bytes(ref) * layout.micro_batch_size / ref.layout.micro_batch_size
    extra = attention_extra_bytes(shape, mode, layout.micro_batch_size, seq_len, layout.cp, layout.tp,
                                  layout.activation_checkpointing, shape.n_layers / layout.pp, width)
    return tokens * (1 / layout.cp - 1) + extra


def fitting_cp(m: StepMeasurement, budget: float, seq_len: int) -> Optional[int]:
    """The smallest ``cp`` of :func:`cp_degrees` (any GPU count) at which the part of ``m``'s
    peak that does not shrink with ``dp_shard`` fits in ``budget`` bytes, its per-token part
    sliced ``1 / cp``; ``None`` where none does or ``seq_len`` is 0 (no ``cp`` search)."""
    rest = m.peak_bytes - m.sharded_state
    for cp in cp_degrees(seq_len, seq_len, 1, "all_gather") if seq_len else []:
        if rest - per_token_bytes(m) * (1 - 1 / cp) < budget:
            return cp
    return None


__all__ = ["ESTIMATED", "SIMULATED", "MIN_TOKENS_PER_RANK", "MODES", "attention_extra_bytes", "check_cp", "cp_degrees",
           "cp_of", "fitting_cp", "peak_delta", "per_token_bytes", "twin"]
