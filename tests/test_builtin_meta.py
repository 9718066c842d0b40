"""The conversation tools: todo list, history, guide, asking the user, the final result."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from builtin_tools import core_tool_names, default_registry
from builtin_tools._workspace import Workspace
from builtin_tools.files import FileTools
from builtin_tools.meta import MetaTools
from dispatcher._exceptions import DispatchInterrupted, ToolError
from dispatcher._types import HistoryEntry, Status, ToolCall, ToolResult

from ._fakes import FakeSession, tool_context


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def meta(ws: Path) -> MetaTools:
    return MetaTools(Workspace(ws))


async def _call(meta: MetaTools, name: str, session: FakeSession, **args: Any) -> str:
    with anyio.fail_after(5):
        return str(await getattr(meta, name)(args, tool_context(name, session)))


def _entry(
    index: int,
    name: str,
    status: Status = Status.ok,
    *,
    deduped: bool = False,
    args: dict[str, Any] | None = None,
    content: str | None = None,
) -> HistoryEntry:
    call = ToolCall(id=f"c{index}", name=name, arguments=args or {"path": f"f{index}.txt"})
    text = f"content of call {index}\nsecond line" if content is None else content
    result = ToolResult(
        call_id=call.id, name=name, status=status, content=text,
        deduped=deduped, started=0.0, duration=0.01,
    )  # fmt: skip
    return HistoryEntry(run_id=1, round=index // 2 + 1, index=index, call=call, result=result)


# -- write_todo ------------------------------------------------------------------------


async def test_write_todo_stores_and_renders_the_list(meta: MetaTools) -> None:
    """The list replaces the session's todo and comes back with marks and counts."""
    session = FakeSession()
    todos = [
        {"content": "read the code", "status": "done"},
        {"content": "write the fix", "status": "in_progress"},
        {"content": "run the tests", "status": "pending"},
    ]
    out = await _call(meta, "write_todo", session, todos=todos)
    assert session.state["todo"] == todos
    assert out.splitlines() == [
        "Todo (1 done, 1 in progress, 1 pending):",
        "[x] read the code",
        "[>] write the fix",
        "[ ] run the tests",
    ]
    assert await _call(meta, "write_todo", session, todos=[]) == "Todo list is empty."
    assert session.state["todo"] == []


async def test_write_todo_refuses_an_unknown_status(meta: MetaTools) -> None:
    """A status outside pending/in_progress/done is refused and the list is unchanged."""
    session = FakeSession()
    session.state["todo"] = [{"content": "keep", "status": "pending"}]
    with pytest.raises(ToolError, match="'finished'"):
        await _call(meta, "write_todo", session, todos=[{"content": "x", "status": "finished"}])
    assert session.state["todo"] == [{"content": "keep", "status": "pending"}]


# -- chat_history ------------------------------------------------------------------------


async def test_chat_history_renders_recent_calls(meta: MetaTools) -> None:
    """Recent calls show run, round, name, short arguments, status, flags and content."""
    session = FakeSession()
    session.history = [_entry(i, "read_files") for i in range(5)]
    session.history.append(_entry(5, "edit_file", Status.failed, deduped=True))
    out = await _call(meta, "chat_history", session, limit=2)
    lines = out.splitlines()
    assert lines[0] == "2 of 6 call(s), oldest first:"
    assert lines[1].startswith('[run 1 round 3 #4] read_files({"path": "f4.txt"}) -> ok: ')
    assert lines[2] == (
        '[run 1 round 3 #5] edit_file({"path": "f5.txt"}) -> failed, deduped: content of call 5 second line'
    )


async def test_chat_history_filters_by_tool_and_shortens(meta: MetaTools) -> None:
    """`tool` keeps one tool's calls; long arguments and content are shortened."""
    session = FakeSession()
    session.history = [
        _entry(0, "fetch_page", args={"url": "https://x/" + "a" * 300}, content="b" * 1000),
        _entry(1, "calculate"),
    ]
    out = await _call(meta, "chat_history", session, tool="fetch_page")
    assert "calculate" not in out
    line = out.splitlines()[1]
    assert len(line) < 400 and line.endswith("…")
    assert await _call(meta, "chat_history", session, tool="nope") == "no calls of 'nope' yet"
    assert await _call(meta, "chat_history", FakeSession()) == "no tool calls yet"


# -- reasoning_guide -------------------------------------------------------------------------


async def test_reasoning_guide_explains_the_core_tools(meta: MetaTools) -> None:
    """The guide tells how to load schemas, call run_tool and batch calls."""
    out = await _call(meta, "reasoning_guide", FakeSession())
    assert 'find_tools(query="select:' in out
    assert "run_tool(name=" in out
    assert "Batch independent calls" in out


# -- ask_user ---------------------------------------------------------------------------------


async def test_ask_user_uses_a_sync_callable_in_a_worker_thread(meta: MetaTools) -> None:
    """A sync callable in the session state answers, off the event loop thread."""
    session = FakeSession()
    seen: list[Any] = []

    def ask(question: str) -> str:
        seen.append((question, threading.current_thread() is threading.main_thread()))
        return "blue"

    session.state["ask_user"] = ask
    assert await _call(meta, "ask_user", session, question="Which colour?") == "blue"
    assert seen == [("Which colour?", False)]


async def test_ask_user_uses_an_async_callable_with_options(meta: MetaTools) -> None:
    """An async callable taking (question, options) gets both and is awaited."""
    session = FakeSession()

    async def ask(question: str, options: list[str]) -> str:
        await anyio.lowlevel.checkpoint()
        return f"{question} -> {options[-1]}"

    session.state["ask_user"] = ask
    out = await _call(meta, "ask_user", session, question="Pick", options=["a", "b"])
    assert out == "Pick -> b"


async def test_ask_user_without_a_way_to_ask_interrupts(meta: MetaTools) -> None:
    """With no callable, ask_user raises DispatchInterrupted carrying the question."""
    session = FakeSession()
    args = {"question": "Deploy now?", "options": ["yes", "no"]}
    with pytest.raises(DispatchInterrupted) as info:
        await meta.ask_user(args, tool_context("ask_user", session, call_id="call_9"))
    [(call, reason, payload)] = info.value.pending
    assert call == ToolCall(id="call_9", name="ask_user", arguments=args)
    assert reason == "ask_user"
    assert payload == {"question": "Deploy now?", "options": ["yes", "no"]}


async def test_ask_user_reports_a_missing_answer(meta: MetaTools) -> None:
    """A callable that returns nothing is reported as no answer, not as empty text."""
    session = FakeSession()
    session.state["ask_user"] = lambda question: None
    assert await _call(meta, "ask_user", session, question="?") == "The user gave no answer."


# -- write_result -------------------------------------------------------------------------------


async def test_write_result_records_and_writes_a_restorable_file(ws: Path, meta: MetaTools) -> None:
    """The result lands in the session state and, with a path, in a file restore_file can undo."""
    session = FakeSession()
    out = await _call(meta, "write_result", session, content="all done")
    assert session.state["result"] == "all done" and out == "result recorded (8 characters)"
    out = await _call(meta, "write_result", session, content="# Report\n", path="out/report.md")
    assert (ws / "out/report.md").read_text() == "# Report\n"
    assert session.state["result"] == "# Report\n"
    assert out.endswith("written to out/report.md")
    FileTools(meta.ws).restore_file({"path": "out/report.md"}, tool_context("restore_file", session))
    assert not (ws / "out/report.md").exists()


async def test_write_result_outside_the_workspace_records_nothing(meta: MetaTools) -> None:
    """A path outside the workspace fails before the result is recorded."""
    session = FakeSession()
    with pytest.raises(ToolError, match="outside the workspace"):
        await _call(meta, "write_result", session, content="x", path="../escape.md")
    assert "result" not in session.state


async def test_write_result_does_not_write_inside_a_git_folder(ws: Path, meta: MetaTools) -> None:
    """write_result refuses a path inside .git and records nothing."""
    session = FakeSession()
    with pytest.raises(ToolError, match=r"inside a \.git folder"):
        await _call(meta, "write_result", session, content="x", path=".git/hooks/pre-commit")
    assert not (ws / ".git").exists() and "result" not in session.state


# -- flags -----------------------------------------------------------------------------------------


def test_core_tools_are_the_non_deferred_builtins(ws: Path) -> None:
    """core_tool_names() lists exactly the builtin tools that are always loaded."""
    reg = default_registry(ws)
    assert core_tool_names() == [t.name for t in reg if not t.deferred]
    assert core_tool_names() == [
        "reasoning_guide", "write_todo", "chat_history", "ask_user", "write_result",
        "error_history", "write_error", "store_secret",
    ]  # fmt: skip


def test_meta_tool_flags(ws: Path) -> None:
    """Concurrency and declared writes match the design; stateful tools are never deduped."""
    reg = default_registry(ws, include=["meta"])
    assert {t.name for t in reg if t.concurrent is True} == {
        "reasoning_guide", "write_todo", "chat_history", "error_history", "write_error",
    }  # fmt: skip
    todo, history, result = reg.get("write_todo"), reg.get("chat_history"), reg.get("write_result")
    assert todo.writes is not None and todo.writes({"todos": []}) == {"state:todo"}
    assert history.writes is not None and history.writes({}) == {"state:chat_history"}
    assert result.writes is not None
    assert result.writes({"content": "x"}) == {"state:result"}
    assert result.writes({"content": "x", "path": "r.md"}) == {
        "state:result", f"file:{ws.resolve()}/r.md",
    }  # fmt: skip
    ask = reg.get("ask_user")
    assert ask.concurrent is False and ask.timeout is not None and ask.timeout >= 3600
