"""The shell tool, `run_command`, and `is_read_only_command`, the conservative test that
decides whether a command needs confirmation and whether it may have written files.

A command runs through the shell in its own process group, with the workspace (or a
folder inside it) as its working directory, stdin closed and its output bounded
(head and tail kept). Its own timeout kills the whole group. Nothing from the
dispatcher's passes may be imported here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

import trio

from dispatcher._exceptions import ToolError
from dispatcher._registry import Tool
from dispatcher._types import ToolContext

from ._workspace import Workspace

__all__ = ["ShellTools", "is_read_only_command", "shell_tools"]

DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 600.0
_PIPE_GRACE = 0.5  # how long to keep reading after the shell exits, for buffered output

# Each allowed program, with the arguments that would make it write or run something.
_READ_ONLY_PROGRAMS: dict[str, frozenset[str]] = {
    "ls": frozenset(),
    "cat": frozenset(),
    "head": frozenset(),
    "tail": frozenset(),
    "wc": frozenset(),
    "grep": frozenset(),
    "pwd": frozenset(),
    "echo": frozenset(),
    # --pre runs a preprocessor program on every file searched.
    "rg": frozenset({"--pre", "--pre-glob"}),
    "find": frozenset(
        {"-delete", "-exec", "-execdir", "-ok", "-okdir", "-fprint", "-fprint0", "-fprintf", "-fls"}
    ),
}
_READ_ONLY_GIT = frozenset({"status", "log", "diff", "show"})
# git diff/log/show --output=<file> writes; --ext-diff and --textconv run configured programs.
# git also takes any unambiguous prefix of a long option (`--outp=x` is `--output=x`).
_GIT_WRITING_OPTIONS = frozenset({"--output", "--ext-diff", "--textconv"})

# A git command that runs without confirmation must not run programs named in the
# repository's own config (.git/config, which a command or a download could have written
# before): core.fsmonitor runs on `git status`, filter drivers whenever git hashes a
# changed file, diff.external and textconv drivers on `git diff/log/show`, gpg on a
# signature check. Refusing such commands would leave no read-only way to look at a
# repository, and reading the config ourselves to decide would still leave git reading it
# again, differently, when it runs. So these commands run with safe settings forced:
# - these values, passed as GIT_CONFIG_COUNT/KEY/VALUE, which git ranks like `-c`,
#   above every config file;
# - every `filter.<driver>.*` and `diff.<driver>.*` program named in the config of the
#   folder the command runs in, emptied the same way (a driver's name is arbitrary, so
#   they are read from `git config --list` first; that command runs none of them);
# - `--no-ext-diff --no-textconv` after diff/log/show, through a shell function named
#   git: `diff.external` has no value that turns it off.
# safe.bareRepository=explicit stops git from taking a folder of plain files that looks
# like a bare repository (HEAD, config, objects/, refs/) for one. The file tools refuse
# to write inside `.git` folders (`Workspace.check_writable`), so planting config there
# needs a command the gate sees. Commands that needed confirmation run as written.
_SAFE_GIT_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.pager", "cat"),
    ("safe.bareRepository", "explicit"),
    ("log.showSignature", "false"),
    ("gpg.program", "false"),
    ("gpg.ssh.program", "false"),
    ("gpg.x509.program", "false"),
)
# The config keys (as `git config --list` spells them) whose value is a program to run.
_GIT_DRIVER_PROGRAM = re.compile(
    r"(filter|diff|merge)\..+\.(clean|smudge|process|textconv|command|driver)"
)
_SAFE_GIT_FUNCTION = (
    'git() { case "$1" in status) command git "$@" ;; '
    '*) __tp_sub=$1; shift; command git "$__tp_sub" --no-ext-diff --no-textconv "$@" ;; esac; }'
)
_GIT_CONFIG_TIMEOUT = 10.0
# Expansions that run a command even inside double quotes; newlines separate commands.
_RAW_FORBIDDEN = ("`", "$(", "\n", "\r", "<(", ">(")


def is_read_only_command(command: object) -> bool:
    """True only for a command that surely writes nothing.

    A pipeline (`|`) of allow-listed programs (ls, cat, head, tail, wc, grep, rg, find,
    pwd, echo, git status/log/diff/show) with no option that writes or runs another
    program. Any other shell operator (`>`, `>>`, `;`, `&`, `&&`, `||`, `<`, `(`, `)`),
    command substitution (`$(...)`, backticks), an environment assignment or a newline
    makes it not read-only. When in doubt: False.
    """
    segments = _read_only_segments(command)
    return segments is not None


def _runs_git(command: str) -> bool:
    """Whether `command` is read-only (so runs without confirmation) and runs git."""
    segments = _read_only_segments(command)
    return segments is not None and any(words[0] == "git" for words in segments)


def _read_only_segments(command: object) -> list[list[str]] | None:
    """The words of each command of a read-only pipeline; None if it is not read-only."""
    if not isinstance(command, str) or not command.strip():
        return None
    if any(bad in command for bad in _RAW_FORBIDDEN):
        return None
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    # shlex starts a comment at any `#`, the shell only at the start of a word: with
    # shlex's rule `ls a#; rm x` would hide `; rm x`. Reading `#` as a plain character
    # instead only ever shows more of the line than the shell runs, never less.
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote
        return None
    segments: list[list[str]] = [[]]
    for token in tokens:
        if token == "|":
            segments.append([])
        elif token and all(ch in "();<>|&" for ch in token):
            return None  # any other operator
        else:
            segments[-1].append(token)
    if not all(_segment_is_read_only(words) for words in segments):
        return None
    return segments


def _segment_is_read_only(words: list[str]) -> bool:
    if not words:
        return False  # `| x`, `x |`
    program, rest = words[0], words[1:]
    if program == "git":
        if not rest or rest[0] not in _READ_ONLY_GIT:
            return False  # includes options before the subcommand (-c, -C, --exec-path)
        return not any(_is_git_writing_option(w) for w in rest[1:])
    forbidden = _READ_ONLY_PROGRAMS.get(program)
    if forbidden is None:
        return False
    return not any(_option_name(w) in forbidden for w in rest)


def _is_git_writing_option(word: str) -> bool:
    name = _option_name(word)
    if not name.startswith("--") or len(name) < 3:
        return False
    return any(option.startswith(name) for option in _GIT_WRITING_OPTIONS)


def _option_name(word: str) -> str:
    return word.split("=", 1)[0] if word.startswith("--") else word


def shell_tools(workspace: Workspace) -> list[Tool]:
    """The shell tool bound to `workspace`."""
    return ShellTools(workspace).tools()


class ShellTools:
    """`run_command` bound to one workspace. `max_output_bytes` bounds each of stdout and
    stderr (half kept from the start, half from the end)."""

    def __init__(self, workspace: Workspace, *, max_output_bytes: int = 32 * 1024) -> None:
        self.ws = workspace
        self.max_output_bytes = max_output_bytes
        # bash when there is one: models write bash; /bin/sh otherwise.
        self.shell = shutil.which("bash") or "/bin/sh"

    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="run_command",
                description=(
                    "Run a shell command in the workspace (or `cwd` inside it) and return its "
                    "exit code, stdout and stderr. stdin is closed; the command is killed "
                    f"after `timeout` seconds (default {DEFAULT_TIMEOUT:g}, at most "
                    f"{MAX_TIMEOUT:g}). Commands that may change anything need confirmation."
                ),
                handler=self.run_command,
                parameters=_RUN_COMMAND_SCHEMA,
                confirm=_needs_confirmation,
                # Past our own kill timeout, so the command's own limit is the one that acts.
                timeout=MAX_TIMEOUT + 30,
                # A read-only command still reads files: any file write invalidates it.
                reads=_reads_any_file,
                writes=_command_writes,
            )
        ]

    async def run_command(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        command: str = args["command"]
        cwd = self.ws.resolve(args.get("cwd") or ".")
        if not cwd.is_dir():
            raise ToolError(f"cwd {args.get('cwd')!r} is not a folder", retryable=False)
        timeout = float(args.get("timeout") or DEFAULT_TIMEOUT)
        if not 0 < timeout <= MAX_TIMEOUT:
            raise ToolError(
                f"timeout must be in (0, {MAX_TIMEOUT:g}] seconds, got {timeout!r}", retryable=False
            )
        stdout = _HeadTail(self.max_output_bytes)
        stderr = _HeadTail(self.max_output_bytes)
        exit_code: int | None = None
        abandoned = False
        env = dict(os.environ)
        env["GIT_OPTIONAL_LOCKS"] = "0"  # a read-only `git status` then leaves .git alone
        env["GIT_TERMINAL_PROMPT"] = "0"
        env.setdefault("PAGER", "cat")
        script = command
        with trio.move_on_after(timeout) as deadline:
            if _runs_git(command):  # runs without confirmation: see _SAFE_GIT_CONFIG
                env = await _safe_git_env(env, cwd)
                script = _SAFE_GIT_FUNCTION + "\n" + command
            exit_code, abandoned = await self._run(script, cwd, env, stdout, stderr)
        if deadline.cancelled_caught:
            raise ToolError(
                f"command timed out after {timeout:g} s and was killed\n"
                + _render(None, stdout, stderr, abandoned=False),
            )
        return _render(exit_code, stdout, stderr, abandoned=abandoned)

    async def _run(
        self,
        command: str,
        cwd: os.PathLike[str],
        env: Mapping[str, str],
        stdout: _HeadTail,
        stderr: _HeadTail,
    ) -> tuple[int | None, bool]:
        """Run `command` to its exit; return (exit code, whether output was abandoned)."""
        exited = trio.Event()
        readers_done = trio.Event()
        options: dict[str, Any] = {}
        if os.name == "posix":
            options = {"start_new_session": True, "deliver_cancel": _kill_process_group}

        async def run_and_mark(*, task_status: trio.TaskStatus[trio.Process]) -> None:
            try:
                await trio.run_process(
                    command,
                    shell=True,
                    executable=self.shell,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    check=False,
                    task_status=task_status,
                    **options,
                )
            finally:
                exited.set()

        async def read_both(process: trio.Process) -> None:
            assert process.stdout is not None and process.stderr is not None
            async with trio.open_nursery() as readers:
                readers.start_soon(_drain, process.stdout, stdout)
                readers.start_soon(_drain, process.stderr, stderr)
            readers_done.set()

        abandoned = False
        try:
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(run_and_mark)
                nursery.start_soon(read_both, process)
                await exited.wait()
                with trio.move_on_after(_PIPE_GRACE):
                    await readers_done.wait()
                if not readers_done.is_set():
                    # A background child still holds the pipes open: stop reading.
                    abandoned = True
                    nursery.cancel_scope.cancel()
        except ExceptionGroup as group:
            # The nursery wraps a failure to start (no shell, cwd gone) in a group.
            failed, rest = group.split(OSError)
            if failed is None or rest is not None:
                raise
            cause = _first_leaf(failed)
            raise ToolError(
                f"cannot start the command with {self.shell!r}: {cause}", retryable=False
            ) from cause
        return process.returncode, abandoned


async def _safe_git_env(env: Mapping[str, str], cwd: os.PathLike[str]) -> dict[str, str]:
    """`env` with git's program-running settings overridden (see _SAFE_GIT_CONFIG), for
    the repository `cwd` is in."""
    overrides = list(_SAFE_GIT_CONFIG)
    safe = _with_git_config(env, overrides)
    try:
        with trio.fail_after(_GIT_CONFIG_TIMEOUT):
            listing = await trio.run_process(
                ["git", "config", "-z", "--name-only", "--list"],
                cwd=cwd,
                env=safe,
                stdin=subprocess.DEVNULL,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    except FileNotFoundError:
        return safe  # no git: the command fails on its own, and runs nothing from a config
    except trio.TooSlowError:
        raise ToolError("reading the git configuration timed out", retryable=True) from None
    if listing.returncode != 0:
        reason = listing.stderr.decode("utf-8", errors="replace").strip()
        raise ToolError(f"cannot read the git configuration here: {reason}", retryable=False)
    names = listing.stdout.decode("utf-8", errors="replace").split("\0")
    programs = sorted({name for name in names if _GIT_DRIVER_PROGRAM.fullmatch(name)})
    overrides += [(name, "") for name in programs]
    # A filter marked required fails the command when it cannot run: let it pass instead.
    drivers = {name.rsplit(".", 1)[0] for name in programs if name.startswith("filter.")}
    overrides += [(f"{driver}.required", "false") for driver in sorted(drivers)]
    return _with_git_config(env, overrides)


def _with_git_config(env: Mapping[str, str], settings: list[tuple[str, str]]) -> dict[str, str]:
    out = dict(env)
    try:
        start = int(out.get("GIT_CONFIG_COUNT") or 0)
    except ValueError:
        start = 0  # git would refuse the malformed count: replace it
    for offset, (key, value) in enumerate(settings):
        out[f"GIT_CONFIG_KEY_{start + offset}"] = key
        out[f"GIT_CONFIG_VALUE_{start + offset}"] = value
    out["GIT_CONFIG_COUNT"] = str(start + len(settings))
    return out


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


async def _kill_process_group(process: trio.Process) -> None:
    """Kill the command and everything it started (it leads its own process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


async def _drain(stream: trio.abc.ReceiveStream, sink: _HeadTail) -> None:
    async with stream:
        while chunk := await stream.receive_some(65536):
            sink.add(chunk)


class _HeadTail:
    """Keeps the first and last `limit // 2` bytes of a stream, and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes | bytearray) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        omitted = self.total - len(self.head) - len(self.tail)
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if omitted <= 0:
            return head + tail
        return f"{head}\n[... {omitted} bytes omitted ...]\n{tail}"


def _render(exit_code: int | None, stdout: _HeadTail, stderr: _HeadTail, *, abandoned: bool) -> str:
    lines = [f"exit code: {exit_code}" if exit_code is not None else "exit code: (killed)"]
    if exit_code is not None and exit_code < 0:
        lines[0] += f" (killed by signal {-exit_code})"
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        body = stream.text()
        lines.append(f"{name}:" if body else f"{name}: (empty)")
        if body:
            lines.append(body.rstrip("\n"))
    if abandoned:
        lines.append("[a background process kept the output open; stopped reading it]")
    return "\n".join(lines)


def _needs_confirmation(args: Mapping[str, Any]) -> bool:
    return not is_read_only_command(args.get("command"))


def _command_writes(args: Mapping[str, Any]) -> set[str]:
    # Unknown effects on every file, unless the command is surely read-only.
    return set() if is_read_only_command(args.get("command")) else {"file:/"}


def _reads_any_file(args: Mapping[str, Any]) -> set[str]:
    return {"file:/"}


_RUN_COMMAND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "minLength": 1, "description": "The shell command line."},
        "cwd": {
            "type": "string",
            "description": "Working folder, relative to the workspace. Default: the workspace.",
        },
        "timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": MAX_TIMEOUT,
            "description": f"Seconds before the command is killed. Default {DEFAULT_TIMEOUT:g}.",
        },
    },
    "required": ["command"],
    "additionalProperties": False,
}
