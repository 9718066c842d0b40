"""`Dispatcher`: what many sessions share — the registry, the result cache, the limiter —
and `invoke`, the programmatic path through the same three passes."""

from __future__ import annotations

import collections
import itertools
import math
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from threading import get_ident
from typing import Any

import anyio
import attrs

from . import _backend
from ._core_tools import core_registry
from ._execute import BeforeWrite, Executor, HookSet, watch_loop
from ._execute import ToolRunner as PassRunner
from ._history import DEFAULT_HISTORY_LIMIT
from ._plan import DEFAULT_MAX_ARGUMENT_BYTES
from ._registry import Registry
from ._results import DEFAULT_MAX_OUTPUT_BYTES
from ._seams import ErrorStore, ResultCache, SessionStore, ToolRunner
from ._session import Session
from ._types import Allow, Answer, BatchEvent, ContextHost, Deny, ToolCall, ToolResult
from ._watch import DEFAULT_BLOCK_THRESHOLD, DispatcherStatistics, Watch

__all__ = ["DEFAULT_TIMEOUT", "Dispatcher", "default_limit"]

DEFAULT_TIMEOUT = 60.0
_WRITES_KEPT = 1024

Gate = Callable[..., Any]
Rewriter = Callable[..., Any]


@attrs.frozen
class _Binding:
    """The event loop a Dispatcher belongs to, and what it made there."""

    loop: _backend.LoopIdentity
    thread_limiter: anyio.CapacityLimiter
    primitives: _backend.Primitives
    read_loop: Callable[[], object]
    """Reads `loop[1]` again while on that loop (`_backend.loop_reader`)."""


def default_limit() -> int:
    """Half the cores, at least 3."""
    return max(3, (os.cpu_count() or 1) // 2)


class Dispatcher:
    """Executes tool calls for many sessions.

    `cache` is the result store (None: no result cache). `error_store` remembers every
    failure of a call that ran, across sessions (None: nothing is remembered).
    `session_store` keeps each session's state between batches where every worker sharing
    it finds it, under a lease per session (None: a session lives in this process only).
    `max_concurrent` bounds the calls running at once across every session (default: half
    the cores, at least 3). `gate` is asked about calls that need confirmation; without
    one, every call runs. `runner` answers calls instead of their handlers (a
    `ScriptedRunner`, for tests and dry runs).

    The dispatcher holds its sessions until they close (`Session.close()`, or `async with
    d.session(...)`). For a long-lived server, `max_idle_sessions` bounds how many idle
    sessions it keeps (the ones used longest ago are closed first) and `idle_timeout`
    closes those unused for that many seconds, whenever a new session is made.

    A Dispatcher belongs to the event loop that first dispatches through it (trio or
    asyncio): using it from another loop or thread raises RuntimeError. Make one per
    loop; they can share a result store.

    Nothing wedges it (see `statistics()`): `queue_limit` is how long a call may wait for
    a slot before it ends `timed_out` naming the holders (None: the call's own timeout);
    `block_threshold` is how long an async tool may hold the loop in one step before it
    is logged and counted. (Which tools run in a worker process is the registry's
    business, as registration checks that they can: `Registry(isolation=...)`.) The
    dispatcher owns those worker processes: `shutdown()` kills them.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        cache: ResultCache | None = None,
        max_concurrent: int | None = None,
        gate: Gate | None = None,
        rewriters: Sequence[Rewriter] = (),
        hooks: Sequence[Any] = (),
        on_result: Callable[..., Any] | None = None,
        runner: ToolRunner | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_idle_sessions: int | None = None,
        idle_timeout: float | None = None,
        queue_limit: float | None = None,
        block_threshold: float = DEFAULT_BLOCK_THRESHOLD,
        error_store: ErrorStore | None = None,
        session_store: SessionStore | None = None,
    ) -> None:
        if not isinstance(registry, Registry):
            raise TypeError(f"expected a Registry, got {registry!r}")
        limit = default_limit() if max_concurrent is None else max_concurrent
        if limit < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if queue_limit is not None and not queue_limit >= 0:
            raise ValueError(f"queue_limit must be seconds (or None), got {queue_limit!r}")
        if not block_threshold > 0:
            raise ValueError(f"block_threshold must be positive seconds, got {block_threshold!r}")
        self.registry = registry
        self.core_registry = core_registry()
        self.cache = cache
        self.error_store = error_store
        self.session_store = session_store
        self.gate = gate
        self.rewriters = tuple(rewriters)
        self.hook_set = HookSet.of(hooks)
        self.on_result = on_result
        self.runner = runner
        self.timeout = timeout
        self.max_argument_bytes = max_argument_bytes
        self.max_output_bytes = max_output_bytes
        self.limiter = anyio.CapacityLimiter(limit)
        self._binding: _Binding | None = None
        # the invalidation epochs of this dispatcher's sessions: a counter, and what the
        # last writes moved (a read started under an older epoch checks what moved since)
        self._generation = 0
        self._recent_writes: collections.deque[tuple[int, frozenset[str]]] = collections.deque(
            maxlen=_WRITES_KEPT
        )
        self._sessions: dict[str, Session] = {}
        self._unnamed = itertools.count(1)
        self.max_idle_sessions = max_idle_sessions
        self.idle_timeout = idle_timeout
        self._private: Session | None = None
        self.watch = Watch(queue_limit, block_threshold)
        self._template: tuple[tuple[Any, ...], Executor] | None = None  # see `_executor`
        weakref.finalize(self, Watch.shutdown, self.watch)
        self._batch_subscribers: list[Callable[[BatchEvent], Any]] = []

    def subscribe_batches(self, fn: Callable[[BatchEvent], Any]) -> Callable[[], None]:
        """Call `fn(event)` (sync or async, and quick: it is awaited shielded from
        cancellation) with a `BatchEvent` after every batch of every session, including
        those cut short; returns an unsubscribe. For observers of the whole dispatcher
        (tracing, metrics), which attach after it is made: `dispatcher.otel` is one."""
        self._batch_subscribers.append(fn)
        return lambda: self._batch_subscribers.remove(fn)

    def _bind(self) -> _Binding:
        """The loop this dispatcher belongs to: the first one to use it."""
        bound = self._binding
        if bound is not None:
            # every batch: the same loop on the same thread, read for less than `loop_identity`
            try:
                if bound.read_loop() is bound.loop[1] and get_ident() == bound.loop[2]:
                    return bound
            except (AttributeError, RuntimeError):  # not on it: `loop_identity` says where
                pass
        here = _backend.loop_identity()
        if bound is None:
            primitives = _backend.primitives()
            bound = self._binding = _Binding(
                here, anyio.CapacityLimiter(math.inf), primitives, _backend.loop_reader(here)
            )
            if self.limiter.borrowed_tokens == 0:
                # the loop's own limiter from now on: anyio's wrapper of trio's costs a call
                self.limiter = primitives.capacity_limiter(self.limiter.total_tokens)
            watch_loop(self.watch)
        elif bound.loop != here:
            first, now = bound.loop, here
            raise RuntimeError(
                f"this Dispatcher belongs to the {first[0]} loop it was first used on (thread "
                f"{first[2]}); it was used from a {now[0]} loop on thread {now[2]}. Make one "
                "Dispatcher per event loop (they can share a result store)."
            )
        return bound

    def _executor(
        self,
        bound: _Binding,
        runner: PassRunner | None,
        before_write: BeforeWrite | None,
        deadline: float | None,
        context: tuple[int, int, float | None, ContextHost | None],
    ) -> Executor:
        """Pass 2's executor for one batch: made afresh from the last one's settings while
        they hold (every batch without start marks, and the same limiter, timeout, hooks,
        output limit and watch), since working them out costs more than copying them; a
        batch with a runner (replay's, one a batch) is given it on the copy."""
        if before_write is not None:
            return self._new_executor(bound, runner, before_write, deadline, context)
        # compared by value: the binding, hook set and numbers are values, the limiter and
        # watch compare by identity
        key = (bound, self.limiter, self.timeout, self.hook_set, self.max_output_bytes, self.watch)
        kept = self._template
        if kept is None or kept[0] != key:
            kept = self._template = (key, self._new_executor(bound, None, None, None, (0, 0, None, None)))
        if runner is not None:
            return kept[1].fresh(deadline, context).run_by(runner)
        return kept[1].fresh(deadline, context)

    def _new_executor(
        self,
        bound: _Binding,
        runner: PassRunner | None,
        before_write: BeforeWrite | None,
        deadline: float | None,
        context: tuple[int, int, float | None, ContextHost | None],
    ) -> Executor:
        return Executor(
            limiter=self.limiter,
            thread_limiter=bound.thread_limiter,
            primitives=bound.primitives,
            default_timeout=self.timeout,
            deadline=deadline,
            hooks=self.hook_set,
            context=context,
            max_output_bytes=self.max_output_bytes,
            runner=runner,
            watch=self.watch,
            before_write=before_write,
        )

    def _moved(self, written: frozenset[str], *, by: Session) -> None:
        """A write of session `by` landed: every other session forgets what it read of it,
        and the epoch moves on for the reads running now."""
        self._generation += 1
        self._recent_writes.append((self._generation, written))
        for session in self._sessions.values():
            if session is not by:
                session._forget(written)
        if self._private is not None and self._private is not by:
            self._private._forget(written)

    def _written_since(self, generation: int) -> frozenset[str] | None:
        """Everything written after epoch `generation`; None if that is too long ago to say."""
        if generation == self._generation:
            return frozenset()
        recent = self._recent_writes
        if not recent or recent[0][0] > generation + 1:
            return None
        return frozenset().union(*(w for g, w in recent if g > generation))

    def statistics(self) -> DispatcherStatistics:
        """The limiter's slots, the sync calls stuck past their timeout holding one, how many
        calls held the event loop, the worker processes alive. It only reads (times are
        time.monotonic), so a health check on another thread may ask too."""
        return self.watch.statistics(self.limiter)

    def shutdown(self) -> None:
        """Kill the worker processes of `isolation="process"` tools, idle or running (a
        running call ends `failed`, its worker gone). Calls of such tools fail from now on;
        everything else goes on working. Also done when the dispatcher is collected.
        Separate from closing sessions: it is about processes, not conversations."""
        self.watch.shutdown()

    def session(
        self,
        session_id: str | None = None,
        *,
        mode: str = "deferred",
        core: Sequence[str] = (),
        record: str | os.PathLike[str] | None = None,
        record_fsync: bool = False,
        record_wait: bool = True,
        history_limit: int | None = DEFAULT_HISTORY_LIMIT,
    ) -> Session:
        """The session named `session_id` (made on first use). `record` appends every batch to
        that JSONL file: a batch returns once its line is in the file, written on the loop's
        thread once the file is open (`record_fsync`: synced to the disk, by a thread of the
        recording's own, which also opens the file and takes over from a disk that stalls;
        `record_wait=False`: once the line is handed to that thread, which writes it within
        milliseconds — a crash may then lose the last lines, never the file's order or its
        chain; with a session store a batch always waits, so that the saved state and the
        file agree). `core` names more tools
        whose schemas go in every request. `history_limit` is how many committed calls
        `Session.history` keeps (None: all)."""
        if session_id is None:
            session_id = f"s{next(self._unnamed)}"
            while session_id in self._sessions:
                session_id = f"s{next(self._unnamed)}"
        found = self._sessions.get(session_id)
        if found is not None:
            return found
        self._evict_idle()
        recorder = None
        if record is not None:
            from ._recording import Recorder

            recorder = Recorder(
                Path(record),
                registry=self.registry,
                session_id=session_id,
                mode=mode,
                fsync=record_fsync,
                wait=record_wait or self.session_store is not None,
            )
        session = Session(
            self, session_id, mode=mode, core=core, recorder=recorder, history_limit=history_limit
        )
        self._sessions[session_id] = session
        return session

    def _evict_idle(self) -> None:
        """Before a session is made: close those idle past `idle_timeout`, then, past
        `max_idle_sessions`, the idle ones used longest ago. A session running a batch
        is never closed under it."""
        limit, timeout = self.max_idle_sessions, self.idle_timeout
        if limit is None and timeout is None:
            return
        now = time.monotonic()
        idle = sorted((s for s in self._sessions.values() if not s.busy), key=lambda s: s.last_used)
        doomed = [s for s in idle if timeout is not None and now - s.last_used > timeout]
        keep = [s for s in idle if s not in doomed]
        if limit is not None and len(keep) >= limit:
            doomed += keep[: len(keep) - limit + 1]
        for session in doomed:
            session.close()

    def _forget_session(self, session: Session) -> None:
        """A closed session leaves the dispatcher (`Session.close` calls this)."""
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]

    async def invoke(
        self,
        name: str,
        args: Mapping[str, Any] | None = None,
        *,
        session: Session | None = None,
        call_id: str | None = None,
        decisions: Mapping[str, Allow | Deny | Answer] | None = None,
        static: Mapping[str, Any] | None = None,
        input: Any = None,
    ) -> ToolResult:
        """Call one tool from code. Every tool counts as loaded; validation, gate, dedupe,
        cache, history and recording are as for a model's call.

        For a deterministic step of a pipeline: `static` (the step's fixed configuration)
        is merged under `args`, and `input` (the previous step's output), unless None, is
        passed as `args["input"]`."""
        if session is None:
            if self._private is None:
                # code's scratch session, this dispatcher's own: never kept in the session store
                self._private = Session(self, "invoke", mode="direct", kept=False)
            session = self._private
        arguments = {**(static or {}), **(args or {})}
        if input is not None:
            arguments["input"] = input
        call = ToolCall(id=call_id or session.next_call_id(), name=name, arguments=arguments)
        results = await session._dispatch([call], decisions=decisions, all_loaded=True)
        return results[0]
