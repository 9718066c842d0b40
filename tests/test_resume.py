"""Exactly once across a resume: a batch cut short by tool code, a hook or a cancellation
keeps what finished; dispatched again in the same run, those calls are served, writers
included, and only the rest runs. `Answer` is any call's result."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from builtin_tools import default_registry
from dispatcher import (
    Allow,
    Answer,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    HookBlocked,
    Interrupt,
    Registry,
    Status,
    Tool,
    ToolCall,
)


def _counting_registry(count: list[int], asked: list[str]) -> Registry:
    def bump(args: Mapping[str, Any], ctx: Any) -> str:
        count[0] += 1
        return f"count is {count[0]}"

    async def ask(args: Mapping[str, Any], ctx: Any) -> str:
        asked.append(ctx.call_id)
        raise DispatchInterrupted([(ToolCall(ctx.call_id, "ask", dict(args)), "ask", {"q": args.get("q")})])

    async def later(args: Mapping[str, Any], ctx: Any) -> str:
        return "later ran"

    obj = {"type": "object", "properties": {"q": {"type": "string"}}}
    return Registry(
        [
            Tool("bump", "Bump the counter.", bump, obj, deferred=False, writes=lambda a: {"file:/count"}),
            Tool("ask", "Ask.", ask, obj, deferred=False),
            Tool("later", "Later.", later, obj, deferred=False),
            Tool(
                "gated", "Gated.", bump, obj, deferred=False, confirm=True, writes=lambda a: {"file:/count"}
            ),
        ]
    )


BATCH = [ToolCall("w", "bump", {}), ToolCall("q", "ask", {"q": "go?"}), ToolCall("l", "later", {})]


async def test_a_tool_interrupt_then_an_answer_runs_the_finished_writer_once() -> None:
    """[bump, ask, later]: the interrupt commits bump; resumed with Answer, bump is served
    (deduped, not run again), ask is answered, later runs: the counter moved once."""
    count, asked = [0], []
    s = Dispatcher(_counting_registry(count, asked)).session("s")
    with pytest.raises(DispatchInterrupted) as caught:
        await s.dispatch(BATCH)
    assert [c.id for c, _, _ in caught.value.pending] == ["q"] and count == [1]
    results = await s.dispatch(BATCH, decisions={"q": Answer("yes")})
    assert count == [1]
    assert [(r.call_id, r.status, r.content) for r in results] == [
        ("w", Status.ok, "count is 1"),
        ("q", Status.ok, "yes"),
        ("l", Status.ok, "later ran"),
    ]
    assert results[0].deduped and asked == ["q"]


async def test_resuming_twice_still_runs_each_writer_once() -> None:
    """A batch interrupted at two questions, answered one resume at a time: the writer and
    the first answer are served on the second resume; nothing runs twice."""
    count, asked = [0], []
    s = Dispatcher(_counting_registry(count, asked)).session("s")
    batch = [ToolCall("w", "bump", {}), ToolCall("q1", "ask", {"q": "a"}), ToolCall("q2", "ask", {"q": "b"})]
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(batch)
    with pytest.raises(DispatchInterrupted) as caught:
        await s.dispatch(batch, decisions={"q1": Answer("one")})
    assert [c.id for c, _, _ in caught.value.pending] == ["q2"] and count == [1]
    results = await s.dispatch(batch, decisions={"q2": Answer("two")})
    assert [r.content for r in results] == ["count is 1", "one", "two"] and count == [1]


async def test_a_gate_interrupt_then_approval_runs_the_gated_writer_exactly_once() -> None:
    """A gated writer interrupted by the gate, approved on resume, runs once; dispatching the
    same batch again with the same approval serves it instead of running it again."""
    count, asked = [0], []
    d = Dispatcher(_counting_registry(count, asked), gate=lambda call, ctx: Interrupt("approve?"))
    s = d.session("s")
    batch = [ToolCall("g", "gated", {}), ToolCall("q", "ask", {})]
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(batch)
    assert count == [0]
    with pytest.raises(DispatchInterrupted):  # now the tool interrupts, after the approved write
        await s.dispatch(batch, decisions={"g": Allow()})
    assert count == [1]
    results = await s.dispatch(batch, decisions={"g": Allow(), "q": Answer("ok")})
    assert count == [1] and results[0].deduped and results[1].content == "ok"


async def test_a_refusal_still_refuses_and_a_new_run_starts_afresh() -> None:
    """A Deny on resume refuses the call; after new_run the kept results are gone, and the
    same batch runs its writer again."""
    count, asked = [0], []
    s = Dispatcher(_counting_registry(count, asked)).session("s")
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(BATCH)
    results = await s.dispatch(BATCH, decisions={"q": Deny("not now")})
    assert results[1].status is Status.denied and count == [1]
    s.new_run()
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(BATCH)
    assert count == [2]


async def test_a_hook_block_keeps_what_finished_for_the_resume() -> None:
    """A hook that blocks the second call: the writer before it finished; dispatched again
    (the hook now lets it through), the writer is served, not run again."""
    count, asked = [0], []
    blocking = [True]

    class Guard:
        def before(self, call: ToolCall, ctx: Any) -> None:
            if call.name == "later" and blocking[0]:
                raise HookBlocked("not yet")

    s = Dispatcher(_counting_registry(count, asked), hooks=[Guard()]).session("s")
    batch = [ToolCall("w", "bump", {}), ToolCall("l", "later", {})]
    with pytest.raises(HookBlocked):
        await s.dispatch(batch)
    blocking[0] = False
    results = await s.dispatch(batch)
    assert count == [1] and results[0].deduped and results[1].content == "later ran"


async def test_a_cancelled_batch_keeps_its_finished_writer() -> None:
    """A batch cancelled while its second call runs: the writer that finished is served when
    the batch is dispatched again."""
    count = [0]
    started = anyio.Event()

    def bump(args: Mapping[str, Any], ctx: Any) -> str:
        count[0] += 1
        return "bumped"

    async def slow(args: Mapping[str, Any], ctx: Any) -> str:
        started.set()
        await anyio.sleep(3600 if not args.get("quick") else 0)
        return "slow done"

    obj = {"type": "object", "properties": {"quick": {"type": "boolean"}}}
    reg = Registry(
        [
            Tool("bump", "B.", bump, obj, deferred=False, writes=lambda a: {"file:/c"}),
            Tool("slow", "S.", slow, obj, deferred=False),
        ]
    )
    s = Dispatcher(reg).session("s")
    batch = [ToolCall("w", "bump", {}), ToolCall("s", "slow", {})]
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.dispatch, batch)
        await started.wait()
        tg.cancel_scope.cancel()
    assert count == [1]
    started = anyio.Event()
    results = await s.dispatch([batch[0], ToolCall("s", "slow", {"quick": True})])
    assert count == [1] and results[0].deduped and results[1].content == "slow done"


async def test_answer_works_for_any_call_and_is_recorded_for_replay(tmp_path: Path) -> None:
    """An Answer for a call nobody interrupted is its result all the same (nothing runs), and a
    recording of the answered batch replays."""
    from dispatcher import replay

    count, asked = [0], []
    rec = tmp_path / "s.jsonl"
    d = Dispatcher(_counting_registry(count, asked))
    s = d.session("s", record=rec)
    [r] = await s.dispatch([ToolCall("w", "bump", {})], decisions={"w": Answer({"done": True})})
    assert r.status is Status.ok and r.content == '{"done": true}' and count == [0]
    report = await replay(rec, Dispatcher(_counting_registry(count, asked)))
    assert report.ok, report


async def test_ask_user_of_the_builtins_resumes_with_an_answer(tmp_path: Path) -> None:
    """The builtin ask_user, with no one to ask, interrupts; an edit before it is not redone
    when the batch resumes with Answer: the file holds one edit."""
    (tmp_path / "n.txt").write_text("0\n")
    s = Dispatcher(default_registry(tmp_path)).session("s", mode="direct")
    edit = ToolCall("e", "edit_file", {"path": "n.txt", "old_string": "0", "new_string": "01"})
    batch = [edit, ToolCall("a", "ask_user", {"question": "Continue?"})]
    s.load_tools(["edit_file"])
    with pytest.raises(DispatchInterrupted):
        await s.dispatch(batch)
    results = await s.dispatch(batch, decisions={"a": Answer("yes")})
    assert (tmp_path / "n.txt").read_text() == "01\n"
    assert results[0].deduped and results[1].content == "yes"
