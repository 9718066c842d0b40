"""What may be cached, for how long, and for whom; and the credential check every write obeys.

Nothing here touches the disk or the clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

import attrs

__all__ = ["DEFAULT_TTL", "CachePolicy", "carries_credentials", "resources_overlap"]

DEFAULT_TTL = 1800.0

_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
_SECRET_WORDS = frozenset(
    {"token", "key", "apikey", "secret", "password", "passwd", "pwd", "signature", "sig", "auth",
     "credential", "credentials", "session", "sessionid", "sessid", "phpsessid", "sid", "jwt", "bearer"}
)  # fmt: skip
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def _names_a_secret(name: str) -> bool:
    """True if one word of the name is a secret's: `api_key`, `accessToken`, `X-Amz-Signature`;
    not `keyword`, `author` or `design`."""
    return any(word.lower() in _SECRET_WORDS for word in _WORD.findall(name))


@attrs.frozen
class CachePolicy:
    """A tool's result-cache policy.

    `scope="shared"` entries serve every session of every dispatcher on the store;
    `scope="session"` entries serve only the session that wrote them. `when(args)`,
    if given, says whether this call's result may be cached at all.
    """

    ttl: float = DEFAULT_TTL
    scope: Literal["shared", "session"] = "shared"
    when: Callable[[Mapping[str, Any]], Any] | None = None

    def __attrs_post_init__(self) -> None:
        if self.scope not in ("shared", "session"):
            raise ValueError(f"scope must be 'shared' or 'session', got {self.scope!r}")
        if not self.ttl > 0:
            raise ValueError(f"ttl must be positive seconds, got {self.ttl!r}")


def _url_has_credentials(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    if parts.username or parts.password:
        return True
    return any(_names_a_secret(name) for name, _ in parse_qsl(parts.query, True))


def carries_credentials(args: Mapping[str, Any]) -> bool:
    """True if the arguments carry a credential: an Authorization, Proxy-Authorization or
    Cookie header, user info in a URL, or a query parameter named like a secret.

    Such a call's result is never written to the result cache.
    """
    headers = args.get("headers")
    if isinstance(headers, Mapping):
        if any(str(name).lower() in _CREDENTIAL_HEADERS for name in headers):
            return True
    elif isinstance(headers, list):
        for pair in headers:
            if isinstance(pair, list | tuple) and pair and str(pair[0]).lower() in _CREDENTIAL_HEADERS:
                return True
    for name in ("url", "uri", "href"):
        value = args.get(name)
        if isinstance(value, str) and _url_has_credentials(value):
            return True
    params = args.get("params")
    return bool(isinstance(params, Mapping) and any(_names_a_secret(str(k)) for k in params))


def _trimmed(resource: str) -> str:
    return resource[:-1] if resource.endswith("/") else resource


def resources_overlap(a: Iterable[str], b: Iterable[str]) -> bool:
    """True if any key of `a` names the same resource as a key of `b`, or a folder above
    or below it (`file:/x` overlaps `file:/x/y`; `file:/` overlaps every file)."""
    bs = [_trimmed(r) for r in b]
    if not bs:
        return False
    for raw in a:
        x = _trimmed(raw)
        for y in bs:
            if x == y or y.startswith(x + "/") or x.startswith(y + "/"):
                return True
    return False
