"""The calls of what a model sent: a batch of call items, or a whole assistant message.

`tool_calls_of` turns what `dispatch` is given into the list of call items pass 1
plans, one result each. It accepts a list of calls (the cheap path: OpenAI chat dicts
are passed through untouched), an OpenAI chat message (its `tool_calls`), an Anthropic
message (its `content`), a Responses response (its `output`), or such a `content` /
`output` list. Blocks that are not calls the client answers (text, thinking,
reasoning, the provider's own server-side tool blocks) are left out; anything else
stays, so an item in no known shape is still that call's `invalid_arguments`.

The SDKs' own objects are read by shape (`model_dump()`, else attributes): nothing
here imports `openai` or `anthropic`. Pure: no I/O, no event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._types import ToolCall, plain

__all__ = ["NOT_CALLS", "tool_calls_of"]

NOT_CALLS: frozenset[str] = frozenset(
    {
        # Anthropic content blocks that ask the client for nothing
        "text",
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "container_upload",
        "mcp_tool_use",
        "mcp_tool_result",
        "image",
        "document",
        "search_result",
        # OpenAI Responses output items run (or only shown) by the provider
        "message",
        "output_text",
        "refusal",
        "reasoning",
        "compaction",
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "tool_search_call",
        "tool_search_output",
        "mcp_call",
        "mcp_list_tools",
        "additional_tools",
        "program",
        "program_output",
    }
)
"""Block and item types that are not calls for the client to answer. Any other type is
kept: a call this library cannot read must still get its one result."""


def tool_calls_of(batch: Any) -> list[Any]:
    """The call items of `batch`, in order: a list of calls or of message blocks, or a
    whole assistant message."""
    if type(batch) is list or type(batch) is tuple:
        for item in batch:
            # an OpenAI chat dict, our own shape or a ToolCall goes to pass 1 as it is
            if type(item) is dict:
                if item.get("type", "function") == "function":
                    continue
            elif type(item) is ToolCall:
                continue
            return _calls_among(batch)
        return list(batch)
    return _calls_among(_items_of_message(batch))


def _calls_among(items: Iterable[Any]) -> list[Any]:
    calls: list[Any] = []
    for item in items:
        try:
            if type(item) is not ToolCall and not isinstance(item, Mapping) and hasattr(item, "model_dump"):
                item = plain(item)  # an SDK object: pass 1 and the recording read it as a dict
            kind = item.get("type") if isinstance(item, Mapping) else getattr(item, "type", None)
        except Exception:
            # an item that cannot be looked at (its attributes or keys raise) is a call pass
            # 1 cannot read: kept, so that it gets its own result and its siblings theirs
            kind = None
        if isinstance(kind, str) and kind in NOT_CALLS:
            continue
        calls.append(item)
    return calls


def _field(message: Any, name: str) -> tuple[bool, Any]:
    if isinstance(message, Mapping):
        return name in message, message.get(name)
    try:
        value = getattr(message, name)
    except AttributeError:
        return False, None
    return True, value


def _items_of_message(message: Any) -> Iterable[Any]:
    if isinstance(message, str | bytes):
        raise TypeError(f"dispatch takes a batch of tool calls or an assistant message, got {message!r}")
    has_role, role = _field(message, "role")
    if has_role and role not in (None, "assistant"):
        raise TypeError(f"dispatch takes an assistant message, got a {role!r} message: {message!r}")
    has_calls, calls = _field(message, "tool_calls")  # OpenAI chat
    if has_calls and calls:
        found: Iterable[Any] = calls
        return found  # (an empty list says nothing: its content may still hold calls)
    for name in ("output", "content"):  # a Responses response; an Anthropic message
        _, items = _field(message, name)
        if isinstance(items, list | tuple):
            return items
    if has_role:
        return ()  # a message with text only: no calls
    if isinstance(message, Mapping) or hasattr(message, "model_dump"):
        hint = " (pass completion.choices[0].message)" if _field(message, "choices")[0] else ""
        raise TypeError(
            f"dispatch takes a batch of tool calls or an assistant message{hint}, got {message!r}"
        )
    try:
        return list(message)
    except TypeError:
        raise TypeError(
            f"dispatch takes a batch of tool calls or an assistant message, got {message!r}"
        ) from None
