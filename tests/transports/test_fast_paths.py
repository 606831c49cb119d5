"""The transports' optional fast paths. ``Stream.receive_nowait``: a message that has arrived is
handed out without waiting (the RPC layer reads a call's opening so; the contract itself, order
and WouldBlock otherwise, is the conformance check ``receive_nowait``). TCP's
``Connection.serve_inline`` and ``Stream.send_last_nowait``: a stream opened with one whole
message and its EOF is offered to a handler from the reader, which can answer it at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import numpy as np
import pytest

from swarmavg.abc import Connection, Stream, Transport
from swarmavg.identity import Identity
from swarmavg.testing import MemoryNetwork, MemoryTransport
from swarmavg_tcp import TcpTransport

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


@asynccontextmanager
async def _tcp_pair() -> AsyncIterator[tuple[Connection, Connection]]:
    """A TCP connection on loopback: the dialed end and the accepted end (closed after)."""
    async with (
        TcpTransport(Identity.generate()) as server,
        TcpTransport(Identity.generate()) as client,
    ):
        listener = await server.listen("tcp://127.0.0.1:0")
        conn = await client.connect(listener.address)
        accepted = await listener.accept()
        try:
            yield conn, accepted
        finally:
            await conn.aclose()
            await accepted.aclose()


@pytest.mark.allow_error_log  # (an inline handler that raises is a bug: logged at ERROR)
async def test_tcp_offers_whole_openings_to_the_inline_handler() -> None:
    offered: list[tuple[bytes, bool]] = []

    def handler(stream: Stream, message: memoryview) -> bool:
        data = bytes(message)
        if data.startswith(b"boom"):
            raise RuntimeError("a buggy handler")
        take = data.startswith(b"take")
        offered.append((data, asyncio.current_task() is None))
        if take:
            assert stream.send_last_nowait(b"answer to ", data)
        return take

    with anyio.fail_after(10):
        async with _tcp_pair() as (conn, accepted):
            assert accepted.serve_inline(handler) is True
            # taken: answered from the reader, never accepted
            stream = await conn.open_stream()
            await stream.send_last(b"take me")
            assert bytes(await stream.receive()) == b"answer to take me"
            with pytest.raises(anyio.EndOfStream):
                await stream.receive()
            assert stream.id not in accepted._streams  # type: ignore[attr-defined]  # no leak
            # left alone: accepted as usual, with the message unread
            for data in (b"leave me", b"boom"):
                stream = await conn.open_stream()
                await stream.send_last(data)
                peer = await accepted.accept_stream()
                assert bytes(await peer.receive()) == data
                with pytest.raises(anyio.EndOfStream):
                    await peer.receive()
                await peer.send_last(b"ok")
                assert bytes(await stream.receive()) == b"ok"
            # a stream whose opening comes without the EOF is not offered
            stream = await conn.open_stream()
            await stream.send(b"take me too")
            peer = await accepted.accept_stream()
            assert bytes(await peer.receive()) == b"take me too"
            assert offered == [(b"take me", True), (b"leave me", True)]
            await peer.aclose()
            await stream.aclose()
            accepted.serve_inline(None)
            stream = await conn.open_stream()
            await stream.send_last(b"take me")
            peer = await accepted.accept_stream()  # no handler: accepted
            assert bytes(await peer.receive()) == b"take me"


def test_receive_buffers_come_in_tight_size_classes_and_are_reused() -> None:
    """A message's buffer is at most ~6% larger than the message (a 2 MiB part with its header
    took a 4 MiB block before), and a freed buffer serves the next message of its class."""
    import gc

    from swarmavg_tcp._buffers import BufferPool, block_size_for

    for size in (65_536, 65_537, 1 << 20, (1 << 20) + 48, (2 << 20) + 48, 3 << 20, 16 << 20):
        block = block_size_for(size)
        assert size <= block <= size * 1.0625 + 4096
        assert block % 4096 == 0
    pool = BufferPool(max_cached=8 << 20)
    first = pool.get((2 << 20) + 48)
    address = np.frombuffer(first, dtype=np.uint8).ctypes.data
    del first
    gc.collect()
    assert pool.cached_bytes == block_size_for((2 << 20) + 48)
    second = pool.get((2 << 20) + 100)  # same class: the same block again
    assert np.frombuffer(second, dtype=np.uint8).ctypes.data == address
    assert pool.cached_bytes == 0


async def test_a_burst_of_calls_is_answered_inline_only_up_to_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past a few inline answers per wake-up of the reader, new streams go to accept_stream
    (a flood of calls cannot hold the event loop in one callback)."""
    import swarmavg_tcp._connection as tcp_connection

    monkeypatch.setattr(tcp_connection, "_INLINE_PER_READ", 2)
    taken: list[bytes] = []

    def handler(stream: Stream, message: memoryview) -> bool:
        taken.append(bytes(message))
        assert stream.send_last_nowait(b"inline")
        return True

    with anyio.fail_after(10):
        async with _tcp_pair() as (conn, accepted):
            accepted.serve_inline(handler)
            streams = [await conn.open_stream() for _ in range(6)]
            for i, stream in enumerate(streams):  # back to back: one wake-up of the reader
                await stream.send_last(b"call %d" % i)
            answers = []
            for _ in range(4):
                peer = await accepted.accept_stream()
                await peer.receive()
                await peer.send_last(b"queued")
            for stream in streams:
                answers.append(bytes(await stream.receive()))
            assert taken == [b"call 0", b"call 1"]
            assert answers == [b"inline"] * 2 + [b"queued"] * 4


async def test_a_memory_link_with_latency_leaves_on_readable_to_receive() -> None:
    """``on_readable`` calls back when a message is in the inbox; over a link with latency a
    message is there before it may be read, and no event comes when it may: such a stream
    says it cannot call back (its readers wait in receive(), which has a timer for that)."""
    network = MemoryNetwork()
    with anyio.fail_after(10):
        async with (
            MemoryTransport(Identity.generate(), network=network, latency=0.05) as server,
            MemoryTransport(Identity.generate(), network=network, latency=0.05) as client,
        ):
            listener = await server.listen("memory://local:0")
            conn = await client.connect(listener.address)
            accepted = await listener.accept()
            stream = await conn.open_stream()
            await stream.send(b"hello")
            peer = await accepted.accept_stream()
            assert not peer.on_readable(lambda: None)
            assert not stream.on_readable(lambda: None)
            assert bytes(await peer.receive()) == b"hello"
            await conn.aclose()
            await accepted.aclose()
