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
