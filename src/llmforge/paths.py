"""Folders a run writes into, checked before anything is built, and ``OSError`` turned into one
user-facing line that names the file.

:func:`check_writable_dir` probes without creating anything: the nearest existing ancestor must
be a folder this process may write into. :func:`os_error_message` is what the CLI prints for a
read or write error nobody foresaw (exit code 2 instead of a traceback). :func:`all_or_nothing`
wraps the writing of an output (an export folder, a consolidated file): a full disk leaves no
half-written output behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator, Optional

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


def resolve_dotdot(path: str | os.PathLike) -> Path:
    """``path`` with its ``..`` resolved as the file system resolves them, to an absolute path
    (``os.path.realpath``): after a symbolic link that exists, the link's target's parent; after
    a folder that does not exist yet, the name as written (``new/../x`` is ``x``: no folder, no
    link to follow). A path without ``..`` is returned as given. Writers that check an output
    and then create its folders see one path: ``new/../x`` does not stat while ``new`` is
    missing, so a check by that name missed an existing ``x``, and creating ``new`` on the way
    left it behind; code that normalises ``link/..`` by its text wrote elsewhere than the folder
    the file system made."""
    path = Path(path)
    return Path(os.path.realpath(path)) if ".." in path.parts else path


def is_special_file(path: str | os.PathLike) -> bool:
    """``path`` exists (links followed) but is not a regular file: a named pipe (opening it
    blocks for ever), a device, a socket or a folder. Files llmforge reads or appends to from a
    run someone else made are checked with it first."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing or unreadable: the reader names it
        return False


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


def write_failed(exc: OSError, target: str | Path, after: str = "") -> WriteError:
    """A :class:`WriteError` naming the file of ``exc`` (else ``target``) and its reason."""
    if exc.filename is None:
        exc = OSError(exc.errno, exc.strerror or str(exc), str(target))
    return WriteError(os_error_message(exc) + (f"; {after}" if after else ""))


@contextlib.contextmanager
def all_or_nothing(target: str | Path) -> Iterator[Path]:
    """Write ``target`` (a file or a folder) completely or not at all: on an ``OSError`` (a
    full disk, a vanished folder) what the block created is removed (the whole ``target`` if it
    did not exist before, else the entries it added) and a :class:`WriteError` names the file.

    Raises:
        WriteError: the block raised an ``OSError``.
    """
    target = Path(target)
    before: Optional[set] = None
    if target.is_dir():
        before = {p.name for p in target.iterdir()}
    elif target.exists():
        before = set()  # an existing file is replaced whole or kept: see the caller
    try:
        yield target
    except OSError as exc:
        _remove_new(target, before)
        raise write_failed(exc, target, f"nothing of {target} is left half-written; free space "
                                        "or choose another place and run it again") from None


def _remove_new(target: Path, before: Optional[set]) -> None:
    if before is None:  # the block created it
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
    elif target.is_dir():
        for p in target.iterdir():
            if p.name not in before:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
