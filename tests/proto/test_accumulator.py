"""The accumulator's rounds (sans-IO) among simulated members on a fake clock.

A :class:`Cohort` delivers the members' messages and plays the all-reduce: each member's slot
holds a number (the sum of its contributed "gradients"); a gradient phase averages
``slot * scale`` with each member's weight, as ``AllReduceService`` would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import pytest

from swarmavg.errors import RemoteProtocolError
from swarmavg.proto.accumulator import (
    AccAck,
    AccLeave,
    AccumulatorCore,
    Action,
    ApplyResult,
    CoreMessage,
    Count,
    DropSlots,
    GradientStats,
    Hello,
    MergeSlots,
    Refresh,
    RequestState,
    Send,
    SlotTotals,
    StartReduce,
    epoch_digest,
    round_group_id,
)
from swarmavg.proto.codec import PROTOCOL_VERSION, decode_message, encode_message_bytes


@dataclass
class Member:
    core: AccumulatorCore
    slots: list[float]
    grad: float | None = None
    applied: list[tuple[int, GradientStats, float]] = field(default_factory=list)
    state_requests: list[RequestState] = field(default_factory=list)


class Cohort:
    """Members, their in-flight messages and all-reduces, delivered when the test says."""

    def __init__(self, names: list[str], **options: object) -> None:
        self.now = 0.0
        self.members = {
            n: Member(AccumulatorCore(n, cohort="c", **options), [0.0] * 4)  # type: ignore[arg-type]
            for n in names
        }
        self.queue: list[tuple[str, str, CoreMessage]] = []
        self.reduces: dict[bytes, dict[str, StartReduce]] = {}
        self.refreshes: list[tuple[str, str]] = []

    def handle(self, name: str, actions: list[Action]) -> None:
        member = self.members[name]
        for action in actions:
            if isinstance(action, Send):
                self.queue += [(name, to, action.message) for to in action.to]
            elif isinstance(action, StartReduce):
                self.reduces.setdefault(action.group_id, {})[name] = action
            elif isinstance(action, ApplyResult):
                member.grad = 0.0 if action.zero else member.grad
                member.applied.append((action.index, action.stats, member.grad or 0.0))
                member.slots[action.slot] = 0.0
            elif isinstance(action, MergeSlots):
                for slot in action.slots:
                    member.slots[0] += member.slots[slot]
                    member.slots[slot] = 0.0
            elif isinstance(action, DropSlots):
                member.slots = [0.0] * len(member.slots)
            elif isinstance(action, RequestState):
                member.state_requests.append(action)
            elif isinstance(action, Refresh):
                self.refreshes.append((name, action.peer))

    def epoch(
        self, names: list[str], who: list[str] | None = None, epoch: bytes | None = None
    ) -> None:
        for name in who or names:
            core = self.members[name].core
            self.handle(name, core.new_epoch(names, self.now, epoch=epoch))

    def deliver(self, only_to: set[str] | None = None) -> None:
        """Deliver every queued message (and those they cause), bounded."""
        for _ in range(10_000):
            ready = [m for m in self.queue if only_to is None or m[1] in only_to]
            if not ready:
                return
            sender, to, message = ready[0]
            self.queue.remove(ready[0])
            self.handle(to, self.members[to].core.receive(sender, message, self.now))
        raise AssertionError("messages never settled")

    def finish_reduces(self, ok: bool = True, skip: frozenset[str] = frozenset()) -> None:
        """Complete every all-reduce whose members all started it (the weighted mean)."""
        for group_id, started in list(self.reduces.items()):
            first = next(iter(started.values()))
            if set(started) != set(first.members):
                continue
            del self.reduces[group_id]
            total_weight = sum(a.weight for a in started.values())
            mean = (
                sum(a.weight * self.members[n].slots[a.slot] * a.scale for n, a in started.items())
                / total_weight
            )
            for name, action in started.items():
                if name in skip:
                    continue
                self.members[name].grad = mean
                core = self.members[name].core
                self.handle(name, core.reduce_done(action.epoch, action.index, ok))

    def reduce(self, name: str, grad: float, batch_size: int) -> int:
        member = self.members[name]
        slot, actions = member.core.contribute(batch_size, self.now)
        scale = batch_size if member.core.weighting == "samples" else 1
        member.slots[slot] += grad * scale
        self.handle(name, actions)
        return slot

    def skip(self, name: str) -> None:
        _slot, actions = self.members[name].core.skip(self.now)
        self.handle(name, actions)

    def zero(self, name: str) -> None:
        self.handle(name, self.members[name].core.zero_gradients())


def connected_cohort(names: list[str], **options: object) -> Cohort:
    cohort = Cohort(names, **options)
    cohort.epoch(names)
    cohort.deliver()
    leader = max(names)
    for name in names:
        assert cohort.members[name].core.leader == leader
        if name != leader:
            (request,) = cohort.members[name].state_requests
            assert request.donors[0] == leader
            cohort.handle(name, cohort.members[name].core.state_loaded(request.version))
        assert cohort.members[name].core.connected()
    return cohort


def test_every_member_applies_the_same_mean_with_the_same_stats() -> None:
    names = ["a", "b", "c"]
    cohort = connected_cohort(names, virtual_batch_size=10)
    grads = {"a": 1.0, "b": 2.0, "c": 6.0}
    # round 1: 4 + 4 samples and a skip: 8 < 10, so everyone must contribute again
    cohort.reduce("a", 1.0, 4)
    cohort.reduce("b", 2.0, 4)
    assert not cohort.members["a"].core.wants_gradients()  # its slot is counting
    cohort.skip("c")
    cohort.deliver()
    assert all(
        m.core.wants_gradients() and not m.core.has_gradients() for m in cohort.members.values()
    )
    for name in names:
        cohort.reduce(name, grads[name], 3)
    cohort.deliver()
    assert all(not m.core.has_gradients() for m in cohort.members.values())
    cohort.finish_reduces()
    # contributions: a twice (1, 1), b twice (2, 2), c once (6): mean over 5 contributions
    expected = (1 + 1 + 2 + 2 + 6) / 5
    for member in cohort.members.values():
        assert member.core.has_gradients()
        assert member.grad == pytest.approx(expected)
        assert member.core.stats() == GradientStats(num_gradients=5, num_skipped=1, batch_size=17)
        assert member.core.stats().as_dict() == {
            "num_gradients": 5,
            "num_skipped": 1,
            "batch_size": 17,
        }
        assert member.core.model_version == 0  # (until the result is read)
        assert not member.core.wants_gradients()  # the result was not read yet
        member.core.zero_gradients()
        assert member.core.model_version == 1
        member.core.zero_gradients()  # (nothing unread: no change)
        assert member.core.model_version == 1


def test_samples_weighting_gives_the_sample_weighted_mean() -> None:
    cohort = connected_cohort(["a", "b"], virtual_batch_size=4, weighting="samples")
    cohort.reduce("a", 1.0, 1)
    cohort.reduce("b", 4.0, 3)
    cohort.deliver()
    cohort.finish_reduces()
    for member in cohort.members.values():
        assert member.grad == pytest.approx((1 * 1 + 4 * 3) / 4)


def test_model_version_increments_once_per_read_result_everywhere() -> None:
    names = ["a", "b"]
    cohort = connected_cohort(names)
    for round_ in range(1, 4):
        for name in names:
            cohort.reduce(name, float(round_), 1)
        cohort.deliver()
        cohort.finish_reduces()
        for name in names:
            assert cohort.members[name].core.model_version == round_ - 1
            cohort.zero(name)
            assert cohort.members[name].core.model_version == round_
    assert [i for i, _, _ in cohort.members["a"].applied] == [0, 1, 2]


def test_all_skips_apply_a_zero_result_without_an_allreduce() -> None:
    cohort = connected_cohort(["a", "b"])
    cohort.skip("a")
    cohort.skip("b")
    cohort.deliver()
    assert cohort.reduces == {}  # nothing to average
    for member in cohort.members.values():
        # batch 0 < virtual batch 1: no result; skips count only once a result is decided
        assert not member.core.has_gradients()
    cohort.reduce("a", 3.0, 1)
    cohort.skip("b")
    cohort.deliver()
    cohort.finish_reduces()
    for member in cohort.members.values():
        assert member.core.stats() == GradientStats(num_gradients=1, num_skipped=3, batch_size=1)
        assert member.grad == 3.0


def test_the_leader_is_the_greatest_version_then_name() -> None:
    cohort = Cohort(["a", "b", "c"])
    cohort.members["a"].core.set_model_version(7)  # a restored checkpoint
    cohort.epoch(["a", "b", "c"])
    cohort.deliver()
    for member in cohort.members.values():
        assert member.core.leader == "a"
    assert cohort.members["a"].core.is_leader()
    assert cohort.members["a"].core.connected()
    for name in ["b", "c"]:
        core = cohort.members[name].core
        assert not core.connected()
        assert not core.wants_gradients()
        assert cohort.members[name].state_requests == [RequestState(("a",), 7)]
        cohort.handle(name, core.state_loaded(7))
        assert core.connected()
        assert core.model_version == 7
    # equal versions (and no model yet): the greatest name
    ties = Cohort(["x", "y"])
    ties.epoch(["x", "y"])
    ties.deliver()
    assert ties.members["x"].core.leader == ties.members["y"].core.leader == "y"


def test_set_model_version_makes_a_restored_peer_leader_at_the_next_epoch() -> None:
    cohort = connected_cohort(["a", "b"])
    for name in ["a", "b"]:
        cohort.reduce(name, 1.0, 1)
    cohort.deliver()
    cohort.finish_reduces()
    for name in ["a", "b"]:
        cohort.zero(name)
    assert cohort.members["b"].core.is_leader()
    # "a" restarts from a checkpoint of version 10
    restored = AccumulatorCore("a", cohort="c")
    restored.set_model_version(10)
    cohort.members["a"] = Member(restored, [0.0] * 4)
    # the same names, but "a" is a new incarnation: a new epoch
    cohort.epoch(["a", "b"], epoch=epoch_digest(["a", "b"], ["restarted", ""]))
    cohort.deliver()
    assert cohort.members["b"].core.leader == "a"
    assert restored.is_leader()
    assert cohort.members["b"].state_requests[-1] == RequestState(("a",), 10)


def test_several_donors_hold_the_leaders_version() -> None:
    cohort = connected_cohort(["a", "b", "c"])
    cohort.members["d"] = Member(AccumulatorCore("d", cohort="c"), [0.0] * 4)
    cohort.epoch(["a", "b", "c", "d"])
    cohort.deliver()
    (request,) = cohort.members["d"].state_requests
    # all at version 0, but d holds no model: c stays leader, and a, b, c can all donate
    assert request == RequestState(("c", "b", "a"), 0)
    for name in "abc":
        assert cohort.members[name].core.connected()  # same version, and a model


def test_members_that_started_alone_hold_other_models_and_download_the_leaders() -> None:
    """Each member led an epoch alone (its own model, version 0): in the epoch of all, the
    leader's version is theirs, but not its lineage, so they download its state."""
    cohort = Cohort(["a", "b", "c"])
    for name in "abc":
        cohort.epoch([name], who=[name])
        assert cohort.members[name].core.is_leader()
        assert cohort.members[name].core.lineage  # (its own model)
    lineages = {n: cohort.members[n].core.lineage for n in "abc"}
    assert len(set(lineages.values())) == 3
    cohort.epoch(["a", "b", "c"])
    cohort.deliver()
    for name in "ab":
        core = cohort.members[name].core
        assert core.leader == "c"
        assert not core.connected()
        assert cohort.members[name].state_requests == [RequestState(("c",), 0)]
        cohort.handle(name, core.state_loaded(0, lineages["c"]))
        assert core.connected()
        assert core.lineage == lineages["c"]
    # the next epoch (the same members, new incarnations): nobody downloads again
    cohort.epoch(["a", "b", "c"], epoch=epoch_digest(["a", "b", "c"], ["1", "1", "1"]))
    cohort.deliver()
    for name in "abc":
        member = cohort.members[name]
        assert member.core.connected()
        assert len(member.state_requests) == (0 if name == "c" else 1)


def test_halves_of_a_split_cohort_that_stepped_apart_are_one_model_again_after_they_meet() -> None:
    """A cohort split in two views for a while ({a, b} and {c}, e.g. c suspected by the
    others and the others by c) steps apart: each side applies its own result and reaches
    the same version. When the views merge, the versions tie, but the models differ: the
    lineage says so, and a and b take the leader's (c's) state instead of carrying on with
    another model than c's at the same version."""
    cohort = connected_cohort(["a", "b", "c"])
    shared = cohort.members["a"].core.lineage
    assert {cohort.members[n].core.lineage for n in "abc"} == {shared}
    cohort.epoch(["a", "b"], who=["a", "b"])
    cohort.epoch(["c"], who=["c"])
    cohort.deliver()
    for name, grad in (("a", 1.0), ("b", 3.0), ("c", 10.0)):
        cohort.reduce(name, grad, 1)
    cohort.deliver()
    cohort.finish_reduces()
    for name in "abc":
        assert cohort.members[name].core.has_gradients()
        cohort.zero(name)
        assert cohort.members[name].core.model_version == 1
    assert [cohort.members[n].grad for n in "abc"] == [2.0, 2.0, 10.0]
    lineages = {n: cohort.members[n].core.lineage for n in "abc"}
    assert lineages["a"] == lineages["b"] != lineages["c"]
    assert shared not in lineages.values()
    cohort.epoch(["a", "b", "c"], epoch=epoch_digest(["a", "b", "c"], ["1", "1", "1"]))
    cohort.deliver()
    for name in "ab":
        core = cohort.members[name].core
        assert core.leader == "c"
        assert not core.connected()
        assert cohort.members[name].state_requests[-1] == RequestState(("c",), 1)
    assert cohort.members["c"].core.connected()


def test_a_joiner_blocks_rounds_until_it_has_the_state() -> None:
    cohort = connected_cohort(["a", "b"])
    cohort.members["c"] = Member(AccumulatorCore("c", cohort="c"), [0.0] * 4)
    cohort.epoch(["a", "b", "c"])
    cohort.deliver()
    joiner = cohort.members["c"].core
    assert not joiner.connected()
    with pytest.raises(RuntimeError, match="waiting for the leader's state"):
        joiner.contribute(1, cohort.now)
    cohort.reduce("a", 1.0, 1)
    cohort.reduce("b", 1.0, 1)
    cohort.deliver()
    assert cohort.reduces == {}  # count 0 waits for c
    cohort.handle("c", joiner.state_loaded(0))
    cohort.reduce("c", 4.0, 1)
    cohort.deliver()
    cohort.finish_reduces()
    for member in cohort.members.values():
        assert member.grad == 2.0
        member.core.zero_gradients()
        assert member.core.model_version == 1


def test_a_member_leaving_mid_round_keeps_the_survivors_contributions() -> None:
    names = ["a", "b", "c"]
    cohort = connected_cohort(names, virtual_batch_size=3)
    cohort.reduce("a", 1.0, 1)
    cohort.reduce("b", 3.0, 1)
    cohort.reduce("c", 100.0, 1)
    cohort.deliver()
    assert len(cohort.reduces) == 1
    # c dies during the gradient phase: a and b's all-reduce fails (incomplete)
    (group_id,) = cohort.reduces
    started = cohort.reduces.pop(group_id)
    for name in ["a", "b"]:
        action = started[name]
        core = cohort.members[name].core
        assert core.reduce_done(action.epoch, action.index, ok=False) == []
        assert not core.has_gradients()
    # the next epoch: a and b only; their contributions are still in slot 0
    cohort.epoch(["a", "b"])
    cohort.queue = [m for m in cohort.queue if m[0] != "c" and m[1] != "c"]
    cohort.deliver()
    for name in ["a", "b"]:
        core = cohort.members[name].core
        assert core.connected()
        assert core.wants_gradients()
    cohort.reduce("a", 1.0, 1)  # one more each: batch 2 + 2 >= 3
    cohort.reduce("b", 3.0, 1)
    cohort.deliver()
    cohort.finish_reduces()
    for name in ["a", "b"]:
        member = cohort.members[name]
        assert member.core.stats() == GradientStats(num_gradients=4, num_skipped=0, batch_size=4)
        assert member.grad == pytest.approx((1 + 1 + 3 + 3) / 4)
        cohort.zero(name)
        assert member.core.model_version == 1


def _a_alone_applies_count_0(cohort: Cohort, names: list[str]) -> None:
    """Every member contributes; count 0's all-reduce completes for "a" only (the last member
    died after sending "a" its part): "a" applies the result, the others' fail."""
    for i, name in enumerate(names):
        cohort.reduce(name, float(i + 1), 1)
    cohort.deliver()
    (started,) = cohort.reduces.values()
    started = dict(started)
    cohort.finish_reduces(skip=frozenset(names) - {"a"})
    for name in names[1:]:
        action = started[name]
        cohort.handle(name, cohort.members[name].core.reduce_done(action.epoch, 0, ok=False))
    assert cohort.members["a"].core.has_gradients()
    assert not any(cohort.members[n].core.has_gradients() for n in names[1:])


def test_a_result_applied_but_unread_when_the_epoch_changes_makes_the_others_download() -> None:
    names = ["a", "b", "c"]
    cohort = connected_cohort(names)
    _a_alone_applies_count_0(cohort, names)
    a, b = cohort.members["a"], cohort.members["b"]
    # the next epoch (c is gone) starts before a's user read the result: a's model will be
    # stepped with it, b's never is, so b must download a's, not train one result behind
    cohort.queue = [m for m in cohort.queue if "c" not in m[:2]]
    cohort.epoch(["a", "b"])
    cohort.deliver()
    assert a.core.leader == b.core.leader == "a"
    assert a.core.state_id()[0] == 1
    (request,) = b.state_requests[1:]
    assert (request.donors, request.version) == (("a",), 1)
    assert not b.core.connected()
    cohort.zero("a")  # (the user steps with the result)
    assert (a.core.model_version, a.core.lineage) == a.core.state_id()
    cohort.handle("b", b.core.state_loaded(1))
    assert (b.core.model_version, b.core.lineage) == (1, a.core.lineage)
    # and they go on as one model
    cohort.reduce("a", 1.0, 1)
    cohort.reduce("b", 3.0, 1)
    cohort.deliver()
    cohort.finish_reduces()
    for member in (a, b):
        assert member.grad == pytest.approx(2.0)
        cohort.zero(member.core.me)
    assert a.core.state_id() == b.core.state_id() == (2, a.core.lineage)


def test_a_state_loaded_over_an_unread_result_drops_the_result() -> None:
    names = ["a", "b", "c"]
    cohort = connected_cohort(names)
    _a_alone_applies_count_0(cohort, names)
    a = cohort.members["a"]
    # c comes back at a greater version (a restored checkpoint): a downloads its model, and
    # the result a's model had not been stepped with yet must not be stepped onto c's
    cohort.members["c"].core.set_model_version(5)
    cohort.epoch(names, epoch=epoch_digest(names, ["", "", "restarted"]))
    cohort.deliver()
    assert a.core.leader == "c"
    (request,) = a.state_requests[1:]
    assert request.version == 5
    cohort.handle("a", a.core.state_loaded(5))
    assert not a.core.has_gradients()
    assert a.core.model_version == 5
    cohort.zero("a")  # (nothing to read: the version stays)
    assert a.core.model_version == 5


def test_a_stale_allreduce_report_of_an_old_epoch_is_ignored() -> None:
    cohort = connected_cohort(["a", "b"])
    cohort.reduce("a", 1.0, 1)
    cohort.reduce("b", 1.0, 1)
    cohort.deliver()
    (started,) = cohort.reduces.values()
    old = started["a"]
    cohort.epoch(["a"], who=["a"])
    assert cohort.members["a"].core.reduce_done(old.epoch, old.index, ok=True) == []
    assert not cohort.members["a"].core.has_gradients()


def test_parallel_two_applies_results_in_count_order() -> None:
    names = ["a", "b"]
    cohort = connected_cohort(names)
    for name in names:
        cohort.members[name].core.set_parallel_gradients(2)
    assert cohort.reduce("a", 1.0, 1) == 0
    assert cohort.reduce("b", 1.0, 1) == 0
    cohort.deliver()
    # slot 0 is reducing; a second contribution goes to slot 1
    assert cohort.reduce("a", 5.0, 1) == 1
    assert cohort.reduce("b", 5.0, 1) == 1
    cohort.deliver()
    assert len(cohort.reduces) == 2
    # slot 1's all-reduce finishes first: nothing is applied before slot 0's
    later = [g for g, s in cohort.reduces.items() if next(iter(s.values())).index == 1]
    first = [g for g, s in cohort.reduces.items() if next(iter(s.values())).index == 0]
    slot1 = {later[0]: cohort.reduces.pop(later[0])}
    for name, action in slot1[later[0]].items():
        assert cohort.members[name].core.reduce_done(action.epoch, action.index, True) == []
    cohort.finish_reduces()
    assert first[0] not in cohort.reduces
    for name in names:
        member = cohort.members[name]
        assert [i for i, _, _ in member.applied] == [0]
        assert member.core.model_version == 0
        assert not member.core.wants_gradients()  # the result is unread
        cohort.zero(name)  # now count 1's result is applied
        assert [i for i, _, _ in member.applied] == [0, 1]
        assert member.core.model_version == 1
        cohort.zero(name)
        assert member.core.model_version == 2


def test_misuse_raises_instead_of_aborting() -> None:
    core = AccumulatorCore("a")
    with pytest.raises(RuntimeError, match="not in a cohort"):
        core.contribute(1, 0.0)
    with pytest.raises(RuntimeError, match="wants_gradients"):
        core.skip(0.0)
    core.new_epoch(["a", "b"], 0.0)
    with pytest.raises(RuntimeError, match="electing"):
        core.contribute(1, 0.0)
    solo = AccumulatorCore("s")
    solo.new_epoch(["s"], 0.0)
    _, actions = solo.contribute(1, 0.0)
    (start,) = actions
    assert isinstance(start, StartReduce)
    assert start.members == ("s",)
    (applied,) = solo.reduce_done(start.epoch, start.index, ok=True)
    assert isinstance(applied, ApplyResult)
    assert solo.has_gradients()
    with pytest.raises(RuntimeError, match="zero_gradients"):
        solo.contribute(1, 0.0)
    for bad, error in [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="batch_size"):
            solo.contribute(bad, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weighting"):
        AccumulatorCore("a", weighting="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="virtual_batch_size"):
        AccumulatorCore("a", virtual_batch_size=0)
    with pytest.raises(ValueError, match="n must"):
        solo.set_parallel_gradients(0)


def test_set_parallel_gradients_refuses_while_contributions_are_in_flight() -> None:
    cohort = connected_cohort(["a", "b"])
    cohort.reduce("a", 1.0, 1)
    with pytest.raises(RuntimeError, match="in flight"):
        cohort.members["a"].core.set_parallel_gradients(2)


def test_bad_messages_are_protocol_errors() -> None:
    cohort = connected_cohort(["a", "b"])
    core = cohort.members["a"].core
    epoch = core.epoch
    assert epoch is not None
    with pytest.raises(RemoteProtocolError, match="not a member"):
        core.receive("z", Hello(epoch, 0), 0.0)
    with pytest.raises(RemoteProtocolError, match="twice"):
        core.receive("b", Hello(epoch, 0), 0.0)
    with pytest.raises(RemoteProtocolError, match="too far ahead"):
        core.receive("b", Count(epoch, 5, SlotTotals(1, 1, 0), 1), 0.0)
    with pytest.raises(RemoteProtocolError, match="virtual_batch_size"):
        core.receive("b", Count(epoch, 0, SlotTotals(1, 1, 0), 2), 0.0)
    with pytest.raises(RemoteProtocolError, match="batch_size"):
        core.receive("b", Count(epoch, 0, SlotTotals(-1, 1, 0), 1), 0.0)
    with pytest.raises(RemoteProtocolError, match="epoch of 3 bytes"):
        core.receive("b", Hello(b"abc", 0), 0.0)
    core.receive("b", Count(epoch, 0, SlotTotals(1, 1, 0), 1), 0.0)
    with pytest.raises(RemoteProtocolError, match="twice"):
        core.receive("b", Count(epoch, 0, SlotTotals(1, 1, 0), 1), 0.0)


def test_messages_of_an_unknown_epoch_wait_for_it_and_ask_for_a_refresh() -> None:
    cohort = connected_cohort(["a", "b"])
    cohort.members["c"] = Member(AccumulatorCore("c", cohort="c"), [0.0] * 4)
    # c and a adopt the new view first; b has not read the DHT yet
    cohort.epoch(["a", "b", "c"], who=["a", "c"])
    cohort.deliver()
    assert ("b", "a") in cohort.refreshes or ("b", "c") in cohort.refreshes
    assert cohort.members["a"].core.leader is None  # b's hello is missing
    cohort.epoch(["a", "b", "c"], who=["b"])  # b catches up: the kept hellos count
    cohort.deliver()
    assert {m.core.leader for m in cohort.members.values()} == {"b"}  # c holds no model


@pytest.mark.parametrize(
    "clock",
    [
        pytest.param((0.0, 0.0, 0.0), id="at-once"),
        # the clock the processes saw (a CI failure): c leaves the view with d only once its
        # own hello to d failed for round_timeout (10 s), a little more than round_timeout
        # after a's and b's hellos came
        pytest.param((100.0, 100.01, 110.02), id="one-round-timeout-later"),
    ],
)
def test_messages_of_an_epoch_adopted_after_another_one_are_still_received(
    clock: tuple[float, float, float],
) -> None:
    """a and b adopt the view without d (a peer that died) and say hello; c first adopts
    another view (it still holds d) and only later theirs. Their hellos, kept since they came,
    count then: a, b and c elect a leader and nobody waits on anyone (the hellos used to be
    dropped when c adopted the other view, or when one ``round_timeout`` had passed since they
    came; each side then waited for the other's until it suspected it: the cohort split in
    two)."""
    cohort = connected_cohort(["a", "b", "c", "d"], round_timeout=10.0)
    old = cohort.members["c"].core.epoch
    cohort.now = clock[0]
    cohort.epoch(["a", "b", "c"], who=["a", "b"])
    cohort.deliver(only_to={"a", "b", "c"})
    assert cohort.members["c"].core.epoch == old  # (kept, a refresh asked)
    cohort.now = clock[1]
    cohort.epoch(["a", "b", "c", "d"], who=["c"], epoch=b"\x01" * 32)  # (another view first)
    cohort.deliver(only_to={"a", "b", "c"})
    cohort.now = clock[2]
    cohort.epoch(["a", "b", "c"], who=["c"])
    cohort.deliver(only_to={"a", "b", "c"})
    assert {cohort.members[n].core.leader for n in "abc"} == {"c"}
    for name in "abc":
        assert cohort.members[name].core.stalled(cohort.now + 9.0) == ()
        assert cohort.members[name].core.stalled(cohort.now + 1e6) == ()


def test_a_member_heard_from_another_epoch_is_waited_on_for_twice_the_round_timeout() -> None:
    """a and b adopt the view without d and say hello; c, still in a view with d, answers
    a's hello with its own epoch (a hears of it: ``heard_elsewhere``) and says hello in that
    view to b. Both wait on c for twice ``round_timeout`` (it is alive, and it keeps their
    hellos until it adopts their view); a member that never spoke of another epoch is
    suspected after one."""
    cohort = connected_cohort(["a", "b", "c", "d"], round_timeout=10.0)
    cohort.now = 100.0
    cohort.epoch(["a", "b", "c"], who=["a", "b"])
    cohort.deliver(only_to={"a", "b", "c"})
    a, b, c = (cohort.members[n].core for n in "abc")
    a.heard_elsewhere("c", 100.01)  # (the shell, on c's answer)
    a.heard_elsewhere("x", 100.01)  # (not a member: nothing)
    cohort.now = 100.02
    cohort.epoch(["a", "b", "c", "d"], who=["c"], epoch=b"\x02" * 32)
    cohort.queue = [m for m in cohort.queue if m[1] == "b"]  # (c's hello to b: kept, heard)
    cohort.deliver(only_to={"b"})
    for core in (a, b):
        assert core.stalled(110.01) == ()
        assert core.stalled(119.99) == ()
        assert core.stalled(120.0) == ("c",)
    # an exchange that began after c last spoke of another epoch waits one round_timeout
    cohort.epoch(["a", "b", "c"], who=["a", "b"], epoch=b"\x03" * 32)
    assert a.stalled(cohort.now + 10.0) == ("b", "c")
    # once c adopts their view, the kept hellos count, and nobody waits on anyone
    cohort.queue.clear()
    cohort.epoch(["a", "b", "c"], who=["a", "b", "c"], epoch=b"\x04" * 32)
    cohort.deliver(only_to={"a", "b", "c"})
    assert {core.leader for core in (a, b, c)} == {"c"}


def test_messages_of_unknown_epochs_are_bounded_and_forgotten_after_two_round_timeouts() -> None:
    """Kept messages take a place per sender (256 senders at most, then a protocol error); a
    place is freed twice ``round_timeout`` after its messages came (their sender has given up
    on this member by then, or left for good)."""
    core = AccumulatorCore("m", cohort="c", round_timeout=30.0)
    core.new_epoch(["m"], 0.0)
    other = epoch_digest(["m", "x"])
    for i in range(256):
        assert core.receive(f"p{i}", Hello(other, 0, b""), 1.0) == [Refresh(f"p{i}")]
    with pytest.raises(RemoteProtocolError, match="too many peers"):
        core.receive("late", Hello(other, 0, b""), 60.0)
    assert core.receive("late", Hello(other, 0, b""), 61.0) == [Refresh("late")]
    assert core.receive("later", Hello(other, 0, b""), 61.0) == [Refresh("later")]
    # the late ones' places were taken at 61: they stay until 121
    core.new_epoch(["m", "y"], 120.0)  # (another epoch: they stay kept)
    assert len(core._early) == 2
    core.new_epoch(["m"], 121.0)
    assert core._early == {}


def test_stalled_names_the_silent_members_after_the_round_timeout() -> None:
    cohort = connected_cohort(["a", "b", "c"], round_timeout=30.0)
    cohort.reduce("a", 1.0, 1)
    cohort.reduce("b", 1.0, 1)
    cohort.deliver()
    core = cohort.members["a"].core
    assert core.stalled(29.0) == ()
    assert core.stalled(30.0) == ("c",)
    # c has not contributed, so it waits on nobody
    assert cohort.members["c"].core.stalled(100.0) == ()


def test_epoch_and_group_ids_are_the_same_for_every_member() -> None:
    assert epoch_digest(["b", "a"]) == epoch_digest(["a", "b", "a"])
    assert epoch_digest(["a", "b"]) != epoch_digest(["a", "bc"])
    assert epoch_digest(["ab", "c"]) != epoch_digest(["a", "bc"])
    assert epoch_digest(["a", "b"], ["1", "2"]) == epoch_digest(["b", "a"], ["2", "1"])
    assert epoch_digest(["a", "b"], ["1", "2"]) != epoch_digest(["a", "b"], ["1", "3"])
    with pytest.raises(ValueError, match="incarnations"):
        epoch_digest(["a", "b"], ["1"])
    epoch = epoch_digest(["a"])
    assert round_group_id("x", epoch, 1) != round_group_id("x", epoch, 2)
    assert round_group_id("x", epoch, 1) != round_group_id("y", epoch, 1)


def test_messages_travel_through_the_codec_and_bad_encodings_are_protocol_errors() -> None:
    epoch = epoch_digest(["a", "b"])
    for msg in (
        Hello(epoch, 3, b"\x01" * 16),
        Count(epoch, 2, SlotTotals(5, 1, 2), 4),
        AccLeave(epoch),
        AccAck(b""),
    ):
        assert decode_message(encode_message_bytes(msg)) == msg
    long = encode_message_bytes(Hello(epoch, 3)).replace(epoch, epoch + b"x")
    with pytest.raises(RemoteProtocolError):
        decode_message(long)  # (the header's length prefix no longer matches)
    header = {"v": PROTOCOL_VERSION, "t": "acc.hello", "f": [bytes(33), 1, b""]}
    packed = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(RemoteProtocolError, match="epoch"):
        decode_message(len(packed).to_bytes(4, "big") + packed)
    header = {"v": PROTOCOL_VERSION, "t": "acc.count", "f": [epoch, 0, [1, "x", 0], 1]}
    packed = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        decode_message(len(packed).to_bytes(4, "big") + packed)
