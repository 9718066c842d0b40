"""A session's history: entries made when read, the newest kept, counts over every call."""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher import Dispatcher, HistoryEntry, Status, ToolCall
from dispatcher._history import DEFAULT_HISTORY_LIMIT, History

from ._fakes import Counter, fake_registry, openai_call


def _dispatcher() -> tuple[Dispatcher, Counter]:
    counter = Counter()
    return Dispatcher(fake_registry(counter)), counter


def _echoes(tag: str, n: int) -> list[dict[str, Any]]:
    return [openai_call(f"{tag}{i}", "echo", {"text": f"{tag}{i}"}) for i in range(n)]


async def test_history_entries_describe_the_call_as_it_ran() -> None:
    """Each entry carries the call as it ran (id, tool, parsed arguments) and its result."""
    d, _ = _dispatcher()
    s = d.session("h", mode="direct")
    results = await s.dispatch([*_echoes("a", 2), openai_call("x", "echo", {"text": "a0"})])
    entries = list(s.history)
    assert [(e.call_id, e.name, dict(e.args)) for e in entries] == [
        ("a0", "echo", {"text": "a0"}),
        ("a1", "echo", {"text": "a1"}),
        ("x", "echo", {"text": "a0"}),
    ]
    assert all(isinstance(e, HistoryEntry) for e in entries)
    assert [e.result for e in entries] == results
    assert [e.deduped for e in entries] == [False, False, True]
    assert entries[0].call == ToolCall(id="a0", name="echo", arguments={"text": "a0"})
    assert (s.history[-1].call_id, [e.call_id for e in s.history[1:]]) == ("x", ["a1", "x"])


async def test_history_keeps_the_newest_calls_up_to_its_limit() -> None:
    """With a limit of 3, five calls leave the last three, oldest first."""
    d, _ = _dispatcher()
    s = d.session("h", mode="direct", history_limit=3)
    await s.dispatch(_echoes("a", 5))
    assert [e.call_id for e in s.history] == ["a2", "a3", "a4"]
    assert len(s.history) == 3
    assert [e.call_id for e in s.tool_history("echo")] == ["a2", "a3", "a4"]


async def test_statistics_count_every_call_the_limit_dropped() -> None:
    """Session statistics count every committed call, not only the ones history kept."""
    d, counter = _dispatcher()
    s = d.session("h", mode="direct", history_limit=2)
    await s.dispatch(
        [*_echoes("a", 4), openai_call("dup", "echo", {"text": "a0"}), openai_call("n", "nope", {})]
    )
    stats = s.statistics()
    assert (stats.calls, stats.deduped, stats.executed) == (6, 1, 4)
    assert stats.by_status == {"ok": 5, "rejected": 1}
    assert len(counter.runs) == 4 and len(s.history) == 2


async def test_a_limit_of_none_keeps_everything() -> None:
    """history_limit=None keeps every call."""
    d, _ = _dispatcher()
    s = d.session("h", mode="direct", history_limit=None)
    for r in range(3):
        s.new_run()
        await s.dispatch(_echoes(f"r{r}_", 4))
    assert len(s.history) == 12 and s.history.limit is None


async def test_history_limit_zero_keeps_nothing_and_still_counts() -> None:
    """A limit of 0 keeps no entries; the counts still grow."""
    d, _ = _dispatcher()
    s = d.session("h", mode="direct", history_limit=0)
    await s.dispatch(_echoes("a", 3))
    assert list(s.history) == [] and s.statistics().calls == 3


def test_the_default_limit_is_generous() -> None:
    """A session keeps 10,000 calls unless told otherwise."""
    assert History().limit == DEFAULT_HISTORY_LIMIT == 10_000


@pytest.mark.parametrize("limit", [-1, -100])
def test_a_negative_limit_is_refused(limit: int) -> None:
    """A negative history limit is a ValueError that shows the value."""
    with pytest.raises(ValueError, match=str(limit)):
        History(limit)


async def test_failed_calls_are_kept_with_their_status() -> None:
    """A rejected call is in the history with its status and the failure content."""
    d, _ = _dispatcher()
    s = d.session("h", mode="direct")
    await s.dispatch([openai_call("n", "nope", {})])
    (entry,) = s.history
    assert entry.status is Status.rejected and "Tool not found: nope" in entry.content


async def test_reading_the_history_while_a_batch_commits() -> None:
    """A reader walking the history while another batch commits sees a consistent list."""
    d, _ = _dispatcher()
    s = d.session("h", mode="direct", history_limit=5)
    await s.dispatch(_echoes("a", 5))
    walk = iter(s.history)
    first = next(walk)
    await s.dispatch(_echoes("b", 3))  # drops a0..a2 while the walk is under way
    assert [first.call_id, *(e.call_id for e in walk)] == ["a0", "a1", "a2", "a3", "a4"]
    assert [e.call_id for e in s.history] == ["a3", "a4", "b0", "b1", "b2"]
