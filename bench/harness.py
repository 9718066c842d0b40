"""``python -m bench``: threepass, the floor and the peers over the same workloads, in one run.

One process runs, one after another: the floor and threepass on trio (``trio.run``),
threepass again at limits 3 and 8 for the concurrency workload, the interleaved figures of
bench/dispatch_costs.py, then each installed peer on asyncio (``asyncio.run``). The memory
workload runs each system in a fresh child process (bench/workloads.py), so that peaks do
not mix. A peer whose framework does not import is reported as "not installed"; one that
fails while measured is reported as failed; the others still run.

Nothing here measures: the workloads and timers are in bench/workloads.py and
bench/dispatch_costs.py. This module chooses what runs and in what order, and renders
the report (a plain dict, ``--json``) as one markdown table, a line per goal, and the
whole of bench/RESULTS.md.

    python -m bench [--quick] [--output PATH | --no-write] [--json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import os
import platform
import re
import shlex
import sys
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import trio

from dispatcher import default_limit

from . import dispatch_costs, floors
from .peers import PEERS, PeerClass, missing_reason, versions
from .sections import kept_sections
from .threepass_runner import ThreepassAsyncioRunner, ThreepassRunner
from .workloads import (
    FloorRunner,
    Goal,
    Rounds,
    RunnerFactory,
    measure_concurrency,
    measure_memory,
    measure_overhead_interleaved,
    measure_system,
    run_in_loop,
)

__all__ = ["Plan", "collect", "goals", "main", "render_results", "render_table"]

_REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = _REPO_ROOT / "bench" / "RESULTS.md"

#: What a cell shows when the system was not measured on that workload.
_NO_FIGURE = "\N{EN DASH}"

#: Workload 1 alternates between the systems this many times (one block each per turn).
OVERHEAD_BLOCKS = 5

#: The goals of the issue that asked for this harness.
TOOLNODE_GOAL = 8.0
TOOLNODE_FAR_GOAL = 25.0  # issue 11: what threepass at 8x the physical floor comes to
CACHE_HIT_GOAL = 2.0  # issue 11: a disk-cache hit at most this times a dedupe hit
REPEATS_GOAL = 0
ASYNCIO_GOAL = 1.3  # threepass on asyncio per call, at most this times its figure on trio


@dataclass(frozen=True)
class Plan:
    """What one run measures. The defaults are the full run of ``python -m bench``."""

    quick: bool = False
    peers: Sequence[PeerClass] = field(default_factory=lambda: tuple(PEERS.values()))
    limits: Sequence[int] = (3, 8)
    memory: bool = True
    costs: bool = True
    floors: bool = True


# --------------------------------------------------------------------------- collecting


def _ref(factory: type) -> str:
    return f"{factory.__module__}:{factory.__qualname__}"


def _measure(title: str, factory: RunnerFactory, memory_ref: str, plan: Plan) -> dict[str, Any]:
    """Workloads 1-4 in the system's own event loop, then workload 5 in a child process.

    ``memory_ref`` names the factory for the child process: ``module:attr``.
    """
    started = time.perf_counter()
    entry: dict[str, Any] = {"title": title, "status": "ok", "loop": factory().loop}
    entry.update(measure_system(factory, plan.quick, overhead=False))  # workload 1: interleaved, later
    if plan.memory:
        entry["memory"] = measure_memory(memory_ref, Rounds.choose(plan.quick).memory_calls)
    entry["seconds"] = round(time.perf_counter() - started, 1)
    return entry


def _measure_limit(limit: int, plan: Plan) -> dict[str, Any]:
    """threepass at a given limit, the concurrency workload only."""
    started = time.perf_counter()
    factory = functools.partial(ThreepassRunner, limit=limit)
    rounds = Rounds.choose(plan.quick)
    concurrency = run_in_loop("trio", lambda: measure_concurrency(factory, rounds))
    return {
        "title": f"threepass (limit {limit})",
        "status": "ok",
        "loop": "trio",
        "concurrency": concurrency,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _measure_peer(peer: PeerClass, plan: Plan) -> dict[str, Any]:
    missing = missing_reason(peer)
    if missing is not None:
        return {"title": peer.title, "status": "not installed", "reason": missing}
    try:
        entry = _measure(peer.title, peer, _ref(peer), plan)
    except Exception as exc:  # a peer's API drift must not sink the other measurements
        return {"title": peer.title, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    entry["versions"] = versions(peer.distributions)
    return entry


def _overhead(
    systems: dict[str, Any], plan: Plan, progress: Callable[[str], object] = lambda line: None
) -> None:
    """Workload 1 for every system measured so far, in alternating blocks (see
    `measure_overhead_interleaved`), so that the ratios between them share the machine's
    slow spells. A system that fails here is marked failed."""
    factories: dict[str, RunnerFactory] = {
        "floor": FloorRunner,
        "threepass": ThreepassRunner,
        "threepass-asyncio": ThreepassAsyncioRunner,
    }
    factories.update({p.name: p for p in plan.peers if systems.get(p.name, {}).get("status") == "ok"})
    factories = {name: f for name, f in factories.items() if name in systems}
    blocks = 1 if plan.quick else OVERHEAD_BLOCKS
    progress(f"overhead, {blocks} block(s) per system, alternating: {', '.join(factories)}...")
    gc.collect()
    started = time.perf_counter()
    for name, figures in measure_overhead_interleaved(factories, plan.quick, blocks).items():
        if "error" in figures:
            systems[name] = {"title": systems[name]["title"], "status": "failed", "error": figures["error"]}
        else:
            systems[name]["overhead"] = figures
    progress(f"overhead: ok ({time.perf_counter() - started:.1f} s)")


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _proc_field(path: str, name: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _threepass_dependencies() -> list[str]:
    """The names of threepass's runtime dependencies, from pyproject.toml or the installed metadata."""
    pyproject = _REPO_ROOT / "pyproject.toml"
    if pyproject.exists():
        requirements: list[str] = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"][
            "dependencies"
        ]
    else:
        requirements = [r for r in importlib.metadata.requires("threepass") or [] if "extra ==" not in r]
    return [m.group(0) for r in requirements if (m := re.match(r"[A-Za-z0-9_.-]+", r))]


def environment(plan: Plan) -> dict[str, Any]:
    """The machine, the interpreter and the versions of threepass and its dependencies."""
    memory_kib = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "memory_gib": round(int(memory_kib.split()[0]) / 2**20, 1) if memory_kib else None,
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "threepass": versions(["threepass"])["threepass"],
        "dependencies": versions(_threepass_dependencies()),
        "default_limit": default_limit(),
        "quick": plan.quick,
        "memory_calls": Rounds.choose(plan.quick).memory_calls if plan.memory else None,
        "load_average_at_start": _load_average(),
    }


def collect(plan: Plan, progress: Callable[[str], object] = lambda line: None) -> dict[str, Any]:
    """Run everything the plan asks for, one system after another, in this process.

    Returns the report: ``environment``, ``systems`` (keyed by name, in table order) and
    ``costs`` (bench/dispatch_costs.py's figures, or ``None`` when left out).
    """
    started = time.perf_counter()
    report: dict[str, Any] = {"environment": environment(plan), "systems": {}, "costs": None}
    systems: dict[str, Any] = report["systems"]

    def step(name: str, measure: Callable[[], dict[str, Any]]) -> None:
        progress(f"{name}...")
        gc.collect()  # one system's garbage is not collected on another's time
        systems[name] = measure()
        progress(f"{name}: {systems[name]['status']} ({systems[name].get('seconds', 0)} s)")

    step("floor", lambda: _measure("floor", FloorRunner, _ref(FloorRunner), plan))
    step(
        "threepass",
        lambda: _measure(
            f"threepass (default limit {default_limit()})", ThreepassRunner, _ref(ThreepassRunner), plan
        ),
    )
    step(
        "threepass-asyncio",
        lambda: _measure(
            f"threepass on asyncio (default limit {default_limit()})",
            ThreepassAsyncioRunner,
            _ref(ThreepassAsyncioRunner),
            plan,
        ),
    )
    for limit in plan.limits:
        step(f"threepass-limit-{limit}", functools.partial(_measure_limit, limit, plan))
    if plan.costs:
        progress("threepass against the floor, interleaved (bench/dispatch_costs.py)...")
        gc.collect()
        costs_started = time.perf_counter()
        report["costs"] = trio.run(dispatch_costs.measure, plan.quick)
        progress(f"interleaved figures: ok ({time.perf_counter() - costs_started:.1f} s)")
    report["floors"] = None
    if plan.floors:
        progress("threepass against the lean and physical floors, recording, replay (bench/floors.py)...")
        gc.collect()
        floors_started = time.perf_counter()
        report["floors"] = trio.run(floors.measure, plan.quick)
        progress(f"floors: ok ({time.perf_counter() - floors_started:.1f} s)")
    for peer in plan.peers:
        step(peer.name, functools.partial(_measure_peer, peer, plan))
    _overhead(systems, plan, progress)
    report["environment"]["load_average_at_end"] = _load_average()
    report["environment"]["seconds"] = round(time.perf_counter() - started, 1)
    return report


# --------------------------------------------------------------------------- rendering


def _number(value: float, count: bool = False) -> str:
    if count:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def _ratio(ratio: float) -> str:
    if ratio >= 100:
        return f"{ratio:.0f}x"
    if ratio >= 10:
        return f"{ratio:.1f}x"
    return f"{ratio:.2f}x"


@dataclass(frozen=True)
class _Column:
    header: str
    figure: Callable[[Mapping[str, Any]], float | None]
    count: bool = False


def _get(*path: str) -> Callable[[Mapping[str, Any]], float | None]:
    def figure(entry: Mapping[str, Any]) -> float | None:
        value: Any = entry
        for key in path:
            if not isinstance(value, Mapping) or key not in value:
                return None
            value = value[key]
        return float(value) if isinstance(value, int | float) else None

    return figure


def _columns(memory_calls: int | None) -> list[_Column]:
    calls = f"{memory_calls:,}" if memory_calls else "10,000"
    return [
        _Column("µs/call, batch 1", _get("overhead", "batch_1", "median_us_per_call")),
        _Column("batch 10", _get("overhead", "batch_10", "median_us_per_call")),
        _Column("batch 100", _get("overhead", "batch_100", "median_us_per_call")),
        _Column("16 naps of 100 ms: wall ms", _get("concurrency", "median_wall_ms")),
        _Column("most in flight", _get("concurrency", "max_in_flight"), count=True),
        _Column("20 calls, 10 repeated: executions", _get("repetition", "executions_per_batch"), count=True),
        _Column("µs per batch", _get("repetition", "median_batch_us")),
        _Column(f"{calls} calls: RSS growth MiB", _get("memory", "rss_sampled_peak_growth_mib")),
        _Column("peak RSS MiB", _get("memory", "maxrss_after_mib")),
    ]


def _sees_edit(entry: Mapping[str, Any]) -> str:
    mixed = entry.get("mixed")
    if not mixed:
        return _NO_FIGURE
    with_io, without = mixed["with_io"]["second_read_sees_edit"], mixed["no_io"]["second_read_sees_edit"]
    seen, total = (int(n) for n in with_io.split("/"))
    verdict = "yes" if seen == total else "no" if seen == 0 else "sometimes"
    return f"{verdict} ({with_io}; {without} without I/O)"


def render_table(report: Mapping[str, Any]) -> str:
    """One markdown row per system; each figure with its ratio to threepass's in brackets."""
    columns = _columns(report["environment"].get("memory_calls"))
    headers = [
        "system",
        *(c.header for c in columns[:7]),
        "last read sees the edit",
        *(c.header for c in columns[7:]),
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    systems: Mapping[str, Any] = report["systems"]
    base = systems.get("threepass", {})
    for name, entry in systems.items():
        if entry["status"] != "ok":
            why = (
                entry["status"] if entry["status"] == "not installed" else f"failed: {entry.get('error', '')}"
            )
            lines.append("| " + " | ".join([entry["title"], why, *[""] * (len(headers) - 2)]) + " |")
            continue
        cells = []
        for column in columns:
            value, reference = column.figure(entry), column.figure(base)
            if value is None:
                cells.append(_NO_FIGURE)
            elif name == "threepass" or not reference:
                cells.append(_number(value, column.count))
            else:
                cells.append(f"{_number(value, column.count)} ({_ratio(value / reference)})")
        cells.insert(7, _sees_edit(entry))
        lines.append("| " + " | ".join([entry["title"], *cells]) + " |")
    return "\n".join(lines)


def goals(report: Mapping[str, Any]) -> list[Goal]:
    """The issue's goals (ToolNode, floor, repeats), then bench/dispatch_costs.py's."""
    systems: Mapping[str, Any] = report["systems"]
    threepass = systems["threepass"]
    per_call_100 = _get("overhead", "batch_100", "median_us_per_call")
    label = "LangGraph ToolNode / threepass per call at batch 100"
    target = f"at least {TOOLNODE_GOAL:.0f}x"
    toolnode = systems.get("langgraph")
    toolnode_us, threepass_us = per_call_100(toolnode or {}), per_call_100(threepass)
    found: list[Goal] = []
    if toolnode_us is None or not threepass_us:
        why = toolnode["status"] if toolnode else "left out of this run"
        found.append(Goal.not_measured(label, target, f"langgraph {why}"))
    else:
        ratio = toolnode_us / threepass_us
        found.append(Goal(label, f"{ratio:.1f}x", target, ratio >= TOOLNODE_GOAL))
    costs = report.get("costs")
    if costs is None:
        found.append(
            Goal.not_measured(
                "threepass / floor per call at batch 100", "at most 1.5x", "left out of this run"
            )
        )
    else:
        found += dispatch_costs.overhead_goals(costs)
    repetition = threepass["repetition"]
    repeats = max(repetition["executions_seen"]) - repetition["distinct"]
    found.append(
        Goal(
            "threepass's repeated executions in the 20-call batch with 10 repeats (every round)",
            str(repeats),
            str(REPEATS_GOAL),
            repeats == REPEATS_GOAL and repetition["outputs_correct"],
        )
    )
    on_asyncio = per_call_100(systems.get("threepass-asyncio") or {})
    label = "threepass on asyncio / on trio per call at batch 100"
    if on_asyncio is None or not threepass_us:
        found.append(Goal.not_measured(label, f"at most {ASYNCIO_GOAL}x", "left out of this run"))
    else:
        ratio = on_asyncio / threepass_us
        found.append(Goal(label, f"{ratio:.2f}x", f"at most {ASYNCIO_GOAL}x", ratio <= ASYNCIO_GOAL))
    if costs is not None:
        found += dispatch_costs.cost_goals(costs)
    label = "per call at batch 100, LangGraph ToolNode over threepass (issue 11)"
    if toolnode_us is None or not threepass_us:
        found.append(Goal.not_measured(label, f"at least {TOOLNODE_FAR_GOAL:.0f}x", "langgraph not measured"))
    else:
        ratio = toolnode_us / threepass_us
        target = f"at least {TOOLNODE_FAR_GOAL:.0f}x"
        found.append(Goal(label, f"{ratio:.1f}x", target, ratio >= TOOLNODE_FAR_GOAL))
    if costs is not None:
        ratios = [costs["dedupe_cache"][f"cache_ratio_batch{size}"] for size in (1, 100)]
        found.append(
            Goal(
                "a disk-cache hit / a dedupe hit per call, batch 1 / batch 100 (issue 11)",
                " / ".join(f"{r:.2f}x" for r in ratios),
                f"at most {CACHE_HIT_GOAL:.0f}x",
                max(ratios) <= CACHE_HIT_GOAL,
            )
        )
    if report.get("floors") is not None:
        found += floors.goals(report["floors"])
    return found


def _versions_line(found: Mapping[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in found.items())


_PROSE = """\
## How to read this

- **The floor** is the least work any dispatcher must do per call: `json.loads` of the
  arguments, xxh3-128 of the name and canonical JSON, a compiled Draft 2020-12 validator's
  `is_valid`, and one trio task per call in a nursery; no result objects, no history, no
  limiter (`bench.workloads.FloorRunner`). It also runs the other workloads, where it
  shows what that least work does: every call at once, every repeat run again.
- **One run of the harness, one process.** threepass and the floor run on trio, the
  peers on asyncio, each system in its own event loop, one after another. The memory
  workload runs each system in a fresh child process. Each batch is one whole run of a
  scripted model (no network): it emits the batch, the system executes it, the model
  answers; for threepass each batch is a new run in one session, so nothing is deduped
  across batches in the overhead rows.
- **Figures** are medians; a figure in brackets is its ratio to threepass's figure in the
  same column. The per-call columns (workload 1) alternate between the systems: each
  runs a fifth of its rounds in a new event loop, then the next system, five times
  round, and each figure is the median of its five block medians, so a slow spell of
  the shared machine falls on every system alike. The other workloads run one system
  after another. The section "threepass against the floor" goes further and
  interleaves the two batch by batch on one trio loop; the floor goal is read there.
- **Concurrency.** threepass's default limit is half the cores, at least 3: on a 2-core
  machine it is 3, so 16 naps of 100 ms take ceil(16/3) x 100 = 600 ms by design. The
  rows at limits 3 and 8 show the limiter at work; the peers start all 16 at once.
- **Repetition and order.** threepass runs each distinct call once per run and serves
  its repeats; it runs a read of a resource after an edit of it in the same batch (the
  tools declare `reads` and `writes`). The peers run every call, all at once: with the
  note store's simulated I/O (1 ms per operation) their last read returns the old text;
  without I/O they may see the edit by the accident of task start order.
- **Memory** is the growth of the resident size, sampled after each batch of 100, over
  the calls through one runner; "peak RSS" is the child process's `ru_maxrss`, imports
  included. threepass's growth includes its session history, which keeps the newest
  10,000 calls with their results (`history_limit`); the peers keep none.
"""


def _rounds_line(quick: bool) -> str:
    rounds = Rounds.choose(quick)
    blocks = 1 if quick else OVERHEAD_BLOCKS
    per_size = ", ".join(f"{n} rounds at batch {size}" for size, n in rounds.overhead.items())
    return (
        f"µs/call is the median of {blocks} alternating blocks' median wall time per call, over "
        f"{per_size} in all ({rounds.warmup} untimed warm-up rounds a block); "
        f"{rounds.concurrency} rounds of the naps, {rounds.repetition} of the repetition batch, "
        f"{rounds.mixed} of read-read-edit-read with the note store's I/O and {rounds.mixed} without. "
        "In brackets: the ratio to threepass's figure in the same column."
    )


def render_results(report: Mapping[str, Any], command: str) -> str:
    """The whole of bench/RESULTS.md."""
    env = report["environment"]
    peers = [e for e in report["systems"].values() if "versions" in e]
    missing = [e["title"] for e in report["systems"].values() if e["status"] == "not installed"]
    quick = " This was a `--quick` smoke run: too few rounds to read." if env["quick"] else ""
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `{command}`; do not edit by hand, run it again.{quick}",
        "",
        f"- Command (from the repository root): `pip install '.[bench]' && {command}`",
        f"- Date: {env['date']}; the whole run took {env['seconds']} s.",
        f"- Machine: {env['cpus']} cores ({env['cpu_model'] or 'unknown CPU'}), {env['memory_gib']} GiB, "
        f"{env['os']}; load average {env['load_average_at_start'][0]} at the start, "
        f"{env['load_average_at_end'][0]} at the end (a shared machine).",
        f"- {env['python']}; threepass {env['threepass']} with {_versions_line(env['dependencies'])}.",
        *(f"- {e['title']}: {_versions_line(e['versions'])}." for e in peers),
        *(f"- {title}: not installed." for title in missing),
        "",
        "## Every system, the same workloads, one run",
        "",
        render_table(report),
        "",
        _rounds_line(env["quick"]),
        "",
        "## Against the goals",
        "",
        *(goal.render() for goal in goals(report)),
        "",
    ]
    if report.get("costs") is not None:
        lines += [
            "## threepass against the floor, interleaved",
            "",
            "bench/dispatch_costs.py, run inside the same command: threepass and the floor",
            "alternate round by round; then a dedupe hit, a disk-cache hit, and 16 sleeps.",
            "",
            dispatch_costs.render(report["costs"]),
            "",
        ]
    if report.get("floors") is not None:
        lines += [
            "## threepass against the lean and physical floors; recording and replay",
            "",
            "bench/floors.py, run inside the same command, on one trio loop: every system gets",
            "the same batch of OpenAI-style calls, rounds alternating system by system. The lean",
            "floor is json.loads, json.dumps(sort_keys=True), xxh3-128 and jsonschema's compiled",
            "`is_valid`; the physical floor orjson.loads, orjson.dumps(OPT_SORT_KEYS), xxh3-128 and",
            "jsonschema-rs `is_valid`; neither starts a task per call (each tool is awaited in",
            "turn). The floor with tasks is the one in the table above. The realistic schema has",
            "five properties, a nested object, an enum and required ones.",
            "",
            floors.render(report["floors"]),
            "",
        ]
    return "\n".join([*lines, _PROSE])


def render_summary(report: Mapping[str, Any]) -> str:
    """What ``python -m bench`` prints: the table and the goal lines."""
    return "\n".join([render_table(report), "", *(goal.render() for goal in goals(report))])


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="threepass, the floor and the installed peers over the same five workloads.",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds per system")
    parser.add_argument(
        "--output",
        type=Path,
        help="write the results here (default: bench/RESULTS.md; a --quick run writes only with --output)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only, write no file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    return parser


def _output(ns: argparse.Namespace) -> Path | None:
    if ns.no_write:
        return None
    if ns.output is not None:
        return Path(ns.output)
    if ns.quick or not (_REPO_ROOT / "pyproject.toml").exists():
        return None  # a smoke run, or no source checkout to write into
    return DEFAULT_OUTPUT


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the benchmark; print the table (or JSON); write RESULTS.md unless told not to."""
    stream = out or sys.stdout
    arguments = list(sys.argv[1:] if argv is None else argv)
    ns = _parser().parse_args(arguments)
    command = " ".join(["python -m bench", *map(shlex.quote, arguments)])

    def progress(line: str) -> None:
        print(f"bench: {line}", file=sys.stderr, flush=True)

    report = collect(Plan(quick=ns.quick), progress)
    stream.write((json.dumps(report, indent=1) if ns.json else render_summary(report)) + "\n")
    output = _output(ns)
    if output is not None:
        kept = kept_sections(output.read_text(encoding="utf-8")) if output.exists() else ""
        output.write_text(render_results(report, command) + kept, encoding="utf-8")
        progress(f"wrote {output}")
    return 0
