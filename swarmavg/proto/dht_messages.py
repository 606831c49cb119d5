"""The DHT's wire messages: bulk ping, store and find (one request carries many keys).

Keys, subkeys and values travel as the msgpack bytes the application's objects serialize to;
a key's place in the id space is :func:`key_id` of those bytes. A request from a node that
others may route to carries its ``sender`` info (PeerID and dialable addresses); a client-mode
node sends ``None`` and is never added to anyone's routing table.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from swarmavg.identity import PeerID
from swarmavg.proto.codec import Message, message

__all__ = [
    "ID_BYTES",
    "KNOWN_PREFIX_BYTES",
    "MAX_ADDRESSES",
    "MAX_KEYS_PER_REQUEST",
    "MAX_KNOWN",
    "DHTFindRequest",
    "DHTFindResponse",
    "DHTFound",
    "DHTPeerInfo",
    "DHTPingRequest",
    "DHTPingResponse",
    "DHTStoreRequest",
    "DHTStoreResponse",
    "id_prefix",
    "key_id",
    "known_prefixes",
    "parse_known",
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


#: A known peer is named by the first 8 bytes of its node id in a request's ``known``.
KNOWN_PREFIX_BYTES: Final = 8
#: At most this many known peers are read from a request (the rest is ignored).
MAX_KNOWN: Final = 64
_PREFIX_SHIFT: Final = 8 * (ID_BYTES - KNOWN_PREFIX_BYTES)


def known_prefixes(node_ids: Iterable[int]) -> bytes:
    """``known`` for a request: the peers (by node id) the answer need not name. A lookup
    sends the candidates it starts with: answers then name only peers new to it (in a small
    swarm, where everyone knows everyone, next to none), which the lookup would otherwise
    decode and drop."""
    prefixes = [id_prefix(nid) for nid in itertools.islice(node_ids, MAX_KNOWN)]
    return _KNOWN_FORMATS[len(prefixes)].pack(*prefixes)


def parse_known(known: bytes) -> frozenset[int]:
    """The node-id prefixes in a request's ``known`` (at most :data:`MAX_KNOWN`; a trailing
    partial prefix is ignored), to test with :func:`id_prefix`."""
    count = min(len(known) // KNOWN_PREFIX_BYTES, MAX_KNOWN)
    return frozenset(_KNOWN_FORMATS[count].unpack_from(known))  # (one C call: 4x faster)


#: ``struct`` formats reading ``n`` prefixes, n <= MAX_KNOWN ("Q": KNOWN_PREFIX_BYTES is 8).
_KNOWN_FORMATS: Final = [struct.Struct(f">{n}Q") for n in range(MAX_KNOWN + 1)]


def id_prefix(nid: int) -> int:
    """The prefix of a node id that ``known`` carries."""
    return nid >> _PREFIX_SHIFT


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
    lookup whose beam is narrower than k has no use for more). ``known``: peers the sender
    knows already, which the answer need not name (see :func:`known_prefixes`)."""

    sender: DHTPeerInfo | None
    keys: list[bytes]
    subkeys: list[bytes | None]
    values: list[bytes]
    expirations: list[float]
    nearest: int = 0
    known: bytes = b""


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
    ``nearest``: how many peers each result names at most (0: the node's k); ``known``: peers
    the sender knows already, which the results need not name (see :func:`known_prefixes`)."""

    sender: DHTPeerInfo | None
    keys: list[bytes]
    targets: list[bytes]
    nearest: int = 0
    known: bytes = b""


@message("dht.findings")
@dataclass(frozen=True, slots=True)
class DHTFindResponse(Message):
    """One :class:`DHTFound` per requested key, then one per target, in request order."""

    results: list[DHTFound]
