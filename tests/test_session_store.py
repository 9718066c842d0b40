"""The `SessionStore` contract, checked on every store the project ships (`STORES`: add a
factory to run it on another), and the snapshot that the kernel keeps in them.

A factory takes a temporary folder, a lease time and the test's `AsyncExitStack` (closed
after the test, in its event loop: what the store needs undone goes there) and returns
`open_store`: each call opens another handle onto the same store, as a second worker would.
The Redis factory starts a redis-server of its own for each test (about 20 ms; killing it
takes 1 ms), so no test sees another's keys."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from cache import MemorySessionStore, RedisSessionStore, SqliteSessionStore
from dispatcher import Lease, SessionBusy, SessionStore, Status, StoredSession, ToolResult
from dispatcher._history import History
from dispatcher._plan import DedupeEntry, FinishedCall
from dispatcher._snapshot import (
    SNAPSHOT_FORMAT,
    ChainPosition,
    SessionSnapshot,
    decode_newer,
    decode_snapshot,
    encode_snapshot,
    fill_history,
    history_state,
    json_values,
)

from ._redis import RedisServer
from ._system import require_program

OpenStore = Callable[[], SessionStore]
Factory = Callable[[Path, float, contextlib.AsyncExitStack], OpenStore]


def memory(tmp_path: Path, lease_seconds: float, cleanup: contextlib.AsyncExitStack) -> OpenStore:
    store = MemorySessionStore(lease_seconds)
    return lambda: store


def sqlite(tmp_path: Path, lease_seconds: float, cleanup: contextlib.AsyncExitStack) -> OpenStore:
    path = tmp_path / "sessions.sqlite"

    def open_store() -> SessionStore:
        store = SqliteSessionStore(path, lease_seconds=lease_seconds)
        cleanup.callback(store.close)
        return store

    return open_store


def redis(tmp_path: Path, lease_seconds: float, cleanup: contextlib.AsyncExitStack) -> OpenStore:
    server = RedisServer(require_program("redis-server", package="redis-server"), tmp_path / "redis")
    server.start()
    cleanup.callback(server.kill)  # nothing to keep; a graceful stop waits ~100 ms

    def open_store() -> SessionStore:  # each handle its own client, as on another machine
        store = RedisSessionStore(server.url, namespace="contract", lease_seconds=lease_seconds)
        cleanup.push_async_callback(store.aclose)
        return store

    return open_store


STORES: list[Factory] = [memory, sqlite, redis]


@contextlib.asynccontextmanager
async def _handles(
    request: pytest.FixtureRequest, tmp_path: Path, lease_seconds: float
) -> AsyncIterator[OpenStore]:
    factory: Factory = request.param
    async with contextlib.AsyncExitStack() as cleanup:
        yield factory(tmp_path, lease_seconds, cleanup)


@pytest.fixture(params=STORES, ids=lambda f: f.__name__)
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenStore]:
    """Handles onto one store with a 30-second lease."""
    async with _handles(request, tmp_path, 30.0) as handles:
        yield handles


_SHORT = 0.4  # seconds a short store's lease lives


@pytest.fixture(params=STORES, ids=lambda f: f.__name__)
async def short_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenStore]:
    """Handles onto one store whose leases live `_SHORT` seconds: time enough for the few
    calls a test makes of a lease it just took, on a loaded machine too."""
    async with _handles(request, tmp_path, _SHORT) as handles:
        yield handles


async def test_a_store_is_a_session_store(open_store: OpenStore) -> None:
    """Every shipped store satisfies the seam's protocol and says its lease time."""
    store = open_store()
    assert isinstance(store, SessionStore) and store.lease_seconds == 30.0


async def test_a_held_lease_makes_the_next_acquire_busy_at_once(open_store: OpenStore) -> None:
    """While one worker holds a session's lease, another's acquire raises SessionBusy naming
    the session, without waiting; other sessions are free."""
    a, b = open_store(), open_store()
    lease = await a.acquire("s1")
    assert lease.session_id == "s1" and lease.seconds == 30.0
    with anyio.fail_after(1):
        with pytest.raises(SessionBusy) as caught:
            await b.acquire("s1")
    assert caught.value.session_id == "s1" and "'s1'" in str(caught.value)
    other = await b.acquire("s2")
    assert other.token != lease.token


async def test_a_released_lease_can_be_taken_again(open_store: OpenStore) -> None:
    """After release another worker acquires at once, with a new token."""
    a, b = open_store(), open_store()
    first = await a.acquire("s1")
    await a.release(first)
    second = await b.acquire("s1")
    assert second.token != first.token


async def test_an_expired_lease_is_taken_over_and_refused_everything(short_store: OpenStore) -> None:
    """A lease not renewed for its lifetime expires: another worker takes it, and the old
    holder's renew says False, its save and mark raise SessionBusy, its release frees nothing."""
    a, b = short_store(), short_store()
    old = await a.acquire("s1")
    await anyio.sleep(_SHORT + 0.1)  # expired
    new = await b.acquire("s1")
    assert await a.renew(old) is False
    with pytest.raises(SessionBusy):
        await a.save(old, b"stale")
    with pytest.raises(SessionBusy):
        await a.mark_started(old, ["c1"])
    await a.release(old)
    with pytest.raises(SessionBusy):
        await a.acquire("s1")
    await b.save(new, b"fresh")
    assert await b.load("s1") == StoredSession(b"fresh", frozenset())


async def test_an_expired_lease_nobody_took_is_still_refused(short_store: OpenStore) -> None:
    """Expiry alone ends a hold: a save after it is refused even if no one acquired since."""
    store = short_store()
    lease = await store.acquire("s1")
    await anyio.sleep(_SHORT + 0.1)  # expired
    assert await store.renew(lease) is False
    with pytest.raises(SessionBusy):
        await store.save(lease, b"late")
    assert (await store.load("s1")).snapshot is None


async def test_renewal_keeps_a_lease_past_its_first_lifetime(short_store: OpenStore) -> None:
    """A lease renewed before it expires is still held after its first lifetime is over."""
    a, b = short_store(), short_store()
    lease = await a.acquire("s1")
    for _ in range(5):  # 0.5 s in all, past the first lifetime
        await anyio.sleep(0.1)
        assert await a.renew(lease) is True
    with pytest.raises(SessionBusy):
        await b.acquire("s1")
    await a.save(lease, b"kept")


async def test_a_forged_token_is_refused(open_store: OpenStore) -> None:
    """A lease with the right session and a wrong token cannot save, mark, renew or release."""
    store = open_store()
    real = await store.acquire("s1")
    forged = Lease("s1", "not-the-token", real.seconds)
    with pytest.raises(SessionBusy):
        await store.save(forged, b"forged")
    with pytest.raises(SessionBusy):
        await store.mark_started(forged, ["c1"])
    assert await store.renew(forged) is False
    await store.release(forged)
    with pytest.raises(SessionBusy):
        await open_store().acquire("s1")
    assert await store.load("s1") == StoredSession()


async def test_marks_are_kept_until_a_save_clears_them(open_store: OpenStore) -> None:
    """Started marks accumulate (repeats once) and are seen by every handle; a save replaces
    the snapshot and clears them in one step."""
    a, b = open_store(), open_store()
    lease = await a.acquire("s1")
    await a.mark_started(lease, ["w1"])
    await a.mark_started(lease, ["w2", "w1"])
    assert await b.load("s1") == StoredSession(None, frozenset({"w1", "w2"}))
    await a.save(lease, b"after")
    assert await b.load("s1") == StoredSession(b"after", frozenset())
    await a.save(lease, b"again")
    assert (await b.load("s1")).snapshot == b"again"


async def test_a_session_never_seen_loads_empty(open_store: OpenStore) -> None:
    """Loading an unknown session gives an empty StoredSession, and takes no lease."""
    store = open_store()
    assert await store.load("nobody") == StoredSession()
    await store.release(Lease("nobody", "x", 1.0))
    lease = await store.acquire("nobody")
    assert lease.session_id == "nobody"


async def test_delete_forgets_snapshot_marks_and_lease(open_store: OpenStore) -> None:
    """After delete the session loads empty and its lease is free."""
    a, b = open_store(), open_store()
    lease = await a.acquire("s1")
    await a.mark_started(lease, ["w1"])
    await a.save(lease, b"x")
    await a.mark_started(lease, ["w2"])
    await b.delete("s1")
    assert await b.load("s1") == StoredSession()
    await b.acquire("s1")


async def test_marking_no_calls_still_needs_the_lease(short_store: OpenStore) -> None:
    """mark_started with no call ids passes under a held lease and raises SessionBusy under
    an expired or forged one: the promise is the holder's, whatever it marks."""
    store = short_store()
    lease = await store.acquire("s1")
    await store.mark_started(lease, [])
    with pytest.raises(SessionBusy):
        await store.mark_started(Lease("s1", "not-the-token", lease.seconds), [])
    await anyio.sleep(_SHORT + 0.1)  # expired
    with pytest.raises(SessionBusy):
        await store.mark_started(lease, [])
    assert await store.load("s1") == StoredSession()


async def test_delete_ends_a_hold(open_store: OpenStore) -> None:
    """A session deleted while a worker holds its lease: that worker's renew says False and
    its save raises SessionBusy, so nothing of the session comes back."""
    a, b = open_store(), open_store()
    lease = await a.acquire("s1")
    await b.delete("s1")
    assert await a.renew(lease) is False
    with pytest.raises(SessionBusy):
        await a.save(lease, b"after delete")
    assert await b.load("s1") == StoredSession()


async def test_one_acquire_wins_when_many_race(open_store: OpenStore) -> None:
    """Ten handles acquiring one session at once: exactly one gets the lease."""
    won: list[Lease] = []
    busy: list[SessionBusy] = []

    async def take() -> None:
        try:
            won.append(await open_store().acquire("s1"))
        except SessionBusy as exc:
            busy.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(take)
    assert len(won) == 1 and len(busy) == 9


async def test_a_lease_time_that_is_not_positive_is_refused(tmp_path: Path) -> None:
    """lease_seconds must be positive for every store."""
    with pytest.raises(ValueError, match="lease_seconds"):
        MemorySessionStore(0)
    with pytest.raises(ValueError, match="lease_seconds"):
        SqliteSessionStore(tmp_path / "s.sqlite", lease_seconds=-1)
    with pytest.raises(ValueError, match="lease_seconds"):
        RedisSessionStore(lease_seconds=0)


async def test_the_sqlite_store_raises_its_faults(tmp_path: Path) -> None:
    """A file that is not a database, and a store closed under a worker, raise: a session
    store's fault is never swallowed."""
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        SqliteSessionStore(junk)
    store = SqliteSessionStore(tmp_path / "s.sqlite")
    lease = await store.acquire("s1")
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        await store.save(lease, b"x")


def test_the_sqlite_file_is_private(tmp_path: Path) -> None:
    """The store's file is readable by its owner only."""
    path = tmp_path / "s.sqlite"
    SqliteSessionStore(path).close()
    assert path.stat().st_mode & 0o777 == 0o600


# -- the snapshot --------------------------------------------------------------------------


def _result(call_id: str, content: str = "ok", **kw: Any) -> ToolResult:
    return ToolResult(call_id, "read", Status.ok, content, started=1.5, duration=0.25, **kw)


def _snapshot(**kw: Any) -> SessionSnapshot:
    fields: dict[str, Any] = {
        "version": 3,
        "session_id": "s1",
        "run_id": 2,
        "round": 4,
        "rounds": 9,
        "executed": 7,
        "mode": "direct",
        "core": ("read",),
        "loaded": frozenset({"write"}),
        "dedupe": (("k1", DedupeEntry(_result("c1"), frozenset({"file:/a"}))),),
        "spent_approvals": frozenset({"c2"}),
        "finished": (("c3", FinishedCall("k3", _result("c3", "done", deduped=True))),),
        "state": {"todo": [{"content": "x", "status": "pending"}], "n": 1},
        "chain": ChainPosition(5, "abcd", 2),
    }
    fields.update(kw)
    return SessionSnapshot(**fields)


def test_a_snapshot_reads_back_as_it_was() -> None:
    """Every field survives encode and decode, results included, in a numbered format."""
    history = History(10)
    history._rows.append((2, 4, 0, "c1", "read", '{"path":"/a"}', _result("c1")))
    snap = _snapshot(history=history_state(history))
    data = encode_snapshot(snap)
    assert f'"format":{SNAPSHOT_FORMAT}'.encode() in data
    assert decode_snapshot(data) == snap


def test_junk_is_not_a_snapshot() -> None:
    """Bytes that are not JSON, another format, or a document of the wrong shape raise ValueError."""
    good = encode_snapshot(_snapshot())
    for bad in (b"\x00\xff", b"[1, 2]", good.replace(b'"format":1', b'"format":99'), b'{"format":1}',
                good.replace(b'"dedupe":[[', b'"dedupe":[["x"],[')):  # fmt: skip
        with pytest.raises(ValueError):
            decode_snapshot(bad)


def test_only_json_state_is_kept() -> None:
    """State values that JSON does not hold exactly (a function, a tuple, NaN, a set) are left
    out by key; the others are kept."""
    kept, skipped = json_values(
        {"ok": {"a": [1, "b", None]}, "fn": print, "pair": (1, 2), "nan": float("nan"), "set": {1}}
    )
    assert kept == {"ok": {"a": [1, "b", None]}}
    assert skipped == ("'fn'", "'pair'", "'nan'", "'set'")


def test_a_restored_history_keeps_its_bound_and_counts() -> None:
    """A history of 5 rows restored into a session bounded at 3 keeps the newest 3 and every count."""
    source = History(None)
    for i in range(5):
        source._rows.append((1, 1, i, f"c{i}", "read", "{}", _result(f"c{i}")))
    source.calls, source.by_status = 5, {"ok": 5}
    target = History(3)
    fill_history(target, decode_snapshot(encode_snapshot(_snapshot(history=history_state(source)))).history)
    assert [e.call.id for e in target] == ["c2", "c3", "c4"]
    assert target.calls == 5 and target.by_status == {"ok": 5}


def test_unkept_state_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """(Through a session) a value that is not JSON is named in one log line, not at every save."""
    from dispatcher import Dispatcher, Registry

    s = Dispatcher(Registry(), session_store=MemorySessionStore()).session("s1")
    s.state["fn"] = print
    with caplog.at_level(logging.INFO, logger="threepass.session"):
        s._snapshot(1)
        s._snapshot(2)
    assert [r.getMessage() for r in caplog.records].count(
        "session s1 keeps these state values on this worker only (not JSON): 'fn'"
    ) == 1


async def test_the_encoded_rows_a_session_keeps_between_saves_match_a_fresh_encoding() -> None:
    """Saves that encode only the rows a batch added (the oldest falling off a bounded
    history) give the same snapshot as encoding the whole history anew."""
    from dispatcher import Dispatcher, Registry, Tool, ToolCall

    reg = Registry([Tool("echo", "Echo.", lambda a, c: a["t"], {"type": "object"}, deferred=False)])
    s = Dispatcher(reg, session_store=MemorySessionStore()).session("s1", history_limit=3)
    for n in range(5):
        await s.dispatch([ToolCall(f"c{n}a", "echo", {"t": f"{n}"}), ToolCall(f"c{n}b", "echo", {"t": "x"})])
        cached = decode_snapshot(encode_snapshot(s._snapshot(9)))
        whole = attrs.evolve(s._snapshot(9), history=history_state(s.history))
        fresh = decode_snapshot(encode_snapshot(whole))
        assert cached == fresh and len(cached.history.rows) == min(3, 2 * (n + 1))
    assert [row[3] for row in cached.history.rows] == ["c3b", "c4a", "c4b"]


async def test_a_snapshot_holds_no_credential_and_restores_its_redacted_forms() -> None:
    """History arguments, and every result that echoes them (history, dedupe map), are kept
    redacted as a recording keeps them, whether the rows are encoded at once or between saves."""
    from dispatcher import Dispatcher, Registry, Tool, ToolCall
    from dispatcher._credentials import redact

    secret = "sk-live-snapshot-0123456789"
    reg = Registry([Tool("echo", "Echo.", lambda a, c: f"sent {a}", {"type": "object"}, deferred=False)])
    s = Dispatcher(reg, session_store=MemorySessionStore()).session("s1")
    auth = {"headers": {"Authorization": f"Bearer {secret}"}}
    [result] = await s.dispatch([ToolCall("c1", "echo", auth)])
    assert secret in result.content  # the caller sees it: only what is kept must not
    cached = encode_snapshot(s._snapshot(9))
    whole = encode_snapshot(attrs.evolve(s._snapshot(9), history=history_state(s.history)))
    for data in (cached, whole):
        assert secret.encode() not in data
        restored = decode_snapshot(data)
        [row] = restored.history.rows
        assert isinstance(row, tuple) and redact(f"Bearer {secret}") in str(row[5])
        assert secret not in row[6].content and redact(f"Bearer {secret}") in row[6].content
        assert [secret not in entry.result.content for _, entry in restored.dedupe] == [True]


def test_a_worker_up_to_date_reads_only_the_head_of_a_snapshot() -> None:
    """decode_newer gives None for a version not above the one held, whatever follows the
    head; a newer one is decoded whole (and junk after its head raises)."""
    data = encode_snapshot(_snapshot(version=4))
    assert decode_newer(data, 4) is None and decode_newer(data[:40] + b"junk", 4) is None
    assert decode_newer(data, 3) == _snapshot(version=4)
    with pytest.raises(ValueError):
        decode_newer(data[:40] + b"junk", 3)
