"""find_files and .gitignore: the root's and nested ones, negations, folder patterns,
and `include_ignored`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from builtin_tools import files
from builtin_tools._workspace import Workspace
from builtin_tools.files import FileTools

from ._fakes import tool_context


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def tools(ws: Path) -> FileTools:
    return FileTools(Workspace(ws))


def _find(tools: FileTools, pattern: str = "**", **args: Any) -> list[str]:
    """The listed paths (without the header line and any trailing note)."""
    out = str(tools.find_files({"pattern": pattern, **args}, tool_context("find_files")))
    return [line for line in out.splitlines()[1:] if not line.startswith("[")]


def _files(ws: Path, *paths: str) -> None:
    for rel in paths:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(rel)


def test_root_gitignore_hides_files_folders_and_anchored_names(ws: Path, tools: FileTools) -> None:
    """`*.log`, a folder pattern `build/` and an anchored `/only-top.txt` are left out; the
    same name deeper than the anchor is not; the output says how many were skipped."""
    _files(ws, "app.py", "debug.log", "src/x.log", "src/x.py", "build/out.bin", "src/build/y.o",
           "only-top.txt", "src/only-top.txt", ".git/config")  # fmt: skip
    (ws / ".gitignore").write_text("# generated\n*.log\nbuild/\n/only-top.txt\n")
    assert _find(tools) == [".gitignore", "app.py", "src/", "src/only-top.txt", "src/x.py"]
    out = str(tools.find_files({"pattern": "**/*.log"}, tool_context("find_files")))
    assert out.splitlines() == [
        "no files match '**/*.log' under '.'",
        "[5 entries that .gitignore ignores were not searched; include_ignored=true searches them]",
    ]


def test_nested_gitignore_applies_below_its_folder_and_can_negate(ws: Path, tools: FileTools) -> None:
    """A nested .gitignore's patterns are relative to its folder, and its `!` lines bring
    back what the root one ignored, there only."""
    _files(ws, "a.tmp", "keep.tmp", "pkg/b.tmp", "pkg/keep.tmp", "pkg/cache/c.txt",
           "other/cache/d.txt")  # fmt: skip
    (ws / ".gitignore").write_text("*.tmp\n")
    (ws / "pkg/.gitignore").write_text("!keep.tmp\n/cache/\n")
    assert _find(tools) == [
        ".gitignore", "other/", "other/cache/", "other/cache/d.txt",
        "pkg/", "pkg/.gitignore", "pkg/keep.tmp",
    ]  # fmt: skip


def test_negation_in_the_same_file_and_the_last_matching_line_wins(ws: Path, tools: FileTools) -> None:
    """`logs/*` then `!logs/keep.log` lists only keep.log in logs/; a later line overrides
    an earlier one."""
    _files(ws, "logs/a.log", "logs/keep.log", "notes.md", "draft.md")
    (ws / ".gitignore").write_text("logs/*\n!logs/keep.log\n*.md\n!*.md\ndraft.md\n")
    assert _find(tools) == [".gitignore", "logs/", "logs/keep.log", "notes.md"]


def test_nothing_under_an_ignored_folder_comes_back(ws: Path, tools: FileTools) -> None:
    """As in git, a negation cannot bring back a file whose folder is ignored."""
    _files(ws, "build/keep.txt", "build/sub/x.txt")
    (ws / ".gitignore").write_text("build/\n!build/keep.txt\n")
    (ws / "build/.gitignore").write_text("!*\n")
    assert _find(tools) == [".gitignore"]


def test_include_ignored_lists_everything_but_git_itself(ws: Path, tools: FileTools) -> None:
    """`include_ignored=true` lists what .gitignore ignores; `.git/` stays out."""
    _files(ws, "a.log", "build/out.bin", ".git/HEAD")
    (ws / ".gitignore").write_text("*.log\nbuild/\n")
    assert _find(tools, include_ignored=True) == [".gitignore", "a.log", "build/", "build/out.bin"]
    out = str(tools.find_files({"pattern": "**", "include_ignored": True}, tool_context("find_files")))
    assert "ignores" not in out


def test_search_from_a_subfolder_honours_the_gitignore_files_above(ws: Path, tools: FileTools) -> None:
    """With `path` below the root, the root's .gitignore (relative to the root) still
    applies."""
    _files(ws, "src/app/main.py", "src/app/gen/out.py", "src/app/x.pyc")
    (ws / ".gitignore").write_text("*.pyc\n/src/app/gen/\n")
    assert _find(tools, path="src/app") == ["src/app/main.py"]
    assert _find(tools, pattern="*", path="src/app", include_ignored=True) == [
        "src/app/gen/", "src/app/main.py", "src/app/x.pyc",
    ]  # fmt: skip


def test_a_symlinked_or_unreadable_gitignore_is_not_followed(ws: Path, tools: FileTools) -> None:
    """A .gitignore that is a symlink (it could name a file outside) is not read, and a
    folder named .gitignore is not an error."""
    outside = ws.parent / "outside-rules"
    outside.write_text("*\n")
    _files(ws, "a.txt", "d/b.txt", "d/.gitignore/x")
    (ws / ".gitignore").symlink_to(outside)
    assert _find(tools, pattern="**/*.txt") == ["a.txt", "d/b.txt"]


def test_find_files_schema_and_reads_cover_gitignore(ws: Path, tools: FileTools) -> None:
    """The schema offers `include_ignored` (default false); the call reads the .gitignore
    files above its folder, so editing one invalidates it."""
    (ws / "a/b").mkdir(parents=True)
    tool = next(t for t in tools.tools() if t.name == "find_files")
    prop = tool.parameters["properties"]["include_ignored"]
    assert prop["type"] == "boolean" and prop["default"] is False
    assert tool.reads is not None
    root = ws.resolve()
    assert tool.reads({"pattern": "*", "path": "a/b"}) == {
        f"file:{root}/a/b", f"file:{root}/a/.gitignore", f"file:{root}/.gitignore",
    }  # fmt: skip
    assert tool.reads({"pattern": "*"}) == {f"file:{root}"}
    assert tool.reads({"pattern": "*", "path": "a/b", "include_ignored": True}) == {f"file:{root}/a/b"}


def test_a_gitignore_is_read_from_the_folder_the_walk_holds_open(
    ws: Path, tools: FileTools, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folder `d`, swapped for a link to an outside folder right after the walk listed it,
    still has its own .gitignore read: the outside one never decides what is listed."""
    outside = ws.parent / "outside"
    outside.mkdir()
    (outside / ".gitignore").write_text("visible.txt\n")
    _files(ws, "d/visible.txt")
    (ws / "d/.gitignore").write_text("# nothing ignored\n")
    listed = files._list_folder
    real_d = str((ws / "d").resolve())

    def list_then_swap(fd: int) -> tuple[list[str], list[str]]:
        names = listed(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == real_d:
            (ws / "d").rename(ws / "d.real")
            (ws / "d").symlink_to(outside)
        return names

    monkeypatch.setattr(files, "_list_folder", list_then_swap)
    assert _find(tools, pattern="d/*") == ["d/.gitignore", "d/visible.txt"]


def test_folders_nested_too_deep_are_named_not_entered(
    ws: Path, tools: FileTools, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the depth bound the walk lists folders without entering them, says so naming
    the first, and holds one descriptor per level; a deeper `path` reaches them."""
    monkeypatch.setattr(files, "_MAX_DEPTH", 2)
    _files(ws, "a/b/c/d/deep.txt", "a/b/c2/e/deeper.txt", "a/top.txt")
    listed = files._list_folder
    held: list[int] = []

    def counting(fd: int) -> tuple[list[str], list[str]]:
        held.append(len(os.listdir("/proc/self/fd")))
        return listed(fd)

    monkeypatch.setattr(files, "_list_folder", counting)
    out = str(tools.find_files({"pattern": "**/*.txt"}, tool_context("find_files")))
    assert out.splitlines() == [
        "1 match(es) for '**/*.txt' under '.':",
        "a/top.txt",
        "[2 folder(s) more than 2 levels below '.' were not searched, the first 'a/b/c/'; "
        "to search one, pass it as `path`]",
    ]
    assert max(held) - min(held) <= 2  # the root's descriptor, then one per level
    assert _find(tools, pattern="**/*.txt", path="a/b/c") == ["a/b/c/d/deep.txt"]
