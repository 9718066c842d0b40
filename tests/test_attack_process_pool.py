"""Attacks on `Tool(isolation="process")`: worker processes from a forkserver pool, killed
at the call's timeout, whether the worker is starting, running or hung; what outlives a
timeout, a cancellation or a shutdown is checked on the processes themselves (/proc)."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from dispatcher import (
    Dispatcher,
    ProcessContext,
    Registry,
    Status,
    Tool,
    ToolCall,
    ToolResult,
    _backend,
    _pool,
)

from . import _process_tools as worker

WRITES = {"file:/x"}


def tool(name: str, handler: Any, **kw: Any) -> Tool:
    kw.setdefault("deferred", False)
    kw.setdefault("isolation", "process")
    return Tool(name, name, handler, **kw)


def _state_of(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid` from /proc, None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    return rest[0], int(rest[1])


def is_alive(pid: int) -> bool:
    """The process exists (kill 0 reaches it) and is no zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = _state_of(pid)
    return state is not None and state[0] != "Z"


def _forkserver_pid() -> int | None:
    """The pid of this test process's forkserver (None: none runs)."""
    return multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[no-any-return,attr-defined]


def _forked() -> set[int]:
    """Every live process the forkserver forked (a worker of any pool of this test process)."""
    server = _forkserver_pid()
    if server is None:
        return set()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = _state_of(int(entry))
            if state is not None and state[1] == server and state[0] != "Z":
                found.add(int(entry))
    return found


_EARLIER: set[int] = set()  # workers alive as the test began: an earlier test's, not this one's


def live_workers() -> set[int]:
    """The live workers this test started (any other test in this process is over)."""
    return _forked() - _EARLIER


async def eventually(check: Callable[[], bool], within: float = 3.0) -> bool:
    """Whether `check()` becomes true within `within` seconds (polled)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if check():
            return True
        await anyio.sleep(0.02)
    return check()


def spin_until_dead(pid: int, within: float = 2.0) -> None:
    """Block (no checkpoint) until /proc shows `pid` dead, so that nothing runs between."""
    end = time.monotonic() + within
    while is_alive(pid) and time.monotonic() < end:
        time.sleep(0.0005)


def pids_in(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.fixture(autouse=True)
def no_worker_outlives_the_test() -> Iterator[None]:
    """The forkserver runs before each test (its first start is not what the tests time,
    except where a start is slowed on purpose); no worker the test started is alive after
    it (one another test left, in the same process, is not this test's)."""
    # a worker forked and gone: the server has imported its preload (set by the pool, as
    # its first start would), which it does after `ensure_running` returns, before a fork
    warm = _pool.ProcessPool().start()
    warm.process.kill()
    warm.process.join(5)
    _EARLIER.clear()
    _EARLIER.update(_forked())
    yield
    end = time.monotonic() + 3
    while live_workers() and time.monotonic() < end:
        time.sleep(0.02)
    assert live_workers() == set(), "a worker outlived the test"


class SlowStarts:
    """`ProcessPool.start` delayed by `delay` for the first `count` starts (None: all); the
    workers it started, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float, count: int | None = None) -> None:
        self.delay, self.count = delay, count
        self.calls = 0
        self.ended = 0
        self.made: list[Any] = []
        real = _pool.ProcessPool.start

        def start(pool: _pool.ProcessPool) -> Any:
            self.calls += 1
            try:
                if self.count is None or self.calls <= self.count:
                    time.sleep(self.delay)
                w = real(pool)
                self.made.append(w)
                return w
            finally:
                self.ended += 1

        monkeypatch.setattr(_pool.ProcessPool, "start", start)


@pytest.fixture
def slow_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., SlowStarts]]:
    """Makes a SlowStarts; at the end waits for its starts still in flight (abandoned by
    their calls), so that no worker of this test arrives during the next."""
    made: list[SlowStarts] = []

    def make(delay: float, count: int | None = None) -> SlowStarts:
        made.append(SlowStarts(monkeypatch, delay, count))
        return made[-1]

    yield make
    end = time.monotonic() + 5
    while any(s.ended < s.calls for s in made) and time.monotonic() < end:
        time.sleep(0.02)


def check_batch(results: list[ToolResult], calls: list[ToolCall]) -> None:
    assert [(r.call_id, r.name) for r in results] == [(c.id, c.name) for c in calls]


# --- one result per call ---------------------------------------------------------------


async def test_a_mixed_batch_gets_one_result_per_call_in_order(tmp_path: Path) -> None:
    """Calls that return, hang, spin, crash (os._exit), raise, return an unpicklable value or
    one the host cannot unpickle each get exactly one result, in call order, ids kept (a
    repeated id is refused in its place); every worker that hung or spun is dead by the
    end of the batch."""
    path = tmp_path / "pids"
    reg = Registry(
        [
            tool("ok", worker.pid_and_clock, timeout=10),
            tool("hang", worker.note_pid_then_hang, timeout=0.4),
            tool("spin", worker.note_pid_then_spin, timeout=0.4),
            tool("crash", worker.exit_hard),
            tool("raise", worker.raise_value_error),
            tool("tool_error", worker.raise_tool_error),
            tool("unpicklable", worker.unpicklable_result),
            tool("unloadable", worker.unloadable_result),
        ]
    )
    d = Dispatcher(reg, max_concurrent=1)
    p = {"path": str(path)}
    calls = [
        ToolCall("a", "ok", {}),
        ToolCall("b", "hang", p),
        ToolCall("c", "crash", {}),
        ToolCall("d", "unloadable", {}),
        ToolCall("e", "spin", p),
        ToolCall("f", "raise", {}),
        ToolCall("g", "unpicklable", {}),
        ToolCall("a", "tool_error", {}),
        ToolCall("i", "tool_error", {}),
        ToolCall("h", "ok", {}),
    ]
    try:
        with anyio.fail_after(15):
            results = await d.session("s").dispatch(calls)
        check_batch(results, calls)
        statuses = [r.status for r in results]
        assert statuses == [
            Status.ok,
            Status.timed_out,
            Status.failed,
            Status.failed,
            Status.timed_out,
            Status.failed,
            Status.failed,
            Status.invalid_arguments,
            Status.failed,
            Status.ok,
        ], [(r.call_id, r.status, r.content) for r in results]
        assert "exit code 3" in results[2].content
        assert "NeedsTwo" in results[3].content or "missing" in results[3].content, results[3].content
        assert "could not be sent back" in results[6].content
        assert "duplicate call id" in results[7].content  # refused, under its own id
        assert "no such row" in results[8].content and not results[8].retryable
        for r in (results[1], results[4]):
            assert 0.4 <= r.duration < 1.0, r
        hung = pids_in(path)
        assert len(hung) == 2
        assert await eventually(lambda: not any(is_alive(pid) for pid in hung), 1.0)
        # the worker of the unloadable result was killed (its pipe may hold the rest)
        assert d.statistics().process_workers <= 1
        again = await d.invoke("ok", {})
        assert again.status is Status.ok, again.content
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers())
    assert d.statistics().process_workers == 0


# --- timed out at the timeout, the slot free at once ---------------------------------------


@pytest.mark.parametrize("state", ["starting", "running", "hung"])
async def test_a_call_is_timed_out_at_its_timeout_and_the_next_starts_promptly(
    state: str, tmp_path: Path, slow_starts: Callable[..., SlowStarts]
) -> None:
    """max_concurrent=1: a call whose worker is still starting (slowed to 1.5 s), or whose
    handler spins or sleeps forever, is timed_out at its 0.4 s timeout (+0.6 s at most),
    and the next call of the batch is running in a worker within 0.6 s of that."""
    path = tmp_path / "pids"
    if state == "starting":
        slow_starts(1.5, count=1)
        first = tool("first", worker.pid_and_clock, timeout=0.4)
    elif state == "running":
        first = tool("first", worker.note_pid_then_spin, timeout=0.4)
    else:
        first = tool("first", worker.note_pid_then_hang, timeout=0.4)
    d = Dispatcher(Registry([first, tool("probe", worker.pid_and_clock, timeout=10)]), max_concurrent=1)
    try:
        calls = [ToolCall("x", "first", {"path": str(path)}), ToolCall("y", "probe", {})]
        began = time.monotonic()
        with anyio.fail_after(15):
            results = await d.session("s").dispatch(calls)
        took = time.monotonic() - began
        check_batch(results, calls)
        timed, probe = results
        assert timed.status is Status.timed_out, timed.content
        assert 0.4 <= timed.duration < 1.0, timed.duration
        assert probe.status is Status.ok, probe.content
        assert timed.started is not None
        probe_began = json.loads(probe.content)["began"]
        assert probe_began - (timed.started + timed.duration) < 0.6
        assert took < 0.4 + 1.2
        stats = d.statistics()
        assert (stats.in_use, stats.stuck) == (0, ())
        if state != "starting":
            [pid] = pids_in(path)
            assert await eventually(lambda: not is_alive(pid), 1.0)
    finally:
        d.shutdown()


# --- bounded, and none after shutdown ------------------------------------------------------


async def test_timed_out_starts_leave_only_tracked_workers_and_none_after_shutdown(
    slow_starts: Callable[..., SlowStarts],
) -> None:
    """Eight calls in a row each timed out while their worker starts (0.6 s, timeout 0.1):
    of the workers that then finish starting, the pool keeps as many as its limit (1) and
    kills the rest; statistics agrees with /proc; the next call reuses the one kept (no
    new start); shutdown() leaves no worker process alive."""
    slow = slow_starts(0.6)
    d = Dispatcher(Registry([tool("pid", worker.pid_and_clock, timeout=0.1)]), max_concurrent=1)
    try:
        timed = []
        with anyio.fail_after(15):
            for i in range(8):
                r = await d.invoke("pid", {"i": i})
                timed.append(r.status)
        assert timed.count(Status.timed_out) >= 6, timed
        with anyio.fail_after(5):
            while len(slow.made) < slow.calls:  # noqa: ASYNC110  # the starts finish in their threads
                await anyio.sleep(0.02)
        assert await eventually(lambda: len(live_workers()) == 1, 2.0), live_workers()
        live = live_workers()
        assert d.statistics().process_workers == len(live), (d.statistics(), live, slow.calls)
        assert live <= {w.process.pid for w in slow.made}
        starts = slow.calls
        slow.delay = 0.0
        got = set()
        for i in range(len(live)):
            r = await d.invoke("pid", {"i": i})
            assert r.status is Status.ok, r.content
            got.add(json.loads(r.content)["pid"])
        assert slow.calls == starts  # served by the adopted workers
        assert got <= live
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers(), 2.0), live_workers()
    assert d.statistics().process_workers == 0


async def test_shutdown_while_abandoned_starts_are_in_flight_kills_each_as_it_arrives(
    slow_starts: Callable[..., SlowStarts],
) -> None:
    """Three concurrent calls time out while their workers start (0.8 s); shutdown() then,
    with the starts still in flight: each worker is killed once started, none is left
    alive, and a call after fails saying the Dispatcher was shut down, at once."""
    slow = slow_starts(0.8)
    d = Dispatcher(
        Registry([tool("pid", worker.pid_and_clock, timeout=0.2, concurrent=True)]), max_concurrent=3
    )
    calls = [ToolCall(f"c{i}", "pid", {"i": i}) for i in range(3)]
    with anyio.fail_after(10):
        results = await d.session("s").dispatch(calls)
    check_batch(results, calls)
    assert [r.status for r in results] == [Status.timed_out] * 3, [r.content for r in results]
    assert all(r.duration < 0.8 for r in results)
    assert len(slow.made) < 3  # still starting
    d.shutdown()
    with anyio.fail_after(5):
        while len(slow.made) < 3:  # noqa: ASYNC110  # the starts finish in their threads
            await anyio.sleep(0.02)
    pids = [w.process.pid for w in slow.made]
    assert await eventually(lambda: not any(is_alive(pid) for pid in pids), 2.0)
    assert d.statistics().process_workers == 0
    began = time.monotonic()
    with anyio.fail_after(5):
        after = await d.invoke("pid", {})
    assert after.status is Status.failed and "shut down" in after.content
    assert time.monotonic() - began < 0.5
    assert slow.calls == 3  # no worker started after the shutdown


async def test_shutdown_while_a_call_waits_for_its_start_fails_it_without_a_hang(
    slow_starts: Callable[..., SlowStarts],
) -> None:
    """shutdown() while a call (timeout 10) waits for its worker to start (1 s): the call
    fails saying the Dispatcher was shut down once the start ends, well before its timeout,
    and that worker is killed."""
    slow = slow_starts(1.0)
    d = Dispatcher(Registry([tool("pid", worker.pid_and_clock, timeout=10)]), max_concurrent=1)
    got: list[ToolResult] = []

    async def call() -> None:
        got.append(await d.invoke("pid", {}))

    began = time.monotonic()
    with anyio.fail_after(8):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.sleep(0.3)
            d.shutdown()
    [result] = got
    assert result.status is Status.failed and "shut down" in result.content, result.content
    assert time.monotonic() - began < 1.0 + 1.0
    [w] = slow.made
    assert await eventually(lambda: not is_alive(w.process.pid), 2.0)


async def test_shutdown_while_calls_run_and_again_leaves_nothing_and_later_calls_fail(
    tmp_path: Path,
) -> None:
    """Three concurrent calls hang in their workers; shutdown() fails all three promptly
    (not at their 30 s timeout), their workers die, a second shutdown() is harmless, and
    later calls (a batch of two) fail saying shut down without waiting."""
    path = tmp_path / "pids"
    d = Dispatcher(
        Registry([tool("hang", worker.note_pid_then_hang, timeout=30, concurrent=True)]), max_concurrent=3
    )
    calls = [ToolCall(f"h{i}", "hang", {"path": str(path), "i": i}) for i in range(3)]
    got: list[list[ToolResult]] = []

    async def batch() -> None:
        got.append(await d.session("s").dispatch(calls))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            while len(pids_in(path)) < 3:  # noqa: ASYNC110  # written by the workers
                await anyio.sleep(0.02)
            stopped = time.monotonic()
            d.shutdown()
        took = time.monotonic() - stopped
    [results] = got
    check_batch(results, calls)
    assert [r.status for r in results] == [Status.failed] * 3, [r.content for r in results]
    assert all("ended without answering" in r.content for r in results)
    assert took < 1.0
    pids = pids_in(path)
    assert await eventually(lambda: not any(is_alive(pid) for pid in pids), 1.0)
    d.shutdown()
    assert d.statistics().process_workers == 0
    began = time.monotonic()
    with anyio.fail_after(5):
        later = await d.session("s").dispatch(calls[:2])
    assert time.monotonic() - began < 0.5
    check_batch(later, calls[:2])
    assert all(r.status is Status.failed and "shut down" in r.content for r in later)


# --- the caller cancels ----------------------------------------------------------------


async def test_the_caller_cancelling_while_a_worker_starts_ends_the_dispatch_at_once(
    slow_starts: Callable[..., SlowStarts],
) -> None:
    """move_on_after(0.3) around a dispatch whose worker takes 1.2 s to start (call timeout
    10): the dispatch ends by 0.9 s; the worker, once started, serves the next dispatch
    (no second start); after shutdown() it is gone."""
    slow = slow_starts(1.2)
    d = Dispatcher(Registry([tool("pid", worker.pid_and_clock, timeout=10)]), max_concurrent=1)
    try:
        began = time.monotonic()
        with anyio.move_on_after(0.3) as scope:
            await d.session("s").dispatch([ToolCall("a", "pid", {})])
        assert scope.cancelled_caught
        assert time.monotonic() - began < 0.9
        with anyio.fail_after(5):
            while not slow.made:  # noqa: ASYNC110  # the start finishes in its thread
                await anyio.sleep(0.02)
        await anyio.sleep(0.05)
        assert live_workers() == {slow.made[0].process.pid}
        with anyio.fail_after(5):
            [r] = await d.session("s").dispatch([ToolCall("b", "pid", {})])
        assert r.status is Status.ok and r.call_id == "b", r.content
        assert f'"pid": {slow.made[0].process.pid}' in r.content
        assert slow.calls == 1
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers(), 2.0)


async def test_the_caller_cancelling_while_a_worker_runs_kills_it(tmp_path: Path) -> None:
    """fail_after around a dispatch whose handler hangs (call timeout 30): the dispatch is
    cancelled promptly, the worker is killed, and a later dispatch (max_concurrent=1)
    runs at once in a fresh worker."""
    path = tmp_path / "pids"
    d = Dispatcher(
        Registry(
            [
                tool("hang", worker.note_pid_then_hang, timeout=30),
                tool("pid", worker.pid_and_clock, timeout=10),
            ]
        ),
        max_concurrent=1,
    )
    try:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.8):
                await d.session("s").dispatch([ToolCall("a", "hang", {"path": str(path)})])
        assert time.monotonic() - began < 0.8 + 0.6
        [pid] = pids_in(path)
        assert await eventually(lambda: not is_alive(pid), 1.0)
        stats = d.statistics()
        assert (stats.in_use, stats.stuck) == (0, ())
        began = time.monotonic()
        with anyio.fail_after(5):
            [r] = await d.session("s").dispatch([ToolCall("b", "pid", {})])
        assert r.status is Status.ok, r.content
        assert time.monotonic() - began < 0.6
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers(), 2.0)


# --- a concurrent batch ----------------------------------------------------------------


async def test_a_concurrent_batch_with_short_timeouts_gets_its_results_in_order(tmp_path: Path) -> None:
    """Nine concurrent process calls (max_concurrent 3, timeouts 0.3 s) that hang, crash,
    sleep briefly or return: one result each in call order, the hung ones timed_out near
    0.3 s, the whole batch within three waves; every hung worker is dead afterwards."""
    path = tmp_path / "pids"
    reg = Registry(
        [
            tool("hang", worker.note_pid_then_hang, timeout=0.3, concurrent=True),
            tool("crash", worker.exit_hard, timeout=0.3, concurrent=True),
            tool("nap", worker.sleep_for, timeout=0.3, concurrent=True),
            tool("pid", worker.pid_and_clock, timeout=0.3, concurrent=True),
        ]
    )
    d = Dispatcher(reg, max_concurrent=3)
    calls = [
        ToolCall("1", "hang", {"path": str(path), "i": 1}),
        ToolCall("2", "pid", {"i": 2}),
        ToolCall("3", "hang", {"path": str(path), "i": 3}),
        ToolCall("4", "crash", {}),
        ToolCall("5", "nap", {"s": 0.1}),
        ToolCall("6", "hang", {"path": str(path), "i": 6}),
        ToolCall("7", "nap", {"s": 5}),
        ToolCall("8", "pid", {"i": 8}),
        ToolCall("9", "hang", {"path": str(path), "i": 9}),
    ]
    expected = [
        Status.timed_out,
        Status.ok,
        Status.timed_out,
        Status.failed,
        Status.ok,
        Status.timed_out,
        Status.timed_out,
        Status.ok,
        Status.timed_out,
    ]
    try:
        began = time.monotonic()
        with anyio.fail_after(10):
            results = await d.session("s").dispatch(calls)
        took = time.monotonic() - began
        check_batch(results, calls)
        assert [r.status for r in results] == expected, [(r.call_id, r.content) for r in results]
        for r in results:
            if r.status is Status.timed_out:
                assert 0.3 <= r.duration < 0.9, r
        assert took < 3 * 0.3 + 1.2, took
        hung = pids_in(path)
        assert len(hung) == 4
        assert await eventually(lambda: not any(is_alive(pid) for pid in hung), 1.0)
        assert len(live_workers()) <= 3
        assert d.statistics().in_use == 0
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers(), 2.0)


# --- effect_uncertain ------------------------------------------------------------------


@pytest.mark.parametrize("starting", [False, True], ids=["hung", "starting"])
async def test_a_timed_out_writer_is_effect_uncertain_and_a_reader_is_not(
    starting: bool, tmp_path: Path, slow_starts: Callable[..., SlowStarts]
) -> None:
    """A writer (writes file:/x) and a reader (reads file:/x) timed out, hung in their
    workers or while those start: the writer's result is effect_uncertain, the reader's
    is not."""
    if starting:
        slow_starts(0.8)
    p = {"path": str(tmp_path / "pids")}
    reg = Registry(
        [
            tool("writer", worker.note_pid_then_hang, timeout=0.3, writes=lambda a: WRITES),
            tool("reader", worker.note_pid_then_hang, timeout=0.3, reads=lambda a: WRITES),
        ]
    )
    d = Dispatcher(reg, max_concurrent=1)
    try:
        calls = [ToolCall("r", "reader", p), ToolCall("w", "writer", p)]
        with anyio.fail_after(10):
            results = await d.session("s").dispatch(calls)
        check_batch(results, calls)
        reader, writer = results
        assert reader.status is Status.timed_out and not reader.effect_uncertain, reader
        assert writer.status is Status.timed_out and writer.effect_uncertain, writer
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers(), 2.0)


# --- the forkserver's real first start, a worker that died idle, a handler's own children ---

FIRST_START = """
import json, sys, time
import anyio, multiprocessing.forkserver
from dispatcher import Dispatcher, Registry, Tool
from tests import _process_tools as w
from tests.test_attack_process_pool import live_workers

async def main():
    reg = Registry([Tool("pid", "pid", w.pid_and_clock, deferred=False, isolation="process", timeout=0.1)])
    d = Dispatcher(reg, max_concurrent=1)
    first = await d.invoke("pid", {})
    t = time.monotonic()
    while d.statistics().process_workers == 0 and time.monotonic() - t < 10:
        await anyio.sleep(0.02)
    second = await d.invoke("pid", {})
    before = sorted(live_workers())
    d.shutdown()
    t = time.monotonic()
    while live_workers() and time.monotonic() - t < 3:
        await anyio.sleep(0.02)
    print(json.dumps({
        "first": first.status, "duration": first.duration, "second": second.status,
        "content": second.content, "before": before, "after": sorted(live_workers()),
    }))

anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_the_forkservers_real_first_start_times_out_the_first_call_then_serves_the_next(
    backend: str,
) -> None:
    """In a fresh interpreter (so the forkserver really starts, unslowed), a first call
    with a 0.1 s timeout is timed_out by 0.7 s rather than at the end of that start; the
    worker, once up, serves the next call, and after shutdown() none is alive."""
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", FIRST_START, backend],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] == "timed_out", got
    assert 0.1 <= got["duration"] < 0.7, got
    assert got["second"] == "ok", got
    assert [json.loads(got["content"])["pid"]] == got["before"], got  # the one worker, adopted
    assert got["after"] == [], got


async def test_an_idle_worker_that_died_is_replaced_and_not_counted_after() -> None:
    """An idle worker killed from outside (the OOM killer, an operator) is not handed a
    call: the next call runs in a new worker, and statistics() counts only the live one."""
    d = Dispatcher(Registry([tool("pid", worker.pid_and_clock, timeout=5)]), max_concurrent=1)
    try:
        first = await d.invoke("pid", {"n": 1})
        assert first.status is Status.ok, first.content
        pid = json.loads(first.content)["pid"]
        os.kill(pid, 9)
        assert await eventually(lambda: not is_alive(pid), 1.0)
        with anyio.fail_after(5):
            second = await d.invoke("pid", {"n": 2})
        assert second.status is Status.ok, second.content
        assert json.loads(second.content)["pid"] != pid
        assert d.statistics().process_workers == len(live_workers()) == 1
    finally:
        d.shutdown()


async def test_shutdown_leaves_thread_tools_working() -> None:
    """After shutdown() (twice), process calls fail saying shut down while a thread tool
    and an async tool of the same Dispatcher still run, in one batch, in call order."""

    async def on_loop(args: Any, ctx: Any) -> str:
        return "async ok"

    d = Dispatcher(
        Registry(
            [
                tool("proc", worker.pid_and_clock, timeout=5),
                tool("thread", worker.pid_and_clock, isolation="thread", timeout=5),
                tool("async", on_loop, isolation=None),
            ]
        )
    )
    assert (await d.invoke("proc", {})).status is Status.ok
    d.shutdown()
    d.shutdown()
    calls = [ToolCall("p", "proc", {}), ToolCall("t", "thread", {}), ToolCall("a", "async", {})]
    with anyio.fail_after(5):
        results = await d.session("s").dispatch(calls)
    check_batch(results, calls)
    proc, thread, on = results
    assert proc.status is Status.failed and "shut down" in proc.content
    assert thread.status is Status.ok and json.loads(thread.content)["pid"] == os.getpid()
    assert on.status is Status.ok and "async ok" in on.content


async def test_a_timed_out_handlers_child_process_is_killed_too(tmp_path: Path) -> None:
    """A handler that starts a process of its own (subprocess) and hangs is timed out; its
    child goes with the worker, not left running (here `sleep 30`, reparented)."""
    path = tmp_path / "children"
    d = Dispatcher(Registry([tool("spawn", worker.spawn_sleeper_then_hang, timeout=0.4)]))
    try:
        with anyio.fail_after(10):
            r = await d.invoke("spawn", {"path": str(path)})
        assert r.status is Status.timed_out, r.content
    finally:
        d.shutdown()
    [child] = pids_in(path)
    try:
        assert await eventually(lambda: not is_alive(child), 1.0)
    finally:
        if is_alive(child):
            os.kill(child, 9)


async def test_a_call_right_after_its_idle_worker_died_runs_in_a_new_worker() -> None:
    """An idle worker killed from outside, dead as /proc shows, and a call made at once,
    before the forkserver has reaped it (the forkserver is held stopped for 0.3 s, as a
    loaded machine would leave it unscheduled): the call runs in a new worker, it does not
    fail for the idle worker's death. Three times."""
    server = _forkserver_pid()
    assert server is not None
    d = Dispatcher(Registry([tool("pid", worker.pid_and_clock, timeout=5)]), max_concurrent=1)

    async def resume_later() -> None:
        await anyio.sleep(0.3)
        os.kill(server, signal.SIGCONT)

    try:
        r = await d.invoke("pid", {"n": -1})
        for n in range(3):
            assert r.status is Status.ok, (n, r.content)
            pid = json.loads(r.content)["pid"]
            os.kill(server, signal.SIGSTOP)
            try:
                os.kill(pid, signal.SIGKILL)
                spin_until_dead(pid)  # a zombie: its parent, the forkserver, is stopped
                with anyio.fail_after(5):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(resume_later)
                        r = await d.invoke("pid", {"n": n})
            finally:
                os.kill(server, signal.SIGCONT)
            assert r.status is Status.ok, (n, r.content)
            assert json.loads(r.content)["pid"] != pid
    finally:
        d.shutdown()


async def test_caller_cancels_a_concurrent_batch_while_starting_then_running_nothing_leaks(
    tmp_path: Path, slow_starts: Callable[..., SlowStarts]
) -> None:
    """max_concurrent 3: a concurrent batch cancelled by the caller while its three workers
    start (0.5 s) ends at once; the three workers, once up, serve the next batch (no new
    start); a batch cancelled while its handlers hang kills those workers; the next batch
    still works, and after shutdown() no worker is alive."""
    slow = slow_starts(0.5)
    path = tmp_path / "pids"
    reg = Registry(
        [
            tool("pid", worker.pid_and_clock, timeout=5, concurrent=True),
            tool("hang", worker.note_pid_then_hang, timeout=30, concurrent=True),
        ]
    )
    d = Dispatcher(reg, max_concurrent=3)
    try:
        began = time.monotonic()
        with anyio.move_on_after(0.2):
            await d.session("s").dispatch([ToolCall(f"a{i}", "pid", {"i": i}) for i in range(6)])
        assert time.monotonic() - began < 0.2 + 0.6
        with anyio.fail_after(5):
            while len(slow.made) < slow.calls:  # noqa: ASYNC110  # the starts finish in their threads
                await anyio.sleep(0.02)
        assert slow.calls == 3
        made = {w.process.pid for w in slow.made}
        await anyio.sleep(0.05)
        assert live_workers() == made
        calls = [ToolCall(f"b{i}", "pid", {"i": i}) for i in range(3)]
        with anyio.fail_after(5):
            results = await d.session("s").dispatch(calls)
        check_batch(results, calls)
        assert all(r.status is Status.ok for r in results), [r.content for r in results]
        assert {json.loads(r.content)["pid"] for r in results} <= made
        assert slow.calls == 3
        with anyio.move_on_after(5) as scope:
            async with anyio.create_task_group() as tg:
                hangs = [ToolCall(f"h{i}", "hang", {"path": str(path), "i": i}) for i in range(3)]
                tg.start_soon(d.session("t").dispatch, hangs)
                while len(pids_in(path)) < 3:  # noqa: ASYNC110  # written by the workers
                    await anyio.sleep(0.02)
                tg.cancel_scope.cancel()
        assert not scope.cancelled_caught
        hung = pids_in(path)
        assert await eventually(lambda: not any(is_alive(pid) for pid in hung), 1.0)
        slow.delay = 0.0
        with anyio.fail_after(5):
            results = await d.session("s").dispatch(calls)
        assert all(r.status is Status.ok for r in results), [r.content for r in results]
        assert d.statistics().in_use == 0
    finally:
        d.shutdown()
    assert await eventually(lambda: not live_workers(), 2.0)


async def test_the_pool_does_not_hand_out_an_idle_worker_that_died_before_it_was_reaped() -> None:
    """`take()` of a pool whose only idle worker was killed, dead as /proc shows but not yet
    reaped by the forkserver (held stopped), so that `is_alive` still says yes: no worker
    (a new one is to be started), and the dead one is not counted."""
    pool = _pool.ProcessPool()
    worker_ = pool.start()
    try:
        ctx = ProcessContext("c", "pid", "s", 1, 1, 5.0)
        with anyio.fail_after(10):
            reply = await pool.run(worker_, worker.pid_and_clock, {}, ctx, _backend.wait_readable)
        pid = reply["pid"]
        server = _forkserver_pid()
        assert server is not None
        os.kill(server, signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGKILL)
            spin_until_dead(pid)
            assert worker_.process.is_alive()  # not reaped: what `take` must not go by alone
            assert pool.take() is None
            assert pool.alive() == 0
        finally:
            os.kill(server, signal.SIGCONT)
    finally:
        pool.shutdown()


async def test_a_call_sent_to_a_worker_that_had_ended_is_worker_gone_and_nothing_ran() -> None:
    """`run` on a worker that ended before the call reached it (its pipe closed) raises
    WorkerGone, which lets the call go to another worker, rather than a failure of the
    call; the dead worker is not kept."""
    pool = _pool.ProcessPool()
    worker_ = pool.start()
    try:
        pid = worker_.process.pid
        os.kill(pid, signal.SIGKILL)
        spin_until_dead(pid)
        ctx = ProcessContext("c", "pid", "s", 1, 1, 5.0)
        with anyio.fail_after(10), pytest.raises(_pool.WorkerGone):
            await pool.run(worker_, worker.pid_and_clock, {"n": 1}, ctx, _backend.wait_readable)
        assert pool.alive() == 0
    finally:
        pool.shutdown()
