"""Averaging rounds over the network lab, exact on every profile and both transports: 3 peer
processes (``benchmarks/_netlab_peer.py``: the sync ``swarmavg.DHT``, one over TCP and one over
QUIC, and ``swarmavg.DecentralizedAverager`` with the library's default timeouts), one in each
host of one lab, average one float32 tensor (peer ``i``'s all ``10**i``) in one group; every
peer must end in one complete group of 3 holding the exact float32 mean. The lab is built once
(one-packet frames: losses independent, as the lossy profiles need) and each case sets the
hosts' profiles live; sizes keep a round to about a second of transfer on each."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from swarmavg.testing import netlab
from swarmavg.testing.netlab import LAN, LinkProfile, NetLab

_reason = netlab.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

#: 1 Gbit/s beside 50 Mbit/s (the same short round trip): the slow hosts bound the round
SLOW = LinkProfile(rate_bps=50e6, rtt_s=0.0005)
SWARMS: dict[str, Sequence[LinkProfile | str]] = {
    "lan": ["lan"] * 3,
    "wan": ["wan"] * 3,
    "bad": ["bad"] * 3,
    "mixed": [LAN, SLOW, SLOW],
}
SIZE = {"lan": 1 << 20, "wan": 1 << 19, "bad": 1 << 16, "mixed": 1 << 19}


def _benchmark() -> ModuleType:
    """``benchmarks/network_faults.py`` (not a package), imported once."""
    name = "_benchmark_network_faults"
    if name not in sys.modules:
        path = Path(__file__).parents[2] / "benchmarks" / "network_faults.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def lab_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    faults = _benchmark()
    logs = tmp_path_factory.mktemp("netlab-averaging")
    with NetLab(3, profile="wan", offload=False) as lab:
        swarm = faults.LabSwarm(lab, ["tcp", "quic"], logs)
        try:
            yield swarm, logs
        finally:
            swarm.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "quic"])
@pytest.mark.parametrize("swarm", list(SWARMS))
def test_a_round_is_exact_on_every_profile(
    swarm: str,
    transport: str,
    lab_swarm: tuple[Any, Path],
    tmp_path: Path,
) -> None:
    faults = _benchmark()
    peers, _ = lab_swarm
    lab: NetLab = peers.lab
    for i, profile in enumerate(SWARMS[swarm]):
        lab.set_profile(i, profile)
    before = sum(host["rx_bytes"] for host in lab.stats())
    results, problems = faults.clean_round(
        peers, SIZE[swarm], {}, tmp_path, transport=transport, timeout=40.0
    )
    stats = lab.stats()
    assert problems == []
    for result in results.values():
        assert len(result["group"]) == len(result["contributors"]) == 3
        assert not result["incomplete"]
    # the tensors went through the lab: each peer sent at least 2/3 of its tensor
    assert sum(host["rx_bytes"] for host in stats) - before > 3 * 2 / 3 * 4 * SIZE[swarm]
