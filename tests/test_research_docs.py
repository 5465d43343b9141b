"""docs/research.md: every example runs as written (the code blocks are written to a
``my_lab`` package and imported), and the contract it states holds: a ``compute_loss``
override tells evaluation from training, plugin state keys, the builders, the block signature."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import DEMO, TINY_OVERRIDES
from helpers.docs_examples import RESEARCH, write_research_package

RUN = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
       "trainer.max_steps=1", "trainer.eval_every=0", "trainer.eval_batches=2",
       "trainer.log_every=1", "data.max_documents=3"]


@pytest.fixture(scope="module")
def my_lab(tmp_path_factory):
    """docs/research.md's ``my_lab`` package on ``sys.path`` (any other ``my_lab`` put aside)."""
    folder = tmp_path_factory.mktemp("research")
    names = write_research_package(folder)

    def ours() -> list[str]:
        return [k for k in sys.modules if k == "my_lab" or k.startswith("my_lab.")]

    saved = {k: sys.modules.pop(k) for k in ours()}
    sys.path.insert(0, str(folder))
    try:
        yield names
    finally:
        sys.path.remove(str(folder))
        for k in ours():
            del sys.modules[k]
        sys.modules.update(saved)


def records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_research_page_is_linked_and_names_every_builder():
    from llmforge import Trainer
    from conftest import REPO

    assert "(docs/research.md)" in (REPO / "README.md").read_text()
    text = RESEARCH.read_text()
    builders = [n for n in dir(Trainer) if n.startswith("build_")]
    assert len(builders) >= 10 and [n for n in builders if f"`{n}(" not in text] == []


def test_the_examples_in_a_real_run(my_lab, tmp_path):
    """A plain run and one with every example (the Trainer subclass, the compute_loss module with
    module_kwargs, two Tracker instances, DecayLater): eval/loss at step 0 (same weights) is the
    plain one exactly, train/loss has the penalty; each Tracker has its own checkpoint entry."""
    import importlib

    from llmforge import Trainer

    assert sorted(my_lab) == ["my_lab.blocks", "my_lab.decay_later", "my_lab.module",
                              "my_lab.tracker", "my_lab.trainer"]
    for name in my_lab:
        importlib.import_module(name)
    from my_lab.trainer import MyTrainer

    base = [*RUN, f"run.output_dir={tmp_path}"]
    Trainer.from_yaml(DEMO, [*base, "run.name=plain", "checkpoint.save_final=false"]).fit()
    trainer = MyTrainer.from_yaml(DEMO, [
        *base, "run.name=research", "trainer.module=my_lab.module.PenalizedModule",
        "trainer.module_kwargs={coef: 1.0}",
        "algorithms=[{name: my_lab.tracker.Tracker, key: a}, {name: my_lab.tracker.Tracker, key: b}, "
        "{name: my_lab.decay_later.DecayLater, steps: 1}]"])
    trainer.fit()
    plain, research = records(tmp_path / "plain"), records(tmp_path / "research")
    assert research[0]["eval/loss"] == plain[0]["eval/loss"]  # before the evaluation ran as training
    assert research[1]["train/loss"] > plain[1]["train/loss"] + 0.01
    saved = json.loads((tmp_path / "research" / "checkpoints" / "step_00000001" / "trainer_state.json")
                       .read_text())["callbacks"]
    assert {k: v for k, v in saved.items() if k.startswith("Tracker")} == {
        f"Tracker[{k}]": {"steps_seen": 1} for k in ("a", "b", "python")}
    groups = {g["name"]: g["weight_decay"] for g in trainer.lightning.optimizers[0].param_groups}
    assert groups == {"decay": 0.0, "no_decay": 0.0}


def test_two_plugins_with_state_under_one_key_are_refused(my_lab):
    from llmforge.checkpoint.plugins import check_state_keys
    from llmforge.errors import ConfigError
    from my_lab.tracker import Tracker

    class Unkeyed(Tracker):
        state_key = property(lambda self: "Unkeyed")

    check_state_keys([Tracker("a"), Tracker("b")])
    with pytest.raises(ConfigError, match="two plugins with state save it under one key 'Unkeyed'"):
        check_state_keys([Unkeyed("a"), Unkeyed("b")])


def test_custom_block_decodes_cached_and_a_block_without_cache_says_so(my_lab, capsys):
    from omegaconf import OmegaConf

    from examples.parallel_block_model import build_parallel_llama
    from llmforge import registry
    from llmforge.models import LLAMA3
    from llmforge.models.sampling import generate, supports_kv_cache
    import my_lab.blocks  # noqa: F401  (registers my_parallel_llama)

    shape = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    cfg = OmegaConf.structured(LLAMA3.config_cls(preset=None, **shape))
    torch.manual_seed(0)
    model = registry.models.get("my_parallel_llama")(cfg).eval()
    assert supports_kv_cache(model)
    cached = generate(model, [1, 2, 3], 8, temperature=0)
    assert cached == generate(model, [1, 2, 3], 8, temperature=0, use_cache=False)
    assert capsys.readouterr().err == ""
    plain = build_parallel_llama(cfg).eval()  # examples/: forward(x, rope), no cache argument
    generate(plain, [1, 2, 3], 2, temperature=0)
    generate(plain, [1, 2, 3], 2, temperature=0)
    err = capsys.readouterr().err.splitlines()
    assert err == ["generate: decoding without a KV cache (ParallelBlock.forward takes no cache "
                   "argument); a block whose forward takes (x, rope, mask=None, cache=None) and "
                   "passes them to its attention decodes cached (docs/research.md)"]
