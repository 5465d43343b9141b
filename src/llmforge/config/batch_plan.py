"""The batch arithmetic of a run: how a config's ``trainer.global_batch_size``,
``micro_batch_size`` and the mesh (``strategy.*``) divide over the world size
(:class:`BatchPlan`, :func:`plan_batch`, :func:`data_parallel_size`). Nothing is rounded
silently: what does not divide raises :class:`~llmforge.errors.ConfigError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmforge.errors import ConfigError

__all__ = ["BatchPlan", "check_positive_sizes", "data_parallel_size", "plan_batch", "resolve_world"]


@dataclass
class BatchPlan:
    """Batch arithmetic of a run. Sizes are in sequences unless the name says tokens."""

    world_size: int
    """Processes in the job."""
    dp_size: int
    """Data-parallel ranks (dp_replicate x dp_shard); each sees different data."""
    micro_batch_size: int
    """Sequences per forward/backward on one rank."""
    global_batch_size: int
    """Sequences per optimizer step over all data-parallel ranks."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step on one rank."""
    local_batch_size: int
    """Sequences per optimizer step on one rank (micro_batch_size x gradient_accumulation_steps)."""
    seq_len: int
    """Tokens per sequence."""
    tokens_per_step: int
    """Tokens per optimizer step over all ranks (global_batch_size x seq_len)."""


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_world(cfg: Any, world_size: Optional[int]) -> int:
    """``world_size``, or ``trainer.devices x trainer.num_nodes`` when it is None.

    Raises:
        ConfigError: the world size is below 1."""
    if world_size is None:
        world_size = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size} (trainer.devices x trainer.num_nodes)")
    return world_size


def data_parallel_size(cfg: Any, world_size: Optional[int] = 1) -> int:
    """Data-parallel size ``dp_replicate * dp_shard`` from ``cfg.strategy`` for ``world_size``
    processes (None: ``trainer.devices * trainer.num_nodes``); ``dp_shard=-1`` takes the rest,
    ``world_size // (pp * dp_replicate * tp)``. With ``strategy.pp > 1`` the sizes below are
    those of one pipeline stage (``world_size // pp`` ranks), and with ``strategy.cp > 1`` those
    of one context-parallel rank (the cp ranks of a data-parallel rank share its rows).

    Raises:
        ConfigError: pp, cp, tp, dp_replicate or dp_shard is not positive, cp does not divide
            the world size, (dp_shard may be -1), pp
            or tp does not divide the world size, or dp_replicate x dp_shard x tp != world size; the message
            names the sizes and a setting that works.
    """
    world = resolve_world(cfg, world_size)
    s = cfg.strategy
    pp = int(s.get("pp", 1))
    if pp < 1:
        raise ConfigError(f"strategy.pp must be >= 1, got {pp}")
    if world % pp:
        options = ", ".join(map(str, _divisors(world)))
        raise ConfigError(f"strategy.pp={pp} does not divide the world size {world}; use one of "
                          f"{options} (e.g. strategy.pp=1)")
    ep = s.get("ep", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"strategy.ep must be an integer >= 1 (1 = no expert parallelism), got {ep!r}")
    world //= pp  # the ranks of one pipeline stage; the other dims multiply to this
    cp = s.get("cp", 1)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"strategy.cp must be an integer >= 1 (1 = no context parallelism), got {cp!r}")
    if world % cp:
        options = ", ".join(map(str, _divisors(world)))
        raise ConfigError(f"strategy.cp={cp} does not divide the world size {world}"
                          f"{' / strategy.pp' if pp > 1 else ''}; use one of {options}"
                          + (" (the world size is trainer.devices x trainer.num_nodes, or --nproc)"
                             if world == 1 else ""))
    world //= cp  # the cp ranks of one data-parallel rank read the same rows
    tp, rep, shard = int(s.tp), int(s.dp_replicate), int(s.dp_shard)
    if tp < 1:
        raise ConfigError(f"strategy.tp must be >= 1, got {tp}")
    if rep < 1:
        raise ConfigError(f"strategy.dp_replicate must be >= 1, got {rep}")
    if shard < 1 and shard != -1:
        raise ConfigError(f"strategy.dp_shard must be >= 1 or -1 (the rest of the world), got {shard}")
    if world % tp:
        options = ", ".join(map(str, _divisors(world)))
        raise ConfigError(
            f"strategy.tp={tp} does not divide the world size {world}; use one of {options} "
            f"(e.g. strategy.tp=1)"
        )
    if shard == -1:
        if (world // tp) % rep:
            good = [d for d in _divisors(world // tp)]
            raise ConfigError(
                f"strategy.dp_replicate={rep} x strategy.tp={tp} = {rep * tp} does not divide the "
                f"world size {world}; use strategy.dp_replicate in {good} (e.g. strategy.dp_replicate=1)"
            )
        shard = world // (tp * rep)
    elif rep * shard * tp != world:
        if world % (rep * tp) == 0:
            fix = f"strategy.dp_shard=-1 (= {world // (rep * tp)})"
        else:
            fix = f"strategy.dp_replicate=1 strategy.dp_shard=-1 (= {world // tp})"
        raise ConfigError(
            f"strategy.dp_replicate ({rep}) x strategy.dp_shard ({shard}) x strategy.tp ({tp}) = "
            f"{rep * shard * tp} must equal the world size ({world}); try {fix}"
        )
    return rep * shard



def check_positive_sizes(cfg: Any) -> None:
    """``trainer.micro_batch_size``, ``seq_len`` and ``global_batch_size`` are positive (what
    ``llmforge plan`` checks before any layout: it divides by them).

    Raises:
        ConfigError: naming the key and its value.
    """
    for key in ("micro_batch_size", "seq_len", "global_batch_size"):
        value = int(cfg.trainer[key])
        if value <= 0:
            raise ConfigError(f"trainer.{key} must be > 0, got {value}")

def plan_batch(cfg: Any, world_size: Optional[int] = 1) -> BatchPlan:
    """Derive gradient accumulation and per-rank sizes from ``cfg.trainer`` and the strategy.

    With ``fault_tolerance.enabled`` the global batch is that of all replica groups together:
    one group's ranks hold ``global_batch_size / replica_groups`` sequences per step, and
    ``dp_size`` stays the group's own.

    Raises:
        ConfigError: micro_batch_size or seq_len is not positive, or global_batch_size is not a
            positive multiple of micro_batch_size x data-parallel size (x replica groups) (the message gives the
            numbers and the nearest valid values), or a strategy size error (see
            :func:`data_parallel_size`).
    """
    world = resolve_world(cfg, world_size)
    t = cfg.trainer
    mbs, gbs, seq = int(t.micro_batch_size), int(t.global_batch_size), int(t.seq_len)
    check_positive_sizes(cfg)
    dp = data_parallel_size(cfg, world)
    # fault-tolerant replica groups split the global batch too (each group is one job of `world`)
    ft = cfg.get("fault_tolerance")
    groups = int(ft.replica_groups) if ft is not None and ft.enabled else 1
    unit = mbs * dp * groups
    if gbs <= 0 or gbs % unit:
        lower = (max(gbs, 0) // unit) * unit
        tries = f"{lower} or {lower + unit}" if lower > 0 else f"{unit}"
        across = f" x fault_tolerance.replica_groups ({groups})" if groups > 1 else ""
        raise ConfigError(
            f"trainer.global_batch_size={gbs} must be a multiple of micro_batch_size ({mbs}) x "
            f"data-parallel size ({dp}){across} = {unit}; try {tries}"
        )
    accum = gbs // unit
    return BatchPlan(
        world_size=world,
        dp_size=dp,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        gradient_accumulation_steps=accum,
        local_batch_size=mbs * accum,
        seq_len=seq,
        tokens_per_step=gbs * seq,
    )
