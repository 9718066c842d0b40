"""Attacks on three promises: no secrets at rest (recordings, the result cache, the session
store, the error store, logs), the `calculate` tool, and MCP servers as a tool source (a
hostile server written here as raw JSON-RPC over stdio, so it can say anything)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from builtin_tools import default_registry
from builtin_tools.calculate import evaluate
from builtin_tools.mcp import open_mcp
from cache import DiskErrorStore, DiskResultCache, SqliteSessionStore
from dispatcher import Allow, CachePolicy, Dispatcher, Registry, Status, Tool, ToolError
from dispatcher._types import ToolContext

SECRET = "Zq9SECRETVALUEzq9xy"
J = json.dumps


def _run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return anyio.run(fn)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _leaks(root: Path, secret: str = SECRET) -> list[str]:
    """Every file under `root` whose raw bytes hold `secret`."""
    return sorted(
        str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()
    )


def _echo(args: Any, ctx: ToolContext) -> str:
    return "echo " + J(args)


def _fail(args: Any, ctx: ToolContext) -> str:
    raise ToolError("upstream said: " + J(args), retryable=False)


def _registry(ws: Path, *, cached_echo: bool = False) -> Registry:
    reg = default_registry(ws, include=["store_secret", "chat_history", "calculate"])
    cache = CachePolicy(scope="shared") if cached_echo else None
    reg.add(
        Tool(name="echo", description="e", handler=_echo, parameters={"type": "object"}, concurrent=True,
             deferred=False, cache=cache)
    )  # fmt: skip
    reg.add(
        Tool(name="fail", description="f", handler=_fail, parameters={"type": "object"}, concurrent=True,
             deferred=False)
    )  # fmt: skip
    return reg


def _dispatch_all(
    tmp_path: Path,
    batches: Sequence[Sequence[dict[str, Any]]],
    *,
    cached_echo: bool = False,
    session_store: bool = False,
    **dispatcher_kw: Any,
) -> list[list[Any]]:
    """Dispatch `batches` in one recorded session with a disk cache and error store (and a
    SQLite session store if asked), all under `tmp_path / "rest"`; the results per batch."""
    rest = tmp_path / "rest"
    rest.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    out: list[list[Any]] = []

    async def main() -> None:
        d = Dispatcher(
            _registry(ws, cached_echo=cached_echo),
            cache=DiskResultCache(rest / "cache"),
            error_store=DiskErrorStore(rest / "errors"),
            session_store=SqliteSessionStore(rest / "sessions.sqlite") if session_store else None,
            **dispatcher_kw,
        )
        s = d.session("s", record=rest / "rec.jsonl", mode="direct")
        s.state["store_secret"] = lambda name, secret: True
        for batch in batches:
            out.append(list(await s.dispatch(list(batch))))
        s.close()

    _run(main)
    return out


# -- no secrets at rest: what holds ------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param('{"\\u0041uthorization": "' + SECRET + '"}', id="escaped-name"),
        pytest.param('{"password": "' + SECRET + '", "password": "x"}', id="duplicate-key"),
        pytest.param(J({"headers": {"authorization": "bearer " + SECRET}}), id="lowercase-bearer-echoed"),
        pytest.param(J({"headers": {"Authorization": "Basic " + SECRET}}), id="basic-echoed"),
        pytest.param(J({"url": "https://h.example/?api%5Fkey=" + SECRET}), id="percent-encoded-name"),
        pytest.param(J({"url": "https://bob:" + SECRET + "%40@h.example/"}), id="percent-userinfo"),
        pytest.param(J({"data": J({"inner": J({"client_secret": SECRET})})}), id="json-in-json-in-json"),
        pytest.param(J({"token": SECRET * 5000}), id="very-long-secret"),
        pytest.param(J({"x": [{"y": {"api_key": SECRET}}]}), id="deep"),
        pytest.param('{"api_key": "' + SECRET + '", "cut', id="cut-short"),
    ],
)
def test_the_recording_never_holds_a_credential_spelled_oddly(tmp_path: Path, arguments: str) -> None:
    """A credential however spelled, echoed back or not, is in neither the recording nor the error store."""
    _dispatch_all(tmp_path, [[_call("c1", "echo", arguments), _call("c2", "fail", arguments)]])
    rest = tmp_path / "rest"
    assert _leaks(rest / "errors") == []
    assert (rest / "rec.jsonl").exists() and SECRET.encode() not in (rest / "rec.jsonl").read_bytes()


def test_gate_supplied_credentials_are_redacted_in_the_recording(tmp_path: Path) -> None:
    """Arguments a gate's Allow supplies are recorded redacted, also where the result echoes them."""

    async def gate(call: Any, ctx: Any = None) -> Allow:
        return Allow(args={"url": f"https://bob:{SECRET}@h.example/", "headers": {"Authorization": SECRET}})

    ws = tmp_path / "ws"
    ws.mkdir()
    reg = Registry(
        [
            Tool(
                name="echo",
                description="e",
                handler=_echo,
                parameters={"type": "object"},
                confirm=True,
                deferred=False,
            )
        ]
    )

    async def main() -> list[Any]:
        d = Dispatcher(reg, gate=gate)
        s = d.session("s", record=tmp_path / "rec.jsonl")
        res = await s.dispatch([_call("c1", "echo", "{}")])
        s.close()
        return list(res)

    res = _run(main)
    assert res[0].status == Status.ok and SECRET in res[0].content
    assert SECRET.encode() not in (tmp_path / "rec.jsonl").read_bytes()


def test_a_stored_secret_is_never_recorded_nor_cached(tmp_path: Path) -> None:
    """`store_secret(secret=...)` keeps the value out of the recording, the cache and the error store."""
    _dispatch_all(tmp_path, [[_call("c1", "store_secret", J({"name": "github", "secret": SECRET}))]])
    assert _leaks(tmp_path / "rest") == []


# -- no secrets at rest: what breaks -----------------------------------------------------------


@pytest.mark.parametrize("pad", [" ", "\n"])
def test_store_secret_through_run_tool_with_padded_args_text_is_not_recorded(
    tmp_path: Path, pad: str
) -> None:
    """`run_tool(name="store_secret", args="<JSON text>")` records no secret, whitespace leading or not."""
    inner = pad + J({"name": "github", "secret": SECRET})
    (results,) = _dispatch_all(
        tmp_path, [[_call("c1", "run_tool", J({"name": "store_secret", "args": inner}))]]
    )
    assert results[0].status == Status.ok  # the call ran: the padded text was read as its arguments
    assert _leaks(tmp_path / "rest") == []


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("\n" + J({"password": SECRET}) + "\n", id="config-file-with-leading-newline"),
        pytest.param("  " + J({"api_key": SECRET}), id="json-after-spaces"),
        pytest.param(" https://bob:" + SECRET + "@h.example/", id="url-after-a-space"),
    ],
)
def test_a_text_argument_holding_json_or_a_url_after_whitespace_is_redacted(
    tmp_path: Path, value: str
) -> None:
    """A text argument holding JSON (a config file's content) or a URL is redacted, spaces first or not."""
    _dispatch_all(tmp_path, [[_call("c1", "echo", J({"content": value}))]])
    assert SECRET.encode() not in (tmp_path / "rest" / "rec.jsonl").read_bytes()


def test_a_url_with_user_info_inside_a_command_text_is_redacted(tmp_path: Path) -> None:
    """URL user info is a credential wherever the URL stands in a text, as in arguments that do not parse."""
    command = f"git clone https://bob:{SECRET}@git.example/repo.git"
    _dispatch_all(tmp_path, [[_call("c1", "echo", J({"command": command}))]])
    assert SECRET.encode() not in (tmp_path / "rest" / "rec.jsonl").read_bytes()


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(J({"name": "github", "secret": SECRET}), id="store_secret"),
        pytest.param(J({"headers": {"Authorization": "Bearer " + SECRET}}), id="authorization-header"),
        pytest.param(J({"url": f"https://bob:{SECRET}@h.example/"}), id="url-password"),
    ],
)
def test_the_sqlite_session_store_never_holds_a_credential(tmp_path: Path, arguments: str) -> None:
    """The session store's file (its history rows too) holds no credential in clear, like a recording."""
    name = "store_secret" if "secret" in json.loads(arguments) else "echo"
    _dispatch_all(tmp_path, [[_call("c1", name, arguments)]], session_store=True)
    rest = tmp_path / "rest"
    assert SECRET.encode() not in (rest / "rec.jsonl").read_bytes()  # the recording keeps the promise
    assert [f for f in _leaks(rest) if f.startswith("sessions.sqlite")] == []


def test_chat_history_does_not_carry_an_echoed_secret_into_the_recording(tmp_path: Path) -> None:
    """A secret a result echoed (redacted in its record) is not recorded in clear via a later chat_history."""
    echoing = _call("c1", "echo", J({"headers": {"Authorization": "Bearer " + SECRET}}))
    first, second = _dispatch_all(tmp_path, [[echoing], [_call("c2", "chat_history", "{}")]])
    assert SECRET in first[0].content and second[0].status == Status.ok
    assert SECRET.encode() not in (tmp_path / "rest" / "rec.jsonl").read_bytes()


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(J({"api_key": SECRET}), id="api_key"),
        pytest.param(J({"Authorization": "Bearer " + SECRET}), id="authorization"),
    ],
)
def test_the_result_cache_never_stores_a_response_that_echoes_a_credential(
    tmp_path: Path, arguments: str
) -> None:
    """A cacheable call carrying a credential (by the rule the recorder uses) stays out of the disk cache."""
    (results,) = _dispatch_all(tmp_path, [[_call("c1", "echo", arguments)]], cached_echo=True)
    rest = tmp_path / "rest"
    assert SECRET in results[0].content
    assert SECRET.encode() not in (rest / "rec.jsonl").read_bytes()  # the recorder sees the credential
    assert _leaks(rest / "cache") == []


def test_a_rewriters_malformed_output_is_logged_without_its_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rewriter that injects a credential but returns the wrong shape is logged without the credential."""

    def rewriter(event: Any, state: Any) -> dict[str, Any]:
        return {"tool_name": "echo", "args": [("api_key", SECRET)]}  # a list, not a mapping

    caplog.set_level(logging.DEBUG)
    (results,) = _dispatch_all(tmp_path, [[_call("c1", "echo", "{}")]], rewriters=[rewriter])
    assert results[0].status == Status.ok
    assert "wrong types" in caplog.text  # the rewrite was dropped, and said so
    assert SECRET not in caplog.text


# -- calculate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9",
        "2**10**10",
        "(-3)**(10**8)",
        "1e308*10",
        "floor(1e308*10)",
        "round(1e308*10)",
        "sqrt(2**4000*2**4000)",
        "exp(2**5000)",
        "floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)*floor(1e308)",
        "(2**5000*2**4000)/3",
        "1.0000001**(2**5000)",
        "round(5, 10**9)",
        "'ab'*10**9",
        "1<<10**9",
        "-" * 999 + "1",
        "(" * 300 + "1" + ")" * 300,
        "1e309-1e309",
        "(-8)**(1/3)",
    ],
)
def test_calculate_refuses_huge_work_quickly_and_clearly(expression: str) -> None:
    """What would take long, overflow or nest too deep is a non-retryable ToolError within half a second."""
    start = time.perf_counter()
    with pytest.raises(ToolError) as info:
        evaluate(expression)
    assert time.perf_counter() - start < 0.5
    assert info.value.retryable is False and info.value.message


@pytest.mark.parametrize(
    "expression",
    [
        "().__class__",
        "(1).__class__.__bases__",
        "[x for x in (1,)]",
        "(lambda: 1)()",
        "__import__('os').system('true')",
        "sqrt.__call__(4)",
        "f'{1}'",
        "(x := 1)",
        "min(*(1, 2))",
        "abs(**{})",
        "1 if 1 else 2",
        "b'1'",
        "1j",
        "...",
        "pi.real",
    ],
)
def test_calculate_runs_no_code(expression: str) -> None:
    """Attributes, imports, lambdas, comprehensions, starred and keyword tricks are refused, naming what."""
    with pytest.raises(ToolError, match=r"unsupported|not an arithmetic") as info:
        evaluate(expression)
    assert info.value.retryable is False


def _calculate_batches(tmp_path: Path, expressions: Sequence[str]) -> list[Any]:
    """The results of one batch of `calculate` calls, its schema loaded first."""

    async def main() -> list[Any]:
        s = Dispatcher(default_registry(tmp_path, include=["calculate"])).session("s")
        await s.dispatch([_call("load", "find_tools", J({"query": "select:calculate"}))])
        batch = [
            _call(f"c{i}", "run_tool", J({"name": "calculate", "args": {"expression": e}}))
            for i, e in enumerate(expressions)
        ]
        return list(await s.dispatch(batch))

    return list(_run(main))


def test_calculate_through_the_dispatcher_fails_clearly(tmp_path: Path) -> None:
    """Through the passes: too long is invalid_arguments; a refused one is failed, not retryable."""
    over, huge, fine = _calculate_batches(tmp_path, ["1+" * 600 + "1", "9**9**9", "2*(3+4)"])
    assert over.status == Status.invalid_arguments
    assert huge.status == Status.failed and json.loads(huge.content.splitlines()[0])["retryable"] is False
    assert fine.status == Status.ok and fine.content == "2*(3+4) = 14"


def test_calculate_evaluates_a_long_flat_sum(tmp_path: Path) -> None:
    """A flat sum of 499 ones (997 characters, inside the limit) is 499, not 'nested too deeply'."""
    (result,) = _calculate_batches(tmp_path, ["+".join(["1"] * 499)])
    assert result.status == Status.ok, result.content
    assert result.content.endswith(" = 499")


def test_calculate_computes_a_power_whose_result_is_within_the_limit() -> None:
    """`2 ** 6000` (6001 bits, under the 10,000-bit limit) is computed, as `2 ** 4000 * 2 ** 2000` is."""
    assert evaluate("2 ** 4000 * 2 ** 2000") == 2**6000
    assert evaluate("2 ** 6000") == 2**6000


def test_calculate_names_the_offending_character_of_a_multi_line_expression() -> None:
    """A syntax error in the second line names the character there, not one of the first line."""
    with pytest.raises(ToolError) as info:
        evaluate("(1 +\n2 +* 3)")
    assert "'*'" in info.value.message


# -- schemas a tool source may supply ------------------------------------------------------------


def _two(schema: dict[str, Any], arguments: dict[str, Any]) -> tuple[list[Any] | BaseException, float]:
    """Dispatch a call of a tool with `schema` beside a plain sibling; the results (or what
    dispatch raised) and the seconds it took."""
    reg = Registry(
        [
            Tool(name="odd", description="o", handler=_echo, parameters=schema, concurrent=True,
                 deferred=False),
            Tool(name="echo", description="e", handler=_echo, parameters={"type": "object"}, concurrent=True,
                 deferred=False),
        ]
    )  # fmt: skip

    async def main() -> list[Any]:
        s = Dispatcher(reg).session("s")
        return list(await s.dispatch([_call("c1", "odd", J(arguments)), _call("c2", "echo", "{}")]))

    start = time.perf_counter()
    try:
        got: list[Any] | BaseException = _run(main)
    except Exception as exc:
        got = exc
    return got, time.perf_counter() - start


@pytest.mark.parametrize(
    "ref",
    ["urn:nothing", "http://127.0.0.1:9/schema.json", "#/$defs/nothing"],
)
def test_an_unresolvable_ref_in_a_schema_fails_only_its_own_call(ref: str) -> None:
    """A tool whose schema's `$ref` cannot be resolved fails its own call; its sibling in the batch runs."""
    got, _ = _two({"type": "object", "properties": {"a": {"$ref": ref}}}, {"a": 1})
    assert not isinstance(got, BaseException), f"the whole batch raised: {got!r}"
    assert got[0].status in (Status.failed, Status.invalid_arguments) and got[1].status == Status.ok


@pytest.mark.xfail(
    strict=True,
    reason="known gap: a schema's `pattern` is matched by Python's re (jsonschema), which "
    "backtracks without bound; a tool's schema comes from its author or an MCP server",
)
def test_a_backtracking_pattern_in_a_schema_does_not_hold_the_batch() -> None:
    """A schema `pattern` that backtracks catastrophically does not hold pass 1 (and siblings) for seconds."""
    got, seconds = _two(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}},
        {"a": "a" * 25 + "!"},
    )
    assert not isinstance(got, BaseException)
    assert got[1].status == Status.ok
    assert seconds < 1.0, f"one call's argument check held the batch for {seconds:.1f} s"


# -- MCP servers as a tool source ---------------------------------------------------------------

HOSTILE_SERVER = r"""
import json, os, sys, threading, time
TOOLS = json.loads(sys.argv[1])
lock = threading.Lock()
def send(obj=None, raw=None):
    with lock:
        sys.stdout.write((raw if raw is not None else json.dumps(obj)) + "\n")
        sys.stdout.flush()
def text(mid, t):
    return {"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": t}]}}
def handle(msg):
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": msg["params"]["protocolVersion"],
              "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        name, args = msg["params"]["name"], msg["params"].get("arguments") or {}
        if name == "huge":
            send(text(mid, "x" * 3_000_000))
        elif name == "hugeerror":
            send({"jsonrpc": "2.0", "id": mid, "result": {"isError": True,
                  "content": [{"type": "text", "text": "F" * 2_000_000}]}})
        elif name == "wrongshape":
            send({"jsonrpc": "2.0", "id": mid, "result": {"content": "not a list"}})
        elif name == "junk":
            send(raw="this is not json {{{")
            send(text(mid, "after junk"))
        elif name == "never":
            pass
        elif name == "servererror":
            error = {"code": -32000, "message": "rate limited, try later"}
            send({"jsonrpc": "2.0", "id": mid, "error": error})
        else:
            send(text(mid, "echo " + json.dumps({"name": name, "args": args})))
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    threading.Thread(target=handle, args=(msg,), daemon=True).start()
os._exit(0)
"""


def _tool(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "inputSchema": schema or {"type": "object"}, "annotations": {"readOnlyHint": True}}


def _with_server(
    tmp_path: Path, listed: list[dict[str, Any]], body: Callable[[Any], Awaitable[Any]], **kw: Any
) -> Any:
    script = tmp_path / "hostile_mcp.py"
    script.write_text(HOSTILE_SERVER)

    async def main() -> Any:
        async with open_mcp(
            sys.executable, [str(script), J(listed)], deferred=False, errlog=sys.stderr, **kw
        ) as tools:
            return await body(tools)

    return _run(main)


def test_a_hostile_mcp_servers_bad_answers_stay_with_their_own_calls(tmp_path: Path) -> None:
    """Huge output is bounded; a wrong-shaped answer, junk line or silence stays with its own call."""
    names = ["echo", "huge", "hugeerror", "wrongshape", "junk", "never"]

    async def body(tools: Any) -> tuple[list[Any], Any]:
        s = Dispatcher(Registry(list(tools))).session("s")
        res = await s.dispatch([_call(f"c{i}", n, "{}") for i, n in enumerate(names)])
        again = await s.dispatch([_call("z", "echo", J({"after": 1}))])
        return [*res, *again], tools.statistics()

    results, stats = _with_server(tmp_path, [_tool(n) for n in names], body, call_timeout=1.5)
    by = {r.name: r for r in results[:-1]}
    assert by["echo"].status == Status.ok
    assert by["huge"].status == Status.ok and len(by["huge"].content.encode()) < 300 * 1024
    assert by["hugeerror"].status == Status.failed and len(by["hugeerror"].content.encode()) < 300 * 1024
    assert by["wrongshape"].status == Status.failed and "'hostile'" in by["wrongshape"].content
    assert by["junk"].status == Status.ok and by["junk"].content == "after junk"
    assert by["never"].status == Status.timed_out
    assert results[-1].status == Status.ok and stats.state == "open"


def test_an_mcp_servers_own_error_code_minus_32000_is_not_taken_for_a_crash(tmp_path: Path) -> None:
    """A live server's JSON-RPC error -32000 fails that call with its message; the next call still works."""

    async def body(tools: Any) -> list[Any]:
        s = Dispatcher(Registry(list(tools))).session("s")
        first = await s.dispatch([_call("c1", "servererror", "{}")])
        second = await s.dispatch([_call("c2", "echo", "{}")])
        return [first[0], second[0]]

    failed, later = _with_server(tmp_path, [_tool("servererror"), _tool("echo")], body)
    assert failed.status == Status.failed
    assert "rate limited" in failed.content, failed.content
    assert later.status == Status.ok, later.content


def test_mcp_tool_names_that_collide_once_made_safe_still_make_a_registry(tmp_path: Path) -> None:
    """Names that collide once made safe (`a b`/`a_b`, a repeat, a shared 128-char start) come out unique."""
    listed = [
        _tool("a b"),
        _tool("a_b"),
        _tool("dup"),
        _tool("dup"),
        _tool("x" * 130 + "1"),
        _tool("x" * 130 + "2"),
    ]

    async def body(tools: Any) -> list[str]:
        return [t.name for t in tools]

    names = _with_server(tmp_path, listed, body)
    assert len(names) == len(set(names)), names


def test_an_mcp_tool_schema_with_an_unresolvable_ref_fails_only_its_call(tmp_path: Path) -> None:
    """A server's tool whose input schema has an unresolvable `$ref` fails its own call; its sibling runs."""
    listed = [_tool("refd", {"type": "object", "properties": {"a": {"$ref": "urn:nothing"}}}), _tool("echo")]

    async def body(tools: Any) -> Any:
        s = Dispatcher(Registry(list(tools))).session("s")
        try:
            return list(await s.dispatch([_call("c1", "refd", '{"a": 1}'), _call("c2", "echo", "{}")]))
        except Exception as exc:
            return exc

    got = _with_server(tmp_path, listed, body)
    assert not isinstance(got, BaseException), f"the whole batch raised: {got!r}"
    assert got[0].status != Status.ok and got[1].status == Status.ok


def test_mcp_calls_after_the_block_fail_clearly_naming_the_server(tmp_path: Path) -> None:
    """Once the block ends, a call of its tool is failed, not retryable, naming the server as closed."""
    script = tmp_path / "hostile_mcp.py"
    script.write_text(HOSTILE_SERVER)

    async def main() -> Any:
        async with open_mcp(sys.executable, [str(script), J([_tool("echo")])], deferred=False) as tools:
            reg = Registry(list(tools))
        return (await Dispatcher(reg).session("s").dispatch([_call("c1", "echo", "{}")]))[0]

    result = _run(main)
    assert result.status == Status.failed and "'hostile' is closed" in result.content
    assert json.loads(result.content.splitlines()[0])["retryable"] is False
