"""DiskResultCache.get_many on the event loop's own thread, against real processes and
real files: another process writing, overwriting and invalidating while the loop reads;
a write lock held by another process; the WAL index's read locks held (as a recovering
process holds them); junk values; and stalls that fail."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import diskcache
import pytest

import cache
from cache import CacheWrite, DiskResultCache

from ._fakes import FakeClock

REPO = Path(cache.__file__).resolve().parents[1]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        child.kill()
        child.communicate(timeout=10)


def _ready(child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line == "ready", (line, child.stderr.read() if child.stderr else "")


class LoopHold:
    """The longest the loop went without running a task that ticks every 5 ms."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.stop = anyio.Event()

    async def tick(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            with anyio.move_on_after(0.005):
                await self.stop.wait()
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now


_HOLD_WRITE_LOCK = """
    import sqlite3, sys, time
    con = sqlite3.connect(sys.argv[1] + "/cache.db", isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    con.execute("UPDATE Cache SET access_time = access_time")
    print("ready", flush=True)
    sys.stdin.readline()
    con.execute("COMMIT")
"""


async def test_a_write_lock_held_by_another_process_does_not_hold_the_loop(
    folder: Path, children: list[subprocess.Popen[str]]
) -> None:
    """While another process holds the database's write lock (BEGIN EXCLUSIVE), a lookup on
    the loop answers at once (a WAL reader never waits for a writer), well inside the
    store's lock timeout."""
    disk = DiskResultCache(folder, timeout=3.0)
    disk.set_many_sync([CacheWrite("a", "A", 600), CacheWrite("b", "B", 600)])
    assert set(await disk.get_many(["a", "b"])) == {"a", "b"}
    child = _child(_HOLD_WRITE_LOCK, str(folder))
    children.append(child)
    _ready(child)
    with anyio.fail_after(10):
        for keys, expected in ((["a"], {"a": "A"}), (["a", "b", "c"], {"a": "A", "b": "B"})):
            began = time.monotonic()
            found = await disk.get_many(keys)
            assert time.monotonic() - began < 0.5
            assert {k: e.content for k, e in found.items()} == expected
    assert disk.healthy


_HOLD_READ_MARKS = """
    import fcntl, os, sys
    fd = os.open(sys.argv[1] + "/cache.db-shm", os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 8, 120)  # the WAL index's locks, as recovery holds them
    print("ready", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX record locks on the WAL index")
@pytest.mark.xfail(
    strict=True,
    reason="a lookup on the loop that SQLite makes wait for the WAL index (locked by a process"
    " recovering the log) holds the loop for that wait, which SQLite's busy timeout does not bound;"
    " only the lookups after it go to a thread (see cache/_disk.py, Reads on the event loop)",
)
async def test_a_locked_wal_index_does_not_hold_the_loop(
    folder: Path, children: list[subprocess.Popen[str]]
) -> None:
    """While another process holds the WAL index's locks for a second, the loop is not held
    for that second by a lookup."""
    disk = DiskResultCache(folder, timeout=3.0)
    disk.set_many_sync([CacheWrite("a", "A", 600)])
    assert "a" in await disk.get_many(["a"])
    child = _child(_HOLD_READ_MARKS, str(folder))
    children.append(child)
    _ready(child)
    hold = LoopHold()

    def release_later() -> None:
        time.sleep(1.0)
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()

    releaser = threading.Thread(target=release_later)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold.tick)
            await anyio.sleep(0.02)
            releaser.start()
            found = await disk.get_many(["a"])
            hold.stop.set()
    releaser.join()
    assert "a" in found
    assert hold.longest < 0.5, hold.longest


async def test_a_lookup_that_stalled_and_failed_sends_the_next_ones_to_a_thread(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup on the loop that slept past the stall limit and then failed (SQLite gave up
    waiting for a lock) counts as a stall: the lookups after it go to a thread."""
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite("a", "A", 600), CacheWrite("b", "B", 600)])
    assert set(await disk.get_many(["a", "b"])) == {"a", "b"}  # the loop's connection opened
    loop_thread = threading.get_ident()
    real = disk._loop_rows  # the loop's read
    failed: list[int] = []

    def locked_once(store: Any, keys: Any, con: Any) -> Any:
        if threading.get_ident() == loop_thread and not failed:
            failed.append(1)
            time.sleep(cache._disk.INLINE_STALL * 1.5)  # SQLite's busy handler sleeping
            raise sqlite3.OperationalError("database is locked")
        return real(store, keys, con)

    monkeypatch.setattr(disk, "_loop_rows", locked_once)
    hops: list[int] = []
    threaded = disk.get_many_sync

    def spy(keys: Any) -> Any:
        hops.append(threading.get_ident())
        return threaded(keys)

    monkeypatch.setattr(disk, "get_many_sync", spy)
    with anyio.fail_after(10):
        assert set(await disk.get_many(["a", "b"])) == {"a", "b"}  # the thread answered it
        assert failed and len(hops) == 1
        assert set(await disk.get_many(["a", "b"])) == {"a", "b"}
    assert len(hops) == 2 and loop_thread not in hops
    assert disk.healthy


_WRITER = """
    import sys, time
    from cache import CacheWrite, DiskResultCache
    folder, until = sys.argv[1], float(sys.argv[2])
    disk = DiskResultCache(folder)
    print("ready", flush=True)
    n = 0
    while time.time() < until:
        n += 1
        size = 50_000 if n % 3 == 0 else 10  # a value file every third write
        letter = "xyz"[n % 3]
        disk.set_many_sync([CacheWrite("k", letter * size, 600, frozenset({"file:/w/" + letter}))])
        if n % 7 == 0:
            disk.invalidate_sync(["file:/w/" + letter])
    print(n, disk.statistics_sync().errors, flush=True)
"""


async def test_another_process_writing_while_the_loop_reads_serves_only_whole_values(
    folder: Path, children: list[subprocess.Popen[str]]
) -> None:
    """While another process overwrites a key (small values in the row, large ones in files
    swapped underneath) and invalidates it, every lookup on the loop is a miss or a whole
    value that process wrote, with the reads it was written with; no error is counted."""
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite("other", "O", 600)])
    child = _child(_WRITER, str(folder), str(time.time() + 1.5))
    children.append(child)
    _ready(child)
    seen: set[str] = set()
    with anyio.fail_after(15):
        while child.poll() is None:
            found = await disk.get_many(["k", "other"])
            assert found["other"].content == "O"
            entry = found.get("k")
            if entry is not None:
                letter = entry.content[0]
                assert entry.content in (letter * 10, letter * 50_000), entry.content[:20]
                assert entry.reads == frozenset({"file:/w/" + letter})
                seen.add("file" if len(entry.content) > 10 else "row")
            single = await disk.get_many(["k"])
            if "k" in single:
                assert len(set(single["k"].content)) == 1
            await anyio.sleep(0.001)
    out, err = child.communicate(timeout=10)
    assert child.returncode == 0, err
    writes, errors = map(int, out.split()[-2:])
    assert writes > 10 and errors == 0
    stats = await disk.statistics()
    assert stats.errors == 0 and disk.healthy
    assert "row" in seen


_INVALIDATE = """
    import sys
    from cache import DiskResultCache
    DiskResultCache(sys.argv[1]).invalidate_sync([sys.argv[2]])
    print("ready", flush=True)
"""


async def test_a_memoised_hit_is_not_served_after_another_process_invalidates_it(
    folder: Path, children: list[subprocess.Popen[str]]
) -> None:
    """A small hit read (and kept decoded) on the loop is a miss once another process
    invalidates what it read, and the same bytes written again are a hit again."""
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite("k", "v", 600, frozenset({"file:/w/a"}))])
    for _ in range(2):
        assert (await disk.get_many(["k"]))["k"].content == "v"
    child = _child(_INVALIDATE, str(folder), "file:/w/a")
    children.append(child)
    _ready(child)
    with anyio.fail_after(5):
        assert await disk.get_many(["k"]) == {}
        assert await disk.get_many(["k", "j"]) == {}
        disk.set_many_sync([CacheWrite("k", "v", 600, frozenset({"file:/w/a"}))])
        assert (await disk.get_many(["k", "j"]))["k"].content == "v"


async def test_a_memoised_entry_expires_on_the_loop_by_the_clock(folder: Path) -> None:
    """A small entry kept decoded expires on time when read on the loop, one key or many,
    and counts as expired each time."""
    clock = FakeClock(time.time())
    disk = DiskResultCache(folder, clock=clock)
    disk.set_many_sync([CacheWrite("k", "v", 30), CacheWrite("j", "w", 600)])
    assert set(await disk.get_many(["k", "j"])) == {"k", "j"}
    assert (await disk.get_many(["k"]))["k"].content == "v"
    clock.now += 31
    assert await disk.get_many(["k"]) == {}
    assert set(await disk.get_many(["k", "j"])) == {"j"}
    stats = await disk.statistics()
    assert stats.expired == 2 and stats.errors == 0


async def test_lookups_on_the_loop_count_as_the_thread_counts(tmp_path: Path) -> None:
    """Hits, misses and expiries counted by lookups on the loop, from the memo or decoded
    anew, are what the same lookups on a thread count, key for key."""
    clock = FakeClock(time.time())
    loop, thread = (DiskResultCache(tmp_path / n, clock=clock) for n in ("loop", "thread"))
    for disk in (loop, thread):
        disk.set_many_sync([CacheWrite(f"k{i}", f"v{i}", 30 if i % 3 else 600) for i in range(9)])
    rounds = [["k0", "k1", "nope"], [f"k{i}" for i in range(9)] + ["k1", "nope"], ["k2", "k3"]]
    for n, asked in enumerate(rounds * 2):
        if n == len(rounds):
            clock.now += 31  # k1, k2, k4, k5, k7, k8 expire
        on_loop = {k: e.content for k, e in (await loop.get_many(asked)).items()}
        assert on_loop == {k: e.content for k, e in thread.get_many_sync(asked).items()}
    a, b = await loop.statistics(), thread.statistics_sync()
    assert (a.hits, a.misses, a.expired, a.errors) == (b.hits, b.misses, b.expired, b.errors)
    assert a.expired > 0 and a.hits > 0


@pytest.mark.parametrize(
    "junk",
    [
        pytest.param(b"\xff\xfe\x00", id="not-utf8"),
        pytest.param(b'{"format":1,"content":"x","reads":[],"stored_at":1,"expires_at":NaN}', id="nan"),
        pytest.param(
            b'{"format":1,"content":"x","reads":[1],"stored_at":1,"expires_at":1e300}', id="bad-reads"
        ),
        pytest.param(b'{"format":1,"content":"x","reads":[],"stored_at":true,"expires_at":1e300}', id="bool"),
        pytest.param(
            b'{"format":1,"content":"x","reads":[],"stored_at":1,"expires_at":' + b"9" * 400 + b"}", id="huge"
        ),
        pytest.param(b'{"format":1,"content":"x","reads":[],"stored_at":1}', id="no-expiry"),
        pytest.param(b"[" * 5000 + b"]" * 5000, id="deep"),
        pytest.param(b'"just text"', id="a-string"),
    ],
)
async def test_junk_values_are_counted_misses_on_the_loop_every_time(folder: Path, junk: bytes) -> None:
    """A junk value in the row is a miss counted as an error on every lookup on the loop
    (nothing junk is kept decoded), and its neighbour is still a hit."""
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite("good", "G", 600)])
    diskcache.Cache(str(folder)).set("bad", junk)
    for _ in range(2):
        assert set(await disk.get_many(["bad", "good"])) == {"good"}
        assert await disk.get_many(["bad"]) == {}
    stats = await disk.statistics()
    assert stats.errors == 4 and stats.hits == 2 and disk.healthy


async def test_a_lone_surrogate_read_on_the_loop_is_what_was_written(folder: Path) -> None:
    """Content with a lone surrogate (which orjson refuses) and astral characters reads back
    on the loop exactly as written, and again from the memo."""
    disk = DiskResultCache(folder)
    text = "a\ud800b \U0001f600 \u2028"
    disk.set_many_sync([CacheWrite("k", text, 600)])
    for _ in range(2):
        assert (await disk.get_many(["k"]))["k"].content == text
        assert (await disk.get_many(["k", "j"]))["k"].content == text


async def test_more_keys_than_a_query_or_the_memo_holds_answer_as_the_thread_does(folder: Path) -> None:
    """A lookup of more keys than one query takes and than the memo keeps, on the loop, is
    what the thread answers, before and after the memo starts again."""
    clock = FakeClock(time.time())
    disk = DiskResultCache(folder, clock=clock)
    keys = [f"k{i}" for i in range(1300)]
    writes = [CacheWrite(k, f"value of {k}", 600 if i % 5 else 10) for i, k in enumerate(keys[:1200])]
    disk.set_many_sync(writes)
    asked = [*keys, "k3", "k3"]
    threaded = {k: e.content for k, e in disk.get_many_sync(asked).items()}
    assert len(threaded) == 1200
    for _ in range(2):
        assert {k: e.content for k, e in (await disk.get_many(asked)).items()} == threaded
    assert len(disk._decoded) <= cache._disk._DECODED_ENTRIES
    clock.now += 11
    after = {k: e.content for k, e in (await disk.get_many(asked)).items()}
    assert after == {k: v for k, v in threaded.items() if int(k[1:]) % 5}


_WRITE_ONE = """
    import sys
    from cache import CacheWrite, DiskResultCache
    DiskResultCache(sys.argv[1]).set_many_sync([CacheWrite(sys.argv[2], sys.argv[3], 600)])
    print("ready", flush=True)
"""


async def test_rows_kept_on_the_loop_are_read_again_once_another_process_commits(
    folder: Path, children: list[subprocess.Popen[str]]
) -> None:
    """The loop's connection serves the rows it read before while the database stands as it
    was (a hit asks SQLite its data_version, and nothing more); once another process
    commits, a key that was missing is found, and one overwritten is served anew."""
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite("k", "first", 600)])
    assert (await disk.get_many(["k", "late"]))["k"].content == "first"
    asked: list[str] = []
    disk._loop_connection().set_trace_callback(asked.append)
    assert set(await disk.get_many(["k", "late"])) == {"k"}
    assert asked == ["PRAGMA data_version"]
    for key, content in (("late", "found"), ("k", "second")):
        child = _child(_WRITE_ONE, str(folder), key, content)
        children.append(child)
        _ready(child)
        assert child.wait(timeout=10) == 0
        found = await disk.get_many(["k", "late"])
        assert found[key].content == content, found
    assert {k: e.content for k, e in (await disk.get_many(["k", "late"])).items()} == {
        "k": "second",
        "late": "found",
    }


async def test_a_row_kept_on_the_loop_expires_on_the_wall_clock_as_the_query_has_it(folder: Path) -> None:
    """diskcache's own expiry (the sweep, a grace after the entry's) is on the wall clock,
    and its query leaves an expired row out whatever the cache's clock reads: a row the
    loop's connection kept is left out as soon as it expires too, with nothing committed
    since (here the cache's clock stands still, and the row's sweep is set short)."""
    clock = FakeClock(time.time())
    disk = DiskResultCache(folder, clock=clock)
    disk.set_many_sync([CacheWrite("j", "w", 600)])
    value = cache._disk._encode("v", frozenset(), clock.now, clock.now + 600)
    disk._store.set("k", value, expire=0.3)
    assert set(await disk.get_many(["k", "j"])) == {"k", "j"}
    await anyio.sleep(0.4)
    assert set(await disk.get_many(["k", "j"])) == {"j"}
    assert disk.get_many_sync(["k", "j"]).keys() == {"j"}  # as the thread answers


async def test_more_keys_than_the_loop_keeps_rows_of_answer_as_the_thread_does(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups on the loop of more keys than its connection keeps rows of, and one cut short
    by a fault: each answers as the thread does, and a fault keeps nothing it did not read."""
    monkeypatch.setattr(cache._disk, "_ROWS_KEPT", 5)
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite(f"k{i}", f"v{i}", 600) for i in range(0, 8, 2)])
    for asked in (["k0", "k1", "k2"], ["k2", "k3", "k4", "k5", "k6"], ["k0", "k6", "k7"], ["k0", "k2"]):
        want = {k: e.content for k, e in disk.get_many_sync(asked).items()}
        assert {k: e.content for k, e in (await disk.get_many(asked)).items()} == want, asked
    disk._loop_rows(disk._store, ["k0"], disk._loop_connection())  # k0's row kept
    monkeypatch.setattr(cache._disk, "_SELECT_KEPT", "SELECT nothing FROM nowhere WHERE 0 IN ({})")
    with pytest.raises(sqlite3.OperationalError):
        disk._loop_rows(disk._store, ["k0", "k8"], disk._loop_connection())
    assert disk._loop_local.rows == {}  # nothing kept that the query did not read
    monkeypatch.undo()
    assert {k: e.content for k, e in (await disk.get_many(["k0", "k8"])).items()} == {"k0": "v0"}


async def test_a_large_value_is_read_again_rather_than_kept_on_the_loop(folder: Path) -> None:
    """A value too large to keep decoded is not kept with its row either: it is served
    whole, read each time, and what the loop's connection keeps stays small."""
    disk = DiskResultCache(folder)
    disk.set_many_sync([CacheWrite("big", "x" * 5000, 600), CacheWrite("small", "s", 600)])
    for _ in range(2):
        found = await disk.get_many(["big", "small"])
        assert found["big"].content == "x" * 5000 and found["small"].content == "s"
    assert set(disk._loop_local.rows) == {"small"}
