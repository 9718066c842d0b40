"""The three passes end to end, through `Session.dispatch` and `Dispatcher.invoke`."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.from_thread
import pytest

import dispatcher
from cache import CachePolicy, MemoryResultCache
from dispatcher import (
    Allow,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    HookBlocked,
    Interrupt,
    Registry,
    Status,
    Tool,
    ToolCall,
    ToolError,
)

from ._fakes import PATH_SCHEMA, TEXT_SCHEMA, Counter, call, fake_registry, openai_call


def test_public_names_are_exactly_the_surface() -> None:
    """dispatcher.__all__ is exactly the public surface of DESIGN.md plus the named extras."""
    assert set(dispatcher.__all__) == {
        "Allow",
        "Answer",
        "BatchEvent",
        "CacheEntry",
        "CachePolicy",
        "CacheStatistics",
        "CacheWrite",
        "Deny",
        "DispatchInterrupted",
        "Dispatcher",
        "DispatcherStatistics",
        "Divergence",
        "ErrorRecord",
        "ErrorStore",
        "HistoryEntry",
        "HookBlocked",
        "Interrupt",
        "Lease",
        "ProcessContext",
        "Registry",
        "ReplayReport",
        "ResultCache",
        "ScriptedRunner",
        "Session",
        "SessionBusy",
        "SessionStatistics",
        "SessionStore",
        "Status",
        "StoredSession",
        "StuckCall",
        "Tool",
        "ToolCall",
        "ToolCallDispatchEvent",
        "ToolContext",
        "ToolDefinitionError",
        "ToolError",
        "ToolResult",
        "ToolResultEvent",
        "ToolRunner",
        "UnknownTool",
        "default_limit",
        "replay",
    }
    for name in dispatcher.__all__:
        assert getattr(dispatcher, name) is not None


def setup(**kw: Any) -> tuple[Dispatcher, Counter, dict[str, str]]:
    counter = Counter()
    files: dict[str, str] = {}
    return Dispatcher(fake_registry(counter, files), **kw), counter, files


async def test_results_come_back_in_call_order_with_ids() -> None:
    """One result per call, in call order, ids preserved, whatever order they finish in."""
    d, _, _ = setup()
    s = d.session("s", mode="direct")
    calls = [openai_call(f"c{i}", "nap", {"ms": 30 - i * 10}) for i in range(3)]
    results = await s.dispatch(calls)
    assert [r.call_id for r in results] == ["c0", "c1", "c2"]
    assert [r.content for r in results] == ["slept 30", "slept 20", "slept 10"]
    assert all(r.status is Status.ok for r in results)


async def test_a_repeated_call_id_is_that_calls_invalid_arguments(autojump_clock: Any) -> None:
    """Two calls of a batch with the same id (a model's slip): the first runs, the second is
    invalid_arguments naming the id, and nothing runs for it."""
    d, counter, _ = setup()
    s = d.session("s", mode="direct")
    calls = [openai_call("same", "nap", {"ms": 20}), openai_call("same", "nap", {"ms": 10})]
    results = await s.dispatch(calls)
    statuses = [(r.call_id, r.status) for r in results]
    assert statuses == [("same", Status.ok), ("same", Status.invalid_arguments)]
    assert results[0].content == "slept 20" and "duplicate call id 'same'" in results[1].content
    assert counter.runs == [("nap", "20")]


async def test_a_decision_is_never_shared_by_two_calls_with_one_id() -> None:
    """decisions={"X": Allow()} approves only the first call with id X: a second, dangerous
    call that reuses the id is refused, not run."""
    ran: list[str] = []

    def act(args: Mapping[str, Any], ctx: Any) -> str:
        ran.append(args["cmd"])
        return "done"

    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    reg = Registry([Tool("act", "Act.", act, schema, deferred=False, confirm=True)])
    d = Dispatcher(reg, gate=lambda call, ctx: Interrupt("ask"))
    s = d.session("s")
    calls = [ToolCall("X", "act", {"cmd": "ls"}), ToolCall("X", "act", {"cmd": "rm -rf /"})]
    results = await s.dispatch(calls, decisions={"X": Allow()})
    assert ran == ["ls"]
    assert results[1].status is Status.invalid_arguments


def _nesting_registry(inner_runs: list[int], sync: bool) -> Registry:
    """`outer` (concurrent) calls `inner` through `ctx.invoke` while holding its slot."""

    async def inner(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)
        inner_runs.append(args["n"])
        return f"inner {args['n']}"

    async def outer(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)  # every outer call holds a slot before any inner one starts
        found = await ctx.invoke("inner", {"n": args["n"]})
        return f"outer {args['n']}: {found.content}"

    def outer_sync(args: Mapping[str, Any], ctx: Any) -> str:
        found = anyio.from_thread.run(ctx.invoke, "inner", {"n": args["n"]})
        return f"outer {args['n']}: {found.content}"

    n_schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    return Registry(
        [
            Tool("inner", "i", inner, n_schema, concurrent=True, deferred=False),
            Tool("outer", "o", outer_sync if sync else outer, n_schema, concurrent=True, deferred=False),
        ]
    )


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_handlers_that_invoke_tools_never_deadlock_at_the_limit(sync: bool) -> None:
    """Calls that each invoke another tool, as many as the limit allows at once, all finish:
    a nested call runs on its caller's slot, and the limit is never exceeded."""
    inner_runs: list[int] = []
    d = Dispatcher(_nesting_registry(inner_runs, sync), max_concurrent=3)
    s = d.session("s", mode="direct")
    with anyio.fail_after(10):
        results = await s.dispatch([openai_call(f"o{n}", "outer", {"n": n}) for n in range(5)])
    assert [r.content for r in results] == [f"outer {n}: inner {n}" for n in range(5)]
    assert sorted(inner_runs) == list(range(5))
    assert d.limiter.borrowed_tokens == 0
    assert s.statistics().calls == 10


async def test_a_nested_sync_call_past_its_timeout_keeps_the_slot() -> None:
    """A sync tool invoked from a handler runs on that handler's slot; past its timeout it is not
    abandoned, so nothing else starts on the slot while its thread still runs."""
    events: list[str] = []

    def slow_sync(args: Mapping[str, Any], ctx: Any) -> str:
        events.append("slow start")
        time.sleep(0.3)
        events.append("slow end")
        return "slow"

    async def quick(args: Mapping[str, Any], ctx: Any) -> str:
        events.append("quick")
        return "quick"

    async def outer(args: Mapping[str, Any], ctx: Any) -> str:
        found = await ctx.invoke("slow_sync", {})
        return f"outer got {found.status.value}"

    reg = Registry(
        [
            Tool("slow_sync", "s", slow_sync, deferred=False, timeout=0.05),
            Tool("quick", "q", quick, deferred=False),
            Tool("outer", "o", outer, deferred=False),
        ]
    )
    d = Dispatcher(reg, max_concurrent=1)
    with anyio.fail_after(10):
        results = await d.session("s").dispatch(
            [openai_call("a", "outer", {}), openai_call("b", "quick", {})]
        )
    assert events == ["slow start", "slow end", "quick"]
    assert [r.content for r in results] == ["outer got ok", "quick"]
    assert d.limiter.borrowed_tokens == 0


async def test_a_handler_that_invokes_side_by_side_stays_on_its_slot(autojump_clock: Any) -> None:
    """A handler that runs three invokes at once still runs them one at a time on its slot."""
    counter = Counter()
    n_schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def inner(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("inner", str(args["n"]))
        await anyio.sleep(1)
        counter.leave()
        return str(args["n"])

    async def fan_out(args: Mapping[str, Any], ctx: Any) -> str:
        found: list[str] = []

        async def one(n: int) -> None:
            result = await ctx.invoke("inner", {"n": n})
            found.append(result.content)

        async with anyio.create_task_group() as nursery:
            for k in range(3):
                nursery.start_soon(one, args["n"] * 10 + k)
        return ",".join(sorted(found))

    reg = Registry(
        [
            Tool("inner", "i", inner, n_schema, concurrent=True, deferred=False),
            Tool("fan_out", "f", fan_out, n_schema, concurrent=True, deferred=False),
        ]
    )
    d = Dispatcher(reg, max_concurrent=2)
    s = d.session("s", mode="direct")
    start = anyio.current_time()
    results = await s.dispatch([openai_call(f"f{n}", "fan_out", {"n": n}) for n in (1, 2)])
    assert [r.content for r in results] == ["10,11,12", "20,21,22"]
    assert counter.most == 2  # one inner call per slot, never more than the limit
    assert anyio.current_time() - start == 3  # each slot ran its three inner calls in turn


async def test_a_call_that_swallows_its_timeout_does_not_cut_the_next(autojump_clock: Any) -> None:
    """A handler that catches its own cancellation and returns does not leave the worker's next
    call cancelled: that call runs to the end. What it returned came after its deadline, so
    it is timed_out, on this clock as on a real one."""
    ran: list[int] = []

    async def swallow(args: Mapping[str, Any], ctx: Any) -> str:
        try:
            await anyio.sleep(5)
        except BaseException:  # a handler bug this test is about
            return "partial"
        return "whole"

    async def steady(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(1)
        ran.append(args["n"])
        return f"steady {args['n']}"

    n_schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    reg = Registry(
        [
            Tool("swallow", "s", swallow, n_schema, concurrent=True, deferred=False, timeout=2),
            Tool("steady", "s", steady, n_schema, concurrent=True, deferred=False, timeout=30),
        ]
    )
    s = Dispatcher(reg, max_concurrent=1).session("s", mode="direct")
    batch = [openai_call("sw", "swallow", {}), *(openai_call(f"v{n}", "steady", {"n": n}) for n in (1, 2))]
    results = await s.dispatch(batch)
    assert [(r.status, r.content) for r in results][1:] == [(Status.ok, "steady 1"), (Status.ok, "steady 2")]
    assert results[0].status is Status.timed_out and "partial" not in results[0].content
    assert ran == [1, 2]


async def test_every_status_of_the_failure_table_from_a_real_path(autojump_clock: Any) -> None:
    """ok, failed, rejected, invalid_arguments, schema_required, denied, timed_out, expired."""
    counter = Counter()
    reg = fake_registry(counter)

    async def hang(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(10)
        return "never"

    reg.add(Tool("hang", "Hangs.", hang, {"type": "object"}, timeout=1.0, deferred=False))
    reg.add(Tool("hidden", "Deferred.", hang, {"type": "object"}))
    reg.add(Tool("guarded", "Needs a yes.", hang, {"type": "object"}, confirm=True, deferred=False))
    d = Dispatcher(reg, gate=lambda c, ctx: Deny("not today"))
    s = d.session("s", mode="deferred")
    results = await s.dispatch(
        [
            call("a", "echo", text="x"),
            call("b", "boom"),
            call("c", "nope"),
            openai_call("d", "echo", "{not json"),
            call("e", "run_tool", name="hidden", args={}),
            call("f", "guarded"),
            call("g", "hang"),
        ]
    )
    statuses = [r.status for r in results]
    assert statuses == [
        Status.ok,
        Status.failed,
        Status.rejected,
        Status.invalid_arguments,
        Status.schema_required,
        Status.denied,
        Status.timed_out,
    ]
    assert anyio.current_time() == pytest.approx(1.0)
    s.new_run(deadline=anyio.current_time())
    [expired] = await s.dispatch([call("h", "echo", text="late")])
    assert expired.status is Status.expired
    assert s.statistics().executed == 3  # ok, failed, timed_out started; the expired call never did
    assert ("echo", "late") not in counter.runs
    for r in [*results[1:], expired]:
        body = json.loads(r.content.split("\n")[0])
        assert body["status"] == r.status.value
        assert set(body) == {"error", "status", "retryable", "effect_uncertain"}
        assert body["retryable"] == r.retryable
    assert [r.retryable for r in results[1:]] == [True, False, True, True, False, True]
    assert not expired.retryable


async def test_a_raising_tool_beside_two_healthy_ones() -> None:
    """A tool that raises fails alone; its siblings in the same group succeed."""
    d, _, _ = setup()
    s = d.session("s")
    results = await s.dispatch([call("1", "echo", text="a"), call("2", "boom"), call("3", "echo", text="b")])
    assert [r.status for r in results] == [Status.ok, Status.failed, Status.ok]
    assert "the tool broke" in results[1].content
    assert results[1].retryable and not results[1].effect_uncertain


async def test_tool_error_says_whether_a_retry_helps() -> None:
    """ToolError(retryable=False) reaches the result; a writer's failure is effect_uncertain."""

    async def refuse(args: Mapping[str, Any], ctx: Any) -> str:
        raise ToolError("quota exhausted", retryable=False)

    reg = Registry([Tool("refuse", "r", refuse, deferred=False, writes=lambda a: {"file:/x"})])
    [r] = await Dispatcher(reg).session().dispatch([call("1", "refuse")])
    assert r.status is Status.failed and not r.retryable and r.effect_uncertain
    assert json.loads(r.content.splitlines()[0])["error"] == "quota exhausted"


async def test_read_edit_read_in_one_batch_sees_the_edit() -> None:
    """Read -> edit -> read of one path in one batch: the second read runs and sees the edit."""
    d, counter, files = setup()
    files["a"] = "old"
    s = d.session("s")
    results = await s.dispatch(
        [call("1", "read", path="a"), call("2", "edit", path="a", text="new"), call("3", "read", path="a")]
    )
    assert [r.content for r in results] == ["old", "edited", "new"]
    assert not results[2].deduped
    assert counter.runs.count(("read", "a")) == 2


async def test_an_edit_in_a_later_round_invalidates_an_earlier_read() -> None:
    """A read remembered in this run is served again until an edit of its path drops it."""
    d, counter, files = setup()
    files["a"] = "v1"
    s = d.session("s")
    await s.dispatch([call("1", "read", path="a")])
    [again] = await s.dispatch([call("2", "read", path="a")])
    assert again.deduped and again.content == "v1" and again.call_id == "2"
    await s.dispatch([call("3", "edit", path="a", text="v2")])
    [fresh] = await s.dispatch([call("4", "read", path="a")])
    assert not fresh.deduped and fresh.content == "v2"
    assert counter.runs.count(("read", "a")) == 2


async def test_in_batch_duplicates_run_once_and_share_the_result() -> None:
    """The same key twice in a batch runs once; the follower carries deduped=True."""
    d, counter, _ = setup()
    s = d.session("s")
    results = await s.dispatch([call("1", "echo", text="x"), call("2", "echo", text="x")])
    assert counter.runs == [("echo", "x")]
    assert [r.deduped for r in results] == [False, True]
    assert [r.call_id for r in results] == ["1", "2"]


async def test_dedupe_is_per_run() -> None:
    """new_run empties the dedupe map: the same call runs again in the next user turn."""
    d, counter, _ = setup()
    s = d.session("s")
    await s.dispatch([call("1", "echo", text="x")])
    await s.dispatch([call("2", "echo", text="x")])
    s.new_run()
    await s.dispatch([call("3", "echo", text="x")])
    assert counter.runs == [("echo", "x"), ("echo", "x")]


async def test_failures_are_not_remembered_across_rounds() -> None:
    """A failed call runs again when the model repeats it in a later round."""
    d, counter, _ = setup()
    s = d.session("s")
    await s.dispatch([call("1", "boom")])
    [r] = await s.dispatch([call("2", "boom")])
    assert r.status is Status.failed and not r.deduped
    assert counter.runs.count(("boom", "")) == 2


async def _distinct_naps(limit: int) -> tuple[float, int]:
    counter = Counter()
    reg = Registry()

    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("nap", str(args["i"]))
        await anyio.sleep(0.1)
        counter.leave()
        return "ok"

    schema = {"type": "object", "properties": {"i": {"type": "integer"}}}
    reg.add(Tool("nap", "Sleep 100 ms.", nap, schema, concurrent=True, deferred=False))
    s = Dispatcher(reg, max_concurrent=limit).session("s")
    start = anyio.current_time()
    results = await s.dispatch([ToolCall(id=str(i), name="nap", arguments={"i": i}) for i in range(16)])
    assert all(r.status is Status.ok for r in results)
    assert len(counter.runs) == 16
    return anyio.current_time() - start, counter.most


@pytest.mark.parametrize("limit", [3, 8])
async def test_sixteen_sleeps_take_ceil_16_over_limit_tenths(autojump_clock: Any, limit: int) -> None:
    """16 concurrent 100 ms calls take exactly ceil(16/limit) x 100 ms, never over the limit."""
    wall, most = await _distinct_naps(limit)
    assert wall == pytest.approx(math.ceil(16 / limit) * 0.1)
    assert most == limit


async def test_default_limit_is_half_the_cores_at_least_three() -> None:
    """The limiter defaults to max(3, cpu_count // 2) and is shared by the sessions."""
    d, _, _ = setup()
    assert d.limiter.total_tokens == dispatcher.default_limit() >= 3
    assert d.session("a").dispatcher.limiter is d.session("b").dispatcher.limiter


async def test_non_concurrent_calls_never_overlap() -> None:
    """Calls without the concurrent tag run one at a time, in order."""
    d, counter, _ = setup()
    s = d.session("s")
    await s.dispatch([call(str(i), "serial", text=str(i)) for i in range(4)])
    assert not counter.serial_overlap
    assert [k for n, k in counter.runs if n == "serial"] == ["0", "1", "2", "3"]


async def test_a_concurrent_call_times_out_at_its_own_deadline(autojump_clock: Any) -> None:
    """In a group, each call is cut at exactly start + its timeout; its siblings go on."""
    reg = Registry()
    ends: dict[str, float] = {}

    async def sleepy(args: Mapping[str, Any], ctx: Any) -> str:
        try:
            await anyio.sleep(args["s"])
        finally:
            ends[ctx.call_id] = anyio.current_time()
        return "done"

    schema = {"type": "object", "properties": {"s": {"type": "number"}}}
    reg.add(Tool("sleepy", "s", sleepy, schema, concurrent=True, deferred=False, timeout=2.0))
    reg.add(Tool("quick", "q", sleepy, schema, concurrent=True, deferred=False, timeout=0.5))
    s = Dispatcher(reg, max_concurrent=3).session()
    results = await s.dispatch(
        [
            ToolCall("a", "sleepy", {"s": 5}),
            ToolCall("b", "quick", {"s": 1}),
            ToolCall("c", "sleepy", {"s": 1}),
            ToolCall("d", "sleepy", {"s": 3}),
        ]
    )
    assert [r.status for r in results] == [Status.timed_out, Status.timed_out, Status.ok, Status.timed_out]
    assert ends["a"] == pytest.approx(2.0)
    assert ends["b"] == pytest.approx(0.5)
    assert ends["c"] == pytest.approx(1.0)
    # d waited for a slot: it started when b was cut (0.5 s) and was cut 2 s later
    assert ends["d"] == pytest.approx(2.5)
    assert "timeout of 2 s" in results[0].content


async def test_a_sync_handler_past_its_timeout_keeps_its_slot() -> None:
    """A sync tool past its timeout is reported at once; its thread holds the slot until it returns."""
    import threading

    release = threading.Event()

    def stuck(args: Mapping[str, Any], ctx: Any) -> str:
        release.wait(5)
        return "finally"

    reg = Registry([Tool("stuck", "s", stuck, timeout=0.2, deferred=False)])
    d = Dispatcher(reg, max_concurrent=3)
    with anyio.fail_after(10):
        [r] = await d.session().dispatch([call("1", "stuck")])
    assert r.status is Status.timed_out
    assert d.limiter.borrowed_tokens == 1
    release.set()
    with anyio.fail_after(10):
        # the slot belongs to a thread, which cannot set a anyio.Event here: poll it
        while d.limiter.borrowed_tokens:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert d.limiter.borrowed_tokens == 0


async def test_sync_handlers_run_in_threads() -> None:
    """A sync handler runs off the event loop, under the same limiter."""
    import threading

    seen: list[bool] = []

    def where(args: Mapping[str, Any], ctx: Any) -> str:
        seen.append(threading.current_thread() is threading.main_thread())
        return "ok"

    reg = Registry([Tool("where", "w", where, concurrent=True, deferred=False)])
    with anyio.fail_after(10):
        await Dispatcher(reg).session().dispatch([ToolCall(str(i), "where", {"i": i}) for i in range(3)])
    assert seen == [False, False, False]


async def test_hooks_wrap_every_call_that_starts() -> None:
    """before and after run once per started call, with the result; decided calls cross none."""
    log: list[str] = []

    class Audit:
        async def before(self, c: ToolCall, ctx: Any) -> None:
            log.append(f"before {c.id}")

        def after(self, c: ToolCall, result: Any, ctx: Any) -> None:
            log.append(f"after {c.id} {result.status.value}")

    counter = Counter()
    d = Dispatcher(fake_registry(counter), hooks=[Audit()])
    await d.session().dispatch([call("1", "serial", text="a"), call("2", "nope"), call("3", "boom")])
    assert log == ["before 1", "after 1 ok", "before 3", "after 3 failed"]


async def test_a_faulty_hook_fails_its_own_call_only(caplog: pytest.LogCaptureFixture) -> None:
    """A before hook that raises fails that call unrun; an after hook that raises is logged and
    the result stands; the other calls of the batch, and the other hooks, go on."""
    seen: list[str] = []

    class Faulty:
        def before(self, c: ToolCall, ctx: Any) -> None:
            if c.arguments["text"] == "guarded":
                raise ValueError("the guard broke")

        async def after(self, c: ToolCall, result: Any, ctx: Any) -> None:
            if c.arguments["text"] == "audited":
                raise KeyError("the audit broke")

    class Audit:
        def after(self, c: ToolCall, result: Any, ctx: Any) -> None:
            seen.append(c.id)

    counter = Counter()
    d = Dispatcher(fake_registry(counter), hooks=[Faulty(), Audit()])
    texts = ["plain", "guarded", "audited"]
    s = d.session()
    results = await s.dispatch([openai_call(t, "echo", {"text": t}) for t in texts])
    assert [r.status for r in results] == [Status.ok, Status.failed, Status.ok]
    error = results[1].error()
    assert error is not None and error["retryable"] is False
    assert (
        "before hook Faulty.before failed, so the tool did not run: ValueError: the guard broke"
        in error["error"]
    )
    assert [key for _, key in counter.runs] == ["plain", "audited"]
    assert seen == ["plain", "audited"]  # the call that never started crosses no after hook
    assert s.statistics().executed == 2
    assert any("after hook Faulty.after raised on call audited" in r.getMessage() for r in caplog.records)


async def test_hook_block_finishes_the_group_commits_and_propagates() -> None:
    """HookBlocked: the rest of its group finishes, later groups do not start, what ran is committed."""

    class Guard:
        def before(self, c: ToolCall, ctx: Any) -> None:
            if c.arguments.get("text") == "stop":  # type: ignore[union-attr]
                raise HookBlocked("policy says no")

    counter = Counter()
    d = Dispatcher(fake_registry(counter), hooks=[Guard()])
    s = d.session()
    with pytest.raises(HookBlocked) as info:
        await s.dispatch(
            [
                call("1", "echo", text="a"),
                call("2", "echo", text="stop"),
                call("3", "echo", text="b"),
                call("4", "serial", text="later"),
            ]
        )
    assert info.value.call_id == "2"
    assert sorted(k for _, k in counter.runs) == ["a", "b"]
    assert [h.call_id for h in s.history] == ["1", "3"]
    [again] = await s.dispatch([call("5", "echo", text="a")])
    assert again.deduped


async def test_an_interrupt_runs_nothing_and_resuming_runs_each_approval_once() -> None:
    """Every gate is answered first; an Interrupt runs nothing; a resume spends its approval."""
    asked: list[str] = []

    def gate(c: ToolCall, ctx: Any) -> Any:
        asked.append(c.id)
        return Interrupt("needs a human", {"cmd": c.name})

    counter = Counter()
    reg = fake_registry(counter)

    async def danger(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("danger", args["text"])
        counter.leave()
        return "did " + args["text"]

    reg.add(Tool("danger", "d", danger, TEXT_SCHEMA, confirm=True, deferred=False, writes=lambda a: {"x:y"}))
    d = Dispatcher(reg, gate=gate)
    s = d.session()
    batch = [call("1", "echo", text="a"), call("2", "danger", text="rm"), call("3", "danger", text="mv")]
    with pytest.raises(DispatchInterrupted) as info:
        await s.dispatch(batch)
    assert [(c.id, reason) for c, reason, _ in info.value.pending] == [
        ("2", "needs a human"),
        ("3", "needs a human"),
    ]
    assert info.value.pending[0][2] == {"cmd": "danger"}
    assert counter.runs == [] and asked == ["2", "3"]
    results = await s.dispatch(batch, decisions={"2": Allow(), "3": Deny("no moving")})
    assert [r.status for r in results] == [Status.ok, Status.ok, Status.denied]
    assert "no moving" in results[2].content
    assert counter.runs == [("echo", "a"), ("danger", "rm")]
    # the approval is spent: the same decisions again do not run call 2 a second time
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(batch, decisions={"2": Allow(), "3": Deny("no moving")})
    assert counter.runs.count(("danger", "rm")) == 1


async def test_allow_with_new_arguments_is_validated_again() -> None:
    """Arguments an Allow changed are validated again; bad ones are invalid_arguments."""
    counter = Counter()
    reg = fake_registry(counter)
    reg.add(Tool("ask", "a", lambda a, c: a["text"], TEXT_SCHEMA, confirm=True, deferred=False))
    gate_answers = iter([Allow(args={"text": "changed"}), Allow(args={"text": 5})])
    d = Dispatcher(reg, gate=lambda c, ctx: next(gate_answers))
    s = d.session()
    with anyio.fail_after(10):
        [ok] = await s.dispatch([call("1", "ask", text="orig")])
        [bad] = await s.dispatch([call("2", "ask", text="other")])
    assert ok.content == "changed"
    assert bad.status is Status.invalid_arguments and "$['text']" in bad.content


async def test_followers_share_the_leaders_gate_decision() -> None:
    """An in-batch duplicate of a gated call is not asked again and shares the leader's result."""
    asked: list[str] = []

    def gate(c: ToolCall, ctx: Any) -> Any:
        asked.append(c.id)
        return Deny("nope")

    reg = Registry([Tool("g", "g", lambda a, c: "ran", TEXT_SCHEMA, confirm=True, deferred=False)])
    with anyio.fail_after(10):
        results = (
            await Dispatcher(reg, gate=gate)
            .session()
            .dispatch([call("1", "g", text="x"), call("2", "g", text="x")])
        )
    assert asked == ["1"]
    assert [r.status for r in results] == [Status.denied, Status.denied]
    assert results[1].deduped and results[1].call_id == "2"


async def test_cancellation_cancels_running_calls_and_propagates(autojump_clock: Any) -> None:
    """Cancelling the caller cancels every running call at once; what finished is committed."""
    d, counter, _ = setup()
    s = d.session()
    with anyio.move_on_after(0.05) as scope:
        await s.dispatch([call("1", "echo", text="fast"), ToolCall("2", "nap", {"ms": 1000})])
    assert scope.cancelled_caught
    assert anyio.current_time() == pytest.approx(0.05)
    assert [h.call_id for h in s.history] == ["1"]
    assert counter.in_flight == 0


async def test_cancellation_wins_over_a_hook_block(autojump_clock: Any) -> None:
    """When the caller is cancelled while a hook has blocked, cancellation propagates."""

    class Guard:
        def before(self, c: ToolCall, ctx: Any) -> None:
            if c.id == "1":
                raise HookBlocked("no")

    counter = Counter()
    d = Dispatcher(fake_registry(counter), hooks=[Guard()])
    with anyio.move_on_after(0.05) as scope:
        await d.session().dispatch([ToolCall("1", "nap", {"ms": 1}), ToolCall("2", "nap", {"ms": 1000})])
    assert scope.cancelled_caught


async def test_hook_block_wins_over_an_interrupt_from_tool_code() -> None:
    """A hook block and an interrupt in one batch: the hook block propagates."""

    async def asks(args: Mapping[str, Any], ctx: Any) -> str:
        raise DispatchInterrupted([(ToolCall(ctx.call_id, "asks", {}), "question", None)])

    class Guard:
        def before(self, c: ToolCall, ctx: Any) -> None:
            if c.id == "2":
                raise HookBlocked("no")

    reg = Registry(
        [
            Tool("asks", "a", asks, concurrent=True, deferred=False),
            Tool("other", "o", asks, concurrent=True, deferred=False),
        ]
    )
    d = Dispatcher(reg, hooks=[Guard()])
    with pytest.raises(HookBlocked):
        await d.session().dispatch([call("1", "asks"), call("2", "other")])
    with pytest.raises(DispatchInterrupted) as info:
        await Dispatcher(reg).session().dispatch([call("3", "asks"), call("4", "other")])
    assert info.value.pending[0][0].id == "3"


async def test_rewriters_follow_symfonics_contract(caplog: Any) -> None:
    """Chain in order; None passes; malformed, raising or off-palette rewrites are dropped; ids kept."""
    seen: list[tuple[str, str]] = []

    async def to_echo(event: Any, state: Any) -> Any:
        seen.append((event.call_id, event.tool_name))
        if event.tool_name == "serial":
            return {"tool_name": "echo", "args": {"text": "rewritten " + event.args["text"]}, "call_id": "x"}
        return None

    def sees_rewrite(event: Any, state: Any) -> Any:
        seen.append((event.call_id, event.tool_name))
        assert "echo" in event.available_tools
        return None

    def malformed(event: Any, state: Any) -> Any:
        return "rewrite"

    def raising(event: Any, state: Any) -> Any:
        raise ValueError("broken rewriter")

    def off_palette(event: Any, state: Any) -> Any:
        return {"tool_name": "not_a_tool", "args": {}} if event.tool_name == "boom" else None

    counter = Counter()
    d = Dispatcher(fake_registry(counter), rewriters=[to_echo, sees_rewrite, malformed, raising, off_palette])
    results = await d.session().dispatch([call("1", "serial", text="a"), call("2", "boom")])
    assert results[0].call_id == "1" and results[0].content == "rewritten a"
    assert results[1].status is Status.failed  # off-palette rewrite dropped: the original ran
    assert seen == [("1", "serial"), ("1", "echo"), ("2", "boom"), ("2", "boom")]
    text = caplog.text
    assert "not {'tool_name', 'args'}" in text and "raised" in text and "not_a_tool" in text
    assert "call_id" in text


async def test_a_rewrite_to_run_tool_or_with_unreadable_args_is_dropped(caplog: Any) -> None:
    """A rewriter cannot send a call to run_tool (unwrapped before rewriters speak), and one whose
    args cannot be read is dropped; the original call runs."""

    class Unreadable(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            raise KeyError(key)

        def __iter__(self) -> Any:
            raise RuntimeError("cannot iterate")

        def __len__(self) -> int:
            return 1

    def to_run_tool(event: Any, state: Any) -> Any:
        if event.call_id == "1":
            return {"tool_name": "run_tool", "args": {"name": "echo", "args": {"text": "via run_tool"}}}
        return {"tool_name": "echo", "args": Unreadable()}

    d = Dispatcher(fake_registry(Counter()), rewriters=[to_run_tool])
    results = await d.session("s", mode="direct").dispatch(
        [call("1", "echo", text="a"), call("2", "echo", text="b")]
    )
    assert [(r.status, r.content) for r in results] == [(Status.ok, "a"), (Status.ok, "b")]
    assert "not a tool a call can be rewritten to" in caplog.text and "cannot be read" in caplog.text


async def test_no_rewriters_no_event_built(monkeypatch: Any) -> None:
    """Without rewriters, no ToolCallDispatchEvent is ever constructed."""
    import dispatcher._rewrite as session_module

    built: list[Any] = []

    class Spy:
        def __init__(self, **kw: Any) -> None:
            built.append(kw)

    monkeypatch.setattr(session_module, "ToolCallDispatchEvent", Spy)
    d, _, _ = setup()
    await d.session().dispatch([call("1", "echo", text="a")])
    assert built == []


async def test_deferred_mode_find_tools_then_run_tool() -> None:
    """A deferred tool: rejected when called directly, loaded by find_tools select:, then run."""
    reg = Registry(
        [
            Tool(
                "weather",
                "Weather for a city.",
                lambda a, c: "sunny in " + a["city"],
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            )
        ]
    )
    s = Dispatcher(reg).session("s", mode="deferred")
    names = [t["function"]["name"] for t in s.request_tools("openai")]
    assert names == ["find_tools", "run_tool"]
    assert "weather" in s.request_tools("openai")[1]["function"]["description"]
    with anyio.fail_after(10):
        [direct] = await s.dispatch([call("1", "weather", city="Oslo")])
        assert direct.status is Status.rejected and "select:weather" in direct.content
        [found] = await s.dispatch([call("2", "find_tools", query="select:weather")])
        assert found.status is Status.ok and '"city"' in found.content
        [ran] = await s.dispatch([call("3", "run_tool", name="weather", args={"city": "Oslo"})])
    assert ran.status is Status.ok and ran.content == "sunny in Oslo" and ran.call_id == "3"


async def test_schema_required_then_the_retry_runs() -> None:
    """Through run_tool before its schema: schema_required with the schema; the retry runs."""
    reg = Registry(
        [
            Tool(
                "weather",
                "Weather.",
                lambda a, c: "sunny",
                {"type": "object", "properties": {"city": {"type": "string"}}},
            )
        ]
    )
    s = Dispatcher(reg).session("s", mode="direct")
    stub = s.request_tools("anthropic")[1]
    assert stub["name"] == "weather" and stub["input_schema"] == {"type": "object", "properties": {}}
    with anyio.fail_after(10):
        [first] = await s.dispatch([call("1", "weather", city="Oslo")])
        assert first.status is Status.schema_required and '"city"' in first.content
        [second] = await s.dispatch([call("2", "weather", city="Oslo")])
    assert second.status is Status.ok
    assert s.request_tools("anthropic")[1]["input_schema"]["properties"] == {"city": {"type": "string"}}


async def test_find_tools_free_text_ranks_names_and_descriptions() -> None:
    """find_tools with words returns and loads the best matches."""
    reg = Registry(
        [
            Tool("read_files", "Read files from the workspace.", lambda a, c: ""),
            Tool("fetch_page", "Fetch a web page as text.", lambda a, c: ""),
            Tool("calculate", "Evaluate arithmetic.", lambda a, c: ""),
        ]
    )
    s = Dispatcher(reg).session()
    [r] = await s.dispatch([call("1", "find_tools", query="web page", limit=2)])
    assert r.content.splitlines()[1].startswith('{"description": "Fetch a web page')
    assert s.is_loaded("fetch_page") and not s.is_loaded("calculate")


async def test_shared_cache_serves_other_sessions_and_credentials_are_never_stored() -> None:
    """A shared-policy success is served to another session; a credentialed call never is."""
    runs: list[str] = []

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        runs.append(args["url"])
        return "page " + args["url"]

    schema = {"type": "object", "properties": {"url": {"type": "string"}, "headers": {"type": "object"}}}
    reg = Registry([Tool("fetch", "f", fetch, schema, concurrent=True, deferred=False, cache=CachePolicy())])
    store = MemoryResultCache()
    d = Dispatcher(reg, cache=store)
    await d.session("a").dispatch([ToolCall("1", "fetch", {"url": "https://x.test/"})])
    [hit] = await d.session("b").dispatch([ToolCall("2", "fetch", {"url": "https://x.test/"})])
    assert hit.cached and hit.content == "page https://x.test/"
    secret = {"url": "https://x.test/", "headers": {"Authorization": "Bearer s3cret"}}
    await d.session("c").dispatch([ToolCall("3", "fetch", secret)])
    await d.session("d").dispatch([ToolCall("4", "fetch", secret)])
    assert runs == ["https://x.test/", "https://x.test/", "https://x.test/"]
    assert (await store.statistics()).writes == 1
    [forced] = await d.session("e").dispatch(
        [ToolCall("5", "fetch", {"url": "https://x.test/", "force": True})]
    )
    assert not forced.cached and len(runs) == 4 and (await store.statistics()).writes == 2


def _cached_fetch(runs: list[str]) -> Registry:
    """`fetch(url)`, concurrent and cached (shared scope), noting each URL it really fetches."""

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        runs.append(args["url"])
        return "page " + args["url"]

    schema = {"type": "object", "properties": {"url": {"type": "string"}}}
    return Registry([Tool("fetch", "f", fetch, schema, concurrent=True, deferred=False, cache=CachePolicy())])


class CountingCache(MemoryResultCache):
    """A memory store that counts how pass 1 asks it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, int]] = []
        self._inside = False

    def get(self, key: str) -> Any:
        if not self._inside:  # the memory store's get_many asks get for each key
            self.asked.append(("get", 1))
        return super().get(key)

    def get_many(self, keys: Any) -> Any:
        self.asked.append(("get_many", len(keys)))
        self._inside = True
        try:
            return super().get_many(keys)
        finally:
            self._inside = False


async def test_a_batch_asks_the_result_cache_once() -> None:
    """Pass 1 asks the store for every distinct, unforced, unremembered key of a batch in one get_many."""
    runs: list[str] = []
    reg = _cached_fetch(runs)
    store = CountingCache()
    d = Dispatcher(reg, cache=store)
    urls = ["https://a/", "https://b/", "https://a/", "https://c/"]
    await d.session("warm").dispatch([ToolCall("w", "fetch", {"url": "https://a/"})])
    store.asked.clear()
    s = d.session("s")
    batch = [ToolCall(f"{i}", "fetch", {"url": u}) for i, u in enumerate(urls)]
    batch.append(ToolCall("f", "fetch", {"url": "https://b/", "force": True}))
    results = await s.dispatch(batch)
    assert store.asked == [("get_many", 3)]  # a, b, c: the repeat follows, the forced call skips
    assert [r.cached for r in results] == [True, False, True, False, False]
    assert not results[4].deduped  # forced: it ran again
    assert runs == ["https://a/", "https://b/", "https://c/", "https://b/"]
    store.asked.clear()
    await s.dispatch(batch[:4])  # the same run: all remembered, the store is not asked
    assert store.asked == []


class BrokenStore(MemoryResultCache):
    """A store that fails every lookup, as a remote one might."""

    def get(self, key: str) -> Any:
        raise ConnectionError("the store is down")

    def get_many(self, keys: Any) -> Any:
        raise ConnectionError("the store is down")


async def test_a_store_that_fails_lookups_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    """A result cache that raises on lookup costs the batch nothing: every call runs, with a warning."""
    runs: list[str] = []
    reg = _cached_fetch(runs)
    s = Dispatcher(reg, cache=BrokenStore()).session("s")
    results = await s.dispatch([ToolCall(f"{i}", "fetch", {"url": u}) for i, u in enumerate(["a", "b"])])
    assert [r.content for r in results] == ["page a", "page b"] and runs == ["a", "b"]
    assert any("result cache lookup failed" in r.getMessage() for r in caplog.records)


async def test_session_scoped_cache_stays_in_its_session() -> None:
    """A session-scoped entry serves its own session only."""
    runs: list[int] = []
    reg = Registry(
        [
            Tool(
                "search",
                "s",
                lambda a, c: runs.append(1) or "hits",
                {"type": "object", "properties": {"q": {"type": "string"}}},
                deferred=False,
                cache=CachePolicy(scope="session"),
            )
        ]
    )
    d = Dispatcher(reg, cache=MemoryResultCache())
    a = d.session("a")
    with anyio.fail_after(10):
        await a.dispatch([ToolCall("1", "search", {"q": "x"})])
        a.new_run()
        [own] = await a.dispatch([ToolCall("2", "search", {"q": "x"})])
        [other] = await d.session("b").dispatch([ToolCall("3", "search", {"q": "x"})])
    assert own.cached and not other.cached and len(runs) == 2


async def test_invoke_uses_the_same_passes() -> None:
    """invoke validates, dedupes within its session, and treats every tool as loaded."""
    reg = Registry(
        [
            Tool(
                "weather",
                "Weather.",
                lambda a, c: "sunny",
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            )
        ]
    )
    d = Dispatcher(reg)
    with anyio.fail_after(10):
        ok = await d.invoke("weather", {"city": "Oslo"})
        again = await d.invoke("weather", {"city": "Oslo"})
        bad = await d.invoke("weather", {})
    assert ok.status is Status.ok and again.deduped and bad.status is Status.invalid_arguments


async def test_events_arrive_in_call_order() -> None:
    """Subscribers and on_result see one event per result, in call order."""
    got: list[str] = []
    d, _, _ = setup(on_result=lambda e: got.append("on_result " + e.call.id))
    s = d.session()

    async def sub(event: Any) -> None:
        got.append(f"sub {event.index} {event.result.call_id}")

    s.subscribe(sub)
    await s.dispatch([ToolCall("1", "nap", {"ms": 20}), ToolCall("2", "nap", {"ms": 10})])
    assert got == ["sub 0 1", "on_result 1", "sub 1 2", "on_result 2"]


async def test_output_is_well_formed_and_cut() -> None:
    """Ill-formed output becomes U+FFFD and output over the limit is cut with a marker."""
    reg = Registry(
        [
            Tool("bad", "b", lambda a, c: b"ok \xff\xfe", deferred=False),
            Tool("lone", "l", lambda a, c: "x\ud800y", deferred=False),
            Tool("big", "g", lambda a, c: "é" * 5000, deferred=False),
        ]
    )
    with anyio.fail_after(10):
        results = (
            await Dispatcher(reg, max_output_bytes=1000)
            .session()
            .dispatch([call("1", "bad"), call("2", "lone"), call("3", "big")])
        )
    assert results[0].content == "ok \ufffd\ufffd"
    assert results[1].content == "x\ufffdy"
    assert results[2].content.startswith("é" * 500) and "[output truncated: 10000 bytes" in results[2].content
    for r in results:
        r.content.encode("utf-8")


async def test_unreadable_call_items_do_not_take_siblings_down() -> None:
    """A batch item in no known shape is invalid_arguments; the rest of the batch runs."""
    d, _, _ = setup()
    results = await d.session().dispatch([{"id": "x", "weird": 1}, call("2", "echo", text="a"), 42])
    assert [r.status for r in results] == [Status.invalid_arguments, Status.ok, Status.invalid_arguments]
    assert results[0].call_id == "x"


async def test_provider_shapes_are_accepted_and_answered() -> None:
    """OpenAI chat, Responses and Anthropic call shapes all dispatch; results become tool messages."""
    d, _, _ = setup()
    results = await d.session().dispatch(
        [
            openai_call("c1", "echo", {"text": "a"}),
            {"type": "function_call", "call_id": "c2", "name": "echo", "arguments": '{"text": "b"}'},
            {"type": "tool_use", "id": "c3", "name": "echo", "input": {"text": "c"}},
        ]
    )
    assert [r.content for r in results] == ["a", "b", "c"]
    assert results[0].to_message("openai") == {"role": "tool", "tool_call_id": "c1", "content": "a"}
    fail = (await d.session().dispatch([call("c4", "boom")]))[0].to_message("anthropic")
    assert fail["is_error"] is True and fail["tool_use_id"] == "c4"


# -- faults of the model, the tools and the seams stay with their own call ---------------


class Unprintable(Exception):
    """An exception whose text cannot be made."""

    def __str__(self) -> str:
        raise RuntimeError("no text")


async def test_a_lone_surrogate_in_the_arguments_is_invalid_not_a_crash() -> None:
    """The JSON escape of a lone surrogate, in a value or a key, is invalid_arguments for that call."""
    d, counter, _ = setup()
    s = d.session("s", mode="direct")
    results = await s.dispatch(
        [
            openai_call("v", "echo", '{"text": "\\ud800"}'),
            openai_call("k", "echo", '{"text": "x", "\\udc00": 1}'),
            openai_call("ok", "echo", {"text": "fine"}),
        ]
    )
    assert [r.status for r in results] == [Status.invalid_arguments, Status.invalid_arguments, Status.ok]
    error = results[0].error()
    assert error is not None and "lone surrogate '\\ud800'" in error["error"]
    assert [key for _, key in counter.runs] == ["fine"]


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (Unprintable(), "Unprintable: <Unprintable that cannot be shown>"),
        (ToolError(123), "123"),  # type: ignore[arg-type]  # a message that is not text
    ],
    ids=["unprintable", "message-not-text"],
)
async def test_an_exception_that_cannot_be_printed_is_a_failed_result(
    raised: Exception, expected: str
) -> None:
    """A tool raising an exception whose text cannot be made, or a ToolError whose message is not
    text, still gives a failed result; its sibling is untouched."""

    async def broken(args: Mapping[str, Any], ctx: Any) -> str:
        raise raised

    async def fine(args: Mapping[str, Any], ctx: Any) -> str:
        return "fine"

    reg = Registry(
        [
            Tool("broken", "b", broken, concurrent=True, deferred=False),
            Tool("fine", "f", fine, concurrent=True, deferred=False),
        ]
    )
    s = Dispatcher(reg).session("s")
    bad, good = await s.dispatch([openai_call("b", "broken", {}), openai_call("f", "fine", {})])
    error = bad.error()
    assert bad.status is Status.failed and error is not None and error["error"] == expected
    assert good.content == "fine"


@pytest.mark.parametrize("args", [5, "x", [1, 2]], ids=["int", "str", "list"])
async def test_an_allow_whose_arguments_are_not_an_object_denies(args: Any) -> None:
    """A gate that approves with arguments that are not an object refuses the call; nothing runs."""
    ran: list[Any] = []

    async def guarded(a: Mapping[str, Any], ctx: Any) -> str:
        ran.append(a)
        return "ran"

    reg = Registry([Tool("g", "g", guarded, deferred=False, confirm=True)])
    for gate, decisions in ((lambda c, x: Allow(args=args), None), (None, {"c": Allow(args=args)})):
        s = Dispatcher(reg, gate=gate).session("s")
        [r] = await s.dispatch([openai_call("c", "g", {})], decisions=decisions)
        error = r.error()
        assert r.status is Status.denied and error is not None
        assert "approved with arguments that are not an object" in error["error"]
    assert ran == []


async def test_a_gate_that_fails_in_odd_ways_denies_its_call() -> None:
    """A gate raising an unprintable exception, or returning a value that cannot be shown or a Deny
    whose reason cannot be printed, denies its call and nothing else."""

    class NoRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    answers: list[Any] = [Unprintable(), NoRepr(), Deny(reason=Unprintable())]  # type: ignore[arg-type]

    def gate(c: ToolCall, ctx: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def guarded(a: Mapping[str, Any], ctx: Any) -> str:
        return "ran"

    reg = Registry([Tool("g", "g", guarded, deferred=False, confirm=True)])
    s = Dispatcher(reg, gate=gate).session("s")
    results = await s.dispatch([openai_call(f"c{i}", "g", {"i": i}) for i in range(3)])
    assert [r.status for r in results] == [Status.denied] * 3
    assert "cannot be shown" in results[0].content and "cannot be shown" in results[1].content


async def test_gates_and_hooks_that_edit_what_they_are_shown_change_nothing() -> None:
    """A gate or hook that edits the call's arguments in place edits a copy: the tool runs with
    the arguments that were validated and keyed, and history shows those."""
    got: list[dict[str, Any]] = []

    async def guarded(args: Mapping[str, Any], ctx: Any) -> str:
        got.append(dict(args))
        return "ran"

    def gate(c: ToolCall, ctx: Any) -> Allow:
        c.arguments["n"] = "DROP TABLE"  # type: ignore[index]
        return Allow()

    class Meddler:
        def before(self, c: ToolCall, ctx: Any) -> None:
            c.arguments["extra"] = 1  # type: ignore[index]

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False}
    reg = Registry([Tool("g", "g", guarded, schema, deferred=False, confirm=True)])
    s = Dispatcher(reg, gate=gate, hooks=[Meddler()]).session("s")
    [r] = await s.dispatch([openai_call("c", "g", {"n": 1})])
    assert r.status is Status.ok and got == [{"n": 1}]
    assert dict(s.history[0].args) == {"n": 1}


async def test_two_dispatches_on_one_session_take_turns(autojump_clock: Any) -> None:
    """Two tasks dispatching on one session run one batch after the other: an approval given to
    both runs once, a read is remembered for the second, and serial calls never overlap."""
    d, counter, files = setup(gate=lambda c, x: Interrupt("ask"))

    async def gated(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("gated", args["text"])
        await anyio.sleep(0.01)
        counter.leave()
        return "approved and ran"

    d.registry.add(Tool("gated", "Needs a yes.", gated, TEXT_SCHEMA, deferred=False, confirm=True))
    files["a"] = "v1"
    s = d.session("s", mode="direct")
    gated = [openai_call("g1", "gated", {"text": "x"})]
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(gated)
    batches = [
        (gated, {"g1": Allow()}),
        (gated, {"g1": Allow()}),
        ([openai_call("s1", "serial", {"text": "one"}), openai_call("r1", "read", {"path": "a"})], None),
        ([openai_call("s2", "serial", {"text": "two"}), openai_call("r2", "read", {"path": "a"})], None),
    ]
    found: list[list[Any]] = [[] for _ in batches]

    async def run(i: int) -> None:
        calls, decisions = batches[i]
        found[i] = await s.dispatch(calls, decisions=decisions)

    async with anyio.create_task_group() as nursery:
        for i in range(len(batches)):
            nursery.start_soon(run, i)
    ran = [name for name, _ in counter.runs]
    assert ran.count("gated") == 1 and ran.count("read") == 1
    assert not counter.serial_overlap
    # the second resume finds the first's success remembered: served again, not run again
    resumed = sorted((r.status, r.deduped) for r in found[0] + found[1])
    assert resumed == [(Status.ok, False), (Status.ok, True)]
    assert found[2][1].deduped or found[3][1].deduped


def _gated_file_tools(ran: list[tuple[str, str]]) -> Registry:
    """R reads a path and W writes one; both need confirmation."""

    async def r(args: Mapping[str, Any], ctx: Any) -> str:
        ran.append(("R", args["path"]))
        return f"read {args['path']}"

    async def w(args: Mapping[str, Any], ctx: Any) -> str:
        ran.append(("W", args["path"]))
        return f"wrote {args['path']}"

    def key(args: Mapping[str, Any]) -> set[str]:
        return {f"file:{args['path']}"}

    return Registry(
        [
            Tool("R", "r", r, PATH_SCHEMA, deferred=False, confirm=True, reads=key),
            Tool("W", "w", w, PATH_SCHEMA, deferred=False, confirm=True, writes=key),
        ]
    )


async def test_a_call_reopened_by_a_gates_change_is_never_run_ungated() -> None:
    """When a gate's Allow(args) moves a call, the calls pass 1 decided from it (a follower of a
    moved read, a repeat after a moved write) are refused for a confirmation of their own, not run."""
    ran: list[tuple[str, str]] = []

    def gate(c: ToolCall, ctx: Any) -> Allow:
        return Allow(args={"path": "/x"}) if c.name == "W" else Allow(args={"path": "/safe"})

    s = Dispatcher(_gated_file_tools(ran), gate=gate).session("s", mode="direct")
    r1, w, r2 = await s.dispatch(
        [
            openai_call("r1", "R", {"path": "/x"}),
            openai_call("w", "W", {"path": "/y"}),
            openai_call("r2", "R", {"path": "/x"}),
        ]
    )
    assert ran == [("R", "/safe"), ("W", "/x")]
    assert (r1.content, w.content) == ("read /safe", "wrote /x")
    assert r2.status is Status.denied and "needs a confirmation of its own" in r2.content


async def test_a_follower_of_a_leader_the_gate_moved_does_not_share_its_result() -> None:
    """Two identical gated reads: the gate moves the first; the second is not served the moved
    call's result as if it were its own."""
    ran: list[tuple[str, str]] = []
    s = Dispatcher(_gated_file_tools(ran), gate=lambda c, x: Allow(args={"path": "/other"})).session("s")
    first, second = await s.dispatch(
        [openai_call("a", "R", {"path": "/x"}), openai_call("b", "R", {"path": "/x"})]
    )
    assert ran == [("R", "/other")] and first.content == "read /other"
    assert second.status is Status.denied and "read /other" not in second.content


@pytest.mark.parametrize("how", ["cancelled", "blocked"])
async def test_a_write_that_started_but_never_answered_drops_what_it_may_have_changed(
    how: str, autojump_clock: Any
) -> None:
    """A writer cancelled mid-call, or one whose tool code raised HookBlocked, may have written:
    the next read of what it writes runs again instead of being served the old result."""
    state = {"v": "old"}

    async def rd(args: Mapping[str, Any], ctx: Any) -> str:
        return "value=" + state["v"]

    async def wr(args: Mapping[str, Any], ctx: Any) -> str:
        state["v"] = "new"
        if how == "blocked":
            raise HookBlocked("stop here")
        await anyio.sleep(10)  # waits for an acknowledgement after the effect happened
        return "written"

    def key(args: Mapping[str, Any]) -> set[str]:
        return {"file:/f"}

    reg = Registry(
        [
            Tool("rd", "r", rd, deferred=False, reads=key),
            Tool("wr", "w", wr, deferred=False, writes=key),
        ]
    )
    s = Dispatcher(reg).session("s", mode="direct")
    [first] = await s.dispatch([openai_call("r1", "rd", {})])
    with anyio.move_on_after(1):
        with contextlib.suppress(HookBlocked):
            await s.dispatch([openai_call("w1", "wr", {})])
    [again] = await s.dispatch([openai_call("r2", "rd", {})])
    assert first.content == "value=old"
    assert (again.content, again.deduped) == ("value=new", False)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_tool_that_exits_fails_alone(sync: bool) -> None:
    """A tool that raises SystemExit (argparse inside a tool does) is a failed result; its
    concurrent sibling finishes."""

    async def exits_async(args: Mapping[str, Any], ctx: Any) -> str:
        raise SystemExit(2)

    def exits_sync(args: Mapping[str, Any], ctx: Any) -> str:
        raise SystemExit(2)

    async def sibling(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)
        return "finished"

    reg = Registry(
        [
            Tool("exits", "e", exits_sync if sync else exits_async, concurrent=True, deferred=False),
            Tool("sibling", "s", sibling, concurrent=True, deferred=False),
        ]
    )
    with anyio.fail_after(10):
        bad, good = (
            await Dispatcher(reg)
            .session("s")
            .dispatch([openai_call("e", "exits", {}), openai_call("s", "sibling", {})])
        )
    error = bad.error()
    assert bad.status is Status.failed and error is not None and error["error"] == "SystemExit: 2"
    assert good.content == "finished"


async def test_a_result_cache_that_returns_junk_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    """A store whose lookups return something other than a CacheEntry counts as a miss; the call runs."""

    class JunkStore(MemoryResultCache):
        async def get_many(self, keys: Any) -> Any:
            return {k: "junk" for k in keys}

    reg = _cached_fetch([])
    s = Dispatcher(reg, cache=JunkStore()).session("s")
    [r] = await s.dispatch([ToolCall("1", "fetch", {"url": "a"})])
    assert r.content == "page a" and not r.cached
    assert any("not a CacheEntry" in rec.getMessage() for rec in caplog.records)


async def test_a_tool_call_whose_name_is_not_text_is_rejected() -> None:
    """A ToolCall built in code with a name that is not a string is an unknown tool, not a crash."""
    d, _, _ = setup()
    [r] = await d.session("s").dispatch([ToolCall("1", 5, {})])  # type: ignore[arg-type]
    assert r.status is Status.rejected and "Tool not found: 5" in r.content
