"""Pass 3, commit: land a batch's outcomes in the session, serially, in call order.

Synchronous and sans-IO apart from the result cache handed in (a store keeps its own
failures to itself). Returns the results and, only when somebody listens, the events;
the session delivers events and writes the recording.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import attrs

from cache import ResultCache, resources_overlap

from ._history import History
from ._plan import DedupeEntry, Plan, PlannerState, _served_again
from ._types import Status, ToolResult, ToolResultEvent

__all__ = ["CommitOutcome", "commit"]

log = logging.getLogger("threepass.commit")


@attrs.frozen
class CommitOutcome:
    """One entry per call, in call order; None for a call that never finished."""

    results: tuple[ToolResult | None, ...]
    events: tuple[ToolResultEvent, ...]


def _invalidate(state: PlannerState, cache: ResultCache | None, writes: frozenset[str]) -> None:
    doomed = [k for k, e in state.dedupe.items() if resources_overlap(e.reads, writes)]
    for key in doomed:
        del state.dedupe[key]
    if cache is not None:
        try:
            cache.invalidate(writes)
        except Exception:  # a store's fault must never fail a call
            log.warning("result cache invalidation failed for %s", sorted(writes), exc_info=True)


def commit(
    plan: Plan,
    executed: Mapping[int, ToolResult],
    *,
    started: Collection[int] = (),
    state: PlannerState,
    cache: ResultCache | None,
    history: History,
    run_id: int,
    round: int,
    session_id: str,
    want_events: bool,
) -> CommitOutcome:
    results: list[ToolResult | None] = []
    for planned in plan.calls:
        ran = planned.index in executed
        if planned.outcome is not None:
            result: ToolResult | None = planned.outcome
        elif planned.leader is not None:
            led = results[planned.leader]
            result = None if led is None else _served_again(led, planned.call_id)
        else:
            result = executed.get(planned.index)
        results.append(result)
        if result is None:
            if planned.writes and planned.index in started:
                # started, then cancelled or blocked before it answered: it may have written
                _invalidate(state, cache, planned.writes)
            continue
        history.add(run_id, round, planned, result)
        ok = result.status is Status.ok
        if not ok and planned.loads_schema:
            state.loaded.add(planned.name)
        if ran and planned.spent_approval:
            state.spent_approvals.add(planned.call_id)
        if planned.writes:
            if ran and (ok or result.effect_uncertain):
                # a write that may have happened drops what it may have changed
                _invalidate(state, cache, planned.writes)
            continue  # writes are never remembered
        if not ok:
            continue  # failures are never remembered across rounds
        if planned.key is not None and (ran or result.cached):
            state.dedupe[planned.key] = DedupeEntry(result, planned.reads)
        if ran and planned.cache_key is not None and cache is not None and planned.tool is not None:
            policy = planned.tool.tool.cache
            if policy is not None:
                try:
                    cache.set(planned.cache_key, result.content, ttl=policy.ttl, reads=planned.reads)
                except Exception:
                    log.warning("result cache write failed for %s", planned.name, exc_info=True)
    events: tuple[ToolResultEvent, ...] = ()
    if want_events:
        events = tuple(
            ToolResultEvent(
                session_id=session_id, run_id=run_id, round=round, index=i, call=plan.calls[i].call, result=r
            )
            for i, r in enumerate(results)
            if r is not None
        )
    return CommitOutcome(results=tuple(results), events=events)
