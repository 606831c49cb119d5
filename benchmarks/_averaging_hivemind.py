"""The hivemind side of ``benchmarks/averaging.py``: rounds of hivemind 1.1.12's
``DecentralizedAverager`` on loopback.

Runs under a Python that has hivemind (not the project's venv); ``benchmarks/averaging.py``
starts it as ``/tmp/hm-venv/bin/python benchmarks/_averaging_hivemind.py --peers 8 ...`` in a
session of its own and reads the one JSON object it prints as the last line of stdout (hivemind
logs to stderr).

Method (everything in one warm interpreter; torch and hivemind imported before timing):

1. ``--peers`` hivemind DHTs on 127.0.0.1 (``host_maddrs=/ip4/127.0.0.1/tcp/0``), the first one
   the bootstrap, the others joining it one after the other. Each hivemind ``DHT`` is a process
   with its own p2pd daemon (libp2p, connections encrypted: that is hivemind's only mode).
2. One ``DecentralizedAverager`` per DHT (each a process of its own, hivemind's architecture)
   over one float32 tensor of ``--size`` elements, all equal to the peer's index, with
   ``target_group_size = min_group_size = --peers`` and hivemind's defaults otherwise
   (``min_matchmaking_time=5``, ``request_timeout=3``, no compression), ``allreduce_timeout`` =
   ``--allreduce-timeout``. Then ``--settle`` seconds of sleep.
3. ``--warmup`` untimed and ``--rounds`` timed rounds, ``--gap`` seconds apart. In a round, one
   thread per peer waits on a ``threading.Barrier`` and calls ``step(wait=False,
   timeout=--step-timeout)``; this thread then polls every returned ``StepControl`` every 2 ms
   (``.stage``, ``.done()``) until all are done (bounded by step + all-reduce timeouts + 10 s;
   late ones are cancelled). Per peer i: ``start_i`` (its step call), ``group_i`` (first poll
   that sees ``RUNNING_ALLREDUCE`` or later), ``end_i`` (first poll that sees it done).
   Per round: whole round = max(end) - min(start); formation = max_i(group_i - start_i);
   all-reduce = max_i(end_i - group_i); CPU = machine-wide busy seconds (/proc/stat) and CPU
   seconds of this process's descendants (averager and DHT processes, p2pd daemons; not this
   one, which only polls) over the round. A round counts when every peer's step returned a
   result.
4. The largest ``|tensor - mean|`` over the peers after the rounds.

Every averager and DHT is shut down in ``finally``; SIGTERM, and the driver going away (our
parent pid changes), become SystemExit so that this happens too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import threading
import time
import uuid
from typing import Any

import hivemind
import torch
from _averaging_common import machine_busy_seconds, stats, tree_cpu_seconds
from hivemind import DHT, DecentralizedAverager
from hivemind.averaging.control import AveragingStage

HOST_MADDRS = ["/ip4/127.0.0.1/tcp/0"]
POLL = 0.002


def _start_dhts(n: int, timeout: float) -> tuple[list[DHT], list[float]]:
    dhts: list[DHT] = []
    times: list[float] = []
    try:
        for i in range(n):
            initial = dhts[0].get_visible_maddrs() if i else None
            begin = time.perf_counter()
            dht = DHT(initial_peers=initial, host_maddrs=HOST_MADDRS, start=True, await_ready=False)
            dhts.append(dht)
            dht.wait_until_ready(timeout)
            times.append(time.perf_counter() - begin)
    except BaseException:
        for dht in dhts:
            dht.shutdown()
        raise
    return dhts, times


def _round(averagers: list[Any], step_timeout: float, allreduce_timeout: float) -> dict[str, Any]:
    n = len(averagers)
    starts: list[float] = [0.0] * n
    controls: list[Any] = [None] * n
    launch_errors: list[str] = []
    barrier = threading.Barrier(n, timeout=30)

    def launch(i: int) -> None:
        try:
            barrier.wait()
            starts[i] = time.perf_counter()
            controls[i] = averagers[i].step(wait=False, timeout=step_timeout)
        except Exception as exc:
            launch_errors.append(f"{type(exc).__name__}: {exc}"[:200])

    busy0 = machine_busy_seconds()
    tree0 = tree_cpu_seconds(os.getpid())
    own0 = time.process_time()
    window = time.perf_counter()
    threads = [threading.Thread(target=launch, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    group: list[float | None] = [None] * n
    end: list[float | None] = [None] * n
    deadline = time.perf_counter() + step_timeout + allreduce_timeout + 10
    live = [i for i in range(n) if controls[i] is not None]
    while any(end[i] is None for i in live) and time.perf_counter() < deadline:
        now = time.perf_counter()
        for i in live:
            if end[i] is None:
                control = controls[i]
                done = control.done()
                stage = control.stage
                if group[i] is None and (
                    stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED) or done
                ):
                    group[i] = now
                if done:
                    end[i] = now
        time.sleep(POLL)
    busy1 = machine_busy_seconds()
    tree1 = tree_cpu_seconds(os.getpid())
    own = time.process_time() - own0
    window = time.perf_counter() - window
    errors = list(launch_errors)
    ok = 0
    for i in live:
        control = controls[i]
        if not control.done():
            control.cancel()
            errors.append(f"peer {i}: not done in time, cancelled")
            continue
        try:
            ok += control.result(timeout=10) is not None
        except Exception as exc:
            errors.append(f"peer {i}: {type(exc).__name__}: {exc}"[:200])
    out: dict[str, Any] = {"ok": ok, "errors": errors[:5]}
    if ok == n:
        ends = [e for e in end if e is not None]
        groups = [g for g in group if g is not None]
        machine = None if busy0 is None or busy1 is None else busy1 - busy0
        tree = None if tree0 is None or tree1 is None else tree1 - tree0
        out.update(
            round_s=max(ends) - min(starts),
            formation_s=max(g - s for g, s in zip(groups, starts, strict=True)),
            allreduce_s=max(e - g for e, g in zip(ends, groups, strict=True)),
            start_skew_s=max(starts) - min(starts),
            machine_cpu_s=machine,
            process_cpu_s=tree,
            # CPUs busy with other processes than hivemind's and this one: load from elsewhere
            foreign_per_s=(
                None if machine is None or tree is None else (machine - tree - own) / window
            ),
        )
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.peers
    result: dict[str, Any] = {
        "system": "hivemind",
        "version": hivemind.__version__,
        "python": platform.python_version(),
        "peers": n,
        "size": args.size,
        "rounds": args.rounds,
    }
    dhts, result["dht_start_s"] = _start_dhts(n, args.op_timeout)
    averagers: list[Any] = []
    try:
        prefix = f"avgbench_{uuid.uuid4().hex[:8]}"
        for i, dht in enumerate(dhts):
            averagers.append(
                DecentralizedAverager(
                    [torch.full((args.size,), float(i), dtype=torch.float32)],
                    dht,
                    prefix=prefix,
                    target_group_size=n,
                    min_group_size=n,
                    allreduce_timeout=args.allreduce_timeout,
                    start=True,
                )
            )
        time.sleep(args.settle)
        rounds = []
        for r in range(args.warmup + args.rounds):
            if r:
                time.sleep(args.gap)
            rounds.append(_round(averagers, args.step_timeout, args.allreduce_timeout))
            print(f"hivemind round {r}: {rounds[-1]}", file=sys.stderr, flush=True)
        result["warmup_rounds"] = rounds[: args.warmup]
        timed = rounds[args.warmup :]
        good = [r for r in timed if r["ok"] == n]
        result["rounds_ok"] = len(good)
        result["failures"] = [r for r in timed if r["ok"] != n]
        for key in (
            "round_s",
            "formation_s",
            "allreduce_s",
            "start_skew_s",
            "machine_cpu_s",
            "process_cpu_s",
            "foreign_per_s",
        ):
            result[key] = stats([r[key] for r in good if r.get(key) is not None])
        result["per_round"] = good
        errors = []
        expected = (n - 1) / 2
        for averager in averagers:
            with averager.get_tensors() as tensors:
                errors.append(float((tensors[0] - expected).abs().max()))
        result["max_abs_error"] = max(errors)
    finally:
        for averager in averagers:
            try:
                averager.shutdown()
            except Exception as exc:  # keep shutting the others down
                print(f"averager shutdown failed: {exc!r}", file=sys.stderr)
        for dht in dhts:
            try:
                dht.shutdown()
            except Exception as exc:
                print(f"dht shutdown failed: {exc!r}", file=sys.stderr)
    return result


def _watch_parent(parent: int) -> None:
    """SIGTERM to ourselves when the driver (our parent) is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--size", type=int, default=16 << 20, help="float32 elements per peer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--step-timeout", type=float, default=60.0, help="matchmaking, s")
    parser.add_argument("--allreduce-timeout", type=float, default=120.0)
    parser.add_argument("--op-timeout", type=float, default=60.0, help="a DHT start, s")
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between rounds")
    args = parser.parse_args()

    def on_term(signum: int, frame: object) -> None:  # let `finally` shut everything down
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(1)  # as every process of the benchmark
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    result = measure(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
