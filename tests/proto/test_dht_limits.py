"""Blacklist backoff and per-peer store quotas (sans-IO)."""

from __future__ import annotations

import pytest

from swarmavg.proto.dht_limits import Blacklist, StoreQuota


def test_a_ban_doubles_with_each_failure_and_is_capped() -> None:
    blacklist: Blacklist[str] = Blacklist(base_delay=5.0, backoff=2.0, max_delay=30.0)
    assert [blacklist.failed("p", now=0.0) for _ in range(5)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert blacklist.failures("p") == 5
    assert blacklist.is_banned("p", now=29.9)
    assert not blacklist.is_banned("p", now=30.0)
    assert not blacklist.is_banned("other", now=0.0)


def test_an_answer_clears_the_record() -> None:
    blacklist: Blacklist[str] = Blacklist(base_delay=1.0)
    blacklist.failed("p", now=0.0)
    blacklist.failed("p", now=0.0)
    blacklist.succeeded("p")
    assert not blacklist.is_banned("p", now=0.0)
    assert blacklist.failed("p", now=0.0) == 1.0  # counting starts over


def test_the_blacklist_is_bounded_and_drops_the_stalest() -> None:
    blacklist: Blacklist[int] = Blacklist(max_peers=100)
    for peer in range(1000):
        blacklist.failed(peer, now=0.0)
    assert len(blacklist) == 100
    assert blacklist.is_banned(999, now=0.0)
    assert not blacklist.is_banned(0, now=0.0)


def test_a_peer_stores_at_most_burst_at_once_then_rate_per_second() -> None:
    quota: StoreQuota[str] = StoreQuota(max_records=10_000, rate=10.0, burst=50.0)
    assert quota.admit("p", 80, now=0.0) == 50
    assert quota.admit("p", 1, now=0.0) == 0
    assert quota.admit("p", 100, now=1.0) == 10  # ten tokens came back in a second
    assert quota.admit("q", 5, now=1.0) == 5  # other peers have their own bucket
    assert quota.admit("p", 100, now=1000.0) == 50  # the bucket never holds more than burst


def test_a_peer_holds_at_most_max_records_until_they_expire() -> None:
    quota: StoreQuota[str] = StoreQuota(max_records=3, rate=1000.0, burst=1000.0)
    assert quota.admit("p", 3, now=0.0) == 3
    for expiration in (10.0, 20.0, 30.0):
        quota.stored("p", expiration)
    assert quota.records("p", now=0.0) == 3
    assert quota.admit("p", 1, now=5.0) == 0
    assert quota.admit("p", 5, now=15.0) == 1  # one record expired: room for one
    quota.stored("p", 100.0)
    assert quota.records("p", now=15.0) == 3


def test_quotas_are_bounded_in_peers() -> None:
    quota: StoreQuota[int] = StoreQuota(max_peers=10)
    for peer in range(100):
        quota.admit(peer, 1, now=0.0)
    assert len(quota._accounts) == 10


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_bad_settings_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="base_delay"):
        Blacklist(base_delay=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate"):
        StoreQuota(rate=bad)  # type: ignore[arg-type]
