"""The Redis stores on a loopback redis-server this benchmark starts: the client round trip
per event loop (the choice `RedisResultCache` makes), a cache hit through the dispatcher
with Redis beside the disk store and a dedupe hit, what a session store adds to a batch
(memory, SQLite, Redis), and batch throughput with 1, 2 and 4 worker processes sharing one
Redis. Medians, in one run.

    python -m bench.redis_store [--quick] [--write]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from cache import DiskResultCache, MemoryResultCache, RedisResultCache, ResultCache
from dispatcher import CachePolicy, Dispatcher, Registry, Tool, ToolCall

REPO = Path(__file__).resolve().parents[1]


def _echo(args: Mapping[str, Any], ctx: Any) -> str:
    return f"page {args['n']}"


def _registry() -> Registry:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    return Registry(
        [
            Tool(
                "fetch",
                "Fetch.",
                _echo,
                schema,
                deferred=False,
                concurrent=True,
                cache=CachePolicy(scope="shared"),
            )
        ]
    )


def _batch(size: int, offset: int = 0) -> list[ToolCall]:
    return [ToolCall(f"c{i}", "fetch", {"n": offset + i}) for i in range(size)]


async def _median_us(operation: Callable[[], Awaitable[Any]], rounds: int) -> float:
    for _ in range(min(50, rounds)):
        await operation()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        await operation()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# --- the client round trip ---------------------------------------------------------------


async def _round_trips(url: str, rounds: int) -> dict[str, tuple[float, float]]:
    """GET and MGET of 100 keys, in µs, per client that runs on the current loop."""
    import redis
    import redis.asyncio

    keys = [f"bench:k{i}" for i in range(100)]
    found: dict[str, tuple[float, float]] = {}
    sync = redis.Redis.from_url(url)
    sync.mset({k: b"x" * 200 for k in keys})
    found["redis-py sync, in a worker thread"] = (
        await _median_us(lambda: anyio.to_thread.run_sync(sync.get, keys[0]), rounds),
        await _median_us(lambda: anyio.to_thread.run_sync(sync.mget, keys), rounds),
    )
    sync.close()
    if _library() == "asyncio":
        client = redis.asyncio.Redis.from_url(url)
        found["redis.asyncio"] = (
            await _median_us(lambda: client.get(keys[0]), rounds),
            await _median_us(lambda: client.mget(keys), rounds),
        )
        await client.aclose()
    try:
        import coredis
    except ImportError:
        found["coredis (not installed)"] = (float("nan"), float("nan"))
    else:
        async with coredis.Redis.from_url(url) as other:
            found["coredis (only inside `async with client`)"] = (
                await _median_us(lambda: other.get(keys[0]), rounds),
                await _median_us(lambda: other.mget(keys), rounds),
            )
    return found


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def _parser() -> str:
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "pure Python"


def _library() -> str:
    import sniffio

    return sniffio.current_async_library()


# --- a hit through the dispatcher ----------------------------------------------------------


async def _hits(url: str, folder: Path, batch: int, rounds: int) -> dict[str, float]:
    """µs per call of a batch served whole by: Redis, the disk store, the memory store, the
    run's dedupe."""
    found: dict[str, float] = {}
    calls = _batch(batch)
    redis_store = RedisResultCache(url, namespace=f"bench-hit-{batch}")
    stores: list[tuple[str, ResultCache]] = [
        ("RedisResultCache (loopback)", redis_store),
        ("DiskResultCache", DiskResultCache(folder / f"disk-{batch}")),
        ("MemoryResultCache (in-process)", MemoryResultCache()),
    ]
    for name, store in stores:
        d = Dispatcher(_registry(), cache=store)
        await d.session("warm").dispatch(calls)
        n = 0

        async def fresh_session(d: Dispatcher = d) -> None:
            nonlocal n
            n += 1
            s = d.session(f"s{n}")
            results = await s.dispatch(calls)
            s.close()
            assert all(r.cached for r in results), "expected every call served from the store"

        found[name] = await _median_us(fresh_session, rounds) / batch
    await redis_store.aclose()
    d = Dispatcher(_registry())
    s = d.session("dedupe")
    await s.dispatch(calls)

    async def same_run() -> None:
        results = await s.dispatch(calls)
        assert all(r.deduped for r in results), "expected every call deduped"

    found["dedupe hit (no store)"] = await _median_us(same_run, rounds) / batch
    return found


# --- several worker processes ---------------------------------------------------------------


async def _kept(url: str, folder: Path, rounds: int) -> dict[str, float]:
    """Median µs of a batch of one read in a session with no store and with each session
    store (a lease, a load and a save per batch), the stores' rounds interleaved."""
    from cache import MemorySessionStore, RedisSessionStore, SqliteSessionStore

    redis = RedisSessionStore(url, namespace=f"bench-kept-{os.getpid()}-{time.monotonic_ns()}")
    stores: dict[str, Any] = {
        "no session store": None,
        "MemorySessionStore": MemorySessionStore(),
        "SqliteSessionStore": SqliteSessionStore(folder / "sessions.sqlite"),
        "RedisSessionStore": redis,
    }
    sessions = {
        name: Dispatcher(_registry(), session_store=store).session("s") for name, store in stores.items()
    }
    times: dict[str, list[float]] = {name: [] for name in stores}
    for r in range(rounds + 20):
        for name, session in sessions.items():
            if r % 10 == 0:
                session.new_run()  # a turn of ten batches: the saved run stays a turn's size
            start = time.perf_counter()
            await session.dispatch(_batch(1, r))
            if r >= 20:
                times[name].append(time.perf_counter() - start)
    await redis.aclose()
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def worker(url: str, go: str, seconds: float, backend: str) -> None:
    """One worker process: warm the cache, say "ready", wait for `go`, then dispatch batches
    of 100 hits for `seconds`; print how many calls were served."""

    async def run() -> int:
        store = RedisResultCache(url, namespace="bench-workers")
        d = Dispatcher(_registry(), cache=store)
        calls = _batch(100)
        await d.session("warm").dispatch(calls)
        print("ready", flush=True)
        while not await anyio.Path(go).exists():  # noqa: ASYNC110 - another process writes it
            await anyio.sleep(0.005)
        done, n = 0, 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            n += 1
            s = d.session(f"s{n}")
            results = await s.dispatch(calls)
            s.close()
            done += sum(r.cached for r in results)
        await store.aclose()
        return done

    print(anyio.run(run, backend=backend), flush=True)


def _throughput(url: str, processes: int, seconds: float, backend: str, folder: Path) -> float:
    go = folder / f"go-{processes}-{backend}"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from bench.redis_store import worker; "
        "worker(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])"
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(REPO), url, str(go), str(seconds), backend],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for child in children:  # each has imported, connected and warmed its cache
        assert child.stdout is not None
        if child.stdout.readline() != "ready\n":
            raise RuntimeError(f"a worker failed to start (exit {child.wait()})")
    go.write_text("")
    served = sum(int(child.communicate(timeout=seconds + 60)[0].strip()) for child in children)
    return served / seconds


# --- the run -----------------------------------------------------------------------------------


def measure(quick: bool) -> list[str]:
    from tests._redis import RedisServer

    program = shutil.which("redis-server")
    if program is None:
        return ["skipped: redis-server is not installed (Debian package redis-server)"]
    rounds_rt, rounds_1, rounds_100 = (300, 200, 20) if quick else (3000, 1000, 100)
    seconds = 1.0 if quick else 3.0
    lines: list[str] = []
    started_under = _load()
    with tempfile.TemporaryDirectory(prefix="threepass-bench-redis-") as tmp:
        folder = Path(tmp)
        server = RedisServer(program, folder / "redis")
        server.start()
        try:
            lines.append(f"client round trip on loopback, median µs (reply parser: {_parser()}):")
            lines.append(f"  {'':8} {'client':44} {'GET':>7} {'MGET 100':>9}")
            for backend in ("trio", "asyncio"):
                for name, (one, hundred) in anyio.run(
                    _round_trips, server.url, rounds_rt, backend=backend
                ).items():
                    lines.append(f"  {backend:8} {name:44} {one:7.1f} {hundred:9.1f}")
            lines.append("  chosen: redis.asyncio on asyncio, redis-py sync in a worker thread on trio")
            lines.append("")
            lines.append("a cache hit through the dispatcher, median µs per call (each batch a new session):")
            lines.append(f"  {'':8} {'store':30} {'batch 1':>9} {'batch 100':>10}")
            for backend in ("trio", "asyncio"):
                one = anyio.run(_hits, server.url, folder / backend, 1, rounds_1, backend=backend)
                hundred = anyio.run(_hits, server.url, folder / backend, 100, rounds_100, backend=backend)
                for name in one:
                    lines.append(f"  {backend:8} {name:30} {one[name]:9.1f} {hundred[name]:10.1f}")
            lines.append("")
            lines.append(
                "a batch of one read (a sync tool: a worker thread's hop is in every figure) with a"
                " session store (a lease, a load and a save a batch; a new run every ten batches),"
                " median µs:"
            )
            kept_rounds = 100 if quick else 600
            for backend in ("trio", "asyncio"):
                kept = anyio.run(_kept, server.url, folder / f"kept-{backend}", kept_rounds, backend=backend)
                for name, us in kept.items():
                    lines.append(f"  {backend:8} {name:30} {us:9.1f}")
            lines.append("")
            repeats = 1 if quick else 3
            lines.append(
                f"hits served per second by worker processes sharing one Redis, each dispatching"
                f" batches of 100 cached reads for {seconds:g} s; best of {repeats} interleaved runs"
                f" (the least disturbed), the range after it:"
            )
            for backend in ("trio", "asyncio"):
                rates: dict[int, list[float]] = {1: [], 2: [], 4: []}
                for _ in range(repeats):  # interleaved, so a burst of load hits every count alike
                    for processes in rates:
                        rates[processes].append(_throughput(server.url, processes, seconds, backend, folder))
                one = max(rates[1])
                for processes, got in rates.items():
                    best = max(got)
                    lines.append(
                        f"  {backend:8} {processes} worker(s): {best:9.0f} calls/s ({best / one:.2f}x one)"
                        f"  [{min(got):.0f}-{best:.0f}]"
                    )
            lines.append(
                f"  ({os.cpu_count()} cores, shared by Redis, the workers and whatever else runs;"
                f" load average {started_under} at the start, {_load()} at the end)"
            )
        finally:
            server.stop()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--write", action="store_true", help="put the figures into bench/RESULTS.md")
    args = parser.parse_args()
    lines = measure(args.quick)
    print("\n".join(lines))
    if args.write:
        from bench.sections import write_section

        command = " ".join(["python -m bench.redis_store", *map(shlex.quote, sys.argv[1:])])
        write_section("redis", "Redis: the shared result cache", command, lines)


if __name__ == "__main__":
    main()
