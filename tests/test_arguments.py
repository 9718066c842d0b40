"""The arguments the model sent stay what it sent: validation checks them before defaults
are filled, and history keeps them, whatever the handler does with its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from dispatcher import Dispatcher, Registry, Status, Tool, ToolCall


def _typed_with_null_default(seen: list[Mapping[str, Any]]) -> Tool:
    def handler(args: Mapping[str, Any], ctx: Any) -> str:
        seen.append(dict(args))
        return "ok"

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "default": None}},
        "required": ["city"],
    }
    return Tool("weather", "Weather.", handler, schema, deferred=False)


async def test_a_default_that_fails_its_own_schema_warns_once_and_calls_still_run() -> None:
    """`default: null` on a string parameter: registration warns (UserWarning), and a call
    that leaves the parameter out is valid, its handler getting the default."""
    seen: list[Mapping[str, Any]] = []
    with pytest.warns(UserWarning, match="the default of 'unit' fails its own schema"):
        registry = Registry([_typed_with_null_default(seen)])
    [r] = await Dispatcher(registry).session("s").dispatch([ToolCall("1", "weather", {"city": "Oslo"})])
    assert r.status is Status.ok
    assert seen == [{"city": "Oslo", "unit": None}]


async def test_validation_names_only_what_the_model_sent() -> None:
    """A wrong value the model did send is refused naming it; the defaulted parameter it left
    out is never named."""
    with pytest.warns(UserWarning):
        registry = Registry([_typed_with_null_default([])])
    [r] = await Dispatcher(registry).session("s").dispatch([ToolCall("1", "weather", {"city": 5})])
    assert r.status is Status.invalid_arguments
    assert "$['city']" in r.content and "unit" not in r.content.split("\n", 1)[0]


async def test_history_keeps_what_was_sent_whatever_the_handler_changes() -> None:
    """A handler that keeps its arguments and changes them later rewrites nothing: history
    shows the call as the model sent it, without the filled default."""
    kept: list[Any] = []

    def collect(args: Mapping[str, Any], ctx: Any) -> str:
        kept.append(args)
        args["items"].append("added by the handler")
        return "collected"

    schema = {
        "type": "object",
        "properties": {"items": {"type": "array"}, "limit": {"type": "integer", "default": 10}},
    }
    reg = Registry([Tool("collect", "Collect.", collect, schema, deferred=False)])
    s = Dispatcher(reg).session("s")
    await s.dispatch([ToolCall("1", "collect", {"items": ["a"]})])
    kept[0]["items"].append("and later")
    [entry] = s.history
    assert entry.args == {"items": ["a"]}
    assert s.history[0].args == {"items": ["a"]}  # every reader gets its own copy
    assert kept[0]["limit"] == 10  # the handler saw the default
