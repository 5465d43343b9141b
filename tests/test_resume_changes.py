"""A resume that changes settings (issue 18.4): one line says what changed; changes that break
exactness are refused (exit 2, before the heavy imports) unless checkpoint.allow_config_changes."""

import json
import re

import pytest

from conftest import REPO, TINY_OVERRIDES
from llmforge.checkpoint.resume_changes import MAY_CHANGE
from llmforge.cli import main
from llmforge.config import config_to_dict, load_config, redact
from llmforge.preflight.resolve import resolve_run
from llmforge.errors import ConfigError

DEMO = str(REPO / "yamls" / "demo_cpu.yaml")


@pytest.fixture
def saved_run(tmp_path):
    """A run directory whose step-10 checkpoint was saved by a 1-process run of the tiny demo
    (meta.json as the Checkpointer writes it: world size and the redacted resolved config)."""
    overrides = [*TINY_OVERRIDES, f"run.output_dir={tmp_path}", "run.name=r", "trainer.max_steps=20"]
    first = resolve_run(load_config(DEMO, overrides))
    ckpt = first.checkpoint_dir / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"world_size": 1, "config": redact(config_to_dict(first.cfg))}))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 10}))
    (ckpt / "COMPLETE").write_text("")
    (first.run_dir / "metrics.jsonl").write_text('{"step": 10, "train/loss": 5.0}\n')
    (first.run_dir / "config.yaml").write_text("kept: true\n")
    return overrides, first


def resume(overrides, *extra, environ=None):
    return resolve_run(load_config(DEMO, [*overrides, "checkpoint.resume=auto", *extra]),
                       environ=environ or {})


def test_same_settings_resume_silently(saved_run):
    overrides, first = saved_run
    run = resume(overrides)
    assert run.resume_from == first.checkpoint_dir / "step_00000010" and run.resume_line is None


def test_schedule_length_is_refused_then_allowed(saved_run):
    overrides, _ = saved_run
    with pytest.raises(ConfigError) as exc:
        resume(overrides, "trainer.max_steps=40")
    msg = str(exc.value)
    assert "trainer.max_steps 20 -> 40 (the learning-rate schedule's length)" in msg
    assert "checkpoint.allow_config_changes=true" in msg
    run = resume(overrides, "trainer.max_steps=40", "checkpoint.allow_config_changes=true")
    assert "trainer.max_steps 20 -> 40" in run.resume_line
    assert run.resume_line.startswith("resume: changed vs ") and "\n" not in run.resume_line


def test_changes_that_keep_exactness_are_reported_not_refused(saved_run):
    overrides, _ = saved_run
    run = resume(overrides, "trainer.micro_batch_size=4", "trainer.log_every=5",
                 environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    line = run.resume_line
    for part in ("world size 1 -> 2", "trainer.micro_batch_size 8 -> 4", "trainer.devices 1 -> 2",
                 "trainer.log_every 10 -> 5", "strategy.name 'auto' -> 'fsdp2'"):
        assert part in line, line


def test_kernels_and_the_token_cache_may_change(saved_run):
    """``optimizer.implementation`` (the same AdamW update) and ``data.token_cache`` (the same
    ids, read or computed) are reported, not refused."""
    overrides, _ = saved_run
    line = resume(overrides, "optimizer.implementation=for-loop", "data.token_cache=false").resume_line
    assert "optimizer.implementation 'auto' -> 'for-loop'" in line and "data.token_cache" in line


def checkpointed(tmp_path, *extra):
    """Overrides of a run with one complete step-5 checkpoint whose meta.json holds its config."""
    overrides = [*TINY_OVERRIDES, f"run.output_dir={tmp_path}", "run.name=s", *extra]
    first = resolve_run(load_config(DEMO, overrides))
    ckpt = first.checkpoint_dir / "step_00000005"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"world_size": 1, "config": redact(config_to_dict(first.cfg))}))
    (ckpt / "COMPLETE").write_text("")
    return overrides


def test_a_streaming_run_keeps_its_world_size_and_workers(tmp_path):
    overrides = checkpointed(tmp_path, "data.streaming=true")
    with pytest.raises(ConfigError, match=r"data.num_workers 0 -> 1"):
        resume(overrides, "data.num_workers=1")
    with pytest.raises(ConfigError, match=r"world size 1 -> 2"):
        resume(overrides, environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert "trainer.log_every 10 -> 5" in resume(overrides, "trainer.log_every=5").resume_line


def test_keys_added_since_the_save_at_their_default_are_no_change(saved_run):
    overrides, first = saved_run
    meta_file = first.checkpoint_dir / "step_00000010" / "meta.json"
    meta = json.loads(meta_file.read_text())
    for key in ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps"):
        del meta["config"]["optimizer"][key]  # a checkpoint saved before optimizer.name: muon
    meta_file.write_text(json.dumps(meta))
    assert resume(overrides).resume_line is None
    with pytest.raises(ConfigError, match=r"optimizer.muon_momentum None -> 0.9"):
        resume(overrides, "optimizer.muon_momentum=0.9")


def test_constant_schedule_may_change_its_length(tmp_path):
    overrides = checkpointed(tmp_path, "scheduler.name=constant")
    assert "trainer.max_steps 300 -> 600" in resume(overrides, "trainer.max_steps=600").resume_line


def test_cli_refuses_with_exit_2_and_leaves_the_run(saved_run, capsys):
    overrides, first = saved_run
    assert main(["train", DEMO, *overrides, "checkpoint.resume=auto", "trainer.global_batch_size=32",
                 "optimizer.lr=1e-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint.resume:")
    assert "trainer.global_batch_size 16 -> 32" in err[0] and "optimizer.lr 0.002 -> 0.001" in err[0]
    assert (first.run_dir / "config.yaml").read_text() == "kept: true\n"
    assert (first.run_dir / "metrics.jsonl").read_text() == '{"step": 10, "train/loss": 5.0}\n'
    assert (first.checkpoint_dir / "step_00000010" / "COMPLETE").exists()


def test_docs_list_the_keys_that_may_change():
    text = (REPO / "docs" / "resume.md").read_text()
    listed = set(re.findall(r"`([a-z_.]+)`", text))
    missing = [k for k in MAY_CHANGE if k not in listed]
    assert not missing, missing
    assert "checkpoint.allow_config_changes" in text
