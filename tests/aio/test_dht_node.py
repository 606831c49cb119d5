"""DHTNode: bootstrap, replicated store and get across real nodes on a MemoryNetwork."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest

from swarmavg import get_dht_time
from swarmavg.address import Address
from swarmavg.aio.dht import DHTNode
from swarmavg.aio.node import Node
from swarmavg.errors import ConnectError
from swarmavg.identity import Identity
from swarmavg.proto.dht_storage import ValueWithExpiration
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def _swarm(n: int, **options: Any) -> AsyncIterator[list[DHTNode]]:
    network = MemoryNetwork()
    transports = {"memory": {"network": network}}
    async with AsyncExitStack() as stack:
        dhts: list[DHTNode] = []
        rng = random.Random(n)
        for _ in range(n):
            node = await stack.enter_async_context(
                Node(listen=["memory://local:0"], transports=transports)
            )
            seeds = [d.node.addresses[0] for d in rng.sample(dhts, min(3, len(dhts)))]
            dht = DHTNode(node, initial_peers=seeds, **options)
            with anyio.fail_after(10):
                await dht.start()
            dhts.append(dht)
        yield dhts


async def test_every_msgpack_type_round_trips_between_peers() -> None:
    values: list[Any] = [None, True, 7, -(2**40), 1.5, "text", b"\x00bytes", [1, "a"], {"k": [1.5]}]
    async with _swarm(12) as dhts:
        expiration = get_dht_time() + 60
        with anyio.fail_after(20):
            for i, value in enumerate(values):
                assert await dhts[i % 12].store(("key", i), value, expiration)
            for i, value in enumerate(values):
                got = await dhts[(i + 5) % 12].get(("key", i))
                assert isinstance(got, ValueWithExpiration)
                value_back, exp = got
                assert exp == expiration
                assert value_back == value


async def test_a_swarm_finds_every_stored_value() -> None:
    async with _swarm(30) as dhts:
        rng = random.Random(4)
        expiration = get_dht_time() + 60
        with anyio.fail_after(60):
            for i in range(40):
                assert await rng.choice(dhts).store(f"item{i}", i, expiration)
            misses = 0
            for i in range(40):
                got = await rng.choice(dhts).get(f"item{i}")
                if got is None or got.value != i:  # type: ignore[union-attr]
                    misses += 1
        assert misses == 0
        # the records live on the nearest peers, replicated
        holders = sum(1 for d in dhts if len(d.protocol.storage))
        assert holders >= 5


async def test_subkeys_merge_and_latest_finds_the_newest() -> None:
    async with _swarm(15) as dhts:
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await dhts[1].store("group", "alice", now + 30, subkey="a")
            assert await dhts[2].store("group", "bob", now + 40, subkey="b")
            got = await dhts[3].get("group", latest=True)
            assert isinstance(got, dict)
            assert {k: v.value for k, v in got.items()} == {"a": "alice", "b": "bob"}
            assert got["b"].expiration_time == now + 40
            assert await dhts[4].store("counter", 1, now + 10)
            assert await dhts[5].store("counter", 2, now + 20)
            # an older value: refused where the newer one is (a peer that missed both may
            # still take it), so readers asking for the latest still get the newest
            await dhts[6].store("counter", 0, now + 5)
            latest = await dhts[7].get("counter", latest=True)
            assert latest == ValueWithExpiration(2, now + 20)


async def test_owner_records_only_their_owner_can_write() -> None:
    async with _swarm(10) as dhts:
        owner, intruder = dhts[1], dhts[2]
        key = "state" + owner_marker(owner.peer_id).decode()
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await owner.store(key, {"step": 1}, now + 30)
            with pytest.raises(ValueError, match="another peer"):
                await intruder.store(key, {"step": 666}, now + 40)
            got = await dhts[5].get(key, latest=True)
            assert got is not None
            assert got.value == {"step": 1}  # type: ignore[union-attr]
            assert await owner.store(key, {"step": 2}, now + 50)
            got = await dhts[6].get(key, latest=True)
            assert got.value == {"step": 2}  # type: ignore[union-attr]


async def test_client_mode_queries_and_stores_but_is_not_routed_to() -> None:
    async with _swarm(8) as dhts:
        node = Node(
            transports={"memory": {"network": dhts[0].node._transport_options["memory"]["network"]}}
        )
        async with node:
            client = DHTNode(node, initial_peers=[dhts[0].node.addresses[0]], client_mode=True)
            with anyio.fail_after(20):
                await client.start()
                assert await client.store("from-client", 42, get_dht_time() + 30)
                got = await dhts[3].get("from-client")
                assert got is not None
                assert got.value == 42  # type: ignore[union-attr]
                assert (await client.get("from-client")).value == 42  # type: ignore[union-attr]
            assert all(client.peer_id not in d.protocol.routing for d in dhts)
            assert len(client.protocol.storage) == 0


async def test_bootstrap_names_every_peer_it_could_not_reach() -> None:
    network = MemoryNetwork()
    async with Node(transports={"memory": {"network": network}}) as node:
        ghosts = [
            Address("memory", "nowhere", 9, Identity.generate().peer_id),
            Address("memory", "gone", 7, Identity.generate().peer_id),
        ]
        dht = DHTNode(node, initial_peers=ghosts, request_timeout=1)
        with anyio.fail_after(10), pytest.raises(ConnectError) as info:
            await dht.start()
        for ghost in ghosts:
            assert str(ghost) in str(info.value)


@pytest.mark.parametrize("scheme", ["tcp", "quic"])
async def test_store_and_get_over_real_transports(scheme: str) -> None:
    async with AsyncExitStack() as stack:
        dhts: list[DHTNode] = []
        for _ in range(6):
            node = await stack.enter_async_context(Node(listen=[f"{scheme}://127.0.0.1:0"]))
            seeds = [dhts[0].node.addresses[0]] if dhts else []
            dht = DHTNode(node, initial_peers=seeds)
            with anyio.fail_after(10):
                await dht.start()
            dhts.append(dht)
        expiration = get_dht_time() + 60
        with anyio.fail_after(30):
            assert await dhts[2].store("over", scheme, expiration)
            assert await dhts[3].store("dict", 1, expiration, subkey="a")
            assert await dhts[4].store("dict", 2, expiration, subkey="b")
            got = await dhts[5].get("over")
            assert got == ValueWithExpiration(scheme, expiration)
            merged = await dhts[1].get("dict", latest=True)
            assert isinstance(merged, dict)
            assert {k: v.value for k, v in merged.items()} == {"a": 1, "b": 2}


async def test_a_hundred_node_swarm_with_a_tenth_killed() -> None:
    """Every get finds every stored value in a 100-node swarm; with 10 nodes killed at random
    afterwards (and their records gone with them), at least 99% of gets still succeed."""
    async with _swarm(100) as dhts:
        rng = random.Random(11)
        expiration = get_dht_time() + 300
        with anyio.fail_after(120):
            for i in range(100):
                assert await rng.choice(dhts).store(f"v{i}", i, expiration)
            for i in range(100):
                got = await rng.choice(dhts).get(f"v{i}")
                assert got is not None, f"v{i} not found"
                assert got.value == i  # type: ignore[union-attr]
            killed = rng.sample(dhts[1:], 10)
            for dht in killed:
                await dht.node.aclose()
            alive = [d for d in dhts if d not in killed]
            hits = 0
            for i in range(100):
                got = await rng.choice(alive).get(f"v{i}")
                hits += got is not None and got.value == i  # type: ignore[union-attr]
        assert hits >= 99, f"{hits}/100 gets succeeded with 10% of the nodes killed"
