"""Error memory: signatures, the hints every failure ends with, the stores, and the tools."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import anyio
import pytest

from builtin_tools import default_registry
from cache import DiskErrorStore, MemoryErrorStore
from dispatcher import (
    Dispatcher,
    ErrorRecord,
    ErrorStore,
    Registry,
    Status,
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
)
from dispatcher._commit import commit
from dispatcher._core_tools import core_registry
from dispatcher._errors import (
    FailureNotes,
    argument_shape,
    failure_signature,
    is_credential_failure,
    normalize_error,
    note_failure,
    secret_name,
    stored_error,
)
from dispatcher._plan import DEFAULT_MAX_ARGUMENT_BYTES, PlannerState, new_planner
from dispatcher._recording import replay
from dispatcher._results import DEFAULT_MAX_OUTPUT_BYTES, failure_result

from ._http import serving
from ._network import NetworkGuard, guard_network


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


def _lines(result: ToolResult) -> list[str]:
    return result.content.split("\n")


def _head(result: ToolResult) -> dict[str, Any]:
    head = json.loads(_lines(result)[0])
    assert isinstance(head, dict)
    return head


def _failing_registry(ws: Path) -> Registry:
    """The builtin tools plus `flaky`, which fails with a number that changes every call."""
    counter = iter(range(1000, 2000))

    async def flaky(args: Mapping[str, Any], ctx: Any) -> str:
        raise ToolError(f"connection to db-{next(counter)} refused after {next(counter)} ms")

    reg = default_registry(ws)
    reg.add(
        Tool(
            name="flaky",
            description="Fails.",
            handler=flaky,
            deferred=False,
            parameters={"type": "object", "properties": {"table": {"type": "string"}}},
        )
    )
    return reg


# -- signatures, pure ----------------------------------------------------------------------


def test_a_signature_ignores_what_varies_between_occurrences() -> None:
    """Numbers, paths, ids, hex, a URL's path and query collapse; the tool, the words and an
    HTTP status do not; a signature is 16 hex digits."""
    one = failure_signature(
        "read_files", "no such file /tmp/a/1.txt (uuid 1b4e28ba-2fa1-11d2-883f-0016d3cca427)"
    )
    two = failure_signature(
        "read_files", "No such file /var/x/22.txt  (uuid 6fa459ea-ee8a-3ca4-894e-db77e160355e)"
    )
    assert one == two and len(one) == 16 and int(one, 16) >= 0
    assert failure_signature("edit_file", "no such file /tmp/a/1.txt") != failure_signature(
        "read_files", "no such file /tmp/a/1.txt"
    )
    assert (
        normalize_error("object deadbeef0042 at 0x7f3a gone after 12 tries")
        == "object <hex> at <hex> gone after # tries"
    )
    assert normalize_error("HTTP 401 Unauthorized from GET https://api.example.com/v1/x?key=abc") == (
        "http eab unauthorized from get https://api.example.com/<path>"
    )
    assert failure_signature("http_request", "HTTP 401 from GET http://h/") != failure_signature(
        "http_request", "HTTP 403 from GET http://h/"
    )
    assert normalize_error("first line 1\nsecond line") == "first line #"
    assert normalize_error("'src/a.py' is outside") == normalize_error("'../lib/b.py' is outside")


@pytest.mark.parametrize(
    ("error", "credential"),
    [
        ("HTTP 401 Unauthorized from GET http://127.0.0.1:8000/x", True),
        ("HTTP 403 Forbidden from POST https://api.example.com/", True),
        ("openai.AuthenticationError: Incorrect API key provided", True),
        ("PermissionDeniedError: project has no access", True),
        ("No API key provided", True),
        ("GITHUB_TOKEN is not set", True),
        ("the access token has expired", True),
        ("HTTP 404 Not Found from GET http://127.0.0.1:8000/x", False),
        ("No such file or directory: 'secret.txt'", False),
        ("PermissionError: [Errno 13] Permission denied: '/etc/shadow'", False),
        ("unexpected token in JSON at position 3", False),
        ("command timed out after 5 s and was killed", False),
    ],
)
def test_credential_failures_are_told_apart(error: str, credential: bool) -> None:
    """A 401/403, an auth error type, or a key or token named as missing or wrong is a
    credential failure; other failures are not."""
    assert is_credential_failure(error) is credential


def test_the_secret_name_is_the_variable_the_error_names_or_the_host() -> None:
    """store_secret's name: a variable named in the error, else the URL's host, else the tool."""
    assert secret_name("OPENAI_API_KEY is not set", {"url": "https://x.org/"}, "t") == "OPENAI_API_KEY"
    assert secret_name("HTTP 401", {"url": "https://api.github.com/user"}, "t") == "api.github.com"
    assert secret_name("HTTP 401", {}, "deploy") == "deploy"


def test_what_is_stored_is_redacted_bounded_and_shaped() -> None:
    """The stored error is the first line with the call's secrets and URL credentials
    redacted and bounded; the shape keeps keys and JSON types, never values."""
    args = {
        "url": "https://h.example/x?api_key=SECRETKEY123",
        "headers": {"Authorization": "Bearer TOKEN98765"},
    }
    error = (
        "HTTP 401 from GET https://h.example/x?api_key=SECRETKEY123 with TOKEN98765\nbody echoes TOKEN98765"
    )
    kept = stored_error(error, args)
    assert "SECRETKEY123" not in kept and "TOKEN98765" not in kept and "body" not in kept
    assert kept.startswith("HTTP 401 from GET https://h.example/x?api_key=redacted.len-12.xxh3-")
    assert len(stored_error("x" * 5000, {})) == 500
    assert argument_shape({"b": [1], "a": {"k": 1}, "n": 1.5, "i": 2, "f": False, "z": None, "s": "v"}) == (
        ("a", "object"), ("b", "array"), ("f", "boolean"), ("i", "integer"), ("n", "number"),
        ("s", "string"), ("z", "null"),
    )  # fmt: skip


def test_a_known_failure_gains_seen_and_resolution_and_ends_with_next() -> None:
    """A failure the store knows: its JSON line gains seen and resolution, hint lines follow
    it, and the next: line is last."""
    failed = failure_result("c1", "flaky", Status.failed, "db refused")
    signature = failure_signature("flaky", "db refused")
    known = ErrorRecord("flaky", signature, count=2, resolution="use the replica")
    notes = FailureNotes(remembering=True, known={signature: known}, write_error=True)
    noted, record = note_failure(failed, {"table": "t"}, notes)
    head = _head(noted)
    assert head == {**json.loads(failed.content), "seen": 3, "resolution": "use the replica"}
    assert (
        _lines(noted)[1] == f'signature: {signature} (error_history(signature="{signature}") shows its past)'
    )
    assert _lines(noted)[-1].startswith(
        f'next: once a different approach works, write_error(signature="{signature}"'
    )
    assert record is not None and record.signature == signature and record.shape == (("table", "string"),)
    assert note_failure(noted, {}, notes) == (noted, None)  # finished once: replayed ones stay as they are


def test_without_a_store_a_failure_still_ends_with_next_and_nothing_is_recorded() -> None:
    """No store: no signature line, no record, and a next: line that fits the retryable flag."""
    for retryable, word in ((True, "retry once"), (False, "a retry fails the same way")):
        failed = failure_result("c1", "t", Status.failed, "broke", retryable=retryable)
        noted, record = note_failure(failed, {}, FailureNotes())
        assert record is None and len(_lines(noted)) == 2
        assert _lines(noted)[-1].startswith(f"next: {word}")


def test_commit_returns_one_counted_record_per_signature() -> None:
    """Two failures with one signature in a batch are one record counted twice, in the
    effects; the results both end with next:."""
    reg = Registry([Tool("t", "T", lambda a, c: "x", deferred=False)])
    planner = new_planner(
        registry=reg,
        core=core_registry(),
        state=PlannerState(),
        has_cache=False,
        session_id="s",
        decisions=None,
        mode="direct",
        all_loaded=True,
        max_argument_bytes=DEFAULT_MAX_ARGUMENT_BYTES,
        max_output_bytes=DEFAULT_MAX_OUTPUT_BYTES,
    )
    calls = [{"id": f"c{i}", "name": "t", "arguments": {"n": i}} for i in range(2)]
    drafts = planner.parse([ToolCall.parse(c) for c in calls])
    planner.lookups(drafts)
    planner.resolve(drafts, {})
    plan = planner.finish(drafts)
    executed = {i: failure_result(f"c{i}", "t", Status.failed, f"lost {i}0 rows") for i in range(2)}
    effects = commit(
        plan,
        executed,
        has_cache=False,
        run_id=1,
        round=1,
        session_id="s",
        want_events=False,
        failures=FailureNotes(remembering=True),
    )
    assert [r.count for r in effects.errors] == [2]
    assert all(r is not None and r.content.split("\n")[-1].startswith("next: ") for r in effects.results)


# -- stores ----------------------------------------------------------------------------------


def _stores(tmp_path: Path) -> Iterator[ErrorStore]:
    yield MemoryErrorStore(max_records=3, clock=lambda: 100.0)
    yield DiskErrorStore(tmp_path / "errors", max_records=3, clock=lambda: 100.0)


async def test_the_stores_count_resolve_search_and_stay_bounded(tmp_path: Path) -> None:
    """Both stores count by signature, keep a resolution, search by tool, text and signature,
    and keep only the most recently seen signatures."""
    for store in _stores(tmp_path):
        assert isinstance(store, ErrorStore)
        await store.record_many([ErrorRecord("a", "s1", error="Disk Full", last_seen=10.0, first_seen=10.0)])
        await store.record_many([ErrorRecord("a", "s1", error="disk full", last_seen=20.0, first_seen=20.0)])
        found = (await store.lookup(["s1", "nope"]))["s1"]
        assert (found.count, found.first_seen, found.last_seen) == (2, 10.0, 20.0)
        assert (await store.resolve("s1", "free space")) is not None
        assert await store.resolve("nope", "x") is None
        await store.record_many(
            [ErrorRecord("b", f"s{i}", error=f"e{i}", last_seen=20.0 + i) for i in (2, 3)]
        )
        assert [r.signature for r in await store.search(text="FREE SPACE")] == ["s1"]
        assert [r.signature for r in await store.search(tool="b")] == ["s3", "s2"]
        assert [r.signature for r in await store.search(signature="s2")] == ["s2"]
        await store.record_many([ErrorRecord("c", "s4")])  # stamped by the store's clock: 100
        assert {r.signature for r in await store.search(limit=10)} == {"s2", "s3", "s4"}
        assert (await store.lookup(["s4"]))["s4"].last_seen == 100.0


def test_the_disk_store_is_private(tmp_path: Path) -> None:
    """The folder it makes is 0700 and its database files are 0600."""
    store = DiskErrorStore(tmp_path / "new" / "errors")
    store.record_many_sync([ErrorRecord("a", "s1")])
    assert stat.S_IMODE((tmp_path / "new" / "errors").stat().st_mode) == 0o700
    files = list((tmp_path / "new" / "errors").iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_processes_counting_one_signature_lose_no_count(tmp_path: Path) -> None:
    """Two processes recording the same signature at once: every occurrence is counted."""
    script = (
        "import sys\n"
        "from cache import DiskErrorStore\n"
        "from dispatcher import ErrorRecord\n"
        "store = DiskErrorStore(sys.argv[1])\n"
        "for i in range(40):\n"
        "    store.record_many_sync([ErrorRecord('t', 'shared', error='e', last_seen=1.0 + i)])\n"
    )
    DiskErrorStore(tmp_path)  # made once, so neither process races to create it
    workers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)]) for _ in range(2)]
    assert [w.wait(timeout=20) for w in workers] == [0, 0]
    assert DiskErrorStore(tmp_path).lookup_sync(["shared"])["shared"].count == 80


def test_a_disk_store_that_cannot_open_is_disabled_not_raised(tmp_path: Path) -> None:
    """A folder that is a file: the store says it is unhealthy and remembers nothing."""
    (tmp_path / "file").write_text("")
    store = DiskErrorStore(tmp_path / "file")
    assert not store.healthy
    store.record_many_sync([ErrorRecord("a", "s1")])
    assert store.lookup_sync(["s1"]) == {} and store.search_sync() == []


# -- through sessions ------------------------------------------------------------------------


async def test_a_failure_is_found_in_another_session_and_another_process(ws: Path, tmp_path: Path) -> None:
    """A failure recorded in session A is found by error_history in session B of another
    dispatcher, and in another process opening the same folder."""
    folder = tmp_path / "memory"
    a = Dispatcher(_failing_registry(ws), error_store=DiskErrorStore(folder))
    failed = await a.session("A").invoke("flaky", {"table": "users"})
    assert failed.status is Status.failed
    signature = _lines(failed)[1].split()[1]
    b = Dispatcher(_failing_registry(ws), error_store=DiskErrorStore(folder))
    history = await b.session("B").invoke("error_history", {"tool": "flaky"})
    assert f"[{signature}] flaky(table: string) seen once" in history.content
    assert "connection to db-1000 refused after 1001 ms" in history.content
    script = (
        "import sys, trio\n"
        "from builtin_tools import default_registry\n"
        "from cache import DiskErrorStore\n"
        "from dispatcher import Dispatcher\n"
        "d = Dispatcher(default_registry(sys.argv[1]), error_store=DiskErrorStore(sys.argv[2]))\n"
        "r = trio.run(d.invoke, 'error_history', {'signature': sys.argv[3]})\n"
        "print(r.content)\n"
    )
    with anyio.fail_after(20):
        done = await anyio.run_process(
            [sys.executable, "-c", script, str(ws), str(folder), signature], check=True
        )
    assert f"[{signature}] flaky(table: string) seen once" in done.stdout.decode()


async def test_a_resolution_shows_up_in_the_next_failure(ws: Path) -> None:
    """write_error's resolution reaches the next failure with that signature: seen and
    resolution in its JSON line, hint lines after it, the next: line last."""
    d = Dispatcher(_failing_registry(ws), error_store=MemoryErrorStore())
    s = d.session("s")
    first = await s.invoke("flaky", {})
    assert set(_head(first)) == {"error", "status", "retryable", "effect_uncertain"}
    signature = _lines(first)[1].split()[1]
    assert _lines(first)[-1] == (
        f'next: once a different approach works, write_error(signature="{signature}", '
        'outcome="resolved", resolution="what fixed it")'
    )
    written = await s.invoke(
        "write_error", {"signature": signature, "outcome": "resolved", "resolution": "start the db first"}
    )
    assert written.status is Status.ok and "recorded" in written.content
    again = await d.session("other").invoke("flaky", {})
    assert _head(again)["seen"] == 2 and _head(again)["resolution"] == "start the db first"
    assert _lines(again)[1:-1] == [
        f'signature: {signature} (error_history(signature="{signature}") shows its past)',
        "this failure was resolved before: try that resolution first",
    ]
    assert _lines(again)[-1].startswith("next: ")
    assert "resolution: start the db first" in (await s.invoke("error_history", {"text": "db"})).content
    unknown = await s.invoke("write_error", {"signature": "0000", "resolution": "x"})
    assert unknown.status is Status.failed and "no failure with signature '0000'" in unknown.content


async def test_a_timed_out_call_ends_with_next(ws: Path) -> None:
    """A call past its timeout gets the next: line too, and is remembered."""

    async def stuck(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(30)
        return "never"

    store = MemoryErrorStore()
    reg = Registry([Tool("stuck", "S", stuck, deferred=False, timeout=0.05)])
    result = await Dispatcher(reg, error_store=store).invoke("stuck")
    assert result.status is Status.timed_out
    assert _lines(result)[-1].startswith("next: ")
    assert [r.tool for r in await store.search()] == ["stuck"]


async def test_without_a_store_nothing_is_remembered(ws: Path) -> None:
    """No error store: failures still end with next:, and the error tools say no memory is
    configured."""
    d = Dispatcher(_failing_registry(ws))
    s = d.session("s")
    failed = await s.invoke("flaky", {})
    assert len(_lines(failed)) == 2 and _lines(failed)[-1].startswith("next: retry once")
    for name, args in (("error_history", {}), ("write_error", {"signature": "abc", "resolution": "x"})):
        said = await s.invoke(name, args)
        assert said.status is Status.ok and said.content.startswith("No error memory is configured here")


class _Auth(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        code = 403 if self.path.startswith("/forbidden") else 401
        body = f"refused {self.headers.get('Authorization')}".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def auth_server() -> Iterator[str]:
    with serving(_Auth) as host:
        yield f"http://{host}"


@pytest.fixture
def network(monkeypatch: pytest.MonkeyPatch) -> NetworkGuard:
    return guard_network(monkeypatch)


async def test_credential_failures_point_to_store_secret(
    ws: Path, tmp_path: Path, auth_server: str, network: NetworkGuard
) -> None:
    """A 401 and a 403 from a loopback server, through http_request, end with
    next: store_secret(name=...) when the session can keep secrets, else say to ask the
    user; and the Authorization value reaches no file of the error store."""
    token = "Bearer sk-live-0123456789abcdef"
    key = "QUERYSECRET42"
    folder = tmp_path / "memory"
    d = Dispatcher(default_registry(ws, allow_private_network=True), error_store=DiskErrorStore(folder))
    s = d.session("s")
    asked = await s.invoke("http_request", {"url": f"{auth_server}/private?api_key={key}"})
    assert asked.status is Status.failed
    assert _lines(asked)[-1] == (
        'next: ask the user for the credential "127.0.0.1" (no secret store is configured here), then retry'
    )
    kept: list[tuple[str, str | None]] = []
    s.state["store_secret"] = lambda name, secret: kept.append((name, secret))
    for path in ("/private", "/forbidden"):
        result = await s.invoke(
            "http_request", {"url": f"{auth_server}{path}", "headers": {"Authorization": token}}
        )
        assert result.status is Status.failed and "HTTP 40" in result.content
        assert _lines(result)[-1] == 'next: store_secret(name="127.0.0.1") to keep the credential, then retry'
    stored = b"".join(p.read_bytes() for p in folder.iterdir())
    assert b"HTTP 401 Unauthorized from GET" in stored
    assert b"0123456789abcdef" not in stored and key.encode() not in stored
    assert network.refused == []


async def test_store_secret_hands_the_value_over_and_never_records_it(ws: Path, tmp_path: Path) -> None:
    """store_secret gives the application's callable the name and the secret; the secret is
    in neither the result, the recording nor chat_history."""
    secret = "hunter2-correct-horse-battery"
    kept: list[tuple[str, str | None]] = []

    async def keep(name: str, value: str | None) -> None:
        kept.append((name, value))

    d = Dispatcher(default_registry(ws))
    recording = tmp_path / "s.jsonl"
    s = d.session("s", record=recording)
    s.state["store_secret"] = keep
    result = await s.invoke("store_secret", {"name": "GITHUB_TOKEN", "secret": secret})
    assert result.status is Status.ok and secret not in result.content
    assert kept == [("GITHUB_TOKEN", secret)]
    history = await s.invoke("chat_history", {})
    assert "GITHUB_TOKEN" in history.content and secret not in history.content
    s.close()
    assert secret not in recording.read_text()
    bare = Dispatcher(default_registry(ws))
    said = await bare.invoke("store_secret", {"name": "GITHUB_TOKEN"})
    assert said.status is Status.ok and "No secret store is configured" in said.content


async def test_a_failing_store_never_fails_a_call(ws: Path) -> None:
    """A store whose lookup and record raise: the failure still ends with next:, logged, not raised."""

    class Broken(MemoryErrorStore):
        async def lookup(self, signatures: Any) -> dict[str, ErrorRecord]:
            raise OSError("disk gone")

        async def record_many(self, records: Any) -> None:
            raise OSError("disk gone")

    result = await Dispatcher(_failing_registry(ws), error_store=Broken()).invoke("flaky", {})
    assert result.status is Status.failed and _lines(result)[-1].startswith("next: ")


async def test_a_replayed_failure_is_not_finished_twice(ws: Path, tmp_path: Path) -> None:
    """Replaying a recorded failure serves it as recorded: one next: line, no divergence."""
    recording = tmp_path / "r.jsonl"
    d = Dispatcher(_failing_registry(ws), error_store=MemoryErrorStore())
    s = d.session("s", record=recording)
    [first] = await s.dispatch([{"id": "c1", "name": "flaky", "arguments": {}}])
    s.close()
    served: list[ToolResult] = []
    again = Dispatcher(
        _failing_registry(ws), error_store=MemoryErrorStore(), on_result=lambda e: served.append(e.result)
    )
    report = await replay(recording, again)
    assert report.ok, report
    assert [r.content for r in served] == [first.content]
    assert first.content.count("\nnext: ") == 1
