"""Lines written on the event loop's thread: a waiting batch's line is in the file when the
batch returns, a kill -9 after that loses nothing, a write that stalls sends lines to the
writer thread, a FIFO is left to it, a file replaced between batches is noticed, the chain
holds across both ways of writing, fsync stays on the thread; and the common batch's
`rows` record, built in one pass, reads back as the record built part by part."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from dispatcher import Dispatcher, Registry, Tool, ToolCall, _recording, replay
from dispatcher._recording import Recorder, read_recording

from ._fakes import TEXT_SCHEMA, Counter, call, fake_registry, openai_call
from ._recorded import assert_reads_as, kinds, one_pass_line, part_by_part, read_line

ROOT = Path(__file__).resolve().parent.parent
_REAL_WRITE = os.write


class _Writes:
    """Which thread wrote each recording line: os.write as it is, watched."""

    def __init__(self) -> None:
        self.by: list[tuple[int, bytes]] = []  # (thread ident, the first bytes of a line written)
        self.stall = (0.0, math.inf)  # (seconds, bytes): a longer write takes that long (a stalling disk)

    def __call__(self, fd: int, data: Any) -> int:
        head = bytes(data[:16])
        if head.startswith(b'{"type"'):
            self.by.append((threading.get_ident(), head))
        if len(data) > self.stall[1]:
            time.sleep(self.stall[0])
        return _REAL_WRITE(fd, data)

    def threads(self) -> list[str]:
        """Per write: "loop" (this test's thread) or "thread" (the recorder's writer)."""
        here = threading.get_ident()
        return ["loop" if ident == here else "thread" for ident, _ in self.by]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> _Writes:
    watched = _Writes()
    monkeypatch.setattr(os, "write", watched)
    return watched


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _session(path: Path, name: str = "inline", **options: Any) -> Any:
    return Dispatcher(fake_registry(Counter(), {})).session(name, record=path, **options)


async def test_a_waiting_batch_is_written_on_the_loop_once_the_file_is_open(
    tmp_path: Path, writes: _Writes
) -> None:
    """The first batch opens the file on the writer thread; each batch after it is written
    on the loop's thread, and its line is in the file when dispatch returns."""
    path = tmp_path / "s.jsonl"
    s = _session(path)
    for n in range(4):
        await s.dispatch([call(str(n), "echo", text=f"t{n}")])
        assert [r["seq"] for r in _lines(path)] == list(range(n + 2))  # before close
        assert _lines(path)[-1]["results"][0]["content"] == f"t{n}"
    s.close()
    assert writes.threads() == ["thread", "loop", "loop", "loop"]
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated and len(batches) == 4
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 4


_KILLED_CHILD = """
import os, signal, sys, trio
sys.path.insert(0, {root!r})
from dispatcher import Dispatcher
from tests._fakes import Counter, fake_registry, openai_call

async def main():
    s = Dispatcher(fake_registry(Counter(), {{}})).session("killed", record={path!r})
    for b in range({batches}):
        await s.dispatch([openai_call(f"{{b}}-{{i}}", "echo", {{"text": f"{{b}}/{{i}}"}}) for i in range(3)])
    os.kill(os.getpid(), signal.SIGKILL)  # at once after the last batch returned

trio.run(main)
"""


@pytest.mark.parametrize("batches", [1, 6])
def test_a_process_killed_right_after_a_batch_returned_has_its_line(tmp_path: Path, batches: int) -> None:
    """kill -9 the moment a batch returns (the first, written by the writer thread; or a
    later one, written on the loop): every batch that returned is whole in the file."""
    path = tmp_path / "killed.jsonl"
    script = _KILLED_CHILD.format(root=str(ROOT), path=str(path), batches=batches)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    _, recorded, truncated, problem = read_recording(path)
    assert problem is None and not truncated
    assert [[r["content"] for r in b["results"]] for b in recorded] == [
        [f"{b}/{i}" for i in range(3)] for b in range(batches)
    ]


@contextmanager
def _reader(fifo: Path) -> Iterator[tuple[threading.Event, list[bytes]]]:
    """Read the FIFO `fifo` in a thread while the event is set (it starts set), until its
    writer closes it; once it is cleared, the pipe fills and a write to it waits."""
    go = threading.Event()
    go.set()
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb", buffering=0) as f:
            while True:
                go.wait()
                chunk = f.read(1 << 16)
                if not chunk:
                    return
                got.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield go, got
    finally:
        go.set()
        reader.join(10)


def _big_batch(n: int) -> list[dict[str, Any]]:
    """A batch whose line is far larger than a pipe holds (64 KiB on Linux)."""
    return [openai_call(f"{n}-{i}", "echo", {"text": f"{n}:" + "x" * 100_000}) for i in range(4)]


async def test_a_fifo_is_written_by_the_writer_thread_so_a_reader_that_stops_never_holds_the_loop(
    tmp_path: Path, writes: _Writes
) -> None:
    """A recording to a FIFO: each line waits for its reader, so none is written on the
    loop; a reader that stops reading (its pipe full) holds up the batch waiting for its
    line while the loop goes on; every line arrives in order and chained."""
    fifo = tmp_path / "slow.jsonl"
    os.mkfifo(fifo)
    s = _session(fifo, "slow")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            first = anyio.Event()

            async def first_batch() -> None:
                await s.dispatch([call("0", "echo", text="first")])
                first.set()

            tg.start_soon(first_batch)
            await anyio.sleep(0.1)  # the writer thread waits for the FIFO's reader
            with _reader(fifo) as (go, got):
                await first.wait()
                await s.dispatch([call("1", "echo", text="second")])
                go.clear()  # the reader stops: the pipe fills with the next line
                ticks = 0
                returned = anyio.Event()

                async def big_batch() -> None:
                    await s.dispatch(_big_batch(2))
                    returned.set()

                tg.start_soon(big_batch)
                while ticks < 20:  # the loop is free while the writer thread waits
                    await anyio.sleep(0.005)
                    ticks += 1
                assert not returned.is_set()
                go.set()
                await returned.wait()
                await s.dispatch([call("3", "echo", text="last")])
                s.close()
    assert writes.threads() == ["thread"] * 4
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(b"".join(got))
    _, batches, truncated, problem = read_recording(copy)
    assert problem is None and not truncated
    assert [b["results"][0]["content"][:6] for b in batches] == ["first", "second", "2:xxxx", "last"]
    report = await replay(copy, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 7


async def test_a_write_on_the_loop_slower_than_write_stall_sends_lines_to_the_thread_for_a_while(
    tmp_path: Path, writes: _Writes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A line whose build and write on the loop takes longer than WRITE_STALL (here a large
    batch whose write stalls) sends the next batches to the writer thread, and says so
    once; a quick line does not."""
    monkeypatch.setattr(_recording, "WRITE_STALL", 0.05)
    writes.stall = (0.1, 1_000_000)
    caplog.set_level(logging.INFO, logger="threepass.recording")
    path = tmp_path / "s.jsonl"
    s = _session(path, "stall")
    await s.dispatch([call("0", "echo", text="a")])
    await s.dispatch([call("1", "echo", text="b")])  # quick: on the loop, and the next too
    await s.dispatch([openai_call(f"2-{i}", "echo", {"text": "x" * 500_000}) for i in range(8)])
    await s.dispatch([call("3", "echo", text="c")])
    await s.dispatch([call("4", "echo", text="d")])
    s.close()
    assert writes.threads() == ["thread", "loop", "loop", "thread", "thread"]
    assert sum("lines go to its writer thread" in r.getMessage() for r in caplog.records) == 1
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated and [b["seq"] for b in batches] == [1, 2, 3, 4, 5]


async def test_lines_stay_in_order_and_chained_as_batches_switch_between_loop_and_thread(
    tmp_path: Path, writes: _Writes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write on the loop counted as stalled: each sends the next batches to the
    writer thread for WRITE_PAUSE, then batches come back to the loop; the file holds
    every batch in order, one chain, and replays."""
    monkeypatch.setattr(_recording, "WRITE_STALL", -1.0)
    monkeypatch.setattr(_recording, "WRITE_PAUSE", 0.3)
    path = tmp_path / "switching.jsonl"
    s = _session(path, "switching")
    for n in range(8):
        if n in (4, 7):
            await anyio.sleep(0.35)  # the pause is over
        await s.dispatch([call(str(n), "echo", text=f"t{n}"), call(f"{n}b", "echo", text=f"u{n}")])
        assert len(_lines(path)) == n + 2
    s.close()
    assert writes.threads() == ["thread", "loop", "thread", "thread", "loop", "thread", "thread", "loop"]
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated
    assert [b["seq"] for b in batches] == list(range(1, 9))
    assert [b["results"][1]["content"] for b in batches] == [f"u{n}" for n in range(8)]
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 16


async def test_a_file_replaced_between_batches_written_on_the_loop_is_noticed(
    tmp_path: Path, writes: _Writes
) -> None:
    """A file renamed over the recording, then one deleted: the next batch, which would be
    written on the loop, notices; the writer thread begins the new file with a header, and
    the loop writes the batches after it."""
    path = tmp_path / "s.jsonl"
    s = _session(path, "swapped")
    await s.dispatch([call("1", "echo", text="a")])
    await s.dispatch([call("2", "echo", text="b")])
    (tmp_path / "new.jsonl").write_text("")
    os.replace(tmp_path / "new.jsonl", path)
    await s.dispatch([call("3", "echo", text="c")])
    await s.dispatch([call("4", "echo", text="d")])
    assert [r.get("seq") for r in _lines(path)] == [0, 1, 2]
    path.unlink()
    await s.dispatch([call("5", "echo", text="e")])
    s.close()
    assert writes.threads() == ["thread", "loop", "thread", "loop", "thread"]
    records = _lines(path)
    assert [r["type"] for r in records] == ["header", "batch"]
    assert records[1]["calls"][0]["id"] == "5"


async def test_with_fsync_every_line_is_written_and_synced_by_the_writer_thread(
    tmp_path: Path, writes: _Writes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`record_fsync=True`: a sync waits for the disk, so no batch's line is written on the
    loop; each is written and synced by the writer thread before its batch returns."""
    real_fsync = os.fsync
    synced: list[int] = []

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(threading.get_ident())

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "synced.jsonl"
    s = _session(path, "synced", record_fsync=True)
    for n in range(3):
        await s.dispatch([call(str(n), "echo", text="x")])
        assert len(synced) == n + 1 and len(_lines(path)) == n + 2
    s.close()
    assert writes.threads() == ["thread"] * 3
    assert threading.get_ident() not in synced


# --- the common batch's record ------------------------------------------------------------


def _registry() -> Registry:
    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        return str(args["text"])

    async def boom(args: Mapping[str, Any], ctx: Any) -> str:
        raise RuntimeError("it broke")

    def defaults(value: str) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"text": {"type": "string"}, "mode": {"type": "string", "default": value}},
            "required": ["text"],
        }

    return Registry(
        [
            Tool("echo", "Echo.", echo, TEXT_SCHEMA, concurrent=True, deferred=False),
            Tool("boom", "Fails.", boom, {"type": "object"}, concurrent=True, deferred=False),
            Tool("plain_default", "Echo.", echo, defaults("fast"), concurrent=True, deferred=False),
            Tool("marked_default", "Echo.", echo, defaults("token-less"), concurrent=True, deferred=False),
        ]
    )


def _watch_submitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every batch handed to a recorder from now on, as the parts `Recorder._record_of` takes."""
    submitted: list[tuple[Any, ...]] = []
    submit = Recorder.submit

    def watched(self: Recorder, *parts: Any) -> Any:
        submitted.append(parts)
        return submit(self, *parts)

    monkeypatch.setattr(Recorder, "submit", watched)
    return submitted


_BATCHES: list[list[Any]] = [
    [openai_call("1", "echo", {"text": "a"})],
    [openai_call("2", "echo", '{"text": "café ✓"}'), openai_call("3", "echo", {"text": "a"})],
    [openai_call("4", "echo", {"text": "same"}), openai_call("5", "echo", {"text": "same"})],  # a follower
    [openai_call("6", "echo", {"wrong": 1}), openai_call("7", "boom", {})],  # invalid; failed
    [openai_call("8", "nowhere", {"text": "a"})],  # decided in pass 1, with no arguments as sent
    [openai_call("9", "echo", "not json")],
    [openai_call("10", "plain_default", {"text": "a"})],
    [openai_call("11", "marked_default", {"text": "a"})],  # a default that may hold a credential
    [openai_call("12", "echo", {"text": "a", "api_key": "sk-abcdefghijklmnop1234"})],
    [openai_call("13", "echo", {"text": "see https://u:pw@example.com/x"})],
    [ToolCall("14", "echo", {"text": "a"})],
    [{"id": 15, "function": {"name": "echo", "arguments": '{"text": "b"}'}}],  # an id that is no text
    [openai_call("16", "echo", {"text": "a"})],  # called again in the same run: deduped
    [openai_call("17", "run_tool", {"name": "echo", "args": {"text": "r"}})],  # planned as echo
]


async def test_the_common_batch_is_recorded_as_the_record_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For every batch the one-pass builder takes, its `rows` line reads back as the record
    built call by call with redaction; batches that may hold a credential, or that are not
    all the OpenAI shape with text ids and names, it leaves to the other."""
    submitted = _watch_submitted(monkeypatch)
    s = Dispatcher(_registry()).session("common", record=tmp_path / "s.jsonl")
    for batch in _BATCHES:
        await s.dispatch(batch)
    s.close()
    one_pass = [Recorder._record_of(*batch) for batch in submitted]
    built = [part_by_part(batch, monkeypatch) for batch in submitted]
    assert [plain for _, plain in one_pass] == [
        True, True, True, True, False, False, True, False, False, False, False, False, True, True,
    ]  # fmt: skip
    for (record, plain), expected in zip(one_pass, built, strict=True):
        assert_reads_as(one_pass_line(record, plain), expected)
    assert kinds(tmp_path / "s.jsonl")[1:] == ["rows" if plain else "batch" for _, plain in one_pass]
    taken = [read_line(one_pass_line(record, plain)) for record, plain in one_pass if plain]
    assert {row["how"] for record in taken for row in record["plan"]} == {
        "ran", "follow", "invalid_arguments", "deduped",
    }  # fmt: skip
    assert "failed" in {result["status"] for record in taken for result in record["results"]}
    assert "sk-abcdefghijklmnop1234" not in (tmp_path / "s.jsonl").read_text()
    report = await replay(tmp_path / "s.jsonl", Dispatcher(_registry()))
    assert report.ok, report


def _large_batches(size: int) -> list[list[Any]]:
    """Batches of `size` calls, each the OpenAI shape with text: all run; runs, followers,
    refusals and failures; one whose last call's text holds a lone surrogate (orjson
    refuses it); one whose arguments name a credential."""
    return [
        [openai_call(f"a{i}", "echo", {"text": f"t{i}"}) for i in range(size)],
        [
            openai_call(f"b{i}", *[("echo", {"text": "same"}), ("echo", {"wrong": i}), ("boom", {})][i % 3])
            for i in range(size)
        ],
        [
            openai_call(f"c{i}", "echo", '{"text": "\ud800"}' if i == size - 1 else {"text": f"u{i}"})
            for i in range(size)
        ],
        [
            openai_call(f"d{i}", "echo", {"text": "a", **({"token": "s3cr3t-value"} if i == 3 else {})})
            for i in range(size)
        ],
    ]


@pytest.mark.parametrize("size", [15, 16, 40])
async def test_a_large_common_batch_is_encoded_as_the_record_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """From 16 calls the one-pass builder encodes its rows as they are made: the line reads
    back as the record built call by call, and what orjson refuses or may hold a
    credential is left to that one."""
    submitted = _watch_submitted(monkeypatch)
    registry = _registry()
    path = tmp_path / "large.jsonl"
    s = Dispatcher(registry).session("large", record=path)
    for batch in _large_batches(size):
        s.new_run()
        await s.dispatch(batch)
    s.close()
    one_pass = [Recorder._record_of(*batch) for batch in submitted]
    encoded = [isinstance(record.get("rows"), orjson.Fragment) for record, _ in one_pass]
    assert encoded == [size >= 16, size >= 16, False, False]
    assert [plain for _, plain in one_pass] == [True, True, size < 16, False]
    built = [part_by_part(batch, monkeypatch) for batch in submitted]
    for (record, plain), expected in zip(one_pass, built, strict=True):
        assert_reads_as(one_pass_line(record, plain), expected)
    assert kinds(path)[1:] == ["rows" if plain else "batch" for _, plain in one_pass]
    assert "s3cr3t-value" not in path.read_text()
    report = await replay(path, Dispatcher(registry))
    assert report.ok, report


@pytest.mark.parametrize("run", [2**64, -(2**63) - 1, 2**64 - 1])
async def test_a_large_batch_whose_run_orjson_cannot_write_is_recorded_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: int
) -> None:
    """A run number orjson cannot write (a snapshot's, say) sends the line to json, which
    cannot write an encoded list: the rows stay a list, and the line reads as the general
    builder's record."""
    submitted = _watch_submitted(monkeypatch)
    s = Dispatcher(_registry()).session("run", record=tmp_path / "run.jsonl")
    await s.dispatch([openai_call(f"c{i}", "echo", {"text": f"t{i}"}) for i in range(20)])
    s.close()
    [parts] = submitted
    parts = (run, *parts[1:])
    record, plain = Recorder._record_of(*parts)
    assert plain and isinstance(record["rows"], orjson.Fragment) is (run == 2**64 - 1)
    expected = part_by_part(parts, monkeypatch)
    assert_reads_as(one_pass_line(record, plain), expected)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_ctrl_c_right_after_a_line_is_written_on_the_loop_keeps_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT the moment a line written on the loop is in the file (sent by os.write once it
    has written, handled at the loop thread's next chance): the batch raises
    KeyboardInterrupt, and the next batch's line follows that line in the chain rather
    than repeating its number."""
    interrupt = [False]

    def write(fd: int, data: Any) -> int:
        written = _REAL_WRITE(fd, data)
        if interrupt[0]:
            interrupt[0] = False
            signal.raise_signal(signal.SIGINT)
        return written

    monkeypatch.setattr(os, "write", write)
    path = tmp_path / "s.jsonl"
    s = _session(path, "interrupted")
    await s.dispatch([call("1", "echo", text="a")])
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt):
        await s.dispatch([call("2", "echo", text="b")])
    await s.dispatch([call("3", "echo", text="c")])
    s.close()
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated
    assert [(b["seq"], b["calls"][0]["id"]) for b in batches] == [(1, "1"), (2, "2"), (3, "3")]
