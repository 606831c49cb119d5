"""``swarmavg.optim.DiLoCo`` in separate training processes over TCP on 127.0.0.1 (the workload
of ``swarmavg.testing.workload``, the peer script ``_diloco_peer.py``): four peers train, one is
SIGKILLed mid-run, the others go on and end at the same outer epoch with the same θ_global
and outer state, and a validation loss below the one they started from."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from _jsonl import JsonLinesPeer

pytestmark = [pytest.mark.process, pytest.mark.timeout(150)]

PEER = Path(__file__).resolve().parent / "_diloco_peer.py"
EPOCHS = 8
SYNC_EVERY = 3


def _peer(index: int, log_dir: Path, initial_peers: list[str]) -> JsonLinesPeer:
    """A DiLoCo peer process of this test's run."""
    config = {
        "index": index,
        "initial_peers": initial_peers,
        "run_id": "e2e-diloco",
        "sync_every": SYNC_EVERY,
        "epochs": EPOCHS,
        "batch": 8,
        "lr": 5e-3,
        "deadline": 90,
    }
    return JsonLinesPeer(index, log_dir, [sys.executable, str(PEER), json.dumps(config)])


def test_a_peer_killed_mid_run_the_others_agree(tmp_path: Path) -> None:
    peers: list[JsonLinesPeer] = []
    try:
        peers.append(_peer(0, tmp_path, []))
        maddrs = peers[0].wait_for(lambda e: e["event"] == "listening", 60)["maddrs"]
        peers += [_peer(i, tmp_path, maddrs) for i in range(1, 4)]
        for peer in peers:
            peer.wait_for(lambda e: e["event"] == "ready", 60)
        for peer in peers:  # (each one's first round waits for a read of the others' records)
            peer.send("go")
        start = {p.index: p.wait_for(lambda e: e["event"] == "start", 30) for p in peers}
        peers[3].wait_for(lambda e: e["event"] == "epoch" and e["epoch"] >= 3, 60)
        peers[3].proc.send_signal(signal.SIGKILL)
        assert peers[3].proc.wait(10) == -signal.SIGKILL
        done = [peer.wait_for(lambda e: e["event"] == "done", 90) for peer in peers[:3]]
        for peer in peers[:3]:
            peer.send("stop")
        for peer in peers[:3]:
            peer.wait_for(lambda e: e["event"] == "exit", 30)
            assert peer.proc.wait(30) == 0
    finally:
        for peer in peers:
            peer.close()
    assert [d["epoch"] for d in done] == [EPOCHS] * 3
    assert len({d["digest"] for d in done}) == 1, done  # one θ_global and outer state
    for d in done:
        assert d["val_loss"] < start[0]["val_loss"] - 0.3, (start[0], d)
        assert d["averaged"] >= 1
    assert len({s["val_loss"] for s in start.values()}) == 1  # (the same initial weights)
    for peer in peers[:3]:
        log = peer.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
        assert " ERROR " not in log, log[-3000:]
