"""Pass 3, commit: what a batch's outcomes change, decided serially, in call order.

Synchronous and sans-IO: `commit` reads the plan and what ran, and returns the effects
as values (results, history rows, schemas loaded, approvals spent, invalidations,
dedupe entries, cache writes, events, failures to remember). A failure of a call that ran
is finished here: hint lines, a `next:` line, and what the error store knew of it. `land`
applies the ones that stay in the session's memory; the session awaits the store's and
writes the recording. Nothing here touches the event loop, a store or the disk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping

import attrs

from ._credentials import echoes_credentials
from ._errors import MAX_ERRORS_PER_BATCH, FailureNotes, note_failure
from ._history import History
from ._plan import DedupeEntry, FinishedCall, Plan, PlannedCall, PlannerState, _served_again
from ._policy import NO_RESOURCES, resources_overlap
from ._seams import CacheWrite, ErrorRecord
from ._types import Status, ToolResult, ToolResultEvent

__all__ = ["CommitEffects", "commit", "forget_overlapping", "land"]


@attrs.frozen(slots=False)  # one per batch: filling a dict is cheaper than setting eleven slots
class CommitEffects:
    """What one batch changes, for the session to apply in field order.

    `invalidations` are applied before `remember` and `cache_writes`: a success that a
    later write of the same batch may have changed is left out of both here, so applying
    every invalidation first, then every survivor, is the same as going call by call."""

    results: tuple[ToolResult | None, ...]
    """One per call, in call order; None for a call that never finished."""
    history: tuple[tuple[PlannedCall, ToolResult], ...] = ()
    loaded: tuple[str, ...] = ()
    spent_approvals: tuple[str, ...] = ()
    invalidations: frozenset[str] = frozenset()
    remember: tuple[tuple[str, DedupeEntry], ...] = ()
    cache_writes: tuple[CacheWrite, ...] = ()
    events: tuple[ToolResultEvent, ...] = ()
    finished: tuple[tuple[str, FinishedCall], ...] = ()
    """A batch cut short: the calls that finished (ran, or answered), kept for its resume."""
    consumed: tuple[str, ...] = ()
    """A batch that completed: the kept calls it served, no longer needed."""
    errors: tuple[ErrorRecord, ...] = ()
    """The failures of calls that ran, one per signature (counted), for the error store."""


_OK = Status.ok
_entry: Callable[[tuple[ToolResult, frozenset[str]]], DedupeEntry] = functools.partial(
    tuple.__new__, DedupeEntry
)
"""`DedupeEntry(result, reads)` from the pair, without the named tuple's Python `__new__`."""


def forget_overlapping(remember: dict[str, DedupeEntry], writes: frozenset[str]) -> None:
    """Drop the remembered successes whose reads overlap `writes`."""
    for key in [k for k, e in remember.items() if resources_overlap(e.reads, writes)]:
        del remember[key]


def commit(
    plan: Plan,
    executed: Mapping[int, ToolResult],
    *,
    started: Collection[int] = (),
    moved: frozenset[str] | None = frozenset(),
    cut: bool = False,
    has_cache: bool,
    run_id: int,
    round: int,
    session_id: str,
    want_events: bool,
    failures: FailureNotes | None = None,
) -> CommitEffects:
    """Land a batch: `executed` holds the results of the calls that ran (by index), and
    `started` the calls whose handler began (a writer that began but never answered may
    have written). Successes that wrote nothing are remembered for the run (and cached,
    where their tool has a policy); failures never are; a write that may have happened
    (a success, or a failure that says its effect is uncertain) invalidates what it
    overlaps. `moved`: what other batches wrote while this one ran (the epochs moved; None:
    too much to say, anything): a read of it is returned, but neither remembered nor
    cached. `cut`: the batch was cut short (run control from pass 2, a cancellation):
    what finished is kept, so that dispatching the batch again serves it instead of
    running it twice. `failures`: what the session knows for finishing the failures of
    calls that ran (None: they are left as pass 2 made them). Returns the effects;
    changes nothing itself."""
    results: list[ToolResult | None] = []
    unfinished = False  # a call without a result (None among the results)
    remember: dict[str, DedupeEntry] = {}
    # what most batches never add to starts empty and immutable, made anew as it grows
    loaded: tuple[str, ...] = ()
    spent: tuple[str, ...] = ()
    invalidated = NO_RESOURCES
    cache_writes: list[CacheWrite] | None = None
    errors: dict[str, ErrorRecord] | None = None
    for planned in plan.calls:
        # its fields read once (a named tuple's field read by name takes the generic lookup)
        index, call_id, name, args, tool, outcome, leader, key, reads, writes, _, cache_key, used, _ = planned
        ran = index in executed
        if outcome is not None:
            result: ToolResult | None = outcome
        elif leader is not None:
            led = results[leader]
            result = None if led is None else _served_again(led, call_id)
        else:
            result = executed.get(index)
            if failures is not None and result is not None and result.status is not _OK:
                result, record = note_failure(result, args, failures)
                if record is not None:
                    if errors is None:
                        errors = {}
                    _count(errors, record)
        results.append(result)
        if result is None:
            unfinished = True
            if writes and index in started:
                # started, then cancelled or blocked before it answered: it may have written
                invalidated |= writes
                forget_overlapping(remember, writes)
                if cache_writes:
                    cache_writes = [w for w in cache_writes if not resources_overlap(w.reads, writes)]
            continue
        ok = result.status is _OK
        if not ok and planned.loads_schema:
            loaded += (name,)
        if ran and used:  # its approval spent
            spent += (call_id,)
        if writes:
            if ran and (ok or result.effect_uncertain):
                # a write that may have happened drops what it may have changed
                invalidated |= writes
                forget_overlapping(remember, writes)
                if cache_writes:
                    cache_writes = [w for w in cache_writes if not resources_overlap(w.reads, writes)]
            continue  # writes are never remembered
        if not ok:
            continue  # failures are never remembered across rounds
        if ran and (moved is None or (moved and resources_overlap(reads, moved))):
            continue  # it may have read what a write changed under it: returned, not kept
        if key is not None and (ran or result.cached):
            remember[key] = _entry((result, reads))
        if ran and cache_key is not None and has_cache and tool is not None:
            policy = tool.tool.cache
            # a result that shows a credential of its call is not kept at rest (a recording
            # holds its marker instead): it is returned, and runs again next time
            if policy is not None and not echoes_credentials(args, result.content):
                if cache_writes is None:
                    cache_writes = []
                cache_writes.append(CacheWrite(cache_key, result.content, policy.ttl, reads))
    # every call with a result, in call order, paired with it (in one pass, after the loop)
    history: tuple[tuple[PlannedCall, ToolResult], ...] = (
        tuple(zip(plan.calls, results, strict=True))  # type: ignore[arg-type]  # no None among them
        if not unfinished
        else tuple((p, r) for p, r in zip(plan.calls, results, strict=True) if r is not None)
    )
    events: tuple[ToolResultEvent, ...] = ()
    if want_events:
        events = tuple(
            ToolResultEvent(
                session_id=session_id, run_id=run_id, round=round, index=i, call=plan.calls[i].call, result=r
            )
            for i, r in enumerate(results)
            if r is not None
        )
    carried = plan.carried
    finished: tuple[tuple[str, FinishedCall], ...] = ()
    consumed: tuple[str, ...] = ()
    if cut:
        kept = [(p, r) for p, r in history if p.index in executed or p.index in carried]
        arrived = plan.arrived_keys  # a resume looks a call up by the key it arrives with
        finished = tuple((p.call_id, FinishedCall(arrived.get(p.index, p.key), r)) for p, r in kept)
    elif carried:
        consumed = tuple(plan.calls[i].call_id for i in carried)
    return CommitEffects(  # field by field
        tuple(results),
        history,
        loaded,
        spent,
        invalidated,
        tuple(remember.items()) if remember else (),
        tuple(cache_writes) if cache_writes else (),
        events,
        finished,
        consumed,
        tuple(errors.values()) if errors else (),
    )


def _count(errors: dict[str, ErrorRecord], record: ErrorRecord) -> None:
    """One record per signature, counting repeats; at most MAX_ERRORS_PER_BATCH of them."""
    seen = errors.get(record.signature)
    if seen is not None:
        last = max(seen.last_seen, record.last_seen)
        errors[record.signature] = attrs.evolve(seen, count=seen.count + 1, last_seen=last)
    elif len(errors) < MAX_ERRORS_PER_BATCH:
        errors[record.signature] = record


def land(effects: CommitEffects, state: PlannerState, history: History, *, run_id: int, round: int) -> None:
    """Apply the effects that live in the session's memory: history rows, schemas loaded,
    approvals spent, then the run's dedupe map (invalidations first, then what to remember).
    No await, so nothing can cut it short halfway."""
    history.add_many(run_id, round, effects.history)
    if effects.loaded:
        state.loaded.update(effects.loaded)
    if effects.spent_approvals:
        state.spent_approvals.update(effects.spent_approvals)
    if effects.invalidations:
        forget_overlapping(state.dedupe, effects.invalidations)
    if effects.remember:
        state.dedupe.update(effects.remember)
    if effects.finished:
        state.finished.update(effects.finished)
    if effects.consumed:
        for call_id in effects.consumed:
            state.finished.pop(call_id, None)
