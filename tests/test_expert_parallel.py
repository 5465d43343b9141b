"""Expert parallelism (``strategy.ep``) on 4 real processes (gloo) against one process: FSDP2 x EP
(efsdp 2 x ep 2), ep=4, HSDP x EP (dp_replicate 2 x ep 2) and TP x EP (tp 2 x ep 2, Qwen3-MoE's
TP plan), FSDP2 x EP with LoRA on attention and experts and FSDP2 x EP with Muon (experts
orthogonalized per rank) train the tiny Qwen3-MoE (on right-padded rows, padding left out of the
router statistics, but TP x EP) to the same losses, auxiliary losses and weights; a checkpoint
saved at ep=2 loads into a one-process ep=1 model. One launch of tests/dist/ep_worker.py. Bad
``strategy.ep`` values exit 2 in-process; the dry run and ``llmforge plan`` with ep."""

import json

import pytest
from conftest import REPO
from helpers.dist import torchrun, worker

from llmforge.cli import main

MOE_DEMO = str(REPO / "yamls" / "demo_cpu_qwen3_moe.yaml")
DENSE_DEMO = str(REPO / "yamls" / "demo_cpu.yaml")
# dp_replicate,dp_shard,ep[,tp[,lora|muon]] -> (dp_replicate, efsdp, ep)
CONFIGS = {"1,4,2": [1, 2, 2], "1,4,4": [1, 1, 4], "2,2,2": [2, 1, 2], "1,2,2,2": [1, 1, 2],
           "1,4,2,1,lora": [1, 2, 2], "1,4,2,1,muon": [1, 2, 2]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    proc = torchrun(worker("ep_worker.py"), str(out), *CONFIGS, nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_ep_trains_like_one_process(reports, config):
    for report in reports:
        r = report[config]
        assert r["dims"] == CONFIGS[config]
        assert len(r["losses"]) == 10 and len(set(r["losses"])) > 1  # it trained
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert loss == pytest.approx(ref, abs=1e-5)
        for aux, ref in zip(r["aux"], r["ref_aux"]):
            assert set(aux) == set(ref) >= {"train/aux_loss", "train/aux/load_balancing",
                                            "train/aux/router_z", "moe/load_max_mean/layer_0"}
            assert ref["train/aux/load_balancing"] > 0.05  # coef 0.05 x about 2 (top-2)
            for k in ref:
                assert aux[k] == pytest.approx(ref[k], abs=1e-6), k
        # clipped at 0.5 from 2-5: every step; reduction orders differ (TP, ep all-to-alls), so
        # the norms drift apart by up to 1.1e-4 (relative) over the 10 steps
        for norm, ref in zip(r["norms"], r["ref_norms"]):
            assert norm == pytest.approx(ref, rel=5e-4)
        assert r["param_max_diff"] <= 1e-4
        # loss-free balancing: the bias moved by the load of all data-parallel ranks, as in one
        # process (multiples of the rate 0.01: exactly equal)
        assert r["bias"] == r["ref_bias"] and any(b != 0 for b in r["bias"])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_experts_are_split_over_ep_and_efsdp(reports, config):
    rep, efsdp, ep = CONFIGS[config]
    for report in reports:
        r = report[config]
        assert r["w1_local_shape"] == [8 // (ep * efsdp), 16, 32]  # [E, I, D] with E = 8
        assert r["w1_placements"][-1] == "S(0)"  # the experts on the ep dim
        assert len(r["w1_placements"]) == (3 if rep > 1 else 2)


def test_lora_expert_adapters_are_split_like_the_experts(reports):
    for report in reports:
        r = report["1,4,2,1,lora"]
        assert r["lora_w1_local_shape"] == [8 // 4, 2, 32]  # A [E, r, D]: E over ep 2 x efsdp 2
        assert r["lora_w1_placements"] == r["w1_placements"]
        assert r["lora_b_nonzero"] and r["w1_requires_grad"] is False


def test_muon_orthogonalizes_each_rank_s_own_experts(reports):
    """optimizer.name muon under efsdp 2 x ep 2: the expert stacks are Muon's (``muon_experts``),
    each rank's local shard is 2 whole experts of 8, and training equals one process's Muon
    (test_ep_trains_like_one_process: losses, aux losses, weights)."""
    for report in reports:
        r = report["1,4,2,1,muon"]
        assert r["muon_groups"]["muon_experts"] == [f"layers.0.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]
        assert "layers.0.feed_forward.router.weight" in r["muon_groups"]["muon"]
        assert r["muon_expert_local"] == [[2, 16, 32], [2, 32, 16], [2, 16, 32]]


def test_checkpoint_saved_at_ep2_loads_at_ep1(reports):
    r = reports[0]["1,4,2"]
    assert r["ckpt_keys_equal"] is True  # the model's own FQNs, no wrapper prefixes
    assert r["ckpt_max_diff"] == 0.0  # every full tensor, experts included
    assert r["ckpt_bias"] == r["bias"]  # the balancing bias (a buffer) is in the checkpoint


@pytest.mark.parametrize("config, args, message", [
    (MOE_DEMO, "trainer.devices=4 strategy.ep=3",
     "strategy.ep=3 must divide strategy.dp_shard (4): expert parallelism borrows those ranks"),
    (MOE_DEMO, "trainer.devices=4 strategy.ep=4 model.num_experts=6",
     "strategy.ep=4 must divide model.num_experts (6); use strategy.ep in [1, 2, 3, 6]"),
    (MOE_DEMO, "trainer.devices=2 strategy.name=ddp strategy.ep=2",
     "strategy.ep=2 borrows ranks of the FSDP2 shard group, which strategy.name=ddp does not have"),
    (MOE_DEMO, "trainer.devices=4 strategy.tp=2 strategy.ep=4",
     ("strategy.ep=4 must divide strategy.dp_shard (2): expert parallelism borrows those ranks (not "
      "tp's: strategy.tp=2 computes the experts whole on each tp rank); use one of [1, 2]")),
    (DENSE_DEMO, "trainer.devices=2 strategy.ep=2",
     "strategy.ep=2: model 'llama3' has no expert layers"),
])
def test_bad_ep_exits_2_naming_the_key(tmp_path, capsys, config, args, message):
    code = main(["train", config, "--dry-run", *args.split(), "trainer.micro_batch_size=2",
                 f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert err.count("error:") == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_dry_run_shows_experts_per_device_and_gathered_block(capsys):
    assert main(["train", MOE_DEMO, "--dry-run", "model.preset=qwen3_30b_a3b", "model.vocab_size=151936",
                 "tokenizer.vocab_size=151936", "trainer.devices=8", "trainer.micro_batch_size=1",
                 "trainer.precision=bf16-true", "strategy.ep=8"]) == 0
    out = capsys.readouterr().out
    assert "world size      8 (fsdp2, dp 8, tp 1, ep 8)" in out
    # a layer's experts: 128 x 3 x 2048 x 768 bf16 = 1.125 GiB, 1/8 of them on each device;
    # attention and router 0.035 GiB; model state sharded 8x as without ep
    assert ("experts         128 per layer, ep 8: 16 per device; one block's all-gathered weights "
            "0.18 GiB (experts 0.14 GiB; 1.16 GiB at ep 1)") in out
    assert "sharded 8x" in out and "expert_parallel -> fsdp2" in out


def test_plan_lays_out_ep_for_qwen3_30b_a3b(capsys):
    """`llmforge plan` on the Qwen3-30B-A3B preset enumerates ep (divisors of dp_shard and of the
    128 experts) and derives it from the ep=1 step (a stand-in simulation here: the real one is
    tested in test_planning.py): the two gathered blocks' experts shrink to 1/ep, four
    all-to-alls per sparse layer are added, FLOPs are the active-parameter formula's."""
    from llmforge.config import load_config
    from llmforge.planning.experts import ExpertShape
    from llmforge.planning.gpus import gpu_kind
    from llmforge.planning.layout_settings import winner_yaml
    from llmforge.planning.measure import Collective
    from llmforge.planning.planner import plan
    from llmforge.planning.report import report
    from llmforge.planning.simulate import StepMeasurement

    gib = 2**30

    def stand_in(cfg, layout):
        assert layout.ep == 1  # the simulation runs ep=1 only
        return StepMeasurement(layout=layout, world_size=layout.world_size, n_layers=48,
                               peak_bytes=40 * gib, breakdown={}, flops=1e15, formula_flops=2e15,
                               collectives=[Collective("all_gather", "dp_shard", layout.dp_shard, 96, 120e9)],
                               sharded_state=30 * gib)

    cfg = load_config(MOE_DEMO, ["model.preset=qwen3_30b_a3b", "model.vocab_size=151936",
                                 "tokenizer.vocab_size=151936", "trainer.precision=bf16-true",
                                 "trainer.global_batch_size=64", "variables.seq_len=4096"])
    shape = ExpertShape.of(cfg)
    assert (shape.num_experts, shape.sparse_layers, shape.top_k, shape.dim) == (128, 48, 8, 2048)
    assert shape.gathered_experts == 128 * 3 * 2048 * 768  # one block's experts, elements
    result = plan(cfg, 16, gpu_kind("h100"), simulate_fn=stand_in)
    by = {(c.layout.dp_shard, c.layout.tp, c.layout.ep): c for c in result.candidates
          if c.peak_bytes is not None and c.layout.activation_checkpointing == "none"
          and c.layout.micro_batch_size == 1 and c.layout.dp_replicate == 1}
    assert {ep for (shard, tp, ep) in by if (shard, tp) == (16, 1)} == {1, 2, 4, 8, 16}
    assert {ep for (shard, tp, ep) in by if (shard, tp) == (4, 4)} == {1, 2, 4}
    one, eight = by[16, 1, 1], by[16, 1, 8]
    # 2 blocks in flight x 1.125 GiB of bf16 experts x (1 - 1/8)
    assert (one.peak_bytes - eight.peak_bytes) / gib == pytest.approx(2 * 1.125 * 7 / 8)
    assert eight.step_seconds > one.step_seconds  # the all-to-alls are not overlapped
    # compute-bound on the active-parameter formula's 2e15 FLOPs per rank (not the counter's 1e15)
    assert one.step_seconds == pytest.approx(2e15 / (0.5 * gpu_kind("h100").bf16_flops))
    assert "\n  ep: 8\n" in winner_yaml(eight, []) and "\n  ep:" not in winner_yaml(one, [])
    text = report(result, "yamls/demo_cpu_qwen3_moe.yaml", 1.0)  # fits an 80-column terminal
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "more measured layouts not shown: --json lists every one" in text.replace("\n  ", " ")
    assert main(["plan", MOE_DEMO, "strategy.ep=2", "--gpus", "8", "--json", "model.n_layers=1",
                 "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
                 "model.moe_intermediate_size=32", "model.hidden_dim=64", "variables.seq_len=32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {c["ep"] for c in report["candidates"]} == {1, 2, 4, 8}  # a real simulation, ep derived


def test_dry_run_simulate_refuses_ep(capsys):
    assert main(["train", MOE_DEMO, "--dry-run", "--simulate", "trainer.devices=2",
                 "trainer.micro_batch_size=4", "strategy.name=fsdp2", "strategy.ep=2"]) == 2
    err = capsys.readouterr().err
    assert "strategy.ep=2: the simulation (--dry-run --simulate) runs strategy.ep=1 only" in err
