"""`Session`: one conversation's state, and `dispatch`, which drives the three passes.

The session owns what pass 1 reads and pass 3 changes (loaded schemas, the run's dedupe
map, spent approvals, histories) and does every await the pure passes cannot: the
rewriters, the result store's lookup, the gates; pass 2 is the executor's; then it
applies what pass 3 returns (the store's writes and the recording off the event loop),
and delivers the events.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import attrs

from ._commit import CommitEffects, commit, land
from ._exceptions import DispatchInterrupted
from ._execute import Executor, ToolRunner, _maybe_await
from ._history import DEFAULT_HISTORY_LIMIT, History
from ._plan import FIND_TOOLS, RUN_TOOL, Draft, Plan, PlannedCall, Planner, PlannerState
from ._providers import tool_entry
from ._registry import Tool
from ._results import describe, shown
from ._rewrite import rewrite
from ._seams import CacheEntry
from ._seams import ToolRunner as PublicRunner
from ._types import (
    Allow,
    Decision,
    Deny,
    HistoryEntry,
    Interrupt,
    Provider,
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

Subscriber = Callable[[ToolResultEvent], Any]

_INSIDE: contextvars.ContextVar[frozenset[Session]] = contextvars.ContextVar(
    "threepass_inside_sessions", default=frozenset()
)
"""The sessions whose batch the current task is part of (a handler runs inside its batch)."""


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
        self._one_batch: Any = None  # the bound loop's Lock, made at the first dispatch
        self._ids = itertools.count(1)
        self.new_run()

    # -- runs and schemas ------------------------------------------------------------

    def new_run(self, deadline: float | None = None) -> None:
        """Start the next user turn: dedupe starts empty; `deadline` is in the loop's clock
        (`anyio.current_time()`)."""
        self._run_id += 1
        self._round = 0
        self._deadline = deadline
        self._planner_state.dedupe.clear()

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

    def searchable_tools(self) -> list[Tool]:
        """What `find_tools` searches: every registered tool."""
        return list(self.dispatcher.registry)

    def core_names(self) -> list[str]:
        """The tools whose full schemas go in every request of mode `deferred`."""
        names = [FIND_TOOLS, RUN_TOOL]
        names += [t.name for t in self.dispatcher.registry if not t.deferred and t.name not in names]
        names += [n for n in self._extra_core if n in self.dispatcher.registry and n not in names]
        return names

    def tool_index(self) -> str:
        """The one-line index of the tools not in the request (mode `deferred`)."""
        core = set(self.core_names())
        others = [t.name for t in self.dispatcher.registry if t.name not in core]
        if not others:
            return ""
        return f"More tools (fetch a schema with {FIND_TOOLS}, call with {RUN_TOOL}): " + ", ".join(others)

    def request_tools(self, provider: Provider = "openai") -> list[dict[str, Any]]:
        """The tools array for the next request to `provider`."""
        d = self.dispatcher
        core = d.core_registry
        entries: list[dict[str, Any]] = []
        if self.mode == "deferred":
            for name in self.core_names():
                tool = core.get(name) if name in core else d.registry.get(name)
                description = tool.description
                if name == RUN_TOOL and (index := self.tool_index()):
                    description = f"{description} {index}"
                entries.append(tool_entry(tool, provider, description=description))
            return entries
        entries.append(tool_entry(core.get(FIND_TOOLS), provider))
        for tool in d.registry:
            if tool.name in (FIND_TOOLS, RUN_TOOL):
                continue
            entries.append(tool_entry(tool, provider, stub=tool.deferred and not self.is_loaded(tool.name)))
        return entries

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
            by_status=dict(h.by_status),
            loaded=tuple(sorted(self._planner_state.loaded)),
        )

    # -- dispatch ------------------------------------------------------------------------

    async def dispatch(
        self,
        calls: Sequence[Any],
        *,
        decisions: Mapping[str, Allow | Deny] | None = None,
    ) -> list[ToolResult]:
        """Run one batch: one result per call, in call order, ids preserved."""
        return await self._dispatch(calls, decisions=decisions, all_loaded=False)

    def _context(self, call_id: str, name: str) -> ToolContext:
        return ToolContext(call_id, name, self._run_id, self._round, self._deadline, self)

    def _planned_context(self, planned: PlannedCall) -> ToolContext:
        return ToolContext(planned.call_id, planned.name, self._run_id, self._round, self._deadline, self)

    async def invoke(self, name: str, args: Mapping[str, Any] | None = None) -> ToolResult:
        """`Dispatcher.invoke` in this session (what `ToolContext.invoke` calls)."""
        return await self.dispatcher.invoke(name, args, session=self)

    async def _dispatch(
        self,
        calls: Sequence[Any],
        *,
        decisions: Mapping[str, Allow | Deny] | None,
        all_loaded: bool,
        runner: ToolRunner | None = None,
        gate: Callable[..., Any] | None = None,
    ) -> list[ToolResult]:
        """One batch at a time per session: a second dispatch waits for the first, so that an
        approval is spent, a result remembered and a non-concurrent call finished before the
        next batch plans. A dispatch made by a handler of this session's running batch (an
        `invoke` from a tool) goes ahead: it is part of that batch's work."""
        bound = self.dispatcher._bind()
        inside = _INSIDE.get()
        if self in inside:
            return await self._dispatch_one(bound, calls, decisions, all_loaded, runner, gate)
        lock = self._one_batch
        if lock is None:
            lock = self._one_batch = bound.primitives.lock()
        try:
            lock.acquire_nowait()  # no scheduler round trip when the session is free
        except bound.primitives.would_block:
            await lock.acquire()
        token = _INSIDE.set(inside | {self})
        try:
            return await self._dispatch_one(bound, calls, decisions, all_loaded, runner, gate)
        finally:
            _INSIDE.reset(token)
            lock.release()

    async def _dispatch_one(
        self,
        bound: _Binding,
        calls: Sequence[Any],
        decisions: Mapping[str, Allow | Deny] | None,
        all_loaded: bool,
        runner: ToolRunner | None,
        gate: Callable[..., Any] | None,
    ) -> list[ToolResult]:
        calls = list(calls)  # once: the planner and the recording read the same calls
        d = self.dispatcher
        self._round += 1
        self._rounds_total += 1
        store = d.cache
        planner = Planner(
            registry=d.registry,
            core=d.core_registry,
            state=self._planner_state,
            has_cache=store is not None,
            session_id=self.id,
            mode=self.mode,
            all_loaded=all_loaded,
            max_argument_bytes=d.max_argument_bytes,
            max_output_bytes=d.max_output_bytes,
        )
        drafts = planner.parse(calls)
        if d.rewriters:
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
        found: Mapping[str, CacheEntry] = await self._look_up(wanted) if wanted else {}
        planner.resolve(drafts, found)
        gate_decisions = await self._gate(planner, drafts, decisions, gate or d.gate)
        plan = planner.finish(drafts)
        if runner is None and d.runner is not None:
            runner = _public_runner(d.runner)
        executor = Executor(
            limiter=d.limiter,
            thread_limiter=bound.thread_limiter,
            primitives=bound.primitives,
            default_timeout=d.timeout,
            deadline=self._deadline,
            hooks=d.hook_set,
            make_context=self._planned_context,
            max_output_bytes=d.max_output_bytes,
            runner=runner,
            watch=d.watch,
        )
        want_events = bool(self._subscribers or d.on_result is not None)
        try:
            await executor.run(plan)
        finally:
            effects = commit(
                plan,
                executor.results,
                started=executor.started,
                has_cache=store is not None,
                run_id=self._run_id,
                round=self._round,
                session_id=self.id,
                want_events=want_events,
            )
            self._executed += len(executor.started)
            land(effects, self._planner_state, self.history, run_id=self._run_id, round=self._round)
            if (store is not None and (effects.invalidations or effects.cache_writes)) or (
                self.recorder is not None
            ):
                # shielded: a batch cut short by cancellation still lands what finished
                with anyio.CancelScope(shield=True):
                    await self._write_out(effects, calls, plan, gate_decisions, executor, all_loaded)
        if want_events:
            await self._deliver(effects.events)
        control = executor.control.first()
        if control is not None:
            raise control
        results = [r for r in effects.results if r is not None]
        if len(results) != len(plan.calls):  # pragma: no cover - a broken invariant, never papered over
            raise RuntimeError(f"{len(plan.calls)} calls produced {len(results)} results")
        return results

    async def _look_up(self, keys: Sequence[str]) -> Mapping[str, CacheEntry]:
        """The store's live entries among `keys`; a store's fault is a miss, never a failure."""
        store = self.dispatcher.cache
        assert store is not None
        try:
            found = await store.get_many(keys)
        except Exception:
            log.warning(
                "result cache lookup failed for %d key(s); treated as misses", len(keys), exc_info=True
            )
            return {}
        if not isinstance(found, Mapping):
            log.warning("result cache returned %s, not a mapping; treated as misses", shown(found))
            return {}
        good: dict[str, CacheEntry] = {}
        for key, hit in found.items():
            if isinstance(hit, CacheEntry):
                good[key] = hit
            elif hit is not None:
                log.warning("result cache returned %s, not a CacheEntry; treated as a miss", shown(hit))
        return good

    async def _write_out(
        self,
        effects: CommitEffects,
        calls: list[Any],
        plan: Plan,
        decisions: Mapping[str, Decision],
        executor: Executor,
        all_loaded: bool,
    ) -> None:
        """The effects that leave the process: the store's invalidations, then its writes,
        then the recording, in a worker thread. A store's fault is logged, never raised."""
        store = self.dispatcher.cache
        if store is not None:
            if effects.invalidations:
                try:
                    await store.invalidate(effects.invalidations)
                except Exception:
                    log.warning(
                        "result cache invalidation failed for %s",
                        sorted(effects.invalidations),
                        exc_info=True,
                    )
            if effects.cache_writes:
                try:
                    await store.set_many(effects.cache_writes)
                except Exception:
                    log.warning(
                        "result cache write failed for %d entries", len(effects.cache_writes), exc_info=True
                    )
        recorder = self.recorder
        if recorder is not None:
            results = effects.results
            control = executor.control.first()
            run_id, round_ = self._run_id, self._round
            await anyio.to_thread.run_sync(
                lambda: recorder.record_batch(
                    run_id=run_id,
                    round=round_,
                    calls=calls,
                    plan=plan,
                    results=results,
                    decisions=decisions,
                    control=control,
                    all_loaded=all_loaded,
                )
            )

    async def _gate(
        self,
        planner: Planner,
        drafts: list[Draft],
        decisions: Mapping[str, Allow | Deny] | None,
        gate: Callable[..., Any] | None,
    ) -> dict[str, Decision]:
        """Every gate answered, in call order, before anything runs; then the first Interrupt raises."""
        pending: list[tuple[ToolCall, str, Any]] = []
        taken: dict[str, Decision] = {}
        for draft in planner.gated(drafts):
            decision: Any = planner.take_decision(draft, decisions)
            if decision is None:
                if gate is None:
                    continue
                call = draft.resolved_call()
                try:
                    decision = await _maybe_await(gate(call, self._context(call.id, call.name)))
                except Exception as exc:
                    log.warning("gate raised on call %s; the call is denied", call.id, exc_info=True)
                    decision = Deny(f"the gate failed: {describe(exc)}")
            taken[draft.call_id] = decision
            if isinstance(decision, Deny):
                planner.deny(draft, decision.reason)
            elif isinstance(decision, Allow):
                planner.allow(draft, decision)
            elif isinstance(decision, Interrupt):
                pending.append((draft.resolved_call(), decision.reason, decision.payload))
            else:
                log.warning(
                    "gate returned %s, not Allow, Deny or Interrupt; the call is denied", shown(decision)
                )
                planner.deny(draft, f"the gate returned {shown(decision)}")
        if pending:
            raise DispatchInterrupted(pending)
        return taken

    async def _deliver(self, events: Sequence[ToolResultEvent]) -> None:
        targets = list(self._subscribers)
        if self.dispatcher.on_result is not None:
            targets.append(self.dispatcher.on_result)
        for event in events:
            for fn in targets:
                try:
                    await _maybe_await(fn(event))
                except Exception:
                    log.warning("event subscriber %s raised; ignored", shown(fn), exc_info=True)

    def next_call_id(self) -> str:
        return f"invoke_{self.id}_{next(self._ids)}"
