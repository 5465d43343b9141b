"""The runs registry: one SQLite file, ``$LLMFORGE_HOME/runs.db``, shared by every command.

Every run that ``llmforge launch`` starts has a row: id, name, cluster, status, times, the
resolved config (secrets redacted), run directory, process group or scheduler job id, last step
and loss, resumptions, and a timeline of events. ``launch``, the local supervisor, the
in-training :class:`~llmforge.job.tracker.RunTracker` and ``llmforge runs ...`` write it at the
same time: the database is in WAL mode with a busy timeout, and every read-modify-write is one
``BEGIN IMMEDIATE`` transaction, so concurrent writers wait for each other instead of losing
updates. Times are Unix seconds (float). The schema is versioned (SQLite's ``user_version``):
opening a registry written by an older llmforge applies :data:`MIGRATIONS` in one transaction, so
a new column never breaks an existing ``runs.db``. This module imports only the standard library.
"""

from __future__ import annotations

import json
import os
import secrets as _random
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from llmforge.errors import LLMForgeError

STATUSES = ("pending", "running", "completed", "failed", "stopped")
ACTIVE = ("pending", "running")
BUSY_TIMEOUT_MS = 60_000

_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "name": "TEXT NOT NULL", "cluster": "TEXT NOT NULL",
    "kind": "TEXT NOT NULL", "status": "TEXT NOT NULL", "created_at": "REAL NOT NULL",
    "started_at": "REAL", "ended_at": "REAL", "config": "TEXT", "spec": "TEXT",
    "run_dir": "TEXT", "pgid": "INTEGER", "job_id": "TEXT", "last_step": "INTEGER",
    "last_loss": "REAL", "resumptions": "INTEGER NOT NULL DEFAULT 0",
    "retries": "INTEGER NOT NULL DEFAULT 0", "exit_code": "INTEGER",
    "stop_requested": "INTEGER NOT NULL DEFAULT 0", "message": "TEXT", "backend_state": "TEXT",
}
_JSON = ("config", "spec")
SCHEMA_VERSION = 2
# version -> SQL that brings a registry of the version before to it (version 1: the first
# release, written with user_version 0). Append; never edit a released step.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE runs ADD COLUMN backend_state TEXT",),  # the scheduler's last word on the job
}


def llmforge_home() -> Path:
    """``$LLMFORGE_HOME``, else ``~/.config/llmforge`` (created on first use)."""
    home = Path(os.environ.get("LLMFORGE_HOME") or Path.home() / ".config" / "llmforge").expanduser()
    return home.resolve()


class RunNotFound(LLMForgeError):
    """No run (or several) match the given id, id prefix or name. Exit code 2."""

    exit_code = 2


class RegistryError(LLMForgeError):
    """``runs.db`` cannot be used (written by a newer llmforge, or damaged). Exit code 2."""

    exit_code = 2


@dataclass
class RunRecord:
    """One row of the registry. ``config`` and ``spec`` are decoded JSON."""

    id: str
    name: str
    cluster: str
    kind: str
    status: str
    created_at: float
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    config: Any = None
    spec: dict = field(default_factory=dict)
    run_dir: Optional[str] = None
    pgid: Optional[int] = None
    job_id: Optional[str] = None
    last_step: Optional[int] = None
    last_loss: Optional[float] = None
    resumptions: int = 0
    retries: int = 0
    exit_code: Optional[int] = None
    stop_requested: int = 0
    message: Optional[str] = None
    backend_state: Optional[str] = None

    @property
    def active(self) -> bool:
        """Pending or running."""
        return self.status in ACTIVE


def new_run_id(name: str) -> str:
    """``<name>-<6 hex digits>`` (the name shortened to 40 characters, spaces replaced)."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:40] or "run"
    return f"{stem}-{_random.token_hex(3)}"


class RunRegistry:
    """The SQLite registry at ``path`` (default ``$LLMFORGE_HOME/runs.db``).

    Each method opens its own short connection, so an instance may be shared by threads and
    processes may use the file at the same time.

    Raises:
        RunNotFound: from :meth:`get` and :meth:`resolve` when nothing (or more than one run)
            matches.
    """

    def __init__(self, path: Optional[str | Path] = None) -> None:
        self.path = Path(path) if path else llmforge_home() / "runs.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.execute("PRAGMA journal_mode=WAL")
            if con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                return
        self._migrate()

    def _migrate(self) -> None:
        """Create the tables, or bring an older schema up to :data:`SCHEMA_VERSION` (under the
        write lock: processes opening the file at once migrate it once).

        Raises:
            RegistryError: the file's schema is newer than this llmforge's.
        """
        with self.transaction() as con:
            version = con.execute("PRAGMA user_version").fetchone()[0]
            exists = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone()
            if version > SCHEMA_VERSION:
                raise RegistryError(f"{self.path}: runs registry schema {version} is newer than this "
                                    f"llmforge's ({SCHEMA_VERSION}); upgrade llmforge (pip install -U llmforge)")
            if not exists:
                cols = ", ".join(f"{k} {v}" for k, v in _COLUMNS.items())
                con.execute(f"CREATE TABLE runs ({cols})")
            else:
                for step in range(max(version, 1) + 1, SCHEMA_VERSION + 1):
                    for sql in MIGRATIONS[step]:
                        con.execute(sql)
            con.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                        "run_id TEXT NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL, detail TEXT)")
            con.execute("CREATE INDEX IF NOT EXISTS events_run ON events(run_id)")
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # ------------------------------------------------------------ plumbing
    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        try:
            con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            con.row_factory = sqlite3.Row
            yield con
        except sqlite3.DatabaseError as exc:
            # "file is not a database", "database disk image is malformed": not a busy database
            # or a bad query (OperationalError, IntegrityError, ... are subclasses)
            if type(exc) is not sqlite3.DatabaseError and "malformed" not in str(exc):
                raise
            raise RegistryError(f"{self.path} is not a readable runs registry ({exc}); move it "
                                "away (llmforge then starts a new one) or restore a copy") from None
        finally:
            con.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction (the write lock is taken up front)."""
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    @staticmethod
    def _row(row: sqlite3.Row) -> RunRecord:
        data = dict(row)
        for k in _JSON:
            data[k] = json.loads(data[k]) if data[k] else ({} if k == "spec" else None)
        return RunRecord(**data)

    @staticmethod
    def _encode(fields: dict) -> dict:
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {fields['status']!r}")
        return {k: json.dumps(v) if k in _JSON else v for k, v in fields.items()}

    # --------------------------------------------------------------- writes
    def create(self, name: str, cluster: str, kind: str, *, run_id: Optional[str] = None,
               **fields: Any) -> RunRecord:
        """Insert a ``pending`` run; returns it. ``fields`` are other columns (config, spec, ...)."""
        rid = run_id or new_run_id(name)
        data = self._encode({"id": rid, "name": name, "cluster": cluster, "kind": kind,
                             "status": "pending", "created_at": time.time(), **fields})
        with self.transaction() as con:
            con.execute(f"INSERT INTO runs ({', '.join(data)}) VALUES ({', '.join('?' * len(data))})",
                        list(data.values()))
            con.execute("INSERT INTO events (run_id, time, kind, detail) VALUES (?, ?, ?, ?)",
                        (rid, time.time(), "created", f"on {cluster} ({kind})"))
        return self.get(rid)

    def update(self, run_id: str, *, event: Optional[tuple[str, str]] = None, **fields: Any) -> None:
        """Set columns of one run, and optionally append an ``(kind, detail)`` event, atomically."""
        data = self._encode(fields)
        with self.transaction() as con:
            if data:
                sets = ", ".join(f"{k} = ?" for k in data)
                con.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*data.values(), run_id])
            if event:
                con.execute("INSERT INTO events (run_id, time, kind, detail) VALUES (?, ?, ?, ?)",
                            (run_id, time.time(), event[0], event[1]))

    def increment(self, run_id: str, column: str, by: int = 1) -> int:
        """Add ``by`` to an integer column in one transaction; returns the new value."""
        if column not in ("resumptions", "retries", "last_step"):
            raise ValueError(f"cannot increment {column}")
        with self.transaction() as con:
            con.execute(f"UPDATE runs SET {column} = COALESCE({column}, 0) + ? WHERE id = ?", (by, run_id))
            row = con.execute(f"SELECT {column} FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return int(row[0])

    def set_status(self, run_id: str, status: str, detail: str = "", *, only_if_active: bool = False,
                   **fields: Any) -> bool:
        """Set the status (ended_at for final ones) and log an event; with ``only_if_active``
        nothing changes unless the run is pending or running. Returns whether it changed."""
        extra = dict(fields)
        if status not in ACTIVE:
            extra.setdefault("ended_at", time.time())
        data = self._encode({"status": status, **extra})
        with self.transaction() as con:
            row = con.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None or (only_if_active and row[0] not in ACTIVE):
                return False
            sets = ", ".join(f"{k} = ?" for k in data)
            con.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*data.values(), run_id])
            kind = "exit" if row[0] == status and status not in ACTIVE else status  # confirmed
            con.execute("INSERT INTO events (run_id, time, kind, detail) VALUES (?, ?, ?, ?)",
                        (run_id, time.time(), kind, detail))
        return True

    def delete(self, run_id: str) -> None:
        """Remove a run and its events."""
        with self.transaction() as con:
            con.execute("DELETE FROM runs WHERE id = ?", (run_id,))
            con.execute("DELETE FROM events WHERE run_id = ?", (run_id,))

    # ---------------------------------------------------------------- reads
    def get(self, run_id: str) -> RunRecord:
        """The run with exactly this id."""
        with self._connect() as con:
            row = con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(f"no run with id {run_id!r} (see: llmforge runs list)")
        return self._row(row)

    def resolve(self, ref: str) -> RunRecord:
        """A run by id, name (the newest run of that name), or unique id prefix."""
        with self._connect() as con:
            row = con.execute("SELECT * FROM runs WHERE id = ?", (ref,)).fetchone()
            if row is not None:
                return self._row(row)
            row = con.execute("SELECT * FROM runs WHERE name = ? ORDER BY created_at DESC LIMIT 1",
                              (ref,)).fetchone()
            if row is not None:
                return self._row(row)
            rows = con.execute("SELECT * FROM runs WHERE id LIKE ? ESCAPE '\\'",
                               (ref.replace("%", "\\%").replace("_", "\\_") + "%",)).fetchall()
        if len(rows) > 1:
            ids = ", ".join(r["id"] for r in rows[:5])
            raise RunNotFound(f"{ref!r} matches several runs ({ids}); give more of the id")
        if not rows:
            raise RunNotFound(f"no run with id or name {ref!r} (see: llmforge runs list)")
        return self._row(rows[0])

    def list(self, status: Optional[str] = None, cluster: Optional[str] = None) -> list[RunRecord]:
        """Runs, newest first, optionally of one status and/or cluster."""
        where, args = [], []
        if status:
            where.append("status = ?")
            args.append(status)
        if cluster:
            where.append("cluster = ?")
            args.append(cluster)
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(where) if where else "")
        with self._connect() as con:
            rows = con.execute(sql + " ORDER BY created_at DESC", args).fetchall()
        return [self._row(r) for r in rows]

    def events(self, run_id: str) -> list[dict]:
        """The run's timeline: ``[{time, kind, detail}]`` in order."""
        with self._connect() as con:
            rows = con.execute("SELECT time, kind, detail FROM events WHERE run_id = ? ORDER BY seq",
                               (run_id,)).fetchall()
        return [dict(r) for r in rows]
