"""A DHT node cut off from every peer for a while (its routing table emptied, the others
dropped it too) finds its way back by itself once its link is: it pings its initial peers and
the peers it dropped for failures, with backoff (at most a few seconds), while its routing table
is small; a ping that timed out closes the connection it went over (after a real cut, TCP holds
what was sent during it until a backed-off retransmission timer fires); and a peer an answer
names while it is banned is not banned longer for it."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import pytest

from swarmavg import get_dht_time
from swarmavg.aio import dht as dht_module
from swarmavg.aio.dht import DHTNode
from swarmavg.aio.node import Node
from swarmavg.testing import MemoryNetwork, MemoryTransport, run_on_virtual_time

#: seconds one request may take in these tests
REQUEST_TIMEOUT = 1.0


async def _swarm(stack: AsyncExitStack, n: int) -> list[DHTNode]:
    """``n`` DHT nodes on one memory network, bootstrapped from the first, knowing each other."""
    network = MemoryNetwork()
    transports = {"memory": {"network": network}}
    dhts: list[DHTNode] = []
    for _ in range(n):
        node = await stack.enter_async_context(
            Node(listen=["memory://local:0"], transports=transports)
        )
        seeds = [dhts[0].node.addresses[0]] if dhts else []
        dhts.append(
            await stack.enter_async_context(
                DHTNode(node, initial_peers=seeds, request_timeout=REQUEST_TIMEOUT)
            )
        )
    for dht in dhts[1:]:  # (everyone knows everyone)
        await dht.find_peers(0)
    return dhts


def _transport(dht: DHTNode) -> MemoryTransport:
    transport = dht.node._transports["memory"]
    assert isinstance(transport, MemoryTransport)
    return transport


@pytest.mark.parametrize("cut_for", [20.0, 22.5, 25.0, 27.5, 30.0, 32.5])
def test_a_node_cut_off_for_seconds_rejoins_the_dht_soon_after_its_link_is_back(
    cut_for: float,
) -> None:
    """Healed at any moment of its backoff (``cut_for`` sweeps it), the victim holds the others
    again, and they hold it, within the longest backoff, a try in flight and our poll."""

    async def main() -> tuple[int, list[bool], list[int], list[bool], object, float]:
        async with AsyncExitStack() as stack:
            dhts = await _swarm(stack, 4)
            victim = dhts[3]
            transport = _transport(victim)
            transport.set_link(False)
            cut_at = anyio.current_time()
            with anyio.fail_after(60):  # every request of the victim fails, and theirs to it
                for i in range(3):
                    await victim.get(f"absent{i}")
                    await dhts[i].get(f"absent{i}")
            emptied = victim.routing_table_size
            await anyio.sleep(cut_at + cut_for - anyio.current_time())
            # the rejoin pings that timed out closed the connections they went over
            pooled = [victim.node.connection_to(d.peer_id) is not None for d in dhts[:3]]
            transport.set_link(True)
            healed = anyio.current_time()

            def rejoined() -> bool:  # (the victim holds the others, and they hold it)
                return victim.routing_table_size == 3 and all(
                    victim.peer_id in d.protocol.routing for d in dhts[:3]
                )

            with anyio.fail_after(120):
                while not rejoined():  # noqa: ASYNC110
                    await anyio.sleep(0.25)
            took = anyio.current_time() - healed
            assert await dhts[0].store("key", "value", get_dht_time() + 60)
            found = await victim.get("key")
            sizes = [d.routing_table_size for d in dhts]
            known = [victim.peer_id in d.protocol.routing for d in dhts[:3]]
            return emptied, pooled, sizes, known, found, took

    emptied, pooled, sizes, known, found, took = run_on_virtual_time(main)
    assert emptied == 0
    assert pooled == [False, False, False]
    assert sizes == [3, 3, 3, 3]
    assert known == [True, True, True]
    assert found is not None
    assert found.value == "value"
    # the longest backoff, a try in flight at the heal (its ping's timeout, then closing the
    # connection, bounded by the same), the ping that answers, our poll
    bound = dht_module._REJOIN_MAX + 2 * REQUEST_TIMEOUT + 0.25
    assert took <= bound + 1e-3, took


def test_a_peer_named_while_banned_is_not_banned_longer() -> None:
    """A peer that failed once is banned for ``blacklist_delay``; lookups whose answers name it
    during its ban do not ask it and do not make its ban longer: it may be asked again once
    the delay is over."""

    async def main() -> tuple[int, int, bool, bool]:
        async with AsyncExitStack() as stack:
            a, _, c = await _swarm(stack, 3)
            _transport(c).set_link(False)
            await a.find_peers(12345)  # asks b and c: c fails
            failed_at = anyio.current_time()
            first = a.protocol.blacklist.failures(c.peer_id)
            for target in range(4):  # b still holds c and names it in each answer
                await a.find_peers(target)
            again = a.protocol.blacklist.failures(c.peer_id)
            banned = a.protocol.blacklist.is_banned(c.peer_id, a.clock())
            await anyio.sleep(failed_at + 5.0 + 0.1 - anyio.current_time())  # blacklist_delay
            later = a.protocol.blacklist.is_banned(c.peer_id, a.clock())
            return first, again, banned, later

    first, again, banned, later = run_on_virtual_time(main)
    assert (first, again) == (1, 1)
    assert banned
    assert not later


def test_a_rejoin_ping_that_timed_out_closes_only_a_silent_connection() -> None:
    """The connection a rejoin ping timed out over is closed only if nothing came over it for
    ``request_timeout``: one that carries data (a bulk transfer that a ping waits behind) is
    alive, and closing it broke the all-reduce it carried."""

    async def main() -> tuple[bool, bool]:
        async with AsyncExitStack() as stack:
            a, b = await _swarm(stack, 2)
            await a.get("anything")  # (b's answer just came over the connection)
            await a._drop_connection(b.peer_id)
            kept = a.node.connection_to(b.peer_id) is not None
            await anyio.sleep(REQUEST_TIMEOUT + 0.1)
            await a._drop_connection(b.peer_id)
            closed = a.node.connection_to(b.peer_id) is None
            return kept, closed

    kept, closed = run_on_virtual_time(main)
    assert kept
    assert closed
