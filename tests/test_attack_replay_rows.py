"""Attacks on replay's quick way for `rows` lines: a rows record handed out as read
(`_rows_formed`), its calls read straight from the rows (`_rows_calls`) and its results
served from them (`_BatchServer(rows=...)`), against the general way, every line read
whole (`_read_data`) as the batch record it stands for and every result compared field
by field. Whatever a file holds, the two must report the same, and raise the same."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import MemoryResultCache
from dispatcher import CachePolicy, Deny, Dispatcher, Registry, Tool, ToolCall
from dispatcher._recording import _batch_of_rows, _BatchServer, _replay, _rows_formed, _Stream, line_hash

from ._fakes import Counter, NothingHook, fake_registry, openai_call
from .test_plan import make_planner, run_pass1
from .test_recording import SECRETS, _echo_registry, _secret_request
from .test_recording_rows import _BROKEN_ROWS, _OTHER_ROWS, _broken, _registry, _session_batches
from .test_replay_stream import _edits, _gated_registry, _general_server, _replay_both

# --- the two ways ---------------------------------------------------------------------------

_SERVER_MADE = _BatchServer.__init__


class _Ways:
    """Replays of recordings both ways through dispatchers kept for a test (a registry is
    costly to make, and a replay starts from nothing whatever ran before): `same` asserts
    that the quick way reports, or raises, what the general way does, and counts the
    batches the quick way served from a rows record's rows as they are."""

    def __init__(
        self,
        registry: Callable[[], Registry],
        options: Callable[[], dict[str, Any]] | None = None,
        **dispatcher: Any,
    ) -> None:
        # `options`: a dispatcher's own options, made for each (a cache, say)
        self._quick = Dispatcher(registry(), **dispatcher, **(options() if options else {}))
        self._general = Dispatcher(registry(), **dispatcher, **(options() if options else {}))
        self.from_rows = 0  # batches served from rows as they are, over every replay
        self.last_from_rows: list[bool] = []  # per batch of the last quick replay

    @staticmethod
    async def _outcome(stream: _Stream, dispatcher: Dispatcher) -> tuple[Any, ...]:
        try:
            return ("report", await _replay(stream, dispatcher))
        except (Exception, KeyboardInterrupt) as exc:  # what either raises, by kind and message
            return ("raised", type(exc).__name__, str(exc))

    async def outcomes(self, data: bytes) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        made: list[bool] = []

        def spy(server: _BatchServer, *args: Any, **kwargs: Any) -> None:
            _SERVER_MADE(server, *args, **kwargs)
            made.append(server.rows is not None)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(_BatchServer, "__init__", spy)
            quick = await self._outcome(_Stream(data, "rec.jsonl"), self._quick)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(_BatchServer, "__init__", _general_server)
            general = await self._outcome(_Stream(data, "rec.jsonl", whole=True), self._general)
        self.last_from_rows = made
        self.from_rows += sum(made)
        return quick, general

    async def same(self, data: bytes, where: Any = "") -> Any:
        """The quick way's report (or what it raised), asserted to be the general way's."""
        quick, general = await self.outcomes(data)
        assert quick == general, (where, quick, general)
        # a dispatcher used on another loop raises so before replaying anything: no test
        assert quick[0] != "raised" or "belongs to the" not in quick[2], quick
        return quick[1] if quick[0] == "report" else quick


_KEPT_REGISTRIES: dict[Callable[[], Registry], tuple[Registry, Registry]] = {}


def _sync_same(data: bytes, registry: Callable[[], Registry]) -> Any:
    """`_Ways.same` of one recording on a loop of its own (for hypothesis): dispatchers
    made anew (one belongs to the loop it was first used on) of registries kept for
    `registry` across calls."""
    kept = _KEPT_REGISTRIES.get(registry)
    if kept is None:
        kept = _KEPT_REGISTRIES[registry] = (registry(), registry())
    made = iter(kept)
    ways = _Ways(lambda: next(made))

    async def run() -> Any:
        return await ways.same(data)

    return anyio.run(run, backend="trio")


# --- recordings and their lines ---------------------------------------------------------------


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")[:-1]


def _joined(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def _rechained(
    records: list[Any], *, written: Mapping[int, Callable[[dict[str, Any]], bytes]] | None = None
) -> bytes:
    """`records` one a line, each `prev` (where it has one) the hash of the line before;
    `written`: by index, how a record is written (json.dumps by default)."""
    out: list[bytes] = []
    for i, record in enumerate(records):
        if out and isinstance(record, dict) and "prev" in record:
            record["prev"] = line_hash(out[-1])
        write = written.get(i) if written is not None else None
        out.append(write(record) if write is not None else json.dumps(record).encode())
    return _joined(out)


def _records(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(data)]


_RESULT_FIELDS = ("status", "content", "retryable", "effect_uncertain", "cached", "deduped", "started")


def _as_rows(batch: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `rows` record a batch record would be (None: it holds what rows cannot: a
    decision, a call of another shape, a result of another id)."""
    if batch.get("decisions"):
        return None
    rows = []
    for call, plan, result in zip(batch["calls"], batch["plan"], batch["results"], strict=True):
        if set(call) != {"id", "name", "arguments"}:
            return None
        row = [call["id"], call["name"], call["arguments"], plan["key"], plan["how"]]
        if result is not None:
            if result["call_id"] != call["id"] or result["name"] != plan["name"]:
                return None
            row += [result[f] for f in _RESULT_FIELDS] + [result["duration"]]
        if plan["name"] != call["name"]:
            row.append(plan["name"])
        rows.append(row)
    fields = {k: batch[k] for k in ("run", "round", "all_loaded")}
    return {"type": "rows", **fields, "rows": rows, "control": batch["control"]} | {
        "seq": batch["seq"],
        "prev": batch["prev"],
    }


def _as_batch(rows: Mapping[str, Any]) -> dict[str, Any]:
    return _batch_of_rows(copy.deepcopy(dict(rows)))


async def _rows_recording(tmp_path: Path) -> bytes:
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    return path.read_bytes()


def _rows_lines(data: bytes) -> list[int]:
    """The numbers (1-based) of the rows lines of `data`."""
    return [n for n, record in enumerate(_records(data), 1) if record.get("type") == "rows"]


def _deferred_registry() -> Registry:
    """fake_registry's tools and `hidden`, a deferred tool find_tools loads."""

    async def hidden(args: Mapping[str, Any], ctx: Any) -> str:
        return "found " + args["text"]

    registry = fake_registry(Counter(), {})
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    registry.add(Tool("hidden", "A hidden searcher.", hidden, schema))
    return registry


async def _deferred_recording(tmp_path: Path) -> bytes:
    """A deferred session: find_tools loading `hidden`, `hidden` called directly and through
    run_tool, run_tool of a direct tool, find_tools by free text."""
    path = tmp_path / "deferred.jsonl"
    s = Dispatcher(_deferred_registry()).session("deferred", mode="deferred", record=path)
    await s.dispatch([openai_call("1", "find_tools", {"query": "select:hidden"})])
    await s.dispatch(
        [
            openai_call("2", "hidden", {"text": "a"}),
            openai_call("3", "run_tool", {"name": "hidden", "args": {"text": "b"}}),
            openai_call("4", "run_tool", {"name": "echo", "args": {"text": "b"}}),
        ]
    )
    await s.dispatch([openai_call("5", "find_tools", {"query": "hidden searcher"})])
    await s.dispatch(
        [
            openai_call("6", "run_tool", {"name": "hidden", "args": {"text": "c"}}),
            openai_call("7", "run_tool", {"name": "hidden", "args": {"text": "c"}}),
        ]
    )
    s.close()
    return path.read_bytes()


def _every_line_rows(data: bytes) -> list[dict[str, Any]]:
    """The records of `data`, every batch line that can be a rows line made one."""
    records = _records(data)
    for i, record in enumerate(records):
        if record.get("type") == "batch":
            rows = _as_rows(record)
            if rows is not None:
                records[i] = rows
    return records


# values of every JSON kind, and some only json (not orjson) reads as they were written:
# NaN, infinities, a lone surrogate, an integer past 64 bits (orjson: a float)
_ODD: list[Any] = [
    0,
    1,
    True,
    False,
    None,
    "",
    "ran",
    "failed",
    1.5,
    2,
    -0.0,
    1e308,
    2**63,
    2**64,
    float("nan"),
    float("inf"),
    [],
    ["ok"],
    {"a": 1},
    "\ud800",
]


# --- rows values of unexpected types ------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_every_row_value_set_to_every_kind_of_value_replays_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each value of the rows of the first, a deduped, the cut and the last rows line (and
    a planned name added), set to every kind of JSON value (flags as 0/1, a duration
    whole, huge, NaN or past 64 bits, a start as text), the chain made again: the same
    report both ways; some edits are served from the rows as they are, some are not."""
    data = await _rows_recording(tmp_path)
    records = _records(data)
    lines = _rows_lines(data)
    assert lines == [2, 3, 4, 5, 8, 9]
    ways = _Ways(_registry)
    served_as_rows: dict[tuple[int, int], set[bool]] = {}
    fields: set[str] = set()
    for number, which in ((2, None), (5, [1]), (8, None)):
        rows = records[number - 1]["rows"]
        for r in which if which is not None else range(len(rows)):
            for column in range(len(rows[r]) + 1):
                for value in _ODD:
                    edited = copy.deepcopy(records)
                    row = edited[number - 1]["rows"][r]
                    if column == len(row):
                        row.append(value)  # the name it was planned under
                    else:
                        row[column] = value
                    report = await ways.same(_rechained(edited), (number, r, column, value))
                    assert not isinstance(report, tuple), report  # nothing raised
                    made = ways.last_from_rows
                    served = len(made) > number - 2 and made[number - 2]
                    served_as_rows.setdefault((column, type(value) is bool), set()).add(served)
                    if report.divergence is not None:
                        fields.add(report.divergence.field)
    # flags as booleans, a start of any kind: read as the rows they are; flags as numbers: not
    assert served_as_rows[(7, True)] == {True}, served_as_rows
    assert served_as_rows[(11, False)] == {True}, served_as_rows
    assert True in served_as_rows[(12, False)] and False in served_as_rows[(12, False)]
    assert False in served_as_rows[(7, False)]
    assert {"status", "content", "name", "how", "key"} <= fields, fields


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_other_and_broken_rows_of_the_rows_tests_replay_the_same_on_every_rows_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_OTHER_ROWS` and `_BROKEN_ROWS` (test_recording_rows) on every rows line, also the
    deduped and the cut ones, with the chain made again and without: the same both ways."""
    data = await _rows_recording(tmp_path)
    ways = _Ways(_registry)
    problems = 0
    for number in _rows_lines(data):
        for name, change in [*_OTHER_ROWS, *((n, c) for n, c, _ in _BROKEN_ROWS)]:
            for rechain in (True, False):
                try:
                    broken = _broken(data, number, change, rechain)
                except IndexError:  # an edit of a value an unanswered row does not have
                    continue
                report = await ways.same(broken, (name, number, rechain))
                problems += report.problem is not None
    assert problems > 0 and ways.from_rows > 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize(
    "literal",
    [
        b"NaN",
        b"Infinity",
        b"-Infinity",
        b"18446744073709551616",
        b"-18446744073709551617",
        b"1e400",
        b"1E2",
        b"0.0e0",
        b"-0",
        b"100000000000000000000000000000000000000.5",
    ],
)
async def test_a_number_only_json_reads_as_written_in_a_rows_line_replays_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, literal: bytes
) -> None:
    """A duration, a start or a flag written as a literal orjson refuses or reads otherwise
    than json (NaN, infinities, integers past 64 bits, exponents), in the bytes of a rows
    line, the chain made again: the same report both ways."""
    data = await _rows_recording(tmp_path)
    lines = _lines(data)
    ways = _Ways(_registry)
    record = json.loads(lines[1])
    outcomes = []
    for column in (7, 10, 11, 12):
        for row in range(len(record["rows"])):
            edited = copy.deepcopy(record)
            edited["rows"][row][column] = "@@"
            raw = json.dumps(edited).encode().replace(b'"@@"', literal)
            again = [*lines[:1], raw]
            for later in lines[2:]:
                rec = json.loads(later)
                rec["prev"] = line_hash(again[-1])
                again.append(json.dumps(rec).encode())
            report = await ways.same(_joined(again), (column, row))
            outcomes.append((report.batches, report.problem is None, report.divergence is None))
    assert outcomes and all(batches >= 1 for batches, _, _ in outcomes), outcomes


# --- the record around the rows --------------------------------------------------------------------


def _record_edits() -> list[tuple[str, Callable[[dict[str, Any]], Any]]]:
    def setting(field: str, value: Any) -> Callable[[dict[str, Any]], Any]:
        def change(record: dict[str, Any]) -> Any:
            record[field] = value
            return record

        return change

    def dropping(field: str) -> Callable[[dict[str, Any]], Any]:
        def change(record: dict[str, Any]) -> Any:
            record.pop(field, None)
            return record

        return change

    def ordered(order: Callable[[list[str]], list[str]]) -> Callable[[dict[str, Any]], Any]:
        def change(record: dict[str, Any]) -> Any:
            return {k: record[k] for k in order(list(record))}

        return change

    edits: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
    for field in ("run", "round", "all_loaded", "control", "seq", "prev", "rows", "type"):
        edits.append((f"no {field}", dropping(field)))
    for field, values in {
        "run": [2, 0, -1, 2**63, 2**64, 1.0, True, "1", None],
        "round": [0, 1.5, "1", None, [], 2**64],
        "all_loaded": [True, 1, "yes", [], None, 0.0],
        "control": [3, [], {}, True, "", "HookBlocked", "KeyboardInterrupt", "DispatchInterrupted", "cut"],
        "seq": [1.0, True, 2**64, "1"],
        "prev": [5, None, ""],
    }.items():
        edits += [(f"{field} {value!r}", setting(field, value)) for value in values]
    extras: dict[str, Any] = {
        "decisions": {"1": {"deny": "no"}, "2": {"answer": "yes"}},
        "calls": [],
        "plan": [{"name": "x", "key": None, "how": "ran"}],
        "results": [None],
        "edited": True,
        "meta": {"n": 2**64},
        "rows ": [],
    }
    edits += [(f"an extra {field!r}", setting(field, value)) for field, value in extras.items()]
    edits.append(("fields reversed", ordered(lambda keys: keys[::-1])))
    edits.append(("fields sorted", ordered(sorted)))
    edits.append(("rows first", ordered(lambda keys: ["rows"] + [k for k in keys if k != "rows"])))
    edits.append(("type last", ordered(lambda keys: [k for k in keys if k != "type"] + ["type"])))
    edits.append(("a batch type", setting("type", "batch")))
    edits.append(("a Rows type", setting("type", "Rows")))
    return edits


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rows_record_with_fields_added_missing_odd_or_reordered_replays_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fields around the rows (run, round, all_loaded, control, seq, prev, type) dropped,
    set to odd values, reordered, or joined by fields a batch record has (decisions, calls,
    plan, results) on the first, the cut and the last rows line, the chain made again:
    the same report both ways, among them clean replays served from the rows."""
    data = await _rows_recording(tmp_path)
    records = _records(data)
    ways = _Ways(_registry)
    clean = 0
    for number in (2, 5, 8, 9):
        for name, change in _record_edits():
            edited = copy.deepcopy(records)
            edited[number - 1] = change(edited[number - 1])
            report = await ways.same(_rechained(edited), (number, name))
            clean += report.ok
    assert clean > 0 and ways.from_rows > 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rows_line_with_fields_repeated_in_its_text_replays_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rows line whose text repeats a field (the last one read wins, in json and orjson
    alike: a second type, rows, seq or control), or is written with other spacing or
    escapes, the chain made again: the same report both ways."""
    data = await _rows_recording(tmp_path)
    ways = _Ways(_registry)
    tails = [
        b',"type":"batch"}',
        b',"type":"rows"}',
        b',"rows":[]}',
        b',"rows":null}',
        b',"control":"HookBlocked"}',
        b',"seq":99}',
        b',"run":1.0}',
        b',"decisions":{"7":{"deny":"x"}}}',
    ]

    def compact(record: dict[str, Any]) -> bytes:
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()

    writers: list[Callable[[dict[str, Any]], bytes]] = [
        lambda record: json.dumps(record, ensure_ascii=True).encode(),
        compact,
        lambda record: json.dumps(record, separators=(" , ", " : ")).encode(),
        lambda record: b"  " + compact(record) + b"\t",
        lambda record: json.dumps(record).encode().replace(b'"rows"', b'"\\u0072ows"'),
        *((lambda record, tail=tail: compact(record)[:-1] + tail) for tail in tails),
    ]
    for number in (2, 8):
        for k, write in enumerate(writers):
            report = await ways.same(_rechained(_records(data), written={number - 1: write}), (number, k))
            if k < 5:
                assert report.ok and report.batches == 8, (number, k, report)
    assert ways.from_rows > 0


# --- empty, cut and controlled batches --------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rows_record_of_no_rows_replays_the_same_whatever_its_control(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rows record whose rows list is empty, alone, first, in the middle or last, twice,
    with every kind of control: the same report both ways; with no control it replays
    clean, served from its (no) rows."""
    data = await _rows_recording(tmp_path)
    records = _records(data)
    ways = _Ways(_registry)
    for control in (None, "HookBlocked", "DispatchInterrupted", "KeyboardInterrupt", 3, [], "x"):
        empty = {"type": "rows", "run": 1, "round": 1, "all_loaded": False, "rows": [], "control": control}
        empty |= {"seq": 0, "prev": ""}
        for at in (1, 2, 5, len(records)):
            edited = [*copy.deepcopy(records[:at]), dict(empty), *copy.deepcopy(records[at:])]
            for i, record in enumerate(edited[1:], 1):
                record["seq"] = i
            report = await ways.same(_rechained(edited), (control, at))
            if control is None:
                assert report.ok and report.batches == len(records), report
        alone = _rechained([copy.deepcopy(records[0]), dict(empty, seq=1), dict(empty, seq=2)])
        report = await ways.same(alone, control)
        assert report.calls == 0
        if control is None:
            assert report.ok and report.batches == 2 and ways.last_from_rows == [True, True]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_cut_rows_batch_with_any_control_and_any_hows_replays_or_raises_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch a tool cut short (one call ran, one unfinished), its control set to every
    kind of value and its rows' hows to every kind the replay serves otherwise, and an
    uncut batch given a control and unfinished rows: the same report both ways, or the
    same exception (a replayed KeyboardInterrupt cut)."""
    data = await _rows_recording(tmp_path)
    records = _records(data)
    ways = _Ways(_registry)
    controls = [None, "DispatchInterrupted", "HookBlocked", "KeyboardInterrupt", "KeyboardInterrupt ", 3]
    controls += [[], {"type": "HookBlocked"}, True, "cut"]
    hows = ["ran", "unfinished", "stopped", "follow", "Unfinished"]
    seen: set[Any] = set()
    for number in (8, 2, 9):
        for control in controls:
            for first in hows:
                for second in hows[:3]:
                    edited = copy.deepcopy(records)
                    record = edited[number - 1]
                    record["control"] = control
                    rows = record["rows"]
                    rows[0][4] = first
                    if len(rows) > 1:
                        rows[1][4] = second
                    outcome = await ways.same(_rechained(edited), (number, control, first, second))
                    if isinstance(outcome, tuple):
                        seen.add(outcome[1])
                    elif outcome.divergence is not None:
                        seen.add(outcome.divergence.field)
    assert {"control", "how"} <= seen, seen


# --- calls, ids, names ----------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_duplicate_call_ids_in_a_rows_batch_replay_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches whose calls share an id (the same arguments, followed; others; three of
    them; an id also used in another batch), as recorded and with their rows swapped,
    hows and results exchanged: the same report both ways."""
    path = tmp_path / "dup.jsonl"
    s = Dispatcher(_registry()).session("dup", record=path)
    await s.dispatch([openai_call("1", "echo", {"text": "a"}), openai_call("1", "echo", {"text": "a"})])
    await s.dispatch([openai_call("1", "echo", {"text": "a"}), openai_call("1", "echo", {"text": "b"})])
    await s.dispatch([openai_call("2", "echo", {"text": "c"})] * 3)
    await s.dispatch([openai_call("", "echo", {"text": "d"}), openai_call("", "read", {"path": "a"})])
    s.close()
    data = path.read_bytes()
    ways = _Ways(_registry)
    report = await ways.same(data)
    assert report.ok and report.batches == 4, report
    records = _every_line_rows(data)
    assert all(r["type"] == "rows" for r in records[1:]), [r["type"] for r in records]
    fields: set[str] = set()
    for number in range(2, len(records) + 1):
        n = len(records[number - 1]["rows"])
        edits: list[Callable[[list[Any]], None]] = [
            lambda rows: rows.reverse(),
            lambda rows: rows.append(list(rows[0])),
            lambda rows: rows.pop(),
            lambda rows: [row.__setitem__(0, rows[0][0]) for row in rows],
        ]
        for i in range(n):
            for j in range(n):
                if i != j:
                    edits.append(lambda rows, i=i, j=j: rows.__setitem__(i, rows[i][:5] + rows[j][5:]))
                    edits.append(lambda rows, i=i, j=j: rows[i].__setitem__(4, rows[j][4]))
                    edits.append(lambda rows, i=i, j=j: rows[i].__setitem__(3, rows[j][3]))
        for k, change in enumerate(edits):
            edited = copy.deepcopy(records)
            change(edited[number - 1]["rows"])
            report = await ways.same(_rechained(edited), (number, k))
            if report.divergence is not None:
                fields.add(report.divergence.field)
    assert fields >= {"key", "how"}, fields
    assert ways.from_rows > 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_run_tool_and_find_tools_rows_replay_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deferred session's rows (find_tools, which replay runs for real; run_tool calls,
    planned under the tool they name, a 14-value row) with the planned name dropped,
    made its own, another tool's or no text, the find_tools content, status, key, how and
    query changed, and the find_tools batch lines made rows lines: the same report both
    ways, and as recorded, a clean replay served from the rows."""
    data = await _deferred_recording(tmp_path)
    ways = _Ways(_deferred_registry)
    assert (await ways.same(data)).ok
    records = _every_line_rows(data)
    assert [r["type"] for r in records[1:]] == ["rows"] * 4
    planned_under = [len(row) for r in records[1:] for row in r["rows"]]
    assert 14 in planned_under and 13 in planned_under, planned_under
    report = await ways.same(_rechained(copy.deepcopy(records)))
    assert report.ok and report.batches == 4 and ways.last_from_rows == [True] * 4, report
    fields: set[str] = set()
    for number in range(2, len(records) + 1):
        for r, row in enumerate(records[number - 1]["rows"]):
            changes: list[tuple[int | None, Any]] = [
                (4, "unfinished"),
                (3, None),
                (6, "other"),
                (5, "failed"),
            ]
            if len(row) == 14:
                changes += [(13, v) for v in ("run_tool", row[1], "echo", "hidden", "find_tools", 3, None)]
                changes += [(None, "drop the planned name")]
            else:
                changes += [(None, v) for v in ("hidden", "echo", row[1], "run_tool")]
            if row[1] == "find_tools":
                changes += [(2, '{"query": "select:echo"}'), (2, '{"query": "nothing at all"}')]
                changes += [(2, '{"query": "select:hidden", "limit": 1}'), (1, "run_tool"), (10, True)]
            for column, value in changes:
                edited = copy.deepcopy(records)
                target = edited[number - 1]["rows"][r]
                if column is None and value == "drop the planned name":
                    target.pop()
                elif column is None:
                    target.append(value)
                else:
                    target[column] = value
                report = await ways.same(_rechained(edited), (number, r, column, value))
                if report.divergence is not None:
                    fields.add(report.divergence.field)
    assert {"content", "name", "how", "key", "status"} <= fields, fields


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_rows_and_batch_lines_mixed_in_any_way_replay_the_same_in_format_2_or_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any mix of rows lines and batch lines (each rows line may be the batch record it
    stands for, each batch line the rows it would be), under a header of format 3, 2 or
    1 (unchained: no seq nor prev): the same report both ways; as recorded, clean."""
    data = await _rows_recording(tmp_path)
    as_rows = _every_line_rows(data)
    as_batches = [as_rows[0]] + [_as_batch(r) if r["type"] == "rows" else r for r in as_rows[1:]]
    ways = _Ways(_registry)
    masks = [0, (1 << (len(as_rows) - 1)) - 1, *random.Random(3).sample(range(1 << (len(as_rows) - 1)), 30)]
    for mask in masks:
        mixed = [copy.deepcopy(as_rows[0])] + [
            copy.deepcopy(as_rows[i] if mask >> (i - 1) & 1 else as_batches[i])
            for i in range(1, len(as_rows))
        ]
        for version in (3, 2, 1):
            edited = copy.deepcopy(mixed)
            edited[0]["format"] = version
            if version == 1:
                for record in edited:
                    record.pop("seq", None)
                    record.pop("prev", None)
            report = await ways.same(_rechained(edited), (mask, version))
            assert report.ok and report.batches == 8, (mask, version, report)
            # a key edited in the mix: found both ways at the same call
            if edited[5]["type"] == "rows":
                edited[5]["rows"][-1][3] = "f" * 32
            else:
                edited[5]["plan"][-1]["key"] = "f" * 32
            report = await ways.same(_rechained(edited), (mask, version, "a key"))
            divergence = report.divergence
            assert divergence is not None and (divergence.batch, divergence.field) == (5, "key"), report


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rows_recording_taken_apart_every_way_replays_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_replay_stream's edits (lines dropped, doubled, swapped, cut, emptied, garbled;
    seq and prev edited, a second header, a note; each field changed, the chain made
    again) of a recording of rows lines, a sample of them: the same report both ways."""
    data = await _rows_recording(tmp_path)
    edits = _edits(data, ends=2, chained=True)
    ways = _Ways(_registry)
    problems: set[Any] = set()
    for name, edited in random.Random(5).sample(edits, min(len(edits), 260)):
        report = await ways.same(edited, name)
        problems.add(report.problem is not None)
    assert problems == {True, False} and ways.from_rows > 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rows_recording_cut_after_any_byte_of_its_last_lines_replays_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recording cut after every byte of its last two lines (a rows line cut inside
    its rows, a number, a string), or with a byte of them changed: the same report
    both ways."""
    data = await _rows_recording(tmp_path)
    lines = _lines(data)
    start = len(data) - len(lines[-1]) - len(lines[-2]) - 2
    ways = _Ways(_registry)
    truncated = 0
    for end in range(start, len(data) + 1, 3):
        truncated += (await ways.same(data[:end], end)).truncated
    for at in range(start, len(data), 7):
        for byte in (b"0", b"]", b"\n", b"e"):
            await ways.same(data[:at] + byte + data[at + 1 :], (at, byte))
    assert truncated > 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_rows_lines_of_a_chain_gone_on_from_another_file_or_of_odd_bytes_replay_the_same(
    tmp_path: Path,
) -> None:
    """Rows lines under a header that goes on with another file's chain (`continues`: its
    seq and run, or odd values there), and rows lines holding ill-formed UTF-8, a byte
    order mark, a NUL or a line separator: the same report both ways."""
    data = await _rows_recording(tmp_path)
    records = _records(data)
    ways = _Ways(_registry)
    for continues in ({"seq": 7, "run": 1}, {"seq": 7, "run": 2}, {"seq": 7}, {"seq": "7", "run": 1}, []):
        edited = copy.deepcopy(records)
        edited[0]["continues"] = continues
        for i, record in enumerate(edited[1:], 1):
            record["seq"] = 7 + i if isinstance(continues, dict) and continues.get("seq") == 7 else i
        report = await ways.same(_rechained(edited), continues)
        if continues == {"seq": 7, "run": 1}:
            assert report.ok and report.batches == 8 and all(ways.last_from_rows[:4]), report
    lines = _lines(data)
    for raw in (b"\xff\xfe", b"\xef\xbb\xbf", b"\\u0000", b"\xe2\x80\xa8", b"\\ud83d", b"\x00"):
        for number in (2, 9):
            spoiled = lines[number - 1].replace(b'"x ' if number == 2 else b'"after"', b'"' + raw)
            edited = [*lines[: number - 1], spoiled]
            for later in lines[number:]:
                record = json.loads(later)
                record["prev"] = line_hash(edited[-1])
                edited.append(json.dumps(record).encode())
            await ways.same(_joined(edited), (raw, number))
        await ways.same(raw + data, raw)


# --- credentials -------------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_secrets_placed_in_rows_are_handled_as_the_general_way_handles_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording whose calls held credentials (batch lines, the secrets redacted), made
    rows lines with the arguments redacted or holding the secrets themselves (as text or
    an object), the key of the redacted or of the unredacted arguments, a result's
    content holding a secret, its marker, or neither, a secret in the id, name, started
    or planned name: the same report both ways; the key of the redacted arguments agrees
    with arguments holding the secret, and a secret in a content diverges."""
    path = tmp_path / "secret.jsonl"
    s = Dispatcher(_echo_registry(Counter())).session("rec", record=path)
    token = {"Private-Token": SECRETS["openai"]}
    plain = {"url": "https://api.test/", "headers": token}
    await s.dispatch([_secret_request("1"), openai_call("2", "request", plain)])
    await s.dispatch([_secret_request("3")])
    await s.dispatch([openai_call("4", "request", {"url": "https://api.test/x"})])
    s.close()
    data = path.read_bytes()
    ways = _Ways(lambda: _echo_registry(Counter()))
    assert (await ways.same(data)).ok
    real = [_secret_request("1").arguments, plain, _secret_request("3").arguments]
    planner = make_planner(_echo_registry(Counter()))
    unredacted = [
        c.key for c in run_pass1(planner, [_secret_request("1"), openai_call("2", "request", plain)]).calls
    ]
    made_rows = _every_line_rows(data)
    assert [r["type"] for r in made_rows[1:]] == ["rows"] * 3, made_rows
    outcomes: dict[str, Any] = {}
    for name, arguments, key, content in [
        ("as recorded", None, None, None),
        ("secret text, redacted key", "text", None, None),
        ("secret object, redacted key", "object", None, None),
        ("secret text, unredacted key", "text", "unredacted", None),
        ("secret object, unredacted key", "object", "unredacted", None),
        ("secret text, a secret in the content", "text", None, "secret"),
        ("secret object, the secrets echoed", "object", None, "echoed"),
        ("secret text, the markers echoed", "text", None, None),
        ("redacted, a secret in the content", None, None, "secret"),
        ("redacted, the secrets echoed", None, None, "echoed"),
        ("redacted, unredacted key", None, "unredacted", None),
    ]:
        edited = copy.deepcopy(made_rows)
        for r, row in enumerate(edited[1]["rows"]):
            if arguments == "text":
                row[2] = json.dumps(real[r])
            elif arguments == "object":
                row[2] = real[r]
            if key == "unredacted":
                row[3] = unredacted[r]
            if content == "secret":
                row[6] = row[6] + " " + SECRETS["header"]
            elif content == "echoed":
                row[6] = json.dumps(real[r], sort_keys=True)
        report = await ways.same(_rechained(edited), name)
        div = report.divergence
        outcomes[name] = div and (div.batch, div.field, div.index)
    # the secrets themselves in batch 1, keyed as redacted: batch 1 agrees (batch 2, a
    # repeat of call 1 as recorded, redacted, is no longer served as its repeat)
    assert outcomes["as recorded"] is None, outcomes
    agreeing = ("secret text, redacted key", "secret object, redacted key", "secret text, the markers echoed")
    for name in agreeing:
        assert outcomes[name] == (2, "how", 0), (name, outcomes)
    assert outcomes["secret text, unredacted key"] == (1, "key", 0), outcomes
    assert outcomes["secret object, unredacted key"] == (1, "key", 0), outcomes
    assert outcomes["redacted, unredacted key"] == (1, "key", 0), outcomes
    # a secret of the arguments in a served content: redacted before it is compared
    assert outcomes["secret text, a secret in the content"] == (1, "content", 0), outcomes
    assert outcomes["secret object, the secrets echoed"] == (1, "content", 0), outcomes
    # secrets where replay compares nothing, or compares them as they are
    for column, value in ((0, SECRETS["bearer"]), (1, SECRETS["bearer"]), (11, SECRETS["bearer"])):
        for number in (2, 3, 4):
            edited = copy.deepcopy(made_rows)
            edited[number - 1]["rows"][0][column] = value
            await ways.same(_rechained(edited), (column, number))
            edited[number - 1]["rows"][0].append(value)
            await ways.same(_rechained(edited), (column, number, "planned"))


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_credential_put_into_a_clean_rows_batch_is_keyed_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rows batch holding no credential (served by pass 1's own key, with nothing to
    redact) edited so one call's arguments hold one, as a key the redactor knows or in an
    escaped form, with its recorded key, or the key of those arguments redacted or not:
    the same report both ways."""
    data = await _rows_recording(tmp_path)
    records = _records(data)
    ways = _Ways(_registry)
    secret = "sk-live-0123456789abcdef"
    texts = [
        {"text": "x", "api_key": secret},
        {"text": "x", "password": "hunter2hunter2"},
        {"text": f"Bearer {secret}"},
        {"text": "x", "headers": {"Authorization": f"Bearer {SECRETS['bearer']}"}},
    ]
    keys: list[Any] = []
    for args in texts:
        plan = run_pass1(make_planner(_registry()), [openai_call("k", "echo", args)])
        keys.append(plan.calls[0].key)
    divergences = set()
    for number in (2, 5, 9):
        for args, key in zip(texts, keys, strict=True):
            for as_text in (
                json.dumps(args),
                json.dumps(args, ensure_ascii=True).replace("sk-", "\\u0073k-"),
                args,
            ):
                for row_key in ("recorded", key, None):
                    edited = copy.deepcopy(records)
                    row = edited[number - 1]["rows"][0]
                    row[1], row[2] = "echo", as_text
                    if row_key != "recorded":
                        row[3] = row_key
                    report = await ways.same(_rechained(edited), (number, as_text, row_key))
                    divergences.add(report.divergence and report.divergence.field)
    assert "key" in divergences, divergences


def _default_registry() -> Registry:
    """echo, and `token`, whose schema's default holds a credential (the shortcut that
    skips redaction must not apply to it)."""
    registry = fake_registry(Counter(), {})

    async def token(args: Mapping[str, Any], ctx: Any) -> str:
        return f"sent {args.get('text')}"

    schema = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "api_key": {"type": "string", "default": SECRETS["arg"]}},
    }
    registry.add(Tool("token", "Sends.", token, schema, deferred=False))
    return registry


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_tool_whose_defaults_hold_a_credential_replays_the_same_from_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls of a tool whose schema default is a credential, recorded (whatever the line
    kind), made rows lines, and their keys set to the key of the defaults redacted or
    not: the same report both ways."""
    path = tmp_path / "defaults.jsonl"
    s = Dispatcher(_default_registry()).session("d", record=path)
    await s.dispatch([openai_call("1", "token", {"text": "a"}), openai_call("2", "echo", {"text": "b"})])
    await s.dispatch([openai_call("3", "token", {"text": "a", "api_key": "mine"})])
    s.close()
    data = path.read_bytes()
    ways = _Ways(_default_registry)
    assert (await ways.same(data)).ok
    records = _every_line_rows(data)
    assert (await ways.same(_rechained(copy.deepcopy(records)))).ok
    plan = run_pass1(make_planner(_default_registry()), [openai_call("1", "token", {"text": "a"})])
    for key in (plan.calls[0].key, None, "f" * 32):
        for number in (2, 3):
            edited = copy.deepcopy(records)
            if edited[number - 1]["type"] != "rows":
                continue
            edited[number - 1]["rows"][0][3] = key
            await ways.same(_rechained(edited), (key, number))


def _cached_registry() -> Registry:
    """`_registry`'s tools and `fetch`, whose results a result cache keeps."""
    registry = _registry()

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        return "fetched " + str(args.get("text"))

    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    registry.add(Tool("fetch", "Fetch.", fetch, schema, concurrent=True, deferred=False, cache=CachePolicy()))
    return registry


async def _passing_runner(planned: Any, ctx: Any) -> Any:
    raise AssertionError("replay runs no tool through the dispatcher's own runner")


_OPTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "hooks": lambda: {"hooks": [NothingHook()]},  # every call the general way: no serve_now
    "cache": lambda: {"cache": MemoryResultCache()},
    "small outputs": lambda: {"max_output_bytes": 64},
    "small arguments": lambda: {"max_argument_bytes": 16},
    "on_result": lambda: {"on_result": lambda *args: None},
    "one at a time": lambda: {"max_concurrent": 1},
    "a runner": lambda: {"runner": _passing_runner},
    "a gate": lambda: {"gate": lambda call, ctx: Deny("never")},
}


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("option", sorted(_OPTIONS))
async def test_a_replaying_dispatcher_of_other_options_replays_rows_the_same_both_ways(
    tmp_path: Path, option: str
) -> None:
    """A replaying dispatcher with hooks (pass 2 serves no result at once, every call goes
    through the runner), a result cache, small output or argument limits, on_result, one
    call at a time, a runner or a gate of its own: the same report both ways, for a
    session of rows lines (a cached tool among them) as recorded and edited."""
    path = tmp_path / "options.jsonl"
    s = Dispatcher(_cached_registry(), cache=MemoryResultCache()).session("o", record=path)
    await s.dispatch([openai_call("1", "fetch", {"text": "a"}), openai_call("2", "echo", {"text": "a"})])
    await s.dispatch([openai_call("3", "fetch", {"text": "a"}), openai_call("4", "echo", {"text": "a" * 80})])
    s.new_run()
    # (two cache hits of one call in a batch are recorded as two hits, which replay without
    # the cache serves as a call and its follower: not the point here)
    await s.dispatch([openai_call("5", "fetch", {"text": "a"}), openai_call("6", "fetch", {"text": "b"})])
    s.close()
    data = path.read_bytes()
    records = _records(data)
    assert records[3]["rows"][0][9] is True  # a cache hit
    assert [r["type"] for r in records[1:]] == ["rows"] * 3, records
    ways = _Ways(_cached_registry, _OPTIONS[option])
    report = await ways.same(data)
    assert report.ok or option in ("small outputs", "small arguments"), report
    for number in (2, 3, 4):
        for column, value in ((6, "other"), (9, True), (10, True), (4, "deduped"), (3, "f" * 32), (2, "{}")):
            for r in range(2):
                edited = copy.deepcopy(records)
                edited[number - 1]["rows"][r][column] = value
                await ways.same(_rechained(edited), (number, r, column, value))


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_gated_batch_made_rows_replays_the_same_both_ways(tmp_path: Path) -> None:
    """A batch whose call the gate denied, its decision dropped and made a rows line (rows
    hold no decisions: replay's gate then asks, and is interrupted), with its control set
    as an interruption would: the same report both ways."""
    reg = lambda: _gated_registry()  # noqa: E731
    path = tmp_path / "gated.jsonl"
    d = Dispatcher(reg(), gate=lambda c, ctx: Deny("not now"))
    s = d.session("g", record=path)
    await s.dispatch([ToolCall("1", "risky", {}), openai_call("2", "echo", {"text": "x"})])
    await s.dispatch([openai_call("3", "echo", {"text": "y"})])
    s.close()
    records = _records(path.read_bytes())
    assert records[1]["type"] == "batch" and records[1]["decisions"]
    ways = _Ways(reg)
    assert (await ways.same(path.read_bytes())).ok
    undecided = dict(records[1], decisions={})
    rows = _as_rows(undecided)
    assert rows is not None
    seen = set()
    for control in (None, "DispatchInterrupted", "HookBlocked"):
        for how in (None, "unfinished", "ran"):
            edited = copy.deepcopy(records)
            edited[1] = copy.deepcopy(rows) | {"control": control}
            if how is not None:
                edited[1]["rows"][0][4] = how
            report = await ways.same(_rechained(edited), (control, how))
            seen.add(report.divergence and report.divergence.field)
            edited[1] = _as_batch(edited[1])  # the batch record it stands for, as format 2 wrote it
            assert await ways.same(_rechained(edited), (control, how, "batch")) == report
    assert "control" in seen, seen


# --- rewriters ----------------------------------------------------------------------------------


def _rewriters() -> list[tuple[str, Callable[..., Any]]]:
    def nothing(event: Any, state: Any) -> None:
        return None

    def louder(event: Any, state: Any) -> Any:
        if event.tool_name == "echo":
            return {"tool_name": "echo", "args": {**event.args, "text": str(event.args.get("text")).upper()}}
        return None

    def secret(event: Any, state: Any) -> Any:
        return {"tool_name": event.tool_name, "args": {**event.args, "api_key": SECRETS["arg"]}}

    def elsewhere(event: Any, state: Any) -> Any:
        return {"tool_name": "read", "args": {"path": "a"}}

    def meddler(event: Any, state: Any) -> None:
        args = event.args
        if isinstance(args, dict):
            args["text"] = "meddled"  # in place: the arguments of the replayed call itself
        return None

    async def later(event: Any, state: Any) -> None:
        await anyio.lowlevel.checkpoint()
        return None

    return [
        ("nothing", nothing),
        ("louder", louder),
        ("secret", secret),
        ("elsewhere", elsewhere),
        ("meddler", meddler),
        ("later", later),
    ]


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("name", [name for name, _ in _rewriters()])
async def test_rewriters_of_the_replaying_dispatcher_replay_rows_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A replaying dispatcher with a rewriter (doing nothing, changing arguments, adding a
    credential, sending to another tool, changing the arguments in place, awaiting): the
    same report both ways, for the recording as recorded and with rows arguments that
    are objects, a secret or its key edited in."""
    rewriter = dict(_rewriters())[name]
    data = await _rows_recording(tmp_path)
    records = _records(data)
    ways = _Ways(_registry, rewriters=[rewriter])
    report = await ways.same(data)
    assert report.ok is (name in ("nothing", "later")), report
    for number in (2, 5, 9):
        for value in ({"text": "x"}, '{"text": "x", "api_key": "sk-live-0123456789abcdef"}', {"text": 3}):
            edited = copy.deepcopy(records)
            row = edited[number - 1]["rows"][0]
            row[1], row[2] = "echo", value
            await ways.same(_rechained(edited), (number, value))


# --- generated rows -------------------------------------------------------------------------------

_KEYS = {
    name: run_pass1(make_planner(_registry()), [openai_call("k", name, args)]).calls[0].key
    for name, args in (("echo", {"text": "x"}), ("read", {"path": "a"}), ("find_tools", {"query": "echo"}))
}
_ARGS = {"echo": '{"text": "x"}', "read": '{"path": "a"}', "find_tools": '{"query": "echo"}'}
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities too: json writes them, and only json reads them back
    st.text(max_size=3),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["a", "text"]), st.integers(0, 3), max_size=1),
)


_FINGERPRINT = _registry().fingerprint()
_HOWS = ["ran", "ran", "ran", "follow", "deduped", "unfinished", "stopped", "rejected"]


@st.composite
def _generated_row(draw: Any) -> list[Any]:
    """A row as a recorder writes one, of a call of a known tool, run_tool, find_tools or
    an unknown tool, its key pass 1's (or not), now and then one value spoiled by a
    value of any JSON kind."""
    name = draw(st.sampled_from(["echo", "echo", "read", "find_tools", "run_tool", "nope", "cut"]))
    if name == "run_tool":
        run_echo = '{"name": "echo", "args": {"text": "x"}}'
        arguments: Any = draw(st.sampled_from([run_echo, '{"name": "read"}']))
    else:
        arguments = draw(st.sampled_from([_ARGS.get(name, "{}")] * 4 + ["", "x", "{}"]))
    planned = "echo" if name == "run_tool" else name
    key = draw(st.sampled_from([_KEYS.get(planned)] * 4 + [None, "f" * 32]))
    row = [draw(st.sampled_from(["1", "2", "3", ""])), name, arguments, key, draw(st.sampled_from(_HOWS))]
    if draw(st.integers(0, 3)):  # answered
        row.append(draw(st.sampled_from(["ok", "ok", "failed", "denied", "rejected"])))
        row.append(draw(st.sampled_from(["x", "v1", "<missing>", "", "x" * 300])))
        row += [draw(st.booleans()) for _ in range(4)]
        row.append(draw(st.one_of(st.none(), st.floats(0, 2e9))))
        row.append(draw(st.floats(0, 1)))
    if name == "run_tool" or not draw(st.integers(0, 5)):
        row.append(draw(st.sampled_from([planned, planned, name, "read"])))
    if not draw(st.integers(0, 2)):
        row[draw(st.integers(0, len(row) - 1))] = draw(_JUNK)
    return row


@st.composite
def _generated_recordings(draw: Any) -> bytes:
    """A header and one to three rows records of generated rows, chained, now and then
    with a field dropped or an odd control."""
    header = {"type": "header", "format": draw(st.sampled_from([3, 3, 2])), "seq": 0}
    header |= {"fingerprint": _FINGERPRINT, "session": "gen", "mode": "direct", "meta": {}}
    records: list[dict[str, Any]] = [header]
    for seq in range(1, draw(st.integers(1, 3)) + 1):
        record: dict[str, Any] = {"type": "rows", "run": draw(st.sampled_from([1, 1, 2])), "round": seq}
        record |= {"all_loaded": draw(st.booleans())}
        record["rows"] = draw(st.lists(_generated_row(), max_size=4))
        controls = [None] * 8 + ["DispatchInterrupted", "HookBlocked", "KeyboardInterrupt"]
        odd = st.one_of(st.sampled_from(controls), _JUNK)
        record["control"] = draw(odd if seq > 2 else st.sampled_from(controls))
        record |= {"seq": seq, "prev": ""}
        if not draw(st.integers(0, 9)):
            record.pop(draw(st.sampled_from(["round", "all_loaded", "control", "run"])))
        records.append(record)
    return _rechained(records)


@given(_generated_recordings())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_generated_rows_replay_the_same_both_ways(data: bytes) -> None:
    """Recordings of generated rows lines (ids, names, arguments, keys, hows, statuses,
    contents, flags, starts and durations of the usual values or of any JSON kind,
    NaN included; run_tool, find_tools, unknown tools; odd controls; fields missing):
    the same report both ways, or the same exception."""
    _sync_same(data, _registry)


def test_generated_rows_do_reach_the_quick_way_and_replay_clean() -> None:
    """The generator's usual rows (every value as a recorder writes it) pass the rows
    checks as they are, and a recording of them served as rows replays clean both ways."""
    now = 1.7e9
    rows = [
        ["1", "echo", _ARGS["echo"], _KEYS["echo"], "ran", "ok", "x", False, False, False, False, now, 0.5],
        [
            "2",
            "read",
            _ARGS["read"],
            _KEYS["read"],
            "ran",
            "ok",
            "<missing>",
            False,
            False,
            False,
            False,
            now,
            0.1,
        ],
    ]
    header = {"type": "header", "format": 3, "seq": 0, "fingerprint": _FINGERPRINT}
    header |= {"session": "gen", "mode": "direct", "meta": {}}
    record = {"type": "rows", "run": 1, "round": 1, "all_loaded": False, "rows": rows, "control": None}
    record |= {"seq": 1, "prev": ""}
    assert _rows_formed(record)
    report = _sync_same(_rechained([header, record]), _registry)
    assert report.ok and report.calls == 2, report


# --- replay as such, both ways alike --------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_two_sessions_recording_the_same_call_into_one_file_replay_clean(tmp_path: Path) -> None:
    """Two sessions recording into one file, each making the same call: both ways report
    the same, and the recording replays clean (the second's call ran anew, and replays so,
    after the `session` record that says its batches start from nothing)."""
    path = tmp_path / "two.jsonl"
    d = Dispatcher(fake_registry(Counter(), {}))
    await d.session("one", record=path).dispatch([openai_call("1", "echo", {"text": "x"})])
    await d.session("two", record=path).dispatch([openai_call("2", "echo", {"text": "x"})])
    report = await _Ways(lambda: fake_registry(Counter(), {})).same(path.read_bytes())
    assert report.ok, report.divergence


# --- the existing helper, on attacks of its own -------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_replay_both_agrees_on_long_contents_and_many_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows lines of many calls (followers of a few leaders; ids repeated, which are
    invalid), a content made huge, NUL, a lone surrogate, JSON escapes or other text:
    `_replay_both` finds the same report both ways, a leader's content edited is found
    at its first follower, and a follower's at itself."""
    path = tmp_path / "many.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("many", record=path)
    await s.dispatch([openai_call(f"c{i}", "echo", {"text": f"t{i % 11}"}) for i in range(40)])
    await s.dispatch([openai_call(f"c{i % 7}", "echo", {"text": f"u{i % 11}"}) for i in range(40)])
    s.close()
    records = _every_line_rows(path.read_bytes())
    assert [r["type"] for r in records[1:]] == ["rows", "rows"]
    assert [row[4] for row in records[1]["rows"]].count("ran") == 11
    registry = lambda: fake_registry(Counter(), {})  # noqa: E731
    assert (await _replay_both(path.read_bytes(), registry, monkeypatch)).ok
    assert (await _replay_both(_rechained(copy.deepcopy(records)), registry, monkeypatch)).ok
    for content in ("x" * 2_000_000, "\x00", "\ud800", "\\u0000", "t3\n", "t0 "):
        for r, found in ((0, 11), (11, 11), (39, 39)):
            for number in (2, 3):
                edited = copy.deepcopy(records)
                edited[number - 1]["rows"][r][6] = content
                report = await _replay_both(_rechained(edited), registry, monkeypatch)
                div = report.divergence
                if number == 2:
                    assert div is not None and (div.field, div.index) == ("content", found), report
