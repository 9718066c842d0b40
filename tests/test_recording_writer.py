"""The recording's writer thread: what a batch waits for, a stalled or full disk, crashes,
forks, an unclosed session, many sessions at once; and replay's reader and quick path."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from dispatcher import Allow, Dispatcher, Registry, Tool, ToolCall, replay
from dispatcher._recording import read_recording

from ._fakes import TEXT_SCHEMA, Counter, call, fake_registry, openai_call
from ._recorded import kinds, read_line, read_lines

ROOT = Path(__file__).resolve().parent.parent


def _lines(path: Path) -> list[dict[str, Any]]:
    """The recording's lines as the readers take them (a `rows` line as its `batch` record)."""
    return read_lines(path)


def _writers(besides: frozenset[threading.Thread] = frozenset()) -> int:
    """Recording writer threads alive, not counting `besides` (those of earlier tests)."""
    return sum(t.name == "threepass-recording" and t not in besides for t in threading.enumerate())


def _writers_now() -> frozenset[threading.Thread]:
    return frozenset(t for t in threading.enumerate() if t.name == "threepass-recording")


@contextlib.contextmanager
def _reading(fifo: Path) -> Iterator[list[bytes]]:
    """Read the FIFO `fifo` in a thread until its writer closes it; the bytes land in the list."""
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield got
    finally:
        reader.join(10)


def _writers_end(within: float, besides: frozenset[threading.Thread] = frozenset()) -> bool:
    """Whether every recording writer thread but `besides` has ended within `within` seconds
    (a test before, in the same process, may have left one waiting on a FIFO for good)."""
    deadline = time.monotonic() + within
    while _writers(besides) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _writers(besides) == 0


def _stalled(tmp_path: Path) -> Path:
    """A recording path that stalls like a hung disk: a FIFO nobody reads (yet)."""
    fifo = tmp_path / "stalled.jsonl"
    os.mkfifo(fifo)
    return fifo


# --- what a batch waits for ---------------------------------------------------------------


async def test_a_stalled_disk_holds_up_the_batch_but_never_the_loop(tmp_path: Path) -> None:
    """A batch whose line cannot be written waits for it, while the loop goes on running
    other tasks; once the file takes the line, the batch returns and the line is whole."""
    fifo = _stalled(tmp_path)
    s = Dispatcher(fake_registry(Counter(), {})).session("stall", record=fifo)
    ticks = 0
    returned = anyio.Event()

    async def batch() -> None:
        await s.dispatch([call("1", "echo", text="a")])
        returned.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            while ticks < 20:  # the loop is free: this task keeps ticking
                await anyio.sleep(0.005)
                ticks += 1
            assert not returned.is_set()  # the batch is still waiting for its line
            with _reading(fifo) as got:
                await returned.wait()
                s.close()
    records = [json.loads(line) for line in got[0].splitlines()]
    assert [r["type"] for r in records] == ["header", "batch"]
    assert records[1]["results"][0]["content"] == "a"


async def test_a_batch_cancelled_while_its_line_stalls_returns_and_the_line_is_written(
    tmp_path: Path,
) -> None:
    """A caller's timeout ends a batch waiting on a stalled disk at once (the wait is not
    shielded), batch subscribers still hear of it, and its line reaches the file once the
    disk takes it."""
    fifo = _stalled(tmp_path)
    told: list[str] = []
    d = Dispatcher(fake_registry(Counter(), {}))
    d.subscribe_batches(lambda event: told.append(event.outcome))
    s = d.session("cancelled", record=fifo)
    got: list[bytes] = []
    rescued = threading.Event()

    def rescue() -> None:  # a wait that cannot be cancelled would hang the test: let the disk go
        rescued.set()
        with open(fifo, "rb") as f:
            got.append(f.read())

    watchdog = threading.Timer(3.0, rescue)
    watchdog.start()
    began = time.monotonic()
    with anyio.fail_after(10), anyio.move_on_after(0.2) as scope:
        await s.dispatch([call("1", "echo", text="a")])
    waited = time.monotonic() - began
    watchdog.cancel()
    watchdog.join(0.1)  # a rescue that began has said so by now
    if rescued.is_set():
        s.close()  # the rescue reads until the file is closed
        watchdog.join(10)
    else:
        with _reading(fifo) as read:
            s.close()
        got = read
    assert waited < 2.0 and scope.cancelled_caught and told == ["ok"]
    records = [json.loads(line) for line in got[0].splitlines()]
    assert [r["type"] for r in records] == ["header", "batch"]


async def test_a_batch_that_need_not_wait_returns_before_its_line_is_written(tmp_path: Path) -> None:
    """`wait=False`: batches return while the disk stalls; calls the caller changes after
    that are recorded as they were received; close() waits for every line."""
    fifo = _stalled(tmp_path)
    s = Dispatcher(fake_registry(Counter(), {})).session("queued", record=fifo)
    assert s.recorder is not None
    s.recorder.wait = False
    items = [openai_call(str(n), "echo", {"text": f"t{n}"}) for n in range(3)]
    with anyio.fail_after(10):
        for item in items:
            [r] = await s.dispatch([item])
            assert r.content == item["function"]["arguments"][10:-2]
    for item in items:  # the caller reuses its dicts once the batch returned
        item["id"] = "changed"
        item["function"]["arguments"] = json.dumps({"text": "changed"})
    with _reading(fifo) as got:
        s.close()
    records = [read_line(line) for line in got[0].splitlines()]
    assert [json.loads(line)["type"] for line in got[0].splitlines()] == ["header", "rows", "rows", "rows"]
    assert [r["seq"] for r in records] == [0, 1, 2, 3]
    assert [r["calls"][0]["id"] for r in records[1:]] == ["0", "1", "2"]
    assert [json.loads(r["calls"][0]["arguments"]) for r in records[1:]] == [
        {"text": f"t{n}"} for n in range(3)
    ]


async def test_batches_that_need_not_wait_wait_again_once_a_stalled_disk_holds_enough(
    tmp_path: Path,
) -> None:
    """`wait=False` on a disk that stalls does not queue lines without end: past the bound,
    the next batch waits for the disk (and, cancelled, returns without waiting); once the
    disk takes the lines, every batch is in the file, the cancelled one too."""
    from dispatcher._recording import _MOST_QUEUED

    fifo = _stalled(tmp_path)
    s = Dispatcher(fake_registry(Counter(), {})).session("bounded", record=fifo)
    assert s.recorder is not None
    s.recorder.wait = False
    returned = 0
    with anyio.fail_after(30):
        while True:
            with anyio.move_on_after(0.5):
                await s.dispatch([openai_call(str(returned), "echo", {"text": "x"})])
                returned += 1
                continue
            break  # this batch waited for the stalled disk
    assert returned == _MOST_QUEUED
    with _reading(fifo) as got:
        s.close()
    assert len(got[0].splitlines()) == 1 + returned + 1  # the header, every batch, the cancelled one


async def test_a_batch_with_decisions_waits_even_when_the_recording_need_not(tmp_path: Path) -> None:
    """`wait=False` covers plain batches only: one the gate decided (its decisions are the
    caller's objects) is in the file when it returns, as is one of dict arguments."""

    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        return str(args["text"])

    gated = Registry(
        [Tool("echo", "Echo.", echo, TEXT_SCHEMA, concurrent=True, deferred=False, confirm=True)]
    )
    path = tmp_path / "gated.jsonl"
    s = Dispatcher(gated, gate=lambda c, ctx: Allow()).session("gated", record=path)
    assert s.recorder is not None
    s.recorder.wait = False
    await s.dispatch([openai_call("1", "echo", {"text": "a"})])
    assert len(_lines(path)) == 2 and _lines(path)[1]["decisions"] == {"1": {"allow": None}}
    s.close()
    path = tmp_path / "dicts.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("dicts", record=path)
    assert s.recorder is not None
    s.recorder.wait = False
    await s.dispatch([ToolCall("2", "echo", {"text": "b"})])
    assert len(_lines(path)) == 2
    s.close()


async def test_many_sessions_record_at_once_and_every_recording_replays(tmp_path: Path) -> None:
    """Twenty sessions on one loop, half waiting for their lines and half not, each batch of
    them interleaved: every file holds its own batches, in order, and replays clean; the
    writer threads end once the sessions are idle."""
    before = _writers_now()
    d = Dispatcher(fake_registry(Counter(), {}))
    sessions = [d.session(f"s{n}", record=tmp_path / f"s{n}.jsonl") for n in range(20)]
    for n, s in enumerate(sessions):
        assert s.recorder is not None
        s.recorder.wait = n % 2 == 0

    async def drive(n: int) -> None:
        for b in range(15):
            await sessions[n].dispatch(
                [openai_call(f"{n}-{b}-{i}", "echo", {"text": f"{n}/{b}/{i}"}) for i in range(3)]
            )

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(drive, n)
    for s in sessions:
        s.close()
    for n in range(20):
        path = tmp_path / f"s{n}.jsonl"
        contents = [r["results"][0]["content"] for r in _lines(path)[1:]]
        assert contents == [f"{n}/{b}/0" for b in range(15)]
        assert kinds(path) == ["header"] + ["rows"] * 15
        report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
        assert report.ok and report.calls == 45, (n, report.problem, report.divergence)
    assert _writers_end(within=5, besides=before)


# --- crashes, exits, forks ----------------------------------------------------------------

_CHILD = """
import sys, trio
sys.path.insert(0, {root!r})
from dispatcher import Dispatcher
from tests._fakes import Counter, fake_registry, openai_call

async def main():
    s = Dispatcher(fake_registry(Counter(), {{}})).session("child", record={path!r})
    s.recorder.wait = {wait}
    for b in range({batches}):
        await s.dispatch([openai_call(f"{{b}}-{{i}}", "echo", {{"text": "x" * 3000}}) for i in range(5)])
        print(b + 1, flush=True)
    {after}

trio.run(main)
"""


def _child(path: Path, *, wait: bool, batches: int, after: str = "") -> list[str]:
    script = _CHILD.format(root=str(ROOT), path=str(path), wait=wait, batches=batches, after=after)
    return [sys.executable, "-c", textwrap.dedent(script)]


@pytest.mark.parametrize("wait", [True, False])
def test_a_process_killed_while_it_records_leaves_a_recording_that_replays(
    tmp_path: Path, wait: bool
) -> None:
    """kill -9 in the middle of a session writing batch after batch: what is on disk is the
    session's beginning, at worst with a cut last line, and replays; waiting for each
    line, every batch that returned is in it."""
    path = tmp_path / "killed.jsonl"
    child = subprocess.Popen(_child(path, wait=wait, batches=100_000), stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    returned = 0
    try:
        for line in child.stdout:
            returned = int(line)
            if returned >= 200:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
    assert returned >= 200
    header, batches, truncated, problem = read_recording(path)
    assert problem is None and header["type"] == "header"
    assert [b["seq"] for b in batches] == list(range(1, len(batches) + 1))
    if wait:
        assert len(batches) >= returned
    report = anyio.run(replay, path, Dispatcher(fake_registry(Counter(), {})))
    assert report.problem is None and report.divergence is None and report.batches == len(batches)
    assert report.truncated == truncated


@pytest.mark.parametrize("wait", [True, False])
def test_a_session_never_closed_has_every_line_when_its_process_exits(tmp_path: Path, wait: bool) -> None:
    """A program that never closes its session and simply ends: every batch it recorded is in
    the file, whether or not its batches waited for their lines."""
    path = tmp_path / "unclosed.jsonl"
    done = subprocess.run(_child(path, wait=wait, batches=40), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated and len(batches) == 40


def test_a_forked_child_does_not_write_its_parents_recording(tmp_path: Path) -> None:
    """A child forked while its parent records records nothing more (it would break the
    parent's chain); the parent goes on and its recording replays."""
    path = tmp_path / "forked.jsonl"
    after = textwrap.dedent("""
        import os
        pid = os.fork()
        if pid == 0:
            try:
                await s.dispatch([openai_call("in-child", "echo", {"text": "child"})])
                ok = isinstance(s.recorder.problem, RuntimeError)
            finally:
                os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        await s.dispatch([openai_call("after", "echo", {"text": "parent"})])
        s.close()
    """).replace("\n", "\n    ")
    done = subprocess.run(
        _child(path, wait=True, batches=3, after=after), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    records = _lines(path)
    assert [r["calls"][0]["id"] for r in records[1:]] == ["0-0", "1-0", "2-0", "after"]
    assert kinds(path) == ["header"] + ["rows"] * 4
    report = anyio.run(replay, path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == 4


# --- a full disk ----------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only), unmounted afterwards."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True, timeout=10
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        # lazily should a file on it still be open (a writer that a failed test left behind):
        # a mount left in place would keep pytest from ever removing this folder
        if subprocess.run(["umount", str(folder)], capture_output=True, timeout=10).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=10)


@pytest.mark.parametrize("wait", [True, False])
async def test_a_full_disk_stops_the_recording_and_never_the_batches(tiny_disk: Path, wait: bool) -> None:
    """Batches go on returning their results after the disk fills; the recording stops with
    the disk's error as its problem, and what reached the disk replays."""
    path = tiny_disk / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("full", record=path)
    assert s.recorder is not None
    s.recorder.wait = wait
    with anyio.fail_after(20):
        for b in range(60):
            results = await s.dispatch([openai_call(f"{b}", "echo", {"text": f"{b}" * 2000})])
            assert results[0].content == f"{b}" * 2000
    s.close()
    assert isinstance(s.recorder.problem, OSError) and s.recorder.problem.errno == 28  # ENOSPC
    _, batches, _, problem = read_recording(path)
    assert problem is None and 0 < len(batches) < 60
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.problem is None and report.divergence is None and report.batches == len(batches)


# --- replay's reader and quick path ---------------------------------------------------------


async def test_integers_past_64_bits_read_back_exactly(tmp_path: Path) -> None:
    """Arguments holding integers orjson cannot hold as integers are read back as the same
    integers (not as floats), and the batch replays with the keys it was recorded with."""
    path = tmp_path / "big.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("big", record=path)
    big = [2**64 + 1, -(2**63) - 1, 10**30]
    await s.dispatch([ToolCall(str(n), "echo", {"text": "x", "n": v}) for n, v in enumerate(big)])
    s.close()
    _, [batch], _, problem = read_recording(path)
    assert problem is None
    assert [c["arguments"]["n"] for c in batch["calls"]] == big
    assert all(type(c["arguments"]["n"]) is int for c in batch["calls"])
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 3, report.divergence


async def test_a_malformed_result_is_named_not_crashed_on(tmp_path: Path) -> None:
    """Results whose fields have the wrong types (a status that is a list, a duration that is
    text, a content that is a number) are each reported by line, never raised."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("bad", record=path)
    await s.dispatch([call("1", "echo", text="a")])
    s.close()
    original = _lines(path)
    for field, value, said in (
        ("status", ["ok"], "status ['ok'] is not a status"),
        ("duration", "0.1", "'duration' is not a number"),
        ("content", 3, "'call_id', 'name' or 'content' is not text"),
    ):
        records = json.loads(json.dumps(original))
        records[1]["results"][0][field] = value
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        _, batches, _, problem = read_recording(path)
        assert batches == [] and problem is not None and problem.startswith("line 2: ") and said in problem


async def test_replay_with_hooks_runs_them_for_every_call(tmp_path: Path) -> None:
    """Replay serves recorded results without pass 2's machinery only when no hook wraps the
    calls: with hooks, each call's before and after hooks run, as live."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("hooks", record=path)
    await s.dispatch([call(str(n), "echo", text=f"t{n}") for n in range(4)])
    await s.dispatch([call("4", "echo", text="t4")])
    s.close()
    seen: list[str] = []

    class Hook:
        def before(self, c: ToolCall, ctx: Any) -> None:
            seen.append(f"before {c.id}")

        def after(self, c: ToolCall, result: Any, ctx: Any) -> None:
            seen.append(f"after {c.id}")

    report = await replay(path, Dispatcher(fake_registry(Counter(), {}), hooks=[Hook()]))
    assert report.ok and report.calls == 5
    assert sorted(seen) == sorted([f"{w} {n}" for n in range(5) for w in ("before", "after")])


async def test_record_wait_false_hands_lines_over_and_a_session_store_waits_anyway(tmp_path: Path) -> None:
    """`Dispatcher.session(record_wait=False)` makes a recording that does not wait, whose
    lines are all in the file once the session closes; with a session store the recording
    waits whatever is asked (the saved chain position must be the file's)."""
    from cache import MemorySessionStore

    handed = Dispatcher(fake_registry(Counter(), {})).session(
        "handed", record=tmp_path / "h.jsonl", record_wait=False
    )
    assert handed.recorder is not None and handed.recorder.wait is False
    for n in range(5):
        await handed.dispatch([openai_call(f"c{n}", "echo", {"text": f"t{n}"})])
    handed.close()
    assert [r["seq"] for r in _lines(tmp_path / "h.jsonl")] == [0, 1, 2, 3, 4, 5]
    assert (await replay(tmp_path / "h.jsonl", Dispatcher(fake_registry(Counter(), {})))).ok
    kept = Dispatcher(fake_registry(Counter(), {}), session_store=MemorySessionStore()).session(
        "kept", record=tmp_path / "k.jsonl", record_wait=False
    )
    assert kept.recorder is not None and kept.recorder.wait is True
    kept.close()


_TO_STDOUT = """
import sys, trio
sys.path.insert(0, {root!r})
from dispatcher import Dispatcher
from tests._fakes import Counter, fake_registry, openai_call

async def main():
    s = Dispatcher(fake_registry(Counter(), {{}})).session("piped", record="/dev/stdout")
    for b in range(3):
        await s.dispatch([openai_call(str(b), "echo", {{"text": str(b)}})])
    s.close()

trio.run(main)
"""


def test_a_recording_to_standard_output_piped_to_a_reader_streams_to_it(tmp_path: Path) -> None:
    """`record="/dev/stdout"` with standard output a pipe (`... | reader`): the recording is
    written to the pipe, header first, and never read from it (which waited for ever on the
    process's own pipe, or took what was meant for its reader)."""
    script = _TO_STDOUT.format(root=str(ROOT))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["type"] for r in records] == ["header", "rows", "rows", "rows"]
    assert [r["seq"] for r in records] == [0, 1, 2, 3]


async def test_a_fifo_whose_reader_came_first_takes_the_recording(tmp_path: Path) -> None:
    """A FIFO its reader opened before the session's first batch: the recording is written
    to it, header first, and never read from it."""
    fifo = _stalled(tmp_path)
    with _reading(fifo) as got:
        await anyio.sleep(0.05)  # the reader is at the FIFO first
        s = Dispatcher(fake_registry(Counter(), {})).session("first", record=fifo)
        with anyio.fail_after(10):
            for n in range(3):
                await s.dispatch([call(str(n), "echo", text=str(n))])
        s.close()
    records = [json.loads(line) for line in got[0].splitlines()]
    assert records[0]["type"] == "header" and [r["seq"] for r in records] == [0, 1, 2, 3]


async def test_a_writer_thread_that_fails_of_itself_stops_the_recording_and_leaves_nobody_waiting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fault of the writer thread's own (a bug, not a write that fails): the batch waiting
    for its line returns, the recording stops saying why, and the batches after it run and
    return as a recording that stopped lets them."""
    before = _writers_now()
    from dispatcher._recording import Recorder

    def broken(self: Recorder, burst: Any) -> None:
        raise RuntimeError("the writer's own fault")

    monkeypatch.setattr(Recorder, "_write_burst", broken)
    s = Dispatcher(fake_registry(Counter(), {})).session("broken", record=tmp_path / "b.jsonl")
    assert s.recorder is not None
    with anyio.fail_after(10):
        [first] = await s.dispatch([call("1", "echo", text="a")])  # its line is the thread's to write
        [second] = await s.dispatch([call("2", "echo", text="b")])
    assert (first.content, second.content) == ("a", "b")
    assert isinstance(s.recorder.problem, RuntimeError) and "own fault" in str(s.recorder.problem)
    assert _writers_end(5, besides=before)
    s.close()
