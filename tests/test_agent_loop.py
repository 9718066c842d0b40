"""examples/agent_loop.py, offline: each provider's loop, with the official SDK clients
pointed at the scripted model on loopback, and nothing else on the network."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ._network import guard_network

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "agent_loop.py"
ANSWER = "2 + 3 = 5, and the capital of France is Paris."
KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL")


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agent_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the SDKs' async clients are asyncio's
async def test_every_loop_answers_from_the_tool_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each provider's loop ends with the model's answer made from the tool results, on loopback only."""
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    guard = guard_network(monkeypatch)
    agent_loop = example()
    with agent_loop.ScriptedModel() as model:
        answers = await agent_loop.main(model)
    assert answers == {"chat": ANSWER, "anthropic": ANSWER, "responses": ANSWER}
    assert guard.connects and not guard.refused and not guard.lookups
    paths = [path for path, _ in model.requests]
    assert paths == ["/v1/chat/completions"] * 2 + ["/v1/messages"] * 2 + ["/v1/responses"] * 2
    anthropic_followup = model.requests[3][1]["messages"]
    assert [m["role"] for m in anthropic_followup] == ["user", "assistant", "user"]
    assert [b["tool_use_id"] for b in anthropic_followup[2]["content"]] == ["toolu_add", "toolu_cap"]
    strict = {t["name"]: t["strict"] for t in model.requests[4][1]["tools"]}
    assert strict == {"find_tools": False, "add": True, "capital": False}


def test_the_scripted_model_refuses_calls_left_unanswered() -> None:
    """The scripted model is a real check: a follow-up missing a tool_result is a 400."""
    agent_loop = example()
    model = agent_loop.ScriptedModel()
    tools: list[dict[str, Any]] = [{"name": "add"}, {"name": "capital"}]
    first = model.messages({"model": "m", "tools": tools, "messages": [{"role": "user", "content": "q"}]})
    followup = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_add", "content": "5"}]},
    ]
    with pytest.raises(ValueError, match="must each have a tool_result block"):
        model.messages({"model": "m", "tools": tools, "messages": followup})
    model._server.server_close()


def test_the_example_runs_as_a_script_offline() -> None:
    """`python examples/agent_loop.py` with no API key prints each loop's answer, on loopback only."""
    code = (
        "import json, runpy, pytest\n"
        "from tests._network import guard_network\n"
        "guard = guard_network(pytest.MonkeyPatch())\n"
        "runpy.run_path('examples/agent_loop.py', run_name='__main__')\n"
        "seen = {'refused': guard.refused, 'lookups': guard.lookups, 'connects': len(guard.connects)}\n"
        "print(json.dumps(seen))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    *lines, report = out.stdout.strip().splitlines()
    assert lines == [f"chat: {ANSWER}", f"anthropic: {ANSWER}", f"responses: {ANSWER}"]
    network = json.loads(report)
    assert network["refused"] == [] and network["lookups"] == [] and network["connects"] > 0
