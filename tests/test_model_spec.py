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


def test_plain_function_under_the_demo_base_says_to_register_a_spec(tmp_path, monkeypatch, capsys):
    """Issue 27.5: the demo's shape keys under a bare factory name the spec route, not a
    'did you mean tokenizer.vocab_size'."""
    monkeypatch.chdir(REPO)
    path = tmp_path / "bare_base.yaml"
    path.write_text(f"base: {REPO / 'yamls' / 'demo_cpu.yaml'}\nmodel: {{name: tests.helpers.bare_model.build}}\n")
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown key 'model.vocab_size'") and "tokenizer.vocab_size" not in err
    assert "model.name is a plain function" in err and "register a ModelSpec" in err
    assert "docs/models.md, 'A model in your own package'" in err


def test_docs_model_in_your_own_package_trains(tmp_path, monkeypatch, capsys):
    """docs/models.md's spec route for code outside llmforge: base: yamls/demo_cpu.yaml works,
    the new key is checked, one step trains with the scaled logits."""
    import sys

    from conftest import TINY_OVERRIDES
    from llmforge.registry import models

    text = (REPO / "docs" / "models.md").read_text().split("## A model in your own package", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    yaml = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    # the `llmforge` script does not look in the working directory: the command says PYTHONPATH=.
    assert "PYTHONPATH=. llmforge train my_lab/scaled.yaml" in yaml
    (tmp_path / "my_lab").mkdir()
    (tmp_path / "my_lab" / "models.py").write_text(code)
    (tmp_path / "my_lab" / "scaled.yaml").write_text(
        yaml.replace("../yamls/demo_cpu.yaml", str(REPO / "yamls" / "demo_cpu.yaml")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=.
    for name in [k for k in sys.modules if k == "my_lab" or k.startswith("my_lab.")]:
        monkeypatch.delitem(sys.modules, name)  # another test file's my_lab on this worker
    try:
        cfg = "my_lab/scaled.yaml"
        assert main(["train", cfg, "model.logit_scal=2", "--dry-run"]) == 2
        assert "did you mean 'model.logit_scale'?" in capsys.readouterr().err
        assert main(["train", cfg, *TINY_OVERRIDES, "trainer.max_steps=1", "trainer.eval_every=0",
                     "data.max_documents=3", f"run.output_dir={tmp_path / 'runs'}"]) == 0
        from my_lab.models import ScaledLlama, build_scaled_llama

        from llmforge.config import load_config

        model = build_scaled_llama(load_config(cfg, TINY_OVERRIDES).model)
        assert isinstance(model, ScaledLlama) and model.logit_scale == 0.5
        assert "done: 1 steps" in capsys.readouterr().out
        # no HF adapter: convert to-hf refuses with exit 2, one line, nothing written (issue 27.7)
        out = tmp_path / "hf"
        assert main(["convert", "to-hf", str(tmp_path / "runs" / "scaled"), str(out), "--trust-code"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "model 'scaled_llama' has no Hugging Face adapter" in err
        assert err.count("\n") == 1 and not out.exists()
    finally:
        models._items.pop("scaled_llama", None)
        for name in ("my_lab.models", "my_lab"):
            sys.modules.pop(name, None)
