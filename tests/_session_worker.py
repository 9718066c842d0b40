"""A worker process for tests/test_session_workers.py, and the tools both use.

    python -m tests._session_worker STORE WORKSPACE LEASE_SECONDS STEPS_JSON

runs each step (`{"calls": [...], "decisions": {id: "allow" | "deny" | {"answer": text}},
"record": path}`) as one dispatch of session "s1" through a Dispatcher whose session store
is the SQLite file STORE, and prints one JSON line per step: `{"results": [...]}` or
`{"raised": name, "seconds": s}`. Tools act on files in WORKSPACE, so the test counts what
ran in every process: `write` appends a line to its file (and with `block` waits for ever
after), `read` logs each run to `reads.log`, `ask` interrupts the batch from inside."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import trio

from cache import SqliteSessionStore
from dispatcher import (
    Allow,
    Answer,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    Interrupt,
    Registry,
    Tool,
    ToolCall,
    ToolContext,
)

SESSION = "s1"
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


async def main(store_path: str, workspace: str, lease: float, steps: list[dict[str, Any]]) -> None:
    ws = Path(workspace)
    store = SqliteSessionStore(store_path, lease_seconds=lease)
    d = Dispatcher(registry(ws), session_store=store, gate=gate)
    for step in steps:
        s = d.session(SESSION, record=step.get("record"))
        if step.get("new_run"):
            s.new_run()
        began = time.monotonic()
        try:
            results = await s.dispatch(step["calls"], decisions=decisions_of(step.get("decisions")))
        except Exception as exc:
            line: dict[str, Any] = {"raised": type(exc).__name__, "seconds": time.monotonic() - began}
        else:
            line = {"results": [r.to_json() for r in results]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4]))
