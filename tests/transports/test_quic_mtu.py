"""Choosing the QUIC datagram size from the route (loopback only)."""

from __future__ import annotations

import socket
import sys

import pytest

from swarmavg_quic._mtu import MAX_DATAGRAM, MIN_DATAGRAM, datagram_size_for, route_payload_size

linux = pytest.mark.skipif(sys.platform != "linux", reason="IP_MTU is Linux's")


@linux
def test_loopback_routes_allow_more_than_aioquic_writes() -> None:
    size = route_payload_size("127.0.0.1", 9)
    assert size is not None
    assert size > MAX_DATAGRAM  # loopback's MTU is 64 KiB
    assert datagram_size_for("127.0.0.1", 9) == MAX_DATAGRAM


@linux
def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    size = route_payload_size("::1", 9)
    if size is None:
        pytest.skip("IPv6 loopback is disabled here")
    assert datagram_size_for("::1", 9) == MAX_DATAGRAM


def test_names_and_unknown_routes_fall_back_to_the_minimum() -> None:
    assert route_payload_size("localhost", 9) is None  # names are resolved before this
    assert datagram_size_for("localhost", 9) == MIN_DATAGRAM


def test_an_override_wins_and_is_checked() -> None:
    assert datagram_size_for("127.0.0.1", 9, override=9000) == 9000
    for bad in (1199, 16384, 0):
        with pytest.raises(ValueError, match="max_datagram_size"):
            datagram_size_for("127.0.0.1", 9, override=bad)
