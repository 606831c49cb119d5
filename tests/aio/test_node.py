from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import anyio
import pytest

from swarmavg.abc import ConnectionAttribute, Stream
from swarmavg.aio.node import Node
from swarmavg.errors import ConnectError, ConnectionLost, PeerIdentityMismatch, StreamReset
from swarmavg.identity import Identity
from swarmavg.proto import Ping, Pong
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio


def _node(network: MemoryNetwork, **kwargs: object) -> Node:
    return Node(
        listen=["memory://local:0"],
        transports={"memory": {"network": network}},
        **kwargs,  # type: ignore[arg-type]
    )


async def _echo(stream: Stream) -> None:
    async for msg in stream:
        await stream.send(b"echo:", msg)


async def test_two_nodes_exchange_messages() -> None:
    network = MemoryNetwork()
    async with _node(network, stream_handler=_echo) as server, _node(network) as client:
        assert server.addresses[0].peer_id == server.peer_id
        stream = await client.open_stream(server.addresses[0])
        for i in range(5):
            await stream.send(b"%d" % i)
            assert bytes(await stream.receive()) == b"echo:%d" % i
        await stream.aclose()


async def test_connections_are_pooled_per_peer() -> None:
    network = MemoryNetwork()
    async with _node(network, stream_handler=_echo) as server, _node(network) as client:
        address = str(server.addresses[0])
        first = await client.connect(address)
        second = await client.connect(address)
        assert first is second
        async with anyio.create_task_group() as tg:
            results = []

            async def dial() -> None:
                results.append(await client.connect(address))

            for _ in range(10):
                tg.start_soon(dial)
        assert all(conn is first for conn in results)
        await first.aclose()
        third = await client.connect(address)
        assert third is not first
        assert not third.is_closed


async def test_streams_are_served_at_once_and_idle_servers_stay_few() -> None:
    """Streams opened together are each served at once (a slow one holds up no other); when
    they are done, the tasks that served them do not pile up; and streams opened one after
    another start no new task each (the waiting tasks serve them)."""
    network = MemoryNetwork()
    gate = anyio.Event()
    all_inside = anyio.Event()
    inside = 0

    async def handler(stream: Stream) -> None:
        nonlocal inside
        await stream.receive()
        inside += 1
        if inside == 8:
            all_inside.set()
        await gate.wait()
        inside -= 1
        await stream.send(b"done")

    async with _node(network, stream_handler=handler) as server, _node(network) as client:
        address = server.addresses[0]

        async def one() -> None:
            stream = await client.open_stream(address)
            await stream.send(b"x")
            assert bytes(await stream.receive()) == b"done"
            await stream.aclose()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one)
                await all_inside.wait()  # all eight in their handlers together
                gate.set()
            await one()
            await anyio.sleep(0.05)
            settled = len(asyncio.all_tasks())
            created = 0
            factory = asyncio.get_running_loop().get_task_factory()

            def counting(loop: asyncio.AbstractEventLoop, coro: object, **kw: object) -> object:
                nonlocal created
                created += 1
                if factory is None:
                    return asyncio.Task(coro, loop=loop, **kw)  # type: ignore[arg-type]
                return factory(loop, coro, **kw)  # type: ignore[arg-type]

            asyncio.get_running_loop().set_task_factory(counting)  # type: ignore[arg-type]
            try:
                for _ in range(30):
                    await one()
            finally:
                asyncio.get_running_loop().set_task_factory(factory)
            assert created < 5  # (not one or more per stream)
            assert len(asyncio.all_tasks()) <= settled + 1
            assert settled < 20  # the eight servers of the burst did not all stay


@pytest.mark.allow_error_log  # (a RuntimeError of the handler is its bug: logged at ERROR)
async def test_handler_error_resets_only_that_stream(caplog: pytest.LogCaptureFixture) -> None:
    network = MemoryNetwork()

    async def handler(stream: Stream) -> None:
        msg = bytes(await stream.receive())
        if msg == b"boom":
            raise RuntimeError("handler failed")
        await stream.send(b"fine")

    async with _node(network, stream_handler=handler) as server, _node(network) as client:
        bad = await client.open_stream(server.addresses[0])
        await bad.send(b"boom")
        with pytest.raises(StreamReset):
            await bad.receive()
        good = await client.open_stream(server.addresses[0])
        await good.send(b"hi")
        assert bytes(await good.receive()) == b"fine"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "stream handler failed" in errors[0].getMessage()
    assert errors[0].exc_info is not None  # with the traceback


async def test_a_handler_failing_because_of_the_request_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a peer can cause (a ValueError over its request, a stream it reset) is no bug of
    ours: the stream is reset as for any failure, and it is logged at DEBUG only."""
    network = MemoryNetwork()

    async def handler(stream: Stream) -> None:
        raise ValueError(f"no such thing as {bytes(await stream.receive())!r}")

    caplog.set_level(logging.DEBUG, logger="swarmavg.aio.node")
    async with _node(network, stream_handler=handler) as server, _node(network) as client:
        bad = await client.open_stream(server.addresses[0])
        await bad.send(b"nonsense")
        with pytest.raises(StreamReset):
            await bad.receive()
    failed = [r for r in caplog.records if "no such thing" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.DEBUG]


async def test_rpc_layer_aborts_garbage_on_incoming_streams() -> None:
    """Without a custom stream handler, streams go to ``node.rpc``: junk that is no call
    header gets the stream reset, and the node keeps serving."""
    network = MemoryNetwork()
    async with _node(network) as server, _node(network) as client:
        for _ in range(2):
            stream = await client.open_stream(server.addresses[0])
            await stream.send(b"anyone?")
            with pytest.raises(StreamReset):
                await stream.receive()
        server.rpc.register("ping", _pong)
        assert await client.rpc.call(server.addresses[0], "ping", Ping(7)) == Pong(7)


async def _pong(request: Ping, ctx: object) -> Pong:
    return Pong(request.nonce)


async def test_dial_checks_identity_and_requires_peer_id() -> None:
    network = MemoryNetwork()
    async with _node(network) as server, _node(network) as client:
        impostor = server.addresses[0].with_peer_id(Identity.generate().peer_id)
        with pytest.raises(PeerIdentityMismatch):
            await client.connect(impostor)
        with pytest.raises(ValueError, match="allow_unknown_peer"):
            await client.connect(server.addresses[0].with_peer_id(None))
        conn = await client.connect(server.addresses[0].with_peer_id(None), allow_unknown_peer=True)
        assert conn.peer_id == server.peer_id
        with pytest.raises(ValueError, match="itself"):
            await client.connect(client.addresses[0])
        with pytest.raises(ConnectError):
            await client.connect(f"memory://local:65000/p/{Identity.generate().peer_id}")


async def test_identity_from_key_file(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    network = MemoryNetwork()
    async with _node(network, identity=path) as first:
        peer_id = first.peer_id
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    async with _node(network, identity=str(path)) as second:
        assert second.peer_id == peer_id


async def test_close_is_idempotent_and_closes_connections() -> None:
    network = MemoryNetwork()
    async with _node(network, stream_handler=_echo) as server:
        client = _node(network)
        async with client:
            conn = await client.connect(server.addresses[0])
            await client.aclose()
            await client.aclose()
            assert conn.is_closed
        with pytest.raises(RuntimeError, match="not running"):
            await client.connect(server.addresses[0])


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="listen"):
        Node(listen="memory://local:0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="identity"):
        Node(identity=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scheme|port|address"):
        Node(listen=["nonsense"])


async def test_errors_in_the_body_come_out_unwrapped() -> None:
    """A failure inside ``async with Node()`` reaches the caller as itself, not as a group."""
    network = MemoryNetwork()
    with pytest.raises(ConnectError):
        async with _node(network) as client:
            await client.connect(f"memory://local:65000/p/{Identity.generate().peer_id}")
    with pytest.raises(KeyError):
        async with _node(network):
            raise KeyError("mine")


@pytest.mark.realtime
async def test_a_mixed_swarm_over_tcp_and_quic() -> None:
    """A node listening on TCP and QUIC at once serves peers that speak only one of them, and
    calls each back over the connection that peer opened (by PeerID)."""

    async def pong(request: Ping, ctx: object) -> Pong:
        return Pong(request.nonce)

    async with (
        Node(listen=["tcp://127.0.0.1:0", "quic://127.0.0.1:0"]) as hub,
        Node(listen=["quic://127.0.0.1:0"]) as quic_only,
        Node(listen=["tcp://127.0.0.1:0"]) as tcp_only,
    ):
        for node in (hub, quic_only, tcp_only):
            node.rpc.register("ping", pong, request_type=Ping)
        tcp_address, quic_address = hub.addresses
        assert (tcp_address.scheme, quic_address.scheme) == ("tcp", "quic")
        with anyio.fail_after(10):
            assert await quic_only.rpc.call(quic_address, "ping", Ping(1)) == Pong(1)
            assert await tcp_only.rpc.call(tcp_address, "ping", Ping(2)) == Pong(2)
            assert await hub.rpc.call(quic_only.peer_id, "ping", Ping(3)) == Pong(3)
            assert await hub.rpc.call(tcp_only.peer_id, "ping", Ping(4)) == Pong(4)
        kinds = {
            peer: hub.connection_to(peer).extra(ConnectionAttribute.transport_name)  # type: ignore[union-attr]
            for peer in (quic_only.peer_id, tcp_only.peer_id)
        }
        assert kinds == {quic_only.peer_id: "quic", tcp_only.peer_id: "tcp"}


async def test_aclose_inside_the_block_does_not_cancel_the_block() -> None:
    """aclose() from the task that entered the node stops the node, not the caller's code."""
    network = MemoryNetwork()
    reached = False
    async with _node(network, stream_handler=_echo) as server, _node(network) as client:
        stream = await client.open_stream(server.addresses[0])
        await stream.send(b"x")
        assert bytes(await stream.receive()) == b"echo:x"
        await server.aclose()
        await anyio.sleep(0.01)  # a checkpoint: a cancelled block would end here
        reached = True
        with anyio.fail_after(5), pytest.raises((ConnectionLost, StreamReset, anyio.EndOfStream)):
            await stream.receive()  # the server side is gone
    assert reached
