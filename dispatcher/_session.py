"""`Session`: one conversation's state, and `dispatch`, which drives the three passes.

The session owns what pass 1 reads and pass 3 changes (loaded schemas, the run's dedupe
map, spent approvals, histories) and does every await the pure passes cannot: the
rewriters, the result store's lookup, the gates; pass 2 is the executor's; then it
applies what pass 3 returns (the store's writes and the recording off the event loop),
and delivers the events. With a session store, each batch runs under the session's lease
and its state is loaded before and saved after (`_snapshot.py` says what is kept).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
import operator
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from ._backend import ordinary_failure
from ._commit import CommitEffects, commit, forget_overlapping, land
from ._errors import NOTED, SECRET_STORE_KEY, FailureNotes, needs_note, signatures_of
from ._exceptions import DispatchInterrupted, HookBlocked, SessionBusy
from ._execute import BeforeWrite, Executor, ToolRunner, _maybe_await
from ._history import DEFAULT_HISTORY_LIMIT, History
from ._messages import tool_calls_of
from ._plan import STOPPED_KEY, Draft, FinishedCall, Plan, PlannedCall, Planner, PlannerState, new_planner
from ._providers import core_names, request_tools, tool_index, tool_messages
from ._registry import Tool
from ._results import describe, failure_result, shown
from ._rewrite import rewrite
from ._seams import CacheEntry, ErrorRecord, ErrorStore, Lease, SessionStore, StoredSession
from ._seams import ToolRunner as PublicRunner
from ._snapshot import (
    ChainPosition,
    RowCache,
    SessionSnapshot,
    decode_newer,
    encode_snapshot,
    fill_history,
    history_state,
    json_values,
)
from ._stores import epoch_before, look_up, moved_elsewhere, remember_failures, update_store
from ._turns import Turns
from ._types import (
    Allow,
    Answer,
    BatchEvent,
    Decision,
    Deny,
    HistoryEntry,
    Interrupt,
    Provider,
    Status,
    ToolCall,
    ToolContext,
    ToolResult,
    ToolResultEvent,
)

if TYPE_CHECKING:
    from ._dispatcher import Dispatcher, _Binding
    from ._recording import Recorder

__all__ = ["Session", "SessionStatistics"]

log = logging.getLogger("threepass.session")

_STATUS = operator.attrgetter("status")
_IS_RESULT = functools.partial(operator.is_not, None)  # a result, not the None of a call that has none

Subscriber = Callable[[ToolResultEvent], Any]

_INSIDE: contextvars.ContextVar[tuple[Session, ...]] = contextvars.ContextVar(
    "threepass_inside_sessions", default=()
)
"""The sessions whose batch the current task is part of (a handler runs inside its batch),
outermost first: a tuple, as few as nested dispatches go deep, made with one allocation."""


def _public_runner(runner: PublicRunner) -> ToolRunner:
    """A `dispatcher.ToolRunner` (call, ctx) as pass 2's runner (planned call, ctx)."""

    def run(planned: PlannedCall, ctx: ToolContext) -> Awaitable[Any]:
        return runner(planned.call, ctx)

    return run


@attrs.frozen
class SessionStatistics:
    runs: int
    rounds: int
    calls: int
    executed: int
    deduped: int
    cached: int
    by_status: Mapping[str, int]
    loaded: tuple[str, ...]


class Session:
    """One conversation. Create with `Dispatcher.session(...)`."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        session_id: str,
        *,
        mode: str = "deferred",
        core: Iterable[str] = (),
        recorder: Recorder | None = None,
        history_limit: int | None = DEFAULT_HISTORY_LIMIT,
        kept: bool = True,
    ) -> None:
        if mode not in ("deferred", "direct"):
            raise ValueError(f"mode must be 'deferred' or 'direct', got {mode!r}")
        self.dispatcher = dispatcher
        self.id = session_id
        self.mode = mode
        self.state: dict[str, Any] = {}
        self.history = History(history_limit)
        self._planner_state = PlannerState()
        self._subscribers: list[Subscriber] = []
        self._run_id = 0
        self._round = 0
        self._rounds_total = 0
        self._deadline: float | None = None
        self._extra_core = tuple(core)
        self.recorder = recorder
        self._executed = 0
        self._turns = Turns()  # one batch at a time
        self._ids = itertools.count(1)
        self._id_prefix = f"invoke_{session_id}_"
        self._cleanups: list[Callable[[], Any]] = []
        self.closed = False
        self.busy = False
        self.last_used = time.monotonic()
        # kept in a session store (`Dispatcher(session_store=...)`): the version of the
        # snapshot this object holds, a new run asked for since, the recording's position
        self._store: SessionStore | None = dispatcher.session_store if kept else None
        self._version = 0
        self._run_asked: tuple[float | None] | None = None  # a new run's deadline, until loaded
        self._chain: ChainPosition | None = None
        self._unkept: tuple[str, ...] = ()
        self._row_cache = RowCache()
        if self._store is not None:
            # ids this worker makes for `invoke` must not meet a started mark another worker
            # left under the same number
            self._id_prefix = f"invoke_{session_id}_{secrets.token_hex(4)}_"
        self._start_run(None)

    # -- runs and schemas ------------------------------------------------------------

    def new_run(self, deadline: float | None = None) -> None:
        """Start the next user turn: dedupe starts empty; `deadline` is in the loop's clock
        (`anyio.current_time()`). With a session store, the run starts on whatever stored
        state this object's next dispatch (or `refresh`) loads: call it on the worker that
        dispatches the turn."""
        if self._store is not None:
            self._run_asked = (deadline,)
        self._start_run(deadline)

    def _start_run(self, deadline: float | None) -> None:
        self._run_id += 1
        self._round = 0
        self._deadline = deadline
        self._planner_state.dedupe.clear()
        self._planner_state.finished.clear()

    @property
    def error_store(self) -> ErrorStore | None:
        """The dispatcher's error memory (what `error_history` and `write_error` reach), or None."""
        return self.dispatcher.error_store

    @property
    def run_id(self) -> int:
        return self._run_id

    @property
    def deadline(self) -> float | None:
        return self._deadline

    def load_tools(self, names: Iterable[str]) -> list[str]:
        """Mark tools as loaded (their schema is known to the model); return the known ones."""
        known = [n for n in names if n in self.dispatcher.registry]
        self._planner_state.loaded.update(known)
        return known

    def is_loaded(self, name: str) -> bool:
        tool = self.dispatcher.registry.registered(name)
        return tool is not None and (not tool.tool.deferred or name in self._planner_state.loaded)

    def _forget(self, written: frozenset[str]) -> None:
        """Drop this run's remembered reads that overlap `written` (another session wrote)."""
        forget_overlapping(self._planner_state.dedupe, written)

    def searchable_tools(self) -> list[Tool]:
        """What `find_tools` searches: every registered tool."""
        return list(self.dispatcher.registry)

    def core_names(self) -> list[str]:
        """The tools whose full schemas go in every request of mode `deferred`."""
        return core_names(self.dispatcher.registry, self._extra_core)

    def tool_index(self) -> str:
        """The one-line index of the tools not in the request (mode `deferred`)."""
        return tool_index(self.dispatcher.registry, self._extra_core)

    def request_tools(self, provider: Provider = "openai") -> list[dict[str, Any]]:
        """The tools array for the next request to `provider`."""
        d = self.dispatcher
        return request_tools(
            d.registry,
            d.core_registry,
            provider,
            mode=self.mode,
            extra_core=self._extra_core,
            is_loaded=self.is_loaded,
        )

    def tool_messages(
        self, results: Iterable[ToolResult], provider: Provider = "openai"
    ) -> list[dict[str, Any]]:
        """What to append to the conversation for a batch's results, in call order: OpenAI
        chat's `role: tool` messages, Anthropic's one `role: user` message holding every
        `tool_result` block, or the Responses `function_call_output` items."""
        return tool_messages(results, provider)

    # -- events and history ------------------------------------------------------------

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(event)` (sync or async) for every committed result; returns an unsubscribe."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def tool_history(self, name: str) -> list[HistoryEntry]:
        """The kept calls of tool `name`, oldest first."""
        return self.history.of_tool(name)

    def statistics(self) -> SessionStatistics:
        """Counts over every call this session committed (not only the kept history)."""
        h = self.history
        return SessionStatistics(
            runs=self._run_id,
            rounds=self._rounds_total,
            calls=h.calls,
            executed=self._executed,
            deduped=h.deduped,
            cached=h.cached,
            by_status={str(status): n for status, n in h.by_status.items()},
            loaded=tuple(sorted(self._planner_state.loaded)),
        )

    # -- dispatch ------------------------------------------------------------------------

    # -- closing ------------------------------------------------------------------------

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` (synchronous) when the session closes: tools register the cleanups of
        what they started for it (`ctx.on_close`)."""
        if self.closed:
            raise RuntimeError(f"session {self.id!r} is closed")
        self._cleanups.append(fn)

    def close(self) -> None:
        """Leave the dispatcher, close the recording and run the cleanups tools registered,
        newest first. Idempotent; a closed session refuses new batches."""
        if self.closed:
            return
        self.closed = True
        self.dispatcher._forget_session(self)
        if self.recorder is not None:
            try:
                self.recorder.close()
            except Exception:
                log.warning("closing the recording of session %s failed", self.id, exc_info=True)
        cleanups, self._cleanups = self._cleanups, []
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception:
                log.warning("a cleanup of session %s raised; ignored", self.id, exc_info=True)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def dispatch(
        self,
        calls: Any,
        *,
        decisions: Mapping[str, Allow | Deny | Answer] | None = None,
    ) -> Coroutine[Any, Any, list[ToolResult]]:
        """Run one batch (`await session.dispatch(calls)`): one result per call, in call
        order, ids preserved. `calls` is a list of call items (dicts or the SDKs' objects)
        or a whole assistant message, whose blocks that are not calls are skipped. (It
        returns the batch's coroutine itself, rather than being one that awaits it.)"""
        return self._dispatch(calls, decisions=decisions, all_loaded=False)

    def _context(self, call_id: str, name: str) -> ToolContext:
        return ToolContext(call_id, name, self._run_id, self._round, self._deadline, self)

    async def invoke(self, name: str, args: Mapping[str, Any] | None = None) -> ToolResult:
        """`Dispatcher.invoke` in this session (what `ToolContext.invoke` calls)."""
        return await self.dispatcher.invoke(name, args, session=self)

    async def _dispatch(
        self,
        calls: Sequence[Any],
        *,
        decisions: Mapping[str, Allow | Deny | Answer] | None,
        all_loaded: bool,
        runner: ToolRunner | None = None,
        gate: Callable[..., Any] | None = None,
    ) -> list[ToolResult]:
        """One batch at a time per session: a second dispatch waits for the first, so that an
        approval is spent, a result remembered and a non-concurrent call finished before the
        next batch plans. A dispatch made by a handler of this session's running batch (an
        `invoke` from a tool) goes ahead: it is part of that batch's work."""
        if self.closed:
            raise RuntimeError(f"session {self.id!r} is closed: open a new one with Dispatcher.session()")
        bound = self.dispatcher._bind()
        inside = _INSIDE.get()
        if self in inside:
            return await self._dispatch_one(bound, calls, decisions, all_loaded, runner, gate)
        turns = self._turns
        if not turns.free():  # no scheduler round trip when the session is free
            await turns.wait(bound.primitives.event)
        token = _INSIDE.set((*inside, self))
        self.busy = True
        try:
            if self._store is None:
                return await self._dispatch_one(bound, calls, decisions, all_loaded, runner, gate)
            return await self._dispatch_kept(self._store, bound, calls, decisions, all_loaded, runner, gate)
        finally:
            self.busy = False
            self.last_used = time.monotonic()
            _INSIDE.reset(token)
            turns.done()

    async def _dispatch_one(
        self,
        bound: _Binding,
        calls: Sequence[Any],
        decisions: Mapping[str, Allow | Deny | Answer] | None,
        all_loaded: bool,
        runner: ToolRunner | None,
        gate: Callable[..., Any] | None,
        before_write: BeforeWrite | None = None,
    ) -> list[ToolResult]:
        calls = tool_calls_of(calls)  # once: the planner and the recording read the same calls
        d = self.dispatcher
        timed = bool(d._batch_subscribers)
        began, t0 = (time.time(), time.monotonic()) if timed else (0.0, 0.0)  # for a BatchEvent
        self._round += 1
        self._rounds_total += 1
        store = d.cache
        planner = new_planner(
            d.registry,
            d.core_registry,
            self._planner_state,
            store is not None,
            self.id,
            self.mode,
            all_loaded,
            d.max_argument_bytes,
            d.max_output_bytes,
            decisions,
            # for a recording: what parse reads in place, which its rows need not read again
            None if self.recorder is None else [],
        )
        drafts = planner.parse(calls)
        rewritten = bool(d.rewriters)  # the arguments as sent may then hold more than the calls' text
        if rewritten:
            await rewrite(
                planner,
                drafts,
                d.rewriters,
                state=self.state,
                session_id=self.id,
                run_id=self._run_id,
                round=self._round,
            )
        wanted = planner.lookups(drafts)
        found: Mapping[str, CacheEntry] = await look_up(store, wanted) if store is not None and wanted else {}
        planner.resolve(drafts, found)
        gated = planner.gated(drafts)
        try:
            gate_decisions = await self._gate(planner, gated, decisions, gate or d.gate) if gated else {}
        except DispatchInterrupted:
            if timed:
                await self._tell_batch(self._batch_event((), (), frozenset(), "interrupted", began, t0))
            raise
        if decisions:  # the caller's answers are decisions the recording keeps too
            answered = {dr.call_id for dr in drafts if not dr.duplicate}
            for call_id, decision in decisions.items():
                if isinstance(decision, Answer) and call_id in answered:
                    gate_decisions.setdefault(call_id, decision)
        plan = planner.finish(drafts)
        # pass 1's working objects go now rather than when the batch returns: fewer live
        # at once through passes 2 and 3, so a large batch sets off fewer garbage collections
        del drafts, gated, planner
        t1 = time.monotonic() if timed else 0.0
        if runner is None and d.runner is not None:
            runner = _public_runner(d.runner)
        # the epochs the reads of this batch start under: a write committed while they run
        # (here, or anywhere the store is shared) keeps them from being remembered or stored
        since = d._generation
        store_since = await epoch_before(store, plan) if store is not None else None
        executor = d._executor(
            bound, runner, before_write, self._deadline, (self._run_id, self._round, self._deadline, self)
        )
        want_events = bool(self._subscribers or d.on_result is not None)
        escaped = ""  # what ended pass 2 early (an outcome of BatchEvent), if anything did
        try:
            await executor.run(plan)
        except BaseException as exc:
            escaped = _cut_by(exc)
            raise
        finally:
            t2 = time.monotonic() if timed else 0.0
            moved = d._written_since(since)
            if store is not None and store_since is not None and moved is not None:
                moved = await moved_elsewhere(store, store_since, moved)
            ran = executor.results
            # asked of a batch with a failure only: its statuses are read without a call each
            noted = not NOTED.isdisjoint(map(_STATUS, ran.values())) and any(map(needs_note, ran.values()))
            failures = await self._failure_notes(plan, ran) if noted else None
            effects = commit(
                plan,
                executor.results,
                started=executor.started,
                moved=moved,
                cut=bool(escaped or executor.control),
                has_cache=store is not None,
                run_id=self._run_id,
                round=self._round,
                session_id=self.id,
                want_events=want_events,
                failures=failures,
            )
            self._executed += len(executor.started)
            land(effects, self._planner_state, self.history, run_id=self._run_id, round=self._round)
            if effects.invalidations:
                d._moved(effects.invalidations, by=self)
            if (store is not None and (effects.invalidations or effects.cache_writes)) or (
                effects.errors and d.error_store is not None
            ):
                # shielded: a batch cut short by cancellation still lands what finished
                with anyio.CancelScope(shield=True):
                    await self._write_out(effects, store_since)
            if d._batch_subscribers:
                # delivered shielded and from this finally, so a cancelled batch is reported too
                with anyio.CancelScope(shield=True):
                    event = self._batch_event(
                        tuple(p.call for p in plan.calls),
                        effects.results,
                        frozenset(executor.started),
                        escaped or _outcome_of(executor.control.first()),
                        began,
                        t0,
                        t1,
                        t2,
                    )
                    await self._tell_batch(event)
            # last, so that a Ctrl-C while a line is written on the loop's thread costs nothing
            # else of pass 3; the wait is not shielded: a line handed over gets written either
            # way, and a cancelled batch need not wait for a disk that stalls
            recorded = self._record(effects, calls, plan, gate_decisions, executor, all_loaded, rewritten)
            if recorded is not None:
                await recorded()
        if want_events:
            await self._deliver(effects.events)
        control = executor.control.first()
        if control is not None:
            raise control
        results: list[ToolResult] = list(filter(_IS_RESULT, effects.results))  # type: ignore[arg-type]
        if len(results) != len(plan.calls):  # pragma: no cover - a broken invariant, never papered over
            raise RuntimeError(f"{len(plan.calls)} calls produced {len(results)} results")
        return results

    async def _failure_notes(self, plan: Plan, ran: Mapping[int, ToolResult]) -> FailureNotes:
        """What pass 3 needs to finish the failures of calls that ran: which hints apply, and
        what the error store knows of their signatures. Shielded, like the rest of pass 3; a
        store's fault leaves them unknown."""
        d = self.dispatcher
        store = d.error_store
        notes = FailureNotes(
            remembering=store is not None,
            write_error=store is not None and "write_error" in d.registry,
            store_secret="store_secret" in d.registry and callable(self.state.get(SECRET_STORE_KEY)),
        )
        if store is None:
            return notes
        wanted = signatures_of((r, plan.calls[i].args) for i, r in ran.items())
        with anyio.CancelScope(shield=True):
            try:
                found = await store.lookup(wanted)
            except BaseException as exc:
                if not ordinary_failure(exc):
                    raise
                log.warning("error store lookup failed; failures shown as new", exc_info=True)
                return notes
        if not isinstance(found, Mapping):
            return notes
        return attrs.evolve(notes, known={k: v for k, v in found.items() if isinstance(v, ErrorRecord)})

    def _record(
        self,
        effects: CommitEffects,
        calls: list[Any],
        plan: Plan,
        decisions: Mapping[str, Decision],
        executor: Executor,
        all_loaded: bool,
        rewritten: bool,
    ) -> Callable[[], Awaitable[Any]] | None:
        """Hand the batch to the recording, which writes its line on the loop's thread once
        its file is open, or hands it to its writer thread (opening the file, syncing with
        record_fsync, a disk that stalls), which must not hold up the other sessions' calls.
        What to call and await until the line is in the file, or None (no recording, a line
        already written, or a recording that does not wait)."""
        recorder = self.recorder
        if recorder is None:
            return None
        return recorder.submit(
            self._run_id,
            self._round,
            calls,
            plan,
            effects.results,
            decisions,
            executor.control.first(),
            all_loaded,
            rewritten,
        )

    async def _write_out(self, effects: CommitEffects, store_since: int | None) -> None:
        """The effects that leave the process for the stores: the result store's
        invalidations and writes, in one call, and the error store's. A store's fault is
        logged, never raised."""
        d = self.dispatcher
        if d.cache is not None:
            await update_store(d.cache, effects, store_since)
        if d.error_store is not None and effects.errors:
            await remember_failures(d.error_store, effects.errors)

    async def _gate(
        self,
        planner: Planner,
        gated: list[Draft],
        decisions: Mapping[str, Allow | Deny | Answer] | None,
        gate: Callable[..., Any] | None,
    ) -> dict[str, Decision]:
        """Every gate answered (`gated`, the calls that need one, in call order) before
        anything runs; then the first Interrupt raises."""
        pending: list[tuple[ToolCall, str, Any]] = []
        taken: dict[str, Decision] = {}
        for draft in gated:
            decision: Any = planner.take_decision(draft, decisions)
            if decision is None:
                if gate is None:
                    continue
                call = draft.resolved_call()
                try:
                    decision = await _maybe_await(gate(call, self._context(call.id, call.name)))
                except BaseException as exc:
                    if not ordinary_failure(exc):
                        raise
                    log.warning("gate raised on call %s; the call is denied", call.id, exc_info=True)
                    decision = Deny(f"the gate failed: {describe(exc)}")
            taken[draft.call_id] = decision
            if isinstance(decision, Deny):
                planner.deny(draft, decision.reason)
            elif isinstance(decision, Allow):
                planner.allow(draft, decision)
            elif isinstance(decision, Interrupt):
                pending.append((draft.resolved_call(), decision.reason, decision.payload))
            elif isinstance(decision, Answer):
                planner.answer(draft, decision)
            else:
                log.warning(
                    "gate returned %s, not Allow, Deny, Interrupt or Answer; the call is denied",
                    shown(decision),
                )
                planner.deny(draft, f"the gate returned {shown(decision)}")
        if pending:
            raise DispatchInterrupted(pending)
        return taken

    def _batch_event(
        self,
        calls: tuple[ToolCall, ...],
        results: tuple[ToolResult | None, ...],
        ran: frozenset[int],
        outcome: str,
        began: float,
        t0: float,
        t1: float | None = None,
        t2: float | None = None,
    ) -> BatchEvent:
        """A BatchEvent ending now; `t1`/`t2` (pass 1 and pass 2 over) are None for a batch
        that stopped in pass 1."""
        now = time.monotonic()
        t1 = now if t1 is None else t1
        t2 = now if t2 is None else t2
        return BatchEvent(
            self.id, self._run_id, self._round, calls, results, ran, began, t1 - t0, t2 - t1, now - t2,
            outcome,
        )  # fmt: skip

    async def _tell_batch(self, event: BatchEvent) -> None:
        for fn in list(self.dispatcher._batch_subscribers):
            try:
                await _maybe_await(fn(event))
            except BaseException as exc:
                if not ordinary_failure(exc):
                    raise
                log.warning("batch subscriber %s raised; ignored", shown(fn), exc_info=True)

    async def _deliver(self, events: Sequence[ToolResultEvent]) -> None:
        targets = list(self._subscribers)
        if self.dispatcher.on_result is not None:
            targets.append(self.dispatcher.on_result)
        for event in events:
            for fn in targets:
                try:
                    await _maybe_await(fn(event))
                except BaseException as exc:
                    if not ordinary_failure(exc):
                        raise
                    log.warning("event subscriber %s raised; ignored", shown(fn), exc_info=True)

    def next_call_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    # -- state kept in a session store ---------------------------------------------------

    async def _dispatch_kept(
        self,
        store: SessionStore,
        bound: _Binding,
        calls: Sequence[Any],
        decisions: Mapping[str, Allow | Deny | Answer] | None,
        all_loaded: bool,
        runner: ToolRunner | None,
        gate: Callable[..., Any] | None,
    ) -> list[ToolResult]:
        """A batch under the session's lease: take it (SessionBusy at once if another worker
        holds it), load the stored state, run the batch while renewing the lease, save what
        the batch landed (also when it was interrupted, blocked or cancelled), give the lease
        up. A lease lost while the batch runs stops the batch, and nothing is saved."""
        keeper = _Keeper(store, await store.acquire(self.id), self.dispatcher.max_output_bytes)
        try:
            self._adopt(await store.load(self.id))
            results: list[ToolResult] | None = None
            caught: BaseException | None = None
            async with anyio.create_task_group() as renewing:
                renewing.start_soon(keeper.renew)
                try:
                    with anyio.CancelScope() as keeper.scope:
                        try:
                            ran = await self._dispatch_one(
                                bound, calls, decisions, all_loaded, runner, gate, keeper.mark
                            )
                        except BaseException as exc:
                            await self._keep(keeper, exc)
                            raise
                        if await self._keep(keeper, None):
                            results = ran
                except BaseException as exc:  # raised below, outside the task group
                    caught = exc
                finally:
                    renewing.cancel_scope.cancel()
            if caught is not None:
                raise caught
            if keeper.failed is not None:  # what finished is saved; the writer did not start
                raise keeper.failed
            if results is not None:
                return results
            raise SessionBusy(
                self.id, "this worker's lease was lost while the batch ran: it stopped, its state unsaved"
            )
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await store.release(keeper.lease)
                except Exception:
                    log.warning("releasing the lease of session %s failed", self.id, exc_info=True)

    async def _keep(self, keeper: _Keeper, ended: BaseException | None) -> bool:
        """Save the session at the end of a batch, whatever ended it (`ended`), unless the
        lease is lost; whether it was saved. A save that fails raises, unless the batch
        ended with a cancellation or a KeyboardInterrupt: that goes on, the failure logged."""
        if keeper.lost:
            return False
        with anyio.CancelScope(shield=True):
            try:
                snapshot = encode_snapshot(self._snapshot(self._version + 1))
                await keeper.store.save(keeper.lease, snapshot)
            except Exception:
                if ended is None or isinstance(ended, Exception):
                    raise
                log.warning("the state of session %s could not be saved", self.id, exc_info=True)
                return False
        self._version += 1
        return True

    async def refresh(self) -> bool:
        """Bring this object up to the session's stored state now, as the next dispatch
        would first (no lease is taken): for a worker that reads the session before it
        dispatches, such as `request_tools` for the next request. Whether anything newer
        was found; without a session store, nothing is done."""
        if self._store is None:
            return False
        return self._adopt(await self._store.load(self.id), marks=False)

    def _adopt(self, stored: StoredSession, *, marks: bool = True) -> bool:
        """Take the stored state if it is newer than what this object holds, then the new
        run asked for since, then the started marks of writers no snapshot covers (under
        the lease: `marks`). Whether the stored state was taken."""
        restored = False
        if stored.snapshot is not None:
            snapshot = decode_newer(stored.snapshot, self._version)
            if snapshot is not None:
                self._restore(snapshot)
                restored = True
        asked, self._run_asked = self._run_asked, None
        if asked is not None and restored:  # it started here already, on the state now replaced
            self._start_run(asked[0])
        if not marks:
            if not restored:
                self._run_asked = asked
            return restored
        finished = self._planner_state.finished
        for call_id in stored.started:
            if call_id not in finished:
                # its name is known when the call comes again: pass 1 makes the result then
                finished[call_id] = FinishedCall(STOPPED_KEY, ToolResult(call_id, "", Status.failed, ""))
        return restored

    def _snapshot(self, version: int) -> SessionSnapshot:
        state, unkept = json_values(self.state)
        if unkept != self._unkept:
            self._unkept = unkept
            if unkept:
                log.info("session %s keeps these state values on this worker only (not JSON): %s",
                         self.id, ", ".join(unkept))  # fmt: skip
        chain = self._chain
        position = None if self.recorder is None else self.recorder.position
        if position is not None:
            chain = ChainPosition(position[0], position[1], self._run_id)
        self._chain = chain
        ps = self._planner_state
        return SessionSnapshot(
            version=version,
            session_id=self.id,
            run_id=self._run_id,
            round=self._round,
            rounds=self._rounds_total,
            executed=self._executed,
            mode=self.mode,
            core=self._extra_core,
            loaded=frozenset(ps.loaded),
            dedupe=tuple(ps.dedupe.items()),
            spent_approvals=frozenset(ps.spent_approvals),
            finished=tuple(ps.finished.items()),
            history=history_state(self.history, self._row_cache),
            state=state,
            chain=chain,
        )

    def _restore(self, snapshot: SessionSnapshot) -> None:
        """Become the stored session (the deadline, a worker's own clock, stays)."""
        self._version = snapshot.version
        self._run_id, self._round = snapshot.run_id, snapshot.round
        self._rounds_total, self._executed = snapshot.rounds, snapshot.executed
        self.mode, self._extra_core = snapshot.mode, snapshot.core
        ps = self._planner_state
        ps.loaded.clear()
        ps.loaded.update(snapshot.loaded)
        ps.dedupe.clear()
        ps.dedupe.update(snapshot.dedupe)
        ps.spent_approvals.clear()
        ps.spent_approvals.update(snapshot.spent_approvals)
        ps.finished.clear()
        ps.finished.update(snapshot.finished)
        fill_history(self.history, snapshot.history)
        self._row_cache.forget()
        local = {k: v for k, v in self.state.items() if k not in snapshot.state and json_values({k: v})[1]}
        self.state.clear()
        self.state.update(local)
        self.state.update(snapshot.state)
        self._chain = snapshot.chain
        if self.recorder is not None:
            self.recorder.set_mode(self.mode)  # a replay of it must plan as this session does
            if snapshot.chain is not None:
                chain = snapshot.chain
                self.recorder.resume_at(chain.seq, chain.prev, chain.run)


@attrs.define(eq=False)
class _Keeper:
    """One batch's lease: renewed every third of its life, and the hook that records each
    writer's start. A renewal that finds the lease gone, or a start that cannot be recorded,
    stops the batch (`scope`)."""

    store: SessionStore
    lease: Lease
    max_output_bytes: int
    scope: anyio.CancelScope | None = None
    lost: bool = False
    failed: BaseException | None = None

    def _stop(self) -> None:
        if self.scope is not None:
            self.scope.cancel()

    async def renew(self) -> None:
        every = self.lease.seconds / 3
        while True:
            await anyio.sleep(every)
            try:
                held = await self.store.renew(self.lease)
            except Exception:  # tried again: a save refused at the end says if it expired
                log.warning("renewing the lease of session %s failed", self.lease.session_id, exc_info=True)
                continue
            if not held:
                log.warning("session %s: this worker lost its lease; the batch stops", self.lease.session_id)
                self.lost = True
                self._stop()
                return

    async def mark(self, planned: PlannedCall) -> ToolResult | None:
        """Record that `planned` starts; if that cannot be done, a result instead of running it."""
        why = "the batch was stopped" if self.lost or self.failed is not None else None
        if why is None:
            try:
                await self.store.mark_started(self.lease, (planned.call_id,))
                return None
            except Exception as exc:
                self.failed = exc
                self._stop()
                why = f"the session store could not record its start: {describe(exc)}"
        return failure_result(
            planned.call_id, planned.name, Status.failed, f"{planned.name} did not start: {why}",
            limit=self.max_output_bytes,
        )  # fmt: skip


def _outcome_of(control: BaseException | None) -> str:
    """A BatchEvent's outcome for the run control a batch ended with (None: it ran out)."""
    if control is None:
        return "ok"
    if isinstance(control, DispatchInterrupted):
        return "interrupted"
    if isinstance(control, HookBlocked):
        return "blocked"
    return "error"


def _cut_by(exc: BaseException) -> str:
    """A BatchEvent's outcome for what escaped pass 2: "cancelled" for the loop's
    cancellation (on trio, a group of them from a group of calls), else "error"."""
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, BaseExceptionGroup):
        return "cancelled" if exc.split(cancelled)[1] is None else "error"
    return "cancelled" if isinstance(exc, cancelled) else "error"
