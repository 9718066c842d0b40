"""`RedisResultCache`: the result cache in Redis, shared by every worker on every machine.

What is in Redis (every key starts with `{namespace}:`, one hash tag, so a cluster keeps a
namespace on one node and its scripts may touch any of its keys)
    `e:<key>`         an entry: orjson `{"f": 1, "c": content, "r": reads, "t": stored_at}`,
                      with its TTL (`SET ... PX`)
    `r:<resource>`    the keys of the entries that read `resource` (a set)
    `b:<folder>`      the keys of the entries that read something below `folder` (a set)
    `entries`         key -> expiry (ms) of every entry written (a sorted set): the count
    `epoch`           the invalidation counter
    `moved`           resource -> the epoch it was last invalidated at (a sorted set, the
                      newest 10 000 kept); `forgotten` the newest epoch no longer kept
    Resources are kept trimmed (no trailing "/"), as `resources_overlap` compares them.

Invalidation
    An entry that read `x`, anything below `x` or a folder above `x` is found in
    `r:x`, `b:x` and `r:<each folder above x>`: one SUNION, whatever the number of
    entries. Index sets expire with the longest-lived entry they name; members whose
    entry went first (expired, overwritten, dropped through another resource) are pruned
    a few at a time as the set is written, so they cannot outgrow the live ones.

Epochs
    `set_many` is one Lua script: it refuses the writes whose reads overlap what moved
    after epoch `since`, applies the batch's invalidations, and keeps the rest, so no
    write from another worker can slip between the check and the keep. A Redis that lost
    its data (restarted without persistence) starts its epoch again from a base taken from
    its clock, above any epoch it handed out before, and says it forgot what moved before
    it: a read that began before the loss is never stored.

Failure
    A Redis that is down, slow or refusing never fails a call: a lookup that fails is a
    miss, a write that fails is dropped, `epoch()` says -1 (the kernel then stores nothing
    from that batch), each counted in `errors`, one warning per outage on the
    `threepass.cache` logger. A breaker skips Redis for a growing backoff (0.25 s doubling
    to 5 s) and tries again, so the cache resumes within seconds of Redis coming back.
    Invalidations that could not be delivered are kept (up to 1 000 resources; past that,
    every entry of the namespace is dropped instead) and applied before anything else
    once Redis answers, so no entry they should have dropped is served afterwards.

Eviction
    Run Redis with `maxmemory-policy noeviction` (its default) for this store: an evicting
    Redis may drop an index set before the entries it names, and an invalidation would
    then miss them. A full `noeviction` Redis refuses writes, which this store counts and
    drops like any other failure.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import orjson

from ._protocol import CacheCounters, CacheEntry, CacheStatistics, CacheWrite
from ._redis_client import FAILURES, Breaker, RedisConnection, Script, redacted

__all__ = ["RedisResultCache"]

_log = logging.getLogger("threepass.cache")

_FORMAT: Final = 1
_PENDING_KEPT: Final = 1_000
_CLEAR_BATCH: Final = 500

# Shared by the scripts: key names, the folders above a resource, overlap, the epoch.
_LUA_COMMON: Final = r"""
local P = ARGV[1]
local function above(x)
  local out, i = {}, 1
  while true do
    local j = string.find(x, "/", i, true)
    if not j then return out end
    out[#out + 1] = string.sub(x, 1, j - 1)
    i = j + 1
  end
end
local function under(a, b)
  return #a > #b and string.sub(a, 1, #b + 1) == b .. "/"
end
local function overlap(x, y)
  return x == y or under(x, y) or under(y, x)
end
-- numbers handed to redis.call go through "%.14g": epochs and times are formatted whole
local function int(n)
  return string.format("%d", n)
end
local function now_ms()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function current_epoch()
  return tonumber(redis.call("GET", P .. "epoch") or "0")
end
local function forgotten()
  return tonumber(redis.call("GET", P .. "forgotten") or "0")
end
local function bump()
  if not redis.call("GET", P .. "epoch") then
    -- a fresh (or emptied) Redis: start above every epoch handed out before, and say
    -- that what moved before is unknown
    local base = int(now_ms() * 1000)
    redis.call("SET", P .. "forgotten", base)
    redis.call("SET", P .. "epoch", base)
  end
  return redis.call("INCR", P .. "epoch")
end
local function trim_moved(kept)
  local n = redis.call("ZCARD", P .. "moved")
  if n > kept then
    local cut = n - math.floor(kept / 2)
    local last = redis.call("ZRANGE", P .. "moved", cut - 1, cut - 1, "WITHSCORES")
    if tonumber(last[2]) > forgotten() then
      redis.call("SET", P .. "forgotten", last[2])
    end
    redis.call("ZREMRANGEBYRANK", P .. "moved", 0, cut - 1)
  end
end
local function drop(resources)
  local dropped = 0
  if #resources == 0 then return 0 end
  local e = bump()
  for _, x in ipairs(resources) do
    redis.call("ZADD", P .. "moved", int(e), x)
    local sets = {P .. "r:" .. x, P .. "b:" .. x}
    for _, a in ipairs(above(x)) do sets[#sets + 1] = P .. "r:" .. a end
    local keys = redis.call("SUNION", unpack(sets))
    for i = 1, #keys, 500 do
      local last = math.min(i + 499, #keys)
      local names = {}
      for j = i, last do names[#names + 1] = P .. "e:" .. keys[j] end
      dropped = dropped + redis.call("DEL", unpack(names))
      redis.call("ZREM", P .. "entries", unpack(keys, i, last))
    end
    -- every member of these sets overlapped x, so every one was dropped
    redis.call("DEL", unpack(sets))
  end
  trim_moved(tonumber(ARGV[2]))
  return dropped
end
"""

# ARGV: prefix, moved kept, since ("" for none), n, invalidated..., m, then per write:
# key, ttl in ms (0: none), value, k, reads...
# -> {refused as raced, entries dropped, kept}
_SET_MANY: Final = Script(
    _LUA_COMMON
    + r"""
local since = ARGV[3]
local at = 4
local invalidated = {}
for i = 1, tonumber(ARGV[at]) do invalidated[i] = ARGV[at + i] end
at = at + #invalidated + 1
local writes = {}
for _ = 1, tonumber(ARGV[at]) do
  local w = {key = ARGV[at + 1], px = tonumber(ARGV[at + 2]), value = ARGV[at + 3], reads = {}}
  local k = tonumber(ARGV[at + 4])
  for i = 1, k do w.reads[i] = ARGV[at + 4 + i] end
  writes[#writes + 1] = w
  at = at + 4 + k
end

local refuse_all, moved = false, {}
if since ~= "" then
  local s = tonumber(since)
  -- s above the epoch now: this Redis lost the epochs s came from
  if s < forgotten() or s > current_epoch() then
    refuse_all = true
  else
    moved = redis.call("ZRANGEBYSCORE", P .. "moved", "(" .. since, "+inf")
  end
end
local fresh, raced = {}, 0
for _, w in ipairs(writes) do
  local stale = refuse_all
  if not stale and #moved > 0 then
    for _, r in ipairs(w.reads) do
      for _, m in ipairs(moved) do
        if overlap(r, m) then stale = true break end
      end
      if stale then break end
    end
  end
  if stale then raced = raced + 1 else fresh[#fresh + 1] = w end
end

local dropped = drop(invalidated)

local now = now_ms()
redis.call("ZREMRANGEBYSCORE", P .. "entries", "-inf", int(now))
local function index(set, key, px)
  local left = redis.call("PTTL", set)  -- -2: no such set; -1: kept for ever
  redis.call("SADD", set, key)
  if px == 0 then
    redis.call("PERSIST", set)
  elseif left == -2 or (left >= 0 and left < px) then
    redis.call("PEXPIRE", set, px)
  end
  if redis.call("SCARD", set) > 64 then
    -- members whose entry went first: a few pruned per write keeps them a small share
    for _, member in ipairs(redis.call("SRANDMEMBER", set, 8)) do
      if redis.call("EXISTS", P .. "e:" .. member) == 0 then redis.call("SREM", set, member) end
    end
  end
end
for _, w in ipairs(fresh) do
  if w.px == 0 then
    redis.call("SET", P .. "e:" .. w.key, w.value)
    redis.call("ZADD", P .. "entries", "+inf", w.key)
  else
    redis.call("SET", P .. "e:" .. w.key, w.value, "PX", w.px)
    redis.call("ZADD", P .. "entries", int(now + w.px), w.key)
  end
  for _, r in ipairs(w.reads) do
    index(P .. "r:" .. r, w.key, w.px)
    for _, a in ipairs(above(r)) do index(P .. "b:" .. a, w.key, w.px) end
  end
end
return {raced, dropped, #fresh}
"""
)

# ARGV: prefix, moved kept, n, resources... -> entries dropped
_INVALIDATE: Final = Script(
    _LUA_COMMON
    + r"""
local resources = {}
for i = 1, tonumber(ARGV[3]) do resources[i] = ARGV[3 + i] end
return drop(resources)
"""
)

# ARGV: prefix, moved kept, since -> {forgotten (1 or 0), resources...}
_MOVED_SINCE: Final = Script(
    _LUA_COMMON
    + r"""
local s = tonumber(ARGV[3])
if s < forgotten() or s > current_epoch() then return {1} end
local out = {0}
for _, r in ipairs(redis.call("ZRANGEBYSCORE", P .. "moved", "(" .. ARGV[3], "+inf")) do
  out[#out + 1] = r
end
return out
"""
)

# ARGV: prefix -> live entries
_COUNT: Final = Script(
    r"""
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call("ZCOUNT", ARGV[1] .. "entries", "(" .. string.format("%d", now), "+inf")
"""
)


def _trimmed(resource: str) -> bytes:
    """A resource as the index keeps it: no trailing "/", UTF-8 bytes (`surrogatepass`, so
    any `str` path fits; byte prefixes are exactly string prefixes)."""
    trimmed = resource[:-1] if resource.endswith("/") else resource
    return trimmed.encode("utf-8", "surrogatepass")


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _glob_escaped(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _encode(content: str, reads: frozenset[str], stored_at: float) -> bytes:
    document = {"f": _FORMAT, "c": content, "r": sorted(reads), "t": stored_at}
    try:
        return orjson.dumps(document)
    except orjson.JSONEncodeError:  # a lone surrogate: the standard library escapes it
        return json.dumps(document, separators=(",", ":")).encode()


def _decode(raw: bytes) -> CacheEntry | None:
    """The entry in a stored value; None if it is not a current-format entry."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # what _encode wrote with the standard library
            document = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    if type(document) is not dict or document.get("f") != _FORMAT:
        return None
    content, reads, stored_at = document.get("c"), document.get("r"), document.get("t")
    if type(stored_at) is int:
        stored_at = float(stored_at)
    if (
        type(content) is str
        and type(reads) is list
        and type(stored_at) is float
        and all(type(r) is str for r in reads)
    ):
        return CacheEntry(content, frozenset(reads), stored_at)
    return None


class RedisResultCache:
    """A `ResultCache` in Redis at `url` (`redis://[user:password@]host:port/db`), under
    `namespace`, shared by every process that names both.

    `connect_timeout` and `timeout` (seconds) bound each round trip; past them the
    operation counts as failed (see the module's docstring: a miss, a dropped write).
    `clock` stamps `stored_at`; expiry is Redis's own. `threaded` chooses the client: None
    picks per event loop (redis.asyncio on asyncio, the synchronous client in a worker
    thread elsewhere), True always the thread. Usable before any loop runs: clients are
    made on first use, one per loop.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "threepass",
        connect_timeout: float = 0.25,
        timeout: float = 0.5,
        moved_kept: int = 10_000,
        max_connections: int | None = None,
        threaded: bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty and brace-free, got {namespace!r}")
        self._url = redacted(url)
        self._namespace = namespace
        self._prefix = f"{{{namespace}}}:"
        self._moved_kept = max(2, moved_kept)
        self._clock = clock
        self._connection = RedisConnection(
            url,
            connect_timeout=connect_timeout,
            timeout=timeout,
            max_connections=max_connections,
            threaded=threaded,
        )
        self._breaker = Breaker(_log, f"result cache Redis {self._url} (namespace {namespace!r})")
        self._counters = CacheCounters()
        # invalidations not yet delivered; None once more were lost than are kept
        self._pending: list[bytes] | None = []

    @property
    def url(self) -> str:
        """The Redis URL, its password replaced by `***`."""
        return self._url

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def healthy(self) -> bool:
        """False while an outage lasts (from its first failure until Redis answers again)."""
        return not self._breaker.down

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "unreachable"
        return f"<RedisResultCache {self._url} namespace={self._namespace!r} {state}>"

    # -- talking to Redis, through the breaker --------------------------------------------

    async def _usable(self) -> bool:
        """Whether Redis may be used now: the breaker lets it, and invalidations an outage
        held back have been delivered first."""
        if not self._breaker.closed():
            return False
        pending = self._pending
        if pending == []:
            return True
        delivering = None if pending is None else list(pending)
        try:
            if delivering is None:
                await self._clear_entries()
            else:
                await self._connection.evaluate(_INVALIDATE, [], self._drop_args(delivering))
        except FAILURES as exc:
            self._failed(exc)
            return False
        if delivering is None:
            # held back while clearing: still to deliver
            self._pending = [] if self._pending is None else self._pending
        elif pending is not None and self._pending is pending:
            del pending[: len(delivering)]  # what was held back meanwhile stays
        return True

    def _failed(self, exc: BaseException) -> None:
        self._counters.errors += 1
        self._breaker.failed(exc)

    def _hold_back(self, resources: list[bytes]) -> None:
        """Keep invalidations that did not reach Redis, to deliver once it answers."""
        if self._pending is not None:
            self._pending.extend(resources)
            if len(self._pending) > _PENDING_KEPT:
                self._pending = None  # too many to replay: every entry goes instead

    def _drop_args(self, resources: Sequence[bytes]) -> list[Any]:
        return [self._prefix, self._moved_kept, len(resources), *resources]

    # -- the async seam -------------------------------------------------------------------

    async def get(self, key: str) -> CacheEntry | None:
        """The live entry under `key`, or None."""
        return (await self.get_many([key])).get(key)

    async def get_many(self, keys: Sequence[str]) -> dict[str, CacheEntry]:
        asked = list(dict.fromkeys(keys))
        if not asked:
            return {}
        if not await self._usable():
            self._counters.misses += len(asked)
            return {}
        names = [_utf8(self._prefix + "e:") + _utf8(k) for k in asked]
        try:
            values = await self._connection.call(lambda c: c.mget(names))
        except FAILURES as exc:
            self._failed(exc)
            self._counters.misses += len(asked)
            return {}
        self._breaker.succeeded()
        found: dict[str, CacheEntry] = {}
        for key, raw in zip(asked, values, strict=True):
            entry = None if raw is None else _decode(raw)
            if entry is None:
                self._counters.misses += 1
                if raw is not None:
                    self._counters.errors += 1  # not ours (another format, garbage): a miss
                continue
            self._counters.hits += 1
            found[key] = entry
        return found

    async def set(self, key: str, content: str, *, ttl: float, reads: Iterable[str] = ()) -> None:
        """Keep `content` under `key` for `ttl` seconds, remembering what it read."""
        await self.set_many([CacheWrite(key, content, ttl, frozenset(reads))])

    async def set_many(
        self, writes: Sequence[CacheWrite], *, since: int | None = None, invalidate: Iterable[str] = ()
    ) -> None:
        written = [_trimmed(r) for r in invalidate]
        live = [w for w in writes if w.ttl > 0]  # an entry born expired could serve nothing
        if not (live or written):
            return
        if not await self._usable():
            self._hold_back(written)
            return
        now = self._clock()
        args: list[Any] = [self._prefix, self._moved_kept, "" if since is None else str(since)]
        args += [len(written), *written, len(live)]
        for w in live:
            px = 0 if not math.isfinite(w.ttl) else max(1, math.ceil(w.ttl * 1000))
            reads = sorted({_trimmed(r) for r in w.reads})
            args += [_utf8(w.key), px, _encode(w.content, w.reads, now), len(reads), *reads]
        try:
            raced, dropped, kept = await self._connection.evaluate(_SET_MANY, [], args)
        except FAILURES as exc:
            self._failed(exc)
            self._hold_back(written)
            return
        self._breaker.succeeded()
        self._counters.raced += int(raced)
        self._counters.invalidations += int(dropped)
        self._counters.writes += int(kept)

    async def invalidate(self, resources: Iterable[str]) -> int:
        written = [_trimmed(r) for r in resources]
        if not written:
            return 0
        if not await self._usable():
            self._hold_back(written)
            return 0
        try:
            dropped = int(await self._connection.evaluate(_INVALIDATE, [], self._drop_args(written)))
        except FAILURES as exc:
            self._failed(exc)
            self._hold_back(written)
            return 0
        self._breaker.succeeded()
        self._counters.invalidations += dropped
        return dropped

    async def epoch(self) -> int:
        """The invalidation counter in Redis; -1 when Redis cannot say (the kernel then
        stores nothing the batch reads)."""
        if not await self._usable():
            return -1
        try:
            value = await self._connection.call(lambda c: c.get(self._prefix + "epoch"))
        except FAILURES as exc:
            self._failed(exc)
            return -1
        self._breaker.succeeded()
        return int(value) if value is not None else 0

    async def moved_since(self, epoch: int) -> frozenset[str] | None:
        if epoch < 0 or not await self._usable():
            return None
        try:
            found = await self._connection.evaluate(_MOVED_SINCE, [], [self._prefix, self._moved_kept, epoch])
        except FAILURES as exc:
            self._failed(exc)
            return None
        self._breaker.succeeded()
        if found[0] == 1:
            return None
        return frozenset(r.decode("utf-8", "surrogatepass") for r in found[1:])

    async def clear(self) -> None:
        """Drop every entry and index of this namespace (its epochs stay, so a read running
        now still learns what moved while it ran)."""
        if not await self._usable():
            return
        try:
            await self._clear_entries()
        except FAILURES as exc:
            self._failed(exc)
            return
        self._breaker.succeeded()

    async def _clear_entries(self) -> None:
        pattern = _glob_escaped(self._prefix)
        for kind in ("e:", "r:", "b:"):
            match = f"{pattern}{kind}*"
            cursor = 0
            while True:
                cursor, names = await self._scan(cursor, match)
                if names:
                    await self._unlink(names)
                if cursor == 0:
                    break
        await self._connection.call(lambda c: c.unlink(self._prefix + "entries"))

    async def _unlink(self, names: list[bytes]) -> None:
        def unlink(c: Any) -> Any:
            return c.unlink(*names)

        await self._connection.call(unlink)

    async def _scan(self, cursor: int, match: str) -> tuple[int, list[bytes]]:
        def scan(c: Any) -> Any:
            return c.scan(cursor, match=match, count=_CLEAR_BATCH)

        at, names = await self._connection.call(scan)
        return int(at), list(names)

    async def statistics(self) -> CacheStatistics:
        """This object's counts; `entries` as Redis keeps them (the namespace's live
        entries, 0 while Redis is unreachable). `expired` stays 0: Redis expires entries
        itself, and an expired entry is a plain miss."""
        entries = 0
        if await self._usable():
            try:
                entries = int(await self._connection.evaluate(_COUNT, [], [self._prefix]))
            except FAILURES as exc:
                self._failed(exc)
            else:
                self._breaker.succeeded()
        return self._counters.snapshot(entries)

    async def aclose(self) -> None:
        """Close this loop's connections (the next operation opens them again)."""
        await self._connection.aclose()
