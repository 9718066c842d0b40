"""A session's state as bytes a `SessionStore` keeps, and back: pure functions over values.

What a snapshot holds is what the next batch needs on another worker: the run and round,
the counters, mode and core tools, the loaded schemas, the run's dedupe map, spent
approvals, the finished results of a cut batch (and the calls a dead worker left
started), the history (as bounded as the session bounds it), the JSON values of
`session.state`, and the recording's chain position. JSON via orjson, with a format
number; `version` counts the saves, so a worker knows whether what it holds is older.

No secret is kept in clear, as none is recorded (`_credentials` says what counts as one):
the history's arguments are redacted as a recording redacts a call's; a history row's
result has the secrets of its batch's calls replaced by their markers, and a result of
the dedupe map or of a cut batch those of the newest run's kept rows (a cut batch's own
calls are in no row: a secret only they carry is not known here). A session restored
from a snapshot holds those redacted forms, as a replayed recording does.

Nothing here touches a store, the event loop, the disk or the clock.
"""

from __future__ import annotations

import collections
import json
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import orjson

from ._credentials import redact_call_arguments, redact_text
from ._history import History
from ._plan import DedupeEntry, FinishedCall
from ._results import redacted_json, shown
from ._types import ToolResult

__all__ = [
    "SNAPSHOT_FORMAT",
    "ChainPosition",
    "HistoryState",
    "RowCache",
    "SessionSnapshot",
    "decode_newer",
    "decode_snapshot",
    "encode_snapshot",
    "fill_history",
    "history_state",
    "json_values",
]

log = logging.getLogger("threepass.session")

SNAPSHOT_FORMAT = 1

_Row = tuple[int, int, int, str, str, Any, ToolResult]
_OPTIONS = orjson.OPT_NON_STR_KEYS
# how every snapshot `encode_snapshot` writes begins (orjson keeps the keys' order): a
# worker that holds this version already needs nothing more of a long history's bytes
_HEAD = re.compile(rb'\{"format":(\d{1,9}),"version":(\d{1,18}),')


@attrs.frozen
class ChainPosition:
    """Where a session's recording stands: the last record's `seq`, the hash of its line,
    and the run it belongs to (a recording that continues in a new file starts there)."""

    seq: int
    prev: str
    run: int


@attrs.frozen
class HistoryState:
    """A History's kept rows and its counts over every committed call."""

    rows: tuple[_Row | orjson.Fragment, ...] = ()
    """Each row as History keeps it, or already encoded (`RowCache`)."""
    calls: int = 0
    deduped: int = 0
    cached: int = 0
    by_status: Mapping[str, int] = attrs.field(factory=dict)
    secrets: frozenset[str] = attrs.field(default=frozenset(), eq=False, repr=False)
    """What the arguments of the newest run's rows hid (`RowCache` knows it of rows it
    encoded): cleared from the other results a snapshot keeps. Never encoded."""


@attrs.frozen
class SessionSnapshot:
    """One session's state at the end of a batch (or at its interrupt)."""

    version: int
    session_id: str
    run_id: int
    round: int
    rounds: int
    executed: int
    mode: str
    core: tuple[str, ...] = ()
    loaded: frozenset[str] = frozenset()
    dedupe: tuple[tuple[str, DedupeEntry], ...] = ()
    spent_approvals: frozenset[str] = frozenset()
    finished: tuple[tuple[str, FinishedCall], ...] = ()
    history: HistoryState = HistoryState()
    state: Mapping[str, Any] = attrs.field(factory=dict)
    chain: ChainPosition | None = None


def json_values(state: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The entries of `state` that JSON holds exactly (they read back equal), and the keys
    of the others, which stay with the worker."""
    kept: dict[str, Any] = {}
    skipped: list[str] = []
    for key, value in state.items():
        try:
            same = isinstance(key, str) and orjson.loads(orjson.dumps(value)) == value
        except (TypeError, ValueError, RecursionError):
            same = False
        if same:
            kept[key] = value
        else:
            skipped.append(shown(key))
    return kept, tuple(skipped)


class RowCache:
    """The encoded rows of one History, kept between saves: a row is encoded once, when
    it is new, so that a save costs what the batch added, not the whole history."""

    def __init__(self) -> None:
        self._rows: collections.deque[orjson.Fragment] = collections.deque()
        self._calls = -1  # `History.calls` when the rows were last brought up to date
        self._run = -1  # the run of the newest row encoded
        self.secrets: set[str] = set()
        """What the arguments of that run's rows hid (a run's dedupe map holds its results)."""

    def forget(self) -> None:
        """The History was replaced wholesale (restored): encode every row again."""
        self._calls = -1

    def rows(self, history: History) -> tuple[orjson.Fragment, ...]:
        kept = history._rows
        new = history.calls - self._calls
        if self._calls < 0 or new < 0 or self._rows.maxlen != kept.maxlen:
            self._rows = collections.deque(maxlen=kept.maxlen)
            new = len(kept)
        if new:
            fresh = list(kept)[-new:] if new < len(kept) else list(kept)
            for row, found in _redacted_rows(fresh):
                if row[0] != self._run:
                    self._run, self.secrets = row[0], set()
                self.secrets.update(found)
                self._rows.append(_encoded_row(row))
        self._calls = history.calls
        return tuple(self._rows)


def _redacted_result(result: ToolResult, secrets: Iterable[str]) -> ToolResult:
    """`result` with each secret its content echoes replaced by its marker (`redact_text`)."""
    content = redact_text(result.content, secrets)
    return result if content == result.content else attrs.evolve(result, content=content)


def _redacted_rows(rows: Iterable[_Row]) -> list[tuple[_Row, frozenset[str]]]:
    """Each row with its arguments redacted and its result cleared of the secrets of its
    batch (its run and round), as a recording clears a batch's results of every secret its
    calls hide; with the secrets its own arguments hid."""
    redacted: list[tuple[_Row, frozenset[str]]] = []
    by_batch: dict[tuple[int, int], set[str]] = {}
    for row in rows:
        args, found = redact_call_arguments(row[5])
        if found:
            by_batch.setdefault((row[0], row[1]), set()).update(found)
        redacted.append(((*row[:5], args, row[6]), found))
    if not by_batch:
        return redacted
    return [
        ((*row[:6], _redacted_result(row[6], by_batch.get((row[0], row[1]), ()))), found)
        for row, found in redacted
    ]


def _encoded_row(row: _Row) -> orjson.Fragment:
    """One history row as JSON; text orjson refuses (a lone surrogate, in arguments as sent
    that were refused for it, say) is written by json, escaped, and read back by json."""
    values = [*row[:6], row[6].to_json()]
    try:
        return orjson.Fragment(orjson.dumps(values, default=_plain, option=_OPTIONS))
    except TypeError:  # orjson.JSONEncodeError is one
        return orjson.Fragment(json.dumps(values, default=_plain).encode())


def history_state(history: History, cache: RowCache | None = None) -> HistoryState:
    """What a snapshot keeps of `history` (the rows it holds: as many as its limit allows),
    encoded (and redacted) through `cache` if given, else when the snapshot is."""
    rows = tuple(history._rows) if cache is None else cache.rows(history)
    secrets = frozenset() if cache is None else frozenset(cache.secrets)  # known once `rows` ran
    return HistoryState(
        rows, history.calls, history.deduped, history.cached, dict(history.by_status), secrets
    )


def fill_history(history: History, state: HistoryState) -> None:
    """Make `history` hold `state`'s rows (the newest its limit keeps) and counts, in place:
    whoever holds the session's History sees the restored one."""
    history._rows.clear()
    history._rows.extend(state.rows)
    history.calls, history.deduped, history.cached = state.calls, state.deduped, state.cached
    history.by_status.clear()
    history.by_status.update(state.by_status)


def _result(data: Any) -> ToolResult:
    if not isinstance(data, Mapping):
        raise ValueError(f"a stored result is not an object: {shown(data)}")
    return ToolResult.from_json(data)


def _strings(values: Any) -> list[str]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"expected a list of strings, got {shown(values)}")
    return values


def _plain(value: Any) -> Any:
    """What orjson cannot write (arguments made in code, say), as its repr."""
    return shown(value, 10_000)


def _redacted_history(h: HistoryState) -> tuple[list[orjson.Fragment], set[str]]:
    """`h`'s rows encoded, those not encoded yet redacted first (`_redacted_rows`), and the
    secrets of its newest run's rows: the ones `RowCache` kept, and those found here."""
    secrets = set(h.secrets)
    plain = [row for row in h.rows if not isinstance(row, orjson.Fragment)]
    if not plain:
        return [row for row in h.rows if isinstance(row, orjson.Fragment)], secrets
    redacted = iter(_redacted_rows(plain))
    newest_run = plain[-1][0]
    rows: list[orjson.Fragment] = []
    for row in h.rows:
        if isinstance(row, orjson.Fragment):
            rows.append(row)
            continue
        clean, found = next(redacted)
        if clean[0] == newest_run:
            secrets.update(found)
        rows.append(_encoded_row(clean))
    return rows, secrets


def encode_snapshot(snapshot: SessionSnapshot) -> bytes:
    """The snapshot as one JSON document, its credentials redacted (the module says how)."""
    h = snapshot.history
    chain = snapshot.chain
    rows, secrets = _redacted_history(h)
    document = {
        "format": SNAPSHOT_FORMAT,
        "version": snapshot.version,
        "session": snapshot.session_id,
        "run": snapshot.run_id,
        "round": snapshot.round,
        "rounds": snapshot.rounds,
        "executed": snapshot.executed,
        "mode": snapshot.mode,
        "core": list(snapshot.core),
        "loaded": sorted(snapshot.loaded),
        "dedupe": [[key, redacted_json(e.result, secrets), sorted(e.reads)] for key, e in snapshot.dedupe],
        "spent": sorted(snapshot.spent_approvals),
        "finished": [[call_id, f.key, redacted_json(f.result, secrets)] for call_id, f in snapshot.finished],
        "history": {
            "calls": h.calls,
            "deduped": h.deduped,
            "cached": h.cached,
            "by_status": dict(h.by_status),
            "rows": rows,
        },
        "state": dict(snapshot.state),
        "chain": None if chain is None else {"seq": chain.seq, "prev": chain.prev, "run": chain.run},
    }
    return orjson.dumps(document, default=_plain, option=_OPTIONS)


def decode_snapshot(data: bytes) -> SessionSnapshot:
    """`encode_snapshot`'s bytes back as a snapshot; ValueError for anything else (another
    format, a document cut short or edited into another shape)."""
    snapshot = decode_newer(data, -1)
    assert snapshot is not None
    return snapshot


def decode_newer(data: bytes, version: int) -> SessionSnapshot | None:
    """`decode_snapshot`, or None (and no results built) when the snapshot's version is not
    above `version`: what a worker already holding that version needs."""
    head = _HEAD.match(data, 0, 64)
    if head is not None and int(head[1]) == SNAPSHOT_FORMAT and int(head[2]) <= version:
        return None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        try:  # a lone surrogate, escaped, which json reads and orjson does not (_encoded_row)
            doc = json.loads(data)
        except ValueError:
            raise ValueError(f"a session snapshot that is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"session snapshot format {found!r}, expected {SNAPSHOT_FORMAT}")
    try:
        if int(doc["version"]) <= version:
            return None
        h = doc["history"]
        rows: Iterable[Any] = h["rows"]
        chain = doc["chain"]
        state = doc["state"]
        if not isinstance(state, dict):
            raise ValueError(f"its state is not an object: {shown(state)}")
        return SessionSnapshot(
            version=int(doc["version"]),
            session_id=str(doc["session"]),
            run_id=int(doc["run"]),
            round=int(doc["round"]),
            rounds=int(doc["rounds"]),
            executed=int(doc["executed"]),
            mode=str(doc["mode"]),
            core=tuple(_strings(doc["core"])),
            loaded=frozenset(_strings(doc["loaded"])),
            dedupe=tuple(
                (str(key), DedupeEntry(_result(result), frozenset(_strings(reads))))
                for key, result, reads in doc["dedupe"]
            ),
            spent_approvals=frozenset(_strings(doc["spent"])),
            finished=tuple(
                (str(call_id), FinishedCall(None if key is None else str(key), _result(result)))
                for call_id, key, result in doc["finished"]
            ),
            history=HistoryState(
                tuple(
                    (int(run), int(round_), int(i), str(cid), str(name), args, _result(r))
                    for run, round_, i, cid, name, args, r in rows
                ),
                int(h["calls"]),
                int(h["deduped"]),
                int(h["cached"]),
                {str(k): int(v) for k, v in h["by_status"].items()},
            ),
            state=state,
            chain=None
            if chain is None
            else ChainPosition(int(chain["seq"]), str(chain["prev"]), int(chain["run"])),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"a session snapshot of the wrong shape: {shown(exc)}") from exc
