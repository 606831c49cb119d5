"""Two seeded runs of the network lab's fault matrix (``benchmarks/network_faults.py``; the
full 100 runs: ``python benchmarks/network_faults.py --runs 100``): 4 peers in 4 lab hosts, a
peer SIGKILLed or cut off at a random stage of a round, on a random profile and transport. No
step outlives its bound, survivors agree exactly, every incomplete result names the victim and
nobody else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from swarmavg.testing import netlab

_reason = netlab.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")


@pytest.mark.timeout(120)
def test_seeded_fault_runs_end_in_time_and_survivors_agree(
    tmp_path: Path, load_benchmark: Callable[[str], ModuleType]
) -> None:
    """Seed 33: over TCP on ``bad``, a peer killed while reducing, then one cut off while the
    means come back (the case that once looked like a step outliving its timeout: the
    harness had dropped the victim's early result), which must rejoin the DHT by itself."""
    faults = load_benchmark("network_faults.py")
    records = faults.run_matrix(2, seed=33, logs=tmp_path, say=lambda line: None)
    assert [(r.transport, r.profile, r.fault) for r in records] == [
        ("tcp", "bad", "kill"),
        ("tcp", "bad", "cut"),
    ]
    for record in records:
        assert not record.hang, record
        assert record.problems == [], record
