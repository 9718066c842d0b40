"""threepass's own figures, each beside a baseline measured in the same run.

1. Per-call overhead of a trivial async tool with a schema at batch 1, 10 and 100,
   at the default limit and at a limit of 100, interleaved round by round with the
   floor (bench/workloads.py: json.loads + xxh3 + compiled validator + one trio task
   per call). Goal: at batch 100, at most 1.5x the floor.
2. A deduped call (the same batch again in the same run) against a dict lookup plus
   the work of making the key (json.loads, canonical json.dumps, xxh3-128), rounds
   interleaved; the figure is the median of the per-round differences.
   Goal: within 10 us.
3. A result-cache hit (DiskResultCache in a temporary folder) against a dedupe hit,
   batch 1 and batch 100. Goal: at most 150 us more per call; a batch of 100 cache
   hits under 3x the cost of 100 dedupe hits.
4. Sixteen concurrent calls that sleep 100 ms at limits 3 and 8, in real time.
   Goal: wall within 20 ms of ceil(16/limit) x 100 ms.

    python -m bench.dispatch_costs [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import xxhash

from cache import CachePolicy, DiskResultCache
from dispatcher import Dispatcher, Registry, Tool

from .threepass_runner import ThreepassRunner
from .workloads import FloorRunner, Goal, Toolbox, echo_batch, nap_batch

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


async def _median_us(fn: Callable[[], Awaitable[Any]], rounds: int, per: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / per * 1e6


async def overhead(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for limit in (None, 100):
        floor, three = FloorRunner(), ThreepassRunner(limit=limit)
        toolbox = Toolbox.for_loop("trio")
        await floor.setup(toolbox)
        await three.setup(toolbox)
        for size in (1, 10, 100):
            rounds = (60 if size == 100 else 300) // (4 if quick else 1)
            f_times, t_times = [], []
            for r in range(rounds + 10):
                batch = echo_batch(size, f"r{r}")
                t0 = time.perf_counter()
                await floor.run_batch(batch)
                t1 = time.perf_counter()
                await three.run_batch(batch)
                t2 = time.perf_counter()
                if r >= 10:  # warm-up rounds are not counted
                    f_times.append(t1 - t0)
                    t_times.append(t2 - t1)
            f = statistics.median(f_times) / size * 1e6
            t = statistics.median(t_times) / size * 1e6
            rows.append(
                {"limit": limit or "default", "batch": size, "floor_us": f, "threepass_us": t, "ratio": t / f}
            )
    return rows


def _registry(cache_policy: CachePolicy | None = None) -> Registry:
    async def echo(args: Any, ctx: Any) -> str:
        return str(args["text"])

    return Registry(
        [Tool("echo", "Echo.", echo, SCHEMA, concurrent=True, deferred=False, cache=cache_policy)]
    )


def _calls(size: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "echo", "arguments": json.dumps({"text": f"t{i}"})},
        }
        for i in range(size)
    ]


async def dedupe_and_cache(quick: bool) -> dict[str, Any]:
    rounds = 50 if quick else 200
    out: dict[str, Any] = {}
    # baseline: the key's work plus a dict lookup
    table: dict[str, str] = {}
    calls = _calls(100)
    for c in calls:
        a = json.loads(c["function"]["arguments"])
        canonical = json.dumps(a, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        table[xxhash.xxh3_128_hexdigest(f"echo\x00{canonical}".encode())] = "x"

    async def lookups() -> None:
        for c in calls:
            a = json.loads(c["function"]["arguments"])
            canonical = json.dumps(a, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            table.get(xxhash.xxh3_128_hexdigest(f"echo\x00{canonical}".encode()))

    with tempfile.TemporaryDirectory() as folder:
        store = DiskResultCache(folder)
        d_dedupe = Dispatcher(_registry())
        d_cache = Dispatcher(_registry(CachePolicy()), cache=store)
        for size in (1, 100):
            batch = _calls(size)
            s_dedupe = d_dedupe.session(f"dedupe{size}")
            await s_dedupe.dispatch(batch)  # remembered in this run from now on
            s_cache = d_cache.session(f"cache{size}")
            await s_cache.dispatch(batch)  # stored in the disk cache

            async def dedupe_hit(s: Any = s_dedupe, b: Any = batch) -> None:
                await s.dispatch(b)

            async def cache_hit(s: Any = s_cache, b: Any = batch) -> None:
                s.new_run()  # dedupe empty: every call is looked up in the result cache
                await s.dispatch(b)

            assert all(r.deduped for r in await s_dedupe.dispatch(batch))
            s_cache.new_run()
            assert all(r.cached for r in await s_cache.dispatch(batch))
            # rounds interleaved with the baseline, so a slow spell of the machine hits all three
            kk, dd, cc = [], [], []
            for _ in range(rounds):
                kk.append(await _median_us(lookups, 1, 100))
                dd.append(await _median_us(dedupe_hit, 1, size))
                cc.append(await _median_us(cache_hit, 1, size))
            out[f"dedupe_hit_us_batch{size}"] = statistics.median(dd)
            out[f"cache_hit_us_batch{size}"] = statistics.median(cc)
            # paired per round: each round's difference, then the median of those
            pairs = list(zip(kk, dd, cc, strict=True))
            out[f"dedupe_extra_us_batch{size}"] = statistics.median(d - k for k, d, _ in pairs)
            out[f"cache_extra_us_batch{size}"] = statistics.median(c - d for _, d, c in pairs)
            out[f"cache_ratio_batch{size}"] = statistics.median(c / d for _, d, c in pairs)
            if size == 100:
                out["key_and_lookup_us"] = statistics.median(kk)
        store.close()
    return out


async def sleeps(limit: int) -> dict[str, Any]:
    runner = ThreepassRunner(limit=limit)
    toolbox = Toolbox.for_loop("trio")
    await runner.setup(toolbox)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        await runner.run_batch(nap_batch(16, 100))
        walls.append((time.perf_counter() - t0) * 1000)
    return {"limit": limit, "wall_ms": statistics.median(walls), "ideal_ms": math.ceil(16 / limit) * 100}


async def measure(quick: bool) -> dict[str, Any]:
    """Every figure above, in one trio run: ``trio.run(measure, quick)``."""
    return {
        "overhead": await overhead(quick),
        "dedupe_cache": await dedupe_and_cache(quick),
        "sleeps": [await sleeps(3), await sleeps(8)],
    }


def render(figures: dict[str, Any]) -> str:
    lines = ["| limit | batch | floor µs/call | threepass µs/call | ratio |", "|---|---|---|---|---|"]
    for row in figures["overhead"]:
        lines.append(
            f"| {row['limit']} | {row['batch']} | {row['floor_us']:.1f} | {row['threepass_us']:.1f} | "
            f"{row['ratio']:.2f}x |"
        )
    dc = figures["dedupe_cache"]
    dedupe_extra = dc["dedupe_extra_us_batch100"]
    cache_extra_1 = dc["cache_extra_us_batch1"]
    cache_extra_100 = dc["cache_extra_us_batch100"]
    cache_ratio = dc["cache_ratio_batch100"]
    lines += [
        "",
        "| per call | µs |",
        "|---|---|",
        f"| key (json.loads + canonical dumps + xxh3) + dict lookup | {dc['key_and_lookup_us']:.1f} |",
        f"| dedupe hit through the dispatcher, batch 1 | {dc['dedupe_hit_us_batch1']:.1f} |",
        f"| dedupe hit through the dispatcher, batch 100 | {dc['dedupe_hit_us_batch100']:.1f} |",
        f"| disk-cache hit through the dispatcher, batch 1 | {dc['cache_hit_us_batch1']:.1f} |",
        f"| disk-cache hit through the dispatcher, batch 100 | {dc['cache_hit_us_batch100']:.1f} |",
        "",
        f"Dedupe hit minus key + lookup (batch 100): {dedupe_extra:.1f} µs.  "
        f"Cache hit minus dedupe hit: batch 1 {cache_extra_1:.1f} µs, batch 100 {cache_extra_100:.1f} µs; "
        f"100 cache hits / 100 dedupe hits = {cache_ratio:.2f}x.",
        "",
        "| 16 x 100 ms, limit | wall ms | ceil(16/limit) x 100 ms |",
        "|---|---|---|",
    ]
    for row in figures["sleeps"]:
        lines.append(f"| {row['limit']} | {row['wall_ms']:.1f} | {row['ideal_ms']} |")
    return "\n".join(lines)


def _limit(limit: int | str) -> str:
    return "at the default limit" if limit == "default" else f"at limit {limit}"


def overhead_goals(figures: dict[str, Any]) -> list[Goal]:
    """threepass at most 1.5x the floor per call at batch 100, at each limit measured."""
    return [
        Goal(
            f"threepass / floor per call at batch 100, {_limit(row['limit'])}, rounds interleaved",
            f"{row['ratio']:.2f}x",
            "at most 1.5x",
            row["ratio"] <= 1.5,
        )
        for row in figures["overhead"]
        if row["batch"] == 100
    ]


def cost_goals(figures: dict[str, Any]) -> list[Goal]:
    """The dedupe-hit, cache-hit and sixteen-sleeps goals of this module's docstring."""
    dc = figures["dedupe_cache"]
    dedupe_extra = dc["dedupe_extra_us_batch100"]
    cache_extra = (dc["cache_extra_us_batch1"], dc["cache_extra_us_batch100"])
    cache_ratio = dc["cache_ratio_batch100"]
    goals = [
        Goal(
            "a deduped call minus making its key and a dict lookup (batch 100)",
            f"{dedupe_extra:.1f} µs",
            "within 10 µs",
            dedupe_extra <= 10,
        ),
        Goal(
            "a disk-cache hit minus a dedupe hit, batch 1 / batch 100",
            f"{cache_extra[0]:.1f} / {cache_extra[1]:.1f} µs",
            "at most 150 µs",
            max(cache_extra) <= 150,
        ),
        Goal("100 disk-cache hits / 100 dedupe hits", f"{cache_ratio:.2f}x", "under 3x", cache_ratio < 3),
    ]
    for row in figures["sleeps"]:
        goals.append(
            Goal(
                f"16 concurrent 100 ms sleeps at limit {row['limit']}",
                f"{row['wall_ms']:.1f} ms",
                f"within 20 ms of {row['ideal_ms']} ms",
                abs(row["wall_ms"] - row["ideal_ms"]) <= 20,
            )
        )
    return goals


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    figures = trio.run(measure, ns.quick)
    if ns.json:
        print(json.dumps(figures, indent=1))
    else:
        goals = overhead_goals(figures) + cost_goals(figures)
        print(render(figures), "", "Against the goals:", "", *(g.render() for g in goals), sep="\n")
