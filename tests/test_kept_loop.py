"""Pass 2's kept-slot loops (`Executor._first_steps`, which starts call after call on the
batch's own task, and `Executor._run_kept`, which runs call after call of a worker; each
keeps its limiter slot from call to call in one frame) answer as the general path does,
for every sequence of calls: ones that never give up the loop, ones that do, sync tools
between them, failures, run control, timeouts, repeated ids, `run_tool`, and what each
handler is told in its ToolContext."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import Dispatcher, DispatchInterrupted, HookBlocked, Registry, Tool, ToolError

from ._fakes import openai_call
from ._fakes import raiser as _raiser
from ._fakes import swallow as _swallow


async def _quick(args: Mapping[str, Any], ctx: Any) -> str:
    """Never gives up the loop: the calls a kept worker runs back to back."""
    return f"{ctx.call_id}|{ctx.tool_name}|{ctx.run_id}|{ctx.round}|{ctx.deadline}|{ctx.session_id}|{args}"


async def _yielding(args: Mapping[str, Any], ctx: Any) -> str:
    await anyio.lowlevel.checkpoint()
    return f"yielded {ctx.call_id} {args}"


def _sync(args: Mapping[str, Any], ctx: Any) -> str:
    return f"sync {ctx.call_id}"


async def _mapping(args: Mapping[str, Any], ctx: Any) -> Any:
    return {"seen": dict(args), "id": ctx.call_id}


async def _huge(args: Mapping[str, Any], ctx: Any) -> str:
    return "\u00e9" * 3000


async def _nested(args: Mapping[str, Any], ctx: Any) -> str:
    # its own inner call: two nested calls' inner calls alike would be served one from the
    # other in whichever order trio (which shuffles runnable tasks) happens to run them
    inner = await ctx.invoke("quick", {"n": 1000 + args["n"]})
    return f"nested {inner.status.value} {inner.content}"


HANDLERS: dict[str, Any] = {
    "quick": _quick,
    "yielding": _yielding,
    "sync": _sync,
    "mapping": _mapping,
    "huge": _huge,
    "swallow": _swallow,
    "nested": _nested,
    "tool_error": _raiser(ToolError("nope", retryable=False)),
    "value_error": _raiser(ValueError("bad")),
    "blocked": _raiser(HookBlocked("stop here")),
    "interrupted": _raiser(DispatchInterrupted([])),
}


class _Nothing:
    """A hook that does nothing: its presence alone sends every call the general way."""

    def after(self, call: Any, result: Any, ctx: Any) -> None:
        return None


def _registry() -> Registry:
    return Registry(
        [
            Tool(
                name,
                name,
                handler,
                {"type": "object"},
                concurrent=True,
                deferred=False,
                timeout=0.05 if name == "swallow" else 10.0,
            )
            for name, handler in HANDLERS.items()
        ]
    )


_REGISTRY = _registry()

_items = st.lists(
    st.tuples(
        st.sampled_from([*HANDLERS, *["quick"] * 8, "run_tool", "missing"]),
        st.integers(0, 30),  # the argument: equal ones are served again (dedupe)
        st.integers(0, 20),  # under 3, the call id is an earlier one's (a repeated id)
    ),
    min_size=1,
    max_size=16,
)


def _item(name: str, n: int, k: int) -> dict[str, Any]:
    if name == "run_tool":
        return openai_call(f"c{k}", "run_tool", {"name": "quick", "args": {"n": n}})
    return openai_call(f"c{k}", name, {"n": n})


def _batch(picks: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    return [_item(name, n, k if k < 3 else i + 3) for i, (name, n, k) in enumerate(picks)]


async def _outcome(d: Dispatcher, items: list[dict[str, Any]], batches: int) -> Any:
    s = d.session("s")
    seen: list[Any] = []
    for _ in range(batches):
        try:
            results = await s.dispatch(items)
            seen.append([(r.call_id, r.name, r.status.value, r.content, r.deduped) for r in results])
        except BaseException as exc:  # run control is what is compared
            seen.append(type(exc).__name__)
    assert d.limiter.borrowed_tokens == 0
    stats = d.statistics()
    assert (stats.in_use, stats.waiting) == (0, 0)
    history = [(e.call_id, e.name, e.status.value, e.content) for e in s.history]
    # the handlers' own calls (`ctx.invoke`) are kept as each ends: those of two handlers
    # that run side by side, in whichever order trio (which shuffles runnable tasks) runs them
    nested = sorted(e for e in history if e[0].startswith("invoke_"))
    return seen, [e for e in history if not e[0].startswith("invoke_")], nested, s.statistics().executed


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_items, st.integers(1, 3), st.integers(1, 2))
def test_the_kept_loop_answers_as_the_general_path(
    picks: list[tuple[str, int, int]], limit: int, batches: int
) -> None:
    items = _batch(picks)

    async def main() -> None:
        fast = Dispatcher(_REGISTRY, max_concurrent=limit, max_output_bytes=2000)
        general = Dispatcher(_REGISTRY, max_concurrent=limit, max_output_bytes=2000, hooks=[_Nothing()])
        assert await _outcome(fast, items, batches) == await _outcome(general, items, batches)

    trio.run(main)


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_a_long_batch_of_quick_calls_runs_on_one_kept_slot(limit: int) -> None:
    """Calls that never give up the loop are run one after the other on the batch's own
    task, each told its own id and name, all on the slot it keeps."""

    async def main() -> None:
        d = Dispatcher(_REGISTRY, max_concurrent=limit)
        s = d.session("s")
        items = [openai_call(f"q{i}", "quick", {"n": i}) for i in range(50)]
        results = await s.dispatch(items)
        assert [r.call_id for r in results] == [f"q{i}" for i in range(50)]
        assert [r.content for r in results] == [f"q{i}|quick|1|1|None|s|{{'n': {i}}}" for i in range(50)]
        assert d.limiter.borrowed_tokens == 0
        # a sync call in the middle, and a call that gives up the loop, break the run of kept calls
        items[20] = openai_call("q20", "sync", {"n": 20})
        items[30] = openai_call("q30", "yielding", {"n": 30})
        results = await s.dispatch(items)
        assert results[20].content == "sync q20" and results[30].content == "yielded q30 {'n': 30}"
        assert all(r.status.value == "ok" for r in results)
        assert d.limiter.borrowed_tokens == 0

    trio.run(main)


def test_a_batch_past_its_deadline_says_so_on_the_kept_path() -> None:
    """A run whose deadline passed while the kept worker ran: the calls after it are
    expired, as the general path says."""

    async def late(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.05)
        return "done"

    registry = Registry(
        [
            Tool("quick", "quick", _quick, {"type": "object"}, concurrent=True, deferred=False),
            Tool("late", "late", late, {"type": "object"}, concurrent=True, deferred=False),
        ]
    )

    async def run(hooks: list[Any]) -> Any:
        d = Dispatcher(registry, max_concurrent=1, hooks=hooks)
        s = d.session("s")
        s.new_run(deadline=trio.current_time() + 0.02)
        items = [openai_call("a", "quick", {"n": 1}), openai_call("b", "late", {"n": 1})]
        items += [openai_call(f"c{i}", "quick", {"n": i + 2}) for i in range(3)]
        results = await s.dispatch(items)
        return [(r.call_id, r.status.value, r.content.split("|")[0][:20]) for r in results]

    async def main() -> None:
        assert await run([]) == await run([_Nothing()])
        assert [status for _, status, _ in await run([])][2:] == ["expired"] * 3

    trio.run(main)


def test_contexts_told_to_handlers_name_their_own_call() -> None:
    """Each kept call's ToolContext is its own: its id, tool name, run, round and deadline."""
    told: list[Any] = []

    async def keep(args: Mapping[str, Any], ctx: Any) -> str:
        told.append(ctx)
        return json.dumps([ctx.call_id, ctx.tool_name, ctx.run_id, ctx.round, ctx.deadline])

    registry = Registry([Tool("keep", "keep", keep, {"type": "object"}, concurrent=True, deferred=False)])

    async def main() -> None:
        d = Dispatcher(registry, max_concurrent=1)
        s = d.session("s")
        s.new_run(deadline=trio.current_time() + 60)
        await s.dispatch([openai_call(f"k{i}", "keep", {"n": i}) for i in range(10)])
        assert [c.call_id for c in told] == [f"k{i}" for i in range(10)]
        assert {(c.tool_name, c.run_id, c.round, c.session_id) for c in told} == {("keep", 2, 1, "s")}
        assert len({id(c) for c in told}) == 10

    trio.run(main)


@pytest.mark.parametrize("at", [0.0, 0.01, 0.03])
def test_a_batch_cancelled_while_its_kept_worker_runs_lands_as_the_general_path(at: float) -> None:
    """The caller's scope cancelled while a worker runs kept calls: the same calls finished
    and kept in history, the limiter whole again."""

    async def slowish(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.01)
        return f"slow {ctx.call_id}"

    registry = Registry(
        [
            Tool("quick", "quick", _quick, {"type": "object"}, concurrent=True, deferred=False),
            Tool("slowish", "slowish", slowish, {"type": "object"}, concurrent=True, deferred=False),
        ]
    )

    async def run(hooks: list[Any]) -> Any:
        d = Dispatcher(registry, max_concurrent=1, hooks=hooks)
        s = d.session("s")
        items = [openai_call(f"a{i}", "slowish" if i % 4 == 3 else "quick", {"n": i}) for i in range(16)]
        with trio.move_on_after(at):
            await s.dispatch(items)
        assert d.limiter.borrowed_tokens == 0
        return [(e.call_id, e.status.value) for e in s.history]

    async def main() -> None:
        fast, general = await run([]), await run([_Nothing()])
        assert fast == general
        assert 0 < len(fast) < 16  # cut part way

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))  # the same cut each time


def test_a_group_is_watched_at_its_shortest_timeout() -> None:
    """The supervisor of a group sleeps at most the shortest timeout of the group's tools:
    a call of the shortest, started while it sleeps, is cut at its own deadline."""

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.01)
        return "slow"

    registry = Registry(
        [
            Tool("slow", "slow", slow, {"type": "object"}, concurrent=True, deferred=False, timeout=10.0),
            Tool(
                "swallow",
                "swallow",
                _swallow,
                {"type": "object"},
                concurrent=True,
                deferred=False,
                timeout=0.05,
            ),
            Tool("quick", "quick", _quick, {"type": "object"}, concurrent=True, deferred=False),
        ]
    )

    async def main() -> None:
        d = Dispatcher(registry, max_concurrent=1, timeout=30.0)
        s = d.session("s")
        items = [openai_call(f"s{i}", "slow", {"n": i}) for i in range(3)]
        items += [openai_call("q", "quick", {"n": 0}), openai_call("w", "swallow", {"n": 0})]
        began = trio.current_time()
        results = await s.dispatch(items)
        assert [r.status.value for r in results] == ["ok"] * 4 + ["timed_out"]
        assert trio.current_time() - began < 1.0  # cut at 0.05 s, not at another tool's timeout

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
