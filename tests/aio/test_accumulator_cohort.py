"""The accumulator's anyio shell: cohorts of peers in one process on a MemoryNetwork."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from swarmavg.aio import DHT
from swarmavg.aio.accumulator import Accumulator
from swarmavg.testing import MemoryNetwork

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


@asynccontextmanager
async def cohort(
    n: int, **options: Any
) -> AsyncIterator[list[tuple[Accumulator, torch.nn.Module]]]:
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        dhts: list[DHT] = []
        made = []
        for i in range(n):
            seeds = [a for d in dhts[-2:] for a in d.get_visible_maddrs()]
            dht = await stack.enter_async_context(
                DHT(seeds, transport="memory", transport_options={"network": network})
            )
            dhts.append(dht)
            net = model(i)
            acc = Accumulator("c", list(net.parameters()), list(net.buffers()), dht=dht, **options)
            made.append((await stack.enter_async_context(acc), net))
        yield made


async def serve_states(accs: list[Accumulator], state: object) -> None:
    """Answer wants_state() until every member is connected."""

    async def serve(acc: Accumulator) -> None:
        while True:
            await acc.wait_state_request()
            acc.set_state(state)

    async with anyio.create_task_group() as tg:
        for acc in accs:
            tg.start_soon(serve, acc)
        while not all(acc.connected() for acc in accs):  # (bounded by the caller)
            for acc in accs:
                await acc.wait_state()
        tg.cancel_scope.cancel()


async def test_three_peers_connect_and_apply_the_mean_of_their_contributions() -> None:
    async with cohort(3) as made:
        accs = [a for a, _ in made]
        with anyio.fail_after(30):
            await serve_states(accs, {"step": 1, "opt": (torch.ones(2),)})
        # (one leader for all: the member that held the model first, on equal versions)
        (leader,) = {a.get_leader() for a in accs}
        (lead_net,) = [n for a, n in made if str(a.dht.peer_id) == leader]
        for _, net in made:
            for mine, theirs in zip(
                net.state_dict().values(), lead_net.state_dict().values(), strict=True
            ):
                assert torch.equal(mine, theirs)
        joiners = [a for a in accs if not a.is_leader()]
        for a in joiners:
            assert a.has_new_state()
            state: Any = a.state()
            assert state["step"] == 1
            assert torch.equal(state["opt"][0], torch.ones(2))
        grads = []
        for i, (_acc, net) in enumerate(made):
            for p in net.parameters():
                p.grad = torch.full_like(p, float(i + 1))
            grads.append(i + 1)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i, (acc, _) in enumerate(made):
                    tg.start_soon(acc.reduce_gradients, 4 + i)
        for acc, net in made:
            assert acc.has_gradients()
            assert acc.get_gradient_stats() == {
                "num_gradients": 3,
                "num_skipped": 0,
                "batch_size": 15,
            }
            assert acc.model_version() == 0  # (until the result is read)
            for p in net.parameters():
                assert p.grad is not None
                assert torch.equal(p.grad, torch.full_like(p, 2.0))
            acc.zero_gradients()
            assert acc.model_version() == 1
            assert acc.wants_gradients()
        with pytest.raises(RuntimeError, match="wants_gradients"):
            await _misuse(made[0][0])


async def _misuse(acc: Accumulator) -> None:
    """reduce_gradients while a result is unread (wants_gradients() is false)."""
    for p in acc.parameters:
        p.grad = torch.ones_like(p)
    acc.core._has_gradients = True  # (as after a result, before zero_gradients())
    try:
        await acc.reduce_gradients(1)
    finally:
        acc.core._has_gradients = False
