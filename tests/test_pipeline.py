"""Pipeline parallelism (``strategy.pp``, ``pipeline:``): the split and bubble arithmetic, bad
input (exit 2, one ``error:`` line), the dry run's stage lines, every schedule and the 3-D
compositions against one process on real gloo processes, a SIGKILLed pp=2
run resumed bit-exact at pp=2 and at pp=1, with a last-stage plugin metric (z_loss) in the logs.
"""

import json
import shutil

import pytest
from conftest import DEMO, TINY_OVERRIDES, run_cli
from helpers.dist import torchrun, worker

from llmforge.cli import main
from llmforge.errors import ConfigError
from llmforge.parallel.pipeline import bubble_fraction, resolve_layout, split_blocks


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


# ------------------------------------------------------------------------------ bad input
BASE = ["train", DEMO, "model.n_layers=4", "--dry-run", "--nproc", "2"]


@pytest.mark.parametrize("extra, needles", [
    (["strategy.pp=3"], ["strategy.pp=3 does not divide the world size 2", "use one of 1, 2"]),
    (["strategy.pp=2", "model.n_layers=3"], ["2 stages do not divide the model's 3 blocks",
                                             "strategy.pp in [1]"]),
    (["strategy.pp=2", "pipeline.schedule=interleaved_1f1b", "model.n_layers=6"],
     ["4 stages do not divide the model's 6 blocks"]),
    (["strategy.pp=2", "pipeline.schedule=zbv", "trainer.global_batch_size=16",
      "trainer.micro_batch_size=8"], ["pipeline.microbatches=2", "needs 4 or more", "[4, 8, 16]"]),
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


# ------------------------------------------------------------------------ real processes
def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layouts", [
    (2, ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev", "lighter_ends_m2", "ac_full",
         "compile_aot_eager"]),
    (4, ["pp4_1f1b", "pp4_interleaved", "fsdp2_x_pp2", "tp2_x_pp2"]),
])
def test_every_schedule_and_layout_equals_one_process(tmp_path, nproc, layouts):
    proc = torchrun(worker("pipeline_worker.py"), str(tmp_path), nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(nproc):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        ref_losses, ref_norms = report["reference"]
        assert len(ref_losses) == 6 and ref_losses[0] > 3.0
        for name in layouts:
            losses, norms = report[name]
            assert _max_diff(losses, ref_losses) < 1e-5, (rank, name, losses, ref_losses)
            # clipped at 0.5 (below every norm): the norm is reduced over all stages
            assert _max_diff(norms, ref_norms) < 1e-4, (rank, name, norms, ref_norms)
            keys = report[name + "_keys"]
            assert all(k.startswith(("layers.", "tok_embeddings.", "norm.", "output.")) for k in keys)
    # the stages hold disjoint parts of the model under its own parameter names
    if nproc == 2:
        r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text())["1f1b_keys"] for r in (0, 1))
        assert "tok_embeddings.weight" in r0 and "output.weight" in r1
        assert "layers.0.attention.wq.weight" in r0 and "layers.3.attention.wq.weight" in r1
        assert not set(r0) & set(r1)


def _records(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "train/loss" in r}


KILL_AT_6 = "callbacks=[{name: tests.helpers.killers.KillAt, step: 6, sig: SIGKILL}]"


@pytest.mark.slow
def test_pp2_sigkill_resumes_bit_exact_and_at_pp1(tmp_path):
    """A real `llmforge train ... strategy.pp=2 --nproc 2` with z_loss saves at step 3 and is
    SIGKILLed at the start of step 6 (steps 1-5 done, uninterrupted). `checkpoint.resume=auto` at
    pp=2 recomputes steps 4-5 with bit-identical losses and finishes step 6; that checkpoint
    resumed with pp=1 in one process recomputes steps 4-6 within 1e-5 (DCP keys are the model's
    own names). `train/z_loss`, summed on the last stage, reaches the logger (rank 0, the first
    stage) with pp=1's value within 1e-6."""
    args = ["train", DEMO, *TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
            "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
            "trainer.eval_batches=2", "checkpoint.save_every=3", f"run.output_dir={tmp_path}",
            "run.name=pp", "algorithms=[{name: z_loss}]"]
    pp2 = [*args, "strategy.pp=2", "--nproc", "2"]
    killed = run_cli(*pp2, KILL_AT_6, timeout=400)
    assert killed.returncode != 0, killed.stderr[-4000:]
    run_dir = tmp_path / "pp"
    uninterrupted = _records(run_dir)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    resumed = run_cli(*pp2, "checkpoint.resume=auto", timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    pp2_records = _records(run_dir)
    assert sorted(pp2_records) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5):
        for key in ("train/loss", "train/z_loss", "train/grad_norm"):
            assert pp2_records[step][key] == uninterrupted[step][key], (step, key)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")  # as if it stopped after step 3
    one = run_cli(*args, "checkpoint.resume=auto", timeout=400)
    assert one.returncode == 0, one.stderr[-4000:]
    pp1_records = _records(run_dir)
    assert sorted(pp1_records) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        pp1, pp2_ = pp1_records[step], pp2_records[step]
        assert pp2_["train/loss"] == pytest.approx(pp1["train/loss"], abs=1e-5), step
        assert pp1["train/z_loss"] > 1e-3, pp1  # coef 1e-4 x logsumexp^2 (~ln(1024)^2)
        assert pp2_["train/z_loss"] == pytest.approx(pp1["train/z_loss"], abs=1e-6), step
    assert (run_dir / "checkpoints" / "step_00000006" / "COMPLETE").exists()
