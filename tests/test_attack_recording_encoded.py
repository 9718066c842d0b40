"""Attacks on the recording of a large batch (`_common_rows` encoding its rows as one
orjson fragment) and on the scan of a batch no rewriter touched (its calls' text only):
every kind of call and result at sizes around the threshold, written every way a recorder
writes, each line read back and compared field for field with the record built part by
part (a `batch` line byte for byte); then generated batches, and arguments made to slip a
credential past the scan."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import attrs
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cache import CachePolicy, MemoryResultCache, MemorySessionStore
from dispatcher import (
    Dispatcher,
    DispatchInterrupted,
    Registry,
    Status,
    Tool,
    ToolCall,
    ToolResult,
    replay,
)
from dispatcher._credentials import credential_values, redact_json_text
from dispatcher._recording import Recorder, _copied_calls, read_recording

from ._fakes import TEXT_SCHEMA, openai_call
from ._recorded import assert_reads_as, one_pass_line, part_by_part, read_line
from ._recorded import submitted as _submitted

SECRET = "sk-live-0123456789abcdef"  # never in a recording
DEFAULT_SECRET = "default-secret-value-42"


@attrs.frozen
class _Noted(ToolResult):
    """A result that says more in its to_json."""

    note: Any = "noted ✓"

    def to_json(self) -> dict[str, Any]:
        recorded = super().to_json()
        recorded["note"] = self.note
        return recorded


def _defaults(value: Any, name: str = "mode") -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"text": {"type": "string"}, name: {"type": "string", "default": value}},
        "required": ["text"],
    }


def _registry() -> Registry:
    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        return str(args["text"])

    def serial(args: Mapping[str, Any], ctx: Any) -> str:
        return f"serial {args['text']}"

    async def boom(args: Mapping[str, Any], ctx: Any) -> str:
        raise RuntimeError(f"it broke: ünïcödé {args.get('why', '')}")

    async def big(args: Mapping[str, Any], ctx: Any) -> str:
        return "é✓" * 300_000  # past max_output_bytes: cut

    async def surrogate(args: Mapping[str, Any], ctx: Any) -> Any:
        return {"text": "a\ud800b", "n": 2**70}

    async def naps(args: Mapping[str, Any], ctx: Any) -> str:
        await anyio.sleep(10)
        return "woke"

    async def kbd(args: Mapping[str, Any], ctx: Any) -> str:
        raise KeyboardInterrupt

    async def interrupts(args: Mapping[str, Any], ctx: Any) -> str:
        raise DispatchInterrupted([])

    async def echoes_default(args: Mapping[str, Any], ctx: Any) -> str:
        return f"{args['text']} {args.get('api_key', '')}"

    async def nested(args: Mapping[str, Any], ctx: Any) -> str:
        inner = await ctx.invoke("echo", {"text": f"inner {args['text']}"})
        return f"{inner.status.value}:{inner.content}"

    fast = {"concurrent": True, "deferred": False}
    return Registry(
        [
            Tool("echo", "Echo.", echo, TEXT_SCHEMA, **fast),
            Tool("serial", "Serial.", serial, TEXT_SCHEMA, deferred=False),
            Tool("boom", "Fails.", boom, {"type": "object"}, **fast),
            Tool("big", "Big.", big, {"type": "object"}, **fast),
            Tool("surrogate", "Odd.", surrogate, {"type": "object"}, **fast),
            Tool("naps", "Naps.", naps, {"type": "object"}, timeout=0.05, **fast),
            Tool("kbd", "Ctrl-C.", kbd, {"type": "object"}, **fast),
            Tool("interrupts", "Asks.", interrupts, {"type": "object"}, **fast),
            Tool("plain_default", "Echo.", echo, _defaults("fast"), **fast),
            Tool("marked_default", "Echo.", echo, _defaults("token-less"), **fast),
            Tool("secret_default", "Echo.", echoes_default, _defaults(DEFAULT_SECRET, "api_key"), **fast),
            Tool("cached", "Cached.", echo, TEXT_SCHEMA, cache=CachePolicy(), **fast),
            Tool("nested", "Nested.", nested, TEXT_SCHEMA, **fast),
            Tool("deferred", "Deferred.", echo, TEXT_SCHEMA, concurrent=True),
        ]
    )


def _oc(call_id: str, name: str, args: Mapping[str, Any] | str) -> dict[str, Any]:
    """`openai_call` with non-ASCII text as itself, as most models send it."""
    return openai_call(call_id, name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _kind(kind: str, i: int, rng: random.Random) -> Any:
    """One call of a kind, its id `c<i>` (or not text)."""
    cid = f"c{i}"
    texts = ["same", "café ✓", "\U0001d518\U0001d52b\U0001d526", "", f"t{i}", "ǅ", "<script>"]
    text = rng.choice(texts)
    table: dict[str, Any] = {
        "echo": lambda: _oc(cid, "echo", {"text": text}),
        "plain": lambda: _oc(cid, "echo", {"text": f"t{i} ✓"}),
        "escaped": lambda: openai_call(cid, "echo", {"text": text}),
        "escapes": lambda: _oc(cid, "echo", {"text": rng.choice(['a"b\\c', "tab\there", "/\u0000"])}),
        "same": lambda: _oc(cid, "echo", {"text": "same"}),  # followers; deduped in the run
        "serial": lambda: _oc(cid, "serial", {"text": text}),
        "spaced": lambda: _oc(cid, "echo", f'  {{ "text" : {json.dumps(text)} }}  '),
        "invalid": lambda: _oc(cid, "echo", {"wrong": i}),
        "unknown": lambda: _oc(cid, "nowhere", {"text": "a"}),
        "not_json": lambda: _oc(cid, "echo", "not json"),
        "deferred": lambda: _oc(cid, "deferred", {"text": "a"}),
        "boom": lambda: _oc(cid, "boom", {}),
        "boom_surrogate": lambda: _oc(cid, "boom", '{"why": "\ud800"}'),
        "big": lambda: _oc(cid, "big", {}),
        "surrogate_result": lambda: _oc(cid, "surrogate", {}),
        "surrogate_args": lambda: _oc(cid, "echo", '{"text": "x\ud800y"}'),
        "escaped_surrogate": lambda: _oc(cid, "echo", '{"text": "x\\ud800y"}'),
        "huge_args": lambda: _oc(cid, "echo", {"text": "z" * 70_000}),
        "naps": lambda: _oc(cid, "naps", {}),
        "int_id": lambda: {"id": 1000 + i, "function": {"name": "echo", "arguments": '{"text": "b"}'}},
        "none_id": lambda: {"id": None, "function": {"name": "echo", "arguments": '{"text": "n"}'}},
        "no_id": lambda: {"function": {"name": "echo", "arguments": f'{{"text": "{i}"}}'}},
        "dup_id": lambda: _oc("c0", "echo", {"text": f"dup{i}"}),
        "tool_call": lambda: ToolCall(cid, "echo", {"text": text}),
        "run_tool": lambda: _oc(cid, "run_tool", {"name": "echo", "args": {"text": text}}),
        "force": lambda: _oc(cid, "cached", {"text": "cached", "force": True}),
        "cached": lambda: _oc(cid, "cached", {"text": "cached"}),
        "plain_default": lambda: _oc(cid, "plain_default", {"text": text}),
        "marked_default": lambda: _oc(cid, "marked_default", {"text": text}),
        "secret_default": lambda: _oc(cid, "secret_default", {"text": text}),
        "secret_arg": lambda: _oc(cid, "echo", {"text": "a", "api_key": SECRET}),
        "nested": lambda: _oc(cid, "nested", {"text": text}),
        "numbers": lambda: _oc(
            cid, "echo", '{"text": "n", "x": 1e400, "y": -0.0, "z": 12345678901234567890123}'
        ),
    }
    return table[kind]()


_KINDS = [
    "echo",
    "same",
    "serial",
    "spaced",
    "invalid",
    "unknown",
    "not_json",
    "deferred",
    "boom",
    "big",
    "boom_surrogate",
    "escaped",
    "escapes",
    "plain",
    "surrogate_result",
    "surrogate_args",
    "escaped_surrogate",
    "huge_args",
    "naps",
    "int_id",
    "none_id",
    "no_id",
    "dup_id",
    "tool_call",
    "run_tool",
    "force",
    "cached",
    "plain_default",
    "marked_default",
    "secret_default",
    "secret_arg",
    "nested",
    "numbers",
]
_ENDINGS = ["", "kbd", "interrupts"]  # a batch cut short: by a tool's Ctrl-C, or a tool asking


def _as_copied(parts: tuple[Any, ...]) -> tuple[Any, ...]:
    """A batch's parts as the writer thread gets them from a batch that does not wait: its
    calls copied (`_copied_calls`: ids and names made text), when they can be."""
    copied = _copied_calls(parts[2], parts[5])
    return parts if copied is None else (*parts[:2], copied, *parts[3:])


def _check_file(
    path: Path,
    submitted: list[tuple[Any, ...]],
    monkeypatch: pytest.MonkeyPatch,
    *,
    hidden: bool = True,
    copied: bool = False,
) -> list[str]:
    """Each batch line in `path` reads back as the record built part by part (its `seq` and
    `prev` as written; a `batch` line is that record's bytes), the one-pass record encodes
    to the same line (`copied`: of the calls as copied for a batch that does not wait), and
    the chain holds. Per batch, how it was written: "encoded" (a `rows` line whose rows
    were encoded as one fragment), "rows" or "batch"."""
    lines = path.read_bytes().splitlines()[1:]
    assert len(lines) == len(submitted)
    how = []
    for line, parts in zip(lines, submitted, strict=True):
        written = read_line(line)
        expected = part_by_part(parts, monkeypatch)
        expected["seq"], expected["prev"] = written["seq"], written["prev"]
        assert_reads_as(line, expected)
        fast, plain = Recorder._record_of(*(_as_copied(parts) if copied else parts))
        fast["seq"], fast["prev"] = written["seq"], written["prev"]
        assert one_pass_line(fast, plain) == line
        encoded = isinstance(fast.get("rows"), orjson.Fragment)
        how.append("encoded" if encoded else "rows" if plain else "batch")
    _, batches, truncated, problem = read_recording(path)
    assert problem is None and not truncated and len(batches) == len(lines)
    text = path.read_text(encoding="utf-8", errors="replace")
    assert DEFAULT_SECRET not in text
    assert SECRET not in text or not hidden
    return how


def _dispatcher(**options: Any) -> Dispatcher:
    return Dispatcher(_registry(), cache=MemoryResultCache(), max_output_bytes=4096, **options)


async def _dispatch_all(s: Any, batches: list[list[Any]]) -> None:
    for batch in batches:
        try:
            with anyio.fail_after(20):
                await s.dispatch(batch)
        except (KeyboardInterrupt, DispatchInterrupted):
            pass


def _batch(kinds: list[str], size: int, rng: random.Random, ending: str = "") -> list[Any]:
    batch = [_kind(kinds[i % len(kinds)], i, rng) for i in range(size)]
    if ending:
        batch[size // 2] = openai_call(f"c{size // 2}", ending, {})
    return batch


_OPTIONS: dict[str, dict[str, Any]] = {
    "wait": {},
    "no_wait": {"record_wait": False},
    "fsync": {"record_fsync": True},
}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the builders know no loop: trio's is below
@pytest.mark.parametrize("size", [15, 16, 40])
@pytest.mark.parametrize("how", sorted(_OPTIONS))
async def test_every_kind_of_call_alone_in_a_large_batch_is_written_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, how: str
) -> None:
    """A batch of each kind of call (then of each kind mixed with plain calls, and each
    cut short), every recorder option: each line reads as the general builder's record."""
    rng = random.Random(size)
    path = tmp_path / "kinds.jsonl"
    batches = [_batch([kind], size, rng) for kind in _KINDS]
    batches += [_batch(["plain", kind, "same"], size, rng) for kind in _KINDS]
    with _submitted(monkeypatch) as submitted:
        s = _dispatcher().session("kinds", record=path, **_OPTIONS[how])
        for n, batch in enumerate(batches):
            if n % 3 == 0:
                s.new_run()
            await _dispatch_all(s, [batch])
        s.close()
    written = set(_check_file(path, submitted, monkeypatch, copied=how == "no_wait"))
    taken = "encoded" if size >= 16 else "rows"  # the one-pass builder, its rows encoded from 16 calls
    assert taken in written and "batch" in written  # each builder was taken at all
    assert written <= {taken, "batch"}
    report = await replay(path, _dispatcher())
    assert report.ok, report
    # cut short (replayed apart: test_a_batch_cut_short_by_its_own_tool_replays)
    cut = tmp_path / "cut.jsonl"
    with _submitted(monkeypatch) as submitted:
        s = _dispatcher().session("cut", record=cut, **_OPTIONS[how])
        for ending in _ENDINGS[1:]:
            await _dispatch_all(s, [_batch(["plain", "same", "boom"], size, rng, ending)])
        s.close()
    taken = "encoded" if size >= 16 else "rows"
    assert _check_file(cut, submitted, monkeypatch, copied=how == "no_wait") == [taken] * 2


async def test_a_large_batch_with_a_session_store_is_written_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a session store, every kind of call in large batches is written as built part by part."""
    rng = random.Random(3)
    path = tmp_path / "store.jsonl"
    with _submitted(monkeypatch) as submitted:
        d = Dispatcher(_registry(), session_store=MemorySessionStore(), max_output_bytes=4096)
        s = d.session("stored", record=path, record_wait=False)
        await _dispatch_all(s, [_batch(["plain", "same", kind], 20, rng) for kind in _KINDS])
        s.close()
    assert "encoded" in _check_file(path, submitted, monkeypatch)  # a store: every batch waits


@pytest.mark.parametrize("raw", ['{"why": "\ud800"}', '{"why": "\\ud800"}'])
async def test_a_stored_session_takes_arguments_with_a_lone_surrogate(raw: str) -> None:
    """A session with a store takes arguments holding a lone surrogate: the call refused, no error."""
    d = Dispatcher(_registry(), session_store=MemorySessionStore())
    s = d.session("stored")
    [result] = await s.dispatch([openai_call("1", "boom", raw)])
    assert result.status is Status.invalid_arguments


async def test_a_large_batch_of_subclassed_results_from_a_runner_is_written_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner's results: ToolResult subclasses that say more, plain ones, odd fields. A
    batch with a subclass among its results is built part by part (its to_json may say
    more than a row holds); one of plain results and text goes to the one-pass builder."""

    async def runner(call: ToolCall, ctx: Any) -> Any:
        n = int(call.id[1:])
        status = [Status.ok, Status.failed, Status.timed_out][n % 3]
        if not noted and n % 5 != 4:
            return ToolResult(call.id, call.name, status, f"plain {n} ✓", started=None, duration=0)
        if n % 5 == 0:
            return _Noted(call.id, call.name, status, f"noted {n} ✓", note={"n": n, "ü": [1.5, None]})
        if n % 5 == 1:
            return ToolResult(call.id, call.name, status, f"plain {n}", started=1.0 + n, duration=0.25)
        if n % 5 == 2:
            return _Noted(call.id, call.name, status, "odd note", note=float("nan"))
        if n % 5 == 3:
            return _Noted(call.id, call.name, status, "big note", note=2**70 if odd else 2**40)
        return f"text {n}"

    odd = False  # a note past 64 bits, which orjson refuses
    noted = True  # results that are subclasses
    rng = random.Random(4)
    path = tmp_path / "runner.jsonl"
    with _submitted(monkeypatch) as submitted:
        s = Dispatcher(_registry(), runner=runner).session("runner", record=path)
        for size in (15, 16, 17, 100, -15, -16):
            odd, noted = size == 17, size > 0
            s.new_run()
            await _dispatch_all(s, [_batch(["plain"], abs(size), rng)])
        s.close()
    assert _check_file(path, submitted, monkeypatch) == ["batch"] * 4 + ["rows", "encoded"]
    report = await replay(path, Dispatcher(_registry(), runner=runner))
    assert report.ok, report


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_large_batch_on_trio_is_written_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On trio too, a large batch's line is the general builder's bytes."""
    rng = random.Random(5)
    path = tmp_path / "trio.jsonl"
    with _submitted(monkeypatch) as submitted:
        s = _dispatcher().session("trio", record=path)
        await _dispatch_all(s, [_batch(["plain", "same", kind], 40, rng) for kind in _KINDS])
        s.close()
    assert "encoded" in _check_file(path, submitted, monkeypatch)


_SAFE_KINDS = [k for k in _KINDS if k not in ("naps", "big", "huge_args")]
# kinds that leave a batch to the one-pass builder (not an id that is no text, built part
# by part; run_tool's call is, its row naming the tool it was planned as)
_FAST_KINDS = ["plain", "same", "serial", "invalid", "boom", "force", "cached"]
_FAST_KINDS += ["plain_default", "nested", "numbers", "run_tool"]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kinds=st.lists(
        st.lists(st.sampled_from(_FAST_KINDS), min_size=14, max_size=40)
        | st.lists(st.sampled_from(_FAST_KINDS) | st.sampled_from(_SAFE_KINDS), min_size=1, max_size=40),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
    how=st.sampled_from(sorted(_OPTIONS)),
    ending=st.sampled_from(_ENDINGS),
)
def test_generated_batches_are_written_as_built_part_by_part(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    kinds: list[list[str]],
    seed: int,
    how: str,
    ending: str,
) -> None:
    """Generated batches of mixed kinds and sizes: each line is the general builder's bytes."""
    rng = random.Random(seed)
    path = tmp_path_factory.mktemp("gen") / "gen.jsonl"
    batches = [[_kind(k, i, rng) for i, k in enumerate(ks)] for ks in kinds]
    if ending:
        batches[-1].append(openai_call("end", ending, {}))

    async def main() -> None:
        s = _dispatcher().session("gen", record=path, **_OPTIONS[how])
        await _dispatch_all(s, batches)
        s.close()

    with _submitted(monkeypatch) as submitted:
        anyio.run(main, backend="asyncio")
    written = _check_file(path, submitted, monkeypatch, copied=how == "no_wait")
    if "encoded" in written:
        event("the one-pass builder took a batch and encoded its rows")
    if "rows" in written:
        event("the one-pass builder took a batch")


# --- the scan of a batch no rewriter touched ------------------------------------------------

_SLIPS = [
    '{"text": "a", "\\u0074oken": "%s"}',  # an escaped name
    '{"text": "a", "t\\u006fken": "%s"}',
    '{"text": "a", "TOKEN": "%s"}',
    '{"text": "a", "ᴛoken": "%s"}',  # small capital T: not a credential's word
    '{"text": "a", "\uff54\uff4f\uff4b\uff45\uff4e": "%s"}',  # full width
    '{"text": "a", "PASSWORD": "%s"}',
    '{"text": "a", "passwoRD": "%s"}',
    '{"text": "a", "pass\\u0077ord": "%s"}',
    '{"text": "a", "coo\u212aie": "%s"}',  # the Kelvin sign: lower() makes it "cookie"
    '{"text": "a", "COOKİE": "%s"}',  # dotted capital I
    '{"text": "a", "ﬀtoken": "%s"}',  # a ligature before the word
    '{"text": "a", "api_key": "%s", "api_key": "x"}',  # given twice: json keeps the last
    '{"text": "a", "api_key": "x", "api_key": "%s"}',
    '{"text": "a", "nested": {"secret": "%s"}}',
    '{"text": "https://user:%s@example.com/"}',
    '{"text": "https:\\/\\/user:%s@example.com\\/"}',
    '{"text": "see ?access_token=%s&x=1"}',
    '{"text": "a", "pin": 1, "password": "%s"}',
    '{"text": "a", "headers": [["Authorization", "Bearer %s"]]}',
    '{"text": "{\\"token\\": \\"%s\\"}"}',  # JSON inside text
    '{"text": "a=1&password=%s"}',  # a form
    '{"text": "a", "\\u0073ecret": "%s"}',
]


def _slip_batches(template: str, size: int) -> list[list[Any]]:
    raw = template % SECRET
    plain = [openai_call(f"p{i}", "echo", {"text": f"t{i}"}) for i in range(size - 1)]
    via_run_tool = json.dumps({"name": "echo", "args": json.loads(raw)})
    echo_back = json.loads(raw)
    echo_back["text"] = json.dumps(echo_back, ensure_ascii=False)  # the result echoes the secret
    return [
        [*plain, openai_call("s", "echo", raw)],
        [*plain, openai_call("r", "run_tool", via_run_tool)],
        [*plain, openai_call("f", "cached", {**json.loads(raw), "force": True})],
        [*plain, openai_call("e", "echo", json.dumps(echo_back, ensure_ascii=False))],
        [*plain, openai_call("a", "echo", json.dumps(echo_back))],
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the scan and the builders know no loop
@pytest.mark.parametrize("size", [1, 15, 16])  # a small batch, then either side of encoding rows as one
@pytest.mark.parametrize("template", _SLIPS)
async def test_no_credential_slips_past_the_scan_of_an_untouched_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, size: int
) -> None:
    """Whatever the arguments text hides a credential in, the file holds no secret that
    the arguments hold once parsed, and each line is the general builder's."""
    path = tmp_path / "slip.jsonl"
    with _submitted(monkeypatch) as submitted:
        s = _dispatcher().session("slip", record=path)
        for batch in _slip_batches(template, size):
            s.new_run()
            await _dispatch_all(s, [batch])
        s.close()
    _check_file(path, submitted, monkeypatch, hidden=False)
    raw = template % SECRET
    # the rule's verdict on the arguments as parsed, or on their text (a key given twice)
    hidden = SECRET in credential_values(json.loads(raw)) or SECRET in redact_json_text(raw)[1]
    if hidden or "api_key" in raw:  # a key given twice: its first value goes too
        assert SECRET not in path.read_text(encoding="utf-8", errors="replace"), raw


@pytest.mark.parametrize("size", [1, 16])
async def test_a_rewriter_that_adds_a_credential_is_scanned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """With a rewriter, pass 1's arguments are scanned too: one that adds a credential
    the calls' text never held keeps it out of the file (results echo it)."""

    def add_key(event: Any, state: Any) -> Any:
        args = {**event.args, "api_key": SECRET, "text": f"{event.args['text']} {SECRET}"}
        return {"tool_name": event.tool_name, "args": args}

    path = tmp_path / "rewritten.jsonl"
    with _submitted(monkeypatch) as submitted:
        s = Dispatcher(_registry(), rewriters=[add_key]).session("rw", record=path)
        await s.dispatch([openai_call(f"w{i}", "echo", {"text": f"t{i}"}) for i in range(size)])
        s.close()
    _check_file(path, submitted, monkeypatch)


async def test_a_large_batch_whose_run_number_orjson_refuses_is_encoded_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run number orjson cannot write keeps a large batch's rows a list: the line reads as
    the record built part by part."""
    with _submitted(monkeypatch) as submitted:
        s = _dispatcher().session("run", record=tmp_path / "run.jsonl")
        await s.dispatch([_oc(f"c{i}", "echo", {"text": f"t{i}"}) for i in range(20)])
        s.close()
    [parts] = submitted
    parts = (2**64, *parts[1:])  # the run number
    fast, plain = Recorder._record_of(*parts)
    assert plain and type(fast["rows"]) is list  # json writes the line: a list it can write
    expected = part_by_part(parts, monkeypatch)
    line = one_pass_line(fast, plain)
    assert not line.startswith(b'{"type":"rows"')  # json's, not orjson's, separators
    assert_reads_as(line, expected)


@pytest.mark.parametrize("ending", _ENDINGS[1:])
async def test_a_batch_cut_short_by_its_own_tool_replays(tmp_path: Path, ending: str) -> None:
    """A batch its own tool cut short (Ctrl-C, an interrupt) replays as recorded."""
    path = tmp_path / "cut.jsonl"
    s = _dispatcher().session("cut", record=path)
    await _dispatch_all(s, [_batch(["echo"], 3, random.Random(1), ending)])
    s.close()
    report = await replay(path, _dispatcher())
    assert report.ok, report


_PIECES = [
    "key", "KEY", "\u212aey", "to", "ken", "TO", "KEN", "\ufb00", "\u0131", "\u0130", "\u017f",
    "\uff54", "pass", "word", "s", "id", "://", "@", "%", "\\", "=", "&", "?", "Bearer ", "x",
    "\u00e9", "\u01c5", "1", " ", "/", "http", "code", "sig", "auth", "or",
]  # fmt: skip
_WORDS = st.lists(st.sampled_from(_PIECES), max_size=5).map("".join)
_VALUES = st.recursive(
    _WORDS | st.integers() | st.booleans() | st.none(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_WORDS, inner, max_size=3),
    max_leaves=8,
)


def _echo_all_registry() -> Registry:
    async def echo_all(args: Mapping[str, Any], ctx: Any) -> str:
        return json.dumps(args, ensure_ascii=False, sort_keys=True)  # echoes whatever it was given

    return Registry(
        [Tool("echo_all", "Echo.", echo_all, {"type": "object"}, concurrent=True, deferred=False)]
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=st.lists(st.dictionaries(_WORDS, _VALUES, max_size=4), min_size=1, max_size=4),
    ascii_only=st.booleans(),
    twice=st.booleans(),
    size=st.sampled_from([1, 16]),
)
def test_generated_arguments_text_is_recorded_as_the_general_builder_records_it(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    args: list[dict[str, Any]],
    ascii_only: bool,
    twice: bool,
    size: int,
) -> None:
    """Arguments text made of the pieces credentials are spotted by (and letters that fold
    to them), each echoed whole by its tool: whichever builder records the batch, and
    whatever the scan of the calls' text alone decides, the line is the general builder's."""
    texts = [json.dumps(a, ensure_ascii=ascii_only) for a in args]
    if twice:  # a key given twice: the first value is what json drops
        texts = [t[:-1] + (", " if len(t) > 2 else "") + t[1:] if t != "{}" else t for t in texts]
    batch = [openai_call(f"g{i}", "echo_all", texts[i % len(texts)]) for i in range(size)]
    batch = [{**c, "id": f"g{i}"} for i, c in enumerate(batch)]
    path = tmp_path_factory.mktemp("args") / "args.jsonl"

    async def main() -> None:
        s = Dispatcher(_echo_all_registry()).session("args", record=path)
        await s.dispatch(batch)
        s.close()

    with _submitted(monkeypatch) as submitted:
        anyio.run(main, backend="asyncio")
    _check_file(path, submitted, monkeypatch, hidden=False)


@pytest.mark.parametrize("size", [1, 16])
async def test_a_result_whose_status_is_text_is_recorded_as_the_general_builder_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A runner's result whose status is text, not a Status: no builder makes a line of it."""

    async def runner(call: ToolCall, ctx: Any) -> Any:
        return ToolResult(call.id, call.name, "ok", "from the runner")  # type: ignore[arg-type]

    with _submitted(monkeypatch) as submitted:
        s = Dispatcher(_registry(), runner=runner).session("text", record=tmp_path / "text.jsonl")
        await s.dispatch([_oc(f"c{i}", "echo", {"text": f"t{i}"}) for i in range(size)])
        s.close()
    [parts] = submitted
    with pytest.raises(AttributeError):  # the one-pass builders as the general one: no line
        Recorder._record_of(*parts)
    with pytest.raises(AttributeError):
        part_by_part(parts, monkeypatch)


@pytest.mark.parametrize("size", [15, 16, 40])
async def test_a_large_batch_a_gate_interrupts_then_resumed_is_written_as_built_part_by_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A gate asks about one call (nothing runs, the batch raises); the batch is sent again
    with the decisions (Allow with arguments, Deny, Answer), then a third time plain."""
    from dispatcher import Allow, Answer, Deny, Interrupt

    async def echo(args: Mapping[str, Any], ctx: Any) -> str:
        return json.dumps(dict(args), ensure_ascii=False)

    def gate(call: Any, ctx: Any) -> Any:
        return Interrupt("ask", {"why": "✓"}) if call.id == "c1" else Allow()

    registry = Registry(
        [
            Tool("echo", "Echo.", echo, TEXT_SCHEMA, concurrent=True, deferred=False),
            Tool("asked", "Asked.", echo, {"type": "object"}, concurrent=True, deferred=False, confirm=True),
        ]
    )
    path = tmp_path / "gate.jsonl"
    batch = [_oc(f"c{i}", "asked" if i < 4 else "echo", {"text": f"t{i} ✓"}) for i in range(size)]
    with _submitted(monkeypatch) as submitted:
        s = Dispatcher(registry, gate=gate).session("gate", record=path)
        with pytest.raises(DispatchInterrupted):
            await s.dispatch(batch)
        decisions = {
            "c0": Allow(args={"text": "a", "api_key": SECRET}),
            "c1": Deny("no ✓"),
            "c2": Answer(f"answered {SECRET}"),
        }
        await s.dispatch(batch, decisions=decisions)
        s.new_run()
        await s.dispatch([c for c in batch if c["function"]["name"] == "echo"])
        s.close()
    _check_file(path, submitted, monkeypatch)
