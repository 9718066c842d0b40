"""More attacks on a concurrent group whose plain async calls start on the batch's own task
(on trio), its task group opened only once one of them waits, beneath whatever that call's
first step left open. Each test drives the fast path and, where useful, the general path
(the same dispatcher with a hook that does nothing) and asks for the same outcome; every
dispatch is checked to leave the caller's task as it was and every limiter slot given back."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from dispatcher import Dispatcher, DispatchInterrupted, HookBlocked, Status, ToolCall

from ._fakes import group_dispatcher, numbered_calls

Handler = Callable[[Mapping[str, Any], Any], Any]

# Every test here takes trio's autojump clock: times are exact.


make = group_dispatcher
calls = numbered_calls


def outcome(results: list[Any]) -> list[tuple[str, str, str]]:
    return [(r.call_id, r.status.value, r.content) for r in results]


def assert_slots_back(d: Dispatcher) -> None:
    assert d.limiter.borrowed_tokens == 0
    assert d.statistics().in_use == 0


class Caller:
    """The caller's task as it stands before a dispatch, to compare after."""

    def __init__(self) -> None:
        self.task = trio.lowlevel.current_task()
        self.status = self.task._cancel_status
        self.nurseries = list(self.task.child_nurseries)

    def check(self) -> None:
        assert self.task._cancel_status is self.status
        assert self.task.child_nurseries == self.nurseries


async def checked(d: Dispatcher, batch: list[ToolCall], session: str = "s") -> list[Any]:
    """Dispatch; then the caller's task is as it was and every slot is back."""
    caller = Caller()
    try:
        return await d.session(session).dispatch(batch)
    finally:
        caller.check()
        assert_slots_back(d)


class Counter:
    """Counts the handlers running at once, the most at once, and the order of starts."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.starts: list[str] = []
        self.ends: dict[str, float] = {}

    @contextlib.contextmanager
    def one(self, ctx: Any) -> Any:
        self.starts.append(ctx.call_id)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            yield
        finally:
            self.running -= 1
            self.ends[ctx.call_id] = trio.current_time()


async def quick(args: Mapping[str, Any], ctx: Any) -> str:
    return f"quick {ctx.call_id}"


async def nap(args: Mapping[str, Any], ctx: Any) -> str:
    await trio.sleep(1)
    return f"napped {ctx.call_id}"


async def long(args: Mapping[str, Any], ctx: Any) -> str:
    await trio.sleep(10)
    return "long"


def sync(args: Mapping[str, Any], ctx: Any) -> str:
    return f"sync {ctx.call_id}"


async def both(
    body: Callable[[Dispatcher], Awaitable[Any]], *handlers: Handler, **kw: Any
) -> tuple[Any, Any]:
    """`body(dispatcher)` on the fast path and on the general path, each from time zero."""
    fast_began = trio.current_time()
    fast = await body(make(*handlers, **kw))
    fast_took = trio.current_time() - fast_began
    general_began = trio.current_time()
    general = await body(make(*handlers, general=True, **kw))
    general_took = trio.current_time() - general_began
    return (fast, fast_took), (general, general_took)


# --- contextvars -------------------------------------------------------------------------

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("threepass_attack_var", default="unset")


async def setter(args: Mapping[str, Any], ctx: Any) -> str:
    VAR.set(ctx.call_id)
    await trio.sleep(1)
    return f"set {VAR.get()}"


async def reader(args: Mapping[str, Any], ctx: Any) -> str:
    return f"read {VAR.get()}"


async def test_a_contextvar_set_in_a_first_step_reaches_neither_sibling_nor_caller(
    autojump_clock: Any,
) -> None:
    """A call that sets a context variable in its first step, then waits, beside one that
    reads it: the reader sees what it would on the general path (each call on a task of
    its own context), and the caller's own context is untouched."""

    async def body(d: Dispatcher) -> Any:
        token = VAR.set("caller")
        try:
            results = await checked(d, calls("setter", "reader", "reader"))
            return outcome(results), VAR.get()
        finally:
            VAR.reset(token)

    (fast, _), (general, _) = await both(body, setter, reader)
    assert general == (
        [("c0", "ok", "set c0"), ("c1", "ok", "read caller"), ("c2", "ok", "read caller")],
        "caller",
    )
    assert fast == general


@pytest.mark.parametrize("limit", [1, 2, 3])
async def test_a_contextvar_set_by_a_call_on_a_worker_reaches_not_its_next_call(
    autojump_clock: Any, limit: int
) -> None:
    """A nap on the batch's task, then a setter and readers, which land on a worker one
    after another (limit 2), on the batch's task after its nap (limit 1) or spread: each
    reader sees the caller's value, on the fast path and the general one alike."""

    async def body(d: Dispatcher) -> Any:
        token = VAR.set("caller")
        try:
            results = await checked(d, calls("nap", "setter", "reader", "reader"))
            return outcome(results), VAR.get()
        finally:
            VAR.reset(token)

    (fast, _), (general, _) = await both(body, nap, setter, reader, limit=limit)
    assert fast == general
    assert [content for _, _, content in fast[0]][1:] == ["set c1", "read caller", "read caller"]
    assert fast[1] == "caller"


async def test_a_contextvar_set_by_a_lone_call_stays_its_own(autojump_clock: Any) -> None:
    """A lone call that sets a context variable, before it first waits and after: the caller
    reads its own value after the dispatch, and the next batch's call sees the caller's."""

    async def setter_twice(args: Mapping[str, Any], ctx: Any) -> str:
        VAR.set("first step")
        await trio.sleep(1)
        VAR.set("later step")
        return f"set {VAR.get()}"

    d = make(setter_twice, reader)
    s = d.session("s")
    token = VAR.set("caller")
    try:
        [set_] = await s.dispatch(calls("setter_twice"))
        assert set_.content == "set later step" and VAR.get() == "caller"
        [read] = await s.dispatch([ToolCall("r", "reader", {"n": 9})])
        assert read.content == "read caller" and VAR.get() == "caller"
    finally:
        VAR.reset(token)


# --- KeyboardInterrupt, HookBlocked, DispatchInterrupted raised by a tool ----------------


def _signals() -> dict[str, Handler]:
    async def ki_now(args: Mapping[str, Any], ctx: Any) -> str:
        raise KeyboardInterrupt

    async def ki_later(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        raise KeyboardInterrupt

    async def block_now(args: Mapping[str, Any], ctx: Any) -> str:
        raise HookBlocked("no")

    async def block_later(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        raise HookBlocked("no later")

    async def interrupt_now(args: Mapping[str, Any], ctx: Any) -> str:
        raise DispatchInterrupted([])

    async def interrupt_later(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        raise DispatchInterrupted([])

    return {f.__name__: f for f in (ki_now, ki_later, block_now, block_later, interrupt_now, interrupt_later)}


SIGNALS = _signals()
_RAISED = {"ki": KeyboardInterrupt, "block": HookBlocked, "interrupt": DispatchInterrupted}


@pytest.mark.parametrize("signal", sorted(SIGNALS))
@pytest.mark.parametrize("where", [0, 1, 3])
@pytest.mark.parametrize("limit", [1, 2, 4])
async def test_run_control_raised_by_a_tool_lets_its_siblings_finish(
    autojump_clock: Any, signal: str, where: int, limit: int
) -> None:
    """A tool that raises KeyboardInterrupt, HookBlocked or DispatchInterrupted, first in
    the group, among quick ones, or after naps (so on the batch's task, on a worker, or on
    the batch's task again): every sibling still runs to its end, then the signal
    propagates; as on the general path."""
    ended: list[str] = []

    async def napper(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(1)
        ended.append(ctx.call_id)
        return "napped"

    async def quickly(args: Mapping[str, Any], ctx: Any) -> str:
        ended.append(ctx.call_id)
        return "quick"

    names = ["napper", "quickly", "napper", "quickly", "napper"]
    names.insert(where, signal)
    kind = _RAISED[signal.split("_")[0]]

    async def body(d: Dispatcher) -> Any:
        ended.clear()
        with pytest.raises(kind):
            await checked(d, calls(*names))
        return sorted(ended)

    (fast, fast_took), (general, general_took) = await both(
        body, napper, quickly, SIGNALS[signal], limit=limit
    )
    assert fast == general == sorted(f"c{i}" for i, n in enumerate(names) if n != signal)
    assert fast_took == general_took


# --- cancelling the dispatch from outside ------------------------------------------------


async def cut_from_outside(
    d: Dispatcher, batch: list[ToolCall], at: float, *, fail: bool = False
) -> tuple[bool, float]:
    """Dispatch under the caller's own deadline `at` seconds from now (move_on_after, or
    fail_after): whether it was cut, and when it returned. The caller's task is as it was,
    every slot is back, and the session runs the next batch."""
    caller = Caller()
    began = trio.current_time()
    s = d.session("s")
    cut = False
    if fail:
        try:
            with trio.fail_after(at):
                await s.dispatch(batch)
        except trio.TooSlowError:
            cut = True
    else:
        with trio.move_on_after(at) as scope:
            await s.dispatch(batch)
        cut = scope.cancelled_caught
    took = trio.current_time() - began
    caller.check()
    assert_slots_back(d)
    s.new_run()
    [again] = await s.dispatch([ToolCall("again", "quick", {"n": -1})])
    assert again.status is Status.ok
    caller.check()
    assert_slots_back(d)
    return cut, took


@pytest.mark.parametrize("fail", [False, True])
@pytest.mark.parametrize(
    ("names", "at", "took"),
    [
        # during the batch task's own wait, workers beside it
        (("nap", "long", "long", "quick"), 0.5, 0.5),
        # after the batch task's call ended, workers still running
        (("nap", "long", "long"), 2.0, 2.0),
        # during a call the batch task started after its first one ended (limit 2)
        (("nap", "long", "long", "quick", "long"), 3.0, 3.0),
        # every call waits
        (("long",) * 6, 4.0, 4.0),
    ],
)
@pytest.mark.parametrize("limit", [2, 3, None])
async def test_the_callers_deadline_cuts_everything_wherever_it_lands(
    autojump_clock: Any, names: tuple[str, ...], at: float, took: float, fail: bool, limit: int | None
) -> None:
    """The caller's deadline lands while the batch's task waits in its own call, after that
    call ended while workers still run, or while the batch's task runs a later call: the
    dispatch is cut then, with nothing left open; as on the general path."""

    async def body(d: Dispatcher) -> Any:
        return await cut_from_outside(d, calls(*names), at, fail=fail)

    (fast, _), (general, _) = await both(body, nap, long, quick, limit=limit)
    assert fast == general == (True, took)


async def test_the_callers_scope_cancelled_by_a_first_step_cuts_the_group(autojump_clock: Any) -> None:
    """A quick call's first step cancels the caller's own scope (the caller's deadline,
    landing between the calls started inline): the calls after it that wait are cut at
    their first wait, and nothing is left open."""
    scopes: list[trio.CancelScope] = []
    started: list[str] = []

    async def canceller(args: Mapping[str, Any], ctx: Any) -> str:
        started.append(ctx.call_id)
        scopes[-1].cancel()
        return "cancelled the caller"

    async def napper(args: Mapping[str, Any], ctx: Any) -> str:
        started.append(ctx.call_id)
        await trio.sleep(1)
        return "napped"

    async def body(d: Dispatcher) -> Any:
        started.clear()
        caller = Caller()
        with trio.CancelScope() as scope:
            scopes.append(scope)
            await d.session("s").dispatch(calls("quick", "canceller", "napper", "quick", "napper"))
        caller.check()
        assert_slots_back(d)
        return scope.cancelled_caught, trio.current_time()

    (fast, fast_took), (general, general_took) = await both(body, quick, canceller, napper)
    assert fast[0] and general[0]
    assert fast_took == general_took == 0.0


async def test_the_callers_deadline_passing_during_a_first_step(autojump_clock: Any) -> None:
    """A first step that takes 2 s (the virtual clock jumps) under a caller's deadline of
    1 s: the next call that waits is cut, nothing is left open, as on the general path."""

    async def slow_step(args: Mapping[str, Any], ctx: Any) -> str:
        autojump_clock.jump(2)
        return "slow"

    async def body(d: Dispatcher) -> Any:
        return await cut_from_outside(d, calls("quick", "slow_step", "nap", "quick", "nap"), 1.0)

    (fast, _), (general, _) = await both(body, quick, slow_step, nap)
    assert fast == general
    assert fast[0] is True


async def test_a_caller_already_cancelled_gets_right_results_or_the_cancellation(autojump_clock: Any) -> None:
    """A dispatch of calls that never wait, made in a scope already cancelled: the right
    results (the general path too returns them when its worker ends before its supervisor
    first runs; trio picks), or the cancellation; nothing left open either way."""

    async def body(d: Dispatcher) -> Any:
        caller = Caller()
        got: Any = "cancelled"
        with trio.CancelScope() as scope:
            scope.cancel()
            got = outcome(await d.session("s").dispatch(calls("quick", "quick", "quick")))
        caller.check()
        assert_slots_back(d)
        return got, scope.cancelled_caught

    (fast, _), (general, _) = await both(body, quick)
    right = ([(f"c{i}", "ok", f"quick c{i}") for i in range(3)], False)
    assert fast in (right, ("cancelled", True)) and general in (right, ("cancelled", True))


# --- shields, scopes by hand, nursery.start ------------------------------------------------


async def test_a_shield_in_a_first_step_holds_off_the_callers_cut_for_that_call_only(
    autojump_clock: Any,
) -> None:
    """A call shields 3 s of its first step's wait; the caller cuts at 1 s: its siblings
    stop at 1 s, the dispatch returns once the shield ends (3 s), as on the general path."""
    stopped: dict[str, float] = {}

    async def shielded(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope(shield=True):
            await trio.sleep(3)
        stopped[ctx.call_id] = trio.current_time()
        await trio.sleep(10)
        return "never"

    async def watched(args: Mapping[str, Any], ctx: Any) -> str:
        try:
            await trio.sleep(10)
        finally:
            stopped[ctx.call_id] = trio.current_time()
        return "never"

    for first in ("shielded", "watched"):
        names = (first, "watched" if first == "shielded" else "shielded", "watched")

        async def body(d: Dispatcher, names: tuple[str, ...] = names) -> Any:
            stopped.clear()
            began = trio.current_time()
            cut = await cut_from_outside(d, calls(*names), 1.0)
            return cut, sorted((k, v - began) for k, v in stopped.items())

        (fast, _), (general, _) = await both(body, shielded, watched, quick)
        assert fast == general
        assert fast[0] == (True, 3.0)


async def test_a_shielded_call_is_timed_out_when_its_shield_ends(autojump_clock: Any) -> None:
    """A call whose first step shields a wait longer than its timeout is timed_out when
    the shield ends; a sibling is unharmed; as on the general path."""

    async def shielded(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.CancelScope(shield=True):
            await trio.sleep(3)
        return "late"

    async def body(d: Dispatcher) -> Any:
        return outcome(await checked(d, calls("shielded", "nap", "shielded", "nap")))

    (fast, fast_took), (general, general_took) = await both(
        body, shielded, nap, timeouts={"shielded": 2.0}, limit=4
    )
    assert fast == general and fast_took == general_took == 3.0
    assert [s for _, s, _ in fast] == ["timed_out", "ok", "timed_out", "ok"]


async def test_a_scope_entered_by_hand_and_left_later_keeps_to_its_call(autojump_clock: Any) -> None:
    """A first step enters a scope of 0.5 s by hand and leaves it by hand in a later step,
    once it fired and cut that wait (or, in the other tool, before it fires, with an
    ExitStack), then waits past its timeout: each is timed_out at exactly its own timeout,
    its siblings (naps of 1 s, started beside it) are ok."""
    fired: list[bool] = []

    async def by_hand(args: Mapping[str, Any], ctx: Any) -> str:
        scope = trio.CancelScope(deadline=trio.current_time() + 0.5)
        scope.__enter__()
        try:
            await trio.sleep(1)
        except trio.Cancelled as exc:
            fired.append(scope.__exit__(type(exc), exc, exc.__traceback__))
        else:  # pragma: no cover - the scope fires first
            scope.__exit__(None, None, None)
        await trio.sleep(100)
        return "never"

    async def stacked(args: Mapping[str, Any], ctx: Any) -> str:
        with contextlib.ExitStack() as stack:
            stack.enter_context(trio.move_on_after(50))
            await trio.sleep(0.25)
            stack.close()  # its own scope goes, the call's stays
            await trio.sleep(100)
        return "never"

    async def body(d: Dispatcher) -> Any:
        fired.clear()
        began = trio.current_time()
        results = await checked(d, calls("by_hand", "nap", "stacked", "nap", "by_hand", "stacked"))
        return outcome(results), trio.current_time() - began, list(fired)

    (fast, _), (general, _) = await both(body, by_hand, stacked, nap, timeout=2.0, limit=6)
    assert fast == general
    assert [s for _, s, _ in fast[0]] == ["timed_out", "ok", "timed_out", "ok", "timed_out", "timed_out"]
    assert fast[1] == 2.0 and fast[2] == [True, True]


async def test_a_first_step_that_cancels_its_own_scope_at_once(autojump_clock: Any) -> None:
    """A first step opens a scope and cancels it before it waits: only that call's wait is
    cut; the siblings started after it, beneath it, are not."""

    async def self_cut(args: Mapping[str, Any], ctx: Any) -> str:
        began = trio.current_time()
        with trio.CancelScope() as scope:
            scope.cancel()
            await trio.sleep(5)
        await trio.sleep(0.25)
        return f"cut at {trio.current_time() - began}"

    async def body(d: Dispatcher) -> Any:
        return outcome(await checked(d, calls("self_cut", "nap", "self_cut", "nap")))

    (fast, _), (general, _) = await both(body, self_cut, nap, limit=2)
    assert fast == general
    assert [s for _, s, _ in fast] == ["ok"] * 4
    assert [c for _, _, c in fast][1::2] == ["napped c1", "napped c3"]
    assert fast[0][2] == "cut at 0.25"


@pytest.mark.parametrize("where", [0, 1, 2])
async def test_nursery_start_in_a_first_step_wherever_it_falls(autojump_clock: Any, where: int) -> None:
    """A call that awaits `nursery.start` in its first step, on the batch's task or on a
    worker: its server is cancelled at its timeout, its siblings finish; the caller's cut
    afterwards leaves nothing open; as on the general path."""
    stopped: dict[str, float] = {}

    async def server(name: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(0.5)
        task_status.started("up")
        try:
            await trio.sleep_forever()
        finally:
            stopped[name] = trio.current_time()

    async def starter(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            assert await nursery.start(server, ctx.call_id) == "up"
            nursery.start_soon(server, ctx.call_id + "b")
        return "never"

    names = ["nap", "nap", "nap"]
    names.insert(where, "starter")

    async def body(d: Dispatcher) -> Any:
        stopped.clear()
        began = trio.current_time()
        results = await checked(d, calls(*names))
        return outcome(results), sorted((k, v - began) for k, v in stopped.items())

    (fast, _), (general, _) = await both(body, starter, nap, timeouts={"starter": 2.5}, limit=4)
    assert fast == general
    assert fast[1] == [(f"c{where}", 2.5), (f"c{where}b", 2.5)]


async def test_nursery_start_cut_by_the_caller_while_starting(autojump_clock: Any) -> None:
    """The caller's deadline lands while a first step waits in `nursery.start` (its child
    not started yet): everything is cut, nothing is left open."""

    async def server(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(5)
        task_status.started()

    async def starter(args: Mapping[str, Any], ctx: Any) -> str:
        async with trio.open_nursery() as nursery:
            await nursery.start(server)
        return "never"

    async def body(d: Dispatcher) -> Any:
        return await cut_from_outside(d, calls("starter", "nap", "starter", "long"), 2.0)

    (fast, _), (general, _) = await both(body, starter, nap, long, quick, limit=3)
    assert fast == general == (True, 2.0)


# --- a call's own nursery failing, exception groups, swallowed cancellations ---------------


async def test_a_calls_own_nursery_failing_never_reaches_its_siblings(autojump_clock: Any) -> None:
    """A first step opens a nursery whose child raises after 0.5 s (and another whose child
    raises KeyboardInterrupt, inside a group): that call fails alone, or signals once its
    siblings finish; the naps beside it are ok; as on the general path."""

    async def child_fails(args: Mapping[str, Any], ctx: Any) -> str:
        async def child() -> None:
            await trio.sleep(0.5)
            raise ValueError("child broke")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep(10)
        return "never"

    async def body(d: Dispatcher) -> Any:
        results = await checked(d, calls("child_fails", "nap", "child_fails", "nap", "nap"))
        return outcome(results)

    (fast, fast_took), (general, general_took) = await both(body, child_fails, nap, limit=3)
    assert fast == general and fast_took == general_took
    assert [s for _, s, _ in fast] == ["failed", "ok", "failed", "ok", "ok"]
    assert "child broke" in fast[0][2]


async def test_a_ki_in_a_calls_own_nursery_lets_siblings_finish(autojump_clock: Any) -> None:
    """A KeyboardInterrupt raised by a child of a nursery a call opened in its first step: the
    naps beside it all run to their end, then the KeyboardInterrupt propagates, at the same
    moment as on the general path."""
    ended: list[str] = []

    async def child_ki(args: Mapping[str, Any], ctx: Any) -> str:
        async def child() -> None:
            await trio.sleep(0.5)
            raise KeyboardInterrupt

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await trio.sleep(10)
        return "never"

    async def napper(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(1)
        ended.append(ctx.call_id)
        return "napped"

    async def body(d: Dispatcher) -> Any:
        ended.clear()
        with pytest.raises(KeyboardInterrupt):
            await checked(d, calls("child_ki", "napper", "napper", "child_ki", "napper"))
        return sorted(ended), trio.current_time()

    (fast, fast_took), (general, general_took) = await both(body, child_ki, napper, limit=2)
    assert fast[0] == general[0] == ["c1", "c2", "c4"]
    assert fast_took == general_took


def _groups() -> list[Handler]:
    async def group_now(args: Mapping[str, Any], ctx: Any) -> str:
        raise BaseExceptionGroup("now", [ValueError("a"), GeneratorExit()])

    async def group_later(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        raise ExceptionGroup("later", [ValueError("b"), KeyError("c")])

    async def group_ki(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.5)
        raise BaseExceptionGroup("ki", [ValueError("d"), BaseExceptionGroup("in", [KeyboardInterrupt()])])

    async def group_timed(args: Mapping[str, Any], ctx: Any) -> str:
        # its own timeout's cancellation, and a failure, in one group
        async def breaks() -> None:
            try:
                await trio.sleep_forever()
            finally:
                raise ValueError("broke while cut")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(breaks)
            await trio.sleep_forever()
        return "never"

    return [group_now, group_later, group_ki, group_timed]


GROUPS = _groups()


@pytest.mark.parametrize("names", [("group_now", "group_later"), ("group_ki", "group_now"), ("group_timed",)])
@pytest.mark.parametrize("limit", [1, 2, 4])
async def test_tools_that_raise_exception_groups(
    autojump_clock: Any, names: tuple[str, ...], limit: int
) -> None:
    """Tools that raise exception groups (of failures, of a KeyboardInterrupt, of their own
    cut and a failure, each first in the group and so on the batch's task) between naps:
    the same results, or the same signal after the same siblings, as on the general path
    (which, for the cut and a failure, is broken: see the test after this one)."""
    batch = [n for name in names for n in (name, "nap")]
    if names == ("group_timed",):  # the general path's fault, shown below: compare the fast path alone
        results = await checked(make(nap, *GROUPS, timeout=2.0, limit=limit), calls(*batch))
        assert [r.status for r in results] == [Status.failed, Status.ok]
        assert "broke while cut" in results[0].content
        return

    async def body(d: Dispatcher) -> Any:
        try:
            return outcome(await checked(d, calls(*batch)))
        except KeyboardInterrupt:
            return "KeyboardInterrupt"

    (fast, fast_took), (general, general_took) = await both(body, nap, *GROUPS, timeout=2.0, limit=limit)
    assert fast == general and fast_took == general_took


async def test_a_call_that_swallows_its_cut_and_returns_is_timed_out_alone(autojump_clock: Any) -> None:
    """Calls that swallow their own timeout's cancellation and return late (in their first
    step's scope, or outside any), wherever they fall: timed_out, the naps beside them ok,
    each call ending when it should; as on the general path."""

    async def swallower(args: Mapping[str, Any], ctx: Any) -> str:
        with contextlib.suppress(trio.Cancelled):
            await trio.sleep(10)
        await trio.sleep(0.25)  # not cut again: it was cut once, and it swallowed it
        return "late"

    async def wrapped(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(50):
            with contextlib.suppress(trio.Cancelled):
                await trio.sleep(10)
        return "late too"

    async def body(d: Dispatcher) -> Any:
        results = await checked(d, calls("swallower", "nap", "wrapped", "swallower", "nap", "wrapped"))
        return outcome(results)

    for limit in (1, 2, 6):
        (fast, fast_took), (general, general_took) = await both(
            body, swallower, wrapped, nap, timeout=2.0, limit=limit
        )
        assert fast == general and fast_took == general_took, limit
        assert [s for _, s, _ in fast] == ["timed_out", "ok", "timed_out", "timed_out", "ok", "timed_out"]


async def test_a_call_that_swallows_the_callers_cut(autojump_clock: Any) -> None:
    """A call on the batch's task swallows the caller's cancellation and returns: the
    dispatch is still cut, nothing is left open, the slots are back."""

    async def stubborn(args: Mapping[str, Any], ctx: Any) -> str:
        with contextlib.suppress(trio.Cancelled):
            await trio.sleep(10)
        return "stubborn"

    async def body(d: Dispatcher) -> Any:
        return await cut_from_outside(d, calls("stubborn", "long", "nap", "long"), 0.5)

    (fast, _), (general, _) = await both(body, stubborn, long, nap, quick, limit=2)
    assert fast == general
    assert fast[0] is True


# --- mixed sync and async, run deadlines --------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [
        ("sync", "nap", "quick", "nap"),
        ("nap", "sync", "quick", "sync", "nap"),
        ("quick", "quick", "sync", "nap", "sync"),
        ("nap", "nap", "nap", "sync", "quick", "quick"),
        ("quick", "sync"),
        ("nap", "sync"),
    ],
)
@pytest.mark.parametrize("limit", [1, 2, 3, None])
async def test_groups_mixing_sync_and_async_tools(names: tuple[str, ...], limit: int | None) -> None:
    """Sync tools (run in threads; on the real clock, since the virtual one would jump past
    their timeouts while a thread runs) among async ones: the same results as the general
    path, every slot back, the limit never exceeded, the naps started in program order."""
    counter = Counter()

    async def counted_nap(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            await trio.sleep(0.02)
        return f"napped {ctx.call_id}"

    def counted_sync(args: Mapping[str, Any], ctx: Any) -> str:
        return f"sync {ctx.call_id}"

    counted_nap.__name__ = "nap"
    counted_sync.__name__ = "sync"

    async def body(d: Dispatcher) -> Any:
        counter.most = 0
        counter.starts.clear()
        with trio.fail_after(10):
            results = await checked(d, calls(*names))
        return outcome(results), counter.most, list(counter.starts)

    (fast, _), (general, _) = await both(body, counted_nap, quick, counted_sync, limit=limit, timeout=10.0)
    assert fast[0] == general[0]
    assert all(s == "ok" for _, s, _ in fast[0])
    assert fast[1] <= (limit or math.inf)
    assert fast[2] == sorted(fast[2], key=lambda c: int(c[1:]))


@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("passes", [0.0, 0.5, 1.5])
async def test_a_run_deadline_passing_mid_group(autojump_clock: Any, limit: int, passes: float) -> None:
    """The run's deadline passes while the group runs: the calls started before it run to
    their end, those after it are expired; as on the general path."""

    async def body(d: Dispatcher) -> Any:
        s = d.session("s")
        s.new_run(deadline=trio.current_time() + passes)
        caller = Caller()
        results = await s.dispatch(calls("nap", "quick", "nap", "nap", "quick", "nap"))
        caller.check()
        assert_slots_back(d)
        return outcome(results)

    (fast, fast_took), (general, general_took) = await both(body, nap, quick, limit=limit)
    assert fast == general and fast_took == general_took
    if passes == 0.0:
        assert {s for _, s, _ in fast} == {"expired"}


@pytest.mark.parametrize(
    ("limit", "names", "general"),
    [
        # fast path: started on the batch's task (first, or after the nap at limit 1)
        (1, ("nap", "group_timed", "nap"), False),
        (1, ("group_timed", "nap", "nap"), False),
        (3, ("group_timed", "nap", "nap"), False),
        # fast path, on a worker beside the batch task's nap
        (3, ("nap", "group_timed", "nap"), False),
        # general path: always on a worker
        (1, ("nap", "group_timed", "nap"), True),
        (1, ("group_timed", "nap", "nap"), True),
        (3, ("nap", "group_timed", "nap"), True),
        (3, ("group_timed", "nap", "nap"), True),
    ],
)
async def test_a_call_cut_at_its_timeout_whose_own_nursery_fails_too_keeps_to_itself(
    autojump_clock: Any, general: bool, names: tuple[str, ...], limit: int
) -> None:
    """A call cut at its timeout whose own nursery's child raises as it is cut (the tool
    raises a group of its cut's Cancelled and a ValueError): that call alone fails, saying
    what its nursery raised, the naps beside it are ok, the dispatch returns: wherever the
    call ran, on the batch's task (the fast path) or on a worker (the general path, or the
    fast path once the first call waited), where the worker's scope takes the cut off and
    leaves the ValueError."""
    results = await checked(make(nap, *GROUPS, timeout=2.0, limit=limit, general=general), calls(*names))
    where = names.index("group_timed")
    assert results[where].status is Status.failed and "ValueError" in results[where].content
    assert all(r.status is Status.ok for i, r in enumerate(results) if i != where)


# --- invoking another tool of the session ------------------------------------------------


def _invokers(counter: Counter) -> list[Handler]:
    async def inner(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            await trio.sleep(0.5)
        return f"inner {args['n']}"

    async def invoker_now(args: Mapping[str, Any], ctx: Any) -> str:
        first = await ctx.invoke("inner", {"n": 1000 + args["n"]})
        return f"now {first.status.value} {first.content}"

    async def invoker_later(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(0.25)
        first = await ctx.invoke("inner", {"n": 2000 + args["n"]})
        second = await ctx.invoke("inner", {"n": 3000 + args["n"]})
        return f"later {first.content} {second.content}"

    async def invoker_scoped(args: Mapping[str, Any], ctx: Any) -> str:
        with trio.move_on_after(0.25):  # cuts its own invoke: the inner call is cancelled
            got = await ctx.invoke("inner", {"n": 4000 + args["n"]})
            return f"scoped {got.content}"
        again = await ctx.invoke("inner", {"n": 5000 + args["n"]})
        return f"scoped, then {again.content}"

    async def invoker_spawns(args: Mapping[str, Any], ctx: Any) -> str:
        got: list[str] = []

        async def one(k: int) -> None:
            got.append((await ctx.invoke("inner", {"n": 6000 + 10 * args["n"] + k})).content)

        async with trio.open_nursery() as nursery:
            for k in range(3):
                nursery.start_soon(one, k)
        return "spawned " + ",".join(sorted(got))

    return [inner, invoker_now, invoker_later, invoker_scoped, invoker_spawns]


@pytest.mark.parametrize(
    "names",
    [
        ("invoker_now", "nap", "invoker_later", "quick", "invoker_now"),
        ("quick", "invoker_later", "invoker_scoped", "nap", "invoker_spawns"),
        ("invoker_spawns", "invoker_scoped", "invoker_now", "invoker_later"),
    ],
)
@pytest.mark.parametrize("limit", [1, 2, 3])
async def test_a_tool_that_invokes_another_in_its_first_step_and_after(
    autojump_clock: Any, names: tuple[str, ...], limit: int
) -> None:
    """Tools that `ctx.invoke` a tool of the session in their first step, after waiting,
    under a scope of their own that cuts the invoke, and from tasks of their own: the same
    results and times as on the general path, the slots back, the limit held (an inner
    call runs on its caller's slot: never more inner calls at once than the limit)."""
    counter = Counter()

    async def body(d: Dispatcher) -> Any:
        counter.most = 0
        results = await checked(d, calls(*names))
        return outcome(results), counter.most

    (fast, fast_took), (general, general_took) = await both(
        body, nap, quick, *_invokers(counter), limit=limit
    )
    assert fast == general and fast_took == general_took
    assert all(s == "ok" for _, s, _ in fast[0])
    assert fast[1] <= limit


# --- two sessions at once, the limit, program order, timeouts -----------------------------


@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("general", [False, True])
async def test_two_sessions_dispatching_groups_at_once_share_the_limit(
    autojump_clock: Any, limit: int, general: bool
) -> None:
    """Two sessions of one dispatcher dispatch groups at the same time, in one nursery:
    never more handlers at once than the limit, every result right and in call order, every
    slot back after both. (Each session's starts are not always in program order, on either
    path: two of its workers woken with a slot in the same tick run in trio's order.)"""
    counter = Counter()

    async def counted(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            await trio.sleep(args["t"])
        return f"{ctx.session_id} {ctx.call_id}"

    async def counted_quick(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            pass
        return f"{ctx.session_id} {ctx.call_id} quick"

    d = make(counted, counted_quick, limit=limit, general=general, timeout=30.0)
    plans = {
        "a": [
            ("counted", 1.0),
            ("counted_quick", 0),
            ("counted", 2.0),
            ("counted", 0.5),
            ("counted_quick", 0),
        ],
        "b": [("counted", 0.5), ("counted", 0.5), ("counted_quick", 0), ("counted", 3.0), ("counted", 1.0)],
    }
    got: dict[str, list[Any]] = {}
    caller = Caller()

    async def one(sid: str) -> None:
        batch = [ToolCall(f"{sid}{i}", n, {"n": i, "t": t}) for i, (n, t) in enumerate(plans[sid])]
        got[sid] = await d.session(sid).dispatch(batch)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "a")
        nursery.start_soon(one, "b")
    caller.check()
    assert_slots_back(d)
    assert counter.most <= limit
    for sid, plan in plans.items():
        assert [r.status for r in got[sid]] == [Status.ok] * len(plan)
        assert [r.content.split()[1] for r in got[sid]] == [f"{sid}{i}" for i in range(len(plan))]
        assert sorted(c for c in counter.starts if c.startswith(sid)) == [
            f"{sid}{i}" for i in range(len(plan))
        ]


@pytest.mark.parametrize("limit", [2, 3])
async def test_two_sessions_outcomes_match_the_general_path(autojump_clock: Any, limit: int) -> None:
    """The same two sessions on the fast path and the general path: the same results."""

    async def two(d: Dispatcher) -> Any:
        got: dict[str, Any] = {}

        async def one(sid: str, names: tuple[str, ...]) -> None:
            got[sid] = outcome(await d.session(sid).dispatch(calls(*names)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a", ("nap", "quick", "nap", "long", "nap"))
            nursery.start_soon(one, "b", ("long", "nap", "nap", "quick"))
        assert_slots_back(d)
        return got

    (fast, _), (general, _) = await both(two, nap, long, quick, limit=limit, timeout=30.0)
    assert fast == general  # (their times differ: see the test after the next)


@pytest.mark.parametrize("limit", [1, 2, 3, 5, None])
async def test_the_limit_and_program_order_hold_for_any_mix(autojump_clock: Any, limit: int | None) -> None:
    """A long mix of quick calls and waits of several lengths: never more running at once
    than the limit, starts in program order, the same results and the same total time as
    the general path."""
    counter = Counter()

    async def waits(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            await trio.sleep(args["t"])
        return f"waited {args['t']}"

    async def instant(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            return "instant"

    pattern = [0.5, 0, 0, 2.0, 0, 1.0, 1.0, 0, 0.25, 3.0, 0, 0, 0, 0.5, 0.75, 0, 1.5]
    batch = [ToolCall(f"c{i}", "waits" if t else "instant", {"n": i, "t": t}) for i, t in enumerate(pattern)]

    async def body(d: Dispatcher) -> Any:
        counter.most = 0
        counter.starts.clear()
        results = await checked(d, batch)
        assert counter.most <= (limit or math.inf)
        assert counter.starts == [c.id for c in batch]
        return outcome(results)

    (fast, fast_took), (general, general_took) = await both(body, waits, instant, limit=limit)
    assert fast == general and fast_took == general_took


@pytest.mark.parametrize("limit", [1, 2, 3, 4])
async def test_each_call_is_held_to_its_own_timeout_wherever_it_starts(
    autojump_clock: Any, limit: int
) -> None:
    """Calls of three timeouts that wait forever, between quick ones and naps: each is
    cut at exactly its own start plus its own timeout (its start as the general path
    makes it), none at a sibling's."""
    began: dict[str, float] = {}
    ended: dict[str, float] = {}

    def forever(name: str) -> Handler:
        async def handler(args: Mapping[str, Any], ctx: Any) -> str:
            began[ctx.call_id] = trio.current_time()
            try:
                await trio.sleep_forever()
            finally:
                ended[ctx.call_id] = trio.current_time()
            return "never"

        handler.__name__ = name
        return handler

    timeouts = {"f1": 1.0, "f2": 2.5, "f3": 0.75}
    names = ("f2", "quick", "f1", "nap", "f3", "f1", "quick", "f2", "f3", "nap")

    async def body(d: Dispatcher) -> Any:
        began.clear()
        ended.clear()
        zero = trio.current_time()
        results = await checked(d, calls(*names))
        for call_id in began:
            name = names[int(call_id[1:])]
            assert ended[call_id] - began[call_id] == timeouts[name], call_id
        return outcome(results), sorted((k, v - zero) for k, v in began.items())

    handlers = [forever(n) for n in timeouts]
    (fast, _), (general, _) = await both(body, *handlers, quick, nap, timeouts=timeouts, limit=limit)
    assert fast == general


class _Later:
    """An awaitable that is no coroutine: waits `seconds`, then says so."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __await__(self) -> Any:
        return self._run().__await__()

    async def _run(self) -> str:
        await trio.sleep(self.seconds)
        return f"later {self.seconds}"


class _LaterHandler:
    """A handler the registry takes for async (its instance's `__call__` is a coroutine
    function) whose call returns a `_Later`, an awaitable that is no coroutine."""

    __name__ = "later"

    def __init__(self) -> None:
        async def marker(args: Mapping[str, Any], ctx: Any) -> str:  # pragma: no cover - never called
            return ""

        self.__call__ = marker

    def __call__(self, args: Mapping[str, Any], ctx: Any) -> Any:
        return _Later(args["t"])


async def test_an_awaitable_that_is_no_coroutine_in_a_group(autojump_clock: Any) -> None:
    """A handler that returns an awaitable that is no coroutine (one that waits, one that
    waits past its timeout), first in the group and after naps: each its own result and
    timeout, beside naps; as on the general path."""

    async def body(d: Dispatcher) -> Any:
        batch = [
            ToolCall("c0", "later", {"t": 0.5}),
            ToolCall("c1", "nap", {"n": 1}),
            ToolCall("c2", "later", {"t": 9.0}),
            ToolCall("c3", "nap", {"n": 3}),
            ToolCall("c4", "later", {"t": 1.5}),
        ]
        return outcome(await checked(d, batch))

    for limit in (1, 2, 5):
        (fast, fast_took), (general, general_took) = await both(
            body, _LaterHandler(), nap, timeout=2.0, limit=limit
        )
        assert fast == general and fast_took == general_took, limit
        assert [s for _, s, _ in fast] == ["ok", "ok", "timed_out", "ok", "ok"]


# --- the batch's task giving up its slot for good ------------------------------------------


async def test_once_the_batch_task_leaves_a_call_to_the_workers_the_group_still_uses_the_whole_limit() -> (
    None
):
    """Limit 2: a nap on the batch's task, a long call on the worker beside it, then a sync
    call and more naps. Once the nap ends, the batch's task finds a sync call next and leaves
    it (and all after it) to the workers: the freed slot must still be used (the general
    path runs them beside the long call, from when the nap ends). Real clock: a thread runs."""
    starts: dict[str, float] = {}

    async def napping(args: Mapping[str, Any], ctx: Any) -> str:
        starts[ctx.call_id] = trio.current_time()
        await trio.sleep(args.get("t", 0.05))
        return "napped"

    def syncing(args: Mapping[str, Any], ctx: Any) -> str:
        return "synced"

    batch = [
        ToolCall("c0", "napping", {"n": 0}),
        ToolCall("c1", "napping", {"n": 1, "t": 0.6}),
        ToolCall("c2", "syncing", {"n": 2}),
        ToolCall("c3", "napping", {"n": 3}),
        ToolCall("c4", "napping", {"n": 4}),
    ]
    for general in (True, False):
        starts.clear()
        d = make(napping, syncing, limit=2, timeout=10.0, general=general)
        with trio.fail_after(10):
            results = await checked(d, batch)
        assert [r.status for r in results] == [Status.ok] * 5
        long_ends = starts["c1"] + 0.6
        assert starts["c3"] < long_ends - 0.2, ("general" if general else "fast", starts)


async def test_two_sessions_at_the_limit_keep_using_it_once_a_batch_task_found_no_slot(
    autojump_clock: Any,
) -> None:
    """Limit 2, two sessions at once. Session a's batch task, its nap over, finds no slot
    free at once (session b's worker waits for one) and leaves the rest to its one worker,
    which then runs a long call: a's last nap must still start once b is done and its slot
    free, as on the general path (it ends before the long call), not only once the long
    call ends."""
    ends: dict[str, float] = {}

    async def napping(args: Mapping[str, Any], ctx: Any) -> str:
        await trio.sleep(args["t"])
        ends[f"{ctx.session_id}.{ctx.call_id}"] = trio.current_time()
        return "napped"

    async def two(d: Dispatcher) -> Any:
        ends.clear()
        zero = trio.current_time()
        plans = {"a": [1, 0, 1, 10, 1], "b": [10, 1, 1, 0]}

        async def one(sid: str) -> None:
            batch = [ToolCall(f"c{i}", "napping", {"n": i, "t": t}) for i, t in enumerate(plans[sid])]
            await d.session(sid).dispatch(batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a")
            nursery.start_soon(one, "b")
        assert_slots_back(d)
        return ends["a.c4"] < ends["a.c3"], trio.current_time() - zero

    (fast, _), (general, _) = await both(two, napping, limit=2, timeout=30.0)
    assert general[0] and general[1] <= 14.0  # trio picks the order: 13 s or 14 s
    assert fast[0], (fast, general)


# --- a caller with nurseries and scopes of its own, cut anywhere ---------------------------


def _nesters() -> list[Handler]:
    async def server(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(0.25)
        task_status.started()
        await trio.sleep_forever()

    async def deep(args: Mapping[str, Any], ctx: Any) -> str:
        # a scope, a nursery, a started child, a shield, then a wait, all opened in its first step
        with trio.move_on_after(40):
            async with trio.open_nursery() as nursery:
                await nursery.start(server)
                with trio.CancelScope(shield=True):
                    await trio.sleep(0.5)
                await trio.sleep(1)
                nursery.cancel_scope.cancel()
        return "deep"

    async def stacked(args: Mapping[str, Any], ctx: Any) -> str:
        async with contextlib.AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            nursery.start_soon(trio.sleep, 0.75)
            stack.enter_context(trio.move_on_after(30))
            await trio.sleep(0.5)
        return "stacked"

    return [deep, stacked]


@pytest.mark.parametrize("at", [0.1, 0.3, 0.6, 1.2, 1.8, 2.6, 9.0])
@pytest.mark.parametrize("limit", [1, 2, 3])
async def test_a_caller_with_its_own_nursery_and_scopes_is_left_as_it_was(
    autojump_clock: Any, at: float, limit: int
) -> None:
    """The caller dispatches from inside a nursery of its own (a task running beside it)
    and two scopes of its own; the calls' first steps open scopes, nurseries, a started
    child and a shield; the caller's deadline lands anywhere, or never: the same outcome
    as the general path, the caller's task as it was, every slot back."""
    names = ("deep", "nap", "stacked", "deep", "quick", "stacked", "nap")

    async def body(d: Dispatcher) -> Any:
        async with trio.open_nursery() as beside:
            beside.start_soon(trio.sleep, 100)
            with trio.CancelScope():
                with trio.move_on_after(50):
                    caller = Caller()
                    began = trio.current_time()
                    got: Any = "cut"
                    with trio.move_on_after(at):
                        got = outcome(await d.session("s").dispatch(calls(*names)))
                    took = trio.current_time() - began
                    caller.check()
                    assert_slots_back(d)
            beside.cancel_scope.cancel()
        return got, took

    (fast, _), (general, _) = await both(body, nap, quick, *_nesters(), limit=limit)
    assert fast == general


@pytest.mark.parametrize("limit", [1, 2, 3])
async def test_a_tool_that_dispatches_a_group_in_another_session(autojump_clock: Any, limit: int) -> None:
    """A tool whose first step dispatches a group in another session of the same
    dispatcher (it runs on the calling handler's slot), beside naps, twice in the group:
    the same results and time as the general path, the slots back, the limit held."""
    counter = Counter()
    holder: list[Dispatcher] = []

    async def counted(args: Mapping[str, Any], ctx: Any) -> str:
        with counter.one(ctx):
            await trio.sleep(0.5)
        return f"counted {ctx.session_id} {ctx.call_id}"

    async def fan(args: Mapping[str, Any], ctx: Any) -> str:
        inner = (
            await holder[-1]
            .session(f"inner{args['n']}")
            .dispatch(calls("counted", "quick", "counted", base=100 * (args["n"] + 1)))
        )
        await trio.sleep(0.25)
        return "fan " + " | ".join(r.content for r in inner)

    async def body(d: Dispatcher) -> Any:
        holder.append(d)
        counter.most = 0
        results = await checked(d, calls("fan", "counted", "fan", "counted"))
        return outcome(results), counter.most <= limit

    (fast, fast_took), (general, general_took) = await both(body, fan, counted, quick, limit=limit)
    assert fast == general and fast_took == general_took
    assert fast[1] and all(s == "ok" for _, s, _ in fast[0])
