"""Each research example runs from its YAML for a few steps through the CLI."""

import json

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("yaml_name", ["zloss.yaml", "parallel_block.yaml", "label_smoothing.yaml"])
def test_example_runs(yaml_name, tmp_path, tiny_overrides, monkeypatch):
    from llmforge.cli import main

    monkeypatch.syspath_prepend(str(REPO))  # examples/ is found as PYTHONPATH=REPO finds it
    assert main(["train", str(REPO / "examples" / yaml_name), *tiny_overrides, "trainer.max_steps=6",
                 "trainer.eval_every=0", "trainer.log_every=3"]) == 0
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1
    records = [json.loads(x) for x in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    if yaml_name == "zloss.yaml":
        assert all(r["train/z_loss"] > 0 for r in records if "train/loss" in r)
    if yaml_name == "label_smoothing.yaml":
        assert all(r["train/dropped_targets"] > 0 for r in records if "train/loss" in r)


def test_label_smoothing_example_changes_the_batch_and_the_loss():
    import torch
    import torch.nn.functional as F

    from examples.label_smoothing import LabelSmoothingTokenDrop
    from llmforge.events import State
    from llmforge.training.module import LLMModule

    algo = LabelSmoothingTokenDrop(smoothing=0.2, drop=0.5, seed=3)
    windows = torch.randint(0, 7, (4, 9))
    st = State(batch=windows, step=1, module=LLMModule)
    algo.batch_start(st)
    labels = st.batch["labels"]
    assert torch.equal(st.batch["input_ids"], windows[:, :-1])
    kept = labels != -100
    assert 0 < kept.sum() < labels.numel() and torch.equal(labels[kept], windows[:, 1:][kept])
    st.outputs, st.labels, st.training = torch.randn(4, 8, 7), labels, True
    algo.before_loss(st)
    hand = -sum(0.8 * F.log_softmax(st.outputs[b, t], -1)[labels[b, t]]
                + 0.2 * F.log_softmax(st.outputs[b, t], -1).mean()
                for b in range(4) for t in range(8) if labels[b, t] != -100)
    torch.testing.assert_close(st.loss, hand)


def test_parallel_block_model_is_registered_and_differs():
    import torch
    from omegaconf import OmegaConf

    import examples.parallel_block_model  # noqa: F401
    from llmforge import registry
    from llmforge.models.llama3.config import Llama3Config as ModelConfig

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"dim": 32, "n_layers": 2, "n_heads": 4,
                          "n_kv_heads": 2, "vocab_size": 40, "multiple_of": 16, "max_seq_len": 8})
    model = registry.models.get("parallel_llama")(cfg)
    model.init_weights()
    assert type(model.layers[0]).__name__ == "ParallelBlock"
    assert model(torch.randint(0, 40, (1, 8))).shape == (1, 8, 40)
