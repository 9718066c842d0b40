"""What a batch pays once, made cheaper, tried against the general way: a limiter slot
taken and given back in one frame (the limit, the waiters' order and trio's errors hold),
the loop a dispatcher belongs to read again for less (a second loop or thread still
raises), and pass 3's common batch (every call ok, nothing to write) against the general
pass."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from dispatcher import Dispatcher, Registry, Status, Tool, ToolCall, _backend

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "number"}}}


# --- limiter slots: slot_ops against trio's own methods -----------------------------------


def _outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """What `fn(*args)` returned, or the type and message of what it raised."""
    try:
        return "returned", fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _trio_take(limiter: Any, would_block: type[Exception]) -> Callable[[object], bool]:
    def take(borrower: object) -> bool:
        try:
            limiter.acquire_on_behalf_of_nowait(borrower)
        except would_block:
            return False
        return True

    return take


def _state(limiter: Any) -> tuple[Any, ...]:
    stats = limiter.statistics()
    return (sorted(map(str, stats.borrowers)), stats.tasks_waiting, stats.total_tokens)


@pytest.mark.parametrize("seed", range(12))
def test_slot_ops_on_trio_do_what_trio_does(seed: int) -> None:
    """Random takes, give-backs (of held, waiting and unknown borrowers), waiters parking
    and cancelled, and totals changed, on two trio limiters side by side: one through
    `slot_ops`, one through trio's own methods. Every step returns or raises the same, and
    leaves the same borrowers, waiters and woken tasks."""
    import trio
    import trio.testing

    async def main() -> None:
        rng = random.Random(seed)
        total = rng.randint(0, 3)
        limiters = [trio.CapacityLimiter(total), trio.CapacityLimiter(total)]
        ops = [_backend.slot_ops(limiters[0], trio.WouldBlock)]
        ops.append((_trio_take(limiters[1], trio.WouldBlock), limiters[1].release_on_behalf_of))
        woken: list[list[str]] = [[], []]
        scopes: list[dict[str, trio.CancelScope]] = [{}, {}]

        async def waiter(k: int, label: str, task_status: Any) -> None:
            with trio.CancelScope() as scope:
                scopes[k][label] = scope
                task_status.started()
                await limiters[k].acquire_on_behalf_of(label)
                woken[k].append(label)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for step in range(60):
                op = rng.choice(["take", "take", "give", "give", "wait", "cancel", "total"])
                label = f"b{rng.randint(0, 4)}"
                if op == "give" and rng.random() < 0.3 and woken[0]:
                    label = rng.choice(woken[0])  # a slot a waiter got
                if op == "cancel" and scopes[0]:
                    label = rng.choice(sorted(scopes[0]))
                size = rng.choice([0, 1, 2, 3, 5])
                outcomes = []
                for k in (0, 1):
                    take, give = ops[k]
                    if op == "take":
                        outcomes.append(_outcome(take, label))
                    elif op == "give":
                        outcomes.append(_outcome(give, label))
                    elif op == "wait":
                        await nursery.start(waiter, k, f"w{step}")
                        await trio.testing.wait_all_tasks_blocked()
                    elif op == "cancel" and label in scopes[k]:
                        scopes[k].pop(label).cancel()
                    elif op == "total":
                        limiters[k].total_tokens = size
                    await trio.testing.wait_all_tasks_blocked()
                assert outcomes[:1] == outcomes[1:], (step, op, label)
                assert _state(limiters[0]) == _state(limiters[1]), (step, op, label)
                assert sorted(woken[0]) == sorted(woken[1]), (step, op, label)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_slot_ops_fall_back_to_the_limiters_own_methods() -> None:
    """A limiter that is not trio's own (anyio's, on either loop) is taken and given back
    through its public methods, a full one saying False."""

    async def main() -> None:
        limiter = anyio.CapacityLimiter(1)
        take, give = _backend.slot_ops(limiter, anyio.WouldBlock)
        assert take("a") is True and limiter.borrowed_tokens == 1
        assert take("b") is False
        with pytest.raises(RuntimeError):
            take("a")
        give("a")
        assert limiter.borrowed_tokens == 0
        with pytest.raises(RuntimeError):
            give("a")

    anyio.run(main, backend="trio")
    anyio.run(main, backend="asyncio")


# --- a waiter is woken when a lone call gives its slot back -------------------------------


def _gated_tools(opened: dict[str, anyio.Event], began: list[str]) -> Registry:
    async def hold(args: Mapping[str, Any], ctx: Any) -> str:
        began.append(ctx.call_id)
        await opened[ctx.call_id].wait()
        return f"held {ctx.call_id}"

    async def quick(args: Mapping[str, Any], ctx: Any) -> str:
        began.append(ctx.call_id)
        return f"quick {ctx.call_id}"

    tools = [
        Tool("hold", "Waits for its gate.", hold, SCHEMA, deferred=False, timeout=30),
        Tool("quick", "Returns at once.", quick, SCHEMA, deferred=False, timeout=30),
    ]
    return Registry(tools)


async def _until(check: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not check():  # noqa: ASYNC110 - the state is the dispatcher's, no event to wait on
            await anyio.sleep(0.001)


@pytest.mark.parametrize("shared", [False, True], ids=["one dispatcher", "two sharing a limiter"])
async def test_a_waiter_gets_the_slot_a_lone_call_gives_back(shared: bool) -> None:
    """At a limit of one, a lone call waits for the slot another lone call holds (in another
    session, or in another dispatcher given the same limiter) and starts the moment that
    call ends, long before its queue limit; the waiter's own slot comes back too."""
    opened = {"a": anyio.Event(), "b": anyio.Event()}
    began: list[str] = []
    d = Dispatcher(_gated_tools(opened, began), max_concurrent=1, queue_limit=20)
    other = Dispatcher(_gated_tools(opened, began), max_concurrent=1, queue_limit=20) if shared else d
    await d.session("warm").dispatch([ToolCall("w", "quick", {})])  # bound: the loop's limiter
    if shared:
        await other.session("warm").dispatch([ToolCall("w2", "quick", {})])
        other.limiter = d.limiter
    results: dict[str, Any] = {}

    async def run(dispatcher: Dispatcher, session: str, call_id: str) -> None:
        [results[call_id]] = await dispatcher.session(session).dispatch([ToolCall(call_id, "hold", {})])

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, d, "first", "a")
            await _until(lambda: "a" in began)
            tg.start_soon(run, other, "second", "b")
            await _until(lambda: d.statistics().waiting == 1)
            assert began == (["w", "w2", "a"] if shared else ["w", "a"])
            opened["a"].set()
            await _until(lambda: "b" in began)  # woken by the slot's give-back
            assert d.statistics().in_use == 1 and d.statistics().waiting == 0
            opened["b"].set()
    assert [results[k].status for k in "ab"] == [Status.ok, Status.ok]
    assert d.statistics().in_use == 0 and other.statistics().in_use == 0


async def test_waiters_are_woken_in_order_as_lone_calls_end(autojump_clock: Any) -> None:
    """Three sessions wait at a limit of one behind a lone call: each starts exactly when the
    one before it ends (trio's virtual clock), in the order they came."""
    import trio

    starts: dict[str, float] = {}

    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        starts[ctx.call_id] = trio.current_time()
        await trio.sleep(args["n"])
        return "napped"

    tool = Tool("nap", "Sleeps.", nap, SCHEMA, deferred=False, timeout=60)
    d = Dispatcher(Registry([tool]), max_concurrent=1, queue_limit=100)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i, name in enumerate("abcd"):
            nursery.start_soon(d.session(name).dispatch, [ToolCall(name, "nap", {"n": 1 + i})])
            await trio.sleep(0.01 * (i > 0))
    assert {k: round(v - t0, 6) for k, v in starts.items()} == {"a": 0.0, "b": 1.0, "c": 3.0, "d": 6.0}
    assert d.statistics().in_use == 0


# --- the loop a dispatcher belongs to ------------------------------------------------------


def _flag_registry() -> Registry:
    async def flag(args: Mapping[str, Any], ctx: Any) -> str:
        return "set"

    return Registry([Tool("set_flag", "Sets a flag.", flag, SCHEMA, deferred=False)])


def _dispatch_on(backend: str, d: Dispatcher, session: str) -> BaseException | None:
    """Dispatch once through `d` on a new loop of `backend`: what it raised, if anything."""

    async def go() -> None:
        [result] = await d.session(session).dispatch([ToolCall("1", "set_flag", {})])
        assert result.ok

    try:
        anyio.run(go, backend=backend)
    except BaseException as exc:
        return exc
    return None


@pytest.mark.parametrize("first", ["trio", "asyncio"])
@pytest.mark.parametrize("then", ["trio", "asyncio"])
def test_a_second_loop_on_the_same_thread_raises(first: str, then: str) -> None:
    """A dispatcher used on one loop, then from a new loop on the same thread (trio's next
    run or asyncio's), raises the RuntimeError naming both, however many batches the first
    loop ran."""
    d = Dispatcher(_flag_registry())

    async def many() -> None:
        for i in range(5):
            [result] = await d.session(f"s{i}").dispatch([ToolCall("1", "set_flag", {})])
            assert result.ok

    anyio.run(many, backend=first)
    raised = _dispatch_on(then, d, "later")
    assert isinstance(raised, RuntimeError)
    assert f"belongs to the {first} loop it was first used on (thread {threading.get_ident()})" in str(raised)
    assert f"it was used from a {then} loop on thread {threading.get_ident()}" in str(raised)


@pytest.mark.parametrize("first", ["trio", "asyncio"])
def test_the_same_loop_from_another_thread_raises(first: str) -> None:
    """A dispatcher used on a loop, then from a loop of the same kind in another thread, raises."""
    d = Dispatcher(_flag_registry())
    assert _dispatch_on(first, d, "a") is None
    raised: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: raised.append(_dispatch_on(first, d, "b")))
    worker.start()
    worker.join(10)
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError)
    assert "one Dispatcher per event loop" in str(raised[0])


def test_an_asyncio_dispatcher_under_a_trio_guest_run_says_what_loop_identity_says() -> None:
    """A dispatcher bound to an asyncio loop, used again while a trio guest run is active on
    that loop's thread, is judged as `loop_identity` judges it (trio is asked first there),
    as before batches read their loop for less."""
    import trio

    d = Dispatcher(_flag_registry())
    seen: list[Any] = []

    async def main() -> None:
        await d.session("a").dispatch([ToolCall("1", "set_flag", {})])
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        async def guest() -> None:
            await trio.sleep(0.01)

        trio.lowlevel.start_guest_run(
            guest,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=lambda outcome: loop.call_soon_threadsafe(done.set_result, None),
        )
        await asyncio.sleep(0)
        expected = _backend.loop_identity()  # trio's, while the guest runs
        try:
            await d.session("b").dispatch([ToolCall("2", "set_flag", {})])
            seen.append(None)
        except RuntimeError as exc:
            seen.append(exc)
        seen.append(expected)
        await done

    asyncio.run(main())
    raised, expected = seen
    assert expected[0] == "trio"
    assert isinstance(raised, RuntimeError) and "used from a trio loop" in str(raised)


def test_loop_reader_reads_what_loop_identity_says() -> None:
    """On the loop it was made for, the reader gives `loop_identity()[1]`, batch after batch;
    on another, something else or an error."""

    async def here() -> tuple[Any, Callable[[], object]]:
        identity = _backend.loop_identity()
        read = _backend.loop_reader(identity)
        for _ in range(3):
            assert read() is identity[1]
            await anyio.lowlevel.checkpoint()
        return identity, read

    for backend in ("trio", "asyncio"):
        identity, read = anyio.run(here, backend=backend)
        for other in ("trio", "asyncio"):

            async def elsewhere(read: Callable[[], object] = read) -> Any:
                return _outcome(read)

            kind, value = anyio.run(elsewhere, backend=other)
            assert kind != "returned" or value is not identity[1]
