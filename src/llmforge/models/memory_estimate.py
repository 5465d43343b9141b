"""The memory model of a run: bytes per device for parameters, gradients and AdamW state, and the
activations of one micro-batch from the spec's :class:`~llmforge.models.spec.MemoryShape`.

Used by ``--dry-run`` (:mod:`llmforge.training.dry_run`) and by plugins' own fit verdicts
(``Algorithm.dry_run_lines``: EMA, adapters). FLOPs per token come from the spec
(:meth:`llmforge.models.spec.ModelSpec.flops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


from llmforge.models.spec import spec_for_model

GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per device for the model state (``*_bytes``) and the sharding degree used."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    shards: int

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def estimate_memory(n_params: int, precision: str, strategy: Any, world_size: int,
                    n_trainable: int | None = None) -> MemoryEstimate:
    """Parameters, gradients and AdamW state per device, in bytes.

    Bytes per parameter: ``fp32`` and ``bf16-mixed`` keep fp32 weights and gradients (4 + 4)
    and two fp32 Adam moments (8); ``bf16-true`` keeps everything in bf16 (2 + 2 + 4). FSDP2
    divides model state by ``dp_shard * tp``; DDP and one process by ``tp`` only. Expert
    parallelism does not change it: the expert weights are split over ``ep`` and FSDP2-sharded
    over the other ``dp_shard / ep`` ranks, ``dp_shard`` shards in all like every other weight
    (what ``ep`` saves is in :func:`gathered_block_bytes`).
    """
    trainable = n_params if n_trainable is None else n_trainable
    width = 2 if precision == "bf16-true" else 4
    tp = max(1, strategy.tp)
    if strategy.name == "fsdp2":
        dp_shard = strategy.dp_shard if strategy.dp_shard > 0 else world_size // (strategy.dp_replicate * tp)
        shards = max(1, dp_shard) * tp
    else:
        shards = tp
    return MemoryEstimate(n_params * width / shards, trainable * width / shards,
                          2 * trainable * width / shards, shards)


def estimate_activations(model: Any, micro_batch_size: int, seq_len: int, precision: str,
                         tp: int = 1, spec: Any = None) -> Optional[tuple[float, float]]:
    """Activation bytes per device for one micro-batch: ``(no checkpointing, full checkpointing)``.

    Counts the tensors a decoder block saves for backward, per token (method of Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4, adapted
    to RMSNorm, GQA, SwiGLU and fused SDPA attention, which saves no T x T scores):
    ``5 D + 3 q + 3 kv + 4 F + extra`` elements (two norms' inputs and outputs, q/k/v and their
    rotated copies, the attention output, the SwiGLU's four F-wide tensors; ``extra`` from the
    family, e.g. QK-norm outputs; for Llama ``q = D`` and this is ``8 D + 3 kv + 4 F``), in the
    activation dtype (2 bytes for bf16 precisions, 4 for fp32), divided by ``tp`` (sequence
    parallel). Full activation checkpointing keeps only each block's input (``D`` per token per
    layer) plus one block recomputed at a time. The fp32 logits and their gradient (``2 x 4 V``
    bytes per token) come on top in both cases. The widths come from the family's
    ``ModelSpec.memory_shape`` (``spec``, or the registered spec of the model's class);
    ``None`` for models without one.
    """
    spec = spec if spec is not None else spec_for_model(model)
    fn = spec.get("memory_shape") if spec is not None else None
    if fn is None:
        return None
    m = fn(model)
    width = 4 if precision == "fp32" else 2
    tokens = micro_batch_size * seq_len
    per_layer = tokens * (5 * m.dim + 3 * m.q_dim + 3 * m.kv_dim + 4 * m.ffn_dim + m.extra) * width / tp
    logits = tokens * m.vocab_size * 4 * 2 / tp
    no_ac = m.n_layers * per_layer + logits
    full_ac = m.n_layers * tokens * m.dim * width / tp + per_layer + logits
    return no_ac, full_ac


def gathered_block_bytes(model: Any, spec: Any, width: int, tp: int = 1,
                         ep: int = 1) -> Optional[tuple[float, float, int]]:
    """The weights of the largest repeated block as FSDP2 all-gathers them for its forward and
    backward (one block at a time, plus the next one prefetched), bytes per device:
    ``(block, of which experts, experts per device)``. Expert layers (``ModelSpec.experts``)
    count ``1 / ep`` of their experts (a rank gathers only its own), the other weights
    ``1 / tp``; ``width`` bytes per element (4 fp32, 2 bf16). ``None`` for a model without
    expert layers."""
    experts = spec.expert_modules(model)
    if not experts:
        return None
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    best = (0.0, 0.0)
    for block in spec.model_blocks(model):
        ex = sum(p.numel() for p in block.parameters() if id(p) in expert_ids) / ep
        rest = sum(p.numel() for p in block.parameters() if id(p) not in expert_ids) / tp
        best = max(best, ((ex + rest) * width, ex * width))
    return best[0], best[1], max(int(m.num_experts) for m in experts) // ep


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


USABLE_FRACTION = 0.9
"""Share of device memory counted as usable (the CUDA context, allocator fragmentation and
NCCL buffers take the rest)."""
