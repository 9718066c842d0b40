"""What `isolation="process"` costs per call, beside a sync handler in a thread and an
async handler: one lone call at a time through `Dispatcher.invoke`, warm workers, and
the first call's cold start (the pool starts the forkserver and one worker).

    python -m bench.isolation [--loop trio|asyncio] [--calls 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from typing import Any


def echo_sync(args: Mapping[str, Any], ctx: Any) -> str:
    return str(args["text"])


async def echo_async(args: Mapping[str, Any], ctx: Any) -> str:
    return str(args["text"])


async def measure(calls: int) -> dict[str, float]:
    # by its module's name, not __main__'s: a worker process imports it from there
    from bench.isolation import echo_async, echo_sync
    from dispatcher import Dispatcher, Registry, Tool

    def tool(name: str, handler: Any, **kw: Any) -> Tool:
        return Tool(name=name, description=name, handler=handler, deferred=False, **kw)

    registry = Registry(
        [
            tool("async", echo_async),
            tool("thread", echo_sync),
            tool("process", echo_sync, isolation="process"),
        ]
    )
    d = Dispatcher(registry)
    figures: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        await d.invoke("process", {"text": "cold"})
        figures["process_cold_start_ms"] = (time.perf_counter() - t0) * 1e3
        for name in ("async", "thread", "process"):
            times = []
            for i in range(calls):
                t0 = time.perf_counter()
                await d.invoke(name, {"text": f"{i}"})
                times.append(time.perf_counter() - t0)
            figures[f"{name}_us"] = statistics.median(times) * 1e6
    finally:
        d.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--loop", choices=["trio", "asyncio"], default="trio")
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    if args.loop == "trio":
        import trio

        figures = trio.run(measure, args.calls)
    else:
        import asyncio

        figures = asyncio.run(measure(args.calls))
    print(json.dumps({k: round(v, 1) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
