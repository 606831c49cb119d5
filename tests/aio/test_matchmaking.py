"""Matchmaking through the DHT between real nodes (MemoryTransport), and a round end to end."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest

from swarmavg import Address, get_dht_time
from swarmavg.abc import RoundConfig
from swarmavg.aio.allreduce import AllReduceService, MemberMode
from swarmavg.aio.dht import DHTNode
from swarmavg.aio.matchmaking import DHTMatchmaker, GroupInfo, MatchmakingFailed
from swarmavg.aio.node import Node
from swarmavg.proto.allreduce import FlatLayout, TensorSpec, schema_digest
from swarmavg.proto.averaging_messages import JoinReply, JoinRequest, MemberInfo
from swarmavg.proto.group_search import Declare
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio

SPECS = (TensorSpec((1000,), "float32"), TensorSpec((10,), "float64"))
SCHEMA = schema_digest(SPECS)


@asynccontextmanager
async def _dhts(n: int) -> AsyncIterator[list[DHTNode]]:
    network = MemoryNetwork()
    transports = {"memory": {"network": network}}
    async with AsyncExitStack() as stack:
        dhts: list[DHTNode] = []
        for _ in range(n):
            node = await stack.enter_async_context(
                Node(listen=["memory://local:0"], transports=transports)
            )
            seeds = [d.node.addresses[0] for d in dhts[:2]]
            dhts.append(await stack.enter_async_context(DHTNode(node, initial_peers=seeds)))
        yield dhts


def _matchmakers(
    dhts: Sequence[DHTNode],
    *,
    target: int,
    minimum: int = 2,
    schemas: Sequence[bytes] | None = None,
    modes: Sequence[MemberMode] | None = None,
) -> list[DHTMatchmaker]:
    return [
        DHTMatchmaker(
            dht,
            prefix="run",
            schema=(schemas or [SCHEMA] * len(dhts))[i],
            target_group_size=target,
            min_group_size=minimum,
            mode=(modes or [MemberMode.NODE] * len(dhts))[i],
            request_timeout=1.0,
        )
        for i, dht in enumerate(dhts)
    ]


async def _look_all(
    matchmakers: Sequence[DHTMatchmaker], bits: Sequence[str], wait: float = 3.0
) -> list[GroupInfo | BaseException]:
    outcomes: list[GroupInfo | BaseException] = [RuntimeError("not run")] * len(matchmakers)
    begin_at = get_dht_time() + wait

    async def one(i: int) -> None:
        try:
            outcomes[i] = await matchmakers[i].look_for_group(
                bits[i], gather=f"peer {i}".encode(), begin_at=begin_at
            )
        except MatchmakingFailed as exc:
            outcomes[i] = exc

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(len(matchmakers)):
                tg.start_soon(one, i)
    return outcomes


async def test_four_peers_form_one_group_as_soon_as_it_is_full() -> None:
    async with _dhts(4) as dhts:
        started = anyio.current_time()
        outcomes = await _look_all(_matchmakers(dhts, target=4), ["01"] * 4, wait=10)
        took = anyio.current_time() - started
    assert all(isinstance(o, GroupInfo) for o in outcomes)
    infos = [o for o in outcomes if isinstance(o, GroupInfo)]
    assert len({i.group.group_id for i in infos}) == 1
    members = [m.peer_id for m in infos[0].group.members]
    assert sorted(members, key=lambda p: p.to_bytes()) == members
    assert set(members) == {d.peer_id for d in dhts}
    assert all(i.group == infos[0].group for i in infos)
    assert infos[0].gathered == {d.peer_id: f"peer {k}".encode() for k, d in enumerate(dhts)}
    assert took < 5  # full at once: nobody waited for the declared time (10 s)


async def test_at_the_deadline_a_smaller_group_begins() -> None:
    async with _dhts(3) as dhts:
        outcomes = await _look_all(_matchmakers(dhts, target=8, minimum=2), [""] * 3, wait=1.0)
    infos = [o for o in outcomes if isinstance(o, GroupInfo)]
    assert len(infos) == 3
    assert len(infos[0].group.members) == 3


async def test_too_few_peers_fail_with_the_reason() -> None:
    async with _dhts(2) as dhts:
        outcomes = await _look_all(_matchmakers(dhts[:1], target=4, minimum=2), [""], wait=0.5)
    assert isinstance(outcomes[0], MatchmakingFailed)
    assert "min_group_size=2" in str(outcomes[0])


async def test_only_peers_with_the_same_schema_and_key_group() -> None:
    other = schema_digest([TensorSpec((5,), "float32")])
    async with _dhts(6) as dhts:
        schemas = [SCHEMA, SCHEMA, other, other, SCHEMA, SCHEMA]
        bits = ["0", "0", "0", "0", "1", "1"]
        outcomes = await _look_all(_matchmakers(dhts, target=4, schemas=schemas), bits, wait=1.5)
    infos = [o for o in outcomes if isinstance(o, GroupInfo)]
    assert len(infos) == 6
    for i, info in enumerate(infos):
        peers = {m.peer_id for m in info.group.members}
        same = {
            dhts[j].peer_id for j in range(6) if schemas[j] == schemas[i] and bits[j] == bits[i]
        }
        assert peers == same


async def test_client_mode_peers_follow_and_never_lead() -> None:
    async with _dhts(4) as dhts:
        modes = [MemberMode.CLIENT, MemberMode.NODE, MemberMode.CLIENT, MemberMode.NODE]
        outcomes = await _look_all(_matchmakers(dhts, target=4, modes=modes), ["1"] * 4)
    infos = [o for o in outcomes if isinstance(o, GroupInfo)]
    assert len(infos) == 4
    assert infos[0].leader in {dhts[1].peer_id, dhts[3].peer_id}
    clients = {dhts[0].peer_id, dhts[2].peer_id}
    for member in infos[0].group.members:
        assert (member.address is None) == (member.peer_id in clients)


async def test_a_round_end_to_end_matchmaking_then_all_reduce() -> None:
    layout = FlatLayout(SPECS)
    rng = np.random.default_rng(0)
    async with _dhts(5) as dhts:
        matchmakers = _matchmakers(dhts, target=5)
        buffers = [
            [rng.standard_normal(size).astype(dtype) for dtype, size in layout.buffers]
            for _ in dhts
        ]
        weights = [random.Random(i).uniform(0.5, 2) for i in range(5)]
        expected = [
            sum(buffers[i][b].astype(np.float64) * weights[i] for i in range(5)) / sum(weights)
            for b in range(2)
        ]
        begin_at = get_dht_time() + 5
        services = [AllReduceService.for_node(dht.node) for dht in dhts]  # (as averagers do)

        async def member(i: int) -> Any:
            info = await matchmakers[i].look_for_group("", gather=b"", begin_at=begin_at)
            service = services[i]
            return await service.run(
                info.group,
                buffers[i],
                layout,
                weight=weights[i],
                config=RoundConfig(timeout=10),
            )

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(member, i)
    for own in buffers:
        np.testing.assert_allclose(own[0], expected[0], atol=1e-5)
        np.testing.assert_allclose(own[1], expected[1], atol=1e-12)


async def test_a_leader_refuses_followers_it_could_not_average_with() -> None:
    async with _dhts(2) as dhts:
        leader, other = _matchmakers(dhts, target=4)
        begin_at = get_dht_time() + 2
        bad_members = [
            MemberInfo(dhts[1].peer_id, ["not an address"], -1.0, "node", b""),
            MemberInfo(
                dhts[1].peer_id, [str(dhts[1].node.addresses[0])], float("nan"), "node", b""
            ),
            MemberInfo(dhts[1].peer_id, [], -1.0, "node", b""),  # a node nobody can dial
            MemberInfo(dhts[1].peer_id, [str(dhts[1].node.addresses[0])], -1.0, "boss", b""),
        ]
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def lead() -> None:
                    with pytest.raises(MatchmakingFailed):
                        await leader.look_for_group("", gather=b"", begin_at=begin_at)

                tg.start_soon(lead)
                await anyio.sleep(0.3)
                for member in bad_members:
                    request = JoinRequest("run.0b", SCHEMA, begin_at + 1, member)
                    async with dhts[1].node.rpc.server_stream(
                        dhts[0].node.addresses[0], "avg.join", request, response_type=JoinReply
                    ) as replies:
                        reply = await anext(replies)
                    assert reply.code == "rejected"
                    assert reply.reason
        del other


async def test_a_follower_survives_a_leader_that_sends_garbage() -> None:
    async with _dhts(2) as dhts:
        liar = dhts[0]

        async def lie(request: JoinRequest, ctx: Any) -> AsyncIterator[JoinReply]:
            yield JoinReply("accepted", "", b"", [])
            garbage = MemberInfo(ctx.peer_id, ["tcp://[nonsense"], 1.0, "node", b"")
            yield JoinReply("begin", "", b"g" * 16, [garbage])

        liar.node.rpc.register("avg.join", lie, kind="server_stream", request_type=JoinRequest)
        begin_at = get_dht_time() + 1.0
        assert await liar.store(
            "run.0b", {"schema": SCHEMA}, begin_at - 0.5, subkey=liar.peer_id.to_bytes()
        )
        (follower,) = _matchmakers(dhts[1:], target=2)
        with anyio.fail_after(10), pytest.raises(MatchmakingFailed):
            await follower.look_for_group("", gather=b"", begin_at=begin_at)


def _spy_on_joins(matchmaker: DHTMatchmaker) -> list[tuple[float, float, str]]:
    """Record ``(arrived, answered, code)`` of every first reply ``matchmaker`` gives to a
    join request (anyio time)."""
    answers: list[tuple[float, float, str]] = []
    serve = matchmaker._serve_join

    async def spy(request: JoinRequest, ctx: Any) -> AsyncIterator[JoinReply]:
        arrived = anyio.current_time()
        first = True
        async for reply in serve(request, ctx):
            if first:
                answers.append((arrived, anyio.current_time(), reply.code))
                first = False
            yield reply

    matchmaker._serve_join = spy  # type: ignore[method-assign]
    return answers


def _slow_first_read(matchmaker: DHTMatchmaker, delay: float) -> None:
    """``matchmaker``'s first read of the key's declarations takes ``delay`` s longer."""
    read = matchmaker._declarations
    calls = [0]

    async def slow(key: str) -> list[Any]:
        calls[0] += 1
        if calls[0] == 1:
            await anyio.sleep(delay)
        return await read(key)

    matchmaker._declarations = slow  # type: ignore[method-assign]


async def _best_reads_slowly(
    delay: float,
) -> tuple[list[Any], list[tuple[float, float, str]], Any]:
    """Four peers; the best-ranked one (smallest PeerID: all declare the same time) starts
    first, and its first read of the key takes ``delay`` s more; the others start 0.1 s later,
    see its declaration and ask it to take them in. Their outcomes, its answers, its PeerID."""
    async with _dhts(4) as dhts:
        matchmakers = _matchmakers(dhts, target=4)
        best = min(matchmakers, key=lambda m: m.peer_id.to_bytes())
        answers = _spy_on_joins(best)
        _slow_first_read(best, delay)
        outcomes: dict[Any, GroupInfo | BaseException] = {}
        begin_at = get_dht_time() + 10

        async def one(m: DHTMatchmaker) -> None:
            try:
                outcomes[m.peer_id] = await m.look_for_group("", gather=b"", begin_at=begin_at)
            except MatchmakingFailed as exc:
                outcomes[m.peer_id] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, best)
                await anyio.sleep(0.1)
                for m in matchmakers:
                    if m is not best:
                        tg.start_soon(one, m)
        return [outcomes[m.peer_id] for m in matchmakers], answers, best.peer_id


async def test_a_peer_still_reading_the_key_holds_join_requests_until_it_leads() -> None:
    """Peers that start together ask the best-ranked one while it still reads the key: it
    takes them in once it leads instead of turning them away (they would follow worse
    leaders, which disband only when they next read the key)."""
    outcomes, answers, best = await _best_reads_slowly(0.3)
    assert all(isinstance(o, GroupInfo) for o in outcomes), outcomes
    infos = [o for o in outcomes if isinstance(o, GroupInfo)]
    assert {i.leader for i in infos} == {best}
    assert len({i.group.group_id for i in infos}) == 1
    assert [code for _, _, code in answers] == ["accepted"] * 3, answers


async def test_a_join_request_waits_for_an_undecided_peer_only_so_long() -> None:
    """A peer that takes longer than half of request_timeout (1 s here) to decide answers
    what it would have answered then (``rejected``: not leading), before the requester gives
    up on it; every peer still ends in one group, led by it."""
    outcomes, answers, best = await _best_reads_slowly(1.5)
    assert all(isinstance(o, GroupInfo) for o in outcomes), outcomes
    rejected = [(a, b) for a, b, code in answers if code == "rejected"]
    assert rejected, answers
    assert all(0.4 <= answered - arrived < 1.0 for arrived, answered in rejected), rejected
    infos = [o for o in outcomes if isinstance(o, GroupInfo)]
    assert {i.leader for i in infos} == {best}


async def test_an_undecided_peer_turns_away_requests_for_another_key_at_once() -> None:
    """Only requests for the key we look under wait for our decision: one for another key (a
    stale declaration of ours from an earlier round) or another schema is answered at once."""
    async with _dhts(2) as dhts:
        deciding, other = _matchmakers(dhts, target=4)
        _slow_first_read(deciding, 3.0)
        begin_at = get_dht_time() + 5
        me = MemberInfo(other.peer_id, [str(dhts[1].node.addresses[0])], -1.0, "node", b"")
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: deciding.look_for_group("0", gather=b"", begin_at=begin_at))
                await anyio.sleep(0.3)  # (it is reading the key, for 3 s)
                for key, schema in (("run.0b1", SCHEMA), ("run.0b0", b"another schema")):
                    request = JoinRequest(key, schema, begin_at + 1, me)
                    asked = anyio.current_time()
                    async with dhts[1].node.rpc.server_stream(
                        dhts[0].node.addresses[0], "avg.join", request, response_type=JoinReply
                    ) as replies:
                        reply = await anext(replies)
                    assert reply.code == "rejected"
                    assert anyio.current_time() - asked < 0.01  # not held (the bound is 0.5 s)
                tg.cancel_scope.cancel()


async def test_declarations_and_member_infos_carry_the_announced_addresses() -> None:
    """A node listening on a wildcard (``0.0.0.0``) is dialed at the addresses its DHT
    announces (the facades expand the wildcard to the machine's interfaces), never at the
    listening address itself: the declarations and member infos carry those."""
    async with _dhts(2) as dhts:
        announced = Address.parse(f"tcp://192.0.2.7:7000/p/{dhts[0].peer_id}")
        dhts[0].protocol._announce = lambda: [announced]
        matchmaker = _matchmakers(dhts[:1], target=2)[0]
        assert matchmaker._me(b"").addresses == [str(announced)]
        key = "run.0b"
        await matchmaker._declare(key, Declare(True, get_dht_time() + 30, get_dht_time() + 5))
        found = await dhts[1].get(key, latest=True)
        assert found is not None
        entries = found.value
        assert isinstance(entries, dict)
        (declaration,) = (item.value for item in entries.values())
        assert declaration["addresses"] == [str(announced)]
        assert dhts[0].announced_addresses() == [announced]
        assert dhts[1].announced_addresses() == dhts[1].node.addresses


async def test_peers_lost_a_moment_ago_are_not_expected() -> None:
    """A training run counts a peer that died a moment ago (its progress record outlives it):
    the matchmaker takes the peers it lost within the last few seconds off the expected size,
    so the survivors do not wait a whole matchmaking time for it every round."""
    async with _dhts(2) as dhts:
        (matchmaker,) = _matchmakers(dhts[:1], target=4)
        assert matchmaker._expected() is None
        matchmaker.expected_group_size = 4
        assert matchmaker._expected() == 4
        matchmaker._peer_lost(dhts[1].peer_id)
        assert matchmaker._expected() == 3
        matchmaker._lost[dhts[1].peer_id] = get_dht_time() - 11.0  # (lost long enough ago)
        assert matchmaker._expected() == 4
        matchmaker.expected_group_size = 1
        matchmaker._peer_lost(dhts[1].peer_id)
        assert matchmaker._expected() == 1
        # (kept that long even where declarations live shorter: the search's lost peers are
        # those within declaration_ttl)
        matchmaker.declaration_ttl = 2.0
        matchmaker.expected_group_size = 4
        matchmaker._lost[dhts[1].peer_id] = get_dht_time() - 5.0
        assert matchmaker._lately_lost() == []
        assert matchmaker._expected() == 3
