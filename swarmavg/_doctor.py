"""``swarmavg doctor [ADDRESS ...]``: can this machine join a swarm, and does a peer answer?

Each check prints one line: ``ok``, ``warn`` (it works, but read the note) or ``FAIL`` (what
to do), in this order:

* the versions (swarmavg, Python, the platform);
* each transport: installed (the ``swarmavg.transports`` entry point resolves and imports) or
  not (which distribution to install); TCP is needed, QUIC is optional;
* the interfaces' addresses (what a wildcard listener is advertised as, see
  :mod:`swarmavg._netif`);
* for each installed transport: listening on ``--host``/``--port`` works, the addresses a
  :class:`swarmavg.DHT` listening there would advertise (``get_visible_maddrs()``), and a
  second node of this process dials the first of them and proves the key;
* for each peer address given: whether it answers over its transport (the connection and the
  handshake, then a few ``dht.ping`` calls, or ``ping`` for a ``swarmavg serve`` node: the
  median round trip); over the other transport at the same port too, unless another given
  address names that peer on it; and the skew of its clock against ours, from the DHT time in
  its ``dht.ping`` answer (the call with the shortest round trip: the error is at most half
  of it). A node that answers only ``ping`` tells no time: its clock is not checked.

The exit code is 0 when no check failed (warnings included), 1 otherwise.
"""

from __future__ import annotations

import enum
import math
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Final, TextIO

import anyio

from swarmavg import __version__
from swarmavg._netif import interface_addresses, visible_addresses
from swarmavg._time import get_dht_time
from swarmavg.abc import ConnectionAttribute
from swarmavg.address import Address
from swarmavg.aio.node import Node
from swarmavg.errors import AddressInUse, MethodNotFound, SwarmError, TransportNotFound
from swarmavg.identity import PeerID
from swarmavg.proto import Ping, Pong
from swarmavg.proto.dht_messages import DHTPingRequest, DHTPingResponse
from swarmavg.transport import (
    ENTRY_POINT_GROUP,
    SHIPPED,
    available_transports,
    missing_extra,
    resolve_transport,
)

__all__ = ["Check", "DoctorOptions", "Status", "checks", "run"]

#: The transports that ship with swarmavg, and what to install for each.
_PUBLISHED: Final = SHIPPED
#: A transport a swarm cannot do without.
_REQUIRED: Final = "tcp"
#: A clock further off than this fails (s): the DHT warns about it at bootstrap, and records
#: that live a minute would look half expired.
MAX_CLOCK_SKEW: Final = 5.0
#: A clock further off than this gets a warning (s).
WARN_CLOCK_SKEW: Final = 1.0


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one check: its status, what was checked and what was found (or what to
    do)."""

    status: Status
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status.value:<4}  {self.name}: {self.detail}"


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What ``swarmavg doctor`` checks.

    :param peers: peer addresses (URLs or multiaddrs) to check.
    :param host: the interface the listening checks listen on (``0.0.0.0``: all).
    :param port: the port they listen on (0: any free one).
    :param timeout: seconds one connection or call may take.
    :param calls: round trips timed per peer and transport.
    :raises ValueError: an option is out of range (named).
    """

    peers: tuple[str, ...] = ()
    host: str = "0.0.0.0"  # noqa: S104 (what a peer for other machines listens on)
    port: int = 0
    timeout: float = 5.0
    calls: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, not {self.timeout}")
        if self.calls < 1:
            raise ValueError(f"calls must be at least 1, not {self.calls}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def _seconds(seconds: float) -> str:
    return _ms(seconds) if seconds < 1 else f"{seconds:.1f} s"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# -- this machine --------------------------------------------------------------------------------


def version_check() -> Check:
    return Check(
        Status.OK,
        "versions",
        f"swarmavg {__version__}, Python {platform.python_version()} on {platform.platform()}",
    )


def transport_checks() -> tuple[list[Check], list[str]]:
    """One check per transport (the published ones and every registered one), and the names
    of those that resolve."""
    results: list[Check] = []
    installed: list[str] = []
    names = sorted((set(available_transports()) | set(_PUBLISHED)) - {"memory"})
    for name in names:
        try:
            cls = resolve_transport(name)
        except TransportNotFound as exc:
            if name != _REQUIRED and missing_extra(name, exc.__cause__):
                results.append(
                    Check(
                        Status.WARN,
                        f"transport {name}",
                        f'not installed (optional): `pip install "{_PUBLISHED[name]}"` to listen '
                        f"on and dial {name}:// addresses",
                    )
                )
            else:
                results.append(Check(Status.FAIL, f"transport {name}", str(exc)))
            continue
        installed.append(name)
        where = ""
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            if ep.dist is not None:
                where = f" ({ep.dist.name} {ep.dist.version})"
            break
        results.append(Check(Status.OK, f"transport {name}", f"installed{where}: {cls.__module__}"))
    return results, installed


def interface_check() -> Check:
    ipv4, ipv6 = interface_addresses(), interface_addresses(ipv6=True)
    text = f"IPv4 {', '.join(ipv4) or 'none'}; IPv6 {', '.join(ipv6) or 'none'}"
    routable = [a for a in ipv4 + ipv6 if not a.startswith("127.") and a != "::1"]
    if not routable:
        return Check(
            Status.WARN,
            "interfaces",
            f"{text}: loopback only, so no other machine can reach this one (connect it to "
            f"a network)",
        )
    return Check(Status.OK, "interfaces", text)


async def listen_check(scheme: str, host: str, port: int, timeout: float) -> Check:
    """Listen on ``scheme://host:port``, name what would be advertised, dial it back."""
    name = f"listen {scheme}"
    target = Address(scheme, host, port)
    try:
        async with Node(listen=[target]) as node:
            advertised = visible_addresses(node.addresses)
            bound = ", ".join(str(a.with_peer_id(None)) for a in node.addresses)
            shown = ", ".join(str(a.with_peer_id(None)) for a in advertised)
            if not advertised:
                return Check(Status.FAIL, name, f"on {bound}, but no address to advertise")
            async with Node() as dialer:
                start = time.perf_counter()
                await dialer.connect(advertised[0], timeout=timeout)
                dial = time.perf_counter() - start
    except AddressInUse:
        return Check(
            Status.FAIL,
            name,
            f"port {port} of {host} is taken: pick another with --port (or stop what holds it)",
        )
    except (SwarmError, OSError, TimeoutError) as exc:
        return Check(Status.FAIL, name, f"cannot listen on {target}: {_why(exc)}")
    text = f"on {bound}, advertised as {shown}; dialed it back in {_ms(dial)}"
    hosts = [a.host for a in advertised]
    if all(h.startswith("127.") or h == "::1" for h in hosts):
        return Check(
            Status.WARN,
            name,
            f"{text}; loopback only: other machines cannot dial it (listen on 0.0.0.0, the "
            f"default of `swarmavg dht`)",
        )
    if not any(_is_public(h) for h in hosts):
        text += (
            " (private addresses: peers on other networks need a port forward announced with"
            " announce_maddrs (`swarmavg dht --announce`), or a VPN, to dial them; or this"
            " peer joins them with client_mode=True)"
        )
    return Check(Status.OK, name, text)


def _is_public(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        return True  # (a name: it may be)


# -- peers ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Probe:
    """What one connection to a peer showed."""

    peer_id: PeerID
    connect_s: float
    encrypted: bool
    method: str | None  # "dht.ping", "ping", or None: it serves neither
    round_trips: tuple[float, ...]
    #: (its DHT time - ours at the middle of the call, the call's round trip), per dht.ping
    clocks: tuple[tuple[float, float], ...]


async def _probe(address: Address, timeout: float, calls: int) -> _Probe:
    """Connect to ``address`` with a fresh node and time ``calls`` pings.

    :raises SwarmError: it does not answer.
    :raises OSError: it does not answer.

    :raises TimeoutError: it does not answer.
    """
    async with Node() as node:
        start = time.perf_counter()
        conn = await node.connect(
            address, allow_unknown_peer=address.peer_id is None, timeout=timeout
        )
        connect_s = time.perf_counter() - start
        peer = conn.extra(ConnectionAttribute.peer_id)
        encrypted = bool(conn.extra(ConnectionAttribute.encrypted, False))
        round_trips: list[float] = []
        clocks: list[tuple[float, float]] = []
        method: str | None = "dht.ping"
        for nonce in range(calls):
            if method == "dht.ping":
                before, start = get_dht_time(), time.perf_counter()
                try:
                    pong = await node.rpc.call(
                        peer,
                        "dht.ping",
                        DHTPingRequest(None),
                        response_type=DHTPingResponse,
                        timeout=timeout,
                    )
                except MethodNotFound:
                    method = "ping"
                else:
                    elapsed, after = time.perf_counter() - start, get_dht_time()
                    round_trips.append(elapsed)
                    if math.isfinite(pong.dht_time):
                        clocks.append((pong.dht_time - (before + after) / 2, elapsed))
                    continue
            if method == "ping":
                start = time.perf_counter()
                try:
                    await node.rpc.call(
                        peer, "ping", Ping(nonce), response_type=Pong, timeout=timeout
                    )
                except MethodNotFound:
                    method = None
                    break
                round_trips.append(time.perf_counter() - start)
        return _Probe(peer, connect_s, encrypted, method, tuple(round_trips), tuple(clocks))


def _probe_text(probe: _Probe, calls: int) -> str:
    how = "encrypted" if probe.encrypted else "NOT encrypted"
    text = f"connected in {_ms(probe.connect_s)} (key proven, {how})"
    if probe.method is None:
        return text + "; it serves neither dht.ping nor ping: round trip not measured"
    median = statistics.median(probe.round_trips)
    return text + f", round trip {_ms(median)} (median of {calls} {probe.method} calls)"


def _clock_check(name: str, probe: _Probe) -> Check:
    if not probe.clocks:
        return Check(
            Status.WARN,
            name,
            "not readable: the node is no DHT peer (a `swarmavg serve` node's answers carry "
            "no time)",
        )
    skew, round_trip = min(probe.clocks, key=lambda clock: clock[1])
    if abs(skew) <= round_trip / 2:
        text = f"agrees with ours (within the ± {_ms(round_trip / 2)} the round trip allows)"
    else:
        side = "ahead of" if skew > 0 else "behind"
        text = f"{_seconds(abs(skew))} {side} ours (± {_ms(round_trip / 2)})"
    if abs(skew) > MAX_CLOCK_SKEW:
        return Check(
            Status.FAIL,
            name,
            f"{text}: sync both clocks (NTP, e.g. `timedatectl set-ntp true`); DHT records "
            f"expire by the wall clock, so the peers' records would look expired or too new",
        )
    if abs(skew) > WARN_CLOCK_SKEW:
        return Check(Status.WARN, name, f"{text}: worth syncing both clocks (NTP)")
    return Check(Status.OK, name, text)


_OTHER: Final = {"tcp": "quic", "quic": "tcp"}


async def peer_checks(
    text: str,
    given: Sequence[Address],
    installed: Sequence[str],
    options: DoctorOptions,
    clocked: set[PeerID],
) -> AsyncIterator[Check]:
    """The checks of the peer at ``text`` (``given``: every address given, to tell whether
    another names the same peer on the other transport; ``clocked``: the peers whose clock
    was checked already, to which this one's is added)."""
    try:
        address = Address.parse(text)
    except ValueError as exc:
        yield Check(Status.FAIL, f"peer {text}", f"not an address: {exc}")
        return
    name = f"peer {address.with_peer_id(None)}"
    if address.scheme not in installed:
        yield Check(
            Status.FAIL,
            name,
            f"cannot dial it: transport {address.scheme!r} is not installed"
            + (
                f' (`pip install "{_PUBLISHED[address.scheme]}"`)'
                if address.scheme in _PUBLISHED
                else ""
            ),
        )
        return
    try:
        probe = await _probe(address, options.timeout, options.calls)
    except (SwarmError, OSError, TimeoutError) as exc:
        yield Check(
            Status.FAIL,
            f"{name} over {address.scheme}",
            f"no answer ({_why(exc)}): check that the peer runs, the host and port, and "
            f"that no firewall drops {'TCP' if address.scheme == 'tcp' else 'UDP'} on that port",
        )
        return
    yield Check(Status.OK, f"{name} over {address.scheme}", _probe_text(probe, options.calls))
    if address.peer_id is None:
        yield Check(
            Status.WARN,
            f"{name} identity",
            f"the address names no PeerID; the peer there is {probe.peer_id}: give peers "
            f"{address.with_peer_id(probe.peer_id)} so that they check who answers",
        )
    other = _OTHER.get(address.scheme)
    named = any(
        a.scheme == other and (a.peer_id in (None, probe.peer_id)) and a.host == address.host
        for a in given
    )
    if other is not None and other in installed and not named:
        alternative = Address(other, address.host, address.port, probe.peer_id)
        try:
            second = await _probe(alternative, options.timeout, options.calls)
        except (SwarmError, OSError, TimeoutError) as exc:
            yield Check(
                Status.WARN,
                f"{name} over {other}",
                f"no answer at the same port ({_why(exc)}): fine if it does not listen on "
                f"{other}; give its {other} address to check that",
            )
        else:
            yield Check(
                Status.OK,
                f"{name} over {other}",
                "same port: " + _probe_text(second, options.calls),
            )
    if probe.peer_id not in clocked:
        clocked.add(probe.peer_id)
        yield _clock_check(f"clock of {probe.peer_id.short()}", probe)


# -- the command ---------------------------------------------------------------------------------


async def checks(options: DoctorOptions) -> AsyncIterator[Check]:
    """Every check, in order, as each ends."""
    yield version_check()
    transports, installed = transport_checks()
    for check in transports:
        yield check
    yield interface_check()
    for scheme in ("tcp", "quic"):
        if scheme in installed:
            yield await listen_check(scheme, options.host, options.port, options.timeout)
    given = []
    for text in options.peers:
        try:
            given.append(Address.parse(text))
        except ValueError:
            continue
    clocked: set[PeerID] = set()
    for text in options.peers:
        async for check in peer_checks(text, given, installed, options, clocked):
            yield check


async def _report(options: DoctorOptions, out: TextIO) -> int:
    failed = False
    async for check in checks(options):
        print(check.line(), file=out, flush=True)
        failed = failed or check.status is Status.FAIL
    return 1 if failed else 0


def run(options: DoctorOptions, out: TextIO | None = None) -> int:
    """Run ``swarmavg doctor``: print each check's line to ``out`` (default ``sys.stdout``)
    as it ends; the exit code: 0 if none failed, else 1 (130 on Ctrl+C)."""
    try:
        return anyio.run(_report, options, sys.stdout if out is None else out)
    except KeyboardInterrupt:
        return 130
