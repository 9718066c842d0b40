"""What `dispatch` accepts: the SDKs' own objects and whole assistant messages, built with
the `openai` and `anthropic` SDKs' types from the JSON a real API response holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from anthropic.types import Message, ToolUseBlock
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall
from openai.types.responses import Response, ResponseFunctionToolCall

import dispatcher
from dispatcher import Dispatcher, Registry, Tool, ToolCall, replay
from dispatcher._messages import tool_calls_of

from ._fakes import TEXT_SCHEMA
from ._recorded import kinds, read_lines


def echo(args: Any, ctx: Any) -> str:
    return str(args["text"])


def registry() -> Registry:
    return Registry(
        [Tool(name="echo", description="Echo.", handler=echo, parameters=TEXT_SCHEMA, deferred=False)]
    )


def chat_completion(*tool_calls: dict[str, Any], content: str | None = None) -> ChatCompletion:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1764576000,
            "model": "gpt-4.1-mini-2025-04-14",
            "choices": [
                {"index": 0, "message": message, "logprobs": None,
                 "finish_reason": "tool_calls" if tool_calls else "stop"}
            ],
            "usage": {"prompt_tokens": 80, "completion_tokens": 40, "total_tokens": 120},
            "service_tier": "default",
            "system_fingerprint": None,
        }
    )  # fmt: skip


def chat_call(call_id: str, text: str) -> dict[str, Any]:
    arguments = json.dumps({"text": text})
    return {"id": call_id, "type": "function", "function": {"name": "echo", "arguments": arguments}}


def anthropic_message(*content: dict[str, Any]) -> Message:
    return Message.model_validate(
        {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5-20250929",
            "content": list(content),
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 400, "output_tokens": 90, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "service_tier": "standard"},
        }
    )  # fmt: skip


def tool_use(block_id: str, text: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id, "name": "echo", "input": {"text": text}}


THINKING = {"type": "thinking", "thinking": "Both need echo.", "signature": "EqQBCkYIBxgCKkB"}
TEXT = {"type": "text", "text": "I'll echo both.", "citations": None}


def response(*output: dict[str, Any]) -> Response:
    return Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 1764576000,
            "status": "completed",
            "model": "gpt-4.1-mini-2025-04-14",
            "output": list(output),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
        }
    )


def function_call(call_id: str, text: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": "echo",
            "arguments": json.dumps({"text": text}), "status": "completed"}  # fmt: skip


REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None}
OUTPUT_MESSAGE = {
    "type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
    "content": [{"type": "output_text", "text": "Echoing.", "annotations": []}],
}  # fmt: skip


async def dispatched(batch: Any) -> list[tuple[str, str, str]]:
    results = await Dispatcher(registry()).session("s", mode="direct").dispatch(batch)
    return [(r.call_id, r.status.value, r.content) for r in results]


# -- OpenAI chat ------------------------------------------------------------------------


async def test_chat_sdk_tool_calls_dispatch_with_their_ids() -> None:
    """`message.tool_calls` of a ChatCompletion dispatches: each call runs, keeping its id."""
    message = chat_completion(chat_call("call_a", "a"), chat_call("call_b", "b")).choices[0].message
    assert await dispatched(message.tool_calls) == [("call_a", "ok", "a"), ("call_b", "ok", "b")]


async def test_a_whole_chat_message_dispatches_its_tool_calls() -> None:
    """A ChatCompletionMessage is a batch: its tool calls, in order."""
    message = chat_completion(chat_call("call_a", "a"), chat_call("call_b", "b")).choices[0].message
    assert await dispatched(message) == [("call_a", "ok", "a"), ("call_b", "ok", "b")]


async def test_a_chat_message_with_no_tool_calls_is_an_empty_batch() -> None:
    """A text-only chat message, as the SDK object or as a dict, has no calls and no results."""
    message = chat_completion(content="Done.").choices[0].message
    assert message.tool_calls is None
    assert await dispatched(message) == []
    assert await dispatched({"role": "assistant", "content": "Done."}) == []


async def test_a_chat_message_dict_dispatches_its_tool_calls() -> None:
    """A chat message as a dict (`{"role": "assistant", "tool_calls": [...]}`) is a batch."""
    message = {"role": "assistant", "content": None, "tool_calls": [chat_call("call_a", "a")]}
    assert await dispatched(message) == [("call_a", "ok", "a")]


# -- Anthropic --------------------------------------------------------------------------


async def test_anthropic_tool_use_blocks_dispatch_with_their_ids() -> None:
    """ToolUseBlock objects dispatch: each call runs, keeping its `toolu_` id."""
    blocks = [b for b in anthropic_message(tool_use("toolu_1", "a"), tool_use("toolu_2", "b")).content]
    assert all(isinstance(b, ToolUseBlock) for b in blocks)
    assert await dispatched(blocks) == [("toolu_1", "ok", "a"), ("toolu_2", "ok", "b")]


async def test_an_anthropic_message_skips_its_text_and_thinking() -> None:
    """A whole Anthropic Message, or its `content`, gives results for its tool_use blocks only."""
    message = anthropic_message(THINKING, TEXT, tool_use("toolu_1", "a"), tool_use("toolu_2", "b"))
    want = [("toolu_1", "ok", "a"), ("toolu_2", "ok", "b")]
    assert await dispatched(message) == want
    assert await dispatched(message.content) == want
    as_dicts = [b.model_dump() for b in message.content]
    assert await dispatched(as_dicts) == want
    assert await dispatched({"role": "assistant", "content": as_dicts}) == want


async def test_server_tool_blocks_are_skipped() -> None:
    """Blocks the provider ran itself (server_tool_use and its result) are not the client's calls."""
    message = anthropic_message(
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
        tool_use("toolu_1", "a"),
    )
    assert await dispatched(message) == [("toolu_1", "ok", "a")]


# -- OpenAI Responses -------------------------------------------------------------------


async def test_responses_function_calls_dispatch_with_their_call_ids() -> None:
    """ResponseFunctionToolCall items dispatch under their `call_id`, not their item `id`."""
    output = response(function_call("call_1", "a"), function_call("call_2", "b")).output
    assert all(isinstance(i, ResponseFunctionToolCall) for i in output)
    assert await dispatched(output) == [("call_1", "ok", "a"), ("call_2", "ok", "b")]


async def test_a_response_skips_reasoning_and_messages() -> None:
    """A whole Response, or its `output`, gives results for its function calls only."""
    r = response(REASONING, function_call("call_1", "a"), OUTPUT_MESSAGE, function_call("call_2", "b"))
    want = [("call_1", "ok", "a"), ("call_2", "ok", "b")]
    assert await dispatched(r) == want
    assert await dispatched(r.output) == want
    assert await dispatched([i.model_dump() for i in r.output]) == want


# -- malformed items keep their ids -------------------------------------------------------


async def test_a_malformed_item_keeps_its_real_id() -> None:
    """An item pass 1 cannot read is that call's invalid_arguments under the id it carries."""
    broken_chat = ChatCompletionMessageFunctionToolCall.model_construct(
        id="call_x", type="function", function=None
    )
    broken_responses = {"type": "function_call", "id": "fc_9", "call_id": "call_r", "name": "echo",
                        "arguments": "{not json"}  # fmt: skip
    results = await dispatched(
        [
            {"id": "call_9", "function": "oops"},
            broken_chat,
            broken_responses,
            SimpleNamespace(id="call_o"),
            42,
        ]
    )
    assert [(i, s) for i, s, _ in results] == [
        ("call_9", "invalid_arguments"),
        ("call_x", "invalid_arguments"),
        ("call_r", "invalid_arguments"),
        ("call_o", "invalid_arguments"),
        ("call_4", "invalid_arguments"),
    ]
    assert "unreadable tool call" in results[0][2] and "got ChatCompletion" not in results[1][2]


async def test_a_call_of_an_unsupported_kind_is_answered_not_dropped() -> None:
    """A client call of a kind this library cannot run (chat `custom`) is answered, not dropped."""
    custom = {"id": "call_c", "type": "custom", "custom": {"name": "grammar", "input": "x"}}
    message = chat_completion(chat_call("call_a", "a"), custom).choices[0].message
    assert [(i, s) for i, s, _ in await dispatched(message)] == [
        ("call_a", "ok"),
        ("call_c", "invalid_arguments"),
    ]


async def test_objects_of_a_call_shape_are_read_by_attribute() -> None:
    """An object that is not pydantic but has a call's attributes (say, a dataclass) dispatches."""
    chat = SimpleNamespace(
        id="c1", type="function", function=SimpleNamespace(name="echo", arguments='{"text": "a"}')
    )
    block = SimpleNamespace(type="tool_use", id="c2", name="echo", input={"text": "b"})
    text = SimpleNamespace(type="text", text="skipped")
    assert await dispatched([chat, text, block]) == [("c1", "ok", "a"), ("c2", "ok", "b")]


def test_toolcall_parse_reads_sdk_objects() -> None:
    """ToolCall.parse takes the SDKs' objects as it takes their dicts."""
    chat = chat_completion(chat_call("call_a", "a")).choices[0].message.tool_calls
    assert chat is not None
    assert ToolCall.parse(chat[0]) == ToolCall("call_a", "echo", '{"text": "a"}')
    block = anthropic_message(tool_use("toolu_1", "b")).content[0]
    assert ToolCall.parse(block) == ToolCall("toolu_1", "echo", {"text": "b"})
    item = response(function_call("call_1", "c")).output[0]
    assert ToolCall.parse(item) == ToolCall("call_1", "echo", '{"text": "c"}')


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"role": "user", "content": "hi"}, "got a 'user' message"),
        ({"id": "c1", "type": "function", "function": {"name": "echo"}}, "a batch of tool calls"),
        ("echo", "a batch of tool calls"),
        (chat_completion(chat_call("call_a", "a")), r"choices\[0\]\.message"),
    ],
)
def test_what_is_neither_a_batch_nor_an_assistant_message_is_a_type_error(batch: Any, match: str) -> None:
    """A lone call, a user message or a whole ChatCompletion is a TypeError saying what to pass."""
    with pytest.raises(TypeError, match=match):
        tool_calls_of(batch)


def test_a_list_of_chat_dicts_passes_through_untouched() -> None:
    """The cheap path: a list of OpenAI chat dicts (or ToolCalls) comes back as the same items."""
    calls: list[Any] = [chat_call(f"c{i}", "x") for i in range(3)] + [ToolCall("c3", "echo", {"text": "x"})]
    out = tool_calls_of(calls)
    assert out == calls and out is not calls
    assert all(a is b for a, b in zip(out, calls, strict=True))


# -- recording and replay -------------------------------------------------------------------


async def test_the_recording_holds_the_calls_and_replays(tmp_path: Path) -> None:
    """A session fed SDK messages records their calls (not the text blocks), and replays clean."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("s", mode="direct", record=path)
    await s.dispatch(chat_completion(chat_call("call_a", "a")).choices[0].message)
    await s.dispatch(anthropic_message(TEXT, tool_use("toolu_1", "b")))
    await s.dispatch(response(REASONING, function_call("call_1", "c")))
    await s.dispatch([{"id": "call_9", "function": "oops"}])
    assert kinds(path)[1:] == ["rows", "batch", "batch", "batch"]  # the chat message's calls: rows
    batches = read_lines(path)[1:]
    assert [b["calls"] for b in batches] == [
        [{"id": "call_a", "name": "echo", "arguments": '{"text": "a"}'}],
        [{"id": "toolu_1", "name": "echo", "arguments": {"text": "b"}}],
        [{"id": "call_1", "name": "echo", "arguments": '{"text": "c"}'}],
        [{"raw": {"id": "call_9", "function": "oops"}}],
    ]
    report = await replay(path, Dispatcher(registry()))
    assert report.divergence is None and report.calls == 4


# -- the kernel does not import the SDKs -------------------------------------------------------


def test_the_kernel_imports_no_sdk() -> None:
    """dispatcher/ names neither SDK in an import, and importing it loads neither."""
    root = Path(dispatcher.__file__).parent
    for source in root.glob("*.py"):
        for line in source.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in ("openai", "anthropic"), f"{source.name}: {line}"
    code = "import sys, dispatcher; print(sorted({'openai', 'anthropic'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_no_call_kind_is_skipped() -> None:
    """The kinds of block that are skipped include none that ToolCall.parse reads as a call."""
    from dispatcher._messages import NOT_CALLS

    assert not NOT_CALLS & {"function", "tool_use", "function_call"}
