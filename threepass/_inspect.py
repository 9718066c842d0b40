"""`threepass inspect`: what a recording holds, batch by batch, without replaying it.

Batches are numbered from 1 in file order, as `run` numbers them. A recording keeps
each call's start (wall clock) and duration but not the passes' own timings, so the
table shows pass 2's span: from the first call that started to the last one's end.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dispatcher import BatchEvent, Status, ToolCall, ToolResult
from dispatcher._recording import read_recording

from ._runner import Outcome, ResultRow
from ._view import SERVED_STYLE, STATUS_STYLE, _args, duration, head

__all__ = ["batch_rows", "inspect", "outcome_of_recording"]


def _result(raw: Any) -> ToolResult | None:
    if not isinstance(raw, Mapping):
        return None
    try:
        return ToolResult.from_json(dict(raw))
    except (KeyError, TypeError, ValueError):
        return None


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return {"<unparseable>": args}
    return dict(args) if isinstance(args, Mapping) else {}


def batch_rows(record: Mapping[str, Any]) -> list[ResultRow]:
    """The calls of one batch record with their results and how each was served."""
    calls = record.get("calls") or []
    plan = record.get("plan") or []
    results = record.get("results") or []
    rows = []
    for i, call in enumerate(calls):
        row = plan[i] if i < len(plan) and isinstance(plan[i], Mapping) else {}
        result = _result(results[i]) if i < len(results) else None
        how = str(row.get("how", ""))
        if result is None:
            served = "cancelled"
        elif result.cached:
            served = "cached"
        elif result.deduped or how in ("deduped", "follow"):
            served = "deduped"
        elif result.status is Status.denied:
            served = "denied"
        elif how == "ran":
            served = "ran"
        else:
            served = "decided"
        call_id = str(call.get("id", "")) if isinstance(call, Mapping) else ""
        name = str(row.get("name") or (call.get("name") if isinstance(call, Mapping) else ""))
        args = _arguments(call) if isinstance(call, Mapping) else {}
        if name != "run_tool" and args.keys() >= {"name", "args"} and isinstance(args.get("args"), Mapping):
            args = dict(args["args"])  # the call was run_tool(name, args): show the tool's own
        rows.append(ResultRow(i, call_id, name, args, result, served))
    return rows


def _span(rows: Sequence[ResultRow]) -> tuple[float | None, float | None]:
    """(start, seconds) of pass 2 as the results show it: first start to last end."""
    ran = [r.result for r in rows if r.result is not None and r.result.started is not None]
    if not ran:
        return None, None
    start = min(r.started for r in ran if r.started is not None)
    end = max((r.started or 0.0) + r.duration for r in ran)
    return start, end - start


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def outcome_of_recording(path: str) -> Outcome:
    """A recording's batches as a run's outcome (for the timeline): pass 2 from the calls'
    own starts and durations, passes 1 and 3 unknown (drawn as nothing)."""
    _, batches, _, _ = read_recording(path)
    outcome = Outcome()
    for number, record in enumerate(batches, 1):
        rows = batch_rows(record)
        start, span = _span(rows)
        calls = tuple(ToolCall(r.call_id, r.name, dict(r.arguments)) for r in rows)
        event = BatchEvent(
            session_id="recording",
            run_id=int(record.get("run") or 0),
            round=int(record.get("round") or 0),
            calls=calls,
            results=tuple(r.result for r in rows),
            ran=frozenset(r.index for r in rows if r.served == "ran"),
            started=start or 0.0,
            pass1=0.0,
            pass2=span or 0.0,
            pass3=0.0,
            outcome="ok" if all(r.result is not None for r in rows) else "cancelled",
        )
        outcome.batches += 1
        outcome.calls += len(rows)
        outcome.events.append((number, event, rows))
    return outcome


def inspect(path: str, batch: int | None, console: Console, *, as_json: bool = False) -> int:
    """Print the recording's batches (or one batch's calls); 1 if it cannot be read."""
    header, batches, truncated, problem = read_recording(path)
    if not header and problem:
        raise ValueError(problem)
    if batch is not None and not 1 <= batch <= len(batches):
        raise ValueError(f"--batch {batch}: the recording has batches 1 to {len(batches)}")
    summaries: list[dict[str, Any]] = []
    for number, record in enumerate(batches, 1):
        rows = batch_rows(record)
        _, span = _span(rows)
        summaries.append(
            {
                "batch": number,
                "run": record.get("run"),
                "calls": len(rows),
                "statuses": dict(Counter(r.status for r in rows)),
                "served_by": dict(Counter(r.served for r in rows)),
                "pass2": span,
                "rows": rows,
            }
        )
    if as_json:
        document: dict[str, Any] = {
            "session": header.get("session"),
            "mode": header.get("mode"),
            "meta": header.get("meta"),
            "truncated": truncated,
            "problem": problem,
            "batches": [{k: v for k, v in s.items() if k != "rows"} for s in summaries],
        }
        if batch is not None:
            document["calls"] = [
                {
                    "index": r.index,
                    "id": r.call_id,
                    "name": r.name,
                    "arguments": dict(r.arguments),
                    "status": r.status,
                    "served_by": r.served,
                    "duration": None if r.result is None else r.result.duration,
                    "content": None if r.result is None else r.result.content,
                }
                for r in summaries[batch - 1]["rows"]
            ]
        console.file.write(json.dumps(document, indent=2, default=str) + "\n")
        return 0
    meta = header.get("meta") if isinstance(header.get("meta"), Mapping) else {}
    console.print(
        Text(
            f"{path}: session {header.get('session', '?')!s}, mode {header.get('mode', '?')!s}, "
            f"{len(batches)} batches, {sum(s['calls'] for s in summaries)} calls"
            + (
                f", transcript {meta['transcript']}"
                if isinstance(meta, Mapping) and "transcript" in meta
                else ""
            ),
            style="bold",
        ),
        soft_wrap=True,
    )
    if batch is None:
        table = Table(header_style="bold", box=None, padding=(0, 2, 0, 0), pad_edge=False)
        for column in ("batch", "run", "calls", "statuses", "served by", "pass 2"):
            justify = "right" if column in ("batch", "run", "calls", "pass 2") else "left"
            table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for s in summaries:
            table.add_row(
                str(s["batch"]),
                str(s["run"]),
                str(s["calls"]),
                _counts(Counter(s["statuses"])),
                _counts(Counter(s["served_by"])),
                duration(s["pass2"]),
            )
        console.print(table)
    else:
        _print_batch(console, batch, summaries[batch - 1]["rows"])
    if truncated:
        console.print(Text("the last line was cut short (a crash while writing)", style="yellow"))
    if problem:
        console.print(Text(f"problem: {problem}", style="red"))
    return 0


def _print_batch(console: Console, number: int, rows: Sequence[ResultRow]) -> None:
    console.print(Text(f"batch {number}", style="bold"))
    table = Table(header_style="bold", box=None, padding=(0, 2, 0, 0), pad_edge=False)
    for column in ("#", "id", "tool", "status", "served", "time"):
        table.add_column(column, no_wrap=True, justify="right" if column in ("#", "time") else "left")
    table.add_column("arguments → result", overflow="fold")
    for r in rows:
        res = r.result
        took = duration(res.duration) if res is not None and r.served == "ran" else "-"
        content = "" if res is None else head(res.content, 200)
        table.add_row(
            str(r.index + 1),
            r.call_id,
            r.name,
            Text(r.status, STATUS_STYLE.get(r.status, "")),
            Text(r.served, SERVED_STYLE.get(r.served, "")),
            took,
            Text.assemble((_args(r.arguments, 120), "dim"), "\n", content),
        )
    console.print(table)
