"""Progress accounting (sans-IO) on a fake clock: records, the samples/s EMA, the global
progress, the epoch boundary."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmavg.errors import RemoteProtocolError
from swarmavg.proto.progress import (
    MAX_INTERVAL_RATIO,
    GlobalTrainingProgress,
    LocalTrainingProgress,
    PerformanceEMA,
    ProgressAccounting,
    ProgressSettings,
    aggregate_progress,
    hyperparameters_digest,
    progress_key,
)

ME = b"me" * 10
T0 = 1_000_000.0


def _record(
    peer: bytes,
    epoch: int,
    samples: int,
    speed: float,
    time: float = T0,
    client: bool = False,
    digest: str | None = None,
) -> LocalTrainingProgress:
    return LocalTrainingProgress(peer, epoch, samples, float(speed), time, client, digest)


def _accounting(target: int = 100) -> ProgressAccounting:
    return ProgressAccounting(ProgressSettings(target), ME, client_mode=False, now=T0)


# -- records ---------------------------------------------------------------------------------------


def test_a_record_round_trips_through_msgpack_with_hiveminds_field_names() -> None:
    record = _record(b"peer", 3, 40, 12.5, T0, client=True, digest="abc")
    wire = record.to_wire()
    assert set(wire) == {
        "peer_id", "epoch", "samples_accumulated", "samples_per_second", "time", "client_mode",
        "hyperparameters",
    }  # fmt: skip
    assert LocalTrainingProgress.from_wire(msgpack.unpackb(msgpack.packb(wire))) == record
    plain = _record(b"peer", 0, 0, 0.0)
    assert "hyperparameters" not in plain.to_wire()
    assert LocalTrainingProgress.from_wire(plain.to_wire()) == plain
    # unknown fields (a newer version's) are ignored
    assert LocalTrainingProgress.from_wire({**plain.to_wire(), "future": [1, 2]}) == plain
    stepped = dataclasses.replace(plain, step_samples=16)
    assert stepped.to_wire()["step_samples"] == 16
    assert LocalTrainingProgress.from_wire(stepped.to_wire()) == stepped
    for bad in (-1, 1.5, True, "16"):
        with pytest.raises(RemoteProtocolError, match="step_samples"):
            LocalTrainingProgress.from_wire({**plain.to_wire(), "step_samples": bad})


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("peer_id", "text"),
        ("peer_id", b""),
        ("peer_id", b"x" * 65),
        ("epoch", -1),
        ("epoch", True),
        ("epoch", 1.0),
        ("samples_accumulated", -5),
        ("samples_accumulated", None),
        ("samples_per_second", -0.5),
        ("samples_per_second", float("nan")),
        ("samples_per_second", float("inf")),
        ("samples_per_second", 3),  # (strict: hivemind's StrictFloat)
        ("time", float("nan")),
        ("time", "now"),
        ("client_mode", 1),
        ("hyperparameters", 5),
        ("hyperparameters", ""),
        ("hyperparameters", "x" * 129),
    ],
)
def test_a_bad_field_makes_the_record_invalid(field: str, bad: Any) -> None:
    wire = _record(b"peer", 1, 2, 3.0).to_wire()
    wire[field] = bad
    with pytest.raises(RemoteProtocolError, match=field):
        LocalTrainingProgress.from_wire(wire)


def test_records_that_are_not_maps_or_lack_fields_or_have_too_many_are_invalid() -> None:
    for value in (None, [1, 2], "record", 5):
        with pytest.raises(RemoteProtocolError):
            LocalTrainingProgress.from_wire(value)
    wire = _record(b"peer", 1, 2, 3.0).to_wire()
    for field in ("peer_id", "epoch", "samples_accumulated", "samples_per_second", "time"):
        partial = dict(wire)
        del partial[field]
        with pytest.raises(RemoteProtocolError, match=field):
            LocalTrainingProgress.from_wire(partial)
    with pytest.raises(RemoteProtocolError, match="fields"):
        LocalTrainingProgress.from_wire({**wire, **{f"x{i}": i for i in range(40)}})


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=50),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=8)
    ),
    max_leaves=30,
)
_fields = st.sampled_from(
    [
        "peer_id",
        "epoch",
        "samples_accumulated",
        "samples_per_second",
        "time",
        "client_mode",
        "hyperparameters",
        "other",
    ]
)


@given(st.one_of(_msgpack_values, st.dictionaries(_fields, _msgpack_values, max_size=8)))
def test_whatever_a_peer_publishes_parses_or_is_refused(value: Any) -> None:
    try:
        record = LocalTrainingProgress.from_wire(value)
    except RemoteProtocolError:
        return
    assert LocalTrainingProgress.from_wire(record.to_wire()) == record


def test_a_record_cannot_be_made_invalid_locally() -> None:
    with pytest.raises(ValueError, match="epoch"):
        _record(b"p", -1, 0, 0.0)


def test_the_key_is_hiveminds_and_the_digest_is_stable_and_order_free() -> None:
    assert progress_key("run") == "run_progress"
    a = hyperparameters_digest({"optimizer": "torch.optim.SGD", "lr": 0.1, "target": 256})
    b = hyperparameters_digest({"target": 256, "lr": 0.1, "optimizer": "torch.optim.SGD"})
    assert a == b
    assert len(a) == 16
    assert hyperparameters_digest({"optimizer": "torch.optim.SGD", "lr": 0.2, "target": 256}) != a
    assert hyperparameters_digest({"betas": (0.9, 0.99), "cls": object}) == hyperparameters_digest(
        {"cls": object, "betas": [0.9, 0.99]}
    )
    with pytest.raises(TypeError, match="mapping"):
        hyperparameters_digest([("lr", 0.1)])  # type: ignore[arg-type]


# -- the EMA ---------------------------------------------------------------------------------------


def test_the_ema_is_bias_corrected_so_one_update_gives_the_measured_speed() -> None:
    ema = PerformanceEMA(alpha=0.1, now=0.0)
    assert ema.samples_per_second == pytest.approx(1e-20)
    assert ema.update(10, now=2.0) == pytest.approx(5.0)  # 10 samples in 2 s
    # second update: 10 samples in 0.5 s; EMA of seconds/sample, corrected for its start at 0
    expected_sps = (0.1 * 0.05 + 0.9 * 0.1 * 0.2) / (1 - 0.9**2)
    assert ema.update(10, now=2.5) == pytest.approx(1 / expected_sps)
    assert ema.num_updates == 2


def test_paused_time_does_not_count_and_resuming_restarts_the_timer() -> None:
    ema = PerformanceEMA(alpha=1.0, now=0.0)
    ema.update(10, now=1.0)
    ema.pause()
    ema.pause()  # (nested)
    assert ema.update(10, now=50.0) == pytest.approx(10.0)  # ignored: paused
    ema.resume(now=60.0)
    assert ema.paused
    ema.resume(now=100.0)
    assert not ema.paused
    assert ema.update(10, now=101.0) == pytest.approx(10.0)  # the 100 s paused did not count
    ema.reset_timer(200.0)
    assert ema.update(20, now=201.0) == pytest.approx(20.0)
    assert ema.update(4, now=201.0, interval=0.4) == pytest.approx(10.0)
    with pytest.raises(RuntimeError):
        ema.resume(now=0.0)


def test_one_long_interval_counts_as_at_most_four_predicted_ones() -> None:
    """An evaluation between two steps is not a slowdown: after the first update an interval
    counts as at most MAX_INTERVAL_RATIO times what the estimate predicts (hivemind's EMA would
    read 100 s here and believe the peer 10x slower for dozens of steps)."""
    assert MAX_INTERVAL_RATIO == 4.0
    ema = PerformanceEMA(alpha=0.5, now=0.0)
    assert ema.update(10, now=1.0) == pytest.approx(10.0)  # (the first: taken whole)
    ema.update(10, now=101.0)  # counts as 4 s: 0.4 s/sample, weighted 0.5 (0.1 weighted 0.25)
    assert ema.samples_per_second == pytest.approx(1 / ((0.5 * 0.4 + 0.25 * 0.1) / 0.75))
    for step in range(20):  # a real slowdown shows within a few updates
        ema.update(10, now=200.0 + 10 * step)
    assert ema.samples_per_second == pytest.approx(1.0, rel=1e-3)


def test_the_ema_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="performance_ema_alpha"):
        PerformanceEMA(alpha=0)
    with pytest.raises(ValueError, match="performance_ema_alpha"):
        PerformanceEMA(alpha=1.5)
    with pytest.raises(ValueError, match="task_size"):
        PerformanceEMA().update(0, now=1.0)
    ema = PerformanceEMA(now=10.0)
    ema.update(5, now=9.0)  # (a clock that stepped back: an interval of 0, not negative)
    assert ema.samples_per_second > 0


# -- aggregation -----------------------------------------------------------------------------------


def test_no_records_give_our_own_numbers_and_the_default_refresh() -> None:
    settings = ProgressSettings(100, default_refresh_period=3.0)
    local = _record(ME, 4, 20, 10.0, T0)
    progress = aggregate_progress([], local, settings, T0 + 1)
    assert progress == GlobalTrainingProgress(
        epoch=4,
        samples_accumulated=20,
        target_batch_size=100,
        num_peers=0,
        num_clients=0,
        eta_next_epoch=T0 + 1 + 8.0,
        next_fetch_time=T0 + 1 + 3.0,
    )


def test_the_global_epoch_is_the_highest_of_ours_and_the_non_clients() -> None:
    settings = ProgressSettings(1000)
    local = _record(ME, 2, 0, 1.0)
    others = [_record(b"a", 3, 10, 1.0), _record(b"b", 9, 10, 1.0, client=True)]
    progress = aggregate_progress(others, local, settings, T0)
    assert progress.epoch == 3  # the client at 9 does not raise it
    assert (progress.num_peers, progress.num_clients) == (2, 1)
    # our own epoch counts even if we do not publish
    assert aggregate_progress(others, _record(ME, 5, 0, 1.0), settings, T0).epoch == 5


def test_samples_count_only_at_the_global_epoch_and_are_extrapolated_for_the_eta() -> None:
    settings = ProgressSettings(
        100, min_refresh_period=0.0, max_refresh_period=1e9, expected_drift_peers=0,
        expected_drift_rate=0.0,
    )  # fmt: skip
    records = [
        _record(b"a", 7, 30, 10.0, T0 - 2),  # 30 reported 2 s ago, at 10/s: ~50 now
        _record(b"b", 7, 10, 5.0, T0),
        _record(b"c", 6, 90, 25.0, T0),  # behind: its samples do not count, its speed does
    ]
    progress = aggregate_progress(records, _record(ME, 0, 0, 0.0), settings, T0)
    assert progress.epoch == 7
    assert progress.samples_accumulated == 40  # reported, not extrapolated
    # estimated now: 50 + 10 = 60; missing 40 at 10 + 5 + 25 = 40 samples/s: 1 s
    assert progress.eta_next_epoch == pytest.approx(T0 + 1.0)
    assert progress.next_fetch_time == pytest.approx(T0 + 1.0)  # (no drift: the whole ETA)


def test_the_next_fetch_is_a_drift_adjusted_fraction_of_the_eta_clipped() -> None:
    records = [_record(bytes([i]), 0, 0, 1.0) for i in range(10)]  # 10 peers, 10 samples/s
    local = _record(ME, 0, 0, 0.0)

    def refresh(target: int, **kw: Any) -> float:
        settings = ProgressSettings(target, min_refresh_period=0.5, max_refresh_period=10, **kw)
        return aggregate_progress(records, local, settings, T0).next_fetch_time - T0

    # ETA 10 s; expected peers max(10 + 3, 10 * 1.2) = 13
    assert refresh(100) == pytest.approx(10 * 10 / 13)
    assert refresh(100, expected_drift_peers=0, expected_drift_rate=1.0) == pytest.approx(5.0)
    assert refresh(1000) == pytest.approx(10.0)  # clipped to max_refresh_period
    assert refresh(2) == pytest.approx(0.5)  # clipped to min_refresh_period


def test_our_own_record_is_replaced_by_the_fresher_local_one() -> None:
    settings = ProgressSettings(100)
    stale = _record(ME, 1, 10, 1.0, T0 - 5)
    local = _record(ME, 1, 60, 1.0, T0)
    progress = aggregate_progress([stale, _record(b"a", 1, 5, 1.0, T0)], local, settings, T0)
    assert progress.samples_accumulated == 65
    assert progress.num_peers == 2
    # two records of one peer: the newest counts once
    dup = [_record(b"a", 1, 5, 1.0, T0 - 1), _record(b"a", 1, 7, 1.0, T0)]
    idle = _record(ME, 1, 0, 0.0, T0)
    assert aggregate_progress(dup, idle, settings, T0).samples_accumulated == 7
    # our record not read yet (we just joined), but we train: we count, as a peer too
    joined = aggregate_progress(dup, local, settings, T0)
    assert (joined.samples_accumulated, joined.num_peers) == (67, 2)
    assert aggregate_progress(dup, idle, settings, T0).num_peers == 1


# -- the accounting --------------------------------------------------------------------------------


def test_a_report_at_the_global_epoch_adds_its_difference_at_once() -> None:
    acc = _accounting(100)
    acc.apply_fetch([_record(b"a", 0, 30, 1.0), _record(ME, 0, 0, 0.0)], T0, acc.generation)
    assert acc.global_progress.samples_accumulated == 30
    acc.report_local_progress(0, 16, T0 + 1)
    assert acc.global_progress.samples_accumulated == 46
    acc.report_local_progress(0, 40, T0 + 2)
    assert acc.global_progress.samples_accumulated == 70
    acc.report_local_progress(0, 0, T0 + 3)  # (reset: an fp16 overflow) the count drops
    assert acc.global_progress.samples_accumulated == 30
    acc.report_local_progress(0, 10, T0 + 4, update_global_samples=False)
    assert acc.global_progress.samples_accumulated == 30
    expected = _record(ME, 0, 10, acc.performance_ema.samples_per_second, T0 + 4)
    assert acc.local_progress == dataclasses.replace(expected, step_samples=10)


def test_a_report_at_another_epoch_than_the_global_one_adds_nothing() -> None:
    acc = _accounting(100)
    acc.apply_fetch([_record(b"a", 3, 30, 1.0)], T0, acc.generation)
    assert acc.global_progress.epoch == 3
    acc.report_local_progress(0, 16, T0 + 1)  # we are behind
    assert acc.global_progress.samples_accumulated == 30
    acc.report_local_progress(3, 20, T0 + 2)  # first report at epoch 3: was at 0 before
    assert acc.global_progress.samples_accumulated == 30
    acc.report_local_progress(3, 25, T0 + 3)
    assert acc.global_progress.samples_accumulated == 35


def test_reports_update_the_ema_or_restart_its_timer() -> None:
    acc = ProgressAccounting(
        ProgressSettings(100), ME, client_mode=False, now=T0, performance_ema_alpha=1.0
    )
    acc.report_local_progress(0, 10, T0 + 100)  # the first: starts the timer (set-up before)
    assert acc.performance_ema.num_updates == 0
    acc.report_local_progress(0, 20, T0 + 102)
    assert acc.performance_ema.samples_per_second == pytest.approx(5.0)
    assert acc.local_progress.samples_per_second == pytest.approx(5.0)
    acc.report_local_progress(0, 0, T0 + 110)  # reset: the timer restarts, the speed stays
    assert acc.performance_ema.samples_per_second == pytest.approx(5.0)
    acc.report_local_progress(0, 20, T0 + 111)
    assert acc.performance_ema.samples_per_second == pytest.approx(20.0)


def test_update_epoch_only_while_paused_and_it_moves_the_global_epoch_forward_only() -> None:
    acc = _accounting(100)
    with pytest.raises(RuntimeError, match="pause_updates"):
        acc.update_epoch(1, T0)
    acc.apply_fetch([_record(b"a", 0, 90, 1.0), _record(ME, 0, 20, 1.0)], T0, acc.generation)
    acc.pause()
    assert acc.update_epoch(None, T0 + 1) == 1
    assert acc.global_progress.epoch == 1
    assert acc.global_progress.samples_accumulated == 0
    assert acc.global_progress.eta_next_epoch == math.inf
    assert (acc.local_progress.epoch, acc.local_progress.samples_accumulated) == (1, 0)
    acc.resume(T0 + 1)
    acc.apply_fetch([_record(b"a", 5, 50, 1.0)], T0 + 2, acc.generation)
    acc.pause()
    assert acc.update_epoch(2, T0 + 3) == 2  # behind the swarm: the global epoch stays
    assert acc.global_progress.epoch == 5
    assert acc.global_progress.samples_accumulated == 50
    with pytest.raises(ValueError, match="new_epoch"):
        acc.update_epoch(-1, T0)
    acc.resume(T0 + 3)
    with pytest.raises(RuntimeError):
        acc.resume(T0 + 3)


def test_ready_to_update_epoch_has_three_clauses_including_the_eta() -> None:
    acc = _accounting(100)
    acc.apply_fetch([_record(b"a", 0, 10, 10.0), _record(ME, 0, 0, 0.0)], T0, acc.generation)
    eta = acc.global_progress.eta_next_epoch
    assert eta == pytest.approx(T0 + 9.0)
    assert not acc.ready_to_update_epoch(T0 + 1)
    assert acc.estimated_next_update_time(T0 + 1) == eta
    assert acc.ready_to_update_epoch(eta)  # on the estimate alone: reports say 10 of 100
    assert acc.estimated_next_update_time(eta + 1) == eta + 1
    acc.report_local_progress(0, 90, T0 + 2)  # the target's samples, reported
    assert acc.ready_to_update_epoch(T0 + 2)
    behind = _accounting(100)
    behind.apply_fetch([_record(b"a", 1, 0, 1.0)], T0, behind.generation)
    assert behind.ready_to_update_epoch(T0)  # the swarm is ahead


def _trained(target: int, *, speed: float = 10.0, step: int = 10) -> ProgressAccounting:
    """An accounting that trained two steps of ``step`` samples at ``speed`` (samples/s) in
    epoch 0, then entered epoch 1 and read the records: itself and a peer "a" as fast."""
    acc = ProgressAccounting(
        ProgressSettings(target), ME, client_mode=False, now=T0, performance_ema_alpha=1.0
    )
    acc.report_local_progress(0, step, T0)
    acc.report_local_progress(0, 2 * step, T0 + step / speed)
    assert acc.performance_ema.samples_per_second == pytest.approx(speed)
    acc.pause()
    acc.update_epoch(1, T0 + 1)
    acc.resume(T0 + 1)
    acc.apply_fetch(
        [_record(b"a", 1, 0, speed, T0 + 1), _record(ME, 1, 0, speed, T0 + 1)],
        T0 + 1,
        acc.generation,
    )
    return acc


def test_a_training_peer_measures_the_eta_in_its_own_training_not_wall_time() -> None:
    """Two peers at 10 samples/s, target 100: the epoch ends after 50 samples of ours, however
    long we paused (the whole swarm evaluates at the same time); at the first step at or after
    the estimate by default, at the nearest one with ``nearest_step``."""
    acc = _trained(100)
    assert acc.global_progress.eta_next_epoch == pytest.approx(T0 + 6.0)
    assert not acc.ready_to_update_epoch(T0 + 1000)  # a long pause: no samples, not ready
    for samples in (10, 20, 30, 40):
        acc.report_local_progress(1, samples, T0 + 1000 + samples / 10)
        assert not acc.ready_to_update_epoch(T0 + 1000 + samples / 10)
    assert acc.estimated_next_update_time(T0 + 1004) == pytest.approx(T0 + 1005)
    acc.report_local_progress(1, 50, T0 + 1005)
    assert acc.ready_to_update_epoch(T0 + 1005)  # 50 of ours + (as the estimate has it) 50


def test_a_peer_alone_ends_at_the_target_however_its_speed_changes() -> None:
    """The ETA was computed at one speed; the peer then slows down 10x (a delayed step in the
    background, a busy machine): it ends at exactly the target, not when its slower speed
    says the estimated end has come."""
    acc = ProgressAccounting(
        ProgressSettings(100), ME, client_mode=False, now=T0, performance_ema_alpha=1.0
    )
    acc.report_local_progress(0, 10, T0)
    acc.report_local_progress(0, 20, T0 + 1)  # 10 samples/s
    acc.apply_fetch([acc.local_progress], T0 + 1, acc.generation)
    now = T0 + 1
    for samples in range(30, 100, 10):
        now += 10.0  # (1 sample/s now)
        acc.report_local_progress(0, samples, now)
        assert not acc.ready_to_update_epoch(now, nearest_step=True), samples
    acc.report_local_progress(0, 100, now + 10)
    assert acc.ready_to_update_epoch(now + 10)


def test_nearest_step_ends_the_epoch_at_the_step_nearest_to_the_estimate() -> None:
    """Two peers as fast, target 100: the estimated end is at 50 samples of ours. With steps
    of 40, the step at 40 is nearer to it than the one at 80: only ``nearest_step`` ends
    there. With steps of 30, 30 is farther than 60: neither ends at 30."""
    forty = _trained(100, step=40, speed=40.0)
    forty.report_local_progress(1, 40, T0 + 2)
    assert forty.ready_to_update_epoch(T0 + 2, nearest_step=True)
    assert not forty.ready_to_update_epoch(T0 + 2)
    assert forty.estimated_next_update_time(T0 + 2) == pytest.approx(T0 + 2 + 10 / 40)
    forty.report_local_progress(1, 80, T0 + 3)
    assert forty.ready_to_update_epoch(T0 + 3)
    thirty = _trained(100, step=30, speed=30.0)
    thirty.report_local_progress(1, 30, T0 + 2)
    assert not thirty.ready_to_update_epoch(T0 + 2, nearest_step=True)
    assert thirty.estimated_next_update_time(T0 + 2, nearest_step=True) == pytest.approx(
        T0 + 2 + 5 / 30
    )
    thirty.report_local_progress(1, 60, T0 + 3)
    assert thirty.ready_to_update_epoch(T0 + 3, nearest_step=True)


def test_a_peer_is_extrapolated_by_at_most_its_latest_step() -> None:
    """Peer "a" reported 40 samples 10 s ago at 10 samples/s: without its step size it counts
    as 140 now (hivemind's estimate); with steps of 8, as 48 (it publishes after each step:
    a record that old means it is not training, e.g. it evaluates)."""
    settings = ProgressSettings(1000)
    me = _record(ME, 0, 0, 10.0, T0 + 10)
    old = _record(b"a", 0, 40, 10.0, T0)
    uncapped = aggregate_progress([old, me], me, settings, T0 + 10)
    assert uncapped.eta_next_epoch == pytest.approx(T0 + 10 + (1000 - 140) / 20)
    capped = aggregate_progress(
        [dataclasses.replace(old, step_samples=8), me], me, settings, T0 + 10
    )
    assert capped.eta_next_epoch == pytest.approx(T0 + 10 + (1000 - 48) / 20)
    assert capped.samples_accumulated == uncapped.samples_accumulated == 40


def test_peers_whose_record_went_stale_are_not_active() -> None:
    """What a training loop expects to average with: a peer publishes after each step, so a
    record 10 of its steps old (at least 5 s) is a dead or stalled peer's (its record outlives
    it by up to metadata_expiration)."""
    settings = ProgressSettings(1000)
    me = _record(ME, 0, 16, 10.0, T0 + 100)
    fresh = _record(b"a", 0, 16, 10.0, T0 + 99)
    slow = dataclasses.replace(_record(b"b", 0, 16, 1.0, T0 + 60), step_samples=8)  # 8 s steps
    dead = dataclasses.replace(_record(b"c", 0, 16, 100.0, T0 + 90), step_samples=10)
    zero = dataclasses.replace(_record(b"d", 0, 16, 0.0, T0 + 97), step_samples=10)
    progress = aggregate_progress([me, fresh, slow, dead, zero], me, settings, T0 + 100)
    assert progress.num_peers == 5
    assert progress.num_active_peers == 4  # (c: 10 s old, its steps take 0.1 s; b: 40 of 80 s)


def test_a_peer_without_a_speed_yet_makes_us_read_again_soon() -> None:
    settings = ProgressSettings(1000, min_refresh_period=0.5, max_refresh_period=10.0)
    me = _record(ME, 0, 16, 10.0, T0)
    known = aggregate_progress([_record(b"a", 0, 16, 10.0)], me, settings, T0)
    assert known.next_fetch_time == T0 + 10.0  # (the ETA is far: the longest period)
    new = aggregate_progress([_record(b"a", 0, 16, 0.0)], me, settings, T0)
    assert new.next_fetch_time == T0 + 0.5


def test_our_first_step_makes_us_read_the_records_soon() -> None:
    """The records read before we trained (at start-up) are likely stale."""
    acc = _accounting(100)
    assert acc.global_progress.next_fetch_time == T0 + 3.0  # (no record: the default period)
    acc.report_local_progress(0, 16, T0 + 1)
    assert acc.global_progress.next_fetch_time == T0 + 1.5
    assert acc.performance_ema.num_updates == 0  # (set-up time is not training time)


def test_a_peer_that_never_accumulates_never_publishes() -> None:
    aux = _accounting(100)
    for i in range(5):
        aux.report_local_progress(0, 0, T0 + i)
        assert aux.record_to_publish() is None


def test_a_peer_publishes_while_within_one_epoch_of_the_swarm() -> None:
    acc = _accounting(100)
    assert acc.record_to_publish() is None  # nothing accumulated yet
    acc.report_local_progress(0, 8, T0 + 1)
    assert acc.record_to_publish() == acc.local_progress
    acc.pause()
    acc.update_epoch(1, T0 + 2)
    acc.resume(T0 + 2)
    assert acc.record_to_publish() == acc.local_progress  # 0 samples, at the last epoch + 1
    acc.apply_fetch([_record(b"a", 3, 0, 1.0)], T0 + 3, acc.generation)
    assert acc.record_to_publish() is None  # two epochs behind, no samples since


def test_a_fetch_that_overlaps_a_pause_is_discarded() -> None:
    acc = _accounting(100)
    before = acc.global_progress
    generation = acc.generation
    acc.pause()
    assert acc.apply_fetch([_record(b"a", 4, 1, 1.0)], T0, acc.generation) is None
    acc.resume(T0)
    assert acc.apply_fetch([_record(b"a", 4, 1, 1.0)], T0, generation) is None  # began before
    assert acc.global_progress == before
    assert acc.apply_fetch([_record(b"a", 4, 1, 1.0)], T0, acc.generation) is not None
    assert acc.global_progress.epoch == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"target_batch_size": 0}, ValueError, "target_batch_size"),
        ({"target_batch_size": 1.5}, TypeError, "target_batch_size"),
        ({"target_batch_size": True}, TypeError, "target_batch_size"),
        ({"min_refresh_period": -1}, ValueError, "min_refresh_period"),
        ({"max_refresh_period": 0}, ValueError, "max_refresh_period"),
        ({"default_refresh_period": float("inf")}, ValueError, "default_refresh_period"),
        ({"expected_drift_peers": "3"}, TypeError, "expected_drift_peers"),
        ({"expected_drift_rate": -0.1}, ValueError, "expected_drift_rate"),
        ({"min_refresh_period": 5, "max_refresh_period": 1}, ValueError, "min_refresh_period"),
    ],
)
def test_settings_name_the_bad_argument(kwargs: dict[str, Any], error: type, name: str) -> None:
    kwargs = {"target_batch_size": 10, **kwargs}
    with pytest.raises(error, match=name):
        ProgressSettings(**kwargs)


def test_reports_name_the_bad_argument() -> None:
    acc = _accounting()
    with pytest.raises(ValueError, match="samples_accumulated"):
        acc.report_local_progress(0, -1, T0)
    with pytest.raises(TypeError, match="local_epoch"):
        acc.report_local_progress(0.5, 1, T0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hyperparameters"):
        ProgressAccounting(ProgressSettings(1), ME, client_mode=False, now=T0, hyperparameters="")
