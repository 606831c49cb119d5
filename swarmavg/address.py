"""Peer addresses: canonical URL strings a user can paste, multiaddrs accepted as input.

Canonical form::

    tcp://127.0.0.1:31337/p/12D3KooW…
    quic://[::1]:31337/p/12D3KooW…
    memory://local:4/p/12D3KooW…

The scheme names the transport, host and port say where to dial, and ``/p/<peer-id>`` names the
peer that must answer. An address without ``/p/…`` is only accepted for dialing when the caller
explicitly opts out of the identity check (``allow_unknown_peer=True``), or for listening.

hivemind/libp2p-style multiaddrs are accepted wherever an address is, e.g.
``/ip4/127.0.0.1/tcp/31337/p2p/12D3KooW…``, ``/ip6/::1/udp/31337/quic-v1/p2p/…``,
``/dns4/example.org/tcp/31337``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final
from urllib.parse import urlsplit

from swarmavg.identity import PeerID

__all__ = ["Address", "getaddrinfo"]

_MAX_ADDRESS_LEN: Final = 512


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed peer address. ``str(address)`` is the canonical URL."""

    scheme: str
    host: str
    port: int
    peer_id: PeerID | None = None

    def __post_init__(self) -> None:
        if not self.scheme or not self.scheme.isascii() or not self.scheme.isalnum():
            raise ValueError(f"invalid address scheme {self.scheme!r}")
        if self.scheme != self.scheme.lower():
            raise ValueError(f"address scheme must be lower case: {self.scheme!r}")
        if not self.host or any(c in self.host for c in "/?#@ "):
            raise ValueError(f"invalid host {self.host!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in 0..65535, not {self.port!r}")
        if self.peer_id is not None and not isinstance(self.peer_id, PeerID):
            raise TypeError("peer_id must be a PeerID or None")

    @classmethod
    def parse(cls, value: str | Address) -> Address:
        """Parse a canonical URL or a multiaddr.

        :raises ValueError: naming what is wrong with ``value``.
        :raises TypeError: if ``value`` is not a string or an :class:`Address`.
        """
        if isinstance(value, Address):
            return value
        if not isinstance(value, str):
            raise TypeError(f"an address must be a str, not {type(value).__name__}")
        return _parse_text(value)

    @classmethod
    def _parse_text(cls, value: str) -> Address:
        text = value.strip()
        if not text or len(text) > _MAX_ADDRESS_LEN:
            raise ValueError(f"invalid address {value[:80]!r}")
        if text.startswith("/"):
            return cls._parse_multiaddr(text)
        return cls._parse_url(text)

    @classmethod
    def _parse_url(cls, text: str) -> Address:
        parts = urlsplit(text)
        if not parts.scheme or not parts.netloc:
            raise ValueError(f"invalid address {text!r}: expected scheme://host:port[/p/<peer-id>]")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"invalid address {text!r}: no query, fragment or credentials allowed")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"invalid port in address {text!r}") from exc
        if port is None:
            raise ValueError(f"address {text!r} has no port")
        host = parts.hostname or ""
        path = parts.path.rstrip("/")
        peer_id = None
        if path:
            segments = path.split("/")
            if len(segments) != 3 or segments[1] != "p":
                raise ValueError(f"invalid address {text!r}: the path must be /p/<peer-id>")
            peer_id = PeerID.from_string(segments[2])
        return cls(parts.scheme.lower(), _normalize_host(host), port, peer_id)

    @classmethod
    def _parse_multiaddr(cls, text: str) -> Address:
        tokens = text.strip("/").split("/")
        host: str | None = None
        scheme: str | None = None
        port: int | None = None
        peer_id: PeerID | None = None
        i = 0

        def take() -> str:
            nonlocal i
            if i >= len(tokens) or not tokens[i]:
                raise ValueError(f"invalid multiaddr {text!r}: truncated")
            i += 1
            return tokens[i - 1]

        while i < len(tokens):
            proto = take()
            if proto in ("ip4", "ip6", "dns", "dns4", "dns6"):
                host = take()
                if proto in ("ip4", "ip6"):
                    try:
                        addr = ipaddress.ip_address(host)
                    except ValueError as exc:
                        raise ValueError(f"invalid {proto} host in multiaddr {text!r}") from exc
                    if (proto == "ip4") != (addr.version == 4):
                        raise ValueError(f"{proto} host {host!r} in multiaddr {text!r}")
            elif proto in ("tcp", "udp"):
                raw_port = take()
                if not raw_port.isdigit():
                    raise ValueError(f"invalid port {raw_port!r} in multiaddr {text!r}")
                port = int(raw_port)
                scheme = proto
            elif proto in ("quic", "quic-v1"):
                if scheme != "udp":
                    raise ValueError(f"invalid multiaddr {text!r}: quic must follow udp")
                scheme = "quic"
            elif proto in ("p2p", "ipfs"):
                peer_id = PeerID.from_string(take())
            elif proto == "memory":
                host = "local"
                port = int(take())
                scheme = "memory"
            else:
                raise ValueError(f"unsupported multiaddr protocol {proto!r} in {text!r}")
        if host is None or port is None or scheme is None:
            raise ValueError(f"multiaddr {text!r} must name a host and a tcp/udp port")
        if scheme == "udp":
            raise ValueError(f"multiaddr {text!r}: plain udp is not a transport (add /quic-v1)")
        return cls(scheme, _normalize_host(host), port, peer_id)

    def with_peer_id(self, peer_id: PeerID | None) -> Address:
        """A copy naming ``peer_id``."""
        return replace(self, peer_id=peer_id)

    def with_port(self, port: int) -> Address:
        """A copy with another port (e.g. the one the OS picked for port 0)."""
        return replace(self, port=port)

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    def to_multiaddr(self) -> str:
        """The address as a libp2p multiaddr (for tools that expect one)."""
        if self.scheme == "memory":
            base = f"/memory/{self.port}"
        else:
            try:
                version = ipaddress.ip_address(self.host).version
                base = f"/ip{version}/{self.host}"
            except ValueError:
                base = f"/dns/{self.host}"
            if self.scheme == "quic":
                base += f"/udp/{self.port}/quic-v1"
            else:
                base += f"/{self.scheme}/{self.port}"
        return base + (f"/p2p/{self.peer_id}" if self.peer_id else "")

    def __str__(self) -> str:
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        suffix = f"/p/{self.peer_id}" if self.peer_id is not None else ""
        return f"{self.scheme}://{host}:{self.port}{suffix}"

    def __repr__(self) -> str:
        return f"Address({str(self)!r})"


def _normalize_host(host: str) -> str:
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    host = host.lower()
    if not host or len(host) > 253 or not all(c.isalnum() or c in "-._" for c in host):
        raise ValueError(f"invalid host {host!r}")
    return host


@functools.lru_cache(maxsize=1024)
def _parse_text(value: str) -> Address:
    """Parsing is pure and addresses are immutable: the peers a node talks to repeat."""
    return Address._parse_text(value)


async def getaddrinfo(
    host: str, port: int, *, type: int, proto: int, flags: int = 0
) -> Sequence[tuple[Any, ...]]:
    """``loop.getaddrinfo`` for the transports, but an IP address is read at once, here.
    asyncio resolves every host in a worker thread of the loop's default executor, and at
    interpreter exit, where the facades still shut down (and tell their peers), that executor
    takes no more work; an address needs no lookup. A name that cannot be looked up then
    raises ``OSError``, as one that does not resolve."""
    with contextlib.suppress(socket.gaierror):  # (not an IP address)
        return socket.getaddrinfo(
            host, port, type=type, proto=proto, flags=flags | socket.AI_NUMERICHOST
        )
    loop = asyncio.get_running_loop()
    try:
        return await loop.getaddrinfo(host, port, type=type, proto=proto, flags=flags)
    except RuntimeError as exc:  # ("cannot schedule new futures after interpreter shutdown")
        raise OSError(f"cannot look {host!r} up now: {exc}") from exc
