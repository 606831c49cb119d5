"""``benchmarks/averaging_scale.py`` runs (the 1024-peer figure lives there): a small swarm of
real averagers on virtual time converges, and the script says whether it met its goal."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_small_swarm_on_virtual_time_converges(
    capsys: pytest.CaptureFixture[str], load_benchmark: Callable[[str], ModuleType]
) -> None:
    scale = load_benchmark("averaging_scale.py")
    started = time.monotonic()
    # 64 peers in groups of 4 from 2 random bits: rounds where a group waits out the averaging
    # expiration (15 s) or a lone peer its step timeout (30 s) cost no real time for it. The
    # groups depend on timing, so the rounds it takes vary: 6-8 mostly, now and then 9.
    args = "--peers 64 --group-size 4 --bits 2 --max-rounds 12 --target-rounds 12"
    status = scale.main([*args.split(), "--tolerance", "1e-2", "--time-limit", "200"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "within 0.01 after" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert rows, out
    virtual = sum(float(row[1]) for row in rows)  # (the rounds' time on the loop's clock)
    assert time.monotonic() - started < virtual  # faster than real time
