"""Monitor callbacks: speed/MFU arithmetic, peak table, memory, lr, NaN guard, early stopping,
samples, profiler, memory snapshot; the speed monitor is configured, not duplicated, from YAML."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, TINY_OVERRIDES, run_main
from llmforge.callbacks import speed as speed_mod
from llmforge.callbacks.peak_flops import peak_tflops
from llmforge.callbacks.speed import SpeedMonitor
from llmforge.errors import ConfigError, TrainingDiverged
from llmforge.events import State


# ------------------------------------------------------------------------ speed and MFU
class FakeModule:
    """What SpeedMonitor reads from an LLMModule, with a real tiny Llama for flops_per_token."""

    def __init__(self, model=None, seq_len=8):
        from llmforge.training.module import LLMModule

        self.model = model
        self.device = torch.device("cpu")
        self.plan = SimpleNamespace(seq_len=seq_len)
        self.step_metrics = {}
        self.split_batch = LLMModule.split_batch
        self.is_log_step = lambda step: step % 2 == 0

    def dp_all_reduce(self, t):
        return t


def run_window(monkeypatch, batches, seconds_per_step, model=None, peak=None, world_size=1):
    """Feed ``batches`` (the last one is a logging step) with a fake clock: each step takes
    ``seconds_per_step``, no time passes between steps."""
    now = {"t": 0.0}
    monkeypatch.setattr(speed_mod.time, "perf_counter", lambda: now["t"])
    mon = SpeedMonitor(peak_tflops=peak)
    module = FakeModule(model)
    trainer = SimpleNamespace(global_step=0, world_size=world_size, is_global_zero=False)
    state = State(module=module, trainer=trainer, metrics=module.step_metrics)
    mon.fit_start(state)
    for batch in batches:
        state.step, state.batch = state.step + 1, batch
        mon.batch_start(state)
        now["t"] += seconds_per_step
        mon.after_optimizer_step(state)
    return module.step_metrics


def padded(rows, real, seq=8):
    """``rows`` sequences of ``seq`` tokens of which the first ``real`` have targets."""
    labels = torch.full((rows, seq), -100)
    labels[:, :real] = 7
    return {"input_ids": torch.ones(rows, seq, dtype=torch.long), "labels": labels}


def test_tokens_per_second_counts_targets_not_padding(monkeypatch):
    full = run_window(monkeypatch, [padded(2, 8), padded(2, 8)], 0.5)  # 2 x 16 tokens in 1 s
    half = run_window(monkeypatch, [padded(4, 4), padded(4, 4)], 0.5)  # 32 slots, 16 real, each
    assert full["throughput/tokens_per_second"] == pytest.approx(32.0)
    assert half["throughput/tokens_per_second"] == pytest.approx(32.0)  # padding is not counted
    assert full["time/step_seconds"] == pytest.approx(0.5)
    windows = run_window(monkeypatch, [torch.zeros(3, 9, dtype=torch.long)] * 2, 0.25)
    assert windows["throughput/tokens_per_second"] == pytest.approx(2 * 3 * 8 / 0.5)  # shifted windows


def test_mfu_and_tflops_against_a_hand_computation(monkeypatch):
    from omegaconf import OmegaConf

    from llmforge.models.llama3.config import Llama3Config as ModelConfig
    from llmforge.registry import models

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 100,
        "multiple_of": 32, "max_seq_len": 8})
    model = models.get("llama3")(cfg)
    # by hand: 6 x non-embedding parameters + 12 x layers x heads x head_dim x seq_len
    n = sum(p.numel() for name, p in model.named_parameters() if name != "tok_embeddings.weight")
    flops_per_token = 6 * n + 12 * 2 * 4 * 16 * 8
    assert model.flops_per_token(8) == flops_per_token
    m = run_window(monkeypatch, [padded(4, 8), padded(4, 6)], 2.0, model=model, peak=0.001,
                   world_size=2)
    tokens, seconds = 4 * 8 + 4 * 6, 4.0
    per_device = tokens / seconds / 2
    assert m["throughput/tokens_per_second"] == pytest.approx(tokens / seconds)
    assert m["throughput/tokens_per_second_per_device"] == pytest.approx(per_device)
    assert m["throughput/tflops_per_device"] == pytest.approx(per_device * flops_per_token / 1e12)
    assert m["throughput/mfu"] == pytest.approx(per_device * flops_per_token / 1e12 / 0.001)


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", (989.4, "bf16")),
    ("NVIDIA H100 80GB HBM3", "fp8", (1978.9, "fp8")),
    ("NVIDIA H100 PCIe", "bf16", (756.0, "bf16")),
    ("NVIDIA H100 NVL", "fp8", (1671.0, "fp8")),
    ("NVIDIA H200", "bf16", (989.4, "bf16")),
    ("NVIDIA H200", "fp8", (1978.9, "fp8")),
    ("NVIDIA A100-SXM4-80GB", "fp8", (312.0, "bf16")),  # no fp8 units: says bf16
    ("AMD Instinct MI300X", "bf16", (1307.4, "bf16")),
    ("NVIDIA B200", "fp8", (4500.0, "fp8")),
    ("NVIDIA GeForce RTX 3090", "bf16", None),
])
def test_peak_table(name, precision, expected):
    assert peak_tflops(name, precision) == expected


def test_mfu_peak_choice_is_stated():
    class Float8Linear(torch.nn.Linear):
        pass

    fp8_model = torch.nn.Sequential(Float8Linear(4, 4))
    line = SpeedMonitor(peak_tflops=100).resolve_peak(FakeModule(fp8_model))
    assert "precision for MFU: fp8" in line and "100" in line
    line = SpeedMonitor(peak_tflops=100, precision_for_mfu="bf16").resolve_peak(FakeModule(fp8_model))
    assert "precision for MFU: bf16" in line
    mon = SpeedMonitor()
    assert mon.resolve_peak(FakeModule(torch.nn.Linear(2, 2))) == ""  # CPU: no MFU, no line
    assert mon.peak is None
    with pytest.raises(ConfigError, match="precision_for_mfu"):
        SpeedMonitor(precision_for_mfu="fp4")


def test_speed_monitor_entry_configures_the_default_one(tmp_path):
    from llmforge import Trainer

    trainer = Trainer.from_yaml(REPO / "yamls" / "demo_cpu.yaml", [
        *TINY_OVERRIDES, f"run.output_dir={tmp_path}",
        "callbacks=[{name: speed_monitor, peak_tflops: 123}, {name: lr_monitor}]"])
    cbs = trainer.build_callbacks()
    speeds = [c for c in cbs if isinstance(c, SpeedMonitor)]
    assert len(speeds) == 1 and speeds[0].peak_override == 123.0 and cbs[0] is speeds[0]
    assert type(cbs[-1]).__name__ == "LearningRateMonitor"


# -------------------------------------------------------------------------- NaN guard
def test_nan_guard_flags_non_finite_values():
    from llmforge.callbacks.nan_guard import NaNGuard

    guard = NaNGuard(max_loss=50)
    assert guard.problems({"train/loss": torch.tensor(3.0), "train/grad_norm": torch.tensor(1.0)}) == []
    assert guard.problems({"train/loss": torch.tensor(float("nan")), "train/grad_norm": 1.0}) == ["train/loss = nan"]
    assert guard.problems({"train/loss": 2.0, "train/grad_norm": torch.tensor(float("inf"))}) == ["train/grad_norm = inf"]
    assert guard.problems({"train/loss": 60.0}) == ["train/loss = 60.0000 > max_loss 50"]
    assert TrainingDiverged.exit_code == 3


@pytest.mark.slow
def test_nan_guard_stops_a_diverging_run_and_keeps_the_last_checkpoint(tmp_path):
    # lr 1e6 (warmup 2): the weights blow up; step 3's gradient norm is NaN on this seed
    proc = run_main("train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES,
                    f"run.output_dir={tmp_path}", "optimizer.lr=1e6", "trainer.max_steps=20",
                    "trainer.eval_every=0", "trainer.log_every=1", "checkpoint.save_every=2",
                    "callbacks=[{name: nan_guard}]")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "error: training diverged at step 3" in proc.stderr
    assert "step_00000002, is intact" in proc.stderr
    run_dir = tmp_path / "demo_cpu"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000002"]  # nothing written from the bad state
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]

    from llmforge.checkpoint.run_dir import load_for_inference

    model, _, _ = load_for_inference(run_dir)  # the checkpoint loads, and its weights are finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_a_nan_run_stops_by_default_and_keeps_the_last_finite_checkpoint(tmp_path):
    """Issue 50.4: ``optimizer.lr=1e30`` with no callback listed (``trainer.nan_guard`` on by
    default): step 1 trains, step 2's gradient norm is NaN -> exit 3 naming step 2 and how to go
    on; step 1's checkpoint is the newest and its weights are finite (no final save of the NaN
    state). ``trainer.nan_guard=false`` trains through, as before."""
    args = ["train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES, "optimizer.lr=1e30",
            "trainer.max_steps=3", "trainer.eval_every=0", "trainer.log_every=1"]
    proc = run_main(*args, f"run.output_dir={tmp_path}", "checkpoint.save_every=1")
    assert proc.returncode == 3, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: training diverged at step 2: train/grad_norm = nan"), line
    assert "step_00000001, is intact" in line and "trainer.nan_guard=false" in line
    assert "loss_spike_guard" in line and "done:" not in proc.stdout + proc.stderr
    run_dir = tmp_path / "demo_cpu"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]

    from llmforge.checkpoint.run_dir import load_for_inference

    model, _, _ = load_for_inference(run_dir)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    off = run_main(*args, f"run.output_dir={tmp_path / 'off'}", "trainer.nan_guard=false",
                   "checkpoint.save_final=false")
    assert off.returncode == 0 and "train/loss nan" in off.stdout + off.stderr, off.stderr[-3000:]


def test_the_checkpointer_refuses_non_finite_weights(tmp_path):
    """With the guard on, a save of weights an update made infinite raises before writing."""
    from llmforge.callbacks.checkpointing import Checkpointer

    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, finite_only=True)
    ckpt._check_finite(4, model)  # finite: nothing raised
    with torch.no_grad():
        model.weight[0, 1] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"at step 4: its update made weights non-finite; "
                                               r"their checkpoint was not written \(no checkpoint"):
        ckpt.save(SimpleNamespace(global_step=4), SimpleNamespace(model=model))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------- early stopping, lr, memory, samples, profiler, snapshot
def test_monitor_callbacks_in_one_run(tmp_path, capsys):
    from llmforge import Trainer

    callbacks = (
        "callbacks=[{name: early_stopping, patience: 1, min_delta: 10.0}, {name: lr_monitor}, "
        "{name: memory_monitor}, {name: generate_samples, prompts: [ROMEO., 'To be'], every: 1, "
        "max_new_tokens: 5, temperature: 0}, {name: profiler, start_step: 2, steps: 1}, "
        "{name: memory_snapshot, at_steps: [1]}]")
    trainer = Trainer.from_yaml(REPO / "yamls" / "demo_cpu.yaml", [
        *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.max_steps=8", "trainer.log_every=1",
        "trainer.eval_every=2", "trainer.eval_batches=1", callbacks])
    summary = trainer.fit()
    err = capsys.readouterr().err
    run_dir = Path(summary["run_dir"])
    # early stopping: eval at step 2 did not beat step 0 by 10 nats -> stop after step 2
    assert summary["steps"] == 2 and "early_stopping: eval/loss" in err
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 2 and last["train/lr/decay"] == last["train/lr/no_decay"] == last["train/lr"]
    assert 0.05 < last["memory/peak_gib"] < 64  # peak RSS of this process on the CPU
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(1, "ROMEO."), (1, "To be"), (2, "ROMEO."), (2, "To be")]
    assert all(isinstance(s["sample"], str) for s in samples)
    [trace] = (run_dir / "profiler").glob("trace_rank0_steps2-2.json")
    assert json.loads(trace.read_text())["traceEvents"]
    assert err.count("memory_snapshot: training runs on the CPU") == 1
    # early stopping's state travels in the checkpoint, and a resumed run gets it back
    [ckpt] = (run_dir / "checkpoints").glob("step_*")
    saved = json.loads((ckpt / "trainer_state.json").read_text())["callbacks"]
    assert saved == {"EarlyStopping": {"best": records[0]["eval/loss"], "wait": 1}}
    from llmforge.callbacks.early_stopping import EarlyStopping
    from llmforge.checkpoint.plugins import restore_plain_states

    fresh = EarlyStopping(patience=1)
    restore_plain_states([fresh], saved)
    assert (fresh.best, fresh.wait) == (records[0]["eval/loss"], 1)
    assert not (run_dir / "memory_snapshots").exists()


# ------------------------------------------------------- GPU paths (and their logic on the CPU)
def test_memory_snapshot_dump_logic_on_the_cpu(tmp_path, monkeypatch):
    """The CUDA recorder is replaced by a file writer: dumps happen at ``at_steps``, on a request
    file (which is then removed) and on OOM only, with the documented file names."""
    from llmforge.callbacks import memory_snapshot as ms

    monkeypatch.setattr(ms.torch.cuda.memory, "_dump_snapshot", lambda p: Path(p).write_bytes(b"x"))
    cb = ms.MemorySnapshot(at_steps=[2])
    cb.active = True  # what fit_start does on a CUDA device
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), global_step=0, global_rank=0,
                              is_global_zero=True)
    monkeypatch.setattr(ms.torch.cuda.memory, "_record_memory_history", lambda **kw: None)
    state = State(trainer=trainer)
    for step in (1, 2, 3):
        trainer.global_step = state.step = step
        if step == 3:
            (tmp_path / ms.REQUEST_FILE).touch()
        cb.after_optimizer_step(state)
    assert not (tmp_path / ms.REQUEST_FILE).exists()
    state.exception = ValueError("not an OOM")
    cb.fit_exception(state)
    cb.active = True  # fit_exception stopped the recording
    state.exception = torch.OutOfMemoryError("CUDA out of memory")
    cb.fit_exception(state)
    assert not cb.active
    names = sorted(p.name for p in (tmp_path / "memory_snapshots").iterdir())
    assert names == ["rank0_step2.pickle", "rank0_step3.pickle", "rank0_step3_oom.pickle"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_monitor_and_snapshot_on_a_gpu(tmp_path):
    from llmforge import Trainer

    trainer = Trainer.from_yaml(REPO / "yamls" / "demo_cpu.yaml", [
        *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "trainer.max_steps=3", "trainer.log_every=1",
        "trainer.eval_every=0", "checkpoint.save_final=false", "trainer.accelerator=gpu",
        "callbacks=[{name: memory_monitor}, {name: memory_snapshot, at_steps: [2]}]"])
    summary = trainer.fit()
    run_dir = Path(summary["run_dir"])
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert 0 < last["memory/peak_gib"] <= last["memory/reserved_gib"] < 200
    assert (run_dir / "memory_snapshots" / "rank0_step2.pickle").stat().st_size > 0


def test_garbage_collection_is_scheduled_during_training(monkeypatch):
    import gc

    from llmforge.callbacks import gc as gc_mod

    calls = []
    monkeypatch.setattr(gc_mod.gc, "collect", lambda gen=2: calls.append(gen))
    cb = gc_mod.GarbageCollection(every=2)
    state = State()
    assert gc.isenabled()
    cb.fit_start(state)
    assert not gc.isenabled() and calls == [2]
    for step in (1, 2, 3, 4):
        state.step = step
        cb.step_recorded(state)
    assert calls == [2, 1, 1]  # the young generation, every 2 steps
    state.exception = RuntimeError("x")
    cb.fit_exception(state)
    assert gc.isenabled()
