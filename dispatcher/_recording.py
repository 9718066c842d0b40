"""Recording a session to JSONL, and replaying it offline through the same three passes.

A recording is a header line (format version, registry fingerprint, caller's metadata)
then one line per committed batch: the calls as given, the gate decisions, how pass 1
decided each call, and the results. Each line is written whole with one `write`, so a
crash can at worst leave a truncated last line; replay reports it and replays the rest.

Replay runs no tool: pass 2's runner serves the recorded result of each call that runs,
the gate answers with the recorded decision, and the first place where the passes
decide otherwise than the recording says is reported as a `Divergence`.

No secret is written (`_credentials` says what counts as one): arguments, gate
decisions and the plan's keys are those of the redacted arguments, and each secret of a
batch that a result echoes (at least `MIN_ECHO_LENGTH` characters) is replaced in that
result's text by its marker. A call's arguments that are a JSON text which is not an
object are kept as they are. Replay treats the calls and results it makes the same way
before comparing, so the same secret matches and a different one diverges. The file is
created 0600.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ._credentials import credential_values, redact_arguments, redact_text
from ._exceptions import DispatchInterrupted, HookBlocked
from ._plan import FIND_TOOLS, Plan, PlannedCall, call_key, canonical_json
from ._registry import Registry
from ._results import normalize_output
from ._types import Allow, Answer, Decision, Deny, Interrupt, Status, ToolCall, ToolContext, ToolResult

if TYPE_CHECKING:
    from ._dispatcher import Dispatcher

__all__ = ["FORMAT_VERSION", "Divergence", "Recorder", "ReplayReport", "read_recording", "replay"]

FORMAT_VERSION = 1
_PRIVATE_FILE = 0o600


def _redacted(arguments: Mapping[str, Any] | str, secrets: set[str]) -> Mapping[str, Any] | str:
    """`arguments` with their credentials replaced by markers; the secrets go to `secrets`.
    Arguments given as JSON text stay text (rewritten only when they hold a credential)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
        if not isinstance(parsed, dict):
            return arguments
        redacted: Mapping[str, Any] | str = _redacted(parsed, secrets)
        return arguments if redacted == parsed else json.dumps(redacted, ensure_ascii=False)
    secrets.update(credential_values(arguments))
    return redact_arguments(arguments)


def _call_json(item: Any, secrets: set[str]) -> dict[str, Any]:
    try:
        call = ToolCall.parse(item)
    except (TypeError, ValueError):
        return {"unreadable": _unreadable_json(item)}
    return {"id": call.id, "name": call.name, "arguments": _redacted(call.arguments, secrets)}


def _unreadable_json(item: Any) -> Any:
    """An item pass 1 could not read, as replay can hand it back: a mapping of JSON values
    that carries no credential as it is (replay then reads it, and fails, the same way),
    anything else as its repr."""
    if isinstance(item, Mapping):
        try:
            if not credential_values(item) and json.loads(json.dumps(item)) == item:
                return dict(item)
        except (TypeError, ValueError, RecursionError):
            pass
    return repr(item)


def _recorded_key(planned: PlannedCall, secrets: set[str]) -> str | None:
    """The call's key as pass 1 computes it from its redacted arguments: the key a
    recording holds and replay compares."""
    secrets.update(credential_values(planned.args))
    if planned.key is None:
        return None
    redacted = redact_arguments(planned.args)
    return planned.key if redacted == dict(planned.args) else call_key(planned.name, canonical_json(redacted))


def _result_json(result: ToolResult, secrets: set[str]) -> dict[str, Any]:
    recorded = result.to_json()
    recorded["content"] = redact_text(result.content, secrets)
    return recorded


def _how(planned: PlannedCall, result: ToolResult | None) -> str:
    if planned.leader is not None:
        return "follow"
    if planned.outcome is not None:
        if planned.outcome.deduped:
            return "deduped"
        if planned.outcome.cached:
            return "ran"  # a cache hit then is a run now, when the cache may be empty
        return planned.outcome.status.value
    return "ran" if result is not None else "unfinished"


def _decision_json(decision: Decision, secrets: set[str]) -> dict[str, Any]:
    if isinstance(decision, Allow):
        return {"allow": None if decision.args is None else _redacted(decision.args, secrets)}
    if isinstance(decision, Deny):
        return {"deny": decision.reason}
    if isinstance(decision, Answer):
        return {"answer": redact_text(normalize_output(decision.content), secrets)}
    return {"interrupt": decision.reason}


log = logging.getLogger("threepass.recording")


class Recorder:
    """Appends a session's batches to a JSONL file."""

    def __init__(
        self,
        path: Path,
        *,
        registry: Registry,
        session_id: str,
        mode: str,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        self._header = {
            "type": "header",
            "format": FORMAT_VERSION,
            "fingerprint": registry.fingerprint(),
            "session": session_id,
            "mode": mode,
            "meta": dict(meta or {}),
        }
        self._started = path.exists() and path.stat().st_size > 0
        self.problem: Exception | None = None

    def close(self) -> None:
        """The session is closing: nothing stays open between batches, so nothing to do."""

    def set_meta(self, **meta: Any) -> None:
        self._header["meta"].update(meta)  # type: ignore[attr-defined]

    def _append(self, record: Mapping[str, Any]) -> None:
        """Append one line. A write that fails (a full disk, a folder gone) is logged once
        and ends the recording: what is on disk stays a readable prefix of the session
        (replay reports a cut last line as truncated), and the batch's results still
        reach the caller, since its tools have run."""
        if self.problem is not None:
            return
        try:
            # ASCII with escapes: a lone surrogate in a call (a model's slip) is kept as
            # "\ud800", readable back exactly, where raw it could not be written as UTF-8
            line = json.dumps(record, ensure_ascii=True, default=str) + "\n"
            if not self._started:
                line = json.dumps(self._header, ensure_ascii=True, default=str) + "\n" + line
            # created readable by its owner only (a umask can narrow that, never widen it)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, _PRIVATE_FILE)
            with open(fd, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
        except (OSError, TypeError, ValueError, RecursionError) as exc:
            # OSError: a full disk, a folder gone; the others: a call built in code with
            # arguments JSON cannot hold (keys that are not text, a structure too deep)
            self.problem = exc
            log.error("recording to %s failed and stops here: %s", self.path, exc)
            return
        self._started = True

    def record_batch(
        self,
        *,
        run_id: int,
        round: int,
        calls: Sequence[Any],
        plan: Plan,
        results: Sequence[ToolResult | None],
        decisions: Mapping[str, Decision],
        control: BaseException | None,
        all_loaded: bool = False,
    ) -> None:
        secrets: set[str] = set()  # filled by the redaction of calls, decisions and keys
        recorded_calls = [_call_json(c, secrets) for c in calls]
        recorded_decisions = {k: _decision_json(v, secrets) for k, v in decisions.items()}
        plan_rows = [
            {"name": p.name, "key": _recorded_key(p, secrets), "how": _how(p, r)}
            for p, r in zip(plan.calls, results, strict=True)
        ]
        self._append(
            {
                "type": "batch",
                "run": run_id,
                "round": round,
                "all_loaded": all_loaded,  # `invoke`: every tool counts as loaded
                "calls": recorded_calls,
                "decisions": recorded_decisions,
                "plan": plan_rows,
                "results": [None if r is None else _result_json(r, secrets) for r in results],
                "control": None if control is None else type(control).__name__,
            }
        )


@attrs.frozen
class Divergence:
    """Where replay first decided otherwise than the recording."""

    batch: int
    index: int
    call_id: str
    expected: str
    got: str

    def __str__(self) -> str:
        where = f"batch {self.batch}, call {self.index} ({self.call_id})"
        return f"{where}: expected {self.expected}, got {self.got}"


@attrs.frozen
class ReplayReport:
    batches: int
    calls: int
    divergence: Divergence | None
    truncated: bool
    fingerprint_matches: bool
    header: Mapping[str, Any]
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.problem is None


def read_recording(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], list[dict[str, Any]], bool, str | None]:
    """(header, batches, truncated, problem). A last line cut short is `truncated`; a bad
    line elsewhere stops reading there and is named in `problem`."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    ends_cleanly = text.endswith("\n")
    if ends_cleanly:
        lines = lines[:-1]
    records: list[dict[str, Any]] = []
    truncated = False
    problem = None
    for number, line in enumerate(lines, 1):
        last = number == len(lines)
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            if last and not ends_cleanly:
                truncated = True
            else:
                problem = f"line {number} is not a JSON record: {exc}"
            break
        records.append(value)
    if not records or records[0].get("type") != "header":
        return {}, [], truncated, problem or f"{path} has no recording header"
    header = records[0]
    if header.get("format") != FORMAT_VERSION:
        return header, [], truncated, f"recording format {header.get('format')!r}, expected {FORMAT_VERSION}"
    return header, [r for r in records[1:] if r.get("type") == "batch"], truncated, problem


class _DivergenceSignal(HookBlocked):
    """Travels through pass 2 as run control (an ordinary exception would become a
    `failed` result) and is unwrapped by `replay`."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


@attrs.frozen
class _BatchServer:
    """Pass 2's runner during replay: the recorded result of a call that ran then."""

    number: int
    plan_rows: Sequence[Mapping[str, Any]]
    recorded: Sequence[Mapping[str, Any] | None]
    secrets: set[str] = attrs.field(factory=set)  # of the calls served, as the recorder finds them

    async def __call__(self, planned: PlannedCall, ctx: ToolContext) -> ToolResult:
        i = planned.index
        row = self.plan_rows[i] if i < len(self.plan_rows) else None
        want = self.recorded[i] if i < len(self.recorded) else None
        if row is None or row["how"] != "ran" or want is None:
            got = "the call ran"
            raise _DivergenceSignal(Divergence(self.number, i, planned.call_id, f"{row and row['how']}", got))
        key = _recorded_key(planned, self.secrets)
        if row["name"] != planned.name or row["key"] != key:
            expected = f"{row['name']} with key {row['key']}"
            got = f"{planned.name} with key {key}"
            raise _DivergenceSignal(Divergence(self.number, i, planned.call_id, expected, got))
        recorded = ToolResult.from_json(want)
        if planned.name == FIND_TOOLS and planned.tool is not None:
            # the dispatcher's own tool: it touches nothing outside the session, and loading
            # the schemas it finds is what later calls depend on, so it runs for real
            again = normalize_output(await planned.tool.tool.handler(planned.args, ctx))
            again = redact_text(again, self.secrets)
            if recorded.status is Status.ok and again != recorded.content:
                raise _DivergenceSignal(
                    Divergence(
                        self.number, i, planned.call_id, repr(recorded.content[:120]), repr(again[:120])
                    )
                )
        return recorded


def _same(expected: Mapping[str, Any], got: ToolResult, secrets: set[str]) -> str | None:
    """What differs between a recorded result and a replayed one (None: the same), the
    replayed one's text redacted as the recorder redacts it."""
    if expected["status"] != got.status.value:
        return f"status {got.status.value}"
    content = redact_text(got.content, secrets)
    if expected["content"] != content:
        return f"content {content[:120]!r}"
    if bool(expected.get("deduped")) != got.deduped:
        return f"deduped={got.deduped}"
    return None


async def replay(
    path: str | os.PathLike[str],
    dispatcher: Dispatcher,
) -> ReplayReport:
    """Replay the recording at `path` through `dispatcher`'s passes without running any tool."""
    header, batches, truncated, problem = read_recording(path)
    fingerprint_ok = header.get("fingerprint") == dispatcher.registry.fingerprint()
    session = dispatcher.session(f"replay:{header.get('session', '')}", mode=header.get("mode", "deferred"))
    calls_seen = 0
    last_run = None
    for number, batch in enumerate(batches, 1):
        if last_run is not None and batch["run"] != last_run:
            session.new_run()
        last_run = batch["run"]
        recorded = batch["results"]
        plan_rows = batch["plan"]
        decisions = batch.get("decisions", {})

        serve = _BatchServer(number, plan_rows, recorded)

        def gate(call: ToolCall, ctx: ToolContext, *, _d: Mapping[str, Any] = decisions) -> Decision:
            found = _d.get(call.id)
            if found is None:
                return Interrupt("replay: the recording holds no decision for this call", None)
            if "deny" in found:
                return Deny(found["deny"])
            if "interrupt" in found:
                return Interrupt(found["interrupt"], None)
            return Allow(found.get("allow"))

        calls = [c.get("unreadable", c) for c in batch["calls"]]
        answers = {k: Answer(v["answer"]) for k, v in decisions.items() if "answer" in v}
        try:
            results = await session._dispatch(
                calls, decisions=answers, all_loaded=bool(batch.get("all_loaded")), runner=serve, gate=gate
            )
        except _DivergenceSignal as signal:
            return ReplayReport(
                number, calls_seen, signal.divergence, truncated, fingerprint_ok, header, problem
            )
        except (HookBlocked, DispatchInterrupted) as exc:
            if batch.get("control") == type(exc).__name__:
                calls_seen += len(calls)
                continue
            div = Divergence(number, -1, "", f"control {batch.get('control')}", type(exc).__name__)
            return ReplayReport(number, calls_seen, div, truncated, fingerprint_ok, header, problem)
        for i, (want, got) in enumerate(zip(recorded, results, strict=False)):
            if want is None:
                continue
            differs = _same(want, got, serve.secrets)
            if differs is not None:
                div = Divergence(
                    number, i, got.call_id, f"{want['status']} {want['content'][:120]!r}", differs
                )
                return ReplayReport(number, calls_seen + i, div, truncated, fingerprint_ok, header, problem)
        calls_seen += len(results)
    return ReplayReport(len(batches), calls_seen, None, truncated, fingerprint_ok, header, problem)
