"""``Stream.receive_nowait`` of the transports that implement it: a message that has arrived is
handed out without waiting (the RPC layer reads a call's opening so); the contract itself (order,
WouldBlock otherwise) is the conformance check ``receive_nowait``."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
from swarmavg_tcp import TcpTransport

from swarmavg.abc import Transport
from swarmavg.identity import Identity
from swarmavg.testing import MemoryNetwork, MemoryTransport

pytestmark = pytest.mark.anyio


def _memory() -> tuple[Callable[[Identity], Transport], str]:
    network = MemoryNetwork()
    return (lambda ident: MemoryTransport(ident, network=network)), "memory://local:0"


def _tcp() -> tuple[Callable[[Identity], Transport], str]:
    return TcpTransport, "tcp://127.0.0.1:0"


@pytest.mark.parametrize("kind", [_memory, _tcp], ids=["memory", "tcp"])
async def test_an_arrived_message_is_handed_out_without_waiting(
    kind: Callable[[], tuple[Callable[[Identity], Transport], str]],
) -> None:
    factory, where = kind()
    with anyio.fail_after(10):
        async with factory(Identity.generate()) as server, factory(Identity.generate()) as client:
            listener = await server.listen(where)
            conn = await client.connect(listener.address)
            accepted = await listener.accept()
            stream = await conn.open_stream()
            await stream.send(b"first")
            await stream.send(b"second")
            peer = await accepted.accept_stream()
            assert bytes(await peer.receive()) == b"first"
            for _ in range(200):  # until "second" has arrived (at most 2 s)
                try:
                    got = peer.receive_nowait()
                    break
                except anyio.WouldBlock:
                    await anyio.sleep(0.01)
            else:
                raise AssertionError("an arrived message was never handed out")
            assert bytes(got) == b"second"
            with pytest.raises(anyio.WouldBlock):
                peer.receive_nowait()
            await stream.send(b"third")  # receive() still works after it
            assert bytes(await peer.receive()) == b"third"
            await conn.aclose()
            await accepted.aclose()
