"""``.metrics`` of the averagers and the Optimizer (swarmavg.metrics), and the Prometheus exporter.

The async averager's counts are checked on MemoryTransport peers on a virtual clock; the sync
facade and the Optimizer with real DHTs over TCP on 127.0.0.1 (threads of one process). Tests
that scrape the exporter need prometheus-client (the ``prometheus`` extra) and are skipped
without it.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F

import swarmavg
from swarmavg import DHT, AllReduceFailed, MatchmakingFailed, NonFiniteTensors
from swarmavg.abc import AllReduceRunner, Group
from swarmavg.aio import DHT as AsyncDHT
from swarmavg.aio.allreduce import AllReduceService
from swarmavg.aio.averager import DecentralizedAverager as AsyncAverager
from swarmavg.aio.averager import StepResult
from swarmavg.metrics import (
    GROUP_SIZE_BUCKETS,
    ROUND_FAULTS,
    STEP_FAILURE_CAUSES,
    AveragerCounter,
    AveragerMetrics,
    OptimizerCounter,
    OptimizerMetrics,
)
from swarmavg.proto.butterfly import Fault, Reason
from swarmavg.testing import MemoryNetwork, run_on_virtual_time

pytestmark = pytest.mark.timeout(60)


# -- the sans-IO counting -------------------------------------------------------------------------


def test_the_counter_counts_each_event_into_its_fields() -> None:
    counter = AveragerCounter("run")
    assert counter.snapshot() == AveragerMetrics(
        prefix="run",
        group_size_histogram=tuple((b, 0) for b in GROUP_SIZE_BUCKETS),
        faults=tuple((fault, 0) for fault in ROUND_FAULTS),
    )
    counter.step_started()
    counter.group_search_ended(0.5, failed=True)
    counter.group_search_ended(1.5, failed=False)
    counter.round_started(3)
    counter.round_completed(
        2.0,
        bytes_sent=100,
        bytes_received=90,
        incomplete=True,
        peers_excluded=1,
        faults=[
            Reason(Fault.SILENT, "it sent nothing for 3 s"),
            "untyped",
            Reason(Fault.SILENT, ""),
        ],
    )
    counter.step_succeeded()
    for cause in STEP_FAILURE_CAUSES:
        counter.step_started()
        counter.step_failed(cause)
    counter.step_started()
    counter.round_started(100)  # (above every bound: only in the +Inf bucket)
    counter.round_ended_without_result(0.25, failed=True)
    counter.state_download_started()
    counter.state_download_ended(4096)
    counter.state_download_started()
    counter.state_download_ended(None)
    with pytest.raises(ValueError, match="cause must be one of"):
        counter.step_failed("bad luck")

    m = counter.snapshot(state_requests_served=2, state_bytes_served=512)
    assert (m.steps_started, m.steps_succeeded, m.steps_failed, m.steps_in_progress) == (7, 1, 5, 1)
    assert m.failures() == dict.fromkeys(STEP_FAILURE_CAUSES, 1)
    assert (m.matchmaking_failures, m.matchmaking_seconds) == (1, 2.0)
    assert (m.rounds_started, m.rounds_completed, m.rounds_incomplete, m.rounds_failed) == (
        2,
        1,
        1,
        1,
    )
    assert (m.bytes_sent, m.bytes_received, m.allreduce_seconds, m.peers_excluded) == (
        100,
        90,
        2.25,
        1,
    )
    assert (m.last_group_size, m.group_size_sum) == (100, 103)
    histogram = dict(m.group_size_histogram)
    assert list(histogram) == list(GROUP_SIZE_BUCKETS)
    assert (histogram[2], histogram[3], histogram[64]) == (0, 1, 1)  # cumulative
    assert (m.state_downloads_started, m.state_downloads_succeeded) == (2, 1)
    assert (m.state_downloads_failed, m.state_bytes_downloaded) == (1, 4096)
    assert (m.state_requests_served, m.state_bytes_served) == (2, 512)

    assert m.fault_counts() == {**dict.fromkeys(ROUND_FAULTS, 0), "silent": 2, "other": 1}

    plain = m.as_dict()
    assert plain["group_size_histogram"] == histogram
    assert plain["faults"] == m.fault_counts()
    assert plain["steps_cancelled"] == 1
    assert plain["prefix"] == "run"
    plain_values = {
        type(v) for k, v in plain.items() if k not in ("group_size_histogram", "faults")
    }
    assert plain_values <= {str, int, float}
    with pytest.raises(AttributeError):
        m.steps_started = 0  # type: ignore[misc]  # (a frozen snapshot)


def test_a_snapshot_taken_while_another_thread_counts_is_consistent() -> None:
    """Each round adds the same number of bytes sent and received: a snapshot that caught an
    update halfway would show them differ."""
    counter = AveragerCounter("run")
    done = threading.Event()

    def count() -> None:
        for _ in range(20_000):
            counter.round_completed(
                0.0, bytes_sent=1, bytes_received=1, incomplete=False, peers_excluded=0
            )
        done.set()

    writer = threading.Thread(target=count)
    writer.start()
    seen = 0
    try:
        while not done.is_set() and seen < 200_000:
            m = counter.snapshot()
            assert m.bytes_sent == m.bytes_received == m.rounds_completed
            seen += 1
    finally:
        writer.join(10)
    assert counter.snapshot().rounds_completed == 20_000


def test_the_optimizer_counter_and_its_snapshot() -> None:
    counter = OptimizerCounter("run")
    for _ in range(3):
        counter.epoch_ended()
    counter.gradients_averaged()
    counter.stepped_locally("alone")
    counter.stepped_locally("failed")
    counter.state_loaded(ok=True)
    counter.state_loaded(ok=False)
    with pytest.raises(ValueError, match="reason must be one of"):
        counter.stepped_locally("tired")
    grads = AveragerMetrics(prefix="run_grad_averager", bytes_sent=10, bytes_received=7)
    state = AveragerMetrics(prefix="run_state_averager", bytes_sent=5, bytes_received=3)
    m = counter.snapshot(local_epoch=3, gradients=grads, state=state)
    assert (m.epochs, m.epochs_averaged, m.epochs_local, m.local_epoch) == (3, 1, 2, 3)
    assert m.local_epochs_by_reason() == {"alone": 1, "not_started": 0, "failed": 1}
    assert (m.state_loads, m.state_load_failures) == (1, 1)
    assert (m.bytes_sent, m.bytes_received) == (15, 10)
    plain = m.as_dict()
    assert plain["gradients"]["bytes_sent"] == 10
    assert plain["state"]["prefix"] == "run_state_averager"
    alone = counter.snapshot(local_epoch=3, gradients=None, state=state)
    assert alone.bytes_sent == 5
    assert alone.as_dict()["gradients"] is None


# -- the async averager (MemoryTransport, virtual time) -------------------------------------------


@asynccontextmanager
async def _peers(tensors: list[list[torch.Tensor]], **options: Any) -> AsyncIterator[list[Any]]:
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        dhts: list[AsyncDHT] = []
        made = []
        for own in tensors:
            seeds = [a for d in dhts[:2] for a in d.get_visible_maddrs()]
            dht = await stack.enter_async_context(
                AsyncDHT(seeds, transport="memory", transport_options={"network": network})
            )
            dhts.append(dht)
            options = {"prefix": "m", "target_group_size": len(tensors), **options}
            made.append(await stack.enter_async_context(AsyncAverager(own, dht, **options)))
        yield made


async def _step_all(averagers: list[AsyncAverager], **kwargs: Any) -> list[StepResult]:
    results: list[StepResult] = []

    async def one(averager: AsyncAverager) -> None:
        results.append(await averager.step(**kwargs))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for averager in averagers:
                tg.start_soon(one, averager)
    return results


def test_successful_rounds_are_counted_with_their_groups_bytes_and_times() -> None:
    async def main() -> tuple[list[AveragerMetrics], list[list[StepResult]]]:
        tensors = [[torch.full((1000,), float(i))] for i in range(3)]
        async with _peers(tensors) as averagers:
            results = [await _step_all(averagers, timeout=30) for _ in range(2)]
            return [a.metrics for a in averagers], results

    metrics, results = run_on_virtual_time(main)
    sent = sum(r.bytes_sent for step in results for r in step)
    assert sum(m.bytes_sent for m in metrics) == sent > 0
    assert sum(m.bytes_received for m in metrics) == sum(
        r.bytes_received for step in results for r in step
    )
    for m in metrics:
        assert (m.steps_started, m.steps_succeeded, m.steps_failed) == (2, 2, 0)
        assert (m.rounds_started, m.rounds_completed, m.rounds_failed) == (2, 2, 0)
        assert (m.rounds_incomplete, m.matchmaking_failures, m.peers_excluded) == (0, 0, 0)
        assert (m.last_group_size, m.group_size_sum) == (3, 6)
        assert dict(m.group_size_histogram)[2] == 0
        assert dict(m.group_size_histogram)[3] == 2
        assert m.matchmaking_seconds >= 0
        assert m.allreduce_seconds >= 0
        assert m.prefix == "m"
    total_seconds = sum(r.matchmaking_seconds + r.allreduce_seconds for s in results for r in s)
    assert sum(m.matchmaking_seconds + m.allreduce_seconds for m in metrics) == pytest.approx(
        total_seconds
    )


def test_failed_and_cancelled_steps_are_counted_by_cause() -> None:
    async def main() -> AveragerMetrics:
        async with _peers([[torch.zeros(3)]], target_group_size=2) as (lonely,):
            with pytest.raises(MatchmakingFailed):
                await lonely.step(timeout=0.5, allow_retries=False)
            control = await lonely.step(wait=False, timeout=30)
            await anyio.wait_all_tasks_blocked()  # (it is looking for a group)
            assert control.cancel()
            with pytest.raises(concurrent.futures.CancelledError):
                await control
            with lonely.get_tensors() as tensors:
                tensors[0][1] = float("nan")
            with pytest.raises(NonFiniteTensors):
                await lonely.step(timeout=1)
            return lonely.metrics

    m = run_on_virtual_time(main)
    assert m.steps_started == 3
    assert m.failures() == {
        "matchmaking": 1,
        "allreduce": 0,
        "nonfinite": 1,
        "cancelled": 1,
        "other": 0,
    }
    assert m.matchmaking_failures == 1  # (the cancelled search is no failure)
    assert m.rounds_started == m.last_group_size == 0
    assert m.matchmaking_seconds >= 0.5


class _FailsAlways(AllReduceRunner):
    """The node's all-reduce, but every round fails."""

    def __init__(self, inner: AllReduceRunner) -> None:
        self.inner = inner

    async def run(self, group: Group, buffers: Any, layout: Any, **options: Any) -> Any:
        raise AllReduceFailed("injected: the round fell apart")


def test_a_failed_all_reduce_is_counted_as_a_failed_round_and_step() -> None:
    async def main() -> list[AveragerMetrics]:
        network = MemoryNetwork()
        async with AsyncExitStack() as stack:
            dhts: list[AsyncDHT] = []
            averagers = []
            for i in range(2):
                seeds = [a for d in dhts for a in d.get_visible_maddrs()]
                dht = await stack.enter_async_context(
                    AsyncDHT(seeds, transport="memory", transport_options={"network": network})
                )
                dhts.append(dht)
                averager = AsyncAverager(
                    [torch.full((10,), float(i))],
                    dht,
                    prefix="fail",
                    target_group_size=2,
                    allreduce=_FailsAlways(AllReduceService.for_node(dht.node)),
                )
                averagers.append(await stack.enter_async_context(averager))
            errors: list[Exception] = []

            async def step(averager: AsyncAverager) -> None:
                try:
                    await averager.step(timeout=10, allow_retries=False)
                except Exception as exc:  # (each peer's own failure: the other goes on)
                    errors.append(exc)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for averager in averagers:
                        tg.start_soon(step, averager)
            assert len(errors) == 2
            assert all(isinstance(e, AllReduceFailed) for e in errors)
            return [a.metrics for a in averagers]

    for m in run_on_virtual_time(main):
        assert (m.steps_started, m.steps_failed_allreduce, m.steps_failed) == (1, 1, 1)
        assert (m.rounds_started, m.rounds_failed, m.rounds_completed) == (1, 1, 0)
        assert (m.last_group_size, m.bytes_sent) == (2, 0)


@pytest.mark.anyio
async def test_state_downloads_are_counted_on_both_sides() -> None:
    tensors = [[torch.arange(256.0)], [torch.zeros(256)]]
    async with _peers(tensors) as (donor, taker):
        taker.allow_state_sharing = False
        with anyio.fail_after(10):  # (until the donor's declaration is in the DHT)
            while await taker.dht.get("m.state", latest=True) is None:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        loaded = await taker.load_state_from_peers(timeout=20)
        assert loaded is not None
        torch.testing.assert_close(loaded[1][0], torch.arange(256.0))
        donor.allow_state_sharing = False
        assert await taker.load_state_from_peers(timeout=20) is None
        served, took = donor.metrics, taker.metrics
    assert (took.state_downloads_started, took.state_downloads_succeeded) == (2, 1)
    assert (took.state_downloads_failed, took.state_bytes_downloaded) == (1, 256 * 4)
    assert served.state_requests_served >= 1
    assert served.state_bytes_served >= 256 * 4
    assert (served.state_downloads_started, took.state_requests_served) == (0, 0)


# -- the sync facade and the Optimizer (TCP on 127.0.0.1) -----------------------------------------


def _no_prometheus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (importing it fails)


def test_the_sync_facade_snapshot_from_any_thread_and_after_shutdown(fresh_loop: None) -> None:
    tensors = [[torch.full((100,), float(i))] for i in range(2)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        second = stack.enter_context(DHT(first.get_visible_maddrs()))
        averagers = [
            stack.enter_context(
                swarmavg.DecentralizedAverager(own, dht, prefix="facade", target_group_size=2)
            )
            for own, dht in zip(tensors, (first, second), strict=True)
        ]
        assert averagers[0].metrics.steps_started == 0
        assert averagers[0].metrics_address is None
        handles = [a.step(wait=False, timeout=20) for a in averagers]
        results = [h.result(30) for h in handles]
        seen: list[AveragerMetrics] = []
        reader = threading.Thread(target=lambda: seen.append(averagers[1].metrics))
        reader.start()
        reader.join(10)
        for averager in averagers:
            averager.shutdown()
        after = [a.metrics for a in averagers]  # (still readable)
    assert seen[0].steps_succeeded == 1
    assert seen[0].bytes_sent == results[1].bytes_sent
    for m, result in zip(after, results, strict=True):
        assert (m.steps_started, m.steps_succeeded, m.rounds_completed) == (1, 1, 1)
        assert (m.last_group_size, m.bytes_received) == (2, result.bytes_received)


def test_metrics_port_without_the_extra_says_what_to_install(
    fresh_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_prometheus(monkeypatch)
    with DHT() as dht:
        with pytest.raises(ImportError, match=r"pip install swarmavg\[prometheus\]"):
            swarmavg.DecentralizedAverager(
                [torch.zeros(3)], dht, prefix="p", target_group_size=2, metrics_port=0
            )
        # nothing was made: the prefix is free for another averager
        with swarmavg.DecentralizedAverager([torch.zeros(3)], dht, prefix="p", target_group_size=2):
            pass
        with pytest.raises(ImportError, match=r"pip install swarmavg\[prometheus\]"):
            swarmavg.Optimizer(
                dht=dht,
                run_id="no_prometheus",
                target_batch_size=8,
                optimizer=torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1),
                metrics_port=9100,
            )
        for bad, error in ((True, TypeError), ("9100", TypeError), (70000, ValueError)):
            with pytest.raises(error, match="metrics_port"):
                swarmavg.DecentralizedAverager(
                    [torch.zeros(3)], dht, prefix="q", target_group_size=2, metrics_port=bad
                )


def _train(opt: swarmavg.Optimizer, model: torch.nn.Module, epochs: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(300):
        if opt.local_epoch >= epochs:
            return
        time.sleep(0.02)  # (the compute of a batch)
        x = torch.randn(4, 3, generator=generator)
        F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"stopped at epoch {opt.local_epoch}")


def _optimizer(dht: DHT, model: torch.nn.Module, **options: Any) -> swarmavg.Optimizer:
    return swarmavg.Optimizer(
        dht=dht,
        run_id="metrics",
        target_batch_size=16,
        batch_size_per_step=4,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        matchmaking_time=1.0,
        averaging_timeout=10.0,
        delay_state_averaging=False,
        averager_opts={"request_timeout": 1.0},
        tracker_opts={"min_refresh_period": 0.05, "default_refresh_period": 0.1},
        **options,
    )


def test_the_optimizer_alone_counts_local_epochs(fresh_loop: None) -> None:
    with DHT() as dht:
        model = torch.nn.Linear(3, 1)
        with _optimizer(dht, model) as opt:
            _train(opt, model, 2, seed=0)
            m = opt.metrics
    assert isinstance(m, OptimizerMetrics)
    assert m.run_id == "metrics"
    assert (m.epochs, m.local_epoch, m.epochs_averaged) == (2, 2, 0)
    assert m.local_epochs_by_reason() == {"alone": 2, "not_started": 0, "failed": 0}
    assert m.gradients is not None
    assert m.gradients.steps_succeeded == 0
    assert m.state.prefix == "metrics_state_averager"
    assert (m.state_loads, m.state_load_failures) == (0, 0)


def test_two_optimizers_count_their_epochs_and_averaged_rounds(fresh_loop: None) -> None:
    got: list[OptimizerMetrics] = []
    lock = threading.Lock()
    ready = threading.Barrier(2)

    def peer(dht: DHT, seed: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        with _optimizer(dht, model) as opt:
            ready.wait(30)
            _train(opt, model, 3, seed)
            m = opt.metrics
        with lock:
            got.append(m)

    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        second = stack.enter_context(DHT(first.get_visible_maddrs()))
        threads = [
            threading.Thread(target=partial(peer, dht, i)) for i, dht in enumerate((first, second))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not any(t.is_alive() for t in threads)
    assert len(got) == 2
    for m in got:
        assert m.local_epoch >= 3
        assert m.epochs_averaged + m.epochs_local == m.epochs  # (no delayed round pending)
        assert m.gradients is not None
        # (a round joined with weight 0, as before a state download, is no epoch of ours)
        assert m.gradients.steps_succeeded >= m.epochs_averaged
        # (a state download skips epochs: those are not this peer's)
        assert m.epochs == m.local_epoch if not m.state_loads else m.epochs <= m.local_epoch
    # at least one epoch averaged gradients with the other peer
    assert max(m.epochs_averaged for m in got) >= 1
    averaged = next(m for m in got if m.epochs_averaged)
    assert averaged.gradients is not None
    assert averaged.gradients.bytes_sent > 0
    assert averaged.gradients.last_group_size == 2
    assert averaged.bytes_sent >= averaged.gradients.bytes_sent


# -- the exporter (needs prometheus-client) -------------------------------------------------------


def _scrape(address: tuple[str, int] | None) -> str:
    assert address is not None
    host, port = address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus' text format."""
    inner = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    wanted = f"{name}{{{inner}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    raise AssertionError(f"no sample {wanted} in:\n{text}")


def test_the_averager_serves_its_metrics_and_stops_with_it(fresh_loop: None) -> None:
    pytest.importorskip("prometheus_client")
    tensors = [[torch.full((100,), float(i))] for i in range(2)]
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        second = stack.enter_context(DHT(first.get_visible_maddrs()))
        served = swarmavg.DecentralizedAverager(
            tensors[0], first, prefix="prom", target_group_size=2, metrics_port=0
        )
        other = stack.enter_context(
            swarmavg.DecentralizedAverager(tensors[1], second, prefix="prom", target_group_size=2)
        )
        before = _scrape(served.metrics_address)
        assert _sample(before, "swarmavg_averager_steps_started_total", prefix="prom") == 0
        handles = [a.step(wait=False, timeout=20) for a in (served, other)]
        result = handles[0].result(30)
        handles[1].result(30)
        text = _scrape(served.metrics_address)
        assert _sample(text, "swarmavg_averager_steps_succeeded_total", prefix="prom") == 1
        assert (
            _sample(
                text, "swarmavg_averager_steps_failed_total", prefix="prom", cause="matchmaking"
            )
            == 0
        )
        assert _sample(text, "swarmavg_averager_sent_bytes_total", prefix="prom") == (
            result.bytes_sent
        )
        assert _sample(text, "swarmavg_averager_last_group_size", prefix="prom") == 2
        assert _sample(text, "swarmavg_averager_group_size_bucket", prefix="prom", le="2.0") == 1
        assert _sample(text, "swarmavg_averager_group_size_count", prefix="prom") == 1
        address = served.metrics_address
        served.shutdown()
        with pytest.raises(OSError):
            _scrape(address)  # (the server and its thread are gone: fresh_loop checks)


def test_the_optimizer_serves_its_metrics_and_both_averagers(fresh_loop: None) -> None:
    pytest.importorskip("prometheus_client")
    with DHT() as dht:
        model = torch.nn.Linear(3, 1)
        with _optimizer(dht, model, metrics_port=0) as opt:
            _train(opt, model, 1, seed=0)
            assert opt._metrics_server is not None
            text = _scrape((opt._metrics_server.host, opt._metrics_server.port))
    assert _sample(text, "swarmavg_optimizer_epochs_total", run_id="metrics") == 1
    assert (
        _sample(text, "swarmavg_optimizer_epochs_local_total", run_id="metrics", reason="alone")
        == 1
    )
    for prefix in ("metrics_grad_averager", "metrics_state_averager"):
        assert _sample(text, "swarmavg_averager_steps_started_total", prefix=prefix) >= 0


def test_a_taken_metrics_port_raises_and_leaves_nothing(fresh_loop: None) -> None:
    pytest.importorskip("prometheus_client")
    import socket

    from swarmavg import AddressInUse

    with socket.socket() as taken, DHT() as dht:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUse, match=str(port)):
            swarmavg.DecentralizedAverager(
                [torch.zeros(3)], dht, prefix="taken", target_group_size=2, metrics_port=port
            )
        with swarmavg.DecentralizedAverager(
            [torch.zeros(3)], dht, prefix="taken", target_group_size=2
        ):
            pass
