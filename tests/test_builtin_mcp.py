"""MCP servers as a tool source, against real servers: `mcp-server-time` and `mcp-server-git`
from PyPI over stdio, and the small server in tests/data/mcp_server.py (slow calls, errors,
images, `_meta`) over stdio and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import mcp_types
import pytest

from builtin_tools.mcp import (
    MCPServerError,
    MCPTools,
    _Connection,
    _connection_closed,
    _content_of,
    _tool_for,
    _unique_names,
    open_mcp,
)
from dispatcher import Deny, Dispatcher, Registry, Status, ToolCall, ToolContext

PROBE = str(Path(__file__).parent / "data" / "mcp_server.py")
TIME = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
UTC = {"timezone": "UTC"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds server processes through /proc")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, timeout=30
    ).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with one commit and one untracked file, `new.txt`."""
    path = tmp_path / "repo"
    path.mkdir()
    _git(path, "init", "-q", "-b", "main")
    _git(path, "config", "user.email", "t@example.com")
    _git(path, "config", "user.name", "T")
    (path / "README").write_text("hello\n")
    _git(path, "add", "README")
    _git(path, "commit", "-q", "-m", "first")
    (path / "new.txt").write_text("new\n")
    return path


def _git_server(repo: Path) -> tuple[str, list[str]]:
    return sys.executable, ["-m", "mcp_server_git", "--repository", str(repo)]


def _server_pids() -> set[int]:
    """The live (not zombie) child processes of this test process, but for the forkserver
    and resource tracker that an earlier test's worker processes (`isolation="process"`)
    left running in it, and the streamable HTTP server of this module (`http_server`),
    which lives for the module's tests that a worker runs, in whatever order."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if (
            fields[0] != "Z"
            and int(fields[1]) == os.getpid()
            and b"from multiprocessing." not in command
            and command.split(b"\x00")[1:3] != [os.fsencode(PROBE), b"--http"]
        ):
            found.add(int(entry))
    return found


@asynccontextmanager
async def _served(command: str, args: Sequence[str] = (), **options: Any) -> AsyncIterator[MCPTools]:
    """`open_mcp` with its tools always loaded, and a bound on how long a test may wait."""
    with anyio.fail_after(30):
        async with open_mcp(command, args, deferred=False, **options) as tools:
            yield tools


def _dispatcher(tools: MCPTools, gate: Any = None) -> Dispatcher:
    return Dispatcher(Registry(list(tools)), gate=gate)


async def _one(d: Dispatcher, name: str, args: Mapping[str, Any], session: str = "s") -> Any:
    [r] = await d.session(session, mode="direct").dispatch([ToolCall("c1", name, dict(args))])
    return r


# -- listing and tags --------------------------------------------------------------------
# Listing and reading results are the same SDK calls on either loop, and every dispatching
# test below runs on both: these run on trio alone, to keep the file's time down.


@pytest.mark.trio
async def test_time_tools_are_read_only_concurrent_and_unconfirmed() -> None:
    """The time server's tools keep their schemas, run concurrently, need no confirmation,
    read their own key of the server's namespace and write nothing."""
    with anyio.fail_after(30):
        async with open_mcp(TIME[0], TIME[1:], name="time") as tools:
            assert all(t.deferred for t in tools)
            assert tools.server == "time"
            assert [t.name for t in tools] == ["get_current_time", "convert_time"]
            now = tools.get("get_current_time")
            assert now.parameters["required"] == ["timezone"]
            assert now.concurrent is True and now.confirm is False
            assert now.reads is not None and now.reads(UTC) == {"mcp:time/get_current_time"}
            assert now.writes is None
            assert "open world" not in now.description


@pytest.mark.trio
async def test_git_tools_are_prefixed_and_tagged_from_their_annotations(repo: Path) -> None:
    """With `prefix=True` the git tools are `git__<tool>`; read-only ones are concurrent
    readers, the others writers of the whole server (`mcp:git`), and the destructive one
    (`git_reset`) needs confirmation."""
    async with _served(*_git_server(repo), name="git", prefix=True) as tools:
        by_name = {t.name: t for t in tools}
        assert all(name.startswith("git__") for name in by_name)
        status, add, reset = by_name["git__git_status"], by_name["git__git_add"], by_name["git__git_reset"]
        assert status.concurrent is True and status.confirm is False and status.writes is None
        assert add.concurrent is False and add.confirm is False and add.reads is None
        assert add.writes is not None and add.writes({}) == {"mcp:git"}
        assert reset.confirm is True and reset.writes is not None
        assert "MCP server 'git'" in status.description


@pytest.mark.trio
async def test_annotations_follow_mcp_defaults_and_can_be_distrusted() -> None:
    """A tool with no annotations is a confirmed writer reaching the open world (MCP's
    defaults); `trust_annotations=False` treats every tool that way."""
    async with _served(sys.executable, [PROBE]) as tools:
        assert tools.server == "probe"
        bare = tools.get("unannotated")
        assert bare.confirm is True and bare.concurrent is False
        assert bare.writes is not None and bare.writes({}) == {"mcp:probe"}
        assert "open world" in bare.description
        assert tools.get("nap").confirm is False
    async with _served(sys.executable, [PROBE], trust_annotations=False) as tools:
        assert tools.get("nap").confirm is True and tools.get("nap").concurrent is False


# -- dedupe and invalidation --------------------------------------------------------------


async def test_a_repeated_read_only_call_is_deduped() -> None:
    """`get_current_time` asked twice in a batch and again next round reaches the server once."""
    async with _served(TIME[0], TIME[1:], name="time") as tools:
        s = _dispatcher(tools).session("s", mode="direct")
        first = await s.dispatch([ToolCall(i, "get_current_time", UTC) for i in "ab"])
        [again] = await s.dispatch([ToolCall("c", "get_current_time", UTC)])
        assert [r.status for r in (*first, again)] == [Status.ok] * 3
        assert [r.deduped for r in (*first, again)] == [False, True, True]
        assert again.content == first[0].content and '"timezone": "UTC"' in again.content
        assert tools.statistics().calls == 1


async def test_git_status_runs_again_after_git_add(repo: Path) -> None:
    """After `git_add`, `git_status` reaches the server again and shows the file staged, in
    one batch and across rounds."""
    async with _served(*_git_server(repo), name="git") as tools:
        s = _dispatcher(tools).session("s", mode="direct")
        path = {"repo_path": str(repo)}
        [before] = await s.dispatch([ToolCall("1", "git_status", path)])
        [added] = await s.dispatch([ToolCall("2", "git_add", {**path, "files": ["new.txt"]})])
        [after] = await s.dispatch([ToolCall("3", "git_status", path)])
        assert added.status == Status.ok and not after.deduped
        assert "Untracked files" in before.content and "Changes to be committed" in after.content
        batch = await s.dispatch([
            ToolCall("4", "git_status", path),
            ToolCall("5", "git_reset", path),
            ToolCall("6", "git_status", path),
        ])  # fmt: skip
        assert [r.deduped for r in batch] == [True, False, False]
        assert "Untracked files" in batch[2].content
        assert tools.statistics().calls == 5


async def test_a_destructive_tool_goes_to_the_gate(repo: Path) -> None:
    """`git_reset` is asked about first; a gate that denies it leaves the index as it was
    and the server uncalled."""
    _git(repo, "add", "new.txt")
    asked: list[str] = []

    def gate(call: ToolCall, ctx: ToolContext) -> Deny:
        asked.append(call.name)
        return Deny("not today")

    async with _served(*_git_server(repo), name="git") as tools:
        r = await _one(_dispatcher(tools, gate), "git_reset", {"repo_path": str(repo)})
        assert r.status == Status.denied and "not today" in r.content
        assert asked == ["git_reset"] and tools.statistics().calls == 0
    assert _git(repo, "diff", "--cached", "--name-only").split() == ["new.txt"]


# -- one session, concurrent calls, results ------------------------------------------------


@pytest.mark.slow
async def test_concurrent_calls_share_one_session() -> None:
    """Three read-only naps of 0.4 s in one batch overlap on the one server process."""
    async with _served(sys.executable, [PROBE]) as tools:
        assert len(_server_pids()) == 1
        s = _dispatcher(tools).session("s", mode="direct")
        t0 = time.monotonic()
        results = await s.dispatch([ToolCall(f"n{i}", "nap", {"seconds": 0.4 + i / 100}) for i in range(3)])
        elapsed = time.monotonic() - t0
        assert [r.status for r in results] == [Status.ok] * 3
        assert tools.statistics().max_in_flight == 3 and elapsed < 1.0
        assert len(_server_pids()) == 1


@pytest.mark.trio
async def test_results_become_text_for_the_model() -> None:
    """Text blocks are joined, an image is described, structured content alone is JSON, and
    `isError` is a failed result, retryable for an idempotent tool."""
    async with _served(sys.executable, [PROBE]) as tools:
        d = _dispatcher(tools)
        picture = await _one(d, "picture", {})
        assert picture.content == "a picture\n[image image/png, 100 bytes]"
        numbers = await _one(d, "numbers", {}, session="s2")
        assert numbers.content == '{"one": 1, "two": 2}'
        refused = await _one(d, "refuse", {"reason": "no"}, session="s3")
        assert refused.status == Status.failed and "refused: no" in refused.content
        assert refused.retryable is True


async def test_the_meta_hook_is_sent_as_meta_on_each_call() -> None:
    """What `meta(ctx)` returns goes in the tools/call `_meta`; a hook that raises costs the
    call nothing."""
    seen: list[str] = []

    def meta(ctx: ToolContext) -> dict[str, str]:
        seen.append(ctx.call_id)
        if ctx.call_id == "broken":
            raise RuntimeError("no tracer")
        return {"traceparent": f"00-{ctx.call_id}-01"}

    async with _served(sys.executable, [PROBE], meta=meta) as tools:
        s = _dispatcher(tools).session("s", mode="direct")
        [traced] = await s.dispatch([ToolCall("c1", "echo_meta", {})])
        s.new_run()
        [untraced] = await s.dispatch([ToolCall("broken", "echo_meta", {})])
        assert "'traceparent': '00-c1-01'" in traced.content and seen == ["c1", "broken"]
        assert untraced.status == Status.ok and "traceparent" not in untraced.content


def test_every_content_block_becomes_text() -> None:
    """Resource links, embedded resources (a text one with its text) and audio are described."""
    result = mcp_types.CallToolResult(
        content=[
            mcp_types.ResourceLink(uri="file:///a.txt", name="a", mime_type="text/plain"),
            mcp_types.EmbeddedResource(
                resource=mcp_types.TextResourceContents(uri="file:///b.txt", text="bee")
            ),
            mcp_types.EmbeddedResource(
                resource=mcp_types.BlobResourceContents(uri="file:///c.bin", blob="AAAA", mime_type="x/y")
            ),
            mcp_types.AudioContent(data="AAAAAA==", mime_type="audio/wav"),
        ]
    )
    assert _content_of(result).split("\n") == [
        "[resource link file:///a.txt text/plain: a]",
        "[resource file:///b.txt]",
        "bee",
        "[resource file:///c.bin x/y, 3 bytes]",
        "[audio audio/wav, 4 bytes]",
    ]


def test_tool_names_are_made_safe_and_unusable_schemas_skipped() -> None:
    """A listed name with characters a Tool refuses gets `_` for them; a tool whose schema
    is not a valid JSON schema is left out (with a logged warning) rather than failing the open."""
    connection = _Connection(server="my_server")
    odd = mcp_types.Tool(name="files/read", input_schema={"type": "object"})
    tool = _tool_for(odd, connection, prefix=True, deferred=True, timeout=None, trust_annotations=True)
    assert tool is not None and tool.name == "my_server__files_read"
    broken = mcp_types.Tool(name="bad", input_schema={"type": "object", "properties": {"x": {"type": 12}}})
    assert (
        _tool_for(broken, connection, prefix=False, deferred=True, timeout=None, trust_annotations=True)
        is None
    )


def _made(names: Sequence[str], server: str = "srv", prefix: bool = False) -> list[tuple[str, Any]]:
    connection = _Connection(server=server)
    made = []
    for name in names:
        listed = mcp_types.Tool(name=name, input_schema={"type": "object"})
        tool = _tool_for(
            listed, connection, prefix=prefix, deferred=True, timeout=None, trust_annotations=True
        )
        assert tool is not None
        made.append((name, tool))
    return made


def test_names_that_collide_once_made_safe_are_made_unique(caplog: pytest.LogCaptureFixture) -> None:
    """A name listed twice keeps its first listing; distinct names that meet once made safe
    all stay, the one that needed no change under its own name, the others with a suffix
    that does not depend on the listing order; one log line says so; a Registry takes them."""
    listed = ["a b", "a_b", "dup", "dup", "x" * 130 + "1", "x" * 130 + "2"]
    tools = _unique_names("srv", _made(listed), prefix=False)
    names = [t.name for t in tools]
    [line] = [r.getMessage() for r in caplog.records if r.name == "threepass.mcp"]
    assert "dropped: 'dup'" in line and f"'a b' -> {names[0]!r}" in line
    assert len(names) == len(set(names)) == 5
    assert names[1] == "a_b" and names[2] == "dup" and names[0].startswith("a_b_")
    assert all(len(n) <= 128 for n in names)
    assert sorted(t.name for t in _unique_names("srv", _made(listed[::-1]), prefix=False)) == sorted(names)
    assert len(Registry(list(tools))) == 5


class _FakeDispatcher:
    def __init__(self, closed: bool) -> None:
        self._closed = closed


class _FakeSession:
    def __init__(self, closed: bool) -> None:
        self._dispatcher = _FakeDispatcher(closed)


class _FakeClient:
    def __init__(self, closed: bool | None) -> None:
        self._closed = closed

    @property
    def session(self) -> Any:
        if self._closed is None:
            raise RuntimeError("Client must be used within an async context manager")
        return _FakeSession(self._closed)


@pytest.mark.parametrize(
    ("closed", "code", "message", "gone"),
    [
        (False, -32000, "rate limited, try later", False),  # the server's own error
        (False, -32000, "Connection closed", False),  # ... whatever it says, while it is read
        (True, -32000, "rate limited, try later", False),  # its answer, then it went
        (True, -32000, "Connection closed", True),  # the SDK's: the connection closed
        (True, -32603, "Connection closed", False),  # another code is never a closed connection
        (None, -32000, "Connection closed", True),  # the client has left its block
    ],
)
def test_a_closed_connection_is_told_from_a_servers_own_error_minus_32000(
    closed: bool | None, code: int, message: str, gone: bool
) -> None:
    """-32000 is CONNECTION_CLOSED to the SDK and a server error to JSON-RPC: the connection
    counts as closed only when the SDK's dispatcher says so and the error is the SDK's own."""
    from mcp import MCPError

    assert _connection_closed(_FakeClient(closed), MCPError(code=code, message=message)) is gone  # type: ignore[arg-type]


# -- lifetime and failure ------------------------------------------------------------------


async def test_closing_stops_the_server_and_later_calls_fail() -> None:
    """The server process ends with the block; a call through its tools afterwards is a
    `failed` result saying the server is closed."""
    async with _served(sys.executable, [PROBE]) as tools:
        assert len(_server_pids()) == 1
        d = _dispatcher(tools)
    assert _server_pids() == set()
    r = await _one(d, "pid", {})
    assert r.status == Status.failed and r.retryable is False
    assert "the MCP server 'probe' is closed" in r.content
    assert tools.statistics().state == "closed"


async def test_a_call_in_flight_when_the_block_ends_is_failed_as_closed() -> None:
    """A 10 s nap still running when its `open_mcp` block ends is failed, saying the server
    is closed, as soon as the block has closed."""
    results: list[Any] = []
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg, _served(sys.executable, [PROBE]) as tools:
        d = _dispatcher(tools)

        async def nap() -> None:
            results.append(await _one(d, "nap", {"seconds": 10}))

        tg.start_soon(nap)
        await anyio.sleep(0.3)
    [r] = results
    assert r.status == Status.failed and "the MCP server 'probe' is closed" in r.content
    assert time.monotonic() - t0 < 6 and _server_pids() == set()


async def test_a_killed_server_fails_its_calls_then_every_later_one(repo: Path) -> None:
    """kill -9 of the git server: the next call is failed, saying the server closed the
    connection; the one after says it is gone."""
    async with _served(*_git_server(repo), name="git") as tools:
        d = _dispatcher(tools)
        path = {"repo_path": str(repo)}
        assert (await _one(d, "git_status", path)).status == Status.ok
        [pid] = _server_pids()
        os.kill(pid, signal.SIGKILL)
        first = await _one(d, "git_log", path, session="s2")
        assert first.status == Status.failed and first.retryable is False
        assert "the MCP server 'git' closed the connection before answering git_log" in first.content
        later = await _one(d, "git_diff_unstaged", path, session="s3")
        assert later.status == Status.failed and "the MCP server 'git' is gone" in later.content
        assert tools.statistics().state == "gone"


async def test_a_server_killed_mid_call_fails_that_call_at_once() -> None:
    """A 10 s nap whose server is killed after 0.3 s is failed within a second or two."""
    async with _served(sys.executable, [PROBE]) as tools:
        [pid] = _server_pids()
        d = _dispatcher(tools)

        async def kill_soon() -> None:
            await anyio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            r = await _one(d, "nap", {"seconds": 10})
        assert r.status == Status.failed and "closed the connection before answering nap" in r.content
        assert time.monotonic() - t0 < 3


async def test_a_command_that_does_not_exist_is_a_clear_error() -> None:
    """Opening a missing command raises MCPServerError naming it."""
    expected = r"cannot start the MCP server 'no-such-mcp-server': no such command"
    with pytest.raises(MCPServerError, match=expected):
        async with _served("no-such-mcp-server"):
            pass


async def test_a_server_that_exits_at_start_is_a_clear_error(tmp_path: Path) -> None:
    """A server that dies before its handshake raises MCPServerError quoting its stderr."""
    script = "import sys; print('cannot open the repository', file=sys.stderr); sys.exit(2)"
    with pytest.raises(MCPServerError) as caught:
        async with _served(sys.executable, ["-c", script]):
            pass
    message = str(caught.value)
    assert "closed the connection before the handshake" in message
    assert "cannot open the repository" in message
    assert _server_pids() == set()


async def test_a_server_that_never_answers_is_a_clear_error() -> None:
    """A server silent past `start_timeout` raises MCPServerError saying so, and is stopped."""
    silent = "import sys; print('waiting', file=sys.stderr, flush=True); sys.stdin.read()"
    with pytest.raises(MCPServerError, match=r"no handshake within 0.5 s; its stderr ended with: waiting"):
        async with _served(sys.executable, ["-c", silent], start_timeout=0.5):
            pass
    assert _server_pids() == set()


# -- streamable HTTP -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    """The probe server on streamable HTTP at 127.0.0.1, for this module's tests."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, PROBE, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the HTTP MCP server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_streamable_http_serves_concurrent_calls(http_server: str) -> None:
    """Over streamable HTTP the tools are listed with their tags and three naps overlap on
    one session; after the block a call is failed as closed."""
    async with _served(http_server, headers={"X-Test": "1"}, prefix=True) as tools:
        assert tools.get("probe__nap").concurrent is True
        d = _dispatcher(tools)
        s = d.session("s", mode="direct")
        naps = [ToolCall(f"n{i}", "probe__nap", {"seconds": 0.3 + i / 100}) for i in range(3)]
        results = await s.dispatch(naps)
        assert [r.status for r in results] == [Status.ok] * 3
        assert tools.statistics().max_in_flight == 3
    r = await _one(d, "probe__pid", {})
    assert r.status == Status.failed and "is closed" in r.content


async def test_an_unreachable_url_is_a_clear_error() -> None:
    """A URL nobody listens on raises MCPServerError naming it."""
    url = f"http://127.0.0.1:{_free_port()}/mcp"
    with pytest.raises(MCPServerError, match="cannot start the MCP server"):
        async with _served(url, start_timeout=10):
            pass


# -- packaging -----------------------------------------------------------------------------


def test_builtin_tools_does_not_import_the_sdk() -> None:
    """`import builtin_tools` leaves the MCP SDK unimported; without the SDK, importing
    builtin_tools.mcp raises ImportError naming the extra."""
    script = textwrap.dedent(
        """
        import sys
        import builtin_tools
        assert "mcp" not in sys.modules, "builtin_tools imported mcp"
        sys.modules["mcp"] = None
        try:
            import builtin_tools.mcp
        except ImportError as exc:
            print(exc)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'threepass[mcp]'" in done.stdout
