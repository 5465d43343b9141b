"""Tests of llmforge.config: loading, bases, overrides, errors, redaction and batch arithmetic."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from llmforge.config import (
    BatchPlan,
    TrainConfig,
    config_to_dict,
    data_parallel_size,
    load_config,
    plan_batch,
    redact,
    save_config,
    validate,
)
from llmforge.errors import ConfigError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert info.value.exit_code == 2
    msg = str(info.value)
    assert "full_key" not in msg and "object_type" not in msg  # no OmegaConf internals
    return msg


# ------------------------------------------------------------------------------- loading
def test_load_typed_and_resolved(tmp_path):
    path = write(tmp_path, "demo.yaml", """
        variables:
          lr: 1e-4
          width: 3.0e+2
          big: 1E5
        trainer:
          max_steps: 20
          seq_len: 64
        optimizer:
          lr: ${variables.lr}
          eps: 1e-6
        model:
          max_seq_len: ${trainer.seq_len}
        algorithms:
          - name: compile
            lr: 1e-4
        """)
    cfg = load_config(path)
    assert isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is TrainConfig
    assert cfg.trainer.max_steps == 20 and cfg.model.max_seq_len == 64
    assert isinstance(cfg.optimizer.eps, float) and cfg.optimizer.eps == 1e-6
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.variables.lr == 1e-4 and isinstance(cfg.variables.lr, float)
    assert cfg.variables.width == 300.0 and cfg.variables.big == 1e5
    assert cfg.algorithms[0]["lr"] == 1e-4 and isinstance(cfg.algorithms[0]["lr"], float)
    assert cfg.trainer.micro_batch_size == 8  # schema default
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["optimizer"]["lr"] == 1e-4
    assert not OmegaConf.is_interpolation(cfg.optimizer, "lr")  # resolved in place
    OmegaConf.set_readonly(cfg, True)
    assert cfg.trainer.seq_len == 64 and config_to_dict(cfg)["model"]["max_seq_len"] == 64


def test_empty_file_is_an_error_an_empty_section_is_not(tmp_path):
    for text in ("", "# only a comment\n"):
        msg = error_of(load_config, write(tmp_path, "e.yaml", text))
        assert "config file" in msg and "e.yaml is empty" in msg and "base:" in msg
    child = write(tmp_path, "child.yaml", "base: e.yaml\n")
    assert "e.yaml (the base of" in error_of(load_config, child)
    assert load_config(write(tmp_path, "s.yaml", "trainer:\n")).trainer.max_steps == 100


def test_yaml_merge_keys_merge(tmp_path):
    path = write(tmp_path, "m.yaml", """
        variables:
          shared: &shared {lr: 2e-3, weight_decay: 0.05}
        optimizer:
          <<: *shared
          lr: 1e-3
        scheduler: {<<: [*shared], weight_decay: 0.0}
        """)
    with pytest.raises(ConfigError, match="unknown key 'scheduler.lr'"):
        load_config(path)
    path.write_text(path.read_text().replace("scheduler: {<<: [*shared], weight_decay: 0.0}\n", ""))
    cfg = load_config(path)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.weight_decay == 0.05
    dup = write(tmp_path, "d.yaml", "variables: {a: &a {x: 1}}\nrun:\n  <<: *a\n  name: n\n  name: m\n")
    assert "duplicate key 'name'" in error_of(load_config, dup)


def test_base_chain_merges_dicts_and_replaces_lists(tmp_path):
    write(tmp_path, "configs/root.yaml", """
        run: {name: root, tags: [a, b, c]}
        trainer: {max_steps: 5, seq_len: 32}
        variables: {x: 1, y: 2}
        """)
    write(tmp_path, "configs/mid.yaml", """
        base: root.yaml
        trainer: {seq_len: 64}
        variables: {y: 3}
        """)
    child = write(tmp_path, "exp/child.yaml", """
        base: ../configs/mid.yaml
        run: {tags: [z]}
        """)
    cfg = load_config(child)
    assert cfg.run.name == "root" and list(cfg.run.tags) == ["z"]
    assert cfg.trainer.max_steps == 5 and cfg.trainer.seq_len == 64
    assert dict(cfg.variables) == {"x": 1, "y": 3}
    assert "base" not in cfg


def test_base_cycle_names_files(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    msg = error_of(load_config, tmp_path / "a.yaml")
    assert "cycle" in msg and "a.yaml" in msg and "b.yaml" in msg
    write(tmp_path, "self.yaml", "base: self.yaml\n")
    assert "cycle" in error_of(load_config, tmp_path / "self.yaml")


def test_missing_files(tmp_path):
    msg = error_of(load_config, tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "not found" in msg
    write(tmp_path, "child.yaml", "base: gone.yaml\n")
    msg = error_of(load_config, tmp_path / "child.yaml")
    assert "gone.yaml" in msg and "child.yaml" in msg


def test_malformed_yaml_line_and_column(tmp_path):
    path = write(tmp_path, "bad.yaml", "trainer:\n  max_steps: 5\n  seq_len: [1, 2\nrun: {}\n")
    msg = error_of(load_config, path)
    assert "bad.yaml" in msg and "line 4" in msg and "column" in msg
    path = write(tmp_path, "bad2.yaml", "trainer:\n  max_steps: 5\n   seq_len: 3\n")
    msg = error_of(load_config, path)
    assert "bad2.yaml" in msg and "line 3, column 11" in msg and "mapping values" in msg


def test_duplicate_key(tmp_path):
    msg = error_of(load_config, write(tmp_path, "d.yaml", "trainer:\n  max_steps: 1\n  max_steps: 2\n"))
    assert "duplicate key 'max_steps'" in msg and "line 3" in msg


def test_top_not_mapping(tmp_path):
    msg = error_of(load_config, write(tmp_path, "l.yaml", "- a\n- b\n"))
    assert "l.yaml" in msg and "mapping" in msg and "list" in msg


def test_unknown_keys(tmp_path):
    msg = error_of(load_config, write(tmp_path, "demo.yaml", "trainer:\n  max_step: 10\n"))
    assert msg == (
        f"unknown key 'trainer.max_step' in {tmp_path / 'demo.yaml'}; did you mean 'trainer.max_steps'?"
    )
    msg = error_of(load_config, write(tmp_path, "top.yaml", "trainr:\n  max_steps: 10\n"))
    assert "'trainr'" in msg and "top.yaml" in msg and "'trainer'" in msg
    msg = error_of(load_config, write(tmp_path, "nested.yaml", "strategy:\n  mixed_precision:\n    param_dtyp: x\n"))
    assert "'strategy.mixed_precision.param_dtyp'" in msg and "'strategy.mixed_precision.param_dtype'" in msg
    msg = error_of(load_config, write(tmp_path, "ok.yaml", "run: {}\n"), ["trainer.lr=1e-3"])
    assert "'trainer.lr'" in msg and "override" in msg and "'optimizer.lr'" in msg


def test_wrong_types(tmp_path):
    msg = error_of(load_config, write(tmp_path, "t.yaml", "trainer:\n  max_steps: ten\n"))
    assert msg.startswith("trainer.max_steps: expected an integer, got 'ten' (str)") and "t.yaml" in msg
    msg = error_of(load_config, write(tmp_path, "t2.yaml", "trainer: 5\n"))
    assert "trainer: expected a mapping, got 5 (int)" in msg
    msg = error_of(load_config, write(tmp_path, "t3.yaml", "optimizer:\n  betas: [0.9, high]\n"))
    assert "optimizer.betas.1: expected a number, got 'high' (str)" in msg
    msg = error_of(load_config, write(tmp_path, "t4.yaml", "run:\n  tags: solo\n"))
    assert "run.tags: expected a list" in msg
    msg = error_of(load_config, write(tmp_path, "t5.yaml", "trainer:\n  max_steps: null\n"))
    assert "trainer.max_steps: expected an integer, got None" in msg
    msg = error_of(load_config, write(tmp_path, "t6.yaml", "trainer:\n  progress_bar: maybe\n"))
    assert "trainer.progress_bar: expected a boolean" in msg
    msg = error_of(load_config, write(tmp_path, "ok.yaml", "run: {}\n"), ["trainer.max_steps=ten"])
    assert "trainer.max_steps: expected an integer, got 'ten' (str)" in msg and "override" in msg


# ------------------------------------------------------------------------------ overrides
def test_overrides(tmp_path):
    path = write(tmp_path, "demo.yaml", """
        variables: {n: 7}
        algorithms:
          - {name: activation_checkpointing}
          - {name: fp8}
        """)
    cfg = load_config(path, [
        "trainer.max_steps=5",
        "algorithms.0.name=compile",
        "algorithms.1.mode=max",
        "optimizer.betas.1=0.99",
        "optimizer.lr=1e-4",
        "run.tags=[a,b]",
        "checkpoint.dir=null",
        "run.group=null",
        "trainer.seq_len=${variables.n}",
        "variables.lr=2E-3",
        "variables.nested.deep=1",
        "model.rope_scaling.factor=8.0",
        "trainer={eval_every: 3}",
    ])
    assert cfg.trainer.max_steps == 5 and cfg.trainer.seq_len == 7 and cfg.trainer.eval_every == 3
    assert [a["name"] for a in cfg.algorithms] == ["compile", "fp8"] and cfg.algorithms[1]["mode"] == "max"
    assert list(cfg.optimizer.betas) == [0.9, 0.99]
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert list(cfg.run.tags) == ["a", "b"] and cfg.run.group is None and cfg.checkpoint.dir is None
    assert cfg.variables.lr == 2e-3 and isinstance(cfg.variables.lr, float)
    assert cfg.variables.nested.deep == 1 and cfg.model.rope_scaling.factor == 8.0


def test_override_errors(tmp_path):
    path = write(tmp_path, "demo.yaml", "algorithms:\n  - {name: compile}\n")
    msg = error_of(load_config, path, ["trainer.max_steps"])
    assert "key=value" in msg and "trainer.max_steps" in msg
    msg = error_of(load_config, path, ["algorithms.3.name=x"])
    assert "algorithms.3" in msg and "length 1" in msg
    msg = error_of(load_config, path, ["optimizer.betas.2=0.5"])
    assert "optimizer.betas.2" in msg and "length 2" in msg
    msg = error_of(load_config, path, ["algorithms.first.name=x"])
    assert "'algorithms' is a list" in msg


def test_interpolation_errors(tmp_path):
    path = write(tmp_path, "i.yaml", "optimizer:\n  lr: ${variables.lr}\n")
    msg = error_of(load_config, path)
    assert "optimizer.lr" in msg and "'${variables.lr}'" in msg and "missing key 'variables.lr'" in msg
    msg = error_of(load_config, write(tmp_path, "ok.yaml", "run: {}\n"), ["run.name=${nope.x}"])
    assert "'${nope.x}'" in msg and "'nope.x'" in msg
    msg = error_of(load_config, write(tmp_path, "w.yaml", "variables: {n: ten}\ntrainer: {max_steps: '${variables.n}'}\n"))
    assert "trainer.max_steps: expected an integer, got 'ten' (str)" in msg and "${variables.n}" in msg
    # an escaped '\${x}' resolves to the text '${x}', which the run's config.yaml would read back
    # as a reference (here to trainer.seq_len's value): refused, naming the key
    msg = error_of(load_config, write(tmp_path, "e.yaml", "run: {tags: [ok, 'a\\${trainer.seq_len}']}\n"))
    assert msg.startswith("run.tags.1: its value holds the text '${'"), msg
    # an escaped '\${' that opens nothing: OmegaConf's own parse error, with the key it is under
    for where, over in (("run.name", ["run.name=\\${"]), ("run.tags.1", ["run.tags=[ok, 'x\\${y']"])):
        msg = error_of(load_config, write(tmp_path, "ok.yaml", "run: {}\n"), over)
        assert msg.startswith(f"cannot resolve the config at {where}: no viable alternative"), msg
    # an unclosed '${' in a file: the file and the key
    bad = write(tmp_path, "u.yaml", "run: {name: '${'}\n")
    assert error_of(load_config, bad).startswith(f"{bad}: run.name: no viable alternative at input")
    # ... and in an override, where '${oc.env:' ends in a colon that YAML reads as a mapping's key
    # (it said 'expected a string, got a mapping'); a secret key's value stays unechoed
    for over in ("run.name=${oc.env:", "run.name=${oc.env:HOME", "trainer.max_steps=${oc.env:"):
        key = over.split("=")[0]
        msg = error_of(load_config, write(tmp_path, "ok.yaml", "run: {}\n"), [over])
        assert msg == (f"override '{over}': cannot set '{key}': its value opens an interpolation '${{' that "
                       "it does not close; end it with '}' (e.g. ${oc.env:NAME})"), msg
    msg = error_of(load_config, write(tmp_path, "ok.yaml", "loggers: [{name: wandb}]\n"),
                   ["loggers.0.api_key=${oc.env:MY_KEY"])
    assert "override 'loggers.0.api_key=***'" in msg and "MY_KEY" not in msg and "does not close" in msg


# ------------------------------------------------------------------------------- save/redact
def test_redact_and_save(tmp_path):
    data = {
        "loggers": [{"name": "wandb", "wandb_api_key": "abc", "max_tokens": 5}],
        "svc": {"deep": {"api_key": "k", "hf_token": "t", "token": "t", "password": "p"}},
        "tokens_per_step": 10, "eos_token": "<eos>", "auth_token": None,
    }
    red = redact(data)
    assert red["loggers"][0] == {"name": "wandb", "wandb_api_key": "***", "max_tokens": 5}
    assert red["svc"]["deep"] == {"api_key": "***", "hf_token": "***", "token": "***", "password": "***"}
    assert red["tokens_per_step"] == 10 and red["eos_token"] == "<eos>" and red["auth_token"] is None
    assert data["svc"]["deep"]["api_key"] == "k"  # input untouched

    path = write(tmp_path, "demo.yaml", """
        variables: {lr: 1e-4}
        optimizer: {lr: '${variables.lr}'}
        loggers:
          - {name: wandb, api_key: secret-value, max_tokens: 3}
        """)
    cfg = load_config(path)
    out = save_config(cfg, tmp_path / "run" / "config.yaml")
    text = out.read_text()
    assert "secret-value" not in text and "${" not in text
    saved = yaml.safe_load(text)
    assert saved["loggers"][0] == {"name": "wandb", "api_key": "***", "max_tokens": 3}
    assert saved["optimizer"]["lr"] == 1e-4
    again = load_config(out)  # the saved file loads back to the same config
    assert config_to_dict(again) == redact(config_to_dict(cfg))
    # written through a temp file and a rename: a write that fails leaves the old file whole
    before = out.read_text()
    (out.parent / ".config.yaml.tmp").mkdir()  # the temp name cannot be written
    with pytest.raises(OSError):
        save_config(load_config(path, ["optimizer.lr=0.5"]), out)
    assert out.read_text() == before


def test_number_like_strings_round_trip_through_config_yaml(tmp_path):
    path = write(tmp_path, "n.yaml", """
        run: {name: '1e3', group: '2e5', tags: ['1.5', '007', 'true', '2024-01-01']}
        callbacks: [{name: generate_samples, prompts: ['3e4', '.5']}]
        """)
    cfg = load_config(path, ["variables.label=1e3"])
    assert cfg.run.name == "1e3" and cfg.run.group == "2e5"
    again = load_config(save_config(cfg, tmp_path / "run" / "config.yaml"))
    assert config_to_dict(again) == config_to_dict(cfg)
    assert list(again.run.tags) == ["1.5", "007", "true", "2024-01-01"]
    assert list(again.callbacks[0]["prompts"]) == ["3e4", ".5"]
    # an override of a text field keeps its text; of a free-form key, YAML's type
    cfg = load_config(path, ["run.name=1e3", "run.group=007", "variables.n=1e3"])
    assert cfg.run.name == "1e3" and cfg.run.group == "007" and cfg.variables.n == 1000.0


# --------------------------------------------------------------------------- batch arithmetic
def cfg_with(*overrides, tmp_path):
    return load_config(write(tmp_path, "b.yaml", "run: {}\n"), list(overrides))


def test_plan_batch(tmp_path):
    cfg = cfg_with("trainer.global_batch_size=32", "trainer.micro_batch_size=4", "trainer.seq_len=128",
                   tmp_path=tmp_path)
    plan = plan_batch(cfg, world_size=2)
    assert plan == BatchPlan(world_size=2, dp_size=2, micro_batch_size=4, global_batch_size=32,
                             gradient_accumulation_steps=4, local_batch_size=16, seq_len=128,
                             tokens_per_step=4096)
    assert validate(cfg, world_size=2) == plan
    cfg = cfg_with("trainer.global_batch_size=10", "trainer.micro_batch_size=4", tmp_path=tmp_path)
    msg = error_of(plan_batch, cfg, 1)
    assert msg == ("trainer.global_batch_size=10 must be a multiple of micro_batch_size (4) x "
                   "data-parallel size (1) = 4; try 8 or 12")
    msg = error_of(plan_batch, cfg_with("trainer.global_batch_size=4", "trainer.micro_batch_size=4",
                                        tmp_path=tmp_path), 2)
    assert "= 8; try 8" in msg


def test_data_parallel_size(tmp_path):
    assert data_parallel_size(cfg_with(tmp_path=tmp_path), 8) == 8
    assert data_parallel_size(cfg_with("strategy.tp=2", "strategy.dp_replicate=2", tmp_path=tmp_path), 8) == 4
    assert data_parallel_size(cfg_with("strategy.dp_shard=4", "strategy.dp_replicate=2", tmp_path=tmp_path), 8) == 8
    msg = error_of(data_parallel_size, cfg_with("strategy.tp=3", tmp_path=tmp_path), 4)
    assert "strategy.tp=3" in msg and "world size 4" in msg
    msg = error_of(data_parallel_size, cfg_with("strategy.dp_shard=4", tmp_path=tmp_path), 2)
    assert "(1)" in msg and "(4)" in msg and "world size (2)" in msg and "strategy.dp_shard=-1" in msg
    msg = error_of(data_parallel_size, cfg_with("strategy.dp_replicate=3", tmp_path=tmp_path), 4)
    assert "strategy.dp_replicate=3" in msg and "world size 4" in msg


@pytest.mark.parametrize("override, key", [
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.seq_len=0", "trainer.seq_len"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
    ("trainer.precision=fp16", "trainer.precision"),
    ("scheduler.name=step", "scheduler.name"),
    ("scheduler.warmup_steps=-1", "scheduler.warmup_steps"),
    ("scheduler.min_lr_ratio=1.5", "scheduler.min_lr_ratio"),
    ("scheduler.decay_fraction=0", "scheduler.decay_fraction"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("strategy.name=deepspeed", "strategy.name"),
    ("data.source=ftp", "data.source"),
    ("data.val_fraction=1.0", "data.val_fraction"),
    ("tokenizer.type=sentencepiece", "tokenizer.type"),
    ("trainer.log_every=0", "trainer.log_every"),
    ("trainer.eval_every=-1", "trainer.eval_every"),
    ("trainer.eval_batches=0", "trainer.eval_batches"),
    ("algorithms=[{name: compile}, {mode: x}]", "algorithms[1]"),
    ("callbacks=[{name: 3}]", "callbacks[0]"),
    ("loggers=[{}]", "loggers[0]"),
])
def test_validate_errors(tmp_path, override, key):
    msg = error_of(validate, cfg_with(override, tmp_path=tmp_path))
    assert key in msg


@pytest.fixture
def fresh_warnings(monkeypatch):
    """warn_once as in a fresh rank-0 process: its once-per-process memory empty and no rank
    or launcher variable that another test's process state could have left (a full-suite run
    on one xdist worker saw both warnings below suppressed)."""
    import importlib

    validate_module = importlib.import_module("llmforge.config.validate")  # the module, not the function
    monkeypatch.setattr(validate_module, "_WARNED", set())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(validate_module.WARNINGS_SHOWN_ENV, raising=False)


def test_warmup_longer_than_the_run_is_a_warning_not_an_error(tmp_path, capsys, fresh_warnings):
    cfg = cfg_with("scheduler.warmup_steps=100", "trainer.max_steps=10", tmp_path=tmp_path)
    assert validate(cfg).gradient_accumulation_steps >= 1
    err = capsys.readouterr().err
    assert err.startswith("warning: scheduler.warmup_steps (100) > trainer.max_steps (10)")
    assert "scheduler.warmup_steps=1" in err
    # one advice for every length (issue 49.4: max_steps=5 was told 0, max_steps=10 told 1)
    validate(cfg_with("scheduler.warmup_steps=100", "trainer.max_steps=5", tmp_path=tmp_path))
    assert capsys.readouterr().err.rstrip().endswith("a tenth of the steps: scheduler.warmup_steps=1")
    validate(cfg_with("scheduler.warmup_steps=100", "trainer.max_steps=50", tmp_path=tmp_path))
    assert capsys.readouterr().err.rstrip().endswith("scheduler.warmup_steps=5")


def test_workers_of_the_nproc_launcher_do_not_repeat_its_warnings(tmp_path, capsys, monkeypatch):
    from llmforge.config.validate import WARNINGS_SHOWN_ENV

    monkeypatch.setenv(WARNINGS_SHOWN_ENV, "1")  # what `--nproc N` gives its workers
    validate(cfg_with("scheduler.warmup_steps=99", "trainer.max_steps=7", tmp_path=tmp_path))
    assert capsys.readouterr().err == ""


def test_muon_keys_with_adamw_are_one_warning_naming_them(tmp_path, capsys, fresh_warnings):
    """Issue 50.6: optimizer.muon_* keys were ignored without a word under optimizer.name=adamw."""
    validate(cfg_with("optimizer.muon_lr=0.0123", "optimizer.muon_ns_steps=7", tmp_path=tmp_path))
    err = capsys.readouterr().err
    assert err == ("warning: optimizer.muon_lr=0.0123, optimizer.muon_ns_steps=7 set, but "
                   "optimizer.name=adamw ignores the muon_* keys; set optimizer.name=muon to use "
                   "them, or remove them\n")
    validate(cfg_with("optimizer.name=muon", "optimizer.muon_lr=0.0123", tmp_path=tmp_path))
    validate(cfg_with("optimizer.muon_momentum=0.95", tmp_path=tmp_path))  # the default: no warning
    assert capsys.readouterr().err == ""


def test_validate_accepts_edges(tmp_path):
    cfg = cfg_with("scheduler.warmup_steps=0", "trainer.max_steps=1", "trainer.eval_every=0",
                   "data.val_fraction=0", "scheduler.min_lr_ratio=0", "scheduler.decay_fraction=1",
                   tmp_path=tmp_path)
    assert validate(cfg).gradient_accumulation_steps == 1


def test_error_for_a_secret_looking_override_does_not_echo_its_value():
    from llmforge.config import load_config
    from llmforge.errors import ConfigError

    for item in ["wandb_api_key=SEKRET123", "run.hf_token=SEKRET123", "trainer.api_key=SEKRET123"]:
        with pytest.raises(ConfigError) as info:
            load_config(Path(__file__).parents[1] / "yamls" / "demo_cpu.yaml", [item])
        assert "SEKRET123" not in str(info.value) and "=***'" in str(info.value), str(info.value)


def test_url_credentials_are_redacted_in_configs_and_errors(tmp_path, capsys):
    from llmforge.cli import main

    assert redact({"data": {"path": "https://alice:pw12345@host/x.jsonl"}}) == {
        "data": {"path": "https://***@host/x.jsonl"}}
    assert redact({"p": "s3://AKIATOKEN@bucket/x", "q": "hf://datasets/org/x@main", "m": "memory:///K:S@b/x"}) == {
        "p": "s3://***@bucket/x", "q": "hf://datasets/org/x@main", "m": "memory:///***@b/x"}  # token@ too
    code = main(["train", str(Path(__file__).parents[1] / "yamls" / "demo_cpu.yaml"),
                 "data.source=files", "data.path=https://alice:hunter2SECRET@127.0.0.1:9/x.jsonl",
                 f"run.output_dir={tmp_path}"])  # a closed local port: fails at once
    out, err = capsys.readouterr()
    assert code == 2 and "https://***@127.0.0.1:9/x.jsonl" in err, err[-2000:]
    assert "hunter2SECRET" not in out + err
