"""A swarmavg-tcp connection: multiplexed message streams with flow control over one socket.

Theory of operation
-------------------
Each connection has a reader callback and two background tasks (in the transport's task group),
all stopped by :meth:`TcpConnection.aclose`:

* the **reader**, an event-loop callback (``add_reader``, no task switch per read), pulls
  records off the socket into one reusable buffer (large plaintext payloads straight into the
  message's buffer) and dispatches them synchronously. It never writes and never waits for the
  application: flow control bounds what it may buffer, so a slow consumer cannot stall other
  streams, and a peer that ignores the windows is a protocol error that closes the connection.
* the **control writer** sends queued control records (window updates, EOF/STOP/RESET, PING), so
  that ``receive()`` never blocks on the socket and a cancelled ``receive()`` loses nothing.
* the **keeper** sends PINGs when we have been silent, drops a peer that has been silent for too
  long, and closes the connection when it has had no streams for ``idle_timeout``.

Application tasks write DATA records themselves (a small message with one non-blocking
``sendmsg``, no task switch), under one fair (FIFO) lock per connection that is taken per
*record*, so a bulk message (cut into records of up to ``max_record_size``) lets small messages
of other streams through between its records. A stream never carries part of a message, and a
cancelled send returns at once: cancelled before its first record, it sent nothing; cancelled
while the socket is full, it leaves the rest of the batch it was writing (a record cut in two
would break the connection's framing; at most 2 MiB) to a task of the connection, and, unless
that batch ends the message, the stream is reset (RESET after it): the peer drops the part it
got, and its operations and ours raise :class:`StreamReset`. A socket that takes nothing for
``write_timeout`` drops the connection. Nothing in the send path is shielded. On a slow path
the kernel keeps only ~0.1 s of the connection's rate unsent (``TCP_NOTSENT_LOWAT``, from its
pacing rate) and a bulk message's batches are no larger, so a small message waits for about
that, not for a whole send buffer.

Flow control (both numbers come from the *receiver's* settings): a message costs its size plus
``MESSAGE_OVERHEAD`` of credit, of its stream's window and of the connection's. A message costing
more than half a stream window is *large*: it is sent only when no other large message is in
flight on the connection, and it is not charged to the windows. So the receiver's memory for
one connection is bounded by ``connection_window`` plus one ``max_message_size``, whatever the
peer does. The receiver returns credit when the application has read the messages, in batches
of an eighth of a window.

Stream lifecycle: the peer learns of a stream from its first record (a message or EOF). Either
side forgets a stream once it has sent its end (EOF or RESET) and received the other's (EOF or
RESET); a RESET ends both directions at once. Stream ids are odd for streams the dialer opens,
even for the other side's, and increase.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc

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
    RemoteProtocolError,
    StreamReset,
    TransportError,
)
from swarmavg_tcp import _frames as fr
from swarmavg_tcp._buffers import POOL

if TYPE_CHECKING:
    from swarmavg.abc import Buffer
    from swarmavg.address import Address
    from swarmavg.identity import PeerID

logger = logging.getLogger("swarmavg_tcp")

#: A part of a message at least this large starts its own record, so it is never copied to be
#: joined with a neighbour before encryption.
_OWN_RECORD: Final = 64 << 10
_MAX_STREAM_ID: Final = (1 << 32) - 1
#: The flags of a record that holds a whole message and the stream's EOF.
_WHOLE_WITH_EOF: Final = fr.FIRST | fr.LAST | fr.FIN
#: At most this many new streams are answered inline per wake-up of the reader; the rest of a
#: burst is queued for accept_stream (a task each), so a peer that floods calls cannot hold the
#: event loop in one callback.
_INLINE_PER_READ = 32


#: Most control records queued (unwritten because the peer does not read) before the
#: connection is dropped: bounds the memory a peer can make us spend on replies.
_MAX_QUEUED_CONTROL = 1 << 13
#: Plaintext bytes of one message written with one sendmsg while the connection is otherwise idle.
_WRITE_BATCH = 2 << 20
#: Most buffers handed to one sendmsg call (Linux allows IOV_MAX = 1024).
_IOV_BATCH = 512
#: Sealed records of a bulk message are written into one buffer and go several to a sendmsg:
#: at most this many bytes of them. The buffer is written by AES and read by the kernel's copy
#: right after, so it must stay in the core's L2 cache (2 MiB here) beside the data being
#: encrypted: three 256 KiB records (768 KiB) send ~3.7 GB/s on loopback, four (1 MiB) ~2.6.
#: Plaintext records go by _WRITE_BATCH bytes instead, straight from the caller's buffers.
_SEALED_WRITE = 800 << 10
#: Most bytes read into the read buffer at once outside bulk transfers, in plaintext. A record
#: that arrives whole in the read buffer is copied out of it; one that does not is read
#: straight into its message. Reading little at a time after small records keeps the big ones
#: that follow out of the buffer (each copy is a pass over the data), at the price of more
#: reads when many small records come (64 KiB holds hundreds of them).
_SMALL_READ = 64 << 10
#: While the payload of a large record is read straight into its message, the socket's
#: ``SO_RCVLOWAT`` asks the kernel to wake us only once this much of it (or all that is left of
#: the record, if less) is queued: on a path slower than the CPU, the reader otherwise wakes for
#: every few packets, and each wake-up costs a poll, a callback and a ``recv_into``. The mark
#: never exceeds what the sender is bound to send: it writes a record whole once its header went.
#: A record that follows one read whole at once gets no mark (the path is faster than the CPU).
_DIRECT_LOWAT = 128 << 10
#: ... and is not raised for less than this (not worth its system calls).
_MIN_LOWAT = 32 << 10


#: ``struct tcp_info`` (Linux): ``tcpi_last_data_recv`` and ``tcpi_last_ack_recv``,
#: milliseconds since the last data and the last ACK came, are the u32s at this offset (after
#: 8 bytes of u8 fields and 11 u32s).
_TCP_INFO_LAST_RECV: Final = 52


#: ... and from ``tcpi_snd_mss`` (offset 16) on: the MSS, skip ``tcpi_rcv_mss`` and
#: ``tcpi_unacked``, ``tcpi_sacked`` (segments the peer acknowledged selectively, above a
#: hole), skip to ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` (RFC 4898's
#: HCThruOctetsAcked and HCThruOctetsReceived, Linux 4.1+), the u64s at 120.
_TCP_INFO_TRAFFIC: Final = (16, "=I8xI88xQQ")


def _tcp_info(sock: socket.socket, fmt: str, offset: int) -> tuple[int, ...] | None:
    """The fields ``fmt`` (``struct``) at ``offset`` of ``sock``'s ``struct tcp_info``
    (``None``: not Linux, or the socket cannot say, or the kernel's struct is shorter)."""
    if sys.platform != "linux":
        return None
    size = offset + struct.calcsize(fmt)
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, size)
    except OSError:
        return None
    if len(info) < size:
        return None
    return tuple(int(field) for field in struct.unpack_from(fmt, info, offset))


def _since_last_heard(sock: socket.socket) -> float | None:
    """Seconds since ``sock``'s kernel last received data or an acknowledgement from the peer,
    whether or not we read it yet (``None``: cannot say)."""
    fields = _tcp_info(sock, "=II", _TCP_INFO_LAST_RECV)
    return None if fields is None else min(fields) / 1000


def _tcp_traffic(sock: socket.socket) -> tuple[int, int] | None:
    """``sock``'s bytes that reached the peer and bytes received, from the kernel (``None``:
    cannot say). What reached the peer: the bytes it acknowledged plus the segments it
    acknowledged selectively (SACK) times the MSS. The cumulative acknowledgement alone stalls
    behind a lost packet for a round trip or more while the data after it keeps arriving,
    then jumps by all of it: 50 ms samples of it on ``wan`` read up to 8 times the link's
    rate, and peaks over a second ~40% above it."""
    offset, fmt = _TCP_INFO_TRAFFIC
    fields = _tcp_info(sock, fmt, offset)
    if fields is None:
        return None
    mss, sacked, acked, received = fields
    return acked + sacked * mss, received


#: ``tcpi_pacing_rate`` (u64, bytes/s) in ``struct tcp_info``.
_TCP_INFO_PACING_RATE: Final = 104
#: ``TCP_NOTSENT_LOWAT`` (Linux 3.12+): the socket takes more data only while fewer than this
#: many bytes wait unsent in it (what is in flight is not counted).
_TCP_NOTSENT_LOWAT: Final = 25
#: How much of the connection's sending, in seconds at its pacing rate, may wait unsent in the
#: kernel (where nothing can overtake it), within :data:`UNSENT_BOUNDS`. The rest waits in the
#: connection, where a small message goes before the next batch of a bulk one.
UNSENT_SECONDS: Final = 0.1
UNSENT_BOUNDS: Final = (64 << 10, 4 << 20)


def _unsent_limit(sock: socket.socket) -> int | None:
    """The ``TCP_NOTSENT_LOWAT`` for ``sock`` now: :data:`UNSENT_SECONDS` of its pacing rate,
    within :data:`UNSENT_BOUNDS` (``None``: the kernel cannot say its rate)."""
    fields = _tcp_info(sock, "=Q", _TCP_INFO_PACING_RATE)
    if fields is None or not fields[0] or fields[0] == 0xFFFFFFFFFFFFFFFF:
        return None
    low, high = UNSENT_BOUNDS
    return max(low, min(high, int(fields[0] * UNSENT_SECONDS)))


#: ``SO_MAX_PACING_RATE`` (Linux 3.13+): the most bytes/s the kernel sends the socket's data
#: at, spread evenly (TCP's own pacing, or the ``fq`` qdisc); the u32 ``~0`` means no cap.
_SO_MAX_PACING_RATE: Final = 47
_NO_PACING_CAP: Final = 0xFFFFFFFF


def _set_max_pacing_rate(sock: socket.socket, rate: float | None) -> bool:
    """Cap ``sock``'s sending rate at ``rate`` bytes/s (``None``: no cap); ``False`` where the
    kernel cannot (not Linux, or the socket is gone)."""
    if sys.platform != "linux":
        return False
    value = _NO_PACING_CAP if rate is None else max(1, min(int(rate), _NO_PACING_CAP - 1))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, struct.pack("=I", value))
    except OSError:
        return False
    return True


class _FifoLock:
    """A fair lock that costs nothing when free (no checkpoint on the uncontended path)."""

    __slots__ = ("_locked", "_waiters")

    def __init__(self) -> None:
        self._locked = False
        self._waiters: deque[anyio.Event] = deque()

    def try_acquire(self) -> bool:
        if not self._locked and not self._waiters:
            self._locked = True
            return True
        return False

    async def acquire(self) -> None:
        if not self._locked and not self._waiters:
            self._locked = True
            return
        event = anyio.Event()
        self._waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # ownership was handed to us as we were cancelled: pass it on
                self.release()
            else:
                self._waiters.remove(event)
            raise

    @property
    def contended(self) -> bool:
        """Whether a task waits for the lock."""
        return bool(self._waiters)

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # hand over: stays locked
        else:
            self._locked = False


def plan_records(parts: list[memoryview], max_record: int) -> list[list[memoryview]]:
    """Cut a message (the concatenation of ``parts``) into records of at most ``max_record``.

    Big parts start a record of their own, so only small neighbours are ever joined.
    An empty message is one empty record.
    """
    records: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled = 0
    for part in parts:
        size = len(part)
        if filled and size >= _OWN_RECORD and filled + size > max_record:
            records.append(current)
            current, filled = [], 0
        offset = 0
        while offset < size:
            take = min(max_record - filled, size - offset)
            current.append(part[offset : offset + take])
            filled += take
            offset += take
            if filled == max_record:
                records.append(current)
                current, filled = [], 0
    if current or not records:
        records.append(current)
    return records


class TcpStream(Stream):
    """One message stream of a :class:`TcpConnection`."""

    def __init__(self, conn: TcpConnection, stream_id: int, *, announced: bool) -> None:
        self._conn = conn
        self.id = stream_id
        self._announced = announced  # the peer knows this stream
        self._abandon = AbandonCallbacks()
        self._stop_on_data = False  # closed: send STOP if the peer sends another message
        self._held = False  # new, not queued for accept_stream yet: offered to serve_inline first
        self._inbox: deque[tuple[memoryview, int, bool]] = deque()  # (message, cost, large)
        self._changed = Signal()
        self._send_lock = _FifoLock()
        # receiving
        self._partial: object | None = None  # the buffer of the message being received
        self._partial_view: memoryview | None = None
        self._partial_offset = 0
        self._partial_cost = 0
        self._partial_large = False
        self._buffered = 0  # credit charged to messages queued or arriving, not yet read
        self._pending = 0  # credit read by the application, not yet returned to the peer
        self._recv_eof = False  # the peer sent EOF
        self._recv_end = False  # the peer sent EOF or RESET (or we reset)
        self._discarding = False  # we read nothing more: closed or reset
        # sending
        self._credit = conn._peer_settings.stream_window
        self._sent_eof = False  # no more send() from the application
        self._sent_end = False  # we sent EOF or RESET (or the peer reset)
        self._stopped = False  # the peer reads nothing more: sends are dropped
        self._reset_by_peer = False
        #: why we reset the stream ourselves when a message was cut short (a cancelled send)
        self._broken: str | None = None
        self._closed = False  # aclose() or abort() called
        self._attributes: dict[Any, Callable[[], Any]] | None = None  # made on first use

    # -- attributes ------------------------------------------------------------------------------

    @property
    def extra_attributes(self) -> dict[Any, Callable[[], Any]]:
        # built once (extra() looks attributes up on every call), and only if asked for: most
        # streams (calls) never are
        if self._attributes is None:
            stream_id = self.id
            self._attributes = {
                **self._conn._attributes,
                StreamAttribute.stream_id: lambda: stream_id,
            }
        return self._attributes

    @property
    def max_message_size(self) -> int:
        return self._conn._peer_settings.max_message_size

    def __repr__(self) -> str:
        return f"<TcpStream {self.id} to {self._conn._peer_id.short()}>"

    # -- sending ---------------------------------------------------------------------------------

    async def send(self, *parts: Buffer) -> None:
        await self._send(parts, eof=False)

    async def send_last(self, *parts: Buffer) -> None:
        """Send a message and our EOF; a small message and the EOF go out in one write."""
        await self._send(parts, eof=True)
        if not self._sent_eof:  # the peer had stopped reading: the message was dropped
            await self.send_eof()

    async def _send(self, parts: tuple[Buffer, ...], *, eof: bool) -> None:
        if self._broken is not None and not self._closed:
            raise StreamReset(f"{self!r} was reset: {self._broken}")
        if self._closed or self._sent_eof:
            raise anyio.ClosedResourceError
        if self._reset_by_peer:
            raise StreamReset(f"{self!r} was reset by the peer")
        self._conn._check_usable()
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        if size > self.max_message_size:
            raise MessageTooLarge(
                f"a message of {size} bytes exceeds the peer's limit of {self.max_message_size}"
            )
        if self._stopped:
            await anyio.lowlevel.checkpoint()
            return
        await self._send_lock.acquire()
        try:
            await self._conn._send_message(self, views, size, eof)
            if eof and not self._sent_eof:  # not sent with the message (a multi-record one)
                self._sent_eof = True
                self._end_sending(announce=True)
        finally:
            self._send_lock.release()

    def send_last_nowait(self, *parts: Buffer) -> bool:
        if (
            self._closed
            or self._sent_eof
            or self._reset_by_peer
            or self._stopped
            or self._send_lock._locked
            or self._conn._error is not None
        ):
            return False
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        if size > self.max_message_size:
            return False  # (send_last raises MessageTooLarge)
        return self._conn._send_last_nowait(self, views, size)

    async def send_eof(self) -> None:
        if self._sent_eof or self._closed:
            return
        self._sent_eof = True
        await self._send_lock.acquire()  # after any message being sent on this stream
        try:
            self._end_sending(announce=True)
        finally:
            self._send_lock.release()

    def _end_sending(self, *, announce: bool) -> None:
        """Send our EOF (``announce``: even if the peer does not know the stream yet)."""
        if self._sent_end:
            return
        self._sent_end = True
        if self._announced or announce:
            self._announced = True
            self._conn._queue_control(fr.EOF, 0, self.id, 0)
        self._maybe_forget()

    # -- receiving -------------------------------------------------------------------------------

    async def receive(self) -> memoryview:
        waited = False  # (a wait that returned is a checkpoint: no second one)
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._inbox:
                if not waited:
                    await anyio.lowlevel.checkpoint_if_cancelled()  # before taking: none lost
                message, cost, large = self._inbox.popleft()
                self._conn._consumed(self, cost, large)
                return message
            if self._reset_by_peer:
                raise StreamReset(f"{self!r} was reset by the peer")
            if self._broken is not None:
                raise StreamReset(f"{self!r} was reset: {self._broken}")
            if self._recv_eof:
                raise anyio.EndOfStream
            if self._conn._error is not None:
                raise ConnectionLost(str(self._conn._error))
            await self._changed.wait()
            waited = True

    def receive_nowait(self) -> memoryview:
        if self._inbox and not self._closed:
            message, cost, large = self._inbox.popleft()
            self._conn._consumed(self, cost, large)
            return message
        if not self._ended():
            raise anyio.WouldBlock
        if self._closed:
            raise anyio.ClosedResourceError
        if self._reset_by_peer:
            raise StreamReset(f"{self!r} was reset by the peer")
        if self._broken is not None:
            raise StreamReset(f"{self!r} was reset: {self._broken}")
        if self._recv_eof:
            raise anyio.EndOfStream
        raise ConnectionLost(str(self._conn._error))

    def _ended(self) -> bool:
        """Whether receive() would raise now, with nothing queued to read."""
        return (
            self._closed
            or self._reset_by_peer
            or self._broken is not None
            or self._recv_eof
            or self._conn._error is not None
        )

    def on_readable(self, callback: Callable[[], object]) -> bool:
        if self._inbox or self._ended():
            callback()
        else:
            self._changed.add_callback(callback)
        return True

    # -- closing ---------------------------------------------------------------------------------

    def _release_buffers(self) -> None:
        """Give back the credit of everything queued or arriving; read nothing more."""
        self._discarding = True
        conn = self._conn
        for _message, cost, large in self._inbox:
            conn._released(self, cost, large)
        self._inbox.clear()
        if self._partial is not None:
            conn._released(self, self._partial_cost, self._partial_large)
            self._partial = self._partial_view = None

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._sent_end and self._recv_end and not self._inbox and self._partial is None:
            # Both directions are over and everything was read (a call's usual end): nothing
            # to give back, nothing to send.
            self._closed = self._sent_eof = self._discarding = True
            self._changed.notify()
            self._maybe_forget()
            return
        self._closed = True
        self._sent_eof = True
        unread = bool(self._inbox) or self._partial is not None
        self._release_buffers()
        self._changed.notify()
        if not self._conn._error:
            await self._send_lock.acquire()
            try:
                self._end_sending(announce=False)
                if not self._recv_end and self._announced:
                    # Tell the peer to stop sending if it sent what we will not read; if not,
                    # only once it does (most peers are done, and just owe us their EOF):
                    # as TCP answers data for a closed socket with a reset.
                    if unread:
                        self._conn._queue_control(fr.STOP, 0, self.id, 0)
                    else:
                        self._stop_on_data = True
            finally:
                self._send_lock.release()
        self._maybe_forget()

    async def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sent_eof = True
        self._release_buffers()
        self._changed.notify()
        # RESET unless both directions are over: also after our EOF, when the peer still
        # sends (its sends then fail with StreamReset, and it learns we left)
        alive = not self._sent_end or not self._recv_end
        if alive and self._announced and self._conn._error is None:
            self._conn._queue_control(fr.RESET, 0, self.id, fr.CANCELLED)
        self._sent_end = True
        self._recv_end = True  # a RESET ends both directions at once
        self._maybe_forget()

    def _cut_short(self, reason: str) -> None:
        """A message of ours was cut short (its send cancelled after part of it was written):
        reset the stream, as :meth:`abort` does, so that the peer drops the part it got; the
        RESET follows whatever the connection still writes of the message. Our own later
        operations raise :class:`StreamReset` saying ``reason``."""
        self._broken = reason
        self._sent_eof = True
        self._release_buffers()
        self._changed.notify()
        if not (self._sent_end and self._recv_end) and self._conn._error is None:
            self._conn._queue_control(fr.RESET, 0, self.id, fr.CANCELLED)
        self._sent_end = True
        self._recv_end = True  # a RESET ends both directions at once
        self._maybe_forget()

    def _maybe_forget(self) -> None:
        if (self._sent_end and self._recv_end) or (not self._announced and self._closed):
            self._conn._forget(self)

    def _peer_discards(self) -> bool:
        """Whether the peer reads nothing more of what we send (it reset or stopped)."""
        return self._reset_by_peer or self._stopped

    def _is_discarding(self) -> bool:
        return self._discarding

    # -- events from the reader ------------------------------------------------------------------

    def _on_eof(self) -> None:
        if self._recv_eof:
            raise RemoteProtocolError(f"second EOF on stream {self.id}")
        if self._partial is not None:
            raise RemoteProtocolError(f"EOF in the middle of a message on stream {self.id}")
        self._recv_eof = True
        self._recv_end = True
        self._changed.notify()
        self._maybe_forget()

    def _on_reset(self) -> None:
        if self._closed:
            self._recv_end = True
            self._sent_end = True
            self._maybe_forget()
            return
        self._reset_by_peer = True
        self._release_buffers()
        self._recv_end = True
        self._sent_end = True  # the peer forgot the stream: we send nothing more on it
        self._changed.notify()
        self._conn._credit_changed.notify()
        self._maybe_forget()
        self._abandoned()

    def _on_stop(self) -> None:
        self._stopped = True
        self._end_sending(announce=True)
        self._conn._credit_changed.notify()
        self._abandoned()

    def _on_connection_lost(self) -> None:
        self._changed.notify()
        self._abandoned()

    def on_abandoned(self, callback: Callable[[], object]) -> bool:
        gone = self._reset_by_peer or self._stopped or self._conn._error is not None
        return self._abandon.add(callback, abandoned=gone)

    def _abandoned(self) -> None:
        self._abandon.fire()


class TcpConnection(Connection):
    """An authenticated swarmavg-tcp connection (made by :class:`~swarmavg_tcp.TcpTransport`)."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        transport_name: str,
        is_initiator: bool,
        peer_id: PeerID,
        local_address: Address,
        remote_address: Address,
        settings: fr.Settings,
        peer_settings: fr.Settings,
        sealer: fr.Sealer | None,
        opener: fr.Sealer | None,
        keepalive_interval: float,
        idle_timeout: float | None,
        write_timeout: float,
        on_close: Callable[[TcpConnection], None],
    ) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._transport_name = transport_name
        self._is_initiator = is_initiator
        self._peer_id = peer_id
        self._local_address = local_address
        self._remote_address = remote_address
        self._settings = settings
        self._peer_settings = peer_settings
        self._sealer = sealer
        self._opener = opener
        self._keepalive = keepalive_interval
        self._idle_timeout = idle_timeout
        self._write_timeout = write_timeout
        #: the ``TCP_NOTSENT_LOWAT`` set on the socket (``None``: the kernel's, no limit)
        self._unsent_limit: int | None = None
        #: a bulk message's batch ends past this many bytes (or when another writer waits)
        self._batch_bytes = _WRITE_BATCH
        self._on_close = on_close
        # streams
        self._streams: dict[int, TcpStream] = {}
        self._next_id = 1 if is_initiator else 2
        self._last_peer_id = 0
        self._opened_count = 0  # streams we opened, not yet forgotten
        self._accepted_count = 0  # streams the peer opened, not yet forgotten
        self._accept_queue: deque[TcpStream] = deque()
        self._accept_changed = Signal()
        #: see serve_inline: offered each new stream whose opening came whole with its EOF
        self._inline: Callable[[Stream, memoryview], bool] | None = None
        self._inline_left = 0  # offers left in this wake-up of the reader
        self._streams_changed = Signal()
        # sending
        self._write_lock = _FifoLock()
        self._credit = peer_settings.connection_window
        self._large_in_flight = False
        self._credit_changed = Signal()
        self._control: list[tuple[int, int, int, int]] = []
        self._control_changed = Signal()
        tag = fr.TAG_SIZE if sealer is not None else 0
        #: the most one sealed record takes
        self._record_room = fr.HEADER_SIZE + peer_settings.max_record_size + tag
        self._wbuf = bytearray(self._record_room)
        self._wview = memoryview(self._wbuf)
        #: sealed records of a bulk message, written several to a sendmsg (made on first use:
        #: only connections that carry bulk data pay for it)
        self._bulk_wbuf: memoryview | None = None
        self._gbuf = bytearray(peer_settings.max_record_size)  # joins small parts of a record
        self._gview = memoryview(self._gbuf)
        self._pending_out: list[bytes] = []  # the rest of a control write, for the writer
        self._unwritten: list[memoryview] = []  # the rest of the batch being written
        self._flush_scheduled = False
        # receiving
        rtag = fr.TAG_SIZE if opener is not None else 0
        self._rbuf = bytearray(max(2 * (fr.HEADER_SIZE + settings.max_record_size + rtag), 1 << 20))
        # (sealed records are opened from the read buffer whatever their size: read big)
        self._read_size = len(self._rbuf) if rtag else _SMALL_READ
        self._rview = memoryview(self._rbuf)
        #: a full-size sealed record and its successor's header (what a read expects after
        #: a header)
        self._full_record = settings.max_record_size + rtag + fr.HEADER_SIZE
        self._rpos = 0
        self._rend = 0
        self._scratch_view = memoryview(bytearray(settings.max_record_size))
        self._reading = True
        self._record: tuple[bytes, int, int, int, int, int] | None = None  # header being served
        self._out: memoryview | None = None  # where its payload goes
        self._data_stream: TcpStream | None = None
        self._direct: memoryview | None = None
        self._direct_done = 0
        #: the ``SO_RCVLOWAT`` set on the socket (1: the kernel's default), and the most we may
        #: set it to as far as we know: a quarter of the receive buffer when last read (0: none
        #: is set; 1: not read yet). Only where idle_seconds() sees bytes the kernel holds
        #: (Linux's TCP_INFO): elsewhere a slow flow held below the mark would look silent.
        self._lowat = 1
        #: reads of the record being read in place, and whether the next one gets a mark: not
        #: when the last one came whole at the first read (the data comes faster than we read
        #: it: on loopback a mark only cost two system calls per record, ~770 per round and
        #: peer at 4 peers and 64 MiB)
        self._record_reads = 0
        self._mark_records = True
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        self._lowat_cap = 1 if tcp and sys.platform == "linux" else 0
        self._bulk = False  # the last record was read straight into place
        self._buffered = 0
        self._pending = 0
        self._large_active = False
        # state
        now = time.monotonic()
        self._last_receive = now
        self._last_send = now
        self._fast_sends = 0
        self._idle_since: float | None = now
        self._error: BaseException | None = None
        self._closed_event = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._write_scope: anyio.CancelScope | None = None
        self._tasks: anyio.abc.TaskGroup | None = None  # the connection's own (see run)
        self._reader_done = anyio.Event()
        self._attributes = self._make_attributes()

    # -- public API ------------------------------------------------------------------------------

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
            ConnectionAttribute.encrypted: lambda: self._sealer is not None,
        }

    @property
    def is_closed(self) -> bool:
        return self._error is not None

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def idle_seconds(self) -> float | None:
        """Seconds since we last read bytes from the peer or (Linux) since our kernel last
        received data or an acknowledgement from it, whichever is less: a peer that only
        receives from us (its side of a bulk transfer done, ours still going) is heard from
        through its ACKs, and one whose bytes the kernel holds until a low-water mark is met
        (see ``_raise_lowat``) through its data."""
        idle = max(time.monotonic() - self._last_receive, 0.0)
        heard = _since_last_heard(self._sock)
        return idle if heard is None else min(idle, heard)

    def set_pacing_rate(self, rate: float | None) -> bool:
        """The kernel's ``SO_MAX_PACING_RATE`` (Linux; elsewhere ``False``); see the abc."""
        if self.is_closed:
            return False
        return _set_max_pacing_rate(self._sock, rate)

    def traffic(self) -> tuple[int, int] | None:
        """The kernel's count of bytes that reached the peer (acknowledged, or selectively
        acknowledged) and bytes that arrived (Linux; elsewhere ``None``); see the abc."""
        return _tcp_traffic(self._sock)

    def __repr__(self) -> str:
        side = "to" if self._is_initiator else "from"
        return f"<TcpConnection {side} {self._peer_id.short()} at {self._remote_address}>"

    async def open_stream(self) -> TcpStream:
        while True:
            self._check_usable()
            if self._opened_count < self._peer_settings.max_streams:
                break
            await self._streams_changed.wait()
        if self._next_id > _MAX_STREAM_ID:
            raise TransportError("stream ids of this connection are used up: open a new one")
        stream = TcpStream(self, self._next_id, announced=False)
        self._next_id += 2
        self._streams[stream.id] = stream
        self._opened_count += 1
        self._idle_since = None
        await anyio.lowlevel.checkpoint_if_cancelled()
        return stream

    def serve_inline(self, handler: Callable[[Stream, memoryview], bool] | None) -> bool:
        self._inline = handler
        return True

    async def accept_stream(self) -> TcpStream:
        if self._accept_queue:
            await anyio.lowlevel.checkpoint()  # ready at once: still let others run
        while not self._accept_queue:  # (waiting was a checkpoint: no second one)
            self._check_usable()
            await self._accept_changed.wait()
        return self._accept_queue.popleft()

    async def aclose(self) -> None:
        await self._close(fr.NO_ERROR, ConnectionLost("the connection was closed"))

    # -- state -----------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._error is not None:
            raise ConnectionLost(str(self._error))

    def _forget(self, stream: TcpStream) -> None:
        if self._streams.pop(stream.id, None) is None:
            return
        if (stream.id % 2 == 1) == self._is_initiator:
            self._opened_count -= 1
        else:
            self._accepted_count -= 1
        if not self._streams:
            self._idle_since = time.monotonic()
        self._streams_changed.notify()

    async def _close(self, code: int, error: BaseException) -> None:
        if self._error is not None:
            await self._closed_event.wait()
            return
        self._error = error
        self._wake_everyone()
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self._write_lock.acquire()
                try:
                    self._control.append((fr.GOAWAY, 0, 0, code))
                    await self._flush_control()
                    self._sock.shutdown(socket.SHUT_WR)
                finally:
                    self._write_lock.release()
                # read (and drop) until the peer closes too, so that closing our socket with
                # unread data cannot reset the connection before the peer read our GOAWAY
                await self._reader_done.wait()
        except OSError:
            pass
        finally:
            self._teardown()

    def _fail(self, error: BaseException) -> None:
        """Drop the connection at once (protocol error, broken socket); nothing more is sent."""
        if self._error is None:
            self._error = error
            logger.debug("%r failed: %s", self, error)
            self._wake_everyone()
        self._teardown()

    def _wake_everyone(self) -> None:
        for stream in list(self._streams.values()):
            stream._on_connection_lost()
        self._accept_changed.notify()
        self._credit_changed.notify()
        self._streams_changed.notify()
        self._control_changed.notify()

    def _teardown(self) -> None:
        if self._closed_event.is_set():
            return
        self._reading = False
        self._reader_done.set()
        if self._write_scope is not None:
            self._write_scope.cancel()
        if self._scope is not None:
            self._scope.cancel()
        try:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        except (ValueError, OSError):
            pass
        self._sock.close()
        self._closed_event.set()
        self._on_close(self)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run the connection's background tasks until it closes (in the transport's group)."""
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._error is not None:
                    scope.cancel()
                else:
                    self._loop.add_reader(self._sock.fileno(), self._on_readable)
                    self._bound_unsent()  # (from the handshake's round trips)
                async with anyio.create_task_group() as tg:
                    self._tasks = tg
                    tg.start_soon(self._control_writer)
                    tg.start_soon(self._keeper)
                    task_status.started()
        finally:
            self._tasks = None
            if self._error is None:
                self._fail(ConnectionLost("the transport was closed"))

    # -- sending ---------------------------------------------------------------------------------

    async def _send_message(
        self, stream: TcpStream, parts: list[memoryview], size: int, eof: bool = False
    ) -> None:
        """Send one message of ``stream``; with ``eof``, a one-record message carries the
        stream's EOF in the same write (the caller sends it otherwise)."""
        peer = self._peer_settings
        cost = size + fr.MESSAGE_OVERHEAD
        large = peer.is_large(size)
        while True:  # wait for credit; cancelling here sends nothing
            self._check_usable()
            if stream._reset_by_peer:
                raise StreamReset(f"{stream!r} was reset by the peer")
            if stream._stopped:
                return
            if large:
                if not self._large_in_flight:
                    self._large_in_flight = True
                    break
            elif stream._credit >= cost and self._credit >= cost:
                stream._credit -= cost
                self._credit -= cost
                break
            await self._credit_changed.wait()
        # (records no larger than a batch: a small message goes between two of them)
        records = plan_records(parts, min(peer.max_record_size, self._batch_bytes))
        stream._announced = True
        if len(records) == 1 and self._write_lock.try_acquire():
            # fast path (small messages): write at once, no cancel scopes, no task switch
            try:
                buffers = [self._compose_control()] if self._control else []
                flags = fr.FIRST | fr.LAST | (fr.FIN if eof else 0)  # FIN: the EOF rides along
                buffers += self._compose(stream.id, flags, size, records[0])
            except BaseException:
                self._write_lock.release()
                raise
            if eof:
                stream._sent_eof = stream._sent_end = True
                stream._maybe_forget()
            # (if the socket is full and we are cancelled, the connection writes the rest: the
            # message arrives whole)
            await self._write_batch(buffers)
            self._check_usable()
            self._fast_sends += 1
            if self._fast_sends % 32 == 0:  # let other tasks run in a long burst of sends
                await anyio.lowlevel.checkpoint()
            return
        try:
            # Waiting for the first turn to write can be cancelled (nothing was sent): another
            # writer may hold the lock for up to write_timeout while the peer reads nothing.
            await self._write_lock.acquire()
        except BaseException:
            self._take_back(stream, large, cost)
            raise
        held = True
        sent_first = False
        last_batch = False  # (cancelled in it, the message still goes out whole)
        index, last = 0, len(records) - 1
        try:
            while index <= last:
                if not held:
                    await self._write_lock.acquire()
                    held = True
                if self.is_closed or stream._peer_discards():
                    break  # (the peer discards the rest of this message)
                sent_first = True
                # Plaintext records go several to a sendmsg while nobody else waits to write,
                # up to _batch_bytes (0.1 s of the rate on a slow path: what a small message
                # may wait for, beside what is unsent in the kernel); a sealed record lives in
                # the one write buffer until it is written. Queued control records go first,
                # in the same write.
                buffers = [self._compose_control()] if self._control else []
                batched = 0
                # (a message of one record, here because another writer held the lock, is
                # sealed into the write buffer: no bulk buffer for it)
                out = self._bulk_buffer() if self._sealer is not None and last > 0 else None
                while True:
                    pieces = records[index]
                    flags = (fr.FIRST if index == 0 else 0) | (fr.LAST if index == last else 0)
                    if out is None:
                        buffers += self._compose(stream.id, flags, size, pieces)
                    else:  # sealed into the bulk buffer, one record after the other
                        sealed = self._compose(stream.id, flags, size, pieces, out[batched:])
                        buffers += sealed
                        batched += len(sealed[0])
                    if out is None:
                        batched += sum(len(p) for p in pieces)
                    index += 1
                    if (
                        index > last
                        or batched >= self._batch_bytes
                        or self._write_lock.contended
                        or (out is not None and len(out) - batched < self._record_room)
                    ):
                        break
                held = False  # (released, or handed over, by _write_batch)
                last_batch = index > last
                await self._write_batch(buffers)
        except BaseException:
            if held:
                self._write_lock.release()
            if sent_first and not last_batch and self._error is None:
                # cancelled with part of the message written: the peer must not take that
                # part for a message, nor may the stream carry the rest later
                stream._cut_short("a send was cancelled in the middle of a message")
            elif not sent_first:
                self._take_back(stream, large, cost)
            raise
        if held:  # (the connection closed, or the peer stopped reading, before we wrote)
            self._write_lock.release()
        if not sent_first:  # the peer never heard of this message: take the reservation back
            self._take_back(stream, large, cost)
        self._check_usable()
        if index <= last and stream._reset_by_peer:  # (a peer that stopped reading drops it)
            raise StreamReset(f"{stream!r} was reset by the peer during a send")

    def _send_last_nowait(self, stream: TcpStream, parts: list[memoryview], size: int) -> bool:
        """:meth:`TcpStream.send_last_nowait`: a one-record message and its EOF, written now
        if there is credit and nobody else is writing."""
        peer = self._peer_settings
        cost = size + fr.MESSAGE_OVERHEAD
        if peer.is_large(size) or stream._credit < cost or self._credit < cost:
            return False
        records = plan_records(parts, peer.max_record_size)
        if len(records) != 1 or not self._write_lock.try_acquire():
            return False
        stream._credit -= cost
        self._credit -= cost
        stream._announced = True
        try:
            buffers = [self._compose_control()] if self._control else []
            buffers += self._compose(stream.id, fr.FIRST | fr.LAST | fr.FIN, size, records[0])
            stream._sent_eof = stream._sent_end = True
            stream._maybe_forget()
            left = self._write_now(buffers)
        except OSError as exc:
            self._write_lock.release()
            self._fail(ConnectionLost(f"writing to the socket failed: {exc}"))
            return True
        if left:  # the control writer finishes it, holding the lock meanwhile
            self._pending_out = [bytes(view) for view in left]
            self._control_changed.notify()
        else:
            self._write_lock.release()
        return True

    def _take_back(self, stream: TcpStream, large: bool, cost: int) -> None:
        """Return a message's reservation (credit, or the large-message slot) unsent."""
        if large:
            self._large_in_flight = False
        else:
            stream._credit += cost
            self._credit += cost
        self._credit_changed.notify()

    def _bulk_buffer(self) -> memoryview:
        """The buffer that sealed records of bulk messages are written into, a few at a time:
        as many as fit in _SEALED_WRITE bytes; the write buffer itself when only one does (the
        peer's max_record_size, up to 16 MiB, must not multiply what a connection allocates)."""
        if self._bulk_wbuf is None:
            count = _SEALED_WRITE // self._record_room
            self._bulk_wbuf = (
                memoryview(bytearray(count * self._record_room)) if count > 1 else self._wview
            )
        return self._bulk_wbuf

    def _compose(
        self,
        stream_id: int,
        flags: int,
        total: int,
        pieces: list[memoryview],
        out: memoryview | None = None,
    ) -> list[Any]:
        """The buffers of one DATA record (sealed into ``out``, by default the write buffer,
        when encrypting)."""
        length = sum(len(p) for p in pieces)
        arg = total if flags & fr.FIRST else 0
        if self._sealer is None:
            return [fr.HEADER.pack(length, fr.DATA, flags, 0, stream_id, arg), *pieces]
        wview = self._wview if out is None else out
        fr.HEADER.pack_into(wview, 0, length, fr.DATA, flags, 0, stream_id, arg)
        if len(pieces) == 1:
            plain = pieces[0]
        else:
            offset = 0
            for piece in pieces:
                self._gview[offset : offset + len(piece)] = piece
                offset += len(piece)
            plain = self._gview[:length]
        end = fr.HEADER_SIZE + length + fr.TAG_SIZE
        self._sealer.seal_into(wview[: fr.HEADER_SIZE], plain, wview[fr.HEADER_SIZE : end])
        return [wview[:end]]

    def _write_now(self, buffers: list[Any]) -> list[memoryview]:
        """Write what the socket takes without waiting; return what is left."""
        start = 0
        sent = 0
        batch: list[Any] = []
        # At most _IOV_BATCH buffers per sendmsg: the kernel refuses more than IOV_MAX (1024
        # on Linux) with EMSGSIZE, and a message may have thousands of parts.
        while start < len(buffers):
            batch = buffers[start : start + _IOV_BATCH]
            start += len(batch)
            total = sum(len(b) for b in batch)
            try:
                sent = self._sock.sendmsg(batch) if len(batch) > 1 else self._sock.send(batch[0])
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent != total:
                break
        self._last_send = time.monotonic()
        if sent == sum(len(b) for b in batch) and start >= len(buffers):
            return []
        left: list[memoryview] = []
        for buf in batch:
            view = memoryview(buf)
            if sent >= len(view):
                sent -= len(view)
                continue
            left.append(view[sent:])
            sent = 0
        left.extend(memoryview(b) for b in buffers[start:])
        return left

    async def _write_all(
        self, buffers: list[memoryview], scope: anyio.CancelScope | None = None
    ) -> None:
        """Write everything, waiting for the socket (the caller holds the write lock). Callers
        shield this from their own cancellation; the connection's teardown still ends it (a
        closed socket never becomes writable) by cancelling ``scope``, the caller's scope
        around the write, or one of its own."""
        if scope is None:
            with anyio.CancelScope() as own:
                await self._write_all(buffers, own)
            return
        self._write_scope = scope
        try:
            if self._error is None:
                for view in buffers:
                    await self._loop.sock_sendall(self._sock, view)
                self._last_send = time.monotonic()
        finally:
            self._write_scope = None
        if self._error is not None:
            raise ConnectionResetError("the connection closed while writing")

    async def _write_batch(self, buffers: list[Any], *, hand_over: bool = True) -> None:
        """Write ``buffers`` holding the write lock, and release it.

        Waits for the socket as needed, not shielded: the connection is dropped if the socket
        takes nothing for ``write_timeout``, and a failed write fails the connection (the
        caller sees it in ``_error``). Cancelled before the socket took everything, it hands
        the rest, copied, to a task of the connection (:meth:`_finish_batch`: a record cut in
        two would break the framing of the whole connection), which writes it and the queued
        control records, then releases the lock; and re-raises at once. So a cancelled send
        returns promptly, and what it leaves is at most one batch (2 MiB) for the connection
        to finish.
        """
        handed = False
        try:
            self._unwritten = self._write_now(buffers)
            if self._unwritten:
                with anyio.CancelScope(
                    deadline=anyio.current_time() + self._write_timeout
                ) as scope:
                    self._write_scope = scope  # the connection's teardown ends the wait too
                    try:
                        await self._drain(scope)
                    finally:
                        self._write_scope = None
                if scope.cancelled_caught and self._error is None:
                    self._fail(ConnectionLost(f"the peer read nothing for {self._write_timeout} s"))
        except OSError as exc:
            self._fail(ConnectionLost(f"writing to the socket failed: {exc}"))
        except BaseException:
            if self._unwritten and self._error is None:
                if hand_over and self._tasks is not None:
                    rest = [bytes(view) for view in self._unwritten]
                    self._tasks.start_soon(self._finish_batch, rest)
                    handed = True
                else:
                    self._fail(ConnectionLost("a write was cut short"))
            raise
        finally:
            self._unwritten = []
            if not handed:
                self._write_lock.release()

    async def _drain(self, scope: anyio.CancelScope) -> None:
        """Wait until the socket has taken ``_unwritten``, writing from the event loop's
        writable callback (as ``sock_sendall`` does: one task wake-up per batch, not one per
        writable event), so that, when the wait is cancelled, ``_unwritten`` is exactly what is
        left. Each time the socket takes data, ``scope`` gets ``write_timeout`` more."""
        loop = self._loop
        fd = self._sock.fileno()
        self._bound_unsent()
        done: asyncio.Future[None] = loop.create_future()

        def on_writable() -> None:
            if done.done():  # (cancelled: the waiting task removes us when it resumes)
                return
            try:
                self._unwritten = self._write_now(self._unwritten)
            except OSError as exc:
                loop.remove_writer(fd)
                done.set_exception(exc)
                return
            if self._unwritten:
                scope.deadline = anyio.current_time() + self._write_timeout
            else:
                loop.remove_writer(fd)
                done.set_result(None)

        loop.add_writer(fd, on_writable)
        try:
            await done
        finally:
            if self._sock.fileno() == fd:  # (not closed by the teardown, which removed it)
                loop.remove_writer(fd)

    def _bound_unsent(self) -> None:
        """Keep what waits unsent in the kernel, and a bulk message's batches, to about
        :data:`UNSENT_SECONDS` of the connection's rate (called when the connection starts and
        when the socket is full, so at most once a batch): on a slow path a full 4 MiB send
        buffer is seconds of bulk that a control record, an RPC or a keep-alive would otherwise
        queue behind (11 s for a flow at a 7th of 20 Mbit/s), and so is a 2 MiB batch."""
        limit, current = _unsent_limit(self._sock), self._unsent_limit
        if limit is None or (current is not None and current / 1.5 <= limit <= current * 1.5):
            return  # (close enough: no system call for every wobble of the rate)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, limit)
        except OSError:
            return
        self._unsent_limit = limit
        # (a batch being written holds the lock: what a small message waits for beyond it)
        self._batch_bytes = min(_WRITE_BATCH, limit)

    async def _finish_batch(self, rest: list[bytes]) -> None:
        """Write the rest of a batch whose writer was cancelled, then the control records
        queued meanwhile (the RESET of a message cut short among them); the writer left us
        the write lock, which this releases."""
        buffers: list[Any] = list(rest)
        if self._control:
            buffers.append(self._compose_control())
        await self._write_batch(buffers, hand_over=False)

    def _queue_control(self, ftype: int, flags: int, stream_id: int, arg: int) -> None:
        """Send a control record soon: with the next message written in this turn of the event
        loop, or at the end of the turn (so a burst of them costs one write)."""
        if self._error is not None:
            return
        if len(self._control) >= _MAX_QUEUED_CONTROL:
            # An honest peer keeps this short (credit replies are batched, one large message
            # is in flight); a peer that makes us answer while it reads nothing does not.
            self._fail(ConnectionLost("the peer does not read what it makes us send"))
            return
        self._control.append((ftype, flags, stream_id, arg))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_control_soon)

    def _flush_control_soon(self) -> None:
        self._flush_scheduled = False
        if not self._control or self._error is not None:
            return
        if not self._write_lock.try_acquire():
            self._control_changed.notify()
            return
        try:
            left = self._write_now([self._compose_control()])
        except OSError as exc:
            self._write_lock.release()
            self._fail(ConnectionLost(f"writing to the socket failed: {exc}"))
            return
        if left:  # the control writer finishes it, holding the lock meanwhile
            self._pending_out = [bytes(view) for view in left]
            self._control_changed.notify()
        else:
            self._write_lock.release()

    def _compose_control(self) -> bytearray:
        """The queued control records, sealed, as one buffer (empties the queue)."""
        control, self._control = self._control, []
        buf = bytearray()
        for ftype, flags, stream_id, arg in control:
            header = fr.HEADER.pack(0, ftype, flags, 0, stream_id, arg)
            buf += header
            if self._sealer is not None:
                start = len(buf)
                buf += bytes(fr.TAG_SIZE)
                self._sealer.seal_into(header, memoryview(b""), memoryview(buf)[start:])
        return buf

    async def _flush_control(self) -> None:
        """Write every queued control record (the caller holds the write lock)."""
        if self._control:
            left = self._write_now([self._compose_control()])
            if left:
                await self._write_all(left)

    async def _control_writer(self) -> None:
        while self._error is None:
            pending = self._pending_out
            if not pending and not self._control:
                await self._control_changed.wait()
                continue
            if pending:  # _queue_control left us the lock and the rest of its write
                self._pending_out = []
            else:
                await self._write_lock.acquire()
            try:
                with anyio.move_on_after(self._write_timeout) as timer:
                    if pending:
                        await self._write_all([memoryview(b) for b in pending])
                    await self._flush_control()
            except OSError as exc:
                self._fail(ConnectionLost(f"writing to the socket failed: {exc}"))
            finally:
                self._write_lock.release()
            if timer.cancelled_caught:
                self._fail(ConnectionLost(f"the peer read nothing for {self._write_timeout} s"))

    async def _keeper(self) -> None:
        period = min(self._keepalive, self._idle_timeout or self._keepalive) / 3
        while self._error is None:
            await anyio.sleep(period)
            now = time.monotonic()
            if now - self._last_receive > 3 * self._keepalive:
                self._fail(ConnectionLost(f"the peer was silent for {3 * self._keepalive} s"))
                return
            if now - self._last_send > self._keepalive and not self._control:
                self._queue_control(fr.PING, 0, 0, 0)
            idle = self._idle_since
            if (
                self._idle_timeout is not None
                and idle is not None
                and now - idle > self._idle_timeout
            ):
                logger.debug("closing %r: idle for %s s", self, self._idle_timeout)
                await self._close(fr.IDLE, ConnectionLost("the connection was closed when idle"))
                return

    # -- flow control, receiving side ------------------------------------------------------------

    def _consumed(self, stream: TcpStream, cost: int, large: bool) -> None:
        """The application read a message: give its credit back (batched)."""
        if large:
            self._large_active = False
            self._queue_control(fr.WINDOW, fr.LARGE_DONE, stream.id, 0)
            return
        stream._buffered -= cost
        stream._pending += cost
        self._buffered -= cost
        self._pending += cost
        if stream._pending >= self._settings.stream_window // 8 and not stream._recv_end:
            self._queue_control(fr.WINDOW, 0, stream.id, stream._pending)
            stream._pending = 0
        if self._pending >= self._settings.connection_window // 8:
            self._queue_control(fr.WINDOW, 0, 0, self._pending)
            self._pending = 0

    def _released(self, stream: TcpStream, cost: int, large: bool) -> None:
        """A message was dropped unread (stream closed or reset): give its credit back."""
        if large:
            self._large_active = False
            self._queue_control(fr.WINDOW, fr.LARGE_DONE, stream.id, 0)
            return
        stream._buffered -= cost
        self._buffered -= cost
        self._credit_back(cost)

    def _credit_back(self, cost: int) -> None:
        self._pending += cost
        if self._pending >= self._settings.connection_window // 8:
            self._queue_control(fr.WINDOW, 0, 0, self._pending)
            self._pending = 0

    # -- the reader ------------------------------------------------------------------------------
    #
    # A callback of the event loop (``add_reader``), not a task: it runs as soon as the socket is
    # readable, reads what it can without blocking, and dispatches every complete record
    # synchronously. Nothing it calls (stream callbacks and the inline handler included) may
    # call an anyio function that needs to know the async library (anyio < 4.16 cannot tell
    # it outside a task): clocks are the loop's, tasks are started with start_soon. A plaintext
    # payload of a large record is read straight into the message's buffer (``_direct``);
    # everything else goes through the reusable read buffer.

    def _on_readable(self) -> None:
        self._inline_left = _INLINE_PER_READ
        try:
            budget = 8 << 20  # then give other callbacks and tasks a turn
            while budget > 0 and self._reading:
                direct = self._direct
                if direct is not None:
                    target = direct[self._direct_done :]
                else:
                    if self._rpos == self._rend:
                        self._rpos = self._rend = 0
                        # after a bulk record, read just the next header: its payload most
                        # likely goes straight into a message buffer, not through ours
                        end = fr.HEADER_SIZE if self._bulk else self._read_size
                    else:
                        if self._rend == len(self._rbuf):
                            self._compact()
                        end = min(len(self._rbuf), self._rend + self._read_size)
                    if self._opener is not None:
                        end = self._sealed_read_end(end)
                    target = self._rview[self._rend : end]
                try:
                    n = self._sock.recv_into(target)
                except (BlockingIOError, InterruptedError):
                    break
                if n == 0:
                    raise ConnectionLost("the peer closed the connection without saying goodbye")
                budget -= n
                drained = n < len(target)  # a short read: no need to ask again (EAGAIN)
                if direct is not None:
                    self._direct_done += n
                    self._record_reads += 1
                    rest = len(direct) - self._direct_done
                    if rest == 0:
                        self._mark_records = self._record_reads > 1
                        self._direct = None
                        self._bulk = True
                        if self._lowat > 1:
                            self._set_lowat(1)
                        self._end_data()
                    elif self._lowat > rest:  # (never wait for more than the record holds)
                        self._set_lowat(rest)
                else:
                    self._rend += n
                    self._process()
                if drained:
                    break
            self._last_receive = time.monotonic()
        except RemoteProtocolError as exc:
            logger.debug("dropping %r: protocol error: %s", self, exc)  # (the peer's doing)
            self._protocol_error(exc)
        except ConnectionLost as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(ConnectionLost(f"reading from the socket failed: {exc}"))

    def _raise_lowat(self, rest: int) -> None:
        """Let the kernel wake the reader only once ``min(rest, _DIRECT_LOWAT)`` bytes of the
        record being read in place are queued, if the receive buffer is large enough.

        At most a quarter of ``SO_RCVBUF``: a larger mark makes Linux grow the buffer *and*
        clamp the receive window to the mark (``tcp_set_rcvlowat``), which would cap the
        connection's rate; the buffer grows by itself as the connection speeds up."""
        mark = min(rest, _DIRECT_LOWAT)
        try:
            if mark > self._lowat_cap:
                self._lowat_cap = min(
                    self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4, _DIRECT_LOWAT
                )
                mark = min(mark, self._lowat_cap)
            if mark >= _MIN_LOWAT:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
                self._lowat = mark
        except OSError:  # (a platform without it: read as the data comes)
            self._lowat_cap = 0

    def _set_lowat(self, mark: int) -> None:
        """Lower the mark (an error fails the connection: a mark left above what is coming
        would never wake the reader)."""
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
        self._lowat = mark

    def _sealed_read_end(self, end: int) -> int:
        """Where a read of sealed records into the read buffer should end (at most ``end``):
        at the end of the record being read and its successor's header, then of as many
        full-size records after it as fit. Reads that end between records leave the buffer
        empty once the records are opened, so no partial record is moved to its front
        (moving them cost a third of the bytes received in bulk transfers)."""
        avail = self._rend - self._rpos
        record = self._record
        if record is None:  # (a header is due: fewer than HEADER_SIZE bytes of it are here)
            need = fr.HEADER_SIZE - avail
        else:  # its payload and tag start at _rpos; then the next header
            need = record[1] + fr.TAG_SIZE - avail + fr.HEADER_SIZE
        aligned = self._rend + need
        if aligned >= end:
            return end
        return aligned + (end - aligned) // self._full_record * self._full_record

    def _compact(self) -> None:
        unread = self._rend - self._rpos
        self._rview[:unread] = self._rview[self._rpos : self._rend]
        self._rpos, self._rend = 0, unread

    def _process(self) -> None:
        """Dispatch every complete record in the read buffer."""
        tag = fr.TAG_SIZE if self._opener is not None else 0
        while self._reading:
            avail = self._rend - self._rpos
            if self._record is None:
                if avail < fr.HEADER_SIZE:
                    if self._rpos + fr.HEADER_SIZE > len(self._rbuf):
                        self._compact()
                    return
                pos = self._rpos
                length, ftype, flags, reserved, stream_id, arg = fr.HEADER.unpack_from(
                    self._rbuf, pos
                )
                fr.check_header(length, ftype, flags, reserved, self._settings.max_record_size)
                header = bytes(self._rview[pos : pos + fr.HEADER_SIZE])
                self._rpos = pos + fr.HEADER_SIZE
                avail -= fr.HEADER_SIZE
                self._record = (header, length, ftype, flags, stream_id, arg)
                if ftype == fr.DATA:
                    self._out = self._begin_data(stream_id, flags, arg, length)
            header, length, ftype, flags, stream_id, arg = self._record
            out = self._out
            if (
                ftype == fr.DATA
                and out is not None
                and not tag
                and length > 4096
                and avail < length
            ):
                self._bulk = True
                out[:avail] = self._rview[self._rpos : self._rend]  # the rest goes straight there
                self._rpos = self._rend
                self._direct = out
                self._direct_done = avail
                self._record_reads = 0
                if self._lowat_cap and self._mark_records:
                    self._raise_lowat(length - avail)
                return
            sealed = length + tag
            if avail < sealed:
                if self._rpos + sealed > len(self._rbuf):
                    self._compact()
                return
            payload = self._rview[self._rpos : self._rpos + sealed]
            self._rpos += sealed
            self._bulk = False
            if self._opener is not None:
                target = out if out is not None else self._scratch_view[:length]
                self._opener.open_into(header, payload, target)
            elif out is not None:
                out[:] = payload
            if ftype == fr.DATA:
                self._end_data()
            elif ftype == fr.GOAWAY:
                self._record = None
                self._on_goaway(arg)
                return
            else:
                self._record = None
                self._on_control(ftype, flags, stream_id, arg)

    def _begin_data(self, stream_id: int, flags: int, arg: int, length: int) -> memoryview | None:
        """Check a DATA header; return where its payload goes (None: read and drop it)."""
        whole_with_eof = flags & _WHOLE_WITH_EOF == _WHOLE_WITH_EOF
        stream = self._lookup(stream_id, create=True, hold=whole_with_eof and bool(self._inline))
        self._data_stream = stream
        settings = self._settings
        if stream is not None and stream._recv_end and not stream._discarding:
            raise RemoteProtocolError(f"data after EOF on stream {stream_id}")
        if flags & fr.FIRST:
            total = arg
            if total > settings.max_message_size:
                raise RemoteProtocolError(
                    f"a message of {total} bytes exceeds our limit of {settings.max_message_size}"
                )
            cost = total + fr.MESSAGE_OVERHEAD
            large = settings.is_large(total)
            if stream is not None and stream._stop_on_data:
                stream._stop_on_data = False
                self._queue_control(fr.STOP, 0, stream_id, 0)
            if stream is None or stream._discarding:
                if large:
                    self._queue_control(fr.WINDOW, fr.LARGE_DONE, stream_id, 0)
                else:
                    self._credit_back(cost)
                self._data_stream = None
                return None
            if stream._partial is not None:
                raise RemoteProtocolError(f"a message started inside another on stream {stream_id}")
            if large:
                if self._large_active:
                    raise RemoteProtocolError("the peer sent a large message without credit")
                self._large_active = True
            else:
                if (
                    stream._buffered + cost > settings.stream_window
                    or self._buffered + cost > settings.connection_window
                ):
                    raise RemoteProtocolError("the peer exceeded its flow-control window")
                stream._buffered += cost
                self._buffered += cost
            # uninitialised and recycled (see _buffers): every byte is written before delivery
            stream._partial_view = POOL.get(total)
            stream._partial = stream._partial_view
            stream._partial_offset = 0
            stream._partial_cost = cost
            stream._partial_large = large
        elif stream is None or stream._discarding:
            self._data_stream = None
            return None
        elif stream._partial is None:
            raise RemoteProtocolError(f"a message continued that never started on {stream_id}")
        view = stream._partial_view
        assert view is not None
        offset = stream._partial_offset
        end = offset + length
        if end > len(view):
            raise RemoteProtocolError(f"a message on stream {stream_id} overran its size")
        if bool(flags & fr.LAST) != (end == len(view)):
            raise RemoteProtocolError(f"a message on stream {stream_id} was framed wrongly")
        stream._partial_offset = end
        return view[offset:end]

    def _end_data(self) -> None:
        """The payload of the current DATA record is in place."""
        record, stream = self._record, self._data_stream
        self._record = self._out = self._data_stream = None
        if record is None:
            return
        if stream is not None and not stream._is_discarding() and record[3] & fr.LAST:
            view = stream._partial_view
            assert view is not None
            stream._inbox.append((view, stream._partial_cost, stream._partial_large))
            stream._partial = stream._partial_view = None
            stream._changed.notify()
        if record[3] & fr.FIN:  # the stream's EOF, also for a stream we are discarding
            eof_stream = self._lookup(record[4], create=False)
            if eof_stream is not None:
                eof_stream._on_eof()
        if stream is not None and stream._held:
            self._offer_inline(stream)

    def _offer_inline(self, stream: TcpStream) -> None:
        """A new stream's whole opening and its EOF are here: offer it to the inline handler;
        queue it for accept_stream unless the handler took it."""
        stream._held = False
        handler = self._inline
        if handler is not None and stream._inbox and not stream._closed and self._inline_left > 0:
            self._inline_left -= 1
            message, cost, large = stream._inbox[0]
            try:
                taken = handler(stream, message)
            except Exception:  # (a bug: the handler must not raise) accept_stream serves it
                logger.exception("the inline stream handler failed")
                taken = False
            if taken:
                if stream._inbox and stream._inbox[0][0] is message:
                    stream._inbox.popleft()
                    self._consumed(stream, cost, large)
                return
        self._accept_queue.append(stream)
        self._accept_changed.notify()

    def _lookup(self, stream_id: int, *, create: bool, hold: bool = False) -> TcpStream | None:
        """The stream a record is for; None for a stream already forgotten. A stream the peer
        opens with this record is queued for accept_stream, unless ``hold``: then it is offered
        to the inline handler first, once the record is in (see _offer_inline)."""
        if stream_id == 0:
            raise RemoteProtocolError("stream 0 carries no stream records")
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        if (stream_id % 2 == 1) == self._is_initiator:  # one of ours
            if stream_id >= self._next_id:
                raise RemoteProtocolError(f"record for stream {stream_id} that we never opened")
            return None
        if stream_id <= self._last_peer_id or not create:
            return None
        if self._accepted_count >= self._settings.max_streams:
            raise RemoteProtocolError(
                f"the peer opened more than {self._settings.max_streams} streams"
            )
        self._last_peer_id = stream_id
        if len(self._accept_queue) >= self._settings.max_streams:
            # Streams the peer ended (or reset) before our application accepted them no longer
            # count against max_streams, yet wait in the queue: refuse more rather than queue
            # without bound. The peer sees StreamReset; its records for the stream are dropped.
            self._queue_control(fr.RESET, 0, stream_id, fr.REFUSED)
            return None
        stream = TcpStream(self, stream_id, announced=True)
        self._streams[stream_id] = stream
        self._accepted_count += 1
        self._idle_since = None
        if hold:
            stream._held = True
        else:
            self._accept_queue.append(stream)
            self._accept_changed.notify()
        return stream

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        if self._error is None:
            # best effort: tell the peer why, without waiting for anything
            try:
                header = fr.HEADER.pack(0, fr.GOAWAY, 0, 0, 0, fr.PROTOCOL_ERROR)
                if self._sealer is None and not self._write_lock._locked:
                    self._sock.send(header)
            except OSError:
                pass
        self._fail(ConnectionLost(f"protocol error: {exc}"))

    def _on_control(self, ftype: int, flags: int, stream_id: int, arg: int) -> None:
        if ftype == fr.PING:
            return
        if ftype == fr.WINDOW:
            if flags & ~fr.LARGE_DONE:
                raise RemoteProtocolError("unknown WINDOW flags")
            if flags & fr.LARGE_DONE:
                self._large_in_flight = False
            if stream_id == 0:
                self._credit += arg
                if self._credit > self._peer_settings.connection_window:
                    raise RemoteProtocolError("the peer granted more credit than its window")
            else:
                stream = self._lookup(stream_id, create=False)
                if stream is not None:
                    stream._credit += arg
                    if stream._credit > self._peer_settings.stream_window:
                        raise RemoteProtocolError("the peer granted more credit than its window")
            self._credit_changed.notify()
            return
        if ftype == fr.AUTH:
            raise RemoteProtocolError("AUTH after the handshake")
        stream = self._lookup(stream_id, create=ftype == fr.EOF)
        if stream is None:
            return
        if ftype == fr.EOF:
            stream._on_eof()
        elif ftype == fr.RESET:
            stream._on_reset()
        elif ftype == fr.STOP:
            stream._on_stop()

    def _on_goaway(self, code: int) -> None:
        reason = "closed the connection" if code == fr.NO_ERROR else f"went away (code {code})"
        self._fail(ConnectionLost(f"the peer {reason}"))
