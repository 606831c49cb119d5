"""Training over the network lab: ``swarmavg.Optimizer`` on the workload of
``swarmavg.testing.workload``, 6 training processes (``benchmarks/_optimizer_peer.py``) in 6
hosts on ``wan`` (100 Mbit/s, 40 ms, 0.1% loss), driven by ``benchmarks/network_training.py``
(its command line runs the longer versions: ``churn --period 20 --changes 8``, ``partition
--split 30``). One swarm serves both tests (starting 6 training processes on two shared cores
takes ~20 s), the partition first (on a young swarm, where a split drives the sides far apart:
1-2.5% in 12 s, against ~0.5% at epoch 50); each test looks only at what happened after it
began.

- Churn: a change ``PERIOD`` seconds after the previous one was done (8 s here, ~20 s in the
  issue: shorter to keep the suite short; it must exceed ``averaging_timeout``, 5 s here, which
  a round that lost its peer may take to fail, and still spans several epochs of ~1 s): a random
  peer SIGKILLed, then a fresh process joining in its host (the benchmark makes 8 changes;
  2 keep the suite short). Training goes on (the
  swarm's epoch advances after every change), the joiners download the state (their first
  epoch after 0 is the swarm's) and reach the swarm's epoch within one period, no peer's epoch
  ever goes down, and the validation loss at the end is below ``LOSS_BELOW`` (5.5 at the
  start; 3.16 after 20 epochs, 2.73 after 50 in benchmark runs).
- Partition: the swarm split in two sides of 3 (every path between them cut) for ``SPLIT`` (12 s
  here, 30 s in the issue) trains on both sides (each advances and feeds samples), and is
  driven apart (the sides' parameters differ by more than twice the tolerance); after the
  heal, within ``SETTLE`` seconds (45: 12-17 s measured, but one CI run in about twenty, on a
  loaded machine, with both sides at the same epoch at the heal, found no agreement within
  30 s), at least 5 of the 6 peers report one epoch with parameters
  within ``TOLERANCE`` of each other (one may be absent: on two loaded cores a slow peer falls
  behind at every epoch end and keeps downloading the state, skipping the epochs it reports;
  with all 6 required, one run in five found no such epoch in 30 s); distances are relative
  L2 (the split drove the sides ~1-2.5e-2 apart).
  Healing takes the DHT's rejoining (each side pings the peers it dropped, backing off to
  10 s when measured, 4 s now) and a round of the whole swarm, or a download of the state by
  the side behind: 12-17 s measured. Without the rejoining the sides never average together
  again and this fails.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from swarmavg.testing import netlab
from swarmavg.testing.netlab import NetLab

_reason = netlab.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

PEERS = 6
#: the peers' options beside ``network_training.OPTIONS``: a round that lost a peer (or
#: crossed the cut) fails within ``averaging_timeout``, shorter than a period here
OPTIONS = {"averaging-timeout": 5.0, "verbose": True}
PERIOD = 8.0
CHANGES = 2
LOSS_BELOW = 3.8
SPLIT = 12.0
SETTLE = 45.0
TOLERANCE = 3e-3


def _benchmark() -> ModuleType:
    """``benchmarks/network_training.py`` (not a package), imported once."""
    name = "_benchmark_network_training"
    if name not in sys.modules:
        path = Path(__file__).parents[2] / "benchmarks" / "network_training.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    training = _benchmark()
    logs = tmp_path_factory.mktemp("netlab-training")
    with NetLab(PEERS, profile="wan", seed=0, offload=False) as lab:
        peers = training.TrainSwarm(lab, PEERS, logs, OPTIONS)
        try:
            yield peers
        finally:
            peers.close()


@pytest.mark.timeout(180)
def test_a_partitioned_swarm_trains_on_both_sides_and_heals_to_one_state(swarm: Any) -> None:
    training = _benchmark()
    assert len(swarm.live) == PEERS
    result = training.partition(swarm, 3.0, SPLIT, SETTLE, TOLERANCE, quorum=PEERS - 1)
    problems = training.partition_problems(swarm, result, TOLERANCE)
    assert problems == [], (result, _after_heal(swarm, result.healed_at))
    assert result.agreed_s is not None
    assert result.agreed_s <= SETTLE, result


def _after_heal(swarm: Any, healed: float) -> dict[int, list[tuple[int, float]]]:
    """Each peer's epochs reported after the heal, with when (for a failure's message)."""
    return {
        p.index: [(e["epoch"], round(e["at"] - healed, 2)) for e in p.epochs() if e["at"] >= healed]
        for p in swarm.peers
    }


@pytest.mark.timeout(180)
def test_training_goes_on_while_peers_leave_and_join(swarm: Any) -> None:
    training = _benchmark()
    began = time.monotonic()
    changes = training.churn(swarm, CHANGES, PERIOD, seed=0)
    assert [c.kind for c in changes] == ["leave", "join"] * (CHANGES // 2)
    assert training.churn_problems(swarm, changes, PERIOD) == []
    # the joiners fed the state they downloaded (not epoch 1 onwards) and are counted
    for change in changes:
        if change.kind == "join":
            first = next(e for e in change.joiner_epochs if e > 0)
            assert first >= change.epoch, change
    assert len(swarm.live) == PEERS
    # the loss the live peers evaluated last (every 5 epochs), after the churn
    final = [
        (epoch, loss) for epoch, loss in training.losses(swarm.live) if epoch >= changes[0].epoch
    ]
    assert len(final) >= PEERS - 1, final  # (a joiner may skip the evaluated epochs)
    assert max(loss for _, loss in final) < LOSS_BELOW, final
    assert time.monotonic() - began < CHANGES * PERIOD + 60
