"""Workloads, tools and timing helpers shared by every system the benchmark compares.

Every system (threepass, each agent framework, and the ``floor`` baseline) is driven
through one small protocol, :class:`BatchRunner`: ``setup(toolbox)`` once, then
``run_batch(calls)`` once per assistant message. A ``run_batch`` is one *run*: the
scripted model emits the batch, the system executes it, and the model answers. That is
what a peer's ``Runner.run`` / ``agent.run`` / ``graph.ainvoke`` does, so the timings of
all systems cover the same unit of work.

The measurement coroutines here await nothing but the runner and read only
``time.perf_counter_ns`` (wall) and ``time.process_time_ns`` (CPU), so they run
unchanged under ``asyncio.run`` (the peers) and ``trio.run`` (threepass and the floor).
:func:`measure_system` picks the loop from ``runner.loop``; each system gets its own
event loop, one after another, in one process. Memory is measured in a fresh child
process per system (``python -m bench.workloads memory MODULE:FACTORY``) so that peaks
do not mix.

The workloads:

1. ``overhead``: trivial ``echo`` batches of 1, 10 and 100 calls; median microseconds
   per call (wall and CPU), the fixed cost of a run with no tool call at all, and a
   line fitted through the three batch sizes.
2. ``concurrency``: 16 calls of ``nap(ms=100)`` (labelled apart, so a system that
   runs a repeated call once still runs all 16); wall time and most calls in flight.
3. ``repetition``: 20 ``echo`` calls, half of them repeats of the other half (same tool,
   same arguments); executions made and time per batch.
4. ``mixed``: ``read_note(a), read_note(b), edit_note(a, "new"), read_note(a)`` in one
   batch; does the last read see the edit?
5. ``memory``: RSS growth over 10,000 ``echo`` calls (100 batches of 100) through one
   runner: ``ru_maxrss`` before and after, and the resident size sampled after each batch.

The ``floor`` (:class:`FloorRunner`) is the least work any dispatcher must do per call:
parse the JSON arguments, hash name and canonical arguments with xxh3-128, validate
with a compiled JSON Schema 2020-12 validator, and run one trio task per call in a
nursery. Every system's overhead is read against it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import trio
import xxhash
from jsonschema import Draft202012Validator

LoopName = Literal["asyncio", "trio"]

#: Simulated I/O latency of one note-store operation, in seconds. ``edit_note`` is a
#: read-modify-write (two operations, like an editor's read-replace-write of a file);
#: ``read_note`` is one. The store itself is an in-memory dict.
NOTE_IO_S = 0.001

#: Batch sizes of the overhead workload.
OVERHEAD_SIZES: tuple[int, ...] = (1, 10, 100)

_REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- calls


@dataclass(frozen=True, slots=True)
class Call:
    """One tool call as a model emits it: an id, a tool name and JSON argument text."""

    id: str
    name: str
    arguments: str

    @classmethod
    def make(cls, call_id: str, name: str, args: Mapping[str, Any]) -> Call:
        """Build a call from a dict of arguments (serialised as a model would send them)."""
        return cls(call_id, name, json.dumps(args))

    def as_openai_chat(self) -> dict[str, Any]:
        """The call as an OpenAI chat ``tool_calls`` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def echo_batch(size: int, tag: str) -> list[Call]:
    """``size`` echo calls whose texts are unique to ``tag`` (so nothing repeats)."""
    return [Call.make(f"call_{tag}_{i}", "echo", {"text": f"{tag}-{i}"}) for i in range(size)]


def repetition_batch(tag: str, size: int = 20) -> list[Call]:
    """``size`` echo calls over ``size // 2`` distinct texts: each text appears twice."""
    distinct = size // 2
    return [Call.make(f"call_{tag}_{i}", "echo", {"text": f"{tag}-k{i % distinct}"}) for i in range(size)]


def nap_batch(size: int = 16, ms: int = 100) -> list[Call]:
    """``size`` calls of ``nap(ms)``, each with its own label so none repeats another."""
    return [Call.make(f"call_nap_{i}", "nap", {"ms": ms, "label": f"n{i}"}) for i in range(size)]


def mixed_batch() -> list[Call]:
    """Read a, read b, edit a to "new", read a: program order says the last read sees "new"."""
    return [
        Call.make("call_read_a1", "read_note", {"path": "a"}),
        Call.make("call_read_b", "read_note", {"path": "b"}),
        Call.make("call_edit_a", "edit_note", {"path": "a", "text": "new"}),
        Call.make("call_read_a2", "read_note", {"path": "a"}),
    ]


# --------------------------------------------------------------------------- tools

ToolFn = Callable[..., Awaitable[str]]
ResourceFn = Callable[[Mapping[str, Any]], set[str]]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool defined once for every system.

    ``fn`` is a plain async function with typed keyword parameters and a docstring (what
    the frameworks build their own schemas from); ``parameters`` is the JSON Schema for
    systems that take one. ``concurrent``, ``reads`` and ``writes`` describe effects for
    systems that can use them (resource keys look like ``file:/notes/a``).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn
    concurrent: bool = True
    reads: ResourceFn | None = None
    writes: ResourceFn | None = None


def _note_key(args: Mapping[str, Any]) -> set[str]:
    return {f"file:/notes/{args['path']}"}


def _object_schema(properties: dict[str, Any], required: Sequence[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


class Toolbox:
    """The benchmark's tools and their counters, bound to one event loop's ``sleep``.

    Counters: ``executions[name]`` counts every time a tool body ran; ``in_flight`` and
    ``max_in_flight`` track ``nap`` calls running at once. ``notes`` is the note store;
    each of its operations awaits ``note_io_s`` seconds first (none at all when 0, so
    the store is then plain synchronous code inside an async function).
    """

    def __init__(self, sleep: Callable[[float], Awaitable[object]]) -> None:
        self.note_io_s = NOTE_IO_S
        self.executions: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.notes: dict[str, str] = {}
        self.reset()

        async def echo(text: str) -> str:
            """Return the text unchanged."""
            self.executions["echo"] += 1
            return text

        async def nap(ms: int, label: str = "") -> str:
            """Sleep for ms milliseconds, then say so; label only tells calls apart."""
            self.executions["nap"] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await sleep(ms / 1000)
            finally:
                self.in_flight -= 1
            return f"{label} slept {ms} ms".lstrip()

        async def read_note(path: str) -> str:
            """Return the text of the note at path (empty if there is none)."""
            self.executions["read_note"] += 1
            if self.note_io_s:
                await sleep(self.note_io_s)
            return self.notes.get(path, "")

        async def edit_note(path: str, text: str) -> str:
            """Replace the text of the note at path."""
            self.executions["edit_note"] += 1
            if self.note_io_s:
                await sleep(self.note_io_s)  # read the current note
                await sleep(self.note_io_s)  # write the new one
            self.notes[path] = text
            return f"edited {path}"

        self.specs: tuple[ToolSpec, ...] = (
            ToolSpec(
                "echo",
                "Return the text unchanged.",
                _object_schema({"text": {"type": "string"}}),
                echo,
            ),
            ToolSpec(
                "nap",
                "Sleep for ms milliseconds, then say so; label only tells calls apart.",
                _object_schema(
                    {
                        "ms": {"type": "integer", "minimum": 0, "maximum": 60_000},
                        "label": {"type": "string", "default": ""},
                    },
                    required=["ms"],
                ),
                nap,
            ),
            ToolSpec(
                "read_note",
                "Return the text of the note at path (empty if there is none).",
                _object_schema({"path": {"type": "string"}}),
                read_note,
                reads=_note_key,
            ),
            ToolSpec(
                "edit_note",
                "Replace the text of the note at path.",
                _object_schema({"path": {"type": "string"}, "text": {"type": "string"}}),
                edit_note,
                reads=_note_key,
                writes=_note_key,
            ),
        )

    @classmethod
    def for_loop(cls, loop: LoopName) -> Toolbox:
        """A toolbox whose ``nap`` and note I/O sleep on the given event loop."""
        return cls(asyncio.sleep if loop == "asyncio" else trio.sleep)

    def functions(self) -> list[ToolFn]:
        """The tools as plain async functions, in a fixed order."""
        return [spec.fn for spec in self.specs]

    def spec(self, name: str) -> ToolSpec:
        """The spec of the tool called ``name``."""
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def reset(self) -> None:
        """Zero the counters and restore the note store to ``{a: "old a", b: "old b"}``."""
        self.note_io_s = NOTE_IO_S
        self.executions.clear()
        self.in_flight = 0
        self.max_in_flight = 0
        self.notes.clear()
        self.notes.update({"a": "old a", "b": "old b"})


# --------------------------------------------------------------------------- runners


class BatchRunner(Protocol):
    """What the harness drives. One instance per workload; ``setup`` is called once.

    ``run_batch`` is one run of one assistant message: the system receives ``calls``
    (with JSON argument text), executes them, and returns each call's tool output as a
    string, in call order. ``run_batch([])`` is a run whose model answers at once; its
    time is the system's fixed cost per run.
    """

    name: str
    loop: LoopName

    async def setup(self, toolbox: Toolbox) -> None: ...

    async def run_batch(self, calls: Sequence[Call]) -> list[str]: ...


RunnerFactory = Callable[[], BatchRunner]


class FloorRunner:
    """The baseline: the least any dispatcher does per call, on trio.

    Per call: ``json.loads`` of the arguments, xxh3-128 of name + canonical JSON, a
    compiled Draft 2020-12 validator's ``is_valid``, and one trio task in a nursery that
    awaits the tool. Nothing else: no result objects, no history, no limiter.
    """

    name = "floor"
    loop: LoopName = "trio"

    def __init__(self) -> None:
        self._tools: dict[str, tuple[ToolFn, Any]] = {}

    async def setup(self, toolbox: Toolbox) -> None:
        for spec in toolbox.specs:
            Draft202012Validator.check_schema(spec.parameters)
            self._tools[spec.name] = (spec.fn, Draft202012Validator(spec.parameters))

    async def run_batch(self, calls: Sequence[Call]) -> list[str]:
        planned: list[tuple[ToolFn, dict[str, Any]]] = []
        keys: list[bytes] = []
        for call in calls:
            args = json.loads(call.arguments)
            canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            keys.append(xxhash.xxh3_128_digest((call.name + canonical).encode()))
            fn, validator = self._tools[call.name]
            if not validator.is_valid(args):
                raise ValueError(f"invalid arguments for {call.name}: {call.arguments}")
            planned.append((fn, args))
        results = [""] * len(planned)

        async def run_one(index: int, fn: ToolFn, args: dict[str, Any]) -> None:
            results[index] = await fn(**args)

        async with trio.open_nursery() as nursery:
            for index, (fn, args) in enumerate(planned):
                nursery.start_soon(run_one, index, fn, args)
        return results


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Rounds:
    """How many timed rounds (and untimed warm-up rounds) each workload gets."""

    overhead: Mapping[int, int]
    warmup: int
    empty: int
    concurrency: int
    repetition: int
    mixed: int
    memory_calls: int

    @classmethod
    def choose(cls, quick: bool) -> Rounds:
        """The full counts, or a small set for a smoke run (``quick``)."""
        if quick:
            return cls(
                {1: 30, 10: 15, 100: 5},
                warmup=3,
                empty=30,
                concurrency=1,
                repetition=5,
                mixed=2,
                memory_calls=1_000,
            )
        return cls(
            {1: 300, 10: 100, 100: 30},
            warmup=10,
            empty=200,
            concurrency=3,
            repetition=30,
            mixed=5,
            memory_calls=10_000,
        )


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed batch: wall seconds, and CPU seconds of this process over the same span.

    The systems' overhead is CPU-bound, so on a busy machine the CPU time is the steadier
    figure: it leaves out the time the process waited for a core.
    """

    wall: float
    cpu: float


async def time_batches(
    run_batch: Callable[[Sequence[Call]], Awaitable[list[str]]],
    batches: Iterable[Sequence[Call]],
) -> list[Sample]:
    """Await ``run_batch`` on each batch in turn; the wall and CPU time of each.

    Loop-agnostic: it awaits only ``run_batch``, so it runs under asyncio or trio.
    Each batch must give one output per call (checked outside the timed span).
    """
    samples: list[Sample] = []
    for batch in batches:
        cpu_start = time.process_time_ns()
        wall_start = time.perf_counter_ns()
        outputs = await run_batch(batch)
        wall_end = time.perf_counter_ns()
        cpu_end = time.process_time_ns()
        samples.append(Sample((wall_end - wall_start) / 1e9, (cpu_end - cpu_start) / 1e9))
        if len(outputs) != len(batch):
            raise AssertionError(f"{len(batch)} calls gave {len(outputs)} outputs")
    return samples


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def summarize(samples: Sequence[Sample], calls: int, fixed: Sample | None = None) -> dict[str, Any]:
    """Medians of a run of samples, in µs: per batch, per call, per call net of ``fixed``.

    ``fixed`` is the median empty run; ``net`` = (median batch - fixed) / calls. The
    quartiles and minimum are of wall time per call, to show the spread (on a busy
    machine the minimum is the least disturbed round).
    """
    per = max(calls, 1)
    wall = statistics.median(s.wall for s in samples)
    cpu = statistics.median(s.cpu for s in samples)
    per_call = [s.wall / per for s in samples]
    q1, _, q3 = statistics.quantiles(per_call, n=4) if len(per_call) > 1 else per_call * 3
    figures: dict[str, Any] = {
        "rounds": len(samples),
        "median_batch_us": _us(wall),
        "median_us_per_call": _us(wall / per),
        "q1_us_per_call": _us(q1),
        "q3_us_per_call": _us(q3),
        "min_us_per_call": _us(min(per_call)),
        "median_cpu_us_per_call": _us(cpu / per),
    }
    if fixed is not None:
        figures["net_us_per_call"] = _us((wall - fixed.wall) / per)
        figures["net_cpu_us_per_call"] = _us((cpu - fixed.cpu) / per)
    return figures


def _median_sample(samples: Sequence[Sample]) -> Sample:
    return Sample(statistics.median(s.wall for s in samples), statistics.median(s.cpu for s in samples))


async def _fresh(factory: RunnerFactory) -> tuple[BatchRunner, Toolbox]:
    runner = factory()
    toolbox = Toolbox.for_loop(runner.loop)
    await runner.setup(toolbox)
    return runner, toolbox


async def measure_overhead(
    factory: RunnerFactory, rounds: Rounds, sizes: Sequence[int] = OVERHEAD_SIZES
) -> dict[str, Any]:
    """Workload 1: echo batches of each size; also the fixed cost of an empty run.

    Texts are unique per call and round, so no system can skip a call as a repeat.
    ``net_us_per_call`` is (median batch - median empty run) / batch size. An empty run
    may do less than any run with a call (a scripted model answers once instead of
    twice), so ``fit`` also gives the least-squares line through the median batch times:
    its slope is the marginal cost of a call, its intercept the fixed cost of a run that
    executes tools.
    """
    runner, _ = await _fresh(factory)
    await time_batches(runner.run_batch, [[]] * rounds.warmup)
    empty = await time_batches(runner.run_batch, [[]] * rounds.empty)
    fixed = _median_sample(empty)
    figures: dict[str, Any] = {
        "empty_run_us": _us(fixed.wall),
        "empty_run_cpu_us": _us(fixed.cpu),
        "empty_rounds": len(empty),
    }
    medians: list[float] = []
    for size in sizes:
        warm = [echo_batch(size, f"w{size}r{r}") for r in range(rounds.warmup)]
        timed = [echo_batch(size, f"t{size}r{r}") for r in range(rounds.overhead[size])]
        first = await runner.run_batch(warm[0])
        if first != [f"w{size}r0-{i}" for i in range(size)]:
            raise AssertionError(f"{runner.name}: echo returned {first[:3]}...")
        await time_batches(runner.run_batch, warm[1:])
        samples = await time_batches(runner.run_batch, timed)
        figures[f"batch_{size}"] = summarize(samples, size, fixed)
        medians.append(statistics.median(s.wall for s in samples))
    if len(sizes) > 1:
        slope, intercept = statistics.linear_regression(list(sizes), medians)
        figures["fit"] = {"us_per_call": _us(slope), "fixed_us_per_run": _us(intercept)}
    return figures


async def measure_concurrency(factory: RunnerFactory, rounds: Rounds) -> dict[str, Any]:
    """Workload 2: 16 calls of ``nap(100 ms)``: wall time and the most naps in flight at once."""
    runner, toolbox = await _fresh(factory)
    walls: list[float] = []
    peaks: list[int] = []
    for _ in range(rounds.concurrency):
        toolbox.reset()
        batch = nap_batch()
        [sample] = await time_batches(runner.run_batch, [batch])
        walls.append(sample.wall)
        peaks.append(toolbox.max_in_flight)
    return {
        "calls": 16,
        "nap_ms": 100,
        "median_wall_ms": round(statistics.median(walls) * 1e3, 1),
        "walls_ms": [round(w * 1e3, 1) for w in walls],
        "max_in_flight": max(peaks),
        "executions": toolbox.executions["nap"],
    }


async def measure_repetition(factory: RunnerFactory, rounds: Rounds) -> dict[str, Any]:
    """Workload 3: 20 echo calls, 10 distinct; executions per batch and time per batch."""
    runner, toolbox = await _fresh(factory)
    await runner.run_batch(repetition_batch("warm"))
    executions: list[int] = []
    seconds: list[float] = []
    for r in range(rounds.repetition):
        toolbox.reset()
        batch = repetition_batch(f"rep{r}")
        [sample] = await time_batches(runner.run_batch, [batch])
        seconds.append(sample.wall)
        executions.append(toolbox.executions["echo"])
    outputs = await runner.run_batch(repetition_batch("check"))
    expected = [json.loads(c.arguments)["text"] for c in repetition_batch("check")]
    return {
        "calls": 20,
        "distinct": 10,
        "executions_per_batch": statistics.median(executions),
        "executions_seen": sorted(set(executions)),
        "median_batch_us": _us(statistics.median(seconds)),
        "outputs_correct": outputs == expected,
    }


async def measure_mixed(factory: RunnerFactory, rounds: Rounds) -> dict[str, Any]:
    """Workload 4: does ``read_note(a)`` after ``edit_note(a, "new")`` in one batch see it?

    Measured twice: with the store's simulated I/O (``NOTE_IO_S`` per operation, an edit
    being two operations) and with none, where a system that starts every call at once
    still shows program order by the accident of task start order.
    """
    runner, toolbox = await _fresh(factory)
    figures: dict[str, Any] = {}
    for label, io_s in (("with_io", NOTE_IO_S), ("no_io", 0.0)):
        outcomes: list[list[str]] = []
        for _ in range(rounds.mixed):
            toolbox.reset()
            toolbox.note_io_s = io_s
            outcomes.append(await runner.run_batch(mixed_batch()))
        seen = sum(1 for out in outcomes if out[3] == "new")
        figures[label] = {
            "note_io_ms": io_s * 1e3,
            "second_read_sees_edit": f"{seen}/{len(outcomes)}",
            "outputs": outcomes[0],
            "all_rounds_same": all(out == outcomes[0] for out in outcomes),
            "executions": dict(toolbox.executions),
        }
    return figures


async def run_workloads(factory: RunnerFactory, quick: bool = False, overhead: bool = True) -> dict[str, Any]:
    """Workloads 1-4 for one system, inside whatever loop is running (1 only if ``overhead``)."""
    rounds = Rounds.choose(quick)
    figures: dict[str, Any] = {}
    if overhead:
        figures["overhead"] = await measure_overhead(factory, rounds)
    figures["concurrency"] = await measure_concurrency(factory, rounds)
    figures["repetition"] = await measure_repetition(factory, rounds)
    figures["mixed"] = await measure_mixed(factory, rounds)
    return figures


def run_in_loop(loop: LoopName, fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run the coroutine function ``fn`` in a new event loop of the given kind."""
    if loop == "asyncio":
        return asyncio.run(fn())
    return trio.run(fn)


def measure_system(factory: RunnerFactory, quick: bool = False, overhead: bool = True) -> dict[str, Any]:
    """Workloads 1-4 for one system in its own event loop (``asyncio.run`` or ``trio.run``)."""
    loop = factory().loop
    result: dict[str, Any] = run_in_loop(loop, lambda: run_workloads(factory, quick, overhead))
    return result


def measure_overhead_interleaved(
    factories: Mapping[str, RunnerFactory], quick: bool = False, blocks: int = 5
) -> dict[str, dict[str, Any]]:
    """Workload 1 for several systems, in ``blocks`` turns: each system runs a block of
    the rounds in its own new event loop, then the next system, and round again.

    Systems on different event loops cannot alternate batch by batch; alternating blocks
    spreads a shared machine's slow spells over all of them alike. Each figure is the
    median of the per-block figures. A system that fails is left out of later blocks and
    reported as ``{"error": ...}``.
    """
    rounds = Rounds.choose(quick)
    blocks = max(1, blocks)
    per_block = dataclasses.replace(
        rounds, overhead={size: max(1, n // blocks) for size, n in rounds.overhead.items()}
    )
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in factories}
    failed: dict[str, str] = {}
    for _ in range(blocks):
        for name, factory in factories.items():
            if name in failed:
                continue
            try:
                figures = run_in_loop(factory().loop, lambda f=factory: measure_overhead(f, per_block))
            except Exception as exc:  # a peer's API drift must not sink the others
                failed[name] = f"{type(exc).__name__}: {exc}"
                continue
            found[name].append(figures)
    combined: dict[str, dict[str, Any]] = {}
    for name, per in found.items():
        if name in failed:
            combined[name] = {"error": failed[name]}
            continue
        merged: dict[str, Any] = {"blocks": len(per)}
        for key in per[0]:
            first = per[0][key]
            if isinstance(first, dict):
                merged[key] = {
                    k: statistics.median(block[key][k] for block in per)
                    for k, v in first.items()
                    if isinstance(v, int | float)
                }
                if "rounds" in first:
                    merged[key]["rounds"] = sum(block[key]["rounds"] for block in per)
            elif isinstance(first, int | float):
                merged[key] = statistics.median(block[key] for block in per)
        combined[name] = merged
    return combined


# --------------------------------------------------------------------------- goals


@dataclass(frozen=True, slots=True)
class Goal:
    """One goal of the benchmark: what was measured, the figure, the target, and the verdict.

    ``met`` is ``None`` when the figure could not be measured in this run (a peer that is
    not installed, a part of the run that was left out).
    """

    label: str
    measured: str
    target: str
    met: bool | None

    @classmethod
    def not_measured(cls, label: str, target: str, why: str) -> Goal:
        """A goal whose figure this run did not produce, and why."""
        return cls(label, f"not measured ({why})", target, None)

    def render(self) -> str:
        """The goal as one markdown list item ending in met / NOT met."""
        if self.met is None:
            return f"- {self.label}: {self.measured} (goal: {self.target})"
        verdict = "met" if self.met else "**NOT met**"
        return f"- {self.label}: **{self.measured}** (goal: {self.target}): {verdict}"


# --------------------------------------------------------------------------- memory


def _resolve(ref: str) -> RunnerFactory:
    module, _, attr = ref.partition(":")
    factory: RunnerFactory = getattr(importlib.import_module(module), attr)
    return factory


def _maxrss_mib() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * resource.getpagesize() / 2**20


async def _memory_body(factory: RunnerFactory, calls: int, batch: int) -> dict[str, Any]:
    runner, toolbox = await _fresh(factory)
    gc.collect()
    peak_before, current_before = _maxrss_mib(), _current_rss_mib()
    sampled_peak = current_before
    for r in range(calls // batch):
        await runner.run_batch(echo_batch(batch, f"mem{r}"))
        sampled_peak = max(sampled_peak, _current_rss_mib())
    peak_after = _maxrss_mib()
    gc.collect()
    current_after = _current_rss_mib()
    return {
        "calls": calls,
        "batch": batch,
        "executions": toolbox.executions["echo"],
        "maxrss_before_mib": round(peak_before, 1),
        "maxrss_after_mib": round(peak_after, 1),
        "maxrss_growth_mib": round(peak_after - peak_before, 1),
        "rss_before_mib": round(current_before, 1),
        "rss_sampled_peak_growth_mib": round(sampled_peak - current_before, 1),
        "rss_retained_after_gc_mib": round(current_after - current_before, 1),
    }


def memory_child(ref: str, calls: int = 10_000, batch: int = 100) -> dict[str, Any]:
    """In this process: ``calls`` echo calls through one runner; peak RSS before and after.

    "Before" is after imports and ``setup``, before the first call, so first-call
    allocations count as growth. ``ru_maxrss`` is a high-water mark for the whole
    process, so when importing the framework peaked higher than the calls ever reach,
    its growth reads 0; hence also the resident size sampled after every batch
    (``rss_sampled_peak_growth_mib``, from ``/proc/self/statm``) and what is still
    resident after a final ``gc.collect()``.
    """
    factory = _resolve(ref)
    loop = factory().loop
    result: dict[str, Any] = run_in_loop(loop, lambda: _memory_body(factory, calls, batch))
    return result


def measure_memory(ref: str, calls: int = 10_000, batch: int = 100) -> dict[str, Any]:
    """Workload 5 in a fresh child process. ``ref`` names a runner factory: ``module:attr``."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.workloads", "memory", ref, str(calls), str(batch)],
        cwd=_REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    if len(sys.argv) in (3, 4, 5) and sys.argv[1] == "memory":
        numbers = [int(arg) for arg in sys.argv[3:]]
        print(json.dumps(memory_child(sys.argv[2], *numbers)))
    else:
        print("usage: python -m bench.workloads memory MODULE:FACTORY [CALLS [BATCH]]", file=sys.stderr)
        sys.exit(2)
