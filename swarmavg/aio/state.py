"""State sharing: a peer that joins late downloads the state of peers that have been averaging.

A peer that shares (``allow_state_sharing``) declares itself in the DHT under ``<prefix>.state``
(a dictionary: subkey its ``owner_marker``, so the record is signed and nobody else can
change it; other subkeys are ignored; value ``{"priority": float, "address": str}``), again every
half ``declare_state_period`` with an expiration one period ahead, and withdraws (value
``None``, expiring 1 ms after the declaration it replaces) when it stops. It serves ``avg.state``
(a server-stream call, messages and checks in :mod:`swarmavg.proto.state_messages`).

**Snapshots.** A donor serves snapshots of its state
(:meth:`~swarmavg.aio.DecentralizedAverager.get_current_state`: by default copies of the averaged
tensors, taken under their lock), encoded (``state_compression``) and hashed in a worker thread:
the transfer reads only the snapshot, so the donor's own averaging goes on. A snapshot is
shared by the calls that ask within :data:`_SNAPSHOT_REUSE` seconds of it while the sharer's
priority is unchanged (a training peer's priority is its epoch: a new epoch is a new state),
kept while calls read it and :data:`_SNAPSHOT_IDLE` seconds after the last one (so that a
taker can fetch its ranges over several calls), and at most :data:`_MAX_SNAPSHOTS` are held
(past that, a new snapshot replaces the oldest that no call reads; new calls share the newest
only while every one held is being read).

**Downloading.** A taker reads the key and ranks the donors by priority (highest first, ties
at random, never itself). It *probes* the best ``max_donors`` at once (a header, no bytes),
takes the state of the best-ranked one that answers, and combines it with every probed donor
whose snapshot is identical (same snapshot digest): they fetch disjoint ranges of whole blocks
from a shared queue, each donor one range at a time, so a faster donor serves more. Every block
is checked against its SHA-256 in the header (whose digests the header's checksum covers) as
it arrives: a donor that fails, sends garbage or a bad block, or stalls (no chunk within
``next_chunk_timeout``) is dropped and its unverified ranges go back to the queue for the
others. When every donor of the group is gone, the next donors are probed (keeping what was
downloaded if their snapshot is the same).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import random
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
import msgpack
import numpy as np
import numpy.typing as npt

from swarmavg._time import get_dht_time
from swarmavg.address import Address
from swarmavg.compression import (
    AdaptiveCompression,
    CompressedTensor,
    CompressionBase,
    NoCompression,
    TensorInfo,
    decompress,
)
from swarmavg.errors import SwarmError
from swarmavg.identity import PeerID
from swarmavg.proto.codec import Message
from swarmavg.proto.dht_validation import owner_marker, owner_of
from swarmavg.proto.state_messages import (
    CODED_DTYPES,
    DTYPE_SIZES,
    MAX_BLOCKS,
    MAX_SNAPSHOT_ID,
    Segment,
    StateChunk,
    StateDownloadFailed,
    StateHeader,
    StateLayout,
    StateRequest,
    block_digests,
    check_header,
    check_range,
    snapshot_id,
    split_ranges,
)

if TYPE_CHECKING:
    import torch

    from swarmavg.aio.dht import GetResult
    from swarmavg.aio.dht_facade import DHT
    from swarmavg.aio.node import BackgroundTask, Node
    from swarmavg.aio.rpc import CallContext

__all__ = [
    "BLOCK_SIZE",
    "CHUNK_SIZE",
    "DEFAULT_MAX_DONORS",
    "DEFAULT_MAX_STATE_SIZE",
    "DTYPE_SIZES",
    "METHOD",
    "Donor",
    "StateDownloadFailed",
    "StateLoad",
    "StateSharer",
    "download_state",
    "load_state",
    "load_state_from",
]

logger = logging.getLogger(__name__)

METHOD: Final = "avg.state"
#: The most bytes one chunk carries.
CHUNK_SIZE: Final = 4 << 20
#: Bytes per verified block (more for states over ``MAX_BLOCKS`` of them).
BLOCK_SIZE: Final = 4 << 20
#: Blocks per range a taker asks of one donor in one call.
RANGE_BLOCKS: Final = 4
#: Donors a taker downloads from at once, by default.
DEFAULT_MAX_DONORS: Final = 2
#: The largest state a taker accepts by default (bytes of tensors).
DEFAULT_MAX_STATE_SIZE: Final = 16 << 30
#: How long a taker waits for the header (the donor snapshots and hashes first), at least.
HEADER_WAIT: Final = 30.0
#: How long a load waits for the DHT's answer when it has no timeout of its own.
_DHT_WAIT: Final = 60.0
#: Donors tried at most per load (the best-ranked).
_MAX_DONORS: Final = 32
_MAX_ADDRESS_LENGTH: Final = 512
#: Calls one averager serves at once; more wait (at most ``_UPLOAD_WAIT`` s), then fail.
_MAX_UPLOADS: Final = 8
_UPLOAD_WAIT: Final = 10.0
#: Snapshots a donor holds at most; a new call shares one taken this recently.
_MAX_SNAPSHOTS: Final = 2
_SNAPSHOT_REUSE: Final = 2.0
#: A snapshot no call read for this long is dropped.
_SNAPSHOT_IDLE: Final = 20.0
#: Blocks up to this size are verified on the event loop (larger ones in a worker thread).
_INLINE_HASH: Final = 1 << 16
#: A withdrawal expires this long after the declaration it replaces (the newer one wins).
_WITHDRAWN: Final = 0.001
#: What a failing donor may raise (it is then dropped).
_DONOR_ERRORS: Final = (SwarmError, OSError, TimeoutError, ValueError, TypeError, MemoryError)

StateProvider = Callable[[], Awaitable[tuple[Any, ...]]]
Compression = CompressionBase | AdaptiveCompression
State = tuple[Any, list["torch.Tensor"]]


# -- serving --------------------------------------------------------------------------------------

_registries: weakref.WeakKeyDictionary[Node, dict[str, StateSharer]] = weakref.WeakKeyDictionary()


def _registry(node: Node) -> dict[str, StateSharer]:
    """The node's sharers by prefix; registers ``avg.state`` on first use."""
    registry = _registries.get(node)
    if registry is None:
        registry = _registries[node] = {}
        node.rpc.register(
            METHOD, _serve_state(registry), kind="server_stream", request_type=StateRequest
        )
    return registry


def _serve_state(registry: dict[str, StateSharer]) -> Any:
    """The node's ``avg.state`` handler: hands each request to the sharer of its prefix."""

    async def serve(request: StateRequest, ctx: CallContext) -> AsyncIterator[Message]:
        sharer = registry.get(request.prefix)
        if sharer is None or not sharer.enabled:
            raise ValueError("this peer does not share its state under that prefix")
        async for answer in sharer._serve(request, ctx):
            yield answer

    return serve


@dataclass(eq=False)
class _Snapshot:
    header: StateHeader
    parts: list[npt.NDArray[np.uint8]]  # the payload, in order (no empty part)
    keep: list[object]  # (what the parts look into)
    created: float = 0.0
    last_used: float = 0.0
    active: int = 0  # calls reading it
    #: the sharer's priority when it was taken (a training peer's epoch: a new one means a
    #: new state, so the snapshot is not shared with later calls)
    priority: float = 0.0

    @property
    def id(self) -> bytes:
        return self.header.snapshot

    def pieces(self, start: int, stop: int, chunk_size: int) -> Generator[StateChunk]:
        """The payload ``[start, stop)`` as chunks of at most ``chunk_size`` bytes."""
        offset = 0
        for part in self.parts:
            end = offset + part.size
            lo, hi = max(start, offset), min(stop, end)
            for at in range(lo, hi, chunk_size):
                yield StateChunk(at, part[at - offset : min(at + chunk_size, hi) - offset])
            offset = end


def _unpack_state(state: object) -> tuple[Any, Sequence[torch.Tensor], Sequence[TensorInfo] | None]:
    """``(metadata, tensors)`` or ``(metadata, tensors, infos)`` from ``get_current_state()``."""
    if not isinstance(state, tuple) or len(state) not in (2, 3):
        raise TypeError(
            "get_current_state() must return (metadata, tensors) or (metadata, tensors, infos)"
        )
    metadata, tensors = state[0], state[1]
    infos = state[2] if len(state) == 3 else None
    if isinstance(tensors, str | bytes) or not isinstance(tensors, Sequence):
        raise TypeError("get_current_state() must return (metadata, a sequence of tensors, ...)")
    if infos is not None and (
        not isinstance(infos, Sequence)
        or len(infos) != len(tensors)
        or not all(isinstance(i, TensorInfo) for i in infos)
    ):
        raise TypeError("get_current_state()'s infos must be one TensorInfo per tensor")
    return metadata, tensors, infos


def _take_snapshot(
    metadata: bytes,
    tensors: Sequence[torch.Tensor],
    infos: Sequence[TensorInfo] | None,
    compression: Compression,
    block_size: int,
) -> _Snapshot:
    """The tensors' payload (on the host, contiguous; encoded where ``compression`` makes a
    tensor smaller) and its digests. Runs in a worker thread (hashing gigabytes takes
    seconds)."""
    import torch

    dtypes: list[str] = []
    shapes: list[list[int]] = []
    encodings: list[tuple[str, int, int, int, int]] = []
    parts: list[npt.NDArray[np.uint8]] = []
    keep: list[object] = []
    coding = not isinstance(compression, NoCompression)
    with torch.no_grad():
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"get_current_state() returned a {type(tensor).__name__}")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPE_SIZES:
                raise TypeError(f"a tensor of {tensor.dtype} cannot be shared")
            host = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            raw = host.reshape(-1).view(torch.uint8).numpy()
            dtypes.append(dtype)
            shapes.append(list(host.shape))
            encoded = None
            if coding and dtype in CODED_DTYPES and raw.size:
                encoded = _encode(host.numpy(), compression, infos[i] if infos else None)
            if encoded is not None and encoded.nbytes < raw.size:
                pieces = [
                    np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                    for a in (encoded.data, encoded.scales, encoded.codebook)
                ]
                data, scales, codebook = (p.size for p in pieces)
                encodings.append((encoded.codec, encoded.block_size, data, scales, codebook))
                parts += [p for p in pieces if p.size]
                keep.append(encoded)
            else:
                encodings.append(("", 0, raw.size, 0, 0))
                if raw.size:
                    parts.append(raw)
                keep.append(host)
    total = sum(p.size for p in parts)
    block = max(block_size, -(-total // MAX_BLOCKS))
    digests = b"".join(block_digests([p.data for p in parts], block))
    coded = any(codec for codec, *_ in encodings)
    header = StateHeader(
        metadata,
        dtypes,
        shapes,
        total,
        hashlib.sha256(digests).digest(),
        b"",
        block,
        digests,
        tuple(encodings) if coded else (),
    )
    header = dataclasses.replace(header, snapshot=snapshot_id(header))
    return _Snapshot(header, parts, keep)


def _encode(
    array: npt.NDArray[Any], compression: Compression, info: TensorInfo | None
) -> CompressedTensor | None:
    """``array`` compressed, or ``None`` where the codec cannot (NaN, inf, out of range)."""
    try:
        if isinstance(compression, AdaptiveCompression):
            return compression.compress(array, info)
        return compression.compress(array)
    except (ValueError, TypeError) as exc:
        logger.debug("a tensor of the state is sent uncompressed: %s", exc)
        return None


class StateSharer:
    """One averager's state sharing: the declaration in the DHT and serving ``avg.state``.

    Driven by the averager on the event-loop thread: :meth:`start` (entering it), the
    :attr:`enabled` and :attr:`priority` setters, :meth:`stop` (closing it).
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        provider: StateProvider,
        *,
        enabled: bool,
        priority: float,
        declare_period: float,
        compression: Compression | None = None,
    ) -> None:
        self.dht = dht
        self.prefix = prefix
        self.key = f"{prefix}.state"
        self.provider = provider
        self.declare_period = declare_period
        self.compression: Compression = compression or NoCompression()
        self.chunk_size = CHUNK_SIZE
        self.block_size = BLOCK_SIZE
        #: payload bytes sent to takers so far
        self.bytes_served = 0
        #: calls (one range of a snapshot each) answered to the end so far
        self.requests_served = 0
        self._enabled = enabled
        self._priority = _check_priority(priority)
        self._started = False
        self._closed = False
        self._scopes: list[BackgroundTask] = []  # the declaring and expiring tasks'
        self._changed: anyio.Event | None = None  # wakes the declaring task
        self._declared_until: float | None = None  # expiration of our last declaration
        self._uploads: anyio.Semaphore | None = None
        self._snapshots: dict[bytes, _Snapshot] = {}  # oldest first
        self._snapshot_lock: anyio.Lock | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled and not self._closed

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value and self._started:
            self._claim()
        self._enabled = value
        if not value:
            self._snapshots.clear()
        self._wake()

    @property
    def priority(self) -> float:
        return self._priority

    @priority.setter
    def priority(self, value: float) -> None:
        self._priority = _check_priority(value)
        self._wake()

    def start(self) -> None:
        """Serve ``avg.state`` for our prefix and declare (while enabled) until :meth:`stop`."""
        if self._started or self._closed:
            return
        _registry(self.dht.node)  # (answers "does not share" rather than "no such method")
        if self._enabled:
            self._claim()
        self._uploads = anyio.Semaphore(_MAX_UPLOADS)
        self._snapshot_lock = anyio.Lock()
        self._started = True
        node = self.dht.node
        self._scopes.append(node.spawn(self._declare_loop, name=f"declare state {self.key}"))
        self._scopes.append(node.spawn(self._expire_loop, name=f"expire snapshots {self.key}"))

    def _claim(self) -> None:
        """Serve our prefix's downloads on the node (one sharer per prefix and node)."""
        registry = _registry(self.dht.node)
        if registry.setdefault(self.prefix, self) is not self:
            raise ValueError(f"another averager shares the state of {self.prefix!r} on this node")

    def stop(self) -> None:
        """Stop declaring and serving; withdraw our declaration (in the background). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._snapshots.clear()
        for scope in self._scopes:
            scope.cancel()
        registry = _registries.get(self.dht.node)
        if registry is not None and registry.get(self.prefix) is self:
            del registry[self.prefix]
        if self._declared_until is not None:
            with contextlib.suppress(RuntimeError):  # the node is closing: it just expires
                self.dht.node.spawn(self._withdraw, name=f"withdraw state {self.key}")

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _declare_loop(self) -> None:
        while True:
            self._changed = anyio.Event()
            if self.enabled:
                await self._declare()
            elif self._declared_until is not None:
                await self._withdraw()
            with anyio.move_on_after(self.declare_period / 2):
                await self._changed.wait()

    async def _declare(self) -> None:
        addresses = self.dht.visible_addresses()
        if not addresses:
            logger.warning("cannot share the state of %s: no address to be reached at", self.key)
            return
        expiration = get_dht_time() + self.declare_period
        value = {"priority": self._priority, "address": str(addresses[0])}
        if await self._store(value, expiration):
            self._declared_until = expiration

    async def _withdraw(self) -> None:
        if self._declared_until is None:
            return
        until, self._declared_until = self._declared_until, None
        if until > get_dht_time():
            await self._store(None, until + _WITHDRAWN)

    async def _store(self, value: Any, expiration: float) -> bool:
        try:
            with anyio.fail_after(self.declare_period / 2):
                subkey = owner_marker(self.dht.peer_id)  # (signed: only we can change it)
                if await self.dht.store(self.key, value, expiration, subkey=subkey):
                    return True
            logger.debug("storing %s for %s was refused", self.key, self.dht.peer_id.short())
        except Exception as exc:  # (best effort: the DHT may be closing, e.g. when we close)
            logger.debug("could not store %s: %r", self.key, exc)
        return False

    # -- snapshots -------------------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        while True:
            await anyio.sleep(_SNAPSHOT_IDLE / 4)
            self._expire()

    def _expire(self) -> None:
        """Drop the snapshots no call has read for ``_SNAPSHOT_IDLE`` seconds."""
        now = anyio.current_time()
        for key, snap in list(self._snapshots.items()):
            if not snap.active and now - snap.last_used > _SNAPSHOT_IDLE:
                del self._snapshots[key]

    async def _recent_snapshot(self) -> _Snapshot:
        """A snapshot taken for this call, or one taken less than ``_SNAPSHOT_REUSE`` s ago
        (or the newest, when ``_MAX_SNAPSHOTS`` are held)."""
        assert self._snapshot_lock is not None
        async with self._snapshot_lock:  # (calls that come together share one snapshot)
            self._expire()
            newest = next(reversed(self._snapshots.values()), None)
            now = anyio.current_time()
            if (
                newest is not None
                and now - newest.created < _SNAPSHOT_REUSE
                and newest.priority == self._priority
            ):
                return newest
            if len(self._snapshots) >= _MAX_SNAPSHOTS:
                idle = next((k for k, s in self._snapshots.items() if not s.active), None)
                if idle is None:
                    assert newest is not None
                    return newest  # (every one is being read: share, bounded memory)
                del self._snapshots[idle]
            priority = self._priority
            metadata, tensors, infos = _unpack_state(await self.provider())
            try:
                packed: bytes = msgpack.packb(metadata, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(
                    f"the state's metadata is not msgpack-serializable: {exc}"
                ) from None
            snap = await anyio.to_thread.run_sync(
                _take_snapshot, packed, tensors, infos, self.compression, self.block_size
            )
            snap.created = snap.last_used = anyio.current_time()
            snap.priority = priority
            if not self.enabled:
                raise ValueError("state sharing was turned off")
            self._snapshots.pop(snap.id, None)  # (the same state again: now the newest)
            self._snapshots[snap.id] = snap
            return snap

    async def _serve(self, request: StateRequest, ctx: CallContext) -> AsyncIterator[Message]:
        """One call: a snapshot's header (unless one is named) and its bytes in the range
        asked (the snapshot is what is sent: the averaged tensors can change meanwhile)."""
        assert self._uploads is not None
        with anyio.move_on_after(_UPLOAD_WAIT) as waited:
            await self._uploads.acquire()
        if waited.cancelled_caught:
            raise ValueError("too many downloads of this state at once")
        try:
            if not self.enabled:
                raise ValueError("state sharing was turned off")
            if len(request.snapshot) > MAX_SNAPSHOT_ID:
                raise ValueError("a malformed snapshot id")
            if request.snapshot:
                snap = self._snapshots.get(request.snapshot)
                if snap is None:
                    raise ValueError("that snapshot is no longer held")
            else:
                snap = await self._recent_snapshot()
            start, stop = check_range(request.start, request.stop, snap.header.total_bytes)
            snap.active += 1
            try:
                if not request.snapshot:
                    yield snap.header
                if stop > start:
                    logger.debug(
                        "sending bytes %d-%d of state to %s", start, stop, ctx.peer_id.short()
                    )
                for chunk in snap.pieces(start, stop, self.chunk_size):
                    if self._closed:
                        raise ValueError("the averager closed")
                    yield chunk
                    self.bytes_served += chunk.data.size
                self.requests_served += 1
            finally:
                snap.active -= 1
                snap.last_used = anyio.current_time()
        finally:
            self._uploads.release()


def _check_priority(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"state_sharing_priority must be a finite number, not {value!r}")
    return float(value)


# -- downloading ----------------------------------------------------------------------------------

#: A donor of a state: ``(peer, address, priority)`` (the list is tried in its order).
Donor = tuple[PeerID, Address, float]


def _donors(found: GetResult, me: PeerID) -> list[Donor]:
    """The peers declared under the key, as a get of it returned (never ``me``): best
    priority first, ties at random."""
    if found is None or not isinstance(found.value, dict):
        return []
    donors = []
    for subkey, item in found.value.items():
        peer = owner_of(subkey)
        value = getattr(item, "value", None)
        if peer is None or peer == me or not isinstance(value, dict):
            continue
        priority, address = value.get("priority"), value.get("address")
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int | float)
            or not math.isfinite(priority)
            or not isinstance(address, str)
            or len(address) > _MAX_ADDRESS_LENGTH
        ):
            continue
        try:  # (with the declaring PeerID: only that peer can answer there)
            parsed = Address.parse(address).with_peer_id(peer)
        except ValueError:
            continue
        donors.append((peer, parsed, float(priority), random.random()))
    donors.sort(key=lambda d: (-d[2], d[3]))
    return [(peer, address, priority) for peer, address, priority, _ in donors[:_MAX_DONORS]]


def _decode_metadata(header: StateHeader) -> Any:
    try:
        return msgpack.unpackb(header.metadata, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise StateDownloadFailed(f"the metadata does not decode: {exc}") from None


async def _receive(answers: AsyncIterator[Message], timeout: float, what: str) -> Message | None:
    """The donor's next message (``None`` at the end) within ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            return await anext(answers, None)
    except TimeoutError:
        raise TimeoutError(f"no {what} came within {timeout} s") from None


async def _receive_header(
    answers: AsyncIterator[Message], timeout: float, max_bytes: int
) -> tuple[StateHeader, StateLayout]:
    header = await _receive(answers, timeout, "header")
    if not isinstance(header, StateHeader):
        raise StateDownloadFailed("the donor did not begin with a header")
    layout = check_header(header, max_bytes)
    _decode_metadata(header)
    return header, layout


class _Download:
    """The payload of one snapshot being filled in (tensors allocated once the header passed
    :func:`check_header`): the ranges still to fetch, the blocks verified."""

    def __init__(self, header: StateHeader, layout: StateLayout) -> None:
        import torch

        self.header, self.layout = header, layout
        self.id = snapshot_id(header)
        self.tensors: list[torch.Tensor | None] = []
        self.buffers: list[npt.NDArray[np.uint8]] = []  # each segment's bytes
        for seg in layout.segments:
            if seg.codec:
                self.tensors.append(None)
                self.buffers.append(np.empty(seg.size, dtype=np.uint8))
            else:
                tensor = torch.empty(seg.shape, dtype=getattr(torch, seg.dtype))
                self.tensors.append(tensor)
                self.buffers.append(tensor.reshape(-1).view(torch.uint8).numpy())
        self.pending = split_ranges(layout.total, layout.block_size, RANGE_BLOCKS)
        self.pending.reverse()  # (taken from the end: in order)
        self.in_flight = 0
        self.changed = anyio.Event()
        self.bytes_from: dict[PeerID, int] = {}

    @property
    def complete(self) -> bool:
        return not self.pending and not self.in_flight

    def take(self) -> tuple[int, int] | None:
        if not self.pending:
            return None
        self.in_flight += 1
        return self.pending.pop()

    def settle(self, rest: tuple[int, int] | None) -> None:
        """A range taken is over; ``rest`` (its unverified end) goes back to the queue."""
        self.in_flight -= 1
        if rest is not None and rest[0] < rest[1]:
            self.pending.append(rest)
        self.wake()

    def wake(self) -> None:
        """Wake whoever waits on :attr:`changed` (a fresh event for the next wait)."""
        self.changed.set()
        self.changed = anyio.Event()

    def _slices(self, start: int, stop: int) -> Generator[tuple[npt.NDArray[np.uint8], int, int]]:
        """(segment buffer, from, to) covering the payload ``[start, stop)``."""
        for seg, buffer in zip(self.layout.segments, self.buffers, strict=True):
            lo, hi = max(start, seg.offset), min(stop, seg.offset + seg.size)
            if lo < hi:
                yield buffer, lo - seg.offset, hi - seg.offset

    def write(self, offset: int, data: npt.NDArray[np.uint8]) -> None:
        taken = 0
        for buffer, lo, hi in self._slices(offset, offset + data.size):
            buffer[lo:hi] = data[taken : taken + hi - lo]
            taken += hi - lo

    def _block_ok(self, index: int) -> bool:
        digest = hashlib.sha256()
        for buffer, lo, hi in self._slices(*self.layout.block_range(index)):
            digest.update(buffer[lo:hi].data)
        return digest.digest() == self.layout.digests[index]

    async def verify(self, index: int) -> None:
        start, stop = self.layout.block_range(index)
        if stop - start <= _INLINE_HASH:
            ok = self._block_ok(index)
        else:  # (hashlib releases the GIL: blocks from several donors are hashed in parallel)
            ok = await anyio.to_thread.run_sync(self._block_ok, index)
        if not ok:
            raise StateDownloadFailed(f"block {index} (bytes {start}-{stop}) does not match")

    async def read_range(
        self,
        answers: AsyncIterator[Message],
        start: int,
        stop: int,
        timeout: float,
        done: list[int],
    ) -> None:
        """Read the chunks of ``[start, stop)`` (``start`` at a block's start) in order,
        verifying each block as it completes; ``done[0]``: the end of the verified blocks."""
        size = self.layout.block_size
        pos = done[0] = start
        while pos < stop:
            chunk = await _receive(answers, timeout, f"chunk at byte {pos}")
            if not isinstance(chunk, StateChunk) or chunk.offset != pos:
                raise StateDownloadFailed(f"expected the chunk at byte {pos} of {stop}")
            data = chunk.data
            if data.dtype != np.uint8 or data.ndim != 1 or not 0 < data.size <= stop - pos:
                raise StateDownloadFailed(f"a malformed chunk at byte {pos}")
            self.write(pos, data)
            pos += data.size
            while done[0] < stop and min(done[0] + size, self.layout.total) <= pos:
                await self.verify(done[0] // size)
                done[0] = min(done[0] + size, self.layout.total)
        if await _receive(answers, timeout, "end of the stream") is not None:
            raise StateDownloadFailed("the donor sent more than it asked for")

    async def finish(self) -> State:
        """The state, once every block is verified: compressed tensors decoded, booleans
        checked."""
        metadata = _decode_metadata(self.header)
        tensors: list[torch.Tensor] = []
        for seg, tensor, buffer in zip(
            self.layout.segments, self.tensors, self.buffers, strict=True
        ):
            if tensor is None:
                tensor = await anyio.to_thread.run_sync(_decode_segment, seg, buffer)
            elif seg.dtype == "bool" and buffer.size and buffer.max() > 1:
                raise StateDownloadFailed("a bool tensor holds bytes other than 0 and 1")
            tensors.append(tensor)
        return metadata, tensors


def _decode_segment(seg: Segment, buffer: npt.NDArray[np.uint8]) -> torch.Tensor:
    import torch

    data, scales, _ = seg.parts
    view = buffer.data
    parts = {
        "codec": seg.codec,
        "shape": list(seg.shape),
        "dtype": seg.dtype,
        "data": view[:data],
        "scales": view[data : data + scales],
        "codebook": view[data + scales :],
        "block_size": seg.codec_block,
    }
    try:
        array = decompress(CompressedTensor.from_parts(parts))
    except ValueError as exc:
        raise StateDownloadFailed(f"a compressed tensor does not decode: {exc}") from None
    return torch.from_numpy(np.array(array, copy=True))


async def download_state(
    node: Node,
    address: Address,
    prefix: str,
    *,
    chunk_timeout: float,
    header_timeout: float = HEADER_WAIT,
    max_bytes: int = DEFAULT_MAX_STATE_SIZE,
) -> State:
    """Download the state of the averager under ``prefix`` at ``address`` in one call (header
    and every byte), from that donor alone.

    :raises StateDownloadFailed: the answer was garbage, over ``max_bytes``, or a block's or
        the whole checksum did not match.
    :raises TimeoutError: the header took more than ``max(chunk_timeout, header_timeout)``
        seconds (the donor snapshots and hashes first), or a chunk more than ``chunk_timeout``.
    :raises SwarmError: the call failed (the donor refused, left, could not be reached).
    """
    request = StateRequest(prefix)
    async with node.rpc.server_stream(address, METHOD, request, response_type=Message) as answers:
        wait = max(chunk_timeout, header_timeout)
        header, layout = await _receive_header(answers, wait, max_bytes)
        download = _Download(header, layout)
        await download.read_range(answers, 0, layout.total, chunk_timeout, [0])
    return await download.finish()


@dataclass(eq=False)
class _Probe:
    """A donor's header (a call for no bytes), or why it has none."""

    donor: Donor
    header: StateHeader | None = None
    layout: StateLayout | None = None
    id: bytes = b""
    done: anyio.Event = field(default_factory=anyio.Event)

    async def run(self, node: Node, prefix: str, timeout: float, max_bytes: int) -> None:
        _, address, _ = self.donor
        try:
            request = StateRequest(prefix, stop=0)
            async with node.rpc.server_stream(
                address, METHOD, request, response_type=Message
            ) as answers:
                header, layout = await _receive_header(answers, timeout, max_bytes)
                if await _receive(answers, timeout, "end of the stream") is not None:
                    raise StateDownloadFailed("the donor sent bytes not asked for")
            self.header, self.layout, self.id = header, layout, snapshot_id(header)
        except _DONOR_ERRORS as exc:
            _warn(self.donor, exc)
        finally:
            self.done.set()


def _warn(donor: Donor, exc: BaseException) -> None:
    """A donor failed (its doing: DEBUG; the download goes on with the others, and
    :func:`load_state` warns once if none delivers)."""
    peer, _, priority = donor
    logger.debug(
        "could not load the state from %s (priority %s): %s: %s",
        peer.short(),
        priority,
        type(exc).__name__,
        exc,
    )


async def _fetch(
    node: Node,
    prefix: str,
    probe: _Probe,
    download: _Download,
    chunk_timeout: float,
) -> None:
    """Fetch ranges of ``download`` from the probed donor until none is left or it fails."""
    await probe.done.wait()
    if probe.header is None or probe.id != download.id:
        return
    peer, address, _ = probe.donor
    while not download.complete:
        taken = download.take()
        if taken is None:  # (others hold the rest: wait for them to finish or give some back)
            await download.changed.wait()
            continue
        start, stop = taken
        done = [start]
        try:
            request = StateRequest(prefix, probe.header.snapshot, start, stop)
            async with node.rpc.server_stream(
                address, METHOD, request, response_type=Message
            ) as answers:
                await download.read_range(answers, start, stop, chunk_timeout, done)
        except _DONOR_ERRORS as exc:
            _warn(probe.donor, exc)
            download.settle((done[0], stop))
            return
        except BaseException:
            download.settle((done[0], stop))
            raise
        download.bytes_from[peer] = download.bytes_from.get(peer, 0) + stop - start
        download.settle(None)


async def _session(
    node: Node,
    prefix: str,
    batch: list[Donor],
    download: _Download | None,
    *,
    chunk_timeout: float,
    header_timeout: float,
    max_bytes: int,
) -> tuple[_Download | None, list[Donor]]:
    """Probe ``batch`` and download from those whose snapshot is ``download``'s (none: the
    best-ranked one's, see :func:`_choose`). The download as it stands, and the donors whose
    snapshot differs. Returns as soon as the download is complete: donors still silent then
    (unreachable, or still hashing) are not waited for."""
    probes = [_Probe(donor) for donor in batch]
    wait = max(chunk_timeout, header_timeout)
    async with anyio.create_task_group() as tg:
        for probe in probes:
            tg.start_soon(probe.run, node, prefix, wait, max_bytes)
        if download is None:
            download = await _choose(probes, chunk_timeout)
        if download is not None:
            await _fetch_all(node, prefix, probes, download, chunk_timeout)
        # (a probe still running has nothing left to add: a cut-off donor would hold the
        # download for its whole header wait)
        tg.cancel_scope.cancel()
    target = download.id if download is not None else b""
    others = [p.donor for p in probes if p.header is not None and p.id != target]
    if download is not None and not download.complete and len(others) == len(batch):
        download = None  # (none of them holds it: start over with theirs)
    return download, others


async def _choose(probes: list[_Probe], chunk_timeout: float) -> _Download | None:
    """The download of the best-ranked probed donor whose header arrives, waiting on them in
    rank order; but once a lower-ranked donor answered, a better one still silent gets
    ``chunk_timeout`` more at most (it may be cut off: its header wait is 30 s). ``None`` when
    no probe delivered a usable header."""
    for i, probe in enumerate(probes):
        while not probe.done.is_set():
            with anyio.move_on_after(chunk_timeout):
                await probe.done.wait()
            if not probe.done.is_set() and any(p.header is not None for p in probes[i + 1 :]):
                break
        if (download := _download_of(probe)) is not None:
            return download
    # (every probe skipped above has answered by now or is still silent: take the best that
    # answered, if a skipped one did since)
    for probe in probes:
        if (download := _download_of(probe)) is not None:
            return download
    return None


def _download_of(probe: _Probe) -> _Download | None:
    """A download of ``probe``'s snapshot, if its header arrived and is usable (one that is
    not is warned about and forgotten)."""
    if probe.header is None or probe.layout is None:
        return None
    try:
        return _Download(probe.header, probe.layout)
    except (MemoryError, RuntimeError, ValueError) as exc:
        _warn(probe.donor, exc)
        probe.header = None
        return None


async def _fetch_all(
    node: Node, prefix: str, probes: list[_Probe], download: _Download, chunk_timeout: float
) -> None:
    """Fetch ``download`` from every probed donor with its snapshot; return once it is
    complete (fetchers waiting for a silent donor's header are cancelled) or every fetcher
    is over (the rest of it is for the next donors)."""
    running = [len(probes)]

    async def fetch(probe: _Probe) -> None:
        try:
            await _fetch(node, prefix, probe, download, chunk_timeout)
        finally:
            running[0] -= 1
            download.wake()

    async with anyio.create_task_group() as tg:
        for probe in probes:
            tg.start_soon(fetch, probe)
        while running[0] and not download.complete:
            await download.changed.wait()
        tg.cancel_scope.cancel()


async def load_state(
    dht: DHT,
    prefix: str,
    *,
    chunk_timeout: float,
    header_timeout: float = HEADER_WAIT,
    max_bytes: int = DEFAULT_MAX_STATE_SIZE,
    max_donors: int = DEFAULT_MAX_DONORS,
) -> State | None:
    """The state of the best-ranked donor under ``prefix`` that delivers it, fetched at once
    from up to ``max_donors`` donors that hold the same snapshot; ``None`` when nobody shares
    it (or every donor failed). Unbounded only in the number of donors tried (at most
    ``_MAX_DONORS``), each bounded by its timeouts; bound the whole from outside."""
    found: GetResult = None
    with anyio.move_on_after(_DHT_WAIT):
        found = await dht.get(f"{prefix}.state", latest=True)
    untried = _donors(found, dht.peer_id)
    if not untried:
        logger.info("no peer shares the state of %s", prefix)
        return None
    return await load_state_from(
        dht.node,
        prefix,
        untried,
        chunk_timeout=chunk_timeout,
        header_timeout=header_timeout,
        max_bytes=max_bytes,
        max_donors=max_donors,
    )


async def load_state_from(
    node: Node,
    prefix: str,
    donors: Sequence[Donor],
    *,
    chunk_timeout: float,
    header_timeout: float = HEADER_WAIT,
    max_bytes: int = DEFAULT_MAX_STATE_SIZE,
    max_donors: int = DEFAULT_MAX_DONORS,
) -> State | None:
    """The state under ``prefix`` from the given ``donors`` (``(peer, address, priority)``, best
    first; found without the DHT, e.g. named by an election), fetched at once from up to
    ``max_donors`` of them that hold the same snapshot, the first one that answers setting
    which; ``None`` when every donor failed. Each donor is bounded by the timeouts."""
    untried = list(donors)
    total = len(untried)
    download: _Download | None = None
    while untried:
        batch, untried = untried[:max_donors], untried[max_donors:]
        logger.debug(
            "downloading the state of %s from %s", prefix, [p.short() for p, _, _ in batch]
        )
        download, others = await _session(
            node,
            prefix,
            batch,
            download,
            chunk_timeout=chunk_timeout,
            header_timeout=header_timeout,
            max_bytes=max_bytes,
        )
        if download is not None and download.complete:
            logger.debug(
                "loaded the state of %s: bytes by donor %s",
                prefix,
                {p.short(): n for p, n in download.bytes_from.items()},
            )
            try:
                return await download.finish()
            except StateDownloadFailed as exc:  # (its donors are tried: on with the others)
                logger.debug("the state of %s was refused: %s", prefix, exc)
                download = None
        untried = others + untried
    logger.warning(
        "could not load the state of %s: none of the %d peers that share it delivered it",
        prefix,
        total,
    )
    return None


class StateLoad:
    """A state download in progress (``load_state_from_peers(wait=False)``): ``await`` it for
    the result (``(metadata, tensors)`` or ``None``); :meth:`cancel` stops it."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._outcome: tuple[State | None, BaseException | None] | None = None
        self._canceller: Callable[[], object] | None = None

    def done(self) -> bool:
        return self._outcome is not None

    def cancel(self) -> bool:
        """Cancel the download; ``False`` if it already finished."""
        if self._outcome is not None or self._canceller is None:
            return False
        self._canceller()
        return True

    def __await__(self) -> Generator[Any, None, State | None]:
        return self._result().__await__()

    async def _result(self) -> State | None:
        await self._done.wait()
        assert self._outcome is not None
        result, error = self._outcome
        if error is not None:
            raise error
        return result

    async def _run(self, load: Callable[[], Awaitable[State | None]]) -> None:
        try:
            self._set(await load(), None)
        except anyio.get_cancelled_exc_class():
            import concurrent.futures

            self._set(None, concurrent.futures.CancelledError("the download was cancelled"))
            raise
        except Exception as exc:
            self._set(None, exc)

    def _set(self, result: State | None, error: BaseException | None) -> None:
        if self._outcome is None:
            self._outcome = (result, error)
            self._done.set()
