"""Threads re-chosen during a run (callbacks/threads.py): pure logic and the Trainer's wiring,
in-process with fake readings and a fake clock (no training, no sleeping)."""

from types import SimpleNamespace

import pytest
import torch

from conftest import DEMO, TINY_OVERRIDES
from llmforge.callbacks.threads import ThreadWatch
from llmforge.config import load_config
from llmforge.parallel.threads import TORCHRUN_SET_OMP, explicit_threads, settle


@pytest.mark.parametrize("current, pending, choice, want", [
    (2, None, 2, (2, None)),   # nothing changed
    (2, None, 1, (2, 1)),      # one reading: wait for the next
    (2, 1, 1, (1, None)),      # two in a row: take it
    (2, 1, 2, (2, None)),      # a burst that passed: forget it
    (1, 2, 3, (1, 3)),         # a different choice starts again
])
def test_settle_takes_a_choice_seen_twice(current, pending, choice, want):
    assert settle(current, pending, choice) == want


@pytest.mark.parametrize("override, env, want", [
    (None, {}, None),
    (3, {"OMP_NUM_THREADS": "5"}, (3, "trainer.num_threads=3")),
    (None, {"OMP_NUM_THREADS": "5"}, (5, "OMP_NUM_THREADS=5")),
    (None, {"OMP_NUM_THREADS": "1", TORCHRUN_SET_OMP: "1"}, None),   # torchrun's, not the user's
    (None, {"OMP_NUM_THREADS": "0"}, None),
])
def test_explicit_threads(override, env, want):
    assert explicit_threads(override, env) == want


def test_watch_follows_other_processes(capsys):
    """On 2 cores: idle -> 2 threads; a burner appears -> 1 after two checks 15 s apart; one
    short burst changes nothing; reads only every 15 s of wall time."""
    now = [0.0]
    busy = iter([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    reads = []

    def read():
        reads.append(now[0])
        return next(busy)

    watch = ThreadWatch(0, read_busy=read, clock=lambda: now[0], cores=2, announce=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        watch.fit_start(None)
        for step in range(1, 13):
            now[0] += 7.5  # two steps per check
            watch.step_recorded(SimpleNamespace(step=step))
            if step == 4:
                assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert reads == [15.0, 30.0, 45.0, 60.0, 75.0, 90.0]
    # busy 1, 1 -> 1 thread at step 4; 0 then 1 (a burst) keeps 1; 0, 0 -> 2 at step 12
    assert watch.changes == [(4, 2, 1), (12, 1, 2)]
    assert capsys.readouterr().err.splitlines() == [
        "threads: 2 -> 1 compute thread at step 4 (2 cores available, 1 runnable thread of other processes)",
        "threads: 1 -> 2 compute threads at step 12 (2 cores available)"]


@pytest.mark.parametrize("overrides, env, want", [
    ([], {}, True),
    (["trainer.num_threads=1"], {}, False),
    ([], {"OMP_NUM_THREADS": "1"}, False),
])
def test_trainer_watches_only_its_own_choice(overrides, env, want, tmp_path, monkeypatch):
    from llmforge import Trainer
    from llmforge.training import trainer as trainer_module

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(trainer_module, "machine_wide", lambda cores: True)  # as if not under taskset
    cfg = load_config(DEMO, [*TINY_OVERRIDES, f"run.output_dir={tmp_path}", *overrides])
    trainer = Trainer(cfg)
    assert trainer.watch_threads() is want
    assert any(isinstance(c, ThreadWatch) for c in trainer.build_callbacks()) is want


def test_own_compute_threads_are_not_other_processes():
    """While this process's torch threads compute (a matmul loop in a Python thread, which
    releases the GIL), they are counted as its own, never as busy cores of others."""
    import threading

    from llmforge.parallel.threads import own_running_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    stop = threading.Event()

    def compute():
        while not stop.is_set():
            a @ a

    worker = threading.Thread(target=compute)
    worker.start()
    try:
        seen = [own_running_threads() for _ in range(20)]
    finally:
        stop.set()
        worker.join()
        torch.set_num_threads(before)
    assert max(seen) >= 1 and min(seen) >= 0


@pytest.mark.parametrize("others, want", [(0.0, "all"), ("all but one", 1)])
def test_generate_and_eval_take_trainings_choice(others, want, monkeypatch):
    """``generate`` and ``eval`` (use_inference_threads) take the cores others leave free."""
    from llmforge.generate import use_inference_threads
    from llmforge.parallel import threads

    cores = threads.available_cores()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "machine_wide", lambda n: True)
    monkeypatch.setattr(threads, "busy_cores",
                        lambda: float(cores - 1) if others == "all but one" else others)
    before = torch.get_num_threads()
    try:
        assert use_inference_threads() == torch.get_num_threads() == (cores if want == "all" else 1)
    finally:
        torch.set_num_threads(before)
