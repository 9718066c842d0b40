"""`RedisSessionStore`: session state in Redis, a lease per session, for workers on many
machines.

What is in Redis (a session's keys share one hash tag, so its scripts run on one node)
    `<namespace>:session:{<id>}:lease`     the holder's token, expiring (`SET NX PX`)
    `<namespace>:session:{<id>}:snapshot`  the bytes the kernel saved
    `<namespace>:session:{<id>}:started`   the call ids marked started since (a set)

Every step that needs the lease (renew, release, save, mark_started) is one Lua script that
checks the token and acts, so a worker whose lease expired cannot act after another took
it. Unlike the result cache, a fault is raised (`RedisStoreError`, naming Redis and the
URL without its password): a batch whose state cannot be kept must not pretend it was.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Final

from dispatcher._exceptions import SessionBusy
from dispatcher._seams import Lease, StoredSession

from ._redis_client import FAILURES, RedisConnection, Script, redacted

__all__ = ["RedisSessionStore", "RedisStoreError"]


class RedisStoreError(ConnectionError):
    """A Redis store could not be reached, did not answer in time, or refused an operation."""


_MARKED_AT_ONCE: Final = 1_000

# KEYS: lease; ARGV: token, ms -> 1 renewed, 0 not held
_RENEW: Final = Script(
    """
if redis.call("GET", KEYS[1]) == ARGV[1] then
  redis.call("PEXPIRE", KEYS[1], ARGV[2])
  return 1
end
return 0
"""
)
# KEYS: lease; ARGV: token
_RELEASE: Final = Script(
    """
if redis.call("GET", KEYS[1]) == ARGV[1] then redis.call("DEL", KEYS[1]) end
return 0
"""
)
# KEYS: lease, snapshot, started; ARGV: token, snapshot, ms to keep (0: for ever) -> 1 saved, 0 not held
_SAVE: Final = Script(
    """
if redis.call("GET", KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] == "0" then
  redis.call("SET", KEYS[2], ARGV[2])
else
  redis.call("SET", KEYS[2], ARGV[2], "PX", ARGV[3])
end
redis.call("DEL", KEYS[3])
return 1
"""
)
# KEYS: lease, started; ARGV: token, ms to keep (0: for ever), call ids... -> 1 marked, 0 not held
_MARK: Final = Script(
    """
if redis.call("GET", KEYS[1]) ~= ARGV[1] then return 0 end
redis.call("SADD", KEYS[2], unpack(ARGV, 3))
if ARGV[2] ~= "0" then redis.call("PEXPIRE", KEYS[2], ARGV[2]) end
return 1
"""
)


class RedisSessionStore:
    """A `SessionStore` in Redis at `url`, under `namespace`. `lease_seconds` is how long
    a lease lives without renewal; `keep_seconds`, if given, how long a session's state is
    kept after its last save (None: until `delete`). `connect_timeout` and `timeout`
    bound each round trip. Clients are made on first use, one per event loop."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "threepass",
        lease_seconds: float = 30.0,
        keep_seconds: float | None = None,
        connect_timeout: float = 0.5,
        timeout: float = 2.0,
        max_connections: int | None = None,
        threaded: bool | None = None,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        if keep_seconds is not None and keep_seconds <= 0:
            raise ValueError(f"keep_seconds must be positive or None, got {keep_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        self._keep_ms = 0 if keep_seconds is None else max(1, round(keep_seconds * 1000))
        self._url = redacted(url)
        self._namespace = namespace
        self._connection = RedisConnection(
            url,
            connect_timeout=connect_timeout,
            timeout=timeout,
            max_connections=max_connections,
            threaded=threaded,
        )

    @property
    def url(self) -> str:
        """The Redis URL, its password replaced by `***`."""
        return self._url

    def __repr__(self) -> str:
        return f"<RedisSessionStore {self._url} namespace={self._namespace!r}>"

    def _keys(self, session_id: str) -> tuple[str, str, str]:
        base = f"{self._namespace}:session:{{{session_id}}}:"
        return base + "lease", base + "snapshot", base + "started"

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    async def _call(self, what: str, operation: Any) -> Any:
        try:
            return await self._connection.call(operation)
        except FAILURES as exc:
            raise RedisStoreError(f"session store Redis {self._url}: could not {what}: {exc}") from exc

    async def _run(self, what: str, script: Script, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._connection.evaluate(script, keys, args)
        except FAILURES as exc:
            raise RedisStoreError(f"session store Redis {self._url}: could not {what}: {exc}") from exc

    # -- the seam -------------------------------------------------------------------------

    async def acquire(self, session_id: str) -> Lease:
        lease_key = self._keys(session_id)[0]
        token = secrets.token_hex(16)
        ms = self._ms(self.lease_seconds)
        taken = await self._call(
            f"take the lease of session {session_id!r}", lambda c: c.set(lease_key, token, nx=True, px=ms)
        )
        if not taken:
            raise SessionBusy(session_id, "its lease is held in Redis")
        return Lease(session_id, token, self.lease_seconds)

    async def renew(self, lease: Lease) -> bool:
        lease_key = self._keys(lease.session_id)[0]
        renewed = await self._run(
            f"renew the lease of session {lease.session_id!r}",
            _RENEW,
            [lease_key],
            [lease.token, self._ms(lease.seconds)],
        )
        return int(renewed) == 1

    async def release(self, lease: Lease) -> None:
        lease_key = self._keys(lease.session_id)[0]
        await self._run(
            f"release the lease of session {lease.session_id!r}", _RELEASE, [lease_key], [lease.token]
        )

    async def load(self, session_id: str) -> StoredSession:
        _, snapshot_key, started_key = self._keys(session_id)

        def both(c: Any) -> Any:
            return c.pipeline(transaction=True).get(snapshot_key).smembers(started_key).execute()

        snapshot, started = await self._call(f"load session {session_id!r}", both)
        return StoredSession(
            snapshot=None if snapshot is None else bytes(snapshot),
            started=frozenset(m.decode("utf-8", "surrogatepass") for m in started),
        )

    async def save(self, lease: Lease, snapshot: bytes) -> None:
        saved = await self._run(
            f"save session {lease.session_id!r}",
            _SAVE,
            list(self._keys(lease.session_id)),
            [lease.token, snapshot, self._keep_ms],
        )
        if int(saved) != 1:
            raise SessionBusy(lease.session_id, "the lease expired or was taken over; nothing saved")

    async def mark_started(self, lease: Lease, call_ids: Sequence[str]) -> None:
        lease_key, _, started_key = self._keys(lease.session_id)
        if not call_ids:
            # nothing to record, but the promise stands: only the holder may act
            holder = await self._call(
                f"read the lease of session {lease.session_id!r}", lambda c: c.get(lease_key)
            )
            if holder is None or holder.decode() != lease.token:
                raise SessionBusy(lease.session_id, "the lease expired or was taken over")
            return
        ids = list(call_ids)
        for start in range(0, len(ids), _MARKED_AT_ONCE):  # Lua unpacks a bounded number of values
            marked = await self._run(
                f"mark calls started in session {lease.session_id!r}",
                _MARK,
                [lease_key, started_key],
                [lease.token, self._keep_ms, *ids[start : start + _MARKED_AT_ONCE]],
            )
            if int(marked) != 1:
                raise SessionBusy(lease.session_id, "the lease expired or was taken over; not all marked")

    async def delete(self, session_id: str) -> None:
        keys = self._keys(session_id)
        await self._call(f"delete session {session_id!r}", lambda c: c.delete(*keys))

    async def aclose(self) -> None:
        """Close this loop's connections (the next operation opens them again)."""
        await self._connection.aclose()
