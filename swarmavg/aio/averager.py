"""``swarmavg.aio.DecentralizedAverager``: average tensors with peers in small, changing groups.

Each :meth:`~DecentralizedAverager.step` finds a group through the DHT
(:class:`~swarmavg.aio.matchmaking.DHTMatchmaker`), runs the butterfly all-reduce over it
(:class:`~swarmavg.aio.allreduce.AllReduceService`), writes the weighted mean into the tensors
in place and moves to new group bits (Moshpit), so that repeated steps mix the whole swarm.

The tensors are copied into flat host buffers (one per dtype) for the round and the result is
copied back under :meth:`~DecentralizedAverager.get_tensors`'s lock, so a training loop that
holds the lock while it updates the tensors never sees a half-written average.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import anyio
import msgpack
import numpy as np
import numpy.typing as npt

from swarmavg._time import get_dht_time
from swarmavg.abc._averaging import AllReduceRunner, Matchmaker, MemberMode
from swarmavg.aio.allreduce import AllReduceService
from swarmavg.aio.matchmaking import DHTMatchmaker
from swarmavg.errors import AllReduceFailed, MatchmakingFailed
from swarmavg.proto.allreduce import FlatLayout, TensorSpec, schema_digest
from swarmavg.proto.matchmaking import next_group_bits, validate_bits

if TYPE_CHECKING:
    import torch

    from swarmavg.aio.dht_facade import DHT
    from swarmavg.identity import PeerID

__all__ = ["AllReduceFailed", "DecentralizedAverager", "MatchmakingFailed", "StepResult"]

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float16", "bfloat16", "float32", "float64"}


@dataclass
class StepResult(Mapping["PeerID", Any]):
    """The outcome of one averaging step: a mapping PeerID -> the metadata each member gathered
    (as hivemind's ``step`` returns), plus what the round did."""

    gathered: dict[PeerID, Any]
    group_id: bytes
    #: the members whose tensors went into the mean (with a positive weight)
    contributors: list[PeerID] = field(default_factory=list)
    total_weight: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0

    def __getitem__(self, peer: PeerID) -> Any:
        return self.gathered[peer]

    def __iter__(self) -> Iterator[PeerID]:
        return iter(self.gathered)

    def __len__(self) -> int:
        return len(self.gathered)

    @property
    def group_size(self) -> int:
        return len(self.gathered)


def _spec_of(tensor: torch.Tensor) -> TensorSpec:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise TypeError(f"averaged tensors must be floating point, not {tensor.dtype}")
    return TensorSpec(tuple(tensor.shape), dtype)


class DecentralizedAverager:
    """Averages ``averaged_tensors`` with other peers under ``prefix`` (async API).

    Parameters keep hivemind's names and meaning (see ``docs/``): ``prefix``,
    ``target_group_size``, ``min_group_size``, ``initial_group_bits``, ``averaging_expiration``
    (the longest a peer waits for its group to fill, not a wait), ``request_timeout``,
    ``averaging_alpha``, ``part_size_bytes``, ``allreduce_timeout`` (finite by default),
    ``bandwidth``, ``min_vector_size``, ``auxiliary``, ``client_mode`` (default: the DHT's).
    ``matchmaker`` and ``allreduce`` replace the DHT matchmaker and the butterfly all-reduce
    (:class:`swarmavg.abc.Matchmaker`, :class:`swarmavg.abc.AllReduceRunner`).

    Use as ``async with DecentralizedAverager(tensors, dht, ...) as averager:``; the DHT must be
    running (``async with swarmavg.aio.DHT(...)``) and outlive the averager.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        target_group_size: int,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        averaging_expiration: float = 15.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int = 1 << 20,
        allreduce_timeout: float | None = 60.0,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        client_mode: bool | None = None,
        matchmaker: Matchmaker | None = None,
        allreduce: AllReduceRunner | None = None,
    ) -> None:
        if isinstance(averaged_tensors, Mapping) or not isinstance(averaged_tensors, Sequence):
            raise TypeError("averaged_tensors must be a sequence of tensors")
        self._tensors = list(averaged_tensors)
        self.specs = tuple(_spec_of(t) for t in self._tensors)
        self.layout = FlatLayout(self.specs)
        for name, value in (
            ("averaging_expiration", averaging_expiration),
            ("request_timeout", request_timeout),
        ):
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if allreduce_timeout is not None and not allreduce_timeout > 0:
            raise ValueError(
                f"allreduce_timeout must be positive or None, not {allreduce_timeout!r}"
            )
        if not 0 < averaging_alpha <= 1:
            raise ValueError(f"averaging_alpha must be in (0, 1], not {averaging_alpha!r}")
        if not (isinstance(part_size_bytes, int) and part_size_bytes >= 1024):
            raise ValueError(f"part_size_bytes must be an int >= 1024, not {part_size_bytes!r}")
        self.dht = dht
        self.prefix = prefix
        self.averaging_expiration = float(averaging_expiration)
        self.request_timeout = float(request_timeout)
        self.averaging_alpha = float(averaging_alpha)
        self.part_size_bytes = part_size_bytes
        self.allreduce_timeout = allreduce_timeout
        self.min_vector_size = min_vector_size
        client = dht.client_mode if client_mode is None else client_mode
        self.mode = (
            MemberMode.AUX if auxiliary else MemberMode.CLIENT if client else MemberMode.NODE
        )
        self._bits = validate_bits(initial_group_bits)
        self.allreduce = allreduce
        self.matchmaker = matchmaker or DHTMatchmaker(
            dht.dht_node,
            prefix=prefix,
            schema=schema_digest(self.specs),
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            request_timeout=request_timeout,
            mode=self.mode,
            bandwidth=bandwidth,
        )
        self._lock = threading.Lock()  # the tensors' lock (get_tensors); also taken by threads
        self._step_lock = anyio.Lock()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self.allreduce is None:
            self.allreduce = AllReduceService.for_node(self.dht.node)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop taking part (serving join requests). Idempotent."""
        if not self._closed:
            self._closed = True
            self.matchmaker.close()

    # -- tensors and bits ------------------------------------------------------------------------

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked: averaging results are not written while it is held
        (update them in place inside the block)."""
        with self._lock:
            yield self._tensors

    def get_group_bits(self) -> str:
        """This peer's current group key bits (without the prefix)."""
        return self._bits

    def set_group_bits(self, bits: str) -> None:
        self._bits = validate_bits(bits)

    def _to_buffers(self) -> list[npt.NDArray[Any]]:
        buffers = [
            np.empty(size, dtype=np.float32 if dtype == "bfloat16" else dtype)
            for dtype, size in self.layout.buffers
        ]
        with self._lock:
            for tensor, spec, (buffer, offset) in zip(
                self._tensors, self.specs, self.layout.places, strict=True
            ):
                flat = tensor.detach().reshape(-1)
                if spec.dtype == "bfloat16":
                    flat = flat.float()
                buffers[buffer][offset : offset + spec.numel] = flat.cpu().numpy()
        return buffers

    def _from_buffers(self, buffers: list[npt.NDArray[Any]]) -> None:
        import torch

        with self._lock, torch.no_grad():
            for tensor, spec, (buffer, offset) in zip(
                self._tensors, self.specs, self.layout.places, strict=True
            ):
                values = torch.from_numpy(buffers[buffer][offset : offset + spec.numel])
                tensor.copy_(values.view(tensor.shape).to(tensor.dtype))

    # -- stepping --------------------------------------------------------------------------------

    async def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        scheduled_time: float | None = None,
    ) -> StepResult:
        """Find a group and average with it.

        :param gather: metadata (msgpack-serializable) to share with the group; the result maps
            each member's PeerID to what it gathered.
        :param weight: this peer's weight in the mean (default 1; 0 takes the mean without
            contributing; auxiliary peers always 0).
        :param timeout: seconds to get into a group, retries included (default:
            ``averaging_expiration`` plus ``request_timeout``).
        :param allow_retries: look again (until ``timeout``) when a group fails to form.
        :param scheduled_time: DHT time by which the group should begin (default: now +
            ``averaging_expiration``, or the end of ``timeout`` if sooner).
        :raises MatchmakingFailed: no group formed in time.
        :raises AllReduceFailed: the group formed but the average was not computed.
        """
        if self._closed:
            raise RuntimeError("the averager is closed")
        weight = 1.0 if weight is None else float(weight)
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be a finite number >= 0, not {weight!r}")
        if self.mode is MemberMode.AUX:
            weight = 0.0
        try:
            gathered_bytes: bytes = msgpack.packb(gather, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"gather must be msgpack-serializable: {exc}") from None
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        budget = self.averaging_expiration + self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        async with self._step_lock:
            started = time.perf_counter()
            while True:
                left = deadline - time.monotonic()
                begin_at = get_dht_time() + min(self.averaging_expiration, max(left, 0.0))
                if scheduled_time is not None:
                    begin_at = min(begin_at, scheduled_time)
                try:
                    with anyio.fail_after(max(left, 0.0) + self.request_timeout):
                        info = await self.matchmaker.look_for_group(
                            self._bits, gather=gathered_bytes, begin_at=begin_at
                        )
                    break
                except (MatchmakingFailed, TimeoutError) as exc:
                    if not allow_retries or time.monotonic() >= deadline:
                        raise MatchmakingFailed(f"no group within {budget} s: {exc}") from None
            matched = time.perf_counter()
            buffers = self._to_buffers()
            if self.allreduce is None:
                raise RuntimeError("enter the averager first: `async with averager:`")
            outcome = await self.allreduce.run(
                info.group,
                buffers,
                self.layout,
                weight=weight,
                part_size=max(1, self.part_size_bytes // 4),
                averaging_alpha=self.averaging_alpha,
                min_vector_size=self.min_vector_size,
                timeout=self.allreduce_timeout,
            )
            if self.mode is not MemberMode.AUX and outcome.contributors:
                self._from_buffers(buffers)
            members = info.group.members
            me = info.group.index_of(self.dht.peer_id)
            self._bits = next_group_bits(self._bits, info.group.group_id, me, len(members))
            finished = time.perf_counter()
        return StepResult(
            gathered={peer: _unpack_gathered(peer, raw) for peer, raw in info.gathered.items()},
            group_id=info.group.group_id,
            contributors=[members[i].peer_id for i in outcome.contributors],
            total_weight=outcome.total_weight,
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            matchmaking_seconds=matched - started,
            allreduce_seconds=finished - matched,
        )


def _unpack_gathered(peer: PeerID, raw: bytes) -> Any:
    """A member's gathered metadata; ``None`` (and a warning) if it does not decode: another
    peer's garbage must not fail our step after the average was taken."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        logger.warning("the metadata %s gathered does not decode: %s", peer.short(), exc)
        return None
