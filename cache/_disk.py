"""`DiskResultCache`: the result cache in a diskcache folder, shared by one machine's processes.

What is on disk
    One `diskcache.Cache`: `cache.db` (SQLite in WAL mode) in the folder, values of 32 KiB
    or more in files beside it. A value is our own document, UTF-8 JSON bytes with a
    `format` number: the content, the resources it read, when it was stored and when it
    expires. Only bytes are stored and only bytes are read back, so nothing is ever
    unpickled. A value that is not a current-format document (garbage, truncated, a
    pickle, another format) is a miss counted in `errors`. It is left in place: a newer
    threepass sharing the folder may have written it, and the next write of its key
    replaces it.

Expiry
    By the injected clock, against `expires_at` in the value. diskcache's own `expire`
    (wall time) is set too, a grace period later, only so that entries nobody asks for
    again are swept by later writes instead of waiting for the size limit.

Invalidation index
    A table `threepass_reads(resource, key)` in the same `cache.db`, one row per resource
    an entry read, primary key `(resource, key)`. Overlap (`resources_overlap`: the same
    path, a folder above, or one below) becomes three index lookups instead of decoding
    every entry: `x` itself, the range `[x + "/", x + "0")` for everything below `x` ("0"
    is the byte after "/"), and the folders above `x`. Resources are stored as UTF-8
    bytes (`surrogatepass`, so any `str` path fits), whose byte order keeps prefixes and
    ranges exact.
    It is a table in the same database rather than a second store (a diskcache `Index`,
    a second file) so that a value and its index rows commit in one SQLite transaction:
    no process ever sees an entry its reads cannot invalidate. A trigger on diskcache's
    `Cache` table deletes an entry's rows whenever the entry goes, whoever removes it
    (size-limit eviction, expiry sweeping, `clear`, another process). diskcache's tags
    cannot do this: an entry has one tag, and tags match only exactly.
    `invalidate` first asks the index without a lock (most writes touch nothing cached),
    then, if anything overlaps, deletes under the write lock with one statement per
    written resource, so dropping every file entry costs one DELETE, not one per entry.

Permissions
    What a cache holds is nobody else's business: a folder it creates is 0700, and so are
    the value files' subfolders; a database it creates (`cache.db` and its `-wal` and
    `-shm`, which SQLite creates with the database's mode) and every value file are 0600.
    Modes are set with `chmod` once a file exists, so the process's umask cannot widen
    them. A folder or database that was already there keeps the mode its owner gave it.

Reads
    With least-recently-used eviction, `diskcache.Cache.get` records every hit's access
    time: a write transaction per lookup (about 150 µs instead of 35). `get` therefore
    reads with one SELECT of its own and refreshes the access time only when it is more
    than a minute old: eviction order is least recently used to the minute.

diskcache internals relied on
    The `Cache` table's columns (the trigger, the lookup, the access-time refresh, the
    bulk delete) and `Cache._con`, the per-thread connection our statements share with
    diskcache's transaction. With a diskcache that changed the table, the first of our
    statements naming it fails and the cache disables itself (below); one without `_con`
    fails loudly when the cache is made. Neither can serve a stale entry.

Reads on the event loop
    A hit is a SELECT of a few small rows that SQLite answers from memory in microseconds,
    far less than handing it to a worker thread and back. `get_many` therefore reads on
    the loop's own thread when it can do so without waiting or writing: the rows'
    values are in the database (not files), their access times need no refresh, and the
    store has been quick. Those reads have a connection of their own, which waits at most
    `INLINE_BUSY` for a lock, only reads, and keeps the rows it read while SQLite's
    `data_version` (which moves with every commit of any other connection, in any
    process) stands still: a hit asked again costs one pragma, not a query. Anything
    else (a value file to read, an access time to write, a lock held longer, a fault)
    goes to a worker thread, which reads again and waits as long as the store's
    `timeout` says. A lookup on the loop that waited (the
    thread slept: on Linux, its voluntary context switches say so, as a preempted
    thread's do not) and took over `INLINE_STALL` sends every lookup to a thread for
    `INLINE_PAUSE`. What a lookup on the loop may still wait for, once, before that: the
    disk itself (pages not in memory) and SQLite's recovery of a crashed writer's log by
    another process, usually milliseconds. Writes always go to a thread: they take
    SQLite's write lock, which another process may hold.

Several processes
    SQLite does the work. Every write (a `set`, the deleting part of an `invalidate`) is
    one `BEGIN IMMEDIATE` transaction, so two processes writing one key are serialized
    and the last value, with its own reads, wins whole; a reader sees a committed value
    or none. A value file is written whole under a fresh name before its row commits.

Failure
    The cache must never make a call fail. When opening the folder or any operation on it
    raises what a broken store raises (`OSError`: folder unwritable or full, value file
    unreadable; `sqlite3.Error`: not a database, malformed, disk full; `diskcache.Timeout`:
    locked by another process past `timeout`), one warning naming the folder and the
    problem goes to the `threepass.cache` logger, the error is counted, and from then on
    this object is disabled: `get` misses, `set` and `invalidate` do nothing, `healthy`
    is False. Disabling, rather than trying again later, is what keeps a failed
    invalidation from letting a stale entry be served afterwards.

Nothing from `dispatcher` or trio is imported here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeGuard

import anyio.to_thread
import diskcache
import orjson
import platformdirs
from diskcache.core import MODE_BINARY, MODE_RAW

if sys.platform != "win32":
    import resource

from ._protocol import CacheCounters, CacheEntry, CacheStatistics, CacheWrite

__all__ = ["DEFAULT_SIZE_LIMIT", "DiskResultCache", "default_cache_dir"]

DEFAULT_SIZE_LIMIT: Final = 2**30
_CACHE_DIR_ENV: Final = "THREEPASS_CACHE_DIR"

# Bumped whenever the value document changes shape; other numbers read as misses.
_FORMAT: Final = 1
# diskcache's wall-time expiry trails ours: it only sweeps, the clock decides.
_SWEEP_GRACE: Final = 300.0
# An entry's access time (the LRU order) is refreshed by a hit at most this often.
_TOUCH_AFTER: Final = 60.0
INLINE_BUSY: Final = 0.05
"""How long a lookup on the event loop's thread waits for SQLite's lock (seconds) before
the lookup goes to a thread, which waits the store's `timeout`."""
_DECODED_BYTES: Final = 2048  # stored values up to this size are kept decoded ...
_DECODED_ENTRIES: Final = 1024  # ... this many at most (then the memo starts again)
INLINE_STALL: Final = 0.1
"""A lookup on the event loop's thread that slept and took longer than this (seconds) ...
(a busy machine's preemption, and the GIL's hand-offs, add milliseconds, not this)"""
INLINE_PAUSE: Final = 10.0
"""... sends lookups to a worker thread for this long (seconds): a disk that stalls holds
the loop up once in every `INLINE_PAUSE`, for as long as that one lookup waits."""

_PRIVATE_DIR: Final = 0o700
_PRIVATE_FILE: Final = 0o600
_DATABASE: Final = "cache.db"
_DATABASE_FILES: Final = (_DATABASE, f"{_DATABASE}-wal", f"{_DATABASE}-shm")

_log = logging.getLogger("threepass.cache")


class _Forks:
    """Which process this is, told apart from its parent without a system call: `count`
    moves on in every child a fork makes (`os.getpid` asks the kernel each time)."""

    count = 0

    @classmethod
    def forked(cls) -> None:
        cls.count += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Forks.forked)

_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS threepass_reads ("
    " resource BLOB NOT NULL, key TEXT NOT NULL, PRIMARY KEY (resource, key)"
    ") WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS threepass_reads_key ON threepass_reads (key)",
    "CREATE TRIGGER IF NOT EXISTS threepass_reads_forget AFTER DELETE ON Cache"
    " FOR EACH ROW BEGIN DELETE FROM threepass_reads WHERE key = OLD.key; END",
    # the invalidation epochs: a counter, and the epoch each resource was last moved at
    "CREATE TABLE IF NOT EXISTS threepass_epoch (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS threepass_moved ("
    " resource BLOB PRIMARY KEY, epoch INTEGER NOT NULL, at REAL NOT NULL"
    ") WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS threepass_moved_at ON threepass_moved (at)",
)
_EPOCH: Final = "SELECT value FROM threepass_epoch WHERE name = 'epoch'"
_FORGOTTEN: Final = "SELECT value FROM threepass_epoch WHERE name = 'forgotten'"
_BUMP: Final = (
    "INSERT INTO threepass_epoch (name, value) VALUES ('epoch', 1)"
    " ON CONFLICT (name) DO UPDATE SET value = value + 1"
)
_MOVE: Final = (
    "INSERT INTO threepass_moved (resource, epoch, at) VALUES (?, ?, ?)"
    " ON CONFLICT (resource) DO UPDATE SET epoch = excluded.epoch, at = excluded.at"
)
# Moves older than this are forgotten (no read runs that long); a write whose read began
# before the oldest kept move is refused, as what moved since is no longer known.
_MOVED_KEPT_SECONDS: Final = 3600.0
_FORGET_READS: Final = "DELETE FROM threepass_reads WHERE key = ?"
_REMEMBER_READ: Final = "INSERT OR IGNORE INTO threepass_reads (resource, key) VALUES (?, ?)"
_SELECT_VALUE: Final = (
    "SELECT rowid, access_time, mode, filename, value FROM Cache"
    " WHERE key = ? AND raw = 1 AND (expire_time IS NULL OR expire_time > ?)"
)
_SELECT_VALUES: Final = (
    "SELECT key, rowid, access_time, mode, filename, value FROM Cache"
    " WHERE key IN ({}) AND raw = 1 AND (expire_time IS NULL OR expire_time > ?)"
)
_MANY: Final = 500  # keys per query, well under SQLite's limit on parameters
# the rows the loop's connection keeps between lookups (`_loop_rows`): `_SELECT_VALUES`'s,
# with their expiry, filtered by it when served
_SELECT_KEPT: Final = (
    "SELECT key, rowid, access_time, mode, filename, value, expire_time FROM Cache"
    " WHERE key IN ({}) AND raw = 1"
)
_DATA_VERSION: Final = "PRAGMA data_version"  # moves with every commit of another connection
_ROWS_KEPT: Final = 1024  # keys whose rows the loop's connection keeps at most (values up to _DECODED_BYTES)
_TOUCH: Final = "UPDATE Cache SET access_time = ? WHERE rowid = ?"

# What a broken folder or database raises; anything else is a bug and propagates.
_STORE_FAILURES: Final = (OSError, sqlite3.Error, diskcache.Timeout)


def default_cache_dir() -> Path:
    """The folder `DiskResultCache()` uses when given none: `$THREEPASS_CACHE_DIR` if set,
    else the platform's user cache folder for threepass."""
    override = os.environ.get(_CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("threepass"))


class _Undecodable(ValueError):
    """A stored value that is not a current-format threepass entry."""


def _index_form(resource: str) -> bytes:
    trimmed = resource[:-1] if resource.endswith("/") else resource
    return trimmed.encode("utf-8", "surrogatepass")


def _overlapping(resource: str) -> tuple[str, tuple[bytes, ...]]:
    """A subquery for the keys whose reads overlap `resource`, and its parameters."""
    x = _index_form(resource)
    above = tuple(x[:i] for i in range(len(x)) if x[i : i + 1] == b"/")
    query = "SELECT key FROM threepass_reads WHERE resource = ? OR (resource >= ? AND resource < ?)"
    if above:
        query += f" OR resource IN ({', '.join('?' * len(above))})"
    return query, (x, x + b"/", x + b"0", *above)


def _anything_overlaps(con: sqlite3.Connection, resources: list[str]) -> bool:
    for resource in resources:
        keys, params = _overlapping(resource)
        if con.execute(f"SELECT EXISTS ({keys})", params).fetchone()[0]:
            return True
    return False


def _drop_overlapping(con: sqlite3.Connection, resources: list[str]) -> tuple[int, list[str]]:
    """Delete the entries whose reads overlap `resources`, in the caller's transaction:
    how many went, and the value files to remove once that commits.

    One DELETE per resource rather than `Cache.delete` per key: dropping every file
    entry (a shell command with unknown effects) stays one statement however many there are.
    """
    dropped = 0
    files: list[str] = []
    for resource in resources:
        keys, params = _overlapping(resource)
        files += [
            name
            for (name,) in con.execute(
                f"SELECT filename FROM Cache WHERE filename IS NOT NULL AND key IN ({keys})", params
            )
        ]
        dropped += con.execute(f"DELETE FROM Cache WHERE key IN ({keys})", params).rowcount
    return dropped, files


def _value(con: sqlite3.Connection, query: str) -> int:
    row = con.execute(query).fetchone()
    return int(row[0]) if row else 0


def _moved_since(con: sqlite3.Connection, reads: frozenset[str], since: int) -> bool:
    """Whether an invalidation after epoch `since` moved a resource overlapping `reads`."""
    for resource in reads:
        x = _index_form(resource)
        above = tuple(x[:i] for i in range(len(x)) if x[i : i + 1] == b"/")
        query = "SELECT EXISTS (SELECT 1 FROM threepass_moved WHERE epoch > ? AND (resource = ?"
        query += " OR (resource >= ? AND resource < ?)"
        if above:
            query += f" OR resource IN ({', '.join('?' * len(above))})"
        if con.execute(query + "))", (since, x, x + b"/", x + b"0", *above)).fetchone()[0]:
            return True
    return False


def _encode(content: str, reads: frozenset[str], stored_at: float, expires_at: float) -> bytes:
    document = {
        "format": _FORMAT,
        "content": content,
        "reads": sorted(reads),
        "stored_at": stored_at,
        "expires_at": expires_at,
    }
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "surrogatepass")


def _is_time(value: object) -> TypeGuard[float]:
    if type(value) is float:
        return value == value  # not NaN
    if type(value) is int:  # not bool, which is an int too
        return -_MAX_TIME < value < _MAX_TIME
    return False


_MAX_TIME = 2**1023  # an int beyond a float's range is no time


def _decode(raw: bytes) -> tuple[float, CacheEntry]:
    """`(expires_at, entry)` from a stored value; `_Undecodable` if it is anything else."""
    try:
        # orjson reads our documents (text and two times) as json would, in a third of the
        # time; what it refuses (a lone surrogate, written with surrogatepass; anything not
        # JSON) goes to json, which decides. (It reads an integer past 64 bits as a float,
        # where json keeps it: no document of ours holds one.)
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            text = raw.decode("utf-8", "surrogatepass")
            document = json.loads(text)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise _Undecodable(f"not a JSON document: {exc!r}") from None
    if type(document) is not dict:
        raise _Undecodable(f"expected a JSON object, got {type(document).__name__}")
    if document.get("format") != _FORMAT:
        raise _Undecodable(f"format {document.get('format')!r}, this version reads {_FORMAT}")
    # plain checks rather than a match statement: this runs on every cache hit
    content = document.get("content")
    reads = document.get("reads")
    stored_at = document.get("stored_at")
    expires_at = document.get("expires_at")
    if (
        type(content) is str
        and type(reads) is list
        and _is_time(stored_at)
        and _is_time(expires_at)
        and (not reads or all(type(r) is str for r in reads))
    ):
        return float(expires_at), CacheEntry(content, frozenset(reads), float(stored_at))
    raise _Undecodable("fields missing or of the wrong type")


class _PrivateDisk(diskcache.Disk):  # type: ignore[misc]  # diskcache ships no types
    """diskcache's `Disk`, except that a value file and the two folders above it are the
    owner's alone."""

    def store(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        stored: tuple[Any, ...] = super().store(*args, **kwargs)
        filename = stored[2]
        if filename is not None:
            path = Path(self._directory, filename)
            path.chmod(_PRIVATE_FILE)
            path.parent.chmod(_PRIVATE_DIR)
            path.parent.parent.chmod(_PRIVATE_DIR)
        return stored


def _private_folder(directory: Path) -> bool:
    """Create `directory` (0700) if it is missing; True if a database must be created in it."""
    if not directory.is_dir():
        directory.mkdir(mode=_PRIVATE_DIR, parents=True, exist_ok=True)
        directory.chmod(_PRIVATE_DIR)
    return not (directory / _DATABASE).exists()


def _private_database(directory: Path) -> None:
    for name in _DATABASE_FILES:
        with contextlib.suppress(FileNotFoundError):  # -wal and -shm come and go
            (directory / name).chmod(_PRIVATE_FILE)


def _connection(store: Any) -> sqlite3.Connection:
    # diskcache offers no public handle on its connection, and the reads index must
    # commit inside diskcache's own transaction. `_con` is per thread and reopened after
    # a fork; it has kept its name and meaning since diskcache 3.
    con: sqlite3.Connection = store._con
    return con


def _stored_bytes(store: Any, row: tuple[Any, ...], wall_now: float) -> bytes | None:
    """The bytes of one row of `_SELECT_VALUE` (None if its file is gone), refreshing its
    LRU access time when that is over a minute old. `_Undecodable` if they are not bytes."""
    rowid, access_time, mode, filename, value = row
    if mode not in (MODE_RAW, MODE_BINARY):  # text or a pickle: not ours, never loaded
        raise _Undecodable(f"stored in diskcache mode {mode!r}, not as bytes")
    try:
        raw = store.disk.fetch(mode, filename, value, False)
    except FileNotFoundError:  # its file went with a concurrent overwrite or invalidation
        return None
    if not isinstance(raw, bytes):
        raise _Undecodable(f"expected bytes, got {type(raw).__name__}")
    if not (isinstance(access_time, float) and wall_now - access_time < _TOUCH_AFTER):
        _connection(store).execute(_TOUCH, (wall_now, rowid))
    return raw


def _read_value(store: Any, key: str) -> bytes | None:
    """The stored bytes under `key` (None if absent); see `_stored_bytes`."""
    wall_now = time.time()  # diskcache's expire_time and access_time are wall time
    rows = _connection(store).execute(_SELECT_VALUE, (key, wall_now)).fetchall()
    return _stored_bytes(store, rows[0], wall_now) if rows else None


def _read_values(
    store: Any, keys: Sequence[str], con: sqlite3.Connection | None = None
) -> dict[str, tuple[Any, ...]]:
    """The `_SELECT_VALUE` row of each key present, in one query per `_MANY` keys (on the
    thread's connection, or on `con`)."""
    if con is None:
        con = _connection(store)
    wall_now = time.time()
    if len(keys) == 1:  # the common batch: the one-key statement, which SQLite keeps ready
        one = con.execute(_SELECT_VALUE, (keys[0], wall_now)).fetchone()
        return {} if one is None else {keys[0]: one}
    rows: dict[str, tuple[Any, ...]] = {}
    for row in _rows_of(con, _SELECT_VALUES, keys, wall_now):
        rows[row[0]] = row[1:]  # one slice (a starred target builds a list, then the tuple)
    return rows


def _rows_of(con: sqlite3.Connection, query: str, keys: Sequence[str], *after: Any) -> Iterator[Any]:
    """The rows of `query` (its `IN ({})` filled for the keys) for `keys`, in one query per
    `_MANY` keys, each given the keys and then `after`."""
    for start in range(0, len(keys), _MANY):
        chunk = keys[start : start + _MANY]
        yield from con.execute(query.format(", ".join("?" * len(chunk))), (*chunk, *after))


_RUSAGE_THREAD: int | None = None if sys.platform == "win32" else getattr(resource, "RUSAGE_THREAD", None)


def _sleeps() -> int:
    """How often this thread has gone to sleep (Linux counts it), or 0 where unknown."""
    if sys.platform == "win32" or _RUSAGE_THREAD is None:
        return 0
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


class DiskResultCache:
    """A `ResultCache` in a diskcache folder, shared by every process that opens it.

    `directory` defaults to `default_cache_dir()`. `clock` returns wall-time seconds and
    decides expiry. `size_limit` bounds the folder in bytes, evicting the least recently
    used entries first. `timeout` is how long an operation waits for another process's
    write lock before the cache gives up and disables itself.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        size_limit: int = DEFAULT_SIZE_LIMIT,
        timeout: float = 5.0,
    ) -> None:
        self._directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self._clock = clock
        self._counters = CacheCounters()
        self._store: Any = None  # a diskcache.Cache while healthy, None once disabled
        self._threads_until = 0.0  # time.monotonic() until which lookups go to a thread
        # small stored values already decoded, by their bytes: a value is the same document
        # whenever its bytes are, and its entry is frozen, so a hit of it decodes nothing
        self._decoded: dict[bytes, tuple[float, CacheEntry]] = {}
        self._loop_local = threading.local()  # the connection lookups on a loop's thread use
        try:
            new_database = _private_folder(self._directory)
            store = diskcache.Cache(
                str(self._directory),
                timeout=timeout,
                disk=_PrivateDisk,
                size_limit=size_limit,
                eviction_policy="least-recently-used",
            )
            try:
                if new_database:
                    _private_database(self._directory)
                with store.transact():
                    for statement in _SCHEMA:
                        _connection(store).execute(statement)
            except BaseException:
                store.close()
                raise
        except _STORE_FAILURES as exc:
            self._disable("open", exc)
        else:
            self._store = store

    @property
    def directory(self) -> Path:
        """The folder holding the cache."""
        return self._directory

    @property
    def healthy(self) -> bool:
        """False once the folder failed: from then on the cache stores and serves nothing."""
        return self._store is not None

    # -- the async seam: each operation runs in a worker thread (SQLite may wait for
    # another process's lock), never on the event loop ------------------------------

    async def get(self, key: str) -> CacheEntry | None:
        """The live entry under `key`, or None (missing, expired, unreadable)."""
        return await anyio.to_thread.run_sync(self.get_sync, key)

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        if time.monotonic() >= self._threads_until:
            found = self._get_many_inline(keys)
            if found is not None:
                return found
        return await anyio.to_thread.run_sync(self.get_many_sync, keys)

    def _loop_connection(self) -> sqlite3.Connection:
        """This thread's connection for lookups made on an event loop: its own (not
        diskcache's, which this thread's blocking calls share), waiting at most
        `INLINE_BUSY` for a lock before it gives the lookup to a thread; opened on first
        use, and again in a forked child."""
        local = self._loop_local
        con: sqlite3.Connection | None = getattr(local, "con", None)
        if con is None or local.forks != _Forks.count:
            con = sqlite3.connect(
                self._directory / "cache.db",
                timeout=INLINE_BUSY,
                isolation_level=None,
                check_same_thread=True,
            )
            local.con, local.forks = con, _Forks.count
            local.version, local.rows = None, {}  # what `_loop_rows` keeps, of this connection
        return con

    def _loop_rows(self, store: Any, keys: list[str], con: sqlite3.Connection) -> dict[str, tuple[Any, ...]]:
        """`_read_values(store, keys, con)` (`keys` without repeats) on the loop's connection,
        which only reads: the rows it read before are served again while the database
        stands as it was then. SQLite's `data_version` moves with every commit of any other
        connection, in any process (a write, an eviction, an access time refreshed by a
        thread), and is read before the rows it vouches for; a kept row is filtered by its
        expiry now, as the query would filter it. A hit then asks SQLite one pragma, not a
        query."""
        local = self._loop_local
        version = con.execute(_DATA_VERSION).fetchone()[0]
        kept: dict[str, tuple[tuple[Any, ...], Any] | None] = local.rows
        if local.version != version:
            kept.clear()
            local.version = version
        missing = [key for key in keys if key not in kept]
        read: dict[str, tuple[tuple[Any, ...], Any]] = {}
        if missing:
            if len(kept) + len(missing) > _ROWS_KEPT:
                kept.clear()
                missing = keys
            try:
                for row in _rows_of(con, _SELECT_KEPT, missing):
                    read[row[0]] = (row[1:6], row[6])
            except BaseException:  # a query cut short: nothing it did not read is kept
                kept.clear()
                local.version = None
                raise
            for key in missing:  # kept: a key's absence, and its row unless its value is large
                found = read.get(key)
                value = None if found is None else found[0][4]
                if not (isinstance(value, bytes) and len(value) > _DECODED_BYTES):
                    kept[key] = found
        wall_now = time.time()  # diskcache's expire_time is wall time
        rows: dict[str, tuple[Any, ...]] = {}
        for key in keys:
            found = read[key] if key in read else kept.get(key)
            if found is not None and (found[1] is None or found[1] > wall_now):
                rows[key] = found[0]
        return rows

    def _get_many_inline(self, keys: Sequence[str]) -> dict[str, CacheEntry] | None:
        """`get_many_sync` on the caller's thread, or None (nothing counted) when it would
        have to read a file, write an access time, or report a fault: a thread does those."""
        store = self._store
        if store is None:
            return None
        asked = list(dict.fromkeys(keys))
        try:
            con = self._loop_connection()
        except _STORE_FAILURES:
            return None
        slept = _sleeps()
        began = time.monotonic()
        try:
            rows: dict[str, tuple[Any, ...]] | None = self._loop_rows(store, asked, con)
        except _STORE_FAILURES:
            rows = None  # the thread asks again (waiting as long as it must), or disables the store
        wall_now = time.time()
        took = time.monotonic() - began
        # slow, and not for being preempted. A read that failed counts too: SQLite may have
        # slept its lock timeout (INLINE_BUSY on this connection) first
        if took > INLINE_STALL and _sleeps() != slept:
            self._threads_until = began + INLINE_PAUSE
            _log.info(
                "result cache %s took %.1f ms to answer on the event loop: lookups go to a thread for %g s",
                self._directory,
                took * 1e3,
                INLINE_PAUSE,
            )
        if rows is None:
            return None
        for _, access_time, mode, filename, value in rows.values():
            if filename is not None or not isinstance(value, bytes) or mode not in (MODE_RAW, MODE_BINARY):
                return None
            if not (isinstance(access_time, float) and wall_now - access_time < _TOUCH_AFTER):
                return None
        # the clock read once for the whole lookup
        found: dict[str, CacheEntry] = {}
        now = self._clock()
        for key in asked:
            row = rows.get(key)
            if (entry := self._live(None if row is None else row[4], now)) is not None:
                found[key] = entry
        return found

    async def set(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        """Keep `content` under `key` for `ttl` seconds, remembering what it read."""
        await self.set_many([CacheWrite(key, content, ttl, frozenset(reads))])

    async def set_many(
        self, writes: Sequence[CacheWrite], *, since: int | None = None, invalidate: Iterable[str] = ()
    ) -> None:
        await anyio.to_thread.run_sync(lambda: self.set_many_sync(writes, since=since, invalidate=invalidate))

    async def epoch(self) -> int:
        return await anyio.to_thread.run_sync(self.epoch_sync)

    async def moved_since(self, epoch: int) -> frozenset[str] | None:
        return await anyio.to_thread.run_sync(self.moved_since_sync, epoch)

    async def invalidate(self, resources: Iterable[str]) -> int:
        return await anyio.to_thread.run_sync(self.invalidate_sync, list(resources))

    async def clear(self) -> None:
        await anyio.to_thread.run_sync(self.clear_sync)

    async def statistics(self) -> CacheStatistics:
        return await anyio.to_thread.run_sync(self.statistics_sync)

    # -- the same, synchronous, for code without an event loop (the command line) -------

    def get_sync(self, key: str) -> CacheEntry | None:
        store = self._store
        if store is None:
            self._counters.misses += 1
            return None
        try:
            raw = _read_value(store, key)
        except _Undecodable:
            self._counters.errors += 1
            self._counters.misses += 1
            return None
        except _STORE_FAILURES as exc:
            self._disable("read from", exc)
            self._counters.misses += 1
            return None
        return self._live(raw)

    def get_many_sync(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        store = self._store
        if store is None or len(keys) < 2:
            # one key is one query either way, and a broken store counts its misses in get
            return {k: e for k in keys if (e := self.get_sync(k)) is not None}
        found: dict[str, CacheEntry] = {}
        asked = list(dict.fromkeys(keys))
        done = 0
        try:
            rows = _read_values(store, asked)
            wall_now = time.time()
            for key in asked:
                row = rows.get(key)
                try:
                    raw = None if row is None else _stored_bytes(store, row, wall_now)
                except _Undecodable:
                    self._counters.errors += 1
                    raw = None
                done += 1
                entry = self._live(raw)
                if entry is not None:
                    found[key] = entry
        except _STORE_FAILURES as exc:
            self._disable("read from", exc)
            self._counters.misses += len(asked) - done  # the keys never answered
        return found

    def _live(self, raw: bytes | None, now: float | None = None) -> CacheEntry | None:
        """The entry in a stored value if it decodes and has not expired (at `now`, else at
        the clock's reading), counted."""
        if raw is None:
            self._counters.misses += 1
            return None
        decoded = self._decoded.get(raw)
        if decoded is None:
            try:
                decoded = _decode(raw)
            except _Undecodable:
                self._counters.errors += 1
                self._counters.misses += 1
                return None
            if len(raw) <= _DECODED_BYTES:
                if len(self._decoded) >= _DECODED_ENTRIES:
                    self._decoded.clear()
                self._decoded[raw] = decoded
        expires_at, entry = decoded
        if (self._clock() if now is None else now) >= expires_at:
            self._counters.expired += 1
            self._counters.misses += 1
            return None
        self._counters.hits += 1
        return entry

    def set_sync(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        self.set_many_sync([CacheWrite(key, content, ttl, frozenset(reads))])

    def set_many_sync(
        self, writes: Sequence[CacheWrite], *, since: int | None = None, invalidate: Iterable[str] = ()
    ) -> None:
        """One transaction for a batch: the writes whose reads an invalidation after epoch
        `since` moved (from this or another process) are refused; then `invalidate` drops
        what the batch's own writes changed and moves the epoch; then the rest are kept."""
        store = self._store
        written = list(invalidate)
        live = [w for w in writes if w.ttl > 0]  # an entry born expired could serve nothing
        if store is None or not (live or written):
            return
        now = self._clock()
        kept = 0
        dropped, files = 0, list[str]()
        try:
            with store.transact():
                con = _connection(store)
                forgotten = since is not None and since < _value(con, _FORGOTTEN)
                fresh = []
                for w in live:
                    if since is not None and (forgotten or _moved_since(con, w.reads, since)):
                        self._counters.raced += 1
                    else:
                        fresh.append(w)
                if written:
                    dropped, files = self._move(con, written)
                for w in fresh:
                    value = _encode(w.content, w.reads, now, now + w.ttl)
                    sweep_after = w.ttl + _SWEEP_GRACE if math.isfinite(w.ttl) else None
                    con.execute(_FORGET_READS, (w.key,))
                    con.executemany(_REMEMBER_READ, [(_index_form(r), w.key) for r in w.reads])
                    # The rows go in first: should the size limit evict this very entry
                    # while storing it, the trigger takes its rows along.
                    store.set(w.key, value, expire=sweep_after)
                    kept += 1
            for name in files:  # only once the rows are gone for good
                store.disk.remove(name)
        except _STORE_FAILURES as exc:
            self._disable("write to", exc)
            return
        self._counters.writes += kept
        self._counters.invalidations += dropped

    def moved_since_sync(self, epoch: int) -> frozenset[str] | None:
        store = self._store
        if store is None:
            return None
        try:
            con = _connection(store)
            if epoch < _value(con, _FORGOTTEN):
                return None
            rows = con.execute("SELECT resource FROM threepass_moved WHERE epoch > ?", (epoch,))
            return frozenset(bytes(r).decode("utf-8", "surrogatepass") for (r,) in rows)
        except _STORE_FAILURES as exc:
            self._disable("read the epochs of", exc)
            return None

    def epoch_sync(self) -> int:
        store = self._store
        if store is None:
            return 0
        try:
            return _value(_connection(store), _EPOCH)
        except _STORE_FAILURES as exc:
            self._disable("read the epoch of", exc)
            return 0

    def invalidate_sync(self, resources: Iterable[str]) -> int:
        store = self._store
        written = list(resources)
        if store is None or not written:
            return 0
        try:
            con = _connection(store)
            with store.transact():
                dropped, files = self._move(con, written)
            for name in files:  # only once the rows are gone for good
                store.disk.remove(name)
        except _STORE_FAILURES as exc:
            self._disable("invalidate entries in", exc)
            return 0
        self._counters.invalidations += dropped
        return dropped

    def _move(self, con: sqlite3.Connection, written: list[str]) -> tuple[int, list[str]]:
        """In the caller's transaction: move the epoch on for every write, cached entries or
        none (a read running now must not store what it read before this write), note what
        it moved, drop the entries that read it; how many went, and their value files."""
        wall_now = time.time()
        con.execute(_BUMP)
        epoch = _value(con, _EPOCH)
        con.executemany(_MOVE, [(_index_form(r), epoch, wall_now) for r in written])
        if epoch % 64 == 0:
            self._forget_old_moves(con, wall_now)
        return _drop_overlapping(con, written) if _anything_overlaps(con, written) else (0, [])

    @staticmethod
    def _forget_old_moves(con: sqlite3.Connection, wall_now: float) -> None:
        cutoff = wall_now - _MOVED_KEPT_SECONDS
        row = con.execute("SELECT MAX(epoch) FROM threepass_moved WHERE at < ?", (cutoff,)).fetchone()
        if row and row[0] is not None:
            con.execute(
                "INSERT INTO threepass_epoch (name, value) VALUES ('forgotten', ?)"
                " ON CONFLICT (name) DO UPDATE SET value = MAX(value, excluded.value)",
                (row[0],),
            )
            con.execute("DELETE FROM threepass_moved WHERE at < ?", (cutoff,))

    def clear_sync(self) -> None:
        store = self._store
        if store is None:
            return
        try:
            # diskcache clears in short transactions; the trigger empties the index alongside
            store.clear()
        except _STORE_FAILURES as exc:
            self._disable("clear", exc)

    def statistics_sync(self) -> CacheStatistics:
        store = self._store
        entries = 0
        if store is not None:
            try:
                entries = len(store)  # rows in the store, expired ones not yet swept included
            except _STORE_FAILURES as exc:
                self._disable("count the entries in", exc)
        return self._counters.snapshot(entries)

    def close(self) -> None:
        """Close this thread's connections; the next operation opens them again."""
        con = getattr(self._loop_local, "con", None)
        if con is not None and self._loop_local.forks == _Forks.count:
            con.close()
        self._loop_local.con = None
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> DiskResultCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "disabled"
        return f"<DiskResultCache {str(self._directory)!r} {state}>"

    def _disable(self, action: str, exc: BaseException) -> None:
        self._counters.errors += 1
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(*_STORE_FAILURES):
                store.close()
        damaged = isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)
        _log.warning(
            "result cache disabled: could not %s %s (%s: %s); tool calls still run, uncached.%s",
            action,
            self._directory,
            type(exc).__name__,
            exc or "no detail",
            " The database looks damaged: delete the folder to start afresh." if damaged else "",
        )
