"""Stop signals, owned by llmforge from the start of the process to its end.

``llmforge train`` calls :func:`install` before anything heavy is imported, so SIGTERM, SIGUSR1
(what schedulers send before preemption or a time limit: SLURM's ``--signal=USR1@s``) and
SIGINT (Ctrl-C) are llmforge's from the first moment. What a signal does depends on the phase:

===========================  =====================================================================
phase                        a stop signal
===========================  =====================================================================
startup (imports, data,      nothing has been trained, so nothing needs saving: the process
tokenizer, model, until the  prints ``stopped: ...`` and exits at once with 75 (SIGTERM/SIGUSR1:
resume checkpoint loaded)    a scheduler requeues) or 130 (SIGINT); a launched run's status
                             becomes ``stopped``. An in-process caller (``install()`` without
                             ``exit_at_once``: tests, ``cli.main(argv)``) gets
                             :class:`StoppedBeforeTraining` raised instead
training (from               only recorded: the Checkpointer finishes the optimizer step, saves
:func:`training_started`)    and raises :class:`~llmforge.callbacks.checkpointing.Preempted` (exit
                             75, or 130 for SIGINT); a second SIGINT stops at once, unsaved
                             (exit 130; in-process: ``KeyboardInterrupt``)
after training               ignored (the final checkpoint is written; the run completes), a
(:func:`training_ended`)     SIGINT stops at once (exit 130; in-process: ``KeyboardInterrupt``)
exiting (:func:`exiting`,    ignored: the exit code already says what happened; a second signal
the command returned)        ends the process at once with 75 or 130
===========================  =====================================================================

Why a startup stop exits at once rather than raise (``os._exit``, as a second signal does when
exiting): the handler runs wherever the main thread is, and an exception raised inside Python code
that C++ called (torch's ``_C._autograd_init`` or ``_c10d_init`` during ``import torch``) cannot
unwind through it: pybind11 calls ``std::terminate`` and the process dies of SIGABRT (exit 134,
status ``failed``; 2 of 100 SIGTERMs sent during ``import torch``). Everything startup writes
(run directory marks, the tokenizer cache, prepared shards) is written to survive a SIGKILL at any
moment, so an exit at once loses nothing. A Ctrl-C that stops at once in the later phases exits
too: raised, Lightning's fit caught the ``KeyboardInterrupt`` and exited 1 without a word (a
"failed" run that ``scheduling.max_retries`` would restart).

Lightning installs its own SIGTERM handler at the start of every ``fit`` (it exits 0 without a
checkpoint); :func:`own` turns that off for one ``lightning.Trainer`` so llmforge's handler is the
one that runs throughout. This module imports only the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

from llmforge.errors import LLMForgeError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" (a scheduler requeues)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class StopRequested(LLMForgeError):
    """The run stopped on a stop signal; ``exit_code`` is 75 (SIGTERM/SIGUSR1) or 130 (SIGINT);
    ``signum``: the signal, where known."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, message: str, exit_code: int = EXIT_PREEMPTED,
                 signum: Optional[int] = None) -> None:
        super().__init__(message)
        self.exit_code, self.signum = exit_code, signum


class StoppedBeforeTraining(StopRequested):
    """A stop signal arrived before training started: nothing to save (exit 75 or 130)."""


def exit_code_for(signum: Optional[int]) -> int:
    """75 for SIGTERM/SIGUSR1 (and ``None``), 130 for SIGINT. Under several ranks the largest of
    theirs is every rank's (:func:`llmforge.callbacks.checkpointing.agreed_stop_code`)."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


class _State:
    phase = "off"  # off | startup | training | finished
    received: Optional[int] = None
    previous: dict[int, Any] = {}  # handlers before install(); restored by uninstall()
    previous_hook: Any = sys.unraisablehook
    exit_at_once = False  # a startup stop: print and os._exit (the process's own command line)
    describe: Optional[Callable[[int], str]] = None  # the startup stop's message, by signal
    children: set[int] = set()  # forked workers an exit at once kills first (add_child)


_state = _State()


def _stopped_before_training(signum: int) -> StoppedBeforeTraining:
    return StoppedBeforeTraining(f"received {signal.Signals(signum).name} before training started: nothing "
                                 f"to save (exit code {exit_code_for(signum)})", exit_code_for(signum), signum)


def _handler(signum: int, frame: Any) -> None:
    phase, first = _state.phase, _state.received
    if signum == signal.SIGINT and (first == signal.SIGINT or phase == "finished"):
        if _state.exit_at_once:  # raised inside fit, Lightning turns it into exit 1, silently
            _exit_now("interrupted: " + ("Ctrl-C after training (its final checkpoint is saved)"
                                         if phase == "finished" else
                                         "a second Ctrl-C stops at once, without saving"), EXIT_INTERRUPTED)
        raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
    if phase == "finished":
        return
    _state.received = first if first is not None else signum
    # startup: stop once; a repeat signal must not raise again inside the error report
    if phase == "startup" and first is None:
        stop = _stopped_before_training(signum)
        if _state.exit_at_once:
            message = str(stop)
            if _state.describe is not None:
                try:
                    message = _state.describe(signum)
                except Exception:  # noqa: BLE001 - the default message then
                    pass
            _exit_now(f"stopped: {message}", stop.exit_code)
        raise stop


def _exit_now(line: str, code: int) -> None:
    """Print ``line`` (rank 0 only: every rank gets the signal) and end the process with exit
    ``code``, running no other Python code (see the module doc). Output buffered so far is
    flushed first; a flush the signal interrupted (a reentrant write) is skipped. The processes
    of :func:`add_child` get SIGKILL first, and so do the process's ``multiprocessing``
    children (the data loader's workers): the ``finally`` that would end them does not run, and
    a worker only notices its parent is gone at its next 5 s status check."""
    pids = set(_state.children)
    mp = sys.modules.get("multiprocessing")  # never imported: no such children
    if mp is not None:
        try:
            pids.update(p.pid for p in mp.active_children() if p.pid)
        except Exception:  # noqa: BLE001 - interrupted inside multiprocessing's own bookkeeping
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - interrupted inside a write to this stream
            pass
    try:
        if os.isatty(1):  # a progress bar (rich) hides the cursor until it stops: show it again
            os.write(1, b"\x1b[?25h\n")
        if os.environ.get("RANK", "0") == "0":
            os.write(2, f"{line}\n".encode())
    except OSError:  # a closed pipe: the exit code says it
        pass
    os._exit(code)


def _quiet_unraisable(unraisable: Any) -> None:
    """``sys.unraisablehook`` while the handlers are installed: a startup stop raised inside a
    callback Python cannot propagate from (importlib's module-lock ``weakref`` callback) is
    printed by Python as "Exception ignored ... Traceback"; the stop is not lost
    (:func:`training_started` raises it again from the recorded signal), so stay silent."""
    if isinstance(unraisable.exc_value, StopRequested):
        return
    _state.previous_hook(unraisable)


def install(exit_at_once: bool = False) -> bool:
    """Own SIGTERM, SIGUSR1 and SIGINT from now on, in the startup phase. Idempotent (installed
    already: nothing changes, a signal already received stays); returns whether this call
    installed the handlers (False: already installed, or not the main thread, where Python
    allows no handlers).

    Args:
        exit_at_once: a stop during startup prints ``stopped: ...`` and ends the process at once
            (75 or 130) instead of raising :class:`StoppedBeforeTraining`: for the process's
            own command line, never for an in-process caller (see the module doc).
    """
    if _state.phase != "off":
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    # blocked while the state is set: a stop in between ran the handler in phase "off" and
    # was then forgotten; now it waits and runs once the state is whole
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        _state.exit_at_once, _state.describe = exit_at_once, None
        _state.previous = {sig: signal.signal(sig, _handler) for sig in STOP_SIGNALS}
        _state.previous_hook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
        _state.phase, _state.received = "startup", None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return True


def uninstall() -> None:
    """Give the signals back to the handlers that were there before :func:`install`."""
    for sig, old in _state.previous.items():
        signal.signal(sig, old)
    if sys.unraisablehook is _quiet_unraisable:
        sys.unraisablehook = _state.previous_hook
    _state.previous, _state.phase, _state.received = {}, "off", None
    _state.exit_at_once, _state.describe = False, None


def describe_startup_stop(describe: Callable[[int], str]) -> None:
    """What a startup stop that exits at once prints after ``stopped:``: ``describe(signum)``
    (``data prepare`` says its finished shards are kept). Build every part of the message
    before calling this: the handler must import nothing (it may have interrupted an import)."""
    _state.describe = describe


def add_child(pid: int) -> None:
    """A forked worker process that must end with this one: an exit at once SIGKILLs it first
    (``data prepare``'s tokenizing workers ignore SIGINT and SIGUSR1, and a ``kill PID`` reaches
    only the parent; orphaned, they ran on to the end of their shard). :func:`remove_child`
    when it was ended normally."""
    _state.children.add(pid)


def remove_child(pid: int) -> None:
    """Forget a process given to :func:`add_child` (ended and reaped: its pid may be reused)."""
    _state.children.discard(pid)


def training_started() -> None:
    """Enter the training phase (signals are recorded; see :func:`received`).

    Raises:
        StoppedBeforeTraining: a stop signal arrived during startup but its exception was
            swallowed by library code on the way (a broad ``except Exception``).
    """
    stop = startup_stop()
    if stop is not None:
        raise stop
    _state.phase, _state.received = "training", None


def startup_stop() -> Optional[StoppedBeforeTraining]:
    """The stop a signal received during startup stands for, or ``None``: what an exception
    raised while that signal unwound library code (e.g. a ``RecursionError`` out of a lazy
    import it interrupted) is reported as (exit 75 or 130, nothing to save)."""
    first = _state.received
    return _stopped_before_training(first) if first is not None and _state.phase == "startup" else None


def training_ended() -> None:
    """Enter the after-training phase (SIGTERM/SIGUSR1 ignored; the run completes)."""
    if _state.phase != "off":
        _state.phase = "finished"


def _late(signum: int, frame: Any) -> None:
    if _state.received is not None:  # a second one: the exit hangs; end it now
        os._exit(exit_code_for(signum))
    _state.received = signum


def exiting() -> None:
    """The command is done (trained and saved, failed or stopped) and the process exits next
    with the code it returned: a stop signal from now on is ignored, a second one ends the
    process at once (``os._exit``, 75 or 130); once the interpreter shuts down (``atexit``) they
    are ignored. Default handlers instead let a signal in the last second (loader workers
    joined, modules torn down) kill a completed run (exit -15, -10 for SIGUSR1, -2 for SIGINT).
    Python resets its own handlers to the default when it finalizes, but not ``SIG_IGN``."""
    import atexit

    if threading.current_thread() is not threading.main_thread():
        return
    _state.phase, _state.received, _state.previous = "exiting", None, {}
    for sig in STOP_SIGNALS:
        signal.signal(sig, _late)
    atexit.register(lambda: [signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS])


def received() -> Optional[int]:
    """The first stop signal of the training phase, or None."""
    return _state.received if _state.phase == "training" else None


def phase() -> str:
    """``off``, ``startup``, ``training``, ``finished`` or ``exiting``."""
    return _state.phase


def own(trainer: Any) -> None:
    """Keep Lightning's SIGTERM handler out of ``trainer``'s ``fit`` (it would set its own flag
    and exit 0 without saving, or, installed over ours, hide the signal from the Checkpointer).
    Lightning installs it through the trainer's signal connector at every ``fit``; the connector
    then has nothing to restore."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "register_signal_handlers"):
        connector.register_signal_handlers = lambda: None


__all__ = ["EXIT_INTERRUPTED", "EXIT_PREEMPTED", "STOP_SIGNALS", "StopRequested", "StoppedBeforeTraining",
           "add_child", "describe_startup_stop", "exit_code_for", "exiting", "install", "own", "phase",
           "received", "remove_child", "training_ended", "training_started", "uninstall"]
