"""Pipeline parallelism (``strategy.pp``, ``pipeline:``): the split and bubble arithmetic, bad
input (exit 2, one ``error:`` line), the dry run's stage lines, one FSDP2 root per stage, every
schedule, the 3-D compositions, per-stage algorithms (AC, compile, float8, LoRA, z-loss, EMA,
spike guard) and packed SFT rows (document ids to every stage) against one process on real gloo
processes, a pp=2 checkpoint resumed at pp=4, with FSDP2 and in one process, and a SIGKILLed
pp=2 CLI run resumed bit-exact with a last-stage plugin metric (z_loss) in the logs.
"""

import json

import pytest
import torch.distributed as dist
from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli, run_main
from helpers.dist import torchrun, worker

from llmforge.cli import main
from llmforge.config import load_config
from llmforge.errors import ConfigError
from llmforge.models.spec import get_spec
from llmforge.parallel.mesh import ParallelDims
from llmforge.parallel.pipeline import bubble_fraction, resolve_layout, split_blocks, stage_params
from llmforge.parallel.transforms import pipeline_layout
from llmforge.planning.depth import simulate_scaled
from llmforge.planning.layout import Layout, last_stage_rank
from llmforge.planning.simulate import simulate
from llmforge.plugin import meta_model


# ------------------------------------------------------------------------------ arithmetic
def test_split_blocks_balanced_lighter_ends_and_explicit():
    assert split_blocks(8, 4, "balanced") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # 6 blocks + embedding + output = 8 units over 4 stages: the ends take one block fewer
    assert split_blocks(6, 4, "lighter_ends") == [[0], [1, 2], [3, 4], [5]]
    assert split_blocks(4, 2, [[0], [1, 2, 3]]) == [[0], [1, 2, 3]]
    with pytest.raises(ConfigError, match=r"do not divide the model's 6 blocks.*strategy.pp in \[1, 3\]"):
        split_blocks(6, 4, "balanced", stages_per_rank=2)
    with pytest.raises(ConfigError, match="blocks 0..3 once, in order"):
        split_blocks(4, 2, [[0, 2], [1, 3]])
    # issue 50.6: only the fixes that can work are suggested
    with pytest.raises(ConfigError) as exc:
        split_blocks(6, 4, "balanced", world_size=4)
    assert str(exc.value).endswith("use strategy.pp in [1, 2] with 1 stage(s) per rank, "
                                   "pipeline.split=lighter_ends, or an explicit pipeline.split list of 4 runs of blocks")
    with pytest.raises(ConfigError) as exc:
        split_blocks(5, 2, "lighter_ends", world_size=2)  # 7 units: no lighter ends; balanced neither
    assert str(exc.value).endswith("into parts of 2 or more; use an explicit pipeline.split list "
                                   "of 2 runs of blocks")


def test_bubble_fractions_follow_the_papers():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(vm+p-1)
    assert bubble_fraction("zbv", 4, 8, 2) == 0.0  # m >= 2p
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_layout_stage_order_loop_and_v():
    loop = resolve_layout("interleaved_1f1b", 2, 8, 8, None, None, "balanced", 4)
    assert (loop.stages_per_rank, loop.microbatches) == (2, 4)
    assert loop.stages_of_rank(0) == [0, 2] and loop.stages_of_rank(1) == [1, 3]
    v = resolve_layout("zbv", 2, 4, 8, None, None, "balanced", 4)
    assert v.stages_of_rank(0) == [0, 3] and v.stages_of_rank(1) == [1, 2]
    # where the loss (and the plugins' metrics every logger gets) is computed
    assert loop.last_stage_rank() == 1 and v.last_stage_rank() == 0


def test_too_few_micro_batches_suggest_a_smaller_micro_batch_only_where_one_exists():
    from llmforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"micro-batch\(es\) of 4 sequences per rank; a smaller "
                                          r"trainer.micro_batch_size gives more\)"):
        resolve_layout("1f1b", 2, 8, 4, None, None, "balanced", 1)
    with pytest.raises(ConfigError) as one:  # one sequence per rank: no smaller micro-batch
        resolve_layout("1f1b", 2, 8, 1, None, None, "balanced", 1)
    assert "of 1 sequences per rank):" in str(one.value) and "smaller" not in str(one.value)
    assert "raise trainer.global_batch_size so each rank has 2 or more sequences" in str(one.value)


# ------------------------------------------------------------------------------ bad input
BASE = ["train", DEMO, "model.n_layers=4", "--dry-run", "--nproc", "2"]


@pytest.mark.parametrize("extra, needles", [
    (["strategy.pp=3"], ["strategy.pp=3 does not divide the world size 2", "use one of 1, 2"]),
    (["strategy.pp=2", "model.n_layers=3"], ["2 stages do not divide the model's 3 blocks",
                                             "strategy.pp in [1]"]),
    # more stages than blocks: neither lighter_ends nor an explicit split can work (issue 50.6)
    (["strategy.pp=4", "model.n_layers=2", "--nproc", "4"],
     ["4 stages do not divide the model's 2 blocks evenly (pipeline.split=balanced); use "
      "strategy.pp in [1, 2] with 1 stage(s) per rank, or a model of 4 or more blocks (a stage "
      "holds at least one)"]),
    (["strategy.pp=2", "pipeline.schedule=interleaved_1f1b", "model.n_layers=6"],
     ["4 stages do not divide the model's 6 blocks"]),
    (["strategy.pp=2", "pipeline.schedule=zbv", "trainer.global_batch_size=16",
      "trainer.micro_batch_size=8"], ["pipeline.microbatches=2 (unset: the 2 gradient-accumulation",
                                      "needs 4 or more", "[4, 8, 16]"]),
    (["strategy.pp=2", "pipeline.microbatches=3"], ["pipeline.microbatches=3 must divide the 16",
                                                    "use one of 1, 2, 4, 8, 16"]),
    (["strategy.pp=2", "pipeline.schedule=pipedream"], ["pipeline.schedule: expected one of 1f1b"]),
    (["strategy.pp=2", "pipeline.schedule=gpipe", "pipeline.stages_per_rank=2"],
     ["pipeline.stages_per_rank=2", "one stage per rank"]),
    (["strategy.pp=2", "pipeline.split=[[0],[2,3]]"], ["pipeline.split", "blocks 0..3 once"]),
    (["strategy.pp=2", "model.tie_embeddings=true"], ["untied embeddings"]),
])
def test_bad_pipeline_input_exits_2_with_one_error_line(capsys, extra, needles):
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_dry_run_shows_stages_and_bubble(capsys):
    assert main(BASE + ["strategy.pp=2", "--nproc", "4", "trainer.global_batch_size=32",
                        "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=4"]) == 0
    out = capsys.readouterr().out
    assert "world size      4 (fsdp2, dp 2, tp 1, pp 2)" in out
    assert "0: blocks 0-0 + tok_embeddings" in out and "3: blocks 3-3 + norm, output" in out
    # (p-1)/(v*m+p-1) = 1/9
    assert "2 ranks x 2 stage(s), 4 micro-batches: bubble 11.1% of the step" in out


def test_simulation_of_rank_0_holds_the_first_stage():
    """`--dry-run --simulate` with pp: one step of rank 0 on a fake process group of 4 ranks (pp 2
    x dp 2) holds the AdamW state (2 fp32 moments) of the first stage's parameters only, sharded
    over its 2 dp ranks."""
    cfg = load_config(DEMO, [*TINY_OVERRIDES, "model.n_layers=4", "strategy.pp=2", "trainer.devices=4",
                             "trainer.global_batch_size=8", "trainer.micro_batch_size=2"])
    try:
        sim = simulate_scaled(cfg, Layout(1, 2, 1, "none", 2, pp=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    spec, model = get_spec(cfg.model.name), meta_model(cfg)
    layout = pipeline_layout(cfg, ParallelDims.from_config(cfg, 4), model)
    first = stage_params(model, layout, spec.stage_ends, spec.model_blocks(model))[0]
    assert sim.world_size == 4 and sim.simulated_layers == (4,)
    assert sim.breakdown["optimizer"] == pytest.approx(2 * 4 * first / 2, rel=0.05)


def test_simulation_of_the_last_stage_holds_the_output_and_the_loss():
    """`last_stage=True`: rank 2 of pp 2 x dp 2 (pp is the outer mesh dim) holds the last stage
    (its blocks, the final norm and the output layer) and runs the loss on the hidden states the
    first stage would send; its optimizer state is the last stage's, and at vocab 1,024 its
    loss makes it the larger of the two ranks."""
    cfg = load_config(DEMO, [*TINY_OVERRIDES, "model.n_layers=4", "strategy.pp=2", "trainer.devices=4",
                             "trainer.global_batch_size=8", "trainer.micro_batch_size=2"])
    layout = Layout(1, 2, 1, "none", 2, pp=2)
    try:
        first_sim = simulate_scaled(cfg, layout)
        last_sim = simulate_scaled(cfg, layout, last_stage=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    spec, model = get_spec(cfg.model.name), meta_model(cfg)
    pl = pipeline_layout(cfg, ParallelDims.from_config(cfg, 4), model)
    last = stage_params(model, pl, spec.stage_ends, spec.model_blocks(model))[-1]
    assert (first_sim.rank, last_sim.rank) == (0, 2)
    assert last_sim.breakdown["optimizer"] == pytest.approx(2 * 4 * last / 2, rel=0.05)
    assert last_sim.peak_bytes > first_sim.peak_bytes


def test_each_stage_is_one_fsdp2_root():
    """Under pp with FSDP2 a stage's module is the FSDP2 root of its blocks (fsdp_stage_root), so
    a block's reduce-scatter input is freed when the next block's is issued: simulated rank 0 of
    pp 2 x dp 2, the backward's temporaries grow by about a quarter of a block's unsharded fp32
    gradient per block (4 -> 8 blocks a stage). With every block its own root (before) they
    grew by a whole one: the retained inputs piled up until the end of the stage's backward."""
    cfg = load_config(DEMO, [*TINY_OVERRIDES, "model.dim=512", "variables.seq_len=16", "model.n_layers=4",
                             "strategy.pp=2", "trainer.devices=4", "trainer.global_batch_size=8",
                             "trainer.micro_batch_size=2"])
    layout = Layout(1, 2, 1, "none", 2, pp=2)
    temps = {}
    try:
        for n in (8, 16):
            temps[n] = simulate(cfg, layout, n_layers=n).phases["backward"][1]["temporaries"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    block = get_spec(cfg.model.name).model_blocks(meta_model(cfg))[0]
    grad = 4 * sum(p.numel() for p in block.parameters())
    assert (temps[16] - temps[8]) / 4 < 0.375 * grad, (temps, grad)


def test_last_stage_input_follows_the_batch_and_the_v_schedules_keep_it_on_rank_0():
    """The last stage's simulated input follows the batch's length, which the speedrun recipe's
    seq_length_warmup shortens; with zbv and dualpipev the last stage is on pp rank 0 (the V), so
    `--dry-run --simulate` runs rank 0 only."""
    cfg = load_config(str(REPO / "yamls" / "demo_cpu_fast.yaml"), [
        *TINY_OVERRIDES, "model.n_layers=4", "strategy.name=fsdp2", "strategy.pp=2", "trainer.devices=4",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=2"])
    layout = Layout(1, 2, 1, "none", 2, pp=2)
    try:
        sim = simulate(cfg, layout, last_stage=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sim.rank == 2 and sim.peak_bytes > 0
    assert [last_stage_rank(layout, s) for s in ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")] == [2, 2, 0, 0]


# ------------------------------------------------------------------------ real processes
def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layouts", [
    (2, ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev", "lighter_ends_m2", "ac_full",
         "compile_aot_eager", "algos", "float8", "lora", "packed_sft", "moe_1f1b", "moe_interleaved"]),
    (4, ["pp4_interleaved", "fsdp2_x_pp2", "tp2_x_pp2", "resume_pp4", "resume_fsdp4",
         "resume_pp1", "moe_ep2_x_pp2"]),
])
def test_every_schedule_and_layout_equals_one_process(tmp_path, nproc, layouts):
    """Each layout's losses within 1e-5 and (clipped) gradient norms within 1e-4 of one process
    with the same algorithms (and the same router losses and expert loads for ``moe_*``, a
    Qwen3-MoE with load-free balancing). ``algos`` (pp=2 with z_loss, ema, loss_spike_guard): the same
    ``train/z_loss`` on every rank (the last stage's), the same skipped steps as one process on
    every stage, each stage's EMA equal to one process's for its own weights. ``resume_*``
    (4 ranks): the FSDP2 x PP (2 x 2) checkpoint of step 3 resumed at pp=4, with FSDP2 over 4
    ranks and in one process continues with steps 4-5 of one process. On 2 ranks each layout's
    forward-only evaluation after training equals one process's loss within 1e-5, and the
    pipeline step refuses chunked_cross_entropy at fit start (it fires no BEFORE_FORWARD)."""
    proc = torchrun(worker("pipeline_worker.py"), str(tmp_path), nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    for rank, report in enumerate(reports):
        plain = report["ref_plain"][0]
        assert len(plain) == 5 and plain[0] > 3.0
        for name in layouts:
            (losses, norms, extra), ref = report[name], report["ref_" + report[name + "_ref"]]
            skip = len(ref[0]) - len(losses)  # a resumed run starts after the checkpoint's step
            assert skip == (3 if name.startswith("resume_") else 0), name
            assert _max_diff(losses, ref[0][skip:]) < 1e-5, (rank, name, losses, ref[0])
            # clipped at 0.5 (below every norm): the norm is reduced over all stages
            assert _max_diff(norms, ref[1][skip:]) < 1e-4, (rank, name, norms, ref[1])
            for got, want in zip(extra, ref[2][skip:]):
                assert got.keys() == want.keys(), (rank, name)
                for key in got:
                    assert got[key] == pytest.approx(want[key], abs=1e-6), (rank, name, key)
            keys = report[name + "_keys"]
            assert all(k.startswith(("layers.", "tok_embeddings.", "norm.", "output.")) for k in keys)
    # a mixture of experts: the router losses (in the losses above) and every sparse layer's
    # expert load reach every rank, each stage's layers from that stage
    for name in ("moe_1f1b", "moe_interleaved") if nproc == 2 else ("moe_ep2_x_pp2",):
        last = reports[0][name][2][-1]
        assert last["train/aux_loss"] > 1e-3, last
        layers = 4 if nproc == 2 else 8
        assert {k for k in last if k.startswith("moe/load_max_mean")} == {
            f"moe/load_max_mean/layer_{i}" for i in range(layers) if i != 1}, last
    if nproc == 4:
        return
    r0, r1 = reports
    # the pipeline step fires no BEFORE_FORWARD: chunked_cross_entropy is refused at fit start
    for report in reports:
        msg, code = report["refusal"]
        assert code == 2 and "\n" not in msg and msg.startswith(
            "plugin chunked_cross_entropy handles before_forward, which the pipeline step "
            "(strategy.pp=2) never fires"), msg
    # evaluation after training: every schedule's forward-only pass (the V schedules' too)
    for name in layouts:
        assert abs(r0[name + "_eval"] - r0["ref_eval_" + r0[name + "_ref"]]) < 1e-5, name
    # the stages hold disjoint parts of the model under its own parameter names
    k0, k1 = r0["1f1b_keys"], r1["1f1b_keys"]
    assert "tok_embeddings.weight" in k0 and "output.weight" in k1
    assert "layers.0.attention.wq.weight" in k0 and "layers.3.attention.wq.weight" in k1
    assert not set(k0) & set(k1)
    # the algorithms changed the training (else the comparisons above prove nothing about them)
    algos = r0["ref_algos"][2]
    assert algos[-1]["train/z_loss"] > 1e-3 and 0 < algos[-1]["train/skipped_steps"] < 5, algos
    for ref in ("float8", "lora", "packed"):  # packed: the document masks change the losses
        assert _max_diff(r0["ref_" + ref][0], r0["ref_plain"][0]) > 1e-5, ref
    assert any("lora_A" in k for k in r1["lora_keys"])
    # each stage averages its own weights, together the whole model's
    ema = [r["algos_ema"] for r in reports]
    assert all(e["max_diff"] < 1e-5 for e in ema), ema
    assert ema[0]["names"] + ema[1]["names"] == ema[0]["of"] and ema[0]["names"] < ema[0]["of"]


def _records(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "train/loss" in r}


KILL_AT_6 = "callbacks=[{name: tests.helpers.killers.KillAt, step: 6, sig: SIGKILL}]"


@pytest.mark.slow
def test_pp2_sigkill_resumes_bit_exact(tmp_path):
    """A real `llmforge train ... strategy.pp=2 --nproc 2` with z_loss saves at step 3 and is
    SIGKILLed at the start of step 6 (steps 1-5 done, uninterrupted). `checkpoint.resume=auto` at
    pp=2 recomputes steps 4-5 with bit-identical losses, `train/z_loss` and gradient norms and
    finishes step 6. `train/z_loss`, summed on the last stage, reaches the logger (rank 0, the
    first stage, which holds no loss events). (The same checkpoint format resumed at pp=1, pp=4
    and with FSDP2 is in the 4-process worker above.)"""
    args = ["train", DEMO, *TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
            "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
            "trainer.eval_batches=2", "checkpoint.save_every=3", f"run.output_dir={tmp_path}",
            "run.name=pp", "algorithms=[{name: z_loss}]", "strategy.pp=2", "--nproc", "2"]
    killed = run_cli(*args, KILL_AT_6, timeout=400)
    assert killed.returncode != 0, killed.stderr[-4000:]
    run_dir = tmp_path / "pp"
    uninterrupted = _records(run_dir)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    resumed = run_cli(*args, "checkpoint.resume=auto", timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    records = _records(run_dir)
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5):
        for key in ("train/loss", "train/z_loss", "train/grad_norm"):
            assert records[step][key] == uninterrupted[step][key], (step, key)
    # coef 1e-4 x logsumexp^2 (~ln(1024)^2): the last stage's value, not rank 0's zero
    assert all(r["train/z_loss"] > 1e-3 for r in records.values()), records
    assert (run_dir / "checkpoints" / "step_00000006" / "COMPLETE").exists()


@pytest.mark.slow
def test_pp_checkpoints_resume_across_splits_and_in_one_process(tmp_path):
    """``pipeline.*`` is a layout, like the world size (issue 50.3): a one-process run's step-2
    checkpoint resumes at pp=2 with ``pipeline.split: [[0], [1, 2]]`` (no ``allow_config_changes``),
    and that run's step-4 checkpoint resumes in one process (``pipeline.split`` back to
    ``balanced``); both continue within 1e-5 of the uninterrupted one-process run."""
    common = [*TINY_OVERRIDES, "model.n_layers=3", "trainer.max_steps=6", "trainer.log_every=1",
              "trainer.eval_every=0", "checkpoint.save_every=2", f"run.output_dir={tmp_path}"]
    ref = run_main("train", DEMO, *common, "run.name=ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    pp = run_cli("train", DEMO, *common, "run.name=pp", "strategy.pp=2", "pipeline.split=[[0],[1,2]]",
                 f"checkpoint.resume={tmp_path / 'ref' / 'checkpoints' / 'step_00000002'}",
                 "--nproc", "2", timeout=400)
    assert pp.returncode == 0, pp.stderr[-4000:]
    assert "pipeline.split 'balanced' -> [[0], [1, 2]]" in pp.stderr + pp.stdout  # reported, not refused
    one = run_main("train", DEMO, *common, "run.name=one",
                   f"checkpoint.resume={tmp_path / 'pp' / 'checkpoints' / 'step_00000004'}")
    assert one.returncode == 0, one.stderr[-3000:]
    want, got_pp, got_one = (_records(tmp_path / n) for n in ("ref", "pp", "one"))
    assert sorted(got_pp) == [3, 4, 5, 6] and sorted(got_one) == [5, 6]
    for got in (got_pp, got_one):
        for step, rec in got.items():
            assert abs(rec["train/loss"] - want[step]["train/loss"]) < 1e-5, (step, rec, want[step])
