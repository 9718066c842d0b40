"""The error stores behind the kernel's `ErrorStore` seam: failures remembered by signature.

`MemoryErrorStore` keeps them in a dict, for tests and short-lived processes.
`DiskErrorStore` keeps them in one SQLite file, `errors.db`, in a folder (by default the
result cache's, `default_cache_dir()`), shared by every process of the machine that opens
it: each write is one `BEGIN IMMEDIATE` transaction, so two processes counting the same
signature never lose a count. A connection is opened per operation, in a worker thread,
so the store has no thread or fork to care about.

A folder or database that cannot be opened (unwritable, not a database) is logged once to
the `threepass.cache` logger and leaves the disk store disabled: it remembers and finds
nothing, and `healthy` is False. Faults later on raise to the caller (the session logs
them; `error_history` and `write_error` fail with them).

Both keep the `max_records` most recently seen signatures and forget older ones. What
they hold is what pass 3 hands them: the error's first line already redacted and
bounded, the arguments' shape, never a value. Still, nobody else's business: a folder
the disk store creates is 0700, the database and its `-wal` and `-shm` files are 0600.

Nothing from trio or above the kernel is imported here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import anyio.to_thread
import attrs

from dispatcher._seams import ErrorRecord

from ._disk import default_cache_dir
from ._sqlite import set_wal

__all__ = ["DEFAULT_MAX_RECORDS", "DiskErrorStore", "MemoryErrorStore"]

DEFAULT_MAX_RECORDS: Final = 1000
_MAX_RESOLUTION: Final = 1000
_DATABASE: Final = "errors.db"
_PRIVATE_DIR: Final = 0o700
_PRIVATE_FILE: Final = 0o600
_log = logging.getLogger("threepass.cache")

_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS threepass_errors ("
    " signature TEXT PRIMARY KEY, tool TEXT NOT NULL, shape TEXT NOT NULL, error TEXT NOT NULL,"
    " first_seen REAL NOT NULL, last_seen REAL NOT NULL, count INTEGER NOT NULL, resolution TEXT"
    ")",
    "CREATE INDEX IF NOT EXISTS threepass_errors_last_seen ON threepass_errors (last_seen)",
    "CREATE INDEX IF NOT EXISTS threepass_errors_tool ON threepass_errors (tool)",
)
_COLUMNS: Final = "tool, signature, shape, error, first_seen, last_seen, count, resolution"
_UPSERT: Final = (
    f"INSERT INTO threepass_errors ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, NULL)"
    " ON CONFLICT (signature) DO UPDATE SET count = count + excluded.count,"
    " last_seen = max(last_seen, excluded.last_seen), error = excluded.error, shape = excluded.shape"
)
_TRIM: Final = (
    "DELETE FROM threepass_errors WHERE signature NOT IN"
    " (SELECT signature FROM threepass_errors ORDER BY last_seen DESC LIMIT ?)"
)


def _matches(record: ErrorRecord, tool: str | None, text: str | None, signature: str | None) -> bool:
    if tool is not None and record.tool != tool:
        return False
    if signature is not None and record.signature != signature:
        return False
    if text is not None:
        folded = text.casefold()
        return folded in record.error.casefold() or folded in (record.resolution or "").casefold()
    return True


def _stamped(record: ErrorRecord, now: float) -> ErrorRecord:
    """A record seen at `now` when it carries no time of its own."""
    if record.last_seen:
        return record
    return attrs.evolve(record, first_seen=now, last_seen=now)


class MemoryErrorStore:
    """An `ErrorStore` in this process's memory. `clock` returns wall-time seconds."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, max_records: int = DEFAULT_MAX_RECORDS
    ) -> None:
        self._clock = clock
        self._max = max_records
        self._records: dict[str, ErrorRecord] = {}

    async def lookup(self, signatures: Sequence[str]) -> dict[str, ErrorRecord]:
        return {s: self._records[s] for s in signatures if s in self._records}

    async def record_many(self, records: Sequence[ErrorRecord]) -> None:
        now = self._clock()
        for record in records:
            record = _stamped(record, now)
            seen = self._records.get(record.signature)
            if seen is not None:
                record = attrs.evolve(
                    record,
                    first_seen=seen.first_seen,
                    last_seen=max(seen.last_seen, record.last_seen),
                    count=seen.count + record.count,
                    resolution=seen.resolution,
                )
            self._records[record.signature] = record
        if len(self._records) > self._max:
            newest = sorted(self._records.values(), key=lambda r: r.last_seen, reverse=True)[: self._max]
            self._records = {r.signature: r for r in newest}

    async def resolve(self, signature: str, resolution: str | None) -> ErrorRecord | None:
        seen = self._records.get(signature)
        if seen is None:
            return None
        resolved = attrs.evolve(seen, resolution=None if resolution is None else resolution[:_MAX_RESOLUTION])
        self._records[signature] = resolved
        return resolved

    async def search(
        self,
        *,
        tool: str | None = None,
        text: str | None = None,
        signature: str | None = None,
        limit: int = 20,
    ) -> list[ErrorRecord]:
        found = [r for r in self._records.values() if _matches(r, tool, text, signature)]
        return sorted(found, key=lambda r: r.last_seen, reverse=True)[: max(0, limit)]


def _record(row: Sequence[Any]) -> ErrorRecord:
    tool, signature, shape, error, first_seen, last_seen, count, resolution = row
    try:
        pairs = json.loads(shape)
        parsed = tuple((str(k), str(v)) for k, v in pairs)
    except (ValueError, TypeError):
        parsed = ()
    return ErrorRecord(
        tool=str(tool),
        signature=str(signature),
        shape=parsed,
        error=str(error),
        first_seen=float(first_seen),
        last_seen=float(last_seen),
        count=int(count),
        resolution=None if resolution is None else str(resolution),
    )


class DiskErrorStore:
    """An `ErrorStore` in `directory/errors.db` (SQLite), shared by the processes of one
    machine. `directory` defaults to `default_cache_dir()`, beside the result cache.
    `clock` stamps records that carry no time; `timeout` is how long a write waits for
    another process's lock."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        max_records: int = DEFAULT_MAX_RECORDS,
        timeout: float = 5.0,
    ) -> None:
        self._directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self._path = self._directory / _DATABASE
        self._clock = clock
        self._max = max_records
        self._timeout = timeout
        self._healthy = False
        try:
            if not self._directory.is_dir():
                self._directory.mkdir(mode=_PRIVATE_DIR, parents=True, exist_ok=True)
                self._directory.chmod(_PRIVATE_DIR)
            if not self._path.exists():
                os.close(os.open(self._path, os.O_WRONLY | os.O_CREAT, _PRIVATE_FILE))
                self._path.chmod(_PRIVATE_FILE)
            with self._connect() as con:
                for statement in _SCHEMA:
                    con.execute(statement)
        except (OSError, sqlite3.Error) as exc:
            _log.warning("error store %s disabled: cannot open it: %s", self._path, exc)
        else:
            self._healthy = True

    @property
    def healthy(self) -> bool:
        """False when the store could not be opened: then it keeps and finds nothing."""
        return self._healthy

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self._path, timeout=self._timeout, isolation_level=None)
        try:
            set_wal(con, self._timeout)
            for suffix in ("-wal", "-shm"):  # SQLite gives them the database's mode; made sure
                with contextlib.suppress(FileNotFoundError):
                    Path(f"{self._path}{suffix}").chmod(_PRIVATE_FILE)
            yield con
        finally:
            con.close()

    # -- the async seam: each operation in a worker thread ---------------------------------

    async def lookup(self, signatures: Sequence[str]) -> dict[str, ErrorRecord]:
        return await anyio.to_thread.run_sync(self.lookup_sync, list(signatures))

    async def record_many(self, records: Sequence[ErrorRecord]) -> None:
        await anyio.to_thread.run_sync(self.record_many_sync, list(records))

    async def resolve(self, signature: str, resolution: str | None) -> ErrorRecord | None:
        return await anyio.to_thread.run_sync(self.resolve_sync, signature, resolution)

    async def search(
        self,
        *,
        tool: str | None = None,
        text: str | None = None,
        signature: str | None = None,
        limit: int = 20,
    ) -> list[ErrorRecord]:
        return await anyio.to_thread.run_sync(lambda: self.search_sync(tool, text, signature, limit))

    # -- the same, synchronous ----------------------------------------------------------------

    def lookup_sync(self, signatures: Sequence[str]) -> dict[str, ErrorRecord]:
        if not signatures or not self._healthy:
            return {}
        marks = ", ".join("?" * len(signatures))
        query = f"SELECT {_COLUMNS} FROM threepass_errors WHERE signature IN ({marks})"
        with self._connect() as con:
            return {r.signature: r for r in map(_record, con.execute(query, list(signatures)))}

    def record_many_sync(self, records: Sequence[ErrorRecord]) -> None:
        if not records or not self._healthy:
            return
        now = self._clock()
        rows = []
        for record in records:
            r = _stamped(record, now)
            shape = json.dumps([list(pair) for pair in r.shape])
            rows.append((r.tool, r.signature, shape, r.error, r.first_seen, r.last_seen, r.count))
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                con.executemany(_UPSERT, rows)
                con.execute(_TRIM, (self._max,))
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def resolve_sync(self, signature: str, resolution: str | None) -> ErrorRecord | None:
        if not self._healthy:
            return None
        text = None if resolution is None else resolution[:_MAX_RESOLUTION]
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                con.execute(
                    "UPDATE threepass_errors SET resolution = ? WHERE signature = ?", (text, signature)
                )
                rows = con.execute(
                    f"SELECT {_COLUMNS} FROM threepass_errors WHERE signature = ?", (signature,)
                ).fetchall()
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        return _record(rows[0]) if rows else None

    def search_sync(
        self, tool: str | None = None, text: str | None = None, signature: str | None = None, limit: int = 20
    ) -> list[ErrorRecord]:
        if not self._healthy:
            return []
        where, params = [], []
        if tool is not None:
            where.append("tool = ?")
            params.append(tool)
        if signature is not None:
            where.append("signature = ?")
            params.append(signature)
        query = f"SELECT {_COLUMNS} FROM threepass_errors"
        if where:
            query += " WHERE " + " AND ".join(where)
        query += " ORDER BY last_seen DESC"
        with self._connect() as con:
            records = [_record(row) for row in con.execute(query, params)]
        # text is matched here, case-folded as MemoryErrorStore does (SQLite's LIKE folds ASCII only)
        return [r for r in records if _matches(r, None, text, None)][: max(0, limit)]

    def __repr__(self) -> str:
        return f"DiskErrorStore({os.fspath(self._directory)!r})"
