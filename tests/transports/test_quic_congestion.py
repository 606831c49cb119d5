"""The QUIC transport's loss-tolerant congestion control (``swarmavg_quic._congestion``).

The controller is sans-IO: these tests drive it, and aioquic's Reno beside it, through a
simulated path (a bottleneck of a given rate and buffer, a propagation delay, random loss) on a
virtual clock. One test runs it on real connections over loopback."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import anyio
import pytest
from aioquic.quic.congestion.base import QuicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.packet import QuicPacketType
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.tls import Epoch

from swarmavg.identity import Identity
from swarmavg_quic import QuicTransport
from swarmavg_quic._congestion import (
    BW_WINDOW_ROUNDS,
    MIN_RTT_WINDOW,
    BbrCongestionControl,
    ModelPacer,
)

MDS = 1200  # datagram size
MBIT = 1e6 / 8  # bytes/s


@dataclass
class Path:
    """A bottleneck link: ``rate`` bytes/s, ``buffer`` bytes of queue (more is dropped),
    ``rtt`` seconds of propagation, ``loss`` random loss."""

    rate: float
    rtt: float
    loss: float = 0.0
    buffer: float = math.inf
    seed: int = 0
    #: (time, bytes delivered so far) at each acknowledgement
    log: list[tuple[float, int]] = field(default_factory=list)


def drive(
    cc: QuicCongestionControl, path: Path, *, until: float, start: float = 0.0, limit: int = 0
) -> int:
    """Send as much as ``cc`` lets (paced at its rate, or window / RTT) from ``start`` to
    ``until`` (at most ``limit`` bytes if given), let what is in flight then arrive, and
    return the bytes delivered. Losses are reported one RTT after the packet was sent,
    acknowledgements on arrival."""
    rng = random.Random(path.seed)
    now = start
    busy_until = start  # the bottleneck's backlog ends then
    events: list[tuple[float, int, QuicSentPacket, bool]] = []
    numbers = itertools.count()
    next_send = start
    sent = 0
    delivered = before = path.log[-1][1] if path.log else 0
    while now < until or events:
        window_open = now < until and cc.bytes_in_flight + MDS <= cc.congestion_window
        if window_open and now >= next_send and not (limit and sent >= limit):
            packet = QuicSentPacket(
                epoch=Epoch.ONE_RTT,
                in_flight=True,
                is_ack_eliciting=True,
                is_crypto_packet=False,
                packet_number=next(numbers),
                packet_type=QuicPacketType.ONE_RTT,
                sent_time=now,
                sent_bytes=MDS,
            )
            cc.on_packet_sent(packet=packet)
            sent += MDS
            backlog = max(busy_until - now, 0.0) * path.rate
            lost = rng.random() < path.loss or backlog + MDS > path.buffer
            if not backlog + MDS > path.buffer:
                busy_until = max(now, busy_until) + MDS / path.rate
            arrival = busy_until + path.rtt if not lost else now + path.rtt
            heapq.heappush(events, (arrival, packet.packet_number, packet, lost))
            rate = cc.pacing_rate() if isinstance(cc, BbrCongestionControl) else None
            next_send = now + MDS / (rate or cc.congestion_window / path.rtt)
            continue
        can_send = window_open and not (limit and sent >= limit)
        now = min(events[0][0] if events else math.inf, next_send if can_send else math.inf)
        if math.isinf(now):
            break
        while events and events[0][0] <= now:
            _, _, packet, lost = heapq.heappop(events)
            if lost:
                cc.on_packets_lost(now=now, packets=[packet])
            else:
                delivered += packet.sent_bytes
                cc.on_packet_acked(now=now, packet=packet)
                cc.on_rtt_measurement(now=now, rtt=now - (packet.sent_time or 0.0))
                path.log.append((now, delivered))
    return delivered - before


def goodput(path: Path, since: float, until: float) -> float:
    """Bytes/s delivered between two times of the path's log."""
    inside = [(t, d) for t, d in path.log if since <= t <= until]
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def test_it_finds_the_bottleneck_and_paces_at_it() -> None:
    cc = BbrCongestionControl(max_datagram_size=MDS)
    path = Path(rate=20 * MBIT, rtt=0.15)
    drive(cc, path, until=20.0)
    assert cc.mode == "probe_bw"
    assert cc.full_bw_reached
    assert cc.bandwidth == pytest.approx(path.rate, rel=0.05)
    assert cc.min_rtt == pytest.approx(path.rtt, rel=0.02)
    assert goodput(path, 5.0, 20.0) > 0.95 * path.rate
    # it keeps the queue short: about two bandwidth-delay products in flight at most
    assert cc.congestion_window <= 2.2 * path.rate * path.rtt


def test_random_loss_costs_it_little_where_reno_collapses() -> None:
    """The lab's ``bad`` link: 20 Mbit/s, 150 ms, 1% random loss."""
    rates = {}
    for name, cc in (
        ("bbr", BbrCongestionControl(max_datagram_size=MDS)),
        ("reno", RenoCongestionControl(max_datagram_size=MDS)),
    ):
        path = Path(rate=20 * MBIT, rtt=0.15, loss=0.01, seed=1)
        drive(cc, path, until=30.0)
        rates[name] = goodput(path, 5.0, 30.0)
    assert rates["bbr"] > 0.9 * 0.99 * 20 * MBIT
    assert rates["reno"] < 0.25 * 20 * MBIT  # (what the QUIC transport had before)


def test_a_full_buffer_does_not_make_it_grow_the_queue_without_bound() -> None:
    """A shallow bottleneck buffer (a quarter of the bandwidth-delay product): it still fills
    the link, and its window stays near two bandwidth-delay products."""
    path = Path(rate=100 * MBIT, rtt=0.04, buffer=0.25 * 100 * MBIT * 0.04)
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, path, until=10.0)
    assert goodput(path, 3.0, 10.0) > 0.85 * path.rate
    assert cc.congestion_window <= 2.2 * path.rate * path.rtt


def test_after_an_idle_pause_it_resumes_at_the_rate_it_measured() -> None:
    path = Path(rate=20 * MBIT, rtt=0.15)
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, path, until=10.0, limit=int(20 * MBIT * 10))
    bandwidth = cc.bandwidth
    assert bandwidth == pytest.approx(path.rate, rel=0.05)
    # idle, then a trickle (a ping a second) for many round trips: the estimate stays
    for second in range(20, 20 + 4 * BW_WINDOW_ROUNDS):
        drive(cc, path, start=float(second), until=second + 0.9, limit=MDS)
    assert cc.bandwidth == bandwidth
    # and bulk again: at the link's rate within the first two round trips
    path.log.clear()
    drive(cc, path, start=100.0, until=102.0)
    assert goodput(path, 100.0 + 2 * path.rtt, 102.0) > 0.9 * path.rate


def test_a_slower_path_lowers_the_estimate_within_its_window() -> None:
    path = Path(rate=100 * MBIT, rtt=0.04)
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, path, until=5.0)
    assert cc.bandwidth == pytest.approx(path.rate, rel=0.05)
    # a tenth of the rate: the queue it builds at first stretches its round trips (to ~0.8 s
    # here, the buffer being unbounded); after ten of them the estimate follows
    slower = Path(rate=10 * MBIT, rtt=0.04)
    drive(cc, slower, start=5.0, until=25.0)
    assert cc.bandwidth == pytest.approx(slower.rate, rel=0.1)
    assert goodput(slower, 20.0, 25.0) > 0.95 * slower.rate


def test_the_propagation_time_estimate_expires_and_is_probed_again() -> None:
    cc = BbrCongestionControl(max_datagram_size=MDS)
    cc.on_rtt_measurement(now=0.0, rtt=0.05)
    cc.on_rtt_measurement(now=5.0, rtt=0.1)
    assert cc.min_rtt == 0.05  # still in its window
    cc.on_rtt_measurement(now=MIN_RTT_WINDOW + 1, rtt=0.3)
    assert cc.min_rtt == 0.3  # expired: the newest sample, until ProbeRTT measures again
    # on a path for several windows: the estimate stays the path's own delay
    path = Path(rate=20 * MBIT, rtt=0.15)
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, path, until=35.0)
    assert cc.min_rtt == pytest.approx(path.rtt, rel=0.02)
    assert goodput(path, 5.0, 35.0) > 0.95 * path.rate


def test_probe_rtt_drains_a_standing_queue() -> None:
    """A queue that no phase drains (the rate fell tenfold under a full window) makes the RTT
    samples of a whole window too long; ProbeRTT finds the path's delay again."""
    path = Path(rate=100 * MBIT, rtt=0.04)
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, path, until=5.0)
    slower = Path(rate=10 * MBIT, rtt=0.04)
    drive(cc, slower, start=5.0, until=30.0)
    assert cc.min_rtt == pytest.approx(slower.rtt, rel=0.05)


def test_persistent_congestion_starts_over() -> None:
    path = Path(rate=20 * MBIT, rtt=0.15)
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, path, until=5.0)
    assert cc.full_bw_reached
    cc.on_persistent_congestion()
    assert cc.bandwidth == 0.0
    assert cc.mode == "startup"
    assert not cc.full_bw_reached
    assert cc.congestion_window == 4 * MDS
    assert cc.pacing_rate() is None  # (aioquic's window / RTT until it measures again)


def test_the_pacer_follows_the_model() -> None:
    cc = BbrCongestionControl(max_datagram_size=MDS)
    pacer = ModelPacer(cc, max_datagram_size=MDS)
    pacer.update_rate(congestion_window=12_000, smoothed_rtt=0.1)
    assert pacer.packet_time == pytest.approx(MDS / 120_000)  # no sample yet: window / RTT
    drive(cc, Path(rate=20 * MBIT, rtt=0.15), until=5.0)
    pacer.update_rate(congestion_window=cc.congestion_window, smoothed_rtt=0.3)
    rate = cc.pacing_rate()
    assert rate is not None
    assert rate == pytest.approx(cc.pacing_gain * cc.bandwidth)
    assert pacer.packet_time == pytest.approx(MDS / rate, rel=0.01)


@pytest.mark.anyio
async def test_connections_with_it_carry_data_exactly() -> None:
    """Over loopback with ``congestion_control="bbr"``: both ends pace with the model, and
    8 MiB each way arrive intact."""
    payload = random.Random(3).randbytes(8 << 20)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            QuicTransport(Identity.generate(), congestion_control="bbr")
        )
        b = await stack.enter_async_context(
            QuicTransport(Identity.generate(), congestion_control="bbr")
        )
        listener = await b.listen("quic://127.0.0.1:0")
        with anyio.fail_after(60):
            dialed = await a.connect(listener.address)
            accepted = await listener.accept()
            s = await dialed.open_stream()
            await s.send(payload)
            r = await accepted.accept_stream()
            echoed = bytes(await r.receive())
            await r.send(echoed)
            back = bytes(await s.receive())
        assert echoed == payload
        assert back == payload
        for conn in (dialed, accepted):
            loss = conn._quic._loss
            assert isinstance(loss._cc, BbrCongestionControl)
            assert isinstance(loss._pacer, ModelPacer)
            assert loss._cc.bandwidth > 0
