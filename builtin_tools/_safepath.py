"""Paths under a folder held by descriptor, walked so a racing writer cannot redirect them.

A path is walked one name at a time from a descriptor of the root folder: each folder is
opened with `O_NOFOLLOW` relative to the descriptor of the one before, so a folder swapped
for a symbolic link between a check and the use is met as the link, never followed by
accident. A link met on the way (or as the last name, when asked) is read, its target
resolved lexically against the folder it sits in, and followed only if that stays under
the root: the target is then walked from the root again, the same way, at most
`MAX_LINKS` times. A link that leads out raises `ToolError` naming it.

What is done at the end of a walk is done relative to the folder's descriptor: files are
opened with `O_NOFOLLOW` (and `O_NONBLOCK`, so a pipe swapped in cannot hang the opener),
and a write creates a new file `O_EXCL | O_NOFOLLOW` beside the name and renames it over
the name, which replaces whatever entry is there (a symbolic link, or a hardlink to a
file elsewhere) instead of writing through it.

What this cannot see: a folder moved out of the root while a descriptor of it is held.
That takes write access outside the root, which sandboxed commands are not given.

Nothing here knows about backups, tools or the event loop; nothing from the dispatcher
but `ToolError` may be imported here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_module
import uuid
from collections.abc import Sequence
from types import TracebackType

import attrs

from dispatcher._exceptions import ToolError

__all__ = [
    "MAX_LINKS",
    "NotARegularFile",
    "Place",
    "Root",
    "create_temp",
    "locate",
    "open_dir",
    "open_file_read",
    "open_regular",
    "stat",
    "temp_name",
    "unlink",
    "write_atomic",
]

MAX_LINKS = 40  # as Linux allows in one path lookup
_RETRIES = 20  # times a name that keeps changing under a walk is looked at again

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotARegularFile(OSError):
    """The name is a pipe, socket or device, which is never opened."""


class Root:
    """The folder paths are walked from, held open for the life of this object.

    `path` must be free of symbolic links (a `realpath`): absolute link targets are
    compared with it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._parts = _names(path)
        self.fd = -1  # for __del__, should the open fail
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def reopen(self) -> int:
        """A new descriptor of the root folder, for one walk.

        Opened anew rather than duplicated: a duplicate shares the read position, and
        two folder listings from duplicates in two threads would skip each other's entries.
        """
        return os.open(".", _DIR_FLAGS, dir_fd=self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    def inside(self, absolute: str) -> tuple[str, ...] | None:
        """The names of lexically normalised `absolute` below the root; None if it is not below."""
        names = _names(os.path.normpath(absolute))
        if names[: len(self._parts)] != self._parts:
            return None
        return names[len(self._parts) :]


@attrs.frozen
class Place:
    """A name in a folder held open: where a file is, or is to be. Close it when done.

    `parts` is the real path from the root (the links on the way followed), for checks
    and messages; `stat` is the name's own `lstat` when the walk ended (None: nothing
    there yet).
    """

    dir_fd: int
    name: str
    parts: tuple[str, ...]
    stat: os.stat_result | None

    def close(self) -> None:
        os.close(self.dir_fd)

    def __enter__(self) -> Place:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_dir(root: Root, parts: Sequence[str], *, shown: str, create: bool = False) -> int:
    """A descriptor of the folder `parts` names under `root` (links inside it followed).

    `create` makes missing folders. Raises FileNotFoundError or NotADirectoryError for a
    name on the way that is missing or no folder, ToolError for a link leading out.
    """
    return _walk(root, parts, shown=shown, create=create, last=None).dir_fd


def locate(
    root: Root, parts: Sequence[str], *, shown: str, create: bool = False, follow_last: bool = True
) -> Place:
    """The folder holding the last name of `parts`, open, and that name.

    The folders on the way are walked as `open_dir` walks them (`create` makes missing
    ones); if the last name is a symbolic link it is followed too, unless `follow_last`
    is false. `shown` is the path as the caller names it, for messages.
    """
    return _walk(root, parts, shown=shown, create=create, last=follow_last)


def open_file_read(root: Root, parts: Sequence[str], *, shown: str) -> tuple[int, tuple[str, ...]]:
    """A descriptor of the regular file `parts` names, open for reading, and its real parts.

    Raises FileNotFoundError, IsADirectoryError or NotARegularFile (nothing else is
    opened: a pipe would block, a device could act on being opened), and ToolError for a
    link leading out.
    """
    for _ in range(_RETRIES):
        with locate(root, parts, shown=shown) as place:
            if place.stat is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", shown)
            _refuse_unless_regular(place.stat, shown)
            try:
                return open_regular(place.dir_fd, place.name), place.parts
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOENT):
                    raise
                # Swapped since the walk looked at it: look again.
    raise _keeps_changing(shown)


def open_regular(dir_fd: int, name: str) -> int:
    """Open the regular file `name` in `dir_fd` for reading, never following a link.

    Raises IsADirectoryError or NotARegularFile if it is something else; OSError with
    errno ELOOP if it is a symbolic link.
    """
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        _refuse_unless_regular(os.fstat(fd), name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def temp_name() -> str:
    """A fresh hidden name to write into before renaming over the real one.

    Short whatever the real name is: a name near the 255-byte limit has no room for a
    prefix and a suffix, and a long-named file could not be edited or restored.
    """
    return f".tp-{uuid.uuid4().hex[:16]}.partial"


def create_temp(dir_fd: int) -> tuple[int, str]:
    """A new empty file under a fresh hidden name in `dir_fd`: its descriptor and name.

    Created `O_EXCL | O_NOFOLLOW`, so it is new and nobody's link; mode 0o666 less the umask.
    """
    for _ in range(_RETRIES):
        name = temp_name()
        try:
            return os.open(name, _CREATE_FLAGS, 0o666, dir_fd=dir_fd), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no fresh temporary name", name)


def write_atomic(
    dir_fd: int, name: str, data: bytes, mode: int | None = None, *, durable: bool = False
) -> None:
    """Replace `name` in `dir_fd` with a file holding `data`: a reader sees the old file or
    the new one, never half, and whatever entry was there (a link included) is replaced,
    not written through. `mode` sets the permission bits (None: 0o666 less the umask);
    `durable` waits for the data to reach the disk before the rename.
    """
    fd, temp = create_temp(dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if mode is not None:
                os.fchmod(out.fileno(), mode)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink(dir_fd, temp, missing_ok=True)
        raise


def unlink(dir_fd: int, name: str, *, missing_ok: bool = False) -> None:
    """Remove the entry `name` from `dir_fd` (a link is removed itself, not its target)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        if not missing_ok:
            raise


def stat(dir_fd: int, name: str, *, follow_symlinks: bool = False) -> os.stat_result | None:
    """The status of `name` in `dir_fd` (of a link itself, unless `follow_symlinks`); None if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None


# -- the walk -------------------------------------------------------------------------


def _walk(root: Root, parts: Sequence[str], *, shown: str, create: bool, last: bool | None) -> Place:
    """Walk `parts` from `root`.

    With `last` None every name is a folder, and the Place is the last one itself (its
    `name` empty). Otherwise the last name is looked at, not opened (followed if it is a
    link and `last` is true), and the Place is that name in the folder before it.
    """
    for name in parts:
        if name in ("", ".", "..") or "/" in name:
            raise ValueError(f"a walk takes plain names, got {name!r} in {tuple(parts)!r}")
    pending = list(reversed(parts))  # a stack: the next name is on top
    here: list[str] = []  # the real path of `fd` from the root
    fd = root.reopen()
    links = 0
    retries = 0
    made: tuple[str, ...] | None = None  # the folder this walk last made
    try:
        while pending:
            name = pending.pop()
            if last is not None and not pending:
                entry = stat(fd, name)
                if entry is None or not (last and stat_module.S_ISLNK(entry.st_mode)):
                    return Place(fd, name, (*here, name), entry)
                links = _count_link(links, shown)
                fd, here = _follow(root, fd, here, name, pending, shown)
                continue
            try:
                inner = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, "no such folder", _join(*here, name)) from None
                if made == (*here, name):  # made, and gone again before it could be opened
                    retries = _count_retry(retries, shown)
                made = (*here, name)
                # Made meanwhile, perhaps as a link? The next look decides.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                pending.append(name)
                continue
            except OSError as exc:
                # O_NOFOLLOW on a link fails with ELOOP (some systems say ENOTDIR).
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                entry = stat(fd, name)
                if entry is None:  # gone since the open: look again
                    retries = _count_retry(retries, shown)
                    pending.append(name)
                    continue
                if not stat_module.S_ISLNK(entry.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "not a folder", _join(*here, name)) from None
                links = _count_link(links, shown)
                fd, here = _follow(root, fd, here, name, pending, shown)
                continue
            os.close(fd)
            fd = inner
            here.append(name)
        if last is not None:  # a link that names the root folder
            raise IsADirectoryError(errno.EISDIR, "names the workspace folder", shown)
        return Place(fd, "", tuple(here), None)
    except BaseException:
        os.close(fd)
        raise


def _follow(
    root: Root, fd: int, here: list[str], name: str, pending: list[str], shown: str
) -> tuple[int, list[str]]:
    """Replace the link `name` in the folder `fd` (at `here`) by its target's names, to
    be walked from the root; refuse a target that leads out."""
    try:
        target = os.readlink(name, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT):  # no longer a link: look again
            pending.append(name)
            return fd, here
        raise
    link = _join(*here, name)
    names = root.inside(os.path.join(root.path, *here, target))
    if names is None:
        raise ToolError(f"path {shown!r} leaves the workspace through the symlink {link!r}", retryable=False)
    pending.extend(reversed(names))
    fresh = root.reopen()
    os.close(fd)
    return fresh, []


def _count_link(links: int, shown: str) -> int:
    if links >= MAX_LINKS:
        raise ToolError(f"path {shown!r} goes through more than {MAX_LINKS} symbolic links", retryable=False)
    return links + 1


def _count_retry(retries: int, shown: str) -> int:
    if retries >= _RETRIES:
        raise _keeps_changing(shown)
    return retries + 1


def _keeps_changing(shown: str) -> ToolError:
    return ToolError(f"path {shown!r} keeps changing while it is opened; try again", retryable=True)


def _refuse_unless_regular(entry: os.stat_result, shown: str) -> None:
    if stat_module.S_ISDIR(entry.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a folder", shown)
    if not stat_module.S_ISREG(entry.st_mode):
        raise NotARegularFile(errno.EINVAL, "not a regular file", shown)


def _names(path: str) -> tuple[str, ...]:
    return tuple(name for name in path.split("/") if name not in ("", "."))


def _join(*names: str) -> str:
    return "/".join(names) or "."
