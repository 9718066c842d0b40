"""`Workspace`: the folder a tool set is bound to.

It does two things every file-touching tool relies on:

- confinement: `resolve` turns a path a model wrote into an absolute path inside the
  workspace, or raises `ToolError` naming it (`..`, a symbolic link or an absolute
  path that leads outside);
- restorability: every change made through the tools (`edit_file`, `remove_file`,
  `download_file`, `write_result`) goes through `write` / `remove` / `install`, which
  keep the previous content in memory so `restore_file` can put it back, and log
  the change for `file_history`.

The backups belong to the workspace object, not to a session: every session of a
registry sees the same files, so it sees the same history. Methods are thread-safe
(sync handlers run in worker threads, sessions run side by side). Nothing from trio,
httpx or the dispatcher's passes may be imported here.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import attrs
import xxhash

from dispatcher._exceptions import ToolError

__all__ = ["Change", "ChangeAction", "Workspace", "content_digest", "staging_path", "unique"]

ChangeAction = Literal["create", "edit", "remove", "restore", "download", "write"]

_MIB = 1024 * 1024


def content_digest(data: bytes) -> str:
    """The digest a change remembers of the content it left behind."""
    return xxhash.xxh3_128_hexdigest(data)


@attrs.frozen
class Change:
    """One change made through the file tools, as `file_history` shows it."""

    seq: int
    path: str  # relative to the workspace, with '/' separators
    action: ChangeAction
    at: float  # wall-clock UTC seconds
    session_id: str | None
    call_id: str | None
    size_before: int | None  # None: the file did not exist
    size_after: int | None  # None: the change removed it


@attrs.define
class _Revision:
    """What one change replaced, kept so it can be put back."""

    change: Change
    previous: bytes | None  # None: the file did not exist before the change
    previous_mode: int | None  # its permission bits (st_mode & 0o7777), put back with it
    after_digest: str | None  # digest of what the change left; None: it removed the file


class Workspace:
    """A folder the tools are confined to, with an undo stack per file.

    `max_backup_file_bytes` bounds a single kept version (a file larger than that is
    not edited, removed or overwritten, since it could not be restored);
    `max_backup_bytes` bounds all kept versions together, oldest dropped first.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_backup_file_bytes: int = 10 * _MIB,
        max_backup_bytes: int = 64 * _MIB,
        max_revisions_per_file: int = 20,
        max_log_entries: int = 1000,
    ) -> None:
        resolved = Path(os.path.realpath(os.fspath(root)))
        if not resolved.is_dir():
            raise NotADirectoryError(f"a workspace must be an existing folder, got {os.fspath(root)!r}")
        self.root = resolved
        self.max_backup_file_bytes = max_backup_file_bytes
        self.max_backup_bytes = max_backup_bytes
        self.max_revisions_per_file = max_revisions_per_file
        # Reentrant: edit_file holds it across its read-modify-write and calls `write`.
        self.lock = threading.RLock()
        self._revisions: dict[Path, list[_Revision]] = {}
        self._backup_bytes = 0
        self._log: collections.deque[Change] = collections.deque(maxlen=max_log_entries)
        self._seq = 0

    # -- confinement ----------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The absolute, symlink-free path `path` names inside the workspace.

        Relative paths are taken from the workspace root. Raises ToolError (not
        retryable) naming `path` if it leads outside.
        """
        if not isinstance(path, str) or not path.strip():
            raise ToolError(f"a path must be a non-empty string, got {path!r}", retryable=False)
        if "\x00" in path:
            raise ToolError(f"a path may not contain a NUL character, got {path!r}", retryable=False)
        candidate = Path(path) if os.path.isabs(path) else self.root / path
        try:
            resolved = Path(os.path.realpath(candidate))
        except (OSError, ValueError) as exc:  # a symlink loop, an over-long name
            raise ToolError(f"cannot resolve path {path!r}: {exc}", retryable=False) from exc
        if resolved != self.root and self.root not in resolved.parents:
            raise ToolError(
                f"path {path!r} is outside the workspace {str(self.root)!r}", retryable=False
            )
        return resolved

    def key(self, path: object) -> str:
        """The resource key (`file:/abs/path`) of `path`; never raises.

        A path that does not resolve inside the workspace still gets a key (its plain
        normalised form): the call will fail when it runs, and pass 1 must not.
        """
        if not isinstance(path, str) or not path.strip():
            return f"file:{self.root}"
        try:
            return f"file:{self.resolve(path)}"
        except ToolError:
            joined = path if os.path.isabs(path) else os.path.join(self.root, path)
            return f"file:{os.path.normpath(joined)}"

    def check_writable(self, target: Path) -> None:
        """Refuse a resolved `target` inside a `.git` folder (or a `.git` file itself).

        git runs programs its config names (hooks, fsmonitor, filters, diff drivers),
        and `git status`/`git diff` run without confirmation: a file tool that wrote
        there would let a model choose what they run. Changes to git's own files go
        through run_command, which asks first. Case-insensitive, as some file systems are.
        """
        try:
            parts = target.relative_to(self.root).parts
        except ValueError:
            return  # outside: `resolve` has already refused it
        if any(part.lower() == ".git" for part in parts):
            raise ToolError(
                f"{self.relative(target)!r} is inside a .git folder, which the file tools "
                "do not change (git runs programs named there); use run_command, "
                "which asks for confirmation",
                retryable=False,
            )

    def relative(self, path: Path) -> str:
        """`path` as shown to a model: relative to the root, '/'-separated ('.' for the root)."""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return str(path)
        return rel.as_posix() if rel.parts else "."

    # -- changes --------------------------------------------------------------

    def write(
        self,
        target: Path,
        content: bytes,
        *,
        action: ChangeAction,
        session_id: str | None = None,
        call_id: str | None = None,
    ) -> Change:
        """Replace (or create) the file at `target` with `content`, keeping what was there."""
        self.check_writable(target)
        with self.lock:
            previous = self._read_for_backup(target)
            mode = _mode(target)
            _atomic_write(target, content)
            return self._record(
                target, previous, mode, content_digest(content), len(content), action,
                session_id, call_id,
            )  # fmt: skip

    def install(
        self,
        target: Path,
        staged: Path,
        *,
        digest: str,
        size: int,
        action: ChangeAction,
        session_id: str | None = None,
        call_id: str | None = None,
    ) -> Change:
        """Move the already-written file `staged` (same folder) onto `target`, keeping
        what was there. `staged` is removed if the move is refused."""
        with self.lock:
            try:
                self.check_writable(target)
                previous = self._read_for_backup(target)
                mode = _mode(target)
                os.replace(staged, target)
            except BaseException:
                staged.unlink(missing_ok=True)
                raise
            return self._record(
                target, previous, mode, digest, size, action, session_id, call_id
            )

    def remove(
        self, target: Path, *, session_id: str | None = None, call_id: str | None = None
    ) -> Change:
        """Delete the regular file at `target`, keeping its content."""
        self.check_writable(target)
        with self.lock:
            previous = self._read_for_backup(target)
            if previous is None:
                raise ToolError(f"no such file: {self.relative(target)!r}", retryable=False)
            mode = _mode(target)
            target.unlink()
            return self._record(
                target, previous, mode, None, None, "remove", session_id, call_id
            )

    def restore(
        self, target: Path, *, session_id: str | None = None, call_id: str | None = None
    ) -> tuple[Change, Change]:
        """Undo the last change made through the tools to `target`.

        Returns (the change undone, the restore itself); called again, it steps further back.
        Refuses if the file was changed by other means since (restoring would lose
        those changes without a trace).
        """
        rel = self.relative(target)
        self.check_writable(target)
        with self.lock:
            stack = self._revisions.get(target)
            if not stack:
                raise ToolError(
                    f"no earlier version of {rel!r} is kept: only changes made through "
                    "edit_file, remove_file, download_file or write_result can be restored",
                    retryable=False,
                )
            revision = stack[-1]
            current = _read_current(target)
            current_digest = None if current is None else content_digest(current)
            if current_digest != revision.after_digest:
                raise ToolError(
                    f"{rel!r} changed by other means since its last change through the file "
                    "tools; restoring would discard that. Read it and edit it instead",
                    retryable=False,
                )
            # The file first: if that fails, the version is still kept.
            if revision.previous is None:
                target.unlink(missing_ok=True)
            else:
                _atomic_write(target, revision.previous)
                if revision.previous_mode is not None:
                    os.chmod(target, revision.previous_mode)
                self._backup_bytes -= len(revision.previous)
            stack.pop()
            if not stack:
                del self._revisions[target]
            change = self._log_change(
                target,
                "restore",
                None if current is None else len(current),
                None if revision.previous is None else len(revision.previous),
                session_id,
                call_id,
            )
        return revision.change, change

    def history(self, under: Path | None = None) -> list[Change]:
        """Changes made through the tools, oldest first, to `under` or anything below it."""
        with self.lock:
            changes = list(self._log)
        if under is None or under == self.root:
            return changes
        prefix = self.relative(under)
        return [c for c in changes if c.path == prefix or c.path.startswith(prefix + "/")]

    def restorable(self, target: Path) -> int:
        """How many earlier versions of `target` `restore_file` can step back through."""
        with self.lock:
            return len(self._revisions.get(target, ()))

    # -- internals ------------------------------------------------------------

    def _read_for_backup(self, target: Path) -> bytes | None:
        rel = self.relative(target)
        if target.is_dir():
            raise ToolError(f"{rel!r} is a folder, not a file", retryable=False)
        if not target.exists():
            return None
        if not target.is_file():
            raise ToolError(f"{rel!r} is not a regular file", retryable=False)
        size = target.stat().st_size
        if size > self.max_backup_file_bytes:
            raise ToolError(
                f"{rel!r} is {size} bytes, over the {self.max_backup_file_bytes}-byte limit "
                "of what the file tools keep to restore; change it with run_command instead",
                retryable=False,
            )
        return target.read_bytes()

    def _record(
        self,
        target: Path,
        previous: bytes | None,
        previous_mode: int | None,
        after_digest: str | None,
        size_after: int | None,
        action: ChangeAction,
        session_id: str | None,
        call_id: str | None,
    ) -> Change:
        size_before = None if previous is None else len(previous)
        change = self._log_change(target, action, size_before, size_after, session_id, call_id)
        stack = self._revisions.setdefault(target, [])
        stack.append(_Revision(change, previous, previous_mode, after_digest))
        if previous is not None:
            self._backup_bytes += len(previous)
        while len(stack) > self.max_revisions_per_file:
            self._forget(stack, 0)
        self._trim_to_budget()
        return change

    def _log_change(
        self,
        target: Path,
        action: ChangeAction,
        size_before: int | None,
        size_after: int | None,
        session_id: str | None,
        call_id: str | None,
    ) -> Change:
        self._seq += 1
        change = Change(
            seq=self._seq,
            path=self.relative(target),
            action=action,
            at=time.time(),
            session_id=session_id,
            call_id=call_id,
            size_before=size_before,
            size_after=size_after,
        )
        self._log.append(change)
        return change

    def _forget(self, stack: list[_Revision], index: int) -> None:
        dropped = stack.pop(index)
        if dropped.previous is not None:
            self._backup_bytes -= len(dropped.previous)

    def _trim_to_budget(self) -> None:
        # The oldest kept versions go first, whichever file they belong to.
        while self._backup_bytes > self.max_backup_bytes:
            oldest = min(
                (stack[0].change.seq, path) for path, stack in self._revisions.items() if stack
            )
            stack = self._revisions[oldest[1]]
            self._forget(stack, 0)
            if not stack:
                del self._revisions[oldest[1]]

    def kept_bytes(self) -> int:
        """Bytes of earlier versions held in memory."""
        with self.lock:
            return self._backup_bytes


def _mode(target: Path) -> int | None:
    """The permission bits of the file at `target`; None if there is none."""
    try:
        return target.stat().st_mode & 0o7777
    except FileNotFoundError:
        return None


def _read_current(target: Path) -> bytes | None:
    try:
        return target.read_bytes()
    except FileNotFoundError:
        return None


def _atomic_write(target: Path, content: bytes) -> None:
    """Write `content` to `target` so a reader sees the old file or the new one, never half.

    A new file gets the usual permissions (0o666 less the umask); a replaced one keeps its own.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(target)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        if target.exists():
            os.chmod(staged, target.stat().st_mode & 0o7777)
        os.replace(staged, target)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def staging_path(target: Path) -> Path:
    """A fresh hidden name beside `target` to write into before moving it in place.

    Short whatever `target` is called: a name near the 255-byte limit has no room
    for a prefix and a suffix, and a long-named file could not be edited or restored.
    """
    return target.with_name(f".tp-{uuid.uuid4().hex[:16]}.partial")


def unique(items: Iterable[str]) -> list[str]:
    """`items` without repeats, first occurrence kept."""
    return list(dict.fromkeys(items))
