"""Analytic what-if of a layout: memory per rank (:func:`memory_per_rank`), the calibrated
step-time model's verdict (:func:`assess`), and the fastest layout that fits for a recipe
(:func:`best_layout`). No simulation: formulas on the model's shape only, cheap enough to
check every published run (``benchmarks/planner_fidelity.py``) and to answer
``llmforge plan --layout`` at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

from llmforge.planning.calibration import FITTED, comparison_error
from llmforge.planning.context import attention_extra_bytes
from llmforge.planning.gpus import gpu_kind
from llmforge.planning.layout import AC_MODES
from llmforge.planning.setting import Setting
from llmforge.planning.stages import in_flight
from llmforge.planning.step_model import CostParams, Prediction, predict

FIT_SHARE = 0.80
"""Share of device memory a predicted peak may use and count as fitting: in 454 runs a
predicted peak below about 80 % of device memory gave no out-of-memory failure (arXiv
2411.06465); every published run here is predicted under it (a test checks)."""


def memory_per_rank(s: Setting) -> dict[str, float]:
    """Peak bytes of the most loaded rank (the first pipeline stage) by part, and ``total``.

    * state: fp32 weights, fp32 gradients and two fp32 AdamW moments, 16 bytes per parameter,
      split over ``tp x pp x dp_shard x cp`` (FSDP shards over ``dp_shard x cp``);
    * gathered: two blocks' bf16 weights in use (current and prefetched) and the ends
      (embedding, output) of the stage, ``/ tp``; with pipeline stages the whole stage's
      (torchtitan keeps them gathered after the forward under pipeline parallelism); float8
      adds nothing: torchtitan measured the same peak with and without it (Tables 1 and 3 of
      its 2024-12 benchmarks: 77.0 / 76.8 GiB on 8 GPUs, 62.0 / 61.8 GiB on 128);
    * unsharded_gradients: with stages and FSDP, the stage's fp32 gradients, ``4`` bytes per
      parameter ``/ tp``: the pipeline schedule syncs gradients only after the last
      micro-batch, and FSDP2 accumulates them unsharded in its reduce dtype until then
      (``PipelineStage``, ``FSDPParam``); 0 otherwise;
    * activations of one micro-batch of ``mbs x s / cp`` tokens per block, bf16, ``/ tp``
      (sequence parallel; the two norm outputs, all-gathered to the whole sequence and saved by
      the matmuls after them, are not: ``2 d (1 - 1 / tp)`` more, measured by the simulation
      at ``tp`` 2 and 4, eager; assumed compiled too, where recomputing them would repeat the
      all-gather): none keeps ``6 d + q + 2 kv + 4 F`` per token eager (norm inputs
      and outputs, q k v, attention output, the SwiGLU's four F-wide tensors), ``2 d + 2 q +
      2 kv + 2 F`` compiled (the partitioner recomputes norm outputs, SiLU and the gate
      product), selective (per operator)
      ``2 d + 2 q + kv + F`` (:func:`llmforge.models.memory_estimate.analytic_peak`'s
      policy) plus one block recomputed, full ``d`` plus one block recomputed; with pipeline
      stages the first stage holds the micro-batches in flight of its schedule
      (:func:`llmforge.planning.stages.in_flight`: ``min(pp, micro-batches)`` under 1F1B, more
      interleaved);
      with ``cp > 1`` plus what the attention mode adds (the all-gathered K/V of the whole
      sequence, or Ulysses' all-to-all buffers:
      :func:`llmforge.planning.context.attention_extra_bytes`);
    * logits: bf16 and fp32 log-probabilities of one micro-batch, ``6 V`` bytes per token
      ``/ tp``, on the last stage (counted on the first one too: an upper bound).
    """
    sh = s.shape
    shards = s.tp * s.pp * s.dp_shard * s.cp
    state = sh.params * 16.0 / shards
    ends = 2 * sh.vocab_size * sh.dim / s.pp
    layers = sh.n_layers / s.pp
    held = layers if s.pp > 1 else 2  # blocks whose gathered weights are held at the peak
    gathered = (held * sh.block_params + ends) * 2.0 / s.tp if s.dp_shard * s.cp > 1 else 0.0
    grads = 0.0
    if s.pp > 1 and s.dp_shard * s.cp > 1:
        # the schedule turns gradient sync off until the last micro-batch: FSDP2 accumulates the
        # stage's unsharded gradients in its fp32 reduce dtype (PipelineStage, FSDPParam)
        grads = (layers * sh.block_params + ends) * 4.0 / s.tp
    tokens = s.micro_batch_size * s.seq_len / s.cp
    q, kv, d, f = sh.n_heads * sh.head_dim, sh.n_kv_heads * sh.head_dim, sh.dim, sh.ffn_dim
    # compiled: the partitioner recomputes elementwise results (norm outputs, SiLU, the gate
    # product) in the backward instead of saving them
    keep = 2 * d + 2 * q + 2 * kv + 2 * f if s.compile else 6 * d + 2 * kv + 4 * f + q
    # sequence parallel gathers the two norm outputs to the whole sequence before the
    # column-parallel matmuls, which save them for their weight gradients: not / tp
    none = tokens * (keep / s.tp + 2 * d * (1 - 1 / s.tp)) * 2.0
    per_block = {"none": none, "selective": tokens * (2 * d + 2 * q + kv + f) * 2.0 / s.tp,
                 "full": tokens * d * 2.0 / s.tp}[s.ac]
    n_micro = s.global_batch_size // (s.dp_replicate * s.dp_shard) // s.micro_batch_size
    flight = in_flight(s.schedule, s.pp, n_micro, s.stages_per_rank)
    act = per_block * layers * flight + (none if s.ac != "none" else 0.0)
    act += attention_extra_bytes(sh, s.cp_mode, s.micro_batch_size, s.seq_len, s.cp, s.tp, s.ac, layers)
    logits = tokens * sh.vocab_size * 6.0 / s.tp
    out = {"state": state, "gathered": gathered, "unsharded_gradients": grads, "activations": act,
           "logits": logits}
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class Verdict:
    setting: Setting
    memory: dict[str, float]
    fits: bool
    prediction: Prediction


def assess(s: Setting, p: CostParams = FITTED) -> Verdict:
    """``s``'s memory per rank, whether it fits in :data:`FIT_SHARE` of the GPU, its step."""
    mem = memory_per_rank(s)
    fits = mem["total"] <= FIT_SHARE * gpu_kind(s.gpu, "gpu").memory_bytes
    return Verdict(s, mem, fits, predict(s, p))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(s: Setting, node: int = 8) -> Iterator[Setting]:
    """Every layout of ``s``'s GPUs and global batch: ``tp`` dividing a node and the GPUs, the
    query and the key/value heads and the feed-forward width, ``pp`` up to the number of blocks
    (stages may hold one block more than others, as torchtitan splits 126 blocks into 8; 1F1B,
    and interleaved with 2 stages per rank), the rest ``dp_shard``; AC none / selective / full;
    micro-batch sizes dividing the per-rank batch (at least ``pp`` micro-batches with stages).
    ``cp`` and the recipe (precision, compile, async TP) stay as in ``s``; with tied
    embeddings ``pp`` is 1."""
    sh = s.shape
    for tp in _divisors(math.gcd(node, s.world)):
        if sh.n_heads % tp or sh.n_kv_heads % tp or sh.ffn_dim % tp:  # as training checks (check_decoder_tp)
            continue
        # training refuses stages with tied embeddings (the first and last stage share them)
        for pp in _divisors(s.world // tp // s.cp) if not sh.tie_embeddings else [1]:
            dp = s.world // tp // pp // s.cp
            if s.global_batch_size % dp or pp > sh.n_layers:
                continue
            local = s.global_batch_size // dp
            schedules = [("1f1b", 1)] + ([("interleaved_1f1b", 2)] if pp > 1 and 2 * pp <= sh.n_layers else [])
            for mbs in _divisors(local):
                if pp > 1 and local // mbs < pp:
                    continue
                for ac in AC_MODES:
                    for sched, v in schedules:
                        yield replace(s, tp=tp, pp=pp, dp_shard=dp, dp_replicate=1, micro_batch_size=mbs,
                                      ac=ac, schedule=sched, stages_per_rank=v)


def best_layout(s: Setting, p: CostParams = FITTED, same_degrees: bool = False,
                allowed: Optional[Callable[[Setting], bool]] = None, node: int = 8) -> Optional[Verdict]:
    """The fastest layout of :func:`layouts` (``node`` GPUs per node) that fits, or ``None``;
    ``same_degrees``: only those with ``s``'s degrees (:func:`same_layout`: AC, micro-batch and
    schedule free); ``allowed``: only those it accepts (what a config's own checks take)."""
    best = None
    for lo in layouts(s, node):
        if same_degrees and not same_layout(lo, s) or allowed is not None and not allowed(lo):
            continue
        v = assess(lo, p)
        if v.fits and (best is None or v.prediction.step_seconds < best.prediction.step_seconds):
            best = v
    return best


def same_layout(a: Setting, b: Setting) -> bool:
    """Same degrees (dp_replicate, dp_shard, tp, pp, cp): micro-batch and AC may differ."""
    return (a.dp_replicate, a.dp_shard, a.tp, a.pp, a.cp) == (b.dp_replicate, b.dp_shard, b.tp, b.pp, b.cp)


def deciding_term(a: dict[str, float], b: dict[str, float], within: bool = False) -> str:
    """The step term (seconds per step, :class:`~llmforge.planning.step_model.Prediction`) the
    faster layout ``a`` saves most on against ``b``; ``within`` the model's error, where they
    differ most either way (the terms are per step; steps of different layouts move the same
    global batch)."""
    return max(a, key=lambda k: abs(a[k] - b.get(k, 0.0)) if within else b.get(k, 0.0) - a[k])


def versus(chosen: Verdict, other: Verdict, error: Optional[float] = None) -> str:
    """One phrase comparing ``chosen`` with ``other``: its tokens/s difference, the term whose
    seconds differ most (what decides), and, when the difference is below the model's
    held-out error of a comparison (``error``, default the stored
    :func:`~llmforge.planning.calibration.comparison_error`), that it is within the error."""
    error = comparison_error() if error is None else error
    gap = chosen.prediction.tokens_per_second_per_gpu / other.prediction.tokens_per_second_per_gpu - 1
    a, b = chosen.prediction.terms, other.prediction.terms
    within = abs(gap) <= error
    key = deciding_term(a, b, within) if gap >= 0 else deciding_term(b, a, within)
    decided = f"{key} {a[key]:.3g} s against {b[key]:.3g} s"
    if within:
        return (f"{gap:+.1%} tokens/s per GPU: within the model's error of a comparison ({error:.1%}); "
                f"they differ most in {decided}")
    return f"{gap:+.1%} tokens/s per GPU, decided by {decided}"
