"""Pass 2, execute: the only pass that runs tools, and the only one that uses trio.

Groups run in program order; the calls of a concurrent group are pulled by a few
worker tasks, as many as the limiter could admit at once, rather than one task per
call: the limiter still bounds every call, and a batch of a hundred costs three
tasks, not a hundred. A free limiter slot is taken without a scheduler round trip.

Ordinary failures become results here and never raise; run control (cancellation,
`HookBlocked`, `DispatchInterrupted`) is collected per call and raised by the session
after what finished is committed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import trio

from ._exceptions import DispatchInterrupted, HookBlocked, ToolError
from ._plan import Plan, PlannedCall
from ._results import failure_result, normalize_output
from ._types import Status, ToolContext, ToolResult

__all__ = ["Executor", "HookSet", "RunControl", "ToolRunner"]

ToolRunner = Callable[[PlannedCall, ToolContext], Awaitable[ToolResult]]
"""Stands in for running the handler (offline replay serves recorded results through it)."""


@attrs.frozen
class HookSet:
    """Lifecycle hooks, split once into their bound `before` and `after` methods."""

    before: tuple[Callable[..., Any], ...] = ()
    after: tuple[Callable[..., Any], ...] = ()

    @classmethod
    def of(cls, hooks: Sequence[Any]) -> HookSet:
        return cls(
            before=tuple(h.before for h in hooks if callable(getattr(h, "before", None))),
            after=tuple(h.after for h in hooks if callable(getattr(h, "after", None))),
        )


@attrs.define
class RunControl:
    """Run-control signals raised by calls of this batch, by call index."""

    blocked: dict[int, HookBlocked] = attrs.field(factory=dict)
    interrupted: dict[int, DispatchInterrupted] = attrs.field(factory=dict)

    def __bool__(self) -> bool:
        return bool(self.blocked or self.interrupted)

    def first(self) -> BaseException | None:
        """A hook block wins over an interrupt; among equals, the earliest call."""
        if self.blocked:
            return self.blocked[min(self.blocked)]
        if self.interrupted:
            return self.interrupted[min(self.interrupted)]
        return None


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


@attrs.define
class _Abandonable:
    """Who releases the limiter slot of a sync call: the worker, or the thread if abandoned."""

    lock: threading.Lock = attrs.field(factory=threading.Lock)
    finished: bool = False
    abandoned: bool = False


class Executor:
    """Runs the groups of one plan. `results` is filled as calls finish (pass 3 reads it)."""

    def __init__(
        self,
        *,
        limiter: trio.CapacityLimiter,
        default_timeout: float,
        deadline: float | None,
        hooks: HookSet,
        make_context: Callable[[PlannedCall], ToolContext],
        max_output_bytes: int,
        runner: ToolRunner | None = None,
    ) -> None:
        self._limiter = limiter
        self._timeout = default_timeout
        self._deadline = deadline
        self._hooks = hooks
        self._make_context = make_context
        self._max_out = max_output_bytes
        self._runner = runner
        self.results: dict[int, ToolResult] = {}
        self.control = RunControl()

    async def run(self, plan: Plan) -> None:
        calls = plan.calls
        for group in plan.groups:
            if len(group) == 1:
                await self._run_call(calls[group[0]])
            else:
                todo = iter([calls[i] for i in group])
                workers = min(len(group), max(1, int(min(self._limiter.total_tokens, len(group)))))
                async with trio.open_nursery() as nursery:
                    for _ in range(workers):
                        nursery.start_soon(self._worker, todo)
            if self.control:
                return  # later groups do not start

    async def _worker(self, todo: Iterator[PlannedCall]) -> None:
        for planned in todo:
            await self._run_call(planned)

    async def _run_call(self, planned: PlannedCall) -> None:
        index = planned.index
        call = planned.call
        if self._deadline is not None and trio.current_time() >= self._deadline:
            self.results[index] = failure_result(
                call.id,
                call.name,
                Status.expired,
                "run deadline elapsed before the tool started",
                limit=self._max_out,
            )
            return
        ctx = self._make_context(planned)
        try:
            for before in self._hooks.before:
                await _maybe_await(before(call, ctx))
            result = await self._invoke(planned, ctx)
            self.results[index] = result
            for after in self._hooks.after:
                await _maybe_await(after(call, result, ctx))
        except HookBlocked as exc:
            if exc.call_id is None:
                exc.call_id = call.id
            self.control.blocked[index] = exc
        except DispatchInterrupted as exc:
            self.control.interrupted[index] = exc

    async def _invoke(self, planned: PlannedCall, ctx: ToolContext) -> ToolResult:
        """Run one call under its timeout and a limiter slot; ordinary failures become results."""
        call = planned.call
        tool = planned.tool
        assert tool is not None
        timeout = tool.tool.timeout or self._timeout
        writes = bool(planned.writes)
        args: Mapping[str, Any] = call.arguments  # type: ignore[assignment]  # pass 1 made it a dict
        borrower = object()
        limiter = self._limiter
        try:
            limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            await limiter.acquire_on_behalf_of(borrower)
        release = True
        started = time.time()
        t0 = time.monotonic()
        try:
            with trio.move_on_after(timeout) as scope:
                if self._runner is not None:
                    return await self._runner(planned, ctx)
                if tool.is_async:
                    value = await tool.tool.handler(args, ctx)
                else:
                    state = _Abandonable()
                    release = False
                    value = await self._in_thread(tool.tool.handler, args, ctx, borrower, state)
            if scope.cancelled_caught:
                return failure_result(
                    call.id,
                    call.name,
                    Status.timed_out,
                    f"{call.name} ran past its timeout of {timeout:g} s",
                    effect_uncertain=writes,
                    started=started,
                    duration=time.monotonic() - t0,
                    limit=self._max_out,
                )
            return ToolResult(
                call_id=call.id,
                name=call.name,
                status=Status.ok,
                content=normalize_output(value, self._max_out),
                started=started,
                duration=time.monotonic() - t0,
            )
        except (HookBlocked, DispatchInterrupted):
            raise
        except ToolError as exc:
            return failure_result(
                call.id,
                call.name,
                Status.failed,
                exc.message,
                retryable=exc.retryable,
                effect_uncertain=writes,
                started=started,
                duration=time.monotonic() - t0,
                limit=self._max_out,
            )
        except Exception as exc:
            return failure_result(
                call.id,
                call.name,
                Status.failed,
                f"{type(exc).__name__}: {exc}",
                effect_uncertain=writes,
                started=started,
                duration=time.monotonic() - t0,
                limit=self._max_out,
            )
        finally:
            if release:
                limiter.release_on_behalf_of(borrower)

    async def _in_thread(
        self,
        handler: Callable[..., Any],
        args: Mapping[str, Any],
        ctx: ToolContext,
        borrower: object,
        state: _Abandonable,
    ) -> Any:
        """Run a sync handler in a worker thread. Past its timeout (or on cancellation) the
        call is reported at once, but the thread keeps its limiter slot until it returns."""
        limiter = self._limiter
        token = trio.lowlevel.current_trio_token()

        def job() -> Any:
            try:
                return handler(args, ctx)
            finally:
                with state.lock:
                    state.finished = True
                    give_back = state.abandoned
                if give_back:
                    # if the loop is gone, its limiter went with it
                    with contextlib.suppress(trio.RunFinishedError):
                        trio.from_thread.run_sync(limiter.release_on_behalf_of, borrower, trio_token=token)

        try:
            value = await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=_UNLIMITED)
        except BaseException:
            with state.lock:
                state.abandoned = not state.finished
                give_back_now = not state.abandoned
            if give_back_now:
                limiter.release_on_behalf_of(borrower)
            raise
        limiter.release_on_behalf_of(borrower)
        return value


# The dispatcher's own limiter bounds sync calls too; trio's thread limiter must not add a second bound.
_UNLIMITED = trio.CapacityLimiter(math.inf)
