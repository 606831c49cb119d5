"""State sharing: ``load_state_from_peers`` / ``get_current_state`` / ``allow_state_sharing``
with several peers (MemoryTransport), real donors and fake ones that misbehave."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from swarmavg import get_dht_time
from swarmavg.aio import DHT
from swarmavg.aio.averager import DecentralizedAverager
from swarmavg.aio.rpc import CallContext
from swarmavg.aio.state import (
    METHOD,
    StateDownloadFailed,
    StateLoad,
    download_state,
)
from swarmavg.identity import PeerID
from swarmavg.proto.codec import Message
from swarmavg.proto.state_messages import StateChunk, StateHeader, StateRequest
from swarmavg.testing import MemoryNetwork

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PREFIX = "state"


class _Swarm:
    """DHTs on one memory network; averagers made on demand."""

    def __init__(self, stack: AsyncExitStack) -> None:
        self.stack = stack
        self.network = MemoryNetwork()
        self.dhts: list[DHT] = []

    async def dht(self) -> DHT:
        seeds = [a for d in self.dhts[:2] for a in d.get_visible_maddrs()]
        dht = await self.stack.enter_async_context(
            DHT(seeds, transport="memory", transport_options={"network": self.network})
        )
        self.dhts.append(dht)
        return dht

    async def averager(
        self,
        tensors: Sequence[torch.Tensor],
        cls: type[DecentralizedAverager] = DecentralizedAverager,
        dht: DHT | None = None,
        **options: Any,
    ) -> DecentralizedAverager:
        options.setdefault("prefix", PREFIX)
        options.setdefault("target_group_size", 2)
        dht = dht or await self.dht()
        return await self.stack.enter_async_context(cls(tensors, dht, **options))


@asynccontextmanager
async def _swarm() -> AsyncIterator[_Swarm]:
    async with AsyncExitStack() as stack:
        yield _Swarm(stack)


async def _declared(dht: DHT, prefix: str = PREFIX) -> dict[PeerID, Any]:
    found = await dht.get(f"{prefix}.state", latest=True)
    if not isinstance(found, dict):
        return {}
    return {PeerID(k): v.value for k, v in found.items()}


async def _wait_until(check: Callable[[dict[PeerID, Any]], bool], dht: DHT) -> None:
    """Wait (bounded) until the declarations as ``dht`` reads them pass ``check``."""
    with anyio.fail_after(10):
        while not check(await _declared(dht)):  # noqa: ASYNC110 (polling the DHT)
            await anyio.sleep(0.02)


def _sharing(
    *averagers: DecentralizedAverager, priority: float | None = None
) -> Callable[..., bool]:
    peers = [a.dht.peer_id for a in averagers]

    def check(declared: dict[PeerID, Any]) -> bool:
        return all(
            isinstance(declared.get(p), dict)
            and (priority is None or declared[p]["priority"] == priority)
            for p in peers
        )

    return check


class MetadataDonor(DecentralizedAverager):
    """Shares its own metadata and tensors of many dtypes, in small chunks."""

    STATE: tuple[Any, list[torch.Tensor]] = (
        {"epoch": 7, "name": "ü", "blob": b"\x00\xff", "lr": [0.1, 0.01]},
        [
            torch.randn(33, 17),
            torch.randn(5, dtype=torch.float64),
            torch.randn(8).half(),
            torch.randn(4, 3).bfloat16(),
            torch.arange(10, dtype=torch.int64) - 5,
            torch.tensor([True, False, True]),
            torch.tensor(3.5),  # 0-d
            torch.empty(0, 4),  # empty
            torch.randn(6, dtype=torch.complex64),
            torch.randn(7, 3).t(),  # not contiguous
        ],
    )

    async def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        return self.STATE


def _assert_state_equal(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.device.type == "cpu"
        assert torch.equal(a, b)


async def test_metadata_and_tensors_of_many_dtypes_from_a_subclass_donor() -> None:
    async with _swarm() as swarm:
        donor = await swarm.averager([torch.zeros(3)], MetadataDonor, allow_state_sharing=True)
        donor._state_sharer.chunk_size = 100  # chunks cross tensors' boundaries
        taker = await swarm.averager([torch.zeros(3)])
        await _wait_until(_sharing(donor), taker.dht)
        loaded = await taker.load_state_from_peers(timeout=20)
        assert loaded is not None
        metadata, tensors = loaded
        assert metadata == MetadataDonor.STATE[0]
        _assert_state_equal(tensors, MetadataDonor.STATE[1])
        with taker.get_tensors() as own:  # the averaged tensors are left alone
            assert torch.equal(own[0], torch.zeros(3))


async def test_default_state_is_a_copy_of_the_averaged_tensors() -> None:
    own = [torch.randn(1000), torch.randn(3, 3, dtype=torch.float64), torch.randn(5).half()]
    async with _swarm() as swarm:
        donor = await swarm.averager(own, allow_state_sharing=True)
        metadata, tensors = await donor.get_current_state()
        assert metadata is None
        _assert_state_equal(tensors, own)
        assert all(t.data_ptr() != o.data_ptr() for t, o in zip(tensors, own, strict=True))
        taker = await swarm.averager([torch.zeros(1000), torch.zeros(3, 3), torch.zeros(5)])
        await _wait_until(_sharing(donor), taker.dht)
        loaded = await taker.load_state_from_peers(timeout=20)
        assert loaded is not None
        assert loaded[0] is None
        _assert_state_equal(loaded[1], own)
        # wait=False: a handle to await
        load = await taker.load_state_from_peers(wait=False, timeout=20)
        assert isinstance(load, StateLoad)
        again = await load
        assert again is not None
        assert load.done()
        assert not load.cancel()
        _assert_state_equal(again[1], own)


async def test_the_donor_with_the_highest_priority_is_used() -> None:
    async with _swarm() as swarm:
        low = await swarm.averager(
            [torch.full((4,), 1.0)], allow_state_sharing=True, state_sharing_priority=1
        )
        high = await swarm.averager(
            [torch.full((4,), 2.0)], allow_state_sharing=True, state_sharing_priority=5.5
        )
        taker = await swarm.averager([torch.zeros(4)])
        await _wait_until(_sharing(low, high), taker.dht)
        for _ in range(3):
            loaded = await taker.load_state_from_peers(timeout=20)
            assert loaded is not None
            assert torch.equal(loaded[1][0], torch.full((4,), 2.0))
        low.state_sharing_priority = 10  # declared again at once
        assert low.state_sharing_priority == 10.0
        await _wait_until(_sharing(low, priority=10.0), taker.dht)
        loaded = await taker.load_state_from_peers(timeout=20)
        assert loaded is not None
        assert torch.equal(loaded[1][0], torch.full((4,), 1.0))
        # a peer never loads from itself
        loaded = await low.load_state_from_peers(timeout=20)
        assert loaded is not None
        assert torch.equal(loaded[1][0], torch.full((4,), 2.0))
        with pytest.raises(ValueError, match="finite"):
            low.state_sharing_priority = float("nan")


async def test_sharing_is_on_by_default_unless_client_or_auxiliary() -> None:
    async with _swarm() as swarm:
        assert (await swarm.averager([torch.ones(2)])).allow_state_sharing
        assert not (await swarm.averager([torch.ones(2)], auxiliary=True)).allow_state_sharing
        client = await swarm.averager([torch.ones(2)], client_mode=True)
        assert not client.allow_state_sharing


async def test_sharing_disabled_is_honoured() -> None:
    async with _swarm() as swarm:
        quiet = await swarm.averager([torch.ones(2)], allow_state_sharing=False)
        taker = await swarm.averager([torch.zeros(2)], allow_state_sharing=False)
        assert not quiet.allow_state_sharing
        started = anyio.current_time()
        assert await taker.load_state_from_peers(timeout=20) is None
        assert anyio.current_time() - started < 5
        # even asked directly, it refuses
        address = quiet.dht.visible_addresses()[0]
        with pytest.raises(Exception, match="does not share"):
            await download_state(taker.dht.node, address, PREFIX, chunk_timeout=5)
        # turned on, then off at run time: the declaration is withdrawn
        quiet.allow_state_sharing = True
        await _wait_until(_sharing(quiet), taker.dht)
        assert await taker.load_state_from_peers(timeout=20) is not None
        quiet.allow_state_sharing = False
        await _wait_until(lambda d: d.get(quiet.dht.peer_id) is None, taker.dht)
        assert await taker.load_state_from_peers(timeout=20) is None


async def test_closing_withdraws_and_client_mode_cannot_share() -> None:
    async with _swarm() as swarm:
        donor = await swarm.averager([torch.ones(2)], allow_state_sharing=True)
        taker = await swarm.averager([torch.zeros(2)])
        await _wait_until(_sharing(donor), taker.dht)
        await donor.aclose()
        assert donor._state_sharer._scope is not None
        assert donor._state_sharer._scope.cancel_called
        await _wait_until(lambda d: d.get(donor.dht.peer_id) is None, taker.dht)
        assert await taker.load_state_from_peers(timeout=20) is None
        with pytest.raises(RuntimeError, match="closed"):
            await donor.load_state_from_peers()
        with pytest.raises(ValueError, match="client-mode"):
            await swarm.averager([torch.ones(2)], client_mode=True, allow_state_sharing=True)
        client = await swarm.averager([torch.ones(2)], client_mode=True, prefix="other")
        with pytest.raises(ValueError, match="client-mode"):
            client.allow_state_sharing = True


class BrokenDonor(DecentralizedAverager):
    async def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        raise RuntimeError("no state here")


async def test_a_failing_donor_is_replaced_by_the_next() -> None:
    async with _swarm() as swarm:
        good = await swarm.averager(
            [torch.full((3,), 7.0)], allow_state_sharing=True, state_sharing_priority=0
        )
        broken = await swarm.averager(
            [torch.zeros(3)], BrokenDonor, allow_state_sharing=True, state_sharing_priority=9
        )
        taker = await swarm.averager([torch.zeros(3)])
        await _wait_until(_sharing(good, broken), taker.dht)
        loaded = await taker.load_state_from_peers(timeout=20)
        assert loaded is not None
        assert torch.equal(loaded[1][0], torch.full((3,), 7.0))


# -- fake donors ----------------------------------------------------------------------------------

Handler = Callable[[StateRequest, CallContext], AsyncIterator[Message]]


async def _fake_donor(dht: DHT, handler: Handler, priority: float) -> DHT:
    """A peer that declares itself a donor and answers ``avg.state`` with ``handler``."""
    dht.node.rpc.register(METHOD, handler, kind="server_stream", request_type=StateRequest)
    value = {"priority": priority, "address": str(dht.visible_addresses()[0])}
    assert await dht.store(
        f"{PREFIX}.state", value, get_dht_time() + 60, subkey=dht.peer_id.to_bytes()
    )
    return dht


def _garbage(kind: str, own: list[DHT] | None = None) -> Handler:
    data = np.arange(64, dtype=np.uint8)
    checksum = hashlib.sha256(data.tobytes()).digest()

    async def serve(request: StateRequest, ctx: CallContext) -> AsyncIterator[Message]:
        header = StateHeader(b"\xc0", ["uint8"], [[64]], 64, checksum)
        if kind == "checksum":
            yield StateHeader(b"\xc0", ["uint8"], [[64]], 64, bytes(32))
        elif kind == "too_large":
            yield StateHeader(b"\xc0", ["float32"], [[1 << 40]], 4 << 40, checksum)
        elif kind == "total":
            yield StateHeader(b"\xc0", ["uint8"], [[64]], 65, checksum)
        elif kind == "dtype":
            yield StateHeader(b"\xc0", ["object"], [[64]], 64, checksum)
        elif kind == "metadata":
            yield StateHeader(b"\xc1", ["uint8"], [[64]], 64, checksum)
        elif kind == "bool":
            yield StateHeader(b"\xc0", ["bool"], [[64]], 64, checksum)
        elif kind == "no_header":
            yield StateChunk(0, data)
        else:
            yield header
        if kind == "offset":
            yield StateChunk(1, data[1:])
        elif kind == "extra":
            yield StateChunk(0, data)
            yield StateChunk(64, data[:1])
        elif kind == "stall":
            yield StateChunk(0, data[:10])
            await anyio.sleep(30)
        elif kind == "dies":
            yield StateChunk(0, data[:10])
            assert own is not None
            await own[0].node.aclose()  # the donor's node goes away mid-stream
            await anyio.sleep(30)
        elif kind == "short":
            yield StateChunk(0, data[:10])
        else:
            yield StateChunk(0, data)

    return serve


GARBAGE = [
    ("checksum", "checksum"),
    ("too_large", "over the limit"),
    ("total", "announces 65 bytes"),
    ("dtype", "unsupported dtype"),
    ("metadata", "metadata does not decode"),
    ("no_header", "begin with a header"),
    ("offset", "chunk at byte 0"),
    ("extra", "more than it announced"),
    ("short", "chunk at byte 10"),
    ("bool", "bool tensor holds bytes"),
]


@pytest.mark.parametrize(("kind", "reason"), GARBAGE, ids=[k for k, _ in GARBAGE])
async def test_garbage_is_refused_before_allocating(kind: str, reason: str) -> None:
    async with _swarm() as swarm:
        fake = await _fake_donor(await swarm.dht(), _garbage(kind), priority=1)
        taker = await swarm.dht()
        address = fake.visible_addresses()[0].with_peer_id(fake.peer_id)
        with pytest.raises(StateDownloadFailed, match=reason):
            await download_state(taker.node, address, PREFIX, chunk_timeout=5)


async def test_a_good_fake_donor_works() -> None:
    async with _swarm() as swarm:
        fake = await _fake_donor(await swarm.dht(), _garbage("none"), priority=1)
        taker = await swarm.dht()
        address = fake.visible_addresses()[0].with_peer_id(fake.peer_id)
        metadata, tensors = await download_state(taker.node, address, PREFIX, chunk_timeout=5)
        assert metadata is None
        assert torch.equal(tensors[0], torch.arange(64, dtype=torch.uint8))
        with pytest.raises(StateDownloadFailed, match="over the limit"):
            await download_state(taker.node, address, PREFIX, chunk_timeout=5, max_bytes=63)


async def test_bad_donors_are_skipped_for_the_next_one() -> None:
    kinds = ["checksum", "too_large", "offset", "stall", "dies", "extra"]
    async with _swarm() as swarm:
        # every peer joins first: a record stored before the nearest peers joined is not on them
        dhts = [await swarm.dht() for _ in range(len(kinds) + 2)]
        await swarm.averager(
            [torch.full((5,), 3.0)],
            dht=dhts[0],
            allow_state_sharing=True,
            state_sharing_priority=-1,
        )
        for priority, kind in enumerate(kinds):
            fake = dhts[priority + 1]
            await _fake_donor(fake, _garbage(kind, [fake]), priority=priority)
        taker = await swarm.averager([torch.zeros(5)], dht=dhts[-1], next_chunk_timeout=0.5)
        await _wait_until(lambda d: len(d) == len(kinds) + 1, taker.dht)
        started = anyio.current_time()
        loaded = await taker.load_state_from_peers(timeout=30)
        assert loaded is not None
        assert torch.equal(loaded[1][0], torch.full((5,), 3.0))
        assert anyio.current_time() - started < 10  # the stalled donor cost ~0.5 s
