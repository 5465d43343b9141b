"""Float8 in the step-time model (:mod:`llmforge.planning.step_model`): the share of the linear
FLOPs float8 converts, and the memory-bound casts of its operands at torchao's roofline bytes
(``float8_cast``, nothing fitted)."""

from __future__ import annotations

from llmforge.planning.gpus import GPUKind
from llmforge.planning.setting import Setting, Shape


def block_linear_share(shape: Shape) -> float:
    """The blocks' share of the linear layers' FLOPs (the rest is the output layer's): what
    float8 converts by default (``filter_fqns: [output]``)."""
    blocks = shape.n_layers * shape.block_params
    return blocks / (blocks + shape.vocab_size * shape.dim)


def fp8_share(s: Setting) -> float:
    """The share of the linear FLOPs float8 runs: ``s.fp8_share``, else every block's."""
    return block_linear_share(s.shape) if s.fp8_share is None else float(s.fp8_share)


def block_matrices(sh: Shape, tp: int) -> list[tuple[float, float, bool]]:
    """``(K, N, column_parallel)`` of one block's q, k, v, o and SwiGLU (w1, w3, w2) matrices on
    one rank, sharded by ``tp`` as Megatron-LM shards them: column-parallel q, k, v, w1, w3
    ``N / tp`` (their input is all-gathered under sequence parallelism), row-parallel o, w2
    ``K / tp`` (their output reduce-scattered, its gradient all-gathered)."""
    d, hd, f = sh.dim, sh.head_dim, sh.ffn_dim
    q, kv = sh.n_heads * hd / tp, sh.n_kv_heads * hd / tp
    return [(d, q, True), (d, kv, True), (d, kv, True), (q, d, False), (d, f / tp, True), (d, f / tp, True),
            (f / tp, d, False)]


FLOAT8_CAST_BYTES = {"fp8_tensorwise": (4.0, 6.0), "fp8_rowwise": (6.0, 8.0)}
"""Bytes read and written per element to cast a float8 matmul's operands, compiled,
``(activation, weight)``: torchao's float8 roofline (``torchao/testing/training/roofline_utils.py``
at pytorch/ao 36027d8, ``get_tensor_memory_traffic_ovhd_s`` with ``fuse_with_prev``: the first
bf16 read fused into the op before it; eager reads it once more, 2 bytes). Tensorwise: an
activation (input, output gradient) is read once in bf16 and written twice in float8 (row- and
column-major); a weight is cast twice (forward, backward). Rowwise: each layout is scaled along
its own rows, so an activation is cast, transposed in bf16 and cast again; a weight is cast,
transposed and cast."""

FLOAT8_CAST_BANDWIDTH = 0.92
"""Share of the GPU's memory bandwidth the casting kernels reach (torchao's roofline:
``pct_achievable_mem_bw``, pointwise triton kernels with large inputs on an H100)."""


def float8_cast_seconds(s: Setting, gpu: GPUKind, clock: float, recompute: float, n_micro: int) -> float:
    """Seconds per step of one rank casting the float8 matmuls' operands (0 under bf16).

    Per block matmul ``(M, K) x (K, N)`` on the rank (:func:`block_matrices`; ``M`` the
    micro-batch's ``mbs x s / cp`` rows): its input ``M K`` and output gradient ``M N`` at the
    activation's :data:`FLOAT8_CAST_BYTES` (2 more eager), its weight ``K N`` at the weight's;
    under TP with float8 all-gathers (``fp8_tp_all_gather``, tensorwise) the gathered operand,
    a column-parallel input or a row-parallel output gradient, is cast on the rank's ``1 / tp``
    shard (1 byte written, not 2) and the gathered float8 copy transposed for the backward
    (1 byte read, 1 written). Every one of the rank's ``n_micro`` micro-batches per step, the forward's again under recomputation
    (``recompute``), scaled to the setting's float8 share of the blocks, at
    :data:`FLOAT8_CAST_BANDWIDTH` of ``gpu.memory_bw`` times ``clock``. Why float8 gains less
    on narrow matmuls (TP shards) than on wide ones: the cast grows with ``K + N`` per row, the
    FLOPs with ``K N`` (torchao's float8 README: small shapes run slower in float8).
    """
    if s.precision not in FLOAT8_CAST_BYTES:
        return 0.0
    act, weight = (b + (0.0 if s.compile else 2.0) for b in FLOAT8_CAST_BYTES[s.precision])
    rows = s.micro_batch_size * s.seq_len / s.cp
    sharded = s.tp > 1 and s.fp8_tp_all_gather and s.precision == "fp8_tensorwise"
    gathered_act = (act - 1.0) / s.tp + 2.0 if sharded else act
    per_block = sum(rows * ((k * gathered_act + n * act) if column else (k * act + n * gathered_act))
                    + k * n * weight for k, n, column in block_matrices(s.shape, s.tp))
    share = fp8_share(s) / block_linear_share(s.shape)
    return (n_micro * s.shape.n_layers / s.pp * per_block * recompute * share
            / (gpu.memory_bw * clock * FLOAT8_CAST_BANDWIDTH))


__all__ = ["FLOAT8_CAST_BANDWIDTH", "FLOAT8_CAST_BYTES", "block_linear_share", "block_matrices",
           "float8_cast_seconds", "fp8_share"]
