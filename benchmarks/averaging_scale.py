"""Moshpit averaging of 1024 real averagers in one process, from random initial group bits (the
issue's scale requirement, with the real matchmaking, all-reduce and DHT), on virtual time.

    python benchmarks/averaging_scale.py [--peers 1024] [--group-size 16] [--min-group-size 8]
                                         [--bits 3] [--size 16] [--target-rounds 6]
                                         [--max-rounds 10] [--tolerance 1e-3]
                                         [--time-limit 900] [--seed 0] [--real-time] [...]

Every peer is a ``swarmavg.aio.DHT`` (its own node, on the in-process ``MemoryTransport``: no
sockets, no latency) and a ``swarmavg.aio.DecentralizedAverager`` over one random float32 tensor
of ``--size`` elements, with ``target_group_size=--group-size`` and
``min_group_size=--min-group-size``, all sharing one event loop. The first DHT starts alone;
every later one bootstraps from ``--bootstrap`` random peers among those already running,
``--batch`` peers starting at once. Each averager then gets ``--bits`` random group bits.
``benchmarks/averaging_sim.py --random-bits`` finds that 2 to 5 bits reach 1e-3 within 6 rounds
for 1024 peers in groups of 16, and 6 or more do not (too many keys hold fewer than 16 peers).
The default is 3 bits, i.e. 8 keys of ~128 peers (with fewer, fuller keys fewer peers end a
round in a small leftover group), and ``min_group_size`` half the target (8): a key's last few
peers, a leftover group of 2-7 that would carry the largest distance, disband at the averaging
expiration and look again under the prefix's own key, where the leftovers of every key meet.
Largest distance with groups assembled as soon as every peer looking has joined (issue 22),
seeds 0/1/2: 5.01e-4 / 2.44e-4 / 5.62e-4 after 6 rounds (one run of seed 1 of a version
without regulars: 1.03e-3 after 6, 1.7e-4 after 7). Before that, seeds 0/1: with
``min_group_size`` 8, 7.98e-4 after 6 rounds / 9.95e-4 after 5 (since a peer still deciding
holds join requests for its key, 2026-11-26: groups fill to 16 more often, and a round's few
leftovers, 0-11, may be fewer than 8 and miss it; holding
requests for any key: 9.65e-4 after 6 / 7.44e-4 after 6, seed 2 9.12e-4 after 5; before any
holding, 7.35e-4 after 6 / 8.58e-4 after 5 / 9.46e-4 after 5; runs vary from one to the next:
seed 0 of that code also gave 5.65e-4 after 6); with ``min_group_size`` 2 (before it),
2.1e-4 / 9.96e-4 after 6 and 1.14e-3 after 6 (seed 2 got within 1e-3 only in round 7);
4 bits (16 keys of ~64), ``min_group_size`` 2: 1.5e-3 after 6.

Virtual time (:class:`swarmavg.testing.VirtualClockLoop`): the event loop's clock, and with it
every timeout, sleep and DHT expiration, stands still while the process computes and jumps to
the next timer when every peer waits. 1024 peers on one core then see the timeouts that 1024
peers on their own machines would see (a round costs ~1 minute of CPU here, which on real
time would blow every timeout and leave dozens of peers a round without a group: that run,
``--real-time``, got the RMS to 7e-4 but the largest distance only to 7.5e-3 in 6 rounds), so
the averagers run with the library's defaults (``averaging_expiration`` 15 s,
``request_timeout`` 3 s, DHT ``request_timeout`` 3 s) and ``step(timeout=--step-timeout)``.

A round: every peer calls ``step()`` at once; a peer whose step raises (``MatchmakingFailed``:
no group in time, after which the averager moves to other random bits; ``AllReduceFailed``)
counts as failed and keeps its values. Per round it prints the virtual and wall seconds the
round took and the CPU seconds, the groups formed (their number and a histogram of sizes,
``size×count``), the peers that found no group (and other failures), the steps that averaged
incompletely (``StepResult.incomplete``), the error (below), the median and largest (virtual)
time a peer took to find its group (``mm``) and the longest all-reduce (``ar``). The error:

    error = max over peers p and elements j of |x[p, j] - mean[j]|
            / max over p, j of |x0[p, j] - mean[j]|

where ``mean`` is the global mean of the initial values ``x0`` (float64), i.e. the largest
distance of any value to the global mean relative to the initial spread (as the simulation
reports it); the RMS of ``x - mean`` over the RMS of ``x0 - mean`` is printed beside it, and how
far the peers' own mean moved from ``mean`` (relative to the same spread: float32 rounding, or
a group that averaged incompletely). The run stops once the error is at most ``--tolerance``,
after ``--max-rounds`` rounds, or when ``--time-limit`` seconds of wall time have passed
(building the swarm included; a watchdog thread cancels the run then). It passes (exit status
0) when the error reached ``--tolerance`` within ``--target-rounds`` rounds (the issue: 1e-3
within 6).

CPU savings for one process (all flags): the DHTs use ``k`` 8, ``alpha`` 3, ``num_replicas`` 1
(a store or a read is then a walk of ~1.5 requests, not ~4, and every peer of a key reads the
same node), no local cache; ``min_vector_size`` defaults to ``--size``, so one member of each
group reduces the whole (tiny) vector (a butterfly over 16 floats would cost 240 streams a
group); ``--min-vector-size 0`` for the butterfly. No state sharing (it would only add DHT
traffic).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import torch

from swarmavg.aio import DHT
from swarmavg.aio.averager import (
    AllReduceFailed,
    DecentralizedAverager,
    MatchmakingFailed,
    StepResult,
)
from swarmavg.testing import MemoryNetwork, run_on_virtual_time

PREFIX = "scale"


class _Counting(logging.Handler):
    """Counts the warnings (and worse) the library logs, by logger and first words."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        words = " ".join(str(record.msg).split()[:3])
        self.counts[f"{record.name}: {words}"] += 1


@dataclass
class Swarm:
    dhts: list[DHT | None]
    averagers: list[DecentralizedAverager | None]
    stop: anyio.Event = field(default_factory=anyio.Event)

    def ready(self) -> list[DecentralizedAverager]:
        assert all(a is not None for a in self.averagers)
        return self.averagers  # type: ignore[return-value]


@dataclass
class Round:
    seconds: float  # on the loop's clock (virtual unless --real-time)
    wall: float
    cpu: float  # this process's CPU seconds over the round
    sizes: Counter[int]  # group size -> groups of that size
    failed: Counter[str]  # why -> peers
    incomplete: int
    error: float
    rms: float
    mean_moved: float
    matchmaking: list[float]  # each grouped peer's seconds to find its group, sorted
    slowest_allreduce: float

    def row(self, number: int) -> str:
        groups = sum(self.sizes.values())
        matchmaking = self.matchmaking or [math.nan]
        others = "".join(f" ({why}: {n})" for why, n in self.failed.items() if why != "no group")
        return (
            f"{number:>5} {self.seconds:>6.1f} {self.wall:>6.1f} {self.cpu:>6.1f} {groups:>6}"
            f" {self.failed['no group']:>8} {self.incomplete:>8} {self.error:>9.2e}"
            f" {self.rms:>9.2e} {self.mean_moved:>8.1e}"
            f" {matchmaking[len(matchmaking) // 2]:>6.1f} {matchmaking[-1]:>6.1f}"
            f" {self.slowest_allreduce:>6.1f}  {_histogram(self.sizes)}{others}"
        )


HEADER = (
    f"{'round':>5} {'time s':>6} {'wall s':>6} {'cpu s':>6} {'groups':>6} {'no group':>8}"
    f" {'incompl.':>8} {'error':>9} {'rms':>9} {'mean mv.':>8} {'mm p50':>6} {'mm max':>6}"
    f" {'ar max':>6}"
    "  group sizes (size×count)"
)


def _values(averagers: Sequence[DecentralizedAverager]) -> npt.NDArray[np.float64]:
    """Every peer's tensor (peers × elements), as float64."""
    rows = []
    for averager in averagers:
        with averager.get_tensors() as own:
            rows.append(own[0].detach().to(torch.float64).numpy().copy())
    return np.stack(rows)


async def _peer(
    i: int,
    swarm: Swarm,
    network: MemoryNetwork,
    tensor: torch.Tensor,
    seeds: list[str],
    args: argparse.Namespace,
    started: anyio.Event,
) -> None:
    """Run peer ``i`` (its DHT and averager) until the swarm stops."""
    async with DHT(
        seeds,
        transport="memory",
        transport_options={"network": network},
        k=args.dht_k,
        alpha=args.dht_alpha,
        num_replicas=args.dht_replicas,
        request_timeout=args.dht_request_timeout,
        cache_locally=False,  # (matchmaking reads with latest=True, past any cache)
    ) as dht:
        swarm.dhts[i] = dht
        async with DecentralizedAverager(
            [tensor],
            dht,
            prefix=PREFIX,
            target_group_size=args.group_size,
            min_group_size=args.min_group_size,
            averaging_expiration=args.expiration,
            request_timeout=args.request_timeout,
            min_vector_size=args.min_vector_size,
            allow_state_sharing=False,
        ) as averager:
            swarm.averagers[i] = averager
            started.set()
            await swarm.stop.wait()


async def _build(
    tg: Any, swarm: Swarm, tensors: list[torch.Tensor], args: argparse.Namespace, rng: random.Random
) -> None:
    """Start every peer, ``--batch`` at a time, each bootstrapping from ``--bootstrap`` random
    peers already running."""
    network = MemoryNetwork()
    count = len(tensors)
    i = 0
    while i < count:
        batch = range(i, min(count, i + (1 if i == 0 else args.batch)))
        running = [d for d in swarm.dhts[:i] if d is not None]
        events = []
        for j in batch:
            chosen = rng.sample(running, min(args.bootstrap, len(running)))
            seeds = [a for d in chosen for a in d.get_visible_maddrs()]
            started = anyio.Event()
            events.append(started)
            tg.start_soon(_peer, j, swarm, network, tensors[j], seeds, args, started)
        for started in events:
            await started.wait()
        i = batch.stop


async def _round(
    averagers: Sequence[DecentralizedAverager], step_timeout: float
) -> tuple[list[StepResult | None], Counter[str]]:
    """Every peer steps at once; the results (``None``: the step failed) and why steps failed."""
    results: list[StepResult | None] = [None] * len(averagers)
    failed: Counter[str] = Counter()

    async def one(i: int) -> None:
        try:
            results[i] = await averagers[i].step(timeout=step_timeout)
        except MatchmakingFailed:
            failed["no group"] += 1
        except AllReduceFailed:
            failed["all-reduce failed"] += 1

    # (the steps bound themselves: timeout, then request_timeout and allreduce_timeout)
    async with anyio.create_task_group() as tg:
        for i in range(len(averagers)):
            tg.start_soon(one, i)
    return results, failed


def _histogram(sizes: Counter[int]) -> str:
    return " ".join(f"{size}×{sizes[size]}" for size in sorted(sizes, reverse=True)) or "-"


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tensors = [torch.randn(args.size, dtype=torch.float32) for _ in range(args.peers)]
    initial = np.stack([t.numpy().astype(np.float64) for t in tensors])
    mean = initial.mean(axis=0)
    initial_max = float(np.abs(initial - mean).max())
    initial_rms = float(np.sqrt(((initial - mean) ** 2).mean()))
    print(
        f"{args.peers} averagers in one process (MemoryTransport), target_group_size="
        f"{args.group_size}, min_group_size={args.min_group_size}, {args.bits} random initial"
        f" bits ({1 << args.bits} keys), one float32 tensor of {args.size} elements each;"
        f" goal: error <= {args.tolerance:g} within {args.target_rounds} rounds"
        f" (hard limits: {args.max_rounds} rounds, {args.time_limit:g} s)"
    )
    print(
        f"DHT: k={args.dht_k} alpha={args.dht_alpha} num_replicas={args.dht_replicas}"
        f" request_timeout={args.dht_request_timeout:g}; bootstrap from {args.bootstrap} random"
        f" running peers, {args.batch} at a time. Averager: averaging_expiration="
        f"{args.expiration:g} request_timeout={args.request_timeout:g}, step timeout"
        f" {args.step_timeout:g} s, min_vector_size={args.min_vector_size}",
        flush=True,
    )
    swarm = Swarm([None] * args.peers, [None] * args.peers)
    rounds: list[Round] = []
    t0 = time.perf_counter()
    built_at = None
    reached = None
    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as overall, _watchdog(overall, args.time_limit):
            await _build(tg, swarm, tensors, args, rng)
            built_at = time.perf_counter() - t0
            averagers = swarm.ready()
            sizes = [d.dht_node.routing_table_size for d in swarm.dhts if d is not None]
            print(
                f"built in {built_at:.1f} s; routing tables: min {min(sizes)}, median"
                f" {sorted(sizes)[len(sizes) // 2]}, max {max(sizes)} peers",
                flush=True,
            )
            for averager in averagers:
                averager.set_group_bits(format(rng.getrandbits(args.bits), f"0{args.bits}b"))
            keys = Counter(a.get_group_bits() for a in averagers)
            print(
                f"initial keys: {len(keys)}, peers per key min {min(keys.values())} max"
                f" {max(keys.values())}"
            )
            print(HEADER)
            # the longest a round can take: the step's timeout, the matchmaker's last
            # request_timeout, then the all-reduce
            for number in range(1, args.max_rounds + 1):
                if time.perf_counter() - t0 + 1.5 * _longest(rounds) > args.time_limit:
                    print(f"stopping: round {number} might not finish within the time limit")
                    break
                started, wall = anyio.current_time(), time.perf_counter()
                cpu = time.process_time()
                results, failed = await _round(averagers, args.step_timeout)
                seconds = anyio.current_time() - started
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                values = _values(averagers)
                ok = [r for r in results if r is not None]
                groups = {r.group_id: r.group_size for r in ok}
                rounds.append(
                    Round(
                        seconds=seconds,
                        wall=wall,
                        cpu=cpu,
                        sizes=Counter(groups.values()),
                        failed=failed,
                        incomplete=sum(r.incomplete for r in ok),
                        error=float(np.abs(values - mean).max()) / initial_max,
                        rms=float(np.sqrt(((values - mean) ** 2).mean())) / initial_rms,
                        mean_moved=float(np.abs(values.mean(axis=0) - mean).max()) / initial_max,
                        matchmaking=sorted(r.matchmaking_seconds for r in ok),
                        slowest_allreduce=max((r.allreduce_seconds for r in ok), default=0),
                    )
                )
                r = rounds[-1]
                print(r.row(number), flush=True)
                if r.error <= args.tolerance:
                    reached = number
                    break
        swarm.stop.set()
    total = time.perf_counter() - t0
    if overall.cancelled_caught:
        print(f"the time limit ({args.time_limit:g} s) ran out", file=sys.stderr)
    steps = [r.wall for r in rounds]
    if steps:
        print(
            f"rounds took {sum(steps):.1f} s of wall time (median"
            f" {sorted(steps)[len(steps) // 2]:.1f} s, max {max(steps):.1f} s) and"
            f" {sum(r.seconds for r in rounds):.1f} s on the loop's clock; built in"
            f" {built_at or float('nan'):.1f} s; total {total:.1f} s (shutdown included)"
        )
    if _COUNTING.counts:
        print("library warnings:")
        for what, n in _COUNTING.counts.most_common(10):
            print(f"  {n:>6}  {what}")
    rms_reached = next((n for n, r in enumerate(rounds, 1) if r.rms <= args.tolerance), None)
    if rms_reached is not None:
        print(f"(the RMS was within {args.tolerance:g} after {rms_reached} rounds)")
    if reached is not None and reached <= args.target_rounds:
        print(f"within {args.tolerance:g} after {reached} rounds (target {args.target_rounds})")
        return 0
    final = f"{rounds[-1].error:.2e} after {len(rounds)} rounds" if rounds else "no round ran"
    if reached is not None:
        final = f"within {args.tolerance:g} only after {reached} rounds"
    print(f"FAILED: {final} (target: {args.target_rounds} rounds)", file=sys.stderr)
    return 1


def _longest(rounds: list[Round]) -> float:
    return max((r.wall for r in rounds), default=0.0)


@contextlib.contextmanager
def _watchdog(scope: anyio.CancelScope, seconds: float) -> Iterator[None]:
    """Cancel ``scope`` after ``seconds`` of wall time (the loop's clock may be virtual)."""
    loop = asyncio.get_running_loop()
    timer = threading.Timer(seconds, loop.call_soon_threadsafe, (scope.cancel,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


_COUNTING = _Counting()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=16, help="target_group_size")
    parser.add_argument(
        "--min-group-size", type=int, help="min_group_size (default: half --group-size, >= 2)"
    )
    parser.add_argument("--bits", type=int, default=3, help="random initial group bits")
    parser.add_argument("--size", type=int, default=16, help="float32 elements per peer")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--target-rounds", type=int, default=6, help="rounds to pass within")
    parser.add_argument("--max-rounds", type=int, default=10, help="hard limit on rounds")
    parser.add_argument("--time-limit", type=float, default=900.0, help="wall-time limit (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expiration", type=float, default=15.0, help="averaging_expiration")
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--step-timeout", type=float, default=30.0, help="step(timeout=)")
    parser.add_argument(
        "--min-vector-size",
        type=int,
        default=None,
        help="members with a smaller span reduce nothing (default --size: one reducer a group)",
    )
    parser.add_argument("--dht-k", type=int, default=8)
    parser.add_argument("--dht-alpha", type=int, default=3)
    parser.add_argument("--dht-replicas", type=int, default=1)
    parser.add_argument("--dht-request-timeout", type=float, default=3.0)
    parser.add_argument("--bootstrap", type=int, default=3, help="initial peers per DHT")
    parser.add_argument("--batch", type=int, default=32, help="DHTs started at once")
    parser.add_argument("--log", action="store_true", help="print the library's warnings")
    parser.add_argument(
        "--real-time",
        action="store_true",
        help="run on the real clock (1024 peers on one core then miss their timeouts)",
    )
    args = parser.parse_args(argv)
    if args.min_group_size is None:
        args.min_group_size = max(2, args.group_size // 2)
    if not (2 <= args.min_group_size <= args.group_size <= args.peers):
        parser.error("need 2 <= --min-group-size <= --group-size <= --peers")
    if not 0 <= args.bits <= 64 or args.size < 1 or args.max_rounds < 1 or args.batch < 1:
        parser.error("--bits must be in 0..64, --size, --max-rounds and --batch >= 1")
    if args.min_vector_size is None:
        args.min_vector_size = args.size
    logging.getLogger("swarmavg").addHandler(_COUNTING)
    if args.log:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    else:  # (counted, not printed: a busy round can log hundreds)
        logging.getLogger("swarmavg").propagate = False
    torch.set_num_threads(1)
    if args.real_time:
        return anyio.run(run, args)
    return run_on_virtual_time(run, args)


if __name__ == "__main__":
    sys.exit(main())
