"""Kademlia routing (sans-IO): node ids, XOR distance, the k-bucket routing table.

A node id is the SHA-256 of a PeerID (:meth:`PeerID.digest`), read as a 256-bit integer; the
distance between two ids is their XOR. The routing table of a node keeps, for every range of the
id space, up to ``k`` peers it has seen recently, so that it knows many peers close to its own id
and a few far away: a lookup (see the DHT) then halves the distance to any target per step.

Theory of operation
-------------------
The table is a list of :class:`KBucket` s that partition ``[0, 2**256)`` into contiguous ranges,
sorted. A peer goes into the bucket whose range holds its id. A bucket keeps its peers from the
least to the most recently seen. When a peer is seen again it moves to the end. When a new peer
arrives at a full bucket:

* the bucket is **split** in two halves (and the peer tried again) if its range holds our own id,
  or if its depth (the length of its common prefix) is not a multiple of ``depth_modulo``: the
  relaxed rule of the Kademlia paper (section 4.2), which keeps more peers near ranges we often
  look up without letting the table grow without bound;
* otherwise the newcomer waits in the bucket's **replacement cache** (the most recent ``k``), and
  :meth:`RoutingTable.add_or_update` returns the bucket's least recently seen peer: the caller
  pings it and, if it does not answer, calls :meth:`RoutingTable.remove`, which promotes the most
  recent replacement. Long-lived peers are thus preferred, which is what makes Kademlia resist
  churn and flooding with fresh identities.

Nothing here reads a clock: callers pass ``now`` (any monotonic seconds) where recency matters.
"""

from __future__ import annotations

import functools
import random
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator
from typing import Final

from swarmavg.identity import PeerID

__all__ = [
    "ID_BITS",
    "MAX_ID",
    "KBucket",
    "RoutingTable",
    "distance",
    "node_id",
]

#: Bits in a node id.
ID_BITS: Final = 256
#: One past the largest node id.
MAX_ID: Final = 1 << ID_BITS


@functools.lru_cache(maxsize=65536)  # a hash per peer, asked for at every answer
def node_id(peer: PeerID) -> int:
    """The Kademlia id of ``peer``: SHA-256 of its PeerID, as a 256-bit integer."""
    return int.from_bytes(peer.digest(), "big")


def distance(a: int, b: int) -> int:
    """The XOR distance between two node ids."""
    return a ^ b


class KBucket:
    """Up to ``size`` peers whose ids are in ``[lower, upper)``, least recently seen first,
    and up to ``size`` replacements waiting for a place."""

    __slots__ = ("depth", "last_updated", "lower", "peers", "replacements", "size", "upper")

    def __init__(self, lower: int, upper: int, size: int, depth: int = 0) -> None:
        self.lower = lower
        self.upper = upper
        self.size = size
        self.depth = depth  # bits of prefix every id in the range shares
        self.peers: OrderedDict[PeerID, int] = OrderedDict()
        self.replacements: OrderedDict[PeerID, int] = OrderedDict()
        self.last_updated = 0.0

    def __contains__(self, key: int) -> bool:
        """Whether the node id ``key`` falls in this bucket's range."""
        return self.lower <= key < self.upper

    def __len__(self) -> int:
        return len(self.peers)

    def __repr__(self) -> str:
        return (
            f"<KBucket depth={self.depth} [{self.lower:#x}, {self.upper:#x}) "
            f"{len(self.peers)}/{self.size} +{len(self.replacements)}>"
        )

    @property
    def is_full(self) -> bool:
        return len(self.peers) >= self.size

    def least_recently_seen(self) -> PeerID | None:
        return next(iter(self.peers), None)

    def split(self) -> tuple[KBucket, KBucket]:
        """Two buckets for the halves of this range, with the peers and replacements shared
        out by id (the recency order is kept within each)."""
        middle = (self.lower + self.upper) // 2
        low = KBucket(self.lower, middle, self.size, self.depth + 1)
        high = KBucket(middle, self.upper, self.size, self.depth + 1)
        for source, attr in ((self.peers, "peers"), (self.replacements, "replacements")):
            for peer, nid in source.items():
                getattr(low if nid < middle else high, attr)[peer] = nid
        low.last_updated = high.last_updated = self.last_updated
        return low, high


class RoutingTable:
    """The k-bucket routing table of the node whose id is ``own_id``.

    :param own_id: our node id (:func:`node_id` of our PeerID).
    :param k: peers per bucket (Kademlia's k; 20 by default).
    :param depth_modulo: buckets not holding our id are still split while their depth is not a
        multiple of this (Kademlia's b; 5 by default).
    """

    def __init__(self, own_id: int, k: int = 20, depth_modulo: int = 5) -> None:
        if not isinstance(own_id, int) or not 0 <= own_id < MAX_ID:
            raise ValueError(f"own_id must be a {ID_BITS}-bit node id, not {own_id!r}")
        for name, value in (("k", k), ("depth_modulo", depth_modulo)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.own_id = own_id
        self.k = k
        self.depth_modulo = depth_modulo
        self.buckets: list[KBucket] = [KBucket(0, MAX_ID, k)]
        self._lowers: list[int] = [0]  # bucket lower bounds, for bisect
        self._ids: dict[PeerID, int] = {}  # every peer in a bucket (not the replacements)
        self._peers: dict[int, PeerID] = {}  # the same, by node id

    # -- queries ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, peer: object) -> bool:
        return peer in self._ids

    def __iter__(self) -> Iterator[PeerID]:
        return iter(self._ids)

    def bucket_index(self, key: int) -> int:
        """The index in :attr:`buckets` of the bucket whose range holds the id ``key``."""
        return bisect_right(self._lowers, key) - 1

    def bucket_for(self, key: int) -> KBucket:
        return self.buckets[self.bucket_index(key)]

    def nearest(
        self, target: int, count: int | None = None, exclude: PeerID | None = None
    ) -> list[tuple[PeerID, int]]:
        """Up to ``count`` (default ``k``) peers closest to ``target`` by XOR distance, closest
        first, as ``(peer, node id)`` pairs; ``exclude`` (e.g. the peer asking) is left out."""
        count = self.k if count is None else count
        if count <= 0:
            return []
        # distances as plain ints (compared in C), mapped back through the node ids: several
        # times faster than ranking (distance, id, peer) tuples (this runs on every request)
        skip = self._ids.get(exclude) if exclude is not None else None
        wanted = count + (skip is not None)
        # (a table holds at most a few hundred peers: sorting them all in C beats a heap)
        distances = sorted([nid ^ target for nid in self._peers])
        nearest = []
        for distance in distances[:wanted]:
            nid = distance ^ target
            if nid != skip:
                nearest.append((self._peers[nid], nid))
        return nearest[:count]

    def stale_buckets(self, now: float, period: float) -> list[KBucket]:
        """Buckets no peer of which was seen in the last ``period`` seconds (to refresh by a
        lookup of a random id in their range)."""
        return [b for b in self.buckets if now - b.last_updated >= period]

    @staticmethod
    def random_id_in(bucket: KBucket, rng: random.Random | None = None) -> int:
        """A uniformly random node id in ``bucket``'s range."""
        return (rng or random).randrange(bucket.lower, bucket.upper)

    # -- updates ---------------------------------------------------------------------------------

    def add_or_update(self, peer: PeerID, now: float = 0.0) -> PeerID | None:
        """Note that ``peer`` was seen (it answered, or called us) at ``now``.

        :returns: ``None`` if the peer is in the table now (added, or moved to the most recent
            end), or else the least recently seen peer of its full bucket: the caller should
            ping that one and :meth:`remove` it if it does not answer (``peer`` waits in the
            replacement cache meanwhile).
        """
        nid = node_id(peer)
        if nid == self.own_id:
            return None  # ourselves
        while True:
            index = self.bucket_index(nid)
            bucket = self.buckets[index]
            if peer in bucket.peers:
                bucket.peers.move_to_end(peer)
                bucket.last_updated = now
                return None
            if not bucket.is_full:
                bucket.replacements.pop(peer, None)
                bucket.peers[peer] = nid
                self._ids[peer] = nid
                self._peers[nid] = peer
                bucket.last_updated = now
                return None
            splittable = self.own_id in bucket or bucket.depth % self.depth_modulo != 0
            if splittable and bucket.upper - bucket.lower > 1:
                self._split(index)
                continue
            bucket.replacements.pop(peer, None)
            bucket.replacements[peer] = nid
            while len(bucket.replacements) > bucket.size:
                bucket.replacements.popitem(last=False)
            return bucket.least_recently_seen()

    def remove(self, peer: PeerID) -> bool:
        """Drop ``peer`` (it failed); its bucket takes its most recent replacement, if any.

        :returns: whether the peer was in the table (replacement caches included).
        """
        nid = node_id(peer)
        bucket = self.bucket_for(nid)
        if bucket.replacements.pop(peer, None) is not None:
            return True
        if bucket.peers.pop(peer, None) is None:
            return False
        del self._ids[peer]
        del self._peers[nid]
        if bucket.replacements:
            newcomer, newcomer_id = bucket.replacements.popitem(last=True)
            bucket.peers[newcomer] = newcomer_id
            self._ids[newcomer] = newcomer_id
            self._peers[newcomer_id] = newcomer
        return True

    def _split(self, index: int) -> None:
        low, high = self.buckets[index].split()
        for half in (low, high):  # a half with room takes its most recent replacements
            while half.replacements and not half.is_full:
                peer, nid = half.replacements.popitem(last=True)
                half.peers[peer] = nid
                self._ids[peer] = nid
                self._peers[nid] = peer
        self.buckets[index : index + 1] = [low, high]
        self._lowers[index : index + 1] = [low.lower, high.lower]
