"""Folders a run writes into, checked before anything is built, and ``OSError`` turned into one
user-facing line that names the file.

:func:`check_writable_dir` probes without creating anything: the nearest existing ancestor must
be a folder this process may write into. :func:`os_error_message` is what the CLI prints for a
read or write error nobody foresaw (exit code 2 instead of a traceback).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from llmforge.errors import ConfigError, LLMForgeError


class WriteError(LLMForgeError):
    """A file or folder llmforge must write cannot be written (a file where a folder is
    needed, a read-only or full disk, no permission). Exit code 2."""

    exit_code = 2


def check_printable(value: str, key: str) -> None:
    """``value`` (a name or path) holds no control character (``\\x00``-``\\x1f``, ``\\x7f``:
    a newline in a name rendered into a job script starts a new shell command).

    Raises:
        ConfigError: naming ``key`` and showing the value with the character escaped.
    """
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"{key}={value!r} holds a control character (newline, tab, ...); use "
                          f"printable characters only in {key}")


def check_writable_dir(path: str | Path, key: str) -> None:
    """``path`` exists as a writable folder, or could be created as one.

    Args:
        path: the folder (e.g. the run directory).
        key: the config key that chose it, named in the message (e.g. ``run.output_dir``).

    Raises:
        WriteError: ``path`` or an ancestor is a file, or the nearest existing ancestor is not
            writable (read-only file system, no permission).
    """
    path = Path(path).expanduser().absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        raise WriteError(f"{key}: {path} {where}, not a folder; choose another {key}")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "on a read-only file system" if _read_only(probe) else "not writable by this user"
        what = "is" if probe == path else f"cannot be created: {probe} is"
        raise WriteError(f"{key}: {path} {what} {why}; choose another {key}")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def os_error_message(exc: OSError) -> str:
    """``cannot write FILE: No space left on device`` style text for an ``OSError``."""
    name = exc.filename if exc.filename is not None else "a file"
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    verb = "write" if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EEXIST,
                                    errno.ENOTDIR, errno.EISDIR) else "use"
    return f"cannot {verb} {name}: {reason}"
