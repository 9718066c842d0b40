"""The benchmark harness (bench/harness.py) on its quick path, for the floor and threepass.

No peer framework is needed: the one peer here stands for a framework that is not
installed. Timing values are never asserted, only what each system did.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from bench.harness import Plan, collect, goals, render_table
from bench.peers import PydanticAIPeer
from bench.threepass_runner import ThreepassRunner
from bench.workloads import FloorRunner, Rounds, measure_overhead_interleaved
from threepass import cli


class FrameworkNotInstalled(PydanticAIPeer):
    """A peer adapter whose framework does not import here."""

    name = "absent"
    title = "Absent framework"
    modules = ("bench_no_such_framework",)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    plan = Plan(
        quick=True, peers=(FrameworkNotInstalled,), limits=(), memory=False, costs=False, floors=False
    )
    return collect(plan)


def _row(table: str, title: str) -> str:
    [row] = [line for line in table.splitlines() if line.startswith(f"| {title}")]
    return row


def test_threepass_runs_each_distinct_call_of_the_repetition_batch_once(report: dict[str, Any]) -> None:
    """threepass makes exactly 10 executions of the 20-call batch with 10 repeats, every round."""
    repetition = report["systems"]["threepass"]["repetition"]
    assert repetition["executions_seen"] == [10]
    assert repetition["outputs_correct"]


def test_the_floor_runs_every_repeat(report: dict[str, Any]) -> None:
    """The floor, which keeps no dedupe map, runs all 20 calls of the repetition batch."""
    assert report["systems"]["floor"]["repetition"]["executions_seen"] == [20]


def test_threepass_last_read_sees_the_edit(report: dict[str, Any]) -> None:
    """In read, read, edit, read, threepass's last read returns the edited text in every round."""
    mixed = report["systems"]["threepass"]["mixed"]
    for label in ("with_io", "no_io"):
        seen, total = mixed[label]["second_read_sees_edit"].split("/")
        assert seen == total != "0"
        assert mixed[label]["outputs"][3] == "new"


def test_the_table_has_a_row_per_system_with_ratios_to_threepass(report: dict[str, Any]) -> None:
    """The table has a row per system; the floor's figures carry ratios, threepass's do not."""
    table = render_table(report)
    floor, threepass = _row(table, "floor"), _row(table, "threepass (default limit")
    assert len(re.findall(r"\(\d+(\.\d+)?x\)", floor)) >= 3  # µs/call at batch 1, 10 and 100
    assert "x)" not in threepass
    assert "yes (" in threepass
    on_asyncio = _row(table, "threepass on asyncio")
    assert len(re.findall(r"\(\d+(\.\d+)?x\)", on_asyncio)) >= 3  # its ratios to threepass on trio
    # header, rule, floor, threepass, threepass on asyncio, the absent peer
    assert len(table.splitlines()) == 2 + 4


def test_a_peer_that_does_not_import_is_reported_not_installed(report: dict[str, Any]) -> None:
    """A peer whose framework does not import is a "not installed" row, not a crash."""
    entry = report["systems"]["absent"]
    assert entry["status"] == "not installed"
    assert "bench_no_such_framework" in entry["reason"]
    assert "| not installed |" in _row(render_table(report), "Absent framework")


def test_goals_say_what_was_met_and_what_was_not_measured(report: dict[str, Any]) -> None:
    """The repeats goal is met; the ToolNode and floor goals are not measured in this plan."""
    verdicts = {goal.label: goal.met for goal in goals(report)}

    def verdict(words: str) -> bool | None:
        [met] = [met for label, met in verdicts.items() if words in label]
        return met

    assert verdict("repeated executions") is True
    assert verdict("LangGraph ToolNode / threepass") is None
    assert verdict("threepass / floor") is None
    assert verdict("threepass on asyncio / on trio") in (True, False)  # measured in every plan


def test_threepass_bench_hands_its_arguments_to_the_harness(capsys: pytest.CaptureFixture[str]) -> None:
    """`threepass bench --help` is the harness's own help: the CLI passes everything on."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


class BrokenRunner(FloorRunner):
    """A system whose every batch fails, as a peer's changed API would."""

    name = "broken"

    async def run_batch(self, calls: Any) -> list[str]:
        raise RuntimeError("the framework changed its API")


def test_overhead_alternates_blocks_and_survives_a_failing_system() -> None:
    """Workload 1 runs each system in every block, merges the blocks, and reports a failure as an error."""
    found = measure_overhead_interleaved(
        {"floor": FloorRunner, "broken": BrokenRunner, "threepass": ThreepassRunner}, quick=True, blocks=2
    )
    rounds = Rounds.choose(True).overhead
    for name in ("floor", "threepass"):
        assert found[name]["blocks"] == 2
        for size, n in rounds.items():
            batch = found[name][f"batch_{size}"]
            assert batch["rounds"] == 2 * max(1, n // 2)
            assert batch["median_us_per_call"] > 0
    assert found["broken"] == {"error": "RuntimeError: the framework changed its API"}


def test_the_floors_section_measures_every_workload_and_says_each_goal() -> None:
    """bench/floors.py on its quick path: a row per workload and batch, a replay, a verdict per goal."""
    import trio

    from bench import floors

    figures = trio.run(floors.measure, True)
    table = floors.render(figures)
    for workload in ("echo", "realistic"):
        for size in (1, 10, 100):
            assert f"| {workload} | {size} |" in table
    assert figures["replay"]["calls"] > 0 and figures["replay"]["replay_calls_per_s"] > 0
    assert figures["replay"]["floor_s"] > 0 and "The replay floor" in table
    assert all(figures["per_request"][k] > 0 for k in ("make_us", "first_us", "kept_us"))
    assert "A dispatcher made per request" in table
    assert all(figures["recording"][size]["floor"] > 0 for size in ("1", "100"))
    assert "line floor" in table and "without its fstat and write" in table
    assert all(figures["recording"][size]["unwritten"] > 0 for size in ("1", "100"))
    verdicts = floors.goals(figures)
    assert len(verdicts) == 9 and all(goal.met in (True, False) for goal in verdicts)


def test_the_replay_floor_runs_the_passes_and_hands_back_the_results_made_beforehand() -> None:
    """The replay floor's runner, in a session's dispatch, hands pass 2 each call's result
    as made beforehand: the batch's results are those very objects, in call order, and
    no handler runs."""
    import trio

    from bench import floors
    from dispatcher import Dispatcher, Status, ToolResult
    from dispatcher._session import Session

    calls = floors.batch("echo", 3, 0)
    made = [ToolResult(c["id"], "echo", Status.ok, f"made {i}") for i, c in enumerate(calls)]

    async def dispatched() -> list[ToolResult]:
        session = Session(Dispatcher(floors._registry()), "floor", mode="direct", kept=False)
        runner = floors._HandedAtOnce(made)
        return await session._dispatch(list(calls), decisions=None, all_loaded=False, runner=runner)

    results = trio.run(dispatched)
    assert [id(r) for r in results] == [id(r) for r in made]
    assert [r.content for r in results] == ["made 0", "made 1", "made 2"]


def test_the_line_floor_writes_the_rows_line_a_recording_writes(tmp_path: Path) -> None:
    """The recording's floor in bench/floors.py writes, for a batch, the line a recorded
    session writes for it: the same record, field for field and in key order, but for
    each call's key (zeros) and where the line stands in its file."""
    import json

    import trio

    from bench import floors

    calls = floors.batch("echo", 3, 0)
    floor = floors.LineFloor(tmp_path / "floor.jsonl")
    recorded = floors.Threepass(record=tmp_path / "recorded.jsonl", session="recorded")

    async def both() -> None:
        await floor.run_batch(calls)
        await recorded.run_batch(calls)

    trio.run(both)
    floor.close()
    recorded.session.close()
    (ours,) = [json.loads(line) for line in (tmp_path / "floor.jsonl").read_text().splitlines()]
    theirs = json.loads((tmp_path / "recorded.jsonl").read_text().splitlines()[-1])
    assert list(ours) == list(theirs) and ours["type"] == "rows"
    for record in (ours, theirs):
        for row in record["rows"]:
            assert len(row[3]) == 32
            row[3] = row[11] = row[12] = None  # the key; when the call started and how long it took
        for field in ("seq", "prev", "run"):
            record[field] = None
    assert ours == theirs
