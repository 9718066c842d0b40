"""ScriptedRunner: every pass runs, but calls are answered from a script."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from dispatcher import (
    Dispatcher,
    Registry,
    ScriptedRunner,
    Status,
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
)

from ._fakes import file_at_path, path_schema


def _never(args: Mapping[str, Any], ctx: Any) -> str:
    raise AssertionError("a scripted dispatcher never runs a handler")


REGISTRY = Registry(
    [
        Tool("read", "Read.", _never, path_schema(), deferred=False, concurrent=True, reads=file_at_path),
        Tool(
            "write",
            "Write.",
            _never,
            path_schema(text={"type": "string"}),
            deferred=False,
            writes=file_at_path,
        ),
        Tool("clock", "Time.", _never, {"type": "object"}, deferred=False),
        Tool("danger", "Gated.", _never, {"type": "object"}, deferred=False, confirm=True),
    ]
)


async def test_calls_are_answered_in_turn_and_every_pass_still_runs() -> None:
    """A list answers a tool's calls in turn (the last repeats); dedupe, validation and the
    write's invalidation still apply; `calls` lists what ran."""
    runner = ScriptedRunner({"read": ["v1", "v2"], "write": "written"})
    s = Dispatcher(REGISTRY, runner=runner).session("s")
    first = await s.dispatch([ToolCall("1", "read", {"path": "/a"}), ToolCall("2", "read", {"path": "/a"})])
    assert [r.content for r in first] == ["v1", "v1"] and first[1].deduped
    [bad] = await s.dispatch([ToolCall("3", "read", {"path": 5})])
    assert bad.status is Status.invalid_arguments
    await s.dispatch([ToolCall("4", "write", {"path": "/a", "text": "x"})])
    [again] = await s.dispatch([ToolCall("5", "read", {"path": "/a"})])
    assert again.content == "v2" and not again.deduped
    [third] = await s.dispatch([ToolCall("6", "read", {"path": "/b"})])
    assert third.content == "v2"  # the last answer repeats
    assert [c.id for c in runner.calls] == ["1", "4", "5", "6"]


async def test_callables_results_and_exceptions_are_answers() -> None:
    """A callable sees the arguments (and ctx if it takes it); a ToolResult is served with the
    call's id; an exception fails the call as the tool would; an unscripted tool fails."""
    served = ToolResult("other", "other", Status.ok, "from a result")

    async def clock(args: Mapping[str, Any], ctx: Any) -> str:
        return f"noon in {ctx.session_id}"

    runner = ScriptedRunner(
        {
            "read": lambda args: f"read {args['path']}",
            "clock": clock,
            "write": served,
            "danger": ToolError("no", retryable=False),
        }
    )
    d = Dispatcher(REGISTRY, runner=runner)
    results = await d.session("s").dispatch(
        [
            ToolCall("1", "read", {"path": "/a"}),
            ToolCall("2", "clock", {}),
            ToolCall("3", "write", {"path": "/a", "text": "x"}),
            ToolCall("4", "danger", {}),
        ]
    )
    assert [r.content for r in results[:3]] == ["read /a", "noon in s", "from a result"]
    assert results[2].call_id == "3" and results[2].name == "write"
    assert (
        results[3].status is Status.failed
        and not results[3].retryable
        and '"error": "no"' in results[3].content
    )
    [missing] = (
        await Dispatcher(REGISTRY, runner=ScriptedRunner({}))
        .session("t")
        .dispatch([ToolCall("5", "clock", {})])
    )
    assert missing.status is Status.failed and "not in the script" in missing.content


@pytest.mark.parametrize("script", [{"read": []}])
async def test_an_empty_list_fails_the_call(script: dict[str, Any]) -> None:
    """A tool scripted with an empty list has no answer: its call fails, saying so."""
    [r] = (
        await Dispatcher(REGISTRY, runner=ScriptedRunner(script))
        .session("s")
        .dispatch([ToolCall("1", "read", {"path": "/a"})])
    )
    assert r.status is Status.failed and "empty list" in r.content
