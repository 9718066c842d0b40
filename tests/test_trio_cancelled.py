"""On trio, a Cancelled a tool kept from a cancel scope of its own and raised after that
scope ended (no scope around the call is cancelled, so none would catch it) is that
call's failure, as asyncio's stray CancelledError is; a cancellation of the batch, and a
call's timeout, are what they were."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing

from dispatcher import Dispatcher, Registry, Status, Tool

from ._fakes import openai_call


async def _kept_cancelled(args: Mapping[str, Any], ctx: Any) -> str:
    kept: BaseException | None = None
    with trio.CancelScope() as inner:
        inner.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            kept = exc
            raise
    assert kept is not None
    raise kept


def _kept_cancelled_in_a_thread(args: Mapping[str, Any], ctx: Any) -> str:
    return trio.from_thread.run(_kept_cancelled, args, ctx)  # type: ignore[no-any-return]


async def _quick(args: Mapping[str, Any], ctx: Any) -> str:
    return f"quick {args.get('n')}"


async def _yielding(args: Mapping[str, Any], ctx: Any) -> str:
    await trio.lowlevel.checkpoint()
    return f"yielded {args.get('n')}"


def _sync(args: Mapping[str, Any], ctx: Any) -> str:
    return f"sync {args.get('n')}"


async def _naps(args: Mapping[str, Any], ctx: Any) -> str:
    await trio.sleep(10)
    return "woke"


_HANDLERS: dict[str, Any] = {
    "kept": _kept_cancelled,
    "quick": _quick,
    "yielding": _yielding,
    "sync": _sync,
    "naps": _naps,
}


def _registry(concurrent: bool, timeout: float = 60.0) -> Registry:
    return Registry(
        [
            Tool(
                name,
                name,
                handler,
                {"type": "object"},
                concurrent=concurrent,
                deferred=False,
                timeout=timeout,
            )
            for name, handler in _HANDLERS.items()
        ]
    )


def _batch(names: list[str]) -> list[dict[str, Any]]:
    return [openai_call(f"c{i}", name, {"n": i}) for i, name in enumerate(names)]


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize(
    "names",
    [
        ["kept"],
        ["sync", "kept"],
        ["yielding", "yielding", "kept"],
        ["quick", "kept", "quick", "quick"],
        ["kept", "kept", "yielding", "sync"],
    ],
)
async def test_a_kept_cancelled_fails_its_call_alone(names: list[str], limit: int, concurrent: bool) -> None:
    """Each call that raised a kept Cancelled fails, naming it; its siblings keep their
    results, in call order; every limiter slot comes back; the next batch runs whole."""
    d = Dispatcher(_registry(concurrent), max_concurrent=limit)
    s = d.session("s")
    results = await s.dispatch(_batch(names))
    assert [r.call_id for r in results] == [f"c{i}" for i in range(len(names))]
    for i, (name, result) in enumerate(zip(names, results, strict=True)):
        if name == "kept":
            assert result.status is Status.failed
            assert "Cancelled" in result.content
        else:
            assert result.status is Status.ok
            assert result.content.endswith(str(i))
    assert d.limiter.borrowed_tokens == 0
    s.new_run()
    again = await s.dispatch(_batch(["quick", "yielding", "sync"]))
    assert [r.status for r in again] == [Status.ok] * 3
    assert d.limiter.borrowed_tokens == 0


async def test_a_kept_cancelled_raised_through_a_thread_fails_its_call() -> None:
    """A sync tool that runs the same in the loop from its thread fails alone too."""
    registry = Registry(
        [
            Tool("thread", "thread", _kept_cancelled_in_a_thread, {"type": "object"}, deferred=False),
            Tool("quick", "quick", _quick, {"type": "object"}, deferred=False),
        ]
    )
    d = Dispatcher(registry)
    results = await d.session("s").dispatch(_batch(["thread", "quick"]))
    assert [r.status for r in results] == [Status.failed, Status.ok]
    assert d.limiter.borrowed_tokens == 0


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_cancelled_batch_still_raises_cancellation(concurrent: bool) -> None:
    """A batch cancelled from outside is cancelled, not turned into failures."""
    d = Dispatcher(_registry(concurrent))
    s = d.session("s")
    with trio.move_on_after(0.05) as scope:
        await s.dispatch(_batch(["naps", "naps"]))
    assert scope.cancelled_caught
    assert d.limiter.borrowed_tokens == 0


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("alone", [True, False])
async def test_a_call_past_its_timeout_still_times_out(concurrent: bool, alone: bool) -> None:
    """The cut of a call's own timeout is its timeout, alone or beside others."""
    d = Dispatcher(_registry(concurrent, timeout=0.05))
    names = ["naps"] if alone else ["naps", "quick", "kept"]
    results = await d.session("s").dispatch(_batch(names))
    assert results[0].status is Status.timed_out
    if not alone:
        assert [r.status for r in results[1:]] == [Status.ok, Status.failed]
    assert d.limiter.borrowed_tokens == 0
