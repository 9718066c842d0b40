"""The values that cross pass boundaries: calls, results, decisions, events, context.

All are frozen attrs classes; change one with `attrs.evolve`. Nothing here runs a
tool, touches trio, the disk or the clock.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs

if TYPE_CHECKING:
    from ._registry import Tool
    from ._seams import ErrorStore

__all__ = [
    "PROVIDERS",
    "Allow",
    "Answer",
    "BatchEvent",
    "Decision",
    "Deny",
    "HistoryEntry",
    "Interrupt",
    "Provider",
    "Status",
    "ToolCall",
    "ToolCallDispatchEvent",
    "ContextHost",
    "ToolContext",
    "ToolResult",
    "ToolResultEvent",
    "call_id_of",
    "id_text",
    "plain",
    "provider_named",
]

Provider = Literal["openai", "anthropic", "responses", "openai-responses"]
PROVIDERS: Mapping[str, str] = {
    "openai": "openai",
    "anthropic": "anthropic",
    "responses": "responses",
    "openai-responses": "responses",
}
"""Every provider name accepted, to the format it names (OpenAI chat, Anthropic, OpenAI Responses)."""


def provider_named(provider: str) -> str:
    """The format `provider` names: `openai`, `anthropic` or `responses`."""
    try:
        return PROVIDERS[provider]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown provider, expected openai, anthropic, responses or openai-responses, got {provider!r}"
        ) from None


_CALL_FIELDS = ("id", "call_id", "type", "name", "input", "arguments", "function")
_MISSING = object()


def _dumped(item: Any) -> dict[str, Any] | None:
    """A pydantic v2 model (the SDKs' objects) as a plain dict; None for anything else."""
    dump = getattr(item, "model_dump", None)
    if not callable(dump):
        return None
    try:
        value = dump(warnings=False)
    except Exception:
        return None
    return value if isinstance(value, dict) else None


def _attributes(item: Any, names: Sequence[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in names:
        try:
            value = getattr(item, name, _MISSING)
        except Exception:
            continue
        if value is not _MISSING:
            fields[name] = value
    return fields


def plain(item: Any) -> Any:
    """`item` as a mapping when it is one, or an object with a call's shape: a pydantic
    model by `model_dump()`, any other object by its attributes. Anything else as it is."""
    if isinstance(item, Mapping):
        return item
    dumped = _dumped(item)
    if dumped is not None:
        return dumped
    fields = _attributes(item, _CALL_FIELDS)
    fn = fields.get("function")
    if fn is not None and not isinstance(fn, Mapping | str):
        fields["function"] = _dumped(fn) or _attributes(fn, ("name", "arguments"))
    return fields or item


def id_text(value: Any) -> str:
    """A call's id as text: a missing one (None, as an SDK object made without one holds)
    is empty, never the word "None"."""
    return "" if value is None else str(value)


def call_id_of(item: Any) -> str | None:
    """The call id an item carries, read even when the rest of it is unreadable (a
    Responses item's `call_id` before its item `id`); None when it has none."""
    for name in ("call_id", "id"):
        if isinstance(item, Mapping):
            value = item.get(name)
        else:
            try:
                value = getattr(item, name, None)
            except Exception:
                continue
        if (isinstance(value, str) and value) or (isinstance(value, int) and not isinstance(value, bool)):
            return str(value)
    return None


class Status(enum.StrEnum):
    """What became of one call (DESIGN.md, failure contract)."""

    ok = "ok"
    failed = "failed"
    rejected = "rejected"
    invalid_arguments = "invalid_arguments"
    schema_required = "schema_required"
    denied = "denied"
    timed_out = "timed_out"
    expired = "expired"


@attrs.frozen
class ToolCall:
    """One tool call as the model emitted it. `arguments` is a JSON string or a mapping."""

    id: str
    name: str
    arguments: str | Mapping[str, Any] = attrs.field(factory=dict)

    @classmethod
    def parse(cls, item: ToolCall | Mapping[str, Any] | Any) -> ToolCall:
        """Accept a ToolCall, an OpenAI chat `tool_calls` item, an OpenAI Responses
        `function_call` item, or an Anthropic `tool_use` block: as a mapping, or as an
        object of that shape (the SDKs' pydantic models, read by `model_dump()`)."""
        if isinstance(item, ToolCall):
            return item
        if not isinstance(item, Mapping):
            item = plain(item)
            if not isinstance(item, Mapping):
                raise TypeError(
                    f"a tool call must be a ToolCall or a mapping (or an object of that shape), got {item!r}"
                )
        kind = item.get("type")
        if "function" in item and isinstance(item["function"], Mapping):  # OpenAI chat
            fn = item["function"]
            return cls(
                id=id_text(item.get("id")),
                name=str(fn.get("name", "")),
                arguments=fn.get("arguments") or {},
            )
        if kind == "tool_use":  # Anthropic
            return cls(
                id=id_text(item.get("id")),
                name=str(item.get("name", "")),
                arguments=item.get("input") or {},
            )
        if kind == "function_call":  # OpenAI Responses
            return cls(
                id=id_text(item.get("call_id") or item.get("id")),
                name=str(item.get("name", "")),
                arguments=item.get("arguments") or {},
            )
        if "name" in item and "id" in item:  # already our own shape, as a dict
            # LangChain's tool call holds them under `args`, an Anthropic block that lost its
            # `type` under `input`: read there rather than run the call with none
            held = next((key for key in ("arguments", "args", "input") if key in item), "arguments")
            return cls(
                id=id_text(item["id"]),
                name=str(item["name"]),
                arguments=item.get(held) or {},
            )
        raise ValueError(f"not a tool call in any known provider shape: {dict(item)!r}")


@attrs.frozen
class ToolResult:
    """The outcome of one call. `started` is wall-clock UTC seconds, `duration` monotonic seconds."""

    call_id: str
    name: str
    status: Status
    content: str
    retryable: bool = False
    effect_uncertain: bool = False
    cached: bool = False
    deduped: bool = False
    started: float | None = None
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is Status.ok

    def to_message(self, provider: Provider = "openai") -> dict[str, Any]:
        """This result as the provider's tool message (Anthropic: one `tool_result` block;
        `Session.tool_messages` makes the user message that carries a batch of them)."""
        fmt = provider_named(provider)
        if fmt == "openai":
            return {"role": "tool", "tool_call_id": self.call_id, "content": self.content}
        if fmt == "anthropic":
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": self.call_id,
                "content": self.content,
            }
            if self.status is not Status.ok:
                block["is_error"] = True
            return block
        if fmt == "responses":
            return {
                "type": "function_call_output",
                "call_id": self.call_id,
                "output": self.content,
            }
        raise AssertionError(f"provider_named gave {fmt!r}")  # pragma: no cover

    def to_json(self) -> dict[str, Any]:
        """A plain dict of every field (for recordings and logs)."""
        return {
            "call_id": self.call_id,
            "name": self.name,
            "status": self.status.value,
            "content": self.content,
            "retryable": self.retryable,
            "effect_uncertain": self.effect_uncertain,
            "cached": self.cached,
            "deduped": self.deduped,
            "started": self.started,
            "duration": self.duration,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolResult:
        return cls(
            call_id=data["call_id"],
            name=data["name"],
            status=Status(data["status"]),
            content=data["content"],
            retryable=bool(data.get("retryable", False)),
            effect_uncertain=bool(data.get("effect_uncertain", False)),
            cached=bool(data.get("cached", False)),
            deduped=bool(data.get("deduped", False)),
            started=data.get("started"),
            duration=float(data.get("duration", 0.0)),
        )

    def error(self) -> dict[str, Any] | None:
        """The failure JSON of a failed result (its first line), or None for `ok`."""
        if self.status is Status.ok:
            return None
        first = self.content.split("\n", 1)[0]
        try:
            value = json.loads(first)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


@attrs.frozen
class Allow:
    """The gate lets the call run; `args`, if given, replace the call's arguments."""

    args: Mapping[str, Any] | None = None


@attrs.frozen
class Deny:
    """The gate refuses the call; the model sees `reason`."""

    reason: str = "denied by the gate"


@attrs.frozen
class Interrupt:
    """The gate wants a human: the batch stops before anything runs."""

    reason: str
    payload: Any = None


@attrs.frozen
class Answer:
    """The call's result is `content`; nothing runs. Resumes an interrupted `ask_user`, or
    answers any call: `dispatch(calls, decisions={call_id: Answer("yes")})`."""

    content: str


Decision = Allow | Deny | Interrupt | Answer


class ContextHost(Protocol):
    """What a `ToolContext` reads from the session it serves (a Session is one)."""

    id: str
    state: dict[str, Any]

    @property
    def history(self) -> Sequence[HistoryEntry]: ...

    def load_tools(self, names: Iterable[str]) -> list[str]: ...

    def searchable_tools(self) -> list[Tool]: ...

    async def invoke(self, name: str, args: Mapping[str, Any] | None = None) -> ToolResult: ...

    def on_close(self, fn: Callable[[], Any]) -> None: ...

    @property
    def error_store(self) -> ErrorStore | None: ...


@attrs.frozen
class ToolContext:
    """What a handler, gate or hook may know about the call it serves, and the few things
    it may do in its session: read the history, load schemas, invoke another tool.
    It carries no Session or Dispatcher: tools depend on this, not on the kernel's objects."""

    call_id: str
    tool_name: str
    run_id: int
    round: int
    deadline: float | None = None
    _host: ContextHost | None = attrs.field(default=None, repr=False, eq=False, alias="host")

    @property
    def session_id(self) -> str:
        """The id of the session the call belongs to ("" outside one)."""
        return "" if self._host is None else str(self._host.id)

    @property
    def state(self) -> dict[str, Any]:
        """The session's scratch space (todo list, whatever tools keep)."""
        if self._host is None:
            raise RuntimeError(f"call {self.call_id!r} has no session, so no session state")
        return self._host.state

    @property
    def history(self) -> Sequence[HistoryEntry]:
        """The session's committed calls, oldest first (read-only)."""
        return () if self._host is None else self._host.history

    def load_tools(self, names: Iterable[str]) -> list[str]:
        """Mark tools as loaded in the session (their schemas are known); the known ones."""
        return [] if self._host is None else self._host.load_tools(names)

    def searchable_tools(self) -> list[Tool]:
        """What `find_tools` searches: the session's registry."""
        return [] if self._host is None else self._host.searchable_tools()

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` when the session closes (a tool's cleanup: stop what it started)."""
        if self._host is None:
            raise RuntimeError(f"call {self.call_id!r} has no session to clean up after")
        self._host.on_close(fn)

    @property
    def errors(self) -> ErrorStore | None:
        """The session's error memory (failures remembered across sessions), or None."""
        return None if self._host is None else self._host.error_store

    async def invoke(self, name: str, args: Mapping[str, Any] | None = None) -> ToolResult:
        """Call another tool from this handler, in the same session, through the same three
        passes. It runs on this handler's limiter slot, so it never deadlocks at the limit."""
        if self._host is None:
            raise RuntimeError(f"call {self.call_id!r} has no session to invoke {name!r} in")
        return await self._host.invoke(name, args)


@attrs.frozen
class ToolCallDispatchEvent:
    """What a rewriter sees (symfonic's contract): one call, before it is dispatched."""

    session_id: str
    run_id: int
    round: int
    call_id: str
    tool_name: str
    args: Mapping[str, Any]
    available_tools: tuple[str, ...]


@attrs.frozen
class ToolResultEvent:
    """Emitted in call order after a batch commits."""

    session_id: str
    run_id: int
    round: int
    index: int
    call: ToolCall
    result: ToolResult


@attrs.frozen
class BatchEvent:
    """One batch, after pass 3 — also when it was cut short — for observers of a whole
    dispatcher (tracing, metrics): `Dispatcher.subscribe_batches(fn)`.

    `calls` are as they ran (after `run_tool` and rewriters), `results` one per call, None
    for a call that never finished (the batch was cancelled or blocked first); `ran` holds
    the indices whose handler started. `started` is wall-clock UTC seconds; `pass1` (from
    the batch's start through the gates to the finished plan), `pass2` (the executor) and
    `pass3` (commit, the store's writes, the recording) are monotonic seconds. `outcome`
    is "ok", "interrupted" (a gate or a tool asked for a human), "blocked" (a hook
    refused), "cancelled" (the caller's scope was cancelled) or "error" (anything else,
    such as KeyboardInterrupt). A batch a gate interrupted ran nothing: its `calls` and
    `results` are empty, and `pass2` and `pass3` are 0."""

    session_id: str
    run_id: int
    round: int
    calls: tuple[ToolCall, ...]
    results: tuple[ToolResult | None, ...]
    ran: frozenset[int]
    started: float
    pass1: float
    pass2: float
    pass3: float
    outcome: str


@attrs.frozen
class HistoryEntry:
    """One committed call, as the session's history keeps it (pass 3): the call as it ran
    (after `run_tool` and rewriters) and its result, kept by reference, not copied."""

    run_id: int
    round: int
    index: int
    call: ToolCall
    result: ToolResult

    @property
    def call_id(self) -> str:
        return self.call.id

    @property
    def name(self) -> str:
        return self.call.name

    @property
    def args(self) -> Mapping[str, Any]:
        args = self.call.arguments
        return args if isinstance(args, Mapping) else {}

    @property
    def status(self) -> Status:
        return self.result.status

    @property
    def content(self) -> str:
        return self.result.content

    @property
    def cached(self) -> bool:
        return self.result.cached

    @property
    def deduped(self) -> bool:
        return self.result.deduped

    @property
    def started(self) -> float | None:
        return self.result.started

    @property
    def duration(self) -> float:
        return self.result.duration


def maker(cls: type[Any]) -> Callable[..., Any]:
    """A constructor of the frozen, slotted attrs class `cls` taking every field in order,
    for the values made for every call and batch: it fills an instance of a subclass of
    `cls` that adds nothing but the plain `__setattr__` (so each field is the
    interpreter's own slot store, not a frozen class's `object.__setattr__` or a call of
    the slot's descriptor), then makes it a `cls`. The instance is the same in every
    respect (class, fields, equality, hash, repr, pickling), and costs half what the slot
    descriptors' way does. The subclass shows in `cls.__subclasses__()`: CPython lets an
    instance's class change only to one of the same layout, and with a `__weakref__`
    slot only a subclass that adds nothing has it."""
    fields = attrs.fields(cls)
    if any(f.validator is not None or f.converter is not None for f in fields):  # pragma: no cover
        raise TypeError(f"{cls.__name__} validates or converts a field: its __init__ must run")
    if "__slots__" not in cls.__dict__:  # pragma: no cover - (`attrs.fields` raised for a class not attrs)
        raise TypeError(f"{cls.__name__} is not a slotted attrs class")
    # both are given: together they are one slot of the type, and only the pair of object's
    # own makes it the plain one
    opened = type(
        f"_Filling{cls.__name__}",
        (cls,),
        {"__slots__": (), "__setattr__": object.__setattr__, "__delattr__": object.__delattr__},
    )
    names = [f.name for f in fields]
    lines = [f"def make({', '.join(names)}):", "    made = new(opened)"]
    lines += [f"    made.{name} = {name}" for name in names]
    lines += ["    made.__class__ = cls", "    return made"]
    scope: dict[str, Any] = {"new": object.__new__, "opened": opened, "cls": cls}
    exec("\n".join(lines), scope)  # the code is made here, from the class's own field names
    made: Callable[..., Any] = scope["make"]
    return made


new_result: Callable[[str, str, Status, str, bool, bool, bool, bool, float | None, float], ToolResult] = (
    maker(ToolResult)
)
"""`ToolResult(call_id, name, status, content, retryable, effect_uncertain, cached, deduped,
started, duration)`, every field given, faster."""

new_context: Callable[[str, str, int, int, float | None, ContextHost | None], ToolContext] = maker(
    ToolContext
)
"""`ToolContext(call_id, tool_name, run_id, round, deadline, host)`, faster."""
