"""The IP addresses of this machine's interfaces, to turn a wildcard listener (0.0.0.0, ::) into
addresses another peer can dial.

Linux: IPv4 from one ``SIOCGIFADDR`` ioctl per interface, IPv6 from ``/proc/net/if_inet6``.
Elsewhere, or if those fail: what the host name resolves to, and loopback. Link-local IPv6
addresses are left out (dialing them needs a scope id that another machine cannot know).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from typing import Final

from swarmavg.address import Address

__all__ = ["interface_addresses", "visible_addresses"]

_SIOCGIFADDR: Final = 0x8915
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})  # noqa: S104 (recognized, not bound)


def _ipv4_linux() -> list[str]:
    import fcntl  # Unix only

    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(reply[20:24]))
    return found


def _ipv6_linux() -> list[str]:
    found: list[str] = []
    with open("/proc/net/if_inet6", encoding="ascii") as table:
        for line in table:
            fields = line.split()
            if fields:
                found.append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def _by_host_name(family: socket.AddressFamily) -> list[str]:
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
        return [str(info[4][0]) for info in infos]
    return []


def interface_addresses(ipv6: bool = False) -> list[str]:
    """This machine's IPv4 (or IPv6) addresses: routable ones first, loopback last."""
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    try:
        found = _ipv6_linux() if ipv6 else _ipv4_linux()
    except (OSError, ImportError, AttributeError, ValueError):
        found = []
    if not found:
        found = _by_host_name(family) + (["::1"] if ipv6 else ["127.0.0.1"])
    addresses: list[str] = []
    for text in found:
        ip = ipaddress.ip_address(text)
        if ip.is_link_local or ip.is_unspecified or text in addresses:
            continue
        addresses.append(text)
    addresses.sort(key=lambda a: ipaddress.ip_address(a).is_loopback)
    return addresses


def visible_addresses(listening: list[Address]) -> list[Address]:
    """``listening`` with each wildcard address replaced by one per interface address."""
    result: list[Address] = []
    for address in listening:
        if address.host not in _WILDCARDS:
            result.append(address)
            continue
        for host in interface_addresses(ipv6=address.host == "::"):
            result.append(Address(address.scheme, host, address.port, address.peer_id))
    return result
