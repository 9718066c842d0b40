"""What a person (or a program) sees of a run: three views over the same events.

- `RichView`: a terminal. Per batch, a row per call, a spinner while it runs, then its
  status, how it was served and its duration; a footer with the pass timings.
- `PlainView`: no terminal, `--plain` or `NO_COLOR`. The same facts as stable lines of
  text, written when each batch ends, with the columns sized to the batch.
- `JsonView`: `--json`. One JSON object a line per event and nothing else on stdout.

Prompts read the terminal's file descriptor directly (`read_line`), never `sys.stdin`:
a prompt abandoned by Ctrl-C leaves its worker thread blocked in `os.read`, which holds
no lock that the interpreter needs on the way out.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from dispatcher import BatchEvent, ToolCall, ToolResult

from ._runner import CallRow, ResultRow

__all__ = ["JsonView", "PlainView", "RichView", "duration", "head", "read_line"]

STATUS_STYLE = {
    "ok": "green",
    "failed": "red",
    "rejected": "red",
    "invalid_arguments": "yellow",
    "schema_required": "cyan",
    "denied": "magenta",
    "timed_out": "red",
    "expired": "yellow",
    "cancelled": "bright_black",
}
SERVED_STYLE = {
    "ran": "bold",
    "deduped": "blue",
    "cached": "cyan",
    "denied": "magenta",
    "decided": "dim",
    "cancelled": "bright_black",
}


def read_line(fd: int = 0) -> str:
    """One line from `fd` ("" at end of input), read a byte at a time."""
    chunks = []
    while True:
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            break
        chunks.append(byte)
    return b"".join(chunks).decode("utf-8", "replace").strip()


def duration(seconds: float | None) -> str:
    """A duration as people read it: 3ms, 1.24s; "-" when there is none."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.2f}s"


def head(content: str, width: int) -> str:
    """The first line of a result, cut to `width` characters."""
    first = content.strip().split("\n", 1)[0]
    return first if len(first) <= width else first[: max(0, width - 1)] + "…"


def _args(arguments: Mapping[str, Any], width: int = 80) -> str:
    return head(json.dumps(dict(arguments), ensure_ascii=False, sort_keys=True, default=str), width)


def _footer(event: BatchEvent | None) -> str:
    if event is None:
        return "nothing ran"
    parts = [
        f"pass 1 {duration(event.pass1)}",
        f"pass 2 {duration(event.pass2)}",
        f"pass 3 {duration(event.pass3)}",
    ]
    if event.outcome != "ok":
        parts.append(event.outcome)
    return " · ".join(parts)


class _Prompting:
    """Prompts on a stream, answers from the terminal's descriptor."""

    prompt_stream: IO[str]
    prompt_open = False  # a prompt was written and no answer came (Ctrl-C cut it)

    def confirm(self, call: ToolCall) -> bool:
        args = call.arguments if isinstance(call.arguments, Mapping) else {"arguments": call.arguments}
        self._prompt(f"allow {call.name} {_args(args, 200)}? [y/N] ")
        answer = read_line()
        self.prompt_open = False
        return answer.lower() in ("y", "yes")

    def ask(self, question: str, options: Sequence[str]) -> str:
        choices = f" [{' / '.join(options)}]" if options else ""
        self._prompt(f"{question}{choices}\n> ")
        answer = read_line()
        self.prompt_open = False
        return answer

    def _close_prompt(self) -> None:
        if self.prompt_open:
            self.prompt_open = False
            self.prompt_stream.write("\n")
            self.prompt_stream.flush()

    def _prompt(self, text: str) -> None:
        self.prompt_open = True
        self.prompt_stream.write(text)
        self.prompt_stream.flush()


class PlainView(_Prompting):
    """Stable lines of text: one a call, written when its batch ends."""

    def __init__(self, out: TextIO, width: int = 100) -> None:
        self.out = out
        self.prompt_stream = out
        self.width = width
        self._notes: dict[str, list[str]] = {}

    def message(self, kind: str, line: str, /, **data: Any) -> None:
        self._close_prompt()
        self.out.write(line + "\n")
        self.out.flush()

    def user(self, text: str) -> None:
        self.message("user", f"user: {text}")

    def batch_started(self, number: int, calls: Sequence[CallRow]) -> None:
        self._notes.clear()
        self.message("batch", f"batch {number}: {len(calls)} call{'s' if len(calls) != 1 else ''}")

    def call_started(self, call_id: str) -> None:
        pass

    def call_finished(self, call_id: str, result: ToolResult) -> None:
        pass

    def note(self, call_id: str, text: str) -> None:
        self._notes.setdefault(call_id, []).append(text)

    def batch_ended(self, number: int, rows: Sequence[ResultRow], event: BatchEvent | None) -> None:
        self._close_prompt()
        if not rows:
            return
        idw = max(len(r.call_id) for r in rows)
        nw = max(len(r.name) for r in rows)
        sw = max(len(r.status) for r in rows)
        vw = max(len(r.served) for r in rows)
        for r in rows:
            took = duration(r.result.duration) if r.result is not None and r.served == "ran" else "-"
            prefix = f"  {r.call_id:<{idw}}  {r.name:<{nw}}  {r.status:<{sw}}  {r.served:<{vw}}  {took:>6}  "
            content = "" if r.result is None else r.result.content
            self.out.write(prefix + head(content, max(20, self.width - len(prefix))) + "\n")
            for note in self._notes.get(r.call_id, []):
                self.out.write(f"  {'':<{idw}}  -> {note}\n")
        if rows[0].note:
            self.out.write(f"  {rows[0].note}\n")
        self.out.write(f"  {_footer(event).replace(' · ', ', ')}\n")
        self.out.flush()


class JsonView(_Prompting):
    """JSON Lines on `out`; prompts (when a person is asked) on stderr."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.prompt_stream = sys.stderr
        self._lock = threading.Lock()

    def emit(self, event: str, **data: Any) -> None:
        self._close_prompt()
        line = json.dumps({"event": event, **data}, ensure_ascii=False, default=str)
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def message(self, kind: str, line: str, /, **data: Any) -> None:
        self.emit(kind, **data)

    def user(self, text: str) -> None:
        self.emit("user", text=text)

    def batch_started(self, number: int, calls: Sequence[CallRow]) -> None:
        self.emit(
            "batch_started",
            batch=number,
            calls=[{"id": c.call_id, "name": c.name, "arguments": dict(c.arguments)} for c in calls],
        )

    def call_started(self, call_id: str) -> None:
        self.emit("call_started", id=call_id)

    def call_finished(self, call_id: str, result: ToolResult) -> None:
        self.emit("call_finished", id=call_id, status=result.status.value, duration=result.duration)

    def note(self, call_id: str, text: str) -> None:
        self.emit("decision", id=call_id, text=text)

    def batch_ended(self, number: int, rows: Sequence[ResultRow], event: BatchEvent | None) -> None:
        for r in rows:
            res = r.result
            self.emit(
                "result",
                batch=number,
                index=r.index,
                id=r.call_id,
                name=r.name,
                status=r.status,
                served_by=r.served,
                duration=None if res is None else res.duration,
                cached=bool(res and res.cached),
                deduped=bool(res and res.deduped),
                content=None if res is None else res.content,
            )
        self.emit(
            "batch_ended",
            batch=number,
            outcome=None if event is None else event.outcome,
            calls=len(rows),
            ran=sum(1 for r in rows if r.served == "ran"),
            pass1=None if event is None else event.pass1,
            pass2=None if event is None else event.pass2,
            pass3=None if event is None else event.pass3,
        )


class RichView(_Prompting):
    """A live table per batch on a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.prompt_stream = console.file
        self._lock = threading.RLock()
        self._live: Live | None = None
        self._rows: list[CallRow] = []
        self._state: dict[str, tuple[str, Any]] = {}
        self._notes: dict[str, list[str]] = {}
        self._number = 0

    def message(self, kind: str, line: str, /, *, style: str = "", **data: Any) -> None:
        self._close_prompt()
        self.console.print(Text(line, style=style or _MESSAGE_STYLE.get(kind, "")))

    def user(self, text: str) -> None:
        self.console.print(Text.assemble(("user ", "bold magenta"), (text, "italic")))

    def batch_started(self, number: int, calls: Sequence[CallRow]) -> None:
        with self._lock:
            self._number = number
            self._rows = list(calls)
            self._state = {c.call_id: ("pending", None) for c in calls}
            self._notes = {}
            n = len(calls)
            self.console.print(
                Text.assemble((f"batch {number}", "bold"), (f" · {n} call{'s' * (n != 1)}", "dim"))
            )

    def _ensure_live(self) -> None:
        if self._live is None:
            self._live = Live(
                self._table(None), console=self.console, refresh_per_second=12, transient=True,
                get_renderable=lambda: self._table(None),
            )  # fmt: skip
            self._live.start()

    def call_started(self, call_id: str) -> None:
        with self._lock:
            self._state[call_id] = ("running", None)
            self._ensure_live()

    def call_finished(self, call_id: str, result: ToolResult) -> None:
        with self._lock:
            self._state[call_id] = ("done", result)

    def note(self, call_id: str, text: str) -> None:
        with self._lock:
            self._notes.setdefault(call_id, []).append(text)

    def _stop_live(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _prompt(self, text: str) -> None:
        with self._lock:
            self.prompt_open = True
            self._stop_live()
            self.console.print(Text(text, style="bold yellow"), end="")
            self.console.file.flush()

    def ask(self, question: str, options: Sequence[str]) -> str:
        answer = super().ask(question, options)
        with self._lock:
            self._ensure_live()
        return answer

    def batch_ended(self, number: int, rows: Sequence[ResultRow], event: BatchEvent | None) -> None:
        with self._lock:
            self._close_prompt()
            self._stop_live()
            self.console.print(self._table(rows))
            footer = Text("  " + _footer(event), style="dim")
            if rows and rows[0].note:
                footer = Text.assemble(("  " + rows[0].note + "\n", "red"), footer)
            self.console.print(footer)

    def _table(self, rows: Sequence[ResultRow] | None) -> Table:
        # Every column but the result keeps its width; the result takes what is left, cut
        # with an ellipsis, so that a long result never squeezes a name.
        idw = max((len(c.call_id) for c in self._rows), default=2)
        nw = min(28, max((len(c.name) for c in self._rows), default=4))
        table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False, expand=True)
        table.add_column("id", style="dim", no_wrap=True, min_width=idw)
        table.add_column("tool", style="bold", no_wrap=True, overflow="ellipsis", min_width=nw, max_width=28)
        table.add_column("status", no_wrap=True, min_width=9)
        table.add_column("served", no_wrap=True, min_width=9)
        table.add_column("time", justify="right", no_wrap=True, min_width=6)
        table.add_column("result", no_wrap=True, overflow="ellipsis", ratio=1)
        if rows is not None:
            for r in rows:
                res = r.result
                took = duration(res.duration) if res is not None and r.served == "ran" else ""
                self._add(table, r.call_id, r.name, Text(r.status, STATUS_STYLE.get(r.status, "")),
                          Text(r.served, SERVED_STYLE.get(r.served, "")), took,
                          "" if res is None else res.content)  # fmt: skip
            return table
        for c in self._rows:
            phase, result = self._state.get(c.call_id, ("pending", None))
            status: Any
            if phase == "running":
                status = Spinner("dots", text=Text("running", "yellow"))
                self._add(table, c.call_id, c.name, status, Text(""), "", _args(c.arguments))
            elif phase == "done" and result is not None:
                st = result.status.value
                self._add(table, c.call_id, c.name, Text(st, STATUS_STYLE.get(st, "")), Text("ran", "bold"),
                          duration(result.duration), result.content)  # fmt: skip
            else:
                self._add(table, c.call_id, c.name, Text("·", "dim"), Text(""), "", _args(c.arguments))
        return table

    def _add(
        self, table: Table, call_id: str, name: str, status: Any, served: Text, took: str, content: str
    ) -> None:
        notes = self._notes.get(call_id)
        text = Text(head(content, 400))
        if notes:
            text = Text.assemble(("(" + "; ".join(notes) + ") ", "italic yellow"), text)
        table.add_row(call_id, name, status, served, took, text)


_MESSAGE_STYLE = {
    "workspace": "dim",
    "answer": "bold",
    "summary": "bold",
    "interrupted": "bold yellow",
    "replay_ok": "bold green",
    "replay_diverged": "bold red",
    "recorded": "dim",
    "site": "dim",
    "warning": "yellow",
}
