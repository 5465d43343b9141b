"""What a training run is, for the step-time model and the planner: a decoder's
:class:`Shape` and one run's layout and recipe on a cluster, its :class:`Setting`. The
published runs (:mod:`llmforge.planning.published`) and the planner's candidates
(:mod:`llmforge.planning.planner`) are both settings."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

from llmforge.config.parallel_schema import CONTEXT_PARALLEL_MODES, PIPELINE_SCHEDULES
from llmforge.planning.layout import AC_MODES


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape: what FLOPs, bytes and collectives follow from."""

    name: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    head_size: int = 0  # 0: dim // n_heads
    tie_embeddings: bool = False  # training refuses pipeline stages then (the search skips them)

    def __post_init__(self) -> None:
        """Raises ValueError naming the field: a width or count that is not an integer >= 1
        (``head_size`` >= 0), a ``name`` that is no string or a ``tie_embeddings`` no bool,
        ``n_heads`` not a multiple of ``n_kv_heads`` (grouped-query
        attention shares each key/value head among whole query heads)."""
        for name in ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "vocab_size", "head_size"):
            value, low = getattr(self, name), 0 if name == "head_size" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Shape.{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.name, str) or not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"Shape.name must be a string and tie_embeddings a bool, got {self.name!r}, "
                             f"{self.tie_embeddings!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Shape.n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if not self.head_dim:
            raise ValueError(f"Shape.dim {self.dim} over n_heads {self.n_heads} leaves no head width; "
                             "give head_size")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def block_params(self) -> int:
        """Parameters of one block: q, k, v, o projections and the SwiGLU's three matrices."""
        hd = self.head_dim
        return self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * self.dim * self.ffn_dim

    @property
    def params(self) -> int:
        """All parameters (untied input embedding and output layer; norms left out)."""
        return self.n_layers * self.block_params + 2 * self.vocab_size * self.dim


PRECISIONS = ("bf16", "fp8_tensorwise", "fp8_rowwise")
CP_MODES = CONTEXT_PARALLEL_MODES + ("ring",)  # ring: torch's experimental one, published rows only


@dataclass(frozen=True)
class Setting:
    """One training run's layout and recipe on a cluster.

    ``global_batch_size`` in sequences of ``seq_len`` tokens; ``micro_batch_size`` sequences
    per forward of one rank (``global_batch_size / (dp_replicate * dp_shard)`` split into
    micro-batches, the pipeline's or gradient accumulation's); ``ac``: none | selective (per
    operator) | full; ``precision``: bf16 | fp8_tensorwise | fp8_rowwise (float8 matmuls of the
    linear layers, torchao; ``fp8_recompute_weight``: its ``force_recompute_fp8_weight_in_bwd``
    as the source states it, which charges no memory either way:
    :func:`~llmforge.planning.whatif.memory_per_rank`; ``fp8_all_gather``: FSDP2 gathers the
    weights in float8; ``fp8_tp_all_gather``: TP's all-gathers move float8 activations and
    gradients under tensorwise float8, torchao's float8 TP styles, as torchtitan and llmforge's
    ``float8`` algorithm apply them by default; ``fp8_share``: the share of the linear layers'
    FLOPs float8 converts, ``None`` for every block's and not the output layer's, the
    ``filter_fqns: [output]`` default of torchtitan and llmforge that the published runs
    ran); ``schedule``: the pipeline schedule
    (``1f1b``, ``interleaved_1f1b``) with ``stages_per_rank`` virtual stages. ``cp_mode``: how ``cp > 1``
    ranks attend across their slices: ``all_gather`` (K/V gathered; llmforge's default),
    ``ulysses`` (all-to-all to head-sharded) or ``ring`` (torch's experimental ring
    ``context_parallel``, which torchtitan's published cp rows ran). ``gpus_per_node``: the
    node a group must fit in to use NVLink; 0 is the GPU kind's reference node
    (:data:`~llmforge.planning.gpus.GPU_KINDS`), a cluster's own otherwise (``--cluster``).
    """

    shape: Shape
    gpu: str
    world: int
    dp_shard: int
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    ac: str = "none"
    precision: str = "bf16"
    fp8_all_gather: bool = False
    fp8_tp_all_gather: bool = False
    fp8_recompute_weight: bool = False
    fp8_share: Optional[float] = None
    compile: bool = False
    async_tp: bool = False
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    cp_mode: str = "all_gather"
    gpus_per_node: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError naming the field: a count below 1, a flag that is no bool, an
        ``fp8_share`` outside [0, 1], an unknown ``ac``,
        ``precision``, ``schedule`` or ``cp_mode``, degrees whose product is not ``world``, more
        pipeline stages than blocks (with ``pp > 1``; without stages ``stages_per_rank`` is
        unused). Whether the batch divides is the callers' check (the planner's base setting
        puts every GPU on ``dp_shard`` before it picks the degrees); :func:`predict
        <llmforge.planning.step_model.predict>` refuses a setting without a micro-batch."""
        for name in ("world", "dp_shard", "global_batch_size", "micro_batch_size", "seq_len",
                     "dp_replicate", "tp", "pp", "cp", "ep", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Setting.{name} must be an integer >= 1, got {value!r}")
        for name in ("fp8_all_gather", "fp8_tp_all_gather", "fp8_recompute_weight", "compile", "async_tp"):
            if not isinstance(getattr(self, name), bool):  # a string 'no' would read as true
                raise ValueError(f"Setting.{name} must be a bool, got {getattr(self, name)!r}")
        share = self.fp8_share  # numbers.Real: a numpy float32 share is a share too
        if share is not None and (isinstance(share, bool) or not isinstance(share, numbers.Real)
                                  or not 0 <= share <= 1):
            raise ValueError(f"Setting.fp8_share must be a share of the linear FLOPs in [0, 1] or None "
                             f"(every block's), got {share!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 0:
            raise ValueError(f"Setting.gpus_per_node must be an integer >= 0 (0: the GPU kind's), "
                             f"got {self.gpus_per_node!r}")
        for name, allowed in (("ac", AC_MODES), ("precision", PRECISIONS), ("schedule", PIPELINE_SCHEDULES),
                              ("cp_mode", CP_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Setting.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        degrees = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if degrees != self.world:
            raise ValueError(f"dp_replicate*dp_shard*tp*pp*cp = {degrees} != world {self.world}")
        if self.pp > 1 and self.pp * self.stages_per_rank > self.shape.n_layers:
            raise ValueError(f"Setting.pp {self.pp} x stages_per_rank {self.stages_per_rank} stages for "
                             f"{self.shape.n_layers} blocks")
