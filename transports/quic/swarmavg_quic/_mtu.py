"""The QUIC datagram size for a peer: what the route to it carries, within aioquic's limits.

aioquic does no path-MTU discovery, and a client pads its first datagrams to the full
``max_datagram_size``, so a size the path cannot carry breaks the handshake itself: the size is
chosen per destination from the route's MTU (``IP_MTU`` of a connected UDP socket: a route
lookup, nothing is sent), between QUIC's 1200-byte floor and 16383, above which aioquic 1.7
writes STREAM frame lengths that do not fit their 2-byte field.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["MAX_DATAGRAM", "MIN_DATAGRAM", "datagram_size_for"]

#: QUIC's minimum (RFC 9000 section 14): every path must carry 1200-byte UDP payloads.
MIN_DATAGRAM = 1200
#: The largest datagram aioquic 1.7 writes correctly (STREAM and CRYPTO frame lengths are
#: 2-byte varints, at most 16383).
MAX_DATAGRAM = 16383

# Linux values (<linux/in.h>, <linux/in6.h>); Python's socket module does not export them.
_IP_MTU_DISCOVER, _IP_MTU, _IP_PMTUDISC_DO = 10, 14, 2
_IPV6_MTU_DISCOVER, _IPV6_MTU, _IPV6_PMTUDISC_DO = 23, 24, 2
_IPV4_UDP_HEADERS = 20 + 8
_IPV6_UDP_HEADERS = 40 + 8


def route_payload_size(host: str, port: int) -> int | None:
    """The largest UDP payload the route to ``host`` carries unfragmented, or ``None`` where
    the platform does not tell (not Linux, or no route)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: the caller resolves it first
    v6 = ip.version == 6
    family = socket.AF_INET6 if v6 else socket.AF_INET
    level = socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            discover, do = (
                (_IPV6_MTU_DISCOVER, _IPV6_PMTUDISC_DO)
                if v6
                else (_IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
            )
            sock.setsockopt(level, discover, do)  # don't fragment: the MTU is the real limit
            sock.connect((host, port))  # a route lookup; nothing is sent
            mtu = sock.getsockopt(level, _IPV6_MTU if v6 else _IP_MTU)
    except OSError:
        return None
    return mtu - (_IPV6_UDP_HEADERS if v6 else _IPV4_UDP_HEADERS)


def datagram_size_for(host: str, port: int, override: int | None = None) -> int:
    """The ``max_datagram_size`` to use towards ``host``: ``override`` if given (checked), else
    the route's payload size clamped to [1200, 16383], else 1200.

    :raises ValueError: if ``override`` is outside [1200, 16383].
    """
    if override is not None:
        if not MIN_DATAGRAM <= override <= MAX_DATAGRAM:
            raise ValueError(
                f"max_datagram_size must be in [{MIN_DATAGRAM}, {MAX_DATAGRAM}], not {override}"
            )
        return override
    size = route_payload_size(host, port)
    if size is None:
        return MIN_DATAGRAM
    return max(MIN_DATAGRAM, min(size, MAX_DATAGRAM))
