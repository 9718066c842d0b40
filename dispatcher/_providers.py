"""Provider formats: the tools array of a request, and the messages that carry a batch's
results back, per provider. No I/O."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._registry import Tool, strict_problem
from ._types import Provider, ToolResult, provider_named

__all__ = ["strict_for", "tool_entry", "tool_messages"]

_STUB_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def strict_for(tool: Tool, *, stub: bool = False) -> bool:
    """Whether `tool` goes out in strict mode: it asks for it and its schema can take it."""
    return tool.strict and not stub and strict_problem(tool.parameters) is None


def tool_entry(
    tool: Tool, provider: Provider, *, stub: bool = False, description: str | None = None
) -> dict[str, Any]:
    """One tool as `provider` wants it in a request; a stub has no parameters. Responses
    always says `strict` (the API's default is strict mode, which a free schema fails);
    the others say it only when it is granted."""
    fmt = provider_named(provider)
    params = _STUB_PARAMETERS if stub else dict(tool.parameters)
    text = tool.description if description is None else description
    strict = strict_for(tool, stub=stub)
    if fmt == "openai":
        function: dict[str, Any] = {"name": tool.name, "description": text, "parameters": params}
        if strict:
            function["strict"] = True
        return {"type": "function", "function": function}
    if fmt == "anthropic":
        entry: dict[str, Any] = {"name": tool.name, "description": text, "input_schema": params}
        if strict:
            entry["strict"] = True
        return entry
    return {
        "type": "function",
        "name": tool.name,
        "description": text,
        "parameters": params,
        "strict": strict,
    }


def tool_messages(results: Iterable[ToolResult], provider: Provider) -> list[dict[str, Any]]:
    """What to append to the conversation for a batch's results, in call order. OpenAI
    chat: one `role: tool` message per result. Anthropic: one `role: user` message holding
    every `tool_result` block (the API wants them all in the message after the calls),
    none for an empty batch. Responses: one `function_call_output` item per result."""
    fmt = provider_named(provider)
    if fmt == "anthropic":
        blocks = [r.to_message("anthropic") for r in results]
        return [{"role": "user", "content": blocks}] if blocks else []
    return [r.to_message(fmt) for r in results]  # type: ignore[arg-type]
