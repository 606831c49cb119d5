"""The iterative Kademlia lookup as a sans-IO state machine (a beam search over node ids).

To find the peers nearest to a target id (or a value stored there), a node asks the ``alpha``
nearest peers it knows for *their* nearest peers, merges the answers into a beam of the ``k``
nearest candidates seen so far, and keeps asking the nearest candidates it has not asked yet.
It stops when the ``k`` nearest candidates have all answered (or failed and been replaced), or,
for a value lookup, as soon as a value is found, unless the caller wants the *latest* value, in
which case the lookup finishes the beam and the caller keeps the newest value seen.

The machine does no I/O and reads no clock. The caller drives it::

    lookup = Lookup(target, k=20, alpha=3)
    lookup.add_candidates(routing_table.nearest(target, k))
    while not lookup.finished:
        for peer in lookup.next_queries():
            ...send a find request to peer (at most alpha in flight)...
        ...on an answer:  lookup.on_response(peer, nearest=[(peer, node_id), ...], found=...)
        ...on a failure:  lookup.on_failure(peer)
    lookup.nearest_responded()   # the k nearest peers that answered: where to store

Answers can only add candidates, never remove them, so a lying peer can waste queries but
not hide honest peers that another answer names.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable
from enum import Enum
from typing import Final

from swarmavg.identity import PeerID

__all__ = ["Lookup", "PeerState"]

_MAX_CANDIDATES_PER_ANSWER: Final = 64


class PeerState(Enum):
    """Where a candidate is in the lookup."""

    NEW = "new"
    IN_FLIGHT = "in flight"
    RESPONDED = "responded"
    FAILED = "failed"


_NEW: Final = PeerState.NEW
_IN_FLIGHT: Final = PeerState.IN_FLIGHT
_RESPONDED: Final = PeerState.RESPONDED
_FAILED: Final = PeerState.FAILED


class _Candidate:
    """One peer of the lookup: its distance to the target and where it is. The ranking holds
    these, so that scanning the beam reads attributes rather than hashing PeerIDs (a Python
    ``__hash__`` each: ~150 per latest get, when the beam was scanned through a dict)."""

    __slots__ = ("distance", "peer", "state")

    def __init__(self, distance: int, peer: PeerID, state: PeerState) -> None:
        self.distance = distance
        self.peer = peer
        self.state = state


#: the ranking's key (C, not a Python function: bisect calls it at every step)
_distance: Final = operator.attrgetter("distance")


class Lookup:
    """One iterative lookup of ``target``.

    :param target: the node id (or key id) looked up.
    :param k: beam width: how many nearest peers must answer before the lookup ends.
    :param alpha: queries in flight at once.
    :param stop_on_value: end as soon as some peer reports a value (``False``: finish the beam
        to find the latest).
    :param exclude: peers never to query (ourselves).
    """

    def __init__(
        self,
        target: int,
        *,
        k: int = 20,
        alpha: int = 3,
        stop_on_value: bool = True,
        exclude: Iterable[PeerID] = (),
    ) -> None:
        for name, value in (("k", k), ("alpha", alpha)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.target = target
        self.k = k
        self.alpha = alpha
        self.stop_on_value = stop_on_value
        self._excluded = set(exclude)
        self._candidates: dict[PeerID, _Candidate] = {}
        #: every candidate that has not failed, nearest first (the beam is its first k)
        self._ranked: list[_Candidate] = []
        self._in_flight = 0
        self.value_found = False
        self.queries = 0  # requests handed out so far

    # -- input -----------------------------------------------------------------------------------

    def add_candidates(self, peers: Iterable[tuple[PeerID, int]]) -> None:
        """Peers (with their node ids) that might be near the target."""
        candidates = self._candidates
        excluded = self._excluded
        ranked = self._ranked
        target = self.target
        for count, (peer, nid) in enumerate(peers):
            if count >= _MAX_CANDIDATES_PER_ANSWER:
                break  # an answer naming thousands of peers costs us no more than 64
            if peer in candidates or peer in excluded:
                continue
            candidate = _Candidate(nid ^ target, peer, _NEW)
            candidates[peer] = candidate
            bisect.insort(ranked, candidate, key=_distance)

    def add_responded(self, peer: PeerID, nid: int) -> None:
        """A peer whose answer is already in hand and that is never asked: the node itself,
        whose own storage the caller has read. It takes its place in the beam like a peer that
        answered, so a lookup for the ``k`` nearest asks one peer fewer when the node is among
        them (and :meth:`nearest_responded` may name it)."""
        if peer in self._candidates:
            return
        candidate = _Candidate(nid ^ self.target, peer, _RESPONDED)
        self._candidates[peer] = candidate
        bisect.insort(self._ranked, candidate, key=_distance)

    def on_response(
        self, peer: PeerID, nearest: Iterable[tuple[PeerID, int]] = (), *, found: bool = False
    ) -> None:
        """``peer`` answered, naming the peers it knows nearest to the target, and whether it
        holds a value for it."""
        candidate = self._candidates.get(peer)
        if candidate is None or candidate.state is not _IN_FLIGHT:
            return  # not asked, or already settled: ignore
        candidate.state = _RESPONDED
        self._in_flight -= 1
        if found:
            self.value_found = True
        self.add_candidates(nearest)

    def on_failure(self, peer: PeerID) -> None:
        """``peer`` did not answer (timeout, refusal, bad answer): the beam moves past it."""
        candidate = self._candidates.get(peer)
        if candidate is not None and candidate.state is _IN_FLIGHT:
            candidate.state = _FAILED
            self._in_flight -= 1
            ranked = self._ranked
            index = bisect.bisect_left(ranked, candidate.distance, key=_distance)
            while index < len(ranked) and ranked[index].distance == candidate.distance:
                if ranked[index] is candidate:
                    del ranked[index]
                    break
                index += 1

    # -- output ----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def finished(self) -> bool:
        """Whether the lookup is over: a value was found (if that is enough), or every peer of
        the beam answered, or nothing is left to ask."""
        if self.value_found and self.stop_on_value:
            return True
        waiting = False  # a peer of the beam not yet answered
        for candidate in self._ranked[: self.k]:
            state = candidate.state
            if state is _NEW:
                return False  # (there is someone to ask)
            if state is not _RESPONDED:
                waiting = True
        return not waiting or self._in_flight == 0

    def next_queries(self) -> list[PeerID]:
        """The peers to ask now (marked in flight): the nearest new candidates of the beam, so
        that at most ``alpha`` requests are in flight."""
        if self.value_found and self.stop_on_value:
            return []
        room = self.alpha - self._in_flight
        if room <= 0:
            return []
        chosen = []
        for candidate in self._ranked[: self.k]:
            if candidate.state is _NEW:
                candidate.state = _IN_FLIGHT
                chosen.append(candidate.peer)
                if len(chosen) == room:
                    break
        self._in_flight += len(chosen)
        self.queries += len(chosen)
        return chosen

    def nearest_responded(self, count: int | None = None) -> list[PeerID]:
        """Up to ``count`` (default ``k``) peers that answered, nearest to the target first."""
        count = self.k if count is None else count
        answered = [c.peer for c in self._ranked if c.state is _RESPONDED]
        return answered[:count]

    def state(self, peer: PeerID) -> PeerState | None:
        candidate = self._candidates.get(peer)
        return None if candidate is None else candidate.state
