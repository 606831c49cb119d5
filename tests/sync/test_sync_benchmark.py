"""Smoke test of ``benchmarks/_sync_handle.py`` (figures are not checked: CI machines are noisy)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType

import pytest

from swarmavg.sync import THREAD_NAME

pytestmark = pytest.mark.timeout(30)


def test_measure_returns_rows_and_cleans_up(load_benchmark: Callable[[str], ModuleType]) -> None:
    rows = load_benchmark("_sync_handle.py").measure(iterations=20)
    names = [str(row["name"]) for row in rows]
    assert any(name.startswith("reference") for name in names)
    assert any("run_sync" in name for name in names)
    assert any("start_soon().result()" in name for name in names)
    for row in rows:
        assert set(row) == {"name", "median_us", "p90_us", "ratio"}
        assert isinstance(row["median_us"], float)
        assert isinstance(row["p90_us"], float)
        assert row["median_us"] > 0
    assert not [t for t in threading.enumerate() if t.name in (THREAD_NAME, "bench-reference-loop")]


def test_measure_rejects_zero_iterations(load_benchmark: Callable[[str], ModuleType]) -> None:
    with pytest.raises(ValueError, match="iterations"):
        load_benchmark("_sync_handle.py").measure(iterations=0)
