"""The lock that makes one process (tree) the writer of a run directory; see
:mod:`llmforge.run_guard` for the rules."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

from llmforge.errors import ConfigError
from llmforge.run_guard.marks import LOCK, MARK, _now, mark_run_dir, refuse_file_link

__all__ = ["LAUNCHER_ENV", "LOCK", "TOKEN_ENV", "WAIT_S", "RunDirBusy", "RunLock", "peek_holder"]

TOKEN_ENV = "LLMFORGE_RUN_LOCK"
"""Environment variable with the lock holder's token, inherited by the processes it starts."""
LAUNCHER_ENV = "LLMFORGE_LAUNCHER_PID"
"""Environment variable with the pid of the process that started a worker (the lock holder, or
llmforge's torchrun launcher): the worker dies with it
(:func:`llmforge.job.torchrun.die_with_launcher`)."""
WAIT_S = 30.0
"""How long taking over a dead holder's lock waits for the processes it left (seconds): the
data-loader workers of a killed process notice within 5 s (torch's watchdog)."""


class RunDirBusy(ConfigError):
    """Another live process holds the run directory's lock. Exit code 2."""


def _read_holder(fd: int) -> Optional[dict[str, Any]]:
    """The holder JSON of the open lock file, or None (empty: released cleanly, or unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode("utf-8", "replace").strip()
        holder = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _token_hash(token: str) -> str:
    """What the lock file stores of a token: its SHA-256 (hex)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _alive(holder: dict[str, Any]) -> Optional[bool]:
    """Whether the holder's process runs (None: on another host, cannot tell from here)."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _describe(holder: Optional[dict[str, Any]]) -> str:
    if not holder:
        return "another process (no holder information)"
    return (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('started')}")


def _busy(path: Path, holder: Optional[dict[str, Any]], os_lock: bool = True,
          left: Sequence[int] = ()) -> RunDirBusy:
    if not os_lock:  # no flock on this file system: the holder's word is all there is
        why = f" (this file system has no locks: if that run is gone, delete {path / LOCK})"
    elif holder and _alive(holder) is False:
        pids = f" (pids {', '.join(map(str, left))})" if left else ""
        why = (f" (that pid has ended, but processes it started{pids} still run or hold the lock "
               f"after {WAIT_S:g} s: stop them, then run again)")
    else:
        why = ""
    return RunDirBusy(f"run directory {path} is in use by {_describe(holder)}{why}; one process "
                      "writes a run at a time: wait for it to finish, stop it, or choose another "
                      "run.name")


def _own(holder: Optional[dict[str, Any]]) -> bool:
    """The holder is this process's own run (its token was inherited from the holder)."""
    token = os.environ.get(TOKEN_ENV)
    return bool(token and holder and holder.get("token_sha256") == _token_hash(token))


def _carriers(holder: Optional[dict[str, Any]]) -> list[int]:
    """Live processes on this host, other than this one, started with the holder's token in
    their environment (``/proc/PID/environ``; the same user's processes only; empty without
    /proc or on another host)."""
    want = (holder or {}).get("token_sha256")
    if not want or holder.get("host") != socket.gethostname() or not os.path.isdir("/proc/self"):
        return []
    prefix = (TOKEN_ENV + "=").encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        if state in (b"Z", b"X"):
            continue
        for var in env.split(b"\0"):
            token = var[len(prefix):].decode("utf-8", "replace") if var.startswith(prefix) else None
            if token is not None and _token_hash(token) == want:
                found.append(int(entry.name))
    return sorted(found)


def _wait_for_leftovers(path: Path, fd: int, holder: Optional[dict[str, Any]],
                        locked: bool) -> tuple[bool, list[int]]:
    """A dead holder's lock: wait up to :data:`WAIT_S` for the processes it started to end and
    (when ``locked`` is false) for the lock to be free, with one line on stderr. Returns whether
    ``fd`` now holds the lock and the pids still running with the holder's token."""
    deadline = time.monotonic() + WAIT_S
    said = False
    while True:
        if not locked:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                pass
        left = _carriers(holder)
        if (locked and not left) or time.monotonic() >= deadline:
            return locked, left
        if not said:
            what = f"pids {', '.join(map(str, left))}" if left else "the process holding the lock"
            print(f"note: {path} was held by {_describe(holder)}, which has ended; waiting up to "
                  f"{WAIT_S:g} s for what it started to exit ({what})", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.2)


def _held_by_the_dead(holder: Optional[dict[str, Any]]) -> bool:
    return bool(holder) and not _own(holder) and _alive(holder) is False


def peek_holder(path: Path) -> None:
    """Check, without taking it, that no other live process holds ``path``'s lock (the early
    check of ``llmforge train``, before the run directory is read). When the holder has ended
    but processes it started remain (they hold the lock, or carry its token), it waits for them
    up to :data:`WAIT_S` seconds, saying so on stderr.

    Raises:
        RunDirBusy: another process of another run holds it, or the processes a dead holder
            started are still there after :data:`WAIT_S` seconds (their pids named).
        ConfigError: the lock or the mark is a link, a pipe or a folder (:func:`refuse_file_link`).
    """
    refuse_file_link(path / MARK)  # what acquire would write through: refused early
    refuse_file_link(path / LOCK)
    try:
        fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file (or no run directory): free
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if _own(holder):
                return
            locked, left = (_wait_for_leftovers(path, fd, holder, False) if _held_by_the_dead(holder)
                            else (False, []))
            if not locked or left:
                raise _busy(path, holder, left=left) from None
        except OSError:
            return  # no OS locks on this file system: RunLock.acquire decides
        try:
            holder = _read_holder(fd)
            if _held_by_the_dead(holder):  # before the run directory is read: orphans may write
                _, left = _wait_for_leftovers(path, fd, holder, True)
                if left:
                    raise _busy(path, holder, left=left)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class RunLock:
    """The lock on one run directory, held from :meth:`acquire` to :meth:`release`.

    Args:
        path: the run directory (created and marked by :meth:`acquire`).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd: Optional[int] = None
        self.token: Optional[str] = None
        self.took_over: Optional[dict[str, Any]] = None
        """The holder info a killed process left behind, when :meth:`acquire` took its lock over."""

    def acquire(self) -> "RunLock":
        """Take the lock (a no-op in a process the holder started: :data:`TOKEN_ENV`); a lock a
        killed process left is taken over, with a line on stderr naming it.

        Raises:
            RunDirBusy: another live process holds it (the message names its host, pid and
                start time).
            ConfigError: the lock or the mark is a link, a pipe or a folder (:func:`refuse_file_link`).
        """
        refuse_file_link(self.path / LOCK)
        refuse_file_link(self.path / MARK)
        self.path.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link put there after the check is not followed either (ELOOP)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if _own(holder):
                os.close(fd)
                return self
            locked, left = False, []
            if _held_by_the_dead(holder):  # a process it started still holds it: wait a while
                locked, left = _wait_for_leftovers(self.path, fd, holder, False)
            if not locked or left:
                os.close(fd)
                raise _busy(self.path, holder, left=left) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            holder = _read_holder(fd)  # no OS locks here: trust a holder that may be alive
            if holder and not _own(holder) and _alive(holder) is not False:
                os.close(fd)
                raise _busy(self.path, holder, os_lock=False) from None
        self.fd = fd
        _HELD.add(self)  # closed in forked children (data-loader workers): see _close_in_child
        try:
            old = _read_holder(fd)
            if _held_by_the_dead(old):  # torchrun workers of a killed launcher still running?
                _, left = _wait_for_leftovers(self.path, fd, old, True)
                if left:
                    raise _busy(self.path, old, left=left)
            mark_run_dir(self.path)  # under the lock: the first write to the run directory
        except BaseException:
            self.fd = None
            _HELD.discard(self)
            os.close(fd)
            raise
        if old and not _own(old):
            self.took_over = old
            print(f"note: took over the lock of {self.path} left by {_describe(old)}, which is no "
                  "longer running", file=sys.stderr, flush=True)
        token = uuid.uuid4().hex
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(),
                "token_sha256": _token_hash(token)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        os.fsync(fd)
        os.environ[TOKEN_ENV] = self.token = token
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks it starts die with it
        return self

    def release(self) -> None:
        """Empty the holder info (a clean end is not a stale lock) and drop the lock; safe to call
        twice, and a no-op for a process that did not take it."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        _HELD.discard(self)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the holder info then reads as a killed process's: the next run takes it over
        finally:
            os.close(fd)  # closing the only descriptor drops the flock
            if os.environ.get(TOKEN_ENV) == self.token:
                del os.environ[TOKEN_ENV]
            if os.environ.get(LAUNCHER_ENV) == str(os.getpid()):
                del os.environ[LAUNCHER_ENV]

    def __del__(self) -> None:  # a Trainer set up but never fit, then dropped
        try:
            self.release()
        except Exception:
            pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_HELD: "weakref.WeakSet[RunLock]" = weakref.WeakSet()
"""The locks this process holds."""


def _close_in_child() -> None:
    """In a forked child (a data-loader worker): close the copies of the held locks'
    descriptors. Closing (never ``LOCK_UN``, which would unlock the parent's open file too)
    leaves the parent's lock as it was; the child's objects forget the descriptor, so a
    ``release`` there empties nothing."""
    for lock in list(_HELD):
        fd, lock.fd, lock.token = lock.fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
