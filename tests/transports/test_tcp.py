"""Adversarial and limit tests of swarmavg-tcp, with real sockets on loopback.

The generic behaviour is covered by the conformance suite (test_tcp_conformance.py). Here a
hand-driven peer (:class:`RawPeer`) runs a valid handshake with ``swarmavg_tcp._handshake`` and
then writes crafted records, and we check that the server drops exactly that connection, never
crashes, and keeps serving honest peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from traffic_helpers import exchange_and_count

from swarmavg.abc import ConnectionAttribute
from swarmavg.address import Address
from swarmavg.errors import (
    ConnectError,
    ConnectionLost,
    PeerIdentityMismatch,
    StreamReset,
    TransportError,
)
from swarmavg.identity import Identity
from swarmavg_tcp import TcpConnection, TcpListener, TcpStream, TcpTransport
from swarmavg_tcp import _frames as fr
from swarmavg_tcp import _transport as tcp_transport
from swarmavg_tcp._frames import HEADER, HEADER_SIZE, TAG_SIZE, Sealer, Settings
from swarmavg_tcp._handshake import HELLO, HELLO_SIZE, MAGIC, VERSION, Handshake

pytestmark = pytest.mark.anyio

BOUND = 5.0  # seconds any single wait may take (generous: loopback answers in milliseconds)
LOCALHOST = "tcp://127.0.0.1:0"

#: Small limits for the server under attack, so that every limit is cheap to reach.
STRICT: dict[str, Any] = {
    "max_message_size": 1 << 20,
    "stream_window": 256 << 10,
    "connection_window": 512 << 10,
    "max_streams": 4,
    "max_record_size": 64 << 10,
}
ENCRYPTION = pytest.mark.parametrize("encryption", [True, False], ids=["encrypted", "plaintext"])


# -- a hand-driven peer --------------------------------------------------------------------------


class RawPeer:
    """A swarmavg-tcp client driven by hand over a raw socket.

    :meth:`handshake` runs a valid handshake (or a doctored one); afterwards :meth:`record`
    builds records exactly as a test wants them (sealed with the session key when the connection
    is encrypted) and :meth:`send_raw` writes any bytes.
    """

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.identity = Identity.generate()
        self.sealer: Sealer | None = None
        self.opener: Sealer | None = None
        self.encrypted = False
        self.peer_settings: Settings | None = None

    @classmethod
    async def connect(cls, address: Address) -> RawPeer:
        return cls(await anyio.connect_tcp(address.host, address.port))

    async def __aenter__(self) -> RawPeer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stream.aclose()

    async def send_raw(self, data: bytes | bytearray) -> None:
        """Write ``data``; the server hanging up first is not an error (it is often the point)."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self.stream.send(bytes(data))

    async def handshake(
        self,
        *,
        encryption: bool = True,
        settings: Settings | None = None,
        auth: Callable[[Handshake], bytes] | None = None,
        auth_header: bytes | None = None,
    ) -> None:
        """A valid handshake as the initiator; ``auth`` / ``auth_header`` replace our AUTH."""
        hs = Handshake(
            self.identity,
            is_initiator=True,
            encryption=encryption,
            settings=settings or Settings(),
        )
        await self.send_raw(hs.hello)
        hs.receive_hello(bytes(await self.reader.receive_exactly(HELLO_SIZE)))
        self.sealer, self.opener, self.encrypted = hs.send_sealer, hs.recv_opener, hs.encrypted
        payload = hs.auth_payload() if auth is None else auth(hs)
        if auth_header is not None:
            await self.send_raw(auth_header + payload)
        else:
            await self.send_raw(self.record(fr.AUTH, payload=payload))
        ftype, _, _, _, peer_auth, _ = await self.receive_record()
        assert ftype == fr.AUTH
        _, self.peer_settings = hs.verify_auth(peer_auth, None)

    def record(
        self,
        ftype: int,
        flags: int = 0,
        stream_id: int = 0,
        arg: int = 0,
        payload: bytes = b"",
        *,
        length: int | None = None,
        reserved: int = 0,
    ) -> bytes:
        """One record; ``length`` overrides the header's length field (the payload is kept)."""
        size = len(payload) if length is None else length
        header = HEADER.pack(size, ftype, flags, reserved, stream_id, arg)
        if self.sealer is None:
            return header + payload
        sealed = bytearray(len(payload) + TAG_SIZE)
        self.sealer.seal_into(header, memoryview(payload), memoryview(sealed))
        return header + bytes(sealed)

    async def send(self, *args: Any, **kwargs: Any) -> None:
        await self.send_raw(self.record(*args, **kwargs))

    async def message(self, stream_id: int, payload: bytes) -> None:
        """A whole message in one record."""
        await self.send(fr.DATA, fr.FIRST | fr.LAST, stream_id, len(payload), payload)

    async def receive_record(self) -> tuple[int, int, int, int, bytes, bytes]:
        """The next record: type, flags, stream, arg, opened payload, and the bytes as sent."""
        header = bytes(await self.reader.receive_exactly(HEADER_SIZE))
        length, ftype, flags, _, stream_id, arg = HEADER.unpack(header)
        body = bytes(await self.reader.receive_exactly(length + (TAG_SIZE if self.opener else 0)))
        if self.opener is None:
            return ftype, flags, stream_id, arg, body, header + body
        plain = bytearray(length)
        self.opener.open_into(header, memoryview(body), memoryview(plain))
        return ftype, flags, stream_id, arg, bytes(plain), header + body

    async def wait_hangup(self) -> None:
        """Read (and drop) until the other side closes the socket."""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                await self.reader.receive()


# -- helpers -------------------------------------------------------------------------------------


@asynccontextmanager
async def serving(**options: Any) -> AsyncIterator[tuple[TcpTransport, TcpListener]]:
    async with TcpTransport(Identity.generate(), **options) as transport:
        listener = await transport.listen(LOCALHOST)
        yield transport, listener


async def pair(client: TcpTransport, listener: TcpListener) -> tuple[TcpConnection, TcpConnection]:
    with anyio.fail_after(BOUND):
        dialed = await client.connect(listener.address)
        accepted = await listener.accept()
    assert accepted.peer_id == client.identity.peer_id
    return dialed, accepted


async def open_pair(a: TcpConnection, b: TcpConnection) -> tuple[TcpStream, TcpStream]:
    with anyio.fail_after(BOUND):
        sa = await a.open_stream()
        await sa.send(b"open")
        sb = await b.accept_stream()
        assert bytes(await sb.receive()) == b"open"
    return sa, sb


async def roundtrip(a: TcpConnection, b: TcpConnection) -> None:
    sa, sb = await open_pair(a, b)
    with anyio.fail_after(BOUND):
        await sb.send(b"pong")
        assert bytes(await sa.receive()) == b"pong"
        await sa.aclose()
        await sb.aclose()


async def assert_serves(listener: TcpListener, **options: Any) -> None:
    """A well-behaved client connects to ``listener`` and exchanges messages."""
    async with TcpTransport(Identity.generate(), **options) as client:
        dialed, accepted = await pair(client, listener)
        await roundtrip(dialed, accepted)
        with anyio.fail_after(BOUND):
            await dialed.aclose()
            await accepted.wait_closed()


async def outcome_of(func: Callable[[], Awaitable[Any]], out: list[Any]) -> None:
    """Run ``func``; append what it returned or raised to ``out``."""
    try:
        out.append(await func())
    except Exception as exc:
        out.append(exc)


# -- before and during the handshake -------------------------------------------------------------


def _hello(
    magic: bytes = MAGIC, version: int = VERSION, flags: int = 0, key: bytes | None = None
) -> bytes:
    if key is None:
        key = Handshake(
            Identity.generate(), is_initiator=True, encryption=True, settings=Settings()
        ).hello[8:]
    return HELLO.pack(magic, version, flags, 0, key)


PRE_HANDSHAKE: dict[str, bytes | None] = {
    "http_request": b"GET / HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n",
    "tls_client_hello": bytes.fromhex("160301") + os.urandom(200),
    "wrong_magic": _hello(magic=b"SWAX"),
    "wrong_version": _hello(version=VERSION + 1),
    "unknown_hello_flags": _hello(flags=2),
    "low_order_key": _hello(key=bytes(32)),
    "truncated_hello": _hello()[:20],  # then silence: the handshake timeout ends it
    "silent": None,  # connect and say nothing
}


@pytest.mark.parametrize("name", list(PRE_HANDSHAKE))
async def test_bad_hello_is_dropped(name: str) -> None:
    async with serving(handshake_timeout=0.3) as (transport, listener):
        async with await RawPeer.connect(listener.address) as raw:
            data = PRE_HANDSHAKE[name]
            if data is not None:
                await raw.send_raw(data)
            with anyio.fail_after(BOUND):
                await raw.wait_hangup()
        assert not transport._connections
        await assert_serves(listener)


async def test_truncated_hello_then_eof_is_dropped() -> None:
    async with serving() as (_, listener):
        async with await RawPeer.connect(listener.address) as raw:
            await raw.send_raw(_hello()[:17])
            await raw.stream.send_eof()
            with anyio.fail_after(BOUND):
                await raw.wait_hangup()
        await assert_serves(listener)


def _auth_signed_by_other_key(hs: Handshake) -> bytes:
    genuine = hs.auth_payload()
    impostor = Handshake(
        Identity.generate(), is_initiator=True, encryption=True, settings=Settings()
    )
    impostor._transcript = hs._transcript  # the right transcript, signed by the wrong key
    return genuine[:32] + impostor.auth_payload()[32:]


BAD_AUTH: dict[str, Callable[[Handshake], bytes]] = {
    "signed_by_another_key": _auth_signed_by_other_key,
    "bad_signature": lambda hs: hs.auth_payload()[:40] + bytes(56) + hs.auth_payload()[96:],
    "signature_for_responder": lambda hs: _as_responder(hs),
    "unacceptable_settings": lambda hs: hs.auth_payload()[:96] + bytes(20),
    "short": lambda hs: hs.auth_payload()[:-1],
}


def _as_responder(hs: Handshake) -> bytes:
    """A valid signature, but for the other role (a reflected AUTH)."""
    hs.is_initiator = False
    try:
        return hs.auth_payload()
    finally:
        hs.is_initiator = True


@ENCRYPTION
@pytest.mark.parametrize("name", list(BAD_AUTH))
async def test_bad_auth_is_rejected(name: str, encryption: bool) -> None:
    async with serving(handshake_timeout=2, encryption=encryption) as (transport, listener):
        async with await RawPeer.connect(listener.address) as raw:
            with anyio.fail_after(BOUND):
                await raw.handshake(encryption=encryption, auth=BAD_AUTH[name])
                await raw.wait_hangup()
        assert not transport._connections
        await assert_serves(listener)


@pytest.mark.parametrize(
    "header",
    [
        HEADER.pack(116, fr.DATA, 0, 0, 0, 0),  # not an AUTH record
        HEADER.pack(116, fr.AUTH, 1, 0, 0, 0),  # flags
        HEADER.pack(116, fr.AUTH, 0, 0, 1, 0),  # a stream
        HEADER.pack(115, fr.AUTH, 0, 0, 0, 0),  # wrong length
    ],
    ids=["data", "flags", "stream", "length"],
)
async def test_malformed_auth_header_is_rejected(header: bytes) -> None:
    async with serving(handshake_timeout=2, encryption=False) as (transport, listener):
        async with await RawPeer.connect(listener.address) as raw:
            with anyio.fail_after(BOUND):
                await raw.handshake(encryption=False, auth_header=header)
                await raw.wait_hangup()
        assert not transport._connections
        await assert_serves(listener)


async def test_tampered_auth_record_is_rejected() -> None:
    async with serving(handshake_timeout=2) as (transport, listener):
        async with await RawPeer.connect(listener.address) as raw:
            with anyio.fail_after(BOUND):
                # our AUTH record, one ciphertext bit flipped: it fails authentication
                hs = Handshake(
                    raw.identity, is_initiator=True, encryption=True, settings=Settings()
                )
                await raw.send_raw(hs.hello)
                hs.receive_hello(bytes(await raw.reader.receive_exactly(HELLO_SIZE)))
                payload = hs.auth_payload()
                header = HEADER.pack(len(payload), fr.AUTH, 0, 0, 0, 0)
                sealed = bytearray(len(payload) + TAG_SIZE)
                assert hs.send_sealer is not None
                hs.send_sealer.seal_into(header, memoryview(payload), memoryview(sealed))
                sealed[5] ^= 1
                await raw.send_raw(header + sealed)
                await raw.wait_hangup()
        assert not transport._connections
        await assert_serves(listener)


async def test_dialing_a_peer_id_another_key_answers() -> None:
    async with serving() as (_, listener), TcpTransport(Identity.generate()) as client:
        impostor = Identity.generate().peer_id
        with anyio.fail_after(BOUND), pytest.raises(PeerIdentityMismatch):
            await client.connect(listener.address.with_peer_id(impostor))
        with anyio.fail_after(BOUND):
            # the server, which cannot know, completed its side; the dialer hung up at once
            abandoned = await listener.accept()
            await abandoned.wait_closed()
        await assert_serves(listener)


# -- after the handshake: every broken rule costs the connection, and only it --------------------


async def _many(raw: RawPeer, *records: bytes) -> None:
    await raw.send_raw(b"".join(records))


def _small_messages(raw: RawPeer, stream_id: int, count: int, size: int = 16 << 10) -> list[bytes]:
    payload = bytes(size)
    return [raw.record(fr.DATA, fr.FIRST | fr.LAST, stream_id, size, payload) for _ in range(count)]


async def _tampered_payload(raw: RawPeer) -> None:
    record = bytearray(raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 5, b"hello"))
    record[HEADER_SIZE + 2] ^= 0x40
    await raw.send_raw(record)


async def _tampered_header(raw: RawPeer) -> None:
    record = bytearray(raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 5, b"hello"))
    record[12:16] = (7).to_bytes(4, "big")  # another stream: the header is authenticated too
    await raw.send_raw(record)


async def _replayed(raw: RawPeer) -> None:
    record = raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 5, b"hello")
    await raw.send_raw(record + record)


async def _dropped(raw: RawPeer) -> None:
    raw.record(fr.PING)  # sealed (uses a nonce) but never sent
    await raw.send(fr.PING)


async def _unsealed(raw: RawPeer) -> None:
    sealer, raw.sealer = raw.sealer, None
    try:  # a plaintext record on an encrypted connection (and 16 bytes of padding as its "tag")
        await raw.send_raw(raw.record(fr.PING) + bytes(TAG_SIZE))
    finally:
        raw.sealer = sealer


#: Each sends records that break a rule; the server must drop the connection.
ATTACKS: dict[str, Callable[[RawPeer], Awaitable[None]]] = {
    "unknown_type": lambda raw: raw.send(fr.MAX_TYPE + 1),
    "type_255": lambda raw: raw.send(255, 0, 3),
    "reserved_bits": lambda raw: raw.send(fr.DATA, fr.FIRST | fr.LAST, 3, 1, b"x", reserved=1),
    "unknown_data_flags": lambda raw: raw.send(fr.DATA, fr.FIRST | fr.LAST | 8, 3, 1, b"x"),
    "fin_before_the_last_record": lambda raw: raw.send(fr.DATA, fr.FIRST | fr.FIN, 3, 2, b"x"),
    "unknown_window_flags": lambda raw: raw.send(fr.WINDOW, 2, 0, 0),
    "flags_on_an_eof": lambda raw: raw.send(fr.EOF, 1, 1, 0),
    "flags_on_a_ping": lambda raw: raw.send(fr.PING, 4, 0, 0),
    "control_with_payload": lambda raw: raw.send(fr.PING, payload=b"surprise"),
    "oversized_record": lambda raw: raw.send(
        fr.DATA, fr.FIRST, 3, 1 << 20, length=STRICT["max_record_size"] + 1
    ),
    "oversized_message": lambda raw: raw.send(
        fr.DATA, fr.FIRST, 3, STRICT["max_message_size"] + 1, b"x" * 100
    ),
    "continuation_without_first": lambda raw: raw.send(fr.DATA, fr.LAST, 3, 0, b"orphan"),
    "continuation_on_idle_stream": lambda raw: _many(
        raw,
        raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 2, b"ok"),
        raw.record(fr.DATA, 0, 3, 0, b"orphan"),
    ),
    "last_before_the_size": lambda raw: raw.send(fr.DATA, fr.FIRST | fr.LAST, 3, 100, b"x" * 50),
    "size_without_last": lambda raw: raw.send(fr.DATA, fr.FIRST, 3, 10, b"x" * 10),
    "overrun": lambda raw: raw.send(fr.DATA, fr.FIRST | fr.LAST, 3, 10, b"x" * 20),
    "overrun_in_continuation": lambda raw: _many(
        raw,
        raw.record(fr.DATA, fr.FIRST, 3, 10, b"x" * 5),
        raw.record(fr.DATA, fr.LAST, 3, 0, b"x" * 6),
    ),
    "message_inside_message": lambda raw: _many(
        raw,
        raw.record(fr.DATA, fr.FIRST, 3, 100, b"x" * 10),
        raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 1, b"x"),
    ),
    # 16 messages of 16 KiB cost more than the 256 KiB stream window (credit never asked for)
    "stream_window": lambda raw: _many(raw, *_small_messages(raw, 3, 16)),
    # 15 + 15 fit two stream windows, but with 2 more the connection's 512 KiB are exceeded
    "connection_window": lambda raw: _many(
        raw,
        *_small_messages(raw, 3, 15),
        *_small_messages(raw, 5, 15),
        *_small_messages(raw, 7, 2),
    ),
    "two_large_messages": lambda raw: _many(
        raw,
        raw.record(fr.DATA, fr.FIRST, 3, 200 << 10, b"x" * 10),
        raw.record(fr.DATA, fr.FIRST, 5, 200 << 10, b"x" * 10),
    ),
    "too_many_streams": lambda raw: _many(
        raw, *(raw.record(fr.EOF, 0, sid) for sid in (3, 5, 7, 9))
    ),
    "stream_zero": lambda raw: raw.send(fr.DATA, fr.FIRST | fr.LAST, 0, 1, b"x"),
    "eof_on_stream_zero": lambda raw: raw.send(fr.EOF, 0, 0),
    "server_stream_never_opened": lambda raw: raw.message(2, b"hi"),
    "eof_on_server_stream_never_opened": lambda raw: raw.send(fr.EOF, 0, 4),
    "window_for_server_stream_never_opened": lambda raw: raw.send(fr.WINDOW, 0, 2, 1),
    "excess_connection_credit": lambda raw: raw.send(fr.WINDOW, 0, 0, 1),
    "data_after_eof": lambda raw: _many(
        raw, raw.record(fr.EOF, 0, 3), raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 1, b"x")
    ),
    "second_eof": lambda raw: _many(raw, raw.record(fr.EOF, 0, 3), raw.record(fr.EOF, 0, 3)),
    "eof_inside_message": lambda raw: _many(
        raw, raw.record(fr.DATA, fr.FIRST, 3, 10, b"x"), raw.record(fr.EOF, 0, 3)
    ),
    "auth_after_handshake": lambda raw: raw.send(fr.AUTH, payload=bytes(116)),
    "tampered_payload": _tampered_payload,
    "tampered_header": _tampered_header,
    "replayed_record": _replayed,
    "dropped_record": _dropped,
    "unsealed_record": _unsealed,
}
ENCRYPTED_ONLY = {
    "tampered_payload",
    "tampered_header",
    "replayed_record",
    "dropped_record",
    "unsealed_record",
}
ATTACK_CASES = [
    pytest.param(name, encryption, id=f"{name}-{'encrypted' if encryption else 'plaintext'}")
    for name in ATTACKS
    for encryption in (True, False)
    if encryption or name not in ENCRYPTED_ONLY
]


@asynccontextmanager
async def raw_session(
    listener: TcpListener, *, encryption: bool, settings: Settings | None = None
) -> AsyncIterator[tuple[RawPeer, TcpConnection, TcpStream]]:
    """A RawPeer after a valid handshake, the server's end of its connection, and a server
    stream (id 1) that has delivered one message."""
    async with await RawPeer.connect(listener.address) as raw:
        with anyio.fail_after(BOUND):
            await raw.handshake(encryption=encryption, settings=settings)
            conn = await listener.accept()
            assert conn.peer_id == raw.identity.peer_id
            await raw.message(1, b"hello")
            stream = await conn.accept_stream()
            assert bytes(await stream.receive()) == b"hello"
        try:
            yield raw, conn, stream
        finally:
            with anyio.CancelScope(shield=True):
                await conn.aclose()


@pytest.mark.parametrize(("attack", "encryption"), ATTACK_CASES)
async def test_protocol_violation_drops_only_that_connection(attack: str, encryption: bool) -> None:
    async with serving(encryption=encryption, **STRICT) as (transport, listener):
        async with raw_session(listener, encryption=encryption) as (raw, conn, stream):
            assert conn.extra(ConnectionAttribute.encrypted) is encryption
            pending: list[Any] = []
            accepting: list[Any] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(outcome_of, stream.receive, pending)
                tg.start_soon(outcome_of, conn.accept_stream, accepting)  # stream 1 was taken
                await anyio.wait_all_tasks_blocked()
                await ATTACKS[attack](raw)
                with anyio.fail_after(BOUND):
                    await conn.wait_closed()
            assert conn.is_closed
            assert isinstance(pending[0], ConnectionLost), pending
            # a stream the attack itself opened may be accepted first; then it is unusable
            if not isinstance(accepting[0], ConnectionLost):
                assert isinstance(accepting[0], TcpStream), accepting
            with pytest.raises(ConnectionLost):
                await conn.open_stream()
            with pytest.raises(ConnectionLost):
                await stream.send(b"x")
            with anyio.fail_after(BOUND):
                await raw.wait_hangup()
        assert conn not in transport._connections
        assert transport._incoming_limits.total == 0
        await assert_serves(listener, encryption=encryption)


@ENCRYPTION
async def test_legal_records_keep_the_connection(encryption: bool) -> None:
    """The same RawPeer, obeying the rules, is served (so the attacks fail for their reason)."""
    async with (
        serving(encryption=encryption, **STRICT) as (_, listener),
        raw_session(listener, encryption=encryption) as (raw, conn, stream),
    ):
        big = os.urandom(100_000)  # two records: the server's max_record_size is 64 KiB
        await _many(
            raw,
            raw.record(fr.PING),
            raw.record(fr.WINDOW, fr.LARGE_DONE, 0, 0),
            *_small_messages(raw, 1, 8),  # with the 100 kB below, inside the window
            raw.record(fr.DATA, fr.FIRST, 1, len(big), big[: 64 << 10]),
            raw.record(fr.DATA, fr.LAST, 1, 0, big[64 << 10 :]),
            raw.record(fr.DATA, fr.FIRST | fr.LAST, 3, 0, b""),
            raw.record(fr.EOF, 0, 3),
        )
        with anyio.fail_after(BOUND):
            for _ in range(8):
                assert len(await stream.receive()) == 16 << 10
            assert bytes(await stream.receive()) == big
            other = await conn.accept_stream()
            assert bytes(await other.receive()) == b""
            with pytest.raises(anyio.EndOfStream):
                await other.receive()
            await stream.send(b"reply")
            while True:  # the server returned credit (WINDOW) before or with the reply
                ftype, flags, sid, arg, payload, _ = await raw.receive_record()
                if ftype == fr.DATA:
                    break
            assert (flags, sid, arg, payload) == (fr.FIRST | fr.LAST, 1, 5, b"reply")
        assert not conn.is_closed


# -- encryption ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client_encryption", "server_encryption"),
    [(True, True), (True, False), (False, True), (False, False)],
)
async def test_encryption_negotiation(client_encryption: bool, server_encryption: bool) -> None:
    expected = client_encryption or server_encryption
    async with (
        serving(encryption=server_encryption) as (_, listener),
        TcpTransport(Identity.generate(), encryption=client_encryption) as client,
    ):
        dialed, accepted = await pair(client, listener)
        assert dialed.extra(ConnectionAttribute.encrypted) is expected
        assert accepted.extra(ConnectionAttribute.encrypted) is expected
        await roundtrip(dialed, accepted)
        sa, sb = await open_pair(accepted, dialed)
        payload = os.urandom(300_000)
        with anyio.fail_after(BOUND):
            await sa.send(payload)
            assert bytes(await sb.receive()) == payload


@pytest.mark.parametrize(
    ("client_encryption", "server_encryption"), [(True, True), (False, True), (False, False)]
)
async def test_encrypted_records_hide_the_data(
    client_encryption: bool, server_encryption: bool
) -> None:
    """What the server writes on the wire contains the plaintext only when both sides asked."""
    marker = b"this is a secret, do not print it " * 8
    async with (
        serving(encryption=server_encryption) as (_, listener),
        raw_session(listener, encryption=client_encryption) as (raw, _conn, stream),
    ):
        assert raw.encrypted is (client_encryption or server_encryption)
        await stream.send(marker)
        with anyio.fail_after(BOUND):
            while True:
                ftype, _, _, _, payload, wire = await raw.receive_record()
                if ftype == fr.DATA:
                    break
        assert payload == marker
        assert (marker[:16] in wire) is not raw.encrypted


# -- limits --------------------------------------------------------------------------------------


async def test_max_connections_per_peer() -> None:
    async with (
        serving(max_connections_per_peer=1) as (transport, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        first, first_accepted = await pair(client, listener)
        with anyio.fail_after(BOUND):
            try:
                second = await client.connect(listener.address)
            except ConnectError:
                pass  # refused during the handshake: also fine
            else:
                await second.wait_closed()  # refused after the handshake
        await roundtrip(first, first_accepted)  # the first is untouched
        assert transport._incoming_limits.count(client.identity.peer_id) == 1
        await assert_serves(listener)  # other peers are still welcome
        # once the first is gone, the same peer may connect again
        with anyio.fail_after(BOUND):
            await first.aclose()
            await first_accepted.wait_closed()
        third, third_accepted = await pair(client, listener)
        await roundtrip(third, third_accepted)


async def test_max_streams_makes_the_opener_wait() -> None:
    async with (
        serving(max_streams=2) as (_, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        dialed, accepted = await pair(client, listener)
        s1, t1 = await open_pair(dialed, accepted)
        s2, _t2 = await open_pair(dialed, accepted)
        third: list[TcpStream] = []

        async def open_third() -> None:
            stream = await dialed.open_stream()
            await stream.send(b"third")
            third.append(stream)

        async with anyio.create_task_group() as tg:
            tg.start_soon(open_third)
            await anyio.sleep(0.2)
            assert not third, "a third stream was opened beyond the peer's max_streams"
            await s1.aclose()
            await t1.aclose()
            with anyio.fail_after(BOUND):
                t3 = await accepted.accept_stream()
                assert bytes(await t3.receive()) == b"third"
        assert not dialed.is_closed
        assert not accepted.is_closed
        await s2.send(b"still fine")
        with anyio.fail_after(BOUND):
            assert bytes(await _t2.receive()) == b"still fine"


async def test_idle_timeout() -> None:
    async with (
        serving(idle_timeout=0.3) as (_, listener),
        TcpTransport(Identity.generate(), idle_timeout=0.3) as client,
    ):
        # without streams: closed by itself
        idle, idle_accepted = await pair(client, listener)
        with anyio.fail_after(BOUND):
            await idle.wait_closed()
            await idle_accepted.wait_closed()
        # with a stream (open on both sides): kept
        busy, busy_accepted = await pair(client, listener)
        sa, sb = await open_pair(busy, busy_accepted)
        await anyio.sleep(1.0)
        assert not busy.is_closed
        assert not busy_accepted.is_closed
        await sb.send(b"alive")
        with anyio.fail_after(BOUND):
            assert bytes(await sa.receive()) == b"alive"
        # and once the stream is closed on both sides, it becomes idle
        await sa.aclose()
        await sb.aclose()
        with anyio.fail_after(BOUND):
            await busy.wait_closed()
            await busy_accepted.wait_closed()


async def test_keepalive_drops_a_silent_peer() -> None:
    async with serving(keepalive_interval=0.1) as (transport, listener):
        async with raw_session(listener, encryption=True) as (raw, conn, _):
            start = time.monotonic()
            with anyio.fail_after(BOUND):
                await conn.wait_closed()
            assert time.monotonic() - start >= 0.2
            with anyio.fail_after(BOUND):
                await raw.wait_hangup()
        assert not transport._connections
        await assert_serves(listener)


async def test_keepalive_keeps_idle_honest_peers() -> None:
    async with (
        serving(keepalive_interval=0.1) as (_, listener),
        TcpTransport(Identity.generate(), keepalive_interval=0.1) as client,
    ):
        dialed, accepted = await pair(client, listener)
        await anyio.sleep(1.0)
        assert not dialed.is_closed
        assert not accepted.is_closed
        await roundtrip(dialed, accepted)


async def test_many_small_parts_in_one_message() -> None:
    """More parts than an iovec can hold (IOV_MAX is 1024 on Linux) still make one message."""
    async with (
        serving(encryption=False) as (_, listener),
        TcpTransport(Identity.generate(), encryption=False) as client,
    ):
        dialed, accepted = await pair(client, listener)
        sa, sb = await open_pair(dialed, accepted)
        parts = [bytes([i % 251]) * (1 + i % 3) for i in range(5000)]
        with anyio.fail_after(BOUND):
            await sa.send(*parts)
            assert bytes(await sb.receive()) == b"".join(parts)
        await roundtrip(dialed, accepted)


@pytest.mark.parametrize("trigger", ["protocol_error", "aclose"])
async def test_a_blocked_sender_learns_the_connection_died(trigger: str) -> None:
    """A send() blocked on a peer that reads nothing ends with ConnectionLost when the
    connection dies, instead of waiting for write_timeout."""
    async with (
        serving() as (_, listener),
        raw_session(listener, encryption=True) as (raw, conn, stream),
    ):
        outcome: list[Any] = []
        async with anyio.create_task_group() as tg:
            # 32 MiB is a large message for the default windows: sent without credit, and
            # stuck in the socket buffers since the raw peer reads nothing
            tg.start_soon(outcome_of, lambda: stream.send(bytes(32 << 20)), outcome)
            await anyio.sleep(0.2)
            assert not outcome
            with anyio.fail_after(BOUND):
                if trigger == "aclose":
                    await conn.aclose()  # may wait a bounded time for the blocked writer
                else:
                    await raw.send(fr.MAX_TYPE + 1)
                    await conn.wait_closed()
                while not outcome:  # noqa: ASYNC110 (outcome_of appends to a list)
                    await anyio.sleep(0.01)
        assert isinstance(outcome[0], ConnectionLost), outcome


async def test_a_send_waiting_behind_a_blocked_writer_can_be_cancelled() -> None:
    """While one send is stuck on a peer that reads nothing (it holds the connection's writes
    for up to write_timeout), another send that has not started can still be cancelled: an
    all-reduce that gives up on a stalled peer must not wait out write_timeout."""
    async with (
        serving() as (_, listener),
        raw_session(listener, encryption=True) as (_, conn, stream),
    ):
        stuck: list[Any] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(outcome_of, lambda: stream.send(bytes(32 << 20)), stuck)
            await anyio.sleep(0.2)
            assert not stuck
            other = await conn.open_stream()
            started = anyio.current_time()
            with anyio.fail_after(BOUND), anyio.move_on_after(0.3) as waited:
                await other.send(b"a small message")
            assert waited.cancelled_caught
            assert anyio.current_time() - started < 2
            with anyio.fail_after(BOUND):
                await conn.aclose()  # (ends the stuck send too)


@ENCRYPTION
async def test_a_send_cancelled_in_the_middle_of_a_message_resets_the_stream(
    encryption: bool,
) -> None:
    """A send stuck on a peer that reads nothing, cancelled with part of its message written,
    returns at once (not after write_timeout): the connection finishes the record it was in
    and resets the stream, so the peer drops the part it got; the connection goes on."""
    async with (
        serving(encryption=encryption) as (_, listener),
        raw_session(listener, encryption=encryption) as (raw, conn, stream),
    ):
        size = 32 << 20  # a large message: sent without credit, it fills the socket buffers
        with anyio.fail_after(BOUND), anyio.move_on_after(0.3) as scope:
            await stream.send(os.urandom(size))
        assert scope.cancelled_caught
        late = anyio.current_time() - scope.deadline
        assert late < 1.0, f"the cancelled send returned {late:.2f} s late"
        with pytest.raises(StreamReset, match="cancelled"):
            await stream.send(b"more")
        with pytest.raises(StreamReset, match="cancelled"):
            await stream.receive()
        # the peer reads records of the message (never its last), then the stream's RESET
        got = 0
        with anyio.fail_after(BOUND):
            while True:
                ftype, flags, stream_id, _, payload, _ = await raw.receive_record()
                if ftype == fr.RESET:
                    assert stream_id == stream.id
                    break
                if ftype == fr.DATA:
                    assert stream_id == stream.id
                    assert bool(flags & fr.FIRST) == (got == 0)
                    assert not flags & fr.LAST
                    got += len(payload)
        assert 0 < got < size
        # the connection keeps working
        other = await conn.open_stream()
        await other.send(b"still here")
        with anyio.fail_after(BOUND):
            while True:
                ftype, flags, stream_id, _, payload, _ = await raw.receive_record()
                if ftype == fr.DATA:
                    assert (stream_id, payload) == (other.id, b"still here")
                    break
        assert not conn.is_closed


async def test_a_send_whose_stream_the_peer_resets_midway_raises_stream_reset() -> None:
    async with (
        serving() as (_, listener),
        raw_session(listener, encryption=True) as (raw, _, stream),
    ):
        outcome: list[Any] = []

        async def read_on() -> None:  # (and drop that stream's records), as a peer does
            while True:
                await raw.receive_record()

        sent = anyio.Event()

        async def send() -> None:
            await outcome_of(lambda: stream.send(bytes(32 << 20)), outcome)
            sent.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with anyio.fail_after(BOUND):
                # the first record is out: the message has started
                ftype, flags, stream_id, _, _, _ = await raw.receive_record()
                assert (ftype, stream_id) == (fr.DATA, stream.id)
                assert flags & fr.FIRST
                await raw.send(fr.RESET, 0, stream.id, fr.CANCELLED)
                # the sender finds the reset between two batches of the message
                tg.start_soon(read_on)
                await sent.wait()
                tg.cancel_scope.cancel()
        assert isinstance(outcome[0], StreamReset), outcome


# -- fairness ------------------------------------------------------------------------------------


async def test_small_messages_overtake_a_bulk_message() -> None:
    async with serving() as (_, listener), TcpTransport(Identity.generate()) as client:
        dialed, accepted = await pair(client, listener)
        events: list[str] = []
        bulk = bytes(64 << 20)

        async def send_bulk(stream: TcpStream) -> None:
            await stream.send(bulk)
            events.append("bulk sent")

        async def echo() -> None:
            stream = await accepted.accept_stream()  # the bulk stream: not read until the end
            rpc = await accepted.accept_stream()
            async for message in rpc:
                await rpc.send(message)
            got = await stream.receive()
            assert len(got) == len(bulk)
            events.append("bulk received")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(echo)
                bulk_stream = await dialed.open_stream()
                tg.start_soon(send_bulk, bulk_stream)
                while not accepted._streams:  # the bulk's first record has arrived
                    await anyio.lowlevel.checkpoint()
                rpc = await dialed.open_stream()
                for i in range(3):
                    await rpc.send(b"request %d" % i)
                    assert bytes(await rpc.receive()) == b"request %d" % i
                    events.append(f"rpc {i}")
                await rpc.send_eof()
        assert events[:3] == ["rpc 0", "rpc 1", "rpc 2"], events


@pytest.mark.parametrize("encryption", [True, False], ids=["encrypted", "plain"])
async def test_concurrent_bulk_messages_arrive_intact(encryption: bool) -> None:
    """Streams sending multi-record messages at once (sealed records go several to a write,
    from one buffer), some of them in pieces, beside small ones: every byte arrives, in
    order, on its own stream."""
    rng = random.Random(5)
    options = {"encryption": encryption, "max_record_size": 64 << 10}
    messages = {
        s: [rng.randbytes(rng.choice([1, 100, 70_000, 300_000, 1 << 20])) for _ in range(6)]
        for s in range(4)
    }
    async with (
        serving(**options) as (_, listener),
        TcpTransport(Identity.generate(), **options) as client,
    ):
        dialed, accepted = await pair(client, listener)
        got: dict[int, list[bytes]] = {}

        async def send(s: int) -> None:
            stream = await dialed.open_stream()
            await stream.send(s.to_bytes(1, "big"))
            for i, message in enumerate(messages[s]):
                if i % 2:  # in pieces: the transport joins them into records
                    third = len(message) // 3
                    await stream.send(
                        message[:third], message[third : 2 * third], message[2 * third :]
                    )
                else:
                    await stream.send(message)
            await stream.send_eof()

        async def receive() -> None:
            stream = await accepted.accept_stream()
            s = bytes(await stream.receive())[0]
            got[s] = [bytes(m) async for m in stream]

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for s in messages:
                    tg.start_soon(receive)
                    tg.start_soon(send, s)
        assert got == messages


# -- arguments and lifecycle ---------------------------------------------------------------------


def test_encryption_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="encryption"):
        TcpTransport(Identity.generate(), encryption="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"stream_window": 1000}, "stream_window"),
        ({"stream_window": 2.5}, "stream_window"),
        ({"stream_window": 1 << 20, "connection_window": 512 << 10}, "connection_window"),
        ({"max_message_size": 10}, "max_message_size"),
        ({"max_record_size": 1 << 30}, "max_record_size"),
        ({"max_streams": 0}, "max_streams"),
        ({"idle_timeout": 0}, "idle_timeout"),
        ({"idle_timeout": float("nan")}, "idle_timeout"),
        ({"keepalive_interval": -1}, "keepalive_interval"),
        ({"handshake_timeout": True}, "handshake_timeout"),
        ({"max_connections_per_peer": 0}, "max_connections_per_peer"),
        ({"max_pending_handshakes": 0}, "max_pending_handshakes"),
    ],
)
def test_bad_options(options: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        TcpTransport(Identity.generate(), **options)


async def test_use_outside_async_with() -> None:
    transport = TcpTransport(Identity.generate())
    peer = Identity.generate().peer_id
    with pytest.raises(RuntimeError, match="async with"):
        await transport.listen(LOCALHOST)
    with pytest.raises(RuntimeError, match="async with"):
        await transport.connect(Address("tcp", "127.0.0.1", 1, peer))
    async with transport:
        pass
    with pytest.raises(TransportError, match="closed"):
        await transport.listen(LOCALHOST)
    with pytest.raises(RuntimeError, match="only once"):
        async with transport:
            pass


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
async def test_aclose_leaves_no_sockets_or_tasks() -> None:
    tasks_before = asyncio.all_tasks()
    fds_before = _open_fds()
    server = TcpTransport(Identity.generate(), handshake_timeout=5)
    client = TcpTransport(Identity.generate())
    async with server, client:
        listener = await server.listen(LOCALHOST)
        await server.listen("tcp://[::1]:0")
        dialed, accepted = await pair(client, listener)
        sa, sb = await open_pair(dialed, accepted)
        await sa.send(bytes(1 << 20))  # unread data on both sides
        await sb.send(b"unread")
        silent = await anyio.connect_tcp("127.0.0.1", listener.address.port)  # mid-handshake
        raw = await RawPeer.connect(listener.address)
        await raw.handshake()
        await listener.accept()  # a connection whose peer will not answer the goodbye
        await anyio.sleep(0.05)
        assert len(_open_fds() - fds_before) >= 8
        with anyio.fail_after(BOUND):
            await server.aclose()
            await client.aclose()
    await silent.aclose()
    await raw.stream.aclose()
    assert _open_fds() <= fds_before, "sockets left open"
    with anyio.fail_after(BOUND):
        while asyncio.all_tasks() - tasks_before - {asyncio.current_task()}:  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_a_peer_that_resets_its_socket_is_harmless() -> None:
    async with serving(**STRICT) as (transport, listener):
        async with raw_session(listener, encryption=True) as (raw, conn, stream):
            raw_socket = raw.stream.extra(anyio.abc.SocketAttribute.raw_socket)
            raw_socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
            await raw.send_raw(raw.record(fr.DATA, fr.FIRST, 3, 1000, b"x" * 10))
            await anyio.sleep(0.05)
            await raw.stream.aclose()  # RST mid-message
            with anyio.fail_after(BOUND):
                await conn.wait_closed()
                with pytest.raises(ConnectionLost):
                    await stream.receive()
        assert not transport._connections
        await assert_serves(listener)


@ENCRYPTION
async def test_a_message_can_carry_the_streams_eof(encryption: bool) -> None:
    """DATA with FIN: the message, then the end of the stream, from one record."""
    async with (
        serving(encryption=encryption, **STRICT) as (_, listener),
        raw_session(listener, encryption=encryption) as (raw, conn, _stream),
    ):
        await raw.send(fr.DATA, fr.FIRST | fr.LAST | fr.FIN, 3, 4, b"last")
        with anyio.fail_after(BOUND):
            stream = await conn.accept_stream()
            assert bytes(await stream.receive()) == b"last"
            with pytest.raises(anyio.EndOfStream):
                await stream.receive()
            await stream.send(b"the other way is open")
            ftype, flags, stream_id, _, payload, _ = await raw.receive_record()
            assert (ftype, stream_id, payload) == (fr.DATA, 3, b"the other way is open")
            assert not flags & fr.FIN


# -- memory bounds found by fuzz/fuzz_tcp.py ------------------------------------------------------


async def test_streams_ended_before_they_are_accepted_are_bounded() -> None:
    """Streams the peer opens and resets at once no longer count against max_streams, but they
    wait to be accepted: past max_streams of them, new ones are refused, not queued."""
    async with (
        serving(encryption=False, **STRICT) as (_, listener),
        raw_session(listener, encryption=False) as (raw, conn, _stream),
    ):
        ids = range(3, 3 + 2 * 200, 2)
        await raw.send_raw(
            b"".join(raw.record(fr.EOF, 0, i) + raw.record(fr.RESET, 0, i) for i in ids)
        )
        refused: set[int] = set()
        with anyio.fail_after(BOUND):
            while len(refused) < 200 - STRICT["max_streams"]:
                ftype, _, stream_id, code, _, _ = await raw.receive_record()
                if ftype == fr.RESET and code == fr.REFUSED:
                    refused.add(stream_id)
        assert len(conn._accept_queue) <= STRICT["max_streams"]
        assert not conn.is_closed  # opening and resetting streams is legal: refused, not dropped
        await raw.message(1001, b"still served?")
        with anyio.fail_after(BOUND):
            while True:  # the queue is full: this one is refused too, until the app accepts
                ftype, _, stream_id, code, _, _ = await raw.receive_record()
                if stream_id == 1001:
                    assert (ftype, code) == (fr.RESET, fr.REFUSED)
                    break
            for _ in range(STRICT["max_streams"]):
                await conn.accept_stream()
        await raw.message(1003, b"now there is room")
        with anyio.fail_after(BOUND):
            stream = await conn.accept_stream()
            assert bytes(await stream.receive()) == b"now there is room"


async def test_a_peer_that_reads_nothing_cannot_make_us_queue_replies_forever() -> None:
    """Each large-message start on a closed stream earns a credit reply; a peer that sends
    them without reading anything loses its connection once the replies pile up."""
    async with (
        serving(encryption=False, **STRICT) as (_, listener),
        raw_session(listener, encryption=False) as (raw, conn, _stream),
    ):
        large = STRICT["stream_window"] // 2 + 1
        await raw.send_raw(raw.record(fr.EOF, 0, 3) + raw.record(fr.RESET, 0, 3))
        burst = raw.record(fr.DATA, fr.FIRST, 3, large) * 4096
        with anyio.fail_after(30):
            with contextlib.suppress(anyio.BrokenResourceError, ConnectionError):
                while not conn.is_closed:
                    await raw.send_raw(burst)
                    assert len(conn._control) <= 1 << 13
        assert conn.is_closed
        await assert_serves(listener)


# -- the record stream, fuzzed (fuzz/fuzz_tcp.py runs the same target for longer) -----------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
@example(data=None)
def test_record_stream_fuzz(data: st.DataObject | None) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fuzz"))
    import fuzz_tcp

    if data is None:  # a fixed input: a valid message, then garbage
        fuzz_tcp.check_record_stream(fuzz_tcp.Scenario(encrypted=False, chunks=[b"\x00" * 40]))
        return
    fuzz_tcp.check_record_stream(data.draw(fuzz_tcp.scenarios()))


async def test_sealed_bulk_reads_end_between_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of sealed records stop at a record's end (and the next header), so the read
    buffer is empty once they are opened: no partial record is moved to its front (that moved
    a third of the bytes of a bulk transfer). Messages of full-size records and a short last
    one, back to back, all arrive intact."""
    from swarmavg_tcp._connection import TcpConnection

    moved: list[int] = []
    compact = TcpConnection._compact

    def counting(self: TcpConnection) -> None:
        moved.append(self._rend - self._rpos)
        compact(self)

    monkeypatch.setattr(TcpConnection, "_compact", counting)
    async with serving() as (_, listener), TcpTransport(Identity.generate()) as client:
        dialed, accepted = await pair(client, listener)
        sa, sb = await open_pair(dialed, accepted)
        rng = random.Random(7)
        messages = [rng.randbytes(size) for size in (8 << 20, (3 << 20) + 12345, 6 << 20)]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def send_all() -> None:
                    for message in messages:
                        await sa.send(message)

                tg.start_soon(send_all)
                for message in messages:
                    assert bytes(await sb.receive()) == message
        # (a short last record may misalign one read: at most that record is moved)
        assert sum(moved) <= (256 << 10), moved
        await roundtrip(dialed, accepted)


@pytest.mark.parametrize(
    ("max_record_size", "size"),
    [
        pytest.param(None, 9 << 20, id="default records"),
        pytest.param(16 << 20, 40 << 20, id="16 MiB"),
    ],
)
async def test_sealed_bulk_records_are_batched_in_a_cache_sized_buffer(
    max_record_size: int | None, size: int
) -> None:
    """Sealed bulk records are batched, several to a sendmsg, in a buffer of their own of at
    most _SEALED_WRITE bytes (it must fit the L2 cache beside the data being sealed). A peer
    may accept records of up to 16 MiB: then one record goes at a time, from the write buffer
    itself (no second buffer of 16 MiB, nor several records' worth). Every byte arrives."""
    from swarmavg_tcp._connection import _SEALED_WRITE

    options = {} if max_record_size is None else {"max_record_size": max_record_size}
    async with (
        serving(**options) as (_, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        dialed, accepted = await pair(client, listener)
        sa, sb = await open_pair(dialed, accepted)
        message = random.Random(size).randbytes(size)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sa.send, message)
                assert bytes(await sb.receive()) == message
        bulk = dialed._bulk_wbuf
        assert bulk is not None
        if max_record_size is None:
            assert bulk.obj is not dialed._wbuf
            assert 2 * dialed._record_room <= bulk.nbytes <= _SEALED_WRITE
        else:
            assert bulk.obj is dialed._wbuf
            assert bulk.nbytes <= max_record_size + 64
        await roundtrip(dialed, accepted)


def _rto_max_supported() -> bool:
    if sys.platform != "linux":
        return False
    with socket.socket() as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, tcp_transport._TCP_RTO_MAX_MS, 2000)
        except OSError:
            return False
    return True


async def test_connections_cap_the_retransmission_timeout_where_the_kernel_can() -> None:
    """Both ends of a connection cap TCP's retransmission timeout (``TCP_RTO_MAX_MS``, Linux
    6.15 and later), so a connection whose link was cut for a while carries data again within
    a few seconds of the link coming back, not at a retry backed off for as long as the cut
    lasted. Where the kernel has no such option, connections work as before."""
    supported = _rto_max_supported()
    async with (
        serving() as (_, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        dialed, accepted = await pair(client, listener)
        for conn in (dialed, accepted):
            assert isinstance(conn, TcpConnection)
            if supported:
                got = conn._sock.getsockopt(socket.IPPROTO_TCP, tcp_transport._TCP_RTO_MAX_MS)
                assert got == tcp_transport.RTO_MAX_MS == 2000
        await roundtrip(dialed, accepted)


async def test_a_peer_that_only_acknowledges_is_not_idle() -> None:
    """On Linux, ``idle_seconds`` counts the peer's kernel acknowledging what we send as hearing
    from it: a peer whose side of a bulk transfer is done while ours goes on sends no bytes,
    yet it is alive (the DHT closes connections idle for long; closing this one broke an
    all-reduce). Elsewhere only bytes from the peer count."""
    async with (
        serving() as (_, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        dialed, accepted = await pair(client, listener)
        await anyio.sleep(0.5)
        idle = dialed.idle_seconds()
        assert idle is not None
        assert idle >= 0.4
        with anyio.fail_after(BOUND):
            stream = await dialed.open_stream()
            await stream.send(b"x" * 1000)
            served = await accepted.accept_stream()
            assert len(await served.receive()) == 1000
            await anyio.sleep(0.05)
        assert time.monotonic() - dialed._last_receive >= 0.4  # no byte came back ...
        idle = dialed.idle_seconds()
        assert idle is not None
        if sys.platform == "linux":
            assert idle < 0.3  # ... but the peer acknowledged ours
        else:
            assert idle >= 0.4


async def test_bytes_the_kernel_holds_unread_count_as_hearing_from_the_peer() -> None:
    """While a low-water mark holds the peer's bytes in our kernel (the reader wakes only once
    enough of a large record came, which on a slow flow can take seconds), the connection is
    not idle: ``idle_seconds`` counts data our kernel received, not only data we read (the
    DHT closes connections idle for long; closing one that carries an all-reduce breaks it).
    Where the kernel does not tell (not Linux) the transport sets no mark at all."""
    async with (
        serving(encryption=False) as (_, listener),
        TcpTransport(Identity.generate(), encryption=False) as client,
    ):
        dialed, accepted = await pair(client, listener)
        sa, sb = await open_pair(dialed, accepted)
        if sys.platform != "linux":
            assert accepted._lowat_cap == 0  # (no mark: bytes are read as they come)
            await roundtrip(dialed, accepted)
            return
        await anyio.sleep(0.5)
        accepted._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1 << 20)
        traffic = accepted.traffic()
        assert traffic is not None
        with anyio.fail_after(BOUND):
            # a trickle, below the mark (the reader does not wake), for longer than the idle
            # that is asserted below
            for _ in range(30):
                await sa.send(b"x" * 1000)
                await anyio.sleep(0.02)
            for _ in range(400):  # (until our kernel has all of it)
                now = accepted.traffic()
                if now is None or now[1] >= traffic[1] + 30_000:
                    break
                await anyio.sleep(0.01)
        assert time.monotonic() - accepted._last_receive >= 0.9  # nothing was read ...
        idle = accepted.idle_seconds()
        assert idle is not None
        assert idle < 0.3  # ... but the bytes came
        accepted._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        with anyio.fail_after(BOUND):
            for _ in range(30):
                assert bytes(await sb.receive()) == b"x" * 1000


async def test_traffic_counts_what_crossed_the_network() -> None:
    """``traffic()`` (Linux): the kernel's count of bytes the peer acknowledged and bytes that
    arrived, each end's view the mirror of the other's; what the averager measures its
    throughput from, since it does not see a socket buffer filled or drained at once.
    Elsewhere the transport does not tell (``None``)."""
    async with (
        serving() as (_, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        dialed, accepted = await pair(client, listener)
        if sys.platform != "linux":
            assert (dialed.traffic(), accepted.traffic()) == (None, None)
            return
        size = 3 << 20
        (sent, came_back), (their_sent, their_received) = await exchange_and_count(
            dialed, accepted, size, 1000
        )
        # the payload and its framing, nothing more (the transport's overhead is small)
        assert size <= sent <= size * 1.01
        assert 1000 <= came_back <= 2000
        # the other end saw the same bytes arrive and leave (give or take what was in flight
        # when the two ends were first read, the handshake's last bytes)
        assert abs(their_received - sent) < 1000
        assert abs(their_sent - came_back) < 1000


async def test_pacing_caps_the_kernel_s_sending_rate_and_comes_off() -> None:
    """``set_pacing_rate`` (Linux): the kernel's ``SO_MAX_PACING_RATE``, read back from
    ``TCP_INFO``'s ``tcpi_max_pacing_rate``; ``None`` lifts the cap. Elsewhere it cannot."""
    async with (
        serving() as (_, listener),
        TcpTransport(Identity.generate()) as client,
    ):
        dialed, _ = await pair(client, listener)

        def cap() -> int:
            info = dialed._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 120)
            return int(struct.unpack_from("=Q", info, 112)[0])

        if sys.platform != "linux":
            assert dialed.set_pacing_rate(4e6) is False
            return
        unlimited = cap()
        assert unlimited >= 0xFFFFFFFF
        assert dialed.set_pacing_rate(4e6) is True
        assert cap() == 4_000_000
        assert dialed.set_pacing_rate(None) is True
        assert cap() == unlimited
        await dialed.aclose()
        assert dialed.set_pacing_rate(4e6) is False


class _LowatSpy:
    """A connection's socket that records the ``SO_RCVLOWAT`` marks set on it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.marks: list[int] = []

    def setsockopt(self, level: int, option: int, value: Any) -> None:
        if (level, option) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT):
            self.marks.append(value)
        self._sock.setsockopt(level, option, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.mark.parametrize(
    ("rcvbuf", "raised"),
    [pytest.param(1 << 20, True, id="large buffer"), pytest.param(24 << 10, False, id="small")],
)
async def test_bulk_payloads_wake_the_reader_by_the_low_water_mark(
    monkeypatch: pytest.MonkeyPatch, rcvbuf: int, raised: bool
) -> None:
    """While a large record's payload is read straight into its message, ``SO_RCVLOWAT`` has
    the kernel wake the reader once 128 KiB of it (or all that is left of the record) are
    queued, not for every few packets of a slow path. The mark never exceeds what is left of
    the record (the sender writes a record whole once its header went, nothing more is
    promised) nor a quarter of the receive buffer (Linux would clamp the window to it); it is
    back at 1 after each record, so a small message that follows arrives at once. Not on
    Linux, no mark is set (``idle_seconds`` could not see the bytes it holds)."""
    from swarmavg_tcp import _connection as tcp_connection

    wakeups = 0  # (the reader's wake-ups)
    on_readable = TcpConnection._on_readable

    def counting(self: TcpConnection) -> None:
        nonlocal wakeups
        wakeups += 1
        on_readable(self)

    monkeypatch.setattr(TcpConnection, "_on_readable", counting)
    async with (
        serving(encryption=False) as (_, listener),
        TcpTransport(Identity.generate(), encryption=False) as client,
    ):
        dialed, accepted = await pair(client, listener)
        accepted._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        buffer = accepted._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        spy = _LowatSpy(accepted._sock)
        accepted._sock = spy  # type: ignore[assignment]
        sa, sb = await open_pair(dialed, accepted)
        dialed.set_pacing_rate(8e6)  # (Linux: a path slower than the reader, 8 MB/s)
        message = random.Random(5).randbytes(4 << 20)
        wakeups = 0
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sa.send, message)
                assert bytes(await sb.receive()) == message
            during = wakeups
            await sa.send(b"small")  # (the mark is down again: this one wakes the reader)
            assert bytes(await sb.receive()) == b"small"
        assert accepted._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        assert all(mark <= min(tcp_connection._DIRECT_LOWAT, buffer // 4) for mark in spy.marks)
        records = len(message) // (256 << 10)
        if sys.platform != "linux":
            assert spy.marks == []
        elif raised:
            # each 256 KiB record: raised to 128 KiB, lowered to its rest, back to 1
            assert spy.marks.count(tcp_connection._DIRECT_LOWAT) >= records - 1
            assert spy.marks[-1] == 1
            assert during <= 2 * records + 8, during  # (at most one wake-up per 128 KiB)
        else:  # a quarter of the buffer is not worth a mark: the reader wakes as data comes
            assert spy.marks == []
        await roundtrip(dialed, accepted)
