"""QuicTransport and its listener: endpoints, handshakes, limits."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.abc
from aioquic.quic.configuration import QuicConfiguration

from swarmavg.abc import IncomingLimits, QueueListener, TaskGroupTransport
from swarmavg.address import Address, getaddrinfo
from swarmavg.errors import AddressInUse, ConnectError, PeerIdentityMismatch, TransportError
from swarmavg_quic import _congestion, _tls
from swarmavg_quic._aioquic import FlowControlledQuic, check_private_api
from swarmavg_quic._connection import CLOSE_REFUSED, QuicConnection
from swarmavg_quic._endpoint import CID_LENGTH, Endpoint, bind_socket
from swarmavg_quic._mtu import datagram_size_for

if TYPE_CHECKING:
    from swarmavg.identity import Identity, PeerID

__all__ = ["QuicListener", "QuicTransport"]

logger = logging.getLogger("swarmavg_quic")

#: our names -> aioquic's
_CONGESTION_CONTROL = {"reno": "reno", "cubic": "cubic", "bbr": _congestion.NAME}


class QuicTransport(TaskGroupTransport):
    """Authenticated, encrypted QUIC on aioquic (``quic://host:port/p/<peer-id>``).

    Each peer presents a self-signed TLS 1.3 certificate of its Ed25519 identity key and checks
    that the other's key is the PeerID it dialed; there is no CA and nothing to configure. One
    UDP socket per listening address carries both the connections it accepts and those this
    transport dials, so a peer keeps one port.

    :param identity: our key pair; peers see its PeerID.
    :param max_message_size: largest message, in bytes (both ends should agree).
    :param stream_window: bytes one stream may have in flight to us, unread.
    :param connection_window: the same for a whole connection.
    :param send_buffer: bytes one stream may have written and not yet acknowledged; ``send()``
        waits above it.
    :param max_datagram_size: UDP payload size; ``None`` (the default) picks it per peer from
        the route's MTU, between 1200 and 16383 bytes.
    :param handshake_timeout: seconds a connection may take to authenticate.
    :param keepalive_interval: we ping a connection this often, and drop a peer silent for
        three times as long (QUIC's idle timeout). With streams open, a peer silent for a
        second is pinged too, and an ICMP error for the peer's address makes us probe it: a
        peer whose process died is dropped within about a second.
    :param idle_timeout: close a connection that had no streams for this long (None: never).
    :param write_timeout: reset a stream whose message the peer takes no data of for this long
        (a cancelled send resets it at once if it had written part of its message).
    :param max_connections_per_peer: incoming connections one PeerID may hold at once.
    :param max_incoming_connections: incoming connections in all.
    :param max_pending_handshakes: incoming handshakes in progress at once; more are dropped.
    :param congestion_control: ``"bbr"`` (the default: paces at the bandwidth it measures and
        does not slow down for random loss; ``swarmavg_quic._congestion``), ``"reno"``
        (aioquic's default) or ``"cubic"``. Reno and CUBIC cut their window at every loss: on
        a long path with some loss they hold a connection far below the link's rate.
    """

    name: ClassVar[str] = "quic"
    schemes: ClassVar[Sequence[str]] = ("quic",)

    def __init__(
        self,
        identity: Identity,
        *,
        max_message_size: int = 128 << 20,
        stream_window: int = 16 << 20,
        connection_window: int = 64 << 20,
        send_buffer: int = 4 << 20,
        max_datagram_size: int | None = None,
        handshake_timeout: float = 10.0,
        keepalive_interval: float = 15.0,
        idle_timeout: float | None = 300.0,
        write_timeout: float = 60.0,
        max_connections_per_peer: int = 8,
        max_incoming_connections: int = 1024,
        max_pending_handshakes: int = 64,
        congestion_control: str = "bbr",
    ) -> None:
        super().__init__(identity)
        check_private_api()
        self._check_count("max_message_size", max_message_size, 1 << 20)
        if max_message_size > 2**32 - 1:
            raise ValueError(f"max_message_size must fit in 32 bits, not {max_message_size}")
        self._check_count("stream_window", stream_window, 64 << 10)
        self._check_count("connection_window", connection_window, stream_window)
        self._check_count("send_buffer", send_buffer, 64 << 10)
        if max_datagram_size is not None:
            if not isinstance(max_datagram_size, int) or isinstance(max_datagram_size, bool):
                raise TypeError(f"max_datagram_size must be an int, not {max_datagram_size!r}")
            datagram_size_for("127.0.0.1", 0, max_datagram_size)  # range check
        for name, value in (
            ("handshake_timeout", handshake_timeout),
            ("keepalive_interval", keepalive_interval),
            ("write_timeout", write_timeout),
        ):
            self._check_seconds(name, value)
        self._check_seconds("idle_timeout", idle_timeout, allow_none=True)
        self._check_count("max_connections_per_peer", max_connections_per_peer)
        self._check_count("max_incoming_connections", max_incoming_connections)
        self._check_count("max_pending_handshakes", max_pending_handshakes)
        if not isinstance(congestion_control, str):
            raise TypeError(f"congestion_control must be a str, not {congestion_control!r:.64}")
        if congestion_control not in _CONGESTION_CONTROL:
            raise ValueError(
                f"congestion_control must be one of {tuple(_CONGESTION_CONTROL)}, "
                f"not {congestion_control!r}"
            )
        self.max_message_size = max_message_size
        self.stream_window = stream_window
        self.connection_window = connection_window
        self.send_buffer = send_buffer
        self.max_datagram_size = max_datagram_size
        self.handshake_timeout = handshake_timeout
        self.keepalive_interval = keepalive_interval
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.max_connections_per_peer = max_connections_per_peer
        self.max_incoming_connections = max_incoming_connections
        self.max_pending_handshakes = max_pending_handshakes
        self.congestion_control = congestion_control
        self._certificate = _tls.certificate_for(identity)
        self._endpoints: set[Endpoint] = set()
        self._listeners: set[QuicListener] = set()
        self._connections: set[QuicConnection] = set()
        self._incoming_limits = IncomingLimits(max_connections_per_peer, max_incoming_connections)
        self._pending_handshakes = 0

    # -- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # First, with no await before it: tell every peer (CONNECTION_CLOSE goes out at once).
        # A concurrent aclose() returns at once and may cancel the connections' tasks.
        for conn in list(self._connections):
            conn._close(0x0, "the peer shut down")
        for listener in list(self._listeners):
            await listener.aclose()
        for endpoint in list(self._endpoints):
            endpoint.close()
        self._cancel_tasks()
        await anyio.lowlevel.checkpoint()

    # -- configuration ---------------------------------------------------------------------------

    def _configuration(self, *, is_client: bool, addr: Any) -> QuicConfiguration:
        config = _tls.configuration(
            self.identity,
            is_client=is_client,
            certificate=self._certificate,
            max_datagram_size=datagram_size_for(addr[0], addr[1], self.max_datagram_size),
            idle_timeout=3 * self.keepalive_interval,
        )
        config.max_data = self.connection_window
        config.max_stream_data = self.stream_window
        config.connection_id_length = CID_LENGTH
        config.congestion_control_algorithm = _CONGESTION_CONTROL[self.congestion_control]
        return config

    def _connection(
        self,
        endpoint: Endpoint,
        quic: FlowControlledQuic,
        *,
        is_initiator: bool,
        addr: Any,
        expected: PeerID | None,
    ) -> QuicConnection:
        return QuicConnection(
            endpoint,
            quic,
            tuple(addr),
            transport_name=self.name,
            is_initiator=is_initiator,
            local_address=Address("quic", endpoint.host, endpoint.port, self.identity.peer_id),
            remote_address=Address("quic", addr[0], addr[1], expected),
            expected_peer=expected,
            max_message_size=self.max_message_size,
            stream_window=self.stream_window,
            connection_window=self.connection_window,
            send_buffer=self.send_buffer,
            keepalive_interval=self.keepalive_interval,
            idle_timeout=self.idle_timeout,
            write_timeout=self.write_timeout,
            on_close=self._forget,
        )

    # -- endpoints -------------------------------------------------------------------------------

    async def _endpoint_at(self, family: int, sockaddr: Any) -> Endpoint:
        try:
            sock = bind_socket(family, sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"cannot bind a UDP socket to {sockaddr[0]} port {sockaddr[1]}: the port is "
                    "already in use (listen on port 0 to pick a free one)"
                ) from exc
            raise TransportError(f"cannot bind a UDP socket to {sockaddr[:2]}: {exc}") from exc
        endpoint = Endpoint(self, sock)
        self._endpoints.add(endpoint)
        await self._task_group().start(endpoint.run)
        return endpoint

    async def _dial_endpoint(self, family: int, host: str) -> Endpoint:
        """The socket to dial ``host`` from: a listening one if one can reach it (one port per
        peer), else a shared one made for dialing."""
        candidates = [
            e for e in self._endpoints if e.family == family and not e.closed and e.can_reach(host)
        ]
        candidates.sort(key=lambda e: (e.dial_only, e.listener is None))
        if candidates:
            return candidates[0]
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"  # noqa: S104
        endpoint = await self._endpoint_at(family, (wildcard, 0))
        endpoint.dial_only = True
        return endpoint

    # -- dialing ---------------------------------------------------------------------------------

    async def connect(
        self, address: Address, *, allow_unknown_peer: bool = False
    ) -> QuicConnection:
        address = Address.parse(address)
        self._check_dial_address(address, allow_unknown_peer)
        tg = self._task_group()
        try:
            with anyio.fail_after(self.handshake_timeout):
                infos = await getaddrinfo(
                    address.host, address.port, type=socket.SOCK_DGRAM, proto=socket.IPPROTO_UDP
                )
        except TimeoutError:
            raise ConnectError(f"resolving {address.host!r} timed out") from None
        except OSError as exc:
            raise ConnectError(f"cannot resolve {address.host!r}: {exc}") from exc
        if not infos:
            raise ConnectError(f"cannot resolve {address.host!r}")
        family, _, _, _, sockaddr = infos[0]
        endpoint = await self._dial_endpoint(family, str(sockaddr[0]))
        quic = FlowControlledQuic(configuration=self._configuration(is_client=True, addr=sockaddr))
        conn = self._connection(
            endpoint, quic, is_initiator=True, addr=sockaddr, expected=address.peer_id
        )
        endpoint.add(conn, quic.host_cid)
        self._connections.add(conn)
        quic.connect(sockaddr, anyio.current_time())
        await tg.start(conn.run)
        conn._pump()
        try:
            with anyio.fail_after(self.handshake_timeout):
                await conn.handshake_done.wait()
        except TimeoutError:
            conn._close(CLOSE_REFUSED, "handshake timeout")
            raise ConnectError(
                f"no QUIC handshake with {address} within {self.handshake_timeout} s"
            ) from None
        except BaseException:
            conn._close(CLOSE_REFUSED, "dial cancelled")
            raise
        error = conn._handshake_error
        if error is not None:
            if isinstance(error, PeerIdentityMismatch):
                raise error
            raise ConnectError(f"cannot connect to {address}: {error}") from error
        if conn._expected is None:
            conn._remote_address = conn._remote_address.with_peer_id(conn.peer_id)
        return conn

    # -- accepting -------------------------------------------------------------------------------

    def _incoming(
        self, endpoint: Endpoint, original_cid: bytes, data: bytes, addr: Any, now: float
    ) -> QuicConnection | None:
        """A new connection for an Initial packet that arrived at ``endpoint`` (called
        synchronously by its socket task), fed with it; ``None`` if it was dropped.

        A datagram that aioquic cannot make a handshake of (it answers nothing) leaves no
        state behind, so garbage shaped like an Initial cannot fill the handshake slots."""
        if self._closed or self._tg is None:
            return None
        if self._pending_handshakes >= self.max_pending_handshakes:
            logger.debug("dropping an Initial from %s: too many handshakes in progress", addr)
            return None
        quic = FlowControlledQuic(
            configuration=self._configuration(is_client=False, addr=addr),
            original_destination_connection_id=original_cid,
        )
        try:
            quic.receive_datagram(data, addr, now)
            first_flight = quic.datagrams_to_send(now)
        except Exception:  # pragma: no cover - aioquic handles bad input itself
            logger.debug("an Initial from %s broke aioquic", addr, exc_info=True)
            return None
        if not first_flight:
            return None
        endpoint.send_datagrams(first_flight)
        conn = self._connection(endpoint, quic, is_initiator=False, addr=addr, expected=None)
        endpoint.add(conn, original_cid, quic.host_cid)
        self._connections.add(conn)
        self._pending_handshakes += 1
        self._tg.start_soon(conn.run)
        self._tg.start_soon(self._finish_incoming, conn, endpoint)
        return conn

    async def _finish_incoming(self, conn: QuicConnection, endpoint: Endpoint) -> None:
        try:
            with anyio.move_on_after(self.handshake_timeout):
                await conn.handshake_done.wait()
        finally:
            self._pending_handshakes -= 1
        if not conn.handshake_done.is_set():
            logger.debug("incoming QUIC handshake from %s timed out", conn._remote_address)
            conn._close(CLOSE_REFUSED, "handshake timeout")
            return
        if conn._handshake_error is not None:
            logger.debug("incoming QUIC handshake failed: %s", conn._handshake_error)
            return
        if conn.is_closed:
            return
        peer = conn.peer_id
        listener = endpoint.listener
        if listener is None or listener.is_closed:
            refusal: str | None = "the listener was closed"
        else:
            refusal = self._incoming_limits.refusal(peer)
        if refusal is not None or listener is None:
            logger.info("refusing an incoming QUIC connection: %s", refusal)
            conn._close(CLOSE_REFUSED, refusal or "refused")
            return
        self._incoming_limits.admit(conn)
        if not listener._deliver(conn):
            conn._close(CLOSE_REFUSED, "overloaded")

    def _forget(self, conn: QuicConnection) -> None:
        self._connections.discard(conn)
        self._incoming_limits.release(conn)

    # -- listening -------------------------------------------------------------------------------

    async def listen(self, address: Address) -> QuicListener:
        address = Address.parse(address)
        if address.scheme not in self.schemes:
            raise ValueError(f"the quic transport cannot listen on {address}")
        self._task_group()
        try:
            infos = await getaddrinfo(
                address.host,
                address.port,
                type=socket.SOCK_DGRAM,
                proto=socket.IPPROTO_UDP,
                flags=socket.AI_PASSIVE,
            )
        except OSError as exc:
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        family, _, _, _, sockaddr = infos[0]
        endpoint = next(
            (
                e
                for e in self._endpoints
                if e.listener is None
                and not e.closed
                and e.family == family
                and e.port == sockaddr[1]
                and _same_host(e.host, sockaddr[0])
            ),
            None,
        )
        if endpoint is None:
            endpoint = await self._endpoint_at(family, sockaddr)
        endpoint.dial_only = False
        listener = QuicListener(
            self,
            endpoint,
            address.with_port(endpoint.port).with_peer_id(self.identity.peer_id),
        )
        endpoint.listener = listener
        self._listeners.add(listener)
        return listener


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


class QuicListener(QueueListener[QuicConnection]):
    """Accepts swarmavg-quic connections arriving at one UDP socket."""

    def __init__(self, transport: QuicTransport, endpoint: Endpoint, address: Address) -> None:
        super().__init__(address)
        self._transport = transport
        self._endpoint = endpoint

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._listeners.discard(self)
        if self._endpoint.listener is self:
            self._endpoint.listener = None
        await self._close_queue()
        self._endpoint.maybe_close()
