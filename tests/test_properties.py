"""Properties over random batches of fake tools (hypothesis), run under trio's MockClock."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher import Dispatcher, DispatchInterrupted, Interrupt, Registry, Status, Tool, ToolCall, replay

SCHEMA = {"type": "object", "properties": {"v": {"type": "string"}, "path": {"type": "string"}}}


@attrs.define
class World:
    files: dict[str, str] = attrs.field(factory=dict)
    executions: list[tuple[str, str]] = attrs.field(factory=list)
    in_flight: int = 0
    most: int = 0
    alone_violated: bool = False
    serial_running: bool = False

    async def run(self, name: str, key: str, *, alone: bool, sleep: float) -> None:
        if alone and self.in_flight:
            self.alone_violated = True
        if self.serial_running:
            self.alone_violated = True
        self.executions.append((name, key))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.serial_running = alone
        try:
            await trio.sleep(sleep)
        finally:
            self.in_flight -= 1
            self.serial_running = False


@attrs.define
class Stage:
    world: World


def build(stage: Stage) -> Registry:
    """The fake tools, acting on the world on `stage` when they run."""

    def file_key(args: Mapping[str, Any]) -> set[str]:
        return {f"file:/w/{args['path']}"}

    async def fast(args: Mapping[str, Any], ctx: Any) -> str:
        await stage.world.run("fast", args["v"], alone=False, sleep=0.01)
        return "fast " + args["v"]

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        await stage.world.run("slow", args["v"], alone=True, sleep=0.02)
        return "slow " + args["v"]

    async def read(args: Mapping[str, Any], ctx: Any) -> str:
        await stage.world.run("read", args["path"], alone=False, sleep=0.01)
        return stage.world.files.get(args["path"], "")

    async def edit(args: Mapping[str, Any], ctx: Any) -> str:
        await stage.world.run("edit", args["path"], alone=True, sleep=0.01)
        stage.world.files[args["path"]] = args["v"]
        return "ok"

    async def fail(args: Mapping[str, Any], ctx: Any) -> str:
        await stage.world.run("fail", args["v"], alone=False, sleep=0.005)
        raise RuntimeError("no")

    async def danger(args: Mapping[str, Any], ctx: Any) -> str:
        await stage.world.run("danger", args["v"], alone=True, sleep=0.0)
        return "done"

    return Registry(
        [
            Tool("fast", "f", fast, SCHEMA, concurrent=True, deferred=False),
            Tool("slow", "s", slow, SCHEMA, concurrent=False, deferred=False),
            Tool("read", "r", read, SCHEMA, concurrent=True, deferred=False, reads=file_key),
            Tool("edit", "e", edit, SCHEMA, concurrent=False, deferred=False, writes=file_key),
            Tool("fail", "x", fail, SCHEMA, concurrent=True, deferred=False),
            Tool("danger", "d", danger, SCHEMA, concurrent=False, deferred=False, confirm=True),
        ]
    )


_STAGE = Stage(World())
_REGISTRY = build(_STAGE)


def registry_over(world: World) -> Registry:
    """The fake tools' registry, acting on `world` until the next call: registering the
    tools checks their schemas, which costs more than most examples, so it is built once."""
    _STAGE.world = world
    return _REGISTRY


names = st.sampled_from(["fast", "slow", "read", "edit", "fail", "nope", "danger"])
values = st.sampled_from(["a", "b"])
one_call = st.tuples(names, values, values)
batches = st.lists(st.lists(one_call, min_size=0, max_size=12), min_size=1, max_size=4)


def args_for(name: str, v: str, path: str) -> dict[str, str]:
    if name == "read":
        return {"path": path}
    return {"path": path, "v": v} if name == "edit" else {"v": v}


@settings(max_examples=80, deadline=None)
@given(rounds=batches, limit=st.integers(1, 4), with_danger_gate=st.booleans())
def test_random_batches_keep_every_promise(
    rounds: list[list[tuple[str, str, str]]], limit: int, with_danger_gate: bool
) -> None:
    """One result per call in order; no key runs twice in a run unless invalidated; the limit
    holds; non-concurrent calls run alone; after an Interrupt nothing ran."""
    world = World()
    gate = (lambda c, ctx: Interrupt("ask")) if with_danger_gate else None
    d = Dispatcher(registry_over(world), max_concurrent=limit, gate=gate)
    s = d.session("s")

    async def main() -> None:
        ran_keys: dict[tuple[str, str], int] = {}
        for number, spec in enumerate(rounds):
            calls = [
                ToolCall(id=f"r{number}c{i}", name=name, arguments=json.dumps(args_for(name, v, p)))
                for i, (name, v, p) in enumerate(spec)
            ]
            before = len(world.executions)
            try:
                results = await s.dispatch(calls)
            except DispatchInterrupted as exc:
                assert with_danger_gate
                assert len(world.executions) == before, "a tool ran before the interrupt"
                assert {c.name for c, _, _ in exc.pending} == {"danger"}
                continue
            assert [r.call_id for r in results] == [c.id for c in calls]
            assert len(results) == len(calls)
            for c, r in zip(calls, results, strict=True):
                if c.name == "nope":
                    assert r.status is Status.rejected
                elif c.name == "fail":
                    assert r.status is Status.failed
                else:
                    assert r.status is Status.ok, r.content
            # a read after an edit of its path in the same batch sees the edit
            seen: dict[str, str] = {}
            for c, r in zip(calls, results, strict=True):
                a = json.loads(str(c.arguments))
                if c.name == "edit":
                    seen[a["path"]] = a["v"]
                elif c.name == "read" and a["path"] in seen:
                    assert r.content == seen[a["path"]]
            for name, key in world.executions[before:]:
                ran_keys[(name, key)] = ran_keys.get((name, key), 0) + 1
        # keys that nothing invalidates and that never fail ran at most once in this run
        for (name, _), count in ran_keys.items():
            if name in ("fast", "slow"):
                assert count == 1
        edits = {k: n for (name, k), n in ran_keys.items() if name == "edit"}
        for (name, key), count in ran_keys.items():
            if name == "read":
                assert count <= 1 + sum(n for p, n in edits.items() if p == key)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert world.most <= limit
    assert not world.alone_violated


# --- junk calls, with the recording on and off --------------------------------------------

junk_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=6),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.integers()),
    st.builds(object),
    st.dictionaries(
        st.text(max_size=3), st.one_of(st.integers(), st.binary(max_size=3), st.text(max_size=3))
    ),
    st.dictionaries(st.tuples(st.integers()), st.integers(), min_size=1, max_size=2),
    st.dictionaries(st.sampled_from(["v", "path"]), values, min_size=1),
)
junk_names = st.sampled_from(["fast", "slow", "read", "edit", "fail", "nope", ""])
junk_call = st.one_of(
    junk_values,  # the call itself
    st.builds(lambda n, a: ToolCall("j", n, a), junk_names, junk_values),
    st.builds(
        lambda n, a: {"id": "o", "type": "function", "function": {"name": n, "arguments": a}},
        junk_names,
        junk_values,
    ),
    st.builds(lambda n, a: {"type": "tool_use", "id": "t", "name": n, "input": a}, junk_names, junk_values),
    st.builds(
        lambda n, v, p: ToolCall("g", n, json.dumps(args_for(n, v, p))),
        names.filter(lambda n: n != "danger"),
        values,
        values,
    ),
)


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.lists(junk_call, max_size=6), min_size=1, max_size=3))
def test_junk_calls_never_raise_and_record_and_replay(rounds: list[list[Any]]) -> None:
    """Calls of any shape and arguments of any type: with the recording on or off, every batch
    returns one result per call, the same results, and the recording replays clean."""

    async def dispatch_all(record: Path | None) -> list[list[tuple[str, str, str]]]:
        s = Dispatcher(registry_over(World())).session("junk", record=record)
        answers = []
        for calls in rounds:
            results = await s.dispatch(calls)
            assert len(results) == len(calls)
            answers.append([(r.call_id, r.status.value, r.content) for r in results])
        assert s.recorder is None or s.recorder.problem is None
        return answers

    clock = trio.testing.MockClock
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "junk.jsonl"
        recorded = trio.run(dispatch_all, path, clock=clock(autojump_threshold=0))
        unrecorded = trio.run(dispatch_all, None, clock=clock(autojump_threshold=0))
        assert recorded == unrecorded
        report = trio.run(replay, path, Dispatcher(registry_over(World())), clock=clock(autojump_threshold=0))
        assert report.ok, (report.problem, report.divergence)
        assert (report.batches, report.calls) == (len(rounds), sum(len(calls) for calls in rounds))


_RECORDED: list[str] = []  # the lines of one recorded session, made once


def _record_a_session(path: Path) -> None:
    async def main() -> None:
        s = Dispatcher(registry_over(World())).session("rec", record=path)
        await s.dispatch([ToolCall("1", "fast", '{"v": "a"}'), ToolCall("2", "nope", {}), [1]])
        await s.dispatch(
            [ToolCall("3", "edit", {"path": "a", "v": "b"}), ToolCall("4", "read", {"path": "a"})]
        )
        await s.dispatch([ToolCall("5", "fast", {"v": "a"}), ToolCall("6", "fail", {"v": "a"})])

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _mutate(value: Any, path: list[int], junk: Any) -> Any:
    """`value` with the node that `path` picks (each step an index into the keys or items
    seen there) replaced by `junk`, or removed when `junk` is the string "<delete>"."""
    if not path or not isinstance(value, dict | list) or not value:
        return junk
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    key = keys[path[0] % len(keys)]
    copy: Any = dict(value) if isinstance(value, dict) else list(value)
    if len(path) == 1 and junk == "<delete>":
        del copy[key]
    else:
        copy[key] = _mutate(copy[key], path[1:], junk)
    return copy


junk_json = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(max_size=4),
    st.just([]),
    st.just({}),
    st.just("<delete>"),
)


@settings(max_examples=100, deadline=None)
@given(line=st.integers(0, 3), path=st.lists(st.integers(0, 20), max_size=4), junk=junk_json)
def test_a_recording_edited_anywhere_never_raises_in_replay(line: int, path: list[int], junk: Any) -> None:
    """Any field of any record replaced by junk or removed: replay never raises, and a change
    to a line that has a successor is a problem naming that line (or the one its `prev` names)."""
    with tempfile.TemporaryDirectory() as folder:
        recording = Path(folder) / "s.jsonl"
        if not _RECORDED:
            _record_a_session(recording)
            _RECORDED.extend(recording.read_text().splitlines())
        lines = list(_RECORDED)
        edited = json.dumps(_mutate(json.loads(lines[line]), path, junk))
        changed, lines[line] = edited != lines[line], edited
        recording.write_text("".join(text + "\n" for text in lines))
        clock = trio.testing.MockClock(autojump_threshold=0)
        report = trio.run(replay, recording, Dispatcher(registry_over(World())), clock=clock)
        assert report.batches <= 3
        if changed and line < 3:  # a line with a successor: the chain sees any change
            assert report.problem is not None, report
            # the edited line is named, or the one before when its `prev` is what changed
            named = int(report.problem.split(":")[0].split()[1])
            assert named in (line, line + 1), report.problem
