"""DHT time: the clock that DHT expirations are written in."""

from __future__ import annotations

import asyncio
import time

__all__ = ["get_dht_time"]


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
