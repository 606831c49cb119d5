"""A DHT node cut off from every peer for a while (its routing table emptied, the others
dropped it too) finds its way back by itself once its link is: it pings its initial peers and
the peers it dropped for failures, with backoff, while its routing table is small."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio

from swarmavg import get_dht_time
from swarmavg.aio.dht import DHTNode
from swarmavg.aio.node import Node
from swarmavg.testing import MemoryNetwork, MemoryTransport, run_on_virtual_time


def test_a_node_cut_off_for_seconds_rejoins_the_dht_after_its_link_is_back() -> None:
    async def main() -> tuple[int, list[int], list[bool], object, float]:
        network = MemoryNetwork()
        transports = {"memory": {"network": network}}
        async with AsyncExitStack() as stack:
            dhts: list[DHTNode] = []
            for _ in range(4):
                node = await stack.enter_async_context(
                    Node(listen=["memory://local:0"], transports=transports)
                )
                seeds = [dhts[0].node.addresses[0]] if dhts else []
                dhts.append(
                    await stack.enter_async_context(
                        DHTNode(node, initial_peers=seeds, request_timeout=1.0)
                    )
                )
            for dht in dhts[1:]:  # (everyone knows everyone)
                await dht.find_peers(0)
            victim = dhts[3]
            transport = victim.node._transports["memory"]
            assert isinstance(transport, MemoryTransport)
            transport.set_link(False)
            with anyio.fail_after(60):  # every request of the victim fails, and theirs to it
                for i in range(5):
                    await victim.get(f"absent{i}")
                    await dhts[i % 3].get(f"absent{i}")
                    await anyio.sleep(1.0)
            emptied = victim.routing_table_size
            transport.set_link(True)
            healed = anyio.current_time()

            def rejoined() -> bool:  # (the victim holds the others, and they hold it)
                return victim.routing_table_size == 3 and all(
                    victim.peer_id in d.protocol.routing for d in dhts[:3]
                )

            with anyio.fail_after(120):
                while not rejoined():  # noqa: ASYNC110
                    await anyio.sleep(0.5)
            took = anyio.current_time() - healed
            assert await dhts[0].store("key", "value", get_dht_time() + 60)
            found = await victim.get("key")
            sizes = [d.routing_table_size for d in dhts]
            known = [victim.peer_id in d.protocol.routing for d in dhts[:3]]
            return emptied, sizes, known, found, took

    emptied, sizes, known, found, took = run_on_virtual_time(main)
    assert emptied == 0
    assert sizes == [3, 3, 3, 3]
    assert known == [True, True, True]
    assert found is not None
    assert found.value == "value"
    assert took <= 10.0 + 1.0 + 0.5 + 1e-3, took  # (longest backoff, a ping, our poll)
