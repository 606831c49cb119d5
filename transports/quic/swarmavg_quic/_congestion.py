"""A loss-tolerant congestion control for the QUIC transport: a simplified BBR (``"bbr"``).

aioquic ships Reno and CUBIC, which cut their window at every loss. On a long path with random
loss (the network lab's ``bad``: 1% at 150 ms) that holds a connection well under 1 Mbit/s of
a 20 Mbit/s link, whatever the link could carry. Like the kernel's TCP BBR (which the TCP
transport relies on, see the internet guide), this controller builds a model of the path
instead of reading losses as congestion:

* **Bottleneck bandwidth**: each acknowledged packet gives a delivery-rate sample (the bytes
  delivered while it was in flight over the longer of its send and ack intervals); the
  estimate is the largest sample of the last ``BW_WINDOW_ROUNDS`` round trips. A sample taken
  while the connection had too little to send (it went idle) only counts if it raises the
  estimate, so a quiet connection keeps what it measured and resumes at that rate.
* **Round-trip propagation time**: the smallest RTT sample of the last ``MIN_RTT_WINDOW``
  seconds. When that passes without a smaller sample while the connection is busy, it keeps
  at most ``MIN_WINDOW_PACKETS`` in flight for ``PROBE_RTT_TIME`` and a round trip (ProbeRTT),
  which drains the queue it may have built, and samples the path's own delay again.
* **Control**: packets are paced at ``pacing_gain x bandwidth`` and at most
  ``cwnd_gain x bandwidth x min RTT`` are in flight, plus the largest recent burst of
  acknowledgements beyond that rate (a busy receiver's event loop acknowledges in batches, and
  the sender would stall between them; in a userspace stack these bursts are large). Startup
  doubles the rate every round trip until the estimate stops growing by 25% for three rounds,
  then drains the queue it built, then cycles the pacing gain through 1.25, 0.75 and six
  rounds of 1 to probe for more bandwidth and give back the queue the probe made.

Losses do not shrink the window; persistent congestion (everything lost for several probe
timeouts, e.g. a link down) starts over from the smallest window. Left out of Linux's BBR
(v1): long-term bandwidth sampling for policers, and the packet-conservation step during
recovery.

aioquic paces at ``window / smoothed RTT``; :class:`ModelPacer` replaces its pacer on
connections that use this controller so that they pace at the model's rate instead
(:class:`~swarmavg_quic._aioquic.FlowControlledQuic` installs it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from aioquic.quic.congestion.base import (
    K_INITIAL_WINDOW,
    QuicCongestionControl,
    register_congestion_control,
)
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.quic.recovery import QuicPacketPacer

__all__ = ["NAME", "BbrCongestionControl", "ModelPacer"]

#: The name this controller is registered under with aioquic.
NAME: Final = "swarmavg-bbr"

#: Startup's pacing and window gain: the smallest that doubles the delivery rate each round.
STARTUP_GAIN: Final = 2 / math.log(2)
#: The window's gain once the pipe is full (room for delayed and aggregated acknowledgements).
CWND_GAIN: Final = 2.0
#: Pacing gains cycled through (one per min RTT) once the pipe is full.
PROBE_GAINS: Final = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
#: Round trips the bandwidth estimate remembers its largest sample for.
BW_WINDOW_ROUNDS: Final = 10
#: Seconds the propagation time estimate keeps its smallest sample for.
MIN_RTT_WINDOW: Final = 10.0
#: Seconds ProbeRTT holds the window at its smallest (and at least one round trip).
PROBE_RTT_TIME: Final = 0.2
#: Startup ends when the estimate grew less than this factor ...
FULL_BW_GROWTH: Final = 1.25
#: ... for this many round trips in a row.
FULL_BW_ROUNDS: Final = 3
#: The smallest window, in packets.
MIN_WINDOW_PACKETS: Final = 4
#: Packets the window holds beyond ``gain x bandwidth-delay product`` (pacing quanta).
EXTRA_PACKETS: Final = 3
#: Seconds of the pacing rate a connection may send at once (aioquic's pacer: at most 16
#: packets; each burst costs a wake-up of the event loop, too many at high rates in Python).
PACING_BURST: Final = 0.004
#: Round trips the largest burst of acknowledgements is remembered for (about; two halves).
AGGREGATION_ROUNDS: Final = 10
#: The most a burst of acknowledgements adds to the window, in seconds at the estimated rate.
AGGREGATION_MAX: Final = 0.1


class _Sent:
    """What the connection had delivered when a packet was sent (for its rate sample)."""

    __slots__ = ("app_limited", "delivered", "delivered_time", "first_sent_time", "packet")

    def __init__(
        self,
        packet: QuicSentPacket,
        delivered: int,
        delivered_time: float,
        first_sent_time: float,
        app_limited: bool,
    ) -> None:
        self.packet = packet  # (held, so that its id() is not reused while it is a key)
        self.delivered = delivered
        self.delivered_time = delivered_time
        self.first_sent_time = first_sent_time
        self.app_limited = app_limited


class BbrCongestionControl(QuicCongestionControl):
    """Paces at the measured bottleneck bandwidth and ignores random loss (see the module
    docstring). Sans-IO: aioquic's loss recovery calls it with packets and times."""

    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._mds = max_datagram_size
        #: id(packet) -> its state at sending (aioquic reports every in-flight packet it
        #: forgets as acknowledged, lost or expired; the space's discard included)
        self._sent: dict[int, _Sent] = {}
        #: bytes acknowledged in all, and declared lost
        self.delivered = 0
        self.lost = 0
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        #: samples are app-limited until ``delivered`` passes this (0: not app-limited)
        self._app_limited_until = 0
        #: round trips counted (a round ends when a packet sent after it began is acknowledged)
        self.rounds = 0
        self._next_round_delivered = 0
        self._bw_window: deque[tuple[int, float]] = deque()  # (round, rate), rates decreasing
        #: the propagation time estimate (seconds; ``inf`` before the first sample)
        self.min_rtt = math.inf
        self._min_rtt_stamp = 0.0
        self._probe_rtt_due = False
        self._probe_rtt_done: float | None = None
        self._probe_rtt_round_done = False
        self._prior_window = 0
        #: ``"startup"``, ``"drain"``, ``"probe_bw"`` or ``"probe_rtt"``
        self.mode = "startup"
        self.pacing_gain = STARTUP_GAIN
        self._cwnd_gain = STARTUP_GAIN
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self.full_bw_reached = False
        self._cycle_index = 0
        self._cycle_stamp = 0.0
        # acknowledgements that came in bursts, beyond the estimated rate (see _aggregation)
        self._epoch_start = 0.0
        self._epoch_acked = 0
        self._extra_acked = [0.0, 0.0]
        self._extra_slot = 0
        self._extra_stamp = 0

    # -- the model -------------------------------------------------------------------------------

    @property
    def bandwidth(self) -> float:
        """The bottleneck bandwidth estimate, bytes/s (0 before the first sample)."""
        return self._bw_window[0][1] if self._bw_window else 0.0

    def bdp(self) -> float:
        """The bandwidth-delay product estimate in bytes (``nan`` before both are measured)."""
        if not self._bw_window or math.isinf(self.min_rtt):
            return math.nan
        return self.bandwidth * self.min_rtt

    def pacing_rate(self) -> float | None:
        """Bytes/s to pace at (``None`` before the first bandwidth sample: aioquic's own
        ``window / RTT``)."""
        bandwidth = self.bandwidth
        return self.pacing_gain * bandwidth if bandwidth > 0 else None

    def extra_acked(self) -> float:
        """The largest burst of acknowledgements of the last ``AGGREGATION_ROUNDS`` round
        trips beyond what the estimated rate explains, in bytes: the window holds that much
        more so that the sender does not stall between bursts (a receiver that acknowledges
        in batches, as a busy event loop does; Linux's BBR does the same)."""
        return max(self._extra_acked)

    def _aggregation(self, now: float, acked: int, round_start: bool) -> None:
        bandwidth = self.bandwidth
        if bandwidth <= 0:
            return
        if round_start and self.rounds - self._extra_stamp >= AGGREGATION_ROUNDS // 2:
            self._extra_slot ^= 1
            self._extra_acked[self._extra_slot] = 0.0
            self._extra_stamp = self.rounds
        expected = bandwidth * (now - self._epoch_start)
        if self._epoch_acked <= expected:  # acknowledgements no faster than the rate: restart
            self._epoch_start = now
            self._epoch_acked = 0
            expected = 0.0
        self._epoch_acked += acked
        extra = min(
            self._epoch_acked - expected, self.congestion_window, AGGREGATION_MAX * bandwidth
        )
        slot = self._extra_slot
        self._extra_acked[slot] = max(self._extra_acked[slot], extra)

    def _add_sample(self, rate: float) -> None:
        window = self._bw_window
        while window and window[-1][1] <= rate:
            window.pop()
        window.append((self.rounds, rate))
        while window[0][0] <= self.rounds - BW_WINDOW_ROUNDS:
            window.popleft()

    # -- aioquic's interface ---------------------------------------------------------------------

    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        sent_time = packet.sent_time or 0.0
        if self.bytes_in_flight == 0:
            # restarting from idle: intervals begin now, and what we measure until the
            # packets in flight now are delivered says how little we sent, not the path
            self._first_sent_time = self._delivered_time = sent_time
            self._app_limited_until = self.delivered + packet.sent_bytes
        self.bytes_in_flight += packet.sent_bytes
        self._sent[id(packet)] = _Sent(
            packet,
            self.delivered,
            self._delivered_time,
            self._first_sent_time,
            self._app_limited_until > 0,
        )

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        self.bytes_in_flight -= packet.sent_bytes
        self.delivered += packet.sent_bytes
        self._delivered_time = now
        if self._app_limited_until and self.delivered > self._app_limited_until:
            self._app_limited_until = 0
        sent = self._sent.pop(id(packet), None)
        if sent is None:
            return
        round_start = sent.delivered >= self._next_round_delivered
        if round_start:
            self._next_round_delivered = self.delivered
            self.rounds += 1
        sent_time = packet.sent_time or 0.0
        interval = max(sent_time - sent.first_sent_time, now - sent.delivered_time)
        self._first_sent_time = sent_time
        if interval > 0 and not interval < self.min_rtt:
            rate = (self.delivered - sent.delivered) / interval
            if not sent.app_limited or rate >= self.bandwidth:
                self._add_sample(rate)
        if round_start and not self.full_bw_reached and not sent.app_limited:
            self._check_full_pipe()
        self._aggregation(now, packet.sent_bytes, round_start)
        self._update_mode(now, round_start)
        self._set_window(packet.sent_bytes)

    def on_packets_expired(self, *, packets: Iterable[QuicSentPacket]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._sent.pop(id(packet), None)

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        for packet in packets:  # (random loss is no reason to slow down: the model says how)
            self.bytes_in_flight -= packet.sent_bytes
            self.lost += packet.sent_bytes
            self._sent.pop(id(packet), None)

    def on_persistent_congestion(self) -> None:
        """Everything sent for several probe timeouts was lost: the path changed or went
        down; measure it again from the smallest window."""
        self._bw_window.clear()
        self._extra_acked = [0.0, 0.0]
        self.congestion_window = MIN_WINDOW_PACKETS * self._mds
        self._probe_rtt_due = False
        self._probe_rtt_done = None
        self._prior_window = 0
        self.mode = "startup"
        self.pacing_gain = self._cwnd_gain = STARTUP_GAIN
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self.full_bw_reached = False

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        if rtt <= 0:
            return
        expired = now - self._min_rtt_stamp > MIN_RTT_WINDOW
        if rtt <= self.min_rtt or expired:
            self.min_rtt = rtt
            self._min_rtt_stamp = now
        # (a connection that just resumed from idle has no queue to drain: its sample is fresh)
        if expired and not self._app_limited_until and self.mode != "probe_rtt":
            self._probe_rtt_due = True

    def get_log_data(self) -> dict[str, Any]:
        data = super().get_log_data()
        data.update(bandwidth=self.bandwidth, min_rtt=self.min_rtt, mode=self.mode)
        return data

    # -- the state machine -----------------------------------------------------------------------

    def _check_full_pipe(self) -> None:
        bandwidth = self.bandwidth
        if bandwidth >= self._full_bw * FULL_BW_GROWTH:
            self._full_bw = bandwidth
            self._full_bw_rounds = 0
            return
        self._full_bw_rounds += 1
        if self._full_bw_rounds >= FULL_BW_ROUNDS:
            self.full_bw_reached = True

    def _update_mode(self, now: float, round_start: bool) -> None:
        if self._probe_rtt_due:
            self._probe_rtt_due = False
            if self.mode != "probe_rtt":
                self._prior_window = max(self._prior_window, self.congestion_window)
                self.mode = "probe_rtt"
                self.pacing_gain = 1.0
                self._probe_rtt_done = None
        if self.mode == "probe_rtt":
            self._update_probe_rtt(now, round_start)
            return
        if self.mode == "startup" and self.full_bw_reached:
            self.mode = "drain"
            self.pacing_gain = 1 / STARTUP_GAIN
            self._cwnd_gain = STARTUP_GAIN
        bdp = self.bdp()
        if self.mode == "drain" and not self.bytes_in_flight > bdp:
            self._enter_probe_bw(now)
        elif self.mode == "probe_bw":
            # each phase lasts a min RTT; the draining one ends early once the queue is gone
            elapsed = now - self._cycle_stamp > self.min_rtt
            if elapsed or (self.pacing_gain < 1 and not self.bytes_in_flight > bdp):
                self._start_cycle_phase(now)

    def _update_probe_rtt(self, now: float, round_start: bool) -> None:
        if self._probe_rtt_done is None:
            if self.bytes_in_flight <= MIN_WINDOW_PACKETS * self._mds:  # drained: time it
                self._probe_rtt_done = now + max(PROBE_RTT_TIME, self.min_rtt)
                self._probe_rtt_round_done = False
                self._next_round_delivered = self.delivered
            return
        if round_start:
            self._probe_rtt_round_done = True
        if self._probe_rtt_round_done and now >= self._probe_rtt_done:
            self._min_rtt_stamp = now
            self.congestion_window = max(self.congestion_window, self._prior_window)
            self._prior_window = 0
            if self.full_bw_reached:
                self._enter_probe_bw(now)
            else:
                self.mode = "startup"
                self.pacing_gain = self._cwnd_gain = STARTUP_GAIN

    def _enter_probe_bw(self, now: float) -> None:
        self.mode = "probe_bw"
        self._cwnd_gain = CWND_GAIN
        self._cycle_index = 0
        self._start_cycle_phase(now)

    def _start_cycle_phase(self, now: float) -> None:
        self._cycle_index = (self._cycle_index + 1) % len(PROBE_GAINS)
        self.pacing_gain = PROBE_GAINS[self._cycle_index]
        self._cycle_stamp = now

    def _set_window(self, acked: int) -> None:
        floor = MIN_WINDOW_PACKETS * self._mds
        bdp = self.bdp()
        if math.isnan(bdp):  # nothing measured yet: grow as slow start does
            self.congestion_window += acked
            return
        target = self._cwnd_gain * bdp + self.extra_acked() + EXTRA_PACKETS * self._mds
        window = self.congestion_window
        if self.full_bw_reached:
            window = min(window + acked, int(target))
        elif window < target or self.delivered < K_INITIAL_WINDOW * self._mds:
            window += acked
        if self.mode == "probe_rtt":
            window = min(window, floor)
        self.congestion_window = max(window, floor)


class ModelPacer(QuicPacketPacer):
    """aioquic's pacer, at the rate of a :class:`BbrCongestionControl` once it has one."""

    def __init__(self, control: BbrCongestionControl, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._control = control

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        rate = self._control.pacing_rate()
        if rate is None or not smoothed_rtt > 0:
            super().update_rate(congestion_window, smoothed_rtt)
        else:  # (the pacer's rate is window / RTT, and its burst a quarter of the window)
            window = max(int(rate * smoothed_rtt), self._max_datagram_size)
            super().update_rate(window, smoothed_rtt)
            # bursts as long as the acknowledgements' own (a busy receiver's), at least
            # PACING_BURST: sending them smoother would gain nothing and cost wake-ups
            burst = max(PACING_BURST, self._control.extra_acked() / rate)
            self.bucket_max = max(self.bucket_max, min(burst, AGGREGATION_MAX))


register_congestion_control(NAME, BbrCongestionControl)
