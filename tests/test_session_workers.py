"""Sessions that outlive their worker: several Dispatchers sharing one session store stand
for the workers of a deployment (in one process over the memory store, and as real
processes over one SQLite file or one Redis), and a conversation moves between them
mid-batch."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from cache import MemorySessionStore, RedisSessionStore, SqliteSessionStore
from dispatcher import (
    Allow,
    Answer,
    Dispatcher,
    DispatchInterrupted,
    Lease,
    SessionBusy,
    Status,
    StoredSession,
    ToolCall,
    ToolResult,
    replay,
)
from dispatcher._recording import line_hash, read_recording

from ._redis import RedisServer
from ._session_worker import NAMESPACE, SESSION, gate, registry
from ._system import require_program

REPO = Path(__file__).resolve().parent.parent


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _workers(ws: Path, store: Any, n: int = 2, **kw: Any) -> list[Dispatcher]:
    return [Dispatcher(registry(ws), session_store=store, gate=gate, **kw) for _ in range(n)]


def _write(call_id: str, path: str = "out.txt", tool: str = "write", **args: Any) -> ToolCall:
    return ToolCall(call_id, tool, {"path": path, "text": "x", **args})


def _read(call_id: str, path: str = "out.txt") -> ToolCall:
    return ToolCall(call_id, "read", {"path": path})


class _Clock:
    """A monotonic clock a test moves by hand (leases expire when it says)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- two workers in one process ------------------------------------------------------------


async def test_a_gate_interrupt_on_one_worker_is_approved_on_another_and_runs_once(tmp_path: Path) -> None:
    """The gate interrupts on A; B, given the approval, runs the writer once; the spent
    approval, dispatched again on A, runs nothing more."""
    a, b = _workers(tmp_path, MemorySessionStore())
    batch = [_write("w1", tool="gated_write")]
    with pytest.raises(DispatchInterrupted) as caught:
        await a.session(SESSION).dispatch(batch)
    assert [c.id for c, _, _ in caught.value.pending] == ["w1"] and _lines(tmp_path / "out.txt") == []
    results = await b.session(SESSION).dispatch(batch, decisions={"w1": Allow()})
    assert results[0].status is Status.ok and _lines(tmp_path / "out.txt") == ["x by w1"]
    with pytest.raises(DispatchInterrupted):  # spent on B: A's gate is asked again
        await a.session(SESSION).dispatch(batch, decisions={"w1": Allow()})
    assert _lines(tmp_path / "out.txt") == ["x by w1"]


@pytest.mark.parametrize("raw", ['{"path": "\ud800"}', '{"path": "\\ud800"}'])
async def test_arguments_with_a_lone_surrogate_are_kept_and_restored(tmp_path: Path, raw: str) -> None:
    """Arguments text holding a lone surrogate (as a character, or escaped) is refused, and
    the session's state, its history row included, is saved and read back on another worker."""
    a, b = _workers(tmp_path, MemorySessionStore())
    item = {"id": "odd", "type": "function", "function": {"name": "read", "arguments": raw}}
    [refused] = await a.session(SESSION).dispatch([item])
    assert refused.status is Status.invalid_arguments and "lone surrogate" in refused.content
    [ran] = await b.session(SESSION).dispatch([_read("r1")])
    assert ran.status is Status.ok
    assert [(e.call.id, e.call.arguments, e.result) for e in b.session(SESSION).history][:1] == [
        ("odd", {"path": "\ud800"}, refused)
    ]


async def test_calls_that_finished_before_a_tool_interrupt_are_served_on_the_other_worker(
    tmp_path: Path,
) -> None:
    """[write, ask, read]: ask interrupts on A after write finished; on B the answer resumes
    the batch: write is served (not rerun), ask answered, read runs."""
    a, b = _workers(tmp_path, MemorySessionStore())
    batch = [_write("w1"), ToolCall("q", "ask", {"path": "-"}), _read("r1")]
    with pytest.raises(DispatchInterrupted):
        await a.session(SESSION).dispatch(batch)
    assert _lines(tmp_path / "out.txt") == ["x by w1"] and _lines(tmp_path / "reads.log") == []
    results = await b.session(SESSION).dispatch(batch, decisions={"q": Answer("yes")})
    assert [(r.call_id, r.status, r.content) for r in results] == [
        ("w1", Status.ok, "wrote out.txt"),
        ("q", Status.ok, "yes"),
        ("r1", Status.ok, "x by w1\n"),
    ]
    assert results[0].deduped and _lines(tmp_path / "out.txt") == ["x by w1"]
    assert _lines(tmp_path / "reads.log") == ["r1"]


async def test_dedupe_spans_the_workers_turns_of_one_run(tmp_path: Path) -> None:
    """A read on A is served on B in the same run; after B's new run it runs again."""
    a, b = _workers(tmp_path, MemorySessionStore())
    await a.session(SESSION).dispatch([_read("r1")])
    again = await b.session(SESSION).dispatch([_read("r2")])
    assert again[0].deduped and _lines(tmp_path / "reads.log") == ["r1"]
    sb = b.session(SESSION)
    sb.new_run()
    fresh = await sb.dispatch([_read("r3")])
    assert not fresh[0].deduped and _lines(tmp_path / "reads.log") == ["r1", "r3"]
    assert sb.run_id == 2


async def test_a_new_run_asked_on_a_stale_worker_starts_after_the_stored_state(tmp_path: Path) -> None:
    """A worker holding old state that starts a new run gets the stored run's successor:
    the other worker's turns are not lost, and dedupe starts empty."""
    a, b = _workers(tmp_path, MemorySessionStore())
    sa, sb = a.session(SESSION), b.session(SESSION)
    await sa.dispatch([_read("r1")])
    sa.new_run()
    await sa.dispatch([_read("r2")])
    assert sa.run_id == 2
    sb.new_run()  # B still holds run 1 of nothing
    results = await sb.dispatch([_read("r3")])
    assert sb.run_id == 3 and not results[0].deduped
    assert [e.call.id for e in sb.history] == ["r1", "r2", "r3"]


async def test_the_state_a_batch_lands_moves_with_the_session(tmp_path: Path) -> None:
    """Loaded schemas, history, counters and JSON state saved by A are what B's session holds."""
    a, b = _workers(tmp_path, MemorySessionStore())
    sa = a.session(SESSION, mode="direct")
    sa.state["todo"] = ["a", "b"]
    sa.state["callback"] = print  # not JSON: stays on A
    await sa.dispatch([_read("r1"), _write("w1")])
    sb = b.session(SESSION)
    sb.state["local"] = len  # B's own, kept through the load
    await sb.dispatch([_read("r2", "other.txt")])
    assert sb.mode == "direct" and sb.state["todo"] == ["a", "b"] and "callback" not in sb.state
    assert sb.state["local"] is len
    assert [e.call.id for e in sb.history] == ["r1", "w1", "r2"]
    assert sb.statistics().rounds == 2 and sb.statistics().executed == 3


async def test_a_second_worker_is_busy_at_once_while_the_first_runs(tmp_path: Path) -> None:
    """While A's batch runs, B's dispatch of the session raises SessionBusy without waiting,
    and runs nothing; once A is done, B goes ahead."""
    a, b = _workers(tmp_path, MemorySessionStore())
    release = anyio.Event()
    started = anyio.Event()

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        started.set()
        await release.wait()
        return "slow done"

    from dispatcher import Tool

    a.registry.add(Tool("slow", "Wait.", slow, {"type": "object"}, deferred=False))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.session(SESSION).dispatch, [ToolCall("s", "slow", {})])
            await started.wait()
            began = time.monotonic()
            with pytest.raises(SessionBusy):
                await b.session(SESSION).dispatch([_write("w1")])
            assert time.monotonic() - began < 0.5
            release.set()
    assert _lines(tmp_path / "out.txt") == []
    await b.session(SESSION).dispatch([_write("w1")])
    assert _lines(tmp_path / "out.txt") == ["x by w1"]


async def test_a_lost_lease_stops_the_batch_and_saves_nothing(tmp_path: Path) -> None:
    """A's lease expires while its call runs and B takes the session over: A's batch stops
    with SessionBusy, the writer after it never starts, and B's state is not overwritten."""
    clock = _Clock()
    store = MemorySessionStore(0.3, clock=clock)
    a, b = _workers(tmp_path, store)
    started = anyio.Event()

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        started.set()
        await anyio.sleep_forever()
        return "never"

    from dispatcher import Tool

    a.registry.add(Tool("slow", "Wait.", slow, {"type": "object"}, deferred=False))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def drive_a() -> None:
                with pytest.raises(SessionBusy, match="lost"):
                    await a.session(SESSION).dispatch([ToolCall("s", "slow", {}), _write("w1")])

            tg.start_soon(drive_a)
            await started.wait()
            clock.now += 1.0  # A's lease is past its time before its next renewal
            await b.session(SESSION).dispatch([_read("r1")])
    assert _lines(tmp_path / "out.txt") == []
    stored = await store.load(SESSION)
    assert stored.snapshot is not None and b'"r1"' in stored.snapshot and b'"s"' not in stored.snapshot


async def test_a_store_that_cannot_save_fails_the_batch(tmp_path: Path) -> None:
    """A store whose save raises makes the dispatch raise it: a batch whose state was not
    kept does not pretend it was (its tools did run)."""

    class Broken(MemorySessionStore):
        async def save(self, lease: Lease, snapshot: bytes) -> None:
            raise OSError("disk full")

    (d,) = _workers(tmp_path, Broken(), n=1)
    with pytest.raises(OSError, match="disk full"):
        await d.session(SESSION).dispatch([_write("w1")])
    assert _lines(tmp_path / "out.txt") == ["x by w1"]


async def test_a_store_that_cannot_mark_a_writer_keeps_it_from_starting(tmp_path: Path) -> None:
    """mark_started failing: the writer does not start, the batch stops and the fault is raised."""

    class Unmarkable(MemorySessionStore):
        async def mark_started(self, lease: Lease, call_ids: Any) -> None:
            raise OSError("store down")

    (d,) = _workers(tmp_path, Unmarkable(), n=1)
    with pytest.raises(OSError, match="store down"):
        await d.session(SESSION).dispatch([_read("r1"), _write("w1")])
    assert _lines(tmp_path / "out.txt") == [] and _lines(tmp_path / "reads.log") == ["r1"]


async def test_a_tool_that_invokes_another_runs_inside_its_batch_lease(tmp_path: Path) -> None:
    """A handler's ctx.invoke in a kept session is part of the running batch: it takes no
    second lease (no SessionBusy against itself), and its call is in the saved history."""
    from dispatcher import Tool

    store = MemorySessionStore()
    (a,) = _workers(tmp_path, store, n=1)

    async def both(args: Mapping[str, Any], ctx: Any) -> str:
        inner = await ctx.invoke("read", {"path": "out.txt"})
        return f"inner {inner.status.value}"

    a.registry.add(Tool("both", "Read through invoke.", both, {"type": "object"}, deferred=False))
    with anyio.fail_after(5):
        results = await a.session(SESSION).dispatch([ToolCall("b", "both", {})])
    assert results[0].content == "inner ok" and _lines(tmp_path / "reads.log") != []
    (b,) = _workers(tmp_path, store, n=1)
    sb = b.session(SESSION)
    assert await sb.refresh() and [e.call.name for e in sb.history] == ["read", "both"]


async def test_a_stored_snapshot_that_is_junk_raises_and_frees_the_lease(tmp_path: Path) -> None:
    """Junk where the snapshot should be: the dispatch raises ValueError, runs nothing, and
    gives the lease back (the next worker is not locked out by it)."""
    store = MemorySessionStore()
    lease = await store.acquire(SESSION)
    await store.save(lease, b'{"format": 1, "version": 7, "history": "no"}')
    await store.release(lease)
    (d,) = _workers(tmp_path, store, n=1)
    with pytest.raises(ValueError, match="snapshot"):
        await d.session(SESSION).dispatch([_write("w1")])
    assert _lines(tmp_path / "out.txt") == []
    await store.release(await store.acquire(SESSION))


async def test_writers_left_started_come_back_uncertain_and_readers_run(tmp_path: Path) -> None:
    """Marks no snapshot covers (a worker died): those writers come back failed, effect
    uncertain, not retryable, with the failure contract's first line; a reader runs; the
    next save clears the marks, and a resume of the same batch serves the same answer."""
    store = MemorySessionStore()
    dead = await store.acquire(SESSION)
    await store.mark_started(dead, ["w1"])
    await store.release(dead)  # as if its lease had expired
    (d,) = _workers(tmp_path, store, n=1)
    batch = [_write("w1"), _read("r1"), ToolCall("q", "ask", {"path": "-"})]
    with pytest.raises(DispatchInterrupted):
        await d.session(SESSION).dispatch(batch)
    assert await store.load(SESSION) == StoredSession((await store.load(SESSION)).snapshot, frozenset())
    results = await d.session(SESSION).dispatch(batch, decisions={"q": Answer("ok")})
    w1 = results[0]
    assert w1.status is Status.failed and w1.effect_uncertain and not w1.retryable
    assert w1.error() == {
        "error": "the worker running this call stopped; its effect is unknown",
        "status": "failed",
        "retryable": False,
        "effect_uncertain": True,
    }
    assert _lines(tmp_path / "out.txt") == [] and _lines(tmp_path / "reads.log") == ["r1"]


async def test_a_cancelled_batch_saves_what_landed_and_frees_the_lease(tmp_path: Path) -> None:
    """The caller cancels A's batch after its writer finished: the writer's result is saved
    and the lease given up, so B takes the session at once and serves it, not rerunning it."""
    a, b = _workers(tmp_path, MemorySessionStore())
    started = anyio.Event()

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        started.set()
        await anyio.sleep_forever()
        return "never"

    from dispatcher import Tool

    for d in (a, b):
        d.registry.add(Tool("slow", "Wait.", slow, {"type": "object"}, deferred=False))
    batch = [_write("w1"), ToolCall("s", "slow", {})]
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.session(SESSION).dispatch, batch)
            await started.wait()
            tg.cancel_scope.cancel()
    started = anyio.Event()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.session(SESSION).dispatch, batch)
            await started.wait()  # slow runs again on B: it never finished on A
            tg.cancel_scope.cancel()
    assert _lines(tmp_path / "out.txt") == ["x by w1"]


async def test_a_hook_block_saves_what_finished_for_the_other_worker(tmp_path: Path) -> None:
    """A hook blocks the batch on A after its writer ran; B, with no such hook, serves the
    writer's result and runs the rest."""
    from dispatcher import HookBlocked

    class Blocker:
        def before(self, call: ToolCall, ctx: Any) -> None:
            if call.name == "read":
                raise HookBlocked("not now")

    store = MemorySessionStore()
    (a,) = _workers(tmp_path, store, n=1, hooks=[Blocker()])
    (b,) = _workers(tmp_path, store, n=1)
    batch = [_write("w1"), _read("r1")]
    with pytest.raises(HookBlocked):
        await a.session(SESSION).dispatch(batch)
    results = await b.session(SESSION).dispatch(batch)
    assert results[0].deduped and results[1].content == "x by w1\n"
    assert _lines(tmp_path / "out.txt") == ["x by w1"] and _lines(tmp_path / "reads.log") == ["r1"]


async def test_refresh_brings_a_worker_up_to_the_stored_state_before_it_dispatches(tmp_path: Path) -> None:
    """refresh() loads what another worker saved (schemas loaded there are in this worker's
    request) without a lease; with nothing newer it says False."""
    from dispatcher import Tool

    store = MemorySessionStore()
    a, b = _workers(tmp_path, store)
    for d in (a, b):
        d.registry.add(Tool("hidden", "A deferred tool.", lambda args, ctx: "h", {"type": "object"}))
    batch = [ToolCall("c1", "run_tool", {"name": "hidden", "args": {}})]
    assert (await a.session(SESSION).dispatch(batch))[0].status is Status.schema_required
    sb = b.session(SESSION)
    assert not sb.is_loaded("hidden")
    held = await store.acquire(SESSION)  # refresh takes no lease: it works while A holds one
    assert await sb.refresh() is True and sb.is_loaded("hidden")
    assert await sb.refresh() is False
    await store.release(held)


async def test_code_invoking_without_a_session_takes_no_lease(tmp_path: Path) -> None:
    """Dispatcher.invoke's own scratch session is per dispatcher: two workers invoke at once
    without SessionBusy, and nothing of it is stored."""
    store = MemorySessionStore()
    a, b = _workers(tmp_path, store)
    held = await store.acquire("invoke")
    assert (await a.invoke("read", {"path": "x"})).status is Status.ok
    assert (await b.invoke("read", {"path": "x"})).status is Status.ok
    await store.release(held)
    assert await store.load("invoke") == StoredSession()


async def test_a_batch_with_an_uncertain_writer_replays_clean(tmp_path: Path) -> None:
    """The recording of a resumed batch whose writer a dead worker left started replays
    with that writer decided as it was (uncertain), nothing run."""
    store = MemorySessionStore()
    dead = await store.acquire(SESSION)
    await store.mark_started(dead, ["w1"])
    await store.release(dead)
    (d,) = _workers(tmp_path, store, n=1)
    path = tmp_path / "s.jsonl"
    results = await d.session(SESSION, record=path).dispatch([_write("w1"), _read("r1")])
    assert results[0].effect_uncertain
    (tmp_path / "replay").mkdir()
    report = await replay(path, Dispatcher(registry(tmp_path / "replay")))
    assert report.ok and report.calls == 2, report
    assert _lines(tmp_path / "replay" / "out.txt") == []


async def test_a_recording_continues_its_chain_in_a_new_file_on_another_worker(tmp_path: Path) -> None:
    """A records to one file, B to a new one: the new file's header says which record it
    goes on from, both read clean, and replaying them in order matches."""
    a, b = _workers(tmp_path, MemorySessionStore())
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    await a.session(SESSION, record=first).dispatch([_read("r1"), _write("w1")])
    await b.session(SESSION, record=second, mode="direct").dispatch([_read("r2"), _write("w2")])
    b.session(SESSION).new_run()
    await b.session(SESSION).dispatch([_read("r3"), _read("r4", "in.txt")])
    header, batches, truncated, problem = read_recording(second)
    first_lines = first.read_bytes().splitlines()
    assert header["continues"] == {"seq": 1, "prev": line_hash(first_lines[1]), "run": 1}
    assert header["mode"] == "deferred"  # the conversation's, not what B's session was opened with
    assert [r["seq"] for r in batches] == [2, 3] and problem is None and not truncated
    assert read_recording(first)[3] is None
    (tmp_path / "replay").mkdir()
    replayer = Dispatcher(registry(tmp_path / "replay"))
    for path in (first, second):
        report = await replay(path, replayer)
        assert report.ok and report.batches == (1 if path == first else 2), report


async def test_workers_recording_to_one_file_keep_one_chain(tmp_path: Path) -> None:
    """A and B take turns appending to the same file: one chain, no second header, and it
    replays clean; a worker whose stored position disagrees with the file says so."""
    a, b = _workers(tmp_path, MemorySessionStore())
    path = tmp_path / "s.jsonl"
    await a.session(SESSION, record=path).dispatch([_read("r1")])
    await b.session(SESSION, record=path).dispatch([_write("w1"), _read("r2")])
    await a.session(SESSION).dispatch([_read("r3")])
    header, batches, _, problem = read_recording(path)
    assert problem is None and "continues" not in header and [r["seq"] for r in batches] == [1, 2, 3]
    (tmp_path / "replay").mkdir()
    report = await replay(path, Dispatcher(registry(tmp_path / "replay")))
    assert report.ok and report.batches == 3, report


async def test_a_file_behind_the_stored_chain_is_continued_from_its_last_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """B recorded elsewhere; A goes back to its own file, which ends before the stored
    position: a warning, and the file's own chain goes on unbroken."""
    a, b = _workers(tmp_path, MemorySessionStore())
    mine = tmp_path / "a.jsonl"
    await a.session(SESSION, record=mine).dispatch([_read("r1")])
    await b.session(SESSION, record=tmp_path / "b.jsonl").dispatch([_read("r2", "in.txt")])
    await a.session(SESSION).dispatch([_read("r3", "other.txt")])
    assert any("ends at record 1, not at record 2" in r.getMessage() for r in caplog.records)
    _, batches, _, problem = read_recording(mine)
    assert problem is None and [r["seq"] for r in batches] == [1, 2]


# -- real worker processes over one SQLite file, or one Redis -----------------------------


class _Shared:
    """The store the worker processes of a test share: `where` is what each is given (a
    SQLite file's path, or the URL of the test's redis-server `server`)."""

    def __init__(self, where: str, server: RedisServer | None = None) -> None:
        self.where = where
        self.server = server

    def marks(self) -> frozenset[str]:
        """The session's started marks, read through a store of this test's own."""
        if self.server is None:
            if not Path(self.where).exists():
                return frozenset()
            reader = SqliteSessionStore(self.where)
            try:
                return anyio.run(reader.load, SESSION).started
            finally:
                reader.close()

        async def load() -> StoredSession:
            store = RedisSessionStore(self.where, namespace=NAMESPACE)
            try:
                return await store.load(SESSION)
            finally:
                await store.aclose()

        return anyio.run(load).started


def _redis_server(tmp_path: Path) -> RedisServer:
    server = RedisServer(require_program("redis-server", package="redis-server"), tmp_path / "redis")
    server.start()
    return server


@pytest.fixture(params=["sqlite", "redis"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Shared]:
    """One SQLite file, or one redis-server of the test's own, for its worker processes."""
    if request.param == "sqlite":
        yield _Shared(str(tmp_path / "sessions.sqlite"))
        return
    server = _redis_server(tmp_path)
    try:
        yield _Shared(server.url, server)
    finally:
        server.kill()  # nothing to keep; a graceful stop waits ~100 ms


def _worker(store: str, ws: Path, lease: float, steps: list[dict[str, Any]]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests._session_worker", store, str(ws), str(lease), json.dumps(steps)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_worker(store: str, ws: Path, lease: float, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = _worker(store, ws, lease, steps)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def _next_line(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, Any]:
    """The next step's line from a worker that is still running (it prints one, then waits)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"worker {proc.pid} said nothing within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"worker {proc.pid} exited: {proc.communicate(timeout=10)[1]}"
    answer: dict[str, Any] = json.loads(line)
    return answer


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def _call(call_id: str, tool: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}


def _statuses(line: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(r["call_id"], r["status"]) for r in line["results"]]


def test_interrupt_in_one_process_approve_in_another_runs_once(shared: _Shared, tmp_path: Path) -> None:
    """Process A's gate interrupts; process B approves and the writer runs once; process C,
    given the same approval, is interrupted again (the approval was spent): one line written."""
    ws = tmp_path / "ws"
    ws.mkdir()
    batch = [_call("w1", "gated_write", path="out.txt", text="x")]
    (interrupted,) = _run_worker(shared.where, ws, 30, [{"calls": batch}])
    assert interrupted["raised"] == "DispatchInterrupted" and _lines(ws / "out.txt") == []
    (approved,) = _run_worker(shared.where, ws, 30, [{"calls": batch, "decisions": {"w1": "allow"}}])
    assert _statuses(approved) == [("w1", "ok")]
    (again,) = _run_worker(shared.where, ws, 30, [{"calls": batch, "decisions": {"w1": "allow"}}])
    assert again["raised"] == "DispatchInterrupted"
    assert _lines(ws / "out.txt") == ["x by w1"]


def _wait_for_mark(shared: _Shared, call_id: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        if call_id in shared.marks():
            return
        time.sleep(0.05)
    raise AssertionError(f"{call_id} was never marked started")


def _wait_for_line(path: Path, line: str, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    """Wait until a worker's writer has appended `line` to `path` (its mark is recorded
    before the writer starts, so the mark alone does not say the effect happened)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        if line in _lines(path):
            return
        time.sleep(0.01)
    raise AssertionError(f"{line!r} never reached {path}")


def test_a_second_process_is_busy_at_once_while_the_first_holds_the_lease(
    shared: _Shared, tmp_path: Path
) -> None:
    """While process A's writer runs, process B's dispatch raises SessionBusy at once and
    runs nothing; A's writer ran once."""
    ws = tmp_path / "ws"
    ws.mkdir()
    holder = _worker(
        shared.where, ws, 30, [{"calls": [_call("w1", "write", path="out.txt", text="x", block=True)]}]
    )
    try:
        _wait_for_mark(shared, "w1", holder)
        (busy,) = _run_worker(
            shared.where, ws, 30, [{"calls": [_call("w2", "write", path="out.txt", text="y")]}]
        )
    finally:
        _stop(holder)
    assert busy["raised"] == "SessionBusy" and busy["seconds"] < 0.5
    assert _lines(ws / "out.txt") == ["x by w1"]


@pytest.mark.slow
def test_a_worker_killed_mid_writer_leaves_it_uncertain_and_never_rerun(
    shared: _Shared, tmp_path: Path
) -> None:
    """kill -9 of a worker while its writer runs (after the writer's first effect): another
    process is refused at once while the dead worker's lease lives; once it expires, the
    writer comes back failed and effect-uncertain without running again, and the reader
    the dead worker never finished runs."""
    ws = tmp_path / "ws"
    ws.mkdir()
    lease = 1.5
    batch = [_call("w1", "write", path="out.txt", text="x", block=True), _call("r1", "read", path="in.txt")]
    go = tmp_path / "go"
    doomed = _worker(shared.where, ws, lease, [{"calls": batch}])
    # started now, so that its start-up is not counted against the dead worker's lease
    other = _worker(shared.where, ws, lease, [{"calls": batch, "wait_for": str(go)}])
    try:
        _wait_for_mark(shared, "w1", doomed)
        _wait_for_line(ws / "out.txt", "x by w1", doomed)
    finally:
        os.kill(doomed.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        doomed.communicate(timeout=30)
    try:
        assert _lines(ws / "out.txt") == ["x by w1"]
        go.touch()
        busy = _next_line(other)
    finally:
        _stop(other)
    assert busy["raised"] == "SessionBusy" and busy["seconds"] < 0.5
    # the dead worker's last renewal came before the kill: a lease time after it, it is gone
    time.sleep(max(0.0, killed_at + lease + 0.1 - time.monotonic()))
    reads_before = _lines(ws / "reads.log")  # the dead worker's reader may have run too
    (resumed,) = _run_worker(shared.where, ws, lease, [{"calls": batch}])
    w1 = ToolResult.from_json(resumed["results"][0])
    assert w1.status is Status.failed and w1.effect_uncertain and not w1.retryable
    assert "the worker running this call stopped; its effect is unknown" in w1.content
    assert _statuses(resumed)[1] == ("r1", "ok")
    assert _lines(ws / "out.txt") == ["x by w1"] and _lines(ws / "reads.log") == [*reads_before, "r1"]
    assert shared.marks() == frozenset()


def test_a_redis_outage_fails_the_next_dispatch_clearly_until_redis_is_back(tmp_path: Path) -> None:
    """Redis stopped while no worker holds the lease: the next dispatch, on another worker
    process that was connected before, raises RedisStoreError naming Redis at once and runs
    nothing; once Redis is started again on the same port, that worker's next dispatch works,
    and so does the first worker's, whose connection the outage broke."""
    ws = tmp_path / "ws"
    ws.mkdir()
    down, up, again = tmp_path / "down", tmp_path / "up", tmp_path / "again"
    server = _redis_server(tmp_path)
    a = _worker(server.url, ws, 30, [
        {"calls": [_call("w1", "write", path="out.txt", text="x")]},
        {"calls": [_call("w4", "write", path="out.txt", text="x")], "wait_for": str(again)},
    ])  # fmt: skip
    b = _worker(server.url, ws, 30, [
        {"calls": [_call("r1", "read", path="out.txt")], "wait_for": str(tmp_path / "a-done")},
        {"calls": [_call("w2", "write", path="out.txt", text="x")], "wait_for": str(down)},
        {"calls": [_call("w3", "write", path="out.txt", text="x")], "wait_for": str(up)},
    ])  # fmt: skip
    try:
        assert _statuses(_next_line(a)) == [("w1", "ok")]
        (tmp_path / "a-done").touch()
        assert _statuses(_next_line(b)) == [("r1", "ok")]
        server.stop()
        down.touch()
        failed = _next_line(b)
        assert failed["raised"] == "RedisStoreError" and failed["seconds"] < 3
        assert failed["message"].startswith(
            f"session store Redis redis://127.0.0.1:{server.port}/0: could not"
        )
        server.start()
        up.touch()
        assert _statuses(_next_line(b)) == [("w3", "ok")]
        again.touch()
        assert _statuses(_next_line(a)) == [("w4", "ok")]
        assert a.wait(timeout=10) == 0 and b.wait(timeout=10) == 0
    finally:
        _stop(a, b)
        server.kill()
    assert _lines(ws / "out.txt") == ["x by w1", "x by w3", "x by w4"]
