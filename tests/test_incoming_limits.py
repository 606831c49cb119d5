"""IncomingLimits (swarmavg.abc): what transports count their incoming connections with."""

from __future__ import annotations

from typing import Any

from swarmavg.abc import IncomingLimits
from swarmavg.identity import Identity


class _Conn:
    def __init__(self, peer: Any) -> None:
        self.peer_id = peer


def test_limits_per_peer_and_in_all() -> None:
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    limits = IncomingLimits(per_peer=2, total=3)
    first, second, third = _Conn(a), _Conn(a), _Conn(b)
    assert limits.refusal(a) is None
    limits.admit(first)  # type: ignore[arg-type]
    limits.admit(second)  # type: ignore[arg-type]
    assert "already holds 2" in (limits.refusal(a) or "")
    assert limits.refusal(b) is None
    limits.admit(third)  # type: ignore[arg-type]
    assert "3 incoming connections already" in (limits.refusal(b) or "")
    assert (limits.total, limits.count(a), limits.count(b)) == (3, 2, 1)
    limits.release(first)  # type: ignore[arg-type]
    limits.release(first)  # type: ignore[arg-type]  # twice: counted once
    limits.release(_Conn(b))  # type: ignore[arg-type]  # never admitted: nothing
    assert (limits.total, limits.count(a), limits.count(b)) == (2, 1, 1)
    assert limits.refusal(a) is None
