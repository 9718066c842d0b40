"""Provider formats: the tools array of a request, and the messages that carry a batch's
results back, per provider. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._plan import FIND_TOOLS, RUN_TOOL
from ._registry import Registry, Tool, strict_problem
from ._types import Provider, ToolResult, provider_named

__all__ = ["core_names", "request_tools", "strict_for", "tool_entry", "tool_index", "tool_messages"]

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


def core_names(registry: Registry, extra_core: Sequence[str] = ()) -> list[str]:
    """The tools whose full schemas go in every request of mode `deferred`: the two the
    session supplies, every tool that is not deferred, and the `core` the session named."""
    names = [FIND_TOOLS, RUN_TOOL]
    names += [t.name for t in registry if not t.deferred and t.name not in names]
    names += [n for n in extra_core if n in registry and n not in names]
    return names


def tool_index(registry: Registry, extra_core: Sequence[str] = ()) -> str:
    """The one-line index of the tools not in a `deferred` request."""
    core = set(core_names(registry, extra_core))
    others = [t.name for t in registry if t.name not in core]
    if not others:
        return ""
    return f"More tools (fetch a schema with {FIND_TOOLS}, call with {RUN_TOOL}): " + ", ".join(others)


def request_tools(
    registry: Registry,
    core: Registry,
    provider: Provider,
    *,
    mode: str,
    extra_core: Sequence[str],
    is_loaded: Callable[[str], bool],
) -> list[dict[str, Any]]:
    """The tools array of a request. Mode `deferred`: the core tools' schemas, the index of
    the rest in `run_tool`'s description. Mode `direct`: every tool, a deferred one that is
    not loaded yet as a stub (its name and description)."""
    entries: list[dict[str, Any]] = []
    if mode == "deferred":
        index = tool_index(registry, extra_core)
        for name in core_names(registry, extra_core):
            tool = core.get(name) if name in core else registry.get(name)
            description = tool.description
            if name == RUN_TOOL and index:
                description = f"{description} {index}"
            entries.append(tool_entry(tool, provider, description=description))
        return entries
    entries.append(tool_entry(core.get(FIND_TOOLS), provider))
    for tool in registry:
        if tool.name in (FIND_TOOLS, RUN_TOOL):
            continue
        entries.append(tool_entry(tool, provider, stub=tool.deferred and not is_loaded(tool.name)))
    return entries
