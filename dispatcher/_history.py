"""`History`: what a session keeps of its committed calls, for the model and for people.

Pass 3 adds one row per committed call; readers see `HistoryEntry` values, made when
read. A row holds the call's parts and its result by reference: committing a call
copies nothing, and a session that only dispatches never builds an entry. The newest
`limit` rows are kept (None keeps all); the counts behind `Session.statistics()` cover
every call ever committed, whatever the limit dropped.

Nothing here runs a tool, touches trio, the disk or the clock.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from ._types import HistoryEntry, ToolCall, ToolResult

if TYPE_CHECKING:
    from ._plan import PlannedCall

__all__ = ["DEFAULT_HISTORY_LIMIT", "History"]

DEFAULT_HISTORY_LIMIT = 10_000
"""Rows a session keeps unless told otherwise: far more than a conversation makes, and a
bound on what a session that runs for days holds (a row keeps its result's content)."""

# run id, round, index in its batch, call id, tool name, arguments, result: only what an
# entry shows (the plan itself holds more, such as its keys, and would keep it alive). The
# arguments are kept as the model sent them, as the canonical JSON the key was made from:
# a handler that changes its arguments changes nothing here, and nothing is copied.
_Row = tuple[int, int, int, str, str, Mapping[str, Any] | str, ToolResult]


def _entry(row: _Row) -> HistoryEntry:
    run_id, round_, index, call_id, name, args, result = row
    arguments = json.loads(args) if isinstance(args, str) else args  # a fresh copy per reader
    call = ToolCall(id=call_id, name=name, arguments=arguments)
    return HistoryEntry(run_id=run_id, round=round_, index=index, call=call, result=result)


class History(Sequence[HistoryEntry]):
    """A session's committed calls, oldest first: a read-only sequence of `HistoryEntry`."""

    def __init__(self, limit: int | None = DEFAULT_HISTORY_LIMIT) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"history limit must be None or at least 0, got {limit!r}")
        self.limit = limit
        self._rows: collections.deque[_Row] = collections.deque(maxlen=limit)
        self.calls = 0
        self.deduped = 0
        self.cached = 0
        self.by_status: dict[str, int] = {}

    def add_many(self, run_id: int, round: int, committed: Sequence[tuple[PlannedCall, ToolResult]]) -> None:
        """Pass 3: a batch's committed calls, in call order."""
        append = self._rows.append
        counts = self.by_status
        deduped = cached = 0
        for planned, result in committed:
            # the fields read at once (a named tuple's field read by name is the generic lookup)
            index, call_id, name, args, _, _, _, _, _, _, _, _, _, sent = planned
            append((run_id, round, index, call_id, name, args if sent is None else sent, result))
            deduped += result.deduped
            cached += result.cached
            status = result.status  # a StrEnum: the member is its value as a key, read faster
            counts[status] = counts.get(status, 0) + 1
        self.calls += len(committed)
        self.deduped += deduped
        self.cached += cached

    def of_tool(self, name: str) -> list[HistoryEntry]:
        """The kept calls of one tool (as run: after `run_tool` and rewriters), oldest first."""
        return [_entry(row) for row in list(self._rows) if row[4] == name]

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> HistoryEntry: ...
    @overload
    def __getitem__(self, index: slice) -> list[HistoryEntry]: ...
    def __getitem__(self, index: int | slice) -> HistoryEntry | list[HistoryEntry]:
        if isinstance(index, slice):
            return [_entry(row) for row in list(self._rows)[index]]
        return _entry(self._rows[index])

    def __iter__(self) -> Iterator[HistoryEntry]:
        # over a copy (taken at once, under the GIL): a dispatch that commits while a
        # reader walks the history, from a handler's thread say, must not break the walk
        return (_entry(row) for row in list(self._rows))

    def __repr__(self) -> str:
        return f"<History of {len(self._rows)} call(s), {self.calls} committed in all>"
