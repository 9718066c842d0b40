"""RedisResultCache against a real redis-server: the seam's behaviours (as the memory and
disk stores have them), invalidation by path and folder, epochs across processes, and a
Redis that is down, stuck or restarted never failing a call."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import CacheWrite, MemoryResultCache, RedisResultCache, ResultCache, resources_overlap
from dispatcher import CachePolicy, Dispatcher, Registry, Tool, ToolCall

from ._redis import RedisServer, Worker, free_port
from ._system import require_program

REPO = Path(__file__).resolve().parents[1]
# timeouts with room to answer on a loaded machine, for tests that are not about timeouts
ROOMY: dict[str, Any] = {"timeout": 5.0, "connect_timeout": 5.0}


@pytest.fixture(scope="module")
def redis_program() -> str:
    return require_program("redis-server", package="redis-server")


@pytest.fixture
def server(redis_program: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (it starts in about 11 ms)."""
    server = RedisServer(redis_program, tmp_path / "redis")
    server.start()
    yield server
    server.kill()  # nothing to save; a graceful stop waits for Redis's next tick (~100 ms)


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[RedisResultCache]:
    """A store with room to answer on a loaded machine; the outage tests make their own."""
    store = RedisResultCache(server.url, namespace="t", **ROOMY)
    yield store
    await store.aclose()


@pytest.fixture
async def quick(server: RedisServer) -> AsyncIterator[RedisResultCache]:
    """A store with the default (short) timeouts."""
    store = RedisResultCache(server.url, namespace="t")
    yield store
    await store.aclose()


def raw(server: RedisServer) -> redis.Redis:
    """A plain client, to look at (or damage) what the store keeps."""
    return redis.Redis.from_url(server.url)


async def test_is_a_result_cache(store: RedisResultCache) -> None:
    """RedisResultCache satisfies the ResultCache protocol."""
    assert isinstance(store, ResultCache)


async def test_set_then_get_many_returns_the_entries(store: RedisResultCache) -> None:
    """What set_many keeps, get_many serves, with its reads and when it was stored."""
    before = time.time()
    await store.set_many([CacheWrite("a", "one", 60, frozenset({"file:/w/a"})), CacheWrite("b", "two", 60)])
    found = await store.get_many(["a", "b", "missing", "a"])
    assert sorted(found) == ["a", "b"]
    assert found["a"].content == "one" and found["a"].reads == frozenset({"file:/w/a"})
    assert before <= found["a"].stored_at <= time.time()
    stats = await store.statistics()
    assert (stats.hits, stats.misses, stats.writes, stats.entries) == (2, 1, 2, 2)


@pytest.mark.parametrize("content", ["", "é\u2028\x00", "\ud800 lone surrogate", "x" * 300_000, '{"f": 1}'])
async def test_any_text_roundtrips(store: RedisResultCache, content: str) -> None:
    """Empty, NUL, line separators, a lone surrogate, 300 kB: served back exactly."""
    await store.set("k", content, ttl=60, reads=["file:/w/\ud801"])
    entry = await store.get("k")
    assert entry is not None and entry.content == content and entry.reads == {"file:/w/\ud801"}


async def test_entries_expire_by_ttl(store: RedisResultCache) -> None:
    """An entry is served until its TTL passes, then missed; a TTL of 0 or less stores nothing."""
    await store.set("short", "v", ttl=0.3)
    await store.set("never", "v", ttl=0)
    await store.set("negative", "v", ttl=-5)
    assert await store.get("short") is not None
    assert await store.get("never") is None and await store.get("negative") is None
    await anyio.sleep(0.45)
    assert await store.get("short") is None
    assert (await store.statistics()).entries == 0


async def test_overwrite_replaces_content_and_reads(store: RedisResultCache) -> None:
    """A second write of a key replaces its content, and the new reads invalidate it."""
    await store.set("k", "old", ttl=60, reads=["file:/w/a"])
    await store.set("k", "new", ttl=60, reads=["file:/w/b"])
    entry = await store.get("k")
    assert entry is not None and entry.content == "new" and entry.reads == {"file:/w/b"}
    assert await store.invalidate(["file:/w/b"]) == 1
    assert await store.get("k") is None


@pytest.mark.parametrize(
    ("written", "dropped"),
    [
        (["file:/w/a/b.txt"], True),
        (["file:/w/a/b.txt/"], True),
        (["file:/w/a"], True),
        (["file:/w/a/"], True),
        (["file:/w"], True),
        (["file:/"], True),
        (["file:/w/a/b.txt/inner"], True),
        (["file:/w/b"], False),
        (["file:/w/a/b"], False),
        (["file:/w/a/b.txt.bak"], False),
        (["file:/w/a/b.txt0"], False),
        (["url:https://w/a/b.txt"], False),
        ([], False),
        (["file:/w/b", "file:/w/a"], True),
    ],
)
async def test_invalidation_follows_resources_overlap(
    store: RedisResultCache, written: list[str], dropped: bool
) -> None:
    """A write drops an entry exactly when resources_overlap says its reads overlap the write."""
    reads = ["file:/w/a/b.txt"]
    assert resources_overlap(reads, written) is dropped
    await store.set("k", "v", ttl=60, reads=reads)
    await store.set("unrelated", "v", ttl=60, reads=["url:https://elsewhere/x"])
    assert await store.invalidate(written) == int(dropped)
    assert (await store.get("k") is None) is dropped
    assert await store.get("unrelated") is not None


@pytest.mark.parametrize("neighbour", ["file:/w/a0", "file:/w/a.b", "file:/w/a-", "file:/w/ab/c"])
async def test_names_that_sort_beside_a_folder_are_not_in_it(store: RedisResultCache, neighbour: str) -> None:
    """Invalidating file:/w/a spares entries that read file:/w/a0, file:/w/a.b and the like."""
    await store.set("k", "v", ttl=60, reads=[neighbour])
    await store.set("inside", "v", ttl=60, reads=["file:/w/a/z"])
    await store.set("listing", "v", ttl=60, reads=["file:/w/"])
    assert await store.invalidate(["file:/w/a"]) == 2
    assert await store.get("k") is not None
    assert await store.get("inside") is None and await store.get("listing") is None


async def test_invalidate_counts_each_entry_once(store: RedisResultCache) -> None:
    """An entry matched by several written resources is dropped and counted once."""
    await store.set("two", "v", ttl=60, reads=["file:/w/a", "file:/w/b"])
    await store.set("one", "v", ttl=60, reads=["file:/w/b"])
    await store.set("none", "v", ttl=60, reads=["file:/x"])
    assert await store.invalidate(iter(["file:/w/a", "file:/w/b"])) == 2
    stats = await store.statistics()
    assert stats.invalidations == 2 and stats.entries == 1


async def test_invalidating_a_folder_drops_thousands_in_one_script(store: RedisResultCache) -> None:
    """3 000 entries below file:/w go with one invalidation of file:/w, the others stay."""
    await store.set_many(
        [CacheWrite(f"k{i}", "v", 60, frozenset({f"file:/w/d{i % 7}/f{i}"})) for i in range(3000)]
    )
    await store.set("outside", "v", ttl=60, reads=["file:/x/f"])
    assert await store.invalidate(["file:/w"]) == 3000
    assert sorted(await store.get_many(["k0", "k2999", "outside"])) == ["outside"]


# one module-wide server for the property test: hypothesis runs many examples per test
@pytest.fixture(scope="module")
def shared_server(redis_program: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_program, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()  # nothing to save; a graceful stop waits for Redis's next tick (~100 ms)


_segments = st.lists(st.sampled_from(["a", "a0", "a.b", "\u00e9", "a b"]), max_size=3)
_resources = st.builds(
    lambda parts, slash: "file:/" + "/".join(parts) + ("/" if slash and parts else ""),
    _segments,
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(st.lists(_resources, max_size=3), min_size=1, max_size=6),
    written=st.lists(_resources, max_size=3),
)
def test_index_drops_what_the_overlap_rule_drops(
    shared_server: RedisServer, entries: list[list[str]], written: list[str]
) -> None:
    """The Redis index answers invalidation exactly as MemoryResultCache's scan of every entry does."""

    async def check() -> None:
        store = RedisResultCache(shared_server.url, namespace="prop", threaded=True, **ROOMY)
        memory = MemoryResultCache()
        await store.clear()
        for i, reads in enumerate(entries):
            for s in (store, memory):
                await s.set(f"k{i}", "v", ttl=60, reads=reads)
        assert await store.invalidate(written) == await memory.invalidate(written)
        keys = [f"k{i}" for i in range(len(entries))]
        assert sorted(await store.get_many(keys)) == sorted(await memory.get_many(keys))
        await store.aclose()

    anyio.run(check)


async def test_index_sets_expire_and_dead_members_are_pruned(
    store: RedisResultCache, server: RedisServer
) -> None:
    """Members whose entries went another way (dropped through another resource they read)
    are pruned as the set is written: it holds about the live entries, not every entry
    ever written; and index sets carry the TTL of their longest-lived entry."""
    old = [CacheWrite(f"old{i}", "v", 60, frozenset({"file:/w/hot", f"file:/cold/{i}"})) for i in range(500)]
    await store.set_many(old)
    assert await store.invalidate(["file:/cold"]) == 500  # dead members of r:file:/w/hot now
    for i in range(300):
        await store.set(f"new{i}", "v", ttl=30, reads=["file:/w/hot"])
    r = raw(server)
    members = r.scard("{t}:r:file:/w/hot")
    assert 300 <= members < 400  # 800 without pruning
    assert 30_000 < r.pttl("{t}:r:file:/w/hot") <= 60_000
    await store.set("short", "v", ttl=5, reads=["file:/q/x"])
    assert 0 < r.pttl("{t}:r:file:/q/x") <= 5_000 and 0 < r.pttl("{t}:b:file:/q") <= 5_000
    r.close()


async def test_clear_empties_only_its_namespace(store: RedisResultCache, server: RedisServer) -> None:
    """clear() drops this namespace's entries and index, not another namespace's."""
    other = RedisResultCache(server.url, namespace="other", **ROOMY)
    for s in (store, other):
        await s.set_many([CacheWrite(f"k{i}", "v", 60, frozenset({f"file:/w/{i}"})) for i in range(700)])
    await store.clear()
    assert (await store.statistics()).entries == 0 and await store.get("k1") is None
    assert (await other.statistics()).entries == 700 and await other.get("k1") is not None
    r = raw(server)
    assert list(r.scan_iter(match="{t}:[erb]:*")) == []
    r.close()
    await other.aclose()


async def test_a_value_that_is_not_ours_is_a_counted_miss(
    store: RedisResultCache, server: RedisServer
) -> None:
    """Garbage, another format, or JSON of the wrong shape under a key: a miss counted in errors."""
    r = raw(server)
    r.set("{t}:e:garbage", b"\x80\x81 not json")
    r.set("{t}:e:future", b'{"f": 2, "c": "x", "r": [], "t": 1.0}')
    r.set("{t}:e:shape", b'{"f": 1, "c": 3, "r": [], "t": 1.0}')
    r.close()
    await store.set("good", "v", ttl=60)
    found = await store.get_many(["garbage", "future", "shape", "good"])
    assert list(found) == ["good"]
    stats = await store.statistics()
    assert (stats.errors, stats.misses, stats.hits) == (3, 3, 1)


async def test_stores_refuse_a_write_whose_reads_moved_since_its_epoch(store: RedisResultCache) -> None:
    """set_many(since=e) keeps a write only if nothing it read (the same resource, a folder
    above or below it) was invalidated after epoch e; the epoch moves with every invalidation."""
    await store.invalidate(["file:/elsewhere"])  # the first invalidation starts the epochs
    start = await store.epoch()
    await store.invalidate(["file:/w/a.txt"])
    assert await store.epoch() == start + 1
    assert await store.moved_since(start) == {"file:/w/a.txt"}
    writes = [
        CacheWrite("same", "x", 60, frozenset({"file:/w/a.txt"})),
        CacheWrite("folder", "x", 60, frozenset({"file:/w/"})),
        CacheWrite("below", "x", 60, frozenset({"file:/w/a.txt/part"})),
        CacheWrite("other", "x", 60, frozenset({"file:/w/b.txt"})),
        CacheWrite("none", "x", 60, frozenset()),
    ]
    await store.set_many(writes, since=start)
    assert sorted(await store.get_many([w.key for w in writes])) == ["none", "other"]
    assert (await store.statistics()).raced == 3
    await store.set_many(writes, since=start + 1)
    assert len(await store.get_many([w.key for w in writes])) == 5


async def test_set_many_checks_before_its_own_invalidations(store: RedisResultCache) -> None:
    """A batch's own write is applied after the race check: its reads were already checked
    against it, so a read of another file is kept while the written file's entry goes."""
    await store.invalidate(["file:/start"])
    await store.set("was", "old", ttl=60, reads=["file:/w/a"])
    since = await store.epoch()
    await store.set_many(
        [CacheWrite("read", "x", 60, frozenset({"file:/w/b"}))], since=since, invalidate=["file:/w/a"]
    )
    assert sorted(await store.get_many(["was", "read"])) == ["read"]
    assert await store.epoch() == since + 1


async def test_a_trimmed_log_cannot_say_what_moved(server: RedisServer) -> None:
    """With only the newest moves kept, an epoch older than the log gets None from
    moved_since and its writes are refused, rather than checked against a partial log."""
    store = RedisResultCache(server.url, namespace="t", moved_kept=4, **ROOMY)
    await store.invalidate(["file:/0"])
    old = await store.epoch()
    for i in range(1, 10):
        await store.invalidate([f"file:/{i}"])
    assert await store.moved_since(old) is None
    assert await store.moved_since(await store.epoch() - 1) == {"file:/9"}
    await store.set_many([CacheWrite("k", "v", 60, frozenset({"file:/unrelated"}))], since=old)
    assert await store.get("k") is None and (await store.statistics()).raced == 1
    await store.aclose()


async def test_a_redis_that_lost_its_data_refuses_reads_from_before(server: RedisServer) -> None:
    """Redis restarted without persistence: an epoch taken before the loss is never trusted,
    whether the epoch started again yet or not, and moved_since says it cannot tell."""
    store = RedisResultCache(server.url, namespace="t", **ROOMY)
    await store.invalidate(["file:/a"])
    before = await store.epoch()
    server.stop()
    server.start()
    await _until_usable(store)
    assert await store.moved_since(before) is None  # no epoch in Redis now
    await store.set_many([CacheWrite("k1", "v", 60, frozenset({"file:/b"}))], since=before)
    await store.invalidate(["file:/c"])  # the epoch starts again, above every old one
    assert await store.epoch() > before and await store.moved_since(before) is None
    await store.set_many([CacheWrite("k2", "v", 60, frozenset({"file:/b"}))], since=before)
    assert await store.get_many(["k1", "k2"]) == {}
    assert (await store.statistics()).raced == 2
    await store.aclose()


async def _until_usable(store: RedisResultCache, within: float = 15.0) -> float:
    """Seconds until the store answers an epoch again (its breaker lets it through)."""
    start = time.monotonic()
    with anyio.fail_after(within):
        while await store.epoch() == -1:  # noqa: ASYNC110 - polling another process's state
            await anyio.sleep(0.05)
    return time.monotonic() - start


async def test_one_object_serves_several_event_loops(server: RedisServer) -> None:
    """Made outside any loop, the store works in this loop and in fresh ones after it (a
    client per loop)."""
    store = RedisResultCache(server.url, namespace="t", **ROOMY)
    await store.set("k", "v", ttl=60)

    async def read() -> str | None:
        entry = await store.get("k")
        await store.aclose()
        return None if entry is None else entry.content

    assert await anyio.to_thread.run_sync(lambda: anyio.run(read, backend="asyncio")) == "v"
    assert await anyio.to_thread.run_sync(lambda: anyio.run(read, backend="trio")) == "v"
    assert (await store.get("k")) is not None
    await store.aclose()


def test_the_url_password_is_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    """The store's repr, url and outage warning name the host, never the password."""
    port = free_port()  # nobody listens: every connection is refused
    store = RedisResultCache(f"redis://user:hunter2@127.0.0.1:{port}/0", timeout=0.1, connect_timeout=0.1)

    async def look() -> None:
        assert await store.get_many(["k"]) == {}

    with caplog.at_level(logging.WARNING, logger="threepass.cache"):
        anyio.run(look)
    shown = repr(store) + store.url + caplog.text
    assert "hunter2" not in shown and f"127.0.0.1:{port}" in caplog.text and "***" in store.url


# --- a Redis that is down, stuck or back -------------------------------------------------


async def test_a_redis_that_is_down_costs_misses_and_one_warning(
    quick: RedisResultCache, server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stopped: 50 lookups, writes, invalidations and epochs neither raise nor wait
    long; one warning for the outage; errors counted; back within seconds of a restart."""
    await quick.set("k", "v", ttl=60)
    server.stop()
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="threepass.cache"):
        for i in range(50):
            assert await quick.get_many(["k"]) == {}
            await quick.set(f"w{i}", "v", ttl=60)
            assert await quick.epoch() == -1
            assert await quick.moved_since(0) is None
        assert time.monotonic() - start < 5
        assert not quick.healthy
        server.start()
        waited = await _until_usable(quick)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert "answers again" in caplog.text
    assert waited < 6 and quick.healthy
    assert (await quick.statistics()).errors >= 1


async def test_a_stuck_redis_times_out_quickly(quick: RedisResultCache, server: RedisServer) -> None:
    """Redis frozen (SIGSTOP): a lookup gives up after about its timeout, not the kernel's;
    then it is skipped at once until the backoff passes."""
    await quick.set("k", "v", ttl=60)
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert await quick.get_many(["k"]) == {}
        first = time.monotonic() - start
        start = time.monotonic()
        assert await quick.get_many(["k"]) == {}
        second = time.monotonic() - start
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert first < 1.5 and second < 0.05
    await _until_usable(quick)
    assert await quick.get("k") is not None


async def test_invalidations_held_back_by_an_outage_are_delivered_first(
    quick: RedisResultCache, server: RedisServer
) -> None:
    """An invalidation made while Redis was stuck is applied when it answers again, before
    any lookup is served: the stale entry is never seen."""
    await quick.set("k", "v", ttl=60, reads=["file:/w/a"])
    await quick.set("other", "v", ttl=60, reads=["file:/x"])
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        assert await quick.invalidate(["file:/w"]) == 0  # not delivered
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    with anyio.fail_after(15):
        while not (found := await quick.get_many(["k", "other"])):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert list(found) == ["other"]


class Files:
    """A reading tool and a writing tool over real files."""

    def __init__(self) -> None:
        self.runs = 0

    def registry(self) -> Registry:
        def read(args: Mapping[str, Any], ctx: Any) -> str:
            self.runs += 1
            return Path(args["path"]).read_text()

        schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
        return Registry(
            [
                Tool("read_file", "Read.", read, schema, deferred=False, concurrent=True,
                     cache=CachePolicy(scope="shared"), reads=lambda a: {"file:" + a["path"]}),
            ]
        )  # fmt: skip


async def test_calls_return_through_an_outage_and_hits_resume_after_it(
    server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a Dispatcher: Redis stopped mid-run, every call still returns its result;
    restarted, hits come back within 15 s; one warning for the whole outage."""
    page = tmp_path / "page.txt"
    page.write_text("content")
    files = Files()
    store = RedisResultCache(server.url, namespace="t", **ROOMY)
    d = Dispatcher(files.registry(), cache=store)
    call = [ToolCall("c", "read_file", {"path": str(page)})]
    with caplog.at_level(logging.WARNING):
        [first] = await d.session("s0").dispatch(call)
        [hit] = await d.session("s1").dispatch(call)
        assert first.ok and not first.cached and hit.cached
        server.stop()
        for n in range(20):
            [r] = await d.session(f"down{n}").dispatch(call)
            assert r.ok and r.content == "content" and not r.cached
        server.start()  # empty: the first call after stores, the next hits
        start = time.monotonic()
        n = 0
        with anyio.fail_after(15):
            while True:
                n += 1
                [r] = await d.session(f"up{n}").dispatch(call)
                assert r.ok and r.content == "content"
                if r.cached:
                    break
                await anyio.sleep(0.05)
    assert time.monotonic() - start < 15
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    await store.aclose()


# --- several processes sharing one Redis --------------------------------------------------


@pytest.fixture
def workers(server: RedisServer) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.close()


def _start(workers: list[Worker], server: RedisServer, n: int) -> list[Worker]:
    backends = ["trio", "asyncio", "trio"]
    workers.extend(Worker(REPO, server.url, "shared", backends[i % 3]) for i in range(n))
    return workers


@pytest.mark.slow
def test_a_hit_is_shared_across_processes(server: RedisServer, workers: list[Worker], tmp_path: Path) -> None:
    """A read in process A (trio) is served from Redis to process B (asyncio)."""
    page = tmp_path / "page.txt"
    page.write_text("v1")
    a, b = _start(workers, server, 2)
    [first] = a.dispatch([("read_file", {"path": str(page)})])
    page.write_text("changed behind the cache's back")
    [second] = b.dispatch([("read_file", {"path": str(page)})])
    assert first == {"ok": True, "content": "v1", "cached": False}
    assert second == {"ok": True, "content": "v1", "cached": True}


@pytest.mark.slow
def test_a_write_in_one_process_invalidates_another_by_path_and_by_folder(
    server: RedisServer, workers: list[Worker], tmp_path: Path
) -> None:
    """B writes a file: A's cached read of that file and A's cached listing of its folder
    both go, so A's next read and listing run again and see the write."""
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a.txt").write_text("old")
    a, b = _start(workers, server, 2)
    read = ("read_file", {"path": str(folder / "a.txt")})
    listing = ("list_dir", {"path": str(folder)})
    assert [r["cached"] for r in a.dispatch([read, listing])] == [False, False]
    assert [r["cached"] for r in a.dispatch([read, listing])] == [True, True]
    assert b.dispatch([("write_file", {"path": str(folder / "a.txt"), "text": "new"})])[0]["ok"]
    [again] = a.dispatch([read])
    assert again == {"ok": True, "content": "new", "cached": False}
    assert b.dispatch([("write_file", {"path": str(folder / "b.txt"), "text": "x"})])[0]["ok"]
    [listed] = a.dispatch([listing])
    assert listed == {"ok": True, "content": "a.txt\nb.txt", "cached": False}


@pytest.mark.slow
def test_a_read_that_raced_a_write_in_another_process_is_not_stored(
    server: RedisServer, workers: list[Worker], tmp_path: Path
) -> None:
    """A's read sees the old file and is held; B writes the file and commits; A's read
    finishes: A is given what it read, but nobody is served it from Redis afterwards."""
    page = tmp_path / "page.txt"
    page.write_text("OLD")
    hold = str(tmp_path / "hold")
    a, b, c = _start(workers, server, 3)
    a.send([("read_file", {"path": str(page), "hold": hold})])
    deadline = time.monotonic() + 20
    while not Path(hold + ".started").exists():
        assert time.monotonic() < deadline, "the read never started"
        time.sleep(0.01)
    assert b.dispatch([("write_file", {"path": str(page), "text": "NEW"})])[0]["ok"]
    Path(hold + ".go").write_text("")
    [raced] = a.receive()
    assert raced == {"ok": True, "content": "OLD", "cached": False}
    # the held read's arguments differ (the hold), so look up the same key it would have stored
    [after] = c.dispatch([("read_file", {"path": str(page), "hold": hold})])
    assert after["content"] == "NEW" and not after["cached"]
    [fresh] = a.dispatch([("read_file", {"path": str(page), "hold": hold})])
    assert fresh == {"ok": True, "content": "NEW", "cached": True}  # the fresh read was stored
