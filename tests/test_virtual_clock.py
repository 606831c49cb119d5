"""``swarmavg.testing.VirtualClockLoop``: the clock jumps over idle time, busy polling and a
cancelled task's timed clean-up still get to their deadlines, DHT time follows, and real
averagers run their timeouts on it (a minute of waiting costs no real time)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

from swarmavg import get_dht_time
from swarmavg.aio import DHT
from swarmavg.aio.averager import DecentralizedAverager, MatchmakingFailed
from swarmavg.testing import MemoryNetwork, VirtualClockLoop, _clock, run_on_virtual_time


def test_an_hour_of_sleep_costs_no_real_time_and_dht_time_follows() -> None:
    async def main() -> tuple[float, float, float]:
        assert isinstance(asyncio.get_running_loop(), VirtualClockLoop)
        clock, dht = anyio.current_time(), get_dht_time()
        await anyio.sleep(3600)
        with anyio.move_on_after(60):
            await anyio.sleep_forever()
        return anyio.current_time() - clock, get_dht_time() - dht, time.time()

    started = time.monotonic()
    slept, dht_slept, wall = run_on_virtual_time(main)
    assert time.monotonic() - started < 5
    assert slept == pytest.approx(3660, abs=1e-3)
    assert dht_slept == pytest.approx(3660, abs=1e-3)
    assert abs(get_dht_time() - wall) < 5  # outside the loop: the wall clock again


def test_the_clock_starts_where_asked() -> None:
    async def now() -> float:
        return anyio.current_time()

    assert run_on_virtual_time(now, start=1000.0) == pytest.approx(1000.0, abs=1e-3)


def test_busy_polling_gets_to_its_deadline() -> None:
    async def main() -> int:
        deadline = anyio.current_time() + 0.01
        spins = 0
        while anyio.current_time() < deadline:  # (a loop that never waits for a timer)
            await anyio.lowlevel.checkpoint()
            spins += 1
        return spins

    real = time.monotonic()
    spins = run_on_virtual_time(main)
    assert time.monotonic() - real < 10
    assert 0 < spins <= 10_001  # (a microsecond a cycle)


def test_a_cancelled_task_in_a_timed_shielded_clean_up_lets_the_clock_move() -> None:
    """anyio re-delivers a cancellation every cycle until the task leaves the scope; a task
    that first cleans up (shielded, for at most 2 s) would hold the clock still forever."""

    async def main() -> float:
        started = anyio.current_time()

        async def worker() -> None:
            try:
                await anyio.sleep(100)
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await anyio.Event().wait()  # (nothing sets it)

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)
            await anyio.sleep(1)
            tg.cancel_scope.cancel()
        return anyio.current_time() - started

    real = time.monotonic()
    took = run_on_virtual_time(main)
    assert time.monotonic() - real < 10
    assert 3 <= took < 10


async def _in_a_thread() -> None:
    await anyio.to_thread.run_sync(time.sleep, 0.05)  # (real time, the GIL let go)


async def _ticking_while(*works: Callable[[], Awaitable[None]]) -> tuple[list[float], int]:
    """Run ``works`` one after the other, half a virtual second in, beside a task that ticks
    every virtual second: the virtual seconds each took, and the ticks meanwhile."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(1)
            ticks += 1

    took = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.5)
        for work in works:
            started = anyio.current_time()
            await work()
            took.append(anyio.current_time() - started)
        tg.cancel_scope.cancel()
    return took, ticks


def test_work_in_a_worker_thread_takes_no_virtual_time() -> None:
    """A thread that computes for the loop (here it sleeps 50 ms of real time, freeing the
    GIL as hashing and torch do) holds the clock as the loop's own work would: the task that
    ticks every virtual second meanwhile does not tick. (Without it, a state snapshot in a
    thread let the joiners' minute-long timeouts run out: the accumulator's tests under older
    dependencies.)"""

    async def main() -> tuple[float, float, int]:
        async def in_executor() -> None:
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0.05)

        (in_thread, executor), ticks = await _ticking_while(_in_a_thread, in_executor)
        return in_thread, executor, ticks

    in_thread, in_executor, ticks = run_on_virtual_time(main)
    assert in_thread < 0.01
    assert in_executor < 0.01
    assert ticks == 0


def test_a_worker_thread_that_waits_for_the_clock_holds_it_only_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread that waits for a timer of the loop (``from_thread.run(anyio.sleep, 5)``)
    would hold the clock forever: past ``_THREAD_HOLD`` real seconds the clock moves on."""
    monkeypatch.setattr(_clock, "_THREAD_HOLD", 0.1)

    async def main() -> float:
        started = anyio.current_time()
        await anyio.to_thread.run_sync(anyio.from_thread.run, anyio.sleep, 5)
        return anyio.current_time() - started

    real = time.monotonic()
    took = run_on_virtual_time(main)
    assert time.monotonic() - real < 10
    assert took == pytest.approx(5, abs=0.01)


@pytest.mark.slow
def test_averagers_wait_out_long_timeouts_on_virtual_time() -> None:
    """Three peers want groups of four (averaging_expiration 60 s): nobody else looks under
    their key, so they average as a group of three at once instead of waiting out the
    expiration; a peer alone fails after its 300 s timeout. All of it in much less real
    time."""

    async def main() -> tuple[float, float, list[int], list[list[float]]]:
        network = MemoryNetwork()
        async with AsyncExitStack() as stack:
            dhts: list[DHT] = []
            averagers = []
            for i in range(4):
                seeds = [a for d in dhts[:1] for a in d.get_visible_maddrs()]
                dht = await stack.enter_async_context(
                    DHT(seeds, transport="memory", transport_options={"network": network})
                )
                dhts.append(dht)
                tensor = torch.full((5,), float(i))
                averagers.append(
                    await stack.enter_async_context(
                        DecentralizedAverager(
                            [tensor],
                            dht,
                            prefix="group" if i < 3 else "alone",
                            target_group_size=4,
                            averaging_expiration=60.0,
                        )
                    )
                )
            sizes: list[int] = []
            started = anyio.current_time()

            async def step(i: int) -> None:
                sizes.append((await averagers[i].step(timeout=120)).group_size)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(step, i)
            grouped = anyio.current_time() - started
            started = anyio.current_time()
            with pytest.raises(MatchmakingFailed):
                await averagers[3].step(timeout=300)
            alone = anyio.current_time() - started
            values = []
            for averager in averagers:
                with averager.get_tensors() as own:
                    values.append(own[0].tolist())
            return grouped, alone, sizes, values

    real = time.monotonic()
    grouped, alone, sizes, values = run_on_virtual_time(main)
    assert time.monotonic() - real < 60
    assert sizes == [3, 3, 3]
    assert grouped < 1  # two reads of the key showed nobody else: no fourth peer is coming
    assert alone >= 300
    assert values[:3] == [[1.0] * 5] * 3  # the mean of 0, 1 and 2
    assert values[3] == [3.0] * 5


def test_peers_alone_under_different_keys_meet_within_one_step() -> None:
    """Two peers want pairs, under the keys "0" and "1": the first attempt (2 s) finds
    nobody; both look again under the prefix's own key and meet there, well within the step's
    timeout, and draw new bits for the next round."""

    async def main() -> tuple[list[int], list[list[float]], float]:
        network = MemoryNetwork()
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(
                DHT([], transport="memory", transport_options={"network": network})
            )
            second = await stack.enter_async_context(
                DHT(
                    first.get_visible_maddrs(),
                    transport="memory",
                    transport_options={"network": network},
                )
            )
            averagers = [
                await stack.enter_async_context(
                    DecentralizedAverager(
                        [torch.full((3,), float(i))],
                        dht,
                        prefix="meet",
                        target_group_size=2,
                        averaging_expiration=2.0,
                        initial_group_bits=str(i),
                    )
                )
                for i, dht in enumerate((first, second))
            ]
            sizes: list[int] = []

            async def step(averager: DecentralizedAverager) -> None:
                sizes.append((await averager.step(timeout=60)).group_size)

            started = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for averager in averagers:
                    tg.start_soon(step, averager)
            took = anyio.current_time() - started
            values = []
            for averager in averagers:
                with averager.get_tensors() as own:
                    values.append(own[0].tolist())
            return sizes, values, took

    sizes, values, took = run_on_virtual_time(main)
    assert sizes == [2, 2]
    assert values == [[0.5] * 3] * 2
    assert took < 10  # two attempts of 2 s, and a request timeout at most


@pytest.mark.parametrize("watch", [True, False])
def test_a_loop_made_to_watch_the_default_thread_limiter_holds_the_clock_by_itself(
    watch: bool,
) -> None:
    """``VirtualClockLoop(watch_default_thread_limiter=True)`` run by someone else (here
    asyncio's runner, as anyio's pytest plugin does) holds the clock for ``anyio.to_thread``
    work without being told the limiter from inside; without it the clock runs on meanwhile."""

    async def main() -> tuple[float, int]:
        (in_thread,), ticks = await _ticking_while(_in_a_thread)
        return in_thread, ticks

    def make_loop() -> VirtualClockLoop:
        return VirtualClockLoop(watch_default_thread_limiter=watch)

    with asyncio.Runner(loop_factory=make_loop) as runner:
        in_thread, ticks = runner.run(main())
    if watch:
        assert in_thread < 0.01
        assert ticks == 0
    else:
        assert in_thread >= 1
        assert ticks >= 1
