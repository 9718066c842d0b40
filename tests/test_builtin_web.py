"""The web tools against a real HTTP server on 127.0.0.1, started by these tests."""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import os
import re
import socket
import struct
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.to_thread
import pytest

from builtin_tools import default_registry
from builtin_tools._html import html_to_text
from builtin_tools._workspace import Workspace
from builtin_tools.files import FileTools
from builtin_tools.web import SEARCH_URL_ENV, WebTools, resource_url, system_resolver
from dispatcher import Dispatcher, Status, ToolCall
from dispatcher._exceptions import ToolError

from ._fakes import tool_context
from ._network import NetworkGuard, guard_network

PAGE = b"""<!doctype html>
<html><head><title>The &amp; Page</title><style>body { color: red }</style>
<script>var secret = "do not show";</script></head>
<body><h1>Welcome</h1><p>First   paragraph
with <a href="/next">a link</a> and <b>bold</b> text.</p>
<ul><li>one</li><li>two</li></ul><pre>  keep   spacing</pre></body></html>"""
FILE_BYTES = bytes(range(256)) * 64  # 16 KiB
LONG_HOST = "a" * 300 + ".com"  # one label over DNS's 63 characters
_MIB = 1024 * 1024


@functools.cache
def _gzip_of_zeros(mib: int) -> bytes:
    """A gzip stream of `mib` MiB of zero bytes, built without compressing them all: after
    a full flush the compressor starts afresh, so each MiB compresses to the same block."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = compressor.compress(bytes(_MIB)) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(bytes(_MIB), crc)
    trailer = struct.pack("<II", crc, (mib * _MIB) & 0xFFFFFFFF)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + block * mib + compressor.flush() + trailer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path = parts.path
        if path == "/page":
            self._send(200, PAGE, "text/html; charset=utf-8")
        elif path == "/cp1252":
            self._send(200, (Path(__file__).parent / "data/windows-1252.html").read_bytes(), "text/html")
        elif path == "/plain":
            self._send(200, b"just text\n  indented", "text/plain")
        elif path == "/redirect":
            self._send(302, b"", "text/plain", Location="/page")
        elif path == "/redirect-to":
            self._send(302, b"", "text/plain", Location=query["to"][0])
        elif path.startswith("/to-localhost/"):  # the query is left alone: search_web sets it
            port = self.headers["Host"].rsplit(":", 1)[1]
            rest = self.path.removeprefix("/to-localhost/")
            self._send(302, b"", "text/plain", Location=f"http://localhost:{port}/{rest}")
        elif path.startswith("/to-https/"):  # the query is left alone: search_web sets it
            port = self.headers["Host"].rsplit(":", 1)[1]
            rest = self.path.removeprefix("/to-https/")
            self._send(302, b"", "text/plain", Location=f"https://127.0.0.1:{port}/{rest}")
        elif path == "/redirect-bomb":
            body = _gzip_of_zeros(256)
            self._send(302, body, "text/plain", Location="/plain", Content_Encoding="gzip")
        elif path == "/early-hints":
            for _ in range(3):
                self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </plain>; rel=preload\r\n\r\n")
            self._send(200, b"after hints", "text/plain")
        elif path == "/gzip-trailing":
            body = gzip.compress(b"small text") + b"trailing junk"
            self._send(200, body, "text/plain", Content_Encoding="gzip")
        elif path == "/redirect-bad-host":
            self._send(302, b"", "text/plain", Location=f"http://{LONG_HOST}/")
        elif path == "/loop":
            self._send(302, b"", "text/plain", Location="/loop")
        elif path == "/big":
            self._send(200, b"x" * 200_000, "text/plain")
        elif path == "/image":
            self._send(200, b"\x89PNG\r\n\x1a\n\x00\x00", "image/png")
        elif path == "/file.bin":
            self._send(200, FILE_BYTES, "application/octet-stream")
        elif path == "/charset-base64":
            body = "<p>h\u00e9llo</p>".encode()
            self._send(200, body, "text/html; charset=base64")
        elif path == "/gzip":
            self._send(200, gzip.compress(b"small text"), "text/plain", Content_Encoding="gzip")
        elif path == "/deflate-raw":
            raw = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
            body = raw.compress(b"raw deflate") + raw.flush()
            self._send(200, body, "text/plain", Content_Encoding="deflate")
        elif path == "/bomb":
            self._send(200, _gzip_of_zeros(1024), "text/plain", Content_Encoding="gzip")
        elif path == "/bomb-stacked":
            body = gzip.compress(_gzip_of_zeros(64))
            self._send(200, body, "text/plain", Content_Encoding="gzip, gzip")
        elif path == "/brotli":
            self._send(200, b"\x0b\x02\x80hello\x03", "text/plain", Content_Encoding="br")
        elif path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            self._send(code, f"problem {code}".encode(), "text/plain")
        elif path == "/slow":
            time.sleep(1.0)
            self._send(200, b"late", "text/plain")
        elif path == "/search":
            q = query.get("q", [""])[0]
            if query.get("format") != ["json"]:
                self._send(400, b"format=json required", "text/plain")
            elif q == "broken":
                self._send(200, b"<html>not json</html>", "text/html")
            else:
                results = [
                    {"title": f"Result {n} for {q}", "url": f"https://example.org/{n}",
                     "content": f"snippet {n}"}
                    for n in range(1, 9)
                ]  # fmt: skip
                self._send(200, json.dumps({"results": results}).encode(), "application/json")
        elif path == "/echo":
            echo = {
                "method": self.command,
                "path": path,
                "query": parse_qs(parts.query),
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body.decode("utf-8", errors="replace"),
            }
            self._send(200, json.dumps(echo).encode(), "application/json")
        else:
            self._send(404, b"not found", "text/plain")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _route


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that stops reading early resets the connection: expected here


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture(autouse=True)
def network(monkeypatch: pytest.MonkeyPatch) -> NetworkGuard:
    """Every test here: loopback connections only, no lookups of names."""
    return guard_network(monkeypatch)


@pytest.fixture
def web(ws: Path, server: str) -> WebTools:
    """The tools with loopback allowed, as the test server is on 127.0.0.1."""
    return WebTools(Workspace(ws), search_url=f"{server}/search", allow_private_network=True)


async def _call(web: WebTools, name: str, **args: Any) -> str:
    with anyio.fail_after(10):
        return str(await getattr(web, name)(args, tool_context(name)))


# -- fetch_page ---------------------------------------------------------------------------


async def test_fetch_page_reduces_html_to_readable_text(web: WebTools, server: str) -> None:
    """HTML becomes Markdown: title, headings, lists, bold, absolute links; no script or style."""
    out = await _call(web, "fetch_page", url=f"{server}/page")
    assert out.startswith(f"URL: {server}/page\nTitle: The & Page\n\n# Welcome")
    assert f"First paragraph\nwith [a link]({server}/next) and **bold** text." in out
    assert "- one\n- two" in out
    assert "```\n  keep   spacing\n```" in out
    assert "secret" not in out and "color" not in out


async def test_fetch_page_reads_the_charset_a_meta_declares(web: WebTools, server: str) -> None:
    """A windows-1252 page whose header names no charset is read by its `<meta charset>`:
    the title and the text have their accents and euro signs."""
    out = await _call(web, "fetch_page", url=f"{server}/cp1252")
    title = "Caf\u00e9 de la Gare \u2013 menu d\u2019\u00e9t\u00e9"
    assert out.startswith(f"URL: {server}/cp1252\nTitle: {title}\n\n# Caf\u00e9 de la Gare\n")
    assert re.search(r"^\| Cr\u00e8me br\u00fbl\u00e9e +\| 6,50 \u20ac +\|$", out, re.MULTILINE)
    assert "\ufffd" not in out


async def test_fetch_page_follows_redirects(web: WebTools, server: str) -> None:
    """A redirect is followed and the final URL is reported."""
    out = await _call(web, "fetch_page", url=f"{server}/redirect")
    assert out.startswith(f"URL: {server}/page\n")


async def test_fetch_page_returns_plain_text_as_is(web: WebTools, server: str) -> None:
    """A text/plain page is returned unchanged."""
    out = await _call(web, "fetch_page", url=f"{server}/plain")
    assert out == f"URL: {server}/plain\n\njust text\n  indented"


async def test_fetch_page_reads_at_most_its_byte_limit(ws: Path, server: str) -> None:
    """A body over the limit is cut at the limit and marked."""
    web = WebTools(Workspace(ws), max_page_bytes=1000, allow_private_network=True)
    out = await _call(web, "fetch_page", url=f"{server}/big")
    assert "x" * 1000 in out and "x" * 1001 not in out
    assert out.endswith("[page cut: longer than this tool returns]")


async def test_fetch_page_http_errors(web: WebTools, server: str) -> None:
    """A 4xx fails for good, a 5xx may be retried; both show the status and body."""
    with pytest.raises(ToolError, match="HTTP 404 Not Found") as missing:
        await _call(web, "fetch_page", url=f"{server}/status/404")
    assert missing.value.retryable is False and "problem 404" in missing.value.message
    with pytest.raises(ToolError, match="HTTP 503") as down:
        await _call(web, "fetch_page", url=f"{server}/status/503")
    assert down.value.retryable is True


async def test_fetch_page_refuses_binary_content(web: WebTools, server: str) -> None:
    """A non-text response is refused with a pointer to download_file."""
    with pytest.raises(ToolError, match=r"not a text page.*image/png.*download_file"):
        await _call(web, "fetch_page", url=f"{server}/image")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.org/x", "not a url", "http://"])
async def test_only_http_and_https_urls(web: WebTools, url: str) -> None:
    """Any other scheme, or a URL without a host, is refused before any request."""
    with pytest.raises(ToolError) as info:
        await _call(web, "fetch_page", url=url)
    assert info.value.retryable is False
    assert repr(url) in info.value.message


async def test_an_invalid_host_name_is_refused_by_name(web: WebTools) -> None:
    """A host with a label over 63 characters is a non-retryable error naming the host."""
    with pytest.raises(ToolError, match="not a valid host name") as info:
        await _call(web, "fetch_page", url=f"http://{LONG_HOST}/")
    assert info.value.retryable is False
    assert repr(LONG_HOST) in info.value.message


async def test_a_redirect_to_an_invalid_host_name_is_not_retryable(web: WebTools, server: str) -> None:
    """A redirect to a host name the resolver refuses fails for good, with a clear cause."""
    with pytest.raises(ToolError, match="a host name could not be looked up") as info:
        await _call(web, "fetch_page", url=f"{server}/redirect-bad-host")
    assert info.value.retryable is False


async def test_redirect_loops_stop(web: WebTools, server: str) -> None:
    """A redirect loop ends in a non-retryable error."""
    with pytest.raises(ToolError, match="too many redirects") as info:
        await _call(web, "fetch_page", url=f"{server}/loop")
    assert info.value.retryable is False


async def test_slow_server_times_out_as_retryable(ws: Path, server: str) -> None:
    """A server slower than the request timeout gives a retryable error."""
    web = WebTools(Workspace(ws), request_timeout=0.2, allow_private_network=True)
    with pytest.raises(ToolError, match="timed out") as info:
        await _call(web, "fetch_page", url=f"{server}/slow")
    assert info.value.retryable is True


async def test_connection_refused_is_retryable(web: WebTools) -> None:
    """Nobody listening is an ordinary, retryable failure."""
    with pytest.raises(ToolError, match="ConnectError") as info:
        await _call(web, "fetch_page", url="http://127.0.0.1:1/")
    assert info.value.retryable is True


# -- search_web -----------------------------------------------------------------------------


async def test_search_web_renders_the_top_results(web: WebTools) -> None:
    """Results come back numbered with title, URL and snippet, at most `limit` of them."""
    out = await _call(web, "search_web", query="trio nursery", limit=2)
    assert out.splitlines() == [
        "1. Result 1 for trio nursery",
        "   https://example.org/1",
        "   snippet 1",
        "2. Result 2 for trio nursery",
        "   https://example.org/2",
        "   snippet 2",
    ]


async def test_search_web_reads_the_endpoint_from_the_environment(
    ws: Path, server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without search_url the THREEPASS_SEARCH_URL variable names the endpoint, read per call."""
    web = WebTools(Workspace(ws))
    monkeypatch.delenv(SEARCH_URL_ENV, raising=False)
    with pytest.raises(ToolError) as info:
        await _call(web, "search_web", query="x")
    assert info.value.message == "no search endpoint configured: set THREEPASS_SEARCH_URL"
    assert info.value.retryable is False
    monkeypatch.setenv(SEARCH_URL_ENV, f"{server}/search")
    assert "Result 1 for x" in await _call(web, "search_web", query="x")


async def test_search_web_reports_a_non_json_answer(web: WebTools) -> None:
    """An endpoint that does not answer with JSON results is a clear failure."""
    with pytest.raises(ToolError, match="did not answer with JSON results"):
        await _call(web, "search_web", query="broken")


# -- http_request ------------------------------------------------------------------------


async def test_http_request_sends_method_headers_params_and_json(web: WebTools, server: str) -> None:
    """The request goes out as given; the result shows status, headers and body."""
    out = await _call(
        web,
        "http_request",
        method="POST",
        url=f"{server}/echo?a=1",
        headers={"X-Test": "yes"},
        params={"b": 2, "flag": True},
        body={"k": [1, 2]},
    )
    head, _, body = out.partition("\n\n")
    assert head.startswith("HTTP/1.1 200 OK\n")
    assert "content-type: application/json" in head.lower()
    echo = json.loads(body)
    assert echo["method"] == "POST"
    assert echo["query"] == {"a": ["1"], "b": ["2"], "flag": ["true"]}
    assert echo["headers"]["x-test"] == "yes"
    assert echo["headers"]["content-type"] == "application/json"
    assert json.loads(echo["body"]) == {"k": [1, 2]}


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"X-Name": "\u00e9"}, "the value of header 'X-Name' can hold only printable ASCII"),
        ({"X-Name": "a\r\nInjected: 1"}, "the value of header 'X-Name' can hold only"),
        ({"X-Name": "\x00"}, "the value of header 'X-Name' can hold only"),
        ({"": "a"}, "not a valid header name: ''"),
        ({"X Name": "a"}, "not a valid header name: 'X Name'"),
    ],
)
async def test_http_request_refuses_headers_that_cannot_be_sent(
    web: WebTools, server: str, headers: dict[str, str], message: str
) -> None:
    """A header name or value HTTP cannot carry is a non-retryable error naming the header."""
    with pytest.raises(ToolError, match=re.escape(message)) as info:
        await _call(web, "http_request", url=f"{server}/echo", headers=headers)
    assert info.value.retryable is False


async def test_http_request_sends_tabs_and_spaces_in_header_values(web: WebTools, server: str) -> None:
    """Inner spaces and tabs are legal in a header value and go out unchanged."""
    out = await _call(web, "http_request", url=f"{server}/echo", headers={"X-Name": "a b\tc"})
    assert json.loads(out.partition("\n\n")[2])["headers"]["x-name"] == "a b\tc"


async def test_http_request_string_body_and_head(web: WebTools, server: str) -> None:
    """A string body is sent verbatim; HEAD returns the status and headers only."""
    out = await _call(web, "http_request", method="PUT", url=f"{server}/echo", body="raw text")
    assert json.loads(out.partition("\n\n")[2])["body"] == "raw text"
    head = await _call(web, "http_request", method="HEAD", url=f"{server}/plain")
    assert head.startswith("HTTP/1.1 200 OK") and "\n\n" not in head


async def test_http_request_error_status_fails_with_the_body(web: WebTools, server: str) -> None:
    """A 4xx answer is a failure whose message carries the response body."""
    with pytest.raises(ToolError, match=r"HTTP 404.*\nproblem 404"):
        await _call(web, "http_request", url=f"{server}/status/404")


async def test_http_request_bounds_and_describes_bodies(ws: Path, server: str) -> None:
    """A long text body is cut at the limit; a binary one is described, not dumped."""
    web = WebTools(Workspace(ws), max_response_bytes=500, allow_private_network=True)
    out = await _call(web, "http_request", url=f"{server}/big")
    assert out.endswith("x" * 500 + "\n[body cut at 500 bytes]")
    out = await _call(web, "http_request", url=f"{server}/image")
    assert "[10 bytes of image/png not shown; use download_file to save it]" in out


async def test_http_request_reports_redirects(web: WebTools, server: str) -> None:
    """A followed redirect is mentioned with the final URL."""
    out = await _call(web, "http_request", url=f"{server}/redirect")
    assert f"(after 1 redirect(s), from {server}/page)" in out


async def test_a_charset_that_is_not_a_text_encoding_is_read_as_utf8(web: WebTools, server: str) -> None:
    """A page declaring charset=base64 (a codec, not a text encoding) is still shown,
    decoded as UTF-8, with a note naming the charset."""
    note = "Charset: 'base64' is not a text encoding; shown as UTF-8"
    page = await _call(web, "fetch_page", url=f"{server}/charset-base64")
    assert page == f"URL: {server}/charset-base64\n{note}\n\nh\u00e9llo"
    out = await _call(web, "http_request", url=f"{server}/charset-base64")
    head, _, body = out.partition("\n\n")
    assert head.endswith(f"\n{note}")
    assert body == "<p>h\u00e9llo</p>"


async def test_compressed_bodies_are_decoded(web: WebTools, server: str) -> None:
    """gzip and deflate (with or without the zlib header) bodies arrive decoded."""
    assert (await _call(web, "fetch_page", url=f"{server}/gzip")).endswith("\n\nsmall text")
    assert (await _call(web, "fetch_page", url=f"{server}/deflate-raw")).endswith("\n\nraw deflate")


async def test_a_decompression_bomb_is_cut_at_the_limit_in_small_memory(web: WebTools, server: str) -> None:
    """A gzip body that inflates to 1 GiB is read up to the byte limit only, and never
    held in memory beyond it."""
    assert len(_gzip_of_zeros(1024)) < 2 * _MIB  # built before memory is measured
    tracemalloc.start()
    try:
        with anyio.fail_after(10):
            out = await _call(web, "http_request", url=f"{server}/bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.endswith(f"[body cut at {web.max_response_bytes} bytes]")
    assert peak < 32 * _MIB


async def test_bytes_after_the_end_of_a_gzip_body_are_left_out_and_said_so(
    ws: Path, web: WebTools, server: str
) -> None:
    """The body ends where its gzip data ends: what follows is not read, and each tool's
    result says so."""
    note = "[the body went on past the end of its gzip data; the rest was not read]"
    url = f"{server}/gzip-trailing"
    assert (await _call(web, "fetch_page", url=url)).endswith(f"\n\nsmall text\n{note}")
    assert (await _call(web, "http_request", url=url)).endswith(f"\n\nsmall text\n{note}")
    out = await _call(web, "download_file", url=url, path="t.txt")
    assert out.endswith(f" to t.txt\n{note}")
    assert (ws / "t.txt").read_bytes() == b"small text"


async def test_a_redirect_body_is_not_inflated(web: WebTools, server: str) -> None:
    """A redirect whose unread gzip body inflates to 256 MiB is followed without
    inflating it."""
    assert len(_gzip_of_zeros(256)) < _MIB  # built before memory is measured
    tracemalloc.start()
    try:
        out = await _call(web, "fetch_page", url=f"{server}/redirect-bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out == f"URL: {server}/plain\n\njust text\n  indented"
    assert peak < 32 * _MIB


async def test_informational_responses_before_the_answer_are_skipped(web: WebTools, server: str) -> None:
    """A few 103 Early Hints before the 200 are read past (the head bound is far above them)."""
    assert (await _call(web, "fetch_page", url=f"{server}/early-hints")).endswith("\n\nafter hints")


@pytest.mark.parametrize(
    ("path", "message"),
    [("/bomb-stacked", "stacked content encodings 'gzip, gzip'"), ("/brotli", "encoding 'br'")],
)
async def test_stacked_or_unknown_encodings_are_refused(
    web: WebTools, server: str, path: str, message: str
) -> None:
    """A body in stacked or unsupported encodings is a clear error, not decoded."""
    with pytest.raises(ToolError, match=message) as info:
        await _call(web, "fetch_page", url=f"{server}{path}")
    assert info.value.retryable is False


# -- download_file ----------------------------------------------------------------------------


async def test_download_file_saves_the_exact_bytes_and_can_be_undone(
    ws: Path, web: WebTools, server: str
) -> None:
    """The file lands in the workspace byte for byte; restore_file puts back the old one."""
    (ws / "data").mkdir()
    (ws / "data/file.bin").write_bytes(b"old")
    out = await _call(web, "download_file", url=f"{server}/file.bin", path="data/file.bin")
    assert (ws / "data/file.bin").read_bytes() == FILE_BYTES
    assert out == (
        f"saved {len(FILE_BYTES)} bytes (application/octet-stream) from {server}/file.bin to data/file.bin"
    )
    FileTools(web.ws).restore_file({"path": "data/file.bin"}, tool_context("restore_file"))
    assert (ws / "data/file.bin").read_bytes() == b"old"
    assert [p.name for p in (ws / "data").iterdir()] == ["file.bin"]  # no staging file left


async def test_download_file_does_not_write_inside_a_git_folder(ws: Path, web: WebTools, server: str) -> None:
    """A download into .git is refused before anything is staged there."""
    (ws / ".git").mkdir()
    with pytest.raises(ToolError, match=r"inside a \.git folder"):
        await _call(web, "download_file", url=f"{server}/file.bin", path=".git/config")
    assert list((ws / ".git").iterdir()) == []


async def test_download_file_over_the_limit_leaves_nothing(ws: Path, server: str) -> None:
    """A download past its byte limit fails and leaves no file, partial or final."""
    web = WebTools(Workspace(ws), max_download_bytes=1000, allow_private_network=True)
    with pytest.raises(ToolError, match="larger than the 1000-byte download limit"):
        await _call(web, "download_file", url=f"{server}/file.bin", path="f.bin")
    assert await anyio.to_thread.run_sync(os.listdir, ws) == []


async def test_download_file_errors_leave_nothing(ws: Path, web: WebTools, server: str) -> None:
    """An HTTP error or a path outside the workspace writes nothing."""
    with pytest.raises(ToolError, match="HTTP 404"):
        await _call(web, "download_file", url=f"{server}/status/404", path="f.bin")
    with pytest.raises(ToolError, match="outside the workspace"):
        await _call(web, "download_file", url=f"{server}/file.bin", path="../f.bin")
    assert await anyio.to_thread.run_sync(os.listdir, ws.parent) == ["ws"]


# -- the network policy -------------------------------------------------------------------------


class FakeResolver:
    """A resolver that answers each lookup with the next list of addresses (the last
    list repeats), recording every (host, port) it was asked about."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _port(server: str) -> int:
    return int(server.rsplit(":", 1)[1])


async def _refusal(web: WebTools, name: str, **args: Any) -> str:
    """The message of the ToolError the call ends in, which must not be retryable."""
    with pytest.raises(ToolError) as info:
        await _call(web, name, **args)
    assert info.value.retryable is False
    return info.value.message


REFUSED_BY_DEFAULT = [
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254", "always refused"),
    ("http://10.0.0.1/", "10.0.0.1", "refused unless allow_private_network=True"),
    ("http://[::ffff:169.254.169.254]/", "the IPv4-mapped form of 169.254.169.254", "always refused"),
    ("http://2852039166/", "169.254.169.254", "always refused"),
    ("http://0xa9fea9fe/", "169.254.169.254", "always refused"),
    ("http://169.254.43518/", "169.254.169.254", "always refused"),
    ("http://169.254.169.254./", "169.254.169.254", "always refused"),
    ("http://0/", '0.0.0.0/8 is "this network"', "always refused"),
    ("http://0x7f.1/", "127.0.0.1", "refused unless allow_private_network=True"),
    ("http://127.1/", "127.0.0.1", "refused unless allow_private_network=True"),
    ("http://[::1]/", "::1/128 is loopback", "refused unless allow_private_network=True"),
    ("http://100.100.100.200/", "100.100.100.200", "always refused"),
    ("http://100.64.0.1/", "carrier-grade NAT", "refused unless allow_private_network=True"),
    ("https://[fd00:ec2::254]/", "fd00:ec2::254", "always refused"),
    ("http://[fe80::1%25eth0]/", "fe80::/10 is link-local", "always refused"),
    ("http://[fe80::a9fe:a9fe%25eth0]:80/", "fe80::/10 is link-local", "always refused"),
    ("http://[2002:a9fe:a9fe::]/", "the 6to4 form of 169.254.169.254", "always refused"),
    ("http://[64:ff9b::a9fe:a9fe]/", "the NAT64 form of 169.254.169.254", "always refused"),
    ("http://224.0.0.1/", "multicast", "always refused"),
    ("http://168.63.129.16/machine/", "(Azure WireServer)", "always refused"),
]


@pytest.mark.parametrize(("url", "named", "verdict"), REFUSED_BY_DEFAULT)
async def test_refused_urls_fail_for_good_without_a_connection(
    ws: Path, network: NetworkGuard, url: str, named: str, verdict: str
) -> None:
    """Metadata, private, loopback and every numeric or IPv6 spelling of them: each web
    tool fails with a non-retryable error naming the address and the rule, and no
    socket is connected."""
    web = WebTools(Workspace(ws))
    for name, args in [
        ("fetch_page", {"url": url}),
        ("http_request", {"url": url, "method": "POST", "body": "x"}),
        ("download_file", {"url": url, "path": "f.bin"}),
    ]:
        message = await _refusal(web, name, **args)
        assert message.startswith(f"refused {url}: the network policy refuses ")
        assert named in message and message.endswith(verdict)
    assert network.connects == [] and network.lookups == []
    assert os.listdir(ws) == []


async def test_a_numeric_form_httpx_cannot_parse_is_refused_as_a_url(ws: Path, network: NetworkGuard) -> None:
    """Octal dotted forms are not valid URLs to httpx: refused before anything starts."""
    message = await _refusal(WebTools(Workspace(ws)), "fetch_page", url="http://0251.0376.0251.0376/")
    assert message.startswith("not a valid URL")
    assert network.connects == []


async def test_loopback_is_refused_by_default_and_reached_when_allowed(
    ws: Path, server: str, network: NetworkGuard
) -> None:
    """The same loopback URL is refused without allow_private_network and fetched with it."""
    message = await _refusal(WebTools(Workspace(ws)), "fetch_page", url=f"{server}/plain")
    assert message.endswith("127.0.0.0/8 is loopback; refused unless allow_private_network=True")
    assert network.connects == []
    allowed = WebTools(Workspace(ws), allow_private_network=True)
    assert (await _call(allowed, "fetch_page", url=f"{server}/plain")).endswith("just text\n  indented")
    assert network.connects == [("127.0.0.1", _port(server))]


@pytest.mark.parametrize(
    "host",
    ["169.254.169.254", "0", "0.0.0.0", "[::ffff:169.254.169.254]", "[::]", "[::ffff:0.0.0.0]",
     "192.0.0.192", "168.63.129.16", "[fd00:c1::a9fe:a9fe]", "[fd00:ec2::23]"],
)  # fmt: skip
async def test_always_refused_stays_refused_with_private_allowed(
    web: WebTools, server: str, network: NetworkGuard, host: str
) -> None:
    """allow_private_network=True does not open metadata or "this network" (0.0.0.0 would
    reach the loopback server on Linux): refused, nothing connected."""
    message = await _refusal(web, "fetch_page", url=f"http://{host}:{_port(server)}/plain")
    assert message.endswith("always refused")
    assert network.connects == []


async def test_every_redirect_hop_is_checked(web: WebTools, server: str, network: NetworkGuard) -> None:
    """A redirect from an allowed server to the metadata address, in any spelling, is
    refused at that hop; only the first server was connected to."""
    for target in [
        "http://169.254.169.254/latest/meta-data/",
        "http://2852039166/",
        "http://[::ffff:a9fe:a9fe]/",
    ]:
        url = f"{server}/redirect-to?to={target}"
        for name in ("fetch_page", "http_request"):
            message = await _refusal(web, name, url=url)
            assert message.startswith(f"refused {url}: the network policy refuses ")
            assert message.endswith("always refused")
        message = await _refusal(web, "download_file", url=url, path="f.bin")
        assert "169.254.169.254" in message
    assert {host for host, _ in network.connects} == {"127.0.0.1"}
    assert network.refused == []


async def test_a_name_is_looked_up_once_and_the_checked_address_connected(
    ws: Path, server: str, network: NetworkGuard
) -> None:
    """DNS rebinding: the resolver answers loopback, then metadata; the request goes to
    the loopback address it checked (the server sees the name in Host), with one
    lookup and no second one; the next call looks up afresh and is refused."""
    resolver = FakeResolver(["127.0.0.1"], ["169.254.169.254"])
    web = WebTools(Workspace(ws), allow_private_network=True, resolver=resolver)
    port = _port(server)
    out = await _call(web, "http_request", url=f"http://rebind.test:{port}/echo")
    assert json.loads(out.partition("\n\n")[2])["headers"]["host"] == f"rebind.test:{port}"
    assert resolver.calls == [("rebind.test", port)]
    assert network.connects == [("127.0.0.1", port)] and network.lookups == []
    message = await _refusal(web, "fetch_page", url=f"http://rebind.test:{port}/page")
    assert "'rebind.test' (169.254.169.254)" in message and message.endswith("always refused")
    assert resolver.calls == [("rebind.test", port)] * 2
    assert network.connects == [("127.0.0.1", port)]


async def test_a_name_with_any_refused_address_is_refused(
    ws: Path, server: str, network: NetworkGuard
) -> None:
    """A name resolving to an allowed and a refused address is refused outright: no
    connection, not even to the allowed one."""
    resolver = FakeResolver(["127.0.0.1", "::ffff:169.254.169.254"])
    web = WebTools(Workspace(ws), allow_private_network=True, resolver=resolver)
    message = await _refusal(web, "fetch_page", url=f"http://mixed.test:{_port(server)}/page")
    assert "'mixed.test' (::ffff:a9fe:a9fe): the IPv4-mapped form of 169.254.169.254" in message
    assert network.connects == []


async def test_a_redirect_to_a_name_is_resolved_and_checked(web: WebTools, server: str) -> None:
    """A redirect to a host name goes through the same lookup and check as the first hop."""
    resolver = FakeResolver(["169.254.169.254"])
    web.resolver = resolver
    url = f"{server}/redirect-to?to=http://metadata.test/latest"
    message = await _refusal(web, "fetch_page", url=url)
    assert "'metadata.test' (169.254.169.254)" in message
    assert resolver.calls == [("metadata.test", 80)]


async def test_the_next_checked_address_is_tried_when_one_refuses(
    ws: Path, server: str, network: NetworkGuard
) -> None:
    """A name with two allowed addresses connects to the second when the first refuses."""
    resolver = FakeResolver(["127.0.0.2", "127.0.0.1"])
    web = WebTools(Workspace(ws), allow_private_network=True, resolver=resolver)
    out = await _call(web, "fetch_page", url=f"http://two.test:{_port(server)}/plain")
    assert out.endswith("just text\n  indented")
    assert network.connects == [("127.0.0.2", _port(server)), ("127.0.0.1", _port(server))]


async def test_lookup_failures_and_slow_lookups(ws: Path) -> None:
    """A failed lookup is a retryable connect error; a lookup that hangs counts toward
    the request timeout."""

    async def failing(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def hanging(host: str, port: int) -> list[str]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    web = WebTools(Workspace(ws), resolver=failing)
    with pytest.raises(ToolError, match=re.escape("could not look up 'nowhere.test'")) as failed:
        await _call(web, "fetch_page", url="http://nowhere.test/")
    assert failed.value.retryable is True
    web = WebTools(Workspace(ws), resolver=hanging, request_timeout=0.1)
    with pytest.raises(ToolError, match="timed out") as slow:
        await _call(web, "fetch_page", url="http://slow.test/")
    assert slow.value.retryable is True


async def test_the_system_resolver_is_the_default_and_answers_addresses(ws: Path) -> None:
    """Without a resolver the system's lookup is used; it returns address strings (a
    numeric host needs no query)."""
    assert WebTools(Workspace(ws)).resolver is system_resolver
    assert await system_resolver("127.0.0.1", 80) == ["127.0.0.1"]


async def test_environment_proxies_are_not_used(
    web: WebTools, server: str, network: NetworkGuard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy named in the environment would connect past the check: it is ignored."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://169.254.169.254:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert (await _call(web, "fetch_page", url=f"{server}/plain")).endswith("just text\n  indented")
    assert network.connects == [("127.0.0.1", _port(server))]


async def test_the_search_endpoint_may_be_private_but_its_results_are_checked(
    ws: Path, server: str, network: NetworkGuard
) -> None:
    """search_url on loopback works without allow_private_network; a redirect from it to
    another private host, and a loopback URL the model fetches next, are refused."""
    web = WebTools(Workspace(ws), search_url=f"{server}/search", resolver=FakeResolver(["127.0.0.1"]))
    assert "1. Result 1 for x" in await _call(web, "search_web", query="x")
    message = await _refusal(web, "fetch_page", url=f"{server}/page")
    assert message.endswith("refused unless allow_private_network=True")
    web.search_url = f"{server}/to-localhost/search"
    message = await _refusal(web, "search_web", query="x")
    assert "'localhost' (127.0.0.1): 127.0.0.0/8 is loopback" in message
    assert network.connects == [("127.0.0.1", _port(server))] * 2


async def test_the_search_endpoint_exemption_is_its_scheme_host_and_port(
    ws: Path, server: str, network: NetworkGuard
) -> None:
    """A redirect from the loopback endpoint to https on the same host and port is another
    endpoint: refused by the policy, not connected."""
    web = WebTools(Workspace(ws), search_url=f"{server}/to-https/search")
    message = await _refusal(web, "search_web", query="x")
    assert "127.0.0.0/8 is loopback; refused unless allow_private_network=True" in message
    assert network.connects == [("127.0.0.1", _port(server))]


@pytest.mark.parametrize(
    "endpoint",
    ["http://169.254.169.254/search", "http://[::ffff:169.254.169.254]/", "http://0xa9fea9fe/", "http://0/"],
)
async def test_a_search_endpoint_on_a_metadata_address_is_refused(
    ws: Path, network: NetworkGuard, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    """The search endpoint is exempt from the private rule only: metadata and "this
    network" are refused for it too, from the argument or the environment."""
    message = await _refusal(WebTools(Workspace(ws), search_url=endpoint), "search_web", query="x")
    assert message.startswith(f"refused {endpoint}") and message.endswith("always refused")
    monkeypatch.setenv(SEARCH_URL_ENV, endpoint)
    message = await _refusal(WebTools(Workspace(ws)), "search_web", query="x")
    assert message.endswith("always refused")
    assert network.connects == []


def test_fetch_page_runs_under_asyncio(ws: Path, server: str, network: NetworkGuard) -> None:
    """The handler works on an asyncio loop too: it fetches from loopback, and refuses
    the metadata address without connecting."""
    web = WebTools(Workspace(ws), allow_private_network=True)

    async def main() -> tuple[str, ToolError]:
        page = await web.fetch_page({"url": f"{server}/page"}, tool_context("fetch_page"))
        try:
            await web.fetch_page({"url": "http://169.254.169.254/"}, tool_context("fetch_page"))
        except ToolError as exc:
            return page, exc
        raise AssertionError("the metadata address was not refused")

    page, refused = asyncio.run(asyncio.wait_for(main(), 10))
    assert page.startswith(f"URL: {server}/page\nTitle: The & Page")
    assert refused.retryable is False and refused.message.endswith("always refused")
    assert network.connects == [("127.0.0.1", _port(server))]


async def test_a_refused_url_fails_its_call_and_its_siblings_run(ws: Path, server: str) -> None:
    """In one batch through a Dispatcher, the refused call is failed and not retryable;
    the call beside it runs."""
    d = Dispatcher(default_registry(ws, include=["web"], search_url=f"{server}/search"))
    s = d.session("s1", mode="direct")
    s.load_tools(["fetch_page", "search_web"])
    calls = [
        ToolCall(id="c1", name="fetch_page", arguments={"url": "http://169.254.169.254/latest/"}),
        ToolCall(id="c2", name="search_web", arguments={"query": "x"}),
    ]
    with anyio.fail_after(10):
        refused, searched = await s.dispatch(calls)
    assert refused.status is Status.failed and refused.retryable is False
    assert "refused http://169.254.169.254/latest/: the network policy" in refused.content
    assert searched.status is Status.ok and "Result 1 for x" in searched.content


def test_default_registry_passes_allow_private_network(ws: Path, server: str) -> None:
    """default_registry's web tools refuse loopback unless allow_private_network=True."""

    async def fetch(allow: bool) -> str:
        handler = (
            default_registry(ws, include=["fetch_page"], allow_private_network=allow)
            .get("fetch_page")
            .handler
        )
        try:
            return str(await handler({"url": f"{server}/plain"}, tool_context("fetch_page")))
        except ToolError as exc:
            return exc.message

    assert anyio.run(fetch, False).endswith("refused unless allow_private_network=True")
    assert anyio.run(fetch, True).endswith("just text\n  indented")


# -- flags and resources ----------------------------------------------------------------------


def test_web_tool_flags(ws: Path) -> None:
    """Caching, confirmation and resources follow the design's table."""
    reg = default_registry(ws, include=["web"])
    fetch, search = reg.get("fetch_page"), reg.get("search_web")
    http, download = reg.get("http_request"), reg.get("download_file")
    assert fetch.cache is not None and fetch.cache.scope == "shared" and fetch.concurrent is True
    assert search.cache is not None and search.cache.scope == "session" and search.concurrent is True
    assert http.cache is not None and http.cache.scope == "session" and http.cache.when is not None
    assert http.cache.when({"method": "GET", "url": "https://a"}) is True
    assert http.cache.when({"method": "POST", "url": "https://a"}) is False
    assert callable(http.confirm) and http.writes is not None and http.reads is not None
    for method, confirmed in [("GET", False), ("HEAD", False), ("OPTIONS", False),
                              ("POST", True), ("DELETE", True), ("patch", True)]:  # fmt: skip
        assert http.confirm({"method": method, "url": "https://a/b"}) is confirmed
        assert http.writes({"method": method, "url": "https://a/b?x=1"}) == (
            {"url:https://a/b"} if confirmed else set()
        )
    assert http.reads({"url": "https://a/b?x=1#f"}) == {"url:https://a/b"}
    assert download.confirm is False and download.concurrent is True and download.writes is not None
    assert download.writes({"url": "https://a", "path": "x/y.bin"}) == {f"file:{Path(ws).resolve()}/x/y.bin"}


def test_html_to_text_keeps_content_and_drops_the_rest() -> None:
    """Nested skipped elements vanish; only http(s) links are written out; entities decode;
    a table is a Markdown table."""
    title, text = html_to_text(
        "<title>T</title><div><noscript><p>hidden <b>deep</b></p></noscript>"
        "<p>a&nbsp;&lt;b&gt; <a href='javascript:void(0)'>click</a> "
        "<a href='https://x.org/'>site</a> <a href='#top'>top</a></p>"
        "<table><tr><th>k</th><td>v</td></tr></table><br>end</div>",
        "https://base.example/dir/",
    )
    assert title == "T"
    assert text == "a <b> click [site](https://x.org/) top\n\n| k | v |\n| --- | --- |\n\nend"
    _, text = html_to_text('<p>see <a href="../up.html">up</a></p>', "https://h.example/d/x.html")
    assert text == "see [up](https://h.example/up.html)"


async def test_html_to_text_with_deeply_nested_links_is_fast() -> None:
    """Links nested thousands deep (a few hundred KB) convert in well under a second, each
    closing the one before it as a browser would."""
    depth = 20_000
    page = '<a href="/x">t' * depth + "</a>" * depth
    assert len(page) > 300_000
    with anyio.fail_after(2):
        _, text = await anyio.to_thread.run_sync(
            html_to_text, page, "https://h.example/", abandon_on_cancel=True
        )
    assert text == "[t](https://h.example/x)" * depth


def test_resource_url_drops_query_and_fragment() -> None:
    """A URL's resource key ignores its query and fragment, so writes to a path cover them."""
    assert resource_url("https://h/p?q=1#top") == "url:https://h/p"
    assert resource_url("https://h/p#x?y") == "url:https://h/p"
    assert resource_url(None) == "url:"
