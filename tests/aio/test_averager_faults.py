"""Averagers under failure, many in one process on the memory transport and virtual time:
a peer that leaves or dies costs the others a moment, not an expiration; a peer with NaN
values is refused at once and one that sends them anyway is left out of later groups; every
step keeps its deadline; errors say why."""

from __future__ import annotations

import contextlib
import logging
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
from swarmavg.testing import MemoryNetwork, run_on_virtual_time


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
        await self.stacks[index].aclose()

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


def _values(averager: DecentralizedAverager) -> list[np.ndarray[Any, Any]]:
    with averager.get_tensors() as tensors:
        return [t.numpy().copy() for t in tensors]


def _agree(averagers: Sequence[DecentralizedAverager]) -> bool:
    first = _values(averagers[0])
    return all(
        all(np.array_equal(a, b) for a, b in zip(first, _values(other), strict=True))
        for other in averagers[1:]
    )


@pytest.mark.parametrize("how", ["leave", "kill"])
def test_after_one_of_four_peers_is_gone_the_others_step_at_once(how: str) -> None:
    """A new user's scenario: four peers with target_group_size=4 average round after round;
    one leaves (Ctrl+C) or dies between rounds. The others' next steps form a group of three
    at once, not after averaging_expiration (15 s)."""

    async def main() -> tuple[list[float], list[list[int]], bool]:
        async with _swarm(4) as swarm:
            sizes = []
            durations = []
            for round_ in range(5):
                if round_ == 2:
                    await (swarm.leave(3) if how == "leave" else swarm.kill(3))
                live = swarm.averagers[:4] if round_ < 2 else swarm.averagers[:3]
                outcomes, took = await _steps(live, timeout=30)
                assert all(isinstance(o, StepResult) for o in outcomes), outcomes
                sizes.append([o.group_size for o in outcomes if isinstance(o, StepResult)])
                durations.append(max(took))
            return durations, sizes, _agree(swarm.averagers[:3])

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
        list[StepResult | BaseException], list[StepResult | BaseException], bool
    ]:
        async with _swarm(4) as swarm:
            bad = swarm.averagers[3]
            with bad.get_tensors() as tensors:
                tensors[0][::3] = float("nan")

            async def no_check() -> None:
                return None

            bad._check_finite = no_check  # type: ignore[method-assign]
            bad.allreduce._finite = lambda buffers: True  # type: ignore[union-attr,method-assign]
            first, _ = await _steps(swarm.averagers, timeout=30)
            second, _ = await _steps(swarm.averagers, timeout=5)
            return first, second, _agree(swarm.averagers[:3])

    with caplog.at_level(logging.WARNING):
        first, second, agree = run_on_virtual_time(main)
    for outcome in first[:3]:
        assert isinstance(outcome, StepResult), outcome
        assert outcome.incomplete  # (its values were left out)
    assert agree
    assert any(
        "sent non-finite values; left out of our groups" in r.message for r in caplog.records
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
