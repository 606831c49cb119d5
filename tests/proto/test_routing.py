"""The Kademlia routing table (sans-IO)."""

from __future__ import annotations

import random

import pytest

from swarmavg.identity import Identity, PeerID
from swarmavg.proto.routing import MAX_ID, KBucket, RoutingTable, distance, node_id


def _peers(n: int) -> list[PeerID]:
    return [Identity.generate().peer_id for _ in range(n)]


@pytest.fixture(scope="module")
def ten_thousand() -> list[PeerID]:
    return _peers(10_000)


def _check_partition(table: RoutingTable) -> None:
    """Buckets are contiguous, sorted, cover the id space, and hold only ids of their range."""
    assert table.buckets[0].lower == 0
    assert table.buckets[-1].upper == MAX_ID
    for before, after in zip(table.buckets, table.buckets[1:], strict=False):
        assert before.upper == after.lower
    for bucket in table.buckets:
        assert len(bucket.peers) <= bucket.size
        assert len(bucket.replacements) <= bucket.size
        assert bucket.upper - bucket.lower == MAX_ID >> bucket.depth
        for nid in [*bucket.peers.values(), *bucket.replacements.values()]:
            assert nid in bucket
    assert len(table) == sum(len(b) for b in table.buckets)
    in_buckets = {peer: nid for b in table.buckets for peer, nid in b.peers.items()}
    assert set(table) == set(in_buckets)
    assert [p for p, _ in table.nearest(0, len(in_buckets))] == sorted(
        in_buckets, key=in_buckets.get
    )


def test_node_ids_are_the_sha256_of_the_peer_id() -> None:
    peer = Identity.generate().peer_id
    nid = node_id(peer)
    assert nid == int.from_bytes(peer.digest(), "big")
    assert 0 <= nid < MAX_ID
    assert distance(nid, nid) == 0
    other = node_id(Identity.generate().peer_id)
    assert distance(nid, other) == distance(other, nid) > 0


def test_ten_thousand_nodes(ten_thousand: list[PeerID]) -> None:
    me = Identity.generate().peer_id
    own = node_id(me)
    table = RoutingTable(own, k=20, depth_modulo=5)
    for i, peer in enumerate(ten_thousand):
        table.add_or_update(peer, now=float(i))
    _check_partition(table)
    # 32 ranges of depth 5 (each 1/32 of the id space, ~312 of the peers): the 31 that do not
    # hold our id stay whole (5 % 5 == 0) and full; ours splits on (relaxed rule, then because
    # it holds our id) into small ranges that keep nearly every peer in them
    depth5 = [b for b in table.buckets if b.depth == 5]
    assert len(depth5) == 31
    assert all(b.is_full for b in depth5)
    assert all(b.depth > 5 for b in table.buckets if b not in depth5)
    assert 40 <= len(table.buckets) <= 80, len(table.buckets)
    near = [p for p in ten_thousand if (node_id(p) ^ own) >> (256 - 5) == 0]
    kept = sum(1 for p in near if p in table)
    assert kept >= 0.95 * len(near), (kept, len(near))
    # the k peers nearest to us are known, but for those in a full bucket that cannot split (a
    # sibling of ours at a depth that is a multiple of depth_modulo: with random ids, one in a
    # few hundred tables draws more than k peers into such a bucket near us)
    brute = sorted(ten_thousand, key=lambda p: node_id(p) ^ own)[:20]
    for peer in brute:
        bucket = table.bucket_for(node_id(peer))
        assert peer in table or (bucket.is_full and own not in bucket and bucket.depth % 5 == 0), (
            peer,
            bucket,
        )
    assert sum(peer in table for peer in brute) >= 15


def test_nearest_equals_brute_force(ten_thousand: list[PeerID]) -> None:
    rng = random.Random(7)
    table = RoutingTable(node_id(Identity.generate().peer_id), k=20)
    for peer in ten_thousand[:3000]:
        table.add_or_update(peer)
    known = list(table)
    for _ in range(50):
        target = rng.randrange(MAX_ID)
        count = rng.choice([1, 5, 20, 50])
        expected = sorted(known, key=lambda p: node_id(p) ^ target)[:count]
        got = [peer for peer, _ in table.nearest(target, count)]
        assert got == expected
    # the caller is left out
    target = node_id(known[0])
    assert table.nearest(target, 1)[0][0] == known[0]
    assert known[0] not in [p for p, _ in table.nearest(target, 5, exclude=known[0])]
    # after removals (replacements move in) and with an unknown peer to leave out
    for peer in rng.sample(known, 300):
        assert table.remove(peer)
    known = list(table)
    stranger = ten_thousand[-1]
    assert stranger not in table
    for _ in range(50):
        target = rng.randrange(MAX_ID)
        count = rng.choice([1, 5, 20, len(known) + 5])
        expected = sorted(known, key=lambda p: node_id(p) ^ target)
        assert [p for p, _ in table.nearest(target, count)] == expected[:count]
        assert [p for p, _ in table.nearest(target, count, exclude=stranger)] == expected[:count]
        without = [p for p in expected if p != expected[0]][:count]
        assert [p for p, _ in table.nearest(target, count, exclude=expected[0])] == without
        assert all(nid == node_id(p) for p, nid in table.nearest(target, count))
    _check_partition(table)


def test_a_full_bucket_returns_its_least_recently_seen_peer_to_ping() -> None:
    # ids far from ours, all in the one bucket that does not split: depth 1, 1 % 1 == 0
    own = 0
    table = RoutingTable(own, k=3, depth_modulo=1)
    far = [p for p in _peers(400) if node_id(p) >= MAX_ID // 2][:6]
    a, b, c, d, e, f = far
    for t, peer in enumerate((a, b, c)):
        assert table.add_or_update(peer, now=t) is None
    assert table.add_or_update(a, now=3) is None  # seen again: now the most recent
    assert table.add_or_update(d, now=4) == b  # full: ping b, the least recently seen
    assert d not in table
    bucket = table.bucket_for(node_id(d))
    assert list(bucket.replacements) == [d]
    assert table.add_or_update(e, now=5) == b
    # b did not answer: it goes, and the most recent replacement takes its place
    assert table.remove(b)
    assert b not in table
    assert e in table
    assert list(bucket.peers) == [c, a, e]
    assert list(bucket.replacements) == [d]
    assert not table.remove(b)
    assert table.remove(d)  # from the replacement cache
    assert not bucket.replacements
    # replacements are bounded by k, the oldest go first
    for peer in (f, *[p for p in _peers(400) if node_id(p) >= MAX_ID // 2][:5]):
        table.add_or_update(peer)
    assert len(bucket.replacements) == 3
    _check_partition(table)


def test_splitting_shares_out_peers_and_keeps_their_recency() -> None:
    bucket = KBucket(0, MAX_ID, 4)
    peers = _peers(6)
    for peer in peers:
        bucket.peers[peer] = node_id(peer)
    low, high = bucket.split()
    assert low.depth == high.depth == 1
    assert list(low.peers) + list(high.peers) != []
    for half in (low, high):
        order = [p for p in peers if p in half.peers]
        assert list(half.peers) == order


def test_ourselves_and_bad_arguments() -> None:
    me = Identity.generate().peer_id
    table = RoutingTable(node_id(me))
    assert table.add_or_update(me) is None
    assert me not in table
    assert table.nearest(0, 0) == []
    with pytest.raises(ValueError, match="own_id"):
        RoutingTable(-1)
    with pytest.raises(ValueError, match="k"):
        RoutingTable(0, k=0)
    with pytest.raises(ValueError, match="depth_modulo"):
        RoutingTable(0, depth_modulo=0)


def test_stale_buckets_and_random_ids_in_them() -> None:
    table = RoutingTable(0, k=2)
    for t, peer in enumerate(_peers(40)):
        table.add_or_update(peer, now=float(t))
    stale = table.stale_buckets(now=100.0, period=70.0)
    assert stale
    assert all(b.last_updated <= 30.0 for b in stale)
    rng = random.Random(1)
    for bucket in table.buckets:
        assert table.random_id_in(bucket, rng) in bucket
