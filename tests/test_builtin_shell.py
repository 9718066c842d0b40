"""run_command with real processes, and the read-only test that drives its flags."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from builtin_tools import default_registry
from builtin_tools._workspace import Workspace
from builtin_tools.shell import ShellTools, is_read_only_command
from dispatcher import Allow, Deny, Dispatcher, Status, ToolCall
from dispatcher._exceptions import ToolError

from ._fakes import tool_context


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root.resolve()


async def _run(ws: Path, command: str, **extra: Any) -> str:
    tools = ShellTools(Workspace(ws), **extra.pop("options", {}))
    with trio.fail_after(10):
        return await tools.run_command({"command": command, **extra}, tool_context("run_command"))


async def test_run_command_returns_exit_code_and_both_streams(ws: Path) -> None:
    """The result carries the exit code, stdout and stderr, each labelled."""
    out = await _run(ws, "echo to-out; echo to-err >&2; exit 3")
    assert out.splitlines() == ["exit code: 3", "stdout:", "to-out", "stderr:", "to-err"]


async def test_run_command_runs_in_the_workspace_or_cwd(ws: Path) -> None:
    """The working folder is the workspace, or `cwd` inside it."""
    (ws / "sub").mkdir()
    assert (await _run(ws, "pwd")).splitlines()[2] == str(ws)
    assert (await _run(ws, "pwd", cwd="sub")).splitlines()[2] == str(ws / "sub")
    assert "stderr: (empty)" in await _run(ws, "true")


async def test_run_command_refuses_a_cwd_outside(ws: Path) -> None:
    """A cwd that leaves the workspace is a ToolError naming it; nothing runs."""
    with pytest.raises(ToolError, match=r"'\.\.' is outside the workspace"):
        await _run(ws, "touch escaped", cwd="..")
    assert not (ws.parent / "escaped").exists()


async def test_run_command_has_no_stdin(ws: Path) -> None:
    """stdin is closed: a command waiting for input sees end of file instead of hanging."""
    out = await _run(ws, "cat; echo done")
    assert "done" in out and out.startswith("exit code: 0")


async def test_run_command_timeout_kills_the_whole_group(ws: Path) -> None:
    """Past its timeout the command and its children are killed and the call fails."""
    start = trio.current_time()
    with pytest.raises(ToolError, match=r"timed out after 0\.5 s") as info:
        await _run(ws, "sleep 30 & echo $! > child.pid; echo partial; wait", timeout=0.5)
    assert trio.current_time() - start < 5
    assert "partial" in info.value.message
    child = int((ws / "child.pid").read_text())
    with trio.fail_after(5):
        while _alive(child):  # noqa: ASYNC110 - another process: nothing to wait on but polling
            await trio.sleep(0.05)


async def test_run_command_output_is_bounded_head_and_tail(ws: Path) -> None:
    """Long output keeps its start and its end, and says how much was left out."""
    out = await _run(ws, "seq 1 100000", options={"max_output_bytes": 1000})
    assert "\n1\n2\n3\n" in out
    assert out.endswith("99999\n100000\nstderr: (empty)")
    assert "bytes omitted ...]" in out
    assert len(out) < 1500


async def test_run_command_does_not_wait_for_background_children(ws: Path) -> None:
    """A background child holding the output open does not keep the call waiting."""
    start = trio.current_time()
    try:
        out = await _run(ws, "sleep 20 & echo $! > bg.pid; echo started")
    finally:
        if (ws / "bg.pid").exists():
            _kill(int((ws / "bg.pid").read_text()))
    assert trio.current_time() - start < 5
    assert "started" in out
    assert "stopped reading" in out


async def test_run_command_reports_a_shell_that_cannot_start(ws: Path) -> None:
    """A missing shell is a plain, non-retryable ToolError, not an exception group."""
    tools = ShellTools(Workspace(ws))
    tools.shell = str(ws / "no-such-shell")
    with trio.fail_after(10), pytest.raises(ToolError, match="cannot start the command") as info:
        await tools.run_command({"command": "echo hi"}, tool_context("run_command"))
    assert info.value.retryable is False


async def test_run_command_reports_a_bad_timeout(ws: Path) -> None:
    """A timeout outside (0, 600] is refused before anything runs."""
    with pytest.raises(ToolError, match="timeout must be"):
        await _run(ws, "echo hi", timeout=601)


@pytest.mark.parametrize(
    "command",
    [
        "ls -la",
        "cat a.txt | grep -n foo | head -5",
        "wc -l *.py",
        "rg 'a;b' src",
        "find . -name '*.py' -type f",
        "git status --short",
        "git log --oneline -5",
        "git diff HEAD~1",
        "echo 'quoted > not a redirect'",
        "tail -n 20 log.txt",
        "pwd",
        "grep -n '#include' main.c",
        "git diff --output-indicator-new=+",
    ],
)
def test_read_only_commands(command: str) -> None:
    """Allow-listed programs with harmless arguments are read-only."""
    assert is_read_only_command(command) is True


@pytest.mark.parametrize(
    "command",
    [
        "rm -rf build",
        "ls > listing.txt",
        "echo hi >> log.txt",
        "cat a | tee b",
        "ls; rm x",
        "ls && rm x",
        "ls || rm x",
        "ls & rm x",
        "echo $(rm x)",
        'echo "$(rm x)"',
        "echo `rm x`",
        "find . -delete",
        "find . -exec rm {} ;",
        "rg --pre=./script pattern",
        "git commit -m x",
        "git -c core.pager=sh status",
        "git diff --output=patch.txt",
        "git diff --outp=patch.txt",
        "git log --outpu patch.txt -1",
        "git diff --ext-d",
        "git show --textc",
        "FOO=1 ls",
        "ls\nrm x",
        "cat < input",
        "(rm x)",
        "ls |",
        "echo 'unclosed",
        "",
        "python -c 'print(1)'",
        "ls a#; touch X",
        "echo x#&&touch P",
        "ls a#|touch P",
        "ls # ; touch X",
    ],
)
def test_commands_that_are_not_read_only(command: str) -> None:
    """Anything that may write, run another program or is unclear is not read-only."""
    assert is_read_only_command(command) is False


def test_run_command_flags_follow_the_read_only_test(ws: Path) -> None:
    """Read-only commands need no confirmation and write nothing; others are confirmed and
    write unknown files."""
    tool = default_registry(ws, include=["run_command"]).get("run_command")
    assert tool.concurrent is False and tool.deferred is True
    assert callable(tool.confirm) and tool.writes is not None and tool.reads is not None
    assert tool.confirm({"command": "git status"}) is False
    assert tool.writes({"command": "git status"}) == set()
    assert tool.reads({"command": "git status"}) == {"file:/"}
    assert tool.confirm({"command": "make"}) is True
    assert tool.writes({"command": "make"}) == {"file:/"}
    assert tool.confirm({}) is True  # unreadable arguments are not trusted


@pytest.mark.parametrize("command", ["ls a#; touch X", "echo x#&&touch X", "ls a#|touch X"])
async def test_a_hash_inside_a_word_hides_nothing_from_the_gate(ws: Path, command: str) -> None:
    """A `#` inside a word does not hide what follows: the gate is asked, and its refusal
    means nothing runs."""
    asked: list[str] = []

    def gate(call: ToolCall, ctx: Any) -> Allow | Deny:
        asked.append(str(dict(call.arguments)["command"]))
        return Deny("no")

    dispatcher = Dispatcher(default_registry(ws, include=["run_command"]), gate=gate)
    with trio.fail_after(10):
        result = await dispatcher.invoke("run_command", {"command": command})
    assert asked == [command]
    assert result.status is Status.denied
    assert os.listdir(ws) == []


_needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(ws: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        cwd=ws, check=True, capture_output=True,
    )  # fmt: skip


def _hostile_repository(ws: Path, outside: Path) -> None:
    """A repository whose config names a program (writing into `outside`) for every way
    git runs one on status, diff, log and show."""
    outside.mkdir()
    payload = outside / "payload.sh"
    payload.write_text(f'#!/bin/sh\ntouch "{outside}/ran-$1"\ncat\n')
    payload.chmod(0o755)
    _git(ws, "init", "-q", ".")
    (ws / "f.txt").write_text("a\n")
    (ws / ".gitattributes").write_text("* diff=conv filter=clean\n")
    _git(ws, "add", ".")
    _git(ws, "commit", "-q", "-m", "first")
    for key, value in [
        ("core.fsmonitor", f"{payload} fsmonitor"),
        ("diff.external", f"{payload} external"),
        ("diff.conv.textconv", f"{payload} textconv"),
        ("filter.clean.clean", f"{payload} clean"),
        ("filter.clean.required", "true"),
        ("log.showSignature", "true"),
        ("gpg.program", f"{payload} gpg"),
    ]:
        _git(ws, "config", key, value)
    (ws / "f.txt").write_text("b\n")


@_needs_git
async def test_read_only_git_runs_nothing_the_repository_config_names(ws: Path, tmp_path: Path) -> None:
    """git status/diff/log/show run without confirmation, so they run none of the programs
    the repository's config names, and still show the change."""
    outside = tmp_path / "outside"
    _hostile_repository(ws, outside)
    commands = ["git status", "git status -v", "git diff", "git log -p", "git show", "git diff HEAD"]
    assert all(is_read_only_command(c) for c in commands)
    outputs = {c: await _run(ws, c) for c in commands}
    assert sorted(p.name for p in outside.iterdir()) == ["payload.sh"]
    assert "modified:   f.txt" in outputs["git status"]
    assert "-a\n+b" in outputs["git diff"] and "-a\n+b" in outputs["git diff HEAD"]
    assert "first" in outputs["git log -p"]
    # The same config does run its programs when git is run as written.
    with trio.fail_after(10):
        await trio.run_process(["git", "diff"], cwd=ws, capture_stdout=True, check=False)
    assert any(p.name.startswith("ran-") for p in outside.iterdir())


@_needs_git
async def test_git_that_needed_confirmation_runs_as_written(ws: Path, tmp_path: Path) -> None:
    """A command the gate approved gets no forced git settings: the user chose to run it."""
    outside = tmp_path / "outside"
    _hostile_repository(ws, outside)
    assert not is_read_only_command("git diff; true")
    await _run(ws, "git diff; true")
    assert any(p.name.startswith("ran-") for p in outside.iterdir())


@_needs_git
async def test_read_only_git_ignores_a_folder_that_looks_like_a_bare_repository(ws: Path) -> None:
    """Plain files shaped like a bare repository are not taken for one (their config could
    name programs); git says so instead of running."""
    _git(ws, "init", "-q", "--bare", "plain")
    out = await _run(ws, "git log", cwd="plain")
    assert out.startswith("exit code: 128") and "cannot use bare repository" in out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
