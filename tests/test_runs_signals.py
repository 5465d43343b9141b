"""Stop signals are llmforge's from process start: during startup a SIGTERM/SIGUSR1 stops at
once with exit 75 and nothing written (a scheduler requeues); during training it is recorded for
the Checkpointer (Lightning's own SIGTERM handler never runs); torchrun's SIGUSR1 forwarding
waits for a worker that has not installed its handlers yet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import REPO, TINY_OVERRIDES
from llmforge import signals
from llmforge.events import State
from llmforge.job.torchrun import catches


@pytest.fixture
def owned():
    assert signals.install()
    yield
    signals.uninstall()


def test_phases_startup_raises_training_records_second_ctrl_c_stops(owned):
    assert signals.phase() == "startup" and signal.getsignal(signal.SIGTERM) is signals._handler
    with pytest.raises(signals.StoppedBeforeTraining) as info:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)  # the handler runs at the next bytecode
    assert info.value.exit_code == 75 and "received SIGUSR1 before training started" in str(info.value)

    signals.uninstall()  # a second in-process run
    signals.install()
    signals.training_started()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert signals.received() == signal.SIGTERM  # the first one counts
    assert signals.exit_code_for(signals.received()) == 75

    signals.uninstall()  # a second in-process run
    signals.install()
    signals.training_started()
    os.kill(os.getpid(), signal.SIGINT)
    assert signals.received() == signal.SIGINT and signals.exit_code_for(signal.SIGINT) == 130
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: at once
        time.sleep(1)

    signals.training_ended()
    os.kill(os.getpid(), signal.SIGTERM)  # after training: ignored, the run completes
    assert signals.received() is None and signals.phase() == "finished"


def test_a_signal_swallowed_during_startup_stops_at_training_start(owned):
    from llmforge.callbacks.checkpointing import Checkpointer

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    except Exception:  # library code with a broad except on the way
        pass
    with pytest.raises(signals.StoppedBeforeTraining, match="SIGTERM"):
        Checkpointer("unused").fit_start(State())  # where training starts


def test_an_error_a_startup_stop_caused_is_reported_as_the_stop(monkeypatch, capsys):
    """A SIGTERM during startup that surfaces as another exception (a full-suite run: a
    RecursionError out of the library code it interrupted, exit 1) exits 75 as the stop; the
    same error with no signal received stays an error (exit 1)."""
    import llmforge.cli as cli

    def command(args, signal_first):
        if signal_first:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            except signals.StoppedBeforeTraining:
                pass  # raised inside library code: what reaches the command is another exception
        raise RecursionError("maximum recursion depth exceeded")

    for signal_first, code, err in ((False, 1, "error: RecursionError: maximum recursion depth exceeded"),
                                    (True, 75, "stopped: received SIGTERM before training started: nothing "
                                               "to save (exit code 75)\n")):
        monkeypatch.setattr(cli, "cmd_data", lambda args: command(args, signal_first))
        assert cli.main(["data", "prepare", "SOURCE", "OUT"]) == code
        assert capsys.readouterr().err.startswith(err) and signals.phase() == "off"


def test_uninstall_gives_the_handlers_back():
    before = signal.getsignal(signal.SIGINT)
    assert signals.install() and not signals.install()
    signals.uninstall()
    assert signal.getsignal(signal.SIGINT) is before and signals.phase() == "off"


def test_lightning_fit_keeps_llmforge_handler_and_never_sees_sigterm(owned):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from llmforge.callbacks.checkpointing import Checkpointer
    from llmforge.events import Dispatcher
    from llmforge.training.bridge import EventBridge

    seen = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            seen["received"], seen["lightning"] = signals.received(), trainer.received_sigterm
            signals._state.received = None  # BoringModel has nothing for the Checkpointer to save
            trainer.should_stop = True

    ckpt = Checkpointer(REPO / "nonexistent-never-written", save_final=False)
    # the checkpointer acts on llmforge's events; an LLMModule puts the bridge first itself
    state, bus = State(), Dispatcher([ckpt])
    bridge = EventBridge(SimpleNamespace(state=state, event=lambda event: bus(event, state)))
    trainer = L.Trainer(max_steps=1, callbacks=[bridge, ckpt, Probe()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(BoringModel())
    assert seen == {"handler": signals._handler, "received": signal.SIGTERM, "lightning": False}
    assert signals.phase() == "finished" and not (REPO / "nonexistent-never-written").exists()


def _wait_catching(proc, sig, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if catches(proc.pid, sig):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {proc.pid} never installed a handler for {sig}")


@pytest.mark.slow
def test_sigusr1_during_startup_exits_75_and_writes_nothing(tmp_path):
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO),
                                                        os.environ.get("PYTHONPATH", "")])}
    stall = "callbacks=[{name: tests.helpers.slow.StallSetup, seconds: 120}]"  # startup lasts until the stop
    proc = subprocess.Popen([sys.executable, "-m", "llmforge", "train", str(REPO / "yamls" / "demo_cpu.yaml"),
                             *TINY_OVERRIDES, f"run.output_dir={out}", "run.name=early", stall], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_catching(proc, signal.SIGUSR1)
    os.kill(proc.pid, signal.SIGUSR1)  # what SLURM sends before the time limit, here while importing
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-2000:]
    assert "received SIGUSR1 before training started: nothing to save" in stderr
    assert "Traceback" not in stderr and not (out / "early" / "checkpoints").exists()


def test_torchrun_forwarding_waits_for_a_worker_to_install_its_handler():
    from llmforge.job.torchrun import forward

    code = ("import signal, sys, time; time.sleep(0.6); "
            "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75)); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        assert forward([child.pid], signal.SIGUSR1, time.monotonic() + 20) == [child.pid]  # not yet
        assert child.wait(timeout=20) == 75  # delivered once the handler was there, not killed by it
    finally:
        if child.poll() is None:
            child.kill()


def test_after_the_command_returned_a_signal_is_ignored_and_a_second_exits_at_once():
    """`python -m llmforge` keeps the handlers to the end (signals.exiting): a signal while the
    interpreter shuts down used to kill a completed run (-15) or raise KeyboardInterrupt (-2)."""
    code = ("import os, signal, time\nfrom llmforge import signals\nsignals.exiting()\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1); print('alive', signals.phase(), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.stdout == "alive exiting\n" and proc.returncode == 130, (proc.stdout, proc.stderr)
    # in the interpreter's last stage, after Python reset its handlers (a builtins object's __del__)
    code = ("import builtins, os, signal, time\nclass D:\n    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
            "builtins._probe = D()\nfrom llmforge import signals\nsignals.exiting()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr


def test_the_process_own_command_stops_at_once_on_a_startup_stop_or_a_second_ctrl_c():
    """Raised inside Python code that C++ called (torch's ``_c10d_init`` during ``import torch``)
    the startup stop made pybind11 abort the process: exit 134, run ``failed`` (CI, 2 in 100
    SIGTERMs during the import here); a second Ctrl-C raised inside Lightning's fit exited 1 with
    no word. The process's own command line now prints the stop and ends (75 or 130): no
    ``finally`` and no ``atexit`` runs, output buffered before is kept, and only rank 0 speaks;
    ``describe_startup_stop`` words it (``data prepare``)."""
    code = ("import atexit, os, signal, sys, time\nfrom llmforge import signals\n"
            "signals.install(exit_at_once=True)\n"
            "if sys.argv[2] == 'described': signals.describe_startup_stop(lambda s: signal.Signals(s).name + "
            "': described')\n"
            "if sys.argv[2] == 'training': signals.training_started(); os.kill(os.getpid(), signal.SIGINT)\n"
            "atexit.register(lambda: print('finalized', flush=True))\nprint('buffered', signals.received())\n"
            "try:\n    os.kill(os.getpid(), getattr(signal, sys.argv[1])); time.sleep(30)\n"
            "finally:\n    print('unwound', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cases = [("SIGTERM", "", "0", 75, "stopped: received SIGTERM before training started: nothing to save "
              "(exit code 75)\n"), ("SIGUSR1", "described", "0", 75, "stopped: SIGUSR1: described\n"),
             ("SIGINT", "", "1", 130, ""),
             ("SIGINT", "training", "0", 130, "interrupted: a second Ctrl-C stops at once, without saving\n")]
    for sig, how, rank, code_wanted, err in cases:
        proc = subprocess.run([sys.executable, "-c", code, sig, how], capture_output=True, text=True,
                              timeout=60, env={**env, "RANK": rank})
        out = f"buffered {int(signal.SIGINT) if how == 'training' else None}\n"
        assert (proc.returncode, proc.stdout, proc.stderr) == (code_wanted, out, err), (sig, how)


def test_a_second_ctrl_c_ends_the_multiprocessing_children_too():
    """The data loader's workers are ``multiprocessing`` children, which the exit at once left
    running until their next 5 s check of the parent (a breaker saw them linger): they get
    SIGKILL with the process."""
    # the child lets go of the pipes, so the run returns when the parent exits, child or not
    code = ("import multiprocessing as mp, os, signal, sys, time\nfrom llmforge import signals\n"
            "def worker():\n    null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2)\n"
            "    time.sleep(60)\n"
            "signals.install(exit_at_once=True); signals.training_started()\n"
            "child = mp.get_context('fork').Process(target=worker); child.start()\n"
            "print(child.pid, flush=True); time.sleep(0.5)\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGINT); time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 130 and "a second Ctrl-C stops at once" in proc.stderr, proc.stderr
    pid = int(proc.stdout.split()[0])
    try:
        deadline = time.monotonic() + 2  # SIGKILL is sent before the exit; init reaps the orphan
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launcher_stopped_by_a_signal_exits_with_the_workers_code():
    """torch's agent passes SIGTERM/SIGINT to llmforge's workers, which save and exit 75/130:
    the launcher (`--nproc`, `llmforge.job.torchrun`) says so too, not 143 (a crash: `failed`)."""
    from llmforge.job.torchrun import signal_exit_code

    assert [signal_exit_code(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)] == \
        [75, 130, 75, 128 + signal.SIGHUP]


def test_a_startup_stop_raised_inside_a_callback_prints_no_traceback(monkeypatch):
    """A signal during startup can land inside importlib's weakref callback, where Python cannot
    raise and prints "Exception ignored ... Traceback" (CI saw it); the stop is recorded, so the
    handlers' unraisable hook stays silent for it and passes every other error on."""
    import weakref

    seen = []

    def hook(unraisable):
        seen.append(type(unraisable.exc_value))

    def raise_stop(_):
        raise signals.StoppedBeforeTraining("received SIGUSR1 before training started")

    class Obj:
        pass

    monkeypatch.setattr(sys, "unraisablehook", hook)
    assert signals.install()
    try:
        for callback in (raise_stop, lambda _: 1 / 0):
            obj = Obj()
            ref = weakref.ref(obj, callback)
            del obj  # the callback runs here; its exception is unraisable
            assert ref() is None
    finally:
        signals.uninstall()
    assert seen == [ZeroDivisionError] and sys.unraisablehook is hook


def test_one_signalled_rank_stops_every_rank_with_its_code():
    """A stop is agreed at each step's end (``all_reduce``): every rank stops there, and with the
    same exit code, the largest of the signalled ranks' (130 where any got SIGINT, else 75): a
    Ctrl-C sent to one rank of a torchrun job no longer leaves the others reporting 75. Two real
    gloo ranks (forked), in a child interpreter whose signal handlers the test may take."""
    code = ("import multiprocessing as mp, os, signal, sys\n"
            "import torch.distributed as dist\n"
            "from llmforge import signals\nfrom llmforge.callbacks.checkpointing import agreed_stop_code\n"
            "ROUNDS = [{}, {1: signal.SIGINT}, {0: signal.SIGTERM}, {0: signal.SIGTERM, 1: signal.SIGINT},\n"
            "          {1: signal.SIGUSR1}]\n"
            "def rank(r, port, q):\n"
            "    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=r, world_size=2)\n"
            "    for sent in ROUNDS:\n"
            "        signals.install(); signals.training_started()\n"
            "        if r in sent: os.kill(os.getpid(), sent[r])\n"
            "        q.put((r, agreed_stop_code())); signals.uninstall()\n"
            "    dist.destroy_process_group()\n"
            "ctx = mp.get_context('fork'); q = ctx.Queue()\n"
            "procs = [ctx.Process(target=rank, args=(r, int(sys.argv[1]), q)) for r in (0, 1)]\n"
            "[p.start() for p in procs]; got = [q.get(timeout=60) for _ in range(2 * len(ROUNDS))]\n"
            "[p.join(60) for p in procs]\n"
            "print([[c for rr, c in got if rr == r] for r in (0, 1)], [p.exitcode for p in procs])\n")
    from helpers.dist import free_port

    proc = subprocess.run([sys.executable, "-c", code, str(free_port())], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # per rank, the codes of the rounds: none, SIGINT on 1, SIGTERM on 0, both, SIGUSR1 on 1
    assert proc.stdout.split("\n")[0] == "[[0, 130, 75, 130, 75], [0, 130, 75, 130, 75]] [0, 0]", proc.stdout
