"""The matchmaking machine (swarmavg.proto.group_search), pumped on a fake clock.

A small discrete-event simulation stands in for the DHT (a dictionary of declarations with
expirations), the join calls (requests and replies with a latency) and the peers' connections;
peers can die (their connections fail: the others hear of it after a delay, or not at all),
stall (they answer nothing) or leave (they cancel their search) at any moment. Every run checks
the deadlines and that the groups that formed agree; the scenarios of a new user (a peer leaves
or dies, and the others must not wait out the expiration) check how soon groups assemble.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from swarmavg.identity import Identity, PeerID
from swarmavg.proto.averaging_messages import MemberInfo
from swarmavg.proto.group_search import (
    Admission,
    Ask,
    Declaration,
    Declare,
    Failed,
    Finished,
    GroupSearch,
    Probe,
    Read,
    Settle,
    Stage,
    Verdict,
)

KEY = "run.0b"
SCHEMA = b"schema"

_IDS = [Identity.from_private_bytes(bytes([i + 1]) * 32).peer_id for i in range(12)]


@dataclass
class _Peer:
    peer: PeerID
    search: GroupSearch | None = None
    state: str = "alive"  # alive | dead | stalled | left
    timer: float = math.inf
    #: held join requests: (requester, begin_at, seq, until)
    holds: list[tuple[PeerID, float, int, float]] = field(default_factory=list)
    #: followers of each leadership term: term -> {peer: its ask seq}
    terms: dict[int, dict[PeerID, int]] = field(default_factory=dict)
    #: the ask in progress: (seq, leader, term it was accepted into, got a first answer)
    ask: tuple[int, PeerID] | None = None
    answered: set[int] = field(default_factory=set)
    outcome: Finished | Failed | None = None
    ended_at: float = math.inf
    begin_at: float = 0.0


class Sim:
    """Peers searching under one key, driven event by event."""

    def __init__(
        self,
        n: int,
        *,
        target: int,
        minimum: int = 2,
        request_timeout: float = 3.0,
        ttl: float = 3.0,
        latency: Callable[[], float] = lambda: 0.001,
        loss_notice: float | None = 0.005,
        schemas: list[bytes] | None = None,
        clients: frozenset[int] = frozenset(),
        admission: list[Admission] | None = None,
        regulars: list[int] = (),  # type: ignore[assignment]
        expected: int | None = None,
        auxes: frozenset[int] = frozenset(),
    ) -> None:
        self.now = 0.0
        self.expected = expected
        self.auxes = auxes
        self.regulars = [_IDS[i] for i in regulars]
        self.peers = [_Peer(_IDS[i]) for i in range(n)]
        self.by_id = {p.peer: p for p in self.peers}
        self.target = target
        self.minimum = minimum
        self.request_timeout = request_timeout
        self.ttl = ttl
        self.latency = latency
        self.loss_notice = loss_notice
        self.schemas = schemas or [SCHEMA] * n
        self.clients = clients
        self.admission = admission
        self.dht: dict[PeerID, tuple[Declaration, float]] = {}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._group_ids = itertools.count(1)
        self._last_reply: dict[tuple[PeerID, int], float] = {}
        self.probes = 0

    # -- the event queue ------------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(when, self.now), next(self._order), fn))

    def run(self, until: float = 120.0) -> None:
        while self._events and self._events[0][0] <= until:
            when, _, fn = heapq.heappop(self._events)
            self.now = when
            fn()

    # -- peers ---------------------------------------------------------------------------------

    def start(self, index: int, when: float, wait: float) -> None:
        def go() -> None:
            peer = self.peers[index]
            if peer.state != "alive":
                return
            peer.begin_at = self.now + wait
            client = index in self.clients
            mode = "client" if client else "aux" if index in self.auxes else "node"
            me = MemberInfo(peer.peer, [] if client else ["x"], -1.0, mode, b"")
            peer.search = GroupSearch(
                me,
                key=KEY,
                schema=self.schemas[index],
                schema_text=f"schema {self.schemas[index]!r}",
                begin_at=peer.begin_at,
                now=self.now,
                target_group_size=self.target,
                min_group_size=self.minimum,
                request_timeout=self.request_timeout,
                declaration_ttl=self.ttl,
                new_group_id=lambda: next(self._group_ids).to_bytes(4, "big"),
                admission=self.admission[index] if self.admission else None,
                regulars=self.regulars,
                expected_group_size=self.expected,
            )
            self._pump(peer)

        self.at(when, go)

    def kill(self, index: int, when: float, *, how: str = "dead") -> None:
        """``dead``: its process died (its connections fail); ``stalled``: it answers
        nothing; ``left``: it cancelled its search (Ctrl+C: withdraws, disbands)."""

        def go() -> None:
            peer = self.peers[index]
            if peer.state != "alive":
                return
            if how == "left":
                if peer.search is not None:
                    peer.search.cancel(self.now)
                    self._pump(peer)
                peer.state = "left"
                self._break_calls(peer)
                return
            peer.state = how
            if how == "dead":
                self._break_calls(peer)
                if self.loss_notice is not None:
                    for other in self.peers:
                        if other is not peer:
                            self.at(self.now + self.loss_notice, self._lost(other, peer.peer))

        self.at(when, go)

    def _lost(self, other: _Peer, peer: PeerID) -> Callable[[], None]:
        def go() -> None:
            if other.state == "alive" and other.search is not None:
                other.search.on_peer_lost(peer, self.now)
                self._pump(other)

        return go

    def _break_calls(self, peer: _Peer) -> None:
        """Its join calls end: as a follower its leader sees it leave, as a leader its
        followers' calls fail."""
        if peer.ask is not None:
            seq, leader = peer.ask
            self._leave_leader(peer, leader)
        for followers in peer.terms.values():
            for follower, seq in list(followers.items()):
                self.at(self.now + self.latency(), self._ask_failed(self.by_id[follower], seq))
            followers.clear()

    def _leave_leader(self, peer: _Peer, leader: PeerID) -> None:
        target = self.by_id[leader]

        def go() -> None:
            for term, followers in target.terms.items():
                left = followers.pop(peer.peer, None) is not None
                if left and target.search is not None and target.state == "alive":
                    target.search.on_follower_left(peer.peer, term)
                    self._pump(target)

        self.at(self.now + self.latency(), go)

    # -- driving one machine ---------------------------------------------------------------------

    def _pump(self, peer: _Peer) -> None:
        search = peer.search
        if search is None or peer.state not in ("alive", "left"):
            return
        for effect in search.effects():
            if isinstance(effect, Declare):
                self._store(peer, effect)
            elif isinstance(effect, Read):
                self._read(peer, effect.seq)
            elif isinstance(effect, Ask):
                self._ask(peer, effect)
            elif isinstance(effect, Settle):
                self._settle(peer, effect)
            elif isinstance(effect, Probe):
                self._probe(peer, effect.peer)
            elif isinstance(effect, Finished | Failed):
                peer.outcome = effect
                peer.ended_at = self.now
        if peer.ask is not None and peer.ask[0] != search.asking:
            self._leave_leader(peer, peer.ask[1])  # (the driver ends the join call)
            peer.ask = None
        if peer.holds:
            holds, peer.holds = peer.holds, []
            for requester, begin_at, seq, until in holds:
                self._decide(peer, self.by_id[requester], begin_at, seq, until)
        deadline = search.deadline()
        if deadline < math.inf and deadline != peer.timer:
            peer.timer = deadline

            def fire() -> None:
                if peer.timer == deadline and peer.state == "alive" and search is peer.search:
                    peer.timer = math.inf
                    search.on_timer(self.now)
                    self._pump(peer)

            self.at(deadline, fire)

    def _store(self, peer: _Peer, effect: Declare) -> None:
        index = self.peers.index(peer)
        declaration = Declaration(
            peer.peer,
            effect.begin_at,
            self.schemas[index],
            looking=effect.looking,
            client=index in self.clients,
            schema_text=f"schema {self.schemas[index]!r}",
        )

        def go() -> None:
            held = self.dht.get(peer.peer)
            if held is None or held[1] < effect.expiration:
                self.dht[peer.peer] = (declaration, effect.expiration)

        self.at(self.now + self.latency(), go)

    def _probe(self, peer: _Peer, target: PeerID) -> None:
        """A probe: a dead peer's transport fails it after a round trip, a peer that left says
        no, a stalled one's times out (request_timeout); a live one answers."""
        self.probes += 1
        state = self.by_id[target].state
        if state == "alive":
            return
        # (a peer that left says it no longer averages there, or its node is gone)
        delay = self.request_timeout if state == "stalled" else 2 * self.latency()
        self.at(self.now + delay, self._lost(peer, target))

    def _read(self, peer: _Peer, seq: int) -> None:
        def answer() -> None:
            found = [d for d, expiration in self.dht.values() if expiration > self.now]
            self.at(self.now + self.latency(), deliver(found))

        def deliver(found: list[Declaration]) -> Callable[[], None]:
            def go() -> None:
                if peer.state == "alive" and peer.search is not None:
                    peer.search.on_read(seq, found, self.now)
                    self._pump(peer)

            return go

        self.at(self.now + self.latency(), answer)

    def _ask(self, peer: _Peer, ask: Ask) -> None:
        if peer.ask is not None:
            self._leave_leader(peer, peer.ask[1])
        peer.ask = (ask.seq, ask.leader)
        target = self.by_id[ask.leader]
        search = peer.search
        assert search is not None
        begin_at = math.inf if search.client else search.begin_at

        def arrive() -> None:
            if target.state == "dead" or (target.search is None and target.state != "alive"):
                self.at(self.now + self.latency(), self._ask_failed(peer, ask.seq))
                return
            if target.state == "stalled":
                return
            self._decide(target, peer, begin_at, ask.seq, self.now + self.request_timeout / 2)

        def first_answer_due() -> None:
            if peer.state == "alive" and ask.seq not in peer.answered and peer.search is not None:
                peer.search.on_ask_failed(ask.seq, self.now)
                self._pump(peer)

        def begin_due() -> None:
            current = peer.ask == (ask.seq, ask.leader)
            if peer.state == "alive" and peer.search is not None and current:
                peer.search.on_ask_failed(ask.seq, self.now)
                self._pump(peer)

        self.at(self.now + self.latency(), arrive)
        self.at(ask.answer_by, first_answer_due)
        self.at(ask.begin_by, begin_due)

    def _decide(self, leader: _Peer, peer: _Peer, begin_at: float, seq: int, until: float) -> None:
        """``leader`` answers ``peer``'s join request (or holds it until ``until``)."""
        if leader.state != "alive":
            return
        search = leader.search
        if search is None:
            self._reply(peer, seq, "rejected")
            return
        me = MemberInfo(peer.peer, ["x"], -1.0, "node", b"")
        if peer.search is not None:
            me = peer.search.me
        decision = search.on_join_request(
            me, KEY, self.schemas[self.peers.index(peer)], self.now, begin_at
        )
        if decision.verdict is Verdict.HOLD:
            if self.now >= until:
                self._reply(peer, seq, "rejected")
            else:
                leader.holds.append((peer.peer, begin_at, seq, until))

                def expire() -> None:
                    for hold in list(leader.holds):
                        if hold[2] == seq and hold[0] == peer.peer:
                            leader.holds.remove(hold)
                            self._reply(peer, seq, "rejected")

                self.at(until, expire)
            return
        if decision.verdict is Verdict.ACCEPT:
            leader.terms.setdefault(decision.term, {})[peer.peer] = seq
            self._reply(peer, seq, "accepted")
            self._pump(leader)
            return
        pointer = None
        if decision.verdict is Verdict.REDIRECT and decision.leader is not None:
            pointer = MemberInfo(decision.leader, ["x"], -1.0, "node", b"")
        self._reply(peer, seq, "rejected", pointer=pointer)

    def _settle(self, leader: _Peer, settle: Settle) -> None:
        followers = leader.terms.pop(settle.term, {})
        for follower, seq in followers.items():
            pointer = None
            if settle.pointer is not None:
                pointer = MemberInfo(settle.pointer, ["x"], -1.0, "node", b"")
            self._reply(
                self.by_id[follower],
                seq,
                "begin" if settle.begin else "disband",
                group_id=settle.group_id,
                members=settle.members,
                pointer=pointer,
            )

    def _reply(self, peer: _Peer, seq: int, code: str, **kw: object) -> None:
        # (replies on one call arrive in order, as on a stream)
        when = max(self.now + self.latency(), self._last_reply.get((peer.peer, seq), 0.0))
        self._last_reply[(peer.peer, seq)] = when

        def go() -> None:
            peer.answered.add(seq)
            if peer.state == "alive" and peer.search is not None:
                peer.search.on_reply(seq, code, self.now, **kw)  # type: ignore[arg-type]
                self._pump(peer)

        self.at(when, go)

    def _ask_failed(self, peer: _Peer, seq: int) -> Callable[[], None]:
        def go() -> None:
            if peer.state == "alive" and peer.search is not None:
                peer.search.on_ask_failed(seq, self.now)
                self._pump(peer)

        return go

    # -- what happened ---------------------------------------------------------------------------

    def groups(self) -> dict[bytes, tuple[PeerID, ...]]:
        """group id -> members, as the survivors that finished saw them (checked to agree)."""
        found: dict[bytes, tuple[PeerID, ...]] = {}
        for peer in self.peers:
            if peer.state == "alive" and isinstance(peer.outcome, Finished):
                members = tuple(m.peer_id for m in peer.outcome.members)
                assert peer.peer in members
                assert found.setdefault(peer.outcome.group_id, members) == members
        return found

    def check_invariants(self) -> None:
        groups = self.groups()
        seen: dict[PeerID, bytes] = {}
        for peer in self.peers:
            if peer.state != "alive" or peer.search is None:
                continue
            # every survivor's search ended, by its deadline (begin_at + request_timeout)
            assert peer.search.done, (peer.peer.short(), peer.search.stage)
            assert peer.ended_at <= peer.begin_at + self.request_timeout + 1e-9
            if isinstance(peer.outcome, Finished):
                assert peer.peer not in seen
                seen[peer.peer] = peer.outcome.group_id
        for members in groups.values():
            assert len(members) <= self.target
            assert len(members) >= self.minimum


def _sizes(sim: Sim) -> list[int]:
    return sorted(len(m) for m in sim.groups().values())


# -- scenarios -----------------------------------------------------------------------------------


def test_peers_that_start_together_form_one_full_group_at_once() -> None:
    sim = Sim(4, target=4)
    for i in range(4):
        sim.start(i, 0.001 * i, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4]
    assert max(p.ended_at for p in sim.peers) < 0.05  # full: nobody waits


@pytest.mark.parametrize("how", ["left", "dead"])
def test_after_a_peer_is_gone_the_rest_assemble_without_waiting_out_the_expiration(
    how: str,
) -> None:
    """A new user's scenario: target 4, one of 4 peers leaves (Ctrl+C) or dies while the
    others look: they form a group of 3 in a fraction of a second, not at begin_at (15 s)."""
    sim = Sim(4, target=4, loss_notice=0.005 if how == "dead" else None)
    sim.kill(3, 0.0, how=how)
    for i in range(3):
        sim.start(i, 0.001 * i, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [3]
    assert max(p.ended_at for p in sim.peers[:3]) < 0.2


@pytest.mark.parametrize("how", ["dead", "stalled"])
def test_a_peer_that_declared_and_died_is_probed_not_waited_for(how: str) -> None:
    """It died (or froze) while looking: its declaration stays in the DHT and no connection
    told the others. The leader, seeing it look but not join, pings it: a dead peer's transport
    fails the ping at once, a frozen one's times out (request_timeout); either way it stops
    counting, long before begin_at (and before its declaration lapses, for the dead one)."""
    sim = Sim(4, target=4, ttl=3.0, loss_notice=None, request_timeout=2.0)
    for i in range(4):
        sim.start(i, 0.01 * i if i < 3 else 0.0, wait=15)
    sim.kill(3, 0.0005, how=how)  # (declared, then died before anyone asked it)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [3]
    assert sim.probes >= 1
    ended = max(p.ended_at for p in sim.peers[:3])
    assert ended < (0.5 if how == "dead" else 2.0 + 0.5), ended


def test_a_peer_that_starts_late_is_not_left_out_of_a_group_of_those_that_wait() -> None:
    """Early assembly waits for two reads in a row to agree: a peer that declares between
    them is still taken in."""
    sim = Sim(4, target=4)
    for i in range(3):
        sim.start(i, 0.0, wait=15)
    sim.start(3, 0.015, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4]


def test_the_leader_disbands_for_a_better_one_and_everyone_ends_together() -> None:
    sim = Sim(5, target=8, latency=lambda: 0.003)
    order = sorted(range(5), key=lambda i: _IDS[i].to_bytes())
    # the best-ranked peer (smallest id) starts last: others lead first, then disband for it
    for rank, i in enumerate(reversed(order)):
        sim.start(i, 0.002 * rank, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [5]


def test_too_few_peers_fail_at_the_deadline_naming_other_schemas() -> None:
    sim = Sim(3, target=4, schemas=[SCHEMA, b"other", b"other"])
    for i in range(3):
        sim.start(i, 0.0, wait=2)
    sim.run()
    sim.check_invariants()
    outcome = sim.peers[0].outcome
    assert isinstance(outcome, Failed)
    assert "only 1 peer(s)" in outcome.reason
    assert "2 peer(s) under 'run.0b' average a different tensor schema" in outcome.reason
    assert "schema b'other'" in outcome.reason
    assert "ours: schema b'schema'" in outcome.reason
    assert sim.peers[0].ended_at == pytest.approx(2.0)
    # the two others found each other
    assert _sizes(sim) == [2]


def test_an_excluded_peer_is_not_taken_in_nor_waited_for() -> None:
    admissions = [Admission() for _ in range(4)]
    for admission in admissions[:3]:
        admission.exclude(_IDS[3], 0.0, "it sent non-finite values")
    sim = Sim(4, target=4, admission=admissions)
    for i in range(4):
        sim.start(i, 0.0, wait=15)
    sim.run()
    sim.check_invariants()
    groups = sim.groups()
    assert len(groups) == 1
    (members,) = groups.values()
    assert set(members) == set(_IDS[:3])
    assert max(p.ended_at for p in sim.peers[:3]) < 0.2  # not waited for
    assert isinstance(sim.peers[3].outcome, Failed)
    assert "excluded" in sim.peers[3].outcome.reason or "only 1" in sim.peers[3].outcome.reason


def test_clients_count_as_looking_and_never_lead() -> None:
    sim = Sim(4, target=4, clients=frozenset({0, 2}))
    for i in range(4):
        sim.start(i, 0.003 * i, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4]
    for peer in sim.peers:
        assert isinstance(peer.outcome, Finished)
        assert peer.outcome.leader in (_IDS[1], _IDS[3])


def test_a_target_of_one_is_a_group_of_one_at_once() -> None:
    sim = Sim(1, target=1, minimum=1)
    sim.start(0, 0.0, wait=15)
    sim.run()
    assert _sizes(sim) == [1]
    assert sim.peers[0].ended_at == 0.0


def test_admission_backs_off() -> None:
    admission = Admission(base=10, cap=35, memory=100)
    peer = _IDS[0]
    assert admission.excluded(peer, 0.0) is None
    assert admission.exclude(peer, 0.0, "why") == 10
    assert admission.excluded(peer, 5.0) is not None
    assert "why" in (admission.excluded(peer, 5.0) or "")
    assert admission.excluded(peer, 10.0) is None
    assert admission.exclude(peer, 20.0, "again") == 20
    assert admission.exclude(peer, 50.0, "again") == 35  # capped
    assert admission.exclude(peer, 500.0, "much later") == 10  # forgotten
    small = Admission(max_peers=2)
    for other in _IDS[:3]:
        small.exclude(other, 0.0, "x")
    assert small.excluded(_IDS[0], 1.0) is None  # (the stalest went)
    assert small.excluded(_IDS[2], 1.0) is not None


def test_a_request_from_a_peer_that_ranks_above_an_undecided_one_is_not_held() -> None:
    """Two peers that each read the other's stale declaration must not hold each other's
    requests (a cycle): the better-ranked requester is turned away at once."""
    first, second = sorted(_IDS[:2], key=lambda p: p.to_bytes())
    search = GroupSearch(
        MemberInfo(second, ["x"], -1.0, "node", b""),
        key=KEY,
        schema=SCHEMA,
        begin_at=10.0,
        now=0.0,
        target_group_size=4,
        min_group_size=2,
        request_timeout=3.0,
        declaration_ttl=3.0,
        new_group_id=lambda: b"g",
    )
    assert search.stage is Stage.DECIDING
    them = MemberInfo(first, ["x"], -1.0, "node", b"")
    assert search.on_join_request(them, KEY, SCHEMA, 0.0, 10.0).verdict is Verdict.REJECT
    assert search.on_join_request(them, KEY, SCHEMA, 0.0, 11.0).verdict is Verdict.HOLD


def test_declarations_are_renewed_while_looking_and_withdrawn_after() -> None:
    sim = Sim(1, target=4, ttl=2.0)
    stores: list[Declare] = []
    real = sim._store

    def spy(peer: _Peer, effect: Declare) -> None:
        stores.append(effect)
        real(peer, effect)

    sim._store = spy  # type: ignore[method-assign]
    sim.start(0, 0.0, wait=5.0)
    sim.run()
    looking = [d for d in stores if d.looking]
    assert [d.expiration for d in looking] == pytest.approx([2.0, 3.0, 4.0, 5.0])
    assert stores[-1].looking is False
    assert stores[-1].expiration > looking[-1].expiration


# -- the fault matrix ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(2000))
def test_random_faults_keep_deadlines_and_groups_consistent(seed: int) -> None:
    """Random swarms (2-8 peers, random targets, start times and latencies); up to two peers
    die, stall or leave at a random moment. Every survivor's search ends by its deadline, the
    groups that formed agree, and without faults every peer that started in time is grouped."""
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    target = rng.randint(2, 8)
    minimum = rng.randint(1, min(target, 3))
    faults = rng.choice([0, 0, 1, 2]) if n > 2 else 0
    sim = Sim(
        n,
        target=target,
        minimum=minimum,
        request_timeout=rng.choice([1.0, 3.0]),
        ttl=rng.choice([1.0, 3.0]),
        latency=lambda: rng.uniform(0.0, 0.01),
        loss_notice=rng.choice([None, 0.001, 0.05]),
        regulars=rng.choice([[], list(range(n))]),  # (they were our last group, or no history)
    )
    spread = rng.choice([0.0, 0.01, 0.5])
    for i in range(n):
        sim.start(i, rng.uniform(0, spread), wait=rng.choice([5.0, 10.0]))
    for i in rng.sample(range(n), faults):
        sim.kill(i, rng.uniform(0, 1.0), how=rng.choice(["dead", "stalled", "left"]))
    sim.run(until=60.0)
    sim.check_invariants()
    if faults == 0:  # no phantoms: whoever a group lists is in it
        for group_id, members in sim.groups().items():
            for member in members:
                outcome = sim.by_id[member].outcome
                assert isinstance(outcome, Finished), (member.short(), outcome)
                assert outcome.group_id == group_id
    if faults == 0 and spread == 0.0 and n >= minimum:
        grouped = sum(len(m) for m in sim.groups().values())
        assert grouped == n or target < n, (n, target, _sizes(sim))


def test_regulars_that_come_back_late_are_waited_for() -> None:
    """The four peers of the last group under this key (regulars) come back, one of them
    0.3 s late (its training step took longer): the others do not assemble without it (two
    agreeing reads would not wait that long), so nobody is split off."""
    sim = Sim(4, target=8, regulars=[0, 1, 2, 3])
    for i in range(3):
        sim.start(i, 0.0, wait=15)
    sim.start(3, 0.3, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4]
    assert max(p.ended_at for p in sim.peers) < 0.4


def test_without_regulars_a_late_peer_misses_the_group() -> None:
    """(what the regulars are for: with no history, two agreeing reads decide)"""
    sim = Sim(4, target=8)
    for i in range(3):
        sim.start(i, 0.0, wait=15)
    sim.start(3, 0.3, wait=2)
    sim.run()
    assert sorted(_sizes(sim)) == [3]


@pytest.mark.parametrize("regulars", [[], [0, 1], [0, 1, 2, 3]])
def test_the_expected_group_size_holds_early_assembly_until_everyone_is_in(
    regulars: list[int],
) -> None:
    """A training swarm of four: two peers look first, the other two 0.3 s later (their last
    batch took longer). Told to expect four, the first two do not assemble on their own (two
    agreeing reads, or their regulars, would let them), so the swarm is not split in halves;
    and the group still assembles at once when the fourth joins, long before begin_at."""
    sim = Sim(4, target=8, regulars=regulars, expected=4)
    for i in range(2):
        sim.start(i, 0.0, wait=15)
    for i in range(2, 4):
        sim.start(i, 0.3, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4]
    assert max(p.ended_at for p in sim.peers) < 1.5  # (begin_at: 15 s)
    split = Sim(4, target=8, regulars=[0, 1])  # (without the hint: the split)
    for i in range(2):
        split.start(i, 0.0, wait=15)
    for i in range(2, 4):
        split.start(i, 0.3, wait=15)
    split.run()
    assert sorted(_sizes(split)) == [2, 2]


def test_auxiliary_members_do_not_count_towards_the_expected_size() -> None:
    """Three trainers expected (their progress records say so) and an auxiliary peer (it
    publishes none): two trainers and the auxiliary looking first are not the three expected,
    so the third trainer, 0.3 s later, is not split off."""
    sim = Sim(4, target=8, expected=3, auxes=frozenset({3}))
    for i in (0, 1, 3):
        sim.start(i, 0.0, wait=15)
    sim.start(2, 0.3, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4]
    assert max(p.ended_at for p in sim.peers) < 1.5


def test_an_expected_peer_that_never_comes_costs_the_wait_until_begin_at() -> None:
    sim = Sim(3, target=8, expected=4)
    for i in range(3):
        sim.start(i, 0.0, wait=2.0)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [3]
    assert min(p.ended_at for p in sim.peers) >= 2.0
    with pytest.raises(ValueError, match="expected_group_size"):
        GroupSearch(
            MemberInfo(_IDS[0], ["x"], -1.0, "node", b""),
            key=KEY,
            schema=SCHEMA,
            begin_at=1.0,
            now=0.0,
            target_group_size=4,
            min_group_size=2,
            request_timeout=1.0,
            declaration_ttl=1.0,
            new_group_id=lambda: b"g",
            expected_group_size=0,
        )


@pytest.mark.parametrize("how", ["dead", "stalled", "left"])
def test_a_regular_that_is_gone_is_probed_and_not_waited_for(how: str) -> None:
    """A regular that died (no connection tells), froze or left before the round: the leader
    pings it when its first read does not show it back, and assembles without it."""
    sim = Sim(4, target=8, regulars=[0, 1, 2, 3], loss_notice=None, request_timeout=2.0)
    sim.kill(3, 0.0, how=how)
    for i in range(3):
        sim.start(i, 0.001, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [3]
    limit = 2.0 + 0.5 if how == "stalled" else 0.2
    assert max(p.ended_at for p in sim.peers[:3]) < limit


def test_a_regular_that_joined_another_group_is_not_waited_for() -> None:
    """Eight peers, groups of four, all of them our last group's peers under this key: those
    that look this time and then stop (they are in another group) are not waited for."""
    sim = Sim(8, target=4, regulars=list(range(8)))
    for i in range(8):
        sim.start(i, 0.0005 * i, wait=15)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [4, 4]
    assert max(p.ended_at for p in sim.peers) < 1.0


def test_an_expected_peer_that_dies_is_not_waited_for() -> None:
    """Four expected (a training run's records), the fourth dies before it looks: once the
    others hear of it (its connections fail), three are all there is, and they assemble long
    before begin_at instead of waiting for it until then."""
    sim = Sim(4, target=8, expected=4, loss_notice=0.1)
    for i in range(3):
        sim.start(i, 0.0, wait=15)
    sim.kill(3, 0.05)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [3]
    assert max(p.ended_at for p in sim.peers[:3]) < 1.5


def test_a_follower_whose_leader_is_cut_off_leaves_it_when_its_declaration_lapses() -> None:
    """The fault matrix's case (a leader's link cut while matchmaking): peer 1 follows peer 0
    (the four are expected, so nobody assembles early), then peer 0 answers nothing and
    renews nothing (no connection tells anyone). Peers 2 and 3, later, ask peer 0 in vain,
    then form a group of their own. Peer 1 sees peer 0's declaration lapse before peer 0's
    ``begin_at`` (two reads in a row) and looks again, so the three survivors average
    together at the others' ``begin_at``; it used to wait for peer 0 until its ``begin_at``
    and ``request_timeout`` more (8 s), by when the others had formed a group of 2 without
    it."""
    sim = Sim(4, target=4, ttl=3.0, request_timeout=3.0, loss_notice=None, expected=4)
    sim.start(0, 0.0, wait=5.0)  # (the best-ranked: begin_at 5.0)
    sim.start(1, 0.001, wait=5.0)  # (follows 0)
    sim.kill(0, 0.1, how="stalled")  # cut off: its declaration lapses at 3.0
    sim.start(2, 0.5, wait=5.0)
    sim.start(3, 0.5, wait=5.0)
    sim.run()
    sim.check_invariants()
    assert _sizes(sim) == [3]
    assert all(isinstance(p.outcome, Finished) for p in sim.peers[1:])
    assert max(p.ended_at for p in sim.peers[1:]) <= 5.5 + 0.1  # (the others' begin_at)
