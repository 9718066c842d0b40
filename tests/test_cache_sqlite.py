"""cache/_sqlite.py: write-ahead logging set on a file another connection holds locked."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from cache._sqlite import set_wal


def _locked_for(path: Path, seconds: float) -> threading.Thread:
    """A connection of another thread that holds `path` locked for writing for `seconds`."""
    ready = threading.Event()

    def hold() -> None:
        con = sqlite3.connect(path, isolation_level=None)
        con.execute("CREATE TABLE IF NOT EXISTS t (x)")
        con.execute("BEGIN EXCLUSIVE")
        ready.set()
        time.sleep(seconds)
        con.execute("COMMIT")
        con.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert ready.wait(5)
    return holder


def test_a_file_locked_for_a_moment_is_set_to_wal_once_it_is_let_go(tmp_path: Path) -> None:
    """A connection told `database is locked` at once (no busy handler: what SQLite answers
    where waiting could deadlock) tries again until the lock is let go, then sets WAL."""
    path = tmp_path / "s.db"
    holder = _locked_for(path, 0.3)
    con = sqlite3.connect(path, timeout=0, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        con.execute("PRAGMA journal_mode=WAL")  # what the store's open was refused with
    began = time.monotonic()
    set_wal(con, 5.0)
    assert time.monotonic() - began >= 0.2
    assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    holder.join()
    con.close()


def test_a_lock_held_past_the_timeout_is_reported(tmp_path: Path) -> None:
    """Held longer than `timeout`: the refusal is raised, after about that long."""
    path = tmp_path / "s.db"
    holder = _locked_for(path, 1.5)
    con = sqlite3.connect(path, timeout=0, isolation_level=None)
    began = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        set_wal(con, 0.2)
    assert 0.15 <= time.monotonic() - began < 1.0
    holder.join()
    con.close()


def test_another_fault_is_raised_at_once(tmp_path: Path) -> None:
    """A fault other than a lock (a file that is not a database) is not tried again."""
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not an SQLite database, not even close" * 20)
    con = sqlite3.connect(path, timeout=0, isolation_level=None)
    began = time.monotonic()
    with pytest.raises(sqlite3.DatabaseError, match="not a database"):
        set_wal(con, 5.0)
    assert time.monotonic() - began < 0.5
    con.close()
