"""A call run alone is held to its timeout exactly as a cancel scope around it would hold
it, whether it returns before it first waits (no scope is made for it), waits (its scope
is made then), or opens cancel scopes, task groups or shields of its own before it waits
(its scope is made beneath theirs, so they still close first)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import trio
import trio.lowlevel

from dispatcher import Status

from ._fakes import bare_call, handler_dispatcher

# The tests that wait take trio's autojump clock: times are exact, and nothing sleeps for real.


async def test_a_call_that_never_waits_returns_its_value(autojump_clock: Any) -> None:
    """A handler that returns before it first waits gives its value, as any other."""

    async def quick(args: Mapping[str, Any], ctx: Any) -> str:
        return f"quick {ctx.call_id}"

    [result] = await handler_dispatcher(quick).session("s").dispatch([bare_call("quick")])
    assert result.status is Status.ok and result.content == "quick call_quick_0"


async def test_a_call_that_waits_past_its_timeout_is_cut_at_it(autojump_clock: Any) -> None:
    """A handler that sleeps past its timeout is timed_out at exactly its timeout."""

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.lowlevel.checkpoint()  # a first wait that is over at once
        await trio.sleep(100)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(slow, timeout=2.0).session("s").dispatch([bare_call("slow")])
    assert result.status is Status.timed_out
    assert trio.current_time() - began == 2.0


async def test_a_call_whose_first_step_outlasts_its_timeout_is_late() -> None:
    """A handler that holds the loop past its timeout before it ever waits is timed_out:
    what it returns came too late to count."""

    async def hog(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.08)  # noqa: ASYNC251 - work that holds the loop, past the timeout of 0.05 s
        return "too late"

    [result] = await handler_dispatcher(hog, timeout=0.05).session("s").dispatch([bare_call("hog")])
    assert result.status is Status.timed_out, result


async def test_a_call_inside_its_own_scope_is_still_cut_at_its_timeout(autojump_clock: Any) -> None:
    """A handler that opens a cancel scope of its own, then waits in it past its timeout, is
    timed_out at its timeout; its scope closes cleanly (no misnested scope)."""

    async def scoped(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            await trio.sleep(100)
        return "its own scope ended it"

    d = handler_dispatcher(scoped, timeout=2.0)
    began = trio.current_time()
    [result] = await d.session("s").dispatch([bare_call("scoped")])
    assert result.status is Status.timed_out, result
    assert trio.current_time() - began == 2.0
    began = trio.current_time()  # a second call of it: held by a scope from the start
    [again] = await d.session("s").dispatch([bare_call("scoped", 1)])
    assert again.status is Status.timed_out and trio.current_time() - began == 2.0


async def test_a_call_whose_own_scope_ends_first_keeps_its_result(autojump_clock: Any) -> None:
    """A handler's own scope that ends before the timeout ends just its own wait: the call
    goes on and returns ok."""

    async def patient(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(1):
            await trio.sleep(100)
        await trio.sleep(0.5)
        return "done after its own timeout"

    began = trio.current_time()
    [result] = await handler_dispatcher(patient, timeout=5.0).session("s").dispatch([bare_call("patient")])
    assert result.status is Status.ok and result.content == "done after its own timeout"
    assert trio.current_time() - began == 1.5


async def test_a_call_with_its_own_task_group_is_cut_and_its_children_stop(autojump_clock: Any) -> None:
    """A handler that starts a task group in its first step and waits in it past its
    timeout is timed_out at its timeout, and the tasks it started are cancelled."""
    finished: list[str] = []

    async def child() -> None:
        try:
            await trio.sleep(100)
        finally:
            finished.append("child unwound")

    async def grouped(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep(100)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(grouped, timeout=3.0).session("s").dispatch([bare_call("grouped")])
    assert result.status is Status.timed_out
    assert trio.current_time() - began == 3.0
    assert finished == ["child unwound"]


async def test_a_shield_of_the_call_holds_off_its_timeout(autojump_clock: Any) -> None:
    """A handler that shields a wait from cancellation keeps it, timeout or not: its
    timeout cuts the first wait after the shield closes, as an outer scope would."""
    log: list[str] = []

    async def shielded(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope(shield=True):
            await trio.sleep(4)
            log.append(f"shielded wait over at {trio.current_time() - began:g}")
        await trio.sleep(100)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(shielded, timeout=1.0).session("s").dispatch([bare_call("shielded")])
    assert log == ["shielded wait over at 4"]
    assert result.status is Status.timed_out
    assert trio.current_time() - began == 4.0


async def test_a_call_that_swallows_its_timeout_in_its_scope_is_still_late(autojump_clock: Any) -> None:
    """A handler that catches the cancellation in its own scope and returns a value after
    its timeout is timed_out, never ok."""

    async def stubborn(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            try:  # noqa: SIM105 - swallowed on purpose: the point of this tool
                await trio.sleep(100)
            except trio.Cancelled:
                pass
            await trio.lowlevel.checkpoint()
        return "returned anyway"

    [result] = await handler_dispatcher(stubborn, timeout=2.0).session("s").dispatch([bare_call("stubborn")])
    assert result.status is Status.timed_out, result


async def test_a_failure_inside_the_calls_own_scope_is_its_result(autojump_clock: Any) -> None:
    """A handler that raises after waiting inside its own scope fails alone, with its error."""

    async def broken(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            await trio.sleep(1)
            raise ValueError("broke while waiting")

    [result] = await handler_dispatcher(broken).session("s").dispatch([bare_call("broken")])
    assert result.status is Status.failed and "broke while waiting" in result.content


async def test_the_callers_cancellation_is_never_a_timeout(autojump_clock: Any) -> None:
    """Cancelling the dispatch while a call waits inside its own scope cancels the dispatch:
    it is not reported as the call's timeout."""
    unwound: list[str] = []

    async def waiting(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            try:
                await trio.sleep(100)
            finally:
                unwound.append("unwound")
        return "never"

    d = handler_dispatcher(waiting, timeout=10.0)
    with trio.move_on_after(1) as outer:
        await d.session("s").dispatch([bare_call("waiting")])
    assert outer.cancelled_caught and unwound == ["unwound"]


async def test_a_call_that_waits_and_then_returns_is_ok(autojump_clock: Any) -> None:
    """A handler that waits inside its own scope and returns in time gives its value."""

    async def steady(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.fail_after(50):
            for _ in range(3):
                await trio.sleep(0.25)
        return "steady"

    began = trio.current_time()
    [result] = await handler_dispatcher(steady, timeout=2.0).session("s").dispatch([bare_call("steady")])
    assert result.status is Status.ok and result.content == "steady"
    assert trio.current_time() - began == 0.75


async def test_a_call_that_closes_its_scope_before_it_waits_is_cut_at_its_timeout(
    autojump_clock: Any,
) -> None:
    """A handler whose first step opens and closes a scope of its own, then waits past its
    timeout, is timed_out at its timeout."""

    async def tidy(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):  # noqa: ASYNC100 - opened and closed before the first wait
            pass
        await trio.sleep(100)
        return "never"

    began = trio.current_time()
    [result] = await handler_dispatcher(tidy, timeout=2.0).session("s").dispatch([bare_call("tidy")])
    assert result.status is Status.timed_out and trio.current_time() - began == 2.0


async def test_a_failing_child_of_the_calls_task_group_fails_the_call(autojump_clock: Any) -> None:
    """A task the handler started in its first step that raises fails the call alone."""

    async def child() -> None:
        await trio.sleep(1)
        raise RuntimeError("the child broke")

    async def parent(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep(100)
        return "never"

    async def quick(args: Mapping[str, Any], ctx: Any) -> str:
        return "sibling ok"

    d = handler_dispatcher(parent, quick, timeout=10.0)
    results = await d.session("s").dispatch([bare_call("parent"), bare_call("quick")])
    assert results[0].status is Status.failed and "the child broke" in results[0].content
    assert results[1].content == "sibling ok"


async def test_a_call_that_invokes_another_from_its_own_scope_gets_its_result(autojump_clock: Any) -> None:
    """A handler that opens a scope and, inside it, invokes another tool (run alone, on the
    caller's slot) gets that tool's result, and both scopes close in order."""

    async def inner(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        return "inner result"

    async def outer(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            result = await ctx.invoke("inner", {})
            await trio.sleep(0.25)
        return f"outer saw {result.content}"

    began = trio.current_time()
    [result] = await handler_dispatcher(outer, inner, timeout=5.0).session("s").dispatch([bare_call("outer")])
    assert result.status is Status.ok and result.content == "outer saw inner result"
    assert trio.current_time() - began == 0.75


async def test_an_anyio_task_group_in_the_call_is_cut_at_its_timeout(autojump_clock: Any) -> None:
    """A handler written on anyio whose first step opens a task group is timed_out at its
    timeout, its tasks cancelled."""
    import anyio

    stopped: list[str] = []

    async def napper() -> None:
        try:
            await anyio.sleep(100)
        finally:
            stopped.append("napper")

    async def anyio_tool(args: Mapping[str, Any], ctx: Any) -> str:
        async with anyio.create_task_group() as tg:
            tg.start_soon(napper)
            with anyio.fail_after(60):
                await anyio.sleep(100)
        return "never"

    began = trio.current_time()
    [result] = (
        await handler_dispatcher(anyio_tool, timeout=1.5).session("s").dispatch([bare_call("anyio_tool")])
    )
    assert result.status is Status.timed_out and trio.current_time() - began == 1.5
    assert stopped == ["napper"]
