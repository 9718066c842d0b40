"""`Workspace`: the folder a tool set is bound to.

It does two things every file-touching tool relies on:

- confinement: `resolve` turns a path a model wrote into an absolute path inside the
  workspace, or raises `ToolError` naming it (`..`, a symbolic link or an absolute
  path that leads outside). That is the check; the use is race-free: every read and
  write walks the path again from a descriptor of the workspace folder, one name at a
  time with `O_NOFOLLOW` (`_safepath`), so a folder swapped for a symbolic link after
  the check is met as the link, and followed only if it points inside. Writes create
  a new file and rename it over the name: a hardlink to a file elsewhere is replaced,
  never written through (it is read as the file it is);
- restorability: every change made through the tools (`edit_file`, `remove_file`,
  `download_file`, `write_result`) goes through `update` / `write` / `remove` /
  `install`, which keep the previous content in memory so `restore_file` can put it
  back, and log the change for `file_history`.

The backups belong to the workspace object, not to a session: every session of a
registry sees the same files, so it sees the same history. Methods are thread-safe
(sync handlers run in worker threads, sessions run side by side). Nothing from trio,
httpx or the dispatcher's passes may be imported here.
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import attrs
import xxhash

from dispatcher._exceptions import ToolError

from . import _safepath

__all__ = ["Change", "ChangeAction", "Staged", "Workspace", "content_digest", "unique"]

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


@attrs.frozen
class _Current:
    """A file as read before a change: what a revision keeps of it."""

    data: bytes
    mode: int  # st_mode & 0o7777
    identity: tuple[int, int]  # (st_dev, st_ino) of the file read


@attrs.define
class Staged:
    """A download being written beside its target: a new hidden file, in a folder held
    open. Write to `file`, then hand it to `Workspace.install`, or `discard` it."""

    file: BinaryIO
    dir_fd: int
    name: str
    _done: bool = False

    def discard(self) -> None:
        """Close and remove the staged file; nothing once installed or discarded."""
        if self._done:
            return
        self._done = True
        try:
            self.file.close()
            _safepath.unlink(self.dir_fd, self.name, missing_ok=True)
        finally:
            os.close(self.dir_fd)

    def _installed(self) -> None:
        # Its name now belongs to the target: only the folder is let go.
        self._done = True
        os.close(self.dir_fd)


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
        # Held for the workspace's life: every path is walked from it. (Replacing the
        # root folder itself is its operator's business.)
        self._tree = _safepath.Root(str(resolved))
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
            raise ToolError(f"path {path!r} is outside the workspace {str(self.root)!r}", retryable=False)
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
        _refuse_git(parts)

    def relative(self, path: Path) -> str:
        """`path` as shown to a model: relative to the root, '/'-separated ('.' for the root)."""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return str(path)
        return rel.as_posix() if rel.parts else "."

    # -- reading --------------------------------------------------------------

    def open_read(self, target: Path) -> BinaryIO:
        """The regular file at `target`, open for reading, reached race-free.

        A hardlink is read as the file it is, whatever other names it has. Raises
        FileNotFoundError, IsADirectoryError, `_safepath.NotARegularFile` (a pipe, socket
        or device is not opened) or another OSError, and ToolError for a path that leads
        outside.
        """
        fd, _ = _safepath.open_file_read(self._tree, self._parts(target), shown=self.relative(target))
        return os.fdopen(fd, "rb")

    def open_folder(self, target: Path) -> int:
        """A descriptor of the folder at `target`, reached race-free; the caller closes it.

        Raises FileNotFoundError or NotADirectoryError, and ToolError for a path that
        leads outside.
        """
        return _safepath.open_dir(self._tree, self._parts(target), shown=self.relative(target))

    # -- changes --------------------------------------------------------------

    def update(
        self,
        target: Path,
        change: Callable[[bytes | None], tuple[bytes, ChangeAction]],
        *,
        session_id: str | None = None,
        call_id: str | None = None,
    ) -> Change:
        """Replace (or create) the file at `target` with what `change` makes of it, keeping
        what was there.

        `change` gets the file's content (None: there is no such file) and returns the new
        content and the action to log, or raises ToolError to change nothing. Reading,
        deciding and writing are one step, under the lock and in one folder held open:
        the file replaced is the one `change` saw. Missing folders are made only when
        there is something to write.
        """
        rel = self.relative(target)
        self.check_writable(target)
        with self.lock, _os_errors("write", rel):
            place = self._find(target)
            try:
                previous = None if place is None else self._read(place, self.max_backup_file_bytes)
                content, action = change(None if previous is None else previous.data)
                if place is None:
                    place = self._locate(target, create=True)
                    if place.stat is not None:
                        raise ToolError(
                            f"{rel!r} appeared while it was being created; try again", retryable=True
                        )
                mode = None if previous is None else previous.mode
                _safepath.write_atomic(place.dir_fd, place.name, content, mode)
            finally:
                if place is not None:
                    place.close()
            return self._record(
                self._real(place), previous, content_digest(content), len(content), action,
                session_id, call_id,
            )  # fmt: skip

    def write(
        self,
        target: Path,
        content: bytes,
        *,
        action: ChangeAction,
        session_id: str | None = None,
        call_id: str | None = None,
    ) -> Change:
        """Replace (or create) the file at `target` with `content`, keeping what was there.

        A new file gets the usual permissions (0o666 less the umask); a replaced one keeps
        its own.
        """
        return self.update(target, lambda _: (content, action), session_id=session_id, call_id=call_id)

    def stage(self, target: Path) -> Staged:
        """A new hidden file beside `target` (its folders made) to write a download into,
        for `install` to move in place."""
        rel = self.relative(target)
        self.check_writable(target)
        with _os_errors("write", rel):
            place = self._locate(target, create=True)
            try:
                if place.stat is not None and stat.S_ISDIR(place.stat.st_mode):
                    raise ToolError(f"{rel!r} is a folder, not a file", retryable=False)
                fd, name = _safepath.create_temp(place.dir_fd)
            except BaseException:
                place.close()
                raise
        return Staged(os.fdopen(fd, "wb"), place.dir_fd, name)

    def install(
        self,
        target: Path,
        staged: Staged,
        *,
        digest: str,
        size: int,
        action: ChangeAction,
        session_id: str | None = None,
        call_id: str | None = None,
    ) -> Change:
        """Move the written file `staged` onto `target` (walked again: it is where the path
        leads now), keeping what was there. `staged` is discarded if the move is refused."""
        rel = self.relative(target)
        with self.lock:
            try:
                self.check_writable(target)
                with _os_errors("write", rel):
                    staged.file.close()
                    with self._locate(target, create=True) as place:
                        previous = self._read(place, self.max_backup_file_bytes)
                        os.replace(staged.name, place.name, src_dir_fd=staged.dir_fd, dst_dir_fd=place.dir_fd)
            except BaseException:
                staged.discard()
                raise
            staged._installed()
            return self._record(self._real(place), previous, digest, size, action, session_id, call_id)

    def remove(self, target: Path, *, session_id: str | None = None, call_id: str | None = None) -> Change:
        """Delete the regular file at `target`, keeping its content."""
        rel = self.relative(target)
        self.check_writable(target)
        with self.lock, _os_errors("remove", rel):
            place = self._find(target, follow_last=False)
            if place is None:
                raise ToolError(f"no such file: {rel!r}", retryable=False)
            with place:
                previous = self._read(place, self.max_backup_file_bytes)
                if previous is None:
                    raise ToolError(f"no such file: {rel!r}", retryable=False)
                now = _safepath.stat(place.dir_fd, place.name)
                if now is None or (now.st_dev, now.st_ino) != previous.identity:
                    raise ToolError(f"{rel!r} changed while it was being removed; try again",
                                    retryable=True)  # fmt: skip
                _safepath.unlink(place.dir_fd, place.name)
            return self._record(self._real(place), previous, None, None, "remove", session_id, call_id)

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
            with _os_errors("restore", rel):
                place = self._find(target)
                try:
                    current = None
                    if place is not None and place.stat is not None:
                        # Another size is another content: no need to read it (it may be huge).
                        if place.stat.st_size != revision.change.size_after:
                            raise _changed_since(rel)
                        current = self._read(place, None)
                    current_digest = None if current is None else content_digest(current.data)
                    if current_digest != revision.after_digest:
                        raise _changed_since(rel)
                    # The file first: if that fails, the version is still kept.
                    if revision.previous is None:
                        if place is not None:
                            _safepath.unlink(place.dir_fd, place.name, missing_ok=True)
                    else:
                        if place is None:
                            place = self._locate(target, create=True)
                        _safepath.write_atomic(
                            place.dir_fd, place.name, revision.previous, revision.previous_mode
                        )
                finally:
                    if place is not None:
                        place.close()
            if revision.previous is not None:
                self._backup_bytes -= len(revision.previous)
            stack.pop()
            if not stack:
                del self._revisions[target]
            change = self._log_change(
                target,
                "restore",
                None if current is None else len(current.data),
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

    def _parts(self, target: Path) -> tuple[str, ...]:
        try:
            return target.relative_to(self.root).parts
        except ValueError:
            raise ToolError(
                f"path {str(target)!r} is outside the workspace {str(self.root)!r}", retryable=False
            ) from None

    def _real(self, place: _safepath.Place) -> Path:
        return self.root.joinpath(*place.parts)

    def _locate(self, target: Path, *, create: bool, follow_last: bool = True) -> _safepath.Place:
        """Where `target` is now, walked race-free, to change it.

        `target` is resolved (no links in it), so a link met on the way was swapped in
        since: even one that points inside is refused here, as a change must land on
        the file its call declared it writes (what it invalidates). The .git rule is
        checked first on where the walk went.
        """
        parts = self._parts(target)
        place = _safepath.locate(
            self._tree, parts, shown=self.relative(target), create=create, follow_last=follow_last
        )
        try:
            _refuse_git(place.parts)
            if place.parts != parts:
                raise ToolError(
                    f"{self.relative(target)!r} now leads through a symbolic link to "
                    f"{'/'.join(place.parts)!r}, not the file this call was checked for; try again",
                    retryable=True,
                )
        except BaseException:
            place.close()
            raise
        return place

    def _find(self, target: Path, *, follow_last: bool = True) -> _safepath.Place | None:
        """`_locate` without making folders: None if a folder on the way does not exist."""
        try:
            return self._locate(target, create=False, follow_last=follow_last)
        except FileNotFoundError:
            return None

    def _read(self, place: _safepath.Place, limit: int | None) -> _Current | None:
        """The regular file at `place` (None: nothing there), at most `limit` bytes."""
        rel = "/".join(place.parts)
        entry = place.stat
        if entry is None:
            return None
        if stat.S_ISDIR(entry.st_mode):
            raise ToolError(f"{rel!r} is a folder, not a file", retryable=False)
        if stat.S_ISLNK(entry.st_mode):
            raise ToolError(
                f"{rel!r} is a symbolic link; the file tools change regular files only",
                retryable=False,
            )
        if not stat.S_ISREG(entry.st_mode):
            raise ToolError(f"{rel!r} is not a regular file", retryable=False)
        self._check_size(rel, entry.st_size, limit)
        try:
            fd = _safepath.open_regular(place.dir_fd, place.name)
        except OSError as exc:
            # A regular file a moment ago: something swapped it since.
            raise ToolError(f"{rel!r} changed while it was being read; try again", retryable=True) from exc
        with os.fdopen(fd, "rb") as file:
            opened = os.fstat(file.fileno())
            self._check_size(rel, opened.st_size, limit)
            data = file.read() if limit is None else file.read(limit + 1)
        self._check_size(rel, len(data), limit)
        return _Current(data, opened.st_mode & 0o7777, (opened.st_dev, opened.st_ino))

    def _check_size(self, rel: str, size: int, limit: int | None) -> None:
        if limit is not None and size > limit:
            raise ToolError(
                f"{rel!r} is {size} bytes, over the {limit}-byte limit "
                "of what the file tools keep to restore; change it with run_command instead",
                retryable=False,
            )

    def _record(
        self,
        target: Path,
        previous: _Current | None,
        after_digest: str | None,
        size_after: int | None,
        action: ChangeAction,
        session_id: str | None,
        call_id: str | None,
    ) -> Change:
        data, mode = (None, None) if previous is None else (previous.data, previous.mode)
        size_before = None if data is None else len(data)
        change = self._log_change(target, action, size_before, size_after, session_id, call_id)
        stack = self._revisions.setdefault(target, [])
        stack.append(_Revision(change, data, mode, after_digest))
        if data is not None:
            self._backup_bytes += len(data)
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
            oldest = min((stack[0].change.seq, path) for path, stack in self._revisions.items() if stack)
            stack = self._revisions[oldest[1]]
            self._forget(stack, 0)
            if not stack:
                del self._revisions[oldest[1]]

    def kept_bytes(self) -> int:
        """Bytes of earlier versions held in memory."""
        with self.lock:
            return self._backup_bytes


def _refuse_git(parts: tuple[str, ...]) -> None:
    if any(part.lower() == ".git" for part in parts):
        raise ToolError(
            f"{'/'.join(parts)!r} is inside a .git folder, which the file tools "
            "do not change (git runs programs named there); use run_command, "
            "which asks for confirmation",
            retryable=False,
        )


def _changed_since(rel: str) -> ToolError:
    return ToolError(
        f"{rel!r} changed by other means since its last change through the file tools; "
        "restoring would discard that. Read it and edit it instead",
        retryable=False,
    )


@contextlib.contextmanager
def _os_errors(doing: str, rel: str) -> Iterator[None]:
    """The file system's errors as ToolErrors naming the file (a ToolError passes as it is)."""
    try:
        yield
    except IsADirectoryError:
        raise ToolError(f"{rel!r} is a folder, not a file", retryable=False) from None
    except NotADirectoryError as exc:
        raise ToolError(
            f"cannot {doing} {rel!r}: {exc.filename!r} is not a folder", retryable=False
        ) from None
    except OSError as exc:
        raise ToolError(f"cannot {doing} {rel!r}: {exc.strerror or exc}", retryable=False) from exc


def unique(items: Iterable[str]) -> list[str]:
    """`items` without repeats, first occurrence kept."""
    return list(dict.fromkeys(items))
