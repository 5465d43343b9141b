"""The simulation (fake process group, fake tensors) against real gloo runs, shipped yamls at their
world size, and ``llmforge plan``'s bad input. See docs/scale.md."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import REPO
from helpers.dist import torchrun, worker

from llmforge import cli
from llmforge.config import load_config
from llmforge.planning.depth import simulate_scaled
from llmforge.planning.gpus import gpu_kind
from llmforge.planning.report import report
from llmforge.planning.planner import plan
from llmforge.planning.layout import Layout
from llmforge.planning.simulate import simulate
from llmforge.plugin import meta_model

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
DEMO = str(REPO / "yamls" / "demo_cpu.yaml")


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


REAL_LAYOUTS = [(2, 1, "none", 1), (1, 2, "none", 1), (1, 1, "full", 2), (2, 2, "full", 1)]
"""(dp_shard, tp, ac, cp) measured in real processes: FSDP2 on 2, TP on 2, context parallelism
on 2 with full AC (the attention's all-gathers recomputed), FSDP2 x TP with full AC on 4."""


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory):
    """Each layout of ``REAL_LAYOUTS`` measured by the tracker in real processes on gloo, 2
    micro-batches of accumulation: one launch per world size (2 and 4 processes)."""
    out = tmp_path_factory.mktemp("real")
    measured = {}
    for world in (2, 4):
        layouts = [lo for lo in REAL_LAYOUTS if lo[0] * lo[1] * lo[3] == world]
        spec = json.dumps([[dp, tp, ac, 2, cp] for dp, tp, ac, cp in layouts])
        proc = torchrun(worker("simulate_worker.py"), str(out / f"{world}.json"), DEMO, spec, *TINY,
                        nproc=world, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        measured.update(zip(layouts, json.loads((out / f"{world}.json").read_text())))
    return measured


@pytest.mark.parametrize("dp_shard, tp, ac, cp", REAL_LAYOUTS)
def test_simulated_peak_within_5_percent_of_real_gloo_runs(real_peaks, dp_shard, tp, ac, cp):
    """Real processes on gloo against the simulation of rank 0 on a fake process group with
    fake tensors."""
    real = real_peaks[(dp_shard, tp, ac, cp)]
    tiny = [*TINY, f"strategy.cp={cp}"]
    sim = simulate(load_config(DEMO, tiny), Layout(1, dp_shard, tp, ac, 2, cp=cp))
    assert real["peak_bytes_per_rank"] > 1e5
    assert abs(sim.peak_bytes - real["peak_bytes_per_rank"]) <= 0.05 * real["peak_bytes_per_rank"]
    assert sim.breakdown["optimizer"] == pytest.approx(real["breakdown"]["optimizer"], rel=0.05)
    kinds = {(c.kind, c.mesh_dim) for c in sim.collectives}
    if dp_shard > 1:
        assert {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard")} <= kinds
    if tp > 1:
        assert any(dim == "tp" for _, dim in kinds), kinds
    if cp > 1:  # one group of 2: FSDP2's dp_shard_cp and the attention's cp
        assert {("all_gather", "dp_shard_cp"), ("reduce_scatter", "dp_shard_cp")} <= kinds
    assert sim.flops == pytest.approx(real["flops_per_rank"], rel=1e-6)


def test_scaling_by_layer_count_matches_full_depth():
    """2- and 3-block simulations extrapolated to 4 blocks equal the 4-block simulation (the
    peak stays in the same phase of the step; docs/scale.md gives a case where it does not)."""
    cfg = load_config(DEMO, TINY)
    lo = Layout(1, 4, 2, "full", 2)
    full = simulate(cfg, lo, n_layers=4)
    scaled = simulate_scaled(cfg, lo, full_depth=4)
    assert scaled.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-3)
    assert scaled.breakdown["optimizer"] == pytest.approx(full.breakdown["optimizer"], rel=1e-3)
    assert scaled.flops == pytest.approx(full.flops, rel=1e-6)
    # the measurement does not depend on when Python's garbage collector runs (full AC's
    # recompute once left reference cycles that held its activations until gc)
    again = simulate(cfg, lo, n_layers=4, reuse=False)
    assert again.peak_bytes == full.peak_bytes and again.phases == full.phases


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_four_micro_batches_measure_the_whole_step(precision):
    """A step of 5 micro-batches (FSDP2 over 2 ranks) simulated as its first, two middle and its
    last micro-batch, the left-out middle one's FLOPs and collectives added (the third's:
    under bf16-mixed the second's reduce-scatters carry less), equals the simulation of all
    5: peak, phases, breakdown, per-block backward peaks, FLOPs, collectives."""
    cfg = load_config(DEMO, TINY + ["trainer.global_batch_size=10", "trainer.micro_batch_size=1",
                                    f"trainer.precision={precision}"])
    lo = Layout(1, 2, 1, "none", 1)
    fast, every = simulate(cfg, lo), simulate(cfg, lo, every_micro_batch=True)
    assert (fast.peak_bytes, fast.breakdown, fast.phases) == (every.peak_bytes, every.breakdown, every.phases)
    assert fast.block_backward == every.block_backward and fast.flops == every.flops
    assert [vars(c) for c in fast.collectives] == [vars(c) for c in every.collectives]
    assert {c.kind: c.count for c in fast.collectives}["reduce_scatter"] > 0
    # the same simulation again in this process is the kept measurement, a copy of it
    again = simulate(cfg, lo)
    assert again is not fast and again.phases == fast.phases and again.seconds == fast.seconds
    again.breakdown["parameters"] = -1.0
    assert simulate(cfg, lo).breakdown == fast.breakdown


def test_simulation_runs_experts_whose_width_grouped_mm_cannot_take():
    """An expert width that is no multiple of 8 (257) trains (its loop takes any) but made
    ``llmforge plan`` exit 1: the simulation's fake experts run torch._grouped_mm, whose meta
    kernel wants 16-byte rows. They run padded to 264 now: under fp32 (the experts cast to bf16
    copies either way) the peak is above 256's; under bf16-true at most 264's plus the padded
    copies of the 8 experts' three 264 x 256 matrices, saved for the backward in each of the 2
    layers (the over-estimate: training uses the weights as they are)."""
    moe = str(REPO / "yamls" / "demo_cpu_qwen3_moe.yaml")

    def peak(width: int, precision: str) -> float:
        cfg = load_config(moe, [f"model.moe_intermediate_size={width}", f"trainer.precision={precision}",
                                "variables.seq_len=32"])
        return simulate(cfg, Layout(1, 2, 1, "none", 1), n_layers=2).peak_bytes

    assert peak(256, "fp32") < peak(257, "fp32")
    copies = 2 * 3 * 8 * 264 * 256 * 2  # layers x matrices x experts x I x D x bf16 bytes
    odd, even = peak(257, "bf16-true"), peak(264, "bf16-true")
    assert even < odd <= even + copies, (odd, even)


def test_scaling_follows_the_backward_peak_into_a_middle_block():
    """MoE with wide experts, FSDP2 over 4 ranks: while a middle block runs its backward, the
    last reduce-scatter's input (a block's unsharded gradients) is still alive, so the phase's
    peak moves from the last block (2 blocks) to the middle one (3 blocks). The per-position
    lines of simulate_scaled give the 6-block peak exactly; one line through the two phase
    peaks would be 23% high."""
    cfg = load_config(str(REPO / "yamls" / "demo_cpu_qwen3_moe.yaml"), [
        "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
        "model.moe_intermediate_size=512", "model.hidden_dim=64", "variables.seq_len=16",
        "trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.precision=bf16-true"])
    lo = Layout(1, 4, 1, "none", 1)
    two, three = simulate(cfg, lo, n_layers=2), simulate(cfg, lo, n_layers=3)
    assert three.phases["backward"][0] == three.block_backward[1][0]  # the middle block's
    full = simulate(cfg, lo, n_layers=6)
    scaled = simulate_scaled(cfg, lo, full_depth=6)
    assert scaled.phases["backward"][0] == pytest.approx(full.phases["backward"][0], rel=1e-6)
    assert scaled.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-6)
    one_line = two.phases["backward"][0] + 4 * (three.phases["backward"][0] - two.phases["backward"][0])
    assert one_line > 1.2 * full.phases["backward"][0]


@pytest.mark.parametrize("layout", [Layout(1, 2, 1, "none", 2), Layout(1, 1, 1, "full", 2)])
def test_peaks_of_the_running_modules_equal_torchs_walk_over_every_module(monkeypatch, layout):
    """The trackers update the peaks from the running modules only (measure._ActivePeaks);
    torch's own walk over every module's stats gives the same measurement, the blocks' backward
    peaks included (FSDP2's tracker and the plain one)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from llmforge.planning import measure

    cfg = load_config(DEMO, [*TINY, "trainer.precision=bf16-mixed"])
    ours = simulate(cfg, layout, reuse=False)
    monkeypatch.setattr(measure._ActivePeaks, "_update_peak_stats", MemTracker._update_peak_stats)
    torchs = simulate(cfg, layout, reuse=False)
    assert ours.peak_bytes > 0 and all(b is not None for b in ours.block_backward)
    assert (ours.peak_bytes, ours.phases, ours.block_backward) == \
        (torchs.peak_bytes, torchs.phases, torchs.block_backward)


def test_a_frozen_heap_changes_no_measurement_and_thaws_on_exit():
    """The planner simulates inside ``frozen_heap`` (the garbage passes before each measured
    step walk the simulations' own objects only): the same measurement, nested blocks are one,
    and nothing stays frozen after it."""
    import gc

    from llmforge.planning.simulate import frozen_heap

    cfg, layout = load_config(DEMO, TINY), Layout(1, 1, 1, "none", 1)
    plain = simulate(cfg, layout, reuse=False)
    with frozen_heap(), frozen_heap():
        frozen = gc.get_freeze_count()
        inside = simulate(cfg, layout, reuse=False)
    assert frozen > 1000 and gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own freeze outlives the block
    try:
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
    assert plain.peak_bytes > 0 and (inside.peak_bytes, inside.phases, inside.flops) == \
        (plain.peak_bytes, plain.phases, plain.flops)


def test_unknown_gpu_lists_known_ones(capsys):
    assert cli.main(["plan", DEMO, "--gpus", "8", "--gpu", "V100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --gpu: unknown GPU kind 'V100'") and "H100-SXM-80GB" in err
    assert "MI300X-192GB" in err and "Traceback" not in err


def test_gpu_counts_past_the_maximum_and_top_below_1_exit_2_at_once(capsys):
    """Issue 50.6: ``--gpus 2**31`` searched divisors over the whole range (no answer); the
    planner takes at most MAX_GPUS and enumerates divisors in O(sqrt(n))."""
    import time

    from llmforge.planning.planner import MAX_GPUS, _divisors

    start = time.perf_counter()
    assert cli.main(["plan", DEMO, "--gpus", "2147483648"]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err.strip()
    assert err == ("error: --gpus 2147483648: the planner takes 1 to 131,072 GPUs (above the largest "
                   "clusters built); pass a GPU count in that range")
    for top in ("0", "-1"):
        assert cli.main(["plan", DEMO, "--gpus", "8", "--top", top]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --top {top}: the number of layouts to print must be >= 1 (default 8)")
    assert MAX_GPUS == 2**17 and _divisors(2**31) == [2**i for i in range(32)]
    assert _divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and _divisors(2**31 - 1) == [1, 2**31 - 1]


def test_world_size_that_divides_nothing_names_key_and_nearest_sizes(capsys):
    # 6 GPUs: tp 1 (dp 6) and tp 2 (dp 3) do not divide 8 sequences; tp 3, 6 do not divide a node
    assert cli.main(["plan", DEMO, *TINY, "--gpus", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --gpus 6: no layout divides trainer.global_batch_size=8")
    assert err.endswith("nearest GPU counts that do: 4, 8")
    # no count near 1,024 divides a batch of 8: say what to change instead of an empty list
    assert cli.main(["plan", DEMO, *TINY, "--gpus", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no GPU count within 64 of 1024 does: raise trainer.global_batch_size to a "
                        "multiple of the data-parallel size (e.g. 1024)")


def test_heads_not_divisible_by_tp_names_the_key(capsys):
    # 8 GPUs, batch 2: only tp 4 or 8 would divide it, and 2 key/value heads refuse both
    assert cli.main(["plan", DEMO, *TINY, "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
                     "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "tp=4 refused" in err and "n_kv_heads" in err and "nearest GPU counts that do: 2, 4" in err


def test_layout_that_fits_nowhere_gives_smallest_gpu_count(capsys):
    """A 3-block model with dim 8192 and a 128K vocabulary (4.6B parameters, 74 GB of fp32 state
    with AdamW) on one A100 80GB: nothing fits; two GPUs would."""
    big = [*TINY, "model.dim=8192", "model.n_layers=3", "model.n_heads=64", "model.n_kv_heads=8",
           "model.multiple_of=1024", "tokenizer.vocab_size=128256", "trainer.global_batch_size=2",
           "trainer.micro_batch_size=1", "strategy.name=fsdp2"]
    assert cli.main(["plan", DEMO, *big, "--gpus", "1", "--gpu", "a100", "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["chosen"] is None and out["smallest_fitting_gpus"] == 2
    assert "the smallest GPU count that would fit is 2" in captured.err
    assert all(c["status"] in ("does not fit", "does not divide") for c in out["candidates"])


def test_cluster_gpu_type_selects_the_row_and_unknown_exits_2(tmp_path, monkeypatch, capsys):
    """The GPU type a clusters file names (SLURM gres, SkyPilot accelerator, SageMaker instance,
    a torch.cuda device name) selects the planner's GPU row; an unknown one exits 2 listing
    the known rows, before anything is simulated."""
    from llmforge.planning.gpus import gpu_kind_of_type
    from llmforge.runs.auto_layout import cluster_gpu
    from llmforge.runs.clusters import get_cluster

    assert gpu_kind_of_type("h100", "k").name == "H100-SXM-80GB"
    assert gpu_kind_of_type("NVIDIA H200", "k").name == "H200-141GB"
    assert gpu_kind_of_type("A100-80GB", "k").name == "A100-SXM-80GB"
    assert gpu_kind_of_type("AMD Instinct MI300X", "k").name == "MI300X-192GB"
    (tmp_path / "clusters.yaml").write_text(
        "lab: {type: slurm, partition: gpu, gpus_per_node: 4, gpu_type: h200}\n"
        "p5: {type: sagemaker, instance_type: ml.p5.48xlarge, image_uri: x, role: y}\n"
        "old: {type: slurm, partition: gpu, gpus_per_node: 8, gpu_type: v100}\n")
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    lab = cluster_gpu(get_cluster("lab"))
    assert (lab.name, lab.gpus_per_node, lab.memory_bytes) == ("H200-141GB", 4, 141e9)
    assert cluster_gpu(get_cluster("p5")).name == "H100-SXM-80GB"
    # --layout times the cluster's nodes: FSDP over 8 H200 crosses the network between two nodes
    # of 4 (an H200 row's own node is 8, all NVLink)
    eight_b = str(REPO / "yamls" / "llama3_8b.yaml")
    steps = {}
    for where in (["--cluster", "lab"], ["--gpu", "h200"]):
        assert cli.main(["plan", eight_b, "--gpus", "8", *where, "--layout", "dp_shard=8", "--json"]) == 0
        steps[where[0]] = json.loads(capsys.readouterr().out)["terms_seconds"]
    assert steps["--cluster"]["data_parallel"] > 5 * steps["--gpu"]["data_parallel"]
    assert steps["--cluster"]["compute"] == steps["--gpu"]["compute"]
    assert cli.main(["plan", DEMO, *TINY, "--gpus", "8", "--cluster", "old"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cluster 'old' gpu_type: unknown GPU kind 'v100'; known: H100-SXM-80GB")
    assert "MI300X-192GB" in err and "Traceback" not in err


def test_strategy_auto_launch_uses_the_planners_winner(tmp_path, monkeypatch):
    """``strategy.name: auto`` launched on 2 GPUs of an H100 cluster: the planner's winner
    becomes the job's overrides (so the run's config.yaml records the layout) and the summary
    says so; one key/value head leaves tp 1 only (one simulated group)."""
    from llmforge.runs.launch import prepare

    (tmp_path / "clusters.yaml").write_text(
        "gpu8: {type: slurm, partition: gpu, gpus_per_node: 8, gpu_type: h100}\n")
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    over = [*TINY, "model.n_kv_heads=1", "strategy.name=auto", "run.output_dir=" + str(tmp_path)]
    cfg, _, plan, spec = prepare(DEMO, over, cluster="gpu8", gpus=2)
    assert spec["overrides"][:len(over)] == over
    added = spec["overrides"][len(over):]
    # a 2-block model: replicating it (one all-reduce of the gradients) beats sharding it
    assert added[:4] == ["strategy.name=fsdp2", "strategy.dp_replicate=2", "strategy.dp_shard=1", "strategy.tp=1"]
    assert "strategy auto: planned dp_replicate 2 x dp_shard 1 x tp 1" in plan.summary()
    again = load_config(DEMO, spec["overrides"])  # what the job loads and writes to config.yaml
    assert (again.strategy.name, again.strategy.dp_replicate, again.strategy.tp) == ("fsdp2", 2, 1)
    assert again.trainer.micro_batch_size == cfg.trainer.micro_batch_size == plan.batch.micro_batch_size


def test_dry_run_simulate_reports_rank_0_beside_the_estimate(capsys):
    """``train --dry-run --simulate``: the simulated peak per rank with its split, the analytic
    estimate with its error, FLOPs against the formula; one process, 2 micro-batches."""
    assert cli.main(["train", DEMO, *TINY, "--dry-run", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "simulation      rank 0 of 1: one training step" in out and "torch.compile not simulated" in out
    peak = next(line for line in out.splitlines() if line.startswith("peak/rank"))
    assert "parameters" in peak and "activations" in peak
    analytic = next(line for line in out.splitlines() if line.startswith("analytic"))
    err = float(analytic.rsplit("(", 1)[1].split("%")[0])
    assert abs(err) <= 10.0, analytic
    assert "x the spec's formula" in out
    assert cli.main(["train", DEMO, *TINY, "--simulate"]) == 2


def test_simulation_runs_z_loss():
    """z_loss masks the positions without a target instead of indexing them (a data-dependent
    shape, which fake tensors cannot trace): the step simulates, and its fp32 logits and
    logsumexp add memory (FlopCounterMode counts matmuls, so the FLOPs stay)."""
    cfg = load_config(DEMO, [*TINY, "algorithms=[{name: z_loss, coef: 1.0e-4}]"])
    with_z = simulate(cfg, Layout(1, 1, 1, "none", 2))
    plain = simulate(load_config(DEMO, TINY), Layout(1, 1, 1, "none", 2))
    assert with_z.peak_bytes > plain.peak_bytes and with_z.flops == plain.flops


def test_simulation_counts_every_storage_of_float8_under_tp():
    """torch 2.13's MemTracker stops at the first storage of a tensor it already tracks, in the
    address order of a set: a wrapper subclass's new storage (a float8 tensor's data beside its
    tracked scale) went uncounted in some processes, so float8 TP's simulated peak varied (up to
    4 GiB on the 8B at TP 2) and the simulation had gathered bf16 instead. Ours counts each
    storage, and the simulation gathers float8 as the run does."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.testing._internal.two_tensor import TwoTensor

    from llmforge.planning.layout import layout_config
    from llmforge.planning.measure import FrozenSafeMemTracker

    kept = []
    for _ in range(40):  # 40 pairs: both set orders occur (torch's tracker missed 15 of 40 here)
        tracker, a, b = FrozenSafeMemTracker(), torch.empty(1024), torch.empty(1024)
        tracker._track(_MemRefType.ACT, a)
        before = tracker._curr_mem_snap[a.device]["Total"]
        tracker._track(_MemRefType.ACT, TwoTensor(a, b))
        assert tracker._curr_mem_snap[a.device]["Total"] - before == 4096
        kept.append((a, b))  # alive: a freed storage's address would come back
    cfg = load_config(DEMO, [*TINY, "algorithms=[{name: float8}]"])
    entries = layout_config(cfg, Layout(1, 1, 2, "none", 2)).algorithms
    assert [e.get("enable_tp_float8_all_gather") for e in entries if e.get("name") == "float8"] == [None]
    # float8 gathers under TP simulated (the 8B yaml's winner: 52.9 GiB, 57.2 with bf16 gathers)
    m = simulate(cfg, Layout(1, 1, 2, "none", 2))
    assert m.peak_bytes > m.breakdown["activations"] > 0


def test_plan_simulates_more_recomputation_where_it_can_win():
    """A lighter activation checkpointing that fits the group's reference (one sequence, no
    stages) need not fit its larger micro-batches: the 70B's FSDP 32 x TP 8 without AC fits one
    sequence per rank, not two, which selective AC fits at a faster step than any layout that
    fits without AC (stages and their bubble). Selective is simulated and wins; full, slower
    wherever selective does not fit, is not (stand-in measurements: seconds, not minutes)."""
    from llmforge.planning.simulate import StepMeasurement

    gib, act = 2**30, {"none": 40, "selective": 16, "full": 4}  # GiB per sequence at tp 8
    seen = set()

    def stand_in(cfg, layout, last_stage=False):
        seen.add((layout.tp, layout.activation_checkpointing))
        state = 1043 * gib / (layout.dp_shard * layout.tp * layout.pp)  # 70B x 16 bytes, sharded
        a = act[layout.activation_checkpointing] * gib * layout.micro_batch_size * 8 / layout.tp / layout.pp
        return StepMeasurement(layout=layout, world_size=layout.world_size, n_layers=80, peak_bytes=state + a,
                               breakdown={"activations": a, "temporaries": 0.0}, flops=1e15,
                               formula_flops=1e15, sharded_state=state)

    result = plan(load_config(str(REPO / "yamls" / "llama3_70b.yaml"), []), 256, gpu_kind("h100"),
                  simulate_fn=stand_in)
    win = result.chosen.layout
    assert (win.dp_shard, win.tp, win.pp, win.activation_checkpointing, win.micro_batch_size) == \
        (32, 8, 1, "selective", 2)
    assert {(8, "none"), (8, "selective")} <= seen and (8, "full") not in seen
    assert any(c.layout.pp > 1 and c.layout.activation_checkpointing == "none" and c.status == "slower"
               for c in result.candidates)  # no AC fits with stages, slower by their bubble
    (full,) = [c for c in result.candidates if (c.layout.tp, c.layout.activation_checkpointing) == (8, "full")]
    assert full.reason.endswith("layouts that selective does not fit at tp=8, and none of them would beat "
                                "selective's fastest")
    counted = " ".join(report(result, "llama3_70b.yaml", 1.0).split("candidates: ")[1].split())
    groups = sum(c.peak_bytes is None and c.status == "slower" for c in result.candidates)
    layouts = sum(c.peak_bytes is not None and c.status == "slower" for c in result.candidates)
    assert groups >= 1 and f"{groups} slower group{'s' * (groups > 1)} not simulated" in counted
    assert f"1 chosen, {layouts} slower," in counted  # measured layouts only
    # the tp groups whose data-parallel size does not divide the batch of 64 (tp 1: dp 256)
    divide = sum(c.status == "does not divide" for c in result.candidates)
    assert divide >= 1 and (f"{divide} groups that do not divide" if divide > 1 else
                            "1 group that does not divide") in counted
    assert "tp=1: does not divide: trainer.global_batch_size=64 is not a multiple of dp=256" in counted
    # the yaml's own layout on 256 GPUs (FSDP 32 x TP 8, full AC, mbs 1): a group not simulated
    from llmforge.planning.explain import explain

    cfg = load_config(str(REPO / "yamls" / "llama3_70b.yaml"), [])
    (own,) = [w for w in explain(result, cfg) if w.startswith("this config's layout")]
    assert own.startswith("this config's layout: dp_shard 32 x tp 8, AC full, mbs 1: slower: not simulated: "
                          "more recomputation than selective"), own


def test_simulation_runs_lora_with_frozen_weights():
    """LoRA's frozen base: torch's MemTracker (one process, no FSDP2) would register a gradient
    hook on it and raise; FrozenSafeMemTracker counts it as parameters. The step's gradients are
    the adapters' only."""
    cfg = load_config(DEMO, [*TINY, "algorithms=[{name: lora, base_dtype: float32}]"])
    m = simulate(cfg, Layout(1, 1, 1, "none", 2))
    base = 4 * meta_model(load_config(DEMO, TINY)).num_params()
    assert m.breakdown["parameters"] >= base
    assert 0 < m.breakdown["gradients"] < 0.1 * base


def test_plan_lays_out_pipeline_stages_where_the_batch_needs_them():
    """8 GPUs, tp 1 only (one key/value head), 12 sequences: no data-parallel size of 8 divides
    them, 2 pipeline stages (dp 4) do. The reference is simulated at pp 2 (both pipeline ranks,
    the first with its micro-batches in flight), the winner has stages, pp 4 is ranked beside
    it (a larger bubble), and the winner's overrides carry ``strategy.pp``."""
    from llmforge.planning.layout_settings import layout_overrides

    cfg = load_config(DEMO, [*TINY, "model.n_kv_heads=1", "model.n_layers=4",
                             "trainer.global_batch_size=12", "trainer.micro_batch_size=1"])
    result = plan(cfg, 8, gpu_kind("h100"))
    (ref,) = result.references.values()
    assert ref.layout.pp == 2 and ref.layout.dp_shard == 4
    chosen = result.chosen.layout
    assert chosen.pp == 2 and chosen.dp_replicate * chosen.dp_shard == 4 and result.chosen.simulated
    assert any(c.layout.pp == 4 and c.status == "slower" for c in result.candidates)
    assert all(c.layout.pp > 1 for c in result.candidates if c.status in ("fits", "slower"))
    assert "strategy.pp=2" in layout_overrides(result.chosen, [])


def test_tensor_parallel_collectives_and_gathered_activations_per_block():
    """What the step-time model and the analytic memory take from the simulation, measured per
    block (a 3-block minus a 2-block run of TP 2): the sequence-parallel all-gathers and
    reduce-scatters by activation checkpointing (step_model.TP_CALLS_PER_BLOCK, the all-gathers
    among them TP_GATHERS_PER_BLOCK: float8 TP moves those in 1 byte), and without AC the two
    norm outputs kept whole-sequence, not / tp (whatif.memory_per_rank)."""
    from llmforge.planning.step_model import TP_CALLS_PER_BLOCK, TP_GATHERS_PER_BLOCK

    cfg = load_config(DEMO, [*TINY, "model.dim=128", "trainer.global_batch_size=4", "trainer.micro_batch_size=4"])

    def per_block(tp: int, ac: str) -> tuple[dict, float]:
        lo, hi = (simulate(cfg, Layout(1, 1, tp, ac, 4), n_layers=n) for n in (2, 3))
        calls = {c.kind: c.count for c in hi.collectives if c.mesh_dim == "tp"}
        calls = {k: n - next((c.count for c in lo.collectives if (c.kind, c.mesh_dim) == (k, "tp")), 0)
                 for k, n in calls.items()}
        return calls, hi.breakdown["activations"] - lo.breakdown["activations"]

    for ac, n in TP_CALLS_PER_BLOCK.items():
        calls, _ = per_block(2, ac)
        assert calls["all_gather"] + calls["reduce_scatter"] == n, (ac, calls)
        assert calls["all_gather"] == TP_GATHERS_PER_BLOCK[ac], (ac, calls)
    _, whole = per_block(1, "none")
    _, split = per_block(2, "none")
    tokens, dim, fp32 = 4 * 64, 128, 4
    assert split - whole / 2 == 2 * dim * (1 - 1 / 2) * tokens * fp32
