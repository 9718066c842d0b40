"""The exceptions threepass raises or understands.

    Exception
     ├── ToolError              a tool's ordinary failure; becomes a `failed` result
     ├── HookBlocked            run control: a hook (or tool code) stopped the batch
     ├── DispatchInterrupted    run control: a gate (or tool code) wants a human first
     └── SessionBusy            another worker holds the session's lease (or took it over)
    ValueError
     └── ToolDefinitionError    a Tool that cannot be registered (bad schema, bad name)
    LookupError
     └── UnknownTool            `Registry.get` of a name nobody registered

Ordinary failures never escape `dispatch`; run control always does.
Nothing from trio, the disk or the clock may be imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._types import ToolCall

__all__ = [
    "DispatchInterrupted",
    "HookBlocked",
    "SessionBusy",
    "ToolDefinitionError",
    "ToolError",
    "UnknownTool",
]


class ToolError(Exception):
    """Raised by a tool for an ordinary failure. `retryable=False` says a retry will not help."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class HookBlocked(Exception):
    """A lifecycle hook, or tool code, refused to let the batch go on."""

    def __init__(self, reason: str, *, call_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.call_id = call_id


class DispatchInterrupted(Exception):
    """A gate (or tool code) asked for a decision before the batch may run.

    `pending` lists `(call, reason, payload)` for every call that was interrupted,
    in call order. Resume with `dispatch(calls, decisions={call_id: Allow() | Deny(...)})`.
    """

    def __init__(self, pending: Sequence[tuple[ToolCall, str, Any]]) -> None:
        self.pending = list(pending)
        names = ", ".join(f"{call.name}({call.id})" for call, _, _ in self.pending)
        super().__init__(f"dispatch interrupted, waiting on {len(self.pending)} call(s): {names}")


class ToolDefinitionError(ValueError):
    """A tool definition that cannot be registered."""


class UnknownTool(LookupError):
    """A name that no registered tool carries."""


class SessionBusy(Exception):
    """A session store's lease on `session_id` is held by another worker (or this
    worker's lease expired and another took it over): the batch did not run, or its state
    was not saved. Raised at once, never after waiting."""

    def __init__(self, session_id: str, detail: str = "") -> None:
        message = f"session {session_id!r} is busy: another worker holds its lease"
        super().__init__(f"{message} ({detail})" if detail else message)
        self.session_id = session_id
        self.detail = detail
