"""The agent frameworks threepass is compared with, each behind one small adapter.

Each adapter is a :class:`bench.workloads.BatchRunner`: ``setup(toolbox)`` registers the
benchmark's tools the way that framework's users register a typed async function, and
``run_batch(calls)`` performs one whole run in which a scripted model (no network)
emits the batch as its tool calls, the framework executes them, and the model then
answers with text. The tool outputs come back as strings in call order.

- ``langgraph``: the prebuilt ``ToolNode`` as the only node of a ``StateGraph`` over
  ``MessagesState``, given an ``AIMessage`` whose ``tool_calls`` are the batch, via
  ``graph.ainvoke`` (the graph supplies the runtime config the node needs). The model
  is not part of the graph, so its JSON arguments are parsed in ``run_batch``, as a
  chat-model integration would before building the ``AIMessage``.
- ``openai-agents``: ``Runner.run`` on an ``Agent`` whose model is a scripted
  implementation of the SDK's ``Model`` interface, tools made with ``function_tool``,
  tracing disabled.
- ``pydantic-ai``: ``Agent.run`` with a ``FunctionModel`` that returns the batch as
  ``ToolCallPart`` items on its first call and text on its second.

All three run on asyncio. Frameworks are imported inside the adapters, so this module
imports without them; :func:`missing_reason` says why one cannot run, and the harness
(``python -m bench``, bench/harness.py) reports it as "not installed".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
from collections.abc import Sequence
from typing import Any

from bench.workloads import Call, LoopName, Toolbox

_FINAL_TEXT = "done"
_USER_PROMPT = "Run the tools."


class LangGraphPeer:
    """LangGraph's prebuilt ``ToolNode`` inside a one-node ``StateGraph``."""

    name = "langgraph"
    title = "LangGraph ToolNode"
    loop: LoopName = "asyncio"
    modules: tuple[str, ...] = ("langgraph", "langchain_core")
    distributions: tuple[str, ...] = ("langgraph", "langgraph-prebuilt", "langchain-core")

    def __init__(self) -> None:
        self._graph: Any = None
        self._ai_message: Any = None
        self._tool_message: Any = None

    async def setup(self, toolbox: Toolbox) -> None:
        from langchain_core.messages import AIMessage, ToolMessage
        from langgraph.graph import END, START, MessagesState, StateGraph
        from langgraph.prebuilt import ToolNode

        self._ai_message, self._tool_message = AIMessage, ToolMessage
        builder = StateGraph(MessagesState)
        builder.add_node("tools", ToolNode(toolbox.functions()))
        builder.add_edge(START, "tools")
        builder.add_edge("tools", END)
        self._graph = builder.compile()

    async def run_batch(self, calls: Sequence[Call]) -> list[str]:
        message = self._ai_message(
            content="",
            tool_calls=[
                {"id": c.id, "name": c.name, "args": json.loads(c.arguments), "type": "tool_call"}
                for c in calls
            ],
        )
        state = await self._graph.ainvoke({"messages": [message]})
        outputs = {m.tool_call_id: m.content for m in state["messages"] if isinstance(m, self._tool_message)}
        return [str(outputs[c.id]) for c in calls]


class OpenAIAgentsPeer:
    """OpenAI Agents SDK: ``Runner.run`` with a scripted ``Model`` and ``function_tool``s."""

    name = "openai-agents"
    title = "OpenAI Agents SDK"
    loop: LoopName = "asyncio"
    modules: tuple[str, ...] = ("agents",)
    distributions: tuple[str, ...] = ("openai-agents", "openai")

    def __init__(self) -> None:
        self._agent: Any = None
        self._model: Any = None
        self._runner: Any = None

    async def setup(self, toolbox: Toolbox) -> None:
        from agents import Agent, Runner, function_tool, set_tracing_disabled

        set_tracing_disabled(True)
        self._runner = Runner
        self._model = _scripted_openai_model()
        self._agent = Agent(
            name="bench",
            instructions="Run the tools.",
            model=self._model,
            tools=[function_tool(fn) for fn in toolbox.functions()],
        )

    async def run_batch(self, calls: Sequence[Call]) -> list[str]:
        self._model.script(calls)
        result = await self._runner.run(self._agent, _USER_PROMPT)
        if result.final_output != _FINAL_TEXT:
            raise AssertionError(f"unexpected final output {result.final_output!r}")
        outputs = {
            item.call_id: item.output for item in result.new_items if item.type == "tool_call_output_item"
        }
        return [str(outputs[c.id]) for c in calls]


def _scripted_openai_model() -> Any:
    """A ``agents.Model`` that emits a scripted batch on its first turn, then text."""
    from agents import Model, ModelResponse, Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    class ScriptedModel(Model):
        def __init__(self) -> None:
            self._calls: Sequence[Call] = ()
            self._turn = 0

        def script(self, calls: Sequence[Call]) -> None:
            self._calls = calls
            self._turn = 0

        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            turn, self._turn = self._turn, self._turn + 1
            output: list[Any]
            if turn == 0 and self._calls:
                output = [
                    ResponseFunctionToolCall(
                        id=f"fc_{c.id}",
                        call_id=c.id,
                        name=c.name,
                        arguments=c.arguments,
                        type="function_call",
                        status="completed",
                    )
                    for c in self._calls
                ]
            else:
                output = [
                    ResponseOutputMessage(
                        id=f"msg_{turn}",
                        type="message",
                        role="assistant",
                        status="completed",
                        content=[ResponseOutputText(type="output_text", text=_FINAL_TEXT, annotations=[])],
                    )
                ]
            return ModelResponse(output=output, usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the benchmark drives Runner.run, never run_streamed")

    return ScriptedModel()


class PydanticAIPeer:
    """Pydantic AI: ``Agent.run`` with a ``FunctionModel`` that scripts one batch."""

    name = "pydantic-ai"
    title = "Pydantic AI"
    loop: LoopName = "asyncio"
    modules: tuple[str, ...] = ("pydantic_ai",)
    distributions: tuple[str, ...] = ("pydantic-ai-slim", "pydantic")

    def __init__(self) -> None:
        self._agent: Any = None
        self._calls: Sequence[Call] = ()
        self._turn = 0

    async def setup(self, toolbox: Toolbox) -> None:
        from pydantic_ai import Agent, Tool
        from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
        from pydantic_ai.models.function import AgentInfo, FunctionModel
        from pydantic_ai.usage import RequestUsage

        # A real model reports its usage; without it FunctionModel estimates token counts
        # from the whole message history, which is test-double work, not framework work.
        usage = RequestUsage(input_tokens=1, output_tokens=1)

        async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            turn, self._turn = self._turn, self._turn + 1
            if turn == 0 and self._calls:
                return ModelResponse(
                    parts=[
                        ToolCallPart(tool_name=c.name, args=c.arguments, tool_call_id=c.id)
                        for c in self._calls
                    ],
                    usage=usage,
                )
            return ModelResponse(parts=[TextPart(content=_FINAL_TEXT)], usage=usage)

        self._agent = Agent(
            FunctionModel(respond),
            tools=[Tool(fn, takes_ctx=False) for fn in toolbox.functions()],
        )

    async def run_batch(self, calls: Sequence[Call]) -> list[str]:
        self._calls = calls
        self._turn = 0
        result = await self._agent.run(_USER_PROMPT)
        if result.output != _FINAL_TEXT:
            raise AssertionError(f"unexpected final output {result.output!r}")
        outputs = {
            part.tool_call_id: part.content
            for message in result.new_messages()
            for part in message.parts
            if part.part_kind == "tool-return"
        }
        return [str(outputs[c.id]) for c in calls]


PeerClass = type[LangGraphPeer] | type[OpenAIAgentsPeer] | type[PydanticAIPeer]

PEERS: dict[str, PeerClass] = {peer.name: peer for peer in (LangGraphPeer, OpenAIAgentsPeer, PydanticAIPeer)}


def missing_reason(peer: PeerClass) -> str | None:
    """Why the peer cannot run here, or ``None`` when its modules import."""
    for module in peer.modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


def versions(distributions: Sequence[str]) -> dict[str, str]:
    """The installed version of each distribution, or "not installed"."""
    found: dict[str, str] = {}
    for dist in distributions:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found
