"""dispatcher.langgraph in real StateGraphs with a scripted chat model: the agent loop, an
approval interrupted and resumed, parallel branches, and a graph of tool steps. LangGraph
runs async nodes on asyncio, so these tests run there only."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Annotated, Any, TypedDict

import anyio
import pytest
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from dispatcher import Allow, Deny, Dispatcher, Interrupt, Registry, Tool, UnknownTool
from dispatcher.langgraph import APPROVAL, ToolStepFailed, decisions_from, tool_node, tool_step


@pytest.fixture
def anyio_backend() -> str:
    """LangGraph runs async nodes on asyncio."""
    return "asyncio"


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _registry(runs: list[str]) -> Registry:
    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        runs.append(f"echo:{args['text']}")
        return str(args["text"])

    async def boom(args: Mapping[str, Any], ctx: Any) -> str:
        runs.append("boom")
        raise RuntimeError("the tool broke")

    async def deploy(args: Mapping[str, Any], ctx: Any) -> str:
        runs.append(f"deploy:{args['text']}")
        return f"deployed {args['text']}"

    return Registry(
        [
            Tool("echo", "Echo the text.", echo, TEXT, concurrent=True),  # deferred: loaded by the node
            Tool("boom", "Always fails.", boom, {"type": "object"}, concurrent=True),
            Tool("deploy", "Deploy, once approved.", deploy, TEXT, confirm=True),
        ]
    )


def _ask(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "name": name, "args": args, "type": "tool_call"}


def _agent_graph(d: Dispatcher, replies: list[AIMessage], checkpointer: Any = None) -> Any:
    model = FakeMessagesListChatModel(responses=replies)

    async def agent(state: Chat) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    g = StateGraph(Chat)
    g.add_node("agent", agent)
    g.add_node("tools", tool_node(d))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=checkpointer)


def _tool_messages(state: Mapping[str, Any]) -> list[ToolMessage]:
    return [m for m in state["messages"] if isinstance(m, ToolMessage)]


async def test_the_agent_loop_answers_every_call_in_order_and_dedupes_within_a_turn() -> None:
    """In the agent loop, the node answers each call in call order with its id, marks a
    failure status="error", serves a repeat in the same turn without running it, and runs
    it again in the conversation's next turn."""
    runs: list[str] = []
    d = Dispatcher(_registry(runs))
    replies = [
        AIMessage(
            "", tool_calls=[_ask("c1", "echo", text="a"), _ask("c2", "boom"), _ask("c3", "echo", text="b")]
        ),
        AIMessage("", tool_calls=[_ask("c4", "echo", text="a")]),
        AIMessage("done"),
        AIMessage("", tool_calls=[_ask("c5", "echo", text="a")]),
        AIMessage("done again"),
    ]
    graph = _agent_graph(d, replies, InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    state = await graph.ainvoke({"messages": [HumanMessage("go")]}, config)
    answered = _tool_messages(state)
    assert [(m.tool_call_id, m.name, m.status, m.content) for m in answered[:3]] == [
        ("c1", "echo", "success", "a"),
        ("c2", "boom", "error", answered[1].content),
        ("c3", "echo", "success", "b"),
    ]
    assert json.loads(answered[1].content.split("\n", 1)[0])["status"] == "failed"
    assert answered[3].content == "a" and answered[3].response_metadata["threepass"]["deduped"] is True
    assert state["messages"][-1].content == "done"
    assert runs == ["echo:a", "boom", "echo:b"]

    state = await graph.ainvoke({"messages": [HumanMessage("again")]}, config)
    assert _tool_messages(state)[-1].response_metadata["threepass"]["deduped"] is False
    assert runs == ["echo:a", "boom", "echo:b", "echo:a"]  # a new turn: dedupe started empty
    assert [e.call_id for e in d.session("t1/tools").history] == ["c1", "c2", "c3", "c4", "c5"]


async def test_an_approval_interrupts_the_graph_and_resuming_runs_each_call_exactly_once() -> None:
    """A gate's Interrupt becomes LangGraph's interrupt() with the pending calls; nothing of
    the batch ran before it, and after Command(resume=...) the approved call and its
    ungated neighbour each run exactly once."""
    runs: list[str] = []
    d = Dispatcher(_registry(runs), gate=lambda call, ctx: Interrupt("deploys need a human", {"env": "prod"}))
    replies = [
        AIMessage("", tool_calls=[_ask("c1", "echo", text="before"), _ask("c2", "deploy", text="v2")]),
        AIMessage("shipped"),
    ]
    graph = _agent_graph(d, replies, InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    state = await graph.ainvoke({"messages": [HumanMessage("ship it")]}, config)
    (asked,) = state["__interrupt__"]
    assert asked.value == {
        "type": APPROVAL,
        "session_id": "t1/tools",
        "pending": [
            {
                "call_id": "c2",
                "name": "deploy",
                "args": {"text": "v2"},
                "reason": "deploys need a human",
                "payload": {"env": "prod"},
            }
        ],
    }
    assert runs == []

    state = await graph.ainvoke(Command(resume={"c2": "allow"}), config)
    assert runs == ["echo:before", "deploy:v2"]
    assert [(m.tool_call_id, m.status, m.content) for m in _tool_messages(state)] == [
        ("c1", "success", "before"),
        ("c2", "success", "deployed v2"),
    ]
    assert state["messages"][-1].content == "shipped"


async def test_a_denial_on_resume_refuses_the_call_without_running_it() -> None:
    """Resuming with {"deny": reason} answers the call status="error" with the reason; it never runs."""
    runs: list[str] = []
    d = Dispatcher(_registry(runs), gate=lambda call, ctx: Interrupt("ask"))
    replies = [AIMessage("", tool_calls=[_ask("c1", "deploy", text="v3")]), AIMessage("ok, not shipping")]
    graph = _agent_graph(d, replies, InMemorySaver())
    config = {"configurable": {"thread_id": "t9"}}
    await graph.ainvoke({"messages": [HumanMessage("ship")]}, config)
    state = await graph.ainvoke(Command(resume={"deny": "not on a Friday"}), config)
    (answer,) = _tool_messages(state)
    assert (answer.status, runs) == ("error", [])
    assert "not on a Friday" in answer.content


async def test_decisions_given_one_resume_at_a_time_add_up_and_each_call_runs_once() -> None:
    """Resuming with a decision for one of two pending calls interrupts again for the
    other alone; after the second resume the approved call has run once and the denied
    one never."""
    runs: list[str] = []
    d = Dispatcher(_registry(runs), gate=lambda call, ctx: Interrupt("ask"))
    replies = [
        AIMessage("", tool_calls=[_ask("c1", "deploy", text="a"), _ask("c2", "deploy", text="b")]),
        AIMessage("half shipped"),
    ]
    graph = _agent_graph(d, replies, InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    state = await graph.ainvoke({"messages": [HumanMessage("ship both")]}, config)
    assert [p["call_id"] for p in state["__interrupt__"][0].value["pending"]] == ["c1", "c2"]
    state = await graph.ainvoke(Command(resume={"c1": "allow"}), config)
    assert [p["call_id"] for p in state["__interrupt__"][0].value["pending"]] == ["c2"]
    assert runs == []
    state = await graph.ainvoke(Command(resume={"c2": "deny"}), config)
    assert runs == ["deploy:a"]
    assert [(m.tool_call_id, m.status) for m in _tool_messages(state)] == [("c1", "success"), ("c2", "error")]


class Fork(TypedDict, total=False):
    left: str
    right: str


async def test_parallel_branches_run_side_by_side_in_sessions_of_their_own() -> None:
    """Two branches of one thread each get their own session, so their calls are in
    flight at the same time (each waits for the other) instead of queueing."""
    arrived: list[str] = []
    both = anyio.Event()

    async def meet(args: Mapping[str, Any], ctx: Any) -> str:
        arrived.append(args["side"])
        if len(arrived) == 2:
            both.set()
        with anyio.fail_after(5):
            await both.wait()
        return f"{args['side']} met {ctx.session_id}"

    d = Dispatcher(Registry([Tool("meet", "Wait for the other side.", meet, {"type": "object"})]))
    g = StateGraph(Fork)
    g.add_node("left", tool_step(d, "meet", static={"side": "L"}, output_key="left"))
    g.add_node("right", tool_step(d, "meet", static={"side": "R"}, output_key="right"))
    g.add_edge(START, "left")
    g.add_edge(START, "right")
    g.add_edge("left", END)
    g.add_edge("right", END)
    with anyio.fail_after(10):
        state = await g.compile().ainvoke({}, {"configurable": {"thread_id": "t1"}})
    assert state == {"left": "L met t1/left", "right": "R met t1/right"}
    assert sorted(arrived) == ["L", "R"]


class Pipeline(TypedDict, total=False):
    input: str
    split: str
    total: str


async def test_a_graph_of_tool_steps_threads_each_output_into_the_next_step() -> None:
    """Each step gets its static configuration with the previous step's output as
    args["input"] (parsed when it is JSON) and writes its content under its output key."""
    seen: dict[str, Mapping[str, Any]] = {}

    def split(args: Mapping[str, Any], ctx: Any) -> list[int]:
        seen["split"] = dict(args)
        return [int(part) for part in args["input"].split(args["sep"])]

    def total(args: Mapping[str, Any], ctx: Any) -> int:
        seen["total"] = dict(args)
        return sum(args["input"]) * args["scale"]

    d = Dispatcher(
        Registry(
            [
                Tool("split", "Split a list of numbers.", split, {"type": "object"}),
                Tool("total", "Sum them, scaled.", total, {"type": "object"}),
            ]
        )
    )
    g = StateGraph(Pipeline)
    g.add_node(tool_step(d, "split", static={"sep": ","}))  # named after its tool, writes state["split"]
    g.add_node("sum", tool_step(d, "total", static={"scale": 2}, input_key="split", output_key="total"))
    g.add_edge(START, "split")
    g.add_edge("split", "sum")
    g.add_edge("sum", END)
    state = await g.compile().ainvoke({"input": "1,2,3"}, {"configurable": {"thread_id": "p1"}})
    assert seen == {"split": {"sep": ",", "input": "1,2,3"}, "total": {"scale": 2, "input": [1, 2, 3]}}
    assert (state["split"], state["total"]) == ("[1, 2, 3]", "12")


async def test_a_failed_step_raises_and_an_unknown_tool_fails_at_build_time() -> None:
    """A step whose call does not succeed raises ToolStepFailed with the result; a step of a
    tool nobody registered raises UnknownTool when the graph is built."""
    d = Dispatcher(_registry([]))
    with pytest.raises(UnknownTool):
        tool_step(d, "nope")
    g = StateGraph(Pipeline)
    g.add_node("b", tool_step(d, "boom"))
    g.add_edge(START, "b")
    g.add_edge("b", END)
    with pytest.raises(ToolStepFailed) as caught:
        await g.compile().ainvoke({"input": "x"})
    assert caught.value.result.status == "failed" and caught.value.result.name == "boom"


async def test_a_gated_step_resumes_by_its_stable_call_id_and_runs_once() -> None:
    """A step's call keeps its id when the node runs again on resume, so the decision in
    Command(resume=...) reaches it and the tool runs exactly once."""
    runs: list[str] = []
    d = Dispatcher(_registry(runs), gate=lambda call, ctx: Interrupt("ask"))
    g = StateGraph(Pipeline)
    g.add_node("ship", tool_step(d, "deploy", static={"text": "v1"}, input_key=None, output_key="total"))
    g.add_edge(START, "ship")
    g.add_edge("ship", END)
    graph = g.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    state = await graph.ainvoke({}, config)
    (pending,) = state["__interrupt__"][0].value["pending"]
    state = await graph.ainvoke(Command(resume={pending["call_id"]: "approve"}), config)
    assert (state["total"], runs) == ("deployed v1", ["deploy:v1"])


def test_resume_values_become_the_kernels_decisions() -> None:
    """One decision applies to every pending call; a mapping is keyed by call id; words,
    booleans, {"deny": reason}, {"allow": args} and decision objects are accepted."""
    assert decisions_from("allow", ["a", "b"]) == {"a": Allow(), "b": Allow()}
    assert decisions_from({"deny": "no"}, ["a"]) == {"a": Deny("no")}
    assert decisions_from(
        {"a": True, "b": "reject", "c": {"allow": {"text": "safer"}}, "d": Deny("why")}, ["a", "b", "c", "d"]
    ) == {"a": Allow(), "b": Deny("denied by the user"), "c": Allow({"text": "safer"}), "d": Deny("why")}
    with pytest.raises(ValueError, match="not pending"):
        decisions_from({"zzz": "allow"}, ["a"])
    with pytest.raises(ValueError, match="'allow' or 'deny'"):
        decisions_from("maybe", ["a"])


def test_importing_the_kernel_imports_no_langgraph() -> None:
    """`import dispatcher` loads neither langgraph nor langchain-core."""
    code = (
        "import sys, dispatcher; print([m for m in sys.modules if m.startswith(('langgraph', 'langchain'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_messages_in_a_list_state_are_answered_as_a_list() -> None:
    """A state that is a plain list of messages gets a list of ToolMessages back."""
    d = Dispatcher(_registry([]))
    node = tool_node(d)

    async def main() -> Any:
        return await node([HumanMessage("hi"), AIMessage("", tool_calls=[_ask("c1", "echo", text="x")])], {})

    out = anyio.run(main, backend="asyncio")
    assert [(m.tool_call_id, m.content) for m in out] == [("c1", "x")]
