"""Replay's quick ways against its general ones: the recording read a line at a time
against `_read`'s whole reading, the results served as recorded compared by identity
against field by field, and a batch's calls read in one pass against `_replayed_call`."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dispatcher._recording as recording_module
from dispatcher import Deny, Dispatcher, DispatchInterrupted, HookBlocked, Registry, Tool, ToolCall
from dispatcher._recording import (
    _batch_of_rows,
    _BatchServer,
    _read_data,
    _replay,
    _replayed_call,
    _replayed_calls,
    _rows_calls,
    _rows_formed,
    _Stream,
    line_hash,
)

from ._fakes import Counter, call, fake_registry, openai_call
from .test_recording import SECRETS, _cutting_registry, _echo_registry, _secret_request, record_session

# --- recordings to take apart ---------------------------------------------------------------


async def _plain(path: Path) -> Callable[[], Registry]:
    await record_session(path, Counter(), {"a": "v1"})
    return lambda: fake_registry(Counter(), {})


async def _cut(path: Path) -> Callable[[], Registry]:
    s = Dispatcher(_cutting_registry()).session("cut", record=path)
    await s.dispatch([call("a", "echo", text="before")])
    for i, how in enumerate(["interrupt", "block", "keyboard"]):
        calls = [
            call(f"b{i}", "echo", text="one"),
            call(f"c{i}", "cut", how=how),
            call(f"d{i}", "echo", text="2"),
        ]
        with pytest.raises((DispatchInterrupted, HookBlocked, KeyboardInterrupt)):
            await s.dispatch(calls)
    await s.dispatch([call("e", "echo", text="after")])
    s.close()
    return _cutting_registry


def _gated_registry() -> Registry:
    reg = fake_registry(Counter(), {})
    reg.add(Tool("risky", "r", lambda a, c: "ran", confirm=True, deferred=False))
    return reg


async def _gated(path: Path) -> Callable[[], Registry]:
    d = Dispatcher(_gated_registry(), gate=lambda c, ctx: Deny("not now"))
    s = d.session("g", record=path)
    await s.dispatch([ToolCall("1", "risky", {}), call("2", "echo", text="x")])
    await s.dispatch([ToolCall("3", "risky", {"why": "again"})])
    s.close()
    return _gated_registry


async def _secret(path: Path) -> Callable[[], Registry]:
    s = Dispatcher(_echo_registry(Counter())).session("rec", record=path)
    token = {"Private-Token": SECRETS["openai"]}
    await s.dispatch(
        [_secret_request("1"), openai_call("2", "request", {"url": "https://api.test/", "headers": token})]
    )
    await s.dispatch([_secret_request("3")])
    await s.dispatch([_secret_request("4", header=SECRETS["other"])])
    s.close()
    return lambda: _echo_registry(Counter())


async def _continued(path: Path) -> Callable[[], Registry]:
    d = Dispatcher(fake_registry(Counter(), {}))
    await d.session("one", record=path).dispatch([call("1", "echo", text="x")])
    await d.session("two", record=path).dispatch([call("2", "echo", text="y"), call("3", "echo", text="y")])
    return lambda: fake_registry(Counter(), {})


RECORDINGS = [_plain, _cut, _gated, _secret, _continued]


# --- ways to take them apart ------------------------------------------------------------------


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")[:-1]


def _joined(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def _rechained(records: list[dict[str, Any]]) -> bytes:
    """`records` as the recorder writes them, each `prev` the hash of the line before."""
    lines: list[bytes] = []
    for record in records:
        if lines and "prev" in record:
            record["prev"] = line_hash(lines[-1])
        lines.append(json.dumps(record).encode())
    return _joined(lines)


def _edits(data: bytes, ends: int | None = None, chained: bool = False) -> list[tuple[str, bytes]]:
    """The recording `data` taken apart in many ways, each named; with `ends`, each line's
    own edits only for its first and last `ends` lines (the header, the first batches,
    the last, which a stream reads unlike the lines between); with `chained`, a field
    changed only with the chain made again after it (the reader, which stops at a broken
    chain, is held to the whole reading for the others)."""
    lines = _lines(data)
    out: list[tuple[str, bytes]] = [("as recorded", data), ("no last newline", data[:-1])]
    out += [("empty", b""), ("a newline", b"\n"), ("header only", lines[0] + b"\n")]
    out += [("header, no newline", lines[0]), ("two newlines at the end", data + b"\n")]
    out += [("crlf", data.replace(b"\n", b"\r\n")), ("garbage after", data + b'{"type": ')]
    for i in range(len(lines)):
        if ends is not None and ends <= i < len(lines) - ends:
            continue
        rest = lines[i + 1 :]
        out.append((f"without line {i + 1}", _joined(lines[:i] + rest)))
        out.append((f"line {i + 1} twice", _joined(lines[: i + 1] + lines[i:])))
        out.append((f"cut in line {i + 1}", _joined(lines[:i]) + lines[i][: len(lines[i]) // 2]))
        out.append((f"cut in line {i + 1}, then more", _joined([*lines[:i], lines[i][:-3], *rest])))
        out.append((f"line {i + 1} emptied", _joined([*lines[:i], b"", *rest])))
        for junk in (b"{}", b"[]", b"1", b'"x"', b"null", b'{"type": "batch"}', b"NaN", b"\xff\xfe"):
            out.append((f"line {i + 1} is {junk!r}", _joined([*lines[:i], junk, *rest])))
        if i + 1 < len(lines):
            out.append(
                (
                    f"lines {i + 1} and {i + 2} swapped",
                    _joined([*lines[:i], lines[i + 1], lines[i], *rest[1:]]),
                )
            )
        out.append((f"blank line after {i + 1}", _joined([*lines[: i + 1], b"", *rest])))
        record = json.loads(lines[i])
        for name, change in _record_changes(record):
            changed = [json.loads(line) for line in lines]
            changed[i] = change(json.loads(lines[i]))
            if not chained:
                out.append(
                    (f"line {i + 1}: {name}", _joined([*lines[:i], json.dumps(changed[i]).encode(), *rest]))
                )
            out.append((f"line {i + 1}: {name}, chained again", _rechained(changed)))
    return out


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        target: Any = record
        for part in path[:-1]:
            target = target[part]
        if isinstance(target, dict | list):  # a result that never finished is None
            target[path[-1]] = value
        return record

    return change


def _drop(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        target: Any = record
        for part in path[:-1]:
            target = target[part]
        if isinstance(target, dict):
            del target[path[-1]]
        return record

    return change


def _record_changes(
    record: Mapping[str, Any],
) -> list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]]:
    """Edits of one record, each changing one field the reader or replay looks at."""
    changes: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = []
    for key, value in [("seq", 99), ("seq", 1.0), ("seq", True), ("prev", "0" * 16), ("prev", 5)]:
        changes.append((f"{key} {value!r}", _set((key,), value)))
    changes.append(("a second header", _set(("type",), "header")))
    changes.append(("a note", _set(("type",), "note")))
    changes.append(("no type", _drop(("type",))))
    if record.get("type") == "header":
        for key, value in [("format", 1), ("format", 3), ("format", 2.0), ("mode", "sideways"), ("seq", 1)]:
            changes.append((f"header {key} {value!r}", _set((key,), value)))
        changes.append(("header continues", _set(("continues",), {"seq": 7, "run": 3})))
        changes.append(("header meta", _set(("meta",), [])))
        return changes
    if record.get("type") != "batch":
        return changes
    for key, value in [
        ("run", 2**70),
        ("run", "1"),
        ("round", 1.5),
        ("control", "HookBlocked"),
        ("control", 3),
        ("control", []),
        ("control", {"type": "HookBlocked"}),
    ]:
        changes.append((f"{key} {value!r}", _set((key,), value)))
    changes.append(("decisions", _set(("decisions",), {"x": {"deny": "no"}})))
    changes.append(("decisions not objects", _set(("decisions",), {"x": 1})))
    changes.append(("all loaded", _set(("all_loaded",), True)))
    changes.append(("no calls", _set(("calls",), [])))
    for n in range(len(record.get("calls", []))):
        for key, value in [("status", "failed"), ("status", "nope"), ("content", "other"), ("name", "other")]:
            changes.append((f"results[{n}].{key} {value!r}", _set(("results", n, key), value)))
        for key, value in [("deduped", True), ("cached", True), ("retryable", "yes"), ("duration", "1")]:
            changes.append((f"results[{n}].{key} {value!r}", _set(("results", n, key), value)))
        changes.append((f"results[{n}] none", _set(("results", n), None)))
        changes.append((f"results[{n}] no call_id", _drop(("results", n, "call_id"))))
        for key, value in [("how", "ran"), ("how", "deduped"), ("how", "unfinished"), ("how", "stopped")]:
            changes.append((f"plan[{n}].{key} {value!r}", _set(("plan", n, key), value)))
        for key, value in [("key", None), ("key", "f" * 32), ("key", 3), ("name", "echo"), ("name", "other")]:
            changes.append((f"plan[{n}].{key} {value!r}", _set(("plan", n, key), value)))
        for key, value in [("arguments", '{"text": "z"}'), ("arguments", ""), ("arguments", {"text": "x"})]:
            changes.append((f"calls[{n}].{key} {value!r}", _set(("calls", n, key), value)))
        changes.append((f"calls[{n}].id", _set(("calls", n, "id"), 7)))
        changes.append((f"calls[{n}].opaque", _set(("calls", n, "opaque"), True)))
        changes.append((f"calls[{n}] raw", _set(("calls", n), {"raw": {"id": "r", "name": "echo"}})))
    return changes


# --- the reader ---------------------------------------------------------------------------------


def _read_by_stream(data: bytes, *, peek: bool) -> tuple[Any, ...]:
    """What a stream reads of `data`, a rows record it hands out as read (its rows well
    formed, `_rows_formed`) as the batch record it stands for."""
    stream = _Stream(data, "rec.jsonl")
    if peek:
        stream.any()
        stream.any()
    batches = []
    for number, record in stream:
        if record["type"] == "rows":
            assert _rows_formed(record), number
            record = _batch_of_rows(dict(record))
        batches.append((number, record))
    assert next(stream, None) is None and not stream.any()
    return stream.header, batches, stream.truncated, stream.problem, stream.warnings


def _read_whole(data: bytes) -> tuple[Any, ...]:
    whole = _read_data(data, "rec.jsonl")
    return whole.header, whole.batches, whole.truncated, whole.problem, whole.warnings


@pytest.mark.parametrize("recording", RECORDINGS)
async def test_a_recording_read_a_line_at_a_time_reads_as_read_whole(tmp_path: Path, recording: Any) -> None:
    """However a recording is edited, cut or garbled, reading it a line at a time finds the
    header, batches (lines and records), truncation, problem and warnings of a whole reading."""
    path = tmp_path / "r.jsonl"
    await recording(path)
    for name, data in _edits(path.read_bytes()):
        whole = _read_whole(data)
        assert _read_by_stream(data, peek=False) == whole, name
        assert _read_by_stream(data, peek=True) == whole, name


@pytest.mark.parametrize("recording", [_plain, _cut])
async def test_a_recording_cut_anywhere_reads_as_read_whole(tmp_path: Path, recording: Any) -> None:
    """A recording cut after any byte, or with any byte changed, reads the same both ways."""
    path = tmp_path / "r.jsonl"
    await recording(path)
    data = path.read_bytes()
    for end in range(len(data) + 1):
        assert _read_by_stream(data[:end], peek=False) == _read_whole(data[:end]), end
    for at in range(0, len(data), 7):
        for byte in (b"\n", b"0", b"}", b"\x80"):
            changed = data[:at] + byte + data[at + 1 :]
            assert _read_by_stream(changed, peek=False) == _read_whole(changed), (at, byte)


# how far ahead a stream reads: one batch, three, and lines up to 300 bytes (a line at a
# time for most of these recordings' batch lines); the tests above read with the default
_READ_AHEADS = {"one batch": (1, 1 << 20), "three batches": (3, 1 << 20), "300 bytes": (64, 300)}


@pytest.mark.parametrize("anyio_backend", ["trio"])  # the reading alone: no loop changes it
@pytest.mark.parametrize("ahead", list(_READ_AHEADS))
@pytest.mark.parametrize("recording", RECORDINGS)
async def test_a_recording_read_a_few_batches_ahead_reads_as_read_whole(
    tmp_path: Path, recording: Any, ahead: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However far ahead of the batches handed out a stream reads, any edit, cut or garbled
    byte of a recording reads as a whole reading reads it."""
    monkeypatch.setattr(recording_module, "_READ_AHEAD", _READ_AHEADS[ahead][0])
    monkeypatch.setattr(recording_module, "_READ_AHEAD_BYTES", _READ_AHEADS[ahead][1])
    path = tmp_path / "r.jsonl"
    await recording(path)
    data = path.read_bytes()
    for name, edited in _edits(data):
        assert _read_by_stream(edited, peek=True) == _read_whole(edited), name
    for end in range(0, len(data) + 1, 3):
        assert _read_by_stream(data[:end], peek=False) == _read_whole(data[:end]), end
    for at in range(0, len(data), 11):
        changed = data[:at] + b"\n" + data[at + 1 :]
        assert _read_by_stream(changed, peek=False) == _read_whole(changed), at


async def _many_batches(path: Path, batches: int, text: str = "x") -> None:
    d = Dispatcher(fake_registry(Counter(), {}))
    s = d.session("many", mode="direct", record=path)
    for n in range(batches):
        s.new_run()
        await s.dispatch([call(f"c{n}", "echo", text=f"{text}{n}")])
    s.close()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_stream_reads_at_most_so_many_batches_or_bytes_ahead(tmp_path: Path) -> None:
    """A stream holds no more than `_READ_AHEAD` batches read and not handed out, nor reads
    ahead more than `_READ_AHEAD_BYTES` of lines (beyond the line it is in), and a long
    recording still reads as read whole."""
    path = tmp_path / "r.jsonl"
    await _many_batches(path, 150)
    data = path.read_bytes()
    stream = _Stream(data, "r.jsonl")
    handed = 0
    for _ in stream:
        handed += 1
        assert stream._number - 1 - handed <= recording_module._READ_AHEAD  # read, not handed out
    assert handed == 150 and stream.problem is None and not stream.truncated
    assert _read_by_stream(data, peek=False) == _read_whole(data)
    big = tmp_path / "big.jsonl"
    await _many_batches(big, 12, text="y" * 400_000)  # lines of about 0.8 MB: one or two a run
    stream = _Stream(big.read_bytes(), "big.jsonl")
    first = next(stream)
    assert first[0] == 2 and stream._number <= 4  # the header, one or two batches, the one after
    assert _read_by_stream(big.read_bytes(), peek=False) == _read_whole(big.read_bytes())


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("ahead", list(_READ_AHEADS))
async def test_a_long_recording_replays_the_same_however_far_ahead_it_is_read(
    tmp_path: Path, ahead: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording of many batches, as recorded and with an edit deep inside it, replays to
    the same report read some batches ahead and read whole."""
    monkeypatch.setattr(recording_module, "_READ_AHEAD", _READ_AHEADS[ahead][0])
    monkeypatch.setattr(recording_module, "_READ_AHEAD_BYTES", _READ_AHEADS[ahead][1])
    path = tmp_path / "r.jsonl"
    await _many_batches(path, 90)
    data = path.read_bytes()
    registry = lambda: fake_registry(Counter(), {})  # noqa: E731
    report = await _replay_both(data, registry, monkeypatch)
    assert report.ok and report.batches == 90
    lines = _lines(data)
    records = [json.loads(line) for line in lines]
    if "rows" in records[70]:  # a key the call's arguments do not make
        records[70]["rows"][0][3] = "f" * 32
    else:
        records[70]["plan"][0]["key"] = "f" * 32
    edited = await _replay_both(_rechained(records), registry, monkeypatch)
    assert edited.divergence is not None and edited.divergence.batch == 70
    assert edited.divergence.field == "key"
    garbled = await _replay_both(_joined([*lines[:80], b"{garbled", *lines[81:]]), registry, monkeypatch)
    assert garbled.divergence is None and garbled.batches == 79  # those before the line
    assert garbled.problem is not None and garbled.problem.startswith("line 81 is not a JSON record")


@given(
    st.lists(
        st.sampled_from([b"", b"{}", b"[", b"x", b"\n", b"\n\n", b'{"type":"batch"}', b"\xff"]), max_size=6
    )
)
@settings(max_examples=200, deadline=None)
def test_junk_reads_the_same_both_ways(pieces: list[bytes]) -> None:
    """Junk after a well-formed header, in any mix, reads the same both ways."""
    header = b'{"type": "header", "format": 2, "seq": 0, "mode": "direct"}\n'
    data = header + b"".join(pieces)
    assert _read_by_stream(data, peek=False) == _read_whole(data)


# --- replay -------------------------------------------------------------------------------------


class _NeverServed(list[Any]):
    """A `served` list that never holds what was served: every result is compared field by field."""

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, object())


_SERVER_MADE = _BatchServer.__init__


def _general_server(self: _BatchServer, *args: Any, **kwargs: Any) -> None:
    _SERVER_MADE(self, *args, **kwargs)
    assert self.rows is None  # read whole: every batch a batch record
    self.served = _NeverServed([None] * len(self.recorded))
    self.cutting = self.control in ("DispatchInterrupted", "HookBlocked", "KeyboardInterrupt")


async def _replay_both(
    data: bytes, registry: Callable[[], Registry], monkeypatch: pytest.MonkeyPatch, **dispatcher: Any
) -> Any:
    """The report of replaying `data` the quick way; asserts the general way reports the same."""
    quick = await _replay(_Stream(data, "rec.jsonl"), Dispatcher(registry(), **dispatcher))
    with monkeypatch.context() as m:
        m.setattr(_BatchServer, "__init__", _general_server)
        general = await _replay(_Stream(data, "rec.jsonl", whole=True), Dispatcher(registry(), **dispatcher))
    assert quick == general
    return quick


# on trio alone: what is compared is the reading and the comparison, which no loop changes
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("recording", RECORDINGS)
async def test_a_recording_taken_apart_replays_as_the_general_way_replays_it(
    tmp_path: Path, recording: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every edit of every field replay compares, every cut and every garbled line: the same
    report (batches, calls, divergence, truncation, problem, warnings) read a line at a time
    and served results compared by identity, as read whole and compared field by field."""
    path = tmp_path / "r.jsonl"
    registry = await recording(path)
    data = path.read_bytes()
    assert (await _replay_both(data, registry, monkeypatch)).ok
    seen: set[Any] = set()
    edits = _edits(data, ends=2, chained=True)
    # half of them, a different half for each recording (the reading tests take every edit)
    for name, edited in random.Random(recording.__name__).sample(edits, len(edits) // 2):
        try:
            report = await _replay_both(edited, registry, monkeypatch)
        except KeyboardInterrupt:  # an edit that makes a Ctrl-C the replay's own: both raise it
            with pytest.raises(KeyboardInterrupt):
                await _replay(_Stream(edited, "rec.jsonl", whole=True), Dispatcher(registry()))
            continue
        except Exception as exc:
            raise AssertionError(name) from exc
        div = report.divergence
        seen.add((div and div.field, report.problem is not None, report.truncated))
    fields = {field for field, _, _ in seen}
    assert {"content", "status", "name", "how", "key"} <= fields or recording is not _plain, fields


@pytest.mark.parametrize("recording", RECORDINGS)
async def test_other_tools_at_replay_report_the_same_both_ways(
    tmp_path: Path, recording: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tools that answer otherwise at replay, a rewriter, a tool removed: the same report."""
    path = tmp_path / "r.jsonl"
    registry = await recording(path)
    data = path.read_bytes()

    def louder() -> Registry:
        reg = registry()
        for name in reg.names():
            if name in ("echo", "request", "read"):
                reg.add(attrs.evolve(reg.get(name), handler=lambda a, c: "LOUD"), replace=True)
        return reg

    def fewer() -> Registry:
        reg = registry()
        reg.remove(sorted(reg.names())[0])
        return reg

    def upper(event: Any, state: Any) -> None:
        return None

    await _replay_both(data, louder, monkeypatch)
    await _replay_both(data, fewer, monkeypatch)
    await _replay_both(data, registry, monkeypatch, rewriters=[upper])
    for end in (len(data) - 5, len(data) // 2):
        await _replay_both(data[:end], louder, monkeypatch)


async def test_a_divergence_early_still_reports_a_problem_late(tmp_path: Path) -> None:
    """A divergence early and a garbled line at the end: both are in the report, as the
    whole file was read."""
    path = tmp_path / "r.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    lines = _lines(path.read_bytes())
    records = [json.loads(line) for line in lines]
    records[1]["results"][1]["content"] = "not x"
    data = _rechained(records)
    garbled = data + b"{garbled\n"
    report = await _replay(_Stream(garbled, "r.jsonl"), Dispatcher(fake_registry(Counter(), {})))
    assert report.divergence is not None and report.divergence.batch == 3  # served "not x", deduped
    assert report.problem is not None and report.problem.startswith("line 6 is not a JSON record: ")
    cut = await _replay(_Stream(data[:-9], "r.jsonl"), Dispatcher(fake_registry(Counter(), {})))
    assert cut.divergence is not None and cut.truncated and cut.problem is None


async def test_a_stream_hands_out_no_batch_before_the_next_line_vouches_for_it(tmp_path: Path) -> None:
    """The last batch read waits for the line after it: an edit it shows stops that batch
    from replaying, as a whole reading stops it."""
    path = tmp_path / "r.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    lines = _lines(path.read_bytes())
    records = [json.loads(line) for line in lines]
    records[2]["results"][0]["content"] = "edited"  # its hash no longer matches line 4's prev
    data = _joined([*lines[:2], json.dumps(records[2]).encode(), *lines[3:]])
    stream = _Stream(data, "r.jsonl")
    assert [line for line, _ in stream] == [2]
    assert stream.problem == "line 3: edited (its hash does not match the next record's prev)"


# --- a batch's calls ------------------------------------------------------------------------------

_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.sampled_from(['{"a": 1}', "{}", "[1]"])
)
_CALLS = st.dictionaries(
    st.sampled_from(["id", "name", "arguments", "raw", "opaque", "unreadable", "other"]), _VALUES, max_size=5
)


_PLAIN = st.fixed_dictionaries(
    {
        "id": st.text(max_size=3),
        "name": st.text(max_size=3),
        "arguments": st.sampled_from(['{"a": 1}', "{}", "x"]),
    },
    optional={key: _VALUES for key in ("raw", "opaque", "unreadable", "other")},
)


@given(
    st.lists(st.one_of(_CALLS, _PLAIN), max_size=4),
    st.lists(st.sampled_from(["ran", "stopped", "deduped"]), max_size=4),
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_batchs_calls_read_in_one_pass_are_those_replayed_call_makes(recorded: Any, hows: Any) -> None:
    """For recorded calls of any shape: the calls `_replayed_call` makes, the ids as replay
    names them, and the texts only when every call's arguments are text."""
    plan = [{"how": hows[i % len(hows)] if hows else "ran", "name": "n"} for i in range(len(recorded))]
    calls, ids, texts, stopped = _replayed_calls(recorded, plan)
    assert calls == [_replayed_call(c) for c in recorded]
    assert [type(c) for c in calls] == [type(_replayed_call(c)) for c in recorded]
    assert ids == [str(c.get("id", "")) for c in recorded]
    arguments = [c.get("arguments") for c in recorded]
    assert texts == (arguments if all(type(a) is str for a in arguments) else None)
    assert stopped == [(ids[i], "n") for i, row in enumerate(plan) if row["how"] == "stopped"]


_ROW_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=3), st.sampled_from(['{"a": 1}', "{}", ""])
)
_ROWS = st.lists(
    st.one_of(
        st.tuples(st.text(max_size=3), _ROW_VALUES, _ROW_VALUES),  # id (text, as checked), name, arguments
        st.tuples(st.text(max_size=3), st.text(max_size=3), st.sampled_from(['{"a": 1}', "{}"])),
    ).flatmap(
        lambda call: st.tuples(
            st.just(list(call)),
            st.sampled_from(["ran", "stopped", "deduped", "unfinished"]),
            st.booleans(),  # answered
            st.one_of(st.none(), st.text(max_size=3)),  # planned under another name
        )
    ),
    max_size=4,
)


@given(_ROWS)
@settings(max_examples=150, deadline=None)
def test_a_rows_records_calls_read_as_they_are_are_those_of_the_batch_record(made: Any) -> None:
    """For rows of any values a checked rows record may hold: the calls, ids and texts
    `_rows_calls` reads of them, and the calls it marks stopped, are those
    `_replayed_calls` reads of the batch record they stand for."""
    rows = []
    for item, how, answered, planned in made:
        row = [*item, None, how]
        if answered:
            row += ["ok", "x", False, False, False, False, None, 0.0]
        rows.append(row + ([planned] if planned is not None else []))
    record = {"type": "rows", "run": 1, "round": 1, "all_loaded": False, "rows": rows, "control": None}
    record |= {"seq": 1, "prev": ""}
    assume_formed = all(type(row[-1] if len(row) % 2 == 0 else row[1]) is str for row in rows)
    assert _rows_formed(record) == assume_formed
    batch = _batch_of_rows(json.loads(json.dumps(record)))
    got = _rows_calls(rows)
    want = _replayed_calls(batch["calls"], batch["plan"])
    assert got == want  # the calls, ids, texts and the calls to mark stopped
    assert [type(c) for c in got[0]] == [type(c) for c in want[0]]


async def test_a_secret_in_a_served_result_is_compared_as_the_general_way_compares_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording edited to hold a secret itself, in a call and in its served result (the
    chain made again): the general way redacts the result before comparing, and so
    diverges; the identity check must not skip that."""
    path = tmp_path / "r.jsonl"
    registry = await _secret(path)
    records = [json.loads(line) for line in _lines(path.read_bytes())]
    records[1]["calls"][0]["arguments"]["headers"]["X-Api-Key"] = SECRETS["header"]
    records[1]["results"][0]["content"] = "echoed " + SECRETS["header"]
    report = await _replay_both(_rechained(records), registry, monkeypatch)
    assert report.divergence is not None and report.divergence.field == "content", report
    assert (report.divergence.batch, report.divergence.index) == (1, 0)


# --- a batch record's shape ---------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)
_TEXT_OR_NOT = st.one_of(st.text(max_size=3), _JSON)
_RESULT = st.fixed_dictionaries(
    {},
    optional={
        "call_id": _TEXT_OR_NOT,
        "name": _TEXT_OR_NOT,
        "status": st.one_of(st.sampled_from(["ok", "failed", "denied", "nope"]), _JSON),
        "content": _TEXT_OR_NOT,
        "duration": st.one_of(st.floats(allow_nan=False), st.integers(), _JSON),
    },
)
_ROW = st.fixed_dictionaries(
    {}, optional={"name": _TEXT_OR_NOT, "key": st.one_of(st.none(), _TEXT_OR_NOT), "how": _TEXT_OR_NOT}
)


@st.composite
def _batch_records(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(0, 3))
    record: dict[str, Any] = {
        "run": draw(st.one_of(st.integers(), _JSON)),
        "calls": draw(st.one_of(st.lists(st.one_of(st.just({}), _JSON), min_size=n, max_size=n), _JSON)),
        "plan": draw(st.one_of(st.lists(st.one_of(_ROW, _JSON), min_size=n, max_size=n), _JSON)),
        "results": draw(
            st.one_of(st.lists(st.one_of(st.none(), _RESULT, _JSON), min_size=n, max_size=n), _JSON)
        ),
        "seq": draw(st.one_of(st.integers(), _JSON)),
        "prev": draw(_TEXT_OR_NOT),
        "decisions": draw(
            st.one_of(st.dictionaries(st.text(max_size=2), st.one_of(st.just({}), _JSON)), _JSON)
        ),
    }
    for name in draw(st.lists(st.sampled_from(sorted(record)), max_size=2)):
        record.pop(name, None)
    return record


def _problem_found_in_full(record: Mapping[str, Any], chained: bool) -> str | None:
    """`_batch_problem` without its quick check: every field looked at in turn."""
    real = recording_module._well_formed
    recording_module._well_formed = lambda record, chained: False
    try:
        return recording_module._batch_problem(record, chained)
    finally:
        recording_module._well_formed = real


@given(_batch_records(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_a_record_taken_as_well_formed_has_no_problem(record: dict[str, Any], chained: bool) -> None:
    """`_well_formed`, the quick check, says a record is well formed only where
    `_batch_problem` finds nothing wrong with it."""
    if recording_module._well_formed(record, chained):
        assert _problem_found_in_full(record, chained) is None


_JUNK = [None, 0, 1, 1.0, 1.5, True, False, "", "x", "ok", [], [1], {}, {"a": 1}, 2**70, "\ud800"]


def _field_paths(record: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    paths: list[tuple[Any, ...]] = [(name,) for name in ("run", "calls", "plan", "results", "seq", "prev")]
    paths.append(("decisions",))
    for n in range(len(record["calls"])):
        paths += [("calls", n), ("plan", n), ("results", n)]
        paths += [("plan", n, name) for name in ("name", "key", "how")]
        paths += [("results", n, name) for name in ("call_id", "name", "status", "content", "duration")]
    return paths


@pytest.mark.parametrize("recording", RECORDINGS)
async def test_a_record_changed_in_any_field_is_well_formed_only_if_it_has_no_problem(
    tmp_path: Path, recording: Any
) -> None:
    """Every field `_batch_problem` checks, set to every kind of JSON value or removed: the
    quick check says well formed only where `_batch_problem` finds nothing, and says so of
    every record as the recorder writes it."""
    path = tmp_path / "r.jsonl"
    await recording(path)
    well_formed = recording_module._well_formed
    for line in _lines(path.read_bytes())[1:]:
        record = json.loads(line)
        if record["type"] == "session":  # where another session's batches begin: no batch
            continue
        assert well_formed(record, True) and well_formed(record, False)
        for field in _field_paths(record):
            for change in [_drop(field), *(_set(field, junk) for junk in _JUNK)]:
                changed = change(json.loads(line))
                for chained in (True, False):
                    if well_formed(changed, chained):
                        assert _problem_found_in_full(changed, chained) is None, (field, changed)
