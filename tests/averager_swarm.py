"""Several averagers in one process on one MemoryNetwork: the helper the averager tests share
(importable from any test: pytest puts this folder, the root conftest's, on ``sys.path``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import torch

from swarmavg.aio import DHT
from swarmavg.aio.averager import DecentralizedAverager, StepResult
from swarmavg.testing import MemoryNetwork


@asynccontextmanager
async def averagers(
    tensors: Sequence[list[torch.Tensor]],
    *,
    dht_options: dict[str, Any] | None = None,
    **options: Any,
) -> AsyncIterator[list[DecentralizedAverager]]:
    """One DHT (with ``dht_options``) and one averager (with ``options``) per list of tensors;
    each DHT bootstraps from the two peers made before it."""
    network = MemoryNetwork()
    async with AsyncExitStack() as stack:
        dhts: list[DHT] = []
        made = []
        for i, own in enumerate(tensors):
            seeds = [a for d in dhts[max(0, i - 2) : i] for a in d.get_visible_maddrs()]
            dht = await stack.enter_async_context(
                DHT(
                    seeds,
                    transport="memory",
                    transport_options={"network": network},
                    **(dht_options or {}),
                )
            )
            dhts.append(dht)
            made.append(await stack.enter_async_context(DecentralizedAverager(own, dht, **options)))
        yield made


async def step_all(
    averagers: Sequence[DecentralizedAverager], *, within: float = 30, **kwargs: Any
) -> list[StepResult]:
    """Every averager's ``step(**kwargs)`` at once (a list value gives each its own item),
    all done within ``within`` seconds."""
    results: list[StepResult | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        extra = {k: v[i] if isinstance(v, list) else v for k, v in kwargs.items()}
        results[i] = await averagers[i].step(**extra)

    with anyio.fail_after(within):
        async with anyio.create_task_group() as tg:
            for i in range(len(averagers)):
                tg.start_soon(one, i)
    return results  # type: ignore[return-value]
