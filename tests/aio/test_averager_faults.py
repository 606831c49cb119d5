"""Averagers under failure, many in one process on the memory transport and virtual time:
a peer that leaves or dies costs the others a moment, not an expiration; a peer with NaN
values is refused at once and one that sends them anyway is left out of later groups; every
step keeps its deadline; errors say why."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from swarmavg import get_dht_time
from swarmavg.aio import DHT
from swarmavg.aio.averager import DecentralizedAverager, StepResult
from swarmavg.errors import AllReduceFailed, MatchmakingFailed, NonFiniteTensors
from swarmavg.proto.averaging_messages import AvgBegin, AvgKeep, AvgPart
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.testing import Adversary, MemoryNetwork, run_on_virtual_time


class _Swarm:
    """Averagers with their DHTs; :meth:`kill` takes one down abruptly (its node closes:
    no leave notice, no withdrawn declaration, connections simply end)."""

    def __init__(self, stack: AsyncExitStack) -> None:
        self.stack = stack
        self.network = MemoryNetwork()
        self.dhts: list[DHT] = []
        self.averagers: list[DecentralizedAverager] = []
        self.stacks: list[AsyncExitStack] = []

    async def add(self, tensors: list[torch.Tensor], **options: Any) -> DecentralizedAverager:
        own = AsyncExitStack()
        await self.stack.enter_async_context(own)
        seeds = [a for d in self.dhts[:2] for a in d.get_visible_maddrs()]
        dht = await own.enter_async_context(
            DHT(seeds, transport="memory", transport_options={"network": self.network})
        )
        options = {"prefix": "run", "target_group_size": 4, **options}
        averager = await own.enter_async_context(DecentralizedAverager(tensors, dht, **options))
        self.dhts.append(dht)
        self.averagers.append(averager)
        self.stacks.append(own)
        return averager

    async def leave(self, index: int) -> None:
        """As Ctrl+C in its process: the averager and the DHT shut down."""
        await self.averagers[index].aclose()
        await self.dhts[index].aclose()

    async def kill(self, index: int) -> None:
        """As SIGKILL: the node's connections end; nothing is said."""
        await self.dhts[index].node.aclose()


@asynccontextmanager
async def _swarm(n: int, **options: Any) -> AsyncIterator[_Swarm]:
    async with AsyncExitStack() as stack:
        swarm = _Swarm(stack)
        for i in range(n):
            await swarm.add([torch.full((1000,), float(i)), torch.full((10,), float(i))], **options)
        yield swarm


async def _steps(
    averagers: Sequence[DecentralizedAverager], **kwargs: Any
) -> tuple[list[StepResult | BaseException], list[float]]:
    """Every averager's step at once: each one's outcome and duration (virtual seconds)."""
    outcomes: list[StepResult | BaseException] = [RuntimeError("not run")] * len(averagers)
    took = [0.0] * len(averagers)

    async def one(i: int) -> None:
        started = anyio.current_time()
        try:
            outcomes[i] = await averagers[i].step(**kwargs)
        except Exception as exc:
            outcomes[i] = exc
        took[i] = anyio.current_time() - started

    async with anyio.create_task_group() as tg:
        for i in range(len(averagers)):
            tg.start_soon(one, i)
    return outcomes, took


def _poison(averager: DecentralizedAverager, *, every: int) -> None:
    """Make ``averager`` a modified peer that sends NaN: every ``every``-th value of its first
    tensor is NaN and it skips its own checks (the step's and the all-reduce's)."""
    with averager.get_tensors() as tensors:
        tensors[0][::every] = float("nan")

    async def no_check() -> None:
        return None

    averager._check_finite = no_check  # type: ignore[method-assign]
    averager.allreduce._finite = lambda buffers: True  # type: ignore[union-attr,method-assign]


def _values(averager: DecentralizedAverager) -> list[np.ndarray[Any, Any]]:
    with averager.get_tensors() as tensors:
        return [t.numpy().copy() for t in tensors]


def _agree(averagers: Sequence[DecentralizedAverager]) -> bool:
    first = _values(averagers[0])
    return all(
        all(np.array_equal(a, b) for a, b in zip(first, _values(other), strict=True))
        for other in averagers[1:]
    )


@pytest.mark.parametrize("victim", [3, 0], ids=["a-peer", "the-bootstrap-peer"])
@pytest.mark.parametrize("how", ["leave", "kill"])
def test_after_one_of_four_peers_is_gone_the_others_step_at_once(how: str, victim: int) -> None:
    """A new user's scenario: four peers with target_group_size=4 average round after round;
    one (also the one the others bootstrapped from) leaves (Ctrl+C) or dies between rounds. The
    others' next steps form a group of three at once, not after averaging_expiration (15 s)."""

    async def main() -> tuple[list[float], list[list[int]], bool]:
        async with _swarm(4) as swarm:
            sizes = []
            durations = []
            for round_ in range(5):
                if round_ == 2:
                    await (swarm.leave(victim) if how == "leave" else swarm.kill(victim))
                live = [a for i, a in enumerate(swarm.averagers) if round_ < 2 or i != victim]
                outcomes, took = await _steps(live, timeout=30)
                assert all(isinstance(o, StepResult) for o in outcomes), outcomes
                sizes.append([o.group_size for o in outcomes if isinstance(o, StepResult)])
                durations.append(max(took))
            survivors = [a for i, a in enumerate(swarm.averagers) if i != victim]
            return durations, sizes, _agree(survivors)

    durations, sizes, agree = run_on_virtual_time(main)
    assert sizes == [[4] * 4] * 2 + [[3] * 3] * 3
    assert max(durations[2:]) < 1.0, durations  # (was averaging_expiration: 15 s a round)
    assert agree


@pytest.mark.parametrize("stage", ["looking", "allreduce"])
def test_a_peer_that_dies_mid_round_costs_the_others_no_timeout(stage: str) -> None:
    """A peer dies while the others look for a group with it, or as the all-reduce begins:
    the survivors finish within a moment (their connections to it fail), well before
    sender_timeout (15 s) or averaging_expiration, and agree exactly afterwards."""

    async def main() -> tuple[float, list[StepResult | BaseException], bool]:
        async with _swarm(4) as swarm:
            await _steps(swarm.averagers, timeout=30)  # (all connected, as after a round)
            victim = swarm.averagers[3]
            if stage == "allreduce":
                run = victim.allreduce.run  # type: ignore[union-attr]

                async def die(*args: Any, **kwargs: Any) -> Any:
                    await anyio.sleep(0.001)  # (the others' rounds began: the group is told)
                    await swarm.kill(3)
                    await anyio.sleep_forever()

                victim.allreduce.run = die  # type: ignore[method-assign,union-attr]
            started = anyio.current_time()

            async def victim_step() -> None:
                with contextlib.suppress(Exception):  # (it is dead: what it raises is moot)
                    await victim.step()

            async with anyio.create_task_group() as tg:
                outcomes: list[StepResult | BaseException] = []

                async def survivors() -> None:
                    result, _ = await _steps(swarm.averagers[:3], timeout=60)
                    outcomes.extend(result)
                    tg.cancel_scope.cancel()

                tg.start_soon(survivors)
                if stage == "looking":
                    tg.start_soon(victim_step)
                    await anyio.sleep(0.001)  # (it declared itself, then dies)
                    await swarm.kill(3)
                else:
                    tg.start_soon(victim_step)
            took = anyio.current_time() - started
            if stage == "allreduce":
                victim.allreduce.run = run  # type: ignore[method-assign,union-attr]
            await _steps(swarm.averagers[:3], timeout=30)
            return took, outcomes, _agree(swarm.averagers[:3])

    took, outcomes, agree = run_on_virtual_time(main)
    assert took < 5, took
    for outcome in outcomes:
        assert isinstance(outcome, StepResult), outcome
        if stage == "allreduce":  # the dead member is named
            assert outcome.incomplete
            assert any("connection was lost" in why for _, why in outcome.local_spans)
    assert agree


def test_a_peer_with_non_finite_tensors_is_refused_at_once_naming_them() -> None:
    async def main() -> tuple[NonFiniteTensors, float]:
        async with _swarm(2) as swarm:
            with swarm.averagers[1].get_tensors() as tensors:
                tensors[1][3] = float("nan")
                tensors[1][4] = float("inf")
            started = anyio.current_time()
            with pytest.raises(NonFiniteTensors) as caught:
                await swarm.averagers[1].step(timeout=30)
            return caught.value, anyio.current_time() - started

    error, took = run_on_virtual_time(main)
    assert took < 0.01  # before looking for a group
    assert error.indices == [1]
    assert "1 of the 2 averaged tensors" in str(error)
    assert "tensor 1 (float32[10]): 2 of 10 values" in str(error)
    assert isinstance(error, ValueError)


def test_a_peer_that_sends_nan_anyway_is_left_out_of_its_groupmates_next_groups(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A modified peer skips the checks and sends NaN: its groupmates leave its values out
    (they still agree exactly), log one line naming it, and keep it out of their next groups,
    which are complete; its own steps fail saying it was excluded."""

    async def main() -> tuple[
        list[StepResult | BaseException], list[StepResult | BaseException], bool, list[int]
    ]:
        async with _swarm(4) as swarm:
            _poison(swarm.averagers[3], every=3)
            first, _ = await _steps(swarm.averagers, timeout=30)
            second, _ = await _steps(swarm.averagers, timeout=5)
            counted = [a.metrics.fault_counts()["non_finite"] for a in swarm.averagers[:3]]
            return first, second, _agree(swarm.averagers[:3]), counted

    with caplog.at_level(logging.WARNING):
        first, second, agree, counted = run_on_virtual_time(main)
    for outcome in first[:3]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.incomplete  # (its values were left out)
    assert agree
    # each honest peer's metrics count the poisoned member at least once (it reduces a span
    # the poisoned one sent to, and the poisoned one's own span answered NaN to it)
    assert all(count >= 1 for count in counted), counted
    assert any(
        "sent non-finite or overflowing values; left out of our groups" in r.message
        for r in caplog.records
    )
    for outcome in second[:3]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.group_size == 3
        assert not outcome.incomplete
    assert isinstance(second[3], MatchmakingFailed)
    # (it says so: it asked a groupmate, or it led and nobody came)
    message = str(second[3])
    assert "turned us away: excluded" in message or "did not join us" in message, message


def test_peers_averaging_other_tensors_are_named_in_the_failure() -> None:
    async def main() -> tuple[BaseException | StepResult, ...]:
        async with AsyncExitStack() as stack:
            swarm = _Swarm(stack)
            await swarm.add([torch.zeros(10)], target_group_size=2, averaging_expiration=2.0)
            await swarm.add([torch.zeros(20)], target_group_size=2, averaging_expiration=2.0)
            outcomes, _ = await _steps(swarm.averagers, timeout=3)
            return tuple(outcomes)

    outcomes = run_on_virtual_time(main)
    for outcome, theirs, ours in zip(
        outcomes, ("float32[20]", "float32[10]"), ("float32[10]", "float32[20]"), strict=True
    ):
        assert isinstance(outcome, MatchmakingFailed)
        message = str(outcome)
        assert "1 peer(s) under 'run.0b' average a different tensor schema" in message
        assert theirs in message.split("ours:")[0]
        assert ours in message.split("ours:")[1]


def test_a_step_timeout_bounds_the_all_reduce_too() -> None:
    """A groupmate that joins and then stalls in the all-reduce: the step(timeout=3) returns
    (raises) within its timeout although allreduce_timeout is 60 s."""

    async def main() -> tuple[BaseException | StepResult, float]:
        async with _swarm(2, target_group_size=2, allreduce_timeout=60.0) as swarm:
            stalled = swarm.averagers[1]

            async def stall(*args: Any, **kwargs: Any) -> Any:
                await anyio.sleep_forever()

            stalled.allreduce.run = stall  # type: ignore[method-assign,union-attr]
            async with anyio.create_task_group() as tg:
                tg.start_soon(stalled.step)
                started = anyio.current_time()
                try:
                    outcome: BaseException | StepResult = await swarm.averagers[0].step(timeout=3)
                except Exception as exc:
                    outcome = exc
                took = anyio.current_time() - started
                tg.cancel_scope.cancel()
            return outcome, took

    outcome, took = run_on_virtual_time(main)
    assert took <= 3 + 1, took
    assert isinstance(outcome, AllReduceFailed | MatchmakingFailed), outcome


def test_a_plain_dictionary_under_a_group_key_is_not_taken_for_declarations() -> None:
    """A value stored under the group key that is not a declaration dictionary (anyone can
    store there) gives no candidates, never an error."""

    async def main() -> list[StepResult | BaseException]:
        async with _swarm(2, target_group_size=2) as swarm:
            dht = swarm.dhts[0]
            await dht.store("run.0b", {"a": 1, "b": [2]}, expiration_time=get_dht_time() + 0.5)
            outcomes, _ = await _steps(swarm.averagers, timeout=10)
            return outcomes

    outcomes = run_on_virtual_time(main)
    assert all(isinstance(o, StepResult) for o in outcomes), outcomes


# -- the fault matrix ----------------------------------------------------------------------------


def _matrix_run(seed: int) -> dict[str, Any]:
    """One random swarm (3-5 peers, one group, links of 2 ms and 2 MB/s so that a round takes a
    while); one peer leaves, dies or sends NaN at a random moment of a step (while the others
    look, while they assemble, before the first part, mid-span or while they relay), or joins
    the group and then stalls (it never begins its all-reduce)."""
    import random

    rng = random.Random(seed)
    n = rng.randint(3, 5)
    victim = rng.randrange(n)
    fault = rng.choice(["leave", "kill", "nan", "stall"])
    at = rng.uniform(0.0, 0.4)
    timeout = 10.0

    async def main() -> dict[str, Any]:
        async with AsyncExitStack() as stack:
            swarm = _Swarm(stack)
            swarm.network = MemoryNetwork()
            for i in range(n):
                own = AsyncExitStack()
                await stack.enter_async_context(own)
                seeds = [a for d in swarm.dhts[:2] for a in d.get_visible_maddrs()]
                dht = await own.enter_async_context(
                    DHT(
                        seeds,
                        transport="memory",
                        transport_options={
                            "network": swarm.network,
                            "latency": 0.002,
                            "bandwidth": 2e6,
                        },
                    )
                )
                averager = await own.enter_async_context(
                    DecentralizedAverager(
                        [torch.full((20000,), 10.0**i)],
                        dht,
                        prefix="matrix",
                        target_group_size=n,
                        part_size_bytes=4096,
                        sender_timeout=1.0,
                        reducer_timeout=2.0,
                        allreduce_timeout=8.0,
                    )
                )
                swarm.dhts.append(dht)
                swarm.averagers.append(averager)
                swarm.stacks.append(own)
            bad = swarm.averagers[victim]
            if fault == "nan":
                _poison(bad, every=5)
            elif fault == "stall":

                async def stall(*args: Any, **kwargs: Any) -> Any:
                    await anyio.sleep_forever()

                bad.allreduce.run = stall  # type: ignore[method-assign,union-attr]
            survivors = [i for i in range(n) if i != victim]
            outcomes: dict[int, StepResult | BaseException] = {}
            took: dict[int, float] = {}
            survived = anyio.Event()

            async def step(i: int) -> None:
                started = anyio.current_time()
                try:
                    outcomes[i] = await swarm.averagers[i].step(timeout=timeout)
                except Exception as exc:
                    outcomes[i] = exc
                took[i] = anyio.current_time() - started
                if len(took) == len(survivors) + (fault == "nan"):
                    survived.set()

            async def strike() -> None:
                await anyio.sleep(at)
                if fault == "leave":  # (as Ctrl+C: its averager closes, cancelling its step)
                    await bad.aclose()
                elif fault == "kill":
                    await swarm.kill(victim)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    if i in survivors or fault == "nan":
                        tg.start_soon(step, i)
                    else:
                        tg.start_soon(_quietly, swarm.averagers[i])
                tg.start_soon(strike)
                if fault == "stall":
                    await survived.wait()
                    tg.cancel_scope.cancel()  # (the stalled one stays stalled)
            if fault == "stall":
                await bad.aclose()  # (it leaves before the next round)
            values = {i: _values(swarm.averagers[i])[0] for i in survivors}
            # the next round, survivors only: quick, complete, exact
            started = anyio.current_time()
            again, _ = await _steps([swarm.averagers[i] for i in survivors], timeout=timeout)
            return {
                "outcomes": outcomes,
                "took": took,
                "values": values,
                "again": again,
                "again_took": anyio.current_time() - started,
                "after": {i: _values(swarm.averagers[i])[0] for i in survivors},
                "ids": [a.dht.peer_id for a in swarm.averagers],
            }

    found = run_on_virtual_time(main)
    found.update(n=n, victim=victim, fault=fault, at=at, timeout=timeout)
    return found


async def _quietly(averager: DecentralizedAverager) -> None:
    with contextlib.suppress(Exception):  # (the victim: what it raises as it goes is moot)
        await (await averager.step(wait=False))


@pytest.mark.parametrize("seed", range(int(os.environ.get("FAULT_MATRIX_RUNS", "24"))))
def test_fault_matrix(seed: int) -> None:
    """Every survivor's step ends within its timeout; survivors of one group agree exactly
    (the same elements averaged, to the same values, the rest their own), the victim is the
    only peer their results name, no NaN spreads; the next round forms at once, complete."""
    run = _matrix_run(seed)
    n, victim, fault = run["n"], run["victim"], run["fault"]
    ids = run["ids"]
    survivors = [i for i in range(n) if i != victim]
    for i in survivors:
        assert run["took"][i] <= run["timeout"] + 1, (i, run["took"][i], run)
        assert not np.isnan(run["values"][i]).any()
    by_group: dict[bytes, list[int]] = {}
    for i in survivors:
        outcome = run["outcomes"][i]
        if isinstance(outcome, StepResult):
            by_group.setdefault(outcome.group_id, []).append(i)
            named = {p for p, _ in outcome.local_spans} | {s for _, s, _ in outcome.dropped}
            assert named <= {ids[victim]}, (i, outcome.local_spans, outcome.dropped)
            if outcome.incomplete:
                assert ids[victim] in named
        else:
            assert isinstance(outcome, MatchmakingFailed | AllReduceFailed), (i, outcome)
    for members in by_group.values():
        kept = {i: run["values"][i] == np.float32(10.0**i) for i in members}
        first = members[0]
        for other in members[1:]:
            assert np.array_equal(kept[first], kept[other]), (first, other, fault, run["at"])
            both = ~kept[first] & ~kept[other]
            assert np.array_equal(run["values"][first][both], run["values"][other][both])
    # the next round: the survivors alone, at once, complete, in agreement
    assert run["again_took"] < 2.0, run["again_took"]
    for outcome in run["again"]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.group_size == n - 1
        assert not outcome.incomplete
    after = [run["after"][i] for i in survivors]
    assert all(np.array_equal(after[0], other) for other in after[1:])


def test_a_step_cut_off_mid_round_ends_within_its_timeout() -> None:
    """A peer whose cable is pulled as its all-reduce begins (nothing it sends or is sent
    arrives; dials wait): its round fails, it looks for another group until the step's
    timeout, and the step raises by then, not request_timeout (and a withdrawal) later: the
    search's own end (a leader's reply awaited request_timeout after begin_at) is kept inside
    the step's deadline."""

    async def main() -> tuple[BaseException | StepResult, float]:
        options = {
            "target_group_size": 2,
            "allreduce_timeout": 4.0,  # (the round fails as a whole: nothing comes in time)
            "sender_timeout": 10.0,
            "reducer_timeout": 10.0,
            "request_timeout": 3.0,
        }
        async with _swarm(2, averaging_expiration=8.0, **options) as swarm:
            await _steps(swarm.averagers, timeout=30)  # (connected, as after a round)
            victim = swarm.averagers[1]
            transport = victim.dht.node._transports["memory"]
            run = victim.allreduce.run  # type: ignore[union-attr]

            async def cut_then_run(*args: Any, **kwargs: Any) -> Any:
                transport.set_link(False)  # type: ignore[attr-defined]
                return await run(*args, **kwargs)

            victim.allreduce.run = cut_then_run  # type: ignore[method-assign,union-attr]
            async with anyio.create_task_group() as tg:
                tg.start_soon(_quietly_step, swarm.averagers[0])
                started = anyio.current_time()
                try:
                    outcome: BaseException | StepResult = await victim.step(timeout=10)
                except Exception as exc:
                    outcome = exc
                took = anyio.current_time() - started
                tg.cancel_scope.cancel()
            transport.set_link(True)  # type: ignore[attr-defined]
            return outcome, took

    outcome, took = run_on_virtual_time(main)
    assert isinstance(outcome, AllReduceFailed | MatchmakingFailed), outcome
    assert took <= 10 + 1e-3, took


async def _quietly_step(averager: DecentralizedAverager) -> None:
    with contextlib.suppress(Exception):
        await averager.step(timeout=10)


def test_a_follower_whose_leader_is_cut_off_while_matchmaking_averages_with_the_others() -> None:
    """The fault matrix's case (the leader's link cut while matchmaking, run 31 of seed 0): the
    best-ranked peer has taken one follower in (it expects all four: it does not begin with
    one follower) when its cable is pulled; the two others come later, ask it in vain, and
    lead among themselves. The follower sees its leader's declaration lapse and looks again,
    so the three survivors average together. It used to wait for the leader until its
    begin_at plus request_timeout, when the two others had averaged without it, and its step
    failed: ``MatchmakingFailed: no group within 25.0 s: only 1 peer(s)``."""

    async def main() -> tuple[list[StepResult | BaseException], list[float]]:
        options = {
            "target_group_size": 4,
            "min_group_size": 2,
            "averaging_expiration": 5.0,
            "request_timeout": 3.0,
        }
        async with _swarm(4, **options) as swarm:
            # (at the same begin_at, the lower PeerID ranks better)
            by_rank = sorted(swarm.averagers, key=lambda a: a.dht.peer_id.to_bytes())
            leader, follower, *later = by_rank
            leader.matchmaker.expected_group_size = 4  # type: ignore[union-attr]
            transport = leader.dht.node._transports["memory"]
            survivors = [follower, *later]
            outcomes: list[StepResult | BaseException] = [RuntimeError("not run")] * 3
            took = [0.0] * 3

            async def step(i: int, after: float) -> None:
                await anyio.sleep(after)
                started = anyio.current_time()
                try:
                    outcomes[i] = await survivors[i].step(timeout=25)
                except Exception as exc:
                    outcomes[i] = exc
                took[i] = anyio.current_time() - started

            async with anyio.create_task_group() as tg:
                tg.start_soon(_quietly_step, leader)
                async with anyio.create_task_group() as steps:
                    steps.start_soon(step, 0, 0.001)  # (it follows the leader at once)
                    steps.start_soon(step, 1, 0.5)
                    steps.start_soon(step, 2, 0.5)
                    await anyio.sleep(0.1)
                    transport.set_link(False)  # type: ignore[attr-defined]
                tg.cancel_scope.cancel()
            transport.set_link(True)  # type: ignore[attr-defined]
            return outcomes, took

    outcomes, took = run_on_virtual_time(main)
    for outcome in outcomes:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.group_size == 3
    assert max(took) < 10.0, took  # (by the later peers' begin_at, and a round)


@pytest.mark.parametrize(
    ("weight", "value"), [(2.0, 3e38), (1e39, 1.0)], ids=["huge-values", "huge-weight"]
)
def test_a_member_whose_contribution_would_overflow_the_mean_is_the_only_one_blamed(
    weight: float, value: float
) -> None:
    """Trust I's F1: a member (the library's own peer, its messages rewritten) sends finite
    values that overflow a float32 sum, or a weight past ``MAX_WEIGHT``. The honest reducers
    used to write an infinite mean, and the honest members then blamed and excluded each other.
    Now the attacker alone is left out: the honest members end with finite, equal values,
    and their next round is the two of them, complete."""

    async def main() -> tuple[list[Any], list[Any], list[list[np.ndarray[Any, Any]]], int]:
        async with _swarm(3, target_group_size=3) as swarm:
            attacker = Adversary(swarm.dhts[2])
            attacker.requests(AvgBegin, lambda m: dataclasses.replace(m, weight=weight))
            attacker.requests(AvgPart, lambda m: AvgPart(m.index, np.full_like(m.values, value)))
            first, _ = await _steps(swarm.averagers, timeout=30)
            values = [_values(a) for a in swarm.averagers[:2]]
            second, _ = await _steps(swarm.averagers, timeout=5)
            return first, second, values, attacker.rewritten["request AvgBegin"]

    first, second, values, rewritten = run_on_virtual_time(main)
    assert rewritten >= 2  # (it sent to both honest reducers)
    for outcome in first[:2]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.incomplete  # (the attacker's values were left out)
    # spans 0 and 1 hold the mean of the honest values (0 and 1), the attacker's span the mean
    # of all three (it reduced its own values honestly); finite and the same on both
    for tensors in values:
        for tensor in tensors:
            assert np.isfinite(tensor).all()
            assert set(np.unique(tensor)) <= {0.5, 1.0}
    for a, b in zip(values[0], values[1], strict=True):
        np.testing.assert_array_equal(a, b)
    for outcome in second[:2]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.group_size == 2
        assert not outcome.incomplete
    assert isinstance(second[2], MatchmakingFailed)


def test_a_reducer_answering_keep_for_a_weighted_part_makes_the_round_incomplete() -> None:
    """Trust I's F15: a reducer (the library's own peer, its answers rewritten) says "keep
    your values" (``AvgKeep``) for every part of its span, which had weight. Members used to
    keep their own values there and report a complete round, silently disagreeing. Now each
    honest member blames it: its span stays local, and the round says it is incomplete."""

    async def main() -> tuple[list[Any], list[Any], int]:
        async with _swarm(3, target_group_size=3) as swarm:
            with pytest.raises(TypeError, match="peer must be a Node"):
                Adversary(object())
            attacker = Adversary(swarm.dhts[2])
            with pytest.raises(RuntimeError, match="rewritten already"):
                Adversary(swarm.dhts[2].node)
            attacker.answers(AvgPart, lambda m: AvgKeep(m.index))
            outcomes, _ = await _steps(swarm.averagers, timeout=30)
            attacker.close()
            attacker.close()  # (idempotent)
            honest, _ = await _steps(swarm.averagers, timeout=30)
            return outcomes, honest, attacker.rewritten["answer AvgPart"]

    outcomes, honest, rewritten = run_on_virtual_time(main)
    assert rewritten >= 2
    for outcome in honest:  # (closed: it answers honestly again)
        assert isinstance(outcome, StepResult), outcome
        assert (outcome.group_size, outcome.incomplete) == (3, False)
    for outcome in outcomes[:2]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.incomplete
        [(_peer, why)] = outcome.local_spans
        assert "answered 'keep' for part 0, which had weight 1" in why


def test_a_member_claiming_a_huge_bandwidth_reduces_at_most_its_share() -> None:
    """Trust I's F4: a member (the library's own peer) announcing ``bandwidth=1e30`` became the
    reducer of the whole vector, so the honest peers' ``clip_norm`` never applied: every
    honest value became the attacker's choice. It now reduces at most ``MAX_SHARE`` (2) even
    shares, half the vector in a group of 4; elsewhere its values are clipped by the honest
    reducers."""

    async def main() -> list[np.ndarray[Any, Any]]:
        async with AsyncExitStack() as stack:
            swarm = _Swarm(stack)
            for i in range(4):
                attacker = i == 3
                await swarm.add(
                    [torch.full((1000,), 1e6 if attacker else 0.0)],
                    bandwidth=1e30 if attacker else 1e6,
                    clip_norm=None if attacker else 10.0,
                )
            outcomes, _ = await _steps(swarm.averagers, timeout=30)
            assert all(isinstance(o, StepResult) and o.group_size == 4 for o in outcomes)
            return [_values(a)[0] for a in swarm.averagers[:3]]

    for values in run_on_virtual_time(main):
        set_by_attacker = values > 1.0
        assert set_by_attacker.sum() == 500  # (its span: the mean of 1e6 and three zeros)
        np.testing.assert_array_equal(values[set_by_attacker], 250_000.0)
        # (the honest spans: its contribution clipped to an L2 norm of 10 over the vector)
        assert np.abs(values[~set_by_attacker]).max() <= 10 / 4


def test_another_identity_cannot_withdraw_or_expire_a_peers_declaration() -> None:
    """Trust I's F5: declarations were stored under the bare PeerID, unsigned; another
    identity overwrote them with ``looking: False`` and a 1 h expiry, and 12 of 12 honest
    steps failed. They are now owner records, signed: the forger cannot write under the
    owner's subkey at all, and what it writes under the bare PeerID is not read."""

    async def main() -> list[StepResult | BaseException]:
        async with _swarm(2, target_group_size=2) as swarm:
            attacker = await swarm.add([torch.zeros(3)], prefix="elsewhere")
            forged = {"schema": b"x" * 32, "looking": False, "addresses": [], "begin": 0.0}
            outcomes: list[StepResult | BaseException] = []
            for _ in range(3):
                for victim in swarm.averagers[:2]:
                    peer = victim.dht.peer_id
                    expiration = get_dht_time() + 3600
                    assert await attacker.dht.store("run.0b", forged, expiration, peer.to_bytes())
                    with pytest.raises(ValueError, match="names another peer as its owner"):
                        await attacker.dht.store("run.0b", forged, expiration, owner_marker(peer))
                steps, _ = await _steps(swarm.averagers[:2], timeout=30)
                outcomes += steps
            return outcomes

    for outcome in run_on_virtual_time(main):
        assert isinstance(outcome, StepResult), outcome
        assert outcome.group_size == 2
