"""Recording a session to JSONL, and replaying it offline through the same three passes.

A recording is a header line (format version, registry fingerprint and a hash per tool,
caller's metadata) then one line per committed batch: the calls as given, the gate
decisions, how pass 1 decided each call, and the results. The common batch (no decisions,
every call the OpenAI chat shape with JSON text, nothing to redact) is a `rows` record
(format 3): one array per call, the call, how pass 1 decided it and its result together,
which every reader takes as the `batch` record it stands for (`_batch_of_rows`); its
line is half to two thirds of that record's bytes, and costs half as much to build and
encode. Format 2 recordings, which hold `batch` records only, are read as before, and a
session that goes on with one writes `batch` records into it. Each line is written whole with
one `write`, so a crash can at worst leave a truncated last line; replay reports it and
replays the rest. A batch returns once its line is in the file. With `Recorder.wait` false
it returns once what its record is made of is kept (the calls as pass 1 read them, the
frozen plan and results: nothing the caller can change), and the records of the batches
that follow are gathered with it, made together in one pass and written with one
`write`, on the loop at the end of the batch in which the
first has waited `_GATHER` seconds or of a large one (`_WRITTEN_AT_ONCE` calls), or by
the writer thread once batches stop coming (it
looks every `_GATHER_LONGEST` seconds at most), so a crash loses at most the records of
the last few milliseconds. Once the file is open, and is a regular file, a batch's
line is built, encoded and written on the event loop's thread: a `write` to an open file
costs less than waking a thread and being woken by it. The recorder's own thread opens
the file (which may block: a hung mount), writes to a FIFO, a socket or a terminal (each
waits for its reader), writes the lines that must reach the disk (`fsync`) and those that
need not be waited for, and takes every line for `WRITE_PAUSE` seconds after one written
on the loop took longer than `WRITE_STALL`: a disk that stalls holds the loop up for one
write in every `WRITE_PAUSE`, and otherwise only the batches that wait for it.

Every line carries `seq` (the header 0, each batch the next number) and every batch
`prev`, the xxh3-64 of the previous line's bytes as written: a hash chain, so that a
record deleted, duplicated, moved or edited in the middle of the file is reported with
its line number instead of replaying as if nothing happened. It shows accidents and
careless edits; it is no signature (anyone can recompute it), and the last record has no
successor to vouch for it. Format 1 recordings, made before the chain, still replay,
with a warning that they cannot be checked.

Recording never raises into a batch: a call is recorded as received, whatever it is (a
value JSON cannot hold is written as a tagged placeholder naming its type, with its
repr, which replay turns back into a stand-in that pass 1 decides the same way), and a
record that cannot be written at all ends the recording (`Recorder.problem`, logged
once) while the batch's results still reach the caller.

Replay runs no tool: pass 2's runner serves the recorded result of each call that runs,
the gate answers with the recorded decision, and every result, those pass 1 decided
included, is compared in call order with the recorded one; the first that differs is
reported as a `Divergence`.

No secret is written (`_credentials` says what counts as one): arguments, gate
decisions and the plan's keys are those of the redacted arguments, and each secret of a
batch that a result echoes (at least `MIN_ECHO_LENGTH` characters) is replaced in that
result's text by its marker, and so is a secret of an earlier batch of the recording that
a later result echoes (`chat_history` showing an old result, say: `Recorder._echoed`). A
call's arguments given as JSON text stay that text unless they hold a credential: then
they are written anew from what they hold, redacted (a key given twice included, whose
first value json drops), or, if they do not parse, with the values of credential names
and the credentials of URLs replaced in place by stand-ins of the same length (so that
they fail to parse where they did). Replay treats the calls and results it makes the
same way before comparing, so the same secret matches and a different one diverges. The
file is
created 0600; the chain hashes each line as written, after redaction.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import math
import os
import queue
import stat
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import orjson
import xxhash

from . import _backend
from ._credentials import (
    MIN_ECHO_LENGTH,
    may_hold_credentials,
    redact_call_arguments,
    redact_collecting,
    redact_text,
)
from ._exceptions import DispatchInterrupted, HookBlocked
from ._history import DEFAULT_HISTORY_LIMIT
from ._plan import FIND_TOOLS, STOPPED_KEY, FinishedCall, Plan, PlannedCall, call_key, canonical_json
from ._registry import Registry
from ._results import normalize_output, redacted_json
from ._session import Session
from ._types import (
    Allow,
    Answer,
    Decision,
    Deny,
    Interrupt,
    Status,
    ToolCall,
    ToolContext,
    ToolResult,
    id_text,
    new_result,
)

if TYPE_CHECKING:
    from ._dispatcher import Dispatcher

__all__ = ["FORMAT_VERSION", "Divergence", "Recorder", "ReplayReport", "read_recording", "replay"]

FORMAT_VERSION = 3
_CHAINED_FORMATS = (3, 2)  # 2: before `rows` records
_OLDER_FORMATS = (2, 1)  # read, and gone on with in their own kind of record
_UNCHAINED_FORMAT = 1  # before the hash chain: replayed, with a warning
_PRIVATE_FILE = 0o600
_OPAQUE = "$opaque"  # the tag of a value JSON cannot hold, in a record marked "opaque"

log = logging.getLogger("threepass.recording")
# what json.dumps(default=str) would turn into text, orjson is told to hand to `default` too
_ORJSON_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
_LINE_OPTIONS = _ORJSON_OPTIONS | orjson.OPT_APPEND_NEWLINE  # a line as written


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in `value` (orjson would write them as null), and no
    subclass of float (json writes its number, orjson would hand it to `default`)."""
    if isinstance(value, float):
        return type(value) is float and math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _calls_finite(calls: Any) -> bool:
    """`_finite(calls)`, quick over calls whose arguments are JSON text (no float in them)."""
    if not isinstance(calls, list):
        return _finite(calls)
    for call in calls:
        if type(call) is dict and len(call) == 3 and type(call.get("arguments")) is str:
            continue  # id, name and text
        if not _finite(call):
            return False
    return True


def encode_line(record: Mapping[str, Any], *, finite: bool = False) -> bytes:
    """One record as one line of JSON, the same bytes for the same record: orjson (UTF-8)
    where it can hold the record; where it refuses (a lone surrogate, an integer past 64
    bits) or would change it (NaN, infinity), json with every non-ASCII character escaped,
    so a lone surrogate is kept as "\\ud800", readable back exactly. `finite`: the
    record's calls and decisions are known to hold no float (`_common_rows`')."""
    try:
        if finite or (_calls_finite(record.get("calls")) and _finite(record.get("decisions"))):
            return orjson.dumps(record, default=str, option=_ORJSON_OPTIONS)
    except (TypeError, orjson.JSONEncodeError):
        pass
    return json.dumps(record, ensure_ascii=True, default=str).encode()


def line_hash(line: bytes | memoryview) -> str:
    """The chain's hash of one line as written, without its newline."""
    return xxhash.xxh3_64_hexdigest(line)


# --- values JSON cannot hold ------------------------------------------------------------


def _json_safe(value: Any, secrets: set[str], *, depth: int = 0) -> tuple[Any, bool]:
    """(`value` as JSON can hold it, whether a placeholder stands in somewhere). What JSON
    holds as is stays; a tuple is tagged as one; anything else, a key that JSON would not
    turn into text included, becomes a placeholder naming its type, with its repr
    (credentials in it replaced by markers)."""
    if value is None or isinstance(value, str | bool | int | float):
        return value, False
    if depth > 200:  # deeper than anything a model sends: kept as one placeholder
        return _placeholder(value, secrets), True
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        opaque = False
        for k, v in value.items():
            if isinstance(k, str):
                name = k
            elif k is None or isinstance(k, bool | int | float):
                name = json.dumps(k)  # as json.dumps writes such a key
            else:
                name, opaque = f"{_OPAQUE}:{type(k).__name__}:{_safe_repr(k, secrets)}", True
            out[name], inner = _json_safe(v, secrets, depth=depth + 1)
            opaque = opaque or inner
        return out, opaque
    if isinstance(value, list | tuple):
        items = [_json_safe(v, secrets, depth=depth + 1) for v in value]
        if isinstance(value, list):
            return [v for v, _ in items], any(o for _, o in items)
        # a tuple is a list to JSON, but not in a repr that pass 1 may quote
        return {_OPAQUE: "tuple", "items": [v for v, _ in items]}, True
    return _placeholder(value, secrets), True


def _safe_repr(value: Any, secrets: set[str]) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a repr that fails says so rather than failing the record
        text = f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"
    return redact_text(text, secrets)


def _placeholder(value: Any, secrets: set[str]) -> dict[str, str]:
    return {_OPAQUE: type(value).__name__, "repr": _safe_repr(value, secrets)}


_STAND_INS: dict[str, type] = {}


def _stand_in(type_name: str, text: str) -> Any:
    """An object of a class named `type_name` whose repr is `text`: what pass 1 says about a
    value it cannot use (its type's name, its repr) it says the same about this one."""
    cls = _STAND_INS.get(type_name)
    if cls is None:
        cls = _STAND_INS[type_name] = type(
            type_name,
            (),
            {
                "__slots__": ("_text",),
                "__init__": lambda self, t: object.__setattr__(self, "_text", t),
                "__repr__": lambda self: self._text,
                "__eq__": lambda self, other: type(other) is type(self) and other._text == self._text,
                "__hash__": lambda self: hash(self._text),
                # ordered among themselves only, as keys of one type are and keys of two
                # types are not: sorting keys fails, or not, as it did for the originals
                "__lt__": lambda self, other: (
                    self._text < other._text if type(other) is type(self) else NotImplemented
                ),
            },
        )
    return cls(text)


def _from_json_safe(value: Any) -> Any:
    """`_json_safe`'s output with each placeholder back as a stand-in."""
    if isinstance(value, dict):
        if set(value) == {_OPAQUE, "repr"}:
            return _stand_in(str(value[_OPAQUE]), str(value["repr"]))
        if set(value) == {_OPAQUE, "items"} and value[_OPAQUE] == "tuple":
            return tuple(_from_json_safe(v) for v in value["items"])
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if k.startswith(f"{_OPAQUE}:"):
                _, type_name, text = k.split(":", 2)
                out[_stand_in(type_name, text)] = _from_json_safe(v)
            else:
                out[k] = _from_json_safe(v)
        return out
    if isinstance(value, list):
        return [_from_json_safe(v) for v in value]
    return value


# --- what a batch record holds ------------------------------------------------------------


def _redacted(arguments: Any, secrets: set[str]) -> Any:
    """`arguments` with their credentials replaced by markers (`redact_call_arguments`);
    the secrets go to `secrets`."""
    redacted, found = redact_call_arguments(arguments)
    secrets.update(found)
    return redacted


def _none_may_hold_credentials(texts: list[str]) -> bool:
    """`not any(may_hold_credentials(t) for t in texts)`, in one scan: no piece of the rule
    holds a NUL, so none can match across two texts joined by one."""
    return not texts or not may_hold_credentials("\x00".join(texts))


def _openai_arguments(item: Any) -> str | None:
    """The JSON text of an OpenAI chat call's arguments (None: not that shape)."""
    fn = item.get("function") if type(item) is dict else None
    if type(fn) is dict and type(raw_args := fn.get("arguments")) is str and raw_args:
        return raw_args
    return None


def _call_json(
    item: Any, secrets: set[str], *, raw_args: str | None = None, clean: bool = False
) -> dict[str, Any]:
    """A call as received: its parts when it reads as a call, else `{"raw": ...}`; either
    is marked `"opaque": true` when a placeholder stands in for something in it.
    `raw_args`: its `_openai_arguments`, if known; `clean`: they hold no credential."""
    if raw_args is None:
        raw_args = _openai_arguments(item)
    if raw_args is not None:
        # the OpenAI chat shape with JSON text, read as ToolCall.parse reads it, without one
        fn = item["function"]
        clean = clean or not may_hold_credentials(raw_args)
        arguments_text = raw_args if clean else _redacted(raw_args, secrets)
        return {"id": id_text(item.get("id")), "name": str(fn.get("name", "")), "arguments": arguments_text}
    try:
        call = ToolCall.parse(item)
    except (TypeError, ValueError):
        # a mapping of no known shape may still hold credentials: redacted like arguments
        raw, opaque = _json_safe(_redacted(item, secrets) if isinstance(item, Mapping) else item, secrets)
        return {"raw": raw, "opaque": True} if opaque else {"raw": raw}
    arguments, opaque = _json_safe(_redacted(call.arguments, secrets), secrets)
    recorded = {"id": str(call.id), "name": str(call.name), "arguments": arguments}
    if opaque:
        recorded["opaque"] = True
    return recorded


def _replayed_call(recorded: Mapping[str, Any]) -> Any:
    """What replay hands pass 1 for a recorded call: the call as it was received."""
    if "unreadable" in recorded:  # format 1
        return recorded["unreadable"]
    opaque = bool(recorded.get("opaque"))
    if "raw" in recorded:
        return _from_json_safe(recorded["raw"]) if opaque else recorded["raw"]
    arguments: Any = recorded.get("arguments")  # as received: of any type, as the model sent it
    if type(arguments) is str and arguments and not opaque:
        # JSON text, as most calls come: the OpenAI chat shape, which pass 1 reads directly
        # and exactly as it reads a ToolCall of that text
        name = str(recorded.get("name", ""))
        return {"id": str(recorded.get("id", "")), "function": {"name": name, "arguments": arguments}}
    # a ToolCall, not the dict: reading the dict would take arguments that are false (0,
    # [], False) for none at all, where pass 1 refused them
    if opaque:
        arguments = _from_json_safe(arguments)
    return ToolCall(str(recorded.get("id", "")), str(recorded.get("name", "")), arguments)


def _recorded_key(planned: PlannedCall, secrets: set[str], *, clean: bool = False) -> str | None:
    """The call's key as pass 1 computes it from its redacted arguments: the key a
    recording holds and replay compares. `clean`: `planned.sent` is known to hold no
    credential."""
    tool = planned.tool
    if (
        planned.sent is not None
        and (clean or not may_hold_credentials(planned.sent))
        and (tool is None or not tool.defaults or not _defaults_may_hold_credentials(tool.defaults))
    ):
        return planned.key  # nothing in the arguments to redact: the key pass 1 made
    redacted, found = redact_collecting(planned.args)
    secrets.update(found)
    if planned.key is None:
        return None
    return planned.key if redacted == dict(planned.args) else call_key(planned.name, canonical_json(redacted))


_DEFAULTS_VERDICTS: dict[int, tuple[Mapping[str, Any], bool]] = {}  # by id, the defaults kept alive


def _defaults_may_hold_credentials(defaults: Mapping[str, Any]) -> bool:
    """Whether a tool's schema defaults may hold a credential: asked once per registered
    tool (its defaults are made at registration and never change)."""
    known = _DEFAULTS_VERDICTS.get(id(defaults))
    if known is not None and known[0] is defaults:
        return known[1]
    try:
        verdict = may_hold_credentials(json.dumps(defaults, ensure_ascii=False, default=str))
    except (TypeError, ValueError, RecursionError):
        verdict = True
    if len(_DEFAULTS_VERDICTS) >= 1024:  # registries made by the thousand (tests): start over
        _DEFAULTS_VERDICTS.clear()
    _DEFAULTS_VERDICTS[id(defaults)] = (defaults, verdict)
    return verdict


def _common_rows(
    calls: Sequence[Any],
    planned: Sequence[PlannedCall],
    results: Sequence[ToolResult | None],
    rewritten: bool = True,
    apart: bool = True,
    received: Sequence[tuple[str, str, str] | None] | None = None,
    echoed: frozenset[str] = frozenset(),
) -> list[Any] | orjson.Fragment | None:
    """The rows of the common batch's `rows` record (`_batch_of_rows`), which holds nothing to
    redact: every call the OpenAI chat shape with an id, a name and JSON text, planned and
    answered under that id and name, pass 1's canonical arguments for each, its result a
    `ToolResult` or none, and no credential in any of them (one scan for the whole batch)
    nor in the defaults of their tools. None for any other batch, which `_record_of`
    builds part by part as a `batch` record; `_batch_of_rows` reads these rows back as
    that record. Only when a rewriter may have changed the arguments (`rewritten`) are
    pass 1's scanned too: otherwise they hold no text the calls' own does not
    (unescaped: text with an escape is scanned further anyway). From `_ENCODED_FROM`
    calls, unless not `apart`, the rows are encoded as soon as they are made (`_encoded`),
    so that they are not all alive in the line's record as well. `received` (`Plan.received`):
    per call, its id, name and arguments text as pass 1 read them in place, each known to
    be text, or None; a call of those is not read and checked again (the row holds what was
    planned, should the caller have changed the item since). `echoed`: the secrets of the
    recording's earlier batches; a batch with a result that holds one is no common batch."""
    if not len(calls) == len(planned) == len(results):
        return None
    reads: Iterable[tuple[str, str, str] | None] = (
        itertools.repeat(None) if received is None or len(received) != len(calls) else received
    )
    tools: set[int] | None = None  # asked about their defaults
    rows: list[Any] = []
    append = rows.append
    # as long as each other: see above
    for item, p, r, read in zip(calls, planned, results, reads, strict=False):
        _, _, planned_name, _, tool, outcome, leader, key, _, _, _, _, _, sent = p
        if sent is None or type(planned_name) is not str:
            return None
        if read is not None:  # read in place by pass 1 (an object, so never empty text)
            call_id, name, raw = read
        else:
            try:
                fn = item["function"]
                call_id, name, raw = item["id"], fn["name"], fn["arguments"]
            except (KeyError, TypeError):  # not the OpenAI shape
                return None
            if (
                type(item) is not dict
                or type(fn) is not dict
                or type(raw) is not str
                or not raw
                or type(call_id) is not str
                or type(name) is not str
            ):
                return None
        how = ("unfinished" if r is None else "ran") if leader is None and outcome is None else _how(p, r)
        row: list[Any]
        if r is None:
            row = [call_id, name, raw, key, how]
        elif (
            type(r) is ToolResult
            and r.call_id == call_id
            and r.name == planned_name
            and type(r.status) is Status
            and type(r.content) is str  # a runner's may be anything: the general builder says why
        ):
            row = [
                call_id,
                name,
                raw,
                key,
                how,
                r.status,  # orjson writes an enum's value
                r.content,
                r.retryable,
                r.effect_uncertain,
                r.cached,
                r.deduped,
                r.started,
                r.duration,
            ]
        else:  # a subclass of ToolResult, which may say more in its to_json; another id or name
            return None
        if planned_name != name:  # `run_tool`'s call, planned and answered as the tool it names
            row.append(planned_name)
        append(row)
        if tool is not None and tool.defaults and (tools is None or id(tool) not in tools):
            if _defaults_may_hold_credentials(tool.defaults):
                return None
            tools = tools or set()
            tools.add(id(tool))
    if echoed and _echoes(results, echoed):
        return None
    scanned = "\x00".join(map(_ARGUMENTS, rows))
    if rewritten:
        scanned += "\x00" + "\x00".join(map(_SENT, planned))
    if may_hold_credentials(scanned):  # as `_none_may_hold_credentials`
        return None
    if apart and len(rows) >= _ENCODED_FROM:
        return _encoded(rows)
    return rows


def _echoes(results: Sequence[ToolResult | None], secrets: frozenset[str]) -> bool:
    """Whether a result's text holds one of `secrets`."""
    return any(secret in r.content for r in results if r is not None for secret in secrets)


_ARGUMENTS = itemgetter(2)  # of a row
_SENT = attrgetter("sent")  # of a planned call


def _rows_record(
    run_id: int, round: int, all_loaded: bool, rows: Any, control: BaseException | None
) -> dict[str, Any]:
    """The common batch's `rows` record of `rows` (`_common_rows`), less `seq` and `prev`."""
    return {
        "type": "rows",
        "run": run_id,
        "round": round,
        "all_loaded": all_loaded,
        "rows": rows,
        "control": None if control is None else type(control).__name__,
    }


def _common_record(
    run_id: int,
    round: int,
    calls: Sequence[Any],
    planned: Sequence[PlannedCall],
    received: Sequence[tuple[str, str, str] | None] | None,
    results: Sequence[ToolResult | None],
    control: BaseException | None,
    all_loaded: bool,
    rewritten: bool,
    echoed: frozenset[str] = frozenset(),
) -> dict[str, Any] | None:
    """The common batch's `rows` record (`_common_rows`), less `seq` and `prev`, or None
    for any other batch; `planned` and `received` its plan's (`Plan.calls`, `Plan.received`).
    Its rows are encoded apart only when orjson takes the rest of the
    record too (a run or round past 64 bits, from a snapshot say, would send it to json,
    which cannot write a fragment)."""
    apart = type(run_id) is type(round) is int and run_id in _ORJSON_INTS and round in _ORJSON_INTS
    rows = _common_rows(calls, planned, results, rewritten, apart, received, echoed)
    return None if rows is None else _rows_record(run_id, round, all_loaded, rows, control)


class _Unbuilt(NamedTuple):
    """A common batch's record gathered before it is made (`Recorder._gather`): every call
    was read in place by pass 1 (`Plan.received`), so nothing its record is made of is the
    caller's to change (the planned calls and the results are frozen; the ids, names and
    arguments are the text pass 1 read). Made where the records gathered are written
    (`_made`), in one go with those beside it, rather than once at the end of every batch.
    It holds only what the record is made of (not the plan: the fewer objects a batch
    leaves alive until its line is written, the fewer garbage collections it sets off)."""

    run_id: int
    round: int
    received: Sequence[tuple[str, str, str] | None]
    planned: tuple[PlannedCall, ...]
    results: Sequence[ToolResult | None]
    control: BaseException | None
    all_loaded: bool
    rewritten: bool


_new_unbuilt: Callable[[type[_Unbuilt], tuple[Any, ...]], _Unbuilt] = tuple.__new__
"""`_Unbuilt(*parts)` without the named tuple's Python `__new__` (one a batch)."""


def _made(
    unbuilt: _Unbuilt, echoed: frozenset[str] = frozenset(), found: set[str] | None = None
) -> tuple[dict[str, Any], bool]:
    """The record of a batch gathered unbuilt, as `Recorder._record_of` makes it of the
    batch (`echoed`, `found`: its own): the common `rows` record, else (a credential in
    the arguments, a result of another kind) the batch record, its calls those pass 1
    read, in the OpenAI chat shape (which is all the batch record keeps of such a call)."""
    run_id, round, received, planned, results, control, all_loaded, rewritten = unbuilt
    # the calls themselves are not read: every one was read in place (`received`)
    record = _common_record(
        run_id, round, received, planned, received, results, control, all_loaded, rewritten, echoed
    )
    if record is not None:
        return record, True
    calls = [  # as `_copied_calls` copies them
        {"id": read[0], "function": {"name": read[1], "arguments": read[2]}}
        for read in received
        if read is not None
    ]
    plan = Plan(planned, (), received=received)  # what the batch record reads of it
    return Recorder._record_of(
        run_id, round, calls, plan, results, {}, control, all_loaded, rewritten, echoed=echoed, found=found
    )


def _made_together(
    gathered: Sequence[_Gathered], echoed: frozenset[str] = frozenset()
) -> Sequence[_Gathered]:
    """`gathered` with the records of its `_Unbuilt` batches made together, when every one of
    them is common: `_common_rows` of all their calls as though they were one batch (one
    pass, one credential scan), each batch's record then given its own rows: the same
    records `_made` makes one by one. A batch of `_ENCODED_FROM` calls or more is left
    for `_made` (its rows are encoded apart: text orjson refuses sends it to the batch
    record), and so is every one when they are not all common."""
    received: list[tuple[str, str, str] | None] = []
    planned: list[PlannedCall] = []
    results: list[ToolResult | None] = []
    rewritten = False  # a batch's arguments as sent are scanned if any batch's may hold more
    together: list[tuple[int, _Unbuilt]] = []  # where each batch made here is, and it
    for i, g in enumerate(gathered):
        if type(g) is _Unbuilt and len(g[4]) < _ENCODED_FROM:
            # its fields read at once (a named tuple's field read by name is the generic lookup)
            _, _, its_received, its_planned, its_results, _, _, its_rewritten = g
            received += its_received
            planned += its_planned
            results += its_results
            rewritten = rewritten or its_rewritten
            together.append((i, g))
    if len(together) < 2:
        return gathered
    rows = _common_rows(received, planned, results, rewritten, False, received, echoed)
    if type(rows) is not list:
        return gathered
    made: list[_Gathered] = list(gathered)
    at = 0
    for i, (run_id, round, _, _, its_results, control, all_loaded, _) in together:
        size = len(its_results)
        made[i] = (_rows_record(run_id, round, all_loaded, rows[at : at + size], control), True)
        at += size
    return made


_Gathered = tuple[dict[str, Any], bool] | _Unbuilt
"""A record gathered (with whether `_common_rows` built it), or a batch's `_Unbuilt`."""


_ENCODED_FROM = 16  # calls in a batch from which `_common_rows` encodes its rows at once
_ORJSON_INTS = range(-(2**63), 2**64)  # the integers orjson writes


def _encoded(rows: list[Any]) -> orjson.Fragment | None:
    """`rows` as `encode_line` writes them within the line; None when orjson refuses them
    (a lone surrogate), which the record built part by part encodes otherwise."""
    try:
        return orjson.Fragment(orjson.dumps(rows, default=str, option=_ORJSON_OPTIONS))
    except TypeError:  # orjson.JSONEncodeError is one
        return None


def _how(planned: PlannedCall, result: ToolResult | None) -> str:
    if planned.leader is not None:
        return "follow"
    if planned.outcome is not None:
        if planned.outcome.deduped:
            return "deduped"
        if planned.outcome.cached:
            return "ran"  # a cache hit then is a run now, when the cache may be empty
        if planned.outcome.effect_uncertain:
            return "stopped"  # a writer a stopped worker left started
        return planned.outcome.status.value
    return "ran" if result is not None else "unfinished"


def _decision_json(decision: Decision, secrets: set[str]) -> dict[str, Any]:
    if isinstance(decision, Allow):
        args = None if decision.args is None else _json_safe(_redacted(decision.args, secrets), secrets)[0]
        return {"allow": args}
    if isinstance(decision, Deny):
        return {"deny": str(decision.reason)}
    if isinstance(decision, Answer):
        return {"answer": redact_text(normalize_output(decision.content), secrets)}
    if isinstance(decision, Interrupt):
        return {"interrupt": str(decision.reason)}
    return {"deny": f"not a decision: {_safe_repr(decision, secrets)}"}


def _tool_hashes(registry: Registry) -> dict[str, list[str]]:
    """Per tool, the xxh3-64 of its description and of its whole schema: what lets replay
    say which tool changed, and how, when the fingerprint differs."""
    hashes: dict[str, list[str]] = {}
    for name in sorted(registry.names()):
        entry = registry.registered(name)
        if entry is not None:
            description = entry.tool.description.encode("utf-8", "surrogatepass")
            hashes[name] = [
                line_hash(description),
                line_hash(entry.schema_json.encode("utf-8", "surrogatepass")),
            ]
    return hashes


_IDLE_SECONDS = 1.0  # a writer thread with nothing to write ends after this long
_CLOSE_WAIT = 5.0  # how long `close()` (and the interpreter's exit) waits for a stalled disk
_LINGER = 0.002  # with `wait=False`, how long a writer gathers lines before it writes them
_GATHER = 0.002  # with `wait=False`, how long records gathered on the loop wait to be written
_GATHERED_MOST = 256  # ... or how many of them
_WRITTEN_AT_ONCE = 64  # calls in a batch whose record is written as it ends, where the loop can:
# one `write` a batch costs little beside that many calls, a thread woken to watch costs more
_GATHER_LONGEST = 0.02  # how often the writer thread looks at them while batches keep coming
_MOST_QUEUED = 1000  # with `wait=False`, lines waiting to be written before batches wait again
WRITE_STALL = 0.1
"""A line written on the event loop that takes longer than this (seconds) sends lines to
the writer thread for `WRITE_PAUSE`."""
WRITE_PAUSE = 10.0
"""... for this long (seconds): a disk that stalls holds the loop up once in every
`WRITE_PAUSE`, for as long as that one write waits."""


def _nobody() -> None:
    """The wake of a batch that did not wait."""


def _copied_calls(calls: Sequence[Any], decisions: Mapping[str, Any]) -> list[Any] | None:
    """The calls of a batch copied as the recorder reads them, for a writer that reads them
    after the batch returned and the caller may have changed them; None when that copy is
    not cheap (a call of another shape, arguments that are not text, decisions)."""
    if decisions:
        return None
    copied: list[Any] = []
    try:
        for item in calls:
            if (raw := _openai_arguments(item)) is not None:
                name = str(item["function"].get("name", ""))
                copied.append({"id": id_text(item.get("id")), "function": {"name": name, "arguments": raw}})
            elif type(item) is ToolCall and type(item.arguments) is str:
                copied.append(item)  # frozen, and its arguments text
            else:
                return None
    except Exception:  # an id or name whose str() raises: the batch waits, and the writer says why
        return None
    return copied


def _batch(
    run_id: int,
    round: int,
    calls: Sequence[Any],
    plan: Plan,
    results: Sequence[ToolResult | None],
    decisions: Mapping[str, Decision],
    control: BaseException | None,
    all_loaded: bool,
    rewritten: bool,
) -> dict[str, Any]:
    """A batch's parts as the writer thread's job holds them (`Recorder._record_of`'s keywords)."""
    return {
        "run_id": run_id,
        "round": round,
        "calls": calls,
        "plan": plan,
        "results": results,
        "decisions": decisions,
        "control": control,
        "all_loaded": all_loaded,
        "rewritten": rewritten,
    }


class _Job(NamedTuple):
    """One job of a writer thread: a batch to record (None: only `wake` when it gets here),
    or `records` made already (those gathered on the loop, `Recorder._gather`), or a
    `poke`: records were gathered, and are the thread's to write should no batch end within
    `_GATHER` seconds (a poke is not counted among the jobs not done)."""

    batch: Mapping[str, Any] | None
    wake: Callable[[], object]
    closing: bool = False
    records: list[_Gathered] | None = None
    poke: bool = False


_RECORDERS: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _drain_at_exit() -> None:
    """At the interpreter's exit, the lines handed over to writer threads reach the file."""
    for recorder in list(_RECORDERS):
        recorder._drain(_CLOSE_WAIT)


def _after_fork_in_child() -> None:
    for recorder in list(_RECORDERS):
        recorder._forked()


atexit.register(_drain_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Recorder:
    """Appends a session's batches to a JSONL file, each line chained to the one before.
    A session hands each batch to `submit`, which writes its line on the loop's thread or
    hands it to the recorder's own writer thread (the module says when)."""

    def __init__(
        self,
        path: Path,
        *,
        registry: Registry,
        session_id: str,
        mode: str,
        meta: Mapping[str, Any] | None = None,
        fsync: bool = False,
        wait: bool = True,
    ) -> None:
        """`fsync`: each batch's line reaches the disk before the batch returns (slower;
        without it the line is in the file when the batch returns and the system writes it
        out). `wait=False`: a batch returns once its record's parts are kept (`_gather`), written
        within milliseconds with those of the batches after it; a crash can then lose the
        records of the last few milliseconds, never corrupt the file, and `close()` waits
        for them. A batch of another shape is handed to the writer thread with its calls
        copied, if they copy cheaply; a batch whose calls do not, or that carries
        decisions, still waits; so does every batch with `fsync`, and once `_MOST_QUEUED`
        lines wait to be written."""
        self.path = path
        self._header: dict[str, Any] = {
            "type": "header",
            "format": FORMAT_VERSION,
            "seq": 0,
            "fingerprint": registry.fingerprint(),
            "tools": _tool_hashes(registry),
            "session": session_id,
            "mode": mode,
            "meta": dict(meta or {}),
        }
        self._seq: int | None = None  # of the last line written; None until the file is read or begun
        self._prev = ""
        self._rows = True  # the file's readers know `rows` records (not a file of format 2 gone on with)
        self._resume: tuple[int, str, int] | None = None  # another worker's chain position
        self.problem: Exception | None = None
        self.fsync = fsync
        self.wait = wait
        self._fd: int | None = None  # open for the session, between batches too
        self._named_fd: int | None = None  # `_fd`, just now seen still named
        self._fd_regular = False  # `_fd` is a regular file (not a FIFO, a socket, a terminal)
        # the secrets the recording's batches held so far, redacted wherever a later result
        # echoes them (replaced whole, never changed in place: the writer thread reads it)
        self._echoed: frozenset[str] = frozenset()
        self._closer: weakref.finalize[Any, Any] | None = None
        self._writer_state()
        _RECORDERS.add(self)

    def _writer_state(self) -> None:
        """No writer thread yet, nothing handed to one (also a forked child's fresh start)."""
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._unwritten = 0  # jobs handed to the writer and not yet done (records, each one)
        self._here_until = 0.0  # monotonic time before which no line is written on the loop
        # with `wait=False`, the records gathered on the loop and not yet written (`_gather`),
        # and when the first of them was
        self._gathered: list[_Gathered] = []
        self._gathered_since = 0.0
        self._last_gathered = 0.0  # monotonic time a record was last gathered
        self._watching = False  # the writer thread looks at them in a while (`_look_at_gathered`)
        self._turn = _backend.GilTurn()  # ... and takes its turn at the GIL at a batch's end

    def submit(
        self,
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        decisions: Mapping[str, Decision],
        control: BaseException | None,
        all_loaded: bool = False,
        rewritten: bool = True,
    ) -> Callable[[], Awaitable[Any]] | None:
        """Record a batch, from the loop: `record_batch` here (see `_write_here`), or handed
        to this recorder's writer thread. What to call and await until the line is written
        (synced, with `fsync`), or None when there is nothing to wait for (the line is
        written, or the batch need not wait: see `wait`). Never raises: a writer that
        cannot start stops the recording. The parts come one by one, not as a mapping:
        this is every batch's path, and the thread's job is the only one that needs one."""
        if self.problem is not None:
            return None  # the recording stopped: nothing to write, nothing to wait for
        if not (self.wait or self.fsync) and self._unwritten + len(self._gathered) < _MOST_QUEUED:
            if not decisions and self._gather(
                run_id, round, calls, plan, results, control, all_loaded, rewritten
            ):
                return None
            copied = _copied_calls(calls, decisions)
            if copied is not None:
                parts = (run_id, round, copied, plan, results, decisions, control, all_loaded, rewritten)
                self._hand_over(_Job(_batch(*parts), _nobody))
                return None
        if (
            self._fd is not None
            and self._fd_regular
            and not self.fsync
            and self._unwritten == 0
            and time.monotonic() >= self._here_until
            and self._write_here(
                run_id, round, calls, plan, results, decisions, control, all_loaded, rewritten
            )
        ):
            return None
        written = _backend.primitives().event()
        post = _backend.poster()
        batch = _batch(run_id, round, calls, plan, results, decisions, control, all_loaded, rewritten)
        if not self._hand_over(_Job(batch, lambda: post(written.set))):
            return None
        waiting: Callable[[], Awaitable[Any]] = written.wait
        return waiting

    def _write_here(
        self,
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        decisions: Mapping[str, Decision],
        control: BaseException | None,
        all_loaded: bool,
        rewritten: bool,
    ) -> bool:
        """Build and write a batch's line on the loop's thread, if the file it goes to is open
        and still named (False: it is not, and the writer thread opens the file anew). A
        `write` to a regular file already open, which the system takes into memory at once,
        costs less than waking the writer thread and being woken by it; opening a file,
        which may block (a hung network mount), and writing to a FIFO, a socket or a
        terminal, which waits for its reader, are left to the thread. Should the line take
        over `WRITE_STALL` seconds (a disk that stalls), batches go to the writer thread
        for `WRITE_PAUSE`."""
        began = time.monotonic()
        with self._writer_lock:  # nothing else writes meanwhile, not even a drain at exit
            fd = self._named_now()
            if fd is None:
                return False
            if self._unwritten:
                # `submit` found no job before this batch, but it asked without the lock: the
                # writer thread may have taken the records gathered as its job since
                # (`_look_at_gathered`), and writes them, unlocked; this batch goes after them
                return False
            if self._gathered:  # gathered while `wait` was false: numbered before this batch
                self._write_gathered(fd)
                if self.problem is not None:
                    return True
            line = None
            if not decisions and self._rows and self._seq is not None:  # `submit` asked of `problem`
                line = self._common_line(run_id, round, calls, plan, results, control, all_loaded, rewritten)
            if line is not None:
                seq, encoded = line
                try:
                    self._write(fd, encoded, seq, line_hash(memoryview(encoded)[:-1]))
                except Exception as exc:  # OSError: a full disk, a folder gone
                    self._stop(exc, close=True)
            else:
                self._named_fd = fd  # `_open` need not look again
                try:
                    self.record_batch(
                        run_id, round, calls, plan, results, decisions, control, all_loaded, rewritten
                    )
                finally:
                    self._named_fd = None
        self._stalled_since(began)
        return True

    def _stalled_since(self, began: float) -> None:
        """After lines written on the loop's thread from `began` (monotonic): should that have
        taken over `WRITE_STALL`, lines go to the writer thread for `WRITE_PAUSE`."""
        took = time.monotonic() - began
        if took > WRITE_STALL:
            self._here_until = began + WRITE_PAUSE
            log.info(
                "the recording %s took %.1f ms to take lines on the event loop: lines go to "
                "its writer thread for %g s",
                self.path,
                took * 1e3,
                WRITE_PAUSE,
            )

    def _common_line(
        self,
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        control: BaseException | None,
        all_loaded: bool,
        rewritten: bool,
    ) -> tuple[int, bytes] | None:
        """(seq, line ending in its newline) of the common batch's `rows` record, numbered
        and chained after the last line, as `record_batch` would write it, built and
        encoded in one go; None for any other batch (and for one whose record orjson
        cannot write), which `record_batch` takes."""
        try:
            rows = _common_rows(calls, plan.calls, results, rewritten, False, plan.received, self._echoed)
            if rows is None:
                return None
            assert self._seq is not None
            seq = self._seq + 1
            record = _rows_record(run_id, round, all_loaded, rows, control)
            record["seq"], record["prev"] = seq, self._prev
            return seq, orjson.dumps(record, default=str, option=_LINE_OPTIONS)
        except Exception:  # what orjson refuses, and whatever else: `record_batch` says why
            return None

    def _write(self, fd: int, data: bytes, seq: int, prev: str) -> None:
        """Write `data`, the lines up to record `seq` whose line hashes to `prev`, whole (and
        sync it, with `fsync`); OSError if the file takes it not."""
        # before the write: a KeyboardInterrupt on the loop's thread that comes while the
        # line is being written is raised as the write returns, and the line it left in
        # the file must not be numbered again by the next record
        self._seq, self._prev = seq, prev
        written = os.write(fd, data)
        while written < len(data):  # a short write (a signal, a nearly full disk): the rest
            written += os.write(fd, data[written:])
        if self.fsync:
            os.fsync(fd)

    def _hand_over(self, job: _Job) -> bool:
        try:
            self._put(job)
        except Exception as exc:  # no thread to be had (a limit, or the interpreter exiting)
            self._stop(exc)
            return False
        return True

    def _put(self, job: _Job) -> None:
        with self._writer_lock:
            self._hand_gathered()  # first: they came before this job
            self._unwritten += 1
            self._jobs.put(job)
            try:
                self._start_writer()
            except BaseException:
                self._unwritten -= 1
                self._jobs.get_nowait()
                raise

    def _hand_gathered(self) -> None:
        """Under `_writer_lock`: the records gathered on the loop, as the writer thread's next
        job (after every job handed over before them, which they came after)."""
        gathered = self._gathered
        if gathered:
            # the job made first, then nothing that calls Python code until it is queued: an
            # interrupt (a KeyboardInterrupt on the loop's thread) lands before the records
            # leave `_gathered` or once they are in the queue, never between
            job, count = _Job(None, _nobody, records=gathered), len(gathered)
            self._gathered = []
            self._unwritten += count
            self._jobs.put(job)
            try:
                self._start_writer()
            except BaseException:
                self._unwritten -= count
                self._jobs.get_nowait()
                self._gathered = gathered
                raise

    def _start_writer(self) -> None:
        """Under `_writer_lock`: a writer thread for the jobs just put, if none runs."""
        if self._writer is None:
            writer = threading.Thread(target=self._write_jobs, name="threepass-recording", daemon=True)
            writer.start()
            self._writer = writer

    def _gather(
        self,
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        control: BaseException | None,
        all_loaded: bool,
        rewritten: bool,
    ) -> bool:
        """With `wait` false: the common batch's record (`_common_rows`) gathered with those
        before it, to be numbered, encoded and written together with one `write` (made
        there too, in one pass with those beside it, when pass 1 read every call in place:
        `_Unbuilt`; else made here): on the loop, at the end of the batch in which the
        first of them has waited `_GATHER` seconds, or of a batch of `_WRITTEN_AT_ONCE`
        calls or more (once the file is open, a regular file, and the writer thread has
        nothing left to do), or else by the writer thread, which the first of them left
        gathered pokes. The batch returns at once: the caller may change its calls
        afterwards, which its record does not read. False for any other batch, which goes to the writer
        thread as before (`_copied_calls`)."""
        entry: _Gathered
        received = plan.received
        if received is not None and len(received) == len(calls) and None not in received:
            # every call read in place by pass 1: made where it is written, with those beside it
            # (`_common_rows` checks then that there is a planned call and a result for each)
            entry = _new_unbuilt(
                _Unbuilt, (run_id, round, received, plan.calls, results, control, all_loaded, rewritten)
            )
        else:
            try:
                record = _common_record(
                    run_id,
                    round,
                    calls,
                    plan.calls,
                    plan.received,
                    results,
                    control,
                    all_loaded,
                    rewritten,
                    self._echoed,
                )
            except Exception:  # what the writer thread would say, and does
                return False
            if record is None:
                return False
            entry = (record, True)
        # the writer thread, due to look at those gathered before (or poked by the last batch)
        # and not yet run, runs now: beside a loop that keeps the GIL it would wait long for it
        self._turn.take_if_due()
        now = time.monotonic()
        with self._writer_lock:
            gathered = self._gathered
            gathered.append(entry)
            self._last_gathered = now
            if len(gathered) == 1:
                self._gathered_since = now
            if (
                len(calls) >= _WRITTEN_AT_ONCE
                or (len(gathered) > 1 and now - self._gathered_since >= _GATHER)
                or len(gathered) >= _GATHERED_MOST
            ) and self._loop_writes(now):
                self._write_gathered_here()
            if self._gathered and not self._watching:  # none left (written): nothing to watch
                try:  # the thread writes them should no batch end meanwhile
                    self._jobs.put(_Job(None, _nobody, poke=True))
                    self._start_writer()
                except Exception:  # no thread to be had: the batch waits for its line after all
                    with contextlib.suppress(Exception):
                        self._jobs.get_nowait()
                    if self._gathered and self._gathered[-1] is entry:
                        self._gathered.pop()
                        return False
                    return True  # written already, with those before it
                self._watching = True
                self._turn.woken()  # it runs when the loop next waits, or is given way to
        return True

    def _loop_writes(self, now: float) -> bool:
        """Under `_writer_lock`: whether the records gathered may be written on the calling
        thread now: the file open and a regular file, no job before them, no disk stalled."""
        return self._unwritten == 0 and self._fd is not None and self._fd_regular and now >= self._here_until

    def _write_gathered_here(self) -> None:
        """Under `_writer_lock`, on the loop's thread: the records gathered written, unless
        the file was removed or replaced since (a new one is opened: the writer thread's to
        do); a write that takes over `WRITE_STALL` sends lines to the thread for `WRITE_PAUSE`."""
        fd = self._named_now()
        if fd is None:
            try:
                self._hand_gathered()
            except Exception as exc:  # no thread to be had
                self._stop(exc)
            return
        began = time.monotonic()
        self._write_gathered(fd)
        self._stalled_since(began)

    def _named_now(self) -> int | None:
        """The file's descriptor, if it is open and still named (one `fstat`: a file renamed
        over it unlinks it), else None."""
        fd = self._fd
        try:
            return fd if fd is not None and os.fstat(fd).st_nlink > 0 else None
        except OSError:
            return None

    def _write_gathered(self, fd: int) -> None:
        """Under `_writer_lock`, on the loop's thread, `fd` the file, open and just seen still
        named: the records gathered numbered, encoded and written. An interrupt that lands meanwhile (a
        KeyboardInterrupt, raised on the loop's thread wherever its handler runs: while
        the records are encoded, say) leaves them gathered if none was written, for the
        next batch, `flush()` or `close()` to write: `_write` numbers the chain on just
        before its `write`, so a `_seq` unchanged says no line of theirs reached the file,
        and one changed that they all did (an interrupt raised as the write returns)."""
        gathered, self._gathered = self._gathered, []
        if not gathered:
            return
        seq = self._seq
        self._named_fd = fd  # `_open` need not look again
        try:
            self._append_all(gathered)
        except BaseException:
            if self._seq == seq and self.problem is None:
                self._gathered = gathered + self._gathered
            raise
        finally:  # an interrupt included: a later `_open` must look at the file again
            self._named_fd = None

    def _write_jobs(self) -> None:
        """The writer thread: build, encode, hash and write the batches handed over, in
        order, every one already waiting with one `write`; end after `_IDLE_SECONDS` with
        nothing to write (the next batch starts another). Daemonic, so a stalled disk never
        holds up the interpreter's exit; `close()` and the exit handler wait for what was
        handed over."""
        burst: list[_Job] = []
        try:
            self._write_jobs_in(burst)
        except BaseException as exc:
            # a fault of this thread's own (not a write's, which stops the recording where it
            # fails): nothing more is written, and every batch waiting for a line is told,
            # rather than left waiting for a thread that is gone
            with self._writer_lock:
                self._writer, self._watching, self._unwritten = None, False, 0
                while True:
                    try:
                        burst.append(self._jobs.get_nowait())
                    except queue.Empty:
                        break
            self._stop(exc if isinstance(exc, Exception) else RuntimeError(f"its writer ended: {exc!r}"))
            for job in burst:
                with contextlib.suppress(Exception):
                    job.wake()

    def _write_jobs_in(self, burst: list[_Job]) -> None:
        """`_write_jobs`, each burst taken into `burst` (what is there when it raises is
        what it had not told)."""
        jobs = self._jobs
        look: float | None = None  # watching the records gathered: when to look at them next
        turn = self._turn
        while True:
            turn.waiting(math.inf if look is None else time.monotonic() + look)
            try:
                burst.append(jobs.get(timeout=_IDLE_SECONDS if look is None else look))
            except queue.Empty:
                turn.running()
                if look is not None:
                    look = self._look_at_gathered()
                    continue
                with self._writer_lock:
                    if jobs.empty() and not self._watching:
                        self._writer = None
                        return
                continue
            turn.running()
            while True:
                try:
                    burst.append(jobs.get_nowait())
                except queue.Empty:
                    break
            if look is None and any(job.poke for job in burst):
                look = _GATHER
            self._write_burst(burst)
            burst.clear()
            if look is None and not self.wait and jobs.empty():
                # batches that do not wait come in while this thread sleeps, and are taken
                # together: the loop does not wake it for every one
                time.sleep(_LINGER)

    def _look_at_gathered(self) -> float | None:
        """The writer thread, watching the records gathered on the loop: once none has been
        gathered for `_GATHER` (no batch ended to write them), or once the first has waited
        that long where the loop cannot write them, they become its next job. Poked, it
        looks `_GATHER` later (a batch alone, then the loop waiting, is written at once),
        then every `_GATHER_LONGEST` (while batches keep ending the loop writes them, and a
        thread that wakes beside a busy loop costs the loop its turn at the GIL), until none
        has been gathered for that long. How long to wait before looking again, or None: it
        watches no more (the next record gathered pokes it)."""
        with self._writer_lock:
            now = time.monotonic()
            # the loop writes them at a batch's end once it can (see `_gather`); until then
            # (the file not yet open, or no regular file, jobs before them, a disk that
            # stalled), this thread takes every record that has waited `_GATHER`
            since = self._last_gathered if self._loop_writes(now) else self._gathered_since
            if self._gathered and now - since >= _GATHER:
                self._hand_gathered()  # this thread's next job
            elif now - self._last_gathered >= _GATHER_LONGEST:
                self._watching = False  # none for a while: the next one pokes
                return None
        return _GATHER_LONGEST

    def _write_burst(self, burst: list[_Job]) -> None:
        """Write the jobs of `burst` in order, then tell each that it is done (a closing job
        closes the file after the lines before it are written)."""
        records: list[_Gathered] = []
        done: list[_Job] = []
        try:
            for job in burst:
                if job.poke:
                    continue
                done.append(job)
                if job.records is not None:
                    records.extend(job.records)
                if job.batch is not None and self.problem is None:
                    # those before it first: it is to be made knowing their secrets
                    self._append_all(records)
                    records = []
                    try:
                        records.append(self._made_of(job.batch))
                    except Exception as exc:  # as record_batch: the lines before it are kept
                        self._append_all(records)
                        records = []
                        self._stop(exc)
                if job.closing:
                    self._append_all(records)
                    records = []
                    self._close_file()
            self._append_all(records)
        finally:
            with self._writer_lock:
                self._unwritten -= sum(1 if job.records is None else len(job.records) for job in done)
            for job in done:
                with contextlib.suppress(Exception):  # the loop that waited is gone: nobody to tell
                    job.wake()

    def _drain(self, timeout: float | None, *, closing: bool = False) -> bool:
        """Wait until every job handed over is written (and, `closing`, the file closed by the
        writer); False if the writer is still busy after `timeout` seconds."""
        with self._writer_lock:
            if self._gathered and self._loop_writes(time.monotonic()):
                self._write_gathered_here()  # as the loop would at a batch's end
            try:
                self._hand_gathered()  # any left: the writer's to write
            except Exception as exc:  # no thread to be had: they are lost, and it is said
                self._stop(exc)
            idle = self._unwritten == 0
        if idle:
            if closing:
                self._close_file()
            return True
        done = threading.Event()
        if not self._hand_over(_Job(None, done.set, closing=closing)):
            return True  # no writer to be had: the recording stopped, nothing more is written
        return done.wait(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch recorded so far is in the file (synced, with `fsync`), the
        records gathered with `wait` false included, and the file stays open; False if the
        writer is still busy after `timeout` seconds (a disk that stalls)."""
        return self._drain(timeout)

    def close(self) -> None:
        """The session is closing: wait for the lines handed over, then close the file (a
        recorder dropped unclosed closes it when it is collected). Should the disk stall,
        the wait ends after `_CLOSE_WAIT` seconds and the writer closes the file when done."""
        if not self._drain(_CLOSE_WAIT, closing=True):
            log.warning("the recording %s is still being written; it closes when that is done", self.path)

    def _close_file(self) -> None:
        if self._closer is not None:
            self._closer()
        self._fd = self._closer = None
        self._fd_regular = False

    def _forked(self) -> None:
        """In a child process after `fork`: the file and its chain are the parent's, and a
        second writer would only break the chain, so the child records nothing more."""
        self._writer_state()
        self.problem = RuntimeError(f"a forked child does not write its parent's recording {self.path}")

    @property
    def position(self) -> tuple[int, str] | None:
        """The last record's seq and line hash (None: the file is neither read nor begun)."""
        return None if self._seq is None else (self._seq, self._prev)

    def resume_at(self, seq: int, prev: str, run: int) -> None:
        """Go on from where another worker's recording of this session stands (record `seq`
        of run `run`, whose line hashes to `prev`): in the same file, from its last line
        (a warning if that is elsewhere); in a new file, from a header that says so."""
        self.close()
        self._seq, self._resume = None, (seq, prev, run)

    def set_mode(self, mode: str) -> None:
        """The session's mode, for a header not yet written."""
        self._header["mode"] = mode

    def set_meta(self, **meta: Any) -> None:
        self._header["meta"].update(meta)

    def _continue_chain(self) -> list[bytes]:
        """The lines to write before the first record: the header for a new file; for a
        file that already holds a recording, the chain goes on from its last line, after a
        `session` record unless this session's own chain goes on there (`resume_at`)."""
        try:
            # a FIFO, a terminal or a socket (`/dev/stdout`, a shell's `>(...)`) is a stream
            # that another reads: reading it would wait for a writer, this recorder, for
            # ever, or take what is meant for its reader; a recording to it begins anew
            data = self.path.read_bytes() if stat.S_ISREG(os.stat(self.path).st_mode) else b""
        except FileNotFoundError:
            data = b""
        last = data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
        resume, self._resume = self._resume, None
        self._rows = not last or _format_of(data) not in _OLDER_FORMATS
        if not last:
            fields = self._header
            if resume is not None:  # the chain goes on from the header, which says from where
                fields = {**fields, "continues": {"seq": resume[0], "prev": resume[1], "run": resume[2]}}
            header = json.dumps(fields, ensure_ascii=True).encode()
            self._seq, self._prev = (0 if resume is None else resume[0]), line_hash(header)
            return [header]
        try:
            seq = json.loads(last).get("seq")
        except (ValueError, AttributeError):
            seq = None
        # a last line without a number (cut short, or format 1) cannot be continued cleanly:
        # the chain goes on regardless, and replay reports where it breaks
        self._seq = seq if isinstance(seq, int) and not isinstance(seq, bool) else 0
        self._prev = line_hash(last)
        if resume is None and self._rows and _format_of(data) in _CHAINED_FORMATS:
            # another session's recording (or this one's begun afresh, its state not kept):
            # a `session` record says that its batches start from nothing, as it did (not in
            # a file of an older format, whose readers replay on as before)
            own = self._header
            marker = {"type": "session", "session": own["session"], "mode": own["mode"]}
            marker |= {"seq": self._seq + 1, "prev": self._prev}
            line = json.dumps(marker, ensure_ascii=True).encode()
            self._seq, self._prev = self._seq + 1, line_hash(line)
            return [line]
        if resume is not None and resume[:2] != (self._seq, self._prev):
            log.warning(
                "the recording %s ends at record %s, not at record %s where the session's state "
                "stands; it goes on from the file's last line",
                self.path,
                self._seq,
                resume[0],
            )
        return []

    def _open(self) -> tuple[int, list[bytes]]:
        """The file, open for appending, and the lines that must come before the next record
        (a header, for a new file). A file deleted or replaced since the last batch is
        noticed (one fstat a batch) and the recording goes on in a new one at that path,
        beginning with a header: what was written before is gone with the old file, and
        a chain that went on from it would only be reported broken."""
        fd, named, self._named_fd = self._fd, self._named_fd, None
        if fd is not None:
            if named == fd or os.fstat(fd).st_nlink:  # still named (a file renamed over it unlinks it)
                return fd, []
            log.warning("the recording %s was removed or replaced; it starts again with a header", self.path)
            self._close_file()
            self._seq = None
        lines = self._continue_chain() if self._seq is None else []
        # created readable by its owner only (a umask can narrow that, never widen it)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, _PRIVATE_FILE)
        self._closer = weakref.finalize(self, os.close, fd)
        # not at exit: finalizers run before the exit handler that lets the writer finish,
        # and the process's end closes the file anyway
        self._closer.atexit = False
        self._fd = fd
        self._fd_regular = stat.S_ISREG(os.fstat(fd).st_mode)
        return fd, lines

    def _append(self, record: Mapping[str, Any]) -> None:
        """Append one record, numbered and chained (see `_append_all`)."""
        self._append_all([(dict(record), False)])

    def _append_all(self, records: Sequence[_Gathered]) -> None:
        """Append records, numbered and chained, with one `write`: each a (record, whether
        `_common_rows` built it) whose record is the recorder's own, given its `seq` and
        `prev` in place, or a batch gathered `_Unbuilt`, whose record is made here. A record
        that cannot be made or encoded (a structure too deep) is not
        written, nor is anything after it; a write that fails (a full disk, a folder gone)
        is logged once and ends the recording: what is on disk stays a readable prefix of
        the session (replay reports a cut last line as truncated), and the batches' results
        still reach the caller, since their tools have run."""
        if self.problem is not None or not records:
            return
        failed: Exception | None = None
        with contextlib.suppress(Exception):  # else made one by one, below, each failure its own
            records = _made_together(records, self._echoed)
        try:
            fd, lines = self._open()
            assert self._seq is not None
            seq, prev = self._seq, self._prev
            older = not self._rows
            for gathered in records:
                try:
                    if isinstance(gathered, _Unbuilt):
                        found: set[str] = set()
                        record, plain = _made(gathered, self._echoed, found)
                        self._learn(found)
                    else:
                        record, plain = gathered
                    if older and record["type"] == "rows":
                        # a file of an older format gone on with: its readers know no `rows`
                        record, plain = _batch_of_rows(_loads(encode_line(record, finite=plain))), False
                    record["seq"], record["prev"] = seq + 1, prev
                    encoded = encode_line(record, finite=plain)
                except Exception as exc:
                    failed = exc
                    break
                seq += 1
                lines.append(encoded)
                prev = line_hash(encoded)
            if lines:
                data = lines[0] + b"\n" if len(lines) == 1 else b"\n".join(lines) + b"\n"
                self._write(fd, data, seq, prev)
        except Exception as exc:  # OSError: a full disk, a folder gone
            failed = exc
        if failed is not None:
            self._stop(failed, close=True)  # the batch goes on; the recording stops

    def _stop(self, exc: Exception, *, close: bool = False) -> None:
        """The recording stops for `exc`, said once in the log; `close`: a write failed, and
        the file it went to is closed too."""
        self.problem = exc
        self._gathered = []  # nothing more is written
        log.error("recording to %s failed and stops here: %s", self.path, exc)
        if close:
            self._close_file()

    def record_batch(
        self,
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        decisions: Mapping[str, Decision],
        control: BaseException | None,
        all_loaded: bool = False,
        rewritten: bool = True,
    ) -> None:
        """Append one batch, on the calling thread (the session hands it to `submit`). Never
        raises: it runs after the batch's tools have run, and a recording's fault must not cost their
        results; a record that cannot be made ends the recording as a failed write does."""
        if self.problem is not None:
            return
        parts = _batch(run_id, round, calls, plan, results, decisions, control, all_loaded, rewritten)
        try:
            built = self._made_of(parts)
        except Exception as exc:
            self._stop(exc)
            return
        self._append_all([built])

    def _made_of(self, batch: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """`_record_of` the batch whose parts `batch` holds (`_batch`), redacting the
        secrets of the batches before it where its results echo them, and learning its own."""
        found: set[str] = set()
        made = self._record_of(**batch, echoed=self._echoed, found=found)
        self._learn(found)
        return made

    def _learn(self, found: set[str]) -> None:
        """The secrets a batch's record was redacted of, for the records after it."""
        found = {secret for secret in found if len(secret) >= MIN_ECHO_LENGTH} - self._echoed
        if found:
            self._echoed = self._echoed | found

    @staticmethod
    def _record_of(
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        decisions: Mapping[str, Decision],
        control: BaseException | None,
        all_loaded: bool = False,
        rewritten: bool = True,
        *,
        echoed: frozenset[str] = frozenset(),
        found: set[str] | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """(the record of one batch, as its line holds it less `seq` and `prev`; whether
        `_common_rows` built it: the common batch's `rows` record, built in one pass,
        which holds no float for `encode_line` to look for but its results' times; a file
        of format 2 gone on with gets the batch record it stands for: see `_append_all`).
        `echoed`: the secrets of earlier batches, redacted in this one's results too;
        `found`: where to add the secrets this batch's redaction found."""
        if not decisions:
            common = _common_record(
                run_id,
                round,
                calls,
                plan.calls,
                plan.received,
                results,
                control,
                all_loaded,
                rewritten,
                echoed,
            )
            if common is not None:
                return common, True
        secrets: set[str] = set()  # filled by the redaction of calls, decisions and keys
        # the common batch holds no credential anywhere: one scan says so for every call
        texts = [_openai_arguments(c) for c in calls]
        plain = [t for t in texts if t is not None]
        sent = [p.sent for p in plan.calls if p.sent is not None]
        calls_plain, keys_plain = len(plain) == len(calls), len(sent) == len(plan.calls)
        calls_clean = keys_clean = calls_plain and keys_plain and _none_may_hold_credentials(plain + sent)
        if not calls_clean:  # something may hold one: which part says so, each on its own
            calls_clean = calls_plain and _none_may_hold_credentials(plain)
            keys_clean = keys_plain and _none_may_hold_credentials(sent)
        recorded_calls = [
            _call_json(c, secrets, raw_args=t, clean=calls_clean) for c, t in zip(calls, texts, strict=True)
        ]
        recorded_decisions = {str(k): _decision_json(v, secrets) for k, v in decisions.items()}
        plan_rows = [
            {"name": p.name, "key": _recorded_key(p, secrets, clean=keys_clean), "how": _how(p, r)}
            for p, r in zip(plan.calls, results, strict=True)
        ]
        record = {
            "type": "batch",
            "run": run_id,
            "round": round,
            "all_loaded": all_loaded,  # `invoke`: every tool counts as loaded
            "calls": recorded_calls,
            "decisions": recorded_decisions,
            "plan": plan_rows,
            "results": [None if r is None else redacted_json(r, secrets | echoed) for r in results],
            "control": None if control is None else type(control).__name__,
        }
        if found is not None:
            found |= secrets
        return record, False


# --- reading ----------------------------------------------------------------------------

_STATUSES = frozenset(s.value for s in Status)
_MODES = ("deferred", "direct")


@attrs.frozen
class _Recording:
    """A recording as read: what replays, and what reading found wrong or doubtful."""

    header: dict[str, Any]
    # (line number, record), the header being line 1: its batch records, and a `session`
    # record where another session's batches begin
    batches: list[tuple[int, dict[str, Any]]]
    truncated: bool
    problem: str | None
    warnings: tuple[str, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_problem(header: Mapping[str, Any]) -> str | None:
    if header.get("format") in _CHAINED_FORMATS and not (_is_int(header.get("seq")) and header["seq"] == 0):
        return "line 1: the header's 'seq' is missing or not 0"
    if not isinstance(header.get("fingerprint", ""), str):
        return "line 1: the header's 'fingerprint' is not text"
    if header.get("mode", "deferred") not in _MODES:
        return f"line 1: the header's mode {header.get('mode')!r} is not one of {', '.join(_MODES)}"
    if not isinstance(header.get("meta", {}), dict) or not isinstance(header.get("tools", {}), dict):
        return "line 1: the header's 'meta' or 'tools' is not an object"
    return None


def _well_formed(record: Mapping[str, Any], chained: bool) -> bool:
    """True only where `_batch_problem` finds nothing: its checks, quickly, for the record
    as the recorder writes it (exact types); anything else is left to `_batch_problem`."""
    try:  # a field missing (KeyError) or a status that is no text (TypeError): not the usual record
        run, calls, plan, results = record["run"], record["calls"], record["plan"], record["results"]
        if chained and (type(record["seq"]) is not int or type(record["prev"]) is not str):
            return False
        if (
            type(run) is not int
            or type(calls) is not list
            or type(plan) is not list
            or type(results) is not list
        ):
            return False
        if not len(calls) == len(plan) == len(results):
            return False
        for call in calls:
            if type(call) is not dict:
                return False
        for row in plan:
            if type(row) is not dict or type(row["how"]) is not str or type(row["name"]) is not str:
                return False
            key = row["key"]
            if key is not None and type(key) is not str:
                return False
        for result in results:
            if result is None:
                continue
            if type(result) is not dict or result["status"] not in _STATUSES:
                return False
            if type(result.get("duration", 0.0)) not in (float, int):
                return False
            if type(result["call_id"]) is not str or type(result["name"]) is not str:
                return False
            if type(result["content"]) is not str:
                return False
    except (KeyError, TypeError):
        return False
    decisions = record.get("decisions", {})
    return type(decisions) is dict and all(type(d) is dict for d in decisions.values())


def _batch_problem(record: Mapping[str, Any], chained: bool) -> str | None:
    """What is structurally wrong with a batch record (None: nothing); replay reads every
    field named here without further checks."""
    if _well_formed(record, chained):
        return None
    fields = (
        ("run", "calls", "plan", "results", "seq", "prev") if chained else ("run", "calls", "plan", "results")
    )
    for name in fields:
        if name not in record:
            return f"the batch record has no {name!r}"
    if not _is_int(record["run"]):
        return f"its 'run' is {record['run']!r}, not a number"
    for name in ("calls", "plan", "results"):
        if not isinstance(record[name], list):
            return f"its {name!r} is not a list"
    calls, plan, results = record["calls"], record["plan"], record["results"]
    if not len(calls) == len(plan) == len(results):
        return f"it holds {len(calls)} calls, {len(plan)} plan rows and {len(results)} results"
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            return f"calls[{i}] is not an object"
    for i, row in enumerate(plan):
        if not isinstance(row, dict):
            return f"plan[{i}] is not an object"
        for name in ("name", "key", "how"):
            if name not in row:
                return f"plan[{i}] has no {name!r}"
        if not isinstance(row["how"], str) or not isinstance(row["name"], str):
            return f"plan[{i}]'s 'name' or 'how' is not text"
        if row["key"] is not None and not isinstance(row["key"], str):
            return f"plan[{i}]'s 'key' is not text"
    for i, result in enumerate(results):
        if result is None:
            continue
        if not isinstance(result, dict):
            return f"results[{i}] is not an object"
        for name in ("call_id", "name", "status", "content"):
            if name not in result:
                return f"results[{i}] has no {name!r}"
        if not isinstance(result["status"], str) or result["status"] not in _STATUSES:
            return f"results[{i}]'s status {result['status']!r} is not a status"
        if not all(isinstance(result[n], str) for n in ("call_id", "name", "content")):
            return f"results[{i}]'s 'call_id', 'name' or 'content' is not text"
        if not isinstance(result.get("duration", 0.0), int | float):
            return f"results[{i}]'s 'duration' is not a number"
    decisions = record.get("decisions", {})
    if not isinstance(decisions, dict) or not all(isinstance(d, dict) for d in decisions.values()):
        return "its 'decisions' is not an object of objects"
    if chained and (not _is_int(record["seq"]) or not isinstance(record["prev"], str)):
        return "its 'seq' is not a number or its 'prev' not text"
    return None


def _edited(number: int) -> str:
    return f"line {number}: edited (its hash does not match the next record's prev)"


def _chain_problem(
    lines: Sequence[tuple[int, bytes, dict[str, Any]]], at: int, seq_before: int, hash_before: str
) -> str | None:
    """What is wrong with the record `lines[at]` following a record numbered `seq_before`
    whose line hashes to `hash_before` (None: it follows it)."""
    number, raw, record = lines[at]
    seq, prev = record["seq"], record["prev"]
    if seq == seq_before + 1:
        return None if prev == hash_before else _edited(number - 1)
    for earlier_number, earlier_raw, earlier in lines[:at]:
        if earlier_raw == raw or (earlier.get("seq") == seq and earlier.get("prev") == prev):
            return f"line {number}: a duplicate of line {earlier_number} (record seq {seq})"
    expected = seq_before + 1
    later = next((n for n, _, r in lines[at + 1 :] if r.get("seq") == expected), None)
    if later is not None:
        return (
            f"line {number}: record seq {seq} follows seq {seq_before} "
            f"(out of order: seq {expected} is on line {later})"
        )
    if seq > expected:
        missing = "a record is" if seq == expected + 1 else f"{seq - expected} records are"
        return f"line {number}: record seq {seq} follows seq {seq_before} ({missing} missing)"
    return f"line {number}: record seq {seq} follows seq {seq_before} (out of order)"


_TWO_63 = float(2**63)


def _widened(value: Any) -> bool:
    """Whether `value` holds a float that orjson may have read from an integer past 64 bits."""
    if type(value) is float:
        return value.is_integer() and abs(value) >= _TWO_63
    if type(value) is dict:
        return any(_widened(v) for v in value.values())
    if type(value) is list:
        return any(_widened(v) for v in value)
    return False


def _record_widened(record: dict[str, Any]) -> bool:
    """`_widened` over what a record holds as the caller gave it (a call's arguments as JSON
    text hold no number), and over its own numbers; the rest of a record is text."""
    get = record.get
    if type(get("run")) is float or type(get("round")) is float or type(get("seq")) is float:
        return True  # a record's numbers are integers: as a float, one is wrong either way
    calls = get("calls")
    if type(calls) is list:
        for call in calls:
            as_text = type(call) is dict and type(call.get("arguments")) is str and len(call) == 3
            if not as_text and _widened(call):
                return True
    decisions, meta = get("decisions"), get("meta")  # most often empty, or not there
    return bool(decisions and _widened(decisions)) or bool(meta and _widened(meta))


def _loads(raw: bytes) -> Any:
    """One line as `json.loads` reads it (ill-formed UTF-8 replaced), by orjson where that
    reads the same value: orjson refuses NaN, infinities, lone surrogates and ill-formed
    UTF-8, and reads an integer past 64 bits as a float, so such lines are read by json."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw.decode("utf-8", errors="replace"))
    if type(value) is dict and not _record_widened(value):
        return value
    return json.loads(raw.decode("utf-8", errors="replace"))


def _object(raw: bytes) -> dict[str, Any]:
    """One line as a JSON object (`_loads`); ValueError or RecursionError if it is none."""
    value = _loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def _record(raw: bytes) -> dict[str, Any]:
    """One line as a record (`_object`), a `rows` record as the `batch` record it stands for
    (`_batch_of_rows`); ValueError or RecursionError if it is none."""
    value = _object(raw)
    return _batch_of_rows(value) if value.get("type") == "rows" else value


def _record_checked(raw: bytes) -> tuple[dict[str, Any], bool]:
    """One line as replay reads it, and whether it is a `rows` record well formed for a
    chained file (`_rows_formed`): such a record as it is, its rows not taken apart, and
    any other record as `_record` reads it (False leaves the question to the batch
    record's checks)."""
    value = _object(raw)
    if value.get("type") != "rows":
        return value, False
    if _rows_formed(value):
        return value, True
    return _batch_of_rows(value), False


# A `rows` record (format 3) is the common batch's `batch` record, one row per call:
# [id, name, arguments, key, how] for a call with no result, and for one with a result
# these and its status, content, retryable, effect_uncertain, cached, deduped, started,
# duration; either followed by the name the call was planned and answered under when
# that is not its own (`run_tool`'s call: the tool it names). The call and its result
# share the id, there are no decisions, and the rest of the record (run, round,
# all_loaded, control, seq, prev) is the batch record's.
_UNANSWERED_ROW = 5
_ANSWERED_ROW = 13
_ROW_SIZES = frozenset({_UNANSWERED_ROW, _UNANSWERED_ROW + 1, _ANSWERED_ROW, _ANSWERED_ROW + 1})


def _planned_name(row: list[Any]) -> Any:
    """The name a row's call was planned and answered under: the last value of a row of
    even length, else the call's own name."""
    return row[-1] if len(row) & 1 == 0 else row[1]


def _rows_formed(record: Mapping[str, Any]) -> bool:
    """Whether a `rows` record stands for a batch record well formed for a chained file
    (`_well_formed(_batch_of_rows(record), True)`), asked of its rows as they are, and
    more strictly: the id of a call with no result is text too, its result's flags are
    booleans and its duration a float, as a recorder writes them. Replay reads such rows
    without taking them apart, and makes their results as they are."""
    get = record.get
    rows = get("rows")
    if type(rows) is not list or type(get("run")) is not int:
        return False
    if type(get("seq")) is not int or type(get("prev")) is not str:
        return False
    for row in rows:
        if type(row) is not list or (size := len(row)) not in _ROW_SIZES:
            return False
        key = row[3]
        if (
            type(row[0]) is not str  # the id
            or type(_planned_name(row)) is not str
            or type(row[4]) is not str  # how
            or (key is not None and type(key) is not str)
        ):
            return False
        if size >= _ANSWERED_ROW and (
            type(status := row[5]) is not str
            or status not in _STATUSES
            or type(row[6]) is not str  # content
            or type(row[7]) is not bool  # retryable, effect_uncertain, cached, deduped
            or type(row[8]) is not bool
            or type(row[9]) is not bool
            or type(row[10]) is not bool
            or type(row[12]) is not float  # duration
        ):
            return False
    return True


def _batch_of_rows(record: dict[str, Any]) -> dict[str, Any]:
    """The `batch` record a `rows` record stands for, field for field what the recorder
    builds part by part for the same batch; ValueError if its rows are not rows (what
    they hold is left to the batch record's checks)."""
    rows = record.pop("rows", None)
    if type(rows) is not list:
        raise ValueError("a 'rows' record whose 'rows' is not a list")
    calls, plan, results = _rows_apart(rows)
    if tuple(record) == _ROWS_FIELDS:  # as the recorder writes it: the same, in one go
        return {
            "type": "batch",
            "run": record["run"],
            "round": record["round"],
            "all_loaded": record["all_loaded"],
            "calls": calls,
            "decisions": {},
            "plan": plan,
            "results": results,
            "control": record["control"],
            "seq": record["seq"],
            "prev": record["prev"],
        }
    batch: dict[str, Any] = {"type": "batch"}
    for field in ("run", "round", "all_loaded"):
        if field in record:
            batch[field] = record[field]
    batch["calls"], batch["decisions"], batch["plan"], batch["results"] = calls, {}, plan, results
    for field, value in record.items():
        if field not in batch:
            batch[field] = value  # control, seq and prev, and whatever an edit added
    return batch


def _rows_apart(rows: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """The calls, plan rows and results of a batch record, made of a `rows` record's rows;
    ValueError if a row is not a list of 5, 6, 13 or 14 values."""
    calls: list[Any] = []
    plan: list[Any] = []
    results: list[Any] = []
    for i, row in enumerate(rows):
        size = len(row) if type(row) is list else 0
        if size == _ANSWERED_ROW:
            call_id, name, arguments, key, how, status, content, *flags, started, duration = row
            planned = name
        elif size == _ANSWERED_ROW + 1:
            call_id, name, arguments, key, how, status, content, *flags, started, duration, planned = row
        elif size == _UNANSWERED_ROW:
            call_id, name, arguments, key, how = row
            planned = name
        elif size == _UNANSWERED_ROW + 1:
            call_id, name, arguments, key, how, planned = row
        else:
            raise ValueError(f"a 'rows' record whose rows[{i}] is not a list of 5, 6, 13 or 14 values")
        calls.append({"id": call_id, "name": name, "arguments": arguments})
        plan.append({"name": planned, "key": key, "how": how})
        if size < _ANSWERED_ROW:
            results.append(None)
            continue
        retryable, effect_uncertain, cached, deduped = flags
        results.append(
            {  # ToolResult.to_json, field for field
                "call_id": call_id,
                "name": planned,
                "status": status,
                "content": content,
                "retryable": retryable,
                "effect_uncertain": effect_uncertain,
                "cached": cached,
                "deduped": deduped,
                "started": started,
                "duration": duration,
            }
        )
    return calls, plan, results


# a `rows` record's fields as the recorder writes them, in order, less its rows
_ROWS_FIELDS = ("type", "run", "round", "all_loaded", "control", "seq", "prev")


def _format_of(data: bytes) -> Any:
    """The format a recording's header line says it is of (None: no header to say so)."""
    end = data.find(b"\n")
    try:
        header = _loads(data if end < 0 else data[:end])
    except (ValueError, RecursionError):
        return None
    return header.get("format") if type(header) is dict and header.get("type") == "header" else None


def _chain_start(header: Mapping[str, Any], raw: bytes) -> tuple[int, str]:
    """The seq and line hash that the first batch of a chained recording follows."""
    continues = header.get("continues")
    if isinstance(continues, dict) and _is_int(continues.get("seq")):
        return continues["seq"], line_hash(raw)  # a recording that another file's chain goes on in
    return 0, line_hash(raw)


def _read(path: str | os.PathLike[str]) -> _Recording:
    """Read and check a recording: its structure line by line, then its chain. The batches
    before the first problem replay; a record the chain shows edited does not."""
    return _read_data(Path(path).read_bytes(), path)


def _read_data(data: bytes, path: str | os.PathLike[str]) -> _Recording:
    """`_read` of the recording `data`, read from `path`."""
    raw_lines = data.split(b"\n")
    ends_cleanly = data.endswith(b"\n")
    if ends_cleanly:
        raw_lines.pop()
    parsed: list[tuple[int, bytes, dict[str, Any]]] = []
    truncated = False
    problem: str | None = None
    for number, raw in enumerate(raw_lines, 1):
        try:
            value = _record(raw)
        except (ValueError, RecursionError) as exc:
            if number == len(raw_lines) and not ends_cleanly:
                truncated = True
            else:
                problem = f"line {number} is not a JSON record: {exc}"
            break
        parsed.append((number, raw, value))
    if not parsed or parsed[0][2].get("type") != "header":
        return _Recording({}, [], truncated, problem or f"line 1: {path} has no recording header", ())
    header = parsed[0][2]
    version = header.get("format")
    if not _is_int(version) or version not in (*_CHAINED_FORMATS, _UNCHAINED_FORMAT):
        return _Recording(
            header, [], truncated, f"line 1: recording format {version!r}, expected {FORMAT_VERSION}", ()
        )
    header_problem = _header_problem(header)
    if header_problem is not None:
        return _Recording(header, [], truncated, header_problem, ())
    chained = version in _CHAINED_FORMATS
    if not chained and ("seq" in header or any("prev" in value for _, _, value in parsed[1:])):
        # the chain's own fields give a downgraded header away: an edit, not an old file
        return _Recording(
            header,
            [],
            truncated,
            "line 1: the header says format 1, but its records are chained (edited)",
            (),
        )
    warnings: tuple[str, ...] = ()
    if not chained:
        warnings = (
            f"format {version} recording, made before the hash chain: a deleted, reordered or "
            "edited record cannot be detected",
        )
    batches: list[tuple[int, dict[str, Any]]] = []
    seq_before, hash_before = _chain_start(header, parsed[0][1]) if chained else (0, "")
    for at in range(1, len(parsed)):
        number, raw, record = parsed[at]
        kind = record.get("type")
        wrong: str | None = None
        if kind is None:
            wrong = f"line {number}: a record without 'type'"
        elif kind == "header":
            wrong = f"line {number}: a second header"
        elif kind == "batch":
            shape = _batch_problem(record, chained)
            wrong = None if shape is None else f"line {number}: {shape}"
        elif kind == "session" and record.get("mode", "deferred") not in _MODES:
            mode = record.get("mode")
            wrong = f"line {number}: a session record's mode {mode!r} is not one of {', '.join(_MODES)}"
        elif chained and not (_is_int(record.get("seq")) and isinstance(record.get("prev"), str)):
            wrong = f"line {number}: a {kind!r} record without 'seq' or 'prev'"
        if wrong is None and chained:
            wrong = _chain_problem(parsed, at, seq_before, hash_before)
            if wrong == _edited(number - 1) and batches and batches[-1][0] == number - 1:
                batches.pop()  # the edited record: not replayed as if it were the recording
        if wrong is not None:
            problem = wrong  # earlier in the file than a line that could not be read
            break
        if kind in ("batch", "session"):  # a session record: the batches after it replay afresh
            batches.append((number, record))
        if chained:
            seq_before, hash_before = record["seq"], line_hash(raw)
    return _Recording(header, batches, truncated, problem, warnings)


# A replay reads and checks the batches ahead of those it replays, up to so many of them
# or so many bytes of their lines (at least one line): read in a run rather than one
# between each two batches replayed, the bench's replay takes a few percent less time.
# Runs of 16 did as well as runs of 64 when the shared machine was quiet and 7-9% better
# in a slow spell: what a shorter run holds stays in the caches.
_READ_AHEAD = 16
_READ_AHEAD_BYTES = 1 << 18


class _Stream:
    """A chained recording read a run of lines at a time, for replay: its batches in order,
    each handed out once the next line vouches for it (or the file ends there), none kept
    after.
    A line that is anything but a well-formed batch following the one before (a record of
    another kind, a problem) and a recording of another format are left to `_read_data`,
    which reads the same bytes whole: its batches begin with those handed out already,
    since both take each line before that one the same way, and the rest follow. Lines
    are read some batches ahead of those handed out (`_read_ahead`). Once the
    last batch is out, `truncated` and `problem` are those `_read_data` finds. A `rows`
    record well formed (`_rows_formed`) is handed out as read, its rows not taken apart:
    `_replay_batches` reads them as they are; any other batch is a `batch` record."""

    def __init__(self, data: bytes, path: str | os.PathLike[str], *, whole: bool = False) -> None:
        self._data, self._path = data, path
        self.header: dict[str, Any] = {}
        self.warnings: tuple[str, ...] = ()
        self.truncated = False
        self.problem: str | None = None
        self._rest: list[tuple[int, dict[str, Any]]] | None = None  # `_read_data`'s batches
        self._handed = 0  # batches handed out
        self._pending: tuple[int, dict[str, Any]] | None = None  # read, not yet vouched for
        self._ahead: tuple[int, dict[str, Any]] | None = None  # handed out by `any`
        self._ready: list[tuple[int, dict[str, Any]]] = []  # vouched for, not handed out: last first
        end = data.find(b"\n")
        first = data if end < 0 else data[:end]
        self._at = len(data) if end < 0 else end + 1  # where the next line begins
        self._number = 1  # the line read last
        try:
            header: dict[str, Any] | None = _record(first)
        except (ValueError, RecursionError):
            header = None
        if (
            whole
            or header is None
            or header.get("type") != "header"
            or not (_is_int(header.get("format")) and header["format"] in _CHAINED_FORMATS)
            or _header_problem(header) is not None
        ):
            self._read_whole()
            self._seq_before, self._hash_before = 0, ""
        else:
            self.header = header
            self._seq_before, self._hash_before = _chain_start(header, first)

    def _read_whole(self) -> None:
        whole = _read_data(self._data, self._path)
        self._rest = whole.batches
        self.header, self.warnings = whole.header, whole.warnings
        self.truncated, self.problem = whole.truncated, whole.problem

    def __iter__(self) -> _Stream:
        return self

    def any(self) -> bool:
        """Whether a batch is to come (the next one is read, and handed out next)."""
        if self._ahead is None:
            self._ahead = next(self, None)
        return self._ahead is not None

    def __next__(self) -> tuple[int, dict[str, Any]]:
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return ahead
        ready = self._ready
        if not ready and self._rest is None:
            self._read_ahead()
        if ready:
            self._handed += 1
            return ready.pop()
        if self._rest is not None and self._handed < len(self._rest):
            self._handed += 1
            return self._rest[self._handed - 1]
        raise StopIteration

    def next_run(self) -> list[tuple[int, dict[str, Any]]]:
        """The next batch and those read and vouched for after it (`_read_ahead`), in order;
        none at the end."""
        first = next(self, None)
        if first is None:
            return []
        run, ready = [first], self._ready
        while ready:
            self._handed += 1
            run.append(ready.pop())
        return run

    def _read_ahead(self) -> None:
        """Read the lines after the last one read until `_READ_AHEAD` batches are vouched for
        (`_ready`, last first), `_READ_AHEAD_BYTES` are read, or the file ends; at a line
        that is anything but a well-formed batch following the one before, the whole file
        is read instead (`_read_whole`), and the batches not yet handed out are those of
        `_rest`."""
        data = self._data
        vouched: list[tuple[int, dict[str, Any]]] = []
        until = self._at + _READ_AHEAD_BYTES
        # at least one batch vouched for, unless the file ends first
        while self._at < len(data) and (not vouched or (len(vouched) < _READ_AHEAD and self._at < until)):
            self._number += 1
            end = data.find(b"\n", self._at)
            raw = data[self._at :] if end < 0 else data[self._at : end]
            self._at = len(data) if end < 0 else end + 1
            try:
                # formed: a rows line checked as read, handed out with its rows as they are
                record, formed = _record_checked(raw)
            except (ValueError, RecursionError) as exc:
                if end < 0:  # the last line, and the file does not end cleanly
                    self.truncated = True
                else:
                    self.problem = f"line {self._number} is not a JSON record: {exc}"
                self._at = len(data)  # no line after it is read
                break
            if (
                (not formed and (record.get("type") != "batch" or _batch_problem(record, True) is not None))
                or record["seq"] != self._seq_before + 1
                or record["prev"] != self._hash_before  # where `_chain_problem` finds nothing
            ):
                self._read_whole()
                return
            self._seq_before, self._hash_before = record["seq"], line_hash(raw)
            if self._pending is not None:
                vouched.append(self._pending)
            self._pending = (self._number, record)
        if self._at >= len(data) and self._pending is not None:
            # the last line read: nothing after it to vouch for it
            vouched.append(self._pending)
            self._pending = None
        vouched.reverse()
        self._ready[:0] = vouched

    def finish(self) -> None:
        """Read the rest of the file, past the batches handed out: `truncated` and `problem`
        are then the whole file's."""
        for _ in self:
            pass


def _stream(path: str | os.PathLike[str]) -> _Stream:
    """The recording at `path` to be read a line at a time."""
    return _Stream(Path(path).read_bytes(), path)


def read_recording(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], list[dict[str, Any]], bool, str | None]:
    """(header, batches, truncated, problem). A last line cut short is `truncated`; a line
    that is not a well-formed record, or that the hash chain shows deleted, duplicated,
    moved or edited, stops reading there and is named in `problem` (`line N: ...`, the
    header being line 1)."""
    recording = _read(path)
    batches = [b for _, b in recording.batches if b["type"] != "session"]
    return recording.header, batches, recording.truncated, recording.problem


# --- replay -----------------------------------------------------------------------------

_WINDOW = 40  # characters of each text shown around their first difference


def _first_difference(a: str, b: str) -> int:
    """The length of the common prefix of `a` and `b`, found a block at a time."""
    at, end, block = 0, min(len(a), len(b)), 256
    while at < end and a[at : at + block] == b[at : at + block]:
        at += block
    while at < end and a[at] == b[at]:
        at += 1
    return min(at, end)


def _compact_diff(expected: str, got: str, width: int = _WINDOW) -> str:
    """`expected` and `got` around their first difference: the offset, then a window of
    about `width` characters of each, "…" where the text goes on."""
    at = _first_difference(expected, got)
    start = max(0, at - width // 2)

    def window(text: str) -> str:
        piece = text[start : start + width]
        return ("…" if start > 0 else "") + repr(piece) + ("…" if start + width < len(text) else "")

    lengths = f" (lengths {len(expected)} and {len(got)})" if len(expected) != len(got) else ""
    return f"at offset {at}: expected {window(expected)}, got {window(got)}{lengths}"


@attrs.frozen
class Divergence:
    """Where replay first decided otherwise than the recording: the batch (and its line in
    the file), the call's index and id, the field that differs, and both values in full."""

    batch: int
    index: int
    call_id: str
    expected: str
    got: str
    field: str = ""
    line: int | None = None

    def __str__(self) -> str:
        batch = f"batch {self.batch}" if self.line is None else f"batch {self.batch} (line {self.line})"
        where = f"{batch}, call {self.index} ({self.call_id})" if self.index >= 0 else batch
        return f"{where}: {self.field or 'value'} differs {_compact_diff(self.expected, self.got)}"


@attrs.frozen
class ReplayReport:
    """What a replay found. `warnings` never make it fail: a changed registry (naming the
    tools that changed) or an old recording that has no hash chain."""

    batches: int
    calls: int
    divergence: Divergence | None
    truncated: bool
    fingerprint_matches: bool
    header: Mapping[str, Any]
    problem: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.problem is None


def _registry_drift(header: Mapping[str, Any], registry: Registry) -> str:
    """A warning naming the tools that differ from those the recording was made with."""
    recorded = header.get("tools")
    if not isinstance(recorded, dict):
        return "the tools differ from those the recording was made with (it does not say which)"
    now = _tool_hashes(registry)
    changes: list[str] = []
    for name in sorted(set(recorded) | set(now)):
        was, is_ = recorded.get(name), now.get(name)
        if was == is_:
            continue
        if was is None:
            changes.append(f"{name} added")
        elif is_ is None:
            changes.append(f"{name} removed")
        elif isinstance(was, list) and was[:1] != is_[:1]:
            changes.append(f"{name} changed (description)")
        else:
            changes.append(f"{name} changed (parameters)")
    return "the tools differ from those the recording was made with: " + (
        ", ".join(changes) or "the fingerprint differs"
    )


_CUTS = frozenset({"DispatchInterrupted", "HookBlocked", "KeyboardInterrupt"})  # a tool's own run control
_UNSERVED: Any = object()  # in `_BatchServer.served`: no recorded result was served


class _BatchServer:
    """Pass 2's runner during replay: the recorded result of a call that ran then. A call
    that ran otherwise than recorded is noted, not raised, so that the batch finishes and
    the earliest call that differs is the one reported. Of a batch record's plan rows and
    results, or of a `rows` record's rows as they are (`rows`)."""

    __slots__ = (
        "_plan_rows",
        "_recorded",
        "_results",
        "clean",
        "control",
        "cutting",
        "divergences",
        "line",
        "number",
        "raised",
        "rows",
        "secrets",
        "served",
    )

    def __init__(
        self,
        number: int,
        line: int | None,
        plan_rows: Sequence[Mapping[str, Any]] | None,
        recorded: Sequence[Mapping[str, Any] | None] | None,
        *,
        clean: bool = False,
        control: str | None = None,
        rows: list[list[Any]] | None = None,
    ) -> None:
        self.number, self.line = number, line
        self._plan_rows, self._recorded = plan_rows, recorded
        self.rows = rows  # a `rows` record's, checked (`_rows_formed`): plan rows and results in one
        self.secrets: set[str] = set()  # of the calls served, as the recorder finds them
        self.divergences: dict[int, Divergence] = {}
        self.clean = clean  # the batch's arguments are known to hold no credential
        self.control = control  # what cut the recorded batch short, by its name
        self.raised: list[BaseException] = []  # the cuts it made again
        # by index, the recorded result handed to pass 2 as it was read (`_UNSERVED`: none)
        self.served: list[Any] = [_UNSERVED] * len(rows if rows is not None else self.recorded)
        # a run control cut the recorded batch short; an edited record may hold anything
        # there, a list say, which no set can be asked about
        self.cutting = type(control) is str and control in _CUTS
        # of rows: each call's recorded result made as `_recorded_row` serves it, as the
        # rows are read (None: a row with no result)
        self._results = [] if rows is None else [_row_result(row) for row in rows]

    def _taken_apart(self) -> None:
        assert self.rows is not None
        _, self._plan_rows, self._recorded = _rows_apart(self.rows)

    @property
    def plan_rows(self) -> Sequence[Mapping[str, Any]]:
        """The plan rows of the batch record served, made of the rows when first asked."""
        if self._plan_rows is None:
            self._taken_apart()
        assert self._plan_rows is not None
        return self._plan_rows

    @property
    def recorded(self) -> Sequence[Mapping[str, Any] | None]:
        """The results of the batch record served, made of the rows when first asked."""
        if self._recorded is None:
            self._taken_apart()
        assert self._recorded is not None
        return self._recorded

    def _how(self, i: int) -> str | None:
        """How the recorded batch says call `i` went (None: it holds no such call)."""
        rows = self.rows
        if rows is not None:
            return rows[i][4] if i < len(rows) else None
        plan_rows = self.plan_rows
        return plan_rows[i]["how"] if i < len(plan_rows) else None

    def _cut_here(self, planned: PlannedCall) -> bool:
        """Whether `planned` is a call left unfinished when a tool's own run control (an
        interrupt, a block, a KeyboardInterrupt) cut the recorded batch short: served by
        raising that again, so the batch is cut as it was."""
        return self.cutting and self._how(planned.index) == "unfinished"

    def _cut(self, planned: PlannedCall) -> BaseException:
        cut: BaseException
        if self.control == "DispatchInterrupted":
            cut = DispatchInterrupted([(planned.call, "replayed: this call interrupted the batch", None)])
        elif self.control == "HookBlocked":
            cut = HookBlocked("replayed: this call blocked the batch", call_id=planned.call_id)
        else:
            cut = KeyboardInterrupt()
        self.raised.append(cut)
        return cut

    def _differs(self, planned: PlannedCall, field: str, expected: str, got: str) -> ToolResult:
        i = planned.index
        self.divergences.setdefault(
            i, Divergence(self.number, i, planned.call_id, expected, got, field, self.line)
        )
        return ToolResult(planned.call_id, planned.name, Status.failed, f"replay: {field} differs")

    def _recorded_result(self, planned: PlannedCall) -> tuple[ToolResult, bool]:
        """(the recorded result of `planned`, True), or (a failed result, False) noting
        how it ran otherwise than recorded."""
        i = planned.index
        rows = self.rows
        if rows is not None:
            return self._recorded_row(planned, rows[i] if i < len(rows) else None)
        plan_rows, recorded = self.plan_rows, self.recorded
        row = plan_rows[i] if i < len(plan_rows) else None
        want = recorded[i] if i < len(recorded) else None
        if row is None or row["how"] != "ran" or want is None:
            return self._differs(
                planned, "how", _how_recorded(row and row["how"], want is None), "ran"
            ), False
        key = _recorded_key(planned, self.secrets, clean=self.clean)
        if row["name"] != planned.name:
            return self._differs(planned, "name", row["name"], planned.name), False
        if row["key"] != key:
            return self._differs(planned, "key", str(row["key"]), str(key)), False
        result = self.served[i] = _result_from_json(want)
        return result, True

    def _recorded_row(self, planned: PlannedCall, row: list[Any] | None) -> tuple[ToolResult, bool]:
        """`_recorded_result` of a `rows` record's `row` for `planned` (None: it has none),
        as of the batch record it stands for (`_rows_apart`)."""
        size = 0 if row is None else len(row)
        if row is None or row[4] != "ran" or size < _ANSWERED_ROW:
            how = _how_recorded(row and row[4], size < _ANSWERED_ROW)
            return self._differs(planned, "how", how, "ran"), False
        result = self._results[planned.index]
        assert result is not None  # a row of that size holds one
        name = result.name  # the name it was planned under (`_row_result`)
        tool = planned.tool
        if self.clean and planned.sent is not None and (tool is None or not tool.defaults):
            key = planned.key  # as `_recorded_key` finds first: nothing to redact
        else:
            key = _recorded_key(planned, self.secrets, clean=self.clean)
        if name != planned.name:
            return self._differs(planned, "name", name, planned.name), False
        if row[3] != key:
            return self._differs(planned, "key", str(row[3]), str(key)), False
        self.served[planned.index] = result
        return result, True

    def serve_now(self, planned: PlannedCall) -> ToolResult | None:
        """Pass 2's quick way for a recorded result: at once, with nothing to run (None for
        `find_tools`, which runs for real)."""
        if (planned.name == FIND_TOOLS and planned.tool is not None) or (
            self.cutting and self._cut_here(planned)
        ):
            return None
        rows = self.rows
        if rows is not None:  # most batches: straight to the row
            i = planned.index
            return self._recorded_row(planned, rows[i] if i < len(rows) else None)[0]
        return self._recorded_result(planned)[0]

    async def __call__(self, planned: PlannedCall, ctx: ToolContext) -> ToolResult:
        if self._cut_here(planned):
            raise self._cut(planned)
        recorded, same = self._recorded_result(planned)
        if same and planned.name == FIND_TOOLS and planned.tool is not None:
            # the dispatcher's own tool: it touches nothing outside the session, and loading
            # the schemas it finds is what later calls depend on, so it runs for real
            again = normalize_output(await planned.tool.tool.handler(planned.args, ctx))
            again = redact_text(again, self.secrets)
            if recorded.status is Status.ok and again != recorded.content:
                return self._differs(planned, "content", recorded.content, again)
        return recorded


def _row_result(row: list[Any]) -> ToolResult | None:
    """The result a checked row (`_rows_formed`) holds, as `_result_from_json` makes it of
    the batch record's result (its flags booleans and its duration a float already), under
    the name the call was planned under; None for a row with no result."""
    if len(row) < _ANSWERED_ROW:
        return None
    return new_result(
        row[0],
        _planned_name(row),
        _STATUS_OF[row[5]],
        row[6],
        row[7],
        row[8],
        row[9],
        row[10],
        row[11],
        row[12],
    )


def _how_recorded(how: Any, unanswered: bool) -> str:
    """How a recorded batch says a call went, as a divergence shows it: a call that ran
    but has no result recorded (an edit) says so, rather than "ran" against "ran"."""
    return "ran, with no result recorded" if how == "ran" and unanswered else f"{how}"


_STATUS_OF = {s.value: s for s in Status}


def _result_from_json(data: Mapping[str, Any]) -> ToolResult:
    """`ToolResult.from_json` of a result `_batch_problem` checked, without its keyword calls."""
    get = data.get
    return new_result(
        data["call_id"],
        data["name"],
        _STATUS_OF[data["status"]],
        data["content"],
        bool(get("retryable", False)),
        bool(get("effect_uncertain", False)),
        bool(get("cached", False)),
        bool(get("deduped", False)),
        get("started"),
        float(get("duration", 0.0)),
    )


def _first_divergence(
    serve: _BatchServer, call_ids: Sequence[str], results: Sequence[ToolResult]
) -> Divergence | None:
    """The earliest call, in call order, that pass 2 ran otherwise than recorded or whose
    result differs from the recorded one (status, content, name, deduped), the replayed
    text redacted as the recorder redacts it."""
    divergences, secrets = serve.divergences, serve.secrets
    if not divergences and not secrets and list(map(id, results)) == list(map(id, serve.served)):
        return None  # each result is the one served, made from the recorded one: they agree
    recorded = serve.recorded
    for i in range(max(len(recorded), len(results))):
        if i in divergences:
            return divergences[i]
        call_id = results[i].call_id if i < len(results) else call_ids[i] if i < len(call_ids) else ""
        if i >= len(results) or i >= len(recorded):
            got, expected = str(len(results)), str(len(recorded))
            return Divergence(serve.number, i, call_id, expected, got, "result count", serve.line)
        want, got_result = recorded[i], results[i]
        if want is None:
            continue
        content = redact_text(got_result.content, secrets) if secrets else got_result.content
        if (
            want["status"] == got_result.status.value
            and want["content"] == content
            and want["name"] == got_result.name
            and bool(want.get("deduped")) == got_result.deduped
        ):
            continue
        checks = (
            ("status", want["status"], got_result.status.value),
            ("content", want["content"], content),
            ("name", want["name"], got_result.name),
            ("deduped", str(bool(want.get("deduped"))), str(got_result.deduped)),
        )
        for field, expected, got in checks:
            if expected != got:
                return Divergence(serve.number, i, call_id, expected, got, field, serve.line)
    return None


def _recorded_gate(decisions: Mapping[str, Any]) -> Any:
    """The gate of a replayed batch: the decision recorded for each call."""

    def gate(call: ToolCall, ctx: ToolContext) -> Decision:
        found = decisions.get(call.id)
        if found is None:
            return Interrupt("replay: the recording holds no decision for this call", None)
        if "deny" in found:
            return Deny(str(found["deny"]))
        if "interrupt" in found:
            return Interrupt(str(found["interrupt"]), None)
        if "answer" in found:
            return Answer(str(found["answer"]))
        allowed = found.get("allow")
        return Allow(allowed if isinstance(allowed, dict) else None)

    return gate


_UNDECIDED = _recorded_gate({})  # the gate of the many batches that recorded no decision


async def replay(
    path: str | os.PathLike[str],
    dispatcher: Dispatcher,
) -> ReplayReport:
    """Replay the recording at `path` through `dispatcher`'s passes without running any
    tool; report the first divergence, or the first problem of the file itself."""
    return await _replay(_stream(path), dispatcher)


async def _replay(recording: _Stream, dispatcher: Dispatcher) -> ReplayReport:
    """`replay` of the recording as `recording` reads it."""
    header = recording.header
    warnings = list(recording.warnings)
    fingerprint_ok = header.get("fingerprint") == dispatcher.registry.fingerprint()
    if "fingerprint" in header and not fingerprint_ok:
        warnings.append(_registry_drift(header, dispatcher.registry))

    def report(batches: int, calls: int, divergence: Divergence | None) -> ReplayReport:
        recording.finish()  # what the file holds after the batches replayed
        truncated, problem = recording.truncated, recording.problem
        return ReplayReport(
            batches, calls, divergence, truncated, fingerprint_ok, header, problem, tuple(warnings)
        )

    if not recording.any():  # nothing to replay (or a header that says nothing usable)
        return report(0, 0, None)
    # a session of its own, in no session store and not among the dispatcher's: a replay
    # starts from nothing each time, whatever ran through this dispatcher before
    opened: list[Session] = []  # the session replaying now, once one is: the one to close
    # Only a hook may read that session's history (`ToolContext.history`): no handler runs
    # but `find_tools`, which reads none, and the gate is the recorded one. Without hooks it
    # keeps none, so each batch's calls and results are freed once compared, rather than
    # kept to the end and walked by every collection of the garbage collector meanwhile.
    hooks = dispatcher.hook_set
    history_limit = DEFAULT_HISTORY_LIMIT if hooks.before or hooks.after else 0

    def fresh(of: Mapping[str, Any]) -> Session:
        """A session of its own for the batches of the header or `session` record `of`,
        the one before it closed."""
        if opened:
            opened.pop().close()
        mode = of.get("mode", "deferred")
        name = f"replay:{of.get('session', '')}"
        opened.append(Session(dispatcher, name, mode=mode, kept=False, history_limit=history_limit))
        return opened[0]

    try:
        return await _replay_batches(header, recording, dispatcher, fresh, report)
    finally:
        if opened:
            opened.pop().close()


def _replayed_calls(
    recorded: Sequence[Mapping[str, Any]], plan: Sequence[Mapping[str, Any]]
) -> tuple[list[Any], list[str], list[str] | None, list[tuple[str, str]]]:
    """The calls of a batch record as replay hands them to pass 1 (`_replayed_call`), their
    ids, their arguments if every call holds them as text (None if one does not), and the
    (id, name) of each call the plan says was stopped, to be marked as the session
    store's started mark did then (`_mark_stopped`)."""
    calls: list[Any] = []
    call_ids: list[str] = []
    texts: list[str] | None = []
    stopped: list[tuple[str, str]] = []
    for item, row in zip(recorded, plan, strict=True):
        arguments = item.get("arguments")
        if (
            len(item) == 3  # nothing but these three: no "raw", "opaque" nor "unreadable"
            and type(arguments) is str
            and arguments
            and type(call_id := item.get("id")) is str
            and type(name := item.get("name")) is str
        ):
            calls.append({"id": call_id, "function": {"name": name, "arguments": arguments}})
        else:
            calls.append(_replayed_call(item))
            call_id = str(item.get("id", ""))
        call_ids.append(call_id)
        if texts is not None:
            if type(arguments) is str:
                texts.append(arguments)
            else:
                texts = None
        if row["how"] == "stopped":
            stopped.append((call_id, row["name"]))
    return calls, call_ids, texts, stopped


def _mark_stopped(session: Session, call_id: str, name: str) -> None:
    """Mark the call `call_id` of `name` stopped in `session`, as the session store's
    started mark did then."""
    placeholder = ToolResult(call_id, name, Status.failed, "")
    session._planner_state.finished[call_id] = FinishedCall(STOPPED_KEY, placeholder)


def _rows_calls(
    rows: list[list[Any]],
) -> tuple[list[Any], list[str], list[str] | None, list[tuple[str, str]]]:
    """`_replayed_calls` of a `rows` record's rows, read as they are (`_rows_formed` checked
    them): the calls of the batch record they stand for, as replay hands them to pass 1."""
    calls: list[Any] = []
    call_ids: list[str] = []
    texts: list[str] | None = []
    stopped: list[tuple[str, str]] = []
    for row in rows:
        call_id, name, arguments = row[0], row[1], row[2]
        if type(arguments) is str and arguments and type(name) is str:
            calls.append({"id": call_id, "function": {"name": name, "arguments": arguments}})
        else:
            calls.append(_replayed_call({"id": call_id, "name": name, "arguments": arguments}))
        call_ids.append(call_id)
        if texts is not None:
            if type(arguments) is str:
                texts.append(arguments)
            else:
                texts = None
        if row[4] == "stopped":
            stopped.append((call_id, _planned_name(row)))
    return calls, call_ids, texts, stopped


class _Served(NamedTuple):
    """What replays one batch (`_served_batch`)."""

    calls: list[Any]  # as pass 1 reads them
    call_ids: list[str]
    serve: _BatchServer  # pass 2's runner, serving the recorded results
    gate: Callable[..., Any]  # answering as recorded
    answers: dict[str, Answer] | None  # the answers recorded
    stopped: list[tuple[str, str]]  # the calls to mark stopped before it plans (`_mark_stopped`)


def _served_batch(number: int, line: int, batch: dict[str, Any], rewriters: bool) -> _Served:
    """What replays the batch record, or `rows` record (`_Stream` checked its rows), `batch`
    on line `line`, the `number`th batch."""
    control = batch.get("control")
    if batch["type"] == "rows":  # no decisions: the recorded gate asked nothing
        rows = batch["rows"]
        calls, call_ids, texts, stopped = _rows_calls(rows)
        # arguments as JSON text holding no credential stay so through pass 1, unless a
        # rewriter changes them: one scan for the whole batch
        clean = not rewriters and texts is not None and _none_may_hold_credentials(texts)
        serve = _BatchServer(number, line, None, None, clean=clean, control=control, rows=rows)
        return _Served(calls, call_ids, serve, _UNDECIDED, None, stopped)
    calls, call_ids, texts, stopped = _replayed_calls(batch["calls"], batch["plan"])
    decisions = batch.get("decisions", {})
    # ... nor a recorded decision
    clean = not rewriters and not decisions and texts is not None and _none_may_hold_credentials(texts)
    serve = _BatchServer(number, line, batch["plan"], batch["results"], clean=clean, control=control)
    gate = _recorded_gate(decisions) if decisions else _UNDECIDED
    answers = {
        k: Answer(v["answer"])
        for k, v in decisions.items()
        if isinstance(v, Mapping) and isinstance(v.get("answer"), str)
    }
    return _Served(calls, call_ids, serve, gate, answers, stopped)


def _served_ahead(
    batches: _Stream, rewriters: bool
) -> Iterator[tuple[int, int, dict[str, Any], _Served | None]]:
    """(number, line, record, `_served_batch`) of each batch of `batches` in turn (None and
    the number before for a `session` record), those of a run the stream read together
    (`_Stream.next_run`) made before the first of them is handed on: together, as the
    lines were read, rather than each between two dispatches."""
    number = 0
    while run := batches.next_run():
        made: list[tuple[int, int, dict[str, Any], _Served | None]] = []
        for line, batch in run:
            if batch["type"] == "session":
                made.append((number, line, batch, None))
                continue
            number += 1
            made.append((number, line, batch, _served_batch(number, line, batch, rewriters)))
        yield from made


async def _replay_batches(
    header: Mapping[str, Any],
    batches: _Stream,
    dispatcher: Dispatcher,
    fresh: Callable[[Mapping[str, Any]], Session],
    report: Callable[[int, int, Divergence | None], ReplayReport],
) -> ReplayReport:
    """The `batches` (line, record) of a recording with `header` through a session of
    their own (`fresh`), compared one by one; after a `session` record, through another."""
    calls_seen = 0
    continues = header.get("continues")
    last_run = continues.get("run") if isinstance(continues, dict) else None
    rewriters = bool(dispatcher.rewriters)
    session = fresh(header)
    number = 0
    for number, line, batch, served in _served_ahead(batches, rewriters):
        if served is None:  # a session record: another session's batches from here, from nothing
            session, last_run = fresh(batch), None
            continue
        if last_run is not None and batch["run"] != last_run:
            session.new_run()
        last_run = batch["run"]
        calls, call_ids, serve, gate, answers, stopped = served
        for call_id, name in stopped:
            _mark_stopped(session, call_id, name)
        try:
            results = await session._dispatch(
                calls, decisions=answers, all_loaded=bool(batch.get("all_loaded")), runner=serve, gate=gate
            )
        except (HookBlocked, DispatchInterrupted, KeyboardInterrupt) as exc:
            if isinstance(exc, KeyboardInterrupt) and not any(exc is cut for cut in serve.raised):
                raise  # a Ctrl-C of the replay's own
            if serve.divergences:
                return report(number, calls_seen, serve.divergences[min(serve.divergences)])
            if batch.get("control") == type(exc).__name__:
                calls_seen += len(calls)
                continue
            expected = str(batch.get("control"))
            return report(
                number, calls_seen, Divergence(number, -1, "", expected, type(exc).__name__, "control", line)
            )
        divergence = _first_divergence(serve, call_ids, results)
        if divergence is not None:
            return report(number, calls_seen + divergence.index, divergence)
        if batch.get("control") is not None:
            expected = str(batch["control"])
            return report(number, calls_seen, Divergence(number, -1, "", expected, "None", "control", line))
        calls_seen += len(results)
    return report(number, calls_seen, None)
