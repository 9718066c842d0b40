"""`MemoryResultCache`: the result cache in a dict, for tests and short-lived processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from ._policy import resources_overlap
from ._protocol import CacheCounters, CacheEntry, CacheStatistics, CacheWrite

__all__ = ["MemoryResultCache"]


class MemoryResultCache:
    """A `ResultCache` held in this process's memory. `clock` returns seconds (wall time)."""

    def __init__(self, *, clock: Callable[[], float] = time.time, max_entries: int = 10_000) -> None:
        self._clock = clock
        self._max_entries = max_entries
        self._entries: dict[str, tuple[float, CacheEntry]] = {}
        self._counters = CacheCounters()

    # -- the async seam (nothing here waits: the dict is in this process) -----------------

    async def get(self, key: str) -> CacheEntry | None:
        """The live entry under `key`, or None."""
        return self.get_sync(key)

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        return self.get_many_sync(keys)

    async def set(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        """Keep `content` under `key` for `ttl` seconds."""
        self.set_sync(key, content, ttl=ttl, reads=reads)

    async def set_many(self, writes: Sequence[CacheWrite]) -> None:
        self.set_many_sync(writes)

    async def invalidate(self, resources: Iterable[str]) -> int:
        return self.invalidate_sync(resources)

    async def clear(self) -> None:
        self.clear_sync()

    async def statistics(self) -> CacheStatistics:
        return self.statistics_sync()

    # -- the same, synchronous, for code without an event loop ---------------------------

    def get_sync(self, key: str) -> CacheEntry | None:
        found = self._entries.get(key)
        if found is None:
            self._counters.misses += 1
            return None
        expires_at, entry = found
        if self._clock() >= expires_at:
            del self._entries[key]
            self._counters.expired += 1
            self._counters.misses += 1
            return None
        self._counters.hits += 1
        return entry

    def get_many_sync(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        found = {}
        for key in dict.fromkeys(keys):  # each distinct key counted once, as a disk store does
            entry = self.get_sync(key)
            if entry is not None:
                found[key] = entry
        return found

    def set_sync(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        self.set_many_sync([CacheWrite(key, content, ttl, frozenset(reads))])

    def set_many_sync(self, writes: Sequence[CacheWrite]) -> None:
        now = self._clock()
        for w in writes:
            if w.key not in self._entries and len(self._entries) >= self._max_entries:
                # dicts keep insertion order: the oldest write goes first
                del self._entries[next(iter(self._entries))]
            self._entries[w.key] = (now + w.ttl, CacheEntry(w.content, w.reads, now))
            self._counters.writes += 1

    def invalidate_sync(self, resources: Iterable[str]) -> int:
        written = list(resources)
        doomed = [k for k, (_, e) in self._entries.items() if resources_overlap(e.reads, written)]
        for key in doomed:
            del self._entries[key]
        self._counters.invalidations += len(doomed)
        return len(doomed)

    def clear_sync(self) -> None:
        self._entries.clear()

    def statistics_sync(self) -> CacheStatistics:
        return self._counters.snapshot(len(self._entries))
