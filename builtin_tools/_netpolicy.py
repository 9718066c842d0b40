"""The network policy of the web tools: which addresses they may connect to.

Pure code over values: no sockets, no resolver, no clock. The web tools resolve a
host once, ask `NetworkPolicy.check` about every address it resolved to, and connect
only to an address it passed (`builtin_tools/web.py` does the I/O).

The rules, in the order they are applied:

1. Always refused: link-local (where cloud metadata services listen), the metadata
   and credential addresses outside it (AWS, Alibaba, Google, Oracle, Azure), "this
   network" and the unspecified address (both reach the local host on Linux),
   multicast, and the reserved 240.0.0.0/4 (with broadcast).
2. Refused unless `allow_private=True`: loopback, the private ranges, carrier-grade
   NAT, and the other special-purpose ranges no public server lives in.
3. An IPv6 address that carries an IPv4 address (IPv4-mapped, IPv4-compatible,
   IPv4-translated, 6to4, NAT64, Teredo) is refused when the IPv4 address it
   carries is.

Nothing from the dispatcher, and nothing that does I/O, may be imported here.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import attrs

__all__ = ["Address", "NetworkPolicy", "RefusedAddress", "numeric_host", "parse_address"]

Address = IPv4Address | IPv6Address

_PRIVATE_OPTION = "allow_private_network=True"


_Table = tuple[tuple[IPv4Network | IPv6Network, str], ...]


def _table(*rows: tuple[str, str]) -> _Table:
    return tuple((ipaddress.ip_network(net), name) for net, name in rows)


# The metadata addresses come first: most lie inside a range allowed with
# `allow_private` (carrier-grade NAT, unique local, IETF protocol assignments), and
# none may ever be allowed. Azure's WireServer is a public address, reachable from
# every Azure VM, that hands out the VM's provisioning data and certificates.
_ALWAYS_REFUSED = _table(
    ("169.254.0.0/16", "link-local, where cloud metadata services listen"),
    ("100.100.100.200/32", "a cloud metadata service (Alibaba Cloud)"),
    ("fd00:ec2::254/128", "a cloud metadata service (AWS EC2, IPv6)"),
    ("fd00:ec2::23/128", "a cloud credentials service (AWS EKS Pod Identity, IPv6)"),
    ("fd20:ce::254/128", "a cloud metadata service (Google Cloud, IPv6)"),
    ("fd00:c1::a9fe:a9fe/128", "a cloud metadata service (Oracle Cloud, IPv6)"),
    ("192.0.0.192/32", "a cloud metadata service (Oracle Cloud Classic)"),
    ("168.63.129.16/32", "a cloud metadata service (Azure WireServer)"),
    ("fe80::/10", "link-local"),
    ("0.0.0.0/8", '"this network", which reaches the local host'),
    ("::/128", "the unspecified address, which reaches the local host"),
    ("224.0.0.0/4", "multicast"),
    ("ff00::/8", "multicast"),
    ("240.0.0.0/4", "reserved, with broadcast"),
)

_PRIVATE = _table(
    ("127.0.0.0/8", "loopback"),
    ("::1/128", "loopback"),
    ("10.0.0.0/8", "a private range"),
    ("172.16.0.0/12", "a private range"),
    ("192.168.0.0/16", "a private range"),
    ("100.64.0.0/10", "carrier-grade NAT (shared address space)"),
    ("fc00::/7", "unique local (private)"),
    ("fec0::/10", "site-local (the old private range)"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("198.18.0.0/15", "benchmarking"),
    ("192.0.2.0/24", "documentation"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("2001:db8::/32", "documentation"),
    ("100::/64", "discard-only"),
)

_IPV4_COMPATIBLE = IPv6Network("::/96")
_IPV4_TRANSLATED = IPv6Network("::ffff:0:0:0/96")
_NAT64 = IPv6Network("64:ff9b::/96")
_LOCAL_NAT64 = IPv6Network("64:ff9b:1::/48")


class RefusedAddress(PermissionError):
    """The network policy refused the address a host resolved to; nothing was sent."""

    def __init__(self, host: str, address: Address, rule: str) -> None:
        self.host = host
        self.address = address
        self.rule = rule
        named = str(address) if _same_host(host, address) else f"{host!r} ({address})"
        super().__init__(f"the network policy refuses {named}: {rule}")


@attrs.frozen
class NetworkPolicy:
    """Which addresses the web tools may connect to. `allow_private` lets loopback and
    the private ranges through; the always-refused set stays refused."""

    allow_private: bool = False

    def check(self, address: str | Address) -> str | None:
        """None when `address` may be connected to, else the rule that refuses it.

        A string is read as an address in any form a resolver accepts (see
        `parse_address`); anything else is a ValueError.
        """
        addr = address if isinstance(address, IPv4Address | IPv6Address) else parse_address(address)
        carried = list(_carried_ipv4(addr)) if isinstance(addr, IPv6Address) else []
        # The always-refused set is searched first, carried addresses included, so an
        # address refused for good is never reported as merely private.
        tables = [(_ALWAYS_REFUSED, "always refused")]
        if not self.allow_private:
            tables.append((_PRIVATE, f"refused unless {_PRIVATE_OPTION}"))
        for table, verdict in tables:
            rule = _match(addr, table)
            if rule is not None:
                return f"{rule}; {verdict}"
            for form, inner in carried:
                rule = _match(inner, table)
                if rule is not None:
                    return f"the {form} form of {inner}, {rule}; {verdict}"
        return None


def _match(addr: Address, table: _Table) -> str | None:
    for network, name in table:
        if addr in network:
            return f"{network} is {name}"
    return None


def parse_address(text: str) -> Address:
    """The address `text` names, in any numeric form (see `numeric_host`); else ValueError."""
    addr = numeric_host(text)
    if addr is None:
        raise ValueError(f"not an IP address: {text!r}")
    return addr


def numeric_host(host: str) -> Address | None:
    """The address a URL's host names if it is numeric, in any form the C resolver
    accepts; None for a name, which must be looked up.

    Besides dotted decimal and IPv6 (with or without brackets and a `%zone`), IPv4
    comes in the forms of `inet_aton`: one to four parts, each decimal, octal (a
    leading 0) or hex (0x), the last filling the bytes left, so `2852039166`,
    `0xa9fea9fe`, `0251.0376.0251.0376` and `169.254.43518` are all 169.254.169.254,
    `127.1` is 127.0.0.1 and `0` is 0.0.0.0. A trailing dot is dropped first.
    """
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if ":" in text:
        text = text.replace("%25", "%", 1)  # a zone as it appears in a URL
        try:
            return IPv6Address(text)
        except ValueError:
            return None
    return _inet_aton(text.removesuffix("."))


_INET_PART = re.compile(r"0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*", re.ASCII)


def _inet_aton(text: str) -> IPv4Address | None:
    parts = text.split(".")
    if not 1 <= len(parts) <= 4 or not all(_INET_PART.fullmatch(p) for p in parts):
        return None
    values = [_inet_part(p) for p in parts]
    *leading, last = values
    if any(v > 0xFF for v in leading) or last >= 1 << (8 * (4 - len(leading))):
        return None
    number = 0
    for value in leading:
        number = number << 8 | value
    return IPv4Address(number << (8 * (4 - len(leading))) | last)


def _inet_part(part: str) -> int:
    if part[:2] in ("0x", "0X"):
        return int(part[2:], 16)
    if len(part) > 1 and part.startswith("0"):
        return int(part, 8)
    return int(part)


def _carried_ipv4(addr: IPv6Address) -> Iterator[tuple[str, IPv4Address]]:
    """The IPv4 addresses an IPv6 address carries, with the name of the form."""
    low32 = IPv4Address(int(addr) & 0xFFFFFFFF)
    if addr.ipv4_mapped is not None:
        yield "IPv4-mapped", addr.ipv4_mapped
    if addr in _IPV4_COMPATIBLE and int(addr) > 1:  # :: and ::1 have rules of their own
        yield "IPv4-compatible", low32
    if addr in _IPV4_TRANSLATED:
        yield "IPv4-translated", low32
    if addr.sixtofour is not None:
        yield "6to4", addr.sixtofour
    if addr in _NAT64:
        yield "NAT64", low32
    if addr in _LOCAL_NAT64:
        # RFC 6052: the operator picks the prefix length, so every layout that fits
        # the address (zero "u" octet and suffix) is checked.
        octets = addr.packed
        for prefix, carrying, zeros in _RFC6052_LAYOUTS:
            if not any(octets[i] for i in zeros):
                yield f"NAT64 (/{prefix})", IPv4Address(bytes(octets[i] for i in carrying))
    if addr.teredo is not None:
        server, client = addr.teredo
        yield "Teredo server", server
        yield "Teredo client", client


# RFC 6052, section 2.2: (prefix length, the octets carrying the IPv4 address, the
# octets that must be zero). Octet 8 (bits 64 to 71) is the reserved "u" octet.
_RFC6052_LAYOUTS = (
    (48, (6, 7, 9, 10), (8, 11, 12, 13, 14, 15)),
    (56, (7, 9, 10, 11), (8, 12, 13, 14, 15)),
    (64, (9, 10, 11, 12), (8, 13, 14, 15)),
    (96, (12, 13, 14, 15), ()),
)


def _same_host(host: str, address: Address) -> bool:
    return numeric_host(host) == address
