"""The sandbox run_command runs in: what a command inside it cannot reach, and what
happens when there is no sandbox."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import builtin_tools
from builtin_tools import shell
from builtin_tools._sandbox import SandboxStatus, command_sandbox
from builtin_tools._workspace import Workspace
from builtin_tools.shell import ShellTools
from dispatcher._exceptions import ToolError

from ._fakes import tool_context
from ._system import require_program


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root.resolve()


@pytest.fixture
def bwrap() -> str:
    return require_program("bwrap", package="bubblewrap")


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP server on the host's loopback (the kernel accepts into its backlog); its port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


async def _run(ws: Path, command: str, **options: Any) -> str:
    tools = ShellTools(Workspace(ws), **options)
    with anyio.fail_after(10):
        return await tools.run_command({"command": command}, tool_context("run_command"))


def _any_exists(*paths: str) -> bool:
    return any(os.path.lexists(path) for path in paths)


def _connect(port: int) -> str:
    """A bash line that opens a TCP connection to the loopback `port` and says whether it could."""
    return f"if exec 3<>/dev/tcp/127.0.0.1/{port}; then echo connected; else echo refused; fi"


def test_the_sandbox_is_on_where_bwrap_works(ws: Path, bwrap: str) -> None:
    """With a working bwrap the sandbox is active, read-only commands run unconfirmed, and
    the tool's description says so."""
    status = command_sandbox()
    assert status == SandboxStatus(active=True, program=bwrap, reason=None)
    assert builtin_tools.command_sandbox() == status
    tools = ShellTools(Workspace(ws))
    assert tools.statistics() == shell.ShellStatistics(status, auto_approval=True, command_network=False)
    assert tools.needs_confirmation({"command": "ls"}) is False
    assert "runs in a sandbox" in tools.tools()[0].description
    assert "Read-only commands run without confirmation" in tools.tools()[0].description


async def test_a_command_cannot_write_outside_the_workspace(ws: Path, tmp_path: Path, bwrap: str) -> None:
    """An approved command writes the workspace, and nothing else of the host: not a
    folder beside it, not the system, not a home."""
    beside = tmp_path / "beside"
    beside.mkdir()
    out = await _run(
        ws,
        f"touch inside; touch {beside}/x; touch /usr/x; touch /etc/x; mkdir -p /root/x; echo done",
    )
    assert (ws / "inside").exists()
    assert list(beside.iterdir()) == []
    assert not _any_exists("/usr/x", "/etc/x", "/root/x")
    assert "Read-only file system" in out and "done" in out


async def test_a_command_sees_no_home_and_nothing_beside_the_workspace(
    ws: Path, tmp_path: Path, bwrap: str
) -> None:
    """/root and /home are empty inside, a file beside the workspace does not exist there,
    and the password hashes cannot be read."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2\n")
    home_listing = await _run(ws, "ls -A /root /home")
    assert home_listing.splitlines()[2:6] == ["/home:", "", "/root:", "stderr: (empty)"]
    leaked = await _run(ws, f"cat {secret}; cat /etc/shadow; echo end")
    assert "hunter2" not in leaked and "No such file" in leaked
    assert "root:" not in leaked.split("stderr:")[0]


async def test_a_command_cannot_reach_the_network(ws: Path, bwrap: str, listener: int) -> None:
    """A loopback server the host reaches is refused from inside the sandbox."""
    outside = await _run(ws, _connect(listener), sandbox=False)
    assert "connected" in outside
    inside = await _run(ws, _connect(listener))
    assert "refused" in inside and "connected" not in inside


async def test_command_network_gives_approved_commands_the_network(
    ws: Path, bwrap: str, listener: int
) -> None:
    """With command_network=True an approved command connects; the tool says so."""
    tools = ShellTools(Workspace(ws), command_network=True)
    assert "with network" in tools.tools()[0].description
    inside = await _run(ws, _connect(listener), command_network=True)
    assert "connected" in inside


@pytest.fixture
def mistaken_classifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """A classifier that wrongly lets bash, touch and cat's writes through unconfirmed."""
    for program in ("bash", "touch"):
        monkeypatch.setitem(shell._READ_ONLY_PROGRAMS, program, shell._Refused())


async def test_a_classifier_mistake_can_neither_write_nor_reach_out(
    ws: Path, bwrap: str, listener: int, mistaken_classifier: None
) -> None:
    """Were a writing or connecting command taken for read-only, it would still find the
    workspace read-only and no network, even with command_network=True."""
    tools = ShellTools(Workspace(ws), command_network=True)
    assert tools.needs_confirmation({"command": "touch x"}) is False
    wrote = await _run(ws, "touch x", command_network=True)
    assert "Read-only file system" in wrote and not (ws / "x").exists()
    command = f"bash -c '{_connect(listener)}'"
    assert tools.needs_confirmation({"command": command}) is False
    reached = await _run(ws, command, command_network=True)
    assert "refused" in reached and "connected" not in reached
    # Not even by remounting the workspace writable: the command holds no capability.
    remount = f"bash -c 'mount -o remount,rw,bind {ws} {ws}; mount -o remount,rw /usr; touch {ws}/y'"
    assert tools.needs_confirmation({"command": remount}) is False
    remounted = await _run(ws, remount)
    assert "Read-only file system" in remounted and not (ws / "y").exists()


async def test_a_command_holds_no_capability(ws: Path, bwrap: str) -> None:
    """Even run by root, a command in the sandbox has an empty capability set."""
    out = await _run(ws, "grep CapEff /proc/self/status")
    assert "CapEff:\t0000000000000000" in out


async def test_a_read_only_pipeline_runs_in_the_sandbox(ws: Path, bwrap: str) -> None:
    """A read-only pipeline reads the workspace in the sandbox, stage into stage."""
    (ws / "a.txt").write_text("b\na\nc\na\n")
    out = await _run(ws, "cat a.txt | sort | grep -c a")
    assert out.splitlines()[:3] == ["exit code: 0", "stdout:", "2"]
    # Approved (it names a path outside), it still sees only the sandbox's empty /root.
    seen = await _run(ws, "ls -A /root")
    assert seen.splitlines()[:2] == ["exit code: 0", "stdout: (empty)"]


def test_a_sandboxed_command_runs_under_asyncio(ws: Path, bwrap: str) -> None:
    """The tool runs on an asyncio loop: a read-only pipeline and an approved write, both
    sandboxed."""
    (ws / "a.txt").write_text("one\ntwo\n")
    tools = ShellTools(Workspace(ws))

    async def main() -> tuple[str, str]:
        ctx = tool_context("run_command")
        read = await tools.run_command({"command": "cat a.txt | wc -l"}, ctx)
        wrote = await tools.run_command({"command": "echo hi > b.txt; cat b.txt"}, ctx)
        return read, wrote

    read, wrote = asyncio.run(main())
    assert read.splitlines()[:3] == ["exit code: 0", "stdout:", "2"]
    assert "hi" in wrote and (ws / "b.txt").read_text() == "hi\n"


def test_a_timeout_under_asyncio_kills_the_command(ws: Path, bwrap: str) -> None:
    """On asyncio too, a command past its timeout is killed and the call fails."""
    tools = ShellTools(Workspace(ws))

    async def main() -> None:
        await tools.run_command({"command": "sleep 20", "timeout": 0.3}, tool_context("run_command"))

    with pytest.raises(ToolError, match=r"timed out after 0\.3 s"):
        asyncio.run(main())


# -- no sandbox -------------------------------------------------------------------------------


def test_without_bwrap_every_command_needs_confirmation(
    ws: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bwrap that is not there turns auto-approval off, says why once in the log, in
    statistics() and in the description."""
    missing = str(tmp_path / "no-bwrap")
    with caplog.at_level(logging.WARNING, logger="threepass.shell"):
        first = ShellTools(Workspace(ws), bwrap=missing)
        ShellTools(Workspace(ws), bwrap=missing)
    stats = first.statistics()
    assert stats.sandbox.active is False and stats.auto_approval is False
    assert stats.sandbox.reason is not None and "cannot start" in stats.sandbox.reason
    assert [r.getMessage() for r in caplog.records].count(
        f"run_command has no sandbox, so every command needs confirmation: {stats.sandbox.reason}"
    ) == 1
    assert first.needs_confirmation({"command": "ls"}) is True
    description = first.tools()[0].description
    assert "without a sandbox (bwrap is missing or cannot start)" in description
    assert "Every command needs confirmation" in description


def test_a_bwrap_that_cannot_start_turns_auto_approval_off(ws: Path, tmp_path: Path) -> None:
    """A bwrap that starts but cannot build the sandbox (no user namespaces, say) is
    found out by trying it once, and its complaint is the reason."""
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    tools = ShellTools(Workspace(ws), bwrap=str(broken))
    assert tools.statistics().sandbox == SandboxStatus(
        active=False,
        program=str(broken),
        reason=f"{broken} cannot start a sandbox: bwrap: No permissions to creating new namespace",
    )
    assert tools.needs_confirmation({"command": "cat a.txt"}) is True


async def test_an_approved_command_still_runs_without_a_sandbox(ws: Path, tmp_path: Path) -> None:
    """With no sandbox, a command the gate approved runs (unsandboxed, as the user chose)."""
    out = await _run(ws, "echo hi > a.txt; cat a.txt", bwrap=str(tmp_path / "no-bwrap"))
    assert "hi" in out and (ws / "a.txt").exists()


def test_sandbox_false_leaves_the_classifier_to_decide(ws: Path) -> None:
    """sandbox=False is the explicit choice to run unsandboxed: read-only commands run
    unconfirmed, and the description says there is no sandbox."""
    tools = ShellTools(Workspace(ws), sandbox=False)
    assert tools.statistics().sandbox == SandboxStatus(False, None, "turned off (sandbox=False)")
    assert tools.statistics().auto_approval is True
    assert tools.needs_confirmation({"command": "ls"}) is False
    assert tools.needs_confirmation({"command": "ls > x"}) is True
    assert "without a sandbox" in tools.tools()[0].description


def test_default_registry_passes_the_options_on(ws: Path) -> None:
    """default_registry(sandbox=..., command_network=...) reaches run_command."""
    off = builtin_tools.default_registry(ws, include=["run_command"], sandbox=False)
    assert "without a sandbox (turned off" in off.get("run_command").description
    assert off.get("run_command").confirm({"command": "ls"}) is False  # type: ignore[operator]


async def test_sandbox_read_only_paths_show_a_host_folder_read_only(
    ws: Path, tmp_path: Path, bwrap: str
) -> None:
    """A folder named in sandbox_read_only_paths is readable inside, and not writable."""
    tools_dir = tmp_path / "toolchain"
    tools_dir.mkdir()
    (tools_dir / "version").write_text("1.2\n")
    out = await _run(ws, f"cat {tools_dir}/version; touch {tools_dir}/x", sandbox_read_only_paths=[tools_dir])
    assert "1.2" in out and "Read-only file system" in out
    assert sorted(p.name for p in tools_dir.iterdir()) == ["version"]


async def test_a_pipeline_whose_reader_stops_early_ends(ws: Path, bwrap: str) -> None:
    """`cat big | head -1` ends when head does: the writer is not left blocked on the pipe."""
    (ws / "big.txt").write_text("line\n" * 2_000_000)
    start = anyio.current_time()
    out = await _run(ws, "cat big.txt | head -1")
    assert out.splitlines()[:3] == ["exit code: 0", "stdout:", "line"]
    assert anyio.current_time() - start < 5
