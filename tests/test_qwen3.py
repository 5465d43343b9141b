"""Qwen3 against transformers' Qwen3ForCausalLM (tiny random models built locally, no download):
`convert from-hf` gives the same logits, `convert to-hf` writes the same tensors bit for bit and
transformers loads them back; `model.init_from: hf:PATH` fine-tunes; the presets have
transformers' parameter counts; its YAML keys are checked like every other key."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import REPO, TINY_OVERRIDES  # noqa: E402
from llmforge.cli import main  # noqa: E402
from helpers.hf_files import safetensors_of  # noqa: E402

QWEN_DEMO = str(REPO / "yamls" / "demo_cpu_qwen3.yaml")
# TINY_OVERRIDES without Llama's shape keys, plus a tiny Qwen3 (head dim decoupled: 4 x 32 != 48)
QWEN_TINY = [o for o in TINY_OVERRIDES if not o.startswith("model.")] + [
    "model.dim=48", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.head_dim=32", "model.hidden_dim=96"]


def tiny_hf(path, tie: bool, n_kv: int, vocab: int = 128, seed: int = 0):
    cfg = transformers.Qwen3Config(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv, head_dim=32, vocab_size=vocab, max_position_embeddings=128,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to ones; random QK-norm weights test their mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tie, n_kv", [(True, 1), (False, 2), (True, 2), (False, 1)])
def test_convert_round_trip_matches_transformers(tmp_path, tie, n_kv):
    from llmforge.checkpoint.run_dir import load_model

    hf = tiny_hf(tmp_path / "hf", tie, n_kv)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours, cfg, _ = load_model(tmp_path / "run")
    assert cfg.model.name == "qwen3" and cfg.model.head_dim == 32
    with torch.no_grad():
        ref = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), ref, atol=1e-5, rtol=0)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie

    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    theirs, mine = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "back")
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # bit-exact
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref, atol=1e-5, rtol=0)


def test_preset_parameter_counts_equal_transformers():
    from omegaconf import OmegaConf

    from llmforge.models import QWEN3

    counts = {}
    for name, a in QWEN3.presets.items():
        with torch.device("meta"):
            ours = QWEN3(OmegaConf.structured(QWEN3.config_cls(preset=name)))
            theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
                num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, intermediate_size=a.hidden_dim,
                vocab_size=a.vocab_size, tie_word_embeddings=a.tie_embeddings))
        counts[name] = ours.num_params()
        assert counts[name] == sum(p.numel() for p in theirs.parameters()), name
    assert counts["qwen3_0_6b"] == 596_049_920 and counts["qwen3_8b"] == 8_190_735_360


def test_dry_run_prints_the_published_counts(capsys):
    assert main(["train", str(REPO / "yamls" / "qwen3_0_6b_sft.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "parameters      596.05M (596,049,920)" in out and "qwen3 (preset qwen3_0_6b)" in out
    assert main(["train", QWEN_DEMO, "model.preset=qwen3_8b", "model.vocab_size=151936",
                 "model.max_seq_len=40960", "--dry-run"]) == 0
    assert "(8,190,735,360)" in capsys.readouterr().out


@pytest.mark.parametrize("override, message", [
    ("model.multiple_of=32", "unknown key 'model.multiple_of'"),  # a Llama key under qwen3
    ("model.head_dm=64", "did you mean 'model.head_dim'"),
    ("model.head_dim=wide", "model.head_dim: expected an integer"),
    ("model.preset=qwen3_7b", "unknown qwen3 preset 'qwen3_7b'"),
    # the SwiGLU's width splits over tp: 8193 did not, and torch's sharding propagation failed
    ("model.hidden_dim=8193 strategy.tp=2 trainer.devices=2",
     "strategy.tp=2 must divide the feed-forward hidden width 8193 (set by model.hidden_dim, or by intermediate_size"),
])
def test_qwen3_keys_are_checked(tmp_path, capsys, override, message):
    code = main(["train", QWEN_DEMO, *override.split(), f"run.output_dir={tmp_path}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_init_from_another_family_names_the_model_to_set(tmp_path, capsys):
    tiny_hf(tmp_path / "hf", True, 2)
    code = main(["train", str(REPO / "yamls" / "demo_cpu.yaml"), f"model.init_from=hf:{tmp_path / 'hf'}",
                 f"run.output_dir={tmp_path}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "'qwen3' model" in err and "set model.name: qwen3" in err, err


@pytest.mark.slow
def test_init_from_hf_fine_tunes_and_exports_token_ids(tmp_path):
    """With a ~0 learning rate the fine-tuned model still gives the HF model's logits (the
    weights were loaded), and the export carries the tokenizer's bos/eos ids and a
    generation_config.json that transformers reads."""
    hf = tiny_hf(tmp_path / "hf", True, 2, vocab=1024, seed=3)
    args = ["train", QWEN_DEMO, *QWEN_TINY, "trainer.max_steps=2", "trainer.eval_every=0",
            "optimizer.lr=1e-30", "optimizer.weight_decay=0", "scheduler.warmup_steps=0",
            f"model.init_from=hf:{tmp_path / 'hf'}", f"run.output_dir={tmp_path}", "run.name=ft"]
    assert main(args) == 0
    assert main(["convert", "to-hf", str(tmp_path / "ft"), str(tmp_path / "back")]) == 0
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, 1024, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)

    from llmforge.checkpoint.hf import dtype_key
    from llmforge.data.tokenizers import load_saved

    tok = load_saved(tmp_path / "ft" / "tokenizer")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert config[dtype_key()] == "float32" and dtype_key() == "dtype"  # transformers 5.x
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "back")
    assert (gen.bos_token_id, gen.eos_token_id) == (tok.bos_id, tok.eos_id)


def test_chatml_template_renders_qwen_turns(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from llmforge.data.chat import build_chat_template
    from llmforge.data.tokenizers import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["user assistant system what is two plus two four\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=[
                                "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    template = build_chat_template("chatml", hf)
    chat = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]
    ids, targets = template.tokenize(chat)
    text = "".join(tok.decode([i], skip_special_tokens=False) for i in ids)
    assert text == ("<|im_start|>user\nwhat is two plus two<|im_end|>\n"
                    "<|im_start|>assistant\nfour<|im_end|>\n")
    assert "".join(tok.decode([i], skip_special_tokens=False) for i, t in zip(ids, targets) if t) \
        == "four<|im_end|>"
    assert template.stop_id == tok.token_to_id("<|im_end|>")
    prompt = template.prompt_ids(chat[:1])
    assert "".join(tok.decode([i], skip_special_tokens=False) for i in prompt).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")


def test_lora_adapters_on_qwen3_export_to_peft_and_load_with_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from llmforge.algorithms.lora import LoRA, init_adapters, lora_modules
    from llmforge.algorithms.lora.peft import save_peft
    from llmforge.checkpoint.run_dir import load_model
    from llmforge.models.spec import get_spec

    hf = tiny_hf(tmp_path / "hf", tie=False, n_kv=2)
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours, _, _ = load_model(tmp_path / "run")
    entry = {"rank": 4, "alpha": 8, "targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"],
             "base_dtype": "float32"}
    ours = LoRA(**entry).convert(ours.float(), 0)
    init_adapters(ours, 0)
    with torch.no_grad():  # B = 0 would hide a wrong layout: random B on every adapter
        for _, m in lora_modules(ours):
            m.lora_B.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    out = save_peft(ours.eval(), tmp_path / "adapters", LoRA(**entry).options(),
                    base=str(tmp_path / "hf"), adapter=get_spec("qwen3").adapter())
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = hf(tokens).logits
        want = ours(tokens)
        got = peft.PeftModel.from_pretrained(hf, str(out)).eval()(tokens).logits
    assert (want - base).abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
