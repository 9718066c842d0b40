"""Pass 1, pre-flight: decide every call of a batch before anything runs.

Synchronous and sans-IO: the planner reads the registry and the session's bookkeeping
and returns values. It never touches the event loop, a store, the disk or the clock;
what pass 1 awaits (rewriters, the result store, the gates) the session awaits between
the planner's synchronous pieces:

    parse -> [rewriters] -> lookups -> [store.get_many] -> resolve -> [gates] -> finish

`lookups` says which cache keys the batch wants; the session hands the store's answer
to `resolve`.

A call's life is a small table (`_NEXT`): a step taken out of order raises.
Each step below is numbered as in DESIGN.md.
"""

from __future__ import annotations

import copy
import difflib
import enum
import json
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import orjson
import referencing.exceptions
import xxhash

from ._credentials import carries_credentials, redact_arguments, redact_json_text
from ._fastcheck import fast_verdict
from ._policy import NO_RESOURCES, resources_overlap
from ._registry import RegisteredTool, Registry
from ._results import DEFAULT_MAX_OUTPUT_BYTES, describe, failure_result, normalize_output, safe_text, shown
from ._seams import CacheEntry
from ._types import Allow, Answer, Deny, Status, ToolCall, ToolResult, call_id_of, maker, new_result

__all__ = [
    "DEFAULT_MAX_ARGUMENT_BYTES",
    "RUN_TOOL",
    "FIND_TOOLS",
    "STOPPED_KEY",
    "PATHS",
    "DedupeEntry",
    "Draft",
    "FinishedCall",
    "Plan",
    "PlannedCall",
    "Planner",
    "PlannerState",
    "Step",
    "call_key",
    "canonical_json",
    "stopped_result",
]

log = logging.getLogger("threepass.plan")

DEFAULT_MAX_ARGUMENT_BYTES = 1024 * 1024
RUN_TOOL = "run_tool"
FIND_TOOLS = "find_tools"
FORCE = "force"
_RAW_SLACK = 8  # "\\u0001" is six characters for one byte, plus room for whitespace

# A call's life: each step may only follow the ones listed for it.
_NEXT: dict[str, frozenset[str]] = {
    "parsed": frozenset({"resolved", "decided"}),
    "resolved": frozenset({"approved", "decided", "following"}),
    "approved": frozenset({"decided", "planned"}),
    "following": frozenset({"planned", "reopened"}),
    "decided": frozenset({"planned", "reopened"}),
    "reopened": frozenset({"approved", "decided"}),
}
_ALLOWED = frozenset((a, b) for a, nexts in _NEXT.items() for b in nexts)  # one lookup per step
# The steps `finish` plans a call from: "resolved" and "reopened" by way of "approved"
_PLANNED_FROM = frozenset({a for a, _ in _ALLOWED if (a, "planned") in _ALLOWED} | {"resolved", "reopened"})


class Step(enum.Enum):
    """The checks pass 1 makes of a call whose tool it found, in DESIGN.md's order."""

    KEY = "key"  # 1 and 6: defaults, `force`, canonical JSON, size, the key, reads/writes/cache
    LOOKUP = "lookup"  # 6: dedupe in the batch and the run, the result cache
    VALIDATE = "validate"  # 7: JSON Schema
    CONFIRM = "confirm"  # 8: whether the gate must be asked


# Which checks each path through pass 1 makes, in this order; a call that fails one is
# decided and goes no further. The one place the order is written.
PATHS: dict[str, tuple[Step, ...]] = {
    # a call as the model sent it
    "resolve": (Step.KEY, Step.LOOKUP, Step.VALIDATE, Step.CONFIRM),
    # arguments a gate's Allow(args) changed: keyed and validated anew, never looked up
    # (their result is stored under the new key), and the gate has already spoken
    "allow": (Step.KEY, Step.VALIDATE),
    # a call decided from arguments a gate then changed (see `_reopen_stale`): checked
    # again, and if it needs a gate it is refused, since no gate saw it
    "reopen": (Step.VALIDATE, Step.CONFIRM),
}
# `lookups` keys every call, `resolve` takes the rest of the path; both call the steps
# directly (one call each, where `_check` loops over the table): they must be these
if PATHS["resolve"] != (Step.KEY, Step.LOOKUP, Step.VALIDATE, Step.CONFIRM):  # pragma: no cover
    raise AssertionError("Planner.lookups and Planner.resolve take the steps of PATHS['resolve']")


_IN_PLACE = True
"""Pass 1 takes the common call (an OpenAI chat item with JSON text, for a plain tool) in
place, in fewer frames; each place says what it stands for. False: every call goes the
general way (the tests compare the two)."""

STOPPED_KEY = "\x00stopped"
"""The key of a `FinishedCall` standing for a writer that a worker started and never
committed (its session store's started mark): it matches whatever key the call arrives
with, and the call is answered with `stopped_result` instead of running again."""
STOPPED_ERROR = "the worker running this call stopped; its effect is unknown"


def stopped_result(call_id: str, name: str, limit: int = DEFAULT_MAX_OUTPUT_BYTES) -> ToolResult:
    """The result of a writer a stopped worker left started: failed, its effect uncertain,
    and not to be retried blindly."""
    return failure_result(
        call_id,
        name,
        Status.failed,
        STOPPED_ERROR,
        retryable=False,
        effect_uncertain=True,
        hint="look at what it writes to see whether it happened before calling it again",
        limit=limit,
    )


def _served_again(result: ToolResult, call_id: str) -> ToolResult:
    """An earlier success, served to another call (attrs.evolve is several times slower)."""
    return new_result(
        call_id,
        result.name,
        result.status,
        result.content,
        result.retryable,
        result.effect_uncertain,
        result.cached,
        True,  # deduped
        None,
        0.0,
    )


# One encoder for every call: json.dumps with options builds a new one each time, and
# JSONEncoder.encode builds a new C encoder each time. `c_make_encoder` is that C encoder,
# made once here with exactly the arguments JSONEncoder.encode passes it (no circular
# check: a cycle ends in RecursionError, which callers treat as unserialisable). Where
# it is missing (no C accelerator) or takes other arguments, JSONEncoder.encode serves.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_canonical_chunks: Callable[[Any, int], Sequence[str]] | None
try:
    _canonical_chunks = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        None, _CANONICAL.default, json.encoder.encode_basestring, None, ":", ",", True, False, True
    )
except (AttributeError, TypeError):  # pragma: no cover - CPython has it
    _canonical_chunks = None
# A decoder for the arguments: raw_decode skips the whitespace scans of json.loads;
# anything it does not take whole goes to json.loads, for its answer and its message.
_DECODER = json.JSONDecoder()


class _HoldsFloat(Exception):
    """The text holds a number with a fraction or an exponent, NaN or an infinity."""


def _refuse_float(text: str) -> Any:
    raise _HoldsFloat(text)


# What raw_decode calls, for the common call read in place (no StopIteration turned into
# its message: a text it does not take goes the general way, which writes that). It reads
# as _DECODER does and refuses floats: what it reads, orjson writes in the canonical form
# byte for byte (it writes some floats otherwise, and NaN as null), in a third of the time.
# Integers past 64 bits, lone surrogates and nesting past 255 it refuses, and json writes.
_scan_floatless: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(  # type: ignore[attr-defined]
    parse_float=_refuse_float, parse_constant=_refuse_float
).scan_once
_SORT_KEYS = orjson.OPT_SORT_KEYS


def canonical_json(args: Mapping[str, Any]) -> str:
    """Sorted keys, no spaces, UTF-8 kept: the form arguments are keyed and measured in.
    Raises TypeError or ValueError if they are not JSON, RecursionError if they nest too deep."""
    if _canonical_chunks is None:  # pragma: no cover
        return _CANONICAL.encode(args)
    return "".join(_canonical_chunks(args, 0))


def parse_json(raw: str) -> Any:
    """`json.loads(raw)`, faster on the common case of a document with no surrounding space."""
    try:
        value, end = _DECODER.raw_decode(raw)
    except ValueError:
        return json.loads(raw)
    return value if end == len(raw) else json.loads(raw)


def call_key(name: str, canonical: str) -> str:
    """xxh3-128 of the tool name and its canonical arguments."""
    return xxhash.xxh3_128_hexdigest(f"{name}\x00{canonical}".encode())


class DedupeEntry(NamedTuple):
    """A success earlier in this run, with what it read (for invalidation). A named tuple:
    pass 3 makes one per remembered call, and it is private to the session."""

    result: ToolResult
    reads: frozenset[str]


class FinishedCall(NamedTuple):
    """A call that finished in a batch cut short: its key and its result."""

    key: str | None
    result: ToolResult


@attrs.define
class PlannerState:
    """The session bookkeeping pass 1 reads. Owned by the session; pass 3 writes it."""

    loaded: set[str] = attrs.field(factory=set)
    dedupe: dict[str, DedupeEntry] = attrs.field(factory=dict)
    spent_approvals: set[str] = attrs.field(factory=set)
    finished: dict[str, FinishedCall] = attrs.field(factory=dict)
    """Calls of a batch that was cut short (an interrupt or block from pass 2, a
    cancellation), by call id: dispatched again in the same run, they are served."""


class Draft:
    """A call while pass 1 decides it (mutable, private to pass 1). Slotted, and every
    field set as it is made: one is made for every call of every batch and each field is
    read several times, and on 3.11 a field read from the class (a default there) takes
    the interpreter's generic lookup, where a slot's is specialized."""

    index: int
    call_id: str
    name: str
    args: dict[str, Any] | None
    via_run_tool: bool
    step: str
    entry: RegisteredTool | None
    outcome: ToolResult | None
    key: str | None
    reads: frozenset[str]
    writes: frozenset[str]
    concurrent: bool
    confirm: bool
    force: bool
    cache_key: str | None
    cacheable: bool
    leader: int | None
    approval: Allow | None
    spent_approval: bool
    duplicate: bool
    arrived_key: str | None  # the key of the arguments as the call arrived (before a gate)
    sent: Mapping[str, Any] | None  # as the model sent them (less `force`): validated
    sent_json: str | None  # ... and as history keeps them, immune to the handler
    from_json: bool  # `args` came straight from JSON text (only JSON's types in them)
    plain: bool  # keyed in place: a plain tool without defaults (see `lookups`)
    floatless: bool  # read in place from JSON text without a float (`_scan_floatless`)
    __slots__ = tuple(__annotations__)  # the fields above, each a slot

    def __init__(self, index: int, call_id: str, name: str, args: dict[str, Any] | None) -> None:
        _filled(self, index, call_id, name, args)

    def __repr__(self) -> str:
        return f"Draft({self.index}, {self.call_id!r}, {self.name!r}, step={self.step!r})"

    def advance(self, step: str) -> None:
        if (self.step, step) not in _ALLOWED:
            raise RuntimeError(f"call {self.call_id!r}: cannot go from {self.step!r} to {step!r}")
        self.step = step

    def decide(self, outcome: ToolResult) -> None:
        self.advance("decided")
        self.outcome = outcome

    def resolved_call(self) -> ToolCall:
        """The call as it stands, with a copy of its arguments: a gate that edits what it is
        shown changes nothing (`Allow(args=...)` is how a gate changes them)."""
        return ToolCall(id=self.call_id, name=self.name, arguments=copy.deepcopy(self.args or {}))


def _filled(d: Draft, index: int, call_id: str, name: str, args: dict[str, Any] | None) -> Draft:
    """`d`, every field set: `Draft(...)` without a class call (on 3.11 a call of a
    function is specialized, a class call is not), for the common call in `parse`."""
    d.index = index
    d.call_id = call_id
    d.name = name
    d.args = args
    d.via_run_tool = False
    d.step = "parsed"
    d.entry = None
    d.outcome = None
    d.key = None
    d.reads = NO_RESOURCES
    d.writes = NO_RESOURCES
    d.concurrent = False
    d.confirm = False
    d.force = False
    d.cache_key = None
    d.cacheable = False
    d.leader = None
    d.approval = None
    d.spent_approval = False
    d.duplicate = False
    d.arrived_key = None
    d.sent = None
    d.sent_json = None
    d.from_json = False
    d.plain = False
    d.floatless = False
    return d


_new_draft: Callable[[type[Draft]], Draft] = object.__new__


class PlannedCall(NamedTuple):
    """One call as pass 1 left it: decided (`outcome`), following a leader, or to run.

    A named tuple rather than a frozen attrs class: just as immutable, and one is made
    for every call of every batch, where a frozen attrs class costs three times as much
    to build (each field goes through `object.__setattr__`). For the same reason the
    call is kept as its parts and `call` builds the ToolCall only when asked."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, which nothing here uses
    call_id: str
    name: str
    args: Mapping[str, Any]
    tool: RegisteredTool | None
    outcome: ToolResult | None
    leader: int | None
    key: str | None
    reads: frozenset[str]
    writes: frozenset[str]
    concurrent: bool
    cache_key: str | None
    spent_approval: bool
    sent: str | None = None  # the arguments as sent, canonical JSON (what history keeps)

    @property
    def call(self) -> ToolCall:
        """The call as it runs: after `run_tool` is unwrapped and rewriters have spoken."""
        return ToolCall(self.call_id, self.name, self.args)

    @property
    def runs(self) -> bool:
        return self.outcome is None and self.leader is None

    @property
    def cacheable(self) -> bool:
        """Looked up in the result cache, and written to it if it succeeds."""
        return self.cache_key is not None

    @property
    def loads_schema(self) -> bool:
        """Answered with its schema: pass 3 marks the tool loaded."""
        return self.outcome is not None and self.outcome.status is Status.schema_required


@attrs.frozen
class Plan:
    """The whole batch: every call in order, and the groups pass 2 runs (indices).
    `carried`: the calls pass 1 answered with a result that must outlive a cut batch
    (an `Answer`, or a result served from the batch's earlier, cut-short dispatch)."""

    calls: tuple[PlannedCall, ...]
    groups: tuple[tuple[int, ...], ...]
    carried: frozenset[int] = frozenset()
    arrived_keys: Mapping[int, str] = attrs.field(factory=dict)
    """The calls an Allow(args) re-keyed: the key they arrived with, under which a resume of
    the batch will look them up."""
    received: Sequence[tuple[str, str, str] | None] | None = attrs.field(default=None, eq=False)
    """When the planner was asked to keep them (`Planner.received`, for a recording): per
    call, the id, name and arguments text of an item `parse` read in place (the OpenAI chat
    shape, each of the three text), as they were when read; None for any other item."""


_OK = Status.ok
_CALL_ID = operator.attrgetter("call_id")
# PlannedCall(...) is a lambda calling this; called directly, one frame fewer per call
_planned_call: Callable[[type[PlannedCall], tuple[Any, ...]], PlannedCall] = tuple.__new__
_plan: Callable[..., Plan] = maker(Plan)  # every field in order: one is made per batch


class _SeamFailed(Exception):
    def __init__(self, seam: str, cause: Exception) -> None:
        super().__init__(seam)
        self.seam = seam
        self.cause = cause


def _nearest(name: str, names: Iterable[str], n: int = 3) -> list[str]:
    return difflib.get_close_matches(name, list(names), n=n, cutoff=0.5)


def _unreadable(item: Any, exc: Exception) -> str:
    """Why `item` is no tool call (`exc`), quoting it redacted where it carries a credential:
    one is not said back, nor kept in a recording, which replays the call redacted."""
    if isinstance(item, Mapping):
        try:
            redacted = redact_arguments(dict(item))
            changed = redacted != item
        except Exception:  # keys that are no text, say: quoted as they are
            return str(exc)
        if changed:
            try:
                ToolCall.parse(redacted)
            except (TypeError, ValueError) as again:
                return str(again)
    return str(exc) if isinstance(exc, TypeError | ValueError) else f"reading it raised {describe(exc)}"


def _clean_name(name: str) -> str:
    name = name.strip()
    cut = name.find("<|")
    return name[:cut].strip() if cut >= 0 else name


def _evaluate(flag: bool | Callable[[Mapping[str, Any]], Any], args: Mapping[str, Any]) -> bool:
    return flag if isinstance(flag, bool) else bool(flag(args))


def _resources(fn: Callable[[Mapping[str, Any]], Any] | None, args: Mapping[str, Any]) -> frozenset[str]:
    if fn is None:
        return frozenset()
    value = fn(args)
    if not value:
        return frozenset()
    if isinstance(value, str):
        return frozenset((value,))
    return frozenset(str(v) for v in value)


def _schema_errors(entry: RegisteredTool, args: Mapping[str, Any]) -> list[str]:
    errors = []
    for err in sorted(entry.validator.iter_errors(args), key=lambda e: list(e.absolute_path)):
        path = "$" + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in err.absolute_path)
        errors.append(f"{path}: {err.message}")
    return errors


def _reference_of(exc: referencing.exceptions.Unresolvable) -> str:
    """The reference `exc` could not resolve, as the schema spells it where it can be told.
    jsonschema wraps the error of `referencing` (its cause); a pointer's is the part after
    `#`, an anchor's the anchor's name."""
    cause = exc.__cause__ if isinstance(exc.__cause__, referencing.exceptions.Unresolvable) else exc
    if isinstance(cause, referencing.exceptions.NoSuchAnchor):
        return f"#{cause.anchor}"
    if isinstance(cause, referencing.exceptions.PointerToNowhere):
        return f"#{cause.ref}"
    return safe_text(cause.ref)


class _Batch:
    """What the LOOKUP step of one batch shares across its calls (a plain class: one is
    made per batch, and attrs' factories cost more than the rest of a one-call batch)."""

    __slots__ = ("cached", "leaders", "pending_writes")

    def __init__(self, cached: Mapping[str, CacheEntry]) -> None:
        self.cached = cached
        self.leaders: dict[str, Draft] = {}
        self.pending_writes: list[str] = []


def _cached_result(
    d: Draft, cached: Mapping[str, CacheEntry], pending_writes: list[str]
) -> ToolResult | None:
    """The result the result cache holds for `d` (it has a cache key), unless a write of this
    batch touches what it read."""
    hit = cached.get(d.cache_key or "")
    if hit is not None and not isinstance(hit, CacheEntry):
        log.warning("result cache returned %s, not a CacheEntry; treated as a miss", shown(hit))
        return None
    if hit is None or (pending_writes and resources_overlap(hit.reads, pending_writes)):
        return None
    # ToolResult(d.call_id, d.name, ok, hit.content, cached=True), field by field
    return new_result(d.call_id, d.name, _OK, hit.content, False, False, True, False, None, 0.0)


class Planner:
    """Pass 1 for one batch. Made by `new_planner` (one a batch: a function call costs less
    than a class call), then its steps are called in order (the session does)."""

    _registry: Registry
    _core: Registry
    _state: PlannerState
    _has_cache: bool
    _decisions: Mapping[str, Any]
    _carried: set[int]
    _keyed: list[Draft]
    _session_id: str
    _mode: str
    _all_loaded: bool
    _max_args: int
    _max_out: int
    _writes_moved: bool
    _looked_up: dict[str, RegisteredTool | None]
    _asks: bool  # whether a call was found to need the gate (`gated`)
    # [] for a session that records: `parse` keeps there what it read in place
    received: list[tuple[str, str, str] | None] | None

    # -- palette ---------------------------------------------------------------

    def lookup(self, name: str) -> RegisteredTool | None:
        """The tool called `name`, core tools first (asked once per name and batch)."""
        looked_up = self._looked_up
        if name in looked_up:  # not a KeyError: raising one costs more than asking twice
            return looked_up[name]
        found = looked_up[name] = self._core.registered(name) or self._registry.registered(name)
        return found

    def palette(self) -> tuple[str, ...]:
        names = dict.fromkeys(self._core.names())
        names.update(dict.fromkeys(self._registry.names()))
        return tuple(names)

    def _fail(self, d: Draft, status: Status, error: str, **kw: Any) -> None:
        d.decide(failure_result(d.call_id, d.name, status, error, limit=self._max_out, **kw))

    # -- 1. parse, 2. unwrap run_tool --------------------------------------------

    def parse(self, items: Sequence[Any]) -> list[Draft]:
        """Step 1 and 2 for every item. A call id repeated within the batch is that later
        call's `invalid_arguments`: nothing runs for it, and no decision is shared."""
        drafts: list[Draft] = []
        append = drafts.append
        limit = _RAW_SLACK * self._max_args if _IN_PLACE else -1
        received = self.received
        for index, item in enumerate(items):
            # The common item, an OpenAI chat call whose arguments are one JSON object and
            # whose id and name are text, is read here in place, as `_parse_one` reads it:
            # any other item, or text that `parse_json` would not take whole, goes there.
            fn = item.get("function") if type(item) is dict else None
            if (
                type(fn) is dict
                and type(raw := fn.get("arguments")) is str
                and (size := len(raw)) <= limit
                and type(call_id := item.get("id")) is str  # an item without one: `_parse_one`
                and type(name := fn.get("name")) is str
            ):
                try:
                    args, end = _scan_floatless(raw, 0)
                except (StopIteration, ValueError, RecursionError, _HoldsFloat):
                    end = -1
                if end == size and type(args) is dict:
                    planned = name.strip()
                    d = _filled(
                        _new_draft(Draft),
                        index,
                        call_id,
                        _clean_name(planned) if "<|" in planned else planned,
                        args,
                    )
                    d.from_json = True
                    if d.name == RUN_TOOL:
                        self._unwrap_run_tool(d, args)
                    else:
                        d.floatless = True
                    if received is not None:
                        received.append((call_id, name, raw))
                else:
                    d = self._parse_one(index, item)
                    if received is not None:
                        received.append(None)
            else:
                d = self._parse_one(index, item)
                if received is not None:
                    received.append(None)
            append(d)
        if len(drafts) > 1 and len(set(map(_CALL_ID, drafts))) < len(drafts):
            seen: set[str] = set()
            for d in drafts:
                if d.call_id in seen:
                    self._duplicate(d)
                seen.add(d.call_id)
        return drafts

    def _duplicate(self, d: Draft) -> None:
        if d.step == "parsed":
            self._fail(
                d,
                Status.invalid_arguments,
                f"duplicate call id {d.call_id!r}: call ids are unique within a batch",
                retryable=False,
            )
        d.duplicate = True

    def _parse_one(self, index: int, item: Any) -> Draft:
        fn = item.get("function") if type(item) is dict else None
        if type(fn) is dict:
            # the OpenAI chat shape, read directly: the common case needs no ToolCall
            raw_id = item.get("id")
            call_id = "" if raw_id is None else str(raw_id)  # as ToolCall.parse reads it
            name, raw = str(fn.get("name", "")), fn.get("arguments") or {}
        else:
            try:
                call = ToolCall.parse(item)
            except Exception as exc:  # not a call, or one whose keys or attributes raise
                try:
                    call_id = call_id_of(item) or f"call_{index}"
                except Exception:
                    call_id = f"call_{index}"
                d = Draft(index=index, call_id=call_id, name="", args=None)
                self._fail(d, Status.invalid_arguments, f"unreadable tool call: {_unreadable(item, exc)}")
                return d
            call_id, name, raw = str(call.id), str(call.name), call.arguments
        d = Draft(index, call_id, _clean_name(name), None)
        args = self._parse_arguments(d, raw)
        if args is None:
            return d
        d.args = args
        if d.name == RUN_TOOL:
            self._unwrap_run_tool(d, args)
        return d

    def _parse_arguments(self, d: Draft, raw: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
        if raw is None or raw == "":
            return {}
        if not isinstance(raw, str):
            if isinstance(raw, Mapping):
                return dict(raw)  # what it holds is as the caller made it: `from_json` stays

            self._fail(
                d, Status.invalid_arguments, f"arguments must be a JSON object, got {type(raw).__name__}"
            )
            return None
        if len(raw) > _RAW_SLACK * self._max_args:
            # the limit is on canonical JSON (measured in _key); escapes and whitespace can
            # make the raw text several times longer, but never this much
            self._fail(
                d,
                Status.invalid_arguments,
                f"arguments are {len(raw)} characters of JSON, far over the limit of {self._max_args} bytes",
            )
            return None
        try:
            value = parse_json(raw)
        except ValueError as exc:
            self._fail(
                d,
                Status.invalid_arguments,
                f"arguments are not valid JSON: {exc}",
                hint="send the arguments as one JSON object",
            )
            return None
        except RecursionError:
            self._fail(d, Status.invalid_arguments, "arguments nest too deeply to read")
            return None
        if not isinstance(value, dict):
            shown_start = redact_json_text(raw)[0][:80]
            self._fail(
                d,
                Status.invalid_arguments,
                # quoted redacted: a secret cut at the 80th character would not be found whole
                # in the result, so a recording would keep its first part
                f"arguments must be a JSON object, got {type(value).__name__}: {shown_start!r}",
                hint="send the arguments as one JSON object",
            )
            return None
        d.from_json = True
        return value

    def _unwrap_run_tool(self, d: Draft, args: dict[str, Any]) -> None:
        target = args.get("name", args.get("tool_name", args.get("tool")))
        inner = args.get("args", args.get("arguments", args.get("input", {})))
        if not isinstance(target, str) or not target.strip():
            self._fail(
                d,
                Status.invalid_arguments,
                f"run_tool needs the tool's name as a string in 'name', got {target!r}",
                hint='call run_tool(name="<tool>", args={...})',
            )
            return
        target = _clean_name(target)
        if target == RUN_TOOL:
            self._fail(d, Status.invalid_arguments, "run_tool cannot run run_tool")
            return
        d.name = target
        d.via_run_tool = True
        parsed = self._parse_arguments(d, inner)
        d.args = parsed

    # -- 3. rewriters (the session awaits them; this applies one return) -----------

    def apply_rewrite(self, d: Draft, tool_name: str, args: dict[str, Any]) -> None:
        d.name = tool_name
        d.args = args
        d.from_json = d.floatless = False

    # -- 4..7: existence, deferred schemas, dedupe and cache, validation -----------

    def lookups(self, drafts: list[Draft]) -> list[str]:
        """Steps 4 and 5, and the keys of step 6: find each tool, answer deferred schemas,
        key the arguments. Returns the result-cache keys `resolve` may need, each once: the
        session asks the store for all of them in one `get_many`."""
        keyed = self._keyed = []
        in_place = _IN_PLACE and _canonical_chunks is not None
        looked_up, loaded, all_loaded = self._looked_up, self._state.loaded, self._all_loaded
        max_args = self._max_args
        for d in drafts:
            if d.step != "parsed":
                continue
            name = d.name
            # the tool as `lookup` finds it, unless `_resolve_tool` has more to say (no tool,
            # or a deferred one whose schema is not loaded)
            entry = (looked_up.get(name) or self.lookup(name)) if in_place else None
            if entry is None or (entry.tool.deferred and not all_loaded and name not in loaded):
                entry = self._resolve_tool(d)
                if entry is None:
                    continue
            d.entry = entry
            args = d.args
            if (
                in_place
                and args is not None
                and (entry.plain or (entry.cached_plain and not (entry.takes_force and FORCE in args)))
            ):
                # The common call, keyed in place as `_key` keys it: a plain tool (no seams,
                # so no `force` either), or one whose only seam is a cache policy without
                # `when` (and no `force` sent). Arguments that are not JSON, or are too long,
                # go there for its message.
                filled = None
                if entry.defaults:
                    defaults = copy.deepcopy(entry.defaults) if entry.defaults_mutable else entry.defaults
                    filled = {**defaults, **args}
                size = -1
                if d.floatless:
                    try:
                        encoded = orjson.dumps(args, option=_SORT_KEYS)
                        canonical, size = encoded.decode(), len(encoded)
                    except TypeError:  # past 64 bits, a lone surrogate, nested past 255
                        pass
                if size < 0:
                    try:
                        canonical = "".join(_canonical_chunks(args, 0))  # type: ignore[misc]
                        size = len(canonical) if canonical.isascii() else len(canonical.encode())
                    except (TypeError, ValueError, RecursionError):
                        pass
                sent_json = canonical if size >= 0 else None
                if filled is not None and len(filled) != len(args) and size >= 0:
                    # a default filled in: the key is of the filled arguments (had every
                    # default been sent, they would be written as what was sent)
                    try:
                        canonical = "".join(_canonical_chunks(filled, 0))  # type: ignore[misc]
                        size = len(canonical) if canonical.isascii() else len(canonical.encode())
                    except (TypeError, ValueError, RecursionError):
                        size = -1
                key = xxhash.xxh3_128_hexdigest(f"{name}\x00{canonical}".encode()) if size >= 0 else ""
                policy = entry.tool.cache
                cache_key = None
                if policy is not None and 0 <= size <= max_args and self._has_cache:
                    # `_evaluate_seams` of a policy without `when`; a walk that cannot read
                    # the arguments goes there, for its message
                    try:
                        carries = carries_credentials(filled or args)
                    except Exception:
                        size = -1
                    else:
                        if not carries:
                            cache_key = (
                                key
                                if policy.scope == "shared"
                                else xxhash.xxh3_128_hexdigest(f"{key}\x00{self._session_id}".encode())
                            )
                if 0 <= size <= max_args:
                    if policy is not None:  # as `_evaluate_seams` leaves a call of such a tool
                        d.reads = d.writes = NO_RESOURCES
                        d.cacheable = cache_key is not None
                        if cache_key is not None:
                            d.cache_key = cache_key
                    d.sent = args
                    if filled is not None:
                        d.args = filled
                    d.sent_json = sent_json
                    d.key = d.arrived_key = key
                    d.concurrent = entry.tool.concurrent is True
                    d.plain = True  # looked up in place, in the result cache too (`resolve`)
                    keyed.append(d)
                    continue
            if self._key(d, entry):  # the key, for the store's lookup
                keyed.append(d)
        if not self._has_cache:
            return []
        dedupe = self._state.dedupe
        # a call remembered in this run is served from memory, unless a write of this batch
        # touches what it read: then the cache is asked after all
        any_writes = any(d.writes for d in keyed)
        return list(
            dict.fromkeys(
                d.cache_key
                for d in keyed
                if d.cache_key is not None and not d.force and (any_writes or d.key not in dedupe)
            )
        )

    def resolve(self, drafts: list[Draft], cached: Mapping[str, CacheEntry]) -> None:
        """Steps 6 and 7 for the calls `lookups` keyed: dedupe (in the batch and in the run),
        the result cache (`cached`: the store's live entries among the keys asked), schema
        validation, and whether the gate must be asked."""
        batch = _Batch(cached)
        # with no caller's decisions and no cut-short batch to serve, a plain call's
        # LOOKUP is the batch's leaders and the run's successes, taken in place
        in_place = _IN_PLACE and not self._decisions and not self._state.finished
        leaders, pending_writes, dedupe = batch.leaders, batch.pending_writes, self._state.dedupe
        for d in self._keyed:
            d.step = "resolved"  # from "parsed", as every keyed call is
            entry = d.entry
            assert entry is not None
            if d.plain and in_place:
                # `_look_up` for a call that writes nothing and has no `force`
                key = d.key
                assert key is not None
                leader = leaders.get(key)
                if leader is not None:
                    d.leader = leader.index
                    d.step = "following"
                    continue
                found = dedupe.get(key)
                if found is not None and not (
                    pending_writes and resources_overlap(found.reads, pending_writes)
                ):
                    d.step = "decided"
                    d.outcome = _served_again(found.result, d.call_id)
                    continue
                if d.cache_key is not None and (hit := _cached_result(d, cached, pending_writes)) is not None:
                    d.step = "decided"
                    d.outcome = hit
                    continue
                leaders[key] = d
                # `_validate` where jsonschema-rs says valid and is sure to agree
                fast, sent = entry.fast, d.sent
                if (
                    fast is not None
                    and d.from_json
                    and sent is not None
                    and fast_verdict(fast, sent, from_json=True, canonical=d.sent_json)
                ):
                    if entry.tool.confirm is not False:
                        self._confirm(d, entry)
                    continue
                if self._validate(d, entry):
                    self._confirm(d, entry)
                continue
            if self._look_up(d, batch) and self._validate(d, entry):
                self._confirm(d, entry)

    def _check(self, d: Draft, steps: Sequence[Step], batch: _Batch | None = None) -> bool:
        """Take `steps` in order; False once one decided the call (or made it a follower)."""
        entry = d.entry
        assert entry is not None
        for step in steps:
            if step is Step.KEY:
                ok = self._key(d, entry)
            elif step is Step.LOOKUP:
                assert batch is not None
                ok = self._look_up(d, batch)
            elif step is Step.VALIDATE:
                ok = self._validate(d, entry)
            else:
                ok = self._confirm(d, entry)
            if not ok:
                return False
        return True

    def _look_up(self, d: Draft, batch: _Batch) -> bool:
        """Dedupe in the batch (a follower shares its leader's result and decision), then in
        the run and the result cache; a writer instead ends the leadership of what it touches.
        First of all, a call that finished in this batch's earlier, cut-short dispatch is
        served its result, writers included: it ran once (and a writer a stopped worker
        left started gets `stopped_result`: it may have run). Before that, the caller's `Answer`
        is the call's result and its `Deny` refuses it, whatever the tool."""
        if self._decisions and not d.duplicate:
            decision = self._decisions.get(d.call_id)
            if isinstance(decision, Answer):
                self._answer(d, decision)
                return False
            if isinstance(decision, Deny):
                self.deny(d, decision.reason)
                return False
        finished = self._state.finished
        if finished and (done := finished.get(d.call_id)) is not None and done.key in (d.key, STOPPED_KEY):
            served = done.key == d.key
            d.decide(
                _served_again(done.result, d.call_id)
                if served
                else stopped_result(d.call_id, d.name, self._max_out)
            )
            self._carried.add(d.index)
            return False
        if not d.writes:
            leader = None if d.force else batch.leaders.get(d.key or "")
            if leader is not None:
                d.leader = leader.index
                d.advance("following")
                return False
            if not d.force and self._lookup_earlier(d, batch.pending_writes, batch.cached):
                return False
            batch.leaders[d.key or ""] = d
            return True
        batch.pending_writes.extend(d.writes)
        leaders = batch.leaders
        for k in [k for k, ld in leaders.items() if resources_overlap(ld.reads, d.writes)]:
            del leaders[k]
        return True

    def _confirm(self, d: Draft, entry: RegisteredTool) -> bool:
        """Whether the gate must be asked (a predicate that cannot judge the arguments says
        they are wrong)."""
        confirm = entry.tool.confirm
        if confirm is False:
            return True
        try:
            d.confirm = _evaluate(confirm, d.args or {})
            self._asks = self._asks or d.confirm
        except Exception as exc:
            self._fail(
                d,
                Status.invalid_arguments,
                f"{d.name}.confirm could not judge these arguments: {describe(exc)}",
            )
            return False
        return True

    def _resolve_tool(self, d: Draft) -> RegisteredTool | None:
        entry = self.lookup(d.name)
        if entry is None:
            near = _nearest(d.name, self.palette())
            hint = (
                f"did you mean {', '.join(near)}?"
                if near
                else f'call {FIND_TOOLS}(query="...") to find a tool by what it does'
            )
            self._fail(d, Status.rejected, f"Tool not found: {d.name}", hint=hint)
            return None
        tool = entry.tool
        if tool.deferred and not self._all_loaded and d.name not in self._state.loaded:
            if self._mode == "deferred" and not d.via_run_tool:
                self._fail(
                    d,
                    Status.rejected,
                    f"{d.name} is not loaded: its schema must be fetched first",
                    hint=(
                        f'call {FIND_TOOLS}(query="select:{d.name}"), '
                        f'then {RUN_TOOL}(name="{d.name}", args={{...}})'
                    ),
                )
            else:
                how = (
                    f'{RUN_TOOL}(name="{d.name}", args={{...}})' if self._mode == "deferred" else f"{d.name}"
                )
                self._fail(
                    d,
                    Status.schema_required,
                    f"{d.name} was called before its schema was fetched; the schema follows, "
                    "call it again with arguments that match",
                    detail="schema: " + entry.schema_json,
                    hint=f"call {how} again with arguments that match the schema",
                )
            return None
        return entry

    def _key(self, d: Draft, entry: RegisteredTool) -> bool:
        """Take `force` out, fill defaults, canonicalise, measure, key, evaluate the seams.
        What the model sent (`sent`) is what step 7 validates and history keeps; the key
        and the handler see the filled arguments."""
        sent = d.args if d.args is not None else {}
        tool = entry.tool
        if entry.takes_force and FORCE in sent:
            sent = dict(sent)
            d.force = bool(sent.pop(FORCE))
        args = sent
        if entry.defaults:
            defaults = copy.deepcopy(entry.defaults) if entry.defaults_mutable else entry.defaults
            args = {**defaults, **sent}
        d.sent, d.args = sent, args
        try:
            canonical = canonical_json(args)
            d.sent_json = canonical if args is sent or len(args) == len(sent) else canonical_json(sent)
        except (TypeError, ValueError) as exc:
            self._fail(d, Status.invalid_arguments, f"arguments are not JSON-serialisable: {exc}")
            return False
        except RecursionError:
            self._fail(d, Status.invalid_arguments, "arguments nest too deeply (or refer to themselves)")
            return False
        try:
            size = len(canonical) if canonical.isascii() else len(canonical.encode("utf-8"))
        except UnicodeEncodeError as exc:  # a lone surrogate, such as the JSON escape "\ud800"
            bad = canonical[exc.start : exc.end]
            self._fail(
                d,
                Status.invalid_arguments,
                f"arguments hold text that is not valid Unicode: a lone surrogate {bad!r}",
                hint="send well-formed text; escape binary data (base64, for example)",
            )
            return False
        if size > self._max_args:
            self._fail(
                d, Status.invalid_arguments, f"arguments are {size} bytes, over the limit of {self._max_args}"
            )
            return False
        d.key = call_key(d.name, canonical)
        if d.arrived_key is None:
            d.arrived_key = d.key
        if entry.plain:
            d.concurrent = tool.concurrent is True  # a bool when plain
            return True
        try:
            self._evaluate_seams(d, entry, args)
        except _SeamFailed as exc:
            # a seam that cannot read these arguments usually means they are wrong: say so
            if self._validate(d, entry):
                self._fail(
                    d,
                    Status.invalid_arguments,
                    f"{d.name}.{exc.seam} could not judge these arguments: {describe(exc.cause)}",
                )
            return False
        return True

    def _evaluate_seams(self, d: Draft, entry: RegisteredTool, args: Mapping[str, Any]) -> None:
        tool = entry.tool
        seam = "reads"
        try:
            d.reads = _resources(tool.reads, args)
            seam = "writes"
            d.writes = _resources(tool.writes, args)
            seam = "concurrent"
            d.concurrent = _evaluate(tool.concurrent, args)
            seam = "cache.when"
            policy = tool.cache
            d.cacheable = bool(
                policy is not None
                and self._has_cache
                and not d.writes
                and (policy.when is None or policy.when(args))
                and not carries_credentials(args)
            )
        except Exception as exc:
            raise _SeamFailed(seam, exc) from exc
        if d.cacheable and policy is not None and d.key is not None:
            d.cache_key = (
                d.key
                if policy.scope == "shared"
                else xxhash.xxh3_128_hexdigest(f"{d.key}\x00{self._session_id}".encode())
            )

    def _lookup_earlier(self, d: Draft, pending_writes: list[str], cached: Mapping[str, CacheEntry]) -> bool:
        """A success earlier in this run, or in the result cache -> decided, nothing runs."""
        found = self._state.dedupe.get(d.key or "")
        if found is not None and not (pending_writes and resources_overlap(found.reads, pending_writes)):
            d.decide(_served_again(found.result, d.call_id))
            return True
        if d.cache_key is not None and (hit := _cached_result(d, cached, pending_writes)) is not None:
            d.decide(hit)
            return True
        return False

    def _validate(self, d: Draft, entry: RegisteredTool) -> bool:
        args = d.sent if d.sent is not None else (d.args or {})
        fast = entry.fast
        try:
            # jsonschema-rs decides where it is sure to agree; jsonschema is the authority,
            # asked whenever the fast one refuses (and a call it finds no error in is valid)
            verdict = None
            if fast is not None:
                verdict = fast_verdict(fast, args, from_json=d.from_json, canonical=d.sent_json)
            if verdict or (verdict is None and entry.validator.is_valid(args)):
                return True
            errors = _schema_errors(entry, args)
        except RecursionError:  # the validator recurses in Python, far sooner than json does
            self._fail(d, Status.invalid_arguments, "arguments nest too deeply to check against the schema")
            return False
        except referencing.exceptions.Unresolvable as exc:
            # The tool's schema is broken, not the model's arguments: `failed`, and no retry
            # helps (registration logged a local reference that points nowhere; a remote
            # one is never fetched, so it always lands here). Only this call fails.
            self._fail(
                d,
                Status.failed,
                f"the schema of {d.name} refers to {_reference_of(exc)!r}, which cannot be resolved, "
                "so no arguments can be checked against it",
                retryable=False,
                hint=f"{d.name} cannot be called until its schema is fixed; do without it",
            )
            return False
        if not errors:
            return True
        required = entry.tool.parameters.get("required", [])
        self._fail(
            d,
            Status.invalid_arguments,
            f"arguments do not match the schema of {d.name}: " + "; ".join(errors),
            detail=f"required: {', '.join(required)}" if required else None,
            hint=f"call {d.name} again with arguments that match its schema: {entry.schema_json}",
        )
        return False

    # -- 8. the confirm gate -------------------------------------------------------

    def gated(self, drafts: Sequence[Draft]) -> list[Draft]:
        """The calls a gate must answer, in call order."""
        if not self._asks:  # no call of this batch was found to need one
            return []
        return [d for d in drafts if d.step == "resolved" and d.confirm]

    def take_decision(self, d: Draft, decisions: Mapping[str, Any] | None) -> Allow | Deny | None:
        """A caller's decision for this call, if any (an Allow already spent does not count)."""
        if not decisions or d.duplicate:
            return None
        decision = decisions.get(d.call_id)
        if isinstance(decision, Deny):
            return decision
        if isinstance(decision, Allow) and d.call_id not in self._state.spent_approvals:
            d.spent_approval = True
            return decision
        return None

    def _answer(self, d: Draft, answer: Answer) -> None:
        """The caller's (or the gate's) answer is the call's result; nothing runs."""
        content = normalize_output(answer.content, self._max_out)
        d.decide(ToolResult(d.call_id, d.name, Status.ok, content))
        self._carried.add(d.index)

    def answer(self, d: Draft, answer: Answer) -> None:
        """A gate answered the call itself."""
        self._answer(d, answer)

    def deny(self, d: Draft, reason: str) -> None:
        self._fail(d, Status.denied, f"denied: {safe_text(reason)}")

    def allow(self, d: Draft, decision: Allow) -> None:
        if decision.args is None:
            return
        # arguments a gate changed are validated and keyed anew; no dedupe lookup for them
        entry = d.entry
        assert entry is not None
        if not isinstance(decision.args, Mapping):
            self._fail(
                d,
                Status.denied,
                f"denied: the gate approved with arguments that are not an object: {shown(decision.args)}",
            )
            return
        before = d.writes
        d.args = dict(decision.args)
        d.from_json = False
        d.force = False
        key_before = d.key
        self._check(d, PATHS["allow"])
        if d.writes != before or d.key != key_before:
            self._writes_moved = True  # what pass 1 decided from this call is looked at again

    # -- finish: freeze the plan and group the runnable calls ------------------------

    def _reopen_stale(self, drafts: Sequence[Draft]) -> None:
        """An Allow that changed a call's arguments changed what pass 1 decided from them:
        - a follower whose leader now runs with other arguments no longer shares its result;
        - a follower, or an earlier success served again, that reads what a write before it
          now touches runs after all.
        Such a call runs unless its tool needs confirmation: a gate never saw it, so it is
        refused, to be called again."""
        writers: list[tuple[int, frozenset[str]]] = []
        for d in drafts:
            served = d.outcome is not None and (d.outcome.deduped or d.outcome.cached)
            if d.step == "following" and d.leader is not None:
                leader = drafts[d.leader]
                since = [w for i, w in writers if d.leader < i]
                stale = leader.key != d.key or (
                    leader.outcome is None and any(resources_overlap(d.reads, w) for w in since)
                )
            elif d.step == "decided" and served:
                stale = any(resources_overlap(d.reads, w) for _, w in writers)
            else:
                stale = False
            if stale and d.entry is not None:
                d.advance("reopened")
                d.leader, d.outcome = None, None
                if self._check(d, PATHS["reopen"]) and d.confirm:
                    self._fail(
                        d,
                        Status.denied,
                        "a gate changed the arguments of an earlier call, and this call, decided from "
                        "them, now needs a confirmation of its own",
                        retryable=True,
                        hint="call it again",
                    )
            if d.outcome is None and d.leader is None and d.writes:
                writers.append((d.index, d.writes))

    def finish(self, drafts: Sequence[Draft]) -> Plan:
        """Freeze the batch after the gates: calls whose arguments an Allow changed reopen
        what was decided from them (`_reopen_stale`), every call becomes a PlannedCall, and
        the runnable ones are grouped for pass 2 (`group_calls`)."""
        if self._writes_moved:
            self._reopen_stale(drafts)
        calls: list[PlannedCall] = []
        # the runnable calls, while all of them are concurrent and write nothing: then they
        # are one group, as `group_calls` would find (with no write, nothing clashes)
        together: list[int] | None = [] if _IN_PLACE else None
        for d in drafts:
            if d.step in _PLANNED_FROM:
                d.step = "planned"
            else:
                d.advance("planned")  # raises
            index = d.index
            outcome = d.outcome
            leader = d.leader
            writes = d.writes
            concurrent = d.concurrent
            calls.append(
                _planned_call(
                    PlannedCall,
                    (
                        index,
                        d.call_id,
                        d.name,
                        d.args or {},
                        d.entry,
                        outcome,
                        leader,
                        d.key,
                        d.reads,
                        writes,
                        concurrent,
                        d.cache_key if d.cacheable else None,
                        d.spent_approval,
                        d.sent_json,
                    ),
                )
            )
            if together is not None and outcome is None and leader is None:
                if concurrent and not writes:
                    together.append(index)
                else:
                    together = None
        # only an Allow that changed a call's key re-keys it, and that marks writes moved
        rekeyed = (
            {d.index: d.arrived_key for d in drafts if d.arrived_key is not None and d.arrived_key != d.key}
            if self._writes_moved or not _IN_PLACE
            else {}
        )
        groups = group_calls(calls) if together is None else (tuple(together),) if together else ()
        return _plan(tuple(calls), groups, frozenset(self._carried), rekeyed, self.received)


def new_planner(
    registry: Registry,
    core: Registry,
    state: PlannerState,
    has_cache: bool,
    session_id: str,
    mode: str,
    all_loaded: bool,
    max_argument_bytes: int,
    max_output_bytes: int,
    decisions: Mapping[str, Any] | None = None,
    received: list[tuple[str, str, str] | None] | None = None,
) -> Planner:
    """A planner for one batch, without a class call (on 3.11 a call of a function is
    specialized, a class call is not: a third of the cost); `received` as
    `Planner.received`."""
    planner = _new_planner(Planner)
    planner._registry = registry
    planner._core = core
    planner._state = state
    planner._has_cache = has_cache
    planner._decisions = decisions or {}
    planner._carried = set()
    planner._keyed = []
    planner._session_id = session_id
    planner._mode = mode
    planner._all_loaded = all_loaded
    planner._max_args = max_argument_bytes
    planner._max_out = max_output_bytes
    planner._writes_moved = False
    planner._looked_up = {}
    planner._asks = not _IN_PLACE
    planner.received = received
    return planner


_new_planner: Callable[[type[Planner]], Planner] = object.__new__


def group_calls(calls: Sequence[PlannedCall]) -> tuple[tuple[int, ...], ...]:
    """Program order with barriers: consecutive concurrent calls run together, a call without
    the tag runs alone. A concurrent call that touches what an earlier call of its group
    writes, or writes what one of them reads, starts a new group."""
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    group_reads: list[str] = []
    group_writes: list[str] = []
    for c in calls:
        if c.outcome is not None or c.leader is not None:
            continue  # decided in pass 1, or served by its leader
        if not c.concurrent:
            if current:
                groups.append(tuple(current))
                current, group_reads, group_writes = [], [], []
            groups.append((c.index,))
            continue
        reads, writes = c.reads, c.writes
        if reads or writes:  # a call that touches nothing clashes with nothing
            clash = bool(group_writes) and resources_overlap(reads | writes, group_writes)
            clash = clash or (bool(writes) and resources_overlap(writes, group_reads))
            if clash and current:
                groups.append(tuple(current))
                current, group_reads, group_writes = [], [], []
            group_reads.extend(reads)
            group_writes.extend(writes)
        current.append(c.index)
    if current:
        groups.append(tuple(current))
    return tuple(groups)
