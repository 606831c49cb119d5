"""The suite's ``anyio_backend`` (tests/conftest.py): anyio tests run on virtual time, and
those of the other tiers on asyncio's own loop."""

from __future__ import annotations

import asyncio
import time

import anyio
import anyio.to_thread
import pytest

from swarmavg.testing import VirtualClockLoop

pytestmark = pytest.mark.anyio


async def test_an_unmarked_test_runs_on_virtual_time() -> None:
    assert isinstance(asyncio.get_running_loop(), VirtualClockLoop)
    real = time.monotonic()
    started = anyio.current_time()
    with anyio.move_on_after(3600):
        await anyio.sleep_forever()
    assert anyio.current_time() - started == pytest.approx(3600, abs=1e-3)
    assert time.monotonic() - real < 1


async def test_the_clock_stands_still_while_a_worker_thread_runs() -> None:
    """The loop watches anyio's default thread limiter (as ``run_on_virtual_time``'s does):
    a timer due meanwhile does not fire while the thread works."""
    fired = anyio.Event()

    async def timer() -> None:
        await anyio.sleep(1)
        fired.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(timer)
        started = anyio.current_time()
        await anyio.to_thread.run_sync(time.sleep, 0.05)
        assert anyio.current_time() - started < 0.01
        assert not fired.is_set()
        await fired.wait()
    assert anyio.current_time() - started == pytest.approx(1, abs=1e-3)


@pytest.mark.parametrize(
    "tier",
    [pytest.param(t, marks=getattr(pytest.mark, t)) for t in ("realtime", "process", "lab")],
)
async def test_a_test_of_another_tier_runs_on_the_wall_clock(tier: str) -> None:
    """(processes and the lab's hosts run on the wall clock: a virtual one would jump past
    their answers)"""
    assert not isinstance(asyncio.get_running_loop(), VirtualClockLoop)
    # (asyncio's clock is the monotonic clock)
    assert anyio.current_time() == pytest.approx(time.monotonic(), abs=0.5)
