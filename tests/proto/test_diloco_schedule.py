"""DiLoCo's rounds and epochs (sans-IO) on a fake clock."""

from __future__ import annotations

import pytest

from swarmavg.proto.diloco import (
    DIGEST_SIZE,
    EPOCH_BITS,
    LOAD_BACKOFF,
    DiLoCoSchedule,
    epoch_group_bits,
    gather_payload,
    parse_gathered,
    round_weight,
)

A, B, C = b"\x01peer-a", b"\x02peer-b", b"\x03peer-c"
X, Y = b"x" * DIGEST_SIZE, b"y" * DIGEST_SIZE


def test_a_round_is_due_every_sync_every_inner_steps() -> None:
    schedule = DiLoCoSchedule(3)
    assert [schedule.inner_step_done() for _ in range(3)] == [False, False, True]
    with pytest.raises(RuntimeError, match="no round is due"):
        DiLoCoSchedule(3).plan_round(2, 0)
    assert schedule.plan_round(num_peers=2, global_epoch=0) == "average"
    assert schedule.plan_round(num_peers=1, global_epoch=0) == "alone"
    assert schedule.plan_round(num_peers=0, global_epoch=0) == "alone"  # (not published yet)
    assert schedule.plan_round(num_peers=3, global_epoch=1) == "behind"
    report = schedule.round_succeeded(alone=False, group_size=3, seconds=0.5)
    assert (report.epoch, report.outcome, report.action, report.group_size) == (
        0,
        "averaged",
        "outer_step",
        3,
    )
    assert report.inner_steps == 3
    assert schedule.outer_epoch == 1
    assert schedule.inner_step == 0
    assert schedule.global_step == 3
    assert schedule.inner_step_done() is False
    assert schedule.global_step == 4
    assert schedule.last_round is report
    assert schedule.rounds_averaged == 1


def test_alone_rounds_count_separately() -> None:
    schedule = DiLoCoSchedule(1)
    schedule.inner_step_done()
    report = schedule.round_succeeded(alone=True, group_size=5)
    assert report.outcome == "alone"
    assert report.group_size == 1
    assert (schedule.rounds_alone, schedule.rounds_averaged) == (1, 0)


def test_rollback_discards_local_progress_and_keep_local_keeps_it() -> None:
    rollback, keep = DiLoCoSchedule(2, "rollback"), DiLoCoSchedule(2, "keep_local")
    for schedule in (rollback, keep):
        schedule.inner_step_done()
        schedule.inner_step_done()
    report = rollback.round_failed("timed out")
    assert (report.outcome, report.action, report.error) == ("failed", "rollback", "timed out")
    assert rollback.inner_step == 0
    assert rollback.outer_epoch == 0
    assert rollback.global_step == 0
    assert rollback.rounds_failed == 1
    assert rollback.last_round is report
    report = keep.round_failed("timed out")
    assert report.action == "keep_local"
    assert report.inner_steps == 2
    assert keep.inner_step == 2
    assert keep.outer_epoch == 0
    # the next round of keep_local comes after sync_every more steps, with both rounds' steps
    assert [keep.inner_step_done(), keep.inner_step_done()] == [False, True]
    assert keep.round_succeeded(alone=False, group_size=2).inner_steps == 4
    assert keep.outer_epoch == 1
    assert keep.inner_step == 0


def test_gathered_epochs_show_a_peer_ahead() -> None:
    schedule = DiLoCoSchedule(1, outer_epoch=5)
    gathered = {A: gather_payload(5, X), B: gather_payload(4, Y), C: gather_payload(5, X)}
    check = schedule.check_round(gathered, X)
    assert (check.verdict, check.reference, check.diverged) == ("agree", A, 0)
    assert schedule.check_round({A: gather_payload(5, X), B: gather_payload(6, X)}, X).verdict == (
        "behind"
    )
    malformed: list[object] = [
        True,
        "9",
        None,
        7,
        {"epoch": True, "theta": X},
        {"epoch": 7.0, "theta": X},
        {"epoch": -1, "theta": X},
        {"epoch": 9, "theta": b"short"},
        {"epoch": 9, "theta": "x" * DIGEST_SIZE},
        {"epoch": 9},
    ]
    for value in malformed:  # (ignored: neither behind nor the reference)
        assert parse_gathered(value) is None
        check = schedule.check_round({A: value, B: gather_payload(5, Y)}, Y)
        assert (check.verdict, check.reference) == ("agree", B)
    assert schedule.check_round({}, X).verdict == "agree"


def test_the_reference_is_the_lowest_peer_at_the_highest_epoch() -> None:
    """Members at the same epoch with other θ_global: the one with the lowest PeerID holds
    the reference; every member whose digest is not the reference's has diverged."""
    schedule = DiLoCoSchedule(1, outer_epoch=3)
    gathered = {C: gather_payload(3, X), B: gather_payload(3, Y), A: gather_payload(3, X)}
    check = schedule.check_round(gathered, X)
    assert (check.verdict, check.reference, check.diverged) == ("agree", A, 1)
    check = schedule.check_round(gathered, Y)
    assert (check.verdict, check.reference, check.diverged) == ("diverged", A, 1)
    # a member behind us does not count: it fails its own round
    behind = {A: gather_payload(2, Y), B: gather_payload(3, X)}
    assert schedule.check_round(behind, X).reference == B
    assert schedule.check_round(behind, X).verdict == "agree"


def test_a_diverged_round_always_rolls_back() -> None:
    for policy in ("rollback", "keep_local"):
        schedule = DiLoCoSchedule(2, policy, outer_epoch=1)
        schedule.inner_step_done()
        schedule.inner_step_done()
        report = schedule.round_failed("another θ_global", diverged=True)
        assert (report.outcome, report.action, report.inner_steps) == ("failed", "rollback", 2)
        assert (schedule.inner_step, schedule.outer_epoch) == (0, 1)
        assert (schedule.rounds_failed, schedule.rounds_diverged) == (1, 1)


def test_state_download_backoff_on_a_fake_clock() -> None:
    schedule = DiLoCoSchedule(4)
    now = 1000.0
    assert not schedule.should_load_state(global_epoch=0, now=now)
    assert schedule.should_load_state(global_epoch=2, now=now)
    assert schedule.state_load_failed(now) == LOAD_BACKOFF[0]
    assert not schedule.should_load_state(2, now + 0.5)
    assert schedule.should_load_state(2, now + 1.0)
    assert schedule.state_load_failed(now + 1.0) == 2 * LOAD_BACKOFF[0]
    assert not schedule.should_load_state(2, now + 2.5)
    waits = [schedule.state_load_failed(now) for _ in range(10)]
    assert waits[-1] == LOAD_BACKOFF[1]
    schedule.inner_step_done()
    schedule.state_loaded(7)
    assert (schedule.outer_epoch, schedule.inner_step, schedule.state_loads) == (7, 0, 1)
    assert schedule.global_step == 28
    assert schedule.should_load_state(8, now)  # (the backoff is reset)


def test_behind_only_when_a_download_may_be_tried() -> None:
    """A record ahead that no download delivers (a killed peer's, until it expires) does not
    fail every round: while the backoff runs, the peer averages with the others."""
    schedule = DiLoCoSchedule(1, outer_epoch=2)
    schedule.inner_step_done()
    now = 50.0
    assert schedule.plan_round(3, 4, now) == "behind"
    wait = schedule.state_load_failed(now)
    assert schedule.plan_round(3, 4, now + wait / 2) == "average"
    assert schedule.plan_round(1, 4, now + wait / 2) == "alone"
    assert schedule.plan_round(3, 4, now + wait) == "behind"
    assert schedule.plan_round(3, 4) == "behind"  # (no clock: the backoff is not asked)


def test_weights() -> None:
    assert round_weight("equal", 10, 32) == 1.0
    assert round_weight("samples", 10, 32) == 320.0
    with pytest.raises(ValueError, match="weighting"):
        round_weight("tokens", 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"sync_every": 0}, ValueError, "sync_every"),
        ({"sync_every": True}, TypeError, "sync_every"),
        ({"sync_every": 1, "on_round_failure": "retry"}, ValueError, "on_round_failure"),
        ({"sync_every": 1, "outer_epoch": -1}, ValueError, "outer_epoch"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        DiLoCoSchedule(**kwargs)  # type: ignore[arg-type]


def test_restore_continues_from_a_checkpoint_and_keeps_counters() -> None:
    schedule = DiLoCoSchedule(4)
    for _ in range(4):
        schedule.inner_step_done()
    schedule.round_succeeded(alone=True, group_size=1)
    schedule.state_load_failed(now=0.0)
    schedule.restore(7, 3)
    assert (schedule.outer_epoch, schedule.inner_step, schedule.global_step) == (7, 3, 31)
    assert schedule.rounds_alone == 1
    assert schedule.state_load_failures == 1
    assert schedule.should_load_state(8, now=0.0)  # (the backoff was for the old position)
    assert schedule.inner_step_done()  # the 4th inner step of epoch 7 ends a round
    for epoch, step, error, name in (
        (-1, 0, ValueError, "outer_epoch"),
        (1, 4, ValueError, "inner_step"),
        (1, -1, ValueError, "inner_step"),
        (True, 0, TypeError, "outer_epoch"),
        (1, 1.0, TypeError, "inner_step"),
    ):
        with pytest.raises(error, match=name):
            schedule.restore(epoch, step)  # type: ignore[arg-type]
    assert (schedule.outer_epoch, schedule.inner_step) == (7, 4)


def test_epoch_group_bits_differ_between_nearby_epochs() -> None:
    from swarmavg.proto.matchmaking import validate_bits

    bits = [epoch_group_bits(epoch) for epoch in range(300)]
    assert len(set(bits)) == 300
    assert all(validate_bits(b) == b and len(b) == EPOCH_BITS for b in bits)
    assert epoch_group_bits(5) == "0000000000000101"
    assert epoch_group_bits(1 << EPOCH_BITS) == epoch_group_bits(0)
    with pytest.raises(ValueError, match="outer_epoch"):
        epoch_group_bits(-1)
