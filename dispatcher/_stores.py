"""The session's dealings with its stores, around the pure passes: the result cache's
look-up before pass 1 resolves, its epoch before pass 2, what moved elsewhere before
pass 3 commits, and the writes after it; the error store's records. A store's fault is
logged and never fails a call: a failed look-up is a miss, a failed write is dropped
(on asyncio, a CancelledError a store raises itself is such a fault).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import anyio

from ._backend import ordinary_failure
from ._commit import CommitEffects
from ._plan import Plan
from ._results import shown
from ._seams import CacheEntry, ErrorRecord, ErrorStore, ResultCache

__all__ = ["epoch_before", "look_up", "moved_elsewhere", "remember_failures", "update_store"]

log = logging.getLogger("threepass.session")


_ENTRY_ONLY = frozenset({CacheEntry})


async def look_up(store: ResultCache, keys: Sequence[str]) -> Mapping[str, CacheEntry]:
    """The store's live entries among `keys`; a store's fault is a miss, never a failure."""
    try:
        found = await store.get_many(keys)
    except BaseException as exc:
        if not ordinary_failure(exc):
            raise
        log.warning("result cache lookup failed for %d key(s); treated as misses", len(keys), exc_info=True)
        return {}
    if not isinstance(found, Mapping):
        log.warning("result cache returned %s, not a mapping; treated as misses", shown(found))
        return {}
    if type(found) is dict and _ENTRY_ONLY.issuperset(map(type, found.values())):
        return found  # the common answer, every value an entry: nothing to drop
    good: dict[str, CacheEntry] = {}
    for key, hit in found.items():
        if isinstance(hit, CacheEntry):
            good[key] = hit
        elif hit is not None:
            log.warning("result cache returned %s, not a CacheEntry; treated as a miss", shown(hit))
    return good


async def epoch_before(store: ResultCache, plan: Plan) -> int | None:
    """The store's epoch before pass 2, when a call that runs may be stored (else None);
    -1 when the store cannot say: then nothing this batch reads is stored."""
    if not any(p.cache_key is not None and p.runs for p in plan.calls):
        return None
    try:
        return int(await store.epoch())
    except BaseException as exc:
        if not ordinary_failure(exc):
            raise
        log.warning("result cache epoch unreadable; this batch's results are not stored", exc_info=True)
        return -1


async def moved_elsewhere(store: ResultCache, since: int, moved: frozenset[str]) -> frozenset[str] | None:
    """`moved` and what the store says was invalidated after its epoch `since` (by other
    dispatchers or processes sharing it); None when it cannot say. Shielded: it runs in
    pass 3, which a cancellation must not cut short."""
    if since < 0:
        return None
    with anyio.CancelScope(shield=True):
        try:
            elsewhere = await store.moved_since(since)
        except BaseException as exc:
            if not ordinary_failure(exc):
                raise
            log.warning("result cache epochs unreadable; this batch's reads are not kept", exc_info=True)
            return None
    return None if elsewhere is None else moved | elsewhere


async def update_store(store: ResultCache, effects: CommitEffects, since: int | None) -> None:
    """Pass 3's effects on the result cache: its invalidations and writes in one call (no
    writes when the epoch could not be read)."""
    writes = effects.cache_writes if since != -1 else ()
    if not (effects.invalidations or writes):
        return
    try:
        await store.set_many(writes, since=since, invalidate=effects.invalidations)
    except BaseException as exc:
        if not ordinary_failure(exc):
            raise
        log.warning(
            "result cache update failed (%d writes, invalidating %s)",
            len(writes),
            sorted(effects.invalidations),
            exc_info=True,
        )


async def remember_failures(store: ErrorStore, records: Sequence[ErrorRecord]) -> None:
    """Pass 3's failures, into the error store."""
    try:
        await store.record_many(records)
    except BaseException as exc:
        if not ordinary_failure(exc):
            raise
        log.warning("error store failed to record %d failure(s)", len(records), exc_info=True)
