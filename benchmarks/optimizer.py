"""Collaborative-training benchmarks (issue 23's, 25's and 27's figures): ``swarmavg.Optimizer``
beside ``hivemind.Optimizer`` 1.1.12 and beside training alone; ``DecentralizedSGD`` /
``DecentralizedAdam`` and ``DiLoCo`` beside training alone and ``swarmavg.Optimizer``;
Lightning's ``Trainer`` with ``SwarmStrategy`` beside ``swarmavg.Optimizer``; on the workload of
``swarmavg/testing/workload.py`` (a byte-level transformer LM on the standard library's source).

    python benchmarks/optimizer.py [--quick] [--parts convergence,speed,overhead]
                                   [--parts decentralized,diloco]
                                   [--parts lightning] [--lightning-epochs 100]
                                   [--lightning-repeats 2]
                                   [--systems swarmavg,hivemind] [--peers 4]
                                   [--target-batch-size 256] [--batch-size 16]
                                   [--convergence-epochs 100] [--speed-epochs 20]
                                   [--overhead-epochs 20]
                                   [--matchmaking-times 1,2,5] [--hivemind-python PATH]
                                   [--plot optimizer-convergence.png] [--out results.jsonl]

hivemind's side needs a venv with ``hivemind==1.1.12`` (default ``/tmp/hm-venv/bin/python``;
``--hivemind-python`` for another); without one its rows say why they are empty. Without
``swarmavg.Optimizer`` in this checkout our rows say so likewise.

Every training process is ``benchmarks/_optimizer_peer.py`` (its docstring has the protocol):
``--system swarmavg`` under this Python, ``--system hivemind`` under hivemind's, ``--system
local`` (plain torch, no DHT) under this one. Each is a process of its own on loopback, started
in a session of its own (hivemind's p2pd daemons and averager processes die with it),
``torch.set_num_threads(1)``, the same corpus (``--stdlib`` of this Python, its fingerprint
checked), the same model seed, Adam at ``--lr`` with a linear warmup over ``--warmup-epochs``
epochs stepped by epoch, ``batch_size_per_step = --batch-size`` (16) and ``target_batch_size =
--target-batch-size`` (T, 256). Each peer draws its own batches (seed 0, stream = its index).
A swarm run: peer 0 starts its DHT, the others join it, every peer makes its optimizer and
says ready; then all start at one instant (``time.monotonic()``, one clock on Linux) and train
until their local epoch reaches E; a peer that is done goes on training (uncounted) until all
are, as the peers of a longer run would (a straggler can still average with it or load its
state; without that hivemind's last straggler waits ``averaging_timeout`` alone), then all shut
down. Per run: the wall-clock from the start until the last peer reached E, the samples every
peer fed to ``step()`` until then (their sum per epoch is the swarm's samples per epoch), and
peer 0's validation loss (``workload.evaluate``: 8 batches of 64 x 64 fixed validation
windows) every ``--eval-every`` epochs.

Parts (``--parts``, default the first three; ``decentralized``, ``diloco`` and ``lightning`` on
request):

- **convergence**: for each system in ``--convergence-systems`` (default swarmavg), ``--peers``
  (4) peers for ``--convergence-epochs`` (E, 100; ``--quick`` 20) epochs, evaluated every
  ``--eval-every`` (5) epochs; then one process training alone with batch T (``--system
  local``: it accumulates its batches of 16 to T samples, then steps: the same optimizer and
  schedule), for as many epochs as cover the swarm's samples. Reported: the swarm's validation
  loss after E epochs, the alone process's at the same total samples (linear interpolation of
  its curve) and at the same epoch, the ratio swarm / alone at equal samples (goal: <= 1.02)
  and the swarm's samples per epoch over T (what the tracker overshot). Both curves go to a PNG
  (``--plot``; needs matplotlib, else a message says it was skipped).
- **speed**: for each system in ``--systems`` and each ``matchmaking_time`` in
  ``--matchmaking-times`` (1, 2, 5 s), the wall-clock for the peers to finish
  ``--speed-epochs`` (20; ``--quick`` 5) epochs, no evaluation during the run. Reported: the
  wall-clock, the median epoch (peer 0's time between epochs after the first), samples/s, and
  ours over hivemind's best (goal: <= 1/3, i.e. at least 3x faster).
- **overhead**: the swarm of each system in ``--overhead-systems`` (default ``--systems``;
  ``--quick``: ours) for ``--overhead-epochs`` (E, 20; ``--quick`` 10) epochs at
  ``--overhead-matchmaking-time`` (1 s), once with the library's defaults and once with
  ``--delay-optimizer-step --delay-grad-averaging`` (hivemind's ``delay_state_averaging`` is
  on by default); then the same ``--peers`` processes training alone (``--system local``, no
  DHT, no averaging), each for the samples a swarm peer fed on average (at least E x T /
  peers). Reported: samples/s of each (all samples over the wall-clock) and the overhead
  1 - swarm / alone (goal: <= 20% with the delays). Identical configurations (a speed run at
  the same matchmaking time and epochs) are run once and reused.
- **decentralized** (issue 25): ``--peers`` (4) peers of each of ``--decentralized-systems``
  (``dsgd``: ``swarmavg.DecentralizedSGD``, SGD ``--sgd-lr`` 0.1 momentum 0.9; ``dadam``:
  ``swarmavg.DecentralizedAdam``, Adam ``--lr``), each peer stepping on every batch of 16,
  ``target_group_size=--group-size`` (default the peers), ``averaging_steps_period=
  --averaging-steps-period`` (4), ``averaging_expiration=--decentralized-matchmaking-time``
  (1 s), for ``--decentralized-epochs`` (E, 100; ``--quick`` 25) epochs of T samples of all
  the peers (T / (peers x 16) = 4 local steps each: 400 steps, 25,600 samples in all);
  their reference is one process with the same global batch G = peers x 16 = 64 (``--system
  local --target-batch-size 64``, with SGD for dsgd, Adam for dadam; one of its steps stands
  for one local step of each peer: the same warmup per step). Beside them
  ``swarmavg.Optimizer`` (T, as the convergence part: the same run when E is the same) and
  its reference alone with batch T. Reported: peer 0's validation loss after E epochs, the
  reference's at the same samples, the ratio (goal: <= 1.05), ``swarmavg.Optimizer``'s at the
  same samples.
- **diloco** (issue 25): ``swarmavg.optim.DiLoCo`` with ``--peers`` peers for each H in
  ``--sync-every`` (10, 50), and with ``Float16Compression()`` for each H in
  ``--fp16-sync-every`` (10): inner Adam ``--lr`` with the same warmup per step, outer SGD lr
  0.7, momentum 0.9, Nesterov, ``matchmaking_time=--diloco-matchmaking-time`` (5 s), for E
  epochs as above (raised until every peer's steps are a multiple of every H: the run ends
  with a round, and the final loss is θ_global's). Every peer starts from the same model
  seed and at the same instant, 4 s after all are ready, with a progress tracker that reads
  the others' records every 0.1-1 s: none takes a round alone (see ``DILOCO_STAGGER``).
  Reference: the same process alone with batch G (Adam). Reported: the ratio at equal
  samples (goal: <= 1.03), all-reduce rounds and bytes sent per peer, bytes per round, what
  averaging the same Δ after every step would send (bytes per round x steps: the rounds and
  bytes are H times fewer), fp16 against fp32 (goal: within 0.5%). ``--outer
  LR:MOMENTUM,...`` runs each H with each outer setting (e.g. ``0.7:0.9,1:0``).

  Options of both parts: ``--samples N`` (the sample budget of all peers, instead of
  ``--decentralized-epochs``: more samples, more outer steps), ``--repeat N`` (each
  configuration N times: the run-to-run noise), ``--data-seeds 0,1,..`` (diloco: each
  configuration with other batches), ``--step-compute-ms 0,100`` (dsgd/dadam: a sleep per
  step standing for a bigger model's forward and backward, so that rounds can keep up with
  ``averaging_steps_period`` steps; one run per value), ``--wait-for-round`` (dsgd/dadam: a
  step that asked for a round waits until it is written: synchronous averaging),
  ``--no-collaborative`` (no ``swarmavg.Optimizer`` beside them). Each row says how many
  rounds every peer took and asked for, and the rounds of all peers by group size (``4:160``:
  160 memberships of groups of 4).

  **Reproducibility**: the peers' PeerIDs derive from ``--identity-seed`` (0; -1: random
  ones), so a group's members are in the same order in every run and each one reduces the
  same parts; the data and model seeds are fixed and every process runs one torch thread.
  What is left is the order in which a reducer sums the values it receives (as they arrive,
  float32: not associative): the last bit of a mean depends on timing, and training amplifies
  that to about +-0.5% of the final loss. ``--ordered-reduction`` (a diagnostic: each peer
  process patches the reducer to hold the values until all arrived and sum them in member
  order) makes two runs of a synchronous configuration (DiLoCo) bit-identical.

  Both parts then print a **cost** table (wall-clock, samples/s, all-reduce bytes sent and
  received per peer, rounds and failed rounds per peer, state bytes) of every swarm, and draw
  all the curves in ``--plot-decentralized`` (``optimizer-decentralized.png``). The losses at
  equal samples do not depend on the machine's load; the wall-clock does.
- **lightning** (issue 27): the convergence part's swarm (``--peers`` peers, T, ``--lightning-
  epochs`` E (100; ``--quick`` 20), evaluated every ``--eval-every`` epochs, matchmaking time
  ``--convergence-matchmaking-time``) with ``--system swarmavg`` (``swarmavg.Optimizer`` in a
  loop of its own) and with ``--system lightning`` (``lightning.pytorch.Trainer.fit`` with
  ``SwarmStrategy``: the same optimizer, scheduler, seeds, batches and target, the optimizer
  and scheduler from ``configure_optimizers``), ``--lightning-repeats`` (2) runs of each, the
  two alternating. Reported: peer 0's validation loss after E epochs and the wall-clock of
  each run, their means, and Lightning's over the direct one's (goals: loss within 1%,
  wall-clock at most 1.10x).

What it prints: one table per part (markdown), then notes (the machine's CPUs and load, the
corpus, the runs that failed and why). ``--out FILE`` writes JSON lines (replacing FILE): a
``meta`` record, one ``row`` per table row and one ``raw`` per run (every event of every
peer). ``--logs DIR`` keeps each peer's stderr (default: a new temporary directory, named in
the notes).

``--quick`` (~2-3 min): E=20 for convergence, 5 for speed, 10 for overhead, matchmaking time
1 s only, and the overhead part with our system only. A full run takes ~10-15 min on 2 CPUs,
most of it hivemind's (its epochs take at least its matchmaking time). Every wait has a
timeout; every process is killed (its whole session) on the way out, also on Ctrl+C and
SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import queue
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _averaging_common import hivemind_sockets, machine_busy_seconds, remove_stale_sockets

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_SCRIPT = HERE / "_optimizer_peer.py"
HIVEMIND_PYTHON = Path("/tmp/hm-venv/bin/python")
#: starts a peer process as ``subprocess.Popen`` does (tests/test_bench_optimizer.py puts in
#: the tests' fork server: tests/forkserver.py)
start_peer: Callable[..., Any] = subprocess.Popen
READY_TIMEOUT = 180.0  # every peer up: imports, DHT, optimizer (2 CPUs, 4 imports at once)
GO_DELAY = 1.0  # the peers start this long after the driver sends the start time
#: the peers gone after they were told to stop, before their sessions are killed (a peer in a
#: step that waits for a group cannot answer before its averaging_timeout)
EXIT_TIMEOUT = 15.0
#: goals (issue 23)
GOAL_CONVERGENCE = 1.02
GOAL_SPEEDUP = 3.0
GOAL_OVERHEAD = 0.20
#: goals (issue 25)
GOAL_DECENTRALIZED = 1.05
GOAL_DILOCO = 1.03
GOAL_FP16 = 0.005
#: goals (issue 27): Lightning's SwarmStrategy beside swarmavg.Optimizer
GOAL_LIGHTNING_LOSS = 0.01
GOAL_LIGHTNING_WALL = 0.10
#: DiLoCo: peers 1.. start this long after peer 0 (0: together; a stagger makes peer 0 take
#: its first rounds alone, since a peer's record counts only once it stepped: the others then
#: download its state and drop their first steps), and every peer waits DILOCO_GO_DELAY after
#: all are ready. Peers made at different moments but starting together, with trackers that
#: read every 0.1-1 s (the peer script's --tracker-refresh), all see each other before their
#: first round (H >= 2; docs/guides/diloco.md, "Limits").
DILOCO_STAGGER = 0.0
DILOCO_GO_DELAY = 4.0
#: configuration keys passed to the peer as flags of the same name
PER_STEP_OPTIONS = (
    "steps_per_epoch",
    "group_size",
    "averaging_steps_period",
    "sync_every",
    "compression",
    "local_optimizer",
    "outer_lr",
    "outer_momentum",
    "step_compute_ms",
    "data_seed",
)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class RunFailed(RuntimeError):
    """A run could not complete; the message says why (shown in its row)."""


# -- processes ------------------------------------------------------------------------------------


class _Peer:
    """One ``_optimizer_peer.py`` process: its events arrive on a shared queue."""

    def __init__(
        self,
        python: str,
        index: int,
        argv: list[str],
        events: queue.Queue[tuple[int, dict[str, Any]]],
        log: Path,
        env: dict[str, str],
    ) -> None:
        self.index = index
        self.log = log
        self._log_file: IO[str] = log.open("w")
        self.proc = start_peer(
            [python, str(PEER_SCRIPT), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events: queue.Queue[tuple[int, dict[str, Any]]]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    events.put((self.index, json.loads(line)))
        events.put((self.index, {"event": "eof", "returncode": self.proc.wait()}))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def request_stop(self) -> None:
        """Tell it to shut down (a line ``stop``, then EOF)."""
        self.send("stop")
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def finish(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for it to exit, then kill its
        session (what is left of it: hivemind's daemons and averager processes)."""
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _progress(f"  peer {self.index} had not exited when told to stop: killed")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log_file.close()

    def log_tail(self, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


def _python_for(system: str, args: argparse.Namespace) -> str:
    if system == "hivemind":
        python = Path(args.hivemind_python)
        if not python.exists():
            raise RunFailed(f"skipped: {python} not found (a venv with hivemind==1.1.12)")
        return str(python)
    return sys.executable


def _env_for(system: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if system == "hivemind":
        env.pop("PYTHONPATH", None)
    else:  # this checkout's swarmavg first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _common_argv(args: argparse.Namespace, config: dict[str, Any]) -> list[str]:
    argv = [
        f"--system={config['system']}",
        f"--target-batch-size={config['target']}",
        f"--batch-size={args.batch_size}",
        f"--epochs={config.get('epochs', 1 << 30)}",
        f"--lr={args.lr}",
        f"--warmup-epochs={args.warmup_epochs}",
        f"--stdlib={args.stdlib}",
        f"--num-peers={config['peers']}",
        f"--deadline={args.run_timeout}",
        f"--eval-every={config.get('eval_every', 0)}",
        "--wait-go",
        f"--linger={args.run_timeout}",
        f"--startup-timeout={READY_TIMEOUT}",
    ]
    if config["system"] != "local":
        seed = getattr(args, "identity_seed", -1)
        if config["system"] != "hivemind" and seed >= 0:
            argv.append(f"--identity-seed={seed}")
        argv += [
            f"--run-id={config['run_id']}",
            f"--matchmaking-time={config['matchmaking_time']}",
            f"--averaging-timeout={args.averaging_timeout}",
        ]
        argv.append("--keep-stepping")
        if args.verbose:
            argv.append("--verbose")
    for key in PER_STEP_OPTIONS:  # (the per-step systems' and the reference's options)
        if config.get(key) is not None:
            argv.append(f"--{key.replace('_', '-')}={config[key]}")
    if config["system"] == "dsgd" or config.get("local_optimizer") == "sgd":
        argv += [f"--sgd-lr={args.sgd_lr}", f"--momentum={args.momentum}"]
    for flag in config.get("delays", ()):
        argv.append(f"--{flag}")
    if config.get("wait_for_round"):
        argv.append("--wait-for-round")
    if config["system"] not in ("local", "hivemind") and getattr(args, "ordered_reduction", False):
        argv.append("--ordered-reduction")
    if config.get("max_samples"):
        argv.append(f"--max-samples={config['max_samples']}")
    return argv


def run_config(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """Runs ``config['peers']`` processes of ``config['system']`` to the end; returns every
    event of every peer (``events[i]``) and the run's figures. Raises :class:`RunFailed`."""
    system, n = config["system"], config["peers"]
    python = _python_for(system, args)
    env = _env_for(system)
    events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    name = config["name"]
    peers: list[_Peer] = []
    log_dir = Path(args.logs)
    per_peer: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    sockets_before = hivemind_sockets()
    busy0 = machine_busy_seconds()
    wall0 = time.monotonic()

    def spawn(i: int, initial: list[str]) -> None:
        argv = [*_common_argv(args, config), f"--peer={i}"]
        if initial:
            argv += ["--initial-peers", *initial]
        peers.append(_Peer(python, i, argv, events, log_dir / f"{name}-peer{i}.log", env))

    def wait_for(kind: str, who: set[int], timeout: float) -> dict[int, dict[str, Any]]:
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while set(got) != who:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(who - set(got))
                raise RunFailed(f"no {kind!r} from peers {missing} within {timeout:.0f} s")
            try:
                i, event = events.get(timeout=left)
            except queue.Empty:
                continue
            per_peer[i].append(event)
            if event["event"] == "error":
                raise RunFailed(f"peer {i}: {event['error']}")
            if event["event"] == "eof" and kind != "exit":
                raise RunFailed(
                    f"peer {i} exited (status {event['returncode']}) before {kind!r}: "
                    f"{peers[i].log_tail()}"
                )
            if event["event"] == kind:
                got[i] = event
        return got

    try:
        spawn(0, [])
        if system == "local":
            for i in range(1, n):
                spawn(i, [])
            ready = wait_for("ready", set(range(n)), READY_TIMEOUT)
        else:
            first = wait_for("ready", {0}, READY_TIMEOUT)
            for i in range(1, n):
                spawn(i, first[0]["maddrs"])
            ready = first | wait_for("ready", set(range(1, n)), READY_TIMEOUT)
        corpora = {event["corpus"] for event in ready.values()}
        if len(corpora) != 1:
            raise RunFailed(f"the peers loaded different corpora: {sorted(corpora)}")
        go = time.monotonic() + config.get("go_delay", GO_DELAY)
        for peer in peers:  # (peer 0 first by config["stagger"] s: see DILOCO_STAGGER)
            offset = config.get("stagger", 0.0) if peer.index else 0.0
            peer.send(json.dumps({"go": go + offset}))
        busy_go = machine_busy_seconds()
        done = wait_for("done", set(range(n)), args.run_timeout + 60)
        busy_end = machine_busy_seconds()
        end = time.monotonic()
    finally:
        for peer in peers:
            peer.request_stop()
        stop_deadline = time.monotonic() + EXIT_TIMEOUT
        for peer in peers:
            peer.finish(stop_deadline)
        while True:  # what arrived meanwhile (exit records)
            try:
                i, event = events.get_nowait()
            except queue.Empty:
                break
            per_peer[i].append(event)
        remove_stale_sockets(sockets_before)
    result = _summarize(config, per_peer, done, ready)
    result["session_s"] = end - wall0
    if busy_go is not None and busy_end is not None and end > go:
        result["machine_busy_cpus"] = (busy_end - busy_go) / (end - go)
    result["busy_before_go"] = None if busy0 is None or busy_go is None else busy_go - busy0
    return result


def _summarize(
    config: dict[str, Any],
    per_peer: list[list[dict[str, Any]]],
    done: dict[int, dict[str, Any]],
    ready: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    n = config["peers"]
    wall = max(float(done[i]["t"]) for i in range(n))
    samples = sum(int(done[i]["samples"]) for i in range(n))
    by_epoch: dict[int, int] = {}
    for events in per_peer:
        for event in events:
            if event["event"] == "epoch" and event["epoch"] > 0:
                by_epoch[event["epoch"]] = by_epoch.get(event["epoch"], 0) + event["samples"]
    curve: list[dict[str, float]] = []
    cumulative = 0
    epoch_times: list[float] = []
    last_t = None
    for event in per_peer[0]:
        if event["event"] != "epoch":
            continue
        epoch = int(event["epoch"])
        if epoch > 0:
            cumulative = sum(s for e, s in by_epoch.items() if e <= epoch)
            if last_t is not None:
                epoch_times.append(float(event["t"]) - last_t)
        last_t = float(event["t"])
        if "val_loss" in event:
            curve.append({"epoch": epoch, "samples": cumulative, "val_loss": event["val_loss"]})
    epoch_times = epoch_times[1:]  # the first epoch includes the first matchmaking
    traffic: dict[str, Any] = {  # per peer, until it was done (the mean over the peers)
        key: sum(float(done[i][key]) for i in range(n)) / n
        for key in (
            "bytes_sent",
            "bytes_received",
            "rounds",
            "rounds_failed",
            "rounds_incomplete",
            "state_bytes",
        )
        if all(key in done[i] for i in range(n))
    }
    for key in ("group_sizes", "waited", "diloco_rounds"):  # (counts summed over the peers)
        if any(key in done[i] for i in range(n)):
            summed: dict[str, int] = {}
            for i in range(n):
                for what, count in done[i].get(key, {}).items():
                    summed[what] = summed.get(what, 0) + int(count)
            traffic[key] = summed
    return {
        "traffic": traffic,
        "steps_per_peer": sum(int(done[i]["steps"]) for i in range(n)) / n,
        "config": config,
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall if wall > 0 else None,
        "epochs_reached": min(int(done[i]["epoch"]) for i in range(n)),
        "timed_out": any(done[i].get("timed_out") for i in range(n)),
        "samples_per_epoch": [by_epoch[e] for e in sorted(by_epoch)],
        "median_epoch_s": _median(epoch_times),
        "curve": curve,
        "setup_s": max(float(ready[i]["setup_s"]) for i in range(n)),
        "events": per_peer,
    }


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


class Runner:
    """Runs configurations once each (identical ones are reused) and keeps every result."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, dict[str, Any]] = {}
        #: per part: label -> run, for the plot of the parameter-averaging optimizers
        self.curves: dict[str, dict[str, dict[str, Any]]] = {}

    def run(self, **config: Any) -> dict[str, Any]:
        key = json.dumps(config, sort_keys=True)
        if key in self.results:
            return self.results[key]
        label = " ".join(f"{k}={v}" for k, v in config.items())
        _progress(f"running {label} ...")
        full = dict(config, name=f"run{len(self.results)}", run_id=f"bench-{uuid.uuid4().hex[:8]}")
        began = time.monotonic()
        try:
            result = run_config(self.args, full)
        except RunFailed as exc:
            result = {"config": full, "error": str(exc)}
        except Exception as exc:
            result = {"config": full, "error": _error(exc)}
        result["run_s"] = time.monotonic() - began
        if "error" in result:
            _progress(f"  failed: {result['error']}")
        else:
            _progress(
                f"  {result['wall_s']:.1f} s, {result['samples_per_s']:.0f} samples/s, "
                f"epochs {result['epochs_reached']}"
            )
        self.results[key] = result
        return result


# -- the parts ------------------------------------------------------------------------------------


def _interpolate(curve: list[dict[str, float]], samples: float) -> float | None:
    points = sorted((p["samples"], p["val_loss"]) for p in curve)
    for (s0, l0), (s1, l1) in itertools.pairwise(points):
        if s0 <= samples <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (samples - s0) / (s1 - s0)
    return None


def part_convergence(runner: Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    T, E = args.target_batch_size, args.convergence_epochs
    swarms: dict[str, dict[str, Any]] = {}
    for system in args.convergence_systems:
        swarms[system] = runner.run(
            part="convergence",
            system=system,
            peers=args.peers,
            target=T,
            epochs=E,
            eval_every=args.eval_every,
            matchmaking_time=args.convergence_matchmaking_time,
        )
    done = [r for r in swarms.values() if "error" not in r]
    if not done:
        return [
            {"part": "convergence", "system": system, "error": swarm["error"]}
            for system, swarm in swarms.items()
        ]
    most = max(r["samples"] for r in done)
    alone_epochs = max(E, math.ceil(most / T)) + args.eval_every
    alone_epochs = math.ceil(alone_epochs / args.eval_every) * args.eval_every
    alone = runner.run(
        part="convergence",
        system="local",
        peers=1,
        target=T,
        epochs=alone_epochs,
        eval_every=args.eval_every,
    )
    for system, swarm in swarms.items():
        row: dict[str, Any] = {"part": "convergence", "system": system, "peers": args.peers}
        row |= {"target_batch_size": T, "epochs": E}
        if "error" in swarm or "error" in alone:
            row["error"] = swarm.get("error") or f"alone: {alone.get('error')}"
            rows.append(row)
            continue
        final = swarm["curve"][-1] if swarm["curve"] else None
        if final is None or final["epoch"] < E:
            row["error"] = f"the swarm reached epoch {swarm['epochs_reached']} of {E}"
            rows.append(row)
            continue
        at_samples = _interpolate(alone["curve"], final["samples"])
        at_epoch = next((p["val_loss"] for p in alone["curve"] if p["epoch"] == E), None)
        row |= {
            "swarm_samples": final["samples"],
            "swarm_val_loss": final["val_loss"],
            "alone_val_loss_same_samples": at_samples,
            "alone_val_loss_same_epoch": at_epoch,
            "ratio_same_samples": None if at_samples is None else final["val_loss"] / at_samples,
            "ratio_same_epoch": None if at_epoch is None else final["val_loss"] / at_epoch,
            "samples_per_epoch_over_T": final["samples"] / (E * T),
            "swarm_wall_s": swarm["wall_s"],
            "alone_wall_s": alone["wall_s"],
        }
        rows.append(row)
    if args.plot:
        _plot(args.plot, swarms, alone, T)
    return rows


def part_lightning(runner: Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``Trainer.fit`` with ``SwarmStrategy`` beside ``swarmavg.Optimizer`` driven directly:
    the convergence part's swarm (``--peers``, T, E, the same seeds and evaluation), each
    ``--lightning-repeats`` times, the two systems alternating (the machine's speed drifts)."""
    T, E = args.target_batch_size, args.lightning_epochs
    runs: dict[str, list[dict[str, Any]]] = {"swarmavg": [], "lightning": []}
    for repeat in range(args.lightning_repeats):
        order = ("swarmavg", "lightning") if repeat % 2 == 0 else ("lightning", "swarmavg")
        for system in order:
            runs[system].append(
                runner.run(
                    part="lightning",
                    system=system,
                    peers=args.peers,
                    target=T,
                    epochs=E,
                    eval_every=args.eval_every,
                    matchmaking_time=args.convergence_matchmaking_time,
                    repeat=repeat,
                )
            )
    rows: list[dict[str, Any]] = []
    means: dict[str, dict[str, float]] = {}
    for system, results in runs.items():
        row: dict[str, Any] = {"part": "lightning", "system": system, "peers": args.peers}
        row |= {"target_batch_size": T, "epochs": E}
        errors = [r["error"] for r in results if "error" in r]
        finals = [r["curve"][-1] for r in results if "error" not in r and r["curve"]]
        if errors or len(finals) != len(results) or any(f["epoch"] < E for f in finals):
            row["error"] = "; ".join(errors) or f"a run did not reach epoch {E}"
            rows.append(row)
            continue
        losses = [f["val_loss"] for f in finals]
        walls = [r["wall_s"] for r in results]
        means[system] = {
            "val_loss": sum(losses) / len(losses),
            "wall_s": sum(walls) / len(walls),
        }
        row |= {
            "val_losses": ", ".join(f"{x:.4f}" for x in losses),
            "walls": ", ".join(f"{x:.1f}" for x in walls),
            "val_loss": means[system]["val_loss"],
            "wall_s": means[system]["wall_s"],
            "samples_per_epoch_over_T": sum(f["samples"] for f in finals) / (len(finals) * E * T),
        }
        rows.append(row)
    if len(means) == 2:
        direct, light = means["swarmavg"], means["lightning"]
        for row in rows:
            if row["system"] == "lightning":
                row["loss_ratio"] = light["val_loss"] / direct["val_loss"]
                row["wall_ratio"] = light["wall_s"] / direct["wall_s"]
    return rows


def _plot(path: Path, swarms: dict[str, dict[str, Any]], alone: dict[str, Any], T: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _progress(f"matplotlib is not installed: no plot ({path})")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, swarm in swarms.items():
        if swarm.get("curve"):
            xs = [p["samples"] for p in swarm["curve"]]
            ax.plot(xs, [p["val_loss"] for p in swarm["curve"]], marker=".", label=system)
    if alone.get("curve"):
        xs = [p["samples"] for p in alone["curve"]]
        ax.plot(xs, [p["val_loss"] for p in alone["curve"]], "k--", label=f"alone, batch {T}")
    ax.set_xlabel("samples (windows of 64 bytes)")
    ax.set_ylabel("validation cross-entropy (nats/byte)")
    n = next((s["config"]["peers"] for s in swarms.values()), "?")
    ax.set_title(f"{n} peers, target_batch_size {T} vs one process with batch {T}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    _progress(f"plot written to {path}")


def part_speed(runner: Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for mm in args.matchmaking_times:
        for system in args.systems:
            result = runner.run(
                part="swarm",
                system=system,
                peers=args.peers,
                target=args.target_batch_size,
                epochs=args.speed_epochs,
                matchmaking_time=mm,
            )
            rows.append(_speed_row(system, mm, args, result))
    best = {}
    for row in rows:
        if "error" not in row and not row.get("timed_out"):
            s = row["system"]
            best[s] = min(best.get(s, math.inf), row["wall_s"])
    for row in rows:
        if row["system"] == "swarmavg" and "hivemind" in best and "wall_s" in row:
            row["speedup_vs_hivemind_best"] = best["hivemind"] / row["wall_s"]
    return rows


def _speed_row(
    system: str, mm: float, args: argparse.Namespace, result: dict[str, Any]
) -> dict[str, Any]:
    T = args.target_batch_size
    row: dict[str, Any] = {"part": "speed", "system": system, "matchmaking_time": mm}
    row |= {"peers": args.peers, "epochs": args.speed_epochs}
    if "error" in result:
        row["error"] = result["error"]
        return row
    row |= {
        "wall_s": result["wall_s"],
        "median_epoch_s": result["median_epoch_s"],
        "samples_per_s": result["samples_per_s"],
        "epochs_reached": result["epochs_reached"],
        "timed_out": result["timed_out"],
        "samples_per_epoch_over_T": result["samples"] / (args.speed_epochs * T),
    }
    return row


def part_overhead(runner: Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    T, E, n = args.target_batch_size, args.overhead_epochs, args.peers
    swarms: list[tuple[str, str, dict[str, Any]]] = []
    for system in args.overhead_systems:
        for delays in ((), ("delay-optimizer-step", "delay-grad-averaging")):
            config: dict[str, Any] = dict(
                part="swarm",
                system=system,
                peers=n,
                target=T,
                epochs=E,
                matchmaking_time=args.overhead_matchmaking_time,
            )
            if delays:
                config["delays"] = list(delays)
            label = "+".join(d.removeprefix("delay-") for d in delays) or "defaults"
            swarms.append((system, label, runner.run(**config)))
    # alone: each process feeds what a swarm peer fed on average (at least E x T / n samples)
    fed = [r["samples"] / n for _, _, r in swarms if "error" not in r]
    per_process = max([E * T / n, *fed])
    alone = runner.run(
        part="alone",
        system="local",
        peers=n,
        target=T,
        max_samples=math.ceil(per_process / args.batch_size) * args.batch_size,
    )
    alone_sps = alone.get("samples_per_s")
    rows: list[dict[str, Any]] = [
        {
            "part": "overhead",
            "system": "alone",
            "delays": "-",
            "peers": n,
            "samples_per_s": alone_sps,
            **({"error": alone["error"]} if "error" in alone else {}),
        }
    ]
    for system, label, result in swarms:
        row: dict[str, Any] = {"part": "overhead", "system": system, "peers": n, "delays": label}
        if "error" in result:
            row["error"] = result["error"]
        else:
            row["samples_per_s"] = result["samples_per_s"]
            row["epochs_reached"] = result["epochs_reached"]
            if alone_sps:
                row["overhead"] = 1 - result["samples_per_s"] / alone_sps
        rows.append(row)
    return rows


# -- the parameter-averaging optimizers (issue 25) ------------------------------------------------


def _per_step_plan(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(G, K, E)``: the global batch of the per-step systems (peers x batch per step), the
    local steps per reported epoch (an epoch of all peers is T samples) and the epochs."""
    G = args.peers * args.batch_size
    K = max(1, args.target_batch_size // G)
    return G, K, args.decentralized_epochs


def _reference(
    runner: Runner, args: argparse.Namespace, optimizer: str, epochs: int
) -> dict[str, Any]:
    """One process alone with batch G (``optimizer``: adam or sgd) for ``epochs`` reported
    epochs' worth of samples, evaluated at the same samples as the swarms."""
    G, K, _ = _per_step_plan(args)
    for result in runner.results.values():  # (a longer run of the same reference will do)
        config = result["config"]
        if (
            "error" not in result
            and config.get("part") == "reference"
            and config.get("local_optimizer") == optimizer
            and config["target"] == G
            and config.get("eval_every") == args.eval_every * K
            and config.get("epochs", 0) >= epochs * K
        ):
            return result
    return runner.run(
        part="reference",
        system="local",
        peers=1,
        target=G,
        epochs=epochs * K,
        eval_every=args.eval_every * K,
        local_optimizer=optimizer,
    )


def _collaborative(runner: Runner, args: argparse.Namespace, epochs: int) -> dict[str, Any]:
    """``swarmavg.Optimizer`` as in the convergence part (the same run when E is the same)."""
    return runner.run(
        part="convergence",
        system="swarmavg",
        peers=args.peers,
        target=args.target_batch_size,
        epochs=epochs,
        eval_every=args.eval_every,
        matchmaking_time=args.convergence_matchmaking_time,
    )


def _final(result: dict[str, Any], epochs: int) -> dict[str, float] | None:
    """The last evaluated point of a run, if it reached ``epochs``."""
    if "error" in result or not result.get("curve"):
        return None
    last: dict[str, float] = result["curve"][-1]
    return last if last["epoch"] >= epochs else None


def _cost(result: dict[str, Any]) -> dict[str, Any]:
    """What a swarm run cost: wall-clock, samples/s, bytes and rounds per peer."""
    traffic = result.get("traffic", {})
    row: dict[str, Any] = {
        "wall_s": result.get("wall_s"),
        "samples_per_s": result.get("samples_per_s"),
        "steps_per_peer": result.get("steps_per_peer"),
    }
    for key in ("bytes_sent", "bytes_received", "state_bytes"):
        if key in traffic:
            row[f"mb_{key.removeprefix('bytes_').removesuffix('_bytes')}_per_peer"] = (
                traffic[key] / 1e6
            )
    row["rounds_per_peer"] = traffic.get("rounds")
    row["rounds_failed_per_peer"] = traffic.get("rounds_failed")
    sizes = traffic.get("group_sizes")
    if sizes:  # rounds begun by all the peers, by group size: "4:160" (4 peers x 40 rounds)
        row["group_sizes"] = " ".join(f"{k}:{v}" for k, v in sorted(sizes.items()))
    for key in ("waited", "diloco_rounds"):
        if traffic.get(key):
            row[key] = " ".join(f"{k}:{v}" for k, v in traffic[key].items() if v)
    return row


def part_decentralized(runner: Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    """DecentralizedSGD/Adam, ``--peers`` peers: validation loss at equal samples beside one
    process with the same global batch (SGD, Adam) and beside ``swarmavg.Optimizer``."""
    G, K, E = _per_step_plan(args)
    T, n = args.target_batch_size, args.peers
    swarms: dict[str, dict[str, Any]] = {}
    kinds: dict[str, str] = {}  # label -> dsgd/dadam
    for system, compute_ms, repeat in itertools.product(
        args.decentralized_systems, args.step_compute_ms, range(args.repeat)
    ):
        extra: dict[str, Any] = {}  # (only when not the defaults: the configuration names the run)
        if compute_ms:
            extra["step_compute_ms"] = compute_ms
        if args.wait_for_round:
            extra["wait_for_round"] = True
        if repeat:
            extra["repeat"] = repeat
        label = _label(system) + f" p{args.averaging_steps_period}"
        if compute_ms:
            label += f" +{compute_ms:g} ms/step"
        if args.wait_for_round:
            label += " waits"
        if repeat:
            label += f" #{repeat + 1}"
        kinds[label] = system
        swarms[label] = runner.run(
            part="decentralized",
            system=system,
            peers=n,
            target=T,
            epochs=E,
            eval_every=args.eval_every,
            matchmaking_time=args.decentralized_matchmaking_time,
            steps_per_epoch=K,
            group_size=args.group_size or n,
            averaging_steps_period=args.averaging_steps_period,
            **extra,
        )
    collaborative = (
        _collaborative(runner, args, E)
        if args.with_collaborative
        else {"error": "not run (--no-collaborative)", "config": {}}
    )
    most = max([E * T, *(r["samples"] for r in (collaborative,) if "error" not in r)])
    ref_epochs = math.ceil(most / T / args.eval_every) * args.eval_every + args.eval_every
    references = {
        optimizer: _reference(runner, args, optimizer, ref_epochs)
        for optimizer in sorted({"adam", *("sgd" for s in kinds.values() if s == "dsgd")})
    }
    collab_final = _final(collaborative, E)
    # swarmavg.Optimizer's own reference: alone with batch T (the convergence part's run)
    alone_epochs = max(E, math.ceil(most / T)) + args.eval_every
    alone_epochs = math.ceil(alone_epochs / args.eval_every) * args.eval_every
    alone_T = (
        runner.run(
            part="convergence",
            system="local",
            peers=1,
            target=T,
            epochs=alone_epochs,
            eval_every=args.eval_every,
        )
        if args.with_collaborative
        else {"error": "not run (--no-collaborative)", "config": {}}
    )
    rows: list[dict[str, Any]] = []
    kinds["swarmavg.Optimizer"] = "swarmavg"
    entries = [*swarms.items()]
    if args.with_collaborative:
        entries.append(("swarmavg.Optimizer", collaborative))
    for label, swarm in entries:
        system = kinds[label]
        optimizer = "sgd" if system == "dsgd" else "adam"
        batch = T if system == "swarmavg" else G
        reference = alone_T if system == "swarmavg" else references[optimizer]
        row: dict[str, Any] = {
            "part": "decentralized",
            "system": label,
            "peers": n,
            "global_batch": batch,
            "reference": f"alone, {optimizer}, batch {batch}",
        }
        final = _final(swarm, E)
        if final is None or "error" in reference:
            row["error"] = swarm.get("error") or reference.get("error") or "did not reach E"
            rows.append(row)
            continue
        at_samples = _interpolate(reference["curve"], final["samples"])
        row |= {
            "samples": final["samples"],
            "val_loss": final["val_loss"],
            "reference_val_loss": at_samples,
            "ratio": None if at_samples is None else final["val_loss"] / at_samples,
        }
        if system != "swarmavg" and collab_final is not None:
            collab = _interpolate(collaborative["curve"], final["samples"])
            row["collaborative_val_loss"] = collab
            row["ratio_collaborative"] = None if collab is None else final["val_loss"] / collab
        row |= _cost(swarm)
        if system != "swarmavg" and row.get("steps_per_peer"):
            row["rounds_asked_per_peer"] = row["steps_per_peer"] // args.averaging_steps_period
        rows.append(row)
    runner.curves["decentralized"] = {
        **swarms,
        **({f"swarmavg.Optimizer, T={T}": collaborative} if args.with_collaborative else {}),
        **{f"alone, {o}, batch {G}": r for o, r in references.items()},
        **({f"alone, adam, batch {T}": alone_T} if args.with_collaborative else {}),
    }
    return rows


def _label(system: str, sync_every: int | None = None, compression: str = "none") -> str:
    names = {
        "dsgd": "DecentralizedSGD",
        "dadam": "DecentralizedAdam",
        "diloco": "DiLoCo",
        "swarmavg": "swarmavg.Optimizer",
    }
    label = names.get(system, system)
    if sync_every is not None:
        label += f" H={sync_every}" + (" fp16" if compression == "fp16" else "")
    return label


def part_diloco(runner: Runner, args: argparse.Namespace) -> list[dict[str, Any]]:
    """DiLoCo, ``--peers`` peers, H in ``--sync-every``: validation loss at equal samples
    beside one process with batch G (Adam), bytes and rounds per peer, fp16 Δ beside fp32."""
    G, K, E0 = _per_step_plan(args)
    T, n = args.target_batch_size, args.peers
    E = E0  # (the last round ends the run: all its local steps are a multiple of every H)
    while any((E * K) % H for H in args.sync_every):
        E += 1
    outers: list[tuple[float, float]] = args.outer or [(args.outer_lr, args.outer_momentum)]
    configs = [(H, "none") for H in args.sync_every]
    configs += [(H, "fp16") for H in args.fp16_sync_every if H > 0]
    #: (H, compression, (outer lr, momentum), repeat) -> run
    runs: dict[tuple[int, str, tuple[float, float], int], dict[str, Any]] = {}
    # (a data seed other than 0 counts as a repeat of its own: runs[..., repeat] keys)
    repeats = [(seed, r) for seed in args.data_seeds for r in range(args.repeat)]
    for (H, compression), (lr, momentum), (seed, rep_index) in itertools.product(
        configs, outers, repeats
    ):
        repeat = rep_index + args.repeat * args.data_seeds.index(seed)
        extra: dict[str, Any] = {  # (only when not the defaults: the configuration names the run)
            key: value
            for key, value, default in (
                ("outer_lr", lr, 0.7),
                ("outer_momentum", momentum, 0.9),
                ("repeat", rep_index, 0),
                ("data_seed", seed, 0),
            )
            if value != default
        }
        runs[H, compression, (lr, momentum), repeat] = runner.run(
            part="diloco",
            system="diloco",
            peers=n,
            target=T,
            epochs=E,
            eval_every=args.eval_every,
            matchmaking_time=args.diloco_matchmaking_time,
            steps_per_epoch=K,
            sync_every=H,
            compression=compression,
            stagger=DILOCO_STAGGER,
            go_delay=DILOCO_GO_DELAY,
            **extra,
        )
    ref_epochs = math.ceil(E / args.eval_every) * args.eval_every + args.eval_every
    reference = _reference(runner, args, "adam", ref_epochs)

    def label(H: int, compression: str, outer: tuple[float, float], repeat: int) -> str:
        text = _label("diloco", H, compression)
        if len(outers) > 1 or outer != (0.7, 0.9):
            text += f" outer {outer[0]:g}/{outer[1]:g}"
        seed = args.data_seeds[repeat // args.repeat]
        text += f" seed {seed}" if seed else ""
        return text + (f" #{repeat % args.repeat + 1}" if repeat % args.repeat else "")

    rows: list[dict[str, Any]] = []
    for (H, compression, outer, repeat), run in runs.items():
        row: dict[str, Any] = {
            "part": "diloco",
            "system": label(H, compression, outer, repeat),
            "sync_every": H,
            "outer_lr": outer[0],
            "outer_momentum": outer[1],
            "compression": compression,
            "peers": n,
            "global_batch": G,
        }
        final = _final(run, E)
        if final is None or "error" in reference:
            row["error"] = run.get("error") or reference.get("error") or "did not reach E"
            rows.append(row)
            continue
        at_samples = _interpolate(reference["curve"], final["samples"])
        row |= {
            "samples": final["samples"],
            "val_loss": final["val_loss"],
            "reference_val_loss": at_samples,
            "ratio": None if at_samples is None else final["val_loss"] / at_samples,
        }
        row |= _cost(run)
        rounds, sent = row.get("rounds_per_peer"), row.get("mb_sent_per_peer")
        if rounds and sent is not None:
            row["mb_per_round"] = sent / rounds
            row["steps_per_round"] = row["steps_per_peer"] / rounds
            # what averaging the same tensors after every local step would send
            row["mb_per_step_averaging"] = sent / rounds * row["steps_per_peer"]
        if compression != "none" and (H, "none", outer, repeat) in runs:
            fp32 = _final(runs[H, "none", outer, repeat], E)
            if fp32 is not None:
                row["vs_fp32"] = final["val_loss"] / fp32["val_loss"] - 1
        if repeat:  # the run-to-run noise: the same configuration's first run
            first = _final(runs[H, compression, outer, 0], E)
            if first is not None:
                row["vs_first_run"] = final["val_loss"] / first["val_loss"] - 1
        rows.append(row)
    runner.curves["diloco"] = {
        **{label(*key): r for key, r in runs.items()},
        f"alone, adam, batch {G}": reference,
    }
    return rows


def _plot_curves(path: Path, curves: dict[str, dict[str, Any]], title: str, G: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _progress(f"matplotlib is not installed: no plot ({path})")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, result in curves.items():
        curve = result.get("curve")
        if not curve:
            continue
        style = "-"
        if label.startswith("alone"):
            style = "k:" if "sgd" in label else "k--" if label.endswith(f"batch {G}") else "k-."
        ax.plot(
            [p["samples"] for p in curve],
            [p["val_loss"] for p in curve],
            style,
            marker=None if label.startswith("alone") else ".",
            label=label,
        )
    ax.set_xlabel("samples, all peers (windows of 64 bytes)")
    ax.set_ylabel("validation cross-entropy (nats/byte)")
    ax.set_ylim(top=3.5)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    _progress(f"plot written to {path}")


# -- output ---------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(head for head, _ in columns) + " | note |")
    print("|" + "---|" * (len(columns) + 1))
    for row in rows:
        cells = [_fmt(row.get(key)) for _, key in columns]
        print("| " + " | ".join(cells) + f" | {row.get('error', '')[:160]} |")


def print_tables(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    conv = [r for r in rows if r["part"] == "convergence"]
    if conv:
        _table(
            f"Convergence: {args.peers} peers, T={args.target_batch_size}, "
            f"E={args.convergence_epochs} vs alone with batch T (goal: ratio <= "
            f"{GOAL_CONVERGENCE})",
            conv,
            [
                ("system", "system"),
                ("swarm samples", "swarm_samples"),
                ("samples/epoch / T", "samples_per_epoch_over_T"),
                ("swarm val loss", "swarm_val_loss"),
                ("alone, same samples", "alone_val_loss_same_samples"),
                ("ratio", "ratio_same_samples"),
                ("alone, same epoch", "alone_val_loss_same_epoch"),
                ("ratio (epoch)", "ratio_same_epoch"),
                ("swarm s", "swarm_wall_s"),
                ("alone s", "alone_wall_s"),
            ],
        )
    light = [r for r in rows if r["part"] == "lightning"]
    if light:
        _table(
            f"Lightning: {args.peers} peers, T={args.target_batch_size}, "
            f"E={args.lightning_epochs}, Trainer.fit with SwarmStrategy vs swarmavg.Optimizer "
            f"directly, {args.lightning_repeats} runs each, means (goals: val loss within "
            f"{GOAL_LIGHTNING_LOSS:.0%}, wall-clock <= {1 + GOAL_LIGHTNING_WALL:.2f}x)",
            light,
            [
                ("system", "system"),
                ("val loss", "val_loss"),
                ("each run", "val_losses"),
                ("wall s", "wall_s"),
                ("each run (s)", "walls"),
                ("samples/epoch / T", "samples_per_epoch_over_T"),
                ("loss ratio", "loss_ratio"),
                ("wall ratio", "wall_ratio"),
            ],
        )
    speed = [r for r in rows if r["part"] == "speed"]
    if speed:
        _table(
            f"Speed: {args.peers} peers, {args.speed_epochs} epochs of T="
            f"{args.target_batch_size} (goal: ours >= {GOAL_SPEEDUP}x faster than hivemind's "
            "best)",
            speed,
            [
                ("system", "system"),
                ("matchmaking_time", "matchmaking_time"),
                ("wall s", "wall_s"),
                ("median epoch s", "median_epoch_s"),
                ("samples/s", "samples_per_s"),
                ("samples/epoch / T", "samples_per_epoch_over_T"),
                ("epochs", "epochs_reached"),
                ("speedup vs hivemind best", "speedup_vs_hivemind_best"),
            ],
        )
    overhead = [r for r in rows if r["part"] == "overhead"]
    if overhead:
        _table(
            f"Overhead: samples/s of {args.peers} peers in a swarm ({args.overhead_epochs} "
            "epochs) vs the same processes alone (matchmaking_time "
            f"{args.overhead_matchmaking_time} s; goal: <= {GOAL_OVERHEAD:.0%} with the delays)",
            overhead,
            [
                ("system", "system"),
                ("delays", "delays"),
                ("samples/s", "samples_per_s"),
                ("overhead", "overhead"),
            ],
        )
    G = args.peers * args.batch_size
    dec = [r for r in rows if r["part"] == "decentralized"]
    if dec:
        _table(
            f"Decentralized: {args.peers} peers, {args.decentralized_epochs} x "
            f"{args.target_batch_size} samples, validation loss at equal samples vs one process "
            f"with the same global batch ({G}; goal: ratio <= {GOAL_DECENTRALIZED}; "
            f"swarmavg.Optimizer: T={args.target_batch_size} beside alone with batch T)",
            dec,
            [
                ("system", "system"),
                ("global batch", "global_batch"),
                ("samples", "samples"),
                ("val loss", "val_loss"),
                ("reference", "reference"),
                ("reference, same samples", "reference_val_loss"),
                ("ratio", "ratio"),
                ("swarmavg.Optimizer, same samples", "collaborative_val_loss"),
                ("ratio (Optimizer)", "ratio_collaborative"),
            ],
        )
    diloco = [r for r in rows if r["part"] == "diloco"]
    if diloco:
        _table(
            f"DiLoCo: {args.peers} peers vs one process with batch {G} (Adam) at equal samples "
            f"(goal: ratio <= {GOAL_DILOCO}; fp16 within {GOAL_FP16:.1%} of fp32; rounds H times "
            "fewer than averaging every step)",
            diloco,
            [
                ("run", "system"),
                ("samples", "samples"),
                ("val loss", "val_loss"),
                ("alone, same samples", "reference_val_loss"),
                ("ratio", "ratio"),
                ("fp16 vs fp32", "vs_fp32"),
                ("vs run 1", "vs_first_run"),
                ("steps/peer", "steps_per_peer"),
                ("rounds/peer", "rounds_per_peer"),
                ("steps/round", "steps_per_round"),
                ("MB sent/peer", "mb_sent_per_peer"),
                ("MB/round", "mb_per_round"),
                ("MB if every step", "mb_per_step_averaging"),
            ],
        )
    cost = [r for r in rows if r["part"] in ("decentralized", "diloco") and "wall_s" in r]
    if cost:
        _table(
            f"Cost per peer ({args.peers} peer processes on this machine; wall-clock depends on "
            "its load, the losses above do not)",
            cost,
            [
                ("optimizer", "system"),
                ("samples", "samples"),
                ("wall s", "wall_s"),
                ("samples/s", "samples_per_s"),
                ("MB sent/peer", "mb_sent_per_peer"),
                ("MB received/peer", "mb_received_per_peer"),
                ("all-reduce rounds/peer", "rounds_per_peer"),
                ("asked/peer", "rounds_asked_per_peer"),
                ("group sizes (all peers)", "group_sizes"),
                ("waited", "waited"),
                ("DiLoCo rounds (all peers)", "diloco_rounds"),
                ("failed/peer", "rounds_failed_per_peer"),
                ("state MB/peer", "mb_state_per_peer"),
            ],
        )


def _parse_outer(text: str) -> list[tuple[float, float]]:
    """``lr:momentum,...`` -> ``[(lr, momentum), ...]``."""
    pairs: list[tuple[float, float]] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        lr, sep, momentum = item.partition(":")
        try:
            pairs.append((float(lr), float(momentum) if sep else 0.9))
        except ValueError:
            raise argparse.ArgumentTypeError(f"lr:momentum pairs, not {item!r}") from None
    if not pairs:
        raise argparse.ArgumentTypeError("an empty list")
    return pairs


def _parse_list(kind: type, choices: tuple[str, ...] = ()) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(x) for x in text.split(",") if x.strip()]
        if choices and any(x not in choices for x in items):
            raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(choices)}")
        if not items:
            raise argparse.ArgumentTypeError("an empty list")
        return items

    return parse


PARTS = ("convergence", "speed", "overhead", "decentralized", "diloco", "lightning")
#: what runs without --parts (the parts of issue 23)
DEFAULT_PARTS = ("convergence", "speed", "overhead")
SYSTEMS = ("swarmavg", "hivemind")
DECENTRALIZED_SYSTEMS = ("dsgd", "dadam")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~2-3 min: fewer epochs and runs")
    parser.add_argument("--parts", type=_parse_list(str, PARTS), default=list(DEFAULT_PARTS))
    parser.add_argument("--systems", type=_parse_list(str, SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--convergence-systems", type=_parse_list(str, SYSTEMS))
    parser.add_argument("--overhead-systems", type=_parse_list(str, SYSTEMS))
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step()")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--convergence-epochs", type=int, help="default 100 (--quick 20)")
    parser.add_argument("--eval-every", type=int, default=5, help="epochs (convergence)")
    parser.add_argument("--convergence-matchmaking-time", type=float, default=1.0)
    parser.add_argument("--speed-epochs", type=int, help="default 20 (--quick 5)")
    parser.add_argument(
        "--matchmaking-times", type=_parse_list(float), help="default 1,2,5 (--quick 1)"
    )
    parser.add_argument("--overhead-epochs", type=int, help="default 20 (--quick 10)")
    parser.add_argument("--overhead-matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--run-timeout", type=float, default=300.0, help="s of training per run")
    parser.add_argument("--hivemind-python", default=str(HIVEMIND_PYTHON))
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="corpus root")
    parser.add_argument("--plot", type=Path, default=Path("optimizer-convergence.png"))
    parser.add_argument("--no-plot", dest="plot", action="store_const", const=None)
    parser.add_argument("--out", type=Path, help="JSON lines: meta, rows, raw runs")
    parser.add_argument("--logs", type=Path, help="the peers' stderr (default: a new tmp dir)")
    parser.add_argument("--verbose", action="store_true", help="the optimizers log at INFO")
    group = parser.add_argument_group("decentralized and diloco parts (issue 25)")
    group.add_argument("--decentralized-epochs", type=int, help="E: default 100 (--quick 25)")
    group.add_argument(
        "--decentralized-systems",
        type=_parse_list(str, DECENTRALIZED_SYSTEMS),
        default=list(DECENTRALIZED_SYSTEMS),
    )
    group.add_argument("--decentralized-matchmaking-time", type=float, default=1.0)
    group.add_argument("--group-size", type=int, default=0, help="dsgd/dadam; 0: --peers")
    group.add_argument("--averaging-steps-period", type=int, default=4, help="dsgd/dadam")
    group.add_argument("--sgd-lr", type=float, default=0.1, help="dsgd and its reference")
    group.add_argument("--momentum", type=float, default=0.9, help="dsgd and its reference")
    group.add_argument("--sync-every", type=_parse_list(int), default=[10, 50], help="DiLoCo H")
    group.add_argument(
        "--fp16-sync-every",
        type=_parse_list(int),
        default=[10],
        help="the H with a Float16Compression run too (0: none)",
    )
    group.add_argument("--diloco-matchmaking-time", type=float, default=5.0)
    group.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD")
    group.add_argument("--outer-momentum", type=float, default=0.9, help="(Nesterov)")
    group.add_argument(
        "--outer",
        type=_parse_outer,
        help="DiLoCo: outer SGD settings to run, lr:momentum,... (e.g. 0.7:0.9,1:0); "
        "default --outer-lr:--outer-momentum",
    )
    group.add_argument(
        "--samples",
        type=int,
        help="the sample budget of all peers (sets --decentralized-epochs to samples / T)",
    )
    group.add_argument(
        "--repeat", type=int, default=1, help="run each decentralized/diloco config N times"
    )
    group.add_argument(
        "--step-compute-ms",
        type=_parse_list(float),
        default=[0.0],
        help="dsgd/dadam: ms of sleep per step standing for a bigger model's compute (a list)",
    )
    group.add_argument(
        "--wait-for-round",
        action="store_true",
        help="dsgd/dadam: each step that asks for a round waits until it is written",
    )
    group.add_argument(
        "--no-collaborative",
        dest="with_collaborative",
        action="store_false",
        help="decentralized: leave swarmavg.Optimizer and its reference out",
    )
    parser.add_argument(
        "--ordered-reduction",
        action="store_true",
        help="diagnostic: swarmavg peers sum each part's values in member order, not in "
        "arrival order (see the peer script)",
    )
    group.add_argument(
        "--data-seeds",
        type=_parse_list(int),
        default=[0],
        help="diloco: run each configuration with each of these data seeds (the peers' "
        "batches; the reference keeps seed 0)",
    )
    parser.add_argument(
        "--identity-seed",
        type=int,
        default=0,
        help="swarmavg peers get PeerIDs derived from this seed (the same member order, hence "
        "the same all-reduce plan, in every run); -1: random ones",
    )
    group.add_argument(
        "--plot-decentralized", type=Path, default=Path("optimizer-decentralized.png")
    )
    group = parser.add_argument_group("lightning part (issue 27)")
    group.add_argument("--lightning-epochs", type=int, help="E: default 100 (--quick 20)")
    group.add_argument("--lightning-repeats", type=int, default=2, help="runs of each system")
    args = parser.parse_args(argv)
    if args.samples is not None:
        if args.decentralized_epochs is not None:
            parser.error("give --samples or --decentralized-epochs, not both")
        args.decentralized_epochs = max(1, round(args.samples / args.target_batch_size))
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.lightning_epochs is None:
        args.lightning_epochs = 20 if args.quick else 100
    if args.decentralized_epochs is None:
        args.decentralized_epochs = 25 if args.quick else 100
    if args.convergence_epochs is None:
        args.convergence_epochs = 20 if args.quick else 100
    if args.speed_epochs is None:
        args.speed_epochs = 5 if args.quick else 20
    if args.overhead_epochs is None:
        args.overhead_epochs = 10 if args.quick else 20
    if args.matchmaking_times is None:
        args.matchmaking_times = [1.0] if args.quick else [1.0, 2.0, 5.0]
    if args.convergence_systems is None:
        args.convergence_systems = [s for s in args.systems if s == "swarmavg"] or args.systems
    if args.overhead_systems is None:
        quick_one = [s for s in args.systems if s == "swarmavg"] or args.systems[:1]
        args.overhead_systems = quick_one if args.quick else args.systems
    if args.peers < 2 or args.target_batch_size < 1 or args.batch_size < 1:
        parser.error("--peers must be >= 2, --target-batch-size and --batch-size >= 1")
    if min(args.eval_every, args.convergence_epochs, args.speed_epochs, args.overhead_epochs) < 1:
        parser.error("--eval-every and the --*-epochs must be >= 1")
    if min(args.lightning_epochs, args.lightning_repeats) < 1:
        parser.error("--eval-every and the --*-epochs must be >= 1")
    if args.logs is None:
        args.logs = Path(tempfile.mkdtemp(prefix="swarmavg-optimizer-bench-"))
    args.logs.mkdir(parents=True, exist_ok=True)

    def on_term(signum: int, frame: object) -> None:  # let `finally` stop the processes
        raise SystemExit(f"signal {signum}")

    previous_term = signal.signal(signal.SIGTERM, on_term)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def _main(args: argparse.Namespace) -> int:
    started = time.time()
    runner = Runner(args)
    rows: list[dict[str, Any]] = []
    try:
        if "convergence" in args.parts:
            rows += part_convergence(runner, args)
        if "speed" in args.parts:
            rows += part_speed(runner, args)
        if "overhead" in args.parts:
            rows += part_overhead(runner, args)
        if "decentralized" in args.parts:
            rows += part_decentralized(runner, args)
        if "diloco" in args.parts:
            rows += part_diloco(runner, args)
        if "lightning" in args.parts:
            rows += part_lightning(runner, args)
    except KeyboardInterrupt:  # every process was stopped on the way out
        _progress("interrupted")
        return 130
    print_tables(rows, args)
    curves = {
        label: run
        for part in ("decentralized", "diloco")
        for label, run in runner.curves.get(part, {}).items()
    }
    if curves and args.plot and args.plot_decentralized:
        G = args.peers * args.batch_size
        _plot_curves(
            args.plot_decentralized,
            curves,
            f"{args.peers} peers, batch {args.batch_size} per step (global {G}) vs alone",
            G,
        )
    notes = [
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, peers' stderr in {args.logs}",
        f"batch_size_per_step {args.batch_size}, Adam lr {args.lr}, warmup "
        f"{args.warmup_epochs} epochs, averaging_timeout {args.averaging_timeout} s",
    ]
    if {"decentralized", "diloco"} & set(args.parts):
        G, K, _ = _per_step_plan(args)
        notes.append(
            f"per-step systems: {K} local steps of {args.batch_size} per reported epoch, warmup "
            f"over {args.warmup_epochs} local steps; DecentralizedSGD/Adam: target_group_size "
            f"{args.group_size or args.peers}, averaging_steps_period "
            f"{args.averaging_steps_period}, SGD lr {args.sgd_lr} momentum {args.momentum}; "
            f"DiLoCo: inner Adam lr {args.lr}, outer SGD lr {args.outer_lr} momentum "
            f"{args.outer_momentum} Nesterov, "
            f"matchmaking_time {args.diloco_matchmaking_time} s, peer 0 starts "
            f"{DILOCO_STAGGER} s before the others"
        )
    busy = [r["machine_busy_cpus"] for r in runner.results.values() if "machine_busy_cpus" in r]
    if busy:
        notes.append(
            f"machine-wide busy CPUs during the runs: {min(busy):.2f}-{max(busy):.2f} "
            "(all processes, this benchmark's included)"
        )
    failed = [r for r in runner.results.values() if "error" in r]
    for r in failed:
        notes.append(f"run {r['config']['name']} ({r['config']['system']}) failed: {r['error']}")
    notes.append(f"the whole run took {time.time() - started:.0f} s")
    print()
    for note in notes:
        print(f"- {note}")
    if args.out:
        meta = {
            "kind": "meta",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "notes": notes,
        }
        lines = [meta, *({"kind": "row", **row} for row in rows)]
        lines += [{"kind": "raw", **result} for result in runner.results.values()]
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
