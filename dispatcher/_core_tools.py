"""The core tools every session supplies itself: `find_tools` and `run_tool`.

`run_tool` never runs: pass 1 unwraps it into the tool it names. `find_tools` loads
schemas: `select:A,B` loads those tools, free text ranks names and descriptions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ._exceptions import ToolError
from ._plan import FIND_TOOLS, RUN_TOOL
from ._registry import Registry, Tool
from ._types import ToolContext

__all__ = ["core_registry", "rank_tools"]

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def rank_tools(query: str, tools: list[Tool], limit: int) -> list[Tool]:
    """The tools whose name and description best match the words of `query`."""
    wanted = _words(query)
    if not wanted:
        return []
    scored = []
    for order, tool in enumerate(tools):
        name_words = _words(tool.name.replace("_", " "))
        text_words = _words(tool.description)
        score = 3 * len(wanted & name_words) + len(wanted & text_words)
        if query.strip().lower() in tool.name.lower():
            score += 5
        if score:
            scored.append((-score, order, tool))
    scored.sort(key=lambda t: (t[0], t[1]))
    return [tool for _, _, tool in scored[:limit]]


async def _find_tools(args: Mapping[str, Any], ctx: ToolContext) -> str:
    query = str(args["query"]).strip()
    limit = int(args.get("limit", 5))
    searchable = ctx.searchable_tools()
    if query.lower().startswith("select:"):
        names = [n.strip() for n in query[len("select:") :].split(",") if n.strip()]
        by_name = {t.name: t for t in searchable}
        found = [by_name[n] for n in names if n in by_name]
        missing = [n for n in names if n not in by_name]
        if not found:
            raise ToolError(f"no tool named {', '.join(missing) or repr(query)}", retryable=False)
    else:
        found = rank_tools(query, searchable, limit)
        missing = []
    ctx.load_tools([t.name for t in found])
    lines = [f"{len(found)} tool(s) loaded; call them with {RUN_TOOL}(name, args)."]
    lines += [json.dumps(t.schema(), ensure_ascii=False, sort_keys=True) for t in found]
    if missing:
        lines.append(f"not found: {', '.join(missing)}")
    if not found:
        lines.append(f'nothing matched {query!r}; try other words, or "select:<name>"')
    return "\n".join(lines)


async def _run_tool(args: Mapping[str, Any], ctx: ToolContext) -> str:
    raise ToolError("run_tool is unwrapped before it runs; this is a bug in threepass", retryable=False)


_CORE: list[Registry] = []  # the one checked; each dispatcher gets a copy


def core_registry() -> Registry:
    """A registry of the two tools every session supplies: a new one each time, its tools
    checked once per process (a Dispatcher is made in a fraction of the time)."""
    if not _CORE:
        _CORE.append(_checked_core())
    return _CORE[0].copy()


def _checked_core() -> Registry:
    return Registry(
        [
            Tool(
                name=FIND_TOOLS,
                description=(
                    "Find tools and load their schemas. query='select:A,B' loads those tools by name; "
                    "any other text searches tool names and descriptions and loads the best few."
                ),
                handler=_find_tools,
                parameters={
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "minLength": 1},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5},
                    },
                    "required": ["query"],
                    "additionalProperties": False,
                },
                concurrent=True,
                deferred=False,
            ),
            Tool(
                name=RUN_TOOL,
                description=(
                    "Run a tool by name with its arguments. Fetch a tool's schema with find_tools first."
                ),
                handler=_run_tool,
                parameters={
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "description": "the tool to run"},
                        "args": {"type": "object", "description": "its arguments"},
                    },
                    "required": ["name"],
                },
                concurrent=False,
                deferred=False,
            ),
        ]
    )
