"""Attacks on dispatch's input boundary: junk and hostile call items, the SDKs' own objects,
whole messages, results formatted back for each provider, `invoke`, and the LangGraph tool
node. Each test states the promise it checks; a failing one is a promise broken."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from anthropic.types import Message, TextBlock, ToolUseBlock
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from openai.types.responses import ResponseFunctionToolCall

from dispatcher import Dispatcher, Interrupt, Registry, Status, Tool, ToolCall, ToolResult
from dispatcher.langgraph import tool_node

TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PROVIDERS = ("openai", "anthropic", "responses", "openai-responses")


@pytest.fixture
def anyio_backend() -> str:
    """LangGraph runs async nodes on asyncio; the boundary is the same on both loops."""
    return "asyncio"


class Seen:
    def __init__(self) -> None:
        self.args: list[dict[str, Any]] = []

    def echo(self, args: Mapping[str, Any], ctx: Any) -> str:
        self.args.append(dict(args))
        return str(args["text"])

    def free(self, args: Mapping[str, Any], ctx: Any) -> str:
        self.args.append(dict(args))
        return json.dumps(args, sort_keys=True, default=repr)


def registry(seen: Seen | None = None, *, gated: bool = False) -> Registry:
    seen = seen or Seen()
    tools = [
        Tool(name="echo", description="Echo.", handler=seen.echo, parameters=TEXT, deferred=False),
        Tool(
            name="free",
            description="Any object.",
            handler=seen.free,
            parameters={"type": "object"},
            deferred=False,
        ),
    ]
    if gated:
        tools.append(
            Tool(name="deploy", description="Deploy.", handler=seen.echo, parameters=TEXT, confirm=True)
        )
    return Registry(tools)


def session(seen: Seen | None = None) -> Any:
    return Dispatcher(registry(seen)).session("s", mode="direct")


def chat(call_id: Any, arguments: Any = '{"text": "x"}', name: Any = "echo") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def use(block_id: str, text: str = "x") -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id, "name": "echo", "input": {"text": text}}


def check_formats(results: list[ToolResult], ids: list[str]) -> None:
    """Every provider's tool messages carry the results' ids in call order, and none raises."""
    assert [r.call_id for r in results] == ids
    for provider in PROVIDERS:
        messages = Dispatcher(registry()).session("f").tool_messages(results, provider)
        if provider == "openai":
            assert [m["tool_call_id"] for m in messages] == ids
            assert all(m["role"] == "tool" and isinstance(m["content"], str) for m in messages)
        elif provider == "anthropic":
            blocks = messages[0]["content"] if ids else []
            assert [b["tool_use_id"] for b in blocks] == ids
            assert [bool(b.get("is_error")) for b in blocks] == [not r.ok for r in results]
        else:
            assert [m["call_id"] for m in messages] == ids
        json.dumps(messages)  # what goes back to the API is JSON


def status_of(results: list[ToolResult]) -> list[str]:
    return [r.status.value for r in results]


# -- promises that hold ------------------------------------------------------------------


async def test_mixed_shapes_in_one_list_keep_ids_and_order() -> None:
    """Chat, Anthropic, Responses dicts, SDK objects and ToolCalls in one list run in order, ids kept."""
    batch = [
        chat("c1", '{"text": "a"}'),
        ToolUseBlock(id="t1", name="echo", input={"text": "b"}, type="tool_use"),
        TextBlock(text="between", type="text"),
        ResponseFunctionToolCall(type="function_call", call_id="r1", name="echo", arguments='{"text": "c"}'),
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "r2",
            "name": "echo",
            "arguments": '{"text": "d"}',
        },
        ToolCall("tc", "echo", {"text": "e"}),
        use("t2", "f"),
    ]
    results = await session().dispatch(batch)
    assert [(r.call_id, r.content) for r in results] == [
        ("c1", "a"), ("t1", "b"), ("r1", "c"), ("r2", "d"), ("tc", "e"), ("t2", "f")
    ]  # fmt: skip
    check_formats(results, ["c1", "t1", "r1", "r2", "tc", "t2"])


async def test_a_repeated_id_is_refused_and_its_first_call_runs() -> None:
    """An id repeated in a batch (across shapes too) is the later call's invalid_arguments; the first runs."""
    seen = Seen()
    results = await session(seen).dispatch(
        [chat("a", '{"text": "1"}'), use("a", "2"), chat("b", '{"text": "3"}')]
    )
    assert status_of(results) == ["ok", "invalid_arguments", "ok"]
    assert "duplicate call id 'a'" in results[1].content
    assert [a["text"] for a in seen.args] == ["1", "3"]
    check_formats(results, ["a", "a", "b"])


async def test_empty_huge_and_odd_text_ids_come_back_as_given() -> None:
    """Ids that are empty, 1 MB long, or hold NUL, newlines and non-BMP text are preserved exactly."""
    ids = ["", "x" * 1_000_000, "a\x00b", "line\nbreak", "\U0001f600\u200b", "  spaced  "]
    results = await session().dispatch([chat(i) for i in ids])
    assert status_of(results) == ["ok"] * len(ids)
    check_formats(results, ids)


async def test_names_with_control_characters_nul_or_10_mb_are_rejected_in_place() -> None:
    """A name with NUL, escapes or 10 MB is that call's `rejected`, result bounded; siblings run."""
    names = ["ec\x00ho", "\x1b[31mecho", "e" * 10_000_000, None, 7, ""]
    batch = [chat(f"n{i}", name=n) for i, n in enumerate(names)] + [chat("ok")]
    results = await session().dispatch(batch)
    assert status_of(results) == ["rejected"] * len(names) + ["ok"]
    assert all(len(r.content) < 300_000 for r in results)
    check_formats(results, [f"n{i}" for i in range(len(names))] + ["ok"])


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ("[1, 2]", "must be a JSON object"),
        ("null", "must be a JSON object"),
        ('"text"', "must be a JSON object"),
        ("42", "must be a JSON object"),
        ("{", "not valid JSON"),
        ("{'text': 'x'}", "not valid JSON"),
        ('\ufeff{"text": "x"}', "not valid JSON"),
        ('{"text": "x"} trailing', "not valid JSON"),
        ('{"x": ' + "[" * 10_000 + "]" * 10_000 + "}", "nest too deeply"),
        ('{"x": ' + '{"a": ' * 10_000 + "1" + "}" * 10_001, "nest too deeply"),
        ('{"x": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"text": "\\ud800"}', "lone surrogate"),
        ('{"text": "\ud800"}', "lone surrogate"),
        ([1], "must be a JSON object"),
        (7, "must be a JSON object"),
        (b'{"text": "x"}', "must be a JSON object"),
        ({"x": {1, 2}}, "not JSON-serialisable"),
        ({"x": object()}, "not JSON-serialisable"),
    ],
)
async def test_hostile_arguments_are_that_calls_invalid_arguments(arguments: Any, fragment: str) -> None:
    """Arguments that are no JSON object (too deep, huge number, lone surrogate) are named; siblings run."""
    results = await session().dispatch([chat("before"), chat("bad", arguments, "free"), chat("after")])
    assert status_of(results) == ["ok", "invalid_arguments", "ok"]
    assert fragment in results[1].content
    check_formats(results, ["before", "bad", "after"])


async def test_huge_numbers_and_duplicate_keys_are_read_as_python_json_reads_them() -> None:
    """2**70 as text arrives as that integer; with a key given twice, the last wins; each gets a result."""
    seen = Seen()
    results = await session(seen).dispatch(
        [chat("a", f'{{"x": {2**70}}}', "free"), chat("b", '{"text": "1", "text": "2"}')]
    )
    assert status_of(results) == ["ok", "ok"]
    assert seen.args == [{"x": 2**70}, {"text": "2"}]


async def test_an_anthropic_tool_use_whose_input_is_a_string_is_read_as_json() -> None:
    """A tool_use whose input is a JSON string runs; a list or junk text is invalid_arguments."""
    batch = [
        ToolUseBlock.model_construct(id="t1", name="echo", input='{"text": "s"}', type="tool_use"),
        ToolUseBlock.model_construct(id="t2", name="echo", input=[1], type="tool_use"),
        {"type": "tool_use", "id": "t3", "name": "echo", "input": "not json"},
        use("t4"),
    ]
    results = await session().dispatch(batch)
    assert status_of(results) == ["ok", "invalid_arguments", "invalid_arguments", "ok"]
    check_formats(results, ["t1", "t2", "t3", "t4"])


async def test_unknown_blocks_between_tool_uses_are_answered_not_dropped() -> None:
    """An Anthropic message with blocks of unknown types between tool_use blocks answers each, in place."""
    message = {
        "role": "assistant",
        "content": [
            use("t1"),
            {"type": "hologram", "id": "h1"},
            {"type": "text", "text": "hi"},
            {"type": 5},
            use("t2"),
        ],
    }
    results = await session().dispatch(message)
    assert [(r.call_id, r.status.value) for r in results] == [
        ("t1", "ok"), ("h1", "invalid_arguments"), ("call_2", "invalid_arguments"), ("t2", "ok")
    ]  # fmt: skip


async def test_a_responses_function_call_without_call_id_falls_back_to_its_item_id() -> None:
    """A Responses function_call with no call_id is answered under its item id; its neighbours keep theirs."""
    batch = [
        {"type": "function_call", "id": "fc_1", "name": "echo", "arguments": '{"text": "x"}'},
        ResponseFunctionToolCall(type="function_call", call_id="r2", name="echo", arguments='{"text": "y"}'),
    ]
    results = await session().dispatch(batch)
    assert [(r.call_id, r.status.value) for r in results] == [("fc_1", "ok"), ("r2", "ok")]


async def test_junk_items_each_get_an_invalid_arguments_result() -> None:
    """None, numbers, text, bytes, empty lists and dicts in a batch are each that call's invalid_arguments."""
    junk: list[Any] = [
        None,
        5,
        "str",
        b"x",
        [],
        {},
        {1: 2},
        {"id": "f", "type": "function", "function": None},
    ]
    results = await session().dispatch([*junk, chat("ok")])
    assert len(results) == len(junk) + 1
    assert status_of(results)[:-1] == ["invalid_arguments"] * len(junk) and results[-1].ok
    assert results[-2].call_id == "f"
    check_formats(results, [r.call_id for r in results])


async def test_a_generator_of_calls_is_a_batch() -> None:
    """A generator of call items dispatches like the list it yields."""

    def calls() -> Iterator[dict[str, Any]]:
        yield chat("g1")
        yield use("g2")

    results = await session().dispatch(calls())
    assert [(r.call_id, r.status.value) for r in results] == [("g1", "ok"), ("g2", "ok")]


async def test_a_chat_message_with_tool_calls_and_content_answers_its_calls() -> None:
    """A chat message with text and tool calls (dict or SDK object) dispatches exactly its calls."""
    function = {"name": "echo", "arguments": '{"text": "x"}'}
    call = ChatCompletionMessageFunctionToolCall(id="c1", type="function", function=function)
    sdk = ChatCompletionMessage(role="assistant", content="I'll call", tool_calls=[call])
    for message in (sdk, {"role": "assistant", "content": "I'll call", "tool_calls": [chat("c1")]}):
        results = await session().dispatch(message)
        assert [(r.call_id, r.status.value) for r in results] == [("c1", "ok")]


async def test_messages_with_no_tool_calls_are_empty_batches() -> None:
    """Assistant messages with text only, tool_calls None or [] give no results, and format to nothing."""
    text_only = Message.model_validate(
        {"id": "m", "type": "message", "role": "assistant", "model": "claude",
         "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn", "stop_sequence": None,
         "usage": {"input_tokens": 1, "output_tokens": 1}}
    )  # fmt: skip
    for message in (
        text_only,
        {"role": "assistant", "content": "hi", "tool_calls": None},
        {"role": "assistant", "content": "hi", "tool_calls": []},
        ChatCompletionMessage(role="assistant", content="hi"),
        {"role": "assistant", "content": "hi"},
    ):
        s = session()
        assert await s.dispatch(message) == []
        assert s.tool_messages([], "anthropic") == [] and s.tool_messages([], "openai") == []


async def test_five_thousand_calls_keep_ids_and_order_around_bad_ones() -> None:
    """5,000 calls in one batch, a few broken, give 5,000 results in call order with their ids."""
    calls: list[Any] = [chat(f"c{i}", json.dumps({"text": str(i)})) for i in range(5000)]
    calls[100] = chat("c100", "{")
    calls[200] = calls[199]
    calls[300] = use("c300", "u")
    calls[400] = None
    results = await session().dispatch(calls)
    assert len(results) == 5000
    ids = [f"c{i}" for i in range(5000)]
    ids[200], ids[400] = "c199", "call_400"
    check_formats(results, ids)
    bad = {i for i, r in enumerate(results) if not r.ok}
    assert bad == {100, 200, 400}
    assert results[4999].content == "4999" and results[300].content == "u"


async def test_every_status_formats_for_every_provider() -> None:
    """A result of each status, with odd ids and content, formats back for each provider without raising."""
    results = [
        ToolResult(call_id=f"id{i}\x00", name="n", status=status, content="\ud800 \x00 text")
        for i, status in enumerate(Status)
    ]
    for provider in PROVIDERS:
        messages = Dispatcher(registry()).session("f").tool_messages(iter(results), provider)
        assert messages
    anthropic = Dispatcher(registry()).session("f").tool_messages(results, "anthropic")[0]["content"]
    assert [b.get("is_error", False) for b in anthropic] == [s is not Status.ok for s in Status]


async def test_a_call_shaped_object_whose_type_attribute_raises_is_still_read() -> None:
    """An object whose `type` property raises, otherwise call-shaped, runs under its id; its sibling too."""

    class Odd:
        id = "o1"
        name = "echo"
        arguments = '{"text": "x"}'

        @property
        def type(self) -> str:
            raise RuntimeError("no type")

    results = await session().dispatch([Odd(), chat("c1")])
    assert [(r.call_id, r.status.value) for r in results] == [("o1", "ok"), ("c1", "ok")]


async def test_invoke_with_junk_names_answers_with_a_result() -> None:
    """`invoke` of an unknown, None or numeric name is `rejected`; unserialisable input, invalid_arguments."""
    d = Dispatcher(registry())
    assert (await d.invoke("nope", {})).status is Status.rejected
    assert (await d.invoke(None, {})).status is Status.rejected  # type: ignore[arg-type]
    assert (await d.invoke(5, {})).status is Status.rejected  # type: ignore[arg-type]
    assert (await d.invoke("free", {}, input=object())).status is Status.invalid_arguments
    result = await d.invoke("echo", {"text": "x"}, call_id="mine")
    assert (result.call_id, result.content) == ("mine", "x")


# -- LangGraph ---------------------------------------------------------------------------

CONFIG: Any = {"configurable": {"thread_id": "t"}, "metadata": {"langgraph_node": "tools"}}


async def test_tool_node_answers_odd_but_wellformed_tool_calls_one_each() -> None:
    """Calls with a None name, list args, None id, repeated id, invalid_tool_calls each get a ToolMessage."""
    ai = AIMessage("", tool_calls=[{"id": "a", "name": "echo", "args": {"text": "hi"}}])
    ai.tool_calls += [
        {"id": "d", "name": None, "args": None},
        {"id": "e", "name": "echo", "args": "[1]"},
        {"id": None, "name": "echo", "args": {"text": "q"}},
        {"id": "a", "name": "echo", "args": {"text": "dup"}},
    ]  # type: ignore[list-item]
    ai.invalid_tool_calls = [
        {"id": "z", "name": "echo", "args": "{bad", "error": "x", "type": "invalid_tool_call"}
    ]
    out = await tool_node(Dispatcher(registry()))({"messages": [HumanMessage("h"), ai]}, CONFIG)
    assert [(m.tool_call_id, m.status) for m in out["messages"]] == [
        ("a", "success"), ("d", "error"), ("e", "error"), ("", "success"), ("a", "error"), ("z", "error")
    ]  # fmt: skip


async def test_tool_node_with_a_state_without_messages_says_so() -> None:
    """A state with no list of messages is a ValueError naming the key; no AIMessage answers nothing."""
    node = tool_node(Dispatcher(registry()))
    for state in ({}, {"messages": None}):
        with pytest.raises(ValueError, match="no list of messages under 'messages'"):
            await node(state, CONFIG)
    assert await node({"messages": [HumanMessage("h")]}, CONFIG) == {"messages": []}


def _graph(d: Dispatcher, replies: list[AIMessage]) -> Any:
    model = FakeMessagesListChatModel(responses=replies)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", tool_node(d))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


def _answers(state: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    return [(m.tool_call_id, m.status, m.content) for m in state["messages"] if isinstance(m, ToolMessage)]


async def test_a_graph_run_twice_on_one_thread_runs_a_reused_call_id_again() -> None:
    """Two turns on one thread reusing call id c1 with new arguments run each call once, each answered."""
    seen = Seen()
    call = {"id": "c1", "name": "echo", "args": {"text": "one"}}
    again = {**call, "args": {"text": "two"}}
    replies = [
        AIMessage("", tool_calls=[call]),
        AIMessage("done"),
        AIMessage("", tool_calls=[again]),
        AIMessage("done"),
    ]
    graph = _graph(Dispatcher(registry(seen)), replies)
    config = {"configurable": {"thread_id": "same"}}
    await graph.ainvoke({"messages": [HumanMessage("first")]}, config)
    state = await graph.ainvoke({"messages": [HumanMessage("second")]}, config)
    assert _answers(state) == [("c1", "success", "one"), ("c1", "success", "two")]
    assert seen.args == [{"text": "one"}, {"text": "two"}]


async def test_interrupt_then_junk_resume_asks_again_and_a_real_one_runs_once() -> None:
    """A resume value that is no decision leaves the call pending (asked again); 'allow' then runs it once."""
    seen = Seen()
    d = Dispatcher(registry(seen, gated=True), gate=lambda call, ctx: Interrupt("ask"))
    calls = [
        {"id": "c1", "name": "echo", "args": {"text": "free"}},
        {"id": "c2", "name": "deploy", "args": {"text": "v"}},
    ]
    graph = _graph(d, [AIMessage("", tool_calls=calls), AIMessage("shipped")])
    config = {"configurable": {"thread_id": "t"}}
    state = await graph.ainvoke({"messages": [HumanMessage("go")]}, config)
    assert [p["call_id"] for p in state["__interrupt__"][0].value["pending"]] == ["c2"]
    for junk in (42, [1, 2], {"c2": 7}):
        state = await graph.ainvoke(Command(resume=junk), config)
        assert "__interrupt__" in state and seen.args == []
    state = await graph.ainvoke(Command(resume={"c2": "allow"}), config)
    assert _answers(state) == [("c1", "success", "free"), ("c2", "success", "v")]
    assert seen.args == [{"text": "free"}, {"text": "v"}]


# -- promises broken -----------------------------------------------------------------------


async def test_an_item_whose_attribute_access_raises_does_not_take_down_its_siblings() -> None:
    """An item whose every attribute access raises is that call's invalid_arguments; its sibling runs."""

    class Hostile:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"no {name} for you")

    results = await session().dispatch([Hostile(), chat("c1")])
    assert [(r.call_id, r.status.value) for r in results] == [("call_0", "invalid_arguments"), ("c1", "ok")]


async def test_a_mapping_whose_access_raises_does_not_take_down_its_siblings() -> None:
    """A Mapping item whose get/getitem raises is that call's invalid_arguments; its siblings run."""

    class BadGet(dict):  # type: ignore[type-arg]
        def get(self, *args: Any) -> Any:
            raise RuntimeError("get")

    class BadItem(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            raise RuntimeError("getitem")

        def __iter__(self) -> Iterator[str]:
            return iter(["id"])

        def __len__(self) -> int:
            return 1

    for bad in (BadGet(id="x"), BadItem()):
        results = await session().dispatch([bad, chat("c1")])
        assert status_of(results) == ["invalid_arguments", "ok"]


async def test_a_call_dict_with_arguments_under_another_key_is_not_run_with_empty_arguments() -> None:
    """{"id", "name", "input"|"args"} (untyped tool_use, LangChain shape) never runs with args dropped."""
    seen = Seen()
    batch = [
        {"id": "a", "name": "free", "input": {"text": "x"}},  # an Anthropic tool_use without its "type"
        {"id": "b", "name": "free", "args": {"text": "y"}, "type": "tool_call"},  # a LangChain ToolCall
    ]
    results = await session(seen).dispatch(batch)
    assert len(results) == 2
    for result, sent in zip(results, ({"text": "x"}, {"text": "y"}), strict=True):
        # either the arguments reach the tool, or the call is refused naming the problem
        assert result.status is Status.invalid_arguments or sent in seen.args, (result, seen.args)
    assert {} not in seen.args


async def test_dispatching_an_aimessage_never_drops_its_arguments() -> None:
    """An AIMessage given to dispatch runs its calls with their args or refuses them; never with {}."""
    seen = Seen()
    ai = AIMessage("", tool_calls=[{"id": "a", "name": "free", "args": {"text": "hi"}}])
    results = await session(seen).dispatch(ai)
    assert len(results) == 1 and results[0].call_id == "a"
    assert seen.args in ([{"text": "hi"}], [])
    assert results[0].ok or results[0].status is Status.invalid_arguments


async def test_tool_node_survives_a_tool_call_without_a_name_or_not_a_dict() -> None:
    """An AIMessage whose tool_calls hold junk (no name, a bare string) answers each; the good ones run."""
    node = tool_node(Dispatcher(registry()))
    for junk in ({"id": "c"}, "junk"):
        ai = AIMessage("", tool_calls=[{"id": "a", "name": "echo", "args": {"text": "hi"}}])
        ai.tool_calls.append(junk)  # type: ignore[arg-type]
        out = await node({"messages": [HumanMessage("h"), ai]}, CONFIG)
        assert [m.status for m in out["messages"]] == ["success", "error"]
        assert out["messages"][0].tool_call_id == "a"


async def test_a_call_whose_id_is_none_is_not_answered_under_the_id_none() -> None:
    """A call whose id is None (SDK objects made without one) is not given the made-up id 'None'."""
    batch = [
        ChatCompletionMessageFunctionToolCall.model_construct(
            id=None, type="function", function={"name": "echo", "arguments": '{"text": "x"}'}
        ),
        ResponseFunctionToolCall.model_construct(
            type="function_call", name="echo", arguments='{"text": "y"}'
        ),
    ]
    results = await session().dispatch(batch)
    assert len(results) == 2
    assert "None" not in [r.call_id for r in results]


async def test_a_message_with_empty_tool_calls_and_tool_use_content_does_not_drop_the_calls() -> None:
    """A message dict with tool_calls [] but tool_use blocks in its content answers those blocks."""
    message = {"role": "assistant", "tool_calls": [], "content": [use("t1"), use("t2")]}
    results = await session().dispatch(message)
    assert [r.call_id for r in results] == ["t1", "t2"]


@pytest.mark.parametrize("bad", [{"zz": "allow"}, "maybe", {"c2": {"allow": 5}}])
async def test_one_malformed_resume_value_does_not_wedge_the_thread(bad: Any) -> None:
    """A resume value the node cannot read asks again, saying what was wrong; a correct
    resume {"c2": "allow"} then runs c2 once."""
    seen = Seen()
    d = Dispatcher(registry(seen, gated=True), gate=lambda call, ctx: Interrupt("ask"))
    calls = [{"id": "c2", "name": "deploy", "args": {"text": "v"}}]
    graph = _graph(d, [AIMessage("", tool_calls=calls), AIMessage("shipped")])
    config = {"configurable": {"thread_id": "t"}}
    await graph.ainvoke({"messages": [HumanMessage("go")]}, config)
    asked = await graph.ainvoke(Command(resume=bad), config)
    [again] = asked["__interrupt__"]
    assert [p["call_id"] for p in again.value["pending"]] == ["c2"]
    assert again.value["problem"].startswith(("resume names calls that are not pending", "a decision"))
    assert seen.args == []
    state = await graph.ainvoke(Command(resume={"c2": "allow"}), config)
    assert _answers(state) == [("c2", "success", "v")]
    assert seen.args == [{"text": "v"}]
