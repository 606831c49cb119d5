"""``swarmavg.aio.DHT``: the DHT as one object, with hivemind's names, for asyncio/anyio code.

It makes (or attaches to) a :class:`~swarmavg.aio.node.Node`, runs a
:class:`~swarmavg.aio.dht.DHTNode` on it, and offers ``store``/``get``/``run_coroutine`` as
coroutines. The synchronous ``swarmavg.DHT`` runs one of these on swarmavg's event-loop thread.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any, Final, Self, TypeVar

import anyio

from swarmavg._netif import visible_addresses
from swarmavg.address import Address
from swarmavg.aio.dht import DHTNode, GetResult
from swarmavg.aio.node import Node
from swarmavg.identity import Identity, PeerID
from swarmavg.proto.dht_validation import RecordValidator

__all__ = ["DHT"]

T = TypeVar("T")


def _listen_addresses(
    transport: str,
    host: str,
    port: int,
    host_maddrs: Sequence[str | Address] | None,
    client_mode: bool,
) -> list[Address]:
    if host_maddrs is not None:
        if isinstance(host_maddrs, str):
            raise TypeError("host_maddrs must be a list of addresses, not a single string")
        return [Address.parse(a) for a in host_maddrs]
    if client_mode:
        return []  # a client dials out only
    if transport == "memory":
        return [Address("memory", "local", port)]
    return [Address(transport, host, port)]


#: The keyword arguments of DHTNode that the facade passes on (the others it sets itself).
#: Accepted, but not named to users (a test's virtual clock).
_INTERNAL_OPTIONS: Final = frozenset({"clock"})
_DHT_OPTIONS: Final = frozenset(inspect.signature(DHTNode).parameters) - {
    "node",
    "initial_peers",
    "client_mode",
    "validators",
    "announce",
}


class DHT:
    """A DHT peer for async code: ``async with DHT(initial_peers=[...]) as dht: ...``.

    Entering starts the node (unless ``node`` is given), serves the DHT and bootstraps from
    ``initial_peers``; leaving (or :meth:`aclose`) stops it all.

    :param initial_peers: addresses of running peers (``get_visible_maddrs()`` of one of them,
        or ``swarmavg dht``'s output); empty for the first peer of a swarm.
    :param client_mode: query and store, but stay out of other peers' routing tables and listen
        on nothing (unless ``host_maddrs`` names addresses) and announce nothing (a peer
        behind NAT or a firewall).
    :param transport: the transport to listen with (``"tcp"``, ``"quic"``, ``"memory"``, or a
        plugin's name).
    :param host: the interface to listen on; ``"0.0.0.0"`` (or ``"::"``) for all of them, which
        other machines need.
    :param port: the port to listen on; 0 picks a free one.
    :param identity: an :class:`~swarmavg.Identity` or the path of a key file (created if
        missing), for a PeerID that stays the same across restarts; ``None``: a fresh one.
    :param host_maddrs: hivemind's spelling of where to listen: addresses or multiaddrs such as
        ``["/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1"]``; overrides
        ``transport``, ``host`` and ``port``.
    :param identity_path: hivemind's spelling of ``identity=<path>`` (the key file is
        swarmavg's own format, not libp2p's).
    :param announce_maddrs: where other peers can dial us, announced instead of the listening
        addresses (hivemind's name): addresses or multiaddrs, e.g. a router's public address
        that forwards a port to us, ``["/ip4/203.0.113.5/tcp/31337"]``; our PeerID is added.
        Default: the listening addresses, a wildcard expanded to this machine's interfaces.
    :param transport_options: options for the transport, e.g. ``{"network": memory_network}``
        for ``"memory"`` or ``{"encryption": False}`` for ``"tcp"``.
    :param node: a running node to attach to instead of making one (its owner closes it; the
        listening arguments are then ignored).
    :param record_validators: extra record validators (owner signatures are always checked).
    :param dht_options: passed to :class:`~swarmavg.aio.dht.DHTNode`: ``num_replicas``,
        ``request_timeout``, ``cache_locally``, ``k``, ``alpha``, ``refresh_period``,
        ``max_records_per_peer``, ``max_stores_per_second``, ...
    """

    def __init__(
        self,
        initial_peers: Sequence[str | Address] = (),
        *,
        client_mode: bool = False,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        identity: Identity | str | os.PathLike[str] | None = None,
        host_maddrs: Sequence[str | Address] | None = None,
        identity_path: str | os.PathLike[str] | None = None,
        announce_maddrs: Sequence[str | Address] | None = None,
        transport_options: Mapping[str, Any] | None = None,
        node: Node | None = None,
        record_validators: Sequence[RecordValidator] = (),
        **dht_options: Any,
    ) -> None:
        if isinstance(initial_peers, str | Address):
            raise TypeError("initial_peers must be a list of addresses, not a single address")
        if not isinstance(transport, str) or not transport:
            raise TypeError(f"transport must be a transport name such as 'tcp', not {transport!r}")
        if not isinstance(host, str):
            raise TypeError(f"host must be a string, not {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, not {port!r}")
        if identity is not None and identity_path is not None:
            raise ValueError("pass identity or identity_path, not both")
        if isinstance(announce_maddrs, str | Address):
            raise TypeError("announce_maddrs must be a list of addresses, not a single address")
        announced = [Address.parse(a) for a in announce_maddrs or ()]
        unknown = sorted(set(dht_options) - _DHT_OPTIONS)
        if unknown:
            raise TypeError(
                f"DHT() got an unexpected keyword argument {unknown[0]!r} (the DHT options are "
                f"{', '.join(sorted(_DHT_OPTIONS - _INTERNAL_OPTIONS))})"
            )
        self._owns_node = node is None
        if node is None:
            listen = _listen_addresses(transport, host, port, host_maddrs, client_mode)
            options = {transport: dict(transport_options)} if transport_options else {}
            node = Node(
                identity=identity if identity is not None else identity_path,
                listen=listen,
                transports=options,
            )
        self.node = node
        for address in announced:
            if address.peer_id not in (None, node.peer_id):
                raise ValueError(f"announce_maddrs: {address} names another peer's PeerID")
        self._announced = [a.with_peer_id(node.peer_id) for a in announced]
        #: The Kademlia node (for :meth:`run_coroutine` functions and advanced use).
        self.dht_node = DHTNode(
            node,
            initial_peers=[Address.parse(a) for a in initial_peers],
            client_mode=client_mode,
            validators=list(record_validators),
            announce=self.visible_addresses,
            **dht_options,
        )
        self._visible: list[Address] | None = None
        self._stack: AsyncExitStack | None = None
        self._entered = False
        self._closed = anyio.Event()

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a DHT can be started once")
        self._entered = True
        try:
            async with AsyncExitStack() as stack:
                if self._owns_node:
                    await stack.enter_async_context(self.node)
                await stack.enter_async_context(self.dht_node)
                self._stack = stack.pop_all()
        except BaseException:
            self._closed.set()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                return await stack.__aexit__(*exc_info)
            return None
        finally:
            self._closed.set()

    async def aclose(self) -> None:
        """Stop serving and close the node (if we made it). Idempotent; callable from any task
        (the ``async with`` block, if any, goes on)."""
        await self.dht_node.aclose()
        if self._owns_node:
            await self.node.aclose()
        self._closed.set()

    async def wait_closed(self) -> None:
        """Return once :meth:`aclose` was called or the ``async with`` block ended."""
        await self._closed.wait()

    # -- properties ------------------------------------------------------------------------------

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    @property
    def client_mode(self) -> bool:
        return self.dht_node.client_mode

    def visible_addresses(self) -> list[Address]:
        """Where other peers can dial us: ``announce_maddrs`` if given, else the listening
        addresses with wildcards expanded to this machine's interface addresses; empty in
        client mode."""
        if self.client_mode:
            return []
        if self._announced:
            return list(self._announced)
        if self._visible is None or len(self._visible) < len(self.node.addresses):
            self._visible = visible_addresses(self.node.addresses)
        return list(self._visible)

    def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        """:meth:`visible_addresses` as multiaddr strings (hivemind's form), usable as another
        peer's ``initial_peers``. ``latest`` reads the interfaces again."""
        if latest:
            self._visible = None
        return [a.to_multiaddr() for a in self.visible_addresses()]

    # -- operations ------------------------------------------------------------------------------

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store ``value`` (msgpack types and tuples, which come back as tuples) under ``key``
        (and ``subkey``, for a dictionary value) on the peers nearest the key, until
        ``expiration_time`` in DHT time (:func:`swarmavg.get_dht_time`). Whether at least one
        peer accepted it. See :meth:`swarmavg.aio.dht.DHTNode.store` for what it raises."""
        return await self.dht_node.store(key, value, expiration_time, subkey=subkey)

    async def get(self, key: Any, latest: bool = False) -> GetResult:
        """The value under ``key`` as ``ValueWithExpiration(value, expiration_time)``, or
        ``None`` if nothing live is stored under it. For a dictionary key (stored with
        subkeys), ``value`` is ``{subkey: ValueWithExpiration(value, expiration_time)}`` and
        ``expiration_time`` the latest of theirs (hivemind's shape: ``value, expiration =
        await dht.get(key)`` works for both). ``latest``: ask the nearest peers for the newest
        (and every subkey) rather than taking the first found (or the cached one). See
        :meth:`swarmavg.aio.dht.DHTNode.get`.

        :raises TypeError: the key cannot be serialized.
        """
        return await self.dht_node.get(key, latest=latest)

    async def run_coroutine(self, fn: Callable[[DHT, DHTNode], Awaitable[T]]) -> T:
        """``await fn(self, self.dht_node)``: hivemind's way to run custom DHT code."""
        return await fn(self, self.dht_node)

    def __repr__(self) -> str:
        return f"<swarmavg.aio.DHT {self.peer_id}>"
