"""`llmforge convert foundry`: LLM Foundry YAMLs (tests/data/foundry) converted, their values
checked against Composer's formulas, and the outputs trained for a few steps on the CPU."""

import json
import math
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import DEMO, REPO, run_main

FOUNDRY = REPO / "tests" / "data" / "foundry"


def composer_lr(batch: int, *, peak: float, warmup: int, total: int, alpha_f: float, kind: str) -> float:
    """Composer's lr at batch ``batch`` (composer.optim.scheduler: CosineAnnealingWithWarmup /
    LinearWithWarmup / ConstantWithWarmup, t_max = 1dur, scale_warmup false)."""
    if batch < warmup:
        return peak * batch / warmup
    frac = min(1.0, (batch - warmup) / (total - warmup))
    if kind == "cosine":
        return peak * (alpha_f + (1 - alpha_f) * (1 + math.cos(math.pi * frac)) / 2)
    if kind == "linear":
        return peak * (1 + frac * (alpha_f - 1))
    return peak


def _fill(name: str, tmp_path: Path, **values: str) -> Path:
    text = (FOUNDRY / name).read_text()
    for key, value in values.items():
        text = text.replace(key, value)
    path = tmp_path / name
    path.write_text(text)
    return path


def _convert(src: Path, out: Path, *extra: str) -> tuple[dict, str]:
    r = run_main("convert", "foundry", str(src), "-o", str(out), *extra)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(out.read_text()), r.stdout


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A tokenizer folder (tokenizer.json) trained on the MDS test text, as a Hugging Face name
    stands for one."""
    root = tmp_path_factory.mktemp("tok")
    r = run_main("data", "prepare", str(REPO / "tests" / "data" / "mds" / "text"), str(root / "p"),
                 "tokenizer.vocab_size=512", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return root / "p" / "tokenizer"


def test_mpt_pretraining_converts_prepares_and_trains_on_composers_schedule(tmp_path, tokenizer):
    mds = tmp_path / "mds"
    shutil.copytree(REPO / "tests" / "data" / "mds" / "text", mds)
    src = _fill("mpt_pretrain.yaml", tmp_path, MDS_ROOT=str(mds), TOKENIZER=str(tokenizer))
    cfg, report = _convert(src, tmp_path / "out.yaml")
    model, trainer = cfg["model"], cfg["trainer"]
    assert (model["name"], model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"],
            model["vocab_size"], model["tie_embeddings"]) == ("llama3", 64, 2, 4, 4, 512, True)
    # 6144 tokens / (16 sequences x 64 tokens) = 6 steps; 16 / 8 = 2 micro-batches per step
    assert (trainer["max_steps"], trainer["global_batch_size"], trainer["micro_batch_size"],
            trainer["seq_len"], trainer["eval_every"], trainer["gradient_clip_val"]) == (6, 16, 8, 64, 3, 1.0)
    # decoupled_adamw's 6e-5 is not multiplied by lr; torch AdamW's is: 6e-5 / 6e-4
    assert cfg["optimizer"]["weight_decay"] == pytest.approx(0.1)
    assert cfg["scheduler"] == {"name": "cosine", "warmup_steps": 2, "warmup_from_zero": True,
                                "min_lr_ratio": 0.1}
    assert cfg["checkpoint"] == {"dir": "./mpt-tiny/checkpoints", "save_every": 3, "keep_last_n": 1}
    for key in ("model.attn_config.alibi", "model.norm_type", "model.expansion_ratio",
                "callbacks.runtime_estimator", "fsdp_config.limit_all_gathers", "device_eval_batch_size"):
        assert f"  {key}" in report, key
    assert "not a key the converter knows" not in report
    command = next(line for line in report.splitlines() if "llmforge data prepare" in line)
    argv = shlex.split(command.split("prepare the MDS data once: ", 1)[1])
    assert run_main(*argv[1:], "--workers", "1").returncode == 0  # the report's own command

    r = run_main("train", str(tmp_path / "out.yaml"), f"run.output_dir={tmp_path / 'runs'}",
                 "data.num_workers=0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [m for m in _metrics(tmp_path / "runs" / "mpt-tiny") if "train/lr" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    for m in rows:  # metrics step s is Composer's batch s - 1
        want = composer_lr(m["step"] - 1, peak=6e-4, warmup=2, total=6, alpha_f=0.1, kind="cosine")
        assert m["train/lr"] == pytest.approx(want, rel=1e-9, abs=1e-15), m["step"]
    assert (tmp_path / "mpt-tiny" / "checkpoints").is_dir()


def test_llama_finetuning_from_hf_weights_converts_and_trains(tmp_path, tokenizer):
    import torch
    import transformers

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)).save_pretrained(hf_dir)
    shutil.copy(tokenizer / "tokenizer.json", hf_dir / "tokenizer.json")
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(40)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = _fill("llama_finetune.yaml", tmp_path, HF_DIR=str(hf_dir), DATA_DIR=str(data))
    cfg, report = _convert(src, tmp_path / "out.yaml")
    assert cfg["model"] == {"name": "llama3", "init_from": f"hf:{hf_dir}"}
    assert cfg["tokenizer"] == {"type": "huggingface", "path": str(hf_dir / "tokenizer.json")}
    assert cfg["data"] == {"task": "sft", "source": "files", "path": str(data / "train.jsonl"),
                           "packed": True, "train_on_input": False, "num_workers": 0}
    trainer = cfg["trainer"]
    # auto micro-batching -> 1 (reported); 0.25dur of 8ba = 2 warmup steps; eval_interval 1 = 1 epoch
    assert (trainer["max_steps"], trainer["micro_batch_size"], trainer["precision"]) == (8, 1, "bf16-mixed")
    assert cfg["scheduler"]["warmup_steps"] == 2 and cfg["scheduler"]["min_lr_ratio"] == 0.0
    assert cfg["optimizer"]["weight_decay"] == 0.0
    assert cfg["strategy"]["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    assert {"name": "activation_checkpointing", "mode": "full"} in cfg["algorithms"]
    assert cfg["checkpoint"]["resume"] == "auto"
    for key in ("device_train_microbatch_size", "callbacks.hf_checkpointer", "model.use_flash_attention_2",
                "eval_interval"):
        assert f"  {key}" in report, key

    dry = run_main("train", str(tmp_path / "out.yaml"), "--dry-run", cwd=tmp_path)  # as converted
    assert dry.returncode == 0 and "activation_checkpointing" in dry.stdout, dry.stderr
    r = run_main("train", str(tmp_path / "out.yaml"), f"run.output_dir={tmp_path / 'runs'}",
                 "trainer.precision=fp32", "trainer.micro_batch_size=8", "trainer.log_every=1",
                 "algorithms=[]", "trainer.eval_every=0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [m for m in _metrics(tmp_path / "runs" / "llama-ft") if "train/lr" in m]
    assert [m["step"] for m in rows] == list(range(1, 9))
    for m in rows:
        want = composer_lr(m["step"] - 1, peak=1e-5, warmup=2, total=8, alpha_f=0.0, kind="linear")
        assert m["train/lr"] == pytest.approx(want, rel=1e-9, abs=1e-20), m["step"]


def test_every_callback_and_logger_is_mapped_or_reported(tmp_path, tokenizer):
    mds = tmp_path / "mds"
    shutil.copytree(REPO / "tests" / "data" / "mds" / "text", mds)
    src = _fill("monitors.yaml", tmp_path, MDS_ROOT=str(mds), TOKENIZER=str(tokenizer))
    cfg, report = _convert(src, tmp_path / "out.yaml", "--prepared", str(tmp_path / "prep"))
    assert cfg["callbacks"] == [{"name": "speed_monitor", "peak_tflops": 989.0}, {"name": "lr_monitor"},
                                {"name": "memory_monitor"}]
    assert cfg["loggers"] == [
        {"name": "jsonl"},
        {"name": "wandb", "project": "foundry-test", "entity": "lab", "tags": ["a"], "mode": "offline"},
        {"name": "comet", "project": "foundry-test", "workspace": "lab", "mode": "offline"},
        {"name": "mlflow", "experiment": "/Users/me/foundry", "tracking_uri": "./mlruns"},
        {"name": "tensorboard", "dir": "tb"}]
    for key in ("callbacks.runtime_estimator", "callbacks.hf_checkpointer", "algorithms.alibi",
                "algorithms.low_precision_layernorm", "optimizer.name", "precision"):
        assert f"  {key}" in report, key
    # Lion -> AdamW (reported); ConstantWithWarmup(alpha=0.5) folds into the lr; t_warmup 0.5dur of 4
    assert cfg["optimizer"]["lr"] == pytest.approx(5e-5) and cfg["scheduler"]["warmup_steps"] == 2
    assert cfg["model"]["n_kv_heads"] == 2 and cfg["model"]["rope_theta"] == 10000
    assert {"name": "float8"} in cfg["algorithms"] and cfg["trainer"]["gradient_clip_val"] is None
    command = next(line for line in report.splitlines() if "llmforge data prepare" in line)
    assert run_main(*shlex.split(command.split("once: ", 1)[1])[1:], "--workers", "1").returncode == 0
    r = run_main("train", str(tmp_path / "out.yaml"), f"run.output_dir={tmp_path / 'runs'}",
                 "trainer.precision=fp32", "algorithms=[]", "trainer.eval_every=0", "run.name=mon", "trainer.log_every=1",
                 "loggers=[{name: jsonl}, {name: tensorboard, dir: tb}, {name: wandb, mode: offline}]",
                 cwd=tmp_path, env={"WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr
    rows = [m for m in _metrics(tmp_path / "runs" / "mon") if "train/lr" in m]
    assert [m["train/lr"] for m in rows] == pytest.approx([0.0, 2.5e-5, 5e-5, 5e-5])
    assert any((tmp_path / "runs" / "mon" / "tb").iterdir())


def test_qwen3_checkpoint_and_epochs_with_steps_per_epoch(tmp_path):
    hf = tmp_path / "qwen"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    data = yaml.safe_load((FOUNDRY / "llama_finetune.yaml").read_text())
    data["variables"]["model_name_or_path"] = str(hf)
    data["max_duration"], data["eval_interval"], data["callbacks"] = "2ep", "500sp", ["not", "a", "mapping"]
    (tmp_path / "in.yaml").write_text(yaml.safe_dump(data))
    cfg, report = _convert(tmp_path / "in.yaml", tmp_path / "out.yaml", "--steps-per-epoch", "5")
    assert cfg["model"] == {"name": "qwen3", "init_from": f"hf:{hf}"}
    # 2 epochs x 5 steps; 500 samples / 8 per step = 62.5 -> 63; t_warmup 0.25dur of 10 -> 2
    assert (cfg["trainer"]["max_steps"], cfg["trainer"]["eval_every"], cfg["scheduler"]["warmup_steps"]) == (10, 63, 2)
    assert "  callbacks: expected LLM Foundry's mapping" in report
    assert "has no tokenizer.json" in report and "DATA_DIR/train.jsonl" in cfg["data"]["path"]


@pytest.mark.parametrize("edit,key", [
    (None, "trainer"),  # an llmforge YAML
    ({"train_loader": None}, "train_loader"),
    ({"model": {"name": "gpt2_causal_lm"}}, "model.name"),
    ({"max_duration": "10 batches"}, "max_duration"),
    ({"scheduler": {"name": "cosine_with_warmup", "t_warmup": "5minutes"}}, "scheduler.t_warmup"),
    ({"max_duration": "${oc.env:HOME}"}, "max_duration calls the resolver"),
    ({"model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": "gpt2"}},
     "model.pretrained_model_name_or_path"),
    ({"max_duration": "2ep"}, "--steps-per-epoch"),
    # a value of the wrong kind: exit 2 naming its section, not a ValueError/TypeError (exit 1)
    ({"optimizer": {"name": "decoupled_adamw", "lr": "fast"}}, "optimizer: "),
    ({"optimizer": {"name": "decoupled_adamw", "lr": 1e-4, "betas": 0.9}}, "optimizer: "),
    ({"precision": ["amp_bf16"]}, "precision: "),
    ({"device_train_microbatch_size": "eight"}, "device_train_microbatch_size"),
    ({"train_loader": {"name": "text", "dataset": {"local": "x", "split": "train", "max_seq_len": 0}}},
     "max_seq_len: must be a positive integer"),  # was 2048, silently
    ({"fsdp_config": {"sharding_strategy": "WEIRD"}}, "fsdp_config.sharding_strategy: 'WEIRD'"),
    # an escaped interpolation: the resolved text ${seed} was written as a live reference
    ({"run_name": "r-\\${global_seed}"}, "run.name: its value holds the text '${'"),
    # the same after a backslash of its own: was written as a backslash and a live reference
    ({"run_name": "r\\\\\\${global_seed}"}, "run.name: its value holds the text '${'"),
])
def test_bad_foundry_input_exits_2_naming_the_key(tmp_path, edit, key):
    if edit is None:
        src = Path(DEMO)
    else:
        data = yaml.safe_load((FOUNDRY / "monitors.yaml").read_text())
        for k, v in edit.items():
            if v is None:
                data.pop(k)
            else:
                data[k] = v
        src = tmp_path / "in.yaml"
        src.write_text(yaml.safe_dump(data))
    r = run_main("convert", "foundry", str(src), "-o", str(tmp_path / "new" / ".." / "other" / "out.yaml"))
    assert r.returncode == 2 and key in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    left = sorted(p.name for p in tmp_path.iterdir())  # no file, no empty folder either
    assert left == ([] if edit is None else ["in.yaml"]), left


def test_output_through_a_missing_folder_and_dotdot_is_the_file_it_names(tmp_path):
    """``-o new/../x.yaml`` with no ``new/``: the file is ``x.yaml`` (a ``..`` after a folder that
    does not exist has no link to follow); an existing ``x.yaml`` is refused without
    ``--overwrite`` (it was replaced before) and no ``new/`` is made."""
    src = str(FOUNDRY / "mpt_pretrain.yaml")
    (tmp_path / "x.yaml").write_text("keep me\n")
    r = run_main("convert", "foundry", src, "-o", str(tmp_path / "new" / ".." / "x.yaml"))
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert (tmp_path / "x.yaml").read_text() == "keep me\n"
    r = run_main("convert", "foundry", src, "-o", str(tmp_path / "new" / ".." / "y.yaml"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.yaml", "y.yaml"]
    assert (tmp_path / "y.yaml").read_text().startswith("# llmforge YAML converted from the LLM Foundry")
    # through an existing link the '..' is the file system's (the target's parent), through a
    # folder that does not exist the name's; a path without '..' stays as given
    import os

    from llmforge.paths import resolve_dotdot

    real = Path(os.path.realpath(tmp_path))
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "d" / "sub")
    assert resolve_dotdot(tmp_path / "link" / ".." / "x.yaml") == real / "d" / "x.yaml"
    assert resolve_dotdot(tmp_path / "a" / "b" / ".." / "c" / "x") == real / "a" / "c" / "x"
    assert resolve_dotdot("x.yaml") == Path("x.yaml")
    r = run_main("convert", "foundry", src, "-o", str(tmp_path / "link" / ".." / "z.yaml"))
    assert r.returncode == 0 and (tmp_path / "d" / "z.yaml").is_file(), r.stderr
    assert f"check it: llmforge train {real / 'd' / 'z.yaml'} --dry-run" in r.stdout, r.stdout


def test_peft_config_becomes_the_plugin_that_takes_it(tmp_path):
    """PEFT's LoRA settings become a `lora` entry through Algorithm.from_peft_config (the
    converter names no plugin); an adapter kind no plugin takes is reported, not guessed."""
    src = yaml.safe_load(_fill("llama_finetune.yaml", tmp_path, HF_DIR="meta-llama/Llama-3.1-8B",
                               DATA_DIR=str(tmp_path)).read_text())
    for peft_type, want in (("LORA", {"name": "lora", "rank": 4, "alpha": 8, "dropout": 0.05}),
                            ("IA3", None)):
        src["model"]["peft_config"] = {"peft_type": peft_type, "r": 4, "lora_alpha": 8,
                                       "lora_dropout": 0.05, "target_modules": ["q_proj"]}
        path = tmp_path / f"{peft_type}.yaml"
        path.write_text(yaml.safe_dump(src))
        cfg, report = _convert(path, tmp_path / f"{peft_type}_out.yaml")
        algos = [a for a in cfg.get("algorithms", []) if a["name"] == "lora"]
        assert algos == ([want] if want else []), algos
        assert "  model.peft_config" in report
        if want is None:
            assert "no llmforge algorithm takes peft_type 'IA3'" in report


@pytest.mark.parametrize("peft, says", [
    ("lora", "model.peft_config must be a mapping of PEFT's settings"),
    ([1, 2], "got a list"),
    ({"peft_type": "LORA", "r": "8"}, "lora.rank='8' must be an integer >= 1"),
    ({"r": 4, "lora_dropout": 7}, "lora.dropout=7 must be in [0, 1)")])
def test_bad_peft_config_exits_2_naming_it(tmp_path, peft, says):
    """A peft_config that is not a mapping, or whose values the plugin refuses, stops the
    conversion with one error line naming model.peft_config; nothing is written."""
    src = yaml.safe_load(_fill("llama_finetune.yaml", tmp_path, HF_DIR="meta-llama/Llama-3.1-8B",
                               DATA_DIR=str(tmp_path)).read_text())
    src["model"]["peft_config"] = peft
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(src))
    r = run_main("convert", "foundry", str(path), "-o", str(tmp_path / "out.yaml"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: model.peft_config") and says in r.stderr, r.stderr
    assert not (tmp_path / "out.yaml").exists()


def test_credentials_in_foundry_urls_are_left_out_of_the_converted_yaml(tmp_path):
    """A Foundry YAML may carry ``s3://KEY:SECRET@bucket`` or a tracking URI's password: they
    were copied into the converted YAML, its header and the printed report. Now left out (the
    URL without them), with a to-do naming the environment variables; the file loads."""
    data = yaml.safe_load((FOUNDRY / "monitors.yaml").read_text())
    data["save_folder"] = "s3://AKIAFAKE:S3PASS_SECRET@bucket/ckpt"
    data["loggers"]["mlflow"]["tracking_uri"] = "https://me:MLFLOW_PW_SECRET@host/mlflow?token=TOKSECRET&x=1"
    src = tmp_path / "in.yaml"
    src.write_text(yaml.safe_dump(data))
    cfg, report = _convert(src, tmp_path / "out.yaml")
    text = (tmp_path / "out.yaml").read_text()
    for secret in ("S3PASS_SECRET", "AKIAFAKE", "MLFLOW_PW_SECRET", "TOKSECRET"):
        assert secret not in text and secret not in report
    assert cfg["checkpoint"]["dir"] == "s3://bucket/ckpt"
    assert "https://host/mlflow?x=1" in text and "MLFLOW_TRACKING_PASSWORD" in report


def test_a_conversion_train_would_refuse_says_so_in_its_report(tmp_path):
    """Composer clamps a micro-batch above the global batch and runs ``max_duration: 0ba`` as no
    training; the converted YAML loads but ``llmforge train`` refuses it: the report (and the
    file's header) says which key, instead of a clean exit 0 and a surprise at training."""
    data = yaml.safe_load((FOUNDRY / "monitors.yaml").read_text())
    data.update(global_train_batch_size=16, device_train_microbatch_size=32)
    src = tmp_path / "in.yaml"
    src.write_text(yaml.safe_dump(data))
    _, report = _convert(src, tmp_path / "out.yaml")
    line = "llmforge train refuses this file as written: trainer.global_batch_size=16 must be a multiple"
    assert line in report and line in (tmp_path / "out.yaml").read_text()
    # the model family's shape check too (Foundry's own model would fail at build time)
    data = yaml.safe_load((FOUNDRY / "monitors.yaml").read_text())
    data["model"]["n_heads"] = 5
    src.write_text(yaml.safe_dump(data))
    _, report = _convert(src, tmp_path / "shape.yaml")
    assert ("llmforge train refuses this file as written: model.dim (64) must be divisible by "
            "model.n_heads (5)") in report
