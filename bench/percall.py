"""threepass's per-call cost at batch 1, 10 and 100, through the public API only, so the
same measurement runs against any revision of the kernel (see bench/versus.py).

A trivial async echo tool with a schema, a new run per batch (no dedupe), no cache. Prints
one JSON object: the median microseconds per call for each batch size.

    python -m bench.percall [--loop trio|asyncio] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from typing import Any

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
SIZES = ((1, 1500), (10, 300), (100, 60))


async def _echo(args: Mapping[str, Any], ctx: Any) -> str:
    return str(args["text"])


def _batch(size: int, round_: int) -> list[dict[str, Any]]:
    return [
        {"id": f"c{i}", "type": "function",
         "function": {"name": "echo", "arguments": json.dumps({"text": f"{round_}-{i}"})}}
        for i in range(size)
    ]  # fmt: skip


async def measure(quick: bool = False) -> dict[str, float]:
    from dispatcher import Dispatcher, Registry, Tool

    registry = Registry(
        [
            Tool(
                name="echo",
                description="Echo.",
                handler=_echo,
                parameters=SCHEMA,
                concurrent=True,
                deferred=False,
            )
        ]
    )
    session = Dispatcher(registry).session("bench", mode="direct")
    figures: dict[str, float] = {}
    for size, rounds in SIZES:
        rounds //= 4 if quick else 1
        batches = [_batch(size, r) for r in range(rounds)]
        times = []
        for batch in batches:
            session.new_run()
            t0 = time.perf_counter()
            await session.dispatch(batch)
            times.append(time.perf_counter() - t0)
        figures[f"batch_{size}"] = statistics.median(times) / size * 1e6
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--loop", choices=["trio", "asyncio"], default="trio")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.loop == "trio":
        import trio

        figures = trio.run(measure, args.quick)
    else:
        import asyncio

        figures = asyncio.run(measure(args.quick))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
