"""Remote procedure calls between nodes: unary, server-stream, client-stream and bidirectional.

Theory of operation
-------------------
Every call is one transport stream. The caller sends a :class:`CallHeader` (method name, kind,
remaining time budget), then its request message(s), each an encoded
:class:`~swarmavg.proto.Message`; a client-stream or bidi caller marks the end of its requests
with an :class:`EndOfRequests` message. The callee answers with response message(s) and ends its
direction of the stream; a failure is a single :class:`CallFailed` message instead, which the
caller raises as :class:`~swarmavg.errors.RemoteError`.

The callee notices a caller that goes away (gives up, aborts, times out) and cancels the handler.
Over a transport that reports an abandoned stream (:meth:`~swarmavg.abc.Stream.on_abandoned`:
memory, TCP and QUIC do), a unary caller ends its direction with the request itself (EOF with the
opening) and the transport's callback tells the callee when the caller leaves; the handler runs
in the accepting task, with no reader beside it. Otherwise the caller never ends its own
direction before it has read the whole answer, and the callee watches the stream for the whole
call with a task that reads the caller's side (and hands requests to the handler): EOF or a
reset there means the caller went away. (While that task waits for the handler to take a request
it cannot notice the caller leaving; the handler's next read or write does.)

Deadlines travel as a *relative* budget (clocks of peers are not synchronized). The callee runs
the handler under that budget; the caller enforces its own with the same number, so both sides
give up at about the same time, and the caller raises :class:`~swarmavg.errors.RPCTimeout`.

Handlers only ever see messages of the types they declared: a message of another type, a
message that does not decode, or a protocol breach fails that call (``"bad_request"``), never the
node. A handler that raises fails only its call (``"handler_error"``, with the exception's type
name and message).

How a call can fail, from the caller's side:

* :class:`~swarmavg.errors.ConnectError`: the call could not be started (the peer cannot be
  reached); no request was sent, so it is safe to retry.
* :class:`~swarmavg.errors.RemoteError` with ``code``: ``"handler_error"``, ``"bad_request"``,
  ``"response_too_large"``, ``"no_response"``, or :class:`~swarmavg.errors.MethodNotFound`
  (``"unknown_method"``): the callee answered that the call failed; or ``"interrupted"``: the
  connection broke or the callee reset the stream mid-call (the peer died, closed or dropped
  us); the transport error is its ``__cause__``, and the handler may or may not have run.
* :class:`~swarmavg.errors.RPCTimeout` (also a :class:`TimeoutError`): past ``timeout``.
* :class:`~swarmavg.errors.MessageTooLarge`: a request does not fit in one message; raised
  locally, before it is sent.
* :class:`~swarmavg.errors.RemoteProtocolError`: the callee sent something that is not a valid
  answer.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import math
import struct
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from swarmavg._time import loop_time
from swarmavg.abc import Stream
from swarmavg.address import Address
from swarmavg.errors import (
    ConnectError,
    ConnectionLost,
    MessageTooLarge,
    MethodNotFound,
    RemoteError,
    RemoteProtocolError,
    RPCTimeout,
    StreamReset,
    SwarmError,
)
from swarmavg.identity import PeerID
from swarmavg.proto import (
    Buffer,
    Message,
    decode_message,
    encode_message,
    encode_message_bytes,
    encoded_size,
    message,
)
from swarmavg.proto.text import printable

if TYPE_CHECKING:
    from swarmavg.aio.node import Node

__all__ = [
    "RPC",
    "CallContext",
    "CallFailed",
    "CallHeader",
    "EndOfRequests",
    "PendingCall",
    "Prepared",
    "RPCKind",
    "StreamingCall",
]

logger = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
#: A test's rewriting of an outgoing message: ``(method, message, answer) -> message``, where
#: ``answer`` tells a handler's answer from a call's request (see RPC.rewrite).
Rewrite = Callable[[str, Message, bool], Message]

_MAX_METHOD_LEN = 128
_HEADER_TIMEOUT = 10.0  # a caller must send its header this soon after opening the stream
_FAIL_TIMEOUT = 5.0  # how long the callee tries to deliver a CallFailed
_MAX_FAILURE_TEXT = 2000
#: The transport errors that mean the other side of a call's stream is gone.
_GONE = (StreamReset, ConnectionLost, anyio.ClosedResourceError, anyio.BrokenResourceError)


class RPCKind(enum.Enum):
    """The shape of a call: how many messages go each way."""

    UNARY = "unary"  #: one request, one response
    SERVER_STREAM = "server_stream"  #: one request, any number of responses
    CLIENT_STREAM = "client_stream"  #: any number of requests, one response
    BIDI = "bidi"  #: any number each way, interleaved


class Prepared:
    """A request to send in several calls, encoded once (for the first call) instead of once
    per call: ``rpc.call(peer, method, Prepared(request))``. The request must not change while
    it is in use (like any message being sent; its arrays are sent from their memory)."""

    __slots__ = ("_limit", "_parts", "message")

    def __init__(self, message: Message) -> None:
        if not isinstance(message, Message):
            raise TypeError(f"Prepared takes a Message, not {type(message).__name__}")
        self.message = message
        self._parts: list[Buffer] = []
        self._limit = -1

    def encoded(self, max_size: int) -> list[Buffer]:
        """The message's buffers (see :func:`~swarmavg.proto.encode_message`).

        :raises MessageTooLarge: it does not fit in ``max_size`` bytes.
        """
        if max_size != self._limit:
            self._parts = encode_message(self.message, max_size=max_size)
            self._limit = max_size
        return self._parts

    def __repr__(self) -> str:
        return f"Prepared({self.message!r})"


@message("rpc.call")
@dataclass(frozen=True, slots=True)
class CallHeader(Message):
    """The first message of every call. ``timeout`` is the caller's budget in seconds, 0: none."""

    method: str
    kind: str
    timeout: float


@message("rpc.failed")
@dataclass(frozen=True, slots=True)
class CallFailed(Message):
    """The callee's answer when a call fails: ``code`` says why, ``message`` for humans."""

    code: str
    error_type: str
    message: str


@message("rpc.end")
@dataclass(frozen=True, slots=True)
class EndOfRequests(Message):
    """The caller of a client-stream or bidi call sends no more requests (see
    :meth:`StreamingCall.done_sending`)."""


#: Messages of the RPC protocol itself: never a request nor a response.
_CONTROL = (CallHeader, CallFailed, EndOfRequests)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call it serves."""

    peer_id: PeerID
    method: str
    #: ``anyio.current_time()`` by which the call must finish, or ``math.inf``.
    deadline: float


@dataclass(frozen=True, slots=True)
class _Method:
    name: str
    kind: RPCKind
    handler: Callable[..., Any]
    request_type: type[Message]
    inline: bool = False


class _fail_after:
    """``anyio.fail_after`` without its generator (a call's hot path enters two of these).
    The scope is not handed out, so only its deadline can cancel it."""

    __slots__ = ("_scope",)

    def __init__(self, seconds: float) -> None:
        self._scope = anyio.CancelScope(deadline=anyio.current_time() + seconds)

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        if self._scope.__exit__(*exc_info):  # it caught its own cancellation: the deadline
            raise TimeoutError


def _timeout_budget(timeout: float | None) -> float:
    if timeout is None:
        return math.inf
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or math.isnan(timeout)
        or timeout <= 0
    ):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return float(timeout)


async def _send_message(stream: Stream, msg: Message, *, last: bool = False) -> None:
    """Send ``msg`` (``last``: and EOF after it); :class:`MessageTooLarge` (before sending
    anything) if it does not fit."""
    parts = encode_message(msg, max_size=stream.max_message_size)
    if last:
        await stream.send_last(*parts)
    else:
        await stream.send(*parts)


async def _receive_message(stream: Stream) -> Message:
    """The next message; ``anyio.EndOfStream`` at the end; ``RemoteProtocolError`` on garbage."""
    data = await stream.receive()
    return decode_message(data, max_size=stream.max_message_size)


class StreamingCall(Generic[Req, Resp]):
    """The caller's side of a call in progress (see :meth:`RPC.open`).

    ``send`` requests, ``receive`` responses (or ``async for`` them), ``done_sending`` to tell
    the callee no more requests come. Every operation respects the call's deadline and raises
    :class:`~swarmavg.errors.RPCTimeout` past it; a :class:`CallFailed` answer raises
    :class:`~swarmavg.errors.RemoteError`; a broken connection or a reset stream raises
    :class:`~swarmavg.errors.RemoteError` with code ``"interrupted"``.
    """

    def __init__(
        self,
        stream: Stream,
        method: str,
        response_type: type[Resp] | None,
        deadline: float,
        timeout: float | None,
    ) -> None:
        self._stream = stream
        self._method = method
        self._response_type = response_type
        self._deadline = deadline
        self._timeout = timeout
        self._finished = False
        self._done_sending = False
        #: the request went in the opening with our EOF (see RPC._open_call)
        self._half_closed = False
        #: the caller enforces the deadline around the whole call (see RPC.call)
        self._scoped_outside = False
        #: a test's rewriting of what we send (see RPC.rewrite)
        self._rewrite: Rewrite | None = None

    def _scope(self) -> AbstractContextManager[object]:
        if self._scoped_outside or math.isinf(self._deadline):
            return _NO_SCOPE
        return _fail_after(self._deadline - anyio.current_time())

    async def _send_opening(self, header: CallHeader, first: Message | Prepared | None) -> None:
        """Send the opening message: ``u32 header size | CallHeader | [first request]``."""
        limit = self._stream.max_message_size
        head = _encode_header(header)
        parts: list[Buffer] = [head]
        if self._rewrite is not None and isinstance(first, Message):
            first = self._rewrite(self._method, first, False)
        if isinstance(first, Prepared):
            parts += first.encoded(limit)
        elif first is not None:
            parts += encode_message(first, max_size=limit)
        size = encoded_size(parts)
        if size > limit:
            raise MessageTooLarge(f"the request needs {size} bytes; the peer takes {limit}")
        try:
            with self._scope():
                if self._half_closed:
                    await self._stream.send_last(*parts)
                else:
                    await self._stream.send(*parts)
        except TimeoutError:
            raise self._timed_out() from None
        except (StreamReset, ConnectionLost) as exc:
            raise self._interrupted(exc) from exc

    async def _send(self, msg: Message) -> None:
        if self._rewrite is not None:
            msg = self._rewrite(self._method, msg, False)
        try:
            with self._scope():
                await _send_message(self._stream, msg)
        except TimeoutError:
            raise self._timed_out() from None
        except (StreamReset, ConnectionLost) as exc:
            raise self._interrupted(exc) from exc

    async def send(self, request: Message) -> None:
        """Send one request message.

        :raises MessageTooLarge: if it does not fit in one message of the transport (nothing
            is sent).
        :raises anyio.ClosedResourceError: after :meth:`done_sending`.
        """
        if self._done_sending:
            raise anyio.ClosedResourceError(f"call {self._method!r}: done_sending() was called")
        await self._send(request)

    async def done_sending(self) -> None:
        """Tell the callee that no more requests come. Idempotent.

        This does not end our direction of the stream: the callee keeps watching it, so that
        leaving the call still cancels the handler.
        """
        if not self._done_sending:
            self._done_sending = True
            await self._send(EndOfRequests())

    async def receive(self) -> Resp:
        """The next response.

        :raises StopAsyncIteration: when the callee has sent everything.
        :raises RemoteError: if the callee answered with a failure, or ``"interrupted"`` if
            the connection broke or the callee reset the stream.
        :raises RPCTimeout: past the deadline.
        :raises RemoteProtocolError: if the callee sent something that is not a valid response.
        """
        if self._finished:
            raise StopAsyncIteration
        try:
            with self._scope():
                msg = await _receive_message(self._stream)
        except anyio.EndOfStream:
            self._finished = True
            raise StopAsyncIteration from None
        except TimeoutError:
            raise self._timed_out() from None
        except (StreamReset, ConnectionLost) as exc:
            raise self._interrupted(exc) from exc
        if isinstance(msg, CallFailed):
            self._finished = True
        return _response(msg, self._method, self._response_type, self._timeout)

    def __aiter__(self) -> AsyncIterator[Resp]:
        return self

    async def __anext__(self) -> Resp:
        return await self.receive()

    def _timed_out(self) -> RPCTimeout:
        return _timed_out(self._method, self._timeout)

    def _interrupted(self, exc: Exception) -> RemoteError:
        return _interrupted(self._method, exc)


def _timed_out(method: str, timeout: float | None) -> RPCTimeout:
    return RPCTimeout(f"call {method!r} timed out after {timeout} s")


def _interrupted(method: str, exc: Exception) -> RemoteError:
    return RemoteError(
        f"call {method!r} was interrupted: {str(exc) or type(exc).__name__}", code="interrupted"
    )


def _response(
    msg: Message, method: str, response_type: type[Resp] | None, timeout: float | None
) -> Resp:
    """The response that ``msg`` is; raise what a failure answer or a wrong message means."""
    if isinstance(msg, CallFailed):
        if msg.code == "timeout":  # the callee's clock ran out before ours
            raise _timed_out(method, timeout)
        cls = MethodNotFound if msg.code == "unknown_method" else RemoteError
        # (the callee's words: they go into our exceptions and logs)
        raise cls(
            printable(msg.message),
            code=printable(msg.code, 40),
            remote_type=printable(msg.error_type, 80),
        )
    if isinstance(msg, _CONTROL):
        raise RemoteProtocolError(f"call {method!r} got a {type(msg).__name__} response")
    if response_type is not None and not isinstance(msg, response_type):
        raise RemoteProtocolError(
            f"call {method!r} expected a {response_type.__name__} response, "
            f"got {type(msg).__name__}"
        )
    return msg  # type: ignore[return-value]


class PendingCall(Generic[Resp]):
    """A unary call whose request is on its way (:meth:`RPC.start_call`); whoever holds it
    reads the answer when it is here, without a task of its own: :meth:`poll` when
    :meth:`on_ready` calls back (or :meth:`wait` where the transport cannot call back), then
    :meth:`result`, then :meth:`aclose`. A DHT lookup reads all of its queries' answers so,
    in one task.
    """

    __slots__ = (
        "_closed",
        "_error",
        "_method",
        "_response",
        "_response_type",
        "_stream",
        "_timeout",
        "deadline",
        "settled",
    )

    def __init__(
        self,
        stream: Stream,
        method: str,
        response_type: type[Resp] | None,
        deadline: float,
        timeout: float | None,
    ) -> None:
        self._stream = stream
        self._method = method
        self._response_type = response_type
        self._timeout = timeout
        #: when the call times out (``anyio.current_time()`` clock; ``inf`` without a timeout)
        self.deadline = deadline
        #: whether the call is over: answered, or failed (see :meth:`result`)
        self.settled = False
        self._response: Resp | None = None
        self._error: Exception | None = None
        self._closed = False

    def poll(self) -> bool:
        """Read the answer if it is here (without waiting); whether the call is over."""
        if self.settled:
            return True
        stream = self._stream
        try:
            data = stream.receive_nowait()
        except anyio.WouldBlock:
            return False
        except Exception as exc:
            self._fail(exc)
            return True
        self._settle(data)
        return True

    def on_ready(self, callback: Callable[[], object]) -> bool:
        """Call ``callback()`` once when :meth:`poll` may settle the call (possibly early, or
        at once); ``False`` if the transport cannot (then :meth:`wait`). See
        :meth:`Stream.on_readable <swarmavg.abc.Stream.on_readable>`."""
        return self._stream.on_readable(callback)

    async def wait(self) -> None:
        """Wait for the answer, until the deadline (then the call has timed out)."""
        if self.settled:
            return
        try:
            with _fail_after(self.deadline - anyio.current_time()):
                data = await self._stream.receive()
        except TimeoutError:
            self.expire()
        except Exception as exc:
            self._fail(exc)
        else:
            self._settle(data)

    def expire(self) -> None:
        """Give up waiting: the call has timed out (if it is not over)."""
        if not self.settled:
            self.settled = True
            self._error = _timed_out(self._method, self._timeout)

    def result(self) -> Resp:
        """The response of a settled call.

        :raises RemoteError: a failure answer, or ``"no_response"`` / ``"interrupted"``.
        :raises RPCTimeout: the call timed out.
        :raises RemoteProtocolError: the callee sent something that is not a valid response.
        """
        if not self.settled:
            raise RuntimeError(f"call {self._method!r} is not over yet")
        if self._error is not None:
            raise self._error
        return self._response  # type: ignore[return-value]

    async def aclose(self) -> None:
        """Leave the call: close its stream if it was answered, reset it otherwise (the
        callee's handler is then cancelled). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.settled and self._error is None:
            await self._stream.aclose()
        else:
            with anyio.CancelScope(shield=True):
                await self._stream.abort()

    def _settle(self, data: memoryview) -> None:
        self.settled = True
        try:
            msg = decode_message(data, max_size=self._stream.max_message_size)
            self._response = _response(msg, self._method, self._response_type, self._timeout)
        except SwarmError as exc:
            self._error = exc

    def _fail(self, exc: Exception) -> None:
        self.settled = True
        if isinstance(exc, anyio.EndOfStream):
            self._error = RemoteError(
                f"call {self._method!r} ended without a response", code="no_response"
            )
        elif isinstance(exc, _GONE):
            self._error = _interrupted(self._method, exc)
        else:
            self._error = exc


class RPC:
    """The RPC layer of a :class:`~swarmavg.aio.node.Node` (``node.rpc``).

    :param node: the node whose streams carry the calls.
    :param max_concurrent_calls_per_peer: calls one peer may have running on this node at once;
        more wait for a free slot (within their deadline). Other peers are not affected.
    """

    def __init__(self, node: Node, *, max_concurrent_calls_per_peer: int = 64) -> None:
        if (
            isinstance(max_concurrent_calls_per_peer, bool)
            or not isinstance(max_concurrent_calls_per_peer, int)
            or max_concurrent_calls_per_peer < 1
        ):
            raise ValueError(
                "max_concurrent_calls_per_peer must be an int >= 1, "
                f"not {max_concurrent_calls_per_peer!r}"
            )
        self._node = node
        self._methods: dict[str, _Method] = {}
        self._per_peer = max_concurrent_calls_per_peer
        self._slots: dict[PeerID, _Slots] = {}
        #: every message this node sends (its calls' requests, its handlers' answers) passes
        #: through ``rewrite(method, message, answer)`` first: a test's dishonest peer
        #: (:class:`swarmavg.testing.Adversary`); ``None``, the default, sends them as they are.
        #: (Requests already encoded, :class:`Prepared`, are sent as they are.)
        self.rewrite: Rewrite | None = None

    # -- registration --------------------------------------------------------------------------

    def register(
        self,
        name: str,
        handler: Callable[..., Any],
        *,
        kind: RPCKind | str = RPCKind.UNARY,
        request_type: type[Message] = Message,
        inline: bool = False,
    ) -> None:
        """Serve ``name`` with ``handler``.

        Handler shapes, by ``kind``::

            UNARY          async def h(request, ctx) -> Message
            SERVER_STREAM  async def h(request, ctx) -> AsyncIterator[Message]  (async generator)
            CLIENT_STREAM  async def h(requests: AsyncIterator, ctx) -> Message
            BIDI           async def h(requests: AsyncIterator, ctx) -> AsyncIterator[Message]

        ``ctx`` is the :class:`CallContext`. The handler is cancelled when the caller goes
        away or the call's deadline passes; an exception it raises fails only its call, and the
        caller gets it as :class:`~swarmavg.errors.RemoteError` (code ``"handler_error"``).

        ``inline=True`` (unary only): the handler is a plain function,
        ``def h(request, ctx) -> Message``, that does not wait for anything. Where the
        transport allows (:meth:`~swarmavg.abc.Connection.serve_inline`; TCP does), the call is
        then answered from the transport's reader as soon as it arrives, without a task: a
        third less CPU per call on the callee. Such a handler cannot be cancelled, so it must
        be quick; ``ctx.deadline`` still tells how long the caller waits.

        :param request_type: the message type requests must have; others fail the call with
            code ``"bad_request"`` before the handler sees them.
        :raises ValueError: if ``name`` is not a non-empty str of at most 128 characters or is
            already registered, or ``kind`` is not an :class:`RPCKind`.
        :raises TypeError: if ``handler`` is not callable or ``request_type`` is not a
            :class:`~swarmavg.proto.Message` subclass.
        """
        if not isinstance(name, str) or not name or len(name) > _MAX_METHOD_LEN:
            raise ValueError(
                f"method name must be a non-empty str of <= {_MAX_METHOD_LEN} chars: {name!r}"
            )
        if name in self._methods:
            raise ValueError(f"method {name!r} is already registered")
        if not callable(handler):
            raise TypeError(f"handler for {name!r} must be callable")
        if not (isinstance(request_type, type) and issubclass(request_type, Message)):
            raise TypeError(f"request_type must be a Message subclass, not {request_type!r}")
        kind = RPCKind(kind)
        if inline and kind is not RPCKind.UNARY:
            raise ValueError(f"only a unary method can be inline; {name!r} is {kind.value}")
        if inline and (inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler)):
            raise TypeError(f"the inline handler of {name!r} must be a plain function, not async")
        self._methods[name] = _Method(name, kind, handler, request_type, bool(inline))

    def unregister(self, name: str) -> None:
        """Stop serving ``name`` (calls in progress finish)."""
        self._methods.pop(name, None)

    # -- calling -------------------------------------------------------------------------------

    @asynccontextmanager
    async def open(
        self,
        peer: PeerID | Address | str,
        method: str,
        *,
        kind: RPCKind | str = RPCKind.BIDI,
        response_type: type[Resp] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[StreamingCall[Message, Resp]]:
        """Open a call and yield its :class:`StreamingCall`; the general form of every call.

        ``peer`` is an address to dial (an open connection to that peer is reused), or the
        :class:`~swarmavg.identity.PeerID` of a peer this node is connected to.

        Leaving the block closes the call: the callee's handler is cancelled if it has not
        finished. Leaving it with an exception (or cancellation) resets the stream.

        :raises ConnectError: if the peer cannot be reached (nothing was sent).
        :raises RPCTimeout: if the call cannot even be opened within ``timeout``.
        :raises ValueError: if ``timeout`` is not a positive number of seconds or ``None``.
        """
        async with self._open_call(peer, method, kind, response_type, timeout, None) as call:
            yield call

    @asynccontextmanager
    async def _open_call(
        self,
        peer: PeerID | Address | str,
        method: str,
        kind: RPCKind | str,
        response_type: type[Resp] | None,
        timeout: float | None,
        first: Message | Prepared | None,
    ) -> AsyncIterator[StreamingCall[Message, Resp]]:
        """:meth:`open`, sending ``first`` (the request of a unary or server-stream call) in
        the opening message, with the header: one message, one write, one read."""
        call = await self._start_call(peer, method, kind, response_type, timeout, first)
        try:
            yield call
        except BaseException:
            await _abort_call(call)
            raise
        await _end_call(call)

    async def _start_call(
        self,
        peer: PeerID | Address | str,
        method: str,
        kind: RPCKind | str,
        response_type: type[Resp] | None,
        timeout: float | None,
        first: Message | Prepared | None,
        *,
        scoped_outside: bool = False,
    ) -> StreamingCall[Message, Resp]:
        """Open the stream of a call and send its opening; on failure, nothing is left open.

        ``scoped_outside``: the caller runs the whole call in one scope with its deadline, so
        the steps need none of their own.
        """
        budget = _timeout_budget(timeout)
        deadline = anyio.current_time() + budget
        kind = RPCKind(kind)
        try:
            if math.isinf(budget) or scoped_outside:
                stream = await self._open_stream(peer)
            else:
                with _fail_after(budget):
                    stream = await self._open_stream(peer)
        except TimeoutError:
            raise RPCTimeout(f"opening call {method!r} timed out after {timeout} s") from None
        call: StreamingCall[Message, Resp] = StreamingCall(
            stream, method, response_type, deadline, timeout
        )
        call._scoped_outside = scoped_outside
        call._rewrite = self.rewrite
        try:
            # the budget left once connected; positive (0 means "none"): if it is all spent,
            # sending the header times out right away
            left = max(deadline - anyio.current_time(), 1e-9) if math.isfinite(budget) else 0.0
            if first is not None and _watchable(stream):
                # The whole request is in the opening: end our direction with it (one write).
                # The callee needs nothing more from us, and the transport tells it if we
                # leave (abort resets the stream), so cancelling still reaches the handler;
                # closing after the answer then costs no write at all.
                call._half_closed = call._done_sending = True
            await call._send_opening(CallHeader(method, kind.value, left), first)
        except BaseException:
            await _abort_call(call)
            raise
        return call

    async def call(
        self,
        peer: PeerID | Address | str,
        method: str,
        request: Message | Prepared,
        *,
        response_type: type[Resp] | None = None,
        timeout: float | None = None,
    ) -> Resp:
        """A unary call: send ``request``, return the response. A request sent to several
        peers can be wrapped in :class:`Prepared` to be encoded once.

        :raises RemoteError: if the handler raised or the call was refused (see ``code``), or
            with code ``"interrupted"`` if the connection broke or the callee reset the stream.
        :raises MethodNotFound: if the peer serves no such method.
        :raises RPCTimeout: if no answer came within ``timeout`` seconds; the remote handler
            is cancelled.
        :raises MessageTooLarge: if ``request`` is too large for one message (nothing is sent).
        :raises ConnectError: if the peer cannot be reached.
        """
        if timeout is None:
            return await self._unary(peer, method, request, response_type, None)
        try:
            with _fail_after(_timeout_budget(timeout)):  # one scope for the whole call
                return await self._unary(peer, method, request, response_type, timeout)
        except TimeoutError:
            raise RPCTimeout(f"call {method!r} timed out after {timeout} s") from None

    async def start_call(
        self,
        peer: PeerID | Address | str,
        method: str,
        request: Message | Prepared,
        *,
        response_type: type[Resp] | None = None,
        timeout: float | None = None,
        bounded: bool = True,
    ) -> PendingCall[Resp]:
        """Send a unary call's request and return at once: its answer is read later, by the
        caller, from the :class:`PendingCall` (which the caller must ``aclose``). ``timeout``
        bounds the whole call; ``bounded=False``: the caller bounds the sending itself (one
        scope around several starts), only the wait for the answer is bounded here.

        :raises RPCTimeout: sending took longer than ``timeout``.
        :raises MessageTooLarge: ``request`` is too large for one message (nothing is sent).
        :raises ConnectError: the peer cannot be reached.
        """
        budget = _timeout_budget(timeout)
        finite = math.isfinite(budget)
        deadline = anyio.current_time() + budget
        try:
            with _fail_after(budget) if bounded and finite else _NO_SCOPE:
                stream = await self._open_stream(peer)
                if self.rewrite is not None and isinstance(request, Message):
                    request = self.rewrite(method, request, False)
                try:
                    await self._send_request(stream, method, request, deadline, finite)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await stream.abort()
                    raise
        except TimeoutError:
            raise RPCTimeout(f"call {method!r} timed out after {timeout} s") from None
        except (StreamReset, ConnectionLost) as exc:
            raise _interrupted(method, exc) from exc
        return PendingCall(stream, method, response_type, deadline, timeout)

    @staticmethod
    async def _send_request(
        stream: Stream, method: str, request: Message | Prepared, deadline: float, finite: bool
    ) -> None:
        """A unary call's opening (what :meth:`StreamingCall._send_opening` sends for it),
        with our EOF where the transport tells the callee that we left (see
        :meth:`_start_call`)."""
        limit = stream.max_message_size
        # the budget left once connected; positive (0 means "none")
        left = max(deadline - anyio.current_time(), 1e-9) if finite else 0.0
        parts: list[Buffer] = [_encode_header(CallHeader(method, "unary", left))]
        if isinstance(request, Prepared):
            parts += request.encoded(limit)
        else:
            parts += encode_message(request, max_size=limit)
        size = encoded_size(parts)
        if size > limit:
            raise MessageTooLarge(f"the request needs {size} bytes; the peer takes {limit}")
        if _watchable(stream):
            await stream.send_last(*parts)
        else:
            await stream.send(*parts)

    async def _unary(
        self,
        peer: PeerID | Address | str,
        method: str,
        request: Message | Prepared,
        response_type: type[Resp] | None,
        timeout: float | None,
    ) -> Resp:
        # what ``async with self._open_call(...)`` does, without a generator: it is the most
        # frequent call
        call = await self._start_call(
            peer,
            method,
            RPCKind.UNARY,
            response_type,
            timeout,
            request,
            scoped_outside=timeout is not None,
        )
        try:
            response = await call.receive()
        except StopAsyncIteration:
            await _abort_call(call)
            raise RemoteError(
                f"call {method!r} ended without a response", code="no_response"
            ) from None
        except BaseException:
            await _abort_call(call)
            raise
        await _end_call(call)
        return response

    @asynccontextmanager
    async def server_stream(
        self,
        peer: PeerID | Address | str,
        method: str,
        request: Message | Prepared,
        *,
        response_type: type[Resp] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncIterator[Resp]]:
        """Send one request and iterate over the responses::

            async with node.rpc.server_stream(peer, "chunks", Req()) as responses:
                async for chunk in responses: ...

        Leaving the block before the last response cancels the remote handler. Raises as
        :meth:`call` does.
        """
        async with self._open_call(
            peer, method, RPCKind.SERVER_STREAM, response_type, timeout, request
        ) as call:
            yield call

    async def client_stream(
        self,
        peer: PeerID | Address | str,
        method: str,
        requests: AsyncIterable[Message] | Iterable[Message],
        *,
        response_type: type[Resp] | None = None,
        timeout: float | None = None,
    ) -> Resp:
        """Send every message of ``requests``, then return the single response.

        Raises as :meth:`call` does.
        """
        async with self.open(
            peer, method, kind=RPCKind.CLIENT_STREAM, response_type=response_type, timeout=timeout
        ) as call:
            if isinstance(requests, AsyncIterable):
                async for request in requests:
                    await call.send(request)
            else:
                for request in requests:
                    await call.send(request)
            await call.done_sending()
            try:
                return await call.receive()
            except StopAsyncIteration:
                raise RemoteError(
                    f"call {method!r} ended without a response", code="no_response"
                ) from None

    async def _open_stream(self, peer: PeerID | Address | str) -> Stream:
        if isinstance(peer, PeerID):
            conn = self._node.connection_to(peer)
            if conn is None:
                raise ConnectError(f"not connected to {peer} and no address is known for it")
            try:
                return await conn.open_stream()
            except ConnectionLost as exc:
                raise ConnectError(f"the connection to {peer} is gone: {exc}") from exc
        try:
            return await self._node.open_stream(peer)
        except ConnectionLost as exc:
            raise ConnectError(f"the connection to {peer} is gone: {exc}") from exc

    # -- serving -------------------------------------------------------------------------------

    async def serve_stream(self, stream: Stream, peer_id: PeerID) -> None:
        """Serve one incoming call (the node's stream handler).

        A stream that does not start with a valid :class:`CallHeader` is aborted; every other
        failure is answered with a :class:`CallFailed`.
        """
        try:
            try:
                opening = stream.receive_nowait()  # (our callers' opening comes whole, at once)
            except anyio.WouldBlock:
                with _fail_after(_HEADER_TIMEOUT):
                    opening = await stream.receive()
            header, rest = _decode_opening(opening, stream.max_message_size)
        except (TimeoutError, anyio.EndOfStream, RemoteProtocolError, *_GONE) as exc:
            logger.debug("dropping a stream from %s without a valid call header: %r", peer_id, exc)
            await stream.abort()
            return
        first: Message | None = None
        if rest:
            try:
                first = decode_message(rest, max_size=stream.max_message_size)
            except RemoteProtocolError as exc:
                await self._fail(stream, "bad_request", "", f"undecodable request: {exc}")
                return
        method = self._methods.get(header.method)
        if method is None:
            await self._fail(stream, "unknown_method", "", f"no method {header.method!r} here")
            return
        if header.kind != method.kind.value:
            await self._fail(
                stream,
                "bad_request",
                "",
                f"{header.method!r} is a {method.kind.value} method, called as {header.kind}",
            )
            return
        if not (math.isfinite(header.timeout) and header.timeout >= 0):
            await self._fail(stream, "bad_request", "", f"invalid timeout {header.timeout!r}")
            return
        budget = header.timeout or math.inf
        ctx = CallContext(peer_id, method.name, anyio.current_time() + budget)
        failure: CallFailed | None = None
        slots = self._slots.get(peer_id)
        if slots is None:
            slots = self._slots[peer_id] = _Slots(self._per_peer)
        slots.users += 1
        # One scope for the call: its deadline, and (see _run) the caller leaving.
        call = _Served(anyio.CancelScope(deadline=ctx.deadline))
        try:
            with call.scope:
                await slots.acquire()
                try:
                    failure = await self._run(method, stream, ctx, first, call)
                finally:
                    slots.release()
            if call.scope.cancelled_caught:
                if call.caller_left:  # nobody to tell
                    logger.debug("call %r from %s: the caller left", ctx.method, ctx.peer_id)
                    return
                failure = CallFailed("timeout", "", f"deadline of {header.timeout} s exceeded")
        finally:
            slots.users -= 1
            if not slots.users:
                del self._slots[peer_id]
        if failure is not None:
            await self._fail(stream, failure.code, failure.error_type, failure.message)

    def serve_inline(self, stream: Stream, peer_id: PeerID, opening: memoryview) -> bool:
        """Answer a call at once, from the transport's reader, if it is a well-formed call of
        an inline method (see :meth:`register`); whether it did (the node's
        :meth:`~swarmavg.abc.Connection.serve_inline` handler). Anything else, including
        every malformed call, is left to :meth:`serve_stream`, which answers it as usual.
        """
        try:
            header, rest = _decode_opening(opening, stream.max_message_size)
        except RemoteProtocolError:
            return False
        method = self._methods.get(header.method)
        timeout = header.timeout
        if (
            method is None
            or self.rewrite is not None  # (the answer goes through _respond, rewritten)
            or not method.inline
            or header.kind != "unary"
            or not rest
            or not (math.isfinite(timeout) and timeout >= 0)
        ):
            return False
        try:
            msg = decode_message(rest, max_size=stream.max_message_size)
            request = self._check_request(method, msg)
        except (RemoteProtocolError, _BadRequest):
            return False
        # From here on the call is ours: every outcome is answered. (This runs in the
        # transport's reader, an event-loop callback: no anyio call may be made here, see
        # loop_time.)
        ctx = CallContext(peer_id, method.name, loop_time() + (timeout or math.inf))
        try:
            response = _inline_answer(method, request, ctx)
            if not isinstance(response, Message):
                raise TypeError(
                    f"handler of {method.name!r} returned {type(response).__name__}, not a Message"
                )
            parts = encode_message(response, max_size=stream.max_message_size)
        except MessageTooLarge as exc:
            parts = _failure_parts(stream, "response_too_large", "MessageTooLarge", str(exc))
        except Exception as exc:
            _log_handler_failure(method.name, peer_id, exc)
            parts = _failure_parts(stream, "handler_error", type(exc).__name__, str(exc))
        if not stream.send_last_nowait(*parts):
            with contextlib.suppress(RuntimeError):  # (the node is closing: so is the connection)
                self._node.spawn(_answer_later, stream, parts, name=f"answer {method.name}")
        return True

    async def _run(
        self,
        method: _Method,
        stream: Stream,
        ctx: CallContext,
        first: Message | None,
        call: _Served,
    ) -> CallFailed | None:
        """Run the handler of one call and send its responses; return the failure to report.

        Returns ``None`` when the call succeeded or the caller went away (nobody to tell).
        """
        failures: list[CallFailed] = []  # the first one is reported

        def fail(code: str, error_type: str, text: str) -> None:
            if not failures:
                failures.append(CallFailed(code, error_type, text))

        streaming = method.kind in (RPCKind.CLIENT_STREAM, RPCKind.BIDI)
        request: Message | None = None
        if not streaming:
            try:
                if first is not None:
                    request = self._check_request(method, first)
                else:
                    request = await self._receive_request(stream, method)
            except _BadRequest as exc:
                return CallFailed("bad_request", "", str(exc))
            except _GONE:
                return None
        if not streaming and first is not None:
            # The request came in the opening (as our callers send it); the caller sends
            # nothing more but its close. Where the transport tells us when the caller abandons
            # the stream, the handler runs right here, without a task reading the caller's side
            # (which costs a third of a small call): anything more the caller sends is not read,
            # and dropped with the stream.
            finished = False

            def abandoned() -> None:
                if not finished:
                    call.caller_left = True
                    call.scope.cancel()

            if stream.on_abandoned(abandoned):
                try:
                    await self._invoke_guarded(method, stream, ctx, request, fail)
                finally:
                    finished = True
                return failures[0] if failures else None
        send_requests: MemoryObjectSendStream[Message] | None = None
        receive_requests: MemoryObjectReceiveStream[Message] | None = None
        if streaming:
            send_requests, receive_requests = anyio.create_memory_object_stream[Message](0)
        try:
            async with anyio.create_task_group() as tg:
                scope = tg.cancel_scope
                reader_done = anyio.Event()
                handler_done = anyio.Event()  # answered: the reader just waits for the caller
                tg.start_soon(
                    self._read_caller,
                    stream,
                    method,
                    send_requests,
                    fail,
                    scope,
                    reader_done,
                    first if streaming else None,
                    handler_done,
                )
                try:
                    arg = receive_requests if streaming else request
                    if await self._invoke_guarded(method, stream, ctx, arg, fail):
                        handler_done.set()
                        # Answered: let the reader see the caller leave on its own (cheaper
                        # than cancelling it), within a bound: the group's own scope (one
                        # scope less than move_on_after).
                        scope.deadline = min(scope.deadline, anyio.current_time() + _LINGER)
                        await reader_done.wait()
                finally:
                    if not reader_done.is_set():
                        tg.cancel_scope.cancel()  # stop reading the caller's side
        finally:
            if send_requests is not None and receive_requests is not None:
                send_requests.close()
                receive_requests.close()
        return failures[0] if failures else None

    async def _invoke_guarded(
        self,
        method: _Method,
        stream: Stream,
        ctx: CallContext,
        arg: object,
        fail: Callable[[str, str, str], None],
    ) -> bool:
        """:meth:`_invoke`, then our EOF where responses are streamed (the one response of a
        unary or client-stream call carries it). Failures go to ``fail``; returns whether the
        call was answered in full."""
        try:
            await self._invoke(method, stream, ctx, arg)
            if method.kind in (RPCKind.SERVER_STREAM, RPCKind.BIDI):
                await stream.send_eof()
            return True
        except _CallerGone as exc:
            logger.debug("call %r from %s: the caller left: %s", ctx.method, ctx.peer_id, exc)
        except _ResponseTooLarge as exc:
            fail("response_too_large", "MessageTooLarge", str(exc))
        except Exception as exc:
            _log_handler_failure(ctx.method, ctx.peer_id, exc)
            fail("handler_error", type(exc).__name__, str(exc))
        return False

    async def _invoke(self, method: _Method, stream: Stream, ctx: CallContext, arg: object) -> None:
        """Call the handler and send its response(s)."""
        if method.inline:
            await self._respond(stream, method, _inline_answer(method, arg, ctx), last=True)
            return
        if method.kind in (RPCKind.UNARY, RPCKind.CLIENT_STREAM):
            # the one response and our EOF: one write where the transport can
            await self._respond(stream, method, await method.handler(arg, ctx), last=True)
            return
        responses = method.handler(arg, ctx)
        if not isinstance(responses, AsyncIterator):
            if inspect.iscoroutine(responses):
                responses.close()  # never awaited: close it to avoid the warning
            raise TypeError(
                f"handler of the {method.kind.value} method {method.name!r} must return an async "
                f"iterator (be an async generator function), not {type(responses).__name__}"
            )
        try:
            async for response in responses:
                await self._respond(stream, method, response)
        finally:
            # run the generator's cleanup now, not whenever it is garbage-collected
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _read_caller(
        self,
        stream: Stream,
        method: _Method,
        requests: MemoryObjectSendStream[Message] | None,
        fail: Callable[[str, str, str], None],
        scope: anyio.CancelScope,
        done: anyio.Event,
        first: Message | None,
        finished: anyio.Event,
    ) -> None:
        """Read the caller's side of the stream until the call ends, then cancel ``scope``.

        For client-stream and bidi calls, hand the requests on through ``requests`` (closed at
        :class:`EndOfRequests`). After that, and for the whole of a unary or server-stream call
        (whose request was read already), the caller sends nothing but maybe an
        ``EndOfRequests``: anything else is a protocol breach. EOF or a reset means the caller
        went away.
        """
        try:
            if requests is not None:
                async with requests:  # closing it ends the handler's iteration
                    if first is not None:
                        await requests.send(self._check_request(method, first))
                    while not isinstance(msg := await _receive_message(stream), EndOfRequests):
                        await requests.send(self._check_request(method, msg))
            end_seen = requests is not None
            while True:
                msg = await _receive_message(stream)
                if isinstance(msg, EndOfRequests) and not end_seen:
                    end_seen = True
                    continue
                raise _BadRequest(f"unexpected {type(msg).__name__} after the request(s)")
        except _BadRequest as exc:
            fail("bad_request", "", str(exc))
        except RemoteProtocolError as exc:
            fail("bad_request", "", f"undecodable request: {exc}")
        except (anyio.EndOfStream, *_GONE):
            pass  # the caller left, or the handler has finished and stopped taking requests
        if not finished.is_set():
            scope.cancel()  # the handler is still at work: stop it (cancelling costs, so only then)
        done.set()

    async def _receive_request(self, stream: Stream, method: _Method) -> Message:
        try:
            msg = await _receive_message(stream)
        except anyio.EndOfStream:
            raise _BadRequest("the call carried no request") from None
        except RemoteProtocolError as exc:
            raise _BadRequest(f"undecodable request: {exc}") from None
        if isinstance(msg, EndOfRequests):
            raise _BadRequest("the call carried no request")
        return self._check_request(method, msg)

    @staticmethod
    def _check_request(method: _Method, msg: Message) -> Message:
        if isinstance(msg, _CONTROL) or not isinstance(msg, method.request_type):
            raise _BadRequest(
                f"{method.name!r} takes {method.request_type.__name__}, not {type(msg).__name__}"
            )
        return msg

    async def _respond(
        self, stream: Stream, method: _Method, response: object, *, last: bool = False
    ) -> None:
        if not isinstance(response, Message):
            raise TypeError(
                f"handler of {method.name!r} returned {type(response).__name__}, not a Message"
            )
        if self.rewrite is not None:
            response = self.rewrite(method.name, response, True)
        try:
            await _send_message(stream, response, last=last)
        except MessageTooLarge as exc:
            raise _ResponseTooLarge(str(exc)) from exc
        except _GONE as exc:
            raise _CallerGone(str(exc) or type(exc).__name__) from exc

    async def _fail(self, stream: Stream, code: str, error_type: str, text: str) -> None:
        """Tell the caller that the call failed (best effort, bounded in time)."""
        with anyio.move_on_after(_FAIL_TIMEOUT, shield=True):
            for limit in (_MAX_FAILURE_TEXT, 0):  # without the text if it is too large
                try:
                    await _send_message(
                        stream, CallFailed(code, error_type, text[:limit]), last=True
                    )
                except MessageTooLarge:
                    continue
                except (SwarmError, *_GONE):
                    pass
                return


#: What a handler raises when the request cannot be served (a bad or stale request, a peer
#: that went away, a deadline): the caller is told (``"handler_error"``), and it is logged at
#: DEBUG only, since a remote peer can make it happen at will. Any other exception type is a
#: bug of the handler, logged at ERROR with its traceback (docs/design/errors-and-logging.md,
#: "Logging").
_REQUEST_FAILURES: Final = (ValueError, SwarmError, TimeoutError, *_GONE, anyio.EndOfStream)


def _log_handler_failure(method: str, peer: PeerID, exc: Exception) -> None:
    if isinstance(exc, _REQUEST_FAILURES):
        logger.debug("handler of %r failed for %s: %r", method, peer, exc)
    else:
        logger.error("handler of %r failed for %s: %r", method, peer, exc, exc_info=exc)


def _inline_answer(method: _Method, request: object, ctx: CallContext) -> object:
    """Call an inline handler: its response (a coroutine is refused, not awaited)."""
    response = method.handler(request, ctx)
    if inspect.isawaitable(response):
        if inspect.iscoroutine(response):
            response.close()  # never awaited: close it to avoid the warning
        raise TypeError(f"the inline handler of {method.name!r} returned an awaitable")
    return response


def _failure_parts(stream: Stream, code: str, error_type: str, text: str) -> list[Buffer]:
    """A CallFailed answer, encoded (without the text if it would not fit)."""
    try:
        return encode_message(
            CallFailed(code, error_type, text[:_MAX_FAILURE_TEXT]),
            max_size=stream.max_message_size,
        )
    except MessageTooLarge:
        return encode_message(CallFailed(code, error_type, ""), max_size=stream.max_message_size)


async def _answer_later(stream: Stream, parts: list[Buffer]) -> None:
    """Send an inline call's answer that could not go out at once (no credit, or another
    writer busy), then close the stream; bounded like any failure report."""
    with anyio.move_on_after(_FAIL_TIMEOUT):
        try:
            await stream.send_last(*parts)
        except (SwarmError, *_GONE):
            pass
    with anyio.CancelScope(shield=True):
        await stream.aclose()


async def _abort_call(call: StreamingCall[Any, Any]) -> None:
    """Leave a call that failed or was cancelled: reset its stream."""
    with anyio.CancelScope(shield=True):
        await call._stream.abort()


async def _end_call(call: StreamingCall[Any, Any]) -> None:
    """Leave a call normally: close its stream."""
    await call._stream.aclose()
    if not call._half_closed:
        # Let the close go out now, in a write of its own, rather than with the opening of the
        # caller's next call: the callee then tears this call down while we prepare the next
        # one, not on that call's critical path.
        await anyio.lowlevel.checkpoint()


def _watchable(stream: Stream) -> bool:
    """Whether the stream's transport implements :meth:`Stream.on_abandoned` (both ends of a
    call use the same transport, so this tells the caller what the callee can do)."""
    return type(stream).on_abandoned is not Stream.on_abandoned


_NO_SCOPE: Final = nullcontext()
#: The opening message of a call starts with the size of its CallHeader.
_OPENING_PREFIX: Final = struct.Struct("!I")


def _decode_opening(data: memoryview, max_size: int) -> tuple[CallHeader, memoryview]:
    """Split a call's opening message into its header and the request it may carry (raw).

    :raises RemoteProtocolError: if it is not ``u32 size | CallHeader | [request]``.
    """
    if len(data) < _OPENING_PREFIX.size:
        raise RemoteProtocolError("truncated call opening")
    (size,) = _OPENING_PREFIX.unpack_from(data)
    end = _OPENING_PREFIX.size + size
    if end > len(data):
        raise RemoteProtocolError("call header overruns the opening message")
    raw = bytes(data[_OPENING_PREFIX.size : end])
    # A header's encoding ends with its timeout, a msgpack float64 (see _encode_header): the
    # bytes before it are the same for every call of a method, and are decoded once.
    template = _HEADERS.get(raw[:-_FLOAT_SIZE]) if raw[-_FLOAT_SIZE:-8] == _FLOAT64 else None
    if template is not None:
        (timeout,) = _FLOAT.unpack_from(raw, len(raw) - 8)
        return CallHeader(template.method, template.kind, timeout), data[end:]
    decoded = decode_message(raw, max_size=max_size)
    if not isinstance(decoded, CallHeader):
        raise RemoteProtocolError(f"a call must open with a header, not {type(decoded).__name__}")
    if raw[-_FLOAT_SIZE:-8] == _FLOAT64:  # (a valid header always ends so; others: no cache)
        if len(_HEADERS) >= _MAX_CACHED_HEADERS:
            _HEADERS.pop(next(iter(_HEADERS)))
        _HEADERS[raw[:-_FLOAT_SIZE]] = decoded
    return decoded, data[end:]


@lru_cache(maxsize=256)
def _header_template(method: str, kind: str) -> bytes:
    """``u32 size | CallHeader(method, kind, 0.0)`` without the timeout's 8 bytes at its end."""
    head = encode_message_bytes(CallHeader(method, kind, 0.0))
    encoded = _OPENING_PREFIX.pack(len(head)) + head
    if encoded[-_FLOAT_SIZE:-8] != _FLOAT64:  # the codec changed: the fast path is wrong
        raise AssertionError("a CallHeader must end with its timeout as a msgpack float64")
    return encoded[:-8]


def _encode_header(header: CallHeader) -> bytes:
    """``u32 size | CallHeader``: a method's cached bytes with the timeout appended."""
    return _header_template(header.method, header.kind) + _FLOAT.pack(header.timeout)


#: A msgpack float64: its type byte, then the value big-endian.
_FLOAT64: Final = b"\xcb"
_FLOAT: Final = struct.Struct("!d")
_FLOAT_SIZE: Final = 1 + _FLOAT.size
#: Decoded headers by their encoding less the timeout (the oldest dropped first).
_HEADERS: dict[bytes, CallHeader] = {}
_MAX_CACHED_HEADERS: Final = 256


#: After answering, how long a callee waits for the caller to close the call before it stops
#: watching (a caller closes at once; this only bounds a misbehaving one).
_LINGER: Final = 10.0


class _Slots:
    """Per-peer call slots: a FIFO semaphore that does not yield when a slot is free."""

    __slots__ = ("free", "users", "waiters")

    def __init__(self, size: int) -> None:
        self.free = size
        self.users = 0  # calls holding or waiting for a slot
        self.waiters: deque[anyio.Event] = deque()

    async def acquire(self) -> None:
        if self.free and not self.waiters:
            self.free -= 1
            return
        event = anyio.Event()
        self.waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # a slot was handed to us as we were cancelled: pass it on
                self.release()
            else:
                self.waiters.remove(event)
            raise

    def release(self) -> None:
        if self.waiters:
            self.waiters.popleft().set()  # hand the slot over
        else:
            self.free += 1


class _Served:
    """A call being served: its scope (deadline and the caller leaving) and why it ended."""

    __slots__ = ("caller_left", "scope")

    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope = scope
        self.caller_left = False


class _BadRequest(Exception):
    """The caller sent something a call does not accept."""


class _ResponseTooLarge(Exception):
    """A handler's response does not fit in one message."""


class _CallerGone(Exception):
    """The caller reset or closed the call's stream, or the connection broke."""
