"""A small MCP server for the tests of builtin_tools.mcp: what the servers from PyPI do not
show (slow calls, a reported error, an image, structured output only, `_meta`, no
annotations). Run over stdio, or `--http PORT` for the streamable HTTP transport on
127.0.0.1."""

from __future__ import annotations

import base64
import os
import sys
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations

server = MCPServer("probe")
READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(92)).decode()


@server.tool(annotations=READ_ONLY)
async def nap(seconds: float) -> str:
    """Sleep, then say how long."""
    await anyio.sleep(seconds)
    return f"slept {seconds}"


@server.tool(annotations=READ_ONLY)
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool(annotations=READ_ONLY)
def echo_meta(ctx: Context) -> str:
    """The `_meta` the request carried, as the server saw it."""
    meta: Any = ctx.request_context.meta
    return repr(dict(meta or {}))


@server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=True))
def picture() -> list[Any]:
    """A caption and a 100-byte PNG."""
    return [TextContent(text="a picture"), ImageContent(data=PNG, mime_type="image/png")]


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True))
def refuse(reason: str) -> CallToolResult:
    """Report a failure the way MCP tools do: isError with a text."""
    return CallToolResult(content=[TextContent(text=f"refused: {reason}")], is_error=True)


@server.tool()
def unannotated() -> str:
    """No annotations at all."""
    return "done"


@server.tool(annotations=READ_ONLY)
def numbers() -> CallToolResult:
    """Structured content and no content blocks."""
    return CallToolResult(content=[], structured_content={"one": 1, "two": 2})


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
        # its stdin closed, the server is done: it exits now, since the interpreter's
        # teardown of the SDK would keep every test that closes it waiting half a second
        sys.stdout.flush()
        os._exit(0)
