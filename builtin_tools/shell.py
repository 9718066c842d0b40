"""The shell tool, `run_command`, and `is_read_only_command`, the conservative test that
decides whether a command needs confirmation and whether it may have written files.

A command runs through the shell in its own process group, with the workspace (or a
folder inside it) as its working directory, stdin closed and its output bounded
(head and tail kept). Its own timeout kills the whole group. Nothing from the
dispatcher's passes may be imported here.
"""

from __future__ import annotations

import os
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
_GIT_WRITING_OPTIONS = frozenset({"--output", "--ext-diff", "--textconv"})
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
    if not isinstance(command, str) or not command.strip():
        return False
    if any(bad in command for bad in _RAW_FORBIDDEN):
        return False
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    # shlex starts a comment at any `#`, the shell only at the start of a word: with
    # shlex's rule `ls a#; rm x` would hide `; rm x`. Reading `#` as a plain character
    # instead only ever shows more of the line than the shell runs, never less.
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote
        return False
    segments: list[list[str]] = [[]]
    for token in tokens:
        if token == "|":
            segments.append([])
        elif token and all(ch in "();<>|&" for ch in token):
            return False  # any other operator
        else:
            segments[-1].append(token)
    return all(_segment_is_read_only(words) for words in segments)


def _segment_is_read_only(words: list[str]) -> bool:
    if not words:
        return False  # `| x`, `x |`
    program, rest = words[0], words[1:]
    if program == "git":
        if not rest or rest[0] not in _READ_ONLY_GIT:
            return False  # includes options before the subcommand (-c, -C, --exec-path)
        return not any(_option_name(w) in _GIT_WRITING_OPTIONS for w in rest[1:])
    forbidden = _READ_ONLY_PROGRAMS.get(program)
    if forbidden is None:
        return False
    return not any(_option_name(w) in forbidden for w in rest)


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
        with trio.move_on_after(timeout) as deadline:
            exit_code, abandoned = await self._run(command, cwd, stdout, stderr)
        if deadline.cancelled_caught:
            raise ToolError(
                f"command timed out after {timeout:g} s and was killed\n"
                + _render(None, stdout, stderr, abandoned=False),
            )
        return _render(exit_code, stdout, stderr, abandoned=abandoned)

    async def _run(
        self, command: str, cwd: os.PathLike[str], stdout: _HeadTail, stderr: _HeadTail
    ) -> tuple[int | None, bool]:
        """Run `command` to its exit; return (exit code, whether output was abandoned)."""
        exited = trio.Event()
        readers_done = trio.Event()
        env = dict(os.environ)
        env["GIT_OPTIONAL_LOCKS"] = "0"  # a read-only `git status` then leaves .git alone
        env["GIT_TERMINAL_PROMPT"] = "0"
        env.setdefault("PAGER", "cat")
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
