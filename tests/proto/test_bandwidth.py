"""Measuring a peer's throughput from its rounds' transfers (``swarmavg.proto.bandwidth``)."""

from __future__ import annotations

from typing import Any

import pytest

from swarmavg.proto.bandwidth import BandwidthEstimator, peak_rate

MiB = 1 << 20


def test_peak_rate_of_a_steady_flow_is_its_rate() -> None:
    # 8 parts of 1 MiB, one every 0.5 s from t=10: 2 MiB/s whatever the window
    events = [(10.0 + 0.5 * (i + 1), MiB) for i in range(8)]
    for window in (MiB, 2 * MiB, 8 * MiB):
        assert peak_rate(10.0, events, window) == 2 * MiB


def test_peak_rate_is_the_fastest_stretch_of_the_window() -> None:
    # 4 MiB in the first second, then 4 MiB over the next 8 seconds
    events = [(0.25 * (i + 1), MiB) for i in range(4)] + [
        (1.0 + 2.0 * (i + 1), MiB) for i in range(4)
    ]
    assert peak_rate(0.0, events, 4 * MiB) == 4 * MiB  # the first second
    assert peak_rate(0.0, events, 2 * MiB) == 4 * MiB
    # a window of 6 MiB must take 2 MiB of the slow part: 6 MiB over 5 s at best
    assert peak_rate(0.0, events, 6 * MiB) == 6 * MiB / 5.0
    assert peak_rate(0.0, events, 8 * MiB) == 8 * MiB / 9.0
    assert peak_rate(0.0, events, 9 * MiB) is None  # more than moved


def test_peak_rate_ignores_bursts_of_no_duration_and_orders_events() -> None:
    # everything at the start: no rate at all
    assert peak_rate(0.0, [(0.0, MiB), (0.0, MiB)], MiB) is None
    # 3 MiB at t=1 at once (a buffer read after a pause): one event, over the stretch back
    # to the start: 3 MiB/s (not 1 MiB/s, nor a stretch of duration 0)
    assert peak_rate(0.0, [(1.0, MiB)] * 3, MiB) == 3 * MiB
    # after a steady MiB/s, a burst of 2 MiB at t=4 counts over the second before it
    assert (
        peak_rate(0.0, [(1.0, MiB), (2.0, MiB), (3.0, MiB), (4.0, MiB), (4.0, MiB)], MiB) == 2 * MiB
    )
    # out of order, empty events and events before the start (clamped to it) are taken as such
    events = [(3.0, MiB), (-5.0, 0), (2.0, MiB), (1.0, 0)]
    assert peak_rate(1.0, events, 2 * MiB) == MiB


@pytest.mark.parametrize(
    ("window", "events", "match"),
    [
        (0, [], "window_bytes"),
        (float("inf"), [], "window_bytes"),
        (MiB, [(0.0, -1)], "byte count"),
        (MiB, [(0.0, 1.5)], "byte count"),
        (MiB, [(float("nan"), 1)], "time"),
    ],
)
def test_peak_rate_refuses_malformed_input(
    window: float, events: list[tuple[float, Any]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        peak_rate(0.0, events, window)


def _flow(rate: float, total: int, part: int = MiB, start: float = 0.0) -> list[tuple[float, int]]:
    """``total`` bytes in parts of ``part`` at a steady ``rate``."""
    return [(start + (i + 1) * part / rate, part) for i in range(total // part)]


def test_a_round_rate_is_the_slower_direction_leaving_out_small_ones() -> None:
    estimator = BandwidthEstimator(min_bytes=4 * MiB)
    sent, received = _flow(10 * MiB, 16 * MiB), _flow(40 * MiB, 16 * MiB)
    assert estimator.round_rate(0.0, sent, received) == pytest.approx(10 * MiB, rel=1e-12)
    assert estimator.round_rate(0.0, received, sent) == pytest.approx(10 * MiB, rel=1e-12)
    # a direction under min_bytes is left out; both under it: nothing
    assert estimator.round_rate(0.0, _flow(1 * MiB, 3 * MiB), received) == pytest.approx(
        40 * MiB, rel=1e-12
    )
    assert estimator.round_rate(0.0, _flow(1 * MiB, 3 * MiB), _flow(1 * MiB, 3 * MiB)) is None
    assert estimator.round_rate(0.0, [], []) is None


def test_a_round_rate_uses_a_fraction_of_its_bytes_as_the_window() -> None:
    # 16 MiB fast (16 MiB/s), then 48 MiB slow (1 MiB/s): a fast peer waiting on slow ones
    fast = _flow(16 * MiB, 16 * MiB)
    events = fast + _flow(MiB, 48 * MiB, start=1.0)
    # window 64/8 = 8 MiB: inside the fast stretch
    assert BandwidthEstimator().round_rate(0.0, events, []) == 16 * MiB
    # window 64/2 = 32 MiB: 16 MiB fast + 16 MiB slow = 32 MiB over 17 s
    half = BandwidthEstimator(window_fraction=0.5)
    assert half.round_rate(0.0, events, []) == 32 * MiB / 17.0
    # min_window_bytes bounds the window from below: 32 MiB here too
    floor = BandwidthEstimator(min_window_bytes=32 * MiB)
    assert floor.round_rate(0.0, events, []) == 32 * MiB / 17.0


def test_the_estimate_is_the_median_of_recent_rounds_and_reports_big_changes() -> None:
    estimator = BandwidthEstimator(rounds=3, report_factor=2.0)
    assert estimator.estimate is None
    assert not estimator.add_round(0.0, [], _flow(MiB, MiB))  # too small: nothing
    assert estimator.estimate is None
    reports = []
    for rate in (10, 19, 15, 100, 110, 120, 9, 8):
        reports.append(estimator.add_round(0.0, [], _flow(rate * MiB, 8 * MiB)))
        assert estimator.estimate is not None
        reports[-1] = (reports[-1], round(estimator.estimate / MiB, 9))
    assert reports == [
        (True, 10),  # the first estimate
        (False, 14.5),  # median of 10, 19: under 2x the last reported
        (False, 15),  # 10, 19, 15
        (False, 19),  # 19, 15, 100 (the oldest went)
        (True, 100),  # 15, 100, 110: 10x the last reported
        (False, 110),  # 100, 110, 120
        (False, 110),  # 110, 120, 9
        (True, 9),  # 120, 9, 8: under 100 / 2
    ]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("min_bytes", 0),
        ("window_fraction", 0),
        ("window_fraction", 1.5),
        ("min_window_bytes", 0),
        ("rounds", 0),
        ("report_factor", 1.0),
    ],
)
def test_bad_options_are_named(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        BandwidthEstimator(**{option: value})  # type: ignore[arg-type]
