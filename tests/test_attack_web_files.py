"""Attacks on the shipped web and file tools, through a real Dispatcher, against servers on
127.0.0.1 these tests start and workspaces in tmp_path. Each test states the promise it
checks; one that fails has found a way to break it."""

from __future__ import annotations

import contextlib
import ctypes
import gzip
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import anyio
import pytest

from builtin_tools import default_registry
from builtin_tools._workspace import Workspace
from builtin_tools.web import WebTools
from dispatcher import Allow, Deny, Dispatcher, Registry, Status, ToolCall
from dispatcher._exceptions import ToolError

from ._fakes import tool_context
from ._http import serving
from ._network import NetworkGuard, guard_network

_MIB = 1024 * 1024
_SECRET = "OUTSIDE-SECRET"
_WEB = ["fetch_page", "search_web", "http_request", "download_file"]
_FILES = ["read_files", "find_files", "edit_file", "remove_file", "restore_file", "file_history"]


@pytest.fixture(autouse=True)
def network(monkeypatch: pytest.MonkeyPatch) -> NetworkGuard:
    """Every test here: loopback connections only, no lookups of names."""
    return guard_network(monkeypatch)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the workspace holding a secret, a file to protect and a folder."""
    out = tmp_path / "outside"
    (out / "dir").mkdir(parents=True)
    (out / "secret.txt").write_text(_SECRET)
    (out / "dir" / "secret.txt").write_text(_SECRET)
    return out


def _dispatch(registry: Registry, *calls: tuple[str, dict[str, Any]], gate: Any = None) -> list[Any]:
    """Run the calls as one batch in a direct-mode session of a fresh Dispatcher."""

    async def main() -> list[Any]:
        d = Dispatcher(registry, gate=gate)
        s = d.session("attack", mode="direct")
        s.load_tools(sorted({name for name, _ in calls}))
        batch = [ToolCall(id=f"c{i}", name=name, arguments=args) for i, (name, args) in enumerate(calls)]
        with anyio.fail_after(30):
            return list(await s.dispatch(batch))

    return anyio.run(main)


def _one(registry: Registry, name: str, **args: Any) -> Any:
    return _dispatch(registry, (name, args))[0]


def _web(ws: Path, **options: Any) -> Registry:
    return Registry(WebTools(Workspace(ws), **options).tools())


def _refused_for_good(result: Any) -> str:
    assert result.status is Status.failed, result
    assert result.retryable is False, result
    return str(result.content)


def _tree(folder: Path) -> dict[str, bytes | str]:
    """Everything under `folder`: file contents, link targets, other kinds by name."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            found[rel] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[rel] = path.read_bytes()
        else:
            found[rel] = stat.filemode(path.lstat().st_mode)
    return found


# -- raw loopback servers -----------------------------------------------------------------


class _Raw:
    """A loopback TCP server that answers every connection with `respond(conn, send)`,
    counting the bytes it managed to send (`sent`); a client that hangs up ends it."""

    def __init__(self, respond: Callable[[socket.socket, Callable[[bytes], None]], None]) -> None:
        self.respond = respond
        self.sent = 0
        self.hung_up = threading.Event()
        self.requests: list[bytes] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.port = self._sock.getsockname()[1]
        self._done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            request = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in request:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    request += piece
            self.requests.append(request)

            def send(data: bytes) -> None:
                conn.sendall(data)
                self.sent += len(data)

            try:
                self.respond(conn, send)
            except OSError:
                self.hung_up.set()
            finally:
                self._done.set()

    def wait(self, seconds: float = 10) -> None:
        """Wait until the response in progress ended (sent whole, or the client left)."""
        self._done.wait(seconds)

    def close(self) -> None:
        self._sock.close()


@contextlib.contextmanager
def _raw(respond: Callable[[socket.socket, Callable[[bytes], None]], None]) -> Iterator[_Raw]:
    server = _Raw(respond)
    try:
        yield server
    finally:
        server.close()


# -- the network policy: odd spellings ----------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://169\u3002254\u3002169\u3002254/",  # ideographic full stops
        "http://169\uff0e254\uff0e169\uff0e254/",  # fullwidth full stops
        "http://evil@169.254.169.254/",
        "http://127.0.0.1:80\\@169.254.169.254/",
        "http://a@b@169.254.169.254/",
        "http://169.254.169.254#@127.0.0.1/",
        "HTTP://169.254.169.254/",
        "http://[0:0:0:0:0:ffff:a9fe:a9fe]/",
        "http://[::ffff:169.254.169.254%25lo]/",
        "http://[fe80::1%2525lo]/",
        "http://[::a9fe:a9fe]/",
        "http://[::ffff:0:a9fe:a9fe]/",
        "http://[2002:a9fe:a9fe::1]/",
        "http://0x00a9.0xfe.0xa9.0xfe/",
        "http://0xA9FEA9FE./",
        "http://0x0000000000000000a9fea9fe/",
        "http://169.254.169.254.:80/",
        "http://0.0.0.0/",
        "http://0x0/",
        "http://[::]/",
        "http://[::ffff:0.0.0.0]/",
        "http://255.255.255.255/",
    ],
)
def test_odd_spellings_of_forbidden_addresses_are_refused_without_connecting(
    ws: Path, network: NetworkGuard, url: str
) -> None:
    """Unicode dots, user info, backslashes, fragments, zones, mapped, compatible,
    translated and 6to4 IPv6, padded hex and trailing dots of metadata and "this network":
    each web tool fails for good with allow_private_network=True, and nothing is connected."""
    reg = default_registry(ws, include=["web"], allow_private_network=True)
    results = _dispatch(
        reg,
        ("fetch_page", {"url": url}),
        ("http_request", {"url": url}),
        ("download_file", {"url": url, "path": "f.bin"}),
    )
    for result in results:
        assert "always refused" in _refused_for_good(result)
    assert network.connects == [] and network.lookups == []
    assert os.listdir(ws) == []


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.16\t9.254/",
        "http://169.254.169.254\n/",
        "http://\uff11\uff16\uff19.254.169.254/",  # fullwidth digits
        "http://\u2460\u2465\u2468.254.169.254/",  # circled digits
        " http://169.254.169.254/",
        "http://0251.254.169.254/",
        "http://0000000000000000000000000000000000000000251.254.169.254/",
        "gopher://169.254.169.254/",
        "file:///etc/passwd",
        "http:///169.254.169.254/",
    ],
)
def test_malformed_urls_are_refused_without_connecting(ws: Path, network: NetworkGuard, url: str) -> None:
    """Tabs, newlines, look-alike digits, leading spaces, octal httpx rejects and other
    schemes: a final failure naming the URL, nothing connected or looked up."""
    reg = default_registry(ws, include=["web"], allow_private_network=True)
    _refused_for_good(_one(reg, "fetch_page", url=url))
    assert network.connects == [] and network.lookups == []


def test_a_percent_encoded_host_is_looked_up_and_its_answer_checked(ws: Path, network: NetworkGuard) -> None:
    """`%31%36%39.254.169.254` is a name to httpx: it goes to the resolver, whose answer
    (the metadata address) is refused; nothing is connected."""
    calls: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["169.254.169.254"]

    reg = _web(ws, allow_private_network=True, resolver=resolver)
    message = _refused_for_good(_one(reg, "fetch_page", url="http://%31%36%39.254.169.254/"))
    assert "always refused" in message
    assert calls == ["%31%36%39.254.169.254"]
    assert network.connects == []


def test_an_invalid_punycode_host_is_a_clear_final_error(ws: Path, network: NetworkGuard) -> None:
    """A host with a broken A-label (`xn--169-254-169-254`) is a junk argument: a final
    failure that names the URL, as every other invalid URL is, not a retryable
    `IDNAError: Invalid A-label`."""
    url = "http://xn--169-254-169-254/"
    reg = default_registry(ws, include=["web"])
    for name, args in [("fetch_page", {"url": url}), ("download_file", {"url": url, "path": "f"})]:
        message = _refused_for_good(_one(reg, name, **args))
        assert url in message or "xn--169-254-169-254" in message, message
    assert network.connects == []


@pytest.mark.parametrize(
    ("address", "owner"),
    [
        ("fd00:c1::a9fe:a9fe", "Oracle Cloud's IPv6 instance metadata service"),
        ("fd00:ec2::23", "the IPv6 twin of 169.254.170.23, AWS EKS Pod Identity credentials"),
    ],
)
def test_cloud_metadata_addresses_in_ula_are_always_refused(
    ws: Path, network: NetworkGuard, address: str, owner: str
) -> None:
    """Cloud metadata/credential endpoints that live in the unique-local range, like
    fd00:ec2::254 does, stay refused with allow_private_network=True: nothing is connected."""
    reg = default_registry(ws, include=["web"], allow_private_network=True)
    result = _one(reg, "fetch_page", url=f"http://[{address}]/latest/meta-data/")
    assert network.connects == [], f"{address} ({owner}) was connected to"
    assert "always refused" in _refused_for_good(result)


# -- redirects -----------------------------------------------------------------------------


class _Redirects(BaseHTTPRequestHandler):
    """`/<status>?to=<location>` answers with that redirect; `/chain/<n>` redirects n
    more times; `/ok` is a page."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path.startswith("/to-port/"):  # the query is left alone: search_web sets it
            port = path.rsplit("/", 1)[1]
            self._answer(302, b"", {"Location": f"http://127.0.0.1:{port}/admin"})
        elif path == "/ok":
            self._answer(200, b"fine", {})
        elif path.startswith("/chain/"):
            n = int(path.rsplit("/", 1)[1])
            self._answer(302, b"", {"Location": f"/chain/{n - 1}" if n > 0 else "/ok"})
        else:
            location = query.removeprefix("to=")
            self._answer(int(path.strip("/")), b"", {"Location": location})

    do_POST = do_HEAD = do_GET

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize(
    "location",
    [
        "//169.254.169.254/latest/",
        "http://[::ffff:a9fe:a9fe]/",
        "http://0/",
        "http://evil@[fd00:ec2::254]/",
        "http://[fe80::1%25lo]:{port}/",
    ],
)
def test_every_redirect_status_to_a_forbidden_address_is_refused(
    ws: Path, network: NetworkGuard, status: int, location: str
) -> None:
    """301/302/303/307/308, absolute, protocol-relative or oddly spelled: the hop to the
    forbidden address is refused for good and only the loopback server was connected."""
    reg = default_registry(ws, include=["web"], allow_private_network=True)
    with serving(_Redirects) as host:
        port = int(host.rsplit(":", 1)[1])
        url = f"http://{host}/{status}?to={location.format(port=port)}"
        results = _dispatch(reg, ("fetch_page", {"url": url}), ("download_file", {"url": url, "path": "f"}))
    for result in results:
        assert "always refused" in _refused_for_good(result)
    assert {h for h, _ in network.connects} == {"127.0.0.1"}
    assert os.listdir(ws) == []


@pytest.mark.parametrize("location", ["file:///etc/passwd", "gopher://127.0.0.1:{port}/_", "ftp://x/"])
def test_a_redirect_to_another_scheme_is_not_followed(ws: Path, network: NetworkGuard, location: str) -> None:
    """A redirect to file:, gopher: or ftp: fails for good; nothing but the first server is reached."""
    reg = default_registry(ws, include=["web"], allow_private_network=True)
    with serving(_Redirects) as host:
        port = int(host.rsplit(":", 1)[1])
        result = _one(reg, "fetch_page", url=f"http://{host}/302?to={location.format(port=port)}")
    message = _refused_for_good(result)
    assert "root:" not in message
    assert network.connects == [("127.0.0.1", port)]


def test_a_long_redirect_chain_stops_after_ten_hops(ws: Path, network: NetworkGuard) -> None:
    """Eleven distinct hops are too many: a final error after at most 11 requests."""
    reg = default_registry(ws, include=["web"], allow_private_network=True)
    with serving(_Redirects) as host:
        assert "fine" in _one(reg, "fetch_page", url=f"http://{host}/chain/9").content
        message = _refused_for_good(_one(reg, "fetch_page", url=f"http://{host}/chain/10"))
    assert "too many redirects" in message


def test_a_redirect_to_a_name_with_one_forbidden_address_is_refused(ws: Path, network: NetworkGuard) -> None:
    """A redirect to a name that resolves to loopback and to the EC2 IPv6 metadata address
    is refused outright at that hop: no connection to either of its addresses."""
    asked: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1", "fd00:ec2::254"]

    reg = _web(ws, allow_private_network=True, resolver=resolver)
    with serving(_Redirects) as host:
        port = int(host.rsplit(":", 1)[1])
        message = _refused_for_good(
            _one(reg, "fetch_page", url=f"http://{host}/307?to=http://two.test:{port}/ok")
        )
    assert "'two.test' (fd00:ec2::254)" in message
    assert asked == ["two.test"]
    assert network.connects == [("127.0.0.1", port)]


def test_dns_rebinding_between_redirect_hops_is_refused(ws: Path, network: NetworkGuard) -> None:
    """A name that answers loopback first and the metadata address next: a redirect back
    to the same name on a fresh connection is looked up again and refused, never connected."""
    answers = [["127.0.0.1"], ["169.254.169.254"]]

    async def resolver(host: str, port: int) -> list[str]:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def respond(conn: socket.socket, send: Callable[[bytes], None]) -> None:
        send(b"HTTP/1.1 302 Found\r\nLocation: /again\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    reg = _web(ws, allow_private_network=True, resolver=resolver)
    with _raw(respond) as server:
        message = _refused_for_good(_one(reg, "fetch_page", url=f"http://rebind.test:{server.port}/"))
    assert "'rebind.test' (169.254.169.254)" in message
    assert network.connects == [("127.0.0.1", server.port)]


def test_the_search_endpoint_exemption_covers_that_endpoint_only(ws: Path, network: NetworkGuard) -> None:
    """The search endpoint may be on loopback; a redirect from it to another service on
    the same loopback host (another port) is "elsewhere" and is refused without
    allow_private_network: that service is never asked and its answer never shown."""
    internal = _Raw(
        lambda conn, send: send(
            b"HTTP/1.1 500 Oops\r\nContent-Type: text/plain\r\nContent-Length: 15\r\n\r\nINTERNAL-SECRET"
        )
    )
    try:
        with serving(_Redirects) as host:
            search_url = f"http://{host}/to-port/{internal.port}"
            reg = _web(ws, search_url=search_url)
            result = _one(reg, "search_web", query="x")
        assert internal.requests == [], "the search endpoint's redirect reached another loopback service"
        assert "INTERNAL-SECRET" not in result.content
        assert "refused" in _refused_for_good(result)
    finally:
        internal.close()


# -- response sizes ------------------------------------------------------------------------


def _limited(ws: Path) -> Registry:
    limit = 64 * 1024
    return _web(
        ws,
        allow_private_network=True,
        max_page_bytes=limit,
        max_response_bytes=limit,
        max_download_bytes=limit,
    )


_CAP = 48 * _MIB  # what a server sends at most before it gives up on the client leaving
_BOUND = 16 * _MIB  # a client that stops at a 64 KiB limit leaves long before this


def _streamer(head: bytes, first: bytes, more: bytes, tail: bytes = b"") -> Any:
    def respond(conn: socket.socket, send: Callable[[bytes], None]) -> None:
        total = 0
        send(head + first)
        while total < _CAP:
            send(more)
            total += len(more)
        if tail:
            send(tail)

    return respond


_GZIP_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: gzip\r\nConnection: close\r\n\r\n"
)


def _args(name: str, port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/"
    return {"url": url, "path": "f.bin"} if name == "download_file" else {"url": url}


@pytest.mark.parametrize("name", ["fetch_page", "http_request", "download_file"])
def test_an_endless_plain_body_is_read_only_to_the_limit(ws: Path, name: str) -> None:
    """An endless identity body: the client hangs up near its 64 KiB limit (control)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    with _raw(_streamer(head, b"", b"x" * 65536)) as server:
        _one(_limited(ws), name, **_args(name, server.port))
        server.wait()
    assert server.sent < _BOUND, f"{server.sent} bytes read for a 64 KiB limit"


@pytest.mark.parametrize("name", ["fetch_page", "http_request", "download_file"])
def test_bytes_after_the_end_of_a_gzip_body_are_not_read_without_limit(ws: Path, name: str) -> None:
    """A gzip body that ends after 5 bytes of text and goes on with endless junk: the
    response costs no more than the limit, so the client hangs up long before 16 MiB."""
    with _raw(_streamer(_GZIP_HEAD, gzip.compress(b"hello"), b"J" * 65536)) as server:
        _one(_limited(ws), name, **_args(name, server.port))
        server.wait()
    assert server.sent < _BOUND, f"{server.sent} bytes read for a 64 KiB limit"


@pytest.mark.parametrize("name", ["fetch_page", "http_request", "download_file"])
def test_a_gzip_body_that_inflates_to_nothing_is_not_read_without_limit(ws: Path, name: str) -> None:
    """An endless gzip stream of empty stored deflate blocks (5 bytes in, 0 bytes out each):
    the raw bytes read are bounded too, not only the inflated ones."""
    gzip_header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    empty_blocks = b"\x00\x00\x00\xff\xff" * 13107
    with _raw(_streamer(_GZIP_HEAD, gzip_header, empty_blocks)) as server:
        _one(_limited(ws), name, **_args(name, server.port))
        server.wait()
    assert server.sent < _BOUND, f"{server.sent} bytes read for a 64 KiB limit"


def test_endless_informational_responses_are_not_read_without_limit(ws: Path) -> None:
    """A server that answers with 103 Early Hints over and over (each 60 KB of headers)
    before its 200: the client gives up long before 16 MiB of them."""
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: </" + b"a" * 60_000 + b">; rel=preload\r\n\r\n"
    final = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
    with _raw(_streamer(b"", b"", hint, final)) as server:
        result = _one(_limited(ws), "fetch_page", url=f"http://127.0.0.1:{server.port}/")
        server.wait()
    assert server.sent < _BOUND, f"{server.sent} bytes of 1xx responses read ({result.status})"


def test_a_huge_header_fails_without_reading_it_all(ws: Path) -> None:
    """One 8 MiB header line: a clear failure, with the client gone long before the end."""
    head = b"HTTP/1.1 200 OK\r\nX-Big: "
    with _raw(_streamer(head, b"", b"a" * 65536, b"\r\n\r\nbody")) as server:
        result = _one(_limited(ws), "fetch_page", url=f"http://127.0.0.1:{server.port}/")
        server.wait()
    assert result.status is Status.failed
    assert server.sent < _BOUND


def test_content_length_lies_cannot_overfill_a_download(ws: Path) -> None:
    """A declared length under the body saves only the declared bytes; one over the
    limit is refused before the body is read; nothing partial is left."""

    def short(conn: socket.socket, send: Callable[[bytes], None]) -> None:
        send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\n" + b"y" * _MIB)

    def long(conn: socket.socket, send: Callable[[bytes], None]) -> None:
        send(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\nConnection: close\r\n\r\n" + b"z" * 1000)

    reg = _limited(ws)
    with _raw(short) as server:
        result = _one(reg, "download_file", url=f"http://127.0.0.1:{server.port}/", path="s.bin")
    assert result.status is Status.ok and (ws / "s.bin").read_bytes() == b"y" * 10
    with _raw(long) as server:
        message = _refused_for_good(
            _one(reg, "download_file", url=f"http://127.0.0.1:{server.port}/", path="l.bin")
        )
    assert "download limit" in message
    assert sorted(os.listdir(ws)) == ["s.bin"]


def test_a_download_bomb_is_cut_at_the_download_limit(ws: Path) -> None:
    """A small gzip body that inflates to 32 MiB is refused at the 64 KiB download limit,
    leaving no file behind."""
    body = gzip.compress(bytes(32 * _MIB), 9)

    def bomb(conn: socket.socket, send: Callable[[bytes], None]) -> None:
        send(_GZIP_HEAD.replace(b"Connection: close", f"Content-Length: {len(body)}".encode()) + body)

    with _raw(bomb) as server:
        message = _refused_for_good(
            _one(_limited(ws), "download_file", url=f"http://127.0.0.1:{server.port}/", path="b.bin")
        )
    assert "larger than the 65536-byte download limit" in message
    assert os.listdir(ws) == []


# -- the gate ------------------------------------------------------------------------------


def test_writing_methods_wait_for_the_gate_and_reading_ones_do_not(ws: Path) -> None:
    """A denying gate stops a POST, PUT or DELETE before anything is sent; a GET runs
    ungated; file writers (confirm=False) run ungated too."""
    asked: list[str] = []

    def gate(call: ToolCall, ctx: Any) -> Allow | Deny:
        asked.append(call.name + ":" + str(dict(call.arguments).get("method", "")))
        return Deny("no")

    def respond(conn: socket.socket, send: Callable[[bytes], None]) -> None:
        send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    reg = Registry([*WebTools(Workspace(ws), allow_private_network=True).tools()])
    with _raw(respond) as server:
        url = f"http://127.0.0.1:{server.port}/x"
        results = _dispatch(
            reg,
            *[("http_request", {"url": url, "method": m, "body": "b"}) for m in ("POST", "PUT", "DELETE")],
            gate=gate,
        )
        assert [r.status for r in results] == [Status.denied] * 3
        assert server.requests == []
        [got] = _dispatch(reg, ("http_request", {"url": url, "method": "GET"}), gate=gate)
        assert got.status is Status.ok and len(server.requests) == 1
    assert asked == ["http_request:POST", "http_request:PUT", "http_request:DELETE"]
    files = default_registry(ws, include=["edit_file"])
    [edit] = _dispatch(
        files, ("edit_file", {"path": "a.txt", "old_string": "", "new_string": "x"}), gate=gate
    )
    assert edit.status is Status.ok and (ws / "a.txt").read_text() == "x"


# -- junk arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "named"),
    [
        ("read_files", {"paths": [1]}, "paths"),
        ("read_files", {"paths": ["a"], "limit": 10**9}, "limit"),
        ("read_files", {"paths": ["a"], "offset": "1"}, "offset"),
        ("read_files", {"paths": []}, "paths"),
        ("find_files", {"pattern": None}, "pattern"),
        (
            "edit_file",
            {"path": "a", "old_string": "", "new_string": "x", "replace_all": "yes"},
            "replace_all",
        ),
        ("edit_file", {"path": ["a"], "old_string": "", "new_string": "x"}, "path"),
        ("remove_file", {}, "path"),
        ("http_request", {"url": "http://127.0.0.1/", "method": "get"}, "method"),
        ("http_request", {"url": "http://127.0.0.1/", "headers": ["a"]}, "headers"),
        ("http_request", {"url": "http://127.0.0.1/", "params": {"a": {"b": 1}}}, "params"),
        ("search_web", {"query": "q", "limit": 10**12}, "limit"),
        ("fetch_page", {"url": ""}, "url"),
        ("fetch_page", {"url": 5}, "url"),
        ("download_file", {"url": "http://127.0.0.1/", "path": None}, "path"),
    ],
)
def test_junk_arguments_are_refused_naming_the_argument(
    ws: Path, network: NetworkGuard, name: str, args: dict[str, Any], named: str
) -> None:
    """Wrong types, empty lists and huge numbers are an invalid_arguments result that
    names the argument; nothing runs."""
    [result] = _dispatch(default_registry(ws, include=["web", "files"]), (name, args))
    assert result.status is Status.invalid_arguments, result
    assert named in result.content
    assert network.connects == [] and os.listdir(ws) == []


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("a\x00b", "NUL"),
        ("x" * 300, "File name too long"),
        ("\u00e9" * 128, "File name too long"),  # 256 bytes in UTF-8
    ],
)
def test_impossible_paths_are_clear_failures(ws: Path, path: str, message: str) -> None:
    """NUL bytes and over-long names or paths fail for good, saying why, for readers and writers."""
    reg = default_registry(ws, include=["files"])
    results = _dispatch(
        reg,
        ("read_files", {"paths": [path]}),
        ("edit_file", {"path": path, "old_string": "", "new_string": "x"}),
    )
    for result in results:
        assert message in _refused_for_good(result)
    assert os.listdir(ws) == []


def test_find_files_over_a_very_deep_folder_gives_an_answer_or_a_clear_error(ws: Path) -> None:
    """A folder nested 1500 deep, which edit_file makes on request: find_files then
    answers (or fails for good saying why), not with a retryable RecursionError."""
    reg = default_registry(ws, include=["files"])
    deep = "/".join(["d"] * 1500) + "/f.txt"
    try:
        [made] = _dispatch(reg, ("edit_file", {"path": deep, "old_string": "", "new_string": "x"}))
        assert made.status is Status.ok
        [found] = _dispatch(reg, ("find_files", {"pattern": "**/*.txt"}))
    finally:  # shutil.rmtree (pytest's clean-up of old tmp_path folders) recurses too deep
        subprocess.run(["rm", "-rf", str(ws / "d")], check=True)
    assert "RecursionError" not in found.content, found.content
    assert found.status is Status.ok or found.retryable is False


def test_a_lone_surrogate_in_a_path_is_refused_as_invalid(ws: Path) -> None:
    """A path that cannot be a file name (a lone surrogate) is invalid_arguments, naming it."""
    [result] = _dispatch(default_registry(ws, include=["files"]), ("read_files", {"paths": ["a\ud800"]}))
    assert result.status is Status.invalid_arguments
    assert "surrogate" in result.content


# -- file confinement ----------------------------------------------------------------------


def _links(ws: Path, outside: Path) -> None:
    """Links in the workspace that lead out, every way a link can."""
    (ws / "sub").mkdir()
    (ws / "to-secret").symlink_to(outside / "secret.txt")
    (ws / "to-dir").symlink_to(outside / "dir")
    (ws / "rel-out").symlink_to("../outside/secret.txt")
    (ws / "sub" / "up").symlink_to("../../outside")
    (ws / "chain1").symlink_to("chain2")
    (ws / "chain2").symlink_to("sub/chain3")
    (ws / "sub" / "chain3").symlink_to("../to-secret")
    (ws / "dangling").symlink_to(outside / "new.txt")
    (ws / "dangling-dir").symlink_to(outside / "newdir")
    (ws / "zero").symlink_to("/dev/zero")
    (ws / "proc-root").symlink_to("/proc/self/root")
    (ws / "proc-cwd").symlink_to("/proc/self/cwd")
    (ws / "self").symlink_to(".")
    (ws / "loop1").symlink_to("loop2")
    (ws / "loop2").symlink_to("loop1")


_OUT_PATHS = [
    "../outside/secret.txt",
    "sub/../../outside/secret.txt",
    "./../outside/secret.txt",
    "to-secret",
    "to-dir/secret.txt",
    "rel-out",
    "sub/up/secret.txt",
    "sub/up/dir/secret.txt",
    "chain1",
    "self/self/to-secret",
    "self/../outside/secret.txt",
    "proc-root{outside}/secret.txt",
    "proc-cwd/../outside/secret.txt",
    "{outside}/secret.txt",
    "/{outside}/secret.txt",
    "{ws}/../outside/secret.txt",
    "{ws}/to-dir/secret.txt",
]


@pytest.mark.parametrize("path", _OUT_PATHS)
def test_paths_that_lead_out_are_never_read(ws: Path, outside: Path, path: str) -> None:
    """`..`, absolute paths, links to files, folders and links, chains, `/proc/self/root`
    and links to the workspace itself: read_files fails for good and shows no secret."""
    _links(ws, outside)
    path = path.format(outside=outside, ws=ws)
    result = _one(default_registry(ws, include=["files"]), "read_files", paths=[path])
    assert _SECRET not in result.content
    _refused_for_good(result)


@pytest.mark.parametrize(
    "path", [*_OUT_PATHS, "dangling", "dangling-dir/x.txt", "to-dir/new.txt", "sub/up/new.txt", "zero"]
)
def test_paths_that_lead_out_are_never_written(ws: Path, outside: Path, path: str) -> None:
    """edit_file (create and edit), remove_file, restore_file and download_file on a path
    that leads out fail, and nothing outside changes: no file made, none edited or removed."""
    _links(ws, outside)
    before = _tree(outside)
    path = path.format(outside=outside, ws=ws)
    reg = default_registry(ws, include=["files", "download_file"], allow_private_network=True)
    with serving() as host:
        results = _dispatch(
            reg,
            ("edit_file", {"path": path, "old_string": "", "new_string": "pwned"}),
            ("edit_file", {"path": path, "old_string": _SECRET, "new_string": "pwned"}),
            ("remove_file", {"path": path}),
            ("restore_file", {"path": path}),
            ("download_file", {"url": f"http://{host}/", "path": path}),
        )
    for result in results:
        assert result.status is Status.failed, result
    assert _tree(outside) == before


def test_find_files_never_lists_or_enters_what_links_lead_to(ws: Path, outside: Path) -> None:
    """find_files lists a link to an outside folder by its own name only: nothing inside
    the outside folder is listed, whatever the pattern."""
    _links(ws, outside)
    reg = default_registry(ws, include=["find_files"])
    for pattern in ["**", "**/secret.txt", "to-dir/*", "sub/up/**"]:
        [result] = _dispatch(reg, ("find_files", {"pattern": pattern, "include_ignored": True}))
        listed = result.content.splitlines()[1:]  # the first line repeats the pattern
        assert not any("secret.txt" in line for line in listed), (pattern, result.content)


def test_a_hardlink_to_an_outside_file_is_replaced_or_removed_never_written(ws: Path, outside: Path) -> None:
    """A hardlink to an outside file reads as that file (documented), but edit_file,
    download_file and remove_file change only the workspace's name for it."""
    os.link(outside / "secret.txt", ws / "hard.txt")
    os.link(outside / "dir" / "secret.txt", ws / "hard2.txt")
    reg = default_registry(ws, include=["files", "download_file"], allow_private_network=True)
    with serving() as host:
        edit, download, remove = _dispatch(
            reg,
            ("edit_file", {"path": "hard.txt", "old_string": _SECRET, "new_string": "pwned"}),
            ("download_file", {"url": f"http://{host}/x", "path": "hard2.txt"}),
            ("remove_file", {"path": "hard.txt"}),
        )
    assert [edit.status, download.status, remove.status] == [Status.ok] * 3
    assert (outside / "secret.txt").read_text() == _SECRET
    assert (outside / "dir" / "secret.txt").read_text() == _SECRET
    assert (outside / "secret.txt").stat().st_nlink == 1 and not (ws / "hard.txt").exists()


def test_a_link_loop_is_a_clear_failure(ws: Path, outside: Path) -> None:
    """A link loop fails for good, saying so, for a read and a write."""
    _links(ws, outside)
    reg = default_registry(ws, include=["files"])
    read, edit = _dispatch(
        reg,
        ("read_files", {"paths": ["loop1"]}),
        ("edit_file", {"path": "loop1/x", "old_string": "", "new_string": "x"}),
    )
    assert "more than 40 symbolic links" in _refused_for_good(read)
    assert edit.status is Status.failed


def test_pipes_sockets_and_devices_are_never_opened(ws: Path, outside: Path) -> None:
    """A FIFO (direct, through a link, as a hardlink), a socket and a character device
    (/dev/zero's numbers, made with mknod as root) are refused at once by every file tool."""
    os.mkfifo(ws / "fifo")
    (ws / "to-fifo").symlink_to("fifo")
    os.mkfifo(outside / "fifo")
    os.link(outside / "fifo", ws / "hard-fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws / "sock"))
    names = ["fifo", "to-fifo", "hard-fifo", "sock"]
    if os.geteuid() == 0:
        os.mknod(ws / "dev-zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
        names.append("dev-zero")
    reg = default_registry(ws, include=["files", "download_file"], allow_private_network=True)
    started = time.monotonic()
    try:
        with serving() as host:
            for name in names:
                read, edit, remove, download = _dispatch(
                    reg,
                    ("read_files", {"paths": [name]}),
                    ("edit_file", {"path": name, "old_string": "a", "new_string": "b"}),
                    ("remove_file", {"path": name}),
                    ("download_file", {"url": f"http://{host}/", "path": name}),
                )
                assert "not a regular file" in _refused_for_good(read)
                for result in (edit, remove, download):
                    assert result.status is Status.failed, (name, result)
    finally:
        sock.close()
    assert time.monotonic() - started < 20
    assert stat.S_ISFIFO((ws / "fifo").lstat().st_mode)
    assert (ws / "to-fifo").is_symlink()


def test_git_folders_are_refused_in_every_spelling(ws: Path) -> None:
    """`.git`, `.GIT`, `sub/.Git`, through `..` or a link to it: writes are refused."""
    (ws / ".git" / "hooks").mkdir(parents=True)
    (ws / "sub" / ".Git").mkdir(parents=True)
    (ws / "g").symlink_to(".git")
    reg = default_registry(ws, include=["files"])
    paths = [
        ".git/config",
        ".GIT/hooks/post-checkout",
        "sub/.Git/config",
        "sub/../.git/x",
        "g/hooks/pre-commit",
    ]
    results = _dispatch(
        reg, *[("edit_file", {"path": p, "old_string": "", "new_string": "x"}) for p in paths]
    )
    for result in results:
        assert ".git folder" in _refused_for_good(result)
    assert _tree(ws / ".git") == {"hooks": "drwxr-xr-x"}


def test_a_workspace_reached_through_a_link_stays_confined(tmp_path: Path, outside: Path) -> None:
    """A workspace named through a symlink: paths through the link name work, `..` from
    it and links out of it are still refused."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.txt").write_text("inside")
    link = tmp_path / "link"
    link.symlink_to(real)
    reg = default_registry(link, include=["files"])
    ok, out, up = _dispatch(
        reg,
        ("read_files", {"paths": [f"{link}/a.txt"]}),
        ("read_files", {"paths": [f"{link}/../outside/secret.txt"]}),
        ("edit_file", {"path": "../outside/new.txt", "old_string": "", "new_string": "x"}),
    )
    assert ok.status is Status.ok and "inside" in ok.content
    assert _SECRET not in out.content and out.status is Status.failed
    assert up.status is Status.failed and not (outside / "new.txt").exists()


# -- races ---------------------------------------------------------------------------------


_AT_FDCWD = -100
try:
    _renameat2: Any = ctypes.CDLL(None, use_errno=True).renameat2
except AttributeError:  # pragma: no cover - not Linux
    _renameat2 = None


@contextlib.contextmanager
def _swapping(a: Path, b: Path) -> Iterator[list[int]]:
    """A thread exchanging `a` and `b` (renameat2 RENAME_EXCHANGE) until the block ends."""
    if _renameat2 is None:
        pytest.skip("needs renameat2")
    stop = threading.Event()
    swaps = [0]

    def run() -> None:
        while not stop.is_set():
            if _renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), 2) == 0:
                swaps[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield swaps
    finally:
        stop.set()
        thread.join(5)
        if a.is_symlink():
            _renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), 2)


def _race(seconds: float, attempt: Callable[[], bool]) -> tuple[int, int]:
    """Call `attempt` until it returns True (an escape) or time runs out: (tries, escapes)."""
    tries = escapes = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tries += 1
        try:
            escaped = attempt()
        except ToolError:
            escaped = False
        if escaped:
            escapes += 1
            break
    return tries, escapes


def test_a_file_swapped_for_a_link_is_never_read_or_written_through(ws: Path, outside: Path) -> None:
    """A thread swaps `f.txt` with a symlink to the outside secret: read_files never shows
    it, edit_file never changes it."""
    (ws / "f.txt").write_text("inside text")
    (ws / ".parked").symlink_to(outside / "secret.txt")
    reg = default_registry(ws, include=["files"])
    read = reg.get("read_files").handler
    edit = reg.get("edit_file").handler

    def attempt() -> bool:
        out = str(read({"paths": ["f.txt"]}, tool_context("read_files")))
        with contextlib.suppress(ToolError):
            edit({"path": "f.txt", "old_string": "text", "new_string": "text"}, tool_context("edit_file"))
        with contextlib.suppress(ToolError):
            edit({"path": "f.txt", "old_string": _SECRET, "new_string": "pwned"}, tool_context("edit_file"))
        return _SECRET in out or (outside / "secret.txt").read_text() != _SECRET

    with _swapping(ws / "f.txt", ws / ".parked") as swaps:
        tries, escapes = _race(1.5, attempt)
    assert escapes == 0 and swaps[0] > 0, (tries, escapes)


def test_a_file_swapped_for_a_fifo_never_hangs_a_read(ws: Path) -> None:
    """A thread swaps `f.txt` with a FIFO: every read_files returns at once (no open that
    waits for a writer)."""
    (ws / "f.txt").write_text("inside")
    os.mkfifo(ws / ".parked")
    read = default_registry(ws, include=["read_files"]).get("read_files").handler
    finished = threading.Event()
    counted = [0]

    def loop() -> None:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with contextlib.suppress(ToolError):
                read({"paths": ["f.txt"]}, tool_context("read_files"))
            counted[0] += 1
        finished.set()

    with _swapping(ws / "f.txt", ws / ".parked"):
        threading.Thread(target=loop, daemon=True).start()
        assert finished.wait(10), f"a read hung after {counted[0]} calls"


def test_find_files_never_reads_a_gitignore_outside(ws: Path, outside: Path) -> None:
    """A thread swaps folder `d` with a symlink to an outside folder whose .gitignore
    ignores `visible.txt`: find_files keeps listing d/visible.txt, as d's own .gitignore
    ignores nothing (a file outside the workspace never decides what is shown)."""
    (ws / "d").mkdir()
    (ws / "d" / ".gitignore").write_text("# nothing ignored\n")
    (ws / "d" / "visible.txt").write_text("x")
    (outside / "dir" / ".gitignore").write_text("visible.txt\n")
    (ws / ".parked").symlink_to(outside / "dir")
    find = default_registry(ws, include=["find_files"]).get("find_files").handler
    seen: list[str] = []

    def attempt() -> bool:
        out = str(find({"pattern": "d/*"}, tool_context("find_files")))
        if "d/.gitignore" in out and "d/visible.txt" not in out:
            seen.append(out)
            return True
        return False

    with _swapping(ws / "d", ws / ".parked") as swaps:
        tries, escapes = _race(3.0, attempt)
    assert swaps[0] > 0
    assert escapes == 0, f"after {tries} tries, the outside .gitignore hid d/visible.txt:\n{seen[0]}"
