"""Never wedged, never killed by a neighbour: worker processes killed at their timeout,
stuck threads listed, a bounded wait for a slot, a tool's BaseExceptions kept to its own
call, and async tools that hold the loop caught."""

from __future__ import annotations

import gc
import logging
import os
import re
import statistics
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import attrs
import pytest

from dispatcher import (
    Dispatcher,
    DispatcherStatistics,
    ProcessContext,
    Registry,
    Status,
    StuckCall,
    Tool,
    ToolCall,
    ToolDefinitionError,
    _backend,
)

from . import _process_tools as worker

LOGGER = "threepass.execute"


def tool(name: str, handler: Any, **kw: Any) -> Tool:
    kw.setdefault("deferred", False)
    return Tool(name, name, handler, **kw)


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and text in r.getMessage()
    ]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event a stuck thread waits on; set at the end so no thread outlives the test."""
    event = threading.Event()
    yield event
    event.set()


# --- process isolation ------------------------------------------------------------------


async def test_a_process_call_past_its_timeout_is_killed_and_its_slot_freed_at_once() -> None:
    """limit 1: a sync handler that never returns, in a worker process, is timed_out (effect
    uncertain, as it writes) at its timeout, and the next call gets the slot at once."""
    reg = Registry(
        [
            tool(
                "hang", worker.sleep_forever, isolation="process", timeout=1.0, writes=lambda a: {"file:/x"}
            ),
            tool("describe", worker.describe_call, isolation="process", timeout=10.0),
        ]
    )
    d = Dispatcher(reg, max_concurrent=1)
    try:
        # the forkserver starts with the first worker (seconds on a loaded machine): start
        # it first, so what is timed below is the kill, not the start
        warm = await d.invoke("describe", {"n": 0})
        assert warm.status is Status.ok, warm.content
        began = time.monotonic()
        with anyio.fail_after(15):
            hang, described = await d.session("s").dispatch(
                [ToolCall("h", "hang", {}), ToolCall("d", "describe", {"n": 1})]
            )
        took = time.monotonic() - began
        assert hang.status is Status.timed_out and hang.effect_uncertain
        assert 1.0 <= hang.duration < 1.5
        assert described.status is Status.ok, described.content
        assert took < 1.0 + 1.5  # the second call waited for no thread: a fresh worker, quickly
        stats = d.statistics()
        assert (stats.in_use, stats.stuck, stats.process_workers) == (0, (), 1)
    finally:
        d.shutdown()
    assert d.statistics().process_workers == 0
    after = await d.invoke("describe", {"n": 2})
    assert after.status is Status.failed and "shut down" in after.content


async def test_a_call_whose_timeout_comes_while_its_worker_starts_is_timed_out_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that takes longer to start than the call's timeout (a loaded machine, the
    forkserver's first start) does not hold the call past it: the call is timed_out at its
    timeout, and the worker, once started, serves the next call rather than being lost."""
    from dispatcher import _pool

    real_start = _pool.ProcessPool.start
    starts: list[float] = []

    def slow_start(self: _pool.ProcessPool) -> Any:
        starts.append(time.monotonic())
        time.sleep(1.2)
        return real_start(self)

    monkeypatch.setattr(_pool.ProcessPool, "start", slow_start)
    reg = Registry([tool("describe", worker.describe_call, isolation="process", timeout=0.3)])
    d = Dispatcher(reg, max_concurrent=1)
    try:
        with anyio.fail_after(15):
            first = await d.invoke("describe", {"n": 1})
        assert first.status is Status.timed_out, first.content
        assert 0.3 <= first.duration < 0.9  # not the 1.2 s the start took
        with anyio.fail_after(15):
            while d.statistics().process_workers == 0:  # noqa: ASYNC110  # the start goes on in its thread
                await anyio.sleep(0.05)
        monkeypatch.setattr(_pool.ProcessPool, "start", real_start)
        second = await d.invoke("describe", {"n": 2})
        assert second.status is Status.ok, second.content
        assert len(starts) == 1  # the second call got the first one's worker
        assert d.statistics().process_workers == 1
    finally:
        d.shutdown()
    assert d.statistics().process_workers == 0


async def test_a_worker_that_finishes_starting_after_shutdown_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose call stopped waiting and whose Dispatcher shut down before it started
    is killed as it arrives: nothing outlives the shutdown."""
    from dispatcher import _pool

    real_start = _pool.ProcessPool.start
    started: list[Any] = []

    def slow_start(self: _pool.ProcessPool) -> Any:
        time.sleep(0.8)
        w = real_start(self)
        started.append(w)
        return w

    monkeypatch.setattr(_pool.ProcessPool, "start", slow_start)
    reg = Registry([tool("describe", worker.describe_call, isolation="process", timeout=0.2)])
    d = Dispatcher(reg, max_concurrent=1)
    with anyio.fail_after(15):
        first = await d.invoke("describe", {"n": 1})
    assert first.status is Status.timed_out, first.content
    d.shutdown()
    with anyio.fail_after(15):
        while not started:  # noqa: ASYNC110  # set by the starting thread
            await anyio.sleep(0.05)
        w = started[0]
        while w.process.is_alive():  # noqa: ASYNC110  # another process
            await anyio.sleep(0.05)
    assert d.statistics().process_workers == 0


async def test_results_errors_and_crashes_cross_the_process_boundary() -> None:
    """A worker's return value, its exceptions (a ToolError keeps `retryable`), a crash
    (os._exit) and an unpicklable result each come back as that call's result; ctx is a
    ProcessContext snapshot of the call."""
    reg = Registry(
        [
            tool("describe", worker.describe_call, timeout=10.0),
            tool("value_error", worker.raise_value_error),
            tool("tool_error", worker.raise_tool_error),
            tool("exit_hard", worker.exit_hard),
            tool("unpicklable", worker.unpicklable_result),
        ],
        isolation="process",
    )
    d = Dispatcher(reg, max_concurrent=1)
    try:
        with anyio.fail_after(15):
            results = await d.session("s9").dispatch(
                [
                    ToolCall("a", "describe", {"n": 2}),
                    ToolCall("b", "value_error", {}),
                    ToolCall("c", "tool_error", {}),
                    ToolCall("d", "exit_hard", {}),
                    ToolCall("e", "unpicklable", {}),
                    ToolCall("f", "describe", {"n": 3}),
                ]
            )
    finally:
        d.shutdown()
    first, value_error, tool_error, crash, unpicklable, last = results
    assert first.status is Status.ok and '"ctx": "ProcessContext"' in first.content
    assert '"call_id": "a"' in first.content and '"session_id": "s9"' in first.content
    assert '"timeout": 10.0' in first.content and '"args": {"n": 2}' in first.content
    assert value_error.status is Status.failed and "ValueError: boom in the worker" in value_error.content
    assert tool_error.status is Status.failed and not tool_error.retryable
    assert "no such row" in tool_error.content
    assert crash.status is Status.failed and "ended without answering (exit code 3)" in crash.content
    assert unpicklable.status is Status.failed and "could not be sent back" in unpicklable.content
    assert last.status is Status.ok  # a new worker stood in for the one that died


def test_registration_refuses_a_process_handler_a_worker_cannot_import() -> None:
    """A lambda, a closure or an async handler with isolation="process" is refused naming why;
    a registry-wide default refuses a closure too, but leaves async handlers on the loop."""

    def closure(args: Mapping[str, Any], ctx: Any) -> str:
        return "x"

    async def on_the_loop(args: Mapping[str, Any], ctx: Any) -> str:
        return "x"

    with pytest.raises(ToolDefinitionError, match="a lambda cannot be imported"):
        Registry([tool("l", lambda args, ctx: "x", isolation="process")])
    with pytest.raises(ToolDefinitionError, match="defined inside a function"):
        Registry([tool("c", closure, isolation="process")])
    with pytest.raises(ToolDefinitionError, match="runs sync handlers"):
        Registry([tool("a", on_the_loop, isolation="process")])
    with pytest.raises(ToolDefinitionError, match="registry's default isolation='process'"):
        Registry([tool("c", closure)], isolation="process")
    reg = Registry([tool("a", on_the_loop), tool("t", closure, isolation="thread")], isolation="process")
    assert not any(reg.registered(name).in_process for name in ("a", "t"))  # type: ignore[union-attr]
    assert ProcessContext("c", "t", "s", 1, 1, 5.0) == ProcessContext("c", "t", "s", 1, 1, 5.0)


# --- stuck threads and the queue limit ----------------------------------------------------


async def test_a_stuck_thread_is_listed_in_statistics_and_warned_about_once(
    gate: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """A sync call past its timeout whose thread runs on is timed_out at once, listed in
    statistics (tool, call id, seconds over) while it holds its slot, warned about once,
    and gone from the list when its thread returns."""
    d = Dispatcher(Registry([tool("stuck", lambda args, ctx: gate.wait(30), timeout=0.05)]), max_concurrent=2)
    assert d.statistics() == DispatcherStatistics(2, 0, 0, (), 0, 0)
    with anyio.fail_after(10):
        [result] = await d.session("s").dispatch([ToolCall("c1", "stuck", {})])
        assert result.status is Status.timed_out
        await anyio.sleep(0.05)
        stats = d.statistics()
        assert stats.in_use == 1
        [stuck] = stats.stuck
        assert (stuck.tool, stuck.call_id) == ("stuck", "c1") and 0.04 <= stuck.seconds_over < 5
        assert isinstance(stuck, StuckCall)
        assert len(warnings_about(caplog, "stuck (call c1) ran past its timeout")) == 1
        gate.set()
        while d.statistics().in_use:  # noqa: ASYNC110 - the thread returns the slot on its own
            await anyio.sleep(0.01)
    assert d.statistics().stuck == ()
    assert len(warnings_about(caplog, "ran past its timeout")) == 1


async def test_a_call_waiting_past_its_queue_limit_is_timed_out_naming_the_holders(
    autojump_clock: Any, gate: threading.Event
) -> None:
    """limit 1, the slot held by a stuck thread: the next call waits its own timeout (the
    default queue limit) for a slot, then ends timed_out naming the holder, not hanging."""
    reg = Registry(
        [
            tool("stuck", lambda args, ctx: gate.wait(30), timeout=1.0),
            tool("next", lambda args, ctx: "ran", timeout=2.0),
        ]
    )
    d = Dispatcher(reg, max_concurrent=1)
    with anyio.fail_after(10):
        stuck, waited = await d.session("s").dispatch(
            [ToolCall("c1", "stuck", {}), ToolCall("c2", "next", {})]
        )
    assert stuck.status is Status.timed_out
    assert waited.status is Status.timed_out and not waited.effect_uncertain
    # the wait is the loop's clock (exact here); how long a holder has run is wall time
    assert re.search(r"waited 2 s for a slot held by: stuck\(c1, running \d+\.\d s\)", waited.content)
    assert waited.duration == 2.0


async def test_the_queue_limit_is_the_dispatchers_when_set(autojump_clock: Any) -> None:
    """Dispatcher(queue_limit=0.5): a call of another session waiting behind an async call
    for the only slot ends timed_out after 0.5 s, naming that call; the holder is unharmed."""

    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(10)
        return "napped"

    d = Dispatcher(Registry([tool("nap", nap, timeout=20)]), max_concurrent=1, queue_limit=0.5)
    got: dict[str, Any] = {}

    async def run(session: str, call_id: str, delay: float) -> None:
        await anyio.sleep(delay)
        [got[call_id]] = await d.session(session).dispatch([ToolCall(call_id, "nap", {})])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", "first", 0)
            tg.start_soon(run, "b", "second", 1)
    assert got["first"].status is Status.ok
    assert got["second"].status is Status.timed_out
    held_by = r"waited 0.5 s for a slot held by: nap\(first, running \d+\.\d s\)"
    assert re.search(held_by, got["second"].content)


# --- BaseExceptions raised by a tool ------------------------------------------------------


class OddBaseException(BaseException):
    """Neither an Exception nor run control."""


async def test_generator_exit_and_odd_base_exceptions_are_that_calls_failure() -> None:
    """GeneratorExit (and any BaseException that is not cancellation, KeyboardInterrupt or
    SystemExit) raised by a tool is its `failed`; its concurrent siblings are ok."""

    async def gen_exit(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)
        raise GeneratorExit

    def odd(args: Mapping[str, Any], ctx: Any) -> str:
        raise OddBaseException("odd")

    async def fine(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.05)
        return "fine"

    reg = Registry(
        [tool(n, h, concurrent=True) for n, h in (("gen_exit", gen_exit), ("odd", odd), ("fine", fine))]
    )
    with anyio.fail_after(10):
        results = (
            await Dispatcher(reg)
            .session("s")
            .dispatch([ToolCall("a", "gen_exit", {}), ToolCall("b", "fine", {}), ToolCall("c", "odd", {})])
        )
    assert [r.status for r in results] == [Status.failed, Status.ok, Status.failed]
    assert "GeneratorExit" in results[0].content and "OddBaseException: odd" in results[2].content


@pytest.mark.parametrize("in_a_thread", [False, True])
async def test_a_tools_keyboard_interrupt_commits_the_group_then_propagates_plainly(
    in_a_thread: bool,
) -> None:
    """A KeyboardInterrupt raised by a tool (async, or sync in its thread): its siblings
    finish, what finished is committed (history), later groups do not start, and a plain
    KeyboardInterrupt propagates."""
    ran: list[str] = []

    async def interrupt(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)
        raise KeyboardInterrupt

    def interrupt_in_a_thread(args: Mapping[str, Any], ctx: Any) -> str:
        raise KeyboardInterrupt

    async def sibling(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.1)
        ran.append("sibling")
        return "finished"

    def later(args: Mapping[str, Any], ctx: Any) -> str:
        ran.append("later")
        return "never"

    reg = Registry(
        [
            tool("interrupt", interrupt_in_a_thread if in_a_thread else interrupt, concurrent=True),
            tool("sibling", sibling, concurrent=True),
            tool("later", later),
        ]
    )
    s = Dispatcher(reg).session("s")
    with anyio.fail_after(10), pytest.raises(BaseException) as caught:
        await s.dispatch(
            [ToolCall("k", "interrupt", {}), ToolCall("b", "sibling", {}), ToolCall("z", "later", {})]
        )
    assert caught.type is KeyboardInterrupt
    assert ran == ["sibling"]
    assert [(e.call.id, e.result.status) for e in s.history] == [("b", Status.ok)]


# --- async tools that hold the loop -------------------------------------------------------


async def test_an_async_tool_that_holds_the_loop_is_caught_and_never_ok_past_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An async handler that calls time.sleep(0.3) with a 0.1 s timeout is timed_out (effect
    uncertain: it writes), logged once with its name and the time, and counted; a sibling
    that behaves is ok."""

    async def blocker(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.3)  # noqa: ASYNC251 - the fault under test
        return "too late"

    async def polite(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)
        return "polite"

    reg = Registry(
        [
            tool("blocker", blocker, concurrent=True, timeout=0.1, writes=lambda a: {"file:/x"}),
            tool("polite", polite, concurrent=True),
        ]
    )
    d = Dispatcher(reg)
    with anyio.fail_after(10):
        first, blocked = await d.session("s").dispatch(
            [ToolCall("p", "polite", {}), ToolCall("b", "blocker", {})]
        )
        await anyio.sleep(0.05)  # the probe's answer lands just after the step that held the loop
    assert first.status is Status.ok
    assert blocked.status is Status.timed_out and blocked.effect_uncertain
    [message] = warnings_about(caplog, "held the event loop")
    assert message.startswith("tool blocker (call b) held the event loop for 0.")
    assert d.statistics().loop_blocks == 1


async def test_a_short_stall_under_the_threshold_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    """An async handler that holds the loop for less than the threshold is ok, unreported."""

    async def brief(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.02)  # noqa: ASYNC251 - the fault under test
        return "brief"

    d = Dispatcher(Registry([tool("brief", brief)]), block_threshold=0.2)
    with anyio.fail_after(10):
        [result] = await d.session("s").dispatch([ToolCall("a", "brief", {})])
    assert result.status is Status.ok
    assert d.statistics().loop_blocks == 0 and not warnings_about(caplog, "held the event loop")


def _watch_threads() -> int:
    return sum(t.name == "threepass-block-watch" for t in threading.enumerate())


async def test_the_dispatchers_of_a_loop_share_one_block_watch(caplog: pytest.LogCaptureFixture) -> None:
    """Thirty dispatchers on one loop start one watch thread between them (one per threshold),
    and a call that holds the loop is counted by its own dispatcher only."""

    async def brief(args: Mapping[str, Any], ctx: Any) -> str:
        return "brief"

    async def holds(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.2)  # noqa: ASYNC251 - the fault under test
        return "held"

    registry = Registry([tool("brief", brief), tool("holds", holds)])
    with anyio.fail_after(20):
        dispatchers = [Dispatcher(registry, block_threshold=0.05) for _ in range(30)]
        before = _watch_threads()
        for d in dispatchers:
            [result] = await d.session("s").dispatch([ToolCall("a", "brief", {})])
            assert result.status is Status.ok
        assert _watch_threads() - before <= 1
        other = Dispatcher(registry, block_threshold=0.5)
        await other.session("s").dispatch([ToolCall("a", "brief", {})])
        assert _watch_threads() - before <= 2
        [held] = await dispatchers[7].session("t").dispatch([ToolCall("b", "holds", {})])
        await anyio.sleep(0.1)  # the probe's answer lands just after the step that held the loop
    assert held.status is Status.ok
    assert [d.statistics().loop_blocks for d in dispatchers] == [int(n == 7) for n in range(30)]
    assert other.statistics().loop_blocks == 0  # its threshold is not reached
    [message] = warnings_about(caplog, "held the event loop")
    assert message.startswith("tool holds (call b) held the event loop for 0.")


async def _watched_session() -> tuple[Any, Any]:
    """A session of a quick async tool that has run one batch, and its loop's block watch."""

    async def brief(args: Mapping[str, Any], ctx: Any) -> str:
        return "brief"

    d = Dispatcher(Registry([tool("brief", brief)]))
    s = d.session("s")
    await s.dispatch([ToolCall("0", "brief", {})])
    assert d.watch.blocking is not None
    return s, d.watch.blocking


async def test_the_block_watch_runs_when_due_beside_a_loop_that_makes_brief_system_calls(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop's thread that runs batch after batch, releasing the GIL only for brief system
    calls (as a recording's write or SQLite does), gives way to the block watch's thread at
    a batch's edge once it is due: the thread runs within milliseconds of each wake. Left
    to race for the GIL, it lost nearly every time and waited a tenth of a second or more,
    while each of those calls woke it in vain."""
    s, watch = await _watched_session()
    lags: list[float] = []
    due = [float("inf")]  # when the watch's thread said it would wake, before its last wait
    running, waiting = watch._running, watch._waiting

    def said(until: float) -> None:  # on the watch's thread, before it waits
        due[0] = until
        waiting(until)

    def timed() -> None:  # on the watch's thread, as it runs again
        if due[0] != float("inf"):
            lags.append(time.monotonic() - due[0])
        running()

    monkeypatch.setattr(watch, "_waiting", said)
    monkeypatch.setattr(watch, "_running", timed)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    # what the worker's earlier tests left on the heap is kept out of the collector's way:
    # a full collection of it holds the loop's thread, and so the watch's, for a third of a
    # second and more (0.38 s was seen), which is no race for the GIL and no turn missed
    gc.freeze()
    try:
        n, until = 0, time.monotonic() + 1.0
        while time.monotonic() < until:  # never yields to the loop: the probe stays unanswered
            n += 1
            s.new_run()  # the call runs again, rather than being served as a repeat
            await s.dispatch([ToolCall(str(n), "brief", {})])
            for _ in range(3):
                os.fstat(fd)
    finally:
        gc.unfreeze()
        os.close(fd)
    # its period is 20 ms: about fifty turns fit in the second; a turn the system ran too
    # late is given way to again a few milliseconds on, rather than left to the race (which
    # costs 100 ms and more each time), so on a busy machine few are lost, and none for long
    assert len(lags) >= 20, sorted(lags)
    assert statistics.median(lags) < 0.01, sorted(lags)


def test_a_helper_that_misses_its_turn_is_given_way_to_again_less_often_until_it_runs() -> None:
    """`GilTurn`: a helper due to wake that does not run (the system runs it too late) is
    waited for at a batch's end, no longer than the give-way; then not at once again, but
    once the retry is due, twice as long after each turn missed, up to the most; when it
    waits again the retries start over, and one that runs meanwhile is not waited for."""
    turn = _backend.GilTurn()
    turn.waiting(time.monotonic() - 1.0)  # due a second ago; nothing runs it
    retry, seen = _backend._RETRY_FIRST, []
    while len(seen) < 8:
        began = time.monotonic()
        turn.take_if_due()
        ended = time.monotonic()
        assert ended - began >= _backend._GIVE_WAY * 0.9  # it was waited for
        due = turn._wake[0]
        seen.append(round(due - ended, 4))
        assert retry * 0.9 <= due - ended <= retry + 0.001, seen
        before = turn._wake
        turn.take_if_due()  # not due yet: nothing waited for, nothing changed
        assert turn._wake is before
        time.sleep(max(0.0, due - time.monotonic()))
        retry = min(2 * retry, _backend._RETRY_MOST)
    assert seen[-1] == seen[-2] == _backend._RETRY_MOST, seen
    turn.waiting(time.monotonic() - 1.0)
    turn.take_if_due()
    assert turn._wake[0] - time.monotonic() <= _backend._RETRY_FIRST  # the retries start over

    turn.waiting(time.monotonic() - 1.0)
    ran = threading.Thread(target=turn.running)
    ran.start()
    ran.join()
    before = turn._wake
    turn.take_if_due()  # it ran: its turn is not missed
    assert turn._wake is before


async def test_the_block_watch_rests_once_the_batches_end_on_a_loop_that_never_yields() -> None:
    """Batches back to back on a loop that never yields (their probe never runs), then the
    loop's thread goes on with other work, never yielding either: the watch's thread,
    with nothing to report, soon stops waking (it would otherwise wait for the GIL beside
    that work for a second)."""
    s, watch = await _watched_session()
    woke: list[float] = []
    running = watch._running

    def counted() -> None:
        woke.append(time.monotonic())
        running()

    watch._running = counted  # type: ignore[method-assign]
    try:
        until = time.monotonic() + 0.2
        while time.monotonic() < until:
            s.new_run()
            await s.dispatch([ToolCall("b", "brief", {})])
        ended = time.monotonic()
        time.sleep(0.5)  # noqa: ASYNC251 - the loop's thread busy with other work
    finally:
        del watch._running
    assert len(woke) >= 3  # it did wake while the batches ran
    assert len([t for t in woke if t > ended + 0.1]) <= 2, [round(t - ended, 3) for t in woke]


async def test_the_block_watch_ends_when_idle_and_a_batch_after_starts_one_again() -> None:
    """Idle a second, the watch's thread ends; the next batch starts one thread again, and
    one about to end that finds a batch begun goes on instead, so no batch runs unwatched."""
    s, watch = await _watched_session()
    assert watch._sampler is not None
    with anyio.fail_after(10):
        while watch._sampler is not None:  # noqa: ASYNC110 - another thread's attribute, no event to wait on
            await anyio.sleep(0.05)
    s.new_run()
    await s.dispatch([ToolCall("b", "brief", {})])
    sampler = watch._sampler
    assert sampler is not None and sampler.is_alive()
    watch._batches += 1  # a batch begun as the thread would end
    try:
        assert watch._retire() is False and watch._sampler is threading.current_thread()
    finally:
        watch._batches -= 1
        watch._sampler = sampler
    assert watch._retire() is True and watch._sampler is None
    watch._sampler = sampler  # the real thread ends on its own


async def test_short_batches_with_pauses_between_keep_one_watch_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches that come and go, with pauses of a few milliseconds between them, for longer
    than the second after which an idle watch thread ends: the thread sees them come and
    go, and goes on; none is started again."""
    starts: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        starts.append(self.name)
        start(self)

    s, watch = await _watched_session()
    monkeypatch.setattr(threading.Thread, "start", counted)
    until = time.monotonic() + 1.6
    while time.monotonic() < until:
        s.new_run()
        await s.dispatch([ToolCall("b", "brief", {})])
        await anyio.sleep(0.01)
    assert "threepass-block-watch" not in starts and watch._sampler is not None


async def test_a_call_that_holds_the_loop_around_another_dispatchers_batches_is_caught(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tool that holds the loop while it awaits batches of another dispatcher on the same
    loop (which share its watch, and end without yielding): the ends of those nested
    batches do not count as the loop let go, and the call is reported."""

    async def brief(args: Mapping[str, Any], ctx: Any) -> str:
        return "brief"

    inner = Dispatcher(Registry([tool("brief", brief)]), block_threshold=0.1)

    async def agent(args: Mapping[str, Any], ctx: Any) -> str:
        for _ in range(30):
            time.sleep(0.01)  # noqa: ASYNC251 - the fault under test
            await inner.invoke("brief", {})
        return "done"

    d = Dispatcher(Registry([tool("agent", agent)]), block_threshold=0.1)
    with anyio.fail_after(10):
        [result] = await d.session("s").dispatch([ToolCall("a", "agent", {})])
        await anyio.sleep(0.1)  # the probe's answer lands just after the step that held the loop
    assert result.status is Status.ok
    assert d.statistics().loop_blocks == 1 and inner.statistics().loop_blocks == 0
    [message] = warnings_about(caplog, "held the event loop")
    assert message.startswith("tool agent (call a) held the event loop for 0.")


async def test_a_hold_under_its_own_dispatchers_threshold_is_not_reported_by_a_stricter_watch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two dispatchers on one loop, thresholds 0.1 s and 0.5 s: the stricter one's watch sees
    the other's call hold the loop for 0.3 s, which is under that call's own threshold, and
    nothing is reported."""

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(1.0)  # keeps the stricter watch's batch running
        return "slow"

    async def holds(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.3)  # noqa: ASYNC251 - the fault under test
        return "held"

    strict = Dispatcher(Registry([tool("slow", slow)]), block_threshold=0.1)
    lax = Dispatcher(Registry([tool("holds", holds)]), block_threshold=0.5)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(strict.invoke, "slow", {})
            await anyio.sleep(0.1)
            assert (await lax.invoke("holds", {})).status is Status.ok
            await anyio.sleep(0.1)  # the probe's answer lands just after the step that held the loop
    assert lax.statistics().loop_blocks == 0 and strict.statistics().loop_blocks == 0
    assert not warnings_about(caplog, "held the event loop")


def test_statistics_is_a_frozen_value() -> None:
    """Dispatcher.statistics() is a frozen snapshot: limit, slots in use, waiting, stuck calls,
    loop blocks, worker processes."""
    stats = Dispatcher(Registry(), max_concurrent=4).statistics()
    assert stats == DispatcherStatistics(
        limit=4, in_use=0, waiting=0, stuck=(), loop_blocks=0, process_workers=0
    )
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.limit = 5  # type: ignore[misc]


async def test_a_dispatcher_shut_down_before_any_process_call_starts_no_workers() -> None:
    """shutdown() before the pool started: a process call fails saying so, no worker starts."""
    d = Dispatcher(Registry([tool("describe", worker.describe_call, isolation="process")]))
    d.shutdown()
    result = await d.invoke("describe", {})
    assert result.status is Status.failed and "shut down" in result.content
    assert d.statistics().process_workers == 0


async def test_shutdown_during_a_process_call_fails_that_call_at_once() -> None:
    """shutdown() while a process call runs: its worker is killed and the call fails now,
    not at its timeout."""
    d = Dispatcher(Registry([tool("hang", worker.sleep_forever, isolation="process", timeout=30)]))
    got: list[Any] = []

    async def call() -> None:
        got.append(await d.invoke("hang", {}))

    began = time.monotonic()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            while not d.statistics().process_workers:  # noqa: ASYNC110 - the worker starts on its own
                await anyio.sleep(0.01)
            await anyio.sleep(0.1)
            d.shutdown()
    [result] = got
    assert result.status is Status.failed and "ended without answering (killed by SIGKILL)" in result.content
    assert time.monotonic() - began < 5


def test_a_loops_shared_block_watch_does_not_keep_the_loop_alive() -> None:
    """asyncio loops that ran a batch and closed are collected: the watch kept for each holds
    its loop's poster weakly (else every `asyncio.run` would leave its loop behind)."""
    import asyncio
    import gc
    import weakref

    async def brief(args: Mapping[str, Any], ctx: Any) -> str:
        return "brief"

    registry = Registry([tool("brief", brief)])
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        [result] = await Dispatcher(registry).session("s").dispatch([ToolCall("a", "brief", {})])
        assert result.status is Status.ok

    for _ in range(3):
        asyncio.run(one())
    gc.collect()
    assert [ref() for ref in loops] == [None, None, None]
