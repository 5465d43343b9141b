"""The research callback and logger of examples/ run from YAML by import path."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from conftest import REPO, TINY_OVERRIDES


def test_custom_callback_and_logger_from_yaml(tmp_path, monkeypatch):
    from llmforge import Trainer

    monkeypatch.syspath_prepend(str(REPO))  # examples.callbacks is found as PYTHONPATH=REPO finds it
    summary = Trainer.from_yaml(REPO / "examples" / "custom_callback.yaml", [
        *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.max_steps=4", "trainer.log_every=2",
        "trainer.eval_every=0", "trainer.eval_batches=1", "checkpoint.save_final=false"]).fit()
    run_dir = Path(summary["run_dir"])
    assert run_dir.name == "demo_custom_callback"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 4]
    assert all(abs(r["train/loss_ema"] - r["train/loss"]) < 1.0 for r in train)
    assert train[0]["train/loss_ema"] == train[0]["train/loss"]  # the EMA starts at the first loss
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["name"] for r in rows} >= {"train/loss", "train/loss_ema", "eval/loss"}
    csv_losses = [float(r["value"]) for r in rows if r["name"] == "train/loss"]
    assert csv_losses == [r["train/loss"] for r in train]


def test_monitoring_example_builds_every_logger_and_callback(tmp_path):
    from llmforge import Trainer
    from llmforge.callbacks import SpeedMonitor

    trainer = Trainer.from_yaml(REPO / "examples" / "monitoring.yaml", [f"run.output_dir={tmp_path}"])
    names = [type(c).__name__ for c in trainer.build_callbacks()]
    # the example's nan_guard entry configures the default guard (trainer.nan_guard), not a second
    assert names.count("SpeedMonitor") == names.count("NaNGuard") == 1 and {"NaNGuard", "EarlyStopping", "GenerateSamples", "Profiler",
                                                  "MemorySnapshot", "MemoryMonitor", "LearningRateMonitor"} <= set(names)
    speed = next(c for c in trainer.build_callbacks() if isinstance(c, SpeedMonitor))
    assert speed.peak_override == 0.2
    loggers = trainer.build_loggers()  # builds only: nothing is written before the first record
    assert [lg.name for lg in loggers] == ["jsonl", "console", "tensorboard", "wandb", "comet"]
    assert not any(tmp_path.iterdir())


def test_unknown_callback_key_is_a_config_error(tmp_path):
    import pytest

    from llmforge import Trainer
    from llmforge.errors import ConfigError

    trainer = Trainer.from_yaml(REPO / "yamls" / "demo_cpu.yaml", [
        *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "callbacks=[{name: nan_guard, max_los: 3}]"])
    with pytest.raises(ConfigError, match=r"callbacks\[0\] \(nan_guard\).*max_los"):
        trainer.build_callbacks()
