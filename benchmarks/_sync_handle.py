"""Round-trip cost of a no-op call through the swarmavg loop thread, against bare asyncio.

Variants, measured in the same run, in blocks of calls whose order rotates every round so that
drift (CPU frequency, other load) hits all of them alike:

* ``reference``: ``asyncio.run_coroutine_threadsafe(noop(), loop).result()`` against a bare
  asyncio loop running in a thread.
* ``sync … run_sync``: ``swarmavg.sync.run_sync(noop)``.
* ``sync … start_soon().result()``: ``swarmavg.sync.start_soon(noop).result()``.
* ``anyio … BlockingPortal.call``: ``get_portal().call(noop)``, for context (anyio's own bridge
  spawns each task with an extra blocking round trip).
* ``control``: the reference's code path aimed at the swarmavg loop thread. It separates what
  our code costs from where the scheduler happened to put our thread.

Each is measured twice. ``[one CPU]``: the calling thread and both loop threads are pinned to one
CPU, so a round trip is two same-core context switches and the figure compares code paths.
``[any CPU]``: the scheduler places the threads, as in real use. On small VMs the cross-CPU
wake-up latency of an idle vCPU dominates and can differ between two identical bare asyncio loop
threads by 2-3×; the blocks are long so that placement settles, and the control row shows how
much of a difference is placement. Pinning needs Linux (``os.sched_setaffinity``); elsewhere only
``[any CPU]`` is measured.

The target is ``ratio`` (a row's median over the reference median in the same placement) ≤ 2.

Run: ``python benchmarks/_sync_handle.py [--iterations N] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import swarmavg.sync
from swarmavg.sync import _loop

REFERENCE = "reference no-op run_coroutine_threadsafe"
CONTROL = "control no-op run_coroutine_threadsafe on swarmavg loop"


async def _noop() -> None:
    pass


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _pin(threads: list[threading.Thread], cpus: set[int]) -> None:
    if not cpus or not hasattr(os, "sched_setaffinity"):
        raise ValueError("CPU affinity is not available here")
    for thread in threads:
        if thread.native_id is not None:
            os.sched_setaffinity(thread.native_id, cpus)


def _sample(variants: dict[str, Callable[[], object]], iterations: int) -> dict[str, list[float]]:
    for _ in range(max(50, iterations // 10)):  # warm-up
        for fn in variants.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    # Long blocks: the scheduler needs a few hundred round trips to settle where it places a
    # pair of threads that wake each other; short alternating blocks measure its indecision.
    block = max(1, min(500, iterations // 4))
    clock = time.perf_counter_ns
    for _ in range(-(-iterations // block)):
        order = order[1:] + order[:1]
        for name in order:
            fn, out = variants[name], samples[name]
            for _ in range(block):
                start = clock()
                fn()
                out.append((clock() - start) / 1000)
    return samples


def measure(iterations: int = 2000) -> list[dict[str, object]]:
    """Time about ``iterations`` no-op round trips per variant and placement.

    :returns: one row per variant and placement: ``{"name", "median_us", "p90_us", "ratio"}``,
        ``ratio`` being the row's median over the reference median of the same placement. The
        swarmavg loop is stopped afterwards only if this call started it.
    :raises ValueError: ``iterations`` < 1.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be ≥ 1, got {iterations}")
    loop_was_running = any(t.name == swarmavg.sync.THREAD_NAME for t in threading.enumerate())
    ref_loop = asyncio.new_event_loop()
    ref_thread = threading.Thread(target=ref_loop.run_forever, name="bench-reference-loop")
    ref_thread.start()
    portal = swarmavg.sync.get_portal()
    state = _loop._current_state()
    our_loop = state.loop
    threads = [threading.current_thread(), ref_thread, state.thread]
    variants: dict[str, Callable[[], object]] = {
        REFERENCE: lambda: asyncio.run_coroutine_threadsafe(_noop(), ref_loop).result(),
        "sync no-op run_sync": lambda: swarmavg.sync.run_sync(_noop),
        "sync no-op start_soon().result()": lambda: swarmavg.sync.start_soon(_noop).result(),
        "anyio no-op BlockingPortal.call": lambda: portal.call(_noop),
        CONTROL: lambda: asyncio.run_coroutine_threadsafe(_noop(), our_loop).result(),
    }
    rows: list[dict[str, object]] = []
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        for placement in ("one CPU", "any CPU"):
            pinned = False
            if placement == "one CPU":
                try:
                    _pin(threads, {min(allowed)})
                    pinned = True
                except (ValueError, OSError):  # no affinity API or not permitted: skip
                    continue
            try:
                samples = _sample(variants, iterations)
            finally:
                if pinned:
                    _pin(threads, allowed)
            reference = statistics.median(samples[REFERENCE])
            rows.extend(
                {
                    "name": f"{name} [{placement}]",
                    "median_us": round(statistics.median(values), 2),
                    "p90_us": round(_percentile(values, 0.9), 2),
                    "ratio": round(statistics.median(values) / reference, 3),
                }
                for name, values in samples.items()
            )
    finally:
        ref_loop.call_soon_threadsafe(ref_loop.stop)
        ref_thread.join()
        ref_loop.close()
        if not loop_was_running:
            swarmavg.sync.shutdown_loop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="No-op round trips: swarmavg.sync vs asyncio.")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = measure(args.iterations)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'name':<62} {'median µs':>10} {'p90 µs':>10} {'ratio':>7}")
    for row in rows:
        print(f"{row['name']:<62} {row['median_us']:>10} {row['p90_us']:>10} {row['ratio']:>7}")


if __name__ == "__main__":
    main()
