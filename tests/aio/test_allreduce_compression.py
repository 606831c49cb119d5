"""Compression in the butterfly all-reduce (MemoryTransport, several real peers)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest
from round_options import run_options

from swarmavg.abc import RoundConfig
from swarmavg.aio.allreduce import (
    AllReduceResult,
    AllReduceService,
    Group,
    GroupMember,
    MemberMode,
    part_codecs,
)
from swarmavg.aio.node import Node
from swarmavg.compression import (
    BlockwiseQuantization,
    CompressionBase,
    ErrorFeedback,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorInfo,
    Uniform8BitQuantization,
)
from swarmavg.errors import RemoteError
from swarmavg.proto.allreduce import FlatLayout, Part, TensorSpec, load_balance, plan_parts
from swarmavg.proto.averaging_messages import AvgBegin, AvgCompressedPart
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio

SPECS = (TensorSpec((3000,), "float32"), TensorSpec((100,), "float64"))
LAYOUT = FlatLayout(SPECS)


@asynccontextmanager
async def _nodes(n: int) -> AsyncIterator[list[Node]]:
    options = {"memory": {"network": MemoryNetwork()}}
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(Node(listen=["memory://local:0"], transports=options))
            for _ in range(n)
        ]


def _group(nodes: Sequence[Node], modes: Sequence[MemberMode] | None = None) -> Group:
    modes = modes or [MemberMode.NODE] * len(nodes)
    return Group(
        os.urandom(16),
        tuple(
            GroupMember(n.peer_id, None if m is MemberMode.CLIENT else n.addresses[0], None, m)
            for n, m in zip(nodes, modes, strict=True)
        ),
    )


def _buffers(rng: np.random.Generator, layout: FlatLayout = LAYOUT) -> list[npt.NDArray[Any]]:
    return [rng.standard_normal(size).astype(dtype) for dtype, size in layout.buffers]


def _mean(buffers: Sequence[list[npt.NDArray[Any]]], members: Sequence[int]) -> list[Any]:
    return [
        sum(buffers[i][b].astype(np.float64) for i in members) / len(members)
        for b in range(len(buffers[0]))
    ]


async def _run_all(
    nodes: Sequence[Node],
    group: Group,
    buffers: Sequence[list[npt.NDArray[Any]]],
    layout: FlatLayout = LAYOUT,
    **options: Any,
) -> list[AllReduceResult]:
    results: list[AllReduceResult | None] = [None] * len(nodes)

    async def one(i: int) -> None:
        service = AllReduceService.for_node(nodes[i])
        results[i] = await service.run(group, buffers[i], layout, **run_options(options))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(len(nodes)):
                tg.start_soon(one, i)
    return results  # type: ignore[return-value]


def _assert_identical(buffers: Sequence[list[npt.NDArray[Any]]]) -> None:
    for member in buffers[1:]:
        for got, first in zip(member, buffers[0], strict=True):
            np.testing.assert_array_equal(got, first)


CODECS: list[tuple[CompressionBase, float]] = [
    (NoCompression(), 1e-6),
    (Float16Compression(), 1e-3),
    (ScaledFloat16Compression(), 1e-3),
    (Uniform8BitQuantization(), 0.05),
    (Quantile8BitQuantization(), 0.05),
    (BlockwiseQuantization(), 0.05),
]


@pytest.mark.parametrize(("codec", "error"), CODECS, ids=lambda c: getattr(c, "name", ""))
async def test_four_peers_end_identical_and_close_to_the_mean(
    codec: CompressionBase, error: float
) -> None:
    rng = np.random.default_rng(1)
    async with _nodes(4) as nodes:
        buffers = [_buffers(rng) for _ in nodes]
        expected = _mean(buffers, range(4))
        results = await _run_all(nodes, _group(nodes), buffers, part_size=700, compression=codec)
    _assert_identical(buffers)
    for got, want in zip(buffers[0], expected, strict=True):
        # (8-bit codecs: the tails of a quantile codebook are coarse; the typical error is small)
        assert np.sqrt(np.mean((got - want) ** 2)) < error
        assert np.abs(got - want).max() < (3 * error if error < 0.01 else 0.5)
    for result in results:
        assert not result.incomplete
        assert result.contributors == [0, 1, 2, 3]
    sent = sum(r.bytes_sent for r in results)
    # every value sent once by 3 of 4 members, and its mean back to them
    plain = 2 * (3 * LAYOUT.numel * 4 + 3 * 100 * 4)
    if codec.name == "none":
        assert sent >= plain
    elif codec.name == "quantile_8bit":  # (a 1 KiB codebook per 700-element part)
        assert sent < plain
    elif codec.name.endswith("8bit"):
        assert sent < plain / 3


async def test_identical_with_alpha_below_one_and_a_client() -> None:
    rng = np.random.default_rng(2)
    async with _nodes(3) as nodes:
        group = _group(nodes, [MemberMode.NODE, MemberMode.NODE, MemberMode.CLIENT])
        buffers = [_buffers(rng) for _ in nodes]
        before = [[b.copy() for b in member] for member in buffers]
        expected = _mean(buffers, range(3))
        await _run_all(
            nodes, group, buffers, part_size=500, compression=Float16Compression(),
            averaging_alpha=0.5,
        )  # fmt: skip
    for member, old in zip(buffers, before, strict=True):
        for got, was, want in zip(member, old, expected, strict=True):
            np.testing.assert_allclose(got, was + 0.5 * (want - was), atol=2e-3)


def test_a_part_takes_the_codec_of_the_tensor_holding_most_of_it() -> None:
    layout = FlatLayout((TensorSpec((10,), "float32"), TensorSpec((30,), "float32")))
    small, big = Float16Compression(), Uniform8BitQuantization()
    chooser = SizeAdaptiveCompression(20, less=small, greater_equal=big)
    parts = [Part(0, 0, 0, 0, 8), Part(0, 1, 0, 5, 16), Part(0, 2, 0, 8, 20), Part(0, 3, 0, 0, 20)]
    assert part_codecs(layout, parts, chooser) == [small, big, big, small]  # (tie: the first)
    infos = [TensorInfo("gradient", 10), TensorInfo("parameter", 30)]
    roles = RoleAdaptiveCompression(parameter=small, default=big)
    assert part_codecs(layout, parts, roles, infos) == [big, small, small, big]
    assert part_codecs(layout, parts, small) == [small] * 4
    with pytest.raises(ValueError, match="one TensorInfo per tensor"):
        part_codecs(layout, parts, roles, infos[:1])


async def test_per_tensor_codecs_in_one_allreduce() -> None:
    layout = FlatLayout(
        (
            TensorSpec((2000,), "float32"),
            TensorSpec((300,), "float32"),
            TensorSpec((50,), "float64"),
        )
    )
    chooser = RoleAdaptiveCompression(
        gradient=BlockwiseQuantization(256),
        parameter=SizeAdaptiveCompression(
            1000, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
        ),
    )
    infos = [TensorInfo("parameter", 2000), TensorInfo("parameter", 300), TensorInfo()]
    plans = plan_parts(layout, load_balance(layout.numel, [None] * 4), 250)
    chosen = [
        (p, c)
        for plan in plans
        for p, c in zip(plan, part_codecs(layout, plan, chooser, infos), strict=True)
    ]
    assert {c.name for _, c in chosen} == {"uniform_8bit", "float16", "none"}
    rng = np.random.default_rng(3)
    async with _nodes(4) as nodes:
        buffers = [_buffers(rng, layout) for _ in nodes]
        expected = _mean(buffers, range(4))
        await _run_all(
            nodes, _group(nodes), buffers, layout, part_size=250, compression=chooser,
            tensor_infos=infos,
        )  # fmt: skip
    _assert_identical(buffers)
    bounds = {"uniform_8bit": (1e-3, 0.05), "float16": (1e-6, 3e-3), "none": (0, 1e-12)}
    for part, codec in chosen:
        got = buffers[0][part.buffer][part.start : part.stop]
        error = np.abs(got - expected[part.buffer][part.start : part.stop]).max()
        low, high = bounds[codec.name]
        assert low <= error < high, (part, codec)


@pytest.mark.parametrize("bad", ["size", "nan_scale", "codec", "dtype", "bytes"])
async def test_a_forged_compressed_part_leaves_its_sender_out(bad: str) -> None:
    rng = np.random.default_rng(4)
    codec = Uniform8BitQuantization()
    async with _nodes(4) as nodes:
        # member 3 is a client (it reduces nothing): every span is reduced by honest members
        group = _group(nodes, [MemberMode.NODE] * 3 + [MemberMode.CLIENT])
        buffers = [_buffers(rng) for _ in nodes]
        expected = _mean(buffers, range(3))
        plans = plan_parts(LAYOUT, group.span_sizes(LAYOUT.numel), 1 << 16)
        services = [AllReduceService.for_node(node) for node in nodes]
        outcomes: dict[int, AllReduceResult] = {}

        async def honest(i: int) -> None:
            outcomes[i] = await services[i].run(
                group, buffers[i], LAYOUT, config=RoundConfig(timeout=20), compression=codec
            )

        async def forged(reducer: int) -> None:
            first = plans[reducer][0]
            values = buffers[3][first.buffer][first.start : first.stop]
            good = AvgCompressedPart.of(0, codec.compress(values))
            fields = {
                name: getattr(good, name)
                for name in ("codec", "shape", "dtype", "data", "scales", "codebook", "block_size")
            }
            if bad == "size":  # declares one more element (and brings the bytes for it)
                fields["shape"] = [first.size + 1]
                fields["data"] = np.zeros(first.size + 1, np.uint8)
            elif bad == "nan_scale":
                fields["scales"] = np.array([np.nan, 1.0], np.float32)
            elif bad == "codec":
                fields["codec"] = "zip_1bit"
            elif bad == "dtype":
                fields["dtype"] = "float16"
            else:
                fields["data"] = fields["data"][:-1]
            message = AvgCompressedPart(0, **fields)
            address = nodes[reducer].addresses[0]
            async with nodes[3].rpc.open(address, "avg.allreduce", kind="bidi") as call:
                await call.send(AvgBegin(group.group_id, 3, 1.0))
                await call.send(message)
                with pytest.raises(RemoteError):
                    await call.receive()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(honest, i)
                for reducer in range(3):
                    tg.start_soon(forged, reducer)
    _assert_identical(buffers[:3])
    for i in range(3):
        result = outcomes[i]
        assert {sender for _, sender, _, _ in result.dropped} == {3}
        assert not result.local_spans
        for got, want in zip(buffers[i], expected, strict=True):
            assert np.abs(got - want).max() < 0.05


async def test_a_plain_part_is_still_accepted_from_a_sender_that_does_not_compress() -> None:
    rng = np.random.default_rng(5)
    async with _nodes(2) as nodes:
        group = _group(nodes, [MemberMode.NODE, MemberMode.CLIENT])
        buffers = [_buffers(rng) for _ in nodes]
        expected = _mean(buffers, range(2))
        services = [AllReduceService.for_node(node) for node in nodes]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: services[0].run(
                        group, buffers[0], LAYOUT, compression=Float16Compression()
                    )
                )
                tg.start_soon(lambda: services[1].run(group, buffers[1], LAYOUT))
    _assert_identical(buffers)
    for got, want in zip(buffers[0], expected, strict=True):
        assert 0 < np.abs(got - want).max() < 2e-3  # the reducer compressed its answers


async def test_error_feedback_keeps_the_accumulated_error_small() -> None:
    rng = np.random.default_rng(6)
    layout = FlatLayout((TensorSpec((4000,), "float32"),))
    rounds = [[_buffers(rng, layout) for _ in range(4)] for _ in range(10)]
    errors = {}
    async with _nodes(4) as nodes:
        for feedback in (False, True):
            states = [ErrorFeedback() if feedback else None for _ in nodes]
            total = np.zeros(4000)
            for values in rounds:
                buffers = [[b.copy() for b in member] for member in values]
                expected = _mean(buffers, range(4))[0]
                services = [AllReduceService.for_node(node) for node in nodes]
                group = _group(nodes)
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        for i in range(4):
                            tg.start_soon(
                                _run_one, services[i], group, buffers[i], layout, states[i]
                            )
                _assert_identical(buffers)
                total += buffers[0][0] - expected
            errors[feedback] = float(np.sqrt(np.mean(total**2)))
    assert errors[True] < 0.6 * errors[False]


async def _run_one(
    service: AllReduceService,
    group: Group,
    buffers: list[npt.NDArray[Any]],
    layout: FlatLayout,
    feedback: ErrorFeedback | None,
) -> None:
    await service.run(
        group,
        buffers,
        layout,
        config=RoundConfig(part_size=500),
        compression=Uniform8BitQuantization(),
        error_feedback=feedback,
    )


async def test_big_parts_are_compressed_in_a_worker_thread() -> None:
    layout = FlatLayout((TensorSpec((600_000,), "float32"),))  # 2.4 MB parts (> 1 MiB)
    rng = np.random.default_rng(7)
    async with _nodes(2) as nodes:
        buffers = [_buffers(rng, layout) for _ in nodes]
        expected = _mean(buffers, range(2))
        await _run_all(
            nodes, _group(nodes), buffers, layout, part_size=600_000,
            compression=BlockwiseQuantization(),
        )  # fmt: skip
    _assert_identical(buffers)
    assert np.abs(buffers[0][0] - expected[0]).max() < 0.05


async def test_a_wrong_compression_argument_is_refused() -> None:
    async with _nodes(1) as nodes:
        service = AllReduceService.for_node(nodes[0])
        buffers = _buffers(np.random.default_rng(0))
        with pytest.raises(TypeError, match="codec or a chooser"):
            await service.run(_group(nodes), buffers, LAYOUT, compression="fp16")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="one TensorInfo per tensor"):
            await service.run(
                _group(nodes), buffers, LAYOUT, compression=RoleAdaptiveCompression(),
                tensor_infos=[TensorInfo()],
            )  # fmt: skip
