"""The one credential rule: which arguments carry a secret. The result cache never stores
such a call's result.

Pure: nothing here touches the disk, the network or the clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

__all__ = ["carries_credentials"]

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
