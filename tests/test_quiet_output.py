"""Quiet and true output (issue 18.7): no noise that is not actionable, a clean stop is not an
error, the progress bar and the summary tell the same last loss and the real first eval step."""

import warnings
from types import SimpleNamespace

from llmforge.cli import main
from llmforge.cli.handlers import _print_summary
from llmforge.events import State
from llmforge.quiet import quiet_libraries


def fake_srun(tmp_path, monkeypatch) -> None:
    """An ``srun`` on PATH outside SLURM: what makes Lightning print its srun hint."""
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)


def test_srun_hint_and_dtensor_cpu_rng_warning_are_silenced(tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
    from torch.distributed.tensor._random import is_rng_supported_mesh

    fake_srun(tmp_path, monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        SLURMEnvironment._validate_srun_used()
        is_rng_supported_mesh(SimpleNamespace(device_type="cpu"))
        assert {"srun", "DTensor random"} == {w for w in ("srun", "DTensor random")
                                              if any(w in str(x.message) for x in seen)}  # real texts
        seen.clear()
        quiet_libraries()
        SLURMEnvironment._validate_srun_used()
        is_rng_supported_mesh(SimpleNamespace(device_type="cpu"))
    assert [str(w.message) for w in seen] == []


def test_sigterm_stop_is_not_printed_as_an_error(monkeypatch, capsys):
    from llmforge.callbacks.checkpointing import Preempted
    import llmforge.cli as cli

    def stopped(args):
        raise Preempted("received SIGTERM: saved the checkpoint of step 7 in runs/x/checkpoints; "
                        "exit code 75 (continue with checkpoint.resume=auto)")

    monkeypatch.setattr(cli, "cmd_train", stopped)
    assert main(["train", "any.yaml"]) == 75
    err = capsys.readouterr().err
    assert err.startswith("stopped: received SIGTERM") and "error" not in err
    monkeypatch.setenv("RANK", "1")  # another rank of the same run: rank 0 says it once
    assert main(["train", "any.yaml"]) == 75 and capsys.readouterr().err == ""


def test_summary_labels_the_first_eval_with_its_step(capsys):
    _print_summary({"steps": 200, "tokens": 1000, "seconds": 61, "final_train_loss": 2.5,
                    "initial_eval_loss": 3.25, "initial_eval_step": 100, "final_eval_loss": 2.75,
                    "run_dir": "runs/x", "checkpoint": None})
    assert "eval/loss 2.7500 (step 100: 3.2500)" in capsys.readouterr().out


def test_summary_after_a_resume_says_what_this_run_trained(capsys):
    base = {"tokens": 1000, "seconds": 2, "final_train_loss": 2.5, "initial_eval_loss": None,
            "final_eval_loss": None, "run_dir": "runs/x", "checkpoint": None, "max_steps": 300}
    _print_summary({**base, "steps": 300, "resumed_step": 120})
    assert capsys.readouterr().out.startswith(
        "done: 300 steps, 1,000 tokens (180 steps in 0m02s after resuming at step 120) | ")
    # resume=auto of a finished run: no step ran, and the summary must not claim a done run
    _print_summary({**base, "steps": 300, "resumed_step": 300})
    out = capsys.readouterr().out
    assert out.startswith("nothing to train: the checkpoint resumed is at step 300, and "
                          "trainer.max_steps is 300; to train on, raise trainer.max_steps and pass "
                          "checkpoint.allow_config_changes=true (the schedule's length changes)\n")
    assert "done:" not in out and "run directory: runs/x" in out


def test_progress_bar_last_frame_shows_the_last_steps_loss():
    from rich.console import Console

    from llmforge.callbacks.progress import RichProgress

    console = Console(record=True, force_terminal=True, width=160)
    bar = RichProgress(console=console)
    trainer = SimpleNamespace(is_global_zero=True, max_steps=20, global_step=10)
    module = SimpleNamespace(history=[{"step": 10, "train/loss": 4.0}])
    state = State(trainer=trainer, module=module, step=10)
    bar.fit_start(state)
    bar.step_recorded(state)
    trainer.global_step = 20  # a record written after the last step_recorded (eval_harness's)
    module.history.append({"step": 20, "train/loss": 1.2345})
    bar.fit_end(state)
    frames = console.export_text()
    assert "20/20" in frames and "loss 1.2345" in frames.split("20/20")[-1]


def test_python_api_is_as_quiet_as_the_cli(tmp_path, monkeypatch):
    """Building a Trainer from Python silences the same library noise as `llmforge train`
    (issue 27.7): here Lightning's srun hint."""
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment

    from conftest import DEMO, TINY_OVERRIDES
    from llmforge import Trainer, load_config

    fake_srun(tmp_path, monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        Trainer(load_config(DEMO, [*TINY_OVERRIDES, f"run.output_dir={tmp_path}"]))
        seen.clear()
        SLURMEnvironment._validate_srun_used()
    assert [str(w.message) for w in seen] == []
