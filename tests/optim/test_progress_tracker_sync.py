"""``swarmavg.optim.ProgressTracker``: the sync facade, peers over TCP in one process (the
training thread reports and reads while the tracker publishes and fetches on the loop)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import pytest

from swarmavg import DHT
from swarmavg.optim.progress_tracker import ProgressTracker
from swarmavg.proto.dht_validation import owner_marker
from swarmavg.proto.progress import GlobalTrainingProgress, LocalTrainingProgress

pytestmark = pytest.mark.timeout(60)

FAST = {"min_refresh_period": 0.05, "default_refresh_period": 0.1, "max_refresh_period": 0.2}


def _wait_for(tracker: ProgressTracker, condition: Callable[[], bool], timeout: float = 20) -> None:
    """Wait for fetches of ``tracker`` until ``condition()`` holds (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    fetched = tracker.fetched_global_progress_this_epoch
    while not condition():
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"not true within {timeout} s: {tracker.global_progress}"
        fetched.clear()
        if not condition():
            fetched.wait(min(remaining, 1.0))


def _dhts(stack: ExitStack, n: int) -> list[DHT]:
    first = stack.enter_context(DHT())
    return [first] + [stack.enter_context(DHT(first.get_visible_maddrs())) for _ in range(n - 1)]


def test_three_peers_count_each_others_samples_and_move_to_the_next_epoch() -> None:
    with ExitStack() as stack:
        dhts = _dhts(stack, 3)
        trackers = [stack.enter_context(ProgressTracker(d, "run", 100, **FAST)) for d in dhts]
        assert all(t.is_alive() for t in trackers)
        for i, tracker in enumerate(trackers):
            tracker.report_local_progress(0, 10 * (i + 1))
        for tracker in trackers:
            _wait_for(tracker, lambda t=tracker: t.global_progress.num_peers == 3)
            _wait_for(tracker, lambda t=tracker: t.global_progress.samples_accumulated == 60)
        first = trackers[0]
        first.report_local_progress(0, 60)  # 60 + 20 + 30: counted at once, locally
        assert first.global_progress.samples_accumulated == 110
        assert first.ready_to_update_epoch
        with first.pause_updates():
            assert first.update_epoch() == 1
        assert first.global_epoch == 1
        assert first.local_progress.epoch == 1
        for other in trackers[1:]:
            _wait_for(other, lambda t=other: t.global_epoch == 1)
            assert other.ready_to_update_epoch  # the swarm is ahead of it
            assert other.estimated_next_update_time <= time.time() + 1
        assert isinstance(first.global_progress, GlobalTrainingProgress)
        assert isinstance(first.local_progress, LocalTrainingProgress)
        assert first.training_progress_key == "run_progress"


def test_shutdown_is_idempotent_leaves_a_tombstone_and_nothing_running() -> None:
    with ExitStack() as stack:
        stays_dht, leaves_dht = _dhts(stack, 2)
        stays = stack.enter_context(ProgressTracker(stays_dht, "bye", 100, **FAST))
        leaves = ProgressTracker(leaves_dht, "bye", 100, **FAST)
        leaves.report_local_progress(0, 5)
        _wait_for(stays, lambda: stays.global_progress.num_peers == 1)
        leaves.shutdown()
        leaves.shutdown()
        assert not leaves.is_alive()
        _wait_for(stays, lambda: stays.global_progress.num_peers == 0)
        found = stays_dht.get("bye_progress", latest=True)
        assert found is not None
        assert found.value[owner_marker(leaves_dht.peer_id)].value is None
        with pytest.raises(RuntimeError, match="shut down"):
            leaves.start()
    stays.shutdown()  # (after its DHT: nothing to do)
    assert not stays.is_alive()


def test_the_training_thread_reports_while_other_threads_read() -> None:
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        tracker = stack.enter_context(ProgressTracker(dht, "threads", 10_000, **FAST))
        stop = threading.Event()
        seen: list[int] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                while not stop.is_set():
                    progress = tracker.global_progress
                    seen.append(progress.samples_accumulated)
                    _ = tracker.ready_to_update_epoch, tracker.estimated_next_update_time
                    stop.wait(0.001)
            except BaseException as exc:  # (reported below)
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for samples in range(1, 2001):
                tracker.report_local_progress(0, samples)
        finally:
            stop.set()
            reader.join(10)
        assert not errors
        assert tracker.local_progress.samples_accumulated == 2000
        assert seen
        _wait_for(tracker, lambda: tracker.global_progress.num_peers == 1)
        assert tracker.global_progress.samples_accumulated == 2000


def test_start_later_and_use_as_a_context_manager() -> None:
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        tracker = ProgressTracker(dht, "later", 10, start=False, **FAST)
        assert not tracker.is_alive()
        tracker.report_local_progress(0, 3)  # (allowed before the start)
        with tracker:
            assert tracker.is_alive()
            tracker.start()  # (idempotent while running)
            _wait_for(tracker, lambda: tracker.global_progress.num_peers == 1)
        assert not tracker.is_alive()


def test_update_epoch_requires_pause_updates() -> None:
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        tracker = stack.enter_context(ProgressTracker(dht, "pause", 10, **FAST))
        with pytest.raises(RuntimeError, match="pause_updates"):
            tracker.update_epoch()
        with tracker.pause_updates(), tracker.pause_updates():
            assert tracker.update_epoch(3) == 3
        assert tracker.global_epoch == 3


def test_arguments_are_checked_with_their_names() -> None:
    with ExitStack() as stack:
        (dht,) = _dhts(stack, 1)
        cases: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"private_key": object()}, TypeError, "private_key"),
            ({"daemon": 1}, TypeError, "daemon"),
            ({"start": "yes"}, TypeError, "start"),
            ({"client_mode": "no"}, TypeError, "client_mode"),
            ({"target_batch_size": -1}, ValueError, "target_batch_size"),
            ({"max_refresh_period": 0}, ValueError, "max_refresh_period"),
            ({"metadata_expiration": float("nan")}, ValueError, "metadata_expiration"),
        ]
        for kwargs, error, name in cases:
            kwargs = {"prefix": "args", "target_batch_size": 10, **kwargs}
            with pytest.raises(error, match=name):
                ProgressTracker(dht, **kwargs)
        with pytest.raises(TypeError, match="dht"):
            ProgressTracker(dht._dht, "args", 10)  # type: ignore[arg-type]
        tracker = ProgressTracker(dht, "args", 10, private_key=None, daemon=False)
        tracker.shutdown()
    stopped = DHT()
    stopped.shutdown()
    with pytest.raises(RuntimeError, match="DHT is not running"):
        ProgressTracker(stopped, "args", 10)


def test_hyperparameter_mismatch_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with ExitStack() as stack, caplog.at_level(logging.WARNING, logger="swarmavg.aio.progress"):
        first, second = _dhts(stack, 2)
        ours = stack.enter_context(ProgressTracker(first, "hp", 100, hyperparameters="a1", **FAST))
        theirs = stack.enter_context(
            ProgressTracker(second, "hp", 100, hyperparameters="b2", **FAST)
        )
        assert ours.hyperparameters == "a1"
        ours.report_local_progress(0, 1)
        theirs.report_local_progress(0, 1)
        _wait_for(ours, lambda: ours.global_progress.num_peers == 2)
        for _ in range(3):  # (three more fetches)
            ours.fetched_global_progress_this_epoch.clear()
            assert ours.fetched_global_progress_this_epoch.wait(10)
    about_theirs = [r for r in caplog.records if str(second.peer_id) in r.getMessage()]
    assert len(about_theirs) == 1
    assert about_theirs[0].levelno == logging.WARNING
