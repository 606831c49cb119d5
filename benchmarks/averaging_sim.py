"""Moshpit averaging of many peers, simulated with swarmavg's sans-IO pieces (no network, no
event loop, no real time).

    python benchmarks/averaging_sim.py [--peers 1024] [--group-size 2] [--size 256]
                                       [--part-size 64] [--bandwidths equal|random] [--seed 0]
    python benchmarks/averaging_sim.py --random-bits [--bits 6,8,12] [--peers 1024]
                                       [--group-size 16] [--size 64] [--max-rounds 6]
                                       [--tolerance 1e-3] [--seed 0]

What runs is the library's own arithmetic, only the I/O is left out:

- matchmaking: every peer sits under the group key ``group_key(prefix, bits)``
  (:mod:`swarmavg.proto.matchmaking`); the peers of one key form one group, its members in
  PeerID order (as a leader sends them) under a random 16-byte group id;
- all-reduce: the group's vector is split by :func:`~swarmavg.proto.allreduce.load_balance`
  (each member's bandwidth) and cut into parts by
  :func:`~swarmavg.proto.allreduce.plan_parts`; each part is reduced by a
  :class:`~swarmavg.proto.allreduce.PartReducer` that every member adds its values to, and its
  mean is written back to every member;
- Moshpit: each member moves on to ``next_group_bits(bits, group_id, index, group_size)``.

The peers start on a grid: with ``N = g^d`` peers in groups of ``g`` (a power of two),
peer ``i`` starts with the ``(d - 1)·log2 g`` bits of ``i // g``, so round 1 forms ``N / g`` full
groups, one per key. Moshpit then averages along one dimension of the ``g × … × g`` grid per
round, so every peer holds the exact global mean after ``d = log_g N`` rounds and not before.
The script checks that (and that every round keeps the mean and forms only full groups) and
prints, per round: the groups formed, the spread (max - min over peers and elements), and the
values the busiest member sent and received (what bounds a real round's time). It exits with
status 1 if a check fails.

``--random-bits`` (the issue's scale test): no grid. Every peer starts with ``--bits`` random
group bits (a comma-separated list runs each length in turn). Each round the peers with equal
bits form groups: a set larger than ``--group-size`` is shuffled (seeded) and cut into groups of
``--group-size`` in that order, what is left forming one smaller group (a leftover of one peer
finds no group and, as the averager does then, moves to other random bits of the same length);
members are ordered by PeerID, each group's mean is computed exactly (float64 numpy mean, no
parts) and written back, and every member moves on with
``next_group_bits(bits, group_id, index, len(group))``. Per round it prints the groups, their
sizes, and the largest distance of any peer's value to the global mean relative to the initial
one (max over peers and elements of ``|x - mean|``, divided by its value before round 1). A bit
length passes when that is at most ``--tolerance`` within ``--max-rounds`` rounds; the script
exits with status 1 unless every length passes. A real deployment would take about
``log2(N / group_size)`` bits (one key per full group: 6 for 1024 peers in 16s), i.e. two or
three rounds' worth of 4-bit moves (``log_16 1024 = 2.5``: 8 or 12 bits).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from swarmavg.identity import PeerID
from swarmavg.proto.allreduce import FlatLayout, PartReducer, TensorSpec, load_balance, plan_parts
from swarmavg.proto.matchmaking import group_key, next_group_bits

PREFIX = "sim"


@dataclass
class Peer:
    peer_id: PeerID
    bits: str
    values: npt.NDArray[np.float64]
    bandwidth: float


@dataclass
class RoundStats:
    groups: int
    sizes: set[int]
    mean_error: float
    spread: float
    busiest_sent: int
    busiest_received: int


def grid_dimensions(peers: int, group_size: int) -> int:
    """``d`` with ``peers == group_size ** d``.

    :raises ValueError: not a grid of full groups (or a group size that is not a power of two,
        which Moshpit's new bits cannot spread evenly).
    """
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"the group size must be a power of two >= 2, not {group_size}")
    dimensions = round(math.log(peers, group_size))
    if peers < group_size or group_size**dimensions != peers:
        raise ValueError(f"{peers} peers are not a power of the group size {group_size}")
    return dimensions


def make_peers(
    count: int, group_size: int, size: int, bandwidths: str, rng: random.Random
) -> list[Peer]:
    """``count`` peers on the grid: random PeerIDs, values and (optionally) bandwidths."""
    width = (group_size - 1).bit_length()
    bits = (grid_dimensions(count, group_size) - 1) * width
    values = np.random.default_rng(rng.getrandbits(64)).standard_normal((count, size))
    return [
        Peer(
            PeerID.from_public_key(rng.randbytes(32)),
            format(i // group_size, f"0{bits}b") if bits else "",
            values[i].copy(),
            1.0 if bandwidths == "equal" else rng.uniform(0.1, 10.0),
        )
        for i in range(count)
    ]


def all_reduce(members: list[Peer], layout: FlatLayout, part_size: int) -> tuple[int, int]:
    """Average the members' values in place as the butterfly all-reduce does; the values the
    busiest member sent and received."""
    n = len(members)
    spans = load_balance(layout.numel, [m.bandwidth for m in members])
    plans = plan_parts(layout, spans, part_size)
    sent, received = [0] * n, [0] * n
    means: list[tuple[int, int, npt.NDArray[np.floating]]] = []
    senders = range(n)
    for reducer, parts in enumerate(plans):
        for part in parts:
            dtype = layout.buffers[part.buffer][0]
            accumulate = PartReducer(part.size, dtype, senders)
            for sender, member in enumerate(members):
                accumulate.add(sender, member.values[part.start : part.stop], 1.0)
                if sender != reducer:
                    sent[sender] += part.size
                    received[reducer] += part.size
            mean = accumulate.result()
            assert accumulate.done
            assert mean is not None
            means.append((part.start, part.stop, mean))
            for other in senders:
                if other != reducer:
                    sent[reducer] += part.size
                    received[other] += part.size
    for start, stop, mean in means:  # every member applies every part's mean (alpha = 1)
        for member in members:
            member.values[start:stop] = mean
    return max(sent), max(received)


def simulate_round(
    peers: list[Peer], layout: FlatLayout, part_size: int, rng: random.Random
) -> tuple[list[int], int, int]:
    """One round: group the peers by key, all-reduce each group, move every member on. The
    sizes of the groups, and the values the busiest member sent and received."""
    groups: dict[str, list[Peer]] = {}
    for peer in peers:
        groups.setdefault(group_key(PREFIX, peer.bits), []).append(peer)
    busiest_sent = busiest_received = 0
    for members in groups.values():
        members.sort(key=lambda p: p.peer_id.to_bytes())
        group_id = rng.randbytes(16)
        sent, received = all_reduce(members, layout, part_size)
        busiest_sent, busiest_received = max(busiest_sent, sent), max(busiest_received, received)
        for index, member in enumerate(members):
            member.bits = next_group_bits(member.bits, group_id, index, len(members))
    return [len(m) for m in groups.values()], busiest_sent, busiest_received


def run(
    peers: int, group_size: int, size: int, part_size: int, bandwidths: str, seed: int
) -> list[RoundStats]:
    rng = random.Random(seed)
    rounds = grid_dimensions(peers, group_size)
    swarm = make_peers(peers, group_size, size, bandwidths, rng)
    layout = FlatLayout((TensorSpec((size,), "float64"),))
    target = np.mean([p.values for p in swarm], axis=0)
    stats = []
    for _ in range(rounds):
        sizes, busiest_sent, busiest_received = simulate_round(swarm, layout, part_size, rng)
        values = np.stack([p.values for p in swarm])
        stats.append(
            RoundStats(
                groups=len(sizes),
                sizes=set(sizes),
                mean_error=float(np.abs(values.mean(axis=0) - target).max()),
                spread=float((values.max(axis=0) - values.min(axis=0)).max()),
                busiest_sent=busiest_sent,
                busiest_received=busiest_received,
            )
        )
    final = np.stack([p.values for p in swarm])
    stats[-1].mean_error = max(stats[-1].mean_error, float(np.abs(final - target).max()))
    return stats


def check(stats: list[RoundStats], peers: int, group_size: int) -> list[str]:
    """What went wrong (nothing: an empty list)."""
    problems = []
    for number, round_ in enumerate(stats, 1):
        if round_.sizes != {group_size} or round_.groups != peers // group_size:
            problems.append(
                f"round {number}: {round_.groups} groups of sizes {sorted(round_.sizes)},"
                f" not {peers // group_size} of {group_size}"
            )
        if round_.mean_error > 1e-9:
            problems.append(f"round {number}: the mean moved by {round_.mean_error:.2e}")
    if stats[-1].spread > 1e-9:
        problems.append(f"after {len(stats)} rounds the spread is {stats[-1].spread:.2e}, not 0")
    for number, round_ in enumerate(stats[:-1], 1):
        if round_.spread < 1e-3:
            problems.append(f"round {number} of {len(stats)} already reached the mean")
    return problems


@dataclass
class RandomRound:
    groups: int
    sizes: list[int]
    alone: int
    relative_distance: float
    mean_error: float


def run_random(
    peers: int, group_size: int, bits: int, size: int, max_rounds: int, tolerance: float, seed: int
) -> list[RandomRound]:
    """Moshpit from random initial bits of length ``bits`` (see the module doc); stops early
    once the relative distance is within ``tolerance``."""
    rng = random.Random(seed)
    ids = [PeerID.from_public_key(rng.randbytes(32)) for _ in range(peers)]
    order = sorted(range(peers), key=lambda i: ids[i].to_bytes())  # (index within a group)
    rank = {peer: position for position, peer in enumerate(order)}
    peer_bits = [format(rng.getrandbits(bits), f"0{bits}b") if bits else "" for _ in ids]
    values = np.random.default_rng(rng.getrandbits(64)).standard_normal((peers, size))
    target = values.mean(axis=0)
    initial = float(np.abs(values - target).max())
    stats = []
    for _ in range(max_rounds):
        by_key: dict[str, list[int]] = {}
        for i in range(peers):
            by_key.setdefault(group_key(PREFIX, peer_bits[i]), []).append(i)
        groups: list[list[int]] = []
        for key in sorted(by_key):
            members = by_key[key]
            rng.shuffle(members)
            groups.extend(members[k : k + group_size] for k in range(0, len(members), group_size))
        for members in groups:
            members.sort(key=rank.__getitem__)
            values[members] = values[members].mean(axis=0)
            group_id = rng.randbytes(16)
            if len(members) == 1:  # no group: the averager moves to other random bits
                i = members[0]
                if peer_bits[i]:
                    width = len(peer_bits[i])
                    moved = peer_bits[i]
                    while moved == peer_bits[i]:
                        moved = format(rng.getrandbits(width), f"0{width}b")
                    peer_bits[i] = moved
                continue
            for index, i in enumerate(members):
                peer_bits[i] = next_group_bits(peer_bits[i], group_id, index, len(members))
        sizes = sorted(len(m) for m in groups)
        stats.append(
            RandomRound(
                groups=len(groups),
                sizes=sizes,
                alone=sizes.count(1),
                relative_distance=float(np.abs(values - target).max()) / initial,
                mean_error=float(np.abs(values.mean(axis=0) - target).max()),
            )
        )
        if stats[-1].relative_distance <= tolerance:
            break
    return stats


def main_random(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.bits.split(",") if x.strip()]
    print(
        f"{args.peers} peers, groups of up to {args.group_size} from random initial bits"
        f" ({', '.join(map(str, lengths))} bits), {args.size} float64 values each; goal:"
        f" max |x - mean| <= {args.tolerance:g} x its initial value within {args.max_rounds}"
        " rounds"
    )
    failed = []
    for bits in lengths:
        started = time.perf_counter()
        stats = run_random(
            args.peers,
            args.group_size,
            bits,
            args.size,
            args.max_rounds,
            args.tolerance,
            args.seed,
        )
        elapsed = time.perf_counter() - started
        print(f"-- {bits} bits ({1 << bits} keys)")
        print(
            f"{'round':>5} {'groups':>7} {'alone':>6} {'sizes (min/median/max)':>23}"
            f" {'rel. distance':>13} {'mean moved':>10}"
        )
        for number, round_ in enumerate(stats, 1):
            sizes = round_.sizes
            spread = f"{sizes[0]}/{sizes[len(sizes) // 2]}/{sizes[-1]}"
            print(
                f"{number:>5} {round_.groups:>7} {round_.alone:>6} {spread:>23}"
                f" {round_.relative_distance:>13.2e} {round_.mean_error:>10.1e}"
            )
        reached = stats[-1].relative_distance <= args.tolerance
        moved = max(r.mean_error for r in stats)
        if reached and moved <= 1e-9:
            print(f"within {args.tolerance:g} after {len(stats)} rounds ({elapsed:.2f} s)")
        else:
            failed.append(bits)
            why = (
                f"the mean moved by {moved:.2e}"
                if reached
                else f"{stats[-1].relative_distance:.2e} after {len(stats)} rounds"
            )
            print(f"FAILED with {bits} bits: {why}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1024, help="N (a power of --group-size)")
    parser.add_argument("--group-size", type=int, default=2, help="g (a power of two)")
    parser.add_argument("--size", type=int, default=256, help="elements per peer (float64)")
    parser.add_argument("--part-size", type=int, default=64, help="elements per part")
    parser.add_argument("--bandwidths", choices=["equal", "random"], default="random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--random-bits", action="store_true", help="the scale test: random initial bits"
    )
    parser.add_argument("--bits", default="2,3", help="--random-bits: bit lengths to try")
    parser.add_argument("--max-rounds", type=int, default=6, help="--random-bits: round limit")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="--random-bits: goal")
    args = parser.parse_args(argv)
    if args.random_bits:
        if argv is None and "--group-size" not in sys.argv:
            args.group_size = 16
        if args.group_size < 2 or args.peers < 2 or args.size < 1 or args.max_rounds < 1:
            parser.error("--group-size and --peers must be >= 2, --size and --max-rounds >= 1")
        return main_random(args)
    try:
        rounds = grid_dimensions(args.peers, args.group_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.size < 1 or args.part_size < 1:
        parser.error("--size and --part-size must be positive")
    print(
        f"{args.peers} peers in groups of {args.group_size}: ⌈log_{args.group_size}"
        f" {args.peers}⌉ = {rounds} rounds, {args.size} float64 values each,"
        f" {args.bandwidths} bandwidths"
    )
    PartReducer(1, "float64", [0]).add(0, np.zeros(1), 1.0)  # (first use may import lazily)
    started = time.perf_counter()
    stats = run(args.peers, args.group_size, args.size, args.part_size, args.bandwidths, args.seed)
    elapsed = time.perf_counter() - started
    print(f"{'round':>5} {'groups':>7} {'spread':>10} {'mean moved':>10} {'busiest sent/recv':>18}")
    for number, round_ in enumerate(stats, 1):
        print(
            f"{number:>5} {round_.groups:>7} {round_.spread:>10.2e} {round_.mean_error:>10.1e}"
            f" {round_.busiest_sent:>8}/{round_.busiest_received:<9}"
        )
    problems = check(stats, args.peers, args.group_size)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if not problems:
        print(f"exact mean after {len(stats)} rounds ({elapsed:.2f} s of computing)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
