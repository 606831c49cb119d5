"""CUDA tensors: averaged through host buffers, written back in place on their device.

Skipped where torch sees no CUDA device (CI here has none); run on a machine with a GPU:
``python -m pytest tests/gpu``. Several real peers, as elsewhere: MemoryTransport in one
process for the async averager, TCP on loopback for the sync facade.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import anyio
import pytest
import torch
from averager_swarm import averagers as _averagers
from averager_swarm import step_all

import swarmavg
from swarmavg.aio.averager import DecentralizedAverager, StepResult
from swarmavg.compression import Uniform8BitQuantization

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

CUDA = torch.device("cuda")

#: how close a mean rounded to each dtype must be to the exact one (float64)
TOLERANCE = {
    torch.float64: dict(atol=1e-12, rtol=0.0),
    torch.float32: dict(atol=1e-5, rtol=1e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}


async def _step_all(
    averagers: Sequence[DecentralizedAverager], weights: Sequence[float] | None = None
) -> list[StepResult]:
    weight = None if weights is None else list(weights)
    return await step_all(averagers, within=60, weight=weight, timeout=30)


def _mean(tensors: Sequence[list[torch.Tensor]], k: int, weights: Sequence[float]) -> torch.Tensor:
    total = sum(w * own[k].detach().double().cpu() for own, w in zip(tensors, weights, strict=True))
    return total / sum(weights)  # type: ignore[operator]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(
        got.detach().double().cpu(),
        want,
        **TOLERANCE[got.dtype],  # type: ignore[arg-type]
    )


def _cuda_set(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return [
        randn(64, 33).to(CUDA),  # float32
        randn(17, dtype=torch.float16).to(CUDA),
        randn(5, 4, dtype=torch.bfloat16).to(CUDA),
        randn(3, dtype=torch.float64).to(CUDA),
        randn(40, 6).to(CUDA).t(),  # not contiguous
        randn(6),  # a CPU tensor beside them
    ]


async def test_cuda_tensors_are_averaged_in_place_on_their_device() -> None:
    tensors = [_cuda_set(seed) for seed in range(4)]
    weights = [1.0, 2.0, 0.5, 1.5]
    originals = [[t.clone() for t in own] for own in tensors]
    expected = [_mean(originals, k, weights) for k in range(len(tensors[0]))]
    pointers = [[t.data_ptr() for t in own] for own in tensors]
    async with _averagers(tensors, prefix="cuda", target_group_size=4) as averagers:
        results = await _step_all(averagers, weights)
        assert all(r.group_size == 4 and len(r.contributors) == 4 for r in results)
        for averager, own_pointers, own_originals in zip(
            averagers, pointers, originals, strict=True
        ):
            with averager.get_tensors() as values:
                for value, pointer, original, want in zip(
                    values, own_pointers, own_originals, expected, strict=True
                ):
                    assert value.device == original.device
                    assert value.dtype == original.dtype
                    assert value.data_ptr() == pointer  # written into, not replaced
                    _close(value, want)
    torch.cuda.synchronize()


async def test_cuda_peers_and_cpu_peers_average_together() -> None:
    generator = torch.Generator().manual_seed(7)
    host = [[torch.randn(300, generator=generator), torch.randn(9, generator=generator).half()]]
    host += [[t.clone() + i for t in host[0]] for i in range(1, 4)]
    tensors = [
        [t.to(CUDA) for t in own] if i % 2 else [t.clone() for t in own]
        for i, own in enumerate(host)
    ]
    expected = [_mean(host, k, [1.0] * 4) for k in range(2)]
    async with _averagers(tensors, prefix="mixed", target_group_size=4) as averagers:
        results = await _step_all(averagers)
        assert all(r.group_size == 4 for r in results)
        for i, averager in enumerate(averagers):
            with averager.get_tensors() as values:
                for value, want in zip(values, expected, strict=True):
                    assert value.device.type == ("cuda" if i % 2 else "cpu")
                    _close(value, want)


async def test_a_cuda_parameter_averaged_is_seen_changed_by_autograd() -> None:
    generator = torch.Generator().manual_seed(3)
    params = [
        [torch.nn.Parameter(torch.randn(8, 5, generator=generator).to(CUDA))] for _ in range(2)
    ]
    expected = _mean(params, 0, [1.0, 1.0])
    pending = (params[0][0] ** 2).sum()  # saves params[0][0] for its backward
    versions = [own[0]._version for own in params]
    async with _averagers(params, prefix="autograd", target_group_size=2) as averagers:
        await _step_all(averagers)
    for own, version in zip(params, versions, strict=True):
        assert own[0].requires_grad
        assert own[0].is_cuda
        assert own[0]._version > version
        _close(own[0], expected)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


async def test_compressed_rounds_with_error_feedback_on_cuda_end_identical() -> None:
    generator = torch.Generator().manual_seed(5)
    tensors = [[torch.randn(5000, generator=generator).to(CUDA)] for _ in range(3)]
    expected = _mean(tensors, 0, [1.0] * 3)
    async with _averagers(
        tensors,
        prefix="compressed",
        target_group_size=3,
        compression=Uniform8BitQuantization(),
        error_feedback=True,
    ) as averagers:
        for _ in range(2):  # the second round adds the first's compression error back
            await _step_all(averagers)
        own = []
        for averager in averagers:
            with averager.get_tensors() as values:
                assert values[0].is_cuda
                own.append(values[0].clone())
    for got in own[1:]:
        assert torch.equal(got, own[0])
    assert (own[0].double().cpu() - expected).abs().max() < 0.1


async def test_the_state_of_cuda_tensors_is_shared() -> None:
    generator = torch.Generator().manual_seed(9)
    own = [torch.randn(1000, generator=generator).to(CUDA), torch.randn(4, 4).half().to(CUDA)]
    host = [torch.zeros(1000), torch.zeros(4, 4).half()]
    async with _averagers(
        [own, host], prefix="state", target_group_size=2, allow_state_sharing=True
    ) as (_, taker):
        loaded = None
        with anyio.fail_after(30):
            while loaded is None:  # (until the donor's declaration is in the DHT)
                loaded = await taker.load_state_from_peers(timeout=10)
                if loaded is None:
                    await anyio.sleep(0.05)
        _, tensors = loaded
        assert [t.device.type for t in tensors] == ["cpu", "cpu"]
        for got, want in zip(tensors, own, strict=True):
            assert got.dtype == want.dtype
            assert torch.equal(got, want.cpu())


def test_the_sync_facade_averages_cuda_tensors_over_tcp() -> None:
    generator = torch.Generator().manual_seed(11)
    host = [[torch.randn(2000, generator=generator)] for _ in range(3)]
    tensors = [[t.to(CUDA) for t in own] for own in host]
    expected = _mean(host, 0, [1.0] * 3)
    with ExitStack() as stack:
        first = stack.enter_context(swarmavg.DHT())
        dhts = [first] + [
            stack.enter_context(swarmavg.DHT(first.get_visible_maddrs())) for _ in range(2)
        ]
        averagers = [
            stack.enter_context(
                swarmavg.DecentralizedAverager(own, dht, prefix="sync", target_group_size=3)
            )
            for own, dht in zip(tensors, dhts, strict=True)
        ]
        handles = [a.step(wait=False, timeout=30) for a in averagers]
        results = [h.result(timeout=60) for h in handles]
        assert all(r.group_size == 3 for r in results)
        for averager in averagers:
            with averager.get_tensors() as values:
                assert values[0].is_cuda
                _close(values[0], expected)
