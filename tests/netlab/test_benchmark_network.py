"""``benchmarks/network.py``: its bounds (pure arithmetic, anywhere), and its ``--quick`` run on
the lab (Linux, root): our rows exact, timed, beside the right bound."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from swarmavg.testing import netlab

_reason = netlab.unavailable_reason()
BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
MIB = 1 << 20


def _benchmark() -> ModuleType:
    """``benchmarks/network.py`` (not a package; it imports its neighbours), imported once."""
    name = "_benchmark_network"
    if name not in sys.modules:
        if str(BENCHMARKS) not in sys.path:
            sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "network.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_uniform_bound_is_2_n_minus_1_over_n_times_s_over_b() -> None:
    bound = _benchmark().bound_s
    # 64 MiB per peer, 4 peers at 100 Mbit/s: 1.5 * 536.870912 Mbit / 100 Mbit/s
    assert bound(64 * MIB, [100e6] * 4) == pytest.approx(1.5 * 64 * MIB * 8 / 100e6)
    assert bound(8 * MIB, [20e6] * 8) == pytest.approx(1.75 * 8 * MIB * 8 / 20e6)


def test_the_best_split_bound_is_the_slowest_peers_own_tensor_or_the_shared_rate() -> None:
    module = _benchmark()
    bits = 64 * MIB * 8
    # 2 peers at 1 Gbit/s, 2 at 50 Mbit/s: a slow peer must send and receive its tensor once
    assert module.bound_s(64 * MIB, [1e9, 1e9, 50e6, 50e6]) == pytest.approx(bits / 50e6)
    # close rates: every peer takes a share, 2(N-1) S / sum(B)
    rates = [100e6, 100e6, 80e6, 80e6]
    assert module.bound_s(64 * MIB, rates) == pytest.approx(6 * bits / sum(rates))
    # where every peer takes a share, the best split's shares cover the vector exactly
    t = module.bound_s(64 * MIB, rates)
    shares = [(t * b / bits - 1) / (len(rates) - 2) for b in rates]
    assert min(shares) > 0
    assert sum(shares) == pytest.approx(1.0)
    # the even split is slower: (1 + (N-2)/N) S / min(B)
    assert module.even_bound_s(64 * MIB, [1e9, 1e9, 50e6, 50e6]) == pytest.approx(1.5 * bits / 50e6)


@pytest.mark.skipif(_reason is not None, reason=_reason or "")
@pytest.mark.timeout(120)
def test_a_quick_run_on_the_lab_gives_exact_timed_rows_for_ours(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--quick", "--systems", "ours", "--transports", "tcp", "--json", str(out)]
    code = _benchmark().main([*argv, "--logs", str(tmp_path / "logs")])
    rows = json.loads(out.read_text())
    assert code == 0
    assert [(r["profile"], r["peers"], r["system"], r["transport"]) for r in rows] == [
        ("wan", 3, "ours", "tcp")
    ]
    row = rows[0]
    assert row["status"] == "ok"
    assert row["exact"] is True
    assert len(row["times_s"]) == 1
    assert row["times_s"][0] > 0
    # 0.25 MiB per peer, 3 peers at 100 Mbit/s (rounded to ms)
    assert row["bound_s"] == pytest.approx(4 / 3 * 0.25 * MIB * 8 / 100e6, abs=1e-3)


@pytest.mark.skipif(_reason is not None, reason=_reason or "")
@pytest.mark.timeout(120)
def test_the_raw_tcp_reference_moves_an_all_reduces_bytes_no_faster_than_the_links(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rows.json"
    argv = ["--quick", "--systems", "tcp", "--json", str(out), "--logs", str(tmp_path / "logs")]
    code = _benchmark().main(argv)
    rows = json.loads(out.read_text())
    assert code == 0
    assert [(r["profile"], r["peers"], r["system"], r["status"]) for r in rows] == [
        ("wan", 3, "raw TCP", "ok")
    ]
    (row,) = rows
    assert len(row["times_s"]) == 1
    # every host sent and received 2 (N-1)/N * S through its 100 Mbit/s link, 20 ms away
    assert row["times_s"][0] > row["bound_s"] + 0.02
    assert row["exact"] is None  # (no values: nothing to check)
