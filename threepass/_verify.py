"""`threepass replay --verify`: the recording's calls run again for real, in a workspace,
and every result compared with the one recorded.

Replay proves the passes decide as they did; verify asks whether the tools still answer
as they did. The recorded decisions stand in for the person: a call approved then is
approved now, a refusal refuses, and `ask_user` gets the answer it got then.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from builtin_tools import default_registry
from dispatcher import Allow, Deny, Dispatcher, ToolCall, ToolContext
from dispatcher._recording import read_recording

from ._inspect import batch_rows
from ._runner import Answers, Outcome, TranscriptRun

__all__ = ["verify"]


def _recorded_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded call in OpenAI chat shape, as the session takes it."""
    args = call.get("arguments")
    text = args if isinstance(args, str) else json.dumps(args if args is not None else {})
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": call.get("name"), "arguments": text},
    }


def _messages(batches: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The recording as a transcript: a user message where the run changes."""
    messages: list[dict[str, Any]] = []
    last_run = None
    for record in batches:
        if last_run is not None and record.get("run") != last_run:
            messages.append({"role": "user", "content": f"(run {record.get('run')})"})
        last_run = record.get("run")
        calls = [_recorded_call(c) for c in record.get("calls") or [] if isinstance(c, Mapping)]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    return messages


def verify(
    path: str,
    workspace: Path,
    view: Any,
    *,
    diff_lines: Callable[[str, str], list[str]],
    print_diff: Callable[[Any, Sequence[str]], None],
) -> tuple[int, Outcome]:
    """Run the recording's batches for real; (0 if every result matches, else 1; what ran)."""
    header, batches, _, problem = read_recording(path)
    if problem and not batches:
        raise ValueError(problem)
    decisions: dict[str, Any] = {}
    asked: list[str] = []
    for record in batches:
        decisions.update(record.get("decisions") or {})
        for row in batch_rows(record):
            if row.name == "ask_user" and row.result is not None:
                asked.append(row.result.content)
    meta = header.get("meta") if isinstance(header.get("meta"), Mapping) else {}
    private = isinstance(meta, Mapping) and meta.get("private_network") == "yes"
    registry = default_registry(workspace, allow_private_network=private)

    def make(**kw: Any) -> Dispatcher:
        kw["gate"] = recorded_gate
        return Dispatcher(registry, **kw)

    def recorded_gate(call: ToolCall, ctx: ToolContext) -> Allow | Deny:
        found = decisions.get(call.id)
        if isinstance(found, Mapping) and "allow" in found:
            view.note(call.id, "approved, as recorded")
            return Allow()
        return Deny(str(found.get("deny")) if isinstance(found, Mapping) else "not approved in the recording")

    answers = Answers(texts=asked, source="the recording")
    runner = TranscriptRun(make, view, answers, mode=str(header.get("mode", "deferred")))
    trio.run(runner.run, _messages(batches))
    runner.close()
    for (number, _event, rows), record in zip(runner.outcome.events, batches, strict=False):
        for now, then in zip(rows, batch_rows(record), strict=False):
            if now.result is None or then.result is None:
                continue
            for field, was, got in (
                ("status", then.result.status.value, now.result.status.value),
                ("content", then.result.content, now.result.content),
            ):
                if was != got:
                    view.message(
                        "divergence",
                        f"differs: batch {number}, call {now.index} ({now.call_id}, {now.name}): {field}",
                        batch=number,
                        call_id=now.call_id,
                        field=field,
                        expected=was,
                        got=got,
                    )
                    print_diff(view, diff_lines(was, got))
                    return 1, runner.outcome
    view.message(
        "verified",
        f"verified: {runner.outcome.calls} calls ran again and answered as recorded",
        ok=True,
        calls=runner.outcome.calls,
    )
    return 0, runner.outcome
