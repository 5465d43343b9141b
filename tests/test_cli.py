"""The CLI end to end: config errors (exit 2, one line, no traceback), dry-run, train, generate."""

import json
from pathlib import Path

import pytest

from conftest import REPO, run_cli

DEMO = str(REPO / "yamls" / "demo_cpu.yaml")


def assert_config_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_unknown_key_suggests_closest():
    proc = run_cli("train", DEMO, "trainer.max_step=5", "--dry-run")
    assert_config_error(proc, "trainer.max_step", "trainer.max_steps")


def test_wrong_type_names_path_type_value():
    proc = run_cli("train", DEMO, "trainer.max_steps=ten", "--dry-run")
    assert_config_error(proc, "trainer.max_steps", "int", "ten")


def test_missing_file():
    proc = run_cli("train", "does/not/exist.yaml")
    assert_config_error(proc, "does/not/exist.yaml")


def test_malformed_yaml_gives_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 5\n  seq_len: [1, 2\n")
    proc = run_cli("train", str(bad))
    assert_config_error(proc, "bad.yaml", "line 4")


def test_batch_arithmetic_says_the_numbers():
    proc = run_cli("train", DEMO, "trainer.global_batch_size=10", "trainer.micro_batch_size=4", "--dry-run")
    assert_config_error(proc, "global_batch_size=10", "micro_batch_size (4)", "data-parallel size (1)")


def test_debug_shows_traceback():
    proc = run_cli("train", DEMO, "trainer.max_step=5", "--dry-run", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize("yaml_name, params", [
    ("llama3_8b.yaml", "8.03B (8,030,261,248)"),
    ("llama3_70b.yaml", "70.55B (70,553,706,496)"),
    ("llama3_405b.yaml", "405.85B (405,853,388,800)"),
])
def test_dry_run_big_models_on_meta(yaml_name, params):
    proc = run_cli("train", str(REPO / "yamls" / yaml_name), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert params in proc.stdout
    assert "grad accum" in proc.stdout and "memory/device" in proc.stdout


def test_dry_run_batch_arithmetic():
    proc = run_cli("train", DEMO, "trainer.global_batch_size=32", "trainer.micro_batch_size=4", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "grad accum      8 steps" in proc.stdout
    assert "32 sequences = 8,192 tokens/step" in proc.stdout


@pytest.mark.slow
def test_train_on_shakespeare_then_generate(tmp_path, tiny_overrides):
    """A few hundred steps of real text through the CLI: the loss falls; generate prints text."""
    proc = run_cli("train", DEMO, *tiny_overrides, "trainer.max_steps=200", "trainer.eval_every=100",
                   "trainer.log_every=20", "optimizer.lr=3e-3", "run.name=e2e")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 100, 200]
    assert evals[-1]["eval/loss"] < 0.7 * evals[0]["eval/loss"]
    train = [r for r in records if "train/loss" in r]
    assert train[-1]["train/loss"] < 0.7 * train[0]["train/loss"]
    steps = [r["step"] for r in train]
    assert steps == [1, *range(20, 201, 20)]
    for r in train:
        assert {"train/lr", "train/grad_norm", "throughput/tokens_per_second"} <= set(r)
    assert (run_dir / "config.yaml").exists() and (run_dir / "tokenizer").is_dir()
    assert (run_dir / "checkpoints" / "step_00000200" / "COMPLETE").exists()
    assert "done: 200 steps" in proc.stdout

    gen = run_cli("generate", str(run_dir), "--prompt", "ROMEO.", "--max-new-tokens", "40")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO.") and len(gen.stdout.strip()) > len("ROMEO.") + 20

    again = run_cli("train", DEMO, *tiny_overrides, "run.name=e2e")
    assert_config_error(again, "already holds a run", "--overwrite")
    # resuming with another model shape is refused; the run's config.yaml stays as it was
    before = (run_dir / "config.yaml").read_text()
    bad = run_cli("train", DEMO, *tiny_overrides, "run.name=e2e", "model.dim=128",
                  "checkpoint.resume=auto", "trainer.max_steps=210")
    assert_config_error(bad, "does not fit this run's model or optimizer")
    assert (run_dir / "config.yaml").read_text() == before
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == len(records)
    # starting from this run's weights with a tokenizer trained anew (on other text) is refused
    other = run_cli("train", DEMO, *tiny_overrides, "run.name=ft", f"model.init_from={run_dir}",
                    "data.max_documents=3", "trainer.max_steps=2")
    assert_config_error(other, "was trained with another tokenizer",
                        f"tokenizer.path={run_dir / 'tokenizer' / 'tokenizer.json'}")


def test_generate_on_missing_run(tmp_path):
    proc = run_cli("generate", str(tmp_path / "nothing"), "--prompt", "x")
    assert proc.returncode == 1 and "no such run directory" in proc.stderr and "Traceback" not in proc.stderr
