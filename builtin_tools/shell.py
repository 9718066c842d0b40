"""The shell tools, `run_command` and `background_command`, and `is_read_only_command`,
the strict test that decides which commands run without confirmation.

A command runs one of two ways:

- read-only (`is_read_only_command`): the line is split by the strict lexer below into
  the argv of each command of a pipeline, and exactly those argvs run, without a shell
  (the tool wires the pipes), in the sandbox with the workspace read-only and no
  network. What was checked is what runs: there is no shell left to expand anything.
  Such a line runs this way even when it needed the gate (it named a path outside the
  workspace, or there is no sandbox): an allowed program never needs more.
- anything else, once the gate approved it: through bash, in the sandbox with the
  workspace writable (and the network only with `command_network=True`).

The sandbox (`_sandbox.py`, bubblewrap) is what makes a classifier mistake harmless: a
command in it can neither write outside the workspace nor reach the network, and sees no
home folder. When it is missing or cannot start, nothing runs without confirmation,
unless the tools were built with `sandbox=False`, which says the user accepts running
unsandboxed; then the classifier alone decides.

Every command runs in its own process group (killed whole at its timeout), in the
workspace or a folder inside it, with stdin closed and its output bounded (head and
tail kept).

`background_command` starts a command under the same rules and sandbox and returns at
once; the process belongs to the session. Its output goes to a file in a private folder
of the session (0700, files 0600), which `action="output"` reads from where the last read
stopped, so no task outlives the call that started it. Closing the session (`ctx.on_close`)
kills every process group it started: in the sandbox that ends bwrap, whose
`--die-with-parent` takes the sandbox's whole pid namespace with it, children that
double-forked or left the session included. Without the sandbox, killing the process
group ends what stayed in it; a child that made a session of its own (`setsid`) escapes.
bwrap's `--die-with-parent` follows the thread that forked it, so background commands are
forked from the event loop's thread, never from a worker thread that exits when idle.

Nothing from the dispatcher's passes, trio or asyncio may be imported here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import string
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs

from dispatcher._backend import open_process
from dispatcher._exceptions import ToolError
from dispatcher._registry import Tool
from dispatcher._types import ToolContext

from ._sandbox import SandboxStatus, bwrap_argv, command_sandbox
from ._workspace import Workspace

__all__ = ["BACKGROUND_KEY", "ShellStatistics", "ShellTools", "is_read_only_command", "shell_tools"]

DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 600.0
_PIPE_GRACE = 0.5  # how long to keep reading after the command exits, for buffered output
_REAP_TIMEOUT = 5.0

BACKGROUND_KEY = "background_commands"
"""`ctx.state[BACKGROUND_KEY]`: the session's background commands."""
_BACKGROUND_ACTIONS = ("start", "output", "stop", "list")
_BACKGROUND_KEPT = 16  # commands a session keeps (running ones count against it)
_STOP_GRACE = 2.0  # between SIGTERM and SIGKILL
_OUTPUT_FILE_LIMIT = 8 * 1024 * 1024  # an output file read to its end past this starts over

# -- the strict lexer -----------------------------------------------------------------------
#
# It accepts only what bash would pass on unchanged: words of the characters below, and
# quoted parts that bash takes literally ('...' always; "..." without $ ` \ or !), glued
# together as bash glues them, with `|` between commands. `~` is taken only inside a word
# and not after `=` or `:` (`HEAD~1`), where bash leaves it alone. Anything else (every
# other character unquoted: $ ` \ { } [ ] * ? ! # ; & < > ( ) and newlines) makes the
# line not read-only: it is left to the gate and to bash, never reinterpreted here.
_UNQUOTED = frozenset(string.ascii_letters + string.digits + "_-./,:=+@%^")
_NOT_LITERAL_IN_DOUBLE_QUOTES = frozenset('$`\\!"')
_BLANKS = frozenset(" \t")
_MAX_WORD = 4096


def _split_pipeline(command: str) -> list[list[str]] | None:
    """The argv of each command of `command`, a pipeline of plain words; None for
    anything the lexer does not accept."""
    segments: list[list[str]] = [[]]
    word: list[str] | None = None  # None: between words
    size = 0  # characters in `word`, checked as it grows: a long line is refused as it is read
    i, end = 0, len(command)
    while i < end:
        ch = command[i]
        if ch in _BLANKS or ch == "|":
            if word is not None:
                segments[-1].append("".join(word))
                word = None
            if ch == "|":
                if not segments[-1]:
                    return None  # `| x`, `x || y`
                segments.append([])
            i += 1
        elif ch in "'\"":
            close = command.find(ch, i + 1)
            if close < 0:
                return None  # an unclosed quote
            part = command[i + 1 : close]
            if not part.isprintable() or (ch == '"' and _NOT_LITERAL_IN_DOUBLE_QUOTES & set(part)):
                return None
            word, size = _grown(word, size, part)
            i = close + 1
        elif ch in _UNQUOTED or (ch == "~" and word and not word[-1].endswith(("=", ":"))):
            word, size = _grown(word, size, ch)
            i += 1
        else:
            return None
        if size > _MAX_WORD:
            return None
    if word is not None:
        segments[-1].append("".join(word))
    if not all(segments):
        return None
    return segments


def _refuse_nul(command: str) -> None:
    """A command holding a NUL is refused plainly: no argv or shell can carry one."""
    if "\x00" in command:
        raise ToolError(
            f"the command holds a NUL character at {command.index(chr(0))}: remove it", retryable=False
        )


def _grown(word: list[str] | None, size: int, part: str) -> tuple[list[str], int]:
    """`word` (a new one if None) with `part` appended in place, and its new size: a copy of
    the word for each character would make a long line cost its length squared to read."""
    if word is None:
        return [part], len(part)
    word.append(part)
    return word, size + len(part)


# -- what each allowed program may not be asked to do ---------------------------------------


@attrs.frozen
class _Refused:
    """The options that would make an allowed program write, run another program, or
    follow symbolic links out of the workspace."""

    # Long options, refused with every abbreviation (GNU getopt takes any unique prefix).
    long: frozenset[str] = frozenset()
    # Short option letters, refused anywhere in a cluster (`-rR` is `-r -R`).
    short: str = ""
    # Whole words refused by prefix (find's actions are words, not options).
    words: tuple[str, ...] = ()


# --files0-from (sort, wc, du; find's -files0-from) reads the names of the files to open from
# a file, whose contents no check of the words typed can see: a file the model wrote may
# name anything outside.
_READ_ONLY_PROGRAMS: dict[str, _Refused] = {
    "cat": _Refused(),
    "head": _Refused(),
    "tail": _Refused(),
    "wc": _Refused(long=frozenset({"--files0-from"})),
    "pwd": _Refused(),
    "echo": _Refused(),
    "cut": _Refused(),
    "tr": _Refused(),
    "stat": _Refused(),
    "ls": _Refused(long=frozenset({"--dereference"}), short="L"),
    "du": _Refused(long=frozenset({"--dereference", "--files0-from"}), short="L"),
    "grep": _Refused(long=frozenset({"--dereference-recursive"}), short="R"),
    # --pre and --hostname-bin run programs; --follow leaves the workspace through links.
    "rg": _Refused(long=frozenset({"--pre", "--pre-glob", "--hostname-bin", "--follow"}), short="L"),
    # -o writes the output to a file, --compress-program runs one, -T writes temp files.
    "sort": _Refused(
        long=frozenset({"--output", "--compress-program", "--temporary-directory", "--files0-from"}),
        short="oT",
    ),
    "find": _Refused(
        words=("-exec", "-ok", "-delete", "-fprint", "-fls", "-follow", "-L", "-files0-from"),
    ),
}
_READ_ONLY_GIT = frozenset({"status", "log", "diff", "show"})
# git diff/log/show --output=<file> writes; --ext-diff and --textconv run configured programs;
# --submodule and --ignore-submodules would have git look into submodules, which it does by
# running git there, under the submodule's own config (see _SAFE_GIT_CONFIG).
# git also takes any unambiguous prefix of a long option (`--outp=x` is `--output=x`).
_GIT_REFUSED = _Refused(
    long=frozenset({"--output", "--ext-diff", "--textconv", "--submodule", "--ignore-submodules"})
)
# Read-only commands are looked up here, never in PATH, which may name a folder of the
# workspace (or `.`) where a command could have left its own `ls`.
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
# All that a read-only command keeps of the agent's environment: the locale and the
# terminal's settings, and the settings the call itself makes (`_READ_ONLY_SETTINGS`). The
# rest is the agent's (API keys, tokens), which the command's /proc/self/environ would show
# through a link swapped in after the check; and settings an allowed program would read to
# run something else (RIPGREP_CONFIG_PATH, GREP_OPTIONS, GIT_EXTERNAL_DIFF, GIT_EXEC_PATH)
# or to find a repository other than by searching from the folder (GIT_DIR, ...).
_KEPT_ENVIRONMENT = frozenset({"LANG", "LANGUAGE", "TZ", "TERM", "COLUMNS", "LINES", "NO_COLOR"})
_READ_ONLY_SETTINGS = frozenset({"GIT_OPTIONAL_LOCKS", "GIT_TERMINAL_PROMPT", "PAGER"})


def _segment_is_read_only(words: Sequence[str]) -> bool:
    program, rest = words[0], list(words[1:])
    if program == "git":
        if not rest or rest[0] not in _READ_ONLY_GIT:
            return False  # includes options before the subcommand (-c, -C, --exec-path)
        program, rest, refused = "git", rest[1:], _GIT_REFUSED
    else:
        found = _READ_ONLY_PROGRAMS.get(program)
        if found is None:
            return False
        refused = found
    return not any(_is_refused(word, refused) for word in rest)


def _is_refused(word: str, refused: _Refused) -> bool:
    if any(word.startswith(prefix) for prefix in refused.words):
        return True
    if word.startswith("--"):
        name = word.split("=", 1)[0]
        return len(name) > 2 and any(option.startswith(name) for option in refused.long)
    if word.startswith("-") and len(word) > 1:
        return any(letter in refused.short for letter in word[1:])
    return False


# -- confinement to the workspace -----------------------------------------------------------


def _path_candidates(word: str) -> list[str]:
    """What in `word` a program could take for a path: the word itself, even one that
    looks like an option (after `--`, or as an option's value, `-x` is a file's name: a
    link named `-x` may lead anywhere), an option's `=value`, or, in a short option,
    whatever follows its letter (`-f../x`, `-O/etc/x`)."""
    if word.startswith("--"):
        _, eq, value = word.partition("=")
        return [word, value] if eq else [word]
    if word.startswith("-") and len(word) > 1:
        _, eq, value = word.partition("=")
        return [word] + [word[k:] for k in range(2, len(word))] + ([value] if eq else [])
    return [word]


# Past this, a short option's attached value is not searched for paths: the word is refused.
_MAX_OPTION_WORD = 256


def _leaves(candidate: str, root: Path | None, cwd: Path | None) -> bool:
    """Whether `candidate`, taken as a path from `cwd`, names something outside `root`
    (after `..` and symbolic links, see `_stays_within`). Without a root: any absolute or
    climbing path."""
    if not candidate:
        return False
    if root is None or cwd is None:
        return os.path.isabs(candidate) or ".." in Path(candidate).parts
    return not _stays_within(os.path.join(cwd, candidate), root)


_MAX_LINKS = 40  # symbolic links followed in one path, as Linux allows


def _stays_within(path: str | os.PathLike[str], root: Path) -> bool:
    """Whether the absolute `path`, resolved one name at a time with each symbolic link
    followed, ends inside `root` without any step passing anywhere but `root` and the
    folders above it. `os.path.realpath` would only say where the path ends, and resolve it
    in this process: `/proc/self/cwd` is then this process's folder, while the command sees
    its own, so `/proc/self/cwd/../..` can end inside here and outside there. No step
    through /proc (or anything else outside) is taken, wherever the path would end; a link
    loop, a name holding a NUL or too many links is outside too."""
    top = os.fspath(root)
    inside = top if top.endswith(os.sep) else top + os.sep
    above = {os.fspath(folder) for folder in root.parents}  # the way down to the root

    def allowed(here: str) -> bool:
        return here == top or here.startswith(inside) or here in above

    names = os.fspath(path).split(os.sep)[::-1]  # a stack: the next name last
    here, links = os.sep, 0
    while names:
        name = names.pop()
        if name in ("", "."):
            continue
        if name == "..":
            here = os.path.dirname(here)
        else:
            step = os.path.join(here, name)
            try:
                target = os.readlink(step)
            except OSError:  # not a link, or not there: a name like any other
                here = step
            except ValueError:  # a NUL in the name
                return False
            else:
                links += 1
                if links > _MAX_LINKS:
                    return False
                names += target.split(os.sep)[::-1]  # read from the link's folder, or from /
                if os.path.isabs(target):
                    here = os.sep
                continue
        if not allowed(here):
            return False
    return here == top or here.startswith(inside)


def _repository_top(root: Path, cwd: Path) -> Path | None:
    """The folder holding the `.git` that git finds from `cwd`, looking no higher than
    `root` (see GIT_CEILING_DIRECTORIES); None where there is none."""
    here = cwd
    while not os.path.lexists(here / ".git"):
        if here == root or here.parent == here:
            return None
        here = here.parent
    return here


def _git_stays_inside(root: Path, cwd: Path) -> bool:
    """Whether the repository git finds from `cwd` (looking no higher than `root`, see
    GIT_CEILING_DIRECTORIES) keeps its files inside `root`. A `.git` file (worktrees,
    submodules), a `commondir` file or an alternates file may point anywhere, and git
    would show what it finds there."""
    here = _repository_top(root, cwd)
    if here is None:
        return True  # no repository inside: git finds none and says so
    dot_git = here / ".git"
    git_dir = _linked_dir(dot_git, here, root) if dot_git.is_file() else dot_git
    if git_dir is None or not _stays_within(git_dir, root):
        return False
    common = git_dir / "commondir"
    objects_of = _linked_dir(common, git_dir, root, prefix="") if common.is_file() else git_dir
    return objects_of is not None and not os.path.lexists(objects_of / "objects" / "info" / "alternates")


def _linked_dir(pointer: Path, base: Path, root: Path, *, prefix: str = "gitdir:") -> Path | None:
    """The folder a `.git` (`gitdir: <path>`) or `commondir` (`<path>`) file names, if it
    is inside `root`; else None."""
    try:
        text = pointer.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    if not text.startswith(prefix):
        return None
    named = base / text[len(prefix) :].strip()
    return Path(os.path.realpath(named)) if _stays_within(named, root) else None


def _read_only_pipeline(command: object, root: Path | None, cwd: Path | None) -> list[list[str]] | None:
    segments = _lexically_read_only(command)
    if segments is None:
        return None
    runs_git = any(words[0] == "git" for words in segments)
    if runs_git and root is not None and cwd is not None and not _git_stays_inside(root, cwd):
        return None
    for words in segments:
        for word in words[1:]:
            if word.startswith("-") and not word.startswith("--") and len(word) > _MAX_OPTION_WORD:
                return None
            if any(_leaves(candidate, root, cwd) for candidate in _path_candidates(word)):
                return None
    return segments


def _lexically_read_only(command: object) -> list[list[str]] | None:
    """The argvs of `command` if it is a pipeline of allowed programs with harmless
    options, whatever paths it names; else None."""
    if not isinstance(command, str) or not command.strip():
        return None
    segments = _split_pipeline(command)
    if segments is None or not all(_segment_is_read_only(words) for words in segments):
        return None
    return segments


def is_read_only_command(
    command: object,
    *,
    workspace: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> bool:
    """True only for a command that surely writes nothing and reads only the workspace.

    It must be plain words (letters, digits and `_-./,:=+@%^`, `~` inside a word, or quoted
    so that bash takes them literally: '...', or "..." without $ ` \\ !), with `|` between
    commands and nothing else of the shell: no expansion of any kind, no redirection, no
    other operator, no assignment, no newline. Each command must be an allowed program (cat,
    head, tail, wc, pwd, echo, cut, tr, stat, ls, du, grep, rg, sort, find, and git
    status/log/diff/show) without an option that writes, runs another program or follows
    links (find -exec/-ok/-delete/-fprint*/-fls/-L, rg --pre, sort -o, git --output, ...,
    long options with every abbreviation; nor one that reads the names of files to open
    from a file, --files0-from). No argument may name a path outside `workspace` (from
    `cwd`, a folder inside it or relative to it; resolved one name at a time, `..` and
    symbolic links followed, no step passing outside: not through /proc either), nor may
    an option's attached value, nor may git's repository lie
    outside (a `.git` file or link, `commondir` or alternates pointing out). Without a
    workspace, any absolute path or `..` is outside. When in doubt: False.
    """
    root = Path(os.path.realpath(workspace)) if workspace is not None else None
    here = None
    if root is not None:
        here = Path(os.path.realpath(os.path.join(root, cwd))) if cwd is not None else root
    return _read_only_pipeline(command, root, here) is not None


# -- git without the programs a repository's config names ----------------------------------
#
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
# - `--no-ext-diff --no-textconv` after diff/log/show (the checked argv is what runs, so
#   they go into it): `diff.external` has no value that turns it off.
# - no submodule looked into (`--ignore-submodules=all` after the subcommand, which a
#   `.gitmodules` `ignore = none` cannot override as it does diff.ignoreSubmodules; and
#   status.submoduleSummary=false, submodule.recurse=false): git looks into one by running
#   git there, which reads the submodule's own config, whose drivers the listing below
#   never saw;
# - no transport allowed (protocol.allow=never, and each protocol by name, as well as every
#   `protocol.<name>.allow` the config sets): a partial clone fetches missing objects on
#   demand, running the remote's `uploadpack` program (any program its config names) or
#   reading a repository outside; GIT_NO_LAZY_FETCH says the same to a git that knows it;
# - the repository's work tree is the folder that holds its `.git` (GIT_WORK_TREE), as git
#   finds it unless `core.worktree` names another folder, outside say, whose files
#   `git diff` would show.
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
    ("diff.ignoreSubmodules", "all"),
    ("status.submoduleSummary", "false"),
    ("submodule.recurse", "false"),
    ("protocol.allow", "never"),
    *(
        (f"protocol.{name}.allow", "never")
        for name in ("file", "git", "ssh", "http", "https", "ext", "ftp", "ftps")
    ),
)
# The keys that allow a transport, emptied to "never" as found in the config.
_GIT_PROTOCOL_ALLOWED = re.compile(r"protocol\..+\.allow")
# The config keys (as `git config --list` spells them) whose value is a program to run.
_GIT_DRIVER_PROGRAM = re.compile(r"(filter|diff|merge)\..+\.(clean|smudge|process|textconv|command|driver)")
_GIT_CONFIG_TIMEOUT = 10.0


# -- the tool -------------------------------------------------------------------------------


@attrs.frozen
class ShellStatistics:
    """How `run_command` runs commands: in `sandbox` or not, whether read-only commands
    run without confirmation, and whether approved commands get the network."""

    sandbox: SandboxStatus
    auto_approval: bool
    command_network: bool


def shell_tools(workspace: Workspace, *, sandbox: bool = True, command_network: bool = False) -> list[Tool]:
    """The shell tool bound to `workspace` (see ShellTools)."""
    return ShellTools(workspace, sandbox=sandbox, command_network=command_network).tools()


class ShellTools:
    """`run_command` bound to one workspace.

    `sandbox=True` runs every command in bubblewrap (`bwrap`, from PATH or the path
    given as `bwrap`); when it is missing or cannot start, every command needs
    confirmation and approved commands run unsandboxed. `sandbox=False` runs without it
    and lets the classifier alone approve read-only commands: only for hosts that are a
    sandbox already. `command_network=True` gives approved commands the network
    (read-only commands never get it). `sandbox_read_only_paths` are further host folders
    commands may read (a toolchain outside the system folders). `max_output_bytes` bounds
    each of stdout and stderr (half kept from the start, half from the end).
    """

    def __init__(
        self,
        workspace: Workspace,
        *,
        max_output_bytes: int = 32 * 1024,
        sandbox: bool = True,
        command_network: bool = False,
        bwrap: str | None = None,
        sandbox_read_only_paths: Sequence[str | os.PathLike[str]] = (),
    ) -> None:
        self.ws = workspace
        self.max_output_bytes = max_output_bytes
        # bash when there is one: models write bash; /bin/sh otherwise.
        self.shell = shutil.which("bash", path=_SYSTEM_PATH) or "/bin/sh"
        self.command_network = command_network
        self.sandbox_read_only_paths = [os.fspath(p) for p in sandbox_read_only_paths]
        self.sandbox = (
            command_sandbox(bwrap) if sandbox else SandboxStatus(False, None, "turned off (sandbox=False)")
        )
        self.auto_approval = self.sandbox.active or not sandbox

    def statistics(self) -> ShellStatistics:
        return ShellStatistics(self.sandbox, self.auto_approval, self.command_network)

    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="run_command",
                description=self._description(),
                handler=self.run_command,
                parameters=_RUN_COMMAND_SCHEMA,
                confirm=self.needs_confirmation,
                # Past our own kill timeout, so the command's own limit is the one that acts.
                timeout=MAX_TIMEOUT + 30,
                # A read-only command still reads files: any file write invalidates it.
                reads=_reads_any_file,
                writes=_command_writes,
            ),
            Tool(
                name="background_command",
                description=self._background_description(),
                handler=self.background_command,
                parameters=_BACKGROUND_COMMAND_SCHEMA,
                confirm=self.background_needs_confirmation,
                timeout=_STOP_GRACE + 30,
                reads=_reads_any_file,
                writes=_background_writes,
            ),
        ]

    def _background_description(self) -> str:
        return (
            "Start a long-running command (a dev server, a watcher, a build) and return at once "
            'with its id: background_command(command="..."). action="output" with the id returns '
            'its output since the last read, action="stop" stops it, action="list" lists them. '
            "Commands run under run_command's rules and sandbox and stop when the conversation "
            "ends."
        )

    def background_needs_confirmation(self, args: Mapping[str, Any]) -> bool:
        """unless reading or stopping one, or starting a read-only command

        Starting follows run_command's rule; reading, listing and stopping the session's
        own commands never need the gate."""
        if args.get("action", "start") != "start":
            return False
        return self.needs_confirmation(args)

    async def background_command(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        action = args.get("action") or "start"
        if action not in _BACKGROUND_ACTIONS:
            raise ToolError(
                f"action is one of {', '.join(_BACKGROUND_ACTIONS)}, got {action!r}", retryable=False
            )
        jobs = _session_jobs(ctx)
        if action == "list":
            return jobs.listing()
        if action == "start":
            command = args.get("command")
            if not isinstance(command, str) or not command.strip():
                raise ToolError('action="start" needs the command to run', retryable=False)
            _refuse_nul(command)
            return await self._start_background(command, args.get("cwd"), jobs)
        job = jobs.find(args.get("id"))
        if action == "stop":
            await job.stop()
        return job.report(self.max_output_bytes)

    async def _start_background(self, command: str, cwd_arg: object, jobs: _Jobs) -> str:
        cwd = self.ws.resolve(cwd_arg if isinstance(cwd_arg, str) and cwd_arg else ".")
        if not cwd.is_dir():
            raise ToolError(f"cwd {cwd_arg!r} is not a folder", retryable=False)
        jobs.make_room()
        env = dict(os.environ)
        env["GIT_OPTIONAL_LOCKS"] = "0"
        env["GIT_TERMINAL_PROMPT"] = "0"
        env.setdefault("PAGER", "cat")
        segments = _lexically_read_only(command)
        if segments is not None:
            stages, env = await self._read_only_stages(segments, cwd, env)
        else:
            if not os.access(self.shell, os.X_OK):
                raise ToolError(f"cannot start the command with {self.shell!r}", retryable=False)
            shell = [self.shell, "-c", command]
            stages = [self._confine(shell, cwd, writable=True, network=self.command_network)]
        job = jobs.start(command, stages, cwd, env, sandboxed=self.sandbox.active)
        return (
            f"started {job.id}: {command}\n"
            f'read its output with background_command(action="output", id="{job.id}"); '
            f'stop it with action="stop"'
        )

    def _description(self) -> str:
        text = (
            "Run a shell command in the workspace (or `cwd` inside it) and return its "
            "exit code, stdout and stderr. stdin is closed; the command is killed "
            f"after `timeout` seconds (default {DEFAULT_TIMEOUT:g}, at most {MAX_TIMEOUT:g}). "
        )
        if self.sandbox.active:
            network = "with" if self.command_network else "without"
            text += (
                "It runs in a sandbox: the system read-only, no home folders, nothing outside "
                f"the workspace writable, {network} network. "
            )
        else:
            # Fixed words, not the reason itself (paths, versions): the description is part
            # of the registry's fingerprint, which recordings carry.
            why = "turned off" if self.auto_approval else "bwrap is missing or cannot start"
            text += f"It runs without a sandbox ({why}). "
        if self.auto_approval:
            text += (
                "Read-only commands run without confirmation: plain words and quotes, no $, "
                "globs, braces, ~ or redirections, only `|` between cat, head, tail, wc, pwd, "
                "echo, cut, tr, stat, ls, du, grep, rg, sort, find, git status/log/diff/show, "
                "and no path outside the workspace. Every other command needs confirmation."
            )
        else:
            text += "Every command needs confirmation."
        return text

    def needs_confirmation(self, args: Mapping[str, Any]) -> bool:
        """unless the command is read-only and may run unconfirmed

        False only for a read-only command (see is_read_only_command) when read-only
        commands may run unconfirmed (a working sandbox, or `sandbox=False`)."""
        if not self.auto_approval:
            return True
        try:
            cwd = self.ws.resolve(args.get("cwd") or ".")
        except ToolError:
            return True
        return _read_only_pipeline(args.get("command"), self.ws.root, cwd) is None

    async def run_command(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        command: str = args["command"]
        _refuse_nul(command)
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
        # Whatever the gate said, a line the lexer accepts runs as its checked argvs: an
        # allowed program then never writes, and never gets the network or the shell.
        segments = _lexically_read_only(command)
        with anyio.move_on_after(timeout) as deadline:
            if segments is not None:
                stages, env = await self._read_only_stages(segments, cwd, env)
            else:
                if not os.access(self.shell, os.X_OK):
                    raise ToolError(f"cannot start the command with {self.shell!r}", retryable=False)
                shell = [self.shell, "-c", command]
                stages = [self._confine(shell, cwd, writable=True, network=self.command_network)]
            exit_code, abandoned = await _run_stages(stages, cwd, env, stdout, stderr)
        if deadline.cancelled_caught:
            raise ToolError(
                f"command timed out after {timeout:g} s and was killed\n"
                + _render(None, stdout, stderr, abandoned=False),
            )
        return _render(exit_code, stdout, stderr, abandoned=abandoned)

    async def _read_only_stages(
        self, segments: list[list[str]], cwd: Path, env: dict[str, str]
    ) -> tuple[list[list[str]], dict[str, str]]:
        """The argv of each stage of a read-only pipeline, and the environment it runs in
        (of `env`, only what `_KEPT_ENVIRONMENT` keeps)."""
        env = {
            name: value
            for name, value in env.items()
            if name in _KEPT_ENVIRONMENT or name in _READ_ONLY_SETTINGS or name.startswith("LC_")
        }
        # What the programs start in turn (rg's decompressors, git's helpers) comes from
        # the system folders too, and git does not look for a repository above the
        # workspace (whose files it would show from outside).
        env["PATH"] = _SYSTEM_PATH
        env["GIT_CEILING_DIRECTORIES"] = os.fspath(self.ws.root.parent)
        if any(words[0] == "git" for words in segments):  # see _SAFE_GIT_CONFIG
            env["GIT_NO_LAZY_FETCH"] = "1"
            top = _repository_top(self.ws.root, cwd)
            if top is not None:
                env["GIT_WORK_TREE"] = os.fspath(top)
            env = await _safe_git_env(env, cwd)
        stages = []
        for words in segments:
            program = shutil.which(words[0], path=_SYSTEM_PATH)
            if program is None:
                raise ToolError(f"cannot start the command: {words[0]!r} is not installed", retryable=False)
            argv = [program, *words[1:]]
            if words[0] == "git":
                # on the command line, above a `.gitmodules` `ignore = none` (see _SAFE_GIT_CONFIG)
                argv[2:2] = ["--ignore-submodules=all"]
                if words[1] != "status":
                    argv[2:2] = ["--no-ext-diff", "--no-textconv"]
            stages.append(self._confine(argv, cwd, writable=False, network=False))
        return stages, env

    def _confine(self, argv: list[str], cwd: Path, *, writable: bool, network: bool) -> list[str]:
        if not self.sandbox.active or self.sandbox.program is None:
            return argv
        return bwrap_argv(
            self.sandbox.program,
            argv,
            workspace=self.ws.root,
            cwd=cwd,
            writable=writable,
            network=network,
            read_only_paths=self.sandbox_read_only_paths,
        )


async def _run_stages(
    stages: list[list[str]], cwd: Path, env: Mapping[str, str], stdout: _HeadTail, stderr: _HeadTail
) -> tuple[int | None, bool]:
    """Run a pipeline of argvs (each one's stdout into the next one's stdin) to its end;
    return (the last one's exit code, whether output was abandoned). Each stage leads its
    own process group, killed whole if the call is cancelled."""
    processes: list[anyio.abc.Process] = []
    pipes = [os.pipe() for _ in stages[1:]]
    try:
        try:
            for index, argv in enumerate(stages):
                processes.append(
                    await open_process(
                        argv,
                        stdin=pipes[index - 1][0] if index else subprocess.DEVNULL,
                        stdout=pipes[index][1] if index < len(pipes) else subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=cwd,
                        env=env,
                        start_new_session=True,
                    )
                )
        except OSError as exc:
            raise ToolError(f"cannot start the command {argv[0]!r}: {exc}", retryable=False) from exc
        finally:
            for read_end, write_end in pipes:  # the stages hold their own copies
                os.close(read_end)
                os.close(write_end)
        return await _collect(processes, stdout, stderr)
    except BaseException:
        # Cancelled (the timeout) or failed: nothing the command started may outlive it.
        for process in processes:
            _kill_process_group(process)
        raise
    finally:
        # Close our ends of the pipes and reap every stage, even when cancelled.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_REAP_TIMEOUT):
            for process in processes:
                await process.aclose()


async def _collect(
    processes: list[anyio.abc.Process], stdout: _HeadTail, stderr: _HeadTail
) -> tuple[int | None, bool]:
    readers_done = anyio.Event()

    async def read_all() -> None:
        async with anyio.create_task_group() as readers:
            last = processes[-1].stdout
            assert last is not None
            readers.start_soon(_drain, last, stdout)
            for process in processes:
                assert process.stderr is not None
                readers.start_soon(_drain, process.stderr, stderr)
        readers_done.set()

    abandoned = False
    async with anyio.create_task_group() as group:
        group.start_soon(read_all)
        for process in processes:
            await process.wait()
        with anyio.move_on_after(_PIPE_GRACE):
            await readers_done.wait()
        if not readers_done.is_set():
            # A background child still holds the pipes open: stop reading.
            abandoned = True
            group.cancel_scope.cancel()
    return processes[-1].returncode, abandoned


async def _safe_git_env(env: Mapping[str, str], cwd: os.PathLike[str]) -> dict[str, str]:
    """`env` with git's program-running settings overridden (see _SAFE_GIT_CONFIG), for
    the repository `cwd` is in."""
    overrides = list(_SAFE_GIT_CONFIG)
    safe = _with_git_config(env, overrides)
    git = shutil.which("git", path=_SYSTEM_PATH)
    if git is None:
        return safe  # no git: the command fails on its own, and runs nothing from a config
    try:
        with anyio.fail_after(_GIT_CONFIG_TIMEOUT):
            listing = await anyio.run_process(
                [git, "config", "-z", "--name-only", "--list"],
                cwd=cwd,
                env=safe,
                stdin=subprocess.DEVNULL,
                check=False,
            )
    except TimeoutError:
        raise ToolError("reading the git configuration timed out", retryable=True) from None
    if listing.returncode != 0:
        reason = listing.stderr.decode("utf-8", errors="replace").strip()
        raise ToolError(f"cannot read the git configuration here: {reason}", retryable=False)
    names = listing.stdout.decode("utf-8", errors="replace").split("\0")
    programs = sorted({name for name in names if _GIT_DRIVER_PROGRAM.fullmatch(name)})
    overrides += [(name, "") for name in programs]
    overrides += [(name, "never") for name in sorted(set(filter(_GIT_PROTOCOL_ALLOWED.fullmatch, names)))]
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


def _kill_process_group(process: anyio.abc.Process) -> None:
    """Kill a stage and everything it started (it leads its own process group)."""
    if process.returncode is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            process.kill()


async def _drain(stream: anyio.abc.ByteReceiveStream, sink: _HeadTail) -> None:
    async for chunk in stream:
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


# -- background commands --------------------------------------------------------------------


def _spawn(
    stages: list[list[str]], cwd: Path, env: Mapping[str, str], output: int
) -> list[subprocess.Popen[bytes]]:
    """Start a pipeline whose stderr, and last stdout, go to the file `output`; each stage
    leads its own process group. Called on the event loop's thread on purpose: bwrap's
    `--die-with-parent` follows the thread that forked it, and a worker thread (trio's
    `open_process` forks from one) exits after ten idle seconds, killing the sandbox."""
    processes: list[subprocess.Popen[bytes]] = []
    pipes = [os.pipe() for _ in stages[1:]]
    try:
        for index, argv in enumerate(stages):
            processes.append(
                subprocess.Popen(
                    argv,
                    stdin=pipes[index - 1][0] if index else subprocess.DEVNULL,
                    stdout=pipes[index][1] if index < len(pipes) else output,
                    stderr=output,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            )
    except OSError as exc:
        _kill_all(processes)
        raise ToolError(f"cannot start the command {argv[0]!r}: {exc}", retryable=False) from exc
    finally:
        for read_end, write_end in pipes:  # the stages hold their own copies
            os.close(read_end)
            os.close(write_end)
    return processes


def _kill_all(processes: Sequence[subprocess.Popen[bytes]], sig: int = signal.SIGKILL) -> None:
    """Send `sig` to the process group of every stage still running."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            found += [int(word) for word in (task / "children").read_text().split()]
    return found


def _sandboxed_processes(bwrap: int) -> list[int]:
    """The processes running inside the sandbox bwrap `bwrap` started: the descendants of
    the namespace's init (bwrap's child), whom a signal from outside does not reach."""
    todo = [child for init in _children(bwrap) for child in _children(init)]
    found: list[int] = []
    while todo and len(found) < 10_000:
        pid = todo.pop()
        found.append(pid)
        todo += _children(pid)
    return found


def _incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character not yet complete."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        needs = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
        return back if needs > back else 0
    return 0


def _ended(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


@attrs.define(eq=False)
class _Job:
    """One background command: its stages, the file its output goes to, how far it was read."""

    id: str
    command: str
    processes: list[subprocess.Popen[bytes]]
    output: Path
    started: float
    sandboxed: bool = False
    offset: int = 0
    stop_asked: bool = False

    def exit_code(self) -> int | None:
        """The last stage's exit code once every stage has exited; None while any runs."""
        codes = [p.poll() for p in self.processes]
        return None if any(c is None for c in codes) else codes[-1]

    def state(self) -> str:
        code = self.exit_code()
        if code is None:
            return "running"
        return f"stopped, {_ended(code)}" if self.stop_asked else f"exited, {_ended(code)}"

    def read_new(self, limit: int) -> tuple[str, int]:
        """The output written since the last read (its first and last `limit // 2` bytes
        when there is more), and how many bytes that was."""
        try:
            with open(self.output, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # started over (see below)
                    self.offset = 0
                new = size - self.offset
                half = max(1, limit // 2)
                f.seek(self.offset)
                if new <= limit:
                    data = f.read(new)
                    if self.exit_code() is None:
                        # a character still being written is shown whole by the next read
                        held = _incomplete_tail(data)
                        data, size, new = data[: len(data) - held], size - held, new - held
                    text = data.decode("utf-8", "replace")
                else:
                    head = f.read(half)
                    f.seek(size - half)
                    tail = f.read(half)
                    omitted = new - len(head) - len(tail)
                    text = (
                        head.decode("utf-8", "replace")
                        + f"\n[... {omitted} bytes omitted ...]\n"
                        + tail.decode("utf-8", "replace")
                    )
        except FileNotFoundError:
            return "", 0
        self.offset = size
        if size > _OUTPUT_FILE_LIMIT:
            # Read to its end: the command appends (O_APPEND), so emptying the file bounds the
            # disk it takes; bytes written between the read and this are lost.
            with contextlib.suppress(OSError):
                os.truncate(self.output, 0)
                self.offset = 0
        return text, new

    def report(self, limit: int) -> str:
        text, new = self.read_new(limit)
        lines = [f"{self.id} {self.state()}: {self.command}"]
        if new:
            lines += [f"output ({new} new bytes):", text.rstrip("\n")]
        else:
            lines.append("no new output")
        return "\n".join(lines)

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after a grace period; then reaped. A sandboxed stage's SIGTERM
        goes to the processes inside the sandbox (bwrap passes no signal on: it would die
        of it at once and take the command with it, with no chance to clean up)."""
        self.stop_asked = True
        for process in self.processes:
            inside = _sandboxed_processes(process.pid) if self.sandboxed else []
            for pid in inside:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
            if not inside:
                _kill_all([process], signal.SIGTERM)
        with anyio.move_on_after(_STOP_GRACE):
            while self.exit_code() is None:  # noqa: ASYNC110  # polling child processes, no event to wait on
                await anyio.sleep(0.02)
        self.kill()

    def kill(self) -> None:
        _kill_all(self.processes)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_REAP_TIMEOUT)


@attrs.define(eq=False)
class _Jobs:
    """One session's background commands and the private folder of their output files."""

    folder: Path
    jobs: dict[str, _Job] = attrs.field(factory=dict)
    started: int = 0
    closed: bool = False

    def find(self, job_id: object) -> _Job:
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if job is None:
            known = ", ".join(self.jobs) or "none"
            raise ToolError(
                f"no background command {job_id!r} in this session (known: {known})", retryable=False
            )
        return job

    def make_room(self) -> None:
        """Forget the oldest ended commands past the bound; refuse when all still run."""
        while len(self.jobs) >= _BACKGROUND_KEPT:
            ended = next((j for j in self.jobs.values() if j.exit_code() is not None), None)
            if ended is None:
                raise ToolError(
                    f"{_BACKGROUND_KEPT} background commands are running: stop one first", retryable=False
                )
            del self.jobs[ended.id]
            with contextlib.suppress(OSError):
                ended.output.unlink()

    def start(
        self, command: str, stages: list[list[str]], cwd: Path, env: Mapping[str, str], *, sandboxed: bool
    ) -> _Job:
        if self.closed:
            raise ToolError("the session is closing: no command can start", retryable=False)
        self.started += 1
        job_id = f"bg{self.started}"
        path = self.folder / f"{job_id}.out"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        try:
            processes = _spawn(stages, cwd, env, fd)
        finally:
            os.close(fd)
        job = _Job(job_id, command, processes, path, time.time(), sandboxed=sandboxed)
        self.jobs[job_id] = job
        return job

    def listing(self) -> str:
        if not self.jobs:
            return "no background commands in this session"
        now = time.time()
        lines = []
        for job in self.jobs.values():
            try:
                size = job.output.stat().st_size
            except OSError:
                size = 0
            unread = max(0, size - job.offset)
            lines.append(
                f"{job.id} {job.state()} ({now - job.started:.0f} s, {unread} bytes unread): {job.command}"
            )
        return "\n".join(lines)

    def close(self) -> None:
        """Kill every command the session started, reap them and remove their output."""
        self.closed = True
        for job in self.jobs.values():
            _kill_all(job.processes)
        for job in self.jobs.values():
            job.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _session_jobs(ctx: ToolContext) -> _Jobs:
    """The session's background commands, made (with their cleanup) on first use."""
    jobs = ctx.state.get(BACKGROUND_KEY)
    if isinstance(jobs, _Jobs) and not jobs.closed:
        return jobs
    jobs = _Jobs(Path(tempfile.mkdtemp(prefix="threepass-background-")))
    try:
        ctx.on_close(jobs.close)
    except RuntimeError:
        shutil.rmtree(jobs.folder, ignore_errors=True)
        raise ToolError("this call has no session to own a background command", retryable=False) from None
    ctx.state[BACKGROUND_KEY] = jobs
    return jobs


def _background_writes(args: Mapping[str, Any]) -> set[str]:
    # A running command may change any file at any time: every call but a read-only start
    # drops what the run remembers of files (and none of them is deduped).
    if args.get("action", "start") == "start" and _lexically_read_only(args.get("command")) is not None:
        return {"state:background"}
    return {"file:/", "state:background"}


def _command_writes(args: Mapping[str, Any]) -> set[str]:
    # Unknown effects on every file, unless the line runs as the argvs of allowed programs
    # with harmless options (whatever paths they name, they only read).
    return set() if _lexically_read_only(args.get("command")) is not None else {"file:/"}


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

_BACKGROUND_COMMAND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {
            "type": "string",
            "enum": list(_BACKGROUND_ACTIONS),
            "default": "start",
            "description": "start (the default), output, stop or list.",
        },
        "command": {"type": "string", "minLength": 1, "description": "start: the shell command line."},
        "cwd": {
            "type": "string",
            "description": "start: working folder, relative to the workspace. Default: the workspace.",
        },
        "id": {"type": "string", "description": "output, stop: the id start returned."},
    },
    "additionalProperties": False,
}
