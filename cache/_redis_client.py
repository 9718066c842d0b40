"""The connection to Redis shared by the Redis stores: a client per event loop, made on
first use, and a breaker that keeps an unreachable Redis from costing every call a timeout.

Which client
    On asyncio, redis-py's `redis.asyncio` client, one per running loop (a client binds to
    the loop it first connected on). On trio, or any other loop, redis-py's synchronous
    client in a worker thread (`anyio.to_thread`): its asyncio client does not run there,
    and coredis, which does, keeps its pool in a task group that lives only inside
    `async with client:`, which a store handed to a `Dispatcher` never gets. Loopback
    round trips measured for each are in bench/RESULTS.md's Redis section.

Timeouts
    Connect and read timeouts are short (a few hundred ms) and redis-py's own retries are
    off: the store decides what a failure means, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import urllib.parse
import weakref
from collections.abc import Callable
from typing import Any, Final

import anyio
import anyio.to_thread
import sniffio

try:
    import redis
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff
    from redis.exceptions import NoScriptError, RedisError
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Redis stores need redis-py: pip install 'threepass[redis]'") from exc

__all__ = ["FAILURES", "Breaker", "RedisConnection", "Script", "redacted"]

# What an unreachable, slow or refusing Redis raises through redis-py (its ConnectionError
# and TimeoutError are RedisErrors; a socket's own errors are OSErrors; a deadline that
# passed on the loop is a TimeoutError).
FAILURES: Final = (RedisError, OSError, TimeoutError)

_BACKOFF_FIRST: Final = 0.25
_BACKOFF_CAP: Final = 5.0


def redacted(url: str) -> str:
    """`url` with its password, if any, replaced by `***`."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class Script:
    """A Lua script run by its SHA1, sent whole only when the server does not know it yet."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class RedisConnection:
    """Clients for one Redis URL, made lazily: one `redis.asyncio` client per asyncio loop,
    or one synchronous client used from worker threads on any other loop (`threaded=True`
    chooses that on asyncio too)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        timeout: float,
        max_connections: int | None = None,
        threaded: bool | None = None,
    ) -> None:
        self.url = url
        self._options: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout,
            "socket_timeout": timeout,
            "max_connections": max_connections,
            "retry_on_timeout": False,
        }
        # a deadline on the loop too, for what socket timeouts do not cover (a connect
        # that resolves a name first, a command queued behind a stuck one)
        self._deadline = connect_timeout + timeout
        self._threaded = threaded
        self._sync: Any = None
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )

    def _on_asyncio(self) -> bool:
        if self._threaded:
            return False
        try:
            return sniffio.current_async_library() == "asyncio"
        except sniffio.AsyncLibraryNotFoundError:
            return False

    def _sync_client(self) -> Any:
        if self._sync is None:
            self._sync = redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), **self._options)
        return self._sync

    def _async_client(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._per_loop.get(loop)
        if client is None:
            client = redis.asyncio.Redis.from_url(self.url, retry=AsyncRetry(NoBackoff(), 0), **self._options)
            self._per_loop[loop] = client
        return client

    async def call(self, operation: Callable[[Any], Any]) -> Any:
        """`operation(client)` on this loop's client: awaited on asyncio, in a worker thread
        elsewhere. The same operation serves both, as redis-py's two clients share names."""
        if self._on_asyncio():
            with anyio.fail_after(self._deadline):
                return await operation(self._async_client())
        return await anyio.to_thread.run_sync(operation, self._sync_client())

    async def evaluate(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """Run `script` on the server (EVALSHA, then EVAL if the server lost it)."""
        try:
            return await self.call(lambda c: c.evalsha(script.sha, len(keys), *keys, *args))
        except NoScriptError:
            return await self.call(lambda c: c.eval(script.source, len(keys), *keys, *args))

    async def aclose(self) -> None:
        """Close this loop's client (asyncio) and the threaded client's connections."""
        if self._on_asyncio():
            client = self._per_loop.pop(asyncio.get_running_loop(), None)
            if client is not None:
                await client.aclose()
        self.close()

    def close(self) -> None:
        """Close the threaded client's connections (they reopen on the next call)."""
        if self._sync is not None:
            self._sync.close()
            self._sync = None


class Breaker:
    """After a failure, Redis is skipped for a backoff that doubles from 0.25 s up to 5 s,
    then tried again: a store that is down costs one timeout per backoff, not per call, and
    is used again within seconds of coming back. One warning when an outage begins, one
    info line when it ends."""

    def __init__(self, log: logging.Logger, what: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._what = what
        self._clock = clock
        self._backoff = 0.0
        self._retry_at = 0.0
        self._down_since: float | None = None
        self.skipped = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def closed(self) -> bool:
        """True if Redis may be tried now (False: skip it, an outage's backoff is running)."""
        if self._down_since is None or self._clock() >= self._retry_at:
            return True
        self.skipped += 1
        return False

    def failed(self, exc: BaseException) -> None:
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
            self._log.warning(
                "%s unreachable (%s: %s); tool calls still run, uncached, until it answers again",
                self._what,
                type(exc).__name__,
                exc or "no detail",
            )
        self._backoff = min(max(self._backoff * 2, _BACKOFF_FIRST), _BACKOFF_CAP)
        self._retry_at = now + self._backoff

    def succeeded(self) -> None:
        if self._down_since is not None:
            self._log.info(
                "%s answers again after %.1f s (%d operations skipped meanwhile)",
                self._what,
                self._clock() - self._down_since,
                self.skipped,
            )
        self._down_since = None
        self._backoff = 0.0
        self.skipped = 0
