"""Group keys, leaders and Moshpit group bits (sans-IO).

Peers that want to average declare themselves in the DHT under a *group key*
``<prefix>.0b<bits>``. Among the declared peers the *leader* is the one with the earliest
declared expiration (ties: the smaller PeerID); every other peer asks a better-ranked peer to
take it in, so all of a key's peers converge on one leader.

Moshpit: after a round, each member moves to a new key. With ``k = ⌈log2 g⌉`` bits per group of
``g``, a member drops the first ``k`` bits of its key and appends ``k`` bits of its own, distinct
within the group: its index in the group, permuted by a generator seeded with the group id (so
the new keys do not depend on who sorted first, and members of different groups mix). Peers on
a grid (``N = g^d`` peers, keys of ``(d - 1)·k`` bits, one full group per key) then average along
one grid dimension per round and reach the exact global mean after ``d`` rounds.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable
from typing import Final

from swarmavg.identity import PeerID

__all__ = ["choose_leader", "group_key", "next_group_bits", "validate_bits"]

_BITS: Final = re.compile(r"[01]*")
_MAX_BITS: Final = 64
_MAX_PREFIX: Final = 128


def validate_bits(bits: str) -> str:
    """``bits`` if it is a string of at most 64 '0'/'1' characters.

    :raises TypeError: not a str.
    :raises ValueError: other characters, or too long.
    """
    if not isinstance(bits, str):
        raise TypeError(f"group bits are a str of '0' and '1', not {type(bits).__name__}")
    if not _BITS.fullmatch(bits) or len(bits) > _MAX_BITS:
        raise ValueError(f"group bits are at most {_MAX_BITS} '0'/'1' characters, not {bits!r}")
    return bits


def group_key(prefix: str, bits: str) -> str:
    """The DHT key under which peers with ``bits`` look for a group."""
    if not isinstance(prefix, str) or not prefix or len(prefix) > _MAX_PREFIX:
        raise ValueError(f"prefix must be a non-empty str of <= {_MAX_PREFIX} characters")
    return f"{prefix}.0b{validate_bits(bits)}"


def choose_leader(
    candidates: Iterable[tuple[PeerID, float]], me: PeerID, my_expiration: float
) -> PeerID | None:
    """The peer to ask to lead us: the best-ranked candidate (earliest expiration, then
    smallest PeerID) that ranks better than we do; ``None`` if we rank first (we lead)."""
    mine = (my_expiration, me.to_bytes())
    best: tuple[float, bytes] | None = None
    leader: PeerID | None = None
    for peer, expiration in candidates:
        if peer == me or not math.isfinite(expiration):
            continue
        rank = (expiration, peer.to_bytes())
        if rank < mine and (best is None or rank < best):
            best, leader = rank, peer
    return leader


def next_group_bits(bits: str, group_id: bytes, index: int, group_size: int) -> str:
    """The key bits a member moves to after a round (see the module docstring): ``bits``
    shifted by ``⌈log2 group_size⌉`` and ended by that many bits distinct within the group."""
    validate_bits(bits)
    if not 0 <= index < group_size:
        raise ValueError(f"index {index} is not in a group of {group_size}")
    if not bits:
        return bits
    width = min(max(1, math.ceil(math.log2(group_size))) if group_size > 1 else 0, len(bits))
    if width == 0:
        return bits
    slots = random.Random(group_id).sample(range(1 << width), min(group_size, 1 << width))
    own = slots[index % len(slots)]
    return bits[width:] + format(own, f"0{width}b")
