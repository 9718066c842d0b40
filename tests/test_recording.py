"""Recording sessions to JSONL and replaying them offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio

from dispatcher import Deny, Dispatcher, Status, Tool, ToolCall, replay

from ._fakes import Counter, call, fake_registry, openai_call


async def record_session(path: Path, counter: Counter, files: dict[str, str]) -> None:
    d = Dispatcher(fake_registry(counter, files))
    s = d.session("rec", record=path)
    await s.dispatch([call("1", "read", path="a"), call("2", "echo", text="x"), call("3", "nope")])
    await s.dispatch([call("4", "edit", path="a", text="v2"), call("5", "read", path="a")])
    await s.dispatch([call("6", "echo", text="x"), call("7", "boom")])
    s.new_run()
    await s.dispatch([call("8", "echo", text="x")])


async def test_a_recording_replays_without_running_any_tool(tmp_path: Path) -> None:
    """Replay serves every recorded result through the passes; no tool runs."""
    path = tmp_path / "s.jsonl"
    counter, files = Counter(), {"a": "v1"}
    await record_session(path, counter, files)
    ran_when_recording = len(counter.runs)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["type"] == "header" and len(lines) == 5
    replay_counter = Counter()
    report = await replay(path, Dispatcher(fake_registry(replay_counter, {})))
    assert report.ok and report.divergence is None and report.fingerprint_matches
    assert report.batches == 4 and report.calls == 8
    assert replay_counter.runs == [] and ran_when_recording == 6


async def test_replay_reports_the_first_divergence(tmp_path: Path) -> None:
    """A recording whose calls no longer decide the same way names the call, expected and got."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[3]["results"][0]["content"] = "something else"  # the deduped echo of batch 3
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.divergence is not None
    assert (report.divergence.batch, report.divergence.index, report.divergence.call_id) == (3, 0, "6")
    assert "something else" in report.divergence.expected


async def test_a_truncated_last_line_is_reported_and_the_rest_replays(tmp_path: Path) -> None:
    """A crash mid-write leaves a cut last line: replay says so and replays what came before."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    text = path.read_text()
    path.write_text(text[: len(text) - 40])
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.truncated and report.ok
    assert report.batches == 3 and report.calls == 7


async def test_gate_decisions_are_recorded_and_replayed(tmp_path: Path) -> None:
    """A denied call replays as denied, from the recorded decision, without asking anyone."""
    path = tmp_path / "s.jsonl"
    counter = Counter()
    reg = fake_registry(counter)
    from dispatcher import Tool

    reg.add(Tool("risky", "r", lambda a, c: "ran", confirm=True, deferred=False))
    d = Dispatcher(reg, gate=lambda c, ctx: Deny("not now"))
    with anyio.fail_after(10):
        [r] = await d.session("g", record=path).dispatch([ToolCall("1", "risky", {})])
    assert r.status is Status.denied

    def never_asked(c: Any, ctx: Any) -> Any:
        raise AssertionError("replay must not ask the live gate")

    report = await replay(path, Dispatcher(reg, gate=never_asked))
    assert report.ok, report.divergence


async def test_a_changed_registry_is_noticed(tmp_path: Path) -> None:
    """Replaying against other tools reports the fingerprint mismatch."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    reg = fake_registry(Counter(), {})
    reg.remove("boom")
    report = await replay(path, Dispatcher(reg))
    assert not report.fingerprint_matches
    assert report.divergence is not None and report.divergence.call_id == "7"


async def test_a_recording_that_cannot_be_written_stops_and_the_results_still_come_back(
    tmp_path: Path, caplog: Any
) -> None:
    """When the recording's folder goes away, the batch still returns its results, the failure
    is logged once, and what was written before still replays."""
    folder = tmp_path / "records"
    folder.mkdir()
    path = folder / "s.jsonl"
    counter = Counter()
    d = Dispatcher(fake_registry(counter, {}))
    s = d.session("rec", record=path)
    await s.dispatch([call("1", "echo", text="x")])
    kept = path.read_text()
    path.unlink()
    folder.rmdir()
    results = await s.dispatch([call("2", "echo", text="y"), call("3", "echo", text="z")])
    assert [r.content for r in results] == ["y", "z"]
    await s.dispatch([call("4", "echo", text="w")])
    assert s.recorder is not None and isinstance(s.recorder.problem, FileNotFoundError)
    assert [r.getMessage() for r in caplog.records].count(
        f"recording to {path} failed and stops here: {s.recorder.problem}"
    ) == 1
    assert not folder.exists()  # nothing was written after the failure
    folder.mkdir()
    path.write_text(kept)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.batches == 1


async def test_a_session_driven_by_invoke_replays_clean(tmp_path: Path) -> None:
    """invoke counts every tool as loaded; its recording says so, and replay decides the same."""
    path = tmp_path / "s.jsonl"

    async def hidden(args: Any, ctx: Any) -> str:
        return "found " + args["text"]

    def registry() -> Any:
        reg = fake_registry(Counter(), {})
        reg.add(
            Tool(
                "hidden",
                "A deferred tool.",
                hidden,
                {"type": "object", "properties": {"text": {"type": "string"}}},
            )
        )
        return reg

    d = Dispatcher(registry())
    s = d.session("rec", mode="deferred", record=path)
    result = await d.invoke("hidden", {"text": "hi"}, session=s)
    assert result.content == "found hi"
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.divergence is None and report.calls == 1


async def test_calls_json_cannot_hold_as_is_never_cost_the_batch(tmp_path: Path) -> None:
    """A lone surrogate in a call is recorded escaped and replays; arguments JSON cannot hold
    at all (a key that is not text) end the recording, and the batch still answers."""
    path = tmp_path / "s.jsonl"
    d = Dispatcher(fake_registry(Counter(), {}))
    s = d.session("rec", record=path)
    odd = await s.dispatch(
        [openai_call("1", "ec\ud800ho", {"text": "x"}), openai_call("2", "echo", '{"text": "\\ud800"}')]
    )
    assert [r.status for r in odd] == [Status.rejected, Status.invalid_arguments]
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 2
    [r] = await s.dispatch([ToolCall("3", "echo", {(1, 2): "x"})])  # type: ignore[dict-item]
    assert r.status is Status.invalid_arguments
    assert isinstance(s.recorder.problem, TypeError)  # type: ignore[union-attr]
    assert (await replay(path, Dispatcher(fake_registry(Counter(), {})))).calls == 2
