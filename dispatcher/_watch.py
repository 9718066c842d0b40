"""What a Dispatcher knows about the calls holding its limiter: who holds each slot and
since when, which sync calls outlived their timeout in a thread, and which async tools
held the event loop. `Dispatcher.statistics()` reads it; pass 2 keeps it.

Kept cheap on purpose: a call adds one dict entry when it takes a slot and removes it
when the slot is given back; everything else happens only when something goes wrong.
Nothing here imports trio or asyncio (the loop-blocking probes live in `_backend`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from ._backend import BlockWatch
    from ._plan import PlannedCall
    from ._pool import ProcessPool

__all__ = ["DEFAULT_BLOCK_THRESHOLD", "DispatcherStatistics", "StuckCall", "Watch"]

log = logging.getLogger("threepass.execute")

DEFAULT_BLOCK_THRESHOLD = 0.1
"""Seconds an async tool may hold the event loop in one step before it is reported."""


@attrs.frozen
class StuckCall:
    """A sync call past its timeout whose thread still runs, holding a limiter slot."""

    tool: str
    call_id: str
    seconds_over: float


@attrs.frozen
class DispatcherStatistics:
    """A snapshot of a Dispatcher's limiter and of the calls that went wrong on it.

    `limit` slots, `in_use` of them held (a stuck thread's included), `waiting` calls
    queued for one; `stuck` the sync calls past their timeout still holding a slot;
    `loop_blocks` how many calls have held the event loop past the threshold, ever;
    `process_workers` the worker processes alive for `isolation="process"` tools."""

    limit: int
    in_use: int
    waiting: int
    stuck: tuple[StuckCall, ...]
    loop_blocks: int
    process_workers: int


Holding = tuple["PlannedCall", float, float]
"""One slot's holder: the call, when (time.monotonic) it took the slot, its timeout (a
tuple: one is made per call)."""


@attrs.define(eq=False)
class Watch:
    """A Dispatcher's bookkeeping of its slots, shared by every executor of its sessions."""

    queue_limit: float | None
    block_threshold: float
    holding: dict[object, Holding] = attrs.field(factory=dict)
    stuck_ones: dict[object, None] = attrs.field(factory=dict)  # borrowers whose thread outlived them
    loop_blocks: int = 0
    last_block: PlannedCall | None = None
    blocking: BlockWatch | None = None
    pool: ProcessPool | None = None  # started by the first isolation="process" call
    closed: bool = False  # shut down: no pool from now on
    # (limiter, take, give_back, waiting, what waiting counts by): made once, not per executor
    slot_ops: tuple[Any, Any, Any, Any, Any] | None = None

    def holders(self) -> str:
        """`tool(call_id, running X s), ...`: who holds the slots, oldest first."""
        now = time.monotonic()
        held = sorted(self.holding.values(), key=lambda h: h[1])
        return ", ".join(f"{p.name}({p.call_id}, running {now - since:.1f} s)" for p, since, _ in held)

    def release(self, limiter: Any, borrower: object) -> None:
        """Give `borrower`'s slot back and forget who held it."""
        self.holding.pop(borrower, None)
        if self.stuck_ones:
            self.stuck_ones.pop(borrower, None)
        limiter.release_on_behalf_of(borrower)

    def stuck(self, borrower: object) -> None:
        """The sync call holding `borrower`'s slot was reported timed out, its thread runs on:
        say so once."""
        held = self.holding.get(borrower)
        if held is None or borrower in self.stuck_ones:
            return
        self.stuck_ones[borrower] = None
        planned, _, timeout = held
        log.warning(
            "tool %s (call %s) ran past its timeout of %g s; its thread still runs and holds a "
            "limiter slot until it returns (isolation='process' would kill it)",
            planned.name,
            planned.call_id,
            timeout,
        )

    def blocked(self, planned: PlannedCall, seconds: float) -> None:
        """An async call held the event loop for `seconds` in one step (reported once a call)."""
        self.loop_blocks += 1
        log.warning(
            "tool %s (call %s) held the event loop for %.2f s in one step (threshold %g s): an "
            "async handler must not block; use a sync handler (it runs in a thread) or "
            "anyio.to_thread",
            planned.name,
            planned.call_id,
            seconds,
            self.block_threshold,
        )

    def shutdown(self) -> None:
        """Kill the worker processes; a pool is never started again."""
        self.closed = True
        if self.pool is not None:
            self.pool.shutdown()

    def statistics(self, limiter: Any) -> DispatcherStatistics:
        now = time.monotonic()
        held = sorted((self.holding[b] for b in self.stuck_ones if b in self.holding), key=lambda h: h[1])
        stuck = tuple(
            StuckCall(p.name, p.call_id, max(0.0, now - since - timeout)) for p, since, timeout in held
        )
        return DispatcherStatistics(
            limit=int(limiter.total_tokens),
            in_use=int(limiter.borrowed_tokens),
            waiting=int(limiter.statistics().tasks_waiting),
            stuck=stuck,
            loop_blocks=self.loop_blocks,
            process_workers=0 if self.pool is None else self.pool.alive(),
        )
