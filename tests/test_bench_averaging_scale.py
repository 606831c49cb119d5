"""``benchmarks/averaging_scale.py`` runs (the 1024-peer figure lives there): a small swarm of
real averagers on virtual time converges, and the script says whether it met its goal."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).parents[1] / "benchmarks" / "averaging_scale.py"
    spec = importlib.util.spec_from_file_location("_averaging_scale_benchmark", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_a_small_swarm_on_virtual_time_converges(capsys: pytest.CaptureFixture[str]) -> None:
    scale = _load()
    started = time.monotonic()
    # 64 peers in groups of 4 from 2 random bits: rounds where a group waits out the averaging
    # expiration (15 s) or a lone peer its step timeout (30 s) cost no real time for it
    args = "--peers 64 --group-size 4 --bits 2 --max-rounds 8 --target-rounds 8"
    status = scale.main([*args.split(), "--tolerance", "1e-2", "--time-limit", "200"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "within 0.01 after" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert rows, out
    virtual = sum(float(row[1]) for row in rows)  # (the rounds' time on the loop's clock)
    assert time.monotonic() - started < virtual  # faster than real time
