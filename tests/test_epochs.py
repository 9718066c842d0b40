"""Nothing stale: a write reaches every session of the dispatcher, and a read that raced a
write (in this dispatcher, another one, or another process sharing the store) is returned
to the model but neither remembered nor stored."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from cache import DiskResultCache, MemoryResultCache
from dispatcher import CachePolicy, CacheWrite, Dispatcher, Registry, ResultCache, Tool, ToolCall

REPO = Path(__file__).resolve().parents[1]


class World:
    """A file the tools read and write, with a gate the test opens to let a read finish."""

    def __init__(self) -> None:
        self.text = "OLD"
        self.reads = 0
        self.hold: anyio.Event | None = None
        self.reading = anyio.Event()

    def registry(self) -> Registry:
        async def fetch(args: Mapping[str, Any], ctx: Any) -> str:
            self.reads += 1
            seen = self.text  # what the read saw when it ran
            self.reading.set()
            if self.hold is not None:
                await self.hold.wait()
            return seen

        async def edit(args: Mapping[str, Any], ctx: Any) -> str:
            self.text = args["text"]
            return "edited"

        url = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}
        text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        return Registry(
            [
                Tool(
                    "fetch_page",
                    "Fetch.",
                    fetch,
                    url,
                    deferred=False,
                    concurrent=True,
                    cache=CachePolicy(scope="shared"),
                    reads=lambda a: {"file:/w/a.txt"},
                ),
                Tool("edit", "Edit.", edit, text, deferred=False, writes=lambda a: {"file:/w/a.txt"}),
            ]
        )


FETCH = [ToolCall("f", "fetch_page", {"url": "https://site.test/a"})]


def edit(text: str, call_id: str = "e") -> list[ToolCall]:
    return [ToolCall(call_id, "edit", {"text": text})]


async def test_a_write_in_one_session_reaches_every_session_of_the_dispatcher() -> None:
    """Session q's edit drops session p's remembered read in the same run: p's next read
    runs and sees the edit, instead of being served the old one."""
    world = World()
    d = Dispatcher(world.registry())
    p, q = d.session("p"), d.session("q")
    await p.dispatch(FETCH)
    [again] = await p.dispatch([ToolCall("f2", "fetch_page", {"url": "https://site.test/a"})])
    assert again.deduped and world.reads == 1
    await q.dispatch(edit("NEW"))
    [after] = await p.dispatch([ToolCall("f3", "fetch_page", {"url": "https://site.test/a"})])
    assert not after.deduped and after.content == "NEW" and world.reads == 2


async def _race(
    world: World, reader: Dispatcher, writer: Dispatcher, store: ResultCache, between: Any = None
) -> None:
    """p's read starts and holds; the write lands (by `between`, or a session of `writer`);
    then the read finishes."""
    world.hold = anyio.Event()
    p = reader.session("p")
    results: list[Any] = []

    async def read() -> None:
        results.extend(await p.dispatch(FETCH))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await world.reading.wait()
        if between is None:
            await writer.session("q").dispatch(edit("NEW"))
        else:
            await between()
        world.hold.set()
    [raced] = results
    assert raced.ok and raced.content == "OLD"  # returned to the model as it was read
    # neither remembered in p's run nor stored: the next read runs and sees the write
    world.hold = None
    [next_in_run] = await p.dispatch([ToolCall("f2", "fetch_page", {"url": "https://site.test/a"})])
    assert not next_in_run.deduped and not next_in_run.cached and next_in_run.content == "NEW"
    [elsewhere] = await reader.session("r").dispatch(FETCH)
    assert elsewhere.content == "NEW"
    # the only entry stored is the fresh read's
    fresh = await reader.session("s").dispatch([ToolCall("f4", "fetch_page", {"url": "https://site.test/a"})])
    assert fresh[0].cached and fresh[0].content == "NEW"


@pytest.mark.parametrize("kind", ["memory", "disk"])
async def test_a_read_that_races_a_write_of_the_same_dispatcher_is_not_kept(
    kind: str, tmp_path: Path
) -> None:
    """Session q writes while session p's read is held open: p's result is returned but not
    deduped in its run, nor cached for the next session."""
    world = World()
    store: ResultCache = MemoryResultCache() if kind == "memory" else DiskResultCache(tmp_path / "c")
    d = Dispatcher(world.registry(), cache=store)
    await _race(world, d, d, store)


@pytest.mark.parametrize("kind", ["memory", "disk"])
async def test_a_read_that_races_a_write_of_another_dispatcher_is_not_stored(
    kind: str, tmp_path: Path
) -> None:
    """Two dispatchers share one store (two workers): B's write while A's read runs keeps
    A's result out of the store (the store's epochs), so nobody is served the old page."""
    world = World()
    if kind == "memory":
        shared = MemoryResultCache()
        store_a: ResultCache = shared
        store_b: ResultCache = shared
    else:
        store_a, store_b = DiskResultCache(tmp_path / "c"), DiskResultCache(tmp_path / "c")
    a = Dispatcher(world.registry(), cache=store_a)
    b = Dispatcher(world.registry(), cache=store_b)
    await _race(world, a, b, store_a)


async def test_a_read_that_races_an_invalidation_from_another_process_is_not_stored(tmp_path: Path) -> None:
    """Another process invalidates the file in the shared disk store while this process's
    read runs: the read is not stored."""
    world = World()
    folder = tmp_path / "c"
    store = DiskResultCache(folder)
    d = Dispatcher(world.registry(), cache=store)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from cache import DiskResultCache
        DiskResultCache({str(folder)!r}).invalidate_sync(["file:/w"])
        """
    )

    async def other_process_writes() -> None:
        world.text = "NEW"
        done = await anyio.run_process([sys.executable, "-c", script], check=False)
        assert done.returncode == 0, done.stderr

    await _race(world, d, d, store, between=other_process_writes)


@pytest.mark.parametrize("kind", ["memory", "disk"])
async def test_stores_refuse_a_write_whose_reads_moved_since_its_epoch(kind: str, tmp_path: Path) -> None:
    """set_many(since=e) keeps a write only if nothing it read (the same resource, a folder
    above or below it) was invalidated after epoch e; the epoch moves with every
    invalidation, cached entries or none."""
    store: ResultCache = MemoryResultCache() if kind == "memory" else DiskResultCache(tmp_path / "c")
    start = await store.epoch()
    await store.invalidate(["file:/w/a.txt"])
    assert await store.epoch() == start + 1
    writes = [
        CacheWrite("same", "x", 60, frozenset({"file:/w/a.txt"})),
        CacheWrite("folder", "x", 60, frozenset({"file:/w"})),
        CacheWrite("below", "x", 60, frozenset({"file:/w/a.txt/part"})),
        CacheWrite("other", "x", 60, frozenset({"file:/w/b.txt"})),
        CacheWrite("none", "x", 60, frozenset()),
    ]
    await store.set_many(writes, since=start)
    assert sorted(await store.get_many([w.key for w in writes])) == ["none", "other"]
    assert (await store.statistics()).raced == 3
    await store.set_many(writes, since=start + 1)  # read after the write: all kept
    assert len(await store.get_many([w.key for w in writes])) == 5
