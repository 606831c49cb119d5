"""The averager's measured bandwidth: without ``bandwidth=`` it measures its throughput from
its rounds and announces it in matchmaking; an explicit ``bandwidth=`` always wins."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy.typing as npt
import pytest
import torch

from swarmavg.abc import AllReduceResult, AllReduceRunner, Group
from swarmavg.aio import DHT
from swarmavg.aio.allreduce import AllReduceService
from swarmavg.aio.averager import DecentralizedAverager
from swarmavg.proto.allreduce import FlatLayout
from swarmavg.testing import MemoryNetwork, run_on_virtual_time

pytestmark = pytest.mark.timeout(60)

#: each end's link rate in the tests (bytes/s of the memory transport)
RATE = 50e6


class _Recording(AllReduceRunner):
    """The node's all-reduce, keeping each round's group (what the members announced)."""

    paces = True

    def __init__(self, inner: AllReduceService) -> None:
        self.inner = inner
        self.groups: list[Group] = []
        self.upload_rates: list[float | None] = []
        self.part_sizes: list[int] = []

    async def run(
        self,
        group: Group,
        buffers: Sequence[npt.NDArray[Any]],
        layout: FlatLayout,
        **options: Any,
    ) -> AllReduceResult:
        self.groups.append(group)
        self.upload_rates.append(options.get("upload_rate"))
        self.part_sizes.append(options["config"].part_size)
        return await self.inner.run(group, buffers, layout, **options)

    def expect(self, group: Group) -> None:
        self.inner.expect(group)

    async def leave(self, group: Group, reason: str) -> None:
        await self.inner.leave(group, reason)


async def _pair(
    stack: AsyncExitStack, numel: int, bandwidths: Sequence[float | None]
) -> tuple[list[DecentralizedAverager], list[_Recording]]:
    """Two averagers of ``numel`` float32 values (0s and 1s), groups of 2, links of ``RATE``
    bytes/s each way; ``bandwidths`` their ``bandwidth=`` (``None``: not given)."""
    network = MemoryNetwork()
    dhts: list[DHT] = []
    for _ in range(2):
        seeds = [a for d in dhts for a in d.get_visible_maddrs()]
        options = {"network": network, "bandwidth": RATE}
        dht = DHT(seeds, transport="memory", transport_options=options)
        dhts.append(await stack.enter_async_context(dht))
    runners = [_Recording(AllReduceService.for_node(d.node)) for d in dhts]
    averagers = []
    for i, (dht, runner, bandwidth) in enumerate(zip(dhts, runners, bandwidths, strict=True)):
        given = {} if bandwidth is None else {"bandwidth": bandwidth}
        averager = DecentralizedAverager(
            [torch.full((numel,), float(i))],
            dht,
            prefix="bw",
            target_group_size=2,
            averaging_expiration=1.0,
            allreduce=runner,
            **given,
        )
        averagers.append(await stack.enter_async_context(averager))
    return averagers, runners


async def _step_both(averagers: Sequence[DecentralizedAverager]) -> None:
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for averager in averagers:
                tg.start_soon(averager.step)


def _announced(runner: _Recording) -> list[float | None]:
    """The bandwidths the members of the last round's group announced, in peer order."""
    members = sorted(runner.groups[-1].members, key=lambda m: m.peer_id.to_bytes())
    return [m.bandwidth for m in members]


def test_a_measured_bandwidth_is_announced_after_a_round(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "swarmavg.aio.averager")

    async def main() -> tuple[list[list[float | None]], list[list[float | None]]]:
        async with AsyncExitStack() as stack:
            # 8 MiB each: each peer receives 8 MiB (the other's half, then its half's mean)
            averagers, runners = await _pair(stack, 2 << 20, [None, None])
            averagers.sort(key=lambda a: a.dht.peer_id.to_bytes())  # (as _announced)
            measured = [[a.measured_bandwidth for a in averagers]]
            announced = []
            for _ in range(2):
                await _step_both(averagers)
                announced.append(_announced(runners[0]))
                assert _announced(runners[1]) == announced[-1]
                measured.append([a.measured_bandwidth for a in averagers])
            for averager in averagers:
                with averager.get_tensors() as got:
                    assert torch.equal(got[0], torch.full((2 << 20,), 0.5))
            for index, averager in enumerate(averagers):
                runner = averager.allreduce
                assert isinstance(runner, _Recording)
                assert runner.upload_rates[0] is None
                assert runner.upload_rates[1] == measured[1][index]
            return announced, measured

    announced, measured = run_on_virtual_time(main)
    # the first round: nothing measured yet ("unknown"); the second: what each measured in
    # the first (also the upload rate its connections are paced by)
    assert measured[0] == [None, None]
    assert announced[0] == [None, None]
    assert announced[1] == measured[1]
    # each direction of a link carries RATE bytes/s (both peers' traffic shares it)
    for value in measured[1] + measured[2]:
        assert value == pytest.approx(RATE, rel=0.01)
    # one line per peer when first measured (the second round changed it by far less than 2x)
    lines = [r.getMessage() for r in caplog.records if "measured bandwidth" in r.getMessage()]
    assert len(lines) == 2
    assert all(line.startswith("measured bandwidth 50 MB/s") for line in lines)


def test_an_explicit_bandwidth_is_not_overridden() -> None:
    async def main() -> tuple[list[float | None], list[float | None]]:
        async with AsyncExitStack() as stack:
            averagers, runners = await _pair(stack, 2 << 20, [3.0, None])
            order = sorted(range(2), key=lambda i: averagers[i].dht.peer_id.to_bytes())
            for _ in range(2):
                await _step_both(averagers)
            announced = _announced(runners[0])
            # back in the order made: the first was given bandwidth=3.0
            return [announced[order.index(i)] for i in range(2)], [
                a.measured_bandwidth for a in averagers
            ]

    announced, measured = run_on_virtual_time(main)
    # the peer given bandwidth=3.0 announces it and measures nothing; the other measures
    assert announced == [3.0, pytest.approx(RATE, rel=0.01)]
    assert measured == [None, pytest.approx(RATE, rel=0.01)]


@pytest.mark.parametrize(
    ("bandwidths", "elements"),
    [
        ((None, None), 1 << 19),  # nothing known: a quarter of a span (2 MiB)
        ((40e6, 40e6), 1 << 19),  # 40 MB/s: a part to the other in 0.4 s is 16 MB, no less
        ((2e6, 2e6), 1 << 17),  # 2 MB/s: 0.8 MB in 0.4 s -> 512 KiB
        ((2e6, 3.0), 1 << 17),  # (3.0 is a ratio: says nothing about time)
        ((0.25e6, 8e6), 1 << 16),  # the slowest's 0.1 MB in 0.4 s, but no less than 256 KiB
    ],
)
def test_the_part_size_follows_the_slowest_announced_rate(
    bandwidths: tuple[float | None, float | None], elements: int
) -> None:
    """Parts are a quarter of a span (1 to 16 MiB), smaller on slow links: what the slowest
    member sends to all the others in about 0.4 s, a power of two, at least 256 KiB; both
    members use the same."""

    async def main() -> list[list[int]]:
        async with AsyncExitStack() as stack:
            averagers, runners = await _pair(stack, 4 << 20, list(bandwidths))
            await _step_both(averagers)
            return [runner.part_sizes for runner in runners]

    assert run_on_virtual_time(main) == [[elements], [elements]]


def test_a_part_is_never_a_large_message() -> None:
    """A quarter of a span of 64 MiB between two is 8 MiB: parts stay at 4 MiB, under half of
    a connection's stream window, so that two members never wait on each other's large
    messages (see ``_MAX_PART_BYTES``)."""

    async def main() -> list[list[int]]:
        async with AsyncExitStack() as stack:
            averagers, runners = await _pair(stack, 16 << 20, [None, None])
            await _step_both(averagers)
            return [runner.part_sizes for runner in runners]

    assert run_on_virtual_time(main) == [[1 << 20], [1 << 20]]


def test_small_rounds_measure_nothing() -> None:
    async def main() -> tuple[list[float | None], list[float | None]]:
        async with AsyncExitStack() as stack:
            # 4 KiB each: far under the 4 MiB a round must move to say something
            averagers, runners = await _pair(stack, 1024, [None, None])
            for _ in range(2):
                await _step_both(averagers)
            return _announced(runners[0]), [a.measured_bandwidth for a in averagers]

    announced, measured = run_on_virtual_time(main)
    assert announced == [None, None]
    assert measured == [None, None]


class _Bursty(_Recording):
    """As :class:`_Recording`, but each round's application-level logs say every byte went
    and came within one millisecond at its end (what a socket buffer filled at once, or read
    at once after the event loop was busy, looks like from above the transport)."""

    async def run(
        self,
        group: Group,
        buffers: Sequence[npt.NDArray[Any]],
        layout: FlatLayout,
        **options: Any,
    ) -> AllReduceResult:
        result = await super().run(group, buffers, layout, **options)
        end = anyio.current_time()
        for log in (result.sent_log, result.received_log):
            total = sum(nbytes for _, nbytes in log)
            log[:] = [(end - 0.001, total // 2), (end, total - total // 2)]
        return result


def test_the_bytes_on_the_wire_are_measured_not_the_handovers() -> None:
    """Where the transport counts what crossed the network (``Connection.traffic``), the
    averager measures from that: application-level bursts (here every byte within 1 ms) do
    not make a peer look faster than its link. On TCP such bursts made 4 peers on one 100
    Mbit/s lab measure 7.8-17.2 MB/s, and the uneven split that followed doubled the round."""

    async def main() -> tuple[list[float | None], int]:
        async with AsyncExitStack() as stack:
            averagers, runners = await _pair(stack, 2 << 20, [None, None])
            bursty = [_Bursty(r.inner) for r in runners]
            for averager, runner in zip(averagers, bursty, strict=True):
                averager.allreduce = runner
            await _step_both(averagers)
            return [a.measured_bandwidth for a in averagers], len(bursty[0].groups)

    measured, rounds = run_on_virtual_time(main)
    assert rounds == 1  # (the bursty logs were what the averager got)
    for value in measured:
        assert value == pytest.approx(RATE, rel=0.01)


def test_one_round_in_eight_is_not_paced() -> None:
    """A paced round cannot measure more than its caps: every 8th round after the first
    measurement goes unpaced, and the pacing rate is the estimate or the last unpaced round's
    rate, whichever is higher (so a link that got faster is found)."""

    async def main() -> list[float | None]:
        async with AsyncExitStack() as stack:
            averagers, runners = await _pair(stack, 2 << 20, [None, None])
            for _ in range(10):
                await _step_both(averagers)
            return runners[0].upload_rates

    rates = run_on_virtual_time(main)
    assert rates[0] is None  # nothing measured yet
    assert rates[8] is None  # the probe
    paced = [r for i, r in enumerate(rates) if i not in (0, 8)]
    assert all(r == pytest.approx(RATE, rel=0.01) for r in paced)
