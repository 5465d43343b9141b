"""Checkpoints that never lose a run: bit-exact resume after SIGKILL (1 and 2 processes), a save
killed half-way, SIGTERM, and resuming on another number of processes.

The runs that are killed, crash or stop on a signal are real processes; one-process runs that
finish (the references, the resumptions) and the checkpoint tools run in this process."""

import json
import signal
from pathlib import Path

import pytest
import torch

from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli, run_main

BASE = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1",
        "scheduler.warmup_steps=2",
        # 6 of Shakespeare's 42 texts: each run tokenizes its data (all 42: ~4.5 s of CPU a run)
        "data.max_documents=6"]


def train(out: Path, name: str, *extra: str, nproc: int = 1, env=None):
    """A real process (``--nproc N``: N of them): for runs that are killed or crash."""
    args = ["train", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}", *extra]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    return run_cli(*args, cwd=REPO, env=env, timeout=600)


def train_here(out: Path, name: str, *extra: str):
    """One process, in this process (``llmforge.cli.main``: no interpreter start)."""
    return run_main("train", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}", *extra, cwd=REPO)


def kill_at(step: int, sig: str = "SIGKILL") -> str:
    return f"callbacks=[{{name: tests.helpers.killers.KillAt, step: {step}, sig: {sig}}}]"


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "train/loss" in r:
            out[r["step"]] = r["train/loss"]
    return out


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from llmforge.checkpoint.run_dir import load_for_inference

    model, _, _ = load_for_inference(run_dir)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_exact(a: Path, b: Path, from_step: int):
    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(range(1, 9))
    for s in range(from_step, 9):
        assert la[s] == lb[s], (s, la[s], lb[s])
    wa, wb = weights(a), weights(b)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def reference(out):
    proc = train_here(out, "ref")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "ref"


@pytest.fixture(scope="module")
def reference2(out):
    proc = train(out, "ref2", "strategy.name=fsdp2", "checkpoint.save_every=4", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "ref2"


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact_one_process(out, reference):
    killed = train(out, "k1", "checkpoint.save_every=3", kill_at(6))
    assert killed.returncode == -signal.SIGKILL
    ckpts = sorted(p.name for p in (out / "k1" / "checkpoints").iterdir())
    assert ckpts == ["step_00000003"]
    resumed = train_here(out, "k1", "checkpoint.save_every=3", "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_exact(reference, out / "k1", from_step=4)


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact_fsdp2_two_processes(out, reference2):
    killed = train(out, "k2", "strategy.name=fsdp2", "checkpoint.save_every=4", kill_at(6), nproc=2)
    assert killed.returncode != 0
    resumed = train(out, "k2", "strategy.name=fsdp2", "checkpoint.save_every=4",
                    "checkpoint.resume=auto", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_exact(reference2, out / "k2", from_step=5)


@pytest.mark.slow
def test_save_killed_half_way_keeps_previous_checkpoint(out, reference):
    crashed = train(out, "half", "checkpoint.save_every=2",
                    env={"LLMFORGE_CRASH_AT": "after_dcp_write:2"})
    assert crashed.returncode == -signal.SIGKILL
    root = out / "half" / "checkpoints"
    assert (root / "step_00000002" / "COMPLETE").exists()
    assert (root / ".tmp-step_00000004").is_dir() and not (root / "step_00000004").exists()
    resumed = train_here(out, "half", "checkpoint.save_every=2", "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_exact(reference, out / "half", from_step=3)


@pytest.mark.slow
def test_killed_right_after_a_save_loses_no_record(out, reference):
    # the checkpoint of step 4 is whole when the process dies: step 4's record must be written
    # already, else the resumed run (steps 5..8) never logs step 4
    crashed = train(out, "after", "checkpoint.save_every=2", env={"LLMFORGE_CRASH_AT": "after_complete:2"})
    assert crashed.returncode == -signal.SIGKILL
    assert (out / "after" / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    assert sorted(losses(out / "after")) == [1, 2, 3, 4]
    resumed = train_here(out, "after", "checkpoint.save_every=2", "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_exact(reference, out / "after", from_step=5)


@pytest.mark.slow
def test_sigterm_saves_last_step_and_exits_75(out, reference):
    stopped = train(out, "term", kill_at(4, "SIGTERM"))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "received SIGTERM" in stopped.stderr and "Traceback" not in stopped.stderr
    root = out / "term" / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_00000004"]
    assert json.loads((root / "step_00000004" / "meta.json").read_text())["step"] == 4
    resumed = train_here(out, "term", "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_exact(reference, out / "term", from_step=5)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 4])
def test_resume_two_process_checkpoint_on_other_world_sizes(out, reference, reference2, nproc):
    ckpt = reference2 / "checkpoints" / "step_00000004"
    extra = ["strategy.name=fsdp2"] if nproc > 1 else []
    if nproc > 1:
        proc = train(out, f"from2to{nproc}", f"checkpoint.resume={ckpt}", *extra, nproc=nproc)
    else:
        proc = train_here(out, f"from2to{nproc}", f"checkpoint.resume={ckpt}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, ref = losses(out / f"from2to{nproc}"), losses(reference)
    assert sorted(got) == [5, 6, 7, 8]
    for s in range(5, 9):
        assert got[s] == pytest.approx(ref[s], abs=1e-5), s


@pytest.mark.slow
def test_async_save_trains_identically_and_tools_read_it(out, reference, tmp_path):
    proc = train_here(out, "async", "checkpoint.async_save=true", "checkpoint.save_every=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = out / "async" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000006", "step_00000008"]
    assert_bit_exact(reference, out / "async", from_step=1)

    info = run_main("checkpoint", "inspect", str(out / "async"))
    assert info.returncode == 0, info.stderr
    assert "step         8" in info.stdout and "layers.0.attention.wq.weight" in info.stdout
    assert "(64, 64)" in info.stdout and "optim" in info.stdout

    done = run_main("checkpoint", "consolidate", str(root / "step_00000008"), str(tmp_path / "m.safetensors"))
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "m.safetensors"))
    ref = weights(reference)
    assert set(tensors) == set(ref)
    for k in ref:
        assert torch.equal(tensors[k], ref[k]), k

    bad = run_main("checkpoint", "inspect", str(tmp_path))
    assert bad.returncode == 2 and "not a checkpoint" in bad.stderr and "Traceback" not in bad.stderr


def test_module_without_super_still_saves_when_due(out):
    proc = train_here(out, "nosuper", "trainer.max_steps=3", "checkpoint.save_every=2", "checkpoint.save_final=false",
                 "trainer.module=tests.helpers.modules.NoSuperModule")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (out / "nosuper" / "checkpoints").iterdir()] == ["step_00000002"]


def test_truncate_metrics_drops_later_and_torn_lines(tmp_path):
    from llmforge.training.run_files import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "train/lo')  # killed mid-line
    assert truncate_metrics(path, 1) == 2
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert truncate_metrics(path, -1) == 2 and path.read_text() == ""


@pytest.mark.slow
def test_resume_auto_before_any_checkpoint_starts_over_without_duplicates(out):
    killed = train(out, "early", "checkpoint.save_every=100", kill_at(4))
    assert killed.returncode != 0
    run = out / "early"
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*"))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/lo')  # torn by the kill
    again = train_here(out, "early", "checkpoint.resume=auto", "trainer.max_steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no complete checkpoint" in again.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 4


def test_resume_of_a_finished_run_trains_nothing_and_changes_nothing(out, reference):
    """`checkpoint.resume=auto` on a run already at trainer.max_steps says so and leaves its
    config.yaml and metrics.jsonl as they were (also with a smaller max_steps allowed); a
    checkpoint path that does not exist is named as such."""
    import shutil

    run = out / "finished"
    shutil.copytree(reference, run)
    before = {f: (run / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    # with overrides that would be written to config.yaml if anything were trained
    again = train_here(out, "finished", "checkpoint.resume=auto", "trainer.max_steps=6",
                       "checkpoint.allow_config_changes=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith("nothing to train: the checkpoint resumed is at step 8")
    assert {f: (run / f).read_bytes() for f in before} == before
    missing = train_here(out, "finished", f"checkpoint.resume={run / 'checkpoints' / 'step_00000009'}")
    assert missing.returncode == 2 and "step_00000009 does not exist" in missing.stderr
