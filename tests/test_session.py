"""The session applies what pass 3 returns: the store is told its invalidations and writes,
and a store's fault never fails a call."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from cache import CacheEntry, CachePolicy, CacheWrite, MemoryResultCache
from dispatcher import (
    BatchEvent,
    Dispatcher,
    DispatchInterrupted,
    Interrupt,
    Registry,
    Tool,
    ToolCall,
)

from ._fakes import file_at_path, path_schema


def _registry(calls: list[str]) -> Registry:
    def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        calls.append(args["url"])
        return f"page {args['url']}"

    def write(args: Mapping[str, Any], ctx: Any) -> str:
        return "written"

    return Registry(
        [
            Tool(
                name="fetch_page",
                description="Fetch.",
                handler=fetch,
                parameters={"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
                deferred=False,
                concurrent=True,
                cache=CachePolicy(ttl=60),
                reads=lambda a: {f"file:/w/{a['url']}"},
            ),
            Tool(
                name="write_file",
                description="Write.",
                handler=write,
                parameters=path_schema(),
                deferred=False,
                writes=file_at_path,
            ),
        ]
    )


def fetch(url: str, call_id: str) -> ToolCall:
    return ToolCall(call_id, "fetch_page", {"url": url})


async def test_a_write_drops_the_stores_entries_that_read_it() -> None:
    """A successful write drops result-cache entries whose reads overlap it, and no others."""
    store = MemoryResultCache()
    await store.set("k1", "x", ttl=60, reads=["file:/w/a"])
    await store.set("k2", "y", ttl=60, reads=["file:/other"])
    d = Dispatcher(_registry([]), cache=store)
    [r] = await d.session("s").dispatch([ToolCall("c1", "write_file", {"path": "/w"})])
    assert r.ok
    assert await store.get("k1") is None
    assert await store.get("k2") is not None


async def test_a_cached_success_is_served_from_the_store_until_its_ttl() -> None:
    """A cacheable success is written to the store; another session is served it (cached,
    nothing runs) until the tool's ttl passes by the store's clock."""
    now = [1000.0]
    calls: list[str] = []
    store = MemoryResultCache(clock=lambda: now[0])
    d = Dispatcher(_registry(calls), cache=store)
    [first] = await d.session("a").dispatch([fetch("u", "c1")])
    assert first.ok and not first.cached and calls == ["u"]
    now[0] = 1059.0
    [hit] = await d.session("b").dispatch([fetch("u", "c2")])
    assert hit.cached and hit.content == "page u" and calls == ["u"]
    assert (await store.statistics()).writes == 1  # a hit is not written back
    now[0] = 1060.0
    [again] = await d.session("c").dispatch([fetch("u", "c3")])
    assert not again.cached and calls == ["u", "u"]


class _Broken(MemoryResultCache):
    """A store whose every operation fails."""

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        raise OSError("store down")

    async def set_many(self, writes: Sequence[CacheWrite]) -> None:
        raise OSError("store down")

    async def invalidate(self, resources: Iterable[str]) -> int:
        raise OSError("store down")


async def test_a_failing_store_fails_no_call() -> None:
    """A store that raises on lookup, write and invalidation: every call still runs and
    succeeds, the run's dedupe still works, and a write still drops remembered reads."""
    calls: list[str] = []
    d = Dispatcher(_registry(calls), cache=_Broken())
    s = d.session("s")
    [a] = await s.dispatch([fetch("a", "c1")])
    [again] = await s.dispatch([fetch("a", "c2")])
    assert a.ok and again.ok and again.deduped and calls == ["a"]
    [w] = await s.dispatch([ToolCall("c3", "write_file", {"path": "/w/a"})])
    assert w.ok
    [after] = await s.dispatch([fetch("a", "c4")])
    assert after.ok and not after.deduped and calls == ["a", "a"]


# -- the per-batch event ------------------------------------------------------------------


def _batch_registry() -> Registry:
    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        return str(args["text"])

    async def hang(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    text = {"type": "object", "properties": {"text": {"type": "string"}}}
    return Registry(
        [
            Tool("echo", "Echo.", echo, text, concurrent=True, deferred=False),
            Tool("hang", "Never returns.", hang, {"type": "object"}, concurrent=True, deferred=False),
            Tool("ask", "Needs a human.", echo, text, deferred=False, confirm=True),
        ]
    )


async def test_a_batch_event_carries_every_call_its_result_and_the_pass_timings() -> None:
    """After a batch, a batch subscriber sees every call, its result (a deduped one too), the
    indices that ran, and three pass timings that add up to no more than the batch took."""
    d = Dispatcher(_batch_registry())
    seen: list[BatchEvent] = []
    d.subscribe_batches(seen.append)
    s = d.session("s1")
    before = time.time()
    results = await s.dispatch([ToolCall("a", "echo", {"text": "x"}), ToolCall("b", "echo", {"text": "x"})])
    took = time.time() - before
    (event,) = seen
    assert (event.session_id, event.run_id, event.round, event.outcome) == ("s1", 1, 1, "ok")
    assert [c.id for c in event.calls] == ["a", "b"]
    assert event.results == tuple(results)
    assert event.ran == frozenset({0})  # b is a's follower: it never ran
    assert event.results[1] is not None and event.results[1].deduped
    assert before <= event.started <= before + took
    assert min(event.pass1, event.pass2, event.pass3) >= 0
    assert event.pass1 + event.pass2 + event.pass3 <= took


async def test_a_gate_interrupt_is_reported_as_an_interrupted_batch_that_ran_nothing() -> None:
    """A batch stopped by a gate's Interrupt is reported with outcome "interrupted" and no calls."""
    d = Dispatcher(_batch_registry(), gate=lambda call, ctx: Interrupt("ask a human"))
    seen: list[BatchEvent] = []
    d.subscribe_batches(seen.append)
    with pytest.raises(DispatchInterrupted):
        await d.session("s1").dispatch([ToolCall("a", "ask", {"text": "x"})])
    (event,) = seen
    assert (event.outcome, event.calls, event.results, event.pass2, event.pass3) == (
        "interrupted",
        (),
        (),
        0.0,
        0.0,
    )


async def test_a_cancelled_batch_is_reported_with_its_unfinished_calls() -> None:
    """Cancelling the caller still delivers the batch event (async subscribers included):
    outcome "cancelled", the finished call's result, None for the one cut short."""
    d = Dispatcher(_batch_registry())
    seen: list[BatchEvent] = []

    async def observe(event: BatchEvent) -> None:
        await anyio.lowlevel.checkpoint()  # would raise if the delivery were not shielded
        seen.append(event)

    d.subscribe_batches(observe)
    with anyio.move_on_after(0.2) as scope:
        await d.session("s1").dispatch([ToolCall("a", "echo", {"text": "x"}), ToolCall("b", "hang", {})])
    assert scope.cancelled_caught
    (event,) = seen
    assert event.outcome == "cancelled"
    assert event.ran == frozenset({0, 1})
    assert event.results[0] is not None and event.results[0].content == "x"
    assert event.results[1] is None


async def test_a_faulty_batch_subscriber_is_logged_and_unsubscribing_stops_delivery() -> None:
    """A batch subscriber that raises never fails the batch; after unsubscribing it is not called."""
    d = Dispatcher(_batch_registry())
    calls: list[int] = []

    def broken(event: BatchEvent) -> None:
        calls.append(event.round)
        raise RuntimeError("observer broke")

    stop = d.subscribe_batches(broken)
    s = d.session("s1")
    (result,) = await s.dispatch([ToolCall("a", "echo", {"text": "x"})])
    assert result.ok
    stop()
    await s.dispatch([ToolCall("b", "echo", {"text": "y"})])
    assert calls == [1]


async def test_invoke_merges_static_configuration_under_the_arguments_and_threads_input() -> None:
    """`invoke(static=..., input=...)`: the arguments override static keys, and `input` is
    passed as args["input"]; None passes no input."""
    seen: list[Mapping[str, Any]] = []

    def step(args: Mapping[str, Any], ctx: Any) -> str:
        seen.append(dict(args))
        return "ok"

    d = Dispatcher(Registry([Tool("step", "A step.", step, {"type": "object"}, deferred=False)]))
    static = {"expression": "$.x", "language": "jsonpath"}
    await d.invoke("step", {"language": "jq"}, static=static, input=[1])
    await d.invoke("step", static={"expression": "$.y"})
    assert seen == [{"expression": "$.x", "language": "jq", "input": [1]}, {"expression": "$.y"}]


# -- closing, and a long-lived server stays bounded ------------------------------------------


def _closing_registry(log: list[str]) -> Registry:
    async def start(args: Mapping[str, Any], ctx: Any) -> str:
        ctx.on_close(lambda: log.append(f"stop {args['name']} of {ctx.session_id}"))
        return "started"

    async def hold(args: Mapping[str, Any], ctx: Any) -> str:
        await ctx.state["release"].wait()
        return "held"

    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    return Registry(
        [
            Tool("start", "Start.", start, schema, deferred=False),
            Tool("hold", "Hold.", hold, {"type": "object"}, deferred=False),
        ]
    )


async def test_close_leaves_the_dispatcher_runs_cleanups_and_refuses_batches() -> None:
    """close() drops the session from its dispatcher, runs the cleanups its tools registered
    (newest first), is idempotent, and a closed session refuses a batch, saying so."""
    log: list[str] = []
    d = Dispatcher(_closing_registry(log))
    s = d.session("s")
    await s.dispatch([ToolCall("1", "start", {"name": "a"}), ToolCall("2", "start", {"name": "b"})])
    s.close()
    s.close()
    assert log == ["stop b of s", "stop a of s"]
    assert d.session("s") is not s
    with pytest.raises(RuntimeError, match="session 's' is closed"):
        await s.dispatch([ToolCall("3", "start", {"name": "c"})])


async def test_async_with_closes_the_session() -> None:
    """`async with d.session(...) as s` closes it on the way out, cleanups included."""
    log: list[str] = []
    d = Dispatcher(_closing_registry(log))
    async with d.session("s") as s:
        await s.dispatch([ToolCall("1", "start", {"name": "a"})])
    assert s.closed and log == ["stop a of s"]


async def test_idle_sessions_past_the_limit_or_the_timeout_are_closed() -> None:
    """With max_idle_sessions=2, making sessions closes the idle ones used longest ago; an
    idle_timeout closes those unused for that long; a session running a batch is kept."""
    log: list[str] = []
    d = Dispatcher(_closing_registry(log), max_idle_sessions=2)
    for name in ("a", "b", "c", "d"):
        await d.session(name).dispatch([ToolCall("1", "start", {"name": name})])
    assert sorted(d._sessions) == ["c", "d"]
    assert log == ["stop a of a", "stop b of b"]

    timed = Dispatcher(_closing_registry(log), idle_timeout=60)
    old = timed.session("old")
    old.last_used -= 61
    timed.session("new")
    assert old.closed and sorted(timed._sessions) == ["new"]

    busy_d = Dispatcher(_closing_registry(log), max_idle_sessions=1)
    busy = busy_d.session("busy")
    busy.state["release"] = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(busy.dispatch, [ToolCall("h", "hold", {})])
        await anyio.sleep(0.01)
        busy_d.session("x")
        busy_d.session("y")
        assert not busy.closed
        busy.state["release"].set()
    assert not busy.closed
