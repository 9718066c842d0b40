"""The event loop underneath: the one module of the kernel that may import trio or asyncio.

Everything else speaks anyio, so the kernel runs under trio (the reference) and under
asyncio. This module holds the few places where anyio's wrappers cost on the hot path,
or where the kernel must know which loop it is on:

- `clock()`: the running loop's clock function, fetched once per batch (anyio's
  `current_time` looks the backend up on every call);
- `loop_identity()`: what a Dispatcher binds to on first use, so that using it from a
  second loop or thread is a clear error instead of a hang.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import sniffio
import trio

__all__ = ["LoopIdentity", "clock", "loop_identity"]

LoopIdentity = tuple[str, object, int]
"""(the async library's name, its running loop or token, the thread it runs on)."""


def clock() -> Callable[[], float]:
    """The current loop's clock (seconds; what deadlines and timeouts are measured in)."""
    if sniffio.current_async_library() == "trio":
        return trio.current_time
    return asyncio.get_running_loop().time


def loop_identity() -> LoopIdentity:
    """Which loop this is: trio's token, or asyncio's running loop, and the thread."""
    library = sniffio.current_async_library()
    loop: object
    if library == "trio":
        loop = trio.lowlevel.current_trio_token()
    elif library == "asyncio":
        loop = asyncio.get_running_loop()
    else:  # pragma: no cover - anyio supports only these two
        raise RuntimeError(f"threepass runs under trio or asyncio, not {library!r}")
    return library, loop, threading.get_ident()
