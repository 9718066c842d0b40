"""A call run alone on trio, whose cancel scope is made only once it first waits, is held
to its timeout as a scope around it from the start would hold it, whatever its first step
leaves open: nurseries, scopes closed in a later step, shields, tasks still running,
`nursery.start`, nested invokes; and the caller's cancel scopes are left as they were."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.lowlevel

from dispatcher import Dispatcher, Registry, Status, Tool

from ._fakes import NO_ARGUMENTS, bare_call, handler_dispatcher

# Every test here takes trio's autojump clock: times are exact, and nothing sleeps for real.


@pytest.mark.xfail(
    strict=True,
    reason="on trio a lone call's first step runs with no cancel scope: it reads an effective"
    " deadline of inf, not its timeout's (its waits are still cut at the timeout)",
)
async def test_the_first_step_sees_the_calls_deadline(autojump_clock: Any) -> None:
    """A handler that reads its effective deadline before it first waits sees its timeout,
    as it would inside a cancel scope of that deadline."""
    seen: list[float] = []

    async def sizer(args: Mapping[str, Any], ctx: Any) -> str:
        seen.append(trio.current_effective_deadline() - trio.current_time())
        await trio.sleep(0.5)
        return "sized"

    [result] = await handler_dispatcher(sizer, timeout=2.0).session("s").dispatch([bare_call("sizer")])
    assert result.status is Status.ok
    assert seen == [2.0]


async def test_a_later_step_inside_the_first_steps_scope_sees_the_calls_deadline(autojump_clock: Any) -> None:
    """Inside a scope of its own opened before it first waited, a handler's effective
    deadline is its timeout's, the nearer of the two."""
    seen: list[float] = []

    async def later(args: Mapping[str, Any], ctx: Any) -> str:
        began = trio.current_time()
        with trio.move_on_after(50):
            await trio.sleep(0.25)
            seen.append(trio.current_effective_deadline() - began)
        return "later"

    [result] = await handler_dispatcher(later, timeout=2.0).session("s").dispatch([bare_call("later")])
    assert result.status is Status.ok and seen == [2.0]


async def test_a_scope_entered_in_the_first_step_and_left_in_a_later_one_is_cut(autojump_clock: Any) -> None:
    """A handler that enters a scope by hand before it first waits and leaves it steps
    later, then waits past its timeout, is timed_out at exactly its timeout."""

    async def by_hand(args: Mapping[str, Any], ctx: Any) -> str:
        with contextlib.ExitStack() as stack:
            stack.enter_context(trio.move_on_after(50))
            await trio.sleep(0.5)
            stack.close()  # its own scope goes, ours stays
            await trio.sleep(100)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(by_hand, timeout=2.0).session("s").dispatch([bare_call("by_hand")])
    assert result.status is Status.timed_out and trio.current_time() - began == 2.0


async def test_a_task_started_in_the_first_step_is_cancelled_at_the_timeout(autojump_clock: Any) -> None:
    """A task the first step spawned, still running when the call's timeout comes, is
    cancelled then, at exactly the timeout."""
    stopped: list[float] = []
    began = 0.0

    async def lingering() -> None:
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(trio.current_time() - began)

    async def spawner(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lingering)
            nursery.start_soon(lingering)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(spawner, timeout=3.0).session("s").dispatch([bare_call("spawner")])
    assert result.status is Status.timed_out and stopped == [3.0, 3.0]


async def test_a_nursery_start_in_the_first_step_is_cut_at_the_timeout(autojump_clock: Any) -> None:
    """A handler that awaits `nursery.start` in its first step (its cancel statuses are
    moved by trio as the child starts) is still timed_out at exactly its timeout."""
    stopped: list[float] = []
    began = 0.0

    async def server(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(1)
        task_status.started("up")
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(trio.current_time() - began)

    async def starter(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            assert await nursery.start(server) == "up"
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(starter, timeout=2.5).session("s").dispatch([bare_call("starter")])
    assert result.status is Status.timed_out and stopped == [2.5]


async def test_a_nursery_start_that_never_starts_is_cut_at_the_timeout(autojump_clock: Any) -> None:
    """A child whose `started()` would come after the call's timeout is cancelled at the
    timeout, and the call is timed_out then."""

    async def slow_server(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(10)
        task_status.started()

    async def starter(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            await nursery.start(slow_server)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(starter, timeout=2.0).session("s").dispatch([bare_call("starter")])
    assert result.status is Status.timed_out and trio.current_time() - began == 2.0


async def test_a_call_that_swallows_each_cancellation_is_cut_at_every_wait(autojump_clock: Any) -> None:
    """A handler that swallows its timeout's Cancelled inside its own scope and waits
    again is cancelled again at once, every time, until the cancellation gets out."""
    swallowed: list[float] = []
    began = 0.0

    async def stubborn(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            for _ in range(3):
                try:
                    await trio.sleep(100)
                except trio.Cancelled:
                    swallowed.append(trio.current_time() - began)
            await trio.sleep(100)
        return "late"

    began = trio.current_time()
    [result] = await handler_dispatcher(stubborn, timeout=1.0).session("s").dispatch([bare_call("stubborn")])
    assert result.status is Status.timed_out
    assert swallowed == [1.0, 1.0, 1.0] and trio.current_time() - began == 1.0


async def swallower(args: Mapping[str, Any], ctx: Any) -> str:
    """A handler that swallows its timeout in its own scope and returns without waiting again."""
    with trio.move_on_after(50):
        try:  # noqa: SIM105 - swallowed on purpose: the point of this tool
            await trio.sleep(10)
        except trio.Cancelled:
            pass
    return "late"


async def test_a_call_that_swallows_its_timeout_and_returns_is_late_on_a_real_clock() -> None:
    """On the real clock, a handler that swallows its timeout in its own scope and returns
    without waiting again is timed_out: its value came too late."""
    with trio.fail_after(5):
        [result] = (
            await handler_dispatcher(swallower, timeout=0.05).session("s").dispatch([bare_call("swallower")])
        )
    assert result.status is Status.timed_out, result


async def test_checkpoint_if_cancelled_past_the_deadline_is_cancelled(autojump_clock: Any) -> None:
    """Past its deadline, a handler's `checkpoint_if_cancelled` inside a scope its first
    step opened raises Cancelled, and the call is timed_out at its timeout."""
    raised: list[str] = []

    async def polite(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope(shield=True):
            await trio.sleep(2)  # shielded past its timeout of 1 s
        with trio.move_on_after(50):
            try:
                await trio.lowlevel.checkpoint_if_cancelled()
            except trio.Cancelled:
                raised.append("cancelled")
                raise
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(polite, timeout=1.0).session("s").dispatch([bare_call("polite")])
    assert result.status is Status.timed_out and raised == ["cancelled"]
    assert trio.current_time() - began == 2.0


async def test_the_callers_cancel_status_is_restored_after_each_kind_of_call(autojump_clock: Any) -> None:
    """After calls that return at once, wait, leave scopes open, time out, or fail in their
    own nursery, the caller's task is back on its own cancel status, with its deadline."""

    async def at_once(args: Mapping[str, Any], ctx: Any) -> str:
        return "now"

    async def waits(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        return "waited"

    async def overruns(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope():
            await trio.sleep(100)
        return "never"

    async def breaks(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery():
            await trio.sleep(0.5)
            raise ValueError("broken inside")

    d = handler_dispatcher(at_once, waits, overruns, breaks, timeout=1.0)
    task = trio.lowlevel.current_task()
    with trio.move_on_after(1000) as outer:
        before = task._cancel_status
        for name in ("at_once", "waits", "overruns", "breaks", "at_once"):
            [result] = await d.session(name).dispatch([bare_call(name)])
            assert task._cancel_status is before, name
            assert trio.current_effective_deadline() == outer.deadline
            expected = {"overruns": Status.timed_out, "breaks": Status.failed}.get(name, Status.ok)
            assert result.status is expected, (name, result)
        await trio.lowlevel.checkpoint()
    assert not outer.cancelled_caught


async def test_the_callers_deadline_inside_the_calls_scope_cancels_the_dispatch(autojump_clock: Any) -> None:
    """A caller's deadline nearer than the call's timeout, reached while the call waits in
    a nursery its first step opened, cancels the dispatch (no timed_out result)."""
    stopped: list[float] = []
    began = 0.0

    async def child() -> None:
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(trio.current_time() - began)

    async def grouped(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep(100)
        return "never"

    d = handler_dispatcher(grouped, timeout=10.0)
    began = trio.current_time()
    with trio.move_on_after(1.5) as outer:
        await d.session("s").dispatch([bare_call("grouped")])
    assert outer.cancelled_caught and stopped == [1.5]
    [again] = await d.session("t").dispatch([bare_call("grouped")])
    assert again.status is Status.timed_out and trio.current_time() - began == 11.5


async def test_a_keyboard_interrupt_in_the_calls_nursery_propagates_and_leaves_no_scope(
    autojump_clock: Any,
) -> None:
    """A tool's KeyboardInterrupt raised in its own nursery after it waited propagates from
    the dispatch; the caller's cancel status is intact and the next dispatch works."""

    async def interrupted(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery():
            await trio.sleep(0.5)
            raise KeyboardInterrupt

    async def fine(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        return "fine"

    d = handler_dispatcher(interrupted, fine, timeout=1.0)
    task = trio.lowlevel.current_task()
    before = task._cancel_status
    with pytest.raises(KeyboardInterrupt):
        await d.session("s").dispatch([bare_call("interrupted")])
    assert task._cancel_status is before
    [result] = await d.session("t").dispatch([bare_call("fine")])
    assert result.status is Status.ok


async def test_a_nested_invoke_from_the_calls_scopes_is_cut_at_the_outer_timeout(autojump_clock: Any) -> None:
    """A handler that, inside a nursery and a shield-free scope of its first step, invokes
    a tool that outlasts the handler's timeout is timed_out at the handler's timeout."""
    stopped: list[float] = []
    began = 0.0

    async def inner(args: Mapping[str, Any], ctx: Any) -> str:
        try:
            with trio.move_on_after(80):
                await trio.sleep(100)
        finally:
            stopped.append(trio.current_time() - began)
        return "inner late"

    async def outer(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery():
            with trio.move_on_after(50):
                result = await ctx.invoke("inner", {})
        return f"outer saw {result.content}"

    d = Dispatcher(
        Registry(
            [
                Tool("outer", "The outer tool.", outer, NO_ARGUMENTS, deferred=False, timeout=2.0),
                Tool("inner", "The inner tool.", inner, NO_ARGUMENTS, deferred=False, timeout=30.0),
            ]
        )
    )
    began = trio.current_time()
    [result] = await d.session("s").dispatch([bare_call("outer")])
    assert result.status is Status.timed_out and stopped == [2.0]
    assert trio.current_time() - began == 2.0


async def test_a_nested_invoke_shorter_than_its_caller_is_its_own_timeout(autojump_clock: Any) -> None:
    """A nested call with a shorter timeout than its caller's, invoked inside the caller's
    own scopes, is timed_out at its own timeout and the caller goes on."""

    async def inner(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope():
            await trio.sleep(100)
        return "never"

    async def outer(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            result = await ctx.invoke("inner", {})
            await trio.sleep(0.5)
        return f"outer saw {result.status.value}"

    d = Dispatcher(
        Registry(
            [
                Tool("outer", "The outer tool.", outer, NO_ARGUMENTS, deferred=False, timeout=5.0),
                Tool("inner", "The inner tool.", inner, NO_ARGUMENTS, deferred=False, timeout=1.0),
            ]
        )
    )
    began = trio.current_time()
    [result] = await d.session("s").dispatch([bare_call("outer")])
    assert result.status is Status.ok and result.content == "outer saw timed_out"
    assert trio.current_time() - began == 1.5


async def test_a_shield_around_the_whole_call_keeps_it_past_its_timeout_but_late() -> None:
    """On the real clock, a handler that shields its whole body from its first step returns
    after its timeout: it is timed_out (late), and the next call is not left cancelled."""

    async def shielded(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.15)
        return "late"

    async def after(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.01)
        return "after"

    d = handler_dispatcher(shielded, after, timeout=0.05)
    with trio.fail_after(5):
        [result] = await d.session("s").dispatch([bare_call("shielded")])
        assert result.status is Status.timed_out
        d2 = handler_dispatcher(shielded, after, timeout=1.0)
        [next_result] = await d2.session("t").dispatch([bare_call("after")])
    assert next_result.status is Status.ok


async def test_calls_in_program_order_each_get_their_own_deadline(autojump_clock: Any) -> None:
    """Lone calls run one after another (a writer between readers) each get a deadline of
    their own timeout from their own start, whatever the previous one left."""
    seen: list[float] = []

    async def reader(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            await trio.sleep(0.5)
            seen.append(trio.current_effective_deadline() - trio.current_time())
        return "read"

    d = handler_dispatcher(reader, timeout=2.0)
    for n in range(3):
        [result] = await d.session(f"s{n}").dispatch([bare_call("reader", n)])
        assert result.status is Status.ok
    assert seen == [1.5, 1.5, 1.5]


async def test_a_runner_whose_first_step_opens_a_nursery_is_cut_at_the_timeout(autojump_clock: Any) -> None:
    """A runner standing in for the handler, whose first step opens a nursery and waits, is
    timed_out at the tool's timeout; one that answers at once gives its answer."""
    stopped: list[float] = []
    began = 0.0

    async def never(args: Mapping[str, Any], ctx: Any) -> str:
        raise AssertionError("the runner answers instead")

    async def child() -> None:
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(trio.current_time() - began)

    async def runner(call: Any, ctx: Any) -> str:
        if call.id.endswith("_1"):
            return "answered at once"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep(100)
        return "never"

    registry = Registry([Tool("never", "The never tool.", never, NO_ARGUMENTS, deferred=False, timeout=2.0)])
    d = Dispatcher(registry, runner=runner)
    began = trio.current_time()
    [result] = await d.session("s").dispatch([bare_call("never", 0)])
    assert result.status is Status.timed_out and stopped == [2.0]
    [quick] = await d.session("t").dispatch([bare_call("never", 1)])
    assert quick.status is Status.ok and quick.content == "answered at once"


async def test_a_later_step_that_holds_the_loop_is_reported_and_late() -> None:
    """A lone call whose second step (run through the hand-driven resume) holds the loop
    past its timeout is timed_out and counted as holding the loop."""

    async def hog(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            await trio.sleep(0.01)
            time.sleep(0.3)  # noqa: ASYNC251 - holds the loop, the point of this tool
        return "too late"

    d = Dispatcher(
        Registry([Tool("hog", "The hog tool.", hog, NO_ARGUMENTS, deferred=False, timeout=0.1)]),
        block_threshold=0.05,
    )
    with trio.fail_after(5):
        [result] = await d.session("s").dispatch([bare_call("hog")])
        await trio.sleep(0.05)  # the probe's answer lands just after the step that held the loop
    assert result.status is Status.timed_out
    assert d.statistics().loop_blocks == 1


def _swallower_tool(name: str) -> Tool:
    """`swallower` as a concurrent tool with a timeout of 1 s."""
    return Tool(
        name, f"The {name} tool.", swallower, NO_ARGUMENTS, deferred=False, timeout=1.0, concurrent=True
    )


@pytest.mark.parametrize("calls", [1, 3])
async def test_a_call_that_swallows_its_timeout_is_late_on_a_mock_clock(
    calls: int, autojump_clock: Any
) -> None:
    """On a clock of the loop's own (a MockClock, whose seconds pass without real time), a
    handler that swallows its timeout and returns without waiting again is timed_out all
    the same, alone or in a concurrent group: its value came after its deadline on the
    clock the deadline is kept in, however little real time went by."""
    d = Dispatcher(Registry([_swallower_tool("swallow")]))
    began = trio.current_time()
    results = await d.session("s").dispatch([bare_call("swallow", n) for n in range(calls)])
    assert [r.status for r in results] == [Status.timed_out] * calls, results
    assert trio.current_time() - began == 1.0  # each cut at its timeout, together
