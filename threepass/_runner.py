"""Drives a transcript through one session and tells a view what happens, as it happens.

A transcript is chat messages: each assistant message's tool calls are one batch, a user
message starts a new run, and the last assistant message with text and no calls is the
answer. The gate and `ask_user` ask the person at the terminal through the view (in a
worker thread, abandoned on cancellation, so Ctrl-C never waits for Enter), or take the
answers given on the command line. Cancellation of the caller's scope cuts the batch that
is running: what finished is committed and recorded, and `finish_cut` marks the rest of
that batch's record cancelled so that the recording still replays.

Nothing here writes to a terminal: that is the view's (threepass/_view.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio.to_thread
import attrs

from dispatcher import (
    Allow,
    BatchEvent,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    HookBlocked,
    Session,
    Status,
    ToolCall,
    ToolContext,
    ToolError,
    ToolResult,
)
from dispatcher._recording import _record as read_record

__all__ = [
    "CUT_CONTENT",
    "Answers",
    "CallRow",
    "Outcome",
    "ResultRow",
    "TranscriptRun",
    "View",
    "final_answer",
    "mark_cut_batch",
    "read_messages",
    "served_by",
    "tool_calls_of",
]

CUT_CONTENT = (
    json.dumps(
        {
            "error": "cancelled: the run was interrupted before this call finished",
            "status": "failed",
            "retryable": True,
            "effect_uncertain": True,
        }
    )
    + "\nnext: check what the call may have done before you run it again"
)
"""The result recorded for a call a Ctrl-C cut off: it may have had an effect. It ends with
its `next:` line, as every failure does, so replay serves it as recorded."""

_STRICT_OK = frozenset({Status.ok.value, Status.schema_required.value})


def read_messages(path: Path) -> list[dict[str, Any]]:
    """The messages of a transcript: one JSON object a line, or one JSON array."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            raise ValueError(f"{path}: expected a JSON array of message objects")
        return data
    messages = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not a JSON message: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"{path}:{number}: a message must be a JSON object")
        messages.append(value)
    return messages


def tool_calls_of(message: Mapping[str, Any]) -> list[Any]:
    """The tool calls of an assistant message, in either provider's shape."""
    calls = list(message.get("tool_calls") or [])
    content = message.get("content")
    if isinstance(content, list):
        calls += [b for b in content if isinstance(b, Mapping) and b.get("type") == "tool_use"]
    return calls


def _text_of(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(b.get("text", "")) for b in content if isinstance(b, Mapping) and b.get("type") == "text"
        )
    return ""


def final_answer(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The transcript's last assistant text that asks for no tool."""
    for message in reversed(messages):
        if message.get("role") == "assistant" and not tool_calls_of(message):
            text = _text_of(message).strip()
            if text:
                return text
    return None


@attrs.frozen
class CallRow:
    """A call as the transcript has it, for display before it is decided: `run_tool`
    unwrapped to the tool it names."""

    call_id: str
    name: str
    arguments: Mapping[str, Any]

    @classmethod
    def of(cls, raw: Any) -> CallRow:
        if not isinstance(raw, Mapping):
            return cls("?", "?", {})
        function = raw.get("function")
        if isinstance(function, Mapping):
            name, args = function.get("name"), function.get("arguments")
        else:
            name, args = raw.get("name"), raw.get("input", raw.get("arguments"))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"<unparseable>": args}
        if not isinstance(args, Mapping):
            args = {}
        if name == "run_tool" and isinstance(args.get("name"), str):
            inner = args.get("args")
            name, args = args["name"], inner if isinstance(inner, Mapping) else {}
        return cls(str(raw.get("id", "?")), str(name), args)


@attrs.frozen
class ResultRow:
    """One call of a finished (or cut) batch: its result, or None when it was cancelled."""

    index: int
    call_id: str
    name: str
    arguments: Mapping[str, Any]
    result: ToolResult | None
    served: str  # ran, deduped, cached, denied, decided (settled in pass 1), cancelled
    note: str = ""

    @property
    def status(self) -> str:
        return "cancelled" if self.result is None else self.result.status.value


def served_by(index: int, result: ToolResult | None, event: BatchEvent | None) -> str:
    """How a call was served: ran, deduped, cached, denied, decided or cancelled."""
    if result is None:
        return "cancelled"
    if result.cached:
        return "cached"
    if result.deduped:
        return "deduped"
    if result.status is Status.denied:
        return "denied"
    if event is None:
        return "decided" if result.started is None else "ran"
    return "ran" if index in event.ran else "decided"


class View(Protocol):
    """What the run tells its audience. `confirm` and `ask` block on a person and are
    called in a worker thread; everything else is quick."""

    def user(self, text: str) -> None: ...
    def batch_started(self, number: int, calls: Sequence[CallRow]) -> None: ...
    def call_started(self, call_id: str) -> None: ...
    def call_finished(self, call_id: str, result: ToolResult) -> None: ...
    def note(self, call_id: str, text: str) -> None: ...
    def batch_ended(self, number: int, rows: Sequence[ResultRow], event: BatchEvent | None) -> None: ...
    def confirm(self, call: ToolCall) -> bool: ...
    def ask(self, question: str, options: Sequence[str]) -> str: ...


@attrs.define
class Answers:
    """Who decides what the model asks for: the approvals of a script (by call id), a
    blanket --yes/--no, the --answer texts in order, and whether a person is there."""

    approve: frozenset[str] = frozenset()
    assume: bool | None = None
    texts: list[str] = attrs.Factory(list)
    interactive: bool = False
    source: str = "--answer"  # who gave the texts, as the notes beside the calls say
    approver: str = "the script"  # who gave the approvals


@attrs.define
class Outcome:
    """What a run did, for the summary and the exit code."""

    batches: int = 0
    calls: int = 0
    statuses: Counter[str] = attrs.Factory(Counter)
    served: Counter[str] = attrs.Factory(Counter)
    events: list[tuple[int, BatchEvent, list[ResultRow]]] = attrs.Factory(list)
    cut: int | None = None  # the batch a cancellation cut short
    cut_rows: list[ResultRow] = attrs.Factory(list)
    answer: str | None = None
    recording_problem: str | None = None

    @property
    def strict_failures(self) -> int:
        """Calls that failed or were refused (schema fetches are part of the protocol)."""
        return sum(n for status, n in self.statuses.items() if status not in _STRICT_OK)


class _Hooks:
    """Tells the view when each call starts and finishes (pass 2, as it happens)."""

    def __init__(self, view: View) -> None:
        self._view = view
        self.asking = ""  # the ask_user call running (it runs alone: not concurrent)

    def before(self, call: ToolCall, ctx: ToolContext) -> None:
        if call.name == "ask_user":
            self.asking = call.id
        self._view.call_started(call.id)

    def after(self, call: ToolCall, result: ToolResult, ctx: ToolContext) -> None:
        self._view.call_finished(call.id, result)


class TranscriptRun:
    """One transcript through one session of a dispatcher made here."""

    def __init__(
        self,
        make_dispatcher: Callable[..., Dispatcher],
        view: View,
        answers: Answers,
        *,
        mode: str = "deferred",
        record: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> None:
        self.view = view
        self.answers = answers
        self.record = record
        self.outcome = Outcome()
        self._hooks = _Hooks(view)
        self.dispatcher = make_dispatcher(gate=self._gate, hooks=[self._hooks])
        self._events: list[BatchEvent] = []
        self.dispatcher.subscribe_batches(self._events.append)
        self.session: Session = self.dispatcher.session("cli", mode=mode, record=record)
        self.session.state["ask_user"] = self._ask_user
        if self.session.recorder is not None and meta:
            self.session.recorder.set_meta(**meta)
        self._pending: tuple[int, list[CallRow]] | None = None
        self._batches_in_run = 0

    async def _gate(self, call: ToolCall, ctx: ToolContext) -> Allow | Deny:
        a = self.answers
        if call.id in a.approve:
            self.view.note(call.id, f"approved by {a.approver}")
            return Allow()
        if a.assume is not None:
            self.view.note(call.id, "approved by --yes" if a.assume else "refused by --no")
            return Allow() if a.assume else Deny("refused on the command line (--no)")
        if not a.interactive:
            return Deny("no one to ask: run with --yes to allow calls that need confirmation")
        allowed = await anyio.to_thread.run_sync(self.view.confirm, call, abandon_on_cancel=True)
        self.view.note(call.id, "approved at the terminal" if allowed else "refused at the terminal")
        return Allow() if allowed else Deny("the user said no")

    def _ask_user(self, question: str, options: list[str]) -> str:
        """`ask_user`'s answer (called in a worker thread): the next --answer, else the
        person at the terminal; with neither, the call fails and says how to answer."""
        a = self.answers
        if a.texts:
            answer = a.texts.pop(0)
            self.view.note(self._hooks.asking, f"answered {answer!r} by {a.source}")
            return answer
        if not a.interactive:
            raise ToolError(
                "no one to answer: there is no terminal; pass --answer TEXT (once per question)",
                retryable=False,
            )
        answer = self.view.ask(question, options)
        self.view.note(self._hooks.asking, f"answered {answer!r} at the terminal")
        return answer

    async def run(self, messages: Sequence[Mapping[str, Any]]) -> Outcome:
        """Dispatch every batch; a cancellation propagates (call `finish_cut` after it)."""
        self.outcome.answer = final_answer(messages)
        for message in messages:
            role = message.get("role")
            if role == "user":
                if self._batches_in_run:  # the session starts in a run: the first needs none
                    self.session.new_run()
                self._batches_in_run = 0
                text = message.get("content")
                self.view.user(text if isinstance(text, str) else _text_of(message))
                continue
            calls = tool_calls_of(message)
            if role != "assistant" or not calls:
                continue
            self.outcome.batches += 1
            self._batches_in_run += 1
            number = self.outcome.batches
            rows = [CallRow.of(c) for c in calls]
            self._pending = (number, rows)
            self.view.batch_started(number, rows)
            self._events.clear()
            try:
                results: Sequence[ToolResult | None] = await self.session.dispatch(calls)
            except DispatchInterrupted as exc:
                # a tool asked for a person the command line cannot reach: refuse it
                decisions: dict[str, Any] = {
                    call.id: Deny(f"{reason}: nothing on the command line can answer it")
                    for call, reason, _ in exc.pending
                }
                results = await self.session.dispatch(calls, decisions=decisions)
            except HookBlocked as exc:
                event = self._events[-1] if self._events else None
                results = list(event.results) if event is not None else [None] * len(calls)
                self._finish_batch(number, rows, results, event, note=f"blocked: {exc.reason}")
                continue
            self._pending = None
            self._finish_batch(number, rows, results, self._events[-1] if self._events else None)
        return self.outcome

    def _finish_batch(
        self,
        number: int,
        rows: Sequence[CallRow],
        results: Sequence[ToolResult | None],
        event: BatchEvent | None,
        note: str = "",
    ) -> list[ResultRow]:
        ran_calls = event.calls if event is not None and len(event.calls) == len(rows) else None
        out = []
        for i, row in enumerate(rows):
            result = results[i] if i < len(results) else None
            name = result.name if result is not None else ran_calls[i].name if ran_calls else row.name
            served = served_by(i, result, event)
            out.append(ResultRow(i, row.call_id, name, row.arguments, result, served, note))
            self.outcome.calls += 1
            self.outcome.statuses["cancelled" if result is None else result.status.value] += 1
            self.outcome.served[served] += 1
        if event is not None:
            self.outcome.events.append((number, event, out))
        self.view.batch_ended(number, out, event)
        return out

    def finish_cut(self) -> None:
        """After a cancellation: show and count the batch that was cut, close the session,
        and mark the cut calls of its record cancelled so the recording replays."""
        if self._pending is not None:
            number, rows = self._pending
            self.outcome.cut = number
            event = self._events[-1] if self._events else None
            results = list(event.results) if event is not None else [None] * len(rows)
            if len(results) != len(rows):
                results = [None] * len(rows)
            self.outcome.cut_rows = self._finish_batch(number, rows, results, event)
            self._pending = None
        self.close()
        if self.record and self.outcome.recording_problem is None:
            mark_cut_batch(self.record)

    def close(self) -> None:
        recorder = self.session.recorder
        self.session.close()
        if recorder is not None and recorder.problem is not None:
            self.outcome.recording_problem = str(recorder.problem)


def _lines(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        yield from f


def mark_cut_batch(path: str) -> bool:
    """Give the calls a cancellation cut off in the recording's last batch a recorded
    result (`failed`, `CUT_CONTENT`), so that replay serves them as it serves any call;
    True if the last record was changed. Only the last record is touched, which no later
    record's hash covers, and only its unfinished calls."""
    lines = list(_lines(path))
    if len(lines) < 2:
        return False
    try:  # a rows record as the batch record it stands for, which is written back
        record = read_record(lines[-1].rstrip("\n").encode())
    except (ValueError, RecursionError):
        return False
    if record.get("type") != "batch":
        return False
    plan, results, calls = record.get("plan"), record.get("results"), record.get("calls")
    if not (isinstance(plan, list) and isinstance(results, list) and isinstance(calls, list)):
        return False
    changed = False
    for i, row in enumerate(plan):
        if isinstance(row, dict) and row.get("how") == "unfinished" and i < len(results):
            call = calls[i] if i < len(calls) and isinstance(calls[i], dict) else {}
            row["how"] = "ran"
            results[i] = {
                "call_id": str(call.get("id", "")),
                "name": row.get("name"),
                "status": Status.failed.value,
                "content": CUT_CONTENT,
                "retryable": True,
                "effect_uncertain": True,
                "cached": False,
                "deduped": False,
                "started": None,
                "duration": 0.0,
            }
            changed = True
    if not changed:
        return False
    lines[-1] = json.dumps(record, ensure_ascii=True, default=str) + "\n"
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".threepass-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.chmod(tmp, os.stat(path).st_mode & 0o777)
    os.replace(tmp, path)
    return True
