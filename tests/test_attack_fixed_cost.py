"""What a batch pays once, made cheaper, tried against the general way: a limiter slot
taken and given back in one frame (the limit, the waiters' order and trio's errors hold),
the loop a dispatcher belongs to read again for less (a second loop or thread still
raises), and pass 3's common batch (every call ok, nothing to write) against the general
pass."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from dispatcher import Allow, Dispatcher, Registry, Status, Tool, ToolCall, ToolResult, _backend
from dispatcher._core_tools import core_registry

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "number"}}}


# --- limiter slots: slot_ops against trio's own methods -----------------------------------


def _outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """What `fn(*args)` returned, or the type and message of what it raised."""
    try:
        return "returned", fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _trio_take(limiter: Any, would_block: type[Exception]) -> Callable[[object], bool]:
    def take(borrower: object) -> bool:
        try:
            limiter.acquire_on_behalf_of_nowait(borrower)
        except would_block:
            return False
        return True

    return take


def _state(limiter: Any) -> tuple[Any, ...]:
    stats = limiter.statistics()
    return (sorted(map(str, stats.borrowers)), stats.tasks_waiting, stats.total_tokens)


@pytest.mark.parametrize("seed", range(12))
def test_slot_ops_on_trio_do_what_trio_does(seed: int) -> None:
    """Random takes, give-backs (of held, waiting and unknown borrowers), waiters parking
    and cancelled, and totals changed, on two trio limiters side by side: one through
    `slot_ops`, one through trio's own methods. Every step returns or raises the same, and
    leaves the same borrowers, waiters and woken tasks."""
    import trio
    import trio.testing

    async def main() -> None:
        rng = random.Random(seed)
        total = rng.randint(0, 3)
        limiters = [trio.CapacityLimiter(total), trio.CapacityLimiter(total)]
        ops = [_backend.slot_ops(limiters[0], trio.WouldBlock)]
        ops.append((_trio_take(limiters[1], trio.WouldBlock), limiters[1].release_on_behalf_of))
        woken: list[list[str]] = [[], []]
        scopes: list[dict[str, trio.CancelScope]] = [{}, {}]

        async def waiter(k: int, label: str, task_status: Any) -> None:
            with trio.CancelScope() as scope:
                scopes[k][label] = scope
                task_status.started()
                await limiters[k].acquire_on_behalf_of(label)
                woken[k].append(label)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for step in range(60):
                op = rng.choice(["take", "take", "give", "give", "wait", "cancel", "total"])
                label = f"b{rng.randint(0, 4)}"
                if op == "give" and rng.random() < 0.3 and woken[0]:
                    label = rng.choice(woken[0])  # a slot a waiter got
                if op == "cancel" and scopes[0]:
                    label = rng.choice(sorted(scopes[0]))
                size = rng.choice([0, 1, 2, 3, 5])
                outcomes = []
                for k in (0, 1):
                    take, give = ops[k]
                    if op == "take":
                        outcomes.append(_outcome(take, label))
                    elif op == "give":
                        outcomes.append(_outcome(give, label))
                    elif op == "wait":
                        await nursery.start(waiter, k, f"w{step}")
                        await trio.testing.wait_all_tasks_blocked()
                    elif op == "cancel" and label in scopes[k]:
                        scopes[k].pop(label).cancel()
                    elif op == "total":
                        limiters[k].total_tokens = size
                    await trio.testing.wait_all_tasks_blocked()
                assert outcomes[:1] == outcomes[1:], (step, op, label)
                assert _state(limiters[0]) == _state(limiters[1]), (step, op, label)
                assert sorted(woken[0]) == sorted(woken[1]), (step, op, label)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_slot_ops_fall_back_to_the_limiters_own_methods() -> None:
    """A limiter that is not trio's own (anyio's, on either loop) is taken and given back
    through its public methods, a full one saying False."""

    async def main() -> None:
        limiter = anyio.CapacityLimiter(1)
        take, give = _backend.slot_ops(limiter, anyio.WouldBlock)
        assert take("a") is True and limiter.borrowed_tokens == 1
        assert take("b") is False
        with pytest.raises(RuntimeError):
            take("a")
        give("a")
        assert limiter.borrowed_tokens == 0
        with pytest.raises(RuntimeError):
            give("a")

    anyio.run(main, backend="trio")
    anyio.run(main, backend="asyncio")


# --- a waiter is woken when a lone call gives its slot back -------------------------------


def _gated_tools(opened: dict[str, anyio.Event], began: list[str]) -> Registry:
    async def hold(args: Mapping[str, Any], ctx: Any) -> str:
        began.append(ctx.call_id)
        await opened[ctx.call_id].wait()
        return f"held {ctx.call_id}"

    async def quick(args: Mapping[str, Any], ctx: Any) -> str:
        began.append(ctx.call_id)
        return f"quick {ctx.call_id}"

    tools = [
        Tool("hold", "Waits for its gate.", hold, SCHEMA, deferred=False, timeout=30),
        Tool("quick", "Returns at once.", quick, SCHEMA, deferred=False, timeout=30),
    ]
    return Registry(tools)


async def _until(check: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not check():  # noqa: ASYNC110 - the state is the dispatcher's, no event to wait on
            await anyio.sleep(0.001)


@pytest.mark.parametrize("shared", [False, True], ids=["one dispatcher", "two sharing a limiter"])
async def test_a_waiter_gets_the_slot_a_lone_call_gives_back(shared: bool) -> None:
    """At a limit of one, a lone call waits for the slot another lone call holds (in another
    session, or in another dispatcher given the same limiter) and starts the moment that
    call ends, long before its queue limit; the waiter's own slot comes back too."""
    opened = {"a": anyio.Event(), "b": anyio.Event()}
    began: list[str] = []
    d = Dispatcher(_gated_tools(opened, began), max_concurrent=1, queue_limit=20)
    other = Dispatcher(_gated_tools(opened, began), max_concurrent=1, queue_limit=20) if shared else d
    await d.session("warm").dispatch([ToolCall("w", "quick", {})])  # bound: the loop's limiter
    if shared:
        await other.session("warm").dispatch([ToolCall("w2", "quick", {})])
        other.limiter = d.limiter
    results: dict[str, Any] = {}

    async def run(dispatcher: Dispatcher, session: str, call_id: str) -> None:
        [results[call_id]] = await dispatcher.session(session).dispatch([ToolCall(call_id, "hold", {})])

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, d, "first", "a")
            await _until(lambda: "a" in began)
            tg.start_soon(run, other, "second", "b")
            await _until(lambda: d.statistics().waiting == 1)
            assert began == (["w", "w2", "a"] if shared else ["w", "a"])
            opened["a"].set()
            await _until(lambda: "b" in began)  # woken by the slot's give-back
            assert d.statistics().in_use == 1 and d.statistics().waiting == 0
            opened["b"].set()
    assert [results[k].status for k in "ab"] == [Status.ok, Status.ok]
    assert d.statistics().in_use == 0 and other.statistics().in_use == 0


async def test_waiters_are_woken_in_order_as_lone_calls_end(autojump_clock: Any) -> None:
    """Three sessions wait at a limit of one behind a lone call: each starts exactly when the
    one before it ends (trio's virtual clock), in the order they came."""
    import trio

    starts: dict[str, float] = {}

    async def nap(args: Mapping[str, Any], ctx: Any) -> str:
        starts[ctx.call_id] = trio.current_time()
        await trio.sleep(args["n"])
        return "napped"

    tool = Tool("nap", "Sleeps.", nap, SCHEMA, deferred=False, timeout=60)
    d = Dispatcher(Registry([tool]), max_concurrent=1, queue_limit=100)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i, name in enumerate("abcd"):
            nursery.start_soon(d.session(name).dispatch, [ToolCall(name, "nap", {"n": 1 + i})])
            await trio.sleep(0.01 * (i > 0))
    assert {k: round(v - t0, 6) for k, v in starts.items()} == {"a": 0.0, "b": 1.0, "c": 3.0, "d": 6.0}
    assert d.statistics().in_use == 0


# --- the loop a dispatcher belongs to ------------------------------------------------------


def _flag_registry() -> Registry:
    async def flag(args: Mapping[str, Any], ctx: Any) -> str:
        return "set"

    return Registry([Tool("set_flag", "Sets a flag.", flag, SCHEMA, deferred=False)])


def _dispatch_on(backend: str, d: Dispatcher, session: str) -> BaseException | None:
    """Dispatch once through `d` on a new loop of `backend`: what it raised, if anything."""

    async def go() -> None:
        [result] = await d.session(session).dispatch([ToolCall("1", "set_flag", {})])
        assert result.ok

    try:
        anyio.run(go, backend=backend)
    except BaseException as exc:
        return exc
    return None


@pytest.mark.parametrize("first", ["trio", "asyncio"])
@pytest.mark.parametrize("then", ["trio", "asyncio"])
def test_a_second_loop_on_the_same_thread_raises(first: str, then: str) -> None:
    """A dispatcher used on one loop, then from a new loop on the same thread (trio's next
    run or asyncio's), raises the RuntimeError naming both, however many batches the first
    loop ran."""
    d = Dispatcher(_flag_registry())

    async def many() -> None:
        for i in range(5):
            [result] = await d.session(f"s{i}").dispatch([ToolCall("1", "set_flag", {})])
            assert result.ok

    anyio.run(many, backend=first)
    raised = _dispatch_on(then, d, "later")
    assert isinstance(raised, RuntimeError)
    assert f"belongs to the {first} loop it was first used on (thread {threading.get_ident()})" in str(raised)
    assert f"it was used from a {then} loop on thread {threading.get_ident()}" in str(raised)


@pytest.mark.parametrize("first", ["trio", "asyncio"])
def test_the_same_loop_from_another_thread_raises(first: str) -> None:
    """A dispatcher used on a loop, then from a loop of the same kind in another thread, raises."""
    d = Dispatcher(_flag_registry())
    assert _dispatch_on(first, d, "a") is None
    raised: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: raised.append(_dispatch_on(first, d, "b")))
    worker.start()
    worker.join(10)
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError)
    assert "one Dispatcher per event loop" in str(raised[0])


def test_an_asyncio_dispatcher_under_a_trio_guest_run_says_what_loop_identity_says() -> None:
    """A dispatcher bound to an asyncio loop, used again while a trio guest run is active on
    that loop's thread, is judged as `loop_identity` judges it (trio is asked first there),
    as before batches read their loop for less."""
    import trio

    d = Dispatcher(_flag_registry())
    seen: list[Any] = []

    async def main() -> None:
        await d.session("a").dispatch([ToolCall("1", "set_flag", {})])
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        async def guest() -> None:
            await trio.sleep(0.01)

        trio.lowlevel.start_guest_run(
            guest,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=lambda outcome: loop.call_soon_threadsafe(done.set_result, None),
        )
        await asyncio.sleep(0)
        expected = _backend.loop_identity()  # trio's, while the guest runs
        try:
            await d.session("b").dispatch([ToolCall("2", "set_flag", {})])
            seen.append(None)
        except RuntimeError as exc:
            seen.append(exc)
        seen.append(expected)
        await done

    asyncio.run(main())
    raised, expected = seen
    assert expected[0] == "trio"
    assert isinstance(raised, RuntimeError) and "used from a trio loop" in str(raised)


def test_loop_reader_reads_what_loop_identity_says() -> None:
    """On the loop it was made for, the reader gives `loop_identity()[1]`, batch after batch;
    on another, something else or an error."""

    async def here() -> tuple[Any, Callable[[], object]]:
        identity = _backend.loop_identity()
        read = _backend.loop_reader(identity)
        for _ in range(3):
            assert read() is identity[1]
            await anyio.lowlevel.checkpoint()
        return identity, read

    for backend in ("trio", "asyncio"):
        identity, read = anyio.run(here, backend=backend)
        for other in ("trio", "asyncio"):

            async def elsewhere(read: Callable[[], object] = read) -> Any:
                return _outcome(read)

            kind, value = anyio.run(elsewhere, backend=other)
            assert kind != "returned" or value is not identity[1]


# --- pass 3: the commit of every batch against the commit as first written ----------------


def _reference_commit(
    plan: Any,
    executed: Mapping[int, Any],
    *,
    started: Any = (),
    moved: frozenset[str] | None = frozenset(),
    cut: bool = False,
    has_cache: bool,
    run_id: int,
    round: int,
    session_id: str,
    want_events: bool,
    failures: Any = None,
) -> Any:
    """`commit` as it read before its empty fields were made lazy (every container made up
    front, every field a tuple of it): the oracle the lean one is held to."""
    from dispatcher._commit import CommitEffects, _count, forget_overlapping
    from dispatcher._errors import note_failure
    from dispatcher._plan import DedupeEntry, FinishedCall, _served_again
    from dispatcher._policy import resources_overlap
    from dispatcher._seams import CacheWrite
    from dispatcher._types import ToolResultEvent

    results: list[Any] = []
    history: list[Any] = []
    loaded: list[str] = []
    spent: list[str] = []
    invalidated: set[str] = set()
    remember: dict[str, Any] = {}
    cache_writes: list[Any] = []
    errors: dict[str, Any] = {}
    for planned in plan.calls:
        ran = planned.index in executed
        if planned.outcome is not None:
            result = planned.outcome
        elif planned.leader is not None:
            led = results[planned.leader]
            result = None if led is None else _served_again(led, planned.call_id)
        else:
            result = executed.get(planned.index)
            if failures is not None and result is not None and result.status is not Status.ok:
                result, record = note_failure(result, planned.args, failures)
                if record is not None:
                    _count(errors, record)
        results.append(result)
        writes = planned.writes
        if result is None:
            if writes and planned.index in started:
                invalidated.update(writes)
                forget_overlapping(remember, writes)
                cache_writes = [w for w in cache_writes if not resources_overlap(w.reads, writes)]
            continue
        history.append((planned, result))
        ok = result.status is Status.ok
        if not ok and planned.loads_schema:
            loaded.append(planned.name)
        if ran and planned.spent_approval:
            spent.append(planned.call_id)
        if writes:
            if ran and (ok or result.effect_uncertain):
                invalidated.update(writes)
                forget_overlapping(remember, writes)
                cache_writes = [w for w in cache_writes if not resources_overlap(w.reads, writes)]
            continue
        if not ok:
            continue
        if ran and (moved is None or (moved and resources_overlap(planned.reads, moved))):
            continue
        if planned.key is not None and (ran or result.cached):
            remember[planned.key] = DedupeEntry(result, planned.reads)
        if ran and planned.cache_key is not None and has_cache and planned.tool is not None:
            policy = planned.tool.tool.cache
            if policy is not None:
                cache_writes.append(CacheWrite(planned.cache_key, result.content, policy.ttl, planned.reads))
    events: tuple[Any, ...] = ()
    if want_events:
        events = tuple(
            ToolResultEvent(
                session_id=session_id, run_id=run_id, round=round, index=i, call=plan.calls[i].call, result=r
            )
            for i, r in enumerate(results)
            if r is not None
        )
    carried = plan.carried
    finished: tuple[Any, ...] = ()
    consumed: tuple[str, ...] = ()
    if cut:
        kept = [(p, r) for p, r in history if p.index in executed or p.index in carried]
        arrived = plan.arrived_keys
        finished = tuple((p.call_id, FinishedCall(arrived.get(p.index, p.key), r)) for p, r in kept)
    elif carried:
        consumed = tuple(plan.calls[i].call_id for i in carried)
    return CommitEffects(
        tuple(results),
        tuple(history),
        tuple(loaded),
        tuple(spent),
        frozenset(invalidated),
        tuple(remember.items()),
        tuple(cache_writes),
        events,
        finished,
        consumed,
        tuple(errors.values()),
    )


def _commit_registry() -> Registry:
    """test_commit's tools, and a cached read whose reads a write may overlap."""
    from cache import CachePolicy

    from ._fakes import done, file_at_path, path_schema
    from .test_commit import REGISTRY

    cached = Tool(
        "cached_read",
        "Read, cached.",
        done,
        path_schema(),
        deferred=False,
        concurrent=True,
        reads=file_at_path,
        cache=CachePolicy(ttl=30),
    )
    return Registry([*REGISTRY, cached])


def _plan_of(registry: Registry, state: Any, calls: list[ToolCall], decisions: Any, has_cache: bool) -> Any:
    """Pass 1 as the session runs it, nothing found in the cache."""
    from dispatcher._plan import DEFAULT_MAX_ARGUMENT_BYTES, new_planner
    from dispatcher._results import DEFAULT_MAX_OUTPUT_BYTES

    planner = new_planner(
        registry=registry,
        core=_CORE,
        state=state,
        has_cache=has_cache,
        session_id="s",
        mode="deferred",
        all_loaded=False,
        max_argument_bytes=DEFAULT_MAX_ARGUMENT_BYTES,
        max_output_bytes=DEFAULT_MAX_OUTPUT_BYTES,
    )
    drafts = planner.parse(calls)
    planner.lookups(drafts)
    planner.resolve(drafts, {})
    for draft in planner.gated(drafts):
        decision = planner.take_decision(draft, decisions)
        if decision is not None:
            planner.allow(draft, decision)
    return planner.finish(drafts)


_CORE = core_registry()
KINDS = ["read", "cached", "write", "command", "fetch", "danger", "secret", "nope"]
FATES = ["ok", "failed", "uncertain", "timed_out", "unfinished", "unstarted"]


def _call_of(kind: str, i: int, path: str, call_id: str) -> ToolCall:
    """A call of one of `_commit_registry`'s tools (`secret`: run_tool of a deferred one,
    answered with its schema until loaded; `nope`: an unknown name)."""
    if kind == "read":
        return ToolCall(call_id, "read_file", {"path": path})
    if kind == "cached":
        return ToolCall(call_id, "cached_read", {"path": path})
    if kind == "write":
        return ToolCall(call_id, "write_file", {"path": path})
    if kind == "command":
        return ToolCall(call_id, "run_command", {"cmd": "ls"})
    if kind == "fetch":
        return ToolCall(call_id, "fetch_page", {"url": f"u{i % 2}"})
    if kind == "danger":
        return ToolCall(call_id, "danger", {"n": i})
    if kind == "secret":
        return ToolCall(call_id, "run_tool", {"name": "secret_tool", "args": {"x": i}})
    return ToolCall(call_id, "nope", {})


def _outcomes(plan: Any, fates: Callable[[int], str]) -> tuple[dict[int, Any], set[int]]:
    """What pass 2 would leave of `plan`, the call at index `i` (if it runs) given `fates(i)`."""
    from dispatcher._results import failure_result

    executed: dict[int, Any] = {}
    started: set[int] = set()
    for planned in plan.calls:
        if not planned.runs:
            continue
        fate = fates(planned.index)
        if fate != "unstarted":
            started.add(planned.index)
        if fate == "ok":
            executed[planned.index] = ToolResult(
                planned.call_id, planned.name, Status.ok, f"out {planned.index}", started=1.0 + planned.index
            )
        elif fate in ("failed", "uncertain", "timed_out"):
            executed[planned.index] = failure_result(
                planned.call_id,
                planned.name,
                Status.timed_out if fate == "timed_out" else Status.failed,
                f"it broke at /tmp/x{planned.index}",
                effect_uncertain=fate == "uncertain",
                started=2.0,
                duration=0.5,
            )
    return executed, started


class _Both:
    """Two sessions' memories, one landed from the lean commit and one from the first."""

    def __init__(self) -> None:
        from dispatcher._history import History
        from dispatcher._plan import PlannerState

        self.registry = _commit_registry()
        self.states = [PlannerState(), PlannerState()]
        self.histories = [History(), History()]
        self.round = 0

    def check(
        self,
        rng: random.Random,
        calls: list[ToolCall],
        decisions: dict[str, Any],
        fates: Callable[[int], str],
    ) -> None:
        """Plan `calls`, give them `fates`, commit both ways with random options, land both:
        the same effects, memory and history."""
        from dispatcher._commit import commit, land
        from dispatcher._errors import FailureNotes

        self.round += 1
        has_cache = rng.random() < 0.6
        plan = _plan_of(self.registry, self.states[0], calls, decisions, has_cache)
        executed, started = _outcomes(plan, fates)
        options: dict[str, Any] = dict(
            started=started,
            moved=rng.choice(
                [frozenset(), frozenset(), None, frozenset({"file:/a"}), frozenset({"file:/zzz"})]
            ),
            cut=rng.random() < 0.3,
            has_cache=has_cache,
            run_id=1,
            round=self.round,
            session_id="s",
            want_events=rng.random() < 0.5,
            failures=rng.choice([None, FailureNotes(), FailureNotes(remembering=True, write_error=True)]),
        )
        lean = commit(plan, executed, **options)
        first = _reference_commit(plan, executed, **options)
        assert lean == first, (calls, options)
        assert [type(v) for v in vars(lean).values()] == [type(v) for v in vars(first).values()]
        for effects, state, history in zip((lean, first), self.states, self.histories, strict=True):
            land(effects, state, history, run_id=1, round=self.round)
        assert self.states[0] == self.states[1]
        assert list(self.histories[0]) == list(self.histories[1])
        assert (self.histories[0].calls, self.histories[0].by_status) == (
            self.histories[1].calls,
            self.histories[1].by_status,
        )


@pytest.mark.parametrize("seed", range(30))
def test_commit_and_land_do_what_the_first_commit_did(seed: int) -> None:
    """Random batches (reads, cached reads, writes, approvals, unknown and deferred tools,
    ids used twice, repeated calls), random outcomes (ok, failed with and without an
    uncertain effect, timed out, started and never finished, never started), moved epochs,
    cut batches, events and failure notes, round after round of one session: the lean
    commit returns exactly the effects the first one did, and landing them leaves the same
    session memory and history."""
    rng = random.Random(seed)
    both = _Both()
    for _ in range(15):
        calls, decisions = [], {}
        for i in range(rng.randint(1, 8)):
            call_id = f"c{i}" if rng.random() < 0.9 else "c0"
            calls.append(_call_of(rng.choice(KINDS), i, rng.choice(["/a", "/b", "/a/x"]), call_id))
            if rng.random() < 0.7:
                decisions[call_id] = Allow()
        both.check(rng, calls, decisions, lambda index: rng.choice(["ok", "ok", *FATES]))


def test_commit_and_land_do_what_the_first_commit_did_for_every_pair() -> None:
    """Every two-call batch of two kinds and two outcomes (on one file or two): the lean
    commit and the first agree, effects, memory and history."""
    rng = random.Random(7)
    for first_kind in KINDS:
        for second_kind in KINDS:
            both = _Both()  # a session per pair of kinds: its history stays short to compare
            for first_fate in FATES:
                for second_fate in FATES:
                    fates = {0: first_fate, 1: second_fate}
                    calls = [
                        _call_of(first_kind, 0, "/a", "c0"),
                        _call_of(second_kind, 1, rng.choice(["/a", "/a/x", "/b"]), "c1"),
                    ]
                    both.check(rng, calls, {"c0": Allow(), "c1": Allow()}, fates.__getitem__)


# --- run control: batches without a signal share one that stays empty ----------------------


async def test_signals_stay_with_their_batch() -> None:
    """Batches whose tools interrupt, block and raise KeyboardInterrupt (alone, in groups,
    in sessions running at once) each raise their own signal; the calm batches between and
    beside them raise nothing, and the run control they share stays empty."""
    from dispatcher import DispatchInterrupted, HookBlocked
    from dispatcher._execute import _CALM

    async def calm(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.001 * args.get("n", 0))
        return "calm"

    async def interrupt(args: Mapping[str, Any], ctx: Any) -> str:
        raise DispatchInterrupted([(ToolCall(ctx.call_id, ctx.tool_name, {}), "ask first", None)])

    async def block(args: Mapping[str, Any], ctx: Any) -> str:
        raise HookBlocked("no")

    async def stop(args: Mapping[str, Any], ctx: Any) -> str:
        raise KeyboardInterrupt

    tools = [
        Tool(name, f"The {name} tool.", fn, SCHEMA, deferred=False, concurrent=True)
        for name, fn in (("calm", calm), ("interrupt", interrupt), ("block", block), ("stop", stop))
    ]
    d = Dispatcher(Registry(tools))
    expected = {"interrupt": DispatchInterrupted, "block": HookBlocked, "stop": KeyboardInterrupt}
    rng = random.Random(3)
    outcomes: list[tuple[str, str]] = []

    async def session(name: str) -> None:
        s = d.session(name)
        for round_ in range(12):
            s.new_run()
            signal = rng.choice(["calm", "calm", *expected])
            size = rng.choice([1, 1, 3])
            calls = [ToolCall(f"{name}{round_}c{i}", "calm", {"n": i}) for i in range(size - 1)]
            calls.insert(rng.randint(0, len(calls)), ToolCall(f"{name}{round_}x", signal, {}))
            try:
                results = await s.dispatch(calls)
            except (DispatchInterrupted, HookBlocked, KeyboardInterrupt) as exc:
                outcomes.append((signal, type(exc).__name__))
            else:
                assert [r.content for r in results] == ["calm"] * size
                outcomes.append((signal, "calm"))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for name in "abc":
                tg.start_soon(session, name)
    assert all(got == (expected[sent].__name__ if sent in expected else "calm") for sent, got in outcomes)
    assert {sent for sent, _ in outcomes} == {"calm", *expected}
    assert not _CALM and not (_CALM.blocked or _CALM.interrupted or _CALM.keyboard)
