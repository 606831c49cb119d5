"""The serving half of the DHT (DHTProtocol) between real nodes on a MemoryNetwork."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import msgpack
import pytest

from swarmavg.aio.dht import DHTProtocol
from swarmavg.aio.node import Node
from swarmavg.errors import RemoteError
from swarmavg.identity import Identity
from swarmavg.proto.dht_messages import (
    KNOWN_PREFIX_BYTES,
    MAX_KNOWN,
    DHTFindRequest,
    DHTFindResponse,
    DHTPeerInfo,
    DHTPingRequest,
    DHTPingResponse,
    DHTStoreRequest,
    DHTStoreResponse,
    id_prefix,
    known_prefixes,
    parse_known,
)
from swarmavg.proto.dht_validation import (
    DHTRecord,
    SchemaValidator,
    SignatureValidator,
    owner_marker,
)
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio

T0 = 1_900_000_000.0


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


@asynccontextmanager
async def _nodes(n: int, **options: object) -> AsyncIterator[list[tuple[Node, DHTProtocol]]]:
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            node = await stack.enter_async_context(
                Node(listen=["memory://local:0"], transports={"memory": {"network": network}})
            )
            dht = DHTProtocol(node, clock=lambda: T0, **options)  # type: ignore[arg-type]
            dht.register()
            out.append((node, dht))
        yield out


def _store(
    sender: DHTPeerInfo | None,
    *records: tuple[bytes, bytes | None, bytes, float],
    nearest: int = 0,
) -> DHTStoreRequest:
    return DHTStoreRequest(
        sender,
        [r[0] for r in records],
        [r[1] for r in records],
        [r[2] for r in records],
        [r[3] for r in records],
        nearest,
    )


async def test_store_then_find_many_keys_in_one_request() -> None:
    async with _nodes(2) as [(server, _), (client, client_dht)]:
        address = server.addresses[0]
        with anyio.fail_after(5):
            stored = await client.rpc.call(
                address,
                "dht.store",
                _store(
                    client_dht.own_info(),
                    (b"a", None, _pack(1), T0 + 60),
                    (b"b", b"x", _pack("bx"), T0 + 60),
                    (b"b", b"y", _pack("by"), T0 + 30),
                    (b"c", None, _pack(3), T0 - 1),  # expired
                ),
                response_type=DHTStoreResponse,
            )
            assert stored.accepted == [True, True, True, False]
            found = await client.rpc.call(
                address,
                "dht.find",
                DHTFindRequest(client_dht.own_info(), [b"a", b"b", b"c"], []),
                response_type=DHTFindResponse,
            )
        a, b, c = found.results
        assert (a.value, a.expiration, a.entries) == (_pack(1), T0 + 60, [])
        assert a.value is not None
        assert b.value is None
        assert sorted(b.entries) == [(b"x", _pack("bx"), T0 + 60), (b"y", _pack("by"), T0 + 30)]
        assert (c.value, c.entries) == (None, [])


async def test_peers_are_learned_from_requests_and_named_in_answers() -> None:
    async with _nodes(4) as nodes:
        (server, server_dht), *clients = nodes
        with anyio.fail_after(5):
            for node, dht in clients:
                pong = await node.rpc.call(
                    server.addresses[0],
                    "dht.ping",
                    DHTPingRequest(dht.own_info()),
                    response_type=DHTPingResponse,
                )
                assert pong.dht_time == T0
                assert pong.serving
            assert len(server_dht.routing) == 3
            asker, asker_dht = clients[0]
            found = await asker.rpc.call(
                server.addresses[0],
                "dht.find",
                DHTFindRequest(asker_dht.own_info(), [b"anything"], []),
                response_type=DHTFindResponse,
            )
        named = {info.peer_id: info.addresses for info in found.results[0].nearest}
        assert set(named) == {node.peer_id for node, _ in clients[1:]}  # not the asker itself
        for node, _ in clients[1:]:
            assert named[node.peer_id] == [str(a) for a in node.addresses]


async def test_answers_name_as_many_peers_as_asked_up_to_k() -> None:
    """A find or a store names at most ``nearest`` peers when the caller asks for fewer than
    k (the nearest ones), k when it asks for none, for more, or for a negative count."""
    async with _nodes(7, k=4) as nodes:
        (server, server_dht), *clients = nodes
        with anyio.fail_after(5):
            for node, dht in clients:
                await node.rpc.call(server.addresses[0], "dht.ping", DHTPingRequest(dht.own_info()))
            assert len(server_dht.routing) == 6
            asker = clients[0][0]
            everyone = server_dht.routing.nearest(5, 4, exclude=asker.peer_id)
            for wanted, named in ((2, 2), (0, 4), (3, 3), (9, 4), (-1, 4)):
                found = await asker.rpc.call(
                    server.addresses[0],
                    "dht.find",
                    DHTFindRequest(None, [], [(5).to_bytes(32, "big")], wanted),
                    response_type=DHTFindResponse,
                )
                ids = [info.peer_id for info in found.results[0].nearest]
                assert ids == [peer for peer, _ in everyone[:named]]
                stored = await asker.rpc.call(
                    server.addresses[0],
                    "dht.store",
                    _store(None, (b"k%d" % wanted, None, _pack(1), T0 + 60), nearest=wanted),
                    response_type=DHTStoreResponse,
                )
                assert len(stored.nearest) == named


async def test_answers_leave_out_the_peers_the_asker_knows() -> None:
    """``known`` (8-byte node-id prefixes) takes peers out of an answer's nearest list (a find
    of a key or a target, and a store): the asker has them already; the rest are named as
    before. Garbage in ``known`` only leaves out nothing."""
    async with _nodes(7, k=6) as nodes:
        (server, server_dht), *clients = nodes
        with anyio.fail_after(5):
            for node, dht in clients:
                await node.rpc.call(server.addresses[0], "dht.ping", DHTPingRequest(dht.own_info()))
            asker = clients[0][0]
            target = (5).to_bytes(32, "big")
            everyone = server_dht.routing.nearest(5, 6, exclude=asker.peer_id)
            skipped = {everyone[0][0], everyone[3][0]}
            known = known_prefixes(nid for peer, nid in everyone if peer in skipped)
            expected = [peer for peer, _ in everyone if peer not in skipped]
            for request in (
                DHTFindRequest(None, [], [target], 0, known),
                DHTFindRequest(None, [b"key"], [], 0, known),
            ):
                found = await asker.rpc.call(
                    server.addresses[0], "dht.find", request, response_type=DHTFindResponse
                )
                named = [info.peer_id for info in found.results[0].nearest]
                if request.targets:
                    assert named == expected
                else:
                    assert set(named) == set(expected)  # (nearest to the key: another order)
            store = _store(None, (b"key", None, _pack(1), T0 + 60))
            stored = await asker.rpc.call(
                server.addresses[0],
                "dht.store",
                dataclasses.replace(store, known=known),
                response_type=DHTStoreResponse,
            )
            assert stored.accepted == [True]
            assert not skipped & {info.peer_id for info in stored.nearest}
            assert len(stored.nearest) == len(expected)
            for garbage in (b"\x01", b"\xff" * 7, b"\x00" * 8 * 1000):
                found = await asker.rpc.call(
                    server.addresses[0],
                    "dht.find",
                    DHTFindRequest(None, [], [target], 0, garbage),
                    response_type=DHTFindResponse,
                )
                assert len(found.results[0].nearest) == len(everyone)


def test_known_prefixes_round_trip_and_are_bounded() -> None:
    ids = [random.getrandbits(256) for _ in range(100)]
    known = known_prefixes(ids)
    assert len(known) == MAX_KNOWN * KNOWN_PREFIX_BYTES  # at most MAX_KNOWN are sent
    parsed = parse_known(known + b"\x01\x02")  # (a trailing partial prefix is ignored)
    assert parsed == {id_prefix(nid) for nid in ids[:MAX_KNOWN]}
    assert parse_known(known * 2) == parsed  # at most MAX_KNOWN are read
    assert parse_known(b"") == frozenset()


async def test_sender_info_must_be_the_callers_own() -> None:
    async with _nodes(3) as [(server, server_dht), (liar, _), (victim, _victim_dht)]:
        with anyio.fail_after(5):
            # the liar announces the victim's identity with its own addresses: ignored
            spoofed = DHTPeerInfo(victim.peer_id, [str(a) for a in liar.addresses])
            await liar.rpc.call(server.addresses[0], "dht.ping", DHTPingRequest(spoofed))
            # ...and addresses that name another peer are dropped
            mixed = DHTPeerInfo(liar.peer_id, [str(victim.addresses[0]), "not an address"])
            await liar.rpc.call(server.addresses[0], "dht.ping", DHTPingRequest(mixed))
        assert len(server_dht.routing) == 0
        assert victim.peer_id not in server_dht.addresses


async def test_client_mode_nodes_stay_out_of_routing_tables() -> None:
    network = MemoryNetwork()
    async with (
        Node(listen=["memory://local:0"], transports={"memory": {"network": network}}) as server,
        Node(transports={"memory": {"network": network}}) as client,
    ):
        server_dht = DHTProtocol(server, clock=lambda: T0)
        server_dht.register()
        client_dht = DHTProtocol(client, client_mode=True, clock=lambda: T0)
        client_dht.register()
        assert client_dht.own_info() is None
        with anyio.fail_after(5):
            await client.rpc.call(server.addresses[0], "dht.ping", DHTPingRequest(None))
            stored = await client.rpc.call(
                server.addresses[0],
                "dht.store",
                _store(None, (b"k", None, _pack("v"), T0 + 5)),
                response_type=DHTStoreResponse,
            )
        assert stored.accepted == [True]  # a client may store and query...
        assert len(server_dht.routing) == 0  # ...but is not routed to
        with anyio.fail_after(5), pytest.raises(RemoteError):  # and serves no finds itself
            await server.rpc.call(client.peer_id, "dht.find", DHTFindRequest(None, [b"k"], []))


async def test_owner_records_and_schemas_are_enforced_on_store() -> None:
    owner = Identity.generate()
    key = b"state" + owner_marker(owner.peer_id)
    async with _nodes(2, validators=[SchemaValidator({"loss": float})]) as [
        (server, _),
        (client, _),
    ]:
        signed = SignatureValidator(owner).sign_value(DHTRecord(key, None, _pack(1), T0 + 9))
        forged = SignatureValidator(owner).sign_value(DHTRecord(key, None, _pack(2), T0 + 8))
        with anyio.fail_after(5):
            stored = await client.rpc.call(
                server.addresses[0],
                "dht.store",
                _store(
                    None,
                    (key, None, signed, T0 + 9),  # the owner's, relayed by anyone: fine
                    (key, None, forged, T0 + 10),  # signed for another expiration
                    (key, None, _pack(3), T0 + 11),  # not signed at all
                    (_pack("loss"), None, _pack(0.5), T0 + 5),
                    (_pack("loss"), None, _pack("high"), T0 + 6),  # not a float
                ),
                response_type=DHTStoreResponse,
            )
        assert stored.accepted == [True, False, False, True, False]


async def test_malformed_requests_are_refused() -> None:
    async with _nodes(2) as [(server, _), (client, _)]:
        with anyio.fail_after(5):
            bad = DHTStoreRequest(None, [b"a", b"b"], [None], [b"1"], [T0 + 1])
            with pytest.raises(RemoteError):
                await client.rpc.call(server.addresses[0], "dht.store", bad)
            too_many = DHTFindRequest(None, [b"k"] * 1000, [])
            with pytest.raises(RemoteError):
                await client.rpc.call(server.addresses[0], "dht.find", too_many)
            # the node keeps serving
            await client.rpc.call(server.addresses[0], "dht.ping", DHTPingRequest(None))
