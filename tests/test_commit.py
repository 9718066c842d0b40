"""Pass 3, commit: a plan from the planner plus the results pass 2 would have produced."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest

from cache import CacheEntry, CachePolicy
from dispatcher import Allow, Registry, Status, Tool, ToolCall, ToolResult, ToolResultEvent
from dispatcher._commit import CommitEffects, commit, land
from dispatcher._core_tools import core_registry
from dispatcher._history import History
from dispatcher._plan import (
    DEFAULT_MAX_ARGUMENT_BYTES,
    DedupeEntry,
    Plan,
    PlannerState,
    new_planner,
)
from dispatcher._results import DEFAULT_MAX_OUTPUT_BYTES, failure_result

from ._fakes import done, file_at_path, path_schema

REGISTRY = Registry(
    [
        Tool(
            name="read_file",
            description="Read.",
            handler=done,
            parameters=path_schema(),
            deferred=False,
            reads=file_at_path,
        ),
        Tool(
            name="write_file",
            description="Write.",
            handler=done,
            parameters=path_schema(),
            deferred=False,
            writes=file_at_path,
        ),
        Tool(
            name="run_command",
            description="Unknown effects on files.",
            handler=done,
            parameters={"type": "object", "properties": {"cmd": {"type": "string"}}},
            deferred=False,
            writes=lambda a: {"file:/"},
        ),
        Tool(
            name="fetch_page",
            description="Fetch.",
            handler=done,
            parameters={"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
            deferred=False,
            concurrent=True,
            cache=CachePolicy(ttl=60),
        ),
        Tool(
            name="secret_tool",
            description="Deferred.",
            handler=done,
            parameters={"type": "object", "properties": {"x": {"type": "integer"}}},
        ),
        Tool(
            name="danger",
            description="Gated.",
            handler=done,
            parameters={"type": "object", "properties": {"n": {"type": "integer"}}},
            deferred=False,
            confirm=True,
        ),
    ]
)
CORE = core_registry()


class RecordingCache:
    """Stands for a store: records what the session would ask of it (nothing is kept)."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, str, float, frozenset[str]]] = []
        self.invalidated: list[frozenset[str]] = []

    def get_many_now(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        return {}


class Harness:
    """One session's bookkeeping, planned and committed as Session._dispatch does it."""

    def __init__(self, cache: RecordingCache | None = None, state: PlannerState | None = None) -> None:
        self.cache = cache
        self.state = state if state is not None else PlannerState()
        self.history = History()

    def plan(self, calls: list[ToolCall], decisions: Mapping[str, Any] | None = None) -> Plan:
        planner = new_planner(
            registry=REGISTRY,
            core=CORE,
            state=self.state,
            has_cache=self.cache is not None,
            session_id="s1",
            mode="deferred",
            all_loaded=False,
            max_argument_bytes=DEFAULT_MAX_ARGUMENT_BYTES,
            max_output_bytes=DEFAULT_MAX_OUTPUT_BYTES,
        )
        drafts = planner.parse(calls)
        wanted = planner.lookups(drafts)
        planner.resolve(drafts, self.cache.get_many_now(wanted) if self.cache is not None else {})
        for d in planner.gated(drafts):
            decision = planner.take_decision(d, decisions)
            if decision is not None:
                planner.allow(d, decision)  # type: ignore[arg-type]
        return planner.finish(drafts)

    def commit(
        self, plan: Plan, executed: Mapping[int, ToolResult], *, want_events: bool = False
    ) -> CommitEffects:
        """Pass 3, then what the session does with its effects: `land` them, and tell the
        store its invalidations, then its writes."""
        effects = commit(
            plan,
            executed,
            has_cache=self.cache is not None,
            run_id=3,
            round=2,
            session_id="s1",
            want_events=want_events,
        )
        land(effects, self.state, self.history, run_id=3, round=2)
        if self.cache is not None:
            if effects.invalidations:
                self.cache.invalidated.append(effects.invalidations)
            for w in effects.cache_writes:
                self.cache.sets.append((w.key, w.content, w.ttl, w.reads))
        return effects


def tc(name: str, args: dict[str, Any], call_id: str) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=args)


def ran(plan: Plan, index: int, content: str = "out", status: Status = Status.ok) -> ToolResult:
    """The result pass 2 would give the call at `index`."""
    call = plan.calls[index].call
    if status is Status.ok:
        return ToolResult(
            call_id=call.id,
            name=call.name,
            status=status,
            content=content,
            started=100.0 + index,
            duration=0.25,
        )
    return failure_result(call.id, call.name, status, content, started=100.0 + index, duration=0.25)


def run_all(plan: Plan, **contents: str) -> dict[int, ToolResult]:
    return {
        c.index: ran(plan, c.index, contents.get(c.call.id, f"out-{c.call.id}")) for c in plan.calls if c.runs
    }


def entry(content: str, *reads: str) -> DedupeEntry:
    return DedupeEntry(
        ToolResult(call_id="old", name="read_file", status=Status.ok, content=content), frozenset(reads)
    )


# -- results ---------------------------------------------------------------------------------


def test_results_are_in_call_order_with_ids() -> None:
    """One result per call, in call order, each with its call's id."""
    h = Harness()
    calls = [
        tc("read_file", {"path": "/b"}, "c1"),
        tc("nope", {}, "c2"),
        tc("read_file", {"path": "/a"}, "c3"),
    ]
    plan = h.plan(calls)
    executed = run_all(plan)
    out = h.commit(plan, dict(reversed(list(executed.items()))))  # finishing order does not matter
    assert [r.call_id if r else None for r in out.results] == ["c1", "c2", "c3"]
    assert [r.status if r else None for r in out.results] == [Status.ok, Status.rejected, Status.ok]
    assert out.results[0] is executed[0] and out.results[2] is executed[2]


def test_follower_gets_the_leader_result_under_its_own_id() -> None:
    """A follower gets the leader's result with its own call id, deduped, no timings."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/a"}, "c1"), tc("read_file", {"path": "/a"}, "c2")])
    assert plan.calls[1].leader == 0
    out = h.commit(plan, {0: ran(plan, 0, "A")})
    leader, follower = out.results
    assert leader is not None and follower is not None
    assert follower.call_id == "c2" and follower.content == "A" and follower.status is Status.ok
    assert follower.deduped is True and leader.deduped is False
    assert follower.started is None and follower.duration == 0.0


def test_follower_shares_a_failed_leader() -> None:
    """A follower shares its leader's result whatever it is, failures included."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/a"}, "c1"), tc("read_file", {"path": "/a"}, "c2")])
    out = h.commit(plan, {0: ran(plan, 0, "disk on fire", Status.failed)})
    follower = out.results[1]
    assert follower is not None
    assert follower.status is Status.failed and follower.call_id == "c2" and follower.deduped


def test_decided_outcomes_are_committed_as_planned() -> None:
    """A call decided in pass 1 commits its planned outcome."""
    h = Harness()
    plan = h.plan([tc("nope", {}, "c1")])
    out = h.commit(plan, {})
    assert out.results == (plan.calls[0].outcome,)
    assert len(h.history) == 1 and h.history[0].status is Status.rejected


# -- dedupe map -----------------------------------------------------------------------------------


def test_successes_land_in_the_dedupe_map_with_their_reads() -> None:
    """A success is remembered under its key, with what it read."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {0: ran(plan, 0, "A")})
    key = plan.calls[0].key
    assert key is not None
    remembered = h.state.dedupe[key]
    assert remembered.result.content == "A"
    assert remembered.reads == frozenset({"file:/w/a"})


def test_failures_are_not_remembered() -> None:
    """A failed call leaves nothing in the dedupe map."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {0: ran(plan, 0, "nope", Status.failed)})
    assert h.state.dedupe == {}


def test_remembered_success_is_served_next_round() -> None:
    """A success committed in one round is served deduped in the next."""
    h = Harness()
    first = h.plan([tc("read_file", {"path": "/w/a"}, "c1")])
    h.commit(first, {0: ran(first, 0, "A")})
    second = h.plan([tc("read_file", {"path": "/w/a"}, "c2")])
    outcome = second.calls[0].outcome
    assert outcome is not None and outcome.deduped and outcome.content == "A" and outcome.call_id == "c2"


def test_writers_are_not_remembered() -> None:
    """A successful write is not put in the dedupe map."""
    h = Harness()
    plan = h.plan([tc("write_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {0: ran(plan, 0)})
    assert h.state.dedupe == {}


# -- invalidation ----------------------------------------------------------------------------------


def _dedupe_with_reads() -> dict[str, DedupeEntry]:
    return {
        "same": entry("a", "file:/w/a"),
        "folder": entry("listing", "file:/w"),
        "below": entry("inner", "file:/w/a/b"),
        "sibling": entry("b", "file:/w/b"),
        "prefix": entry("ab", "file:/w/ab"),
        "web": entry("page", "url:https://a.test/"),
        "none": entry("pure"),
    }


def test_successful_write_drops_overlapping_dedupe_entries() -> None:
    """A successful write drops entries reading the same path, a folder above or below it."""
    h = Harness(cache=RecordingCache(), state=PlannerState(dedupe=_dedupe_with_reads()))
    plan = h.plan([tc("write_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {0: ran(plan, 0)})
    assert set(h.state.dedupe) == {"sibling", "prefix", "web", "none"}


def test_successful_write_invalidates_the_cache() -> None:
    """A successful write calls cache.invalidate with what it wrote."""
    cache = RecordingCache()
    h = Harness(cache=cache)
    plan = h.plan([tc("write_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {0: ran(plan, 0)})
    assert cache.invalidated == [frozenset({"file:/w/a"})]


def test_unknown_effects_drop_every_file_entry() -> None:
    """A write of "file:/" drops every file entry and keeps the others."""
    h = Harness(cache=RecordingCache(), state=PlannerState(dedupe=_dedupe_with_reads()))
    plan = h.plan([tc("run_command", {"cmd": "make"}, "c1")])
    h.commit(plan, {0: ran(plan, 0)})
    assert set(h.state.dedupe) == {"web", "none"}


def test_failed_write_does_not_invalidate() -> None:
    """A write that failed invalidates nothing."""
    cache = RecordingCache()
    h = Harness(cache=cache, state=PlannerState(dedupe=_dedupe_with_reads()))
    plan = h.plan([tc("write_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {0: ran(plan, 0, "disk full", Status.failed)})
    assert set(h.state.dedupe) == set(_dedupe_with_reads())
    assert cache.invalidated == []


def test_write_that_never_finished_does_not_invalidate() -> None:
    """A write missing from `executed` invalidates nothing."""
    cache = RecordingCache()
    h = Harness(cache=cache, state=PlannerState(dedupe=_dedupe_with_reads()))
    plan = h.plan([tc("write_file", {"path": "/w/a"}, "c1")])
    h.commit(plan, {})
    assert len(h.state.dedupe) == len(_dedupe_with_reads())
    assert cache.invalidated == []


def test_cacheable_success_is_written_with_the_tool_ttl() -> None:
    """A cacheable success is written to the cache under its cache key with the tool's ttl."""
    cache = RecordingCache()
    h = Harness(cache=cache)
    plan = h.plan([tc("fetch_page", {"url": "https://a.test/"}, "c1")])
    assert plan.calls[0].cacheable
    h.commit(plan, {0: ran(plan, 0, "<html>")})
    assert cache.sets == [(plan.calls[0].cache_key, "<html>", 60.0, frozenset())]


def test_failures_are_not_cached() -> None:
    """A failed cacheable call is not written to the cache."""
    cache = RecordingCache()
    h = Harness(cache=cache)
    plan = h.plan([tc("fetch_page", {"url": "https://a.test/"}, "c1")])
    h.commit(plan, {0: ran(plan, 0, "503", Status.failed)})
    assert cache.sets == []


def test_schema_required_loads_the_tool() -> None:
    """A schema_required outcome adds the tool to the loaded set; its next call runs."""
    h = Harness()
    plan = h.plan([tc("run_tool", {"name": "secret_tool", "args": {"x": 1}}, "c1")])
    assert plan.calls[0].loads_schema
    h.commit(plan, {})
    assert h.state.loaded == {"secret_tool"}
    again = h.plan([tc("run_tool", {"name": "secret_tool", "args": {"x": 1}}, "c2")])
    assert again.calls[0].runs


def test_spent_approval_is_recorded_when_the_call_ran() -> None:
    """An approval used by a call that ran is recorded as spent; an unused one is not."""
    h = Harness()
    plan = h.plan(
        [tc("danger", {"n": 1}, "c1"), tc("danger", {"n": 2}, "c2")], {"c1": Allow(), "c2": Allow()}
    )
    assert [c.spent_approval for c in plan.calls] == [True, True]
    h.commit(plan, {0: ran(plan, 0)})  # c2 never finished
    assert h.state.spent_approvals == {"c1"}


def test_history_gets_one_entry_per_committed_call() -> None:
    """history and tool_history get one entry per committed call, with its flags and timings."""
    h = Harness()
    plan = h.plan(
        [
            tc("read_file", {"path": "/a"}, "c1"),
            tc("read_file", {"path": "/a"}, "c2"),
            tc("nope", {}, "c3"),
        ]
    )
    h.commit(plan, {0: ran(plan, 0, "A")})
    assert [e.call_id for e in h.history] == ["c1", "c2", "c3"]
    first = h.history[0]
    assert (first.run_id, first.round, first.index) == (3, 2, 0)
    assert (first.call_id, first.name, dict(first.args)) == ("c1", "read_file", {"path": "/a"})
    assert (first.status, first.content, first.cached, first.deduped) == (Status.ok, "A", False, False)
    assert (first.started, first.duration) == (100.0, 0.25)
    assert first.result is h.history[0].result and first.call.arguments == {"path": "/a"}
    assert h.history[1].deduped is True
    assert [e.call_id for e in h.history.of_tool("read_file")] == ["c1", "c2"]
    assert [e.call_id for e in h.history.of_tool("nope")] == ["c3"]


def test_history_records_the_unwrapped_call() -> None:
    """History records the tool run_tool named, with its arguments."""
    h = Harness(state=PlannerState(loaded={"secret_tool"}))
    plan = h.plan([tc("run_tool", {"name": "secret_tool", "args": {"x": 4}}, "c1")])
    h.commit(plan, {0: ran(plan, 0)})
    assert (h.history[0].name, dict(h.history[0].args)) == ("secret_tool", {"x": 4})
    assert h.history.of_tool("run_tool") == []


def test_call_that_never_finished_yields_none() -> None:
    """A call missing from `executed` gives None, no history, and nothing remembered."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/a"}, "c1"), tc("read_file", {"path": "/b"}, "c2")])
    out = h.commit(plan, {1: ran(plan, 1)})
    assert out.results[0] is None
    assert out.results[1] is not None
    assert [e.call_id for e in h.history] == ["c2"]
    assert plan.calls[0].key not in h.state.dedupe


def test_follower_of_an_unfinished_leader_yields_none() -> None:
    """A follower whose leader never finished gives None too."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/a"}, "c1"), tc("read_file", {"path": "/a"}, "c2")])
    out = h.commit(plan, {})
    assert out.results == (None, None)
    assert len(h.history) == 0 and h.history.calls == 0


def test_events_only_when_wanted() -> None:
    """Events are built, in call order, only when want_events is true."""
    h = Harness()
    plan = h.plan(
        [tc("read_file", {"path": "/a"}, "c1"), tc("nope", {}, "c2"), tc("read_file", {"path": "/b"}, "c3")]
    )
    executed = {0: ran(plan, 0), 2: ran(plan, 2)}
    quiet = Harness().commit(plan, executed)
    assert quiet.events == ()
    loud = h.commit(plan, executed, want_events=True)
    assert [e.call.id for e in loud.events] == ["c1", "c2", "c3"]
    assert loud.events[1] == ToolResultEvent(
        session_id="s1", run_id=3, round=2, index=1, call=plan.calls[1].call, result=loud.results[1]
    )
    assert [e.result for e in loud.events] == list(loud.results)


def test_events_skip_calls_that_never_finished() -> None:
    """A call that never finished has no event."""
    h = Harness()
    plan = h.plan([tc("read_file", {"path": "/a"}, "c1"), tc("read_file", {"path": "/b"}, "c2")])
    out = h.commit(plan, {1: ran(plan, 1)}, want_events=True)
    assert [e.index for e in out.events] == [1]


def test_commit_outcome_is_frozen() -> None:
    """The commit outcome is a frozen value."""
    h = Harness()
    plan = h.plan([tc("nope", {}, "c1")])
    out = h.commit(plan, {})
    assert attrs.has(type(out))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        out.results = ()  # type: ignore[misc]
