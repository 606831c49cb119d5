"""DHT time: the clock that DHT expirations are written in."""

from __future__ import annotations

import asyncio
import time

import anyio

__all__ = ["get_dht_time", "loop_time"]


def loop_time() -> float:
    """``anyio.current_time()`` (the event loop's clock, which deadlines and timeouts use) that
    may also be called from a raw event-loop callback: a socket reader (``add_reader``), a
    ``call_soon`` or a timer callback, as the transports run their readers and the RPC layer's
    inline handlers.

    anyio < 4.16 cannot tell the async library there (no task is running) and raises
    ``sniffio.AsyncLibraryNotFoundError``; on asyncio its clock is the loop's ``time()``,
    which this reads directly (also on :class:`swarmavg.testing.VirtualClockLoop`).
    """
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.time()
    return anyio.current_time()  # (trio: its callbacks are tasks)


def get_dht_time() -> float:
    """Seconds since the Unix epoch (wall-clock time, comparable across machines up to their
    clock skew): expirations of DHT records are absolute times on this clock.

    On a :class:`swarmavg.testing.VirtualClockLoop` (a simulation on virtual time) it follows
    that loop's clock instead."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        virtual = getattr(loop, "dht_time", None)
        if virtual is not None:
            return float(virtual())
    return time.time()
