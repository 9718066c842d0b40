"""The seams: what a user plugs into the kernel, each a small `typing.Protocol`.

    Handler       (args, ctx) -> str | dict | list | bytes     a tool's code, sync or async
    Gate          (call, ctx) -> Allow | Deny | Interrupt      asked about confirm calls
    Rewriter      (event, state) -> {"tool_name", "args"} | None
    Hook          before(call, ctx) / after(call, result, ctx), either optional
    Subscriber    (event) -> None                              every committed result
    ToolRunner    (call, ctx) -> content | ToolResult          stands in for running handlers
    ResultCache   async get_many / set_many / invalidate / epoch / moved_since / clear /
                  statistics
    ErrorStore    async lookup / record_many / resolve / search      failures remembered
    SessionStore  async acquire / renew / release / load / save / mark_started
                  a session's state shared by workers, a lease per session

Gates, rewriters, hooks, subscribers and handlers may be sync or async. The result
store is async, so that a store across the network fits it; pass 1 and pass 3 never
call it: they say what they want looked up or written, and the session awaits it.

Nothing here runs, and nothing above the kernel is imported.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from ._types import Decision, ToolCall, ToolCallDispatchEvent, ToolContext, ToolResult, ToolResultEvent

__all__ = [
    "CacheEntry",
    "CacheStatistics",
    "CacheWrite",
    "ErrorRecord",
    "ErrorStore",
    "Gate",
    "Handler",
    "Hook",
    "Lease",
    "ResultCache",
    "Rewriter",
    "SessionStore",
    "StoredSession",
    "Subscriber",
    "ToolRunner",
]


class Handler(Protocol):
    """A tool's code. A sync handler runs in a worker thread; an async one on the host loop."""

    def __call__(self, args: Mapping[str, Any], ctx: ToolContext) -> Any: ...


class Gate(Protocol):
    """Asked, in call order, about every call that needs confirmation, before anything runs."""

    def __call__(self, call: ToolCall, ctx: ToolContext) -> Decision | Awaitable[Decision]: ...


class Rewriter(Protocol):
    """One link of the rewriter chain: None passes the call on, a mapping rewrites it."""

    def __call__(
        self, event: ToolCallDispatchEvent, state: dict[str, Any]
    ) -> Mapping[str, Any] | Awaitable[Mapping[str, Any] | None] | None: ...


class Hook(Protocol):
    """Wraps every call that starts. Either method may be missing; either may raise
    `HookBlocked` to stop the batch (what finished is committed first)."""

    def before(self, call: ToolCall, ctx: ToolContext) -> Any: ...

    def after(self, call: ToolCall, result: ToolResult, ctx: ToolContext) -> Any: ...


class Subscriber(Protocol):
    """Told every committed result, in call order, after the batch commits."""

    def __call__(self, event: ToolResultEvent) -> Any: ...


class ToolRunner(Protocol):
    """Runs a call instead of its handler: returns the content (as a handler would) or a
    whole `ToolResult`. Offline replay serves recorded results through one; tests and
    users can script tools with `ScriptedRunner`."""

    def __call__(self, call: ToolCall, ctx: ToolContext) -> Awaitable[Any]: ...


@attrs.frozen
class CacheEntry:
    """One cached success: the content the model saw and the resources it read."""

    content: str
    reads: frozenset[str] = frozenset()
    stored_at: float = 0.0


@attrs.frozen
class CacheWrite:
    """What pass 3 asks a store to keep: `content` under `key` for `ttl` seconds."""

    key: str
    content: str
    ttl: float
    reads: frozenset[str] = frozenset()


@attrs.frozen
class CacheStatistics:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    invalidations: int = 0
    expired: int = 0
    errors: int = 0
    entries: int = 0
    raced: int = 0
    """Writes refused because a write invalidated what they read while they ran."""


@runtime_checkable
class ResultCache(Protocol):
    """A result store keyed by the dispatcher's cache key (a hex string).

    A store never raises into a call: the session treats a failing lookup as misses and a
    failing write as dropped, with a warning. Stores keep their own clock for expiry."""

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        """The live entries among `keys` (missing, expired and unreadable ones left out).
        Pass 1 asks once per batch, so a store can answer in one round trip."""
        ...

    async def set_many(
        self, writes: Sequence[CacheWrite], *, since: int | None = None, invalidate: Iterable[str] = ()
    ) -> None:
        """A batch's store effects, in one transaction or round trip where the store can:
        refuse a write whose reads overlap what was invalidated after epoch `since` (the
        epoch read before those reads started: a read that raced a write is never stored);
        then `invalidate` as `invalidate()` does (the batch's own writes, which its reads
        were already checked against); then keep the other writes."""
        ...

    async def invalidate(self, resources: Iterable[str]) -> int:
        """Drop every entry whose reads overlap `resources`, and move the store's epoch on,
        remembering which resources it moved for; return how many entries were dropped."""
        ...

    async def epoch(self) -> int:
        """The store's invalidation counter now (0 for a store never written to)."""
        ...

    async def moved_since(self, epoch: int) -> frozenset[str] | None:
        """The resources invalidated after `epoch` (None: too long ago for the store to say)."""
        ...

    async def clear(self) -> None: ...

    async def statistics(self) -> CacheStatistics: ...


@attrs.frozen
class ErrorRecord:
    """One remembered failure: which tool, its signature (16 hex digits of the normalised
    error), the arguments' shape (keys and JSON types, never values), the first and last
    time it was seen (wall-clock seconds), how often, the error's first line (redacted,
    bounded) and the resolution written for it, if any."""

    tool: str
    signature: str
    shape: tuple[tuple[str, str], ...] = ()
    error: str = ""
    first_seen: float = 0.0
    last_seen: float = 0.0
    count: int = 1
    resolution: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "signature": self.signature,
            "shape": dict(self.shape),
            "error": self.error,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "count": self.count,
            "resolution": self.resolution,
        }


@runtime_checkable
class ErrorStore(Protocol):
    """Failures remembered across sessions and processes, keyed by signature.

    Pass 3 never calls it: the session looks a batch's signatures up before commit and
    records what commit returns (`CommitEffects.errors`) after; a store's fault is logged,
    never a call's failure. A store keeps its own clock for records stamped 0."""

    async def lookup(self, signatures: Sequence[str]) -> dict[str, ErrorRecord]:
        """The records among `signatures` (unknown ones left out)."""
        ...

    async def record_many(self, records: Sequence[ErrorRecord]) -> None:
        """Count each record's occurrences under its signature (made on first sight), keeping
        only the most recently seen signatures past the store's bound."""
        ...

    async def resolve(self, signature: str, resolution: str | None) -> ErrorRecord | None:
        """Write (None: clear) the resolution of `signature`; its record, or None if unknown."""
        ...

    async def search(
        self,
        *,
        tool: str | None = None,
        text: str | None = None,
        signature: str | None = None,
        limit: int = 20,
    ) -> list[ErrorRecord]:
        """The records matching every filter given (`text`: in the error or the resolution,
        case-folded), most recently seen first."""
        ...


@attrs.frozen
class Lease:
    """One worker's hold on one session: `token` is unique to this acquisition; the
    store forgets the hold `seconds` after it was taken or last renewed."""

    session_id: str
    token: str
    seconds: float


@attrs.frozen
class StoredSession:
    """What a session store holds for one session: the state saved at the end of its
    last batch or interrupt (opaque bytes the kernel wrote; None before the first save),
    and the call ids marked started since that save (writers that began and never
    committed)."""

    snapshot: bytes | None = None
    started: frozenset[str] = frozenset()


@runtime_checkable
class SessionStore(Protocol):
    """Session state shared by the workers of a deployment, so that a session's next
    batch (or the approval of an interrupted one) may land on any of them.

    The kernel holds a lease while a batch runs: `acquire` at the start (a held, unexpired
    lease raises `SessionBusy` at once, never waits), `renew` while it runs, `release` at
    the end or at an interrupt. `save` and `mark_started` take the lease and refuse (raise
    `SessionBusy`) when it is no longer held: a worker whose lease expired never overwrites
    the worker that took over. Unlike the result cache, a fault here is raised: a batch
    whose state cannot be kept must not pretend it was."""

    lease_seconds: float
    """How long a lease lives without renewal (a crashed worker's lease expires then)."""

    async def acquire(self, session_id: str) -> Lease:
        """Take the session's lease, or raise `SessionBusy` if another holder has it."""
        ...

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease by `lease.seconds`; False when it is no longer held."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the lease up (nothing happens if it is no longer held)."""
        ...

    async def load(self, session_id: str) -> StoredSession:
        """The session's snapshot and started marks (an empty `StoredSession` if unknown)."""
        ...

    async def save(self, lease: Lease, snapshot: bytes) -> None:
        """Replace the session's snapshot and clear its started marks, in one step."""
        ...

    async def mark_started(self, lease: Lease, call_ids: Sequence[str]) -> None:
        """Record that these calls are starting (before their first side effect)."""
        ...

    async def delete(self, session_id: str) -> None:
        """Forget the session: snapshot, marks and lease."""
        ...
