"""A worker process for tests/test_session_workers.py, and the tools both use.

    python -m tests._session_worker STORE WORKSPACE LEASE_SECONDS STEPS_JSON

runs each step (`{"calls": [...], "decisions": {id: "allow" | "deny" | {"answer": text}},
"record": path, "wait_for": path}`) as one dispatch of session "s1" through a Dispatcher
whose session store is STORE: a `redis://` URL (a `RedisSessionStore` under NAMESPACE) or
the path of a SQLite file. A step with `wait_for` first waits (up to 30 s) for that file to
exist, so a test can act between steps. It prints one JSON line per step: `{"results":
[...]}` or `{"raised": name, "message": text, "seconds": s}`. Tools act on files in
WORKSPACE, so the test counts what ran in every process: `write` appends a line to its file
(and with `block` waits for ever after), `read` logs each run to `reads.log`, `ask`
interrupts the batch from inside."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import trio

from cache import RedisSessionStore, SqliteSessionStore
from dispatcher import (
    Allow,
    Answer,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    Interrupt,
    Registry,
    SessionStore,
    Tool,
    ToolCall,
    ToolContext,
)

SESSION = "s1"
NAMESPACE = "workers"
WRITE_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "text": {"type": "string"}, "block": {"type": "boolean"}},
    "required": ["path", "text"],
}
PATH_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def registry(workspace: Path) -> Registry:
    """write and gated_write (confirm) append a line; read logs that it ran; ask interrupts."""

    async def write(args: Mapping[str, Any], ctx: ToolContext) -> str:
        with (workspace / args["path"]).open("a") as f:
            f.write(f"{args['text']} by {ctx.call_id}\n")
        if args.get("block"):
            await anyio.sleep_forever()  # until the test kills this worker
        return f"wrote {args['path']}"

    async def read(args: Mapping[str, Any], ctx: ToolContext) -> str:
        with (workspace / "reads.log").open("a") as f:
            f.write(f"{ctx.call_id}\n")
        target = workspace / args["path"]
        return target.read_text() if target.exists() else ""

    async def ask(args: Mapping[str, Any], ctx: ToolContext) -> str:
        raise DispatchInterrupted([(ToolCall(ctx.call_id, "ask", dict(args)), "a question", None)])

    def file_of(args: Mapping[str, Any]) -> set[str]:
        return {f"file:{workspace / args['path']}"}

    return Registry(
        [
            Tool("write", "Append a line.", write, WRITE_SCHEMA, deferred=False, writes=file_of,
                 concurrent=True),
            Tool("gated_write", "Append, once approved.", write, WRITE_SCHEMA, deferred=False,
                 writes=file_of, confirm=True),
            Tool("read", "Read a file.", read, PATH_SCHEMA, deferred=False, reads=file_of, concurrent=True),
            Tool("ask", "Ask a human.", ask, PATH_SCHEMA, deferred=False),
        ]
    )  # fmt: skip


def gate(call: ToolCall, ctx: ToolContext) -> Interrupt:
    """Every call that needs confirmation waits for a human."""
    return Interrupt("approve?", {"call": call.id})


def decisions_of(raw: Mapping[str, Any] | None) -> dict[str, Allow | Deny | Answer]:
    out: dict[str, Allow | Deny | Answer] = {}
    for call_id, value in (raw or {}).items():
        if value == "allow":
            out[call_id] = Allow()
        elif value == "deny":
            out[call_id] = Deny("no")
        else:
            out[call_id] = Answer(value["answer"])
    return out


def wait_for(path: Path, timeout: float = 30) -> None:
    """Until `path` exists (or `timeout` seconds passed: the test's own asserts then fail)."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def open_store(where: str, lease: float) -> SessionStore:
    """The session store at `where`: a Redis URL or a SQLite file's path."""
    if where.startswith("redis://"):
        return RedisSessionStore(where, namespace=NAMESPACE, lease_seconds=lease)
    return SqliteSessionStore(where, lease_seconds=lease)


async def main(store_at: str, workspace: str, lease: float, steps: list[dict[str, Any]]) -> None:
    ws = Path(workspace)
    d = Dispatcher(registry(ws), session_store=open_store(store_at, lease), gate=gate)
    for step in steps:
        if step.get("wait_for"):
            await anyio.to_thread.run_sync(wait_for, Path(step["wait_for"]))
        s = d.session(SESSION, record=step.get("record"))
        if step.get("new_run"):
            s.new_run()
        began = time.monotonic()
        try:
            results = await s.dispatch(step["calls"], decisions=decisions_of(step.get("decisions")))
        except Exception as exc:
            line: dict[str, Any] = {
                "raised": type(exc).__name__,
                "message": str(exc),
                "seconds": time.monotonic() - began,
            }
        else:
            line = {"results": [r.to_json() for r in results]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4]))
