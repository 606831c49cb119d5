"""The transport conformance suite: what every :class:`~swarmavg.abc.Transport` must do.

Run all checks with :func:`check_transport`, or one at a time (for one test per check) with
:func:`run_transport_check` and the names in :data:`TRANSPORT_CHECKS`::

    @pytest.mark.parametrize("check", TRANSPORT_CHECKS)
    async def test_conformance(check):
        await run_transport_check(check, lambda ident: MyTransport(ident), "my://127.0.0.1:0")

A failing check raises ``AssertionError`` naming the rule that was broken.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio

from swarmavg.abc import Connection, ConnectionAttribute, Listener, Stream, Transport
from swarmavg.address import Address
from swarmavg.errors import (
    ConnectError,
    ConnectionLost,
    MessageTooLarge,
    PeerIdentityMismatch,
    StreamReset,
)
from swarmavg.identity import Identity

__all__ = ["TRANSPORT_CHECKS", "TransportFactory", "check_transport", "run_transport_check"]

#: Makes a transport bound to the given identity.
TransportFactory = Callable[[Identity], Transport]

_TIMEOUT = 30.0
#: A cancelled operation must return within this many seconds of its cancellation (it should
#: take milliseconds; the bound is generous for loaded test machines, and far below the
#: write timeouts, a minute, that a shielded send would wait for).
_PROMPT = 5.0


@dataclass
class _Harness:
    factory: TransportFactory
    listen_address: Address
    stack: AsyncExitStack

    async def transport(self) -> Transport:
        transport = self.factory(Identity.generate())
        return await self.stack.enter_async_context(transport)

    async def listener(self) -> tuple[Transport, Listener]:
        transport = await self.transport()
        listener = await transport.listen(self.listen_address)
        self.stack.push_async_callback(listener.aclose)
        return transport, listener

    async def pair(self) -> tuple[Connection, Connection]:
        """A connection dialed by one fresh transport and accepted by another."""
        _, listener = await self.listener()
        dialer = await self.transport()
        dialed = await dialer.connect(listener.address)
        accepted = await listener.accept()
        self.stack.push_async_callback(dialed.aclose)
        self.stack.push_async_callback(accepted.aclose)
        return dialed, accepted


async def _open_pair(a: Connection, b: Connection, hello: bytes = b"open") -> tuple[Stream, Stream]:
    """Open a stream from ``a`` and accept it on ``b`` (a transport may show a stream only
    once data arrives, so the opener sends ``hello`` first)."""
    sa = await a.open_stream()
    await sa.send(hello)
    sb = await b.accept_stream()
    assert bytes(await sb.receive()) == hello, "first message of a new stream was altered"
    return sa, sb


async def _expect_end(stream: Stream, why: str) -> None:
    """``stream.receive()`` must raise ``EndOfStream``; ``why`` says which rule if not."""
    try:
        await stream.receive()
    except anyio.EndOfStream:
        return
    raise AssertionError(why)


def _pattern(n: int) -> bytes:
    """``n`` bytes of a random 64 KiB block repeated (cheap, yet misplaced data shows)."""
    block = os.urandom(min(n, 1 << 16))
    return (block * (n // max(len(block), 1) + 1))[:n]


async def _check_handshake_and_attributes(h: _Harness) -> None:
    transport_b, listener = await h.listener()
    addr = listener.address
    assert addr.peer_id == transport_b.identity.peer_id, "listener address must name our PeerID"
    assert addr.scheme == h.listen_address.scheme
    if h.listen_address.port == 0:
        assert addr.port != 0, "listener address must carry the port actually bound"
    dialer = await h.transport()
    a = await dialer.connect(Address.parse(str(addr)))  # the printed address dials as is
    b = await listener.accept()
    h.stack.push_async_callback(a.aclose)
    h.stack.push_async_callback(b.aclose)
    assert a.peer_id == transport_b.identity.peer_id
    assert b.peer_id == dialer.identity.peer_id
    assert a.extra(ConnectionAttribute.is_initiator) is True
    assert b.extra(ConnectionAttribute.is_initiator) is False
    assert a.extra(ConnectionAttribute.transport_name) == dialer.name
    assert isinstance(a.extra(ConnectionAttribute.remote_address), Address)
    assert isinstance(b.extra(ConnectionAttribute.remote_address), Address)
    assert isinstance(a.extra(ConnectionAttribute.encrypted), bool)
    assert not a.is_closed
    assert not b.is_closed


async def _check_stream_both_ways(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    messages = [b"", b"x", b"hello" * 1000, _pattern(200_000)]
    for msg in messages:
        await sa.send(msg)
    for msg in messages:
        got = await sb.receive()
        assert isinstance(got, memoryview), "receive() must return a memoryview"
        assert bytes(got) == msg, "message boundaries or content were not preserved"
    await sb.send(b"re", bytearray(b"p"), memoryview(b"ly"))
    assert bytes(await sa.receive()) == b"reply", "a multi-part send is one message"
    # a stream opened by the accepting side works the same way
    tb, ta = await _open_pair(b, a, b"from b")
    await ta.send(b"pong")
    assert bytes(await tb.receive()) == b"pong"


async def _check_buffer_reuse(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    buf = bytearray(b"A" * 1000)
    await sa.send(buf)
    buf[:] = b"B" * 1000  # the caller may reuse its buffer once send() returned
    await sa.send(buf)
    first, second = await sb.receive(), await sb.receive()
    assert bytes(first) == b"A" * 1000, "send() must not keep a reference to the caller's buffer"
    assert bytes(second) == b"B" * 1000


async def _check_many_concurrent_streams(h: _Harness) -> None:
    a, b = await h.pair()
    n_streams, n_messages = 64, 8

    async def echo_server() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(n_streams):
                stream = await b.accept_stream()
                tg.start_soon(echo, stream)

    async def echo(stream: Stream) -> None:
        async for msg in stream:
            await stream.send(msg)
        await stream.aclose()

    async def client(i: int) -> None:
        stream = await a.open_stream()
        for j in range(n_messages):
            payload = f"{i}:{j}:".encode() * (1 + (i * j) % 50)
            await stream.send(payload)
            assert bytes(await stream.receive()) == payload, "stream data got mixed up"
        await stream.send_eof()
        try:
            extra = await stream.receive()
        except anyio.EndOfStream:
            pass
        else:
            raise AssertionError(f"unexpected message after EOF: {bytes(extra)[:40]!r}")
        await stream.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(echo_server)
        for i in range(n_streams):
            tg.start_soon(client, i)


async def _check_large_message(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    limit = sa.max_message_size
    assert limit >= 1 << 20, "a transport must carry messages of at least 1 MiB"
    size = min(limit, 32 << 20)
    payload = _pattern(size)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sa.send, payload)
        got = await sb.receive()
    assert len(got) == size and bytes(got) == payload, "large message corrupted"
    chunk = bytes(1 << 20)
    parts = [chunk] * (limit // len(chunk) + 1)
    try:
        await sa.send(*parts)
    except MessageTooLarge:
        pass
    else:
        raise AssertionError("sending more than max_message_size must raise MessageTooLarge")
    await sa.send(b"still usable")
    assert bytes(await sb.receive()) == b"still usable", "an oversized send must not break a stream"


async def _check_backpressure(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    chunk = bytes(256 * 1024)
    sent = 0
    blocked = False
    cap = 512 << 20
    while sent < cap:
        with anyio.move_on_after(0.5) as scope:
            await sa.send(chunk)
        if scope.cancelled_caught:
            blocked = True
            break
        sent += len(chunk)
    assert blocked, f"send() never blocked although the receiver read nothing ({sent} bytes)"
    # a blocked bulk stream must not starve another stream of the same connection
    with anyio.fail_after(10):
        ta, tb = await _open_pair(a, b, b"small rpc")
        await tb.send(b"answer")
        assert bytes(await ta.receive()) == b"answer"
    # once the receiver reads, the sender proceeds, and nothing was lost or duplicated
    marker = b"end-of-bulk"

    async def writer() -> None:
        await sa.send(marker)

    received = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer)
        while True:
            msg = await sb.receive()
            if bytes(msg) == marker:
                break
            received += len(msg)
    # The message cancelled by move_on_after may or may not have been sent (cancellation of a
    # send is allowed to be atomic either way), but never partly.
    assert received in (sent, sent + len(chunk)), f"sent {sent} bytes, received {received}"


async def _check_cancelled_send(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    # messages larger than most windows and send buffers, to a receiver that reads nothing:
    # some go (a receiver takes at least one), then one send blocks, possibly in the middle of
    # its message (once part of it was written)
    size = min(sa.max_message_size, 8 << 20)
    sent: list[bytes] = []
    cancelled = b""
    late = -1.0
    for _ in range(64):
        payload = _pattern(size)
        with anyio.move_on_after(0.5) as scope:
            await sa.send(payload)
        if scope.cancelled_caught:
            cancelled = payload
            late = anyio.current_time() - scope.deadline
            break
        sent.append(payload)
    assert late >= 0, f"send() never blocked although the receiver read nothing ({len(sent)} sent)"
    assert late < _PROMPT, f"a cancelled send() returned {late:.1f} s after its cancellation"
    # The stream carries no part of the cancelled message: either none of it was sent (the
    # stream goes on) or the stream was reset (the peer's and our operations raise StreamReset).
    ours: list[BaseException | None] = []

    async def finish() -> None:
        try:
            await sa.send_last(b"after")
        except StreamReset as exc:
            ours.append(exc)
        else:
            ours.append(None)

    got: list[bytes] = []
    end: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(finish)
        while end is None:
            try:
                got.append(bytes(await sb.receive()))
            except (StreamReset, anyio.EndOfStream) as exc:
                end = exc
    if isinstance(end, StreamReset):
        assert isinstance(ours[0], StreamReset), (
            "the peer saw the stream reset after a cancelled send: our later sends must raise "
            f"StreamReset, got {ours[0]!r}"
        )
        whole = [*sent, cancelled]
        assert got == whole[: len(got)], (
            "a reset stream delivered something other than whole messages in order"
        )
    else:
        assert ours[0] is None, f"the stream was not reset, yet send_last() raised {ours[0]!r}"
        assert got in ([*sent, b"after"], [*sent, cancelled, b"after"]), (
            "a cancelled send() left part of its message on the stream (or lost others): "
            f"{[len(m) for m in got]} bytes received after {[len(m) for m in sent]} sent"
        )
    # the connection survives
    ta, tb = await _open_pair(a, b)
    await tb.send(b"ok")
    assert bytes(await ta.receive()) == b"ok", "a cancelled send must not break the connection"


async def _check_send_eof(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    for i in range(3):
        await sa.send(b"%d" % i)
    await sa.send_eof()
    await sa.send_eof()  # idempotent
    for i in range(3):
        assert bytes(await sb.receive()) == b"%d" % i
    for _ in range(2):
        await _expect_end(sb, "receive() after the peer's EOF must raise EndOfStream")
    await sb.send(b"half-open")
    assert bytes(await sa.receive()) == b"half-open", "the other direction must stay open"
    try:
        await sa.send(b"after eof")
    except anyio.ClosedResourceError:
        pass
    else:
        raise AssertionError("send() after send_eof() must raise ClosedResourceError")


async def _check_send_last(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    await sa.send(b"first")
    await sa.send_last(b"last")
    assert bytes(await sb.receive()) == b"first"
    assert bytes(await sb.receive()) == b"last"
    await _expect_end(sb, "send_last() must end the stream after its message")
    await sb.send(b"half-open")
    assert bytes(await sa.receive()) == b"half-open", "the other direction must stay open"
    try:
        await sa.send(b"after send_last")
    except anyio.ClosedResourceError:
        pass
    else:
        raise AssertionError("send() after send_last() must raise ClosedResourceError")
    # a large message (several records on record-based transports) ends the stream too
    big = _pattern(3 << 20)
    sa2 = await a.open_stream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sa2.send_last, big)
        sb2 = await b.accept_stream()
        assert bytes(await sb2.receive()) == big
    await _expect_end(sb2, "send_last() of a large message must end the stream after it")
    for stream in (sa, sb, sa2, sb2):
        await stream.aclose()


def _would_block(stream: Stream, when: str, *ends: type[BaseException]) -> None:
    """``receive_nowait()`` has nothing to hand out: ``WouldBlock``, or one of ``ends`` (what
    receive() raises there; a transport with ``on_readable`` must raise it)."""
    readable = _has_on_readable(stream)
    try:
        got = stream.receive_nowait()
    except anyio.WouldBlock:
        if readable and ends:
            raise AssertionError(
                f"receive_nowait() {when} must raise {ends[0].__name__} on a transport with "
                "on_readable(), not WouldBlock"
            ) from None
        return
    except ends:
        return
    allowed = " or ".join(["WouldBlock", *(e.__name__ for e in ends)])
    raise AssertionError(f"receive_nowait() {when} must raise {allowed}, not return {got!r}")


def _has_on_readable(stream: Stream) -> bool:
    return type(stream).on_readable is not Stream.on_readable


async def _check_receive_nowait(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    _would_block(sb, "with nothing to read")
    messages = [b"one", b"", b"three" * 1000]
    for msg in messages:
        await sa.send(msg)
    await sa.send_eof()
    # it hands out the messages that are here, in order; receive() goes on after them
    got: list[bytes] = []
    while len(got) < len(messages):
        try:
            got.append(bytes(sb.receive_nowait()))
        except anyio.WouldBlock:
            got.append(bytes(await sb.receive()))
    assert got == messages, "receive_nowait() and receive() must keep the messages in order"
    _would_block(sb, "at the end of the stream", anyio.EndOfStream)
    await _expect_end(sb, "receive() after the peer's EOF must raise EndOfStream")
    # after a reset or a close: WouldBlock or what receive() raises, never anything else
    tb, ta = await _open_pair(b, a)
    await tb.send(b"unread")
    await tb.abort()
    with anyio.fail_after(5):
        while True:  # until the reset arrives
            try:
                await ta.receive()
            except StreamReset:
                break
    _would_block(ta, "on a stream the peer reset", StreamReset)
    await sb.aclose()
    _would_block(sb, "on a closed stream", anyio.ClosedResourceError)


async def _check_on_readable(h: _Harness) -> None:
    """A transport that implements ``on_readable`` calls back once per registration, when a
    message, the end or a reset is there for ``receive_nowait``, or at once if it already is."""
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    calls: list[str] = []
    woken = anyio.Event()

    def callback(tag: str) -> Callable[[], None]:
        def called() -> None:
            calls.append(tag)
            woken.set()

        return called

    if not sb.on_readable(callback("first")):
        await sa.aclose()
        await sb.aclose()
        return  # optional: this transport cannot (its users wait in receive())

    async def wait_call() -> None:
        nonlocal woken
        with anyio.fail_after(5):
            await woken.wait()
        woken = anyio.Event()

    async def next_message(stream: Stream) -> bytes:
        # a callback may come early (nothing new for the reader): then register again
        while True:
            try:
                return bytes(stream.receive_nowait())
            except anyio.WouldBlock:
                assert stream.on_readable(callback("again"))
                await wait_call()

    await anyio.sleep(0.05)
    assert not calls, "on_readable() must not call back before anything arrives"
    await sa.send(b"hello")
    await wait_call()
    assert calls[0] == "first"
    assert await next_message(sb) == b"hello"
    await sa.send(b"queued")
    with anyio.fail_after(5):
        while True:  # until it is here, without reading it
            if sb.on_readable(callback("ready")) and "ready" in calls:
                break
            await anyio.sleep(0.01)
    assert await next_message(sb) == b"queued"

    # the end: called back, and receive_nowait raises EndOfStream
    async def until_raises(stream: Stream, end: type[BaseException], after: str) -> None:
        with anyio.fail_after(5):
            while True:
                try:
                    stream.receive_nowait()
                except end:
                    return
                except anyio.WouldBlock:
                    assert stream.on_readable(callback("again"))
                    await wait_call()
                else:
                    raise AssertionError(f"receive_nowait() {after} must not hand out a message")

    calls.clear()
    assert sb.on_readable(callback("eof"))
    await sa.send_eof()
    await until_raises(sb, anyio.EndOfStream, "after EOF")
    assert calls, "on_readable() must call back when the peer ends the stream"
    # a reset by the peer
    tb, ta = await _open_pair(b, a)
    calls.clear()
    assert ta.on_readable(callback("reset"))
    await tb.abort()
    await until_raises(ta, StreamReset, "after a reset")
    assert calls, "on_readable() must call back when the peer resets the stream"
    # our own close wakes a registered reader too
    calls.clear()
    assert sa.on_readable(callback("closed"))
    await sa.aclose()
    assert calls == ["closed"], "on_readable() must call back when we close the stream"
    await sb.aclose()


async def _check_concurrent_accept(h: _Harness) -> None:
    """Several tasks may wait in accept_stream at once: each stream goes to exactly one."""
    a, b = await h.pair()
    got: list[bytes] = []

    async def acceptor() -> None:
        stream = await b.accept_stream()
        got.append(bytes(await stream.receive()))
        await stream.aclose()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(acceptor)
            await anyio.sleep(0.01)  # all four wait
            opened = []
            for i in range(4):
                stream = await a.open_stream()
                await stream.send(b"%d" % i)
                opened.append(stream)
        for stream in opened:
            await stream.aclose()
    assert sorted(got) == [b"0", b"1", b"2", b"3"], got


async def _check_on_abandoned(h: _Harness) -> None:
    a, b = await h.pair()
    for how in ("abort", "aclose", "connection"):
        sa, sb = await _open_pair(a, b)
        called = anyio.Event()
        if not sb.on_abandoned(called.set):
            return  # allowed: this transport cannot tell (then it must never call back)
        assert not called.is_set(), "on_abandoned called back before anything happened"
        if how == "abort":
            await sa.abort()
        elif how == "aclose":
            await sa.aclose()  # before reading what sb might still send
            await sb.send(b"unwanted")  # a transport may wait for this to tell sb
        else:
            await a.aclose()
        with anyio.fail_after(10):
            await called.wait()
        late = anyio.Event()
        assert sb.on_abandoned(late.set)
        assert late.is_set(), "on_abandoned of an abandoned stream must call back at once"
        await sb.aclose()


async def _check_aclose(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    await sa.send(b"last words")
    await sa.aclose()
    await sa.aclose()  # idempotent
    assert bytes(await sb.receive()) == b"last words", "data sent before aclose() was lost"
    await _expect_end(sb, "receive() after the peer closed must raise EndOfStream")
    for op in (sa.send(b"x"), sa.receive()):
        try:
            await op
        except anyio.ClosedResourceError:
            pass
        else:
            raise AssertionError("using a stream after aclose() must raise ClosedResourceError")


async def _check_abort(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    result: list[BaseException] = []

    async def reader() -> None:
        try:
            await sb.receive()
        except BaseException as exc:
            result.append(exc)
            if not isinstance(exc, Exception):
                raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await sa.abort()
    assert result and isinstance(result[0], StreamReset), (
        f"a pending receive() must raise StreamReset when the peer aborts, got {result!r}"
    )
    try:
        await sb.send(b"x")
    except StreamReset:
        pass
    else:
        raise AssertionError("send() on a stream the peer reset must raise StreamReset")
    # the connection survives a stream reset
    ta, tb = await _open_pair(a, b)
    await tb.send(b"ok")
    assert bytes(await ta.receive()) == b"ok", "a stream reset must not break the connection"


async def _check_cancelled_receive(h: _Harness) -> None:
    a, b = await h.pair()
    sa, sb = await _open_pair(a, b)
    with anyio.move_on_after(0.05):
        await sb.receive()
    payload = _pattern(300_000)
    await sa.send(payload)
    await sa.send(b"next")
    assert bytes(await sb.receive()) == payload, "a cancelled receive() must not lose data"
    assert bytes(await sb.receive()) == b"next"


async def _check_connection_close(h: _Harness) -> None:
    a, b = await h.pair()
    _sa, sb = await _open_pair(a, b)
    outcome: list[BaseException] = []

    async def reader() -> None:
        try:
            await sb.receive()
        except (ConnectionLost, anyio.EndOfStream) as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await a.aclose()
    assert outcome, "a receive() pending when the peer closed the connection must end"
    await a.aclose()  # idempotent
    with anyio.fail_after(10):
        await b.wait_closed()
    assert a.is_closed
    assert b.is_closed
    for conn in (a, b):
        try:
            await conn.open_stream()
        except ConnectionLost:
            pass
        else:
            raise AssertionError("open_stream() on a closed connection must raise ConnectionLost")
        try:
            await conn.accept_stream()
        except ConnectionLost:
            pass
        else:
            raise AssertionError("accept_stream() on a closed connection must raise ConnectionLost")


async def _check_identity(h: _Harness) -> None:
    transport_b, listener = await h.listener()
    dialer = await h.transport()
    impostor = Identity.generate().peer_id
    try:
        await dialer.connect(listener.address.with_peer_id(impostor))
    except PeerIdentityMismatch as exc:
        assert exc.expected == impostor
        assert exc.actual == transport_b.identity.peer_id
    else:
        raise AssertionError("dialing a PeerID that another key answers must fail")
    anonymous = listener.address.with_peer_id(None)
    try:
        await dialer.connect(anonymous)
    except ValueError:
        pass
    else:
        raise AssertionError("dialing without a PeerID must need allow_unknown_peer=True")
    conn = await dialer.connect(anonymous, allow_unknown_peer=True)
    h.stack.push_async_callback(conn.aclose)
    assert conn.peer_id == transport_b.identity.peer_id
    wrong_scheme = Address("zz" + listener.address.scheme, "127.0.0.1", 1, impostor)
    try:
        await dialer.connect(wrong_scheme)
    except ValueError:
        pass
    else:
        raise AssertionError("dialing another transport's scheme must raise ValueError")


async def _check_refused_and_listener_close(h: _Harness) -> None:
    _, listener = await h.listener()
    dialer = await h.transport()
    conn = await dialer.connect(listener.address)
    accepted = await listener.accept()
    h.stack.push_async_callback(conn.aclose)
    h.stack.push_async_callback(accepted.aclose)
    address = listener.address
    await listener.aclose()
    await listener.aclose()  # idempotent
    try:
        await listener.accept()
    except anyio.ClosedResourceError:
        pass
    else:
        raise AssertionError("accept() after aclose() must raise ClosedResourceError")
    sa, sb = await _open_pair(conn, accepted)  # existing connections stay open
    await sb.send(b"alive")
    assert bytes(await sa.receive()) == b"alive"
    try:
        with anyio.fail_after(10):
            await dialer.connect(address)
    except ConnectError:
        pass
    else:
        raise AssertionError("dialing an address nobody listens on must raise ConnectError")


async def _check_transport_aclose(h: _Harness) -> None:
    transport_b, listener = await h.listener()
    dialer = await h.transport()
    conn = await dialer.connect(listener.address)
    accepted = await listener.accept()
    await dialer.aclose()
    await dialer.aclose()  # idempotent
    assert conn.is_closed, "closing a transport must close its connections"
    with anyio.fail_after(10):
        await accepted.wait_closed()
    await transport_b.aclose()
    try:
        await listener.accept()
    except anyio.ClosedResourceError:
        pass
    else:
        raise AssertionError("closing a transport must close its listeners")


#: Every check, by name, in a sensible order.
TRANSPORT_CHECKS: dict[str, Callable[[_Harness], Awaitable[None]]] = {
    "handshake_and_attributes": _check_handshake_and_attributes,
    "stream_both_ways": _check_stream_both_ways,
    "buffer_reuse": _check_buffer_reuse,
    "many_concurrent_streams": _check_many_concurrent_streams,
    "large_message": _check_large_message,
    "backpressure": _check_backpressure,
    "cancelled_send": _check_cancelled_send,
    "send_eof": _check_send_eof,
    "send_last": _check_send_last,
    "receive_nowait": _check_receive_nowait,
    "on_readable": _check_on_readable,
    "on_abandoned": _check_on_abandoned,
    "concurrent_accept": _check_concurrent_accept,
    "aclose": _check_aclose,
    "abort": _check_abort,
    "cancelled_receive": _check_cancelled_receive,
    "connection_close": _check_connection_close,
    "identity": _check_identity,
    "refused_and_listener_close": _check_refused_and_listener_close,
    "transport_aclose": _check_transport_aclose,
}


@asynccontextmanager
async def _harness(
    factory: TransportFactory, listen_address: str | Address
) -> AsyncIterator[_Harness]:
    async with AsyncExitStack() as stack:
        yield _Harness(factory, Address.parse(listen_address), stack)


async def run_transport_check(
    name: str, factory: TransportFactory, listen_address: str | Address
) -> None:
    """Run the check called ``name`` against fresh transports made by ``factory``.

    :raises KeyError: if there is no such check.
    :raises AssertionError: if the transport breaks the rule.
    """
    check = TRANSPORT_CHECKS[name]
    with anyio.fail_after(_TIMEOUT):
        async with _harness(factory, listen_address) as h:
            try:
                await check(h)
            except AssertionError as exc:
                raise AssertionError(f"transport check {name!r} failed: {exc}") from exc


async def check_transport(factory: TransportFactory, listen_address: str | Address) -> None:
    """Run the whole conformance suite; raises ``AssertionError`` at the first broken rule."""
    for name in TRANSPORT_CHECKS:
        await run_transport_check(name, factory, listen_address)
