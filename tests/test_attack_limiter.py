"""The limiter's bound holds while the workers of a concurrent group keep their slot
between calls: across sessions and batches at once, with timeouts, cancellation, hook
blocks, interrupts and sync calls in threads mixed in; every slot comes back; and a batch
that waits for a slot gets one as soon as a call ends, not when a whole group does."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

from dispatcher import Dispatcher, DispatchInterrupted, HookBlocked, Registry, Status, Tool, ToolCall

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "number"}, "k": {"type": "string"}}}


class InFlight:
    """Counts the calls running at once, measured inside the tools (threads included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def exit(self) -> None:
        with self._lock:
            self.now -= 1


def _tool(name: str, handler: Any, *, timeout: float = 5.0) -> Tool:
    return Tool(name, f"The {name} tool.", handler, SCHEMA, deferred=False, concurrent=True, timeout=timeout)


def _call(name: str, n: float, tag: str = "") -> dict[str, Any]:
    """A call with id `call_<name>_<tag>`: distinct tags make distinct calls (a batch runs
    a repeated call once)."""
    return {
        "id": f"call_{name}_{tag}",
        "type": "function",
        "function": {"name": name, "arguments": f'{{"n": {n}, "k": "{tag}"}}'},
    }


def _tools(flight: InFlight) -> list[Tool]:
    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        flight.enter()
        try:
            await anyio.sleep(args["n"])
        finally:
            flight.exit()
        return "napped"

    async def quick(args: Mapping[str, Any], ctx: Any) -> str:
        flight.enter()
        flight.exit()
        return "quick"

    def block(args: Mapping[str, Any], ctx: Any) -> str:
        flight.enter()
        try:
            time.sleep(args["n"])
        finally:
            flight.exit()
        return "blocked"

    async def broken(args: Mapping[str, Any], ctx: Any) -> str:
        flight.enter()
        try:
            await anyio.sleep(args["n"])
        finally:
            flight.exit()
        raise ValueError("broken")

    return [
        _tool("nap", nap),
        _tool("quick", quick),
        _tool("block", block, timeout=0.2),
        _tool("broken", broken),
        _tool("slow", nap, timeout=0.1),
    ]


async def _all_slots_back(d: Dispatcher, within: float = 3.0) -> None:
    with anyio.fail_after(within):
        while d.statistics().in_use:  # noqa: ASYNC110 - a thread gives its slot back, no event to wait on
            await anyio.sleep(0.01)


async def test_two_sessions_two_batches_never_run_more_than_the_limit() -> None:
    """Two sessions dispatching mixed groups at once (sleeps, quick calls, threads, failures,
    timeouts) never have more calls in flight than the limit; every slot comes back."""
    flight = InFlight()
    d = Dispatcher(Registry(_tools(flight)), max_concurrent=3)
    results: dict[str, list[Any]] = {}

    async def batch(session: str) -> None:
        calls = []
        for i in range(6):
            calls += [_call("nap", 0.01 * (i % 3 + 1), f"{session}{i}"), _call("quick", i, f"{session}{i}")]
        calls += [_call("block", 0.02, session), _call("broken", 0.01, session), _call("slow", 5, session)]
        results[session] = await d.session(session).dispatch(calls)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for session in ("a", "b"):
                tg.start_soon(batch, session)
    assert flight.most <= 3 and flight.most >= 2
    for got in results.values():
        assert [r.status for r in got[-3:]] == [Status.ok, Status.failed, Status.timed_out]
        assert {r.status for r in got[:-3]} == {Status.ok}
    await _all_slots_back(d)


async def test_a_waiting_batch_is_not_starved_by_many_quick_calls() -> None:
    """A batch that waits for a slot while another batch's group of many short calls holds
    them all starts within about one call, not after the whole group."""
    flight = InFlight()
    d = Dispatcher(Registry(_tools(flight)), max_concurrent=2)
    began: list[float] = []

    async def long_group() -> None:
        await d.session("many").dispatch([_call("nap", 0.02, f"x{i}") for i in range(40)])

    async def latecomer() -> None:
        await anyio.sleep(0.05)
        asked = time.monotonic()
        [result] = await d.session("late").dispatch([_call("nap", 0.0)])
        assert result.status is Status.ok
        began.append(time.monotonic() - asked)

    with anyio.fail_after(10):
        start = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_group)
            tg.start_soon(latecomer)
        whole = time.monotonic() - start
    assert whole >= 0.4  # 40 calls of 20 ms, two at a time
    assert began and began[0] < 0.15, began
    assert flight.most <= 2
    await _all_slots_back(d)


async def test_slots_come_back_after_the_batch_is_cancelled() -> None:
    """Cancelling a batch whose workers keep their slots between calls gives every slot
    back, and the next batch may use them all."""
    flight = InFlight()
    d = Dispatcher(Registry(_tools(flight)), max_concurrent=3)
    with anyio.move_on_after(0.1) as scope:
        await d.session("s").dispatch([_call("nap", 0.03, f"c{i}") for i in range(30)])
    assert scope.cancelled_caught
    await _all_slots_back(d)
    flight.most = 0
    with anyio.fail_after(5):
        results = await d.session("t").dispatch([_call("nap", 0.05, f"d{i}") for i in range(3)])
    assert {r.status for r in results} == {Status.ok} and flight.most == 3


async def test_slots_come_back_after_a_stuck_thread_returns() -> None:
    """A sync call past its timeout is reported at once and its thread holds its slot
    (statistics show it) until it returns; then no slot is left in use."""
    flight = InFlight()
    d = Dispatcher(Registry(_tools(flight)), max_concurrent=2)
    with anyio.fail_after(5):
        results = await d.session("s").dispatch(
            [_call("quick", 1, "1"), _call("block", 0.6), _call("quick", 2, "2"), _call("nap", 0.01)]
        )
        assert [r.status for r in results] == [Status.ok, Status.timed_out, Status.ok, Status.ok]
        stats = d.statistics()
        assert stats.in_use == 1 and len(stats.stuck) == 1
    await _all_slots_back(d)
    assert d.statistics().stuck == ()


async def test_slots_come_back_after_hook_blocks_and_interrupts() -> None:
    """A group whose before hook blocks some calls, or whose tool raises KeyboardInterrupt
    or DispatchInterrupted, leaves no slot in use; each propagates."""
    flight = InFlight()

    class Refuse:
        def before(self, call: ToolCall, ctx: Any) -> None:
            if "_h3" in call.id:
                raise HookBlocked("not this one")

    async def interrupt(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(args["n"])
        raise KeyboardInterrupt

    async def ask(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(args["n"])
        raise DispatchInterrupted([(ToolCall(ctx.call_id, ctx.tool_name, {}), "ask first", None)])

    tools = [*_tools(flight), _tool("interrupt", interrupt), _tool("ask", ask)]
    d = Dispatcher(Registry(tools), max_concurrent=2, hooks=[Refuse()])
    with anyio.fail_after(5):
        with pytest.raises(HookBlocked):
            await d.session("s").dispatch([_call("nap", 0.01, f"h{i}") for i in range(6)])
        await _all_slots_back(d)
        with pytest.raises(KeyboardInterrupt):
            await d.session("t").dispatch(
                [_call("nap", 0.01, "k1"), _call("interrupt", 0.02), _call("nap", 0.01, "k2")]
            )
        await _all_slots_back(d)
        with pytest.raises(DispatchInterrupted):
            await d.session("u").dispatch(
                [_call("nap", 0.01, "i1"), _call("ask", 0.02), _call("quick", 0, "i2")]
            )
        await _all_slots_back(d)
    assert flight.most <= 2


async def _another_session_runs_while_the_hook_waits(
    flight: InFlight, hook: Any, hook_over: anyio.Event, other_done: anyio.Event
) -> None:
    """Session s runs a quick call then a nap at a limit of one, `hook` holding things up
    until another session's call is done (1 s at most); that call must get the slot and
    finish while the hook still waits, and every slot comes back."""
    d = Dispatcher(Registry(_tools(flight)), max_concurrent=1, hooks=[hook], queue_limit=0.5)
    seen: list[tuple[Status, bool]] = []

    async def other() -> None:
        await anyio.sleep(0.2)
        [result] = await d.session("other").dispatch([_call("nap", 0.0, "b")])
        seen.append((result.status, hook_over.is_set()))
        other_done.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(d.session("s").dispatch, [_call("quick", 1, "a1"), _call("nap", 0.01, "a2")])
            tg.start_soon(other)
    assert seen == [(Status.ok, False)], seen
    await _all_slots_back(d)


async def test_a_slot_is_not_kept_while_a_before_hook_waits() -> None:
    """While the next call's before hook waits (an approval, say), its worker holds no slot:
    another session's call that needs one runs at once instead of waiting for the hook."""
    flight = InFlight()
    hook_over, other_done = anyio.Event(), anyio.Event()

    class SlowApproval:
        async def before(self, call: ToolCall, ctx: Any) -> None:
            if "_a2" in call.id:
                # waits until the other call has its result, and 1 s at most: past the other
                # call's queue limit, so a slot kept meanwhile would time it out
                with anyio.move_on_after(1.0):
                    await other_done.wait()
                hook_over.set()

    await _another_session_runs_while_the_hook_waits(flight, SlowApproval(), hook_over, other_done)


async def test_a_slot_is_not_kept_while_an_after_hook_waits() -> None:
    """While a finished call's after hook waits, its worker holds no slot: another session's
    call runs meanwhile."""
    flight = InFlight()
    hook_over, other_done = anyio.Event(), anyio.Event()

    class SlowAudit:
        async def after(self, call: ToolCall, result: Any, ctx: Any) -> None:
            if call.id == "call_quick_a1":
                with anyio.move_on_after(1.0):  # as the before hook above waits
                    await other_done.wait()
                hook_over.set()

    await _another_session_runs_while_the_hook_waits(flight, SlowAudit(), hook_over, other_done)
