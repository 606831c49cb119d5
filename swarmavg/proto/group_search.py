"""Matchmaking as a sans-IO state machine: one peer's search for a group under one key.

Theory of operation
-------------------
A peer that wants to average *declares* itself under its group key in the DHT (a
:class:`Declaration`: when it wants to begin at the latest, its tensor schema, whether it can
lead) and reads the key's declarations. Peers rank by ``(begin_at, PeerID)``; every peer asks
the best-ranked peer above it to take it in, so the peers of a key converge on one *leader*:
the best-ranked peer that can lead. The leader takes followers in and *assembles* the group
(sends every follower the members) as soon as one of these holds:

1. the group is full (``target_group_size``);
2. waiting cannot make it bigger: every peer looking there has joined, and so has every
   *regular* still alive (the members of our last group, when it formed under this same key:
   peers of a training loop come back every round, a few tens of ms apart), as one read shows;
   with no regulars, two reads in a row must agree. A peer that leaves withdraws its
   declaration; a dead one stops counting when its connection fails, when a probe of it fails
   (a leader asks a regular that is not back, or a looking peer that does not join, whether
   it still averages here), or when its short-lived declaration lapses;
3. ``begin_at`` came, with at least ``min_group_size`` members (with fewer it disbands and
   the search fails, saying why: too few peers, peers with another tensor schema, peers
   excluded for sending non-finite values).

A leader that reads a better-ranked leader disbands its followers (pointing them to it) and
asks it. Declarations are short-lived (``declaration_ttl``) and renewed while the peer looks,
so that a dead peer's declaration lapses in seconds rather than at its ``begin_at``.

:class:`GroupSearch` does no I/O and reads no clock. Its inputs are method calls (``on_*``,
each given ``now``, DHT time); its outputs are *effects* the driver pulls with
:meth:`GroupSearch.effects` and carries out (store a declaration, read the key, ask a peer to
lead us, tell our followers how their group ended), and a deadline
(:meth:`GroupSearch.deadline`) at which the driver calls :meth:`GroupSearch.on_timer`. Join
requests from other peers get an immediate :class:`Decision`.

Stages and what moves them (everything that changes the stage lives in this class)::

    stage      event                                   next stage   effects
    ---------  --------------------------------------  -----------  ----------------------------
    (start)    __init__                                DECIDING     Declare, Read
    DECIDING   on_read: a better-ranked leader         ASKING       Ask
    DECIDING   on_read: none, we can lead              LEADING      (poll timer)
    DECIDING   on_read: none, client mode              WAITING      (poll timer)
    WAITING    timer (poll)                            WAITING      Read
    WAITING    on_read: a leader                       ASKING       Ask
    ASKING     on_reply accepted                       FOLLOWING
    ASKING     on_reply redirect / on_ask_failed       ASKING       Ask (the peer it points to)
                                                       or DECIDING  Read
    FOLLOWING  on_reply begin (we are a member)        DONE         Finished, Declare(withdraw)
    FOLLOWING  on_reply disband / on_ask_failed        ASKING       Ask (the leader it names)
                                                       or DECIDING  Read
    FOLLOWING  timer (follow poll)                     FOLLOWING    Read
    FOLLOWING  on_read: the leader's declaration        DECIDING     Read
               lapsed before its begin (twice)
    LEADING    on_join_request (room left)             LEADING      (ACCEPT)
    LEADING    on_join_request fills the group         DONE         Settle(begin), Finished, ...
    LEADING    timer (poll)                            LEADING      Read
    LEADING    on_read: a better-ranked leader         ASKING       Settle(disband), Ask
    LEADING    on_read: all looking joined, twice      DONE         Settle(begin), Finished, ...
    LEADING    on_read: the same looking, some absent  LEADING      Probe (each absent peer once)
    LEADING    (with regulars) all looking and every   DONE         Settle(begin), Finished, ...
               regular not lost joined (a read, a join
               or a loss completes it)
    LEADING    timer: begin_at, >= min_group_size      DONE         Settle(begin), Finished, ...
    LEADING    timer: begin_at, too few                FAILED       Settle(disband), Failed, ...
    any        timer: begin_at + request_timeout       FAILED       Failed, Declare(withdraw)
    any        cancel()                                FAILED       Settle(disband), withdraw
    any        timer: declaration half-lived           (same)       Declare (renewed)

Join requests (:meth:`GroupSearch.on_join_request`): a leader with room ACCEPTs (unless the
requester is excluded); a follower REDIRECTs to its leader; a peer still DECIDING or ASKING
HOLDs the request (the driver asks again when the stage changes: requests go only from worse-
to better-ranked peers, so holding makes no cycle); otherwise REJECT with a reason.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from swarmavg.identity import PeerID
from swarmavg.proto.averaging_messages import MemberInfo

__all__ = [
    "Admission",
    "Ask",
    "Decision",
    "Declaration",
    "Declare",
    "Effect",
    "Failed",
    "Finished",
    "GroupSearch",
    "Probe",
    "Read",
    "Settle",
    "Stage",
    "Verdict",
]

#: How often a leader re-reads its key, and a client between tries (s): first after
#: FIRST_POLL (peers that start together see each other at once), then 1.5 times as long each
#: time, up to POLL.
FIRST_POLL: Final = 0.02
POLL: Final = 0.25
#: How often a follower re-reads its key, to see whether its leader's declaration lapsed (a
#: leader cut off from the network, or dead with no connection of ours to it to tell).
FOLLOW_POLL: Final = 0.5
#: Reads in a row that must show our own declaration and not our leader's before we leave it
#: (one read can miss a record, say a store that reached other nodes than our read did).
LEADER_ABSENT_READS: Final = 2
#: A withdrawn declaration expires this much after the one it replaces (a later expiration is
#: what lets it replace it in the DHT).
WITHDRAWN: Final = 1e-3


class Stage(enum.Enum):
    """Where a search is (see the module docstring's table)."""

    DECIDING = "deciding"
    WAITING = "waiting"
    ASKING = "asking"
    FOLLOWING = "following"
    LEADING = "leading"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Declaration:
    """One peer's declaration under the key, as a read returned it."""

    peer: PeerID
    #: when it wants to begin at the latest (DHT time): the rank, earliest first
    begin_at: float
    schema: bytes
    #: ``False``: it stopped looking (withdrawn)
    looking: bool = True
    #: a client-mode peer: it counts as looking but never leads
    client: bool = False
    #: a short description of its tensors (for the error when the schemas differ)
    schema_text: str = ""


class Verdict(enum.Enum):
    ACCEPT = "accepted"
    REJECT = "rejected"
    REDIRECT = "redirect"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to a join request. ``leader``: where a REDIRECT points; ``term``: the
    leadership an ACCEPT joins (its :class:`Settle` effect tells the follower how it ended)."""

    verdict: Verdict
    reason: str = ""
    leader: PeerID | None = None
    term: int = 0


# -- effects ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Declare:
    """Store our declaration: looking until ``expiration`` (DHT time), to begin by
    ``begin_at``; ``looking=False`` withdraws it."""

    looking: bool
    expiration: float
    begin_at: float


@dataclass(frozen=True, slots=True)
class Read:
    """Read the key's declarations; answer with :meth:`GroupSearch.on_read` (``seq``)."""

    seq: int


@dataclass(frozen=True, slots=True)
class Ask:
    """Ask ``leader`` to take us in. Its first answer is due by ``answer_by`` and, once it
    accepted us, the group by ``begin_by`` (DHT times); answer with
    :meth:`GroupSearch.on_reply` / :meth:`GroupSearch.on_ask_failed` (``seq``). ``hint``:
    where a peer that turned us away said it is."""

    seq: int
    leader: PeerID
    answer_by: float
    begin_by: float
    hint: MemberInfo | None = None


@dataclass(frozen=True, slots=True)
class Probe:
    """Check that ``peer`` is alive (it declared that it looks under our key, but it has not
    joined us though two reads agree): if the check fails, answer with
    :meth:`GroupSearch.on_peer_lost`."""

    peer: PeerID


@dataclass(frozen=True, slots=True)
class Settle:
    """Tell the followers of leadership ``term`` how it ended: ``begin`` with the group
    (``group_id``, ``members`` in PeerID order) or ``disband`` (``reason``; ``pointer``: the
    better leader to ask instead, if any)."""

    term: int
    begin: bool
    reason: str = ""
    group_id: bytes = b""
    members: tuple[MemberInfo, ...] = ()
    pointer: PeerID | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """We are in a group: ``members`` in PeerID order, led by ``leader``."""

    group_id: bytes
    members: tuple[MemberInfo, ...]
    leader: PeerID


@dataclass(frozen=True, slots=True)
class Failed:
    """No group: ``reason`` says why (for :class:`~swarmavg.errors.MatchmakingFailed`)."""

    reason: str


Effect = Declare | Read | Ask | Probe | Settle | Finished | Failed


# -- who may join ----------------------------------------------------------------------------------


class Admission:
    """Peers excluded from our groups for a while, and why: a peer that sent non-finite
    values is left out for ``base`` seconds, twice as long each time it does it again within
    ``memory`` seconds of its last exclusion, up to ``cap``. Bounded (``max_peers``; the
    stalest go first). Shared by all searches of one averager."""

    def __init__(
        self,
        *,
        base: float = 60.0,
        cap: float = 3600.0,
        memory: float = 3600.0,
        max_peers: int = 4096,
    ) -> None:
        if not (0 < base <= cap and memory >= 0 and max_peers >= 1):
            raise ValueError("Admission needs 0 < base <= cap, memory >= 0, max_peers >= 1")
        self.base = base
        self.cap = cap
        self.memory = memory
        self.max_peers = max_peers
        #: peer -> (excluded until, seconds of its last exclusion, why)
        self._excluded: OrderedDict[PeerID, tuple[float, float, str]] = OrderedDict()

    def exclude(self, peer: PeerID, now: float, why: str) -> float:
        """Exclude ``peer`` from ``now`` on; the seconds it stays excluded."""
        previous = self._excluded.pop(peer, None)
        seconds = self.base
        if previous is not None and now <= previous[0] + self.memory:
            seconds = min(self.cap, 2 * previous[1])
        self._excluded[peer] = (now + seconds, seconds, why)
        while len(self._excluded) > self.max_peers:
            self._excluded.popitem(last=False)
        return seconds

    def excluded(self, peer: PeerID, now: float) -> str | None:
        """Why ``peer`` is excluded now (with how long it still is), or ``None``."""
        entry = self._excluded.get(peer)
        if entry is None or entry[0] <= now:
            return None
        return f"excluded for another {entry[0] - now:.0f} s: {entry[2]}"


def _rank(peer: PeerID, begin_at: float) -> tuple[float, bytes]:
    return (begin_at, peer.to_bytes())


@dataclass
class _Leadership:
    """The followers of one spell of leading (a *term*)."""

    term: int
    followers: dict[PeerID, MemberInfo] = field(default_factory=dict)


class GroupSearch:
    """One peer's search for a group under ``key`` (see the module docstring).

    :param me: our :class:`MemberInfo` (PeerID, addresses, bandwidth, mode, gathered bytes).
    :param key: the group key searched under (requests for other keys are turned away).
    :param schema: our tensor schema digest (only peers with the same one group).
    :param schema_text: a short description of our tensors (for error messages).
    :param begin_at: DHT time by which we want to begin at the latest.
    :param now: DHT time now.
    :param target_group_size: assemble as soon as this many are in.
    :param min_group_size: assemble at ``begin_at`` only with at least this many.
    :param request_timeout: how long a leader may take to answer (s); the search fails at
        ``begin_at + request_timeout``.
    :param declaration_ttl: how long one declaration lives (s); renewed at half-life.
    :param new_group_id: makes a group id (the driver's randomness).
    :param admission: peers excluded from our groups (shared between searches).
    :param lost: peers whose connection failed lately (an earlier search heard of it): their
        declarations do not count, unless they join us.
    :param declared_before: the expiration of our last record under this key (a withdrawal):
        a new declaration must expire later, or the DHT keeps the old record.
    :param regulars: the members of our last group, when it formed under this same key: a
        leader takes them for coming back (they are alive; a departed or dead one is reported
        lost) and assembles once they and every peer looking have joined, after one read; it
        pings one that has not joined at once. One that a read shows looking and then no
        longer looking is in another group: it is not waited for.
    :param expected_group_size: how many peers (us included) the caller expects to look here
        for this round, e.g. a training run's peers, from their progress records: rule 2
        (waiting cannot make it bigger) then holds only once that many are in, because peers
        that will look soon are not looking *yet*. Without it (``None``), the first peers of a
        training swarm to look assemble among themselves, and with regulars the split repeats
        every round. Rules 1 and 3 are unchanged, so a peer that was expected and never
        comes costs the wait until ``begin_at``. Auxiliary members do not count towards it.
        A peer lost during the search (:meth:`on_peer_lost`) that has not joined us is taken
        for an expected one that will not come: the expectation drops by one (a dead peer's
        progress record outlives it; see the caller for peers lost before the search).
    """

    def __init__(
        self,
        me: MemberInfo,
        *,
        key: str,
        schema: bytes,
        schema_text: str = "",
        begin_at: float,
        now: float,
        target_group_size: int,
        min_group_size: int,
        request_timeout: float,
        declaration_ttl: float,
        new_group_id: Callable[[], bytes],
        admission: Admission | None = None,
        lost: Iterable[PeerID] = (),
        regulars: Iterable[PeerID] = (),
        declared_before: float = -math.inf,
        expected_group_size: int | None = None,
    ) -> None:
        if not 1 <= min_group_size <= target_group_size:
            raise ValueError("need 1 <= min_group_size <= target_group_size")
        if expected_group_size is not None and (
            isinstance(expected_group_size, bool)
            or not isinstance(expected_group_size, int)
            or expected_group_size < 1
        ):
            raise ValueError(
                f"expected_group_size must be None or an int >= 1, not {expected_group_size!r}"
            )
        self.expected = min(expected_group_size or 1, target_group_size)
        self.me = me
        self.peer = me.peer_id
        self.key = key
        self.schema = schema
        self.schema_text = schema_text
        self.begin_at = begin_at
        self.target = target_group_size
        self.minimum = min_group_size
        self.request_timeout = request_timeout
        self.ttl = declaration_ttl
        self.client = me.mode == "client"
        self._new_group_id = new_group_id
        self.admission = admission if admission is not None else Admission()
        self.stage = Stage.DECIDING
        self._effects: list[Effect] = []
        self._seq = 0  # of reads and asks handed out (answers to older ones are ignored)
        self._read_seq = -1  # the read we wait for (-1: none)
        self._ask_seq = -1
        self._leader: PeerID | None = None  # whom we ask or follow
        #: when our leader wants to begin (its declaration's; -inf: not known, as for a
        #: leader we were pointed to) and reads in a row that showed it lapsed before then
        self._leader_begin = -math.inf
        self._leader_absent = 0
        self._rejected: set[PeerID] = set()  # turned us away in this search
        self._lost: set[PeerID] = set(lost)  # their connection failed
        self._regulars = {
            peer
            for peer in regulars
            if peer != me.peer_id and self.admission.excluded(peer, now) is None
        }
        self._regulars_looked: set[PeerID] = set()
        self._floor = declared_before
        self._term = 0
        self._leading: _Leadership | None = None
        self._poll = FIRST_POLL
        self._next_poll = math.inf
        self._last_looking: frozenset[PeerID] | None = None  # the previous read's
        #: what reads showed: peers with another schema (PeerID -> its description)
        self._other_schemas: dict[PeerID, str] = {}
        self._excluded_seen: dict[PeerID, str] = {}
        #: why peers we asked turned us away (their words), for the failure's message
        self._refusals: dict[PeerID, str] = {}
        #: every peer a read showed looking here (for the failure's message)
        self._seen_looking: set[PeerID] = set()
        self._probed: set[PeerID] = set()  # (once each)
        self._declared_until = -math.inf  # our declaration's expiration (-inf: none made)
        self.finished: Finished | None = None
        self.failure: str | None = None
        if self.target == 1 and not self.client:
            self._lead(now)  # (a group of one: nobody to wait for, nothing to declare)
            return
        self._declare(now)
        self._read()

    # -- the driver's side -----------------------------------------------------------------------

    def effects(self) -> list[Effect]:
        """What to do now, in order (each effect is handed out once)."""
        effects, self._effects = self._effects, []
        return effects

    @property
    def done(self) -> bool:
        return self.stage in (Stage.DONE, Stage.FAILED)

    @property
    def deciding(self) -> bool:
        """Whether join requests for our key are held (we may still come to lead)."""
        return self.stage in (Stage.DECIDING, Stage.ASKING) and not self.client

    @property
    def asking(self) -> int:
        """The ``seq`` of the :class:`Ask` in progress (-1: none): the driver ends the join
        call of any other (a leader must not keep us as a follower once we moved on)."""
        return self._ask_seq

    @property
    def leader(self) -> PeerID | None:
        """Whom we ask or follow (``None``: nobody)."""
        return self._leader

    @property
    def term(self) -> int:
        """The current leadership's term (0: not leading)."""
        return self._leading.term if self._leading is not None else 0

    @property
    def followers(self) -> list[PeerID]:
        return list(self._leading.followers) if self._leading is not None else []

    def deadline(self) -> float:
        """DHT time at which to call :meth:`on_timer` (``inf``: none)."""
        if self.done:
            return math.inf
        times = [self.begin_at + self.request_timeout, self._next_poll]
        if self.stage is Stage.LEADING:
            times.append(self.begin_at)
        if self._declared_until < self.begin_at:
            times.append(self._declared_until - self.ttl / 2)
        return min(times)

    # -- inputs ----------------------------------------------------------------------------------

    def on_timer(self, now: float) -> None:
        """Time passed (call it at :meth:`deadline`, or any time)."""
        if self.done:
            return
        if self._declared_until < self.begin_at and now >= self._declared_until - self.ttl / 2:
            self._declare(now)
        if self.stage is Stage.LEADING and now >= self.begin_at:
            self._assemble_or_fail(now)
            return
        if now >= self.begin_at + self.request_timeout:
            self._fail(now, self._too_few(1 + len(self.followers)))
            return
        if now >= self._next_poll and self.stage in (
            Stage.LEADING,
            Stage.WAITING,
            Stage.FOLLOWING,
        ):
            self._next_poll = math.inf
            if self._read_seq < 0:
                self._read()

    def on_read(self, seq: int, declarations: Iterable[Declaration], now: float) -> None:
        """The answer to :class:`Read` ``seq`` (a failed read: no declarations)."""
        if seq != self._read_seq or self.done:
            return
        self._read_seq = -1
        if self.stage is Stage.FOLLOWING:
            self._check_leader(declarations, now)
            return
        looking: set[PeerID] = set()
        best: tuple[tuple[float, bytes], PeerID, float] | None = None
        mine = _rank(self.peer, math.inf if self.client else self.begin_at)
        for item in declarations:
            peer = item.peer
            if peer in self._regulars:
                if item.looking:
                    self._regulars_looked.add(peer)
                elif peer in self._regulars_looked:
                    # it looked this time and stopped: it is in another group (or left)
                    self._regulars.discard(peer)
            if peer == self.peer or not item.looking:
                continue
            if item.schema != self.schema:
                self._other_schemas[peer] = item.schema_text
                continue
            self._other_schemas.pop(peer, None)
            why = self.admission.excluded(peer, now)
            if why is not None:
                self._excluded_seen[peer] = why
                continue
            if peer in self._lost:
                continue
            looking.add(peer)
            if item.client or not math.isfinite(item.begin_at):
                continue
            if peer in self._rejected and self.stage is not Stage.LEADING:
                continue  # (a leader reads them all: one that turned us away may lead now)
            rank = _rank(peer, item.begin_at)
            if rank < mine and (best is None or rank < best[0]):
                best = (rank, peer, item.begin_at)
        better = None if best is None else best[1]
        better_begin = self.begin_at if best is None else best[2]
        current = frozenset(looking)
        self._seen_looking |= current
        previous, self._last_looking = self._last_looking, current
        if self.stage is Stage.LEADING:
            assert self._leading is not None
            if better is not None and better not in self._leading.followers:
                self._disband(f"a better leader appeared: {better.short()}", pointer=better)
                self._rejected.clear()
                self._ask(better, now, begin_at=better_begin)
                return
            joined = set(self._leading.followers)
            if self._regulars:
                absent = self._regulars - self._lost - self._excluded_seen.keys() - joined
                for peer in sorted(absent, key=PeerID.to_bytes):
                    if peer not in self._probed:  # (a regular that is not back yet: alive?)
                        self._probed.add(peer)
                        self._effects.append(Probe(peer))
                if self._all_in(current):
                    self._assemble(now)
                    return
            elif current == previous:
                if self._all_in(current):
                    self._assemble(now)
                    return
                # looking, yet not joining: it may be dead with its declaration still there
                # (a connection to it tells at once; with none, nothing would until it lapses)
                for peer in sorted(current - joined - self._probed, key=PeerID.to_bytes):
                    self._probed.add(peer)
                    self._effects.append(Probe(peer))
            self._schedule_poll(now)
            return
        if better is not None:
            self._ask(better, now, begin_at=better_begin)
        elif self.client:
            self.stage = Stage.WAITING
            self._rejected.clear()  # (a full group's leader may lead again later)
            self._schedule_poll(now)
        elif self.stage in (Stage.DECIDING, Stage.WAITING):
            self._lead(now)

    def on_reply(
        self,
        seq: int,
        code: str,
        now: float,
        *,
        group_id: bytes = b"",
        members: tuple[MemberInfo, ...] = (),
        pointer: MemberInfo | None = None,
        reason: str = "",
    ) -> None:
        """An answer of the leader we asked (:class:`Ask` ``seq``): ``accepted``, ``begin``
        (with the group), ``disband``, ``redirect`` or ``rejected`` (``pointer``: where it
        said the leader is; ``reason``: why it turned us away, in its words)."""
        if seq != self._ask_seq or self.done:
            return
        leader = self._leader
        assert leader is not None
        if code in ("rejected", "disband") and reason:
            self._refusals[leader] = reason[:200]
        if code == "accepted" and self.stage is Stage.ASKING:
            self.stage = Stage.FOLLOWING
            self._leader_absent = 0
            self._next_poll = now + FOLLOW_POLL
            return
        in_it = any(m.peer_id == self.peer for m in members)
        if code == "begin" and self.stage is Stage.FOLLOWING and in_it:
            self._finish(Finished(group_id, tuple(members), leader), now)
            return
        self._turned_away(leader, now, pointer)  # (a group without us is not ours either)

    def _check_leader(self, declarations: Iterable[Declaration], now: float) -> None:
        """A follower's read: a live leader renews its declaration until its ``begin_at``
        (then withdraws it, which stays readable), so one that lapsed before then is a leader
        that can no longer reach the DHT: cut off or dead (a dead one's connection would
        usually tell first). If :data:`LEADER_ABSENT_READS` reads in a row show our own
        declaration and not the leader's, leave it and look again (otherwise we would wait
        for it until its ``begin_at`` and ``request_timeout`` more, while the others formed a
        group without us)."""
        leader = self._leader
        assert leader is not None
        ours = theirs = False
        for item in declarations:
            if item.peer == self.peer:
                ours = True
            elif item.peer == leader:
                theirs = True
                if math.isfinite(item.begin_at):
                    self._leader_begin = item.begin_at
        if ours and not theirs and now < self._leader_begin:
            self._leader_absent += 1
        else:
            self._leader_absent = 0
        if self._leader_absent >= LEADER_ABSENT_READS:
            self._turned_away(leader, now, None)
            return
        self._next_poll = now + FOLLOW_POLL

    def on_ask_failed(self, seq: int, now: float) -> None:
        """The leader of :class:`Ask` ``seq`` did not answer in time, or the call broke."""
        if seq != self._ask_seq or self.done:
            return
        assert self._leader is not None
        self._turned_away(self._leader, now, None)

    def on_join_request(
        self, member: MemberInfo, key: str, schema: bytes, now: float, begin_at: float = math.inf
    ) -> Decision:
        """Another peer asks us to take it in (``member``: its info, its PeerID already
        checked against the caller's; ``begin_at``: what it declared, ``inf`` for a client).
        ACCEPT adds it to our followers; HOLD means: ask again when our stage changes."""
        peer = member.peer_id
        if key != self.key:
            return Decision(Verdict.REJECT, "another key")
        if schema != self.schema:
            return Decision(Verdict.REJECT, "it averages a different tensor schema")
        why = self.admission.excluded(peer, now)
        if why is not None:
            return Decision(Verdict.REJECT, why)
        if self.stage is Stage.FOLLOWING and self._leader != peer:
            return Decision(Verdict.REDIRECT, "following", leader=self._leader)
        if self.deciding:
            if _rank(peer, begin_at) < _rank(self.peer, self.begin_at):
                # It ranks above us (it read a stale declaration of ours): holding it could
                # wait on a peer that waits on us. Let it look again.
                return Decision(Verdict.REJECT, "not leading a group: you rank above me")
            return Decision(Verdict.HOLD)
        leading = self._leading
        if self.stage is not Stage.LEADING or leading is None:
            return Decision(Verdict.REJECT, "not leading a group")
        if peer in leading.followers:
            return Decision(Verdict.REJECT, "it is in the group already")
        if 1 + len(leading.followers) >= self.target:
            return Decision(Verdict.REJECT, "the group is full")
        leading.followers[peer] = member
        self._lost.discard(peer)
        decision = Decision(Verdict.ACCEPT, term=leading.term)
        if 1 + len(leading.followers) >= self.target or (
            self._regulars and self._last_looking is not None and self._all_in(self._last_looking)
        ):
            self._assemble(now)
        return decision

    def _all_in(self, looking: frozenset[PeerID]) -> bool:
        """Whether every peer ``looking`` and every regular still alive has joined us (and
        that makes a group)."""
        assert self._leading is not None
        joined = set(self._leading.followers)
        return (
            looking <= joined
            and self._regulars - self._lost - self._excluded_seen.keys() <= joined
            and 1 + len(joined) >= self.minimum
            and self._expected_in()
            and len(joined) >= 1
        )

    def _expected_in(self) -> bool:
        """Whether the expected peers are in: auxiliary members do not count (they publish no
        training progress, so a training run does not count them in its expectation)."""
        assert self._leading is not None
        trainers = sum(m.mode != "aux" for m in self._leading.followers.values())
        return int(self.me.mode != "aux") + trainers >= self.expected

    def on_follower_left(self, peer: PeerID, term: int) -> None:
        """A follower of leadership ``term`` went away before the group was settled."""
        leading = self._leading
        if leading is not None and leading.term == term and self.stage is Stage.LEADING:
            leading.followers.pop(peer, None)

    def on_peer_lost(self, peer: PeerID, now: float) -> None:
        """Our connection to ``peer`` failed: its declaration no longer counts (it may be
        dead); if it is whom we ask or follow, that is over."""
        joined = self._leading is not None and peer in self._leading.followers
        if peer not in self._lost and not joined:
            self.expected = max(1, self.expected - 1)
        self._lost.add(peer)
        if self.done:
            return
        if self._leader == peer and self.stage in (Stage.ASKING, Stage.FOLLOWING):
            self._turned_away(peer, now, None)
            return
        if self._last_looking is not None and peer in self._last_looking:
            self._last_looking = self._last_looking - {peer}
        if (
            self.stage is Stage.LEADING
            and self._regulars
            and self._last_looking is not None
            and self._all_in(self._last_looking)
        ):
            self._assemble(now)  # (the regular we waited for is gone)

    def cancel(self, now: float) -> None:
        """The search is abandoned (its step was cancelled): disband our followers and
        withdraw our declaration."""
        if not self.done:
            self._fail(now, "the search was cancelled")

    # -- transitions -----------------------------------------------------------------------------

    def _read(self) -> None:
        self._seq += 1
        self._read_seq = self._seq
        self._effects.append(Read(self._seq))

    def _declare(self, now: float) -> None:
        expiration = max(min(self.begin_at, now + self.ttl), self._floor + WITHDRAWN)
        if expiration <= self._declared_until:
            return
        self._declared_until = expiration
        self._effects.append(Declare(True, expiration, self.begin_at))

    def _withdraw(self) -> None:
        if self._declared_until > -math.inf:
            self._declared_until += WITHDRAWN
            self._effects.append(Declare(False, self._declared_until, self.begin_at))

    def _schedule_poll(self, now: float) -> None:
        self._next_poll = now + self._poll
        self._poll = min(1.5 * self._poll, POLL)

    def _ask(
        self,
        leader: PeerID,
        now: float,
        *,
        begin_at: float | None = None,
        hint: MemberInfo | None = None,
    ) -> None:
        """Ask ``leader`` (which wants to begin by ``begin_at``, ours if unknown)."""
        self.stage = Stage.ASKING
        self._leader = leader
        self._leader_begin = -math.inf if begin_at is None else begin_at
        self._next_poll = math.inf
        self._seq += 1
        self._ask_seq = self._seq
        self._read_seq = -1
        self._effects.append(
            Ask(
                self._seq,
                leader,
                answer_by=now + self.request_timeout,
                begin_by=min(begin_at or self.begin_at, self.begin_at) + self.request_timeout,
                hint=hint,
            )
        )

    def _turned_away(self, leader: PeerID, now: float, pointer: MemberInfo | None) -> None:
        """``leader`` would not (or no longer) lead us: ask where it pointed, else read again."""
        self._rejected.add(leader)
        self._leader = None
        self._ask_seq = -1
        self._next_poll = math.inf  # (a follower's poll: nothing to poll for while deciding)
        if (
            pointer is not None
            and pointer.peer_id not in self._rejected
            and pointer.peer_id != self.peer
            and self.admission.excluded(pointer.peer_id, now) is None
        ):
            self._ask(pointer.peer_id, now, hint=pointer)
            return
        self.stage = Stage.DECIDING
        self._read()

    def _lead(self, now: float) -> None:
        self.stage = Stage.LEADING
        self._term += 1
        self._leading = _Leadership(self._term)
        self._poll = FIRST_POLL
        self._schedule_poll(now)
        if self.target == 1:
            self._assemble(now)

    def _disband(self, reason: str, pointer: PeerID | None = None) -> None:
        leading, self._leading = self._leading, None
        if leading is not None:
            self._effects.append(Settle(leading.term, False, reason, pointer=pointer))

    def _assemble(self, now: float) -> None:
        leading, self._leading = self._leading, None
        assert leading is not None
        members = tuple(
            sorted([self.me, *leading.followers.values()], key=lambda m: m.peer_id.to_bytes())
        )
        group_id = self._new_group_id()
        self._effects.append(Settle(leading.term, True, "", group_id, members))
        self._finish(Finished(group_id, members, self.peer), now)

    def _assemble_or_fail(self, now: float) -> None:
        size = 1 + len(self.followers)
        if size >= self.minimum:
            self._assemble(now)
        else:
            self._fail(now, self._too_few(size), disband="too few peers")

    def _finish(self, finished: Finished, now: float) -> None:
        self.stage = Stage.DONE
        self.finished = finished
        self._next_poll = math.inf
        self._effects.append(finished)
        self._withdraw()

    def _fail(self, now: float, reason: str, disband: str = "the leader stopped") -> None:
        self._disband(disband)
        self.stage = Stage.FAILED
        self.failure = reason
        self._next_poll = math.inf
        self._effects.append(Failed(reason))
        self._withdraw()

    def _too_few(self, size: int) -> str:
        """Why a group of ``size`` did not do (the failure's message)."""
        reason = (
            f"only {size} peer(s) under {self.key!r} by the deadline"
            f" (min_group_size={self.minimum})"
        )
        if self._other_schemas:
            texts = sorted({text or "unknown" for text in self._other_schemas.values()})
            reason += (
                f"; {len(self._other_schemas)} peer(s) under {self.key!r} average a different"
                f" tensor schema: {'; '.join(texts[:3])}"
                + (f" (and {len(texts) - 3} more)" if len(texts) > 3 else "")
                + (f"; ours: {self.schema_text}" if self.schema_text else "")
            )
        if self._excluded_seen:
            reason += f"; {len(self._excluded_seen)} peer(s) excluded: " + next(
                iter(self._excluded_seen.values())
            )
        absent = self._seen_looking - set(self.followers)
        if absent and size < self.minimum:
            reason += (
                f"; {len(absent)} other peer(s) looked there but did not join us (they"
                " followed another leader, or they exclude us: peers that received non-finite"
                " values from us leave us out for a while)"
            )
        told = sorted(why for why in self._refusals.values() if why.startswith("excluded"))
        if told:
            reason += f"; {len(told)} peer(s) turned us away: {told[0]}"
        return reason
