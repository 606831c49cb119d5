"""Averaging over the network lab (``swarmavg.testing.netlab``), and the randomized fault matrix:
a peer SIGKILLed or cut off at a random stage of a round (Linux, root).

    python benchmarks/network_faults.py [--runs 100] [--seed 0] [--peers 4]
                                        [--transports tcp,quic] [--profiles lan,wan,bad]
                                        [--logs DIR] [--json FILE] [--only RUN,...]

``--peers`` processes (``_netlab_peer.py``: the sync ``swarmavg.DHT`` and
``swarmavg.DecentralizedAverager``), one in each host of one lab, average one float32 tensor;
peer ``i``'s is all ``10**i``, so the mean of any set of peers is none of their values and an
element a peer kept local is exactly one that still holds its own value. The runs are split
evenly over the transports (a swarm per transport, peers reused from run to run). Each run
draws, with ``random.Random(seed)``:

- the profile of every host (``set_profile``, live: the lab is built once, without offload,
  so ``lan`` runs at what the emulator sustains, ~250 Mbit/s here);
- the victim (any peer, the DHT's first one included) and the fault: ``kill`` (SIGKILL to its
  process group) or ``cut`` (``set_link(victim, False)``: a pulled cable, the process lives on
  and its own step must end in time too);
- the stage: ``matchmaking`` (0-0.3 s after the step was asked for, before the victim's
  all-reduce began; if it had begun, the stage recorded is what it was), or a moment of the
  all-reduce measured from when every peer saw it begin, as a fraction of a clean round on the
  same profile and transport (measured first, once each): ``sending`` (0-1/3: parts on their
  way), ``reducing`` (1/3-2/3), ``returning`` (2/3-1: the means coming back); the butterfly
  pipelines its parts, so these stages overlap, and the fraction is what is controlled.

Checks per run (a run that breaks one is a *failure*, with what it broke):

- no hang: every survivor's step ends within ``allreduce_timeout`` (+2 s of slack for two
  shared cores) of a fault in its round, and within its step timeout (+2 s) of its start
  (a fault while matchmaking: the group may form after it); a cut-off victim's step within
  its step timeout (+2 s) of its start (after its round failed it may look for another group
  until then);
- a cut-off victim rejoins by itself: once its link is back, its DHTs hold every other peer
  again within ``REJOIN_WITHIN`` seconds (it is replaced otherwise, and the run fails);
- every survivor's step returns a result (no error);
- survivors in one group agree exactly: the same elements kept local, the same values elsewhere;
  every averaged value is the mean of the group or of the group without the victim;
- every result says who was left out: a result that kept anything local is ``incomplete``, an
  incomplete one names the victim (in ``local_spans`` or ``dropped``) and nobody else, a
  complete one holds the group's mean everywhere.

A run in which survivors did not finish is reported as a hang, and the swarm is restarted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from swarmavg.testing.netlab import PROFILES, NetLab

PEER = Path(__file__).with_name("_netlab_peer.py")
ROOT = Path(__file__).parents[1]
STAGES = ("matchmaking", "sending", "reducing", "returning")
FAULTS = ("kill", "cut")
SLACK = 2.0
#: float32 elements per peer, per profile: a round of well under a second
SIZES = {"lan": 1 << 20, "wan": 1 << 19, "bad": 1 << 16}
#: timeouts of the fault runs (the library's defaults are minutes: a cut link is found by them)
FAULT_OPTIONS: dict[str, Any] = {
    "sender_timeout": 3.0,
    "reducer_timeout": 6.0,
    "allreduce_timeout": 12.0,
    "request_timeout": 3.0,
    "averaging_expiration": 5.0,
}
STEP_TIMEOUT = 25.0
#: a cut-off victim's DHT must hold the others again this long after its link is back (its
#: rejoin pings back off to 4 s while cut off; a try under way at the heal takes its
#: request_timeout and closing the connection more; slack for two shared cores)
REJOIN_WITHIN = 15.0
REJOIN_POLL = 0.25
#: tries of a fault-free reference round (under load one can come back incomplete)
CLEAN_TRIES = 3


class LabPeer:
    """A ``_netlab_peer.py`` process in lab host ``index`` and a thread reading its lines."""

    def __init__(
        self,
        lab: NetLab,
        index: int,
        transports: Sequence[str],
        initial: dict[str, list[str]],
        log: Path,
    ) -> None:
        self.index = index
        self._log = log.open("a")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        host = lab.host(index)
        self.proc: subprocess.Popen[str] = host.popen(
            [
                *(sys.executable, str(PEER), "--host", host.address),
                *("--transports", ",".join(transports), "--peers", json.dumps(initial)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._held: collections.deque[dict[str, Any] | None] = collections.deque()  # (poll's)
        threading.Thread(target=self._read, daemon=True).start()
        self.peer_ids: dict[str, str] = {}
        self.maddrs: dict[str, list[str]] = {}

    def wait_started(self, deadline: float) -> LabPeer:
        """Wait for the process's first line (its DHT is up); returns ``self``."""
        started = self.expect("started", deadline)
        self.peer_ids = started["peer_ids"]
        self.maddrs = started["maddrs"]
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self.lines.put(json.loads(line))
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def send(self, **request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, deadline: float) -> dict[str, Any]:
        """The next line with ``event``; ``TimeoutError`` at ``deadline``, ``RuntimeError`` if
        the process exited."""
        while True:
            try:
                if self._held:
                    got = self._held.popleft()
                else:
                    got = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"peer {self.index}: no {event!r} in time") from None
            if got is None:
                self.lines.put(None)
                raise RuntimeError(f"peer {self.index} exited (code {self.proc.poll()})")
            if got.get("event") == event:
                return got

    def poll(self, event: str) -> dict[str, Any] | None:
        """The first line with ``event`` if one is already there; the lines before it are
        kept for :meth:`expect` (a victim whose step already ended has said ``result``)."""
        while True:
            try:
                got = self.lines.get_nowait()
            except queue.Empty:
                return None
            if got is not None and got.get("event") == event:
                return got
            self._held.append(got)
            if got is None:
                return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()


class LabSwarm:
    """One peer process in each host of ``lab``, with a DHT on each of ``transports``; peer 0
    is the first DHT node. Rounds run on :attr:`transport` (set by :meth:`prepare`)."""

    def __init__(self, lab: NetLab, transports: Sequence[str], logs: Path) -> None:
        self.lab = lab
        self.transports = list(transports)
        self.transport = self.transports[0]
        self.logs = logs
        self.peers: list[LabPeer] = []
        try:  # (the first alone, the others at once, all bootstrapping from the first)
            self.peers.append(self._start(0).wait_started(time.monotonic() + 60))
            self.peers += [self._start(i) for i in range(1, len(lab.hosts))]
            deadline = time.monotonic() + 60
            for peer in self.peers[1:]:
                peer.wait_started(deadline)
        except BaseException:
            self.close()
            raise

    def _start(self, index: int) -> LabPeer:
        live = [p for p in self.peers if p.index != index and p.proc.poll() is None and p.maddrs]
        initial = live[0].maddrs if live else {}
        log = self.logs / f"peer{index}.log"
        return LabPeer(self.lab, index, self.transports, initial, log)

    def rejoined(self, index: int, deadline: float) -> bool:
        """Wait until peer ``index``'s DHTs hold every other peer in their routing tables
        (a peer cut off for a while rejoins by itself: see ``DHTNode._rejoin``), at most until
        ``deadline``; whether they did."""
        peer = self.peers[index]
        while True:
            peer.send(op="dht")
            sizes = peer.expect("dht", deadline)["peers"]
            if all(size >= len(self.peers) - 1 for size in sizes.values()):
                return True
            if time.monotonic() + REJOIN_POLL >= deadline:
                return False
            time.sleep(REJOIN_POLL)

    def replace(self, index: int) -> None:
        """A fresh peer in host ``index`` (the old one killed)."""
        self.peers[index].stop()
        self.peers[index] = self._start(index).wait_started(time.monotonic() + 60)

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()

    def prepare(
        self,
        size: int,
        options: dict[str, Any],
        *,
        transport: str | None = None,
        min_group_size: int | None = None,
    ) -> None:
        """A fresh averager on every peer under a fresh prefix (peer ``i``: all ``10**i``), on
        ``transport`` (by default the last one used)."""
        if transport is not None:
            self.transport = transport
        prefix = f"lab_{uuid.uuid4().hex[:8]}"
        n = len(self.peers)
        for peer in self.peers:
            peer.send(
                op="averager",
                transport=self.transport,
                prefix=prefix,
                size=size,
                value=10.0**peer.index,
                group_size=n,
                min_group_size=n if min_group_size is None else min_group_size,
                options=options,
            )
        deadline = time.monotonic() + 30
        for peer in self.peers:
            peer.expect("ready", deadline)

    def step(self, timeout: float, out: Path | None) -> float:
        """Every peer starts a step; the monotonic time when the last was asked."""
        for peer in self.peers:
            target = None if out is None else str(out / f"peer{peer.index}.npy")
            peer.send(op="step", timeout=timeout, out=target)
        return time.monotonic()


def round_mean(members: Sequence[int]) -> np.float32:
    """The float32 mean of peers ``members``' values, as the reducers compute it (a float32
    sum of integers below 2**24 is exact; one rounding in the division)."""
    total = np.float32(sum(10.0**i for i in members))
    return np.float32(total / np.float32(len(members)))


def check_round(
    swarm: LabSwarm,
    results: dict[int, dict[str, Any]],
    tensors: dict[int, np.ndarray],
    victim: int | None,
) -> list[str]:
    """What the survivors' ``results`` and ``tensors`` break of the checks in the module's
    docstring (empty: all hold)."""
    problems = []
    ids = {peer.peer_ids[swarm.transport]: peer.index for peer in swarm.peers}
    dead = None if victim is None else swarm.peers[victim].peer_ids[swarm.transport]
    kept: dict[int, np.ndarray] = {}
    for i, got in results.items():
        if "error" in got:
            problems.append(f"peer {i}: {got['error']}")
            continue
        members = sorted(ids[p] for p in got["group"] if p in ids)
        if len(members) != len(got["group"]):
            problems.append(f"peer {i}: a group member that is no peer of the swarm")
            continue
        tensor = tensors[i]
        kept[i] = tensor == np.float32(10.0**i)
        means = {round_mean(members)}
        if victim is not None and victim in members and len(members) > 2:
            means.add(round_mean([m for m in members if m != victim]))
        averaged = np.isin(tensor, np.array(sorted(means), dtype=np.float32))
        if not (kept[i] | averaged).all():
            problems.append(f"peer {i}: values that are no mean of its group {members}")
        blamed = {p for p, _ in got["local_spans"]} | {s for _, s, _ in got["dropped"]}
        if kept[i].any() and not got["local_spans"]:
            problems.append(f"peer {i}: kept values local and says no span was")
        if got["incomplete"]:
            if dead is None or dead not in blamed:
                problems.append(f"peer {i}: incomplete, does not name the victim: {blamed}")
            if blamed - {dead}:
                problems.append(f"peer {i}: blames {blamed - {dead}}")
        elif not (tensor == round_mean(members)).all():
            problems.append(f"peer {i}: complete, but not the mean of {members}")
    by_group: dict[str, list[int]] = {}
    for i, got in results.items():
        if i in kept:
            by_group.setdefault(got["group_id"], []).append(i)
    for members in by_group.values():
        for a in members:
            for b in members:
                if a < b:
                    if not np.array_equal(kept[a], kept[b]):
                        problems.append(f"peers {a} and {b} kept different elements local")
                    both = ~kept[a] & ~kept[b]
                    if not np.array_equal(tensors[a][both], tensors[b][both]):
                        problems.append(f"peers {a} and {b} disagree")
    return problems


def clean_round(
    swarm: LabSwarm,
    size: int,
    options: dict[str, Any],
    out: Path,
    *,
    transport: str | None = None,
    timeout: float = STEP_TIMEOUT,
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """One round of every peer on ``transport``, nothing done to it; the results and what they
    break (every peer must be in one complete group and hold the exact mean)."""
    swarm.prepare(size, options, transport=transport)
    swarm.step(timeout, out)
    deadline = time.monotonic() + timeout + 10
    results = {peer.index: peer.expect("result", deadline) for peer in swarm.peers}
    tensors = {i: np.load(out / f"peer{i}.npy") for i, got in results.items() if "error" not in got}
    problems = check_round(swarm, results, tensors, None)
    n = len(swarm.peers)
    for i, got in results.items():
        if "error" not in got and (len(got["group"]) != n or got["incomplete"]):
            problems.append(
                f"peer {i}: group of {len(got['group'])}, incomplete={got['incomplete']}"
            )
    return results, problems


@dataclasses.dataclass
class FaultRun:
    run: int
    transport: str
    profile: str
    fault: str
    stage: str
    victim: int
    delay: float
    stage_seen: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)
    hang: bool = False
    #: seconds from the fault to the last survivor's result
    finish_s: float = 0.0
    #: the survivors' results, trimmed: (group size, incomplete, relayed)
    outcomes: list[tuple[int, bool, int]] = dataclasses.field(default_factory=list)
    #: a cut-off victim's: seconds from the fault to its own step's end
    victim_s: float = 0.0
    #: a cut-off victim's: seconds from its link coming back to its DHTs holding the others
    rejoin_s: float | None = None


def fault_run(
    swarm: LabSwarm,
    number: int,
    profile: str,
    fault: str,
    stage: str,
    victim: int,
    fraction: float,
    round_s: float,
    out: Path,
) -> FaultRun:
    """One run of the matrix (see the module's docstring); the swarm is usable after it (a
    killed victim's peer replaced; a cut-off one's link restored and its DHTs holding the
    others again, or it replaced; everything restarted after a hang)."""
    lab = swarm.lab
    for i in range(len(lab.hosts)):
        lab.set_profile(i, profile)
    options = FAULT_OPTIONS
    size = SIZES[profile]
    swarm.prepare(size, options, min_group_size=2)
    for path in out.glob("peer*.npy"):
        path.unlink()
    delay = fraction * (0.3 if stage == "matchmaking" else round_s)
    record = FaultRun(number, swarm.transport, profile, fault, stage, victim, round(delay, 3))
    started = swarm.step(STEP_TIMEOUT, out)
    survivors = [p.index for p in swarm.peers if p.index != victim]
    if stage != "matchmaking":
        deadline = started + STEP_TIMEOUT
        try:
            for peer in swarm.peers:
                peer.expect("allreduce", deadline)
        except (TimeoutError, RuntimeError) as exc:
            record.problems.append(f"before the fault: {exc}")
    time.sleep(delay)
    victim_peer = swarm.peers[victim]
    began = victim_peer.poll("allreduce")
    record.stage_seen = stage if stage != "matchmaking" or began is None else "allreduce-begun"
    fault_at = time.monotonic()
    if fault == "kill":
        victim_peer.kill()
    else:
        lab.set_link(victim, False)
    # in a round, allreduce_timeout bounds what is left; before it, the step's own timeout
    if began is None and stage == "matchmaking":
        bound = started + STEP_TIMEOUT + SLACK
    else:
        bound = min(fault_at + options["allreduce_timeout"], started + STEP_TIMEOUT) + SLACK
    results: dict[int, dict[str, Any]] = {}
    for i in survivors:
        try:
            results[i] = swarm.peers[i].expect("result", bound)
        except TimeoutError:
            record.hang = True
            record.problems.append(f"peer {i}: no result {bound - fault_at:.1f} s after the fault")
        except RuntimeError as exc:
            record.problems.append(str(exc))
    if results:
        record.finish_s = round(max(r["t"] for r in results.values()) - fault_at, 2)
    if fault == "cut":
        # its step must end within its timeout too (it may look for another group until then
        # after its round failed); its values are not checked: it was cut off
        victim_bound = started + STEP_TIMEOUT + SLACK
        try:
            got = victim_peer.expect("result", victim_bound)
            record.victim_s = round(got["t"] - fault_at, 2)
            if got["t"] > victim_bound:
                record.hang = True
                record.problems.append(
                    f"cut-off victim: its step ended {record.victim_s} s after the fault"
                )
        except (TimeoutError, RuntimeError) as exc:
            record.hang = True
            record.problems.append(f"cut-off victim: {exc}")
        lab.set_link(victim, True)
        healed = time.monotonic()
    tensors = {
        i: np.load(out / f"peer{i}.npy")
        for i, got in results.items()
        if "error" not in got and (out / f"peer{i}.npy").exists()
    }
    record.problems += check_round(
        swarm, {i: r for i, r in results.items() if i in tensors or "error" in r}, tensors, victim
    )
    record.outcomes = [
        (len(r["group"]), r["incomplete"], len(r["relayed"]))
        for r in results.values()
        if "error" not in r
    ]
    if fault == "kill":
        swarm.replace(victim)
    else:  # a cut-off victim lives on: its DHT, emptied while cut off, must fill again by itself
        try:
            back = swarm.rejoined(victim, healed + REJOIN_WITHIN)
        except (TimeoutError, RuntimeError) as exc:
            back = False
            record.problems.append(f"cut-off victim: {exc}")
        if back:
            record.rejoin_s = round(time.monotonic() - healed, 2)
        if not back:
            record.problems.append(
                f"cut-off victim: its DHT did not hold the others {REJOIN_WITHIN} s after its"
                " link was back"
            )
            swarm.replace(victim)
    if record.hang:
        for i in survivors:
            swarm.replace(i)
    return record


def run_matrix(
    runs: int,
    seed: int,
    *,
    peers: int = 4,
    transports: Sequence[str] = ("tcp", "quic"),
    profiles: Sequence[str] = ("lan", "wan", "bad"),
    stages: Sequence[str] = STAGES,
    faults: Sequence[str] = FAULTS,
    logs: Path,
    only: Sequence[int] | None = None,
    say: Any = print,
) -> list[FaultRun]:
    """``runs`` fault runs in one lab of ``peers`` hosts, one peer process each (with a DHT on
    every transport), each run on a transport, profile, fault, stage and victim drawn with
    ``random.Random(seed)``. ``only``: run just these run numbers (below ``runs``), each with
    what it draws in the full matrix (the others' draws are made and skipped)."""
    rng = random.Random(seed)
    records: list[FaultRun] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        NetLab(peers, profile="wan", seed=seed, offload=False) as lab,
    ):
        out = Path(tmp)
        swarm = LabSwarm(lab, transports, logs)
        try:
            round_s: dict[tuple[str, str], float] = {}
            for number in range(runs):
                transport = rng.choice(list(transports))
                profile = rng.choice(list(profiles))
                fault = rng.choice(list(faults))
                stage = rng.choice(list(stages))
                victim = rng.randrange(peers)
                fraction = rng.uniform(*_window(stage))
                if only is not None and number not in only:
                    continue
                if (transport, profile) not in round_s:
                    seconds = reference_round(swarm, transport, profile, out, say)
                    if seconds is None:  # (no reference: the run is not made, and fails)
                        record = FaultRun(number, transport, profile, fault, stage, victim, 0.0)
                        record.problems.append(
                            f"no clean reference round in {CLEAN_TRIES} tries: run not made"
                        )
                        records.append(record)
                        say(json.dumps(dataclasses.asdict(record)))
                        continue
                    round_s[transport, profile] = seconds
                swarm.transport = transport
                record = fault_run(
                    swarm,
                    number,
                    profile,
                    fault,
                    stage,
                    victim,
                    fraction,
                    round_s[transport, profile],
                    out,
                )
                records.append(record)
                say(json.dumps(dataclasses.asdict(record)))
        finally:
            swarm.close()
    return records


def reference_round(
    swarm: LabSwarm, transport: str, profile: str, out: Path, say: Any
) -> float | None:
    """The median all-reduce seconds of a clean round of every peer on ``transport`` and
    ``profile`` (what a fault run's stage is a fraction of), trying up to :data:`CLEAN_TRIES`
    times: under load a clean round can come back incomplete (a sender that "did not begin
    within" ``sender_timeout``); ``None`` if no try was clean (each try's problems said)."""
    for i in range(len(swarm.lab.hosts)):
        swarm.lab.set_profile(i, profile)
    for attempt in range(1, CLEAN_TRIES + 1):
        try:
            results, problems = clean_round(
                swarm, SIZES[profile], FAULT_OPTIONS, out, transport=transport
            )
        except (TimeoutError, RuntimeError) as exc:  # a peer silent or gone: start afresh
            results, problems = {}, [str(exc)]
            for i in range(len(swarm.peers)):
                swarm.replace(i)
        if not problems:
            seconds = float(statistics.median(r["allreduce_s"] for r in results.values()))
            say(f"# {transport} {profile}: a clean round's all-reduce {seconds:.2f} s")
            return seconds
        say(f"# {transport} {profile}: clean round {attempt} of {CLEAN_TRIES} not: {problems}")
    return None


def _window(stage: str) -> tuple[float, float]:
    return {
        "matchmaking": (0.0, 1.0),
        "sending": (0.0, 1 / 3),
        "reducing": (1 / 3, 2 / 3),
        "returning": (2 / 3, 1.0),
    }[stage]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--transports", default="tcp,quic")
    parser.add_argument("--profiles", default="lan,wan,bad")
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated run numbers: run just these, as drawn in the full matrix",
    )
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    profiles = [p for p in args.profiles.split(",") if p]
    for profile in profiles:
        if profile not in PROFILES:
            parser.error(f"--profiles: unknown profile {profile!r}")
    if args.runs < 1 or args.peers < 3:
        parser.error("--runs must be at least 1 and --peers at least 3")
    only = None
    if args.only is not None:
        try:
            only = sorted({int(n) for n in args.only.split(",") if n})
        except ValueError:
            parser.error(f"--only: not comma-separated run numbers: {args.only!r}")
        if not only or only[0] < 0 or only[-1] >= args.runs:
            parser.error(f"--only: run numbers from 0 to --runs - 1 ({args.runs - 1})")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="netfaults-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"# peers' logs in {logs}")
    records = run_matrix(
        args.runs,
        args.seed,
        peers=args.peers,
        transports=transports,
        profiles=profiles,
        logs=logs,
        only=only,
    )
    hangs = sum(r.hang for r in records)
    failed = [r for r in records if r.problems]
    print(f"# {len(records)} runs: {hangs} hangs, {len(failed)} with problems")
    for key in ("transport", "profile", "fault", "stage_seen"):
        counts: dict[str, int] = {}
        for r in records:
            counts[getattr(r, key)] = counts.get(getattr(r, key), 0) + 1
        print(f"#   by {key}: {counts}")
    finish = sorted(r.finish_s for r in records)
    if finish:
        print(
            f"#   survivors done after the fault: median {statistics.median(finish):.2f} s, "
            f"max {finish[-1]:.2f} s (bound {FAULT_OPTIONS['allreduce_timeout']} s)"
        )
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in records], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
