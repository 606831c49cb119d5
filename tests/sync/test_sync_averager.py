"""``swarmavg.DecentralizedAverager``: the sync facade, three peers over TCP in one process."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import pytest
import torch

from swarmavg import DHT, AveragingStage, DecentralizedAverager, StepHandle
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


def _wait_for_stage(handles: list[StepHandle], stage: AveragingStage) -> None:
    deadline = time.monotonic() + 20
    while not all(h.stage is stage for h in handles):
        assert time.monotonic() < deadline, [h.stage for h in handles]
        time.sleep(0.02)


def test_step_handles_wait_for_the_trigger_take_new_weights_and_cancel() -> None:
    tensors = [[torch.full((100,), float(i))] for i in range(3)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        dhts = [first] + [stack.enter_context(DHT(first.get_visible_maddrs())) for _ in range(2)]
        averagers = [
            stack.enter_context(
                DecentralizedAverager(
                    own, dht, prefix="trigger", target_group_size=3, allreduce_timeout=30
                )
            )
            for own, dht in zip(tensors, dhts, strict=True)
        ]
        handles = [a.step(wait=False, require_trigger=True, timeout=20) for a in averagers]
        assert all(isinstance(h, StepHandle) and h.require_trigger for h in handles)
        _wait_for_stage(handles, AveragingStage.AWAITING_TRIGGER)
        handles[0].weight = 3.0
        handles[1].weight = 1.0
        handles[2].weight = 0.0
        for handle in handles:
            handle.allow_allreduce()
        results = [h.result(timeout=30) for h in handles]
        for averager in averagers:
            with averager.get_tensors() as own:
                torch.testing.assert_close(own[0], torch.full((100,), 0.25))
        assert results[1].total_weight == 4.0
        assert all(h.stage is AveragingStage.FINISHED for h in handles)
        with pytest.raises(RuntimeError):
            handles[0].weight = 1.0

        # a peer that cancels in its group: the others learn it at once
        handles = [a.step(wait=False, require_trigger=True, timeout=20) for a in averagers]
        _wait_for_stage(handles, AveragingStage.AWAITING_TRIGGER)
        handles[0].allow_allreduce()
        handles[1].allow_allreduce()
        time.sleep(0.2)
        started = time.monotonic()
        assert handles[2].cancel()
        for handle in handles[:2]:  # they go on without it, at once
            assert handle.result(timeout=10).group_size == 3
        assert time.monotonic() - started < 5  # not the 30 s all-reduce timeout
        assert handles[2].cancelled()
        with pytest.raises(ValueError, match="require_trigger"):
            averagers[0].step(require_trigger=True)


def test_shutdown_right_after_a_cancelled_step_is_prompt() -> None:
    """Ctrl+C in a training script cancels its step and shuts the averager down: the
    shutdown waits for the cancelled step to end (it withdraws, tells its group), not for a
    timeout (it waited 2 s for a step the facade ran, while its group waited for it)."""
    with ExitStack() as stack:
        dht = stack.enter_context(DHT(host="127.0.0.1"))
        averager = DecentralizedAverager([torch.zeros(10)], dht, prefix="quit", target_group_size=2)
        handle = averager.step(wait=False, timeout=15)
        deadline = time.monotonic() + 10
        while handle.stage is not AveragingStage.LOOKING_FOR_GROUP and time.monotonic() < deadline:
            time.sleep(0.005)
        handle.cancel()
        started = time.monotonic()
        averager.shutdown()
        took = time.monotonic() - started
    assert took < 1.0, took


def test_the_expected_group_size_reaches_the_matchmaker_and_is_checked() -> None:
    with ExitStack() as stack:
        dht = stack.enter_context(DHT(host="127.0.0.1"))
        averager = stack.enter_context(
            DecentralizedAverager([torch.zeros(3)], dht, prefix="expect", target_group_size=4)
        )
        assert averager.expected_group_size is None
        averager.expected_group_size = 3
        assert averager.expected_group_size == 3
        assert averager._averager.matchmaker.expected_group_size == 3  # type: ignore[attr-defined]
        averager.expected_group_size = None
        assert averager.expected_group_size is None
        for bad in (0, -1, True, 2.5):
            with pytest.raises(ValueError, match="expected_group_size"):
                averager.expected_group_size = bad  # type: ignore[assignment]


def test_shutdown_waits_at_most_shutdown_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """hivemind's ``shutdown_timeout``: a closing that hangs is cancelled after it, with one
    WARNING; ``daemon`` is accepted (no process of its own). Bad values are named."""
    import anyio

    from swarmavg.sync import run_sync

    with DHT(host="127.0.0.1") as dht:
        for bad, error in ((0, ValueError), ("5", TypeError), (True, TypeError)):
            with pytest.raises(error, match="shutdown_timeout"):
                DecentralizedAverager(
                    [torch.zeros(3)], dht, prefix="bad", target_group_size=2, shutdown_timeout=bad
                )
        with pytest.raises(TypeError, match="daemon"):
            DecentralizedAverager(
                [torch.zeros(3)], dht, prefix="bad", target_group_size=2, daemon=1
            )  # type: ignore[arg-type]
        averager = DecentralizedAverager(
            [torch.zeros(3)],
            dht,
            prefix="slow",
            target_group_size=2,
            shutdown_timeout=0.5,
            daemon=False,
        )
        real_aclose = averager._averager.aclose

        async def stuck() -> None:
            await anyio.sleep(60)

        averager._averager.aclose = stuck  # type: ignore[method-assign]
        started = time.monotonic()
        averager.shutdown()
        assert time.monotonic() - started < 30  # (not the 60 s of the stuck closing)
        run_sync(real_aclose)
    assert any(
        "shutdown_timeout=0.5" in r.message and r.levelname == "WARNING" for r in caplog.records
    )


def test_the_measured_bandwidth_is_read_through_the_facade() -> None:
    # 8 MiB each (a round must move 4 MiB each way to say something); the second peer is
    # given bandwidth=5.0 and measures nothing
    tensors = [[torch.full((2 << 20,), float(i))] for i in range(2)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        second = stack.enter_context(DHT(first.get_visible_maddrs()))
        averagers = [
            stack.enter_context(
                DecentralizedAverager(own, dht, prefix="measured", target_group_size=2, **given)
            )
            for own, dht, given in zip(
                tensors, [first, second], [{}, {"bandwidth": 5.0}], strict=True
            )
        ]
        assert [a.measured_bandwidth for a in averagers] == [None, None]
        handles = [a.step(wait=False, timeout=20) for a in averagers]
        for handle in handles:
            handle.result(timeout=30)
        measured, given = (a.measured_bandwidth for a in averagers)
        assert isinstance(measured, float)
        assert measured > 0
        assert given is None
