"""Compute threads per process, chosen from the cores this process may use and what else runs.

torch's default intra-op pool has one thread per *installed* core. On a machine whose cores
are busy (other processes, the other ranks of ``--nproc``) that pool oversubscribes them:
measured on 2 shared cores, the demo ran 10-30x slower than with ``OMP_NUM_THREADS=1``
(issue 18) and ``generate`` 3-80x slower (issue 27). On idle cores the same pool is the fastest
(issue 27: 2 threads gave ~6,700 tokens/s against ~3,800 with 1). PyTorch's CPU performance
guide gives the rule: one compute thread per core a process has to itself.

:func:`choose_num_threads` is that rule, in this one place, for training, ``generate`` and
``eval``: the cores of ``os.sched_getaffinity`` (what the scheduler, taskset or SLURM's cgroup
allow) divided among the ranks of this node, less the data workers that do real work, and no
more than the cores other processes leave free right now (:func:`busy_cores`, read only where
this process may run on every core of the machine: the count is machine-wide).
``trainer.num_threads`` overrides it, and so does ``OMP_NUM_THREADS`` when it is set (a user's or
a launcher's explicit choice). A single process repeats the choice every 15 s while it trains
(:class:`llmforge.callbacks.threads.ThreadWatch`, with :func:`settle`).
``benchmarks/threads.py`` and ``benchmarks/generate.py --burner`` measure it side by side. No
torch import here: the choice is part of the resolved run (:mod:`llmforge.preflight.resolve`)
and applied by the Trainer (and the generate/eval commands).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Mapping, Optional

__all__ = ["TORCHRUN_SET_OMP", "MACHINE", "available_cores", "busy_cores", "choose_num_threads",
           "explicit_threads", "machine_wide", "own_running_threads", "settle"]

# torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset; llmforge's launcher notes
# that value here, so the workers still choose from their cores (a user's own value wins)
TORCHRUN_SET_OMP = "LLMFORGE_TORCHRUN_SET_OMP"

MACHINE = "machine"
"""``busy`` default of :func:`choose_num_threads`: look at the machine (:func:`busy_cores`)."""


def available_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where the
    platform has no affinity, e.g. macOS)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def own_running_threads() -> int:
    """Threads of this process other than the caller that are running or runnable now (state
    ``R`` in ``/proc/self/task/*/stat``; 0 where there is no ``/proc``).

    Why: after a parallel region torch's OpenMP threads spin before they sleep (libgomp's
    ``GOMP_SPINCOUNT``); measured on 2 shared cores, 20 ms after a matmul the second thread was
    still running in 90% of reads, 50 ms after in 35%: a machine-wide count taken between two
    steps must not take them for another process."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        n += stat[stat.rfind(")") + 2:stat.rfind(")") + 3] == "R"  # after "pid (name) "
    return max(0, n - 1)


def busy_cores(samples: int = 9, interval: float = 0.004) -> Optional[float]:
    """Cores other processes keep busy now: the median over ``samples`` reads, ``interval``
    seconds apart (~40 ms in all), of the runnable tasks in ``/proc/loadavg`` (its 4th field,
    ``running/total``, which counts this process's threads too: less the caller and
    :func:`own_running_threads`). Where there is no ``/proc/loadavg`` (macOS), the 1-minute
    load average; None where neither exists.

    Why not the load average alone: it trails by a minute, so a run started right after
    another would see the finished one's load and take too few threads; the median of reads
    over a few milliseconds ignores one short burst.
    """
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg", encoding="ascii") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            break
        counts.append(running - 1 - own_running_threads())
        if i + 1 < samples:
            time.sleep(interval)
    if counts:
        return float(max(0, statistics.median(counts)))
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_wide(cores: int) -> bool:
    """Whether ``cores`` (this process's) are every core of the machine, so that the machine-wide
    count of :func:`busy_cores` applies (not under taskset or a SLURM cgroup)."""
    return cores >= (os.cpu_count() or 1)


def explicit_threads(override: Optional[int],
                     environ: Mapping[str, str]) -> Optional[tuple[int, str]]:
    """The user's own count and where it came from (``trainer.num_threads``, else a positive
    ``OMP_NUM_THREADS`` that torchrun did not set), or None: llmforge chooses."""
    if override is not None:
        return int(override), f"trainer.num_threads={override}"
    omp = environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) >= 1 and environ.get(TORCHRUN_SET_OMP) != omp:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    return None


def settle(current: int, pending: Optional[int], choice: int) -> tuple[int, Optional[int]]:
    """One re-check of the threads during a run: ``(threads to use, choice pending)``.

    A new ``choice`` is taken only when the check before chose it too (``pending``), so one
    reading that lands in another process's short burst changes nothing; a choice equal to
    ``current`` clears what was pending.
    """
    if choice == current:
        return current, None
    if choice == pending:
        return choice, None
    return current, choice


def choose_num_threads(override: Optional[int], local_world_size: int, worker_cores: int,
                       cores: Optional[int] = None, environ: Optional[Mapping[str, str]] = None,
                       busy: Optional[float] | str = MACHINE) -> tuple[int, str]:
    """Intra-op threads for one process, and a line that says why.

    ``min(cores // local_world_size - worker_cores, (cores - busy - (local_world_size - 1))
    // local_world_size)``, at least 1: each rank gets its share of the cores, less one per data
    worker that does real work, and no more than its share of the cores nobody else is using.

    Args:
        override: ``trainer.num_threads`` (a positive count), or ``None`` for the choice above.
        local_world_size: processes on this node (``--nproc``, ``LOCAL_WORLD_SIZE``; 1 for
            generate and eval).
        worker_cores: cores the data workers of each process take: ``data.num_workers`` where
            they tokenize (streaming sources), 0 where they only slice windows already in memory
            or memory-mapped (measured: such a worker is busy for 0.06-0.16% of a step).
        cores: cores available (default :func:`available_cores`).
        environ: the environment (default ``os.environ``); a positive ``OMP_NUM_THREADS`` wins
            over the choice above (not over ``override``), unless torchrun set it (the value
            is then also in ``LLMFORGE_TORCHRUN_SET_OMP``, see :mod:`llmforge.job.torchrun`).
        busy: cores other processes keep busy (tasks; this node's other ranks are taken off),
            None = do not look; default: :func:`busy_cores` when this process may run on every
            core of the machine, else None (taskset, SLURM: the count is machine-wide).
    """
    cores = available_cores() if cores is None else cores
    env = os.environ if environ is None else environ
    own = explicit_threads(override, env)
    if own is not None:
        return own[0], f"{own[1]}; {cores} cores available"
    local = max(1, local_world_size)
    if busy == MACHINE:
        busy = busy_cores() if machine_wide(cores) else None
    share = cores // local
    n = share - worker_cores
    per = f" / {local} processes" if local > 1 else ""
    why = f"{cores} cores available{per}"
    if worker_cores:
        why += f" - {worker_cores} data worker{'s' * (worker_cores != 1)}"
    if busy is not None:
        others = max(0.0, float(busy) - (local - 1))  # this node's other ranks are not others
        free = int(cores - others) // local
        if free < n:
            n = free
            why += f", {others:g} runnable thread{'s' * (others != 1)} of other processes"
    if n < 1:
        why += ", at least 1"
    return max(1, n), why + "; set trainer.num_threads to change"
