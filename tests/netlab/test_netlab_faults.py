"""Two seeded runs of the network lab's fault matrix (``benchmarks/network_faults.py``; the
full 100 runs: ``python benchmarks/network_faults.py --runs 100``): 4 peers in 4 lab hosts, a
peer SIGKILLed or cut off at a random stage of a round, on a random profile and transport. No
step outlives its bound, survivors agree exactly, every incomplete result names the victim and
nobody else."""

from __future__ import annotations

import time
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


@pytest.mark.timeout(120)
def test_a_peer_cut_off_for_seconds_rejoins_and_averages_with_the_others_again(
    tmp_path: Path, load_benchmark: Callable[[str], ModuleType]
) -> None:
    """3 peers over TCP on ``wan``; host 2's cable is pulled while everyone steps (it fails
    alone, its DHT requests fail and empty its routing table; the others average without it
    and drop it from theirs); once the cable is back, every DHT holds the others again within
    ``REJOIN_WITHIN`` seconds, and the next round has all three, exact, without a restart."""
    faults = load_benchmark("network_faults.py")
    size = 1 << 16
    out = tmp_path / "out"
    out.mkdir()
    with netlab.NetLab(3, profile="wan", seed=1, offload=False) as lab:
        swarm = faults.LabSwarm(lab, ["tcp"], tmp_path)
        try:
            _, problems = faults.clean_round(swarm, size, faults.FAULT_OPTIONS, out)
            assert problems == []
            lab.set_link(2, False)
            swarm.prepare(size, faults.FAULT_OPTIONS, min_group_size=2)
            swarm.step(10.0, None)
            deadline = time.monotonic() + 30
            results = {peer.index: peer.expect("result", deadline) for peer in swarm.peers}
            assert "error" in results[2], results[2]
            for i in (0, 1):
                assert len(results[i]["group"]) == 2, results[i]
            lab.set_link(2, True)
            deadline = time.monotonic() + faults.REJOIN_WITHIN
            assert [swarm.rejoined(i, deadline) for i in range(3)] == [True] * 3
            _, problems = faults.clean_round(swarm, size, faults.FAULT_OPTIONS, out)
            assert problems == []
        finally:
            swarm.close()
