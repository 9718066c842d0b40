"""Attacks on run_command's gate, second round: what still runs unasked after the first
round's fixes (tests/test_attack_shell_gate.py). Each goes through the real dispatcher, a
gate that records whether it was asked (and refuses), and the real bwrap."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from dispatcher import Status

from ._shell_gate import Gate, git_in, payload, run_command, shell_dispatcher
from ._system import require_program

_MARK = "PAYLOAD-RAN-2b9e"  # what a program run by a hostile config prints to stderr


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
    """A workspace with a.txt and sub/b.txt, beside a secret; links to outside named like options."""
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "outside.txt").write_text("OUTSIDE-SECRET\n")
    (root / "a.txt").write_text("a\n")
    (root / "sub").mkdir()
    (root / "sub" / "b.txt").write_text("b\n")
    # Links a checked-out repository may hold, named as a word the checker takes for an option.
    (root / "-leak").symlink_to(tmp_path / "outside.txt")
    (root / "--leak").symlink_to(tmp_path / "outside.txt")
    (root / "-etc").symlink_to("/etc")
    (root / "-passwd").symlink_to("/etc/passwd")
    (root / "-up").symlink_to(tmp_path)
    return root.resolve()


def _git_out(cwd: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, timeout=30, input=stdin, text=True
    )
    return done.stdout.strip()


# -- (a) a link named like an option: the checker reads the word as an option, the program as a path


LEAKS_OUTSIDE = [
    "cat -- -passwd",
    "cat -- -etc",
    "tail -n 5 -- -passwd",
    "head -- -passwd",
    "grep root -- -passwd",
    "grep -r root:x -- -etc",
    "grep -f -passwd -- -passwd",
    "grep --file -passwd -- -passwd",
    "sort -- -passwd",
    "cut -c1- -- -passwd",
    "wc -l -- -passwd",
    "ls -- -etc",
    "git diff --no-index -- a.txt -passwd",
]


@pytest.mark.parametrize("command", LEAKS_OUTSIDE)
async def test_a_link_named_like_an_option_to_outside_is_never_auto_approved(
    ws: Path, bwrap: str, command: str
) -> None:
    """A path operand naming a link out of the workspace (here `-passwd` -> /etc/passwd) asks the gate."""
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert "root:x:0:0" not in result.content and "hostname" not in result.content
    assert gate.commands() == [command], result.content


@pytest.mark.parametrize("command", ["cat -- -leak", "cat -- --leak", "grep -r SECRET -- -up"])
async def test_unsandboxed_a_link_named_like_an_option_reads_nothing_outside(ws: Path, command: str) -> None:
    """With sandbox=False (the classifier alone decides), `-leak` -> ../outside.txt asks the gate."""
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate, sandbox=False)
    assert "OUTSIDE-SECRET" not in result.content
    assert gate.commands() == [command], result.content


@pytest.mark.parametrize(
    "command",
    ["cat -- -a", "cat ./-leak", "grep -f ./-leak a.txt", "grep --file=-leak a.txt", "cat -- -a-missing"],
)
async def test_option_like_names_inside_run_or_ask_as_their_target_says(
    ws: Path, bwrap: str, command: str
) -> None:
    """A dash-named file inside runs unasked; `./-leak` and `--file=-leak` (links out) ask the gate."""
    (ws / "-a").write_text("inside-dash\n")
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert "OUTSIDE-SECRET" not in result.content
    if "leak" in command:
        assert gate.commands() == [command], result.content
    else:
        assert gate.asked == [], result.content


# -- (d) git looks into a submodule that `.gitmodules` (a plain workspace file) un-ignores --------


@pytest.fixture
def unignored_submodule(ws: Path, git: str) -> Path:
    """A repository with a submodule `lib` whose own config names a clean filter and whose
    file is modified, and a `.gitmodules` (any file tool may write it) saying `ignore = none`."""
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
    script = payload(ws, _MARK)  # inside: the sandbox shows nothing else of the host's
    git_in(lib, "config", "filter.evil.clean", str(script))
    (lib / "f.txt").write_text("b\n")
    (ws / ".gitmodules").write_text('[submodule "lib"]\n\tpath = lib\n\turl = ./lib\n\tignore = none\n')
    return ws


@pytest.mark.parametrize("command", ["git status", "git diff", "git diff HEAD", "git status --short"])
async def test_gitmodules_ignore_none_makes_read_only_git_run_no_submodule_program(
    unignored_submodule: Path, bwrap: str, command: str
) -> None:
    """Auto-approved git runs no filter a submodule's config names, whatever `.gitmodules` says."""
    gate = Gate()
    result = await run_command(unignored_submodule, {"command": command}, gate=gate)
    assert _MARK not in result.content, result.content


async def test_unsandboxed_gitmodules_ignore_none_writes_nothing_outside(
    unignored_submodule: Path, tmp_path: Path
) -> None:
    """With sandbox=False, auto-approved `git status` runs no submodule filter that writes outside."""
    outside = tmp_path / "outside-marker"
    payload(unignored_submodule, _MARK, f"touch {outside}\ncat")
    gate = Gate()
    result = await run_command(unignored_submodule, {"command": "git status"}, gate=gate, sandbox=False)
    assert not outside.exists(), result.content


# -- git: what held --------------------------------------------------------------------------


@pytest.fixture
def repo(ws: Path, git: str) -> Path:
    """A repository with one commit of a.txt (whose attributes name diff and filter drivers)
    and a modified, staged a.txt."""
    git_in(ws, "init", "-q", ".")
    (ws / ".gitattributes").write_text("*.txt diff=evil filter=evil\n")
    git_in(ws, "add", "a.txt", ".gitattributes")
    git_in(ws, "commit", "-q", "-m", "first")
    (ws / "a.txt").write_text("changed\n")
    git_in(ws, "add", "a.txt")
    # a commit carrying a signature, which --show-signature and %G? have git verify
    for kind in ("PGP", "SSH"):
        tree = _git_out(ws, "write-tree")
        head = _git_out(ws, "rev-parse", "HEAD")
        body = (
            f"tree {tree}\nparent {head}\nauthor t <t@example.org> 0 +0000\n"
            f"committer t <t@example.org> 0 +0000\ngpgsig -----BEGIN {kind} SIGNATURE-----\n \n"
            f" AAAA\n -----END {kind} SIGNATURE-----\n\nsigned\n"
        )
        signed = _git_out(ws, "hash-object", "-t", "commit", "-w", "--stdin", stdin=body)
        git_in(ws, "update-ref", "HEAD", signed)
    return ws


@pytest.mark.parametrize(
    ("settings", "command"),
    [
        ({"diff.external": "PAYLOAD"}, "git status -v"),
        ({"diff.external": "PAYLOAD"}, "git status -vv"),
        ({"diff.evil.textconv": "PAYLOAD"}, "git status -v"),
        ({"diff.evil.command": "PAYLOAD"}, "git log -p"),
        ({"gpg.openpgp.program": "PAYLOAD"}, "git log --show-signature"),
        ({"gpg.openpgp.program": "PAYLOAD"}, "git log '--format=%G?'"),
        ({"gpg.ssh.allowedSignersFile": "a.txt", "gpg.ssh.program": "PAYLOAD"}, "git show --show-signature"),
        ({"pager.log": "PAYLOAD", "pager.status": "PAYLOAD"}, "git log"),
        ({"core.fsmonitor": "PAYLOAD"}, "git status"),
        ({"core.hooksPath": "hooks"}, "git status"),
        ({"filter.evil.process": "PAYLOAD"}, "git status"),
        ({"log.showSignature": "true", "gpg.program": "PAYLOAD"}, "git log"),
        ({"diff.external": "PAYLOAD"}, "git diff --no-index a.txt sub/b.txt"),
    ],
)
async def test_read_only_git_runs_no_program_its_config_names(
    repo: Path, bwrap: str, settings: dict[str, str], command: str
) -> None:
    """Auto-approved git status/log/diff/show runs no program the repository's config names."""
    script = payload(repo, _MARK)  # inside: the sandbox shows nothing else of the host's
    (repo / "hooks").mkdir()
    for hook in ("post-index-change", "reference-transaction", "fsmonitor-watchman"):
        (repo / "hooks" / hook).symlink_to(script)
    for key, value in settings.items():
        git_in(
            repo,
            "config",
            key,
            str(script) if value == "PAYLOAD" else str(repo / value) if value == "a.txt" else value,
        )
    (repo / "a.txt").write_text("changed again\n")
    gate = Gate()
    result = await run_command(repo, {"command": command}, gate=gate)
    assert gate.asked == [], result.content
    assert _MARK not in result.content, result.content


@pytest.mark.parametrize(
    "command",
    [
        "git log --ext",
        "git diff --ext-d",
        "git show --textconv",
        "git log --outp=x",
        "git diff --submod=diff",
        "git status --ignore-sub=none",
        "git diff --ignore-submodules=none",
        "git -P log",
        "git --no-pager log",
        "git -c core.pager=cat log",
        "find . -fprint0 x",
        "find . -fprintf x %p",
        "find . -okdir id ;",
        "find . -files0-from names",
        "sort --compress-program=gzip a.txt",
        "sort --temporary-directory=. a.txt",
        "sort -T. a.txt",
        "du --files0=names",
        "wc --files0-f=names",
        "grep --dereference-r x .",
        "ls --dereference a.txt",
        "du -L .",
        "find . -follow",
    ],
)
async def test_writing_and_program_running_options_ask_the_gate(ws: Path, bwrap: str, command: str) -> None:
    """Writing, program-running and link-following options (abbreviated too) ask the gate."""
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert gate.commands() == [command] and result.status is Status.denied


@pytest.mark.parametrize(
    "command",
    [
        "git show HEAD:../outside.txt",
        "git log --follow -- :(top)a.txt",
        "git log -- :/a.txt",
        "git show :/first",
        "git diff --no-index a.txt sub",
        "git status --porcelain --untracked-files=all",
        "git log --format=%an%x00%(describe)",
        "find . -newermt 2020-01-01 -printf %p%l%Y",
        "find . -regex .*a.*",
        "stat --printf=%n%N -- a.txt",
        "ls --hyperlink=always -R",
        "sort --parallel=2 --batch-size=2 a.txt sub/b.txt",
        "du --exclude-from=a.txt .",
        "grep --exclude-from=a.txt -r a .",
        "tail --pid=1 -n1 a.txt",
        "cut -d, -f1 a.txt",
        "tr a-z A-Z",
        "echo a=b % ^ @ , + : HEAD:../x",
    ],
)
async def test_auto_approved_lines_read_only_the_workspace(
    ws: Path, bwrap: str, git: str, command: str
) -> None:
    """Pathspec magic, `<rev>:../x`, -printf escapes and other plain options read only the workspace."""
    git_in(ws, "init", "-q", ".")
    git_in(ws, "add", "a.txt", "sub")
    git_in(ws, "commit", "-q", "-m", "first")
    (ws / "sub" / "in-link").symlink_to(ws.parent / "outside.txt")
    gate = Gate()
    result = await run_command(ws, {"command": command}, gate=gate)
    assert "OUTSIDE-SECRET" not in result.content and "root:x:0:0" not in result.content


# -- background_command ------------------------------------------------------------------------


async def test_a_background_start_of_an_option_named_link_asks_the_gate(ws: Path, bwrap: str) -> None:
    """background_command's start of `tail -f -- -passwd` asks the gate, as run_command should."""
    gate = Gate()
    command = "tail -n 3 -f -- -passwd"
    async with shell_dispatcher(ws, gate).session("s") as s:
        with anyio.fail_after(30):
            result = await s.invoke("background_command", {"command": command})
            if result.status is Status.ok:
                await anyio.sleep(1)
                result = await s.invoke("background_command", {"action": "output", "id": "bg1"})
    assert "root:x:0:0" not in result.content
    assert gate.commands() == [command], result.content


@pytest.mark.parametrize("job_id", ["bg1", "../bg1", "bg1.out", "", "BG1", None, 1, ["bg1"]])
async def test_another_sessions_background_output_is_never_read(ws: Path, bwrap: str, job_id: Any) -> None:
    """action="output" with another session's id, or junk, fails naming no output of it."""
    gate = Gate()
    dispatcher = shell_dispatcher(ws, gate)
    async with dispatcher.session("one") as one, dispatcher.session("two") as two:
        with anyio.fail_after(30):
            started = await one.invoke("background_command", {"command": "cat a.txt sub/b.txt"})
            assert started.status is Status.ok, started.content
            await anyio.sleep(0.5)
            args: dict[str, Any] = {"action": "output"}
            if job_id is not None:
                args["id"] = job_id
            result = await two.invoke("background_command", args)
    assert result.status in (Status.failed, Status.invalid_arguments), result.content
    assert "b\n" not in result.content


def _output_folders() -> list[Path]:
    """The background output folders whose bg1.out holds the mark."""
    return [
        p.parent
        for p in Path(tempfile.gettempdir()).glob("threepass-background-*/bg1.out")
        if _MARK in p.read_text(errors="replace")
    ]


async def test_a_background_output_folder_is_private(ws: Path, bwrap: str) -> None:
    """Background output lives in a 0700 folder, its file 0600, and goes with the session."""
    (ws / "a.txt").write_text(f"{_MARK}-{os.getpid()}\n")
    gate = Gate()
    async with shell_dispatcher(ws, gate).session("s") as s:
        with anyio.fail_after(30):
            result = await s.invoke("background_command", {"command": "tail -f a.txt"})
            assert result.status is Status.ok and gate.asked == [], result.content
            await anyio.sleep(1)
            folders = await anyio.to_thread.run_sync(_output_folders)
            assert len(folders) == 1, folders
            modes = {(p.stat().st_mode & 0o777, (p / "bg1.out").stat().st_mode & 0o777) for p in folders}
            assert modes == {(0o700, 0o600)}
    assert not any(p.exists() for p in folders)
