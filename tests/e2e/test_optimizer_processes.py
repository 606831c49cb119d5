"""``swarmavg.Optimizer`` in separate training processes over TCP (the workload of
``swarmavg.testing.workload``, the peer script of ``benchmarks/optimizer.py``): a peer killed
mid-epoch does not stop the others, and Ctrl+C stops a training process cleanly."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from _jsonl import JsonLinesPeer

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "_optimizer_peer.py"


def _peer(index: int, log_dir: Path, *extra: str) -> JsonLinesPeer:
    """A ``swarmavg.Optimizer`` peer process (the benchmark's peer script) of a run of 3."""
    argv = [
        sys.executable,
        str(PEER),
        "--system=swarmavg",
        f"--peer={index}",
        "--num-peers=3",
        "--run-id=e2e-optimizer",
        "--target-batch-size=96",
        "--batch-size=16",
        "--matchmaking-time=1.0",
        "--averaging-timeout=10",
        "--deadline=150",
        "--wait-go",
        "--keep-stepping",
        *extra,
    ]
    return JsonLinesPeer(index, log_dir, argv)


def _start(log_dir: Path, count: int, *extra: str) -> list[JsonLinesPeer]:
    first = _peer(0, log_dir, *extra)
    peers = [first]
    try:
        ready = first.wait_for(lambda e: e["event"] == "ready", 120)
        initial = ["--initial-peers", *ready["maddrs"]]
        peers += [_peer(i, log_dir, *initial, *extra) for i in range(1, count)]
        for peer in peers[1:]:
            peer.wait_for(lambda e: e["event"] == "ready", 120)
        go = json.dumps({"go": time.monotonic() + 0.5})
        for peer in peers:
            peer.send(go)
    except BaseException:
        for peer in peers:
            peer.close()
        raise
    return peers


def test_a_peer_killed_mid_epoch_does_not_stop_the_others(tmp_path: Path) -> None:
    peers = _start(tmp_path, 3, "--epochs=6")
    try:
        peers[2].wait_for(lambda e: e["event"] == "epoch" and e["epoch"] >= 2, 120)
        peers[2].proc.send_signal(signal.SIGKILL)
        for peer in peers[:2]:
            done = peer.wait_for(lambda e: e["event"] == "done", 120)
            assert done["epoch"] == 6
            assert done["timed_out"] is False
        for peer in peers[:2]:
            peer.send("stop")
        for peer in peers[:2]:
            assert peer.wait_for(lambda e: e["event"] == "exit", 30)["shutdown_s"] < 7
    finally:
        for peer in peers:
            peer.close()


def test_ctrl_c_stops_a_training_process_cleanly(tmp_path: Path) -> None:
    peers = _start(tmp_path, 2, "--epochs=50")
    try:
        peers[1].wait_for(lambda e: e["event"] == "epoch" and e["epoch"] >= 1, 120)
        peers[1].proc.send_signal(signal.SIGINT)
        began = time.monotonic()
        exit_event = peers[1].wait_for(lambda e: e["event"] == "exit", 30)
        peers[1].proc.wait(30)
        # shutdown_timeout is 5 s; the process is gone well before the others notice
        assert time.monotonic() - began < 15
        assert exit_event["shutdown_s"] < 7
        # the survivor goes on training alone
        epoch = peers[0].wait_for(lambda e: e["event"] == "epoch", 60)["epoch"]
        peers[0].wait_for(lambda e: e["event"] == "epoch" and e["epoch"] >= epoch + 2, 60)
    finally:
        for peer in peers:
            peer.close()
