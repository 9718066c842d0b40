"""The command line: run the shipped example, replay its recording, manage the cache."""

from __future__ import annotations

import io
import json
from pathlib import Path

from threepass.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "threepass" / "examples" / "transcript.jsonl"
WORKSPACE = ROOT / "threepass" / "examples" / "workspace"


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_run_then_replay_the_shipped_example(tmp_path: Path) -> None:
    """The main job runs the example in a copy of the workspace, records it, and replays clean."""
    before = (WORKSPACE / "src" / "inventory.py").read_text()
    rec = tmp_path / "session.jsonl"
    code, text = run_cli(
        "run",
        str(EXAMPLE),
        "--workspace",
        str(WORKSPACE),
        "--record",
        str(rec),
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert code == 0, text
    assert "call_7     read_files     ok                [deduped]" in text
    assert "3 * 0.75 + 2 * 1.2 = 4.65" in text
    assert "call_18c   run_command    denied" in text  # no terminal: the CLI refuses
    assert "Tool not found: calcualte" in text
    assert (WORKSPACE / "src" / "inventory.py").read_text() == before  # the copy was edited
    code, text = run_cli("replay", str(rec))
    assert code == 0, text
    assert "no divergence" in text and "replayed 24 calls in 6 batches" in text


def test_replay_of_a_tampered_recording_fails(tmp_path: Path) -> None:
    """A tampered result is named by its line (the hash chain breaks there); exit 1."""
    rec = tmp_path / "session.jsonl"
    run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--record", str(rec), "--no-cache")
    lines = rec.read_text().splitlines()
    tampered = json.loads(lines[2])
    tampered["results"][1]["content"] = "tampered"
    lines[2] = json.dumps(tampered)  # that line alone rewritten; the others keep their bytes
    rec.write_text("".join(line + "\n" for line in lines))
    code, text = run_cli("replay", str(rec))
    assert code == 1
    assert "problem: line 3: edited (its hash does not match the next record's prev)\n" in text
    assert "replayed 3 calls in 1 batches" in text and "no divergence" not in text


def test_yes_allows_confirmations(tmp_path: Path) -> None:
    """--yes lets a call that needs confirmation run."""
    code, text = run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--no-cache", "--yes")
    assert code == 0 and "call_18c   run_command    ok" in text


def test_cache_stats_and_clear(tmp_path: Path) -> None:
    """`cache stats` counts entries of the folder; `cache clear` empties it."""
    from cache import DiskResultCache

    store = DiskResultCache(tmp_path / "c")
    store.set_sync("k", "v", ttl=60)
    code, text = run_cli("cache", "stats", "--dir", str(tmp_path / "c"))
    assert code == 0 and "1 entries" in text
    code, text = run_cli("cache", "clear", "--dir", str(tmp_path / "c"))
    assert code == 0 and DiskResultCache(tmp_path / "c").statistics_sync().entries == 0


def test_a_missing_transcript_is_a_clear_error(tmp_path: Path) -> None:
    """A transcript that does not exist exits 2 with its path in the message."""
    code, text = run_cli("run", str(tmp_path / "none.jsonl"), "--workspace", str(WORKSPACE))
    assert code == 2 and "none.jsonl" in text


def test_replay_works_when_the_recorded_workspace_is_gone(tmp_path: Path) -> None:
    """Replay runs no tool, so a recording whose workspace copy was deleted still replays."""
    import shutil

    rec = tmp_path / "session.jsonl"
    run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--record", str(rec), "--no-cache")
    header = json.loads(rec.read_text().splitlines()[0])
    shutil.rmtree(Path(header["meta"]["workspace"]).parent)
    code, text = run_cli("replay", str(rec))
    assert code == 0 and "no divergence" in text


def test_recording_twice_to_one_file_replaces_it(tmp_path: Path) -> None:
    """Running the main job twice with one --record file leaves one clean recording."""
    rec = tmp_path / "session.jsonl"
    for _ in range(2):
        run_cli("run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--record", str(rec), "--no-cache")
    assert sum(1 for line in rec.read_text().splitlines() if '"type": "header"' in line) == 1
    code, text = run_cli("replay", str(rec))
    assert code == 0 and "replayed 24 calls in 6 batches" in text


def test_run_says_when_its_recording_could_not_be_written(tmp_path: Path) -> None:
    """--record into a folder that does not exist: every batch still runs, the command says the
    recording stopped and exits 1."""
    rec = tmp_path / "no-such-folder" / "session.jsonl"
    code, text = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--record", str(rec), "--no-cache"
    )
    assert code == 1
    assert "24 calls in 6 batches" in text
    assert f"recording to {rec} stopped early:" in text and "No such file or directory" in text
    assert "recorded to" not in text


def test_tools_lists_every_tool_with_its_confirm_rule_and_the_sandbox(tmp_path: Path) -> None:
    """`threepass tools` lists the core two and every builtin, each confirm rule (a predicate
    by its rule), and whether the command sandbox is active; --json is one document."""
    code, text = run_cli("tools", "--workspace", str(tmp_path))
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("find_tools") and lines[1].startswith("run_tool")
    run_command = next(line for line in lines if line.startswith("run_command"))
    assert "confirm=unless the command is read-only" in run_command
    assert lines[-1].startswith("command sandbox: ")
    code, text = run_cli("tools", "--json", "--workspace", str(tmp_path))
    data = json.loads(text)
    by_name = {t["name"]: t for t in data["tools"]}
    assert by_name["http_request"]["confirm"] == "unless the method is GET, HEAD or OPTIONS"
    assert by_name["edit_file"]["concurrent"] is False and by_name["read_files"]["concurrent"] is True
    assert by_name["fetch_page"]["cache"] == {"ttl": 1800.0, "scope": "shared"}
    assert {"active", "program", "reason"} <= set(data["command_sandbox"])


def _example_recording(folder: Path) -> list[str]:
    rec = folder / "example.jsonl"
    code, text = run_cli(
        "run", str(EXAMPLE), "--workspace", str(WORKSPACE), "--record", str(rec), "--no-cache"
    )
    assert code == 0, text
    return rec.read_text().splitlines()


def _without_results(line: str) -> str:
    record = json.loads(line)
    del record["results"]
    return json.dumps(record)


def test_replay_names_the_line_of_every_kind_of_tampering(tmp_path: Path) -> None:
    """Deleted, moved, duplicated, emptied and incomplete records each exit 1 with one
    `problem: line N: ...` line, no traceback, and the records before them replayed."""
    lines = _example_recording(tmp_path)
    assert len(lines) == 7
    cases = {
        "deleted": (lines[:3] + lines[4:], "line 4: record seq 4 follows seq 2 (a record is missing)"),
        "moved": (
            [*lines[:3], lines[4], lines[3], *lines[5:]],
            "line 4: record seq 4 follows seq 2 (out of order: seq 3 is on line 5)",
        ),
        "duplicated": (lines[:4] + lines[3:], "line 5: a duplicate of line 4 (record seq 3)"),
        "emptied": ([*lines[:3], "{}", *lines[4:]], "line 4: a record without 'type'"),
        "incomplete": (
            [*lines[:3], _without_results(lines[3]), *lines[4:]],
            "line 4: the batch record has no 'results'",
        ),
    }
    for name, (tampered, problem) in cases.items():
        rec = tmp_path / f"{name}.jsonl"
        rec.write_text("".join(line + "\n" for line in tampered))
        code, text = run_cli("replay", str(rec))
        assert code == 1, (name, text)
        assert [line for line in text.splitlines() if line.startswith("problem: ")] == [f"problem: {problem}"]
        assert "Traceback" not in text and "no divergence" not in text
        assert f"in {3 if name == 'duplicated' else 2} batches" in text, (name, text)
