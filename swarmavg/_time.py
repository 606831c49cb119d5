"""DHT time: the clock that DHT expirations are written in."""

from __future__ import annotations

import time

__all__ = ["get_dht_time"]


def get_dht_time() -> float:
    """Seconds since the Unix epoch (wall-clock time, comparable across machines up to their
    clock skew): expirations of DHT records are absolute times on this clock."""
    return time.time()
