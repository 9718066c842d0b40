"""default_registry, and the builtin tools' flags at work inside a real Dispatcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import builtin_tools
from builtin_tools import GROUPS, core_tool_names, default_registry
from dispatcher import Allow, Answer, Deny, Dispatcher, DispatchInterrupted, Status, Tool, ToolCall
from dispatcher._exceptions import ToolDefinitionError

from ._system import require_program

ALL_TOOLS = [
    "read_files", "find_files", "edit_file", "remove_file", "restore_file", "file_history",
    "run_command", "background_command",
    "fetch_page", "search_web", "http_request", "download_file",
    "reasoning_guide", "write_todo", "chat_history", "ask_user", "write_result",
    "error_history", "write_error", "store_secret",
    "calculate",
]  # fmt: skip


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


def test_default_registry_holds_every_builtin(ws: Path) -> None:
    """Every builtin tool is registered, in group order, and find_tools/run_tool are not."""
    reg = default_registry(ws)
    assert reg.names() == ALL_TOOLS
    assert [n for names in GROUPS.values() for n in names] == ALL_TOOLS
    assert "find_tools" not in reg and "run_tool" not in reg


def test_include_takes_groups_and_names(ws: Path) -> None:
    """`include` selects whole groups and single tools; an unknown name is an error."""
    reg = default_registry(ws, include=["meta", "calculate", "read_files"])
    assert reg.names() == ["read_files", *core_tool_names(), "calculate"]
    assert default_registry(ws, include="shell").names() == ["run_command", "background_command"]
    with pytest.raises(ValueError, match="'edit_files'"):
        default_registry(ws, include=["edit_files"])


def test_workspace_must_be_an_existing_folder(tmp_path: Path) -> None:
    """A missing folder or a file is refused when the registry is built."""
    with pytest.raises(NotADirectoryError, match="missing"):
        default_registry(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        default_registry(tmp_path / "file")


def test_public_names() -> None:
    """The package exports exactly its documented names."""
    assert sorted(builtin_tools.__all__) == [
        "GROUPS", "SandboxStatus", "Workspace", "all_tools", "command_sandbox", "core_tool_names",
        "default_registry", "is_read_only_command",
    ]  # fmt: skip


def test_builtins_can_sit_beside_other_tools(ws: Path) -> None:
    """A registry of builtins takes further tools, and refuses a second tool of a builtin's name."""
    reg = default_registry(ws)
    reg.add(Tool(name="echo", description="Echo.", handler=lambda args, ctx: args))
    assert reg.names()[-1] == "echo"
    with pytest.raises(ToolDefinitionError, match="'calculate' is already registered"):
        reg.add(reg.get("calculate"))


# -- inside a Dispatcher --------------------------------------------------------------------


def _call(call_id: str, name: str, **args: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=args)


def _session(ws: Path, **options: Any) -> Any:
    d = Dispatcher(default_registry(ws), **options)
    s = d.session("s1", mode="direct")
    s.load_tools(ALL_TOOLS)
    return s


async def test_a_read_after_an_edit_in_one_batch_sees_the_edit(ws: Path) -> None:
    """read, edit, read in one message: the first read sees the old text, the second the new."""
    (ws / "a.txt").write_text("old\n")
    s = _session(ws)
    with anyio.fail_after(10):
        results = await s.dispatch(
            [
                _call("c1", "read_files", paths=["a.txt"]),
                _call("c2", "edit_file", path="a.txt", old_string="old", new_string="new"),
                _call("c3", "read_files", paths=["a.txt"]),
            ]
        )
    assert [r.status for r in results] == [Status.ok] * 3
    assert "old" in results[0].content and "new" not in results[0].content
    assert "new" in results[2].content
    assert results[2].deduped is False


async def test_repeated_reads_are_deduped_until_a_write(ws: Path) -> None:
    """A repeated read in one run is answered from the first; a write to it makes it run again."""
    (ws / "a.txt").write_text("one\n")
    s = _session(ws)
    with anyio.fail_after(10):
        first = await s.dispatch([_call("c1", "read_files", paths=["a.txt"])])
        again = await s.dispatch([_call("c2", "read_files", paths=["a.txt"])])
        await s.dispatch([_call("c3", "run_command", command="echo two > a.txt")])
        fresh = await s.dispatch([_call("c4", "read_files", paths=["a.txt"])])
    assert again[0].deduped is True and again[0].content == first[0].content
    assert fresh[0].deduped is False and "two" in fresh[0].content


async def test_only_commands_that_may_write_reach_the_gate(ws: Path) -> None:
    """The gate is asked about `rm`, not about `ls`; its refusal stops the command."""
    require_program("bwrap", package="bubblewrap")  # without a sandbox, `ls` is gated too
    asked: list[str] = []

    def gate(call: ToolCall, ctx: Any) -> Allow | Deny:
        asked.append(str(dict(call.arguments)["command"]))
        return Deny("not today")

    (ws / "keep.txt").write_text("k")
    s = _session(ws, gate=gate)
    with anyio.fail_after(10):
        results = await s.dispatch(
            [_call("c1", "run_command", command="ls"), _call("c2", "run_command", command="rm keep.txt")]
        )
    assert asked == ["rm keep.txt"]
    assert results[0].status is Status.ok and "keep.txt" in results[0].content
    assert results[1].status is Status.denied
    assert (ws / "keep.txt").exists()


async def test_ask_user_interrupts_the_dispatch_and_resumes_with_the_answer(ws: Path) -> None:
    """With no way to ask, ask_user stops the batch; resumed with an Answer decision, the
    answer is its result."""
    s = _session(ws)
    call = _call("q1", "ask_user", question="Which branch?")
    with anyio.fail_after(10):
        with pytest.raises(DispatchInterrupted) as info:
            await s.dispatch([call])
        [(pending, reason, payload)] = info.value.pending
        assert (pending.id, reason, payload["question"]) == ("q1", "ask_user", "Which branch?")
        results = await s.dispatch([call], decisions={"q1": Answer("main")})
    assert results[0].status is Status.ok and results[0].content == "main"


async def test_chat_history_is_never_answered_from_an_earlier_call(ws: Path) -> None:
    """A second chat_history in the same run runs again and sees the calls made since."""
    s = _session(ws)
    with anyio.fail_after(10):
        await s.dispatch([_call("c1", "calculate", expression="1 + 1")])
        first = await s.dispatch([_call("c2", "chat_history")])
        await s.dispatch([_call("c3", "calculate", expression="2 + 2")])
        second = await s.dispatch([_call("c4", "chat_history")])
    assert second[0].deduped is False
    assert "2 + 2" not in first[0].content and "2 + 2" in second[0].content
