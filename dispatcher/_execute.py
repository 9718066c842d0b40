"""Pass 2, execute: the only pass that runs tools (on anyio: trio or asyncio underneath).

Groups run in program order; the calls of a concurrent group are pulled by worker
tasks rather than one task per call. A group starts with one worker, and a spawner
adds another (up to what the limiter admits) each time the running workers let go of
the loop while calls still wait: a hundred calls that never block cost two tasks,
a hundred that sleep fan out to the limit. The limiter still bounds every call, and
a free slot is taken without a scheduler round trip.

Ordinary failures become results here and never raise; run control (cancellation,
`HookBlocked`, `DispatchInterrupted`, a tool's `KeyboardInterrupt`) is collected per call
and raised by the session after what finished is committed.

Nothing wedges the dispatcher: a call that cannot get a slot within its queue limit ends
`timed_out` naming the holders; a sync call past its timeout in a thread is reported at
once and listed as stuck while its thread holds the slot (with `isolation="process"` its
worker is killed instead); an async call that holds the loop is reported (`_backend`'s
block watch) and, past its timeout, is `timed_out`, never `ok`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import inspect
import logging
import math
import operator
import threading
import time
import types
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from types import FrameType
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import attrs

from . import _backend
from ._exceptions import DispatchInterrupted, HookBlocked, ToolError
from ._plan import Plan, PlannedCall
from ._pool import ProcessPool, Start, WorkerGone
from ._process import ProcessContext
from ._registry import RegisteredTool
from ._results import describe, failure_result, normalize_output
from ._types import ContextHost, Status, ToolCall, ToolContext, ToolResult, new_context, new_result
from ._watch import DEFAULT_BLOCK_THRESHOLD, Watch

__all__ = ["BeforeWrite", "Executor", "HookSet", "RunControl", "ToolRunner", "watch_loop"]

log = logging.getLogger("threepass.execute")

_OK = Status.ok
_TOOL = operator.attrgetter("tool")
_INF = math.inf

ToolRunner = Callable[[PlannedCall, ToolContext], Awaitable[Any]]
"""Stands in for running the handler: returns what a handler would, or a whole ToolResult
(offline replay serves recorded results through one; `Dispatcher(runner=...)` wraps a
public `dispatcher.ToolRunner`)."""


BeforeWrite = Callable[[PlannedCall], Awaitable[ToolResult | None]]
"""Awaited before a call that writes starts (a session store records that it started):
None lets it start; a result is the call's instead, and it does not start."""


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


class RunControl:
    """Run-control signals raised by calls of this batch, by call index (a plain class:
    one is made per batch)."""

    __slots__ = ("blocked", "interrupted", "keyboard")

    def __init__(self) -> None:
        self.blocked: dict[int, HookBlocked] = {}
        self.interrupted: dict[int, DispatchInterrupted] = {}
        self.keyboard: dict[int, KeyboardInterrupt] = {}

    def __bool__(self) -> bool:
        return bool(self.blocked or self.interrupted or self.keyboard)

    def first(self) -> BaseException | None:
        """A tool's KeyboardInterrupt wins (whoever raised it wants the program to stop), then
        a hook block, then an interrupt; among equals, the earliest call. (Cancellation
        wins over all of them: it propagates out of pass 2 itself.)"""
        if self.keyboard:
            return self.keyboard[min(self.keyboard)]
        if self.blocked:
            return self.blocked[min(self.blocked)]
        if self.interrupted:
            return self.interrupted[min(self.interrupted)]
        return None


_CALM = RunControl()
"""The run control of every batch that has no signal: never written (see `Executor._signalled`)."""


def _is_cancellation(exc: BaseException) -> bool:
    """Whether `exc` is the loop's cancellation, or a group holding one."""
    cancelled = anyio.get_cancelled_exc_class()
    return isinstance(exc, cancelled) or (
        isinstance(exc, BaseExceptionGroup) and exc.subgroup(cancelled) is not None
    )


def _keyboard_in(group: BaseExceptionGroup[BaseException]) -> KeyboardInterrupt | None:
    """The first KeyboardInterrupt in a group the tool raised (its own task group's)."""
    for exc in group.exceptions:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        if isinstance(exc, BaseExceptionGroup) and (found := _keyboard_in(exc)) is not None:
            return found
    return None


def _call_to_show(planned: PlannedCall) -> ToolCall:
    """The call for hooks, with a copy of its arguments: a hook that edits them must not
    change what the tool runs with, what was validated and keyed."""
    return ToolCall(planned.call_id, planned.name, copy.deepcopy(planned.args))


def _name_of(fn: Any) -> str:
    """A hook's name for a message: `Audit.before`, not its repr with an address."""
    name = getattr(fn, "__qualname__", None)
    return name.rsplit("<locals>.", 1)[-1] if isinstance(name, str) else repr(fn)


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


@attrs.define(eq=False)
class _Slot:
    """One worker's bookkeeping: the call it is running and when that call must stop."""

    watched: bool
    scope: Any = None  # the backend's CancelScope
    borrower: object | None = None  # the limiter slot this worker keeps between its calls
    running: PlannedCall | None = None
    ctx: ToolContext | None = None
    started: float = 0.0
    t0: float = 0.0
    timeout: float = 0.0
    deadline: float = math.inf
    cut: bool = False  # the watchdog cancelled `scope` (cheaper to read than `cancel_called`)

    def idle(self) -> None:
        """The running call is over (or never started): nothing for the watchdog to cut."""
        self.deadline = math.inf
        self.running = None


@attrs.define(eq=False)
class _Crew:
    """The workers of one concurrent group, the calls they share and who supervises them."""

    done: Any  # the backend's Event
    todo: collections.deque[PlannedCall]
    most: int
    shortest: float
    slots: list[_Slot] = attrs.field(factory=list)
    working: int = 0
    nursery: Any = None  # the backend's task group


class Executor:
    """Runs the groups of one plan. `results` is filled as calls finish (pass 3 reads it).

    Timeouts: a call started on the batch's own task (a lone call, and the calls of a
    concurrent group until one waits, `_run_group`) is held to its deadline as a cancel
    scope around it would hold it (`Primitives.under_deadline`: where first steps run at
    once, one that returns before it first waits pays for no scope at all; one that waits
    gets its scope then). On a group's workers a cancel scope per call would cost more
    than the rest of the call's overhead, so each worker keeps one scope and one watchdog
    task per group sleeps until the earliest running call's deadline and cancels just that
    worker. A call that starts at `s` with timeout `T` is still cancelled at exactly
    `s + T`: the watchdog never sleeps past `now + (the group's smallest timeout)`, and no
    call can start and end sooner.
    """

    def __init__(
        self,
        *,
        limiter: anyio.CapacityLimiter,
        thread_limiter: anyio.CapacityLimiter,
        primitives: _backend.Primitives,
        default_timeout: float,
        deadline: float | None,
        hooks: HookSet,
        context: tuple[int, int, float | None, ContextHost | None],
        max_output_bytes: int,
        runner: ToolRunner | None = None,
        watch: Watch | None = None,
        before_write: BeforeWrite | None = None,
    ) -> None:
        self._limiter = limiter
        self._before_write = before_write
        # the dispatcher's limiter bounds sync calls too: the thread pool's own bound must
        # not add a second one, so threads are started under this unbounded limiter
        self._thread_limiter = thread_limiter
        self._timeout = default_timeout
        self._hooks = hooks
        self._max_out = max_output_bytes
        # a worker may keep its slot between calls only when nothing runs between them: a
        # hook may wait (an approval, an audit), and no slot is held while no call runs
        self._keep = not (hooks.before or hooks.after)
        self._runner: ToolRunner | None = None
        self._serve: Callable[[PlannedCall], ToolResult | None] | None = None
        # nothing but the handler between a call's start and its result: `_run_kept` serves
        self._plain = self._keep and before_write is None
        if runner is not None:
            self.run_by(runner)
        self._now = primitives.clock
        self._p = primitives
        # a call's first step runs before any scope exists (`Primitives.eager`): a concurrent
        # group's calls start on the batch's own task, and workers start only once one waits
        self._eager = primitives.eager
        self._watch = watch if watch is not None else Watch(None, DEFAULT_BLOCK_THRESHOLD)
        ops = self._watch.slot_ops  # made once a limiter: replay makes an executor a batch
        if ops is None or ops[0] is not limiter or ops[4] is not primitives.waiting:
            ops = self._watch.slot_ops = (
                limiter,
                *_backend.slot_ops(limiter, primitives.would_block),
                _backend.waiting_on(limiter, primitives.waiting),
                primitives.waiting,
            )
        self._take, self._give, self._waiting_now = ops[1], ops[2], ops[3]
        self._holding = self._watch.holding
        self._blocking = self._watch.blocking
        self._begin(deadline, context)
        # what `fresh` copies: everything, those of one batch made anew (keeping them in the
        # copy sizes it for them)
        self._settings = dict(vars(self))

    def _begin(
        self, deadline: float | None, context: tuple[int, int, float | None, ContextHost | None]
    ) -> None:
        """What belongs to one batch: its deadline and calls' context, and what it fills."""
        self._deadline = deadline
        self._context = context  # run id, round, deadline and host of every call's ToolContext
        self.results: dict[int, ToolResult] = {}
        self.started: set[int] = set()  # calls whose handler (or, in replay, runner) was started
        self.control = _CALM  # made anew by `_signalled`, at the batch's first signal
        self._nested = False

    def fresh(
        self, deadline: float | None, context: tuple[int, int, float | None, ContextHost | None]
    ) -> Executor:
        """An executor for another batch, with this one's settings and the batch's own
        `deadline` and `context`: one dict copied, where `__init__` works each out again."""
        made = object.__new__(Executor)
        made.__dict__ = self._settings.copy()
        made._begin(deadline, context)
        return made

    def run_by(self, runner: ToolRunner) -> Executor:
        """This executor, its calls run by `runner` (replay's serves a recorded result at
        once, with `serve_now`, unless hooks wrap every call that starts)."""
        self._runner = runner
        self._serve = getattr(runner, "serve_now", None) if self._keep else None
        self._plain = False
        return self

    def _signalled(self) -> RunControl:
        """This batch's run control, to record a signal in: made at the first one (most
        batches have none, and share one that stays empty)."""
        control = self.control
        if control is _CALM:
            control = self.control = RunControl()
        return control

    def _timeout_of(self, planned: PlannedCall) -> float:
        return self._tool_timeout(planned.tool)

    def _tool_timeout(self, tool: RegisteredTool | None) -> float:
        """The timeout of a call of `tool`: its own, else the dispatcher's."""
        return (tool.tool.timeout if tool is not None else None) or self._timeout

    async def run(self, plan: Plan) -> None:
        calls = plan.calls
        # A handler that dispatches (`ctx.dispatcher.invoke(...)`) holds a slot of this
        # limiter while it waits: its calls run on that slot, one at a time (whatever the
        # handler runs side by side), instead of waiting for a slot that every holder may
        # be waiting for too.
        holder = _RUNNING_ON.get()
        self._nested = holder is not None and holder.limiter is self._limiter
        blocking = self._blocking
        if blocking is not None:
            blocking.enter()
        # taken and given back by hand: `async with` a null context costs more than a call
        lock = holder.lock() if holder is not None and self._nested else None
        try:
            if lock is not None:
                await lock.acquire()
            try:
                alone: _Slot | None = None  # the unwatched slot of the groups of one call
                for group in plan.groups:
                    if self._serve is not None and not (group := self._served(group, calls)):
                        continue
                    if self._nested:
                        await self._worker(collections.deque([calls[i] for i in group]), _Slot(watched=False))
                    elif len(group) == 1:
                        # started on this task (`_first_steps`), else `_worker`'s steps for one
                        # call, without a worker: most batches are one call
                        todo = collections.deque((calls[group[0]],))
                        running_on = _RUNNING_ON.set(_Holder(self._limiter))
                        try:
                            if self._plain and (step := self._first_steps(todo)) is not None:
                                await step
                            if todo:  # left to the usual way: not async, or no slot free at once
                                if alone is None:
                                    alone = _Slot(watched=False)
                                await self._run_call(todo[0], alone)
                        finally:
                            _RUNNING_ON.reset(running_on)
                    else:
                        await self._run_group(list(map(calls.__getitem__, group)))
                    if self.control is not _CALM:  # a signal came (`_signalled`)
                        return  # later groups do not start
            finally:
                if lock is not None:
                    lock.release()
        finally:
            if blocking is not None:
                blocking.exit()

    def _served(self, group: tuple[int, ...], calls: Sequence[PlannedCall]) -> tuple[int, ...]:
        """Replay: the calls of `group` whose recorded result its runner hands back at once
        (`serve_now`) are done here, with no task, slot or timeout, since nothing runs;
        the rest (a tool replay runs for real, a run past its deadline) go the usual way."""
        assert self._serve is not None
        rest = []
        for i in group:
            planned = calls[i]
            try:
                result = self._serve(planned) if self._deadline is None else None
            except Exception:  # the usual way makes a failed result of it, as of any runner's
                result = None
            if result is None:
                rest.append(i)
                continue
            self.started.add(i)
            if result.call_id != planned.call_id or result.name != planned.name:
                result = attrs.evolve(result, call_id=planned.call_id, name=planned.name)
            self.results[i] = result
        return tuple(rest)

    async def _run_group(self, group: list[PlannedCall]) -> None:
        """Run a concurrent group. Where a call's first step runs before any scope exists
        (`_eager`) and nothing but the handler runs between a call's start and its result,
        the batch's own task starts the calls in turn, each as a call run alone starts,
        while a slot is free at once: most calls return in their first step, and a group
        of them costs no task and no task group. Once one waits, the task group opens, as
        if before that call started, and workers start in it for the calls after it (one
        slot fewer: this task goes on as the last of them once its call is over); a call
        that is not async, or finds no slot free, is left to the workers."""
        todo = collections.deque(group)
        if self._eager and self._plain:
            mark = self._p.mark()
            running_on = _RUNNING_ON.set(_Holder(self._limiter))
            try:
                step = self._first_steps(todo)
                if step is not None:
                    async with self._p.task_group_since(mark) as nursery:
                        spare = self._limiter.total_tokens - 1  # the slots besides this task's
                        crew = (
                            self._crew(nursery, todo, int(min(len(todo), spare)))
                            if todo and spare >= 1
                            else None
                        )
                        while step is not None:
                            await step
                            if (lost := self._p.lost_cancel(mark)) is not None:
                                raise lost
                            step = self._first_steps(todo)
                        if todo:  # the next is the workers' (not async, or no slot free at once)
                            if crew is None or crew.done.is_set():
                                self._crew(nursery, todo, len(todo))
                            else:  # theirs is this task's slot too: one more of them takes it
                                crew.most += 1
                                self._add_worker(crew)
                    return
            finally:
                _RUNNING_ON.reset(running_on)
            if not todo:
                return
        async with self._p.task_group() as nursery:
            self._crew(nursery, todo, len(todo))

    def _crew(self, nursery: Any, todo: collections.deque[PlannedCall], most: int) -> _Crew:
        """Start the workers of `todo` in `nursery`: one now, and a supervisor that adds
        more, up to `most` (and the limit), as the running ones let go of the loop."""
        tools = list(map(_TOOL, todo))
        crew = _Crew(
            done=self._p.event(),
            todo=todo,
            most=max(1, int(min(most, self._limiter.total_tokens))),
            # asked once a tool (told apart by identity, in one pass without a frame a call):
            # a batch is mostly calls of a few
            shortest=min(map(self._tool_timeout, dict(zip(map(id, tools), tools, strict=True)).values())),
            nursery=nursery,
        )
        self._add_worker(crew)
        nursery.start_soon(self._supervise, crew)
        return crew

    def _add_worker(self, crew: _Crew) -> None:
        slot = _Slot(watched=True)
        crew.slots.append(slot)
        crew.working += 1
        assert crew.nursery is not None
        crew.nursery.start_soon(self._crew_worker, crew, slot)

    async def _crew_worker(self, crew: _Crew, slot: _Slot) -> None:
        try:
            await self._worker(crew.todo, slot)
        finally:
            crew.working -= 1
            if not crew.working:
                crew.done.set()  # the last one out lets the supervisor go

    async def _supervise(self, crew: _Crew) -> None:
        """Spawn and watch. While calls wait, add a worker each time the running ones let go
        of the loop (calls that never block are all run by the first worker; calls that block
        fan out up to the limit). Then sleep until the earliest running call's deadline and
        cancel just the worker whose call overran. Returns when the last worker is done:
        it is woken, not cancelled, since unwinding a cancellation costs more than a
        group of quick calls."""
        slots = crew.slots
        while not crew.done.is_set():
            now = self._now()
            wake = now + crew.shortest
            for slot in slots:
                if slot.deadline <= now:
                    slot.deadline = math.inf
                    assert slot.scope is not None
                    slot.cut = True
                    slot.scope.cancel()
                elif slot.deadline < wake:
                    wake = slot.deadline
            if crew.todo and len(slots) < crew.most:
                await self._p.checkpoint()
                if crew.todo:
                    self._add_worker(crew)
            else:
                with self._p.cancel_scope(deadline=wake):
                    await crew.done.wait()

    async def _worker(self, todo: collections.deque[PlannedCall], slot: _Slot) -> None:
        running_on = _RUNNING_ON.set(_Holder(self._limiter))  # the slot a handler run here holds
        try:
            if not slot.watched:  # no watchdog to cancel it: each call's own scope is its timeout
                while todo:
                    await self._run_call(todo.popleft(), slot)
                return
            plain = self._plain
            while True:
                try:
                    with self._p.cancel_scope() as scope:
                        slot.scope, slot.cut = scope, False
                        while todo:
                            tool = todo[0].tool
                            if plain and slot.borrower is not None and tool is not None and tool.is_async:
                                await self._run_kept(todo, slot)
                            else:
                                await self._run_call(todo.popleft(), slot)
                            if slot.cut:
                                # the call overran but swallowed its cancellation and returned:
                                # the next call must not inherit a cancelled scope
                                break
                        else:
                            return
                except BaseException as exc:
                    # the watchdog's cut, which the tool took and raised anew as a cancellation
                    # of its own (asyncio's scope lets through a CancelledError it did not make)
                    if not slot.cut or _backend.cancellation_pending():
                        raise
                    if not _is_cancellation(exc):
                        # what the cut call raised beside the cut (its own tasks' failures), the
                        # cut taken off by the scope: that call's result, as on the batch's task
                        cut = slot.running
                        if cut is None or slot.ctx is None:
                            raise
                        slot.running = None
                        try:
                            result = self._raised(cut, None, exc, slot.started, slot.t0)
                        except (HookBlocked, DispatchInterrupted, KeyboardInterrupt) as control:
                            self._land_raised(cut, None, control, slot.started, slot.t0)
                            continue
                        await self._finish(cut, result, slot.ctx)
                        continue
                # only the watchdog cancels this scope: the running call timed out
                timed_out = slot.running
                if timed_out is not None and slot.ctx is not None:
                    slot.running = None
                    result = self._timed_out(timed_out, slot.timeout, slot.started, slot.t0)
                    await self._finish(timed_out, result, slot.ctx)
        finally:
            _RUNNING_ON.reset(running_on)
            if slot.borrower is not None:
                self._give_back(slot)

    def _let_go(self, slot: _Slot, borrower: object | None) -> None:
        """Give back the slot a call took, or its worker kept, for a call that does not start."""
        if borrower is not None:
            if slot.borrower is borrower:
                slot.borrower = None
            self._watch.release(self._limiter, borrower)

    def _give_back(self, slot: _Slot) -> None:
        """Return the limiter slot a worker kept between its calls."""
        self._let_go(slot, slot.borrower)

    def _timed_out(self, planned: PlannedCall, timeout: float, started: float, t0: float) -> ToolResult:
        return failure_result(
            planned.call_id,
            planned.name,
            Status.timed_out,
            f"{planned.name} ran past its timeout of {timeout:g} s",
            effect_uncertain=bool(planned.writes),
            started=started,
            duration=time.monotonic() - t0,
            limit=self._max_out,
        )

    async def _finish(
        self, planned: PlannedCall, result: ToolResult, ctx: ToolContext, call: ToolCall | None = None
    ) -> None:
        """Record the result, then run the after hooks (given the same `call` as the before
        hooks, if any ran); run control is collected, not raised."""
        self.results[planned.index] = result
        if not self._hooks.after:
            return
        if call is None:
            call = _call_to_show(planned)
        for after in self._hooks.after:
            try:
                await _maybe_await(after(call, result, ctx))
            except HookBlocked as exc:
                self._block(planned, exc)
                return
            except DispatchInterrupted as exc:
                self._signalled().interrupted[planned.index] = exc
                return
            except BaseException as exc:  # the call is over and its result stands; a faulty hook is logged
                if not _backend.ordinary_failure(exc):
                    raise
                log.warning(
                    "after hook %s raised on call %s; ignored",
                    _name_of(after),
                    planned.call_id,
                    exc_info=True,
                )

    def _block(self, planned: PlannedCall, exc: HookBlocked) -> None:
        if exc.call_id is None:
            exc.call_id = planned.call_id
        self._signalled().blocked[planned.index] = exc

    async def _run_call(self, planned: PlannedCall, slot: _Slot) -> None:
        index = planned.index
        if self._deadline is not None and self._now() >= self._deadline:
            self.results[index] = failure_result(
                planned.call_id,
                planned.name,
                Status.expired,
                "run deadline elapsed before the tool started",
                limit=self._max_out,
            )
            return
        ctx = new_context(planned.call_id, planned.name, *self._context)
        hooks = self._hooks
        call = None  # one ToolCall for both kinds of hook
        if hooks.before or hooks.after:
            call = _call_to_show(planned)
        try:
            if call is not None and hooks.before:
                refused = await self._before(planned, call, ctx)
                if refused is not None:
                    self.results[index] = refused
                    return
            result = await self._invoke(planned, ctx, slot)
        except HookBlocked as exc:
            self._block(planned, exc)
            return
        except DispatchInterrupted as exc:
            self._signalled().interrupted[index] = exc
            return
        except KeyboardInterrupt as exc:  # the tool's own: its siblings finish, then it propagates
            self._signalled().keyboard[index] = exc
            return
        if hooks.after:
            await self._finish(planned, result, ctx, call)
        else:
            self.results[index] = result

    async def _before(self, planned: PlannedCall, call: ToolCall, ctx: ToolContext) -> ToolResult | None:
        """Run the before hooks; run control propagates. A hook that raises anything else
        fails the call unrun (a guard that broke cannot vouch for it): that result, or None."""
        for before in self._hooks.before:
            try:
                await _maybe_await(before(call, ctx))
            except (HookBlocked, DispatchInterrupted):
                raise
            except BaseException as exc:
                if not _backend.ordinary_failure(exc):
                    raise
                name = _name_of(before)
                log.warning("before hook %s raised on call %s", name, planned.call_id, exc_info=True)
                return failure_result(
                    planned.call_id,
                    planned.name,
                    Status.failed,
                    f"the before hook {name} failed, so the tool did not run: {describe(exc)}",
                    retryable=False,
                    limit=self._max_out,
                )
        return None

    async def _invoke(self, planned: PlannedCall, ctx: ToolContext, slot: _Slot) -> ToolResult:
        """Run one call under its timeout and a limiter slot; ordinary failures become results."""
        tool = planned.tool
        assert tool is not None
        timeout = self._timeout_of(planned)
        args = planned.args
        borrower: object | None = None  # nested: the calling handler's slot, nothing to take
        # a sync call's slot is given back by its thread (it may outlive a timeout); others
        # give theirs back as they end, or keep it for their worker's next call
        release = self._runner is not None or tool.is_async or tool.in_process
        if not self._nested:
            borrower = slot.borrower
            if borrower is None or not release:
                if borrower is not None:
                    self._give_back(slot)
                # one per slot taken, hashed by identity: a ToolContext hashes by value, and
                # two calls of a batch may share an id
                borrower = object()
                if not self._take(borrower):
                    waited = await self._queue(planned, borrower, timeout)
                    if waited is not None:
                        return waited
        if planned.writes and self._before_write is not None:
            try:
                refused = await self._before_write(planned)
            except BaseException:  # cancelled while its start was being recorded
                self._let_go(slot, borrower)
                raise
            if refused is not None:  # its start could not be recorded: it does not start
                self._let_go(slot, borrower)
                return refused
        release = release and borrower is not None
        self.started.add(planned.index)
        started = time.time()
        t0 = time.monotonic()
        holding = self._holding
        if borrower is not None:
            holding[borrower] = (planned, t0, timeout)
        deadline: float | None = None  # of its own scope, when no watchdog's slot cuts it
        try:
            if slot.watched:
                slot.running, slot.ctx, slot.started, slot.t0 = planned, ctx, started, t0
                slot.timeout, slot.deadline = timeout, self._now() + timeout
                value = await _backend.in_own_context(self._start(planned, ctx, args, borrower, timeout))
                slot.idle()
                if slot.cut and tool.is_async:  # the watchdog cut it at its deadline; it swallowed that
                    return self._timed_out(planned, timeout, started, t0)
            else:
                deadline = self._now() + timeout
                awaitable = self._start(planned, ctx, args, borrower, timeout)
                if type(awaitable) is types.CoroutineType:
                    # a handler's coroutine (or a runner's), held to its deadline without a
                    # cancel scope of its own while it never waits; in a context of its own
                    value, rest = self._p.under_deadline(awaitable, deadline)
                    late = False
                    if rest is not None:
                        value, late = await rest
                    if late or (tool.is_async and self._now() >= deadline):
                        # cut short, or it swallowed that and returned after its deadline (a
                        # nested sync call, on its caller's slot, is not cut and counts as it ends)
                        return self._timed_out(planned, timeout, started, t0)
                else:
                    # a scope with a deadline: move_on_after is a generator-made wrapper of it
                    with self._p.cancel_scope(deadline=deadline) as scope:
                        value = await awaitable
                    if scope.cancelled_caught or (tool.is_async and scope.cancel_called):
                        return self._timed_out(planned, timeout, started, t0)
            if isinstance(value, ToolResult) and self._runner is not None:
                if time.monotonic() - t0 > timeout and tool.is_async:
                    return self._timed_out(planned, timeout, started, t0)
                if value.call_id == planned.call_id and value.name == planned.name:
                    return value
                return attrs.evolve(value, call_id=planned.call_id, name=planned.name)
            return self._returned(planned, value, timeout, started, t0, tool.is_async)
        except BaseException as exc:
            return self._raised(planned, slot, exc, started, t0, deadline)
        finally:
            if release:
                self._done_with(slot, borrower)

    async def _run_kept(self, todo: collections.deque[PlannedCall], slot: _Slot) -> None:
        """`_run_call` of the async tools' calls at the front of `todo`, by a worker that
        kept its limiter slot, when nothing but the handler runs between a call's start and
        its result (no hook, runner or start mark): the same steps in one frame, call after
        call while the worker keeps its slot and none was cut, since this is most calls of a
        batch (awaiting a coroutine is no checkpoint: one a call would run them alike)."""
        run_id, round_, deadline, host = self._context
        results, started_calls, holding = self.results, self.started, self._holding
        waiting, now = self._waiting_now, self._now
        run_deadline, default_timeout = self._deadline, self._timeout
        while todo:
            planned = todo[0]
            # the fields read at once (a named tuple's field read by name is the generic lookup)
            index, call_id, name, args, tool, _, _, _, _, _, _, _, _, _ = planned
            if slot.borrower is None or tool is None or not tool.is_async:
                return  # the worker's loop takes it
            todo.popleft()
            if run_deadline is not None and now() >= run_deadline:
                await self._run_call(planned, slot)  # which says so
                if slot.cut:
                    return
                continue
            spec = tool.tool
            timeout = spec.timeout or default_timeout
            borrower = slot.borrower
            ctx = new_context(call_id, name, run_id, round_, deadline, host)
            started_calls.add(index)
            started = time.time()
            t0 = time.monotonic()
            holding[borrower] = (planned, t0, timeout)
            slot.running, slot.ctx, slot.started, slot.t0 = planned, ctx, started, t0
            slot.timeout, slot.deadline = timeout, now() + timeout
            try:
                value = await _backend.in_own_context(spec.handler(args, ctx))
                slot.running, slot.deadline = None, _INF  # slot.idle()
                if slot.cut:  # the watchdog cut it at its deadline, and it swallowed that
                    results[index] = self._timed_out(planned, timeout, started, t0)
                else:
                    results[index] = self._returned(planned, value, timeout, started, t0, True)
            except BaseException as exc:
                self._land_raised(planned, slot, exc, started, t0)
            finally:
                value = None  # let go before the next call runs, as a frame a call would
                if waiting():
                    self._done_with(slot, borrower)  # which gives the slot back
                else:
                    slot.borrower = borrower  # `_done_with`'s commonest case: kept for the next call
            if slot.cut:
                return  # the worker's loop gives the next call a scope of its own

    def _first_steps(self, todo: collections.deque[PlannedCall]) -> Coroutine[Any, Any, None] | None:
        """`_run_call` of the async tools' calls at the front of `todo`, on this task, when
        nothing but the handler runs between a call's start and its result, as far as the
        first that waits: each taken from `todo` as it starts, the handler's first step run
        before any scope exists (`under_deadline`); one slot of the limiter taken for them
        and kept from call to call while nobody waits for one. Returns what finishes the
        call that waited (it has the slot), to await on this task; None once the calls are
        done, or the next is one to leave to the usual way (not async, no slot free at once,
        or the run's deadline passed, which it says)."""
        # few locals made before the first call: most groups of them are a lone call
        holding, now = self._holding, self._now
        borrower: object | None = None
        try:
            while todo:
                planned = todo[0]
                # the fields read at once (a named tuple's field read by name is the generic lookup)
                index, call_id, name, args, tool, _, _, _, _, _, _, _, _, _ = planned
                if (
                    tool is None
                    or not tool.is_async
                    or (self._deadline is not None and now() >= self._deadline)
                ):
                    return None
                if borrower is None:
                    borrower = object()
                    if not self._take(borrower):
                        borrower = None
                        return None
                todo.popleft()
                spec = tool.tool
                timeout = spec.timeout or self._timeout
                ctx = new_context(call_id, name, *self._context)
                self.started.add(index)
                started = time.time()
                t0 = time.monotonic()
                holding[borrower] = (planned, t0, timeout)
                until = math.inf
                try:
                    awaitable = spec.handler(args, ctx)
                    until = now() + timeout
                    if type(awaitable) is types.CoroutineType:
                        # in a copy of the batch's context, as a task of its own would run: what
                        # it sets reaches neither the calls after it nor the caller
                        value, left = self._p.under_deadline(awaitable, until)
                        if left is not None:
                            kept, borrower = borrower, None  # the rest gives it back
                            return self._rest(planned, left, None, kept, timeout, started, t0, until)
                    else:  # an awaitable that is no coroutine: awaited in a scope of its own
                        kept, borrower = borrower, None
                        return self._rest(planned, None, awaitable, kept, timeout, started, t0, until)
                    if now() >= until:  # it returned after its deadline, never having waited
                        self.results[index] = self._timed_out(planned, timeout, started, t0)
                    else:
                        self.results[index] = self._returned(planned, value, timeout, started, t0, True)
                except BaseException as exc:
                    self._land_raised(planned, None, exc, started, t0, until)
                value = None  # let go before the next call runs, as a frame a call would
                if self._waiting_now():  # somebody waits for a slot: this one is theirs
                    del holding[borrower]
                    self._give(borrower)
                    borrower = None
            return None
        finally:
            if borrower is not None:
                del holding[borrower]
                self._give(borrower)

    async def _rest(
        self,
        planned: PlannedCall,
        left: Awaitable[tuple[Any, bool]] | None,
        awaitable: Any,
        borrower: object,
        seconds: float,
        started: float,
        t0: float,
        deadline: float,
    ) -> None:
        """The rest of a call `_first_steps` started: `left`, what `under_deadline` left of
        it, or else `awaitable`, one that is no coroutine, in a scope of its deadline;
        `seconds`, its timeout."""
        index = planned.index
        try:
            if left is not None:
                value, late = await left
            else:
                with self._p.cancel_scope(deadline=deadline) as scope:
                    value = await awaitable
                late = scope.cancelled_caught
            if late or self._now() >= deadline:  # cut short, or it swallowed that and returned after
                self.results[index] = self._timed_out(planned, seconds, started, t0)
            else:
                self.results[index] = self._returned(planned, value, seconds, started, t0, True)
        except BaseException as exc:
            self._land_raised(planned, None, exc, started, t0, deadline)
        finally:
            del self._holding[borrower]
            self._give(borrower)

    def _returned(
        self, planned: PlannedCall, value: Any, timeout: float, started: float, t0: float, is_async: bool
    ) -> ToolResult:
        """The result of a handler that returned `value`."""
        duration = time.monotonic() - t0
        if type(value) is str and duration <= timeout and value.isascii() and len(value) * 4 <= self._max_out:
            # the commonest value: text that needs neither mending nor a cut
            return new_result(
                planned.call_id, planned.name, _OK, value, False, False, False, False, started, duration
            )
        if duration > timeout and is_async:
            # it held the loop (or swallowed its cancellation) past its timeout: what it
            # returned came too late to count (a nested sync call is not cut short at its
            # timeout, being on its caller's slot, and is reported as it ends)
            return self._timed_out(planned, timeout, started, t0)
        content = normalize_output(value, self._max_out)
        return new_result(
            planned.call_id, planned.name, _OK, content, False, False, False, False, started, duration
        )

    def _land_raised(
        self,
        planned: PlannedCall,
        slot: _Slot | None,
        exc: BaseException,
        started: float,
        t0: float,
        deadline: float | None = None,
    ) -> None:
        """What `_run_call` makes of a handler's exception, for the one-frame paths: run
        control collected, a failure the call's result, cancellation raised again."""
        if isinstance(exc, HookBlocked):  # raised by the tool: run control
            if slot is not None:
                slot.idle()
            self._block(planned, exc)
        elif isinstance(exc, DispatchInterrupted):
            if slot is not None:
                slot.idle()
            self._signalled().interrupted[planned.index] = exc
        else:
            try:
                self.results[planned.index] = self._raised(planned, slot, exc, started, t0, deadline)
            except KeyboardInterrupt as keyboard:
                self._signalled().keyboard[planned.index] = keyboard

    def _raised(
        self,
        planned: PlannedCall,
        slot: _Slot | None,
        exc: BaseException,
        started: float,
        t0: float,
        deadline: float | None = None,
    ) -> ToolResult:
        """The result of a handler that raised `exc`: ordinary failures become results; run
        control and cancellation raise again (a tool's KeyboardInterrupt as itself). Only a
        cancellation leaves `slot` (None: a call started by `_first_steps`) saying what
        runs, for the worker that reports the timeout. A cancellation is the call's when
        its slot was cut or the task is being cancelled; else, past the call's `deadline`
        (its own scope's), its timeout, however it took the cut; else a cancellation the
        tool raised itself (on asyncio, having awaited something else cancelled; on trio, one
        it kept from a scope of its own), its failure."""
        if _is_cancellation(exc):
            if (slot is not None and slot.cut) or _backend.cancellation_pending():
                raise exc  # the worker reports a timeout from what the slot says is running
            if deadline is not None and self._now() >= deadline:
                if slot is not None:
                    slot.idle()
                return self._timed_out(planned, self._timeout_of(planned), started, t0)
        if slot is not None:
            slot.idle()
        if isinstance(exc, (HookBlocked, DispatchInterrupted)):
            raise exc
        if isinstance(exc, ToolError):
            return self._failed(planned, exc.message, started, t0, retryable=exc.retryable)
        if isinstance(exc, (Exception, SystemExit)):  # a tool that calls sys.exit (argparse does) fails alone
            return self._failed(planned, describe(exc), started, t0)
        if isinstance(exc, KeyboardInterrupt):
            raise exc  # run control: `_run_call` collects it
        if isinstance(exc, BaseExceptionGroup) and (keyboard := _keyboard_in(exc)) is not None:
            raise keyboard from exc
        # GeneratorExit and the like, raised by the tool's own code: its failure alone
        return self._failed(planned, describe(exc), started, t0)

    def _done_with(self, slot: _Slot, borrower: object) -> None:
        """A call on `borrower`'s limiter slot is over: its worker keeps the slot for its next
        call while nobody waits for one (taking and giving back a slot per call costs more
        than the rest of it), else it goes back."""
        if slot.watched and self._keep and not self._waiting_now():
            slot.borrower = borrower
        else:  # what Watch.release does, inline: this is every async call
            slot.borrower = None
            del self._holding[borrower]
            self._give(borrower)

    async def _queue(self, planned: PlannedCall, borrower: object, call_timeout: float) -> ToolResult | None:
        """Wait for a slot, at most the queue limit (default: the call's timeout). None: got
        one; else the call's `timed_out`, naming who held the slots."""
        wait = self._watch.queue_limit
        if wait is None:
            wait = call_timeout
        began = time.time()
        with self._p.move_on_after(wait) as scope:
            await self._limiter.acquire_on_behalf_of(borrower)
        if not scope.cancelled_caught:
            return None
        holders = self._watch.holders() or "nobody (the limit is full of nested calls)"
        return failure_result(
            planned.call_id,
            planned.name,
            Status.timed_out,
            f"waited {wait:g} s for a slot held by: {holders}",
            started=began,
            duration=wait,
            limit=self._max_out,
        )

    def _failed(
        self,
        planned: PlannedCall,
        error: str,
        started: float,
        t0: float,
        *,
        retryable: bool | None = None,
    ) -> ToolResult:
        """A call whose tool raised: `failed`, its effect uncertain if it writes."""
        return failure_result(
            planned.call_id,
            planned.name,
            Status.failed,
            error,
            retryable=retryable,
            effect_uncertain=bool(planned.writes),
            started=started,
            duration=time.monotonic() - t0,
            limit=self._max_out,
        )

    def _start(
        self,
        planned: PlannedCall,
        ctx: ToolContext,
        args: Mapping[str, Any],
        borrower: object | None,
        timeout: float,
    ) -> Awaitable[Any]:
        """What to await for the handler's return value (or, in replay, the runner's recorded
        result). Not itself a coroutine: an async handler's own coroutine is awaited directly."""
        if self._runner is not None:
            return self._runner(planned, ctx)
        tool = planned.tool
        assert tool is not None
        if tool.is_async:
            awaitable: Awaitable[Any] = tool.tool.handler(args, ctx)
            return awaitable
        if tool.in_process:
            return self._in_process(tool.tool.handler, args, ctx, timeout)
        return self._in_thread(tool.tool.handler, args, ctx, borrower, _Abandonable())

    async def _in_process(
        self, handler: Callable[..., Any], args: Mapping[str, Any], ctx: ToolContext, call_timeout: float
    ) -> Any:
        """Run a sync handler in a worker process, killed if this call is cancelled (its
        timeout): the slot is this call's and is given back as it unwinds."""
        pool = self._watch.pool
        if pool is None:
            if self._watch.closed:
                raise RuntimeError("this Dispatcher was shut down: it starts no worker processes")
            pool = self._watch.pool = ProcessPool(keep=int(self._limiter.total_tokens))
        snapshot = ProcessContext(
            ctx.call_id, ctx.tool_name, ctx.session_id, ctx.run_id, ctx.round, call_timeout
        )
        for _ in range(2):  # a second worker if the first had ended before the call reached it
            worker = pool.take()
            if worker is None:
                start = Start(pool)
                try:
                    # the call's timeout does not wait for a fork: the worker is kept for the next
                    worker = await anyio.to_thread.run_sync(
                        start, limiter=self._thread_limiter, abandon_on_cancel=True
                    )
                except BaseException:
                    start.abandon()
                    raise
            with contextlib.suppress(WorkerGone):
                return await pool.run(worker, handler, args, snapshot, _backend.wait_readable)
        raise ToolError(f"two worker processes ended before {ctx.tool_name} reached either")

    async def _in_thread(
        self,
        handler: Callable[..., Any],
        args: Mapping[str, Any],
        ctx: ToolContext,
        borrower: object | None,
        state: _Abandonable,
    ) -> Any:
        """Run a sync handler in a worker thread. Past its timeout (or on cancellation) the
        call is reported at once, but the thread keeps its limiter slot until it returns.
        `borrower` None: the slot is a calling handler's, not this call's to give back."""
        limiter = self._limiter
        watch = self._watch
        token = anyio.lowlevel.current_token()

        def job() -> Any:
            try:
                return handler(args, ctx)
            finally:
                with state.lock:
                    state.finished = True
                    give_back = state.abandoned
                if give_back and borrower is not None:
                    # if the loop is gone, its limiter went with it
                    with contextlib.suppress(anyio.RunFinishedError, RuntimeError):
                        anyio.from_thread.run_sync(watch.release, limiter, borrower, token=token)

        try:
            # A call on a slot of its own is reported at its timeout and the thread gives the
            # slot back when it returns. A nested call (borrower None) runs on its caller's
            # slot, which the caller frees when it returns: it is not abandoned, so its
            # timeout cannot cut it short, and it is reported as it ends.
            value = await anyio.to_thread.run_sync(
                job, abandon_on_cancel=borrower is not None, limiter=self._thread_limiter
            )
        except BaseException:
            with state.lock:
                state.abandoned = not state.finished
                give_back_now = not state.abandoned
            if borrower is not None:
                if give_back_now:
                    watch.release(limiter, borrower)
                else:
                    watch.stuck(borrower)
            raise
        if borrower is not None:
            watch.release(limiter, borrower)
        return value


@attrs.define(eq=False)
class _Holder:
    """A worker's slot of `limiter`, which the handler it runs may lend to its own dispatches."""

    limiter: anyio.CapacityLimiter
    _lock: anyio.Lock | None = None

    def lock(self) -> anyio.Lock:
        """Taken by each dispatch on this slot, so they run one at a time (made when first needed)."""
        if self._lock is None:
            self._lock = anyio.Lock()
        return self._lock


_INVOKE = frozenset(
    f.__code__ for f in (Executor._invoke, Executor._run_kept, Executor._first_steps, Executor._rest)
)
"""What `_culprit` looks for on the loop thread's stack: the frames a handler runs under,
each with the call (`planned`) and when it started (`t0`)."""

_RUNNING_ON: contextvars.ContextVar[_Holder | None] = contextvars.ContextVar(
    "threepass_running_on", default=None
)
"""The slot the current task's handler holds, if any (see `Executor.run`)."""


def _culprit(frame: FrameType | None) -> tuple[PlannedCall, float, Watch] | None:
    """The call whose handler's frame (`_INVOKE`) is on the loop thread's stack (the
    innermost: a nested dispatch runs inside its caller's handler), when it started
    (time.monotonic) and the watch of its dispatcher, sampled while the loop is held;
    read from another thread, so it only reads."""
    while frame is not None:
        if frame.f_code in _INVOKE:
            found = frame.f_locals
            planned, t0, executor = found.get("planned"), found.get("t0"), found.get("self")
            if isinstance(planned, PlannedCall) and isinstance(t0, float) and isinstance(executor, Executor):
                return planned, t0, executor._watch
            return None
        frame = frame.f_back
    return None


def _report_block(planned: PlannedCall, seconds: float, watch: Watch) -> None:
    if watch.last_block is planned or seconds <= watch.block_threshold:
        # once a call (its next stall, if any, is the same story); and only past the threshold
        # of its own dispatcher (a watch of a lower one, on the same loop, may have seen it)
        return
    watch.last_block = planned
    watch.blocked(planned, seconds)


def watch_loop(watch: Watch) -> None:
    """Bind `watch` to the running loop: the loop's block watch for its threshold."""
    watch.blocking = _backend.shared_block_watch(watch.block_threshold, _culprit, _report_block)
