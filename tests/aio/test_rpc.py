"""The RPC layer (``node.rpc``) between real nodes on an in-process MemoryNetwork."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import struct
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from swarmavg.abc import Connection, Stream
from swarmavg.address import Address
from swarmavg.aio.node import Node
from swarmavg.aio.rpc import (
    CallContext,
    CallFailed,
    CallHeader,
    EndOfRequests,
    PendingCall,
    Prepared,
    RPCKind,
    StreamingCall,
)
from swarmavg.errors import (
    ConnectError,
    ConnectionLost,
    MessageTooLarge,
    MethodNotFound,
    RemoteError,
    RemoteProtocolError,
    RPCError,
    RPCTimeout,
    StreamReset,
)
from swarmavg.identity import Identity
from swarmavg.proto import Message, decode_message, encode_message_bytes, message
from swarmavg.testing import MemoryNetwork, MemoryTransport, _memory
from swarmavg_quic import QuicStream
from swarmavg_tcp._connection import TcpStream

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True, params=["watched", "read"])
def abandon_watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: with the transport telling the RPC layer when a caller abandons a
    stream (handlers of unary calls run without a reader task), and without, as a transport
    that cannot tell (every call gets a task reading the caller's side)."""
    if request.param == "read":
        monkeypatch.setattr(_memory._MemoryStream, "on_abandoned", Stream.on_abandoned)
        monkeypatch.setattr(TcpStream, "on_abandoned", Stream.on_abandoned)
        monkeypatch.setattr(QuicStream, "on_abandoned", Stream.on_abandoned)
    return str(request.param)


#: The transport ``_peers`` builds nodes on; tests marked ``@over_transports`` run on each.
_KIND = "memory"
#: (real loopback sockets: on the wall clock, see tests/aio/conftest.py)
TRANSPORT_KINDS = [
    "memory",
    pytest.param("tcp", marks=pytest.mark.realtime),
    pytest.param("quic", marks=pytest.mark.realtime),
]


@pytest.fixture(params=TRANSPORT_KINDS)
def transport_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys.modules[__name__], "_KIND", request.param)
    return str(request.param)


#: Runs a test over the in-process memory transport and over real TCP and QUIC on loopback.
over_transports = pytest.mark.usefixtures("transport_kind")


def _opening(header: Message, *requests: Message) -> bytes:
    """A call's opening message as the RPC layer writes it: u32 header size, header, request."""
    head = encode_message_bytes(header)
    return struct.pack("!I", len(head)) + head + b"".join(map(encode_message_bytes, requests))


@message("test.rpc.num")
@dataclass(frozen=True, slots=True)
class Num(Message):
    value: int


@message("test.rpc.text")
@dataclass(frozen=True, slots=True)
class Text(Message):
    text: str


@message("test.rpc.blob")
@dataclass(frozen=True, slots=True)
class Blob(Message):
    data: bytes


class CountingTransport(MemoryTransport):
    """A MemoryTransport that counts the connections it dials."""

    def __init__(self, identity: Identity, **options: Any) -> None:
        super().__init__(identity, **options)
        self.dials = 0

    async def connect(self, address: Address, *, allow_unknown_peer: bool = False) -> Connection:
        self.dials += 1
        return await super().connect(address, allow_unknown_peer=allow_unknown_peer)


def _node(network: MemoryNetwork, *, limit: int = 64, **transport_options: Any) -> Node:
    identity = Identity.generate()
    transport = CountingTransport(identity, network=network, **transport_options)
    return Node(
        identity=identity,
        listen=["memory://local:0"],
        transports=[transport],
        max_concurrent_calls_per_peer=limit,
    )


def _transport(node: Node) -> CountingTransport:
    transport = node._transports["memory"]
    assert isinstance(transport, CountingTransport)
    return transport


@asynccontextmanager
async def _peers(n: int, network: MemoryNetwork | None = None) -> AsyncIterator[list[Node]]:
    """``n`` nodes on the memory transport, or on loopback TCP or QUIC in tests marked
    ``@over_transports``."""
    network = network if network is not None else MemoryNetwork()
    async with AsyncExitStack() as stack:
        if _KIND == "memory":
            yield [await stack.enter_async_context(_node(network)) for _ in range(n)]
        else:
            yield [
                await stack.enter_async_context(Node(listen=[f"{_KIND}://127.0.0.1:0"]))
                for _ in range(n)
            ]


# -- handlers shared by several tests --------------------------------------------------------


async def double(request: Num, ctx: CallContext) -> Num:
    return Num(2 * request.value)


async def count(request: Num, ctx: CallContext) -> AsyncIterator[Num]:
    for i in range(request.value):
        yield Num(i)


async def total(requests: AsyncIterator[Num], ctx: CallContext) -> Num:
    return Num(sum([r.value async for r in requests]))


async def increment(requests: AsyncIterator[Num], ctx: CallContext) -> AsyncIterator[Num]:
    async for request in requests:
        yield Num(request.value + 1)


async def echo(request: Message, ctx: CallContext) -> Message:
    return request


def _serve_arithmetic(node: Node) -> None:
    node.rpc.register("double", double, request_type=Num)
    node.rpc.register("count", count, kind=RPCKind.SERVER_STREAM, request_type=Num)
    node.rpc.register("total", total, kind="client_stream", request_type=Num)
    node.rpc.register("increment", increment, kind=RPCKind.BIDI, request_type=Num)


class Blocker:
    """A handler that blocks until released and records how it ended."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.cancelled = anyio.Event()
        self.finished = anyio.Event()
        self.release = anyio.Event()
        self.contexts: list[CallContext] = []

    async def _block(self, ctx: CallContext) -> None:
        self.contexts.append(ctx)
        self.started.set()
        try:
            await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        finally:
            self.finished.set()

    async def unary(self, request: Message, ctx: CallContext) -> Num:
        await self._block(ctx)
        return Num(1)

    async def stream(self, request: Message, ctx: CallContext) -> AsyncIterator[Num]:
        yield Num(0)
        await self._block(ctx)
        yield Num(1)

    async def client_stream(self, requests: AsyncIterator[Message], ctx: CallContext) -> Num:
        n = len([r async for r in requests])
        await self._block(ctx)
        return Num(n)

    async def bidi(self, requests: AsyncIterator[Message], ctx: CallContext) -> AsyncIterator[Num]:
        async for _ in requests:
            yield Num(0)
            await self._block(ctx)


def _serve_blocker(node: Node) -> Blocker:
    blocker = Blocker()
    node.rpc.register("block", blocker.unary)
    node.rpc.register("block_stream", blocker.stream, kind="server_stream")
    node.rpc.register("block_client", blocker.client_stream, kind="client_stream")
    node.rpc.register("block_bidi", blocker.bidi, kind="bidi")
    return blocker


async def _collect(
    call: AbstractAsyncContextManager[AsyncIterator[Any]], into: list[Any] | None = None
) -> list[Any]:
    """Enter a server-stream call and read every response."""
    got = [] if into is None else into
    async with call as responses:
        async for response in responses:
            got.append(response)
    return got


async def _bidi(
    call: AbstractAsyncContextManager[StreamingCall[Message, Any]],
    requests: list[Message],
    *,
    done_sending: bool = True,
) -> list[Any]:
    """Enter a call opened with ``rpc.open``, send ``requests`` and read every response."""
    async with call as c:
        for request in requests:
            await c.send(request)
        if done_sending:
            await c.done_sending()
        return [r async for r in c]


# -- the four kinds of calls --------------------------------------------------------------------


@over_transports
async def test_unary_calls_between_several_peers() -> None:
    seen: list[tuple[object, str]] = []

    async def whoami(request: Text, ctx: CallContext) -> Text:
        seen.append((ctx.peer_id, ctx.method))
        assert ctx.deadline == math.inf  # no timeout given
        return Text(f"{request.text} from {ctx.peer_id}")

    async with _peers(3) as (server, a, b):
        _serve_arithmetic(server)
        server.rpc.register("whoami", whoami, request_type=Text)
        address = server.addresses[0]
        with anyio.fail_after(5):
            assert await a.rpc.call(address, "double", Num(21)) == Num(42)
            assert await b.rpc.call(str(address), "double", Num(-5), response_type=Num) == Num(-10)
            reply = await a.rpc.call(address, "whoami", Text("hi"))
            assert reply == Text(f"hi from {a.peer_id}")
            # the callee calls back over the connection the caller opened, by PeerID
            _serve_arithmetic(a)
            assert await server.rpc.call(a.peer_id, "double", Num(4)) == Num(8)
        assert seen == [(a.peer_id, "whoami")]


@over_transports
async def test_server_stream_delivers_every_response_in_order() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with anyio.fail_after(5):
            async with client.rpc.server_stream(
                server.addresses[0], "count", Num(50), response_type=Num
            ) as responses:
                got = [r.value async for r in responses]
            assert got == list(range(50))
            async with client.rpc.server_stream(server.addresses[0], "count", Num(0)) as empty:
                assert [r async for r in empty] == []


@over_transports
async def test_client_stream_takes_sync_and_async_iterables() -> None:
    async def numbers() -> AsyncIterator[Num]:
        for i in range(10):
            yield Num(i)

    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        address = server.addresses[0]
        with anyio.fail_after(5):
            assert await client.rpc.client_stream(address, "total", numbers()) == Num(45)
            assert await client.rpc.client_stream(address, "total", [Num(1), Num(2)]) == Num(3)
            assert await client.rpc.client_stream(address, "total", []) == Num(0)


@over_transports
async def test_bidi_call_interleaves_requests_and_responses() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with anyio.fail_after(5):
            async with client.rpc.open(
                server.addresses[0], "increment", kind="bidi", response_type=Num
            ) as call:
                for i in range(5):
                    # each answer arrives before the next request is sent: truly interleaved
                    await call.send(Num(i * 10))
                    assert await call.receive() == Num(i * 10 + 1)
                await call.send(Num(100))
                await call.done_sending()
                await call.done_sending()  # idempotent
                assert [r async for r in call] == [Num(101)]
                with pytest.raises(StopAsyncIteration):
                    await call.receive()


@over_transports
async def test_bidi_handler_can_answer_before_reading_everything() -> None:
    async def greet_then_echo(
        requests: AsyncIterator[Text], ctx: CallContext
    ) -> AsyncIterator[Text]:
        yield Text("hello")
        async for request in requests:
            yield request

    async with _peers(2) as (server, client):
        server.rpc.register("greet", greet_then_echo, kind=RPCKind.BIDI, request_type=Text)
        with anyio.fail_after(5):
            async with client.rpc.open(server.addresses[0], "greet") as call:
                assert await call.receive() == Text("hello")
                await call.send(Text("a"))
                await call.send(Text("b"))
                await call.done_sending()
                assert [r async for r in call] == [Text("a"), Text("b")]


# -- failures of one call -----------------------------------------------------------------------


@over_transports
@pytest.mark.allow_error_log  # (the KeyError: a bug of the handler)
async def test_handler_error_fails_only_that_call(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="swarmavg.aio.rpc")

    async def picky(request: Num, ctx: CallContext) -> Num:
        if request.value == 7:
            raise ValueError("seven is not allowed")
        return Num(request.value)

    async def broken_stream(request: Num, ctx: CallContext) -> AsyncIterator[Num]:
        yield Num(1)
        yield Num(2)
        raise KeyError("chunk 3")

    async with _peers(2) as (server, client):
        server.rpc.register("picky", picky, request_type=Num)
        server.rpc.register("broken", broken_stream, kind="server_stream", request_type=Num)
        address = server.addresses[0]
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for i in range(5):  # calls in flight on the same connection are not affected
                    tg.start_soon(client.rpc.call, address, "picky", Num(i))
                with pytest.raises(RemoteError, match="seven is not allowed") as info:
                    await client.rpc.call(address, "picky", Num(7))
            assert info.value.code == "handler_error"
            assert info.value.remote_type == "ValueError"
            assert not isinstance(info.value, MethodNotFound)

            got: list[Message] = []
            with pytest.raises(RemoteError, match="chunk 3") as info:
                await _collect(client.rpc.server_stream(address, "broken", Num(0)), got)
            assert got == [Num(1), Num(2)]
            assert info.value.remote_type == "KeyError"

            # the node and the connection keep serving
            conn = client.connection_to(server.peer_id)
            assert await client.rpc.call(address, "picky", Num(8)) == Num(8)
            assert client.connection_to(server.peer_id) is conn is not None
    # what the request caused is the caller's business (DEBUG); a KeyError is our bug
    assert _handler_failures(caplog) == {"ValueError": logging.DEBUG, "KeyError": logging.ERROR}


def _handler_failures(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    """The level each type of handler failure was logged at (by the RPC layer)."""
    levels = {}
    for record in caplog.records:
        if record.name == "swarmavg.aio.rpc" and "failed for" in record.getMessage():
            assert record.levelno == logging.DEBUG or record.exc_info is not None  # traceback
            levels[type(record.args[-1]).__name__] = record.levelno  # type: ignore[index]
    return levels


@over_transports
@pytest.mark.allow_error_log  # (a bug of the handler: logged at ERROR)
async def test_handler_returning_a_non_message_is_a_handler_error() -> None:
    async def sloppy(request: Message, ctx: CallContext) -> Any:
        return {"value": 1}

    async with _peers(2) as (server, client):
        server.rpc.register("sloppy", sloppy)
        with anyio.fail_after(5), pytest.raises(RemoteError, match="not a Message") as info:
            await client.rpc.call(server.addresses[0], "sloppy", Num(1))
        assert (info.value.code, info.value.remote_type) == ("handler_error", "TypeError")


@over_transports
@pytest.mark.allow_error_log  # (a bug of the handler: logged at ERROR)
async def test_stream_handler_that_is_no_generator_is_a_handler_error() -> None:
    async def not_a_generator(request: Message, ctx: CallContext) -> Num:
        return Num(1)

    async with _peers(2) as (server, client):
        server.rpc.register("wrong", not_a_generator, kind="server_stream")
        with anyio.fail_after(5), pytest.raises(RemoteError, match="async generator") as info:
            await _collect(client.rpc.server_stream(server.addresses[0], "wrong", Num(0)))
        assert info.value.remote_type == "TypeError"


@over_transports
async def test_unknown_method_raises_method_not_found() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        address = server.addresses[0]
        with anyio.fail_after(5):
            with pytest.raises(MethodNotFound, match="no_such_method") as info:
                await client.rpc.call(address, "no_such_method", Num(1))
            assert info.value.code == "unknown_method"
            server.rpc.unregister("double")
            with pytest.raises(MethodNotFound, match="double"):
                await client.rpc.call(address, "double", Num(1))
            with pytest.raises(MethodNotFound, match="nope"):
                await _collect(client.rpc.server_stream(address, "nope", Num(1)))
            assert await client.rpc.client_stream(address, "total", [Num(1)]) == Num(1)


@over_transports
async def test_wrong_request_type_is_bad_request_and_handler_never_sees_it() -> None:
    seen: list[Message] = []

    async def collect(requests: AsyncIterator[Num], ctx: CallContext) -> Num:
        async for request in requests:
            seen.append(request)
        return Num(len(seen))

    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        server.rpc.register("collect", collect, kind="client_stream", request_type=Num)
        server.rpc.register("anything", echo)
        address = server.addresses[0]
        with anyio.fail_after(5):
            with pytest.raises(RemoteError, match="Text") as info:
                await client.rpc.call(address, "double", Text("21"))
            assert info.value.code == "bad_request"
            with pytest.raises(RemoteError, match="Text") as info:
                await client.rpc.client_stream(address, "collect", [Num(1), Text("x"), Num(2)])
            assert info.value.code == "bad_request"
            assert seen == [Num(1)]
            # RPC-internal messages are not requests, even for a method that takes any message
            with pytest.raises(RemoteError) as info:
                await client.rpc.call(address, "anything", CallHeader("double", "unary", 0.0))
            assert info.value.code == "bad_request"
            assert await client.rpc.call(address, "anything", Text("x")) == Text("x")
            assert await client.rpc.call(address, "double", Num(3)) == Num(6)


@over_transports
async def test_calling_a_method_with_the_wrong_kind_is_bad_request() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        address = server.addresses[0]
        with anyio.fail_after(5):
            with pytest.raises(RemoteError, match="server_stream") as info:
                await client.rpc.call(address, "count", Num(3))
            assert info.value.code == "bad_request"
            with pytest.raises(RemoteError, match="unary") as info:
                await client.rpc.client_stream(address, "double", [Num(1)])
            assert info.value.code == "bad_request"
            with pytest.raises(RemoteError, match="client_stream") as info:
                await _bidi(client.rpc.open(address, "total", kind="bidi"), [Num(1)])
            assert info.value.code == "bad_request"
            assert await client.rpc.call(address, "double", Num(1)) == Num(2)


@over_transports
async def test_a_unary_call_without_a_request_is_bad_request() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with anyio.fail_after(5), pytest.raises(RemoteError, match="no request") as info:
            await _bidi(client.rpc.open(server.addresses[0], "double", kind="unary"), [])
        assert info.value.code == "bad_request"


@over_transports
async def test_unexpected_response_type_raises_remote_protocol_error() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with anyio.fail_after(5), pytest.raises(RemoteProtocolError, match="Text"):
            await client.rpc.call(server.addresses[0], "double", Num(1), response_type=Text)


# -- deadlines and cancellation -----------------------------------------------------------------


@over_transports
async def test_timeout_cancels_the_remote_handler() -> None:
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        start = anyio.current_time()
        with anyio.fail_after(5), pytest.raises(RPCTimeout, match="block") as info:
            await client.rpc.call(server.addresses[0], "block", Num(0), timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        assert isinstance(info.value, RPCError)
        if _KIND == "memory":  # (virtual time: the exact second)
            assert anyio.current_time() - start == pytest.approx(0.2, abs=1e-3)
        else:
            assert 0.15 <= anyio.current_time() - start < 2
        with anyio.fail_after(2):
            await blocker.cancelled.wait()
        # the handler knew its deadline, about `timeout` after the call started
        (ctx,) = blocker.contexts
        assert start + 0.1 < ctx.deadline < start + 0.5


_KINDS = {
    "block": "unary",
    "block_stream": "server_stream",
    "block_client": "client_stream",
    "block_bidi": "bidi",
}


async def test_the_callee_gets_the_budget_left_after_connecting() -> None:
    network = MemoryNetwork()
    deadlines: list[float] = []

    async def note(request: Message, ctx: CallContext) -> Message:
        deadlines.append(ctx.deadline)
        return request

    # 50 ms each way: connecting takes a 100 ms round trip, the header arrives 50 ms later
    async with _node(network, latency=0.05) as server, _node(network) as client:
        server.rpc.register("note", note)
        start = anyio.current_time()
        with anyio.fail_after(5):
            await client.rpc.call(server.addresses[0], "note", Num(0), timeout=1.0)
        # the callee gives up when the caller does (plus the header's trip), not 100 ms later
        (deadline,) = deadlines
        assert deadline == pytest.approx(start + 1.0 + 0.05, abs=1e-3)


@over_transports
@pytest.mark.parametrize("method", ["block_stream", "block_client", "block_bidi"])
async def test_timeout_applies_to_streaming_calls(method: str) -> None:
    kind = _KINDS[method]
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        # Connected first, and 0.5 s: the callee must reach the blocking point before its
        # deadline (a handler cancelled at its first send, as happened once on a busy machine
        # with 0.2 s that also covered the handshake, never blocks, so never sees it).
        await client.connect(server.addresses[0])
        call = client.rpc.open(server.addresses[0], method, kind=kind, timeout=0.5)
        with anyio.fail_after(5), pytest.raises(RPCTimeout):
            await _bidi(call, [Num(0)], done_sending=kind == "client_stream")
        with anyio.fail_after(2):
            await blocker.cancelled.wait()


@over_transports
async def test_callee_enforces_the_deadline_it_was_sent() -> None:
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        with anyio.fail_after(5):
            stream = await client.open_stream(server.addresses[0])
            await stream.send(_opening(CallHeader("block", "unary", 0.2), Num(0)))
            failed = decode_message(await stream.receive())  # we never give up: the callee does
            assert isinstance(failed, CallFailed)
            assert failed.code == "timeout"
            assert blocker.cancelled.is_set()
            await stream.aclose()
            # a caller with no deadline of its own raises the callee's verdict as RPCTimeout
            stream = await client.open_stream(server.addresses[0])
            call: StreamingCall[Message, Message] = StreamingCall(
                stream, "block", None, math.inf, 0.2
            )
            await call._send_opening(CallHeader("block", "unary", 0.2), Num(0))
            with pytest.raises(RPCTimeout):
                await call.receive()
            await stream.aclose()


@over_transports
async def test_callee_waits_a_bounded_time_for_a_caller_that_never_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After answering a call whose requests it reads in a task, the callee waits for the
    caller's close (cheaper than cancelling that read), but not forever: the call's slot is
    freed after the linger time."""
    monkeypatch.setattr("swarmavg.aio.rpc._LINGER", 0.3)
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with anyio.fail_after(5):
            stream = await client.open_stream(server.addresses[0])
            await stream.send(_opening(CallHeader("total", "client_stream", 0.0), Num(20)))
            await stream.send(encode_message_bytes(Num(22)))
            await stream.send(encode_message_bytes(EndOfRequests()))
            answer = decode_message(await stream.receive())
            assert isinstance(answer, Num)
            assert answer.value == 42
            with pytest.raises(anyio.EndOfStream):  # the answer carried the callee's EOF
                await stream.receive()
            assert server.rpc._slots  # the callee still waits for our close...
            while server.rpc._slots:  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.05)  # ...until the linger time is up
            await stream.aclose()


@over_transports
async def test_a_unary_callee_ignores_what_follows_the_request(abandon_watch: str) -> None:
    """A unary call whose request came in the opening is answered without reading the
    caller's side further: a stray message after it is dropped, not an error."""
    if abandon_watch == "read":
        pytest.skip(
            "a transport without on_abandoned makes the callee read the caller's side, where a "
            "message after the request is a breach (test_a_caller_breaking_the_protocol...)"
        )
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with anyio.fail_after(5):
            stream = await client.open_stream(server.addresses[0])
            await stream.send(_opening(CallHeader("double", "unary", 0.0), Num(21)))
            await stream.send(encode_message_bytes(Num(1)))
            answer = decode_message(await stream.receive())
            assert isinstance(answer, Num)
            assert answer.value == 42
            await stream.aclose()
            assert await client.rpc.call(server.addresses[0], "double", Num(2)) == Num(4)


async def test_bad_timeouts_are_refused() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        address = server.addresses[0]
        for bad in (0, -1, math.nan, -math.inf, True):
            with pytest.raises(ValueError, match="timeout"):
                await client.rpc.call(address, "double", Num(1), timeout=bad)
            with pytest.raises(ValueError, match="timeout"):
                async with client.rpc.server_stream(address, "count", Num(1), timeout=bad):
                    pass
            with pytest.raises(ValueError, match="timeout"):
                await client.rpc.client_stream(address, "total", [], timeout=bad)
        with anyio.fail_after(5):  # a generous timeout does not get in the way
            assert await client.rpc.call(address, "double", Num(1), timeout=30) == Num(2)
            assert await client.rpc.call(address, "double", Num(2), timeout=math.inf) == Num(4)


@over_transports
@pytest.mark.parametrize("method", ["block", "block_stream", "block_client", "block_bidi"])
async def test_caller_cancellation_reaches_the_remote_handler(method: str) -> None:
    kind = _KINDS[method]
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)

        async def caller(scope: anyio.CancelScope) -> None:
            with scope:
                async with client.rpc.open(server.addresses[0], method, kind=kind) as call:
                    await call.send(Num(0))
                    if kind == "client_stream":
                        await call.done_sending()  # the callee has read everything
                    async for _ in call:
                        pass
                pytest.fail("the call should not have finished")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()
                tg.start_soon(caller, scope)
                await blocker.started.wait()
                scope.cancel()
            await blocker.cancelled.wait()
            # the node keeps serving
            blocker.release.set()
            assert await client.rpc.call(server.addresses[0], "block", Num(0)) == Num(1)


@over_transports
async def test_leaving_a_server_stream_early_stops_the_handler() -> None:
    produced = 0
    stopped = anyio.Event()

    async def endless(request: Message, ctx: CallContext) -> AsyncIterator[Num]:
        nonlocal produced
        try:
            while True:
                yield Num(produced)
                produced += 1
        finally:
            stopped.set()

    async with _peers(2) as (server, client):
        server.rpc.register("endless", endless, kind="server_stream")
        with anyio.fail_after(5):
            async with client.rpc.server_stream(server.addresses[0], "endless", Num(0)) as rs:
                async for response in rs:
                    if response.value == 3:
                        break
            await stopped.wait()
        assert produced >= 3


# -- connections and concurrency ------------------------------------------------------------


async def test_calls_reuse_one_pooled_connection_per_peer() -> None:
    async with _peers(3) as (server, a, b):
        _serve_arithmetic(server)
        address = server.addresses[0]
        with anyio.fail_after(5):
            for i in range(20):
                assert await a.rpc.call(address, "double", Num(i)) == Num(2 * i)
            async with anyio.create_task_group() as tg:
                for i in range(30):
                    tg.start_soon(a.rpc.call, address, "double", Num(i))
                    tg.start_soon(b.rpc.call, address, "double", Num(i))
            async with a.rpc.server_stream(address, "count", Num(3)) as responses:
                assert len([r async for r in responses]) == 3
            assert await a.rpc.client_stream(address, "total", [Num(1)]) == Num(1)
            # and back, from the server over the connection `a` opened
            _serve_arithmetic(a)
            assert await server.rpc.call(a.peer_id, "double", Num(1)) == Num(2)
        assert _transport(a).dials == 1
        assert _transport(b).dials == 1
        assert _transport(server).dials == 0
        assert a.connection_to(server.peer_id) is not None
        assert server.connection_to(a.peer_id) is not None


@over_transports
async def test_calling_a_peer_id_without_a_connection_is_a_connect_error() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        with pytest.raises(ConnectError, match=re.escape(str(server.peer_id))):
            await client.rpc.call(server.peer_id, "double", Num(1))
        with anyio.fail_after(5):
            await client.rpc.call(server.addresses[0], "double", Num(1))
            assert await client.rpc.call(server.peer_id, "double", Num(5)) == Num(10)


async def test_per_peer_concurrency_limit() -> None:
    network = MemoryNetwork()
    running = {"a": 0, "b": 0}
    peak = {"a": 0, "b": 0}
    started: list[str] = []
    gates = {f"a{i}": anyio.Event() for i in range(3)}

    async def hold(request: Text, ctx: CallContext) -> Text:
        who = request.text[0]
        running[who] += 1
        peak[who] = max(peak[who], running[who])
        started.append(request.text)
        try:
            if who == "a":
                await gates[request.text].wait()
            return request
        finally:
            running[who] -= 1

    async with (
        _node(network, limit=2) as server,
        _node(network) as a,
        _node(network) as b,
    ):
        server.rpc.register("hold", hold, request_type=Text)
        address = server.addresses[0]
        results: list[str] = []

        async def call(node: Node, text: str) -> None:
            reply = await node.rpc.call(address, "hold", Text(text))
            results.append(reply.text)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(call, a, f"a{i}")
                await anyio.wait_all_tasks_blocked()
                assert running["a"] == 2
                assert len(started) == 2  # the third call waits for a free slot
                (waiting,) = set(gates) - set(started)
                # another peer is not held up by a's calls
                await call(b, "b0")
                await call(b, "b1")
                assert results == ["b0", "b1"]
                assert running["a"] == 2
                assert waiting not in started
                gates[started[0]].set()  # one of a's calls finishes: the third gets its slot
                await anyio.wait_all_tasks_blocked()
                assert started[-1] == waiting
                assert running["a"] == 2
                for gate in gates.values():
                    gate.set()
        assert sorted(results) == ["a0", "a1", "a2", "b0", "b1"]
        assert peak == {"a": 2, "b": 1}


async def test_many_concurrent_calls_from_several_peers() -> None:
    network = MemoryNetwork()

    async def slow_square(request: Num, ctx: CallContext) -> Num:
        await anyio.sleep(0.001 * (request.value % 5))
        return Num(request.value * request.value)

    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(_node(network, latency=0.001))
        clients = [await stack.enter_async_context(_node(network)) for _ in range(3)]
        server.rpc.register("square", slow_square, request_type=Num)
        results: dict[tuple[int, int], int] = {}

        async def call(c: int, i: int) -> None:
            reply = await clients[c].rpc.call(server.addresses[0], "square", Num(i), timeout=10)
            results[c, i] = reply.value

        with anyio.fail_after(8):
            async with anyio.create_task_group() as tg:
                for i in range(70):  # more than the default per-peer limit of 64
                    for c in range(3):
                        tg.start_soon(call, c, i)
        assert results == {(c, i): i * i for c in range(3) for i in range(70)}


# -- sizes ------------------------------------------------------------------------------------


async def test_oversized_request_is_refused_locally() -> None:
    network = MemoryNetwork()
    calls = 0

    async def size(request: Blob, ctx: CallContext) -> Num:
        nonlocal calls
        calls += 1
        return Num(len(request.data))

    async def sizes(requests: AsyncIterator[Blob], ctx: CallContext) -> Num:
        nonlocal calls
        calls += 1
        return Num(sum([len(r.data) async for r in requests]))

    async with _node(network) as server, _node(network, max_message_size=1024) as client:
        server.rpc.register("size", size, request_type=Blob)
        server.rpc.register("sizes", sizes, kind="client_stream", request_type=Blob)
        with anyio.fail_after(5):
            with pytest.raises(MessageTooLarge):
                await client.rpc.call(server.addresses[0], "size", Blob(b"x" * 2000))
            with pytest.raises(MessageTooLarge):
                await client.rpc.client_stream(
                    server.addresses[0], "sizes", [Blob(b"small"), Blob(b"x" * 2000)]
                )
            with pytest.raises(MessageTooLarge):  # a started call: nothing is sent either
                await client.rpc.start_call(server.addresses[0], "size", Blob(b"x" * 2000))
            await anyio.wait_all_tasks_blocked()
            assert calls <= 1  # the client-stream handler may have started, never finished
            assert await client.rpc.call(server.addresses[0], "size", Blob(b"x" * 500)) == Num(500)
            started = await client.rpc.start_call(server.addresses[0], "size", Blob(b"x" * 500))
            assert await _answer_of(started) == Num(500)


async def test_oversized_response_fails_the_call_remotely() -> None:
    network = MemoryNetwork()

    async def blob(request: Num, ctx: CallContext) -> Blob:
        return Blob(b"y" * request.value)

    async with _node(network, max_message_size=1024) as server, _node(network) as client:
        server.rpc.register("blob", blob, request_type=Num)
        with anyio.fail_after(5):
            with pytest.raises(RemoteError) as info:
                await client.rpc.call(server.addresses[0], "blob", Num(5000))
            assert info.value.code == "response_too_large"
            assert await client.rpc.call(server.addresses[0], "blob", Num(10)) == Blob(b"y" * 10)


# -- peers that go away -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["disconnect", "close_callee"])
async def test_peer_killed_mid_call_interrupts_the_call(how: str) -> None:
    network = MemoryNetwork()
    async with _node(network) as client, _node(network) as server:
        blocker = _serve_blocker(server)
        address = server.addresses[0]

        async def kill() -> None:
            await blocker.started.wait()
            if how == "disconnect":
                _transport(server).disconnect_all()
            else:
                await server.aclose()

        start = anyio.current_time()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(RemoteError, match="interrupted") as info:
                    await client.rpc.call(address, "block", Num(0))
        assert info.value.code == "interrupted"
        assert anyio.current_time() - start < 2
        if how == "close_callee":
            with anyio.fail_after(2):
                await blocker.cancelled.wait()
            with pytest.raises(ConnectError):
                await client.rpc.call(address, "block", Num(0))
        else:
            # a fresh connection is dialed for the next call
            blocker.release.set()
            with anyio.fail_after(5):
                assert await client.rpc.call(address, "block", Num(0)) == Num(1)
            assert _transport(client).dials == 2


@over_transports
async def test_callee_shutting_down_mid_call_interrupts_the_call() -> None:
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        address = server.addresses[0]

        async def kill() -> None:
            await blocker.started.wait()
            await server.aclose()

        start = anyio.current_time()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(RemoteError, match="interrupted") as info:
                    await client.rpc.call(address, "block", Num(0))
            await blocker.cancelled.wait()
        assert info.value.code == "interrupted"
        assert anyio.current_time() - start < 2
        with anyio.fail_after(5), pytest.raises(ConnectError):  # nobody there any more
            await client.rpc.call(address, "block", Num(0))


@over_transports
async def test_hundreds_of_concurrent_calls_on_one_connection() -> None:
    """More calls at once than the per-peer limit (64) and than QUIC's 128 open streams."""

    async def square(request: Num, ctx: CallContext) -> Num:
        await anyio.sleep(0.001 * (request.value % 3))
        return Num(request.value * request.value)

    async with _peers(2) as (server, client):
        server.rpc.register("square", square, request_type=Num)
        results: dict[int, int] = {}

        async def call(i: int) -> None:
            reply = await client.rpc.call(server.addresses[0], "square", Num(i), timeout=20)
            results[i] = reply.value

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(400):
                    tg.start_soon(call, i)
        assert results == {i: i * i for i in range(400)}
        assert len(client._pool) == 1  # one connection carried them all


async def test_peer_killed_while_the_caller_sends_interrupts_the_call() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        first_sent = anyio.Event()

        async def requests() -> AsyncIterator[Num]:
            yield Num(1)
            first_sent.set()
            _transport(server).disconnect_all()
            yield Num(2)

        with anyio.fail_after(5), pytest.raises(RemoteError, match="interrupted") as info:
            await client.rpc.client_stream(server.addresses[0], "total", requests())
        assert first_sent.is_set()
        assert info.value.code == "interrupted"
        assert isinstance(info.value.__cause__, ConnectionLost)


async def test_peer_killed_during_a_server_stream() -> None:
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        got: list[Message] = []

        async def kill() -> None:
            await blocker.started.wait()
            _transport(server).disconnect_all()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(RemoteError) as info:
                    await _collect(
                        client.rpc.server_stream(server.addresses[0], "block_stream", Num(0)), got
                    )
        assert info.value.code == "interrupted"
        assert got == [Num(0)]


# -- garbage on the wire --------------------------------------------------------------------


@over_transports
async def test_garbage_streams_are_aborted_and_the_node_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from swarmavg.aio import rpc

    monkeypatch.setattr(rpc, "_HEADER_TIMEOUT", 0.1)
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        address = server.addresses[0]
        with anyio.fail_after(5):
            # bytes that are no message at all
            stream = await client.open_stream(address)
            await stream.send(b"\x00\x00\x00\x05junk!")
            with pytest.raises(StreamReset):
                await stream.receive()
            # a valid message that is not a call opening, or one that opens with no header
            for opening in (encode_message_bytes(Num(1)), _opening(Num(1))):
                stream = await client.open_stream(address)
                await stream.send(opening)
                with pytest.raises(StreamReset):
                    await stream.receive()
            # a stream that ends, or stays silent, before its header
            stream = await client.open_stream(address)
            await stream.send_eof()
            with pytest.raises(StreamReset):
                await stream.receive()
            if _KIND == "memory":  # TCP and QUIC show a peer a stream only once data arrives
                stream = await client.open_stream(address)
                with pytest.raises(StreamReset):
                    await stream.receive()
            # a valid header followed by garbage fails that call as a bad request, whether the
            # garbage comes in the opening message or after it
            stream = await client.open_stream(address)
            await stream.send(_opening(CallHeader("double", "unary", 0.0)), b"\xff" * 16)
            failed = decode_message(await stream.receive())
            assert isinstance(failed, CallFailed)
            assert failed.code == "bad_request"
            stream = await client.open_stream(address)
            await stream.send(_opening(CallHeader("double", "unary", 0.0)))
            await stream.send(b"\xff" * 16)
            failed = decode_message(await stream.receive())
            assert isinstance(failed, CallFailed)
            assert failed.code == "bad_request"
            # an invalid deadline is refused
            stream = await client.open_stream(address)
            await stream.send(_opening(CallHeader("double", "unary", -1.0)))
            failed = decode_message(await stream.receive())
            assert isinstance(failed, CallFailed)
            assert failed.code == "bad_request"
            # ... and every call still works, on the same connection
            conn = client.connection_to(server.peer_id)
            assert await client.rpc.call(address, "double", Num(2)) == Num(4)
            assert client.connection_to(server.peer_id) is conn


@over_transports
async def test_a_caller_breaking_the_protocol_fails_its_call() -> None:
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        with anyio.fail_after(5):
            # a second request in a unary call is a protocol breach: the handler is cancelled
            async with client.rpc.open(server.addresses[0], "block", kind="unary") as call:
                await call.send(Num(0))
                await blocker.started.wait()
                await call.send(Num(1))
                with pytest.raises(RemoteError) as info:
                    await call.receive()
            assert info.value.code == "bad_request"
            await blocker.cancelled.wait()


# -- argument validation ------------------------------------------------------------------------


def test_register_validates_its_arguments() -> None:
    node = Node()
    node.rpc.register("double", double, request_type=Num)
    for bad_name in ("", "x" * 129, 42, None):
        with pytest.raises(ValueError, match="name"):
            node.rpc.register(bad_name, double)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        node.rpc.register("double", double)
    with pytest.raises(TypeError, match="request_type"):
        node.rpc.register("x", double, request_type=int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_type"):
        node.rpc.register("x", double, request_type=Num(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        node.rpc.register("x", "double")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kind|RPCKind"):
        node.rpc.register("x", double, kind="sideways")
    node.rpc.register("x" * 128, double)  # the longest name is fine
    with pytest.raises(ValueError, match="max_concurrent_calls_per_peer"):
        Node(max_concurrent_calls_per_peer=0)


def test_call_headers_keep_their_own_timeout_when_decoded_from_the_cache() -> None:
    """The callee decodes a method's header once and reads only the timeout of later calls
    (the last 8 bytes); the wire format is the plain encoding of the CallHeader."""
    from swarmavg.aio.rpc import _HEADERS, _decode_opening, _encode_header

    def opening(header: CallHeader, request: Message | None = None) -> memoryview:
        data = _encode_header(header) + (b"" if request is None else encode_message_bytes(request))
        assert data == _opening(header, *([] if request is None else [request]))
        return memoryview(data)

    _HEADERS.clear()
    first = CallHeader("cached.call", "unary", 1.5)
    header, rest = _decode_opening(opening(first, Num(3)), 1 << 20)
    assert header == first
    assert decode_message(rest) == Num(3)
    assert len(_HEADERS) == 1
    for timeout in (0.0, 2.25, 1e-9, 86400.0):
        expected = CallHeader("cached.call", "unary", timeout)
        header, rest = _decode_opening(opening(expected), 1 << 20)
        assert header == expected
        assert not rest
    nan, _ = _decode_opening(opening(CallHeader("cached.call", "unary", float("nan"))), 1 << 20)
    assert math.isnan(nan.timeout)  # (serve_stream refuses it)
    # a header of the same length that differs before the timeout is decoded on its own
    other = CallHeader("cached.cell", "bidi_x", 7.0)
    assert _decode_opening(opening(other), 1 << 20)[0] == other
    assert len(_HEADERS) == 2
    # something else where a header should be is still refused, cached prefix or not
    with pytest.raises(RemoteProtocolError):
        _decode_opening(memoryview(_opening(Num(1))), 1 << 20)


# -- inline handlers -------------------------------------------------------------------------


@over_transports
@pytest.mark.allow_error_log  # (returning a dict: a bug of the handler)
async def test_inline_handlers_answer_from_the_reader_where_the_transport_allows(
    abandon_watch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An inline handler runs outside any task over TCP (the transport's reader answers the
    call); over the other transports it runs as usual, and so it does where the caller keeps
    its side open after the request (a transport without on_abandoned). Both give the same
    answers and errors."""
    caplog.set_level(logging.DEBUG, logger="swarmavg.aio.rpc")
    tasks: list[object] = []
    contexts: list[CallContext] = []

    def triple(request: Num, ctx: CallContext) -> Num:
        tasks.append(asyncio.current_task())
        contexts.append(ctx)
        if request.value == 7:
            raise ValueError("seven is not allowed")
        if request.value == 8:
            return {"value": 8}  # type: ignore[return-value]
        return Num(3 * request.value)

    async with _peers(2) as (server, client):
        server.rpc.register("triple", triple, request_type=Num, inline=True)
        address = server.addresses[0]
        with anyio.fail_after(10):
            # (the first call may arrive before the node adopted the new connection: it is
            # then served the usual way)
            assert await client.rpc.call(address, "triple", Num(1)) == Num(3)
            del tasks[:], contexts[:]
            async with anyio.create_task_group() as tg:
                results: dict[int, Message] = {}

                async def one(i: int) -> None:
                    results[i] = await client.rpc.call(address, "triple", Num(i), timeout=5)

                for i in range(10, 30):  # concurrent calls on one connection
                    tg.start_soon(one, i)
            assert results == {i: Num(3 * i) for i in range(10, 30)}
            with pytest.raises(RemoteError, match="seven is not allowed") as info:
                await client.rpc.call(address, "triple", Num(7))
            assert (info.value.code, info.value.remote_type) == ("handler_error", "ValueError")
            with pytest.raises(RemoteError, match="not a Message") as info:
                await client.rpc.call(address, "triple", Num(8))
            assert (info.value.code, info.value.remote_type) == ("handler_error", "TypeError")
            # a request of the wrong type never reaches it
            with pytest.raises(RemoteError) as info:
                await client.rpc.call(address, "triple", Text("x"))
            assert info.value.code == "bad_request"
            assert await client.rpc.call(address, "triple", Num(2)) == Num(6)
    assert len(tasks) == 23
    assert contexts[0].peer_id == client.peer_id
    assert contexts[0].method == "triple"
    assert math.isfinite(contexts[0].deadline)  # the caller's timeout reached it
    assert math.isinf(contexts[-1].deadline)
    if _KIND == "tcp" and abandon_watch == "watched":
        assert tasks == [None] * len(tasks), "TCP should answer inline calls from its reader"
    else:
        assert None not in tasks
    assert _handler_failures(caplog) == {"ValueError": logging.DEBUG, "TypeError": logging.ERROR}


@pytest.mark.realtime  # (TCP's inline path)
async def test_inline_answers_that_cannot_go_out_at_once_go_out_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No credit or another writer busy: the answer is sent by a task instead, in full."""
    monkeypatch.setattr(TcpStream, "send_last_nowait", lambda self, *parts: False)

    def triple(request: Num, ctx: CallContext) -> Num:
        return Num(3 * request.value)

    def huge(request: Num, ctx: CallContext) -> Text:
        return Text("x" * (2 << 20))

    server = Node(listen=["tcp://127.0.0.1:0"], transports={"tcp": {"max_message_size": 1 << 20}})
    async with server, Node() as client:
        server.rpc.register("triple", triple, request_type=Num, inline=True)
        server.rpc.register("huge", huge, request_type=Num, inline=True)
        address = server.addresses[0]
        with anyio.fail_after(10):
            for i in range(5):
                assert await client.rpc.call(address, "triple", Num(i)) == Num(3 * i)
            with pytest.raises(RemoteError) as info:
                await client.rpc.call(address, "huge", Num(0))
            assert info.value.code == "response_too_large"


async def test_inline_registration_is_checked() -> None:
    async with _peers(1) as (node,):
        with pytest.raises(TypeError, match="plain function"):
            node.rpc.register("async", double, request_type=Num, inline=True)
        with pytest.raises(ValueError, match="only a unary method"):
            node.rpc.register("stream", count, kind="server_stream", inline=True)

        def sneaky(request: Num, ctx: CallContext) -> Any:
            return double(request, ctx)  # a coroutine, from a plain function

        node.rpc.register("sneaky", sneaky, request_type=Num, inline=True)


@over_transports
@pytest.mark.allow_error_log  # (a bug of the handler: logged at ERROR)
async def test_an_inline_handler_that_returns_a_coroutine_fails_its_call() -> None:
    def sneaky(request: Num, ctx: CallContext) -> Any:
        return double(request, ctx)

    async with _peers(2) as (server, client):
        server.rpc.register("sneaky", sneaky, request_type=Num, inline=True)
        with anyio.fail_after(5), pytest.raises(RemoteError, match="awaitable") as info:
            await client.rpc.call(server.addresses[0], "sneaky", Num(1))
        assert info.value.code == "handler_error"


@pytest.mark.realtime  # (TCP's inline path)
async def test_a_stream_handler_gets_one_message_streams_not_the_inline_path() -> None:
    """With a stream handler set, the node serves streams with it, even a stream that looks
    like an inline call."""
    seen: list[bytes] = []

    async def handler(stream: Stream) -> None:
        seen.append(bytes(await stream.receive()))
        await stream.send_last(b"handled")

    def triple(request: Num, ctx: CallContext) -> Num:
        return Num(3 * request.value)

    async with Node(listen=["tcp://127.0.0.1:0"]) as server, Node() as client:
        server.rpc.register("triple", triple, request_type=Num, inline=True)
        server.set_stream_handler(handler)
        with anyio.fail_after(5):
            opening = _opening(CallHeader("triple", "unary", 0.0), Num(2))
            stream = await client.open_stream(server.addresses[0])
            await stream.send_last(opening)
            assert bytes(await stream.receive()) == b"handled"
            await stream.aclose()
        assert seen == [opening]
        server.set_stream_handler(None)
        with anyio.fail_after(5):
            assert await client.rpc.call(server.addresses[0], "triple", Num(2)) == Num(6)


@over_transports
async def test_a_prepared_request_is_encoded_once_for_several_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import swarmavg.aio.rpc as rpc_module

    encoded: list[Message] = []
    real_encode = rpc_module.encode_message

    def counting_encode(msg: Message, **kwargs: Any) -> Any:
        encoded.append(msg)
        return real_encode(msg, **kwargs)

    monkeypatch.setattr(rpc_module, "encode_message", counting_encode)
    async with _peers(3) as (a, b, client):
        for node in (a, b):
            node.rpc.register("double", double, request_type=Num)
            node.rpc.register("count", count, kind="server_stream", request_type=Num)
        request = Prepared(Num(21))
        assert repr(request) == "Prepared(Num(value=21))"
        with anyio.fail_after(5):
            for node in (a, b, a):
                assert await client.rpc.call(node.addresses[0], "double", request) == Num(42)
            got: list[Message] = []
            await _collect(client.rpc.server_stream(b.addresses[0], "count", Prepared(Num(3))), got)
            assert got == [Num(0), Num(1), Num(2)]
        assert encoded.count(Num(21)) == 1  # (the callee's answers are encoded too)
    with pytest.raises(TypeError, match="Message"):
        Prepared(b"raw")  # type: ignore[arg-type]


# -- PendingCall: calls whose answers the caller reads without a task per call -----------------


async def _answer_of(call: PendingCall[Any]) -> Any:
    """Read ``call``'s answer as a DHT lookup does: poll when the transport calls back; wait in
    ``wait()`` where it cannot."""
    woken = anyio.Event()
    with anyio.fail_after(5):
        while not call.poll():
            if not call.on_ready(woken.set):
                await call.wait()
                break
            await woken.wait()
            woken = anyio.Event()
    try:
        return call.result()
    finally:
        await call.aclose()


@over_transports
async def test_started_calls_are_answered_in_any_order_without_tasks() -> None:
    async with _peers(3) as (a, b, c):
        _serve_arithmetic(a)
        _serve_arithmetic(b)
        with anyio.fail_after(10):
            calls = [
                await c.rpc.start_call(peer.addresses[0], "double", Num(i), response_type=Num)
                for i, peer in enumerate([a, b, a, b])
            ]
            assert not any(call.settled for call in calls)  # (answers take a network trip)
            # memory and TCP streams call back; QUIC's cannot (wait() reads those)
            assert calls[0].on_ready(lambda: None) is (_KIND != "quic")
            answers = [await _answer_of(call) for call in reversed(calls)]
        assert answers == [Num(6), Num(4), Num(2), Num(0)]


@over_transports
async def test_a_started_call_reports_failures_through_result() -> None:
    async with _peers(2) as (server, client):
        _serve_arithmetic(server)
        _serve_blocker(server)
        address = server.addresses[0]
        missing = await client.rpc.start_call(address, "nope", Num(1))
        with pytest.raises(MethodNotFound):
            await _answer_of(missing)
        wrong = await client.rpc.start_call(address, "double", Num(1), response_type=Text)
        with pytest.raises(RemoteProtocolError, match="expected a Text"):
            await _answer_of(wrong)
        early = await client.rpc.start_call(address, "block", Num(1))
        with pytest.raises(RuntimeError, match="not over"):
            early.result()
        await early.aclose()
        await early.aclose()  # idempotent


async def test_a_started_call_times_out_and_leaving_it_cancels_the_handler() -> None:
    async with _peers(2) as (server, client):
        blocker = _serve_blocker(server)
        start = anyio.current_time()
        call = await client.rpc.start_call(server.addresses[0], "block", Num(0), timeout=0.2)
        assert call.deadline == pytest.approx(start + 0.2, abs=1e-3)
        with anyio.fail_after(5):
            await blocker.started.wait()
        assert not call.poll()
        with anyio.CancelScope(deadline=call.deadline):
            await anyio.sleep_forever()
        call.expire()
        with pytest.raises(RPCTimeout, match="block"):
            call.result()
        await call.aclose()  # unanswered: the stream is reset, and the handler cancelled
        with anyio.fail_after(5):
            await blocker.cancelled.wait()
        # wait() gives up at the deadline by itself
        call = await client.rpc.start_call(server.addresses[0], "block", Num(0), timeout=0.2)
        with anyio.fail_after(5):
            await call.wait()
        assert call.settled
        with pytest.raises(RPCTimeout):
            call.result()
        await call.aclose()


async def test_a_started_call_whose_callee_resets_is_interrupted() -> None:
    async with _peers(2) as (server, client):
        left = anyio.Event()

        async def leave(stream: Stream) -> None:
            await stream.receive()
            await stream.abort()
            left.set()

        server.set_stream_handler(leave)
        call = await client.rpc.start_call(server.addresses[0], "anything", Num(0))
        with pytest.raises(RemoteError) as info:
            await _answer_of(call)
        assert info.value.code in {"interrupted", "no_response"}
        assert left.is_set()


def test_a_callees_failure_text_is_escaped_and_bounded() -> None:
    """Trust I's F16 for calls: what a callee says in its failure answer becomes our
    exception's text (and so our log lines): newlines and escapes are shown, not obeyed."""
    from swarmavg.aio.rpc import _response

    failed = CallFailed("handler_error\n", "Value\x1bError", "bad\nWARNING forged" + "y" * 5000)
    with pytest.raises(RemoteError) as caught:
        _response(failed, "m", None, None)
    error = caught.value
    assert str(error).startswith("bad\\nWARNING forged")
    assert str(error).isprintable()
    assert len(str(error)) <= 301
    assert (error.code, error.remote_type) == ("handler_error\\n", "Value\\x1bError")
