"""SQLite files that the processes of a machine share: setting write-ahead logging on a
connection, which two processes opening the file at once can be refused.

Nothing from the kernel or above it is imported here.
"""

from __future__ import annotations

import sqlite3
import time

__all__ = ["set_wal"]

_BUSY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})


def set_wal(con: sqlite3.Connection, timeout: float) -> None:
    """Put `con`'s database in write-ahead logging (nothing to do once it is), trying again
    for up to `timeout` seconds while SQLite answers that it is busy. Its busy handler waits
    for a lock, but not where waiting could deadlock: two processes that open a new file at
    once both read it, then both want to write its header, and one is told `database is
    locked` at once, holding a read lock the other waits on. Trying again, that lock let
    go, it finds the file in WAL already."""
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        try:
            con.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            # the primary code of an extended one (SQLITE_BUSY_RECOVERY is a SQLITE_BUSY)
            if exc.sqlite_errorcode & 0xFF not in _BUSY or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
