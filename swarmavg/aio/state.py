"""State sharing: a peer that joins late downloads the state of one that has been averaging.

A peer that shares (``allow_state_sharing``) declares itself in the DHT under ``<prefix>.state``
(a dictionary: subkey its PeerID, value ``{"priority": float, "address": str}``), again every
half ``declare_state_period`` with an expiration one period ahead, and withdraws (value
``None``, expiring 1 ms after the declaration it replaces) when it stops. It serves ``avg.state``
(a server-stream call, messages in :mod:`swarmavg.proto.state_messages`): a header (msgpack
metadata, every tensor's dtype and shape, the total size, a SHA-256 checksum) and then the
tensors' bytes in chunks of at most :data:`CHUNK_SIZE`.

A taker reads the key, tries the donors by priority (highest first, ties at random, never
itself), checks each header against its limits before it allocates anything, checks every
chunk's place and the checksum at the end, and moves to the next donor when one fails, sends
garbage or stalls (no message within ``next_chunk_timeout``).

The donor takes a snapshot (:meth:`~swarmavg.aio.DecentralizedAverager.get_current_state`: by
default copies of the averaged tensors, taken under their lock) and hashes it in a worker
thread; the transfer then reads only the snapshot, so the donor's own averaging goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
import msgpack
import numpy as np
import numpy.typing as npt

from swarmavg._time import get_dht_time
from swarmavg.address import Address
from swarmavg.errors import SwarmError
from swarmavg.identity import PeerID
from swarmavg.proto.codec import Message
from swarmavg.proto.state_messages import StateChunk, StateHeader, StateRequest

if TYPE_CHECKING:
    import torch

    from swarmavg.aio.dht_facade import DHT
    from swarmavg.aio.node import Node
    from swarmavg.aio.rpc import CallContext

__all__ = [
    "CHUNK_SIZE",
    "DEFAULT_MAX_STATE_SIZE",
    "METHOD",
    "StateLoad",
    "StateSharer",
    "download_state",
    "load_state",
]

logger = logging.getLogger(__name__)

METHOD: Final = "avg.state"
#: The most bytes one chunk carries.
CHUNK_SIZE: Final = 4 << 20
#: The largest state a taker accepts by default (bytes of tensors).
DEFAULT_MAX_STATE_SIZE: Final = 16 << 30
#: How long a taker waits for the header (the donor snapshots and hashes first), at least.
HEADER_WAIT: Final = 30.0
#: How long a load waits for the DHT's answer when it has no timeout of its own.
_DHT_WAIT: Final = 60.0
#: Donors tried at most per load (the best-ranked).
_MAX_DONORS: Final = 32
#: Tensors a header may announce.
_MAX_TENSORS: Final = 1 << 16
_MAX_NDIM: Final = 32
_MAX_ADDRESS_LENGTH: Final = 512
#: Downloads one averager serves at once; more wait (at most ``_UPLOAD_WAIT`` s), then fail.
_MAX_UPLOADS: Final = 4
_UPLOAD_WAIT: Final = 10.0
#: A withdrawal expires this long after the declaration it replaces (the newer one wins).
_WITHDRAWN: Final = 0.001

#: dtypes a state may hold: name (as torch and the header spell it) -> bytes per element
DTYPE_SIZES: Final = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

StateProvider = Callable[[], Awaitable[tuple[Any, Sequence["torch.Tensor"]]]]


class StateDownloadFailed(SwarmError, ValueError):
    """A donor's answer was refused (garbage, over the limits, a wrong checksum)."""


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
        async for answer in sharer._serve(ctx):
            yield answer

    return serve


@dataclass
class _Snapshot:
    dtypes: list[str]
    shapes: list[list[int]]
    views: list[npt.NDArray[np.uint8]]  # each tensor's bytes
    keep: list[torch.Tensor]  # (what the views look into)
    total: int
    checksum: bytes


def _snapshot(tensors: object) -> _Snapshot:
    """The tensors' bytes (on the host, contiguous) and their checksum. Runs in a worker thread
    (hashing gigabytes takes seconds)."""
    import torch

    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError("get_current_state() must return (metadata, a sequence of tensors)")
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    views: list[npt.NDArray[np.uint8]] = []
    keep: list[torch.Tensor] = []
    digest = hashlib.sha256()
    with torch.no_grad():
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"get_current_state() returned a {type(tensor).__name__}")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPE_SIZES:
                raise TypeError(f"a tensor of {tensor.dtype} cannot be shared")
            host = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            view = host.reshape(-1).view(torch.uint8).numpy()
            digest.update(view.data)
            dtypes.append(dtype)
            shapes.append(list(host.shape))
            views.append(view)
            keep.append(host)
    return _Snapshot(dtypes, shapes, views, keep, sum(v.size for v in views), digest.digest())


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
    ) -> None:
        self.dht = dht
        self.prefix = prefix
        self.key = f"{prefix}.state"
        self.provider = provider
        self.declare_period = declare_period
        self.chunk_size = CHUNK_SIZE
        self._enabled = enabled
        self._priority = _check_priority(priority)
        self._started = False
        self._closed = False
        self._scope: anyio.CancelScope | None = None  # the declaring task's
        self._changed: anyio.Event | None = None  # wakes the declaring task
        self._declared_until: float | None = None  # expiration of our last declaration
        self._uploads: anyio.Semaphore | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled and not self._closed

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value and self._started:
            self._claim()
        self._enabled = value
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
        self._started = True
        self._scope = self.dht.node.spawn(self._declare_loop, name=f"declare state {self.key}")

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
        if self._scope is not None:
            self._scope.cancel()
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
                subkey = self.dht.peer_id.to_bytes()
                if await self.dht.store(self.key, value, expiration, subkey=subkey):
                    return True
            logger.debug("storing %s for %s was refused", self.key, self.dht.peer_id.short())
        except Exception as exc:  # (best effort: the DHT may be closing, e.g. when we close)
            logger.debug("could not store %s: %r", self.key, exc)
        return False

    async def _serve(self, ctx: CallContext) -> AsyncIterator[Message]:
        """One download: snapshot, header, chunks (the snapshot is what is sent: the averaged
        tensors can change meanwhile)."""
        assert self._uploads is not None
        with anyio.move_on_after(_UPLOAD_WAIT) as waited:
            await self._uploads.acquire()
        if waited.cancelled_caught:
            raise ValueError("too many downloads of this state at once")
        try:
            if not self.enabled:
                raise ValueError("state sharing was turned off")
            metadata, tensors = await self.provider()
            try:
                packed: bytes = msgpack.packb(metadata, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(
                    f"the state's metadata is not msgpack-serializable: {exc}"
                ) from None
            snapshot = await anyio.to_thread.run_sync(_snapshot, tensors)
            logger.debug("sending %d bytes of state to %s", snapshot.total, ctx.peer_id.short())
            yield StateHeader(
                packed, snapshot.dtypes, snapshot.shapes, snapshot.total, snapshot.checksum
            )
            offset = 0
            for view in snapshot.views:
                for start in range(0, view.size, self.chunk_size):
                    if self._closed:
                        raise ValueError("the averager closed")
                    chunk = view[start : start + self.chunk_size]
                    yield StateChunk(offset, chunk)
                    offset += chunk.size
        finally:
            self._uploads.release()


def _check_priority(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"state_sharing_priority must be a finite number, not {value!r}")
    return float(value)


# -- downloading ----------------------------------------------------------------------------------


def _donors(found: object, me: PeerID) -> list[tuple[PeerID, Address, float]]:
    """The peers declared under the key (never ``me``): best priority first, ties at random."""
    if not isinstance(found, dict):
        return []
    donors = []
    for subkey, item in found.items():
        try:
            peer = PeerID(subkey) if isinstance(subkey, bytes) else None
        except ValueError:
            continue
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


def _check_header(header: StateHeader, max_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """The announced tensors (dtype, shape), if the header is consistent and within bounds."""
    if len(header.dtypes) != len(header.shapes) or len(header.dtypes) > _MAX_TENSORS:
        raise StateDownloadFailed("the header's dtypes and shapes do not match")
    if len(header.checksum) != hashlib.sha256().digest_size:
        raise StateDownloadFailed("the header's checksum is not a SHA-256 digest")
    total = 0
    specs = []
    for dtype, shape in zip(header.dtypes, header.shapes, strict=True):
        if dtype not in DTYPE_SIZES:
            raise StateDownloadFailed(f"unsupported dtype {dtype[:32]!r}")
        if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
            raise StateDownloadFailed("a malformed shape")
        size = DTYPE_SIZES[dtype] * math.prod(shape)  # (Python ints: no overflow)
        total += size
        if total > max_bytes:
            raise StateDownloadFailed(f"the state is over the limit ({max_bytes} bytes)")
        specs.append((dtype, tuple(shape)))
    if total != header.total_bytes:
        raise StateDownloadFailed(
            f"the header announces {header.total_bytes} bytes, its tensors hold {total}"
        )
    return specs


async def download_state(
    node: Node,
    address: Address,
    prefix: str,
    *,
    chunk_timeout: float,
    header_timeout: float = HEADER_WAIT,
    max_bytes: int = DEFAULT_MAX_STATE_SIZE,
) -> tuple[Any, list[torch.Tensor]]:
    """Download the state of the averager under ``prefix`` at ``address``.

    :raises StateDownloadFailed: the answer was garbage, over ``max_bytes``, or its checksum
        did not match.
    :raises TimeoutError: the header took more than ``max(chunk_timeout, header_timeout)``
        seconds (the donor snapshots and hashes first), or a chunk more than ``chunk_timeout``.
    :raises SwarmError: the call failed (the donor refused, left, could not be reached).
    """
    import torch

    request = StateRequest(prefix)
    async with node.rpc.server_stream(address, METHOD, request, response_type=Message) as answers:
        header = await _receive(answers, max(chunk_timeout, header_timeout), "header")
        if not isinstance(header, StateHeader):
            raise StateDownloadFailed("the donor did not begin with a header")
        specs = _check_header(header, max_bytes)
        try:
            metadata = msgpack.unpackb(header.metadata, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise StateDownloadFailed(f"the metadata does not decode: {exc}") from None
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in specs]
        views = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
        digest = hashlib.sha256()
        total = header.total_bytes
        received = index = filled = 0  # bytes so far; the tensor being filled; its bytes so far
        while received < total:
            chunk = await _receive(answers, chunk_timeout, f"chunk at byte {received}")
            if not isinstance(chunk, StateChunk) or chunk.offset != received:
                raise StateDownloadFailed(f"expected the chunk at byte {received} of {total}")
            data = chunk.data
            if data.dtype != np.uint8 or data.ndim != 1 or not 0 < data.size <= total - received:
                raise StateDownloadFailed(f"a malformed chunk at byte {received}")
            digest.update(data.data)
            taken = 0
            while taken < data.size:
                while filled == views[index].size:
                    index, filled = index + 1, 0
                n = min(data.size - taken, views[index].size - filled)
                views[index][filled : filled + n] = data[taken : taken + n]
                taken, filled = taken + n, filled + n
            received += data.size
        extra = await _receive(answers, chunk_timeout, "end of the stream")
        if extra is not None:
            raise StateDownloadFailed("the donor sent more than it announced")
    if digest.digest() != header.checksum:
        raise StateDownloadFailed("the checksum does not match")
    for (dtype, _), view in zip(specs, views, strict=True):
        if dtype == "bool" and view.size and view.max() > 1:  # (other bytes are not booleans)
            raise StateDownloadFailed("a bool tensor holds bytes other than 0 and 1")
    return metadata, tensors


async def _receive(answers: AsyncIterator[Message], timeout: float, what: str) -> Message | None:
    """The donor's next message (``None`` at the end) within ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            return await anext(answers, None)
    except TimeoutError:
        raise TimeoutError(f"no {what} came within {timeout} s") from None


async def load_state(
    dht: DHT,
    prefix: str,
    *,
    chunk_timeout: float,
    header_timeout: float = HEADER_WAIT,
    max_bytes: int = DEFAULT_MAX_STATE_SIZE,
) -> tuple[Any, list[torch.Tensor]] | None:
    """The state of the best-ranked donor under ``prefix`` that delivers it, or ``None`` when
    nobody shares it (or every donor failed). Unbounded only in the number of donors tried
    (at most ``_MAX_DONORS``), each bounded by its timeouts; bound the whole from outside."""
    found: object = None
    with anyio.move_on_after(_DHT_WAIT):
        found = await dht.get(f"{prefix}.state", latest=True)
    donors = _donors(found, dht.peer_id)
    if not donors:
        logger.info("no peer shares the state of %s", prefix)
        return None
    for peer, address, priority in donors:
        logger.debug("downloading the state of %s from %s", prefix, peer.short())
        try:
            return await download_state(
                dht.node,
                address,
                prefix,
                chunk_timeout=chunk_timeout,
                header_timeout=header_timeout,
                max_bytes=max_bytes,
            )
        except (SwarmError, OSError, TimeoutError, ValueError, TypeError, MemoryError) as exc:
            logger.warning(
                "could not load the state from %s (priority %s): %s: %s",
                peer.short(),
                priority,
                type(exc).__name__,
                exc,
            )
    return None


class StateLoad:
    """A state download in progress (``load_state_from_peers(wait=False)``): ``await`` it for
    the result (``(metadata, tensors)`` or ``None``); :meth:`cancel` stops it."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._outcome: tuple[tuple[Any, list[torch.Tensor]] | None, BaseException | None] | None
        self._outcome = None
        self._canceller: Callable[[], object] | None = None

    def done(self) -> bool:
        return self._outcome is not None

    def cancel(self) -> bool:
        """Cancel the download; ``False`` if it already finished."""
        if self._outcome is not None or self._canceller is None:
            return False
        self._canceller()
        return True

    def __await__(self) -> Generator[Any, None, tuple[Any, list[torch.Tensor]] | None]:
        return self._result().__await__()

    async def _result(self) -> tuple[Any, list[torch.Tensor]] | None:
        await self._done.wait()
        assert self._outcome is not None
        result, error = self._outcome
        if error is not None:
            raise error
        return result

    async def _run(
        self, load: Callable[[], Awaitable[tuple[Any, list[torch.Tensor]] | None]]
    ) -> None:
        try:
            self._set(await load(), None)
        except anyio.get_cancelled_exc_class():
            import concurrent.futures

            self._set(None, concurrent.futures.CancelledError("the download was cancelled"))
            raise
        except Exception as exc:
            self._set(None, exc)

    def _set(
        self, result: tuple[Any, list[torch.Tensor]] | None, error: BaseException | None
    ) -> None:
        if self._outcome is None:
            self._outcome = (result, error)
            self._done.set()
