"""A guard for tests that open sockets: loopback only, every connection recorded.

`guard_network(monkeypatch)` wraps `socket.socket.connect` (and `connect_ex`) and
`socket.getaddrinfo` for the rest of the test. A connection to anything but a
loopback address is recorded and refused, so nothing leaves the machine; a lookup of
a name (not a number) is recorded and refused too, so no DNS query goes out. Tests
assert on what was recorded: "no connection attempted" is `guard.connects == []`.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import attrs
import pytest

__all__ = ["NetworkGuard", "guard_network"]


@attrs.define
class NetworkGuard:
    """What the code under test tried: (host, port) connection targets and names looked up."""

    connects: list[tuple[str, int]] = attrs.field(factory=list)
    refused: list[tuple[str, int]] = attrs.field(factory=list)
    lookups: list[str] = attrs.field(factory=list)

    def check_connect(self, sock: socket.socket, address: Any) -> None:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return  # a local socket (AF_UNIX) never leaves the machine
        host, port = str(address[0]), int(address[1])
        self.connects.append((host, port))
        if not _is_loopback(host):
            self.refused.append((host, port))
            raise ConnectionRefusedError(f"the test's network guard refuses {host}:{port}")

    def check_lookup(self, host: object, flags: int) -> None:
        if host is None or flags & socket.AI_NUMERICHOST:
            return
        name = host.decode("ascii", "replace") if isinstance(host, bytes) else str(host)
        try:
            ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            self.lookups.append(name)
            message = f"the test's network guard refuses to look up {name!r}"
            raise socket.gaierror(socket.EAI_NONAME, message) from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def guard_network(monkeypatch: pytest.MonkeyPatch) -> NetworkGuard:
    """Install the guard for the current test and return its record."""
    guard = NetworkGuard()
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def connect(self: socket.socket, address: Any) -> None:
        guard.check_connect(self, address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        guard.check_connect(self, address)
        return real_connect_ex(self, address)

    def getaddrinfo(
        host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
    ) -> Any:
        guard.check_lookup(host, flags)
        return real_getaddrinfo(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return guard
