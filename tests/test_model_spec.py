"""Model specs as the core sees them: a bare factory by import path gets the generic model: keys,
no tensor-parallel plan and no HF export, with clear errors (in-process CLI, no processes)."""

import pytest

from conftest import REPO
from llmforge.cli import main

BARE = """
model:
  name: tests.helpers.bare_model.build
  kwargs: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, vocab_size: 1024, multiple_of: 32, max_seq_len: 64}
tokenizer: {vocab_size: 1024}
trainer: {seq_len: 64, global_batch_size: 8, micro_batch_size: 8}
"""


@pytest.fixture
def bare_yaml(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # tests.helpers.bare_model: as PYTHONPATH=REPO would
    path = tmp_path / "bare.yaml"
    path.write_text(BARE)
    return str(path)


def test_bare_factory_dry_run_and_its_keys(bare_yaml, capsys):
    assert main(["train", bare_yaml, "--dry-run"]) == 0
    assert "parameters      " in capsys.readouterr().out
    assert main(["train", bare_yaml, "model.dim=64", "--dry-run"]) == 2  # not a key of a bare factory
    assert "unknown key 'model.dim'" in capsys.readouterr().err


def test_tp_without_a_plan_says_how_to_get_one(bare_yaml, capsys):
    code = main(["train", bare_yaml, "strategy.tp=2", "trainer.devices=2", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "has no tensor-parallel plan" in err and "ModelSpec" in err, err


def test_unknown_model_name_lists_the_families(tmp_path, capsys):
    code = main(["train", str(REPO / "yamls" / "demo_cpu.yaml"), "model.name=qwen", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown model 'qwen'" in err and "qwen3" in err and "llama3" in err, err


def test_a_spec_flops_formula_reaches_the_dry_run_and_mfu(capsys):
    from types import SimpleNamespace

    from llmforge.callbacks.speed import _flops_fn
    from llmforge.models import LLAMA3
    from llmforge.registry import models

    models.register("llama3_flops", LLAMA3.derive(name="llama3_flops", flops_per_token=lambda m, s: 1e6 * s))
    try:
        assert main(["train", str(REPO / "yamls" / "demo_cpu.yaml"), "model.name=llama3_flops",
                     "--dry-run"]) == 0
        assert "flops/token     2.56e+08 (training, at seq_len 256)" in capsys.readouterr().out
        module = SimpleNamespace(model=object(), cfg=SimpleNamespace(model=SimpleNamespace(name="llama3_flops")))
        assert _flops_fn(module)(10) == 1e7
    finally:
        models._items.pop("llama3_flops")


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_builtin_families_refuse_model_kwargs_and_name_their_plan(family):
    from llmforge.config import structured_config
    from llmforge.errors import ConfigError
    from llmforge.models.spec import get_spec

    spec = get_spec(family)
    assert spec.tp_plan == f"llmforge.models.{family}.parallelize:apply_tp"  # family_spec's layout
    assert callable(spec.get("check_tp")) and spec.adapter().family == family
    cfg = structured_config(family).model
    cfg.kwargs = {"share_norm": True}
    with pytest.raises(ConfigError, match=rf"model.kwargs: the built-in '{family}' factory takes no "
                                          r"extra arguments \(got share_norm\)"):
        spec(cfg)
