"""The web tools' network policy: pure rules over addresses, no sockets."""

from __future__ import annotations

import ast
import re
import socket
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

import pytest

import builtin_tools._netpolicy as netpolicy
from builtin_tools._netpolicy import NetworkPolicy, RefusedAddress, numeric_host, parse_address

STRICT = NetworkPolicy()
PRIVATE_OK = NetworkPolicy(allow_private=True)

ALWAYS_REFUSED = [
    ("169.254.169.254", "169.254.0.0/16 is link-local"),
    ("169.254.0.1", "169.254.0.0/16 is link-local"),
    ("100.100.100.200", "100.100.100.200/32 is a cloud metadata service"),
    ("fd00:ec2::254", "fd00:ec2::254/128 is a cloud metadata service"),
    ("fd20:ce::254", "fd20:ce::254/128 is a cloud metadata service"),
    ("fd00:ec2::23", "fd00:ec2::23/128 is a cloud credentials service (AWS EKS Pod Identity"),
    ("fd00:c1::a9fe:a9fe", "fd00:c1::a9fe:a9fe/128 is a cloud metadata service (Oracle Cloud"),
    ("192.0.0.192", "192.0.0.192/32 is a cloud metadata service (Oracle Cloud Classic)"),
    ("168.63.129.16", "168.63.129.16/32 is a cloud metadata service (Azure WireServer)"),
    ("::ffff:168.63.129.16", "the IPv4-mapped form of 168.63.129.16, 168.63.129.16/32"),
    ("64:ff9b::c000:c0", "the NAT64 form of 192.0.0.192, 192.0.0.192/32"),
    ("fe80::1", "fe80::/10 is link-local"),
    ("fe80::1%eth0", "fe80::/10 is link-local"),
    ("fe80::a9fe:a9fe", "fe80::/10 is link-local"),
    ("febf:ffff::1", "fe80::/10 is link-local"),
    ("0.0.0.0", '0.0.0.0/8 is "this network"'),
    ("0.255.255.255", '0.0.0.0/8 is "this network"'),
    ("::", "::/128 is the unspecified address"),
    ("224.0.0.1", "224.0.0.0/4 is multicast"),
    ("239.255.255.250", "224.0.0.0/4 is multicast"),
    ("ff02::1", "ff00::/8 is multicast"),
    ("255.255.255.255", "240.0.0.0/4 is reserved"),
    ("::ffff:169.254.169.254", "the IPv4-mapped form of 169.254.169.254, 169.254.0.0/16"),
    ("::ffff:a9fe:a9fe", "the IPv4-mapped form of 169.254.169.254"),
    ("::169.254.169.254", "the IPv4-compatible form of 169.254.169.254"),
    ("::ffff:0:169.254.169.254", "the IPv4-translated form of 169.254.169.254"),
    ("2002:a9fe:a9fe::", "the 6to4 form of 169.254.169.254"),
    ("2002:a9fe:a9fe:1:2:3:4:5", "the 6to4 form of 169.254.169.254"),
    ("64:ff9b::a9fe:a9fe", "the NAT64 form of 169.254.169.254"),
    ("64:ff9b::169.254.169.254", "the NAT64 form of 169.254.169.254"),
    ("64:ff9b::6464:64c8", "the NAT64 form of 100.100.100.200, 100.100.100.200/32"),
    ("64:ff9b:1::a9fe:a9fe", "the NAT64 (/96) form of 169.254.169.254"),
    ("64:ff9b:1:a9fe:a9:fe00::", "the NAT64 (/48) form of 169.254.169.254"),
    ("64:ff9b:1:0:a9:fea9:fe00:0", "the NAT64 (/64) form of 169.254.169.254"),
    ("2001:0:5ef5:79fd:0:0:5601:5601", "the Teredo client form of 169.254.169.254"),
    ("2001:0:a9fe:a9fe::1", "the Teredo server form of 169.254.169.254"),
]

PRIVATE = [
    ("127.0.0.1", "127.0.0.0/8 is loopback"),
    ("127.255.255.254", "127.0.0.0/8 is loopback"),
    ("::1", "::1/128 is loopback"),
    ("10.0.0.1", "10.0.0.0/8 is a private range"),
    ("172.16.0.1", "172.16.0.0/12 is a private range"),
    ("172.31.255.255", "172.16.0.0/12 is a private range"),
    ("192.168.1.1", "192.168.0.0/16 is a private range"),
    ("100.64.0.1", "100.64.0.0/10 is carrier-grade NAT"),
    ("100.127.255.255", "100.64.0.0/10 is carrier-grade NAT"),
    ("fc00::1", "fc00::/7 is unique local"),
    ("fd12:3456::1", "fc00::/7 is unique local"),
    ("fec0::1", "fec0::/10 is site-local"),
    ("192.0.2.1", "192.0.2.0/24 is documentation"),
    ("198.18.0.1", "198.18.0.0/15 is benchmarking"),
    ("2001:db8::1", "2001:db8::/32 is documentation"),
    ("::ffff:127.0.0.1", "the IPv4-mapped form of 127.0.0.1, 127.0.0.0/8 is loopback"),
    ("::ffff:10.0.0.1", "the IPv4-mapped form of 10.0.0.1"),
    ("2002:c0a8:0101::1", "the 6to4 form of 192.168.1.1"),
    ("64:ff9b::10.0.0.1", "the NAT64 form of 10.0.0.1"),
    ("64:ff9b::7f00:1", "the NAT64 form of 127.0.0.1"),
]

PUBLIC = [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "172.32.0.1", "172.15.255.255", "100.63.255.255",
    "100.128.0.0", "169.253.255.255", "169.255.0.0", "11.0.0.1", "223.255.255.255",
    "2606:4700:4700::1111", "2a00:1450:4001::200e", "::ffff:8.8.8.8", "2002:0808:0808::1",
    "64:ff9b::8.8.8.8", "fbff:ffff::1", "168.63.129.15", "168.63.129.17",
]  # fmt: skip


@pytest.mark.parametrize(("address", "rule"), ALWAYS_REFUSED)
def test_always_refused_addresses_stay_refused_with_private_allowed(address: str, rule: str) -> None:
    """Link-local, metadata, this-network, multicast and their IPv6 carriers are refused
    whatever allow_private says, and the rule says so."""
    for policy in (STRICT, PRIVATE_OK):
        found = policy.check(address)
        assert found is not None and found.startswith(rule), found
        assert found.endswith("always refused")


@pytest.mark.parametrize(("address", "rule"), PRIVATE)
def test_private_addresses_need_allow_private(address: str, rule: str) -> None:
    """Loopback, private, CGNAT and special-purpose ranges, and their IPv6 carriers, are
    refused by default with a rule naming the option, and allowed with it."""
    found = STRICT.check(address)
    assert found is not None and found.startswith(rule), found
    assert found.endswith("refused unless allow_private_network=True")
    assert PRIVATE_OK.check(address) is None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address: str) -> None:
    """Public addresses, next door to refused ranges or carried in IPv6, are allowed."""
    assert STRICT.check(address) is None


def test_check_takes_address_objects_and_refuses_names() -> None:
    """check accepts ipaddress objects; a host name is a ValueError, not a pass."""
    assert STRICT.check(IPv4Address("169.254.169.254")) is not None
    assert STRICT.check(IPv6Address("2606:4700::1")) is None
    with pytest.raises(ValueError, match=re.escape("not an IP address: 'example.org'")):
        STRICT.check("example.org")


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("2852039166", "169.254.169.254"),
        ("0xa9fea9fe", "169.254.169.254"),
        ("0XA9FEA9FE", "169.254.169.254"),
        ("0251.0376.0251.0376", "169.254.169.254"),
        ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
        ("169.254.43518", "169.254.169.254"),
        ("169.16689662", "169.254.169.254"),
        ("127.1", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("0", "0.0.0.0"),
        ("00", "0.0.0.0"),
        ("169.254.169.254.", "169.254.169.254"),
        ("[::ffff:169.254.169.254]", "::ffff:a9fe:a9fe"),
        ("fe80::1%25eth0", "fe80::1%eth0"),
        ("4294967295", "255.255.255.255"),
    ],
)
def test_numeric_forms_are_normalised(host: str, address: str) -> None:
    """Decimal, hex, octal, short dotted, trailing-dot and bracketed hosts name the address
    the C resolver would connect to."""
    assert str(numeric_host(host)) == address
    assert str(parse_address(host)) == address


@pytest.mark.parametrize(
    "host",
    ["example.org", "4294967296", "0x100000000", "1.2.3.256", "1.2.65536", "0x", "08", "1..2",
     ".1", "1.2.3.4.5", "", "1.2.3.4 x", "\u0661.2.3.4", "::ffff:zz", "a9fe.a9fe"],
)  # fmt: skip
def test_names_and_malformed_numbers_are_not_addresses(host: str) -> None:
    """Anything the C resolver would not read as a number is a name to look up."""
    assert numeric_host(host) is None


@pytest.mark.parametrize(
    "text",
    ["2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "127.1", "0x7f.1", "0", "1.2.65535",
     "0X7F.0.0.1", "000000000000000000000127.0.0.1", "4294967296", "0x", "08", "1..2", ".1",
     "00x1", "1.2.3.256"],
)  # fmt: skip
def test_the_ipv4_forms_agree_with_the_c_library(text: str) -> None:
    """On every form tried, the parser and the platform's inet_aton agree."""
    try:
        expected: IPv4Address | None = IPv4Address(socket.inet_aton(text))
    except OSError:
        expected = None
    assert numeric_host(text) == expected


def test_refused_address_names_host_address_and_rule() -> None:
    """The error names the host, the address it resolved to and the rule; it is a
    PermissionError."""
    rule = STRICT.check("169.254.169.254")
    assert rule is not None
    err = RefusedAddress("metadata.test", IPv4Address("169.254.169.254"), rule)
    assert isinstance(err, PermissionError)
    assert str(err) == f"the network policy refuses 'metadata.test' (169.254.169.254): {rule}"
    same = RefusedAddress("2852039166", IPv4Address("169.254.169.254"), rule)
    assert str(same) == f"the network policy refuses 169.254.169.254: {rule}"


def test_the_policy_module_does_no_io() -> None:
    """The policy imports nothing that touches sockets, files, threads or the event loop."""
    tree = ast.parse(Path(netpolicy.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert imported <= {"__future__", "ipaddress", "re", "collections", "attrs"}
