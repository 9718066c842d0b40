"""Ctrl-C, as a person presses it: SIGINT sent to a real `threepass run` at the [y/N]
prompt and while a tool runs. The run ends as a cancellation (exit 130, quickly, one line
saying so) and its recording still replays."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from threepass.cli import main

ROOT = Path(__file__).resolve().parent.parent
WORKSPACE = ROOT / "threepass" / "examples" / "workspace"


def _call(call_id: str, name: str, args: dict[str, object]) -> dict[str, object]:
    inner = {"name": name, "args": args}
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "run_tool", "arguments": json.dumps(inner)},
    }


def _transcript(folder: Path) -> Path:
    """A batch of reads, then one whose middle call runs for 30 s (and needs confirmation)."""
    load = {"id": "c1", "type": "function", "function": {"name": "find_tools", "arguments": json.dumps(
        {"query": "select:run_command,read_files"})}}  # fmt: skip
    messages = [
        {"role": "user", "content": "wait"},
        {"role": "assistant", "content": None, "tool_calls": [load]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("c2", "read_files", {"paths": ["README.md"]}),
                _call("c3", "run_command", {"command": "sleep 30"}),
                _call("c4", "read_files", {"paths": ["data/prices.csv"]}),
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("c5", "read_files", {"paths": ["README.md"]})],
        },
    ]
    path = folder / "slow.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in messages))
    return path


def _wait_for(fd: int, needle: bytes, timeout: float) -> bytes:
    """Read `fd` until `needle` shows up; everything read so far."""
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {needle!r}; got {seen[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"the stream ended before {needle!r}; got {seen[-2000:]!r}"
            seen += chunk
    return seen


def _interrupt(tmp_path: Path, *extra: str, wait_on: str, needle: bytes) -> tuple[int, float, str, Path]:
    """Start a run with a terminal as stdin, send SIGINT once `needle` appears on
    `wait_on` ("stdout" or "stderr"); (exit code, seconds from SIGINT to exit, stdout, recording)."""
    rec = tmp_path / "cut.jsonl"
    primary, secondary = os.openpty()
    argv = [sys.executable, "-m", "threepass", "run", str(_transcript(tmp_path)),
            "--workspace", str(WORKSPACE), "--no-cache", "--record", str(rec), "--json", *extra]  # fmt: skip
    child = subprocess.Popen(
        argv, stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    try:
        assert child.stdout is not None and child.stderr is not None
        stream = child.stdout if wait_on == "stdout" else child.stderr
        seen = _wait_for(stream.fileno(), needle, timeout=20)
        time.sleep(0.2)  # the tool (or the prompt) is under way
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=10)
        took = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
        os.close(primary)
        os.close(secondary)
    text = (seen if wait_on == "stdout" else b"").decode() + out.decode()
    return child.returncode, took, text, rec


def _events(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.slow
def test_ctrl_c_while_a_tool_runs_cancels_it_and_the_recording_replays(tmp_path: Path) -> None:
    """SIGINT while a tool runs: exit 130 within 2 s, the rest cancelled, and the recording replays."""
    code, took, text, rec = _interrupt(
        tmp_path, "--yes", wait_on="stdout", needle=b'"call_started", "id": "c3"'
    )
    assert code == 130 and took < 2.0, (code, took, text)
    events = _events(text)
    results = {e["id"]: e for e in events if e["event"] == "result"}
    assert results["c2"]["status"] == "ok"
    assert results["c3"]["status"] == "cancelled" and results["c4"]["status"] == "cancelled"
    assert "c5" not in results
    [cut] = [e for e in events if e["event"] == "interrupted"]
    assert cut["batch"] == 2 and cut["finished"] == 1 and cut["cancelled"] == 2
    assert main(["replay", str(rec)], out=(sink := io.StringIO())) == 0
    assert "replayed 4 calls in 2 batches" in sink.getvalue() and "no divergence" in sink.getvalue()


@pytest.mark.slow
def test_ctrl_c_at_the_prompt_ends_at_once(tmp_path: Path) -> None:
    """SIGINT at the [y/N] prompt: exit 130 within 2 s without Enter, and the recording replays."""
    code, took, text, rec = _interrupt(tmp_path, wait_on="stderr", needle=b"allow run_command")
    assert code == 130 and took < 2.0, (code, took, text)
    events = _events(text)
    assert {e["status"] for e in events if e["event"] == "result" and e["batch"] == 2} == {"cancelled"}
    assert not [e for e in events if e["event"] == "call_started" and e["id"] in ("c2", "c3", "c4")]
    assert main(["replay", str(rec)], out=(sink := io.StringIO())) == 0
    assert "replayed 1 calls in 1 batches" in sink.getvalue() and "no divergence" in sink.getvalue()
