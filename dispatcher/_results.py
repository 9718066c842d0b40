"""How outcomes become tool messages: the failure contract and output normalisation.

Every result that reaches the model passes through here: tool output is made
well-formed UTF-8 and cut at the size limit with a marker; a failure becomes the
JSON line `{"error", "status", "retryable", "effect_uncertain"}`, then an optional
`next:` hint. No trio, disk or clock here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ._credentials import redact_text
from ._types import Status, ToolResult

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "describe",
    "failure_content",
    "failure_result",
    "normalize_output",
    "redacted_json",
    "safe_text",
    "shown",
    "well_formed",
]

DEFAULT_MAX_OUTPUT_BYTES = 256 * 1024
_SURROGATE = re.compile("[\ud800-\udfff]")

# status -> retryable by default (failed and timed_out may be overridden per call)
_RETRYABLE: dict[Status, bool] = {
    Status.failed: True,
    Status.rejected: False,
    Status.invalid_arguments: True,
    Status.schema_required: True,
    Status.denied: False,
    Status.timed_out: True,
    Status.expired: False,
}


def safe_text(value: Any) -> str:
    """`str(value)` for a message; never raises, whatever the value's `__str__` does."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__} that cannot be shown>"


def shown(value: Any, limit: int = 120) -> str:
    """`repr(value)` for a message, cut short; never raises."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} that cannot be shown>"
    return text if len(text) <= limit else text[:limit] + "..."


def describe(exc: BaseException) -> str:
    """`"ValueError: the message"` for an exception, or its type alone; a group of them
    (a task group's) names what it holds, the first three; never raises."""
    text = safe_text(exc)
    said = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if isinstance(exc, BaseExceptionGroup):
        held = [describe(inner) for inner in exc.exceptions[:3]]
        more = len(exc.exceptions) - len(held)
        said += " [" + "; ".join(held) + (f"; and {more} more" if more > 0 else "") + "]"
    return said


def well_formed(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (so it encodes as UTF-8)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _cut(text: str, limit: int) -> str:
    # a character is at most 4 bytes: short strings need no encoding to be measured
    if len(text) * 4 <= limit:
        return text
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")  # drops a character cut in half
    return f"{kept}\n[output truncated: {len(data)} bytes, showing the first {limit}]"


def normalize_output(value: Any, limit: int = DEFAULT_MAX_OUTPUT_BYTES) -> str:
    """A handler's return value as the text the model sees.

    str as is; bytes decoded as UTF-8 (ill-formed sequences become U+FFFD); None as "";
    anything else as JSON.
    """
    if isinstance(value, str):
        text = well_formed(value)
    elif isinstance(value, bytes | bytearray | memoryview):
        text = bytes(value).decode("utf-8", "replace")
    elif value is None:
        text = ""
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError) as exc:
            text = f"<unserialisable {type(value).__name__}: {exc}>"
        text = well_formed(text)
    return _cut(text, limit)


def failure_content(
    status: Status,
    error: str,
    *,
    retryable: bool,
    effect_uncertain: bool,
    hint: str | None = None,
    detail: str | None = None,
) -> str:
    """The failure contract's content: the JSON line, an optional detail block, a `next:` line."""
    head = json.dumps(
        {
            "error": well_formed(error),
            "status": status.value,
            "retryable": retryable,
            "effect_uncertain": effect_uncertain,
        },
        ensure_ascii=False,
    )
    parts = [head]
    if detail:
        parts.append(well_formed(detail))
    if hint:
        parts.append(f"next: {well_formed(hint)}")
    return "\n".join(parts)


def failure_result(
    call_id: str,
    name: str,
    status: Status,
    error: str,
    *,
    retryable: bool | None = None,
    effect_uncertain: bool = False,
    hint: str | None = None,
    detail: str | None = None,
    started: float | None = None,
    duration: float = 0.0,
    limit: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> ToolResult:
    """A non-ok ToolResult whose content follows the failure contract."""
    if retryable is None:
        retryable = _RETRYABLE[status]
    # the JSON line is the contract: shorten what it says, never cut the line itself
    error = _cut(safe_text(error), limit // 2)
    detail = None if detail is None else _cut(detail, limit // 4)
    hint = None if hint is None else _cut(hint, limit // 8)
    content = failure_content(
        status, error, retryable=retryable, effect_uncertain=effect_uncertain, hint=hint, detail=detail
    )
    return ToolResult(
        call_id=call_id,
        name=name,
        status=status,
        content=content,
        retryable=retryable,
        effect_uncertain=effect_uncertain,
        started=started,
        duration=duration,
    )


def redacted_json(result: ToolResult, secrets: Iterable[str]) -> dict[str, Any]:
    """`result.to_json()` with each of `secrets` in its content replaced by its marker: a
    result as a recording, or a session snapshot, keeps it."""
    recorded = result.to_json()
    recorded["content"] = redact_text(result.content, secrets)
    return recorded
