"""One rank of ``benchmarks/network.py``'s gloo reference, started inside a network-lab host.

``torch.distributed`` gloo over the lab: ``init_process_group("gloo",
init_method="tcp://<rank 0's lab address>:<port>")`` with ``GLOO_SOCKET_IFNAME=eth0`` (the
host's only interface), one float32 tensor of ``--size`` elements, ``--warmup`` untimed
``all_reduce(SUM)`` calls, then ``--rounds`` times ``barrier()`` + a timed ``all_reduce``.
A round's time is the max over ranks (``all_reduce`` of the times with ``MAX``). Rank 0 prints
one JSON line ``{"times_s": [...], "cpu_s": [...], "finite": bool}`` (``cpu_s``: this
process's CPU seconds per call, summed over ranks). ``--timeout`` bounds every collective
(gloo raises past it).

The tensor is all 1 and summed in place, so it grows by ``world`` per call: the driver keeps
``warmup + rounds`` small.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        x = torch.ones(args.size, dtype=torch.float32)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        times = torch.zeros(args.rounds, dtype=torch.float64)
        cpus = torch.zeros(args.rounds, dtype=torch.float64)
        for i in range(args.rounds):
            dist.barrier()
            cpu = time.process_time()
            t = time.perf_counter()
            dist.all_reduce(x)
            times[i] = time.perf_counter() - t
            cpus[i] = time.process_time() - cpu
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpus, op=dist.ReduceOp.SUM)
        expected = float(args.world) ** (args.warmup + args.rounds)
        if args.rank == 0:
            out = {
                "times_s": times.tolist(),
                "cpu_s": cpus.tolist(),
                "finite": bool(torch.isfinite(x).all()),
                "exact": bool((x == expected).all()),
            }
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
