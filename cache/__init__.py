"""threepass's result cache: the `ResultCache` seam, its policy, and the stores behind it."""

from ._memory import MemoryResultCache
from ._policy import DEFAULT_TTL, CachePolicy, carries_credentials, resources_overlap
from ._protocol import CacheEntry, CacheStatistics, ResultCache

__all__ = [
    "DEFAULT_TTL",
    "CacheEntry",
    "CachePolicy",
    "CacheStatistics",
    "MemoryResultCache",
    "ResultCache",
    "carries_credentials",
    "resources_overlap",
]
