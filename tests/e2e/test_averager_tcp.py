"""``swarmavg.aio.DecentralizedAverager`` over real sockets on 127.0.0.1: four peers, one round,
the exact mean, over TCP (encrypted, the default, and plaintext) and over QUIC (when
``swarmavg-quic`` is installed)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from swarmavg.abc import ConnectionAttribute
from swarmavg.aio import DHT
from swarmavg.aio.averager import DecentralizedAverager, StepResult

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TRANSPORTS = [
    pytest.param("tcp", {}, True, id="tcp-encrypted"),
    pytest.param("tcp", {"encryption": False}, False, id="tcp-plaintext"),
    pytest.param("quic", {}, True, id="quic"),
]


@asynccontextmanager
async def _averagers(
    tensors: Sequence[list[torch.Tensor]],
    transport: str,
    transport_options: dict[str, Any],
    client_mode: Sequence[bool] = (),
    **options: Any,
) -> AsyncIterator[list[DecentralizedAverager]]:
    """One DHT (on 127.0.0.1, a free port) and averager per peer; ``client_mode[i]`` puts peer
    ``i``'s DHT in client mode (it listens on nothing and only dials out)."""
    async with AsyncExitStack() as stack:
        listening: list[DHT] = []
        averagers = []
        for i, own in enumerate(tensors):
            client = i < len(client_mode) and client_mode[i]
            seeds = [a for d in listening[:2] for a in d.get_visible_maddrs()]
            dht = await stack.enter_async_context(
                DHT(
                    seeds,
                    client_mode=client,
                    transport=transport,
                    host="127.0.0.1",
                    port=0,
                    transport_options=transport_options,
                )
            )
            if not client:
                listening.append(dht)
            averagers.append(
                await stack.enter_async_context(DecentralizedAverager(own, dht, **options))
            )
        yield averagers


async def _step_all(averagers: Sequence[DecentralizedAverager]) -> list[StepResult]:
    results: list[StepResult | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        results[i] = await averagers[i].step(gather=i)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(len(averagers)):
                tg.start_soon(one, i)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _tensors(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(1000, generator=generator),
            torch.randn(3, 5, generator=generator, dtype=torch.float64),
        ]
        for _ in range(4)
    ]


def _mean(tensors: Sequence[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack([own[k].double() for own in tensors]).mean(dim=0) for k in range(2)]


async def _round(
    transport: str, transport_options: dict[str, Any], encrypted: bool, client_mode: list[bool]
) -> None:
    if transport == "quic":
        pytest.importorskip("swarmavg_quic")
    tensors = _tensors(seed=len(client_mode))
    expected = _mean(tensors)
    async with _averagers(
        tensors,
        transport,
        transport_options,
        client_mode,
        prefix="e2e",
        target_group_size=4,
    ) as averagers:
        results = await _step_all(averagers)
        peers = [a.dht.peer_id for a in averagers]
        for averager in averagers:
            with averager.get_tensors() as own:
                for tensor, mean in zip(own, expected, strict=True):
                    torch.testing.assert_close(tensor.double(), mean, atol=1e-6, rtol=0)
        # every peer talked to the others over the transport asked for, encrypted or not
        for averager in averagers:
            node = averager.dht.node
            connections = [node.connection_to(p) for p in peers if p != node.peer_id]
            for conn in connections:
                if conn is not None:
                    assert conn.extra(ConnectionAttribute.transport_name) == transport
                    assert conn.extra(ConnectionAttribute.encrypted) is encrypted
            assert any(conn is not None for conn in connections)
    for result in results:
        assert dict(result) == {peer: i for i, peer in enumerate(peers)}
        assert set(result.contributors) == set(peers)
        assert result.total_weight == pytest.approx(4.0)


@pytest.mark.parametrize(("transport", "transport_options", "encrypted"), TRANSPORTS)
async def test_four_peers_average_exactly_over_a_real_transport(
    transport: str, transport_options: dict[str, Any], encrypted: bool
) -> None:
    await _round(transport, transport_options, encrypted, client_mode=[])


@pytest.mark.parametrize(("transport", "transport_options", "encrypted"), TRANSPORTS)
async def test_a_client_mode_peer_that_listens_on_nothing_averages_too(
    transport: str, transport_options: dict[str, Any], encrypted: bool
) -> None:
    await _round(transport, transport_options, encrypted, client_mode=[False, False, False, True])
