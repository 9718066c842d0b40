"""The file tools: `read_files`, `find_files`, `edit_file`, `remove_file`, `restore_file`,
`file_history`.

Every path is resolved inside the workspace (`_workspace.Workspace.resolve`), and every
file is opened through the workspace, which walks the path again race-free (`_safepath`).
Readers run concurrently and declare what they read; writers run alone, declare what they
write, and go through the workspace's backups so `restore_file` can undo them.
Handlers are synchronous (plain file I/O): the dispatcher runs them in worker threads.
Nothing from the dispatcher's passes may be imported here.
"""

from __future__ import annotations

import io
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import attrs
import pathspec

from dispatcher._exceptions import ToolError
from dispatcher._registry import Tool
from dispatcher._types import ToolContext

from . import _safepath
from ._safepath import NotARegularFile
from ._workspace import Change, ChangeAction, Workspace, unique

__all__ = ["FileTools", "file_tools", "glob_to_regex"]

_DEFAULT_LIMIT = 2000
_MAX_LINE_CHARS = 2000
_MAX_OUTPUT_CHARS = 200_000
_BINARY_SNIFF_BYTES = 8192
_MAX_MATCHES = 1000
_MAX_VISITED = 200_000
_SNIPPET_LINES = 12
_GITIGNORE = ".gitignore"
_MAX_GITIGNORE_BYTES = 1024 * 1024
# find_files enters folders at most this many levels below where it starts: its walk
# holds one descriptor per level, and a tree can be far deeper (edit_file makes any
# folder asked for) than a search needs to go.
_MAX_DEPTH = 128
# How find_files opens a folder from its parent's descriptor: a symbolic link swapped in
# for the folder is not followed (O_NOFOLLOW), and a pipe not opened, which would wait
# for a writer (O_DIRECTORY refuses it first; O_NONBLOCK besides).
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def file_tools(workspace: Workspace) -> list[Tool]:
    """The file tools bound to `workspace`."""
    return FileTools(workspace).tools()


class FileTools:
    """The file tools' handlers and resource functions, bound to one workspace."""

    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace

    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="read_files",
                description=(
                    "Read one or more text files in the workspace, with line numbers. "
                    "`offset` (1-based line) and `limit` (lines) select a window of each file."
                ),
                handler=self.read_files,
                parameters=_READ_FILES_SCHEMA,
                concurrent=True,
                reads=self.read_files_reads,
            ),
            Tool(
                name="find_files",
                description=(
                    "List files and folders in the workspace whose path (relative to `path`) "
                    "matches a glob: `*` and `?` stay within one folder, `**` spans folders "
                    "(`**/*.py` finds Python files at any depth). Folders end with '/'. "
                    "What .gitignore files ignore is left out unless `include_ignored`."
                ),
                handler=self.find_files,
                parameters=_FIND_FILES_SCHEMA,
                concurrent=True,
                reads=self.find_files_reads,
            ),
            Tool(
                name="edit_file",
                description=(
                    "Replace `old_string` with `new_string` in a file (it must occur exactly "
                    "once unless `replace_all`). With an empty `old_string` and no such file, "
                    "create the file with `new_string` as its content. Undo with restore_file."
                ),
                handler=self.edit_file,
                parameters=_EDIT_FILE_SCHEMA,
                writes=self.path_writes,
            ),
            Tool(
                name="remove_file",
                description="Delete one file from the workspace. Undo with restore_file.",
                handler=self.remove_file,
                parameters=_PATH_SCHEMA,
                writes=self.path_writes,
            ),
            Tool(
                name="restore_file",
                description=(
                    "Undo the last change made to a file by edit_file, remove_file, "
                    "download_file or write_result; call again to step further back."
                ),
                handler=self.restore_file,
                parameters=_PATH_SCHEMA,
                writes=self.path_writes,
            ),
            Tool(
                name="file_history",
                description=(
                    "List the changes made through the file tools (to `path` and below, or "
                    "everywhere), oldest first, and how many versions restore_file can reach."
                ),
                handler=self.file_history,
                parameters=_FILE_HISTORY_SCHEMA,
                concurrent=True,
                reads=self.folder_reads,
            ),
        ]

    # -- resources (pass 1 calls these before validation: they never raise) --

    def read_files_reads(self, args: Mapping[str, Any]) -> set[str]:
        paths = args.get("paths")
        if not isinstance(paths, list):
            return set()
        return {self.ws.key(p) for p in paths if isinstance(p, str)}

    def folder_reads(self, args: Mapping[str, Any]) -> set[str]:
        path = args.get("path", ".")
        return {self.ws.key(path if isinstance(path, str) and path.strip() else ".")}

    def find_files_reads(self, args: Mapping[str, Any]) -> set[str]:
        """The folder searched, and the .gitignore files above it, which decide too."""
        reads = self.folder_reads(args)
        if args.get("include_ignored") is True:
            return reads
        folder = Path(next(iter(reads)).removeprefix("file:"))
        if self.ws.root in folder.parents:
            for above in folder.parents:
                reads.add(f"file:{above / _GITIGNORE}")
                if above == self.ws.root:
                    break
        return reads

    def path_writes(self, args: Mapping[str, Any]) -> set[str]:
        path = args.get("path")
        if not isinstance(path, str) or not path.strip():
            return {"file:/"}  # arguments that will fail validation: assume the worst
        return {self.ws.key(path)}

    # -- handlers ---------------------------------------------------------------

    def read_files(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        paths: list[str] = unique(args["paths"])
        offset = int(args.get("offset") or 1)
        limit = int(args.get("limit") or _DEFAULT_LIMIT)
        # A path that leads outside (or names nothing valid) is one more per-file
        # error: the files that can be read are still shown.
        entries: list[tuple[str, Path | ToolError]] = []
        for path in paths:
            try:
                target = self.ws.resolve(path)
            except ToolError as exc:
                entries.append((path, exc))
            else:
                entries.append((self.ws.relative(target), target))
        sections: list[str] = []
        failures = 0
        used = 0
        for index, (name, entry) in enumerate(entries):
            body = ""
            if isinstance(entry, Path):
                try:
                    body = _read_window(self.ws, entry, offset, limit)
                except ToolError as exc:
                    entry = exc
            if isinstance(entry, ToolError):
                failures += 1
                body = f"error: {entry.message}"
            section = f"==> {name} <==\n{body}"
            if used + len(section) > _MAX_OUTPUT_CHARS:
                rest = ", ".join(name for name, _ in entries[index:])
                sections.append(
                    f"[output cut at {_MAX_OUTPUT_CHARS} characters; not shown: {rest}. "
                    "Read fewer files, or use offset and limit]"
                )
                break
            used += len(section)
            sections.append(section)
        if failures == len(entries):
            raise ToolError("\n".join(sections), retryable=False)
        return "\n\n".join(sections)

    def find_files(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        pattern: str = args["pattern"]
        base = self.ws.resolve(args.get("path") or ".")
        if not base.is_dir():
            raise ToolError(f"{args.get('path')!r} is not a folder", retryable=False)
        matcher = glob_to_regex(pattern)
        skip_git = ".git" not in pattern
        ignores = None if args.get("include_ignored") else _GitIgnores(self.ws, base)
        matches: list[str] = []
        visited = 0
        ignored = 0
        too_deep: list[str] = []  # folders listed but not entered
        stopped = False
        for folder in _walk_folder(self.ws, base, args.get("path"), max_depth=_MAX_DEPTH):
            dirnames, filenames = folder.dirs, folder.files
            if skip_git and ".git" in dirnames:
                dirnames.remove(".git")
            here = folder.path
            if ignores is not None:
                rules = ignores.enter(here, folder.fd, _GITIGNORE in filenames)
                kept_dirs = [n for n in dirnames if not rules.ignores(here / n, is_dir=True)]
                kept_files = [n for n in filenames if not rules.ignores(here / n, is_dir=False)]
                ignored += len(dirnames) - len(kept_dirs) + len(filenames) - len(kept_files)
                dirnames[:], filenames = kept_dirs, kept_files
                ignores.hand_down(here, dirnames, rules)
            dirnames.sort()
            rel_dir = here.relative_to(base).as_posix()
            prefix = "" if rel_dir == "." else rel_dir + "/"
            for name in dirnames:
                if matcher.fullmatch(prefix + name):
                    matches.append(self.ws.relative(here / name) + "/")
            for name in filenames:
                if matcher.fullmatch(prefix + name):
                    matches.append(self.ws.relative(here / name))
            if folder.depth == _MAX_DEPTH:
                too_deep.extend(self.ws.relative(here / name) + "/" for name in dirnames)
            visited += len(dirnames) + len(filenames)
            if visited > _MAX_VISITED or len(matches) > _MAX_MATCHES:
                stopped = True
                break
        where = self.ws.relative(base)
        notes: list[str] = []
        if too_deep:
            notes.append(
                f"[{len(too_deep)} folder(s) more than {_MAX_DEPTH} levels below {where!r} were "
                f"not searched, the first {too_deep[0]!r}; to search one, pass it as `path`]"
            )
        if ignored:
            notes.append(
                f"[{ignored} entries that .gitignore ignores were not searched; "
                "include_ignored=true searches them]"
            )
        if not matches:
            return "\n".join([f"no files match {pattern!r} under {where!r}", *notes])
        matches.sort()
        shown = matches[:_MAX_MATCHES]
        lines = [f"{len(shown)} match(es) for {pattern!r} under {where!r}:", *shown]
        if stopped:
            lines.append("[stopped early: too many entries; narrow the pattern or the path]")
        return "\n".join([*lines, *notes])

    def edit_file(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        path: str = args["path"]
        old: str = args["old_string"]
        new: str = args["new_string"]
        replace_all = bool(args.get("replace_all", False))
        target = self.ws.resolve(path)
        self.ws.check_writable(target)
        rel = self.ws.relative(target)
        edit: _Edit | None = None

        def change(current: bytes | None) -> tuple[bytes, ChangeAction]:
            nonlocal edit
            edit = _plan_edit(current, old, new, replace_all, rel)
            return edit.content, edit.action

        # Read, change and write as one step, against other sessions and other writers.
        self.ws.update(target, change, **_who(ctx))
        assert edit is not None
        return edit.report

    def remove_file(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        path: str = args["path"]
        target = self.ws.resolve(path)
        self.ws.check_writable(target)
        if _names_a_symlink(path if os.path.isabs(path) else os.path.join(self.ws.root, path)):
            raise ToolError(
                f"{path!r} is a symbolic link; remove_file removes regular files only",
                retryable=False,
            )
        change = self.ws.remove(target, **_who(ctx))
        return f"removed {change.path} ({change.size_before} bytes); restore_file can bring it back"

    def restore_file(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        target = self.ws.resolve(args["path"])
        undone, _ = self.ws.restore(target, **_who(ctx))
        left = self.ws.restorable(target)
        when = _when(undone.at)
        if undone.size_before is None:
            outcome = f"removed {undone.path}: it did not exist before the {undone.action} at {when}"
        else:
            outcome = (
                f"restored {undone.path} to its version before the {undone.action} at {when} "
                f"({undone.size_before} bytes)"
            )
        return f"{outcome}; {left} earlier version(s) still kept"

    def file_history(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        path = args.get("path")
        under = self.ws.resolve(path) if path else None
        changes = self.ws.history(under)
        if not changes:
            where = f" to {self.ws.relative(under)!r}" if under is not None else ""
            return f"no changes made through the file tools{where}"
        lines = [_render_change(c) for c in changes]
        paths = unique(c.path for c in changes)
        kept = [f"{p}: {self.ws.restorable(self.ws.root / p)}" for p in paths]
        return "\n".join(
            [f"{len(changes)} change(s), oldest first:", *lines, "versions restore_file can reach:", *kept]
        )


# -- helpers ---------------------------------------------------------------------


def _who(ctx: ToolContext) -> dict[str, str | None]:
    session_id = ctx.session_id
    return {"session_id": None if session_id is None else str(session_id), "call_id": ctx.call_id}


@attrs.define
class _Folder:
    """One folder a walk lists, open as `fd` while the walk is at it. Removing names from
    `dirs` keeps the walk out of those subfolders."""

    path: Path
    depth: int  # levels below the folder the walk started from
    fd: int
    dirs: list[str]
    files: list[str]


def _walk_folder(ws: Workspace, base: Path, shown: object, *, max_depth: int) -> Iterator[_Folder]:
    """The folders under `base` (itself included), top-down, walked race-free.

    `base` is opened through the workspace, and each folder below from its parent's
    descriptor with O_NOFOLLOW | O_DIRECTORY, so a folder swapped for a symbolic link is
    not entered (nor a pipe swapped in opened, which would wait for a writer). Folders
    `max_depth` levels down are listed but not entered. The walk keeps a stack instead of
    recursing, and holds one descriptor per level, so neither Python's stack nor the
    descriptors held grow past `max_depth`, however deep the tree.
    """
    try:
        fd = ws.open_folder(base)
    except (FileNotFoundError, NotADirectoryError):
        raise ToolError(f"{shown!r} is not a folder", retryable=False) from None
    except OSError as exc:
        raise ToolError(f"cannot list {shown!r}: {exc.strerror or exc}", retryable=False) from exc
    held = [fd]  # the descriptors open: those of `entered`, then the current folder's
    entered: list[tuple[_Folder, Iterator[str]]] = []  # with the subfolders left to enter
    try:
        try:
            folder: _Folder | None = _Folder(base, 0, fd, *_list_folder(fd))
        except OSError as exc:
            raise ToolError(f"cannot list {shown!r}: {exc.strerror or exc}", retryable=False) from exc
        while folder is not None:
            yield folder
            if folder.depth < max_depth and folder.dirs:
                entered.append((folder, iter(folder.dirs)))
            else:
                os.close(held.pop())
            folder = None
            while entered and folder is None:
                parent, names = entered[-1]
                name = next(names, None)
                if name is None:
                    entered.pop()
                    os.close(held.pop())
                    continue
                try:
                    fd = os.open(name, _FOLDER_FLAGS, dir_fd=parent.fd)
                except OSError:
                    continue  # gone, or no longer a folder (a link, a pipe): not entered
                held.append(fd)
                try:
                    folder = _Folder(parent.path / name, parent.depth + 1, fd, *_list_folder(fd))
                except OSError:
                    os.close(held.pop())  # unreadable, like a folder that went away
    finally:
        for fd in held:
            os.close(fd)


def _list_folder(fd: int) -> tuple[list[str], list[str]]:
    """The names in the folder open as `fd`: its subfolders and everything else, as
    `os.fwalk` sorts them (a link to a folder counts as a folder, and is never entered)."""
    dirs: list[str] = []
    files: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False  # a link whose target cannot be looked at (a loop, say)
            (dirs if is_dir else files).append(entry.name)
    return dirs, files


def _names_a_symlink(path: str) -> bool:
    """Whether the last component of `path` is a symbolic link, with the folders before
    it resolved the way `Workspace.resolve` resolves them: `nosuchdir/../link` and
    `link/` name the link too (checked as written, they would not)."""
    path = path.rstrip("/") or "/"
    folder, name = os.path.split(path)
    if name in ("", ".", ".."):
        return False  # a folder, which remove_file refuses anyway
    try:
        last = os.path.join(os.path.realpath(folder), name)
    except OSError:
        # A folder on the way changed while it was resolved. Workspace.remove, which
        # never follows the last name, still refuses a link, race-free.
        return False
    return os.path.islink(last)


def _read_window(ws: Workspace, target: Path, offset: int, limit: int) -> str:
    """Lines `offset` .. `offset + limit - 1` of a text file, numbered like `cat -n`."""
    try:
        # Opened once, race-free: everything below reads this one file.
        raw = ws.open_read(target)
    except FileNotFoundError:
        raise ToolError("no such file", retryable=False) from None
    except IsADirectoryError:
        raise ToolError("is a folder; list it with find_files", retryable=False) from None
    except NotARegularFile:
        # Opening a FIFO would wait for a writer forever.
        raise ToolError("not a regular file (a pipe, socket or device)", retryable=False) from None
    except OSError as exc:
        raise ToolError(f"cannot read: {exc.strerror or exc}", retryable=False) from exc
    with raw:
        try:
            head = raw.read(_BINARY_SNIFF_BYTES)
            size = os.fstat(raw.fileno()).st_size
            raw.seek(0)
        except OSError as exc:
            raise ToolError(f"cannot read: {exc.strerror or exc}", retryable=False) from exc
        if b"\x00" in head:
            return f"[binary file, {size} bytes; not shown]"
        if size == 0:
            return "[empty file]"
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")
        try:
            return _numbered_lines(text, offset, limit)
        finally:
            text.detach()  # `raw` is closed by its own `with`


def _numbered_lines(text: TextIO, offset: int, limit: int) -> str:
    out: list[str] = []
    more = False
    number = 0
    # Lines are read in bounded pieces: a file of one 300 MB line must not be read
    # into memory whole to show its first characters.
    while piece := text.readline(_MAX_LINE_CHARS + 1):
        number += 1
        long_line = not piece.endswith(("\n", "\r"))
        if long_line:
            _skip_rest_of_line(text)
        if number < offset:
            continue
        if len(out) == limit:
            more = True
            break
        line = piece.rstrip("\r\n")
        if len(line) > _MAX_LINE_CHARS:
            line = line[:_MAX_LINE_CHARS] + f" [line cut at {_MAX_LINE_CHARS} characters]"
        out.append(f"{number:6}\t{line}")
    if not out:
        return f"[the file has fewer than {offset} lines]"
    if more:
        out.append(f"[more lines follow: read again with offset={offset + limit}]")
    return "\n".join(out)


def _skip_rest_of_line(text: TextIO) -> None:
    while (rest := text.readline(65536)) and not rest.endswith(("\n", "\r")):
        pass


def _text_for_edit(data: bytes, rel: str) -> str:
    if b"\x00" in data[:_BINARY_SNIFF_BYTES]:
        raise ToolError(f"{rel!r} is a binary file; edit_file edits text", retryable=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolError(
            f"{rel!r} is not UTF-8 text (byte {exc.start}); edit_file edits UTF-8 files",
            retryable=False,
        ) from exc


@attrs.frozen
class _Edit:
    """What edit_file makes of a file: the new content, the action to log, the report."""

    content: bytes
    action: ChangeAction
    report: str


def _plan_edit(current: bytes | None, old: str, new: str, replace_all: bool, rel: str) -> _Edit:
    """The edit of the file `rel`, whose content is `current` (None: no such file)."""
    if current is None:
        if old:
            raise ToolError(
                f"no such file: {rel!r} (to create it, pass an empty old_string)",
                retryable=False,
            )
        data = new.encode("utf-8")
        return _Edit(data, "create", f"created {rel} ({len(data)} bytes, {_count_lines(new)} lines)")
    text = _text_for_edit(current, rel)
    if not old:
        if text:
            raise ToolError(
                f"{rel!r} already exists and is not empty: old_string must quote the text to replace",
                retryable=False,
            )
        return _Edit(
            new.encode("utf-8"), "edit", f"wrote {rel} (it was empty; now {_count_lines(new)} lines)"
        )
    if old == new:
        raise ToolError("old_string and new_string are the same: nothing to change", retryable=False)
    count = text.count(old)
    if count == 0 and "\r\n" in text and "\n" in old:
        # The file uses CRLF line ends; the model wrote LF. Match in the file's style.
        old, new = _crlf(old), _crlf(new)
        count = text.count(old)
    if count == 0:
        raise ToolError(
            f"old_string was not found in {rel!r}; read the file and quote it exactly "
            "(whitespace and indentation included)",
            retryable=False,
        )
    if count > 1 and not replace_all:
        raise ToolError(
            f"old_string occurs {count} times in {rel!r}; add surrounding lines to "
            "make it unique, or set replace_all",
            retryable=False,
        )
    first_at = text.index(old)
    updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
    replaced = count if replace_all else 1
    report = f"edited {rel}: replaced {replaced} occurrence(s)\n" + _snippet(updated, first_at, len(new))
    return _Edit(updated.encode("utf-8"), "edit", report)


def _crlf(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\n", "\r\n")


def _count_lines(text: str) -> int:
    return text.count("\n") + (0 if text.endswith("\n") or not text else 1)


def _snippet(text: str, start: int, length: int) -> str:
    """The lines around the first replacement, numbered, so the model sees the result."""
    lines = text.splitlines()
    first = text.count("\n", 0, start)
    last = first + text.count("\n", start, start + length)
    lo = max(0, first - 2)
    hi = min(len(lines), max(last + 3, lo + 1), lo + _SNIPPET_LINES)
    shown = [f"{n + 1:6}\t{lines[n]}" for n in range(lo, hi)]
    return "\n".join(shown)


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _render_change(c: Change) -> str:
    before = "absent" if c.size_before is None else f"{c.size_before} B"
    after = "absent" if c.size_after is None else f"{c.size_after} B"
    by = f" (session {c.session_id}, call {c.call_id})" if c.session_id else ""
    return f"#{c.seq} {_when(c.at)} {c.action} {c.path}: {before} -> {after}{by}"


class _IgnoreRules:
    """The .gitignore files that apply in one folder, nearest last."""

    def __init__(self, specs: tuple[tuple[Path, pathspec.GitIgnoreSpec], ...] = ()) -> None:
        self.specs = specs

    def ignores(self, path: Path, *, is_dir: bool) -> bool:
        """Whether git would ignore `path`: the nearest .gitignore with a matching line
        decides, and within one file the last matching line (`!` negates)."""
        for folder, spec in reversed(self.specs):
            rel = path.relative_to(folder).as_posix() + ("/" if is_dir else "")
            include = spec.check_file(rel).include
            if include is not None:
                return include
        return False


class _GitIgnores:
    """The .gitignore files a walk from `base` meets, from the workspace root down.

    A folder git ignores is not entered, so nothing under it can be brought back by a
    negation further down, as in git. Each folder's rules are its parent's plus its own
    .gitignore, handed down as the walk goes (top-down), so every file is read once.
    Every .gitignore is opened from its folder's descriptor, never by path: a folder
    swapped for a symbolic link after the walk opened it cannot lead to an outside one.
    """

    def __init__(self, ws: Workspace, base: Path) -> None:
        self._pending: dict[Path, _IgnoreRules] = {base: _IgnoreRules(_gitignores_above(ws, base))}

    def enter(self, folder: Path, folder_fd: int, has_gitignore: bool) -> _IgnoreRules:
        """The rules in `folder` (open as `folder_fd`), whose listing has a .gitignore or not."""
        rules = self._pending.pop(folder, None) or _IgnoreRules()
        spec = _read_gitignore(folder_fd) if has_gitignore else None
        return _IgnoreRules((*rules.specs, (folder, spec))) if spec is not None else rules

    def hand_down(self, folder: Path, subfolders: list[str], rules: _IgnoreRules) -> None:
        for name in subfolders:
            self._pending[folder / name] = rules


def _gitignores_above(ws: Workspace, base: Path) -> tuple[tuple[Path, pathspec.GitIgnoreSpec], ...]:
    """The rules of the .gitignore files in the folders above `base`, root first.

    The folders are opened from the workspace root's descriptor down, each from the one
    before with O_NOFOLLOW, as the walk below `base` opens its folders: one swapped for a
    symbolic link on the way fails the call (retryably) instead of being followed.
    """
    if base == ws.root:
        return ()
    specs: list[tuple[Path, pathspec.GitIgnoreSpec]] = []
    folder = ws.root
    fd = ws.open_folder(folder)
    try:
        for name in base.relative_to(ws.root).parts:
            spec = _read_gitignore(fd)
            if spec is not None:
                specs.append((folder, spec))
            if folder / name == base:
                break
            try:
                below = os.open(name, _FOLDER_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise ToolError(
                    f"folder {ws.relative(folder / name)!r} changed while find_files looked "
                    f"at it ({exc.strerror or exc}); try again",
                    retryable=True,
                ) from exc
            os.close(fd)
            fd, folder = below, folder / name
    finally:
        os.close(fd)
    return tuple(specs)


def _read_gitignore(folder_fd: int) -> pathspec.GitIgnoreSpec | None:
    """The rules of the .gitignore in the folder open as `folder_fd`, or None when there is
    no such regular file (a symlink is not followed: it could name a file outside the
    workspace; a pipe is not opened: it would wait for a writer)."""
    try:
        with os.fdopen(_safepath.open_regular(folder_fd, _GITIGNORE), "rb") as file:
            data = file.read(_MAX_GITIGNORE_BYTES)
    except OSError:
        return None
    return pathspec.GitIgnoreSpec.from_lines(data.decode("utf-8", errors="replace").splitlines())


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob over '/'-separated relative paths.

    `*` and `?` never cross a '/', `[...]` is a character class (`[!...]` negated),
    and a `**` segment matches any number of folders, none included. Names starting
    with '.' match like any other. Raises ToolError for an absolute pattern, `..` or
    a malformed class.

    The regex matches in time polynomial in the path's length, whatever the pattern:
    a plain translation (`*a*a*a*b` to `[^/]*a[^/]*a[^/]*a[^/]*b`) backtracks through
    every way to split a name between the stars, exponential in their number, and
    the regex engine holds the GIL (and so the event loop) meanwhile. Between two
    stars, the text in between has a fixed length, so its leftmost occurrence is as
    good as any later one: an atomic group `(?>[^/]*?text)` takes it and never comes
    back. Only the last star of a name, which must reach the name's end, backtracks.
    `**` segments work the same way over whole folders.
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise ToolError(f"a glob pattern must be a non-empty string, got {pattern!r}", retryable=False)
    if pattern.startswith("/") or os.path.isabs(pattern):
        raise ToolError(f"the pattern must be relative to `path`, got {pattern!r}", retryable=False)
    segments = [s for s in pattern.split("/") if s not in ("", ".")]
    if ".." in segments:
        raise ToolError(f"the pattern may not contain '..', got {pattern!r}", retryable=False)
    if not segments:
        raise ToolError(f"the pattern matches nothing, got {pattern!r}", retryable=False)
    # `**/**` means what `**` means.
    segments = [s for i, s in enumerate(segments) if not (s == "**" and segments[i - 1 : i] == ["**"])]
    out: list[str] = []
    i = 0
    while i < len(segments):
        segment = segments[i]
        last = i == len(segments) - 1
        if segment != "**":
            out.append(_translate_segment(segment) + ("" if last else "/"))
        elif last:
            out.append(".*")
        elif "**" in segments[i + 1 :]:
            # Folders up to the leftmost place where the segments before the next `**` match.
            upto = segments.index("**", i + 1)
            middle = "".join(_translate_segment(s) + "/" for s in segments[i + 1 : upto])
            out.append(f"(?>(?:[^/]+/)*?{middle})")
            i = upto
            continue
        else:
            out.append("(?:[^/]+/)*")
        i += 1
    try:
        return re.compile("".join(out), re.DOTALL)
    except re.error as exc:
        raise ToolError(f"not a valid glob pattern: {pattern!r} ({exc})", retryable=False) from exc


def _translate_segment(segment: str) -> str:
    """A regex for one name; see glob_to_regex for why stars become atomic groups."""
    chunks: list[list[str]] = [[]]  # the single-character matchers between stars
    i = 0
    while i < len(segment):
        ch = segment[i]
        if ch == "*":
            chunks.append([])
        elif ch == "?":
            chunks[-1].append("[^/]")
        elif ch == "[":
            j = i + 1
            if segment[j : j + 1] == "!":
                j += 1
            if segment[j : j + 1] == "]":  # a ']' first is a member, not the end
                j += 1
            end = segment.find("]", j)
            if end == -1:
                chunks[-1].append(re.escape(ch))
            else:
                body = segment[i + 1 : end]
                negate = body.startswith("!")
                if negate:
                    body = body[1:]
                # Escape all but '-' so ranges work and nothing reads as a nested set.
                members = "".join(c if c == "-" else re.escape(c) for c in body)
                # A negated class matches no '/' either: it stands for one character of a name.
                chunks[-1].append(f"[^/{members}]" if negate else f"[{members}]")
                i = end
        else:
            chunks[-1].append(re.escape(ch))
        i += 1
    first, *between, final = ["".join(chunk) for chunk in chunks] + [""] * (len(chunks) == 1)
    if len(chunks) == 1:
        return first  # no star
    middle = "".join(f"(?>[^/]*?{text})" for text in between if text)
    return f"{first}{middle}[^/]*{final}"


# -- schemas ---------------------------------------------------------------------

_READ_FILES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "paths": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": 50,
            "description": "Files to read, relative to the workspace.",
        },
        "offset": {
            "type": "integer",
            "minimum": 1,
            "description": "First line to show (1-based). Default 1.",
        },
        "limit": {
            "type": "integer",
            "minimum": 1,
            "maximum": 10_000,
            "description": f"How many lines to show from each file. Default {_DEFAULT_LIMIT}.",
        },
    },
    "required": ["paths"],
    "additionalProperties": False,
}

_FIND_FILES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "pattern": {
            "type": "string",
            "minLength": 1,
            "description": "Glob relative to `path`, e.g. '**/*.py' or 'src/*.md'.",
        },
        "path": {
            "type": "string",
            "default": ".",
            "description": "Folder to search from, relative to the workspace.",
        },
        "include_ignored": {
            "type": "boolean",
            "default": False,
            "description": "Also list what .gitignore files ignore.",
        },
    },
    "required": ["pattern"],
    "additionalProperties": False,
}

_EDIT_FILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 1, "description": "File, relative to the workspace."},
        "old_string": {
            "type": "string",
            "description": "Exact text to replace; empty to create a new file.",
        },
        "new_string": {"type": "string", "description": "The replacement text."},
        "replace_all": {
            "type": "boolean",
            "default": False,
            "description": "Replace every occurrence instead of exactly one.",
        },
    },
    "required": ["path", "old_string", "new_string"],
    "additionalProperties": False,
}

_PATH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 1, "description": "File, relative to the workspace."},
    },
    "required": ["path"],
    "additionalProperties": False,
}

_FILE_HISTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {
            "type": "string",
            "description": "A file or folder to limit the history to; all changes if omitted.",
        },
    },
    "additionalProperties": False,
}
