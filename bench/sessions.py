"""A long-lived server stays bounded: resident memory while 100,000 sessions are opened,
used for one call and closed, beside the same without closing them, in one run.

    python -m bench.sessions [--sessions 100000] [--write]
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
from collections.abc import Mapping
from typing import Any

import trio
import trio.lowlevel

from dispatcher import Dispatcher, Registry, Tool


def _rss_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


async def _echo(args: Mapping[str, Any], ctx: Any) -> str:
    return str(args["text"])


async def measure(sessions: int, close: bool) -> list[tuple[int, float]]:
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    d = Dispatcher(Registry([Tool("echo", "Echo.", _echo, schema, deferred=False)]))
    call = [
        {"id": "c", "type": "function", "function": {"name": "echo", "arguments": json.dumps({"text": "hi"})}}
    ]
    samples = []
    step = max(1, sessions // 10)
    for i in range(1, sessions + 1):
        s = d.session(f"conversation-{i}")
        await s.dispatch(call)
        if close:
            s.close()
        if i % 100 == 0:
            # a real loop awaits the model between batches; without any checkpoint trio
            # never runs its scheduler, and never prunes the deadlines of finished calls
            await trio.lowlevel.checkpoint()
        if i % step == 0:
            gc.collect()
            samples.append((i, _rss_mib()))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--write", action="store_true", help="put the figures into bench/RESULTS.md")
    args = parser.parse_args()
    closed = trio.run(measure, args.sessions, True)
    kept = trio.run(measure, args.sessions, False)
    lines = [f"resident MiB after N sessions, each dispatching one call ({args.sessions} in all):"]
    lines.append(f"{'sessions':>10} {'closed':>10} {'never closed':>14}")
    for (n, a), (_, b) in zip(closed, kept, strict=True):
        lines.append(f"{n:>10} {a:>10.1f} {b:>14.1f}")
    growth = closed[-1][1] - closed[0][1]
    never = kept[-1][1] - kept[0][1]
    lines.append(
        f"from the first sample to the last: closed {growth:+.1f} MiB, never closed {never:+.1f} MiB"
    )
    print("\n".join(lines))
    if args.write:
        from bench.sections import write_section

        command = " ".join(["python -m bench.sessions", *map(shlex.quote, sys.argv[1:])])
        write_section("sessions", "Sessions opened and closed", command, lines)


if __name__ == "__main__":
    main()
