"""MCP servers as a tool source: `open_mcp` connects to one server (a command over stdio,
or a streamable HTTP endpoint by URL) and yields a `Tool` for each tool it lists.

    async with open_mcp("mcp-server-git", ["--repository", repo], prefix=True) as tools:
        registry = Registry(list(tools))
        ...                                   # dispatch through it; calls go to the server

What a server's tool annotations become (MCP's defaults when a hint is missing: not
read-only, destructive, not idempotent, open world):

    readOnlyHint     concurrent; reads `mcp:<server>/<tool>`, so a repeat in a run is deduped
    not read-only    a writer with unknown effects on the server: writes `mcp:<server>`, which
                     drops every remembered read of that server; never deduped, runs alone
    destructiveHint  `confirm=True`: the call goes to the gate first (writers only)
    idempotentHint   its failures are retryable (read-only tools' are too)
    openWorldHint    a line in the description

Annotations are the server's word. For a server you do not trust,
`trust_annotations=False` makes every tool a confirmed writer.

One MCP client session serves every call, concurrent ones included; it lives as long as
the `async with`, which owns the server process (closing stops it). A call after the
block is `failed` ("the MCP server X is closed"); a server that dies fails the calls in
flight and every later one, saying so. `meta=fn(ctx)` returns the `_meta` sent with each
tools/call (trace context goes there), or None.

The MCP SDK is imported here and nowhere else in builtin_tools, so `import builtin_tools`
stays small: it is the `threepass[mcp]` extra. Nothing of the dispatcher's passes is
imported here, only the values a tool is made of.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import math
import os
import re
import shlex
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import IO, Any, Literal, TextIO, cast, overload

import anyio
import anyio.to_thread
import attrs

try:
    import httpx2
    import mcp_types
    from mcp import Client, MCPError, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp_types.jsonrpc import CONNECTION_CLOSED
except ImportError as exc:  # pragma: no cover - the extra is installed wherever the tests run
    raise ImportError(f"builtin_tools.mcp needs the MCP SDK ({exc}): pip install 'threepass[mcp]'") from exc

from dispatcher._exceptions import ToolDefinitionError, ToolError
from dispatcher._registry import Tool, register_check
from dispatcher._types import ToolContext

__all__ = ["MCPServerError", "MCPStatistics", "MCPTools", "MetaHook", "open_mcp"]

_log = logging.getLogger("threepass.mcp")

MetaHook = Callable[[ToolContext], Mapping[str, Any] | None]
"""`(ctx) -> dict | None`: the `_meta` of the call's tools/call request (None: none)."""

_NAME_CHAR = re.compile(r"[^A-Za-z0-9_.\-]")
_STDERR_TAIL = 2000
_SDK_CLOSED = "Connection closed"  # the message of the SDK's own CONNECTION_CLOSED error
_CLIENT_INFO = mcp_types.Implementation(name="threepass", version="0.1.0")


class MCPServerError(ConnectionError):
    """An MCP server that could not be started or reached, or failed its handshake."""


@attrs.frozen
class MCPStatistics:
    """What one connection has done. `max_in_flight` above 1 shows calls overlapped."""

    server: str
    state: Literal["open", "closed", "gone"]
    calls: int
    ok: int
    failed: int
    in_flight: int
    max_in_flight: int


@attrs.define
class _Connection:
    """The one client session every tool of a server calls through, and its state."""

    server: str
    client: Client | None = None
    meta: MetaHook | None = None
    stderr: IO[str] | None = None
    state: Literal["open", "closed", "gone"] = "open"
    gone_reason: str = ""
    calls: int = 0
    ok: int = 0
    failed: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    def statistics(self) -> MCPStatistics:
        return MCPStatistics(
            self.server, self.state, self.calls, self.ok, self.failed, self.in_flight, self.max_in_flight
        )

    async def call(self, tool: str, args: Mapping[str, Any], ctx: ToolContext, retryable: bool) -> Any:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            value = await self._call(tool, args, ctx, retryable)
        except BaseException:
            self.failed += 1
            raise
        finally:
            self.in_flight -= 1
        self.ok += 1
        return value

    def _refusal(self) -> ToolError:
        """Why a call cannot reach the server (once it is closed or gone)."""
        if self.state == "gone":
            return ToolError(
                f"the MCP server {self.server!r} is gone ({self.gone_reason}); open it again",
                retryable=False,
            )
        return ToolError(
            f"the MCP server {self.server!r} is closed: its tools work only inside `open_mcp`",
            retryable=False,
        )

    async def _call(self, tool: str, args: Mapping[str, Any], ctx: ToolContext, retryable: bool) -> Any:
        client = self.client
        if self.state != "open" or client is None:
            raise self._refusal()
        meta = self._meta_for(ctx)
        try:
            result = await client.call_tool(tool, dict(args), meta=meta)
        except MCPError as exc:
            if not _connection_closed(client, exc):
                raise ToolError(
                    f"the MCP server {self.server!r} answered {tool} with error {exc.code}: {exc.message}",
                    retryable=retryable,
                ) from exc
            if self.state != "open":  # closed by the block's end while this call was waiting
                raise self._refusal() from exc
            self._mark_gone("it closed the connection: exited or crashed")
            raise ToolError(
                f"the MCP server {self.server!r} closed the connection before answering {tool} "
                f"(it exited or crashed){await self._stderr_note()}",
                retryable=False,
            ) from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            self._mark_gone("its connection broke")
            raise self._refusal() from exc
        except Exception as exc:
            raise ToolError(
                f"the MCP server {self.server!r} failed {tool}: {type(exc).__name__}: {exc}",
                retryable=retryable,
            ) from exc
        if result.is_error:
            raise ToolError(_text_of(result) or f"{tool} reported an error", retryable=retryable)
        return _content_of(result)

    def _meta_for(self, ctx: ToolContext) -> mcp_types.RequestParamsMeta | None:
        if self.meta is None:
            return None
        try:
            found = self.meta(ctx)
        except Exception:  # tracing must never cost a call
            _log.warning("the meta hook of MCP server %r raised; no _meta sent", self.server, exc_info=True)
            return None
        # an open map on the wire: the SDK adds its reserved keys beside the hook's
        return None if found is None else cast(mcp_types.RequestParamsMeta, dict(found))

    def _mark_gone(self, reason: str) -> None:
        if self.state == "open":
            self.state = "gone"
            self.gone_reason = reason

    async def _stderr_note(self) -> str:
        tail = await _tail(self.stderr)
        return f"; its stderr ended with: {tail}" if tail else ""


def _connection_closed(client: Client, exc: MCPError) -> bool:
    """Whether `exc` is the SDK saying the connection closed, not the server's own error.

    The SDK reports a closed connection as CONNECTION_CLOSED (-32000), which is also the
    first code of JSON-RPC's range for servers' own errors: a live server may answer a
    call with -32000 "rate limited". So the code alone says nothing. The SDK fails a
    call this way when its write finds the transport torn down (the exception's context
    is anyio's), or once its dispatcher has marked itself closed (it does so before it
    fails the calls waiting on it, and fails every later one at once); a server's error
    reaches its call while the dispatcher still reads. That state is not public
    (`_closed`, mcp 2.x): where it cannot be read, the SDK's own words decide. A server
    that answers and then exits gets its answer reported: the next call finds it gone."""
    if exc.code != CONNECTION_CLOSED:
        return False
    if isinstance(exc.__context__, anyio.BrokenResourceError | anyio.ClosedResourceError):
        return True
    sdk_words = exc.message == _SDK_CLOSED and exc.data is None
    try:
        closed = getattr(getattr(client.session, "_dispatcher", None), "_closed", None)
    except RuntimeError:  # the client has left its block: no session, nothing open
        return True
    return (closed and sdk_words) if isinstance(closed, bool) else sdk_words


class MCPTools(Sequence[Tool]):
    """The tools of one MCP server, in the order it listed them, as `open_mcp` yields them."""

    def __init__(self, server: str, tools: Sequence[Tool], connection: _Connection, instructions: str | None):
        self._server = server
        self._tools = tuple(tools)
        self._connection = connection
        self._instructions = instructions

    @property
    def server(self) -> str:
        """The server's name: the namespace of its resource keys and of prefixed tool names."""
        return self._server

    @property
    def instructions(self) -> str | None:
        """What the server says about using its tools, if anything."""
        return self._instructions

    def statistics(self) -> MCPStatistics:
        return self._connection.statistics()

    @overload
    def __getitem__(self, index: int) -> Tool: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Tool]: ...

    def __getitem__(self, index: int | slice) -> Tool | Sequence[Tool]:
        return self._tools[index]

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools)

    def __repr__(self) -> str:
        return f"MCPTools({self._server!r}, {[t.name for t in self._tools]})"

    def get(self, name: str) -> Tool:
        """The tool named `name` (as exposed, prefix included)."""
        for tool in self._tools:
            if tool.name == name:
                return tool
        names = [t.name for t in self._tools]
        raise KeyError(f"the MCP server {self._server!r} has no tool {name!r}; it has {names}")


def _is_url(command: str) -> bool:
    return command.startswith(("http://", "https://"))


@asynccontextmanager
async def open_mcp(
    command: str,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    name: str | None = None,
    prefix: bool = False,
    meta: MetaHook | None = None,
    cwd: str | os.PathLike[str] | None = None,
    headers: Mapping[str, str] | None = None,
    deferred: bool = True,
    call_timeout: float | None = None,
    start_timeout: float = 30.0,
    trust_annotations: bool = True,
    errlog: TextIO | None = None,
) -> AsyncIterator[MCPTools]:
    """Connect to an MCP server and yield its tools; closing the block closes the session
    and stops the server.

    `command` is an executable run with `args` over stdio (its environment is the MCP
    SDK's safe default, PATH and HOME among it, plus `env`; in `cwd`), or an `http://` /
    `https://` URL of a streamable HTTP endpoint (then `headers` go with every request).
    `name` is the server's namespace (default: the name it gives itself); `prefix=True`
    names the tools `<name>__<tool>`. `deferred` and `call_timeout` (a `Tool`'s `timeout`)
    apply to every tool. `meta(ctx)` gives the `_meta` of each tools/call request (a
    dict, or None for none); a hook that raises is logged and the call goes without.
    The server's stderr goes to `errlog` (default: a temporary file, whose last lines are
    quoted when the server fails). Raises `MCPServerError` when the server cannot be
    started or reached, or does not complete its handshake within `start_timeout`.
    """
    url = _is_url(command)
    if url and (args or env or cwd is not None):
        raise ValueError(f"args, env and cwd are for a command, not a URL; got {command!r}")
    if not url and headers:
        raise ValueError(f"headers are for a URL, not a command; got {command!r}")
    label = command if url else shlex.join([command, *args])
    own_stderr = None if url or errlog is not None else await anyio.to_thread.run_sync(_temporary_log)
    try:
        # One scope around the whole lifetime: the client's task group is entered during the
        # start-up and left at the end, so only a scope enclosing both may bound the start-up.
        startup = anyio.CancelScope(deadline=anyio.current_time() + start_timeout)
        with startup:
            async with AsyncExitStack() as stack:
                if url:
                    http_client = None
                    if headers:
                        http_client = httpx2.AsyncClient(
                            headers=dict(headers), timeout=httpx2.Timeout(30.0, read=300.0)
                        )
                        await stack.enter_async_context(http_client)
                    transport = streamable_http_client(command, http_client=http_client)
                else:
                    params = StdioServerParameters(
                        command=command,
                        args=list(args),
                        env=dict(env) if env is not None else None,
                        cwd=os.fspath(cwd) if cwd is not None else None,
                    )
                    transport = stdio_client(params, errlog=errlog or own_stderr or sys.stderr)
                client = Client(transport, cache=None, client_info=_CLIENT_INFO)
                try:
                    await stack.enter_async_context(client)
                    listed = await _list_all(client)
                except Exception as exc:
                    note = await _tail_note(own_stderr)
                    raise MCPServerError(
                        f"cannot start the MCP server {label!r}: {_describe(exc)}{note}"
                    ) from exc
                startup.deadline = math.inf
                info = client.server_info
                server = _namespace(name or (info.name if info is not None else "") or label)
                connection = _Connection(server=server, client=client, meta=meta, stderr=own_stderr)
                made: list[tuple[str, Tool]] = []
                for listed_tool in listed:
                    tool = _tool_for(
                        listed_tool, connection, prefix=prefix, deferred=deferred, timeout=call_timeout,
                        trust_annotations=trust_annotations,
                    )  # fmt: skip
                    if tool is not None:
                        made.append((listed_tool.name, tool))
                tools = _unique_names(server, made, prefix=prefix)
                try:
                    yield MCPTools(server, tools, connection, client.instructions)
                finally:
                    connection.state = "closed"
                    connection.client = None
        if startup.cancelled_caught:
            raise MCPServerError(
                f"cannot start the MCP server {label!r}: no handshake within {start_timeout:g} s"
                f"{await _tail_note(own_stderr)}"
            )
    finally:
        if own_stderr is not None:
            own_stderr.close()


async def _list_all(client: Client) -> list[mcp_types.Tool]:
    found: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(100):  # a paginator that never ends cannot hang the open
        page = await client.list_tools(cursor=cursor)
        found.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return found


def _tool_for(
    listed: mcp_types.Tool,
    connection: _Connection,
    *,
    prefix: bool,
    deferred: bool,
    timeout: float | None,
    trust_annotations: bool,
) -> Tool | None:
    hints = listed.annotations if trust_annotations else None
    read_only = bool(hints and hints.read_only_hint)
    destructive = not read_only and (hints is None or hints.destructive_hint is not False)
    idempotent = read_only or bool(hints and hints.idempotent_hint)
    open_world = hints is None or hints.open_world_hint is not False
    server, mcp_name = connection.server, listed.name
    exposed = _NAME_CHAR.sub("_", f"{server}__{mcp_name}" if prefix else mcp_name)[:128]

    async def call_mcp_tool(args: Mapping[str, Any], ctx: ToolContext) -> Any:
        return await connection.call(mcp_name, args, ctx, idempotent)

    description = (listed.description or (hints.title if hints else None) or listed.title or mcp_name).strip()
    notes = [f"A tool of the MCP server {server!r}."]
    if open_world:
        notes.append("It reaches systems outside that server (open world).")
    reads_key = f"mcp:{server}/{mcp_name}"
    writes_key = f"mcp:{server}"
    tool = Tool(
        name=exposed,
        description=f"{description}\n\n{' '.join(notes)}",
        handler=call_mcp_tool,
        parameters=_parameters(listed.input_schema),
        concurrent=read_only,
        deferred=deferred,
        confirm=destructive,
        timeout=timeout,
        reads=(lambda args: {reads_key}) if read_only else None,
        writes=None if read_only else (lambda args: {writes_key}),
    )
    try:
        register_check(tool)
    except ToolDefinitionError as exc:
        _log.warning("skipping tool %r of MCP server %r: %s", mcp_name, server, exc)
        return None
    return tool


def _unique_names(server: str, made: Sequence[tuple[str, Tool]], *, prefix: bool) -> list[Tool]:
    """The tools, each under a name of its own (a registry refuses a second tool of a name).

    A name the server lists twice is one tool to it (a call names it, and the server
    picks), so the later listing is dropped. Distinct names that meet once made safe
    (`a b` and `a_b`, or two that share their first 128 characters) are distinct tools,
    and the agent should reach both: a tool whose name needed no change keeps it, and
    the others get `_` and 8 hex digits of a hash of their MCP name. A hash rather than
    a count, so that no name changes when the server lists its tools in another order
    (recordings, cached results and the model's history name tools). One log line says
    what was dropped or renamed."""
    seen: set[str] = set()
    kept: list[tuple[str, Tool]] = []
    dropped: list[str] = []
    for mcp_name, tool in made:
        if mcp_name in seen:
            dropped.append(mcp_name)
        else:
            seen.add(mcp_name)
            kept.append((mcp_name, tool))
    # A name that needed no change is its tool's; a changed name that another tool's also
    # became goes to none of them (each gets its suffix), so that no name depends on order.
    own = [t.name == (f"{server}__{mcp_name}" if prefix else mcp_name) for mcp_name, t in kept]
    unchanged = {t.name for (_, t), is_own in zip(kept, own, strict=True) if is_own}
    changed = Counter(t.name for (_, t), is_own in zip(kept, own, strict=True) if not is_own)
    taken: set[str] = set()
    tools: list[Tool] = []
    renamed: list[str] = []
    for (mcp_name, tool), is_own in zip(kept, own, strict=True):
        name = tool.name
        if not is_own and (name in unchanged or changed[name] > 1 or name in taken):
            digest = hashlib.sha256(mcp_name.encode("utf-8", "surrogatepass")).hexdigest()
            for extra in range(len(digest) - 7):  # a longer digest in the unlikely clash
                name = f"{tool.name[: 128 - 9 - extra]}_{digest[: 8 + extra]}"
                if name not in taken and name not in unchanged:
                    break
            renamed.append(f"{mcp_name!r} -> {name!r}")
            tool = attrs.evolve(tool, name=name)
        taken.add(name)
        tools.append(tool)
    if dropped or renamed:
        _log.warning(
            "MCP server %r: tool names that would collide%s%s",
            server,
            f"; listed again, dropped: {', '.join(map(repr, dropped))}" if dropped else "",
            f"; renamed: {', '.join(renamed)}" if renamed else "",
        )
    return tools


def _parameters(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    params = dict(schema or {})
    params.setdefault("type", "object")
    return params


def _namespace(name: str) -> str:
    cleaned = _NAME_CHAR.sub("_", name.strip()) or "mcp"
    return cleaned[:60]


# -- results -------------------------------------------------------------------------------


def _text_of(result: mcp_types.CallToolResult) -> str:
    return "\n".join(_describe_block(block) for block in result.content)


def _content_of(result: mcp_types.CallToolResult) -> Any:
    """Text blocks joined; other blocks described; structured content when there is no text."""
    if not result.content and result.structured_content is not None:
        return result.structured_content
    return _text_of(result)


def _decoded_size(data: str) -> int:
    try:
        return len(base64.b64decode(data, validate=False))
    except (binascii.Error, ValueError):
        return len(data) * 3 // 4


def _describe_block(block: Any) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        return f"[{block.type} {block.mime_type}, {_decoded_size(block.data)} bytes]"
    if isinstance(block, mcp_types.ResourceLink):
        mime = f" {block.mime_type}" if block.mime_type else ""
        return f"[resource link {block.uri}{mime}: {block.name}]"
    if isinstance(block, mcp_types.EmbeddedResource):
        res = block.resource
        mime = f" {res.mime_type}" if res.mime_type else ""
        if isinstance(res, mcp_types.TextResourceContents):
            return f"[resource {res.uri}{mime}]\n{res.text}"
        return f"[resource {res.uri}{mime}, {_decoded_size(res.blob)} bytes]"
    kind = getattr(block, "type", type(block).__name__)
    return f"[{kind} content]"


# -- errors ----------------------------------------------------------------------------------


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _describe(exc: BaseException) -> str:
    parts = []
    for leaf in _leaves(exc):
        # the SDK's own error (a server's -32000 carries its own message: see `_connection_closed`)
        if isinstance(leaf, MCPError) and leaf.code == CONNECTION_CLOSED and leaf.message == _SDK_CLOSED:
            parts.append("it closed the connection before the handshake (it exited or crashed)")
        elif isinstance(leaf, FileNotFoundError):
            parts.append(f"no such command ({leaf.strerror or leaf})")
        else:
            parts.append(f"{type(leaf).__name__}: {leaf}")
    return "; ".join(dict.fromkeys(parts))


def _temporary_log() -> TextIO:
    return cast(TextIO, tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))


def _read_tail(log: IO[str]) -> str:
    # pread, not seek: the server writes through the same open file, and its offset is shared
    try:
        log.flush()
        fd = log.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - _STDERR_TAIL)
        text = os.pread(fd, size - start, start).decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-5:] if line.strip())


async def _tail(log: IO[str] | None) -> str:
    if log is None:
        return ""
    return await anyio.to_thread.run_sync(_read_tail, log)


async def _tail_note(log: IO[str] | None) -> str:
    tail = await _tail(log)
    return f"; its stderr ended with: {tail}" if tail else ""
