"""The session applies what pass 3 returns: the store is told its invalidations and writes,
and a store's fault never fails a call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cache import CacheEntry, CachePolicy, CacheWrite, MemoryResultCache
from dispatcher import Dispatcher, Registry, Tool, ToolCall

from ._fakes import file_at_path, path_schema


def _registry(calls: list[str]) -> Registry:
    def fetch(args: Mapping[str, Any], ctx: Any) -> str:
        calls.append(args["url"])
        return f"page {args['url']}"

    def write(args: Mapping[str, Any], ctx: Any) -> str:
        return "written"

    return Registry(
        [
            Tool(
                name="fetch_page",
                description="Fetch.",
                handler=fetch,
                parameters={"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
                deferred=False,
                concurrent=True,
                cache=CachePolicy(ttl=60),
                reads=lambda a: {f"file:/w/{a['url']}"},
            ),
            Tool(
                name="write_file",
                description="Write.",
                handler=write,
                parameters=path_schema(),
                deferred=False,
                writes=file_at_path,
            ),
        ]
    )


def fetch(url: str, call_id: str) -> ToolCall:
    return ToolCall(call_id, "fetch_page", {"url": url})


async def test_a_write_drops_the_stores_entries_that_read_it() -> None:
    """A successful write drops result-cache entries whose reads overlap it, and no others."""
    store = MemoryResultCache()
    await store.set("k1", "x", ttl=60, reads=["file:/w/a"])
    await store.set("k2", "y", ttl=60, reads=["file:/other"])
    d = Dispatcher(_registry([]), cache=store)
    [r] = await d.session("s").dispatch([ToolCall("c1", "write_file", {"path": "/w"})])
    assert r.ok
    assert await store.get("k1") is None
    assert await store.get("k2") is not None


async def test_a_cached_success_is_served_from_the_store_until_its_ttl() -> None:
    """A cacheable success is written to the store; another session is served it (cached,
    nothing runs) until the tool's ttl passes by the store's clock."""
    now = [1000.0]
    calls: list[str] = []
    store = MemoryResultCache(clock=lambda: now[0])
    d = Dispatcher(_registry(calls), cache=store)
    [first] = await d.session("a").dispatch([fetch("u", "c1")])
    assert first.ok and not first.cached and calls == ["u"]
    now[0] = 1059.0
    [hit] = await d.session("b").dispatch([fetch("u", "c2")])
    assert hit.cached and hit.content == "page u" and calls == ["u"]
    assert (await store.statistics()).writes == 1  # a hit is not written back
    now[0] = 1060.0
    [again] = await d.session("c").dispatch([fetch("u", "c3")])
    assert not again.cached and calls == ["u", "u"]


class _Broken(MemoryResultCache):
    """A store whose every operation fails."""

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        raise OSError("store down")

    async def set_many(self, writes: Sequence[CacheWrite]) -> None:
        raise OSError("store down")

    async def invalidate(self, resources: Iterable[str]) -> int:
        raise OSError("store down")


async def test_a_failing_store_fails_no_call() -> None:
    """A store that raises on lookup, write and invalidation: every call still runs and
    succeeds, the run's dedupe still works, and a write still drops remembered reads."""
    calls: list[str] = []
    d = Dispatcher(_registry(calls), cache=_Broken())
    s = d.session("s")
    [a] = await s.dispatch([fetch("a", "c1")])
    [again] = await s.dispatch([fetch("a", "c2")])
    assert a.ok and again.ok and again.deduped and calls == ["a"]
    [w] = await s.dispatch([ToolCall("c3", "write_file", {"path": "/w/a"})])
    assert w.ok
    [after] = await s.dispatch([fetch("a", "c4")])
    assert after.ok and not after.deduped and calls == ["a", "a"]
