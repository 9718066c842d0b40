"""On asyncio, a CancelledError a tool raises itself (it awaited a future or task that
something else cancelled) is that call's failure; a cancellation of the batch is not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cache import CachePolicy, MemoryResultCache
from dispatcher import CacheEntry, Dispatcher, Registry, Status, Tool

from ._fakes import NO_ARGUMENTS, TEXT_SCHEMA, call

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])


async def _awaits_a_cancelled_future(args: Mapping[str, Any], ctx: Any) -> str:
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    return str(await future)


async def _awaits_a_cancelled_task(args: Mapping[str, Any], ctx: Any) -> str:
    task = asyncio.create_task(asyncio.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    await task
    return "not cancelled"


async def _raises_it(args: Mapping[str, Any], ctx: Any) -> str:
    raise asyncio.CancelledError


def _raises_it_in_a_thread(args: Mapping[str, Any], ctx: Any) -> str:
    raise asyncio.CancelledError


async def _echo(args: Mapping[str, Any], ctx: Any) -> str:
    await anyio.lowlevel.checkpoint()
    return str(args["text"])


async def _naps(args: Mapping[str, Any], ctx: Any) -> str:
    await anyio.sleep(10)
    return "woke"


_CULPRITS = {
    "future": _awaits_a_cancelled_future,
    "task": _awaits_a_cancelled_task,
    "raises": _raises_it,
    "thread": _raises_it_in_a_thread,
}


def _dispatcher(*, concurrent: bool, timeout: float = 30.0) -> Dispatcher:
    tools = [
        Tool(name, "Cancelled inside.", fn, NO_ARGUMENTS, concurrent=concurrent, deferred=False)
        for name, fn in _CULPRITS.items()
    ]
    tools.append(Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=concurrent, deferred=False))
    tools.append(Tool("naps", "Naps.", _naps, NO_ARGUMENTS, concurrent=concurrent, deferred=False))
    return Dispatcher(Registry(tools), timeout=timeout)


@pytest.mark.parametrize("culprit", sorted(_CULPRITS))
@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_call_alone_that_raises_cancelled_error_itself_fails(culprit: str, concurrent: bool) -> None:
    """A batch of one such call returns its failure, naming CancelledError; the session goes on."""
    s = _dispatcher(concurrent=concurrent).session("alone", mode="direct")
    with anyio.fail_after(10):
        [result] = await s.dispatch([call("1", culprit)])
        assert result.status is Status.failed, result
        assert "CancelledError" in result.content
        [after] = await s.dispatch([call("2", "echo", text="still here")])
    assert (after.status, after.content) == (Status.ok, "still here")


@pytest.mark.parametrize("culprit", sorted(_CULPRITS))
@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_call_that_raises_cancelled_error_itself_leaves_its_siblings_their_results(
    culprit: str, concurrent: bool
) -> None:
    """Among siblings (run together or in turn) the call fails and every other call keeps its result."""
    s = _dispatcher(concurrent=concurrent).session("siblings", mode="direct")
    batch = [call("a", "echo", text="before"), call("b", culprit), call("c", "echo", text="after")]
    batch += [call(f"d{n}", "echo", text=str(n)) for n in range(4)]
    with anyio.fail_after(10):
        results = await s.dispatch(batch)
    assert [r.call_id for r in results] == [c.id for c in batch]
    assert results[1].status is Status.failed and "CancelledError" in results[1].content
    assert [r.content for r in results if r.call_id != "b"] == ["before", "after", "0", "1", "2", "3"]
    assert all(r.status is Status.ok for r in results if r.call_id != "b")


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_cancelled_batch_still_raises_cancellation(concurrent: bool) -> None:
    """A batch cancelled from outside (a scope's deadline) still ends in cancellation, not results."""
    s = _dispatcher(concurrent=concurrent).session("outside", mode="direct")
    with anyio.move_on_after(0.2) as scope:
        await s.dispatch([call("1", "naps"), call("2", "naps")])
        pytest.fail("the batch returned through its cancellation")
    assert scope.cancelled_caught
    [after] = await s.dispatch([call("3", "echo", text="next")])
    assert after.status is Status.ok


async def test_a_task_cancelled_while_its_batch_runs_is_cancelled() -> None:
    """`task.cancel()` on the task awaiting dispatch cancels it, CancelledError and all."""
    s = _dispatcher(concurrent=True).session("task", mode="direct")
    task = asyncio.create_task(s.dispatch([call("1", "naps"), call("2", "future")]))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_call_past_its_timeout_still_times_out(concurrent: bool) -> None:
    """The timeout's own cancellation is a timeout, as before."""
    s = _dispatcher(concurrent=concurrent, timeout=0.05).session("late", mode="direct")
    with anyio.fail_after(10):
        [late, fine] = await s.dispatch([call("1", "naps"), call("2", "echo", text="x")])
    assert late.status is Status.timed_out
    assert fine.status is Status.ok


class _CancelledInside:
    """A hook whose `before` (or `after`) awaits a future something else cancelled."""

    def __init__(self, where: str) -> None:
        self.where = where

    async def before(self, call: Any, ctx: Any) -> None:
        if self.where == "before" and call.name == "echo" and call.arguments["text"] == "odd":
            await _awaits_a_cancelled_future({}, ctx)

    async def after(self, call: Any, result: Any, ctx: Any) -> None:
        if self.where == "after" and call.name == "echo" and call.arguments["text"] == "odd":
            await _awaits_a_cancelled_future({}, ctx)


@pytest.mark.parametrize("where", ["before", "after"])
async def test_a_hook_that_raises_cancelled_error_itself_is_a_faulty_hook(where: str) -> None:
    """A before hook's own CancelledError fails its call unrun; an after hook's leaves the result."""
    d = Dispatcher(
        Registry([Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False)]),
        hooks=[_CancelledInside(where)],
    )
    s = d.session("hooks", mode="direct")
    with anyio.fail_after(10):
        results = await s.dispatch([call(str(n), "echo", text="odd" if n == 1 else str(n)) for n in range(4)])
    odd = results[1]
    if where == "before":
        assert (
            odd.status is Status.failed and "before hook" in odd.content and "CancelledError" in odd.content
        )
    else:
        assert (odd.status, odd.content) == (Status.ok, "odd")
    assert [(r.status, r.content) for r in results if r.call_id != "1"] == [
        (Status.ok, "0"),
        (Status.ok, "2"),
        (Status.ok, "3"),
    ]


class _StoreCancelledInside(MemoryResultCache):
    """The memory store, but the named method awaits a future something else cancelled."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    async def _maybe(self, name: str) -> None:
        if name == self.broken:
            await _awaits_a_cancelled_future({}, None)

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        await self._maybe("get_many")
        return await super().get_many(keys)

    async def set_many(self, *args: Any, **kwargs: Any) -> None:
        await self._maybe("set_many")
        await super().set_many(*args, **kwargs)

    async def epoch(self) -> int:
        await self._maybe("epoch")
        return await super().epoch()

    async def moved_since(self, epoch: int) -> frozenset[str] | None:
        await self._maybe("moved_since")
        return await super().moved_since(epoch)


@pytest.mark.parametrize("broken", ["get_many", "set_many", "epoch", "moved_since"])
async def test_a_result_cache_that_raises_cancelled_error_itself_is_a_faulty_store(broken: str) -> None:
    """Its own CancelledError is a store's fault: a miss, an unstored result, never the batch's end."""
    cached = Tool("look", "Looks.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False, cache=CachePolicy())
    d = Dispatcher(Registry([cached]), cache=_StoreCancelledInside(broken))
    s = d.session("store", mode="direct")
    with anyio.fail_after(10):
        for n in range(3):
            s.new_run()
            results = await s.dispatch([call(f"{n}{i}", "look", text=str(i)) for i in range(3)])
            assert [(r.status, r.content) for r in results] == [(Status.ok, str(i)) for i in range(3)]


async def _cancelled_inside(*args: Any) -> None:
    await _awaits_a_cancelled_future({}, None)


async def test_a_gate_that_raises_cancelled_error_itself_denies_the_call() -> None:
    """A gate's own CancelledError is a gate that failed: that call is denied, the others run."""
    confirmed = Tool(
        "careful", "Asks first.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False, confirm=True
    )
    plain = Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False)
    d = Dispatcher(Registry([confirmed, plain]), gate=_cancelled_inside)
    with anyio.fail_after(10):
        denied, ran = await d.session("gate", mode="direct").dispatch(
            [call("1", "careful", text="a"), call("2", "echo", text="b")]
        )
    assert denied.status is Status.denied and "the gate failed" in denied.content
    assert "CancelledError" in denied.content
    assert (ran.status, ran.content) == (Status.ok, "b")


async def test_subscribers_that_raise_cancelled_error_themselves_are_ignored() -> None:
    """A result or batch subscriber's own CancelledError is logged and ignored, as any fault of one."""
    echo = Tool("echo", "Echo.", _echo, TEXT_SCHEMA, deferred=False)
    d = Dispatcher(Registry([echo]), on_result=_cancelled_inside)
    d.subscribe_batches(_cancelled_inside)
    s = d.session("events", mode="direct")
    s.subscribe(_cancelled_inside)
    with anyio.fail_after(10):
        for n in range(2):
            [result] = await s.dispatch([call(str(n), "echo", text=str(n))])
            assert (result.status, result.content) == (Status.ok, str(n))


async def _takes_its_cut_and_raises_anew(args: Mapping[str, Any], ctx: Any) -> str:
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    raise asyncio.CancelledError  # not the scope's: made here, after the cut was swallowed


async def _uncancels_its_cut(args: Mapping[str, Any], ctx: Any) -> str:
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()
        raise
    return "never"


@pytest.mark.parametrize("culprit", [_takes_its_cut_and_raises_anew, _uncancels_its_cut])
@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("where", [0, 1])
async def test_a_call_cut_at_its_timeout_times_out_however_it_takes_the_cut(
    culprit: Any, concurrent: bool, where: int
) -> None:
    """A call its timeout cut, which swallows that and raises a CancelledError of its own, or
    uncancels its task, is `timed_out`, alone, in turn or among siblings, and they keep theirs."""
    tools = [
        Tool("late", "Late.", culprit, NO_ARGUMENTS, concurrent=concurrent, deferred=False, timeout=0.1),
        Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=concurrent, deferred=False),
    ]
    s = Dispatcher(Registry(tools)).session("late", mode="direct")
    batch = [call("0", "echo", text="zero"), call("1", "late"), call("2", "echo", text="two")][where:]
    with anyio.fail_after(10):
        results = await s.dispatch(batch)
    assert [r.call_id for r in results] == [c.id for c in batch]
    for r in results:
        assert (r.status, r.content) in {(Status.ok, "zero"), (Status.ok, "two")} or (
            r.call_id == "1" and r.status is Status.timed_out
        ), r


async def test_a_rewriter_that_raises_cancelled_error_itself_is_skipped() -> None:
    """A rewriter's own CancelledError is a rewriter that raised: skipped, the call runs as sent."""

    async def rewriter(event: Any, state: Any) -> None:
        await _awaits_a_cancelled_future({}, None)

    echo = Tool("echo", "Echo.", _echo, TEXT_SCHEMA, deferred=False)
    s = Dispatcher(Registry([echo]), rewriters=[rewriter]).session("rewrite", mode="direct")
    with anyio.fail_after(10):
        [result] = await s.dispatch([call("1", "echo", text="as sent")])
    assert (result.status, result.content) == (Status.ok, "as sent")
