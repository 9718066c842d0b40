"""Error memory, pure: a failure's signature, what of it may be stored, and the hint lines
and `next:` line pass 3 ends a failed call's content with.

A signature names a failure independently of the values that vary between its
occurrences: the tool's name and the error's first line, normalised (URLs cut to their
scheme and host, paths, UUIDs, long hex and numbers collapsed, case and spacing folded;
an `HTTP 401`'s status kept), hashed with xxh3-64 into 16 hex digits. It is computed
from the redacted text, so no secret goes into it.

What is stored of a failure (`ErrorRecord`) passes the credential rule: the error's first
line, redacted with the call's credential values and with credential query parameters of
any URL in it, at most `MAX_ERROR_CHARS` long; the arguments' shape (keys and JSON types),
never their values.

Nothing here does I/O, reads the clock or imports above the kernel; `commit` calls
`note_failure`, the session calls `signatures_of` to look the batch's failures up first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import xxhash

from ._credentials import credential_values, redact_arguments, redact_text
from ._seams import ErrorRecord
from ._types import Status, ToolResult

__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_ERRORS_PER_BATCH",
    "MAX_RESOLUTION_CHARS",
    "NOTED",
    "SECRET_STORE_KEY",
    "FailureNotes",
    "argument_shape",
    "failure_signature",
    "is_credential_failure",
    "needs_note",
    "normalize_error",
    "note_failure",
    "secret_name",
    "signatures_of",
    "stored_error",
]

SECRET_STORE_KEY: Final = "store_secret"
"""`session.state[SECRET_STORE_KEY]`: the application's `fn(name, secret)` that keeps a
secret in the host's secret store (`store_secret` calls it; `secret` None: ask the user)."""

MAX_ERROR_CHARS: Final = 500
MAX_RESOLUTION_CHARS: Final = 1000
MAX_ERRORS_PER_BATCH: Final = 32
"""Distinct signatures one batch records at most (the rest still get their hints)."""

NOTED: Final = frozenset({Status.failed, Status.timed_out})
"""The statuses a failure note may finish (`needs_note`)."""

_URL: Final = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{},;]+")
_UUID: Final = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_HEX: Final = re.compile(
    r"\b(?:0x[0-9a-fA-F]+|(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,})\b"
)
_PATH: Final = re.compile(
    r"(?<![\w.:/])(?:~|\.{1,2})?(?:/[\w.@%+=~-]+)+/?"  # absolute, ~/ and ./ ../
    r"|(?<![\w.:/])[\w.-]+(?:/[\w.@%+=~-]+)+/?"  # relative, with a folder in it
)
_HTTP_STATUS: Final = re.compile(r"\bHTTP (\d{3})\b")
_DIGITS: Final = re.compile(r"\d+")
_SPACES: Final = re.compile(r"\s+")

# A missing or rejected credential: an HTTP status, an error type's name, or a message
# that names a key or token together with what went wrong with it.
_AUTH_STATUS: Final = re.compile(
    r"\b(?:HTTP|status(?: code)?:?) ?(?:401|403)\b|\b(?:401|403) (?:Unauthorized|Forbidden)\b", re.I
)
_AUTH_TYPE: Final = re.compile(
    # not Python's PermissionError: that one is about files
    r"\b\w*(?:Authentication|Authorization|Auth|Credential|PermissionDenied|Unauthori[sz]ed|Forbidden|"
    r"InvalidToken|TokenExpired)\w*(?:Error|Exception)\b"
)
_SECRET_WORD: Final = (
    r"(?:api[ _-]?key|access[ _-]?key|secret[ _-]?key|token|credentials?|password|secret|bearer)"
)
_WHAT_WENT_WRONG: Final = (
    r"(?:missing|invalid|expired|revoked|required|not set|not found|not provided|rejected|denied|bad|"
    r"wrong|incorrect|unauthori[sz]ed|unauthenticated|malformed)"
)
_AUTH_MESSAGE: Final = re.compile(
    rf"\b{_WHAT_WENT_WRONG}\b[^.\n]{{0,40}}?\b{_SECRET_WORD}\b"
    rf"|\b{_SECRET_WORD}\b[^.\n]{{0,40}}?\b{_WHAT_WENT_WRONG}\b"
    rf"|\bno (?:valid )?{_SECRET_WORD}\b",
    re.I,
)
_WRONG: Final = re.compile(rf"\b{_WHAT_WENT_WRONG}\b", re.I)
_ENV_SECRET: Final = re.compile(
    r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*_(?:API_KEY|KEY|TOKEN|SECRET|PASSWORD|PAT)\b"
)


@attrs.frozen
class FailureNotes:
    """What pass 3 is told, as values, to finish a batch's failures.

    `remembering`: an error store is configured (failures go out as `CommitEffects.errors`).
    `known`: the store's records of this batch's signatures (the session looked them up).
    `write_error`: the `write_error` tool can be called (and a store keeps what it writes).
    `store_secret`: `store_secret` can keep a secret (the tool is there and the session
    holds the application's callable); else a credential failure says to ask the user."""

    remembering: bool = False
    known: Mapping[str, ErrorRecord] = attrs.field(factory=dict)
    write_error: bool = False
    store_secret: bool = False


def normalize_error(text: str) -> str:
    """The error's first line with what varies between occurrences collapsed."""
    line = text.strip().split("\n", 1)[0][: MAX_ERROR_CHARS * 2]
    line = _URL.sub(_url_shape, line)
    line = _UUID.sub("<id>", line)
    line = _HEX.sub("<hex>", line)
    line = _PATH.sub("<path>", line)
    line = _HTTP_STATUS.sub(_status_kept, line)
    line = _DIGITS.sub("#", line)
    return _SPACES.sub(" ", line).strip().lower()


def _status_kept(match: re.Match[str]) -> str:
    # spelled in letters, so that collapsing numbers keeps 401 apart from 403
    return "HTTP " + "".join("abcdefghij"[int(digit)] for digit in match[1])


def _url_shape(match: re.Match[str]) -> str:
    try:
        parts = urlsplit(match[0])
        host = parts.hostname or ""
    except ValueError:
        return "<url>"
    return f"{parts.scheme}://{host}" + ("/<path>" if parts.path.strip("/") else "")


def failure_signature(tool: str, error: str) -> str:
    """16 hex digits naming the failure of `tool` with `error` (its first line normalised)."""
    return xxhash.xxh3_64_hexdigest(f"{tool}\n{normalize_error(error)}".encode("utf-8", "surrogatepass"))


def argument_shape(args: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The arguments' keys with the JSON type of each value, sorted; never a value."""
    return tuple(sorted((str(key), _json_type(value)) for key, value in args.items()))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def stored_error(error: str, args: Mapping[str, Any]) -> str:
    """What may be kept of `error`: its first line with the call's credentials redacted
    (and credential query parameters of any URL in it), at most MAX_ERROR_CHARS long."""
    line = error.strip().split("\n", 1)[0]
    line = redact_text(line, credential_values(args))
    line = _URL.sub(lambda m: str(redact_arguments({"url": m[0]})["url"]), line)
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 1] + "…"


def _error_of(result: ToolResult) -> dict[str, Any] | None:
    head = result.error()
    return head if head is not None and isinstance(head.get("error"), str) else None


def needs_note(result: ToolResult) -> bool:
    """A `failed` or `timed_out` result in the failure contract's shape whose content does
    not yet end with a `next:` line (a replayed or runner-made one may already)."""
    if result.status not in NOTED or _error_of(result) is None:
        return False
    return not result.content.rsplit("\n", 1)[-1].startswith("next: ")


def signatures_of(failures: Iterable[tuple[ToolResult, Mapping[str, Any]]]) -> list[str]:
    """The signatures of the (result, arguments) pairs that `note_failure` will finish."""
    found: list[str] = []
    for result, args in failures:
        head = _error_of(result) if needs_note(result) else None
        if head is not None:
            signature = failure_signature(result.name, stored_error(head["error"], args))
            if signature not in found:
                found.append(signature)
    return found


def is_credential_failure(error: str) -> bool:
    """True when `error` points to a missing or rejected credential: HTTP 401/403, an
    authentication error type, or a message naming a key or token that is missing, wrong
    or refused."""
    if _AUTH_STATUS.search(error) or _AUTH_TYPE.search(error) or _AUTH_MESSAGE.search(error):
        return True
    return bool(_ENV_SECRET.search(error) and _WRONG.search(error))


def secret_name(error: str, args: Mapping[str, Any], tool: str) -> str:
    """The name to store the credential under: a variable the error names (`GITHUB_TOKEN`),
    else the host of the call's URL, else the tool's name."""
    named = _ENV_SECRET.search(error)
    if named is not None:
        return named[0]
    for key in ("url", "uri", "href"):
        value = args.get(key)
        if isinstance(value, str):
            try:
                host = urlsplit(value).hostname
            except ValueError:
                host = None
            if host:
                return host
    return tool


def note_failure(
    result: ToolResult, args: Mapping[str, Any], notes: FailureNotes
) -> tuple[ToolResult, ErrorRecord | None]:
    """`result` finished for the model: the first line gains `seen`/`resolution` when the
    store knows the failure, then a line naming its signature, then the `next:` line.
    Returns it and the record to remember (None when nothing is remembered)."""
    head = _error_of(result)
    if head is None or not needs_note(result):
        return result, None
    error = stored_error(head["error"], args)
    signature = failure_signature(result.name, error)
    known = notes.known.get(signature)
    lines = result.content.split("\n")
    if known is not None:
        head = {**head, "seen": known.count + 1}
        if known.resolution:
            head["resolution"] = known.resolution[:MAX_RESOLUTION_CHARS]
        lines[0] = json.dumps(head, ensure_ascii=False)
    if notes.remembering:
        lines.append(f'signature: {signature} (error_history(signature="{signature}") shows its past)')
    if known is not None and known.resolution:
        lines.append("this failure was resolved before: try that resolution first")
    lines.append(_next_line(result, head["error"], error, args, signature, notes))
    noted = attrs.evolve(result, content="\n".join(lines))
    if not notes.remembering:
        return noted, None
    at = result.started or 0.0
    record = ErrorRecord(
        tool=result.name,
        signature=signature,
        shape=argument_shape(args),
        error=error,
        first_seen=at,
        last_seen=at,
        count=1,
    )
    return noted, record


def _next_line(
    result: ToolResult,
    raw_error: str,
    error: str,
    args: Mapping[str, Any],
    signature: str,
    notes: FailureNotes,
) -> str:
    if is_credential_failure(raw_error):
        name = json.dumps(secret_name(raw_error, args, result.name))
        if notes.store_secret:
            return f"next: store_secret(name={name}) to keep the credential, then retry"
        return (
            f"next: ask the user for the credential {name} (no secret store is configured here), then retry"
        )
    if notes.write_error:
        return (
            f'next: once a different approach works, write_error(signature="{signature}", '
            'outcome="resolved", resolution="what fixed it")'
        )
    if result.retryable:
        return "next: retry once if the cause may pass; otherwise try a different approach"
    return "next: a retry fails the same way: try a different approach"
