"""The reference of ``benchmarks/averaging.py``: torch.distributed gloo ``all_reduce`` on loopback.

:func:`rank_main` is one rank, a process of its own ("spawn"): ``torch.set_num_threads(1)``,
``init_process_group("gloo", init_method="tcp://127.0.0.1:<port>")``, one float32 tensor of
``size`` elements, ``warmup`` untimed ``all_reduce`` calls, then ``iters`` times: ``barrier()``,
then ``all_reduce(SUM)`` timed on every rank with ``perf_counter`` and this process's CPU time
(``process_time``: all its threads, gloo's included). An iteration's time is the max over ranks,
its CPU the sum over ranks. Machine-wide busy CPU (``/proc/stat``) is read by rank 0 before
and after the timed loop (barriers included) and divided by ``iters``; less the ranks' own CPU
over the loop, it is the load from elsewhere. Rank 0 sends the figures to the driver over
``conn``; each rank then exits at once (``os._exit``) after ``destroy_process_group()``.

The values are all 1 and are summed in place, so they grow by a factor ``world`` per call: the
driver keeps ``warmup + iters`` small enough that they stay finite.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from _averaging_common import machine_busy_seconds


def rank_main(
    rank: int,
    world: int,
    port: int,
    size: int,
    iters: int,
    warmup: int,
    timeout: float,
    conn: Connection,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver ends us
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    begin = time.perf_counter()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        dist.barrier()
        init_s = time.perf_counter() - begin
        x = torch.ones(size, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(x)
        times = torch.zeros(iters, dtype=torch.float64)
        cpus = torch.zeros(iters, dtype=torch.float64)
        kernel = torch.zeros(iters, dtype=torch.float64)  # (the kernel's part of cpus)
        dist.barrier()
        busy0 = machine_busy_seconds()
        loop_cpu = time.process_time()
        loop_wall = time.perf_counter()
        for i in range(iters):
            dist.barrier()
            cpu = time.process_time()
            sys0 = os.times().system
            t = time.perf_counter()
            dist.all_reduce(x)
            times[i] = time.perf_counter() - t
            cpus[i] = time.process_time() - cpu
            kernel[i] = os.times().system - sys0
        dist.barrier()
        busy1 = machine_busy_seconds()
        loop = torch.tensor([time.process_time() - loop_cpu], dtype=torch.float64)
        loop_wall = time.perf_counter() - loop_wall
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpus, op=dist.ReduceOp.SUM)
        dist.all_reduce(kernel, op=dist.ReduceOp.SUM)
        dist.all_reduce(loop, op=dist.ReduceOp.SUM)
        if rank == 0:
            machine = None if busy0 is None or busy1 is None else busy1 - busy0
            out: dict[str, Any] = {
                "init_s": init_s,
                "times_s": times.tolist(),
                "cpu_s": cpus.tolist(),
                "cpu_sys_s": kernel.tolist(),
                "finite": bool(torch.isfinite(x).all()),
                "machine_cpu_s": None if machine is None else machine / iters,
                # busy CPU of processes other than the ranks (load from elsewhere) per call, and
                # per second of the timed loop
                "foreign_cpu_s": None if machine is None else (machine - float(loop)) / iters,
                "foreign_per_s": None if machine is None else (machine - float(loop)) / loop_wall,
            }
            conn.send(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        conn.close()
    # done and shut down: skip the interpreter's teardown (torch's is slow on a loaded machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
