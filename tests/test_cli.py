"""The CLI end to end: config errors (exit 2, one line, no traceback), dry-run, train, generate.

In-process through ``llmforge.cli.main([...])`` and ``capsys`` (an interpreter start costs
seconds); one test runs the real ``llmforge`` process for its exit code and stderr."""

import json
import sys

import pytest

from conftest import DEMO, REPO, run_cli
from llmforge.cli import main


def assert_one_error(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def config_error(capsys, argv, *needles: str) -> str:
    """Run ``main(argv)`` in-process: exit code 2 and one ``error:`` line holding ``needles``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    return assert_one_error(err, *needles)


def test_unknown_key_suggests_closest_in_a_real_process():
    proc = run_cli("train", DEMO, "trainer.max_step=5", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert_one_error(proc.stderr, "trainer.max_step", "trainer.max_steps")


def test_wrong_type_names_path_type_value(capsys):
    config_error(capsys, ["train", DEMO, "trainer.max_steps=ten", "--dry-run"],
                 "trainer.max_steps", "int", "ten")


def test_missing_file(capsys):
    config_error(capsys, ["train", "does/not/exist.yaml"], "does/not/exist.yaml")


def test_malformed_yaml_gives_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 5\n  seq_len: [1, 2\n")
    config_error(capsys, ["train", str(bad)], "bad.yaml", "line 4")


def test_empty_config_file_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    config_error(capsys, ["train", str(empty), "--dry-run"], f"config file {empty} is empty")


def test_float8_filter_entry_that_matches_nothing(capsys):
    config_error(capsys, ["train", DEMO, "algorithms=[{name: float8, filter_fqns: [lm_head]}]",
                          "--dry-run"], "float8.filter_fqns entry 'lm_head'", "output")


def test_batch_arithmetic_says_the_numbers(capsys):
    config_error(capsys, ["train", DEMO, "trainer.global_batch_size=10", "trainer.micro_batch_size=4",
                          "--dry-run"],
                 "global_batch_size=10", "micro_batch_size (4)", "data-parallel size (1)")


def test_debug_shows_traceback():
    from llmforge.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.max_step"):
        main(["train", DEMO, "trainer.max_step=5", "--dry-run", "--debug"])


@pytest.mark.parametrize("yaml_name, params", [
    ("llama3_8b.yaml", "8.03B (8,030,261,248)"),
    ("llama3_70b.yaml", "70.55B (70,553,706,496)"),
    ("llama3_405b.yaml", "405.85B (405,853,388,800)"),
])
def test_dry_run_big_models_on_meta(yaml_name, params, capsys):
    assert main(["train", str(REPO / "yamls" / yaml_name), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert params in out
    assert "grad accum" in out and "memory/device" in out
    if yaml_name == "llama3_405b.yaml":  # the 8 of dp next to the memory's 64 shards (issue 27.7)
        assert "(fsdp2, dp 8, tp 8, pp 8)" in out and "sharded 64x" in out and "bubble 30.4%" in out


def test_dry_run_checks_the_loggers_packages(capsys, monkeypatch):
    """A tracker SDK that is not installed fails the dry run as it would the run (issue 27.7);
    an API key missing here does not (it may be set where the run goes)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it fails
    assert main(["train", DEMO, "loggers=[{name: wandb, mode: offline}]", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: loggers: wandb needs the 'wandb' package") and "llmforge[wandb]" in err
    monkeypatch.delitem(sys.modules, "wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert main(["train", DEMO, "loggers=[{name: wandb, mode: online}]", "--dry-run"]) == 0
    # Lightning's own logger by import path: its ModuleNotFoundError is bad input too (exit 2)
    import lightning.pytorch.loggers.wandb as lightning_wandb
    from lightning_utilities.core.imports import RequirementCache

    monkeypatch.setattr(lightning_wandb, "_WANDB_AVAILABLE", RequirementCache("wandb-not-here"))
    assert main(["train", DEMO, "loggers=[{name: lightning.pytorch.loggers.WandbLogger, offline: true}]",
                 "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: loggers[0] (lightning.pytorch.loggers.WandbLogger) needs a package that is not installed: "
        "Requirement 'wandb-not-here' not met")


def test_dry_run_batch_arithmetic(capsys):
    assert main(["train", DEMO, "trainer.global_batch_size=32", "trainer.micro_batch_size=4",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "grad accum      8 steps" in out
    assert "32 sequences = 8,192 tokens/step" in out


@pytest.mark.slow
def test_train_on_shakespeare_then_generate(tmp_path, tiny_overrides, capsys):
    """A few hundred steps of real text through the CLI: the loss falls; generate prints text."""
    code = main(["train", DEMO, *tiny_overrides, "trainer.max_steps=120", "trainer.eval_every=60",
                 "trainer.log_every=20", "optimizer.lr=3e-3", "run.name=e2e"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 60, 120]
    assert evals[-1]["eval/loss"] < 0.7 * evals[0]["eval/loss"]
    train = [r for r in records if "train/loss" in r]
    assert train[-1]["train/loss"] < 0.7 * train[0]["train/loss"]
    steps = [r["step"] for r in train]
    assert steps == [1, *range(20, 121, 20)]
    for r in train:
        assert {"train/lr", "train/grad_norm", "throughput/tokens_per_second"} <= set(r)
    assert (run_dir / "config.yaml").exists() and (run_dir / "tokenizer").is_dir()
    assert (run_dir / "checkpoints" / "step_00000120" / "COMPLETE").exists()
    assert "done: 120 steps" in out

    assert main(["generate", str(run_dir), "--prompt", "ROMEO.", "--max-new-tokens", "40"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO.") and len(text.strip()) > len("ROMEO.") + 20

    config_error(capsys, ["train", DEMO, *tiny_overrides, "run.name=e2e"],
                 "already holds a run", "--overwrite")
    # the same folder named through one that does not exist ('new/..'): the same refusal, and no
    # new/ left behind (it had said the run appeared while it prepared, after making new/)
    config_error(capsys, ["train", DEMO, *tiny_overrides, "run.name=e2e",
                          f"run.output_dir={tmp_path / 'new' / '..' / 'runs'}"], "already holds a run")
    assert not (tmp_path / "new").exists()
    # after a link the '..' is the file system's: link/.. is runs/, where e2e is (taken by its
    # text, link/.. was tmp_path, and the run's files went to two folders)
    (tmp_path / "link").symlink_to(run_dir)
    config_error(capsys, ["train", DEMO, *tiny_overrides, "run.name=e2e",
                          f"run.output_dir={tmp_path / 'link' / '..'}"], "already holds a run")
    # resuming with another model shape is refused; the run's config.yaml stays as it was
    before = (run_dir / "config.yaml").read_text()
    changed = ["run.name=e2e", "model.dim=128", "checkpoint.resume=auto", "trainer.max_steps=130"]
    config_error(capsys, ["train", DEMO, *tiny_overrides, *changed], "model.dim 64 -> 128")  # before loading
    config_error(capsys, ["train", DEMO, *tiny_overrides, *changed, "checkpoint.allow_config_changes=true"],
                 "checkpoint.resume: ", "parameter tok_embeddings.weight has shape (1024, 64) in the "
                 "checkpoint, but this model's is (1024, 128)")
    assert (run_dir / "config.yaml").read_text() == before
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == len(records)
    # starting from this run's weights with a tokenizer trained anew (on other text) is refused
    config_error(capsys, ["train", DEMO, *tiny_overrides, "run.name=ft", f"model.init_from={run_dir}",
                          "data.max_documents=3", "trainer.max_steps=2"],
                 "was trained with another tokenizer",
                 f"tokenizer.path={run_dir / 'tokenizer' / 'tokenizer.json'}")


def test_generate_on_missing_run(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "x"]) == 2  # a wrong path is bad input
    assert_one_error(capsys.readouterr().err, "no such run directory")


def test_version_and_dir_list_the_public_names(capsys):
    """`llmforge --version` and `dir(llmforge)` (issue 27.7)."""
    import llmforge
    from llmforge.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"llmforge {llmforge.__version__}\n"
    assert {"Trainer", "LLMModule", "load_config", "TrainConfig", "registry", "__version__"} <= set(dir(llmforge))
