"""Matchmaking through the DHT: peers that want to average find each other and form a group.

A peer looking for a group *declares* itself under its group key (``<prefix>.0b<bits>``, a DHT
dictionary: subkey its PeerID, value its tensor schema, expiring when it wants to start). It then
reads the key's declarations and asks the best-ranked peer with the same schema (earliest
expiration, then smallest PeerID: :func:`~swarmavg.proto.matchmaking.choose_leader`) to take it
in, over a server-stream call (``avg.join``): the leader answers ``accepted`` and later ``begin``
with the group, or ``disband``; or ``rejected`` at once (it is not leading, is full, or averages
other tensors), and the peer asks the next one. A peer that ranks first leads: it accepts
followers until ``target_group_size`` members are in, or until its declared time comes with at
least ``min_group_size``, then sends every follower the group (a random id, the members in
PeerID order with their metadata). While it leads it keeps reading the key: if a better-ranked
leader appears it disbands its followers (they look again and find that leader) and joins it.

A peer that follows rejects join requests (pointing to its leader), and every peer only asks
peers ranked better than itself, so two peers never wait for each other; a peer that has not yet
decided (it still reads the key) holds a request for its key until it leads or follows, for at
most half of ``request_timeout``. Client-mode peers (nobody can dial them) never
declare or lead; they only follow.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

import anyio
import msgpack

from swarmavg._time import get_dht_time
from swarmavg.abc._averaging import Group, GroupInfo, GroupMember, Matchmaker, MemberMode
from swarmavg.address import Address
from swarmavg.errors import MatchmakingFailed, SwarmError
from swarmavg.proto.averaging_messages import JoinReply, JoinRequest, MemberInfo
from swarmavg.proto.matchmaking import choose_leader, group_key

if TYPE_CHECKING:
    from swarmavg.aio.dht import DHTNode
    from swarmavg.aio.rpc import CallContext
    from swarmavg.identity import PeerID

__all__ = ["DHTMatchmaker", "GroupInfo", "MatchmakingFailed"]

logger = logging.getLogger(__name__)

JOIN_METHOD: Final = "avg.join"
#: How often a leader re-reads its key for a better leader, and a client between tries (s):
#: first after _FIRST_POLL (peers that start together see each other at once), then 1.5 times as
#: long each time, up to _POLL.
_POLL: Final = 0.25
_FIRST_POLL: Final = 0.02
#: A withdrawn declaration expires this much after the one it replaces (a later expiration is
#: what lets it replace it).
_WITHDRAWN: Final = 1e-3
#: A declaration carries at most this many of our addresses (others read the first), each at
#: most this long; we remember the addresses of this many declared peers.
_MAX_ADDRESSES: Final = 4
_MAX_ADDRESS_LENGTH: Final = 512
_MAX_DECLARED: Final = 4096


def _member_info(info: MemberInfo) -> GroupMember:
    mode = MemberMode(info.mode)
    address = None
    if mode is not MemberMode.CLIENT and info.addresses:
        address = Address.parse(info.addresses[0]).with_peer_id(info.peer_id)
    bandwidth = None if info.bandwidth < 0 else info.bandwidth
    return GroupMember(info.peer_id, address, bandwidth, mode)


def _valid_member(info: MemberInfo) -> bool:
    """Whether a would-be follower's info makes a usable group member."""
    bandwidth = info.bandwidth
    if math.isnan(bandwidth) or math.isinf(bandwidth):
        return False
    try:
        _member_info(info)
    except ValueError:
        return False
    return info.mode == "client" or bool(info.addresses)


def _group_info(group_id: bytes, members: list[MemberInfo], leader: PeerID) -> GroupInfo:
    group = Group(group_id, tuple(_member_info(m) for m in members))
    return GroupInfo(group, {m.peer_id: m.gather for m in members}, leader)


class _Leading:
    """The state of a peer that leads: the followers it took in, and when it begins."""

    def __init__(self, key: str, schema: bytes, target: int) -> None:
        self.key = key
        self.schema = schema
        self.target = target
        self.followers: dict[PeerID, MemberInfo] = {}
        self.full = anyio.Event()
        self.outcome: JoinReply | None = None
        self.settled = anyio.Event()

    def settle(self, reply: JoinReply) -> None:
        self.outcome = reply
        self.settled.set()


_matchmakers: weakref.WeakKeyDictionary[Any, dict[str, DHTMatchmaker]] = weakref.WeakKeyDictionary()


class DHTMatchmaker(Matchmaker):
    """Forms groups of peers that average the same tensors under ``prefix``.

    :param dht: the DHT node (its node serves ``avg.join``).
    :param prefix: the averaging run's name: group keys are ``<prefix>.0b<bits>``.
    :param schema: the digest of the averaged tensors' shapes and dtypes; only equal ones group.
    :param target_group_size: begin as soon as this many members are in.
    :param min_group_size: begin at the declared time with at least this many.
    :param request_timeout: how long a leader may take to answer a join request (s).
    :param mode: how this peer takes part (client-mode peers only follow).
    :param bandwidth: this peer's bandwidth (``None``: unknown), for load balancing.
    """

    def __init__(
        self,
        dht: DHTNode,
        *,
        prefix: str,
        schema: bytes,
        target_group_size: int,
        min_group_size: int = 2,
        request_timeout: float = 3.0,
        mode: MemberMode = MemberMode.NODE,
        bandwidth: float | None = None,
    ) -> None:
        if not (isinstance(target_group_size, int) and target_group_size >= 1):
            raise ValueError(f"target_group_size must be an int >= 1, not {target_group_size!r}")
        if not (isinstance(min_group_size, int) and 1 <= min_group_size <= target_group_size):
            raise ValueError(
                f"min_group_size must be an int in 1..target_group_size, not {min_group_size!r}"
            )
        group_key(prefix, "")  # checks the prefix
        self.dht = dht
        self.prefix = prefix
        self.schema = schema
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.request_timeout = request_timeout
        self.mode = mode
        self.bandwidth = bandwidth
        self._leading: _Leading | None = None
        self._following: tuple[PeerID, Address | None] | None = None  # the leader we wait for
        self._declared: dict[PeerID, Address] = {}  # addresses read in declarations
        self._looking = False
        self._key: str | None = None  # the key we look under (while looking)
        #: set (and replaced) whenever we start or stop leading, following or looking
        self._changed = anyio.Event()
        registry = _matchmakers.get(dht.node)
        if registry is None:
            registry = _matchmakers[dht.node] = {}
            dht.node.rpc.register(
                JOIN_METHOD, _serve_join(registry), kind="server_stream", request_type=JoinRequest
            )
        if prefix in registry:
            raise ValueError(f"a matchmaker for prefix {prefix!r} already runs on this node")
        registry[prefix] = self

    def close(self) -> None:
        """Stop serving join requests for this prefix."""
        registry = _matchmakers.get(self.dht.node)
        if registry is not None and registry.get(self.prefix) is self:
            del registry[self.prefix]

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    def _notify(self) -> None:
        """Wake join requests waiting for us to decide whether we lead (see _serve_join)."""
        self._changed.set()
        self._changed = anyio.Event()

    def _deciding(self, key: str) -> bool:
        """Whether we look for a group under ``key`` but neither lead nor follow yet (we are
        reading the key, or asking a better-ranked peer to take us)."""
        return (
            self._looking
            and self._key == key
            and self._leading is None
            and self._following is None
            and self.mode is not MemberMode.CLIENT
        )

    def _me(self, gather: bytes) -> MemberInfo:
        addresses = (
            [] if self.mode is MemberMode.CLIENT else [str(a) for a in self.dht.node.addresses]
        )
        bandwidth = -1.0 if self.bandwidth is None else float(self.bandwidth)
        return MemberInfo(self.peer_id, addresses, bandwidth, self.mode.value, gather)

    # -- looking for a group ---------------------------------------------------------------------

    async def look_for_group(self, bits: str, *, gather: bytes, begin_at: float) -> GroupInfo:
        """Find a group under ``bits``, beginning at the latest at ``begin_at`` (DHT time).

        :raises MatchmakingFailed: no group with at least ``min_group_size`` members formed by
            then (plus ``request_timeout`` to hear from a leader).
        """
        if self._looking:
            raise RuntimeError("this matchmaker is already looking for a group")
        self._looking = True
        key = self._key = group_key(self.prefix, bits)
        me = self._me(gather)
        client = self.mode is MemberMode.CLIENT
        expiration = math.inf if client else begin_at
        rejected: set[PeerID] = set()
        poll = _FIRST_POLL
        declared = False
        fresh: list[tuple[PeerID, float]] | None = None  # candidates read with the declaration
        hint: MemberInfo | None = None  # where a peer that turned us away said the leader is
        try:
            if not client:
                async with anyio.create_task_group() as tg:  # (a store and a get at once)
                    tg.start_soon(self._declare, key, begin_at)
                    fresh = await self._candidates(key)
                declared = True
            while True:
                now = get_dht_time()
                if now > begin_at + self.request_timeout:
                    raise MatchmakingFailed(
                        f"no group of at least {self.min_group_size} formed under {key!r} in time"
                    )
                if fresh is None:
                    fresh = await self._candidates(key)
                candidates = [c for c in fresh if c[0] not in rejected]
                fresh = None
                leader = choose_leader(candidates, self.peer_id, expiration)
                tried = leader is not None
                while leader is not None:  # follow it, and whoever it redirects us to
                    address = self._address_of(leader)
                    if hint is not None and hint.peer_id == leader:
                        address = _member_info(hint).address
                    until = dict(candidates).get(leader, begin_at) + self.request_timeout
                    outcome = await self._follow(leader, address, key, expiration, me, until)
                    if isinstance(outcome, GroupInfo):
                        return outcome
                    rejected.add(leader)
                    hint = outcome
                    leader = None
                    if hint is not None and hint.peer_id not in rejected | {self.peer_id}:
                        leader = hint.peer_id
                if tried:  # turned away: read the declarations again
                    continue
                if client:  # a client cannot lead: wait for leaders to declare
                    await anyio.sleep(poll)
                    poll = min(1.5 * poll, _POLL)
                    rejected.clear()
                    continue
                info = await self._lead(key, begin_at, me)
                if info is not None:
                    return info
                rejected.clear()  # disbanded for a better leader: look again
        finally:
            self._looking = False
            self._leading = None
            self._notify()
            if declared:  # (in the background: the group must not wait for it)
                with contextlib.suppress(RuntimeError):  # the node is closing
                    self.dht.node.spawn(self._declare, key, begin_at, False)

    async def _declare(self, key: str, begin_at: float, looking: bool = True) -> None:
        """Declare that we look for a group under ``key`` until ``begin_at``, or (``looking``
        false) that we stopped: a declaration would otherwise outlive a group that formed
        early, and the next round's peers would take us for a leader."""
        addresses = [str(a) for a in self.dht.node.addresses[:_MAX_ADDRESSES]]
        value = {"schema": self.schema, "looking": looking, "addresses": addresses}
        expiration = begin_at if looking else begin_at + _WITHDRAWN
        if not await self.dht.store(key, value, expiration, subkey=self.peer_id.to_bytes()):
            logger.debug("declaring %s under %s was refused", self.peer_id.short(), key)

    async def _candidates(self, key: str) -> list[tuple[PeerID, float]]:
        """Declared peers of ``key`` with our schema: (PeerID, expiration)."""
        from swarmavg.identity import PeerID as _PeerID

        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        candidates = []
        for subkey, item in found.value.items():
            try:
                peer = _PeerID(subkey) if isinstance(subkey, bytes) else None
            except ValueError:
                peer = None
            value = getattr(item, "value", None)  # (None: a plain value that is a dict)
            if peer is None or not isinstance(value, dict) or value.get("schema") != self.schema:
                continue
            if value.get("looking") is not True:
                continue
            candidates.append((peer, float(item.expiration_time)))
            declared = value.get("addresses")
            if isinstance(declared, list) and declared and isinstance(declared[0], str):
                try:  # (the PeerID goes with it: only that peer can answer there)
                    address = Address.parse(declared[0][:_MAX_ADDRESS_LENGTH]).with_peer_id(peer)
                except ValueError:
                    continue
                self._declared[peer] = address
                while len(self._declared) > _MAX_DECLARED:
                    del self._declared[next(iter(self._declared))]
        return candidates

    def _address_of(self, peer: PeerID) -> Address | None:
        """Where to dial ``peer``: as our DHT node knows it, else as it declared itself (the
        DHT node need not know every peer that averages under our key)."""
        return self.dht._address_of(peer) or self._declared.get(peer)

    async def _follow(
        self,
        leader: PeerID,
        address: Address | None,
        key: str,
        expiration: float,
        me: MemberInfo,
        until: float,
    ) -> GroupInfo | MemberInfo | None:
        """Ask ``leader`` to take us in; the group, or where it said the leader is (it follows
        one, or disbanded for a better one), or ``None`` if it would not, or did not begin by
        ``until`` (DHT time)."""
        if address is None:
            return None
        request = JoinRequest(key, self.schema, expiration, me)
        try:
            async with self.dht.node.rpc.server_stream(
                address, JOIN_METHOD, request, response_type=JoinReply
            ) as replies:
                with anyio.fail_after(self.request_timeout):
                    first = await anext(replies, None)
                if first is None or first.code != "accepted":
                    logger.debug("%s did not take us: %s", leader.short(), first)
                    return _redirect(first)
                self._following = (leader, address)
                self._notify()
                try:
                    with anyio.fail_after(max(0.0, until - get_dht_time())):
                        reply = await anext(replies, None)
                finally:
                    self._following = None
                if reply is not None and reply.code == "begin":
                    if not any(m.peer_id == self.peer_id for m in reply.members):
                        return None  # a group without us: not ours
                    return _group_info(reply.group_id, reply.members, leader)
                return _redirect(reply)  # disbanded
        except (SwarmError, OSError, TimeoutError, ValueError) as exc:
            # (ValueError: a group whose members do not parse, from a faulty leader)
            logger.debug("joining %s failed: %s", leader.short(), exc)
        return None

    async def _lead(self, key: str, begin_at: float, me: MemberInfo) -> GroupInfo | None:
        """Lead until the group is full or ``begin_at``; the group, or ``None`` if we disbanded
        for a better leader (then look again)."""
        leading = self._leading = _Leading(key, self.schema, self.target_group_size)
        self._notify()
        if self.target_group_size == 1:
            leading.full.set()
        poll = _FIRST_POLL
        try:
            while not leading.full.is_set():
                left = begin_at - get_dht_time()
                if left <= 0:
                    break
                with anyio.move_on_after(min(left, poll)):
                    await leading.full.wait()
                poll = min(1.5 * poll, _POLL)
                if leading.full.is_set():
                    break
                candidates = await self._candidates(key)
                if leading.full.is_set():  # filled up while we read: begin
                    break
                better = choose_leader(candidates, self.peer_id, begin_at)
                if better is not None and better not in leading.followers:
                    logger.debug("%s: a better leader %s appeared", key, better.short())
                    pointer = self._pointer(better, self._address_of(better))
                    leading.settle(JoinReply("disband", "a better leader appeared", b"", pointer))
                    return None
            self._leading = None  # no more followers from here
            if 1 + len(leading.followers) < self.min_group_size:
                leading.settle(JoinReply("disband", "too few peers", b"", []))
                if get_dht_time() >= begin_at:
                    raise MatchmakingFailed(
                        f"only {1 + len(leading.followers)} peer(s) under {key!r} by the deadline"
                        f" (min_group_size={self.min_group_size})"
                    )
                return None
            members = sorted([me, *leading.followers.values()], key=lambda m: m.peer_id.to_bytes())
            group_id = os.urandom(16)
            leading.settle(JoinReply("begin", "", group_id, members))
            return _group_info(group_id, members, self.peer_id)
        finally:
            if not leading.settled.is_set():
                leading.settle(JoinReply("disband", "the leader stopped", b"", []))

    def _pointer(self, leader: PeerID, address: Address | None) -> list[MemberInfo]:
        """Where ``leader`` is, for a peer we turn away (empty if we cannot say)."""
        if address is None:
            return []
        return [MemberInfo(leader, [str(address)], -1.0, MemberMode.NODE.value, b"")]

    # -- serving join requests -------------------------------------------------------------------

    async def _serve_join(self, request: JoinRequest, ctx: CallContext) -> AsyncIterator[JoinReply]:
        if request.schema == self.schema and self._deciding(request.group_key):
            # Peers that start together ask the best-ranked one while it still reads the key:
            # turned away ("not leading"), they would follow worse leaders that disband only
            # when they next read the key (measured: 8 processes, 0.1-0.2 s instead of ~0.04 s
            # to form in some rounds). Requesters only ask peers ranked above them, so waiting
            # for our own decision (a DHT read, or asking a peer ranked above us) is no cycle.
            # Only for our key: a request for another one (a stale declaration of ours, from
            # an earlier round) is turned away at once, not after our decision.
            with anyio.move_on_after(self.request_timeout / 2):
                while self._deciding(request.group_key):
                    await self._changed.wait()
        leading = self._leading
        reason = ""
        if leading is None:
            following = self._following
            if following is not None and following[0] != request.member.peer_id:
                yield JoinReply("redirect", "following", b"", self._pointer(*following))
                return
            reason = "not leading a group"
        elif request.group_key != leading.key or request.schema != leading.schema:
            reason = "another key or schema"
        elif request.member.peer_id != ctx.peer_id:
            reason = "the request names another peer"
        elif len(leading.followers) + 1 >= leading.target or leading.full.is_set():
            reason = "the group is full"
        elif request.member.mode not in ("node", "client", "aux"):
            reason = "unknown mode"
        elif not _valid_member(request.member):
            reason = "an unusable address or bandwidth"
        if reason or leading is None:
            yield JoinReply("rejected", reason, b"", [])
            return
        leading.followers[ctx.peer_id] = request.member
        if len(leading.followers) + 1 >= leading.target:
            leading.full.set()
        try:
            yield JoinReply("accepted", "", b"", [])
            await leading.settled.wait()
            assert leading.outcome is not None
            yield leading.outcome
        finally:
            if not leading.settled.is_set():  # the follower left before we began
                leading.followers.pop(ctx.peer_id, None)


def _serve_join(registry: dict[str, DHTMatchmaker]) -> Any:
    """The node's ``avg.join`` handler: hands each request to the matchmaker of its prefix."""

    async def serve(request: JoinRequest, ctx: CallContext) -> AsyncIterator[JoinReply]:
        prefix, _, _ = request.group_key.rpartition(".0b")
        matchmaker = registry.get(prefix)
        if matchmaker is None:
            yield JoinReply("rejected", "no averaging under that prefix here", b"", [])
            return
        async for reply in matchmaker._serve_join(request, ctx):
            yield reply

    return serve


def _redirect(reply: JoinReply | None) -> MemberInfo | None:
    """The leader a refusal or a disband points to (``redirect``/``disband`` with one member
    that has a usable address), if any."""
    if reply is None or reply.code not in ("redirect", "disband") or len(reply.members) != 1:
        return None
    pointer = reply.members[0]
    if pointer.mode != MemberMode.NODE.value or not _valid_member(pointer):
        return None
    return pointer


def pack_gather(value: Any) -> bytes:
    """The bytes a member gathers to its group (msgpack)."""
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed
