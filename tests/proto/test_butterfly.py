"""The butterfly round's machine (``swarmavg.proto.butterfly``) on numbers: every fault rule
fires at the exact time its timer says, every rejection is a typed ``RoundProtocolError``, and
what the honest members deliver is reduced exactly."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from swarmavg.abc._averaging import Group, GroupMember, MemberMode
from swarmavg.errors import RemoteProtocolError
from swarmavg.identity import Identity
from swarmavg.proto.allreduce import FlatLayout, TensorSpec, plan_parts
from swarmavg.proto.averaging_messages import (
    AvgBegin,
    AvgDropped,
    AvgHave,
    AvgKeep,
    AvgLeave,
    AvgPart,
    AvgRelay,
    AvgWeights,
)
from swarmavg.proto.butterfly import (
    LINK_TRANSITIONS,
    SENDER_TRANSITIONS,
    AnswerCame,
    Apply,
    BadWeights,
    Began,
    ButterflyRound,
    CallOpened,
    Dropped,
    EndCall,
    EndedEarly,
    Excluded,
    FalseKeep,
    Fault,
    GaveUp,
    LinkStage,
    Malformed,
    MemberLeft,
    NonFiniteData,
    NotAMember,
    OutOfOrder,
    OwnPart,
    PartCame,
    PartMismatch,
    Reason,
    Reduced,
    ReducerEnded,
    ReducerFailed,
    RelayReader,
    RoundConfig,
    SenderBroke,
    SenderEnded,
    SenderStage,
    Tick,
    TooLate,
    TooManyNotices,
    check_leave,
    check_relay_request,
)

#: 3 members, 1 float32 tensor of 30: each reduces 10 elements in 3 parts (4, 4, 2)
LAYOUT = FlatLayout((TensorSpec((30,), "float32"),))
PART = 4
CONFIG = RoundConfig(part_size=PART, sender_timeout=3.0, reducer_timeout=5.0)
PEERS = [Identity.generate().peer_id for _ in range(3)]


def _group() -> Group:
    return Group(
        os.urandom(16),
        tuple(GroupMember(peer, f"memory://local:{i}") for i, peer in enumerate(PEERS)),
    )


def _round(config: RoundConfig = CONFIG, now: float = 100.0) -> ButterflyRound:
    group = _group()
    plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), config.part_size)
    machine = ButterflyRound(group, 0, plans, LAYOUT, config, sending=True, now=now)
    machine.own_weight(1.0)
    return machine


def _values(sender: int, part: int, size: int) -> npt.NDArray[np.float32]:
    return np.full(size, 10.0 * sender + part, np.float32)


def _deliver(machine: ButterflyRound, sender: int, parts: int, now: float) -> None:
    for index in range(parts):
        size = machine.parts[index].size
        machine.receive(PartCame(sender, AvgPart(index, _values(sender, index, size))), now)


def _kinds(actions: list[Any]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_the_honest_round_reduces_each_part_exactly_once_everyone_delivered_it() -> None:
    machine = _round()
    for index, part in enumerate(machine.parts):
        machine.receive(OwnPart(index, _values(0, index, part.size)), 100.0)
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    machine.receive(Began(2, PEERS[2], 3.0), 100.0)
    _deliver(machine, 1, 3, 101.0)
    assert machine.actions() == []  # (member 2 has not sent anything yet)
    _deliver(machine, 2, 2, 102.0)
    reduced = machine.actions()
    assert [a.index for a in reduced if isinstance(a, Reduced)] == [0, 1]
    for action in reduced:
        assert isinstance(action, Reduced)
        want = (
            1.0 * (0 + action.index) + 1.0 * (10 + action.index) + 3.0 * (20 + action.index)
        ) / 5
        np.testing.assert_array_equal(action.mean, np.full(PART, want, np.float32))
    machine.receive(SenderEnded(1), 103.0)
    assert machine.sender_stage(1) is SenderStage.ENDED
    assert machine.deadline() == 102.0 + 3.0  # (member 2's last part, and its timer)
    assert machine.excluded == {}


def test_a_sender_whose_values_could_overflow_the_mean_is_left_out_and_blamed_alone() -> None:
    """Trust I's F1: finite values that overflow a float32 sum (3e38 with weight 2, or any
    value with weight 1e39) made the honest reducer's mean infinite, and every member then
    blamed the reducer. Now the sender is left out at once, typed, and the others' mean is
    exact."""
    for weight, value in ((2.0, 3e38), (1e39, 1.0)):
        machine = _round()
        for index, part in enumerate(machine.parts):
            machine.receive(OwnPart(index, _values(0, index, part.size)), 100.0)
        machine.receive(Began(1, PEERS[1], 1.0), 100.0)
        _deliver(machine, 1, 3, 100.0)
        attack = PartCame(2, AvgPart(0, np.full(PART, value, np.float32)))
        if weight > 1e9:
            with pytest.raises(BadWeights, match="bad weight 1e"):
                machine.receive(Began(2, PEERS[2], weight), 100.0)
        else:
            machine.receive(Began(2, PEERS[2], weight), 100.0)
            with pytest.raises(NonFiniteData, match="member 2 sent values too large"):
                machine.receive(attack, 100.0)
        assert machine.excluded[2][0] == 0
        assert machine.excluded[2][1].fault in (Fault.NON_FINITE, Fault.BAD_DATA)
        assert machine.report.nonfinite == {2}  # (left out of our next groups)
        means = [a.mean for a in machine.actions() if isinstance(a, Reduced)]
        assert len(means) == 3
        for index, mean in enumerate(means):
            np.testing.assert_array_equal(mean, (index + 10.0 + index) / 2)


def test_a_sender_that_never_begins_is_left_out_at_exactly_sender_timeout() -> None:
    machine = _round(now=100.0)
    machine.receive(Began(1, PEERS[1], 1.0), 100.5)
    _deliver(machine, 1, 3, 100.5)
    machine.receive(SenderEnded(1), 100.5)
    for index, part in enumerate(machine.parts):
        machine.receive(OwnPart(index, _values(0, index, part.size)), 100.5)
    assert machine.deadline() == 103.0
    machine.receive(Tick(), 102.999)
    assert machine.actions() == []
    machine.receive(Tick(), 103.0)
    actions = machine.actions()
    assert _kinds(actions) == ["Excluded", "Reduced", "Reduced", "Reduced"]
    excluded = actions[0]
    assert excluded == Excluded(2, 0, Reason(Fault.NOT_BEGUN, "it did not begin within 3.0 s"))
    assert excluded.reason.fault is Fault.NOT_BEGUN
    assert machine.excluded[2][1].fault is Fault.NOT_BEGUN


def test_a_sender_silent_after_a_part_is_left_out_of_the_rest_sender_timeout_after_it() -> None:
    machine = _round(now=100.0)
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    machine.receive(Began(2, PEERS[2], 1.0), 100.0)
    _deliver(machine, 1, 3, 100.0)
    machine.receive(SenderEnded(1), 100.0)
    _deliver(machine, 2, 1, 101.25)  # part 0 at 101.25, then nothing
    machine.actions()
    assert machine.deadline() == 104.25
    machine.receive(Tick(), 104.2499)
    assert machine.actions() == []
    machine.receive(Tick(), 104.25)
    actions = machine.actions()
    reason = Reason(Fault.SILENT, "it sent nothing for 3.0 s")
    assert actions[0] == Excluded(2, 1, reason)
    assert EndCall(2, reason) in actions
    assert machine.sender_stage(2) is SenderStage.EXCLUDED


def test_garbage_is_refused_with_a_typed_error_and_leaves_the_sender_out_at_once() -> None:
    machine = _round()
    machine.receive(Began(2, PEERS[2], 1.0), 100.0)
    with pytest.raises(PartMismatch, match="int64") as caught:
        machine.receive(PartCame(2, AvgPart(0, np.zeros(4, np.int64))), 100.5)
    assert isinstance(caught.value, RemoteProtocolError)
    [excluded] = [a for a in machine.actions() if isinstance(a, Excluded)]
    assert (excluded.sender, excluded.first, excluded.reason.fault) == (2, 0, Fault.BAD_DATA)
    # out of order, a message that is not a part, non-finite values: each its own type
    for bad, error in [
        (AvgPart(1, np.zeros(4, np.float32)), OutOfOrder),
        (AvgBegin(b"x", 1, 1.0), OutOfOrder),
        (AvgPart(0, np.full(4, np.nan, np.float32)), NonFiniteData),
    ]:
        fresh = _round()
        fresh.receive(Began(1, PEERS[1], 1.0), 100.0)
        with pytest.raises(error):
            fresh.receive(PartCame(1, bad), 100.0)
        assert 1 in fresh.excluded
    assert fresh.report.nonfinite == {1}


def test_a_stranger_claiming_a_place_is_refused_and_the_member_it_claims_is_not_harmed() -> None:
    machine = _round()
    stranger = Identity.generate().peer_id
    with pytest.raises(NotAMember, match="not the member it claims"):
        machine.receive(Began(1, stranger, 1.0), 100.0)
    with pytest.raises(NotAMember):
        machine.receive(Began(7, PEERS[1], 1.0), 100.0)
    assert machine.excluded == {}
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    with pytest.raises(TooLate, match="already called"):
        machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    assert machine.sender_stage(1) is SenderStage.SENDING
    with pytest.raises(BadWeights):
        machine.receive(Began(2, PEERS[2], float("inf")), 100.0)
    assert machine.excluded[2][1].fault is Fault.BAD_DATA  # (at once, not at sender_timeout)


def test_a_member_claiming_another_members_place_is_left_out_at_once() -> None:
    """Trust I's F14: the caller is authenticated, so a member that sends another's index is
    known: it is left out at that moment (its parts complete without it), not waited for
    until ``sender_timeout``; the member it named is unharmed."""
    machine = _round()
    with pytest.raises(NotAMember, match="not the member it claims"):
        machine.receive(Began(1, PEERS[2], 1.0), 100.0)
    [excluded] = [a for a in machine.actions() if isinstance(a, Excluded)]
    assert (excluded.sender, excluded.first) == (2, 0)
    assert excluded.reason.fault is Fault.BAD_DATA
    assert "claimed to be member 1" in excluded.reason
    assert machine.sender_stage(2) is SenderStage.EXCLUDED
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    assert machine.sender_stage(1) is SenderStage.SENDING


def test_a_stream_ended_early_or_broken_off_leaves_the_sender_out_of_what_it_owed() -> None:
    machine = _round()
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    machine.receive(Began(2, PEERS[2], 1.0), 100.0)
    _deliver(machine, 1, 1, 100.0)
    with pytest.raises(EndedEarly, match="1 parts of 3"):
        machine.receive(SenderEnded(1), 100.5)
    assert machine.excluded[1][0] == 1
    assert machine.excluded[1][1].fault is Fault.ENDED_EARLY
    _deliver(machine, 2, 2, 101.0)
    machine.receive(SenderBroke(2), 101.5)  # (dead mid-transfer)
    assert machine.excluded[2][0] == 2
    assert machine.excluded[2][1].fault is Fault.BROKE_OFF


def test_a_sender_that_delivered_everything_is_never_blamed() -> None:
    machine = _round()
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    _deliver(machine, 1, 3, 100.0)
    machine.receive(SenderBroke(1), 100.5)
    machine.receive(MemberLeft(1, Fault.LOST, "its connection was lost"), 100.6)
    assert 1 not in machine.excluded


def _linked(now: float = 100.0) -> ButterflyRound:
    machine = _round(now=now)
    machine.receive(CallOpened(1), now)
    return machine


def _weights() -> AvgWeights:
    return AvgWeights([1.0, 1.0, 1.0])


def test_a_reducer_silent_mid_answers_keeps_our_values_reducer_timeout_after_its_last() -> None:
    machine = _linked(now=100.0)
    assert machine.deadline() == 100.0 + 3.0  # (our own span's senders come first)
    machine.receive(AnswerCame(1, _weights()), 101.0)
    machine.receive(AnswerCame(1, AvgPart(0, np.ones(PART, np.float32))), 102.0)
    [apply] = [a for a in machine.actions() if isinstance(a, Apply)]
    assert (apply.reducer, apply.index) == (1, 0)
    machine.receive(Began(1, PEERS[1], 0.0), 102.0)  # (our span needs nothing more of 1, 2...)
    machine.receive(Began(2, PEERS[2], 0.0), 102.0)
    machine.receive(SenderEnded(1), 102.0)
    machine.receive(SenderEnded(2), 102.0)
    assert machine.deadline() == 107.0
    machine.receive(Tick(), 106.999)
    assert not [a for a in machine.actions() if isinstance(a, GaveUp)]
    machine.receive(Tick(), 107.0)
    [gave_up] = [a for a in machine.actions() if isinstance(a, GaveUp)]
    assert gave_up == GaveUp(1, 1, Reason(Fault.SILENT, "it answered nothing for 5.0 s"))
    assert machine.link_stage(1) is LinkStage.GAVE_UP
    assert machine.report.local_spans == [(1, 1, gave_up.reason)]


def test_a_reducers_bad_answers_are_typed_and_keep_our_values() -> None:
    cases: list[tuple[list[Any], type[Exception], Fault]] = [
        ([AvgPart(0, np.ones(PART, np.float32))], OutOfOrder, Fault.BAD_DATA),
        ([AvgWeights([1.0, -1.0, 1.0])], BadWeights, Fault.BAD_DATA),
        ([AvgWeights([1.0, 1.0])], BadWeights, Fault.BAD_DATA),
        ([AvgWeights([1.0, 1e39, 1.0])], BadWeights, Fault.BAD_DATA),  # (past MAX_WEIGHT)
        ([_weights(), AvgKeep(2)], OutOfOrder, Fault.BAD_DATA),
        ([_weights(), AvgPart(0, np.ones(3, np.float32))], PartMismatch, Fault.BAD_DATA),
        (
            [_weights(), AvgPart(0, np.full(PART, np.inf, np.float32))],
            NonFiniteData,
            Fault.NON_FINITE,
        ),
        ([AvgDropped(2, 0, "x")] * 4, TooManyNotices, Fault.BAD_DATA),
    ]
    for messages, error, fault in cases:
        machine = _linked()
        for message in messages[:-1]:
            machine.receive(AnswerCame(1, message), 100.5)
        with pytest.raises(error):
            machine.receive(AnswerCame(1, messages[-1]), 100.5)
        [gave_up] = [a for a in machine.actions() if isinstance(a, GaveUp)]
        assert gave_up.reason.fault is fault, (messages, gave_up)


def _keep_answer(machine: ButterflyRound, weights: list[float], notices: list[Any]) -> None:
    machine.receive(AnswerCame(1, AvgWeights(weights)), 100.5)
    for notice in notices:
        machine.receive(AnswerCame(1, notice), 100.5)
    machine.receive(AnswerCame(1, AvgKeep(0)), 100.5)


def test_a_reducer_keeping_a_weighted_part_is_blamed_and_our_span_of_it_stays_local() -> None:
    """Trust I's F15: "keep your values" (``AvgKeep``) is the answer only for a part whose
    senders all had weight 0 or were left out. Said of a part with weight (ours, or a
    member's it did not say it left out) it would leave members silently disagreeing: the
    reducer is blamed and its span marked local (the round is incomplete)."""
    cases: list[tuple[float, list[float], list[Any]]] = [
        (1.0, [1.0, 1.0, 1.0], []),  # (ours and everyone's)
        (0.0, [0.0, 0.0, 2.0], []),  # (member 2's, which it did not leave out)
        (0.0, [0.0, 0.0, 2.0], [AvgDropped(2, 1, "slow")]),  # (left out after part 0 only)
    ]
    for own, weights, notices in cases:
        machine = _linked()
        machine.own_weight(own)
        with pytest.raises(FalseKeep, match="answered 'keep' for part 0, which had weight"):
            _keep_answer(machine, weights, notices)
        [gave_up] = [a for a in machine.actions() if isinstance(a, GaveUp)]
        assert (gave_up.reducer, gave_up.first) == (1, 0)
        assert gave_up.reason.fault is Fault.BAD_DATA
        assert machine.link_stage(1) is LinkStage.GAVE_UP
        assert machine.report.local_spans == [(1, 0, gave_up.reason)]


def test_a_reducer_keeping_a_part_without_weight_is_believed() -> None:
    """The honest cases: every sender of the part had weight 0, or those with weight were
    left out of it (and we were told)."""
    for weights, notices in (
        ([0.0, 0.0, 0.0], []),
        ([0.0, 3.0, 2.0], [AvgDropped(2, 0, "slow"), AvgDropped(1, 0, "ours")]),
    ):
        machine = _linked()
        machine.own_weight(0.0)
        _keep_answer(machine, weights, notices)
        [apply] = [a for a in machine.actions() if isinstance(a, Apply)]
        assert (apply.reducer, apply.index, apply.mean) == (1, 0, None)
        assert machine.link_stage(1) is LinkStage.ANSWERING


def test_a_peers_words_reach_our_logs_escaped_and_bounded() -> None:
    """Trust I's F16: a reducer's (or relay's) reason for leaving a sender out, with newlines,
    ANSI escapes and a bidirectional override, would forge lines in our WARNING log."""
    forged = "slow\n2026-12-07 WARNING swarmavg: forged \x1b[2K\u202eline" + "x" * 1000
    machine = _linked()
    machine.receive(AnswerCame(1, AvgDropped(2, 0, forged)), 100.5)
    [dropped] = [a for a in machine.actions() if isinstance(a, Dropped)]
    plan = plan_parts(LAYOUT, _group().span_sizes(LAYOUT.numel), PART)[1]
    relayed = RelayReader(2, 1, 1, plan, ["float32"], members=3).receive(AvgDropped(0, 1, forged))
    for reason in (dropped.reason, relayed.reason):  # type: ignore[union-attr]
        assert reason.isprintable()
        assert reason.startswith("slow\\n2026-12-07 WARNING swarmavg: forged \\x1b[2K\\u202eline")
        assert len(reason) <= 201


def test_a_reducer_that_ends_its_answers_early_is_a_typed_error_not_a_crash() -> None:
    machine = _linked()
    machine.receive(AnswerCame(1, _weights()), 100.5)
    with pytest.raises(EndedEarly, match="after 0 of 3"):
        machine.receive(ReducerEnded(1), 100.6)
    [gave_up] = [a for a in machine.actions() if isinstance(a, GaveUp)]
    assert (gave_up.first, gave_up.reason.fault) == (0, Fault.ENDED_EARLY)


def test_a_member_that_leaves_is_left_out_of_our_span_and_we_stop_waiting_for_its_own() -> None:
    machine = _linked()
    machine.receive(Began(1, PEERS[1], 1.0), 100.0)
    _deliver(machine, 1, 1, 100.0)
    machine.receive(AnswerCame(1, _weights()), 100.0)
    machine.actions()
    machine.receive(MemberLeft(1, Fault.LEFT, "it left the group: cancelled"), 100.25)
    actions = machine.actions()
    assert [a for a in actions if isinstance(a, Excluded)] == [
        Excluded(1, 1, Reason(Fault.LEFT, "it left the group: cancelled"))
    ]
    assert [(a.reducer, a.first) for a in actions if isinstance(a, GaveUp)] == [(1, 0)]
    assert machine.gone[1].fault is Fault.LEFT


def test_every_move_the_machine_makes_is_in_its_tables() -> None:
    # (the machine raises RuntimeError on a move not in the tables: the tests above made each)
    assert {stage for stage, _ in SENDER_TRANSITIONS} == set(SenderStage)
    assert {stage for stage, _ in LINK_TRANSITIONS} == set(LinkStage)
    for table in (SENDER_TRANSITIONS, LINK_TRANSITIONS):
        for (stage, move), targets in table.items():
            assert targets, (stage, move)


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"part_size": 0}, ValueError, "part_size"),
        ({"part_size": 1.5}, TypeError, "part_size"),
        ({"sender_timeout": 0}, ValueError, "sender_timeout"),
        ({"reducer_timeout": float("nan")}, ValueError, "reducer_timeout"),
        ({"timeout": "1"}, TypeError, "timeout"),
        ({"averaging_alpha": 0.0}, ValueError, "averaging_alpha"),
        ({"min_vector_size": -1}, ValueError, "min_vector_size"),
        ({"clip_norm": -1.0}, ValueError, "clip_norm"),
        ({"check_values": 1}, TypeError, "check_values"),
    ],
)
def test_a_bad_round_config_names_the_argument(
    options: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        RoundConfig(**options)


def test_an_auxiliary_member_sends_nothing_and_a_claim_to_send_is_refused() -> None:
    group = _group()
    members = list(group.members)
    members[2] = GroupMember(PEERS[2], "memory://local:2", mode=MemberMode.AUX)
    group = Group(group.group_id, tuple(members))
    plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), PART)
    machine = ButterflyRound(group, 0, plans, LAYOUT, CONFIG, sending=True, now=0.0)
    with pytest.raises(NotAMember, match="sends nothing"):
        machine.receive(Began(2, PEERS[2], 1.0), 0.0)


def test_a_relay_is_read_in_order_and_each_breach_is_typed() -> None:
    plan = plan_parts(LAYOUT, _group().span_sizes(LAYOUT.numel), PART)[1]
    reader = RelayReader(2, 1, 1, plan, ["float32"], members=3)
    assert reader.have(AvgHave(2)) == 2
    assert reader.receive(AvgDropped(0, 1, "x")) == Dropped(1, 0, 1, "x")
    applied = reader.receive(AvgPart(1, np.ones(PART, np.float32)))
    # (field by field: Python 3.13's dataclass __eq__ compares the arrays' truth value)
    assert isinstance(applied, Apply)
    assert (applied.reducer, applied.index, applied.nbytes, reader.next) == (1, 1, 4 * PART, 2)
    np.testing.assert_array_equal(applied.mean, np.ones(PART, np.float32))
    with pytest.raises(OutOfOrder):  # (it said it has 2 parts: part 2 is one too many)
        reader.receive(AvgKeep(2))
    cases: list[tuple[list[Any], type[Exception]]] = [
        ([AvgPart(1, np.ones(PART, np.float32))], OutOfOrder),  # (no AvgHave first)
        ([AvgHave(3), AvgPart(2, np.ones(PART, np.float32))], OutOfOrder),
        ([AvgHave(3), AvgPart(1, np.ones(PART, np.float64))], PartMismatch),
        ([AvgHave(3), AvgPart(1, np.full(PART, np.nan, np.float32))], NonFiniteData),
        ([AvgHave(3), *[AvgDropped(0, 1, "x")] * 4], TooManyNotices),
        ([AvgHave(3), AvgDropped(7, 1, "x")], TooManyNotices),
    ]
    for messages, error in cases:
        reader = RelayReader(2, 1, 1, plan, ["float32"], members=3)
        with pytest.raises(error):
            _read_relay(reader, messages)


def test_a_relayed_keep_of_a_part_we_weighted_is_refused() -> None:
    """Trust I's F15, relayed: a groupmate relaying "keep" for a part of the reducer's span
    that had our weight (and that the reducer did not leave us out of) lies as a reducer
    would; the same keep is believed where we sent weight 0 or were left out."""
    plan = plan_parts(LAYOUT, _group().span_sizes(LAYOUT.numel), PART)[1]
    lying = RelayReader(2, 1, 1, plan, ["float32"], members=3, me=0, own_weight=1.0)
    with pytest.raises(FalseKeep, match="relayed 'keep' for part 1 of member 1's span"):
        _read_relay(lying, [AvgHave(3), AvgKeep(1)])
    for own_weight, notices in ((0.0, []), (1.0, [AvgDropped(0, 1, "slow")])):
        honest = RelayReader(2, 1, 1, plan, ["float32"], members=3, me=0, own_weight=own_weight)
        _read_relay(honest, [AvgHave(3), *notices, AvgKeep(1)])
        assert honest.next == 2


def _read_relay(reader: RelayReader, messages: list[Any]) -> None:
    reader.have(messages[0])
    for message in messages[1:]:
        reader.receive(message)


def test_relay_requests_and_leave_notices_are_checked_against_the_group() -> None:
    group = _group()
    check_relay_request(AvgRelay(group.group_id, 1, 0, True), group, PEERS[2])
    stranger = Identity.generate().peer_id
    for ask, peer, error in [
        (AvgRelay(b"", 1, 0, True), PEERS[2], Malformed),
        (AvgRelay(group.group_id, -1, 0, True), PEERS[2], Malformed),
        (AvgRelay(group.group_id, 1, 0, True), stranger, NotAMember),
        (AvgRelay(group.group_id, 3, 0, True), PEERS[2], NotAMember),
    ]:
        with pytest.raises(error):
            check_relay_request(ask, group, peer)
    check_leave(AvgLeave(group.group_id, 1, "x"), group, PEERS[1])
    check_leave(
        AvgLeave(group.group_id, 1, "x"), None, stranger
    )  # (not started: kept, checked later)
    with pytest.raises(NotAMember):
        check_leave(AvgLeave(group.group_id, 1, "x"), group, PEERS[2])
    with pytest.raises(Malformed):
        check_leave(AvgLeave(group.group_id, -1, "x"), None, PEERS[1])


def test_the_report_says_who_contributed_and_fails_a_round_where_nothing_was_averaged() -> None:
    machine = _round()
    for index, part in enumerate(machine.parts):
        machine.receive(OwnPart(index, _values(0, index, part.size)), 100.0)
    machine.receive(Began(1, PEERS[1], 2.0), 100.0)
    machine.receive(Began(2, PEERS[2], 0.0), 100.0)
    _deliver(machine, 1, 2, 100.0)
    machine.receive(SenderBroke(1), 100.5)
    report = machine.finish()
    assert (report.contributors, report.total_weight) == ((0, 1), 3.0)
    assert [(s, first, why.fault) for s, first, why in report.excluded] == [(1, 2, Fault.BROKE_OFF)]
    assert report.failed is None
    # a member that reduces nothing, whose every reducer kept its values from part 0: failed
    members = list(_group().members)
    members[0] = GroupMember(PEERS[0], None, None, MemberMode.CLIENT)  # (a client reduces none)
    group = Group(os.urandom(16), tuple(members))
    plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), PART)
    assert not plans[0]
    idle = ButterflyRound(group, 0, plans, LAYOUT, CONFIG, sending=True, now=0.0)
    idle.own_weight(1.0)
    for reducer in (1, 2):
        if plans[reducer]:
            idle.receive(CallOpened(reducer), 0.0)
            idle.receive(ReducerFailed(reducer, Fault.BROKE_OFF, "gone"), 0.0)
    assert idle.finish().failed is not None
    assert idle.finish().failed.startswith("nothing was averaged")  # type: ignore[union-attr]
