"""Provider formats, checked against the SDKs' own types: the tool messages a batch's results
become (`Session.tool_messages`), and the tools array of a request (`request_tools`),
including Responses' `strict`."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
from anthropic.types import MessageParam, ToolParam, ToolResultBlockParam, UserMessageParam
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionToolParam,
)
from openai.types.responses import FunctionToolParam, ResponseInputItemParam, ResponseInputParam
from openai.types.responses.response_input_item_param import FunctionCallOutput
from openai.types.shared_params import FunctionDefinition
from pydantic import TypeAdapter

from dispatcher import Dispatcher, Registry, Status, Tool, ToolResult
from dispatcher._providers import tool_entry, tool_messages
from dispatcher._registry import strict_problem

from ._fakes import TEXT_SCHEMA
from .test_messages import (
    REASONING,
    TEXT,
    THINKING,
    anthropic_message,
    chat_call,
    chat_completion,
    function_call,
    response,
    tool_use,
)


def closed(properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema as strict mode wants it: every property required, no others."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


WITH_DEFAULT = {"type": "string", "default": "x"}
OPEN_ITEMS = {"type": "array", "items": {"type": "object", "properties": {}}}
STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": "what to echo"},
        "times": {"type": ["integer", "null"], "minimum": 1},
        "style": {
            "type": "object",
            "properties": {"case": {"enum": ["upper", "lower"]}},
            "required": ["case"],
            "additionalProperties": False,
        },
    },
    "required": ["text", "times", "style"],
    "additionalProperties": False,
}


def echo(args: Any, ctx: Any) -> str:
    return str(args["text"])


def boom(args: Any, ctx: Any) -> str:
    raise RuntimeError("no")


def registry() -> Registry:
    return Registry(
        [
            Tool(name="echo", description="Echo.", handler=echo, parameters=TEXT_SCHEMA, deferred=False),
            Tool(name="boom", description="Fails.", handler=boom, deferred=False),
            Tool(name="shout", description="Strict.", handler=echo, parameters=STRICT_SCHEMA, strict=True),
            Tool(name="later", description="Deferred.", handler=echo, parameters=TEXT_SCHEMA),
        ]
    )


@functools.cache
def adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def conforms(kind: Any, value: Any) -> None:
    """`value` validates as the SDK's `kind`; a TypedDict's also has no key `kind` lacks
    (pydantic lets unknown keys of a TypedDict through)."""
    adapter(kind).validate_python(value)
    if hasattr(kind, "__optional_keys__"):
        unknown = set(value) - (kind.__required_keys__ | kind.__optional_keys__)
        assert not unknown, f"{kind.__name__} has no {sorted(unknown)}"


async def results_of(batch: Any) -> list[ToolResult]:
    return await Dispatcher(registry()).session("s", mode="direct").dispatch(batch)


def boom_chat(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "boom", "arguments": "{}"}}


# -- tool messages ----------------------------------------------------------------------------


async def test_openai_tool_messages_are_the_sdk_tool_message_params() -> None:
    """OpenAI chat: one valid `role: tool` message per call, in order, making a valid next request."""
    completion = chat_completion(chat_call("call_a", "a"), boom_chat("call_b"), chat_call("call_c", "c"))
    message = completion.choices[0].message
    results = await results_of(message)
    out = Dispatcher(registry()).session().tool_messages(results, "openai")
    for m in out:
        conforms(ChatCompletionToolMessageParam, m)
    assert [(m["role"], m["tool_call_id"]) for m in out] == [
        ("tool", "call_a"),
        ("tool", "call_b"),
        ("tool", "call_c"),
    ]
    assert out[0]["content"] == "a" and '"status": "failed"' in out[1]["content"]
    history = [{"role": "user", "content": "go"}, message.model_dump(exclude_none=True), *out]
    adapter(list[ChatCompletionMessageParam]).validate_python(history)


async def test_anthropic_tool_messages_are_one_user_message() -> None:
    """Anthropic: ONE valid user message holding every tool_result block in order, is_error on failures."""
    message = anthropic_message(
        THINKING,
        TEXT,
        tool_use("toolu_1", "a"),
        {"type": "tool_use", "id": "toolu_2", "name": "boom", "input": {}},
        tool_use("toolu_3", "c"),
    )
    results = await results_of(message)
    out = tool_messages(results, "anthropic")
    assert len(out) == 1
    conforms(MessageParam, out[0])
    conforms(UserMessageParam, out[0])
    blocks = out[0]["content"]
    for b in blocks:
        conforms(ToolResultBlockParam, b)
    assert out[0]["role"] == "user"
    assert [b["tool_use_id"] for b in blocks] == ["toolu_1", "toolu_2", "toolu_3"]
    assert [b.get("is_error", False) for b in blocks] == [False, True, False]
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        *out,
    ]
    adapter(list[MessageParam]).validate_python(history)


async def test_responses_tool_messages_are_function_call_outputs() -> None:
    """Responses: one valid `function_call_output` item per call, under its `call_id`, in order."""
    r = response(REASONING, function_call("call_1", "a"), function_call("call_2", "b"))
    results = await results_of(r)
    for provider in ("responses", "openai-responses"):
        out = tool_messages(results, provider)  # type: ignore[arg-type]
        for item in out:
            conforms(FunctionCallOutput, item)
            conforms(ResponseInputItemParam, item)
        assert [(i["type"], i["call_id"], i["output"]) for i in out] == [
            ("function_call_output", "call_1", "a"),
            ("function_call_output", "call_2", "b"),
        ]
    items = [{"role": "user", "content": "go"}, *(i.model_dump(exclude_none=True) for i in r.output), *out]
    adapter(ResponseInputParam).validate_python(items)


def test_an_empty_batch_has_no_anthropic_message() -> None:
    """No results, nothing to append: an empty user message is not sent to Anthropic."""
    assert tool_messages([], "anthropic") == []
    assert tool_messages([], "openai") == []


def test_an_unknown_provider_is_a_value_error_naming_it() -> None:
    """tool_messages and request_tools refuse a provider they do not know, naming it."""
    s = Dispatcher(registry()).session()
    with pytest.raises(ValueError, match="'gemini'"):
        s.tool_messages([], "gemini")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'gemini'"):
        s.request_tools("gemini")  # type: ignore[arg-type]


def test_to_message_gives_the_single_message_it_always_gave() -> None:
    """ToolResult.to_message still gives one provider message per result (the alias too)."""
    r = ToolResult(call_id="c1", name="echo", status=Status.failed, content="x")
    assert r.to_message("openai") == {"role": "tool", "tool_call_id": "c1", "content": "x"}
    assert r.to_message("anthropic") == {
        "type": "tool_result",
        "tool_use_id": "c1",
        "content": "x",
        "is_error": True,
    }
    assert r.to_message("openai-responses") == r.to_message("responses")


# -- the tools array ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "deferred"])
def test_request_tools_are_the_sdk_tool_params(mode: str) -> None:
    """Every entry of request_tools validates as the SDK's tool param, in both modes."""
    s = Dispatcher(registry()).session("s", mode=mode)  # type: ignore[arg-type]
    for entry in s.request_tools("openai"):
        conforms(ChatCompletionToolParam, entry)
        conforms(FunctionDefinition, entry["function"])
    for entry in s.request_tools("anthropic"):
        conforms(ToolParam, entry)
    for provider in ("responses", "openai-responses"):
        for entry in s.request_tools(provider):  # type: ignore[arg-type]
            conforms(FunctionToolParam, entry)
            assert isinstance(entry["strict"], bool)


def test_responses_strict_is_granted_only_to_a_strict_tool_with_a_strict_schema(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Responses says `strict` on every tool, true only when asked for and the schema can take it."""
    reg = registry()
    with caplog.at_level(logging.WARNING, logger="threepass.registry"):
        reg.add(Tool(name="loose", description="Asks.", handler=echo, parameters=TEXT_SCHEMA, strict=True))
    assert "'loose' asks for strict mode" in caplog.text and "additionalProperties" in caplog.text
    d = Dispatcher(reg)
    direct = {e["name"]: e["strict"] for e in d.session("a", mode="direct").request_tools("responses")}
    assert direct == {"find_tools": False, "echo": False, "boom": False, "shout": False, "later": False,
                      "loose": False}  # fmt: skip
    s = d.session("b", mode="direct")
    s.load_tools(["shout"])  # loaded: no longer a stub, so its schema goes out, strict
    assert {e["name"]: e["strict"] for e in s.request_tools("responses")}["shout"] is True
    deferred = {e["name"]: e["strict"] for e in d.session("c").request_tools("responses")}
    assert deferred["run_tool"] is False and deferred["find_tools"] is False


def test_chat_and_anthropic_say_strict_only_when_granted() -> None:
    """OpenAI chat and Anthropic carry `strict: true` for a granted tool and leave it out otherwise."""
    reg = registry()
    shout, echo_tool = reg.get("shout"), reg.get("echo")
    assert tool_entry(shout, "openai")["function"]["strict"] is True
    assert tool_entry(shout, "anthropic")["strict"] is True
    assert "strict" not in tool_entry(echo_tool, "openai")["function"]
    assert "strict" not in tool_entry(echo_tool, "anthropic")
    assert "strict" not in tool_entry(shout, "anthropic", stub=True)


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (STRICT_SCHEMA, None),
        ({"type": "object", "properties": {}, "additionalProperties": False}, None),
        (TEXT_SCHEMA, "$ does not set additionalProperties to false"),
        ({**STRICT_SCHEMA, "required": ["text"]}, "$ does not require style, times"),
        (
            {**STRICT_SCHEMA, "properties": {**STRICT_SCHEMA["properties"], "text": WITH_DEFAULT}},
            "$.properties.text uses default",
        ),
        (
            closed({"xs": OPEN_ITEMS}),
            "$.properties.xs.items does not set additionalProperties to false",
        ),
        ({"anyOf": [{"type": "object"}]}, "the root is an anyOf"),
        ({"type": "object", "properties": {}, "additionalProperties": False, "allOf": []}, "$ uses allOf"),
    ],
)  # fmt: skip
def test_strict_problem_names_what_strict_mode_cannot_take(
    schema: dict[str, Any], problem: str | None
) -> None:
    """strict_problem is None for a schema strict mode takes, else says where and why it cannot."""
    assert strict_problem(schema) == problem


def test_strict_problem_refuses_a_schema_nested_too_deep() -> None:
    """More than ten levels of nesting is past what strict mode takes."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(11):
        schema = {
            "type": "object",
            "properties": {"x": schema},
            "required": ["x"],
            "additionalProperties": False,
        }
    assert "nests deeper than 10 levels" in (strict_problem(schema) or "")
