"""Group keys, leader choice and Moshpit group bits."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from swarmavg.identity import PeerID
from swarmavg.proto.matchmaking import choose_leader, group_key, next_group_bits, validate_bits


def _peer(rng: random.Random) -> PeerID:
    return PeerID.from_public_key(rng.randbytes(32))


def test_group_keys_and_bits_are_checked() -> None:
    assert group_key("run", "0110") == "run.0b0110"
    assert group_key("run", "") == "run.0b"
    for bad in ("012", "0b01", "1" * 65):
        with pytest.raises(ValueError, match="bits"):
            validate_bits(bad)
    with pytest.raises(TypeError):
        validate_bits(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix"):
        group_key("", "01")


def test_the_leader_is_the_earliest_then_the_smallest_peer() -> None:
    rng = random.Random(0)
    a, b, c = sorted(_peer(rng) for _ in range(3))
    assert choose_leader([(a, 10.0), (b, 5.0), (c, 5.0)], me=c, my_expiration=5.0) == b
    assert choose_leader([(a, 10.0), (b, 5.0)], me=c, my_expiration=4.0) is None
    assert choose_leader([(a, 10.0)], me=a, my_expiration=10.0) is None  # ourselves
    assert choose_leader([(b, float("nan")), (a, 7.0)], me=c, my_expiration=8.0) == a


def test_every_peer_of_a_key_picks_the_same_leader_or_leads() -> None:
    rng = random.Random(1)
    peers = [(_peer(rng), rng.choice([1.0, 2.0, 3.0])) for _ in range(20)]
    leaders = {choose_leader(peers, me, expiration) for me, expiration in peers}
    best = min(peers, key=lambda p: (p[1], p[0].to_bytes()))[0]
    assert leaders == {best, None}
    assert choose_leader(peers, best, dict(peers)[best]) is None


def test_new_bits_are_distinct_within_a_group() -> None:
    for size in (2, 3, 4, 8, 16):
        group_id = os.urandom(16)
        new = {next_group_bits("1011001", group_id, i, size) for i in range(size)}
        assert len(new) == size
        width = max(1, (size - 1).bit_length())
        assert all(bits.startswith("1011001"[width:]) for bits in new)
    assert next_group_bits("", b"id", 0, 4) == ""
    with pytest.raises(ValueError, match="index"):
        next_group_bits("01", b"id", 4, 4)


def _simulate(peers: int, group_size: int, bits: int, rounds: int, seed: int) -> list[float]:
    """Spread (max - min) after each round of peers on a grid that average in their key's
    group, the group's members ordered by PeerID."""
    rng = random.Random(seed)
    ids = [_peer(rng) for _ in range(peers)]
    keys = {p: format(i // group_size, f"0{bits}b") if bits else "" for i, p in enumerate(ids)}
    values = {p: np.float64(rng.gauss(0, 1)) for p in ids}
    mean = np.mean(list(values.values()))
    spreads = []
    for _ in range(rounds):
        groups: dict[str, list[PeerID]] = {}
        for p in ids:
            groups.setdefault(keys[p], []).append(p)
        for members in groups.values():
            members.sort()
            group_mean = np.mean([values[p] for p in members])
            group_id = rng.randbytes(16)
            for index, p in enumerate(members):
                values[p] = group_mean
                keys[p] = next_group_bits(keys[p], group_id, index, len(members))
        assert np.isclose(np.mean(list(values.values())), mean)  # the mean is preserved
        spreads.append(max(values.values()) - min(values.values()))
    return spreads


@pytest.mark.parametrize(
    ("peers", "group_size", "bits", "rounds"),
    [(8, 2, 2, 3), (128, 2, 6, 7), (64, 4, 4, 3), (64, 8, 3, 2), (16, 16, 0, 1)],
)
def test_a_grid_reaches_the_exact_mean_in_as_many_rounds_as_dimensions(
    peers: int, group_size: int, bits: int, rounds: int
) -> None:
    spreads = _simulate(peers, group_size, bits, rounds, seed=peers + group_size)
    assert spreads[-1] < 1e-9
    if rounds > 1:
        assert spreads[-2] > 1e-3  # and not before
