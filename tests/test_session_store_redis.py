"""RedisSessionStore against a real redis-server: a lease is busy at once, expires after a
crash, and only its holder may save or mark; save replaces the snapshot and clears the
marks; of processes racing for a lease exactly one wins; faults raise, naming Redis."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from cache import RedisSessionStore, RedisStoreError
from dispatcher import Lease, SessionBusy, SessionStore, StoredSession

from ._redis import RedisServer, free_port
from ._system import require_program

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(require_program("redis-server", package="redis-server"), tmp_path / "redis")
    server.start()
    yield server
    server.kill()  # nothing to save; a graceful stop waits for Redis's next tick (~100 ms)


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[RedisSessionStore]:
    store = RedisSessionStore(server.url, namespace="t", lease_seconds=5)
    yield store
    await store.aclose()


async def test_is_a_session_store(store: RedisSessionStore) -> None:
    """RedisSessionStore satisfies the SessionStore protocol and says its lease time."""
    assert isinstance(store, SessionStore) and store.lease_seconds == 5.0


async def test_a_held_lease_is_busy_at_once(store: RedisSessionStore) -> None:
    """A second acquire raises SessionBusy without waiting; another session is free."""
    lease = await store.acquire("s1")
    assert lease.session_id == "s1" and lease.seconds == 5.0
    start = time.monotonic()
    with pytest.raises(SessionBusy) as busy:
        await store.acquire("s1")
    assert time.monotonic() - start < 0.5 and busy.value.session_id == "s1"
    other = await store.acquire("s2")
    assert other.token != lease.token


async def test_release_frees_the_lease_and_ignores_a_stale_token(store: RedisSessionStore) -> None:
    """Released, the lease can be taken again; releasing with a stale token leaves the new
    holder's lease alone."""
    first = await store.acquire("s")
    await store.release(first)
    second = await store.acquire("s")
    await store.release(first)  # stale: nothing happens
    with pytest.raises(SessionBusy):
        await store.acquire("s")
    assert await store.renew(second)


@pytest.mark.slow
async def test_renew_keeps_a_lease_alive_past_its_time(server: RedisServer) -> None:
    """A lease renewed every 0.1 s outlives its 0.3 s; once renewal stops it expires; renew
    then says False."""
    store = RedisSessionStore(server.url, namespace="t", lease_seconds=0.3)
    lease = await store.acquire("s")
    for _ in range(6):
        await anyio.sleep(0.1)
        assert await store.renew(lease)
    with pytest.raises(SessionBusy):
        await store.acquire("s")
    await anyio.sleep(0.45)
    assert not await store.renew(lease)
    await store.acquire("s")
    await store.aclose()


async def test_a_stale_token_cannot_save_or_mark(server: RedisServer) -> None:
    """A's lease expires and B takes the session over: A's save and mark_started raise
    SessionBusy and leave B's snapshot and marks as they were."""
    store = RedisSessionStore(server.url, namespace="t", lease_seconds=0.2)
    a = await store.acquire("s")
    await anyio.sleep(0.3)
    b = await store.acquire("s")
    await store.save(b, b"B's state")
    await store.mark_started(b, ["b1"])
    with pytest.raises(SessionBusy):
        await store.save(a, b"A's late state")
    with pytest.raises(SessionBusy):
        await store.mark_started(a, ["a1"])
    with pytest.raises(SessionBusy):
        await store.mark_started(a, [])
    assert await store.load("s") == StoredSession(b"B's state", frozenset({"b1"}))
    forged = Lease("s", "not-the-token", 0.2)
    with pytest.raises(SessionBusy):
        await store.save(forged, b"forged")
    await store.aclose()


async def test_save_replaces_the_snapshot_and_clears_the_marks(store: RedisSessionStore) -> None:
    """Marks accumulate until a save; the save's snapshot replaces the last and no mark is left."""
    assert await store.load("s") == StoredSession()
    lease = await store.acquire("s")
    await store.save(lease, b"\x00first")
    await store.mark_started(lease, ["c1", "c2"])
    await store.mark_started(lease, ["c2", "c3", "\u00e9"])
    assert await store.load("s") == StoredSession(b"\x00first", frozenset({"c1", "c2", "c3", "\u00e9"}))
    await store.save(lease, b"second")
    assert await store.load("s") == StoredSession(b"second", frozenset())


async def test_thousands_of_marks_fit(store: RedisSessionStore) -> None:
    """A batch of 5 000 call ids is marked whole (past what Lua unpacks at once)."""
    lease = await store.acquire("s")
    ids = [f"call-{i}" for i in range(5000)]
    await store.mark_started(lease, ids)
    assert (await store.load("s")).started == frozenset(ids)


async def test_load_sees_state_saved_by_another_store_object(server: RedisServer) -> None:
    """What one worker's store saves, another worker's store (another object, another
    client) loads."""
    one = RedisSessionStore(server.url, namespace="t")
    two = RedisSessionStore(server.url, namespace="t")
    lease = await one.acquire("s")
    await one.save(lease, b"state")
    await one.mark_started(lease, ["w1"])
    await one.release(lease)
    assert await two.load("s") == StoredSession(b"state", frozenset({"w1"}))
    elsewhere = RedisSessionStore(server.url, namespace="elsewhere")
    assert await elsewhere.load("s") == StoredSession()
    await two.acquire("s")
    for s in (one, two, elsewhere):
        await s.aclose()


async def test_delete_forgets_snapshot_marks_and_lease(store: RedisSessionStore) -> None:
    """After delete the session loads empty and its lease is free."""
    lease = await store.acquire("s")
    await store.save(lease, b"x")
    await store.mark_started(lease, ["c"])
    await store.delete("s")
    assert await store.load("s") == StoredSession()
    await store.acquire("s")


async def test_keep_seconds_lets_old_sessions_go(server: RedisServer) -> None:
    """With keep_seconds, a session's snapshot and marks expire that long after the last save."""
    store = RedisSessionStore(server.url, namespace="t", keep_seconds=0.3)
    lease = await store.acquire("s")
    await store.save(lease, b"x")
    await store.mark_started(lease, ["c"])
    assert (await store.load("s")).snapshot == b"x"
    await anyio.sleep(0.45)
    assert await store.load("s") == StoredSession()
    await store.aclose()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import anyio
    from cache import RedisSessionStore

    async def main():
        store = RedisSessionStore(sys.argv[2], namespace="t", lease_seconds=float(sys.argv[3]))
        lease = await store.acquire("s")
        await store.save(lease, b"saved by the holder")
        await store.mark_started(lease, ["writer-1"])
        print("held", flush=True)
        while True:  # renews until killed
            await anyio.sleep(float(sys.argv[3]) / 3)
            assert await store.renew(lease)

    anyio.run(main, backend="trio")
    """
)


@pytest.mark.slow
async def test_a_crashed_holders_lease_expires(server: RedisServer) -> None:
    """A process holding (and renewing) the lease is killed -9: the lease stays busy while
    it lived, then expires within its lease time; its snapshot and marks are there to resume."""
    child = subprocess.Popen(  # noqa: ASYNC220 - its PID is what the test kills
        [sys.executable, "-c", _HOLDER, str(REPO), server.url, "0.6"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        with anyio.fail_after(20):
            said = await anyio.to_thread.run_sync(child.stdout.readline, abandon_on_cancel=True)
        assert said == "held\n"
        store = RedisSessionStore(server.url, namespace="t", lease_seconds=0.6)
        await anyio.sleep(0.8)  # past one lease time: the holder renews it
        with pytest.raises(SessionBusy):
            await store.acquire("s")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=5)
        killed_at = time.monotonic()
        with anyio.fail_after(5):
            while True:
                try:
                    lease = await store.acquire("s")
                    break
                except SessionBusy:
                    await anyio.sleep(0.02)
        assert time.monotonic() - killed_at < 0.6 + 0.3
        assert await store.load("s") == StoredSession(b"saved by the holder", frozenset({"writer-1"}))
        await store.save(lease, b"resumed")
        await store.aclose()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=5)
        if child.stdout is not None:
            child.stdout.close()


_RACER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    import anyio
    from cache import RedisSessionStore
    from dispatcher import SessionBusy

    async def main():
        store = RedisSessionStore(sys.argv[2], namespace="t")
        await store.load("warm-up")  # connected before the start
        print("ready", flush=True)
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.001)
        try:
            await store.acquire("contested")
        except SessionBusy:
            print("busy")
        else:
            print("won")

    anyio.run(main, backend=sys.argv[4])
    """
)


@pytest.mark.slow
def test_processes_racing_for_a_lease_exactly_one_wins(server: RedisServer, tmp_path: Path) -> None:
    """Four processes (trio and asyncio) released at one instant acquire one session: one wins,
    three are busy."""
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(REPO), server.url, str(go), backend],
            stdout=subprocess.PIPE,
            text=True,
        )
        for backend in ("trio", "asyncio", "trio", "asyncio")
    ]
    for racer in racers:  # each started and connected
        assert racer.stdout is not None
        ready, _, _ = select.select([racer.stdout], [], [], 20)
        assert ready and racer.stdout.readline() == "ready\n"
    go.write_text("")
    outcomes = sorted(racer.communicate(timeout=20)[0].strip() for racer in racers)
    assert outcomes == ["busy", "busy", "busy", "won"]


async def test_a_redis_that_is_down_raises_naming_it_without_the_password() -> None:
    """No Redis at the URL: every operation raises RedisStoreError naming the host and port,
    never the password; nothing is swallowed."""
    port = free_port()
    store = RedisSessionStore(f"redis://me:s3cret@127.0.0.1:{port}/0", connect_timeout=0.2, timeout=0.2)
    lease = Lease("s", "t", 1.0)
    for operation in (
        store.acquire("s"),
        store.renew(lease),
        store.release(lease),
        store.load("s"),
        store.save(lease, b"x"),
        store.mark_started(lease, ["c"]),
        store.delete("s"),
    ):
        with pytest.raises(RedisStoreError) as failed:
            await operation
        message = str(failed.value)
        assert f"127.0.0.1:{port}" in message and "s3cret" not in message and "Redis" in message
    assert "s3cret" not in repr(store) and "s3cret" not in store.url
    await store.aclose()


async def test_a_password_protected_redis_is_used_with_its_password(tmp_path: Path) -> None:
    """With the right password in the URL both stores work; with a wrong one the session
    store raises and the cache misses, and neither shows the password."""
    from cache import RedisResultCache

    server = RedisServer(
        require_program("redis-server", package="redis-server"), tmp_path / "redis", password="pa55"
    )
    server.start()
    try:
        store = RedisSessionStore(server.url, namespace="t")
        lease = await store.acquire("s")
        await store.save(lease, b"x")
        assert (await store.load("s")).snapshot == b"x"
        cache = RedisResultCache(server.url, namespace="t", timeout=5.0, connect_timeout=5.0)
        await cache.set("k", "v", ttl=60)
        assert await cache.get("k") is not None
        wrong_url = server.url.replace("pa55", "wrong")
        wrong = RedisSessionStore(wrong_url, namespace="t")
        with pytest.raises(RedisStoreError) as refused:
            await wrong.load("s")
        assert "wrong" not in str(refused.value) and "***" in str(refused.value)
        wrong_cache = RedisResultCache(wrong_url, namespace="t")
        assert await wrong_cache.get_many(["k"]) == {} and (await wrong_cache.statistics()).errors >= 1
        for s in (store, cache, wrong, wrong_cache):
            await s.aclose()
    finally:
        server.kill()


async def test_a_stuck_redis_raises_within_the_timeout(server: RedisServer) -> None:
    """Redis frozen (SIGSTOP): load raises RedisStoreError after about the timeout, not never."""
    store = RedisSessionStore(server.url, namespace="t", timeout=0.3, connect_timeout=0.3)
    await store.load("s")
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RedisStoreError):
            await store.load("s")
        assert time.monotonic() - start < 2
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    await store.aclose()


def test_options_are_checked() -> None:
    """A lease time or keep time that is not positive is refused when the store is made."""
    with pytest.raises(ValueError, match="lease_seconds"):
        RedisSessionStore(lease_seconds=0)
    with pytest.raises(ValueError, match="keep_seconds"):
        RedisSessionStore(keep_seconds=-1)
