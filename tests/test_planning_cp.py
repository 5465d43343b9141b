"""Context parallelism (``cp``) in ``llmforge plan``: the memory and step-time terms on the
Llama 3.1 8B shape at 131,072 tokens, the degrees searched, ``cp`` layouts ranked by their
``cp=1`` twin and the winner simulated (a stand-in simulation: the real one takes a minute at
this length, docs/parallelism.md gives its numbers), and bad ``--layout cp=``. Analytic and in-process: about a second each."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_main

from llmforge.planning.calibration import FITTED
from llmforge.planning.context import attention_extra_bytes, cp_degrees
from llmforge.planning.gpus import gpu_kind
from llmforge.planning.published import LLAMA3_8B
from llmforge.planning.setting import Setting
from llmforge.planning.step_model import context_parallel_seconds, predict
from llmforge.planning.whatif import FIT_SHARE, memory_per_rank

GIB = 2**30
SEQ = 131072
LLAMA8B = str(REPO / "yamls" / "llama3_8b.yaml")


def _8b(cp: int, mode: str = "all_gather", ac: str = "full") -> Setting:
    """The 128K recipe on 8 H100: 32 sequences, FSDP2 over dp_shard x cp = 8."""
    return Setting(LLAMA3_8B, "H100-SXM-80GB", 8, 8 // cp, 32, 1, SEQ, cp=cp, ac=ac, cp_mode=mode)


def test_cp_memory_terms_on_the_8b_at_128k():
    # K and V of the whole sequence: 131072 tokens x 2 x 8 kv heads x 128 x 2 bytes = 512 MiB,
    # 7/8 of it beyond the rank's slice; saved in all 32 blocks unless full AC recomputes them
    kv = SEQ * 2 * 8 * 128 * 2
    assert kv == 512 * 2**20
    assert attention_extra_bytes(LLAMA3_8B, "all_gather", 1, SEQ, 8, 1, "selective", 32) == kv * 7 / 8 * 32
    assert attention_extra_bytes(LLAMA3_8B, "all_gather", 1, SEQ, 8, 1, "full", 32) == kv * 7 / 8
    # Ulysses: one block's all-to-all buffers, 16384 tokens x (2 q + 2 kv = 10240) x 2 bytes
    assert attention_extra_bytes(LLAMA3_8B, "ulysses", 1, SEQ, 8, 1, "full", 32) == 16384 * 10240 * 2
    assert attention_extra_bytes(LLAMA3_8B, "ring", 1, SEQ, 8, 1, "full", 32) == 0.0
    assert attention_extra_bytes(LLAMA3_8B, "all_gather", 1, SEQ, 1, 1, "full", 32) == 0.0

    per_token = {cp: memory_per_rank(_8b(cp, "ring")) for cp in (1, 2, 4, 8)}
    one = per_token[1]["activations"] + per_token[1]["logits"]
    for cp, m in per_token.items():  # a slice of every sequence: exactly 1 / cp
        assert m["activations"] + m["logits"] == pytest.approx(one / cp)
        assert m["state"] == pytest.approx(per_token[1]["state"])  # FSDP2 over dp_shard x cp = 8
    # per token: 32 blocks' inputs (4096 x 2 bytes), one block recomputed (6 d + 2 kv + 4 F + q
    # = 88064 elements), bf16 and fp32 log-probabilities (6 x 128256 bytes): 147.4 GiB
    assert one == (32 * 4096 * 2 + 88064 * 2 + 6 * 128256) * SEQ
    cp8 = memory_per_rank(_8b(8))
    assert cp8["activations"] == pytest.approx(per_token[8]["activations"] + kv * 7 / 8)
    budget = FIT_SHARE * gpu_kind("h100").memory_bytes
    assert memory_per_rank(_8b(1))["total"] > budget > cp8["total"]
    # state 15.0 GiB (16 bytes x 8.03B / 8) + 2 gathered blocks and the ends 2.8 + 147.4 / 8 + 0.44
    assert cp8["total"] / GIB == pytest.approx(36.59, abs=0.01)


def test_cp_step_terms_on_the_8b_at_128k():
    gpu, p = gpu_kind("h100"), FITTED
    nvlink = gpu.intra_node_bw * p.nvlink_efficiency
    full = SEQ * 2 * 8 * 128 * 2  # K, V of the whole sequence, bf16
    # all_gather: forward all-gather, backward reduce-scatter (and the recompute's all-gather)
    ag = context_parallel_seconds(_8b(8, ac="selective"), p)
    assert ag == pytest.approx(2 * p.nvlink_latency + 2 * full * 7 / 8 / nvlink)
    assert context_parallel_seconds(_8b(8), p) == pytest.approx(3 * p.nvlink_latency + 3 * full * 7 / 8 / nvlink)
    # ulysses: 4 all-to-alls per block, q k v (6144 wide) in and the output (4096) back, both ways
    uly = context_parallel_seconds(_8b(8, "ulysses", "selective"), p)
    assert uly == pytest.approx(4 * p.nvlink_latency + 2 * 16384 * 10240 * 2 * 7 / 8 / nvlink)
    pr = predict(_8b(8, ac="selective"), p)
    assert pr.terms["cp"] == pytest.approx(32 * 32 * ag)  # 32 micro-batches x 32 blocks, exposed
    assert pr.terms["cp"] < 0.02 * pr.terms["compute"]  # GQA keeps K/V small (Llama 3 §3.3.2)
    ring = predict(_8b(8, "ring"), p)  # the published rows' mode: overlapped with compute
    assert ring.terms["cp"] == 0.0 and ring.overlapped > predict(_8b(1, "ring"), p).overlapped
    assert predict(_8b(1), p).terms["cp"] == 0.0


def test_cp_degrees_searched():
    assert cp_degrees(SEQ, 8, 32, "all_gather") == [1, 2, 4, 8]
    assert cp_degrees(SEQ, 32, 32, "all_gather") == [1, 2, 4, 8, 16]  # 8192 tokens per rank at 16
    assert cp_degrees(8192, 8, 32, "all_gather") == [1]  # short sequences: no cp
    assert cp_degrees(SEQ, 8, 4, "ulysses") == [1, 2, 4]  # 4 heads per tp rank
    assert cp_degrees(3 * 16384, 8, 32, "all_gather") == [1, 2, 4]


def test_plan_ranks_cp_by_its_twin_and_simulates_the_winner():
    """On 8 GPUs at 131,072 tokens no cp=1 layout fits (the stand-in's 100 GiB of per-token
    memory); cp layouts are ranked by their cp=1 twin's simulation (per-token part / cp plus
    the K/V all-gather buffer), and the winner, which uses cp, is confirmed by its own
    simulation (the stand-in's cp answer: 1 GiB above the estimate), labelled simulated."""
    from llmforge.config import load_config
    from llmforge.planning.layout_settings import winner_yaml
    from llmforge.planning.planner import plan
    from llmforge.planning.simulate import StepMeasurement

    def estimate(lo):  # the twin's peak, the per-token part / cp, the all_gather buffers
        twin_peak = 120 * GIB / (lo.dp_shard * lo.cp * lo.tp) + 102 * GIB
        extra = attention_extra_bytes(LLAMA3_8B, "all_gather", 1, SEQ, lo.cp, lo.tp,
                                      lo.activation_checkpointing, 32)
        return twin_peak - 100 * GIB * (1 - 1 / lo.cp) + extra

    seen = []

    def stand_in(cfg, layout):
        seen.append(layout)
        state = 120 * GIB / (layout.dp_shard * layout.cp * layout.tp)
        peak = state + 102 * GIB if layout.cp == 1 else estimate(layout) + GIB
        return StepMeasurement(layout=layout, world_size=layout.world_size, n_layers=32,
                               peak_bytes=peak, breakdown={"activations": 80 * GIB / layout.cp,
                                                           "temporaries": 20 * GIB / layout.cp},
                               flops=1e15, formula_flops=1e15, sharded_state=state)

    cfg = load_config(LLAMA8B, [f"variables.seq_len={SEQ}", "trainer.global_batch_size=32"])
    result = plan(cfg, 8, gpu_kind("h100"), simulate_fn=stand_in)
    win = result.chosen
    assert win is not None and win.layout.cp > 1 and win.simulated
    assert seen[-1] == win.layout  # the winner's own layout, cp included, simulated last
    assert f"cp={win.layout.cp} simulated (all_gather" in win.reason
    assert f"estimated from its cp=1 twin: {estimate(win.layout) / GIB:.1f} GiB" in win.reason
    # no cp=1 layout fits (a heavier checkpointing left unsimulated, where it cannot win, is no layout)
    assert not any(c.status in ("fits", "slower") and c.layout.cp == 1 and "not simulated" not in c.reason
                   for c in result.candidates)
    assert win.peak_bytes == pytest.approx(estimate(win.layout) + GIB)
    lo = win.layout
    assert win.as_dict()["cp"] == lo.cp and f"\n  cp: {lo.cp}\n" in winner_yaml(win, [])
    # on 2 GPUs nothing fits; cp 2 halves the 100 GiB (52 of 67.1 GiB usable left), and the
    # 120 GiB of state then needs 8 shards: 8 GPUs, not "fits at no GPU count"
    small = plan(cfg, 2, gpu_kind("h100"), simulate_fn=stand_in)
    assert small.chosen is None and small.min_gpus == 8


def test_plan_layout_cp(capsys):
    """``--layout ...,cp=2`` predicts a cp layout; a cp that does not divide the GPUs or the
    sequence (2 x cp chunks) exits 2 naming the key."""
    r = run_main("plan", LLAMA8B, "--gpus", "8", "--layout", "dp_shard=4,cp=2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["layout"]["cp"] == 2 and out["terms_seconds"]["cp"] > 0
    r = run_main("plan", LLAMA8B, "--gpus", "8", "--layout", "cp=3")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --layout cp=3: does not divide the 8 GPUs; use a divisor of 8"
    r = run_main("plan", LLAMA8B, "--gpus", "6", "--layout", "cp=3")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: --layout cp=3: trainer.seq_len=8192 is not a multiple of 2 x cp = 6")


def test_128k_yaml_dry_run():
    """yamls/llama3_8b_128k.yaml sizes on a laptop: 32 sequences of 131,072 tokens."""
    r = run_main("train", str(REPO / "yamls" / "llama3_8b_128k.yaml"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "32 sequences = 4,194,304 tokens/step" in r.stdout


def test_simulation_runs_the_context_parallel_step():
    """``simulate`` runs the runtime's context-parallel step on the fake process group: the
    attention's collectives are measured over ``cp`` (all-gathers and their reduce-scatters,
    or all-to-alls), FSDP2's over ``dp_shard_cp``; the saved activations fall about as
    ``1 / cp`` against the cp=1 twin; and at ``dp_shard 1 x cp 2`` the gradients stay sharded
    over ``dp_shard_cp`` between micro-batches, as the twin's (``MicroBatchStep.no_sync``: they
    were kept unsharded, 29.9 GiB per rank for the 128K yaml)."""
    from conftest import TINY_OVERRIDES
    from llmforge.config import load_config
    from llmforge.planning.layout import Layout
    from llmforge.planning.simulate import simulate

    cfg = load_config(str(REPO / "yamls" / "demo_cpu.yaml"), TINY_OVERRIDES)
    twin = simulate(cfg, Layout(1, 4, 1, "none", 4))
    kinds = {}
    for mode in ("all_gather", "ulysses"):
        cfg.context_parallel.mode = mode
        m = simulate(cfg, Layout(1, 2, 1, "none", 4, cp=2))
        kinds[mode] = {(c.kind, c.mesh_dim) for c in m.collectives}
        assert m.breakdown["activations"] < 0.6 * twin.breakdown["activations"]
        # the same tokens per rank as the twin (twice the rows, half of each): the same work
        assert m.flops == pytest.approx(twin.flops, rel=0.1)
    assert {("all_gather", "cp"), ("reduce_scatter", "cp"), ("all_gather", "dp_shard_cp"),
            ("reduce_scatter", "dp_shard_cp")} <= kinds["all_gather"]
    assert ("all_to_all", "cp") in kinds["ulysses"] and ("all_gather", "cp") not in kinds["ulysses"]
    cfg.context_parallel.mode = "all_gather"
    one = simulate(cfg, Layout(1, 1, 1, "none", 8, cp=2))  # 2 micro-batches, dp_shard 1
    pair = simulate(cfg, Layout(1, 2, 1, "none", 4))  # 2 micro-batches, 2 shards
    assert pair.breakdown["gradients"] > 0
    assert one.breakdown["gradients"] == pytest.approx(pair.breakdown["gradients"])


SIMULATED_128K_GIB = {(8, "all_gather"): 42.39, (4, "all_gather"): 67.89, (2, "all_gather"): 119.27,
                      (8, "ulysses"): 41.33, (4, "ulysses"): 65.64, (2, "ulysses"): 114.27}
"""Peak per rank of ``yamls/llama3_8b_128k.yaml`` (8 ranks, dp_shard x cp = 8, full AC, micro-batch
1 of 131,072 tokens), simulated 2026-12-05 with ``--dry-run --simulate`` / ``simulate_scaled``
(docs/parallelism.md): a minute each, too slow for the suite; the arithmetic is checked here."""


@pytest.mark.parametrize("cp,mode", [(8, "all_gather"), (2, "all_gather"), (2, "ulysses")])
def test_analytic_128k_estimate_within_3_percent_of_its_simulation(cp, mode):
    """The dry run's analytic peak (``analytic_peak``: the rank's ``seq_len / cp`` tokens,
    FSDP2 over ``dp_shard x cp``, the all-gathered K/V and causal masks or Ulysses' buffers)
    against the stored simulation."""
    from llmforge.config import load_config
    from llmforge.models.memory_estimate import analytic_peak
    from llmforge.preflight.resolve import resolve_run

    cfg = load_config(str(REPO / "yamls" / "llama3_8b_128k.yaml"),
                      [f"strategy.cp={cp}", f"context_parallel.mode={mode}"])
    run = resolve_run(cfg, check_dir=False, dry_run=True)
    est = analytic_peak(run.cfg, run.plan, run.dims)["total"] / GIB
    assert est == pytest.approx(SIMULATED_128K_GIB[cp, mode], rel=0.03)
