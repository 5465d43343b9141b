"""torchft's lighthouse, the process through which replica groups form their quorums
(:mod:`llmforge.parallel.fault_tolerance`): its command line, the one starter llmforge uses
(``llmforge launch``, the SLURM and local backends' job scripts, ``benchmarks/ft.py``, the tests),
and the reachability check a run makes at its start."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from llmforge.errors import ConfigError, LLMForgeError

__all__ = ["check_lighthouse", "lighthouse_command", "start_lighthouse"]


def check_lighthouse(address: str, wait_s: float = 5.0) -> None:
    """Connect to the lighthouse at ``address`` (``http://HOST:PORT``), retrying for ``wait_s``
    seconds (a lighthouse started beside the groups may still be coming up).

    Raises:
        ConfigError: it cannot be reached; names ``fault_tolerance.lighthouse``."""
    parts = urlsplit(address)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=wait_s):
                return
        except (OSError, ValueError) as exc:
            if time.monotonic() >= deadline or isinstance(exc, ValueError):
                raise ConfigError(f"fault_tolerance.lighthouse={address}: cannot reach it ({exc}); "
                                  f"start one (`torchft_lighthouse --min_replicas 1 --bind "
                                  f"{parts.hostname}:{parts.port}`) or fix the address") from exc
            time.sleep(0.2)


def lighthouse_command(bind: str, min_replicas: int = 1, join_timeout_ms: int = 1000,
                       heartbeat_timeout_ms: int = 2000, quorum_tick_ms: int = 100,
                       exe: Optional[str] = None) -> list[str]:
    """The argument list of torchft's lighthouse (``torchft_lighthouse``, from the wheel of the
    ``llmforge[ft]`` extra) listening on ``bind`` (``HOST:PORT``).

    ``join_timeout_ms``: how long a quorum waits for stragglers beyond ``min_replicas`` (torchft's
    default, 60 s, would make a rejoin wait a minute; 1 s here); ``heartbeat_timeout_ms``: a
    group silent this long is dead. ``exe`` defaults to the one beside this interpreter."""
    exe = exe or shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    return [exe, "--min_replicas", str(int(min_replicas)), "--join_timeout_ms", str(int(join_timeout_ms)),
            "--heartbeat_timeout_ms", str(int(heartbeat_timeout_ms)),
            "--quorum_tick_ms", str(int(quorum_tick_ms)), "--bind", bind]


def start_lighthouse(port: int, host: str = "127.0.0.1", min_replicas: int = 1, *,
                     join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 2000,
                     wait_s: float = 30.0, log: Optional[Path] = None,
                     detach: bool = False) -> subprocess.Popen:
    """Start torchft's lighthouse on ``HOST:PORT`` (:func:`lighthouse_command`) and return its
    process once it accepts connections; the caller stops it (``proc.kill()``).

    The one lighthouse starter of llmforge: ``llmforge launch`` (:mod:`llmforge.job.ft_groups`),
    ``benchmarks/ft.py`` and the tests use it. ``log``: a file for its output (else discarded);
    ``detach``: in a session of its own (it outlives the caller's terminal and process group).

    Raises:
        LLMForgeError: the executable is missing (``pip install 'llmforge[ft]'``), or nothing
            listens on the port within ``wait_s`` seconds (the port is taken, say).
    """
    cmd = lighthouse_command(f"{host}:{int(port)}", min_replicas, join_timeout_ms, heartbeat_timeout_ms)
    try:  # something already listening there would pass the readiness check below
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        pass
    else:
        raise LLMForgeError(f"cannot start a torchft lighthouse on {host}:{port}: the port is taken")
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=detach)
    except OSError as exc:
        raise LLMForgeError(f"cannot start the torchft lighthouse {cmd[0]} ({exc}): "
                            "pip install 'llmforge[ft]'") from exc
    finally:
        if log is not None:
            out.close()  # the child holds its own copy
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise LLMForgeError(f"the torchft lighthouse did not listen on {host}:{port} within {wait_s:.0f} s "
                        f"(exit {proc.returncode}; is the port taken?)")
