"""LoRA: only adapters train and the base stays bit-identical; merge keeps the logits (rank !=
alpha); adapters exported to PEFT's format load with ``peft`` onto ``transformers``' Llama with
the same logits; adapter-only checkpoints resume exactly; FSDP2 on 2 processes (with compile and
activation checkpointing) trains like one process; the dry run sizes 405B LoRA; bad input is a
one-line error."""

import json
from pathlib import Path

import pytest
import torch

from algo_harness import batches, make_cfg, make_module
from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli

from llmforge.algorithms.lora import LoRA, init_adapters, is_adapter_key, merge_lora
from llmforge.errors import ConfigError

transformers = pytest.importorskip("transformers")

ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
LORA = {"name": "lora", "rank": 4, "alpha": 12, "targets": ALL, "base_dtype": "float32"}
COMMON = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
          "trainer.log_every=1", "trainer.eval_every=0", "data.val_fraction=0",
          "data.max_documents=2", "optimizer.lr=1e-2", "optimizer.weight_decay=0.1",
          "scheduler.warmup_steps=1"]
LORA_CLI = "algorithms=[{name: lora, rank: 4, alpha: 12, dropout: 0.1, targets: [wq, wk, wv, wo, w1, w2, w3], base_dtype: float32}]"


def randomize_b(model, seed=0):
    """Non-zero B (as after training), so merged and unmerged differ from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


# ------------------------------------------------------------------------ in-process
def test_only_adapters_train_and_base_is_bit_identical():
    from llmforge.training.optim import build_optimizer

    module = make_module([{**LORA, "dropout": 0.1}])
    model = module.model
    base = {k: v.clone() for k, v in model.state_dict().items() if not is_adapter_key(k)}
    adapters = {k: v.clone() for k, v in model.state_dict().items() if is_adapter_key(k)}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 layers in 2 blocks
    # the optimizer holds exactly the adapters (weight decay 0.1 would move a frozen base)
    module.cfg.optimizer.weight_decay = 0.1
    module.cfg.optimizer.lr = 1e-2
    opt = build_optimizer(model, module.cfg.optimizer)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert in_opt == {id(p) for k, p in named.items() if is_adapter_key(k)}
    assert all(not p.requires_grad for k, p in named.items() if not is_adapter_key(k))
    losses = []
    for batch in batches(1, module.cfg.trainer.seq_len) * 5:  # the same batch: the loss must fall
        loss_sum, n = module.forward_backward(batch)
        assert all(p.grad is None for k, p in named.items() if not is_adapter_key(k))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss_sum / n).item())
    after = model.state_dict()
    for k, v in base.items():
        assert torch.equal(after[k], v), k
    for k, v in adapters.items():
        assert not torch.equal(after[k], v), k  # every adapter moved (B from zero)
    assert losses[-1] < losses[0]


def test_init_is_the_base_model_and_adapters_follow_the_paper():
    plain = make_module([]).model
    lora = make_module([LORA]).model
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(tokens), lora(tokens))  # B = 0: same function, same base init
    wq = lora.layers[0].attention.wq
    bound = 1 / 64 ** 0.5  # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
    a = wq.lora_A.weight
    assert a.shape == (4, 64) and wq.lora_B.weight.shape == (64, 4)
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert torch.count_nonzero(wq.lora_B.weight) == 0
    assert wq.lora_scaling == 3.0
    again = make_module([LORA]).model  # deterministic from run.seed and the module name
    assert torch.equal(again.layers[1].feed_forward.w2.lora_A.weight,
                       lora.layers[1].feed_forward.w2.lora_A.weight)
    assert not torch.equal(lora.layers[1].feed_forward.w2.lora_A.weight[:, :4],
                           lora.layers[1].attention.wq.lora_A.weight[:, :4])


def test_merged_and_unmerged_logits_agree():
    model = make_module([{**LORA, "rank": 3, "alpha": 7}]).model.eval()
    randomize_b(model)
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        unmerged = model(tokens)
        plain = make_module([]).model.eval()(tokens)
        assert (unmerged - plain).abs().max() > 1e-3  # the adapters matter
        merged = merge_lora(model)(tokens)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    assert type(model.layers[0].attention.wq) is torch.nn.Linear
    assert not any(is_adapter_key(k) for k in model.state_dict())


def test_bf16_base_and_float8_composition():
    module = make_module([{"name": "lora", "rank": 4, "alpha": 8, "base_dtype": "bfloat16"},
                          {"name": "float8", "emulate": True}])
    wq = module.model.layers[0].attention.wq
    assert type(wq).__name__ == "LoRAFloat8Linear"  # float8 first, LoRA on top, any YAML order
    assert wq.weight.dtype == torch.bfloat16 and wq.lora_A.weight.dtype == torch.float32
    assert module.model.tok_embeddings.weight.dtype == torch.bfloat16
    loss_sum, n = module.forward_backward(batches(1, module.cfg.trainer.seq_len)[0])
    assert torch.isfinite(loss_sum) and wq.lora_B.weight.grad is not None and wq.weight.grad is None


def test_bad_settings_are_config_errors():
    from llmforge.algorithms.loading import available, build_algorithms

    assert any(name == "lora" and stage == "convert" for name, stage, _ in available())

    with pytest.raises(ConfigError, match=r"lora.targets entry 'q_proj' matches no Linear layer.*wq"):
        build_algorithms(make_cfg([{**LORA, "targets": ["wq", "q_proj"]}]))
    with pytest.raises(ConfigError, match="lora.rank"):
        LoRA(rank=0)
    with pytest.raises(ConfigError, match="lora.base_dtype"):
        LoRA(base_dtype="int8")
    cfg = make_cfg([LORA])
    cfg.strategy.tp = 2
    with pytest.raises(ConfigError, match="strategy.tp=2"):
        build_algorithms(cfg)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        build_algorithms(make_cfg([{**LORA, "targets": ["output"]}], tie_embeddings=True))
    proc = run_cli("train", DEMO, "algorithms=[{name: lora, targets: [nope]}]", "--dry-run")
    assert proc.returncode == 2 and "lora.targets entry 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------ PEFT export
def tiny_hf(path: Path, vocab: int = 1024):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
        rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def lora_from_hf(path: Path, entry: dict):
    """Our Llama with the HF weights and LoRA adapters (random B), unsharded, fp32."""
    from omegaconf import OmegaConf

    from llmforge.checkpoint.hf import load_hf_weights, model_overrides_from_hf, read_hf_config
    from llmforge.config.schema import TrainConfig
    from llmforge.parallel.init import seeded_init
    from llmforge.plugin import build_meta_model

    cfg = OmegaConf.structured(TrainConfig)
    for k, v in model_overrides_from_hf(read_hf_config(path)).items():
        cfg.model[k] = v
    model = LoRA(**entry).convert(build_meta_model(cfg), 0)
    model.to_empty(device="cpu")
    seeded_init(model, 0)
    load_hf_weights(model, path)
    randomize_b(model)
    return model.eval()


def test_peft_export_loads_with_peft_and_gives_equal_logits(tmp_path):
    peft = pytest.importorskip("peft")
    from llmforge.algorithms.lora.peft import save_peft

    entry = {"rank": 4, "alpha": 12, "targets": ALL + ["output"], "base_dtype": "float32"}
    hf_path = tmp_path / "hf"
    hf = tiny_hf(hf_path)
    ours = lora_from_hf(hf_path, entry)
    out = save_peft(ours, tmp_path / "adapters", LoRA(**entry).options(), base=str(hf_path))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 12
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj", "lm_head"])
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in keys
    assert "base_model.model.lm_head.lora_A.weight" in keys and len(keys) == 2 * 15
    tokens = torch.randint(0, 1024, (2, 20))
    with torch.no_grad():
        base_logits = hf(tokens).logits
        wrapped = peft.PeftModel.from_pretrained(hf, str(out)).eval()
        got = wrapped(tokens).logits
        want = ours(tokens)
    assert (want - base_logits).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------ CLI runs
def cli_train(out: Path, name: str, *extra: str, nproc: int = 1):
    args = ["train", DEMO, *COMMON, f"run.output_dir={out}", f"run.name={name}", *extra]
    if nproc > 1:
        args += ["--nproc", str(nproc), "strategy.name=fsdp2"]
    proc = run_cli(*args, cwd=out, timeout=900)
    assert proc.returncode == 0, (name, proc.stderr[-4000:])
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """A tiny HF Llama; LoRA (dropout 0.1) on it 4 steps straight, and killed at step 3 then
    resumed from the step-2 adapter-only checkpoint."""
    out = tmp_path_factory.mktemp("lora")
    hf = tiny_hf(out / "hf")
    base = [LORA_CLI, f"model.init_from=hf:{out / 'hf'}", "checkpoint.save_every=2"]
    cli_train(out, "straight", *base, "trainer.max_steps=4")
    kill = "callbacks=[{name: tests.helpers.killers.KillAt, step: 3, sig: SIGKILL}]"
    killed = run_cli("train", DEMO, *COMMON, *base, "trainer.max_steps=4", kill,
                     f"run.output_dir={out}", "run.name=resumed", cwd=out, timeout=900)
    assert killed.returncode == -9, killed.stderr[-3000:]  # killed after the step-2 checkpoint
    cli_train(out, "resumed", *base, "trainer.max_steps=4", "checkpoint.resume=auto")
    return out, hf


@pytest.mark.slow
def test_cli_checkpoint_holds_adapters_and_the_base_pointer(hf_runs):
    from llmforge.checkpoint.tools import tensor_entries
    from llmforge.checkpoint.run_dir import load_model

    out, hf = hf_runs
    ckpt = out / "straight" / "checkpoints" / "step_00000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["adapters_only"] and meta["base"]["init_from"] == f"hf:{out / 'hf'}"
    assert meta["adapters_by"] == ["lora"]
    assert meta["plugins"]["lora"]["rank"] == 4 and meta["plugins"]["lora"]["targets"] == ALL
    keys = [k for k in tensor_entries(ckpt) if k.startswith("model.")]
    assert len(keys) == 28 and all(is_adapter_key(k) for k in keys)
    # the base rebuilt from the pointer is the HF model bit for bit; every adapter trained
    model, _, _ = load_model(out / "straight")
    ref = lora_from_hf(out / "hf", {"rank": 4, "alpha": 12, "targets": ALL, "base_dtype": "float32"})
    init_adapters(ref, 1234)
    got, want = model.state_dict(), ref.state_dict()
    for k in want:
        if is_adapter_key(k):
            assert not torch.equal(got[k], want[k]), k
        else:
            assert torch.equal(got[k], want[k]), k
    # init_from on an adapter-only checkpoint explains itself
    proc = run_cli("train", DEMO, *COMMON, f"model.init_from={ckpt}", f"run.output_dir={out}",
                   "run.name=bad", "trainer.max_steps=2")
    assert proc.returncode == 2 and "holds only the adapters of lora" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # resuming needs the same base (here: a random init instead of the HF weights)
    # (allow_config_changes: the generic resume check would refuse first; the plugin's checks
    # refuse even when the user allows changed settings)
    other = run_cli("train", DEMO, *COMMON, LORA_CLI, "trainer.max_steps=6", "checkpoint.allow_config_changes=true",
                    f"checkpoint.resume={ckpt}", f"run.output_dir={out}", "run.name=other_base")
    assert other.returncode == 2 and "trained on the base 'weights of hf:" in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr
    # resuming with other lora settings is refused, and the refused run keeps its config.yaml
    import shutil

    shutil.copytree(out / "straight", out / "changed")
    before = (out / "changed" / "config.yaml").read_text()
    base = [f"model.init_from=hf:{out / 'hf'}", "trainer.max_steps=6", "checkpoint.resume=auto",
            "checkpoint.allow_config_changes=true", f"run.output_dir={out}", "run.name=changed"]
    for lora, words in [(LORA_CLI.replace("alpha: 12", "alpha: 99"), "saved with alpha=12.0; this run has alpha=99.0"),
                        (LORA_CLI.replace("rank: 4", "rank: 8"), "saved with rank=4; this run has rank=8"),
                        ("algorithms=[]", "holds only the adapters of lora")]:
        proc = run_cli("train", DEMO, *COMMON, lora, *base)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert (out / "changed" / "config.yaml").read_text() == before


@pytest.mark.slow
def test_cli_resume_from_adapter_checkpoint_is_exact(hf_runs):
    from llmforge.checkpoint.run_dir import load_model

    out, _ = hf_runs
    a, b = losses(out / "straight"), losses(out / "resumed")
    assert sorted(b) == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        assert a[s] == b[s], (s, a[s], b[s])
    wa, wb = load_model(out / "straight")[0].state_dict(), load_model(out / "resumed")[0].state_dict()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow
def test_cli_export_merged_and_peft(hf_runs, tmp_path):
    peft = pytest.importorskip("peft")
    from llmforge.checkpoint.run_dir import load_model

    out, hf = hf_runs
    merged = run_cli("convert", "to-hf", str(out / "straight"), str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-2000:]
    adapters = run_cli("convert", "to-hf", str(out / "straight"), str(tmp_path / "peft"), "--adapters-only")
    assert adapters.returncode == 0, adapters.stderr[-2000:]
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(out / "hf")
    tokens = torch.randint(0, 1024, (2, 20))
    with torch.no_grad():
        ours = load_model(out / "straight")[0](tokens)
        back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
        wrapped = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()(tokens).logits
    torch.testing.assert_close(back, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(wrapped, ours, atol=1e-5, rtol=0)
    plain = run_cli("convert", "to-hf", str(out / "hf"), str(tmp_path / "x"), "--adapters-only")
    assert plain.returncode != 0 and "Traceback" not in plain.stderr


@pytest.mark.slow
def test_fsdp2_two_processes_with_compile_and_checkpointing(tmp_path):
    """Random-init base (pointer: the seed), FSDP2 over 2 gloo processes with per-block compile
    and activation checkpointing: the same losses and adapters as one eager process."""
    from llmforge.checkpoint.tools import tensor_entries
    from llmforge.checkpoint.run_dir import load_model

    steps = ["trainer.max_steps=3"]
    cli_train(tmp_path, "one", LORA_CLI.replace("dropout: 0.1", "dropout: 0.0"), *steps)
    algos = ("algorithms=[{name: lora, rank: 4, alpha: 12, targets: [wq, wk, wv, wo, w1, w2, w3], "
             "base_dtype: float32}, {name: compile}, {name: activation_checkpointing}]")
    proc = cli_train(tmp_path, "two", algos, *steps, nproc=2)
    assert "lora: 14 Linear layers with rank-4 adapters" in proc.stdout
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert list(two.values()) == pytest.approx(list(one.values()), abs=1e-5)
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000003"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["base"] == {
        "init_from": None, "seed": 1234, "description": "random init of model 'llama3' with run.seed=1234"}
    assert all(is_adapter_key(k) for k in tensor_entries(ckpt) if k.startswith("model."))
    wa, wb = load_model(tmp_path / "one")[0].state_dict(), load_model(tmp_path / "two")[0].state_dict()
    for k in wa:
        if is_adapter_key(k):  # AdamW amplifies reduction-order noise in tiny early gradients;
            # PLATFORM.md's fp32 parameter tolerance (measured max here: 1.3e-5)
            torch.testing.assert_close(wb[k], wa[k], atol=1e-4, rtol=0, msg=k)
        else:  # the base is rebuilt from the seed: bit-identical
            assert torch.equal(wb[k], wa[k]), k


@pytest.mark.slow
def test_fsdp2_float8_all_gather_on_a_bf16_base(tmp_path):
    """float8 converts the frozen bf16 base (FP8 all-gather, emulated on the CPU), LoRA adds
    fp32 adapters on top: 2 processes train like 1 within the FP8 tolerance of PLATFORM.md."""
    from llmforge.checkpoint.run_dir import load_model

    algos = ("algorithms=[{name: lora, rank: 4, alpha: 8, base_dtype: bfloat16}, "
             "{name: float8, emulate: true%s}]")
    cli_train(tmp_path, "one", algos % "", "trainer.max_steps=3")
    proc = cli_train(tmp_path, "two", algos % ", enable_fsdp_float8_all_gather: true",
                     "trainer.max_steps=3", nproc=2)
    assert "FP8 all-gather" in proc.stdout and "base in bfloat16" in proc.stdout
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert list(two.values()) == pytest.approx(list(one.values()), abs=1e-3)
    model = load_model(tmp_path / "two")[0]  # adapters onto the rebuilt base, without torchao
    assert model.layers[0].attention.wq.weight.dtype == torch.bfloat16
    assert torch.count_nonzero(model.layers[0].attention.wq.lora_B.weight) > 0


# ------------------------------------------------------------------------ dry run
def test_dry_run_405b_lora_fits_192_not_80():
    y = str(REPO / "yamls" / "llama3_405b_lora.yaml")
    proc = run_cli("train", y, "--dry-run")  # without the HF folder: the preset's shape
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "trainable       101.15M" in out and "frozen          405.85B" in out
    assert "base 94.50 GiB (sharded 8x)" in out  # 405.85B x 2 bytes / 8
    assert "device memory   does NOT fit in 80 GiB" in out
    assert "device memory   fits in 192 GiB" in out
    assert "pipeline        build (meta) -> lora -> activation_checkpointing -> compile -> fsdp2" in out
    offload = run_cli("train", y, "--dry-run", "--device-memory-gib", "80", "strategy.cpu_offload=true")
    assert "base 0.00 GiB (on the CPU" in offload.stdout
    assert "device memory   fits in 80 GiB" in offload.stdout
    assert "192 GiB" not in offload.stdout
    eight = run_cli("train", str(REPO / "yamls" / "llama3_8b_lora.yaml"), "--dry-run",
                    "--device-memory-gib", "40")
    assert eight.returncode == 0 and "device memory   fits in 40 GiB" in eight.stdout
    assert "trainable       41.94M" in eight.stdout
