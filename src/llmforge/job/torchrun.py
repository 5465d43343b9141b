"""``python -m llmforge.job.torchrun ARGS``: torchrun (same arguments) that keeps the exit code.

Plain ``torchrun`` exits 1 whenever a worker fails, so a scheduler cannot tell a clean
preemption (llmforge exits 75 after saving) from a crash. This runs torch's own launcher
(``torch.distributed.run``: argument parsing, rendezvous, elastic agent) and exits with:

- 0 when every worker succeeded;
- 75 when a worker exited 75 (saved on SIGTERM/SIGUSR1), else 2 when one exited 2 (a
  configuration error), else the first failed rank's code (128 + N for a worker killed by
  signal N);
- when the launcher itself got SIGTERM or SIGINT (it has forwarded it to the workers and waited
  ``--shutdown-timeout`` seconds for them): 75 or 130, what llmforge's workers exit with on it
  (they save first when training); 128 + N for another signal N.

Its workers die with it: it names itself in :data:`LAUNCHER_ENV`, and each worker's
``llmforge train`` asks the kernel for SIGKILL when its parent ends
(:func:`die_with_launcher`). torch's agent starts the workers in sessions of their own, so a
SIGKILL of the launcher (or of its process group) would otherwise leave them training.

SIGUSR1 — what SLURM sends before a time limit — is forwarded to every worker's process group
(workers are session leaders) instead of killing the launcher. A worker that has not installed
llmforge's handlers yet (its interpreter is still starting) gets it once it has (within
:data:`FORWARD_WAIT_S`), so a SIGUSR1 during startup stops it with exit 75 instead of killing it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence
from llmforge.parallel.threads import TORCHRUN_SET_OMP
from llmforge.run_guard import LAUNCHER_ENV
from llmforge.signals import exit_code_for, STOP_SIGNALS

FORWARD_WAIT_S = 60.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(environ: Optional[dict] = None) -> bool:
    """In a worker started by llmforge's launcher (:data:`LAUNCHER_ENV` set): have the kernel
    SIGKILL this process when its parent ends (``prctl(PR_SET_PDEATHSIG)``, Linux), then check
    that the parent is still that launcher, since it may have died before the call (the process
    then kills itself the same way; a launcher that runs but is not its parent is not its
    launcher: nothing is set). The variable is removed, so processes this one starts do not
    take this one's launcher for theirs. Returns whether the death signal is set.

    SIGKILL, not SIGTERM: the launcher's end means the run crashed; a worker that went on to save
    would write beside the run that resumes it (the lock died with the launcher)."""
    env = os.environ if environ is None else environ
    raw = env.pop(LAUNCHER_ENV, None)
    if not raw or not sys.platform.startswith("linux"):
        return False
    try:
        expected = int(raw)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (ValueError, OSError, AttributeError):
        return False
    if os.getppid() != expected:
        try:
            os.kill(expected, 0)
        except ProcessLookupError:  # the launcher died before the call: do what it would have done
            print(f"llmforge: the launcher (pid {expected}) has ended; this worker stops",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        except (PermissionError, OverflowError):
            pass
        # it runs, but is not this process's parent: the variable came from further up (a
        # process that started this one's parent); not this process's launcher
        libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        return False
    return True


def proc_table() -> Optional[dict[int, tuple[int, int, str]]]:
    """``{pid: (ppid, pgid, state)}`` from /proc, or None where /proc is missing."""
    root = Path("/proc")
    if not (root / "self" / "stat").exists():
        return None
    table = {}
    for stat in root.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; empty where /proc is missing)."""
    return [p for p, (ppid, _, _) in (proc_table() or {}).items() if ppid == pid]


def catches(pid: int, sig: int) -> Optional[bool]:
    """Whether process ``pid`` has a handler for ``sig`` installed (``SigCgt`` in
    /proc/PID/status); None where that cannot be read (no /proc, the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def forward(pids: Sequence[int], sig: int, deadline: float) -> list[int]:
    """Send ``sig`` to each pid's process group (or the pid) once it catches ``sig``; those that
    do not yet are retried every 0.2 s in a timer thread until ``deadline`` (monotonic seconds),
    then sent anyway. Returns the pids left for later."""
    later = [p for p in pids if catches(p, sig) is False and time.monotonic() < deadline]
    for child in (p for p in pids if p not in later):
        try:
            os.killpg(child, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass
    if later:
        timer = threading.Timer(0.2, forward, (later, sig, deadline))
        timer.daemon = True
        timer.start()
    return later


def _forward_usr1(signum: int, frame: object) -> None:
    forward(child_pids(os.getpid()), signal.SIGUSR1, time.monotonic() + FORWARD_WAIT_S)


def exit_code(failures: dict) -> int:
    """The code to exit with for torchelastic's ``{rank: ProcessFailure}`` (see module doc)."""
    codes = [f.exitcode for _, f in sorted(failures.items())]
    for wanted in (75, 2):
        if wanted in codes:
            return wanted
    if not codes:
        return 1
    code = codes[0]
    return 128 - code if code < 0 else (code or 1)


def signal_exit_code(sigval: int) -> int:
    """The exit code of a launcher stopped by signal ``sigval`` after torch's agent passed it on:
    the workers' own (75 for SIGTERM/SIGUSR1, 130 for SIGINT; :mod:`llmforge.signals`), not
    128 + N, which reads as a crash (status ``failed``, automatic retries) although they saved."""
    return exit_code_for(sigval) if sigval in STOP_SIGNALS else 128 + int(sigval)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse torchrun arguments, run the workers, return the exit code (see module doc)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    signal.signal(signal.SIGUSR1, _forward_usr1)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers die with this process
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun will set 1: let the workers choose
        os.environ[TORCHRUN_SET_OMP] = "1"
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        return exit_code(exc.failures)
    except SignalException as exc:
        return signal_exit_code(int(exc.sigval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
