"""The DHT over a :class:`~swarmavg.aio.node.Node`: Kademlia with signed records.

:class:`DHTProtocol` answers the DHT's RPCs on a node: bulk ping, store and find, backed by the
sans-IO routing table (:mod:`swarmavg.proto.routing`), record storage
(:mod:`swarmavg.proto.dht_storage`), validators (:mod:`swarmavg.proto.dht_validation`) and
per-peer limits (:mod:`swarmavg.proto.dht_limits`). It learns peers from the requests they
make: a request's ``sender`` info counts only if it names the caller's own, authenticated
PeerID, and client-mode callers (no sender info) never enter the routing table.

:class:`DHTNode` is the asking half: bootstrap, iterative lookups (:mod:`swarmavg.proto.lookup`),
replicated stores, gets that merge what replicas hold, a local cache, and the upkeep tasks
(pinging least recently seen peers, refreshing buckets, rejoining through the initial peers and
the peers dropped for failures while the routing table is small). The facades
``swarmavg.aio.DHT`` and ``swarmavg.DHT`` wrap it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, Self, TypeAlias, TypeVar

import anyio

from swarmavg._groups import sole_error
from swarmavg._time import get_dht_time
from swarmavg.address import Address
from swarmavg.aio.rpc import PendingCall, Prepared
from swarmavg.errors import ConnectError, RemoteProtocolError, SwarmError
from swarmavg.proto.codec import Message
from swarmavg.proto.dht_limits import Blacklist, StoreQuota
from swarmavg.proto.dht_messages import (
    ID_BYTES,
    MAX_ADDRESSES,
    MAX_KEYS_PER_REQUEST,
    DHTFindRequest,
    DHTFindResponse,
    DHTFound,
    DHTPeerInfo,
    DHTPingRequest,
    DHTPingResponse,
    DHTStoreRequest,
    DHTStoreResponse,
    id_prefix,
    key_id,
    known_prefixes,
    parse_known,
)
from swarmavg.proto.dht_storage import DictionaryValue, LocalStorage, ValueWithExpiration
from swarmavg.proto.dht_validation import (
    CompositeValidator,
    DHTRecord,
    RecordValidator,
    SignatureValidator,
)
from swarmavg.proto.dht_values import pack, unpack, unpack_subkey
from swarmavg.proto.lookup import Lookup
from swarmavg.proto.routing import RoutingTable, node_id

if TYPE_CHECKING:
    from swarmavg.aio.node import BackgroundTask, Node
    from swarmavg.aio.rpc import CallContext
    from swarmavg.identity import PeerID

__all__ = ["DHTNode", "DHTProtocol", "DictionaryEntries", "GetResult"]

logger = logging.getLogger(__name__)

#: Least recently seen peers of full buckets waiting for a liveness ping.
_MAX_PING_QUEUE: Final = 256
#: A peer whose clock is further off than this gets a warning at bootstrap (seconds).
_MAX_CLOCK_SKEW: Final = 5.0
#: Dictionary entries taken from one peer's answer.
_MAX_ENTRIES: Final = 4096


#: Addresses of peers named in answers (not yet proven) kept for dialing them.
_MAX_HINTS: Final = 4096

#: Rejoining (:meth:`DHTNode._rejoin`): below this many peers in the routing table (or ``k``),
#: the initial peers and the peers dropped for failures that are not in it are pinged again,
#: the first time this many seconds after the table became small, then with the delay doubled
#: after each try that reached nobody, up to the maximum (back to the first once one answers).
#: The maximum bounds how long a node whose link is back waits for its next try: a few
#: seconds (it was 10 s, and with a try in flight at the heal, a cut-off peer was now and then
#: not back in 15 s).
_REJOIN_BELOW: Final = 10
_REJOIN_FIRST: Final = 1.0
_REJOIN_MAX: Final = 4.0
#: Peers dropped for failures remembered for rejoining (the most recent), and for how long.
_MAX_DROPPED: Final = 64
_DROPPED_MEMORY: Final = 3600.0


class _NotAsked(ConnectError):
    """A lookup did not ask a peer an answer named: it is banned (it failed us lately), or
    we know no address of it. Not a failure of the peer's: counting it as one would ban it
    longer each time answers name it (after a cut, peers the others name stayed banned for
    minutes, so a node back from a cut did not take them back)."""


R = TypeVar("R", bound=Message)
#: What one query of a lookup learned: the peers the answer named, and whether it held a value.
_Reply = tuple[list[DHTPeerInfo], bool]


@dataclasses.dataclass(frozen=True, slots=True)
class _Query(Generic[R]):
    """What a lookup asks each peer: one request (encoded once, naming the candidates the
    lookup starts with as known), and how to read an answer (``read(peer, response)``: the
    reply, or :class:`RemoteProtocolError` for a bad one)."""

    method: str
    #: the request, given the ``known`` field (see :func:`known_prefixes`)
    request: Callable[[bytes], Message]
    response_type: type[R]
    read: Callable[[PeerID, R], _Reply]


def dialable_addresses(info: DHTPeerInfo) -> list[Address]:
    """The addresses ``info`` announces that parse and name no other peer, with its PeerID."""
    return list(_dialable(info.peer_id, tuple(info.addresses[:MAX_ADDRESSES])))


@functools.lru_cache(maxsize=4096)  # answers name the same peers over and over
def _dialable(peer: PeerID, texts: tuple[str, ...]) -> tuple[Address, ...]:
    addresses = []
    for text in texts:
        try:
            address = Address.parse(text)
        except ValueError:
            continue
        if address.peer_id == peer:
            addresses.append(address)
        elif address.peer_id is None:
            addresses.append(address.with_peer_id(peer))
    return tuple(addresses)


class _BadRequest(ValueError):
    pass


class DHTProtocol:
    """The serving half of a DHT node, attached to ``node``.

    :param node: the node whose identity and connections the DHT uses.
    :param k: bucket size, and how many nearest peers a find answers with.
    :param depth_modulo: the routing table's relaxed splitting rule.
    :param client_mode: serve nothing and announce no addresses (a node behind NAT): others do
        not add it to their routing tables.
    :param storage: the record storage (a default :class:`LocalStorage` if ``None``).
    :param validators: record validators, on top of owner signatures (always checked).
    :param quota: the per-peer store limits (a default :class:`StoreQuota` if ``None``).
    :param blacklist: peers that failed recently; they are not (re)added to the routing table
        while banned (a default :class:`Blacklist` if ``None``).
    :param announce: the addresses to announce (default: the node's listening addresses).
    :param clock: DHT time (for tests).
    """

    def __init__(
        self,
        node: Node,
        *,
        k: int = 20,
        depth_modulo: int = 5,
        client_mode: bool = False,
        storage: LocalStorage | None = None,
        validators: list[RecordValidator] | None = None,
        quota: StoreQuota[PeerID] | None = None,
        blacklist: Blacklist[PeerID] | None = None,
        announce: Callable[[], Sequence[Address]] | None = None,
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        self.node = node
        self.k = k
        self.client_mode = client_mode
        self.routing = RoutingTable(node_id(node.peer_id), k=k, depth_modulo=depth_modulo)
        self.storage = storage if storage is not None else LocalStorage()
        self.validator = CompositeValidator(
            [SignatureValidator(node.identity), *(validators or [])]
        )
        self.quota: StoreQuota[PeerID] = quota if quota is not None else StoreQuota()
        self.blacklist: Blacklist[PeerID] = blacklist if blacklist is not None else Blacklist()
        self._announce = announce
        self.clock = clock
        #: Called when a peer joins :attr:`ping_queue` (the DHT node wakes its pinger).
        self.on_stale: Callable[[], None] | None = None
        #: Where each peer in the routing table can be dialed (what it announced).
        self.addresses: dict[PeerID, list[Address]] = {}
        self._infos: dict[PeerID, DHTPeerInfo] = {}  # what finds say of them
        self._own_info: tuple[list[Address], DHTPeerInfo] | None = None
        #: Least recently seen peers of full buckets, to ping (and drop if they fail).
        self.ping_queue: deque[PeerID] = deque(maxlen=_MAX_PING_QUEUE)
        self._registered = False

    # -- serving -------------------------------------------------------------------------------

    def register(self) -> None:
        """Serve the DHT's methods on the node (client mode: only ``dht.ping``). Idempotent."""
        if self._registered:
            return
        self._registered = True
        rpc = self.node.rpc
        # Inline handlers: they never wait, so the transport answers them from its reader.
        rpc.register("dht.ping", self._ping, request_type=DHTPingRequest, inline=True)
        if not self.client_mode:
            rpc.register("dht.store", self._store, request_type=DHTStoreRequest, inline=True)
            rpc.register("dht.find", self._find, request_type=DHTFindRequest, inline=True)

    def announced_addresses(self) -> list[Address]:
        """Where other peers can dial us, as we tell them: the ``announce`` callable's answer
        (the facades give wildcard listeners expanded to this machine's interfaces), else the
        node's listening addresses."""
        return list(self._announce() if self._announce is not None else self.node.addresses)

    def own_info(self) -> DHTPeerInfo | None:
        """What requests announce about us (``None`` in client mode)."""
        if self.client_mode:
            return None
        announced = self.announced_addresses()
        if self._own_info is None or self._own_info[0] != announced:
            addresses = [str(a) for a in announced][:MAX_ADDRESSES]
            self._own_info = (list(announced), DHTPeerInfo(self.node.peer_id, addresses))
        return self._own_info[1]

    def learn(self, info: DHTPeerInfo | None, caller: PeerID) -> None:
        """Note a peer that called us or answered us, if it announced itself as routable."""
        if info is None or info.peer_id != caller:
            return  # client mode, or info about someone else: not proven, ignored
        if self.blacklist.is_banned(caller, self.clock()):
            return  # it failed us lately: not routable until its ban ends
        addresses = dialable_addresses(info)
        if not addresses:
            return  # nothing we could dial it at
        if self.addresses.get(caller) != addresses:
            self.addresses[caller] = addresses
            self._infos.pop(caller, None)
        stale = self.routing.add_or_update(caller, self.clock())
        if len(self.addresses) > 2 * len(self.routing) + 1024:
            self._prune_addresses()
        if stale is not None and stale not in self.ping_queue:
            self.ping_queue.append(stale)
            if self.on_stale is not None:
                self.on_stale()

    def _prune_addresses(self) -> None:
        """Keep the addresses of peers in the routing table or its replacement caches only."""
        known = {p for b in self.routing.buckets for p in (*b.peers, *b.replacements)}
        for peer in [p for p in self.addresses if p not in known]:
            del self.addresses[peer]
            self._infos.pop(peer, None)

    def forget(self, peer: PeerID) -> None:
        """``peer`` failed: drop it from the routing table and ban it for a while."""
        self.blacklist.failed(peer, self.clock())
        if self.routing.remove(peer):
            self.addresses.pop(peer, None)
            self._infos.pop(peer, None)

    def peer_info(self, peer: PeerID) -> DHTPeerInfo:
        """What we tell others about ``peer`` (cached: finds name the same peers often)."""
        info = self._infos.get(peer)
        if info is None:
            info = DHTPeerInfo(peer, [str(a) for a in self.addresses.get(peer, [])])
            if peer in self.addresses:
                self._infos[peer] = info
        return info

    def _ping(self, request: DHTPingRequest, ctx: CallContext) -> DHTPingResponse:
        self.learn(request.sender, ctx.peer_id)
        return DHTPingResponse(dht_time=self.clock(), serving=not self.client_mode)

    def _store(self, request: DHTStoreRequest, ctx: CallContext) -> DHTStoreResponse:
        count = len(request.keys)
        if count > MAX_KEYS_PER_REQUEST or not (
            len(request.subkeys) == len(request.values) == len(request.expirations) == count
        ):
            raise _BadRequest(
                f"a store carries at most {MAX_KEYS_PER_REQUEST} records in equal-length lists"
            )
        self.learn(request.sender, ctx.peer_id)
        now = self.clock()
        allowed = self.quota.admit(ctx.peer_id, count, now)
        if allowed < count:
            logger.debug(
                "%s is over its store quota: %d of %d records refused",
                ctx.peer_id.short(),
                count - allowed,
                count,
            )
        accepted = []
        for index, (key, subkey, value, expiration) in enumerate(
            zip(request.keys, request.subkeys, request.values, request.expirations, strict=True)
        ):
            record = DHTRecord(key, subkey, value, expiration)
            if index >= allowed or not self.validator.validate(record):
                accepted.append(False)
                continue
            result = self.storage.store(key, value, expiration, now, subkey=subkey)
            if result.accepted:
                self.quota.stored(ctx.peer_id, expiration)
            accepted.append(result.accepted)
        nearest = (
            self._nearest_infos(
                key_id(request.keys[0]), ctx.peer_id, request.nearest, parse_known(request.known)
            )
            if count
            else []
        )
        return DHTStoreResponse(accepted, nearest)

    def _nearest_infos(
        self, target: int, caller: PeerID, wanted: int = 0, known: frozenset[int] = frozenset()
    ) -> list[DHTPeerInfo]:
        """The peers we know nearest to ``target`` (but the caller), to tell the caller: k, or
        ``wanted`` if the caller asked for fewer; of those, the ones not ``known`` to it
        (node-id prefixes)."""
        count = wanted if 0 < wanted < self.k else self.k
        nearest = self.routing.nearest(target, count, exclude=caller)
        return [
            self.peer_info(peer)
            for peer, nid in nearest
            if not known or id_prefix(nid) not in known
        ]

    def _find(self, request: DHTFindRequest, ctx: CallContext) -> DHTFindResponse:
        if len(request.keys) + len(request.targets) > MAX_KEYS_PER_REQUEST:
            raise _BadRequest(f"a find asks for at most {MAX_KEYS_PER_REQUEST} keys")
        if any(len(t) != ID_BYTES for t in request.targets):
            raise _BadRequest(f"a target is a {ID_BYTES}-byte node id")
        self.learn(request.sender, ctx.peer_id)
        now = self.clock()
        known = parse_known(request.known)
        results = []
        for key in request.keys:
            nearest = self._nearest_infos(key_id(key), ctx.peer_id, request.nearest, known)
            found = self.storage.get(key, now)
            if isinstance(found, DictionaryValue):
                entries = [(s, v.value, v.expiration_time) for s, v in found.items.items()]
                results.append(DHTFound(None, 0.0, entries, nearest))
            elif found is not None:
                results.append(DHTFound(found.value, found.expiration_time, [], nearest))
            else:
                results.append(DHTFound(None, 0.0, [], nearest))
        for target in request.targets:
            nearest = self._nearest_infos(
                int.from_bytes(target, "big"), ctx.peer_id, request.nearest, known
            )
            results.append(DHTFound(None, 0.0, [], nearest))
        return DHTFindResponse(results)


#: What a get returns: ``None`` when nothing live is stored under the key, else
#: ``ValueWithExpiration(value, expiration_time)``; for a dictionary value, ``value`` is
#: ``{subkey: ValueWithExpiration(value, expiration_time)}`` and ``expiration_time`` the latest of
#: its subkeys' (hivemind's shape: ``value, expiration = get(key)`` works for both).
GetResult: TypeAlias = ValueWithExpiration[Any] | None
#: The value of a dictionary key as a get returns it: subkey -> (value, expiration_time).
DictionaryEntries: TypeAlias = dict[Any, ValueWithExpiration[Any]]


class DHTNode:
    """A DHT peer on ``node``: serves requests (:class:`DHTProtocol`) and asks other peers
    (iterative lookups, replicated stores, gets that merge what replicas hold).

    Use it as ``async with DHTNode(node, ...) as dht:``: entering bootstraps from
    ``initial_peers`` and starts the upkeep tasks (pinging the least recently seen peer of a full
    bucket when a newcomer wants its place, refreshing buckets nobody was seen in for
    ``refresh_period`` seconds); leaving stops them. The node itself stays open.

    :param node: the node to run on (already started).
    :param initial_peers: addresses (with PeerIDs) to bootstrap from.
    :param client_mode: ask and store, but serve nothing and stay out of routing tables.
    :param k: bucket size and lookup beam width.
    :param depth_modulo: relaxed bucket splitting: a bucket that does not hold our own id still
        splits unless its depth is a multiple of this (see :class:`RoutingTable`).
    :param alpha: lookup requests in flight at once.
    :param num_replicas: how many of the nearest peers a store goes to.
    :param request_timeout: seconds one request to one peer may take.
    :param validators: record validators, on top of owner signatures (always checked).
    :param cache_locally: keep what gets find (and what we store) in a local cache that answers
        later gets with ``latest=False`` without asking the network.
    :param cache_size: entries the cache holds (the soonest to expire make room).
    :param refresh_period: seconds after which a bucket nobody was seen in is refreshed with a
        lookup of a random id in it (``None``: never).
    :param max_records_per_peer: unexpired records one peer may store on this node.
    :param max_stores_per_second: records one peer may store here per second (bursts of up to
        ``max(512, 5 × this)``).
    :param blacklist_delay: seconds a peer that failed is not asked again; doubles with each
        failure in a row, up to ten minutes.
    :param announce: what to announce as our addresses (default: the node's listening
        addresses; the facade passes addresses with wildcards expanded).
    """

    def __init__(
        self,
        node: Node,
        *,
        initial_peers: Iterable[str | Address] = (),
        client_mode: bool = False,
        k: int = 20,
        depth_modulo: int = 5,
        alpha: int = 5,
        num_replicas: int = 5,
        request_timeout: float = 3.0,
        validators: list[RecordValidator] | None = None,
        cache_locally: bool = True,
        cache_size: int = 10_000,
        refresh_period: float | None = 600.0,
        max_records_per_peer: int = 10_000,
        max_stores_per_second: float = 100.0,
        blacklist_delay: float = 5.0,
        announce: Callable[[], Sequence[Address]] | None = None,
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        for name, count in (
            ("k", k),
            ("alpha", alpha),
            ("num_replicas", num_replicas),
            ("depth_modulo", depth_modulo),
            ("cache_size", cache_size),
            ("max_records_per_peer", max_records_per_peer),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{name} must be a positive int, not {count!r}")
        for name, seconds in (
            ("request_timeout", request_timeout),
            ("refresh_period", refresh_period),
            ("max_stores_per_second", max_stores_per_second),
        ):
            if seconds is not None and (
                isinstance(seconds, bool)
                or not isinstance(seconds, int | float)
                or not (seconds > 0 and math.isfinite(seconds))
            ):
                raise ValueError(f"{name} must be a positive, finite number, not {seconds!r}")
        if (
            isinstance(blacklist_delay, bool)
            or not isinstance(blacklist_delay, int | float)
            or not (blacklist_delay >= 0 and math.isfinite(blacklist_delay))
        ):
            raise ValueError(
                f"blacklist_delay must be a finite number >= 0, not {blacklist_delay!r}"
            )
        if not isinstance(client_mode, bool):
            raise TypeError(f"client_mode must be a bool, not {client_mode!r}")
        if not isinstance(cache_locally, bool):
            raise TypeError(f"cache_locally must be a bool, not {cache_locally!r}")
        if isinstance(initial_peers, str | Address):
            raise TypeError("initial_peers must be a list of addresses, not a single address")
        self.node = node
        self.protocol = DHTProtocol(
            node,
            k=k,
            depth_modulo=depth_modulo,
            client_mode=client_mode,
            validators=validators,
            quota=StoreQuota(
                max_records=max_records_per_peer,
                rate=max_stores_per_second,
                burst=max(float(MAX_KEYS_PER_REQUEST * 2), 5 * max_stores_per_second),
            ),
            blacklist=Blacklist(base_delay=blacklist_delay, max_delay=max(600.0, blacklist_delay)),
            announce=announce,
            clock=clock,
        )
        self.initial_peers = [Address.parse(a) for a in initial_peers]
        self.k = k
        self.alpha = alpha
        self.num_replicas = num_replicas
        self.request_timeout = request_timeout
        self.refresh_period = refresh_period
        self.cache: LocalStorage | None = LocalStorage(cache_size) if cache_locally else None
        self.clock = clock
        self._hints: dict[PeerID, list[Address]] = {}  # addresses answers named (unproven)
        #: peers dropped for failures, to rejoin through: peer -> (its address, DHT time)
        self._dropped: OrderedDict[PeerID, tuple[Address, float]] = OrderedDict()
        self._tasks: list[BackgroundTask] = []  # our upkeep tasks (run by the node)
        self._started = False
        self._wake_pinger: anyio.Event | None = None
        self._closed = False

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    def announced_addresses(self) -> list[Address]:
        """Where other peers can dial us, as we tell them (see
        :meth:`DHTProtocol.announced_addresses`): what the averagers put in their matchmaking
        declarations too."""
        return self.protocol.announced_addresses()

    @property
    def client_mode(self) -> bool:
        return self.protocol.client_mode

    @property
    def routing_table_size(self) -> int:
        """Peers in our routing table."""
        return len(self.protocol.routing)

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._started or self._closed:
            raise RuntimeError("a DHTNode can be started once")
        self._started = True
        await self.start()
        self._wake_pinger = anyio.Event()
        self.protocol.on_stale = self._wake_pinger.set
        spawn = self.node.spawn
        self._tasks.append(spawn(self._ping_stale_peers, name="dht: ping least recently seen"))
        if self.refresh_period is not None:
            self._tasks.append(spawn(self._refresh_buckets, name="dht: refresh buckets"))
        self._tasks.append(spawn(self._rejoin, name="dht: rejoin"))
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the upkeep tasks. Idempotent. The node goes on serving the DHT's methods until
        it closes (its routing table and storage stay valid)."""
        if self._closed:
            return
        self._closed = True
        self.protocol.on_stale = None
        for scope in self._tasks:
            scope.cancel()
        self._tasks.clear()

    async def start(self) -> None:
        """Serve the DHT's methods and bootstrap from ``initial_peers`` (entering the ``async
        with`` block does this; call it alone to run without the upkeep tasks).

        :raises ConnectError: if initial peers were given and none answered; the message
            names each and why.
        """
        self.protocol.register()
        if self.initial_peers:
            await self.bootstrap(self.initial_peers)

    async def bootstrap(self, addresses: Sequence[Address]) -> None:
        """Join the DHT through ``addresses`` (each with a PeerID): ping them, then look up our
        neighbourhood. Also for a node that started alone (e.g. an accumulator's ``connect``).

        :raises ConnectError: none of them answered; the message names each and why.
        """
        failures: list[str] = []

        async def ping(address: Address) -> None:
            try:
                await self._ping(address)
            except (SwarmError, OSError, TimeoutError, ValueError) as exc:
                failures.append(f"{address}: {type(exc).__name__}: {exc}")

        error: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                for address in addresses:
                    tg.start_soon(ping, address)
        except BaseExceptionGroup as group:
            error = sole_error(group)  # (a bug: the failures of peers are caught above)
        if error is not None:
            raise error
        if len(failures) == len(addresses):
            raise ConnectError("no initial peer answered: " + "; ".join(failures))
        for failure in failures:
            logger.warning("initial peer unreachable: %s", failure)
        await self.find_peers(node_id(self.peer_id))  # fill our neighbourhood

    async def _ping(self, address: Address) -> None:
        if address.peer_id is None:
            raise ValueError(f"initial peer {address} names no PeerID (/p/<peer-id>)")
        response = await self.node.rpc.call(
            address,
            "dht.ping",
            DHTPingRequest(self.protocol.own_info()),
            response_type=DHTPingResponse,
            timeout=self.request_timeout,
        )
        if response.serving:
            self._answered(address.peer_id, address)
        skew = response.dht_time - self.clock()
        if abs(skew) > _MAX_CLOCK_SKEW:
            logger.warning(
                "the clock of %s is %.1f s off ours: DHT expirations will look wrong",
                address.peer_id.short(),
                skew,
            )

    def _answered(self, peer: PeerID, address: Address) -> None:
        """``peer`` answered us at ``address``: it is alive and routable."""
        protocol = self.protocol
        protocol.blacklist.succeeded(peer)
        known = protocol.addresses.get(peer)
        if known is not None and address in known and peer in protocol.routing:
            protocol.routing.add_or_update(peer, self.clock())  # (the usual case: just seen)
            return
        protocol.learn(DHTPeerInfo(peer, [str(address)]), peer)

    def _failed(self, peer: PeerID, why: object) -> None:
        logger.debug("DHT peer %s failed: %s", peer.short(), why)
        address = self._address_of(peer)
        if address is not None and peer in self.protocol.routing:
            self._dropped.pop(peer, None)
            self._dropped[peer] = (address, self.clock())
            while len(self._dropped) > _MAX_DROPPED:
                self._dropped.popitem(last=False)
        self.protocol.forget(peer)
        self._hints.pop(peer, None)

    # -- upkeep --------------------------------------------------------------------------------

    async def _ping_stale_peers(self) -> None:
        """Ping the least recently seen peer of each full bucket a newcomer wanted a place in:
        a peer that answers keeps its place (Kademlia prefers old peers: they tend to stay), one
        that does not makes room for the newcomer (from the bucket's replacements)."""
        queue = self.protocol.ping_queue
        while True:
            if not queue:
                assert self._wake_pinger is not None
                await self._wake_pinger.wait()
                self._wake_pinger = anyio.Event()
                self.protocol.on_stale = self._wake_pinger.set
                continue
            peer = queue.popleft()
            address = self._address_of(peer)
            if address is None or peer not in self.protocol.routing:
                continue
            try:
                await self._ping(address)
            except (SwarmError, OSError, TimeoutError) as exc:
                self._failed(peer, exc)

    async def _refresh_buckets(self) -> None:
        """Every so often, look up a random id in each bucket nobody was seen in lately."""
        assert self.refresh_period is not None
        interval = min(60.0, self.refresh_period / 2)
        while True:
            await anyio.sleep(interval)
            routing = self.protocol.routing
            for bucket in routing.stale_buckets(self.clock(), self.refresh_period):
                target = routing.random_id_in(bucket)
                logger.debug("refreshing a bucket of %d peers", len(bucket))
                await self.find_peers(target)

    async def _rejoin(self) -> None:
        """Every :data:`_REJOIN_FIRST` seconds, while the routing table holds fewer than
        :data:`_REJOIN_BELOW` (or ``k``) peers, ping the initial peers and the peers dropped
        for failures (within :data:`_DROPPED_MEMORY`) that are not in it; those that answer
        are taken back (their bans lifted), and a lookup of our own id refills the table from
        them. A try that reached nobody doubles the delay to the next, up to
        :data:`_REJOIN_MAX`. A node cut off for a while (every request failing, every peer
        dropped, as the others dropped it) finds its way back by itself once its link is."""
        delay = _REJOIN_FIRST
        while True:
            await anyio.sleep(delay)
            if len(self.protocol.routing) >= min(_REJOIN_BELOW, self.k):
                delay = _REJOIN_FIRST
                continue
            candidates = self._rejoin_candidates()
            if not candidates:
                delay = _REJOIN_FIRST
                continue
            if await self._rejoin_through(candidates):
                delay = _REJOIN_FIRST
            else:
                delay = min(2 * delay, _REJOIN_MAX)

    def _rejoin_candidates(self) -> list[Address]:
        """Where to rejoin through: one address of each initial peer and remembered dropped
        peer that is not in the routing table."""
        routing = self.protocol.routing
        since = self.clock() - _DROPPED_MEMORY
        while self._dropped and next(iter(self._dropped.values()))[1] < since:
            self._dropped.popitem(last=False)
        found: dict[PeerID, Address] = {}
        for address in (*self.initial_peers, *(a for a, _ in self._dropped.values())):
            peer = address.peer_id
            if peer is not None and peer != self.peer_id and peer not in routing:
                found.setdefault(peer, address)
        return list(found.values())

    async def _rejoin_through(self, candidates: list[Address]) -> bool:
        """Ping ``candidates`` at once (each within ``request_timeout``); if any answered,
        look up our own id. Whether any answered."""
        answered: list[Address] = []
        before = len(self.protocol.routing)

        async def ping(address: Address) -> None:
            try:
                await self._ping(address)
            except (SwarmError, OSError, TimeoutError, ValueError) as exc:
                logger.debug("rejoin: %s did not answer: %s", address, exc)
                if isinstance(exc, TimeoutError) and address.peer_id is not None:
                    await self._drop_connection(address.peer_id)
                return
            answered.append(address)

        async with anyio.create_task_group() as tg:
            for address in candidates:
                tg.start_soon(ping, address)
        if not answered:
            return False
        logger.info(
            "rejoining the DHT (%d peers in the routing table): %d of %d known peers answered",
            before,
            len(answered),
            len(candidates),
        )
        for address in answered:
            assert address.peer_id is not None
            self._dropped.pop(address.peer_id, None)
        await self.find_peers(node_id(self.peer_id))
        return True

    async def _drop_connection(self, peer: PeerID) -> None:
        """Close our pooled connection to ``peer`` (a rejoin ping over it timed out), so that
        the next try dials afresh. After a cut, a TCP connection holds what we sent during it
        until its retransmission timer fires, and that timer backed off for as long as the cut
        lasted: the link is back long before such a connection carries anything again, while a
        new one works at once. Only a connection silent for ``request_timeout`` is closed: one
        that carries data is alive, its ping only slow behind a bulk transfer (closing it broke
        the all-reduce it carried); one whose transport does not tell (QUIC) is kept."""
        conn = self.node.connection_to(peer)
        if conn is None:
            return
        idle = conn.idle_seconds()
        if idle is None or idle < self.request_timeout:
            return  # (it carries data: alive, only slow to answer, e.g. full of a bulk transfer)
        logger.debug("rejoin: closing our silent connection to %s", peer.short())
        with anyio.move_on_after(self.request_timeout):  # (closing is bounded; bounded twice)
            await conn.aclose()

    # -- asking ----------------------------------------------------------------------------------

    def _address_of(self, peer: PeerID) -> Address | None:
        known = self.protocol.addresses.get(peer) or self._hints.get(peer)
        return known[0] if known else None

    def _candidates(self, infos: list[DHTPeerInfo]) -> list[tuple[PeerID, int]]:
        """The peers an answer named (at most k), noting where to dial the ones we do not know."""
        nearest = []
        for info in infos[: self.k]:
            if info.peer_id == self.peer_id:
                continue
            if info.peer_id not in self.protocol.addresses:
                addresses = dialable_addresses(info)
                if not addresses:
                    continue
                self._hints[info.peer_id] = addresses
            nearest.append((info.peer_id, node_id(info.peer_id)))
        if len(self._hints) > _MAX_HINTS:
            for peer in list(self._hints)[: len(self._hints) - _MAX_HINTS]:
                del self._hints[peer]
        return nearest

    async def _lookup(
        self,
        target: int,
        beam: int,
        query: _Query[Any],
        *,
        stop_on_value: bool = False,
        with_self: bool = False,
    ) -> Lookup:
        """Drive a lookup of ``target`` with a beam of ``beam`` peers, asking each ``query``
        (see :class:`_Queries`). ``with_self``: this node counts as one of the beam that
        already answered (the caller has read its own storage), so where it is among the
        nearest, one peer fewer is asked."""
        lookup = Lookup(
            target,
            k=beam,
            alpha=self.alpha,
            stop_on_value=stop_on_value,
            exclude=[self.peer_id],
        )
        if with_self:
            lookup.add_responded(self.peer_id, node_id(self.peer_id))
        # the beam, and as many again to stand in for peers that fail: the peers an answer
        # would name (see _named_per_answer), which the request then says we know
        wanted = max(beam, self.alpha, min(self.k, 2 * beam))
        candidates = self.protocol.routing.nearest(target, wanted)
        lookup.add_candidates(candidates)
        if lookup.finished:
            return lookup
        known = known_prefixes(nid for _, nid in candidates)
        queries = _Queries(self, lookup, query, Prepared(query.request(known)))
        try:
            await queries.run()
        finally:
            await queries.aclose()
        return lookup

    async def find_peers(self, target: int) -> list[PeerID]:
        """The k peers nearest to the node id ``target`` that answered us (a node lookup)."""

        def request(known: bytes) -> DHTFindRequest:
            target_bytes = target.to_bytes(ID_BYTES, "big")
            return DHTFindRequest(self.protocol.own_info(), [], [target_bytes], 0, known)

        def read(peer: PeerID, response: DHTFindResponse) -> _Reply:
            return _one_result(response).nearest, False

        query = _Query("dht.find", request, DHTFindResponse, read)
        lookup = await self._lookup(target, self.k, query)
        return lookup.nearest_responded()

    def _named_per_answer(self) -> int:
        """How many peers a store's or a get's answers should name: twice the beam of
        ``num_replicas`` (the rest stand in for peers that fail), not k: in a swarm of more than
        k peers, decoding k peer infos per answer was a quarter of a lookup's CPU."""
        return min(self.k, 2 * self.num_replicas)

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) on the ``num_replicas`` peers nearest
        to the key until ``expiration_time`` (DHT time); whether at least one peer (or we, if
        we are among the nearest or alone) accepted it.

        The store requests are themselves the lookup: each peer that takes a record answers
        with the peers it knows nearer the key, and those are asked next, until the
        ``num_replicas`` nearest peers found have all answered. This node is one of them when
        it is among the nearest (it stores the record itself and asks one peer fewer).

        :raises ValueError: the record is too large, or does not pass our validators (a key
            owned by another peer, a value the schema refuses).
        :raises TypeError: the key, subkey or value cannot be serialized (msgpack types and
            tuples, see :mod:`swarmavg.proto.dht_values`), or the subkey is unhashable.
        """
        key_bytes = pack(key, "key")
        subkey_bytes = None
        if subkey is not None:
            try:
                hash(subkey)
            except TypeError:
                raise TypeError(
                    f"a subkey must be hashable (gets return a dict), not {type(subkey).__name__}"
                ) from None
            subkey_bytes = pack(subkey, "subkey")
        record = DHTRecord(key_bytes, subkey_bytes, pack(value), float(expiration_time))
        signed = self.protocol.validator.sign_value(record)
        limits = self.protocol.storage
        for what, size, limit in (
            ("key", len(key_bytes), limits.max_key_size),
            ("subkey", len(subkey_bytes or b""), limits.max_key_size),
            ("value", len(signed), limits.max_value_size),
        ):
            if size > limit:
                raise ValueError(f"the {what} is {size} bytes serialized; the limit is {limit}")
        if not self.protocol.validator.validate(dataclasses.replace(record, value=signed)):
            raise ValueError(f"the record under {key!r} does not pass this DHT's validators")
        target = key_id(key_bytes)

        def request(known: bytes) -> DHTStoreRequest:
            return DHTStoreRequest(
                self.protocol.own_info(),
                [key_bytes],
                [subkey_bytes],
                [signed],
                [record.expiration_time],
                self._named_per_answer(),
                known,
            )

        accepted_by: list[PeerID] = []

        def read(peer: PeerID, response: DHTStoreResponse) -> _Reply:
            if response.accepted[:1] == [True]:
                accepted_by.append(peer)
            return response.nearest, False

        query = _Query("dht.store", request, DHTStoreResponse, read)
        serving = not self.protocol.client_mode  # (a client-mode node stores nothing)
        lookup = await self._lookup(target, self.num_replicas, query, with_self=serving)
        accepted = bool(accepted_by)
        if serving and self.peer_id in lookup.nearest_responded(self.num_replicas):
            result = self.protocol.storage.store(
                key_bytes, signed, record.expiration_time, self.clock(), subkey=subkey_bytes
            )
            accepted = accepted or result.accepted
        if accepted and self.cache is not None:
            self.cache.store(
                key_bytes, signed, record.expiration_time, self.clock(), subkey=subkey_bytes
            )
        return accepted

    async def get(self, key: Any, latest: bool = False) -> GetResult:
        """The value under ``key`` as ``ValueWithExpiration(value, expiration_time)``: the first
        found (our own storage, then the cache, then the network), or with ``latest`` the newest
        held by the peers nearest the key; ``None`` if nothing live is stored under it.

        A dictionary key (stored with subkeys) gives ``ValueWithExpiration({subkey:
        ValueWithExpiration(value, expiration_time)}, <the latest of those expirations>)``, its
        subkeys merged across the replicas (the newest value of each); once all its subkeys
        expired, ``None``. Where replicas hold a plain value and a dictionary, the one that
        expires later wins (the dictionary on a tie), as in storage. This is hivemind's
        ``DHTNode.get``: ``value, expiration = await node.get(key)`` works for both kinds.

        Records that do not validate, values or subkeys that do not decode (see
        :func:`swarmavg.proto.dht_values.unpack`) and unhashable subkeys are ignored: an
        invalid record never shadows an older valid one.

        :raises TypeError: the key cannot be serialized.
        """
        key_bytes = pack(key, "key")
        now = self.clock()
        # the newest valid record so far: as stored (for the cache) and decoded; per subkey
        # (by its bytes) for a dictionary, with the subkey decoded
        plain: tuple[ValueWithExpiration[bytes], Any] | None = None
        entries: dict[bytes, tuple[ValueWithExpiration[bytes], Any, Any]] = {}

        def consider(subkey: bytes | None, value: bytes, expiration: float) -> None:
            # only a record that would replace the newest so far is validated and decoded
            # (replicas mostly answer the same record: a latest get saw it 4-5 times)
            nonlocal plain
            if expiration <= now:
                return
            entry = entries.get(subkey) if subkey is not None else None
            if subkey is None:
                best = plain[0] if plain is not None else None
            else:
                best = entry[0] if entry is not None else None
            if best is not None and expiration <= best.expiration_time:
                return
            record = DHTRecord(key_bytes, subkey, value, expiration)
            if not self.protocol.validator.validate(record):
                return
            try:
                decoded = unpack(self.protocol.validator.strip_value(record))
                if subkey is not None:
                    decoded_subkey = entry[1] if entry is not None else unpack_subkey(subkey)
            except (RemoteProtocolError, ValueError) as exc:
                logger.debug("ignoring a record under %r that does not decode: %s", key, exc)
                return
            item = ValueWithExpiration(value, expiration)
            if subkey is None:
                plain = (item, decoded)
            else:
                entries[subkey] = (item, decoded_subkey, decoded)

        local = self.protocol.storage.get(key_bytes, now)
        if local is None and not latest and self.cache is not None:
            local = self.cache.get(key_bytes, now)
        if isinstance(local, DictionaryValue):
            for subkey, item in local.items.items():
                consider(subkey, item.value, item.expiration_time)
        elif local is not None:
            consider(None, local.value, local.expiration_time)
        if local is None or latest:

            def request(known: bytes) -> DHTFindRequest:
                own = self.protocol.own_info()
                return DHTFindRequest(own, [key_bytes], [], self._named_per_answer(), known)

            def read(peer: PeerID, response: DHTFindResponse) -> _Reply:
                result = _one_result(response)
                if result.value is not None:
                    consider(None, result.value, result.expiration)
                for entry_key, entry_value, entry_exp in result.entries[:_MAX_ENTRIES]:
                    consider(entry_key, entry_value, entry_exp)
                # (found: a valid record so far; one that does not validate or decode does
                # not end a lookup for the first value found)
                return result.nearest, plain is not None or bool(entries)

            await self._lookup(
                key_id(key_bytes),
                self.num_replicas,
                _Query("dht.find", request, DHTFindResponse, read),
                stop_on_value=not latest,
                with_self=not self.protocol.client_mode,  # (our own storage was read above)
            )
            if self.cache is not None:
                if plain is not None:
                    stored = plain[0]
                    self.cache.store(key_bytes, stored.value, stored.expiration_time, now)
                for subkey, (stored, _, _) in entries.items():
                    self.cache.store(key_bytes, stored.value, stored.expiration_time, now, subkey)
        newest_entry = max((e[0].expiration_time for e in entries.values()), default=-1.0)
        if plain is not None and plain[0].expiration_time > newest_entry:
            return ValueWithExpiration(plain[1], plain[0].expiration_time)
        if not entries:
            return None
        dictionary: DictionaryEntries = {}
        for stored, subkey_value, value in entries.values():
            # (two encodings of one subkey, e.g. 1 and 1.0, may come from other peers: the
            # later expiration wins, as it would for one encoding)
            known = dictionary.get(subkey_value)
            if known is None or stored.expiration_time > known.expiration_time:
                dictionary[subkey_value] = ValueWithExpiration(value, stored.expiration_time)
        return ValueWithExpiration(dictionary, newest_entry)


def _one_result(response: DHTFindResponse) -> DHTFound:
    """The one result of a find of one key or target."""
    if len(response.results) != 1:
        raise RemoteProtocolError("dht.find answered with the wrong number of results")
    return response.results[0]


class _Queries(Generic[R]):
    """The queries of one lookup, driven by the lookup's task.

    The requests go out from this task, and the answers are read here as they arrive
    (:meth:`Stream.on_readable <swarmavg.abc.Stream.on_readable>` tells which call to read)
    without a task, a cancel scope or a timer per query: one scope bounds the sending of a
    batch of requests, one wait with the earliest deadline stands for all the answers still
    due. A query to a peer that must be dialed first, or over a transport that cannot call
    back, runs in a background task of the node instead (a slow dial never holds up the
    others), cancelled when the lookup ends.
    """

    def __init__(self, dht: DHTNode, lookup: Lookup, query: _Query[R], request: Prepared) -> None:
        self._dht = dht
        self._lookup = lookup
        self._query = query
        self._request = request
        self._timeout = dht.request_timeout
        #: calls in flight whose answers this task reads (by peer)
        self._pending: dict[PeerID, tuple[PendingCall[R], Address]] = {}
        #: settled queries not yet handled: (peer, address, the call or why it failed)
        self._ready: deque[tuple[PeerID, Address | None, PendingCall[R] | Exception]] = deque()
        self._tasks: set[BackgroundTask] = set()  # queries running in tasks of their own
        self._closed = False
        self._wake: asyncio.Future[None] | anyio.Event | None = None
        try:  # on asyncio, the wait is a bare future with a timer (the cheapest there is)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    async def run(self) -> None:
        lookup = self._lookup
        dht = self._dht
        await self._start(lookup.next_queries())
        while not lookup.finished:
            if not self._ready:
                if not self._pending and not self._tasks:
                    return  # (nothing can arrive: the lookup's bookkeeping says otherwise)
                await self._wait()
                continue
            peer, address, outcome = self._ready.popleft()
            reply: _Reply | None = None
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                try:
                    response = outcome.result()
                finally:
                    await outcome.aclose()
                reply = self._query.read(peer, response)
            except _NotAsked:  # (not a failure of the peer's: its ban is not made longer)
                lookup.on_failure(peer)
            except (SwarmError, OSError, TimeoutError) as exc:
                dht._failed(peer, f"{self._query.method}: {exc}")
                lookup.on_failure(peer)
            else:
                assert address is not None
                dht._answered(peer, address)
                named, found = reply
                lookup.on_response(peer, dht._candidates(named), found=found)
            await self._start(lookup.next_queries())

    async def aclose(self) -> None:
        """Leave the calls still in flight (their streams are reset) and the query tasks."""
        self._closed = True
        for scope in self._tasks:
            scope.cancel()
        pending, self._pending = self._pending, {}
        for call, _address in pending.values():
            await call.aclose()
        while self._ready:
            outcome = self._ready.popleft()[2]
            if not isinstance(outcome, Exception):
                await outcome.aclose()

    # -- sending ---------------------------------------------------------------------------------

    async def _start(self, peers: list[PeerID]) -> None:
        """Send the requests to ``peers``: from this task to the peers we are connected to,
        under one deadline; to the others from tasks of their own."""
        dht = self._dht
        if not dht.node.is_running:  # (it closed under the lookup: that ends with what it has)
            for peer in peers:
                self._settled(peer, None, ConnectError("the node is closed"))
            return
        now: list[tuple[PeerID, Address]] = []
        for peer in peers:
            address = dht._address_of(peer)
            if address is None or dht.protocol.blacklist.is_banned(peer, dht.clock()):
                self._settled(peer, None, _NotAsked(f"no address to ask {peer}, or banned"))
            elif dht.node.connection_to(peer) is None:
                self._in_task(self._start_in_task, peer, address)
            else:
                now.append((peer, address))
        done = 0
        while done < len(now):
            try:
                with anyio.fail_after(self._timeout):
                    for peer, address in now[done:]:
                        try:
                            call = await self._call(address)
                        except (SwarmError, OSError, anyio.ClosedResourceError) as exc:
                            self._settled(peer, address, exc)
                        else:
                            if not self._watch(peer, address, call):
                                self._in_task(self._wait_in_task, peer, address, call)
                        done += 1
            except TimeoutError:  # the request to now[done] could not be sent in time
                peer, address = now[done]
                self._settled(peer, address, TimeoutError("sending the request timed out"))
                done += 1

    async def _call(self, address: Address) -> PendingCall[R]:
        if not self._dht.node.is_running:  # (it closed under the lookup; its tasks stop soon)
            raise ConnectError("the node is closed")
        query = self._query
        return await self._dht.node.rpc.start_call(
            address,
            query.method,
            self._request,
            response_type=query.response_type,
            timeout=self._timeout,
            bounded=False,
        )

    def _in_task(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        scope: BackgroundTask | None = None

        async def run() -> None:
            try:
                await fn(*args)
            finally:
                self._tasks.discard(scope)
                self._wakeup()

        scope = self._dht.node.spawn(run, name="dht query")
        self._tasks.add(scope)

    async def _start_in_task(self, peer: PeerID, address: Address) -> None:
        try:
            with anyio.fail_after(self._timeout):
                call = await self._call(address)
        except (SwarmError, OSError, TimeoutError, anyio.ClosedResourceError) as exc:
            self._settled(peer, address, exc)
            return
        if self._closed:
            await call.aclose()
        elif not self._watch(peer, address, call):
            await self._wait_in_task(peer, address, call)

    async def _wait_in_task(self, peer: PeerID, address: Address, call: PendingCall[R]) -> None:
        try:
            await call.wait()
        finally:
            if self._closed:
                await call.aclose()
        self._settled(peer, address, call)

    # -- reading ---------------------------------------------------------------------------------

    def _watch(self, peer: PeerID, address: Address, call: PendingCall[R]) -> bool:
        """Have the answer of ``call`` read by the lookup's task; ``False`` if the transport
        cannot call back (a task must wait for it)."""
        self._pending[peer] = (call, address)
        if call.on_ready(functools.partial(self._readable, peer, call)):
            return True
        del self._pending[peer]
        return False

    def _readable(self, peer: PeerID, call: PendingCall[R]) -> None:
        """(From the transport) the answer of ``call`` may be here."""
        entry = self._pending.get(peer)
        if entry is None or entry[0] is not call:
            return  # left already
        if call.poll():
            del self._pending[peer]
            self._settled(peer, entry[1], call)
        elif not call.on_ready(functools.partial(self._readable, peer, call)):
            call.expire()  # (cannot happen: the transport could call back before)
            del self._pending[peer]
            self._settled(peer, entry[1], call)

    def _settled(
        self, peer: PeerID, address: Address | None, outcome: PendingCall[R] | Exception
    ) -> None:
        if not self._closed:
            self._ready.append((peer, address, outcome))
            self._wakeup()

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is None:
            return
        if isinstance(wake, anyio.Event):
            wake.set()
        elif not wake.done():
            wake.set_result(None)

    async def _wait(self) -> None:
        """Until a query settles, or the earliest deadline of those in flight passes (those
        past it have then timed out)."""
        deadline = min((call.deadline for call, _ in self._pending.values()), default=math.inf)
        loop = self._loop
        try:
            if loop is not None:  # (anyio's clock on asyncio is the loop's)
                self._wake = wake = loop.create_future()
                timer = loop.call_at(deadline, _wake_up, wake) if deadline < math.inf else None
                try:
                    await wake
                finally:
                    if timer is not None:
                        timer.cancel()
            else:
                self._wake = event = anyio.Event()
                with anyio.CancelScope(deadline=deadline):  # (move_on_at: anyio >= 4.15)
                    await event.wait()
        finally:
            self._wake = None
        if not self._ready:
            now = anyio.current_time()
            for peer, (call, address) in list(self._pending.items()):
                if call.deadline <= now:
                    call.expire()
                    del self._pending[peer]
                    self._settled(peer, address, call)


def _wake_up(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
