"""The stores' side of the kernel's `ResultCache` seam: the seam and its values are the
kernel's (`dispatcher._seams`), re-exported here; `CacheCounters` is what every store
counts with."""

from __future__ import annotations

import attrs

from dispatcher._seams import CacheEntry, CacheStatistics, CacheWrite, ResultCache

__all__ = ["CacheCounters", "CacheEntry", "CacheStatistics", "CacheWrite", "ResultCache"]


@attrs.define
class CacheCounters:
    """A store's running counts (mutable, private to the store); `snapshot` freezes them."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    invalidations: int = 0
    expired: int = 0
    errors: int = 0
    raced: int = 0

    def snapshot(self, entries: int) -> CacheStatistics:
        return CacheStatistics(
            hits=self.hits,
            misses=self.misses,
            writes=self.writes,
            invalidations=self.invalidations,
            expired=self.expired,
            errors=self.errors,
            entries=entries,
            raced=self.raced,
        )
