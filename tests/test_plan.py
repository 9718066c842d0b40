"""Pass 1, the planner: driven step by step as the session drives it, with no event loop."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache import CacheEntry, CachePolicy
from dispatcher import Allow, Deny, Registry, Status, Tool, ToolCall, ToolDefinitionError, ToolResult
from dispatcher._core_tools import core_registry
from dispatcher._plan import (
    DEFAULT_MAX_ARGUMENT_BYTES,
    DedupeEntry,
    Draft,
    Plan,
    PlannedCall,
    Planner,
    PlannerState,
    call_key,
    canonical_json,
    new_planner,
    parse_json,
)
from dispatcher._results import DEFAULT_MAX_OUTPUT_BYTES

from ._fakes import done, file_at_path, path_schema


def _base_tools() -> list[Tool]:
    return [
        Tool(
            name="echo",
            description="Echo the text.",
            handler=done,
            parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            concurrent=True,
            deferred=False,
        ),
        Tool(
            name="read_file",
            description="Read a file.",
            handler=done,
            parameters=path_schema(),
            concurrent=True,
            deferred=False,
            reads=file_at_path,
        ),
        Tool(
            name="write_file",
            description="Write a file.",
            handler=done,
            parameters=path_schema(content={"type": "string"}),
            deferred=False,
            writes=file_at_path,
        ),
        Tool(
            name="cwrite",
            description="Write a file, concurrently.",
            handler=done,
            parameters=path_schema(),
            concurrent=True,
            deferred=False,
            writes=file_at_path,
        ),
        Tool(
            name="fetch_page",
            description="Fetch a page.",
            handler=done,
            parameters={
                "type": "object",
                "properties": {"url": {"type": "string"}, "headers": {"type": "object"}},
                "required": ["url"],
                "additionalProperties": False,
            },
            concurrent=True,
            deferred=False,
            cache=CachePolicy(ttl=60),
        ),
        Tool(
            name="search_web",
            description="Search the web.",
            handler=done,
            parameters={"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            concurrent=True,
            deferred=False,
            cache=CachePolicy(ttl=60, scope="session"),
        ),
        Tool(
            name="list_dir",
            description="List a folder.",
            handler=done,
            parameters={
                "type": "object",
                "properties": {
                    "path": {"type": "string", "default": "/w"},
                    "depth": {"type": "integer", "default": 1},
                },
            },
            deferred=False,
        ),
        Tool(
            name="secret_tool",
            description="A deferred tool.",
            handler=done,
            parameters={"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        ),
        Tool(
            name="danger",
            description="Needs a yes.",
            handler=done,
            parameters={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            deferred=False,
            confirm=True,
        ),
        Tool(
            name="maybe",
            description="Needs a yes unless reading.",
            handler=done,
            parameters={"type": "object", "properties": {"mode": {"type": "string"}}},
            deferred=False,
            confirm=lambda a: a.get("mode") != "read",
        ),
    ]


_BASE_TOOLS = _base_tools()
_BASE = Registry(_BASE_TOOLS)
_CORE = core_registry()


def make_registry(*extra: Tool) -> Registry:
    """The test palette (built once), or a new registry with `extra` tools added."""
    return Registry([*_BASE_TOOLS, *extra]) if extra else _BASE


class Hits:
    """Stands for a result store: the answers the session hands pass 1 after its lookups."""

    def __init__(self) -> None:
        self.entries: dict[str, CacheEntry] = {}
        self.asked: list[str] = []

    def set(self, key: str | None, content: str, *, ttl: float, reads: Sequence[str] = ()) -> None:
        assert key is not None
        self.entries[key] = CacheEntry(content, frozenset(reads))

    def answer(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        self.asked.extend(keys)
        return {k: self.entries[k] for k in keys if k in self.entries}


_NO_HITS = Hits()


def resolve(planner: Planner, drafts: list[Any], cache: Hits | None = None) -> None:
    """Pass 1's lookups, the store's answer, then resolve, as the session does it."""
    wanted = planner.lookups(drafts)
    planner.resolve(drafts, (cache or _NO_HITS).answer(wanted))


def make_planner(
    registry: Registry | None = None,
    *,
    state: PlannerState | None = None,
    cache: Hits | None = None,
    session_id: str = "s1",
    mode: str = "deferred",
    all_loaded: bool = False,
    max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> Planner:
    planner = new_planner(
        registry=registry if registry is not None else make_registry(),
        core=_CORE,
        state=state if state is not None else PlannerState(),
        has_cache=cache is not None,
        session_id=session_id,
        mode=mode,
        all_loaded=all_loaded,
        max_argument_bytes=max_argument_bytes,
        max_output_bytes=max_output_bytes,
    )
    planner.test_hits = cache  # type: ignore[attr-defined]  # what run_pass1 hands resolve
    return planner


def run_pass1(
    planner: Planner, calls: Sequence[Any], decisions: Mapping[str, Allow | Deny] | None = None
) -> Plan:
    """What Session._dispatch does, with no rewriters and no gate configured."""
    drafts = planner.parse(list(calls))
    resolve(planner, drafts, getattr(planner, "test_hits", None))
    for d in planner.gated(drafts):
        decision = planner.take_decision(d, decisions)
        if isinstance(decision, Deny):
            planner.deny(d, decision.reason)
        elif isinstance(decision, Allow):
            planner.allow(d, decision)
    return planner.finish(drafts)


def plan_one(call: Any, **kw: Any) -> PlannedCall:
    return run_pass1(make_planner(**kw), [call]).calls[0]


def tc(name: str, args: Any = None, call_id: str = "c1") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments={} if args is None else args)


def error_of(p: PlannedCall) -> dict[str, Any]:
    assert p.outcome is not None
    err = p.outcome.error()
    assert err is not None
    return err


def next_line(p: PlannedCall) -> str:
    assert p.outcome is not None
    lines = [ln for ln in p.outcome.content.splitlines() if ln.startswith("next: ")]
    assert len(lines) == 1, p.outcome.content
    return lines[0]


def ok_result(name: str, content: str = "earlier", call_id: str = "old") -> ToolResult:
    return ToolResult(call_id=call_id, name=name, status=Status.ok, content=content)


# -- 1. parse ----------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["  echo  ", "echo<|channel|>commentary", " echo <|end|>", "\techo\n"])
def test_name_is_trimmed_and_cut_at_special_token(raw: str) -> None:
    """A tool name is trimmed and cut at the first `<|`."""
    p = plan_one(tc(raw, {"text": "hi"}))
    assert p.call.name == "echo"
    assert p.runs


def test_json_string_and_dict_arguments_plan_the_same() -> None:
    """A JSON-string argument and the same dict give the same arguments and the same key."""
    as_string = plan_one(tc("echo", '{"text": "hi"}'))
    as_dict = plan_one(tc("echo", {"text": "hi"}))
    assert as_string.call.arguments == as_dict.call.arguments == {"text": "hi"}
    assert as_string.key == as_dict.key is not None
    assert as_string.runs and as_dict.runs


def test_openai_chat_item_is_parsed_with_its_id() -> None:
    """An OpenAI chat tool_calls item is parsed and keeps its id."""
    item = {"id": "call_9", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}
    p = plan_one(item)
    assert p.call == ToolCall(id="call_9", name="echo", arguments={"text": "x"})
    assert p.runs


def test_empty_argument_string_is_an_empty_object() -> None:
    """An empty argument string is read as `{}` (then validated)."""
    p = plan_one(tc("list_dir", ""))
    assert p.runs
    assert p.call.arguments == {"path": "/w", "depth": 1}


def test_unparseable_json_is_invalid_arguments_with_a_hint() -> None:
    """Arguments that are not JSON are invalid_arguments, with a `next:` hint."""
    p = plan_one(tc("echo", '{"text": '))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    err = error_of(p)
    assert "not valid JSON" in err["error"]
    assert err["retryable"] is True
    assert next_line(p) == "next: send the arguments as one JSON object"
    assert not p.runs


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "3", "null"])
def test_json_string_that_is_not_an_object_is_invalid_arguments(raw: str) -> None:
    """A JSON-string argument that is not an object is invalid_arguments."""
    p = plan_one(tc("echo", raw))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "must be a JSON object" in error_of(p)["error"]
    assert next_line(p) == "next: send the arguments as one JSON object"


def test_arguments_of_a_wrong_type_are_invalid_arguments() -> None:
    """Arguments that are neither a JSON string nor a mapping are invalid_arguments."""
    p = plan_one(ToolCall(id="c1", name="echo", arguments=[1, 2]))  # type: ignore[arg-type]
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "got list" in error_of(p)["error"]


def test_unreadable_call_is_invalid_arguments_keeping_its_id() -> None:
    """A call in no known shape is invalid_arguments and keeps the id it carried."""
    p = plan_one({"id": "weird", "nothing": True})
    assert p.call.id == "weird"
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "unreadable tool call" in error_of(p)["error"]


def test_big_argument_string_is_invalid_arguments() -> None:
    """A JSON string over the size limit is invalid_arguments."""
    p = plan_one(tc("echo", json.dumps({"text": "x" * 200})), max_argument_bytes=100)
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "over the limit of 100" in error_of(p)["error"]


def test_big_dict_arguments_are_invalid_arguments() -> None:
    """Dict arguments over the size limit (canonical JSON) are invalid_arguments."""
    p = plan_one(tc("echo", {"text": "x" * 200}), max_argument_bytes=100)
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "over the limit of 100" in error_of(p)["error"]


def test_size_is_measured_in_utf8_bytes_of_canonical_json() -> None:
    """The size counts UTF-8 bytes of the canonical JSON, not characters."""
    args = {"text": "é" * 50}  # 61 characters, 111 bytes
    assert len(canonical_json(args)) < 100 < len(canonical_json(args).encode())
    p = plan_one(tc("echo", args), max_argument_bytes=100)
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "111 bytes" in error_of(p)["error"]


def test_arguments_under_the_limit_run() -> None:
    """Arguments just under the size limit are accepted."""
    args = {"text": "x" * 50}
    assert len(canonical_json(args)) <= 100
    p = plan_one(tc("echo", json.dumps(args, indent=None)), max_argument_bytes=100)
    assert p.runs


def test_size_limit_ignores_escapes_and_whitespace_of_the_raw_string() -> None:
    """The size limit is measured on the canonical JSON, not on the raw string the model sent."""
    raw = '{"text": "' + "\\u0436" * 30 + '"}'  # 192 characters; canonical JSON is 71 bytes
    assert len(canonical_json(json.loads(raw)).encode()) < 100 < len(raw)
    p = plan_one(tc("echo", raw), max_argument_bytes=100)
    assert p.runs, p.outcome


def test_unserialisable_dict_arguments_are_invalid_arguments() -> None:
    """Dict arguments that cannot be written as JSON are invalid_arguments."""
    p = plan_one(tc("echo", {"text": {1, 2}}))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "not JSON-serialisable" in error_of(p)["error"]


def test_top_level_defaults_are_filled_in() -> None:
    """Top-level schema defaults are filled in; given values win."""
    p = plan_one(tc("list_dir", {"path": "/x"}))
    assert p.call.arguments == {"path": "/x", "depth": 1}


def test_defaults_are_part_of_the_key() -> None:
    """A call with the defaults spelled out has the same key as one without."""
    bare = plan_one(tc("list_dir", {}))
    spelled = plan_one(tc("list_dir", {"path": "/w", "depth": 1}))
    other = plan_one(tc("list_dir", {"depth": 2}))
    assert bare.key == spelled.key == call_key("list_dir", canonical_json({"depth": 1, "path": "/w"}))
    assert other.key != bare.key


def test_a_filled_in_default_is_a_copy() -> None:
    """Changing a filled-in default in one call's arguments does not change the next call's."""
    tagged = Tool(
        name="tagged",
        description="Tags.",
        handler=done,
        parameters={"type": "object", "properties": {"tags": {"type": "array", "default": []}}},
        deferred=False,
    )
    planner = make_planner(make_registry(tagged))
    first = run_pass1(planner, [tc("tagged")]).calls[0]
    first.call.arguments["tags"].append("changed")  # type: ignore[index]  # what a handler may do
    second = run_pass1(planner, [tc("tagged")]).calls[0]
    assert second.call.arguments == {"tags": []}


# -- force -------------------------------------------------------------------------------


def test_force_is_taken_out_for_cacheable_tools() -> None:
    """`force` is removed from a cacheable tool's arguments before validation and keying."""
    forced = plan_one(tc("fetch_page", {"url": "https://a.test/", "force": True}))
    plain = plan_one(tc("fetch_page", {"url": "https://a.test/"}))
    assert forced.runs  # additionalProperties is false: force must be gone before validation
    assert forced.call.arguments == {"url": "https://a.test/"}
    assert forced.key == plain.key


def test_force_stays_for_tools_without_a_cache_policy() -> None:
    """`force` is an ordinary argument of a tool with no cache policy."""
    p = plan_one(tc("echo", {"text": "hi", "force": True}))
    assert p.call.arguments == {"text": "hi", "force": True}
    assert p.key != plan_one(tc("echo", {"text": "hi"})).key


def test_force_skips_the_dedupe_lookup() -> None:
    """A forced call runs even when its key succeeded earlier in the run."""
    key = plan_one(tc("fetch_page", {"url": "https://a.test/"})).key
    assert key is not None
    state = PlannerState(dedupe={key: DedupeEntry(ok_result("fetch_page"), frozenset())})
    p = plan_one(tc("fetch_page", {"url": "https://a.test/", "force": True}), state=state)
    assert p.runs and p.outcome is None


def test_force_skips_the_cache_lookup() -> None:
    """A forced call runs even when the result cache holds its key."""
    cache = Hits()
    probe = plan_one(tc("fetch_page", {"url": "https://a.test/"}), cache=cache)
    assert probe.cache_key is not None
    cache.set(probe.cache_key, "cached page", ttl=60)
    p = plan_one(tc("fetch_page", {"url": "https://a.test/", "force": True}), cache=cache)
    assert p.runs and p.cacheable and p.cache_key == probe.cache_key


def test_force_skips_the_in_batch_leader() -> None:
    """A forced call does not follow an identical call earlier in its batch."""
    plan = run_pass1(
        make_planner(),
        [
            tc("fetch_page", {"url": "https://a.test/"}, "c1"),
            tc("fetch_page", {"url": "https://a.test/", "force": True}, "c2"),
        ],
    )
    assert [c.runs for c in plan.calls] == [True, True]


# -- 2. run_tool -------------------------------------------------------------------------


def test_run_tool_is_unwrapped_keeping_the_call_id() -> None:
    """run_tool(name, args) becomes the named tool's call under the same id."""
    item = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "run_tool", "arguments": json.dumps({"name": "echo", "args": {"text": "hi"}})},
    }
    p = plan_one(item)
    assert p.call == ToolCall(id="call_7", name="echo", arguments={"text": "hi"})
    assert p.tool is not None and p.tool.name == "echo"
    assert p.runs


def test_run_tool_accepts_args_as_a_json_string() -> None:
    """run_tool's inner args may be a JSON string."""
    p = plan_one(tc("run_tool", {"name": " echo ", "args": '{"text": "hi"}'}))
    assert p.call.name == "echo"
    assert p.call.arguments == {"text": "hi"}


def test_run_tool_with_bad_inner_args_is_invalid_arguments() -> None:
    """run_tool whose inner args are not a JSON object is invalid_arguments."""
    p = plan_one(tc("run_tool", {"name": "echo", "args": "[1]"}))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments


@pytest.mark.parametrize("args", [{}, {"args": {"text": "hi"}}, {"name": 3}, {"name": "  "}])
def test_run_tool_without_a_name_is_invalid_arguments(args: dict[str, Any]) -> None:
    """run_tool without a tool name is invalid_arguments, with a hint how to call it."""
    p = plan_one(tc("run_tool", args))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "run_tool needs the tool's name" in error_of(p)["error"]
    assert next_line(p) == 'next: call run_tool(name="<tool>", args={...})'


def test_run_tool_cannot_run_itself() -> None:
    """run_tool(name="run_tool") is refused."""
    p = plan_one(tc("run_tool", {"name": "run_tool", "args": {"name": "echo"}}))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert error_of(p)["error"] == "run_tool cannot run run_tool"
    assert not p.runs


# -- 4. existence ------------------------------------------------------------------------


def test_unknown_tool_is_rejected_with_nearest_names() -> None:
    """An unknown name is rejected, "Tool not found: X", with the nearest names in `next:`."""
    p = plan_one(tc("read_fiel", {"path": "/a"}))
    assert p.outcome is not None and p.outcome.status is Status.rejected
    err = error_of(p)
    assert err["error"] == "Tool not found: read_fiel"
    assert err["retryable"] is False and err["effect_uncertain"] is False
    line = next_line(p)
    assert line.startswith("next: did you mean ") and "read_file" in line
    assert p.tool is None and not p.runs


def test_unknown_tool_with_no_near_name_points_to_find_tools() -> None:
    """An unknown name with no near match points to find_tools."""
    p = plan_one(tc("zzzzqqq"))
    assert p.outcome is not None and p.outcome.status is Status.rejected
    assert "find_tools" in next_line(p)


def test_unknown_tool_through_run_tool_is_rejected() -> None:
    """run_tool naming an unknown tool is rejected under that name."""
    p = plan_one(tc("run_tool", {"name": "nope_tool", "args": {}}))
    assert p.outcome is not None and p.outcome.status is Status.rejected
    assert error_of(p)["error"] == "Tool not found: nope_tool"


# -- 5. deferred schemas -----------------------------------------------------------------


def test_deferred_tool_called_directly_is_rejected_with_select_hint() -> None:
    """Mode deferred: a deferred tool called directly and not loaded is rejected with the find_tools hint."""
    p = plan_one(tc("secret_tool", {"x": 1}))
    assert p.outcome is not None and p.outcome.status is Status.rejected
    assert "secret_tool is not loaded" in error_of(p)["error"]
    assert next_line(p) == (
        'next: call find_tools(query="select:secret_tool"), then run_tool(name="secret_tool", args={...})'
    )
    assert p.loads_schema is False


def test_deferred_tool_through_run_tool_returns_its_schema() -> None:
    """Mode deferred: run_tool before the schema was fetched is schema_required, with the schema."""
    planner = make_planner()
    p = run_pass1(planner, [tc("run_tool", {"name": "secret_tool", "args": {"x": 1}})]).calls[0]
    assert p.outcome is not None and p.outcome.status is Status.schema_required
    entry = planner.lookup("secret_tool")
    assert entry is not None
    assert entry.schema_json in p.outcome.content
    assert p.outcome.retryable is True
    assert p.loads_schema is True
    assert not p.runs


def test_loaded_deferred_tool_runs_both_ways() -> None:
    """Once loaded, a deferred tool runs when called directly or through run_tool."""
    state = PlannerState(loaded={"secret_tool"})
    direct = plan_one(tc("secret_tool", {"x": 1}), state=state)
    wrapped = plan_one(tc("run_tool", {"name": "secret_tool", "args": {"x": 1}}), state=state)
    assert direct.runs and wrapped.runs
    assert direct.key == wrapped.key


def test_direct_mode_first_call_of_deferred_tool_returns_schema() -> None:
    """Mode direct: a deferred tool's first call returns its schema instead of running."""
    p = plan_one(tc("secret_tool", {"x": 1}), mode="direct")
    assert p.outcome is not None and p.outcome.status is Status.schema_required
    assert '"secret_tool"' in p.outcome.content
    assert next_line(p) == "next: call secret_tool again with arguments that match the schema"
    assert p.loads_schema is True


@pytest.mark.parametrize("mode", ["deferred", "direct"])
def test_not_deferred_tools_run_on_first_call(mode: str) -> None:
    """deferred=False tools run on their first call in both modes."""
    p = plan_one(tc("echo", {"text": "hi"}), mode=mode)
    assert p.runs and p.outcome is None


@pytest.mark.parametrize("mode", ["deferred", "direct"])
def test_all_loaded_skips_the_schema_step(mode: str) -> None:
    """all_loaded=True (invoke) runs a deferred tool with no schema step."""
    p = plan_one(tc("secret_tool", {"x": 1}), mode=mode, all_loaded=True)
    assert p.runs and p.loads_schema is False


def test_find_tools_is_always_available() -> None:
    """The core find_tools runs on its first call, with its default limit filled in."""
    p = plan_one(tc("find_tools", {"query": "select:secret_tool"}))
    assert p.runs
    assert p.call.arguments == {"query": "select:secret_tool", "limit": 5}


# -- 6. dedupe and cache -----------------------------------------------------------------


def test_run_level_dedupe_serves_the_earlier_result() -> None:
    """A key that succeeded earlier in the run is decided deduped, under the new call id."""
    key = plan_one(tc("read_file", {"path": "/w/a"})).key
    assert key is not None
    earlier = attrs.evolve(ok_result("read_file", "A"), started=1_700_000_000.0, duration=0.5)
    state = PlannerState(dedupe={key: DedupeEntry(earlier, frozenset({"file:/w/a"}))})
    plan = run_pass1(make_planner(state=state), [tc("read_file", {"path": "/w/a"}, "new")])
    p = plan.calls[0]
    assert p.outcome is not None
    assert p.outcome.status is Status.ok and p.outcome.content == "A"
    assert p.outcome.call_id == "new"
    assert p.outcome.deduped is True
    assert p.outcome.started is None and p.outcome.duration == 0.0
    assert not p.runs
    assert plan.groups == ()


def test_in_batch_duplicate_follows_its_leader() -> None:
    """The same key twice in a batch runs once: the second follows the first."""
    plan = run_pass1(
        make_planner(),
        [tc("read_file", {"path": "/w/a"}, "c1"), tc("read_file", {"path": "/w/a"}, "c2")],
    )
    leader, follower = plan.calls
    assert leader.runs and leader.leader is None
    assert follower.leader == 0 and not follower.runs and follower.outcome is None
    assert follower.call.id == "c2"
    assert plan.groups == ((0,),)


def test_duplicate_after_a_write_to_its_reads_runs_again() -> None:
    """A duplicate read after a write that touches what it reads is not a follower."""
    plan = run_pass1(
        make_planner(),
        [
            tc("read_file", {"path": "/w/a"}, "c1"),
            tc("write_file", {"path": "/w/a", "content": "x"}, "c2"),
            tc("read_file", {"path": "/w/a"}, "c3"),
        ],
    )
    assert plan.calls[2].leader is None
    assert [c.runs for c in plan.calls] == [True, True, True]
    assert plan.groups == ((0,), (1,), (2,))


def test_write_to_a_folder_above_breaks_the_follower() -> None:
    """A write to a folder above what a read read also makes the duplicate run again."""
    plan = run_pass1(
        make_planner(),
        [
            tc("read_file", {"path": "/w/a"}, "c1"),
            tc("write_file", {"path": "/w", "content": "x"}, "c2"),
            tc("read_file", {"path": "/w/a"}, "c3"),
        ],
    )
    assert plan.calls[2].runs


def test_write_to_another_path_keeps_the_follower() -> None:
    """A write that does not touch what a read read leaves the duplicate a follower."""
    plan = run_pass1(
        make_planner(),
        [
            tc("read_file", {"path": "/w/a"}, "c1"),
            tc("write_file", {"path": "/w/b", "content": "x"}, "c2"),
            tc("read_file", {"path": "/w/a"}, "c3"),
        ],
    )
    assert plan.calls[2].leader == 0
    assert not plan.calls[2].runs


def test_run_level_entry_overlapping_an_earlier_write_is_not_served() -> None:
    """A dedupe entry whose reads overlap a write earlier in this batch is not served."""
    key = plan_one(tc("read_file", {"path": "/w/a"})).key
    assert key is not None
    state = PlannerState(dedupe={key: DedupeEntry(ok_result("read_file"), frozenset({"file:/w/a"}))})
    plan = run_pass1(
        make_planner(state=state),
        [tc("write_file", {"path": "/w/a", "content": "x"}, "c1"), tc("read_file", {"path": "/w/a"}, "c2")],
    )
    assert plan.calls[1].runs and plan.calls[1].outcome is None


def test_run_level_entry_is_served_after_an_unrelated_write() -> None:
    """A dedupe entry is still served after a write to another path in the batch."""
    key = plan_one(tc("read_file", {"path": "/w/a"})).key
    assert key is not None
    state = PlannerState(dedupe={key: DedupeEntry(ok_result("read_file"), frozenset({"file:/w/a"}))})
    plan = run_pass1(
        make_planner(state=state),
        [tc("write_file", {"path": "/w/b", "content": "x"}, "c1"), tc("read_file", {"path": "/w/a"}, "c2")],
    )
    outcome = plan.calls[1].outcome
    assert outcome is not None and outcome.deduped is True


def test_cache_entry_overlapping_an_earlier_write_is_not_served() -> None:
    """A result-cache entry whose reads overlap a write earlier in this batch is not served."""
    cache = Hits()
    probe = plan_one(tc("fetch_page", {"url": "https://a.test/"}), cache=cache)
    assert probe.cache_key is not None
    cache.set(probe.cache_key, "page", ttl=60, reads=["file:/w/a"])
    plan = run_pass1(
        make_planner(cache=cache),
        [
            tc("write_file", {"path": "/w/a", "content": "x"}, "c1"),
            tc("fetch_page", {"url": "https://a.test/"}, "c2"),
        ],
    )
    assert plan.calls[1].runs


def test_writers_are_never_deduped() -> None:
    """A call that writes runs every time: not a follower, not served from the run's dedupe."""
    args = {"path": "/w/a", "content": "x"}
    key = plan_one(tc("write_file", args)).key
    assert key is not None
    state = PlannerState(dedupe={key: DedupeEntry(ok_result("write_file"), frozenset())})
    plan = run_pass1(make_planner(state=state), [tc("write_file", args, "c1"), tc("write_file", args, "c2")])
    assert [c.runs for c in plan.calls] == [True, True]
    assert [c.leader for c in plan.calls] == [None, None]
    assert plan.groups == ((0,), (1,))


def test_writers_are_not_cacheable() -> None:
    """A call of a cacheable tool that writes is not cacheable."""
    posting = Tool(
        name="post",
        description="Post.",
        handler=done,
        parameters={"type": "object", "properties": {"url": {"type": "string"}}},
        deferred=False,
        cache=CachePolicy(),
        writes=lambda a: {f"url:{a['url']}"},
    )
    p = plan_one(tc("post", {"url": "https://a.test/"}), registry=make_registry(posting), cache=Hits())
    assert p.cacheable is False and p.cache_key is None
    assert p.writes == frozenset({"url:https://a.test/"})


def test_cache_hit_is_decided_cached() -> None:
    """A cacheable call whose key is in the result cache is decided cached; nothing runs."""
    cache = Hits()
    probe = plan_one(tc("fetch_page", {"url": "https://a.test/"}), cache=cache)
    assert probe.cacheable and probe.cache_key == probe.key  # shared scope
    assert probe.cache_key is not None
    cache.set(probe.cache_key, "cached page", ttl=60)
    p = plan_one(tc("fetch_page", {"url": "https://a.test/"}, "c5"), cache=cache)
    assert p.outcome is not None
    assert p.outcome.status is Status.ok and p.outcome.cached is True
    assert p.outcome.content == "cached page" and p.outcome.call_id == "c5"
    assert not p.runs


def test_no_cache_means_not_cacheable() -> None:
    """With no result cache, nothing is cacheable."""
    p = plan_one(tc("fetch_page", {"url": "https://a.test/"}))
    assert p.cacheable is False and p.cache_key is None
    assert p.runs


def test_session_scoped_cache_keys_differ_by_session() -> None:
    """A session-scoped policy keys by session id; a shared one does not."""
    cache = Hits()
    s1 = plan_one(tc("search_web", {"q": "trio"}), cache=cache, session_id="s1")
    s2 = plan_one(tc("search_web", {"q": "trio"}), cache=cache, session_id="s2")
    assert s1.key == s2.key
    assert s1.cache_key is not None and s2.cache_key is not None
    assert s1.cache_key != s2.cache_key
    assert s1.cache_key != s1.key
    shared1 = plan_one(tc("fetch_page", {"url": "https://a.test/"}), cache=cache, session_id="s1")
    shared2 = plan_one(tc("fetch_page", {"url": "https://a.test/"}), cache=cache, session_id="s2")
    assert shared1.cache_key == shared2.cache_key


def test_session_scoped_entry_is_not_served_to_another_session() -> None:
    """A session-scoped cache entry serves only the session that wrote it."""
    cache = Hits()
    s1 = plan_one(tc("search_web", {"q": "trio"}), cache=cache, session_id="s1")
    assert s1.cache_key is not None
    cache.set(s1.cache_key, "results", ttl=60)
    again = plan_one(tc("search_web", {"q": "trio"}), cache=cache, session_id="s1")
    other = plan_one(tc("search_web", {"q": "trio"}), cache=cache, session_id="s2")
    assert again.outcome is not None and again.outcome.cached
    assert other.runs


@pytest.mark.parametrize(
    "args",
    [
        {"url": "https://a.test/", "headers": {"Authorization": "Bearer t"}},
        {"url": "https://a.test/", "headers": {"cookie": "id=1"}},
        {"url": "https://user:pw@a.test/"},
        {"url": "https://a.test/?api_key=1"},
    ],
)
def test_call_with_credentials_is_not_cacheable(args: dict[str, Any]) -> None:
    """A call that carries credentials is never cacheable (and not looked up)."""
    cache = Hits()
    p = plan_one(tc("fetch_page", args), cache=cache)
    assert p.cacheable is False and p.cache_key is None
    assert p.runs
    assert cache.asked == []


def test_cache_policy_when_decides() -> None:
    """A cache policy's `when` predicate decides whether a call is cacheable."""
    getter = Tool(
        name="http_get",
        description="HTTP.",
        handler=done,
        parameters={"type": "object", "properties": {"method": {"type": "string"}}},
        deferred=False,
        cache=CachePolicy(when=lambda a: a.get("method", "GET") == "GET"),
    )
    reg = make_registry(getter)
    cache = Hits()
    assert plan_one(tc("http_get", {"method": "GET"}), registry=reg, cache=cache).cacheable is True
    assert plan_one(tc("http_get", {"method": "POST"}), registry=reg, cache=cache).cacheable is False


# -- 7. validation -----------------------------------------------------------------------


def test_validation_errors_list_paths_and_required_fields() -> None:
    """Schema errors name each JSON path and the required fields; retryable."""
    typed = Tool(
        name="typed",
        description="Typed.",
        handler=done,
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "items": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["path", "items"],
        },
        deferred=False,
    )
    p = plan_one(tc("typed", {"items": [1, "x"]}), registry=make_registry(typed))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert p.outcome.retryable is True
    err = error_of(p)
    assert err["retryable"] is True
    assert "$['items'][1]: 'x' is not of type 'integer'" in err["error"]
    assert "$: 'path' is a required property" in err["error"]
    assert "required: path, items" in p.outcome.content.splitlines()
    assert next_line(p).startswith("next: call typed again with arguments that match its schema: ")
    assert not p.runs


def test_validation_of_an_unwrapped_call_uses_the_inner_tool() -> None:
    """A call through run_tool is validated against the named tool's schema."""
    p = plan_one(tc("run_tool", {"name": "echo", "args": {"text": 3}}))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "$['text']: 3 is not of type 'string'" in error_of(p)["error"]


@pytest.mark.parametrize(
    ("ref", "shown"),
    [
        ("urn:nothing", "urn:nothing"),
        ("http://127.0.0.1:9/schema.json", "http://127.0.0.1:9/schema.json"),
        ("#/$defs/nothing", "#/$defs/nothing"),
        ("#nothing", "#nothing"),
    ],
)
def test_a_schema_reference_that_cannot_be_resolved_fails_only_its_call(
    ref: str, shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `$ref` that resolves nowhere is the tool's fault: `failed`, not retryable, naming the
    tool and the reference; never fetched; the call beside it runs."""

    def no_fetch(*args: Any, **kw: Any) -> Any:
        raise AssertionError(f"pass 1 tried to fetch {args!r}")

    monkeypatch.setattr("urllib.request.urlopen", no_fetch)
    keyword = "$dynamicRef" if ref == "#nothing" else "$ref"
    odd = Tool(
        name="odd",
        description="Odd.",
        handler=done,
        parameters={"type": "object", "properties": {"a": {keyword: ref}}},
        concurrent=True,
        deferred=False,
    )
    plan = run_pass1(make_planner(make_registry(odd)), [tc("odd", {"a": 1}), tc("echo", {"text": "t"}, "c2")])
    broken, sibling = plan.calls
    assert broken.outcome is not None and broken.outcome.status is Status.failed
    assert broken.outcome.retryable is False
    assert f"the schema of odd refers to {shown!r}, which cannot be resolved" in error_of(broken)["error"]
    assert sibling.runs


def test_invalid_arguments_are_not_gated() -> None:
    """A call that fails validation is not offered to the gate."""
    planner = make_planner()
    drafts = planner.parse([tc("danger", {"n": "many"})])
    resolve(planner, drafts)
    assert planner.gated(drafts) == []


# -- seams that raise --------------------------------------------------------------------


def _raising_tool(seam: str) -> Tool:
    def boom(args: Mapping[str, Any]) -> Any:
        return {f"file:{args['path']}"}

    return Tool(
        name=f"t_{seam}",
        description="Seams.",
        handler=done,
        parameters={"type": "object", "properties": {"path": {"type": "string"}}},
        deferred=False,
        **{seam: boom},
    )


@pytest.mark.parametrize("seam", ["reads", "writes", "concurrent", "confirm"])
def test_raising_seam_is_invalid_arguments(seam: str) -> None:
    """A seam that raises on valid arguments makes the call invalid_arguments, naming the tool."""
    tool = _raising_tool(seam)
    p = plan_one(tc(tool.name, {}), registry=make_registry(tool))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    err = error_of(p)["error"]
    assert err.startswith(tool.name)
    assert "could not judge these arguments" in err
    assert "KeyError: 'path'" in err
    assert not p.runs


@pytest.mark.parametrize("seam", ["reads", "writes", "concurrent"])
def test_raising_seam_is_named(seam: str) -> None:
    """The error of a raising seam names the seam, as it does for confirm."""
    tool = _raising_tool(seam)
    p = plan_one(tc(tool.name, {}), registry=make_registry(tool))
    assert f"{tool.name}.{seam}" in error_of(p)["error"]


def test_raising_seam_on_invalid_arguments_reports_the_schema_errors() -> None:
    """When a seam raises on arguments that fail the schema, the schema errors are reported."""
    tool = _raising_tool("reads")
    p = plan_one(tc(tool.name, {"path": 5}), registry=make_registry(tool))
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "$['path']: 5 is not of type 'string'" in error_of(p)["error"]


@pytest.mark.parametrize("seam", ["reads", "writes", "concurrent", "confirm"])
def test_an_async_seam_is_refused_at_registration(seam: str) -> None:
    """Seams are judged in pass 1, which never waits: an async one is refused when registered."""

    async def judge(args: Mapping[str, Any]) -> Any:
        return {"file:/w/a"}

    tool = Tool(name="aseam", description="Async seam.", handler=done, parameters=path_schema(),
                deferred=False, **{seam: judge})  # fmt: skip
    with pytest.raises(ToolDefinitionError, match=f"'aseam': {seam} must be a plain function"):
        make_registry(tool)


# -- 8. the gate -------------------------------------------------------------------------


def _gate_batch() -> list[ToolCall]:
    return [
        tc("echo", {"text": "a"}, "c1"),
        tc("danger", {"n": 1}, "c2"),
        tc("maybe", {"mode": "read"}, "c3"),
        tc("maybe", {"mode": "write"}, "c4"),
        tc("danger", {"n": 2}, "c5"),
    ]


def test_gated_lists_only_confirm_calls_in_order() -> None:
    """gated() lists the calls that need confirmation, in call order."""
    planner = make_planner()
    drafts = planner.parse(_gate_batch())
    resolve(planner, drafts)
    assert [d.call_id for d in planner.gated(drafts)] == ["c2", "c4", "c5"]


def test_no_decision_and_no_gate_runs_the_call() -> None:
    """With no decision (and no gate), a confirm call runs."""
    plan = run_pass1(make_planner(), _gate_batch())
    assert all(c.runs for c in plan.calls)
    assert not any(c.spent_approval for c in plan.calls)


def test_take_decision_allow_is_spent() -> None:
    """An Allow for the call is taken and marked spent."""
    planner = make_planner()
    drafts = planner.parse([tc("danger", {"n": 1}, "c2")])
    resolve(planner, drafts)
    (d,) = planner.gated(drafts)
    decision = planner.take_decision(d, {"c2": Allow()})
    assert decision == Allow()
    assert d.spent_approval is True
    planner.allow(d, Allow())
    p = planner.finish(drafts).calls[0]
    assert p.runs and p.spent_approval is True


def test_take_decision_ignores_a_spent_allow() -> None:
    """An Allow already spent (in spent_approvals) does not count."""
    planner = make_planner(state=PlannerState(spent_approvals={"c2"}))
    drafts = planner.parse([tc("danger", {"n": 1}, "c2")])
    resolve(planner, drafts)
    (d,) = planner.gated(drafts)
    assert planner.take_decision(d, {"c2": Allow()}) is None
    assert d.spent_approval is False


def test_take_decision_without_decisions_is_none() -> None:
    """No decisions, or none for this call, give None."""
    planner = make_planner()
    drafts = planner.parse([tc("danger", {"n": 1}, "c2")])
    resolve(planner, drafts)
    (d,) = planner.gated(drafts)
    assert planner.take_decision(d, None) is None
    assert planner.take_decision(d, {"other": Allow()}) is None
    assert d.spent_approval is False


def test_a_spent_deny_still_refuses() -> None:
    """A Deny refuses even when the call id is among spent approvals."""
    state = PlannerState(spent_approvals={"c2"})
    plan = run_pass1(make_planner(state=state), [tc("danger", {"n": 1}, "c2")], {"c2": Deny("no")})
    outcome = plan.calls[0].outcome
    assert outcome is not None and outcome.status is Status.denied


def test_deny_is_denied() -> None:
    """A Deny decides the call denied, not retryable, with the reason."""
    plan = run_pass1(make_planner(), _gate_batch(), {"c2": Deny("too risky")})
    p = plan.calls[1]
    assert p.outcome is not None and p.outcome.status is Status.denied
    assert p.outcome.retryable is False
    assert error_of(p)["error"] == "denied: too risky"
    assert not p.runs
    assert 1 not in {i for g in plan.groups for i in g}


def test_allow_with_invalid_args_is_invalid_arguments() -> None:
    """Arguments an Allow changed are validated again: invalid ones are invalid_arguments."""
    plan = run_pass1(make_planner(), [tc("danger", {"n": 1}, "c2")], {"c2": Allow(args={"n": "x"})})
    p = plan.calls[0]
    assert p.outcome is not None and p.outcome.status is Status.invalid_arguments
    assert "$['n']" in error_of(p)["error"]


def test_allow_with_args_rekeys_the_call() -> None:
    """Arguments an Allow changed replace the call's and give it a new key."""
    before = plan_one(tc("danger", {"n": 1}, "c2"))
    plan = run_pass1(make_planner(), [tc("danger", {"n": 1}, "c2")], {"c2": Allow(args={"n": 7})})
    p = plan.calls[0]
    assert p.runs
    assert p.call.arguments == {"n": 7}
    assert p.key == call_key("danger", canonical_json({"n": 7}))
    assert p.key != before.key


def test_allow_with_args_is_not_looked_up() -> None:
    """Arguments an Allow changed are not served from the run's dedupe."""
    cacheable = Tool(
        name="careful_get",
        description="Cached, gated.",
        handler=done,
        parameters={"type": "object", "properties": {"url": {"type": "string"}}},
        deferred=False,
        confirm=True,
        cache=CachePolicy(),
    )
    reg = make_registry(cacheable)
    target = plan_one(tc("careful_get", {"url": "https://b.test/"}), registry=reg).key
    assert target is not None
    state = PlannerState(dedupe={target: DedupeEntry(ok_result("careful_get"), frozenset())})
    plan = run_pass1(
        make_planner(reg, state=state),
        [tc("careful_get", {"url": "https://a.test/"}, "c1")],
        {"c1": Allow(args={"url": "https://b.test/"})},
    )
    assert plan.calls[0].key == target
    assert plan.calls[0].runs


def test_allow_that_redirects_a_write_breaks_a_later_follower() -> None:
    """A duplicate read after a write an Allow redirected onto what it reads runs again."""
    gated_write = Tool(
        name="gated_write",
        description="Write after a yes.",
        handler=done,
        parameters=path_schema(),
        deferred=False,
        confirm=True,
        writes=file_at_path,
    )
    plan = run_pass1(
        make_planner(make_registry(gated_write)),
        [
            tc("read_file", {"path": "/w/a"}, "c1"),
            tc("gated_write", {"path": "/w/b"}, "c2"),
            tc("read_file", {"path": "/w/a"}, "c3"),
        ],
        {"c2": Allow(args={"path": "/w/a"})},
    )
    assert plan.calls[1].writes == frozenset({"file:/w/a"})
    assert plan.calls[2].runs  # it must see the write


# -- grouping ----------------------------------------------------------------------------


def test_consecutive_concurrent_calls_form_a_group() -> None:
    """Consecutive concurrent calls run together; a non-concurrent call is a group of its own."""
    plan = run_pass1(
        make_planner(),
        [
            tc("read_file", {"path": "/a"}, "c1"),
            tc("echo", {"text": "x"}, "c2"),
            tc("write_file", {"path": "/z", "content": ""}, "c3"),
            tc("read_file", {"path": "/b"}, "c4"),
            tc("read_file", {"path": "/c"}, "c5"),
        ],
    )
    assert plan.groups == ((0, 1), (2,), (3, 4))


def test_reader_after_concurrent_writer_of_same_path_starts_a_group() -> None:
    """A concurrent read of what a concurrent call of its group writes starts a new group."""
    plan = run_pass1(
        make_planner(),
        [tc("cwrite", {"path": "/w/a"}, "c1"), tc("read_file", {"path": "/w/a"}, "c2")],
    )
    assert plan.groups == ((0,), (1,))


def test_writer_after_concurrent_reader_of_same_path_starts_a_group() -> None:
    """A concurrent write of what a call of its group reads starts a new group."""
    plan = run_pass1(
        make_planner(),
        [tc("read_file", {"path": "/w/a"}, "c1"), tc("cwrite", {"path": "/w/a"}, "c2")],
    )
    assert plan.groups == ((0,), (1,))


def test_concurrent_calls_on_different_paths_share_a_group() -> None:
    """Concurrent reads and writes of unrelated paths stay in one group."""
    plan = run_pass1(
        make_planner(),
        [
            tc("cwrite", {"path": "/w/a"}, "c1"),
            tc("read_file", {"path": "/w/b"}, "c2"),
            tc("cwrite", {"path": "/w/c"}, "c3"),
        ],
    )
    assert plan.groups == ((0, 1, 2),)


def test_decided_and_follower_calls_are_in_no_group() -> None:
    """Calls that will not run (decided, followers) are in no group."""
    plan = run_pass1(
        make_planner(),
        [
            tc("read_file", {"path": "/a"}, "c1"),
            tc("nope", {}, "c2"),
            tc("read_file", {"path": "/a"}, "c3"),
            tc("echo", {"text": 1}, "c4"),
            tc("read_file", {"path": "/b"}, "c5"),
        ],
    )
    assert [c.runs for c in plan.calls] == [True, False, False, False, True]
    assert plan.groups == ((0, 4),)


def test_plan_keeps_every_call_in_order() -> None:
    """The plan holds one PlannedCall per call, in call order, ids preserved."""
    calls = [tc("echo", {"text": str(i)}, f"c{i}") for i in range(5)] + [tc("nope", {}, "bad")]
    plan = run_pass1(make_planner(), calls)
    assert [c.index for c in plan.calls] == list(range(6))
    assert [c.call.id for c in plan.calls] == ["c0", "c1", "c2", "c3", "c4", "bad"]


# -- the step table ----------------------------------------------------------------------


def test_draft_refuses_an_impossible_step() -> None:
    """A step out of order raises RuntimeError naming the call and both steps."""
    d = Draft(index=0, call_id="c1", name="echo", args={})
    with pytest.raises(RuntimeError, match="'c1': cannot go from 'parsed' to 'planned'"):
        d.advance("planned")
    assert d.step == "parsed"


def test_draft_cannot_be_decided_twice() -> None:
    """A decided call cannot be decided again."""
    d = Draft(index=0, call_id="c1", name="echo", args={})
    d.decide(ok_result("echo"))
    with pytest.raises(RuntimeError, match="from 'decided' to 'decided'"):
        d.decide(ok_result("echo"))


def test_planned_draft_cannot_be_finished_again() -> None:
    """Finishing drafts that are already planned raises."""
    planner = make_planner()
    drafts = planner.parse([tc("echo", {"text": "x"})])
    resolve(planner, drafts)
    planner.finish(drafts)
    with pytest.raises(RuntimeError, match="from 'planned'"):
        planner.finish(drafts)


def test_finish_before_resolve_raises() -> None:
    """Finishing a batch that was never resolved raises instead of planning it."""
    planner = make_planner()
    drafts = planner.parse([tc("echo", {"text": "x"})])
    with pytest.raises(RuntimeError, match="from 'parsed' to 'planned'"):
        planner.finish(drafts)


# -- arguments that nest too deeply, and the fast JSON paths -----------------------------


def _nested(depth: int) -> str:
    return '{"text": "x", "deep": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize(
    ("depth", "message"),
    [(100_000, "nest too deeply to read"), (900, "nest too deeply to check against the schema")],
)
def test_arguments_that_nest_too_deeply_are_invalid_not_a_crash(depth: int, message: str) -> None:
    """Arguments nested past what the parser or the validator can follow are invalid_arguments;
    the call beside them is planned as usual."""
    nests = {"type": "array", "items": {"$ref": "#/properties/deep"}}
    deep_tool = Tool(
        "nested", "n", done, {"type": "object", "properties": {"text": {"type": "string"}, "deep": nests}}
    )
    planner = make_planner(make_registry(deep_tool), all_loaded=True)
    plan = run_pass1(planner, [tc("nested", _nested(depth), "deep"), tc("echo", {"text": "hi"}, "fine")])
    deep, fine = plan.calls
    assert deep.outcome is not None and deep.outcome.status is Status.invalid_arguments
    assert message in error_of(deep)["error"]
    assert fine.runs


def test_arguments_that_refer_to_themselves_are_invalid() -> None:
    """A mapping that contains itself (only code can send one) is invalid_arguments, not a crash."""
    args: dict[str, Any] = {"text": "x"}
    args["self"] = args
    p = plan_one(tc("echo", args))
    assert p.outcome is not None and "nest too deeply (or refer to themselves)" in error_of(p)["error"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(
    value=st.dictionaries(st.text(max_size=8), json_values, max_size=5),
    pad=st.sampled_from(["", " ", "\n\t"]),
)
def test_parse_json_and_canonical_json_agree_with_the_json_module(value: dict[str, Any], pad: str) -> None:
    """The fast paths give json.loads's value and json.dumps's canonical text, whitespace or not."""
    text = pad + json.dumps(value, indent=1 if pad else None) + pad
    assert parse_json(text) == json.loads(text)
    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert canonical_json(value) == expected


@pytest.mark.parametrize("text", ['{"a": 1} x', '{"a": 1}{"b": 2}', " {", "", "nul", '{"a": 1,}'])
def test_parse_json_fails_as_json_loads_does(text: str) -> None:
    """Trailing data, truncation and bad tokens raise json.loads's own error."""
    with pytest.raises(ValueError) as ours:
        parse_json(text)
    with pytest.raises(ValueError) as theirs:
        json.loads(text)
    assert str(ours.value) == str(theirs.value)
