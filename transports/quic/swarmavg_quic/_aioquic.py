"""The aioquic connection we drive, and the private parts of aioquic it relies on.

Besides the certificate hooks of :mod:`swarmavg_quic._tls`, swarmavg needs two things aioquic
1.7 has no public API for, so they live here, next to :func:`check_private_api`:

* **Receive flow control that follows the application.** aioquic raises a stream's (and the
  connection's) receive window by doubling it whenever half of it was *received*, whether or not
  anybody read the data, so a fast sender could fill our memory. :class:`FlowControlledQuic`
  grants credit from what the application consumed instead: the transport sets
  ``stream_credit[stream_id]`` and ``data_credit`` (absolute offsets the peer may send up to),
  and the overridden ``_write_stream_limits`` / ``_write_connection_limits`` announce them and
  never double anything on their own.
* **Send-side buffering.** ``send_stream_data`` appends to an unbounded buffer; the transport
  waits while :func:`unacked` bytes of a stream (written, not yet acknowledged) are above its
  send buffer size, and reads how far a stream is written and acknowledged
  (:func:`written_to`, :func:`acked_to`).
* **A cap on loss recovery's backoff.** aioquic doubles its probe timeout (PTO) at every
  probe that goes unanswered, without limit (RFC 9002 sets none): after a path was down for
  10 s, the next probe could be 10 s away, so a connection whose path came back stayed silent
  for as long again. :meth:`FlowControlledQuic.handle_timer` keeps the backed-off timeout at
  most ``max(PTO_MAX, 2 x PTO)``: the count of unanswered probes (``_pto_count`` of aioquic's
  recovery, the timeout's exponent of 2) is lowered to fit, so the interval stops growing at
  the PTO times the largest power of 2 that fits. The TCP transport caps the kernel's
  retransmission timeout likewise.
* **Pacing at a model's rate.** A connection whose congestion control is
  :class:`~swarmavg_quic._congestion.BbrCongestionControl` gets a
  :class:`~swarmavg_quic._congestion.ModelPacer` in place of aioquic's pacer (``_pacer`` of its
  loss recovery), which paces at ``window / smoothed RTT``.
* **Traffic counts.** ``bytes_acked`` adds up the packets the peer acknowledged (each packet's
  ``sent_bytes``, counted where aioquic tells its congestion control, ``on_packet_acked``, which
  is wrapped on the instance) and ``bytes_received`` the datagrams handed to
  ``receive_datagram`` that held a packet from the peer (one that decrypted: a datagram
  forged with the connection's ID does not count): the connection's ``traffic()``.
* **Liveness.** ``last_heard`` is when a packet from the peer last decrypted (an override of
  ``_payload_received``, which aioquic calls for each authenticated packet), and
  :func:`smoothed_rtt` reads the RTT estimate of aioquic's loss recovery; together they decide
  when a quiet peer is pinged and how long a probe waits for its answer.

Whether a connection is closing is read from ``_close_event``: aioquic reports
``ConnectionTerminated`` only at the end of the closing period (three PTOs later), but a peer that
sent CONNECTION_CLOSE is gone at once.
"""

from __future__ import annotations

from typing import Any, Final

from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated
from aioquic.quic.packet_builder import QuicSentPacket

from swarmavg_quic._congestion import BbrCongestionControl, ModelPacer
from swarmavg_quic._tls import AuthenticatingConnection

__all__ = [
    "PTO_MAX",
    "FlowControlledQuic",
    "acked_to",
    "aioquic_buffered",
    "check_private_api",
    "closing_event",
    "smoothed_rtt",
    "unacked",
    "written_to",
]


#: The longest loss recovery waits between probes once backed off (seconds; at least twice the
#: connection's probe timeout).
PTO_MAX: Final = 2.0


class FlowControlledQuic(AuthenticatingConnection):
    """An authenticating ``QuicConnection`` whose receive windows follow consumption."""

    def __init__(self, *, configuration: QuicConfiguration, **kwargs: Any) -> None:
        super().__init__(configuration=configuration, **kwargs)
        #: stream id -> the highest offset the peer may send up to on it (never lowered).
        self.stream_credit: dict[int, int] = {}
        #: the highest total of stream bytes the peer may send on the connection.
        self.data_credit = configuration.max_data
        #: when the last packet from the peer was authenticated (the ``now`` it came with).
        self.last_heard = 0.0
        #: bytes of the packets the peer acknowledged, and of the datagrams that came from
        #: it (the connection's ``traffic()``)
        self.bytes_acked = 0
        self.bytes_received = 0
        self._authenticated = False  # (a packet of the datagram at hand decrypted)
        loss = self._loss
        if isinstance(loss._cc, BbrCongestionControl):  # (it paces at its model's rate)
            loss._pacer = ModelPacer(loss._cc, max_datagram_size=loss._pacer._max_datagram_size)
        acked = loss._cc.on_packet_acked

        def on_packet_acked(*, packet: QuicSentPacket, now: float) -> None:
            self.bytes_acked += packet.sent_bytes
            acked(packet=packet, now=now)

        setattr(loss._cc, "on_packet_acked", on_packet_acked)  # noqa: B010 (an instance's)

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        self._authenticated = False
        super().receive_datagram(data, addr, now)
        if self._authenticated:  # (counted only once the peer's keys vouched for it)
            self.bytes_received += len(data)

    def _payload_received(
        self, context: Any, plain: bytes, crypto_frame_required: bool = False
    ) -> tuple[bool, bool]:
        # aioquic calls this for each packet that decrypted, i.e. that came from the peer
        self.last_heard = context.time
        self._authenticated = True
        result: tuple[bool, bool] = super()._payload_received(
            context, plain, crypto_frame_required=crypto_frame_required
        )
        return result

    def handle_timer(self, now: float) -> None:
        super().handle_timer(now)
        loss = self._loss
        if loss._pto_count > 1:
            pto = loss.get_probe_timeout(include_max_ack_delay=loss.handshake_confirmed)
            longest = max(PTO_MAX, 2 * pto)
            while loss._pto_count > 1 and pto * 2**loss._pto_count > longest:
                loss._pto_count -= 1

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        target = self.stream_credit.get(stream.stream_id)
        if (
            target is not None
            and stream.max_stream_data_local
            and target > stream.max_stream_data_local
        ):
            stream.max_stream_data_local = target
        receiver = stream.receiver
        highest = receiver.highest_offset
        receiver.highest_offset = 0  # aioquic doubles the window when this passes half of it
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:  # also when the packet is full (QuicPacketBuilderStop)
            receiver.highest_offset = highest

    def ack_with_next_packet(self, now: float) -> None:
        """Let the next packet carry the ACK aioquic holds back for up to 1 ms: called before
        we send data, so that a reply acknowledges the request it answers instead of both
        sides sending an ACK-only packet a millisecond later (which costs more CPU here than
        the reply itself)."""
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        if space is not None and space.ack_at is not None and space.ack_at > now:
            space.ack_at = now

    def ack_due(self, now: float) -> bool:
        """Whether aioquic has an acknowledgement to send now."""
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        return space is not None and space.ack_at is not None and space.ack_at <= now

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        limit = self._local_max_data
        if self.data_credit > limit.value:
            limit.value = self.data_credit
        used = limit.used
        limit.used = 0  # the same doubling, for the connection
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used


def unacked(quic: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream and not yet acknowledged by the peer (sent or not)."""
    stream = quic._streams.get(stream_id)
    if stream is None:
        return 0
    sender = stream.sender
    return int(sender._buffer_stop - sender._buffer_start)


def written_to(quic: QuicConnection, stream_id: int) -> int | None:
    """The stream offset up to which we have written data; ``None`` once aioquic forgot the
    stream."""
    stream = quic._streams.get(stream_id)
    return None if stream is None else int(stream.sender._buffer_stop)


def acked_to(quic: QuicConnection, stream_id: int) -> int | None:
    """The stream offset up to which the peer acknowledged all our data; ``None`` once aioquic
    forgot the stream (it does so when everything, FIN included, was acknowledged, or after a
    reset)."""
    stream = quic._streams.get(stream_id)
    return None if stream is None else int(stream.sender._buffer_start)


def smoothed_rtt(quic: QuicConnection) -> float | None:
    """aioquic's smoothed round-trip time in seconds; ``None`` before the first sample."""
    loss = getattr(quic, "_loss", None)
    if loss is None or not getattr(loss, "_rtt_initialized", False):
        return None
    rtt = getattr(loss, "_rtt_smoothed", None)
    return float(rtt) if isinstance(rtt, int | float) else None


def aioquic_buffered(quic: QuicConnection) -> int:
    """Stream bytes aioquic holds for us and has not delivered: data that arrived out of order
    (behind a gap), and the gap itself, which aioquic allocates."""
    total = 0
    for stream in quic._streams.values():
        receiver = stream.receiver
        total += receiver.highest_offset - receiver._buffer_start
    return total


def closing_event(quic: QuicConnection) -> ConnectionTerminated | None:
    """Why the connection is closing or closed, as soon as that is known; else ``None``."""
    event: ConnectionTerminated | None = quic._close_event
    return event


def check_private_api() -> None:
    """Fail loudly if the private parts of aioquic used here have changed.

    :raises RuntimeError: naming what is missing.
    """
    from aioquic.quic.congestion.base import QuicCongestionControl
    from aioquic.quic.recovery import QuicPacketPacer, QuicPacketRecovery
    from aioquic.quic.stream import QuicStreamReceiver, QuicStreamSender

    from swarmavg_quic._tls import check_aioquic

    check_aioquic()
    missing = [
        f"{owner.__name__}.{name}"
        for owner, name in (
            (QuicConnection, "_write_stream_limits"),
            (QuicConnection, "_write_connection_limits"),
            (QuicConnection, "_payload_received"),
            (QuicPacketRecovery, "get_probe_timeout"),
            (QuicCongestionControl, "on_packet_acked"),
        )
        if not callable(getattr(owner, name, None))
    ]
    probe = QuicConnection(configuration=QuicConfiguration(is_client=True))
    recovery = getattr(probe, "_loss", None)
    missing += [
        f"QuicPacketRecovery.{name}"
        for name in ("_pto_count", "handshake_confirmed")
        if not isinstance(getattr(recovery, name, None), int)
    ]
    missing += [
        f"QuicPacketRecovery.{name}"
        for name, kind in (("_cc", QuicCongestionControl), ("_pacer", QuicPacketPacer))
        if not isinstance(getattr(recovery, name, None), kind)
    ]
    if not isinstance(getattr(getattr(recovery, "_pacer", None), "_max_datagram_size", None), int):
        missing.append("QuicPacketPacer._max_datagram_size")
    sender = QuicStreamSender(stream_id=0, writable=True)
    missing += [
        f"QuicStreamSender.{name}"
        for name in ("_buffer_start", "_buffer_stop")
        if not hasattr(sender, name)
    ]
    receiver = QuicStreamReceiver(stream_id=0, readable=True)
    missing += [
        f"QuicStreamReceiver.{name}"
        for name in ("highest_offset", "_buffer_start")
        if not hasattr(receiver, name)
    ]
    if missing:
        import aioquic

        raise RuntimeError(
            f"aioquic {aioquic.__version__} lacks {', '.join(missing)}, which swarmavg-quic "
            "needs (flow control, liveness); install the aioquic version it pins"
        )
