"""Shared fakes: tools that count what they do, built through the public surface."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.lowlevel
import attrs

from dispatcher import Dispatcher, Registry, Tool, ToolCall, ToolContext

TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PATH_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


class FakeClock:
    """Seconds that move only when a test says so (`clock.now += 61`)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeSession:
    """What a ToolContext reads from its session, for calling a handler directly."""

    def __init__(self, session_id: str = "s1") -> None:
        self.id = session_id
        self.state: dict[str, Any] = {}
        self.history: list[Any] = []
        self.loaded: list[str] = []
        self.cleanups: list[Any] = []
        self.error_store: Any = None

    def load_tools(self, names: Any) -> list[str]:
        self.loaded.extend(names)
        return list(names)

    def searchable_tools(self) -> list[Tool]:
        return []

    async def invoke(self, name: str, args: Mapping[str, Any] | None = None) -> Any:
        raise RuntimeError(f"a FakeSession cannot invoke {name!r}")

    def on_close(self, fn: Any) -> None:
        self.cleanups.append(fn)


def tool_context(name: str, session: FakeSession | None = None, call_id: str = "call_1") -> ToolContext:
    """A ToolContext for calling the handler of tool `name` directly (run 1, round 1)."""
    return ToolContext(call_id, name, 1, 1, None, session or FakeSession())


def done(args: Mapping[str, Any], ctx: Any) -> str:
    """A handler for tools whose running is not the point of the test."""
    return "done"


async def swallow(args: Mapping[str, Any], ctx: Any) -> str:
    """Waits past its timeout, swallows its cancellation and returns."""
    with contextlib.suppress(BaseException):
        await anyio.sleep(10)
    return "late"


def raiser(exc: BaseException) -> Any:
    """A handler that raises `exc`."""

    async def handler(args: Mapping[str, Any], ctx: Any) -> Any:
        raise exc

    return handler


def path_schema(**extra: Any) -> dict[str, Any]:
    """An object schema with a required string `path`, plus the properties given."""
    props: dict[str, Any] = {"path": {"type": "string"}}
    props.update(extra)
    return {"type": "object", "properties": props, "required": ["path"]}


def file_at_path(args: Mapping[str, Any]) -> set[str]:
    """The resource key of the file named by `path`, as given (`file:<path>`)."""
    return {f"file:{args['path']}"}


@attrs.define
class Counter:
    """Counts executions and the most calls in flight at once."""

    runs: list[tuple[str, str]] = attrs.field(factory=list)
    in_flight: int = 0
    most: int = 0
    serial_in_flight: int = 0
    serial_overlap: bool = False

    def enter(self, name: str, key: str) -> None:
        self.runs.append((name, key))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1


def call(call_id: str, name: str, /, **args: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=json.dumps(args))


def openai_call(call_id: str, name: str, args: Mapping[str, Any] | str) -> dict[str, Any]:
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def fake_registry(counter: Counter, files: dict[str, str] | None = None) -> Registry:
    """echo (concurrent), nap (concurrent sleep), slow_serial, read/edit on an in-memory file dict."""
    files = {} if files is None else files

    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("echo", args["text"])
        await anyio.lowlevel.checkpoint()
        counter.leave()
        return str(args["text"])

    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("nap", str(args["ms"]))
        try:
            await anyio.sleep(args["ms"] / 1000)
        finally:
            counter.leave()
        return f"slept {args['ms']}"

    async def serial(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("serial", args["text"])
        counter.serial_in_flight += 1
        if counter.serial_in_flight > 1:
            counter.serial_overlap = True
        await anyio.sleep(0.01)
        counter.serial_in_flight -= 1
        counter.leave()
        return args["text"]

    async def read(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("read", args["path"])
        await anyio.lowlevel.checkpoint()
        counter.leave()
        return files.get(args["path"], "<missing>")

    async def edit(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("edit", args["path"])
        await anyio.lowlevel.checkpoint()
        files[args["path"]] = args["text"]
        counter.leave()
        return "edited"

    async def boom(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("boom", "")
        counter.leave()
        raise RuntimeError("the tool broke")

    def file_key(args: Mapping[str, Any]) -> set[str]:
        return {f"file:/w/{args['path']}"}

    return Registry(
        [
            Tool("echo", "Echo the text.", echo, TEXT_SCHEMA, concurrent=True, deferred=False),
            Tool(
                "nap",
                "Sleep ms milliseconds.",
                nap,
                {"type": "object", "properties": {"ms": {"type": "integer"}}, "required": ["ms"]},
                concurrent=True,
                deferred=False,
            ),
            Tool("serial", "Run alone.", serial, TEXT_SCHEMA, concurrent=False, deferred=False),
            Tool("read", "Read a file.", read, PATH_SCHEMA, concurrent=True, deferred=False, reads=file_key),
            Tool(
                "edit",
                "Edit a file.",
                edit,
                {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                    "required": ["path", "text"],
                },
                concurrent=False,
                deferred=False,
                writes=file_key,
            ),
            Tool("boom", "Always fails.", boom, {"type": "object"}, concurrent=True, deferred=False),
        ]
    )


def handler_dispatcher(*handlers: Any, timeout: float = 5.0) -> Dispatcher:
    """A Dispatcher of one direct tool per handler, named after it, taking no arguments,
    each with `timeout`."""
    tools = [
        Tool(fn.__name__, f"The {fn.__name__} tool.", fn, NO_ARGUMENTS, deferred=False, timeout=timeout)
        for fn in handlers
    ]
    return Dispatcher(Registry(tools))


def bare_call(name: str, n: int = 0) -> dict[str, Any]:
    """An OpenAI-style call of tool `name` with no arguments, id `call_<name>_<n>`."""
    return openai_call(f"call_{name}_{n}", name, "{}")


class NothingHook:
    """A hook that does nothing: its presence alone sends every call the general way (the
    path the fast ones must answer as)."""

    def after(self, call: Any, result: Any, ctx: Any) -> None:
        return None


def group_dispatcher(
    *handlers: Any,
    timeout: float = 5.0,
    limit: int | None = None,
    general: bool = False,
    timeouts: Mapping[str, float] | None = None,
) -> Dispatcher:
    """A Dispatcher of one concurrent direct tool per handler, named after it, each with
    `timeout` (or its own in `timeouts`); `general` sends every call the general way."""
    tools = [
        Tool(
            fn.__name__,
            f"The {fn.__name__} tool.",
            fn,
            {"type": "object"},
            deferred=False,
            concurrent=True,
            timeout=(timeouts or {}).get(fn.__name__, timeout),
        )
        for fn in handlers
    ]
    return Dispatcher(Registry(tools), max_concurrent=limit, hooks=[NothingHook()] if general else ())


def numbered_calls(*names: str, base: int = 0) -> list[ToolCall]:
    """Calls `c0`, `c1`, ... of `names`, each with arguments of its own (no two the same,
    so none is served as a repeat of another)."""
    return [ToolCall(f"c{i}", name, {"n": base + i}) for i, name in enumerate(names)]
