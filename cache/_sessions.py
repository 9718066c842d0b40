"""Session stores for one machine, behind the kernel's `SessionStore` seam.

`MemorySessionStore` holds the sessions of one process (tests, a single worker, several
dispatchers in one process); `SqliteSessionStore` holds them in one SQLite file that
the worker processes of a machine share (each step one `BEGIN IMMEDIATE` transaction,
leases expiring on the wall clock). Unlike the result cache, a store's fault raises:
the kernel must not report a batch's state kept when it was not.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, TypeVar

import anyio.to_thread
import attrs

from dispatcher import Lease, SessionBusy, StoredSession

from ._sqlite import set_wal

__all__ = ["DEFAULT_LEASE_SECONDS", "MemorySessionStore", "SqliteSessionStore"]

DEFAULT_LEASE_SECONDS: Final = 30.0
_PRIVATE_FILE: Final = 0o600

T = TypeVar("T")


def _check_seconds(lease_seconds: float) -> float:
    if not lease_seconds > 0:
        raise ValueError(f"lease_seconds must be positive seconds, got {lease_seconds!r}")
    return float(lease_seconds)


@attrs.define
class _Held:
    """One session in memory: its snapshot, its started marks, and who holds it until when."""

    snapshot: bytes | None = None
    started: set[str] = attrs.field(factory=set)
    token: str | None = None
    expires: float = 0.0


class MemorySessionStore:
    """A `SessionStore` in this process's memory. `clock` returns seconds (monotonic)."""

    def __init__(
        self, lease_seconds: float = DEFAULT_LEASE_SECONDS, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lease_seconds = _check_seconds(lease_seconds)
        self._clock = clock
        self._sessions: dict[str, _Held] = {}

    def _holding(self, lease: Lease) -> _Held:
        """The session `lease` still holds, or SessionBusy."""
        held = self._sessions.get(lease.session_id)
        if held is None or held.token != lease.token or held.expires <= self._clock():
            raise SessionBusy(lease.session_id, "this worker's lease expired or was taken over")
        return held

    async def acquire(self, session_id: str) -> Lease:
        held = self._sessions.setdefault(session_id, _Held())
        now = self._clock()
        if held.token is not None and held.expires > now:
            raise SessionBusy(session_id)
        lease = Lease(session_id, secrets.token_hex(16), self.lease_seconds)
        held.token, held.expires = lease.token, now + lease.seconds
        return lease

    async def renew(self, lease: Lease) -> bool:
        try:
            held = self._holding(lease)
        except SessionBusy:
            return False
        held.expires = self._clock() + lease.seconds
        return True

    async def release(self, lease: Lease) -> None:
        held = self._sessions.get(lease.session_id)
        if held is not None and held.token == lease.token:
            held.token, held.expires = None, 0.0

    async def load(self, session_id: str) -> StoredSession:
        held = self._sessions.get(session_id)
        if held is None:
            return StoredSession()
        return StoredSession(held.snapshot, frozenset(held.started))

    async def save(self, lease: Lease, snapshot: bytes) -> None:
        held = self._holding(lease)
        held.snapshot = bytes(snapshot)
        held.started.clear()

    async def mark_started(self, lease: Lease, call_ids: Sequence[str]) -> None:
        self._holding(lease).started.update(call_ids)

    async def delete(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    snapshot BLOB,
    token TEXT,
    expires REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS started (
    id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    PRIMARY KEY (id, call_id)
);
"""


class SqliteSessionStore:
    """A `SessionStore` in one SQLite file, shared by the processes of one machine.

    Every step that writes is one transaction taken with `BEGIN IMMEDIATE` (so two workers acquiring
    at once are serialised by SQLite, and one of them gets `SessionBusy`); lease expiry
    is wall-clock time (`clock`), which the processes of one machine share. The blocking
    calls run in a worker thread; the file is created 0600."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        clock: Callable[[], float] = time.time,
        busy_timeout: float = 10.0,
    ) -> None:
        self.lease_seconds = _check_seconds(lease_seconds)
        self.path = Path(path)
        self._clock = clock
        # one connection per store, used by one thread at a time: SQLite's own locking
        # orders the processes, this lock the threads of this one
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), _PRIVATE_FILE))
        self._db = sqlite3.connect(
            self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        with self._lock:
            set_wal(self._db, busy_timeout)
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the connection (the store is unusable afterwards)."""
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self, *, writes: bool = True) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._db
            # a writer takes the write lock at once, so its checks and its writes are one
            # step; a reader reads one consistent state of both tables, and (WAL) waits on nobody
            db.execute("BEGIN IMMEDIATE" if writes else "BEGIN")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    async def _run(self, fn: Callable[[], T]) -> T:
        # not abandoned on cancellation: a step the caller gave up on still completes, so
        # the transaction is never left half done by this process
        return await anyio.to_thread.run_sync(fn)

    def _check_held(self, db: sqlite3.Connection, lease: Lease) -> None:
        row = db.execute("SELECT token, expires FROM sessions WHERE id = ?", (lease.session_id,)).fetchone()
        if row is None or row[0] != lease.token or row[1] <= self._clock():
            raise SessionBusy(lease.session_id, "this worker's lease expired or was taken over")

    async def acquire(self, session_id: str) -> Lease:
        lease = Lease(session_id, secrets.token_hex(16), self.lease_seconds)

        def take() -> None:
            with self._transaction() as db:
                now = self._clock()
                row = db.execute("SELECT token, expires FROM sessions WHERE id = ?", (session_id,)).fetchone()
                if row is not None and row[0] is not None and row[1] > now:
                    raise SessionBusy(session_id)
                db.execute(
                    "INSERT INTO sessions (id, token, expires) VALUES (?, ?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET token = excluded.token, expires = excluded.expires",
                    (session_id, lease.token, now + lease.seconds),
                )

        await self._run(take)
        return lease

    async def renew(self, lease: Lease) -> bool:
        def extend() -> bool:
            with self._transaction() as db:
                now = self._clock()
                done = db.execute(
                    "UPDATE sessions SET expires = ? WHERE id = ? AND token = ? AND expires > ?",
                    (now + lease.seconds, lease.session_id, lease.token, now),
                )
                return done.rowcount == 1

        return await self._run(extend)

    async def release(self, lease: Lease) -> None:
        def give_up() -> None:
            with self._transaction() as db:
                db.execute(
                    "UPDATE sessions SET token = NULL, expires = 0 WHERE id = ? AND token = ?",
                    (lease.session_id, lease.token),
                )

        await self._run(give_up)

    async def load(self, session_id: str) -> StoredSession:
        def read() -> StoredSession:
            with self._transaction(writes=False) as db:
                row = db.execute("SELECT snapshot FROM sessions WHERE id = ?", (session_id,)).fetchone()
                marks = db.execute("SELECT call_id FROM started WHERE id = ?", (session_id,)).fetchall()
            snapshot = None if row is None or row[0] is None else bytes(row[0])
            return StoredSession(snapshot, frozenset(m[0] for m in marks))

        return await self._run(read)

    async def save(self, lease: Lease, snapshot: bytes) -> None:
        data = bytes(snapshot)

        def write() -> None:
            with self._transaction() as db:
                self._check_held(db, lease)
                db.execute("UPDATE sessions SET snapshot = ? WHERE id = ?", (data, lease.session_id))
                db.execute("DELETE FROM started WHERE id = ?", (lease.session_id,))

        await self._run(write)

    async def mark_started(self, lease: Lease, call_ids: Sequence[str]) -> None:
        ids = list(call_ids)

        def mark() -> None:
            with self._transaction() as db:
                self._check_held(db, lease)
                db.executemany(
                    "INSERT OR IGNORE INTO started (id, call_id) VALUES (?, ?)",
                    [(lease.session_id, call_id) for call_id in ids],
                )

        await self._run(mark)

    async def delete(self, session_id: str) -> None:
        def forget() -> None:
            with self._transaction() as db:
                db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
                db.execute("DELETE FROM started WHERE id = ?", (session_id,))

        await self._run(forget)
