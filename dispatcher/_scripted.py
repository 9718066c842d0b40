"""`ScriptedRunner`: an in-memory stand-in for running tools, through the `ToolRunner` seam.

With `Dispatcher(registry, runner=ScriptedRunner({...}))` every pass runs as usual —
parsing, schemas, dedupe, the cache, validation, the gate, groups and barriers, timeouts,
history, recording — but a call that would run its handler is answered from the script.
For tests of an agent loop, demos, and dry runs of a transcript. No I/O.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._types import ToolCall, ToolContext

__all__ = ["ScriptedRunner"]

_MISSING: Any = object()


class ScriptedRunner:
    """Answers calls by tool name. Each value of `script` is one of:

    - a list: its items answer the tool's calls in turn (the last one repeats);
    - a callable `(args) -> answer` or `(args, ctx) -> answer` (sync or async);
    - anything else: the answer to every call of that tool.

    An answer is what a handler returns (text, a dict or list, bytes), a whole
    `ToolResult`, or an exception, which is raised, so the call fails as the tool would.
    A tool the script does not name gets `default`, or fails saying it is not scripted.
    `calls` lists the calls answered, in the order they ran.
    """

    def __init__(self, script: Mapping[str, Any], *, default: Any = _MISSING) -> None:
        self._script = dict(script)
        self._default = default
        self._turns: dict[str, Iterator[Any]] = {}
        self._last: dict[str, Any] = {}
        self.calls: list[ToolCall] = []

    async def __call__(self, call: ToolCall, ctx: ToolContext) -> Any:
        self.calls.append(call)
        answer = self._answer(call.name)
        if callable(answer) and not isinstance(answer, type):
            answer = self._call(answer, call, ctx)
            if inspect.isawaitable(answer):
                answer = await answer
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _answer(self, name: str) -> Any:
        entry = self._script.get(name, self._default)
        if entry is _MISSING:
            raise LookupError(f"{name} is not in the script of this ScriptedRunner")
        if not isinstance(entry, list):
            return entry
        turns = self._turns.get(name)
        if turns is None:
            turns = self._turns[name] = iter(entry)
        for item in turns:
            self._last[name] = item
            return item
        if name in self._last:
            return self._last[name]
        raise LookupError(f"the script of {name} is an empty list")

    @staticmethod
    def _call(fn: Callable[..., Any], call: ToolCall, ctx: ToolContext) -> Any:
        args = dict(call.arguments) if isinstance(call.arguments, Mapping) else {}
        try:
            takes_ctx = len(inspect.signature(fn).parameters) >= 2
        except (TypeError, ValueError):
            takes_ctx = False
        return fn(args, ctx) if takes_ctx else fn(args)
