"""The values that cross pass boundaries: ToolCall parsing, ToolResult messages, Status."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from dispatcher import Status, ToolCall, ToolResult


def test_parse_openai_chat_item() -> None:
    """An OpenAI chat tool_calls item parses to id, name and the JSON-string arguments."""
    item = {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "hi"}'}}
    assert ToolCall.parse(item) == ToolCall(id="call_1", name="echo", arguments='{"text": "hi"}')


def test_parse_openai_chat_item_without_arguments() -> None:
    """An OpenAI chat item with no or empty arguments gets an empty mapping."""
    item = {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": ""}}
    assert ToolCall.parse(item).arguments == {}


def test_parse_openai_responses_function_call() -> None:
    """A Responses function_call item uses call_id (not the item id) as the call id."""
    item = {
        "type": "function_call",
        "id": "fc_123",
        "call_id": "call_abc",
        "name": "echo",
        "arguments": '{"text": "x"}',
    }
    assert ToolCall.parse(item) == ToolCall(id="call_abc", name="echo", arguments='{"text": "x"}')


def test_parse_openai_responses_without_call_id_uses_id() -> None:
    """A Responses item without call_id falls back to its id."""
    item = {"type": "function_call", "id": "fc_9", "name": "echo", "arguments": "{}"}
    assert ToolCall.parse(item).id == "fc_9"


def test_parse_anthropic_tool_use() -> None:
    """An Anthropic tool_use block parses with its input as the arguments mapping."""
    block = {"type": "tool_use", "id": "toolu_1", "name": "echo", "input": {"text": "hi"}}
    assert ToolCall.parse(block) == ToolCall(id="toolu_1", name="echo", arguments={"text": "hi"})


def test_parse_own_dict_shape() -> None:
    """A dict of id, name and arguments parses as our own shape."""
    call = ToolCall.parse({"id": "c1", "name": "echo", "arguments": {"text": "x"}})
    assert call == ToolCall(id="c1", name="echo", arguments={"text": "x"})
    assert ToolCall.parse({"id": 5, "name": "echo"}) == ToolCall(id="5", name="echo", arguments={})


def test_parse_a_tool_call_returns_it() -> None:
    """A ToolCall parses to itself."""
    call = ToolCall(id="c1", name="echo")
    assert ToolCall.parse(call) is call


@pytest.mark.parametrize("item", [None, "echo", 42, ["id", "name"]])
def test_parse_non_mapping_is_type_error(item: Any) -> None:
    """Something that is not a mapping is a TypeError showing the value."""
    with pytest.raises(TypeError, match="must be a ToolCall or a mapping"):
        ToolCall.parse(item)


@pytest.mark.parametrize(
    "item",
    [{}, {"name": "echo"}, {"id": "x"}, {"type": "text", "text": "hi"}, {"function": "echo", "id": "1"}],
)
def test_parse_unknown_shape_is_value_error(item: dict[str, Any]) -> None:
    """A mapping in no known shape is a ValueError."""
    with pytest.raises(ValueError, match="not a tool call"):
        ToolCall.parse(item)


def test_tool_call_is_frozen() -> None:
    """ToolCall is frozen; change it with attrs.evolve."""
    call = ToolCall(id="c1", name="echo")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        call.name = "other"  # type: ignore[misc]
    assert attrs.evolve(call, name="other").name == "other"


def _result(status: Status = Status.ok, content: str = "hi") -> ToolResult:
    return ToolResult(call_id="c1", name="echo", status=status, content=content)


def test_to_message_openai() -> None:
    """For OpenAI the message is role tool with the call id and content."""
    assert _result().to_message("openai") == {"role": "tool", "tool_call_id": "c1", "content": "hi"}
    assert _result().to_message() == _result().to_message("openai")


def test_to_message_anthropic_ok_has_no_is_error() -> None:
    """For Anthropic a success is a tool_result block without is_error."""
    assert _result().to_message("anthropic") == {"type": "tool_result", "tool_use_id": "c1", "content": "hi"}


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.ok])
def test_to_message_anthropic_failure_has_is_error(status: Status) -> None:
    """For Anthropic every failure carries is_error true."""
    msg = _result(status, '{"error": "x"}').to_message("anthropic")
    assert msg["is_error"] is True
    assert msg["tool_use_id"] == "c1"


def test_to_message_responses() -> None:
    """For Responses the message is a function_call_output item."""
    assert _result().to_message("responses") == {
        "type": "function_call_output",
        "call_id": "c1",
        "output": "hi",
    }


def test_to_message_unknown_provider_is_value_error() -> None:
    """An unknown provider is a ValueError naming it."""
    with pytest.raises(ValueError, match="'gemini'"):
        _result().to_message("gemini")  # type: ignore[arg-type]


def test_to_json_from_json_round_trip() -> None:
    """to_json and from_json round-trip every field, through real JSON text."""
    r = ToolResult(
        call_id="c9",
        name="fetch",
        status=Status.timed_out,
        content='{"error": "slow"}',
        retryable=True,
        effect_uncertain=True,
        cached=False,
        deduped=True,
        started=1_700_000_000.25,
        duration=2.5,
    )
    data = r.to_json()
    assert data["status"] == "timed_out"
    assert set(data) == {f.name for f in attrs.fields(ToolResult)}
    assert ToolResult.from_json(json.loads(json.dumps(data))) == r


def test_from_json_fills_missing_flags() -> None:
    """from_json defaults the flags and timings a record may leave out."""
    r = ToolResult.from_json({"call_id": "c1", "name": "t", "status": "ok", "content": "x"})
    assert r == ToolResult(call_id="c1", name="t", status=Status.ok, content="x")


def test_error_reads_the_failure_json() -> None:
    """error() gives the failure JSON of a failed result and None for ok."""
    failed = _result(Status.failed, '{"error": "boom", "status": "failed"}\nnext: retry')
    assert failed.error() == {"error": "boom", "status": "failed"}
    assert _result().error() is None
    assert _result(Status.failed, "not json").error() is None
    assert _result().ok and not failed.ok


def test_status_values_are_the_eight_of_the_contract() -> None:
    """Status holds exactly the eight values of DESIGN.md, as strings."""
    assert [s.value for s in Status] == [
        "ok",
        "failed",
        "rejected",
        "invalid_arguments",
        "schema_required",
        "denied",
        "timed_out",
        "expired",
    ]
    assert all(isinstance(s, str) for s in Status)
    assert Status("denied") is Status.denied
    assert Status.ok == "ok"
