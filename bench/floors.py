"""threepass against two honest floors, and what recording and replay cost.

Every system here is fed the same batch of OpenAI-style calls (`tool_calls` items with
JSON argument text), and rounds alternate system by system on one trio loop, so a slow
spell of the shared machine falls on all of them alike. The floors run no per-call task:
each tool is awaited in turn.

- **lean floor**: `json.loads` of the arguments, `json.dumps(sort_keys=True)`,
  xxh3-128 of name and canonical JSON, jsonschema's compiled Draft 2020-12 `is_valid`;
- **physical floor**: `orjson.loads`, `orjson.dumps(OPT_SORT_KEYS)`, xxh3-128,
  jsonschema-rs `is_valid`;
- **floor**: today's floor (bench/workloads.py `FloorRunner`: one trio task per call),
  kept for continuity on the echo workload, in rounds of its own against threepass (its
  tasks' garbage would otherwise land in the other systems' rounds).

Two workloads: `echo` (one string property, the harness's echo) and `realistic` (a tool
schema of five properties, a nested object, an enum and required ones). Then threepass
with a recording and without (batch 1 and 100; the default recording, whose batches wait
for their line, and `record_wait=False`; beside them the line floor, the least a batch
that waits for its line can pay), the fixed cost of a batch (per call at
batch 1 less per call at batch 100, in rounds that alternate the two sizes), and replay
of a recording (the file read and its chain checked) against live dispatch of the same
batches, beside the replay floor, the least a replay that reads the file pays.

    python -m bench.floors [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema_rs
import orjson
import trio
import xxhash

from dispatcher import Dispatcher, Registry, Tool, ToolResult
from dispatcher._plan import PlannedCall
from dispatcher._recording import line_hash, replay
from dispatcher._session import Session

from .workloads import Call, FloorRunner, Goal, Toolbox

ECHO = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
REALISTIC = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 1, "description": "The file to open."},
        "mode": {"type": "string", "enum": ["read", "write", "append"]},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100_000},
        "encoding": {"type": "string", "default": "utf-8"},
        "options": {
            "type": "object",
            "properties": {
                "recursive": {"type": "boolean"},
                "depth": {"type": "integer", "minimum": 0, "maximum": 32},
            },
            "required": ["recursive"],
            "additionalProperties": False,
        },
    },
    "required": ["path", "mode", "options"],
    "additionalProperties": False,
}
SCHEMAS = {"echo": ECHO, "open_file": REALISTIC}
WORKLOADS = {"echo": "echo", "realistic": "open_file"}

# Goals (issue 11), each a ratio measured in one run.
PHYSICAL_GOAL = 8.0  # threepass per call at batch 100, at most this times the physical floor
LEAN_GOAL = 1.0  # ... and at most this times the lean floor (echo)
FIXED_GOAL_US = 15.0  # batch 1: per call at batch 1 less per call at batch 100
RECORDING_GOALS = {100: 1.10, 1: 1.25}  # recording on / off
REPLAY_GOAL = 1.0  # replay / live dispatch of the same batches: under this


def _arguments(tool: str, r: int, i: int) -> dict[str, Any]:
    if tool == "echo":
        return {"text": f"r{r}-{i}"}
    return {
        "path": f"/src/pkg{r}/module_{i}.py",
        "mode": "read",
        "limit": 100 + i,
        "encoding": "utf-8",
        "options": {"recursive": i % 2 == 0, "depth": 2},
    }


def batch(tool: str, size: int, r: int) -> list[dict[str, Any]]:
    """`size` OpenAI chat `tool_calls` items for `tool`, unique to round `r`."""
    return [
        {
            "id": f"call_{r}_{i}",
            "type": "function",
            "function": {"name": tool, "arguments": json.dumps(_arguments(tool, r, i))},
        }
        for i in range(size)
    ]


async def _echo(args: Mapping[str, Any], ctx: Any = None) -> str:
    return str(args["text"])


async def _open_file(args: Mapping[str, Any], ctx: Any = None) -> str:
    return str(args["path"])


HANDLERS = {"echo": _echo, "open_file": _open_file}


class LeanFloor:
    """json + xxh3-128 + jsonschema's compiled validator; each tool awaited in turn."""

    def __init__(self) -> None:
        self._tools = {
            name: (HANDLERS[name], jsonschema.Draft202012Validator(schema))
            for name, schema in SCHEMAS.items()
        }

    async def run_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str]:
        out = []
        for call in calls:
            fn = call["function"]
            name = fn["name"]
            args = json.loads(fn["arguments"])
            canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            xxhash.xxh3_128_digest(f"{name}\x00{canonical}".encode())
            handler, validator = self._tools[name]
            if not validator.is_valid(args):
                raise ValueError(f"invalid arguments for {name}")
            out.append(await handler(args))
        return out


class PhysicalFloor:
    """orjson + xxh3-128 + jsonschema-rs; each tool awaited in turn."""

    def __init__(self) -> None:
        self._tools = {
            name: (HANDLERS[name], jsonschema_rs.Draft202012Validator(schema, validate_formats=False))
            for name, schema in SCHEMAS.items()
        }

    async def run_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str]:
        out = []
        for call in calls:
            fn = call["function"]
            name = fn["name"]
            args = orjson.loads(fn["arguments"])
            canonical = orjson.dumps(args, option=orjson.OPT_SORT_KEYS)
            xxhash.xxh3_128_digest(name.encode() + b"\x00" + canonical)
            handler, validator = self._tools[name]
            if not validator.is_valid(args):
                raise ValueError(f"invalid arguments for {name}")
            out.append(await handler(args))
        return out


def _registry() -> Registry:
    return Registry(
        [
            Tool(name, f"The {name} tool.", HANDLERS[name], schema, concurrent=True, deferred=False)
            for name, schema in SCHEMAS.items()
        ]
    )


class Threepass:
    """One session; each batch a new run (nothing deduped across batches). `wait=False`: a
    recording whose batches return once their line is handed to its writer."""

    def __init__(self, record: Path | None = None, session: str = "bench", *, wait: bool = True) -> None:
        self.dispatcher = Dispatcher(_registry())
        self.session = self.dispatcher.session(session, mode="direct", record=record, record_wait=wait)

    async def run_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str]:
        self.session.new_run()
        return [r.content for r in await self.session.dispatch(list(calls))]

    def flush(self) -> None:
        """Every batch's line in the file (`Recorder.flush`), if the session records."""
        if self.session.recorder is not None:
            self.session.recorder.flush()


_NO_KEY = "0" * 32  # a call's key in the line floor's rows: its length, not its making


class LineFloor:
    """A session without a recording, then, after each batch, the least that a recording
    whose batches wait for their line does on the loop: the rows record of the batch (its
    fields as `_common_rows` writes them, each call's key written as 32 zeros, since the
    dispatcher made it already) encoded with orjson, the xxh3-64 of the line that chains
    the next one, one `fstat` that finds the file still named, and one `write`. No check,
    no credential scan, no lock: what no waited line can do without. `written=False`: the
    same without the `fstat` and the `write`, so that the difference between the two is
    what those system calls cost where they are made, their effect on the code after them
    included."""

    def __init__(self, path: Path, *, written: bool = True) -> None:
        self._three = Threepass(session="line-floor")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._seq, self._prev = 0, ""
        self._written = written

    async def run_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str]:
        session = self._three.session
        session.new_run()
        results = await session.dispatch(list(calls))
        rows = []
        for call, r in zip(calls, results, strict=True):
            fn = call["function"]
            row = [call["id"], fn["name"], fn["arguments"], _NO_KEY, "ran", r.status, r.content]
            row += (r.retryable, r.effect_uncertain, r.cached, r.deduped, r.started, r.duration)
            rows.append(row)
        self._seq += 1
        record = {
            "type": "rows",
            "run": session.run_id,
            "round": 1,
            "all_loaded": False,
            "rows": rows,
            "control": None,
            "seq": self._seq,
            "prev": self._prev,
        }
        line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        self._prev = line_hash(memoryview(line)[:-1])  # the chain's hash, as the recorder takes it
        if self._written and os.fstat(self._fd).st_nlink:
            os.write(self._fd, line)
        return [r.content for r in results]

    def flush(self) -> None:
        """Nothing: each line is written as its batch returns."""

    def close(self) -> None:
        os.close(self._fd)


class TodaysFloor:
    """bench/workloads.py's floor (a trio task per call), fed the same calls."""

    def __init__(self) -> None:
        self._floor = FloorRunner()

    async def setup(self) -> None:
        await self._floor.setup(Toolbox.for_loop("trio"))

    async def run_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str]:
        made = [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return await self._floor.run_batch(made)


Runner = Callable[[Sequence[Mapping[str, Any]]], Awaitable[list[str]]]


async def _interleaved(
    runners: Mapping[str, Runner], tool: str, size: int, rounds: int, warmup: int = 10
) -> dict[str, float]:
    """Median µs per call of each runner, rounds alternating runner by runner (the order
    rotating each round), over the same batch."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds + warmup):
        calls = batch(tool, size, r)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            outputs = await runners[name](calls)
            elapsed = time.perf_counter() - t0
            if len(outputs) != size:
                raise AssertionError(f"{name}: {size} calls gave {len(outputs)} outputs")
            if r >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(t) / size * 1e6 for name, t in times.items()}


async def fixed_cost(quick: bool) -> dict[str, float]:
    """threepass's fixed cost of a batch, echo: per call at batch 1 less per call at batch
    100, from rounds that alternate the sizes (a batch of 100, `_SMALL_PER_ROUND` batches of
    1 and as many of 2, the order turning each round) on one session, so that a slow spell
    of the machine weighs on all alike; medians of each. Beside it, a concurrent group's:
    a batch of 2 less two calls at batch 100."""
    three = Threepass()
    times: dict[int, list[float]] = {1: [], 2: [], 100: []}
    warmup = 3
    for r in range(_rounds(100, quick) + warmup):
        for size in (1, 2, 100) if r % 2 else (100, 2, 1):
            for k in range(1 if size == 100 else _SMALL_PER_ROUND):
                calls = batch("echo", size, r * _SMALL_PER_ROUND + k)
                t0 = time.perf_counter()
                outputs = await three.run_batch(calls)
                elapsed = time.perf_counter() - t0
                if len(outputs) != size:
                    raise AssertionError(f"{size} calls gave {len(outputs)} outputs")
                if r >= warmup:
                    times[size].append(elapsed / size)
    one, two, hundred = (statistics.median(times[size]) * 1e6 for size in (1, 2, 100))
    return {
        "batch_1": one,
        "batch_2": two,
        "batch_100": hundred,
        "fixed_us": one - hundred,
        "group_fixed_us": 2 * (two - hundred),
    }


_SMALL_PER_ROUND = 20  # batches of 1 (and of 2) in each round of `fixed_cost`, beside one of 100


def _rounds(size: int, quick: bool) -> int:
    full = {1: 1500, 10: 300, 100: 80}[size]
    return full // 10 if quick else full


async def per_call(quick: bool) -> dict[str, Any]:
    """µs per call of threepass and the floors, each workload at batch 1, 10 and 100."""
    today = TodaysFloor()
    await today.setup()
    lean, physical, three = LeanFloor(), PhysicalFloor(), Threepass()
    out: dict[str, Any] = {}
    for workload, tool in WORKLOADS.items():
        runners: dict[str, Runner] = {
            "threepass": three.run_batch,
            "lean": lean.run_batch,
            "physical": physical.run_batch,
        }
        figures: dict[str, Any] = {}
        for size in (1, 10, 100):
            figures[str(size)] = await _interleaved(runners, tool, size, _rounds(size, quick))
            if workload == "echo":
                # today's floor starts a trio task per call: in rounds of its own against
                # threepass, so that its tasks' garbage and scheduling do not fall in the
                # rounds of the systems compared above (it costs them a fifth at batch 1)
                apart = await _interleaved(
                    {"threepass": three.run_batch, "floor": today.run_batch}, tool, size, _rounds(size, quick)
                )
                figures[str(size)]["floor"] = apart["floor"]
        out[workload] = figures
    return out


async def _blocks(
    runners: Mapping[str, tuple[Runner, Callable[[], None]]], size: int, blocks: int, per_block: int
) -> dict[str, float]:
    """Median µs per call of each runner over `blocks` blocks of `per_block` batches (echo),
    each block timed whole with the runner's flush at its end (every line in the file),
    blocks alternating runner by runner (the order turning each round) after one untimed
    block each."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for b in range(blocks + 1):
        order = names[b % len(names) :] + names[: b % len(names)]
        for name in order:
            run, flush = runners[name]
            made = [batch("echo", size, b * per_block + k) for k in range(per_block)]
            t0 = time.perf_counter()
            for calls in made:
                if len(await run(calls)) != size:
                    raise AssertionError(f"{name}: a batch of {size} lost calls")
            flush()
            elapsed = time.perf_counter() - t0
            if b:
                times[name].append(elapsed / (per_block * size))
            # untimed: a writer thread that looks a while after its batches (`record_wait=False`)
            # is done looking before the next system's block, where it would wait for the GIL
            await trio.sleep(_BETWEEN_BLOCKS)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


_RECORDING_BLOCKS = {1: (9, 300), 100: (9, 16)}  # (blocks, batches in each) per batch size
_BETWEEN_BLOCKS = 0.03  # seconds between two blocks of `_blocks`


async def recording(quick: bool, folder: Path) -> dict[str, Any]:
    """threepass with a recording against threepass without, µs per call, batch 1 and 100:
    `on` as a session records by default (each batch returns once its line is in the
    file), `handed` with `record_wait=False` (once its record's parts are kept; the records
    of a few milliseconds are made and written together), and the line floor. Timed in blocks of batches
    that end once every line is in the file, so that what a writer does after a batch
    returned counts too."""
    off = Threepass(session="off")
    on = Threepass(record=folder / "on.jsonl", session="on")
    floor = LineFloor(folder / "floor.jsonl")
    unwritten = LineFloor(folder / "unwritten.jsonl", written=False)
    handed = Threepass(record=folder / "handed.jsonl", session="handed", wait=False)
    out = {}
    for size in (1, 100):
        blocks, per_block = _RECORDING_BLOCKS[size]
        if quick:
            blocks = max(3, blocks // 5)
        got = await _blocks(
            {
                "off": (off.run_batch, off.flush),
                "on": (on.run_batch, on.flush),
                "floor": (floor.run_batch, floor.flush),
                "unwritten": (unwritten.run_batch, unwritten.flush),
                "handed": (handed.run_batch, handed.flush),
            },
            size,
            blocks,
            per_block,
        )
        out[str(size)] = {
            **got,
            "ratio": got["on"] / got["off"],
            "floor_ratio": got["floor"] / got["off"],
            "unwritten_ratio": got["unwritten"] / got["off"],
            "handed_ratio": got["handed"] / got["off"],
            "blocks": blocks,
            "per_block": per_block,
        }
    on.session.close()
    handed.session.close()
    floor.close()
    unwritten.close()
    return out


class _HandedAtOnce:
    """Pass 2's runner of the replay floor: each call's result, made beforehand, handed back
    at once (`serve_now`, as replay's runner hands a recorded one)."""

    def __init__(self, results: Sequence[ToolResult]) -> None:
        self._results = results

    def serve_now(self, planned: PlannedCall) -> ToolResult:
        return self._results[planned.index]

    async def __call__(self, planned: PlannedCall, ctx: Any) -> ToolResult:
        return self._results[planned.index]


def _read_and_hashed(path: Path) -> None:
    """Every line of the recording at `path` read as orjson reads it, and hashed."""
    for line in path.read_bytes().split(b"\n")[:-1]:
        orjson.loads(line)
        line_hash(line)


async def _replay_floor(
    path: Path, batches: Sequence[Sequence[Mapping[str, Any]]], results: Sequence[Sequence[ToolResult]]
) -> float:
    """Seconds the replay floor takes: every line of the recording at `path` read (orjson)
    and hashed, then passes 1 and 3 of each batch in a session of its own, each call's
    result handed to pass 2 at once (`_HandedAtOnce`, made before the clock starts)."""
    dispatcher = Dispatcher(_registry())
    handed = [(list(b), _HandedAtOnce(r)) for b, r in zip(batches, results, strict=True)]
    t0 = time.perf_counter()
    _read_and_hashed(path)
    session = Session(dispatcher, "replay-floor", mode="direct", kept=False)
    for calls, runner in handed:
        session.new_run()
        await session._dispatch(calls, decisions=None, all_loaded=False, runner=runner)
    session.close()
    return time.perf_counter() - t0


async def replaying(quick: bool, folder: Path) -> dict[str, Any]:
    """Replay of a recording of batches against live dispatch of the same batches, and the
    replay floor (`_replay_floor`): the median of several rounds of each, alternating, so
    one slow spell does not decide."""
    batches = [
        batch(tool, size, r) for r in range(10 if quick else 40) for tool in SCHEMAS for size in (1, 10)
    ]
    calls = sum(len(b) for b in batches)
    path = folder / "replay.jsonl"
    recorded = Threepass(record=path, session="recorded")
    results = []
    for b in batches:
        recorded.session.new_run()
        results.append(await recorded.session.dispatch(list(b)))
    recorded.session.close()
    live_times, replay_times, floor_times = [], [], []
    for n in range(3 if quick else 15):
        live = Threepass(session=f"live{n}")
        t0 = time.perf_counter()
        for b in batches:
            await live.run_batch(b)
        live_times.append(time.perf_counter() - t0)
        live.session.close()
        dispatcher = Dispatcher(_registry())
        t0 = time.perf_counter()
        report = await replay(path, dispatcher)
        replay_times.append(time.perf_counter() - t0)
        if not report.ok or report.calls != calls:
            raise AssertionError(f"replay did not match: {report}")
        floor_times.append(await _replay_floor(path, batches, results))
    live_s, replay_s = statistics.median(live_times), statistics.median(replay_times)
    floor_s = statistics.median(floor_times)
    return {
        "batches": len(batches),
        "calls": calls,
        "live_s": live_s,
        "replay_s": replay_s,
        "floor_s": floor_s,
        "ratio": replay_s / live_s,
        "floor_ratio": floor_s / live_s,
        "replay_calls_per_s": calls / replay_s,
        "live_calls_per_s": calls / live_s,
    }


async def per_request(quick: bool) -> dict[str, Any]:
    """A dispatcher made for one request (the registry made once): making it and its
    session, and its first batch of one call, against a batch of one on a session that
    lives on; medians of rounds that alternate."""
    registry = _registry()
    kept = Threepass(session="kept")
    made, first, again = [], [], []
    for r in range(30 if quick else 300):
        calls = batch("echo", 1, r)
        t0 = time.perf_counter()
        fresh = Dispatcher(registry)
        session = fresh.session("request", mode="direct")
        t1 = time.perf_counter()
        await session.dispatch(list(calls))
        t2 = time.perf_counter()
        session.close()
        await kept.run_batch(calls)
        t3 = time.perf_counter()
        made.append(t1 - t0)
        first.append(t2 - t1)
        again.append(t3 - t2)
    return {
        "make_us": statistics.median(made) * 1e6,
        "first_us": statistics.median(first) * 1e6,
        "kept_us": statistics.median(again) * 1e6,
    }


async def measure(quick: bool = False) -> dict[str, Any]:
    """Every figure above, in one trio run: ``trio.run(measure, quick)``."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        return {
            "per_call": await per_call(quick),
            "fixed": await fixed_cost(quick),
            "recording": await recording(quick, folder),
            "replay": await replaying(quick, folder),
            "per_request": await per_request(quick),
        }


def render(figures: Mapping[str, Any]) -> str:
    lines = [
        "| workload | batch | threepass µs/call | lean floor | physical floor | floor (tasks) | "
        "threepass / lean | threepass / physical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, sizes in figures["per_call"].items():
        for size, row in sizes.items():
            today = f"{row['floor']:.1f}" if "floor" in row else "\N{EN DASH}"
            three, lean, physical = row["threepass"], row["lean"], row["physical"]
            lines.append(
                f"| {workload} | {size} | {three:.1f} | {lean:.1f} | {physical:.2f} | {today} | "
                f"{three / lean:.2f}x | {three / physical:.1f}x |"
            )
    rec = figures["recording"]
    lines += [
        "",
        "| recording, echo | batch | blocks x batches | off µs/call | on µs/call | on / off | "
        "line floor µs/call | line floor / off | without its fstat and write / off | "
        "on, wait=False | wait=False / off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| | {size} | {row['blocks']} x {row['per_block']} | {row['off']:.1f} | {row['on']:.1f} | "
            f"{row['ratio']:.2f}x | {row['floor']:.1f} | {row['floor_ratio']:.2f}x | "
            f"{row['unwritten_ratio']:.2f}x | {row['handed']:.1f} | {row['handed_ratio']:.2f}x |"
            for size, row in rec.items()
        ),
        "",
        "On: the default, each batch returns once its line is in the file (built and written on",
        "the loop's thread once the file is open; its writer thread opens the file and takes",
        "over from a disk that stalls). wait=False (`record_wait=False`): a batch returns once",
        "what its record is made of is kept, and the records of a few milliseconds are made in one",
        "pass and written together with one `write`. The line floor: the same session without a",
        "recording, then the batch's rows line encoded with orjson, hashed, the file found still",
        "named (`fstat`) and the line written (`write`), on the loop: what any recording whose",
        "batches wait for their line pays; beside it, the same without the `fstat` and the",
        "`write`, whose difference is what those two system calls cost where they are made, their",
        "effect on the code that runs after them included. Each figure is the median, over",
        "blocks of batches of one system (the systems taking turns block by block), of a block's",
        "time per call, the time until every line of the block is in the file (`Recorder.flush`)",
        "included: what a writer does after a batch returned counts too. A mean over a block",
        "counts the slow batches a median of single batches leaves out.",
    ]
    rp = figures["replay"]
    lines += [
        "",
        f"Replay of a recording of {rp['batches']} batches ({rp['calls']} calls, echo and realistic, "
        f"batch 1 and 10), the file read and its chain checked: {rp['replay_s'] * 1e3:.1f} ms, "
        f"{rp['replay_calls_per_s']:,.0f} calls/s; live dispatch of the same batches "
        f"{rp['live_s'] * 1e3:.1f} ms ({rp['live_calls_per_s']:,.0f} calls/s); replay / live "
        f"{rp['ratio']:.2f}x. The replay floor {rp['floor_s'] * 1e3:.1f} ms ({rp['floor_ratio']:.2f}x "
        "live): every line read (orjson) and hashed, then passes 1 and 3 of each batch, each "
        "call's result handed to pass 2 at once, made beforehand: what any replay that reads "
        "the file and runs the passes again pays, without checking a line or making a result "
        "of it.",
    ]
    fx = figures["fixed"]
    lines += [
        "",
        f"The fixed cost of a batch (echo), from rounds that alternate a batch of 100 with "
        f"{_SMALL_PER_ROUND} batches of 1 and as many of 2 on one session: {fx['batch_1']:.1f} µs "
        f"per call at batch 1, {fx['batch_100']:.1f} at batch 100, {fx['fixed_us']:.1f} µs between "
        f"them. A concurrent group's: a batch of 2 {2 * fx['batch_2']:.1f} µs, "
        f"{fx['group_fixed_us']:.1f} µs above two calls at batch 100.",
    ]
    pr = figures["per_request"]
    lines += [
        "",
        f"A dispatcher made per request (its registry made once): `Dispatcher(registry)` and its "
        f"session {pr['make_us']:.0f} µs, its first batch of one call {pr['first_us']:.0f} µs, "
        f"against {pr['kept_us']:.0f} µs for a batch of one on a session that lives on (the "
        "loop's block watch is shared by its dispatchers, so a new one starts no thread).",
    ]
    return "\n".join(lines)


def fixed_cost_us(figures: Mapping[str, Any]) -> float:
    """threepass's fixed cost of a batch: per call at batch 1 less per call at batch 100
    (echo), from `fixed_cost`'s alternating rounds."""
    return float(figures["fixed"]["fixed_us"])


def goals(figures: Mapping[str, Any]) -> list[Goal]:
    """Issue 11's goals that this module measures."""
    found = []
    for workload, sizes in figures["per_call"].items():
        row = sizes["100"]
        physical = row["threepass"] / row["physical"]
        found.append(
            Goal(
                f"threepass / physical floor per call at batch 100, {workload} schema",
                f"{physical:.1f}x",
                f"at most {PHYSICAL_GOAL:.0f}x",
                physical <= PHYSICAL_GOAL,
            )
        )
        if workload == "echo":
            lean = row["threepass"] / row["lean"]
            found.append(
                Goal(
                    "threepass / lean floor per call at batch 100, echo schema",
                    f"{lean:.2f}x",
                    f"at most {LEAN_GOAL:.1f}x",
                    lean <= LEAN_GOAL,
                )
            )
    fixed = fixed_cost_us(figures)
    found.append(
        Goal(
            "threepass's fixed cost of a batch: per call at batch 1 less per call at batch 100 (echo)",
            f"{fixed:.1f} µs",
            f"at most {FIXED_GOAL_US:.0f} µs",
            fixed <= FIXED_GOAL_US,
        )
    )
    for size, row in figures["recording"].items():
        target = RECORDING_GOALS[int(size)]
        found.append(
            Goal(
                f"recording on / off per call at batch {size} (a batch waits for its line, the default)",
                f"{row['ratio']:.2f}x (the line floor: {row['floor_ratio']:.2f}x, "
                f"{row['unwritten_ratio']:.2f}x without its fstat and write)",
                f"at most {target:.2f}x",
                row["ratio"] <= target,
            )
        )
        if "handed_ratio" in row:
            found.append(
                Goal(
                    f"recording on / off per call at batch {size}, record_wait=False (records gathered)",
                    f"{row['handed_ratio']:.2f}x",
                    f"at most {target:.2f}x",
                    row["handed_ratio"] <= target,
                )
            )
    rp = figures["replay"]
    found.append(
        Goal(
            f"replay / live dispatch of the same batches ({rp['replay_calls_per_s']:,.0f} calls/s replayed)",
            f"{rp['ratio']:.2f}x (the replay floor: {rp['floor_ratio']:.2f}x)",
            f"under {REPLAY_GOAL:.1f}x",
            rp["ratio"] < REPLAY_GOAL,
        )
    )
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    result = trio.run(measure, ns.quick)
    if ns.json:
        print(json.dumps(result, indent=1))
    else:
        print(render(result), "", "Against the goals:", "", *(g.render() for g in goals(result)), sep="\n")
