"""Worker processes for `Tool(isolation="process")`: a sync handler that may never return
runs in a process of its own, which is killed (SIGKILL) at the call's timeout with the
processes it started (its process group), so its limiter slot is free at once instead of
held by a thread nobody can stop.

A pool per Dispatcher, started on the first such call. Workers come from the
"forkserver" start method (a fresh server, forked per worker: no copy of the host's
threads or locks) and are kept between calls; a worker that was killed or died is
replaced by a new one on the next call (a call given one that had ended before the call
reached it goes to another). What crosses the boundary is pickled: the
handler by reference (module and qualified name, which registration checks), the
arguments, the result, and a `ProcessContext` in place of the ToolContext.

This module is what registration needs (the registry imports it, so it keeps to no
thread, process or event loop); the pool of workers and their loop are `_pool`.
"""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["ProcessContext", "why_not_importable"]


@attrs.frozen
class ProcessContext:
    """What a handler run with `isolation="process"` receives as `ctx`: a picklable snapshot
    of the call (the session's state, history and `invoke` live in the host process and
    cannot cross). `timeout` is the call's, in seconds."""

    call_id: str
    tool_name: str
    session_id: str
    run_id: int
    round: int
    timeout: float


def why_not_importable(fn: Callable[..., Any]) -> str | None:
    """Why a worker process could not get `fn` by pickling it, or None if it can."""
    if isinstance(fn, types.FunctionType):
        qualname = fn.__qualname__
        if "<lambda>" in qualname:
            return "a lambda cannot be imported by a worker process; define a module-level function"
        if "<locals>" in qualname:
            return (
                f"{qualname} is defined inside a function, so a worker process cannot import it; "
                "define it at module level"
            )
        if fn.__module__ == "__main__":
            return (
                f"{qualname} is defined in __main__, which a worker process does not import; "
                "define it in a module"
            )
        found: Any = sys.modules.get(fn.__module__)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is not fn:
            return f"{fn.__module__}.{qualname} does not name it, so a worker process cannot import it"
    try:
        pickle.dumps(fn)
    except Exception as exc:
        return f"it cannot be pickled for a worker process: {exc}"
    return None
