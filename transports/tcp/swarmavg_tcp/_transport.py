"""TcpTransport and its listener: sockets, handshakes, limits."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Final

import anyio
import anyio.abc

from swarmavg.abc import IncomingLimits, QueueListener, TaskGroupTransport
from swarmavg.address import Address, getaddrinfo
from swarmavg.errors import (
    AddressInUse,
    ConnectError,
    ConnectionLost,
    PeerIdentityMismatch,
    RemoteProtocolError,
    TransportError,
)
from swarmavg_tcp import _frames as fr
from swarmavg_tcp._connection import TcpConnection
from swarmavg_tcp._handshake import AUTH_SIZE, HELLO_SIZE, Handshake

if TYPE_CHECKING:
    from swarmavg.identity import Identity, PeerID

logger = logging.getLogger("swarmavg_tcp")

#: Linux's ``TCP_RTO_MAX_MS`` socket option (6.15 and later), and the longest retransmission
#: timeout we set with it, in ms (the kernel's default is 120 s). While a link is down, TCP
#: doubles the timeout of the data it keeps resending; without a cap, what a peer sends once
#: the link is back waits behind the next retry, which after a cut of 20 s comes up to ~20 s
#: later (the network lab's fault matrix: a peer cut off, then healed, stayed out of the next
#: round, its DHT pings and join requests timing out over its old connections). With 2 s, a
#: healed connection carries data again within 2 s; a longer cut costs a small retry every
#: 2 s, and the kernel gives a connection up after about half a minute of them (then it is
#: dialled again). Elsewhere the option is not set (nothing changes).
_TCP_RTO_MAX_MS: Final = 44
RTO_MAX_MS: Final = 2000


class TcpTransport(TaskGroupTransport):
    """Authenticated, encrypted, multiplexed TCP (``tcp://host:port/p/<peer-id>``).

    :param identity: our key pair; peers see its PeerID.
    :param encryption: encrypt data with AES-128-GCM (the default). ``False`` keeps mutual
        authentication but sends data in the clear, for trusted networks; a connection is
        encrypted unless *both* ends turned it off.
    :param max_message_size: largest message we accept, in bytes.
    :param stream_window: bytes one stream may have in flight to us, unread.
    :param connection_window: the same for a whole connection.
    :param max_streams: streams a peer may have open to us at once, per connection.
    :param max_record_size: largest record we accept; bulk data travels in records this big.
    :param handshake_timeout: seconds a connection may take to authenticate.
    :param connect_timeout: seconds a TCP connect may take.
    :param keepalive_interval: we send a keep-alive after this many silent seconds, and drop a
        peer silent for three times as long.
    :param idle_timeout: close a connection that had no streams for this long (None: never).
    :param write_timeout: drop a connection whose peer accepts no data for this long.
    :param max_connections_per_peer: incoming connections one PeerID may hold at once.
    :param max_incoming_connections: incoming connections in all.
    :param max_pending_handshakes: incoming handshakes in progress at once; more wait.
    """

    name: ClassVar[str] = "tcp"
    schemes: ClassVar[Sequence[str]] = ("tcp",)

    def __init__(
        self,
        identity: Identity,
        *,
        encryption: bool = True,
        max_message_size: int = 128 << 20,
        stream_window: int = 16 << 20,
        connection_window: int = 64 << 20,
        max_streams: int = 256,
        max_record_size: int = 256 << 10,
        handshake_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        keepalive_interval: float = 15.0,
        idle_timeout: float | None = 300.0,
        write_timeout: float = 60.0,
        max_connections_per_peer: int = 8,
        max_incoming_connections: int = 1024,
        max_pending_handshakes: int = 64,
    ) -> None:
        super().__init__(identity)
        if not isinstance(encryption, bool):
            raise TypeError(f"encryption must be a bool, not {encryption!r}")
        self.encryption = encryption
        self.settings = fr.Settings(
            max_message_size=max_message_size,
            stream_window=stream_window,
            connection_window=connection_window,
            max_streams=max_streams,
            max_record_size=max_record_size,
        )
        for name, value in (
            ("handshake_timeout", handshake_timeout),
            ("connect_timeout", connect_timeout),
            ("keepalive_interval", keepalive_interval),
            ("write_timeout", write_timeout),
        ):
            self._check_seconds(name, value)
        self._check_seconds("idle_timeout", idle_timeout, allow_none=True)
        self._check_count("max_connections_per_peer", max_connections_per_peer)
        self._check_count("max_incoming_connections", max_incoming_connections)
        self._check_count("max_pending_handshakes", max_pending_handshakes)
        self.handshake_timeout = handshake_timeout
        self.connect_timeout = connect_timeout
        self.keepalive_interval = keepalive_interval
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.max_connections_per_peer = max_connections_per_peer
        self.max_incoming_connections = max_incoming_connections
        self._handshake_slots = anyio.Semaphore(max_pending_handshakes)
        self._listeners: set[TcpListener] = set()
        self._connections: set[TcpConnection] = set()
        self._incoming_limits = IncomingLimits(max_connections_per_peer, max_incoming_connections)

    # -- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for listener in list(self._listeners):
            await listener.aclose()
        if self._connections:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for conn in list(self._connections):
                        tg.start_soon(conn.aclose)
        self._cancel_tasks()

    # -- dialing ---------------------------------------------------------------------------------

    async def connect(self, address: Address, *, allow_unknown_peer: bool = False) -> TcpConnection:
        address = Address.parse(address)
        self._check_dial_address(address, allow_unknown_peer)
        tg = self._task_group()
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            with anyio.fail_after(self.connect_timeout):
                infos = await getaddrinfo(
                    address.host, address.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
                if not infos:
                    raise ConnectError(f"cannot resolve {address.host!r}")
                family, kind, proto, _, sockaddr = infos[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                await loop.sock_connect(sock, sockaddr)
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise ConnectError(f"connecting to {address} timed out") from None
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise ConnectError(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        try:
            conn = await self._handshake(sock, is_initiator=True, expected=address.peer_id)
        except PeerIdentityMismatch:
            sock.close()
            raise
        except (RemoteProtocolError, ConnectionLost, OSError, TimeoutError) as exc:
            sock.close()
            raise ConnectError(f"handshake with {address} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        await tg.start(conn.run)
        return conn

    # -- handshakes ------------------------------------------------------------------------------

    async def _handshake(
        self, sock: socket.socket, *, is_initiator: bool, expected: PeerID | None
    ) -> TcpConnection:
        loop = asyncio.get_running_loop()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if sys.platform == "linux":
            with contextlib.suppress(OSError):  # (before 6.15: ENOPROTOOPT; nothing to do)
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, RTO_MAX_MS)
        hs = Handshake(
            self.identity,
            is_initiator=is_initiator,
            encryption=self.encryption,
            settings=self.settings,
        )

        async def recv_exact(n: int) -> bytes:
            buf = bytearray(n)
            view = memoryview(buf)
            got = 0
            while got < n:
                k = await loop.sock_recv_into(sock, view[got:])
                if k == 0:
                    raise ConnectionLost("the peer closed the connection during the handshake")
                got += k
            return bytes(buf)

        with anyio.fail_after(self.handshake_timeout):
            await loop.sock_sendall(sock, hs.hello)
            hs.receive_hello(await recv_exact(HELLO_SIZE))
            payload = hs.auth_payload()
            header = fr.HEADER.pack(len(payload), fr.AUTH, 0, 0, 0, 0)
            if hs.send_sealer is not None:
                sealed = bytearray(len(payload) + fr.TAG_SIZE)
                hs.send_sealer.seal_into(header, memoryview(payload), memoryview(sealed))
                await loop.sock_sendall(sock, header + sealed)
            else:
                await loop.sock_sendall(sock, header + payload)
            peer_header = await recv_exact(fr.HEADER_SIZE)
            length, ftype, flags, reserved, stream_id, arg = fr.HEADER.unpack(peer_header)
            if ftype != fr.AUTH or length != AUTH_SIZE or flags or reserved or stream_id or arg:
                raise RemoteProtocolError("expected the peer's AUTH record")
            if hs.recv_opener is not None:
                sealed_auth = await recv_exact(length + fr.TAG_SIZE)
                plain = bytearray(length)
                hs.recv_opener.open_into(peer_header, memoryview(sealed_auth), memoryview(plain))
                peer_auth = bytes(plain)
            else:
                peer_auth = await recv_exact(length)
            peer_id, peer_settings = hs.verify_auth(peer_auth, expected)
        local = sock.getsockname()
        remote = sock.getpeername()
        conn = TcpConnection(
            sock,
            transport_name=self.name,
            is_initiator=is_initiator,
            peer_id=peer_id,
            local_address=Address("tcp", local[0], local[1], self.identity.peer_id),
            remote_address=Address("tcp", remote[0], remote[1], peer_id if is_initiator else None),
            settings=self.settings,
            peer_settings=peer_settings,
            sealer=hs.send_sealer,
            opener=hs.recv_opener,
            keepalive_interval=self.keepalive_interval,
            idle_timeout=self.idle_timeout,
            write_timeout=self.write_timeout,
            on_close=self._forget,
        )
        self._connections.add(conn)
        return conn

    def _forget(self, conn: TcpConnection) -> None:
        self._connections.discard(conn)
        self._incoming_limits.release(conn)

    # -- listening -------------------------------------------------------------------------------

    async def listen(self, address: Address) -> TcpListener:
        address = Address.parse(address)
        if address.scheme not in self.schemes:
            raise ValueError(f"the tcp transport cannot listen on {address}")
        tg = self._task_group()
        try:
            infos = await getaddrinfo(
                address.host,
                address.port,
                type=socket.SOCK_STREAM,
                proto=socket.IPPROTO_TCP,
                flags=socket.AI_PASSIVE,
            )
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"cannot listen on {address}: port {address.port} is already in use "
                    "(listen on port 0 to pick a free one)"
                ) from exc
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        port = sock.getsockname()[1]
        listener = TcpListener(
            self, sock, address.with_port(port).with_peer_id(self.identity.peer_id)
        )
        self._listeners.add(listener)
        await tg.start(listener._accept_loop)
        return listener

    async def _serve_incoming(self, sock: socket.socket, listener: TcpListener) -> None:
        try:
            async with self._handshake_slots:
                conn = await self._handshake(sock, is_initiator=False, expected=None)
        except (RemoteProtocolError, ConnectionLost, OSError, TimeoutError) as exc:
            logger.debug("incoming handshake failed: %s", exc)  # (the peer's doing)
            sock.close()
            return
        except Exception:  # a bug must cost one connection, never the transport
            logger.exception("incoming handshake failed unexpectedly")
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        peer = conn.peer_id
        refusal = (
            "the listener was closed" if listener._closed else self._incoming_limits.refusal(peer)
        )
        if refusal is not None:
            logger.info("refusing an incoming connection: %s", refusal)
            self._connections.discard(conn)
            sock.close()
            return
        self._incoming_limits.admit(conn)
        await self._task_group().start(conn.run)
        if not listener._deliver(conn):
            conn._fail(ConnectionLost("the listener is overloaded or closed"))


class TcpListener(QueueListener[TcpConnection]):
    """Accepts swarmavg-tcp connections on one socket."""

    def __init__(self, transport: TcpTransport, sock: socket.socket, address: Address) -> None:
        super().__init__(address)
        self._transport = transport
        self._sock = sock
        self._scope: anyio.CancelScope | None = None

    async def _accept_loop(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        loop = asyncio.get_running_loop()
        tg = self._transport._task_group()
        with anyio.CancelScope() as scope:
            self._scope = scope
            task_status.started()
            while not self._closed:
                try:
                    sock, _ = await loop.sock_accept(self._sock)
                except OSError as exc:
                    if self.is_closed:
                        break
                    logger.warning(
                        "accepting connections on %s failed: %s; retrying", self.address, exc
                    )
                    await anyio.sleep(0.1)
                    continue
                sock.setblocking(False)
                tg.start_soon(self._transport._serve_incoming, sock, self)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._listeners.discard(self)
        if self._scope is not None:
            self._scope.cancel()
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        await self._close_queue()
