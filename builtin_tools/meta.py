"""The always-loaded tools that serve the conversation itself: `write_todo`,
`chat_history`, `reasoning_guide`, `ask_user`, `write_result`, and the error memory's
`error_history`, `write_error` and `store_secret`.

They keep their state in the session (`ctx.state`): the todo list under "todo", the
final result under "result". `ask_user` asks through a callable the application puts
in `ctx.state["ask_user"]`; without one it interrupts the dispatch (a question
nobody can hear is run control, not a failure), and the application resumes the batch
with `dispatch(calls, decisions={call_id: Answer(text)})`. `error_history` and
`write_error` reach the dispatcher's error store through `ctx.errors` (without one they
say no memory is configured); `store_secret` hands a secret to the application's
`ctx.state["store_secret"]` and never shows it (its argument is named `secret`, which the
credential rule redacts in recordings; `chat_history` shows arguments redacted too).
These handlers touch session state, which belongs to the event loop's thread, so they
are async even where they never await.
Nothing from the dispatcher's passes may be imported here.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Mapping
from typing import Any

import anyio.to_thread

from dispatcher._credentials import redact_arguments
from dispatcher._errors import MAX_RESOLUTION_CHARS, SECRET_STORE_KEY
from dispatcher._exceptions import DispatchInterrupted, ToolError
from dispatcher._registry import Tool
from dispatcher._seams import ErrorRecord
from dispatcher._types import ToolCall, ToolContext

from ._workspace import Workspace

__all__ = [
    "ASK_USER_KEY",
    "ASK_USER_TIMEOUT",
    "CORE_TOOL_NAMES",
    "MetaTools",
    "SECRET_STORE_KEY",
    "meta_tools",
    "render_todo",
]

CORE_TOOL_NAMES = (
    "reasoning_guide", "write_todo", "chat_history", "ask_user", "write_result",
    "error_history", "write_error", "store_secret",
)  # fmt: skip
ASK_USER_KEY = "ask_user"
"""`ctx.state[ASK_USER_KEY]`: `fn(question) -> str` or `fn(question, options) -> str`,
sync (run in a worker thread, so it may block on a terminal) or async."""

ASK_USER_TIMEOUT = 24 * 3600.0
"""A person answers at their own pace: far past the dispatcher's default call timeout."""

_STATUS_MARK = {"done": "[x]", "in_progress": "[>]", "pending": "[ ]"}

REASONING_GUIDE = """\
How to work with the tools here:

1. Most tools are listed only by name. Before the first use of one, load its schema:
   find_tools(query="select:read_files,edit_file") for named tools, or
   find_tools(query="words about the task") to discover them.
2. Call a loaded tool as run_tool(name="read_files", args={...}). A call made before
   the schema was loaded returns the schema instead of running: re-issue it as given.
3. Batch independent calls into one message: reads, fetches and searches run side by
   side. Calls that change things (edit_file, run_command, ...) run one at a time, in
   the order you wrote them, and a read after a write in the same message sees it.
4. A repeated identical read in the same turn returns the earlier result at no cost;
   a write to what it read makes the next read run again.
5. Read a file before editing it, and quote old_string exactly. restore_file undoes
   the last change made through the file tools.
6. Keep a plan with write_todo for work of more than a few steps; mark one item
   in_progress at a time and done as soon as it is.
7. When something is unclear only the user can settle, ask_user. Finish with
   write_result once the task is complete.
8. A failed call says whether a retry can help ("retryable") and ends with a "next:"
   line: follow it rather than repeating the same call. Failures are remembered across
   conversations: error_history shows them, and once a different approach works,
   write_error(signature=..., outcome="resolved", resolution=...) tells the next one.
"""

_NO_MEMORY = "No error memory is configured here: failures are not remembered across conversations."


def meta_tools(workspace: Workspace) -> list[Tool]:
    """The conversation tools; `write_result` writes files into `workspace`."""
    return MetaTools(workspace).tools()


class MetaTools:
    """The conversation tools' handlers, bound to one workspace (for `write_result`)."""

    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace

    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="reasoning_guide",
                description="A short guide to using the tools here well: loading, batching, undo.",
                handler=self.reasoning_guide,
                parameters={"type": "object", "properties": {}, "additionalProperties": False},
                concurrent=True,
                deferred=False,
            ),
            Tool(
                name="write_todo",
                description=(
                    "Replace the task list with `todos` (each with content and status: "
                    "pending, in_progress or done) and show it."
                ),
                handler=self.write_todo,
                parameters=_WRITE_TODO_SCHEMA,
                concurrent=True,
                deferred=False,
                # It changes the session's list, so an identical call later in the run
                # must run again rather than be answered from the earlier one.
                writes=_writes_state("todo"),
            ),
            Tool(
                name="chat_history",
                description=(
                    "Show the most recent tool calls of this conversation (optionally of one "
                    "tool): name, status, arguments and the start of the result."
                ),
                handler=self.chat_history,
                parameters=_CHAT_HISTORY_SCHEMA,
                concurrent=True,
                deferred=False,
                # What it reads (the history) grows with every call and no resource key
                # names it: declaring a write of its own view keeps it from being deduped.
                writes=_writes_state("chat_history"),
            ),
            Tool(
                name="ask_user",
                description=(
                    "Ask the user a question and wait for the answer; `options` suggests "
                    "choices. Use it only for what the user alone can decide."
                ),
                handler=self.ask_user,
                parameters=_ASK_USER_SCHEMA,
                deferred=False,
                timeout=ASK_USER_TIMEOUT,
            ),
            Tool(
                name="write_result",
                description=(
                    "Record the final result of the task (and, with `path`, also write it to "
                    "that file in the workspace)."
                ),
                handler=self.write_result,
                parameters=_WRITE_RESULT_SCHEMA,
                deferred=False,
                writes=self.write_result_writes,
            ),
            Tool(
                name="error_history",
                description=(
                    "Failures remembered across conversations, most recent first: tool, signature, "
                    "arguments' shape, when and how often, and the resolution written for each. "
                    "Filter by `tool`, `text` or `signature`."
                ),
                handler=self.error_history,
                parameters=_ERROR_HISTORY_SCHEMA,
                concurrent=True,
                deferred=False,
                # It reads what write_error writes (so a write earlier in the batch comes first),
                # and what it reads changes with every failure: never deduped.
                reads=_writes_state("errors"),
                writes=_writes_state("error_history"),
            ),
            Tool(
                name="write_error",
                description=(
                    "Record what fixed a failure, by the signature its result named: "
                    'write_error(signature="...", outcome="resolved", resolution="what worked"). '
                    'The next time it fails, anywhere, the failure shows the fix. outcome="unresolved" '
                    "clears a resolution that turned out wrong."
                ),
                handler=self.write_error,
                parameters=_WRITE_ERROR_SCHEMA,
                concurrent=True,
                deferred=False,
                writes=_writes_state("errors"),
            ),
            Tool(
                name="store_secret",
                description=(
                    "Keep a credential (API key, token, password) in the application's secret store "
                    "under `name`. Give `secret` only if the user gave it to you; without it the "
                    "application asks the user. The value is never shown or recorded."
                ),
                handler=self.store_secret,
                parameters=_STORE_SECRET_SCHEMA,
                deferred=False,
                timeout=ASK_USER_TIMEOUT,
                writes=_writes_state("secrets"),
            ),
        ]

    def write_result_writes(self, args: Mapping[str, Any]) -> set[str]:
        path = args.get("path")
        keys = {"state:result"}
        if path is not None:
            keys.add(self.ws.key(path) if isinstance(path, str) and path.strip() else "file:/")
        return keys

    # -- handlers -----------------------------------------------------------------

    async def reasoning_guide(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        return REASONING_GUIDE

    async def write_todo(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        todos = [{"content": str(t["content"]), "status": str(t["status"])} for t in args["todos"]]
        for item in todos:
            if item["status"] not in _STATUS_MARK:
                raise ToolError(
                    f"a todo status is pending, in_progress or done, got {item['status']!r}",
                    retryable=False,
                )
        ctx.state["todo"] = todos
        return render_todo(todos)

    async def chat_history(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        limit = int(args.get("limit") or 20)
        tool = args.get("tool")
        entries = list(ctx.history)
        if tool:
            entries = [e for e in entries if e.name == tool]
        if not entries:
            return f"no calls of {tool!r} yet" if tool else "no tool calls yet"
        recent = entries[-limit:]
        lines = [f"{len(recent)} of {len(entries)} call(s), oldest first:"]
        for e in recent:
            flags = "".join(f", {flag}" for flag, on in (("cached", e.cached), ("deduped", e.deduped)) if on)
            status = getattr(e.status, "value", e.status)
            lines.append(
                f"[run {e.run_id} round {e.round} #{e.index}] {e.name}({_short_args(e.args)}) "
                f"-> {status}{flags}: {_short(e.content, 160)}"
            )
        return "\n".join(lines)

    async def ask_user(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        question: str = args["question"]
        options = list(args.get("options") or [])
        ask = ctx.state.get(ASK_USER_KEY)
        if not callable(ask):
            call = ToolCall(id=ctx.call_id, name="ask_user", arguments=dict(args))
            raise DispatchInterrupted([(call, "ask_user", {"question": question, "options": options})])
        call_args: tuple[Any, ...] = (question, options) if _takes_two(ask) else (question,)
        if _is_async(ask):
            answer = await ask(*call_args)
        else:
            # Abandoned on cancellation: a thread blocked on a terminal cannot be interrupted.
            answer = await anyio.to_thread.run_sync(lambda: ask(*call_args), abandon_on_cancel=True)
            if inspect.isawaitable(answer):  # a sync wrapper around a coroutine function
                answer = await answer
        return _answer_text(answer)

    async def error_history(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        store = ctx.errors
        if store is None:
            return _NO_MEMORY
        limit = int(args.get("limit") or 20)
        records = await store.search(
            tool=args.get("tool") or None,
            text=args.get("text") or None,
            signature=args.get("signature") or None,
            limit=limit,
        )
        if not records:
            return "no remembered failures match"
        lines = [f"{len(records)} remembered failure(s), most recent first:"]
        lines += [_render_error(r) for r in records]
        return "\n".join(lines)

    async def write_error(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        store = ctx.errors
        if store is None:
            return _NO_MEMORY + " Nothing was written."
        signature = str(args["signature"]).strip()
        outcome = args.get("outcome") or "resolved"
        resolution = args.get("resolution")
        if outcome == "resolved":
            if not isinstance(resolution, str) or not resolution.strip():
                raise ToolError('outcome="resolved" needs `resolution`: say what fixed it', retryable=False)
            resolution = resolution.strip()[:MAX_RESOLUTION_CHARS]
        else:
            resolution = None
        record = await store.resolve(signature, resolution)
        if record is None:
            raise ToolError(
                f"no failure with signature {signature!r} is remembered; error_history lists them",
                retryable=False,
            )
        if resolution is None:
            return f"resolution of {signature} ({record.tool}) cleared"
        return f"resolution of {signature} ({record.tool}) recorded: the next failure like it shows it"

    async def store_secret(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        name = str(args["name"]).strip()
        secret = args.get("secret")
        keep = ctx.state.get(SECRET_STORE_KEY)
        if not callable(keep):
            return (
                f"No secret store is configured here, so {name!r} was not stored: ask the user "
                "(ask_user) to provide that credential to the application, then retry."
            )
        if _is_async(keep):
            kept = await keep(name, secret)
        else:
            # Abandoned on cancellation: the application may be asking the user on a terminal.
            kept = await anyio.to_thread.run_sync(lambda: keep(name, secret), abandon_on_cancel=True)
            if inspect.isawaitable(kept):
                kept = await kept
        if kept is False:
            raise ToolError(f"the secret store did not keep {name!r}", retryable=False)
        return f"secret {name!r} stored; retry what needed it"

    async def write_result(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        content: str = args["content"]
        path = args.get("path")
        if path is None:
            ctx.state["result"] = content
            return f"result recorded ({len(content)} characters)"
        target = self.ws.resolve(path)
        session_id = ctx.session_id
        change = await anyio.to_thread.run_sync(
            lambda: self.ws.write(
                target,
                content.encode("utf-8"),
                action="write",
                session_id=None if session_id is None else str(session_id),
                call_id=ctx.call_id,
            )
        )
        ctx.state["result"] = content
        return f"result recorded ({len(content)} characters) and written to {change.path}"


def render_todo(todos: list[dict[str, str]]) -> str:
    """The todo list as the model sees it."""
    if not todos:
        return "Todo list is empty."
    counts = {s: sum(1 for t in todos if t["status"] == s) for s in _STATUS_MARK}
    head = f"Todo ({counts['done']} done, {counts['in_progress']} in progress, {counts['pending']} pending):"
    return "\n".join([head, *(f"{_STATUS_MARK[t['status']]} {t['content']}" for t in todos)])


def _writes_state(name: str) -> Any:
    def writes(args: Mapping[str, Any]) -> set[str]:
        return {f"state:{name}"}

    return writes


def _short(text: object, limit: int) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _short_args(args: Mapping[str, Any]) -> str:
    try:
        encoded = json.dumps(redact_arguments(args), ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        encoded = repr(args)
    return _short(encoded, 120)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def _render_error(record: ErrorRecord) -> str:
    shape = ", ".join(f"{key}: {kind}" for key, kind in record.shape)
    times = "once" if record.count == 1 else f"{record.count} times"
    line = (
        f"[{record.signature}] {record.tool}({shape}) seen {times}, first {_when(record.first_seen)}, "
        f"last {_when(record.last_seen)}: {record.error}"
    )
    if record.resolution:
        line += f"\n    resolution: {record.resolution}"
    return line


def _answer_text(answer: object) -> str:
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        return "The user gave no answer."
    return str(answer)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def _takes_two(fn: Any) -> bool:
    """Whether `fn` accepts (question, options) rather than (question) alone."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    positional = [
        p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
        return True
    return len(positional) >= 2


# -- schemas -----------------------------------------------------------------------

_WRITE_TODO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "todos": {
            "type": "array",
            "maxItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "content": {"type": "string", "minLength": 1},
                    "status": {"type": "string", "enum": ["pending", "in_progress", "done"]},
                },
                "required": ["content", "status"],
                "additionalProperties": False,
            },
            "description": "The whole list, in order; it replaces the previous one.",
        },
    },
    "required": ["todos"],
    "additionalProperties": False,
}

_CHAT_HISTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "limit": {"type": "integer", "minimum": 1, "maximum": 200, "default": 20},
        "tool": {"type": "string", "description": "Only calls of this tool."},
    },
    "additionalProperties": False,
}

_ASK_USER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "question": {"type": "string", "minLength": 1},
        "options": {
            "type": "array",
            "items": {"type": "string"},
            "maxItems": 20,
            "description": "Suggested answers; the user may still answer freely.",
        },
    },
    "required": ["question"],
    "additionalProperties": False,
}

_ERROR_HISTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool": {"type": "string", "description": "Only failures of this tool."},
        "text": {"type": "string", "description": "Only failures whose error or resolution says this."},
        "signature": {"type": "string", "description": "Only the failure with this signature."},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    },
    "additionalProperties": False,
}

_WRITE_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "signature": {"type": "string", "minLength": 1, "description": "As the failure named it."},
        "outcome": {"type": "string", "enum": ["resolved", "unresolved"], "default": "resolved"},
        "resolution": {
            "type": "string",
            "maxLength": MAX_RESOLUTION_CHARS,
            "description": "What fixed it, for whoever meets it next. Never a secret.",
        },
    },
    "required": ["signature"],
    "additionalProperties": False,
}

_STORE_SECRET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "minLength": 1,
            "maxLength": 200,
            "description": "What the credential is for, as the failure's next: line named it.",
        },
        "secret": {
            "type": "string",
            "description": "The value, only if the user gave it to you; omit it to have the user asked.",
        },
    },
    "required": ["name"],
    "additionalProperties": False,
}

_WRITE_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "content": {"type": "string", "description": "The final result."},
        "path": {
            "type": "string",
            "minLength": 1,
            "description": "Also write it to this file, relative to the workspace.",
        },
    },
    "required": ["content"],
    "additionalProperties": False,
}
