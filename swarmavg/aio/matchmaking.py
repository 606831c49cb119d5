"""Matchmaking through the DHT: peers that want to average find each other and form a group.

The decisions (whom to ask, when to lead, when to assemble, whom to admit, when to give up)
are :class:`swarmavg.proto.group_search.GroupSearch`, a sans-IO machine; this module is its
driver: it stores and reads declarations in the DHT, makes the join calls (``avg.join``, a
server stream: ``accepted``, then ``begin`` with the group or ``disband``; or at once
``rejected`` / ``redirect``), serves other peers' join requests by asking the machine, and
tells it when a peer's connection fails.

A declaration is a DHT dictionary entry under the group key (``<prefix>.0b<bits>``): subkey
the peer's ``owner_marker`` (so the DHT signs it, and no other identity can overwrite or
withdraw it; entries under any other subkey are ignored), value ``{schema, looking,
addresses, begin, client, tensors}``, expiring ``declaration_ttl`` seconds after it was made
(renewed while the peer looks), so that a dead peer's declaration lapses in seconds. A peer
that stops looking withdraws it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import msgpack

from swarmavg._time import get_dht_time
from swarmavg.abc._averaging import Group, GroupInfo, GroupMember, Matchmaker, MemberMode
from swarmavg.address import Address
from swarmavg.errors import MatchmakingFailed, SwarmError
from swarmavg.proto.averaging_messages import JoinReply, JoinRequest, MemberInfo, Presence
from swarmavg.proto.dht_storage import ValueWithExpiration
from swarmavg.proto.dht_validation import owner_marker, owner_of
from swarmavg.proto.group_search import (
    Admission,
    Ask,
    Declaration,
    Declare,
    GroupSearch,
    Probe,
    Read,
    Settle,
    Stage,
    Verdict,
)
from swarmavg.proto.matchmaking import group_key

if TYPE_CHECKING:
    from swarmavg.aio.dht import DHTNode
    from swarmavg.aio.rpc import CallContext
    from swarmavg.identity import PeerID

__all__ = ["DHTMatchmaker", "GroupInfo", "MatchmakingFailed"]

logger = logging.getLogger(__name__)

JOIN_METHOD: Final = "avg.join"
PRESENCE_METHOD: Final = "avg.presence"
#: A declaration carries at most this many of our addresses (others read the first), each at
#: most this long; we remember the addresses of this many declared peers.
_MAX_ADDRESSES: Final = 4
#: A peer whose connection was lost this recently (s) is not expected to look for a group (see
#: :meth:`DHTMatchmaker._expected`): longer than a training run counts a silent peer's record.
_LOST_NOT_EXPECTED: Final = 10.0
_MAX_ADDRESS_LENGTH: Final = 512
_MAX_DECLARED: Final = 4096
_MAX_SCHEMA_TEXT: Final = 200
_MAX_KEYS: Final = 64
#: What a DHT operation raises when the network or our own node (closing) fails it.
_UNREACHABLE: Final = (SwarmError, OSError, RuntimeError, anyio.ClosedResourceError)
#: How long a cancelled search may spend withdrawing its declaration (s).
_WITHDRAW_TIMEOUT: Final = 1.0


def _member_info(info: MemberInfo) -> GroupMember:
    mode = MemberMode(info.mode)
    address = None
    if mode is not MemberMode.CLIENT and info.addresses:
        address = Address.parse(info.addresses[0]).with_peer_id(info.peer_id)
    bandwidth = None if info.bandwidth < 0 else info.bandwidth
    return GroupMember(info.peer_id, address, bandwidth, mode)


def _valid_member(info: MemberInfo) -> bool:
    """Whether a would-be follower's info makes a usable group member."""
    if info.mode not in ("node", "client", "aux"):
        return False
    bandwidth = info.bandwidth
    if math.isnan(bandwidth) or math.isinf(bandwidth):
        return False
    try:
        _member_info(info)
    except ValueError:
        return False
    return info.mode == "client" or bool(info.addresses)


def _group_info(group_id: bytes, members: tuple[MemberInfo, ...], leader: PeerID) -> GroupInfo:
    group = Group(group_id, tuple(_member_info(m) for m in members))
    return GroupInfo(group, {m.peer_id: m.gather for m in members}, leader)


@dataclass
class _Term:
    """How one spell of leading ended, for the followers waiting on it."""

    settled: anyio.Event = field(default_factory=anyio.Event)
    reply: JoinReply | None = None


class _Running:
    """The search in progress, and what its driver and the join handlers share."""

    def __init__(self, search: GroupSearch) -> None:
        self.search = search
        self.terms: dict[int, _Term] = {}
        #: set (and replaced) whenever the machine may have changed
        self.changed = anyio.Event()
        #: the join call in progress and the seq of its Ask
        self.ask_scope: anyio.CancelScope | None = None
        self.ask_seq = -1

    def term(self, term: int) -> _Term:
        found = self.terms.get(term)
        if found is None:
            found = self.terms[term] = _Term()
        return found

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


_matchmakers: weakref.WeakKeyDictionary[Any, dict[str, DHTMatchmaker]] = weakref.WeakKeyDictionary()


class DHTMatchmaker(Matchmaker):
    """Forms groups of peers that average the same tensors under ``prefix``.

    :param dht: the DHT node (its node serves ``avg.join``).
    :param prefix: the averaging run's name: group keys are ``<prefix>.0b<bits>``.
    :param schema: the digest of the averaged tensors' shapes and dtypes; only equal ones group.
    :param schema_text: a short description of those tensors, for the error when peers
        under our key average others.
    :param target_group_size: begin as soon as this many members are in.
    :param min_group_size: begin at the declared time with at least this many.
    :param request_timeout: how long a leader may take to answer a join request (s).
    :param mode: how this peer takes part (client-mode peers only follow).
    :param bandwidth: this peer's bandwidth (``None``: unknown), for load balancing.
    :param declaration_ttl: how long one declaration lives in the DHT (s; renewed at half-life
        while looking; default ``request_timeout``): a dead peer stops counting after it.
    :param admission: peers excluded from our groups (see
        :class:`~swarmavg.proto.group_search.Admission`); default: a fresh one.
    """

    def __init__(
        self,
        dht: DHTNode,
        *,
        prefix: str,
        schema: bytes,
        schema_text: str = "",
        target_group_size: int,
        min_group_size: int = 2,
        request_timeout: float = 3.0,
        mode: MemberMode = MemberMode.NODE,
        bandwidth: float | None = None,
        declaration_ttl: float | None = None,
        admission: Admission | None = None,
    ) -> None:
        if not (isinstance(target_group_size, int) and target_group_size >= 1):
            raise ValueError(f"target_group_size must be an int >= 1, not {target_group_size!r}")
        if not (isinstance(min_group_size, int) and 1 <= min_group_size <= target_group_size):
            raise ValueError(
                f"min_group_size must be an int in 1..target_group_size ({target_group_size}),"
                f" not {min_group_size!r}"
            )
        group_key(prefix, "")  # checks the prefix
        self.dht = dht
        self.prefix = prefix
        self.schema = schema
        self.schema_text = schema_text[:_MAX_SCHEMA_TEXT]
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.request_timeout = request_timeout
        self.declaration_ttl = request_timeout if declaration_ttl is None else declaration_ttl
        self.mode = mode
        self.bandwidth = bandwidth
        self.admission = admission if admission is not None else Admission()
        self._running: _Running | None = None
        self._declared: dict[PeerID, Address] = {}  # addresses read in declarations
        #: the latest expiration of a record we stored under each key (a new declaration must
        #: expire later than our last withdrawal there, or the DHT keeps the withdrawal)
        self._records: dict[str, float] = {}
        #: the key of our last search and the members of the group it formed (if it did): when
        #: we look under that key again, they are expected back (see GroupSearch's regulars)
        self._previous: tuple[str, frozenset[PeerID] | tuple[()]] = ("", ())
        #: how many peers (us included) are expected to look for each group; see GroupSearch's
        #: ``expected_group_size`` (a training loop sets it from its progress records)
        self.expected_group_size: int | None = None
        #: peers whose last connection to us ended, and when (DHT time), oldest first
        self._lost: OrderedDict[PeerID, float] = OrderedDict()
        registry = _matchmakers.get(dht.node)
        if registry is None:
            registry = _matchmakers[dht.node] = {}
            dht.node.rpc.register(
                JOIN_METHOD, _serve_join(registry), kind="server_stream", request_type=JoinRequest
            )
            dht.node.rpc.register(
                PRESENCE_METHOD, _serve_presence(registry), request_type=Presence, inline=True
            )
        if prefix in registry:
            raise ValueError(f"a matchmaker for prefix {prefix!r} already runs on this node")
        registry[prefix] = self
        self._unwatch = dht.node.watch_peers(self._peer_lost)

    def close(self) -> None:
        """Stop serving join requests for this prefix."""
        registry = _matchmakers.get(self.dht.node)
        if registry is not None and registry.get(self.prefix) is self:
            del registry[self.prefix]
        self._unwatch()

    @property
    def peer_id(self) -> PeerID:
        return self.dht.peer_id

    @property
    def search(self) -> GroupSearch | None:
        """The search in progress, if any (for tests and status views)."""
        return None if self._running is None else self._running.search

    def _me(self, gather: bytes) -> MemberInfo:
        addresses = (
            []
            if self.mode is MemberMode.CLIENT
            else [str(a) for a in self.dht.announced_addresses()[:_MAX_ADDRESSES]]
        )
        bandwidth = -1.0 if self.bandwidth is None else float(self.bandwidth)
        return MemberInfo(self.peer_id, addresses, bandwidth, self.mode.value, gather)

    def _lately_lost(self) -> list[PeerID]:
        """Peers lost within the last ``declaration_ttl`` (a declaration they made before
        they died may still be in the DHT that long)."""
        now = get_dht_time()
        kept = now - max(self.declaration_ttl, _LOST_NOT_EXPECTED)  # (see _expected)
        while self._lost and next(iter(self._lost.values())) < kept:
            self._lost.popitem(last=False)
        since = now - self.declaration_ttl
        return [peer for peer, when in self._lost.items() if when >= since]

    def _expected(self) -> int | None:
        """:attr:`expected_group_size` less the peers lost within :data:`_LOST_NOT_EXPECTED`:
        a training run still counts a peer that died a moment ago (its progress record
        outlives it by a few seconds), and waiting for it would cost each round until then
        its whole matchmaking time."""
        expected = self.expected_group_size
        if expected is None:
            return None
        since = get_dht_time() - _LOST_NOT_EXPECTED
        return max(1, expected - sum(1 for when in self._lost.values() if when >= since))

    def _peer_lost(self, peer: PeerID) -> None:
        self._lost[peer] = get_dht_time()
        self._lost.move_to_end(peer)
        while len(self._lost) > _MAX_DECLARED:
            self._lost.popitem(last=False)
        running = self._running
        if running is not None:
            running.search.on_peer_lost(peer, get_dht_time())
            running.notify()

    # -- looking for a group ---------------------------------------------------------------------

    async def look_for_group(self, bits: str, *, gather: bytes, begin_at: float) -> GroupInfo:
        """Find a group under ``bits``, beginning at the latest at ``begin_at`` (DHT time).

        :raises MatchmakingFailed: no group with at least ``min_group_size`` members formed by
            then (plus ``request_timeout`` to hear from a leader); the message says why.
        """
        if self._running is not None:
            raise RuntimeError("this matchmaker is already looking for a group")
        key = group_key(self.prefix, bits)
        search = GroupSearch(
            self._me(gather),
            key=key,
            schema=self.schema,
            schema_text=self.schema_text,
            begin_at=begin_at,
            now=get_dht_time(),
            target_group_size=self.target_group_size,
            min_group_size=self.min_group_size,
            request_timeout=self.request_timeout,
            declaration_ttl=self.declaration_ttl,
            new_group_id=lambda: os.urandom(16),
            admission=self.admission,
            lost=self._lately_lost(),
            regulars=self._previous[1] if self._previous[0] == key else (),
            declared_before=self._records.get(key, -math.inf),
            expected_group_size=self._expected(),
        )
        running = self._running = _Running(search)
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    self._carry_out(running, tg)
                    if search.done:
                        break
                    changed = running.changed
                    with anyio.move_on_after(max(0.0, search.deadline() - get_dht_time())):
                        await changed.wait()
                    search.on_timer(get_dht_time())
                tg.cancel_scope.cancel()  # (reads and asks still under way)
        except BaseException:
            if not search.done:
                search.cancel(get_dht_time())
                with anyio.CancelScope(shield=True), anyio.move_on_after(_WITHDRAW_TIMEOUT):
                    await self._carry_out_finally(running)
            raise
        finally:
            self._running = None
            running.notify()
            finished = search.finished
            self._previous = (
                key,
                frozenset(m.peer_id for m in finished.members) if finished is not None else (),
            )
        if finished is not None:
            return _group_info(finished.group_id, finished.members, finished.leader)
        raise MatchmakingFailed(search.failure or "no group formed")

    def _carry_out(self, running: _Running, tg: anyio.abc.TaskGroup) -> None:
        """Carry out what the machine asks for."""
        search = running.search
        for effect in search.effects():
            if isinstance(effect, Read):
                tg.start_soon(self._read, running, effect.seq)
            elif isinstance(effect, Ask):
                running.ask_scope = scope = anyio.CancelScope()
                running.ask_seq = effect.seq
                tg.start_soon(self._ask, running, effect, scope)
            elif isinstance(effect, Declare):
                self._records[search.key] = max(
                    self._records.get(search.key, -math.inf), effect.expiration
                )
                while len(self._records) > _MAX_KEYS:
                    del self._records[next(iter(self._records))]
                if effect.looking:
                    tg.start_soon(self._declare, search.key, effect)
                else:  # (in the background: the group must not wait for it)
                    with contextlib.suppress(RuntimeError):  # the node is closing
                        self.dht.node.spawn(self._declare, search.key, effect)
            elif isinstance(effect, Settle):
                self._settle(running, effect)
            elif isinstance(effect, Probe):
                tg.start_soon(self._probe, running, effect.peer)
        if running.ask_scope is not None and running.ask_seq != search.asking:
            # the machine moved on: end the join call, or the leader keeps us as a follower
            running.ask_scope.cancel()
            running.ask_scope = None
        running.notify()

    async def _carry_out_finally(self, running: _Running) -> None:
        """A cancelled search's last effects: tell the followers, withdraw (awaited)."""
        for effect in running.search.effects():
            if isinstance(effect, Settle):
                self._settle(running, effect)
            elif isinstance(effect, Declare) and not effect.looking:
                key = running.search.key
                self._records[key] = max(self._records.get(key, -math.inf), effect.expiration)
                await self._declare(key, effect)
        running.notify()

    def _settle(self, running: _Running, effect: Settle) -> None:
        if effect.begin:
            reply = JoinReply("begin", "", effect.group_id, list(effect.members))
        else:
            pointer = []
            if effect.pointer is not None:
                pointer = self._pointer(effect.pointer, self._address_of(effect.pointer))
            reply = JoinReply("disband", effect.reason, b"", pointer)
        term = running.term(effect.term)
        term.reply = reply
        term.settled.set()

    async def _declare(self, key: str, effect: Declare) -> None:
        """Store our declaration (or withdraw it: ``looking`` false)."""
        addresses = (
            []
            if self.mode is MemberMode.CLIENT
            else [str(a) for a in self.dht.announced_addresses()[:_MAX_ADDRESSES]]
        )
        value = {
            "schema": self.schema,
            "looking": effect.looking,
            "addresses": addresses,
            "begin": effect.begin_at,
            "client": self.mode is MemberMode.CLIENT,
            "tensors": self.schema_text,
        }
        try:
            stored = await self.dht.store(
                key, value, effect.expiration, subkey=owner_marker(self.peer_id)
            )
        except _UNREACHABLE as exc:
            logger.debug("declaring under %s failed: %s", key, exc)
            return
        if not stored:
            logger.debug("declaring %s under %s was refused", self.peer_id.short(), key)

    async def _read(self, running: _Running, seq: int) -> None:
        try:
            declarations = await self._declarations(running.search.key)
        except _UNREACHABLE as exc:
            logger.debug("reading %s failed: %s", running.search.key, exc)
            declarations = []
        search = running.search
        leader = search.leader if search.stage is Stage.FOLLOWING else None
        search.on_read(seq, declarations, get_dht_time())
        if leader is not None and search.stage is not Stage.FOLLOWING:
            logger.info(
                "leaving leader %s under %s: its declaration lapsed (it cannot reach the DHT)",
                leader.short(),
                search.key,
            )
        running.notify()

    async def _declarations(self, key: str) -> list[Declaration]:
        """The declarations under ``key`` (and remember where their peers said they are)."""
        found = await self.dht.get(key, latest=True)
        entries = None if found is None else found.value  # {subkey: ValueWithExpiration}
        if not isinstance(entries, dict):
            return []
        declarations = []
        for subkey, item in entries.items():
            if not isinstance(item, ValueWithExpiration):
                return []  # (a plain value that happens to be a dict: not declarations)
            peer = owner_of(subkey)  # (signed by that peer: nobody else can withdraw it)
            value = item.value
            if peer is None or not isinstance(value, dict):
                continue
            schema = value.get("schema")
            begin = value.get("begin", item.expiration_time)
            text = value.get("tensors", "")
            if not isinstance(schema, bytes) or not isinstance(begin, int | float):
                continue
            declarations.append(
                Declaration(
                    peer,
                    float(begin),
                    schema,
                    looking=value.get("looking") is True,
                    client=value.get("client") is True,
                    schema_text=text[:_MAX_SCHEMA_TEXT] if isinstance(text, str) else "",
                )
            )
            addresses = value.get("addresses")
            if isinstance(addresses, list) and addresses and isinstance(addresses[0], str):
                try:  # (the PeerID goes with it: only that peer can answer there)
                    address = Address.parse(addresses[0][:_MAX_ADDRESS_LENGTH]).with_peer_id(peer)
                except ValueError:
                    continue
                self._declared[peer] = address
                while len(self._declared) > _MAX_DECLARED:
                    del self._declared[next(iter(self._declared))]
        return declarations

    async def _probe(self, running: _Running, peer: PeerID) -> None:
        """Ask ``peer`` whether it still averages under our prefix (it looks under our key
        but does not join, or it was in our last group and is not back): if it does not
        answer, or says no, it is not waited for. A dead peer's transport tells at once (TCP's
        reset; QUIC's ICMP error starts its liveness probe)."""
        address = self._address_of(peer)
        present = False
        if address is not None:
            try:
                answer = await self.dht.node.rpc.call(
                    address,
                    PRESENCE_METHOD,
                    Presence(self.prefix),
                    response_type=Presence,
                    timeout=self.request_timeout,
                )
                present = answer.present
            except (*_UNREACHABLE, TimeoutError, ValueError) as exc:
                logger.debug("%s did not answer our probe: %s", peer.short(), exc)
        if present:
            running.notify()
        else:
            logger.debug("%s no longer averages under %r", peer.short(), self.prefix)
            self._peer_lost(peer)

    def _address_of(self, peer: PeerID) -> Address | None:
        """Where to dial ``peer``: as our DHT node knows it, else as it declared itself (the
        DHT node need not know every peer that averages under our key)."""
        return self.dht._address_of(peer) or self._declared.get(peer)

    async def _ask(self, running: _Running, ask: Ask, scope: anyio.CancelScope) -> None:
        """Ask ``ask.leader`` to take us in and feed its answers to the machine."""
        search = running.search
        address = self._address_of(ask.leader)
        if ask.hint is not None and ask.hint.peer_id == ask.leader:
            with contextlib.suppress(ValueError):
                address = _member_info(ask.hint).address
        with scope:
            try:
                if address is None:
                    raise LookupError("no address")
                await self._join(running, ask, address)
            except (SwarmError, OSError, TimeoutError, ValueError, LookupError) as exc:
                # (ValueError: a group whose members do not parse, from a faulty leader)
                logger.debug("joining %s failed: %s", ask.leader.short(), exc)
                search.on_ask_failed(ask.seq, get_dht_time())
                running.notify()

    async def _join(self, running: _Running, ask: Ask, address: Address) -> None:
        search = running.search
        begin_at = math.inf if search.client else search.begin_at
        request = JoinRequest(search.key, self.schema, begin_at, search.me)
        async with self.dht.node.rpc.server_stream(
            address, JOIN_METHOD, request, response_type=JoinReply
        ) as replies:
            with anyio.fail_after(max(0.0, ask.answer_by - get_dht_time())):
                first = await anext(replies, None)
            if first is None or first.code != "accepted":
                logger.debug("%s did not take us: %s", ask.leader.short(), first)
                _refused(search, ask, first, "rejected")
                running.notify()
                return
            search.on_reply(ask.seq, "accepted", get_dht_time())
            running.notify()
            with anyio.fail_after(max(0.0, ask.begin_by - get_dht_time())):
                reply = await anext(replies, None)
            if reply is not None and reply.code == "begin":
                members = tuple(reply.members)
                _group_info(reply.group_id, members, ask.leader)  # (raises if they do not parse)
                search.on_reply(
                    ask.seq, "begin", get_dht_time(), group_id=reply.group_id, members=members
                )
            else:
                _refused(search, ask, reply, "disband")
            running.notify()

    def _pointer(self, leader: PeerID, address: Address | None) -> list[MemberInfo]:
        """Where ``leader`` is, for a peer we turn away (empty if we cannot say)."""
        if address is None:
            return []
        return [MemberInfo(leader, [str(address)], -1.0, MemberMode.NODE.value, b"")]

    # -- serving join requests -------------------------------------------------------------------

    async def _serve_join(self, request: JoinRequest, ctx: CallContext) -> AsyncIterator[JoinReply]:
        member = request.member
        if member.peer_id != ctx.peer_id:
            yield JoinReply("rejected", "the request names another peer", b"", [])
            return
        if not _valid_member(member):
            yield JoinReply("rejected", "an unusable mode, address or bandwidth", b"", [])
            return
        running = self._running
        decision = None
        with anyio.move_on_after(self.request_timeout / 2):
            while running is not None:
                decision = running.search.on_join_request(
                    member, request.group_key, request.schema, get_dht_time(), request.expiration
                )
                if decision.verdict is not Verdict.HOLD:
                    break
                # Peers that start together ask the best-ranked one while it still reads the
                # key: turned away, they would follow worse leaders that disband only when
                # they next read it. Requests go only to better-ranked peers, so waiting for
                # our own decision is no cycle.
                await running.changed.wait()
                running = self._running
        if running is None or decision is None or decision.verdict is Verdict.HOLD:
            yield JoinReply("rejected", "not leading a group", b"", [])
            return
        if decision.verdict is Verdict.REDIRECT:
            assert decision.leader is not None
            pointer = self._pointer(decision.leader, self._address_of(decision.leader))
            yield JoinReply("redirect", decision.reason, b"", pointer)
            return
        if decision.verdict is Verdict.REJECT:
            yield JoinReply("rejected", decision.reason, b"", [])
            return
        running.notify()  # (the group may be full: the driver settles it)
        term = running.term(decision.term)
        try:
            yield JoinReply("accepted", "", b"", [])
            await term.settled.wait()
            assert term.reply is not None
            yield term.reply
        finally:
            if not term.settled.is_set():  # the follower left before we began
                running.search.on_follower_left(member.peer_id, decision.term)
                running.notify()


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


def _serve_presence(registry: dict[str, DHTMatchmaker]) -> Any:
    """The node's ``avg.presence`` handler (inline): whether it averages under the prefix."""

    def serve(request: Presence, ctx: CallContext) -> Presence:
        return Presence(request.prefix, request.prefix in registry)

    return serve


def _refused(search: GroupSearch, ask: Ask, reply: JoinReply | None, code: str) -> None:
    """Tell the machine that the leader of ``ask`` turned us away (``rejected``) or disbanded
    (``disband``), with where it pointed and why."""
    search.on_reply(
        ask.seq,
        code,
        get_dht_time(),
        pointer=_pointer_in(reply),
        reason="" if reply is None else reply.reason,
    )


def _pointer_in(reply: JoinReply | None) -> MemberInfo | None:
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
