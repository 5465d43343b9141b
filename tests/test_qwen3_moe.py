"""Qwen3-MoE: the grouped expert computation against a per-token reference, the router against
transformers' Qwen3MoeForCausalLM (logits, the auxiliary loss, `convert from-hf`/`to-hf`
bit-exact, transformers reloads the export), the presets' total and active parameter counts,
the auxiliary losses through the event contract (optimized loss, `eval/loss` pure
cross-entropy), the dry run and bad MoE keys (exit 2)."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from conftest import REPO  # noqa: E402
from llmforge.cli import main  # noqa: E402
from llmforge.errors import ConfigError  # noqa: E402
from llmforge.models.qwen3_moe.moe import MoE  # noqa: E402
from helpers.hf_files import safetensors_of  # noqa: E402
from helpers.moe import moe_module  # noqa: E402

MOE_DEMO = str(REPO / "yamls" / "demo_cpu_qwen3_moe.yaml")


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """sum_k w_k * SwiGLU_{e_k}(x_t), one token and one expert at a time; ``x [N, D]``."""
    _, _, weights, idx = moe.route(x)
    ex = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = int(idx[t, j])
            h = F.silu(x[t] @ ex.w1[e].T) * (x[t] @ ex.w3[e].T)
            out[t] += weights[t, j] * (h @ ex.w2[e].T)
    return out


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_grouped_experts_equal_the_per_token_reference(impl):
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=16, num_experts=4, top_k=2)
    moe.init_weights(0.15, 0.15)
    moe.impl = impl
    x = torch.randn(2, 12, 32, requires_grad=True)
    y = moe(x)
    ref = per_token_reference(moe, x.detach().reshape(-1, 32)).reshape_as(y)
    assert 0.2 < ref.abs().max() < 4  # outputs of order 1: 1e-6 is a few float32 ulps
    assert (y - ref).abs().max().item() < 1e-6
    assert int(moe.stats.counts.sum()) == 24 * 2 and int(moe.stats.dropped) == 0
    y.square().sum().backward()  # the grouped path has gradients for every expert weight
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.parameters())


def test_capacity_factor_drops_the_overflow_and_counts_it():
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=16, num_experts=4, top_k=1, capacity_factor=1.0)
    moe.init_weights(0.15, 0.15)
    with torch.no_grad():  # route every token to expert 0: capacity ceil(1.0 * 8 / 4) = 2
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.rand(1, 8, 32) + 0.1
    y = moe(x)
    assert int(moe.stats.dropped) == 6 and moe.stats.counts.tolist() == [8.0, 0.0, 0.0, 0.0]
    full = MoE(dim=32, hidden_dim=16, num_experts=4, top_k=1)
    full.load_state_dict(moe.state_dict())
    ref = full(x)
    torch.testing.assert_close(y[0, :2], ref[0, :2], atol=1e-6, rtol=0)  # the first two kept
    assert y[0, 2:].abs().max() == 0  # the rest add nothing


def test_loss_free_balancing_chooses_with_the_bias_and_weighs_without_it():
    """DeepSeek-V3's rule: top-k by probs + bias, weights the unbiased probs; the bias moves by
    rate x sign(mean load - load) after a step, and a load counted twice moves it the same."""
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=16, num_experts=4, top_k=1, norm_topk_prob=False, bias_update_rate=0.25)
    moe.init_weights(0.15, 0.15)
    with torch.no_grad():  # every token prefers expert 0
        moe.router.weight.zero_()
        moe.router.weight[0] = 0.02
    x = torch.rand(1, 8, 32) + 0.1
    moe(x)
    moe(x)  # e.g. an activation-checkpointing recompute: the same load counted again
    assert moe.load.tolist() == [16.0, 0.0, 0.0, 0.0]
    moe.update_bias(moe.load.clone())  # one process: the summed load is its own
    assert moe.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25] and moe.load.sum() == 0
    _, probs, weights, idx = moe.route(x.reshape(-1, 32))
    assert (idx != 0).all()  # chosen by the bias ...
    torch.testing.assert_close(weights, probs.gather(-1, idx))  # ... weighed without it
    moe.eval()
    moe(x)
    assert moe.load.sum() == 0  # evaluation forwards do not count
    assert "expert_bias" in moe.state_dict() and "load" not in moe.state_dict()  # checkpointed


def tiny_hf(path, norm_topk: bool, tie: bool = False, seed: int = 0, sparse_step: int = 1, vocab: int = 128):
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=64,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=norm_topk,
        decoder_sparse_step=sparse_step, router_aux_loss_coef=0.02)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits the router to zeros and norms to ones: randomize them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("norm_topk, tie, sparse_step", [(True, False, 1), (False, True, 2)])
def test_convert_round_trip_matches_transformers(tmp_path, norm_topk, tie, sparse_step):
    from llmforge.checkpoint.run_dir import load_model

    hf = tiny_hf(tmp_path / "hf", norm_topk, tie, sparse_step=sparse_step)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours, cfg, _ = load_model(tmp_path / "run")
    assert cfg.model.name == "qwen3_moe" and cfg.model.norm_topk_prob == norm_topk
    assert len(ours.moe_layers()) == (2 if sparse_step == 1 else 1)
    with torch.no_grad():
        out = hf(tokens, labels=tokens, output_router_logits=True)
        torch.testing.assert_close(ours(tokens), out.logits, atol=1e-5, rtol=0)
        aux = ours.aux_losses()["load_balancing"]
        assert abs(aux.item() - 0.02 * out.aux_loss.item()) < 1e-6  # router_aux_loss_coef x aux_loss

    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    theirs, mine = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "back")
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # bit-exact
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, out.logits, atol=1e-5, rtol=0)


def test_preset_parameter_counts_equal_transformers():
    from omegaconf import OmegaConf

    from llmforge.models import QWEN3_MOE

    published = {"qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
                 "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520)}
    for name, (total, active) in published.items():
        a = QWEN3_MOE.presets[name]
        with torch.device("meta"):
            ours = QWEN3_MOE(OmegaConf.structured(QWEN3_MOE.config_cls(preset=name)))
            theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
                num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, intermediate_size=a.hidden_dim,
                moe_intermediate_size=a.moe_intermediate_size, num_experts=a.num_experts,
                num_experts_per_tok=a.num_experts_per_tok, vocab_size=a.vocab_size,
                tie_word_embeddings=a.tie_embeddings))
        assert QWEN3_MOE.num_params(ours) == (total, active)
        assert sum(p.numel() for p in theirs.parameters()) == total


def test_dry_run_prints_total_and_active_parameters(capsys):
    assert main(["train", MOE_DEMO, "--dry-run", "model.preset=qwen3_30b_a3b",
                 "model.vocab_size=151936", "tokenizer.vocab_size=151936"]) == 0
    out = capsys.readouterr().out
    assert "30,532,122,624" in out and "active" in out and "3,353,032,704" in out
    # 6 x active non-embedding parameters + attention at seq_len 256
    flops = 6 * (3_353_032_704 - 151936 * 2048) + 12 * 48 * 32 * 128 * 256
    assert f"flops/token     {float(flops):.4g}" in out


@pytest.mark.parametrize("override, message", [
    ("model.num_experts_per_tok=9", "model.num_experts_per_tok must be an integer from 1 to model.num_experts (8)"),
    ("model.capacity_factor=0", "model.capacity_factor must be a number > 0"),
    ("model.router_aux_loss_coef=-1", "model.router_aux_loss_coef must be a finite number >= 0"),
    ("model.router_bias_update_rate=-0.1", "model.router_bias_update_rate must be a finite number >= 0"),
    ("model.mlp_only_layers=[7]", "model.mlp_only_layers must be a list of layer indices from 0 to 3"),
    ("strategy.tp=3 trainer.devices=3 strategy.name=fsdp2", "strategy.tp=3 must divide model.n_heads (8)"),
    # issue 50.6: no layer with experts, and a capacity that leaves less than a token per expert
    ("model.decoder_sparse_step=5", "model.decoder_sparse_step=5 is larger than the 4 layers"),
    ("model.mlp_only_layers=[0,1,2,3] strategy.ep=2 strategy.name=fsdp2 trainer.devices=2",
     "model.mlp_only_layers=[0, 1, 2, 3] makes every layer that model.decoder_sparse_step=1 would "
     "give experts dense"),
    # a micro-batch of 8 x 256 tokens, top-2 of 8 experts: 0.001 x 2048 x 2 / 8 = 0.512
    ("model.capacity_factor=0.001", "model.capacity_factor=0.001 leaves 0.512 tokens per expert in a "
     "forward of 2,048 tokens"),
    ("model.num_experts=" + "9" * 40, "model.num_experts is a 40-digit number: llmforge builds at most 16,777,216"),
])
def test_bad_moe_keys_exit_2_naming_the_key(tmp_path, capsys, override, message):
    code = main(["train", MOE_DEMO, "--dry-run", *override.split(), f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_ep_on_a_spec_with_experts_but_none_built_says_the_layers_are_dense():
    from llmforge.parallel.expert import check_expert_parallel

    with pytest.raises(ConfigError, match=r"strategy.ep=2: model 'mine' has no expert layers \(this "
                                          r"configuration of it has none: every layer is dense"):
        check_expert_parallel([], 2, "mine", declared=True)
    with pytest.raises(ConfigError, match=r"its ModelSpec declares no experts\); use strategy.ep=1"):
        check_expert_parallel([], 2, "llama3")


def test_aux_losses_through_the_events_in_process():
    """One micro-batch: the optimized loss and its gradients are those of cross-entropy + the
    model's aux terms (transformers' loss + coef x aux_loss); evaluation's loss is the pure
    cross-entropy; a BEFORE_LOSS handler sees state.aux_losses."""
    torch.manual_seed(0)
    module = moe_module(router_aux_loss_coef=0.3, router_z_loss_coef=0.01)
    batch = torch.randint(0, 50, (2, 9))
    seen = {}

    class Peek:
        name = "peek"

        def before_loss(self, state):
            seen.update({k: v.item() for k, v in state.aux_losses.items()})

    module.setup_events([Peek()])
    loss_sum, n = module.forward_backward(batch)
    got = {k: p.grad.clone() for k, p in module.model.named_parameters()}
    module.model.zero_grad()
    logits = module.model(batch[:, :-1])
    aux = module.model.aux_losses()
    ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    ref = ce + aux["load_balancing"] + aux["router_z"]
    ref.backward()
    # E sum_e f_e P_e is k = 2 for a balanced router and near it for a random one
    assert set(seen) == {"load_balancing", "router_z"} and 0.3 * 1.5 < seen["load_balancing"] < 0.3 * 4
    assert abs(loss_sum.item() / n.item() - ref.item()) < 1e-6
    for k, p in module.model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, atol=1e-6, rtol=1e-5)
    assert got["layers.0.feed_forward.router.weight"].abs().sum() > 0
    metrics = module.step.aux_step_metrics(n.float())
    assert metrics["train/aux_loss"].item() == pytest.approx(seen["load_balancing"] + seen["router_z"], abs=1e-6)

    module.state.training = False  # evaluation: no auxiliary term in the loss
    with torch.no_grad():
        ev = module.step.micro_batch_loss(0, batch[:, :-1], batch[:, 1:], None)
    assert abs(ev.item() / n.item() - ce.item()) < 1e-6


def _records(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_ep2_from_hf_equals_one_process_and_resumes_after_sigkill(tmp_path):
    """`model.init_from: hf:PATH` into expert-parallel experts (FSDP2 x ep=2 on 2 gloo processes:
    each reads only its 2 of the 4 experts per projection), 6 steps with loss-free balancing on
    (its bias starts at 0: HF has none): the auxiliary terms and the expert load reach the
    metrics file and equal one process's within 1e-5. The ep=2 run saves at step 3 and is
    SIGKILLed at the start of step 6; `checkpoint.resume=auto` at ep=2 recomputes steps 4-5
    bit-identically (losses, auxiliary terms, gradient norm, expert load: the balancing bias and
    the sharded optimizer state come back whole); its step-3 checkpoint resumed at ep=1 in one
    process trains steps 4-6 within 1e-5 of the ep=2 run."""
    from conftest import run_cli
    from test_parallel import COMMON

    tiny_hf(tmp_path / "hf", norm_topk=True, vocab=1024)
    common = [o for o in COMMON if not o.startswith("model.")] + [
        f"model.init_from=hf:{tmp_path / 'hf'}", f"run.output_dir={tmp_path}", "model.router_z_loss_coef=0.001",
        "model.router_bias_update_rate=0.01",  # loss-free balancing too: its bias alike on 1 and 2
        "trainer.max_steps=6", "checkpoint.save_every=3"]
    assert main(["train", MOE_DEMO, *common, "run.name=one"]) == 0
    ep2 = ["train", MOE_DEMO, *common, "run.name=two", "strategy.name=fsdp2", "strategy.ep=2", "--nproc", "2"]
    kill = "callbacks=[{name: tests.helpers.killers.KillAt, step: 6, sig: SIGKILL}]"
    killed = run_cli(*ep2, kill, cwd=REPO, timeout=900)
    assert killed.returncode != 0, killed.stderr[-4000:]
    uninterrupted = _records(tmp_path / "two")
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5]
    proc = run_cli(*ep2, "checkpoint.resume=auto", cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    keys = ("train/loss", "train/aux_loss", "train/aux/router_z", "train/grad_norm",
            "moe/load_max_mean/layer_0", "moe/load_max_mean/layer_1")
    for step in (4, 5):  # recomputed after the SIGKILL: bit-identical
        assert [two[step][k] for k in keys] == [uninterrupted[step][k] for k in keys], step
    for r in one.values():  # the auxiliary terms and expert load are logged
        assert r["train/aux_loss"] == pytest.approx(r["train/aux/load_balancing"] + r["train/aux/router_z"], abs=1e-6)
        assert r["train/aux/router_z"] > 0 and r["moe/dropped_fraction"] == 0.0
        assert 1.0 <= r["moe/load_max_mean/layer_0"] <= 4.0
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    assert 0.1 * 1.5 < one[1]["train/aux_loss"] < 0.1 * 4  # 0.1 x (E sum f P, k = 2 if balanced)
    for step in one:
        assert [two[step][k] for k in keys] == [pytest.approx(one[step][k], abs=1e-5) for k in keys], step
    # the ep=2 checkpoint of step 3 resumed by one process at ep=1
    import shutil

    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step_00000006")
    assert main(["train", MOE_DEMO, *common, "run.name=two", "checkpoint.resume=auto"]) == 0
    ep1 = _records(tmp_path / "two")
    assert sorted(ep1) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert [ep1[step][k] for k in keys] == [pytest.approx(two[step][k], abs=1e-5) for k in keys], step
    from omegaconf import OmegaConf

    model = OmegaConf.load(tmp_path / "one" / "config.yaml").model
    assert model.router_aux_loss_coef == 0.1 and model.num_experts == 4  # the YAML's weight, HF's shape
    # the routing bias has no place in Qwen3MoeForCausalLM: the export says so, writes nothing
    assert main(["convert", "to-hf", str(tmp_path / "one"), str(tmp_path / "hf_out")]) == 2
    assert not (tmp_path / "hf_out").exists()


def test_lora_on_experts_exports_to_peft_with_equal_logits(tmp_path):
    """LoRA on attention (wq, wv) and the experts (w1 w2 w3: one adapter pair per expert, stacked
    on dim 0 like the experts) of a tiny Qwen3-MoE from HF: B = 0 gives the base logits; only
    adapters get gradients; with random B the PEFT folder (expert adapters as
    `target_parameters`, gate and up fused into gate_up_proj at rank 2r) loaded by PeftModel on
    transformers' Qwen3MoeForCausalLM gives our logits within 1e-5, and so does the merged
    model. A dense layer's w1 (gate_proj, which PEFT reads as the experts' in a qwen3_moe
    model) is refused with a ConfigError (exit 2 in `convert`)."""
    peft = pytest.importorskip("peft")
    from omegaconf import OmegaConf
    from safetensors import safe_open

    from llmforge.algorithms.lora import LoRA, merge_lora
    from llmforge.algorithms.lora.peft import save_peft
    from llmforge.checkpoint.hf import load_hf_weights, model_overrides_from_hf, read_hf_config
    from llmforge.config.schema import TrainConfig, model_config_class
    from llmforge.errors import ConfigError
    from llmforge.models.qwen3_moe.hf import Qwen3MoeHFAdapter
    from llmforge.parallel.init import seeded_init
    from llmforge.plugin import build_meta_model

    entry = {"rank": 2, "alpha": 6, "targets": ["wq", "wv", "w1", "w2", "w3"], "base_dtype": "float32"}

    def ours_from(path):
        cfg = OmegaConf.structured(TrainConfig)
        cfg.model = OmegaConf.merge(OmegaConf.structured(model_config_class("qwen3_moe")),
                                    model_overrides_from_hf(read_hf_config(path)))
        model = LoRA(**entry).convert(build_meta_model(cfg), 0)
        model.to_empty(device="cpu")
        seeded_init(model, 0)
        load_hf_weights(model, path)
        return model

    tiny_hf(tmp_path / "dense0", norm_topk=True, sparse_step=2)  # layer 0 dense, layer 1 experts
    mixed = ours_from(tmp_path / "dense0")
    assert mixed.layers[0].feed_forward.w1.lora_A.weight.shape == (2, 32)  # the dense layer's Linear
    with pytest.raises(ConfigError, match=r"layers.0.feed_forward.w1 \(gate_proj\) cannot be exported to PEFT"):
        save_peft(mixed, tmp_path / "refused", LoRA(**entry).options(), adapter=Qwen3MoeHFAdapter())
    assert not (tmp_path / "refused").exists()
    hf = tiny_hf(tmp_path / "hf", norm_topk=True)
    ours = ours_from(tmp_path / "hf")
    experts = ours.layers[1].feed_forward.experts
    assert experts.lora_A["w1"].shape == (4, 2, 32) and experts.lora_B["w2"].shape == (4, 32, 2)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = hf(tokens).logits
    torch.testing.assert_close(ours(tokens), base, atol=1e-5, rtol=0)  # B = 0: the base model
    ours(tokens).sum().backward()
    assert experts.w1.grad is None and experts.lora_A["w1"].grad is not None
    assert experts.lora_B["w3"].grad.abs().sum() > 0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        want = ours(tokens)
    assert (want - base).abs().max() > 1e-3
    out = save_peft(ours, tmp_path / "adapters", LoRA(**entry).options(), base=str(tmp_path / "hf"),
                    adapter=Qwen3MoeHFAdapter())
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert conf["rank_pattern"] == {"gate_up_proj": 4} and conf["alpha_pattern"] == {"gate_up_proj": 12}
    assert sorted(conf["target_modules"]) == ["q_proj", "v_proj"]
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    layer1 = "base_model.model.model.layers.1.mlp.experts."
    assert shapes[layer1 + "base_layer.lora_A.weight"] == (4 * 4, 32)  # gate_up: E x 2r rows
    assert shapes[layer1 + "lora_B.weight"] == (32, 2 * 4)  # down_proj: [D, r x E]
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, str(out)).eval()(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(merge_lora(ours)(tokens), want, atol=1e-5, rtol=0)
    assert not hasattr(experts, "lora_A") and type(experts).__name__ == "GroupedExperts"


def test_lora_dropout_on_experts_exits_2(capsys):
    assert main(["train", MOE_DEMO, "--dry-run", "model.preset=debug",
                 "algorithms=[{name: lora, dropout: 0.1, targets: [wq, w1]}]"]) == 2
    err = capsys.readouterr().err
    assert ("lora.dropout=0.1 must be 0 when lora.targets entry 'w1' names expert weights" in err
            and "Traceback" not in err)

