"""An in-process transport for tests and simulations, with latency, bandwidth and loss knobs.

Theory of operation
-------------------
Peers in one process find each other through a :class:`MemoryNetwork` (a registry of listeners
keyed by ``(host, port)``). A connection is a pair of :class:`_MemoryConnection` objects that
point at each other; each stream is a pair of :class:`_MemoryStream` objects. Sending copies the
message into a fresh ``bytearray`` (so a test catches code that reuses or mutates a buffer it
already handed over) and appends it to the peer stream's inbox with a *delivery time*.

There are no background tasks: the link model is evaluated at send time. Each direction of a
connection is a link that serializes messages at ``bandwidth`` bytes/s, then delays them by
``latency`` seconds; with probability ``loss`` a message is "lost" once and retransmitted after
``retransmit_timeout`` (head-of-line blocking, as TCP and a QUIC stream would show it). The
receiver does not return a message before its delivery time. Flow control is per stream: a
sender waits while the bytes it has sent and the receiver has not yet read exceed ``window``.
A connection's ``set_pacing_rate`` caps its sending direction's rate below the link's, and
``traffic`` counts the bytes each way as the link delivers them (evenly over a message's
serialization, shifted by the latency).

:meth:`MemoryTransport.set_link` pulls a peer's cable: while it is down, whatever is sent to or
from it (messages, EOFs, resets) is lost without a word, and dialing it or from it waits until
the link is back (callers' timeouts end the wait), as a SYN would be retransmitted. Connections
stay open; messages sent after the link is back are delivered again.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final

import anyio

from swarmavg.abc import (
    AbandonCallbacks,
    Buffer,
    Connection,
    ConnectionAttribute,
    Listener,
    Signal,
    Stream,
    Transport,
)
from swarmavg.abc._transport import StreamAttribute
from swarmavg.address import Address
from swarmavg.errors import (
    AddressInUse,
    ConnectError,
    ConnectionLost,
    MessageTooLarge,
    PeerIdentityMismatch,
    StreamReset,
)
from swarmavg.identity import Identity, PeerID

__all__ = ["MemoryNetwork", "MemoryTransport"]

logger = logging.getLogger(__name__)

_EOF: Final = object()
DEFAULT_WINDOW: Final = 4 * 1024 * 1024
DEFAULT_MAX_MESSAGE_SIZE: Final = 256 * 1024 * 1024
_BACKLOG: Final = 256
#: how often a dial over a pulled cable looks whether it is back (seconds)
_LINK_POLL: Final = 0.05


class MemoryNetwork:
    """A namespace of in-process listeners. Transports on different networks cannot meet."""

    _default: ClassVar[MemoryNetwork | None] = None

    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], _MemoryListener] = {}
        self._ports = itertools.count(1)

    @classmethod
    def default(cls) -> MemoryNetwork:
        """The process-wide network used when a transport is given none."""
        if cls._default is None:
            cls._default = cls()
        return cls._default

    def _bind(self, listener: _MemoryListener, address: Address) -> Address:
        port = address.port
        if port == 0:
            port = next(self._ports)
            while (address.host, port) in self._listeners:
                port = next(self._ports)
        key = (address.host, port)
        if key in self._listeners:
            raise AddressInUse(f"memory address {address.host}:{port} is already in use")
        self._listeners[key] = listener
        return address.with_port(port)

    def _unbind(self, address: Address) -> None:
        self._listeners.pop((address.host, address.port), None)

    def _lookup(self, address: Address) -> _MemoryListener | None:
        return self._listeners.get((address.host, address.port))


class _Link:
    """One direction of a connection: serialization at a bandwidth, then latency and loss."""

    __slots__ = (
        "_delivered",
        "_free_at",
        "_in_flight",
        "_last_delivery",
        "bandwidth",
        "latency",
        "loss",
        "pacing",
        "rto",
    )

    def __init__(self, latency: float, bandwidth: float | None, loss: float, rto: float) -> None:
        self.latency = latency
        self.bandwidth = bandwidth
        self.loss = loss
        self.rto = rto
        self._free_at = 0.0
        self._last_delivery = 0.0
        #: messages not wholly delivered: (first byte's arrival, last byte's, bytes)
        self._in_flight: deque[tuple[float, float, int]] = deque()
        self._delivered = 0
        #: a sender's cap on this direction (bytes/s; ``Connection.set_pacing_rate``)
        self.pacing: float | None = None

    def delivered(self) -> int:
        """Bytes delivered over this link so far: a message's bytes arrive evenly over its
        serialization time, shifted by the latency (as a kernel's counters would see them)."""
        now = anyio.current_time()
        while self._in_flight and self._in_flight[0][1] <= now:
            self._delivered += self._in_flight.popleft()[2]
        partial = 0
        for first, last, nbytes in self._in_flight:
            if first >= now:
                break
            partial += int(nbytes * (now - first) / (last - first))
        return self._delivered + partial

    @property
    def ideal(self) -> bool:
        return self.latency == 0 and self.rate is None and self.loss == 0

    @property
    def rate(self) -> float | None:
        """Bytes/s this direction serializes at: the link's, or the sender's cap if lower."""
        if self.pacing is None or (self.bandwidth is not None and self.bandwidth < self.pacing):
            return self.bandwidth
        return self.pacing

    def delivery_time(self, nbytes: int) -> float:
        now = anyio.current_time()
        start = max(now, self._free_at)
        rate = self.rate
        self._free_at = start + (nbytes / rate if rate else 0.0)
        at = self._free_at + self.latency
        if self.loss and random.random() < self.loss:
            at += self.rto
        # in-order delivery: a message never overtakes the one before it
        self._last_delivery = max(self._last_delivery, at)
        serialized = nbytes / rate if rate else 0.0
        self._in_flight.append((self._last_delivery - serialized, self._last_delivery, nbytes))
        return self._last_delivery


class _MemoryStream(Stream):
    def __init__(self, conn: _MemoryConnection, stream_id: int) -> None:
        self._conn = conn
        self._id = stream_id
        self._peer: _MemoryStream | None = None
        self._inbox: deque[tuple[float, Any]] = deque()
        self._buffered = 0  # bytes sent to us and not yet read
        self._changed = Signal()  # inbox, credit or state changed
        self._eof_sent = False
        self._closed = False  # we closed or aborted
        self._reset_by_peer = False
        self._discard = False  # we closed: drop whatever still arrives
        self._abandon = AbandonCallbacks()

    @property
    def extra_attributes(self) -> dict[Any, Any]:
        attrs = dict(self._conn.extra_attributes)
        attrs[StreamAttribute.stream_id] = lambda: self._id
        return attrs

    @property
    def max_message_size(self) -> int:
        return self._conn._transport.max_message_size

    @property
    def _cut(self) -> bool:
        return self._conn._cut

    def _check_usable(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if self._reset_by_peer:
            raise StreamReset(f"stream {self._id} was reset by {self._conn._remote_peer.short()}")

    async def send(self, *parts: Buffer) -> None:
        self._check_usable()
        if self._eof_sent:
            raise anyio.ClosedResourceError("send_eof() was called on this stream")
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.max_message_size:
            raise MessageTooLarge(f"message of {size} bytes > limit {self.max_message_size}")
        await anyio.lowlevel.checkpoint()
        self._check_usable()
        peer = self._peer
        assert peer is not None
        # backpressure: wait for credit (an empty window always admits one message)
        while peer._buffered and peer._buffered + size > self._conn._transport.window:
            if self._conn.is_closed:
                raise ConnectionLost("connection closed while waiting to send")
            await peer._changed.wait()
            self._check_usable()
        if self._conn.is_closed:
            raise ConnectionLost("connection closed")
        # one copy of mutable buffers: the receiver never aliases the sender's memory
        data = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        if peer._discard or self._cut:
            return
        at = self._conn._out_link.delivery_time(size)
        peer._buffered += size
        peer._inbox.append((at, data))
        peer._conn._last_receive = max(peer._conn._last_receive, at)
        peer._changed.notify()

    def receive_nowait(self) -> memoryview:
        self._check_usable()
        if not self._inbox:
            if self._conn.is_closed:
                raise ConnectionLost("connection closed")
            raise anyio.WouldBlock
        at, item = self._inbox[0]
        if at > anyio.current_time():
            raise anyio.WouldBlock
        if item is _EOF:
            raise anyio.EndOfStream  # (it stays: every later call sees it)
        self._inbox.popleft()
        self._buffered -= len(item)
        self._changed.notify()  # returns credit to the sender
        return memoryview(item)

    async def receive(self) -> memoryview:
        while True:
            self._check_usable()
            if self._inbox:
                at, item = self._inbox[0]
                delay = at - anyio.current_time()
                if delay > 0:
                    with anyio.move_on_after(delay):
                        await self._changed.wait()  # woken early by a reset or close
                    continue
                self._inbox.popleft()
                if item is _EOF:
                    self._inbox.appendleft((at, item))  # EOF stays: every later call sees it
                    raise anyio.EndOfStream
                self._buffered -= len(item)
                self._changed.notify()  # returns credit to the sender
                await anyio.lowlevel.checkpoint()
                return memoryview(item)
            if self._conn.is_closed:
                raise ConnectionLost("connection closed")
            await self._changed.wait()

    def on_readable(self, callback: Callable[[], object]) -> bool:
        peer = self._peer
        if peer is None or not peer._conn._out_link.ideal:
            return False  # (a message due later would need a timer: receive() has one)
        if self._inbox or self._closed or self._reset_by_peer or self._conn.is_closed:
            callback()
        else:
            self._changed.add_callback(callback)
        return True

    def on_abandoned(self, callback: Callable[[], object]) -> bool:
        peer = self._peer
        gone = self._reset_by_peer or self._conn.is_closed or (peer is not None and peer._closed)
        return self._abandon.add(callback, abandoned=gone)

    def _abandoned(self) -> None:
        self._abandon.fire()

    async def send_eof(self) -> None:
        if self._eof_sent or self._closed or self._conn.is_closed:
            return
        self._eof_sent = True
        peer = self._peer
        assert peer is not None
        if not peer._discard and not self._cut:
            peer._inbox.append((self._conn._out_link.delivery_time(0), _EOF))
            peer._changed.notify()
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if self._closed:
            return
        if not self._reset_by_peer:
            await self.send_eof()
        self._closed = True
        self._discard = True
        self._inbox.clear()
        self._buffered = 0
        self._changed.notify()
        self._conn._forget(self)
        if self._peer is not None:
            self._peer._abandoned()  # we read nothing more of what it sends

    async def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._discard = True
        self._inbox.clear()
        self._buffered = 0
        self._changed.notify()
        peer = self._peer
        assert peer is not None
        if not peer._closed and not self._cut:
            peer._reset_by_peer = True
            peer._inbox.clear()
            peer._buffered = 0
            peer._changed.notify()
            peer._abandoned()
        self._conn._forget(self)
        await anyio.lowlevel.checkpoint()


class _MemoryConnection(Connection):
    def __init__(
        self,
        transport: MemoryTransport,
        remote_peer: PeerID,
        local_address: Address,
        remote_address: Address,
        out_link: _Link,
        initiator: bool,
    ) -> None:
        self._transport = transport
        self._remote_peer = remote_peer
        self._local_address = local_address
        self._remote_address = remote_address
        self._out_link = out_link
        self._initiator = initiator
        self._peer: _MemoryConnection | None = None
        self._streams: dict[int, _MemoryStream] = {}
        self._incoming: deque[_MemoryStream] = deque()
        self._incoming_changed = Signal()
        self._closed_event = anyio.Event()
        self._next_id = 1 if initiator else 2
        #: when the last data sent to us arrives (anyio's clock: virtual time in tests)
        self._last_receive = anyio.current_time()

    @property
    def extra_attributes(self) -> dict[Any, Any]:
        return {
            ConnectionAttribute.peer_id: lambda: self._remote_peer,
            ConnectionAttribute.remote_address: lambda: self._remote_address,
            ConnectionAttribute.local_address: lambda: self._local_address,
            ConnectionAttribute.transport_name: lambda: "memory",
            ConnectionAttribute.is_initiator: lambda: self._initiator,
            ConnectionAttribute.encrypted: lambda: False,
        }

    @property
    def is_closed(self) -> bool:
        return self._closed_event.is_set()

    @property
    def _cut(self) -> bool:
        """Whether either end's link is down (see :meth:`MemoryTransport.set_link`)."""
        peer = self._peer
        return not self._transport.link_up or (peer is not None and not peer._transport.link_up)

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def idle_seconds(self) -> float | None:
        return max(anyio.current_time() - self._last_receive, 0.0)

    def set_pacing_rate(self, rate: float | None) -> bool:
        """Messages sent from now on serialize at most at ``rate`` bytes/s (``None``: at the
        link's rate)."""
        if self.is_closed:
            return False
        self._out_link.pacing = rate
        return True

    def traffic(self) -> tuple[int, int] | None:
        """Bytes of messages delivered each way so far (at their delivery times)."""
        peer = self._peer
        received = 0 if peer is None else peer._out_link.delivered()
        return self._out_link.delivered(), received

    async def open_stream(self) -> Stream:
        await anyio.lowlevel.checkpoint()
        if self.is_closed:
            raise ConnectionLost("connection is closed")
        peer = self._peer
        assert peer is not None
        sid = self._next_id
        self._next_id += 2
        local, remote = _MemoryStream(self, sid), _MemoryStream(peer, sid)
        local._peer, remote._peer = remote, local
        self._streams[sid] = local
        peer._streams[sid] = remote
        peer._incoming.append(remote)
        peer._incoming_changed.notify()
        return local

    async def accept_stream(self) -> Stream:
        if self._incoming:
            await anyio.lowlevel.checkpoint()  # ready at once: still let others run
        while not self._incoming:  # (another task may take it while we wait: look again)
            if self.is_closed:
                raise ConnectionLost("connection is closed")
            await self._incoming_changed.wait()
        return self._incoming.popleft()

    def _forget(self, stream: _MemoryStream) -> None:
        self._streams.pop(stream._id, None)

    def _shutdown(self) -> None:
        if self.is_closed:
            return
        self._closed_event.set()
        self._incoming_changed.notify()
        for stream in list(self._streams.values()):
            stream._changed.notify()
            stream._abandoned()
        self._transport._connections.discard(self)

    async def aclose(self) -> None:
        if self.is_closed:
            return
        self._shutdown()
        if self._peer is not None:
            self._peer._shutdown()
        await anyio.lowlevel.checkpoint()


class _MemoryListener(Listener):
    def __init__(self, transport: MemoryTransport) -> None:
        self._transport = transport
        self._address: Address | None = None
        self._pending: deque[_MemoryConnection] = deque()
        self._changed = Signal()
        self._closed = False

    @property
    def address(self) -> Address:
        assert self._address is not None
        return self._address

    async def accept(self) -> Connection:
        while not self._pending:
            if self._closed:
                raise anyio.ClosedResourceError
            await self._changed.wait()
        await anyio.lowlevel.checkpoint()
        return self._pending.popleft()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._network._unbind(self.address)
        self._transport._listeners.discard(self)
        for conn in self._pending:
            await conn.aclose()
        self._pending.clear()
        self._changed.notify()


class MemoryTransport(Transport):
    """In-process transport for tests, simulations and examples.

    Link properties of a connection combine both ends' knobs: latencies add up, the lower
    bandwidth wins, and losses compound.

    :param identity: this peer's identity.
    :param network: the namespace to listen and dial in (default: one per process).
    :param latency: one-way delay this end adds to every message, in seconds.
    :param bandwidth: bytes per second this end can send or receive (``None``: unlimited).
    :param loss: probability in [0, 1) that a message needs one retransmission.
    :param retransmit_timeout: extra delay of a lost message, in seconds.
    :param window: per-stream flow-control window in bytes.
    :param max_message_size: largest message in bytes.
    """

    name: ClassVar[str] = "memory"
    schemes: ClassVar[Sequence[str]] = ("memory",)

    def __init__(
        self,
        identity: Identity,
        *,
        network: MemoryNetwork | None = None,
        latency: float = 0.0,
        bandwidth: float | None = None,
        loss: float = 0.0,
        retransmit_timeout: float = 0.2,
        window: int = DEFAULT_WINDOW,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        if not isinstance(identity, Identity):
            raise TypeError(f"identity must be an Identity, not {type(identity).__name__}")
        super().__init__(identity)
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, not {latency!r}")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, not {bandwidth!r}")
        if not 0 <= loss < 1:
            raise ValueError(f"loss must be in [0, 1), not {loss!r}")
        if retransmit_timeout < 0:
            raise ValueError(f"retransmit_timeout must be >= 0, not {retransmit_timeout!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1 byte, not {window!r}")
        if max_message_size < 1:
            raise ValueError(f"max_message_size must be >= 1, not {max_message_size!r}")
        self._network = network if network is not None else MemoryNetwork.default()
        self.latency = latency
        self.bandwidth = bandwidth
        self.loss = loss
        self.retransmit_timeout = retransmit_timeout
        self.window = window
        self.max_message_size = max_message_size
        self._listeners: set[_MemoryListener] = set()
        self._connections: set[_MemoryConnection] = set()
        self._closed = False
        #: whether this peer's link delivers anything (see :meth:`set_link`)
        self.link_up = True

    def _link_to(self, other: MemoryTransport) -> _Link:
        bandwidths = [b for b in (self.bandwidth, other.bandwidth) if b is not None]
        return _Link(
            latency=self.latency + other.latency,
            bandwidth=min(bandwidths) if bandwidths else None,
            loss=1 - (1 - self.loss) * (1 - other.loss),
            rto=max(self.retransmit_timeout, other.retransmit_timeout),
        )

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError("transport is closed")

    async def listen(self, address: Address) -> Listener:
        self._check_open()
        address = Address.parse(address)
        if address.scheme not in self.schemes:
            raise ValueError(f"the memory transport listens on memory:// addresses, not {address}")
        listener = _MemoryListener(self)
        bound = self._network._bind(listener, address.with_peer_id(None))
        listener._address = bound.with_peer_id(self.identity.peer_id)
        self._listeners.add(listener)
        await anyio.lowlevel.checkpoint()
        return listener

    async def connect(self, address: Address, *, allow_unknown_peer: bool = False) -> Connection:
        self._check_open()
        address = Address.parse(address)
        self._check_dial_address(address, allow_unknown_peer)
        await anyio.lowlevel.checkpoint()
        listener = self._network._lookup(address)
        if listener is None or listener._closed:
            raise ConnectError(f"connection refused: nothing listens on {address}")
        remote = listener._transport
        if address.peer_id is not None and address.peer_id != remote.identity.peer_id:
            raise PeerIdentityMismatch(address.peer_id, remote.identity.peer_id)
        while not (self.link_up and remote.link_up):  # (a SYN retransmitted until the link is back)
            await anyio.sleep(_LINK_POLL)
            self._check_open()
            if listener._closed:
                raise ConnectError(f"connection refused: nothing listens on {address}")
        if len(listener._pending) >= _BACKLOG:
            raise ConnectError(f"connection refused: backlog of {address} is full")
        link_out, link_in = self._link_to(remote), remote._link_to(self)
        if not link_out.ideal:
            await anyio.sleep(2 * link_out.latency)  # one round trip to set up
        local_addr = Address("memory", "local", 0, self.identity.peer_id)
        ours = _MemoryConnection(
            self, remote.identity.peer_id, local_addr, listener.address, link_out, True
        )
        theirs = _MemoryConnection(
            remote, self.identity.peer_id, listener.address, local_addr, link_in, False
        )
        ours._peer, theirs._peer = theirs, ours
        self._connections.add(ours)
        remote._connections.add(theirs)
        listener._pending.append(theirs)
        listener._changed.notify()
        return ours

    def set_link(self, up: bool) -> None:
        """Pull (``False``) or plug back (``True``) this peer's cable: while it is down,
        everything sent to or from it over any connection is lost silently, and dials to or
        from it wait (see the module docstring)."""
        if not isinstance(up, bool):
            raise TypeError(f"up must be a bool, not {up!r}")
        self.link_up = up

    def disconnect_all(self) -> None:
        """Break every connection of this transport at once, as if the process died."""
        for conn in list(self._connections):
            conn._shutdown()
            if conn._peer is not None:
                conn._peer._shutdown()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for listener in list(self._listeners):
            await listener.aclose()
        for conn in list(self._connections):
            await conn.aclose()
