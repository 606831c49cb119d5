"""The transport protocol: what every transport (memory, tcp, quic, plugins) implements.

Theory of operation
-------------------
A :class:`Transport` is bound to one :class:`~swarmavg.identity.Identity`. It can *listen* on an
address (returning a :class:`Listener` that accepts incoming :class:`Connection` objects) and
*dial* an address that names a PeerID (returning a :class:`Connection` whose remote peer proved
that identity). A connection carries many independent, bidirectional, ordered, reliable
**message streams** (:class:`Stream`): every ``send`` is delivered as one message by one
``receive``, never split or merged. Streams have per-stream flow control: ``send`` waits while the
receiver has not consumed enough (backpressure), so a bulk transfer on one stream cannot use
unbounded memory nor starve the other streams of the connection.

Closing rules (the conformance suite in :mod:`swarmavg.testing` checks each of them):

* ``stream.send_eof()`` half-closes: the peer's ``receive`` raises :class:`anyio.EndOfStream`
  after it has read everything sent before; the peer may keep sending to us.
* ``stream.aclose()`` closes both directions; the peer reads what was sent, then
  ``EndOfStream``. Our own later calls raise :class:`anyio.ClosedResourceError`.
* ``stream.abort()`` resets the stream: data in flight may be dropped and the peer's pending and
  later operations raise :class:`~swarmavg.errors.StreamReset`.
* A cancelled ``stream.send()`` returns promptly and never leaves part of its message: it was
  not sent, or sent whole, or the stream is reset (as by ``abort()``).
* ``connection.aclose()`` ends every stream of the connection; operations pending on the peer's
  side raise :class:`~swarmavg.errors.ConnectionLost` (or ``EndOfStream`` if everything was read
  and the stream had ended cleanly).
* ``aclose()`` is idempotent everywhere.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar

import anyio
import anyio.abc
from anyio import TypedAttributeProvider, TypedAttributeSet, typed_attribute

if TYPE_CHECKING:
    from types import TracebackType

    from swarmavg.address import Address
    from swarmavg.identity import Identity, PeerID

__all__ = [
    "Buffer",
    "Connection",
    "ConnectionAttribute",
    "IncomingLimits",
    "Listener",
    "Stream",
    "StreamAttribute",
    "TaskGroupTransport",
    "Transport",
]

#: Anything exposing the buffer protocol that a stream can send.
Buffer = bytes | bytearray | memoryview


logger = logging.getLogger(__name__)


class ConnectionAttribute(TypedAttributeSet):
    """Typed attributes of a :class:`Connection`: ``conn.extra(ConnectionAttribute.peer_id)``."""

    #: The authenticated identity of the remote peer.
    peer_id: PeerID = typed_attribute()
    #: Where the remote end is (for an accepted connection: its source address, no PeerID path).
    remote_address: Address = typed_attribute()
    #: Our end of the connection.
    local_address: Address = typed_attribute()
    #: The name of the transport that made the connection ("memory", "tcp", ...).
    transport_name: str = typed_attribute()
    #: Whether we dialed (True) or accepted (False) this connection.
    is_initiator: bool = typed_attribute()
    #: Whether data on this connection is encrypted.
    encrypted: bool = typed_attribute()


class StreamAttribute(TypedAttributeSet):
    """Typed attributes of a :class:`Stream`; a stream also exposes its connection's attributes."""

    #: Transport-specific stream number, unique within its connection.
    stream_id: int = typed_attribute()


class Signal:
    """A re-armable broadcast for transport implementations: ``wait()`` returns at the next
    ``notify()`` (every waiter wakes; waiters re-check their condition in a loop). Callbacks
    added with ``add_callback`` are called once, at the next ``notify()`` (a callback that
    raises is logged, not propagated: it runs in the transport's machinery)."""

    __slots__ = ("_callbacks", "_event")

    def __init__(self) -> None:
        self._event: anyio.Event | None = None  # made only when someone waits
        self._callbacks: list[Callable[[], object]] | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None
        if self._callbacks is not None:
            callbacks, self._callbacks = self._callbacks, None
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    logger.exception("a stream's on_readable callback failed")

    def add_callback(self, callback: Callable[[], object]) -> None:
        if self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class AbandonCallbacks:
    """The callbacks of :meth:`Stream.on_abandoned`, for a transport that implements it: the
    stream ``add``-s them and ``fire``-s them once, when the peer abandons it. A callback added
    after that, or while ``abandoned`` is true, is called at once. A callback that raises is
    logged, not propagated (it runs in the transport's machinery)."""

    __slots__ = ("_callbacks", "_fired")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], object]] | None = None
        self._fired = False

    def add(self, callback: Callable[[], object], *, abandoned: bool = False) -> bool:
        if abandoned or self._fired:
            self._call(callback)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)
        return True

    def fire(self) -> None:
        self._fired = True
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            self._call(callback)

    @staticmethod
    def _call(callback: Callable[[], object]) -> None:
        try:
            callback()
        except Exception:
            logger.exception("an on_abandoned callback failed")


class Stream(TypedAttributeProvider, ABC):
    """One ordered, reliable, bidirectional message stream within a :class:`Connection`."""

    @abstractmethod
    async def send(self, *parts: Buffer) -> None:
        """Send one message made of the concatenation of ``parts``.

        Waits while the peer's receive window is full (backpressure). The buffers may be reused
        by the caller once this returns (or raises).

        Cancelling it returns promptly (never after a transport's write timeout) and leaves no
        part of the message on the stream: the message was not sent, or was sent whole, or, if
        the transport had written part of it, the stream is reset (the peer's operations and
        ours then raise :class:`~swarmavg.errors.StreamReset`).

        :raises MessageTooLarge: if the message exceeds :attr:`max_message_size`.
        :raises anyio.ClosedResourceError: if we closed the stream or sent EOF.
        :raises StreamReset: if the peer aborted the stream.
        :raises ConnectionLost: if the connection broke.
        """

    @abstractmethod
    async def receive(self) -> memoryview:
        """Receive the next message, whole.

        The returned view belongs to the caller and stays valid; it may be read-only.

        :raises anyio.EndOfStream: after the peer sent EOF or closed, once everything was read.
        :raises anyio.ClosedResourceError: if we closed the stream.
        :raises StreamReset: if the peer aborted the stream.
        :raises ConnectionLost: if the connection broke.
        """

    def receive_nowait(self) -> memoryview:
        """The next message if it is here already, without waiting (or yielding to the event
        loop); otherwise :class:`anyio.WouldBlock`.

        A transport may raise ``WouldBlock`` even with a message waiting (this default always
        does). At the end of the stream, or after an error, it raises what :meth:`receive`
        would (``EndOfStream``, ``StreamReset``, ...), or ``WouldBlock`` and leaves it to
        :meth:`receive` to tell; a transport that implements :meth:`on_readable` must raise
        the end and the errors. The RPC layer reads a call's opening so, to spare the timeout
        it would put around a wait.
        """
        raise anyio.WouldBlock

    def on_readable(self, callback: Callable[[], object]) -> bool:
        """Call ``callback()`` once, from the event loop's thread, when :meth:`receive_nowait`
        may have something new to say: a message arrived, the peer ended or reset the stream,
        the connection was lost, or we closed the stream. It may also be called when nothing
        changed for the reader (the caller then asks again), and at once if a message or the
        end is already here.

        Returns ``False`` (and never calls it) if this transport cannot; the caller must then
        wait in :meth:`receive`. The RPC layer reads the answers of many calls in one task so
        (a DHT lookup's queries), instead of a task per call.

        ``callback`` may run in a raw event-loop callback (a socket reader), outside any task:
        it must not call an anyio function that needs to know the async library there (anyio
        < 4.16 raises): no ``anyio.current_time()`` (the loop's ``time()`` is the same clock),
        no new ``Event`` or ``CancelScope``; setting an event, cancelling a scope and
        ``TaskGroup.start_soon`` are fine. The same holds for :meth:`on_abandoned` callbacks
        and :meth:`Connection.serve_inline` handlers.
        """
        return False

    def send_last_nowait(self, *parts: Buffer) -> bool:
        """:meth:`send_last` if it can be done at once, without waiting or yielding to the
        event loop; whether it was (``False``: nothing was sent, use :meth:`send_last`).

        A message that the socket cannot take whole at once is still sent, the rest by the
        transport's machinery: ``True`` means the message and the EOF are on their way, in
        order. This default never sends. The RPC layer answers inline calls so (see
        :meth:`Connection.serve_inline`).
        """
        return False

    @abstractmethod
    async def send_eof(self) -> None:
        """Tell the peer we will send nothing more; we can still receive. Idempotent."""

    async def send_last(self, *parts: Buffer) -> None:
        """:meth:`send` one message, then :meth:`send_eof`.

        Transports override it to put both on the wire together (one write, one wake-up of the
        peer): the last answer of a call is the common case.
        """
        await self.send(*parts)
        await self.send_eof()

    def on_abandoned(self, callback: Callable[[], object]) -> bool:
        """Call ``callback()`` once, from the event loop's thread, when the peer abandons the
        stream: it reset it, closed it or stopped reading it (a transport may notice that
        only once we send it something), or the connection was lost.

        It may be called at once if that already happened. Returns ``False`` (and never calls
        it) if this transport cannot tell; the caller must then watch the stream by reading it.
        Users of this: the RPC layer cancels a handler whose caller went away without reading
        the caller's side of the stream in a task of its own.
        """
        return False

    @abstractmethod
    async def aclose(self) -> None:
        """Close both directions gracefully. Idempotent; never raises transport errors."""

    @abstractmethod
    async def abort(self) -> None:
        """Reset the stream: the peer's pending and later operations raise ``StreamReset``."""

    @property
    @abstractmethod
    def max_message_size(self) -> int:
        """The largest message, in bytes, this stream can carry."""

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> memoryview:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.aclose()
        else:
            with anyio.CancelScope(shield=True):
                await self.abort()


class Connection(TypedAttributeProvider, ABC):
    """An authenticated connection to one remote peer, multiplexing many :class:`Stream` s."""

    @abstractmethod
    async def open_stream(self) -> Stream:
        """Open a new outgoing stream.

        :raises ConnectionLost: if the connection is closed or broken.
        :raises TransportError: if the peer's stream limit is reached and does not free up.
        """

    @abstractmethod
    async def accept_stream(self) -> Stream:
        """Wait for the next stream the peer opens.

        :raises ConnectionLost: once the connection is closed (by either side) or broken.
        """

    def serve_inline(self, handler: Callable[[Stream, memoryview], bool] | None) -> bool:
        """Offer ``handler`` every new stream whose first message came whole with the peer's
        EOF (a unary call's opening), before the stream is queued for :meth:`accept_stream`.

        ``handler(stream, message)`` is called synchronously from the transport's reader, with
        the message still unread. It returns ``True`` if it took the stream (the message then
        counts as read, and the stream is never accepted), ``False`` to leave it to
        :meth:`accept_stream` untouched. It must not block, and should not raise: an exception
        is logged and leaves the stream to :meth:`accept_stream`. ``None`` removes it.
        Returns whether the transport does this (this default does not, and never calls it).
        """
        return False

    @abstractmethod
    async def aclose(self) -> None:
        """Close the connection and all its streams. Idempotent."""

    @property
    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the connection was closed (by either side) or broke."""

    @abstractmethod
    async def wait_closed(self) -> None:
        """Return once the connection is closed or broken."""

    def idle_seconds(self) -> float | None:
        """Seconds since anything last arrived from the peer on this connection, its
        acknowledgements of our data included where the transport sees them (``None``: the
        transport does not tell). A connection that carries data is alive, however slowly a
        request over it is answered (a link full of bulk data); one silent for long may be
        stale (after a network cut, TCP holds what it sends behind a backed-off retransmission
        timer)."""
        return None

    def traffic(self) -> tuple[int, int] | None:
        """``(bytes that reached the peer, bytes that arrived from it)`` on this connection so
        far, counted where they cross the network (for TCP: the kernel's counters, which see
        data when it arrives, not when the application hands it over or reads it; framing and
        encryption included; what reached the peer counts what it acknowledged selectively
        too, so a lost packet does not hold back the count of the data after it); ``None``:
        the transport does not tell. Only the differences between two reads mean something."""
        return None

    def set_pacing_rate(self, rate: float | None) -> bool:
        """Cap the rate at which this connection sends at ``rate`` bytes/s (``None``: no cap),
        spreading its packets over time. Returns whether the transport did (``False``: it
        cannot pace). The all-reduce paces its connections so that they share this peer's
        upload fairly (see ``docs/design/averaging.md``)."""
        return False

    @property
    def peer_id(self) -> PeerID:
        """Shortcut for ``self.extra(ConnectionAttribute.peer_id)``."""
        return self.extra(ConnectionAttribute.peer_id)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Listener(ABC):
    """Accepts incoming connections on one address."""

    @property
    @abstractmethod
    def address(self) -> Address:
        """The address peers dial, including the port actually bound and our PeerID."""

    @abstractmethod
    async def accept(self) -> Connection:
        """Wait for the next authenticated incoming connection.

        Handshake failures of individual peers are logged and skipped, not raised here.

        :raises anyio.ClosedResourceError: after :meth:`aclose`.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Stop listening. Connections already accepted stay open. Idempotent."""

    async def serve(
        self,
        handler: Callable[[Connection], Coroutine[Any, Any, Any]],
        task_group: anyio.abc.TaskGroup,
    ) -> None:
        """Accept connections forever, running ``handler(conn)`` in ``task_group`` for each."""
        while True:
            try:
                conn = await self.accept()
            except anyio.ClosedResourceError:
                return
            task_group.start_soon(handler, conn)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class IncomingLimits:
    """The incoming connections a transport holds, counted per peer and in all, for its
    ``max_connections_per_peer`` and ``max_incoming_connections`` limits."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer = per_peer
        self.max_total = total
        self._counts: dict[PeerID, int] = {}
        self._admitted: set[int] = set()  # id() of the connections counted

    @property
    def total(self) -> int:
        return len(self._admitted)

    def count(self, peer: PeerID) -> int:
        return self._counts.get(peer, 0)

    def refusal(self, peer: PeerID) -> str | None:
        """Why a new connection from ``peer`` is over a limit, or ``None``."""
        if self.total >= self.max_total:
            return f"{self.max_total} incoming connections already"
        if self.count(peer) >= self.per_peer:
            return f"{peer.short()} already holds {self.per_peer} connections"
        return None

    def admit(self, conn: Connection) -> None:
        self._admitted.add(id(conn))
        self._counts[conn.peer_id] = self.count(conn.peer_id) + 1

    def release(self, conn: Connection) -> None:
        """``conn`` closed; nothing happens if it was never admitted (or already released)."""
        if id(conn) not in self._admitted:
            return
        self._admitted.discard(id(conn))
        left = self._counts[conn.peer_id] - 1
        if left:
            self._counts[conn.peer_id] = left
        else:
            del self._counts[conn.peer_id]


_C = TypeVar("_C", bound=Connection)


class QueueListener(Listener, Generic[_C]):
    """A :class:`Listener` that its transport hands authenticated connections to
    (:meth:`_deliver`), and :meth:`accept` takes them from a bounded queue.

    Subclasses' :meth:`aclose` sets ``_closed``, releases their socket, then awaits
    :meth:`_close_queue` (which closes the connections nobody accepted).
    """

    def __init__(self, address: Address, backlog: int = 64) -> None:
        self._address = address
        self._send, self._receive = anyio.create_memory_object_stream[_C](backlog)
        self._closed = False

    @property
    def address(self) -> Address:
        return self._address

    @property
    def is_closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._address}>"

    async def accept(self) -> _C:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise anyio.ClosedResourceError from None

    def _deliver(self, conn: _C) -> bool:
        """Queue ``conn`` for :meth:`accept`; ``False`` (the caller drops it) if the queue is
        full or the listener closed."""
        try:
            self._send.send_nowait(conn)
        except anyio.WouldBlock:
            logger.warning(
                "dropping an incoming connection on %s: %d wait to be accepted already",
                self._address,
                self._send.statistics().current_buffer_used,
            )
            return False
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            logger.debug("dropping an incoming connection: %s is closed", self._address)
            return False
        return True

    async def _close_queue(self) -> None:
        self._send.close()
        while True:
            try:
                conn = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            await conn.aclose()
        self._receive.close()
        await anyio.lowlevel.checkpoint()


class Transport(ABC):
    """A way to reach peers, bound to one identity.

    Implementations are constructed as ``TransportClass(identity, **options)`` and registered
    under the entry-point group ``swarmavg.transports``; see
    :func:`swarmavg.transport.resolve_transport`.

    A transport is used as an async context manager: ``async with transport:`` gives it the
    place where its background tasks live (reader tasks, keep-alives), and leaving the block
    closes everything it made. Transports without background tasks keep the default
    ``__aenter__``. Its listeners and connections may only be used inside that block.
    """

    #: Registered name, e.g. "tcp".
    name: ClassVar[str]
    #: URL schemes this transport dials and listens on, e.g. ("tcp",).
    schemes: ClassVar[Sequence[str]]

    def __init__(self, identity: Identity) -> None:
        self.identity = identity

    @abstractmethod
    async def listen(self, address: Address) -> Listener:
        """Start listening on ``address`` (port 0 picks a free port).

        :raises AddressInUse: if another socket holds the port (the ``OSError`` chained).
        :raises TransportError: if the address cannot be listened on for another reason
            (``OSError`` is translated, never raised as is).
        """

    @abstractmethod
    async def connect(
        self,
        address: Address,
        *,
        allow_unknown_peer: bool = False,
    ) -> Connection:
        """Dial ``address`` and authenticate the peer.

        :param allow_unknown_peer: accept whoever answers when ``address`` names no PeerID.
        :raises ValueError: if ``address`` names no PeerID and ``allow_unknown_peer`` is false,
            or its scheme is not one of :attr:`schemes`.
        :raises PeerIdentityMismatch: if another key answers.
        :raises ConnectError: if the peer cannot be reached or the handshake fails.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Close every listener and connection this transport made. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.aclose()
        return None

    def _check_dial_address(self, address: Address, allow_unknown_peer: bool) -> None:
        """Shared argument validation for :meth:`connect` implementations."""
        if address.scheme not in self.schemes:
            raise ValueError(
                f"address {address} has scheme {address.scheme!r}; "
                f"the {self.name} transport dials {', '.join(self.schemes)}"
            )
        if address.peer_id is None and not allow_unknown_peer:
            raise ValueError(
                f"address {address} names no peer (/p/<peer-id>): pass an address that includes "
                "the PeerID, or allow_unknown_peer=True to trust whoever answers"
            )


class TaskGroupTransport(Transport):
    """A :class:`Transport` whose background tasks (readers, timers, keep-alives) run in a task
    group that ``async with transport:`` opens; leaving the block closes the transport and
    cancels them.

    Subclasses start their tasks in :meth:`_task_group`, and their :meth:`aclose` sets
    ``self._closed`` and ends with :meth:`_cancel_tasks`. Also here: the argument checks that
    transport options share.
    """

    def __init__(self, identity: Identity) -> None:
        super().__init__(identity)
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False

    async def __aenter__(self) -> Self:
        name = type(self).__name__
        if self._tg is not None:
            raise RuntimeError(f"a {name} can be entered only once")
        if self._closed:
            raise RuntimeError(f"this {name} was closed")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await super().__aexit__(exc_type, exc, tb)  # closes the transport, shielded
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        return await self._tg.__aexit__(exc_type, exc, tb)

    def _task_group(self) -> anyio.abc.TaskGroup:
        """Where background tasks go.

        :raises TransportError: once the transport is closed.
        :raises RuntimeError: outside ``async with transport:``.
        """
        from swarmavg.errors import TransportError

        if self._closed:
            raise TransportError("the transport is closed")
        if self._tg is None:
            raise RuntimeError("use the transport inside `async with transport:`")
        return self._tg

    def _cancel_tasks(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    @staticmethod
    def _check_seconds(name: str, value: float | None, *, allow_none: bool = False) -> None:
        """:raises ValueError: unless ``value`` is a positive number (or ``None`` if allowed)."""
        if value is None and allow_none:
            return
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or math.isnan(value)
            or value <= 0
        ):
            raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")

    @staticmethod
    def _check_count(name: str, value: int, minimum: int = 1) -> None:
        """:raises ValueError: unless ``value`` is an int of at least ``minimum``."""
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an int of at least {minimum}, not {value!r}")
