"""Bad input to the scale keys (``strategy.pp``/``ep``, ``pipeline:``, the MoE model keys,
``batch_size_warmup``, ``muon``), as a hostile user would write it: each is one ``ConfigError``
naming the key, raised by the config checks before any model is built (in-process, no trainer);
the CLI path (exit 2, one ``error:`` line, nothing written) is checked once."""

from __future__ import annotations

import pytest

from conftest import DEMO, REPO
from llmforge.algorithms.loading import build_algorithms
from llmforge.cli import main
from llmforge.config.loader import load_config
from llmforge.config.parallel_schema import PIPELINE_SCHEDULES
from llmforge.config.validate import validate
from llmforge.errors import ConfigError
from llmforge.parallel.pipeline import SCHEDULE_CLASSES

MOE = str(REPO / "yamls" / "demo_cpu_qwen3_moe.yaml")
PP2 = ["strategy.pp=2", "trainer.devices=2"]
BSW = "algorithms=[{name: batch_size_warmup, start_global_batch_size: 4, duration_tokens: 1000}]"

# (overrides, a part of the one error line). Before the fix, the ones marked so exited 1 with a
# Python error, or were accepted (a typo at pp=1, a fraction truncated to block 0).
CASES = [
    # pipeline.split of the wrong shape: TypeError/ValueError (exit 1), or 0.5 read as block 0
    ([*PP2, "pipeline.split=[0,1,2,3]"], "pipeline.split: expected balanced, lighter_ends or a list"),
    ([*PP2, "pipeline.split=[[a,b],[c]]"], "got [['a', 'b'], ['c']]"),
    ([*PP2, "pipeline.split=[[null],[2,3]]"], "pipeline.split: expected balanced"),
    ([*PP2, "pipeline.split=null"], "got None"),
    ([*PP2, "pipeline.split=[[0.5,1],[2,3]]"], "got [[0.5, 1], [2, 3]]"),
    ([*PP2, "pipeline.split=[[0,1],[-1,3]]"], "integers >= 0"),
    ([*PP2, "pipeline.split=[[0,1],[2,3],[]]"], "one non-empty list"),
    ([*PP2, "pipeline.split=Balanced"], "pipeline.split: expected one of balanced, lighter_ends; got 'Balanced'"),
    # typos and nonsense at pp=1 were accepted (the pipeline keys were read only at pp > 1)
    (["pipeline.schedule=bogus"], "pipeline.schedule: expected one of 1f1b, interleaved_1f1b"),
    (["pipeline.microbatches=-5"], "pipeline.microbatches must be an integer >= 1 or null"),
    ([*PP2, "pipeline.microbatches=0"], "pipeline.microbatches must be an integer >= 1"),
    ([*PP2, "pipeline.stages_per_rank=0"], "pipeline.stages_per_rank must be an integer >= 1"),
    # strategy.ep <= 0 said "must divide strategy.dp_shard"
    (["strategy.ep=0", "trainer.devices=2"], "strategy.ep must be an integer >= 1"),
    (["strategy.ep=-1", "trainer.devices=2"], "strategy.ep must be an integer >= 1"),
    # ep under ddp said "strategy.ep=2 must divide strategy.dp_shard (1)"
    (["strategy.name=ddp", "strategy.ep=2", "trainer.devices=2"], "which strategy.name=ddp does not have"),
    # {name:lora} (no space) is one key 'name:lora' to OmegaConf: said "needs a string 'name'"
    (["algorithms=[{name:lora}]"], "write a space after the colon, e.g. 'algorithms=[{name: lora}]'"),
    # already right; kept so they stay right
    (["strategy.pp=3", "trainer.devices=2"], "strategy.pp=3 does not divide the world size 2"),
    (["strategy.pp=0"], "strategy.pp must be >= 1"),
    (["optimizer.name=muon", "optimizer.muon_momentum=1"], "optimizer.muon_momentum must be in [0, 1)"),
    (["optimizer.name=muon", "optimizer.muon_lr=nan"], "optimizer.muon_lr must be > 0 and finite"),
]


@pytest.mark.parametrize("overrides, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_scale_key_refused(overrides, message):
    cfg = load_config(DEMO, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, None)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# Refused by a check that needs the run's layout (the algorithm's own check, before any process).
ALGO_CASES = [
    # batch_size_warmup + pp=2 passed --dry-run, then failed at step 1 in torch's schedule
    # ("Tensor size 2 is smaller than num_chunks", exit 1)
    (DEMO, [*PP2, BSW], "batch_size_warmup changes the batch of each step, which strategy.pp=2"),
    (DEMO, [BSW.replace("4,", "1000,")], "start_global_batch_size=1000 exceeds trainer.global_batch_size=16"),
]


@pytest.mark.parametrize("config, overrides, message", ALGO_CASES)
def test_scale_combination_refused(config, overrides, message):
    cfg = load_config(config, overrides)
    validate(cfg, None)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_algorithms(cfg)


def test_moe_keys_refused():
    """The MoE model keys are checked where the model is built (models/qwen3_moe/config.py)."""
    from llmforge.models.qwen3_moe.config import qwen3_moe_args_from_config

    for override, message in [("model.num_experts_per_tok=9", "model.num_experts_per_tok must be an integer from 1"),
                              ("model.capacity_factor=nan", "model.capacity_factor must be a number > 0"),
                              ("model.router_bias_update_rate=-0.1", "model.router_bias_update_rate must be a finite"),
                              ("model.mlp_only_layers=[7]", "model.mlp_only_layers must be a list of layer indices")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            qwen3_moe_args_from_config(load_config(MOE, [override]).model)


def test_schedule_names_match_torch_classes():
    """The config floor's list of pipeline.schedule names is the pipeline's own."""
    assert set(PIPELINE_SCHEDULES) == set(SCHEDULE_CLASSES)


def test_cli_one_error_line_exit_2(tmp_path, capsys):
    runs = tmp_path / "runs"
    code = main(["train", DEMO, "--dry-run", *PP2, "pipeline.split=[0,1,2,3]", f"run.output_dir={runs}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: pipeline.split:"), err
    assert not runs.exists()


def test_plan_of_a_pp_config_and_a_refusal():
    """``llmforge plan`` / ``strategy: auto`` with ``strategy.pp=2`` in the config plans (its
    ``pp`` is searched like ``tp``; it used to say "no layout fits ... at no GPU count"); a layout
    every simulation refuses is a config error, not a memory verdict."""
    from llmforge.planning.gpus import gpu_kind
    from llmforge.planning.planner import plan

    gpu = gpu_kind("H100-SXM-80GB")
    result = plan(load_config(DEMO, ["strategy.pp=2", "model.n_layers=2"]), 2, gpu,
                  simulate_fn=lambda cfg, layout, last_stage=False: _stand_in(layout))
    assert result.chosen is not None
    assert {c.layout.pp for c in result.candidates} | {result.chosen.layout.pp} == {1, 2}

    def refuse(cfg, layout):
        raise ConfigError("algorithms[0]: refused at this layout")

    with pytest.raises(ConfigError, match=r"^algorithms\[0\]: refused at this layout$"):
        plan(load_config(DEMO, []), 2, gpu, simulate_fn=refuse)


def _stand_in(layout):
    """A measurement without a simulation: 1 GiB of sharded state, 1 GiB of the rest."""
    from llmforge.planning.simulate import StepMeasurement

    phases = {"forward": (2**31, {"activations": 2**29}, 2**30)}
    return StepMeasurement(layout=layout, world_size=layout.world_size, n_layers=2, peak_bytes=2**31,
                           breakdown={"activations": 2**29}, flops=1e12, formula_flops=1e12,
                           phases=phases, sharded_state=2**30)

