"""Averaging benchmarks: swarmavg's all-reduce, whole round, group formation and CPU per round,
beside torch.distributed gloo and hivemind 1.1.12 measured in the same run.

    python benchmarks/averaging.py [--quick] [--out results.jsonl] [--peers 4,8] [--size S]
                                   [--rounds R] [--no-gloo] [--no-hivemind] [--no-plain]
                                   [--no-encrypted] [--hivemind-python PATH]
                                   [--main] [--faults [--fault-quick]] [--state] [--codecs]
                                   [--baseline TREE [--repeats K]] [--part-size-bytes B]

hivemind's side needs a venv with ``hivemind==1.1.12`` (default ``/tmp/hm-venv/bin/python``;
``--hivemind-python`` for another); without one its cells say why they are empty.

Setting: N peers (``--peers``, default 4 and 8), each a process of its own on loopback, each
averaging one float32 tensor of S elements (``--size``, default 16 Mi = 16·2**20, i.e. 64 MiB;
``--quick``: 1 Mi). Every process sets ``torch.set_num_threads(1)``. The runs go one after the
other, never two at once: gloo (each N), then ours (plain TCP at each N, then encrypted TCP at
each N), gloo again, then hivemind (at ``--hivemind-peers``, default the largest N).

swarmavg (``_averaging_peer.py``): a pool of max(N) peer processes ("spawn"; torch and swarmavg
imported before anything is timed), driven over pipes. For each setting the first N of them each
start a ``swarmavg.DHT(transport="tcp", host="127.0.0.1", port=0,
transport_options={"encryption": ...})`` (peer 0 the bootstrap, the others joining it one after
the other) and a ``swarmavg.DecentralizedAverager`` over their tensor (peer i's all equal to i)
with ``target_group_size = min_group_size = N`` under a fresh prefix. Then, after ``--settle``
seconds, ``--warmup`` untimed and ``--rounds`` timed rounds, ``--gap`` seconds apart. A round:
the driver sends every peer a start time 0.2 s ahead (``time.monotonic()``, one clock for all
processes on Linux); each sleeps until then and calls ``averager.step(timeout=--step-timeout)``
(the sync facade, as a training loop would). Per peer i: start_i and end_i around the call,
its ``StepResult.allreduce_seconds`` a_i, its process CPU time over the call. Per round:

- all-reduce, group formed = max_i a_i (from the moment peer i learned its group to the
  average written back into its tensor, copies in and out included);
- whole round = max_i end_i - min_i start_i;
- group formation = max_i (end_i - a_i - start_i): from the step() call until the peer had its
  group, as its caller sees it;
- CPU = the sum over peers of their process CPU time (all threads) over the call, and the
  machine-wide busy CPU seconds (/proc/stat) from the start time until the last answer.
  Machine-wide figures include whatever else the machine runs: the notes give that load (busy
  CPU less the CPU of this benchmark's processes, per second; for gloo and hivemind likewise)
  and warn above 0.25 CPU, as it inflates every timing.

A round counts when every peer's step returned a group of N with N contributors; figures are the
median and min over the counted rounds.

``--baseline TREE`` (another checkout, e.g. ``git worktree add /tmp/base <commit>``) runs each
setting of ours ``--repeats`` times (default 2) on this checkout's code and as often with
processes that import ``swarmavg`` and the transports from ``TREE``, taking turns; its rows
compare ours with the baseline (the rounds of all runs of a side pooled; the notes give each
run's median). After the rounds every tensor must equal the mean
(N-1)/2 (the largest deviation is reported).

gloo (``_averaging_gloo.py``): N rank processes, ``init_process_group("gloo", tcp://127.0.0.1)``,
``--warmup`` untimed ``all_reduce`` calls, then ``--gloo-iters`` times ``barrier()`` and a timed
``all_reduce(SUM)`` of the same S float32 elements: the time is the max over ranks, CPU the sum
of the ranks' process CPU over the call; machine-wide busy CPU over the timed loop (barriers
included) per call. gloo runs before ours and again after (when ours runs), and its figures are
those of the run with the lower median (the notes give both): this machine's speed drifts by up
to 1.6x over tens of seconds, gloo's median moved 0.084-0.145 s at N=4 between runs of one
evening, and its second run came out slower each time; the reference at its best keeps a slow
spell during one gloo run from flattering our ratio.

hivemind (``_averaging_hivemind.py``, under hivemind's Python, a session of its own): N DHTs and
N ``DecentralizedAverager`` (hivemind's defaults: ``min_matchmaking_time=5``,
``request_timeout=3``, no compression), same tensors, ``--warmup`` + ``--rounds`` rounds where
all peers call ``step(wait=False)`` together (a thread barrier) and ``StepControl.stage`` is
polled every 2 ms: whole round, formation (step() call to RUNNING_ALLREDUCE, max over peers),
all-reduce and CPU as above (its process CPU is that of its averager and DHT processes and p2pd
daemons). hivemind always encrypts (libp2p), so it is compared with our encrypted figures.

Targets (issue): all-reduce with the group formed <= 1.5x gloo's time unencrypted and <= 2.5x
encrypted (N=4 and N=8, S=16 Mi); whole round at N=8 encrypted >= 5x faster than hivemind's,
group formation >= 4x faster; CPU per round is reported beside gloo's (no target). ratio =
ours / reference (lower is better, but for the MB/s rows, where higher is).

The main table runs unless ``--faults``, ``--state`` or ``--codecs`` is given (``--main`` runs it
beside them; ``--no-gloo``, ``--no-plain``, ``--no-encrypted``, ``--no-hivemind`` leave parts of it
out).

Issue 22 (``--faults``, a table of its own; ``_averaging_faults.py`` has the method): the
survivors' step times before and after a peer leaves (Ctrl+C: SIGINT, the script shuts its
averager and DHT down) or dies (SIGKILL) at each stage of a round (``idle`` between rounds,
``looking`` for a group, right after its ``allreduce`` began, ``allreduce-mid``), over TCP and
QUIC, at N = 4 and 8 (``--fault-peers``, ``--fault-transports``, ``--fault-kinds``,
``--fault-stages``), each peer a training loop of ``step(timeout=--fault-step-timeout)`` (15 s)
and ``--fault-compute`` (0.1 s) of compute on ``--fault-size`` (4 Mi) float32 elements with
``target_group_size=N``, swarmavg's defaults otherwise; hivemind 1.1.12 in the same scenarios
and run (``--no-hivemind`` leaves it out; TCP only by default, ``--fault-hivemind-transports``:
its p2pd listens on QUIC (``/quic-v1``) but in a trial at N=4 most of its rounds there failed
before any fault, "Unable to run All-Reduce", 15-20 s steps). Per scenario: the median step
time before, the fault round's (and whether a survivor's step raised, with what), the three
rounds after, whether the survivors' tensors agree exactly after the next complete round, and
whether the second round after is within 2x the median before (the issue's target).
``--fault-quick``: N=4, TCP, stages ``looking`` and ``allreduce``, fewer rounds before (the
test's setting). Every scenario is bounded (``--fault-scenario-timeout``: reported as hung,
its processes killed); the peers' logs go under ``--fault-logs``. ``--out``: one
``fault_row`` line per scenario and a ``raw`` one with every step of every peer.

Issue 7 rows, off unless asked for:

- ``--state``: a taker and k donor processes (k in ``--state-donors``, 1,2,4) on plain TCP, each
  donor sharing one float32 tensor of ``--state-mb`` (256) MiB; the taker times
  ``load_state_from_peers()`` ``--state-repeats`` (3) times (MB/s = 10**6 bytes/s). The donors
  hold the same state, so the taker (``state_max_donors=k``) fetches disjoint ranges from all k
  at once. Two rows per k: the first load, for which every donor copies and hashes its state (a
  snapshot), and the median of the later ones, which come within the 2 s a donor reuses its
  snapshot for (the transfer alone). Reference: the same bytes over one plain asyncio TCP
  connection between two processes (``_averaging_bulk.py``), in the same run.
- ``--codecs``: on one pool of ``--codec-peers`` (4) processes with ``--codec-size`` (16 Mi;
  ``--quick``: 1 Mi) float32 elements each, encrypted TCP (the default;
  ``--no-codec-encrypted``: plain), for each codec of ``swarmavg.compression`` in
  ``--codec-list`` (default NoCompression, Float16Compression, ScaledFloat16Compression,
  Uniform8BitQuantization, Quantile8BitQuantization, BlockwiseQuantization): a fresh swarm with
  ``compression=`` that codec (the peer makes it from its name), ``averaging_alpha=1``, equal
  weights, ``--warmup`` + ``--codec-rounds`` (3; ``--quick``: 2) rounds as above. Before each
  round every peer sets its tensor to ``torch.randn`` values seeded by (round, peer), the same
  for every codec; after each timed round every peer reports its tensor's error against the
  exact mean (float64). A table of its own, a row per codec: all-reduce and whole round (median
  [min]) and bytes sent per peer, each over NoCompression's, and the worst relative RMS error
  (RMS(result - mean) / RMS(mean)) and largest absolute error over peers and timed rounds.

Every pipe wait, call and subprocess has a timeout; peer and rank processes ignore SIGINT and
are shut down (killed if they do not exit) in ``finally``, also on Ctrl+C and SIGTERM;
hivemind's process group is killed at the end of its run. ``--out FILE`` writes JSON lines
(replacing FILE): one ``meta`` record, one ``row`` per table row, one ``raw`` per run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _averaging_bulk import measure as bulk_reference_seconds
from _averaging_common import (
    hivemind_sockets,
    machine_busy_seconds,
    remove_stale_sockets,
    stats,
    tree_cpu_seconds,
)
from _averaging_faults import KINDS as FAULT_KINDS
from _averaging_faults import STAGES as FAULT_STAGES
from _averaging_faults import fault_rows, print_fault_table, run_faults
from _averaging_gloo import rank_main
from _averaging_peer import CODEC_CLASSES, peer_main

HERE = Path(__file__).resolve().parent
HIVEMIND_PYTHON = Path("/tmp/hm-venv/bin/python")
MiB = 1 << 20
SPAWN_TIMEOUT = 180.0  # all peer processes up, torch and swarmavg imported (2 CPUs, 8 imports)
OP_TIMEOUT = 60.0  # a DHT start, an averager made, a check
EXIT_TIMEOUT = 15.0  # a process gone after it was told to stop, before it is killed
WORKER_IDLE = 1800.0  # a peer process gives up when its driver says nothing for this long
GO_DELAY = 0.2  # a round starts this long after the driver sends the start time
GLOO_TIMEOUT = 600.0  # one gloo run, spawn to result
HIVEMIND_TIMEOUT = 900.0  # the whole hivemind run
#: a round's figures that a setting's result gives statistics of (median, min, ...)
ROUND_STATS = (
    "allreduce_s",
    "allreduce_wall_s",
    "round_s",
    "formation_s",
    "matchmaking_s",
    "start_skew_s",
    "process_cpu_s",
    "process_sys_s",
    "machine_cpu_s",
    "foreign_cpu_s",
    "foreign_per_s",
)
#: ratio targets (ours / reference, at most)
TARGET_ALLREDUCE_PLAIN = 1.5
TARGET_ALLREDUCE_ENCRYPTED = 2.5
TARGET_ROUND = 1 / 5
TARGET_FORMATION = 1 / 4
#: CPUs busy with other processes' work during the timed part above which the notes warn
FOREIGN_WARN = 0.25


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- our peer processes ---------------------------------------------------------------------------


class _PeerHandle:
    """The driver's end of one peer process (``_averaging_peer.peer_main``)."""

    def __init__(self, ctx: Any, index: int, tree: str | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=peer_main,
            args=(child, WORKER_IDLE, tree),
            name=f"avg-{'base' if tree else 'peer'}-{index}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self._seq = 0

    def send(self, op: str, *args: Any) -> int:
        self._seq += 1
        self.conn.send((self._seq, op, args))
        return self._seq

    def answer(self, seq: int, what: str, deadline: float) -> Any:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise TimeoutError(f"{self.proc.name}: no answer to {what} in time")
            got, status, payload = self.conn.recv()
            if got != seq:
                continue  # a late answer to an earlier request
            if status == "error":
                raise RuntimeError(f"{self.proc.name}: {what}: {payload}")
            return payload

    def call(self, op: str, *args: Any, timeout: float = OP_TIMEOUT) -> Any:
        return self.answer(self.send(op, *args), op, time.monotonic() + timeout)


class _Pool:
    """``size`` warm peer processes; a setting uses the first N of them. ``tree``: another
    checkout whose swarmavg they import (``--baseline``)."""

    def __init__(self, size: int, tree: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.peers: list[_PeerHandle] = []
        try:
            for i in range(size):
                self.peers.append(_PeerHandle(ctx, i, tree))
            deadline = time.monotonic() + SPAWN_TIMEOUT
            for peer in self.peers:
                peer.answer(0, "start-up", deadline)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Tells every process to exit, waits for all of them together (``EXIT_TIMEOUT``; a
        process in the middle of a step answers after it), kills those still there."""
        peers, self.peers = self.peers, []
        for peer in peers:
            with contextlib.suppress(Exception):  # gone already: nothing to tell
                peer.send("exit")
        deadline = time.monotonic() + EXIT_TIMEOUT
        for peer in peers:
            peer.proc.join(max(0.0, deadline - time.monotonic()))
        for peer in peers:
            if peer.proc.is_alive():
                _progress(f"killing {peer.proc.name}: it did not exit")
                peer.proc.kill()
            peer.proc.join(EXIT_TIMEOUT)
            peer.conn.close()


def _ours_round(
    peers: list[_PeerHandle], args: argparse.Namespace, n: int, index: int
) -> dict[str, Any]:
    go_at = time.monotonic() + GO_DELAY
    budget = args.step_timeout + args.request_timeout + args.allreduce_timeout + 30.0
    seqs = [peer.send("step", go_at, args.step_timeout) for peer in peers]
    time.sleep(max(0.0, go_at - time.monotonic()))
    busy0 = machine_busy_seconds()
    tree0 = tree_cpu_seconds(os.getpid(), include_root=True)
    window = time.monotonic()
    answers = [
        peer.answer(seq, "step", go_at + budget) for peer, seq in zip(peers, seqs, strict=True)
    ]
    busy1 = machine_busy_seconds()
    tree1 = tree_cpu_seconds(os.getpid(), include_root=True)
    window = time.monotonic() - window
    errors = [f"peer {i}: {a['error']}" for i, a in enumerate(answers) if "error" in a]
    bad = [
        f"peer {i}: group of {a['group_size']}, {a['contributors']} contributors"
        for i, a in enumerate(answers)
        if "error" not in a and (a["group_size"] != n or a["contributors"] != n)
    ]
    out: dict[str, Any] = {"round": index, "ok": not errors and not bad, "errors": errors + bad}
    starts = [a["start"] for a in answers]
    ends = [a["end"] for a in answers]
    out["start_skew_s"] = max(starts) - min(starts)
    out["process_cpu_s"] = sum(a["cpu"] for a in answers)
    out["process_sys_s"] = sum(a.get("cpu_sys", 0.0) for a in answers)
    out["machine_cpu_s"] = None if busy0 is None or busy1 is None else busy1 - busy0
    if out["machine_cpu_s"] is not None and tree0 is not None and tree1 is not None:
        # busy CPU of processes that are not this benchmark's: load from elsewhere
        out["foreign_cpu_s"] = out["machine_cpu_s"] - (tree1 - tree0)
        out["foreign_per_s"] = out["foreign_cpu_s"] / window if window > 0 else None
    out["round_s"] = max(ends) - min(starts)
    if out["ok"]:
        formed = [a["end"] - a["allreduce_s"] for a in answers]
        out["allreduce_s"] = max(a["allreduce_s"] for a in answers)
        out["allreduce_wall_s"] = max(ends) - min(formed)
        out["formation_s"] = max(f - s for f, s in zip(formed, starts, strict=True))
        out["matchmaking_s"] = max(a["matchmaking_s"] for a in answers)
        out["bytes_sent_per_peer"] = max(a["bytes_sent"] for a in answers)
        out["bytes_received"] = [a["bytes_received"] for a in answers]
        out["bandwidths"] = [a.get("bandwidth") for a in answers]
    return out


def _run_ours(pool: _Pool, n: int, encryption: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One setting (N, encryption) on the first N processes of ``pool``: a fresh swarm, rounds,
    the check; the swarm is shut down again. Raises if a process fails or stops answering (the
    caller then closes the pool: a process may be stuck, and its swarm is not shut down here)."""
    peers = pool.peers[:n]
    result: dict[str, Any] = {
        "system": "swarmavg",
        "peers": n,
        "size": args.size,
        "encryption": encryption,
        "rounds": args.rounds,
    }
    elapsed, maddrs = peers[0].call("start", [], encryption)
    starts = [elapsed]
    for peer in peers[1:]:
        elapsed, _ = peer.call("start", maddrs, encryption)
        starts.append(elapsed)
    result["dht_start_s"] = starts
    prefix = f"avgbench_{n}_{'enc' if encryption else 'plain'}_{uuid.uuid4().hex[:8]}"
    options = {
        "averaging_expiration": args.averaging_expiration,
        "request_timeout": args.request_timeout,
        "allreduce_timeout": args.allreduce_timeout,
    }
    if args.part_size_bytes is not None:
        options["part_size_bytes"] = args.part_size_bytes
    for i, peer in enumerate(peers):
        peer.call("averager", prefix, n, args.size, float(i), options)
    time.sleep(args.settle)
    rounds = []
    for r in range(args.warmup + args.rounds):
        if r:
            time.sleep(args.gap)
        rounds.append(_ours_round(peers, args, n, r))
        got = rounds[-1]
        _progress(
            f"  swarmavg N={n} {'encrypted' if encryption else 'plain'} round {r}"
            f"{' (warm-up)' if r < args.warmup else ''}: "
            + (
                f"all-reduce {got['allreduce_s']:.3f} s, round {got['round_s']:.3f} s, "
                f"formation {got['formation_s']:.3f} s, received MB "
                + "/".join(f"{b / 1e6:.0f}" for b in got["bytes_received"])
                + (
                    ", measured MB/s "
                    + "/".join(f"{b / 1e6:.0f}" for b in got["bandwidths"] if b is not None)
                    if any(b is not None for b in got["bandwidths"])
                    else ""
                )
                if got["ok"]
                else f"FAILED {got['errors'][:2]}"
            )
        )
    timed = rounds[args.warmup :]
    good = [r for r in timed if r["ok"]]
    result["rounds_ok"] = len(good)
    result["failures"] = [r for r in timed if not r["ok"]]
    result["warmup_rounds"] = rounds[: args.warmup]
    result["per_round"] = good
    for key in ROUND_STATS:
        result[key] = stats([r[key] for r in good if r.get(key) is not None])
    expected = (n - 1) / 2
    result["max_abs_error"] = max(peer.call("error", expected) for peer in peers)
    for peer in peers:
        peer.call("stop")
    return result


def _run_ours_all(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every (encryption, N) setting, plain first; ``{"plain-4": {...}, ...}``. With
    ``--baseline``, each setting runs ``--repeats`` times on this checkout's code and as often
    on the baseline's, taking turns (ours, baseline, ours, ...), each on its own warm pool:
    ``{"plain-4": ..., "baseline-plain-4": ...}``, each the rounds of all its runs pooled
    (:func:`_pooled`)."""
    jobs: list[tuple[str, str, Callable[[_Pool], dict[str, Any]]]] = []
    sides = [("", None), ("baseline-", args.baseline)] if args.baseline else [("", None)]
    for encryption in (False, True):
        if args.encrypted if encryption else args.plain:
            for n in args.peers:
                kind = "encrypted" if encryption else "plain"
                run = functools.partial(_run_ours, n=n, encryption=encryption, args=args)
                for rep in range(args.repeats):
                    for side, tree in sides:
                        who = f"baseline ({tree})" if tree else "swarmavg"
                        line = f"running {who} N={n} {kind}, run {rep + 1}/{args.repeats} ..."
                        jobs.append((f"{side}{kind}-{n}#{rep}", line, run))
    pools: dict[str, str | None] = {"": None}
    if args.baseline:
        pools["baseline-"] = args.baseline
    runs = _run_on_pools(max(args.peers), pools, jobs)
    return {
        key: _pooled([runs[k] for k in runs if k.split("#")[0] == key])
        for key in {k.split("#")[0] for k in runs}
    }


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one setting as one: the rounds of all of them, their statistics over those;
    ``run_medians`` holds each run's own median all-reduce and CPU (the first failure, if every
    run failed)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    if len(runs) == 1:
        return {**good[0], "runs": 1}
    out = dict(good[0])
    rounds = [r for run in good for r in run["per_round"]]
    out["per_round"] = rounds
    out["rounds_ok"] = len(rounds)
    out["rounds"] = sum(run["rounds"] for run in good)
    out["failures"] = [f for run in good for f in run["failures"]]
    out["max_abs_error"] = max(run["max_abs_error"] for run in good)
    for key in ROUND_STATS:
        out[key] = stats([r[key] for r in rounds if r.get(key) is not None])
    out["runs"] = len(runs)
    out["run_errors"] = [r["error"] for r in runs if "error" in r]
    out["run_medians"] = [
        {k: (run.get(k) or {}).get("median") for k in ("allreduce_s", "process_cpu_s")}
        for run in good
    ]
    return out


def _run_on_one_pool(
    size: int, jobs: list[tuple[str, str, Callable[[_Pool], dict[str, Any]]]]
) -> dict[str, dict[str, Any]]:
    """``{key: run(pool)}`` for each (key, progress line, run) of ``jobs`` in turn, on one pool
    of ``size`` processes; a job that fails gets ``{"error": ...}`` and the next a fresh pool."""
    return _run_on_pools(size, {"": None}, jobs)


def _run_on_pools(
    size: int,
    trees: dict[str, str | None],
    jobs: list[tuple[str, str, Callable[[_Pool], dict[str, Any]]]],
) -> dict[str, dict[str, Any]]:
    """As :func:`_run_on_one_pool`, with one pool per entry of ``trees`` (a key prefix: the
    checkout its processes import, ``None`` for this one); a job runs on the pool whose prefix
    its key starts with (the longest)."""
    results: dict[str, dict[str, Any]] = {}
    pools: dict[str, _Pool] = {}
    try:
        for key, line, run in jobs:
            _progress(line)
            side = max((p for p in trees if key.startswith(p)), key=len)
            try:
                if side not in pools:
                    pools[side] = _Pool(size, trees[side])
                results[key] = run(pools[side])
            except Exception as exc:
                results[key] = {"error": _error(exc)}
                _progress(f"  failed: {results[key]['error']}")
                if side in pools:  # a process may be stuck: start afresh for the next one
                    pools.pop(side).close()
    finally:
        for pool in pools.values():
            pool.close()
    return results


# -- issue 7: state download (--state) -----------------------------------------------------------


def _run_state(args: argparse.Namespace) -> dict[str, Any]:
    """The raw TCP bulk reference, then for each donor count k: k donor processes sharing the
    same state of ``--state-mb`` MB (one float32 tensor), one taker (``state_max_donors=k``)
    timing ``load_state_from_peers`` ``--state-repeats`` times: its ranges come from all k."""
    total = args.state_mb * MiB
    size = total // 4
    result: dict[str, Any] = {"bytes": total}
    _progress(f"  raw asyncio TCP bulk, {args.state_mb} MiB ...")
    result["raw_s"] = stats([bulk_reference_seconds(total) for _ in range(args.state_repeats)])
    pool = _Pool(max(args.state_donors) + 1)
    try:
        taker, donors = pool.peers[0], pool.peers[1:]
        for k in args.state_donors:
            _, maddrs = taker.call("start", [], False)
            for donor in donors[:k]:
                donor.call("start", maddrs, False)
            prefix = f"avgstate_{uuid.uuid4().hex[:8]}"
            taker_options = {"allow_state_sharing": False, "state_max_donors": k}
            taker.call("averager", prefix, 2, 1, 0.0, taker_options)
            for i, donor in enumerate(donors[:k]):  # (one state: the taker combines them all)
                options = {"allow_state_sharing": True, "state_sharing_priority": float(i)}
                donor.call("averager", prefix, 2, size, 1.0, options)
            time.sleep(args.settle)
            loads = []
            for _ in range(args.state_repeats):
                got = taker.call("load_state", args.state_timeout, timeout=args.state_timeout + 30)
                _progress(f"  {k} donor(s): {got}")
                loads.append(got)
            result[f"donors_{k}"] = loads
            good = [g["seconds"] for g in loads if g.get("bytes") == total]
            result[f"donors_{k}_first_s"] = stats(good[:1])  # (the donors snapshot)
            result[f"donors_{k}_s"] = stats(good[1:])  # (the snapshot reused)
            for peer in [taker, *donors[:k]]:
                peer.call("stop")
    finally:
        pool.close()
    return result


def _mb_per_s(total: int, seconds: Any) -> dict[str, Any] | None:
    """Seconds (stats) as MB/s (median of the rate = rate of the median; min = the best)."""
    if not isinstance(seconds, dict) or not seconds.get("n"):
        return None
    return {"n": seconds["n"], "median": total / 1e6 / seconds["median"], "min": None}


def _issue7_rows(args: argparse.Namespace, state: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = []
    if state is not None and "error" not in state:
        total = state["bytes"]
        raw = _mb_per_s(total, state["raw_s"])
        for k in args.state_donors:
            for key, which in (("first_s", "first load"), ("s", "later loads")):
                row = _row(
                    f"state download {total // MiB} MiB, {k} donor(s) at once, {which}",
                    _mb_per_s(total, state.get(f"donors_{k}_{key}")),
                    "raw TCP",
                    raw,
                    None,
                )
                row["unit"] = "MB/s"
                rows.append(row)
    return rows


def _issue7_notes(state: dict[str, Any] | None) -> list[str]:
    notes = []
    if state is not None:
        if "error" in state:
            notes.append(f"state: {state['error']}")
        else:
            notes.append(
                "state: the k donors hold the same state, so load_state_from_peers "
                "(state_max_donors=k) fetches disjoint ranges from all k at once; every "
                "process on this machine shares its cores; MB/s rows: higher is better "
                "(ours/ref < 1 is slower than raw TCP)"
            )
            for k in (1, 2, 4):
                for got in state.get(f"donors_{k}", []):
                    if got.get("bytes") != state["bytes"]:
                        notes.append(f"state: {k} donor(s): a load failed: {got}")
    return notes


# -- gloo -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_gloo(n: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    procs: list[Any] = []
    timeout = args.allreduce_timeout + 60.0  # gloo's own timeout for a collective
    try:
        port = _free_port()
        for rank in range(n):
            proc = ctx.Process(
                target=rank_main,
                args=(rank, n, port, args.size, args.gloo_iters, args.warmup, timeout, sender),
                name=f"gloo-rank-{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        sender.close()
        if not receiver.poll(GLOO_TIMEOUT):
            raise TimeoutError(f"gloo N={n}: no result within {GLOO_TIMEOUT:.0f} s")
        raw: dict[str, Any] = receiver.recv()
        deadline = time.monotonic() + EXIT_TIMEOUT
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(EXIT_TIMEOUT)
        receiver.close()
        sender.close()
    return {
        "system": "gloo",
        "peers": n,
        "size": args.size,
        "iters": args.gloo_iters,
        "init_s": raw["init_s"],
        "finite": raw["finite"],
        "allreduce_s": stats(raw["times_s"]),
        "process_cpu_s": stats(raw["cpu_s"]),
        "process_sys_s": stats(raw["cpu_sys_s"]),
        "machine_cpu_s": raw["machine_cpu_s"],
        "foreign_cpu_s": raw["foreign_cpu_s"],
        "foreign_per_s": raw["foreign_per_s"],
        "times_s": raw["times_s"],
    }


def _run_gloo_all(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    for n in args.peers:
        _progress(f"running gloo N={n} ...")
        try:
            results[n] = _run_gloo(n, args)
            _progress(f"  all_reduce median {results[n]['allreduce_s']['median']:.3f} s")
        except Exception as exc:
            results[n] = {"error": _error(exc)}
            _progress(f"  failed: {results[n]['error']}")
    return results


def _best_gloo(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Per N, gloo's run (before ours or after) with the lower median: the reference at its
    best, so that a slow spell during one gloo run never flatters our ratio (the second run
    came out 5-45% slower in 2 of 2 tries). Both runs' medians are kept for the notes."""
    best: dict[int, dict[str, Any]] = {}
    for n, first in before.items():
        second = after.get(n, {"error": "not run"})
        if "error" in first or "error" in second:
            best[n] = second if "error" in first else first
            continue
        runs = [first["allreduce_s"]["median"], second["allreduce_s"]["median"]]
        best[n] = {**(first if runs[0] <= runs[1] else second), "run_medians": runs}
    return best


# -- hivemind -------------------------------------------------------------------------------------


def _run_hivemind(args: argparse.Namespace) -> dict[str, Any]:
    """``_averaging_hivemind.py`` under hivemind's Python: its JSON, or ``{"error": ...}``."""
    python = Path(args.hivemind_python)
    if not python.exists():
        return {"error": f"skipped: {python} not found (a venv with hivemind==1.1.12)"}
    command = [
        str(python),
        str(HERE / "_averaging_hivemind.py"),
        f"--peers={args.hivemind_peers}",
        f"--size={args.size}",
        f"--rounds={args.rounds}",
        f"--warmup={args.warmup}",
        f"--step-timeout={max(args.step_timeout, 10.0)}",
        f"--allreduce-timeout={args.allreduce_timeout}",
        f"--settle={args.settle}",
        f"--gap={args.gap}",
    ]
    sockets_before = hivemind_sockets()
    # a session of its own, so that its averager and DHT processes and their p2pd daemons can be
    # killed as a group if it does not shut them down itself
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, err = proc.communicate(timeout=HIVEMIND_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # it shuts everything down on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=30)
            return {"error": f"timed out after {HIVEMIND_TIMEOUT:.0f} s"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        remove_stale_sockets(sockets_before)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}; stderr: {err[-800:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- issue 7: each codec's round time and the error it leaves (--codecs) --------------------------


def _codec_seed(round_: int, peer: int) -> int:
    """The seed of peer ``peer``'s tensor in round ``round_`` (the same for every codec, so that
    the codecs average the same values)."""
    return 1_000 * (round_ + 1) + peer


def _call_all(peers: list[_PeerHandle], op: str, per_peer: list[tuple[Any, ...]]) -> list[Any]:
    """``op`` on every peer at once (its own arguments each); their answers, in order."""
    seqs = [peer.send(op, *a) for peer, a in zip(peers, per_peer, strict=True)]
    deadline = time.monotonic() + OP_TIMEOUT
    return [peer.answer(seq, op, deadline) for peer, seq in zip(peers, seqs, strict=True)]


def _run_codec(pool: _Pool, codec: str, args: argparse.Namespace) -> dict[str, Any]:
    """One codec on the first ``--codec-peers`` processes of ``pool``: a fresh swarm whose
    averagers use ``compression=codec``; ``--warmup`` + ``--codec-rounds`` rounds, each from
    seeded random tensors, the timed ones followed by the error against the exact mean."""
    n, size, encryption = args.codec_peers, args.codec_size, args.codec_encrypted
    peers = pool.peers[:n]
    result: dict[str, Any] = {"codec": codec, "peers": n, "size": size, "encryption": encryption}
    _, maddrs = peers[0].call("start", [], encryption)
    for peer in peers[1:]:
        peer.call("start", maddrs, encryption)
    options = {
        "averaging_expiration": args.averaging_expiration,
        "request_timeout": args.request_timeout,
        "allreduce_timeout": args.allreduce_timeout,
        "averaging_alpha": 1.0,
        "compression": codec,  # a name: the peer makes the codec (nothing but names cross over)
    }
    prefix = f"avgcodec_{codec}_{uuid.uuid4().hex[:8]}"
    for peer in peers:
        peer.call("averager", prefix, n, size, 0.0, options)
    time.sleep(args.settle)
    rounds = []
    ended = time.monotonic()
    for r in range(args.warmup + args.codec_rounds):
        seeds = [_codec_seed(r, i) for i in range(n)]
        _call_all(peers, "randomize", [(seed,) for seed in seeds])
        if r:  # --gap from the end of the last round (its error took some of it)
            time.sleep(max(0.0, args.gap - (time.monotonic() - ended)))
        got = _ours_round(peers, args, n, r)  # every peer's weight is the default, 1
        ended = time.monotonic()
        timed = r >= args.warmup
        if got["ok"] and timed:
            got["peer_errors"] = _call_all(peers, "mean_error", [(seeds,)] * n)
            got["rel_rms"] = max(e["rel_rms"] for e in got["peer_errors"])
            got["max_abs"] = max(e["max_abs"] for e in got["peer_errors"])
        rounds.append(got)
        _progress(
            f"  {codec} round {r}{'' if timed else ' (warm-up)'}: "
            + (
                f"all-reduce {got['allreduce_s']:.3f} s, round {got['round_s']:.3f} s, "
                f"{got['bytes_sent_per_peer'] / 1e6:.1f} MB sent"
                + (f", rel. RMS error {got['rel_rms']:.2e}" if timed else "")
                if got["ok"]
                else f"FAILED {got['errors'][:2]}"
            )
        )
    good = [r for r in rounds[args.warmup :] if r["ok"]]
    result["rounds"] = args.codec_rounds
    result["rounds_ok"] = len(good)
    result["per_round"] = rounds
    for key in ("allreduce_s", "round_s", "bytes_sent_per_peer", "process_cpu_s", "foreign_per_s"):
        result[key] = stats([r[key] for r in good if r.get(key) is not None])
    # the worst over peers and timed rounds
    result["rel_rms"] = max((r["rel_rms"] for r in good), default=None)
    result["max_abs"] = max((r["max_abs"] for r in good), default=None)
    for peer in peers:
        peer.call("stop")
    return result


def _run_codecs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every codec of ``--codec-list`` in turn on one pool (a fresh one after a failure)."""
    jobs: list[tuple[str, str, Callable[[_Pool], dict[str, Any]]]] = [
        (codec, f"running codec {codec} ...", functools.partial(_run_codec, codec=codec, args=args))
        for codec in args.codec_list
    ]
    return _run_on_one_pool(args.codec_peers, jobs)


def _codec_rows(codecs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per codec: medians (and mins) of the all-reduce, the whole round and the bytes sent
    per peer, each beside NoCompression's (ratio = codec / NoCompression), and the error."""
    base = codecs.get("NoCompression", {})
    rows = []
    for codec, got in codecs.items():
        row: dict[str, Any] = {"codec": codec, "rounds_ok": got.get("rounds_ok", 0)}
        for key in ("allreduce_s", "round_s", "bytes_sent_per_peer"):
            row[key] = _median(got.get(key))
            row[f"{key}_min"] = got[key]["min"] if row[key] is not None else None
            ref = _median(base.get(key))
            row[f"{key}_ratio"] = row[key] / ref if row[key] is not None and ref else None
        row["rel_rms"] = got.get("rel_rms")
        row["max_abs"] = got.get("max_abs")
        rows.append(row)
    return rows


def _print_codec_table(rows: list[dict[str, Any]], notes: list[str]) -> None:
    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}x"

    def error(value: float | None) -> str:
        return "-" if value is None else f"{value:.2e}"

    width = max([len("codec"), *(len(row["codec"]) for row in rows)])
    header = (
        f"{'codec':{width}}  {'all-reduce (s)':>15}  {'/none':>6}  {'whole round (s)':>15}  "
        f"{'/none':>6}  {'MB sent/peer':>12}  {'/none':>6}  {'rel. RMS err':>12}  "
        f"{'max |err|':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        mb = row["bytes_sent_per_peer"]
        print(
            f"{row['codec']:{width}}  "
            f"{_cell(row['allreduce_s'], row['allreduce_s_min']):>15}  "
            f"{ratio(row['allreduce_s_ratio']):>6}  "
            f"{_cell(row['round_s'], row['round_s_min']):>15}  {ratio(row['round_s_ratio']):>6}  "
            f"{'-' if mb is None else f'{mb / 1e6:.1f}':>12}  "
            f"{ratio(row['bytes_sent_per_peer_ratio']):>6}  "
            f"{error(row['rel_rms']):>12}  {error(row['max_abs']):>9}"
        )
    print(
        "  cells: median [min] over timed rounds; /none: this codec over NoCompression (lower is "
        "better); errors: the worst over peers and timed rounds"
    )
    for note in notes:
        print(f"  {note}")


def _codec_notes(args: argparse.Namespace, codecs: dict[str, dict[str, Any]]) -> list[str]:
    kind = "encrypted" if args.codec_encrypted else "plain"
    notes = [
        f"codecs: N={args.codec_peers}, S={args.codec_size} float32 "
        f"({args.codec_size * 4 / MiB:.0f} MiB) per peer, {kind} TCP"
        f"{' (the default)' if args.codec_encrypted else ''}, {args.codec_rounds} timed rounds "
        f"after {args.warmup} warm-up, averaging_alpha=1, equal weights; every peer starts each "
        "round from torch.randn values seeded by (round, peer), the same for every codec",
        "codecs: all-reduce = max over peers of StepResult.allreduce_seconds (group known to the "
        "average written back); whole round = last step() return - first step() call; MB sent = "
        "the most StepResult.bytes_sent of a peer (10**6 bytes); rel. RMS err = RMS(result - "
        "exact mean) / RMS(exact mean), the mean of standard normals being ~N(0, 1/N)",
    ]
    loads = {c: _median(got.get("foreign_per_s")) for c, got in codecs.items()}
    measured = {c: load for c, load in loads.items() if load is not None}
    if measured:
        notes.append(
            f"codecs: load from other processes during the rounds (CPUs busy outside this "
            f"benchmark, of {os.cpu_count()}): "
            + ", ".join(f"{c} {load:.2f}" for c, load in measured.items())
        )
        if max(measured.values()) > FOREIGN_WARN:
            notes.append(
                f"WARNING: more than {FOREIGN_WARN} CPU of load from elsewhere: the timings are "
                "inflated and the ratios skewed by whichever codec it hit; run again on a quiet "
                "machine"
            )
    for codec, got in codecs.items():
        if "error" in got:
            notes.append(f"codec {codec}: {got['error']}")
        elif got["rounds_ok"] < got["rounds"]:
            failed = [r["errors"][:2] for r in got["per_round"][args.warmup :] if not r["ok"]]
            notes.append(f"codec {codec}: {got['rounds_ok']}/{got['rounds']} rounds ok {failed}")
    return notes


# -- the table ------------------------------------------------------------------------------------


def _median(figure: Any) -> float | None:
    if isinstance(figure, dict) and figure.get("n"):
        return float(figure["median"])
    if isinstance(figure, int | float):
        return float(figure)
    return None


def _row(
    name: str,
    ours: Any,
    ref_name: str,
    ref: Any,
    target: float | None,
    target_text: str = "",
) -> dict[str, Any]:
    """A table row: medians (and mins) of ours and the reference, ours/ref, the target."""
    row: dict[str, Any] = {"name": name, "unit": "s", "reference": ref_name}
    row["ours"] = _median(ours)
    row["ours_min"] = ours.get("min") if isinstance(ours, dict) else None
    row["ref"] = _median(ref)
    row["ref_min"] = ref.get("min") if isinstance(ref, dict) else None
    if row["ours"] is not None and row["ref"]:
        row["ratio"] = row["ours"] / row["ref"]
    if target is not None:
        row["target"] = target_text or f"<= {target:.2f}"
        if "ratio" in row:
            row["ok"] = row["ratio"] <= target
    return row


def _rows(
    args: argparse.Namespace,
    ours: dict[str, dict[str, Any]],
    gloo: dict[int, dict[str, Any]],
    hivemind: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    kinds = [k for k, on in (("plain", args.plain), ("encrypted", args.encrypted)) if on]
    settings = [(kind, n) for kind in kinds for n in args.peers]
    hm_ok = hivemind is not None and "error" not in hivemind
    rows: list[dict[str, Any]] = []
    for kind, n in settings:  # 1. all-reduce with the group formed
        target = TARGET_ALLREDUCE_ENCRYPTED if kind == "encrypted" else TARGET_ALLREDUCE_PLAIN
        rows.append(
            _row(
                f"all-reduce, group formed, N={n} {kind}",
                ours.get(f"{kind}-{n}", {}).get("allreduce_s"),
                "gloo",
                gloo.get(n, {}).get("allreduce_s"),
                target,
            )
        )
    for metric, label, target, text in (  # 2. and 3.
        ("round_s", "whole round", TARGET_ROUND, "<= 0.20 (5x faster)"),
        ("formation_s", "group formation", TARGET_FORMATION, "<= 0.25 (4x faster)"),
    ):
        for kind, n in settings:
            with_hm = hm_ok and kind == "encrypted" and n == args.hivemind_peers
            rows.append(
                _row(
                    f"{label}, N={n} {kind}",
                    ours.get(f"{kind}-{n}", {}).get(metric),
                    "hivemind" if with_hm else "",
                    hivemind.get(metric) if with_hm and hivemind is not None else None,
                    target if kind == "encrypted" and n == args.hivemind_peers else None,
                    text,
                )
            )
    if args.baseline:  # 1b. the same against the baseline checkout
        for kind, n in settings:
            base = ours.get(f"baseline-{kind}-{n}", {})
            mine = ours.get(f"{kind}-{n}", {})
            for label, metric, unit in (
                (f"all-reduce, group formed, N={n} {kind}", "allreduce_s", "s"),
                (f"CPU s per round, processes, N={n} {kind}", "process_cpu_s", "CPU s"),
            ):
                row = _row(label, mine.get(metric), "baseline", base.get(metric), None)
                row["unit"] = unit
                rows.append(row)
    for kind, n in settings:  # 4. CPU per round
        mine = ours.get(f"{kind}-{n}", {})
        for label, metric in (
            (f"CPU s per round, processes, N={n} {kind}", "process_cpu_s"),
            (f"  of which in the kernel, N={n} {kind}", "process_sys_s"),
            (f"CPU s per round, machine busy, N={n} {kind}", "machine_cpu_s"),
        ):
            row = _row(label, mine.get(metric), "gloo", gloo.get(n, {}).get(metric), None)
            row["unit"] = "CPU s"
            rows.append(row)
        if hm_ok and hivemind is not None and kind == "encrypted" and n == args.hivemind_peers:
            for metric, what in (("process_cpu_s", "processes"), ("machine_cpu_s", "machine busy")):
                row = _row(
                    f"CPU s per round, {what}, N={n} {kind}",
                    mine.get(metric),
                    "hivemind",
                    hivemind.get(metric),
                    None,
                )
                row["unit"] = "CPU s"
                rows.append(row)
    return rows


def _cell(value: float | None, low: float | None) -> str:
    if value is None:
        return "-"
    if low is None:
        return f"{value:.3f}"
    return f"{value:.3f} [{low:.3f}]"


def _print_table(rows: list[dict[str, Any]], notes: list[str]) -> None:
    width = max((len(f"{r['name']} ({r['unit']})") for r in rows), default=40)
    header = (
        f"{'metric':{width}}  {'swarmavg':>15}  {'reference':>24}  {'ours/ref':>8}  "
        f"{'target':22} {'met':3}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ref = _cell(row["ref"], row["ref_min"])
        ref = f"{row['reference']} {ref}" if row["reference"] and row["ref"] is not None else ref
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        met = "" if "ok" not in row else ("yes" if row["ok"] else "NO")
        print(
            f"{row['name'] + ' (' + row['unit'] + ')':{width}}  "
            f"{_cell(row['ours'], row['ours_min']):>15}  {ref:>24}  {ratio:>8}  "
            f"{row.get('target', ''):22} {met}"
        )
    print("  cells: median [min] over timed rounds; ours/ref: lower is better (MB/s: higher)")
    for note in notes:
        print(f"  {note}")


def _notes(
    args: argparse.Namespace,
    ours: dict[str, dict[str, Any]],
    gloo: dict[int, dict[str, Any]],
    hivemind: dict[str, Any] | None,
) -> list[str]:
    notes = []
    foreign: list[tuple[str, float | None]] = []
    for key, got in ours.items():
        if "error" in got:
            notes.append(f"swarmavg {key}: {got['error']}")
            continue
        notes.append(
            f"swarmavg {key}: {got['rounds_ok']}/{got['rounds']} rounds ok, max |tensor - mean| "
            f"{got['max_abs_error']:.2e}, start skew median "
            f"{1e3 * (_median(got['start_skew_s']) or 0):.1f} ms, all-reduce wall (first group "
            f"known to last done) median {_median(got['allreduce_wall_s']) or 0:.3f} s"
        )
        foreign.append((f"swarmavg {key}", _median(got.get("foreign_per_s"))))
        if got.get("run_medians"):
            notes.append(
                f"  {key}: {got['runs']} runs, each one's median all-reduce / CPU: "
                + ", ".join(
                    f"{m['allreduce_s'] or 0:.3f} s / {m['process_cpu_s'] or 0:.2f} CPU s"
                    for m in got["run_medians"]
                )
                + (f"; failed runs: {got['run_errors']}" if got.get("run_errors") else "")
            )
        for failure in got["failures"][:2]:
            notes.append(f"  failed round {failure['round']}: {failure['errors'][:2]}")
    for n, got in gloo.items():
        if "error" in got:
            notes.append(f"gloo N={n}: {got['error']}")
        else:
            runs = got.get("run_medians")
            notes.append(
                f"gloo N={n}: {got['iters']} timed all_reduce, init {got['init_s']:.2f} s, "
                f"values finite: {got['finite']}"
                + (
                    ""
                    if runs is None
                    else f"; runs before, after ours: medians {runs[0]:.3f}, {runs[1]:.3f} s "
                    "(the lower is used)"
                )
            )
            foreign.append((f"gloo N={n}", got.get("foreign_per_s")))
    if hivemind is None:
        notes.append("hivemind: skipped (--no-hivemind)")
    elif "error" in hivemind:
        notes.append(f"hivemind: {hivemind['error']}")
    else:
        notes.append(
            f"hivemind {hivemind['version']} N={hivemind['peers']}: {hivemind['rounds_ok']}/"
            f"{hivemind['rounds']} rounds ok, max |tensor - mean| "
            f"{hivemind['max_abs_error']:.2e}, its all-reduce (RUNNING_ALLREDUCE to done) "
            f"median {_median(hivemind['allreduce_s']) or 0:.3f} s"
        )
        for failure in hivemind.get("failures", [])[:2]:
            notes.append(f"  hivemind failed round: {failure.get('errors', [])[:2]}")
        foreign.append(("hivemind", _median(hivemind.get("foreign_per_s"))))
    measured = [(name, load) for name, load in foreign if load is not None]
    if measured:
        notes.append(
            "load from other processes during the timed part (CPUs busy outside this "
            "benchmark, of "
            f"{os.cpu_count()}): " + ", ".join(f"{name} {load:.2f}" for name, load in measured)
        )
        if max(load for _, load in measured) > FOREIGN_WARN:
            notes.append(
                f"WARNING: more than {FOREIGN_WARN} CPU of load from elsewhere: the timings "
                "are inflated and the comparisons skewed by whichever run it hit; run again "
                "on a quiet machine"
            )
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    notes.append(
        f"S={args.size} float32 ({args.size * 4 / MiB:.0f} MiB) per peer, {args.rounds} timed "
        f"rounds after {args.warmup} warm-up, {os.cpu_count()} CPUs, load at the end {load}"
    )
    return notes


def _parse_peers(text: str) -> list[int]:
    peers = [int(x) for x in text.split(",") if x.strip()]
    if not peers or min(peers) < 2:
        raise argparse.ArgumentTypeError("peers: a comma-separated list of counts >= 2")
    return peers


def _parse_codecs(text: str) -> list[str]:
    codecs = [x.strip() for x in text.split(",") if x.strip()]
    if not codecs or not set(codecs) <= set(CODEC_CLASSES):
        raise argparse.ArgumentTypeError(f"codecs: a comma-separated list of {CODEC_CLASSES}")
    return codecs


def _parse_choices(text: str, choices: tuple[str, ...]) -> list[str]:
    got = [x.strip() for x in text.split(",") if x.strip()]
    if not got or not set(got) <= set(choices):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(choices)}")
    return got


def _parse_peers_any(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of counts >= 1")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S=1 Mi, 2 rounds, 3 gloo iters")
    parser.add_argument(
        "--out",
        "--json",  # the other benchmarks' name (nox -s bench passes the same arguments to all)
        dest="out",
        type=Path,
        help="write JSON lines (rows and raw figures) here",
    )
    parser.add_argument("--peers", type=_parse_peers, default=[4, 8], help="e.g. 4,8")
    parser.add_argument("--size", type=int, help="float32 elements per peer (default 16 Mi)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5, --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--baseline",
        metavar="TREE",
        help="another checkout (e.g. `git worktree add /tmp/base <commit>`) run beside ours",
    )
    parser.add_argument(
        "--repeats", type=int, help="runs of each setting (default 1, with --baseline 2)"
    )
    parser.add_argument("--gloo-iters", type=int, help="timed gloo calls (default 10)")
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--encrypted", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--gloo", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hivemind", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hivemind-python", default=str(HIVEMIND_PYTHON))
    parser.add_argument("--hivemind-peers", type=int, help="default: the largest of --peers")
    parser.add_argument("--step-timeout", type=float, default=30.0, help="matchmaking, s")
    parser.add_argument("--allreduce-timeout", type=float, default=120.0)
    parser.add_argument("--averaging-expiration", type=float, default=15.0)
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--part-size-bytes", type=int, help="default: automatic")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before the rounds")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between rounds")
    parser.add_argument(
        "--main",
        action=argparse.BooleanOptionalAction,
        help="the main table (gloo, ours, hivemind); default: on unless --faults, --state or "
        "--codecs is given",
    )
    fault = parser.add_argument_group(
        "issue 22: survivors' steps when a peer leaves or dies (off unless asked for)"
    )
    fault.add_argument("--faults", action="store_true", help="the fault scenarios")
    fault.add_argument(
        "--fault-quick",
        action="store_true",
        help="N=4, TCP, stages looking and allreduce, 1 warm-up + 3 rounds before",
    )
    fault.add_argument("--fault-peers", type=_parse_peers, help="e.g. 4,8 (the default)")
    fault.add_argument(
        "--fault-transports",
        type=functools.partial(_parse_choices, choices=("tcp", "quic")),
        help="tcp,quic (the default)",
    )
    fault.add_argument(
        "--fault-hivemind-transports",
        type=functools.partial(_parse_choices, choices=("tcp", "quic")),
        default=["tcp"],
        help="those of --fault-transports that hivemind runs too (default tcp)",
    )
    fault.add_argument(
        "--fault-kinds",
        type=functools.partial(_parse_choices, choices=FAULT_KINDS),
        default=list(FAULT_KINDS),
        help="leave (SIGINT: Ctrl+C), die (SIGKILL)",
    )
    fault.add_argument(
        "--fault-stages",
        type=functools.partial(_parse_choices, choices=FAULT_STAGES),
        help=f"some of {','.join(FAULT_STAGES)} (the default)",
    )
    fault.add_argument("--fault-size", type=int, default=4 * MiB, help="float32 elements")
    fault.add_argument("--fault-step-timeout", type=float, default=15.0, help="step(timeout=)")
    fault.add_argument("--fault-compute", type=float, default=0.1, help="s between steps")
    fault.add_argument("--fault-warmup", type=int, help="rounds not counted (default 2)")
    fault.add_argument("--fault-before", type=int, help="rounds before the fault (default 5)")
    fault.add_argument(
        "--fault-check-rounds",
        type=int,
        default=6,
        help="rounds after the fault in which to look for a complete one",
    )
    fault.add_argument("--fault-settle", type=float, default=1.0, help="s before the loops")
    fault.add_argument(
        "--fault-scenario-timeout", type=float, default=240.0, help="s: longer is a hang"
    )
    fault.add_argument("--fault-logs", type=Path, help="the peers' logs (default: a new dir)")
    issue7 = parser.add_argument_group("issue 7 (off unless asked for)")
    issue7.add_argument("--state", action="store_true", help="state download MB/s")
    issue7.add_argument("--state-mb", type=int, default=256, help="MiB of state")
    issue7.add_argument("--state-donors", type=_parse_peers_any, default=[1, 2, 4])
    issue7.add_argument("--state-repeats", type=int, default=3, help="the first and later loads")
    issue7.add_argument("--state-timeout", type=float, default=120.0)
    issue7.add_argument("--codecs", action="store_true", help="round time and error per codec")
    issue7.add_argument("--codec-peers", type=int, default=4)
    issue7.add_argument("--codec-size", type=int, help="float32 elements (16 Mi, --quick 1 Mi)")
    issue7.add_argument("--codec-rounds", type=int, help="timed rounds (default 3, --quick 2)")
    issue7.add_argument("--codec-encrypted", action=argparse.BooleanOptionalAction, default=True)
    issue7.add_argument(
        "--codec-list",
        type=_parse_codecs,
        default=list(CODEC_CLASSES),
        help="comma-separated class names (default: all six, NoCompression first)",
    )
    args = parser.parse_args(argv)
    if args.main is None:
        args.main = not (args.faults or args.state or args.codecs)
    if not args.main:
        args.gloo = args.plain = args.encrypted = False
    quick = args.fault_quick
    if args.fault_peers is None:
        args.fault_peers = [4] if quick else [4, 8]
    if args.fault_transports is None:
        args.fault_transports = ["tcp"] if quick else ["tcp", "quic"]
    if args.fault_stages is None:
        args.fault_stages = ["looking", "allreduce"] if quick else list(FAULT_STAGES)
    if args.fault_warmup is None:
        args.fault_warmup = 1 if quick else 2
    if args.fault_before is None:
        args.fault_before = 3 if quick else 5
    if args.fault_logs is None:
        args.fault_logs = Path(f"/tmp/swarmavg-faults-{time.strftime('%Y%m%d-%H%M%S')}")
    if (
        args.fault_size < 1
        or args.fault_warmup < 0
        or args.fault_before < 1
        or args.fault_check_rounds < 3
        or not args.fault_step_timeout > 5
    ):
        parser.error(
            "--fault-size and --fault-before must be >= 1, --fault-warmup >= 0, "
            "--fault-check-rounds >= 3, --fault-step-timeout > 5 (hivemind's step needs its "
            "min_matchmaking_time, 5 s, within it)"
        )
    if args.codec_size is None:
        args.codec_size = MiB if args.quick else 16 * MiB
    if args.codec_rounds is None:
        args.codec_rounds = 2 if args.quick else 3
    if args.codec_peers < 2 or args.codec_size < 1 or args.codec_rounds < 1:
        parser.error("--codec-peers must be >= 2, --codec-size and --codec-rounds >= 1")
    if args.repeats is None:
        args.repeats = 2 if args.baseline else 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.baseline is not None and not (Path(args.baseline) / "swarmavg").is_dir():
        parser.error(f"--baseline {args.baseline}: no swarmavg package there")
    if args.size is None:
        args.size = MiB if args.quick else 16 * MiB
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.gloo_iters is None:
        args.gloo_iters = 3 if args.quick else 10
    if args.hivemind_peers is None:
        args.hivemind_peers = max(args.peers)
    if args.size < 1 or args.rounds < 1 or args.warmup < 0 or args.gloo_iters < 1:
        parser.error("--size and --rounds and --gloo-iters must be >= 1, --warmup >= 0")
    if args.warmup + args.gloo_iters > 30:  # gloo sums ones in place: N**30 stays finite
        parser.error("--warmup + --gloo-iters must be <= 30")

    def on_term(signum: int, frame: object) -> None:  # let `finally` shut the processes down
        raise SystemExit(f"signal {signum}")

    previous_term = signal.signal(signal.SIGTERM, on_term)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def _main(args: argparse.Namespace) -> int:
    started = time.time()
    try:
        gloo = _run_gloo_all(args) if args.gloo else {}
        ours = _run_ours_all(args) if args.plain or args.encrypted else {}
        if args.gloo and ours:  # again after ours: one slow spell no longer decides the ratio
            gloo = _best_gloo(gloo, _run_gloo_all(args))
        faults = state = None
        if args.faults:
            faults = run_faults(args)  # a failed scenario says so in its entry
        if args.state:
            _progress(f"running state download {args.state_mb} MiB ...")
            try:
                state = _run_state(args)
            except Exception as exc:
                state = {"error": _error(exc)}
        codecs = None
        if args.codecs:
            _progress(f"running codecs N={args.codec_peers} S={args.codec_size} ...")
            codecs = _run_codecs(args)  # a failed codec says so in its entry
        hivemind = None
        if args.main and args.hivemind:
            _progress(f"running hivemind N={args.hivemind_peers} ({args.hivemind_python}) ...")
            try:
                hivemind = _run_hivemind(args)
            except Exception as exc:
                hivemind = {"error": _error(exc)}
    except KeyboardInterrupt:  # every process was shut down on the way out
        _progress("interrupted")
        return 130
    rows = _rows(args, ours, gloo, hivemind) + _issue7_rows(args, state)
    notes = _notes(args, ours, gloo, hivemind) if args.main else []
    notes += _issue7_notes(state)
    notes.append(f"the whole run took {time.time() - started:.0f} s")
    if rows:
        _print_table(rows, notes)
    if faults is not None:
        print()
        print_fault_table(fault_rows(faults), args)
    if not rows:
        print(f"  {notes[-1]}")
    if codecs is not None:
        print()
        _print_codec_table(_codec_rows(codecs), _codec_notes(args, codecs))
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
        lines += [{"kind": "raw", "run": f"gloo-{n}", **got} for n, got in gloo.items()]
        lines += [{"kind": "raw", "run": f"swarmavg-{k}", **got} for k, got in ours.items()]
        if hivemind is not None:
            lines.append({"kind": "raw", "run": "hivemind", **hivemind})
        if faults is not None:
            lines += [{"kind": "fault_row", **row} for row in fault_rows(faults)]
            lines += [{"kind": "raw", "run": "fault", **got} for got in faults]
        if state is not None:
            lines.append({"kind": "raw", "run": "state", **state})
        if codecs is not None:
            lines += [{"kind": "codec_row", **row} for row in _codec_rows(codecs)]
            lines += [{"kind": "raw", "run": f"codec-{c}", **got} for c, got in codecs.items()]
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
