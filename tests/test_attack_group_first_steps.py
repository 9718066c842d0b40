"""A concurrent group on trio starts its calls on the batch's own task, each call's first
step run before any scope or task exists, and opens its task group only once one of them
waits, as if it had been there from the start. Attacked here: whatever that first step
leaves open (its own scopes, nurseries, `nursery.start`), whatever fires in it (its own
timeout, the call's, the caller's), the siblings still run beside it and each call keeps
its own result; no task is spawned for calls that never wait; the limit holds; the
caller's cancel status and nurseries are as they were."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import trio
import trio.lowlevel

from dispatcher import Dispatcher, Registry, Status, Tool, ToolCall

from ._fakes import group_dispatcher, numbered_calls

Handler = Callable[[Mapping[str, Any], Any], Any]

# Every trio test here but the block watch's takes trio's autojump clock: times are exact.


def group(*handlers: Handler, timeout: float = 5.0, limit: int | None = None) -> Dispatcher:
    """A Dispatcher of one concurrent direct tool per handler, named after it, with `timeout`."""
    return group_dispatcher(*handlers, timeout=timeout, limit=limit)


calls = numbered_calls


class Spawns(trio.abc.Instrument):
    """Counts the tasks spawned while it is installed."""

    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


@contextlib.contextmanager
def counting_spawns() -> Any:
    spawns = Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        yield spawns
    finally:
        trio.lowlevel.remove_instrument(spawns)


async def quick(args: Mapping[str, Any], ctx: Any) -> str:
    return "quick"


async def nap(args: Mapping[str, Any], ctx: Any) -> str:
    await trio.sleep(1)
    return "napped"


async def dispatch_where_nothing_is_left(d: Dispatcher, batch: list[ToolCall]) -> list[Any]:
    """Dispatch, then check the caller's task is as it was: its cancel status and nurseries."""
    task = trio.lowlevel.current_task()
    status, nurseries = task._cancel_status, list(task.child_nurseries)
    results = await d.session("s").dispatch(batch)
    assert task._cancel_status is status and task.child_nurseries == nurseries
    return results


async def test_a_group_of_calls_that_never_wait_spawns_no_task(autojump_clock: Any) -> None:
    """Ten calls that return in their first step: ten results in order, no task spawned."""
    d = group(quick)
    with counting_spawns() as spawns:
        results = await dispatch_where_nothing_is_left(d, calls(*["quick"] * 10))
    assert [r.content for r in results] == ["quick"] * 10
    assert [r.call_id for r in results] == [f"c{i}" for i in range(10)]
    assert spawns.spawned == 0


async def test_calls_that_wait_run_side_by_side_up_to_the_limit(autojump_clock: Any) -> None:
    """16 naps of 1 s at limit 3 take ceil(16/3) s, never more than 3 at once, in program
    order; at limit 1 they run one after another on the batch's task, spawning nothing."""
    running, most, order = 0, 0, []

    async def counted(args: Mapping[str, Any], ctx: Any) -> str:
        nonlocal running, most
        order.append(ctx.call_id)
        running += 1
        most = max(most, running)
        await trio.sleep(1)
        running -= 1
        return "napped"

    began = trio.current_time()
    results = await dispatch_where_nothing_is_left(group(counted, limit=3), calls(*["counted"] * 16))
    assert trio.current_time() - began == 6.0 and most == 3
    assert order == [f"c{i}" for i in range(16)]
    assert all(r.status is Status.ok for r in results)

    running, most, order = 0, 0, []
    with counting_spawns() as spawns:
        began = trio.current_time()
        results = await dispatch_where_nothing_is_left(group(counted, limit=1), calls(*["counted"] * 4))
    assert trio.current_time() - began == 4.0 and most == 1 and spawns.spawned == 0
    assert order == ["c0", "c1", "c2", "c3"]


async def test_a_call_whose_own_scope_fires_does_not_cut_its_siblings(autojump_clock: Any) -> None:
    """The first call opens a scope of its own before it first waits, and that scope fires
    at 0.5 s: it ends that call's wait only; the naps beside it (started once it waited,
    in a task group opened beneath that scope) run their whole second."""

    async def own(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(0.5):
            await trio.sleep(10)
        return f"own at {trio.current_time() - began}"

    began = trio.current_time()
    results = await dispatch_where_nothing_is_left(
        group(own, nap, limit=4), calls("own", "nap", "nap", "nap")
    )
    assert [r.content for r in results] == ["own at 0.5", "napped", "napped", "napped"]
    assert trio.current_time() - began == 1.0


async def test_a_call_whose_first_step_leaves_a_nursery_open_is_cut_at_its_timeout_alone(
    autojump_clock: Any,
) -> None:
    """The first call opens a nursery with two tasks that never end: it is timed_out at
    exactly its timeout and both its tasks are cancelled then; its siblings, a nap and a
    quick call, are unharmed, and the task group closes after its nursery."""
    stopped: list[float] = []

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
    results = await dispatch_where_nothing_is_left(
        group(spawner, nap, quick, timeout=3.0), calls("spawner", "nap", "quick")
    )
    assert [r.status for r in results] == [Status.timed_out, Status.ok, Status.ok]
    assert stopped == [3.0, 3.0] and trio.current_time() - began == 3.0


async def test_a_nursery_start_in_a_first_step_beside_siblings(autojump_clock: Any) -> None:
    """A call that awaits `nursery.start` in its first step (trio moves its cancel statuses
    as the child starts) beside naps: the naps end at 1 s, it ends at its timeout."""
    stopped: list[float] = []

    async def server(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(0.5)
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
    results = await dispatch_where_nothing_is_left(
        group(starter, nap, timeout=2.5), calls("starter", "nap", "nap")
    )
    assert [r.status for r in results] == [Status.timed_out, Status.ok, Status.ok]
    assert stopped == [2.5]


async def test_every_call_of_a_group_is_held_to_its_own_timeout(autojump_clock: Any) -> None:
    """Calls that wait forever, each started where it fell (the batch's task, the workers
    beside it, the batch's task again once its own call ended): each is timed_out at
    exactly its own start plus its timeout; the quick ones among them are ok."""
    ended: dict[str, float] = {}

    async def forever(args: Mapping[str, Any], ctx: Any) -> str:
        try:
            await trio.sleep_forever()
        finally:
            ended[ctx.call_id] = trio.current_time() - began
        return "never"

    began = trio.current_time()
    results = await dispatch_where_nothing_is_left(
        group(forever, quick, timeout=2.0, limit=2), calls("forever", "quick", "forever", "forever", "quick")
    )
    assert [r.status for r in results] == [
        Status.timed_out,
        Status.ok,
        Status.timed_out,
        Status.timed_out,
        Status.ok,
    ]
    # limit 2: c0 on the batch's task and c2 on a worker from 0 s, then c3 at 2 s
    assert ended == {"c0": 2.0, "c2": 2.0, "c3": 4.0}


async def test_a_first_step_that_raises_or_is_interrupted_keeps_to_its_own_call(autojump_clock: Any) -> None:
    """A call that raises in its first step, one that raises after it waited, and one that
    swallows its timeout's cancellation and returns late: each its own result, the naps
    beside them ok."""

    async def broken(args: Mapping[str, Any], ctx: Any) -> str:
        raise ValueError("broken at once")

    async def later(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        raise ValueError("broken later")

    async def stubborn(args: Mapping[str, Any], ctx: Any) -> str:
        with contextlib.suppress(trio.Cancelled):
            await trio.sleep(10)
        return "late"

    results = await dispatch_where_nothing_is_left(
        group(broken, later, stubborn, nap, timeout=2.0), calls("broken", "later", "nap", "stubborn", "nap")
    )
    statuses = [r.status for r in results]
    assert statuses == [Status.failed, Status.failed, Status.ok, Status.timed_out, Status.ok]
    assert "broken at once" in results[0].content and "broken later" in results[1].content


async def test_the_callers_scope_cuts_the_whole_group_and_leaves_nothing_open(autojump_clock: Any) -> None:
    """The caller's own deadline comes while the batch's task waits in a call whose first
    step opened a scope, with workers beside it: the dispatch is cancelled, every call's
    task is gone, the caller's cancel status is its own again; the session runs the next."""
    task = trio.lowlevel.current_task()
    status, nurseries = task._cancel_status, list(task.child_nurseries)
    stopped: list[str] = []

    async def scoped(args: Mapping[str, Any], ctx: Any) -> str:
        try:
            with trio.move_on_after(50):
                await trio.sleep(10)
        finally:
            stopped.append(ctx.call_id)
        return "never"

    d = group(scoped, quick)
    s = d.session("s")
    with trio.move_on_after(1.0) as cut:
        await s.dispatch(calls("scoped", "scoped", "quick", "scoped"))
    assert cut.cancelled_caught and trio.current_time() == 1.0
    assert sorted(stopped) == ["c0", "c1", "c3"]
    assert task._cancel_status is status and task.child_nurseries == nurseries
    s.new_run()
    [again] = await s.dispatch(calls("quick"))
    assert again.status is Status.ok


async def test_a_call_of_the_group_that_holds_the_loop_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """A group whose second call holds the loop (a blocking sleep in an async tool, started
    on the batch's own task): the block watch names that call."""

    async def holds(args: Mapping[str, Any], ctx: Any) -> str:
        time.sleep(0.4)  # noqa: ASYNC251 - the fault under test
        return "held"

    tools = [
        Tool(fn.__name__, fn.__name__, fn, {"type": "object"}, deferred=False, concurrent=True)
        for fn in (quick, holds)
    ]
    d = Dispatcher(Registry(tools), block_threshold=0.1)
    s = d.session("s")
    await s.dispatch([ToolCall("warm", "quick", {})])  # the watch's thread is up
    with caplog.at_level(logging.WARNING, logger="threepass.execute"):
        with trio.fail_after(10):
            results = await s.dispatch([ToolCall("q", "quick", {}), ToolCall("h", "holds", {})])
            await trio.sleep(0.1)  # the probe's answer lands just after the step that held the loop
    assert [r.status for r in results] == [Status.ok, Status.ok]
    assert d.statistics().loop_blocks == 1
    [message] = [r.getMessage() for r in caplog.records if "held the event loop" in r.getMessage()]
    assert message.startswith("tool holds (call h) held the event loop")
