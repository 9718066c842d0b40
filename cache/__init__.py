"""threepass's result cache: the `ResultCache` seam, its policy, and the stores behind it;
and the error stores behind the `ErrorStore` seam; the session stores behind `SessionStore`.
The Redis stores need the `redis` extra (`pip install 'threepass[redis]'`) and are
imported on first use."""

from typing import TYPE_CHECKING, Any

from ._disk import DEFAULT_SIZE_LIMIT, DiskResultCache, default_cache_dir
from ._errors import DEFAULT_MAX_RECORDS, DiskErrorStore, MemoryErrorStore
from ._memory import MemoryResultCache
from ._policy import DEFAULT_TTL, CachePolicy, carries_credentials, resources_overlap
from ._protocol import CacheEntry, CacheStatistics, CacheWrite, ResultCache
from ._sessions import DEFAULT_LEASE_SECONDS, MemorySessionStore, SqliteSessionStore

if TYPE_CHECKING:
    from ._redis import RedisResultCache
    from ._redis_sessions import RedisSessionStore, RedisStoreError

_REDIS = {
    "RedisResultCache": "_redis",
    "RedisSessionStore": "_redis_sessions",
    "RedisStoreError": "_redis_sessions",
}

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
    "RedisResultCache",
    "RedisSessionStore",
    "RedisStoreError",
    "ResultCache",
    "SqliteSessionStore",
    "carries_credentials",
    "default_cache_dir",
    "resources_overlap",
]


def __getattr__(name: str) -> Any:
    # the Redis stores import redis-py, an optional extra: only when asked for
    module = _REDIS.get(name)
    if module is None:
        raise AttributeError(f"module 'cache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
