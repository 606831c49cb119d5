"""Training over the network lab (``swarmavg.testing.netlab``, Linux, root): ``swarmavg.Optimizer``
on the workload of ``swarmavg.testing.workload``, one training process per lab host, while peers
leave and join (churn) or the swarm is split in two and healed (partition); and how fast it
trains there beside ``hivemind.Optimizer`` (speed).

    python benchmarks/network_training.py churn [--peers 6] [--period 20] [--changes 8]
    python benchmarks/network_training.py partition [--peers 6] [--split 30] [--settle 60]
    python benchmarks/network_training.py speed [--peers 4] [--systems swarmavg,hivemind]
        [--target-loss 2.8] [--limit 240]
        common: [--profile wan] [--seed 0] [--logs DIR] [--json FILE]

Every training process is ``benchmarks/_optimizer_peer.py --system swarmavg`` with its DHT on
its host's address (``--host``) and ``--probe`` (each ``epoch`` event carries a fingerprint of
the parameters). The peers start at once (no go), the first alone, the others bootstrapping
from it; a joiner bootstraps from a live peer.

- ``churn``: a change ``--period`` seconds after the previous one was done, alternately: a
  random live peer is SIGKILLed (its process group), then a fresh process (a new identity)
  starts in the host it left (done once it is ready).
  Checks: every peer's epochs only go up; after every change the swarm's epoch advances
  before the next one; a joiner downloads the state (its first epoch after 0 is the swarm's,
  not 1) and reaches the epoch the swarm had when it joined within one period; the swarm's
  validation loss at the end is below ``--loss-below``.
- ``partition``: after ``--warmup`` seconds the links between the two halves are cut (the
  emulator drops every frame between a host of one half and one of the other; each half
  still reaches itself) for ``--split`` seconds, then healed. Checks: both halves advance
  their epochs while split; after healing, within ``--settle`` seconds, every peer reports
  the same epoch with parameters within ``--tolerance`` (relative L2 distance of their
  probes) of each other, and every peer's epochs only go up.

- ``speed``: each of ``--systems`` in turn on the same lab (its first ``--peers`` hosts):
  ``swarmavg.Optimizer``, then ``hivemind.Optimizer`` 1.1.12 (``_optimizer_peer.py --system
  hivemind`` under :data:`HIVEMIND_PYTHON`, its DHT and p2pd daemon in the host), both with
  :data:`OPTIONS` (the same target batch, batch, Adam at 2e-3 with the warmup,
  ``matchmaking_time``, ``averaging_timeout``; the library defaults otherwise) and the same
  corpus, from the go until peer 0's validation loss (it alone evaluates, at every epoch) is
  at or below ``--target-loss``, ``--limit`` seconds at most; then its processes are killed.
  A row: the swarm's samples per second (what the peers fed to ``step()`` in the epochs
  they ended, over the time), the seconds from the go to the target, the epoch there, the
  loss, the samples per epoch (hivemind's peers go on accumulating while they gather a
  group), the start-up and the machine's load (at the go and at the stop) and busy share.
  Status 1 unless every system that ran reached the target.

The lab's hosts all get ``--profile`` (``wan``: 100 Mbit/s, 40 ms, 0.1% loss), one-packet
frames (independent losses). The run's knobs are :data:`OPTIONS` (short epochs: 256 samples
of the swarm, ~3 steps of 16 per peer); the suite's versions are
``tests/netlab/test_netlab_training.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmavg.testing.netlab import NetLab

PEER = Path(__file__).with_name("_optimizer_peer.py")
ROOT = Path(__file__).parents[1]
#: the training processes' options (``_optimizer_peer.py`` flags)
OPTIONS: dict[str, Any] = {
    "target-batch-size": 256,
    "batch-size": 16,
    "matchmaking-time": 1.0,
    "averaging-timeout": 10.0,
    "warmup-epochs": 2,
    "eval-every": 5,
    "eval-batches": 4,
    "startup-timeout": 60.0,
}
STARTUP = 90.0
#: hivemind 1.1.12's Python (a venv with ``hivemind==1.1.12``), for ``speed``'s reference
HIVEMIND_PYTHON = Path("/tmp/hm-venv/bin/python")
#: the peers' ``--num-peers`` (their streams of batches are keyed by their index below it)
MAX_PEERS = 64


class TrainPeer:
    """A ``_optimizer_peer.py`` process in lab host ``host`` (peer ``index`` of the run: its
    stream of batches) and a thread collecting its events (with the driver's arrival time).
    ``system``: its ``--system`` (``swarmavg``, or ``hivemind`` under :data:`HIVEMIND_PYTHON`,
    without this checkout on its path)."""

    def __init__(
        self,
        lab: NetLab,
        host: int,
        index: int,
        initial: Sequence[str],
        log: Path,
        options: dict[str, Any],
        run_id: str,
        wait_go: bool = False,
        system: str = "swarmavg",
    ) -> None:
        self.host = host
        self.index = index
        self._log = log.open("a")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if system == "hivemind":
            python = str(HIVEMIND_PYTHON)
            env.pop("PYTHONPATH", None)
        else:
            python = sys.executable
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        argv = [
            *(python, str(PEER), f"--system={system}", "--probe", "--epochs=1000000"),
            *(f"--peer={index}", f"--num-peers={max(MAX_PEERS, index + 1)}"),
            *(f"--run-id={run_id}", f"--host={lab.host(host).address}"),
            *(
                f"--{key}" if value is True else f"--{key}={value}"
                for key, value in options.items()
            ),
        ]
        if wait_go:
            argv.append("--wait-go")
        if initial:
            argv += ["--initial-peers", *initial]
        self.proc: subprocess.Popen[str] = lab.host(host).popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self.exited = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.maddrs: list[str] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    event = json.loads(line)
                    event["at"] = time.monotonic()
                    with self._changed:
                        self.events.append(event)
                        self._changed.notify_all()
        except (OSError, ValueError):
            pass
        with self._changed:
            self.exited = True
            self._changed.notify_all()

    def wait(self, predicate: Callable[[dict[str, Any]], bool], deadline: float) -> dict[str, Any]:
        """The first event (of all so far) for which ``predicate`` holds; ``TimeoutError`` at
        ``deadline``, ``RuntimeError`` if the process exited without one."""
        with self._changed:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                if self.exited:
                    raise RuntimeError(f"peer {self.index} exited (code {self.proc.poll()})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"peer {self.index}: no such event in time")
                self._changed.wait(left)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_ready(self, deadline: float) -> TrainPeer:
        self.maddrs = self.wait(lambda e: e["event"] == "ready", deadline)["maddrs"]
        return self

    def epochs(self) -> list[dict[str, Any]]:
        """The ``epoch`` events so far, in order."""
        with self._changed:
            return [e for e in self.events if e["event"] == "epoch"]

    @property
    def epoch(self) -> int:
        """The last epoch reported (-1: none yet)."""
        epochs = self.epochs()
        return int(epochs[-1]["epoch"]) if epochs else -1

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (its process group), and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._reader.join(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()


class TrainSwarm:
    """One training process in each of the first ``peers`` hosts of ``lab`` (``system``: see
    :class:`TrainPeer`; ``first_options``: peer 0's options beside ``options``)."""

    def __init__(
        self,
        lab: NetLab,
        peers: int,
        logs: Path,
        options: dict[str, Any] | None = None,
        run_id: str = "lab",
        system: str = "swarmavg",
        first_options: dict[str, Any] | None = None,
    ) -> None:
        self.lab = lab
        self.logs = logs
        self.options = {**OPTIONS, **(options or {})}
        self.first_options = first_options or {}
        self.run_id = run_id
        self.system = system
        self.peers: list[TrainPeer] = []
        self._indices = itertools.count()
        self.go = math.inf
        try:  # (the first alone, then the others from it; they start training together)
            self.peers.append(self._start(0, wait_go=True).wait_ready(time.monotonic() + STARTUP))
            self.peers += [self._start(h, wait_go=True) for h in range(1, peers)]
            deadline = time.monotonic() + STARTUP
            for peer in self.peers[1:]:
                peer.wait_ready(deadline)
            #: when the peers start training (``time.monotonic()``; their events' ``t`` is from it)
            self.go = time.monotonic() + 0.5
            for peer in self.peers:
                peer.send(json.dumps({"go": self.go}))
        except BaseException:
            self.close()
            raise

    def _start(self, host: int, wait_go: bool = False) -> TrainPeer:
        live = [p for p in self.peers if p.alive and p.maddrs]
        initial = live[-1].maddrs if live else []
        index = next(self._indices)
        log = self.logs / f"{self.system}-peer{index}-host{host}.log"
        options = {**self.options, **self.first_options} if index == 0 else self.options
        return TrainPeer(
            self.lab,
            host,
            index,
            initial,
            log,
            options,
            self.run_id,
            wait_go=wait_go,
            system=self.system,
        )

    @property
    def live(self) -> list[TrainPeer]:
        return [p for p in self.peers if p.alive]

    def epoch(self) -> int:
        """The swarm's epoch: the highest the live peers reported."""
        return max((p.epoch for p in self.live), default=-1)

    def wait_epoch(self, above: int, deadline: float, peers: Sequence[TrainPeer] = ()) -> int:
        """Wait until one of ``peers`` (default: the live ones) reports an epoch above
        ``above``; returns it (``TimeoutError`` at ``deadline``)."""
        while True:
            group = list(peers) or self.live
            best = max((p.epoch for p in group), default=-1)
            if best > above:
                return best
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no epoch above {above} in time (at {best})")
            time.sleep(0.1)

    def join(self, host: int) -> TrainPeer:
        """A fresh process in ``host`` (bootstrapping from a live peer), once it is ready."""
        peer = self._start(host)
        self.peers.append(peer)
        return peer.wait_ready(time.monotonic() + STARTUP)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


def losses(peers: Sequence[TrainPeer]) -> list[tuple[int, float]]:
    """(epoch, validation loss) of the last evaluation of each of ``peers``."""
    out = []
    for peer in peers:
        evaluated = [e for e in peer.epochs() if "val_loss" in e]
        if evaluated:
            out.append((int(evaluated[-1]["epoch"]), float(evaluated[-1]["val_loss"])))
    return out


def regressions(peers: Sequence[TrainPeer]) -> list[str]:
    """Where a peer's reported epoch went down (or repeated)."""
    problems = []
    for peer in peers:
        epochs = [int(e["epoch"]) for e in peer.epochs()]
        for before, after in itertools.pairwise(epochs):
            if after <= before:
                problems.append(f"peer {peer.index}: epoch {before} then {after}")
    return problems


# -- churn


@dataclasses.dataclass
class Change:
    """One change of a churn run: ``kind`` (``leave``/``join``), the peer, when, the swarm's
    epoch then, and what followed: the swarm's epoch before the next change, and for a
    joiner the epochs it reported and when it reached ``epoch``."""

    kind: str
    peer: int
    host: int
    at: float
    epoch: int
    epoch_after: int = -1
    joiner_epochs: list[int] = dataclasses.field(default_factory=list)
    caught_up_s: float | None = None


def churn(swarm: TrainSwarm, changes: int, period: float, seed: int) -> list[Change]:
    """Make ``changes`` changes (leave, join, leave, ...), each ``period`` seconds after the
    previous one was done (a joiner is done once its process is ready), and return them (see
    the module docstring), a period after the last one."""
    rng = random.Random(seed)
    done: list[Change] = []
    free: list[int] = []
    last = time.monotonic()
    for k in range(changes):
        time.sleep(max(0.0, last + period - time.monotonic()))
        if done:
            done[-1].epoch_after = swarm.epoch()
        epoch = swarm.epoch()
        if k % 2 == 0:
            victim = rng.choice(swarm.live)
            victim.kill()
            free.append(victim.host)
            done.append(Change("leave", victim.index, victim.host, time.monotonic(), epoch))
        else:
            joiner = swarm.join(free.pop(0))
            done.append(Change("join", joiner.index, joiner.host, time.monotonic(), epoch))
        last = done[-1].at
    time.sleep(max(0.0, last + period - time.monotonic()))
    done[-1].epoch_after = swarm.epoch()
    for change in done:
        if change.kind == "join":
            peer = next(p for p in swarm.peers if p.index == change.peer)
            change.joiner_epochs = [int(e["epoch"]) for e in peer.epochs()]
            reached = [e for e in peer.epochs() if e["epoch"] >= change.epoch]
            if reached:
                change.caught_up_s = reached[0]["at"] - change.at
    return done


def churn_problems(swarm: TrainSwarm, changes: Sequence[Change], period: float) -> list[str]:
    """What a churn run broke (empty: nothing)."""
    problems = regressions(swarm.peers)
    for change in changes:
        if change.epoch_after <= change.epoch:
            problems.append(f"{change}: the swarm's epoch did not advance")
        if change.kind == "join":
            after_zero = [e for e in change.joiner_epochs if e > 0]
            if not after_zero or after_zero[0] < change.epoch:
                problems.append(f"{change}: the joiner did not start at the swarm's epoch")
            if change.caught_up_s is None or change.caught_up_s > period:
                problems.append(f"{change}: the joiner did not catch up within {period} s")
    return problems


# -- partition


@dataclasses.dataclass
class Partition:
    """What a partition run saw: the hosts of each side; each side's epoch when cut and when
    healed, and the samples its peers fed meanwhile; ``apart``: the largest relative distance
    between the parameters of a peer of one side and one of the other, at the last epoch
    both sides reported before the heal (how far the split drove them apart); and after
    healing the first epoch at which every peer agreed (within the tolerance), how long
    after the heal the last of them reported it, and their largest distance there."""

    halves: list[list[int]]
    cut_epochs: list[int]
    healed_epochs: list[int]
    split_samples: list[int]
    apart: float | None = None
    healed_at: float = 0.0
    agreed_epoch: int | None = None
    agreed_s: float | None = None
    distance: float | None = None


def distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The relative distance between the parameters of two ``epoch`` events (their probes'
    distance over the larger norm)."""
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a["probe"], b["probe"], strict=True)))
    return float(diff / max(a["norm"], b["norm"], 1e-12))


def _by_epoch(peer: TrainPeer, since: float, until: float) -> dict[int, dict[str, Any]]:
    return {int(e["epoch"]): e for e in peer.epochs() if since <= e["at"] < until and "probe" in e}


def agreement(
    peers: Sequence[TrainPeer], since: float, tolerance: float, quorum: int | None = None
) -> tuple[int, float] | None:
    """The first epoch, reported after ``since`` by at least ``quorum`` of ``peers`` (default:
    all), whose parameters there are all within ``tolerance`` of each other: (epoch, largest
    distance), or ``None``. (A peer that keeps resyncing skips epochs: it downloads the
    state instead of reporting them; ``quorum`` lets one such straggler be absent.)"""
    need = len(peers) if quorum is None else quorum
    by_peer = [_by_epoch(p, since, math.inf) for p in peers]
    epochs = sorted({epoch for reported in by_peer for epoch in reported})
    for epoch in epochs:
        events = [reported[epoch] for reported in by_peer if epoch in reported]
        if len(events) < need:
            continue
        worst = max(distance(a, b) for a in events for b in events)
        if worst <= tolerance:
            return epoch, worst
    return None


def apart(sides: Sequence[Sequence[TrainPeer]], since: float, until: float) -> float | None:
    """The largest distance between a peer of ``sides[0]`` and one of ``sides[1]``, each pair
    at the last epoch both reported between ``since`` and ``until`` (``None``: a pair with no
    such epoch)."""
    worst = 0.0
    for a in sides[0]:
        for b in sides[1]:
            ours, theirs = _by_epoch(a, since, until), _by_epoch(b, since, until)
            common = set(ours) & set(theirs)
            if not common:
                return None
            epoch = max(common)
            worst = max(worst, distance(ours[epoch], theirs[epoch]))
    return worst


def partition(
    swarm: TrainSwarm,
    warmup: float,
    split: float,
    settle: float,
    tolerance: float,
    first: int | None = None,
    quorum: int | None = None,
) -> Partition:
    """Split the live peers in two sides (the first ``first``, default half of them, and the
    rest) after ``warmup`` seconds (cutting every path between the sides' hosts), heal it
    ``split`` seconds later, and wait at most ``settle`` seconds for the peers (``quorum`` of
    them, default all) to agree (see :func:`agreement`)."""
    peers = swarm.live
    half = len(peers) // 2 if first is None else first
    sides = [peers[:half], peers[half:]]
    halves = [[p.host for p in side] for side in sides]
    time.sleep(warmup)
    cut_epochs = [max(p.epoch for p in side) for side in sides]
    swarm.lab.partition(*halves)
    cut = time.monotonic()
    time.sleep(split)
    healed_epochs = [max(p.epoch for p in side) for side in sides]
    swarm.lab.partition()
    healed = time.monotonic()
    samples = [
        sum(int(e["samples"]) for p in side for e in p.epochs() if cut <= e["at"] < healed)
        for side in sides
    ]
    result = Partition(halves, cut_epochs, healed_epochs, samples, healed_at=healed)
    result.apart = apart(sides, cut, healed)
    deadline = healed + settle
    while time.monotonic() < deadline:
        found = agreement(peers, healed, tolerance, quorum)
        if found is not None:
            result.agreed_epoch, result.distance = found
            at = max(
                e["at"] for p in peers for e in p.epochs() if e["epoch"] == result.agreed_epoch
            )
            result.agreed_s = at - healed
            break
        time.sleep(0.2)
    return result


def partition_problems(swarm: TrainSwarm, result: Partition, tolerance: float) -> list[str]:
    """What a partition run broke (empty: nothing)."""
    problems = regressions(swarm.peers)
    target = int(swarm.options["target-batch-size"])
    for i, (cut, healed) in enumerate(zip(result.cut_epochs, result.healed_epochs, strict=True)):
        if healed < cut + 2 or result.split_samples[i] < target:
            problems.append(
                f"side {i} did not train while split: epoch {cut} then {healed}, "
                f"{result.split_samples[i]} samples"
            )
    if result.apart is None or result.apart <= 2 * tolerance:
        problems.append(f"the split did not drive the sides apart: {result.apart}")
    if result.agreed_epoch is None:
        problems.append("the peers did not agree on one state after healing")
    return problems


# -- speed


#: ``speed``'s options beside :data:`OPTIONS`: only peer 0 evaluates (:data:`SPEED_FIRST`), the
#: same for both systems (a collaborative optimizer's peers hold one model after each epoch)
SPEED_OPTIONS: dict[str, Any] = {"eval-every": 0}
#: peer 0's: the validation loss (8 batches of 64 windows) at every epoch
SPEED_FIRST: dict[str, Any] = {"eval-every": 1, "eval-batches": 8}


@dataclasses.dataclass
class Speed:
    """One system's ``speed`` run. ``status``: ``reached`` (the target loss), ``time limit``,
    ``skipped: ...`` or ``failed: ...``; ``startup_s``: from the first process's start until
    the go (every peer ready, and 0.5 s); from the go: ``reached_s`` (peer 0's first
    evaluation at or below the target: seconds, and the epoch there), ``samples`` (what the
    peers fed to ``step()`` in the epochs they ended until then, or until the stop),
    ``samples_per_s`` (that over the time),
    ``loss`` (peer 0's last evaluation then), ``evaluations`` (peer 0's: ``[t, epoch, loss]``);
    the machine: ``load`` (1-minute load average at the go and at the stop) and ``busy`` (its
    busy share of its CPUs meanwhile)."""

    system: str
    status: str
    target_loss: float
    limit_s: float
    startup_s: float | None = None
    reached_s: float | None = None
    epoch: int | None = None
    samples: int = 0
    samples_per_s: float | None = None
    loss: float | None = None
    evaluations: list[list[float]] = dataclasses.field(default_factory=list)
    load: list[float] = dataclasses.field(default_factory=list)
    busy: float | None = None


def _averaging_common() -> Any:
    """``benchmarks/_averaging_common.py`` (hivemind's sockets, the machine's busy time)."""
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import _averaging_common

    return _averaging_common


def speed(
    lab: NetLab,
    system: str,
    peers: int,
    logs: Path,
    target_loss: float,
    limit: float,
    options: dict[str, Any] | None = None,
) -> Speed:
    """``peers`` processes of ``system`` (``swarmavg`` or ``hivemind``) in the first hosts of
    ``lab``, training from the go until peer 0 evaluates a validation loss at or below
    ``target_loss``, or for ``limit`` seconds at most; then every process is killed. Options:
    :data:`OPTIONS`, :data:`SPEED_OPTIONS`, then ``options``."""
    result = Speed(system, "", target_loss, limit)
    if system == "hivemind" and not HIVEMIND_PYTHON.exists():
        result.status = f"skipped: no {HIVEMIND_PYTHON} (a venv with hivemind==1.1.12)"
        return result
    common = _averaging_common()
    sockets = common.hivemind_sockets()
    began = time.monotonic()
    run_id = f"speed-{system}-{os.getpid()}-{random.randrange(1 << 30):x}"
    stdlib = sysconfig.get_paths()["stdlib"]  # (the same corpus under both Pythons)
    merged = {**SPEED_OPTIONS, "deadline": limit + 30, "stdlib": stdlib, **(options or {})}
    try:
        swarm = TrainSwarm(lab, peers, logs, merged, run_id, system, SPEED_FIRST)
    except (TimeoutError, RuntimeError) as exc:
        result.status = f"failed: did not start: {exc}"
        common.remove_stale_sockets(sockets)
        return result
    try:
        result.startup_s = swarm.go - began
        time.sleep(max(0.0, swarm.go - time.monotonic()))
        busy = common.machine_busy_seconds()
        result.load.append(os.getloadavg()[0])
        first = swarm.peers[0]

        def reached(event: dict[str, Any]) -> bool:
            return event["event"] == "epoch" and event.get("val_loss", math.inf) <= target_loss

        try:
            hit: dict[str, Any] | None = first.wait(reached, swarm.go + limit)
            result.status = "reached"
        except TimeoutError:
            hit = None
            result.status = "time limit"
        except RuntimeError as exc:
            hit = None
            result.status = f"failed: {exc}"
        stopped = time.monotonic()
        result.load.append(os.getloadavg()[0])
        busy_after = common.machine_busy_seconds()
        if busy is not None and busy_after is not None:
            result.busy = (busy_after - busy) / (os.cpu_count() or 1) / (stopped - swarm.go)
        until = float(hit["t"]) if hit is not None else stopped - swarm.go
        evaluated = [e for e in first.epochs() if "val_loss" in e and e["t"] <= until]
        result.evaluations = [[e["t"], e["epoch"], e["val_loss"]] for e in evaluated]
        if evaluated:
            result.loss = float(evaluated[-1]["val_loss"])
        result.epoch = max(
            (int(e["epoch"]) for p in swarm.peers for e in p.epochs() if e["t"] <= until),
            default=None,
        )
        result.samples = sum(
            int(e["samples"]) for p in swarm.peers for e in p.epochs() if e["t"] <= until
        )
        if hit is not None:
            result.reached_s = until
            result.epoch = int(hit["epoch"])
        if until > 0:
            result.samples_per_s = result.samples / until
    finally:
        swarm.close()
        common.remove_stale_sockets(sockets)
    return result


def speed_table(results: Sequence[Speed]) -> str:
    """The markdown table of ``speed`` results."""
    lines = [
        "| system | status | samples/s | to the target (s) | epochs | loss | samples/epoch "
        "| startup (s) | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def number(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in results:
        lines.append(
            f"| {r.system} | {r.status} | {number(r.samples_per_s, '.0f')} | "
            f"{number(r.reached_s, '.1f')} | {'' if r.epoch is None else r.epoch} | "
            f"{number(r.loss, '.3f')} | "
            f"{number(r.samples / r.epoch if r.epoch else None, '.0f')} | "
            f"{number(r.startup_s, '.1f')} | "
            + " / ".join(f"{x:.1f}" for x in r.load)
            + (f" (busy {r.busy:.2f})" if r.busy is not None else "")
            + " |"
        )
    return "\n".join(lines)


# -- the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=("churn", "partition", "speed"))
    parser.add_argument("--peers", type=int, default=None, help="6; speed: 4")
    parser.add_argument("--profile", default="wan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--period", type=float, default=20.0, help="churn: seconds per change")
    parser.add_argument("--changes", type=int, default=8, help="churn: how many")
    parser.add_argument("--loss-below", type=float, default=3.5, help="churn: at the end")
    parser.add_argument("--warmup", type=float, default=10.0, help="partition: before the cut")
    parser.add_argument("--split", type=float, default=30.0, help="partition: seconds cut")
    parser.add_argument("--settle", type=float, default=60.0, help="partition: to agree")
    parser.add_argument("--tolerance", type=float, default=5e-3, help="partition")
    parser.add_argument(
        "--first", type=int, default=None, help="partition: peers in the first side"
    )
    parser.add_argument(
        "--systems", default="swarmavg,hivemind", help="speed: which, in this order"
    )
    parser.add_argument("--target-loss", type=float, default=2.8, help="speed: validation loss")
    parser.add_argument("--limit", type=float, default=240.0, help="speed: seconds per system")
    parser.add_argument("--verbose", action="store_true", help="the peers log every event")
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="network-training-"))
    logs.mkdir(parents=True, exist_ok=True)
    if args.scenario == "speed":
        return main_speed(args, logs)
    args.peers = args.peers or 6
    report: dict[str, Any] = {"scenario": args.scenario, "profile": args.profile}
    with NetLab(args.peers, profile=args.profile, seed=args.seed, offload=False) as lab:
        swarm = TrainSwarm(lab, args.peers, logs, {"verbose": True} if args.verbose else None)
        try:
            if args.scenario == "churn":
                changes = churn(swarm, args.changes, args.period, args.seed)
                problems = churn_problems(swarm, changes, args.period)
                final = losses(swarm.live)
                if not final or max(loss for _, loss in final) >= args.loss_below:
                    problems.append(f"validation loss not below {args.loss_below}: {final}")
                report["changes"] = [dataclasses.asdict(c) for c in changes]
                report["losses"] = final
                for change in changes:
                    print(
                        f"{change.kind:5} peer {change.peer} (host {change.host}) at epoch "
                        f"{change.epoch}, swarm at {change.epoch_after} a period later"
                        + (
                            f"; caught up in {change.caught_up_s:.1f} s"
                            if change.caught_up_s is not None
                            else ""
                        )
                    )
                print(f"losses at the end (epoch, loss): {final}")
            else:
                result = partition(
                    swarm, args.warmup, args.split, args.settle, args.tolerance, args.first
                )
                problems = partition_problems(swarm, result, args.tolerance)
                report["partition"] = dataclasses.asdict(result)
                print(json.dumps(report["partition"]))
        finally:
            swarm.close()
    report["problems"] = problems
    report["epochs"] = {
        p.index: [
            {key: e[key] for key in ("epoch", "at", "norm", "probe", "val_loss") if key in e}
            for e in p.epochs()
        ]
        for p in swarm.peers
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    for problem in problems:
        print("PROBLEM:", problem)
    print(f"logs: {logs}; {len(problems)} problem(s)")
    return 1 if problems else 0


def main_speed(args: argparse.Namespace, logs: Path) -> int:
    """``speed``: each of ``--systems`` in turn on one lab; the table, ``--json``; status 1
    unless every system that ran reached the target."""
    peers = args.peers or 4
    systems = [name for name in args.systems.split(",") if name]
    unknown = sorted(set(systems) - {"swarmavg", "hivemind"})
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown} (swarmavg, hivemind)")
    options = {"verbose": True} if args.verbose else None
    results: list[Speed] = []
    uptime = [f"{time.strftime('%H:%M:%S')} load {os.getloadavg()}"]
    began = time.monotonic()
    with NetLab(peers, profile=args.profile, seed=args.seed, offload=False) as lab:
        for system in systems:
            print(f"{system}: {peers} peers on {args.profile} ...", flush=True)
            result = speed(lab, system, peers, logs, args.target_loss, args.limit, options)
            results.append(result)
            print(speed_table([result]).splitlines()[-1], flush=True)
    uptime.append(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()}")
    print(
        f"\n{peers} peers on {args.profile}, target validation loss {args.target_loss}, "
        f"at most {args.limit:.0f} s each ({time.monotonic() - began:.0f} s in all); "
        f"load from {uptime[0]} to {uptime[-1]}\n"
    )
    print(speed_table(results))
    report = {
        "scenario": "speed",
        "profile": args.profile,
        "peers": peers,
        "options": {**OPTIONS, **SPEED_OPTIONS},
        "first_options": SPEED_FIRST,
        "uptime": uptime,
        "results": [dataclasses.asdict(r) for r in results],
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"logs: {logs}")
    ran = [r for r in results if not r.status.startswith("skipped")]
    return 0 if ran and all(r.status == "reached" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
