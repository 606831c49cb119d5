"""``swarmavg.aio.DHT``: the DHT as one object (node + DHTNode), with hivemind's names."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from swarmavg import ConnectError, Identity, ValueWithExpiration, get_dht_time
from swarmavg.address import Address
from swarmavg.aio import DHT, Node
from swarmavg.aio.dht import DHTNode
from swarmavg.testing import MemoryNetwork

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

#: Seconds any one step (a bootstrap, a store, a get) may take before the test fails.
STEP = 10


def _memory(network: MemoryNetwork) -> dict[str, Any]:
    return {"transport": "memory", "transport_options": {"network": network}}


@asynccontextmanager
async def _swarm(
    n: int, network: MemoryNetwork | None = None, **options: Any
) -> AsyncIterator[list[DHT]]:
    """``n`` peers on a MemoryNetwork, each bootstrapped from the visible multiaddrs of up to two
    earlier ones."""
    network = MemoryNetwork() if network is None else network
    rng = random.Random(n)
    async with AsyncExitStack() as stack:
        dhts: list[DHT] = []
        for _ in range(n):
            seeds = [m for d in rng.sample(dhts, min(2, len(dhts))) for m in d.get_visible_maddrs()]
            # (no fail_after here: its scope would end inside the node's task group; the test's
            # timeout and the DHT's request_timeout bound the bootstrap)
            dht = await stack.enter_async_context(DHT(seeds, **_memory(network), **options))
            dhts.append(dht)
        yield dhts


async def _can_dial(address: Address, network: MemoryNetwork) -> bool:
    """Whether a fresh node (no pooled connection) can connect to ``address``."""
    async with Node(transports={"memory": {"network": network}}) as probe:
        try:
            with anyio.fail_after(STEP):
                await probe.connect(address)
        except (ConnectError, OSError):
            return False
        return True


async def test_values_and_subkey_dictionaries_round_trip_across_eight_peers() -> None:
    async with _swarm(8) as dhts:
        now = get_dht_time()
        with anyio.fail_after(STEP):
            assert await dhts[1].store("plain", {"nested": [1, 2.5, "x"]}, now + 60)
            got = await dhts[6].get("plain")
            assert isinstance(got, ValueWithExpiration)
            value, expiration = got
            assert value == {"nested": [1, 2.5, "x"]}
            assert expiration == now + 60

            assert await dhts[2].store("group", "alice", now + 30, subkey="a")
            assert await dhts[3].store("group", b"bob", now + 40, subkey="b")
            merged = await dhts[7].get("group", latest=True)
            assert merged == ValueWithExpiration(
                {
                    "a": ValueWithExpiration("alice", now + 30),
                    "b": ValueWithExpiration(b"bob", now + 40),
                },
                now + 40,
            )

            assert await dhts[4].get("never stored") is None


async def test_run_coroutine_passes_the_dht_and_its_node() -> None:
    async with _swarm(3) as dhts:
        seen: list[tuple[DHT, DHTNode]] = []

        async def fn(dht: DHT, node: DHTNode) -> str:
            seen.append((dht, node))
            assert await node.store("via-node", 7, get_dht_time() + 30)
            return "done"

        with anyio.fail_after(STEP):
            assert await dhts[1].run_coroutine(fn) == "done"
            got = await dhts[2].get("via-node")
        assert seen == [(dhts[1], dhts[1].dht_node)]
        assert isinstance(got, ValueWithExpiration)
        assert got.value == 7

        async def fails(dht: DHT, node: DHTNode) -> None:
            raise LookupError("from fn")

        with pytest.raises(LookupError, match="from fn"):
            await dhts[0].run_coroutine(fails)


async def test_visible_maddrs_are_initial_peers_for_another_peer() -> None:
    network = MemoryNetwork()
    async with DHT(**_memory(network)) as first:
        maddrs = first.get_visible_maddrs()
        assert maddrs
        assert all(isinstance(m, str) and m.startswith("/") for m in maddrs)
        assert all(m.endswith(f"/p2p/{first.peer_id}") for m in maddrs)
        assert [Address.parse(m) for m in maddrs] == first.node.addresses
        with anyio.fail_after(STEP):
            async with DHT(maddrs, **_memory(network)) as second:
                assert first.peer_id in second.dht_node.protocol.routing
                assert second.peer_id in first.dht_node.protocol.routing
                assert await second.store("hello", "world", get_dht_time() + 30)
                assert (await first.get("hello")).value == "world"  # type: ignore[union-attr]


async def test_attached_to_a_node_it_leaves_the_node_running() -> None:
    network = MemoryNetwork()
    async with (
        _swarm(3, network) as dhts,
        Node(listen=["memory://local:0"], transports={"memory": {"network": network}}) as node,
    ):
        seeds = dhts[0].get_visible_maddrs()
        # the listening arguments are ignored when a node is given
        dht = DHT(seeds, node=node, transport="no-such-transport", port=5)
        assert dht.node is node
        assert dht.peer_id == node.peer_id
        with anyio.fail_after(STEP):
            async with dht:
                assert dht.get_visible_maddrs() == [a.to_multiaddr() for a in node.addresses]
                assert await dht.store("attached", 1, get_dht_time() + 30)
                assert (await dhts[2].get("attached")).value == 1  # type: ignore[union-attr]
                assert node.peer_id in dhts[0].dht_node.protocol.routing
            await dht.aclose()
        # neither leaving the block nor aclose() closed the node: a fresh peer still reaches it
        assert await _can_dial(node.addresses[0], network)


async def test_a_node_it_made_is_closed_with_it() -> None:
    """The contrast to the test above: the DHT closes a node it made itself."""
    network = MemoryNetwork()
    async with DHT(**_memory(network)) as dht:
        address = dht.node.addresses[0]
        assert await _can_dial(address, network)
    assert not await _can_dial(address, network)


async def test_client_mode_lists_no_addresses_and_is_in_no_routing_table() -> None:
    network = MemoryNetwork()
    async with _swarm(8, network) as dhts:
        seeds = dhts[0].get_visible_maddrs() + dhts[5].get_visible_maddrs()
        with anyio.fail_after(STEP):
            async with DHT(seeds, client_mode=True, **_memory(network)) as client:
                assert client.client_mode
                assert client.get_visible_maddrs() == []
                assert client.get_visible_maddrs(latest=True) == []
                assert client.node.addresses == []
                assert await client.store("from-client", [4, 2], get_dht_time() + 30)
                assert (await dhts[3].get("from-client")).value == [4, 2]  # type: ignore[union-attr]
                assert (await client.get("from-client")).value == [4, 2]  # type: ignore[union-attr]
                assert len(client.dht_node.protocol.routing) > 0  # it knows the servers
                assert [d for d in dhts if client.peer_id in d.dht_node.protocol.routing] == []
                assert all(not d.client_mode for d in dhts)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"initial_peers": "/ip4/127.0.0.1/tcp/1"}, TypeError, "initial_peers"),
        ({"initial_peers": Address("tcp", "127.0.0.1", 1)}, TypeError, "initial_peers"),
        ({"port": 70000}, ValueError, "port"),
        ({"port": -1}, ValueError, "port"),
        ({"port": True}, ValueError, "port"),
        ({"host_maddrs": "/ip4/127.0.0.1/tcp/0"}, TypeError, "host_maddrs"),
        ({"transport": ""}, TypeError, "transport"),
        ({"host": 127}, TypeError, "host"),
    ],
)
async def test_bad_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        DHT(**kwargs)


async def test_identity_and_identity_path_together_are_refused(tmp_path: Path) -> None:
    key = tmp_path / "k.key"
    with pytest.raises(ValueError, match="identity_path") as info:
        DHT(identity=Identity.generate(), identity_path=key)
    assert "identity " in str(info.value)
    assert not key.exists()  # refused before anything was written


async def test_identity_path_keeps_the_peer_id(tmp_path: Path) -> None:
    key = tmp_path / "k.key"
    network = MemoryNetwork()
    async with DHT(identity_path=key, **_memory(network)) as first:
        peer_id = first.peer_id
    assert key.exists()
    async with DHT(identity=str(key), **_memory(network)) as second:
        assert second.peer_id == peer_id
    async with DHT(**_memory(network)) as fresh:
        assert fresh.peer_id != peer_id


async def test_aclose_from_another_task_while_the_block_goes_on() -> None:
    network = MemoryNetwork()
    async with _swarm(3, network) as dhts:
        seeds = dhts[0].get_visible_maddrs()
        reached_end_of_block = False
        with anyio.fail_after(STEP):
            async with DHT(seeds, **_memory(network)) as dht:
                address = dht.node.addresses[0]
                woke: list[str] = []

                async def waiter() -> None:
                    await dht.wait_closed()
                    woke.append("waiter")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await anyio.lowlevel.checkpoint()
                    assert woke == []
                    tg.start_soon(dht.aclose)  # another task closes it
                assert woke == ["waiter"]
                await dht.wait_closed()
                await dht.aclose()  # idempotent
                assert not await _can_dial(address, network)
                reached_end_of_block = True
            await dht.aclose()  # and after the block too
        assert reached_end_of_block
        # the rest of the swarm is unaffected
        with anyio.fail_after(STEP):
            assert await dhts[1].store("after", 1, get_dht_time() + 30)
            assert (await dhts[2].get("after")).value == 1  # type: ignore[union-attr]


async def test_wait_closed_returns_when_the_block_ends() -> None:
    network = MemoryNetwork()
    async with DHT(**_memory(network)) as dht:
        pass
    with anyio.fail_after(1):
        await dht.wait_closed()


async def test_a_dht_starts_once() -> None:
    network = MemoryNetwork()
    dht = DHT(**_memory(network))
    async with dht:
        pass
    with pytest.raises(RuntimeError, match="once"):
        async with dht:
            pass


async def test_bootstrap_from_unreachable_peers_names_them() -> None:
    network = MemoryNetwork()
    ghosts = [
        Address("memory", "nowhere", 9, Identity.generate().peer_id),
        Address("memory", "gone", 7, Identity.generate().peer_id),
    ]
    dht = DHT([str(g) for g in ghosts], request_timeout=1, **_memory(network))
    with anyio.fail_after(STEP), pytest.raises(ConnectError) as info:
        async with dht:
            pytest.fail("the block ran without a bootstrap")
    for ghost in ghosts:
        assert str(ghost) in str(info.value)
    # the node it made for itself was closed again
    assert not await _can_dial(dht.node.addresses[0], network)


async def test_one_unreachable_initial_peer_among_live_ones_is_skipped() -> None:
    network = MemoryNetwork()
    async with DHT(**_memory(network)) as live:
        ghost = Address("memory", "nowhere", 9, Identity.generate().peer_id)
        seeds = [ghost.to_multiaddr(), *live.get_visible_maddrs()]
        with anyio.fail_after(STEP):
            async with DHT(seeds, request_timeout=1, **_memory(network)) as dht:
                assert live.peer_id in dht.dht_node.protocol.routing


@pytest.mark.realtime
async def test_wildcard_host_over_tcp_shows_dialable_addresses() -> None:
    with anyio.fail_after(STEP):
        async with DHT(host="0.0.0.0") as first:
            (listening,) = first.node.addresses
            assert listening.host == "0.0.0.0"
            maddrs = first.get_visible_maddrs()
            assert maddrs == first.get_visible_maddrs(latest=True)
            assert f"/ip4/127.0.0.1/tcp/{listening.port}/p2p/{first.peer_id}" in maddrs
            for maddr in maddrs:
                assert "0.0.0.0" not in maddr
                address = Address.parse(maddr)
                assert (address.scheme, address.port) == ("tcp", listening.port)
                assert address.peer_id == first.peer_id
            async with DHT(maddrs) as second:
                assert first.peer_id in second.dht_node.protocol.routing
                assert await second.store("over tcp", 1.5, get_dht_time() + 30)
                assert (await first.get("over tcp")).value == 1.5  # type: ignore[union-attr]


@pytest.mark.realtime  # (TCP through a relay on loopback)
async def test_announce_maddrs_is_what_others_dial_a_port_forward() -> None:
    """A peer behind a port forward (here: a TCP relay on 127.0.0.2 to the peer's port on
    127.0.0.1) announces the forward's address with ``announce_maddrs``: its visible maddrs
    and its DHT records name it, and a peer bootstrapping from them reaches it through the
    forward (the TCP handshake proves the PeerID end to end)."""
    target: list[int] = []
    relayed = 0

    async def pipe(source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
        with contextlib.suppress(
            anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
        ):
            async for chunk in source:
                await sink.send(chunk)
        with contextlib.suppress(Exception):
            await sink.aclose()

    async def relay(client: anyio.abc.SocketStream) -> None:
        nonlocal relayed
        relayed += 1
        server = await anyio.connect_tcp("127.0.0.1", target[0])
        async with client, server, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, server)
            tg.start_soon(pipe, server, client)

    with anyio.fail_after(STEP):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.2", local_port=0)
        forward_port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as relays:
            relays.start_soon(listener.serve, relay)
            forwarded = f"/ip4/127.0.0.2/tcp/{forward_port}"
            async with DHT(announce_maddrs=[forwarded]) as hidden:
                target.append(hidden.node.addresses[0].port)
                maddrs = hidden.get_visible_maddrs()
                assert maddrs == [f"{forwarded}/p2p/{hidden.peer_id}"]
                assert hidden.dht_node.announced_addresses() == [Address.parse(maddrs[0])]
                own = hidden.dht_node.protocol.own_info()
                assert own is not None
                assert [Address.parse(a) for a in own.addresses] == [Address.parse(maddrs[0])]
                async with DHT(maddrs) as outside:
                    assert hidden.peer_id in outside.dht_node.protocol.routing
                    assert await outside.store("via the forward", 7, get_dht_time() + 30)
                    assert (await hidden.get("via the forward")).value == 7  # type: ignore[union-attr]
            relays.cancel_scope.cancel()
    assert relayed >= 1


async def test_announce_maddrs_are_checked() -> None:
    with pytest.raises(TypeError, match="announce_maddrs"):
        DHT(announce_maddrs="/ip4/127.0.0.1/tcp/1")
    other = Identity.generate().peer_id
    with pytest.raises(ValueError, match="announce_maddrs"):
        DHT(announce_maddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{other}"])
    with pytest.raises(ValueError):
        DHT(announce_maddrs=["not an address"])
