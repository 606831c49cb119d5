"""What one DHT node stores (sans-IO): values with expirations, dictionary values, limits.

Every DHT value carries an absolute expiration in DHT time (seconds since the Unix epoch, see
:func:`swarmavg.get_dht_time`). A key holds either one value, or a *dictionary*: subkey ->
(value, expiration), which several peers fill in (a group's members, a run's progress reports).
Values are stored as the bytes they travel as (msgpack, already serialized and validated by the
caller), so the size limits are limits on the wire size. Nothing here reads a clock: callers
pass ``now``.

Rules (the same on every node, so that replicas converge whatever order stores arrive in):

* a store whose expiration is not after ``now`` is refused;
* for a plain value, the newer expiration wins; a store with an older expiration, or the same
  expiration and another value, is refused (equal expirations keep the first value, so a
  replica does not flip between two writers);
* a subkey store merges into the key's dictionary under the same rule per subkey;
* a plain value and a dictionary under one key: the one whose (latest) expiration is later
  replaces the other; on a tie the dictionary stays (or wins). Replicas that see plain and
  subkey stores of one key in different orders may still keep different subkeys (a dictionary
  that replaced a plain value starts empty): give a key one kind of value;
* when the storage is full, the entry that expires soonest makes room (or the new one is
  refused if it would expire even sooner).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Generic, NamedTuple, TypeVar

__all__ = [
    "DEFAULT_MAX_KEY_SIZE",
    "DEFAULT_MAX_VALUE_SIZE",
    "DictionaryValue",
    "LocalStorage",
    "StoreResult",
    "ValueWithExpiration",
]

#: Largest serialized key or subkey, in bytes.
DEFAULT_MAX_KEY_SIZE: Final = 512
#: Largest serialized value, in bytes.
DEFAULT_MAX_VALUE_SIZE: Final = 64 << 10


_V = TypeVar("_V")


class ValueWithExpiration(NamedTuple, Generic[_V]):
    """A value and when it expires (DHT time); unpacks as ``value, expiration = item``.

    Storage holds serialized values (``ValueWithExpiration[bytes]``); the DHT's ``get`` returns
    them decoded, a dictionary key's as ``ValueWithExpiration({subkey:
    ValueWithExpiration(value, expiration_time)}, <the latest of those expirations>)``.
    """

    value: _V
    expiration_time: float


@dataclass
class DictionaryValue:
    """Subkey -> :class:`ValueWithExpiration`, all stored under one key."""

    items: dict[bytes, ValueWithExpiration[bytes]] = field(default_factory=dict)

    @property
    def latest_expiration(self) -> float:
        return max((v.expiration_time for v in self.items.values()), default=float("-inf"))

    def drop_expired(self, now: float) -> None:
        for subkey in [s for s, v in self.items.items() if v.expiration_time <= now]:
            del self.items[subkey]


class StoreResult(NamedTuple):
    """Whether a store was accepted, and why not (``""`` when it was)."""

    accepted: bool
    reason: str = ""


_ACCEPTED: Final = StoreResult(True)


def _newer(new: ValueWithExpiration[bytes], old: ValueWithExpiration[bytes] | None) -> bool:
    return old is None or new.expiration_time > old.expiration_time or new == old


class LocalStorage:
    """The records one node holds, bounded in count and in key and value size.

    :param max_entries: values in all (a dictionary counts one per subkey).
    :param max_key_size: largest key or subkey, in bytes.
    :param max_value_size: largest value, in bytes.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        max_key_size: int = DEFAULT_MAX_KEY_SIZE,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
    ) -> None:
        for name, value in (
            ("max_entries", max_entries),
            ("max_key_size", max_key_size),
            ("max_value_size", max_value_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        self.max_entries = max_entries
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self._data: dict[bytes, ValueWithExpiration[bytes] | DictionaryValue] = {}
        self._entries = 0
        # (expiration, sequence, key, subkey) of every entry, lazily pruned, soonest first (the
        # sequence number keeps tuples from ever comparing a subkey with None)
        self._expirations: list[tuple[float, int, bytes, bytes | None]] = []
        self._sequence = 0

    def __len__(self) -> int:
        """Stored values (dictionary entries count one each); expired ones until pruned."""
        return self._entries

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[bytes]:
        """The keys (a snapshot: storing while iterating is fine)."""
        return iter(list(self._data))

    # -- reading ---------------------------------------------------------------------------------

    def get(self, key: bytes, now: float) -> ValueWithExpiration[bytes] | DictionaryValue | None:
        """The live value or dictionary under ``key`` (a copy of the dictionary), or ``None``."""
        self.prune(now)
        found = self._data.get(key)
        if isinstance(found, DictionaryValue):
            live = {s: v for s, v in found.items.items() if v.expiration_time > now}
            return DictionaryValue(live) if live else None
        if found is not None and found.expiration_time > now:
            return found
        return None

    # -- writing ---------------------------------------------------------------------------------

    def store(
        self,
        key: bytes,
        value: bytes,
        expiration_time: float,
        now: float,
        subkey: bytes | None = None,
    ) -> StoreResult:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``, by the rules
        in the module docstring."""
        if len(key) > self.max_key_size or (subkey is not None and len(subkey) > self.max_key_size):
            return StoreResult(False, f"key over {self.max_key_size} bytes")
        if len(value) > self.max_value_size:
            return StoreResult(False, f"value over {self.max_value_size} bytes")
        if not expiration_time > now:  # also refuses NaN
            return StoreResult(False, "already expired")
        if expiration_time == float("inf"):
            return StoreResult(False, "expiration must be finite")
        self.prune(now)
        new = ValueWithExpiration(bytes(value), float(expiration_time))
        current = self._data.get(key)
        if subkey is None:
            if isinstance(current, DictionaryValue):
                if new.expiration_time <= current.latest_expiration:
                    return StoreResult(False, "a dictionary under this key expires later")
                if not self._make_room(new.expiration_time, 1 - len(current.items)):
                    return StoreResult(False, "storage full of longer-lived values")
                self._entries -= len(current.items)
            else:
                if not _newer(new, current):
                    return StoreResult(False, "a value with a later expiration is stored")
                if current == new:
                    return _ACCEPTED
                if current is None and not self._make_room(new.expiration_time, 1):
                    return StoreResult(False, "storage full of longer-lived values")
                if current is not None:
                    self._entries -= 1
            self._data[key] = new
            self._entries += 1
            self._push(new.expiration_time, key, None)
            return _ACCEPTED
        subkey = bytes(subkey)
        if isinstance(current, ValueWithExpiration):
            if new.expiration_time < current.expiration_time:
                return StoreResult(False, "a plain value under this key expires later")
            current = None  # the dictionary replaces it
            self._data.pop(key)
            self._entries -= 1
        dictionary = current if isinstance(current, DictionaryValue) else DictionaryValue()
        old = dictionary.items.get(subkey)
        if not _newer(new, old):
            return StoreResult(False, "this subkey has a value with a later expiration")
        if old == new:
            return _ACCEPTED
        if old is None and not self._make_room(new.expiration_time, 1):
            return StoreResult(False, "storage full of longer-lived values")
        if old is None:
            self._entries += 1
        dictionary.items[subkey] = new
        self._data[key] = dictionary
        self._push(new.expiration_time, key, subkey)
        return _ACCEPTED

    def remove(self, key: bytes, subkey: bytes | None = None) -> bool:
        """Drop ``key`` (or one subkey of it); whether anything was there."""
        current = self._data.get(key)
        if current is None:
            return False
        if subkey is None:
            del self._data[key]
            self._entries -= len(current.items) if isinstance(current, DictionaryValue) else 1
            return True
        if not isinstance(current, DictionaryValue) or subkey not in current.items:
            return False
        del current.items[subkey]
        self._entries -= 1
        if not current.items:
            del self._data[key]
        return True

    # -- expiry and room -------------------------------------------------------------------------

    def prune(self, now: float) -> int:
        """Drop every entry expired at ``now``; how many went."""
        dropped = 0
        heap = self._expirations
        while heap and heap[0][0] <= now:
            _, _, key, subkey = heapq.heappop(heap)
            dropped += self._drop_if_expired(key, subkey, now)
        if len(heap) > 4 * self._entries + 64:  # stale heap entries of overwritten values
            self._rebuild_heap()
        return dropped

    def _drop_if_expired(self, key: bytes, subkey: bytes | None, now: float) -> int:
        current = self._data.get(key)
        if current is None:
            return 0
        if subkey is None:
            if isinstance(current, ValueWithExpiration) and current.expiration_time <= now:
                del self._data[key]
                self._entries -= 1
                return 1
            return 0
        if isinstance(current, DictionaryValue):
            item = current.items.get(subkey)
            if item is not None and item.expiration_time <= now:
                self.remove(key, subkey)
                return 1
        return 0

    def _make_room(self, expiration_time: float, needed: int) -> bool:
        """Evict the soonest-expiring entries until ``needed`` more fit; ``False`` (evicting
        nothing) if the newcomer would expire before all of those."""
        excess = self._entries + needed - self.max_entries
        if excess <= 0:
            return True
        self._rebuild_heap()
        victims = heapq.nsmallest(excess, self._expirations)
        if len(victims) < excess or victims[-1][0] >= expiration_time:
            return False
        for _, _, key, subkey in victims:
            self.remove(key, subkey)
        self._rebuild_heap()
        return True

    def _push(self, expiration_time: float, key: bytes, subkey: bytes | None) -> None:
        self._sequence += 1
        heapq.heappush(self._expirations, (expiration_time, self._sequence, key, subkey))

    def _rebuild_heap(self) -> None:
        self._expirations = []
        for key, current in self._data.items():
            if isinstance(current, DictionaryValue):
                for subkey, item in current.items.items():
                    self._push(item.expiration_time, key, subkey)
            else:
                self._push(current.expiration_time, key, None)
