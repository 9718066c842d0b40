"""background_command with real processes: start, output, list, stop, and the session's end."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from builtin_tools._workspace import Workspace
from builtin_tools.shell import ShellTools
from dispatcher import Deny, Dispatcher, Registry, Session, Status, ToolResult

from ._procs import alive, pids_with_argument
from ._system import require_program

# Unsandboxed: for the behaviour of processes themselves, seen from the host.
_BARE = {"sandbox": False}


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root.resolve()


def _dispatcher(ws: Path, gate: Any = None, **options: Any) -> Dispatcher:
    return Dispatcher(Registry(ShellTools(Workspace(ws), **options).tools()), gate=gate)


async def _bg(s: Session, **args: Any) -> ToolResult:
    with anyio.fail_after(10):
        return await s.invoke("background_command", args)


async def _until(s: Session, job: str, text: str) -> str:
    """The output of `job` read until `text` shows in it (everything read so far)."""
    seen = ""
    with anyio.fail_after(10):
        while text not in seen:
            seen += (await _bg(s, action="output", id=job)).content + "\n"
            await anyio.sleep(0.05)
    return seen


async def _pids_appear(argument: str, count: int = 1) -> list[int]:
    with anyio.fail_after(10):
        while len(pids := pids_with_argument(argument)) < count:  # noqa: ASYNC110  # the process table
            await anyio.sleep(0.05)
    return pids


async def _all_gone(pids: list[int]) -> None:
    with anyio.fail_after(5):
        while any(alive(pid) for pid in pids):  # noqa: ASYNC110  # the process table
            await anyio.sleep(0.05)


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Pids a failing test would leave behind, killed at its end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_start_returns_at_once_and_output_reads_what_is_new(ws: Path) -> None:
    """Start returns the id before the command ends; output returns only what came since
    the last read; list shows it; stop ends it."""
    async with _dispatcher(ws, **_BARE).session("s") as s:
        start = anyio.current_time()
        command = "echo $((40+2)); sleep 0.3; echo $((50+5)); sleep 30"
        started = await _bg(s, command=command)
        assert anyio.current_time() - start < 2
        assert started.status is Status.ok and started.content.startswith(f"started bg1: {command}\n")
        assert "\n42\n" in await _until(s, "bg1", "\n42\n")
        later = await _until(s, "bg1", "\n55\n")
        assert "42" not in later
        listing = await _bg(s, action="list")
        assert listing.content.startswith("bg1 running (") and listing.content.endswith(command)
        stopped = await _bg(s, action="stop", id="bg1")
        assert stopped.content.startswith("bg1 stopped, killed by signal 15: ")
        assert (await _bg(s, action="output", id="bg1")).content.endswith("no new output")


async def test_stop_lets_a_sandboxed_command_clean_up(ws: Path) -> None:
    """In the sandbox, stop's SIGTERM reaches the command itself, which may exit cleanly."""
    require_program("bwrap", package="bubblewrap")
    async with _dispatcher(ws).session("s") as s:
        trap = "trap 'echo cleaned-$((1+1)); exit 0' TERM"
        await _bg(s, command=f"{trap}; echo ready-$((2+3)); sleep 60 & wait")
        await _until(s, "bg1", "ready-5")
        stopped = await _bg(s, action="stop", id="bg1")
    assert stopped.content.startswith("bg1 stopped, exit code 0: ")
    assert "cleaned-2" in stopped.content


async def test_a_command_that_exits_reports_its_exit_code(ws: Path) -> None:
    """A command that ends on its own is reported as exited with its exit code."""
    async with _dispatcher(ws, **_BARE).session("s") as s:
        await _bg(s, command="echo done; exit 3")
        assert "bg1 exited, exit code 3: echo done; exit 3" in await _until(s, "bg1", "exit code 3")


async def test_output_is_bounded_head_and_tail(ws: Path) -> None:
    """Output past the bound keeps its start and its end and says how much was left out."""
    async with _dispatcher(ws, max_output_bytes=1000, **_BARE).session("s") as s:
        await _bg(s, command="seq 1 100000")
        reads: list[str] = []  # a busy machine may show the output in more than one read
        with anyio.fail_after(10):
            while not reads or "exited" not in reads[-1]:
                reads.append((await _bg(s, action="output", id="bg1")).content)
                await anyio.sleep(0.05)
        out = "\n".join(reads)
        assert "\n1\n2\n3\n" in out and "99999\n100000" in out
        assert "bytes omitted ...]" in out
        assert all(len(read) < 1500 for read in reads)


async def test_a_character_cut_between_reads_is_shown_whole(ws: Path) -> None:
    """A UTF-8 character half written when output is read comes whole with the next read."""
    async with _dispatcher(ws, **_BARE).session("s") as s:
        # the words printed are made by the shell, so that the command line does not hold them
        halves = r"printf 'p%s \xe2\x82' $((1+1)); sleep 0.4; printf '\xac q%s\n' $((3+4))"
        await _bg(s, command=f"{halves}; sleep 30")
        first = await _until(s, "bg1", "p2 ")
        assert "\ufffd" not in first
        # a busy machine may read first only after the 0.4 s, both halves in one read
        both = first if "q7" in first else first + await _until(s, "bg1", "q7")
        assert "\u20ac q7" in both
        await _bg(s, action="stop", id="bg1")


async def test_an_unknown_id_or_action_fails_plainly(ws: Path) -> None:
    """An id the session never started, or a start without a command, fails naming it."""
    async with _dispatcher(ws, **_BARE).session("s") as s:
        missing = await _bg(s, action="output", id="bg7")
        assert missing.status is Status.failed and "no background command 'bg7'" in missing.content
        assert "needs the command" in (await _bg(s)).content
        assert (await _bg(s, action="list")).content == "no background commands in this session"


async def test_starting_needs_confirmation_unless_read_only(ws: Path) -> None:
    """Starting a command that is not read-only goes to the gate, as run_command does;
    a read-only start, output, list and stop never do."""
    asked: list[dict[str, Any]] = []

    def gate(call: Any, ctx: Any) -> Deny:
        asked.append(dict(call.arguments))
        return Deny("not now")

    (ws / "log.txt").write_text("line one\n")
    async with _dispatcher(ws, gate=gate, **_BARE).session("s") as s:
        denied = await _bg(s, command="touch made")
        assert denied.status is Status.denied and not (ws / "made").exists()
        assert (await _bg(s, command="tail -f log.txt")).status is Status.ok
        assert "line one" in await _until(s, "bg1", "line one")
        await _bg(s, action="list")
        await _bg(s, action="stop", id="bg1")
    assert asked == [{"action": "start", "command": "touch made"}]


async def test_a_read_only_sandboxed_start_runs_without_the_gate(ws: Path) -> None:
    """In the sandbox a read-only command starts with no gate asked, and it reads the workspace."""
    require_program("bwrap", package="bubblewrap")

    def gate(call: Any, ctx: Any) -> Deny:
        raise AssertionError(f"the gate was asked about {call}")

    (ws / "notes.txt").write_text("sandboxed read\n")
    async with _dispatcher(ws, gate=gate).session("s") as s:
        started = await _bg(s, command="tail -f notes.txt")
        assert started.status is Status.ok
        assert "sandboxed read" in await _until(s, "bg1", "sandboxed read")


async def test_closing_the_session_kills_a_double_forked_child_unsandboxed(
    ws: Path, reaper: list[int]
) -> None:
    """Without the sandbox, a grandchild whose parent exited (it stays in the process group)
    dies when the session closes, and so does the command."""
    d = _dispatcher(ws, **_BARE)
    s = d.session("s")
    await _bg(s, command="(sleep 88.11 &); exec sleep 88.12")
    pids = await _pids_appear("88.11") + await _pids_appear("88.12")
    reaper.extend(pids)
    s.close()
    await _all_gone(pids)


async def test_closing_the_session_kills_the_whole_sandbox(ws: Path, reaper: list[int]) -> None:
    """In the sandbox, a child that double-forked into a session of its own dies with the
    session, found by its pid on the host after the close; their output files go too."""
    require_program("bwrap", package="bubblewrap")
    require_program("setsid", package="util-linux")
    d = _dispatcher(ws)
    s = d.session("s")
    await _bg(s, command="setsid sh -c 'sleep 77.31 & exit'; sleep 77.32")
    await _bg(s, command="sleep 77.33")
    pids = [*await _pids_appear("77.31"), *await _pids_appear("77.32"), *await _pids_appear("77.33")]
    reaper.extend(pids)
    folder = s.state["background_commands"].folder
    assert sorted(p.name for p in folder.iterdir()) == ["bg1.out", "bg2.out"]
    s.close()
    await _all_gone(pids)
    assert not folder.exists()


@pytest.mark.trio
async def test_a_sandboxed_command_outlives_the_worker_threads(
    ws: Path, monkeypatch: pytest.MonkeyPatch, reaper: list[int]
) -> None:
    """bwrap dies with the thread that forked it: a background command keeps running when
    every idle worker thread exits."""
    require_program("bwrap", package="bubblewrap")
    from trio._core import _thread_cache

    monkeypatch.setattr(_thread_cache, "IDLE_TIMEOUT", 0.05)
    async with _dispatcher(ws).session("s") as s:
        await anyio.to_thread.run_sync(lambda: None)  # a worker thread that then goes idle
        await _bg(s, command="sleep 47.3")
        pids = await _pids_appear("47.3")
        reaper.extend(pids)
        await anyio.sleep(1.0)  # twenty idle timeouts
        assert all(alive(pid) for pid in pids)
        assert (await _bg(s, action="list")).content.startswith("bg1 running")
    await _all_gone(pids)
