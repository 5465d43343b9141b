"""Compute threads re-chosen during a run, as other processes come and go.

The thread rule (:func:`llmforge.parallel.threads.choose_num_threads`) counts the cores other
processes keep busy when the run starts. On a shared machine that count changes within
minutes (on this project's 2-core machine the load average went from 1 to 16 in ten minutes),
and a run that started on idle cores with 2 threads then oversubscribes them: measured 2x
(issue 27) to 10-30x (issue 18) slower than 1 thread. :class:`ThreadWatch` repeats the choice
every ``every_seconds`` between two steps (the count leaves out this process's own threads,
:func:`llmforge.parallel.threads.own_running_threads`, which still spin there) and takes a new
count once two checks in a row agree (:func:`llmforge.parallel.threads.settle`). The Trainer
adds it only where llmforge chose the threads: one process per node, no ``trainer.num_threads``
or ``OMP_NUM_THREADS``, and every core of the machine available (the count is machine-wide).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.parallel.threads import busy_cores, choose_num_threads, settle

EVERY_SECONDS = 15.0
"""Seconds between two checks: ~40 ms of reads each, 0.3% of the wall time."""


class ThreadWatch(Callback):
    """Re-choose torch's compute threads every ``every_seconds`` (wall clock) of training.

    Args:
        worker_cores: cores the data workers take (see
            :func:`llmforge.preflight.resolve.worker_cores`).
        every_seconds: seconds between two checks (each reads ``/proc/loadavg`` for ~40 ms).
        read_busy: cores other processes keep busy now (default :func:`busy_cores`).
        cores: cores available (default :func:`llmforge.parallel.threads.available_cores`).
        announce: print each change on stderr (rank 0 of the job).
        clock: monotonic seconds (default :func:`time.monotonic`).

    ``changes`` lists ``(step, threads before, threads after)`` for each change made.
    """

    def __init__(self, worker_cores: int, every_seconds: float = EVERY_SECONDS,
                 read_busy: Callable[[], Optional[float]] = busy_cores,
                 clock: Callable[[], float] = time.monotonic, cores: Optional[int] = None,
                 announce: bool = False) -> None:
        self.worker_cores = int(worker_cores)
        self.every_seconds = float(every_seconds)
        self.read_busy = read_busy
        self.clock = clock
        self.cores = cores
        self.announce = announce
        self.changes: list[tuple[int, int, int]] = []
        self._pending: Optional[int] = None
        self._next = 0.0

    def fit_start(self, state: Any) -> None:
        self._next = self.clock() + self.every_seconds

    def step_recorded(self, state: Any) -> None:
        """Event ``STEP_RECORDED``: between two steps, when this run's threads are idle."""
        now = self.clock()
        if now < self._next:
            return
        choice, why = choose_num_threads(None, 1, self.worker_cores, cores=self.cores, environ={},
                                       busy=self.read_busy())
        current = torch.get_num_threads()
        threads, self._pending = settle(current, self._pending, choice)
        if threads != current:
            torch.set_num_threads(threads)
            self.changes.append((state.step, current, threads))
            if self.announce:  # rich's live bar, where there is one, prints it above itself
                print(f"threads: {current} -> {threads} compute thread{'s' * (threads != 1)} at "
                      f"step {state.step} ({why.split(';')[0]})", file=sys.stderr, flush=True)
        self._next = self.clock() + self.every_seconds  # the reads' own ~40 ms not counted
