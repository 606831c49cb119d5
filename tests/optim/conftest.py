from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import swarmavg.sync


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == swarmavg.sync.THREAD_NAME]


@pytest.fixture(autouse=True)
def _fresh_loop() -> Iterator[None]:
    """Every test starts without a loop thread and leaves no thread behind (the event loop's,
    a TrainingStateAverager's background threads, ...)."""
    swarmavg.sync.shutdown_loop(timeout=10)
    before = set(threading.enumerate())
    yield
    swarmavg.sync.shutdown_loop(timeout=10)
    assert loop_threads() == []
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert leftover == [], f"threads left behind: {leftover}"
