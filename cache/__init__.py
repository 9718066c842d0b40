"""threepass's result cache: the `ResultCache` seam, its policy, and the stores behind it."""

from ._disk import DEFAULT_SIZE_LIMIT, DiskResultCache, default_cache_dir
from ._memory import MemoryResultCache
from ._policy import DEFAULT_TTL, CachePolicy, carries_credentials, resources_overlap
from ._protocol import CacheEntry, CacheStatistics, CacheWrite, ResultCache

__all__ = [
    "DEFAULT_SIZE_LIMIT",
    "DEFAULT_TTL",
    "CacheEntry",
    "CachePolicy",
    "CacheStatistics",
    "CacheWrite",
    "DiskResultCache",
    "MemoryResultCache",
    "ResultCache",
    "carries_credentials",
    "default_cache_dir",
    "resources_overlap",
]
