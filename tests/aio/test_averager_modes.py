"""``swarmavg.aio.DecentralizedAverager`` with peers in every mode (MemoryTransport).

Four real peers (each a ``swarmavg.aio.DHT`` on one :class:`MemoryNetwork`) average once in a
group of four. Peers take part as:

- ``node``: sends its values and reduces a span;
- ``client``: nobody can dial it, so it sends and reduces nothing; either its DHT runs in client
  mode (``DHT(client_mode=True)``, which listens on nothing) or only its averager does
  (``DecentralizedAverager(client_mode=True)`` on a listening DHT);
- ``aux``: reduces a span and contributes nothing (its tensors only give the schema).

A group needs a peer that can reduce (a node or an aux peer: at most two of four are clients
here) and one that contributes (at most two are auxiliary), so every mix of 0–2 clients and
0–2 auxiliary peers forms a group.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch

from swarmavg.abc import MemberMode
from swarmavg.aio import DHT
from swarmavg.aio.averager import DecentralizedAverager, StepResult
from swarmavg.testing import MemoryNetwork

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Role:
    """How one peer takes part: ``"node"``, ``"aux"``, ``"client-dht"`` (the DHT is in client
    mode) or ``"client-avg"`` (only the averager is)."""

    name: str

    @property
    def dht_client(self) -> bool:
        return self.name == "client-dht"

    @property
    def averager_options(self) -> dict[str, Any]:
        return {
            "node": {},
            "aux": {"auxiliary": True},
            "client-dht": {},
            "client-avg": {"client_mode": True},
        }[self.name]

    @property
    def mode(self) -> MemberMode:
        if self.name == "aux":
            return MemberMode.AUX
        return MemberMode.NODE if self.name == "node" else MemberMode.CLIENT


NODE, AUX = Role("node"), Role("aux")
CLIENT_DHT, CLIENT_AVG = Role("client-dht"), Role("client-avg")


@asynccontextmanager
async def _peers(
    roles: Sequence[Role], tensors: Sequence[list[torch.Tensor]], **options: Any
) -> AsyncIterator[list[DecentralizedAverager]]:
    """One averager per role, on DHTs that bootstrap from the first two listening ones."""
    network = MemoryNetwork()
    transport_options = {"network": network}
    async with AsyncExitStack() as stack:
        listening: list[DHT] = []
        averagers = []
        for role, own in zip(roles, tensors, strict=True):
            seeds = [a for d in listening[:2] for a in d.get_visible_maddrs()]
            dht = await stack.enter_async_context(
                DHT(
                    seeds,
                    client_mode=role.dht_client,
                    transport="memory",
                    transport_options=transport_options,
                )
            )
            if not role.dht_client:
                listening.append(dht)
            averager = DecentralizedAverager(own, dht, **{**options, **role.averager_options})
            assert averager.mode is role.mode
            averagers.append(await stack.enter_async_context(averager))
        yield averagers


async def _step_all(averagers: Sequence[DecentralizedAverager], **kwargs: Any) -> list[StepResult]:
    """Every averager's ``step`` at once; a list value of ``kwargs`` gives each its own."""
    results: list[StepResult | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        extra = {k: v[i] if isinstance(v, list) else v for k, v in kwargs.items()}
        results[i] = await averagers[i].step(**extra)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(len(averagers)):
                tg.start_soon(one, i)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _random_tensors(count: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(30, 5, generator=generator),
            torch.randn(7, generator=generator, dtype=torch.float64),
        ]
        for _ in range(count)
    ]


def _weighted_mean(
    tensors: Sequence[list[torch.Tensor]], weights: Sequence[float]
) -> list[torch.Tensor]:
    total = sum(weights)
    return [
        sum(
            (t[k].double() * w for t, w in zip(tensors, weights, strict=True)),
            torch.zeros_like(tensors[0][k], dtype=torch.float64),
        )
        / total
        for k in range(len(tensors[0]))
    ]


def _assert_holds(averager: DecentralizedAverager, expected: Sequence[torch.Tensor]) -> None:
    with averager.get_tensors() as own:
        for tensor, mean in zip(own, expected, strict=True):
            torch.testing.assert_close(tensor.double(), mean, atol=1e-6, rtol=0)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _roles(n_client: int, n_aux: int) -> list[Role]:
    """Four roles: the nodes, then the auxiliary peers, then the clients (one of each kind
    first), so that the first peers listen and can be the others' bootstrap."""
    clients = [CLIENT_AVG, CLIENT_DHT][:n_client]
    return [NODE] * (4 - n_client - n_aux) + [AUX] * n_aux + clients


MIXES = [(c, a) for c in range(3) for a in range(3)]


@pytest.mark.parametrize(("n_client", "n_aux"), MIXES, ids=[f"{c}client-{a}aux" for c, a in MIXES])
async def test_every_mix_of_client_and_auxiliary_peers_averages_exactly(
    n_client: int, n_aux: int
) -> None:
    roles = _roles(n_client, n_aux)
    tensors = _random_tensors(4, seed=10 * n_client + n_aux)
    contributing = [i for i, role in enumerate(roles) if role.mode is not MemberMode.AUX]
    expected = _weighted_mean([tensors[i] for i in contributing], [1.0] * len(contributing))
    originals = [[t.clone() for t in own] for own in tensors]
    async with _peers(roles, tensors, prefix="modes", target_group_size=4) as averagers:
        results = await _step_all(averagers)
        peers = [a.dht.peer_id for a in averagers]
        for i, averager in enumerate(averagers):
            if i in contributing:
                _assert_holds(averager, expected)
    vector_bytes = _nbytes(originals[0])
    for role, result in zip(roles, results, strict=True):
        assert len(result) == 4
        assert set(result) == set(peers)
        assert result.group_size == 4
        assert result.group_id == results[0].group_id
        assert set(result.contributors) == {peers[i] for i in contributing}
        assert result.total_weight == pytest.approx(len(contributing))
        if role.mode is MemberMode.CLIENT:  # reduces nothing: sends the whole vector
            assert result.bytes_sent == vector_bytes
        elif role.mode is MemberMode.AUX:  # contributes nothing, answers its span's mean
            assert 0 < result.bytes_sent < vector_bytes * len(contributing)
        else:  # keeps its own span, answers its mean
            assert result.bytes_sent > 0
        # what a member sends is what it receives: its values (parts it does not reduce) go
        # out and their means come back; its span's contributions come in and its mean goes
        # back to each contributor
        assert result.bytes_sent == result.bytes_received


async def test_random_weights_with_two_client_mode_peers() -> None:
    rng = torch.Generator().manual_seed(7)
    weights = (torch.rand(4, generator=rng, dtype=torch.float64) * 3 + 0.1).tolist()
    roles = [NODE, NODE, CLIENT_AVG, CLIENT_DHT]
    tensors = _random_tensors(4, seed=7)
    expected = _weighted_mean(tensors, weights)
    async with _peers(roles, tensors, prefix="weighted", target_group_size=4) as averagers:
        results = await _step_all(averagers, weight=weights)
        for averager in averagers:
            _assert_holds(averager, expected)
        peers = [a.dht.peer_id for a in averagers]
    for result in results:
        assert set(result) == set(peers)
        assert set(result.contributors) == set(peers)
        assert result.total_weight == pytest.approx(sum(weights))


@pytest.mark.parametrize(
    "roles",
    [[NODE] * 4, [NODE, NODE, AUX, CLIENT_DHT], [AUX, AUX, CLIENT_AVG, CLIENT_DHT]],
    ids=["nodes", "node-aux-client", "aux-and-clients-only"],
)
async def test_every_member_gathers_every_members_metadata(roles: list[Role]) -> None:
    tensors = _random_tensors(4, seed=3)
    gathered = [
        {"rank": i, "role": role.name, "blob": bytes([i]) * 3, "nested": [i, {"x": i / 2}]}
        for i, role in enumerate(roles)
    ]
    async with _peers(roles, tensors, prefix="gather", target_group_size=4) as averagers:
        results = await _step_all(averagers, gather=gathered)
        peers = [a.dht.peer_id for a in averagers]
    everyone = dict(zip(peers, gathered, strict=True))
    for result in results:
        assert dict(result) == everyone
        assert [result[p] for p in peers] == gathered


@pytest.mark.parametrize("role", [NODE, CLIENT_AVG, CLIENT_DHT], ids=lambda r: r.name)
async def test_a_peer_of_weight_zero_takes_the_mean_of_the_others(role: Role) -> None:
    roles = [NODE, NODE, NODE, role]
    tensors = _random_tensors(4, seed=5)
    weights = [1.0, 2.0, 0.5, 0.0]
    expected = _weighted_mean(tensors[:3], weights[:3])
    async with _peers(roles, tensors, prefix="zero", target_group_size=4) as averagers:
        results = await _step_all(averagers, weight=weights)
        for averager in averagers:
            _assert_holds(averager, expected)
        peers = [a.dht.peer_id for a in averagers]
    for result in results:
        assert set(result) == set(peers)
        assert set(result.contributors) == set(peers[:3])
        assert result.total_weight == pytest.approx(3.5)
    if role is NODE:  # it sent none of its values, only its span's mean to the others
        assert 0 < results[3].bytes_sent < results[3].bytes_received
    else:  # a client reduces nothing
        assert results[3].bytes_sent == 0
