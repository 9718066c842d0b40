"""The file tools under a racing attacker: a thread swaps a folder of the workspace for a
symbolic link to an outside folder while the tools run, and nothing outside is ever read
or written. Each loop is bounded in time, so a run takes a few seconds at most."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs
import pytest

from builtin_tools._workspace import Workspace
from builtin_tools.files import FileTools
from builtin_tools.web import WebTools
from dispatcher._exceptions import ToolError

from ._fakes import tool_context

_SECONDS = 1.5  # each race loop stops after this long ...
_TRIES = 400  # ... or after this many calls
_SECRET = "OUTSIDE-SECRET"
_BODY = b"downloaded body\n" * 64


@attrs.define
class _Scene:
    """A workspace whose folder `d` a thread keeps swapping with `.parked`, a symlink to
    `outside`: `d` is the folder, then the link, then the folder..."""

    root: Path
    outside: Path
    stop: threading.Event = attrs.field(factory=threading.Event)
    swaps: int = 0
    thread: threading.Thread | None = None

    def snapshot(self) -> tuple[int, dict[str, bytes]]:
        """The outside folder's mtime (any entry created or removed moves it) and contents."""
        return (
            self.outside.stat().st_mtime_ns,
            {p.name: p.read_bytes() for p in sorted(self.outside.iterdir())},
        )

    def start(self) -> None:
        self.thread = threading.Thread(target=self._swap, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=5)
        if (self.root / "d").is_symlink():  # leave the real folder in place for the checks
            self._exchange()

    def _swap(self) -> None:
        while not self.stop.is_set():
            self._exchange()
            self.swaps += 1

    def _exchange(self) -> None:
        d, parked = self.root / "d", self.root / ".parked"
        # One step where Linux's renameat2(RENAME_EXCHANGE) is there: `d` is always a
        # folder or a link. Elsewhere three renames, and `d` is briefly missing.
        if _renameat2 is not None and _renameat2(_AT_FDCWD, bytes(d), _AT_FDCWD, bytes(parked), 2) == 0:
            return
        spare = self.root / ".spare"
        os.rename(d, spare)
        self._put(parked, d)
        os.rename(spare, parked)

    def _put(self, src: Path, dst: Path) -> None:
        # A tool that makes folders may have made a new `d` while it was missing: move it
        # aside (it is inside the workspace, and so is what was written in it).
        while True:
            try:
                os.rename(src, dst)
            except OSError:
                os.rename(dst, self.root / f".made-by-a-tool-{time.monotonic_ns()}")
            else:
                return


_AT_FDCWD = -100
try:
    _renameat2: Any = ctypes.CDLL(None, use_errno=True).renameat2
except AttributeError:
    _renameat2 = None


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[_Scene]:
    root, outside = tmp_path / "ws", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    for folder, secret in ((root / "d", "inside"), (outside, _SECRET)):
        (folder / "f.txt").write_text("hello")
        (folder / "secret.txt").write_text(secret)
        (folder / "file.bin").write_bytes(b"old")
    (root / ".parked").symlink_to(outside)
    time.sleep(0.01)  # so that a change to the outside folder moves its mtime
    scene = _Scene(root, outside)
    yield scene
    if scene.thread is not None and scene.thread.is_alive():
        scene.finish()


@attrs.define
class _Tally:
    ok: int = 0
    refused: int = 0  # a ToolError: the call's failed result
    crashed: int = 0  # any other exception
    crash: str = ""  # the first of them
    escapes: int = 0
    tries: int = 0


def _race(scene: _Scene, attempt: Callable[[], bool]) -> _Tally:
    """Call `attempt` repeatedly while the folder is swapped. An escape is a call after
    which the outside folder has changed, or one that returns True (it saw outside data)."""
    tally = _Tally()
    scene.start()
    deadline = time.monotonic() + _SECONDS
    try:
        while tally.tries < _TRIES and time.monotonic() < deadline:
            tally.tries += 1
            before = scene.snapshot()
            try:
                saw_outside = attempt()
            except ToolError:
                tally.refused += 1
                saw_outside = False
            except Exception as exc:
                tally.crashed += 1
                tally.crash = tally.crash or repr(exc)
                saw_outside = False
            else:
                tally.ok += 1
            tally.escapes += saw_outside or scene.snapshot() != before
    finally:
        scene.finish()
    return tally


def test_edit_file_never_writes_through_a_swapped_folder(scene: _Scene) -> None:
    """edit_file with its folder swapped for a symlink to outside writes only inside."""
    tools = FileTools(Workspace(scene.root))

    def attempt() -> bool:
        tools.edit_file(
            {"path": "d/f.txt", "old_string": "hello", "new_string": "hello!"},
            tool_context("edit_file"),
        )
        return False

    tally = _race(scene, attempt)
    assert (tally.escapes, tally.crashed) == (0, 0), tally
    assert tally.ok > 0 and scene.swaps > 0, tally
    assert (scene.outside / "f.txt").read_text() == "hello"
    assert (scene.root / "d/f.txt").read_text() == "hello" + "!" * tally.ok


def test_edit_file_creating_never_writes_through_a_swapped_folder(scene: _Scene) -> None:
    """edit_file creating new files in a swapped folder creates them only inside."""
    tools = FileTools(Workspace(scene.root))
    names = iter(range(10**6))

    def attempt() -> bool:
        tools.edit_file(
            {"path": f"d/new-{next(names)}.txt", "old_string": "", "new_string": "x"},
            tool_context("edit_file"),
        )
        return False

    tally = _race(scene, attempt)
    assert (tally.escapes, tally.crashed) == (0, 0), tally
    assert tally.ok > 0, tally


def test_read_files_never_reads_through_a_swapped_folder(scene: _Scene) -> None:
    """read_files with its folder swapped for a symlink to outside never shows the outside file."""
    tools = FileTools(Workspace(scene.root))

    def attempt() -> bool:
        out = str(tools.read_files({"paths": ["d/secret.txt"]}, tool_context("read_files")))
        return _SECRET in out

    tally = _race(scene, attempt)
    assert (tally.escapes, tally.crashed) == (0, 0), tally
    assert tally.ok > 0, tally


def test_remove_and_restore_never_touch_a_swapped_folder(scene: _Scene) -> None:
    """remove_file and restore_file with their folder swapped remove and restore only inside."""
    tools = FileTools(Workspace(scene.root))

    def attempt() -> bool:
        try:
            tools.remove_file({"path": "d/f.txt"}, tool_context("remove_file"))
        finally:
            # Whatever happened, put back what was removed (if it was).
            for _ in range(100):
                try:
                    tools.restore_file({"path": "d/f.txt"}, tool_context("restore_file"))
                except ToolError as exc:
                    if "no earlier version" in exc.message:
                        break
                    time.sleep(0.0005)
                else:
                    break
        return False

    tally = _race(scene, attempt)
    assert (tally.escapes, tally.crashed) == (0, 0), tally
    assert tally.ok > 0, tally


def test_find_files_never_lists_a_swapped_folder(scene: _Scene) -> None:
    """find_files never lists the outside folder's entries, whatever the swap shows it."""
    (scene.outside / "only-outside.txt").write_text("x")
    for n in range(300):  # names to match between listing the root and entering `d`
        (scene.root / f"top-{n}.txt").write_text("")
    tools = FileTools(Workspace(scene.root))

    def attempt() -> bool:
        out = str(tools.find_files({"pattern": "**/*"}, tool_context("find_files")))
        return "only-outside" in out

    tally = _race(scene, attempt)
    assert (tally.escapes, tally.crashed) == (0, 0), tally
    assert tally.ok > 0, tally


# -- download_file against a server that trickles its body --------------------------------


class _TrickleHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(_BODY)))
        self.end_headers()
        self.wfile.flush()
        for start in range(0, len(_BODY), len(_BODY) // 4):
            time.sleep(0.002)
            self.wfile.write(_BODY[start : start + len(_BODY) // 4])
            self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


@pytest.fixture
def slow_server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _TrickleHandler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/body"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


async def test_download_file_never_writes_through_a_swapped_folder(scene: _Scene, slow_server: str) -> None:
    """download_file from a slow server into a swapped folder stages and saves only inside."""
    web = WebTools(Workspace(scene.root), allow_private_network=True)
    tally = _Tally()
    scene.start()
    try:
        with anyio.fail_after(30):
            deadline = anyio.current_time() + _SECONDS
            while tally.tries < _TRIES and anyio.current_time() < deadline:
                tally.tries += 1
                before = await anyio.to_thread.run_sync(scene.snapshot)
                try:
                    await web.download_file(
                        {"url": slow_server, "path": "d/file.bin"}, tool_context("download_file")
                    )
                except ToolError:
                    tally.refused += 1
                except Exception as exc:
                    tally.crashed += 1
                    tally.crash = tally.crash or repr(exc)
                else:
                    tally.ok += 1
                if await anyio.to_thread.run_sync(scene.snapshot) != before:
                    tally.escapes += 1
    finally:
        await anyio.to_thread.run_sync(scene.finish)
    assert (tally.escapes, tally.crashed) == (0, 0), tally
    assert tally.ok > 0, tally
    assert (scene.root / "d/file.bin").read_bytes() == _BODY
    assert not [p for p in (scene.root / "d").iterdir() if p.name.endswith(".partial")]
