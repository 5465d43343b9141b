"""Hugging Face bridge: a tiny random LlamaForCausalLM (built locally, no download) is imported
with the same logits, exported back, and loaded by transformers with the same logits again."""

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")

from helpers.dist import torchrun, worker  # noqa: E402

from llmforge.checkpoint.hf import (  # noqa: E402
    load_hf_weights,
    model_overrides_from_hf,
    read_hf_config,
    save_hf,
)
from llmforge.models.llama3.config import Llama3Config as ModelConfig  # noqa: E402
from llmforge.models.llama3.model import build_llama  # noqa: E402


def tiny_hf(tmp_path, tie: bool, inter: int = 96):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path / f"hf_{tie}_{inter}"
    model.save_pretrained(path)
    return model, path


def ours_from(path):
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model_overrides_from_hf(read_hf_config(path)))
    model = build_llama(cfg)
    model.init_weights()
    load_hf_weights(model, path)
    return model.eval()


@pytest.mark.parametrize("tie, inter", [(False, 96), (True, 96), (False, 200)])
def test_import_then_export_keeps_logits(tmp_path, tie, inter):
    hf, path = tiny_hf(tmp_path, tie, inter)
    tokens = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = ours_from(path)
        got = ours(tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if tie:
        assert ours.output.weight is ours.tok_embeddings.weight

    out = save_hf(ours, tmp_path / "exported")
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref, atol=1e-5, rtol=1e-5)


def test_sharded_index_export_and_import(tmp_path):
    hf, path = tiny_hf(tmp_path, False)
    ours = ours_from(path)
    out = save_hf(ours, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").exists()
    again = ours_from(out)
    tokens = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


def test_convert_cli_round_trip(tmp_path):
    from conftest import run_main

    hf, path = tiny_hf(tmp_path, False)
    proc = run_main("convert", "from-hf", str(path), str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000000" / "COMPLETE").exists()
    proc = run_main("convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=1e-5)
    bad = run_main("convert", "from-hf", str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"error: PATH: {tmp_path / 'nothing' / 'config.json'} not found")

    # --overwrite (issue 47.1): an earlier export is replaced whole, swapped in once complete
    (tmp_path / "back" / "stale.safetensors").write_bytes(b"old shard")
    again = run_main("convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "back"), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "back" / "stale.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp folders
    # ... but never a folder llmforge did not export, even one that looks like an old run
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.yaml").write_text("lr: 0.1\n")
    (foreign / "metrics.jsonl").write_text("{}\n")
    # ... and never the source of a round trip: convert from-hf RUN/hf RUN --overwrite
    (tmp_path / "run" / "hf").mkdir()
    for f in path.iterdir():
        (tmp_path / "run" / "hf" / f.name).write_bytes(f.read_bytes())
    linked = tmp_path / "snapshot"
    linked.mkdir()
    for f in (tmp_path / "run" / "hf").iterdir():
        (linked / f.name).symlink_to(f)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    refused = run_main("convert", "to-hf", str(tmp_path / "run"), str(foreign), "--overwrite")
    assert refused.returncode == 2 and refused.stderr.startswith(
        f"error: OUT: {foreign} is not empty and is not a folder llmforge exported (no .llmforge-export"), refused.stderr
    src = tmp_path / "run" / "hf"
    refused = run_main("convert", "from-hf", str(src), str(tmp_path / "run"), "--overwrite")
    assert refused.returncode == 2 and refused.stderr.startswith(
        f"error: PATH={src} lies inside {(tmp_path / 'run').resolve()} (OUT), which --overwrite would "
        "delete before PATH is read"), refused.stderr
    # ... nor a source whose files link into OUT (a Hugging Face cache snapshot's layout)
    refused = run_main("convert", "from-hf", str(linked), str(tmp_path / "run"), "--overwrite")
    assert refused.returncode == 2 and "lies inside" in refused.stderr, refused.stderr
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_train_from_hf_weights(tmp_path, nproc):
    """model.init_from=hf:PATH loads the weights (rank-locally under FSDP2): with a ~0 learning
    rate the trained model still gives the HF model's logits. One process runs in this process;
    2 processes through `--nproc 2` (the CLI's own launcher)."""
    from conftest import REPO, TINY_OVERRIDES, run_cli, run_main

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                   max_position_embeddings=128, rope_theta=500000.0)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    args = ["train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES, "trainer.max_steps=1",
            "trainer.eval_every=0", "optimizer.lr=1e-30", "optimizer.weight_decay=0",
            "scheduler.warmup_steps=0", "data.max_documents=6", f"model.init_from=hf:{tmp_path / 'hf'}",
            f"run.output_dir={tmp_path}", "run.name=ft"]
    if nproc > 1:
        proc = run_cli(*args, "--nproc", "2", "strategy.name=fsdp2")
    else:
        proc = run_main(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_main("convert", "to-hf", str(tmp_path / "ft"), str(tmp_path / "back"))
    assert out.returncode == 0, out.stderr
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, 1024, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=1e-5)
    if nproc == 1:  # the exported tokenizer adds BOS as llmforge trains, and files are readable
        from llmforge.data.tokenizers import load_saved

        ours = load_saved(tmp_path / "ft" / "tokenizer")
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
        assert theirs("ROMEO.").input_ids == ours.encode("ROMEO.", bos=True)
        assert all(f.stat().st_mode & 0o044 == 0o044 for f in (tmp_path / "back").iterdir())
        again = run_main("convert", "to-hf", str(tmp_path / "ft"), str(tmp_path / "back"))
        assert again.returncode == 2 and "--overwrite" in again.stderr


def test_rank_local_import_keeps_each_process_below_the_checkpoint_size(tmp_path):
    """2 processes (FSDP2) import a ~400 MB fp32 HF checkpoint: each process's anonymous
    memory grows by less than the checkpoint's size (it holds its shard plus one slice at a
    time, never the whole state dict; rank 0 does not build a full model either)."""
    import json

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "dim": 1024, "n_layers": 6, "n_heads": 16, "n_kv_heads": 4, "vocab_size": 16384,
        "multiple_of": 256, "max_seq_len": 64})
    torch.manual_seed(0)
    model = build_llama(cfg)
    model.init_weights()
    want = float(sum(p.detach().double().sum() for p in model.parameters()))
    path = save_hf(model, tmp_path / "hf")
    del model
    ckpt_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert ckpt_bytes > 350 * 2**20
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(worker("hf_import_worker.py"), str(path), str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        r = json.loads((out / f"rank{rank}.json").read_text())
        print(rank, {k: (f"{v / 2**20:.0f} MiB" if k.endswith("bytes") else v) for k, v in r.items()},
              f"checkpoint {ckpt_bytes / 2**20:.0f} MiB")
        assert r["local_param_bytes"] <= 0.55 * ckpt_bytes  # a half shard (+ replicated norms)
        assert r["local_param_bytes"] * 0.9 <= r["growth_bytes"] < 0.8 * ckpt_bytes
        assert r["checksum"] == pytest.approx(want, rel=1e-9)


# keys a hand-written or older config.json may lack; transformers then uses its config class's
# defaults (Qwen3: head_dim 128, rope_theta 10,000; Llama: rms_norm_eps 1e-6), and so must we
ABSENT = ("head_dim", "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps",
          "max_position_embeddings")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_absent_config_keys_take_transformers_defaults(tmp_path, family):
    """A config.json without head_dim, rope_theta, rms_norm_eps...: `convert from-hf` reads the
    installed transformers' defaults, so the logits equal transformers' within 1e-5."""
    import json

    from llmforge.checkpoint.run_dir import load_model
    from llmforge.cli import main

    cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                      "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    hf = model_cls(cls(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)).eval()
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in ABSENT}))
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    ours, cfg, _ = load_model(tmp_path / "run")
    assert cfg.model.rope_theta == 10_000.0 and cfg.model.norm_eps == 1e-6
    if family == "qwen3":
        assert cfg.model.head_dim == 128  # transformers' default, not hidden_size / heads (12)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=0)


def test_from_hf_overwrite_never_marks_a_folder_llmforge_did_not_make(tmp_path, capsys):
    """`convert from-hf HF ~/work --overwrite` wrote into a user's folder and marked it a run, so a
    later `train --overwrite` of that folder deleted the user's files: refused, exit 2, untouched."""
    from llmforge.cli import main

    user = tmp_path / "work"
    user.mkdir()
    (user / "thesis.tex").write_text("precious")
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(user), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: OUT: {user} is not empty and is not an llmforge run"), err
    assert [p.name for p in user.iterdir()] == ["thesis.tex"] and (user / "thesis.tex").read_text() == "precious"


def test_from_hf_overwrite_replaces_a_run_instead_of_mixing_with_it(tmp_path, capsys):
    """`convert from-hf HF RUN --overwrite` onto a trained run left its step_1 beside the new
    step_0, so generate loaded the old checkpoint: the old run is deleted, as train --overwrite does."""
    from llmforge.checkpoint.run_dir import load_model
    from llmforge.cli import main

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128)).eval()
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)  # an older, bigger run's
    (run / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(run), "--overwrite"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000000"]
    assert not (run / "metrics.jsonl").exists()
    ours, _, _ = load_model(run)
    tokens = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=0)
