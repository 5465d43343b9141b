"""Each research example runs from its YAML for a few steps through the CLI."""

import json

import pytest

from conftest import REPO, run_cli


@pytest.mark.slow
@pytest.mark.parametrize("yaml_name", ["zloss.yaml", "parallel_block.yaml"])
def test_example_runs(yaml_name, tmp_path, tiny_overrides):
    proc = run_cli("train", str(REPO / "examples" / yaml_name), *tiny_overrides,
                   "trainer.max_steps=6", "trainer.eval_every=0", "trainer.log_every=3", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1
    records = [json.loads(x) for x in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)


def test_zloss_adds_the_auxiliary_term():
    import torch
    from omegaconf import OmegaConf

    from examples.zloss_module import ZLossModule
    from llmforge.config.schema import TrainConfig
    from llmforge.config.validate import plan_batch
    from llmforge.training.module import LLMModule

    cfg = OmegaConf.structured(TrainConfig)
    plan = plan_batch(cfg, 1)
    logits = torch.randn(2, 3, 7)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    base, n = LLMModule(cfg, plan).compute_loss(logits, labels)
    z, n2 = ZLossModule(cfg, plan, z_loss_weight=0.5).compute_loss(logits, labels)
    lse = torch.logsumexp(logits, -1)[labels != -100]
    assert n == n2 == 3
    torch.testing.assert_close(z, base + 0.5 * (lse**2).sum())


def test_parallel_block_model_is_registered_and_differs():
    import torch
    from omegaconf import OmegaConf

    import examples.parallel_block_model  # noqa: F401
    from llmforge import registry
    from llmforge.config.schema import ModelConfig

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"dim": 32, "n_layers": 2, "n_heads": 4,
                          "n_kv_heads": 2, "vocab_size": 40, "multiple_of": 16, "max_seq_len": 8})
    model = registry.models.get("parallel_llama")(cfg)
    model.init_weights()
    assert type(model.layers[0]).__name__ == "ParallelBlock"
    assert model(torch.randint(0, 40, (1, 8))).shape == (1, 8, 40)
