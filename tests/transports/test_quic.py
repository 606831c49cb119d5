"""swarmavg-quic beyond the conformance suite: flow control, limits, refusals, garbage, timers."""

from __future__ import annotations

import itertools
import os
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
from traffic_helpers import exchange_and_count

from swarmavg.address import Address
from swarmavg.errors import (
    ConnectError,
    ConnectionLost,
    MessageTooLarge,
    StreamReset,
    TransportError,
)
from swarmavg.identity import Identity
from swarmavg_quic import QuicConnection, QuicTransport
from swarmavg_quic._aioquic import unacked
from swarmavg_quic._connection import PROBE_MAX
from swarmavg_quic._endpoint import CID_LENGTH

pytestmark = pytest.mark.anyio

KiB, MiB = 1 << 10, 1 << 20


@asynccontextmanager
async def _pair(
    server_options: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[tuple[QuicTransport, QuicTransport, QuicConnection, QuicConnection]]:
    """A dialer and a listener (``server_options`` override ``options`` for it), connected."""
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(QuicTransport(Identity.generate(), **options))
        b = await stack.enter_async_context(
            QuicTransport(Identity.generate(), **{**options, **(server_options or {})})
        )
        listener = await b.listen("quic://127.0.0.1:0")
        with anyio.fail_after(10):
            dialed = await a.connect(listener.address)
            accepted = await listener.accept()
        yield a, b, dialed, accepted


def _udp(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    sock.settimeout(2)
    return sock


# -- traffic and pacing ------------------------------------------------------------------------


async def test_traffic_counts_what_crossed_the_network() -> None:
    """``traffic()``: bytes of the packets the peer acknowledged and of the datagrams that
    came, each end's view the mirror of the other's (what the averager measures its
    throughput from)."""
    async with _pair() as (_, _, dialed, accepted):
        size = 3 * MiB
        (sent, came_back), (their_sent, their_received) = await exchange_and_count(
            dialed, accepted, size, 1000
        )
        # the payload with QUIC's headers and encryption (a few %), nothing lost on loopback
        assert size <= sent <= size * 1.05
        assert 1000 <= came_back <= 20_000  # the reply and the acknowledgements of 3 MiB
        # the other end received what we sent (and sent what came back), give or take
        # acknowledgements in flight and packets the peer did not acknowledge yet
        assert abs(their_received - sent) < 64 * KiB
        assert abs(their_sent - came_back) < 64 * KiB
        assert dialed.set_pacing_rate(1e6) is False  # (each paces at its own model's rate)


async def test_traffic_does_not_count_datagrams_that_do_not_decrypt() -> None:
    """A datagram forged with the connection's ID (an on-path attacker can read it) does not
    raise the received count that the averager's bandwidth is measured from; the connection
    goes on."""
    async with _pair() as (_, _, dialed, accepted):
        await exchange_and_count(dialed, accepted, 64 * KiB, 1000)
        quic = accepted._quic
        before = accepted.traffic()
        forged = bytes([0x40]) + quic.host_cid + bytes(range(256)) * 4  # short header, junk
        for _ in range(10):
            quic.receive_datagram(forged, ("127.0.0.1", 1), now=anyio.current_time())
        assert accepted.traffic() == before
        (sent, _), _ = await exchange_and_count(dialed, accepted, 64 * KiB, 1000)
        assert sent >= 64 * KiB


# -- flow control and memory ------------------------------------------------------------------


async def test_a_receiver_that_reads_nothing_holds_bounded_memory() -> None:
    window, conn_window, send_buffer = 256 * KiB, 1 * MiB, 256 * KiB
    async with _pair(
        stream_window=window, connection_window=conn_window, send_buffer=send_buffer
    ) as (_, _, dialed, accepted):
        streams = []
        for _ in range(8):  # eight bulk streams, none read: together past the connection window
            s = await dialed.open_stream()
            await s.send(b"hi")
            streams.append(s)
        chunk = bytes(64 * KiB)
        sent = 0

        async def push(s: Any) -> None:
            nonlocal sent
            while True:
                await s.send(chunk)
                sent += len(chunk)

        with anyio.move_on_after(1.5):
            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(push, s)
        # the receiver holds at most its connection window plus the incomplete messages (one
        # per stream here, each smaller than a chunk; the documented bound is the window plus
        # one max_message_size), and each sender stream at most its send buffer
        held = accepted._unread + accepted._partial
        assert accepted._partial <= 8 * len(chunk)
        assert held <= conn_window + 8 * len(chunk), held
        assert sent < 4 * conn_window, f"senders were not held back ({sent} bytes sent)"
        for s in streams:
            assert unacked(dialed._quic, s.id) <= send_buffer + 64 * KiB
        # once read, everything arrives, in order and whole
        got = 0
        for _ in range(8):
            r = await accepted.accept_stream()
            assert bytes(await r.receive()) == b"hi"
            while accepted._streams[r.id]._inbox:
                got += (await r.receive()).nbytes
        assert got <= sent


async def test_messages_larger_than_the_windows_arrive_and_do_not_stall_each_other() -> None:
    """Two 3 MiB messages at once over 256 KiB stream / 1 MiB connection windows: the receiver
    lets a message grow past the windows (bounded by max_message_size), and senders keep large
    messages one at a time per connection, so neither starves the other of credit."""
    async with _pair(stream_window=256 * KiB, connection_window=1 * MiB, send_buffer=256 * KiB) as (
        _,
        _,
        dialed,
        accepted,
    ):
        payloads = [os.urandom(3 * MiB), os.urandom(3 * MiB)]
        received: dict[bytes, bytes] = {}

        async def send(payload: bytes) -> None:
            s = await dialed.open_stream()
            await s.send(payload[:8])
            await s.send_last(payload)

        async def receive() -> None:
            r = await accepted.accept_stream()
            key = bytes(await r.receive())
            received[key] = bytes(await r.receive())

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for p in payloads:
                    tg.start_soon(send, p)
                    tg.start_soon(receive)
        assert received == {p[:8]: p for p in payloads}
        assert accepted._unread == accepted._partial == 0


async def test_a_message_over_the_limit_is_refused_by_both_ends() -> None:
    async with _pair(server_options={"max_message_size": 1 * MiB}, max_message_size=2 * MiB) as (
        _,
        _,
        dialed,
        accepted,
    ):
        s = await dialed.open_stream()
        with pytest.raises(MessageTooLarge):
            await s.send(bytes(2 * MiB + 1))  # our own limit
        await s.send(bytes(MiB + 1))  # within ours, over the receiver's: it resets the stream
        r = await accepted.accept_stream()
        with anyio.fail_after(10), pytest.raises(StreamReset):
            await r.receive()
        # the connection keeps working
        t = await dialed.open_stream()
        await t.send(b"fine")
        u = await accepted.accept_stream()
        assert bytes(await u.receive()) == b"fine"


async def _blocked_mid_message(
    dialed: QuicConnection, accepted: QuicConnection
) -> tuple[Any, Any, bytes]:
    """A stream whose receiver holds a window's worth of unread messages, so that a new message
    is written in part (the send buffer's worth) and then waits: the streams, and the message
    read so far."""
    s = await dialed.open_stream()
    first = os.urandom(dialed._stream_window)
    await s.send(first)  # (a receiver takes one message past its window, if it must)
    r = await accepted.accept_stream()
    return s, r, first


async def test_a_send_cancelled_in_the_middle_of_a_message_resets_the_stream() -> None:
    async with _pair(stream_window=256 * KiB, connection_window=1 * MiB, send_buffer=256 * KiB) as (
        _,
        _,
        dialed,
        accepted,
    ):
        s, r, first = await _blocked_mid_message(dialed, accepted)
        with anyio.move_on_after(0.3) as scope:
            await s.send(os.urandom(2 * MiB))  # a large message: it takes the connection's slot
        assert scope.cancelled_caught
        late = anyio.current_time() - scope.deadline
        assert late < 1.0, f"the cancelled send returned {late:.2f} s late"
        # the receiver gets the whole messages sent before, then the reset
        with anyio.fail_after(10):
            assert bytes(await r.receive()) == first
            with pytest.raises(StreamReset):
                await r.receive()
            with pytest.raises(StreamReset):
                await r.send(b"x")
        # our side says so too
        with pytest.raises(StreamReset, match="cancelled"):
            await s.send(b"more")
        with pytest.raises(StreamReset, match="cancelled"):
            await s.receive()
        await s.aclose()
        # the connection goes on, and its large-message slot was given back
        assert dialed._large_sender is None
        t = await dialed.open_stream()
        big = os.urandom(2 * MiB)
        with anyio.fail_after(10):
            await t.send_last(big)
            u = await accepted.accept_stream()
            assert bytes(await u.receive()) == big


async def test_a_message_the_peer_takes_nothing_of_times_out_and_resets_the_stream() -> None:
    async with _pair(
        stream_window=256 * KiB, connection_window=1 * MiB, send_buffer=256 * KiB, write_timeout=0.5
    ) as (_, _, dialed, accepted):
        s, r, first = await _blocked_mid_message(dialed, accepted)
        with anyio.fail_after(10), pytest.raises(StreamReset, match="timed out"):
            await s.send(os.urandom(1 * MiB))
        with anyio.fail_after(10):
            assert bytes(await r.receive()) == first
            with pytest.raises(StreamReset):
                await r.receive()
        assert not dialed.is_closed


async def test_a_large_send_returns_once_written_and_frees_the_slot_when_acknowledged() -> None:
    """A large message no longer waits in send() for its acknowledgement; the pump gives the
    connection's large-message slot back once it comes."""
    async with _pair(stream_window=256 * KiB, connection_window=1 * MiB, send_buffer=4 * MiB) as (
        _,
        _,
        dialed,
        accepted,
    ):
        s = await dialed.open_stream()
        payload = os.urandom(1 * MiB)
        with anyio.fail_after(10):
            await s.send(payload)  # fits the send buffer: handed to aioquic at once
            assert dialed._large_sender is s  # until acknowledged
            r = await accepted.accept_stream()
            assert bytes(await r.receive()) == payload
            while dialed._large_sender is not None:  # (the pump frees it)
                await dialed._progress.wait()


# -- liveness -----------------------------------------------------------------------------------


def _icmp_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _spoof_port_unreachable(ours: tuple[str, int], peer: tuple[str, int]) -> None:
    """Send ``ours`` an ICMP "port unreachable" for a datagram it sent to ``peer`` (which is
    alive): what an off-path attacker could send. Needs a raw socket (root, or CAP_NET_RAW).

    :raises PermissionError: without one.
    """
    src, dst = socket.inet_aton(ours[0]), socket.inet_aton(peer[0])
    # the offending datagram: its IP header and the first 8 bytes of its UDP header
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 8 + 32, 0, 0, 64, 17, 0, src, dst)
    udp = struct.pack("!HHHH", ours[1], peer[1], 8 + 32, 0)
    body = bytes(4) + ip + udp
    checksum = _icmp_checksum(struct.pack("!BBH", 3, 3, 0) + body)
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as raw:
        raw.sendto(struct.pack("!BBH", 3, 3, checksum) + body, (ours[0], 0))


async def _assert_the_probe_is_answered(dialed: QuicConnection, accepted: QuicConnection) -> None:
    # the probe's deadline is at most PROBE_MAX on loopback: the connection outlives it
    with anyio.move_on_after(3 * PROBE_MAX):
        await dialed.wait_closed()
    assert dialed._ping_id >= 1, "no probe was started"
    assert not dialed.is_closed, "a spoofed ICMP error closed a live connection"
    assert dialed._probe_deadline is None, "the probe was not answered"
    s = await dialed.open_stream()
    await s.send(b"still here")
    r = await accepted.accept_stream()
    assert bytes(await r.receive()) == b"still here"


async def test_a_spoofed_icmp_error_costs_a_ping_not_the_connection() -> None:
    async with _pair() as (_, _, dialed, accepted):
        endpoint = dialed._endpoint
        peer = dialed._quic.get_peer_address()
        assert peer is not None
        try:
            _spoof_port_unreachable((endpoint.host, endpoint.port), (peer[0], peer[1]))
        except PermissionError:
            pytest.skip("sending a spoofed ICMP error needs a raw socket (root or CAP_NET_RAW)")
        await _assert_the_probe_is_answered(dialed, accepted)


async def test_a_probe_that_the_peer_answers_leaves_the_connection_alone() -> None:
    """What the endpoint does on an ICMP error for an established connection (without the raw
    socket that a real spoofed error needs)."""
    async with _pair() as (_, _, dialed, accepted):
        dialed._suspect("127.0.0.1 port 9 is unreachable (a test)")
        await _assert_the_probe_is_answered(dialed, accepted)


async def test_a_vanished_peer_is_noticed_while_a_stream_waits() -> None:
    """Default keep-alives (15 s, QUIC idle timeout 45 s): with a stream open, a quiet peer is
    pinged after a second, its closed port answers with ICMP, the probe goes unanswered, and
    the waiting receive() fails, seconds after the peer vanished."""
    async with _pair() as (_, b, dialed, accepted):
        s = await dialed.open_stream()
        await s.send(b"hi")
        r = await accepted.accept_stream()
        assert bytes(await r.receive()) == b"hi"
        for endpoint in list(b._endpoints):  # b vanishes without a word
            endpoint.close()
        start = anyio.current_time()
        with anyio.fail_after(10), pytest.raises(ConnectionLost, match="unreachable"):
            await s.receive()
        assert anyio.current_time() - start < 5


# -- refusals and reachability ----------------------------------------------------------------


async def test_dialing_a_port_nobody_listens_on_fails_fast() -> None:
    sock = _udp()
    port = sock.getsockname()[1]
    sock.close()  # nothing there: the kernel answers with ICMP port unreachable
    async with QuicTransport(Identity.generate(), handshake_timeout=30) as a:
        address = Address("quic", "127.0.0.1", port, Identity.generate().peer_id)
        start = anyio.current_time()
        with anyio.fail_after(10), pytest.raises(ConnectError, match="unreachable"):
            await a.connect(address)
        assert anyio.current_time() - start < 5


async def test_a_socket_whose_listener_closed_refuses_new_connections_at_once() -> None:
    async with _pair(handshake_timeout=30) as (_a, b, dialed, _accepted):
        listener = next(iter(b._listeners))
        address = listener.address
        await listener.aclose()  # its socket stays open for the connection it accepted
        async with QuicTransport(Identity.generate(), handshake_timeout=30) as c:
            start = anyio.current_time()
            with anyio.fail_after(10), pytest.raises(ConnectError):
                await c.connect(address)
            assert anyio.current_time() - start < 5
        assert not dialed.is_closed


async def test_connections_per_peer_are_limited() -> None:
    async with _pair(server_options={"max_connections_per_peer": 1}) as (a, b, dialed, _):
        listener = next(iter(b._listeners))
        with anyio.fail_after(10):
            second = await a.connect(listener.address)  # the handshake completes, then...
            await second.wait_closed()  # ...the listener refuses it
        assert not dialed.is_closed


async def test_one_socket_serves_listening_and_dialing() -> None:
    """A peer that listens dials from its listening port, so others see one port per peer."""
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(QuicTransport(Identity.generate()))
        b = await stack.enter_async_context(QuicTransport(Identity.generate()))
        la = await a.listen("quic://127.0.0.1:0")
        lb = await b.listen("quic://127.0.0.1:0")
        with anyio.fail_after(10):
            conn = await a.connect(lb.address)
            accepted = await lb.accept()
        assert accepted.extra_attributes is not None
        seen_from = accepted._remote_address
        assert seen_from.port == la.address.port
        assert conn._local_address.port == la.address.port
        assert len(a._endpoints) == 1


async def test_datagram_size_follows_the_route() -> None:
    async with _pair() as (_, _, dialed, accepted):
        # loopback carries 64 KiB datagrams: we use the most aioquic writes correctly
        assert dialed._quic._configuration.max_datagram_size == 16383
        assert accepted._quic._configuration.max_datagram_size == 16383
    async with _pair(max_datagram_size=1200) as (_, _, dialed, accepted):
        assert dialed._quic._configuration.max_datagram_size == 1200
        s = await dialed.open_stream()
        payload = os.urandom(300 * KiB)
        await s.send(payload)
        r = await accepted.accept_stream()
        assert bytes(await r.receive()) == payload


# -- garbage ----------------------------------------------------------------------------------


async def test_garbage_datagrams_are_dropped_and_leave_no_state() -> None:
    async with _pair(server_options={"max_pending_handshakes": 4}) as (a, b, dialed, accepted):
        listener = next(iter(b._listeners))
        port = listener.address.port
        junk = _udp()
        try:
            rng = os.urandom
            samples = [b"", b"\x00", rng(20), rng(1199), rng(1500), rng(65000)]
            # shaped like a QUIC v1 Initial (long header, type 0), full size, random inside
            for _ in range(64):
                samples.append(b"\xc0\x00\x00\x00\x01\x08" + rng(8) + b"\x08" + rng(8) + rng(1200))
            # short headers naming the live connection's IDs, random inside
            for _ in range(16):
                samples.append(b"\x40" + accepted._quic.host_cid + rng(200))
            for data in samples:
                junk.sendto(data, ("127.0.0.1", port))
            await anyio.sleep(0.3)
        finally:
            junk.close()
        endpoint = next(iter(b._endpoints))
        assert endpoint.connection_count == 1, "garbage must not leave connections behind"
        assert b._pending_handshakes == 0
        # the live connection and the listener keep working
        s = await dialed.open_stream()
        await s.send(b"still here")
        r = await accepted.accept_stream()
        assert bytes(await r.receive()) == b"still here"
        c = await a.connect(listener.address)
        assert not c.is_closed
        assert len(accepted._quic.host_cid) == CID_LENGTH


async def test_unknown_quic_versions_get_a_version_negotiation() -> None:
    async with QuicTransport(Identity.generate()) as b:
        listener = await b.listen("quic://127.0.0.1:0")
        probe = _udp()
        try:
            initial = b"\xc0\x0a\x0a\x0a\x0a\x08" + bytes(8) + b"\x08" + bytes(8) + bytes(1200)
            probe.sendto(initial, ("127.0.0.1", listener.address.port))
            with anyio.fail_after(5):
                answer = await anyio.to_thread.run_sync(probe.recv, 2048)
        finally:
            probe.close()
        assert answer[1:5] == b"\x00\x00\x00\x00"  # version 0: version negotiation
        assert b"\x00\x00\x00\x01" in answer[5:]  # offers QUIC v1


# -- timers -------------------------------------------------------------------------------------


async def test_keepalives_hold_a_quiet_connection_and_a_vanished_peer_is_noticed() -> None:
    async with _pair(keepalive_interval=0.2, idle_timeout=None) as (_, b, dialed, accepted):
        await anyio.sleep(1.5)  # more than QUIC's idle timeout (3 x 0.2 s), no traffic
        assert not dialed.is_closed
        assert not accepted.is_closed
        for endpoint in list(b._endpoints):  # b vanishes without a word
            endpoint.close()
        with anyio.fail_after(5):
            await dialed.wait_closed()
        with pytest.raises(ConnectionLost):
            await dialed.open_stream()


async def test_a_connection_without_streams_closes_after_idle_timeout() -> None:
    async with _pair(idle_timeout=0.3) as (_, _, dialed, accepted):
        s = await dialed.open_stream()
        await s.send(b"x")
        r = await accepted.accept_stream()
        await r.receive()
        await anyio.sleep(0.6)
        assert not dialed.is_closed  # a stream is open
        await s.aclose()
        await r.aclose()
        with anyio.fail_after(5):
            await dialed.wait_closed()
            await accepted.wait_closed()


def _open_fds() -> int | None:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None


async def test_closing_the_transport_leaves_no_socket_behind() -> None:
    before = _open_fds()
    async with _pair() as (a, b, dialed, _):
        s = await dialed.open_stream()
        await s.send(b"x")
    assert not a._endpoints
    assert not b._endpoints
    if before is not None:
        assert (_open_fds() or 0) <= before


def test_options_are_checked() -> None:
    ident = Identity.generate()
    with pytest.raises(ValueError, match="max_datagram_size"):
        QuicTransport(ident, max_datagram_size=1000)
    with pytest.raises(TypeError, match="max_datagram_size"):
        QuicTransport(ident, max_datagram_size="big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream_window"):
        QuicTransport(ident, stream_window=10)
    with pytest.raises(ValueError, match="connection_window"):
        QuicTransport(ident, stream_window=1 * MiB, connection_window=64 * KiB)
    with pytest.raises(ValueError, match="keepalive_interval"):
        QuicTransport(ident, keepalive_interval=0)
    with pytest.raises(ValueError, match="congestion_control"):
        QuicTransport(ident, congestion_control="vegas")
    with pytest.raises(TypeError, match="congestion_control"):
        QuicTransport(ident, congestion_control=["bbr"])  # type: ignore[arg-type]


def test_the_private_aioquic_hooks_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioquic.quic.connection import QuicConnection as AioQuicConnection

    from swarmavg_quic._aioquic import check_private_api

    check_private_api()  # the pinned aioquic has them
    monkeypatch.delattr(AioQuicConnection, "_write_stream_limits")
    with pytest.raises(RuntimeError, match="_write_stream_limits"):
        check_private_api()
    with pytest.raises(RuntimeError, match="aioquic"):
        QuicTransport(Identity.generate())


async def test_use_outside_async_with() -> None:
    transport = QuicTransport(Identity.generate())
    with pytest.raises(RuntimeError, match="async with"):
        await transport.listen("quic://127.0.0.1:0")
    with pytest.raises(RuntimeError, match="async with"):
        await transport.connect(Address("quic", "127.0.0.1", 1, Identity.generate().peer_id))
    async with transport:
        pass
    with pytest.raises(TransportError, match="closed"):
        await transport.listen("quic://127.0.0.1:0")
    with pytest.raises(RuntimeError, match="only once"):
        async with transport:
            pass


def test_loss_recovery_backs_off_to_at_most_pto_max() -> None:
    """A client whose handshake goes unanswered (the path is down) probes again at growing
    intervals, but never more than PTO_MAX apart, so that it is heard soon after the path
    comes back (aioquic alone doubles the interval without limit: 0.2, 0.4, ... 12.8 s)."""
    from swarmavg_quic._aioquic import PTO_MAX, FlowControlledQuic

    transport = QuicTransport(Identity.generate())
    addr = ("127.0.0.1", 4433)
    quic = FlowControlledQuic(configuration=transport._configuration(is_client=True, addr=addr))
    now = 0.0
    quic.connect(addr, now)
    sent = [now] if quic.datagrams_to_send(now) else []
    while now < 30.0:
        timer = quic.get_timer()
        assert timer is not None
        now = timer
        quic.handle_timer(now)
        if quic.datagrams_to_send(now):
            sent.append(now)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert len(gaps) >= 15  # (0.2, 0.4, 0.8, then every 1.6 s: 21 in 30 s; uncapped: 7)
    assert gaps[1] == pytest.approx(2 * gaps[0])  # it does back off
    assert max(gaps) <= PTO_MAX + 1e-9
    assert PTO_MAX / 2 < gaps[-1] <= PTO_MAX  # (the backed-off PTO is the PTO x a power of 2)
