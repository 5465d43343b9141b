"""The parallel-layout keys of the schema (:mod:`llmforge.config.schema`): ``strategy:`` (the
mesh degrees and FSDP2 settings) and ``pipeline:`` (how ``strategy.pp`` cuts the model into
stages). Kept apart from the rest of the schema because the layout is its own subject (and
``llmforge plan`` / ``strategy: auto`` choose it); :class:`~llmforge.config.schema.TrainConfig`
holds them as ``strategy`` and ``pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zbv", "dualpipev")
"""Allowed ``pipeline.schedule`` names (llmforge.parallel.pipeline.SCHEDULE_CLASSES maps them to
torch's classes; tests/test_scale_bad_input.py keeps the two equal)."""
PIPELINE_SPLITS = ("balanced", "lighter_ends")
"""Named ``pipeline.split`` values (or a list of block-index lists)."""


@dataclass
class MixedPrecisionConfig:
    """``strategy.mixed_precision:`` — FSDP2 parameter and reduction dtypes."""

    param_dtype: Optional[str] = None
    """dtype of unsharded parameters in forward/backward (e.g. bfloat16); null = unchanged."""
    reduce_dtype: Optional[str] = None
    """dtype of gradient reduce-scatter (e.g. float32)."""


@dataclass
class StrategyConfig:
    """``strategy:`` — how the model is spread over processes."""

    name: str = "auto"
    """``auto``, ``single``, ``ddp`` or ``fsdp2`` (HSDP = fsdp2 with dp_replicate > 1)."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or the replicate dim of HSDP)."""
    dp_shard: int = -1
    """FSDP shard group size; -1 = the rest of the world."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree: the model's repeated blocks are split into ``pp`` groups of
    ranks (outermost mesh dim; ``pp x dp_replicate x dp_shard x tp`` = world size). See the
    ``pipeline:`` keys and docs/parallelism.md."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over ep ranks, tokens sent to
    them by all-to-all. Borrows ranks from dp_shard (torchtitan's rule; here not from tp): ep
    must divide dp_shard and the model's num_experts; expert weights are FSDP2-sharded over the
    other dp_shard / ep ranks. 1 for a model without experts."""
    cp: int = 1
    """Context-parallel degree: every sequence is cut into ``2 x cp`` chunks and each of the cp
    ranks holds two (one from the head, its mirror from the tail, balancing the causal mask's
    work); attention across the slices as ``context_parallel.mode`` says. The cp ranks of one
    data-parallel rank read the same rows; FSDP2 shards over ``dp_shard x cp``. ``2 x cp`` must
    divide ``trainer.seq_len``. See docs/parallelism.md."""
    reshard_after_forward: bool = True
    """FSDP2: free unsharded parameters after forward (ZeRO-3) or keep them (ZeRO-2)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """FSDP2 mixed-precision policy."""
    cpu_offload: bool = False
    """FSDP2: keep sharded parameters and optimizer state in CPU memory."""


@dataclass
class PipelineConfig:
    """``pipeline:`` — how the model is cut into stages when ``strategy.pp > 1`` (ignored at
    ``pp=1``); see docs/parallelism.md."""

    schedule: str = "1f1b"
    """``1f1b``, ``interleaved_1f1b`` (several stages per rank), ``gpipe`` (all forwards, then
    all backwards), ``zbv`` (zero-bubble V schedule, 2 stages per rank) or ``dualpipev``
    (DeepSeek's DualPipe-V, 2 stages per rank); the torch.distributed.pipelining schedules
    (llmforge.parallel.pipeline.SCHEDULE_CLASSES checks the name)."""
    microbatches: Optional[int] = None
    """Micro-batches the pipeline splits each rank's batch into; null = the gradient-accumulation
    micro-batches (global_batch_size / (micro_batch_size x dp)). Must divide the rank's batch."""
    stages_per_rank: Optional[int] = None
    """Virtual stages per rank; null = 1 for ``1f1b``/``gpipe``, 2 for ``interleaved_1f1b``,
    ``zbv`` and ``dualpipev`` (the V schedules need exactly 2)."""
    split: Any = "balanced"
    """How the blocks are divided among the ``pp x stages_per_rank`` stages: ``balanced`` (equal
    counts; the stages must divide the blocks), ``lighter_ends`` (the first and last stage take
    one block fewer, as they also hold the embedding and the output layer: the stages must
    divide blocks + 2), or an explicit list of block-index lists, one per stage, e.g.
    ``[[0, 1], [2, 3]]``."""


CONTEXT_PARALLEL_MODES = ("all_gather", "ulysses")
"""Allowed ``context_parallel.mode`` values (llmforge.parallel.context_parallel)."""


@dataclass
class ContextParallelConfig:
    """``context_parallel:`` — how attention crosses the sequence slices of ``strategy.cp > 1``
    (ignored at ``cp=1``); see docs/parallelism.md."""

    mode: str = "all_gather"
    """``all_gather``: every layer all-gathers keys and values over the cp ranks and attends its
    local queries to the whole sequence (Llama 3 paper, sec. 3.3.2; any head count);
    ``ulysses``: all-to-all from sequence- to head-sharded, attention of the whole sequence on
    heads / cp heads, all-to-all back (DeepSpeed-Ulysses, arXiv:2309.14509; query heads per
    tensor-parallel rank must divide by cp, kv heads are repeated when they do not)."""


@dataclass
class FaultToleranceConfig:
    """``fault_tolerance:`` — data-parallel replica groups that survive the loss of one of them
    (torchft; the optional extra ``llmforge[ft]``). Each replica group is one ordinary llmforge
    job; across groups gradients are averaged through torchft's managed process group and the
    optimizer step commits only when the quorum agrees. See docs/fault_tolerance.md."""

    enabled: bool = False
    """Run this job as one replica group of a fault-tolerant run."""
    replica_groups: int = 2
    """Replica groups of the whole run (the data is split into this many shards;
    ``trainer.global_batch_size`` is the batch of all of them together)."""
    replica_id: int = 0
    """This job's group, ``0 .. replica_groups - 1`` (its data shard and torchft replica id)."""
    min_replicas: int = 1
    """Fewest groups with which a step may commit (torchft ``min_replica_size``)."""
    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (``torchft_lighthouse --bind HOST:PORT``), which must be
    reachable when the run starts."""
    timeout_s: float = 60.0
    """Seconds a collective, a commit vote or a checkpoint transfer between groups may take."""
    quorum_timeout_s: float = 120.0
    """Seconds to wait for a quorum of groups before the step fails."""
    first_quorum_timeout_s: float = 600.0
    """Seconds this process waits for its first quorum, in place of ``quorum_timeout_s``: the
    other groups may still be queued, starting or compiling (with ``min_replicas`` > 1 a group
    started first waits for them); every later quorum waits ``quorum_timeout_s``."""
