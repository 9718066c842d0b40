"""run_command with real processes, and the read-only test that drives its flags."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import hypothesis
import hypothesis.strategies
import pytest
import sniffio

from builtin_tools import default_registry
from builtin_tools._workspace import Workspace
from builtin_tools.shell import ShellTools, is_read_only_command
from builtin_tools.shell import _split_pipeline as split_pipeline
from dispatcher import Allow, Deny, Dispatcher, Status, ToolCall
from dispatcher._exceptions import ToolError

from ._fakes import tool_context
from ._procs import alive, pids_with_argument
from ._system import require_program


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root.resolve()


# Unsandboxed: for the behaviour of processes themselves, seen from the host.
_BARE = {"sandbox": False}


async def _run(ws: Path, command: str, **extra: Any) -> str:
    tools = ShellTools(Workspace(ws), **extra.pop("options", {}))
    with anyio.fail_after(10):
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
    start = anyio.current_time()
    with pytest.raises(ToolError, match=r"timed out after 0\.5 s") as info:
        await _run(ws, "sleep 30 & echo $! > child.pid; echo partial; wait", timeout=0.5, options=_BARE)
    assert anyio.current_time() - start < 5
    assert "partial" in info.value.message
    child = int((ws / "child.pid").read_text())
    with anyio.fail_after(5):
        while alive(child):  # noqa: ASYNC110  # polling another process, no event to wait on
            await anyio.sleep(0.05)


async def test_a_sandboxed_command_past_its_timeout_leaves_nothing_running(ws: Path) -> None:
    """In the sandbox too, a command past its timeout is killed with all it started."""
    require_program("bwrap", package="bubblewrap")
    marker = "31.4159"
    with pytest.raises(ToolError, match=r"timed out after 0\.5 s") as info:
        await _run(ws, f"sleep {marker} & echo partial; wait", timeout=0.5)
    assert "partial" in info.value.message
    with anyio.fail_after(5):
        while pids_with_argument(marker):  # noqa: ASYNC110  # polling the process table
            await anyio.sleep(0.05)


async def test_run_command_output_is_bounded_head_and_tail(ws: Path) -> None:
    """Long output keeps its start and its end, and says how much was left out."""
    out = await _run(ws, "seq 1 100000", options={"max_output_bytes": 1000})
    assert "\n1\n2\n3\n" in out
    assert out.endswith("99999\n100000\nstderr: (empty)")
    assert "bytes omitted ...]" in out
    assert len(out) < 1500


async def test_run_command_does_not_wait_for_background_children(ws: Path) -> None:
    """Unsandboxed, a background child holding the output open does not keep the call
    waiting."""
    start = anyio.current_time()
    try:
        out = await _run(ws, "sleep 20 & echo $! > bg.pid; echo started", options=_BARE)
    finally:
        if (ws / "bg.pid").exists():
            _kill(int((ws / "bg.pid").read_text()))
    assert anyio.current_time() - start < 5
    assert "started" in out
    assert "stopped reading" in out


async def test_a_sandboxed_command_takes_its_background_children_with_it(ws: Path) -> None:
    """In the sandbox, what a command left running in the background ends when it exits."""
    require_program("bwrap", package="bubblewrap")
    marker = "27.1828"
    start = anyio.current_time()
    out = await _run(ws, f"sleep {marker} & echo started")
    assert anyio.current_time() - start < 5
    assert "started" in out
    with anyio.fail_after(5):
        while pids_with_argument(marker):  # noqa: ASYNC110  # polling the process table
            await anyio.sleep(0.05)


async def test_run_command_reports_a_shell_that_cannot_start(ws: Path) -> None:
    """A missing shell is a plain, non-retryable ToolError, not an exception group."""
    tools = ShellTools(Workspace(ws))
    tools.shell = str(ws / "no-such-shell")
    with anyio.fail_after(10), pytest.raises(ToolError, match="cannot start the command") as info:
        await tools.run_command({"command": "echo hi > out.txt"}, tool_context("run_command"))
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
        "rg 'a;b' src",
        "find . -name '*.py' -type f",
        "git status --short",
        "git log --oneline -5",
        "git diff HEAD~1",
        "echo 'quoted > not a redirect'",
        'echo "double quoted | not a pipe" a\'b\'"c"',
        "tail -n 20 log.txt",
        "pwd",
        "grep -n '#include' main.c",
        "git diff --output-indicator-new=+",
        "git log -- a.txt",
        "sort -n -k2,2 data.csv | cut -d, -f1|head",
        "echo ''",
        "grep -e '$HOME' -e '{a,b}' -e '*' a.txt",
    ],
)
def test_read_only_commands(command: str) -> None:
    """Allow-listed programs with harmless plain or literally quoted arguments are read-only."""
    assert is_read_only_command(command) is True


# Each line is a way to make bash run something other than what a reader of the words
# sees, to write, to run another program, or to read outside: none may run unconfirmed.
BYPASSES = [
    # the reported ones
    "find . -maxdepth 0 -ex${X}ec sh -c 'id > /tmp/p' {} +",
    "find . -de${X}lete",
    "find . $'-delete'",
    "find . {-delete,}",
    "git diff --out${X}put=/tmp/x",
    "find . -fls${X} /tmp/x",
    "find .. *",
    "cat ../outside.txt",
    "cat /etc/shadow",
    # quotes that bash removes: the program still sees the option
    "find . '-delete'",
    "find . \"-de\"'lete'",
    "find . -ex'ec' rm {} ';'",
    'git diff --out"put"=x',
    "git diff '--output=x'",
    "'sed' -i s/a/b/ a.txt",
    # parameter expansion, ANSI-C and locale quoting, IFS
    "cat ${HOME}/.ssh/id_rsa",
    "cat $HOME",
    "echo $'\\x41'",
    'echo $"x"',
    'echo "$X"',
    'echo "${X}"',
    "cat${IFS}a.txt",
    "IFS=, cat a.txt",
    "X=1 ls",
    # command substitution, arithmetic, process substitution
    "echo $(id)",
    'echo "$(id)"',
    "echo `id`",
    'echo "`id`"',
    "echo $((1+1))",
    "cat <(id)",
    # braces, globs, tilde
    "echo {a,b}",
    "find . -{delete,name} x",
    "ls *.py",
    "wc -l *.py",
    "ls ?",
    "ls [ab]",
    "ls a*",
    "cat ~/x",
    "ls ~",
    "cat ~root/.bashrc",
    "grep x --file=~/x",
    "grep x a:~/x",
    # escapes, history, comments
    "find . \\-delete",
    "find . -del\\ete",
    'echo "\\$x"',
    "echo !!",
    'echo "!x"',
    "ls # ; touch X",
    "ls a#; touch X",
    # operators, redirections, newlines
    "ls > listing.txt",
    "echo hi >> log.txt",
    "ls 2>&1",
    "cat < input",
    "ls; rm x",
    "ls && rm x",
    "ls || rm x",
    "ls & rm x",
    "ls |& cat",
    "ls |",
    "| ls",
    "(ls)",
    "ls\nrm x",
    "ls\rrm x",
    "echo 'a\nb'",
    "echo 'unclosed",
    "",
    "   ",
    # find's actions and link-following
    "find . -exec rm {} ;",
    "find . -execdir rm {} +",
    "find . -ok rm {} ;",
    "find . -okdir rm {} ;",
    "find . -delete",
    "find . -fprint x",
    "find . -fprint0 x",
    "find . -fprintf x %p",
    "find . -fls x",
    "find -L .",
    "find . -follow",
    # git: writing options with every abbreviation, programs, options before the subcommand
    *[
        f"git {sub} {option}"
        for sub in ("diff", "log", "show")
        for option in (
            "--out=x",
            "--outp=x",
            "--outpu=x",
            "--output=x",
            "--output x",
            "--outp x",
            "--o=x",
        )
    ],
    "git diff --ext-diff",
    "git diff --ext-d",
    "git show --textconv",
    "git show --textc",
    "git -c core.pager=sh status",
    "git -C .. status",
    "git --exec-path=. status",
    "git commit -m x",
    "git grep x",
    "git",
    # rg, grep, ls running programs or following links
    "rg --pre ./x pattern",
    "rg --pre=./x pattern",
    "rg --pre-glob '*' --pre ./x pattern",
    "rg --hostname-bin=./x pattern",
    "rg -L pattern",
    "rg --follow pattern",
    "grep -R x .",
    "grep -rR x .",
    "grep --dereference-recursive x .",
    "ls -L",
    "ls -laL",
    # sort writing files or running a compressor
    "sort -o x a.txt",
    "sort -no x a.txt",
    "sort --output=x a.txt",
    "sort --out x a.txt",
    "sort --compress-program=./x a.txt",
    "sort -T . a.txt",
    # programs that run other programs or write: never allow-listed
    "sed -i s/a/b/ a.txt",
    "sed --in-place s/a/b/ a.txt",
    "sed -n 1p a.txt",
    "sed 'w out' a.txt",
    "awk '{print}' a.txt",
    "awk 'BEGIN{system(\"id\")}'",
    "xargs rm",
    "ls | xargs rm",
    "env",
    "env rm x",
    "nice ls",
    "timeout 1 ls",
    "tee x",
    "ls | tee x",
    "python -c 'print(1)'",
    "rm -rf build",
    "./ls",
    "/bin/ls",
    "command ls",
    "exec ls",
    "grep -" + "x" * 300 + " a.txt",
    "cat a.txt\t| tee x",
    "cat 'a.txt\x00'",
    "cat \u00e9",
]


@pytest.mark.parametrize("command", BYPASSES)
def test_commands_that_are_not_read_only(command: str) -> None:
    """Anything that may expand, write, run another program or read outside is not
    read-only."""
    assert is_read_only_command(command) is False


@pytest.mark.parametrize("command", BYPASSES)
def test_every_bypass_needs_confirmation(ws: Path, command: str) -> None:
    """run_command asks the gate before any of the bypasses runs, with a sandbox or not."""
    for sandbox in (True, False):
        tools = ShellTools(Workspace(ws), sandbox=sandbox)
        assert tools.needs_confirmation({"command": command}) is True


@pytest.fixture
def outside_and_in(tmp_path: Path, ws: Path) -> Path:
    """A workspace with a.txt, sub/, a link inside, and links and a secret outside."""
    (tmp_path / "outside.txt").write_text("secret\n")
    (ws / "a.txt").write_text("a\n")
    (ws / "sub").mkdir()
    (ws / "sub" / "b.txt").write_text("b\n")
    (ws / "inner").symlink_to(ws / "a.txt")
    (ws / "leak").symlink_to(tmp_path / "outside.txt")
    (ws / "up").symlink_to(tmp_path)
    return ws


@pytest.mark.parametrize(
    ("command", "cwd"),
    [
        ("cat ../outside.txt", None),
        ("cat sub/../../outside.txt", None),
        ("cat ../../outside.txt", "sub"),
        ("cat leak", None),
        ("cat up/outside.txt", None),
        ("cat ../leak", "sub"),
        ("cat /etc/passwd", None),
        ("ls /", None),
        ("ls ..", None),
        ("grep -r secret ..", None),
        ("grep -f../outside.txt a.txt", None),
        ("grep -fleak a.txt", None),
        ("grep --file=../outside.txt a.txt", None),
        ("rg --ignore-file=/etc/passwd x", None),
        ("find .. -name outside.txt", None),
        ("find . -newer ../outside.txt", None),
        ("git diff --no-index /etc/hostname a.txt", None),
        ("cat a.txt | grep -f ../outside.txt", None),
        ("echo /", None),
    ],
)
def test_a_path_outside_the_workspace_needs_confirmation(
    outside_and_in: Path, command: str, cwd: str | None
) -> None:
    """A read-only command naming a path outside the workspace (after `..` and links,
    attached to an option or not) is not read-only."""
    tools = ShellTools(Workspace(outside_and_in), sandbox=False)
    here = outside_and_in / (cwd or ".")
    assert is_read_only_command(command, workspace="/", cwd=here) is True  # only the path
    assert is_read_only_command(command, workspace=outside_and_in, cwd=cwd) is False
    assert tools.needs_confirmation({"command": command, "cwd": cwd}) is True


@pytest.mark.parametrize(
    ("command", "cwd"),
    [
        ("cat a.txt", None),
        ("cat ./a.txt sub/b.txt", None),
        ("cat sub/../a.txt", None),
        ("cat ../a.txt", "sub"),
        ("cat inner", None),
        (f"cat {'{ws}'}/a.txt", None),
        ("grep -f a.txt a.txt", None),
        ("find . -name '*/b.txt'", None),
        ("ls", "sub"),
    ],
)
def test_paths_inside_the_workspace_stay_read_only(
    outside_and_in: Path, command: str, cwd: str | None
) -> None:
    """Paths that stay inside the workspace, even through `..`, a link or an absolute
    path, keep a command read-only."""
    command = command.replace("{ws}", str(outside_and_in))
    tools = ShellTools(Workspace(outside_and_in), sandbox=False)
    assert tools.needs_confirmation({"command": command, "cwd": cwd}) is False


async def test_a_read_only_command_runs_as_the_words_it_was_checked_as(ws: Path) -> None:
    """The checked argv is the argv that runs: quotes are joined as bash joins them, and
    nothing in a quoted word is expanded, by a shell or otherwise."""
    (ws / "a.txt").write_text("one\ntwo\nthree\n")
    (ws / "x.py").write_text("")
    tools = ShellTools(Workspace(ws), sandbox=False)
    command = "echo 'a  b' \"c | d\" e'f'\"g\" '$HOME' '*' '{x,y}' HEAD~1"
    assert tools.needs_confirmation({"command": command}) is False
    out = await _run(ws, command, options=_BARE)
    assert out.splitlines()[2] == "a  b c | d efg $HOME * {x,y} HEAD~1"
    piped = await _run(ws, "cat a.txt | grep -n t | tail -1", options=_BARE)
    assert piped.splitlines()[:3] == ["exit code: 0", "stdout:", "3:three"]
    found = await _run(ws, "find . -name '*.py'", options=_BARE)
    assert found.splitlines()[2] == "./x.py"


async def test_a_read_only_command_looks_programs_up_outside_the_workspace(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program the workspace offers on PATH is not the one an auto-approved command runs."""
    (ws / "bin").mkdir()
    fake = ws / "bin" / "ls"
    fake.write_text(f"#!/bin/sh\ntouch {ws}/ran\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ws / 'bin'}:.:{os.environ['PATH']}")
    out = await _run(ws, "ls", options=_BARE)
    assert "bin" in out and not (ws / "ran").exists()


@pytest.mark.parametrize(
    "command",
    [
        "find . -maxdepth 0 -ex${X}ec sh -c 'touch pwned' {} +",
        "find . -de${X}lete",
        "find . $'-delete'",
        "find . {-delete,}",
        "find . -fls${X} listing",
        "git diff --out${X}put=patch",
        "find . *",
    ],
)
async def test_a_refused_bypass_runs_nothing(ws: Path, command: str) -> None:
    """Through the dispatcher each reported bypass reaches the gate, and refused, it
    deletes and writes nothing (not even with a file named `-delete` for a glob)."""
    (ws / "keep.txt").write_text("k")
    (ws / "-delete").write_text("")
    asked: list[str] = []

    def gate(call: ToolCall, ctx: Any) -> Deny:
        asked.append(str(dict(call.arguments)["command"]))
        return Deny("no")

    dispatcher = Dispatcher(default_registry(ws, include=["run_command"]), gate=gate)
    with anyio.fail_after(10):
        result = await dispatcher.invoke("run_command", {"command": command})
    assert asked == [command]
    assert result.status is Status.denied
    assert sorted(os.listdir(ws)) == ["-delete", "keep.txt"]


async def test_a_command_that_cannot_run_fails_alone(ws: Path) -> None:
    """A refused command is that call's `failed` result; the calls beside it still run."""
    (ws / "a.txt").write_text("hello\n")
    session = Dispatcher(default_registry(ws, include=["run_command"], sandbox=False)).session(
        "s1", mode="direct"
    )
    session.load_tools(["run_command"])
    calls = [
        ToolCall(id="c1", name="run_command", arguments={"command": "cat a.txt", "cwd": ".."}),
        ToolCall(id="c2", name="run_command", arguments={"command": "cat a.txt"}),
        ToolCall(id="c3", name="run_command", arguments={"command": "cat a.txt", "cwd": "a.txt"}),
    ]
    with anyio.fail_after(10):
        results = await session.dispatch(calls)
    assert [r.status for r in results] == [Status.failed, Status.ok, Status.failed]
    assert "outside the workspace" in results[0].content
    assert "hello" in results[1].content


def test_run_command_flags_follow_the_read_only_test(ws: Path) -> None:
    """Read-only commands need no confirmation and write nothing; others are confirmed and
    write unknown files."""
    require_program("bwrap", package="bubblewrap")
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
    with anyio.fail_after(10):
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
@pytest.mark.parametrize("sandbox", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_read_only_git_runs_nothing_the_repository_config_names(
    ws: Path, tmp_path: Path, sandbox: bool
) -> None:
    """Unconfirmed git status/diff/log/show run none of the programs the repository's
    config names, sandboxed or not, and still show the change."""
    if sandbox:
        require_program("bwrap", package="bubblewrap")
    outside = tmp_path / "outside"
    _hostile_repository(ws, outside)
    commands = ["git status", "git status -v", "git diff", "git log -p", "git show", "git diff HEAD"]
    assert all(is_read_only_command(c) for c in commands)
    outputs = {c: await _run(ws, c, options={"sandbox": sandbox}) for c in commands}
    assert sorted(p.name for p in outside.iterdir()) == ["payload.sh"]
    assert "modified:   f.txt" in outputs["git status"]
    assert "-a\n+b" in outputs["git diff"] and "-a\n+b" in outputs["git diff HEAD"]
    assert "first" in outputs["git log -p"]
    # The same config does run its programs when git is run as written.
    with anyio.fail_after(10):
        await anyio.run_process(["git", "diff"], cwd=ws, check=False)
    assert any(p.name.startswith("ran-") for p in outside.iterdir())


@_needs_git
async def test_git_that_needed_confirmation_runs_as_written(ws: Path, tmp_path: Path) -> None:
    """A command the gate approved gets no forced git settings: the user chose to run it
    (unsandboxed here, so the program outside the workspace is there to run)."""
    outside = tmp_path / "outside"
    _hostile_repository(ws, outside)
    assert not is_read_only_command("git diff; true")
    await _run(ws, "git diff; true", options=_BARE)
    assert any(p.name.startswith("ran-") for p in outside.iterdir())


@_needs_git
async def test_read_only_git_ignores_a_folder_that_looks_like_a_bare_repository(ws: Path) -> None:
    """Plain files shaped like a bare repository are not taken for one (their config could
    name programs); git says so instead of running."""
    _git(ws, "init", "-q", "--bare", "plain")
    out = await _run(ws, "git log", cwd="plain")
    assert out.startswith("exit code: 128") and "cannot use bare repository" in out


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@_needs_git
async def test_read_only_git_does_not_look_above_the_workspace(tmp_path: Path) -> None:
    """A workspace inside a bigger repository: read-only git does not show that repository's
    files or history from outside the workspace."""
    _git(tmp_path, "init", "-q", ".")
    (tmp_path / "secret.txt").write_text("outside\n")
    _git(tmp_path, "add", "secret.txt")
    _git(tmp_path, "commit", "-q", "-m", "outside history")
    ws = tmp_path / "ws"
    ws.mkdir()
    out = await _run(ws, "git log", options=_BARE)
    assert "outside history" not in out and "not a git repository" in out


_PIECES = [
    "a", "b.txt", "-x", "--opt=v", "HEAD~1", "~", "=", ":", "a=", "a:", ".", "..", "/",
    "'q w'", '"d q"', "''", '""', "'$X'", '"$X"', "'*'", '"a\'b"', "'a\"b'", "$X", "${X}",
    "$'x'", '$"x"', "{a,b}", "*", "?", "[a]", "\\", "\\n", "#", "!", "!!", "%", "^", "@", "+",
    ",", " ", " ", "\t", ";", "&", ">", "<", "(", ")", "`x`",
]  # fmt: skip


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
# Most generated lines are refused and filtered out, and each kept one starts bash: on a
# loaded machine hypothesis's speed and filtering health checks would fail the test,
# though no line broke the property.
@hypothesis.settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.filter_too_much],
)
@hypothesis.given(hypothesis.strategies.lists(hypothesis.strategies.sampled_from(_PIECES), max_size=8))
def test_the_lexer_reads_every_line_it_accepts_as_bash_does(pieces: list[str]) -> None:
    """Every line the strict lexer accepts means to bash exactly the words the lexer read:
    bash would expand nothing in it."""
    line = "".join(pieces)
    segments = split_pipeline(line)
    hypothesis.assume(segments is not None and len(segments) == 1)
    assert segments is not None
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", "printf '%s\\0' " + line],
        capture_output=True, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        check=True, timeout=10,
    )  # fmt: skip
    words = done.stdout.decode().split("\0")[:-1]
    assert words == segments[0]


def _repository_shaped(folder: Path) -> Path:
    """A folder laid out like a .git folder (enough for the check; git need not run)."""
    (folder / "objects" / "info").mkdir(parents=True)
    (folder / "HEAD").write_text("ref: refs/heads/main\n")
    return folder


@pytest.mark.parametrize("layout", ["gitdir-outside", "link-outside", "commondir-outside", "alternates"])
def test_read_only_git_needs_confirmation_when_the_repository_lies_outside(
    ws: Path, tmp_path: Path, layout: str
) -> None:
    """git reads whatever repository a `.git` file, link, commondir or alternates names:
    one outside the workspace makes read-only git need confirmation."""
    outside = _repository_shaped(tmp_path / "elsewhere.git")
    if layout == "gitdir-outside":
        (ws / ".git").write_text(f"gitdir: {outside}\n")
    elif layout == "link-outside":
        (ws / ".git").symlink_to(outside)
    elif layout == "commondir-outside":
        inner = _repository_shaped(ws / ".git")
        (inner / "commondir").write_text(f"{outside}\n")
    else:
        inner = _repository_shaped(ws / ".git")
        (inner / "objects" / "info" / "alternates").write_text(f"{outside}/objects\n")
    (ws / "sub").mkdir()
    tools = ShellTools(Workspace(ws), sandbox=False)
    assert tools.needs_confirmation({"command": "git log", "cwd": "sub"}) is True
    assert tools.needs_confirmation({"command": "git status"}) is True
    assert tools.needs_confirmation({"command": "cat a.txt"}) is False


def test_read_only_git_in_a_submodule_inside_stays_read_only(ws: Path) -> None:
    """A `.git` file pointing inside the workspace (a submodule's) keeps git read-only."""
    _repository_shaped(ws / ".git")
    modules = _repository_shaped(ws / ".git" / "modules" / "lib")
    (ws / "lib").mkdir()
    (ws / "lib" / ".git").write_text("gitdir: ../.git/modules/lib\n")
    tools = ShellTools(Workspace(ws), sandbox=False)
    assert modules.is_dir()
    assert tools.needs_confirmation({"command": "git status", "cwd": "lib"}) is False
    assert tools.needs_confirmation({"command": "git log"}) is False


async def test_a_sandboxed_command_outlives_the_idle_timeout_of_worker_threads(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bwrap dies with the thread that started it: a sandboxed run_command longer than the
    worker threads' idle timeout still runs to its end (it is started on the loop's thread)."""
    require_program("bwrap", package="bubblewrap")
    if sniffio.current_async_library() == "trio":
        from trio._core import _thread_cache

        monkeypatch.setattr(_thread_cache, "IDLE_TIMEOUT", 0.05)
    await anyio.to_thread.run_sync(lambda: None)  # a worker thread, idle from now on
    out = await _run(ws, "sleep 1; echo survived", options={})
    assert "survived" in out and "signal" not in out
