"""LangGraph: threepass as a graph's tool node, and as deterministic tool steps.

- `tool_node(dispatcher)` stands where LangGraph's `ToolNode` would: it takes the last
  `AIMessage`'s tool calls, sends them through the three passes as one batch, and returns
  one `ToolMessage` per call, in call order (`status="error"` for every result that is not
  `ok`).
- `tool_step(dispatcher, name, ...)` is a step the graph takes, not the model: one call of
  one tool, with the step's fixed configuration and the previous step's output.

Sessions. Each LangGraph thread (`config["configurable"]["thread_id"]`) gets a threepass
session per graph node, `"{thread_id}/{node}"`, so dedupe, the session's cache scope,
spent approvals and the recording belong to one conversation, and branches that run side
by side never queue behind one another's batches. `session=fn(config) -> Session` chooses
otherwise (a recording file, a mode, one session for several nodes). A tool node starts a
new run (dedupe starts empty) when the conversation has a new human message; every step
of `tool_step` is a run of its own.

Approvals. A gate's `Interrupt` becomes LangGraph's `interrupt()`, with the value

    {"type": "threepass.approval", "session_id": "...",
     "pending": [{"call_id", "name", "args", "reason", "payload"}, ...]}

and the graph is resumed with `Command(resume=decisions)`, where `decisions` is one
decision for every pending call or a mapping of call id to decision; a decision is
`"allow"` (or `"approve"`, `True`), `"deny"` (or `"reject"`, `False`), `{"deny": reason}`
or `{"allow": new_args}`. These are plain values because the checkpointer stores the
resume value; a kernel decision object (`Allow()`, `Deny(reason)`) is passed through to
the kernel as it is, for a checkpointer whose serializer can store it.
The node runs again from its start on resume, as LangGraph nodes do; nothing of the batch
ran before the interrupt (every gate is answered before anything runs), so each approved
call runs exactly once. A pending call left without a decision is asked about again.

Both nodes are async (LangGraph runs them with `ainvoke`/`astream`): a Dispatcher belongs
to the event loop that first uses it.

Imports langgraph and langchain-core (the `threepass[langgraph]` extra); `import
dispatcher` never imports this module.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.types import interrupt

from ._dispatcher import Dispatcher
from ._exceptions import DispatchInterrupted
from ._session import Session
from ._types import Allow, Deny, ToolCall, ToolResult

__all__ = ["APPROVAL", "ToolStepFailed", "decisions_from", "tool_node", "tool_step"]

APPROVAL = "threepass.approval"
"""The `type` of the value a tool node or step passes to LangGraph's `interrupt()`."""

SessionFor = Callable[[RunnableConfig], Session]
Node = Callable[[Any, RunnableConfig], Awaitable[Any]]

_ALLOW = frozenset({"allow", "approve", "approved", "yes"})
_DENY = frozenset({"deny", "reject", "rejected", "no"})
_UNSEEN = object()


class ToolStepFailed(RuntimeError):
    """A `tool_step`'s call did not succeed; `result` is what it returned."""

    def __init__(self, result: ToolResult) -> None:
        first = result.content.split("\n", 1)[0]
        super().__init__(f"tool step {result.name!r} ended {result.status.value}: {first}")
        self.result = result


def _session_for(dispatcher: Dispatcher) -> SessionFor:
    def session(config: RunnableConfig) -> Session:
        thread = (config.get("configurable") or {}).get("thread_id")
        node = (config.get("metadata") or {}).get("langgraph_node")
        return dispatcher.session(f"{'-' if thread is None else thread}/{node or 'tools'}")

    return session


def tool_node(
    dispatcher: Dispatcher,
    *,
    messages_key: str = "messages",
    session: SessionFor | None = None,
) -> Node:
    """A node for a `StateGraph` that runs the tool calls of the last `AIMessage` in
    `state[messages_key]` and returns `{messages_key: [ToolMessage, ...]}` (a list, for
    a state that is a list of messages). Every tool counts as loaded: the graph's model
    was given the schemas (`bind_tools`). Calls LangChain could not parse
    (`invalid_tool_calls`) follow the others and come back `invalid_arguments`."""
    session_of = session or _session_for(dispatcher)
    turns: weakref.WeakKeyDictionary[Session, object] = weakref.WeakKeyDictionary()

    async def tools(state: Any, config: RunnableConfig) -> Any:
        messages = _messages(state, messages_key)
        ai = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
        calls = [] if ai is None else _calls_of(ai)
        if not calls:
            return [] if isinstance(state, list) else {messages_key: []}
        s = session_of(config)
        turn = _turn_of(messages)
        seen = turns.get(s, _UNSEEN)
        if seen is not _UNSEEN and seen != turn:
            s.new_run()
        turns[s] = turn
        results = await _approved(
            s, lambda decisions: s._dispatch(calls, decisions=decisions, all_loaded=True)
        )
        out = [_tool_message(r) for r in results]
        return out if isinstance(state, list) else {messages_key: out}

    return tools


def tool_step(
    dispatcher: Dispatcher,
    name: str,
    *,
    static: Mapping[str, Any] | None = None,
    input_key: str | None = "input",
    output_key: str | None = None,
    session: SessionFor | None = None,
) -> Node:
    """A deterministic graph step: one call of tool `name` through the three passes, with
    `static` (the step's fixed configuration) merged under the arguments and the state's
    `input_key` value (the previous step's output; parsed when it is a JSON string) as
    `args["input"]` (none when the key is absent or None). Returns `{output_key: content}`
    (`output_key` defaults to the tool's name). A call that does not succeed raises
    `ToolStepFailed` (LangGraph's retry policies apply), so no step reads a failure as
    its input. The node's name defaults to the tool's."""
    dispatcher.registry.get(name)  # an unknown tool fails when the graph is built
    session_of = session or _session_for(dispatcher)
    fixed = dict(static or {})
    key = output_key or name

    async def step(state: Any, config: RunnableConfig) -> dict[str, Any]:
        value = None if input_key is None else _read(state, input_key)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # not JSON: the text itself
                value = json.loads(value)
        s = session_of(config)
        s.new_run()  # a step never serves an earlier step's result from dedupe
        # the same id when the node runs again on resume, so the decision finds its call
        call_id = (config.get("metadata") or {}).get("langgraph_checkpoint_ns") or s.next_call_id()

        async def call(decisions: Mapping[str, Any] | None) -> list[ToolResult]:
            result = await dispatcher.invoke(
                name, None, session=s, call_id=call_id, decisions=decisions, static=fixed, input=value
            )
            return [result]

        (result,) = await _approved(s, call)
        if not result.ok:
            raise ToolStepFailed(result)
        return {key: result.content}

    step.__name__ = step.__qualname__ = name
    return step


async def _approved(
    session: Session, dispatch: Callable[[Mapping[str, Any] | None], Awaitable[list[ToolResult]]]
) -> list[ToolResult]:
    """`dispatch` until no gate interrupts: each interrupt goes to LangGraph's `interrupt()`,
    whose resume value (when the node runs again) adds to the decisions."""
    decisions: dict[str, Any] = {}
    problem: str | None = None  # what was wrong with the last resume value, asked again
    while True:
        try:
            return await dispatch(decisions or None)
        except DispatchInterrupted as exc:
            request = _approval_request(session, exc)
            if problem is not None:
                request["problem"] = problem
            answer = interrupt(request)
            try:
                decisions.update(decisions_from(answer, [call.id for call, _, _ in exc.pending]))
                problem = None
            except ValueError as bad:
                # LangGraph keeps a resume value for its interrupt: raising here would meet
                # the same value on every later resume, and the thread would never move on.
                # The same calls are asked about again, with what was wrong, instead.
                problem = str(bad)


def _approval_request(session: Session, exc: DispatchInterrupted) -> dict[str, Any]:
    return {
        "type": APPROVAL,
        "session_id": session.id,
        "pending": [
            {
                "call_id": call.id,
                "name": call.name,
                "args": _arguments(call),
                "reason": reason,
                "payload": payload,
            }
            for call, reason, payload in exc.pending
        ],
    }


def decisions_from(answer: Any, pending: Sequence[str]) -> dict[str, Any]:
    """The kernel's decisions for the pending call ids from a resume value (the module's
    docstring has its shapes): a mapping keyed by call id, or one decision for them all."""
    if isinstance(answer, Mapping) and not _is_decision_mapping(answer):
        unknown = [k for k in answer if k not in pending]
        if unknown:
            raise ValueError(
                f"resume names calls that are not pending: {unknown!r}; pending: {list(pending)!r}"
            )
        return {str(k): _decision(v) for k, v in answer.items()}
    decision = _decision(answer)
    return dict.fromkeys(pending, decision)


def _is_decision_mapping(value: Mapping[Any, Any]) -> bool:
    return len(value) == 1 and next(iter(value)) in ("allow", "deny")


def _decision(value: Any) -> Any:
    if value is True:
        return Allow()
    if value is False:
        return Deny("denied by the user")
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _ALLOW:
            return Allow()
        if word in _DENY:
            return Deny("denied by the user")
        raise ValueError(f"a decision is 'allow' or 'deny', got {value!r}")
    if isinstance(value, Mapping):
        if _is_decision_mapping(value):
            if "deny" in value:
                return Deny(str(value["deny"]))
            args = value["allow"]
            if args is None or isinstance(args, Mapping):
                return Allow(args)
        raise ValueError(f"a decision mapping is {{'deny': reason}} or {{'allow': args}}, got {value!r}")
    return value  # a kernel decision object (Allow, Deny, ...): the kernel judges it


def _tool_message(result: ToolResult) -> ToolMessage:
    return ToolMessage(
        content=result.content,
        tool_call_id=result.call_id,
        name=result.name,
        status="success" if result.ok else "error",
        response_metadata={
            "threepass": {"status": result.status.value, "cached": result.cached, "deduped": result.deduped}
        },
    )


def _calls_of(ai: AIMessage) -> list[Any]:
    """The calls of `ai` for the kernel: each tool call as a ToolCall, and one that is not a
    mapping (an edit, a broken model output) as it is, for pass 1 to answer as unreadable."""
    calls: list[Any] = [
        ToolCall(str(tc.get("id") or ""), str(tc.get("name") or ""), tc.get("args") or {})
        if isinstance(tc, Mapping)
        else tc
        for tc in ai.tool_calls
    ]
    for bad in ai.invalid_tool_calls:
        calls.append(ToolCall(str(bad.get("id") or ""), str(bad.get("name") or ""), bad.get("args") or ""))
    return calls


def _turn_of(messages: Sequence[BaseMessage]) -> object:
    """What names the current user turn: the last human message (its id, or its place)."""
    for place in range(len(messages) - 1, -1, -1):
        message = messages[place]
        if isinstance(message, HumanMessage):
            return message.id or place
    return None


def _messages(state: Any, key: str) -> list[BaseMessage]:
    if isinstance(state, list):
        return state
    found = _read(state, key)
    if not isinstance(found, list):
        raise ValueError(f"the state has no list of messages under {key!r}: {type(state).__name__}")
    return found


def _read(state: Any, key: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(key)
    return getattr(state, key, None)


def _arguments(call: ToolCall) -> Any:
    args = call.arguments
    return dict(args) if isinstance(args, Mapping) else args
