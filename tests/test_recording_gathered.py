"""A recording whose batches need not wait (`record_wait=False`): each batch's record is made
on the loop as the batch returns and gathered with the next ones; the loop writes them with
one `write` at the end of the batch in which the first has waited `_GATHER`, and the writer
thread writes them once batches stop coming. What a crash can lose is bounded in time, the
chain holds across both ways of writing, and a file replaced meanwhile is noticed."""

from __future__ import annotations

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

from dispatcher import Allow, Dispatcher, Registry, Tool, _recording, replay
from dispatcher._recording import _GATHER, _GATHER_LONGEST, read_recording

from ._fakes import TEXT_SCHEMA, Counter, fake_registry, openai_call
from ._recorded import first_results, lines_in, read_lines, until_lines

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
    """The record is made as the batch returns: the caller's dicts, changed afterwards (a
    large batch, whose rows are encoded at once, and a small one), change nothing in it."""
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
