"""The web tools: `fetch_page`, `search_web`, `http_request`, `download_file`.

All use `httpx.AsyncClient` on anyio, so they run under trio and asyncio alike. A
client lives for one call: a pooled connection belongs to the event loop that opened
it, and a registry outlives any one event loop. Only http and https URLs are
accepted, redirects are followed (at most 10), and every body is read as a stream
with a byte limit, so a huge or endless response costs no more than the limit; what
each response may take off the network, head and body, raw, is bounded as well
(`_ReadMeter`).

Every connection, the first and each redirect's, goes through `_PinnedBackend`: the
host is resolved once, every address it resolved to is checked against the network
policy (`_netpolicy.py`), and the socket is opened to a checked address, never to the
name, so a second lookup that answers differently (DNS rebinding) cannot happen.
Proxies from the environment are ignored: a proxy would make the connection for us,
past the check. Nothing from the dispatcher's passes may be imported here.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import attrs
import charset_normalizer
import httpcore
import httpx
import xxhash

from dispatcher import CachePolicy
from dispatcher._exceptions import ToolError
from dispatcher._registry import Tool
from dispatcher._types import ToolContext

from ._html import html_to_text
from ._netpolicy import Address, NetworkPolicy, RefusedAddress, numeric_host, parse_address
from ._workspace import Workspace

__all__ = [
    "DOWNLOAD_TIMEOUT",
    "SEARCH_URL_ENV",
    "Resolver",
    "WebTools",
    "resource_url",
    "system_resolver",
    "web_tools",
]

SEARCH_URL_ENV = "THREEPASS_SEARCH_URL"
USER_AGENT = "threepass/0.1 (+https://pypi.org/project/threepass/)"
DOWNLOAD_TIMEOUT = 600.0
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_METHODS = ["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"]
_RETRYABLE_STATUS = frozenset({408, 425, 429})
_MIB = 1024 * 1024


Resolver = Callable[[str, int], Awaitable[Iterable[str]]]
"""`(host, port) -> addresses`: how a host name becomes the addresses to check and connect to."""


async def system_resolver(host: str, port: int) -> list[str]:
    """The system's lookup (getaddrinfo, off the event loop): every address of `host`."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def web_tools(
    workspace: Workspace, *, search_url: str | None = None, allow_private_network: bool = False
) -> list[Tool]:
    """The web tools; `download_file` saves into `workspace`. `search_url` is the
    SearXNG-compatible endpoint (else the THREEPASS_SEARCH_URL environment variable).
    `allow_private_network` lets the tools reach loopback and private addresses."""
    return WebTools(workspace, search_url=search_url, allow_private_network=allow_private_network).tools()


def resource_url(url: object) -> str:
    """The resource key of a URL: `url:` and the URL without query or fragment, so a write
    to a path invalidates reads of it whatever their query. Never raises."""
    text = url if isinstance(url, str) else ""
    cut = len(text)
    for mark in ("?", "#"):
        at = text.find(mark)
        if at != -1:
            cut = min(cut, at)
    return f"url:{text[:cut]}"


class WebTools:
    """The web tools' handlers, with their limits. `request_timeout` is seconds per
    network step (looking up and connecting, each read).

    Link-local and cloud metadata addresses are always refused; loopback and the
    private ranges only with `allow_private_network=True`. The search endpoint, being
    the operator's own configuration, may be on loopback or a private range anyway.
    `resolver` replaces the system's lookup (tests hand in a fake one).
    """

    def __init__(
        self,
        workspace: Workspace,
        *,
        search_url: str | None = None,
        max_page_bytes: int = 5 * _MIB,
        max_page_chars: int = 100_000,
        max_response_bytes: int = 1 * _MIB,
        max_download_bytes: int = 100 * _MIB,
        request_timeout: float = 30.0,
        allow_private_network: bool = False,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.ws = workspace
        self.policy = NetworkPolicy(allow_private=allow_private_network)
        self.resolver = resolver
        self.search_url = search_url
        self.max_page_bytes = max_page_bytes
        self.max_page_chars = max_page_chars
        self.max_response_bytes = max_response_bytes
        self.max_download_bytes = max_download_bytes
        self.request_timeout = request_timeout
        self._ssl_context: ssl.SSLContext | None = None

    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="fetch_page",
                description=(
                    "Fetch a web page (http or https) and return its readable text: HTML is "
                    "reduced to text with [links](url); other text types come back as they are."
                ),
                handler=self.fetch_page,
                parameters=_FETCH_PAGE_SCHEMA,
                concurrent=True,
                cache=CachePolicy(scope="shared"),
                reads=_url_reads,
            ),
            Tool(
                name="search_web",
                description="Search the web; return titles, URLs and snippets of the top results.",
                handler=self.search_web,
                parameters=_SEARCH_WEB_SCHEMA,
                concurrent=True,
                cache=CachePolicy(scope="session"),
            ),
            Tool(
                name="http_request",
                description=(
                    "Send one HTTP request and return the status, headers and body. `body` is "
                    "sent as is (a string) or as JSON (an object or array). Methods other than "
                    "GET, HEAD and OPTIONS need confirmation."
                ),
                handler=self.http_request,
                parameters=_HTTP_REQUEST_SCHEMA,
                concurrent=True,
                confirm=_unsafe_method,
                cache=CachePolicy(scope="session", when=_is_get),
                reads=_url_reads,
                writes=_request_writes,
            ),
            Tool(
                name="download_file",
                description=(
                    "Download a URL into a file in the workspace (replacing it if it exists; "
                    "restore_file undoes that)."
                ),
                handler=self.download_file,
                parameters=_DOWNLOAD_FILE_SCHEMA,
                # Side by side with other calls: pass 2 starts a new group when a call
                # reads or writes the file it writes, so program order still holds.
                concurrent=True,
                # Large files over slow links take longer than the dispatcher's default.
                timeout=DOWNLOAD_TIMEOUT,
                reads=_url_reads,
                writes=self.download_writes,
            ),
        ]

    def download_writes(self, args: Mapping[str, Any]) -> set[str]:
        path = args.get("path")
        if not isinstance(path, str) or not path.strip():
            return {"file:/"}  # arguments that will fail validation: assume the worst
        return {self.ws.key(path)}

    # -- handlers ---------------------------------------------------------------

    async def fetch_page(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        url = _checked_url(args["url"])
        async with (
            self._client(self.max_page_bytes) as client,
            _network_errors(url),
            client.stream("GET", url) as response,
        ):
            data, cut, left_out = await _read_bounded(response, self.max_page_bytes)
        _raise_for_status(response, "GET", data)
        content_type = response.headers.get("content-type", "")
        if not _is_text(content_type, data):
            raise ToolError(
                f"{url} is not a text page (content-type {content_type or 'unknown'!r}, "
                f"{len(data)}{'+' if cut else ''} bytes); use download_file to save it",
                retryable=False,
            )
        text, charset_note = _decode_text(response, data)
        final_url = str(response.url)
        header = [f"URL: {final_url}"]
        if charset_note:
            header.append(charset_note)
        if _is_html(content_type, text):
            # Parsing megabytes of HTML takes a while: not on the event loop's thread. The parse is
            # pure, so on a timeout the thread is left to finish and its answer dropped.
            title, text = await anyio.to_thread.run_sync(
                html_to_text, text, final_url, abandon_on_cancel=True
            )
            if title:
                header.append(f"Title: {title}")
        if len(text) > self.max_page_chars:
            text = text[: self.max_page_chars]
            cut = True
        if cut:
            text += "\n[page cut: longer than this tool returns]"
        if left_out:
            text += "\n" + left_out
        return "\n".join(header) + "\n\n" + text

    async def search_web(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        endpoint = self.search_url or os.environ.get(SEARCH_URL_ENV)
        if not endpoint:
            raise ToolError(f"no search endpoint configured: set {SEARCH_URL_ENV}", retryable=False)
        endpoint = _checked_url(endpoint)
        query: str = args["query"]
        limit = int(args.get("limit") or 5)
        # The operator configured this endpoint: it may be on loopback or a private
        # range. Only it, its scheme, host and port: a redirect elsewhere (another port
        # of the same host included), and the result URLs, are checked as usual.
        async with (
            self._client(self.max_response_bytes, private_ok=_origin(httpx.URL(endpoint))) as client,
            _network_errors(endpoint),
            client.stream("GET", endpoint, params={"q": query, "format": "json"}) as response,
        ):
            data, cut, _ = await _read_bounded(response, self.max_response_bytes)
        _raise_for_status(response, "GET", data)
        try:
            if cut:
                raise ValueError("response too large")
            payload = json.loads(data)
            results = payload["results"]
            if not isinstance(results, list):
                raise TypeError("results is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            raise ToolError(
                f"the search endpoint did not answer with JSON results ({exc})", retryable=True
            ) from exc
        lines: list[str] = []
        shown = 0
        for item in results:
            if shown == limit:
                break
            if not isinstance(item, Mapping) or not item.get("url"):
                continue
            shown += 1
            lines.append(f"{shown}. {_one_line(item.get('title')) or '(no title)'}")
            lines.append(f"   {item['url']}")
            snippet = _one_line(item.get("content"), 300)
            if snippet:
                lines.append(f"   {snippet}")
        if not lines:
            return f"no results for {query!r}"
        return "\n".join(lines)

    async def http_request(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        method = str(args.get("method") or "GET").upper()
        url = _checked_url(args["url"])
        headers = _checked_headers(args.get("headers") or {})
        params = {str(k): _param(v) for k, v in (args.get("params") or {}).items()}
        body = args.get("body")
        send: dict[str, Any] = {}
        if isinstance(body, str):
            send["content"] = body.encode("utf-8")
        elif body is not None:
            send["json"] = body
        # Added to the URL's own query (httpx's `params=` would replace it).
        target = httpx.URL(url).copy_merge_params(params) if params else httpx.URL(url)
        async with (
            self._client(self.max_response_bytes) as client,
            _network_errors(url),
            client.stream(method, target, headers=headers, **send) as response,
        ):
            data, cut, left_out = await _read_bounded(response, self.max_response_bytes)
        _raise_for_status(response, method, data)
        lines = [f"{response.http_version} {response.status_code} {response.reason_phrase}"]
        lines.extend(f"{name}: {value}" for name, value in response.headers.multi_items())
        if response.history:
            lines.append(f"(after {len(response.history)} redirect(s), from {response.url})")
        content_type = response.headers.get("content-type", "")
        if method == "HEAD" or not data:
            return "\n".join(lines)
        if _is_text(content_type, data):
            text, charset_note = _decode_text(response, data)
            if charset_note:
                lines.append(charset_note)
            if cut:
                text += f"\n[body cut at {self.max_response_bytes} bytes]"
            if left_out:
                text += "\n" + left_out
        else:
            text = (
                f"[{len(data)}{'+' if cut else ''} bytes of {content_type or 'binary data'} "
                "not shown; use download_file to save it]"
            )
        return "\n".join(lines) + "\n\n" + text

    async def download_file(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        url = _checked_url(args["url"])
        target = self.ws.resolve(args["path"])
        rel = self.ws.relative(target)
        if target.is_dir():
            raise ToolError(f"{rel!r} is a folder; give a file path", retryable=False)
        self.ws.check_writable(target)  # before anything is staged beside it
        # Created race-free in the target's folder (made if missing), which it holds open.
        staged = await anyio.to_thread.run_sync(self.ws.stage, target)
        digest = xxhash.xxh3_128()
        size = 0
        installed = False
        try:
            async with (
                self._client(self.max_download_bytes) as client,
                _network_errors(url),
                client.stream("GET", url) as response,
            ):
                if response.status_code >= 400:
                    data, _, _ = await _read_bounded(response, 4096)
                    _raise_for_status(response, "GET", data)
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_download_bytes:
                    raise _too_large(url, self.max_download_bytes)
                async with (
                    anyio.wrap_file(staged.file) as out,
                    _body_chunks(response, self.max_download_bytes) as chunks,
                ):
                    async for chunk in chunks:
                        size += len(chunk)
                        if size > self.max_download_bytes:
                            raise _too_large(url, self.max_download_bytes)
                        digest.update(chunk)
                        await out.write(chunk)
                    if chunks.overran:
                        raise _too_large(url, self.max_download_bytes)
                    left_out = chunks.left_out
                content_type = response.headers.get("content-type", "unknown")
                final_url = str(response.url)
            session_id = ctx.session_id
            await anyio.to_thread.run_sync(
                lambda: self.ws.install(
                    target,
                    staged,
                    digest=digest.hexdigest(),
                    size=size,
                    action="download",
                    session_id=None if session_id is None else str(session_id),
                    call_id=ctx.call_id,
                )
            )
            installed = True
        finally:
            if not installed:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(staged.discard)
        saved = f"saved {size} bytes ({content_type}) from {final_url} to {rel}"
        return f"{saved}\n{left_out}" if left_out else saved

    # -- internals ---------------------------------------------------------------

    @asynccontextmanager
    async def _client(
        self, body_limit: int, private_ok: _Origin | None = None
    ) -> AsyncIterator[httpx.AsyncClient]:
        """A client for one call that connects only where the policy allows (and, for
        requests to the `private_ok` origin, to loopback and private addresses too),
        and reads no more per response than its head and `body_limit` need."""
        if self._ssl_context is None:
            # Loading the CA bundle takes a tenth of a second: once, off the event loop.
            self._ssl_context = await anyio.to_thread.run_sync(httpx.create_ssl_context)
        backend = _PinnedBackend(self.policy, self.resolver, body_limit=body_limit, private_ok=private_ok)
        async with httpx.AsyncClient(
            transport=_PinnedTransport(backend, self._ssl_context),
            # No proxies, .netrc or certificate files from the environment.
            trust_env=False,
            follow_redirects=True,
            max_redirects=10,
            timeout=httpx.Timeout(self.request_timeout),
            # Only what _body_chunks can inflate in bounded steps.
            headers={"User-Agent": USER_AGENT, "Accept-Encoding": "gzip, deflate"},
            event_hooks={"request": [backend.request_started], "response": [backend.head_received]},
        ) as client:
            yield client


# -- the pinned connection -------------------------------------------------------


_Origin = tuple[str, str, int]
"""(scheme, host, port) of a URL, the host as sent (IDNA-encoded, lower case)."""


def _origin(url: httpx.URL) -> _Origin:
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.scheme, url.raw_host.decode("ascii").lower(), port


# What a response's head (its 1xx responses, then its status line and headers) may
# take off the network. httpcore reads 1xx responses without end, each up to h11's
# 100 KiB, so without a bound endless `103 Early Hints` are read forever.
_HEAD_BYTES = 512 * 1024
# What a redirect's body may take: httpx reads it whole, and nobody ever looks at it.
_REDIRECT_BODY_BYTES = 512 * 1024


@attrs.define
class _ReadMeter:
    """The bytes the connections of one call may still read, raw off the network, for
    the response in flight: first its head, then its body. `_MeteredStream` charges
    every read here; past the bound the read fails, for good.

    One meter serves all the connections of a client, as a client lives for one call
    and sends one request at a time (the next hop of a redirect after the last).
    """

    body_limit: int
    url: str = ""
    left: int = _HEAD_BYTES
    part: str = f"over {_HEAD_BYTES} bytes of informational responses and headers"

    def start_head(self, url: str) -> None:
        self.url, self.left = url, _HEAD_BYTES
        self.part = f"over {_HEAD_BYTES} bytes of informational responses and headers"

    def start_body(self, is_redirect: bool) -> None:
        if is_redirect:
            self.left = _REDIRECT_BODY_BYTES
            self.part = f"a redirect with a body over {_REDIRECT_BODY_BYTES} bytes"
        else:
            # Chunked framing costs a few bytes a chunk: twice the raw bound leaves
            # room for chunks down to a handful of bytes, and the body's own reader
            # (`_DecodedBody`) stops at the raw bound first.
            self.left = 2 * _raw_limit(self.body_limit)
            self.part = f"over {self.left} bytes for a body this tool reads {self.body_limit} bytes of"

    def charge(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise ToolError(f"{self.url} sent {self.part}; it was not read further", retryable=False)


class _MeteredStream(httpcore.AsyncNetworkStream):
    """A network stream whose reads are charged to a `_ReadMeter`."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, meter: _ReadMeter) -> None:
        self._inner = inner
        self._meter = meter

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        data = await self._inner.read(max_bytes, timeout)
        self._meter.charge(len(data))
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
    ) -> httpcore.AsyncNetworkStream:
        inner = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _MeteredStream(inner, self._meter)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the policy in front of every connection.

    The host is resolved once (a numeric host, in any form, is not looked up), every
    address is checked, and the socket is opened to a checked address as a number.
    TLS still names the host: httpcore passes it for SNI and certificate checks, and
    the Host header comes from the URL. A refused address raises RefusedAddress
    before any socket is opened. What the connections read is metered (`_ReadMeter`),
    and the client's event hooks tell the backend where each request goes and when
    its head has arrived.
    """

    def __init__(
        self,
        policy: NetworkPolicy,
        resolver: Resolver,
        *,
        body_limit: int,
        private_ok: _Origin | None = None,
    ) -> None:
        self._policy = policy
        self._resolver = resolver
        self._private_ok = private_ok
        self._requested: _Origin | None = None
        self._meter = _ReadMeter(body_limit)
        self._inner = httpcore.AnyIOBackend()

    async def request_started(self, request: httpx.Request) -> None:
        """httpx's request hook: each hop of a call, before it is sent."""
        self._requested = _origin(request.url)
        self._meter.start_head(str(request.url))

    async def head_received(self, response: httpx.Response) -> None:
        """httpx's response hook: each hop's final status line and headers have arrived."""
        self._meter.start_body(response.has_redirect_location)
        if response.has_redirect_location:
            # httpx reads a redirect's body whole, inflating it as it goes (a few
            # hundred KiB of gzip can hold gigabytes); nobody reads it, so it stays raw.
            response.headers.pop("content-encoding", None)

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        policy = self._policy
        # httpcore names no scheme here: the request this connection is for does.
        exempt = self._private_ok
        if exempt is not None and self._requested == exempt and (host.lower(), port) == exempt[1:]:
            policy = attrs.evolve(policy, allow_private=True)
        try:
            with anyio.fail_after(timeout):
                addresses = await self._addresses(host, port)
                for address in addresses:
                    rule = policy.check(address)
                    if rule is not None:
                        raise RefusedAddress(host, address, rule)
                stream = await self._connect_any(host, addresses, port, local_address, socket_options)
                return _MeteredStream(stream, self._meter)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(
                f"looking up and connecting to {host} took over {timeout} s"
            ) from exc

    async def _addresses(self, host: str, port: int) -> list[Address]:
        numeric = numeric_host(host)
        if numeric is not None:
            return [numeric]
        # What the system's lookup does first: a label over 63 characters or an empty
        # one is a UnicodeError here, and no query goes out.
        host.encode("idna")
        try:
            answers = list(await self._resolver(host, port))
        except OSError as exc:
            raise httpcore.ConnectError(f"could not look up {host!r}: {exc}") from exc
        addresses: list[Address] = []
        for answer in answers:
            try:
                address = parse_address(str(answer))
            except ValueError as exc:
                raise httpcore.ConnectError(
                    f"the lookup of {host!r} answered {answer!r}, not an address"
                ) from exc
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise httpcore.ConnectError(f"the lookup of {host!r} found no address")
        return addresses

    async def _connect_any(
        self,
        host: str,
        addresses: list[Address],
        port: int,
        local_address: str | None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None,
    ) -> httpcore.AsyncNetworkStream:
        """The first of the checked addresses that accepts, tried in the resolver's order."""
        failures: list[str] = []
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    str(address), port, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                failures.append(f"{address}: {exc}")
        raise httpcore.ConnectError(f"could not connect to {host} ({'; '.join(failures)})")

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError(f"the web tools connect over TCP only, not to {path!r}")

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


class _PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (its request, response and error mapping) over a
    connection pool that connects only through `backend`."""

    def __init__(self, backend: _PinnedBackend, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context, trust_env=False)
        # httpx has no option for a network backend, so the pool it built is replaced
        # by one with ours. Should httpx rename the attribute, fail closed: a pool left
        # in place would connect past the policy.
        if not isinstance(getattr(self, "_pool", None), httpcore.AsyncConnectionPool):
            raise RuntimeError("httpx's transport has no connection pool to replace")
        self._pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context, network_backend=backend)


# -- helpers ---------------------------------------------------------------------


def _checked_url(url: object) -> str:
    if not isinstance(url, str):
        raise ToolError(f"a URL must be a string, got {url!r}", retryable=False)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise ToolError(f"not a valid URL: {url!r} ({exc})", retryable=False) from exc
    # `raw_host`, not `host`: reading `host` decodes an A-label (`xn--...`), which
    # fails on a broken one, and that is for the check below to report.
    raw_host = parsed.raw_host.decode("ascii")
    if parsed.scheme not in ("http", "https") or not raw_host:
        raise ToolError(f"only http and https URLs with a host are allowed, got {url!r}", retryable=False)
    try:
        # What the resolver will do with the name: an empty label or one over 63
        # characters fails here, not as a UnicodeError deep inside the connect. And
        # what httpx does with it: an A-label that decodes to nothing valid
        # (`xn--169-254-169-254`) is junk, not a name worth retrying.
        raw_host.encode("idna")
        _ = parsed.host
    except UnicodeError as exc:
        raise ToolError(f"not a valid host name: {raw_host!r} in {url!r} ({exc})", retryable=False) from exc
    return url


# RFC 9110: a field name is a token; a value is visible ASCII, spaces and tabs. httpx
# refuses other characters with a bare UnicodeEncodeError, h11 with an error naming
# neither the header nor the cause, and a line break would split the request.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


def _checked_headers(headers: Mapping[Any, Any]) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in headers.items():
        name, value = str(name), str(value)
        if not _HEADER_NAME.fullmatch(name):
            raise ToolError(f"not a valid header name: {name!r}", retryable=False)
        if not _HEADER_VALUE.fullmatch(value):
            raise ToolError(
                f"the value of header {name!r} can hold only printable ASCII, spaces and "
                f"tabs (no line breaks), got {value!r}",
                retryable=False,
            )
        checked[name] = value
    return checked


@asynccontextmanager
async def _network_errors(url: str) -> AsyncIterator[None]:
    """Turn httpx's transport failures into ToolErrors that say what to do."""
    try:
        yield
    except RefusedAddress as exc:
        raise ToolError(f"refused {url}: {exc}", retryable=False) from exc
    except httpx.TooManyRedirects as exc:
        raise ToolError(f"too many redirects from {url}", retryable=False) from exc
    except httpx.TimeoutException as exc:
        raise ToolError(f"timed out talking to {url} ({type(exc).__name__})") from exc
    except httpx.UnsupportedProtocol as exc:
        raise ToolError(f"unsupported protocol for {url}: {exc}", retryable=False) from exc
    except httpx.HTTPError as exc:
        raise ToolError(f"request to {url} failed: {type(exc).__name__}: {exc}") from exc
    except UnicodeError as exc:
        # The resolver's IDNA step refusing a host name, as on a redirect to a host
        # with a label over 63 characters: retrying changes nothing.
        raise ToolError(
            f"request to {url} failed: a host name could not be looked up ({exc})",
            retryable=False,
        ) from exc


_DECODED_CHUNK = 64 * 1024
_ENCODINGS = ("gzip", "x-gzip", "deflate")


@asynccontextmanager
async def _body_chunks(response: httpx.Response, limit: int) -> AsyncIterator[_DecodedBody]:
    """The (decoded) body's chunks, each at most 64 KiB, safe to leave early; no more
    than `_raw_limit(limit)` raw bytes are read for them.

    The body is read raw and decoded here, not by httpx: httpx inflates each network
    chunk in full (and each stacked encoding in turn), so a few hundred bytes of
    `gzip, gzip` become hundreds of megabytes in memory before a byte limit can act.
    Here one step never yields more than 64 KiB, and a reader that stops at its
    limit stops the inflating too. A single gzip or deflate encoding is supported
    (what the client asks for); stacked or other encodings are a ToolError.

    httpx reads a body through a chain of async generators, and closing the outer one
    leaves the inner ones half-run for the garbage collector (httpx issue #3686). So on
    the way out the response is closed and the chain driven to its end: the next read
    fails inside the innermost generator, and the failure finishes every one of them.
    """
    decoder = _BodyDecoder(response.headers.get("content-encoding", ""), str(response.url))
    raw = response.aiter_raw()
    try:
        yield _DecodedBody(raw, decoder, _raw_limit(limit))
    finally:
        with anyio.move_on_after(1, shield=True):
            await response.aclose()
            with contextlib.suppress(Exception):
                async for _ in raw:
                    pass


class _BodyDecoder:
    """Inflates one content encoding in steps of bounded output."""

    def __init__(self, header: str, url: str) -> None:
        codings = [c.strip().lower() for c in header.split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > 1:
            raise ToolError(
                f"{url} sent a body with stacked content encodings {header!r}; only a single "
                "gzip or deflate encoding is supported",
                retryable=False,
            )
        if codings and codings[0] not in _ENCODINGS:
            raise ToolError(
                f"{url} sent a body with content encoding {header!r}, which this tool cannot "
                "decode (only gzip and deflate)",
                retryable=False,
            )
        self.url = url
        self.coding = codings[0] if codings else "identity"
        self._inflater: Any = None
        if self.coding != "identity":
            gzip_framed = self.coding in ("gzip", "x-gzip")
            self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if gzip_framed else zlib.MAX_WBITS)
        self._pending = b""
        self._started = False

    @property
    def finished(self) -> bool:
        """Whether the encoded stream has ended: no more input is wanted."""
        return self._inflater is not None and bool(self._inflater.eof)

    @property
    def past_end(self) -> bool:
        """Whether input went on past the end of the encoded stream."""
        return self.finished and bool(self._inflater.unused_data)

    def push(self, data: bytes) -> None:
        if self.finished:
            return  # anything after the end of the stream is dropped, as httpx does
        self._pending += data

    def take(self) -> bytes:
        """The next at most 64 KiB of decoded body; b"" when more input is needed."""
        if self._inflater is None:
            head, self._pending = self._pending[:_DECODED_CHUNK], self._pending[_DECODED_CHUNK:]
            return head
        if self._inflater.eof:
            return b""
        try:
            piece: bytes = self._inflater.decompress(self._pending, _DECODED_CHUNK)
        except zlib.error as exc:
            if self.coding == "deflate" and not self._started:
                # Servers send "deflate" both with and without the zlib header.
                self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                return self.take()
            raise ToolError(
                f"{self.url} sent a body that is not valid {self.coding} ({exc})", retryable=False
            ) from exc
        self._started = self._started or bool(self._pending)
        self._pending = self._inflater.unconsumed_tail
        return piece


def _raw_limit(limit: int) -> int:
    """The raw (still encoded) bytes read for a body of at most `limit` decoded bytes.

    Encoded, a body is at most a little longer than decoded (deflate's stored blocks
    add 5 bytes per 64 KiB, under 1/1024; gzip's header and trailer a few bytes), and
    a raw chunk from httpx may run 64 KiB past what was wanted. A body that needs more
    than this inflates past `limit`, or to nothing at all (endless empty deflate
    blocks): either way it is longer than the limit, and reading stops there.
    """
    return limit + limit // 1024 + 2 * _DECODED_CHUNK


class _DecodedBody:
    """An async iterator of decoded chunks, read from `raw` only as they are wanted, and
    no further than `raw_limit` bytes or the end of the encoded stream.

    After the iteration, `overran` says whether it stopped at `raw_limit` (the body is
    longer than its limit), and `left_out` names what it did not read past the end
    of the encoded stream ("" when nothing followed it)."""

    def __init__(self, raw: AsyncIterator[bytes], decoder: _BodyDecoder, raw_limit: int) -> None:
        self._raw = raw
        self._decoder = decoder
        self._raw_limit = raw_limit
        self._raw_read = 0
        self._ended = False
        self.overran = False

    def __aiter__(self) -> _DecodedBody:
        return self

    async def __anext__(self) -> bytes:
        while True:
            piece = self._decoder.take()
            if piece:
                return piece
            # The end of a gzip or deflate stream is the end of the body: whatever a
            # server sends after it is not read, so it cannot cost without limit.
            if self._ended or self._decoder.finished:
                raise StopAsyncIteration
            try:
                data = await self._raw.__anext__()
            except StopAsyncIteration:
                self._ended = True
                continue
            self._raw_read += len(data)
            if self._raw_read > self._raw_limit:
                self._ended = self.overran = True
            self._decoder.push(data)

    @property
    def left_out(self) -> str:
        if not self._decoder.past_end:
            return ""
        return f"[the body went on past the end of its {self._decoder.coding} data; the rest was not read]"


async def _read_bounded(response: httpx.Response, limit: int) -> tuple[bytes, bool, str]:
    """At most `limit` bytes of the (decoded) body, whether there was more, and a note
    on what was left out past the end of its encoded data ("" when nothing was)."""
    buffer = bytearray()
    async with _body_chunks(response, limit) as chunks:
        async for chunk in chunks:
            room = limit - len(buffer)
            if len(chunk) > room:
                buffer += chunk[:room]
                return bytes(buffer), True, ""
            buffer += chunk
    return bytes(buffer), chunks.overran, chunks.left_out


def _raise_for_status(response: httpx.Response, method: str, body: bytes) -> None:
    status = response.status_code
    if status < 400:
        return
    excerpt = body[:2000].decode("utf-8", errors="replace").strip()
    message = f"HTTP {status} {response.reason_phrase} from {method} {response.url}"
    if excerpt:
        message += f"\n{excerpt}"
    raise ToolError(message, retryable=status >= 500 or status in _RETRYABLE_STATUS)


def _too_large(url: str, limit: int) -> ToolError:
    return ToolError(f"{url} is larger than the {limit}-byte download limit", retryable=False)


def _is_text(content_type: str, data: bytes) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    if not kind:
        return b"\x00" not in data[:4096]
    if kind.startswith("text/") or kind.endswith(("+json", "+xml")):
        return True
    return kind in {
        "application/json",
        "application/xml",
        "application/javascript",
        "application/ecmascript",
        "application/x-javascript",
        "application/x-www-form-urlencoded",
        "application/x-ndjson",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
    }


def _decode_text(response: httpx.Response, data: bytes) -> tuple[str, str]:
    """The body as text, and a note when its declared charset could not be used.

    The charset is, in this order, the one a byte-order mark names, the one the
    Content-Type header names, the one an HTML page's `<meta charset>` or `<meta
    http-equiv="Content-Type">` names near its start, UTF-8 when the bytes are UTF-8,
    and else charset-normalizer's guess. Labels are read as browsers read them, so a
    page saying `iso-8859-1` or `ascii` is windows-1252 (which is what such pages are).
    A charset naming no codec, or a codec that is not a text encoding (`base64`,
    `zlib`: `bytes.decode` refuses those with a LookupError), is a server's mistake,
    not a reason to hide the page: it is read as UTF-8 instead, and the note says so.
    """
    for bom, bom_codec in _BOMS:
        if data.startswith(bom):
            return data[len(bom) :].decode(bom_codec, errors="replace"), ""
    declared = response.charset_encoding
    if declared is not None:
        codec = _text_codec(declared)
        if codec is None:
            note = f"Charset: {declared!r} is not a text encoding; shown as UTF-8"
            return data.decode("utf-8", errors="replace"), note
        return data.decode(codec, errors="replace"), ""
    if _is_html(response.headers.get("content-type", ""), data[:100].decode("latin-1")):
        found = _META_CHARSET.search(data[:_META_PRESCAN_BYTES])
        codec = _text_codec(found[1].decode("ascii")) if found else None
        if codec is not None:
            # A page that is in UTF-16 cannot say so in ASCII; the label is wrong.
            return data.decode("utf-8" if codec.startswith("utf-16") else codec, errors="replace"), ""
    try:
        # Not final: a body cut at the byte limit may end inside a character.
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        return data.decode("utf-8", errors="replace"), ""
    except UnicodeDecodeError:
        pass
    guess = charset_normalizer.from_bytes(data).best()
    codec = _text_codec(guess.encoding) if guess is not None else None
    return data.decode(codec or "utf-8", errors="replace"), ""


_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
# Browsers look for the <meta> in the first 1024 bytes at least; pages that open with
# long comments or scripts put it later, so a little more is read.
_META_PRESCAN_BYTES = 4096
# `<meta charset="x">`, and `charset=x` inside a `<meta http-equiv ... content="...">`.
# Each repetition stops at a character the next part cannot start with: linear time.
_META_CHARSET = re.compile(rb"""<meta\s[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
# The labels the WHATWG Encoding standard reads as windows-1252.
_WINDOWS_1252_ALIASES = frozenset({"ascii", "latin-1", "iso8859-1", "cp1252"})


def _text_codec(label: str) -> str | None:
    """The Python codec for a charset label, or None when it names no text encoding."""
    try:
        info = codecs.lookup(label.strip())
    except LookupError:
        return None
    if not info._is_text_encoding:
        return None
    return "cp1252" if info.name in _WINDOWS_1252_ALIASES else info.name


def _is_html(content_type: str, text: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind in ("text/html", "application/xhtml+xml"):
        return True
    if kind:
        return False
    start = text.lstrip()[:100].lower()
    return start.startswith(("<!doctype html", "<html"))


def _one_line(value: object, limit: int = 200) -> str:
    text = " ".join(str(value or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _param(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _url_reads(args: Mapping[str, Any]) -> set[str]:
    url = args.get("url")
    return {resource_url(url)} if isinstance(url, str) else set()


def _method(args: Mapping[str, Any]) -> str:
    return str(args.get("method") or "GET").upper()


def _unsafe_method(args: Mapping[str, Any]) -> bool:
    """unless the method is GET, HEAD or OPTIONS"""
    return _method(args) not in _SAFE_METHODS


def _is_get(args: Mapping[str, Any]) -> bool:
    """for GET requests only"""
    return _method(args) == "GET"


def _request_writes(args: Mapping[str, Any]) -> set[str]:
    if _method(args) in _SAFE_METHODS:
        return set()
    url = args.get("url")
    return {resource_url(url)} if isinstance(url, str) else {"url:"}


# -- schemas ---------------------------------------------------------------------

_URL = {"type": "string", "minLength": 1, "description": "An http or https URL."}

_FETCH_PAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"url": _URL},
    "required": ["url"],
    "additionalProperties": False,
}

_SEARCH_WEB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "description": "What to search for."},
        "limit": {
            "type": "integer",
            "minimum": 1,
            "maximum": 20,
            "default": 5,
            "description": "How many results to return.",
        },
    },
    "required": ["query"],
    "additionalProperties": False,
}

_HTTP_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "method": {"type": "string", "enum": _METHODS, "default": "GET"},
        "url": _URL,
        "headers": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Request headers.",
        },
        "params": {
            "type": "object",
            "additionalProperties": {"type": ["string", "number", "boolean"]},
            "description": "Query parameters added to the URL.",
        },
        "body": {
            "type": ["string", "object", "array"],
            "description": "Request body: a string as is, an object or array as JSON.",
        },
    },
    "required": ["url"],
    "additionalProperties": False,
}

_DOWNLOAD_FILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "url": _URL,
        "path": {"type": "string", "minLength": 1, "description": "File, relative to the workspace."},
    },
    "required": ["url", "path"],
    "additionalProperties": False,
}
