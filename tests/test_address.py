from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmavg.address import Address
from swarmavg.identity import Identity

PEER = Identity.generate().peer_id


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        (f"tcp://127.0.0.1:31337/p/{PEER}", f"tcp://127.0.0.1:31337/p/{PEER}"),
        (f"quic://[::1]:5/p/{PEER}", f"quic://[::1]:5/p/{PEER}"),
        ("TCP://Example.ORG:80", "tcp://example.org:80"),
        ("tcp://[0:0::1]:8/", "tcp://[::1]:8"),
        (f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}", f"tcp://127.0.0.1:31337/p/{PEER}"),
        (f"/ip6/::1/udp/4001/quic-v1/p2p/{PEER}", f"quic://[::1]:4001/p/{PEER}"),
        ("/ip4/10.0.0.1/udp/4001/quic", "quic://10.0.0.1:4001"),
        ("/dns4/example.org/tcp/443", "tcp://example.org:443"),
        (f"memory://local:3/p/{PEER}", f"memory://local:3/p/{PEER}"),
    ],
)
def test_parse_and_canonical_form(text: str, canonical: str) -> None:
    address = Address.parse(text)
    assert str(address) == canonical
    assert Address.parse(str(address)) == address
    assert Address.parse(address.to_multiaddr()) == address


@pytest.mark.parametrize(
    "text",
    [
        "",
        "127.0.0.1:80",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:80/q/x",
        "tcp://127.0.0.1:80/p/notapeerid",
        "tcp://user:pw@host:80",
        "tcp://host:80?x=1",
        "/ip4/127.0.0.1",
        "/ip4/::1/tcp/80",
        "/ip4/127.0.0.1/udp/80",
        "/ip4/127.0.0.1/tcp/eighty",
        "/ip4/127.0.0.1/sctp/80",
        "tcp://" + "a" * 600 + ":1",
    ],
)
def test_bad_addresses_give_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        Address.parse(text)


def test_type_error() -> None:
    with pytest.raises(TypeError, match="address"):
        Address.parse(31337)  # type: ignore[arg-type]


@given(st.text(max_size=120))
def test_garbage_gives_value_error_only(text: str) -> None:
    try:
        address = Address.parse(text)
    except ValueError:
        return
    assert Address.parse(str(address)) == address


def test_with_helpers() -> None:
    address = Address.parse("tcp://127.0.0.1:0")
    assert str(address.with_port(5).with_peer_id(PEER)) == f"tcp://127.0.0.1:5/p/{PEER}"


@pytest.mark.anyio
async def test_an_ip_address_is_read_without_the_loops_executor() -> None:
    """The transports' ``getaddrinfo`` reads an IP address itself: at interpreter exit the
    loop's default executor takes no work, and peers are still told that we leave."""
    import asyncio
    import socket

    from swarmavg.address import getaddrinfo

    loop = asyncio.get_running_loop()
    await loop.shutdown_default_executor()  # (as at exit: nothing more runs in it)
    kind = {"type": socket.SOCK_STREAM, "proto": socket.IPPROTO_TCP}
    [(family, *_, where)] = await getaddrinfo("127.0.0.1", 4321, **kind)
    assert (family, where) == (socket.AF_INET, ("127.0.0.1", 4321))
    [(family, *_, where)] = await getaddrinfo("::1", 4321, **kind)
    assert family == socket.AF_INET6
    assert where[:2] == ("::1", 4321)
    with pytest.raises(OSError, match=r"cannot look 'example\.invalid' up now"):
        await getaddrinfo("example.invalid", 4321, **kind)
