"""The kernel on any host loop: a dispatch under `asyncio.run` with asyncio-only tools, a
Dispatcher bound to its loop, and passes 1 and 3 free of I/O."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import dispatcher
from dispatcher import (
    Allow,
    Dispatcher,
    DispatchInterrupted,
    Interrupt,
    Registry,
    Status,
    Tool,
    ToolCall,
)

REPO = Path(dispatcher.__file__).resolve().parents[1]


def _asyncio_registry(log: list[str]) -> Registry:
    """Tools that only work on asyncio: asyncio.sleep, an asyncio.Event, asyncio's streams."""
    opened = asyncio.Event

    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        log.append(f"start {args['n']}")
        await asyncio.sleep(0.05)
        log.append(f"end {args['n']}")
        return f"napped {args['n']}"

    async def wait_for_flag(args: Mapping[str, Any], ctx: Any) -> str:
        flag = ctx.state.setdefault("flag", opened())
        await asyncio.wait_for(flag.wait(), timeout=5)
        return "flag seen"

    async def set_flag(args: Mapping[str, Any], ctx: Any) -> str:
        ctx.state.setdefault("flag", opened()).set()
        return "flag set"

    async def echo_over_tcp(args: Mapping[str, Any], ctx: Any) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readline())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(args["text"].encode() + b"\n")
        await writer.drain()
        line = await reader.readline()
        writer.close()
        server.close()
        await server.wait_closed()
        return line.decode().strip()

    async def forever(args: Mapping[str, Any], ctx: Any) -> str:
        await asyncio.sleep(3600)
        return "never"

    async def ask(args: Mapping[str, Any], ctx: Any) -> str:
        return "asked"

    def tool(name: str, handler: Any, concurrent: bool = True, **kw: Any) -> Tool:
        return Tool(
            name=name,
            description=name,
            handler=handler,
            parameters={
                "type": "object",
                "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
            },
            concurrent=concurrent,
            deferred=False,
            **kw,
        )

    return Registry(
        [
            tool("nap", nap),
            tool("wait_for_flag", wait_for_flag),
            tool("set_flag", set_flag),
            tool("echo_over_tcp", echo_over_tcp),
            tool("forever", forever, timeout=0.2),
            tool("serial_nap", nap, concurrent=False),
            tool("ask", ask, confirm=True),
        ]
    )


def test_a_dispatch_under_asyncio_run_keeps_every_promise() -> None:
    """Under `asyncio.run`, with tools that use asyncio itself: the limit holds, a serial call
    waits for the group before it, a call past its timeout is timed_out, a gate's Interrupt
    raises and resumes, cancellation stops the batch, and every result is in call order."""
    log: list[str] = []

    async def main() -> None:
        d = Dispatcher(_asyncio_registry(log), max_concurrent=2, gate=lambda call, ctx: Interrupt("ask me"))
        s = d.session("s", mode="direct")
        calls = [ToolCall(f"n{i}", "nap", {"n": i}) for i in range(4)]
        calls += [
            ToolCall("serial", "serial_nap", {"n": 9}),
            ToolCall("tcp", "echo_over_tcp", {"text": "hi"}),
        ]
        calls += [ToolCall("w", "wait_for_flag", {}), ToolCall("f", "set_flag", {})]
        calls += [ToolCall("t", "forever", {})]
        started = time.monotonic()
        results = await s.dispatch(calls)
        assert [r.call_id for r in results] == [c.id for c in calls]
        assert [r.content for r in results[:4]] == [f"napped {i}" for i in range(4)]
        # the limit of 2: never more than two naps started before one ended
        running = most = 0
        for entry in log:
            running += 1 if entry.startswith("start") else -1
            most = max(most, running)
        assert most == 2
        # the serial call starts after the group before it ended
        assert log.index("start 9") > max(log.index(f"end {i}") for i in range(4))
        assert results[5].content == "hi"
        assert results[6].content == "flag seen" and results[7].content == "flag set"
        assert results[8].status is Status.timed_out
        assert time.monotonic() - started < 5

        with pytest.raises(DispatchInterrupted) as caught:
            await s.dispatch([ToolCall("g", "ask", {})])
        assert [call.id for call, _, _ in caught.value.pending] == ["g"]
        [resumed] = await s.dispatch([ToolCall("g", "ask", {})], decisions={"g": Allow()})
        assert resumed.status is Status.ok and resumed.content == "asked"

        task = asyncio.ensure_future(s.dispatch([ToolCall("long", "serial_nap", {"n": 1})]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        [after] = await s.dispatch([ToolCall("again", "nap", {"n": 2})])
        assert after.ok  # the session is usable after a cancelled batch

    asyncio.run(main())


def test_a_dispatcher_used_from_a_second_loop_says_so() -> None:
    """A Dispatcher first used on one loop raises a RuntimeError naming the fix when another
    loop, in another thread, dispatches through it: it never hangs."""
    d = Dispatcher(_asyncio_registry([]))
    call = [ToolCall("1", "set_flag", {})]

    async def first() -> None:
        await d.session("a").dispatch(call)

    asyncio.run(first())
    failures: list[BaseException] = []

    def second() -> None:
        async def go() -> None:
            await d.session("b").dispatch(call)

        try:
            asyncio.run(go())
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=second)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], RuntimeError)
    assert "one Dispatcher per event loop" in str(failures[0])


# -- passes that do no I/O --------------------------------------------------------------

_IO_MODULES = {"trio", "anyio", "asyncio", "sniffio", "diskcache", "sqlite3", "os", "pathlib", "io", "shutil",
               "tempfile", "socket", "threading", "time"}  # fmt: skip


def _imports_of(module: str, seen: set[str]) -> set[str]:
    """Every top-level module `dispatcher.<module>` imports, following the kernel's own modules."""
    if module in seen:
        return set()
    seen.add(module)
    tree = ast.parse((REPO / "dispatcher" / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is not None:  # from ._x import ...
                found |= _imports_of(node.module, seen)
            elif node.level == 1:
                found |= {_ for alias in node.names for _ in _imports_of(alias.name, seen)}
            elif node.module is not None:
                found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            found.add("open()")
    return found


@pytest.mark.parametrize("module", ["_plan", "_commit"])
def test_the_pure_passes_import_no_io(module: str) -> None:
    """Pass 1 and pass 3, with everything of the kernel they import, touch no event loop,
    store, disk, clock or thread: no trio, anyio, asyncio, diskcache, os, pathlib, open()."""
    used = _imports_of(module, set())
    assert used & (_IO_MODULES | {"open()"}) == set()


# -- the import graph ---------------------------------------------------------------------

_ALLOWED_ABOVE = {
    "dispatcher": set(),
    "cache": {"dispatcher"},
    "builtin_tools": {"dispatcher"},
    "threepass": {"dispatcher", "builtin_tools", "cache"},
}
_OURS = {"dispatcher", "cache", "builtin_tools", "threepass", "bench", "tests"}


@pytest.mark.parametrize("package", sorted(_ALLOWED_ABOVE))
def test_dependencies_point_down(package: str) -> None:
    """Each package imports only the ones below it: the kernel nothing of ours, the stores and
    tools only the kernel, the app the three; none imports bench or tests."""
    folder = REPO / package
    if not folder.is_dir():
        pytest.skip(f"{package}/ is not in this checkout")
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in _OURS and top != package:
                    assert top in _ALLOWED_ABOVE[package], f"{path.relative_to(REPO)} imports {name}"


def test_a_users_own_cache_module_does_not_break_the_kernel(tmp_path: Path) -> None:
    """`import dispatcher` and a call through a Dispatcher with no store work even when the
    user's project has its own `cache.py` first on sys.path."""
    (tmp_path / "cache.py").write_text("raise ImportError('this is the user\\'s own cache module')\n")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(tmp_path)!r}, {str(REPO)!r}]
        import trio
        from dispatcher import Dispatcher, Registry, Tool, ToolCall

        def echo(args, ctx):
            return args["text"]

        reg = Registry([Tool("echo", "Echo.", echo, {{"type": "object"}}, deferred=False)])

        async def main():
            [r] = await Dispatcher(reg).session("s").dispatch([ToolCall("1", "echo", {{"text": "hi"}})])
            print(r.status.value, r.content)

        trio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok hi"
