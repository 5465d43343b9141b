"""The event algorithms in real runs: FSDP2 on 2 processes equals 1 process, SIGKILL + resume
is bit-exact with ema + loss_spike_guard + seq_length_warmup + z_loss, the spike guard skips
exactly the injected step, and Lightning's own EarlyStopping / loggers / LearningRateMonitor
work beside llmforge's, with an MLflow run read back by MLflow's client.

The 1-process runs go in-process (``llmforge.cli.main``); the killed run and the 2-process
runs are real processes (gloo; both 2-process runs in one torchrun launch)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli
from helpers.dist import torchrun, worker

BASE = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=4", "trainer.eval_batches=1",
        "scheduler.warmup_steps=2", "optimizer.lr=3e-3",
        # 6 of Shakespeare's 42 texts: each run tokenizes its data (all 42: ~4.5 s of CPU a run)
        "data.max_documents=6"]
GROUP = ("algorithms=[{name: z_loss, coef: 1.0e-3}, {name: seq_length_warmup, duration: 6, "
         "min_seq_len: 16, step_size: 8}, {name: ema, decay: 0.9}, "
         "{name: loss_spike_guard, factor: 50.0, min_history: 2}]")
CHUNKED = "algorithms=[{name: chunked_cross_entropy, chunk_size: 40}]"


def train_in_process(out: Path, name: str, *extra: str) -> Path:
    from llmforge.cli import main

    assert main(["train", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}", *extra]) == 0
    return out / name


def train_process(out: Path, name: str, *extra: str):
    return run_cli("train", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}", *extra,
                   cwd=REPO, timeout=600)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def series(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from llmforge.checkpoint.run_dir import load_for_inference

    # this module's own runs: their algorithms are test classes named by import path
    model, _, _ = load_for_inference(run_dir, trust_code=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("events")


@pytest.fixture(scope="module")
def reference(out):
    """The four algorithms together, uninterrupted, 1 process (checkpoints every 3 steps)."""
    return train_in_process(out, "ref", GROUP, "checkpoint.save_every=3")


def test_the_algorithms_act_in_a_real_run(reference):
    recs = records(reference)
    seq = series(reference, "train/seq_len")
    assert [seq[s] for s in range(1, 9)] == [16, 24, 32, 40, 48, 56, 64, 64]
    tokens = series(reference, "train/tokens_seen")
    assert tokens[1] == 8 * 16 and tokens[3] == 8 * (16 + 24 + 32)  # real tokens, not 8 x 64
    z = series(reference, "train/z_loss")
    assert len(z) == 8 and all(0 < v < 0.1 for v in z.values())
    assert series(reference, "train/skipped_steps")[8] == 0
    assert {r["step"] for r in recs if "eval/loss" in r} == {0, 4, 8}


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact_with_the_stateful_algorithms(out, reference):
    killed = train_process(out, "killed", GROUP, "checkpoint.save_every=3",
                           "callbacks=[{name: tests.helpers.killers.KillAt, step: 6}]")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in (out / "killed" / "checkpoints").iterdir()) == ["step_00000003"]
    state = json.loads((out / "killed" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert len(state["callbacks"]["LossSpikeGuard"]["loss"]) == 3
    resumed = train_in_process(out, "killed", GROUP, "checkpoint.save_every=3", "checkpoint.resume=auto")
    for key in ("train/loss", "train/z_loss", "train/seq_len", "eval/loss"):
        a, b = series(reference, key), series(resumed, key)
        assert a == b, key
    wa, wb = weights(reference), weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def fsdp2_runs(out):
    """Both FSDP2 runs in ONE 2-process torchrun launch (tests/dist/train_worker.py runs them
    in sequence): each launch costs ~8 s of imports per process."""
    runs = {f"{name}2": ["train", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}2", algos,
                         "strategy.name=fsdp2"] for name, algos in (("events", GROUP), ("chunked", CHUNKED))}
    (out / "runs.json").write_text(json.dumps(runs))
    proc = torchrun(worker("train_worker.py"), str(out), str(out / "runs.json"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algos", [GROUP, CHUNKED], ids=["events", "chunked_ce"])
def test_fsdp2_on_two_processes_gives_the_losses_of_one(out, reference, fsdp2_runs, algos):
    name = "events" if algos == GROUP else "chunked"
    one = reference if algos == GROUP else train_in_process(out, "chunked1", CHUNKED)
    a, b = series(one, "train/loss"), series(out / f"{name}2", "train/loss")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in a:
        assert abs(a[s] - b[s]) < 1e-5, (s, a[s], b[s])
    ea, eb = series(one, "eval/loss"), series(out / f"{name}2", "eval/loss")
    assert all(abs(ea[s] - eb[s]) < 1e-5 for s in ea)


def test_chunked_cross_entropy_run_equals_the_plain_run(out):
    plain = train_in_process(out, "plain", "trainer.max_steps=3", "checkpoint.save_final=false")
    chunked = train_in_process(out, "chunk3", CHUNKED, "trainer.max_steps=3", "checkpoint.save_final=false")
    for key in ("train/loss", "eval/loss"):
        a, b = series(plain, key), series(chunked, key)
        assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-5 for s in a), key


def test_spike_guard_skips_exactly_the_injected_step(out):
    spike = ("algorithms=[{name: tests.helpers.algos.SpikeAt, step: 3}, "
             "{name: loss_spike_guard, factor: 4.0, min_history: 2}]")
    guarded = train_in_process(out, "spiked", spike, "trainer.max_steps=5", "scheduler.name=constant")
    never = train_in_process(out, "never", "algorithms=[{name: tests.helpers.algos.SkipAt, step: 3}]",
                             "trainer.max_steps=5", "scheduler.name=constant")
    skipped = series(guarded, "train/skipped_steps")
    assert [skipped[s] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert series(guarded, "train/loss")[3] > 100  # the injected spike was seen ...
    a, b = series(guarded, "train/loss"), series(never, "train/loss")
    assert [a[s] for s in (4, 5)] == [b[s] for s in (4, 5)]  # ... and left no trace
    wa, wb = weights(guarded), weights(never)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    from llmforge.checkpoint.dcp import read_json
    from llmforge.checkpoint.layout import latest_checkpoint

    assert read_json(latest_checkpoint(guarded / "checkpoints"), "trainer_state.json")["step"] == 5


def test_lightning_callbacks_and_loggers_work_beside_llmforges(out, capsys):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run = train_in_process(
        out, "lightning", "trainer.max_steps=40", "trainer.eval_every=2", "optimizer.lr=1e-9",
        "scheduler.warmup_steps=0", "trainer.log_every=2",
        "callbacks=[{name: lightning.pytorch.callbacks.EarlyStopping, monitor: eval/loss, "
        "patience: 2, min_delta: 0.01}, {name: lightning.pytorch.callbacks.LearningRateMonitor}]",
        f"loggers=[{{name: jsonl}}, {{name: mlflow}}, {{name: lightning.pytorch.loggers.CSVLogger, "
        f"save_dir: {out / 'csv'}}}]")
    recs = records(run)
    # lr ~ 0: eval/loss never improves by 0.01; Lightning's EarlyStopping stops after 2 evaluations
    # after the first, which is step 0's (it reaches on_validation_end too, issue 27.7)
    assert max(r["step"] for r in recs) == 4
    assert "stopped early (Lightning's EarlyStopping: eval/loss stopped improving): 4 of 40 steps" \
        in capsys.readouterr().out
    ours = {r["step"]: r for r in recs if "train/loss" in r}
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    run_id = (run / "mlflow_run_id").read_text().strip()
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert history == {s: pytest.approx(r["train/loss"], rel=1e-12) for s, r in ours.items()}
    assert client.get_run(run_id).data.params["trainer.max_steps"] == "40"
    [csv] = (out / "csv").rglob("metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    assert "train/loss" in header and "eval/loss" in header and "lr-AdamW/decay" in header


def test_timer_stop_step0_validation_end_and_the_closing_line_after_resume(out, capsys):
    """Issue 27.7: step 0's evaluation reaches Lightning callbacks' on_validation_end; a run that
    Lightning's Timer stops evaluates once more and says it stopped early; the closing line of
    a resumed run compares with step 0 of the first attempt, not with its own last evaluation."""
    seen = out / "validation_ends.json"
    timer = ("callbacks=[{name: lightning.pytorch.callbacks.Timer, duration: {seconds: 0.001}}, "
             f"{{name: tests.helpers.modules.ValidationEnds, path: '{seen}'}}]")
    run = train_in_process(out, "timer", timer, "trainer.max_steps=6", "trainer.eval_every=4",
                           "scheduler.name=constant")
    evals = series(run, "eval/loss")
    assert sorted(evals) == [0, 1]  # step 0, and the final evaluation after the stop at step 1
    assert json.loads(seen.read_text()) == [[0, pytest.approx(evals[0])], [1, pytest.approx(evals[1])]]
    closing = capsys.readouterr().out
    assert "stopped early (Lightning's Timer: its duration passed): 1 of 6 steps" in closing
    assert f"eval/loss {evals[1]:.4f} (step 0: {evals[0]:.4f})" in closing
    # resume to step 4: one evaluation (step 4) in this process; the baseline is step 0's
    train_in_process(out, "timer", "trainer.max_steps=4", "trainer.eval_every=4", "scheduler.name=constant",
                     "checkpoint.resume=auto")
    evals = series(run, "eval/loss")
    assert sorted(evals) == [0, 1, 4]
    closing = capsys.readouterr().out
    assert "done: 4 steps" in closing and f"eval/loss {evals[4]:.4f} (step 0: {evals[0]:.4f})" in closing


def test_a_lightning_callback_and_an_algorithm_act_in_the_documented_order(out):
    """The one bridge (docs/algorithms/README.md, "One bus"): at each Lightning hook llmforge's
    events come first, the step's events run inside training_step, the record and
    STEP_RECORDED after the Lightning callbacks' on_train_batch_end."""
    from tests.helpers.order import SEEN

    SEEN.clear()
    train_in_process(out, "order", "trainer.max_steps=2", "trainer.eval_every=2",
                     "algorithms=[{name: tests.helpers.order.EventOrder}]",
                     "callbacks=[{name: tests.helpers.order.LightningHooks}]")
    step = ["L.on_train_batch_start", "A.batch_start", "A.before_optimizer_step", "L.on_before_optimizer_step",
            "A.after_optimizer_step", "L.on_train_batch_end"]
    evaluation = ["A.before_evaluation", "A.after_evaluation", "L.on_validation_end"]
    assert SEEN == ["L.on_fit_start", "A.before_load", "A.fit_start", "L.on_train_start", *evaluation,
                    *step, "A.step_recorded",
                    *step, *evaluation, "A.step_recorded",
                    "A.fit_end", "L.on_train_end"]
