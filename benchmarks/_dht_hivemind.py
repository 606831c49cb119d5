"""The hivemind side of ``benchmarks/dht.py``: the same DHT measurements on hivemind 1.1.12.

Runs under a Python that has hivemind (not the project's venv); ``benchmarks/dht.py`` starts it
as ``/tmp/hm-venv/bin/python benchmarks/_dht_hivemind.py --peers 8 ...`` and reads the one JSON
object it prints as the last line of stdout (hivemind logs to stderr).

Method, in this order, all in one warm interpreter (hivemind imported before anything is timed):

1. Swarm: ``--peers`` hivemind DHTs on loopback (``host_maddrs=/ip4/127.0.0.1/tcp/0``), the first
   one the bootstrap, the others started one after the other with ``initial_peers`` = its visible
   multiaddrs. Each hivemind ``DHT`` is a process of its own with its own p2pd daemon; the calls
   below go through hivemind's pipe to that process, which is how a hivemind user calls it.
   Then ``--settle`` seconds of sleep.
2. Rounds: ``--rounds`` times, for ``latest=False`` and then ``latest=True``: a fresh key, stored
   (``store(key, value, now + 300)``) from a random peer a and got from a random peer b != a;
   both calls timed with ``perf_counter``; a get succeeds when it returns the stored value.
3. Failures: ``--kill-fraction`` of the peers (at least one, never the bootstrap) are shut down
   (``dht.shutdown()``), then every key of step 2 is got again, with the same ``latest``, from a
   random survivor (not the peer that stored it, where it survived).
4. Constructor to ready: one warm-up DHT joins (``initial_peers`` = the bootstrap's addresses)
   and is shut down; then ``--ready-repeats`` times ``DHT(..., start=True)`` is timed until it
   returns (hivemind waits for the node to be ready) and the DHT is shut down, untimed. This
   comes last so that the peers it adds and removes do not sit in routing tables during 2 and 3.

Every call has a timeout (``--op-timeout``; a call that times out counts as a failure), and every
DHT is shut down in ``finally`` (SIGTERM is turned into SystemExit so that this happens too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
import uuid
from typing import Any

import hivemind
from hivemind import DHT
from hivemind.utils import get_dht_time

HOST_MADDRS = ["/ip4/127.0.0.1/tcp/0"]
EXPIRATION = 300.0  # seconds a stored value lives


def _ms_stats(samples: list[float]) -> dict[str, Any]:
    """Median, p90, min and max of ``samples`` (seconds), in milliseconds, and the samples
    (so that the runs of several phases can be pooled)."""
    return _stats([s * 1e3 for s in samples])


def _stats(samples: list[float]) -> dict[str, Any]:
    xs = sorted(samples)
    if not xs:
        return {"n": 0, "samples": []}
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "p90": xs[int(0.9 * (len(xs) - 1))],
        "min": xs[0],
        "max": xs[-1],
        "samples": [round(x, 5) for x in samples],
    }


def _start(initial_peers: list[Any] | None, timeout: float) -> DHT:
    """A DHT on loopback, ready (or shut down again if it is not within ``timeout``)."""
    dht = DHT(initial_peers=initial_peers, host_maddrs=HOST_MADDRS, start=True, await_ready=False)
    try:
        dht.wait_until_ready(timeout)
    except BaseException:
        dht.shutdown()
        raise
    return dht


def _timed_join(initial_peers: list[Any], timeout: float) -> float:
    """Seconds from the constructor call until the DHT is ready; shuts it down afterwards."""
    start = time.perf_counter()
    dht = _start(initial_peers, timeout)
    elapsed = time.perf_counter() - start
    dht.shutdown()
    return elapsed


def _store(dht: DHT, key: str, value: str, timeout: float) -> tuple[bool, float | None]:
    """Whether the store was accepted and how long it took (``None`` on an error/timeout)."""
    start = time.perf_counter()
    try:
        future = dht.store(key, value, get_dht_time() + EXPIRATION, return_future=True)
        ok = bool(future.result(timeout=timeout))
    except Exception:
        return False, None
    return ok, time.perf_counter() - start


def _get(dht: DHT, key: str, value: str, latest: bool, timeout: float) -> tuple[bool, float | None]:
    """Whether the get returned ``value`` and how long it took (``None`` on an error/timeout)."""
    start = time.perf_counter()
    try:
        found = dht.get(key, latest=latest, return_future=True).result(timeout=timeout)
    except Exception:
        return False, None
    elapsed = time.perf_counter() - start
    return found is not None and found.value == value, elapsed


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    result: dict[str, Any] = {
        "system": "hivemind",
        "version": hivemind.__version__,
        "peers": args.peers,
        "rounds": args.rounds,
        "python": platform.python_version(),
        "nproc": os.cpu_count(),
    }
    dhts: list[DHT] = []
    try:
        start = time.perf_counter()
        dhts.append(_start(None, args.op_timeout))
        maddrs = dhts[0].get_visible_maddrs()
        for _ in range(args.peers - 1):
            dhts.append(_start(maddrs, args.op_timeout))
        result["swarm_start_s"] = time.perf_counter() - start
        time.sleep(args.settle)

        stored: list[tuple[str, str, int, bool]] = []  # key, value, storer, latest
        store_t: list[float] = []
        store_ok = 0
        for i in range(args.peers * args.warmup_per_peer):  # untimed, as on our side
            key, value = f"warmup-{uuid.uuid4().hex}", uuid.uuid4().hex
            _store(dhts[i % args.peers], key, value, args.op_timeout)
            _get(dhts[i % args.peers], key, value, True, args.op_timeout)
        for latest in (False, True):
            get_t: list[float] = []
            get_ok = 0
            for _ in range(args.rounds):
                key, value = f"bench-{uuid.uuid4().hex}", uuid.uuid4().hex
                a, b = rng.sample(range(args.peers), 2)
                ok, elapsed = _store(dhts[a], key, value, args.op_timeout)
                store_ok += ok
                if elapsed is not None:
                    store_t.append(elapsed)
                stored.append((key, value, a, latest))
                ok, elapsed = _get(dhts[b], key, value, latest, args.op_timeout)
                get_ok += ok
                if elapsed is not None:
                    get_t.append(elapsed)
            tag = "latest" if latest else "first"
            result[f"get_ms_{tag}"] = _ms_stats(get_t)
            result[f"get_ok_{tag}"] = get_ok
            result[f"gets_{tag}"] = args.rounds
        result["store_ms"] = _ms_stats(store_t)
        result["store_ok"] = store_ok
        result["stores"] = 2 * args.rounds

        n_kill = max(1, round(args.kill_fraction * args.peers))
        victims = rng.sample(range(1, args.peers), n_kill)
        for v in victims:
            dhts[v].shutdown()
        result["killed"] = victims
        alive = [i for i in range(args.peers) if i not in victims]
        for latest in (False, True):
            get_t, get_ok, total = [], 0, 0
            for key, value, storer, key_latest in stored:
                if key_latest != latest:
                    continue
                b = rng.choice([i for i in alive if i != storer])
                ok, elapsed = _get(dhts[b], key, value, latest, args.op_timeout)
                total += 1
                get_ok += ok
                if elapsed is not None:
                    get_t.append(elapsed)
            tag = "latest" if latest else "first"
            result[f"killed_get_ms_{tag}"] = _ms_stats(get_t)
            result[f"killed_get_ok_{tag}"] = get_ok
            result[f"killed_gets_{tag}"] = total

        _timed_join(maddrs, args.op_timeout)  # warm-up
        ready = [_timed_join(maddrs, args.op_timeout) for _ in range(args.ready_repeats)]
        result["ready_s"] = _stats(ready)
    finally:
        for dht in dhts:
            try:
                dht.shutdown()
            except Exception as exc:  # keep shutting the others down
                print(f"shutdown failed: {exc!r}", file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=50, help="rounds per latest=False/True")
    parser.add_argument(
        "--warmup-per-peer", type=int, default=3, help="untimed store + get rounds per peer"
    )
    parser.add_argument("--ready-repeats", type=int, default=5)
    parser.add_argument("--kill-fraction", type=float, default=0.1)
    parser.add_argument("--settle", type=float, default=1.0, help="sleep after the swarm is up")
    parser.add_argument("--op-timeout", type=float, default=30.0, help="seconds per call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    def on_term(signum: int, frame: object) -> None:  # let `finally` shut every DHT down
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    result = measure(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
