"""The DHT over a :class:`~swarmavg.aio.node.Node` (in progress: the serving half).

:class:`DHTProtocol` answers the DHT's RPCs on a node: bulk ping, store and find, backed by the
sans-IO routing table (:mod:`swarmavg.proto.routing`), record storage
(:mod:`swarmavg.proto.dht_storage`) and validators (:mod:`swarmavg.proto.dht_validation`). It
learns peers from the requests they make: a request's ``sender`` info counts only if it names
the caller's own, authenticated PeerID, and client-mode callers (no sender info) never enter the
routing table. The asking half (iterative lookups, replication, bootstrap) builds on it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from swarmavg._time import get_dht_time
from swarmavg.address import Address
from swarmavg.proto.dht_messages import (
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
    key_id,
)
from swarmavg.proto.dht_storage import DictionaryValue, LocalStorage
from swarmavg.proto.dht_validation import (
    CompositeValidator,
    DHTRecord,
    RecordValidator,
    SignatureValidator,
)
from swarmavg.proto.routing import RoutingTable, node_id

if TYPE_CHECKING:
    from swarmavg.aio.node import Node
    from swarmavg.aio.rpc import CallContext
    from swarmavg.identity import PeerID

__all__ = ["DHTProtocol"]

logger = logging.getLogger(__name__)

#: Least recently seen peers of full buckets waiting for a liveness ping.
_MAX_PING_QUEUE: Final = 256


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
        self.clock = clock
        #: Where each peer in the routing table can be dialed (what it announced).
        self.addresses: dict[PeerID, list[Address]] = {}
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
        rpc.register("dht.ping", self._ping, request_type=DHTPingRequest)
        if not self.client_mode:
            rpc.register("dht.store", self._store, request_type=DHTStoreRequest)
            rpc.register("dht.find", self._find, request_type=DHTFindRequest)

    def own_info(self) -> DHTPeerInfo | None:
        """What requests announce about us (``None`` in client mode)."""
        if self.client_mode:
            return None
        addresses = [str(a) for a in self.node.addresses][:MAX_ADDRESSES]
        return DHTPeerInfo(self.node.peer_id, addresses)

    def learn(self, info: DHTPeerInfo | None, caller: PeerID) -> None:
        """Note a peer that called us or answered us, if it announced itself as routable."""
        if info is None or info.peer_id != caller:
            return  # client mode, or info about someone else: not proven, ignored
        addresses = []
        for text in info.addresses[:MAX_ADDRESSES]:
            try:
                address = Address.parse(text)
            except ValueError:
                continue
            if address.peer_id in (None, caller):
                addresses.append(address.with_peer_id(caller))
        if not addresses:
            return  # nothing we could dial it at
        self.addresses[caller] = addresses
        stale = self.routing.add_or_update(caller, self.clock())
        if stale is not None and stale not in self.ping_queue:
            self.ping_queue.append(stale)

    def forget(self, peer: PeerID) -> None:
        """``peer`` failed: drop it from the routing table."""
        if self.routing.remove(peer):
            self.addresses.pop(peer, None)

    def peer_info(self, peer: PeerID) -> DHTPeerInfo:
        return DHTPeerInfo(peer, [str(a) for a in self.addresses.get(peer, [])])

    async def _ping(self, request: DHTPingRequest, ctx: CallContext) -> DHTPingResponse:
        self.learn(request.sender, ctx.peer_id)
        return DHTPingResponse(dht_time=self.clock(), serving=not self.client_mode)

    async def _store(self, request: DHTStoreRequest, ctx: CallContext) -> DHTStoreResponse:
        count = len(request.keys)
        if count > MAX_KEYS_PER_REQUEST or not (
            len(request.subkeys) == len(request.values) == len(request.expirations) == count
        ):
            raise _BadRequest(
                f"a store carries at most {MAX_KEYS_PER_REQUEST} records in equal-length lists"
            )
        self.learn(request.sender, ctx.peer_id)
        now = self.clock()
        accepted = []
        for key, subkey, value, expiration in zip(
            request.keys, request.subkeys, request.values, request.expirations, strict=True
        ):
            record = DHTRecord(key, subkey, value, expiration)
            if not self.validator.validate(record):
                accepted.append(False)
                continue
            result = self.storage.store(key, value, expiration, now, subkey=subkey)
            accepted.append(result.accepted)
        return DHTStoreResponse(accepted)

    async def _find(self, request: DHTFindRequest, ctx: CallContext) -> DHTFindResponse:
        if len(request.keys) > MAX_KEYS_PER_REQUEST:
            raise _BadRequest(f"a find asks for at most {MAX_KEYS_PER_REQUEST} keys")
        self.learn(request.sender, ctx.peer_id)
        now = self.clock()
        results = []
        for key in request.keys:
            nearest = [
                self.peer_info(peer)
                for peer, _ in self.routing.nearest(key_id(key), self.k, exclude=ctx.peer_id)
            ]
            found = self.storage.get(key, now)
            if isinstance(found, DictionaryValue):
                entries = [(s, v.value, v.expiration_time) for s, v in found.items.items()]
                results.append(DHTFound(None, 0.0, entries, nearest))
            elif found is not None:
                results.append(DHTFound(found.value, found.expiration_time, [], nearest))
            else:
                results.append(DHTFound(None, 0.0, [], nearest))
        return DHTFindResponse(results)
