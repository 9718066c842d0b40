"""A model checker for the kernel's promises: a hypothesis state machine drives real
sessions (two of one dispatcher, and one of a second dispatcher on the same result store)
over a tiny world of files, and compares every batch with a serial reference of what its
results must be and which calls must run.

The promises checked, batch by batch:
- one result per call, in call order, ids preserved; a repeated id is `invalid_arguments`;
- nothing run twice: a read-only success is served (`deduped`) within a run until a write
  that overlaps what it read; writers always run; failures are never remembered across rounds;
- nothing run that a human refused: a `Deny` never runs, an `Allow` runs the call once and is
  spent, an `Answer` is the call's result with nothing run;
- nothing stale served: after a write, no session of the same dispatcher is served an
  earlier read of it, by dedupe or by the shared result cache;
- exactly once across a resume: a batch cut short by a tool raising `DispatchInterrupted`
  (or `HookBlocked`) keeps what finished, and dispatching it again serves those calls and
  runs only the rest;
- the same when each session is driven in turn by two workers (Dispatchers sharing a
  session store): the conversation is one, whichever worker dispatches.

The reference is serial: pass 2 runs concurrent calls together, but the barriers make the
outcome that of running them in call order, so that is what the model computes. What ran
is read from the tools' own execution log.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import anyio.from_thread
import attrs
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from cache import MemoryResultCache, MemorySessionStore
from dispatcher import (
    Allow,
    Answer,
    CachePolicy,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    HookBlocked,
    Interrupt,
    Registry,
    Session,
    Status,
    Tool,
    ToolCall,
    ToolContext,
    ToolError,
    ToolResult,
)

BACKENDS = ("trio", "asyncio")

A, B, FOLDER = "/w/a", "/w/b", "/w"
PATHS = (A, B)
WRITERS = frozenset({"write", "gated_write", "spoil"})

Decision = Allow | Deny | Answer


# -- the world and its tools -------------------------------------------------------------


@attrs.define
class World:
    """Two files under one folder, and a log of every execution (call id, tool)."""

    files: dict[str, tuple[str, int]] = attrs.field(factory=lambda: {p: ("", 0) for p in PATHS})
    log: list[tuple[str, str]] = attrs.field(factory=list)
    hold: anyio.Event | None = None
    held: anyio.Event | None = None
    """While set, the next `read` or `peek` takes its snapshot, sets `held`, then waits for `hold`."""


@attrs.define
class Stage:
    """The world the tools act on: the machine's registries are built once per test, since
    checking their schemas costs more than most examples' steps, and each example puts a
    fresh world here."""

    world: World = attrs.field(factory=World)


def shown(path: str, files: Mapping[str, tuple[str, int]]) -> str:
    """What a read of `path` returns: its text and its version (writes count up)."""
    text, version = files[path]
    return f"{path}={text}@{version}"


def listing(files: Mapping[str, tuple[str, int]]) -> str:
    return ";".join(shown(p, files) for p in PATHS)


def file_key(path: str) -> str:
    return f"file:{path}"


def _schema(**props: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }


PATH_PROP = {"type": "string", "enum": list(PATHS)}


def build_registry(stage: Stage) -> Registry:
    """read, read_dir, peek (shared cache), write, gated_write (confirm), spoil (writes, then
    fails), boom (fails), ask and block (interrupt or block the batch from inside; each runs
    alone) over the world on `stage` when they run."""

    def ran(ctx: ToolContext) -> None:
        stage.world.log.append((ctx.call_id, ctx.tool_name))

    async def held() -> None:
        """While a race is on, the first read to get here waits for the write to commit."""
        world = stage.world
        if world.hold is not None and world.held is not None and not world.held.is_set():
            world.held.set()
            await world.hold.wait()

    async def read(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        content = shown(args["path"], stage.world.files)
        await held()
        return content

    async def read_dir(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        return listing(stage.world.files)

    async def peek(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        content = "peek " + shown(args["path"], stage.world.files)
        await held()
        return content

    def write(args: Mapping[str, Any], ctx: ToolContext) -> str:  # sync: a worker thread
        ran(ctx)
        path = args["path"]
        version = stage.world.files[path][1] + 1
        stage.world.files[path] = (args["text"], version)
        return f"wrote {path}@{version}"

    def spoil(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        path = args["path"]
        stage.world.files[path] = ("spoiled", stage.world.files[path][1] + 1)
        raise ToolError("spoiled the file halfway")

    def boom(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        raise RuntimeError("boom")

    async def ask(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        call = ToolCall(ctx.call_id, "ask", dict(args))
        raise DispatchInterrupted([(call, "ask", {"q": args["q"]})])

    async def block(args: Mapping[str, Any], ctx: ToolContext) -> str:
        ran(ctx)
        raise HookBlocked("not now", call_id=ctx.call_id)

    def reads_path(args: Mapping[str, Any]) -> set[str]:
        return {file_key(args["path"])}

    def reads_folder(args: Mapping[str, Any]) -> set[str]:
        return {file_key(FOLDER)}

    path_only = _schema(path=PATH_PROP)
    path_text = _schema(path=PATH_PROP, text={"type": "string"})
    on_path: dict[str, Any] = {"deferred": False, "concurrent": True}
    reader, writer = {**on_path, "reads": reads_path}, {**on_path, "writes": reads_path}
    return Registry(
        [
            Tool("read", "Read a file.", read, path_only, **reader),
            Tool("read_dir", "List the folder.", read_dir, _schema(), reads=reads_folder, **on_path),
            Tool("peek", "Read a file, cached.", peek, path_only, cache=CachePolicy(), **reader),
            Tool("write", "Write a file.", write, path_text, **writer),
            Tool("gated_write", "Write, once approved.", write, path_text, confirm=True, **writer),
            Tool("spoil", "Write, then fail.", spoil, path_only, **writer),
            Tool("boom", "Fail.", boom, _schema(), **on_path),
            Tool("ask", "Ask a human.", ask, _schema(q={"type": "string"}), deferred=False),
            Tool("block", "Stop the batch.", block, _schema(), deferred=False),
        ]
    )  # fmt: skip


def interrupt_every_call(call: ToolCall, ctx: ToolContext) -> Interrupt:
    """The gate: every confirmed call waits for a human."""
    return Interrupt("approve?", {"call": call.id})


# -- the reference: a serial model of what each batch must come to -----------------------


@attrs.frozen
class Outcome:
    """What one call's result must be. `content` None: not compared (a failure's JSON);
    `cached` None: not asserted."""

    status: Status
    content: str | None = None
    deduped: bool = False
    cached: bool | None = False
    effect_uncertain: bool = False


@attrs.frozen
class Prediction:
    """A batch's expected end: its results, or (None) the interrupt naming `pending` (with
    `blocked`, the HookBlocked of the one call in `pending`); and the call ids whose tool
    must execute."""

    results: tuple[Outcome, ...] | None
    pending: tuple[str, ...]
    executed: tuple[str, ...]
    blocked: bool = False


@attrs.frozen
class _Decided:
    outcome: Outcome
    carried: bool = False  # kept for a resume: an answer, or a result served from the cut batch
    from_cache: bool = False


@attrs.frozen
class _Follow:
    leader: int


@attrs.frozen
class _Run:
    approved: bool = False
    args: Mapping[str, Any] | None = None  # what an Allow(args) changed them to


_Step = _Decided | _Follow | _Run


@attrs.define
class ModelSession:
    dispatcher: int
    dedupe: dict[str, tuple[Outcome, frozenset[str]]] = attrs.field(factory=dict)
    finished: dict[str, tuple[str, Outcome]] = attrs.field(factory=dict)
    spent: set[str] = attrs.field(factory=set)


def overlap(a: Sequence[str] | frozenset[str], b: Sequence[str] | frozenset[str]) -> bool:
    """The same resource, or a folder above or below it."""
    return any(x == y or x.startswith(y + "/") or y.startswith(x + "/") for x in a for y in b)


def reads_of(name: str, args: Mapping[str, Any]) -> frozenset[str]:
    if name in ("read", "peek"):
        return frozenset({file_key(args["path"])})
    if name == "read_dir":
        return frozenset({file_key(FOLDER)})
    return frozenset()


def writes_of(name: str, args: Mapping[str, Any]) -> frozenset[str]:
    return frozenset({file_key(args["path"])}) if name in WRITERS else frozenset()


def args_of(call: ToolCall) -> dict[str, Any]:
    """The arguments of a call the machine made (always a mapping)."""
    assert not isinstance(call.arguments, str), call
    return dict(call.arguments)


def key_of(name: str, args: Mapping[str, Any]) -> str:
    kept = {k: v for k, v in args.items() if not (name == "peek" and k == "force")}
    return json.dumps([name, kept], sort_keys=True)


def forced(call: ToolCall) -> bool:
    return call.name == "peek" and bool(args_of(call).get("force"))


class Reference:
    """The contract, run serially over plain values: files, each session's dedupe map,
    kept results and spent approvals, and the shared result store."""

    def __init__(self, sessions: Mapping[str, int]) -> None:
        self.files: dict[str, tuple[str, int]] = {p: ("", 0) for p in PATHS}
        self.cache: dict[str, tuple[str, frozenset[str]]] = {}
        self.sessions = {name: ModelSession(d) for name, d in sessions.items()}

    def new_run(self, name: str) -> None:
        s = self.sessions[name]
        s.dedupe.clear()
        s.finished.clear()

    def _invalidate(self, dispatcher: int, writes: frozenset[str]) -> None:
        """A write drops every overlapping read of every session of its dispatcher, and of
        the shared store."""
        for s in self.sessions.values():
            if s.dispatcher == dispatcher:
                for key in [k for k, (_, reads) in s.dedupe.items() if overlap(reads, writes)]:
                    del s.dedupe[key]
        for key in [k for k, (_, reads) in self.cache.items() if overlap(reads, writes)]:
            del self.cache[key]

    def _execute(self, call: ToolCall) -> Outcome:
        args = args_of(call)
        if call.name in ("read",):
            return Outcome(Status.ok, shown(args["path"], self.files))
        if call.name == "peek":
            return Outcome(Status.ok, "peek " + shown(args["path"], self.files))
        if call.name == "read_dir":
            return Outcome(Status.ok, listing(self.files))
        if call.name in ("write", "gated_write"):
            version = self.files[args["path"]][1] + 1
            self.files[args["path"]] = (args["text"], version)
            return Outcome(Status.ok, f"wrote {args['path']}@{version}")
        if call.name == "spoil":
            self.files[args["path"]] = ("spoiled", self.files[args["path"]][1] + 1)
            return Outcome(Status.failed, effect_uncertain=True)
        assert call.name == "boom", call
        return Outcome(Status.failed)

    def _plan(
        self, s: ModelSession, calls: Sequence[ToolCall], decisions: Mapping[str, Decision]
    ) -> tuple[list[_Step], list[str]]:
        """Pass 1: how each call is answered, and the gated calls nobody approved."""
        steps: list[_Step] = []
        gated: list[str] = []
        seen: set[str] = set()
        leaders: dict[str, int] = {}
        pending_writes: list[str] = []
        for i, call in enumerate(calls):
            args = args_of(call)
            key = key_of(call.name, args)
            if call.id in seen:
                steps.append(_Decided(Outcome(Status.invalid_arguments)))
                continue
            seen.add(call.id)
            decision = decisions.get(call.id)
            done = s.finished.get(call.id)
            if isinstance(decision, Answer):
                steps.append(_Decided(Outcome(Status.ok, str(decision.content)), carried=True))
            elif isinstance(decision, Deny):
                steps.append(_Decided(Outcome(Status.denied)))
            elif done is not None and done[0] == key:
                served = attrs.evolve(done[1], deduped=True, cached=None)
                steps.append(_Decided(served, carried=True))
            elif call.name not in WRITERS:
                force = forced(call)
                remembered = s.dedupe.get(key)
                stored = self.cache.get(key) if call.name == "peek" else None
                if not force and key in leaders:
                    steps.append(_Follow(leaders[key]))
                elif not force and remembered is not None and not overlap(remembered[1], pending_writes):
                    steps.append(_Decided(attrs.evolve(remembered[0], deduped=True, cached=None)))
                elif not force and stored is not None and not overlap(stored[1], pending_writes):
                    steps.append(_Decided(Outcome(Status.ok, stored[0], cached=True), from_cache=True))
                else:
                    leaders[key] = i
                    steps.append(_Run())
            else:
                writes = writes_of(call.name, args)
                pending_writes.extend(writes)
                for k in [
                    k
                    for k, j in leaders.items()
                    if overlap(reads_of(calls[j].name, args_of(calls[j])), writes)
                ]:
                    del leaders[k]
                approved, changed = False, None
                if call.name == "gated_write":
                    if isinstance(decision, Allow) and call.id not in s.spent:
                        approved, changed = True, decision.args
                    else:
                        gated.append(call.id)
                steps.append(_Run(approved, changed))
        return steps, gated

    def dispatch(self, name: str, calls: Sequence[ToolCall], decisions: Mapping[str, Decision]) -> Prediction:
        """What `dispatch(calls, decisions=...)` on session `name` must do; the model's state
        moves as the kernel's must."""
        s = self.sessions[name]
        steps, gated = self._plan(s, calls, decisions)
        if gated:  # the gate interrupts before anything runs, and nothing changes
            return Prediction(None, tuple(gated), ())
        # pass 2, in call order: a call after an interrupting one never starts
        outcomes: list[Outcome | None] = [None] * len(calls)
        executed: list[str] = []
        cut: str | None = None
        for i, step in enumerate(steps):
            if isinstance(step, _Run) and cut is None:
                executed.append(calls[i].id)
                if calls[i].name in ("ask", "block"):
                    cut = calls[i].id
                else:
                    changed = step.args
                    call = calls[i] if changed is None else attrs.evolve(calls[i], arguments=dict(changed))
                    outcomes[i] = self._execute(call)
        for i, step in enumerate(steps):
            if isinstance(step, _Decided):
                outcomes[i] = step.outcome
            elif isinstance(step, _Follow):
                led = outcomes[step.leader]
                outcomes[i] = None if led is None else attrs.evolve(led, deduped=True)
        # pass 3, in call order
        for i, call in enumerate(calls):
            outcome, step = outcomes[i], steps[i]
            if outcome is None:
                continue
            ran = isinstance(step, _Run)
            if call.name in WRITERS:
                if ran and (outcome.status is Status.ok or outcome.effect_uncertain):
                    self._invalidate(s.dispatcher, writes_of(call.name, args_of(call)))
                if isinstance(step, _Run) and step.approved:
                    s.spent.add(call.id)
                continue
            if outcome.status is not Status.ok:
                continue  # failures are never remembered
            key, reads = key_of(call.name, args_of(call)), reads_of(call.name, args_of(call))
            if ran or (isinstance(step, _Decided) and step.from_cache):
                s.dedupe[key] = (outcome, reads)
            if ran and call.name == "peek":
                assert outcome.content is not None
                self.cache[key] = (outcome.content, reads)
        carried = [i for i, step in enumerate(steps) if isinstance(step, _Decided) and step.carried]
        if cut is not None:
            for i, call in enumerate(calls):
                outcome = outcomes[i]
                if outcome is not None and (isinstance(steps[i], _Run) or i in carried):
                    s.finished[call.id] = (key_of(call.name, args_of(call)), outcome)
            blocked = calls[[c.id for c in calls].index(cut)].name == "block"
            return Prediction(None, (cut,), tuple(executed), blocked=blocked)
        for i in carried:
            s.finished.pop(calls[i].id, None)
        done = tuple(o for o in outcomes if o is not None)
        assert len(done) == len(calls)
        return Prediction(done, (), tuple(executed))

    def runs(self, name: str, call: ToolCall) -> bool:
        """Whether `call`, alone in a batch of session `name`, would run (not be served)."""
        steps, _ = self._plan(self.sessions[name], [call], {})
        return isinstance(steps[0], _Run)

    def race(self, reader: str, writer: str, read: ToolCall, write: ToolCall) -> tuple[Outcome, Prediction]:
        """`read` (a read or peek that runs) takes its snapshot, then `write` runs and
        commits in another session, then the read returns: its result stands, but it is
        neither remembered nor cached, since what it read moved while it ran."""
        before = self._execute(read)  # what it read: the files before the write
        return before, self.dispatch(writer, [write], {})


# -- the machine ---------------------------------------------------------------------------


@attrs.frozen
class Variant:
    """Which sessions the machine drives (session name -> dispatcher 1 or 2), and whether
    it races a read against a write."""

    name: str
    sessions: Mapping[str, int]
    races: bool = False
    changed_allows: bool = False
    workers: bool = False
    """Each session is driven by either of two Dispatchers sharing a session store."""


SOLO = Variant("solo", {"p": 1, "r": 2})
SESSIONS = Variant("sessions", {"p": 1, "q": 1, "r": 2})
RACES = Variant("races", {"p": 1, "q": 1, "r": 2}, races=True)
APPROVALS = Variant("approvals", {"p": 1, "r": 2}, changed_allows=True)
"""As SOLO, and approvals mostly change a write's text (`Allow(args)`)."""
WORKERS = Variant("workers", {"p": 1, "r": 2}, workers=True)
"""As SOLO, each session's batches, resumes and new runs landing on either of two workers."""


@attrs.frozen
class CallSpec:
    name: str
    args: Mapping[str, Any]
    repeat: int | None  # reuse the id of the call this many places back (mod), else a new id
    decision: str | None  # given up front: "allow", "deny", "answer"


KINDS = (
    ("read",) * 3
    + ("peek",) * 4
    + ("read_dir", "write", "write", "gated_write", "spoil", "boom", "ask", "ask", "block")
)


def _tool_call(kind: str, path: str, text: str, force: bool) -> tuple[str, dict[str, Any]]:
    if kind in ("read", "spoil"):
        return kind, {"path": path}
    if kind == "peek":
        return kind, {"path": path, "force": True} if force else {"path": path}
    if kind in ("write", "gated_write"):
        return kind, {"path": path, "text": text}
    if kind == "ask":
        return kind, {"q": "go?" if text == "x" else "stop?"}
    return kind, {}


tool_calls = st.builds(
    _tool_call,
    st.sampled_from(KINDS),
    st.sampled_from(PATHS),
    st.sampled_from(("x", "y")),
    st.sampled_from((False,) * 4 + (True,)),
)
call_specs = st.builds(
    lambda tc, repeat, decision: CallSpec(tc[0], tc[1], repeat, decision),
    tool_calls,
    st.sampled_from((None,) * 9 + (0,)),
    st.sampled_from((None,) * 7 + ("allow", "deny", "answer")),
)
batches = st.lists(call_specs, min_size=1, max_size=5)

Got = list[ToolResult] | DispatchInterrupted | HookBlocked


class KernelMachine(RuleBasedStateMachine):
    """Real sessions against the reference. Each example makes its own world, result store,
    session store and dispatchers; the event loop (`portal`) and the registries, which hold
    no state of their own, are the test's, made once by `run_machine`."""

    variant = SOLO
    portal: anyio.from_thread.BlockingPortal
    stage: Stage
    registries: Mapping[tuple[int, int], Registry]
    """One per dispatcher: (worker 0 or 1, dispatcher 1 or 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.world = self.stage.world = World()
        store = MemoryResultCache()
        kept = MemorySessionStore() if self.variant.workers else None

        def worker(w: int) -> dict[int, Dispatcher]:
            return {
                n: Dispatcher(self.registries[w, n], cache=store, gate=interrupt_every_call,
                              session_store=kept)
                for n in (1, 2)
            }  # fmt: skip

        dispatchers = worker(0)
        self.live = {name: dispatchers[d].session(name) for name, d in self.variant.sessions.items()}
        others = worker(1) if self.variant.workers else {}
        self.other = {name: others[d].session(name) for name, d in self.variant.sessions.items() if others}
        """The second worker's object for each session (the WORKERS variant)."""
        self.pinned: dict[str, int] = {}
        """The worker a session's next dispatch goes to (where its new run was asked)."""
        self.model = Reference(self.variant.sessions)
        self.last: dict[str, tuple[list[ToolCall], dict[str, Decision], tuple[str, ...]]] = {}
        """Each session's last batch, its decisions, and the calls it is waiting on, if any."""
        self._ids: Iterator[int] = itertools.count(1)

    # -- driving ----------------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"c{next(self._ids)}"

    def _batch(self, specs: Sequence[CallSpec]) -> tuple[list[ToolCall], dict[str, Decision]]:
        calls: list[ToolCall] = []
        decisions: dict[str, Decision] = {}
        for i, spec in enumerate(specs):
            if spec.repeat is not None and i > 0:
                call_id = calls[i - 1 - spec.repeat % i].id
            else:
                call_id = self._new_id()
            calls.append(ToolCall(call_id, spec.name, dict(spec.args)))
            if spec.decision is not None and call_id not in decisions:
                decisions[call_id] = _decision(spec.decision)
                if spec.name == "gated_write" and spec.decision == "allow" and self.variant.changed_allows:
                    decisions[call_id] = Allow({**spec.args, "text": "z"})
        return calls, decisions

    def _worker(self, data: st.DataObject, name: str) -> int:
        """Which worker drives the next step of a session (always the first but in WORKERS).
        The worker a new run was started on dispatches the session next: `new_run` takes
        effect at that object's next dispatch, as when a user turn lands on one worker."""
        if not self.variant.workers:
            return 0
        pinned = self.pinned.pop(name, None)
        return pinned if pinned is not None else data.draw(st.integers(0, 1), label="worker")

    def _session(self, name: str, worker: int) -> Session:
        return self.other[name] if worker else self.live[name]

    def _run(
        self, name: str, calls: list[ToolCall], decisions: Mapping[str, Decision], worker: int = 0
    ) -> tuple[Got, list[str]]:
        session = self._session(name, worker)
        start = len(self.world.log)

        async def go() -> Got:
            with anyio.fail_after(10):
                try:
                    return await session.dispatch(calls, decisions=dict(decisions) or None)
                except (DispatchInterrupted, HookBlocked) as exc:
                    return exc

        got = self.portal.call(go)
        return got, [call_id for call_id, _ in self.world.log[start:]]

    def _dispatch(
        self, name: str, calls: list[ToolCall], decisions: dict[str, Decision], worker: int = 0
    ) -> None:
        prediction = self.model.dispatch(name, calls, decisions)
        got, ran = self._run(name, calls, decisions, worker)
        check(f"session {name} on worker {worker}", calls, decisions, prediction, got, ran)
        _tell(prediction)
        self.last[name] = (calls, decisions, prediction.pending)

    # -- rules ------------------------------------------------------------------------------

    @rule(data=st.data(), specs=batches)
    def dispatch(self, data: st.DataObject, specs: list[CallSpec]) -> None:
        """A new batch on one of the sessions, with some decisions given up front; a session
        waiting on an interrupted batch is mostly resumed instead (a model rarely abandons one)."""
        name = data.draw(st.sampled_from(sorted(self.live)), label="session")
        if name in self._waiting() and data.draw(st.booleans(), label="resume instead"):
            self._resume(name, data)
            return
        calls, decisions = self._batch(specs)
        self._dispatch(name, calls, decisions, self._worker(data, name))

    def _waiting(self) -> list[str]:
        return sorted(name for name, (_, _, pending) in self.last.items() if pending)

    @precondition(lambda self: bool(self._waiting()))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """An interrupted batch dispatched again, with decisions for (some of) its pending calls."""
        self._resume(data.draw(st.sampled_from(self._waiting()), label="session"), data)

    def _resume(self, name: str, data: st.DataObject) -> None:
        calls, decisions, pending = self.last[name]
        decisions = dict(decisions)
        by_id: dict[str, ToolCall] = {}
        for c in calls:  # a repeated id names the first call that carries it, as the kernel reads it
            by_id.setdefault(c.id, c)
        for call_id in pending:
            asks = by_id[call_id].name in ("ask", "block")
            choices: tuple[str | None, ...] = ("answer", "deny", None) if asks else ("allow", "deny", None)
            if not asks and self.variant.changed_allows:
                choices += ("allow other text",) * 3
            choice = data.draw(st.sampled_from(choices), label=f"decision for {call_id}")
            if choice == "allow other text":
                decisions[call_id] = Allow({**args_of(by_id[call_id]), "text": "z"})
            elif choice is not None:
                decisions[call_id] = _decision(choice)
        self._dispatch(name, calls, decisions, self._worker(data, name))

    @precondition(lambda self: bool(self.last))
    @rule(data=st.data())
    def dispatch_again(self, data: st.DataObject) -> None:
        """A session's last batch sent again as it was, decisions and all (a retried request,
        or a resume with nothing new to say)."""
        name = data.draw(st.sampled_from(sorted(self.last)), label="session")
        calls, decisions, _ = self.last[name]
        self._dispatch(name, calls, decisions, self._worker(data, name))

    @rule(data=st.data())
    def new_run(self, data: st.DataObject) -> None:
        """The next user turn on one session."""
        name = data.draw(st.sampled_from(sorted(self.live)), label="session")
        worker = self._worker(data, name)
        self._session(name, worker).new_run()
        if self.variant.workers:
            self.pinned[name] = worker
        self.model.new_run(name)

    @precondition(lambda self: self.variant.races)
    @rule(
        reader_first=st.booleans(),
        path=st.sampled_from(PATHS),
        text=st.sampled_from(("x", "y")),
        kind=st.sampled_from(("forced peek", "peek", "read")),
    )
    def race(self, reader_first: bool, path: str, text: str, kind: str) -> None:
        """A read in one session of dispatcher 1 takes its snapshot, a write of the same file
        in the other session commits, then the read returns. The read is a forced peek, or
        a peek or read that the model says runs (one it would serve has nothing to race):
        a raced read must be neither remembered by its session nor stored."""
        reader, writer = ("p", "q") if reader_first else ("q", "p")
        name = "read" if kind == "read" else "peek"
        peek = ToolCall(
            self._new_id(), name, {"path": path, "force": True} if kind == "forced peek" else {"path": path}
        )
        if not self.model.runs(reader, peek):
            peek = ToolCall(peek.id, "peek", {"path": path, "force": True})
        write = ToolCall(self._new_id(), "write", {"path": path, "text": text})
        expected_read, expected_write = self.model.race(reader, writer, peek, write)
        start = len(self.world.log)
        got_read, got_write = self.portal.call(
            race_read_and_write, self.world, self.live[reader], peek, self.live[writer], write
        )
        ran = [call_id for call_id, _ in self.world.log[start:]]
        check(
            f"race write in {writer}",
            [write],
            {},
            expected_write,
            got_write,
            [c for c in ran if c == write.id],
        )
        check(
            f"race read in {reader}",
            [peek],
            {},
            Prediction((expected_read,), (), (peek.id,)),
            got_read,
            [c for c in ran if c == peek.id],
        )
        self.last.pop(reader, None)
        self.last.pop(writer, None)


async def race_read_and_write(
    world: World, reader: Session, read: ToolCall, writer: Session, write: ToolCall
) -> tuple[list[ToolResult], list[ToolResult]]:
    """`read` runs in `reader` until it has its snapshot; `write` runs to the end in `writer`;
    then the read finishes."""
    world.hold, world.held = anyio.Event(), anyio.Event()
    out: dict[str, list[ToolResult]] = {}

    async def read_side() -> None:
        out["read"] = await reader.dispatch([read])

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_side)
                await world.held.wait()
                out["write"] = await writer.dispatch([write])
                world.hold.set()
    finally:
        world.hold = world.held = None
    return out["read"], out["write"]


def _tell(prediction: Prediction) -> None:
    """What kinds of batch the machine reached (`--hypothesis-show-statistics`)."""
    if prediction.results is None:
        if prediction.blocked:
            event("blocked by a tool")
        else:
            event("interrupted by a tool" if prediction.executed else "interrupted by the gate")
        return
    event("completed")
    for outcome in prediction.results:
        served = "deduped" if outcome.deduped else "cached" if outcome.cached else "as decided or ran"
        event(f"a call {outcome.status.value}, {served}")


def _decision(kind: str) -> Decision:
    if kind == "allow":
        return Allow()
    if kind == "deny":
        return Deny("no")
    assert kind == "answer", kind
    return Answer("yes")


def check(
    where: str,
    calls: Sequence[ToolCall],
    decisions: Mapping[str, Decision],
    prediction: Prediction,
    got: Got,
    ran: list[str],
) -> None:
    """Compare one dispatch with the reference; every difference is named."""
    problems: list[str] = []
    if Counter(ran) != Counter(prediction.executed):
        problems.append(f"executed {ran}, expected {list(prediction.executed)}")
    if prediction.results is not None:
        expected_end: tuple[str, tuple[str, ...]] = ("completed", ())
    else:
        expected_end = ("blocked" if prediction.blocked else "interrupted", prediction.pending)
    end = _end(got)
    if end != expected_end:
        problems.append(f"{end[0]} {list(end[1])}, expected {expected_end[0]} {list(expected_end[1])}")
    elif prediction.results is None or not isinstance(got, list):
        pass
    elif [r.call_id for r in got] != [c.id for c in calls]:
        problems.append(f"result ids {[r.call_id for r in got]}, expected {[c.id for c in calls]}")
    else:
        for call, result, expected in zip(calls, got, prediction.results, strict=True):
            problems += _compare(call, result, expected)
    if problems:
        shown_calls = [f"{c.id}:{c.name}({args_of(c)})" for c in calls]
        raise AssertionError(
            f"{where}: batch {shown_calls} decisions {decisions}:\n  " + "\n  ".join(problems)
        )


def _end(got: Got) -> tuple[str, tuple[str, ...]]:
    """How a dispatch ended, and the calls it ended on."""
    if isinstance(got, DispatchInterrupted):
        return "interrupted", tuple(c.id for c, _, _ in got.pending)
    if isinstance(got, HookBlocked):
        return "blocked", (str(got.call_id),)
    return "completed", ()


def _compare(call: ToolCall, got: ToolResult, expected: Outcome) -> list[str]:
    problems = []
    if got.status is not expected.status:
        problems.append(
            f"{call.id} ({call.name}): status {got.status.value}, expected {expected.status.value}"
        )
        return problems
    if expected.content is not None and got.content != expected.content:
        stale = call.name in ("read", "peek", "read_dir") and got.content < expected.content
        what = "stale" if stale else "wrong"
        problems.append(
            f"{call.id} ({call.name}): {what} content {got.content!r}, expected {expected.content!r}"
        )
    if got.deduped != expected.deduped:
        problems.append(f"{call.id} ({call.name}): deduped={got.deduped}, expected {expected.deduped}")
    if expected.cached is not None and got.cached != expected.cached:
        problems.append(f"{call.id} ({call.name}): cached={got.cached}, expected {expected.cached}")
    if expected.status is Status.failed and got.effect_uncertain != expected.effect_uncertain:
        problems.append(
            f"{call.id} ({call.name}): effect_uncertain={got.effect_uncertain}, "
            f"expected {expected.effect_uncertain}"
        )
    return problems


# -- the machine, run ------------------------------------------------------------------------

MACHINE_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def run_machine(variant: Variant, backend: str, request: pytest.FixtureRequest, gaps: Sequence[str]) -> None:
    """Run the machine. While a known gap of the kernel is open (its minimal case below, a
    strict xfail, still fails), the machine nearly always finds it: it is marked xfail, not
    strictly (an example that misses the gap is no news), and it stops at the first failure
    instead of shrinking it. Once the gap is closed the machine runs as a plain test."""
    open_gaps = [gap for gap in gaps if KNOWN_GAPS[gap]()]
    chosen = MACHINE_SETTINGS
    if open_gaps:
        reasons = "; ".join(GAP_REASONS[gap] for gap in open_gaps)
        request.applymarker(pytest.mark.xfail(strict=False, reason=f"finds the known gap: {reasons}"))
        chosen = settings(MACHINE_SETTINGS, phases=(Phase.explicit, Phase.reuse, Phase.generate))
    stage = Stage()
    registries = {(w, n): build_registry(stage) for w in (0, 1) for n in (1, 2)}
    with anyio.from_thread.start_blocking_portal(backend) as portal:
        machine = type(
            f"KernelMachine_{variant.name}_{backend}",
            (KernelMachine,),
            {"variant": variant, "portal": portal, "stage": stage, "registries": registries},
        )
        run_state_machine_as_test(machine, settings=chosen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_session_per_dispatcher_keeps_every_promise(backend: str, request: pytest.FixtureRequest) -> None:
    """Random batches, resumes and new runs on one session of each of two dispatchers that
    share a result store match the serial reference."""
    run_machine(SOLO, backend, request, gaps=())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sessions_moving_between_two_workers_keep_every_promise(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The same, each step of a session landing on either of two workers (Dispatchers that
    share a session store as well as the result store): one conversation, either way."""
    run_machine(WORKERS, backend, request, gaps=())


@pytest.mark.parametrize("backend", BACKENDS)
def test_approvals_that_change_the_arguments_keep_every_promise(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The same, where a resume may approve a gated write with other arguments."""
    run_machine(APPROVALS, backend, request, gaps=("changed_allow",))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_sessions_of_one_dispatcher_keep_every_promise(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The same with two sessions of one dispatcher: a write in one drops what the other read."""
    run_machine(SESSIONS, backend, request, gaps=("cross_session",))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_racing_a_write_keeps_every_promise(backend: str, request: pytest.FixtureRequest) -> None:
    """The same, with reads that race a write of what they read in the other session."""
    run_machine(RACES, backend, request, gaps=("cross_session", "epoch_dedupe", "epoch_cache"))


# -- what the machine found, written out -------------------------------------------------------


async def read_after_another_sessions_write() -> tuple[ToolResult, list[str]]:
    """p reads a; q (same dispatcher) writes a; p reads a again: the read and what ran."""
    world = World()
    d = Dispatcher(build_registry(Stage(world)))
    p, q = d.session("p"), d.session("q")
    await p.dispatch([ToolCall("r1", "read", {"path": A})])
    await q.dispatch([ToolCall("w1", "write", {"path": A, "text": "new"})])
    [again] = await p.dispatch([ToolCall("r2", "read", {"path": A})])
    return again, [call_id for call_id, _ in world.log]


async def read_after_a_racing_read(tool: str, again_in: str) -> tuple[ToolResult, list[str]]:
    """`tool` on a in p takes its snapshot; q (same dispatcher, same store) writes a and
    commits; the read returns; then `tool` on a again in session `again_in`."""
    world = World()
    d = Dispatcher(build_registry(Stage(world)), cache=MemoryResultCache())
    sessions = {"p": d.session("p"), "q": d.session("q")}
    first = ToolCall("r1", tool, {"path": A})
    await race_read_and_write(
        world, sessions["p"], first, sessions["q"], ToolCall("w1", "write", {"path": A, "text": "new"})
    )
    [again] = await sessions[again_in].dispatch([ToolCall("r2", tool, {"path": A})])
    return again, [call_id for call_id, _ in world.log]


def _fresh(result: ToolResult, log: list[str], content: str) -> bool:
    return result.content == content and not result.deduped and not result.cached and "r2" in log


def _open(
    scenario: Callable[[], Awaitable[tuple[ToolResult, list[str]]]], content: str
) -> Callable[[], bool]:
    @functools.cache
    def gap_is_open() -> bool:
        result, log = anyio.run(scenario)
        return not _fresh(result, log, content)

    return gap_is_open


@functools.cache
def _changed_allow_gap() -> bool:
    written, log = anyio.run(resume_after_a_changed_approval)
    return (written.status, written.content, written.deduped, log) != (
        Status.ok,
        "wrote /w/a@1",
        True,
        ["g", "q"],
    )


KNOWN_GAPS: dict[str, Callable[[], bool]] = {
    "cross_session": _open(read_after_another_sessions_write, "/w/a=new@1"),
    "epoch_dedupe": _open(functools.partial(read_after_a_racing_read, "read", "p"), "/w/a=new@1"),
    "epoch_cache": _open(functools.partial(read_after_a_racing_read, "peek", "q"), "peek /w/a=new@1"),
    "changed_allow": _changed_allow_gap,
}


async def resume_after_a_changed_approval() -> tuple[ToolResult, list[str]]:
    """[gated_write g, ask q]: the gate interrupts; resumed with g approved with other text,
    g writes and q interrupts; resumed again with the same approval and an answer for q: g's
    result as it finished (a failed result here if the resume did not complete)."""
    world = World()
    s = Dispatcher(build_registry(Stage(world)), gate=interrupt_every_call).session("p")
    batch = [ToolCall("g", "gated_write", {"path": A, "text": "x"}), ToolCall("q", "ask", {"q": "go?"})]
    approve: dict[str, Decision] = {"g": Allow({"path": A, "text": "z"})}
    for decisions in ({}, approve):
        with pytest.raises(DispatchInterrupted):
            await s.dispatch(batch, decisions=decisions)
    try:
        [written, _] = await s.dispatch(batch, decisions={**approve, "q": Answer("yes")})
    except DispatchInterrupted as exc:
        pending = ", ".join(call.id for call, _, _ in exc.pending)
        written = ToolResult("g", "gated_write", Status.failed, f"interrupted again, on {pending}")
    return written, [call_id for call_id, _ in world.log]


GAP_REASONS = {
    "cross_session": "a write in one session does not drop another session's remembered reads",
    "epoch_dedupe": "a read that raced a write is remembered by its session",
    "epoch_cache": "a read that raced a write is stored in the shared result cache",
    "changed_allow": (
        "a write approved with changed arguments that finished in a cut batch is not served on "
        "resume (kept under the new key, looked up under the old); its approval is spent, so the "
        "gate interrupts on it again"
    ),
}


async def test_a_write_in_one_session_drops_what_another_session_read() -> None:
    """p reads a, q of the same dispatcher writes a: p's next read of a runs and sees the write."""
    again, log = await read_after_another_sessions_write()
    assert (again.content, again.deduped, log) == ("/w/a=new@1", False, ["r1", "w1", "r2"])


async def test_a_read_that_raced_a_write_is_not_remembered() -> None:
    """p's read of a takes its snapshot before q's write of a commits and returns after it:
    it is returned as read, but p's next read of a runs and sees the write."""
    again, log = await read_after_a_racing_read("read", "p")
    assert (again.content, again.deduped, log) == ("/w/a=new@1", False, ["r1", "w1", "r2"])


async def test_a_read_that_raced_a_write_is_not_cached() -> None:
    """p's cached read of a races q's write of a: q's next cached read of a runs and sees the
    write instead of being served p's snapshot from the shared store."""
    again, log = await read_after_a_racing_read("peek", "q")
    assert (again.content, again.cached, log) == ("peek /w/a=new@1", False, ["r1", "w1", "r2"])


async def test_a_write_approved_with_changed_arguments_is_served_on_resume() -> None:
    """A gated write approved with other text runs, then a later call interrupts the batch:
    resumed with the same decisions, the write is served as it finished (deduped, not run
    again, no new question), and the batch completes."""
    written, log = await resume_after_a_changed_approval()
    assert (written.status, written.content, written.deduped, log) == (
        Status.ok,
        "wrote /w/a@1",
        True,
        ["g", "q"],
    )
