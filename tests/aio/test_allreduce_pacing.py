"""Pacing: in a round given ``upload_rate``, each connection we send on is capped at its share
of our upload (what it carries over all we send), and the caps come off when the round ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np
import pytest

from swarmavg.abc import RoundConfig
from swarmavg.aio._wire import WireSampler
from swarmavg.aio.allreduce import (
    AllReduceResult,
    AllReduceService,
    Group,
    GroupMember,
    MemberMode,
)
from swarmavg.aio.node import Node
from swarmavg.identity import Identity
from swarmavg.proto.allreduce import (
    PACING_MAX_RATE,
    FlatLayout,
    TensorSpec,
    pacing_plan,
    plan_parts,
)
from swarmavg.testing import MemoryNetwork, run_on_virtual_time

MIB = 1 << 20


def _group(modes: Sequence[MemberMode], bandwidths: Sequence[float | None] | None = None) -> Group:
    bandwidths = bandwidths or [None] * len(modes)
    return Group(
        os.urandom(16),
        tuple(
            GroupMember(
                Identity.generate().peer_id,
                None if mode is MemberMode.CLIENT else f"memory://local:{i + 1}",
                bandwidth,
                mode,
            )
            for i, (mode, bandwidth) in enumerate(zip(modes, bandwidths, strict=True))
        ),
    )


def _plan(
    group: Group, me: int, layout: FlatLayout, sends_values: bool, rate: float | None
) -> list[float | None]:
    """Each member's cap in ``group`` (``None``: not paced), as member ``me``."""
    spans = group.span_sizes(layout.numel)
    plans = plan_parts(layout, spans, 1 << 18)
    caps = pacing_plan(group, me, layout, plans, sends_values, rate)
    return [caps.get(m.peer_id) for m in group.members]


def test_an_even_split_shares_the_upload_evenly() -> None:
    layout = FlatLayout([TensorSpec((8 * MIB,), "float32")])  # 32 MiB: 8 MiB a span
    group = _group([MemberMode.NODE] * 4)
    caps = _plan(group, 1, layout, True, 12e6)
    # each of the 3 others gets 8 MiB of our values and 8 MiB of our span's means
    assert caps[1] is None
    assert caps[0] == caps[2] == caps[3] == pytest.approx(4e6)


def test_shares_follow_what_each_connection_carries() -> None:
    layout = FlatLayout([TensorSpec((8 * MIB,), "float32")])
    # member 2 reduces more than the others; member 3 is a client: no span, our means only
    group = _group(
        [MemberMode.NODE, MemberMode.NODE, MemberMode.NODE, MemberMode.CLIENT],
        [4.0, 4.0, 10.0, 1.0],
    )
    spans = group.span_sizes(layout.numel)
    assert spans[3] == 0
    assert 0 < spans[0] == spans[1] < spans[2]
    caps = _plan(group, 0, layout, True, 10e6)
    # to each: our values of its span, and our span's means
    carried = [0, spans[1] + spans[0], spans[2] + spans[0], spans[0]]
    assert caps[0] is None
    for member in (1, 2, 3):
        assert caps[member] == pytest.approx(10e6 * carried[member] / sum(carried))
    # an auxiliary member (or one of weight 0) sends no values: only its span's means
    aux = _group([MemberMode.AUX, MemberMode.NODE, MemberMode.NODE], [1.0, 1.0, 1.0])
    caps = _plan(aux, 0, layout, False, 9e6)
    assert caps == [None, pytest.approx(4.5e6), pytest.approx(4.5e6)]


def test_nothing_is_paced_without_a_rate_a_choice_or_enough_bytes_or_with_many_peers() -> None:
    big = FlatLayout([TensorSpec((8 * MIB,), "float32")])
    small = FlatLayout([TensorSpec((MIB,), "float32")])  # 4 MiB: under 16 MiB sent in all
    four = _group([MemberMode.NODE] * 4)
    assert _plan(four, 0, big, True, None) == [None] * 4
    assert _plan(four, 0, big, True, float("nan")) == [None] * 4
    assert _plan(four, 0, big, True, 0.0) == [None] * 4
    assert _plan(four, 0, small, True, 12e6) == [None] * 4
    # a fast upload: the CPU, not a shared queue, bounds the round (loopback, a LAN)
    assert (
        _plan(four, 0, big, True, PACING_MAX_RATE)
        == [None] + [pytest.approx(PACING_MAX_RATE / 3)] * 3
    )
    assert _plan(four, 0, big, True, PACING_MAX_RATE * 1.01) == [None] * 4
    assert _plan(four, 0, big, True, float("inf")) == [None] * 4
    # one connection has nothing to share its upload with
    assert _plan(_group([MemberMode.NODE] * 2), 0, big, True, 12e6) == [None] * 2
    # four or more share it evenly enough by themselves (measured: caps cost more there)
    assert _plan(_group([MemberMode.NODE] * 5), 0, big, True, 12e6) == [None] * 5
    assert _plan(_group([MemberMode.NODE] * 8), 3, big, True, 12e6) == [None] * 8


def test_a_round_caps_its_connections_and_takes_the_caps_off() -> None:
    """Over the memory transport (whose ``set_pacing_rate`` slows a direction): every member
    given ``upload_rate`` caps each connection it sends on at its share for the round, and
    clears it when the round is over; the round is exact."""
    layout = FlatLayout([TensorSpec((6 * MIB,), "float32")])  # 24 MiB: 18 MiB sent each
    calls: list[tuple[str, float | None]] = []
    conn_type: Any = None

    async def main() -> list[np.ndarray[Any, Any]]:
        nonlocal conn_type
        network = MemoryNetwork()
        async with AsyncExitStack() as stack:
            nodes = [
                await stack.enter_async_context(
                    Node(
                        listen=["memory://local:0"],
                        transports={"memory": {"network": network, "bandwidth": 50e6}},
                    )
                )
                for _ in range(4)
            ]
            for node in nodes[1:]:  # (connections before the round: paced as it begins)
                await nodes[0].connect(node.addresses[0])
            conn = nodes[0].connection_to(nodes[1].peer_id)
            assert conn is not None
            conn_type = type(conn)
            original = conn_type.set_pacing_rate

            def recording(self: Any, rate: float | None) -> bool:
                calls.append((self.peer_id.to_bytes().hex(), rate))
                return bool(original(self, rate))

            conn_type.set_pacing_rate = recording
            group = Group(
                os.urandom(16),
                tuple(GroupMember(n.peer_id, n.addresses[0], None, MemberMode.NODE) for n in nodes),
            )
            buffers = [[np.full(6 * MIB, float(i), np.float32)] for i in range(4)]

            async def one(i: int) -> None:
                service = AllReduceService.for_node(nodes[i])
                await service.run(
                    group,
                    buffers[i],
                    layout,
                    config=RoundConfig(part_size=1 << 18),
                    upload_rate=40e6,
                )

            try:
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        for i in range(4):
                            tg.start_soon(one, i)
            finally:
                conn_type.set_pacing_rate = original
            for node in nodes:
                assert not AllReduceService.for_node(node)._paced
            return [b[0] for b in buffers]

    results = run_on_virtual_time(main)
    for result in results:
        assert np.all(result == 1.5)
    caps = [rate for _, rate in calls if rate is not None]
    clears = [rate for _, rate in calls if rate is None]
    # each of 4 members caps its 3 connections at a third of 40 MB/s, and clears them
    assert len(caps) == len(clears) == 12
    assert caps == pytest.approx([40e6 / 3] * 12)
    assert calls[-1][1] is None


def test_the_wire_is_counted_on_every_connection_to_a_member() -> None:
    """Two peers that dial each other at once hold two connections, and each sends on its own
    pooled one: what a peer receives then comes over the connection it does not use. The
    round's wire logs count both (counting only the pooled one measured half of what came)."""

    async def main() -> None:
        network = MemoryNetwork()

        async def drain(stream: Any) -> None:
            with contextlib.suppress(Exception):
                while await stream.receive():
                    pass

        async with AsyncExitStack() as stack:
            a, b = [
                await stack.enter_async_context(
                    Node(
                        listen=["memory://local:0"],
                        transports={"memory": {"network": network, "bandwidth": 10e6}},
                        stream_handler=drain,
                    )
                )
                for _ in range(2)
            ]
            async with anyio.create_task_group() as tg:  # (both dial before either is pooled)
                tg.start_soon(a.connect, b.addresses[0])
                tg.start_soon(b.connect, a.addresses[0])
            assert len(a.connections_to(b.peer_id)) == len(b.connections_to(a.peer_id)) == 2
            result = AllReduceResult(contributors=[], total_weight=0.0)
            sampler = WireSampler(a, [b.peer_id], result)
            for conn in b.connections_to(a.peer_id):  # 1 MB over each
                stream = await conn.open_stream()
                await stream.send_last(bytes(1_000_000))
            await anyio.sleep(1.0)  # (0.2 s at 10 MB/s)
            sampler.sample()
            assert sum(nbytes for _, nbytes in result.wire_received_log) == 2_000_000
            await anyio.sleep(1.0)
            sampler.sample()  # nothing new
            assert sum(nbytes for _, nbytes in result.wire_received_log) == 2_000_000

    run_on_virtual_time(main)
