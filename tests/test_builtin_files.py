"""The file tools, called directly on real workspaces in tmp_path."""

from __future__ import annotations

import os
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from builtin_tools import default_registry
from builtin_tools._workspace import Workspace
from builtin_tools.files import FileTools, glob_to_regex
from dispatcher._exceptions import ToolError

from ._fakes import FakeSession, tool_context


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def tools(ws: Path) -> FileTools:
    return FileTools(Workspace(ws))


def _call(tools: FileTools, name: str, **args: Any) -> str:
    handler = getattr(tools, name)
    return str(handler(args, tool_context(name)))


# -- read_files -------------------------------------------------------------------------


def test_read_files_numbers_lines_and_windows(ws: Path, tools: FileTools) -> None:
    """read_files numbers lines like cat -n and shows only the offset/limit window."""
    (ws / "a.txt").write_text("".join(f"line {n}\n" for n in range(1, 11)))
    out = _call(tools, "read_files", paths=["a.txt"], offset=3, limit=2)
    assert "==> a.txt <==" in out
    assert "     3\tline 3" in out and "     4\tline 4" in out
    assert "line 2" not in out and "line 5" not in out
    assert "offset=5" in out  # it says where to continue


def test_read_files_reports_missing_file_inline(ws: Path, tools: FileTools) -> None:
    """One missing file among several is reported in place; the others are still read."""
    (ws / "a.txt").write_text("alpha\n")
    out = _call(tools, "read_files", paths=["a.txt", "nope.txt"])
    assert "alpha" in out
    assert "==> nope.txt <==\nerror: no such file" in out


def test_read_files_reports_unresolvable_paths_inline(ws: Path, tools: FileTools) -> None:
    """A path outside the workspace or with an over-long name is reported in place, as
    given; the files that can be read are still shown."""
    (ws / "a.txt").write_text("alpha\n")
    (ws.parent / "outside.txt").write_text("secret")
    long_name = "x" * 300
    out = _call(tools, "read_files", paths=["../outside.txt", "a.txt", long_name])
    sections = out.split("\n\n")
    assert sections[0].startswith(
        "==> ../outside.txt <==\nerror: path '../outside.txt' is outside the workspace"
    )
    assert sections[1] == "==> a.txt <==\n     1\talpha"
    assert sections[2].startswith(f"==> {long_name} <==\nerror: cannot read: File name too long")
    assert len(sections) == 3 and "secret" not in out


def test_read_files_fails_when_nothing_could_be_read(tools: FileTools) -> None:
    """When every path fails, the call fails (not retryable)."""
    with pytest.raises(ToolError) as info:
        _call(tools, "read_files", paths=["nope.txt"])
    assert info.value.retryable is False
    assert "no such file" in info.value.message


def test_read_files_marks_binary_and_empty_files(ws: Path, tools: FileTools) -> None:
    """A binary file is described, not dumped; an empty file says so."""
    (ws / "b.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    (ws / "empty.txt").write_text("")
    out = _call(tools, "read_files", paths=["b.bin", "empty.txt"])
    assert "[binary file, 7 bytes; not shown]" in out
    assert "[empty file]" in out


def test_read_files_does_not_open_pipes(ws: Path, tools: FileTools) -> None:
    """A FIFO is reported, not opened (opening it would wait for a writer forever)."""
    os.mkfifo(ws / "pipe")
    (ws / "a.txt").write_text("alpha\n")
    out = _call(tools, "read_files", paths=["pipe", "a.txt"])
    assert "==> pipe <==\nerror: not a regular file" in out and "alpha" in out
    with pytest.raises(ToolError, match="not a regular file"):
        _call(tools, "edit_file", path="pipe", old_string="a", new_string="b")


def test_read_files_cuts_very_long_lines(ws: Path, tools: FileTools) -> None:
    """A line over 2000 characters is cut with a marker."""
    (ws / "long.txt").write_text("x" * 5000 + "\n")
    out = _call(tools, "read_files", paths=["long.txt"])
    assert "x" * 2000 + " [line cut at 2000 characters]" in out
    assert "x" * 2001 not in out


def test_read_files_reads_a_huge_line_in_small_memory(ws: Path, tools: FileTools) -> None:
    """A file of one 8 MB line is shown cut, without reading the line into memory whole;
    the lines after it keep their numbers."""
    with open(ws / "one.txt", "w") as f:
        for _ in range(8):
            f.write("y" * 1_000_000)
        f.write("\nsecond\r\nthird")
    tracemalloc.start()
    try:
        out = _call(tools, "read_files", paths=["one.txt"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    assert out.splitlines()[1:] == [
        "     1\t" + "y" * 2000 + " [line cut at 2000 characters]", "     2\tsecond", "     3\tthird",
    ]  # fmt: skip


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "sub/../../outside.txt"])
def test_paths_outside_the_workspace_are_refused(ws: Path, tools: FileTools, path: str) -> None:
    """`..` or an absolute path leading outside is a ToolError naming the path."""
    (ws / "sub").mkdir()
    (ws.parent / "outside.txt").write_text("secret")
    with pytest.raises(ToolError) as info:
        _call(tools, "read_files", paths=[path])
    assert repr(path) in info.value.message
    assert "outside the workspace" in info.value.message
    assert info.value.retryable is False


def test_symlink_leading_outside_is_refused(ws: Path, tools: FileTools) -> None:
    """A symbolic link inside the workspace that points outside cannot be read or written."""
    (ws.parent / "outside.txt").write_text("secret")
    (ws / "link.txt").symlink_to(ws.parent / "outside.txt")
    with pytest.raises(ToolError, match=r"'link\.txt' is outside the workspace"):
        _call(tools, "read_files", paths=["link.txt"])
    with pytest.raises(ToolError, match="outside the workspace"):
        _call(tools, "edit_file", path="link.txt", old_string="secret", new_string="x")
    assert (ws.parent / "outside.txt").read_text() == "secret"


def test_inner_dotdot_and_absolute_paths_inside_are_fine(ws: Path, tools: FileTools) -> None:
    """`a/../b` and an absolute path inside the workspace both resolve."""
    (ws / "a").mkdir()
    (ws / "b.txt").write_text("bee\n")
    assert "bee" in _call(tools, "read_files", paths=["a/../b.txt"])
    assert "bee" in _call(tools, "read_files", paths=[str(ws / "b.txt")])


def test_symlinks_inside_the_workspace_are_followed(ws: Path, tools: FileTools) -> None:
    """A symlink (relative or absolute) that stays inside is read and edited through."""
    (ws / "real").mkdir()
    (ws / "real/f.txt").write_text("one\n")
    (ws / "alias").symlink_to("real")
    (ws / "sub").mkdir()
    (ws / "sub/back").symlink_to("../real/f.txt")
    (ws / "abs").symlink_to(ws / "real")
    assert "one" in _call(tools, "read_files", paths=["alias/f.txt", "sub/back", "abs/f.txt"])
    _call(tools, "edit_file", path="sub/back", old_string="one", new_string="two")
    assert (ws / "real/f.txt").read_text() == "two\n" and (ws / "sub/back").is_symlink()


def test_a_folder_swapped_for_a_symlink_after_the_check_is_refused(ws: Path) -> None:
    """A folder swapped for a symlink to outside after the check is refused at the use, naming the link."""
    outside = ws.parent / "outside"
    outside.mkdir()
    (outside / "f.txt").write_text("outside")
    (ws / "d").mkdir()
    (ws / "d/f.txt").write_text("inside")
    workspace = Workspace(ws)
    target = workspace.resolve("d/f.txt")
    (ws / "d/f.txt").unlink()
    (ws / "d").rmdir()
    (ws / "d").symlink_to(outside)
    message = r"path 'd/f\.txt' leaves the workspace through the symlink 'd'"
    with pytest.raises(ToolError, match=message) as info:
        workspace.open_read(target)
    assert info.value.retryable is False
    for change in (
        lambda: workspace.write(target, b"x", action="edit"),
        lambda: workspace.remove(target),
        lambda: workspace.stage(target),
    ):
        with pytest.raises(ToolError, match=message):
            change()
    assert os.listdir(outside) == ["f.txt"] and (outside / "f.txt").read_text() == "outside"


def test_a_symlink_swapped_in_is_read_through_but_never_written_through(ws: Path) -> None:
    """A link swapped in after the check is read through if inside, never written through."""
    (ws / ".git").mkdir()
    (ws / "other").mkdir()
    (ws / "other/f.txt").write_text("other")
    (ws / "d").mkdir()
    workspace = Workspace(ws)
    target = workspace.resolve("d/f.txt")
    (ws / "d").rmdir()
    (ws / "d").symlink_to("other")
    with workspace.open_read(target) as file:
        assert file.read() == b"other"
    with pytest.raises(ToolError, match=r"'d/f\.txt' now leads through a symbolic link to 'other/f\.txt'"):
        workspace.write(target, b"changed", action="edit")
    assert (ws / "other/f.txt").read_text() == "other"
    (ws / "d").unlink()
    (ws / "d").symlink_to(".git")
    with pytest.raises(ToolError, match=r"'\.git/f\.txt' is inside a \.git folder"):
        workspace.write(target, b"hook", action="create")
    (ws / "d").unlink()
    (ws / "d").symlink_to("d")
    with pytest.raises(ToolError, match="more than 40 symbolic links"):
        workspace.open_read(target)
    assert os.listdir(ws / ".git") == []


def test_a_hardlink_to_an_outside_file_is_read_but_never_written_through(ws: Path, tools: FileTools) -> None:
    """A hardlink to an outside file reads as that file; edits and restores replace the link."""
    outside = ws.parent / "outside.txt"
    outside.write_text("shared\n")
    os.link(outside, ws / "h.txt")
    assert "shared" in _call(tools, "read_files", paths=["h.txt"])
    _call(tools, "edit_file", path="h.txt", old_string="shared", new_string="mine")
    assert (ws / "h.txt").read_text() == "mine\n"
    assert outside.read_text() == "shared\n" and outside.stat().st_nlink == 1
    _call(tools, "restore_file", path="h.txt")
    assert (ws / "h.txt").read_text() == "shared\n"
    assert (ws / "h.txt").stat().st_ino != outside.stat().st_ino
    _call(tools, "remove_file", path="h.txt")
    assert outside.read_text() == "shared\n"


# -- find_files -------------------------------------------------------------------------


def _tree(ws: Path) -> None:
    for rel in ["top.py", "README.md", "src/pkg/mod.py", "src/pkg/data.json", "src/.hidden.py",
                ".git/config", ".git/hooks/pre.py"]:  # fmt: skip
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)


def test_find_files_double_star_spans_folders(ws: Path, tools: FileTools) -> None:
    """`**/*.py` finds Python files at every depth, including the top, but not in .git."""
    _tree(ws)
    out = _call(tools, "find_files", pattern="**/*.py").splitlines()
    assert out[1:] == ["src/.hidden.py", "src/pkg/mod.py", "top.py"]


def test_find_files_single_star_stays_in_one_folder(ws: Path, tools: FileTools) -> None:
    """`*.py` matches only in the folder searched; `path` chooses that folder."""
    _tree(ws)
    assert _call(tools, "find_files", pattern="*.py").splitlines()[1:] == ["top.py"]
    out = _call(tools, "find_files", pattern="*", path="src/pkg").splitlines()
    assert out[1:] == ["src/pkg/data.json", "src/pkg/mod.py"]


def test_find_files_marks_folders_and_reports_no_match(ws: Path, tools: FileTools) -> None:
    """Folders end with '/', and an empty result says what was searched."""
    _tree(ws)
    assert "src/pkg/" in _call(tools, "find_files", pattern="src/*").splitlines()
    assert _call(tools, "find_files", pattern="*.rs") == "no files match '*.rs' under '.'"


def test_find_files_searches_git_only_when_asked(ws: Path, tools: FileTools) -> None:
    """A pattern naming .git searches inside it."""
    _tree(ws)
    assert ".git/config" in _call(tools, "find_files", pattern=".git/*")


def test_find_files_refuses_patterns_that_leave_the_folder(tools: FileTools) -> None:
    """An absolute pattern or one with `..` is refused."""
    with pytest.raises(ToolError, match="relative"):
        _call(tools, "find_files", pattern="/etc/*")
    with pytest.raises(ToolError, match=r"'\.\.'"):
        _call(tools, "find_files", pattern="../*")


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("*.py", "a.py", True),
        ("*.py", "d/a.py", False),
        ("**/a.py", "a.py", True),
        ("**/a.py", "x/y/a.py", True),
        ("d/**", "d/x/y", True),
        ("[!a]*.py", "b.py", True),
        ("[!a]*.py", "a.py", False),
        ("[a-c]?.txt", "b1.txt", True),
        ("[]]x", "]x", True),
        ("a[", "a[", True),
        ("x[!a]y", "x/y", False),
        ("*a*b*c", "xaybzc", True),
        ("*a*b*c", "xaybzcd", False),
        ("*a*a*", "aa", True),
        ("**/**/a.py", "a.py", True),
        ("**/d/**/a.py", "d/a.py", True),
        ("**/d/**/a.py", "x/d/y/d/z/a.py", True),
        ("**/d/**/a.py", "x/y/a.py", False),
    ],
)
def test_glob_to_regex(pattern: str, path: str, matches: bool) -> None:
    """Globs follow shell rules: `*`/`?`/classes stay in a folder, `**` spans folders."""
    assert bool(glob_to_regex(pattern).fullmatch(path)) is matches


@pytest.mark.parametrize(
    ("pattern", "name"),
    [
        ("*a" * 11 + "b", "a" * 36),
        ("*a" * 40 + "b", "a" * 250),
        ("/".join(["**"] * 14) + "/zz", "a"),
        ("**/a/" * 12 + "b", "/".join(["a"] * 60)),
    ],
)
async def test_find_files_with_many_wildcards_answers_at_once(
    ws: Path, tools: FileTools, pattern: str, name: str
) -> None:
    """Many `*` or `**` never make matching exponential (it would hold the event loop)."""
    (ws / name).parent.mkdir(parents=True, exist_ok=True)
    (ws / name).write_text("x")
    with anyio.fail_after(2):
        out = await anyio.to_thread.run_sync(
            lambda: _call(tools, "find_files", pattern=pattern), abandon_on_cancel=True
        )
    assert out.startswith("no files match")


def test_find_files_reports_a_malformed_class(tools: FileTools) -> None:
    """A class like `[z-a]` is a ToolError naming the pattern, not a regex error."""
    with pytest.raises(ToolError, match=r"not a valid glob pattern: '\[z-a\]\.txt'") as info:
        _call(tools, "find_files", pattern="[z-a].txt")
    assert info.value.retryable is False


# -- edit_file, remove_file, restore_file -----------------------------------------------


def test_edit_file_replaces_exactly_one_occurrence(ws: Path, tools: FileTools) -> None:
    """edit_file replaces the one occurrence and shows the changed lines."""
    (ws / "a.py").write_text("x = 1\ny = 2\nz = 3\n")
    out = _call(tools, "edit_file", path="a.py", old_string="y = 2", new_string="y = 20")
    assert (ws / "a.py").read_text() == "x = 1\ny = 20\nz = 3\n"
    assert out.startswith("edited a.py: replaced 1 occurrence(s)")
    assert "     2\ty = 20" in out


def test_edit_file_refuses_an_ambiguous_old_string(ws: Path, tools: FileTools) -> None:
    """Several occurrences without replace_all are refused and the file is untouched."""
    (ws / "a.txt").write_text("a a a")
    with pytest.raises(ToolError, match="occurs 3 times"):
        _call(tools, "edit_file", path="a.txt", old_string="a", new_string="b")
    assert (ws / "a.txt").read_text() == "a a a"
    out = _call(tools, "edit_file", path="a.txt", old_string="a", new_string="b", replace_all=True)
    assert (ws / "a.txt").read_text() == "b b b"
    assert "replaced 3 occurrence(s)" in out


def test_edit_file_reports_missing_text(ws: Path, tools: FileTools) -> None:
    """An old_string that is not in the file is a non-retryable error."""
    (ws / "a.txt").write_text("hello")
    with pytest.raises(ToolError, match="not found") as info:
        _call(tools, "edit_file", path="a.txt", old_string="bye", new_string="x")
    assert info.value.retryable is False


def test_edit_file_creates_a_new_file_with_folders(ws: Path, tools: FileTools) -> None:
    """An empty old_string and no such file creates it, folders included."""
    out = _call(tools, "edit_file", path="new/dir/f.txt", old_string="", new_string="one\ntwo\n")
    assert (ws / "new/dir/f.txt").read_text() == "one\ntwo\n"
    assert out == "created new/dir/f.txt (8 bytes, 2 lines)"
    mode = stat.S_IMODE((ws / "new/dir/f.txt").stat().st_mode)
    assert mode == 0o666 & ~_umask()


def test_edit_file_will_not_overwrite_with_empty_old_string(ws: Path, tools: FileTools) -> None:
    """An empty old_string on an existing, non-empty file is refused."""
    (ws / "a.txt").write_text("keep me")
    with pytest.raises(ToolError, match="already exists"):
        _call(tools, "edit_file", path="a.txt", old_string="", new_string="gone")
    assert (ws / "a.txt").read_text() == "keep me"


def test_edit_file_matches_lf_text_in_a_crlf_file(ws: Path, tools: FileTools) -> None:
    """A model's LF old_string matches a CRLF file, and the file keeps CRLF."""
    (ws / "w.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
    _call(tools, "edit_file", path="w.txt", old_string="one\ntwo", new_string="1\n2")
    assert (ws / "w.txt").read_bytes() == b"1\r\n2\r\nthree\r\n"


def test_edit_file_keeps_permissions(ws: Path, tools: FileTools) -> None:
    """An edited file keeps its mode bits (an executable stays executable)."""
    script = ws / "run.sh"
    script.write_text("echo a\n")
    script.chmod(0o750)
    _call(tools, "edit_file", path="run.sh", old_string="a", new_string="b")
    assert stat.S_IMODE(script.stat().st_mode) == 0o750


def test_edit_file_refuses_binary_and_non_utf8(ws: Path, tools: FileTools) -> None:
    """edit_file edits UTF-8 text only."""
    (ws / "b.bin").write_bytes(b"a\x00b")
    (ws / "l1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ToolError, match="binary"):
        _call(tools, "edit_file", path="b.bin", old_string="a", new_string="c")
    with pytest.raises(ToolError, match="not UTF-8"):
        _call(tools, "edit_file", path="l1.txt", old_string="caf", new_string="x")


def test_restore_file_steps_back_through_edits(ws: Path, tools: FileTools) -> None:
    """Each restore_file undoes one more change; a created file is removed at the end."""
    _call(tools, "edit_file", path="f.txt", old_string="", new_string="v1")
    _call(tools, "edit_file", path="f.txt", old_string="v1", new_string="v2")
    _call(tools, "edit_file", path="f.txt", old_string="v2", new_string="v3")
    out = _call(tools, "restore_file", path="f.txt")
    assert (ws / "f.txt").read_text() == "v2"
    assert "before the edit" in out and "2 earlier version(s) still kept" in out
    _call(tools, "restore_file", path="f.txt")
    assert (ws / "f.txt").read_text() == "v1"
    out = _call(tools, "restore_file", path="f.txt")
    assert not (ws / "f.txt").exists()
    assert "did not exist before the create" in out
    with pytest.raises(ToolError, match="no earlier version"):
        _call(tools, "restore_file", path="f.txt")


def test_remove_then_restore_brings_the_file_back(ws: Path, tools: FileTools) -> None:
    """remove_file deletes the file and restore_file puts back the exact bytes."""
    data = bytes(range(256)) * 4
    (ws / "data.bin").write_bytes(data)
    out = _call(tools, "remove_file", path="data.bin")
    assert not (ws / "data.bin").exists()
    assert "removed data.bin (1024 bytes)" in out
    _call(tools, "restore_file", path="data.bin")
    assert (ws / "data.bin").read_bytes() == data


def test_restore_puts_back_the_file_mode(ws: Path, tools: FileTools) -> None:
    """A removed executable comes back executable, with its exact permission bits."""
    (ws / "run.sh").write_text("#!/bin/sh\n")
    (ws / "run.sh").chmod(0o751)
    _call(tools, "remove_file", path="run.sh")
    _call(tools, "restore_file", path="run.sh")
    assert stat.S_IMODE((ws / "run.sh").stat().st_mode) == 0o751


def test_files_with_names_near_the_length_limit_can_be_edited_and_restored(
    ws: Path, tools: FileTools
) -> None:
    """A 240-character name leaves no room for a long temporary name: edit, remove and
    restore still work."""
    name = "n" * 236 + ".txt"
    (ws / name).write_text("one\n")
    _call(tools, "edit_file", path=name, old_string="one", new_string="two")
    _call(tools, "remove_file", path=name)
    _call(tools, "restore_file", path=name)
    assert (ws / name).read_text() == "two\n"
    _call(tools, "restore_file", path=name)
    assert (ws / name).read_text() == "one\n"
    assert os.listdir(ws) == [name]


def test_restore_refuses_after_a_change_by_other_means(ws: Path, tools: FileTools) -> None:
    """A file changed outside the tools since its last edit is not silently overwritten."""
    (ws / "f.txt").write_text("a")
    _call(tools, "edit_file", path="f.txt", old_string="a", new_string="b")
    for by_hand in ("changed by hand", "c"):  # another size, then the same size
        (ws / "f.txt").write_text(by_hand)
        with pytest.raises(ToolError, match="changed by other means"):
            _call(tools, "restore_file", path="f.txt")
        assert (ws / "f.txt").read_text() == by_hand


def test_remove_file_refuses_symlinks_folders_and_missing_files(ws: Path, tools: FileTools) -> None:
    """remove_file removes regular files only."""
    (ws / "target.txt").write_text("t")
    (ws / "link.txt").symlink_to(ws / "target.txt")
    (ws / "dir").mkdir()
    with pytest.raises(ToolError, match="symbolic link"):
        _call(tools, "remove_file", path="link.txt")
    with pytest.raises(ToolError, match="folder"):
        _call(tools, "remove_file", path="dir")
    with pytest.raises(ToolError, match="no such file"):
        _call(tools, "remove_file", path="missing.txt")
    assert (ws / "target.txt").exists() and (ws / "link.txt").is_symlink()


@pytest.mark.parametrize("path", ["nosuchdir/../link.txt", "dir/../link.txt", "./link.txt", "link.txt/"])
def test_remove_file_refuses_a_symlink_however_it_is_named(ws: Path, tools: FileTools, path: str) -> None:
    """A path that reaches a symlink through `..`, `.` or a trailing '/' is still refused,
    and the link's target is left alone."""
    (ws / "target.txt").write_text("t")
    (ws / "link.txt").symlink_to("target.txt")
    (ws / "dir").mkdir()
    with pytest.raises(ToolError, match="symbolic link"):
        _call(tools, "remove_file", path=path)
    assert (ws / "target.txt").read_text() == "t" and (ws / "link.txt").is_symlink()


@pytest.mark.parametrize(
    "path", [".git/config", ".git/hooks/post-index-change", "sub/.git/config", ".GIT/config",
             "gitdir/config", ".git", "a/../.git/config"],
)  # fmt: skip
def test_file_tools_do_not_write_inside_git_folders(ws: Path, tools: FileTools, path: str) -> None:
    """Files inside a .git folder (git runs programs named there) are neither created,
    edited nor removed, however the path reaches them."""
    for repo in (ws / ".git", ws / "sub/.git"):
        (repo / "hooks").mkdir(parents=True)
        (repo / "config").write_text("[core]\n")
    (ws / "gitdir").symlink_to(".git")
    before = {p: p.read_bytes() for p in ws.rglob("*") if p.is_file()}
    attempts = [
        ("edit_file", {"old_string": "[core]", "new_string": "[core]\n\tfsmonitor = evil"}),
        ("edit_file", {"old_string": "", "new_string": "#!/bin/sh\n"}),
        ("remove_file", {}),
        ("restore_file", {}),
    ]
    for name, extra in attempts:
        with pytest.raises(ToolError, match=r"inside a \.git folder") as info:
            _call(tools, name, path=path, **extra)
        assert info.value.retryable is False
    assert {p: p.read_bytes() for p in ws.rglob("*") if p.is_file()} == before
    assert not (ws / ".git/hooks/post-index-change").exists()


def test_files_too_large_to_back_up_are_left_alone(ws: Path) -> None:
    """A file over the backup limit is neither edited nor removed: it could not be restored."""
    tools = FileTools(Workspace(ws, max_backup_file_bytes=100))
    (ws / "big.txt").write_text("x" * 200)
    with pytest.raises(ToolError, match="over the 100-byte limit"):
        _call(tools, "edit_file", path="big.txt", old_string="xx", new_string="y", replace_all=True)
    with pytest.raises(ToolError, match="over the 100-byte limit"):
        _call(tools, "remove_file", path="big.txt")
    assert (ws / "big.txt").read_text() == "x" * 200


def test_backup_budget_drops_the_oldest_versions(ws: Path) -> None:
    """Past the total backup budget the oldest kept versions are forgotten first."""
    workspace = Workspace(ws, max_backup_bytes=250)
    tools = FileTools(workspace)
    for name in ("a.txt", "b.txt", "c.txt"):
        (ws / name).write_text("z" * 100)
        _call(tools, "edit_file", path=name, old_string="z" * 100, new_string="new")
    assert workspace.kept_bytes() == 200
    assert workspace.restorable(ws / "a.txt") == 0
    assert workspace.restorable(ws / "c.txt") == 1
    with pytest.raises(ToolError, match="no earlier version"):
        _call(tools, "restore_file", path="a.txt")


# -- file_history -------------------------------------------------------------------------


def test_file_history_lists_changes_with_their_session(ws: Path, tools: FileTools) -> None:
    """file_history shows every change made through the tools, oldest first, per path."""
    session = FakeSession("chat-7")
    tools.edit_file({"path": "a.txt", "old_string": "", "new_string": "1"}, tool_context("e", session, "c1"))
    tools.edit_file(
        {"path": "d/b.txt", "old_string": "", "new_string": "22"}, tool_context("e", session, "c2")
    )
    tools.remove_file({"path": "a.txt"}, tool_context("r", session, "c3"))
    out = _call(tools, "file_history")
    lines = out.splitlines()
    assert lines[0] == "3 change(s), oldest first:"
    assert " create a.txt: absent -> 1 B (session chat-7, call c1)" in lines[1]
    assert " remove a.txt: 1 B -> absent (session chat-7, call c3)" in lines[3]
    only_d = _call(tools, "file_history", path="d")
    assert "d/b.txt" in only_d and "a.txt" not in only_d
    assert _call(tools, "file_history", path="other").startswith("no changes")


# -- flags and resources -----------------------------------------------------------------


def test_file_tools_declare_reads_and_writes_by_resolved_path(ws: Path) -> None:
    """Readers declare what they read and writers what they write, as resolved file keys."""
    (ws / "real").mkdir()
    (ws / "alias").symlink_to(ws / "real")
    reg = default_registry(ws, include=["files"])
    real = os.path.realpath(ws)
    read = reg.get("read_files")
    assert read.concurrent is True and read.deferred is True and read.writes is None
    assert read.reads is not None
    assert read.reads({"paths": ["alias/x.py", "y.py"]}) == {
        f"file:{real}/real/x.py",
        f"file:{real}/y.py",
    }
    find = reg.get("find_files")
    assert find.reads is not None and find.reads({"pattern": "*"}) == {f"file:{real}"}
    for name in ("edit_file", "remove_file", "restore_file"):
        tool = reg.get(name)
        assert tool.concurrent is False and tool.writes is not None
        assert tool.writes({"path": "alias/f"}) == {f"file:{real}/real/f"}
        assert tool.writes({}) == {"file:/"}  # arguments that will fail validation


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
