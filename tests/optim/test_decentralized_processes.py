"""``DecentralizedAdam`` and ``DecentralizedSGD`` in four processes over TCP on 127.0.0.1
training the workload; one is SIGKILLed mid-run; the three others keep training, average among
themselves (rounds begun after the kill succeed), and end with the same parameters and a lower
validation loss. The
peers are driven by ``tests/optim/decentralized_peer.py`` in JSON lines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import forkserver
import numpy as np
import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
PEERS = 4
VICTIM = PEERS - 1
#: the whole exchange, from the first process's start to the last event
DEADLINE = 100.0


def _pythonpath() -> str:
    """The checkout first, then this process's PYTHONPATH (the transports of a checkout
    without an install, as this process has them)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


class _Peers:
    """The peer processes, their events in one queue (a reader thread per process)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[forkserver.Process] = []
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.deadline = time.monotonic() + DEADLINE
        self.done: set[int] = set()  # (these may exit)

    def start(self, index: int, **config: Any) -> None:
        config = {"index": index, "out": str(self.tmp_path), **config}
        stderr = open(self.tmp_path / f"peer{index}.err", "w")  # noqa: SIM115 (closed by Popen's owner)
        proc = forkserver.popen(
            [sys.executable, "-m", "tests.optim.decentralized_peer", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": _pythonpath()},
        )
        stderr.close()
        self.procs.append(proc)
        assert proc.stdout is not None
        threading.Thread(target=self._read, args=(index, proc.stdout), daemon=True).start()

    def _read(self, index: int, stream: IO[str]) -> None:
        for line in stream:
            if line.strip():
                self.events.put((index, json.loads(line)))
        self.events.put((index, {"event": "exited"}))

    def send(self, index: int, **command: Any) -> None:
        stdin = self.procs[index].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def next(self) -> tuple[int, dict[str, Any]]:
        """The next event of any peer; fails the test on an error or an unexpected exit, or
        past the deadline."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"the peers took longer than {DEADLINE} s:\n{self.stderr()}")
        try:
            index, event = self.events.get(timeout=remaining)
        except queue.Empty:
            pytest.fail(f"the peers took longer than {DEADLINE} s:\n{self.stderr()}")
        if event["event"] == "done":
            self.done.add(index)
        if event["event"] == "error" or (
            event["event"] == "exited" and index != VICTIM and index not in self.done
        ):
            pytest.fail(f"peer {index}: {event}\n{self.stderr()}")
        return index, event

    def wait_all(self, name: str, indices: list[int]) -> dict[int, dict[str, Any]]:
        """The event ``name`` of each of ``indices`` (other events dropped)."""
        got: dict[int, dict[str, Any]] = {}
        while set(got) != set(indices):
            index, event = self.next()
            if event["event"] == name and index in indices:
                got[index] = event
        return got

    def stderr(self) -> str:
        return "\n".join(
            f"--- peer {i}:\n" + (self.tmp_path / f"peer{i}.err").read_text()[-3000:]
            for i in range(len(self.procs))
        )

    def close(self) -> None:
        """Kill every process still running and reap them all."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(30)
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.stdout is not None:
                proc.stdout.close()


@contextmanager
def _peers(tmp_path: Path) -> Iterator[_Peers]:
    peers = _Peers(tmp_path)
    try:
        yield peers
    finally:
        peers.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_four_processes_one_killed_the_others_train_and_agree(
    tmp_path: Path, optimizer: str
) -> None:
    config = {"max_steps": 300, "steps_after_kill": 8, "optimizer": optimizer}
    survivors = [i for i in range(PEERS) if i != VICTIM]
    with _peers(tmp_path) as peers:
        for index in range(PEERS):  # (they import torch at once; the others wait for "join")
            peers.start(index, **config)
        maddrs = peers.wait_all("listening", [0])[0]["maddrs"]
        for index in range(1, PEERS):
            peers.send(index, cmd="join", initial_peers=maddrs)
        peers.wait_all("ready", list(range(PEERS)))
        for index in range(PEERS):
            peers.send(index, cmd="go")

        # the victim is killed once it took part in a round and trained on
        while True:
            index, event = peers.next()
            if (
                index == VICTIM
                and event["event"] == "progress"
                and event["step"] >= 8
                and event["rounds_succeeded"] >= 1
            ):
                break
        peers.procs[VICTIM].kill()
        assert peers.procs[VICTIM].wait(30) == -9  # (SIGKILL)
        for index in survivors:
            peers.send(index, cmd="killed")
        trained = peers.wait_all("trained", survivors)
        for index in survivors:
            # rounds begun after the kill (among the survivors) succeeded
            assert trained[index]["rounds_after_kill"] >= 1, (index, trained[index])

        # one more round of the survivors, from parameters that no longer change: retried
        # (bounded) until it is one group of all three
        for _ in range(3):
            for index in survivors:
                peers.send(index, cmd="settle")
            settled = peers.wait_all("settled", survivors)
            if all(e["succeeded"] and e["group_size"] == len(survivors) for e in settled.values()):
                break
        else:
            pytest.fail(f"the survivors never averaged in one group: {settled}")
        for index in survivors:
            peers.send(index, cmd="finish")
        done = peers.wait_all("done", survivors)

    params = [np.load(tmp_path / f"peer{i}.npy", allow_pickle=False) for i in survivors]
    # One round of all three wrote the same mean into each: the delta rule with no local step
    # in between gives v + (mean - v), the mean up to two float32 roundings (~1e-7 * |value|,
    # the parameters are well under 10): 1e-5 bounds that with room, while the peers' own
    # steps (Adam at lr 3e-3, different batches) set them apart by ~1e-3 and more.
    for other in params[1:]:
        assert np.abs(other - params[0]).max() <= 1e-5
    assert not np.allclose(params[0], _initial_parameters(), atol=1e-3)  # (they trained)
    for index in survivors:
        start, end = done[index]["val_start"], done[index]["val_end"]
        assert end < start - 0.5, (index, start, end)  # (from ~5.5, a uniform guess)


def _initial_parameters() -> Any:
    import torch

    from swarmavg.testing import workload

    model = workload.make_model(0)
    with torch.no_grad():
        return torch.cat([p.reshape(-1) for p in model.parameters()]).numpy()
