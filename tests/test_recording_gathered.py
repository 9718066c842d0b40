"""A recording whose batches need not wait (`record_wait=False`): each batch's record is made
on the loop as the batch returns and gathered with the next ones; the loop writes them with
one `write` at the end of the batch in which the first has waited `_GATHER`, and the writer
thread writes them once batches stop coming. What a crash can lose is bounded in time, the
chain holds across both ways of writing, and a file replaced meanwhile is noticed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import Allow, Dispatcher, Registry, Tool, _recording, replay
from dispatcher._recording import _GATHER, _GATHER_LONGEST, encode_line, read_recording

from ._fakes import TEXT_SCHEMA, Counter, fake_registry, openai_call
from ._recorded import first_results, kinds, lines_in, read_lines, until_lines
from .test_recording import SECRETS, _echo_registry

ROOT = Path(__file__).resolve().parent.parent
_REAL_WRITE = os.write


def _session(path: Path, name: str = "gathered", registry: Registry | None = None, **options: Any) -> Any:
    d = Dispatcher(registry or fake_registry(Counter(), {}), **options)
    return d.session(name, record=path, record_wait=False)


def _batch(n: int, size: int = 1) -> list[dict[str, Any]]:
    return [openai_call(f"{n}-{i}", "echo", {"text": f"{n}/{i}"}) for i in range(size)]


async def test_while_batches_keep_coming_the_loop_writes_what_has_waited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each batch, every batch that returned `_GATHER` seconds before this one began is
    in the file: the loop writes the records gathered at the end of the batch in which the
    first of them has waited that long. Once the file is open, the writer thread writes
    none of them, and the loop writes far fewer times than there are batches."""
    path = tmp_path / "busy.jsonl"
    s = _session(path)
    await s.dispatch(_batch(0))  # opens the file: the writer thread's to do
    assert s.recorder.flush(10)  # ... and done with it (the loop writes only once it is)
    # the loop's part alone: on a busy machine, a pause of the loop's thread between two
    # batches would let the writer thread take what was gathered (as it should: no batch
    # ended), and a write held up past WRITE_STALL would send lines to it for a while
    monkeypatch.setattr(_recording, "WRITE_STALL", 3600.0)
    monkeypatch.setattr(_recording.Recorder, "_look_at_gathered", lambda self: _GATHER_LONGEST)
    writers: list[bool] = []

    def watched(fd: int, data: Any) -> int:
        if bytes(data[:7]) == b'{"type"':
            writers.append(threading.current_thread() is threading.main_thread())
        return _REAL_WRITE(fd, data)

    os_write, os.write = os.write, watched
    try:
        returned: list[float] = [0.0]  # when each batch returned (batch 0 counts as long ago)
        for n in range(1, 400):
            began = time.monotonic()
            await s.dispatch(_batch(n))
            returned.append(time.monotonic())
            written = lines_in(path) - 1
            due = sum(1 for t in returned if t <= began - _GATHER)
            assert written >= due, (n, written, due)
    finally:
        os.write = os_write
    assert writers and all(writers)  # every write on the loop's thread
    assert len(writers) < 200  # many batches to a write
    monkeypatch.undo()
    s.close()
    assert first_results(path) == [f"{n}/0" for n in range(400)]


async def test_once_batches_stop_the_writer_thread_writes_what_was_gathered(tmp_path: Path) -> None:
    """Batches that stop: what they gathered is in the file within `_GATHER_LONGEST` and a
    little more, with no batch ending and the session left open."""
    path = tmp_path / "idle.jsonl"
    s = _session(path)
    for n in range(5):
        await s.dispatch(_batch(n))
    await anyio.sleep(0.1)
    for n in range(5, 12):
        await s.dispatch(_batch(n))
    stopped = time.monotonic()
    await until_lines(path, 13)
    assert time.monotonic() - stopped < _GATHER_LONGEST + 1.0  # a busy machine may be slow to run the thread
    assert first_results(path) == [f"{n}/0" for n in range(12)]
    s.close()


async def test_a_large_batch_is_in_the_file_as_it_returns_and_wakes_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of `_WRITTEN_AT_ONCE` calls or more, once the file is open, is written as it
    ends, with any small ones gathered before it: its line is in the file when it returns,
    and the writer thread is not poked to watch for it (it would wake beside the loop)."""
    path = tmp_path / "large.jsonl"
    s = _session(path)
    recorder = s.recorder
    large = _recording._WRITTEN_AT_ONCE
    await s.dispatch(_batch(0))  # the thread opens the file
    assert recorder.flush(5)
    with anyio.fail_after(5):
        while recorder._watching:  # noqa: ASYNC110  # the thread's own state: polled
            await anyio.sleep(0.005)  # nothing gathered for a while: it stops watching
    await s.dispatch(_batch(1, size=large))
    assert lines_in(path) == 3 and not recorder._watching  # written, and nobody poked
    monkeypatch.setattr(_recording, "_GATHER", 10.0)  # the thread does not take it meanwhile
    await s.dispatch(_batch(2))
    assert lines_in(path) == 3 and recorder._watching  # a small one is gathered, and pokes
    await s.dispatch(_batch(3, size=large))
    assert lines_in(path) == 5  # written with the one gathered before it
    await s.dispatch(_batch(4, size=large - 1))
    assert lines_in(path) == 5  # a smaller one is gathered
    assert recorder.flush(5) and first_results(path) == ["0/0", "1/0", "2/0", "3/0", "4/0"]
    s.close()
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == 5, report


_KILLED = """
import os, signal, sys, time, trio
sys.path.insert(0, {root!r})
from dispatcher import Dispatcher
from tests._fakes import Counter, fake_registry, openai_call

async def main():
    s = Dispatcher(fake_registry(Counter(), {{}})).session("killed", record={path!r}, record_wait=False)
    for b in range({batches}):
        await s.dispatch([openai_call(f"{{b}}-{{i}}", "echo", {{"text": f"{{b}}/{{i}}"}}) for i in range(3)])
    await trio.sleep({pause})
    os.kill(os.getpid(), signal.SIGKILL)

trio.run(main)
"""


@pytest.mark.parametrize("batches", [1, 300])
def test_a_process_killed_a_moment_after_its_batches_has_every_line(tmp_path: Path, batches: int) -> None:
    """kill -9 once the batches have stopped for a moment (`_GATHER_LONGEST` and a margin),
    the session never closed: every batch is whole in the file, and it replays."""
    path = tmp_path / "killed.jsonl"
    script = _KILLED.format(root=str(ROOT), path=str(path), batches=batches, pause=_GATHER_LONGEST + 0.5)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert first_results(path) == [f"{b}/0" for b in range(batches)]
    report = anyio.run(replay, path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == batches


async def test_the_chain_holds_when_batches_that_wait_follow_gathered_ones(tmp_path: Path) -> None:
    """Records gathered, then a batch that waits (the recording told to wait, or a batch the
    gate decided, which is never gathered): the gathered ones are written first, numbered
    before it, and the file replays whole."""

    async def echo(args: Any, ctx: Any) -> str:
        return str(args["text"])

    registry = Registry(
        [
            Tool("echo", "Echo.", echo, TEXT_SCHEMA, concurrent=True, deferred=False),
            Tool("asked", "Echo, asked.", echo, TEXT_SCHEMA, concurrent=True, deferred=False, confirm=True),
        ]
    )
    path = tmp_path / "mixed.jsonl"
    s = _session(path, registry=registry, gate=lambda c, ctx: Allow())
    assert s.recorder is not None
    expected = []
    for n in range(3):
        await s.dispatch(_batch(n))
        expected.append(f"{n}/0")
    await s.dispatch([openai_call("asked-1", "asked", {"text": "asked"})])  # waits for its line
    expected.append("asked")
    assert first_results(path) == expected  # in the file as it returned, after those gathered before it
    for n in range(3, 6):
        await s.dispatch(_batch(n))
        expected.append(f"{n}/0")
    s.recorder.wait = True
    await s.dispatch(_batch(6))
    expected.append("6/0")
    assert first_results(path) == expected
    s.close()
    lines = read_lines(path)
    assert [line["seq"] for line in lines] == list(range(len(expected) + 1))
    report = await replay(path, Dispatcher(registry, gate=lambda c, ctx: Allow()))
    assert report.ok and report.batches == len(expected)


async def test_a_file_replaced_while_records_wait_goes_on_in_the_new_file(tmp_path: Path) -> None:
    """The file renamed over between batches whose records wait to be written: they go on in
    the file now at the path, after a header, numbered from 1, and that file replays."""
    path = tmp_path / "replaced.jsonl"
    s = _session(path)
    await s.dispatch(_batch(0))
    await until_lines(path, 2)
    await s.dispatch(_batch(1))  # gathered, not yet written
    (tmp_path / "other.jsonl").write_bytes(b"")
    os.replace(tmp_path / "other.jsonl", path)
    for n in range(2, 6):
        await s.dispatch(_batch(n))
        await anyio.sleep(_GATHER)  # each batch's end finds the one before waited long enough
    s.close()
    lines = read_lines(path)
    assert lines[0]["type"] == "header" and [line["seq"] for line in lines] == list(range(len(lines)))
    assert first_results(path) == [f"{n}/0" for n in range(1, 6)]
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == 5


async def test_calls_changed_after_the_batch_returned_are_recorded_as_they_were(tmp_path: Path) -> None:
    """The record holds the calls as the batch read them: the caller's dicts, changed
    afterwards (a large batch, whose rows are encoded at once, and a small one), change
    nothing in it."""
    path = tmp_path / "reused.jsonl"
    s = _session(path)
    batches = [_batch(0, size=20), _batch(1, size=2)]
    for items in batches:
        await s.dispatch(items)
        for item in items:
            item["id"] = "changed"
            item["function"]["arguments"] = '{"text": "changed"}'
    s.close()
    _, recorded, _, problem = read_recording(path)
    assert problem is None
    assert [[c["id"] for c in b["calls"]] for b in recorded] == [
        [f"0-{i}" for i in range(20)],
        ["1-0", "1-1"],
    ]
    assert [r["content"] for r in recorded[0]["results"]] == [f"0/{i}" for i in range(20)]


_SECRET = "arg-000-s3cr3t"
_SECRET_ARGS = {"text": "secret", "api_key": _SECRET}  # a credential echo is sent beside its text


def _mixed_batches() -> list[list[dict[str, Any]]]:
    """Batches of one, a few and `_WRITTEN_AT_ONCE` calls, one holding a credential, one
    call of a ToolCall's shape (not read in place) and one whose id is not text."""
    batches = [_batch(n, size) for n, size in enumerate([1, 1, 3, 1, 20, 1, 2, 1])]
    batches[2][1] = openai_call("2-1", "echo", _SECRET_ARGS)
    batches.append([{"id": "8-0", "name": "echo", "arguments": {"text": "8/0"}}])
    batches.append([openai_call("9-0", "echo", {"text": "9/0"}) | {"id": 9}])
    batches.append(_batch(10, _recording._WRITTEN_AT_ONCE))
    batches += [_batch(n) for n in range(11, 15)]
    return batches


def _untimed(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batch records as read, less when each call started and how long it took (and
    the hash of the line before, which holds them)."""
    for b in batches:
        del b["prev"]
        for r in b["results"]:
            if r is not None:
                r["started"] = r["duration"] = 0
    return batches


@pytest.mark.parametrize("waited", [0.0, _GATHER])
async def test_a_record_made_where_it_is_written_is_the_one_made_as_the_batch_returns(
    tmp_path: Path, waited: float
) -> None:
    """Batches gathered before their records are made (`_Unbuilt`: every call read in place)
    record what the same batches record when each waits for its line: the common ones as
    `rows`, the one holding a credential part by part with it redacted, those not read in
    place as before; whether the records are made together or one by one (the batch
    holding a credential beside them), and with a pause between batches or none."""
    records: dict[bool, list[dict[str, Any]]] = {}
    kinds_of: dict[bool, list[str]] = {}
    for wait in (True, False):
        path = tmp_path / f"wait-{wait}.jsonl"
        d = Dispatcher(fake_registry(Counter(), {}))
        s = d.session("same", record=path, record_wait=wait)
        for items in _mixed_batches():
            await s.dispatch(items)
            await anyio.sleep(waited)
        s.close()
        _, batches, truncated, problem = read_recording(path)
        assert problem is None and not truncated
        records[wait] = _untimed(batches)
        kinds_of[wait] = kinds(path)
    assert records[False] == records[True]
    # the credential's batch and the ToolCall shape's part by part, the rest as rows (the
    # id that is not text, copied as text for the writer thread, may be either)
    expected = ["header"] + ["batch" if n in (2, 8) else "rows" for n in range(len(_mixed_batches()))]
    assert [k for n, k in enumerate(kinds_of[False]) if n != 10] == [
        k for n, k in enumerate(expected) if n != 10
    ]
    for wait in (True, False):
        assert _SECRET not in (tmp_path / f"wait-{wait}.jsonl").read_text()
    assert [r["content"] for r in records[False][2]["results"]][0::2] == ["2/0", "2/2"]
    arguments = json.loads(records[False][2]["calls"][1]["arguments"])  # the JSON text, redacted
    assert arguments["text"] == "secret" and arguments["api_key"] != _SECRET
    report = await replay(tmp_path / "wait-False.jsonl", Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == len(_mixed_batches()), report


async def test_records_made_together_are_the_lines_made_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records of batches gathered unbuilt, made together in one pass (`_made_together`),
    encode to the same bytes as each made on its own (`_made`); one of `_ENCODED_FROM` calls
    or more is left to be made alone; with a credential among them, none is made together,
    and each is made on its own."""
    monkeypatch.setattr(_recording, "_GATHER", 3600.0)  # nothing written meanwhile
    monkeypatch.setattr(_recording, "_GATHER_LONGEST", 3600.0)
    s = _session(tmp_path / "together.jsonl")
    await s.dispatch(_batch(0))
    assert s.recorder.flush(5)
    for n, size in enumerate([1, 3, 20, 1, 2], start=1):
        await s.dispatch(_batch(n, size))
    gathered = list(s.recorder._gathered)
    assert len(gathered) == 5 and all(isinstance(g, _recording._Unbuilt) for g in gathered)
    alone = [_recording._made(g) for g in gathered]
    assert all(plain for _, plain in alone)
    together = _recording._made_together(gathered)
    assert [isinstance(g, _recording._Unbuilt) for g in together] == [False, False, True, False, False]
    assert together[2] is gathered[2]
    assert _lines_of(
        [_recording._made(g) if isinstance(g, _recording._Unbuilt) else g for g in together]
    ) == (_lines_of(alone))
    await s.dispatch([openai_call("6-0", "echo", _SECRET_ARGS)])
    mixed = list(s.recorder._gathered)
    assert _recording._made_together(mixed) == mixed  # left for `_made`, each on its own
    assert [plain for _, plain in map(_recording._made, mixed)] == [True] * 5 + [False]
    monkeypatch.undo()
    s.close()
    recorded = first_results(tmp_path / "together.jsonl")
    assert recorded[:6] == [f"{n}/0" for n in range(6)] and len(recorded) == 7
    assert _SECRET not in (tmp_path / "together.jsonl").read_text()


def _lines_of(made: Any) -> list[bytes]:
    """Records as made, numbered and chained alike, as their lines would be written."""
    out = []
    for i, (record, plain) in enumerate(made):
        record = dict(record)
        record["seq"], record["prev"] = i + 1, "0" * 16
        out.append(encode_line(record, finite=plain))
    return out


_ARGUMENT_TEXT = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["\ud800", "api_key=1", "Bearer abc", "é", "\\u0000", '"', "\u2028"]),
)


async def _gathered_of(path: Path, batches: list[list[dict[str, Any]]]) -> list[Any]:
    """What a session that does not wait gathered of `batches`, none of them written yet."""
    s = _session(path)
    await s.dispatch(_batch(0))
    assert s.recorder.flush(5)
    for items in batches:
        await s.dispatch(items)
    gathered = list(s.recorder._gathered)
    s.recorder._gathered = []  # not written: the test only makes them
    s.close()
    return gathered


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(
        st.tuples(
            st.sampled_from([1, 2, 3, 15, 16, 17]),  # calls, either side of `_ENCODED_FROM`
            st.integers(0, 16),  # the call that holds an odd text, if any
            st.none()
            | st.tuples(
                st.sampled_from(["echo", "missing"]), _ARGUMENT_TEXT, st.booleans()
            ),  # with a credential?
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_batches_made_together_are_the_lines_made_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, batches: list[Any]
) -> None:
    """Whatever batches are gathered unbuilt (any text in their arguments: a lone surrogate,
    what looks like a credential, escapes; calls of no tool; a credential beside them; some
    of `_ENCODED_FROM` calls or more), the records made together are, line for line, the
    bytes of each made on its own; and when each alone is a `rows` record, those of fewer
    than `_ENCODED_FROM` calls are indeed made together."""
    monkeypatch.setattr(_recording, "_GATHER", 3600.0)
    monkeypatch.setattr(_recording, "_GATHER_LONGEST", 3600.0)
    items = []
    for n, (size, at, odd) in enumerate(batches):
        calls = []
        for i in range(size):
            name, args = "echo", {"text": f"{n}/{i}"}
            if odd is not None and i == at % size:
                name, args["text"] = odd[0], odd[1]
                if odd[2]:
                    args["api_key"] = _SECRET
            # the text as it is, not escaped (a lone surrogate stays one)
            calls.append(openai_call(f"{n}-{i}", name, json.dumps(args, ensure_ascii=False)))
        items.append(calls)
    path = tmp_path_factory.mktemp("together") / "together.jsonl"
    gathered = anyio.run(_gathered_of, path, items)
    assert len(gathered) == len(items)
    assert all(isinstance(g, _recording._Unbuilt) for g in gathered)  # every call read in place
    alone = [_recording._made(g) for g in gathered]
    made = _recording._made_together(gathered)
    together = [_recording._made(g) if isinstance(g, _recording._Unbuilt) else g for g in made]
    assert _lines_of(together) == _lines_of(alone)
    small = [i for i, g in enumerate(gathered) if len(g.results) < _recording._ENCODED_FROM]
    if all(plain for _, plain in alone) and len(small) >= 2:
        assert not any(isinstance(made[i], _recording._Unbuilt) for i in small)


@pytest.mark.parametrize("wait", [True, False])
async def test_a_credential_a_rewriter_adds_to_gathered_batches_never_reaches_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: bool
) -> None:
    """Batches read in place, gathered unbuilt, whose arguments a rewriter gives the host's
    token (the calls' own text holds none): made together or one by one, no line holds
    the token, not in the arguments as sent nor in the results that echo them (the calls'
    text alone would have them written as rows); and the file replays."""
    token = SECRETS["other"]

    def with_token(event: Any, state: Any) -> Any:
        headers = {**event.args.get("headers", {}), "Authorization": f"Bearer {token}"}
        return {"tool_name": event.tool_name, "args": {**event.args, "headers": headers}}

    monkeypatch.setattr(_recording, "_GATHER", 3600.0)  # every batch gathered until close
    monkeypatch.setattr(_recording, "_GATHER_LONGEST", 3600.0)
    path = tmp_path / f"rewritten-{wait}.jsonl"
    d = Dispatcher(_echo_registry(Counter()), rewriters=[with_token])
    s = d.session("rw", record=path, record_wait=wait)
    for n in range(6):
        calls = [openai_call(f"{n}-{i}", "request", {"url": f"api.test/{n}/{i}"}) for i in range(1 + n % 3)]
        results = await s.dispatch(calls)
        assert all(token in r.content for r in results)  # the tool was given it
    if not wait:
        assert len(s.recorder._gathered) == 6 and all(
            isinstance(g, _recording._Unbuilt) for g in s.recorder._gathered
        )
    s.close()
    assert token.encode() not in path.read_bytes()
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated and len(batches) == 6
    report = await replay(path, Dispatcher(_echo_registry(Counter()), rewriters=[with_token]))
    assert report.ok, report.divergence
