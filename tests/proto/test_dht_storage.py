"""A DHT node's local storage (sans-IO): expiration rules, dictionaries, limits, convergence."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg import get_dht_time
from swarmavg.proto.dht_storage import DictionaryValue, LocalStorage, ValueWithExpiration

NOW = 1_000.0


def test_dht_time_is_wall_clock() -> None:
    assert abs(get_dht_time() - time.time()) < 1.0


def test_newer_expiration_wins_and_older_is_refused() -> None:
    s = LocalStorage()
    assert s.store(b"k", b"v1", NOW + 10, NOW).accepted
    assert s.get(b"k", NOW) == ValueWithExpiration(b"v1", NOW + 10)
    value, expiration = s.get(b"k", NOW)  # type: ignore[misc]
    assert (value, expiration) == (b"v1", NOW + 10)
    older = s.store(b"k", b"v0", NOW + 5, NOW)
    assert not older.accepted
    assert "later expiration" in older.reason
    same_time_other_value = s.store(b"k", b"vX", NOW + 10, NOW)
    assert not same_time_other_value.accepted
    assert s.store(b"k", b"v1", NOW + 10, NOW).accepted  # the same record again: idempotent
    assert s.store(b"k", b"v2", NOW + 20, NOW).accepted
    assert s.get(b"k", NOW).value == b"v2"  # type: ignore[union-attr]
    assert len(s) == 1


def test_expired_values_are_refused_and_vanish() -> None:
    s = LocalStorage()
    assert not s.store(b"k", b"v", NOW, NOW).accepted
    assert not s.store(b"k", b"v", NOW - 1, NOW).accepted
    assert not s.store(b"k", b"v", float("nan"), NOW).accepted
    assert not s.store(b"k", b"v", float("inf"), NOW).accepted
    assert s.store(b"k", b"v", NOW + 1, NOW).accepted
    assert s.get(b"k", NOW + 0.5) is not None
    assert s.get(b"k", NOW + 1) is None
    assert len(s) == 0
    # an expired value does not block a store with an earlier expiration than it had
    assert s.store(b"k", b"w", NOW + 1.5, NOW + 1.2).accepted


def test_subkeys_merge_into_a_dictionary() -> None:
    s = LocalStorage()
    assert s.store(b"group", b"alice", NOW + 10, NOW, subkey=b"a").accepted
    assert s.store(b"group", b"bob", NOW + 20, NOW, subkey=b"b").accepted
    assert not s.store(b"group", b"alice-old", NOW + 5, NOW, subkey=b"a").accepted
    got = s.get(b"group", NOW)
    assert isinstance(got, DictionaryValue)
    assert got.items == {
        b"a": ValueWithExpiration(b"alice", NOW + 10),
        b"b": ValueWithExpiration(b"bob", NOW + 20),
    }
    assert got.latest_expiration == NOW + 20
    assert len(s) == 2
    # a subkey expires on its own
    later = s.get(b"group", NOW + 15)
    assert isinstance(later, DictionaryValue)
    assert set(later.items) == {b"b"}
    # a plain value replaces the dictionary only if it outlives all of it, and vice versa
    assert not s.store(b"group", b"plain", NOW + 15, NOW).accepted
    assert not s.store(b"group", b"plain", NOW + 20, NOW).accepted  # a tie: the dictionary stays
    assert s.store(b"group", b"plain", NOW + 30, NOW).accepted
    assert s.get(b"group", NOW) == ValueWithExpiration(b"plain", NOW + 30)
    assert len(s) == 1
    assert not s.store(b"group", b"x", NOW + 25, NOW, subkey=b"x").accepted
    assert s.store(b"group", b"x", NOW + 35, NOW, subkey=b"x").accepted
    assert isinstance(s.get(b"group", NOW), DictionaryValue)
    assert len(s) == 1


def test_size_limits() -> None:
    s = LocalStorage(max_key_size=8, max_value_size=16)
    assert not s.store(b"k" * 9, b"v", NOW + 1, NOW).accepted
    assert not s.store(b"k", b"v", NOW + 1, NOW, subkey=b"s" * 9).accepted
    refused = s.store(b"k", b"v" * 17, NOW + 1, NOW)
    assert not refused.accepted
    assert "value over 16 bytes" in refused.reason
    assert s.store(b"k" * 8, b"v" * 16, NOW + 1, NOW).accepted
    with pytest.raises(ValueError, match="max_entries"):
        LocalStorage(max_entries=0)


def test_a_full_storage_drops_what_expires_soonest() -> None:
    s = LocalStorage(max_entries=3)
    for i, expiration in enumerate((NOW + 30, NOW + 10, NOW + 20)):
        assert s.store(b"k%d" % i, b"v", expiration, NOW).accepted
    assert not s.store(b"short", b"v", NOW + 5, NOW).accepted  # would be the first to go
    assert s.store(b"long", b"v", NOW + 40, NOW).accepted
    assert s.get(b"k1", NOW) is None  # the soonest to expire made room
    assert set(s) == {b"k0", b"k2", b"long"}
    assert len(s) == 3
    assert s.store(b"d", b"v", NOW + 50, NOW, subkey=b"a").accepted
    assert s.get(b"k2", NOW) is None
    assert len(s) == 3


def test_remove() -> None:
    s = LocalStorage()
    s.store(b"k", b"v", NOW + 1, NOW)
    s.store(b"d", b"v", NOW + 1, NOW, subkey=b"a")
    s.store(b"d", b"v", NOW + 1, NOW, subkey=b"b")
    assert s.remove(b"d", b"a")
    assert not s.remove(b"d", b"a")
    assert s.remove(b"d")
    assert s.remove(b"k")
    assert not s.remove(b"k")
    assert len(s) == 0


_stores = st.lists(
    st.one_of(
        st.tuples(
            st.just(b"plain"),
            st.none(),
            st.sampled_from([b"1", b"2", b"3"]),
            st.integers(1, 6).map(lambda t: NOW + t),
        ),
        st.tuples(
            st.just(b"dict"),
            st.sampled_from([b"x", b"y", b"z"]),
            st.sampled_from([b"1", b"2", b"3"]),
            st.integers(1, 6).map(lambda t: NOW + t),
        ),
    ),
    max_size=14,
)


def _state(s: LocalStorage) -> dict[bytes, object]:
    out: dict[bytes, object] = {}
    for key in s:
        got = s.get(key, NOW)
        out[key] = got.items if isinstance(got, DictionaryValue) else got
    return out


@settings(deadline=None)
@given(_stores, st.randoms(use_true_random=False))
def test_replicas_converge_whatever_order_stores_arrive_in(
    stores: list[tuple[bytes, bytes | None, bytes, float]], rng: random.Random
) -> None:
    """Two nodes that receive the same stores in different orders end up holding the same
    records, as long as no two stores race with the same expiration for one slot (and each key
    holds one kind of value, plain or dictionary)."""
    slots: dict[tuple[bytes, bytes | None, float], bytes] = {}
    for key, subkey, value, expiration in stores:
        if slots.setdefault((key, subkey, expiration), value) != value:
            return  # two values with one expiration: first come wins, order matters (by design)
    first, second = LocalStorage(), LocalStorage()
    for key, subkey, value, expiration in stores:
        first.store(key, value, expiration, NOW, subkey=subkey)
    shuffled = list(stores)
    rng.shuffle(shuffled)
    for key, subkey, value, expiration in shuffled:
        second.store(key, value, expiration, NOW, subkey=subkey)
    assert _state(first) == _state(second)
    assert len(first) == len(second)
