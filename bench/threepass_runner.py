"""threepass behind the harness's `BatchRunner` protocol (bench/workloads.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cache import ResultCache
from dispatcher import Dispatcher, Registry, Tool

from .workloads import Call, LoopName, Toolbox, ToolFn

__all__ = ["ThreepassAsyncioRunner", "ThreepassRunner"]


def _handler(fn: ToolFn) -> Any:
    async def handler(args: Mapping[str, Any], ctx: Any) -> str:
        return await fn(**args)

    return handler


class ThreepassRunner:
    """One session; each `run_batch` is one run (dedupe starts empty, as in a new user turn)."""

    loop: LoopName = "trio"

    def __init__(self, limit: int | None = None, cache: ResultCache | None = None) -> None:
        self.name = "threepass" if limit is None else f"threepass (limit {limit})"
        self._limit = limit
        self._cache = cache

    async def setup(self, toolbox: Toolbox) -> None:
        registry = Registry(
            [
                Tool(
                    name=spec.name,
                    description=spec.description,
                    handler=_handler(spec.fn),
                    parameters=spec.parameters,
                    concurrent=spec.concurrent,
                    deferred=False,
                    reads=spec.reads,
                    writes=spec.writes,
                )
                for spec in toolbox.specs
            ]
        )
        self.dispatcher = Dispatcher(registry, max_concurrent=self._limit, cache=self._cache)
        self.session = self.dispatcher.session("bench", mode="direct")

    async def run_batch(self, calls: Sequence[Call]) -> list[str]:
        self.session.new_run()
        results = await self.session.dispatch([c.as_openai_chat() for c in calls])
        return [r.content for r in results]


class ThreepassAsyncioRunner(ThreepassRunner):
    """threepass on asyncio, the loop the peers run on: the fair comparison for asyncio users."""

    loop: LoopName = "asyncio"

    def __init__(self, limit: int | None = None, cache: ResultCache | None = None) -> None:
        super().__init__(limit, cache)
        self.name = "threepass (asyncio)" if limit is None else f"threepass (asyncio, limit {limit})"
