"""The tokenizing processes of ``llmforge data prepare``: forked workers, each fed through a
pipe of its own.

Why not ``multiprocessing.Pool``: its workers share one task queue guarded by a lock that an
idle worker holds while it waits for a task. A SIGTERM to the process group kills that worker
holding the lock, and ``Pool.terminate()`` (also run at the interpreter's exit) waits for the
lock for ever: ``data prepare`` hung instead of exiting 75 (issue 50.7). Here no lock is
shared: task ``k`` goes to worker ``k % n`` and its result is read back from that worker's pipe,
so ending the pool is killing and reaping processes, whatever state they died in. A worker
that ends on its own (the OOM killer) is an error naming it, not a wait for ever; when the
parent dies (SIGKILL) each worker reads the end of its pipe and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from typing import Any, Callable

from llmforge.errors import LLMForgeError
from llmforge.signals import STOP_SIGNALS, add_child, remove_child


class WorkerDied(LLMForgeError):
    """A tokenizing worker ended without being asked to (exit code 1)."""


def _serve(conn: Any, inherited: list, initializer: Callable[..., None], initargs: tuple,
           work: Callable[[Any], Any]) -> None:
    """A worker's loop: ``work(task)`` for each task received, its result (or exception) sent
    back, until the pipe ends. Stop signals are blocked from before the fork until
    ``initializer`` has set this process's handlers (a signal in between would run the
    parent's handler here)."""
    for other in inherited:  # the parent's ends: only the parent may hold them, so its death ends our recv
        other.close()
    try:
        initializer(*initargs)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            reply = ("ok", work(task))
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
            reply = ("error", exc)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        except Exception as exc:  # an exception that does not pickle
            conn.send(("error", LLMForgeError(f"{type(exc).__name__}: {exc}")))


class ShardPool:
    """``workers`` forked processes running ``work`` on tasks, results read in task order.

    Args:
        workers: number of processes (>= 1).
        initializer: called with ``initargs`` in each worker first (sets its signal handlers:
            ``SIGTERM`` must keep its default action there, :func:`llmforge.data.shard_writer.init_worker`).
        work: a task to its (picklable) result, in the worker.
    """

    def __init__(self, workers: int, initializer: Callable[..., None], initargs: tuple,
                 work: Callable[[Any], Any]) -> None:
        ctx = mp.get_context("fork")  # starts in milliseconds and works from any __main__
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._sent = self._read = 0
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for _ in range(workers):
                mine, theirs = ctx.Pipe(duplex=True)
                self._conns.append(mine)
                proc = ctx.Process(target=_serve, args=(theirs, list(self._conns), initializer, initargs, work),
                                   daemon=True, name="llmforge-prepare")
                proc.start()
                add_child(proc.pid)  # a stop that exits at once ends it too
                theirs.close()
                self._procs.append(proc)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            self.close()
            raise
        try:  # a stop signal that came during the forks is raised here
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        except BaseException:
            self.close()
            raise

    def submit(self, task: Any) -> None:
        """Send the next task (blocks while its worker's pipe is full).

        Raises:
            WorkerDied: its worker has ended (a BrokenPipeError would read as a closed stdout).
        """
        i = self._sent % len(self._conns)
        try:
            self._conns[i].send(task)
        except OSError:
            raise self._died(i) from None
        self._sent += 1

    def ready(self) -> bool:
        """Whether the oldest task not yet read has its result waiting."""
        return self._read < self._sent and self._conns[self._read % len(self._conns)].poll()

    def result(self) -> Any:
        """The result of the oldest task not yet read (waits for it).

        Raises:
            the task's exception (e.g. DataError, WriteError), or WorkerDied: its worker ended.
        """
        i = self._read % len(self._conns)
        try:
            status, value = self._conns[i].recv()
        except (EOFError, OSError):
            raise self._died(i) from None
        self._read += 1
        if status == "error":
            raise value
        return value

    def _died(self, i: int) -> WorkerDied:
        proc = self._procs[i]
        proc.join(1)
        code = proc.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        oom = " (the OOM killer? fewer --workers use less memory)" if code == -signal.SIGKILL else ""
        return WorkerDied(f"a tokenizing worker (pid {proc.pid}) ended ({how}){oom}; the shards "
                          "written so far are kept: run the same command again to continue")

    def close(self) -> None:
        """End every worker (SIGTERM, then SIGKILL after 5 s) and reap it; never waits on a
        worker's state. Idempotent."""
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            remove_child(proc.pid)
        self._procs, self._conns = [], []
