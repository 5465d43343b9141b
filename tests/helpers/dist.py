"""The one way tests start real multi-process runs: ``torchrun --standalone`` on gloo (CPU).

Every multi-process test goes through :func:`torchrun`, so the environment is the same
everywhere: this checkout's ``src`` first on ``PYTHONPATH`` (a worktree never imports another
checkout's llmforge) and one compute thread per process (two processes share two cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(*args: str, nproc: int = 2, timeout: int = 300, env: dict | None = None,
             launcher_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node NPROC ARGS``.

    ``args`` is a worker script and its arguments, or ``-m llmforge train ...``; returns the
    CompletedProcess (text output captured). Raises ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *launcher_args, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def worker(name: str) -> str:
    """The path of ``tests/dist/NAME`` (a worker script run by :func:`torchrun`)."""
    return str(REPO / "tests" / "dist" / name)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmforge(*args: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``python -m llmforge ARGS`` (one process, this checkout's ``src`` first on
    ``PYTHONPATH``, one compute thread) with stdout and stderr into ``log``; the caller waits."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "llmforge", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=full_env, cwd=REPO)


def torchrun_job(*args: str, nproc: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start llmforge's launcher (``python -m llmforge.job.torchrun --standalone``, torchrun's
    arguments; its workers die with it) with NPROC workers running ARGS, output into ``log``;
    the caller waits. A SIGKILL of the returned process ends every worker of the job."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "llmforge.job.torchrun", "--standalone",
                                 "--nproc-per-node", str(nproc), *args], stdout=out,
                                stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
