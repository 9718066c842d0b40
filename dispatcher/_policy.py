"""What may be cached, for how long, and for whom (`CachePolicy`), and when two resource
keys name the same thing (`resources_overlap`).

Pure: nothing here touches the disk or the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import attrs

__all__ = ["DEFAULT_TTL", "NO_RESOURCES", "CachePolicy", "resources_overlap"]

DEFAULT_TTL = 1800.0

NO_RESOURCES: frozenset[str] = frozenset()
"""What a call that reads (or writes) nothing holds: one value, made once."""


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
