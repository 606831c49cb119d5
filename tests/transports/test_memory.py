from __future__ import annotations

import anyio
import pytest

from swarmavg.errors import ConnectError
from swarmavg.identity import Identity
from swarmavg.testing import (
    TRANSPORT_CHECKS,
    MemoryNetwork,
    MemoryTransport,
    run_on_virtual_time,
    run_transport_check,
)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("check", list(TRANSPORT_CHECKS))
async def test_conformance(check: str) -> None:
    network = MemoryNetwork()
    await run_transport_check(
        check, lambda ident: MemoryTransport(ident, network=network), "memory://local:0"
    )


@pytest.mark.parametrize("check", ["stream_both_ways", "backpressure", "many_concurrent_streams"])
async def test_conformance_with_impairments(check: str) -> None:
    network = MemoryNetwork()
    await run_transport_check(
        check,
        lambda ident: MemoryTransport(
            ident,
            network=network,
            latency=0.001,
            bandwidth=2e9,
            loss=0.05,
            retransmit_timeout=0.01,
        ),
        "memory://local:0",
    )


async def test_latency_and_bandwidth_are_applied() -> None:
    network = MemoryNetwork()
    a = MemoryTransport(Identity.generate(), network=network, latency=0.05)
    b = MemoryTransport(Identity.generate(), network=network, bandwidth=10e6)
    async with a, b:
        listener = await b.listen("memory://local:0")
        conn = await a.connect(listener.address)
        peer = await listener.accept()
        stream = await conn.open_stream()
        start = anyio.current_time()
        await stream.send(bytes(1_000_000))  # 0.1 s at 10 MB/s, + 0.05 s latency
        remote = await peer.accept_stream()
        msg = await remote.receive()
        elapsed = anyio.current_time() - start
        assert len(msg) == 1_000_000
        assert elapsed >= 0.149, elapsed


async def test_networks_are_isolated() -> None:
    a = MemoryTransport(Identity.generate(), network=MemoryNetwork())
    b = MemoryTransport(Identity.generate(), network=MemoryNetwork())
    async with a, b:
        listener = await b.listen("memory://local:0")
        with pytest.raises(ConnectError):
            await a.connect(listener.address)


async def test_disconnect_all_breaks_connections() -> None:
    network = MemoryNetwork()
    a = MemoryTransport(Identity.generate(), network=network)
    b = MemoryTransport(Identity.generate(), network=network)
    async with a, b:
        listener = await b.listen("memory://local:0")
        conn = await a.connect(listener.address)
        peer = await listener.accept()
        a.disconnect_all()
        assert conn.is_closed
        assert peer.is_closed


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"latency": -1}, "latency"),
        ({"bandwidth": 0}, "bandwidth"),
        ({"loss": 1.0}, "loss"),
        ({"window": 0}, "window"),
        ({"max_message_size": 0}, "max_message_size"),
    ],
)
def test_bad_knobs_name_the_argument(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        MemoryTransport(Identity.generate(), **kwargs)  # type: ignore[arg-type]


def test_identity_type_checked() -> None:
    with pytest.raises(TypeError, match="identity"):
        MemoryTransport("not an identity")  # type: ignore[arg-type]


async def test_a_pulled_cable_loses_what_is_sent_and_holds_dials_until_it_is_back() -> None:
    network = MemoryNetwork()
    a = MemoryTransport(Identity.generate(), network=network)
    b = MemoryTransport(Identity.generate(), network=network)
    async with a, b:
        listener = await b.listen("memory://local:0")
        conn = await a.connect(listener.address)
        peer = await listener.accept()
        stream = await conn.open_stream()
        remote = await peer.accept_stream()
        with pytest.raises(TypeError, match="up"):
            a.set_link(0)  # type: ignore[arg-type]
        a.set_link(False)
        await stream.send(b"lost")  # (no error: the cable is pulled, not the connection)
        await remote.send(b"lost too")
        with anyio.move_on_after(0.2) as waited:
            await remote.receive()
        assert waited.cancelled_caught
        with anyio.move_on_after(0.2) as dialing:
            await a.connect(listener.address)
        assert dialing.cancelled_caught
        a.set_link(True)
        await stream.send(b"after")
        assert bytes(await remote.receive()) == b"after"
        with pytest.raises(anyio.WouldBlock):  # ("lost too" never came)
            stream.receive_nowait()
        second = await a.connect(listener.address)
        assert not second.is_closed


def test_traffic_counts_bytes_as_the_link_delivers_them() -> None:
    """``traffic()``: bytes delivered each way, arriving evenly over a message's serialization
    (shifted by the latency), as a kernel's counters would see them; both ends agree."""

    async def main() -> None:
        network = MemoryNetwork()
        a = MemoryTransport(Identity.generate(), network=network, latency=0.05)
        b = MemoryTransport(Identity.generate(), network=network, bandwidth=10e6)
        async with a, b:
            listener = await b.listen("memory://local:0")
            conn = await a.connect(listener.address)
            peer = await listener.accept()
            assert conn.traffic() == peer.traffic() == (0, 0)
            stream = await conn.open_stream()
            start = anyio.current_time()
            await stream.send(bytes(1_000_000))  # 0.1 s at 10 MB/s, + 0.05 s latency
            assert conn.traffic() == (0, 0)  # (handed over; nothing crossed yet)
            await anyio.sleep(start + 0.1 - anyio.current_time())  # half of it arrived
            sent, received = conn.traffic() or (0, 0)
            assert sent == pytest.approx(500_000, rel=0.02)
            assert received == 0
            assert peer.traffic() == (0, sent)
            remote = await peer.accept_stream()
            assert len(await remote.receive()) == 1_000_000
            assert conn.traffic() == (1_000_000, 0)
            await remote.send(bytes(1000))
            assert len(await stream.receive()) == 1000
            assert conn.traffic() == (1_000_000, 1000)
            assert peer.traffic() == (1000, 1_000_000)

    run_on_virtual_time(main)
