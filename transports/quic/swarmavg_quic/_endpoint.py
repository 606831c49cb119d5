"""One UDP socket shared by every QUIC connection it carries, dialed and accepted alike.

The socket task waits until the socket is readable, then reads up to :data:`BATCH` datagrams
without waiting, routes each to its connection by the destination connection ID (all our
connection IDs are :data:`CID_LENGTH` bytes, so short headers can be parsed), and pumps each
connection that got datagrams once, after the batch: a burst of datagrams costs one pass over
aioquic's events and output, not one per datagram.

A datagram for an unknown connection ID starts a connection only if it is a full-size Initial
packet and a listener is attached; without a listener the dialer gets an immediate refusal
(CONNECTION_CLOSE) instead of waiting out its handshake timeout. Anything that does not parse is
dropped: datagrams are unauthenticated until a handshake has completed, so garbage costs a
header parse and nothing else.

ICMP errors (Linux ``IP_RECVERR``: the kernel queues them on the socket, naming the address a
datagram of ours could not reach) fail a handshake to that address at once, and make an
established connection to it *probe* its peer (a PING it must answer within a second or so,
see ``QuicConnection._suspect``): ICMP is unauthenticated, so it is a reason to ask, never a
reason to drop a connection by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.connection import QuicConnection as _AioQuicConnection
from aioquic.quic.packet import (
    QuicPacketType,
    encode_quic_version_negotiation,
    pull_quic_header,
)

if TYPE_CHECKING:
    from swarmavg_quic._connection import QuicConnection
    from swarmavg_quic._transport import QuicListener, QuicTransport

logger = logging.getLogger("swarmavg_quic")

#: Length of every connection ID we issue (short headers do not carry it).
CID_LENGTH: Final = 8
#: Datagrams read per wake-up of the socket task before the connections are pumped.
BATCH: Final = 256
#: The largest UDP payload we read.
MAX_UDP_PAYLOAD: Final = 65535
#: Socket buffers we ask for (the kernel caps them at net.core.[rw]mem_max).
SOCKET_BUFFER: Final = 4 << 20
#: QUIC versions we speak (1 and 2, as aioquic does).
SUPPORTED_VERSIONS: Final = (0x00000001, 0x6B3343CF)
_MIN_INITIAL: Final = 1200

# Linux values (<linux/in.h>, <linux/in6.h>): don't fragment (a datagram too large for the
# route fails locally with EMSGSIZE); queue ICMP errors, so that dialing a port nobody listens
# on fails at once ("port unreachable") instead of at the handshake timeout.
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO, _IP_RECVERR = 10, 2, 11
_IPV6_MTU_DISCOVER, _IPV6_PMTUDISC_DO, _IPV6_RECVERR = 23, 2, 25
_MSG_ERRQUEUE = getattr(socket, "MSG_ERRQUEUE", 0x2000)
#: The head of ``struct sock_extended_err`` (<linux/errqueue.h>): ee_errno comes first.
_EXTENDED_ERR = struct.Struct("=I")


def bind_socket(family: int, sockaddr: Any) -> socket.socket:
    """A non-blocking UDP socket bound to ``sockaddr``, with large buffers and no fragmentation.

    :raises OSError: if it cannot be bound.
    """
    sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):  # some platforms refuse large buffers
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        with contextlib.suppress(OSError):  # not Linux
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER, _IPV6_PMTUDISC_DO)
                sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_RECVERR, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
                sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)
        sock.bind(sockaddr)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _queued_errno(ancdata: list[tuple[int, int, bytes]]) -> int:
    """The errno of an error-queue entry (from its ``sock_extended_err``), 0 if it has none."""
    for level, kind, data in ancdata:
        if (level, kind) in (
            (socket.IPPROTO_IP, _IP_RECVERR),
            (socket.IPPROTO_IPV6, _IPV6_RECVERR),
        ) and len(data) >= _EXTENDED_ERR.size:
            code: int = _EXTENDED_ERR.unpack_from(data)[0]
            return code
    return 0


class Endpoint:
    """A UDP socket and the QUIC connections it carries."""

    def __init__(self, transport: QuicTransport, sock: socket.socket) -> None:
        self._transport = transport
        self.sock = sock
        self.family = sock.family
        name = sock.getsockname()
        self.host: str = name[0]
        self.port: int = name[1]
        self.listener: QuicListener | None = None
        self.dial_only = False  # made for dialing; closes when it carries nothing
        self._by_cid: dict[bytes, QuicConnection] = {}
        self._connections: set[QuicConnection] = set()
        self._scope: anyio.CancelScope | None = None
        self._reading = False  # the socket task waits for the socket (or reads it)
        self.closed = False
        self.dropped_sends = 0

    def __repr__(self) -> str:
        return f"<Endpoint udp {self.host}:{self.port}>"

    # -- which connections are ours ------------------------------------------------------------

    def can_reach(self, host: str) -> bool:
        """Whether datagrams from this socket can go to ``host`` (a numeric address)."""
        try:
            bound = ipaddress.ip_address(self.host)
            target = ipaddress.ip_address(host)
        except ValueError:
            return False
        if bound.is_unspecified:
            return True
        if bound.is_loopback:
            return target.is_loopback
        return True

    def add(self, conn: QuicConnection, *cids: bytes) -> None:
        self._connections.add(conn)
        for cid in cids:
            self._by_cid[cid] = conn

    def register(self, cid: bytes, conn: QuicConnection) -> None:
        if conn in self._connections:
            self._by_cid[cid] = conn

    def unregister(self, cid: bytes, conn: QuicConnection) -> None:
        if self._by_cid.get(cid) is conn:
            del self._by_cid[cid]

    def forget(self, conn: QuicConnection) -> None:
        """``conn`` has terminated: drop its connection IDs; close the socket if unused."""
        if conn not in self._connections:
            return
        self._connections.discard(conn)
        for cid in [cid for cid, c in self._by_cid.items() if c is conn]:
            del self._by_cid[cid]
        self.maybe_close()

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    # -- the socket task ---------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self._reading = True
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                task_status.started()
                sock = self.sock
                while not self.closed:
                    try:
                        await anyio.wait_readable(sock)
                    except (anyio.ClosedResourceError, OSError):
                        break
                    self._read_batch()
        finally:
            self._reading = False
            if self.closed:  # (closed from a loop callback: see close)
                self.sock.close()

    def _read_batch(self) -> None:
        sock = self.sock
        now = asyncio.get_running_loop().time()  # (anyio's clock on asyncio)
        touched: dict[int, QuicConnection] = {}
        for _ in range(BATCH):
            try:
                data, addr = sock.recvfrom(MAX_UDP_PAYLOAD)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # an ICMP error reported for an earlier send
                if self.closed:
                    break
                logger.debug("%r: recvfrom: %s", self, exc)
                self._read_errors()
                continue
            conn = self._route(data, addr, now)
            if conn is not None:
                touched[id(conn)] = conn
        for conn in touched.values():
            conn._after_receive()

    def _read_errors(self) -> None:
        """Drain the socket's error queue (Linux ``IP_RECVERR``): each entry names the address a
        datagram of ours could not reach. Handshakes to that address fail at once; established
        connections to it probe their peer (ICMP is unauthenticated: a spoofed error must cost
        a PING, never a live connection). "Message too long" (path MTU) says nothing about
        the peer's liveness and is left to them."""
        for _ in range(BATCH):
            try:
                _, ancdata, _, addr = self.sock.recvmsg(1, 512, _MSG_ERRQUEUE)
            except OSError:
                return
            if not isinstance(addr, tuple):
                continue
            code = _queued_errno(ancdata)
            reason = f"{addr[0]} port {addr[1]} is unreachable"
            if code:
                reason += f" ({os.strerror(code)})"
            target = addr[:2]
            for conn in list(self._connections):
                if not conn.handshake_done.is_set():
                    if conn._sockaddr[:2] == target:
                        conn._unreachable(reason)
                elif code != errno.EMSGSIZE:
                    peer = conn._quic.get_peer_address()
                    if peer is not None and tuple(peer)[:2] == target:
                        conn._suspect(reason)

    def _route(self, data: bytes, addr: Any, now: float) -> QuicConnection | None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            return None
        conn = self._by_cid.get(header.destination_cid)
        if conn is None:
            if header.packet_type != QuicPacketType.INITIAL or len(data) < _MIN_INITIAL:
                return None
            if header.version not in SUPPORTED_VERSIONS:
                self.send_datagrams(
                    [
                        (
                            encode_quic_version_negotiation(
                                source_cid=header.destination_cid,
                                destination_cid=header.source_cid,
                                supported_versions=list(SUPPORTED_VERSIONS),
                            ),
                            addr,
                        )
                    ]
                )
                return None
            if self.listener is None or self.listener.is_closed:
                self._refuse(data, addr, header.destination_cid, now)
                return None
            return self._transport._incoming(self, header.destination_cid, data, addr, now)
        try:
            conn._quic.receive_datagram(data, addr, now)
        except Exception:  # aioquic closes on protocol errors itself; anything else is a bug
            logger.exception("%r: aioquic failed on a datagram from %s", conn, addr)
            conn._close(0x1, "internal error")
        return conn

    def _refuse(self, data: bytes, addr: Any, original_cid: bytes, now: float) -> None:
        """Answer an Initial nobody listens for with CONNECTION_CLOSE, keeping no state."""
        quic = _AioQuicConnection(
            configuration=self._transport._configuration(is_client=False, addr=addr),
            original_destination_connection_id=original_cid,
        )
        try:
            quic.receive_datagram(data, addr, now)
            quic.close(error_code=0x2, reason_phrase="not listening")
            self.send_datagrams(quic.datagrams_to_send(now))
        except Exception:  # pragma: no cover - a refusal is best effort
            logger.debug("%r: could not refuse %s", self, addr, exc_info=True)

    def send_datagrams(self, datagrams: Iterable[tuple[bytes, Any]]) -> None:
        sock = self.sock
        for data, addr in datagrams:
            try:
                sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                self.dropped_sends += 1  # the socket buffer is full: QUIC retransmits
            except OSError as exc:
                if self.closed:
                    return
                logger.debug("%r: sendto %s: %s", self, addr, exc)

    # -- closing -------------------------------------------------------------------------------

    def maybe_close(self) -> None:
        if not self._connections and (self.listener is None or self.listener.is_closed):
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._transport._endpoints.discard(self)
        if self._scope is not None:
            self._scope.cancel()
        if self._reading and not _in_task():
            # An event-loop callback (a connection's scheduled pump saw it end): anyio < 4.16
            # cannot be called there. The socket task, cancelled above, closes the socket once
            # its wait for the socket has ended.
            return
        anyio.notify_closing(self.sock)
        self.sock.close()


def _in_task() -> bool:
    """Whether this runs in a task (not in a raw callback of the event loop)."""
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no running loop
        return False
