"""Compute threads per training process, chosen from the cores this process may use.

torch's default intra-op pool has one thread per *installed* core. On a machine whose cores
are shared (other processes, data workers, the other ranks of ``--nproc``) that pool
oversubscribes them: measured on 2 shared cores, the demo ran 10-30x slower than with
``OMP_NUM_THREADS=1`` (issue 18; ``benchmarks/threads.py`` measures it side by side). PyTorch's
CPU performance guide gives the same rule: one compute thread per core a process owns.

:func:`choose_num_threads` takes the cores of ``os.sched_getaffinity`` (what the scheduler,
taskset or SLURM's cgroup allow), divides them among the ranks of this node and subtracts each
rank's data workers; ``trainer.num_threads`` overrides it, and so does ``OMP_NUM_THREADS`` when
it is set (a user's or a launcher's explicit choice). No torch import here: the choice is part
of the resolved run (:mod:`llmforge.preflight.resolve`) and applied by the Trainer.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["TORCHRUN_SET_OMP", "available_cores", "choose_num_threads"]

# torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset; llmforge's launcher notes
# that value here, so the workers still choose from their cores (a user's own value wins)
TORCHRUN_SET_OMP = "LLMFORGE_TORCHRUN_SET_OMP"


def available_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where the
    platform has no affinity, e.g. macOS)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def choose_num_threads(override: Optional[int], local_world_size: int, num_workers: int,
                       cores: Optional[int] = None,
                       environ: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """Intra-op threads for one training process, and a line that says why.

    ``cores // local_world_size - num_workers``, at least 1: each rank gets its share of the
    cores, less one per DataLoader worker of its own (workers run torch with one thread).

    Args:
        override: ``trainer.num_threads`` (a positive count), or ``None`` for the choice above.
        local_world_size: training processes on this node (``--nproc``, ``LOCAL_WORLD_SIZE``).
        num_workers: ``data.num_workers`` of each process.
        cores: cores available (default :func:`available_cores`).
        environ: the environment (default ``os.environ``); a positive ``OMP_NUM_THREADS`` wins
            over the choice above (not over ``override``), unless torchrun set it (the value
            is then also in ``LLMFORGE_TORCHRUN_SET_OMP``, see :mod:`llmforge.job.torchrun`).
    """
    cores = available_cores() if cores is None else cores
    env = os.environ if environ is None else environ
    if override is not None:
        return int(override), f"trainer.num_threads={override} ({cores} cores available)"
    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) >= 1 and env.get(TORCHRUN_SET_OMP) != omp:
        return int(omp), f"OMP_NUM_THREADS={omp} ({cores} cores available)"
    share = cores // max(1, local_world_size)
    n = max(1, share - num_workers)
    per = f" / {local_world_size} processes" if local_world_size > 1 else ""
    workers = f" - {num_workers} data worker{'s' * (num_workers != 1)}" if num_workers else ""
    floor = ", at least 1" if share - num_workers < 1 else ""
    return n, f"{cores} cores available{per}{workers}{floor}; set trainer.num_threads to change"
