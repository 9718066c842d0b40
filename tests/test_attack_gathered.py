"""A recording whose batches need not wait (`record_wait=False`), attacked where the loop and
the writer thread meet: a batch that ends just as the thread looks at the records gathered,
an interrupt that lands while the loop writes them, and a serial reference that the file,
whatever mix of batches came, must equal."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import Allow, Dispatcher, Registry, Tool, ToolCall, replay
from dispatcher._recording import _GATHER, _GATHER_LONGEST, Recorder, _read_data

from ._fakes import TEXT_SCHEMA, openai_call
from ._recorded import first_results, read_lines, until_lines

_REAL_WRITE = os.write


async def _echo(args: Any, ctx: Any) -> str:
    return str(args["text"])


def _registry() -> Registry:
    return Registry(
        [
            Tool("echo", "Echo.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False),
            Tool("asked", "Echo, asked.", _echo, TEXT_SCHEMA, concurrent=True, deferred=False, confirm=True),
        ]
    )


def _session(path: Path) -> Any:
    d = Dispatcher(_registry(), gate=lambda c, ctx: Allow())
    return d.session("attacked", record=path, record_wait=False)


def _batch(n: int, tool: str = "echo") -> list[dict[str, Any]]:
    return [openai_call(f"{n}-0", tool, {"text": f"{n}/0"})]


async def test_a_batch_that_writes_here_as_the_thread_takes_the_records_keeps_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit` finds no job before a decided batch (`_unwritten == 0`) and goes to write
    its line on the loop; just then, before `_write_here` takes the lock, the writer thread
    looks at the records gathered and takes them as its job (a switch of threads there,
    made certain here by waiting for it). The loop must not write the batch before them,
    nor number it beside them: it leaves the batch to the thread, after them."""
    path = tmp_path / "raced.jsonl"
    s = _session(path)
    await s.dispatch(_batch(0))
    await until_lines(path, 2)  # the file open: the loop may write from now on
    recorder = s.recorder
    original = Recorder._write_here

    def late(self: Recorder, *args: Any) -> bool:
        deadline = time.monotonic() + 2
        while self._unwritten == 0 and time.monotonic() < deadline:
            time.sleep(0.0005)  # the thread, looking at the records gathered, takes them now
        return original(self, *args)

    def slow_on_thread(fd: int, data: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)  # the thread's write takes a moment
        return _REAL_WRITE(fd, data)

    monkeypatch.setattr(Recorder, "_write_here", late)
    monkeypatch.setattr(os, "write", slow_on_thread)
    await s.dispatch(_batch(1))  # gathered
    await s.dispatch(_batch(2, "asked"))  # decided: never gathered, written here if it can be
    monkeypatch.undo()
    assert recorder is not None
    recorder.flush()
    s.close()
    assert [line["seq"] for line in read_lines(path)] == [0, 1, 2, 3]
    assert first_results(path) == ["0/0", "1/0", "2/0"]
    report = await replay(path, Dispatcher(_registry(), gate=lambda c, ctx: Allow()))
    assert report.ok and report.batches == 3


def _interrupting_once(original: Any) -> Any:
    """`original`, raising KeyboardInterrupt instead the first time the loop's thread calls it."""
    armed = [True]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    return interrupted


async def _dispatch_until_interrupted(s: Any, returned: list[str]) -> int:
    """Batches 1, 2, ... on end, until one raises KeyboardInterrupt (the loop writes those
    gathered meanwhile); each that returned adds its text to `returned`. The number of the
    interrupted one, whose tools ran."""
    n = 1
    with pytest.raises(KeyboardInterrupt):
        with anyio.fail_after(10):
            while True:
                await s.dispatch(_batch(n))
                returned.append(f"{n}/0")
                n += 1
    return n


@pytest.mark.parametrize("where", ["encode_line", "_common_rows"])
async def test_an_interrupt_while_the_loop_writes_the_records_gathered_loses_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A KeyboardInterrupt that lands on the loop's thread as it makes, numbers and encodes
    the records gathered, before their `write` (here at the first record's encoding, or as
    the rows of those gathered unbuilt are made, where a signal's handler may run): the
    batches that returned before it lose nothing, since `close()` writes what is gathered,
    and the file is whole and replays."""
    path = tmp_path / "interrupted.jsonl"
    s = _session(path)
    await s.dispatch(_batch(0))
    await until_lines(path, 2)
    from dispatcher import _recording

    monkeypatch.setattr(_recording, where, _interrupting_once(getattr(_recording, where)))
    returned = ["0/0"]
    n = await _dispatch_until_interrupted(s, returned)
    monkeypatch.undo()
    s.close()
    got = first_results(path)
    assert got in (returned, [*returned, f"{n}/0"])  # the interrupted batch's tools ran
    assert [line["seq"] for line in read_lines(path)] == list(range(len(got) + 1))


async def test_a_file_replaced_after_an_interrupt_on_the_loop_is_noticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt lands as the loop goes to write the records gathered, then the file is
    renamed over: the loop had told `_open` that the file was still named (`_named_fd`),
    and that must not outlive the write it was said for, or the records go on in the
    file that is gone. They are in the file now at the path, after its header."""
    path = tmp_path / "interrupted.jsonl"
    s = _session(path)
    await s.dispatch(_batch(0))
    await until_lines(path, 2)
    # as it would at `_open`'s first instruction
    monkeypatch.setattr(Recorder, "_open", _interrupting_once(Recorder._open))
    returned: list[str] = []
    n = await _dispatch_until_interrupted(s, returned)
    monkeypatch.undo()
    (tmp_path / "other.jsonl").write_bytes(b"")
    os.replace(tmp_path / "other.jsonl", path)
    s.close()
    got = first_results(path)
    assert got in (returned, [*returned, f"{n}/0"])
    lines = read_lines(path)
    assert lines[0]["type"] == "header" and [line["seq"] for line in lines] == list(range(len(lines)))


_OPS: tuple[str, ...] = ("common", "big", "decided", "toolcall", "dict", "wait", "fsync", "replace")
_OPS += ("delete", "sleep", "flush")


def _move_away(path: Path, op: str) -> int | None:
    """The file at `path` replaced by an empty one or deleted; a descriptor that still reads
    it (None: there was no file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    if op == "replace":
        (path.parent / "other").write_bytes(b"")
        os.replace(path.parent / "other", path)
    else:
        path.unlink()
    return fd


def _contents(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


async def _program(path: Path, ops: list[tuple[str, float]]) -> None:
    """Run `ops` on a session recording to `path` with `wait` false, then check every file
    the recording went to (the ones replaced or deleted read through a descriptor kept
    open): each begins with a header, numbered 0, 1, 2, ... and chained, and together, in
    order, they hold every batch exactly once, in batch order (the serial reference)."""
    s = _session(path)
    recorder = s.recorder
    assert recorder is not None
    expected: list[str] = []
    kept: list[int] = []
    try:
        for n, (op, pause) in enumerate(ops):
            text = f"{n}/0"
            if op in ("common", "big", "decided"):
                size = 20 if op == "big" else 1
                tool = "asked" if op == "decided" else "echo"
                await s.dispatch([openai_call(f"{n}-{i}", tool, {"text": f"{n}/{i}"}) for i in range(size)])
                expected.append(text)
            elif op in ("toolcall", "dict"):
                arguments: Any = {"text": text} if op == "dict" else f'{{"text": "{text}"}}'
                await s.dispatch([ToolCall(f"{n}-0", "echo", arguments)])
                expected.append(text)
            elif op == "wait":
                recorder.wait = not recorder.wait
            elif op == "fsync":
                recorder.fsync = not recorder.fsync
            elif op in ("replace", "delete"):
                fd = _move_away(path, op)
                if fd is not None:
                    kept.append(fd)
            elif op == "sleep":
                await anyio.sleep(pause)
            elif op == "flush":
                assert recorder.flush(5)
        s.close()
        contents = [os.pread(fd, os.fstat(fd).st_size, 0) for fd in kept]
    finally:
        for fd in kept:
            os.close(fd)
    contents.append(_contents(path))
    got: list[str] = []
    for data in contents:
        if not data:
            continue
        recording = _read_data(data, path)
        assert recording.problem is None and not recording.truncated, recording.problem
        seqs = [orjson.loads(line)["seq"] for line in data.splitlines()]
        assert seqs == list(range(len(seqs)))
        got += [batch["results"][0]["content"] for _, batch in recording.batches]
    assert got == expected


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(_OPS),
            st.sampled_from([0.0, 0.0005, _GATHER, 2 * _GATHER, _GATHER_LONGEST + 0.005]),
        ),
        max_size=40,
    )
)
def test_any_mix_of_batches_replaced_files_and_toggles_matches_the_serial_reference(
    tmp_path_factory: pytest.TempPathFactory, backend: str, ops: list[tuple[str, float]]
) -> None:
    """Whatever mix comes (common batches, large ones, decided ones, ToolCall objects with
    text or dict arguments, `wait` and `fsync` toggled, the file replaced or deleted, pauses
    around `_GATHER` and `_GATHER_LONGEST`, flushes), the files hold the serial reference."""
    path = tmp_path_factory.mktemp("mix") / "mix.jsonl"
    anyio.run(_program, path, ops, backend=backend)


async def test_an_interrupt_as_the_records_gathered_are_handed_to_the_thread_loses_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt that lands as the loop hands the records gathered to the writer
    thread (here as their job is made, a Python function where a signal's handler may
    run), the file not yet open so that the loop cannot write them itself: they stay
    gathered, and counted nowhere else (a count of jobs left undone would keep the loop
    from writing ever after), and `close()` writes them."""
    path = tmp_path / "handed.jsonl"
    s = _session(path)
    assert s.recorder is not None
    from dispatcher import _recording

    original = _recording._Job
    armed = [True]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("records") and armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(_recording, "_GATHER", 10.0)  # the thread does not take them meanwhile
    await s.dispatch(_batch(0))  # gathered: the file is not open yet
    monkeypatch.setattr(_recording, "_Job", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.recorder.flush()  # hands them over
    monkeypatch.undo()
    assert s.recorder._unwritten == 0 or s.recorder._jobs.qsize() > 0
    await s.dispatch(_batch(1))
    s.close()
    assert first_results(path) == ["0/0", "1/0"]
    assert s.recorder._unwritten == 0
