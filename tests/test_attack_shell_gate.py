"""Attacks on run_command's gate: commands that try to run with no confirmation asked and
still read outside the workspace, write, reach the network, run another program or outlive
the call. Each goes through the real dispatcher, a gate that records whether it was asked
(and refuses), and the real bwrap."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from dispatcher import Status

from ._procs import pids_with_argument
from ._shell_gate import Gate, git_in, payload, run_command, shell_dispatcher
from ._system import require_program

_MARK = "PAYLOAD-RAN-7d41"  # what a program run by a hostile config prints to stderr
_SLEEP = "93.7141"  # the argument of a process a payload tries to leave running


@pytest.fixture
def anyio_backend() -> str:
    """One event loop: these tests are about the tool, not the loop (and must stay quick)."""
    return "asyncio"


@pytest.fixture
def bwrap() -> str:
    return require_program("bwrap", package="bubblewrap")


@pytest.fixture
def git() -> str:
    return require_program("git", package="git")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A workspace with a.txt, sub/b.txt, a link inside, links to outside, and a secret beside it."""
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "outside.txt").write_text("OUTSIDE-SECRET\n")
    (root / "a.txt").write_text("a\n")
    (root / "sub").mkdir()
    (root / "sub" / "b.txt").write_text("b\n")
    (root / "inner").symlink_to(root / "a.txt")
    (root / "leak").symlink_to(tmp_path / "outside.txt")
    (root / "up").symlink_to(tmp_path)
    (root / "etc-link").symlink_to("/etc")
    return root.resolve()


@pytest.fixture
def reaper() -> Iterator[None]:
    """Kills whatever a payload left running (the `_SLEEP` processes) at the test's end."""
    yield
    for pid in pids_with_argument(_SLEEP):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP server on the host's loopback that would see any connection from a command."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    try:
        yield server
    finally:
        server.close()


def _was_connected(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


# -- (a) reading outside through a file of names ----------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        "sort --files0-from=names",
        "sort --files0 names",
        "wc --files0-from=names",
        "du --files0-from=names",
        "find -files0-from names -maxdepth 0",
    ],
)
async def test_a_file_of_names_never_leads_outside_unasked(
    ws: Path, bwrap: str, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--files0-from` (sort, wc, du, find) reading names of paths outside is never auto-approved."""
    monkeypatch.setenv("THREEPASS_ATTACK_SECRET", "sk-live-attack-0001")
    # A file the model may write with edit_file, which no gate guards.
    (ws / "names").write_bytes(b"/etc/passwd\0/proc/self/environ")
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert "sk-live-attack-0001" not in result.content
    assert "/etc/passwd" not in result.content and "root:x:0:0" not in result.content
    assert gate.commands() == [command], result.content


# -- (e) /proc/self resolved in the checker's process, not the command's ----------------------


@pytest.mark.parametrize("tool", ["run_command", "background_command"])
async def test_proc_self_cwd_never_leads_outside_unasked(
    ws: Path, bwrap: str, tool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/proc/self/cwd/..` is never auto-approved, wherever the agent's own cwd is."""
    # The agent runs in a folder deep inside its workspace (as deep as the workspace is
    # below /): the check resolves /proc/self/cwd as the agent's folder, so the climb stays
    # inside; the command, run from the workspace root, climbs to / instead.
    depth = len(ws.parts)
    deep = ws.joinpath(*["d"] * depth)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    command = "cat /proc/self/cwd/" + "../" * depth + "etc/passwd"
    gate = Gate()
    async with shell_dispatcher(ws, gate).session("s") as s:
        with anyio.fail_after(30):
            result = await s.invoke(tool, {"command": command})
            if tool == "background_command" and result.status is Status.ok:
                await anyio.sleep(1)
                result = await s.invoke(tool, {"action": "output", "id": "bg1"})
    assert "root:x:0:0" not in result.content
    assert gate.commands() == [command], result.content


# -- (e) a symlink swapped in between the check and the run ------------------------------------


_AT_FDCWD = -100
try:
    _renameat2: Any = ctypes.CDLL(None, use_errno=True).renameat2
except AttributeError:
    _renameat2 = None


@pytest.mark.parametrize(
    ("target", "name", "raced"),
    [("beside", "outside.txt", "No such file"), ("/proc/self", "environ", "PATH=")],
)
async def test_a_folder_swapped_for_a_link_after_the_check_shows_only_what_the_sandbox_shows(
    ws: Path, tmp_path: Path, bwrap: str, monkeypatch: pytest.MonkeyPatch, target: str, name: str, raced: str
) -> None:
    """A folder swapped for a link to outside between the check and the run (a race no check
    of paths can win) is read as the sandbox shows it: a file beside the workspace is not
    there, and the command's own environment holds nothing of the agent's but the locale."""
    if _renameat2 is None:
        pytest.skip("renameat2 is not available")
    monkeypatch.setenv("THREEPASS_ATTACK_SECRET", "sk-live-attack-0002")
    (ws / "d").mkdir()
    (ws / "d" / name).write_text("inside\n")
    (ws / ".parked").symlink_to(tmp_path if target == "beside" else target)
    d, parked = bytes(ws / "d"), bytes(ws / ".parked")
    stop = threading.Event()

    def swap() -> None:  # what any other process writing the workspace could do
        while not stop.is_set():
            _renameat2(_AT_FDCWD, d, _AT_FDCWD, parked, 2)  # RENAME_EXCHANGE

    gate = Gate()
    dispatcher = shell_dispatcher(ws, gate)
    seen: list[str] = []
    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    won = 0  # commands checked while `d` was a folder that ran while it was the link
    try:
        # a second at least, and on until the race has been won a few times (about one
        # try in seven wins it here), however slowly a busy machine runs the tries
        start = time.monotonic()
        while (won < 3 or time.monotonic() < start + 1) and time.monotonic() < start + 20:
            # trailing blanks: the same argv, but no result served from the cache
            command = f"cat d/{name}" + " " * len(seen)
            with anyio.fail_after(30):
                seen.append((await dispatcher.invoke("run_command", {"command": command})).content)
            won += "exit code" in seen[-1] and raced in seen[-1]  # run unasked, through the link
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not any("OUTSIDE-SECRET" in content or "sk-live-attack" in content for content in seen)
    assert won >= 3, seen[:3]


# -- (a), (d) git run unconfirmed, steered by a repository's own config ------------------------


async def test_git_whose_worktree_is_set_outside_shows_the_workspace_only(
    ws: Path, bwrap: str, git: str
) -> None:
    """`git diff` in a repository whose core.worktree is outside (here /etc) diffs the
    folder that holds its `.git`, never the one the config names."""
    git_in(ws, "init", "-q", ".")
    (ws / "passwd").write_text("inside\n")
    git_in(ws, "add", "passwd")
    git_in(ws, "commit", "-q", "-m", "first")
    git_in(ws, "config", "core.worktree", "/etc")
    (ws / "passwd").write_text("changed in the workspace\n")
    gate = Gate()
    result = await run_command(ws, {"command": "git diff"}, gate=gate)
    assert "root:x:0:0" not in result.content
    assert "+changed in the workspace" in result.content and "-inside" in result.content, result.content


@pytest.fixture
def nested_repository(ws: Path, git: str) -> Path:
    """A repository in the workspace whose submodule `lib` (a repository inside, with a
    modified file) names a clean filter in its own config."""
    git_in(ws, "init", "-q", ".")
    lib = ws / "lib"
    lib.mkdir()
    git_in(lib, "init", "-q", ".")
    (lib / "f.txt").write_text("a\n")
    (lib / ".gitattributes").write_text("* filter=evil\n")
    git_in(lib, "add", ".")
    git_in(lib, "commit", "-q", "-m", "lib")
    git_in(ws, "add", "lib")
    git_in(ws, "commit", "-q", "-m", "top")
    script = payload(ws, _MARK, "cat")
    git_in(lib, "config", "filter.evil.clean", str(script))
    (lib / "f.txt").write_text("b\n")
    return ws


@pytest.mark.parametrize("command", ["git status", "git diff", "git diff --submodule=diff"])
async def test_read_only_git_runs_no_program_a_submodule_config_names(
    nested_repository: Path, bwrap: str, command: str
) -> None:
    """Auto-approved git status/diff run no filter a submodule's own config names."""
    gate = Gate()
    result = await run_command(nested_repository, {"command": command}, gate=gate)
    assert _MARK not in result.content


@pytest.fixture
def partial_clone(tmp_path: Path, git: str) -> Path:
    """The workspace is a partial clone (blobs fetched on demand) whose remote's
    `uploadpack` names a program of the workspace's."""
    origin = tmp_path / "origin"
    origin.mkdir()
    git_in(origin, "init", "-q", ".")
    (origin / "f.txt").write_text("blob fetched on demand\n")
    git_in(origin, "add", ".")
    git_in(origin, "commit", "-q", "-m", "o")
    git_in(origin, "config", "uploadpack.allowFilter", "true")
    ws = tmp_path / "clone"
    git_in(tmp_path, "clone", "-q", "--filter=blob:none", "--no-checkout", f"file://{origin}", str(ws))
    return ws.resolve()


async def test_read_only_git_runs_no_upload_pack_the_config_names(partial_clone: Path, bwrap: str) -> None:
    """Auto-approved `git show` in a partial clone runs no remote.*.uploadpack program (lazy fetch)."""
    script = payload(partial_clone, _MARK, "exit 1")
    git_in(partial_clone, "config", "remote.origin.uploadpack", str(script))
    gate = Gate()
    for command in ("git show HEAD:f.txt", "git log -p"):
        result = await run_command(partial_clone, {"command": command}, gate=gate)
        assert _MARK not in result.content, f"{command!r} ran the payload unasked:\n{result.content}"


async def test_whatever_auto_approved_git_runs_cannot_write_connect_or_linger(
    partial_clone: Path, bwrap: str, listener: socket.socket, reaper: None
) -> None:
    """What a hostile git config runs in an auto-approved command cannot write, connect or linger."""
    port = listener.getsockname()[1]
    script = payload(
        partial_clone,
        _MARK,
        f"touch {partial_clone}/written\n"
        f"(exec 3<>/dev/tcp/127.0.0.1/{port}) && echo CONNECTED >&2\n"
        f"setsid sleep {_SLEEP} </dev/null >/dev/null 2>&1 &\n"
        "exit 1",
    )
    git_in(partial_clone, "config", "remote.origin.uploadpack", str(script))
    result = await run_command(partial_clone, {"command": "git show HEAD:f.txt"})
    assert not (partial_clone / "written").exists()
    assert "CONNECTED" not in result.content and not _was_connected(listener)
    with anyio.fail_after(5):
        while pids_with_argument(_SLEEP):  # noqa: ASYNC110  # polling the process table
            await anyio.sleep(0.05)


async def test_unsandboxed_auto_approved_git_writes_nothing_outside(
    partial_clone: Path, tmp_path: Path, reaper: None
) -> None:
    """With sandbox=False, auto-approved `git show` runs no program that writes outside."""
    outside = tmp_path / "outside-marker"
    script = payload(partial_clone, _MARK, f"touch {outside}\nexit 1")
    git_in(partial_clone, "config", "remote.origin.uploadpack", str(script))
    gate = Gate()
    result = await run_command(partial_clone, {"command": "git show HEAD:f.txt"}, gate=gate, sandbox=False)
    assert not outside.exists(), result.content


# -- what held: every spelling below goes to the gate ------------------------------------------


HELD = [
    # programs and options that run another program
    "git -c core.pager=sh log",
    "git -c core.fsmonitor=./x status",
    "git --output=x diff",
    "git --paginate log",
    "git diff --outpu=/tmp/x",
    "git log --ext-d",
    "git show --textco",
    "git difftool",
    "git grep -O x",
    "git log -O/etc/passwd",
    "tar --to-command=sh -xf a.tar",
    "tar -xf a.tar",
    "env cat a.txt",
    "env -i cat a.txt",
    "xargs cat",
    "cat a.txt | xargs cat",
    "awk 'BEGIN{system(\"id\")}'",
    "sed e a.txt",
    "sed -n '1e id' a.txt",
    "less a.txt",
    "more a.txt",
    "man ls",
    "sort --compress-prog=sh a.txt",
    "sort --comp=sh a.txt",
    "sort -ooops a.txt",
    "sort --ou=x a.txt",
    "rg --pre=sh x",
    "rg --pre-g=x x",
    "find . -execdir sh {} +",
    "find . -fprintf x %p",
    "find . -newer a.txt -exec id ';'",
    "find -L . -name x",
    # expansions, substitutions, redirections
    "cat $'\\x2fetc/passwd'",
    'cat "$HOME/.bashrc"',
    "cat ~/.bashrc",
    "cat ~root/.bashrc",
    "cat ${HOME}",
    "cat `echo /etc/passwd`",
    "cat $(printf /etc/passwd)",
    "cat <(cat /etc/passwd)",
    "cat a.txt > b.txt",
    "cat a.txt>>b.txt",
    "cat a.txt 2>b.txt",
    "cat a*",
    "cat a.tx?",
    "cat {a,b}.txt",
    "PATH=. cat a.txt",
    "GIT_DIR=/etc git status",
    "cat a.txt; id",
    "cat a.txt && id",
    "cat a.txt\nid",
    # paths outside: absolute, `..`, links, /proc, /dev
    "cat /etc/passwd",
    "cat '/etc/passwd'",
    "cat /et'c'/pass\"wd\"",
    "cat x/../../etc/passwd",
    "cat " + "../" * 40 + "etc/passwd",
    "cat sub/../../outside.txt",
    "cat leak",
    "cat up/outside.txt",
    "cat etc-link/passwd",
    "grep -r x up",
    "ls etc-link/",
    "cat /proc/self/root/etc/passwd",
    "cat /proc/1/root/etc/passwd",
    "cat /proc/self/environ",
    "cat /proc/thread-self/environ",
    "cat /dev/stdin",
    "cat /dev/fd/0",
    "head -c1 /dev/zero",
    "grep -f/etc/passwd a.txt",
    "grep --file=/etc/passwd a.txt",
    "grep -e x -f /etc/passwd a.txt",
    "sort --random-source=/etc/passwd a.txt",
    "du --files0-from=/etc/passwd",
    "git diff --no-index /etc/passwd a.txt",
    "git diff --no-index a.txt leak",
    "stat -c %n /etc/passwd",
    "find / -maxdepth 0",
    # unicode look-alikes, NUL, control characters, over-long words
    "\u0441\u0430t /etc/passwd",  # Cyrillic es and a
    "\uff43\uff41\uff54 a.txt",  # fullwidth "cat"
    "cat\u00a0/etc/passwd",  # no-break space
    "cat a.txt\u2028id",
    "'cat /etc/passwd'",
    "c'a't /etc/passwd",
    "cat a.txt\x00/etc/passwd",
    "cat 'a.txt\x00/etc/passwd'",
    "cat 'a.txt\x1b[2Jx'",
    "cat " + "a" * 5000,
    "grep -" + "x" * 300 + " a.txt",
    # network, writes, things that outlive the call
    "curl http://127.0.0.1/",
    "git fetch",
    "git ls-remote http://127.0.0.1/x",
    "git pull",
    "touch b",
    "tee b.txt",
    "cat a.txt | tee b.txt",
    "cp a.txt b.txt",
    "ln -s /etc q",
    "setsid sleep 5",
    "nohup sleep 5",
    "sleep 5 &",
    "timeout 9 cat a.txt",
]


@pytest.mark.parametrize("command", HELD)
async def test_the_gate_is_asked_before_anything_of_this_runs(ws: Path, bwrap: str, command: str) -> None:
    """Program-running options, expansions, paths outside and look-alikes are never auto-approved."""
    before = sorted(os.listdir(ws))
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert gate.commands() == [command]
    assert result.status is Status.denied
    assert sorted(os.listdir(ws)) == before


@pytest.mark.parametrize("command", ["tail -f /etc/passwd", "cat leak", "cat a.txt | tee b.txt"])
async def test_a_background_start_asks_the_gate_as_run_command_does(
    ws: Path, bwrap: str, command: str
) -> None:
    """background_command's start asks the gate for what run_command would."""
    gate = Gate()
    async with shell_dispatcher(ws, gate).session("s") as s:
        with anyio.fail_after(30):
            result = await s.invoke("background_command", {"command": command})
    assert gate.commands() == [command] and result.status is Status.denied


@pytest.mark.parametrize(
    "command",
    ["cat @a.txt", "cat -- -n", "cat a.txt~", "cat 'a  b'", "cat sub/../a.txt", "cat inner", "cat ./-"],
)
async def test_look_alike_arguments_that_are_auto_approved_read_only_the_workspace(
    ws: Path, bwrap: str, command: str
) -> None:
    """`@file`, `--`, `~` in a word, `..` and links inside run unasked, reading only the workspace."""
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert gate.asked == [] and result.status is Status.ok
    assert "OUTSIDE-SECRET" not in result.content and "root:x:0:0" not in result.content


# -- junk input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"command": 5}, "command"),
        ({"command": ["cat", "a.txt"]}, "command"),
        ({"command": None}, "command"),
        ({"command": ""}, "command"),
        ({}, "command"),
        ({"command": "ls", "cwd": 5}, "cwd"),
        ({"command": "ls", "cwd": "a\x00b"}, "NUL"),
        ({"command": "ls", "cwd": "/etc"}, "outside the workspace"),
        ({"command": "ls", "cwd": "../"}, "outside the workspace"),
        ({"command": "ls", "cwd": "a.txt"}, "not a folder"),
        ({"command": "ls", "timeout": math.nan}, "timeout"),
        ({"command": "ls", "timeout": math.inf}, "timeout"),
        ({"command": "ls", "timeout": 0}, "timeout"),
        ({"command": "ls", "timeout": "10"}, "timeout"),
        ({"command": "ls", "timeout": True}, "timeout"),
        ({"command": "ls", "shell": True}, "shell"),
    ],
)
async def test_junk_arguments_fail_naming_the_problem(
    ws: Path, bwrap: str, args: dict[str, Any], named: str
) -> None:
    """Junk arguments end in a failed result naming the bad field, never in a run."""
    result = await run_command(ws, args, gate=Gate(allow=True))
    assert result.status in (Status.invalid_arguments, Status.failed)
    assert named in result.content


async def test_a_nul_in_an_approved_command_fails_plainly(ws: Path, bwrap: str) -> None:
    """A NUL in a command the gate approved is a plain, non-retryable error naming the NUL."""
    result = await run_command(ws, {"command": "echo 'a\x00b'"}, gate=Gate(allow=True))
    assert result.status is Status.failed
    assert "NUL" in result.content or "null" in result.content
    assert '"retryable": false' in result.content, result.content


async def test_a_long_command_line_is_judged_in_linear_time(ws: Path, bwrap: str) -> None:
    """A 40,000-character command is refused to the gate at once, not after seconds of lexing."""
    command = "cat " + "a" * 40_000
    gate = Gate()
    start = time.monotonic()
    result = await run_command(ws, {"command": command}, gate=gate)
    elapsed = time.monotonic() - start
    assert result.status is Status.denied and len(gate.asked) == 1
    assert elapsed < 1.5, f"judging one 40 kB command line took {elapsed:.1f} s (the event loop was held)"
