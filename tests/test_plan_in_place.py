"""Pass 1 in place: the common call, read, keyed and resolved without the general steps'
frames, comes out as the general steps leave it, for every batch."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import attrs
import orjson
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import CacheEntry, CachePolicy, MemoryResultCache
from dispatcher import (
    Allow,
    Answer,
    Deny,
    Dispatcher,
    Registry,
    Status,
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
    _plan,
)
from dispatcher._plan import (
    STOPPED_KEY,
    DedupeEntry,
    FinishedCall,
    Plan,
    PlannerState,
    call_key,
    canonical_json,
    new_planner,
)
from dispatcher._results import DEFAULT_MAX_OUTPUT_BYTES

from ._fakes import done, file_at_path, path_schema
from .test_plan import _BASE_TOOLS, _CORE, Hits, make_planner

# Tools beside the test palette's: plain ones whose schema jsonschema alone checks, whose
# confirm is a predicate (one that can fail), that run alone, and one with a `force` of its own.
_EXTRA = [
    Tool(
        "spaced",
        "A pattern jsonschema-rs does not take.",
        done,
        {"type": "object", "properties": {"s": {"type": "string", "pattern": r"^\s*x"}}},
        concurrent=True,
        deferred=False,
    ),
    Tool(
        "picky",
        "Asks unless n is small; cannot judge a missing n.",
        done,
        {"type": "object", "properties": {"n": {"type": "integer"}}},
        deferred=False,
        confirm=lambda a: a["n"] > 2,
    ),
    Tool(
        "alone",
        "Runs alone.",
        done,
        {"type": "object", "properties": {"text": {"type": "string"}}, "additionalProperties": False},
        concurrent=False,
        deferred=False,
    ),
    Tool(
        "tree",
        "Any tree of objects and arrays: jsonschema follows it to the bottom.",
        done,
        {
            "type": "object",
            "additionalProperties": {"$ref": "#/$defs/node"},
            "$defs": {
                "node": {
                    "type": ["object", "array", "string", "integer"],
                    "additionalProperties": {"$ref": "#/$defs/node"},
                    "items": {"$ref": "#/$defs/node"},
                }
            },
        },
        concurrent=True,
        deferred=False,
    ),
    Tool(
        "tagged",
        "Defaults to fill, one of them a list, one required: what was sent is what is checked.",
        done,
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "default": ["a"]},
                "level": {"type": "integer", "default": 3},
                "text": {"type": "string"},
            },
            "required": ["level"],
        },
        concurrent=True,
        deferred=False,
    ),
    Tool(
        "forced",
        "A cached tool with a force of its own.",
        done,
        {"type": "object", "properties": {"force": {"type": "boolean"}, "q": {"type": "string"}}},
        deferred=False,
        cache=CachePolicy(ttl=60),
    ),
]
_REGISTRY = Registry([*_BASE_TOOLS, *_EXTRA])
NAMES = [t.name for t in _REGISTRY] + [
    "run_tool",
    "find_tools",
    "nope",
    "",
    " echo ",
    "echo<|call|>x",
    "ec ho",
]

# JSON values that stress the reading and the canonical form: floats of every kind, integers
# past 64 bits, text with escapes, astral and control characters, lone surrogates, nesting.
_TEXT = st.text(
    alphabet=st.sampled_from('ab\u00e9"\\/\n\t\x00\x1f\x7f\u2028\ufeff\U0001f600\ud800\udfff'), max_size=6
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-05, 1e16, 1.5, 1e400]),
    st.sampled_from(["/a", "/a/b", "read", "x"]),
    _TEXT,
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["text", "path", "n", "q", "mode", "a", "\u00e9", "\U0001f600"]),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=6,
)
_OBJECTS = st.dictionaries(
    st.sampled_from(["text", "path", "n", "q", "mode", "s", "x", "force", "content", "name", "args"]),
    _VALUES,
    max_size=3,
)
_FIXED_TEXTS = [
    '{"x": 1}',
    '{"text": "a"}',
    "",
    " ",
    "null",
    "[1]",
    '"text"',
    "{",
    '{"text": "a"} ',
    ' {"text": "a"}',
    '{"text": "a"}{}',
    '{"text": NaN}',
    '{"n": 1e400}',
    '{"n": 123456789012345678901234567890}',
    '{"text": "\\ud800"}',
    '{"text": "\\ud83d\\ude00"}',
    '{"path": "/a", "path": "/b"}',
    "[" * 3000 + "]" * 3000,
    '{"a":' * 200 + "1" + "}" * 200,
    '{"a":' * 101 + "1" + "}" * 101,
    '{"a":' * 300 + "1" + "}" * 300,  # deeper than jsonschema follows
    '{"a":' * 60 + "[" * 60 + "1" + "]" * 60 + "}" * 60,
    '{"text": "' + "x" * 300 + '"}',
]


def _dump(value: Any, style: int) -> str:
    if style == 0:
        return json.dumps(value)
    if style == 1:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return json.dumps(value, indent=1)


# arguments that some tool of the palette takes, and the same written otherwise
_FITTING = st.sampled_from(
    [
        '{"n": 5}',
        '{"n": 1}',
        '{"n":5}',
        '{"text": "a"}',
        '{"text": "b"}',
        '{"path": "/a"}',
        '{"path": "/a", "content": "c"}',
        '{"mode": "write"}',
        '{"mode": "read"}',
        '{"url": "u"}',
        '{"q": "x", "force": true}',
        '{"q": "x"}',
        '{"q": "x", "headers": {"Authorization": "Bearer abc"}}',
        '{"q": "x", "url": "https://u:pw@example.com/"}',
        '{"s": " x"}',
        '{"x": 1}',
        "{}",
    ]
)
_ARGUMENTS = st.one_of(
    _FITTING,
    _FITTING,
    st.builds(_dump, _OBJECTS, st.integers(0, 2)),
    st.builds(
        lambda name, args, s: _dump({"name": name, "args": args}, s),
        st.sampled_from(NAMES),
        _OBJECTS,
        st.integers(0, 2),
    ),
    st.sampled_from(_FIXED_TEXTS),
    _OBJECTS,
    st.sampled_from([None, 3, ["x"]]),
    # arguments no JSON text gives: a tuple, which jsonschema-rs would read as an array
    st.sampled_from([{"x": ("a",)}, {"text": ("a",)}, {"n": (1,)}, {"s": " x", "t": ()}]),
)
_IDS = st.one_of(st.sampled_from(["c1", "c2", "c3"]), st.sampled_from(["c4", "c5", "c6", 7, None]))


# for each tool, arguments it takes (and some it refuses), to meet the steps past validation
_TAKES = {
    "echo": ['{"text": "a"}', '{"text":"a"}', '{"text": "b"}', '{"text": 1}'],
    "danger": ['{"n": 5}', '{"n": 1}', "{}"],
    "maybe": ['{"mode": "write"}', '{"mode": "read"}'],
    "picky": ['{"n": 5}', '{"n": 1}', "{}"],
    "read_file": ['{"path": "/a"}', '{"path": "/a/b"}'],
    "write_file": ['{"path": "/a", "content": "c"}', '{"path": "/b"}'],
    "cwrite": ['{"path": "/a"}'],
    "fetch_page": ['{"url": "u"}', '{"url": "v"}'],
    "search_web": ['{"q": "x", "force": true}', '{"q": "x"}'],
    "forced": ['{"q": "x", "force": true}'],
    "list_dir": ["{}", '{"depth": 2}', '{"path": "/x", "depth": 2}', '{"path": "/x", "depth": 2.5}'],
    "tagged": [
        "{}",
        '{"text": "a"}',
        '{"text": "a", "level": 1}',
        '{"tags": [], "level": 1}',
        '{"tags": [1.5]}',
    ],
    "secret_tool": ['{"x": 1}'],
    "spaced": ['{"s": " x"}', '{"s": "y"}'],
    "alone": ['{"text": "a"}'],
    "run_tool": ['{"name": "echo", "args": {"text": "a"}}', '{"name": "danger", "args": "{\\"n\\": 5}"}'],
}


@st.composite
def _fitting_items(draw: st.DrawFn) -> Any:
    name = draw(st.sampled_from(sorted(_TAKES)))
    arguments = draw(st.sampled_from(_TAKES[name]))
    call_id = draw(st.sampled_from(["c1", "c2", "c3", "c4"]))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@st.composite
def _items(draw: st.DrawFn) -> Any:
    call_id, name, arguments = draw(_IDS), draw(st.sampled_from(NAMES)), draw(_ARGUMENTS)
    shape = draw(st.integers(0, 9))
    if shape <= 5:  # the OpenAI chat shape, as the model sends it
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if shape == 6:
        return {"id": call_id, "function": {"arguments": arguments}}  # no name
    if shape == 7:
        return {"id": call_id, "type": "function", "function": "echo"}
    if shape == 8:
        return ToolCall(
            id=str(call_id), name=name, arguments=arguments if isinstance(arguments, str | dict) else {}
        )
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def _state(draw: st.DrawFn, calls: list[Any]) -> PlannerState:
    """Successes earlier in the run for some of the batch's calls (some with reads), a
    batch cut short, the loaded tools."""
    state = PlannerState()
    for item in calls:
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str) or not draw(st.booleans()):
            continue
        try:
            args = json.loads(fn["arguments"])
            key = call_key(str(fn.get("name", "")).strip(), canonical_json(args))
        except (ValueError, TypeError, RecursionError):
            continue
        reads = draw(st.sampled_from([frozenset(), frozenset({"file:/a"})]))
        state.dedupe[key] = DedupeEntry(ToolResult("old", "echo", Status.ok, "earlier"), reads)
    if draw(st.booleans()):  # c2 finished in this batch's cut-short dispatch (or started)
        keys = [None, STOPPED_KEY, *state.dedupe, call_key("echo", '{"text":"a"}')]
        state.finished["c2"] = FinishedCall(
            draw(st.sampled_from(keys)), ToolResult("c2", "echo", Status.ok, "finished")
        )
    if draw(st.booleans()):
        state.loaded.add("secret_tool")
    return state


@st.composite
def _batches(draw: st.DrawFn) -> dict[str, Any]:
    calls = draw(st.lists(st.one_of(_fitting_items(), _items()), max_size=7))
    decisions = draw(
        st.dictionaries(
            st.sampled_from(["c1", "c2", "c3"]),
            st.sampled_from(
                [
                    Allow(),
                    Allow(args={"n": 1}),
                    Allow(args={"n": 5}),
                    Allow(args={"mode": "write"}),
                    Allow(args={"path": "/a"}),
                    Allow(args={"text": "changed"}),
                    Deny("no"),
                    Answer("answered"),
                ]
            ),
            max_size=3,
        )
    )
    rewrites = draw(
        st.dictionaries(
            st.integers(0, 6),
            st.tuples(st.sampled_from(["echo", "tree", "spaced", "danger"]), _OBJECTS),
            max_size=2,
        )
    )
    return {
        "calls": calls,
        "rewrites": rewrites,
        "state": _state(draw, calls),
        "decisions": decisions,
        "cache": draw(st.booleans()),
        "mode": draw(st.sampled_from(["deferred", "direct"])),
        "all_loaded": draw(st.booleans()),
        "max_argument_bytes": draw(st.sampled_from([_plan.DEFAULT_MAX_ARGUMENT_BYTES, 40])),
    }


class _Outcome:
    """What pass 1 made of a batch: the plan and every draft as it ended, or what it raised."""

    def __init__(
        self, plan: tuple[Any, ...] | None, drafts: list[dict[str, Any]], raised: str | None
    ) -> None:
        self.plan, self.drafts, self.raised = plan, drafts, raised

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Outcome) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"_Outcome({self.plan!r}, {self.drafts!r}, {self.raised!r})"


def _pass1(batch: dict[str, Any], *, in_place: bool) -> _Outcome:
    """The session's pass 1 over `batch` (a gate allowing what the decisions leave)."""
    _plan._IN_PLACE = in_place
    try:
        hits = Hits() if batch["cache"] else None
        if hits is not None:
            hits.set(call_key("fetch_page", '{"url":"u"}'), "cached", ttl=60)
        planner = new_planner(
            registry=_REGISTRY,
            core=_CORE,
            state=_copy(batch["state"]),
            has_cache=hits is not None,
            session_id="s1",
            decisions=batch["decisions"],
            mode=batch["mode"],
            all_loaded=batch["all_loaded"],
            max_argument_bytes=batch["max_argument_bytes"],
            max_output_bytes=DEFAULT_MAX_OUTPUT_BYTES,
        )
        drafts = []
        try:
            drafts = planner.parse(list(batch["calls"]))
            for index, (name, args) in batch.get("rewrites", {}).items():  # as a rewriter would
                if index < len(drafts) and drafts[index].step == "parsed" and drafts[index].args is not None:
                    planner.apply_rewrite(drafts[index], name, dict(args))
            wanted = planner.lookups(drafts)
            planner.resolve(drafts, hits.answer(wanted) if hits is not None else {})
            for d in planner.gated(drafts):
                decision = planner.take_decision(d, batch["decisions"])
                if isinstance(decision, Deny):
                    planner.deny(d, decision.reason)
                elif isinstance(decision, Allow):
                    planner.allow(d, decision)
            plan = planner.finish(drafts)
        except Exception as exc:  # the same fault on both paths, if any
            return _Outcome(None, [], f"{type(exc).__name__}: {exc}")
        return _Outcome(_comparable(plan), [_fields(d) for d in drafts], None)
    finally:
        _plan._IN_PLACE = True


def _comparable(plan: Plan) -> tuple[Any, ...]:
    """The plan, each call's arguments as `_exact` shows them."""
    calls = tuple(c._replace(args=_exact(c.args)) for c in plan.calls)
    return calls, plan.groups, plan.carried, dict(plan.arrived_keys)


def _copy(state: PlannerState) -> PlannerState:
    return PlannerState(
        loaded=set(state.loaded),
        dedupe=dict(state.dedupe),
        spent_approvals=set(state.spent_approvals),
        finished=dict(state.finished),
    )


_MARKS = ("plain", "floatless")  # what the in-place path notes on a draft for itself


def _fields(d: Any) -> dict[str, Any]:
    fields = {k: getattr(d, k) for k in type(d).__slots__ if k not in _MARKS}
    if isinstance(fields.get("args"), dict):
        fields["args"] = _exact(fields["args"])
        fields["sent"] = _exact(fields.get("sent"))
    return fields


def _exact(value: Any) -> Any:
    """`value` with each leaf's type beside it, NaN made comparable (`1 == 1.0 == True`)."""
    if isinstance(value, dict):
        return ("dict", [(k, _exact(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [_exact(v) for v in value])
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(_batches())
def test_in_place_and_general_plans_are_the_same(batch: dict[str, Any]) -> None:
    """Any batch, any session state, decisions and limits: the same plan and drafts either way."""
    assert _pass1(batch, in_place=True) == _pass1(batch, in_place=False)


@pytest.mark.parametrize("text", _FIXED_TEXTS)
@pytest.mark.parametrize(
    "name",
    ["echo", "spaced", "picky", "alone", "tree", "list_dir", "tagged", "secret_tool", "run_tool", "nope"],
)
def test_in_place_and_general_agree_on_each_text(text: str, name: str) -> None:
    """Every awkward arguments text, for each kind of tool, twice in a batch."""
    arguments = (
        json.dumps({"name": "echo", "args": json.loads(text)})
        if name == "run_tool" and _reads(text)
        else text
    )
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i in range(2)
    ]
    batch = {
        "calls": calls,
        "state": PlannerState(),
        "decisions": {},
        "cache": False,
        "mode": "direct",
        "all_loaded": False,
        "max_argument_bytes": _plan.DEFAULT_MAX_ARGUMENT_BYTES,
    }
    assert _pass1(batch, in_place=True) == _pass1(batch, in_place=False)


def _reads(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def test_an_earlier_success_whose_reads_a_write_touches_runs_again_either_way() -> None:
    """A success remembered with what it read is not served after a write to that, in place
    or not (a tool that read nothing then, and reads nothing now)."""
    echo = call_key("echo", canonical_json({"text": "a"}))
    state = PlannerState(
        dedupe={echo: DedupeEntry(ToolResult("old", "echo", Status.ok, "earlier"), frozenset({"file:/a"}))}
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "/a"}'}},
        {"id": "c2", "type": "function", "function": {"name": "echo", "arguments": '{"text": "a"}'}},
        {"id": "c3", "type": "function", "function": {"name": "echo", "arguments": '{"text": "a"}'}},
    ]
    batch = {
        "calls": calls,
        "state": state,
        "decisions": {},
        "cache": False,
        "mode": "direct",
        "all_loaded": False,
    }
    batch["max_argument_bytes"] = _plan.DEFAULT_MAX_ARGUMENT_BYTES
    outcome = _pass1(batch, in_place=True)
    assert outcome == _pass1(batch, in_place=False)
    assert outcome.plan is not None and outcome.plan[0][1].runs and outcome.plan[0][2].leader == 1


@pytest.mark.parametrize("size", [2, 3])
def test_a_call_id_twice_is_refused_the_second_time(size: int) -> None:
    """In a batch of two as of three, the later call with an id already seen is refused."""
    calls = [
        {
            "id": "c1" if i < 2 else "c3",
            "type": "function",
            "function": {"name": "echo", "arguments": '{"text": "a"}'},
        }
        for i in range(size)
    ]
    plan = make_planner(_REGISTRY).parse(calls)
    assert [d.duplicate for d in plan] == [False, True, False][:size]
    assert plan[1].outcome is not None and "duplicate call id 'c1'" in plan[1].outcome.content


@pytest.mark.parametrize(
    "arguments", [{"x": ("a",)}, {"text": ("a",)}, {"text": "a", "t": ()}, {1: "a"}, {"x": {"y": (1, 2)}}]
)
@pytest.mark.parametrize("name", ["echo", "tree", "alone", "spaced"])
def test_arguments_no_json_text_gives_are_checked_alike(arguments: dict[Any, Any], name: str) -> None:
    """Arguments given as objects (a tuple in them, a key that is not text): the same verdict."""
    calls = [
        ToolCall(id="c1", name=name, arguments=arguments),
        ToolCall(id="c2", name=name, arguments=arguments),
    ]
    batch = {
        "calls": calls,
        "state": PlannerState(),
        "decisions": {},
        "cache": False,
        "mode": "direct",
        "all_loaded": False,
    }
    batch["max_argument_bytes"] = _plan.DEFAULT_MAX_ARGUMENT_BYTES
    assert _pass1(batch, in_place=True) == _pass1(batch, in_place=False)


# JSON without floats, as wide as JSON goes: any character (lone surrogates too), integers
# on both sides of 64 bits, keys that sort differently by UTF-16 and by code point, nesting
_WIDE_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
_WIDE = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(-(2**64) - 2, 2**64 + 2),
        st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
        _WIDE_TEXT,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(_WIDE_TEXT, st.sampled_from(["\uffff", "\U00010000", "\ue000", "a", "A"])),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_WIDE_TEXT, _WIDE, max_size=4), st.booleans(), st.integers(0, 2))
def test_floatless_json_is_read_and_written_as_json_does(
    value: dict[str, Any], ascii: bool, depth: int
) -> None:
    """JSON text without a float: the in-place reading gives what json.loads gives, and the
    form it is keyed in (orjson's, where it takes the value) is json's, byte for byte."""
    for _ in range(depth):
        value = {"v": [value]}
    text = json.dumps(value, ensure_ascii=ascii)
    expected = json.loads(text)
    args, end = _plan._scan_floatless(text, 0)
    assert end == len(text) and _exact(args) == _exact(expected)
    try:
        written = orjson.dumps(args, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        written = None  # the general way writes it
    try:
        canonical = canonical_json(expected)
    except RecursionError:
        assert written is None
        return
    if written is not None:
        assert written.decode() == canonical
    item = {"id": "c1", "type": "function", "function": {"name": "tree", "arguments": text}}
    batch = {
        "calls": [item],
        "state": PlannerState(),
        "decisions": {},
        "cache": False,
        "mode": "direct",
        "all_loaded": False,
    }
    batch["max_argument_bytes"] = _plan.DEFAULT_MAX_ARGUMENT_BYTES
    outcome = _pass1(batch, in_place=True)
    assert outcome == _pass1(batch, in_place=False)
    if outcome.drafts[0]["key"] is not None:  # keyed (not refused for a lone surrogate): as call_key says
        assert outcome.drafts[0]["key"] == call_key("tree", canonical)


@pytest.mark.parametrize(
    "text",
    [
        '{"n": 1.5}',
        '{"n": 1e5}',
        '{"n": 1E-5}',
        '{"n": -0.0}',
        '{"n": NaN}',
        '{"n": -Infinity}',
        '{"t": "1.5", "n": 1e400}',
    ],
)
def test_a_float_anywhere_goes_the_json_way(text: str) -> None:
    """Any number with a fraction or exponent, NaN or an infinity: not keyed through orjson."""
    planner = make_planner(_REGISTRY)
    (d,) = planner.parse([{"id": "c1", "type": "function", "function": {"name": "tree", "arguments": text}}])
    assert not d.floatless and d.from_json and _exact(d.args) == _exact(json.loads(text))
    planner.lookups([d])
    assert d.sent_json == canonical_json(json.loads(text))


@pytest.mark.parametrize(
    "args", [{"n": 1e-05}, {"n": 1e16}, {"n": float("nan")}, {"n": 2**70}, {"t": ("a",)}]
)
def test_a_rewrite_is_keyed_the_general_way(args: dict[str, Any]) -> None:
    """Arguments a rewriter gave are not JSON text's: keyed in the canonical form either way."""
    item = {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "a"}'}}
    batch = {
        "calls": [item],
        "rewrites": {0: ("tree", args)},
        "state": PlannerState(),
        "decisions": {},
        "cache": False,
    }
    batch.update(mode="direct", all_loaded=False, max_argument_bytes=_plan.DEFAULT_MAX_ARGUMENT_BYTES)
    outcome = _pass1(batch, in_place=True)
    assert outcome == _pass1(batch, in_place=False)
    assert outcome.drafts[0]["sent_json"] == canonical_json(args)


@pytest.mark.parametrize(
    "decision",
    [None, Allow(), Allow(args={"n": 1}), Allow(args={"n": 9}), Allow(args={"mode": "read"}), Deny("no")],
)
def test_gated_calls_and_what_their_gate_changes_come_out_alike(decision: Allow | Deny | None) -> None:
    """Calls a gate must answer beside calls taken in place, each decision a gate can give."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "danger", "arguments": '{"n": 5}'}},
        {"id": "c2", "type": "function", "function": {"name": "maybe", "arguments": '{"mode": "write"}'}},
        {"id": "c3", "type": "function", "function": {"name": "picky", "arguments": '{"n": 5}'}},
        {"id": "c4", "type": "function", "function": {"name": "echo", "arguments": '{"text": "a"}'}},
        {"id": "c5", "type": "function", "function": {"name": "danger", "arguments": '{"n": 1}'}},
    ]
    decisions = {} if decision is None else {"c1": decision, "c2": decision, "c3": decision}
    batch = {
        "calls": calls,
        "state": PlannerState(),
        "decisions": decisions,
        "cache": False,
        "mode": "direct",
    }
    batch.update(all_loaded=False, max_argument_bytes=_plan.DEFAULT_MAX_ARGUMENT_BYTES)
    outcome = _pass1(batch, in_place=True)
    assert outcome == _pass1(batch, in_place=False)
    asked = ["c5"] if isinstance(decision, Deny) else ["c1", "c2", "c3", "c5"]  # a Deny comes first
    assert [d["call_id"] for d in outcome.drafts if d.get("confirm")] == asked


def test_the_in_place_path_is_taken() -> None:
    """The echo call of the bench goes the in-place way (else the comparison proves nothing)."""
    planner = make_planner(_REGISTRY)
    drafts = planner.parse(
        [{"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "a"}'}}]
    )
    planner.lookups(drafts)
    assert drafts[0].plain and drafts[0].floatless
    planner.resolve(drafts, {})
    assert planner.finish(drafts).calls[0].runs


# --- whole batches dispatched, their results compared --------------------------------


async def _echo(args: Mapping[str, Any], ctx: Any) -> str:
    return json.dumps(args, sort_keys=True)


async def _boom(args: Mapping[str, Any], ctx: Any) -> str:
    raise ToolError(f"boom {args.get('text')!r}")


def _dispatcher(cache: bool) -> Dispatcher:
    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    tools = [
        Tool("echo", "Echo.", _echo, schema, concurrent=True, deferred=False),
        Tool("boom", "Raises.", _boom, schema, concurrent=True, deferred=False),
        Tool("later", "Deferred.", _echo, schema, concurrent=True),
        Tool("read_file", "Read.", _echo, path_schema(), concurrent=True, deferred=False, reads=file_at_path),
        Tool("write_file", "Write.", _echo, path_schema(), deferred=False, writes=file_at_path),
        Tool("cached", "Cached.", _echo, schema, concurrent=True, deferred=False, cache=CachePolicy(ttl=60)),
        Tool("ask", "Asks.", _echo, schema, concurrent=True, deferred=False, confirm=True),
    ]
    return Dispatcher(Registry(tools), cache=MemoryResultCache() if cache else None)


_DISPATCH_NAMES = ["echo", "boom", "later", "read_file", "write_file", "cached", "ask", "run_tool", "nope"]
_DISPATCH_ARGS = st.one_of(
    st.builds(
        lambda text, path, extra: json.dumps({"text": text, "path": path, **extra}),
        st.sampled_from(["a", "b", "\U0001f600", "x" * 50]),
        st.sampled_from(["/a", "/b"]),
        st.sampled_from(
            [{}, {"force": True}, {"n": 1.5}, {"n": 2**70}, {"headers": {"Authorization": "Bearer abc"}}]
        ),
    ),
    st.builds(
        lambda name: json.dumps({"name": name, "args": {"text": "a", "path": "/a"}}),
        st.sampled_from(_DISPATCH_NAMES),
    ),
    st.sampled_from(['{"text": 1}', "{", '{"text": "\\ud800"}', "[]"]),
)


@st.composite
def _dispatches(draw: st.DrawFn) -> dict[str, Any]:
    batches = draw(
        st.lists(
            st.lists(
                st.builds(
                    lambda i, name, args: {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    },
                    st.integers(1, 5),
                    st.sampled_from(_DISPATCH_NAMES),
                    _DISPATCH_ARGS,
                ),
                max_size=6,
            ),
            min_size=1,
            max_size=3,
        )
    )
    decisions = draw(
        st.lists(
            st.dictionaries(
                st.sampled_from(["c1", "c2"]),
                st.sampled_from([Allow(), Allow(args={"text": "z"}), Deny("no"), Answer("yes")]),
            ),
            min_size=len(batches),
            max_size=len(batches),
        )
    )
    return {
        "batches": batches,
        "decisions": decisions,
        "cache": draw(st.booleans()),
        "mode": draw(st.sampled_from(["deferred", "direct"])),
    }


async def _run(case: dict[str, Any], *, in_place: bool) -> list[list[ToolResult] | str]:
    _plan._IN_PLACE = in_place
    try:
        session = _dispatcher(case["cache"]).session("s", mode=case["mode"])
        out: list[list[ToolResult] | str] = []
        for calls, decisions in zip(case["batches"], case["decisions"], strict=True):
            try:
                results = await session.dispatch(calls, decisions=decisions or None)
                # when and how long a call ran is the clock's, not pass 1's
                out.append(
                    [
                        attrs.evolve(r, started=None if r.started is None else 0.0, duration=0.0)
                        for r in results
                    ]
                )
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        return out
    finally:
        _plan._IN_PLACE = True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_dispatches())
def test_in_place_and_general_dispatch_the_same(case: dict[str, Any]) -> None:
    """Batches in one run (dedupe across them, a cache, decisions, a tool that raises): the
    same results either way."""
    ran = trio.run(functools.partial(_run, case, in_place=True))
    assert ran == trio.run(functools.partial(_run, case, in_place=False))


def test_cache_entry_served_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached tool's hit is no business of the in-place path, which leaves it alone."""
    hits = Hits()
    key = call_key("fetch_page", canonical_json({"url": "u"}))
    hits.entries[key] = CacheEntry("hit", frozenset())
    outcomes = []
    for flag in (True, False):
        monkeypatch.setattr(_plan, "_IN_PLACE", flag)  # restored after: later tests plan in place
        planner = make_planner(_REGISTRY, cache=hits)
        drafts = planner.parse(
            [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "fetch_page", "arguments": '{"url": "u"}'},
                }
            ]
        )
        planner.resolve(drafts, hits.answer(planner.lookups(drafts)))
        outcomes.append(planner.finish(drafts))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].calls[0].outcome is not None and outcomes[0].calls[0].outcome.cached


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize(
    "extra",
    [{"headers": {"Authorization": "Bearer abc"}}, {"url": "https://u:pw@example.com/"}, {"note": "n"}],
)
async def test_a_cached_tool_keeps_credentials_out_of_the_result_cache(
    monkeypatch: pytest.MonkeyPatch, in_place: bool, extra: dict[str, Any]
) -> None:
    """A call of a cached tool whose arguments carry a credential is never stored nor served
    from the result cache; one that carries none is, in place as the general way."""
    monkeypatch.setattr(_plan, "_IN_PLACE", in_place)
    s = _dispatcher(cache=True).session("cache")
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "cached", "arguments": json.dumps({"text": "a", **extra})},
    }
    [first] = await s.dispatch([call])
    s.new_run()
    [again] = await s.dispatch([call])
    assert first.status is Status.ok and not first.cached
    assert again.cached is ("note" in extra)
