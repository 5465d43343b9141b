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
                    n_trainable: int | None = None, cp: int = 1) -> MemoryEstimate:
    """Parameters, gradients and AdamW state per device, in bytes.

    Bytes per parameter: ``fp32`` and ``bf16-mixed`` keep fp32 weights and gradients (4 + 4)
    and two fp32 Adam moments (8); ``bf16-true`` keeps everything in bf16 (2 + 2 + 4). FSDP2
    divides model state by ``dp_shard * tp``; DDP and one process by ``tp`` only. Expert
    parallelism does not change it: the expert weights are split over ``ep`` and FSDP2-sharded
    over the other ``dp_shard / ep`` ranks, ``dp_shard`` shards in all like every other weight
    (what ``ep`` saves is in :func:`gathered_block_bytes`). Context parallelism (``cp``):
    FSDP2 shards over ``dp_shard x cp`` (``dp_shard: -1`` takes the rest of ``world_size``,
    cp included).
    """
    trainable = n_params if n_trainable is None else n_trainable
    width = 2 if precision == "bf16-true" else 4
    tp = max(1, strategy.tp)
    if strategy.name == "fsdp2":
        dp_shard = strategy.dp_shard * cp if strategy.dp_shard > 0 else world_size // (strategy.dp_replicate * tp)
        shards = max(1, dp_shard) * tp
    else:
        shards = tp
    return MemoryEstimate(n_params * width / shards, trainable * width / shards,
                          2 * trainable * width / shards, shards)


def loss_bytes(tokens: int, vocab_size: int, precision: str) -> float:
    """Bytes the loss adds per rank at the step's peak (the end of a micro-batch's forward):
    the logits (``4 V`` bytes per token in fp32; under ``bf16-*`` their bf16 ``2 V`` and the
    fp32 copy the loss reads, ``4 V``) and the fp32 log-probabilities the cross-entropy saves
    (``4 V``): ``8 V`` in fp32, ``10 V`` in bf16. The backward adds none: it turns the saved
    log-probabilities into the logits' gradient in place
    (:func:`llmforge.training.cross_entropy.cross_entropy_sum`), and the logits are dropped
    before it (:meth:`llmforge.training.module.LLMModule.forward_backward`). Not divided by
    ``tp``: the families' tensor-parallel plans gather the logits (``Replicate``) and compute
    the loss as one process does (the estimate divided it, and was 36 % low for the 70B
    yaml)."""
    return float(tokens) * vocab_size * (8 if precision == "fp32" else 10)


def estimate_activations(model: Any, micro_batch_size: int, seq_len: int, precision: str,
                         tp: int = 1, spec: Any = None, bf16_weights: bool = False,
                         n_layers: Optional[int] = None) -> Optional[tuple[float, float]]:
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
    (``bf16_weights=False``) the residual stream, the norms and the MLP's tensors stay in fp32
    (autocast saves bf16 copies beside them) and the attention's tensors in bf16: the formula
    with ``5 D + 4 F`` at 4 bytes and the rest at 2 matches within 3 %; with bf16 weights the
    formula at 2 bytes plus the two RMSNorms' fp32 upcasts (``2 x 4 D`` bytes) does. The widths come from the family's
    ``ModelSpec.memory_shape`` (``spec``, or the registered spec of the model's class);
    ``None`` for models without one. ``n_layers``: the blocks this device runs (a pipeline
    stage's), default all of the model's.
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
    # with fp32 weights under autocast the attention's tensors (q, k, v, their rotated and
    # normed copies) stay bf16: per block and token 96,424 B simulated for Qwen3-0.6B, 94,208
    # here (118,784 with them at 4 B); 20,136 against 19,712 on the Llama demo shape
    attn_width = 2 if precision == "bf16-mixed" else layer_width
    whole = tokens * ((5 * m.dim + 4 * m.ffn_dim) * layer_width
                      + (3 * m.q_dim + 3 * m.kv_dim + m.extra) * attn_width + upcast)
    logits = loss_bytes(tokens, m.vocab_size, precision)
    layers = m.n_layers if n_layers is None else n_layers
    no_ac = layers * whole / tp + logits
    full_ac = layers * tokens * m.dim * width / tp + whole / tp + logits
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


@dataclass
class StageShare:
    """What one pipeline rank holds, for :func:`analytic_peak`: its parameters, its blocks, the
    parameters of the end modules among them (the embedding on the first stage; the final norm
    and the output on the last) and whether it computes the loss (it holds the last stage)."""

    params: int
    blocks: int
    end_params: int
    loss: bool


def ac_mode(algorithms: Any) -> tuple[str, int]:
    """``(mode, every)`` of the run's ``activation_checkpointing`` entry: ``none``, ``full``,
    ``selective`` (per operator) or ``layer`` (full on every ``every``-th block)."""
    for entry in algorithms or []:
        if entry.get("name") == "activation_checkpointing":
            mode = entry.get("mode", "full")
            if mode == "selective" and entry.get("selective", "layer") != "op":
                return "layer", int(entry.get("every", 2))
            return mode, 1
    return "none", 1


def bf16_param_dtype(cfg: Any) -> bool:
    """Whether the forward sees bf16 weights: FSDP2 with a bf16 ``param_dtype``, or
    ``bf16-true``."""
    mp = cfg.strategy.mixed_precision.param_dtype
    return cfg.trainer.precision == "bf16-true" or (
        cfg.strategy.name == "fsdp2" and mp in ("bfloat16", "bf16"))


def analytic_peak(cfg: Any, plan: Any, dims: Any, stage: Optional[StageShare] = None) -> dict[str, float]:
    """The analytic peak per rank of one training step, bytes, split as the simulation splits
    it (:mod:`llmforge.planning.simulate`) plus ``total``.

    * parameters: the sharded weights (:func:`estimate_memory`) plus, under FSDP2 with
      ``dp_shard > 1``, the all-gathered ones in use: two blocks (the current one and the
      prefetched next) and the root's own (embedding, output, final norm; the root is not
      resharded after the forward), in ``strategy.mixed_precision.param_dtype`` (else the
      weights' dtype), divided by ``tp``;
    * gradients, optimizer: :func:`estimate_memory` (sharded: FSDP2 reduce-scatters every
      micro-batch of gradient accumulation, :meth:`llmforge.training.steps.MicroBatchStep.no_sync`);
    * activations: :func:`estimate_activations` of one micro-batch for the run's activation
      checkpointing (``selective`` per operator: what the policy saves, see below, plus one
      block recomputed; ``layer``: full on every ``every``-th block);
    * temporaries: the loss's logits and fp32 log-probabilities (:func:`loss_bytes`);
    * or, where it is larger, the end of the backward: every gradient, plus under FSDP2 about
      2.5 blocks' unsharded gradients in reduction, and no activations.

    With context parallelism (``dims.cp > 1``) FSDP2 shards over ``dp_shard x cp`` and every
    per-token term counts the rank's ``seq_len / cp`` tokens, plus what the attention mode
    holds (:func:`context_parallel_bytes`).

    With pipeline stages, ``stage`` (:class:`StageShare`) is the rank's share: its parameters,
    one micro-batch through its blocks (as the simulation measures it: the schedule's other
    micro-batches in flight are not counted), the loss only where the last stage is.
    """
    model = meta_model(cfg)
    spec = spec_for_model(model)
    n_model = sum(p.numel() for p in model.parameters())
    n = stage.params if stage is not None else n_model
    precision = cfg.trainer.precision
    cp = max(1, int(getattr(dims, "cp", 1)))
    mem = estimate_memory(n, precision, cfg.strategy, plan.world_size // max(1, int(dims.pp)), cp=cp)
    tp = max(1, int(dims.tp))
    width = 2 if precision == "bf16-true" else 4
    gathered = in_reduction = 0.0
    if cfg.strategy.name == "fsdp2" and dims.dp_shard * cp > 1:
        mp, low = cfg.strategy.mixed_precision, ("bfloat16", "bf16", "float16", "fp16")
        comp_w = 2 if mp.param_dtype in low else width
        reduce_w = comp_w if mp.get("reduce_dtype") is None else (2 if mp.reduce_dtype in low else 4)
        blocks = model.blocks() if hasattr(model, "blocks") else []
        block = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
        ends = stage.end_params if stage is not None else n_model - block * len(blocks)
        gathered = (2 * block + ends) * comp_w / tp
        # at the end of the backward: about 2.5 blocks' unsharded gradients in the reduce dtype
        # (the block's own, its reduce-scatter input, the previous one's not yet freed;
        # simulated 2.7 for the 405B yaml's first pipeline stage)
        in_reduction = 2.5 * block * reduce_w / tp
    # the peak is at the end of a micro-batch's forward (all activations saved): gradients are
    # there only when an earlier micro-batch of the step made them (accumulation, pipeline
    # micro-batches); zero_grad(set_to_none=True) frees them between steps
    accumulating = plan.gradient_accumulation_steps > 1 or stage is not None
    grads = mem.grads_bytes if accumulating else 0.0
    out = {"parameters": mem.params_bytes + gathered, "gradients": grads,
           "optimizer": mem.optimizer_bytes, "activations": 0.0, "temporaries": 0.0}
    bf16_weights = bf16_param_dtype(cfg)
    layers = stage.blocks if stage is not None else None
    seq_len = int(cfg.trainer.seq_len) // cp  # the rank's slice of every sequence
    act = estimate_activations(model, plan.micro_batch_size, seq_len, precision, tp, spec,
                               bf16_weights=bf16_weights, n_layers=layers)
    if act is not None:
        m = spec.get("memory_shape")(model)
        layers = m.n_layers if layers is None else layers
        tokens = plan.micro_batch_size * seq_len
        logits = loss_bytes(tokens, m.vocab_size, precision)
        no_ac, full_ac = act[0] - logits, act[1] - logits
        mode, every = ac_mode(cfg.algorithms)
        if mode == "full":  # the recomputed block lives in the backward, the loss's tensors
            # before it (freed once the output layer's backward ran): the larger of the two, not
            # both (the sum was 8.8 % high for the 128K yaml at cp=8, 3.3 GiB of 42.4 simulated)
            inputs = layers * tokens * m.dim * (4 if precision == "fp32" else 2) / tp
            loss_here = logits if stage is None or stage.loss else 0.0
            activations = inputs + max(0.0, full_ac - inputs - loss_here)
        elif mode == "layer":
            k = layers // every
            activations = no_ac - k * (no_ac - full_ac) / max(1, layers)
        elif mode == "selective":  # per operator: each block's input, every second matmul's
            # output (q, v, the SwiGLU's gate, the down projection: q + kv + F + D), the attention
            # output (q) are kept, the rest recomputed one block at a time (measured: 63,872 B
            # per token and block simulated for the 8B yaml, 63,488 here; float8 saves the same)
            act_w = 4 if precision == "fp32" else 2
            saved = tokens * (2 * m.dim + 2 * m.q_dim + m.kv_dim + m.ffn_dim) * act_w / tp
            activations = layers * saved + (no_ac / max(1, layers))
        else:
            activations = no_ac
        if cp > 1:
            ac_blocks = {"full": 1, "layer": layers - layers // every}.get(mode, layers)
            activations += context_parallel_bytes(m, str(cfg.context_parallel.mode), plan.micro_batch_size,
                                                  int(cfg.trainer.seq_len), cp, tp, ac_blocks,
                                                  4 if precision == "fp32" else 2)
        if precision == "bf16-mixed" and not bf16_weights:  # autocast's bf16 copies of the fp32
            # weights, cached for the whole forward (counted with the activations)
            activations += n * 2 / tp
        out["activations"] = activations
        out["temporaries"] = logits if stage is None or stage.loss else 0.0
    # the peak is the larger of the forward's end (above) and the backward's end (the whole
    # step's gradients, those in reduction, no activations): the latter where activations are
    # small (full checkpointing on a pipeline stage without the loss)
    backward = {"parameters": out["parameters"], "gradients": mem.grads_bytes + in_reduction,
                "optimizer": out["optimizer"], "activations": 0.0, "temporaries": 0.0}
    if sum(backward.values()) > sum(out.values()):
        out = backward
    out["total"] = sum(out.values())
    return out


def context_parallel_bytes(m: Any, mode: str, mbs: int, seq_len: int, cp: int, tp: int,
                           saving_blocks: int, width: int = 2) -> float:
    """Bytes per rank the context-parallel attention holds beyond the rank's ``seq_len / cp``
    slice (:class:`llmforge.parallel.context_parallel.ContextParallelAttention`), ``m`` the
    spec's :class:`~llmforge.models.spec.MemoryShape`:

    * ``all_gather``: the K and V of the whole sequence (``mbs x seq_len x 2 kv_dim x width /
      tp``, ``(cp - 1) / cp`` of it beyond the slice) in each of ``saving_blocks`` blocks (the
      attention saves them for its backward: every block without checkpointing, the one
      recomputed under full), plus the boolean causal masks of the rank's two chunks,
      ``[c, (r + 1) c]`` and ``[c, (2 cp - r) c]`` with ``c = seq_len / (2 cp)``: ``(2 cp + 1)
      c^2`` bytes, about ``seq_len^2 / (2 cp)`` (built once per forward, shared by the blocks:
      1.06 GiB at 131,072 tokens and ``cp=8``, 5.0 GiB at ``cp=2``);
    * ``ulysses``: one block's all-to-all buffers, the rank's ``mbs x seq_len / cp`` tokens of
      q, k, v and the output (``2 q_dim + 2 kv_dim`` wide).

    The terms of :func:`llmforge.planning.context.attention_extra_bytes`, plus the masks."""
    if cp <= 1:
        return 0.0
    if mode == "ulysses":
        return mbs * seq_len / cp * (2 * m.q_dim + 2 * m.kv_dim) * width / tp
    c = seq_len // (2 * cp)
    kv = mbs * seq_len * 2 * m.kv_dim * width / tp
    return kv * (cp - 1) / cp * saving_blocks + (2 * cp + 1) * c * c


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


USABLE_FRACTION = 0.9
"""Share of device memory counted as usable (the CUDA context, allocator fragmentation and
NCCL buffers take the rest)."""
