"""The analytic step-time model: seconds per optimizer step of one rank for a
:class:`~llmforge.planning.setting.Setting`, split into the terms that make it, with the few
constants of :class:`CostParams` (fitted in :mod:`llmforge.planning.calibration`).

Terms (seconds per step, one rank):

* **compute**: the rank's FLOPs (``global tokens x FLOPs per token / world``) at
  ``matmul_efficiency / gemm_slowdown`` of the GPU's dense bf16 peak (:func:`gemm_slowdown`:
  the rank's matmul shapes, narrower under ``tp`` and with fewer tokens per micro-batch;
  attention at ``attention_efficiency`` of that); compiled, the linear layers' time is divided
  by ``compile_speedup`` (a fitted lump: the GEMM kernels are the same, what compiling saves
  around them, fused casts, fewer copies and launches, is charged there) and the attention's is
  not (inductor calls the same flash attention kernel and nothing around it scales with its
  FLOPs: a long-context step, mostly attention, gains little from compiling);
  the linear FLOPs float8 converts (``Setting.fp8_share``; by default every block's, not the
  output layer's) divided again by ``fp8_*_speedup``. FLOPs per token:
  ``6 x`` the matmul parameters (blocks and output layer) plus causal attention
  ``6 L s d`` (fwd + bwd, half of the full ``12 L s d``: PaLM, Chowdhery et al. 2022 App. B);
  activation checkpointing recomputes the forward: full ``x 4/3`` of everything, selective
  (torchtitan's per-operator policy, every second matmul kept) ``x 7/6`` of the linear part.
  A power-limited GPU kind (``-500W``) runs at ``power_limited_clock`` of its peak.
* **elementwise**: the memory-bound work beside the matmuls (norms, RoPE, the SwiGLU's
  activation and product, residual adds): ``elementwise_passes`` bf16 reads or writes of a
  ``d + F`` wide row per token and block (forward and backward, recomputed with the forward
  under AC), ``/ tp`` (sequence parallel), at the GPU's memory bandwidth (``memory_bw``,
  times ``power_limited_clock``); compiled, ``compile_fusion`` of it is left (inductor fuses
  the chains into fewer kernels). Its share of the step falls as ``1 / d``: what makes a 1B
  model slower per FLOP than an 8B one on the same GPU (roofline, Williams et al. 2009).
* **float8_cast**: under float8 the memory-bound casts of each block matmul's input, weight
  and output gradient, at torchao's roofline bytes per element (:func:`float8_cast_seconds`;
  nothing fitted): what leaves float8 little or no gain on narrow matmuls.
* **pipeline stages**: the most loaded rank paces the schedule, so with stages compute,
  elementwise and float8_cast are the mean rank's times
  :func:`~llmforge.planning.stages.stage_imbalance` (whole blocks
  per stage, the output layer on the last one; nothing fitted); the **bubble** is (compute +
  elementwise + float8_cast) ``x bubble / (1 - bubble)``
  (:func:`llmforge.parallel.pipeline.bubble_fraction`, the schedule's formula, nothing fitted).
* **FSDP** (over ``dp_shard x cp`` ranks): per block two all-gathers of the weights (one with
  pipeline stages: torchtitan keeps them after the forward) in bf16 (1 byte for float8
  all-gather) and one reduce-scatter of fp32 gradients, every micro-batch without pipeline
  stages (FSDP2 reshards after each forward and reduces after each backward), once per step
  with them; **CP**: the ring passes the K, V shard
  ``cp - 1`` times per block (forward, and twice in the backward; ``cp_mode: ring``, the mode
  of the published cp rows); **HSDP**: an all-reduce of
  the sharded gradient across replicas (as often as the reduce-scatter). These overlap with
  the compute (with elementwise and float8_cast) up to ``fsdp_overlap`` of it; the rest is
  exposed. Hidden traffic is not free inside a node: NCCL's NVLink kernels take SMs and
  memory bandwidth from the matmuls they run beside, so ``nvlink_contention`` of the
  overlapped NVLink seconds is added (Lee et al. 2025, arXiv 2507.03114: overlapping slowed
  compute by 18.9 % on average, up to 40 %, on 4 A100 / H100); network traffic moves ~10x fewer
  bytes per second per GPU and is charged nothing for it.
* **CP** (``all_gather``, ``ulysses``): the K/V all-gather and gradient reduce-scatter, or the
  all-to-alls, per block and micro-batch, exposed (:func:`context_parallel_seconds`).
* **TP** (sequence parallel, Megatron-style): per block and micro-batch
  :data:`TP_CALLS_PER_BLOCK` all-gathers and reduce-scatters of ``mbs x s / cp x d``
  activations: two of each forward, the same backward, and what the recomputation repeats
  (the all-gathers, :data:`TP_GATHERS_PER_BLOCK`, in 1 byte per element with the setting's
  ``fp8_tp_all_gather`` under tensorwise float8: torchao's float8 TP styles cast before
  gathering; the reduce-scatters stay bf16): exposed at ``tp_exposed`` (``async_tp_exposed``
  with async TP, whose matmuls hide part of it).
* **PP**: each micro-batch's hidden states cross each virtual stage boundary forward and back,
  exposed.

Every collective costs ``latency + bytes_per_rank / (bandwidth x efficiency)`` by link (alpha-beta,
Hockney 1994): NVLink when a node holds its groups whole (:func:`in_node`; ``tp`` innermost,
then ``cp``, then ``dp_shard``), the network otherwise; a ring over ``n`` ranks moves ``(n - 1) / n`` of the
payload per rank (twice for an all-reduce).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from llmforge.parallel.pipeline import bubble_fraction, min_microbatches
from llmforge.planning.float8_cast import block_linear_share, block_matrices, float8_cast_seconds, fp8_share
from llmforge.planning.gpus import GPUKind, gpu_kind
from llmforge.planning.setting import Setting, Shape
from llmforge.planning.stages import stage_imbalance


@dataclass(frozen=True)
class CostParams:
    """The step-time model's constants; none depends on the model or the run.

    Attributes:
        matmul_efficiency: achieved share of the dense bf16 peak, eager, of a wide matmul.
        narrow_width: the arithmetic intensity ``K N / (K + N)`` of a ``(M, K) x (K, N)``
            matmul at which its efficiency halves (:func:`gemm_slowdown`).
        narrow_power: how sharply the efficiency falls below ``narrow_width`` (1: a hyperbola).
        attention_efficiency: attention's speed relative to the matmuls (flash attention).
        compile_speedup: speed-up of the linear layers' compute under ``torch.compile``, a
            fitted lump of what compiling saves around the same GEMMs (not the attention's:
            the same flash attention kernel runs compiled or eager).
        fp8_tensorwise_speedup, fp8_rowwise_speedup: speed-up of the linear layers' matmuls
            under float8 (tensorwise / rowwise scaling).
        power_limited_clock: share of the SXM peak a ``-500W`` GPU kind runs at.
        nvlink_latency, network_latency: seconds per collective call.
        nvlink_efficiency, network_efficiency: achieved share of the GPU table's bandwidth.
        fsdp_overlap: share of the compute that can hide FSDP / CP / HSDP traffic.
        tp_exposed, async_tp_exposed: share of the tensor-parallel traffic left exposed (its
            bound reaches above 1, traffic that costs more than its bytes, so that the prior,
            1, is not the bound: a constant started at its bound cannot move in the fit).
        elementwise_passes: bf16 passes over a ``d + F`` wide row per token and block,
            forward and backward, of the memory-bound work beside the matmuls.
        compile_fusion: share of that traffic left under ``torch.compile``.
        nvlink_contention: compute seconds lost per second of FSDP traffic hidden under it
            when that traffic runs on NVLink (module docstring).

    Defaults are the prior the fit pulls towards where no row informs a constant; where a
    kernel benchmark knows the value, the default is that: ``attention_efficiency`` 0.5 is
    FlashAttention-2's 35 % of the H100's bf16 peak (Shah et al. 2024, FlashAttention-3,
    arXiv 2407.08608, abstract) over the ~70 % a large bf16 GEMM reaches.
    """

    matmul_efficiency: float = 0.45
    narrow_width: float = 256.0
    attention_efficiency: float = 0.5
    compile_speedup: float = 1.15
    fp8_tensorwise_speedup: float = 1.4
    fp8_rowwise_speedup: float = 1.2
    power_limited_clock: float = 0.85
    nvlink_latency: float = 20e-6
    network_latency: float = 40e-6
    nvlink_efficiency: float = 0.7
    network_efficiency: float = 0.7
    fsdp_overlap: float = 0.9
    tp_exposed: float = 1.0
    async_tp_exposed: float = 0.5
    elementwise_passes: float = 20.0
    compile_fusion: float = 0.5
    nvlink_contention: float = 0.2
    narrow_power: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class Prediction:
    """Seconds per step of one rank by term, and what follows. ``terms``: compute (matmuls and
    attention), elementwise (memory-bound), float8_cast (memory-bound), bubble, data_parallel
    (FSDP / HSDP / ring CP, exposed), tp, pp, cp (all_gather / ulysses), with the raw (before
    overlap) FSDP/CP traffic in ``overlapped``."""

    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    terms: dict[str, float]
    overlapped: float

    @property
    def limit(self) -> str:
        """The largest term: what the step waits on most."""
        return max(self.terms, key=self.terms.get)


def flops_per_token(shape: Shape, seq_len: int) -> tuple[float, float]:
    """``(linear, attention)`` training FLOPs per token (forward + backward, no recomputation):
    ``6 x`` the matmul parameters (blocks and output layer), causal attention ``6 L s d``."""
    linear = 6.0 * (shape.n_layers * shape.block_params + shape.vocab_size * shape.dim)
    attention = 6.0 * shape.n_layers * seq_len * shape.dim
    return linear, attention


def model_flops_per_token(shape: Shape, seq_len: int) -> float:
    """FLOPs per token MFU is counted with (PaLM, Chowdhery et al. 2022 App. B, as torchtitan
    and ``llmforge plan``'s table count it): ``6 x`` the matmul parameters plus ``12 L s d``
    of attention (not halved for the causal mask), no recomputation. The step's time charges
    the causal half only (:func:`flops_per_token`)."""
    linear, attention = flops_per_token(shape, seq_len)
    return linear + 2 * attention


TP_CALLS_PER_BLOCK = {"none": 8, "selective": 10, "full": 11}
"""Sequence-parallel all-gathers and reduce-scatters of one block's activations per micro-batch,
by activation checkpointing, as the simulation counts them (``tests/test_planning.py``):
2 + 2 forward and 2 + 2 backward; selective AC (torchtitan's policy, llmforge's ``op``) saves the
reduce-scatters' outputs but not the all-gathers', so the backward gathers both block inputs
again (+2); full AC recomputes the forward up to the last tensor the backward needs (torch's
checkpoint stops early), all but the final reduce-scatter (+3)."""

TP_GATHERS_PER_BLOCK = {"none": 4, "selective": 6, "full": 6}
"""The all-gathers among :data:`TP_CALLS_PER_BLOCK`: the block inputs' forward and the output
gradients' backward (2 + 2), and what selective (+2) and full AC (+2 of their +3) gather again."""


def node_size(s: Setting, gpu: GPUKind) -> int:
    """GPUs per node of ``s``: its own (a cluster's), else the GPU kind's reference node."""
    return s.gpus_per_node or gpu.gpus_per_node


def in_node(group: int, node: int) -> bool:
    """Whether every group of ``group`` consecutive ranks lies inside one node of ``node`` GPUs
    (a node holds whole groups: ``node`` a multiple of ``group``), so it runs on NVLink."""
    return group <= node and node % group == 0


def _collective(n: int, payload: float, calls: float, intra: bool, gpu: GPUKind, p: CostParams,
                all_reduce: bool = False) -> float:
    """Seconds of ``calls`` ring collectives over ``n`` ranks moving ``payload`` bytes (summed,
    unsharded size) in all."""
    if n <= 1:
        return 0.0
    bw = gpu.intra_node_bw * p.nvlink_efficiency if intra else gpu.inter_node_bw * p.network_efficiency
    lat = p.nvlink_latency if intra else p.network_latency
    return calls * lat + (2.0 if all_reduce else 1.0) * payload * (n - 1) / n / bw


def context_parallel_seconds(s: Setting, p: CostParams) -> float:
    """Exposed seconds of context parallelism's collectives for one block and one micro-batch
    (0 for ``cp=1`` and for ``ring``, whose passes overlap with compute like FSDP's traffic).

    * ``all_gather`` (Llama 3, Dubey et al. 2024 §3.3.2): the forward all-gathers the K and V
      of the whole sequence (``mbs x s x 2 kv_heads x head_dim``, bf16, ``/ tp``) before the
      block's attention, the backward reduce-scatters their gradients (the same bytes), full
      activation checkpointing all-gathers once more when it recomputes the forward;
    * ``ulysses`` (Jacobs et al. 2023, DeepSpeed-Ulysses): four all-to-alls per block, q, k, v
      to head-sharded and the attention output back, forward and backward (six with full
      AC), each moving the rank's ``mbs x s / cp`` tokens of ``q + 2 kv`` (resp. ``q``) widths.

    Both sit on the attention's critical path (exposed); each costs the ring collectives'
    alpha-beta time over ``cp`` ranks (:func:`_collective`), on NVLink when ``cp x tp`` ranks
    fit in a node.
    """
    if s.cp <= 1 or s.cp_mode == "ring":
        return 0.0
    gpu, sh = gpu_kind(s.gpu, "gpu"), s.shape
    intra = in_node(s.cp * s.tp, node_size(s, gpu))
    kv = 2 * sh.n_kv_heads * sh.head_dim
    if s.cp_mode == "ulysses":
        widths = 2 * sh.n_heads * sh.head_dim + kv  # q, k, v in, the output (q wide) back
        passes = 3 if s.ac == "full" else 2
        local = s.micro_batch_size * s.seq_len / s.cp
        return _collective(s.cp, passes * local * widths * 2.0 / s.tp, 2 * passes, intra, gpu, p)
    full = s.micro_batch_size * s.seq_len * kv * 2.0 / s.tp  # K, V of the whole sequence
    calls = 3 if s.ac == "full" else 2
    return _collective(s.cp, calls * full, calls, intra, gpu, p)


def gemm_slowdown(sh: Shape, tp: int, p: CostParams, rows: float = float("inf")) -> float:
    """How much slower than a wide matmul the rank's matmuls run (>= 1): the FLOP-weighted mean of
    ``1 + (narrow_width / I) ** narrow_power`` over the block's q, k, v, o and SwiGLU matrices
    and the output layer, where ``1 / I = 1 / M + 1 / K + 1 / N``: ``I`` is the arithmetic
    intensity of a ``(M, K) x (K, N)`` matmul, ``M K N`` multiply-adds over the ``M K + K N +
    M N`` elements it reads and writes (the roofline's axis, Williams et al. 2009; the weight
    gradient's ``(K, M) x (M, N)`` has the same). ``M`` is ``rows``, the rank's tokens per
    micro-batch (``mbs x s / cp``; default: many). Each matrix is sharded by ``tp`` as Megatron-LM
    shards it (column-parallel q, k, v, w1, w3 and output: ``N / tp``; row-parallel o, w2:
    ``K / tp``).

    The narrow side decides: Llama 3.1 70B under TP 8 (its SwiGLU 8,192 x 3,584 per rank,
    ``K N / (K + N)`` 2,493) is close to the 8B without TP (4,096 x 14,336: 3,186), the 8B under
    TP 8 (4,096 x 1,792: 1,247) is not (slowdowns 1.09, 1.16 and 1.32 over many rows with the
    fitted constants; 1.12, 1.20 and 1.35 at 8,192 rows); the width ``d / tp`` this replaced put
    the 70B at a quarter of the 8B's. OLMo-core's 13B at one 4,096-token sequence per
    micro-batch: 1.06x its slowdown over many rows.

    Raises:
        ValueError: ``tp`` below 1 or ``rows`` not above 0.
    """
    if not 1 <= tp < float("inf") or not rows > 0:
        raise ValueError(f"gemm_slowdown: tp must be >= 1 and rows > 0, got tp={tp!r}, rows={rows!r}")
    d, v = sh.dim, sh.vocab_size
    mats = [(k * n * sh.n_layers, k, n) for k, n, _ in block_matrices(sh, tp)] + [(d * v / tp, d, v / tp)]
    slow = sum(w * (1 + (p.narrow_width * (k + n + k * n / rows) / (k * n)) ** p.narrow_power) for w, k, n in mats)
    return slow / sum(w for w, _, _ in mats)


def predict(s: Setting, p: CostParams) -> Prediction:
    """The step of ``s`` under ``p`` (module docstring).

    Raises:
        ConfigError: unknown GPU kind in ``s.gpu``.
        ValueError: a global batch that does not split into whole micro-batches on every
            data-parallel rank; fewer micro-batches than the pipeline schedule runs
            (:func:`~llmforge.parallel.pipeline.min_microbatches`).
    """
    gpu = gpu_kind(s.gpu, "gpu")
    sh = s.shape
    node = node_size(s, gpu)
    dp = s.dp_replicate * s.dp_shard
    n_micro = s.global_batch_size // dp // s.micro_batch_size
    if n_micro < 1 or s.global_batch_size % (dp * s.micro_batch_size):
        raise ValueError(f"global_batch_size {s.global_batch_size} does not split into micro-batches of "
                         f"{s.micro_batch_size} sequences on each of {dp} data-parallel ranks")
    need = min_microbatches(s.schedule, s.pp) if s.pp > 1 else 1
    if n_micro < need:
        raise ValueError(f"{n_micro} micro-batches for {s.schedule} on {s.pp} pipeline stages, which runs "
                         f"{need} at least (a smaller micro_batch_size gives more)")
    tokens = s.global_batch_size * s.seq_len
    linear, attention = flops_per_token(sh, s.seq_len)
    # full AC recomputes the whole forward, selective every second matmul (not the attention)
    recompute = {"full": 4 / 3, "selective": 7 / 6}.get(s.ac, 1.0)
    linear *= recompute
    if s.ac == "full":
        attention *= recompute
    clock = p.power_limited_clock if gpu.name.endswith("-500W") else 1.0
    efficiency = p.matmul_efficiency / gemm_slowdown(sh, s.tp, p, s.micro_batch_size * s.seq_len / s.cp)
    speed = gpu.bf16_flops * efficiency * clock
    fp8 = {"fp8_tensorwise": p.fp8_tensorwise_speedup, "fp8_rowwise": p.fp8_rowwise_speedup}.get(s.precision, 1.0)
    share = fp8_share(s)
    compiled = p.compile_speedup if s.compile else 1.0
    compute = (tokens / s.world * (linear * (share / fp8 + 1 - share) / compiled
                                   + attention / p.attention_efficiency) / speed)
    elementwise = (tokens / s.world * sh.n_layers * p.elementwise_passes * (sh.dim + sh.ffn_dim) * 2.0
                   * recompute * (p.compile_fusion if s.compile else 1.0) / (gpu.memory_bw * clock))
    # the slowest pipeline rank paces the schedule
    slowest = stage_imbalance(sh, s.pp, s.stages_per_rank, s.seq_len)
    cast = float8_cast_seconds(s, gpu, clock, recompute, n_micro)
    compute, elementwise, cast = compute * slowest, elementwise * slowest, cast * slowest
    bubble_share = bubble_fraction(s.schedule, s.pp, n_micro, s.stages_per_rank) if s.pp > 1 else 0.0
    bubble = (compute + elementwise + cast) * bubble_share / (1 - bubble_share)

    layers = sh.n_layers / s.pp  # blocks on this rank
    w_gather = 1.0 if s.fp8_all_gather and s.precision != "bf16" else 2.0
    block = sh.block_params / s.tp
    ends = 2 * sh.vocab_size * sh.dim / s.tp / s.pp  # embedding and output, on the end stages
    local = block * layers + ends
    fsdp_n = s.dp_shard * s.cp
    fsdp_intra = in_node(fsdp_n * s.tp, node)
    gathers = 1 if s.pp > 1 else 2
    # without stages FSDP2 reshards after each micro-batch's forward and reduce-scatters after
    # each backward (torchtitan, llmforge's MicroBatchStep); the pipeline keeps them for the step
    syncs = 1 if s.pp > 1 else n_micro
    fsdp = (_collective(fsdp_n, local * w_gather * gathers * syncs, gathers * (layers + 1) * syncs,
                        fsdp_intra, gpu, p)
            + _collective(fsdp_n, local * 4.0 * syncs, (layers + 1) * syncs, fsdp_intra, gpu, p))
    if s.dp_replicate > 1:
        reps = syncs if fsdp_n > 1 else 1  # replicated weights (DDP) all-reduce once per step
        fsdp += _collective(s.dp_replicate, local * 4.0 / fsdp_n * reps, (layers + 1) * reps,
                            in_node(s.world, node), gpu, p, all_reduce=True)
    micro_tokens = s.micro_batch_size * s.seq_len / s.cp
    passes = 4 if s.ac == "full" else 3
    if s.cp > 1 and s.cp_mode == "ring":
        kv = micro_tokens * 2 * sh.n_kv_heads * sh.head_dim * 2.0 / s.tp
        # a ring pass sends the rank's K, V shard to the next rank, cp - 1 times per pass
        fsdp += n_micro * layers * passes * (s.cp - 1) * _collective(
            2, 2 * kv, 1, in_node(s.cp * s.tp, node), gpu, p)
    exposed_fsdp = max(0.0, fsdp - p.fsdp_overlap * (compute + elementwise + cast))
    if fsdp_intra:
        exposed_fsdp += p.nvlink_contention * min(fsdp, p.fsdp_overlap * (compute + elementwise + cast))
    tp = 0.0
    if s.tp > 1:
        calls = n_micro * layers * TP_CALLS_PER_BLOCK[s.ac]
        gathers = n_micro * layers * TP_GATHERS_PER_BLOCK[s.ac]
        act = micro_tokens * sh.dim * 2.0
        # float8 all-gathers (torchao's Float8 TP styles) move 1 byte an element; the reduce-scatters stay bf16
        fp8_gathers = s.fp8_tp_all_gather and s.precision == "fp8_tensorwise"
        payload = act * (calls - gathers / 2) if fp8_gathers else act * calls
        tp = _collective(s.tp, payload, calls, in_node(s.tp, node), gpu, p)
        tp *= p.async_tp_exposed if s.async_tp else p.tp_exposed
    pp = 0.0
    if s.pp > 1:
        sends = 2 * n_micro * s.stages_per_rank
        hidden = micro_tokens * sh.dim * 2.0 / s.tp
        pp = _collective(2, 2 * hidden * sends, sends, s.world // s.pp < node, gpu, p)
    cp = context_parallel_seconds(s, p) * n_micro * layers
    terms = {"compute": compute, "elementwise": elementwise, "float8_cast": cast, "bubble": bubble,
             "data_parallel": exposed_fsdp, "tp": tp, "pp": pp, "cp": cp}
    step = sum(terms.values())
    tps = tokens / step / s.world
    mfu = tps * model_flops_per_token(sh, s.seq_len) / gpu.bf16_flops
    return Prediction(step, tps, mfu, terms, fsdp)


__all__ = ["CostParams", "Prediction", "block_linear_share", "context_parallel_seconds", "flops_per_token",
           "fp8_share", "gemm_slowdown", "in_node", "model_flops_per_token", "predict", "TP_CALLS_PER_BLOCK",
           "TP_GATHERS_PER_BLOCK"]
