"""An agent loop for each provider, with the official SDKs: the model's reply goes to
threepass as it is, the tool messages threepass makes go back, until the model answers.

    pip install threepass openai anthropic
    python examples/agent_loop.py

With no API key this runs offline: the SDK clients are pointed (`base_url`) at a
scripted model this file serves on 127.0.0.1, which speaks the Chat Completions,
Messages and Responses wire formats and refuses a request the real API would refuse.
With `OPENAI_API_KEY` (Chat Completions and Responses) or `ANTHROPIC_API_KEY` set,
that provider's loop talks to the real API (`OPENAI_MODEL`, `ANTHROPIC_MODEL` choose
the model).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from dispatcher import Dispatcher, Registry, Session, Tool

QUESTION = "What is 2 + 3, and what is the capital of France?"


def add(args: Mapping[str, Any], ctx: Any) -> str:
    return str(args["a"] + args["b"])


def capital(args: Mapping[str, Any], ctx: Any) -> str:
    return {"france": "Paris", "japan": "Tokyo"}.get(args["country"].lower(), "not in my atlas")


def number(description: str) -> dict[str, str]:
    return {"type": "number", "description": description}


registry = Registry(
    [
        Tool(name="add", description="Add two numbers.", handler=add, deferred=False, concurrent=True,
             parameters={"type": "object", "properties": {"a": number("a number"), "b": number("another")},
                         "required": ["a", "b"], "additionalProperties": False}, strict=True),
        Tool(name="capital", description="The capital city of a country.", handler=capital,
             deferred=False, concurrent=True,
             parameters={"type": "object", "properties": {"country": {"type": "string"}},
                         "required": ["country"]}),
    ]
)  # fmt: skip


# -- the loops: one per provider -----------------------------------------------------------


async def chat_loop(client: AsyncOpenAI, model: str, session: Session) -> str:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        completion = await client.chat.completions.create(
            model=model, messages=messages, tools=session.request_tools("openai")
        )
        message = completion.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        results = await session.dispatch(message)  # the SDK's message, as it came
        messages += session.tool_messages(results, "openai")


async def anthropic_loop(client: AsyncAnthropic, model: str, session: Session) -> str:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        reply = await client.messages.create(
            model=model, max_tokens=1024, messages=messages, tools=session.request_tools("anthropic")
        )
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            return "".join(block.text for block in reply.content if block.type == "text")
        results = await session.dispatch(reply)  # its text and thinking blocks are skipped
        messages += session.tool_messages(results, "anthropic")  # ONE user message


async def responses_loop(client: AsyncOpenAI, model: str, session: Session) -> str:
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        response = await client.responses.create(
            model=model, input=items, tools=session.request_tools("responses")
        )
        items += response.output
        if not any(item.type == "function_call" for item in response.output):
            return response.output_text
        results = await session.dispatch(response)  # its reasoning and messages are skipped
        items += session.tool_messages(results, "responses")


# -- the scripted model ------------------------------------------------------------------


class ScriptedModel:
    """A model on 127.0.0.1 that asks for `add` and `capital`, then answers from their
    results. It checks what a real API checks: every call answered, in the shape asked."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> ScriptedModel:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append((self.path, body))
                routes = {"/v1/chat/completions": model.chat, "/v1/messages": model.messages,
                          "/v1/responses": model.responses}  # fmt: skip
                try:
                    status, reply = 200, routes[self.path](body)
                except (KeyError, ValueError) as exc:
                    status, reply = 400, {"type": "error", "error": {"type": "invalid_request_error",
                                                                    "message": str(exc)}}  # fmt: skip
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    @staticmethod
    def answer(results: Mapping[str, str]) -> str:
        return f"2 + 3 = {results['add']}, and the capital of France is {results['capital']}."

    @staticmethod
    def tool_names(tools: list[dict[str, Any]]) -> set[str]:
        return {t["function"]["name"] if "function" in t else t["name"] for t in tools}

    def check_tools(self, body: dict[str, Any]) -> None:
        if not {"add", "capital"} <= self.tool_names(body.get("tools", [])):
            raise ValueError("the request offers no add and capital tools")

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.check_tools(body)
        messages = body["messages"]
        asked = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
        if not asked:
            calls = [{"id": "call_add", "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                     {"id": "call_cap", "type": "function",
                      "function": {"name": "capital", "arguments": '{"country": "France"}'}}]  # fmt: skip
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls"
        else:
            after = messages[messages.index(asked[-1]) + 1 :]
            answers = {m["tool_call_id"]: m["content"] for m in after if m["role"] == "tool"}
            names = {c["id"]: c["function"]["name"] for c in asked[-1]["tool_calls"]}
            if set(answers) != set(names):
                raise ValueError(f"tool calls {sorted(names)} were answered by {sorted(answers)}")
            message = {"role": "assistant", "content": self.answer({names[i]: a for i, a in answers.items()})}
            finish = "stop"
        return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}  # fmt: skip

    def messages(self, body: dict[str, Any]) -> dict[str, Any]:
        self.check_tools(body)
        messages = body["messages"]
        if len(messages) == 1:
            content = [{"type": "text", "text": "Let me look both up."},
                       {"type": "tool_use", "id": "toolu_add", "name": "add", "input": {"a": 2, "b": 3}},
                       {"type": "tool_use", "id": "toolu_cap", "name": "capital",
                        "input": {"country": "France"}}]  # fmt: skip
            stop = "tool_use"
        else:
            asked = {b["id"]: b["name"] for b in messages[-2]["content"] if b["type"] == "tool_use"}
            last = messages[-1]
            blocks = last["content"] if last["role"] == "user" and isinstance(last["content"], list) else []
            answers = {b["tool_use_id"]: b["content"] for b in blocks if b["type"] == "tool_result"}
            if len(messages) != 3 or set(answers) != set(asked):
                raise ValueError(
                    f"tool_use ids {sorted(asked)} must each have a tool_result block in the one user "
                    f"message right after them; found {sorted(answers)} in {len(messages) - 2} message(s)"
                )
            content = [{"type": "text", "text": self.answer({asked[i]: a for i, a in answers.items()})}]
            stop = "end_turn"
        return {"id": "msg_scripted", "type": "message", "role": "assistant", "model": body["model"],
                "content": content, "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip

    def responses(self, body: dict[str, Any]) -> dict[str, Any]:
        self.check_tools(body)
        if any("strict" not in t for t in body["tools"]):
            raise ValueError("every function tool says whether it is strict")
        items = body["input"]
        calls = {i["call_id"]: i["name"] for i in items if i.get("type") == "function_call"}
        if not calls:
            output: list[dict[str, Any]] = [
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "id": "fc_add", "call_id": "call_add", "name": "add",
                 "arguments": '{"a": 2, "b": 3}', "status": "completed"},
                {"type": "function_call", "id": "fc_cap", "call_id": "call_cap", "name": "capital",
                 "arguments": '{"country": "France"}', "status": "completed"},
            ]  # fmt: skip
        else:
            answers = {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}
            if set(answers) != set(calls):
                raise ValueError(f"function calls {sorted(calls)} were answered by {sorted(answers)}")
            text = self.answer({calls[i]: a for i, a in answers.items()})
            output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]}]  # fmt: skip
        return {"id": "resp_scripted", "object": "response", "created_at": 0, "model": body["model"],
                "status": "completed", "output": output, "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": body["tools"]}  # fmt: skip


# -- main --------------------------------------------------------------------------------


async def main(scripted: ScriptedModel | None = None) -> dict[str, str]:
    """Run each provider's loop once; the answers by loop. A provider whose API key is
    not set (every provider, given `scripted`) talks to the scripted model."""
    real_openai = scripted is None and bool(os.environ.get("OPENAI_API_KEY"))
    real_anthropic = scripted is None and bool(os.environ.get("ANTHROPIC_API_KEY"))
    if scripted is None and not (real_openai and real_anthropic):
        with ScriptedModel() as model:
            return await run(model.url, real_openai, real_anthropic)
    return await run(scripted.url if scripted is not None else "", real_openai, real_anthropic)


async def run(url: str, real_openai: bool, real_anthropic: bool) -> dict[str, str]:
    oa = AsyncOpenAI() if real_openai else AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    an = AsyncAnthropic() if real_anthropic else AsyncAnthropic(base_url=url, api_key="-", max_retries=0)
    openai_model = os.environ.get("OPENAI_MODEL", "gpt-4.1-mini") if real_openai else "scripted"
    anthropic_model = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5") if real_anthropic else "scripted"
    d = Dispatcher(registry)
    async with oa, an:
        return {
            "chat": await chat_loop(oa, openai_model, d.session("chat", mode="direct")),
            "anthropic": await anthropic_loop(an, anthropic_model, d.session("anthropic", mode="direct")),
            "responses": await responses_loop(oa, openai_model, d.session("responses", mode="direct")),
        }


if __name__ == "__main__":
    for loop, answer in asyncio.run(main()).items():
        print(f"{loop}: {answer}")
