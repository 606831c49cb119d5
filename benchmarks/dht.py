"""DHT benchmarks: store/get latency, constructor to ready and success under failures, swarmavg
beside hivemind 1.1.12 measured in the same run.

    python benchmarks/dht.py [--quick] [--json results.json] [--no-hivemind] [--no-tcp]
                             [--no-memory] [--rounds R] [--repeats P] [--hivemind-python PATH]

hivemind's side needs a venv with ``hivemind==1.1.12`` (default ``/tmp/hm-venv/bin/python``;
``--hivemind-python`` for another); without one its column says why it is empty.

Settings:

- tcp, N=8: eight peer processes on loopback (``multiprocessing``, "spawn"), each with one
  ``swarmavg.DHT(transport="tcp", host="127.0.0.1", port=0)``: peer 0 is the bootstrap, the others
  get its ``get_visible_maddrs()`` as ``initial_peers`` and start one after the other. This
  process drives them over a ``multiprocessing.Pipe``; every call is timed inside the peer
  process around the synchronous call (what a user of the library sees), so the pipe is not in
  our figures. hivemind's figures come from ``_dht_hivemind.py``, run with hivemind's Python:
  there the timing includes hivemind's own pipe to its DHT process (each hivemind ``DHT`` is a
  process with a p2pd daemon: that is its architecture, and what its users see).
- memory, N=32: one process, one event loop (``anyio.run``), 32 ``swarmavg.aio.DHT`` on one
  ``MemoryNetwork``, started and measured the same way (ours only: hivemind has no in-process
  transport).

Measurements, in this order, after the swarm is up and ``--settle`` seconds of sleep, and
``WARMUP_PER_PEER`` untimed rounds of store + latest get from each peer (both systems):

1. Rounds: R times (``--rounds``, default 50, ``--quick`` 10) for ``latest=False`` and then R
   times for ``latest=True``: a fresh key stored (``now + 300 s``) from a random peer a, then got
   from a random peer b != a. Store and get latency: median and p90. A get succeeds when it
   returns the stored value; success rate = successes / gets.
2. Failures: 10% of the peers (``--kill-fraction``; at N=8 one, at N=32 three; never the
   bootstrap) are killed: SIGKILL of the peer process over TCP, ``await dht.aclose()`` in memory
   (hivemind: ``dht.shutdown()``). Then every key of step 1 is got again, with the same
   ``latest``, from a random survivor other than the peer that stored it: success rate and
   latency.
3. Constructor to ready, in a warm interpreter: a peer that has imported everything makes one
   DHT joining the swarm (``initial_peers`` = the bootstrap's addresses) and shuts it down, then
   times ``--ready-repeats`` constructions until ready (``swarmavg.DHT(..., start=True)``
   returning; ``async with swarmavg.aio.DHT(...)`` entered), each shut down afterwards, untimed.
   Over TCP that peer is a ninth process, spawned with the others and used only now. This comes
   last so that the peers it adds and removes are not in routing tables during 1 and 2.

Over TCP this runs in phases that alternate between the systems: ours, hivemind's, ours, ...
(``--repeats`` each, default 3, ``--quick`` 1), each phase a fresh swarm doing all of the above
with the seed + its number. Each figure pools the samples of a system's phases (median and
p90 over all of them; success counts summed); a note gives each phase's medians. This machine's
speed drifts by up to 1.6x over tens of seconds: with one phase each, a slow spell during one
system's phase alone decided the ratio; alternating phases expose both to the same spells.

Both sides use the same seed and draw peers in the same order, so the pairs and the killed peer
are the same. Every pipe wait, call and subprocess has a timeout; a call that times out or fails
counts as a failed store/get and has no latency sample. Peer processes and hivemind's (with their
p2pd daemons) are killed in ``finally`` if they did not exit.

Targets (issue): at N=8 over TCP, store and get medians >= 5x lower than hivemind's, aim <= 2 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final, Protocol

import anyio

import swarmavg
import swarmavg.aio
from swarmavg.testing import MemoryNetwork

HERE = Path(__file__).resolve().parent
HIVEMIND_PYTHON = Path("/tmp/hm-venv/bin/python")
HOST = "127.0.0.1"
EXPIRATION = 300.0  # seconds a stored value lives
OP_TIMEOUT = 30.0  # one store, get or DHT start
SPAWN_TIMEOUT = 60.0  # a peer process up, swarmavg imported
EXIT_TIMEOUT = 10.0  # a peer process gone after it was told to exit, before it is killed
WORKER_IDLE = 900.0  # a peer process gives up when its driver says nothing for this long
HIVEMIND_TIMEOUT = 600.0  # the whole hivemind run
MEMORY_TIMEOUT = 600.0  # the whole in-process memory run
TARGET_RATIO = 5.0
#: Untimed store + latest get rounds per peer before measuring (both systems), so that the
#: figures are of a warm swarm: connections open, caches and code paths warm.
WARMUP_PER_PEER = 3
AIM_MS = 2.0


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


# -- a peer process (tcp) ----------------------------------------------------------------------


def _make_sync_dht(initial_peers: list[str]) -> Any:
    return swarmavg.DHT(
        initial_peers=initial_peers,
        start=True,
        client_mode=False,
        transport="tcp",
        host=HOST,
        port=0,
    )


class _PeerState:
    """What a peer process holds: at most one DHT, and the operations the driver asks for."""

    def __init__(self) -> None:
        self.dht: Any = None

    def start(self, initial_peers: list[str]) -> tuple[float, list[str]]:
        begin = time.perf_counter()
        self.dht = _make_sync_dht(initial_peers)
        elapsed = time.perf_counter() - begin
        return elapsed, [str(a) for a in self.dht.get_visible_maddrs()]

    def store(self, key: str, value: str) -> tuple[bool, float]:
        expiration = swarmavg.get_dht_time() + EXPIRATION
        begin = time.perf_counter()
        ok = self.dht.store(key, value, expiration)
        return bool(ok), time.perf_counter() - begin

    def get(self, key: str, value: str, latest: bool) -> tuple[bool, float]:
        begin = time.perf_counter()
        found = self.dht.get(key, latest=latest)
        elapsed = time.perf_counter() - begin
        return found is not None and found.value == value, elapsed

    def ready(self, initial_peers: list[str], repeats: int) -> list[float]:
        """Seconds from constructor call to ready, ``repeats`` times, after one warm-up."""
        times = []
        for i in range(repeats + 1):
            begin = time.perf_counter()
            dht = _make_sync_dht(initial_peers)
            elapsed = time.perf_counter() - begin
            dht.shutdown()
            if i > 0:
                times.append(elapsed)
        return times

    def shutdown(self) -> None:
        if self.dht is not None:
            dht, self.dht = self.dht, None
            dht.shutdown()


def _peer_main(conn: Connection) -> None:
    """A peer process: runs ``(seq, op, args)`` requests from ``conn`` on a :class:`_PeerState`
    and answers ``(seq, "ok" | "error", payload)``; ``seq`` 0 is the hello once imports are done.
    Exits on ``"exit"``, when the driver goes away (EOF) or stays silent for ``WORKER_IDLE``."""
    state = _PeerState()
    conn.send((0, "ok", os.getpid()))  # swarmavg is imported (with this module): warm from now
    try:
        while conn.poll(WORKER_IDLE):
            try:
                seq, op, args = conn.recv()
            except EOFError:
                break
            if op == "exit":
                state.shutdown()
                conn.send((seq, "ok", None))
                break
            try:
                conn.send((seq, "ok", getattr(state, op)(*args)))
            except Exception as exc:
                conn.send((seq, "error", f"{type(exc).__name__}: {exc}"))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone
    finally:
        state.shutdown()


class _Peer:
    """The driver's handle on a peer process."""

    def __init__(self, ctx: Any, index: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_peer_main, args=(child,), name=f"dht-peer-{index}", daemon=True
        )
        self.proc.start()
        child.close()
        self._seq = 0

    def _answer(self, seq: int, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise TimeoutError(f"{what}: no answer within {timeout:.0f} s")
            got, status, payload = self.conn.recv()
            if got != seq:
                continue  # the late answer to a call that timed out
            if status == "error":
                raise RuntimeError(payload)
            return payload

    def wait_hello(self, timeout: float = SPAWN_TIMEOUT) -> None:
        self._answer(0, "peer process start", timeout)

    def call(self, op: str, *args: Any, timeout: float = OP_TIMEOUT) -> Any:
        self._seq += 1
        self.conn.send((self._seq, op, args))
        return self._answer(self._seq, op, timeout)

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(EXIT_TIMEOUT)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):  # killed below if it is still there
                self.call("exit", timeout=EXIT_TIMEOUT)
            self.proc.join(EXIT_TIMEOUT)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


# -- the swarms ----------------------------------------------------------------------------------


class _Swarm(Protocol):
    size: int

    async def store(self, i: int, key: str, value: str) -> tuple[bool, float]: ...
    async def get(self, i: int, key: str, value: str, latest: bool) -> tuple[bool, float]: ...
    async def kill(self, i: int) -> None: ...
    async def ready(self, repeats: int) -> list[float]: ...


class _TcpSwarm:
    """N peer processes, one ``swarmavg.DHT`` each, plus one more for the constructor timing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.peers: list[_Peer] = []
        self.maddrs: list[str] = []
        self.start_s: list[float] = []

    def open(self) -> None:
        ctx = mp.get_context("spawn")
        self.peers = [_Peer(ctx, i) for i in range(self.size + 1)]  # the last: ready timing
        for peer in self.peers:
            peer.wait_hello()
        elapsed, self.maddrs = self.peers[0].call("start", [])
        self.start_s.append(elapsed)
        for peer in self.peers[1 : self.size]:
            elapsed, _ = peer.call("start", self.maddrs)
            self.start_s.append(elapsed)

    def close(self) -> None:
        for peer in self.peers:
            try:
                peer.close()
            except Exception as exc:
                print(f"closing {peer.proc.name}: {exc!r}", file=sys.stderr)

    async def _call(self, i: int, op: str, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(self.peers[i].call, op, *args))

    async def store(self, i: int, key: str, value: str) -> tuple[bool, float]:
        ok, elapsed = await self._call(i, "store", key, value)
        return bool(ok), float(elapsed)

    async def get(self, i: int, key: str, value: str, latest: bool) -> tuple[bool, float]:
        ok, elapsed = await self._call(i, "get", key, value, latest)
        return bool(ok), float(elapsed)

    async def kill(self, i: int) -> None:
        await anyio.to_thread.run_sync(self.peers[i].kill)

    async def ready(self, repeats: int) -> list[float]:
        peer = self.peers[self.size]
        timeout = OP_TIMEOUT * (repeats + 1)
        fn = partial(peer.call, "ready", self.maddrs, repeats, timeout=timeout)
        return list(await anyio.to_thread.run_sync(fn))


class _MemorySwarm:
    """N ``swarmavg.aio.DHT`` on one ``MemoryNetwork``, in this process and event loop."""

    def __init__(self, size: int, stack: AsyncExitStack) -> None:
        self.size = size
        self.network = MemoryNetwork()
        self.stack = stack
        self.dhts: list[Any] = []
        self.maddrs: list[str] = []
        self.start_s: list[float] = []

    def _new(self, initial_peers: list[str]) -> Any:
        return swarmavg.aio.DHT(
            initial_peers=initial_peers,
            transport="memory",
            transport_options={"network": self.network},
        )

    async def open(self) -> None:
        for i in range(self.size):
            begin = time.perf_counter()
            # no fail_after here: its scope would end before the DHT's (which stays open);
            # _memory bounds the whole run instead
            dht = await self.stack.enter_async_context(self._new(self.maddrs))
            self.start_s.append(time.perf_counter() - begin)
            self.dhts.append(dht)
            if i == 0:
                self.maddrs = [str(a) for a in dht.get_visible_maddrs()]

    async def store(self, i: int, key: str, value: str) -> tuple[bool, float]:
        expiration = swarmavg.get_dht_time() + EXPIRATION
        with anyio.fail_after(OP_TIMEOUT):
            begin = time.perf_counter()
            ok = await self.dhts[i].store(key, value, expiration)
            return bool(ok), time.perf_counter() - begin

    async def get(self, i: int, key: str, value: str, latest: bool) -> tuple[bool, float]:
        with anyio.fail_after(OP_TIMEOUT):
            begin = time.perf_counter()
            found = await self.dhts[i].get(key, latest=latest)
            elapsed = time.perf_counter() - begin
        return found is not None and found.value == value, elapsed

    async def kill(self, i: int) -> None:
        with anyio.fail_after(OP_TIMEOUT):
            await self.dhts[i].aclose()

    async def ready(self, repeats: int) -> list[float]:
        times = []
        for i in range(repeats + 1):  # the first is the warm-up
            with anyio.fail_after(OP_TIMEOUT):
                begin = time.perf_counter()
                async with self._new(self.maddrs):
                    elapsed = time.perf_counter() - begin
            if i > 0:
                times.append(elapsed)
        return times


# -- the measurement, the same for both swarms (and mirrored by _dht_hivemind.py) -----------------


async def _attempt(
    call: Callable[[], Awaitable[tuple[bool, float]]], errors: list[str]
) -> tuple[bool, float | None]:
    """``call()``'s success and seconds; ``(False, None)`` if it raised (noted in ``errors``)."""
    try:
        ok, elapsed = await call()
    except Exception as exc:
        if len(errors) < 5:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        return False, None
    return ok, elapsed


async def _measure(
    swarm: _Swarm, rounds: int, kill_fraction: float, ready_repeats: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    n = swarm.size
    result: dict[str, Any] = {"peers": n, "rounds": rounds}
    errors: list[str] = []
    stored: list[tuple[str, str, int, bool]] = []  # key, value, storer, latest
    store_t: list[float] = []
    store_ok = 0
    for i in range(n * WARMUP_PER_PEER):  # untimed: every peer opens its connections
        key, value = f"warmup-{uuid.uuid4().hex}", uuid.uuid4().hex
        await _attempt(partial(swarm.store, i % n, key, value), errors)
        await _attempt(partial(swarm.get, i % n, key, value, True), errors)
    for latest in (False, True):
        get_t: list[float] = []
        get_ok = 0
        for _ in range(rounds):
            key, value = f"bench-{uuid.uuid4().hex}", uuid.uuid4().hex
            a, b = rng.sample(range(n), 2)
            ok, elapsed = await _attempt(partial(swarm.store, a, key, value), errors)
            store_ok += ok
            if elapsed is not None:
                store_t.append(elapsed)
            stored.append((key, value, a, latest))
            ok, elapsed = await _attempt(partial(swarm.get, b, key, value, latest), errors)
            get_ok += ok
            if elapsed is not None:
                get_t.append(elapsed)
        tag = "latest" if latest else "first"
        result[f"get_ms_{tag}"] = _ms_stats(get_t)
        result[f"get_ok_{tag}"] = get_ok
        result[f"gets_{tag}"] = rounds
    result["store_ms"] = _ms_stats(store_t)
    result["store_ok"] = store_ok
    result["stores"] = 2 * rounds

    victims = rng.sample(range(1, n), max(1, round(kill_fraction * n)))
    for v in victims:
        await swarm.kill(v)
    result["killed"] = victims
    alive = [i for i in range(n) if i not in victims]
    for latest in (False, True):
        get_t, get_ok, total = [], 0, 0
        for key, value, storer, key_latest in stored:
            if key_latest != latest:
                continue
            b = rng.choice([i for i in alive if i != storer])
            ok, elapsed = await _attempt(partial(swarm.get, b, key, value, latest), errors)
            total += 1
            get_ok += ok
            if elapsed is not None:
                get_t.append(elapsed)
        tag = "latest" if latest else "first"
        result[f"killed_get_ms_{tag}"] = _ms_stats(get_t)
        result[f"killed_get_ok_{tag}"] = get_ok
        result[f"killed_gets_{tag}"] = total

    ready = await swarm.ready(ready_repeats)
    result["ready_s"] = _stats(ready)
    result["errors"] = errors
    return result


def _run_tcp(args: argparse.Namespace) -> dict[str, Any]:
    swarm = _TcpSwarm(args.tcp_peers)
    try:
        swarm.open()
        time.sleep(args.settle)
        result = anyio.run(
            _measure, swarm, args.rounds, args.kill_fraction, args.ready_repeats, args.seed
        )
        result["start_s"] = swarm.start_s
        return result
    finally:
        swarm.close()


async def _memory(args: argparse.Namespace) -> dict[str, Any]:
    with anyio.fail_after(MEMORY_TIMEOUT):
        async with AsyncExitStack() as stack:
            swarm = _MemorySwarm(args.memory_peers, stack)
            await swarm.open()
            await anyio.sleep(args.settle)
            result = await _measure(
                swarm, args.rounds, args.kill_fraction, args.ready_repeats, args.seed
            )
            result["start_s"] = swarm.start_s
            return result


def _run_memory(args: argparse.Namespace) -> dict[str, Any]:
    return anyio.run(_memory, args)


def _run_hivemind(args: argparse.Namespace) -> dict[str, Any]:
    """``_dht_hivemind.py`` under hivemind's Python: its JSON, or ``{"error": ...}``."""
    python = Path(args.hivemind_python)
    if not python.exists():
        return {"error": f"skipped: {python} not found (a venv with hivemind==1.1.12)"}
    command = [
        str(python),
        str(HERE / "_dht_hivemind.py"),
        f"--peers={args.tcp_peers}",
        f"--rounds={args.rounds}",
        f"--warmup-per-peer={WARMUP_PER_PEER}",
        f"--ready-repeats={args.ready_repeats}",
        f"--kill-fraction={args.kill_fraction}",
        f"--settle={args.settle}",
        f"--seed={args.seed}",
    ]
    # A session of its own, so that its DHT processes and their p2pd daemons can be killed as a
    # group if it does not shut them down itself.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=HIVEMIND_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # it shuts its DHTs down on SIGTERM
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return {"error": f"timed out after {HIVEMIND_TIMEOUT:.0f} s; stderr: {err[-500:]}"}
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group
        proc.wait(timeout=10)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}; stderr: {err[-800:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's phases as one: the samples of every figure pooled (their median and p90
    recomputed), the counts summed, the killed peers and the errors listed; phases that
    failed as a whole are left out (their error is in the notes)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    pooled = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, dict) and "samples" in value:
            pooled[key] = _stats([x for r in ok for x in r.get(key, {}).get("samples", [])])
        elif isinstance(value, int) and not isinstance(value, bool) and key not in _NOT_SUMMED:
            pooled[key] = sum(r.get(key, 0) for r in ok)
    pooled["killed"] = [r.get("killed") for r in ok]
    pooled["errors"] = [e for r in ok for e in r.get("errors", [])]
    pooled["phases"] = len(ok)
    return pooled


#: Integer figures that describe a phase rather than count its calls.
_NOT_SUMMED: Final = frozenset({"peers", "rounds"})


def _phase_medians(by_key: dict[str, list[dict[str, Any]]]) -> str:
    """A note with each phase's medians, so that drift between phases shows."""
    parts = []
    for name, key in (
        ("store", "store_ms"),
        ("get", "get_ms_first"),
        ("get latest", "get_ms_latest"),
    ):
        sides = []
        for system in ("swarmavg_tcp", "hivemind_tcp"):
            medians = [r.get(key, {}).get("median") for r in by_key.get(system, [])]
            sides.append(" ".join("-" if m is None else f"{m:.2f}" for m in medians) or "-")
        parts.append(f"{name} {sides[0]} | {sides[1]}")
    return "medians per phase (ms), swarmavg | hivemind: " + "; ".join(parts)


# -- the table ----------------------------------------------------------------------------------


def _latency_rows(
    setting: str, ours: dict[str, Any], ref: dict[str, Any] | None, target: bool
) -> list[dict[str, Any]]:
    rows = []
    for name, key, has_target in (
        ("store latency", "store_ms", target),
        ("get latency, latest=False", "get_ms_first", target),
        ("get latency, latest=True", "get_ms_latest", target),
        ("get latency, latest=False, 10% killed", "killed_get_ms_first", False),
        ("get latency, latest=True, 10% killed", "killed_get_ms_latest", False),
    ):
        mine = ours.get(key, {})
        theirs = (ref or {}).get(key, {})
        row: dict[str, Any] = {
            "name": f"{setting}: {name}",
            "unit": "ms",
            "ours": mine.get("median"),
            "ours_p90": mine.get("p90"),
            "hivemind": theirs.get("median"),
            "hivemind_p90": theirs.get("p90"),
        }
        if row["ours"] and row["hivemind"]:
            row["ratio"] = row["hivemind"] / row["ours"]
        if has_target and row["ours"] is not None:
            row["target"] = f">= {TARGET_RATIO:.0f}x lower (aim <= {AIM_MS:.0f} ms)"
            row["aim_met"] = row["ours"] <= AIM_MS
            if "ratio" in row:
                row["ok"] = row["ratio"] >= TARGET_RATIO
        rows.append(row)
    return rows


def _success_rows(
    setting: str, ours: dict[str, Any], ref: dict[str, Any] | None
) -> list[dict[str, Any]]:
    rows = []
    for name, ok_key, total_key in (
        ("store accepted", "store_ok", "stores"),
        ("get success, latest=False", "get_ok_first", "gets_first"),
        ("get success, latest=True", "get_ok_latest", "gets_latest"),
        ("get success, latest=False, 10% killed", "killed_get_ok_first", "killed_gets_first"),
        ("get success, latest=True, 10% killed", "killed_get_ok_latest", "killed_gets_latest"),
    ):
        row: dict[str, Any] = {"name": f"{setting}: {name}", "unit": "%"}
        for side, data in (("ours", ours), ("hivemind", ref or {})):
            if ok_key in data and data.get(total_key):
                row[side] = 100.0 * data[ok_key] / data[total_key]
                row[f"{side}_count"] = f"{data[ok_key]}/{data[total_key]}"
        rows.append(row)
    return rows


def _rows(setting: str, ours: dict[str, Any], ref: dict[str, Any] | None) -> list[dict[str, Any]]:
    ready_ref = (ref or {}).get("ready_s", {}).get("median")
    ready: dict[str, Any] = {
        "name": f"{setting}: DHT constructor -> ready (join)",
        "unit": "s",
        "ours": ours.get("ready_s", {}).get("median"),
        "hivemind": ready_ref,
    }
    if ready["ours"] and ready_ref:
        ready["ratio"] = ready_ref / ready["ours"]
    return [
        ready,
        *_latency_rows(setting, ours, ref, target=ref is not None),
        *_success_rows(setting, ours, ref),
    ]


def _cell(row: dict[str, Any], side: str) -> str:
    value = row.get(side)
    if value is None:
        return "-"
    if row["unit"] == "ms":
        p90 = row.get(f"{side}_p90")
        return f"{value:.2f} / {p90:.2f}" if p90 is not None else f"{value:.2f}"
    if row["unit"] == "%":
        return f"{value:.0f}% ({row[f'{side}_count']})"
    return f"{value:.3f}"


def _print_table(rows: list[dict[str, Any]], notes: list[str]) -> None:
    width = max((len(str(r["name"])) for r in rows), default=40) + 6
    header = (
        f"{'metric':{width}} {'swarmavg':>16} {'hivemind':>16} {'hm/ours':>8}  {'target':34} ok"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        name = f"{row['name']} ({row['unit']})"
        ratio = f"{row['ratio']:.1f}x" if "ratio" in row else ""
        ok = "" if "ok" not in row else ("yes" if row["ok"] else "NO")
        print(
            f"{name:{width}} {_cell(row, 'ours'):>16} {_cell(row, 'hivemind'):>16} "
            f"{ratio:>8}  {row.get('target', ''):34} {ok}"
        )
    print("  latency cells: median / p90; hm/ours: hivemind's median over ours (higher is better)")
    for row in rows:
        if "aim_met" in row:
            met = "met" if row["aim_met"] else "not met"
            print(f"  aim <= {AIM_MS:.0f} ms for {row['name']!r}: {met}")
    for note in notes:
        print(f"  {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds, 3 ready repeats")
    parser.add_argument("--json", type=Path, help="also write rows and raw figures to this file")
    parser.add_argument("--rounds", type=int, help="rounds per latest=False/True (default 50)")
    parser.add_argument("--ready-repeats", type=int, help="timed constructions (default 5)")
    parser.add_argument(
        "--repeats", type=int, help="alternating TCP phases per system (default 3, --quick 1)"
    )
    parser.add_argument("--tcp", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hivemind", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hivemind-python", default=str(HIVEMIND_PYTHON))
    parser.add_argument("--tcp-peers", type=int, default=8)
    parser.add_argument("--memory-peers", type=int, default=32)
    parser.add_argument("--kill-fraction", type=float, default=0.1)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after the swarm is up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 10 if args.quick else 50
    if args.ready_repeats is None:
        args.ready_repeats = 3 if args.quick else 5
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    notes = [f"this machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load {load}"]
    # (key, label, run, seed); over TCP, ours and hivemind's phases alternate (see the top)
    phases: list[tuple[str, str, Callable[[argparse.Namespace], dict[str, Any]], int]] = []
    for rep in range(args.repeats if args.tcp or args.hivemind else 0):
        of = f" (phase {rep + 1}/{args.repeats})"
        if args.tcp:
            phases.append(("swarmavg_tcp", "swarmavg tcp" + of, _run_tcp, args.seed + rep))
        if args.hivemind:
            phases.append(("hivemind_tcp", "hivemind" + of, _run_hivemind, args.seed + rep))
    if args.memory:
        phases.append(("swarmavg_memory", "swarmavg memory", _run_memory, args.seed))
    by_key: dict[str, list[dict[str, Any]]] = {}
    for key, label, run, seed in phases:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        try:
            result = run(argparse.Namespace(**{**vars(args), "seed": seed}))
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        if "error" in result:
            notes.append(f"{label}: {result['error']}")
        for error in result.get("errors", []):
            notes.append(f"{label}, a failed call: {error}")
        by_key.setdefault(key, []).append(result)
    raw: dict[str, Any] = {key: _pooled(results) for key, results in by_key.items()}
    raw["phases"] = by_key
    if args.repeats > 1 and (args.tcp or args.hivemind):
        notes.append(_phase_medians(by_key))

    hivemind = raw.get("hivemind_tcp")
    if hivemind is not None and "error" not in hivemind:
        ours_killed = raw.get("swarmavg_tcp", {}).get("killed")
        notes.append(
            f"hivemind {hivemind['version']} (Python {hivemind['python']}): killed peer(s) "
            f"{hivemind['killed']}" + (f", ours {ours_killed}" if ours_killed else "")
        )
    elif not args.hivemind:
        notes.append("hivemind: skipped (--no-hivemind)")
    rows: list[dict[str, Any]] = []
    if args.tcp or args.hivemind:
        ref = hivemind if hivemind is not None and "error" not in hivemind else None
        rows += _rows(f"tcp N={args.tcp_peers}", raw.get("swarmavg_tcp", {}), ref)
    if args.memory:
        rows += _rows(f"memory N={args.memory_peers}", raw.get("swarmavg_memory", {}), None)
    notes.append(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    _print_table(rows, notes)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "raw": raw, "notes": notes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
