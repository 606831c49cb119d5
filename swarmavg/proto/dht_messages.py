"""The DHT's wire messages: bulk ping, store and find (one request carries many keys).

Keys, subkeys and values travel as the msgpack bytes the application's objects serialize to;
a key's place in the id space is :func:`key_id` of those bytes. A request from a node that
others may route to carries its ``sender`` info (PeerID and dialable addresses); a client-mode
node sends ``None`` and is never added to anyone's routing table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from swarmavg.identity import PeerID
from swarmavg.proto.codec import Message, message

__all__ = [
    "ID_BYTES",
    "MAX_ADDRESSES",
    "MAX_KEYS_PER_REQUEST",
    "DHTFindRequest",
    "DHTFindResponse",
    "DHTFound",
    "DHTPeerInfo",
    "DHTPingRequest",
    "DHTPingResponse",
    "DHTStoreRequest",
    "DHTStoreResponse",
    "key_id",
]

#: Keys one store or find request may carry.
MAX_KEYS_PER_REQUEST: Final = 256
#: Bytes of a node id (a find request's targets).
ID_BYTES: Final = 32
#: Addresses one peer may advertise.
MAX_ADDRESSES: Final = 16


def key_id(key: bytes) -> int:
    """Where ``key`` (its serialized bytes) lives in the 256-bit id space."""
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


@message("dht.peer")
@dataclass(frozen=True, slots=True)
class DHTPeerInfo(Message):
    """A peer and the addresses it can be dialed at."""

    peer_id: PeerID
    addresses: list[str]


@message("dht.ping")
@dataclass(frozen=True, slots=True)
class DHTPingRequest(Message):
    """Are you there? (``sender`` is ``None`` for a client-mode node.)"""

    sender: DHTPeerInfo | None


@message("dht.pong")
@dataclass(frozen=True, slots=True)
class DHTPingResponse(Message):
    """Yes; my DHT time (to detect clock skew) and whether I serve requests (client mode:
    no)."""

    dht_time: float
    serving: bool


@message("dht.store")
@dataclass(frozen=True, slots=True)
class DHTStoreRequest(Message):
    """Store these records (parallel lists, one entry a record; ``subkeys[i]`` ``None`` for a
    plain value). ``nearest``: how many peers the answer names at most (0: the node's k; a
    lookup whose beam is narrower than k has no use for more)."""

    sender: DHTPeerInfo | None
    keys: list[bytes]
    subkeys: list[bytes | None]
    values: list[bytes]
    expirations: list[float]
    nearest: int = 0


@message("dht.stored")
@dataclass(frozen=True, slots=True)
class DHTStoreResponse(Message):
    """Which records were accepted, in request order; and the peers the node knows nearest to
    the first key (so that a store is also a step of the lookup for where to store)."""

    accepted: list[bool]
    nearest: list[DHTPeerInfo]


@message("dht.found")
@dataclass(frozen=True, slots=True)
class DHTFound(Message):
    """What a node holds for one key: a plain value (``value``, ``expiration``), or dictionary
    entries ``(subkey, value, expiration)``, or nothing; and the peers it knows nearest to the
    key."""

    value: bytes | None
    expiration: float
    entries: list[tuple[bytes, bytes, float]]
    nearest: list[DHTPeerInfo]


@message("dht.find")
@dataclass(frozen=True, slots=True)
class DHTFindRequest(Message):
    """What do you hold for these keys, and whom do you know near them? And whom do you know
    near these ``targets`` (32-byte node ids, for lookups of peers rather than keys)?
    ``nearest``: how many peers each result names at most (0: the node's k)."""

    sender: DHTPeerInfo | None
    keys: list[bytes]
    targets: list[bytes]
    nearest: int = 0


@message("dht.findings")
@dataclass(frozen=True, slots=True)
class DHTFindResponse(Message):
    """One :class:`DHTFound` per requested key, then one per target, in request order."""

    results: list[DHTFound]
