"""A peer SIGKILLed in the middle of an all-reduce, with real processes over TCP on 127.0.0.1:
four peer processes (``_kill_peer.py``, the sync facade ``swarmavg.DHT`` +
``swarmavg.DecentralizedAverager``, driven by JSON lines) step together with
``sender_timeout=1``, ``reducer_timeout=3``; one is killed (or stopped with SIGSTOP: it
stalls) 0–0.3 s after all four report that their all-reduce began. The three survivors must
finish soon after, each with a result that is incomplete and names the dead peer (or complete,
if the dead peer's part was done), and they must agree: the same elements kept local by each,
the same values everywhere else.

Peer ``i``'s tensor is all ``10**i``: the mean of any two or more of them is none of those, so
an element a survivor kept local is exactly one that still holds its own value."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest

pytestmark = pytest.mark.process

PEER = Path(__file__).with_name("_kill_peer.py")
PEERS = 4
SIZE = 8 << 20  # float32 elements: a round of ~0.5 s or more on loopback
STEP_TIMEOUT = 15.0
FINISH_WITHIN = 10.0  # survivors done this long after the kill
OPTIONS = {
    "sender_timeout": 1.0,
    # a reducer may wait sender_timeout for the dead peer before it answers anything: the
    # rest is slack for four busy processes on two cores
    "reducer_timeout": 3.0,
    "allreduce_timeout": 20.0,
    "request_timeout": 3.0,
    "averaging_expiration": 5.0,
}


class _Proc:
    """A peer process and a thread that reads its JSON lines into a queue."""

    def __init__(self, index: int, log: Path) -> None:
        self.index = index
        self._log = log.open("w")
        self.proc = forkserver.popen(
            [sys.executable, str(PEER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, **request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, deadline: float) -> dict[str, Any]:
        while True:
            try:
                got = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"peer {self.index}: no {event!r} in time") from None
            if got is None:
                raise RuntimeError(f"peer {self.index} exited (code {self.proc.poll()})")
            if got.get("event") == event:
                return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


def _run(
    tmp_path: Path, victim: int, kill_after: float, how: signal.Signals, transport: str = "tcp"
) -> None:
    procs: list[_Proc] = []
    try:
        procs = [_Proc(i, tmp_path / f"peer{i}.log") for i in range(PEERS)]
        deadline = time.monotonic() + 90
        prefix = f"kill_{uuid.uuid4().hex[:8]}"
        ids: list[str] = []
        seeds: list[str] = []
        for i, proc in enumerate(procs):
            proc.send(
                op="start",
                initial_peers=seeds,
                size=SIZE,
                value=10.0**i,
                prefix=prefix,
                group_size=PEERS,
                options=OPTIONS,
                transport=transport,
            )
            started = proc.expect("started", deadline)
            ids.append(started["peer_id"])
            if not seeds:
                seeds = started["maddrs"]
        for i, proc in enumerate(procs):
            proc.send(op="step", timeout=STEP_TIMEOUT, out=str(tmp_path / f"peer{i}.npy"))
        deadline = time.monotonic() + STEP_TIMEOUT + 10
        for proc in procs:
            proc.expect("stepping", deadline)
        time.sleep(kill_after)
        procs[victim].proc.send_signal(how)  # SIGKILL, or SIGSTOP: it stalls (killed at the end)
        killed_at = time.monotonic()
        if how == signal.SIGKILL:
            procs[victim].proc.wait(timeout=10)
        survivors = [i for i in range(PEERS) if i != victim]
        results = {}
        for i in survivors:
            results[i] = procs[i].expect("result", killed_at + FINISH_WITHIN + 5)
        dead = ids[victim]
        for i, got in results.items():
            assert "error" not in got, f"peer {i}: {got['error']}"
            assert got["t"] - killed_at < FINISH_WITHIN, f"peer {i} took {got['t'] - killed_at}"
            assert sorted(got["group"]) == sorted(ids)
            named = {p for p, _ in got["local_spans"]} | {s for _, s, _ in got["dropped"]}
            if got["incomplete"]:
                assert dead in named, f"peer {i}: {got['local_spans']} {got['dropped']}"
                # nobody else is blamed: only the dead peer failed
                assert {p for p, _ in got["local_spans"]} <= {dead}, got["local_spans"]
                assert {s for _, s, _ in got["dropped"]} <= {dead}, got["dropped"]
        values = {i: 10.0**i for i in range(PEERS)}
        everyone = np.float32(sum(values.values()) / PEERS)
        without = np.float32(sum(v for i, v in values.items() if i != victim) / (PEERS - 1))
        tensors = {i: np.load(tmp_path / f"peer{i}.npy") for i in survivors}
        kept = {}
        for i, tensor in tensors.items():
            assert tensor.shape == (SIZE,)
            kept[i] = tensor == np.float32(values[i])
            averaged = (tensor == everyone) | (tensor == without)
            assert (kept[i] | averaged).all(), f"peer {i}: values that are no mean of the group"
            if kept[i].any():
                assert results[i]["incomplete"], f"peer {i}"
                assert results[i]["local_spans"], f"peer {i}"
            if not results[i]["incomplete"]:
                assert (tensor == everyone).all(), f"peer {i}: complete but not the mean"
        for a in survivors:
            for b in survivors:
                if a < b:
                    # what one averaged, the other did too (relayed if the victim died while
                    # answering), to the same values
                    assert np.array_equal(kept[a], kept[b]), (a, b)
                    both = ~kept[a] & ~kept[b]
                    assert np.array_equal(tensors[a][both], tensors[b][both]), (a, b)
        print(
            f"victim {victim} killed {kill_after} s in:",
            {
                i: (
                    f"{got['t'] - killed_at:.2f} s after the kill, incomplete={got['incomplete']},"
                    f" kept local {kept[i].mean():.0%}"
                )
                for i, got in results.items()
            },
        )
    except BaseException:
        for i in range(len(procs)):  # (pytest shows what the test printed when it fails)
            log = (tmp_path / f"peer{i}.log").read_text(errors="replace").splitlines()
            print(f"--- peer {i} log (last 40 lines):", *log[-40:], sep="\n")
        raise
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victim", "kill_after", "how", "transport"),
    [
        pytest.param(3, 0.0, signal.SIGKILL, "tcp", id="at-once"),
        pytest.param(0, 0.1, signal.SIGKILL, "tcp", id="bootstrap-peer"),
        pytest.param(1, 0.3, signal.SIGKILL, "tcp", id="later-kill"),
        pytest.param(2, 0.2, signal.SIGSTOP, "tcp", id="stalls"),
        # QUIC knows of a dead peer only when it asks (ICMP answers a probe): survivors used
        # to wait out its keep-alive (45 s), in writes shielded from cancellation
        pytest.param(3, 0.0, signal.SIGKILL, "quic", id="quic-at-once"),
        pytest.param(1, 0.3, signal.SIGKILL, "quic", id="quic-later-kill"),
    ],
)
def test_survivors_finish_and_agree(
    tmp_path: Path, victim: int, kill_after: float, how: signal.Signals, transport: str
) -> None:
    _run(tmp_path, victim, kill_after, how, transport)


@pytest.mark.timeout(120)
def test_a_diverged_peer_is_refused_at_once_and_the_others_average_without_it(
    tmp_path: Path,
) -> None:
    """A new user's scenario: four processes, one of which holds NaN (its training diverged).
    Its step raises NonFiniteTensors at once, naming the tensor, instead of failing after a
    timeout; the three others average completely, in a group of three that does not wait for
    it, and agree exactly."""
    procs: list[_Proc] = []
    try:
        procs = [_Proc(i, tmp_path / f"peer{i}.log") for i in range(PEERS)]
        deadline = time.monotonic() + 90
        prefix = f"nan_{uuid.uuid4().hex[:8]}"
        seeds: list[str] = []
        for i, proc in enumerate(procs):
            proc.send(
                op="start",
                initial_peers=seeds,
                size=1 << 16,
                value=10.0**i,
                prefix=prefix,
                group_size=PEERS,
                options={**OPTIONS, "min_group_size": 2},
            )
            started = proc.expect("started", deadline)
            if not seeds:
                seeds = started["maddrs"]
        procs[1].send(op="poison")
        procs[1].expect("poisoned", deadline)
        began = time.monotonic()
        for i, proc in enumerate(procs):
            proc.send(op="step", timeout=STEP_TIMEOUT, out=str(tmp_path / f"peer{i}.npy"))
        results = {i: proc.expect("result", deadline) for i, proc in enumerate(procs)}
        assert results[1]["error_type"] == "NonFiniteTensors", results[1]
        assert "tensor 0 (float32[65536])" in results[1]["error"]
        assert results[1]["t"] - began < 5
        healthy = [0, 2, 3]
        for i in healthy:
            got = results[i]
            assert "error" not in got, got
            assert not got["incomplete"], got
            assert len(got["group"]) == 3
            assert got["t"] - began < 5  # (not the 5 s averaging_expiration)
        tensors = [np.load(tmp_path / f"peer{i}.npy") for i in healthy]
        mean = np.float32((1 + 100 + 1000) / 3)
        for tensor in tensors:
            assert np.array_equal(tensor, np.full_like(tensor, mean))
    finally:
        for proc in procs:
            proc.stop()
