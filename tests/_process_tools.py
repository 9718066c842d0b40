"""Handlers for `isolation="process"` tests: module-level, so a worker process imports them."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from dispatcher import ToolError


def sleep_forever(args: Mapping[str, Any], ctx: Any) -> str:
    while True:
        time.sleep(60)


def describe_call(args: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
    return {
        "args": dict(args),
        "ctx": type(ctx).__name__,
        "call_id": ctx.call_id,
        "session_id": ctx.session_id,
        "timeout": ctx.timeout,
        "pid": os.getpid(),
    }


def raise_value_error(args: Mapping[str, Any], ctx: Any) -> str:
    raise ValueError("boom in the worker")


def raise_tool_error(args: Mapping[str, Any], ctx: Any) -> str:
    raise ToolError("no such row", retryable=False)


def exit_hard(args: Mapping[str, Any], ctx: Any) -> str:
    os._exit(3)


def unpicklable_result(args: Mapping[str, Any], ctx: Any) -> Any:
    return lambda: None


# --- for tests/test_attack_process_pool.py ---------------------------------------------


def pid_and_clock(args: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
    """The worker's pid and the wall clock (comparable across processes) as it began."""
    return {"pid": os.getpid(), "began": time.time(), "call_id": ctx.call_id}


def note_pid_then_hang(args: Mapping[str, Any], ctx: Any) -> str:
    """Write the worker's pid to `args["path"]`, then never return."""
    with open(args["path"], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(60)


def note_pid_then_spin(args: Mapping[str, Any], ctx: Any) -> str:
    """Write the worker's pid to `args["path"]`, then busy-loop (running, not sleeping)."""
    with open(args["path"], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        pass


def sleep_for(args: Mapping[str, Any], ctx: Any) -> int:
    time.sleep(float(args["s"]))
    return os.getpid()


class NeedsTwo(Exception):
    """Pickles in the worker, fails to unpickle in the host (its __init__ takes two)."""

    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(f"{a}-{b}")


def unloadable_result(args: Mapping[str, Any], ctx: Any) -> Any:
    return NeedsTwo(1, 2)


def spawn_sleeper_then_hang(args: Mapping[str, Any], ctx: Any) -> str:
    """Start a child process (`sleep 30`), note its pid in `args["path"]`, then never return."""
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    with open(args["path"], "a") as f:
        f.write(f"{child.pid}\n")
    while True:
        time.sleep(60)
