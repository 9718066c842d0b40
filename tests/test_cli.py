"""The command line: each command's plain output (golden files), the exit codes, --json,
ask_user, replay and inspect of the CLI's own recordings.

Golden files live in tests/golden/; `THREEPASS_UPDATE_GOLDEN=1 pytest tests/test_cli.py`
rewrites them. Durations, temporary folders and the demo site's port are normalised.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest

import threepass
from dispatcher._recording import _record as read_record
from threepass.cli import main, markdown_table

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "threepass" / "examples" / "transcript.jsonl"
WORKSPACE = ROOT / "threepass" / "examples" / "workspace"
GOLDEN = Path(__file__).resolve().parent / "golden"


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def normalise(text: str, *folders: Path) -> str:
    for folder in folders:
        text = text.replace(str(folder), "<tmp>")
    text = text.replace(str(ROOT), "<repo>")
    text = re.sub(r"/[^\s()]*?/threepass-(?:ws|demo|verify|replay)-[a-z0-9_]+", "<tmp>", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r" *\b\d+(?:\.\d+)?(?:ms|s)\b", " <t>", text)
    # the sandbox's state closes `tools`' output; a terminal's width may wrap it (the
    # reason bwrap is missing makes it long), so all of it is the state
    return re.sub(r"command sandbox: .*?(?=\n?\Z)", "command sandbox: <state>", text, flags=re.S)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("THREEPASS_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name} differs; THREEPASS_UPDATE_GOLDEN=1 rewrites it"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """One `threepass demo` run, recorded into a module folder."""
    folder = tmp_path_factory.mktemp("demo")
    rec = folder / "demo.jsonl"
    code, out, err = run_cli("demo", "--record", str(rec))
    assert err == ""
    return code, normalise(out, folder), rec


def test_demo_runs_every_pass_and_its_replay_matches(demo: tuple[int, str, Path]) -> None:
    """`threepass demo` exits 0, its output is the golden one, and it ends saying the replay matched."""
    code, out, _ = demo
    assert code == 0
    check_golden("demo.txt", out)
    assert out.splitlines()[-1] == "replay: 19 calls in 6 batches matched the recording, no tool run"


def test_demo_exercises_what_the_issue_lists(demo: tuple[int, str, Path]) -> None:
    """The demo shows every pass: schema fetch, dedupe, edit, cache, failure, scripted approval and answer."""
    _, out, _ = demo
    assert "6 tool(s) loaded" in out
    assert re.search(r"call_6\s+read_files\s+ok\s+deduped", out)
    assert re.search(r"call_11\s+read_files\s+ok\s+ran", out)  # after call_10's edit
    assert re.search(r"call_18\s+fetch_page\s+ok\s+cached", out)
    assert re.search(r"call_8\s+read_files\s+failed\s+ran", out)
    assert "-> approved by the demo's script" in out
    assert "-> answered 'yes' by the demo's script" in out


def test_run_plain_output_is_the_golden_one(tmp_path: Path) -> None:
    """`run` with no terminal prints the golden rows, footers, answer and summary, and exits 0."""
    code, out, err = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--answer", "yes", "--plain"
    )
    assert code == 0 and err == ""
    check_golden("run.txt", normalise(out, tmp_path))
    assert "answer: Yes: plums are still 1.15, as in the inventory." in out


def test_run_works_in_a_copy_and_says_where(tmp_path: Path) -> None:
    """The workspace copy is named on the first line and the original is untouched."""
    before = (WORKSPACE / "src" / "inventory.py").read_text()
    code, out, _ = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--answer", "yes"
    )
    first = out.splitlines()[0]
    copy = Path(first.split()[1])
    assert code == 0 and "a copy of" in first and copy.is_dir()
    assert '"plum": 1.15' in (copy / "src" / "inventory.py").read_text()
    assert (WORKSPACE / "src" / "inventory.py").read_text() == before
    shutil.rmtree(copy.parent)


def test_json_prints_only_json_lines_one_event_each(tmp_path: Path) -> None:
    """--json prints only JSON Lines: one result event per call, in order, and the summary last."""
    code, out, err = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--answer", "yes", "--json"
    )
    assert code == 0 and err == ""
    events = [json.loads(line) for line in out.splitlines()]
    assert all(isinstance(e, dict) and "event" in e for e in events)
    results = [e for e in events if e["event"] == "result"]
    ids = [c["id"] for e in events if e["event"] == "batch_started" for c in e["calls"]]
    assert [r["id"] for r in results] == ids and len(ids) == 19
    by_id = {r["id"]: r for r in results}
    assert by_id["call_6"]["served_by"] == "deduped" and by_id["call_16"]["status"] == "denied"
    assert events[-1]["event"] == "summary" and events[-1]["calls"] == 19
    assert [e["event"] for e in events].count("batch_ended") == 6


def test_ask_user_takes_the_answers_given_in_order(tmp_path: Path) -> None:
    """--answer is ask_user's result; with none and no terminal, the call fails saying how."""
    code, out, _ = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--json", "--answer", "not now"
    )
    asked = next(
        json.loads(line) for line in out.splitlines() if '"id": "toolu_15"' in line and "result" in line
    )
    assert code == 0 and asked["content"] == "not now" and asked["status"] == "ok"
    code, out, _ = run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--json")
    asked = next(
        json.loads(line) for line in out.splitlines() if '"id": "toolu_15"' in line and "result" in line
    )
    assert code == 0 and asked["status"] == "failed" and "--answer" in asked["content"]


def test_the_summary_counts_each_call_once(tmp_path: Path) -> None:
    """The summary's counts add up to the calls of the transcript (ask_user included)."""
    code, out, _ = run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--answer", "y")
    assert code == 0
    summary = next(line for line in out.splitlines() if " calls in " in line)
    counts = [int(n) for n in re.findall(r"(\d+) (?:ran|deduped|cached|denied|decided)", summary)]
    assert summary.startswith("19 calls in 6 batches") and sum(counts) == 19


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 completed, 1 bad input (stderr only), 2 usage, 1 under --strict on a refusal; --version 0."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code, out, err = run_cli("run", str(bad), "--workspace", str(WORKSPACE))
    assert (code, out) == (1, "") and "bad.jsonl:1: not a JSON message" in err
    code, out, err = run_cli("run", str(tmp_path / "none.jsonl"), "--workspace", str(WORKSPACE))
    assert (code, out) == (1, "") and "none.jsonl" in err
    assert main(["run", "--no-such-flag", "x"]) == 2
    assert "usage: threepass" in capsys.readouterr().err
    code, _, err = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--answer", "y", "--strict"
    )
    assert code == 1 and "--strict" in err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"threepass {threepass.__version__}\n"


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    """`threepass --help` and `threepass run --help` list the exit codes."""
    for argv in (["--help"], ["run", "--help"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "130  interrupted" in text and "2    usage" in text


def test_a_recording_that_cannot_be_written_exits_1(tmp_path: Path) -> None:
    """A recording that cannot be written: every batch still runs, stderr says why, exit 1."""
    rec = tmp_path / "no-such-folder" / "session.jsonl"
    code, out, err = run_cli(
        "run",
        str(EXAMPLE),
        "--workspace",
        str(WORKSPACE),
        "--record",
        str(rec),
        "--no-cache",
        "--answer",
        "y",
    )
    assert code == 1 and "19 calls in 6 batches" in out and "recorded to" not in out
    assert f"recording to {rec} stopped early:" in err and "No such file or directory" in err


def test_run_recording_replays_and_inspects(tmp_path: Path) -> None:
    """The CLI's own recording replays clean, and inspect shows its batches from 1 (golden)."""
    rec = tmp_path / "session.jsonl"
    code, _, _ = run_cli(
        "run",
        str(EXAMPLE),
        "--workspace",
        str(WORKSPACE),
        "--record",
        str(rec),
        "--no-cache",
        "--answer",
        "yes",
    )
    assert code == 0
    code, out, _ = run_cli("replay", str(rec))
    assert code == 0 and out.splitlines()[-2:] == [
        "replayed 19 calls in 6 batches without running any tool",
        "no divergence",
    ]
    check_golden("replay.txt", out)
    code, out, _ = run_cli("inspect", str(rec))
    assert code == 0
    check_golden("inspect.txt", normalise(out, tmp_path))
    code, out, _ = run_cli("inspect", str(rec), "--batch", "2")
    assert code == 0
    check_golden("inspect-batch-2.txt", normalise(out, tmp_path))
    code, _, err = run_cli("inspect", str(rec), "--batch", "7")
    assert code == 1 and "batches 1 to 6" in err


def test_replay_diff_shows_the_divergence(tmp_path: Path) -> None:
    """An edited decision in the last record diverges (exit 1) and --diff shows it as - and + lines."""
    rec = tmp_path / "session.jsonl"
    run_cli(
        "run",
        str(EXAMPLE),
        "--workspace",
        str(WORKSPACE),
        "--record",
        str(rec),
        "--no-cache",
        "--answer",
        "y",
    )
    lines = rec.read_text().splitlines()
    last = read_record(lines[-1].encode())  # a rows record as the batch record it stands for
    last["plan"][1]["how"] = "denied"
    rec.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    code, out, _ = run_cli("replay", str(rec), "--diff")
    assert code == 1 and "divergence: batch 6 (line 7), call 1 (call_19): how differs" in out
    assert "- denied" in out.splitlines() and "+ ran" in out.splitlines()


def test_replay_of_a_tampered_recording_names_the_line(tmp_path: Path) -> None:
    """A result edited in the middle breaks the hash chain at its line: exit 1, no traceback."""
    rec = tmp_path / "session.jsonl"
    run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--record", str(rec), "--no-cache")
    lines = rec.read_text().splitlines()
    tampered = read_record(lines[2].encode())
    tampered["results"][1]["content"] = "tampered"
    lines[2] = json.dumps(tampered)  # that line alone rewritten; the others keep their bytes
    rec.write_text("".join(line + "\n" for line in lines))
    code, out, err = run_cli("replay", str(rec))
    assert code == 1 and err == ""
    assert "problem: line 3: edited (its hash does not match the next record's prev)\n" in out


def test_replay_verify_runs_the_tools_again(tmp_path: Path) -> None:
    """--verify reruns the recorded calls: the example matches, a changed file diverges with its diff."""
    rec = tmp_path / "session.jsonl"
    run_cli(
        "run",
        str(EXAMPLE),
        "--workspace",
        str(WORKSPACE),
        "--record",
        str(rec),
        "--no-cache",
        "--answer",
        "y",
    )
    code, out, _ = run_cli("replay", str(rec), "--verify", "--workspace", str(WORKSPACE), "--plain")
    assert code == 0, out
    assert out.splitlines()[-1] == "verified: 19 calls ran again and answered as recorded"
    changed = tmp_path / "ws"
    shutil.copytree(WORKSPACE, changed)
    (changed / "data" / "prices.csv").write_text("item,price\napple,0.55\npear,0.75\n")
    code, out, _ = run_cli("replay", str(rec), "--verify", "--workspace", str(changed), "--plain")
    assert code == 1 and "differs: batch 2, call 2 (call_5, read_files): content" in out
    assert any(line.startswith("-") and "0.50" in line for line in out.splitlines())


def test_tools_lists_every_tool_and_json_is_a_list(tmp_path: Path) -> None:
    """`tools` lists every tool with its rules (golden); --json is a list of objects with the rule fields."""
    code, out, _ = run_cli("tools", "--workspace", str(tmp_path))
    assert code == 0
    check_golden("tools.txt", normalise(out, tmp_path))
    code, out, _ = run_cli("tools", "--json", "--workspace", str(tmp_path))
    rows = json.loads(out)
    assert isinstance(rows, list) and [r["name"] for r in rows[:2]] == ["find_tools", "run_tool"]
    assert all({"name", "concurrent", "confirm", "deferred", "cache"} <= set(r) for r in rows)
    by_name = {r["name"]: r for r in rows}
    assert by_name["http_request"]["confirm"] == "unless the method is GET, HEAD or OPTIONS"
    assert by_name["edit_file"]["concurrent"] is False and by_name["read_files"]["concurrent"] is True
    assert by_name["fetch_page"]["cache"] == {"ttl": 1800.0, "scope": "shared"}
    assert {"active", "program", "reason"} <= set(by_name["run_command"]["sandbox"])


def test_cache_stats_and_clear(tmp_path: Path) -> None:
    """`cache stats` counts entries of the folder; `cache clear` empties it."""
    from cache import DiskResultCache

    store = DiskResultCache(tmp_path / "c")
    store.set_sync("k", "v", ttl=60)
    code, out, _ = run_cli("cache", "stats", "--dir", str(tmp_path / "c"))
    assert code == 0 and "1 entries" in out
    code, _, _ = run_cli("cache", "clear", "--dir", str(tmp_path / "c"))
    assert code == 0 and DiskResultCache(tmp_path / "c").statistics_sync().entries == 0


def test_the_bench_table_fits_the_terminal() -> None:
    """A 250-column Markdown table fits 80 columns, a column per system and a row per figure."""
    from rich.console import Console

    header = "| system | " + " | ".join(f"a long column header number {i}" for i in range(9)) + " |"
    rows = [
        f"| {name} | " + " | ".join("12.3 (1.0x)" for _ in range(9)) + " |" for name in ("threepass", "floor")
    ]
    lines = [header, "|" + "---|" * 10, *rows]
    assert len(header) > 250
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(markdown_table(lines))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "threepass" in text.splitlines()[1] and "floor" in text.splitlines()[1]
    assert sum("a long column header number" in line for line in text.splitlines()) == 9


def test_the_timeline_page_holds_every_call_in_pass_order(tmp_path: Path) -> None:
    """The timeline page is self-contained and holds every call once, in call order, inside its pass."""
    page = tmp_path / "timeline.html"
    code, out, _ = run_cli("demo", "--timeline", str(page), "--record", str(tmp_path / "r.jsonl"))
    assert code == 0 and f"timeline: {page}" in out
    html = page.read_text(encoding="utf-8")
    assert 'src="http' not in html and "Plotly.newPlot" in html and len(html) > 1_000_000
    found = re.search(r'<script type="application/json" id="threepass-timeline">(.*?)</script>', html, re.S)
    assert found is not None
    batches = json.loads(found.group(1).replace("<\\/", "</"))
    from threepass._runner import tool_calls_of

    transcript = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    calls = [tool_calls_of(m) for m in transcript if m["role"] == "assistant"]
    expected = [[c["id"] for c in batch] for batch in calls if batch]
    assert [[bar["id"] for bar in b["bars"]] for b in batches] == expected
    slack = 1.0  # ms: wall-clock starts against monotonic pass timings
    for b in batches:
        assert b["limit"] >= 3
        for bar in b["bars"]:
            if bar["served"] == "ran":
                assert bar["phase"] == "pass 2"
                assert b["pass1"] - slack <= bar["start"]
                assert bar["start"] + bar["width"] <= b["pass1"] + b["pass2"] + slack
            else:
                assert bar["phase"] == "pass 1" and bar["start"] == 0 and bar["width"] == b["pass1"]
        ran = [bar["id"] for bar in b["bars"] if bar["served"] == "ran"]
        assert [i for g in b["groups"] for i in g["calls"]] == ran
    third = {g["calls"][0]: g["calls"] for g in batches[2]["groups"]}
    assert third == {"call_10": ["call_10"], "call_11": ["call_11"], "call_12": ["call_12"]}
