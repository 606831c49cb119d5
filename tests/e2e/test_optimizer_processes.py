"""``swarmavg.Optimizer`` in separate training processes over TCP (the workload of
``swarmavg.testing.workload``, the peer script of ``benchmarks/optimizer.py``): a peer killed
mid-epoch does not stop the others, and Ctrl+C stops a training process cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "_optimizer_peer.py"


class Peer:
    def __init__(self, index: int, log_dir: Path, *extra: str) -> None:
        self.index = index
        self.log_path = log_dir / f"peer{index}.log"
        log = self.log_path.open("w")
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.proc = subprocess.Popen(
            [
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
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "eof"})

    def wait_for(self, predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"peer {self.index}: no such event within {timeout} s"
            event = self.events.get(timeout=remaining)
            if event["event"] in ("error", "eof"):
                tail = self.log_path.read_text(errors="replace")[-1500:]
                raise AssertionError(f"peer {self.index}: {event}\n{tail}")
            if predicate(event):
                return event

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _start(log_dir: Path, count: int, *extra: str) -> list[Peer]:
    first = Peer(0, log_dir, *extra)
    peers = [first]
    try:
        ready = first.wait_for(lambda e: e["event"] == "ready", 120)
        initial = ["--initial-peers", *ready["maddrs"]]
        peers += [Peer(i, log_dir, *initial, *extra) for i in range(1, count)]
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
