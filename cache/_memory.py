"""`MemoryResultCache`: the result cache in a dict, for tests and short-lived processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from ._policy import resources_overlap
from ._protocol import CacheCounters, CacheEntry, CacheStatistics, CacheWrite

__all__ = ["MemoryResultCache"]

_MOVED_KEPT = 10_000


class MemoryResultCache:
    """A `ResultCache` held in this process's memory. `clock` returns seconds (wall time)."""

    def __init__(self, *, clock: Callable[[], float] = time.time, max_entries: int = 10_000) -> None:
        self._clock = clock
        self._max_entries = max_entries
        self._entries: dict[str, tuple[float, CacheEntry]] = {}
        self._counters = CacheCounters()
        self._epoch = 0
        self._moved: dict[str, int] = {}  # resource -> the epoch an invalidation moved it at
        self._forgotten = 0  # moves up to this epoch are no longer kept

    # -- the async seam (nothing here waits: the dict is in this process) -----------------

    async def get(self, key: str) -> CacheEntry | None:
        """The live entry under `key`, or None."""
        return self.get_sync(key)

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        return self.get_many_sync(keys)

    async def set(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        """Keep `content` under `key` for `ttl` seconds."""
        self.set_sync(key, content, ttl=ttl, reads=reads)

    async def set_many(
        self, writes: Sequence[CacheWrite], *, since: int | None = None, invalidate: Iterable[str] = ()
    ) -> None:
        self.set_many_sync(writes, since=since, invalidate=invalidate)

    async def invalidate(self, resources: Iterable[str]) -> int:
        return self.invalidate_sync(resources)

    async def epoch(self) -> int:
        return self._epoch

    async def moved_since(self, epoch: int) -> frozenset[str] | None:
        if epoch < self._forgotten:
            return None
        return frozenset(r for r, at in self._moved.items() if at > epoch)

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

    def set_many_sync(
        self, writes: Sequence[CacheWrite], *, since: int | None = None, invalidate: Iterable[str] = ()
    ) -> None:
        now = self._clock()
        moved = [r for r, at in self._moved.items() if at > since] if since is not None else []
        forgotten = since is not None and since < self._forgotten  # what moved since is unknown
        fresh = [w for w in writes if not (forgotten or (moved and resources_overlap(w.reads, moved)))]
        self._counters.raced += len(writes) - len(fresh)
        self.invalidate_sync(invalidate)  # the batch's own writes: after the check, before the keep
        for w in fresh:
            if w.key not in self._entries and len(self._entries) >= self._max_entries:
                # dicts keep insertion order: the oldest write goes first
                del self._entries[next(iter(self._entries))]
            self._entries[w.key] = (now + w.ttl, CacheEntry(w.content, w.reads, now))
            self._counters.writes += 1

    def invalidate_sync(self, resources: Iterable[str]) -> int:
        written = list(resources)
        if written:
            self._epoch += 1
            for resource in written:
                self._moved[resource] = self._epoch
            if len(self._moved) > _MOVED_KEPT:  # the oldest moves first: reads do not run that long
                for old in sorted(self._moved, key=self._moved.__getitem__)[: len(self._moved) // 2]:
                    self._forgotten = max(self._forgotten, self._moved.pop(old))
        doomed = [k for k, (_, e) in self._entries.items() if resources_overlap(e.reads, written)]
        for key in doomed:
            del self._entries[key]
        self._counters.invalidations += len(doomed)
        return len(doomed)

    def clear_sync(self) -> None:
        self._entries.clear()

    def statistics_sync(self) -> CacheStatistics:
        return self._counters.snapshot(len(self._entries))
