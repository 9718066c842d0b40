"""DiskResultCache: the result cache in a real diskcache folder, alone and shared by processes."""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diskcache
import platformdirs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cache
from builtin_tools import default_registry
from cache import (
    CacheEntry,
    CacheStatistics,
    CacheWrite,
    DiskResultCache,
    MemoryResultCache,
    ResultCache,
    default_cache_dir,
    resources_overlap,
)
from dispatcher import Dispatcher

from ._fakes import FakeClock
from ._http import serving

REPO = Path(cache.__file__).resolve().parents[1]
LOGGER = "threepass.cache"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def disk(folder: Path, clock: FakeClock) -> DiskResultCache:
    return DiskResultCache(folder, clock=clock)


def warnings_from_cache(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def index_rows(folder: Path) -> list[tuple[bytes, str]]:
    with sqlite3.connect(folder / "cache.db") as con:
        return sorted(con.execute("SELECT resource, key FROM threepass_reads").fetchall())


# --- the basics ---------------------------------------------------------------------------


def test_is_a_result_cache(disk: DiskResultCache, folder: Path) -> None:
    """A DiskResultCache satisfies the ResultCache protocol and opens healthy in its folder."""
    assert isinstance(disk, ResultCache)
    assert disk.healthy
    assert disk.directory == folder
    assert (folder / "cache.db").is_file()


def test_set_then_get_returns_the_entry(disk: DiskResultCache, clock: FakeClock) -> None:
    """What was set comes back whole: content, reads and the time it was stored."""
    disk.set_sync("k1", "hello", ttl=60, reads=["file:/w/a.txt", "url:https://e.com/"])
    assert disk.get_sync("k1") == CacheEntry(
        "hello", frozenset({"file:/w/a.txt", "url:https://e.com/"}), clock.now
    )


def test_missing_key_is_a_miss(disk: DiskResultCache) -> None:
    """A key never set is None and counts one miss."""
    assert disk.get_sync("nothing") is None
    assert disk.statistics_sync().misses == 1


def test_entries_outlive_the_object(folder: Path, clock: FakeClock) -> None:
    """An entry written by one DiskResultCache is served by a later one on the same folder."""
    with DiskResultCache(folder, clock=clock) as first:
        first.set_sync("k", "kept", ttl=60)
    assert DiskResultCache(folder, clock=clock).get_sync("k") == CacheEntry("kept", frozenset(), clock.now)


def test_any_text_roundtrips(disk: DiskResultCache) -> None:
    """Non-ASCII content and resources, even lone surrogates from undecodable paths, survive."""
    odd = "caf\u00e9 \u4e2d\u6587 \U0001f600 \udcff"
    disk.set_sync("k", odd, ttl=60, reads=["file:/w/caf\udce9"])
    entry = disk.get_sync("k")
    assert entry is not None
    assert entry.content == odd
    assert entry.reads == {"file:/w/caf\udce9"}
    assert disk.invalidate_sync(["file:/w"]) == 1


def test_large_content_roundtrips_and_is_invalidated(disk: DiskResultCache, folder: Path) -> None:
    """Content stored in a file beside the database reads back whole and goes on invalidation."""
    big = "x" * 100_000 + "end"
    disk.set_sync("big", big, ttl=60, reads=["url:https://e.com/page"])
    assert any(p.suffix == ".val" for p in folder.rglob("*"))
    entry = disk.get_sync("big")
    assert entry is not None and entry.content == big
    assert disk.invalidate_sync(["url:https://e.com/page"]) == 1
    assert disk.get_sync("big") is None
    assert not any(p.suffix == ".val" for p in folder.rglob("*"))


def test_overwrite_replaces_content_and_reads(disk: DiskResultCache, folder: Path) -> None:
    """Setting a key again replaces its content and forgets what the old value read."""
    disk.set_sync("k", "old", ttl=60, reads=["file:/w/old"])
    disk.set_sync("k", "new", ttl=60, reads=["file:/w/new"])
    assert index_rows(folder) == [(b"file:/w/new", "k")]
    assert disk.invalidate_sync(["file:/w/old"]) == 0
    entry = disk.get_sync("k")
    assert entry is not None and entry.content == "new"
    assert disk.invalidate_sync(["file:/w/new"]) == 1


def test_non_positive_ttl_stores_nothing(disk: DiskResultCache) -> None:
    """An entry that would be born expired is not written."""
    disk.set_sync("k", "v", ttl=0)
    assert disk.get_sync("k") is None
    assert disk.statistics_sync().writes == 0


# --- expiry -------------------------------------------------------------------------------


def test_entry_expires_by_the_injected_clock(disk: DiskResultCache, clock: FakeClock) -> None:
    """An entry is served until its ttl has passed on the injected clock, then is an expired miss."""
    disk.set_sync("k", "v", ttl=1800, reads=["url:https://e.com"])
    clock.now += 1799.5
    assert disk.get_sync("k") is not None
    clock.now += 0.5
    assert disk.get_sync("k") is None
    stats = disk.statistics_sync()
    assert (stats.hits, stats.misses, stats.expired) == (1, 1, 1)


def test_a_fresh_write_after_expiry_is_served(disk: DiskResultCache, clock: FakeClock) -> None:
    """Rewriting an expired key starts a new lifetime from the clock's current time."""
    disk.set_sync("k", "first", ttl=10)
    clock.now += 20
    disk.set_sync("k", "second", ttl=10)
    assert disk.get_sync("k") == CacheEntry("second", frozenset(), clock.now)


# --- invalidation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "dropped"),
    [
        (["file:/w/a/b.txt"], True),  # the same file
        (["file:/w/a/b.txt/"], True),  # a trailing slash names the same resource
        (["file:/w/a"], True),  # a folder above
        (["file:/w/a/"], True),
        (["file:/w"], True),
        (["file:/"], True),  # every file
        (["file:/w/a/b.txt/inner"], True),  # below it: the read saw what changed
        (["file:/w/b"], False),  # a sibling folder
        (["file:/w/a/b"], False),  # a name prefix is not a folder
        (["file:/w/a/b.txt.bak"], False),
        (["file:/w/a/b.txt0"], False),
        (["url:https://w/a/b.txt"], False),
        ([], False),
        (["file:/w/b", "file:/w/a"], True),
    ],
)
def test_invalidation_follows_resources_overlap(
    disk: DiskResultCache, written: list[str], dropped: bool
) -> None:
    """A write drops an entry exactly when resources_overlap says its reads overlap the write."""
    reads = ["file:/w/a/b.txt"]
    assert resources_overlap(reads, written) is dropped
    disk.set_sync("k", "v", ttl=60, reads=reads)
    disk.set_sync("unrelated", "v", ttl=60, reads=["url:https://elsewhere/x"])
    assert disk.invalidate_sync(written) == int(dropped)
    assert (disk.get_sync("k") is None) is dropped
    assert disk.get_sync("unrelated") is not None


@pytest.mark.parametrize("neighbour", ["file:/w/a0", "file:/w/a.b", "file:/w/a-", "file:/w/ab/c"])
def test_names_that_sort_beside_a_folder_are_not_in_it(disk: DiskResultCache, neighbour: str) -> None:
    """Invalidating file:/w/a spares entries that read file:/w/a0, file:/w/a.b and the like."""
    assert not resources_overlap([neighbour], ["file:/w/a"])
    disk.set_sync("k", "v", ttl=60, reads=[neighbour])
    disk.set_sync("inside", "v", ttl=60, reads=["file:/w/a/z"])
    assert disk.invalidate_sync(["file:/w/a"]) == 1
    assert disk.get_sync("k") is not None
    assert disk.get_sync("inside") is None


def test_entry_that_read_a_folder_goes_when_a_file_in_it_changes(disk: DiskResultCache) -> None:
    """A listing of file:/w is dropped by a write to file:/w/sub/new.txt."""
    disk.set_sync("listing", "a.txt\nsub/", ttl=60, reads=["file:/w/"])
    assert disk.invalidate_sync(["file:/w/sub/new.txt"]) == 1
    assert disk.get_sync("listing") is None


def test_invalidate_counts_each_entry_once(disk: DiskResultCache, folder: Path) -> None:
    """An entry matched by several written resources is dropped and counted once."""
    disk.set_sync("two", "v", ttl=60, reads=["file:/w/a", "file:/w/b"])
    disk.set_sync("one", "v", ttl=60, reads=["file:/w/b"])
    disk.set_sync("none", "v", ttl=60, reads=["file:/x"])
    assert disk.invalidate_sync(iter(["file:/w/a", "file:/w/b"])) == 2
    assert disk.statistics_sync().invalidations == 2
    assert index_rows(folder) == [(b"file:/x", "none")]


_segments = st.lists(st.sampled_from(["a", "a0", "a.b", "\u00e9", "a b"]), max_size=3)
_resources = st.builds(
    lambda parts, slash: "file:/" + "/".join(parts) + ("/" if slash and parts else ""),
    _segments,
    st.booleans(),
)


@pytest.fixture(scope="module")
def reused_disk(tmp_path_factory: pytest.TempPathFactory) -> DiskResultCache:
    return DiskResultCache(tmp_path_factory.mktemp("overlap"))


@settings(max_examples=80, deadline=None)
@given(
    entries=st.lists(st.lists(_resources, max_size=3), min_size=1, max_size=6),
    written=st.lists(_resources, max_size=3),
)
def test_index_drops_what_the_overlap_rule_drops(
    reused_disk: DiskResultCache, entries: list[list[str]], written: list[str]
) -> None:
    """The index answers invalidation exactly as MemoryResultCache's scan of every entry does."""
    reused_disk.clear_sync()
    memory = MemoryResultCache()
    for i, reads in enumerate(entries):
        for store in (reused_disk, memory):
            store.set_sync(f"k{i}", "v", ttl=60, reads=reads)
    assert reused_disk.invalidate_sync(written) == memory.invalidate_sync(written)
    keys = [f"k{i}" for i in range(len(entries))]
    assert [reused_disk.get_sync(k) is None for k in keys] == [memory.get_sync(k) is None for k in keys]


# --- clear and statistics -----------------------------------------------------------------


def test_clear_empties_the_store_and_its_index(disk: DiskResultCache, folder: Path) -> None:
    """After clear() nothing is served, nothing is counted, and the reads index is empty."""
    for i in range(5):
        disk.set_sync(f"k{i}", "v", ttl=60, reads=[f"file:/w/{i}"])
    disk.clear_sync()
    assert disk.statistics_sync().entries == 0
    assert disk.get_sync("k0") is None
    assert index_rows(folder) == []


def test_statistics_count_every_outcome(disk: DiskResultCache, clock: FakeClock) -> None:
    """hits, misses, writes, invalidations, expired and entries each count what happened."""
    disk.set_sync("a", "1", ttl=10, reads=["file:/a"])
    disk.set_sync("b", "2", ttl=100, reads=["file:/b"])
    disk.set_sync("c", "3", ttl=100, reads=["file:/c"])
    disk.get_sync("a")
    disk.get_sync("zzz")
    clock.now += 50
    disk.get_sync("a")  # expired
    disk.invalidate_sync(["file:/b"])
    assert disk.statistics_sync() == CacheStatistics(
        hits=1, misses=2, writes=3, invalidations=1, expired=1, errors=0, entries=2
    )


# --- the folder ---------------------------------------------------------------------------


def test_env_variable_chooses_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """THREEPASS_CACHE_DIR names the folder when no directory is given."""
    monkeypatch.setenv("THREEPASS_CACHE_DIR", str(tmp_path / "from-env"))
    assert default_cache_dir() == tmp_path / "from-env"
    with DiskResultCache() as disk:
        assert disk.directory == tmp_path / "from-env"
    assert (tmp_path / "from-env" / "cache.db").is_file()


def test_directory_argument_beats_the_env_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit directory wins over THREEPASS_CACHE_DIR."""
    monkeypatch.setenv("THREEPASS_CACHE_DIR", str(tmp_path / "from-env"))
    with DiskResultCache(tmp_path / "given") as disk:
        assert disk.directory == tmp_path / "given"
    assert (tmp_path / "given" / "cache.db").is_file()
    assert not (tmp_path / "from-env").exists()


@pytest.mark.parametrize("env", [None, ""])
def test_default_folder_is_the_platform_user_cache(monkeypatch: pytest.MonkeyPatch, env: str | None) -> None:
    """Without THREEPASS_CACHE_DIR (or with it empty) the folder is the platform's user cache."""
    if env is None:
        monkeypatch.delenv("THREEPASS_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("THREEPASS_CACHE_DIR", env)
    assert default_cache_dir() == Path(platformdirs.user_cache_dir("threepass"))


# --- size limit ---------------------------------------------------------------------------


def test_size_limit_evicts_least_recently_used(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the size limit the least recently used entries go; one read often stays."""
    wall = FakeClock(1_700_000_000.0)
    # diskcache stamps access times with time.time; a hit refreshes one over a minute old
    monkeypatch.setattr(time, "time", wall)
    limit = 256 * 1024
    disk = DiskResultCache(folder, clock=wall, size_limit=limit)
    disk.set_sync("hot", "h" * 2000, ttl=10**6, reads=["file:/hot"])
    written = 300
    for i in range(written):
        wall.now += 61
        disk.set_sync(f"k{i}", "v" * 2000, ttl=10**6, reads=[f"file:/x/{i}"])
        assert disk.get_sync("hot") is not None, f"hot entry evicted after {i} writes"
    entries = disk.statistics_sync().entries
    assert 10 < entries < written // 2
    assert disk.get_sync("k0") is None
    assert disk.get_sync(f"k{written - 1}") is not None
    assert diskcache.Cache(folder).volume() <= limit + 16 * 1024
    assert len(index_rows(folder)) == entries  # evictions took their index rows along


def test_hits_refresh_the_access_time_at_most_once_a_minute(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit writes the LRU access time only when it is over a minute old, keeping reads cheap."""
    wall = FakeClock(1_700_000_000.0)
    monkeypatch.setattr(time, "time", wall)
    disk = DiskResultCache(folder, clock=wall)
    disk.set_sync("k", "v", ttl=3600)

    def access_time() -> float:
        with sqlite3.connect(folder / "cache.db") as con:
            ((value,),) = con.execute("SELECT access_time FROM Cache WHERE key = 'k'")
            return float(value)

    wall.now += 59
    assert disk.get_sync("k") is not None
    assert access_time() == 1_700_000_000.0
    wall.now += 2
    assert disk.get_sync("k") is not None
    assert access_time() == 1_700_000_061.0


# --- undecodable values -------------------------------------------------------------------

tripped: list[str] = []


def _trip() -> str:
    tripped.append("unpickled")
    return "loaded"


class Tripwire:
    """Records in `tripped` if anyone ever unpickles it."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_trip, ())


def _real_value(folder: Path, clock: FakeClock, content: str = "real") -> bytes:
    DiskResultCache(folder, clock=clock).set_sync("k", content, ttl=60)
    value = diskcache.Cache(folder).get("k")
    assert isinstance(value, bytes)
    return value


@pytest.mark.parametrize(
    "make_value",
    [
        pytest.param(lambda real: b"\x00\xffgarbage\xfe", id="garbage-bytes"),
        pytest.param(lambda real: real[: len(real) // 2], id="truncated"),
        pytest.param(lambda real: real[:-1], id="last-byte-missing"),
        pytest.param(lambda real: real.replace(b'"format":1', b'"format":2'), id="other-format"),
        pytest.param(lambda real: real.replace(b'"format":1,', b""), id="no-format"),
        pytest.param(lambda real: real.replace(b'"content":"', b'"content":["'), id="wrong-shape"),
        pytest.param(lambda real: b"[1, 2, 3]", id="json-list"),
        pytest.param(lambda real: b"[" * 100_000, id="deep-nesting"),
        pytest.param(lambda real: real.decode(), id="text-not-bytes"),
        pytest.param(lambda real: 42, id="an-int"),
        pytest.param(lambda real: Tripwire(), id="a-pickle"),
        pytest.param(lambda real: b"\xff" * 50_000, id="garbage-in-a-file"),
        pytest.param(lambda real: real[:-1] + b" " * 40_000, id="truncated-in-a-file"),
    ],
)
def test_undecodable_value_is_a_counted_miss(folder: Path, clock: FakeClock, make_value: object) -> None:
    """A value that is not a current-format entry is a miss counted in errors, never loaded."""
    real = _real_value(folder, clock, content="x" * 100)
    assert callable(make_value)
    diskcache.Cache(folder).set("k", make_value(real))
    disk = DiskResultCache(folder, clock=clock)
    assert disk.get_sync("k") is None
    stats = disk.statistics_sync()
    assert (stats.misses, stats.errors, stats.hits) == (1, 1, 0)
    assert tripped == []
    # one bad value does not disable the cache: the key can be written and read again
    assert disk.healthy
    disk.set_sync("k", "again", ttl=60)
    entry = disk.get_sync("k")
    assert entry is not None and entry.content == "again"


def test_value_file_gone_is_a_plain_miss(disk: DiskResultCache, folder: Path) -> None:
    """A large value whose file vanished (another process replaced it) is a miss, not an error."""
    disk.set_sync("big", "y" * 50_000, ttl=60)
    (value_file,) = [p for p in folder.rglob("*.val")]
    value_file.unlink()
    assert disk.get_sync("big") is None
    assert disk.statistics_sync().errors == 0
    assert disk.healthy


# --- a broken folder ----------------------------------------------------------------------


def _assert_disabled_but_harmless(
    disk: DiskResultCache, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk.set_sync("k", "v", ttl=60, reads=["file:/a"])
    assert disk.get_sync("k") is None
    assert disk.invalidate_sync(["file:/a"]) == 0
    disk.clear_sync()
    assert not disk.healthy
    stats = disk.statistics_sync()
    assert stats.errors == 1
    assert (stats.hits, stats.writes, stats.entries) == (0, 0, 0)
    (warning,) = warnings_from_cache(caplog)
    assert str(folder) in warning.getMessage()
    assert "disabled" in warning.getMessage()


def test_garbage_database_file_disables_the_cache(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cache.db that is not a database: one warning naming the folder, then misses and no-ops."""
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"this is not sqlite\x00" * 500)
    disk = DiskResultCache(folder)
    assert not disk.healthy
    assert "not a database" in warnings_from_cache(caplog)[0].getMessage()
    _assert_disabled_but_harmless(disk, folder, caplog)


def test_truncated_database_file_disables_the_cache(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cache.db cut in half (a crash, a full disk) disables the cache at its first failure."""
    with DiskResultCache(folder) as disk:
        for i in range(200):
            disk.set_sync(f"k{i}", "v" * 1000, ttl=600, reads=[f"file:/x/{i}"])
    db = folder / "cache.db"
    assert not (folder / "cache.db-wal").exists()
    with db.open("r+b") as f:
        f.truncate(db.stat().st_size // 2)
    disk = DiskResultCache(folder)
    for i in range(200):  # whether opening or some read notices first, nothing is served
        assert disk.get_sync(f"k{i}") is None
    _assert_disabled_but_harmless(disk, folder, caplog)


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder the cache cannot create its database in: read-only, or, where permissions do
    not bind (root), a path under a regular file, which no one can create."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    probe = locked / "probe"
    try:
        probe.touch()
    except PermissionError:
        return locked
    probe.unlink()
    locked.chmod(0o700)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker / "cache"


def test_unwritable_folder_disables_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A folder that cannot be written: one warning naming it, then misses and no-ops."""
    folder = _unwritable_folder(tmp_path)
    try:
        disk = DiskResultCache(folder)
        _assert_disabled_but_harmless(disk, folder, caplog)
    finally:
        if folder.name == "locked":
            folder.chmod(0o700)


def test_disk_full_on_write_disables_the_cache(
    disk: DiskResultCache, folder: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails (the disk is full) warns once and turns the cache off, never raising."""
    disk.set_sync("before", "v", ttl=60)

    def full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(diskcache.Cache, "set", full)
    disk.set_sync("k", "v", ttl=60)
    disk.set_sync("k2", "v", ttl=60)
    assert not disk.healthy
    assert disk.get_sync("before") is None
    (warning,) = warnings_from_cache(caplog)
    assert str(folder) in warning.getMessage() and "disk is full" in warning.getMessage()
    assert disk.statistics_sync().errors == 1


def test_failed_invalidation_stops_serving(
    disk: DiskResultCache, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If an invalidation fails, the entries it should have dropped are never served afterwards."""
    disk.set_sync("k", "stale soon", ttl=60, reads=["file:/w/a"])

    def broken(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(diskcache.Cache, "transact", broken)
    assert disk.invalidate_sync(["file:/w/a"]) == 0
    monkeypatch.undo()
    assert disk.get_sync("k") is None
    assert not disk.healthy
    assert len(warnings_from_cache(caplog)) == 1


# --- several processes --------------------------------------------------------------------

_SET_IN_CHILD = textwrap.dedent(
    """
    import json, sys
    from cache import DiskResultCache
    folder, key, content, reads = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    disk = DiskResultCache(folder)
    disk.set_sync(key, content, ttl=600, reads=reads)
    print(json.dumps(disk.healthy))
    """
)

_GET_IN_CHILD = textwrap.dedent(
    """
    import json, sys
    from cache import DiskResultCache
    entry = DiskResultCache(sys.argv[1]).get_sync(sys.argv[2])
    print(json.dumps(None if entry is None else [entry.content, sorted(entry.reads)]))
    """
)

_HAMMER_IN_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from cache import DiskResultCache
    folder, key, letter, size, rounds, go = sys.argv[1:]
    disk = DiskResultCache(folder)
    print("ready", flush=True)
    give_up = time.monotonic() + 30
    while not os.path.exists(go):
        if time.monotonic() > give_up:
            sys.exit("never told to go")
        time.sleep(0.001)
    for _ in range(int(rounds)):
        disk.set_sync(key, letter * int(size), ttl=600, reads=["file:/" + letter])
    stats = disk.statistics_sync()
    print(stats.writes, stats.errors, disk.healthy, flush=True)
    """
)


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(child: subprocess.Popen[str]) -> str:
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    return out


def test_one_process_reads_what_another_wrote(folder: Path) -> None:
    """An entry set in one process is a hit in another process on the same folder."""
    writer = _child(_SET_IN_CHILD, str(folder), "k", "from A", json.dumps(["file:/w/a"]))
    assert json.loads(_finish(writer)) is True
    reader = _child(_GET_IN_CHILD, str(folder), "k")
    assert json.loads(_finish(reader)) == ["from A", ["file:/w/a"]]


def test_concurrent_writers_of_one_key_leave_one_whole_value(folder: Path, tmp_path: Path) -> None:
    """Two processes writing one key at once: every read, and the last value, is one writer's
    value whole, with that writer's reads."""
    go = tmp_path / "go"
    rounds = "150"
    # one value lives in the database, the other in a file beside it
    values = {"A": "A" * 40_000, "B": "B" * 500}
    writers = [
        _child(_HAMMER_IN_CHILD, str(folder), "k", letter, str(len(value)), rounds, str(go))
        for letter, value in values.items()
    ]
    try:
        for writer in writers:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "ready"
        disk = DiskResultCache(folder)
        go.touch()
        give_up = time.monotonic() + 30
        while any(w.poll() is None for w in writers):
            assert time.monotonic() < give_up, "writers still running after 30 s"
            entry = disk.get_sync("k")
            if entry is not None:
                letter = entry.content[0]
                assert entry.content == values[letter]
                assert entry.reads == {"file:/" + letter}
        for writer in writers:
            assert _finish(writer).split() == [rounds, "0", "True"]
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.communicate()
    final = disk.get_sync("k")
    assert final is not None
    letter = final.content[0]
    assert final.content == values[letter]
    other = "B" if letter == "A" else "A"
    assert disk.invalidate_sync(["file:/" + other]) == 0
    assert disk.invalidate_sync(["file:/" + letter]) == 1
    assert index_rows(folder) == []


def test_tripwire_notices_unpickling() -> None:
    """Unpickling a Tripwire records it, so the pickle case above would see a load."""
    before = len(tripped)
    assert pickle.loads(pickle.dumps(Tripwire())) == "loaded"
    assert len(tripped) == before + 1
    tripped.pop()


# --- many keys at once --------------------------------------------------------------------


@pytest.mark.parametrize("store", ["disk", "memory"])
def test_get_many_answers_as_get_would(store: str, folder: Path, clock: FakeClock) -> None:
    """get_many returns the live entries among the keys, as get finds each, and counts them alike."""
    made: ResultCache = (
        DiskResultCache(folder, clock=clock) if store == "disk" else MemoryResultCache(clock=clock)
    )
    made.set_sync("a", "A", ttl=60, reads=["file:/a"])
    made.set_sync("b", "B", ttl=10)
    made.set_sync("c", "C" * 50_000, ttl=60)  # a value in its own file
    clock.now += 30  # b has expired
    found = made.get_many_sync(["a", "b", "c", "missing", "a"])
    assert sorted(found) == ["a", "c"]
    assert found["a"] == CacheEntry("A", frozenset({"file:/a"}), clock.now - 30)
    assert found["c"].content == "C" * 50_000
    stats = made.statistics_sync()
    # every distinct key asked counts once: a and c hit; b expired; "missing" missed
    assert (stats.hits, stats.misses, stats.expired) == (2, 2, 1)


def test_get_many_on_disk_reads_hundreds_of_keys(disk: DiskResultCache) -> None:
    """More keys than one query takes are read in several, and every one is found."""
    keys = [f"k{i:04d}" for i in range(1_234)]
    for i, key in enumerate(keys):
        if i % 3:
            disk.set_sync(key, f"v{i}", ttl=60)
    found = disk.get_many_sync(keys)
    assert {k: e.content for k, e in found.items()} == {k: f"v{i}" for i, k in enumerate(keys) if i % 3}
    assert disk.statistics_sync().hits == len(found) and disk.statistics_sync().misses == len(keys) - len(
        found
    )


def test_get_many_counts_an_undecodable_value_and_serves_the_rest(folder: Path, clock: FakeClock) -> None:
    """One value that is not an entry is a counted error among otherwise good hits."""
    disk = DiskResultCache(folder, clock=clock)
    disk.set_sync("good", "G", ttl=60)
    diskcache.Cache(folder).set("bad", b"not json")
    assert {k: e.content for k, e in disk.get_many_sync(["bad", "good"]).items()} == {"good": "G"}
    stats = disk.statistics_sync()
    assert (stats.hits, stats.misses, stats.errors) == (1, 1, 1)
    assert disk.healthy


def test_get_many_on_a_disabled_store_is_all_misses(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store whose database is broken answers get_many with nothing, counted as misses."""
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"this is not sqlite\x00" * 500)
    broken = DiskResultCache(folder)
    assert broken.get_many_sync(["a", "b"]) == {}
    assert broken.statistics_sync().misses == 2
    assert not broken.healthy and len(warnings_from_cache(caplog)) == 1


def test_get_many_failing_mid_read_disables_once(
    disk: DiskResultCache, caplog: pytest.LogCaptureFixture
) -> None:
    """A database that fails during get_many disables the store with one warning; no call fails."""
    disk.set_sync("a", "A", ttl=60)
    disk.set_sync("b", "B", ttl=60)
    disk._store._con.close()  # type: ignore[union-attr]  # the next query raises sqlite3.ProgrammingError
    assert disk.get_many_sync(["a", "b"]) == {}
    assert not disk.healthy
    assert disk.statistics_sync().misses == 2
    assert len(warnings_from_cache(caplog)) == 1


# --- the async seam -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["disk", "memory"])
async def test_the_async_seam_keeps_and_serves_a_batch(kind: str, folder: Path, clock: FakeClock) -> None:
    """set_many keeps every write, get_many serves them, invalidate drops what overlaps, on
    either event loop."""
    made: ResultCache = (
        DiskResultCache(folder, clock=clock) if kind == "disk" else MemoryResultCache(clock=clock)
    )
    await made.set_many(
        [CacheWrite("a", "A", 60, frozenset({"file:/w/a"})), CacheWrite("b", "B", 60, frozenset({"file:/x"}))]
    )
    found = await made.get_many(["a", "b", "c"])
    assert {k: e.content for k, e in found.items()} == {"a": "A", "b": "B"}
    assert await made.invalidate(["file:/w"]) == 1
    assert sorted(await made.get_many(["a", "b"])) == ["b"]
    stats = await made.statistics()
    assert (stats.writes, stats.invalidations, stats.entries) == (2, 1, 1)
    await made.clear()
    assert await made.get_many(["b"]) == {}


def _spy(disk: DiskResultCache, name: str) -> list[int]:
    """The threads that call `disk.<name>` from now on."""
    seen: list[int] = []
    real = getattr(disk, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kwargs)

    setattr(disk, name, spy)
    return seen


async def test_the_disk_store_writes_off_the_event_loop_thread(disk: DiskResultCache) -> None:
    """Writes and invalidations, which take SQLite's write lock, run in a worker thread."""
    writes, invalidations = _spy(disk, "set_many_sync"), _spy(disk, "invalidate_sync")
    await disk.set_many([CacheWrite("a", "A", 60, frozenset({"file:/w/a"}))])
    await disk.invalidate(["file:/w/a"])
    here = threading.get_ident()
    assert writes and invalidations and here not in writes + invalidations


async def test_a_small_hit_is_read_on_the_event_loop(disk: DiskResultCache) -> None:
    """A hit whose value is in the database and whose access time is fresh is read on the
    loop's thread, with the same answer as the thread's."""
    disk.set_many_sync([CacheWrite("a", "A", 60, frozenset({"file:/w/a"})), CacheWrite("b", "B", 60)])
    threaded = disk.get_many_sync(["a", "b", "c"])
    hops = _spy(disk, "get_many_sync")
    assert await disk.get_many(["a", "b", "c"]) == threaded
    assert hops == []
    assert set(threaded) == {"a", "b"} and threaded["a"].reads == frozenset({"file:/w/a"})


async def test_a_value_file_or_a_stale_access_time_is_read_in_a_thread(disk: DiskResultCache) -> None:
    """A lookup that must read a value file, or write an access time, goes to a thread."""
    disk.set_many_sync([CacheWrite("big", "x" * 100_000, 60), CacheWrite("old", "O", 60)])
    hops = _spy(disk, "get_many_sync")
    found = await disk.get_many(["big"])
    assert found["big"].content == "x" * 100_000 and len(hops) == 1
    con = sqlite3.connect(disk.directory / "cache.db")
    with con:
        con.execute("UPDATE Cache SET access_time = 0")
    con.close()
    assert (await disk.get_many(["old"]))["old"].content == "O" and len(hops) == 2
    assert hops[0] != threading.get_ident()
    assert (await disk.get_many(["old"]))["old"].content == "O" and len(hops) == 2  # touched


async def test_a_lookup_that_was_only_slow_stays_on_the_loop(
    disk: DiskResultCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow lookup during which the thread never slept (it was preempted, the machine is
    busy) keeps lookups on the loop."""
    disk.set_many_sync([CacheWrite("a", "A", 60)])
    await disk.get_many(["a"])
    monkeypatch.setattr(cache._disk, "INLINE_STALL", -1.0)
    hops = _spy(disk, "get_many_sync")
    for _ in range(3):
        assert "a" in await disk.get_many(["a"])
    assert hops == []


def test_the_thread_sleeps_are_counted_here() -> None:
    """On Linux the count of a thread's sleeps moves when it sleeps, so a stall is told
    from preemption."""
    if cache._disk._RUSAGE_THREAD is None:
        pytest.skip("this system does not count a thread's sleeps")
    before = cache._disk._sleeps()
    time.sleep(0.01)
    assert cache._disk._sleeps() > before


async def test_a_slow_lookup_on_the_loop_sends_lookups_to_a_thread(
    disk: DiskResultCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup on the loop that took longer than the stall limit sends the next ones to a
    worker thread, with one line on the cache's log."""
    disk.set_many_sync([CacheWrite("a", "A", 60)])
    await disk.get_many(["a"])  # the loop's first lookup opens its connection: not timed
    monkeypatch.setattr(cache._disk, "INLINE_STALL", -1.0)
    slept = iter(range(1_000_000))
    monkeypatch.setattr(cache._disk, "_sleeps", lambda: next(slept))  # it slept in every read
    hops = _spy(disk, "get_many_sync")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert "a" in await disk.get_many(["a"])  # on the loop, and "slow"
        assert hops == []
        assert "a" in await disk.get_many(["a"])
        assert "a" in await disk.get_many(["a"])
    assert len(hops) == 2 and threading.get_ident() not in hops
    assert sum("go to a thread" in r.getMessage() for r in caplog.records) == 1


def test_set_many_writes_a_batch_in_one_transaction(disk: DiskResultCache) -> None:
    """A batch of writes commits once: the SQLite connection sees one transaction, not one per entry."""
    con = disk._store._con  # the connection diskcache made for this thread
    before = con.total_changes
    commits: list[str] = []
    con.set_trace_callback(
        lambda sql: commits.append(sql) if sql.strip().upper().startswith(("COMMIT", "BEGIN")) else None
    )
    disk.set_many_sync([CacheWrite(f"k{i}", "v", 60, frozenset({f"file:/w/{i}"})) for i in range(50)])
    con.set_trace_callback(None)
    assert con.total_changes > before
    assert sum(1 for sql in commits if sql.strip().upper().startswith("COMMIT")) == 1
    assert len(disk.get_many_sync([f"k{i}" for i in range(50)])) == 50


# --- permissions --------------------------------------------------------------------------------


def _modes(folder: Path) -> dict[str, tuple[bool, int]]:
    """(is a file, permission bits) of the folder and of everything under it, by relative path."""
    found = {".": (False, folder.stat().st_mode & 0o777)}
    for path in folder.rglob("*"):
        found[str(path.relative_to(folder))] = (path.is_file(), path.stat().st_mode & 0o777)
    return found


def test_a_new_cache_is_readable_by_its_owner_only(folder: Path, clock: FakeClock) -> None:
    """A folder the cache creates is 0700, its database files and value files 0600, whatever the umask."""
    old = os.umask(0o022)
    try:
        disk = DiskResultCache(folder / "deeper", clock=clock)
        disk.set_sync("small", "x", ttl=60)
        disk.set_sync("large", "y" * 100_000, ttl=60)  # over diskcache's 32 KiB: a value file
        modes = _modes(folder / "deeper")
    finally:
        os.umask(old)
        disk.close()
    assert {"cache.db", "cache.db-wal", "cache.db-shm"} <= set(modes)
    value_files = [name for name in modes if name.endswith(".val")]
    assert len(value_files) == 1
    for name, (is_file, mode) in modes.items():
        assert mode == (0o600 if is_file else 0o700), f"{name} is {oct(mode)}"


def test_an_existing_folder_keeps_its_mode(folder: Path, clock: FakeClock) -> None:
    """A folder that was already there is left as its owner made it; the new database in it is 0600."""
    folder.mkdir(mode=0o750)
    folder.chmod(0o750)
    DiskResultCache(folder, clock=clock).close()
    assert folder.stat().st_mode & 0o777 == 0o750
    assert (folder / "cache.db").stat().st_mode & 0o777 == 0o600


# --- credentials never reach the disk -----------------------------------------------------------


@pytest.fixture(scope="module")
def echo_server() -> Iterator[str]:
    with serving() as host:
        yield host


SECRET = "s3cr3t-Value-9f2c"
BASIC = base64.b64encode(f"user:{SECRET}".encode()).decode()  # what user info is sent as
_CREDENTIAL_HEADERS = ["X-Api-Key", "X-Auth-Token", "Api-Key", "Private-Token", "X-Goog-Api-Key",
                       "Ocp-Apim-Subscription-Key", "Authorization", "Proxy-Authorization",
                       "Cookie"]  # fmt: skip


def _web_dispatcher(tmp_path: Path, folder: Path) -> tuple[Dispatcher, DiskResultCache]:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    store = DiskResultCache(folder)
    return Dispatcher(default_registry(ws, include=["web"], allow_private_network=True), cache=store), store


def _files_holding(folder: Path, secret: str) -> list[str]:
    """Every file under `folder` whose bytes hold `secret` (the -wal included)."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def _call_cases(server: str) -> list[tuple[str, str, dict[str, Any]]]:
    cases = [(f"header {name}", "http_request", {"url": f"http://{server}/h",
                                                 "headers": {name: SECRET}})
             for name in _CREDENTIAL_HEADERS]  # fmt: skip
    for param in ("code", "sig", "access_token", "api_key"):
        for tool in ("http_request", "fetch_page"):
            cases.append((f"{tool} ?{param}=", tool, {"url": f"http://{server}/q?{param}={SECRET}"}))
        args = {"url": f"http://{server}/p", "params": {param: SECRET}}
        cases.append((f"params {param}", "http_request", args))
    for tool in ("http_request", "fetch_page"):
        cases.append((f"{tool} user:pass@", tool, {"url": f"http://user:{SECRET}@{server}/u"}))
    return cases


async def test_a_request_with_a_credential_is_never_written_to_disk(tmp_path: Path, echo_server: str) -> None:
    """A response to a request carrying a credential (header, query, user info) never reaches the store."""
    folder = tmp_path / "cache"
    dispatcher, store = _web_dispatcher(tmp_path, folder)
    for label, tool, args in _call_cases(echo_server):
        result = await dispatcher.invoke(tool, args)
        assert result.ok, (label, result.content)
        assert not result.cached, label
        # the server echoed it: had the result been stored, the search below would find it
        assert (BASIC if "user:pass" in label else SECRET) in result.content, label
    assert store.statistics_sync().writes == 0
    assert store.statistics_sync().entries == 0
    assert _files_holding(folder, SECRET) == _files_holding(folder, BASIC) == []
    store.close()


async def test_a_header_that_only_looks_like_a_credential_is_cached(tmp_path: Path, echo_server: str) -> None:
    """`Monkey` is no credential: its response is cached, and the echoed value is found on disk."""
    folder = tmp_path / "cache"
    dispatcher, store = _web_dispatcher(tmp_path, folder)
    args = {"url": f"http://{echo_server}/m", "headers": {"Monkey": "banana-echo-77"}}
    first = await dispatcher.invoke("http_request", args)
    assert first.ok and "banana-echo-77" in first.content
    assert store.statistics_sync().writes == 1
    assert _files_holding(folder, "banana-echo-77")  # the search would find a stored secret
    again, _ = _web_dispatcher(tmp_path, folder)
    assert (await again.invoke("http_request", args)).cached
    store.close()


def test_a_small_value_read_again_is_not_decoded_again(
    disk: DiskResultCache, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """A hit of a small value already read decodes nothing; a value written anew is read
    anew, and a kept entry still expires on time."""
    decoded: list[bytes] = []
    real = cache._disk._decode

    def counting(raw: bytes) -> Any:
        decoded.append(raw)
        return real(raw)

    monkeypatch.setattr(cache._disk, "_decode", counting)
    disk.set_many_sync([CacheWrite("a", "first", 60)])
    for _ in range(3):
        assert disk.get_many_sync(["a", "b"])["a"].content == "first"
    assert len(decoded) == 1
    disk.set_many_sync([CacheWrite("a", "second", 60)])
    assert disk.get_many_sync(["a", "b"])["a"].content == "second" and len(decoded) == 2
    clock.now += 61
    assert disk.get_many_sync(["a", "b"]) == {}


async def test_lookups_on_the_loop_wait_briefly_for_a_lock_and_the_store_as_long_as_it_says(
    folder: Path,
) -> None:
    """Lookups on the loop use a connection of their own that waits at most INLINE_BUSY
    for a lock (then a thread asks again); the store's own connections keep its timeout."""
    disk = DiskResultCache(folder, timeout=3.0)
    disk.set_many_sync([CacheWrite("a", "A", 600)])
    assert "a" in await disk.get_many(["a"])
    con = disk._loop_connection()
    timeout_ms = con.execute("PRAGMA busy_timeout").fetchone()[0]
    assert timeout_ms == int(cache._disk.INLINE_BUSY * 1000)
    assert disk._store._con.execute("PRAGMA busy_timeout").fetchone()[0] == 3000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_looks_up_on_a_connection_of_its_own(tmp_path: Path) -> None:
    """A lookup on the loop in a child forked after the parent's opens the child's own
    connection (SQLite's must not cross a fork), and finds what the parent stored."""
    import anyio

    store = DiskResultCache(tmp_path)
    store.set_many_sync([CacheWrite("k", "stored", 60.0, frozenset())])

    async def look() -> tuple[str | None, int]:
        found = await store.get_many(["k"])
        return (found["k"].content if "k" in found else None), id(store._loop_local.con)

    parent = anyio.run(look)
    assert parent[0] == "stored"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's exit handlers
        try:
            child = anyio.run(look)
            os.write(write, json.dumps([child[0], child[1] != parent[1]]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        answer = json.loads(got.read() or "null")
    os.waitpid(pid, 0)
    assert answer == ["stored", True]
    assert anyio.run(look) == parent  # the parent's connection stays its own
    store.close()
