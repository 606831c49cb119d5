"""A swarmavg-quic connection: an aioquic ``QuicConnection`` driven from anyio, and its streams.

Theory of operation
-------------------
aioquic is sans-IO: it takes datagrams and timer ticks, and hands back events and datagrams to
send. A :class:`QuicConnection` owns one aioquic connection and *pumps* it: :meth:`_pump` takes
every pending event and dispatches it to the streams, then sends every datagram aioquic has for
the network, then checks when aioquic next needs the clock. The pump is synchronous, so it runs
wherever something happened: in the endpoint's socket task after a batch of datagrams for this
connection, in an application task right after it wrote to a stream (a small message leaves
without a task switch), and in the connection's **driver** task, which sleeps until aioquic's
timer (ACK delays, loss recovery, pacing, idle) or the next keep-alive, runs the timer and
pumps.

Messages are framed on each QUIC stream with the 4-byte length prefix of
:mod:`swarmavg.proto.wire`, and decoded with its bounded :class:`FrameDecoder`.

Flow control. aioquic gives the peer credit as data *arrives*; we give it as the application
*reads* (see :mod:`swarmavg_quic._aioquic`). A stream's credit is what it delivered, minus the
complete messages waiting to be read, plus ``stream_window``; the connection's is what all streams
received, minus what waits to be read or is part of an incomplete message, plus
``connection_window``, plus the incomplete messages' bytes up to one ``max_message_size``. So the
receiver holds at most ``connection_window + max_message_size`` per connection whatever the peer
does, and a message larger than the windows still arrives. Senders keep large messages (more
than half a stream window) one at a time per connection, so two of them cannot split the
connection window between them and stall. Credit goes back in batches of a quarter window.

Sending waits while the stream has more than ``send_buffer`` bytes written and not yet
acknowledged (aioquic would buffer without limit). A message is atomic: once its first bytes are
written, the rest is written even if the sending task is cancelled (bounded by
``write_timeout``, after which the stream is reset).

Stream lifecycle: ``aclose()`` sends our FIN and, if the peer may still send, STOP_SENDING
(code ``CLOSED``: the peer's later messages are dropped silently, as on TCP); ``abort()`` sends
RESET_STREAM and STOP_SENDING (code ``ABORTED``: the peer's operations raise
:class:`StreamReset`). aioquic forgets a stream once both directions are finished, and so do we.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
from aioquic.quic import events

from swarmavg.abc import (
    AbandonCallbacks,
    Connection,
    ConnectionAttribute,
    Signal,
    Stream,
    StreamAttribute,
)
from swarmavg.errors import (
    ConnectionLost,
    MessageTooLarge,
    PeerIdentityMismatch,
    RemoteProtocolError,
    StreamReset,
)
from swarmavg.proto.wire import FRAME_HEADER_SIZE, FrameDecoder
from swarmavg_quic._aioquic import FlowControlledQuic, aioquic_buffered, closing_event, unacked
from swarmavg_quic._tls import BAD_CERTIFICATE, authenticated_peer

if TYPE_CHECKING:
    from swarmavg.abc import Buffer
    from swarmavg.address import Address
    from swarmavg.identity import PeerID
    from swarmavg_quic._endpoint import Endpoint

logger = logging.getLogger("swarmavg_quic")

#: Application error codes on streams (RESET_STREAM / STOP_SENDING).
CLOSED: Final = 0x0  # we read nothing more: drop what you send
ABORTED: Final = 0x1  # the stream was aborted
PROTOCOL: Final = 0x2  # the peer broke the framing
REFUSED: Final = 0x3  # a stream we do not take (unidirectional, or too many unaccepted)
#: Streams the peer opened that the application has not accepted yet; more are refused.
MAX_UNACCEPTED: Final = 256
#: Application error codes on connections (CONNECTION_CLOSE).
CLOSE_NORMAL: Final = 0x0
CLOSE_REFUSED: Final = 0x2  # not listening, or over a connection limit
CLOSE_IDLE: Final = 0x3

_HEADER = struct.Struct(">I")


def _parts_views(parts: tuple[Buffer, ...]) -> list[memoryview]:
    views = []
    for part in parts:
        view = part if isinstance(part, memoryview) else memoryview(part)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        views.append(view)
    return views


class QuicStream(Stream):
    """One message stream: one bidirectional QUIC stream."""

    def __init__(self, conn: QuicConnection, stream_id: int) -> None:
        self._conn = conn
        self.id = stream_id
        self._abandon = AbandonCallbacks()
        self._changed = Signal()
        # receiving
        self._decoder = FrameDecoder(conn._max_message_size)
        self._inbox: deque[memoryview] = deque()
        self._unread = 0  # bytes (with headers) of complete messages in the inbox
        self._partial = 0  # bytes of the incomplete message in the decoder
        self._delivered = 0  # stream bytes aioquic handed us
        self._credit = conn._stream_window  # what the peer may send up to (announced)
        self._recv_eof = False
        self._recv_reset = False
        self._recv_done = False  # FIN or RESET received: the peer sends nothing more
        self._discarding = False  # we read nothing more (closed or aborted)
        # sending
        self._sent_eof = False  # no more send() from the application
        self._send_done = False  # FIN or RESET written
        self._stopped = False  # the peer reads nothing more: sends are dropped
        self._reset_by_peer = False
        self._closed = False
        self._attributes = {**conn._attributes, StreamAttribute.stream_id: lambda: self.id}

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return self._attributes

    @property
    def max_message_size(self) -> int:
        return self._conn._max_message_size

    def __repr__(self) -> str:
        return f"<QuicStream {self.id} to {self._conn._peer_id.short()}>"

    # -- sending ---------------------------------------------------------------------------------

    async def send(self, *parts: Buffer) -> None:
        await self._send(parts, eof=False)

    async def send_last(self, *parts: Buffer) -> None:
        """Send a message and our FIN together."""
        await self._send(parts, eof=True)

    def _check_send(self) -> bool:
        """Raise if we may not send; ``False`` if sends are to be dropped silently."""
        if self._closed or self._sent_eof:
            raise anyio.ClosedResourceError
        if self._reset_by_peer:
            raise StreamReset(f"{self!r} was reset by the peer")
        conn = self._conn
        if conn._error is not None:
            raise ConnectionLost(str(conn._error)) from conn._error
        return not self._stopped

    async def _send(self, parts: tuple[Buffer, ...], *, eof: bool) -> None:
        # a checkpoint, even when the message goes out at once or is dropped: a task that only
        # sends must still let others run and be cancellable
        await anyio.lowlevel.checkpoint()
        if not self._check_send():
            if eof:
                self._sent_eof = True
            return
        views = _parts_views(parts)
        size = sum(v.nbytes for v in views)
        if size > self._conn._max_message_size:
            raise MessageTooLarge(
                f"a message of {size} bytes exceeds the limit of "
                f"{self._conn._max_message_size} bytes"
            )
        conn = self._conn
        total = FRAME_HEADER_SIZE + size
        large = total > conn._stream_window // 2
        # Wait for room; cancelling here sends nothing.
        while True:
            if not self._check_send():
                if eof:
                    self._sent_eof = True
                return
            if (not large or conn._large_sender is None) and (
                unacked(conn._quic, self.id) + min(total, conn._send_buffer) <= conn._send_buffer
            ):
                break
            await conn._progress.wait()
        if eof:
            self._sent_eof = True
        if large:
            conn._large_sender = self
        try:
            await self._write([memoryview(_HEADER.pack(size)), *views], eof)
        except (ValueError, RuntimeError) as exc:  # aioquic finished or reset the stream
            self._send_done = True
            raise StreamReset(f"{self!r}: {exc}") from exc
        finally:
            if conn._large_sender is self:
                conn._large_sender = None
                conn._progress.notify()

    async def _write(self, views: list[memoryview], eof: bool) -> None:
        """Hand a whole message to aioquic, at most ``send_buffer`` unacknowledged bytes at a
        time; runs to the end even if cancelled (within ``write_timeout``). A large message
        then keeps the connection's large-message slot until the peer acknowledged it."""
        conn = self._conn
        quic = conn._quic
        budget = conn._send_buffer
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + conn._write_timeout
            for view in views:
                offset = 0
                size = view.nbytes
                while offset < size:
                    room = budget - unacked(quic, self.id)
                    if room <= 0:
                        conn._flush()
                        await conn._progress.wait()
                        if not self._writable_now():
                            return
                        continue
                    piece = view[offset : offset + room]
                    quic.send_stream_data(self.id, piece)  # type: ignore[arg-type]
                    conn._sending.add(self.id)
                    offset += piece.nbytes
            if eof:
                quic.send_stream_data(self.id, b"", end_stream=True)
                conn._sending.add(self.id)
                self._send_done = True
            end = quic._streams[self.id].sender._buffer_stop
            conn._flush()
            if conn._large_sender is self:
                while self._writable_now():
                    stream = quic._streams.get(self.id)
                    if stream is None or stream.sender._buffer_start >= end:
                        break
                    await conn._progress.wait()
        if scope.cancelled_caught:
            logger.debug(  # (the peer's doing; the writer gets StreamReset)
                "%r: the peer took no data for %.0f s; resetting the stream",
                self,
                conn._write_timeout,
            )
            await self.abort()
            raise StreamReset(f"{self!r}: writing a message timed out")
        if eof:
            self._maybe_forget()

    def _writable_now(self) -> bool:
        return not (self._reset_by_peer or self._stopped or self._conn._error is not None)

    async def send_eof(self) -> None:
        if self._sent_eof or self._closed:
            return
        self._sent_eof = True
        if self._send_done or not self._writable_now():
            return
        self._send_done = True
        try:
            self._conn._quic.send_stream_data(self.id, b"", end_stream=True)
        except (ValueError, RuntimeError) as exc:  # aioquic finished or reset it already
            raise StreamReset(f"{self!r}: {exc}") from exc
        self._conn._sending.add(self.id)
        self._conn._flush()
        self._maybe_forget()
        await anyio.lowlevel.checkpoint()

    # -- receiving -------------------------------------------------------------------------------

    async def receive(self) -> memoryview:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._inbox:
                message = self._inbox.popleft()
                self._consumed(FRAME_HEADER_SIZE + message.nbytes)
                return message
            if self._recv_reset:
                raise StreamReset(f"{self!r} was reset by the peer")
            if self._recv_eof:
                raise anyio.EndOfStream
            conn = self._conn
            if conn._error is not None:
                raise ConnectionLost(str(conn._error)) from conn._error
            await self._changed.wait()

    def _consumed(self, nbytes: int) -> None:
        """The application took ``nbytes``: give the credit back once it is worth a packet."""
        self._unread -= nbytes
        conn = self._conn
        conn._unread -= nbytes
        if self._refresh_credit() | conn._update_data_credit():
            conn._flush()

    def _refresh_credit(self) -> bool:
        """Raise the stream's credit if worth it; ``True`` if an update is to be sent."""
        if self._recv_done:
            return False
        conn = self._conn
        target = self._delivered - self._unread + conn._stream_window
        if target - self._credit < conn._stream_window // 4:
            return False
        self._credit = target
        conn._quic.stream_credit[self.id] = target
        return True

    def _on_data(self, data: bytes, end_stream: bool) -> None:
        conn = self._conn
        self._delivered += len(data)
        if self._discarding:
            pass  # we read nothing more; the credit formula counts it as read
        elif data:
            decoder = self._decoder
            before = decoder.pending_frames
            try:
                decoder.feed(data)
            except RemoteProtocolError as exc:
                logger.debug("%r: %s; resetting it", self, exc)  # (the peer's doing)
                self._protocol_error()
                return
            if decoder.pending_frames != before:
                for frame in decoder.frames():
                    cost = FRAME_HEADER_SIZE + frame.nbytes
                    self._unread += cost
                    conn._unread += cost
                    self._inbox.append(frame)
            partial = decoder.buffered
            conn._partial += partial - self._partial
            self._partial = partial
            self._refresh_credit()
        if end_stream:
            self._recv_eof = True
            self._recv_done = True
            if not self._discarding:
                try:
                    self._decoder.feed_eof()
                except RemoteProtocolError as exc:
                    logger.debug("%r: %s", self, exc)
                    self._recv_reset = True
                self._drop_partial()
            self._maybe_forget()
        self._changed.notify()

    def _protocol_error(self) -> None:
        self._drop_partial()
        self._recv_reset = True
        self._discarding = True
        self._reset_quic(PROTOCOL)
        self._abandon.fire()
        self._changed.notify()

    def _drop_partial(self) -> None:
        self._conn._partial -= self._partial
        self._partial = 0

    # -- events from the peer --------------------------------------------------------------------

    def _on_reset(self, code: int) -> None:
        """The peer reset its side: our reads fail (and if it aborted the stream, our sends
        too; its STOP_SENDING is on the way)."""
        self._recv_reset = True
        if code != CLOSED:
            self._reset_by_peer = True
        self._recv_done = True
        self._drop_partial()
        self._abandon.fire()
        self._maybe_forget()
        self._changed.notify()
        self._conn._progress.notify()

    def _on_stop_sending(self, code: int) -> None:
        """The peer reads nothing more (aioquic has already reset our sending side)."""
        if code == CLOSED:
            self._stopped = True
        else:
            self._reset_by_peer = True
        self._send_done = True
        self._abandon.fire()
        self._maybe_forget()
        self._changed.notify()
        self._conn._progress.notify()

    def _on_connection_lost(self) -> None:
        self._drop_partial()
        self._abandon.fire()
        self._changed.notify()

    def on_abandoned(self, callback: Callable[[], object]) -> bool:
        return self._abandon.add(
            callback,
            abandoned=self._recv_reset
            or self._stopped
            or self._reset_by_peer
            or self._conn._error is not None,
        )

    # -- closing ---------------------------------------------------------------------------------

    def _reset_quic(self, code: int) -> None:
        quic = self._conn._quic
        if not self._send_done:
            self._send_done = True
            with contextlib.suppress(ValueError, RuntimeError):
                quic.reset_stream(self.id, code)
        if not self._recv_done and self.id in quic._streams:
            with contextlib.suppress(ValueError, RuntimeError):
                quic.stop_stream(self.id, code)
        self._conn._flush()

    def _discard_inbox(self) -> None:
        self._discarding = True
        if self._inbox:
            self._inbox.clear()
            self._conn._unread -= self._unread
            self._unread = 0
        self._drop_partial()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sent_eof = True
        self._discard_inbox()
        conn = self._conn
        if conn._error is None:
            quic = conn._quic
            wrote = False
            if not self._send_done:
                self._send_done = True
                if self._writable_now():
                    # aioquic refuses if it finished or reset the stream without telling us
                    with contextlib.suppress(ValueError, RuntimeError):
                        quic.send_stream_data(self.id, b"", end_stream=True)
                        conn._sending.add(self.id)
                        wrote = True
            if not self._recv_done and self.id in quic._streams:
                with contextlib.suppress(ValueError, RuntimeError):
                    quic.stop_stream(self.id, CLOSED)
                    wrote = True
            if conn._update_data_credit() or wrote:
                conn._flush()
        self._maybe_forget()
        self._changed.notify()
        await anyio.lowlevel.checkpoint()

    async def abort(self) -> None:
        if self._closed and self._send_done and self._recv_done:
            return
        self._closed = True
        self._sent_eof = True
        self._discard_inbox()
        if self._conn._error is None:
            self._reset_quic(ABORTED)
            self._conn._update_data_credit()
        self._maybe_forget()
        self._changed.notify()
        await anyio.lowlevel.checkpoint()

    def _maybe_forget(self) -> None:
        if self._closed or (self._send_done and self._recv_done):
            self._conn._closing_streams.add(self)


class QuicConnection(Connection):
    """An authenticated QUIC connection carrying swarmavg message streams."""

    def __init__(
        self,
        endpoint: Endpoint,
        quic: FlowControlledQuic,
        sockaddr: tuple[Any, ...],
        *,
        transport_name: str,
        is_initiator: bool,
        local_address: Address,
        remote_address: Address,
        expected_peer: PeerID | None,
        max_message_size: int,
        stream_window: int,
        connection_window: int,
        send_buffer: int,
        keepalive_interval: float,
        idle_timeout: float | None,
        write_timeout: float,
        on_close: Callable[[QuicConnection], None],
    ) -> None:
        self._endpoint = endpoint
        self._quic = quic
        self._sockaddr: tuple[Any, ...] = sockaddr
        self._transport_name = transport_name
        self._is_initiator = is_initiator
        self._local_address = local_address
        self._remote_address = remote_address
        self._expected = expected_peer
        self._peer_id: PeerID = expected_peer  # type: ignore[assignment]  # set at handshake
        self._max_message_size = max_message_size
        self._stream_window = stream_window
        self._connection_window = connection_window
        self._send_buffer = send_buffer
        self._keepalive_interval = keepalive_interval
        self._idle_timeout = idle_timeout
        self._write_timeout = write_timeout
        self._on_close = on_close
        self._streams: dict[int, QuicStream] = {}
        self._closing_streams: set[QuicStream] = set()
        self._accept_queue: deque[QuicStream] = deque()
        self._refused: set[int] = set()
        self._accepting = Signal()
        self._progress = Signal()  # ACKs, credit, resets: blocked writers re-check
        self._large_sender: QuicStream | None = None
        self._unread = 0  # bytes of complete messages waiting to be read, all streams
        self._partial = 0  # bytes of incomplete messages, all streams
        self._error: ConnectionLost | None = None
        self._handshake_error: BaseException | None = None
        self.handshake_done = anyio.Event()
        self._closed_event = anyio.Event()
        self._wake = anyio.Event()
        self._sleep_until = float("inf")
        self._sleep_scope: anyio.CancelScope | None = None
        self._pumping = False
        self._pump_again = False
        self._scheduled = False
        self._sending: set[int] = set()  # streams with data written that may be unsent
        # The pump also runs as an event-loop callback (_schedule): what it calls reads this
        # loop's clock (anyio's on asyncio) and calls no anyio function that needs to know the
        # async library (anyio < 4.16 cannot tell it outside a task).
        self._loop = asyncio.get_running_loop()
        self._last_ping = 0.0
        self._idle_since = self._loop.time()
        self._attributes = self._make_attributes()

    # -- attributes ------------------------------------------------------------------------------

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        return self._attributes

    def _make_attributes(self) -> dict[Any, Callable[[], Any]]:
        return {
            ConnectionAttribute.peer_id: lambda: self._peer_id,
            ConnectionAttribute.remote_address: lambda: self._remote_address,
            ConnectionAttribute.local_address: lambda: self._local_address,
            ConnectionAttribute.transport_name: lambda: self._transport_name,
            ConnectionAttribute.is_initiator: lambda: self._is_initiator,
            ConnectionAttribute.encrypted: lambda: True,
        }

    @property
    def is_closed(self) -> bool:
        return self._error is not None

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def __repr__(self) -> str:
        side = "to" if self._is_initiator else "from"
        who = self._peer_id.short() if self._peer_id is not None else "?"
        return f"<QuicConnection {side} {who} at {self._remote_address}>"

    # -- streams ---------------------------------------------------------------------------------

    async def open_stream(self) -> QuicStream:
        if self._error is not None:
            raise ConnectionLost(str(self._error)) from self._error
        await anyio.lowlevel.checkpoint()
        if self._error is not None:
            raise ConnectionLost(str(self._error)) from self._error
        quic = self._quic
        stream_id = quic.get_next_available_stream_id()
        quic.send_stream_data(stream_id, b"")  # creates it (nothing is sent until data is)
        stream = QuicStream(self, stream_id)
        self._streams[stream_id] = stream
        return stream

    async def accept_stream(self) -> QuicStream:
        while True:
            if self._accept_queue:
                return self._accept_queue.popleft()
            if self._error is not None:
                raise ConnectionLost(str(self._error)) from self._error
            await self._accepting.wait()

    def _peer_stream(self, stream_id: int) -> QuicStream | None:
        """Our stream for an event about ``stream_id``, made (and queued for accept_stream)
        the first time the peer's stream shows up; ``None`` for a stream we do not take."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        if (stream_id & 1) == (0 if self._quic._is_client else 1):
            return None  # ours, and forgotten: aioquic had finished it
        if stream_id in self._refused:
            return None
        if stream_id & 2 or len(self._accept_queue) >= MAX_UNACCEPTED:
            # unidirectional (we open none, take none), or the application is not keeping up
            # with the streams the peer opens: a peer could otherwise end streams as fast as
            # aioquic lets it open new ones and have us queue them without limit
            self._refuse(stream_id)
            return None
        stream = QuicStream(self, stream_id)
        self._streams[stream_id] = stream
        self._accept_queue.append(stream)
        self._accepting.notify()
        return stream

    def _refuse(self, stream_id: int) -> None:
        quic = self._quic
        if len(self._refused) >= MAX_UNACCEPTED:
            self._refused = {i for i in self._refused if i in quic._streams}
        self._refused.add(stream_id)
        with contextlib.suppress(ValueError, RuntimeError):  # already finished or discarded
            quic.stop_stream(stream_id, REFUSED)
        if not stream_id & 2:
            with contextlib.suppress(ValueError, RuntimeError):
                quic.reset_stream(stream_id, REFUSED)
        self._schedule()

    # -- the pump --------------------------------------------------------------------------------

    def _update_data_credit(self) -> bool:
        """Recompute the connection's credit; ``True`` if an update is worth sending.

        Bytes count as held while they wait to be read (``_unread``), belong to an incomplete
        message (``_partial``, of which up to one ``max_message_size`` is granted on top of the
        window), or sit in aioquic's receive buffers out of order, behind a gap (counted only
        when an update looks due, since it means a pass over the streams)."""
        quic = self._quic
        used = quic._local_max_data.used
        partial = self._partial
        target = (
            used
            - self._unread
            - partial
            + self._connection_window
            + min(partial, self._max_message_size)
        )
        step = self._connection_window // 4
        if target - quic.data_credit < step:
            return False
        target -= aioquic_buffered(quic)
        if target - quic.data_credit < step:
            return False
        quic.data_credit = target
        return True

    def _flush(self) -> None:
        """The application wrote something: transmit it soon, with the acknowledgement aioquic
        was holding back (so a reply acknowledges its request in the same packet)."""
        self._quic.ack_with_next_packet(self._loop.time())
        self._schedule()

    def _schedule(self) -> None:
        """Pump once at the end of this turn of the event loop: writes of several tasks (or
        several writes of one) in the same turn share one pass over aioquic's output, which
        costs ~100 µs of CPU whether it sends anything or not."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._scheduled_pump)

    def _scheduled_pump(self) -> None:
        self._scheduled = False
        if self._quic.get_timer() is not None or self._error is None:
            self._pump()

    def _after_receive(self) -> None:
        """Datagrams for us were fed to aioquic: hand their data on now; transmit only if
        something is waiting for it (the handshake, data held back by congestion control or
        flow control). Acknowledgements wait for aioquic's ACK timer or our next write."""
        try:
            self._process()
        except Exception as exc:  # a bug must cost this connection, never the transport
            logger.exception("%r failed", self)
            self._fail(ConnectionLost(f"internal error: {exc!r}"))
            self._wake.set()
            return
        quic = self._quic
        if (
            self._sending
            or quic.ack_due(self._loop.time())
            or not self.handshake_done.is_set()
            or closing_event(quic) is not None
        ):
            self._schedule()

    def _pump(self) -> None:
        """Dispatch aioquic's events, send its datagrams, re-arm the timer (synchronous)."""
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            while True:
                self._pump_again = False
                self._process()
                self._transmit()
                if not self._pump_again and not self._quic._events:
                    break
        except Exception as exc:  # a bug must cost this connection, never the transport
            logger.exception("%r failed", self)
            self._fail(ConnectionLost(f"internal error: {exc!r}"))
            self._wake.set()
        finally:
            self._pumping = False

    def _process(self) -> None:
        """Dispatch aioquic's events; re-arm the timer."""
        quic = self._quic
        while (event := quic.next_event()) is not None:
            self._handle_event(event)
        if self._error is None:
            closing = closing_event(quic)
            if closing is not None:
                self._fail(ConnectionLost(_describe_close(closing, by_peer=True)))
        if self._closing_streams:
            self._sweep_streams()
        self._progress.notify()
        self._rearm()

    def _transmit(self) -> None:
        """Send what aioquic has for the network; re-arm the timer."""
        quic = self._quic
        self._update_data_credit()
        self._endpoint.send_datagrams(quic.datagrams_to_send(self._loop.time()))
        if self._sending:
            streams = quic._streams
            for stream_id in list(self._sending):
                stream = streams.get(stream_id)
                if stream is None or not (
                    len(stream.sender._pending) or stream.sender._pending_eof
                ):
                    self._sending.discard(stream_id)
        self._rearm()

    def _deadline(self) -> float | None:
        """When the driver must next run: aioquic's timer, our keep-alive or idle close;
        ``None`` once aioquic has terminated the connection."""
        deadline = self._quic.get_timer()
        if deadline is None:
            return None
        if self._error is None and self.handshake_done.is_set():
            deadline = min(deadline, self._last_ping + self._keepalive_interval)
            if self._idle_timeout is not None and not self._streams:
                deadline = min(deadline, self._idle_since + self._idle_timeout)
        return deadline

    def _rearm(self) -> None:
        deadline = self._deadline()
        if deadline is None:
            self._wake.set()
        elif deadline < self._sleep_until:
            # move the driver's wake-up earlier without waking it (a deadline move is cheap)
            self._sleep_until = deadline
            if self._sleep_scope is not None:
                self._sleep_scope.deadline = deadline

    def _handle_event(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            stream = self._peer_stream(event.stream_id)
            if stream is not None:
                stream._on_data(event.data, event.end_stream)
        elif isinstance(event, events.StreamReset):
            stream = self._peer_stream(event.stream_id)
            if stream is not None:
                stream._on_reset(event.error_code)
        elif isinstance(event, events.StopSendingReceived):
            # it may come before the stream's first data (in the same packet, ahead of it)
            stream = self._peer_stream(event.stream_id)
            if stream is not None:
                stream._on_stop_sending(event.error_code)
        elif isinstance(event, events.HandshakeCompleted):
            self._on_handshake()
        elif isinstance(event, events.ConnectionIdIssued):
            self._endpoint.register(event.connection_id, self)
        elif isinstance(event, events.ConnectionIdRetired):
            self._endpoint.unregister(event.connection_id, self)
        elif isinstance(event, events.ConnectionTerminated):
            self._fail(ConnectionLost(_describe_close(event, by_peer=True)))
            self._terminated()

    def _on_handshake(self) -> None:
        try:
            self._peer_id = authenticated_peer(self._quic, self._expected)
            self._last_ping = self._loop.time()
        except (PeerIdentityMismatch, RemoteProtocolError) as exc:
            self._handshake_error = exc
            self._quic.close(error_code=BAD_CERTIFICATE, reason_phrase="peer identity")
            self._fail(ConnectionLost(f"handshake failed: {exc}"))
        self.handshake_done.set()

    def _sweep_streams(self) -> None:
        quic_streams = self._quic._streams
        credit = self._quic.stream_credit
        for stream in list(self._closing_streams):
            state = quic_streams.get(stream.id)
            # aioquic discards a finished stream only when it next writes packets: a finished
            # one is as good as gone (it delivers no more events)
            if (state is None or state.is_finished) and (stream._send_done or stream._closed):
                self._closing_streams.discard(stream)
                if self._streams.get(stream.id) is stream:
                    del self._streams[stream.id]
                credit.pop(stream.id, None)
        if not self._streams:
            self._idle_since = self._loop.time()

    # -- the driver ------------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run aioquic's timers and keep-alives until the connection has terminated."""
        quic = self._quic
        task_status.started()
        try:
            while True:
                deadline = self._deadline()
                if deadline is None:
                    break
                now = anyio.current_time()
                if deadline > now:
                    # Sleep until the deadline, which _pump moves earlier when aioquic's timer
                    # does; the wake event is only for the end of the connection.
                    self._sleep_until = deadline
                    with anyio.CancelScope(deadline=deadline) as scope:
                        self._sleep_scope = scope
                        await self._wake.wait()
                    self._sleep_scope = None
                self._sleep_until = float("inf")
                if self._wake.is_set():
                    self._wake = anyio.Event()
                now = anyio.current_time()
                timer = quic.get_timer()
                if timer is not None and now >= timer:
                    quic.handle_timer(now)
                if self._error is None and self.handshake_done.is_set():
                    if now >= self._last_ping + self._keepalive_interval:
                        self._last_ping = now
                        quic.send_ping(0)
                    if (
                        self._idle_timeout is not None
                        and not self._streams
                        and now >= self._idle_since + self._idle_timeout
                    ):
                        logger.debug("%r: idle for %.0f s; closing", self, self._idle_timeout)
                        self._close(CLOSE_IDLE, "idle")
                self._pump()
        finally:
            if self._error is None:  # cancelled from outside: still tell the peer
                with contextlib.suppress(Exception):
                    self._close(CLOSE_NORMAL, "the peer shut down")
            self._fail(ConnectionLost("the transport was closed"))
            self._terminated()

    def _terminated(self) -> None:
        self._endpoint.forget(self)

    # -- closing ---------------------------------------------------------------------------------

    def _fail(self, error: ConnectionLost) -> None:
        if self._error is not None:
            return
        self._error = error
        if not self.handshake_done.is_set():
            if self._handshake_error is None:
                self._handshake_error = error
            self.handshake_done.set()
        for stream in list(self._streams.values()):
            stream._on_connection_lost()
        self._accepting.notify()
        self._progress.notify()
        self._closed_event.set()
        self._on_close(self)

    def _unreachable(self, reason: str) -> None:
        """The peer's address answered with an ICMP error while we were handshaking."""
        if self._handshake_error is None:
            self._handshake_error = ConnectionLost(reason)
        self._close(CLOSE_REFUSED, "unreachable")

    def _close(self, code: int, reason: str) -> None:
        if self._error is None:
            self._fail(ConnectionLost(f"the connection was closed ({reason})"))
        self._quic.close(error_code=code, reason_phrase=reason)
        self._pump()

    async def aclose(self) -> None:
        if self._error is None:
            self._close(CLOSE_NORMAL, "closed")
        await anyio.lowlevel.checkpoint()


def _describe_close(event: events.ConnectionTerminated, *, by_peer: bool) -> str:
    reason = f": {event.reason_phrase}" if event.reason_phrase else ""
    return f"the connection closed (code {event.error_code:#x}{reason})"
