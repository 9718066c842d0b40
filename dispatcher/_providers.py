"""Provider formats: the tools array of a request, per provider. No I/O."""

from __future__ import annotations

from typing import Any

from ._registry import Tool
from ._types import Provider

__all__ = ["tool_entry"]

_STUB_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_entry(
    tool: Tool, provider: Provider, *, stub: bool = False, description: str | None = None
) -> dict[str, Any]:
    """One tool as `provider` wants it in a request; a stub has no parameters."""
    params = _STUB_PARAMETERS if stub else dict(tool.parameters)
    text = tool.description if description is None else description
    if provider == "openai":
        return {
            "type": "function",
            "function": {"name": tool.name, "description": text, "parameters": params},
        }
    if provider == "anthropic":
        return {"name": tool.name, "description": text, "input_schema": params}
    if provider == "responses":
        return {"type": "function", "name": tool.name, "description": text, "parameters": params}
    raise ValueError(f"unknown provider, expected openai, anthropic or responses, got {provider!r}")
