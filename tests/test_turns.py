"""A session's batches take turns: one at a time, in the order they came, and a dispatch
cancelled while it waits (or just as its turn came) never costs anyone else theirs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from dispatcher import Dispatcher, Registry, Session, Tool, ToolCall
from dispatcher._turns import Turns

from ._fakes import TEXT_SCHEMA


def _dispatcher(log: list[str], gate: anyio.Event) -> Dispatcher:
    """`hold` waits for `gate` the first time and logs each start and end; `mark` logs."""

    async def hold(args: Mapping[str, Any], ctx: Any) -> str:
        log.append(f"start {args['text']}")
        await gate.wait()
        log.append(f"end {args['text']}")
        return str(args["text"])

    return Dispatcher(
        Registry(
            [
                Tool("hold", "Holds until let go.", hold, TEXT_SCHEMA, deferred=False),
            ]
        )
    )


def _batch(text: str) -> list[ToolCall]:
    return [ToolCall(f"c_{text}", "hold", {"text": text})]


async def _until(condition: Any) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.lowlevel.checkpoint()


def _holding_session() -> tuple[Session, anyio.Event, list[str], list[str], Callable[[str], Awaitable[None]]]:
    """A session of `hold`, the gate that lets it go, the log of starts and ends, the texts
    of batches done in the order they ended, and what runs one batch of a text."""
    log: list[str] = []
    gate = anyio.Event()
    s = _dispatcher(log, gate).session("s")
    done: list[str] = []

    async def run(text: str) -> None:
        [result] = await s.dispatch(_batch(text))
        done.append(result.content)

    return s, gate, log, done, run


async def test_batches_of_one_session_run_one_at_a_time_in_the_order_they_came() -> None:
    s, gate, log, done, run = _holding_session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "a")
        await _until(lambda: log == ["start a"])
        for n, text in enumerate("bcd"):  # each queues behind the one before
            tg.start_soon(run, text)
            await _until(lambda n=n: s._turns.waiting == n + 1)
        assert log == ["start a"]  # nobody overtook the running batch
        gate.set()
    assert done == ["a", "b", "c", "d"]
    assert log == [f"{what} {t}" for t in "abcd" for what in ("start", "end")]


async def test_a_dispatch_cancelled_while_it_waits_leaves_the_queue_and_the_next_goes_on() -> None:
    s, gate, log, done, run = _holding_session()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "a")
        await _until(lambda: log == ["start a"])
        waiting = anyio.CancelScope()

        async def cancelled() -> None:
            with waiting:
                await s.dispatch(_batch("x"))

        tg.start_soon(cancelled)
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        tg.start_soon(run, "b")
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        waiting.cancel()  # "x" gives up before its turn
        gate.set()
    assert done == ["a", "b"] and "start x" not in log


async def test_a_waiter_cancelled_as_its_turn_came_hands_it_on() -> None:
    """Turns directly: a waiter whose wait is cut short, and which is handed the turn
    before it runs again, gives the turn to the next one: no turn is lost."""
    turns = Turns()
    order: list[str] = []
    assert turns.free()

    async def wait(name: str, scope: anyio.CancelScope) -> None:
        with scope:
            await turns.wait(anyio.Event)
        if scope.cancelled_caught:
            order.append(f"{name} cancelled")
            return
        order.append(name)
        turns.done()

    first, second = anyio.CancelScope(), anyio.CancelScope()
    with anyio.fail_after(5):  # a lost turn leaves "second" waiting for ever
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "first", first)
            await _until(lambda: turns.waiting == 1)
            tg.start_soon(wait, "second", second)
            await _until(lambda: turns.waiting == 2)
            first.cancel()  # "first" is cut short ...
            turns.done()  # ... and handed the turn before it runs again
    assert order == ["first cancelled", "second"]
    assert turns.free()  # and once "second" is done, the session is free


@pytest.mark.parametrize("waiters", [0, 3])
async def test_the_turn_is_free_again_once_every_batch_is_done(waiters: int) -> None:
    turns = Turns()
    assert turns.free()
    assert not turns.free()  # taken
    got: list[int] = []

    async def wait(n: int) -> None:
        await turns.wait(anyio.Event)
        got.append(n)
        turns.done()

    async with anyio.create_task_group() as tg:
        for n in range(waiters):  # one at a time, so that they queue in this order
            tg.start_soon(wait, n)
            await _until(lambda n=n: turns.waiting == n + 1)
        turns.done()
    assert got == list(range(waiters))
    assert turns.free()
