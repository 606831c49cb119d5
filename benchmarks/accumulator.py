"""Accumulator benchmarks (issue 26): round latency beside gloo, sustained reductions per second,
and convergence against one process, with every peer a process of its own on 127.0.0.1.

    python benchmarks/accumulator.py [--quick] [--out results.json] [--sizes 65536,4194304]
                                     [--peers 4] [--rounds 100] [--warmup 10] [--gloo-iters 50]
                                     [--duration 60] [--parallel 2] [--steps 100]
                                     [--no-latency] [--no-throughput] [--no-convergence]
                                     [--profile PREFIX]

Every process is ``benchmarks/_accumulator_peer.py`` (its docstring has the method) or a gloo
rank (``_averaging_gloo.py``), with ``torch.set_num_threads(1)``, over plain TCP; the cohort's
members are ``swarmavg.aio.accumulator.Accumulator`` (awaited ``reduce_gradients``, no polling).
Runs go one after the other, never two at once.

(a) **Round latency** (target: median within 3x gloo's at 64 Ki float32, within 2x at 4 Mi):
``--peers`` (4) members, one float32 gradient of each of ``--sizes`` (64 Ki and 4 Mi),
``virtual_batch_size = peers`` so that every count decides a result; ``--warmup`` untimed and
``--rounds`` timed rounds, each peer timing ``await reduce_gradients(1)`` (count, all-reduce,
result in ``.grad``); a round's time is the max over peers, its CPU the sum over peers of their
process CPU time over it (all threads; gloo's likewise). gloo: ``barrier()`` then a timed
``all_reduce(SUM)`` of the same size, the max over ranks, ``--gloo-iters`` times, in the same run
(before ours). Median and p99 of each (p99 over ``--gloo-iters`` samples is near their max).

(b) **Sustained reductions** (target: no round lost without a peer leaving): ``--peers`` members,
``set_parallel_gradients(--parallel)``, a gradient of ``--throughput-size`` (64 Ki) float32,
each member contributing whenever ``wants_gradients()`` for ``--duration`` (60) seconds from a
common start time; results applied per second (each peer's count over the window, the minimum
over peers), and rounds lost: the epoch changes and failed all-reduces over the window (each
would drop the rounds in flight), and whether every peer applied the same number of results (up
to the ``parallel`` in flight at the window's end).

(c) **Convergence** (target: within 2% of one process at equal samples): ``--conv-peers`` (3)
members train the workload (``swarmavg.testing.workload``: its model, Adam, lr 2e-3) with batch
``--batch`` (16) each from the sharded stream and ``virtual_batch_size = peers * batch``, for
``--steps`` results; one process trains the same model with batch ``peers * batch`` from the same
stream for the same number of steps (equal samples). Validation loss every ``--eval-every``
results, and the relative difference at the end.

``uptime``'s load averages are printed and recorded before and after: the machine is shared and
its load inflates every timing. ``--out FILE`` writes one JSON object (meta, rows, raw runs).
Every wait has a timeout; processes are killed on the way out (also on Ctrl+C).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _averaging_gloo import rank_main  # noqa: E402

PEER = HERE / "_accumulator_peer.py"
START_TIMEOUT = 180.0  # a peer process up (torch imported) and its DHT running
EXIT_TIMEOUT = 20.0


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Peer:
    """A ``_accumulator_peer.py`` process and a thread reading its JSON lines."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if not os.environ.get("BENCH_LOGS") else None,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {event!r} within {timeout:.0f} s") from None
            if got is None:
                raise RuntimeError(f"the peer exited (code {self.proc.wait(5)}) before {event!r}")
            if got["event"] == "error":
                raise RuntimeError(f"peer error: {got['error']}")
            if got["event"] == event:
                return got

    def close(self) -> None:
        try:
            self.proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_cohort(n: int, cfg: dict[str, Any], result_timeout: float) -> list[dict[str, Any]]:
    """``n`` members with ``cfg`` (peer 0 first, the others joining it); their results."""
    common = {"peers": n, "form_timeout": START_TIMEOUT, "run_timeout": result_timeout, **cfg}
    peers: list[Peer] = []
    try:
        peers.append(Peer({**common, "index": 0}))
        address = peers[0].expect("started", START_TIMEOUT)["address"]
        for i in range(1, n):
            peers.append(Peer({**common, "index": i, "initial": address}))
        for p in peers[1:]:
            p.expect("started", START_TIMEOUT)
        return [p.expect("result", START_TIMEOUT + result_timeout) for p in peers]
    finally:
        for p in peers:
            if p.proc.poll() is None and sys.exc_info()[0] is not None:
                p.proc.kill()
            p.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_gloo(n: int, size: int, iters: int, warmup: int) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    procs: list[Any] = []
    try:
        port = free_port()
        for rank in range(n):
            proc = ctx.Process(
                target=rank_main,
                args=(rank, n, port, size, iters, warmup, 120.0, sender),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        sender.close()
        if not receiver.poll(START_TIMEOUT):
            raise TimeoutError("gloo: no result in time")
        raw: dict[str, Any] = receiver.recv()
        return raw["times_s"], raw["cpu_s"]
    finally:
        for proc in procs:
            proc.join(EXIT_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
        receiver.close()


def latency(args: argparse.Namespace, rows: list[dict[str, Any]], raw: dict[str, Any]) -> None:
    for size in args.sizes:
        progress(f"(a) gloo all_reduce, {args.peers} ranks, {size} float32 ...")
        gloo, gloo_cpu = run_gloo(args.peers, size, args.gloo_iters, min(args.warmup, 5))
        progress(f"(a) accumulator, {args.peers} peers, {size} float32 ...")
        results = run_cohort(
            args.peers,
            {
                "mode": "latency",
                "size": size,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "profile": f"{args.profile}.{size}" if args.profile else None,
            },
            600.0,
        )
        per_round = [max(ts) for ts in zip(*(r["times_s"] for r in results), strict=True)]
        cpu = [sum(cs) for cs in zip(*(r["cpu_s"] for r in results), strict=True)]
        row = {
            "figure": "latency",
            "size": size,
            "peers": args.peers,
            "ours_median_s": statistics.median(per_round),
            "ours_p99_s": percentile(per_round, 99),
            "gloo_median_s": statistics.median(gloo),
            "gloo_p99_s": percentile(gloo, 99),
            "rounds": len(per_round),
            "gloo_iters": len(gloo),
            "ours_cpu_median_s": statistics.median(cpu),  # all peers' CPU over a round
            "gloo_cpu_median_s": statistics.median(gloo_cpu),
        }
        row["ratio_median"] = row["ours_median_s"] / row["gloo_median_s"]
        if args.profile:  # the all-reduce's part of each peer's round (medians over rounds)
            row["allreduce_median_s"] = [statistics.median(r["allreduce_s"]) for r in results]
            row["round_median_per_peer_s"] = [statistics.median(r["times_s"]) for r in results]
        row["target_ratio"] = 3.0 if size <= 65536 else 2.0
        rows.append(row)
        raw[f"latency_{size}"] = {"ours": per_round, "gloo": gloo}
        progress(
            f"    ours median {row['ours_median_s'] * 1e3:.2f} ms, "
            f"gloo {row['gloo_median_s'] * 1e3:.2f} ms"
        )


def throughput(args: argparse.Namespace, rows: list[dict[str, Any]], raw: dict[str, Any]) -> None:
    progress(f"(b) {args.peers} peers, parallel {args.parallel}, {args.duration:.0f} s ...")
    # (the start time leaves room for the processes to start and the cohort to form)
    start_at = time.monotonic() + args.throughput_delay
    results = run_cohort(
        args.peers,
        {
            "mode": "throughput",
            "size": args.throughput_size,
            "parallel": args.parallel,
            "start_at": start_at,
            "duration": args.duration,
            "linger": 3.0,
        },
        args.throughput_delay + args.duration + 120.0,
    )
    counts = [r["results"] for r in results]
    window = min(r["window_s"] for r in results)
    lost = sum(r["epoch_changes"] for r in results) + sum(r["failed_allreduces"] for r in results)
    rows.append(
        {
            "figure": "throughput",
            "peers": args.peers,
            "parallel": args.parallel,
            "size": args.throughput_size,
            "duration_s": args.duration,
            "reductions_per_s": min(counts) / window,
            "window_s": window,
            "results_per_peer": counts,
            "epoch_changes": [r["epoch_changes"] for r in results],
            "failed_allreduces": [r["failed_allreduces"] for r in results],
            "wait_timeouts": [r["wait_timeouts"] for r in results],
            "rounds_lost": lost,
            "results_agree": max(counts) - min(counts) <= args.parallel,
        }
    )
    raw["throughput"] = results
    progress(f"    {min(counts) / window:.1f} reductions/s, rounds lost {lost}")


def convergence(args: argparse.Namespace, rows: list[dict[str, Any]], raw: dict[str, Any]) -> None:
    n = args.conv_peers
    cfg = {"batch": args.batch, "steps": args.steps, "eval_every": args.eval_every, "peers": n}
    progress(f"(c) one process, batch {n * args.batch}, {args.steps} steps ...")
    ref = Peer({**cfg, "mode": "local", "index": 0})
    try:
        local = ref.expect("result", 1200)
    finally:
        ref.close()
    progress(f"(c) {n} peers, batch {args.batch}, virtual batch {n * args.batch} ...")
    results = run_cohort(n, {**cfg, "mode": "convergence"}, 1200.0)
    ours = results[0]
    final_ours, final_ref = ours["curve"][-1][1], local["curve"][-1][1]
    rows.append(
        {
            "figure": "convergence",
            "peers": n,
            "batch": args.batch,
            "virtual_batch_size": n * args.batch,
            "steps": args.steps,
            "samples": args.steps * n * args.batch,
            "ours_loss": final_ours,
            "local_loss": final_ref,
            "relative_difference": (final_ours - final_ref) / final_ref,
            "ours_s": ours["seconds"],
            "local_s": local["seconds"],
            "ours_curve": ours["curve"],
            "local_curve": local["curve"],
        }
    )
    raw["convergence"] = {"ours": results, "local": local}
    progress(f"    loss {final_ours:.4f} vs one process {final_ref:.4f}")


def print_table(rows: list[dict[str, Any]], loads: dict[str, str]) -> None:
    print(f"load averages (1, 5, 15 min): before {loads['before']}, after {loads['after']}")
    print()
    print("| figure | swarmavg | reference, same run | ratio (target) |")
    print("|---|---|---|---|")
    for r in rows:
        if r["figure"] == "latency":
            kib = r["size"] * 4 // 1024
            what = f"round latency, {r['peers']} peers, {r['size']} float32 ({kib} KiB)"
            ours = f"median {r['ours_median_s'] * 1e3:.2f} ms, p99 {r['ours_p99_s'] * 1e3:.2f} ms"
            ref = (
                f"gloo all_reduce median {r['gloo_median_s'] * 1e3:.2f} ms, "
                f"p99 {r['gloo_p99_s'] * 1e3:.2f} ms"
            )
            ours += f"; CPU {r['ours_cpu_median_s'] * 1e3:.1f} ms"
            ref += f"; CPU {r['gloo_cpu_median_s'] * 1e3:.1f} ms"
            ratio = f"{r['ratio_median']:.2f}x (<= {r['target_ratio']:.0f}x)"
        elif r["figure"] == "throughput":
            what = (
                f"sustained, {r['peers']} peers, parallel {r['parallel']}, "
                f"{r['size']} float32, {r['window_s']:.0f} s"
            )
            ours = (
                f"{r['reductions_per_s']:.1f} reductions/s; results per peer "
                f"{r['results_per_peer']}"
            )
            ref = f"rounds lost: {r['rounds_lost']} (epoch changes {r['epoch_changes']})"
            ratio = "(0 lost)" + ("" if r["results_agree"] else "; peers DISAGREE")
        else:
            what = (
                f"convergence, {r['peers']} peers x batch {r['batch']}, "
                f"virtual batch {r['virtual_batch_size']}, {r['samples']} samples"
            )
            ours = f"loss {r['ours_loss']:.4f} ({r['ours_s']:.1f} s)"
            ref = f"one process, batch {r['virtual_batch_size']}: {r['local_loss']:.4f}"
            ratio = f"{r['relative_difference'] * 100:+.2f}% (within 2%)"
        print(f"| {what} | {ours} | {ref} | {ratio} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small figures in ~2 minutes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sizes", default="65536,4194304")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--gloo-iters", type=int, default=50)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--throughput-size", type=int, default=65536)
    parser.add_argument("--throughput-delay", type=float, default=45.0)
    parser.add_argument("--conv-peers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--profile",
        default=None,
        help="latency: time each peer's all-reduce and write cProfile stats to PREFIX.SIZE.PEER",
    )
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--no-convergence", action="store_true")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.rounds, args.gloo_iters, args.duration = 30, 20, 10.0
        args.steps, args.eval_every = 30, 10
        args.sizes = [s for s in args.sizes if s <= 1 << 20] or [65536]
    if args.peers < 2 or args.conv_peers < 2:
        parser.error("--peers and --conv-peers must be >= 2")
    if args.gloo_iters + min(args.warmup, 5) > 60:
        parser.error("--gloo-iters must be <= 55 (gloo sums ones in place: 4**60 nears inf)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    loads = {"before": load()}
    progress(f"load averages before: {loads['before']}")
    if not args.no_latency:
        latency(args, rows, raw)
    if not args.no_throughput:
        throughput(args, rows, raw)
    if not args.no_convergence:
        convergence(args, rows, raw)
    loads["after"] = load()
    print_table(rows, loads)
    if args.out is not None:
        meta = {
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load": loads,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
