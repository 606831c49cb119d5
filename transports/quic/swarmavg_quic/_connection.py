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
acknowledged (aioquic would buffer without limit). A stream never carries part of a message:
a send cancelled before it wrote anything sends nothing, and one cancelled (or timed out:
``write_timeout`` without the peer taking data) once it has written part of its message resets
the stream (RESET_STREAM + STOP_SENDING, code ``ABORTED``) and returns at once; the peer's
operations then raise :class:`StreamReset`, and so do ours. Nothing in the send path is
shielded from cancellation. A large message holds the connection's large-message slot until the
peer acknowledged it; the pump gives the slot back, so ``send()`` returns once the message is
handed to aioquic.

Liveness. A peer that is gone is noticed when there is evidence of it, not at QUIC's idle
timeout (three keep-alive intervals): an ICMP error for the peer's address (``IP_RECVERR``,
read by the endpoint) starts a *probe*: a PING at once (and one more halfway), and if none is
acknowledged within ``max(3 x smoothed RTT, 0.25 s)`` (at most ``max(1 s, 2 x RTT)``) the
connection is lost. ICMP is unauthenticated, so a spoofed error costs a PING, never a live
connection. ICMP only answers our own packets, so while streams are open a peer we have heard
nothing from for :data:`QUIET_PING` seconds is sent a PING (a live peer's ACK answers it; a
dead one's port answers with ICMP).

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
from swarmavg_quic._aioquic import (
    FlowControlledQuic,
    acked_to,
    aioquic_buffered,
    closing_event,
    smoothed_rtt,
    unacked,
    written_to,
)
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
CLOSE_UNREACHABLE: Final = 0x4  # an ICMP error, and the peer answered no PING
#: With streams open, a peer we have heard nothing from for this long (seconds) is sent a PING:
#: a live peer's ACK answers it, the closed port of a dead one answers with ICMP.
QUIET_PING: Final = 1.0
#: A probe (see QuicConnection._suspect) waits max(PROBE_RTTS x smoothed RTT, PROBE_MIN) for
#: the peer to answer its PING, and at most max(PROBE_MAX, 2 x RTT).
PROBE_RTTS: Final = 3
PROBE_MIN: Final = 0.25
PROBE_MAX: Final = 1.0

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
        self._reset_sent = False  # we wrote RESET_STREAM
        #: why we reset the stream ourselves when a message was cut short (a cancelled send)
        self._broken: str | None = None
        #: the offset our large message ends at, once written whole (the connection's
        #: large-message slot is ours until the peer acknowledged up to there)
        self._large_end: int | None = None
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
        if self._closed:
            raise anyio.ClosedResourceError
        if self._broken is not None:
            raise StreamReset(f"{self!r} was reset: {self._broken}")
        if self._sent_eof:
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
            self._large_end = None
        try:
            await self._write([memoryview(_HEADER.pack(size)), *views], eof)
        finally:
            if conn._large_sender is self and self._large_end is None:
                # not written whole: nothing of it is owed to the peer any more
                conn._large_sender = None
                conn._progress.notify()

    async def _write(self, views: list[memoryview], eof: bool) -> None:
        """Hand a whole message to aioquic, at most ``send_buffer`` unacknowledged bytes at a
        time.

        Cut short (cancelled, ``write_timeout`` without the peer taking data, aioquic refusing
        the data), it resets the stream and returns at once, raising what cut it short (the
        cancellation; :class:`StreamReset` for the timeout and aioquic's refusal). If the peer
        reset the stream or the connection broke first, it raises :class:`StreamReset` or
        :class:`ConnectionLost` (a stream the peer stopped reading drops the rest silently)."""
        conn = self._conn
        written = False
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + conn._write_timeout) as timer:
                written = await self._write_all(views, eof, timer)
        except (ValueError, RuntimeError) as exc:  # aioquic finished or reset the stream
            self._reset_midway(f"aioquic refused the data: {exc}")
            raise StreamReset(f"{self!r}: {exc}") from exc
        except BaseException as exc:
            # cancelled in the middle of the message: the stream cannot carry the rest of it
            # later, nor may the peer take the part it got for a whole message
            self._reset_midway(
                "a send was cancelled in the middle of a message"
                if isinstance(exc, anyio.get_cancelled_exc_class())
                else f"a send failed in the middle of a message: {exc!r}"
            )
            raise
        if written:
            if eof:
                self._maybe_forget()
            return
        if timer.cancelled_caught and self._writable_now():
            logger.debug(  # (the peer's doing; the writer gets StreamReset)
                "%r: the peer took no data for %.0f s; resetting the stream",
                self,
                conn._write_timeout,
            )
            self._reset_midway(f"the peer took no data for {conn._write_timeout:g} s")
            raise StreamReset(f"{self!r}: writing a message timed out")
        # the peer ended the stream, or the connection ended: say so (a peer that stopped
        # reading the stream drops the rest silently, as a whole message would be)
        if self._reset_by_peer:
            raise StreamReset(f"{self!r} was reset by the peer")
        if conn._error is not None:
            raise ConnectionLost(str(conn._error)) from conn._error

    async def _write_all(
        self, views: list[memoryview], eof: bool, timer: anyio.CancelScope
    ) -> bool:
        """:meth:`_write`'s loop; ``False`` if the stream or the connection ended first. Each
        time the peer acknowledges data, ``timer`` gets ``write_timeout`` more."""
        conn = self._conn
        quic = conn._quic
        budget = conn._send_buffer
        for view in views:
            offset = 0
            size = view.nbytes
            while offset < size:
                held = unacked(quic, self.id)
                room = budget - held
                if room <= 0:
                    conn._flush()
                    await conn._progress.wait()
                    if not self._writable_now():
                        return False
                    if unacked(quic, self.id) < held:
                        timer.deadline = anyio.current_time() + conn._write_timeout
                    continue
                piece = view[offset : offset + room]
                quic.send_stream_data(self.id, piece)  # type: ignore[arg-type]
                conn._sending.add(self.id)
                offset += piece.nbytes
        if eof:
            quic.send_stream_data(self.id, b"", end_stream=True)
            conn._sending.add(self.id)
            self._send_done = True
        if conn._large_sender is self:
            # the slot stays ours until the peer has acknowledged the message (the pump gives
            # it back: QuicConnection._check_large_sender)
            self._large_end = written_to(quic, self.id) or 0
        conn._flush()
        return True

    def _reset_midway(self, reason: str) -> None:
        """A message was cut short after part of it was written: reset the stream (both ways,
        as :meth:`abort` does), so the peer never takes that part for a message. Our own later
        operations raise :class:`StreamReset` saying ``reason``. Synchronous: a cancelled send
        returns at once."""
        self._broken = reason
        self._discard_inbox()
        conn = self._conn
        if conn._error is None:
            self._reset_quic(ABORTED)
            conn._update_data_credit()
        self._maybe_forget()
        self._changed.notify()
        conn._progress.notify()

    def _writable_now(self) -> bool:
        return not (
            self._reset_by_peer
            or self._stopped
            or self._broken is not None
            or self._conn._error is not None
        )

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
            if self._broken is not None:
                raise StreamReset(f"{self!r} was reset: {self._broken}")
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
            self._reset_sent = True
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
        if conn._error is None and self._broken is None:  # (a reset stream has nothing to say)
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
        if self._conn._error is None and self._broken is None:
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
        # a probe of the peer's liveness (see _suspect): its deadline, when to ping again,
        # the PING ids that answer it, and what started it
        self._probe_deadline: float | None = None
        self._probe_retry_at: float | None = None
        self._probe_pings: set[int] = set()
        self._probe_reason = ""
        self._ping_id = 0  # the last PING id a probe used (keep-alives use 0)
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

    def traffic(self) -> tuple[int, int] | None:
        """Bytes of the packets the peer acknowledged and of the datagrams that came from it
        (QUIC headers and encryption included; a retransmitted packet counts each time it
        arrives); see the abc."""
        quic = self._quic
        return quic.bytes_acked, quic.bytes_received

    def set_pacing_rate(self, rate: float | None) -> bool:
        """``False``: a QUIC connection is not capped; it paces at its congestion control's
        own rate (with ``bbr``, its model of the path). On the network lab, capping each
        connection at its share of the measured upload (what the all-reduce does where it
        can) made rounds over QUIC slower, not faster (see ``docs/design/quic.md``)."""
        return False

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
        if self._large_sender is not None:
            self._check_large_sender()
        self._progress.notify()
        self._rearm()

    def _check_large_sender(self) -> None:
        """Give the large-message slot back once its message was acknowledged (or can no
        longer be: the stream was reset or stopped, or the connection ended)."""
        stream = self._large_sender
        if stream is None or stream._large_end is None:
            return  # (being written: the writer gives it back if it stops short)
        acked = acked_to(self._quic, stream.id)
        if (
            acked is None
            or acked >= stream._large_end
            or stream._reset_sent
            or not stream._writable_now()
        ):
            stream._large_end = None
            self._large_sender = None

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
            deadline = min(deadline, self._next_ping())
            if self._idle_timeout is not None and not self._streams:
                deadline = min(deadline, self._idle_since + self._idle_timeout)
            if self._probe_deadline is not None:
                deadline = min(deadline, self._probe_retry_at or self._probe_deadline)
        return deadline

    def _next_ping(self) -> float:
        """When to PING: a keep-alive interval after the last PING; with streams open, also
        once the peer was quiet for QUIET_PING seconds (since its last packet and our last
        PING), so that a peer that died is noticed while something waits for it."""
        at = self._last_ping + self._keepalive_interval
        if self._streams:
            at = min(at, max(self._last_ping, self._quic.last_heard) + QUIET_PING)
        return at

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
        elif isinstance(event, events.PingAcknowledged):
            if event.uid in self._probe_pings:
                logger.debug("%r: the peer answered the probe (%s)", self, self._probe_reason)
                self._probe_deadline = self._probe_retry_at = None
                self._probe_pings.clear()
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
                    if self._probe_deadline is not None:
                        self._run_probe(now)
                    if self._error is None and now >= self._next_ping():
                        self._last_ping = now
                        quic.send_ping(0)
                    if (
                        self._error is None
                        and self._idle_timeout is not None
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

    def _suspect(self, reason: str) -> None:
        """The peer's address answered with an ICMP error (``reason``) on an established
        connection. ICMP is unauthenticated, so ask the peer: PING it now (and once more
        halfway); if no PING of the probe is acknowledged by the probe deadline, the connection
        is lost (see :meth:`_run_probe`). A probe under way is not restarted."""
        if self._error is not None or self._probe_deadline is not None:
            return
        rtt = smoothed_rtt(self._quic) or 0.0
        wait = min(max(PROBE_RTTS * rtt, PROBE_MIN), max(PROBE_MAX, 2 * rtt))
        now = self._loop.time()  # (may run from a callback: see __init__)
        self._probe_deadline = now + wait
        self._probe_retry_at = now + wait / 2
        self._probe_reason = reason
        logger.debug("%r: %s; probing the peer for %.2f s", self, reason, wait)
        self._probe_ping()
        self._schedule()

    def _probe_ping(self) -> None:
        self._ping_id += 1
        self._probe_pings.add(self._ping_id)
        self._quic.send_ping(self._ping_id)

    def _run_probe(self, now: float) -> None:
        """The driver's turn for a probe: ping again halfway, give up at the deadline."""
        assert self._probe_deadline is not None
        if now >= self._probe_deadline:
            logger.info(
                "%r: %s, and the peer answered no PING: the connection is lost",
                self,
                self._probe_reason,
            )
            self._probe_deadline = self._probe_retry_at = None
            self._probe_pings.clear()
            self._fail(
                ConnectionLost(f"the peer is gone ({self._probe_reason}; it answered no PING)")
            )
            self._close(CLOSE_UNREACHABLE, "unreachable")
        elif self._probe_retry_at is not None and now >= self._probe_retry_at:
            self._probe_retry_at = None
            self._probe_ping()

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
