"""``swarmavg.DecentralizedAverager``: the sync facade, three peers over TCP in one process."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import torch

from swarmavg import DHT, DecentralizedAverager
from swarmavg.aio.averager import StepResult
from swarmavg.sync import TaskHandle

pytestmark = pytest.mark.timeout(60)


def test_three_peers_step_without_waiting_and_get_the_mean() -> None:
    torch.manual_seed(1)
    tensors = [[torch.randn(1000), torch.randn(3, 3, dtype=torch.float64)] for _ in range(3)]
    expected = [sum(t[k] for t in tensors) / 3 for k in range(2)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        dhts = [first] + [stack.enter_context(DHT(first.get_visible_maddrs())) for _ in range(2)]
        averagers = [
            stack.enter_context(DecentralizedAverager(own, dht, prefix="sync", target_group_size=3))
            for own, dht in zip(tensors, dhts, strict=True)
        ]
        handles = [a.step(gather=i, wait=False, timeout=20) for i, a in enumerate(averagers)]
        assert all(isinstance(h, TaskHandle) for h in handles)
        results = [h.result(timeout=30) for h in handles]
        for averager in averagers:
            with averager.get_tensors() as own:
                torch.testing.assert_close(own[0], expected[0], atol=1e-5, rtol=0)
                torch.testing.assert_close(own[1], expected[1], atol=1e-12, rtol=0)
        assert all(isinstance(r, StepResult) and r.group_size == 3 for r in results)
        assert sorted(results[0].values()) == [0, 1, 2]


def test_blocking_steps_from_threads_and_shutdown() -> None:
    tensors = [[torch.full((10,), float(i))] for i in range(2)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        second = stack.enter_context(DHT(first.get_visible_maddrs()))
        averagers = [
            DecentralizedAverager(own, dht, prefix="threads", target_group_size=2)
            for own, dht in zip(tensors, [first, second], strict=True)
        ]
        results: list[StepResult | None] = [None, None]

        def run(i: int) -> None:
            results[i] = averagers[i].step(timeout=20)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(r is not None for r in results)
        for averager in averagers:
            with averager.get_tensors() as own:
                assert torch.equal(own[0], torch.full((10,), 0.5))
            averager.shutdown()
            averager.shutdown()  # idempotent
            with pytest.raises(RuntimeError, match="not running"):
                averager.step()
