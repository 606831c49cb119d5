"""Per-peer bookkeeping of a DHT node (sans-IO): a blacklist with exponential backoff, and the
abuse limits on what one peer may store here.

Nothing here reads a clock; callers pass ``now`` (any monotonic-enough seconds).

* :class:`Blacklist`: a peer that failed to answer is not asked again (nor put back in the
  routing table) for ``base_delay`` seconds, doubling (``backoff``) with each failure in a row
  up to ``max_delay``; an answer clears its record.
* :class:`StoreQuota`: each peer may have at most ``max_records`` unexpired records stored on
  this node by its requests, and store at most ``rate`` records a second (a token bucket holding
  ``burst``). Records a peer overwrote still count until they would have expired: the bound is
  conservative, and cheap to keep.

Both are bounded in memory however many peers show up: past ``max_peers`` the entries that
matter least (the stalest ban, the emptiest quota) are dropped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

__all__ = ["Blacklist", "StoreQuota"]

_P = TypeVar("_P")

_DEFAULT_MAX_PEERS: Final = 65_536


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, not {value!r}")
    return float(value)


@dataclass
class _Ban:
    failures: int
    until: float


class Blacklist(Generic[_P]):
    """Peers that failed recently, each banned for a delay that doubles with every failure."""

    def __init__(
        self,
        base_delay: float = 5.0,
        backoff: float = 2.0,
        max_delay: float = 600.0,
        max_peers: int = _DEFAULT_MAX_PEERS,
    ) -> None:
        self.base_delay = _positive("base_delay", base_delay)
        self.backoff = _positive("backoff", backoff)
        self.max_delay = _positive("max_delay", max_delay)
        self.max_peers = int(_positive("max_peers", max_peers))
        self._bans: dict[_P, _Ban] = {}

    def __len__(self) -> int:
        return len(self._bans)

    def failed(self, peer: _P, now: float) -> float:
        """``peer`` failed at ``now``: ban it (longer if it failed before); the ban's length."""
        ban = self._bans.pop(peer, None)  # re-inserted last: dict order is staleness order
        failures = 1 if ban is None else ban.failures + 1
        delay = min(self.base_delay * self.backoff ** min(failures - 1, 64), self.max_delay)
        self._bans[peer] = _Ban(failures, now + delay)
        while len(self._bans) > self.max_peers:
            del self._bans[next(iter(self._bans))]
        return delay

    def succeeded(self, peer: _P) -> None:
        """``peer`` answered: forget its failures."""
        self._bans.pop(peer, None)

    def is_banned(self, peer: _P, now: float) -> bool:
        ban = self._bans.get(peer)
        return ban is not None and now < ban.until

    def failures(self, peer: _P) -> int:
        """Failures in a row of ``peer`` (0 if none recorded)."""
        ban = self._bans.get(peer)
        return 0 if ban is None else ban.failures


@dataclass
class _Account:
    tokens: float
    updated: float
    expirations: list[float] = field(default_factory=list)  # min-heap


class StoreQuota(Generic[_P]):
    """How many records each peer may store here, and how fast."""

    def __init__(
        self,
        max_records: int = 10_000,
        rate: float = 100.0,
        burst: float = 512.0,
        max_peers: int = _DEFAULT_MAX_PEERS,
    ) -> None:
        self.max_records = int(_positive("max_records", max_records))
        self.rate = _positive("rate", rate)
        self.burst = _positive("burst", burst)
        self.max_peers = int(_positive("max_peers", max_peers))
        self._accounts: dict[_P, _Account] = {}

    def admit(self, peer: _P, count: int, now: float) -> int:
        """How many of ``count`` records ``peer`` may store at ``now`` (spends the rate tokens;
        call :meth:`stored` for those that were accepted)."""
        account = self._accounts.get(peer)
        if account is None:
            account = self._accounts[peer] = _Account(self.burst, now)
            if len(self._accounts) > self.max_peers:
                self._evict()
        account.tokens = min(self.burst, account.tokens + (now - account.updated) * self.rate)
        account.updated = max(account.updated, now)
        heap = account.expirations
        while heap and heap[0] <= now:
            heapq.heappop(heap)
        allowed = max(0, min(count, int(account.tokens), self.max_records - len(heap)))
        account.tokens -= allowed
        return allowed

    def stored(self, peer: _P, expiration_time: float) -> None:
        """A record of ``peer``'s that lives until ``expiration_time`` was accepted."""
        account = self._accounts.get(peer)
        if account is not None:
            heapq.heappush(account.expirations, expiration_time)

    def records(self, peer: _P, now: float) -> int:
        """Unexpired records counted against ``peer``."""
        account = self._accounts.get(peer)
        return 0 if account is None else sum(1 for e in account.expirations if e > now)

    def _evict(self) -> None:
        # Drop the peers with the fewest records counted (first those with none).
        surplus = len(self._accounts) - self.max_peers
        for peer in heapq.nsmallest(
            surplus, self._accounts, key=lambda p: len(self._accounts[p].expirations)
        ):
            del self._accounts[peer]
