"""One averaging round of ``swarmavg.DecentralizedAverager`` among 3 processes, each in its own
host of the network lab, over TCP on the ``wan`` profile (100 Mbit/s, 40 ms, 0.1% loss): the
result is the exact mean on every peer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmavg.testing import netlab
from swarmavg.testing.netlab import NetLab

_reason = netlab.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

PEER = Path(__file__).with_name("_lab_peer.py")
ROOT = Path(__file__).parents[2]


def _read_json(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the peer exited ({process.wait(timeout=10)})"
    answer: dict[str, Any] = json.loads(line)
    return answer


@pytest.mark.timeout(90)
def test_one_round_among_three_hosts_on_wan_is_exact() -> None:
    values = [1.0, 2.0, 3.0]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with NetLab(3, profile="wan") as lab:
        peers: list[subprocess.Popen[str]] = []
        initial: list[str] = []
        for host, value in zip(lab.hosts, values, strict=True):
            argv = [sys.executable, str(PEER), "--host", host.address, "--value", str(value)]
            argv += ["--mean", "2", "--size", str(1 << 20), "--group", "3"]
            argv += ["--peers", json.dumps(initial)]
            process = host.popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            peers.append(process)
            initial = initial or _read_json(process)["maddrs"]
            if len(peers) > 1:
                _read_json(process)
        for process in peers:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        results = [_read_json(process) for process in peers]
        stats = lab.stats()
    for result in results:
        assert result["group"] == 3
        assert result["contributors"] == 3
        assert result["incomplete"] is False
        assert result["max_error"] == 0.0
    assert sum(host["tx_bytes"] for host in stats) > 2 * (4 << 20)  # the data went through the lab
