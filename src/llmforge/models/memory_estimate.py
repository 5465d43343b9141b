"""The memory model of a run: bytes per device for parameters, gradients and AdamW state, and the
activations of one micro-batch from the spec's :class:`~llmforge.models.spec.MemoryShape`.

Used by ``--dry-run`` (:mod:`llmforge.planning.dry_run_report`) and by plugins' own fit verdicts
(``Algorithm.dry_run_lines``: EMA, adapters). FLOPs per token come from the spec
(:meth:`llmforge.models.spec.ModelSpec.flops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


from llmforge.models.spec import spec_for_model
from llmforge.plugin import meta_model

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


def loss_bytes(tokens: int, vocab_size: int, precision: str) -> float:
    """Bytes the loss adds per rank: the logits in the activation dtype, the fp32 log-softmax
    the cross-entropy saves and two fp32 gradients in its backward, ``(3 x 4 + width) V`` bytes
    per token (``width`` 4 in fp32, else 2; the simulation's measurement: ``2 x 4 V`` was
    14-16 % low on the demo configs, and 8,192 tokens at V = 128,256 hold 13.9 GiB at the 70B
    yaml's backward peak against 13.7 here). Not divided by ``tp``: the families'
    tensor-parallel plans gather the logits (``Replicate``) and compute the loss as one
    process does (the estimate divided it, and was 36 % low for the 70B yaml)."""
    return float(tokens) * vocab_size * (3 * 4 + (4 if precision == "fp32" else 2))


def estimate_activations(model: Any, micro_batch_size: int, seq_len: int, precision: str,
                         tp: int = 1, spec: Any = None, bf16_weights: bool = False
                         ) -> Optional[tuple[float, float]]:
    """Activation bytes per device for one micro-batch: ``(no checkpointing, full checkpointing)``.

    Counts the tensors a decoder block saves for backward, per token (method of Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4, adapted
    to RMSNorm, GQA, SwiGLU and fused SDPA attention, which saves no T x T scores):
    ``5 D + 3 q + 3 kv + 4 F + extra`` elements (two norms' inputs and outputs, q/k/v and their
    rotated copies, the attention output, the SwiGLU's four F-wide tensors; ``extra`` from the
    family, e.g. QK-norm outputs; for Llama ``q = D`` and this is ``8 D + 3 kv + 4 F``), in the
    activation dtype (2 bytes for bf16 precisions, 4 for fp32), divided by ``tp`` (sequence
    parallel). Full activation checkpointing keeps only each block's input (``D`` per token per
    layer) plus one block recomputed at a time. The loss comes on top in both cases
    (:func:`loss_bytes`).

    ``bf16-mixed`` (autocast) depends on the weights' dtype in the forward, as the simulation
    measured (demo shape, per block and token: 20,136 bytes with fp32 weights, 13,096 with
    FSDP2's bf16 ``param_dtype``, against 10,496 for the formula at 2 bytes): with fp32 weights
    (``bf16_weights=False``) the residual stream, the norms and the rotary embedding stay in
    fp32 and autocast saves bf16 copies beside them, which the formula at 4 bytes matches
    within 5 %; with bf16 weights the formula at 2 bytes plus the two RMSNorms' fp32 upcasts
    (``2 x 4 D`` bytes) does. The widths come from the family's
    ``ModelSpec.memory_shape`` (``spec``, or the registered spec of the model's class);
    ``None`` for models without one.
    """
    spec = spec if spec is not None else spec_for_model(model)
    fn = spec.get("memory_shape") if spec is not None else None
    if fn is None:
        return None
    m = fn(model)
    width = 4 if precision == "fp32" else 2
    layer_width = 4 if precision == "bf16-mixed" and not bf16_weights else width
    tokens = micro_batch_size * seq_len
    upcast = 2 * m.dim * 4 if precision == "bf16-mixed" and bf16_weights else 0
    per_layer = tokens * ((5 * m.dim + 3 * m.q_dim + 3 * m.kv_dim + 4 * m.ffn_dim + m.extra)
                          * layer_width + upcast) / tp
    logits = loss_bytes(tokens, m.vocab_size, precision)
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
def ac_mode(algorithms: Any) -> tuple[str, int]:
    """``(mode, every)`` of the run's ``activation_checkpointing`` entry: ``none``, ``full``,
    ``selective`` (per operator) or ``layer`` (full on every ``every``-th block)."""
    for entry in algorithms or []:
        if entry.get("name") == "activation_checkpointing":
            mode = entry.get("mode", "full")
            if mode == "selective" and entry.get("selective", "op") != "op":
                return "layer", int(entry.get("every", 2))
            return mode, 1
    return "none", 1


def bf16_param_dtype(cfg: Any) -> bool:
    """Whether the forward sees bf16 weights: FSDP2 with a bf16 ``param_dtype``, or
    ``bf16-true``."""
    mp = cfg.strategy.mixed_precision.param_dtype
    return cfg.trainer.precision == "bf16-true" or (
        cfg.strategy.name == "fsdp2" and mp in ("bfloat16", "bf16"))


def analytic_peak(cfg: Any, plan: Any, dims: Any) -> dict[str, float]:
    """The analytic peak per rank of one training step, bytes, split as the simulation splits
    it (:mod:`llmforge.planning.simulate`) plus ``total``.

    * parameters: the sharded weights (:func:`estimate_memory`) plus, under FSDP2 with
      ``dp_shard > 1``, the all-gathered ones in use: two blocks (the current one and the
      prefetched next) and the root's own (embedding, output, final norm; the root is not
      resharded after the forward), in ``strategy.mixed_precision.param_dtype`` (else the
      weights' dtype), divided by ``tp``;
    * gradients, optimizer: :func:`estimate_memory` (sharded: FSDP2 reduce-scatters every
      micro-batch of gradient accumulation, :meth:`llmforge.training.module.LLMModule.no_sync`);
    * activations: :func:`estimate_activations` of one micro-batch for the run's activation
      checkpointing (``selective`` per operator: the no-checkpointing figure less the SwiGLU's
      recomputed elementwise tensors, see below; ``layer``: full on every ``every``-th block);
    * temporaries: the loss's logits, fp32 log-softmax and gradients (:func:`estimate_activations`).
    """
    model = meta_model(cfg)
    spec = spec_for_model(model)
    n = sum(p.numel() for p in model.parameters())
    precision = cfg.trainer.precision
    mem = estimate_memory(n, precision, cfg.strategy, plan.world_size)
    tp = max(1, int(dims.tp))
    width = 2 if precision == "bf16-true" else 4
    gathered = 0.0
    if cfg.strategy.name == "fsdp2" and dims.dp_shard > 1:
        mp = cfg.strategy.mixed_precision.param_dtype
        comp_w = 2 if mp in ("bfloat16", "bf16", "float16", "fp16") else width
        blocks = model.blocks() if hasattr(model, "blocks") else []
        block = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
        gathered = (2 * block + n - block * len(blocks)) * comp_w / tp
    grads = mem.grads_bytes
    out = {"parameters": mem.params_bytes + gathered, "gradients": grads,
           "optimizer": mem.optimizer_bytes, "activations": 0.0, "temporaries": 0.0}
    bf16_weights = bf16_param_dtype(cfg)
    act = estimate_activations(model, plan.micro_batch_size, cfg.trainer.seq_len, precision, tp, spec,
                               bf16_weights=bf16_weights)
    if act is not None:
        m = spec.get("memory_shape")(model)
        tokens = plan.micro_batch_size * cfg.trainer.seq_len
        logits = loss_bytes(tokens, m.vocab_size, precision)
        no_ac, full_ac = act[0] - logits, act[1] - logits
        mode, every = ac_mode(cfg.algorithms)
        if mode == "full":
            activations = full_ac
        elif mode == "layer":
            k = m.n_layers // every
            activations = no_ac - k * (no_ac - full_ac) / m.n_layers
        elif mode == "selective":  # the policy keeps matmul and attention outputs and recomputes
            # the SwiGLU's elementwise products (2 F per token per layer)
            act_w = 4 if precision == "fp32" else 2
            activations = no_ac - m.n_layers * tokens * 2 * m.ffn_dim * act_w / tp
        else:
            activations = no_ac
        if precision == "bf16-mixed" and not bf16_weights:  # autocast's bf16 copies of the fp32
            # weights, cached for the whole forward (counted with the activations)
            activations += n * 2 / tp
        out["activations"], out["temporaries"] = activations, logits
    out["total"] = sum(out.values())
    return out


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


USABLE_FRACTION = 0.9
"""Share of device memory counted as usable (the CUDA context, allocator fragmentation and
NCCL buffers take the rest)."""
