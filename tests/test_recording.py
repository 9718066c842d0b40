"""Recording sessions to JSONL and replaying them offline."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from builtin_tools import default_registry
from dispatcher import (
    Allow,
    Deny,
    Dispatcher,
    DispatchInterrupted,
    HookBlocked,
    Registry,
    Status,
    Tool,
    ToolCall,
    replay,
)
from dispatcher._credentials import redact
from dispatcher._recording import FORMAT_VERSION, Recorder, line_hash, read_recording

from ._fakes import Counter, call, fake_registry, openai_call
from ._http import serving


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rewrite(path: Path, records: list[dict[str, Any]], *, rechain: bool = False) -> None:
    """Write `records` back as the recorder writes them; `rechain` recomputes every `prev`,
    as an edit that knows the chain would."""
    lines: list[str] = []
    for record in records:
        if rechain and lines and "prev" in record:
            record["prev"] = line_hash(lines[-1].encode())
        lines.append(json.dumps(record, ensure_ascii=True))
    path.write_text("".join(line + "\n" for line in lines))


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


class _HistoryWatcher:
    """A hook that notes, after each call, what the session's history holds then."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def after(self, call: ToolCall, result: Any, ctx: Any) -> None:
        self.seen.append([f"{e.call.id}:{e.name}:{e.status}" for e in ctx.history])


async def test_a_hook_reads_the_same_history_at_replay_as_when_recorded(tmp_path: Path) -> None:
    """A replay's own session keeps its history only for a hook, the one thing there that can
    read it: a hook that reads `ctx.history` sees what it saw when the session was recorded,
    batch by batch and run by run; the same recording replayed without hooks matches too."""
    path = tmp_path / "r.jsonl"
    recorded = _HistoryWatcher()
    await record_session_with(path, Dispatcher(fake_registry(Counter(), {"a": "v1"}), hooks=[recorded]))
    assert recorded.seen[-1] and len(recorded.seen) >= 5  # it saw a history that grew
    replayed = _HistoryWatcher()
    report = await replay(path, Dispatcher(fake_registry(Counter(), {"a": "v1"}), hooks=[replayed]))
    assert report.ok, report.divergence
    assert replayed.seen == recorded.seen
    plain = await replay(path, Dispatcher(fake_registry(Counter(), {"a": "v1"})))
    assert plain.ok and plain.calls == report.calls


async def record_session_with(path: Path, d: Dispatcher) -> None:
    """`record_session`'s batches through `d`."""
    s = d.session("rec", record=path)
    await s.dispatch([call("1", "read", path="a"), call("2", "echo", text="x"), call("3", "nope")])
    await s.dispatch([call("4", "edit", path="a", text="v2"), call("5", "read", path="a")])
    await s.dispatch([call("6", "echo", text="x"), call("7", "boom")])
    s.new_run()
    await s.dispatch([call("8", "echo", text="x")])
    s.close()


async def test_replay_reports_the_first_divergence(tmp_path: Path) -> None:
    """A recording whose calls no longer decide the same way names the call, expected and got."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    records = _records(path)
    records[3]["results"][0]["content"] = "something else"  # the deduped echo of batch 3
    _rewrite(path, records, rechain=True)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.problem is None and report.divergence is not None
    div = report.divergence
    assert (div.batch, div.line, div.index, div.call_id, div.field) == (3, 4, 0, "6", "content")
    assert (div.expected, div.got) == ("something else", "x")


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
    (a key that is not text) are recorded as a placeholder that pass 1 decides the same way."""
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
    assert s.recorder is not None and s.recorder.problem is None
    assert _records(path)[2]["calls"][0]["arguments"] == {"$opaque:tuple:(1, 2)": "x"}
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 3, report.divergence


# --- no secrets at rest -------------------------------------------------------------------------


def _echo_registry(counter: Counter) -> Registry:
    """One tool, `request`, shaped like http_request, whose result echoes every argument back."""

    async def request(args: Mapping[str, Any], ctx: Any) -> str:
        counter.enter("request", str(args.get("url")))
        counter.leave()
        return json.dumps(args, sort_keys=True)

    schema = {
        "type": "object",
        "properties": {
            "url": {"type": "string"},
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
            "params": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
            "body": {"type": ["string", "object"]},
        },
        "required": ["url"],
    }
    return Registry([Tool("request", "Echo a request.", request, schema, concurrent=True, deferred=False)])


_PLACES = ["header", "bearer", "query", "password", "arg", "nested", "body", "params", "openai", "other"]
SECRETS = {name: f"{name}-{i}{i}{i}-s3cr3t" for i, name in enumerate(_PLACES)}


def _secret_request(call_id: str, header: str = SECRETS["header"]) -> ToolCall:
    return ToolCall(
        call_id,
        "request",
        {
            "url": f"https://me:{SECRETS['password']}@api.test/v1?q=cats&access_token={SECRETS['query']}",
            "headers": {"X-Api-Key": header, "Authorization": f"Bearer {SECRETS['bearer']}", "Monkey": "x"},
            "params": {"sig": SECRETS["params"], "page": 2},
            "body": json.dumps({"client_secret": SECRETS["body"], "scope": "read"}),
            "api_key": SECRETS["arg"],
            "auth": {"password": SECRETS["nested"]},
        },
    )


async def test_a_recording_holds_markers_not_secrets_and_replays(tmp_path: Path) -> None:
    """Secrets in headers, URLs, params, bodies, arguments and echoes are markers on disk; replay is ok."""
    path = tmp_path / "s.jsonl"
    counter = Counter()
    s = Dispatcher(_echo_registry(counter)).session("rec", record=path)
    token = {"Private-Token": SECRETS["openai"]}
    first = await s.dispatch(
        [_secret_request("1"), openai_call("2", "request", {"url": "https://api.test/", "headers": token})]
    )
    assert SECRETS["header"] in first[0].content  # the tool did echo them
    again = await s.dispatch([_secret_request("3")])  # the same secrets: the same call
    other = await s.dispatch([_secret_request("4", header=SECRETS["other"])])  # another secret: another call
    assert (again[0].deduped, other[0].deduped) == (True, False)

    text = path.read_bytes()
    basic = base64.b64encode(f"me:{SECRETS['password']}".encode())
    for secret in [*SECRETS.values(), basic.decode()]:
        assert secret.encode() not in text, secret
    records = _records(path)
    call = records[1]["calls"][0]["arguments"]
    assert call["headers"] == {
        "X-Api-Key": redact(SECRETS["header"]),
        "Authorization": redact(f"Bearer {SECRETS['bearer']}"),
        "Monkey": "x",
    }
    assert f".len-{len(SECRETS['header'])}." in call["headers"]["X-Api-Key"]
    assert call["api_key"] == redact(SECRETS["arg"]) and call["params"]["page"] == 2
    password, query = redact(SECRETS["password"]), redact(SECRETS["query"])
    assert call["url"] == f"https://me:{password}@api.test/v1?q=cats&access_token={query}"
    assert redact(SECRETS["openai"]).encode() in text  # inside OpenAI's JSON-text arguments, which stay text
    assert isinstance(records[1]["calls"][1]["arguments"], str)
    assert redact(SECRETS["nested"]) in records[1]["results"][0]["content"]  # the echo, redacted
    assert [b["plan"][0]["how"] for b in records[1:]] == ["ran", "deduped", "ran"]

    replayed = Counter()
    report = await replay(path, Dispatcher(_echo_registry(replayed)))
    assert report.ok, report.divergence
    assert report.calls == 4 and replayed.runs == []


async def test_a_different_secret_at_replay_diverges(tmp_path: Path) -> None:
    """A recorded call whose secret is not the one recorded (its marker changed) is reported, not served."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(_echo_registry(Counter())).session("rec", record=path)
    await s.dispatch([_secret_request("1")])
    assert (await replay(path, Dispatcher(_echo_registry(Counter())))).ok
    records = _records(path)
    records[1]["calls"][0]["arguments"]["headers"]["X-Api-Key"] = redact("not-the-recorded-secret")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = await replay(path, Dispatcher(_echo_registry(Counter())))
    assert report.divergence is not None
    assert (report.divergence.batch, report.divergence.index, report.divergence.call_id) == (1, 0, "1")
    assert records[1]["plan"][0]["key"] in report.divergence.expected
    assert records[1]["plan"][0]["key"] not in report.divergence.got


async def test_a_gate_decision_is_recorded_without_its_secrets(tmp_path: Path) -> None:
    """Arguments an approval supplies are redacted in the recording, and the replay still matches."""
    path = tmp_path / "s.jsonl"
    reg = _echo_registry(Counter())
    reg.add(Tool("risky", "r", lambda a, c: json.dumps(a), confirm=True, deferred=False))
    secret = SECRETS["other"]
    d = Dispatcher(reg, gate=lambda c, ctx: Allow({"token": secret, "note": "approved"}))
    [r] = await d.session("g", record=path).dispatch([ToolCall("1", "risky", {})])
    assert r.ok and secret in r.content
    assert secret.encode() not in path.read_bytes()
    assert _records(path)[1]["decisions"]["1"] == {"allow": {"token": redact(secret), "note": "approved"}}
    report = await replay(path, Dispatcher(reg))
    assert report.ok, report.divergence


async def test_a_secret_a_rewriter_adds_is_hidden_and_replays(tmp_path: Path) -> None:
    """A credential a rewriter adds (the host's token) is redacted in keys and echoes; replay matches."""
    secret = SECRETS["other"]

    def with_token(event: Any, state: Any) -> Any:
        headers = {**event.args.get("headers", {}), "Authorization": f"Bearer {secret}"}
        return {"tool_name": event.tool_name, "args": {**event.args, "headers": headers}}

    path = tmp_path / "s.jsonl"
    d = Dispatcher(_echo_registry(Counter()), rewriters=[with_token])
    [r] = await d.session("rw", record=path).dispatch(
        [ToolCall("1", "request", {"url": "https://api.test/"})]
    )
    assert secret in r.content
    assert secret.encode() not in path.read_bytes()
    report = await replay(path, Dispatcher(_echo_registry(Counter()), rewriters=[with_token]))
    assert report.ok, report.divergence


def test_a_recording_is_created_readable_by_its_owner_only(tmp_path: Path) -> None:
    """The recording file is created 0600 whatever the umask, and appended to, not replaced."""
    path = tmp_path / "s.jsonl"
    old = os.umask(0o022)
    try:
        recorder = Recorder(path, registry=_echo_registry(Counter()), session_id="s", mode="deferred")
        recorder.set_meta(note="first")
        recorder._append({"type": "batch", "n": 1})
        recorder._append({"type": "batch", "n": 2})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert [r.get("n") for r in _records(path)] == [None, 1, 2]


async def test_http_request_to_an_echoing_server_records_no_secret(tmp_path: Path) -> None:
    """The real http_request, a server that echoes every header: the recording holds none of the secrets."""
    ws = tmp_path / "ws"
    ws.mkdir()
    path = tmp_path / "web.jsonl"
    with serving() as host:
        d = Dispatcher(default_registry(ws, include=["web"], allow_private_network=True))
        s = d.session("web", record=path)
        args = {
            "url": f"http://{host}/x?code={SECRETS['query']}",
            "headers": {"X-Goog-Api-Key": SECRETS["header"], "Authorization": f"Bearer {SECRETS['bearer']}"},
        }
        with anyio.fail_after(10):
            request = await d.invoke("http_request", args, session=s)
            # user info goes out as Basic authentication, which the server echoes as base64
            url = f"http://me:{SECRETS['password']}@{host}/p"
            page = await d.invoke("fetch_page", {"url": url}, session=s)
    basic = base64.b64encode(f"me:{SECRETS['password']}".encode()).decode()
    echoed = [SECRETS["header"], SECRETS["bearer"], SECRETS["query"], basic]
    assert request.ok and page.ok
    assert all(e in request.content + page.content for e in echoed), (request.content, page.content)
    text = path.read_bytes()
    assert [e for e in echoed if e.encode() in text] == []
    report = await replay(path, Dispatcher(default_registry(ws, include=["web"], allow_private_network=True)))
    assert report.ok and report.fingerprint_matches, report.divergence


# --- the hash chain: tampering is reported by line -------------------------------------------


def _delete_line_3(lines: list[str]) -> list[str]:
    return lines[:2] + lines[3:]


def _swap_lines_3_and_4(lines: list[str]) -> list[str]:
    return [lines[0], lines[1], lines[3], lines[2], lines[4]]


def _duplicate_line_3(lines: list[str]) -> list[str]:
    return lines[:3] + lines[2:]


def _edit_a_result_on_line_3(lines: list[str]) -> list[str]:
    record = json.loads(lines[2])
    record["results"][0]["content"] = "something else"
    return [*lines[:2], json.dumps(record), *lines[3:]]


def _empty_line_3(lines: list[str]) -> list[str]:
    return [*lines[:2], "{}", *lines[3:]]


def _without(field: str) -> Any:
    def drop(lines: list[str]) -> list[str]:
        record = json.loads(lines[2])
        del record[field]
        return [*lines[:2], json.dumps(record), *lines[3:]]

    return drop


def _drop_a_status_on_line_3(lines: list[str]) -> list[str]:
    record = json.loads(lines[2])
    del record["results"][1]["status"]
    return [*lines[:2], json.dumps(record), *lines[3:]]


def _edit_the_header(lines: list[str]) -> list[str]:
    header = json.loads(lines[0])
    header["mode"] = "direct"
    return [json.dumps(header), *lines[1:]]


def _garble_line_4(lines: list[str]) -> list[str]:
    return [*lines[:3], lines[3][:-5], *lines[4:]]


TAMPERING = [
    (_delete_line_3, "line 3: record seq 3 follows seq 1 (a record is missing)", 1),
    (_swap_lines_3_and_4, "line 3: record seq 3 follows seq 1 (out of order: seq 2 is on line 4)", 1),
    (_duplicate_line_3, "line 4: a duplicate of line 3 (record seq 2)", 2),
    (_edit_a_result_on_line_3, "line 3: edited (its hash does not match the next record's prev)", 1),
    (_empty_line_3, "line 3: a record without 'type'", 1),
    (_without("results"), "line 3: the batch record has no 'results'", 1),
    (_without("plan"), "line 3: the batch record has no 'plan'", 1),
    (_without("run"), "line 3: the batch record has no 'run'", 1),
    (_without("prev"), "line 3: the batch record has no 'prev'", 1),
    (_drop_a_status_on_line_3, "line 3: results[1] has no 'status'", 1),
    (_edit_the_header, "line 1: edited (its hash does not match the next record's prev)", 0),
    (_garble_line_4, "line 4 is not a JSON record: ", 2),
]


async def test_every_kind_of_tampering_is_named_by_its_line(tmp_path: Path) -> None:
    """A deleted, moved, duplicated, edited, emptied or incomplete record is a problem naming
    its line and what is wrong, never an exception; the batches before it replay."""
    original = tmp_path / "s.jsonl"
    await record_session(original, Counter(), {"a": "v1"})
    lines = original.read_text().splitlines()
    assert len(lines) == 5
    for tamper, problem, replayed in TAMPERING:
        path = tmp_path / f"{tamper.__name__}.jsonl"
        path.write_text("".join(line + "\n" for line in tamper(lines)))
        report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
        assert report.problem is not None and report.problem.startswith(problem), (tamper, report.problem)
        assert not report.ok and report.divergence is None and not report.truncated, tamper
        assert report.batches == replayed, (tamper, report.batches)


async def test_the_chain_links_every_record_to_the_line_before(tmp_path: Path) -> None:
    """The header is seq 0; each batch has the next seq and the xxh3-64 of the previous line."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    lines = path.read_bytes().split(b"\n")[:-1]
    records = [json.loads(line) for line in lines]
    assert [r["seq"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["prev"] for r in records[1:]] == [line_hash(line) for line in lines[:-1]]
    assert "prev" not in records[0] and records[0]["format"] == FORMAT_VERSION == 3


async def test_a_recorder_opened_on_a_recording_goes_on_with_its_chain(tmp_path: Path) -> None:
    """A second session recording into the same file continues the numbering and the chain,
    after a `session` record naming it, which the batches read from the file leave out."""
    path = tmp_path / "s.jsonl"
    d = Dispatcher(fake_registry(Counter(), {}))
    await d.session("one", record=path).dispatch([call("1", "echo", text="x")])
    await d.session("two", record=path).dispatch([call("2", "echo", text="y")])
    records = _records(path)
    assert [r["seq"] for r in records] == [0, 1, 2, 3]
    marker = {"type": "session", "session": "two", "mode": "deferred", "seq": 2}
    assert records[2] == marker | {"prev": line_hash(path.read_bytes().split(b"\n")[1])}
    assert len(read_recording(path)[1]) == 2
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 2, (report.problem, report.divergence)


async def test_a_session_record_starts_a_session_afresh_at_replay_and_a_bad_one_is_a_problem(
    tmp_path: Path,
) -> None:
    """Two sessions making the same call into one file: replay runs the second's batches in
    a session of their own, so its call replays as run, not deduped; without the `session`
    record (the chain made again) it would be deduped, and a `session` record whose mode is
    no mode is a problem naming its line."""
    path = tmp_path / "s.jsonl"
    d = Dispatcher(fake_registry(Counter(), {}))
    await d.session("one", record=path).dispatch([call("1", "echo", text="x")])
    await d.session("two", record=path, mode="direct").dispatch([call("2", "echo", text="x")])
    records = _records(path)
    assert [r["type"] for r in records] == ["header", "batch", "session", "batch"]
    assert records[2]["mode"] == "direct"
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 2 and report.batches == 2, report.divergence
    without = [records[0], records[1], records[3]]
    without[2]["seq"] = 2
    _rewrite(path, without, rechain=True)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.divergence is not None and report.divergence.field == "deduped", report
    records[2]["mode"] = "sideways"
    _rewrite(path, records, rechain=True)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.problem is not None and report.problem.startswith("line 3: a session record's mode")
    assert report.batches == 1 and report.calls == 1, report


async def test_a_recording_without_the_chain_replays_with_a_warning(tmp_path: Path) -> None:
    """A format 1 recording (no seq, no prev) replays, with a warning that it cannot be checked."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    records = _records(path)
    for record in records:
        record.pop("seq", None)
        record.pop("prev", None)
        record.pop("tools", None)
    records[0]["format"] = 1
    _rewrite(path, records)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 8
    assert len(report.warnings) == 1 and "cannot be detected" in report.warnings[0]


# --- divergences ----------------------------------------------------------------------------


async def test_a_pass_1_decision_that_changed_is_a_divergence(tmp_path: Path) -> None:
    """A call pass 1 rejected then and decides otherwise now (a tool of that name, requiring an
    argument, was added) diverges on its status; the registry change is a warning naming it."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    reg = fake_registry(Counter(), {})
    needs_x = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    reg.add(Tool("nope", "Now it exists.", lambda a, c: "ran", needs_x, deferred=False))
    report = await replay(path, Dispatcher(reg))
    div = report.divergence
    assert div is not None and report.problem is None
    assert (div.batch, div.line, div.index, div.call_id, div.field) == (1, 2, 2, "3", "status")
    assert (div.expected, div.got) == ("rejected", "invalid_arguments")
    assert report.warnings == ("the tools differ from those the recording was made with: nope added",)


async def test_a_long_content_shows_a_window_around_its_first_difference(tmp_path: Path) -> None:
    """A 20,000-character result differing at offset 10,000 is shown as a short window there,
    with the offset and "…" marks, whatever the length."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("rec", record=path)
    text = "ab" * 10_000
    await s.dispatch([call("1", "echo", text=text)])
    await s.dispatch([call("2", "echo", text=text)])  # deduped: its content comes from call 1
    records = _records(path)
    records[2]["results"][0]["content"] = text[:10_000] + "X" + text[10_001:]
    _rewrite(path, records, rechain=True)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    div = report.divergence
    assert div is not None and (div.batch, div.index, div.call_id, div.field) == (2, 0, "2", "content")
    shown = str(div)
    assert shown.startswith("batch 2 (line 3), call 0 (2): content differs at offset 10000: ")
    assert "expected …'ababababababababababXbababababababababab'…" in shown
    assert "got …'abababababababababababababababababababab'…" in shown
    assert len(shown) < 200 and len(div.expected) == len(div.got) == 20_000


async def test_the_earliest_differing_call_is_blamed(tmp_path: Path) -> None:
    """Two calls of a batch differ (an edited pass-1 answer at index 1, an edited key at index
    2 that pass 2 meets first): the one reported is index 1."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("rec", record=path)
    await s.dispatch([call("1", "echo", text="a"), call("2", "nope"), call("3", "echo", text="b")])
    records = _records(path)
    records[1]["results"][1]["content"] = "edited answer"
    records[1]["plan"][2]["key"] = "0" * 32
    _rewrite(path, records, rechain=True)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    div = report.divergence
    assert div is not None and (div.index, div.call_id, div.field) == (1, "2", "content")
    assert div.expected == "edited answer" and "Tool not found: nope" in div.got


async def test_a_changed_description_is_a_warning_naming_the_tool(tmp_path: Path) -> None:
    """A registry whose `echo` has a new description replays on with a warning that names it."""
    path = tmp_path / "s.jsonl"
    await record_session(path, Counter(), {"a": "v1"})
    reg = fake_registry(Counter(), {})
    echo = reg.get("echo")
    reg.remove("echo")
    reg.add(
        Tool("echo", "Say the text back.", echo.handler, echo.parameters, concurrent=True, deferred=False)
    )
    report = await replay(path, Dispatcher(reg))
    assert not report.fingerprint_matches and report.ok and report.batches == 4
    assert report.warnings == (
        "the tools differ from those the recording was made with: echo changed (description)",
    )


# --- recording never raises into a batch ----------------------------------------------------


async def test_calls_of_any_shape_are_recorded_as_received_and_replay(tmp_path: Path) -> None:
    """A call that is a list, number, bool, bytes, None or object, and arguments of those types,
    are recorded (raw, or as a placeholder naming the type) and replay to the same answers."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("rec", record=path)
    odd: list[Any] = [[1, 2], 3, True, b"x", None, object()]
    odd += [ToolCall(f"a{i}", "echo", a) for i, a in enumerate([[1], 2.5, False, b"y", None, object()])]  # type: ignore[arg-type]
    results = await s.dispatch([call("1", "echo", text="x"), *odd])
    assert len(results) == 1 + len(odd) and results[0].ok
    assert [r.status for r in results[1:]] == [Status.invalid_arguments] * len(odd)
    assert s.recorder is not None and s.recorder.problem is None
    calls = _records(path)[1]["calls"]
    assert calls[1:4] == [{"raw": [1, 2]}, {"raw": 3}, {"raw": True}]
    assert calls[4] == {"raw": {"$opaque": "bytes", "repr": "b'x'"}, "opaque": True}
    assert calls[10] == {
        "id": "a3",
        "name": "echo",
        "arguments": {"$opaque": "bytes", "repr": "b'y'"},
        "opaque": True,
    }
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 1 + len(odd), report.divergence


def test_record_batch_never_raises(tmp_path: Path, caplog: Any) -> None:
    """A batch the recorder cannot make a record of (here a plan that does not match its
    results) stops the recording with `problem`, logged once, and raises nothing."""
    from dispatcher._plan import Plan

    recorder = Recorder(
        tmp_path / "s.jsonl", registry=_echo_registry(Counter()), session_id="s", mode="deferred"
    )
    for _ in range(2):
        recorder.record_batch(
            run_id=1,
            round=1,
            calls=[ToolCall("1", "echo", {})],
            plan=Plan(calls=(), groups=()),
            results=[None],
            decisions={},
            control=None,
        )
    assert isinstance(recorder.problem, ValueError)
    assert sum("failed and stops here" in r.getMessage() for r in caplog.records) == 1
    assert not (tmp_path / "s.jsonl").exists()


async def test_a_format_1_call_that_was_unreadable_still_replays(tmp_path: Path) -> None:
    """Format 1 wrote an unreadable call as its repr; replay hands pass 1 that text, as before."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("rec", record=path)
    await s.dispatch(["not a call"])
    records = _records(path)
    records[0] = {k: v for k, v in records[0].items() if k not in ("seq", "tools")} | {"format": 1}
    records[1] = {k: v for k, v in records[1].items() if k not in ("seq", "prev")}
    records[1]["calls"] = [{"unreadable": "not a call"}]
    _rewrite(path, records)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 1 and report.warnings


async def test_a_call_of_no_known_shape_is_recorded_without_its_secrets(tmp_path: Path) -> None:
    """A mapping that is not a tool call is recorded raw, its credentials redacted, and replays."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("rec", record=path)
    [r] = await s.dispatch([{"id": "x", "tool": "echo", "api_key": SECRETS["arg"]}])
    assert r.status is Status.invalid_arguments
    assert SECRETS["arg"].encode() not in path.read_bytes()
    assert _records(path)[1]["calls"][0] == {
        "raw": {"id": "x", "tool": "echo", "api_key": redact(SECRETS["arg"])}
    }
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok, report.divergence


# --- the file kept open, the encoder ------------------------------------------------------


def _opened(path: Path) -> int | None:
    """How many descriptors of this process are open on `path` (None: no /proc to ask)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            continue
    return found


async def test_the_file_stays_open_between_batches_and_closes_with_the_session(tmp_path: Path) -> None:
    """One descriptor for the whole session, however many batches; Session.close gives it back."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("open", record=path)
    for n in range(5):
        await s.dispatch([call(str(n), "echo", text=f"x{n}")])
        assert _opened(path) in (1, None)
    s.close()
    assert _opened(path) in (0, None)
    assert len(path.read_text().splitlines()) == 6


def test_a_recorder_never_closed_lets_its_file_go_without_a_warning(tmp_path: Path) -> None:
    """A recorder dropped unclosed closes its file when collected, with no ResourceWarning
    (warnings are errors in this suite)."""
    import gc

    path = tmp_path / "s.jsonl"
    recorder = Recorder(path, registry=fake_registry(Counter(), {}), session_id="s", mode="direct")
    recorder._append({"type": "batch"})
    assert _opened(path) in (1, None)
    del recorder
    gc.collect()
    assert _opened(path) in (0, None)
    assert len(path.read_text().splitlines()) == 2


async def test_a_recording_deleted_between_batches_starts_again_with_a_header(
    tmp_path: Path, caplog: Any
) -> None:
    """The file removed mid-session: the next batch notices, logs it, and begins a new recording
    (a header, then that batch) that replays clean."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("gone", record=path)
    await s.dispatch([call("1", "echo", text="a")])
    path.unlink()
    await s.dispatch([call("2", "echo", text="b")])
    await s.dispatch([call("3", "echo", text="c")])
    s.close()
    records = _records(path)
    assert [r["type"] for r in records] == ["header", "batch", "batch"]
    assert [r["seq"] for r in records] == [0, 1, 2]
    assert any("removed or replaced" in r.getMessage() for r in caplog.records)
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.ok and report.calls == 2


async def test_lines_are_orjson_where_it_can_and_json_where_it_cannot(tmp_path: Path) -> None:
    """A plain batch is written by orjson (UTF-8 kept); one holding a lone surrogate or a NaN is
    written by json with escapes, and keeps them; both replay, and the chain holds."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("enc", record=path)
    await s.dispatch([call("1", "echo", text="café")])
    await s.dispatch([ToolCall("2", "echo", {"text": "x\ud800"})])
    await s.dispatch([ToolCall("3", "echo", {"text": "y", "n": float("nan")})])
    s.close()
    raw = path.read_bytes().splitlines()
    assert "café".encode() in raw[1]  # orjson: UTF-8 as is
    assert b"\\ud800" in raw[2] and raw[2].isascii()
    assert b"NaN" in raw[3]
    report = await replay(path, Dispatcher(fake_registry(Counter(), {})))
    assert report.problem is None and report.batches == 3


async def test_fsync_is_an_option(tmp_path: Path, monkeypatch: Any) -> None:
    """`Recorder(fsync=True)` syncs the file once a batch; the default does not."""
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    registry = fake_registry(Counter(), {})
    for fsync in (False, True):
        recorder = Recorder(
            tmp_path / f"{fsync}.jsonl", registry=registry, session_id="s", mode="direct", fsync=fsync
        )
        recorder._append({"type": "batch"})
        recorder._append({"type": "batch"})
        recorder.close()
    assert len(synced) == 2
    s = Dispatcher(registry).session("synced", record=tmp_path / "s.jsonl", record_fsync=True)
    await s.dispatch([call("1", "echo", text="x")])
    s.close()
    assert len(synced) == 3


async def test_a_recording_replaced_between_batches_goes_on_in_the_new_file(tmp_path: Path) -> None:
    """A file renamed over the recording: the next batch is written to the file now at the path."""
    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("swapped", record=path)
    await s.dispatch([call("1", "echo", text="a")])
    (tmp_path / "new.jsonl").write_text("")
    os.replace(tmp_path / "new.jsonl", path)
    await s.dispatch([call("2", "echo", text="b")])
    s.close()
    records = _records(path)
    assert [r["type"] for r in records] == ["header", "batch"]
    assert records[1]["calls"][0]["id"] == "2"


async def test_a_recording_replays_again_and_again_through_one_dispatcher(tmp_path: Path) -> None:
    """Each replay starts from nothing: a second one through the same Dispatcher does not
    find the first one's remembered calls (which would serve the repeated call deduped
    where the recording says it ran), and a session store is neither read nor written."""
    from cache import MemorySessionStore

    path = tmp_path / "s.jsonl"
    s = Dispatcher(fake_registry(Counter(), {})).session("s", record=path)
    await s.dispatch([call("a", "echo", text="x")])
    s.new_run()
    await s.dispatch([call("b", "echo", text="x")])  # the same call in a new run: it runs
    s.close()
    store = MemorySessionStore()
    d = Dispatcher(fake_registry(Counter(), {}), session_store=store)
    for _ in range(3):
        report = await replay(path, d)
        assert report.ok and report.calls == 2, report
    assert (await store.load("replay:s")).snapshot is None
    assert len(d.session("replay:s").history) == 0  # no replay left its session among the dispatcher's


async def test_arguments_text_that_hides_a_secret_from_json_is_recorded_without_it(tmp_path: Path) -> None:
    """Arguments text where json alone would not see the secret — a key given twice, JSON
    that is not an object, text cut short — is recorded without it, and replays clean."""
    secret = "sk-live-abcdefghijklmnop123456"
    schema = {"type": "object", "properties": {"headers": {"type": "object"}, "url": {"type": "string"}}}

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        return "fetched"

    def registry() -> Registry:
        return Registry([Tool("fetch", "Fetch.", fetch, schema, deferred=False)])

    texts = [
        '{"headers": {"Authorization": "Bearer %s"}, "headers": {}}',
        '[{"api_key": "%s"}]',
        '{"api_key": "%s", ',
        '{"url": "https://user:%s@example.com/", ',
    ]
    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("s", record=path, mode="direct")
    for n, text in enumerate(texts):
        await s.dispatch([openai_call(f"c{n}", "fetch", text % secret)])
    s.close()
    assert secret not in path.read_text()
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.calls == len(texts), report


async def test_a_text_argument_holding_json_is_recorded_without_its_secrets(tmp_path: Path) -> None:
    """A tool given a config file's content as text: the recording holds it redacted, and
    replays clean (replay redacts the call it makes the same way)."""
    secret = "sk-live-abcdefghijklmnop123456"
    schema = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]}

    async def save(args: Mapping[str, Any], ctx: Any) -> str:
        return f"saved {len(args['content'])} characters"

    def registry() -> Registry:
        return Registry([Tool("save", "Save.", save, schema, deferred=False)])

    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("s", record=path, mode="direct")
    content = json.dumps({"service": "search", "api_key": secret})
    [result] = await s.dispatch([openai_call("c", "save", {"content": content})])
    s.close()
    assert result.content == f"saved {len(content)} characters"  # the tool saw the text as sent
    assert secret not in path.read_text()
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.calls == 1, report


def _cutting_registry() -> Registry:
    """`echo`, and `cut`, whose call with `how` stops its batch as a tool may: it asks for a
    decision (DispatchInterrupted), blocks the batch (HookBlocked), or raises KeyboardInterrupt."""

    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.lowlevel.checkpoint()
        return str(args["text"])

    async def cut(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(0.01)  # after its siblings finished
        how = args["how"]
        if how == "interrupt":
            raise DispatchInterrupted([(ToolCall(ctx.call_id, "cut", dict(args)), "asks", None)])
        if how == "block":
            raise HookBlocked("not now")
        raise KeyboardInterrupt

    text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    how = {"type": "object", "properties": {"how": {"type": "string"}}, "required": ["how"]}
    return Registry(
        [
            Tool("echo", "Echo.", echo, text, concurrent=True, deferred=False),
            Tool("cut", "Cuts.", cut, how, concurrent=True, deferred=False),
        ]
    )


@pytest.mark.parametrize("how", ["interrupt", "block", "keyboard"])
async def test_a_batch_its_own_tool_cut_short_replays(tmp_path: Path, how: str) -> None:
    """A batch a tool cut short (asking, blocking, Ctrl-C) replays as recorded: the calls that
    finished served, the cut made again where it was, and the batches after it compared too."""
    path = tmp_path / "cut.jsonl"
    s = Dispatcher(_cutting_registry()).session("cut", record=path)
    await s.dispatch([call("a", "echo", text="before")])
    cut = [call("b", "echo", text="one"), call("c", "cut", how=how), call("d", "echo", text="two")]
    with pytest.raises((DispatchInterrupted, HookBlocked, KeyboardInterrupt)):
        await s.dispatch(cut)
    await s.dispatch([call("e", "echo", text="after")])
    s.close()
    report = await replay(path, Dispatcher(_cutting_registry()))
    assert report.ok, report
    assert report.batches == 3


async def test_a_ctrl_c_of_its_own_still_stops_a_replay(tmp_path: Path) -> None:
    """A KeyboardInterrupt the replay did not make (here a rewriter's) propagates out of it,
    even in a batch whose recording ends in one."""
    path = tmp_path / "cut.jsonl"
    s = Dispatcher(_cutting_registry()).session("cut", record=path)
    with pytest.raises(KeyboardInterrupt):
        await s.dispatch([call("b", "echo", text="one"), call("c", "cut", how="keyboard")])
    s.close()

    def ctrl_c(event: Any, state: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await replay(path, Dispatcher(_cutting_registry(), rewriters=[ctrl_c]))


@pytest.mark.parametrize("wait", [True, False], ids=["waited", "gathered"])
async def test_a_secret_of_an_earlier_batch_echoed_by_a_later_result_is_not_recorded(
    tmp_path: Path, wait: bool
) -> None:
    """A secret one batch's arguments held, which a later batch's result shows again (a tool
    that recalls an earlier result, as `chat_history` does), is its marker in that later
    record too, whichever way the recording is made, and the recording still replays."""
    secret = "sk-live-recalled-0123456789"
    seen: list[str] = []

    async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        text = f"sent {json.dumps(args)}"
        seen.append(text)
        return text

    async def recall(args: Mapping[str, Any], ctx: Any) -> str:
        return f"earlier: {seen[0]}"

    def registry() -> Registry:
        return Registry(
            [
                Tool("fetch", "Fetch.", fetch, parameters={"type": "object"}, deferred=False),
                Tool("recall", "Recall.", recall, parameters={"type": "object"}, deferred=False),
            ]
        )

    path = tmp_path / "s.jsonl"
    s = Dispatcher(registry()).session("rec", record=path, record_wait=wait)
    headers = {"headers": {"Authorization": f"Bearer {secret}"}}
    await s.dispatch([openai_call("1", "fetch", headers)])
    for n in range(2, 5):  # several, so that gathered records are made together too
        [result] = await s.dispatch([openai_call(str(n), "recall", {"n": n})])
        assert secret in result.content  # the caller sees it: only the file must not
    s.close()
    data = path.read_bytes()
    assert secret.encode() not in data
    # the header's value is the credential: in the arguments, their echo, and each recall
    assert data.count(redact(f"Bearer {secret}").encode()) == 5, data.decode()
    report = await replay(path, Dispatcher(registry()))
    assert report.ok and report.calls == 4, report.divergence
