"""The event loop underneath: the one module of the kernel that may import trio or asyncio.

Everything else speaks anyio, so the kernel runs under trio (the reference) and under
asyncio. This module holds the few places where anyio's wrappers cost on the hot path,
or where the kernel must know which loop it is on:

- `primitives()`: what pass 2 uses per call and per group — the clock, cancel scopes,
  `move_on_after`, events, a checkpoint, task groups — as the running backend's own
  (trio's natives on trio: anyio's wrappers there cost several microseconds a call;
  anyio's own on asyncio, where they are the implementation);
- `loop_identity()`: what a Dispatcher binds to on first use, so that using it from a
  second loop or thread is a clear error instead of a hang.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import sniffio
import trio

__all__ = ["LoopIdentity", "Primitives", "loop_identity", "primitives"]

LoopIdentity = tuple[str, object, int]
"""(the async library's name, its running loop or token, the thread it runs on)."""


def loop_identity() -> LoopIdentity:
    """Which loop this is: trio's token, or asyncio's running loop, and the thread. Asked
    once per batch, so trio (the reference) is tried first, without sniffio's look-up."""
    try:
        return "trio", trio.lowlevel.current_trio_token(), threading.get_ident()
    except RuntimeError:
        pass
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("threepass runs inside an event loop: await it under trio or asyncio") from None
    return "asyncio", loop, threading.get_ident()


@attrs.frozen
class Primitives:
    """The structured-concurrency primitives of one backend, with anyio's API shapes:
    `cancel_scope(deadline=...)`, `move_on_after(seconds)`, `event()`, `await checkpoint()`,
    `async with task_group() as tg: tg.start_soon(fn, *args)`, `lock()` and
    `capacity_limiter(n)` (whose `*_nowait` methods raise `would_block`)."""

    name: str
    clock: Callable[[], float]
    cancel_scope: Callable[..., Any]
    move_on_after: Callable[[float], Any]
    event: Callable[[], Any]
    checkpoint: Callable[[], Any]
    task_group: Callable[[], Any]
    lock: Callable[[], Any]
    capacity_limiter: Callable[[float], Any]
    would_block: type[Exception]


_TRIO = Primitives(
    "trio",
    trio.current_time,
    trio.CancelScope,
    trio.move_on_after,
    trio.Event,
    trio.lowlevel.checkpoint,
    trio.open_nursery,
    trio.Lock,
    trio.CapacityLimiter,
    trio.WouldBlock,
)


def primitives() -> Primitives:
    """The running loop's primitives (see `Primitives`)."""
    if sniffio.current_async_library() == "trio":
        return _TRIO
    return Primitives(
        "asyncio",
        asyncio.get_running_loop().time,
        anyio.CancelScope,
        anyio.move_on_after,
        anyio.Event,
        anyio.lowlevel.checkpoint,
        anyio.create_task_group,
        anyio.Lock,
        anyio.CapacityLimiter,
        anyio.WouldBlock,
    )
