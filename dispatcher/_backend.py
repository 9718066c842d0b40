"""The event loop underneath: the one module of the kernel that may import trio or asyncio.

Everything else speaks anyio, so the kernel runs under trio (the reference) and under
asyncio. This module holds the few places where anyio's wrappers cost on the hot path,
or where the kernel must know which loop it is on:

- `primitives()`: what pass 2 uses per call and per group — the clock, cancel scopes,
  `move_on_after`, events, a checkpoint, task groups — as the running backend's own
  (trio's natives on trio: anyio's wrappers there cost several microseconds a call;
  anyio's own on asyncio, where they are the implementation);
- `loop_identity()`: what a Dispatcher binds to on first use, so that using it from a
  second loop or thread is a clear error instead of a hang (`loop_reader()`: its loop,
  read again every batch for less);
- `slot_ops(limiter, would_block)`: how pass 2 takes a limiter slot without waiting and
  gives it back (on trio, without trio's round of calls that wakes nobody when nobody waits);
  `waiting_on(limiter, waiting)`: how it counts who waits for one, asked after every call;
- `wait_readable(fd)`: how pass 2 waits for a worker process's reply;
- `poster()`: how a thread of the kernel's own (the recording's writer) wakes the loop;
- `BlockWatch`: how an async tool that holds the loop is caught — a probe the loop must
  answer, posted from a thread that looks at the loop thread's stack while it waits;
- `Primitives.under_deadline`: how a call started on the batch's own task is held to its
  timeout, in a context of its own (a call that returns before it first suspends pays
  for no cancel scope); `Primitives.mark`/`task_group_since`/`lost_cancel`: how a
  concurrent group whose calls start on that task opens its task group only once one of
  them waits, as if it had been opened before that call started.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import logging
import math
import operator
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from types import FrameType
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import sniffio
import trio

__all__ = [
    "BlockWatch",
    "LoopIdentity",
    "Primitives",
    "cancellation_pending",
    "in_own_context",
    "loop_identity",
    "loop_reader",
    "open_process",
    "ordinary_failure",
    "poster",
    "primitives",
    "shared_block_watch",
    "slot_ops",
    "waiting_on",
    "wait_readable",
]

_log = logging.getLogger("threepass.execute")


def _trio_run_context() -> Any:
    """trio's run context, read directly where a public call costs frames (each use checks
    what it reads); a trio that keeps it elsewhere gets one that holds no runner and no
    task, so the public ways are always taken."""
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT
    except ImportError:  # pragma: no cover - not this trio
        return threading.local()
    return GLOBAL_RUN_CONTEXT


_TRIO_RUN = _trio_run_context()

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


def _asyncio_loop() -> object:
    """The running asyncio loop, unless `loop_identity` would find a trio run first (a trio
    guest on this loop's thread): then None."""
    if hasattr(_TRIO_RUN, "runner"):
        return None
    return asyncio.get_running_loop()


def loop_reader(identity: LoopIdentity) -> Callable[[], object]:
    """What reads the running loop of `identity` again (its trio token, or its asyncio loop)
    for less than `loop_identity`: on trio, trio's run context read with no Python frame
    (`current_trio_token` is two); on asyncio, without the RuntimeError trio raises first.
    Where `loop_identity` would say another loop, it returns something else or raises
    (AttributeError, RuntimeError)."""
    if identity[0] == "asyncio":
        return _asyncio_loop
    read: Callable[[], object] = functools.partial(operator.attrgetter("runner.trio_token"), _TRIO_RUN)
    try:
        if read() is identity[1]:
            return read
    except AttributeError:  # pragma: no cover - a trio that keeps its run elsewhere
        pass
    return trio.lowlevel.current_trio_token  # pragma: no cover - the same, asked the usual way


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
    waiting: Callable[[Any], int]
    """How many tasks wait for a slot of a limiter (of any kind), cheaply."""
    under_deadline: Callable[
        [Coroutine[Any, Any, Any], float], tuple[Any, Awaitable[tuple[Any, bool]] | None]
    ]
    """`under_deadline(coro, deadline)` starts awaiting `coro` as `with cancel_scope(deadline=
    deadline)` around it would, each of its steps run in a copy of the current context
    (the call's own, as a task of its own would have: what it sets reaches neither the
    calls after it nor the caller): `(its value, None)` if it returned before it first
    waited (where first steps run at once, `eager`; nothing is left to await, and no scope
    could have cut it short), else `(None, rest)`, where `await rest` is (its value,
    whether the scope cut it short)."""
    eager: bool = False
    """Whether `under_deadline` runs a call's first step at once, before any scope exists."""
    mark: Callable[[], Any] = lambda: None
    """Where the running task stands now, for `task_group_since` and `lost_cancel`."""
    lost_cancel: Callable[[Any], BaseException | None] = lambda mark: None
    """`lost_cancel(mark)`: a cancellation to raise when the task was cancelled since `mark`
    and a call on it swallowed that (asyncio delivers a cancellation once, where trio's
    stays until its scope is left), else None: the batch is cancelled as it would have
    been had that call run on a task of its own."""
    task_group_since: Callable[[Any], Any] = lambda mark: anyio.create_task_group()
    """`task_group_since(mark)`: an `async with` task group, opened as if at `mark` (where
    the task stood before a call's first step): beneath the cancel scopes and task groups
    that step opened and left open, so theirs close first and it after. Where first steps
    do not run at once (not `eager`), nothing ran since: a task group as it reads."""


async def _scoped(coro: Coroutine[Any, Any, Any], deadline: float) -> tuple[Any, bool]:
    """The coroutine inside a cancel scope, in its own context: (its value, whether the
    scope cut it short)."""
    with anyio.CancelScope(deadline=deadline) as scope:
        return await in_own_context(coro), False
    return None, scope.cancelled_caught


def _under_scope(coro: Coroutine[Any, Any, Any], deadline: float) -> tuple[None, Awaitable[tuple[Any, bool]]]:
    """`under_deadline` as it reads: everything is left to await, in a cancel scope."""
    return None, _scoped(coro, deadline)


def in_own_context(awaitable: Any) -> Any:
    """`awaitable`, each step of it run in a copy of the current context when it is a
    coroutine (a call's, as a task of its own would run it: what it sets reaches neither
    the calls after it on the same task nor the caller)."""
    if type(awaitable) is types.CoroutineType:
        return _from_start(awaitable, contextvars.copy_context())
    return awaitable


@types.coroutine
def _from_start(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> Generator[Any, Any, Any]:
    """`await coro`, each step run in `context`."""
    try:
        yielded = context.run(coro.send, None)
    except StopIteration as done:
        return done.value
    return (yield from _resume(coro, yielded, context))


@types.coroutine
def _resume(
    coro: Coroutine[Any, Any, Any], yielded: Any, context: contextvars.Context
) -> Generator[Any, Any, Any]:
    """What `await coro` does once its first step has yielded `yielded` (PEP 380's
    `yield from`, spelt out), each step run in `context`: every value goes up to the loop,
    every answer down."""
    while True:
        thrown: BaseException | None = None
        try:
            sent = yield yielded
        except GeneratorExit:
            context.run(coro.close)
            raise
        except BaseException as exc:
            thrown = exc  # thrown in once out of this block, as `yield from` throws it: what
            # the coroutine raises then must not be chained to it (anyio reads that chain)
        try:
            if thrown is None:
                yielded = context.run(coro.send, sent)
            else:
                yielded = context.run(coro.throw, thrown)
                thrown = None
        except StopIteration as done:
            return done.value


@trio.lowlevel.enable_ki_protection  # as trio guards its own scopes: no Ctrl-C halfway through the move
def _scope_beneath(task: Any, base: Any, deadline: float) -> trio.CancelScope | None:
    """A cancel scope of `deadline`, entered now as if before the call's first step: its
    cancel status goes between `base` (the task's before that step) and the outermost
    scope the step opened and left open, so theirs still close first and ours after, and
    cancellation, shields included, reaches the call's scopes as from an outer scope. The
    move is trio's own (`TaskStatus.started` moves cancel statuses the same way). None
    if the step's scopes do not lead back to `base`."""
    inner = task._cancel_status
    top = _outermost_since(inner, base)
    if top is None:
        return None
    scope = trio.CancelScope(deadline=deadline)
    scope.__enter__()  # its status is made beneath `inner`, and is the task's for now
    _put_beneath(task, base, inner, top)
    return scope


def _outermost_since(inner: Any, base: Any) -> Any:
    """The outermost of the cancel statuses from `inner` up that were opened since the
    task's status was `base` (the one whose parent `base` is), None if they do not lead
    back to `base`."""
    top = inner
    while top is not None and top.parent is not base:
        top = top.parent
    return top


def _put_beneath(task: Any, base: Any, inner: Any, top: Any) -> None:
    """Move the status `task` has just entered (beneath `inner`) to between `base` and
    `top` (`_outermost_since`), and make `inner` the task's own again."""
    ours = task._cancel_status
    ours.parent = base
    top.parent = ours
    task._activate_cancel_status(inner)


def _trio_under_deadline(
    coro: Coroutine[Any, Any, Any], deadline: float
) -> tuple[Any, Awaitable[tuple[Any, bool]] | None]:
    """`under_deadline` on trio, where a cancel scope costs more than a quick call: the
    call's first step runs here, before any scope exists, and a call that returns in it (it
    never waited, so no scope could have cut it short) pays for no scope, and no coroutine
    of ours. One that suspended gets its scope then, as if it had been there from the start
    (beneath the scopes its first step opened, if it opened any). The one difference a call
    can see: before it first waits, `current_effective_deadline()` does not include its
    timeout."""
    task = _TRIO_RUN.task  # `current_task()` without its frame (see `_trio_holds_cancel_status`)
    base = task._cancel_status
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration as done:
        return done.value, None
    if task._cancel_status is base:
        return None, _rest_in(coro, yielded, trio.CancelScope(deadline=deadline), context)
    return None, _rest_beneath(coro, yielded, _scope_beneath(task, base, deadline), context)


async def _rest_in(
    coro: Coroutine[Any, Any, Any], yielded: Any, scope: Any, context: contextvars.Context
) -> tuple[Any, bool]:
    """The rest of a call whose first step left no scope open, in `scope` (a cancel scope of
    its deadline, entered now)."""
    with scope:
        return await _resume(coro, yielded, context), False
    return None, scope.cancelled_caught


async def _rest_beneath(
    coro: Coroutine[Any, Any, Any], yielded: Any, beneath: Any, context: contextvars.Context
) -> tuple[Any, bool]:
    """The rest of a call whose first step left scopes open, in the scope entered beneath
    them (`_scope_beneath`, `_anyio_beneath`)."""
    if beneath is None:  # pragma: no cover - a first step that left its own scopes misnested
        return await _resume(coro, yielded, context), False
    try:
        value = await _resume(coro, yielded, context)
    except BaseException as exc:
        if beneath.__exit__(type(exc), exc, exc.__traceback__):
            return None, True
        raise
    beneath.__exit__(None, None, None)
    return value, False


def _trio_mark() -> tuple[Any, Any, int]:
    """Where the running trio task stands: its cancel status and how many nurseries it has
    open (`_TrioGroupSince`)."""
    task = _TRIO_RUN.task
    return task, task._cancel_status, len(task._child_nurseries)


class _TrioGroupSince:
    """`trio.open_nursery()`, opened as if at `mark` (`_trio_mark`): its cancel status goes
    between the task's status then and the outermost scope opened since and left open, and
    it goes before the nurseries opened since among the task's own, so that those close
    first and it after, as if it had been there all along. Cancelling a scope the first
    step opened then reaches only that call, not the nursery's children (the calls beside
    it); cancelling the nursery reaches them all. The moves are those of `_scope_beneath`
    (`_put_beneath`)."""

    __slots__ = ("_manager", "_mark")

    def __init__(self, mark: tuple[Any, Any, int]) -> None:
        self._mark = mark
        self._manager = trio.open_nursery()

    @trio.lowlevel.enable_ki_protection  # no Ctrl-C between the nursery's entry and its move
    async def __aenter__(self) -> trio.Nursery:
        task, base, count = self._mark
        inner = task._cancel_status
        nursery = await self._manager.__aenter__()  # which never waits
        if inner is not base:
            top = _outermost_since(inner, base)
            if top is not None:  # else the step's scopes are misnested already: left as they are
                _put_beneath(task, base, inner, top)
        nurseries = task._child_nurseries
        if len(nurseries) > count + 1:
            nurseries.insert(count, nurseries.pop())
        return nursery

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._manager.__aexit__(*exc_info)


def _anyio_asyncio() -> Any:
    """anyio's asyncio backend, where it keeps what `_asyncio_under_deadline`,
    `_anyio_beneath` and `_AsyncioGroupSince` use (each task's anyio state in `_task_states`,
    its `cancel_scope`; a scope's `_parent_scope`, `_child_scopes`, `_tasks`; a task
    group's `cancel_scope`), else None: then first steps are not run at once there."""
    try:
        from anyio._backends import _asyncio as backend
    except ImportError:  # pragma: no cover - not this anyio
        return None
    scope = getattr(backend, "CancelScope", None)
    state = getattr(backend, "TaskState", None)
    group = getattr(backend, "TaskGroup", None)
    if (
        scope is None
        or state is None
        or group is None
        or not isinstance(getattr(backend, "_task_states", None), weakref.WeakKeyDictionary)
        or not isinstance(getattr(backend._task_states, "data", None), dict)
        or not {"_parent_scope", "_child_scopes", "_tasks"} <= set(getattr(scope, "__slots__", ()))
        or "cancel_scope" not in getattr(state, "__slots__", ())
    ):
        return None  # pragma: no cover - not this anyio
    return backend


_ANYIO_ASYNCIO = _anyio_asyncio()


def _anyio_beneath(task: Any, base: Any, scope: Any) -> bool:
    """Move anyio's `scope`, just entered on asyncio `task` (innermost), beneath the scopes
    the task entered since its cancel scope was `base` (a call's first step) and left open:
    between `base` and the outermost of them, the task still in the innermost, so that
    theirs close first and it after, and its cancellation reaches theirs as from an outer
    scope. False, with nothing moved, if they do not lead back to `base`."""
    inner = scope._parent_scope
    top = inner
    while top is not None and top._parent_scope is not base:
        top = top._parent_scope
    if top is None:
        return False
    inner._child_scopes.discard(scope)
    scope._parent_scope = base
    if base is not None:
        base._child_scopes.discard(top)
        base._child_scopes.add(scope)
    top._parent_scope = scope
    scope._child_scopes.add(top)
    scope._tasks.discard(task)
    inner._tasks.add(task)
    _ANYIO_ASYNCIO._task_states[task].cancel_scope = inner
    return True


# asyncio's running task, without `current_task`'s frame where it has one: read from the
# loop's entry among the tasks asyncio runs now on a Python whose `current_task` is Python
# code (3.11); a later one's is asyncio's own C function, asked as it is
_RUNNING_TASKS: dict[Any, Any] | None = None
if not isinstance(asyncio.current_task, types.BuiltinFunctionType):
    _RUNNING_TASKS = getattr(asyncio.tasks, "_current_tasks", None)
    if not isinstance(_RUNNING_TASKS, dict):  # pragma: no cover - another Python's asyncio
        _RUNNING_TASKS = None


def _asyncio_task() -> Any:
    """The running asyncio task (`_RUNNING_TASKS`)."""
    if _RUNNING_TASKS is None:  # pragma: no cover - a Python whose current_task is C already
        return asyncio.current_task()
    return _RUNNING_TASKS.get(asyncio.get_running_loop())


def _asyncio_scope(task: Any) -> Any:
    """The anyio cancel scope asyncio `task` is in (None: none, or not known to anyio); read
    from the weak dictionary's own dict, for less than its `get`."""
    state = _ANYIO_ASYNCIO._task_states.data.get(weakref.ref(task))
    return None if state is None else state.cancel_scope


def _asyncio_under_deadline(
    coro: Coroutine[Any, Any, Any], deadline: float
) -> tuple[Any, Awaitable[tuple[Any, bool]] | None]:
    """`under_deadline` on asyncio, as `_trio_under_deadline` on trio: the first step runs
    here, before any scope exists; a call that suspended gets its anyio scope then, beneath
    any its first step entered and left open. (The task's scope is read in line: this is
    every call's.)"""
    task = _RUNNING_TASKS.get(asyncio.get_running_loop()) if _RUNNING_TASKS is not None else _asyncio_task()
    state = _ANYIO_ASYNCIO._task_states.data.get(weakref.ref(task))
    base = None if state is None else state.cancel_scope
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration as done:
        return done.value, None
    scope = anyio.CancelScope(deadline=deadline)
    if _asyncio_scope(task) is base:
        return None, _rest_in(coro, yielded, scope, context)
    scope.__enter__()
    if not _anyio_beneath(task, base, scope):  # pragma: no cover - a first step's own misnesting
        scope.__exit__(None, None, None)
        return None, _rest_beneath(coro, yielded, None, context)
    return None, _rest_beneath(coro, yielded, scope, context)


def _asyncio_mark() -> tuple[Any, Any, int]:
    """Where the running asyncio task stands: the anyio scope it is in (`_AsyncioGroupSince`)
    and the cancellations it has pending (`_asyncio_lost_cancel`)."""
    task = _asyncio_task()
    return task, _asyncio_scope(task), task.cancelling()


def _asyncio_lost_cancel(mark: tuple[Any, Any, int]) -> BaseException | None:
    """`lost_cancel` on asyncio: the task has more cancellations pending than at `mark`, a
    call having swallowed the one delivered (an anyio scope's own are taken back as it is
    left, so these are the caller's)."""
    task, _, pending = mark
    return asyncio.CancelledError() if task.cancelling() > pending else None


class _AsyncioGroupSince:
    """anyio's task group on asyncio, opened as if at `mark` (`_asyncio_mark`): its scope
    goes beneath the scopes the task entered since and left open (`_anyio_beneath`), as
    `_TrioGroupSince` on trio."""

    __slots__ = ("_group", "_mark")

    def __init__(self, mark: tuple[Any, Any, int]) -> None:
        self._mark = mark
        self._group = anyio.create_task_group()

    async def __aenter__(self) -> anyio.abc.TaskGroup:
        task, base, _ = self._mark
        group = await self._group.__aenter__()  # which never waits
        scope: Any = group.cancel_scope  # anyio's asyncio scope, whose parent it keeps
        if scope._parent_scope is not base:  # the step left scopes open: it goes beneath them
            _anyio_beneath(task, base, scope)
        return group

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._group.__aexit__(*exc_info)


def _trio_holds_cancel_status() -> bool:
    """Whether this trio keeps what `_trio_under_deadline`, `_scope_beneath` and
    `_TrioGroupSince` use: the current task in its run context, a task's `_cancel_status`,
    a status's settable `parent`, `Task._activate_cancel_status`, a task's list of
    `_child_nurseries`."""
    try:
        task = trio.lowlevel.current_task()
        parent = getattr(type(task._cancel_status), "parent", None)
        here = getattr(_TRIO_RUN, "task", None)
    except (AttributeError, RuntimeError):
        return False
    return (
        here is task
        and isinstance(parent, property)
        and parent.fset is not None
        and callable(getattr(task, "_activate_cancel_status", None))
        and type(getattr(task, "_child_nurseries", None)) is list
    )


def _waiting(limiter: Any) -> int:
    """Tasks waiting for `limiter`: trio's keeps them in a parking lot, anyio's asyncio one
    in a queue (read directly: `statistics()` builds a value per call); other kinds say
    through `statistics()`."""
    queue = getattr(limiter, "_lot", None)
    if queue is None:
        queue = getattr(limiter, "_wait_queue", None)
    if queue is None:
        return int(limiter.statistics().tasks_waiting)
    return len(getattr(queue, "_parked", queue))  # trio's ParkingLot counts its OrderedDict in a frame


def _trio_layout(limiter: Any) -> bool:
    """Whether `limiter` is a trio CapacityLimiter keeping what `slot_ops` reads: its
    borrowers in a set, its waiters parked in an OrderedDict, its total."""
    lot = getattr(limiter, "_lot", None)
    return (
        type(limiter) is trio.CapacityLimiter
        and type(getattr(limiter, "_borrowers", None)) is set
        and type(getattr(lot, "_parked", None)) is collections.OrderedDict
        and isinstance(getattr(limiter, "_total_tokens", None), (int, float))
    )


def slot_ops(
    limiter: Any, would_block: type[Exception]
) -> tuple[Callable[[object], bool], Callable[[object], None]]:
    """`(take, give_back)` for slots of `limiter`: `take(borrower)` is
    `acquire_on_behalf_of_nowait` saying False where it would raise `would_block`, and
    `give_back(borrower)` is `release_on_behalf_of`. On a trio CapacityLimiter both read its
    state directly in one frame while nobody waits for a slot, and are trio's own otherwise:
    trio's take is a frame and its give-back five (waking the waiters, of whom there are
    none, is four), for what is a set operation. Errors are trio's (its own methods raise
    them), and so are the limit and the order of waiters: a slot is taken here only where
    trio's `acquire_on_behalf_of_nowait` would take it, and given back here only where
    trio's release would wake nobody."""

    def take_as_usual(borrower: object) -> bool:
        try:
            limiter.acquire_on_behalf_of_nowait(borrower)
        except would_block:
            return False
        return True

    if not _trio_layout(limiter):
        return take_as_usual, limiter.release_on_behalf_of
    borrowers: set[object] = limiter._borrowers
    parked: collections.OrderedDict[Any, None] = limiter._lot._parked
    release = limiter.release_on_behalf_of

    @trio.lowlevel.enable_ki_protection  # as trio's own: no Ctrl-C between the check and the change
    def take(borrower: object) -> bool:
        if not parked and len(borrowers) < limiter._total_tokens and borrower not in borrowers:
            borrowers.add(borrower)
            return True
        return take_as_usual(borrower)  # none free, or someone waits: trio says (or raises)

    @trio.lowlevel.enable_ki_protection
    def give_back(borrower: object) -> None:
        if parked or borrower not in borrowers:
            release(borrower)  # trio wakes who waits (or raises)
        else:
            borrowers.remove(borrower)

    return take, give_back


def waiting_on(limiter: Any, waiting: Callable[[Any], int]) -> Callable[[], int]:
    """`waiting(limiter)` as a call of nothing: on a trio CapacityLimiter (or anyio's on
    asyncio), counted by the length of its parking lot's waiters (its wait queue) as
    `_waiting` counts them, without a frame."""
    if waiting is _waiting and _trio_layout(limiter):
        parked: collections.OrderedDict[Any, None] = limiter._lot._parked
        return parked.__len__
    if waiting is _waiting and type(getattr(limiter, "_wait_queue", None)) is collections.OrderedDict:
        queued: collections.OrderedDict[Any, Any] = limiter._wait_queue  # anyio's on asyncio, made once
        return queued.__len__
    return functools.partial(waiting, limiter)


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
    _waiting,
    _under_scope,
)


def _trio_clock() -> Callable[[], float]:
    """`trio.current_time`, or what it computes when the run keeps trio's own system clock
    (the offset fixed for the run plus `perf_counter`) without its three calls; a run on
    another clock (a test's MockClock) is asked as usual."""
    clock = trio.lowlevel.current_clock()
    offset = getattr(clock, "offset", None)
    if type(clock).__name__ != "SystemClock" or not isinstance(offset, float):
        return trio.current_time
    now = time.perf_counter
    return lambda: offset + now()


def _asyncio_clock() -> Callable[[], float]:
    """The running loop's `time`, or `time.monotonic` itself where that is all it does (the
    base event loop's), without its frame; a loop with a clock of its own is asked as usual."""
    loop = asyncio.get_running_loop()
    if getattr(type(loop), "time", None) is asyncio.BaseEventLoop.time:
        return time.monotonic
    return loop.time


def primitives() -> Primitives:
    """The running loop's primitives (see `Primitives`)."""
    if sniffio.current_async_library() == "trio":
        if _trio_holds_cancel_status():
            return attrs.evolve(
                _TRIO,
                clock=_trio_clock(),
                under_deadline=_trio_under_deadline,
                eager=True,
                mark=_trio_mark,
                task_group_since=_TrioGroupSince,
            )
        return attrs.evolve(_TRIO, clock=_trio_clock(), under_deadline=_under_scope)
    made = Primitives(
        "asyncio",
        _asyncio_clock(),
        anyio.CancelScope,
        anyio.move_on_after,
        anyio.Event,
        anyio.lowlevel.checkpoint,
        anyio.create_task_group,
        anyio.Lock,
        anyio.CapacityLimiter,
        anyio.WouldBlock,
        _waiting,
        _under_scope,
    )
    if _ANYIO_ASYNCIO is not None:
        return attrs.evolve(
            made,
            under_deadline=_asyncio_under_deadline,
            eager=True,
            mark=_asyncio_mark,
            task_group_since=_AsyncioGroupSince,
            lost_cancel=_asyncio_lost_cancel,
        )
    return made


async def wait_readable(fd: int) -> None:
    """Until `fd` has something to read (trio's own wait; asyncio's reader callback)."""
    if sniffio.current_async_library() == "trio":
        await trio.lowlevel.wait_readable(fd)
        return
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def cancellation_pending() -> bool:
    """Whether a cancellation caught now is the running task's own: on asyncio while the
    task has one pending (`Task.cancelling`), which a CancelledError that a tool raises
    itself, having awaited a future or a task that something else cancelled, does not
    make; on trio while a cancel scope around this point is cancelled (its effective
    deadline is then minus infinity), which a Cancelled a tool kept from an earlier scope
    and raised again does not make: no scope would catch that one."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop here: trio
        try:
            return trio.current_effective_deadline() == -math.inf
        except RuntimeError:  # no loop at all
            return True
    return task is None or task.cancelling() > 0


def ordinary_failure(exc: BaseException) -> bool:
    """An ordinary failure of a tool, a hook or a store, to be reported and lived with: an
    Exception, or a cancellation that is not the task's own (`cancellation_pending`)."""
    return isinstance(exc, Exception) or (
        isinstance(exc, anyio.get_cancelled_exc_class()) and not cancellation_pending()
    )


def poster() -> Callable[[Callable[[], object]], object]:
    """How another thread hands this loop a callback to run on its own thread: trio's token
    `run_sync_soon`, asyncio's `call_soon_threadsafe`. It raises once the loop is gone."""
    if sniffio.current_async_library() == "trio":
        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe


class BlockWatch:
    """Catches a task that holds the loop, on either backend, at no cost per call or task
    step: while a batch runs, a daemon thread posts a probe to the loop every `period` and
    times how long the loop takes to run it. While a probe is overdue past half the
    threshold, the thread looks at the loop thread's stack (`sys._current_frames`) every
    period and asks `culprit(frame)` what is running and since when (time.monotonic). The
    same call seen on consecutive looks has held the loop from when it (or the wait)
    began to the last look, give or take a period; many quick calls that never yield hold
    it together, but none of them alone, and are not reported. `culprit` answers (what,
    since, whom): `whom` is told, so that one watch serves every dispatcher of the loop
    (`shared_block_watch`). When the probe finally runs, on the loop's thread, a call
    that held the loop past `threshold` is reported as `report(what, seconds, whom)`.

    (A trio instrument timing each task step is exact, but costs about a microsecond a
    step and ten to install; asyncio has no step hook at all. The probe is the same on
    both.) `enter()`/`exit()` bracket each batch. Between batches the thread looks again
    a period later, waking nobody; through a longer pause it parks, and the next batch
    wakes it; it ends after a second without batches (the next starts another). A batch
    that ended, none other running, since the last look shows the loop was not held until
    then, as a probe run would (a nested batch's end does not: the call around it may hold
    the loop).

    The thread takes its turn at the GIL from the loop's thread (`GilTurn`), which gives
    way to it at a batch's end once the thread is due to wake (or the probe's answer woke
    it) and it has not run since."""

    def __init__(
        self,
        threshold: float,
        culprit: Callable[[FrameType], tuple[Any, float, Any] | None],
        report: Callable[[Any, float, Any], None],
    ) -> None:
        self._threshold = threshold
        self._period = min(0.02, threshold / 4)
        self._culprit = culprit
        self._report = report
        self._batches = 0
        # the loop's poster held weakly: a watch kept for its loop (`shared_block_watch`)
        # must not be what keeps that loop alive once it has closed
        self._post: Callable[[], Callable[[Callable[[], object]], object] | None] = weakref.WeakMethod(
            poster()
        )
        self._loop_thread = threading.get_ident()
        self._starting = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._answered = threading.Event()
        self._suspect: tuple[Any, float, Any] | None = None  # (what, seconds, whom): held past the threshold
        self._ended = 0  # batches ended with none other running (a nested batch's end tells nothing)
        self._awake = threading.Event()  # cleared while the thread is parked, set by the next batch
        self._awake.set()
        # (when the thread wakes, set once it runs again): published before each of its waits
        self._turn = GilTurn()

    def enter(self) -> None:
        self._batches += 1
        if self._sampler is None:
            with self._starting:
                if self._sampler is None:
                    sampler = threading.Thread(target=self._watch, name="threepass-block-watch", daemon=True)
                    self._sampler = sampler
                    sampler.start()
        elif not self._awake.is_set():
            self._awake.set()  # parked through a pause: it takes its turn when the loop next waits

    def exit(self) -> None:
        self._batches -= 1
        if not self._batches:
            self._ended += 1
        self._turn.take_if_due()

    def _woken(self) -> None:
        """On the loop's thread, which just woke the watch's: it wants the GIL now."""
        self._turn.woken()

    def _waiting(self, until: float) -> None:
        """On the watch's thread, before each wait: when it is to wake (or inf, when the loop wakes it)."""
        self._turn.waiting(until)

    def _running(self) -> None:
        """On the watch's thread, after each wait: it holds the GIL again."""
        self._turn.running()

    def _answer(self) -> None:
        """The probe, run by the loop: it was held if the thread saw who held it."""
        suspect, self._suspect = self._suspect, None
        self._answered.set()
        self._woken()
        if suspect is not None:
            try:
                self._report(*suspect)
            except Exception:  # a callback of the loop's own must never raise into it
                _log.warning("reporting a call that held the loop failed", exc_info=True)

    def _retire(self) -> bool:
        """On the watch's thread, idle a second: end, unless a batch began meanwhile (the
        loop's thread, which counts a batch before it asks whether the thread is there,
        then starts another only once this one has let go)."""
        with self._starting:
            self._sampler = None
            if not self._batches:
                return True
            self._sampler = threading.current_thread()
            return False

    def _watch(self) -> None:
        stale = max(2 * self._period, self._threshold / 2)
        busy, ended = time.monotonic(), self._ended  # when a batch was last seen, and the count then
        while True:
            if not self._batches:
                now = time.monotonic()
                if self._ended != ended:  # batches come and go between its looks: no pause
                    busy, ended = now, self._ended
                if now - busy > 1.0 and self._retire():
                    return
                if now - busy < self._period:  # look again, waking nobody
                    self._waiting(now + self._period)
                    time.sleep(self._period)
                else:  # a pause: parked until a batch begins, or until it ends
                    self._awake.clear()
                    if not self._batches:
                        self._waiting(math.inf)
                        self._awake.wait(max(0.0, busy + 1.0 - now) + self._period)
                self._running()
                continue
            self._answered.clear()
            posted = time.monotonic()
            seen: tuple[Any, float, Any] | None = None
            ended = self._ended
            try:
                post = self._post()
                if post is None:
                    raise RuntimeError("the loop is gone")
                post(self._answer)
                del post  # held no longer than that: the loop may close while this thread idles
            except Exception:  # the loop is gone (trio's RunFinishedError, asyncio's RuntimeError)
                with self._starting:
                    self._sampler = None
                return
            while True:
                self._waiting(time.monotonic() + self._period)
                answered = self._answered.wait(self._period)
                self._running()
                if answered:
                    break
                if not self._batches and (self._suspect is None or time.monotonic() - posted > 1.0):
                    # no batch left, and nothing to report when the probe runs (or a loop that
                    # ended with it unrun): the thread need not wake beside what the loop does next
                    break
                now = time.monotonic()
                if self._ended != ended:  # the loop was not held when that batch ended
                    ended, posted, seen = self._ended, now, None
                elif now - posted > stale:
                    frame = sys._current_frames().get(self._loop_thread)
                    try:
                        found = None if frame is None else self._culprit(frame)
                    except Exception:  # a frame that changed under us: look again next period
                        found = None
                    del frame
                    if found is not None and seen is not None and found[0] is seen[0]:
                        held = now - max(found[1], posted) + self._period
                        if held > self._threshold:
                            self._suspect = (found[0], held, found[2])
                    seen = found
            busy, ended = time.monotonic(), self._ended
            self._waiting(busy + self._period)
            time.sleep(self._period)
            self._running()


_GIVE_WAY = 0.0005  # seconds the loop's thread waits at most for a helper thread to run
_RETRY_FIRST = 0.002  # seconds after a helper missed its turn until it is given way to again ...
_RETRY_MOST = 0.1  # ... twice as long after each turn it misses, up to this


class GilTurn:
    """A helper thread's turn at the GIL beside a loop's thread that keeps it busy. Left to
    win the GIL alone, a thread that wakes while the loop's thread runs and releases the
    GIL for brief system calls (a recording's write, SQLite, a file's stat) loses nearly
    every race for it (CPython hands the GIL over once its holder kept it a whole switch
    interval, and each brief release starts that interval again), and waits for it a
    tenth of a second at a time: all that while, each such release wakes it in vain,
    which makes every one of those calls cost a wake-up of another core (14 µs instead of
    1 on a virtual machine). So the thread says, before each wait, when it is due to wake
    (`waiting`) and, after it, that it runs again (`running`); the loop's thread, where it
    can spare the moment (a batch's end), waits for it, the GIL released, once it is due
    and has not run since (`take_if_due`), at most `_GIVE_WAY` seconds. One that missed
    its turn (the system ran it too late: a busy machine) is given way to again
    `_RETRY_FIRST` seconds later, and after each turn missed twice as long as before, up
    to `_RETRY_MOST`: it is not left to the race, yet a helper that cannot run soon costs
    the loop a few waits, not one a batch."""

    __slots__ = ("_wake",)

    def __init__(self) -> None:
        # (when it is due, set once it runs again, how long after a missed turn it is due again)
        self._wake: tuple[float, threading.Event, float] = (math.inf, threading.Event(), _RETRY_FIRST)

    def waiting(self, until: float) -> None:
        """On the helper's thread, before a wait: when it is to wake (inf: when it is woken)."""
        self._wake = (until, threading.Event(), _RETRY_FIRST)

    def running(self) -> None:
        """On the helper's thread, after a wait: it holds the GIL again."""
        self._wake[1].set()

    def woken(self) -> None:
        """On the loop's thread, which just woke the helper's: it wants the GIL now, and is
        given way to next unless it runs meanwhile."""
        wake = self._wake
        if not wake[1].is_set():
            self._wake = (0.0, wake[1], wake[2])

    def take_if_due(self) -> None:
        """On the loop's thread: give way to the helper's, if it is due and has not run."""
        wake = self._wake
        if time.monotonic() >= wake[0] and not wake[1].wait(_GIVE_WAY) and self._wake is wake:
            retry = wake[2]
            self._wake = (time.monotonic() + retry, wake[1], min(2 * retry, _RETRY_MOST))


_BLOCK_WATCHES: trio.lowlevel.RunVar[dict[float, BlockWatch]] = trio.lowlevel.RunVar("threepass_watches")
_ASYNCIO_BLOCK_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, BlockWatch]] = (
    weakref.WeakKeyDictionary()
)


def shared_block_watch(
    threshold: float,
    culprit: Callable[[FrameType], tuple[Any, float, Any] | None],
    report: Callable[[Any, float, Any], None],
) -> BlockWatch:
    """The running loop's `BlockWatch` for `threshold`, made on first use: one thread per
    loop (and threshold) for every dispatcher on it, rather than one each, which a
    service that makes a dispatcher per request would pay for a thread start and a
    thread's probes apiece. Every dispatcher passes the same `culprit` and `report`."""
    try:
        watches = _BLOCK_WATCHES.get()
    except LookupError:
        watches = {}
        _BLOCK_WATCHES.set(watches)
    except RuntimeError:  # not trio: asyncio's running loop
        watches = _ASYNCIO_BLOCK_WATCHES.setdefault(asyncio.get_running_loop(), {})
    watch = watches.get(threshold)
    if watch is None:
        watch = watches[threshold] = BlockWatch(threshold, culprit, report)
    return watch


class _PipeStream:
    """A pipe of a child process as an async stream of bytes (trio's own FdStream)."""

    def __init__(self, pipe: Any) -> None:
        self._stream = trio.lowlevel.FdStream(os.dup(pipe.fileno()))
        pipe.close()

    def __aiter__(self) -> _PipeStream:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._stream.receive_some(65536)
        if not chunk:
            raise StopAsyncIteration
        return bytes(chunk)

    async def aclose(self) -> None:
        await self._stream.aclose()


class _LoopThreadProcess:
    """A child started on the event loop's own thread, with what the tools use of anyio's
    Process: pid, returncode, stdout, stderr, wait(), kill(), aclose()."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin = None
        self.stdout = None if popen.stdout is None else _PipeStream(popen.stdout)
        self.stderr = None if popen.stderr is None else _PipeStream(popen.stderr)

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        if self._popen.poll() is None:
            try:
                pidfd = os.pidfd_open(self.pid)
            except (AttributeError, OSError):  # no pidfd here: look again now and then
                while self._popen.poll() is None:  # noqa: ASYNC110 - another process, no event to wait on
                    await trio.sleep(0.02)
            else:
                try:
                    await trio.lowlevel.wait_readable(pidfd)
                finally:
                    os.close(pidfd)
        return self._popen.wait()

    def kill(self) -> None:
        self._popen.kill()

    async def aclose(self) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                await stream.aclose()
        await self.wait()


async def open_process(argv: Sequence[str], **options: Any) -> Any:
    """`anyio.open_process`, except that under trio the child is started on the event loop's
    own thread. trio starts children from a worker thread, and a child that asks to die
    with its parent (bubblewrap's --die-with-parent, PR_SET_PDEATHSIG) dies when that
    thread exits, ten idle seconds later; the loop's thread lives as long as the loop."""
    if sniffio.current_async_library() != "trio":
        return await anyio.open_process(list(argv), **options)
    # a fork, on purpose here (the point of this function): quick, and then the loop goes on
    popen = subprocess.Popen(list(argv), **options)  # noqa: ASYNC220
    await trio.lowlevel.checkpoint()
    return _LoopThreadProcess(popen)
