"""What llmforge may do to a run directory: the mark that says llmforge made it, and the lock
that makes one process its writer.

**The mark.** Every run directory llmforge creates holds :data:`MARK` (``.llmforge-run``, a
small JSON file). ``llmforge train`` writes into, and ``--overwrite`` deletes, only a folder
that is empty, missing, or an llmforge run (:func:`is_run_dir`): marked, or made by an llmforge
version before the mark (its own ``config.yaml`` beside ``metrics.jsonl``, or a complete
checkpoint ``checkpoints/step_<digits>/COMPLETE``; such a folder is marked when a run adopts it). A
run directory that is a symbolic link is refused (:func:`check_run_dir`): writing through it would
mix the new run into the old one's files. Before ``--overwrite`` clears anything, the paths the
command will read are checked against what it clears (:func:`refuse_overlap`); a
``checkpoint.dir`` inside another run is refused (:func:`refuse_run_inside_run`); ``convert
to-hf --overwrite`` replaces only a folder it exported itself (:data:`EXPORT_MARK`).

**The lock.** :class:`RunLock` holds an exclusive ``flock(2)`` on :data:`LOCK`
(``.llmforge-lock`` inside the run directory) for the whole run; the file holds the holder's
host, pid, start time and the SHA-256 of a token as JSON (the file is world-readable: the token
itself stays in the holder's environment). A second process gets :class:`RunDirBusy` (exit 2)
naming the holder. The kernel drops the lock when its process dies, so a lock left by a killed
process is free: the next run takes it over and says whose it was. Processes started by the
holder (torchrun's workers under ``--nproc``, Lightning's re-run ranks) inherit the token in
:data:`TOKEN_ENV` and are recognized as the same run, and die with the holder
(:data:`LAUNCHER_ENV`); in a job started by any other launcher
only rank 0 takes the lock (the caller decides, see :meth:`llmforge.Trainer.setup`).

**The whole process tree.** Processes forked by the holder (data-loader workers) close their
copy of the lock's descriptor at once (``os.register_at_fork``): a ``flock`` belongs to the open
file, so a forked copy would hold it after the holder died. When the holder is dead, taking the
lock over first waits, at most :data:`WAIT_S` seconds and saying so, for the processes that
still carry its token (found through ``/proc/PID/environ``: torchrun's workers whose launcher was
killed, before :func:`llmforge.job.torchrun.die_with_launcher` ends them) and for a descendant
that still holds the lock; if they do not end, :class:`RunDirBusy` names them.

``flock`` is used directly rather than the ``filelock`` package: the holder's JSON must be
readable by the process that is refused, from the file the lock is on.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml

from llmforge.errors import ConfigError
from llmforge.paths import is_special_file

__all__ = ["EXPORT_MARK", "LAUNCHER_ENV", "LOCK", "MARK", "TOKEN_ENV", "RunDirBusy", "RunLock",
           "check_export_dir", "check_run_dir", "clear_run_dir", "is_run_dir", "mark_run_dir",
           "peek_holder", "refuse_file_link", "refuse_link", "refuse_overlap", "refuse_run_inside_run"]

MARK = ".llmforge-run"
EXPORT_MARK = ".llmforge-export"
"""The mark of a Hugging Face folder ``llmforge convert to-hf`` wrote: the one kind of
non-empty folder its ``--overwrite`` replaces."""
LOCK = ".llmforge-lock"
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


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a folder llmforge made: it holds :data:`MARK`, or it has the layout
    of a run written before the mark existed: ``metrics.jsonl`` beside the ``config.yaml``
    llmforge saved for a run of this folder's name, or a complete checkpoint ``checkpoints/step_<digits>/COMPLETE`` (the names of
    :mod:`llmforge.checkpoint.layout`)."""
    if (path / MARK).is_file():
        return True
    if (path / "metrics.jsonl").is_file() and _premark_config(path):
        return True
    return any((path / "checkpoints").glob("step_[0-9]*/COMPLETE"))


def _premark_config(path: Path) -> bool:
    """``path/config.yaml`` is the resolved config llmforge saved in it: a mapping with ``model``
    and ``trainer`` sections and ``run.name`` equal to the folder's name (any folder may hold a
    ``config.yaml`` beside a ``metrics.jsonl``; only llmforge's names its own folder)."""
    config = path / "config.yaml"
    try:
        if not config.is_file() or config.stat().st_size > 1 << 20:
            return False
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError):
        return False
    run = data.get("run") if isinstance(data, dict) else None
    return (isinstance(run, dict) and run.get("name") == path.name
            and isinstance(data.get("model"), dict) and isinstance(data.get("trainer"), dict))


def check_run_dir(path: Path, key: str) -> None:
    """Refuse a run directory llmforge must not write into (nor ``--overwrite`` delete).

    Args:
        path: the run directory (``run.output_dir/run.name``) or checkpoint folder.
        key: the config key that chose it, named in the message.

    Raises:
        ConfigError: ``path`` is a symbolic link, or a non-empty folder that is not an llmforge
            run (:func:`is_run_dir`).
    """
    refuse_link(path, key)
    if path.is_dir() and any(path.iterdir()) and not is_run_dir(path):
        raise ConfigError(f"{key}: {path} is not empty and is not an llmforge run (no {MARK} file); "
                          "llmforge neither trains into nor deletes (--overwrite) a folder it did not "
                          f"make: choose another {key}, or move the files away")


def refuse_link(path: Path, key: str) -> None:
    """Raises ConfigError when ``path`` (the folder itself, not its parents) is a symbolic link."""
    if path.is_symlink():
        raise ConfigError(f"{key}: {path} is a symbolic link (to {os.path.realpath(path)}); llmforge "
                          "does not write a run through a link (the new run would mix with the old "
                          "one's files, and --overwrite would not replace them): give the folder it "
                          "points to instead")


def refuse_file_link(path: Path) -> None:
    """Raises ConfigError when ``path`` (the mark or the lock) exists but is not a regular file:
    writing through a symbolic link would truncate or create the file it points to (a run
    directory someone shared may hold ``.llmforge-lock -> ~/.bashrc``); opening a named pipe
    blocks for ever; a folder cannot be opened."""
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link (to {os.path.realpath(path)}); llmforge writes "
                          "its run files only into the run directory itself: delete the link")
    if is_special_file(path):
        raise ConfigError(f"{path} is not a regular file; llmforge keeps its own small file there: "
                          "delete it")


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def refuse_overlap(cleared: Iterable[tuple[str, Path]], inputs: Iterable[tuple[str, str]],
                   flag: str = "--overwrite") -> None:
    """Refuse to clear a folder that holds a path the same command will read.

    ``--overwrite`` deletes before the new run reads its inputs: fine-tuning a run in place
    (``model.init_from`` = the run being replaced), a round trip ``convert from-hf RUN/hf RUN``,
    would delete the very files it needs. Paths are compared after links and ``~`` are resolved.

    Args:
        cleared: ``(key, folder)`` pairs ``flag`` will delete (e.g. ``("run.name", runs/ip)``).
        inputs: ``(key, path)`` pairs the command reads (``model.init_from``, ``tokenizer.path``,
            ``data.path``, ...); URLs and empty values are skipped, a glob is checked by the
            folder before its first wildcard.

    Raises:
        ConfigError: naming both keys and both paths (exit 2); nothing is deleted.
    """
    cleared = [(key, _real(folder)) for key, folder in cleared]
    for in_key, value in inputs:
        local = _local_part(value)
        if local is None:
            continue
        path = _real(local)
        for out_key, folder in cleared:
            if path == folder or folder in path.parents:
                raise ConfigError(
                    f"{in_key}={value} lies inside {folder} ({out_key}), which {flag} would delete "
                    f"before {in_key} is read; copy it elsewhere first, or choose another {out_key}")


def _local_part(value: Any) -> Optional[str]:
    """The local path a config value names (``hf:PATH`` -> PATH; a glob -> its folder), or None
    for a URL or an empty value."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return None
    text = str(value).removeprefix("hf:").removeprefix("file://")
    if "://" in text:
        return None
    for i, ch in enumerate(text):
        if ch in "*?[":
            return os.path.dirname(text[:i]) or "."
    return text


def refuse_run_inside_run(path: Path, run_dir: Path, key: str) -> None:
    """Refuse a folder (``checkpoint.dir``) that is, or lies inside, an llmforge run other than
    ``run_dir``: this run's ``--overwrite`` and ``keep_last_n`` would delete that run's checkpoints.

    Raises:
        ConfigError: naming ``key`` and the other run's folder (exit 2).
    """
    own = _real(run_dir)
    for folder in [_real(path), *_real(path).parents]:
        if folder == own or own in folder.parents:
            return  # inside this run (or below it): its own
        if folder.is_dir() and is_run_dir(folder):
            raise ConfigError(f"{key}={path} lies inside another llmforge run, {folder}; its "
                              f"checkpoints are that run's to keep: choose a {key} outside it (or "
                              f"leave {key} unset for {run_dir}/checkpoints)")


def check_export_dir(path: Path, key: str, overwrite: bool) -> bool:
    """May ``llmforge convert to-hf`` write its folder at ``path``? Returns whether an earlier
    export there is replaced (``overwrite`` and :data:`EXPORT_MARK` present).

    Raises:
        ConfigError: ``path`` is a symbolic link or a file; it is a non-empty folder without
            ``overwrite``; or a non-empty folder llmforge did not export (no :data:`EXPORT_MARK`),
            which ``overwrite`` does not touch either.
    """
    refuse_link(path, key)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a folder; choose another {key}")
    if not path.is_dir() or not any(path.iterdir()):
        return False
    if not overwrite:
        raise ConfigError(f"{key}: {path} already exists and is not empty; choose another output "
                          "folder or pass --overwrite to replace an earlier export there")
    if not (path / EXPORT_MARK).is_file():
        raise ConfigError(f"{key}: {path} is not empty and is not a folder llmforge exported (no "
                          f"{EXPORT_MARK} file); --overwrite replaces only llmforge's own exports: "
                          "choose an empty or new folder")
    return True


def clear_run_dir(path: Path) -> None:
    """Delete what a run directory holds (``--overwrite``; :func:`check_run_dir` has passed),
    except :data:`MARK` and :data:`LOCK` (the lock stays held by this process). Links inside are
    removed, never followed.

    Raises:
        ConfigError: ``path`` is a symbolic link.
    """
    refuse_link(path, "run.name")
    if not path.is_dir():
        return
    for entry in path.iterdir():
        if entry.name in (MARK, LOCK):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def mark_run_dir(path: Path) -> bool:
    """Create ``path`` (and parents) if needed and write :data:`MARK` if missing; returns
    whether the mark was written now."""
    path.mkdir(parents=True, exist_ok=True)
    mark = path / MARK
    refuse_file_link(mark)
    if mark.exists():
        return False
    mark.write_text(json.dumps({"made_by": "llmforge", "created": _now()}) + "\n", encoding="utf-8")
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


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
