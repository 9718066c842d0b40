"""Recordings of format 3, whose common batch is one `rows` line: recordings of format 2
still read and replay, a recorder that goes on with one keeps writing `batch` lines,
malformed rows are problems naming their line (the same read whole or a line at a time),
and a rows line is much smaller than the batch record it stands for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher import Dispatcher, DispatchInterrupted, Registry, Status, Tool, ToolCall, ToolResult, replay
from dispatcher._recording import (
    FORMAT_VERSION,
    Recorder,
    _batch_of_rows,
    _common_rows,
    _rows_formed,
    _well_formed,
    encode_line,
    line_hash,
    read_recording,
)

from ._fakes import Counter, fake_registry, openai_call
from ._recorded import assert_reads_as, assert_same, kinds, part_by_part, read_line, read_lines
from ._recorded import submitted as _submitted
from .test_plan import make_planner, run_pass1
from .test_replay_stream import _edits, _read_by_stream, _read_whole, _replay_both

SECRET = "sk-live-0123456789abcdef"  # sends its batch to the part-by-part builder


def _registry() -> Registry:
    """fake_registry's tools (echo, read, edit, boom, ...) and `cut`, which asks for a
    decision once its siblings have finished: its batch is cut short."""

    async def cut(args: Any, ctx: Any) -> str:
        await anyio.sleep(0.01)  # after its siblings finished
        raise DispatchInterrupted([(ToolCall(ctx.call_id, "cut", dict(args)), "asks", None)])

    registry = fake_registry(Counter(), {"a": "v1"})
    registry.add(Tool("cut", "Cuts.", cut, {"type": "object"}, concurrent=True, deferred=False))
    return registry


async def _session_batches(path: Path, session: str = "rows") -> None:
    """A session of the batches a recording mostly holds, recorded to `path`: runs, reads
    and writes, a failure, followers, an unknown tool, a call holding a credential, and a
    batch cut short, whose calls never finished."""
    s = Dispatcher(_registry()).session(session, record=path)
    await s.dispatch([openai_call("1", "read", {"path": "a"}), openai_call("2", "echo", '{"text": "x ✓"}')])
    await s.dispatch(
        [openai_call("3", "edit", {"path": "a", "text": "v2"}), openai_call("4", "read", {"path": "a"})]
    )
    await s.dispatch([openai_call("5", "echo", {"text": "x"}), openai_call("6", "boom", {})])
    s.new_run()
    await s.dispatch([openai_call("7", "echo", {"text": "y"}), openai_call("8", "echo", {"text": "y"})])
    await s.dispatch([openai_call("9", "nope", {}), openai_call("10", "echo", {"text": "z"})])
    await s.dispatch([openai_call("11", "echo", {"text": "k", "api_key": SECRET})])
    with pytest.raises(DispatchInterrupted):
        await s.dispatch([openai_call("12", "echo", {"text": "c"}), openai_call("13", "cut", {})])
    await s.dispatch([openai_call("14", "echo", {"text": "after"})])
    s.close()


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")[:-1]


def _as_format_2(data: bytes) -> bytes:
    """A recording of format 3 as format 2 wrote it: each `rows` line the `batch` record it
    stands for, the header saying format 2, the chain made again."""
    out: list[bytes] = []
    for raw in _lines(data):
        record = read_line(raw)
        if record["type"] == "header":
            record["format"] = 2
            out.append(json.dumps(record, ensure_ascii=True).encode())  # as the recorder writes it
            continue
        record["prev"] = line_hash(out[-1])
        out.append(encode_line(record))
    return b"".join(line + b"\n" for line in out)


def _without_prev(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in batch.items() if k != "prev"} for batch in batches]


async def test_a_recording_of_format_2_replays_and_reads_as_the_same_batches(tmp_path: Path) -> None:
    """A real session's recording rewritten as format 2 wrote it (batch records only)
    replays clean, read whole and a line at a time, and holds the same batches."""
    three = tmp_path / "three.jsonl"
    await _session_batches(three)
    assert set(kinds(three)[1:]) == {"rows", "batch"}
    two = tmp_path / "two.jsonl"
    two.write_bytes(_as_format_2(three.read_bytes()))
    assert kinds(two)[1:] == ["batch"] * (len(kinds(two)) - 1)
    header_3, batches_3, truncated_3, problem_3 = read_recording(three)
    header_2, batches_2, truncated_2, problem_2 = read_recording(two)
    assert problem_3 is None is problem_2 and not truncated_3 and not truncated_2
    assert header_3["format"] == FORMAT_VERSION == 3 and header_2 == {**header_3, "format": 2}
    assert len(batches_2) == len(batches_3) == 8
    assert_same(_without_prev(batches_2), _without_prev(batches_3))
    assert [b["prev"] for b in batches_2] == [line_hash(line) for line in _lines(two.read_bytes())[:-1]]
    for path in (two, three):
        data = path.read_bytes()
        assert _read_by_stream(data, peek=False) == _read_whole(data)
        report = await replay(path, Dispatcher(_registry()))
        assert report.ok and report.batches == 8 and report.calls == 14, report
        assert report.header["format"] == (2 if path == two else 3) and report.warnings == ()


async def test_a_recorder_going_on_with_a_format_2_file_writes_batch_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions recording into a file of format 2 (one that waits for its lines, one that
    hands them to the writer thread, with a batch large enough for its rows to be
    encoded at once) go on with its chain in batch lines, each the record built part by
    part, byte for byte; the whole file replays. A new file, and one of format 3 gone on
    with, get rows lines."""
    first = tmp_path / "first.jsonl"
    await _session_batches(first)
    path = tmp_path / "two.jsonl"
    path.write_bytes(_as_format_2(first.read_bytes()))
    before = len(_lines(path.read_bytes()))
    with _submitted(monkeypatch) as submitted:
        await _session_batches(path, "again")
        s = Dispatcher(_registry()).session("handed", record=path, record_wait=False)
        await s.dispatch([openai_call(f"h{i}", "echo", {"text": f"t{i}"}) for i in range(20)])
        s.close()
    assert Recorder._record_of(*submitted[-1])[0]["type"] == "rows"  # to a new file: rows
    assert kinds(path) == ["header"] + ["batch"] * (before - 1 + 9)
    assert read_lines(path)[0]["format"] == 2
    lines = _lines(path.read_bytes())
    assert len(submitted) == 9 and len(lines) == before + 9
    for line, parts in zip(lines[before:], submitted, strict=True):
        written = read_line(line)
        expected = part_by_part(parts, monkeypatch)
        expected["seq"], expected["prev"] = written["seq"], written["prev"]
        assert_reads_as(line, expected)  # a batch line: the very bytes
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated and len(batches) == 17
    assert [b["seq"] for b in batches] == list(range(1, 18))
    report = await replay(path, Dispatcher(_registry()))
    assert report.ok and report.batches == 17 and report.calls == 48, report
    # a new file, then a file of format 3 gone on with: rows lines
    assert kinds(first)[0] == "header" and read_lines(first)[0]["format"] == FORMAT_VERSION
    await _session_batches(first, "again")
    written = kinds(first)
    assert written[1:9] == written[10:] and written[9] == "session" and written.count("rows") == 2 * 6
    report = await replay(first, Dispatcher(_registry()))
    assert report.ok and report.batches == 16, report


# --- malformed rows --------------------------------------------------------------------------


def _row_edit(i: int, value: Any) -> Callable[[list[Any]], Any]:
    def change(rows: list[Any]) -> Any:
        rows[0][i] = value
        return rows

    return change


_NOT_A_ROW = "rows[0] is not a list of 5, 6, 13 or 14 values"
_BROKEN_ROWS: list[tuple[str, Callable[[list[Any]], Any], str]] = [
    ("rows an object", lambda rows: {"0": rows[0]}, "is not a JSON record: a 'rows' record whose 'rows'"),
    ("rows text", lambda rows: json.dumps(rows), "is not a JSON record: a 'rows' record whose 'rows'"),
    ("rows null", lambda rows: None, "is not a JSON record: a 'rows' record whose 'rows'"),
    ("a row of 4 values", lambda rows: [rows[0][:4], *rows[1:]], _NOT_A_ROW),
    ("a row of 7 values", lambda rows: [rows[0][:7], *rows[1:]], _NOT_A_ROW),
    ("a row of 15 values", lambda rows: [[*rows[0], "echo", 1], *rows[1:]], _NOT_A_ROW),
    ("a planned name that is a number", lambda rows: [[*rows[0], 1], *rows[1:]], "plan[0]'s 'name'"),
    ("an empty row", lambda rows: [[], *rows[1:]], _NOT_A_ROW),
    ("a row that is an object", lambda rows: [{"id": "1"}, *rows[1:]], _NOT_A_ROW),
    ("a row that is text", lambda rows: ["row", *rows[1:]], _NOT_A_ROW),
    ("a status that is no status", _row_edit(5, "nope"), "results[0]'s status 'nope' is not a status"),
    ("a status that is null", _row_edit(5, None), "results[0]'s status None is not a status"),
    ("a status that is a list", _row_edit(5, ["ok"]), "results[0]'s status ['ok'] is not a status"),
    (
        "a content that is a number",
        _row_edit(6, 3),
        "results[0]'s 'call_id', 'name' or 'content' is not text",
    ),
    ("a content that is null", _row_edit(6, None), "results[0]'s 'call_id', 'name' or 'content' is not text"),
    ("an id that is a number", _row_edit(0, 7), "results[0]'s 'call_id', 'name' or 'content' is not text"),
    ("a name that is a number", _row_edit(1, 7), "plan[0]'s 'name' or 'how' is not text"),
    ("a key that is a number", _row_edit(3, 3), "plan[0]'s 'key' is not text"),
    ("a how that is null", _row_edit(4, None), "plan[0]'s 'name' or 'how' is not text"),
    ("a duration that is text", _row_edit(12, "1"), "results[0]'s 'duration' is not a number"),
]


def _broken(data: bytes, number: int, change: Callable[[list[Any]], Any], rechain: bool) -> bytes:
    """`data` with the rows of its line `number` (a rows line) changed; `rechain`: the
    chain made again after it, so that only the rows are wrong."""
    lines = _lines(data)
    record = json.loads(lines[number - 1])
    assert record["type"] == "rows"
    record["rows"] = change(record["rows"])
    lines[number - 1] = json.dumps(record).encode()
    if rechain:
        for at in range(number, len(lines)):
            later = json.loads(lines[at])
            later["prev"] = line_hash(lines[at - 1])
            lines[at] = json.dumps(later).encode()
    return b"".join(line + b"\n" for line in lines)


# on trio alone: what is compared is the reading, which no loop changes
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_malformed_rows_are_problems_naming_their_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that are no rows, or hold a value of the wrong kind, on the first, a middle or
    the last rows line: read whole and a line at a time alike, a problem naming the line
    and what is wrong, never an exception; the batches before it read and replay."""
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    data = path.read_bytes()
    _, batches, _, _ = read_recording(path)
    rows_lines = [n for n, kind in enumerate(kinds(path), 1) if kind == "rows"]
    answered = [
        n for n in rows_lines if all(len(row) == 13 for row in json.loads(_lines(data)[n - 1])["rows"])
    ]
    assert rows_lines[0] == 2 and rows_lines[-1] == len(_lines(data)) and len(answered) >= 4
    for number in (answered[0], answered[2], answered[-1]):
        for name, change, said in _BROKEN_ROWS:
            for rechain in (False, True):
                broken = _broken(data, number, change, rechain)
                where = (name, number, rechain)
                whole = _read_whole(broken)
                assert _read_by_stream(broken, peek=False) == whole, where
                assert _read_by_stream(broken, peek=True) == whole, where
                problem = whole[3]
                assert problem is not None and problem.startswith(f"line {number}"), (where, problem)
                assert said in problem and not whole[2], (where, problem)
                assert [line for line, _ in whole[1]] == list(range(2, number)), where
                assert_same(_without_prev([b for _, b in whole[1]]), _without_prev(batches[: number - 2]))
                if not rechain:
                    continue  # replayed with the chain made again only: it reads the same
                report = await _replay_both(broken, _registry, monkeypatch)
                assert report.problem == problem and report.divergence is None and not report.ok, where
                assert report.batches == number - 2, (where, report.batches)


# values a row may hold that replay reads otherwise than recorded, or reads as the
# recorder never writes them (a flag that is no boolean, a duration that is a whole number)
_OTHER_ROWS: list[tuple[str, Callable[[list[Any]], Any]]] = [
    ("another status", _row_edit(5, "failed")),
    ("another content", _row_edit(6, "other")),
    ("another id", _row_edit(0, "other-id")),
    ("another name", _row_edit(1, "read")),
    ("another planned name", lambda rows: [[*rows[0], "read"], *rows[1:]]),
    ("a planned name that is its own", lambda rows: [[*rows[0], rows[0][1]], *rows[1:]]),
    ("another key", _row_edit(3, "f" * 32)),
    ("no key", _row_edit(3, None)),
    ("deduped", _row_edit(4, "deduped")),
    ("unfinished", _row_edit(4, "unfinished")),
    ("stopped", _row_edit(4, "stopped")),
    ("no result", lambda rows: [rows[0][:5], *rows[1:]]),
    ("other arguments", _row_edit(2, '{"text": "other"}')),
    ("arguments that are an object", _row_edit(2, {"text": "x"})),
    ("arguments that are empty", _row_edit(2, "")),
    ("a flag that is text", _row_edit(7, "yes")),
    ("a deduped flag", _row_edit(10, True)),
    ("a cached flag that is a number", _row_edit(9, 1)),
    ("a duration that is whole", _row_edit(12, 2)),
    ("a start that is text", _row_edit(11, "noon")),
]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_rows_edited_to_other_values_replay_as_the_batch_records_they_stand_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows edited to values replay reads otherwise than recorded, the chain made again, on
    every answered rows line: served from the rows as they are and compared by identity,
    the report is the one of the batch records they stand for, compared field by field;
    between them they diverge in every field replay compares."""
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    data = path.read_bytes()
    rows_lines = [n for n, kind in enumerate(kinds(path), 1) if kind == "rows"]
    answered = [
        n for n in rows_lines if all(len(row) == 13 for row in json.loads(_lines(data)[n - 1])["rows"])
    ]
    fields: set[str] = set()
    for number in answered:
        for name, change in _OTHER_ROWS:
            report = await _replay_both(_broken(data, number, change, True), _registry, monkeypatch)
            assert report.problem is None, (name, number, report.problem)
            if report.divergence is not None:
                fields.add(report.divergence.field)
    assert {"status", "content", "name", "how", "key"} <= fields, fields


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_call_that_ran_with_no_result_recorded_is_named_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that says its call ran but holds no result (an edit, the chain made again):
    both ways report `how` differs, the expected side saying no result was recorded,
    not "ran" against "ran"."""
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    broken = _broken(path.read_bytes(), 2, lambda rows: [rows[0][:5], *rows[1:]], True)
    report = await _replay_both(broken, _registry, monkeypatch)
    div = report.divergence
    assert div is not None and (div.field, div.index, div.got) == ("how", 0, "ran"), report
    assert div.expected == "ran, with no result recorded"


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_rows_line_edited_to_hold_a_credential_is_keyed_at_replay_as_the_recorder_keys_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch line of the call holding a credential made a rows line, its arguments the
    call's own (the secret in them), its key and result the recorded ones, the chain made
    again: replay keys it as the recorder did, of the arguments redacted, and served from
    the row as from the batch record, finds nothing different; with the key of the
    arguments as they are (the secret unredacted), both ways find the key differs."""
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    lines = _lines(path.read_bytes())
    number = next(n for n, line in enumerate(lines, 1) if b"api_key" in line)
    batch = json.loads(lines[number - 1])
    assert batch["type"] == "batch"
    [call], [plan], [result] = batch["calls"], batch["plan"], batch["results"]
    arguments = json.dumps({"text": "k", "api_key": SECRET})
    unredacted = run_pass1(make_planner(_registry()), [openai_call("k", "echo", arguments)]).calls[0].key
    assert unredacted is not None and unredacted != plan["key"]
    fields = (
        "status",
        "content",
        "retryable",
        "effect_uncertain",
        "cached",
        "deduped",
        "started",
        "duration",
    )
    for key, differs in ((plan["key"], False), (unredacted, True)):
        row = [call["id"], call["name"], arguments, key, plan["how"], *(result[f] for f in fields)]
        record = {k: batch[k] for k in ("run", "round", "all_loaded", "control", "seq", "prev")}
        edited = [*lines[: number - 1], json.dumps({"type": "rows", **record, "rows": [row]}).encode()]
        for later in lines[number:]:
            again = json.loads(later)
            again["prev"] = line_hash(edited[-1])
            edited.append(json.dumps(again).encode())
        report = await _replay_both(b"".join(line + b"\n" for line in edited), _registry, monkeypatch)
        assert report.problem is None and report.batches == (number - 1 if differs else len(lines) - 1)
        assert (report.divergence is not None and report.divergence.field == "key") is differs, report


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_recording_of_rows_lines_taken_apart_reads_the_same_both_ways(tmp_path: Path) -> None:
    """A recording of rows lines cut, garbled, reordered or edited as test_replay_stream
    takes recordings apart: read a line at a time, it reads as read whole."""
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    edits = _edits(path.read_bytes())
    assert len(edits) > 200
    for name, data in edits:
        assert _read_by_stream(data, peek=False) == _read_whole(data), name


# --- size ---------------------------------------------------------------------------------------


async def test_a_rows_line_is_at_most_60_percent_of_the_batch_record_it_stands_for(tmp_path: Path) -> None:
    """A batch of 100 echo calls: its rows line takes at most 60% of the bytes of the
    batch record it reads back as."""
    path = tmp_path / "large.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("large", record=path)
    await s.dispatch([openai_call(f"call_{i:04}", "echo", {"text": f"t{i}"}) for i in range(100)])
    s.close()
    [line] = _lines(path.read_bytes())[1:]
    assert kinds(path) == ["header", "rows"]
    batch = encode_line(read_line(line))
    assert len(line) <= 0.6 * len(batch), (len(line), len(batch))
    assert (await replay(path, Dispatcher(fake_registry(Counter(), {})))).ok


# --- what the one-pass builder takes --------------------------------------------------------------


async def test_a_result_whose_content_is_not_text_is_recorded_as_the_general_builder_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner's result whose content is no text (a number): not a rows line, but the
    batch record the general builder makes of it, and replay names that line as a
    problem instead of raising."""

    async def runner(call: ToolCall, ctx: Any) -> Any:
        return ToolResult(call.id, call.name, Status.ok, 3)  # type: ignore[arg-type]

    path = tmp_path / "n.jsonl"
    with _submitted(monkeypatch) as submitted:
        s = Dispatcher(fake_registry(Counter(), {}), runner=runner).session("n", record=path)
        await s.dispatch([openai_call("1", "echo", {"text": "a"})])
        s.close()
    [parts] = submitted
    record, plain = Recorder._record_of(*parts)
    assert not plain and record == part_by_part(parts, monkeypatch)
    assert kinds(path) == ["header", "batch"]
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.problem is not None and report.problem.startswith("line 2: ")
    assert "'content' is not text" in report.problem


async def test_a_cancelled_batch_recorded_as_rows_is_marked_by_the_runner_and_replays(tmp_path: Path) -> None:
    """A batch a cancellation cut (its last call unfinished), recorded as a rows line: the
    runner's `mark_cut_batch` gives the cut call its recorded result, and the recording
    replays, as it does for a batch line."""
    from threepass._runner import mark_cut_batch

    path = tmp_path / "cancelled.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("cancelled", record=path)
    await s.dispatch([openai_call("1", "echo", {"text": "a"})])
    with anyio.move_on_after(0.05):
        await s.dispatch([openai_call("2", "echo", {"text": "b"}), openai_call("3", "nap", {"ms": 10_000})])
    s.close()
    assert kinds(path) == ["header", "rows", "rows"]
    assert [row["how"] for row in read_lines(path)[-1]["plan"]] == ["ran", "unfinished"]
    assert mark_cut_batch(str(path))
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == 2, report


# --- reading ------------------------------------------------------------------------------------

_WRITTEN_ROWS = (
    ["a", "echo", '{"text": "x"}', None, "unfinished"],
    ["a", "run_tool", '{"name": "echo"}', "k", "unfinished", "echo"],
    ["a", "echo", '{"text": "x"}', "k", "ran", "ok", "x", False, False, False, False, 1.7e9, 0.25],
    ["a", "run_tool", "{}", "k", "deduped", "failed", "y", True, False, False, True, None, 1.0, "echo"],
)
_SPOILS = (None, 0, 1.5, True, "", "okay", [], {}, ["ok"])


def test_a_rows_record_checked_as_it_is_is_what_the_batch_checks_pass() -> None:
    """The stream checks a rows line's rows as they are, and asks the batch record's checks
    nothing more when they pass: every kind of row as a recorder writes it passes; with
    any one value of a row, or the record's run, seq or prev, spoiled, it passes only
    where `_well_formed` passes the batch record it stands for (which does not ask an
    unanswered call's id to be text, nor a result's flags to be booleans); and that batch
    is the same, field for field and in the same order, as the one made field by field."""

    def record(rows: list[list[Any]], extra: bool = False, **fields: Any) -> dict[str, Any]:
        made = {"type": "rows", "run": 3, "round": 1, "all_loaded": False, "rows": rows, "control": None}
        return made | {"seq": 2, "prev": "abc"} | fields | ({"edited": True} if extra else {})

    def checked(made: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        formed = _rows_formed(made)
        return _batch_of_rows(dict(made)), formed

    cases = 0
    for extra in (False, True):
        batch, formed = checked(record([list(r) for r in _WRITTEN_ROWS], extra))
        assert formed and _well_formed(batch, True)
        general: dict[str, Any] = {"type": "batch", "run": 3, "round": 1, "all_loaded": False}
        general |= {k: batch[k] for k in ("calls", "decisions", "plan", "results")}
        general |= {"control": None, "seq": 2, "prev": "abc"} | ({"edited": True} if extra else {})
        assert list(batch.items()) == list(general.items())
    for written in _WRITTEN_ROWS:
        for at in range(len(written)):
            for value in _SPOILS:
                row = list(written)
                row[at] = value
                try:
                    batch, formed = checked(record([list(_WRITTEN_ROWS[2]), row]))
                except ValueError:  # a row of another length: no batch, and not formed
                    assert not _rows_formed(record([row])), (row, value)
                    continue
                assert _well_formed(batch, True) or not formed, (row, value)
                cases += formed != _well_formed(batch, True)
    for field in ("run", "seq", "prev"):
        for value in _SPOILS:
            batch, formed = checked(record([list(r) for r in _WRITTEN_ROWS], **{field: value}))
            assert _well_formed(batch, True) or not formed, (field, value)
    for rows in (None, 3, "rows", [3], [[]], [["a"] * 7]):
        assert not _rows_formed(record(rows))  # type: ignore[arg-type]
    assert cases > 0  # some unanswered call's id the batch's checks let pass, and these do not


async def test_every_rows_line_a_session_writes_is_checked_as_it_is(tmp_path: Path) -> None:
    """The lines of a session's recording, of every kind of rows (answered, not, planned
    under another name), all pass the checks made of their rows as they are."""
    path = tmp_path / "rows.jsonl"
    await _session_batches(path)
    rows_lines = [
        line for line, kind in zip(_lines(path.read_bytes()), kinds(path), strict=True) if kind == "rows"
    ]
    assert len(rows_lines) >= 4
    for line in rows_lines:
        record = json.loads(line)
        assert _rows_formed(record)
        assert _well_formed(_batch_of_rows(record), True)


# --- the calls as pass 1 read them ---------------------------------------------------------------


async def test_a_rows_line_holds_each_call_as_pass_1_read_it_though_the_caller_changes_it_meanwhile(
    tmp_path: Path,
) -> None:
    """A caller (here a tool of the batch) that changes the call items while the batch runs,
    into values no rows line may hold (an id that is a number, arguments that are no text),
    changes nothing recorded: each row holds the id, name and arguments text that pass 1
    read and ran, and the recording replays."""
    calls = [openai_call("1", "echo", '{"text": "a"}'), openai_call("2", "meddle", {})]

    async def meddle(args: Any, ctx: Any) -> str:
        for item in calls:
            item["id"] = 7
            item["function"]["name"] = ["echo"]
            item["function"]["arguments"] = {"text": "changed"}
        return "meddled"

    def registry() -> Registry:
        r = fake_registry(Counter())
        r.add(Tool("meddle", "Changes the batch's items.", meddle, {"type": "object"}, deferred=False))
        return r

    path = tmp_path / "meddled.jsonl"
    s = Dispatcher(registry()).session("meddled", record=path)
    results = await s.dispatch(calls)
    s.close()
    assert [r.call_id for r in results] == ["1", "2"] and calls[0]["id"] == 7
    line = _lines(path.read_bytes())[1]
    assert json.loads(line)["type"] == "rows"
    rows = json.loads(line)["rows"]
    assert [row[:3] for row in rows] == [["1", "echo", '{"text": "a"}'], ["2", "meddle", "{}"]]
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.batches == 1 and report.calls == 2, report


def test_pass_1_keeps_what_it_read_in_place_only_when_asked_and_only_of_the_items_it_so_read() -> None:
    """`Planner.received`: left None, the plan keeps nothing; set to a list (a session that
    records), the plan keeps per call the id, name and text of an OpenAI chat item read in
    place, exactly as given (the name unstripped), and None for every other item: another
    shape, arguments with a float, or an item without an id (read as before, under "")."""
    items = [
        openai_call("1", " echo ", '{"text": "a"}'),
        ToolCall("2", "echo", {"text": "b"}),
        openai_call("3", "echo", '{"text": "c", "n": 1.5}'),
        {"type": "function", "function": {"name": "echo", "arguments": '{"text": "d"}'}},
    ]
    assert run_pass1(make_planner(), items).received is None
    planner = make_planner()
    planner.received = []
    plan = run_pass1(planner, items)
    assert plan.received == [("1", " echo ", '{"text": "a"}'), None, None, None]
    assert [p.call_id for p in plan.calls] == ["1", "2", "3", ""]
    assert plan == run_pass1(make_planner(), items)  # what is kept is no part of the plan's equality


# text with no escape in its JSON (one with an escape is scanned further, and goes part by part)
_WORDS = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, blacklist_characters='"\\'))
_ECHO_TEXT = _WORDS.map(lambda text: json.dumps({"text": text}, ensure_ascii=False))
_RUNS = st.one_of(  # (name, arguments text) of a call that runs
    st.tuples(st.sampled_from(["echo", " echo", "echo\n", "ec<|x|>ho", "\techo "]), _ECHO_TEXT),
    st.tuples(
        st.just("echo"), _WORDS.map(lambda text: json.dumps({"text": text}, indent=1, ensure_ascii=False))
    ),
    st.tuples(
        st.just("run_tool"),
        _WORDS.map(lambda t: json.dumps({"name": "echo", "args": {"text": t}}, ensure_ascii=False)),
    ),
)
_FAILS = st.tuples(
    st.sampled_from(["echo", "nope", ""]), st.sampled_from(['{"text": 1.5}', "[]", "{", "", "{} "])
)
_ITEMS = st.one_of(
    st.lists(st.builds(lambda i, c: openai_call(str(i), *c), st.integers(0, 20), _RUNS), max_size=4),
    st.lists(  # now and then a call that fails, or an item without an id
        st.one_of(
            st.builds(lambda i, c: openai_call(str(i), *c), st.integers(0, 20), _RUNS | _FAILS),
            st.builds(lambda c: {"type": "function", "function": {"name": c[0], "arguments": c[1]}}, _RUNS),
        ),
        max_size=4,
    ),
)


@settings(max_examples=300, deadline=None)
@given(items=_ITEMS)
def test_rows_taken_from_what_pass_1_read_are_the_rows_read_from_the_items(
    items: list[dict[str, Any]],
) -> None:
    """For any batch of chat items (names with spaces or markers, run_tool, floats, text
    that is no object, ids repeated or missing), the rows built from `Plan.received` are
    those built by reading and checking each item, or both builders decline the batch."""
    planner = make_planner()
    planner.received = []
    plan = run_pass1(planner, items)
    results = [
        p.outcome or ToolResult(p.call_id, p.name, Status.ok, f"ran {p.name}", started=1.0, duration=0.5)
        for p in plan.calls
    ]
    kept = _common_rows(items, plan.calls, results, False, False, plan.received)
    read = _common_rows(items, plan.calls, results, False, False)
    assert kept == read
