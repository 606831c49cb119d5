"""The butterfly all-reduce between real nodes (MemoryTransport; one TCP test)."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest
from round_options import run_options

from swarmavg.abc import RoundConfig
from swarmavg.aio.allreduce import (
    AllReduceFailed,
    AllReduceResult,
    AllReduceService,
    Group,
    GroupMember,
    MemberMode,
)
from swarmavg.aio.node import Node
from swarmavg.errors import RemoteError
from swarmavg.proto.allreduce import FlatLayout, TensorSpec, plan_parts
from swarmavg.proto.averaging_messages import (
    AvgBegin,
    AvgHave,
    AvgKeep,
    AvgLeave,
    AvgPart,
    AvgRelay,
    AvgWeights,
)
from swarmavg.proto.butterfly import Fault
from swarmavg.proto.codec import Message
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio

SPECS = (
    TensorSpec((64, 33), "float32"),
    TensorSpec((100,), "float64"),
    TensorSpec((7, 3), "float16"),
    TensorSpec((5,), "float32"),
)
LAYOUT = FlatLayout(SPECS)


@asynccontextmanager
async def _nodes(n: int, scheme: str = "memory") -> AsyncIterator[list[Node]]:
    options = {"memory": {"network": MemoryNetwork()}} if scheme == "memory" else {}
    host = "local" if scheme == "memory" else "127.0.0.1"
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                Node(listen=[f"{scheme}://{host}:0"], transports=options)
            )
            for _ in range(n)
        ]
        yield nodes


def _buffers(rng: np.random.Generator) -> list[npt.NDArray[Any]]:
    return [
        rng.standard_normal(size).astype(dtype if dtype != "bfloat16" else "float32")
        for dtype, size in LAYOUT.buffers
    ]


def _group(
    nodes: Sequence[Node],
    modes: Sequence[MemberMode] | None = None,
    bandwidths: Sequence[float | None] | None = None,
) -> Group:
    modes = modes or [MemberMode.NODE] * len(nodes)
    bandwidths = bandwidths or [None] * len(nodes)
    return Group(
        os.urandom(16),
        tuple(
            GroupMember(
                node.peer_id,
                None if mode is MemberMode.CLIENT else node.addresses[0],
                bandwidth,
                mode,
            )
            for node, mode, bandwidth in zip(nodes, modes, bandwidths, strict=True)
        ),
    )


async def _run_all(
    nodes: Sequence[Node],
    group: Group,
    buffers: Sequence[list[npt.NDArray[Any]]],
    weights: Sequence[float],
    **options: Any,
) -> list[AllReduceResult]:
    results: list[AllReduceResult | None] = [None] * len(nodes)

    async def one(i: int) -> None:
        service = AllReduceService.for_node(nodes[i])
        results[i] = await service.run(
            group, buffers[i], LAYOUT, weight=weights[i], **run_options(options)
        )

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(len(nodes)):
                tg.start_soon(one, i)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _expected(
    buffers: Sequence[list[npt.NDArray[Any]]], weights: Sequence[float], senders: Sequence[int]
) -> list[npt.NDArray[np.float64]]:
    total = sum(weights[i] for i in senders)
    return [
        sum(buffers[i][b].astype(np.float64) * weights[i] for i in senders) / total
        for b in range(len(LAYOUT.buffers))
    ]


def _tolerance(dtype: np.dtype[Any]) -> float:
    return {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-6}.get(dtype, 1e-12)


@pytest.mark.parametrize("part_size", [1 << 16, 100])
async def test_four_peers_reach_the_exact_mean(part_size: int) -> None:
    rng = np.random.default_rng(0)
    async with _nodes(4) as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        expected = _expected(buffers, [1.0] * 4, range(4))
        results = await _run_all(nodes, _group(nodes), buffers, [1.0] * 4, part_size=part_size)
    for member in buffers:
        for got, want in zip(member, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 4)
    for result in results:
        assert result.contributors == [0, 1, 2, 3]
        assert result.total_weight == 4.0
    assert sum(r.reduced for r in results) == LAYOUT.numel
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in results)


MODES = [
    combo
    for combo in itertools.product([MemberMode.NODE, MemberMode.CLIENT, MemberMode.AUX], repeat=4)
    if combo.count(MemberMode.CLIENT) <= 2
    and combo.count(MemberMode.AUX) <= 2
    and MemberMode.NODE in combo  # somebody has to reduce and send
]


@pytest.mark.parametrize("modes", MODES, ids=lambda m: "-".join(x.value for x in m))
async def test_client_and_auxiliary_members(modes: tuple[MemberMode, ...]) -> None:
    rng = np.random.default_rng(1)
    async with _nodes(4) as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        senders = [i for i, m in enumerate(modes) if m is not MemberMode.AUX]
        expected = _expected(buffers, [1.0] * 4, senders)
        results = await _run_all(nodes, _group(nodes, modes), buffers, [1.0] * 4, part_size=512)
    for i in senders:
        for got, want in zip(buffers[i], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 4)
    for i, mode in enumerate(modes):
        if mode is MemberMode.CLIENT:
            assert results[i].reduced == 0
        assert results[i].contributors == senders


async def test_weighted_mean_with_clients_and_a_weightless_member() -> None:
    rng = np.random.default_rng(2)
    weights = [0.5, 3.0, 0.0, 1.25]
    modes = [MemberMode.NODE, MemberMode.CLIENT, MemberMode.NODE, MemberMode.CLIENT]
    async with _nodes(4) as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        expected = _expected(buffers, weights, range(4))
        results = await _run_all(nodes, _group(nodes, modes), buffers, weights, part_size=300)
    for member in buffers:  # the weightless member ends with the mean too
        for got, want in zip(member, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 8)
    for result in results:
        assert result.contributors == [0, 1, 3]
        assert result.total_weight == pytest.approx(4.75)


async def test_all_weights_zero_keeps_local_values() -> None:
    rng = np.random.default_rng(3)
    async with _nodes(3) as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        before = [[b.copy() for b in member] for member in buffers]
        results = await _run_all(nodes, _group(nodes), buffers, [0.0] * 3)
    for member, old in zip(buffers, before, strict=True):
        for got, want in zip(member, old, strict=True):
            np.testing.assert_array_equal(got, want)
    assert all(r.contributors == [] for r in results)


async def test_bandwidth_sizes_the_spans_and_alpha_moves_part_way() -> None:
    rng = np.random.default_rng(4)
    async with _nodes(3) as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        before = [[b.astype(np.float64) for b in member] for member in buffers]
        expected = _expected(buffers, [1.0] * 3, range(3))
        group = _group(nodes, bandwidths=[10.0, 10.0, 0.0])
        results = await _run_all(nodes, group, buffers, [1.0] * 3, averaging_alpha=0.25)
    assert results[2].reduced == 0
    assert results[0].reduced + results[1].reduced == LAYOUT.numel
    for member, old in zip(buffers, before, strict=True):
        for got, start, mean in zip(member, old, expected, strict=True):
            want = start + 0.25 * (mean - start)
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 8)


@pytest.mark.realtime
async def test_over_tcp() -> None:
    rng = np.random.default_rng(5)
    async with _nodes(3, "tcp") as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        expected = _expected(buffers, [1.0, 2.0, 3.0], range(3))
        await _run_all(nodes, _group(nodes), buffers, [1.0, 2.0, 3.0], part_size=1000)
    for member in buffers:
        for got, want in zip(member, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 8)


async def test_a_member_that_never_comes_fails_the_round_within_the_timeout() -> None:
    rng = np.random.default_rng(6)
    async with _nodes(3) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in nodes]
        services = [AllReduceService.for_node(node) for node in nodes]  # serving, not joining
        service = services[0]
        with anyio.fail_after(10), pytest.raises(AllReduceFailed, match=r"within 0\.5 s"):
            await service.run(
                group,
                buffers[0],
                LAYOUT,
                config=RoundConfig(timeout=0.5),
            )


async def _intrude(
    members: int, caller: int, messages: Callable[[Group], Sequence[Message]], why: str
) -> None:
    """Node 0 runs a round of ``members``; node ``caller`` sends ``messages(group)`` on an
    all-reduce call to it and must get a RemoteError matching ``why``."""
    rng = np.random.default_rng(7)
    async with _nodes(members) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in nodes]
        for node in nodes:  # every node serves; only node 0 runs the round
            AllReduceService.for_node(node)

        async def honest() -> None:
            with pytest.raises(AllReduceFailed):
                await AllReduceService.for_node(nodes[0]).run(
                    group,
                    buffers[0],
                    LAYOUT,
                    config=RoundConfig(timeout=1),
                )

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(honest)
                await anyio.sleep(0.05)
                async with nodes[caller].rpc.open(nodes[0].addresses[0], "avg.allreduce") as call:
                    for message in messages(group):
                        await call.send(message)
                    with pytest.raises(RemoteError, match=why):
                        await call.receive()


async def test_a_caller_claiming_another_members_place_is_refused() -> None:
    # node 1 claims to be member 2
    await _intrude(3, 1, lambda g: [AvgBegin(g.group_id, 2, 1.0)], "not the member it claims")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (AvgPart(0, np.zeros(3, dtype=np.float32)), "shape"),
        (AvgPart(5, np.zeros(3, dtype=np.float32)), "expected part 0"),
        (AvgPart(0, np.zeros(3, dtype=np.int64)), "int64"),
        (AvgBegin(b"x" * 16, 1, 1.0), "expected part 0"),
    ],
)
async def test_garbage_fails_the_call_with_the_reason(bad: Message, why: str) -> None:
    await _intrude(2, 1, lambda g: [AvgBegin(g.group_id, 1, 1.0), bad], why)


async def test_a_call_that_breaks_off_after_every_part_came_blames_nobody() -> None:
    """Member 1 delivers its values of member 0's span (one part) but reads no answer, so
    member 0 is still sending it answers (a one-byte window) when member 1's call breaks off;
    member 1 never runs the round, so member 0 waits out the reducer timeout on member 1's span
    meanwhile. Member 0's span holds the exact mean and nobody is reported left out of it
    (nothing was)."""
    layout = FlatLayout((TensorSpec((1000,), "float32"),))
    rng = np.random.default_rng(11)
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                Node(
                    listen=["memory://local:0"],
                    transports={"memory": {"network": network, "window": 1}},
                )
            )
            for _ in range(2)
        ]
        group = _group(nodes)
        values = [rng.standard_normal(1000).astype(np.float32) for _ in nodes]
        want = (values[0].astype(np.float64) + values[1]) / 2
        span = group.span_sizes(layout.numel)[0]
        outcome: list[AllReduceResult] = []
        service = AllReduceService.for_node(nodes[0])
        AllReduceService.for_node(nodes[1])

        async def reducer() -> None:
            outcome.append(
                await service.run(
                    group,
                    [values[0]],
                    layout,
                    config=RoundConfig(part_size=1 << 16, timeout=10, reducer_timeout=1),
                )
            )

        class BreakOff(Exception):
            pass

        async def break_off() -> None:
            async with nodes[1].rpc.open(nodes[0].addresses[0], "avg.allreduce") as call:
                await call.send(AvgBegin(group.group_id, 1, 1.0))
                await call.send(AvgPart(0, values[1][:span].copy()))
                await anyio.sleep(0.3)  # member 0 answers into a full window meanwhile
                raise BreakOff  # (resets the call)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reducer)
                with pytest.raises(BreakOff):
                    await break_off()
    [result] = outcome
    assert result.dropped == []
    assert [(r, first) for r, first, _ in result.local_spans] == [(1, 0)]
    np.testing.assert_allclose(values[0][:span], want[:span], rtol=0, atol=1e-6)


async def test_the_others_finish_at_once_without_a_member_that_leaves() -> None:
    rng = np.random.default_rng(7)
    async with _nodes(3) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in nodes]
        before = [[b.copy() for b in own] for own in buffers]
        expected = _expected(buffers, [1.0] * 3, [0, 1])
        outcomes: list[AllReduceResult | None] = [None, None]
        leaver = AllReduceService.for_node(nodes[2])  # serving, never running the round

        async def run(i: int) -> None:
            service = AllReduceService.for_node(nodes[i])
            outcomes[i] = await service.run(
                group,
                buffers[i],
                LAYOUT,
                config=RoundConfig(timeout=20),
            )

        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
            await anyio.sleep(0.2)  # both are waiting for member 2, which never runs
            await leaver.leave(group, "the user cancelled")
        # when it was told (virtual time), not the 20 s timeout
        assert anyio.current_time() - started == pytest.approx(0.2, abs=1e-3)
        spans = group.span_sizes(LAYOUT.numel)
    lost = slice(spans[0] + spans[1], LAYOUT.numel)  # the leaver's span
    flat_expected = np.concatenate([e.astype(np.float64) for e in expected])
    for i, outcome in enumerate(outcomes):
        assert outcome is not None
        assert outcome.incomplete
        assert [(r, first) for r, first, _ in outcome.local_spans] == [(2, 0)]
        assert "the user cancelled" in outcome.local_spans[0][2]
        assert {(sender, first) for _, sender, first, _ in outcome.dropped} == {(2, 0)}
        flat = np.concatenate([b.astype(np.float64) for b in buffers[i]])
        flat_before = np.concatenate([b.astype(np.float64) for b in before[i]])
        np.testing.assert_array_equal(flat[lost], flat_before[lost])  # nothing half-averaged
        np.testing.assert_allclose(flat[: lost.start], flat_expected[: lost.start], atol=2e-3)


async def test_a_leave_notice_before_the_round_starts_is_taken_into_account() -> None:
    async with _nodes(2) as nodes:
        group = _group(nodes)
        services = [AllReduceService.for_node(node) for node in nodes]
        await services[1].leave(group, "gone")
        buffers = _buffers(np.random.default_rng(0))
        before = [b.copy() for b in buffers]
        with anyio.fail_after(5):
            result = await services[0].run(
                group,
                buffers,
                LAYOUT,
                config=RoundConfig(timeout=20),
            )
        assert [(r, why) for r, _, why in result.local_spans] == [(1, "it left the group: gone")]
        for got, was in zip(buffers, before, strict=True):  # alone: nothing changes
            np.testing.assert_array_equal(got, was)


async def test_leave_notices_from_strangers_are_refused_or_ignored() -> None:
    async with _nodes(3) as nodes:
        group = _group(nodes[:2])
        services = [AllReduceService.for_node(node) for node in nodes]
        # node 2 claims to be member 1 of the round: ignored when the round starts
        forged = Group(group.group_id, (group.members[0], _group(nodes[2:]).members[0]))
        with anyio.fail_after(5):
            await services[2].leave(forged, "forged")
        buffers = [_buffers(np.random.default_rng(i)) for i in range(2)]
        results = await _run_all(nodes[:2], group, buffers, [1.0, 1.0])
        assert all(r.contributors == [0, 1] for r in results)
        # a malformed notice fails only its call
        with pytest.raises(RemoteError, match="malformed"):
            await nodes[1].rpc.call(
                nodes[0].addresses[0], "avg.leave", AvgLeave(b"", 0, "x"), timeout=5
            )


async def _run_some(
    nodes: Sequence[Node],
    group: Group,
    buffers: Sequence[list[npt.NDArray[Any]]],
    members: Sequence[int],
    **options: Any,
) -> dict[int, AllReduceResult | BaseException]:
    """Run the round on ``members`` only; each one's result or exception."""
    outcomes: dict[int, AllReduceResult | BaseException] = {}
    for node in nodes:
        AllReduceService.for_node(node)  # everyone serves, even those that never run

    async def one(i: int) -> None:
        try:
            outcomes[i] = await AllReduceService.for_node(nodes[i]).run(
                group, buffers[i], LAYOUT, **run_options(options)
            )
        except AllReduceFailed as exc:
            outcomes[i] = exc

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in members:
                tg.start_soon(one, i)
    return outcomes


@pytest.mark.parametrize("bad", ["nan", "inf", "float64", "shape", "nan by hand"])
async def test_a_poisoned_sender_is_left_out_and_the_honest_mean_is_exact(bad: str) -> None:
    rng = np.random.default_rng(11)
    async with _nodes(4) as nodes:
        # member 3 is a client (it reduces nothing): every span is reduced by honest members
        group = _group(nodes, [MemberMode.NODE] * 3 + [MemberMode.CLIENT])
        buffers = [_buffers(rng) for _ in nodes]
        expected = _expected(buffers, [1.0] * 4, [0, 1, 2])
        plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 1 << 16)
        outcomes: dict[int, AllReduceResult] = {}
        services = [AllReduceService.for_node(node) for node in nodes]

        async def honest(i: int) -> None:
            outcomes[i] = await services[i].run(
                group,
                buffers[i],
                LAYOUT,
                config=RoundConfig(timeout=20),
            )

        async def poisoned_through_the_runner() -> None:
            for buffer in buffers[3]:
                buffer[::7] = np.nan if bad == "nan" else np.inf
            # our runner sees its own values are not finite: it sends nothing (weight 0) and
            # takes the honest mean
            outcomes[3] = await services[3].run(
                group,
                buffers[3],
                LAYOUT,
                config=RoundConfig(timeout=20),
            )

        async def poisoned_by_hand(reducer: int) -> None:
            # what a modified peer could send: the wrong dtype or size, or NaN, in its first part
            first = plans[reducer][0]
            values = buffers[3][first.buffer][first.start : first.stop]
            if bad == "nan by hand":
                values = values.copy()
                values[::7] = np.nan
            else:
                values = values.astype(np.float64) if bad == "float64" else values[:-1]
            address = nodes[reducer].addresses[0]
            async with nodes[3].rpc.open(address, "avg.allreduce", kind="bidi") as call:
                await call.send(AvgBegin(group.group_id, 3, 1.0))
                await call.send(AvgPart(0, values))
                with pytest.raises(RemoteError):
                    await call.receive()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(honest, i)
                if bad in ("nan", "inf"):
                    tg.start_soon(poisoned_through_the_runner)
                else:
                    for reducer in range(3):
                        tg.start_soon(poisoned_by_hand, reducer)
    if bad in ("nan", "inf"):  # it took part without its values: every round is complete
        assert outcomes[3].own_nonfinite
        for i in range(4):
            assert not outcomes[i].incomplete
            assert outcomes[i].contributors == [0, 1, 2]
            assert not outcomes[i].nonfinite
    else:
        for i in range(3):
            result = outcomes[i]
            assert result.incomplete
            assert {sender for _, sender, _, _ in result.dropped} == {3}
            assert not result.local_spans
            # a sender of NaN is named (the averager leaves it out of its next groups)
            assert result.nonfinite == ([3] if bad == "nan by hand" else [])
    for i in range(4 if bad in ("nan", "inf") else 3):
        for got, want in zip(buffers[i], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 4)


async def test_values_not_checked_before_the_round_are_refused_where_they_arrive() -> None:
    """``check_values=False`` (the averager checked them before the round; they changed since):
    the member's own span leaves its values out as they are added, its groupmates leave out
    what it sends them, and every member, itself included, ends with the honest mean."""
    rng = np.random.default_rng(12)
    async with _nodes(4) as nodes:
        group = _group(nodes, [MemberMode.NODE] * 4)  # member 3 reduces a span of its own
        buffers = [_buffers(rng) for _ in nodes]
        expected = _expected(buffers, [1.0] * 4, [0, 1, 2])
        for buffer in buffers[3]:
            buffer[::7] = np.nan
        config = RoundConfig(timeout=20, check_values=False)
        outcomes: dict[int, AllReduceResult] = {}

        async def one(i: int) -> None:
            service = AllReduceService.for_node(nodes[i])
            outcomes[i] = await service.run(group, buffers[i], LAYOUT, config=config)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
    assert not outcomes[3].own_nonfinite  # (it did not look)
    for i in range(4):
        assert not outcomes[i].local_spans
        dropped = outcomes[i].dropped
        assert {sender for _, sender, _, _ in dropped} == {3}
        # (our own span's reason is typed; the others' came as text in their notices)
        ours = [reason for reducer, _, _, reason in dropped if reducer == i]
        assert [reason.fault for reason in ours] == [  # type: ignore[attr-defined]
            Fault.OURS if i == 3 else Fault.NON_FINITE
        ]
        for got, want in zip(buffers[i], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 4)


async def test_a_sender_that_never_comes_is_left_out_after_sender_timeout() -> None:
    rng = np.random.default_rng(13)
    async with _nodes(4) as nodes:
        group = _group(nodes, [MemberMode.NODE] * 3 + [MemberMode.CLIENT])
        buffers = [_buffers(rng) for _ in nodes]
        expected = _expected(buffers, [1.0] * 4, [0, 1, 2])
        started = anyio.current_time()
        outcomes = await _run_some(
            nodes, group, buffers, range(3), timeout=20, sender_timeout=0.5, reducer_timeout=5
        )
        assert anyio.current_time() - started == pytest.approx(0.5, abs=1e-3)  # sender_timeout
    for i in range(3):
        result = outcomes[i]
        assert isinstance(result, AllReduceResult), result
        assert result.incomplete
        assert not result.local_spans
        assert all(s == 3 and "did not begin" in why for _, s, _, why in result.dropped)
        for got, want in zip(buffers[i], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 4)


async def _member_2_missing(
    seed: int, *, dead: bool, **options: Any
) -> tuple[dict[int, AllReduceResult | BaseException], list[list[npt.NDArray[Any]]]]:
    """A round of 3 that members 0 and 1 run (member 2 serves but never runs it, or its node
    is closed first when ``dead``), within 5 s: their outcomes and buffers, after checking
    that member 2's span kept their own values, the rest is the mean of theirs, and both
    agree on it (alpha = 1)."""
    rng = np.random.default_rng(seed)
    async with _nodes(3) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in nodes]
        before = [[b.copy() for b in own] for own in buffers]
        expected = _expected(buffers, [1.0] * 3, [0, 1])
        if dead:
            await nodes[2].aclose()
        started = anyio.current_time()
        outcomes = await _run_some(nodes, group, buffers, range(2), **options)
        assert anyio.current_time() - started < 5
        spans = group.span_sizes(LAYOUT.numel)
    flat_expected = np.concatenate([e.astype(np.float64) for e in expected])
    lost = slice(spans[0] + spans[1], LAYOUT.numel)  # member 2's span
    for i in range(2):
        result = outcomes[i]
        assert isinstance(result, AllReduceResult), result
        assert [(r, first) for r, first, _ in result.local_spans] == [(2, 0)]
        flat = np.concatenate([b.astype(np.float64) for b in buffers[i]])
        flat_before = np.concatenate([b.astype(np.float64) for b in before[i]])
        np.testing.assert_array_equal(flat[lost], flat_before[lost])  # kept local
        np.testing.assert_allclose(
            flat[: lost.start], flat_expected[: lost.start], rtol=0, atol=2e-3
        )
    flats = [np.concatenate([b.astype(np.float64) for b in buffers[i]]) for i in range(2)]
    np.testing.assert_array_equal(flats[0][: lost.start], flats[1][: lost.start])
    return outcomes, buffers


async def test_a_reducer_that_never_comes_leaves_its_span_local() -> None:
    await _member_2_missing(14, dead=False, timeout=20, sender_timeout=0.5, reducer_timeout=1)


async def test_a_member_that_died_before_the_round_is_left_out_at_once() -> None:
    """A member whose process died after its group formed, before it called anyone: the
    others cannot connect to it, and as nobody is connected to it they do not wait for its
    values either (``sender_timeout`` is 20 s here): its span stays local, its values are left
    out of theirs, and the survivors agree on the rest."""
    outcomes, _ = await _member_2_missing(
        15, dead=True, timeout=25, sender_timeout=20, reducer_timeout=20
    )
    for result in outcomes.values():
        assert isinstance(result, AllReduceResult)
        assert result.incomplete
        # (each reducer left it out of its span, and tells the others)
        assert sorted((r, s, first) for r, s, first, _ in result.dropped) == [(0, 2, 0), (1, 2, 0)]
        assert all("cannot be reached" in why for _, _, _, why in result.dropped)


@pytest.mark.parametrize("seed", range(50))
async def test_random_faults_never_hang_and_never_pass_a_wrong_average_for_right(
    seed: int,
) -> None:
    """Members that never come, leave at a random moment, or die at one (their node closes
    without a word): the others finish within the timeouts, every part a survivor reports as
    averaged holds the exact mean of the members its reducer says contributed (alpha = 1),
    and the survivors agree: each part is averaged, with the same values, by all of them or
    kept local by all of them."""
    rng = np.random.default_rng(seed)
    fates = ["run"] * 2 + list(rng.choice(["run", "absent", "leave", "kill"], size=2))
    rng.shuffle(fates)
    part_size = 97
    async with _nodes(4) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in nodes]
        original = [np.concatenate([b.astype(np.float64) for b in own]) for own in buffers]
        plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), part_size)
        services = [AllReduceService.for_node(node) for node in nodes]
        outcomes: dict[int, AllReduceResult | AllReduceFailed] = {}
        # (timeouts long enough that a loaded machine stalling this loop for a moment does not
        # end the relay that makes the survivors agree; the faults still strike mid-round)
        options = dict(part_size=part_size, timeout=15, sender_timeout=1.5, reducer_timeout=1.5)

        async def run(i: int) -> None:
            try:
                outcomes[i] = await services[i].run(
                    group, buffers[i], LAYOUT, **run_options(options)
                )
            except AllReduceFailed as exc:
                outcomes[i] = exc

        async def leave(i: int, after: float) -> None:
            with anyio.move_on_after(after):
                await services[i].run(group, buffers[i], LAYOUT, **run_options(options))
            await services[i].leave(group, "chaos")

        async def kill(i: int, after: float) -> None:
            with anyio.move_on_after(after):
                await services[i].run(group, buffers[i], LAYOUT, **run_options(options))
            await nodes[i].aclose()

        started = anyio.current_time()
        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                for i, fate in enumerate(fates):
                    if fate == "run":
                        tg.start_soon(run, i)
                    elif fate == "leave":
                        tg.start_soon(leave, i, float(rng.uniform(0, 0.02)))
                    elif fate == "kill":
                        tg.start_soon(kill, i, float(rng.uniform(0, 0.03)))
        assert anyio.current_time() - started < 10
    starts = [LAYOUT.buffer_start(b) for b in range(len(LAYOUT.buffers))]
    averaged: dict[tuple[int, int], npt.NDArray[np.float64]] = {}  # (reducer, part) -> values
    kept: set[tuple[int, int]] = set()
    for i, fate in enumerate(fates):
        if fate != "run" or isinstance(outcomes[i], AllReduceFailed):
            continue
        result = outcomes[i]
        assert isinstance(result, AllReduceResult)
        flat = np.concatenate([b.astype(np.float64) for b in buffers[i]])
        local_from = {r: first for r, first, _ in result.local_spans}
        dropped = {(r, s): first for r, s, first, _ in result.dropped}
        for reducer, parts in enumerate(plans):
            for part in parts:
                lo, hi = starts[part.buffer] + part.start, starts[part.buffer] + part.stop
                if part.index >= local_from.get(reducer, len(parts)):
                    np.testing.assert_array_equal(flat[lo:hi], original[i][lo:hi])  # kept
                    kept.add((reducer, part.index))
                    continue
                senders = [
                    s for s in range(4) if part.index < dropped.get((reducer, s), len(parts))
                ]
                want = np.mean([original[s][lo:hi] for s in senders], axis=0)
                np.testing.assert_allclose(flat[lo:hi], want, rtol=0, atol=2e-3)
                if (reducer, part.index) in averaged:  # every survivor got the same
                    np.testing.assert_array_equal(averaged[reducer, part.index], flat[lo:hi])
                averaged[reducer, part.index] = flat[lo:hi]
    # no disagreement: no part averaged by one survivor and kept local by another
    assert not kept & set(averaged), sorted(kept & set(averaged))


def _flat(buffers: Sequence[npt.NDArray[Any]]) -> npt.NDArray[np.float64]:
    return np.concatenate([b.astype(np.float64) for b in buffers])


async def _reducer_cut_short(
    nodes: Sequence[Node], die: bool, part_size: int = 97
) -> tuple[Group, list[list[npt.NDArray[Any]]], dict[int, AllReduceResult | BaseException]]:
    """Member 2 of 3 answers member 0 its whole span but member 1 only its first 3 parts:
    then it dies (its node closes) or stalls."""
    rng = np.random.default_rng(21)
    group = _group(nodes)
    buffers = [_buffers(rng) for _ in nodes]
    service = AllReduceService.for_node(nodes[2])
    served_0 = anyio.Event()
    stop = anyio.Event()

    async def serve(requests: AsyncIterator[Message], ctx: Any) -> AsyncIterator[Message]:
        caller = group.index_of(ctx.peer_id)
        answered = 0
        async for reply in service._serve(requests, ctx):
            if caller == 1 and answered == 3:
                continue  # (its parts are still taken: member 0 gets all of its answers)
            yield reply
            answered += isinstance(reply, AvgPart | AvgKeep)
        if caller == 0:
            served_0.set()
        else:
            await served_0.wait()
            await anyio.sleep(0.2)  # (member 0 has applied its last part)
            stop.set()
            await anyio.sleep_forever()

    nodes[2].rpc.unregister("avg.allreduce")
    nodes[2].rpc.register("avg.allreduce", serve, kind="bidi", request_type=Message)
    outcomes: dict[int, AllReduceResult | BaseException] = {}
    options = dict(part_size=part_size, timeout=20, sender_timeout=5, reducer_timeout=1)

    async def one(i: int) -> None:
        try:
            outcomes[i] = await AllReduceService.for_node(nodes[i]).run(
                group, buffers[i], LAYOUT, **run_options(options)
            )
        except AllReduceFailed as exc:
            outcomes[i] = exc

    async def dying() -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 2)
                await stop.wait()
                if die:
                    scope.cancel()
                    await nodes[2].aclose()

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
            tg.start_soon(dying)
    return group, buffers, outcomes


@pytest.mark.parametrize("die", [True, False], ids=["dies", "stalls"])
async def test_a_reducer_cut_short_while_answering_leaves_no_disagreement(die: bool) -> None:
    """Member 2 answers member 0 all of its span and member 1 part of it, then dies (or
    stalls past the reducer timeout): member 1 gets the rest from member 0 (or from member 2
    itself, which applied its own span) and both end with identical tensors."""
    async with _nodes(3) as nodes:
        rng = np.random.default_rng(21)  # (what _reducer_cut_short starts from)
        original = [_flat(_buffers(rng)) for _ in range(3)]
        group, buffers, outcomes = await _reducer_cut_short(nodes, die)
    first, second = outcomes[0], outcomes[1]
    assert isinstance(first, AllReduceResult), first
    assert isinstance(second, AllReduceResult), second
    assert not first.local_spans
    assert not first.relayed
    assert not second.local_spans
    [(reducer, start, stop, source)] = second.relayed
    assert (reducer, start) == (2, 3)
    assert source in ((0,) if die else (0, 2))
    plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 97)
    assert stop == len(plans[2])
    flats = [_flat(buffers[i]) for i in range(2)]
    np.testing.assert_array_equal(flats[0], flats[1])  # identical, all of it
    # the exact mean of the three
    want = np.concatenate(
        [e.astype(np.float64) for e in _expected(buffers_of(original), [1.0] * 3, [0, 1, 2])]
    )
    np.testing.assert_allclose(flats[0], want, rtol=0, atol=2e-3)


@pytest.mark.parametrize("bad", ["nan", "inf", "weights"])
async def test_a_reducer_answering_non_finite_means_leaves_its_span_local(bad: str) -> None:
    """Member 2 reduces honestly but answers every sender means with a NaN or inf in them,
    or NaN and negative weights (and relays nothing): the others refuse its answers and keep
    their own values for its span, which no non-finite value ever reaches."""
    async with _nodes(3) as nodes:
        rng = np.random.default_rng(5)
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in nodes]
        original = [[b.copy() for b in own] for own in buffers]
        expected = _expected(buffers, [1.0] * 3, [0, 1, 2])
        service = AllReduceService.for_node(nodes[2])

        async def serve(requests: AsyncIterator[Message], ctx: Any) -> AsyncIterator[Message]:
            async for reply in service._serve(requests, ctx):
                if bad == "weights" and isinstance(reply, AvgWeights):
                    reply = AvgWeights([math.nan, -1.0, *reply.weights[2:]])
                elif bad != "weights" and isinstance(reply, AvgPart):
                    values = reply.values.copy()
                    values[len(values) // 2] = np.nan if bad == "nan" else -np.inf
                    reply = AvgPart(reply.index, values)
                yield reply

        nodes[2].rpc.unregister("avg.allreduce")
        nodes[2].rpc.register("avg.allreduce", serve, kind="bidi", request_type=Message)
        nodes[2].rpc.unregister("avg.relay")
        outcomes = await _run_all(
            nodes, group, buffers, [1.0] * 3, part_size=97, reducer_timeout=1, sender_timeout=5
        )
    plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 97)
    for i in (0, 1):
        [(reducer, first, why)] = outcomes[i].local_spans
        assert (reducer, first) == (2, 0)
        assert ("weights" if bad == "weights" else "non-finite") in why
        for buffer, values in enumerate(buffers[i]):
            assert np.isfinite(values).all()
            for reducer, parts in enumerate(plans):
                for part in (p for p in parts if p.buffer == buffer):
                    got = values[part.start : part.stop]
                    if reducer == 2:  # kept local
                        np.testing.assert_array_equal(
                            got, original[i][buffer][part.start : part.stop]
                        )
                    else:
                        want = expected[buffer][part.start : part.stop]
                        np.testing.assert_allclose(
                            got, want, rtol=0, atol=_tolerance(got.dtype) * 4
                        )


async def test_non_finite_values_relayed_are_refused() -> None:
    """As above (member 2 dies partway through answering member 1), but member 0 relays
    the rest with a NaN in it: member 1 refuses it and keeps the rest of member 2's span."""
    async with _nodes(3) as nodes:
        rng = np.random.default_rng(21)  # (what _reducer_cut_short starts from)
        original = [_flat(_buffers(rng)) for _ in range(3)]
        service = AllReduceService.for_node(nodes[0])

        async def relay(ask: AvgRelay, ctx: Any) -> AsyncIterator[Message]:
            async for answer in service._relays.serve(ask, ctx):
                if isinstance(answer, AvgPart):
                    answer.values[0] = np.nan
                yield answer

        nodes[0].rpc.unregister("avg.relay")
        nodes[0].rpc.register("avg.relay", relay, kind="server_stream", request_type=AvgRelay)
        group, buffers, outcomes = await _reducer_cut_short(nodes, die=True)
    second = outcomes[1]
    assert isinstance(second, AllReduceResult), second
    assert not second.relayed
    [(reducer, first, _)] = second.local_spans
    assert (reducer, first) == (2, 3)
    plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 97)
    flat = _flat(buffers[1])
    assert np.isfinite(flat).all()
    starts = [LAYOUT.buffer_start(b) for b in range(len(LAYOUT.buffers))]
    for part in plans[2][3:]:  # kept: member 1's own values
        at = starts[part.buffer] + part.start
        np.testing.assert_array_equal(flat[at : at + part.size], original[1][at : at + part.size])


def buffers_of(flats: Sequence[npt.NDArray[np.float64]]) -> list[list[npt.NDArray[Any]]]:
    """Flat float64 vectors split back into LAYOUT's buffers."""
    out = []
    for flat in flats:
        own, at = [], 0
        for _, size in LAYOUT.buffers:
            own.append(flat[at : at + size])
            at += size
        out.append(own)
    return out


async def _relay_ask(node: Node, to: Node, ask: AvgRelay) -> list[Message]:
    async with node.rpc.server_stream(to.addresses[0], "avg.relay", ask, timeout=5) as answers:
        return [answer async for answer in answers]


async def test_relay_requests_are_checked_and_answer_only_what_is_held() -> None:
    """``avg.relay`` answers a member with the parts it applied (until its buffers are used
    again), nothing for an unknown round or with alpha != 1, and refuses strangers and
    malformed requests."""
    rng = np.random.default_rng(31)
    async with _nodes(3) as nodes:
        group = _group(nodes[:2])
        buffers = [_buffers(rng) for _ in range(2)]
        await _run_all(nodes[:2], group, buffers, [1.0, 1.0], part_size=97)
        plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 97)
        got = await _relay_ask(nodes[1], nodes[0], AvgRelay(group.group_id, 1, 2, True))
        assert isinstance(got[0], AvgHave)
        assert got[0].count == len(plans[1])
        assert [a.index for a in got[1:] if isinstance(a, AvgPart)] == list(range(2, len(plans[1])))
        flat = _flat(buffers[0])
        starts = [LAYOUT.buffer_start(b) for b in range(len(LAYOUT.buffers))]
        for answer in got[1:]:
            assert isinstance(answer, AvgPart)
            part = plans[1][answer.index]
            lo = starts[part.buffer] + part.start
            np.testing.assert_array_equal(answer.values, flat[lo : lo + part.size])
        # unknown round: nothing; a stranger, a bad index or a negative part: refused
        [have] = await _relay_ask(nodes[1], nodes[0], AvgRelay(b"x" * 16, 1, 0, True))
        assert have == AvgHave(0)
        for who, ask in [
            (nodes[2], AvgRelay(group.group_id, 1, 0, True)),
            (nodes[1], AvgRelay(group.group_id, 5, 0, True)),
            (nodes[1], AvgRelay(group.group_id, 1, -1, True)),
            (nodes[1], AvgRelay(b"", 1, 0, True)),
        ]:
            with pytest.raises(RemoteError):
                await _relay_ask(who, nodes[0], ask)
        # the next round on the same buffers ends what the last one can relay
        group2 = _group(nodes[:2])
        await _run_all(nodes[:2], group2, buffers, [1.0, 1.0], averaging_alpha=0.5)
        [have] = await _relay_ask(nodes[1], nodes[0], AvgRelay(group.group_id, 1, 0, True))
        assert have == AvgHave(0)
        # ... and a round with alpha != 1 has nothing to relay: its buffers are not the means
        [have] = await _relay_ask(nodes[1], nodes[0], AvgRelay(group2.group_id, 1, 0, True))
        assert have == AvgHave(0)


async def test_results_in_the_callers_memory_are_relayed_only_while_it_says_they_hold() -> None:
    """Buffers that are the caller's tensors (``results_valid``) are relayed from after the
    round only while the caller says they still hold its results; a round on another view of
    the same memory ends the relaying too."""
    rng = np.random.default_rng(37)
    async with _nodes(2) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in range(2)]
        holds = [True]
        await _run_all(nodes, group, buffers, [1.0, 1.0], results_valid=lambda: holds[0])
        ask = AvgRelay(group.group_id, 1, 0, True)
        plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 1 << 16)
        got = await _relay_ask(nodes[1], nodes[0], ask)
        assert got[0] == AvgHave(len(plans[1]))
        assert len(got) == 1 + len(plans[1])
        holds[0] = False  # (the caller changed its tensors)
        [have] = await _relay_ask(nodes[1], nodes[0], ask)
        assert have == AvgHave(0)
        # a new round on views of the same memory (new array objects) forgets the old one
        holds[0] = True
        group2 = _group(nodes)
        views = [[buffer[:] for buffer in own] for own in buffers]
        await _run_all(nodes, group2, views, [1.0, 1.0])
        [have] = await _relay_ask(nodes[1], nodes[0], ask)
        assert have == AvgHave(0)


async def test_results_in_the_callers_memory_are_kept_for_relays_when_it_takes_them_back() -> None:
    """The caller is about to change its tensors (``keep_results``): a round of three whose
    results they still hold copies them, and relays go on from the copy, the same values as
    before, however the tensors change; until the next round on that memory."""
    rng = np.random.default_rng(41)
    async with _nodes(3) as nodes:
        group = _group(nodes)
        buffers = [_buffers(rng) for _ in range(3)]
        holds = [True]
        await _run_all(nodes, group, buffers, [1.0] * 3, results_valid=lambda: holds[0])
        ask = AvgRelay(group.group_id, 1, 0, True)
        before = await _relay_ask(nodes[1], nodes[0], ask)
        service = AllReduceService.for_node(nodes[0])
        service.keep_results(buffers[0], max_bytes=1 << 30)
        holds[0] = False  # (the caller changed its tensors)
        for buffer in buffers[0]:
            buffer[...] = 7
        after = await _relay_ask(nodes[1], nodes[0], ask)
        assert after[0] == before[0] != AvgHave(0)
        assert len(after) == len(before) > 1
        for old, new in zip(before[1:], after[1:], strict=True):
            assert isinstance(new, AvgPart)
            assert isinstance(old, AvgPart)
            np.testing.assert_array_equal(new.values, old.values)
        # the next round on that memory ends it; too large a copy is not made at all
        await _run_all(nodes, _group(nodes), buffers, [1.0] * 3)
        [have] = await _relay_ask(nodes[1], nodes[0], ask)
        assert have == AvgHave(0)
        group3 = _group(nodes)
        holds[0] = True
        await _run_all(nodes, group3, buffers, [1.0] * 3, results_valid=lambda: holds[0])
        service.keep_results(buffers[0], max_bytes=1)
        holds[0] = False
        [have] = await _relay_ask(nodes[1], nodes[0], AvgRelay(group3.group_id, 1, 0, True))
        assert have == AvgHave(0)


async def test_later_rounds_reduce_into_recycled_accumulators() -> None:
    # (a fresh span-sized accumulator is page-faulted in every round; the pool hands the last
    # round's back once nothing refers to it: the means of later rounds stay exact)
    rng = np.random.default_rng(3)
    async with _nodes(4) as nodes:
        pools = [AllReduceService.for_node(node)._accumulators for node in nodes]
        for _ in range(3):
            buffers = [_buffers(rng) for _ in nodes]
            expected = _expected(buffers, [1.0] * 4, range(4))
            await _run_all(nodes, _group(nodes), buffers, [1.0] * 4)
            for member in buffers:
                for got, want in zip(member, expected, strict=True):
                    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(got.dtype) * 4)
    # every node reduces a span (all dtypes: one accumulator per dtype buffer it covers)
    assert all(pool.made > 0 for pool in pools)
    assert all(pool.reused >= 2 * pool.made for pool in pools), [(p.made, p.reused) for p in pools]


@pytest.mark.parametrize(
    ("behaviour", "fault", "at", "why"),
    [
        ("silent", Fault.SILENT, 4.0, "it sent nothing for 3 s"),
        ("ends early", Fault.ENDED_EARLY, 2.0, "1 parts of 5 came"),
        ("garbage", Fault.BAD_DATA, 2.0, "part 1 has shape (4,) and dtype int64, not (4,) float32"),
        # (a dead peer's stream ends before its connection is known lost)
        ("dies", Fault.ENDED_EARLY, 2.0, "1 parts of 5 came"),
    ],
)
async def test_a_faulty_sender_and_a_silent_reducer_are_given_up_on_at_the_exact_second(
    behaviour: str, fault: Fault, at: float, why: str
) -> None:
    """On virtual time. Member 1 begins its call to member 0's span and sends part 0 at 1 s;
    then it goes silent, or at 2 s ends its stream, sends garbage or dies (its node closes).
    Its node runs no round, so member 0's call to member 1's span waits unanswered. Member 0
    leaves member 1 out of its parts 1.. at ``at`` (``sender_timeout`` = 3 s after part 0, or
    at once) and ends its call with the reason then, and keeps its values on member 1's span
    exactly ``reducer_timeout`` = 5 s after its call opened (or at once when it died); the
    round ends then."""
    layout = FlatLayout((TensorSpec((40,), "float32"),))
    async with _nodes(2) as nodes:
        group = _group(nodes)
        for node in nodes:
            AllReduceService.for_node(node)
        values = [np.arange(40, dtype=np.float32) + 100 * i for i in range(2)]
        plans = plan_parts(layout, group.span_sizes(layout.numel), 4)
        outcome: list[AllReduceResult] = []
        begun = anyio.current_time()

        async def reducer() -> None:
            service = AllReduceService.for_node(nodes[0])
            config = RoundConfig(part_size=4, timeout=60, sender_timeout=3, reducer_timeout=5)
            outcome.append(await service.run(group, [values[0]], layout, config=config))

        async def faulty() -> None:
            async with nodes[1].rpc.open(nodes[0].addresses[0], "avg.allreduce") as call:
                await call.send(AvgBegin(group.group_id, 1, 1.0))
                await anyio.sleep(1)
                first = plans[0][0]
                await call.send(AvgPart(0, values[1][first.start : first.stop].copy()))
                if behaviour != "silent":
                    await anyio.sleep(1)
                if behaviour == "ends early":
                    await call.done_sending()
                elif behaviour == "garbage":
                    await call.send(AvgPart(1, np.zeros(4, np.int64)))
                elif behaviour == "dies":
                    await nodes[1].aclose()
                    return
                with pytest.raises(RemoteError, match=re.escape(why)):
                    async for _ in call:
                        pass
                # (plus the memory links' delays)
                assert anyio.current_time() - begun == pytest.approx(at, abs=1e-3)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reducer)
                await faulty()
    [result] = outcome
    assert result.seconds == pytest.approx(at if behaviour == "dies" else 5.0, abs=1e-3)
    [(reducer_, sender, part, reason)] = result.dropped
    assert (reducer_, sender, part) == (0, 1, 1)
    assert why in reason
    assert reason.fault is fault  # type: ignore[attr-defined]
    if behaviour == "dies":  # (our call to it broke when its node closed)
        [(reducer_, part, reason)] = result.local_spans
        assert (reducer_, part) == (1, 0)
        assert "interrupted" in reason
        assert reason.fault is Fault.BROKE_OFF  # type: ignore[attr-defined]
    else:
        assert result.local_spans == [(1, 0, "it answered nothing for 5 s")]
    # member 0's span: part 0 holds the mean of both, parts 1.. its own values
    span = group.span_sizes(layout.numel)[0]
    want = np.arange(40, dtype=np.float32)
    want[:4] += 50
    np.testing.assert_array_equal(values[0][:span], want[:span])


async def test_a_reducer_that_ends_its_answers_early_leaves_its_span_local() -> None:
    """Member 1's node answers member 0's call with the weights and then ends the stream (it
    runs no round of its own, so member 0 leaves it out of its span after ``sender_timeout``):
    member 0's round completes with member 1's span at its own values, the fault typed, not an
    ExceptionGroup (Trust I's F12)."""
    layout = FlatLayout((TensorSpec((40,), "float32"),))
    async with _nodes(2) as nodes:
        group = _group(nodes)
        AllReduceService.for_node(nodes[0])

        async def ends_early(requests: AsyncIterator[Message], ctx: Any) -> AsyncIterator[Message]:
            await anext(requests)
            yield AvgWeights([1.0, 1.0])

        nodes[1].rpc.register("avg.allreduce", ends_early, kind="bidi", request_type=Message)
        values = np.arange(40, dtype=np.float32)
        config = RoundConfig(part_size=4, timeout=60, sender_timeout=3, reducer_timeout=5)
        with anyio.fail_after(30):
            result = await AllReduceService.for_node(nodes[0]).run(
                group, [values], layout, config=config
            )
    [(reducer, part, reason)] = result.local_spans
    assert (reducer, part, reason.fault) == (1, 0, Fault.ENDED_EARLY)  # type: ignore[attr-defined]
    assert "ended its answers after 0 of 5" in reason
    assert result.seconds == pytest.approx(3.0, abs=1e-3)  # (member 1 never began: left out)
    np.testing.assert_array_equal(values, np.arange(40, dtype=np.float32))
