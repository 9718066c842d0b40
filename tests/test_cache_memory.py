"""MemoryResultCache, and the policy rules in cache/_policy.py every store relies on."""

from __future__ import annotations

from typing import Any

import pytest

import cache
from cache import (
    DEFAULT_TTL,
    CacheEntry,
    CachePolicy,
    CacheStatistics,
    MemoryResultCache,
    ResultCache,
    carries_credentials,
    resources_overlap,
)

from ._fakes import FakeClock


def test_public_names() -> None:
    """cache exports exactly its public names."""
    assert sorted(cache.__all__) == sorted(
        [
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
    )


# --- MemoryResultCache ----------------------------------------------------------------------


def test_memory_cache_is_a_result_cache() -> None:
    """MemoryResultCache satisfies the ResultCache protocol."""
    assert isinstance(MemoryResultCache(), ResultCache)


def test_memory_roundtrip() -> None:
    """What was set comes back with its reads and the time it was stored."""
    clock = FakeClock(1000.0)
    memory = MemoryResultCache(clock=clock)
    memory.set_sync("k", "v", ttl=60, reads=["file:/a"])
    assert memory.get_sync("k") == CacheEntry("v", frozenset({"file:/a"}), 1000.0)


def test_memory_expiry_by_clock() -> None:
    """An entry is served until its ttl passes on the clock, then is an expired miss."""
    clock = FakeClock(1000.0)
    memory = MemoryResultCache(clock=clock)
    memory.set_sync("k", "v", ttl=10)
    clock.now += 9.9
    assert memory.get_sync("k") is not None
    clock.now += 0.1
    assert memory.get_sync("k") is None
    assert memory.statistics_sync() == CacheStatistics(hits=1, misses=1, writes=1, expired=1)


def test_memory_invalidation_uses_overlap() -> None:
    """A write drops entries that read it or a folder around it, and spares the rest."""
    memory = MemoryResultCache()
    memory.set_sync("file", "v", ttl=60, reads=["file:/w/a/b.txt"])
    memory.set_sync("folder", "v", ttl=60, reads=["file:/w/a"])
    memory.set_sync("other", "v", ttl=60, reads=["file:/w/b"])
    assert memory.invalidate_sync(["file:/w/a/b.txt"]) == 2
    assert memory.get_sync("other") is not None
    assert memory.get_sync("file") is None and memory.get_sync("folder") is None
    assert memory.statistics_sync().invalidations == 2


def test_memory_max_entries_drops_the_oldest() -> None:
    """Past max_entries the oldest write goes first."""
    memory = MemoryResultCache(max_entries=2)
    for key in ("a", "b", "c"):
        memory.set_sync(key, key, ttl=60)
    assert memory.get_sync("a") is None
    assert memory.get_sync("b") is not None and memory.get_sync("c") is not None
    assert memory.statistics_sync().entries == 2


def test_memory_clear() -> None:
    """clear() leaves no entries."""
    memory = MemoryResultCache()
    memory.set_sync("k", "v", ttl=60)
    memory.clear_sync()
    assert memory.get_sync("k") is None
    assert memory.statistics_sync().entries == 0


# --- resources_overlap ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (["file:/w/a"], ["file:/w/a"], True),
        (["file:/w/a/"], ["file:/w/a"], True),  # a trailing slash is the same resource
        (["file:/w"], ["file:/w/a/b"], True),  # a folder above
        (["file:/w/a/b"], ["file:/w"], True),  # a path below
        (["file:/"], ["file:/any/thing"], True),  # the root overlaps every file
        (["file:/any/thing"], ["file:/"], True),
        (["file:/w/ab"], ["file:/w/a"], False),  # a name prefix is not a folder
        (["file:/w/a0"], ["file:/w/a"], False),
        (["file:/w/a"], ["file:/w/b"], False),
        (["file:/"], ["url:https://e.com/"], False),
        (["url:https://e.com/a"], ["url:https://e.com/a"], True),
        (["file:/w/a"], [], False),
        ([], ["file:/w/a"], False),
        (["file:/x", "file:/w/a"], ["file:/y", "file:/w"], True),  # any pair is enough
    ],
)
def test_resources_overlap(a: list[str], b: list[str], expected: bool) -> None:
    """Resources overlap when equal, or when one is a folder above the other."""
    assert resources_overlap(a, b) is expected
    assert resources_overlap(b, a) is expected


def test_resources_overlap_takes_one_shot_iterables() -> None:
    """Generators work for both sides."""
    assert resources_overlap((r for r in ["file:/w/a"]), (r for r in ["file:/w"]))


# --- carries_credentials ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        {"url": "https://e.com", "headers": {"Authorization": "Bearer x"}},
        {"url": "https://e.com", "headers": {"authorization": "Bearer x"}},
        {"url": "https://e.com", "headers": {"Proxy-Authorization": "Basic x"}},
        {"url": "https://e.com", "headers": {"COOKIE": "s=1"}},
        {"url": "https://e.com", "headers": [["Cookie", "s=1"]]},
        {"url": "https://e.com", "headers": [("Authorization", "x")]},
        {"url": "https://user:pw@e.com/"},
        {"url": "https://user@e.com/"},
        {"url": "https://e.com/?access_token=abc"},
        {"url": "https://e.com/?api_key=abc"},
        {"url": "https://e.com/?X-Amz-Signature=abc"},
        {"url": "https://e.com/?password="},
        {"uri": "https://e.com/?secret=1"},
        {"href": "https://e.com/?client_secret=1"},
        {"url": "https://e.com", "params": {"token": "abc"}},
    ],
)
def test_credentials_are_noticed(args: dict[str, Any]) -> None:
    """A credential header, user info in the URL, or a secret-named parameter is noticed."""
    assert carries_credentials(args)


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"url": "https://e.com/page?q=cats&page=2"},
        {"url": "https://e.com", "headers": {"Accept": "text/html", "User-Agent": "x"}},
        {"url": "https://e.com", "headers": [["Accept", "text/html"]]},
        {"url": "https://e.com", "params": {"q": "cats"}},
        {"query": "my password is hunter2"},  # a search about secrets carries none
        {"url": "http://[::1"},  # unparseable: nothing to see
    ],
)
def test_plain_requests_carry_no_credentials(args: dict[str, Any]) -> None:
    """Requests without credentials may be cached."""
    assert not carries_credentials(args)


# --- CachePolicy --------------------------------------------------------------------------------


def test_cache_policy_defaults() -> None:
    """A policy caches for 30 minutes, shared, for every call by default."""
    policy = CachePolicy()
    assert (policy.ttl, policy.scope, policy.when) == (DEFAULT_TTL, "shared", None)
    assert DEFAULT_TTL == 1800.0


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan")])
def test_cache_policy_rejects_a_ttl_that_is_not_positive(ttl: float) -> None:
    """A ttl that is not a positive number of seconds is refused, showing the value."""
    with pytest.raises(ValueError, match="ttl must be positive") as info:
        CachePolicy(ttl=ttl)
    assert repr(ttl) in str(info.value)


def test_cache_policy_rejects_an_unknown_scope() -> None:
    """Only 'shared' and 'session' are scopes."""
    with pytest.raises(ValueError, match="'global'"):
        CachePolicy(scope="global")  # type: ignore[arg-type]


def test_cache_policy_is_frozen() -> None:
    """A policy cannot be changed after it is made."""
    policy = CachePolicy(ttl=60, scope="session", when=lambda args: args.get("method") == "GET")
    with pytest.raises(AttributeError):
        policy.ttl = 5  # type: ignore[misc]
    assert policy.when is not None and policy.when({"method": "GET"})


@pytest.mark.parametrize(
    ("name", "secret"),
    [("api_key", True), ("accessToken", True), ("X-Amz-Signature", True), ("client_secret", True),
     ("PHPSESSID", True), ("sig", True), ("keyword", False), ("author", False), ("design", False),
     ("monkey", False), ("q", False)],
)  # fmt: skip
def test_query_parameters_are_judged_by_whole_words(name: str, secret: bool) -> None:
    """A query parameter is a credential when one of its words names a secret, not a substring."""
    assert carries_credentials({"url": f"https://example.com/search?{name}=x"}) is secret
