"""The seam between the dispatcher and a result store: `ResultCache`, and the values it holds.

A store is synchronous: a lookup is part of pass 1, which never awaits. Stores keep
their own clock (injectable) for expiry. Nothing from `dispatcher` is imported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

__all__ = ["CacheCounters", "CacheEntry", "CacheStatistics", "ResultCache"]


@attrs.frozen
class CacheEntry:
    """One cached success: the content the model saw and the resources it read."""

    content: str
    reads: frozenset[str] = frozenset()
    stored_at: float = 0.0


@attrs.frozen
class CacheStatistics:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    invalidations: int = 0
    expired: int = 0
    errors: int = 0
    entries: int = 0


@attrs.define
class CacheCounters:
    """A store's running counts (mutable, private to the store); `snapshot` freezes them."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    invalidations: int = 0
    expired: int = 0
    errors: int = 0

    def snapshot(self, entries: int) -> CacheStatistics:
        return CacheStatistics(
            hits=self.hits,
            misses=self.misses,
            writes=self.writes,
            invalidations=self.invalidations,
            expired=self.expired,
            errors=self.errors,
            entries=entries,
        )


@runtime_checkable
class ResultCache(Protocol):
    """A result store keyed by the dispatcher's cache key (a hex string)."""

    def get(self, key: str) -> CacheEntry | None:
        """The live entry under `key`, or None (missing, expired, unreadable)."""
        ...

    def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        """The live entries among `keys`, as `get` would find each: pass 1 asks once per
        batch, so a store can answer in one round trip. Counted as one get per key."""
        ...

    def set(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        """Store `content` under `key` for `ttl` seconds, remembering what it read."""
        ...

    def invalidate(self, resources: Iterable[str]) -> int:
        """Drop every entry whose reads overlap `resources`; return how many were dropped."""
        ...

    def clear(self) -> None: ...

    def statistics(self) -> CacheStatistics: ...
