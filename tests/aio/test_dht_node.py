"""DHTNode: bootstrap, replicated store and get across real nodes on a MemoryNetwork."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import msgpack
import pytest

from swarmavg import get_dht_time
from swarmavg.address import Address
from swarmavg.aio.dht import DHTNode
from swarmavg.aio.node import Node
from swarmavg.errors import ConnectError
from swarmavg.identity import Identity
from swarmavg.proto.dht_messages import (
    DHTFindRequest,
    DHTFindResponse,
    DHTPeerInfo,
    DHTStoreRequest,
    DHTStoreResponse,
    key_id,
)
from swarmavg.proto.dht_storage import ValueWithExpiration
from swarmavg.proto.dht_validation import SchemaValidator, owner_marker
from swarmavg.proto.dht_values import pack
from swarmavg.proto.routing import node_id
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
            with anyio.fail_after(10):
                dht = await stack.enter_async_context(DHTNode(node, initial_peers=seeds, **options))
            dhts.append(dht)
        yield dhts


async def test_every_msgpack_type_round_trips_between_peers() -> None:
    values: list[Any] = [
        *(None, True, 7, -(2**40), 1.5, "text", b"\x00bytes", [1, "a"], {"k": [1.5]}),
        *(("i", "love", "bees"), (), [(1, 2), [3]], {"t": (1, (2, [3]))}, {(1, "a"): ("b",)}),
    ]
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
                assert value_back == value  # (a tuple never equals a list)
                assert repr(value_back) == repr(value)  # (nor a 1 a True, nested too)


async def test_get_returns_hivemind_shapes_for_plain_and_dictionary_values() -> None:
    async with _swarm(10) as dhts:
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await dhts[1].get("absent") is None
            assert await dhts[1].get("absent", latest=True) is None
            assert await dhts[2].store("plain", ("a", 1), now + 30)
            assert await dhts[3].get("plain") == ValueWithExpiration(("a", 1), now + 30)
            # a dictionary: ValueWithExpiration({subkey: (value, expiration)}, latest of them)
            assert await dhts[4].store("party", "yes", now + 40, subkey="alice")
            assert await dhts[5].store("party", "no", now + 20, subkey=("carol", 3))
            for latest in (True, False):
                got = await dhts[6].get("party", latest=latest)
                assert got is not None
                attendees, expiration = got
                assert expiration == now + 40
                assert attendees == {
                    "alice": ValueWithExpiration("yes", now + 40),
                    ("carol", 3): ValueWithExpiration("no", now + 20),
                }
            # a plain value that expires later replaces the dictionary on a replica
            assert await dhts[7].store("party", "cancelled", now + 50)
            assert await dhts[8].get("party", latest=True) == ("cancelled", now + 50)
            # all the subkeys expired for a reader (its clock 25 s ahead): nothing
            assert await dhts[4].store("short", 1, now + 10, subkey="a")
            assert await dhts[5].store("short", 2, now + 20, subkey="b")
            reader = _reader(dhts[9], clock=lambda: get_dht_time() + 25)
            assert await reader.get("short", latest=True) is None
            assert await reader.get("short") is None
            got = await _reader(dhts[9], clock=lambda: get_dht_time() + 15).get("short", True)
            assert got == ({"b": (2, now + 20)}, now + 20)  # (only the live subkey)
            with pytest.raises(TypeError, match="hashable"):
                await dhts[1].store("party", "yes", now + 40, subkey=["a", "list"])
            with pytest.raises(TypeError, match="DHT value"):
                await dhts[1].store("party", {1, 2}, now + 40)


def _reader(peer: DHTNode, clock: Any = get_dht_time) -> DHTNode:
    """A client-mode DHT node beside ``peer``, knowing the peers it knows, with ``clock``."""
    reader = DHTNode(peer.node, client_mode=True, clock=clock)
    reader.protocol.routing = peer.protocol.routing
    reader.protocol.addresses = peer.protocol.addresses
    return reader


async def test_records_that_do_not_decode_are_ignored_by_get() -> None:
    async with _swarm(10) as dhts:
        now = get_dht_time()
        key = pack("group", "key")
        with anyio.fail_after(30):
            assert await dhts[1].store("group", ("alice",), now + 30, subkey="a")
            assert await dhts[2].store("group", "bob", now + 40, subkey="b")
            # a hostile writer's subkeys, newer, on every peer (stores of raw bytes go through:
            # nodes check signatures and schemas, not values)
            garbage = [
                (pack("c", "subkey"), b"\xd4\x05\x00"),  # an unknown extension type
                (pack([1], "subkey"), pack("unhashable subkey")),
                (b"\xc1", pack("a subkey that is not msgpack")),
                (pack("d", "subkey"), _nested_tuples(10_000)),
            ]
            holders = [d for d in dhts if d.protocol.storage.get(key, now) is not None]
            for peer in dhts:
                for subkey, value in garbage:
                    assert peer.protocol.storage.store(key, value, now + 60, now, subkey=subkey)
            for holder in holders[1:]:  # a value that is not msgpack shadows a's on most
                storage = holder.protocol.storage
                assert storage.store(key, b"\xc1", now + 60, now, subkey=pack("a", "subkey"))
            for reader in (dhts[3], _reader(dhts[4])):
                got = await reader.get("group", latest=True)
                assert got == ({"a": (("alice",), now + 30), "b": ("bob", now + 40)}, now + 40)
            # a plain value: where the replicas hold garbage, the older valid value is found
            assert await dhts[5].store("plain", "valid", now + 30)
            plain = pack("plain", "key")
            holders = [d for d in dhts if d.protocol.storage.get(plain, now) is not None]
            for holder in holders[1:]:
                assert holder.protocol.storage.store(plain, b"\xc1", now + 60, now)
            assert await _reader(dhts[6]).get("plain", latest=True) == ("valid", now + 30)
            for holder in holders[:1]:
                assert holder.protocol.storage.store(plain, b"\xc1", now + 60, now)
            assert await _reader(dhts[6]).get("plain", latest=True) is None
            assert await _reader(dhts[6]).get("plain") is None


def _nested_tuples(count: int) -> bytes:
    """``count`` tuples nested, as a hostile peer would pack them."""
    data = b"\x90"
    for _ in range(count):
        data = b"\x91\xc9" + len(data).to_bytes(4, "big") + b"\x40" + data
    return data[1:]


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


async def test_a_store_reaches_exactly_the_nearest_replicas_storer_included() -> None:
    """In a swarm whose routing tables are complete, a record lives on exactly the
    num_replicas nodes nearest to its key: a storer among them keeps it itself and asks one
    peer fewer (it used to ask num_replicas others and keep a copy too)."""
    async with _swarm(8) as dhts:
        with anyio.fail_after(20):
            while any(d.routing_table_size < 7 for d in dhts):  # noqa: ASYNC110
                await anyio.sleep(0.05)
            now = get_dht_time()
            rng = random.Random(8)
            storer_among_nearest = 0
            for i in range(24):
                key = f"replicated-{i}"
                storer = rng.choice(dhts)
                assert await storer.store(key, i, now + 60)
                target = key_id(msgpack.packb(key))
                nearest = sorted(dhts, key=lambda d: node_id(d.peer_id) ^ target)[:5]
                key_bytes = msgpack.packb(key)
                holders = [d for d in dhts if d.protocol.storage.get(key_bytes, now) is not None]
                assert {d.peer_id for d in holders} == {d.peer_id for d in nearest}
                storer_among_nearest += storer in nearest
            assert storer_among_nearest > 0  # (the case this is about did occur)


async def test_subkeys_merge_and_latest_finds_the_newest() -> None:
    async with _swarm(15) as dhts:
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await dhts[1].store("group", "alice", now + 30, subkey="a")
            assert await dhts[2].store("group", "bob", now + 40, subkey="b")
            got = await dhts[3].get("group", latest=True)
            assert got is not None
            group, expiration = got  # (hivemind's shape: the latest of the subkeys' expirations)
            assert expiration == now + 40
            assert {k: v.value for k, v in group.items()} == {"a": "alice", "b": "bob"}
            assert group["b"].expiration_time == now + 40
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


@pytest.mark.realtime
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
            assert merged is not None
            assert {k: v.value for k, v in merged.value.items()} == {"a": 1, "b": 2}


@pytest.mark.slow
async def test_a_hundred_node_swarm_with_a_tenth_killed() -> None:
    """Every get finds every stored value in a 100-node swarm; with 10 nodes killed at random
    afterwards (and their records gone with them), at least 99% of gets still succeed."""
    async with _swarm(100, cache_locally=False) as dhts:
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


async def test_expired_values_vanish_and_older_stores_do_not_replace_newer() -> None:
    async with _swarm(10) as dhts:
        now = get_dht_time()
        kept = msgpack.packb("kept")
        with anyio.fail_after(30):
            assert await dhts[1].store("short", "lived", now + 0.5)
            assert await dhts[2].store("kept", "new", now + 60)
            holders = [d for d in dhts if d.protocol.storage.get(kept, now) is not None]
            assert holders
            await dhts[3].store("kept", "old", now + 30)
            # every replica that held the newer value refused the older one (a peer the first
            # store did not reach may take the older one: gets with latest=True still see both)
            for holder in holders:
                stored = holder.protocol.storage.get(kept, now)
                assert stored is not None
                assert stored.expiration_time == now + 60  # type: ignore[union-attr]
            await anyio.sleep(0.7)
            assert await dhts[4].get("short", latest=True) is None
            assert (await dhts[5].get("kept", latest=True)) == ValueWithExpiration("new", now + 60)
            with pytest.raises(ValueError, match="limit"):
                await dhts[6].store("big", b"x" * (65 << 10), now + 60)


async def test_an_owner_record_reads_correctly_after_its_owner_left() -> None:
    async with _swarm(10) as dhts:
        owner = dhts[4]
        key = "profile" + owner_marker(owner.peer_id).decode()
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await owner.store(key, "mine", now + 60)
            await owner.node.aclose()
            got = await dhts[7].get(key, latest=True)
            assert got == ValueWithExpiration("mine", now + 60)


async def test_a_schema_validator_rejects_values_of_the_wrong_type_on_every_peer() -> None:
    schema = SchemaValidator({"loss": float})
    async with _swarm(8, validators=[schema]) as dhts:
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await dhts[1].store("loss", 0.25, now + 60)
            with pytest.raises(ValueError, match="validators"):
                await dhts[2].store("loss", "not a number", now + 90)
            # a peer without the schema stores it anyway: the peers with it refuse the record
            # and never hand it out
            loose = DHTNode(dhts[2].node, client_mode=True)
            loose.protocol.routing = dhts[2].protocol.routing
            loose.protocol.addresses = dhts[2].protocol.addresses
            assert not await loose.store("loss", "not a number", now + 90)
            assert await dhts[3].get("loss", latest=True) == ValueWithExpiration(0.25, now + 60)


def _store_request(writer: DHTNode, prefix: str, count: int) -> DHTStoreRequest:
    keys = [f"{prefix}{i}".encode() for i in range(count)]
    expirations = [get_dht_time() + 60] * count
    return DHTStoreRequest(
        writer.protocol.own_info(), keys, [None] * count, [b"\x01"] * count, expirations
    )


async def _accepted(writer: DHTNode, target: DHTNode, request: DHTStoreRequest) -> int:
    response = await writer.node.rpc.call(
        target.node.addresses[0], "dht.store", request, response_type=DHTStoreResponse
    )
    return sum(response.accepted)


async def test_a_peer_over_its_store_rate_is_refused_others_are_not() -> None:
    async with _swarm(4, max_stores_per_second=1.0) as dhts:
        writer, target, bystander = dhts[1], dhts[2], dhts[3]
        with anyio.fail_after(30):
            accepted = 0
            for batch in range(4):  # 1024 records at once: the burst allows 512
                accepted += await _accepted(
                    writer, target, _store_request(writer, f"w{batch}-", 256)
                )
            assert accepted == 512
            assert await _accepted(bystander, target, _store_request(bystander, "b", 256)) == 256


async def test_a_peer_holds_at_most_max_records_per_peer() -> None:
    async with _swarm(3, max_records_per_peer=100) as dhts:
        writer, target = dhts[1], dhts[2]
        with anyio.fail_after(30):
            assert await _accepted(writer, target, _store_request(writer, "r", 256)) == 100
            assert await _accepted(writer, target, _store_request(writer, "s", 10)) == 0


async def test_a_failed_peer_is_banned_and_not_taken_back_while_banned() -> None:
    async with _swarm(6, blacklist_delay=60.0) as dhts:
        victim = dhts[3]
        with anyio.fail_after(30):
            await victim.node.aclose()
            for i in range(20):  # lookups that ask the victim fail and ban it
                await dhts[0].get(f"missing{i}", latest=True)
            protocol = dhts[0].protocol
            assert protocol.blacklist.is_banned(victim.peer_id, get_dht_time())
            assert victim.peer_id not in protocol.routing
            # someone naming the victim again does not bring it back while it is banned
            protocol.learn(
                DHTPeerInfo(victim.peer_id, [str(victim.node.addresses[0])]), victim.peer_id
            )
            assert victim.peer_id not in protocol.routing


async def test_the_cache_answers_when_the_replicas_are_gone() -> None:
    async with _swarm(12, num_replicas=2) as dhts:
        now = get_dht_time()
        with anyio.fail_after(30):
            assert await dhts[0].store("hot", "value", now + 60)
            holders = [d for d in dhts if len(d.protocol.storage)]
            assert 1 <= len(holders) <= 3
            reader = next(d for d in dhts[1:] if d not in holders)
            assert await reader.get("hot") == ValueWithExpiration("value", now + 60)
            for holder in holders:
                await holder.node.aclose()
            assert await reader.get("hot", latest=True) is None  # the network lost it
            assert await reader.get("hot") == ValueWithExpiration("value", now + 60)


@asynccontextmanager
async def _full_bucket() -> AsyncIterator[tuple[DHTNode, list[Node]]]:
    """A DHTNode (k=2, depth_modulo=1) and three running peers whose ids sit in the half of the
    id space it is not in: a bucket that cannot split, with room for two of them."""
    network = MemoryNetwork()
    transports = {"memory": {"network": network}}
    async with AsyncExitStack() as stack:
        own = await stack.enter_async_context(
            Node(listen=["memory://local:0"], transports=transports)
        )
        top = node_id(own.peer_id) >> 255
        others: list[Node] = []
        while len(others) < 3:
            identity = Identity.generate()
            if node_id(identity.peer_id) >> 255 != top:
                node = Node(identity=identity, listen=["memory://local:0"], transports=transports)
                others.append(await stack.enter_async_context(node))
        dht = await stack.enter_async_context(DHTNode(own, k=2, depth_modulo=1, request_timeout=1))
        for peer in others:
            await stack.enter_async_context(DHTNode(peer, k=2))
        yield dht, others


async def test_a_full_bucket_pings_its_oldest_peer_and_replaces_it_if_dead() -> None:
    """A learns B and C; D waits as a replacement while A pings B (the least recently seen).
    B is dead: D takes its place."""
    async with _full_bucket() as (dht, (b, c, d)):
        with anyio.fail_after(20):
            await dht._ping(b.addresses[0])
            await dht._ping(c.addresses[0])
            await b.aclose()
            await dht._ping(d.addresses[0])  # bucket full: D waits, B gets pinged
            while b.peer_id in dht.protocol.routing:  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.01)
        assert set(dht.protocol.routing) == {c.peer_id, d.peer_id}


async def test_an_old_peer_that_answers_keeps_its_place() -> None:
    async with _full_bucket() as (dht, (b, c, d)):
        with anyio.fail_after(20):
            await dht._ping(b.addresses[0])
            await dht._ping(c.addresses[0])
            await dht._ping(d.addresses[0])
            while dht.protocol.ping_queue:  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.01)
            await anyio.sleep(0.1)
        assert set(dht.protocol.routing) == {b.peer_id, c.peer_id}


async def test_stale_buckets_are_refreshed_by_a_lookup_in_their_range() -> None:
    async with _swarm(6) as dhts:
        network = dhts[0].node._transport_options["memory"]["network"]
        async with Node(
            listen=["memory://local:0"], transports={"memory": {"network": network}}
        ) as node:
            dht = DHTNode(node, initial_peers=[dhts[0].node.addresses[0]], refresh_period=0.2)
            looked_up: list[int] = []
            find_peers = dht.find_peers

            async def spy(target: int) -> Any:
                looked_up.append(target)
                return await find_peers(target)

            dht.find_peers = spy  # type: ignore[method-assign]
            async with dht:
                bootstrap_lookups = len(looked_up)
                with anyio.fail_after(10):
                    while len(looked_up) == bootstrap_lookups:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
            target = looked_up[-1]
            assert any(b.lower <= target < b.upper for b in dht.protocol.routing.buckets)
            assert target != node_id(dht.peer_id)


async def test_latest_finds_the_newest_where_first_found_may_not() -> None:
    async with _swarm(12, cache_locally=False) as dhts:
        now = get_dht_time()
        key = msgpack.packb("version")
        with anyio.fail_after(30):
            assert await dhts[0].store("version", "v1", now + 30)
            replicas = [d for d in dhts if d.protocol.storage.get(key, now) is not None]
            assert len(replicas) >= 5
            # one replica alone learns a newer value (as if the others missed that store): the
            # nearest to the key, which every latest lookup asks (a store may leave copies on
            # more than num_replicas peers, and a lookup asks only the nearest of them)
            nearest = min(replicas, key=lambda d: node_id(d.peer_id) ^ key_id(key))
            newer = msgpack.packb("v2")
            assert nearest.protocol.storage.store(key, newer, now + 60, now).accepted
            reader = next(d for d in dhts if d not in replicas)
            first = await reader.get("version")
            assert first in (
                ValueWithExpiration("v1", now + 30),
                ValueWithExpiration("v2", now + 60),
            )
            assert await reader.get("version", latest=True) == ValueWithExpiration("v2", now + 60)


async def _owned_record(
    dhts: list[DHTNode], owner: DHTNode, name: str
) -> tuple[str, bytes, float, list[DHTNode]]:
    """``owner`` stores "genuine" (for 30 s) under a key it owns: the key, packed, the time
    and the replicas that hold it."""
    key = name + owner_marker(owner.peer_id).decode()
    key_bytes = msgpack.packb(key)
    now = get_dht_time()
    assert await owner.store(key, "genuine", now + 30)
    replicas = [d for d in dhts if d.protocol.storage.get(key_bytes, now) is not None]
    return key, key_bytes, now, replicas


async def test_forged_records_on_a_replica_are_never_returned() -> None:
    async with _swarm(10, cache_locally=False) as dhts:
        with anyio.fail_after(30):
            key, key_bytes, now, replicas = await _owned_record(dhts, dhts[3], "owned")
            # a dishonest replica holds a newer record with a forged or missing signature
            forged = msgpack.packb([msgpack.packb("forged"), b"\x00" * 64])
            unsigned = msgpack.packb("unsigned")
            replicas[0].protocol.storage.store(key_bytes, forged, now + 90, now)
            replicas[1].protocol.storage.store(key_bytes, unsigned, now + 90, now)
            for reader in (d for d in dhts if d not in replicas[:2]):
                got = await reader.get(key, latest=True)
                assert got == ValueWithExpiration("genuine", now + 30)


async def test_a_latest_get_validates_each_record_once_not_once_per_replica() -> None:
    async with _swarm(10, cache_locally=False) as dhts:
        with anyio.fail_after(30):
            key, _, now, replicas = await _owned_record(dhts, dhts[2], "signed")
            assert len(replicas) >= 4
            reader = next(d for d in dhts if d not in replicas)
            validator = reader.protocol.validator
            checked: list[Any] = []
            original = validator.validate

            def counting(record: Any) -> bool:
                checked.append(record)
                return original(record)

            validator.validate = counting  # type: ignore[method-assign]
            got = await reader.get(key, latest=True)
        assert got == ValueWithExpiration("genuine", now + 30)
        # every replica asked answered with the same record: its signature is checked once
        assert len(checked) == 1


async def test_bootstrap_warns_about_a_peer_whose_clock_is_far_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    network = MemoryNetwork()
    transports = {"memory": {"network": network}}
    async with (
        Node(listen=["memory://local:0"], transports=transports) as skewed,
        Node(listen=["memory://local:0"], transports=transports) as newcomer,
    ):
        ahead = DHTNode(skewed, clock=lambda: get_dht_time() + 30)
        async with ahead:
            with caplog.at_level("WARNING", logger="swarmavg.aio.dht"), anyio.fail_after(10):
                async with DHTNode(newcomer, initial_peers=[skewed.addresses[0]]) as dht:
                    assert skewed.peer_id in dht.protocol.routing
        warnings = [r.getMessage() for r in caplog.records if "clock" in r.getMessage()]
        assert len(warnings) == 1
        assert skewed.peer_id.short() in warnings[0]
        assert "30." in warnings[0] or "29." in warnings[0]


class _Hang:
    """A ``dht.find`` handler that never answers, and records that its call was left."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = anyio.Event()

    async def __call__(self, request: DHTFindRequest, ctx: Any) -> DHTFindResponse:
        self.started += 1
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled.set()
        raise AssertionError("unreachable")


def _hang_finds(dht: DHTNode) -> _Hang:
    hang = _Hang()
    dht.node.rpc.unregister("dht.find")
    dht.node.rpc.register("dht.find", hang, request_type=DHTFindRequest)
    return hang


def _by_distance(dhts: list[DHTNode], key: str) -> list[DHTNode]:
    target = key_id(msgpack.packb(key))
    return sorted(dhts, key=lambda d: node_id(d.peer_id) ^ target)


async def test_a_peer_that_never_answers_costs_a_lookup_one_timeout() -> None:
    """A latest get needs every peer of its beam: one that never answers is given up at the
    request timeout (the other answers were read meanwhile), dropped, and its handler is
    cancelled when the call is left."""
    async with _swarm(8, cache_locally=False) as dhts:
        for dht in dhts:  # (after bootstrap: a busy CI machine may take longer to dial)
            dht.request_timeout = 0.5
        expiration = get_dht_time() + 60
        with anyio.fail_after(10):
            assert await dhts[0].store("slow", "value", expiration)
        *near, getter = _by_distance(dhts, "slow")
        hung = near[0]
        hang = _hang_finds(hung)
        start = anyio.current_time()
        with anyio.fail_after(5):
            got = await getter.get("slow", latest=True)
        elapsed = anyio.current_time() - start
        assert got == ValueWithExpiration("value", expiration)
        assert hang.started == 1
        assert elapsed == pytest.approx(0.5, abs=1e-3)  # the request timeout (virtual time)
        assert hung.peer_id not in getter.protocol.routing
        with anyio.fail_after(5):
            await hang.cancelled.wait()


async def test_a_lookup_that_found_its_value_leaves_the_queries_in_flight() -> None:
    async with _swarm(8, num_replicas=2, request_timeout=5, cache_locally=False) as dhts:
        expiration = get_dht_time() + 60
        with anyio.fail_after(10):
            assert await dhts[0].store("found", 7, expiration)
        nearest, second, *_, getter = _by_distance(dhts, "found")
        assert (await second.get("found")) is not None  # a replica: it answers with the value
        hang = _hang_finds(nearest)
        start = anyio.current_time()
        with anyio.fail_after(3):
            got = await getter.get("found")
        assert got == ValueWithExpiration(7, expiration)
        assert anyio.current_time() - start < 0.01  # (not the 5 s request timeout)
        assert hang.started == 1
        with anyio.fail_after(5):
            await hang.cancelled.wait()  # the unanswered call was reset when the lookup ended
        assert nearest.peer_id in getter.protocol.routing  # left, not failed


async def test_answers_never_name_the_peers_a_lookup_started_with() -> None:
    """A lookup's request says which candidates it starts with (its routing table's nearest:
    the beam and as many stand-ins); answers leave them out. In a swarm this small, where
    tables hold everyone, the answers name no one at all."""
    async with _swarm(8, cache_locally=False) as dhts:
        expiration = get_dht_time() + 60
        with anyio.fail_after(10):
            for i in range(8):
                assert await dhts[i].store(f"warm{i}", i, expiration)
        getter = dhts[5]
        named: list[list[DHTPeerInfo]] = []
        real = getter._candidates

        def spy(infos: list[DHTPeerInfo]) -> list[tuple[Any, int]]:
            named.append(list(infos))
            return real(infos)

        getter._candidates = spy  # type: ignore[method-assign]
        for i in range(8):
            target = key_id(msgpack.packb(f"warm{i}"))
            started_with = {peer for peer, _ in getter.protocol.routing.nearest(target, 10)}
            named.clear()
            with anyio.fail_after(10):
                got = await getter.get(f"warm{i}", latest=True)
            assert got is not None
            assert got.value == i  # type: ignore[union-attr]
            assert named, "the lookup read answers"
            assert not started_with & {info.peer_id for answer in named for info in answer}
            if len(getter.protocol.routing) == len(dhts) - 1:
                assert all(answer == [] for answer in named)


async def test_lookups_on_a_node_that_closed_end_without_a_result() -> None:
    """A lookup whose node closes (under it, or before: a background task that begins as the
    node closes) ends at once with what it has (no peer answers): no error escapes or is
    logged."""
    async with _swarm(4, cache_locally=False) as dhts:
        own = dhts[0]
        await own.node.aclose()
        with anyio.fail_after(5):
            await own.store("after", 2, get_dht_time() + 60)  # (its own storage may take it)
            assert await own.get("elsewhere", latest=True) is None
            assert await own.find_peers(node_id(dhts[1].peer_id)) == []
