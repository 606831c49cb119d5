"""``swarmavg.aio.progress.ProgressTracker``: several trackers on the memory transport, on
virtual time (deterministic): hivemind's test_progress_tracker, clients, tombstones, forged and
garbage records, the hyperparameters warning, pauses, shutdown."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import msgpack
import pytest

from swarmavg import get_dht_time
from swarmavg.aio import DHT
from swarmavg.aio.progress import ProgressTracker
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.proto.dht_values import pack
from swarmavg.proto.progress import LocalTrainingProgress
from swarmavg.testing import MemoryNetwork, run_on_virtual_time

pytestmark = pytest.mark.timeout(120)

FAST = {"min_refresh_period": 0.1, "default_refresh_period": 0.2, "max_refresh_period": 0.5}


class _Swarm:
    def __init__(self, stack: AsyncExitStack) -> None:
        self.stack = stack
        self.network = MemoryNetwork()
        self.dhts: list[DHT] = []

    async def dht(self, stack: AsyncExitStack | None = None, **options: Any) -> DHT:
        seeds = [a for d in self.dhts[:2] for a in d.get_visible_maddrs()]
        dht = DHT(seeds, transport="memory", transport_options={"network": self.network}, **options)
        await (stack or self.stack).enter_async_context(dht)
        self.dhts.append(dht)
        return dht

    async def tracker(
        self, prefix: str = "run", target: int = 256, stack: AsyncExitStack | None = None, **kw: Any
    ) -> ProgressTracker:
        stack = stack or self.stack
        dht = await self.dht(stack)
        return await stack.enter_async_context(
            ProgressTracker(dht, prefix, target, **{**FAST, **kw})
        )


@asynccontextmanager
async def _swarm() -> AsyncIterator[_Swarm]:
    async with AsyncExitStack() as stack:
        yield _Swarm(stack)


async def _until(condition: Callable[[], bool], limit: float = 30.0, step: float = 0.05) -> None:
    """Poll ``condition()`` every ``step`` (virtual) seconds; fail after ``limit`` seconds."""
    for _ in range(int(limit / step) + 1):
        if condition():
            return
        await anyio.sleep(step)
    pytest.fail(f"not true within {limit} s")


def _run(main: Callable[[], Awaitable[Any]]) -> Any:
    return run_on_virtual_time(main)


def test_hiveminds_progress_tracker_scenario() -> None:
    """hivemind's test_progress_tracker: a main tracker that never reports and four workers
    (12/0.6 s, 16/0.5 s, 24/0.4 s; the fast one, 64/0.4 s, joins at epoch 2 and leaves after
    epoch 4) with target 256. Epochs 2-4 are faster than the mean, 0, 1 and 5 slower; the EMAs
    follow the workers' speeds; the main tracker's EMA never moved."""

    async def main() -> tuple[list[float], dict[int, float], float]:
        async with _swarm() as swarm:
            root = await swarm.tracker()
            emas: dict[int, float] = {}
            delayed_start = anyio.Event()
            finished = anyio.Event()

            async def worker(index: int, batch_size: int, period: float) -> None:
                async with AsyncExitStack() as own:
                    tracker = await swarm.tracker(stack=own)
                    if index == 4:
                        await delayed_start.wait()
                    local_epoch = 2 if index == 4 else 0
                    samples = 0
                    for _ in range(1000):
                        await anyio.sleep(period)
                        if finished.is_set():
                            break
                        samples += batch_size
                        tracker.report_local_progress(local_epoch, samples)
                        if tracker.ready_to_update_epoch:
                            with tracker.pause_updates():
                                local_epoch = tracker.update_epoch(local_epoch + 1)
                                samples = 0
                            if index == 4 and local_epoch >= 5:
                                await anyio.sleep(0.5)
                                break
                    emas[index] = tracker.performance_ema.samples_per_second

            deltas: list[float] = []
            async with anyio.create_task_group() as tg:
                for index, batch_size, period in ((1, 12, 0.6), (2, 16, 0.5), (3, 24, 0.4)):
                    tg.start_soon(worker, index, batch_size, period)
                tg.start_soon(worker, 4, 64, 0.4)
                step, last = 0, get_dht_time()
                for _ in range(1000):
                    if step >= 6:
                        break
                    await anyio.sleep(0.1)
                    if root.global_progress.epoch > step:
                        step = root.global_progress.epoch
                        if step == 2:
                            delayed_start.set()
                        deltas.append(get_dht_time() - last)
                        last = get_dht_time()
                finished.set()
            return deltas, emas, root.performance_ema.samples_per_second

    deltas, emas, root_ema = _run(main)
    assert len(deltas) == 6, deltas
    mean = sum(deltas) / len(deltas)
    for i in (0, 1, 5):
        assert 1.05 * mean < deltas[i] < 2.0 * mean, deltas
    for i in (2, 3, 4):
        assert 0.5 * mean < deltas[i] < 0.95 * mean, deltas
    assert emas[1] < emas[2] < emas[3] < emas[4], emas
    assert root_ema < 1e-9


def test_a_client_is_counted_but_does_not_raise_the_global_epoch() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            peer = await swarm.tracker()
            client = await swarm.tracker(client_mode=True)
            assert client.client_mode
            assert not peer.client_mode
            client.report_local_progress(7, 10)
            peer.report_local_progress(0, 5)
            await _until(lambda: peer.global_progress.num_clients == 1)
            progress = peer.global_progress
            assert (progress.epoch, progress.num_peers, progress.num_clients) == (0, 2, 1)
            # a client's own view: its epoch counts for itself (it is its local epoch)
            await _until(lambda: client.global_progress.num_peers == 2)
            assert client.global_epoch == 7

    _run(main)


def test_a_peer_that_shuts_down_leaves_a_tombstone_and_stops_being_counted() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            stays = await swarm.tracker(metadata_expiration=600.0)
            async with AsyncExitStack() as own:
                leaves = await swarm.tracker(stack=own, metadata_expiration=600.0)
                leaves.report_local_progress(0, 30)
                stays.report_local_progress(0, 10)
                await _until(lambda: stays.global_progress.num_peers == 2)
                assert stays.global_progress.samples_accumulated == 40
                leaver_id = leaves.dht.peer_id
                await leaves.aclose()
                await leaves.aclose()  # idempotent
                assert not leaves.is_running
            started = anyio.current_time()
            await _until(lambda: stays.global_progress.num_peers == 1)
            assert anyio.current_time() - started < 5  # not the 600 s expiration
            assert stays.global_progress.samples_accumulated == 10
            found = await stays.dht.get("run_progress", latest=True)
            assert found is not None
            assert found.value[owner_marker(leaver_id)].value is None

    _run(main)


def test_a_peer_that_never_accumulates_publishes_nothing() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            aux = await swarm.tracker()
            peer = await swarm.tracker()
            for epoch in range(3):
                aux.report_local_progress(epoch, 0)
                peer.report_local_progress(epoch, 16)
                await anyio.sleep(1)
            found = await peer.dht.get("run_progress", latest=True)
            assert found is not None
            assert set(found.value) == {owner_marker(peer.dht.peer_id)}
            await aux.aclose()  # (nothing published: no tombstone either)
            found = await peer.dht.get("run_progress", latest=True)
            assert set(found.value) == {owner_marker(peer.dht.peer_id)}  # type: ignore[union-attr]

    _run(main)


def test_no_peer_can_forge_another_peers_progress() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            for _ in range(4):  # (replicas)
                await swarm.dht()
            victim = await swarm.tracker()
            observer = await swarm.tracker()
            intruder = await swarm.dht()
            victim.report_local_progress(1, 10)
            await _until(lambda: observer.global_progress.num_peers == 1)
            assert observer.global_epoch == 1
            now = get_dht_time()
            forged = LocalTrainingProgress(
                victim.dht.peer_id.to_bytes(), 99, 10_000, 1000.0, now, False
            ).to_wire()
            victims_subkey = owner_marker(victim.dht.peer_id)
            # through the API: refused at once
            with pytest.raises(ValueError, match="another peer"):
                await intruder.store("run_progress", forged, now + 300, subkey=victims_subkey)
            # written straight into the storage of half the replicas (dishonest ones), with a
            # bogus signature and a later expiration: every reader refuses it
            key, subkey = pack("run_progress", "key"), pack(victims_subkey, "subkey")
            holders = [d for d in swarm.dhts if d.dht_node.protocol.storage.get(key, now)]
            assert len(holders) >= 2
            signed = msgpack.packb([pack(forged), b"\x00" * 64])
            for dht in holders[: len(holders) // 2]:
                dht.dht_node.protocol.storage.store(key, signed, now + 300, now, subkey=subkey)
            # under its own subkey, claiming the victim's peer id: ignored too
            await intruder.store(
                "run_progress", forged, now + 300, subkey=owner_marker(intruder.peer_id)
            )
            await anyio.sleep(2)  # (several fetches)
            assert observer.fetched_global_progress_this_epoch.is_set()
            progress = observer.global_progress
            assert (progress.epoch, progress.num_peers) == (1, 1)
            assert progress.samples_accumulated == 10

    _run(main)


def test_garbage_records_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            peer = await swarm.tracker()
            vandal = await swarm.dht()
            mine = owner_marker(vandal.peer_id)
            now = get_dht_time()
            for i, value in enumerate(([1, 2], {"epoch": -1}, "x", {"peer_id": b"?"})):
                await vandal.store("run_progress", value, now + 60 + i, subkey=mine)
                await vandal.store("run_progress", value, now + 60, subkey=f"loose{i}")
            peer.report_local_progress(0, 3)
            await _until(lambda: peer.global_progress.num_peers == 1)
            await anyio.sleep(1)
            assert peer.global_progress.num_peers == 1

    with caplog.at_level(logging.DEBUG, logger="swarmavg.aio.progress"):
        _run(main)
    assert any("ignored a progress record" in r.getMessage() for r in caplog.records)
    assert all(
        r.levelno <= logging.DEBUG for r in caplog.records if r.name == "swarmavg.aio.progress"
    )


def test_other_hyperparameters_get_one_warning_per_peer(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[str]:
        async with _swarm() as swarm:
            ours = await swarm.tracker(hyperparameters="aaaa")
            same = await swarm.tracker(hyperparameters="aaaa")
            other = await swarm.tracker(hyperparameters="bbbb")
            unknown = await swarm.tracker()  # (publishes no digest: no check)
            for tracker in (ours, same, other, unknown):
                tracker.report_local_progress(0, 8)
            await _until(lambda: ours.global_progress.num_peers == 4)
            await anyio.sleep(3)  # (many more fetches)
            return [str(other.dht.peer_id), str(same.dht.peer_id), str(unknown.dht.peer_id)]

    with caplog.at_level(logging.WARNING, logger="swarmavg.aio.progress"):
        other, same, unknown = _run(main)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # the two "aaaa" peers warn once each about "bbbb", which warns once about each of them
    about_other = [w for w in warnings if other in w]
    assert len(about_other) == 2
    assert all(same not in w for w in about_other)
    assert sum(same in w for w in warnings) == 1
    assert all(unknown not in w for w in warnings)
    assert len(warnings) == 4
    assert all("hyperparameters" in w for w in warnings)


def test_no_fetch_changes_the_progress_while_paused() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            peer = await swarm.tracker()
            other = await swarm.tracker()
            peer.report_local_progress(0, 10)
            await _until(lambda: peer.global_progress.num_peers == 1)
            with peer.pause_updates():
                held = peer.global_progress
                other.report_local_progress(0, 50)
                await anyio.sleep(3)  # (the others' records changed; fetches would see them)
                assert peer.global_progress == held
                assert peer.update_epoch() == 1
                assert not peer.fetched_global_progress_this_epoch.is_set()
            await _until(peer.fetched_global_progress_this_epoch.is_set, limit=1.0)
            assert peer.global_progress.num_peers == 2
            assert peer.global_epoch == 1
            with pytest.raises(RuntimeError, match="pause_updates"):
                peer.update_epoch()

    _run(main)


def test_a_late_joiner_knows_the_global_epoch_once_entered() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            early = await swarm.tracker()
            early.report_local_progress(0, 10)
            with early.pause_updates():
                early.update_epoch(4)
            early.report_local_progress(4, 1)
            await anyio.sleep(1)
            late = await swarm.tracker()
            assert late.global_epoch == 4  # (read when entered, before any background fetch)
            assert late.ready_to_update_epoch
            assert late.estimated_next_update_time == pytest.approx(get_dht_time())

    _run(main)


def test_arguments_are_checked_and_a_tracker_starts_once() -> None:
    async def main() -> None:
        async with _swarm() as swarm:
            dht = await swarm.dht()
            cases: list[tuple[dict[str, Any], type[Exception], str]] = [
                ({"target_batch_size": 0}, ValueError, "target_batch_size"),
                ({"metadata_expiration": 0}, ValueError, "metadata_expiration"),
                ({"performance_ema_alpha": 2}, ValueError, "performance_ema_alpha"),
                ({"min_refresh_period": "1"}, TypeError, "min_refresh_period"),
                ({"hyperparameters": 5}, ValueError, "hyperparameters"),
                ({"status_loglevel": "DEBUG"}, TypeError, "status_loglevel"),
                ({"prefix": ""}, TypeError, "prefix"),
            ]
            for kwargs, error, name in cases:
                kwargs = {"prefix": "run", "target_batch_size": 10, **kwargs}
                with pytest.raises(error, match=name):
                    ProgressTracker(dht, **kwargs)
            with pytest.raises(TypeError, match="dht"):
                ProgressTracker("dht", "run", 10)  # type: ignore[arg-type]
            tracker = ProgressTracker(dht, "run", 10)
            async with tracker:
                assert tracker.is_running
                with pytest.raises(RuntimeError, match="once"):
                    await tracker.__aenter__()
            assert not tracker.is_running

    _run(main)
