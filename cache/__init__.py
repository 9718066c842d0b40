"""threepass's result cache: the `ResultCache` seam, its policy, and the stores behind it;
the error stores behind the `ErrorStore` seam; the session stores behind `SessionStore`."""

from ._disk import DEFAULT_SIZE_LIMIT, DiskResultCache, default_cache_dir
from ._errors import DEFAULT_MAX_RECORDS, DiskErrorStore, MemoryErrorStore
from ._memory import MemoryResultCache
from ._policy import DEFAULT_TTL, CachePolicy, carries_credentials, resources_overlap
from ._protocol import CacheEntry, CacheStatistics, CacheWrite, ResultCache
from ._sessions import DEFAULT_LEASE_SECONDS, MemorySessionStore, SqliteSessionStore

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_MAX_RECORDS",
    "DEFAULT_SIZE_LIMIT",
    "DEFAULT_TTL",
    "CacheEntry",
    "CachePolicy",
    "CacheStatistics",
    "CacheWrite",
    "DiskErrorStore",
    "DiskResultCache",
    "MemoryErrorStore",
    "MemoryResultCache",
    "MemorySessionStore",
    "ResultCache",
    "SqliteSessionStore",
    "carries_credentials",
    "default_cache_dir",
    "resources_overlap",
]
