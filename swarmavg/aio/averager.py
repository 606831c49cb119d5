"""``swarmavg.aio.DecentralizedAverager``: average tensors with peers in small, changing groups.

Each :meth:`~DecentralizedAverager.step` finds a group through the DHT
(:class:`~swarmavg.aio.matchmaking.DHTMatchmaker`), runs the butterfly all-reduce over it
(:class:`~swarmavg.aio.allreduce.AllReduceService`), writes the weighted mean into the tensors
in place and moves to new group bits (Moshpit), so that repeated steps mix the whole swarm.

The all-reduce works on one flat buffer per dtype. Where a dtype's tensors are one plain
contiguous CPU tensor (float16/32/64), or views that lie back to back in one storage in the
order given (keep the parameters in one flat tensor to get this), that buffer is their own
memory: the round reads and writes the tensors in place, without a copy in or out (a copy of
64 MiB in and out was a fifth of a round's time on loopback), and holds
:meth:`~DecentralizedAverager.get_tensors`'s lock from its start until its results are written
(as hivemind does): a training thread that wants the tensors meanwhile waits for the average.
If such a round fails, the parts of the vector it averaged before the failure keep their
averages. Other tensors are copied into flat host buffers for the round (under the lock) and
the results are copied back under it, so a training loop that holds the lock while it updates
the tensors never sees a half-written average (updates it makes during the round are
overwritten where the round averaged).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import secrets
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self, overload

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgpack
import numpy as np
import numpy.typing as npt

from swarmavg._step import AveragingStage, StepResult, _check_weight  # (re-exported here)
from swarmavg._time import get_dht_time
from swarmavg.abc._averaging import (
    AllReduceResult,
    AllReduceRunner,
    Group,
    Matchmaker,
    MemberMode,
)
from swarmavg.aio.allreduce import AllReduceService
from swarmavg.aio.matchmaking import DHTMatchmaker
from swarmavg.aio.state import (
    DEFAULT_MAX_DONORS,
    DEFAULT_MAX_STATE_SIZE,
    StateLoad,
    StateSharer,
    _check_priority,
    load_state,
)
from swarmavg.compression import (
    AdaptiveCompression,
    CompressionBase,
    ErrorFeedback,
    NoCompression,
    TensorInfo,
)
from swarmavg.errors import AllReduceFailed, MatchmakingFailed, NonFiniteTensors
from swarmavg.metrics import AveragerCounter, AveragerMetrics, step_failure_cause
from swarmavg.proto.allreduce import (
    MAX_SHARE,
    FlatLayout,
    TensorSpec,
    _all_finite,
    numpy_dtype,
    schema_digest,
    schema_text,
)
from swarmavg.proto.bandwidth import BandwidthEstimator
from swarmavg.proto.butterfly import RoundConfig
from swarmavg.proto.group_search import Admission
from swarmavg.proto.matchmaking import next_group_bits, validate_bits

if TYPE_CHECKING:
    import torch

    from swarmavg.aio.dht_facade import DHT
    from swarmavg.identity import PeerID

__all__ = [
    "AllReduceFailed",
    "AveragingStage",
    "DecentralizedAverager",
    "MatchmakingFailed",
    "StateLoad",
    "StepControl",
    "StepResult",
]

logger = logging.getLogger(__name__)

#: The largest results (bytes) of an in-place round that are copied when the caller takes the
#: tensors back, so that groupmates can still fetch parts they missed (see get_tensors).
_RELAY_COPY_MAX = 1 << 30
#: How long closing waits for the steps it cancelled to withdraw and tell their groupmates.
_CLOSE_TIMEOUT = 2.0
#: Tensors larger than this (bytes in all) are checked for NaN/inf in a worker thread.
_CHECK_IN_THREAD = 1 << 22
#: Bounds of the automatic part size (elements).
_MIN_PART = 1 << 18
_MAX_PART = 1 << 22
#: A part (one message) is never larger than this, automatic or given: under half of a
#: connection's default stream window (16 MiB). A larger message is sent only when no other
#: one as large is in flight on the connection (swarmavg_tcp), and two members that each
#: send the other large parts and answer the other's with large means then wait on each
#: other for good (2 peers, 64 MiB, 8 MiB parts: every round ran into its reducer timeout).
_MAX_PART_BYTES = 4 << 20
#: ... and its lower bound where the announced bandwidths make it smaller (``_PART_TAIL``).
_MIN_SLOW_PART = 1 << 16
#: Every this many rounds with a measured bandwidth, one is not paced (see ``_upload_rate``).
_PROBE_EVERY = 8
#: The automatic part size keeps a reducer's last answer to everyone within about this long
#: (seconds) at the slowest member's announced bandwidth...
_PART_TAIL = 0.4
#: ... counting only announced bandwidths of at least this (bytes/s): smaller ones are taken
#: for ratios (``bandwidth=`` only needs the right ratios), which say nothing about time.
_MIN_RATE = 1e5

_TORCH_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def _averaged_tensors(tensors: object) -> list[torch.Tensor]:
    """``averaged_tensors`` as a list: any iterable of tensors (a list, ``model.parameters()``).

    :raises TypeError: not an iterable of tensors (the message names the first item that is
        not one, by its index), or a single tensor or a mapping.
    :raises ValueError: no tensors at all.
    """
    import torch

    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            "averaged_tensors must be an iterable of tensors, not a single tensor: pass [tensor]"
        )
    if isinstance(tensors, Mapping):
        raise TypeError(
            "averaged_tensors must be an iterable of tensors, not a mapping: pass its .values()"
        )
    if isinstance(tensors, str | bytes) or not isinstance(tensors, Iterable):
        raise TypeError(
            f"averaged_tensors must be an iterable of tensors, not {type(tensors).__name__}"
        )
    listed = list(tensors)
    for index, tensor in enumerate(listed):
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor)
            hint = " (torch.from_numpy(array) makes one)" if kind.__module__ == "numpy" else ""
            raise TypeError(
                f"averaged_tensors[{index}] is a {kind.__module__}.{kind.__qualname__}, "
                f"not a torch.Tensor{hint}"
            )
    if not listed:
        raise ValueError("averaged_tensors is empty: there is nothing to average")
    return listed


def _spec_of(index: int, tensor: torch.Tensor) -> TensorSpec:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise TypeError(
            f"averaged_tensors[{index}] is {tensor.dtype}: averaged tensors must be floating "
            f"point ({', '.join(sorted(_TORCH_DTYPES))})"
        )
    return TensorSpec(tuple(tensor.shape), dtype)


def _check_dht(dht: object) -> None:
    """:raises TypeError: ``dht`` is not a :class:`swarmavg.aio.DHT`."""
    from swarmavg.aio.dht_facade import DHT

    if isinstance(dht, DHT):
        return
    hint = ""
    if type(dht).__module__ == "swarmavg.dht":
        hint = " (the synchronous swarmavg.DHT goes with swarmavg.DecentralizedAverager)"
    raise TypeError(f"dht must be a swarmavg.aio.DHT, not {type(dht).__name__}{hint}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {value!r:.64}")


def _check_number(name: str, value: object) -> float:
    """``value`` as a float. :raises TypeError: not an int or float (a bool is neither)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {value!r:.64}")
    return float(value)


def _check_count(name: str, value: object, *, minimum: int) -> int:
    """:raises TypeError: not an int (a bool is none). :raises ValueError: below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r:.64}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, not {value!r}")
    return value


@overload
def _check_seconds(name: str, value: object, *, optional: Literal[False] = False) -> float: ...
@overload
def _check_seconds(name: str, value: object, *, optional: Literal[True]) -> float | None: ...
def _check_seconds(name: str, value: object, *, optional: bool = False) -> float | None:
    """``value`` as a positive, finite number of seconds (``None`` if ``optional``).

    :raises TypeError: not a number (a bool is none). :raises ValueError: not positive or
        not finite."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        either = " or None" if optional else ""
        raise TypeError(f"{name} must be a number of seconds{either}, not {value!r:.64}")
    if not (value > 0 and math.isfinite(value)):
        either = " or None" if optional else ""
        raise ValueError(
            f"{name} must be a positive, finite number of seconds{either}, not {value!r}"
        )
    return float(value)


_NO_COMPRESSION = NoCompression()


def _cpu_memory(tensor: torch.Tensor) -> npt.NDArray[Any] | None:
    """A plain, contiguous CPU tensor's memory as a flat numpy array (``None`` for any other
    tensor). Copies between the tensors and the flat buffers go through it where they can:
    numpy copies on one thread, where torch's ``copy_`` splits a large copy over its
    intra-op threads, which costs 1.6x the CPU (7.6 instead of 4.8 ms of CPU per 64 MiB
    here), and averaging runs beside training, or beside the other peers of a machine."""
    import torch

    if (
        tensor.layout != torch.strided
        or tensor.device.type != "cpu"
        or tensor.dtype not in (torch.float32, torch.float64, torch.float16)
        or not tensor.is_contiguous()
        or tensor.is_neg()
    ):
        return None
    return tensor.detach().numpy().reshape(-1)


def _written(tensor: torch.Tensor) -> None:
    """numpy wrote into ``tensor``: bump the version counter it shares with its views, as
    ``copy_`` would, so that autograd still catches a backward through values that changed
    under it (an in-place op on an empty view; inference tensors have no counter)."""
    if not tensor.is_inference():
        tensor.detach().view(-1)[:0].zero_()


def _version(tensor: torch.Tensor) -> int:
    return -1 if tensor.is_inference() else tensor._version


class _InPlace:
    """A round that averages some of the tensors in place (their memory is its buffers)."""

    def __init__(
        self,
        averager: DecentralizedAverager,
        buffers: list[npt.NDArray[Any] | None],
        tensors: list[torch.Tensor],
        epoch: int,
    ) -> None:
        self.averager = averager
        self.buffers = buffers
        self.tensors = tensors
        self.epoch = epoch
        #: the tensors' versions when the round gave them back (``None`` while it holds them)
        self.versions: list[int] | None = None
        self.ended = False

    def results_valid(self) -> bool:
        """Whether the tensors still hold the round's results: nobody entered
        ``get_tensors`` nor changed them with torch since (writes through other views, such as
        ``.data`` or numpy, outside ``get_tensors`` are not seen)."""
        averager = self.averager
        if averager._closed or averager._tensors_epoch != self.epoch:
            return False
        versions = self.versions
        if versions is None:
            return not self.ended  # (held by the round; or it ended without seeing them)
        return versions == [_version(tensor) for tensor in self.tensors]


class DecentralizedAverager:
    """Averages ``averaged_tensors`` with other peers under ``prefix`` (async API).

    ``averaged_tensors`` is any iterable of floating-point tensors (a list, or
    ``model.parameters()``), read once. Parameters keep hivemind's names and meaning (see
    ``docs/``): ``prefix``, ``target_group_size`` (a group begins as soon as it has this many
    members), ``min_group_size`` (a group begins at its declared time if it has at least this
    many; default ``min(2, target_group_size)``, at most ``target_group_size``),
    ``initial_group_bits``, ``averaging_expiration``
    (the longest a peer waits for its group to fill, not a wait; ``min_matchmaking_time`` is
    hivemind 1.1's name for it, accepted instead), ``request_timeout``,
    ``averaging_alpha``, ``part_size_bytes`` (default ``None``: chosen from the tensors' size and
    the group's; a number must be the same on every peer; at most 4 MiB are used, one message),
    ``allreduce_timeout`` (finite by
    default), ``sender_timeout`` and ``reducer_timeout`` (a member silent that long is done
    without, its part kept local; default a quarter and a half of ``allreduce_timeout``),
    ``clip_norm`` (each contribution this peer reduces is scaled down to this L2 norm over the
    whole vector, part by part; off by default),
    ``bandwidth`` (bytes/s, what the vector is split by among a group's members; default
    ``None``: measured from the rounds this peer takes part in and announced once known, see
    :attr:`measured_bandwidth`), ``min_vector_size``, ``max_share`` (a member reduces at most
    this many even shares of the vector whatever bandwidth it announces, default 2: one that
    claims a huge bandwidth would otherwise set every mean; ``None``: no cap; the same on every
    peer), ``auxiliary``, ``client_mode`` (default:
    the DHT's). ``matchmaker`` and ``allreduce`` replace the DHT matchmaker and the butterfly
    all-reduce (:class:`swarmavg.abc.Matchmaker`, :class:`swarmavg.abc.AllReduceRunner`).

    Compression: ``compression`` (a codec of :mod:`swarmavg.compression`, or a chooser such as
    :class:`~swarmavg.compression.SizeAdaptiveCompression` given ``tensor_infos``, one
    :class:`~swarmavg.compression.TensorInfo` per averaged tensor; default: role
    ``unspecified``, the tensor's size). Each part of the all-reduce uses the codec chosen for
    the tensor holding most of its elements. ``error_feedback=True`` keeps what compression
    lost and adds it to the next round's values.

    State sharing (:meth:`load_state_from_peers`): ``allow_state_sharing`` (default ``None``: on
    unless in client mode or auxiliary, as hivemind; a client-mode peer cannot share),
    ``state_sharing_priority`` (donors are tried highest first), ``declare_state_period``
    (seconds between declarations in the DHT, each valid for one period),
    ``next_chunk_timeout`` (a download moves to the next donor when no chunk came in this many
    seconds; default ``request_timeout``), ``max_state_size`` (bytes; larger states are refused
    before anything is allocated), ``state_compression`` (a codec of
    :mod:`swarmavg.compression`, or a chooser given the ``infos`` that
    :meth:`get_current_state` may return, for the float tensors this peer serves; lossy codecs
    allowed; default :class:`~swarmavg.compression.NoCompression`), ``state_max_donors`` (a
    download fetches disjoint ranges from up to this many donors at once, those holding the
    same state as the best-ranked one; default 2, 1 for one donor at a time).

    Use as ``async with DecentralizedAverager(tensors, dht, ...) as averager:``; the DHT must be
    running (``async with swarmavg.aio.DHT(...)``) and outlive the averager.

    :raises TypeError: an argument has the wrong type (a bool where a number is expected, an
        item of ``averaged_tensors`` that is not a floating-point tensor: the message names
        its index); the message names the argument.
    :raises ValueError: an argument is out of range (``min_group_size`` above
        ``target_group_size``, an empty ``averaged_tensors``, a timeout that is not positive
        and finite, ...), or a matchmaker for ``prefix`` already runs on the DHT's node.
    """

    def __init__(
        self,
        averaged_tensors: Iterable[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        target_group_size: int,
        min_group_size: int | None = None,
        initial_group_bits: str = "",
        averaging_expiration: float = 15.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int | None = None,
        allreduce_timeout: float | None = 60.0,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        clip_norm: float | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        max_share: float | None = MAX_SHARE,
        auxiliary: bool = False,
        client_mode: bool | None = None,
        matchmaker: Matchmaker | None = None,
        allreduce: AllReduceRunner | None = None,
        allow_state_sharing: bool | None = None,
        state_sharing_priority: float = 0.0,
        declare_state_period: float = 30.0,
        next_chunk_timeout: float | None = None,
        max_state_size: int = DEFAULT_MAX_STATE_SIZE,
        state_compression: CompressionBase | AdaptiveCompression = _NO_COMPRESSION,
        state_max_donors: int = DEFAULT_MAX_DONORS,
        compression: CompressionBase | AdaptiveCompression = _NO_COMPRESSION,
        tensor_infos: Sequence[TensorInfo] | None = None,
        error_feedback: bool = False,
        min_matchmaking_time: float | None = None,
    ) -> None:
        # Every argument is checked before anything is made (the matchmaker claims the prefix
        # on the node): a bad one raises TypeError/ValueError naming it and leaves nothing.
        self._tensors = _averaged_tensors(averaged_tensors)
        self.specs = tuple(_spec_of(i, t) for i, t in enumerate(self._tensors))
        self.layout = FlatLayout(self.specs)
        _check_dht(dht)
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        target_group_size = _check_count("target_group_size", target_group_size, minimum=1)
        if min_group_size is None:
            min_group_size = min(2, target_group_size)
        else:
            min_group_size = _check_count("min_group_size", min_group_size, minimum=1)
            if min_group_size > target_group_size:
                raise ValueError(
                    f"min_group_size={min_group_size} is larger than "
                    f"target_group_size={target_group_size}"
                )
        if not isinstance(compression, CompressionBase | AdaptiveCompression):
            raise TypeError(f"compression must be a codec or a chooser, not {compression!r:.64}")
        if tensor_infos is not None:
            tensor_infos = list(tensor_infos)
            if len(tensor_infos) != len(self._tensors) or not all(
                isinstance(info, TensorInfo) for info in tensor_infos
            ):
                raise ValueError("tensor_infos must hold one TensorInfo per averaged tensor")
        _check_bool("error_feedback", error_feedback)
        _check_bool("auxiliary", auxiliary)
        if client_mode is not None:
            _check_bool("client_mode", client_mode)
        if min_matchmaking_time is not None:
            if averaging_expiration != 15.0:
                raise ValueError(
                    "pass averaging_expiration or min_matchmaking_time (hivemind 1.1's name for "
                    "it), not both"
                )
            averaging_expiration = _check_seconds("min_matchmaking_time", min_matchmaking_time)
        averaging_expiration = _check_seconds("averaging_expiration", averaging_expiration)
        request_timeout = _check_seconds("request_timeout", request_timeout)
        allreduce_timeout = _check_seconds("allreduce_timeout", allreduce_timeout, optional=True)
        sender_timeout = _check_seconds("sender_timeout", sender_timeout, optional=True)
        reducer_timeout = _check_seconds("reducer_timeout", reducer_timeout, optional=True)
        averaging_alpha = _check_number("averaging_alpha", averaging_alpha)
        if not 0 < averaging_alpha <= 1:
            raise ValueError(f"averaging_alpha must be in (0, 1], not {averaging_alpha!r}")
        if part_size_bytes is not None:
            part_size_bytes = _check_count("part_size_bytes", part_size_bytes, minimum=1024)
        if clip_norm is not None:
            clip_norm = _check_number("clip_norm", clip_norm)
            if not (clip_norm >= 0 and math.isfinite(clip_norm)):
                raise ValueError(
                    f"clip_norm must be a finite number >= 0 or None, not {clip_norm!r}"
                )
        if bandwidth is not None:
            bandwidth = _check_number("bandwidth", bandwidth)
            if not (bandwidth >= 0 and math.isfinite(bandwidth)):
                raise ValueError(
                    f"bandwidth must be a finite number >= 0 or None (unknown), not {bandwidth!r}"
                )
        min_vector_size = _check_count("min_vector_size", min_vector_size, minimum=0)
        if matchmaker is not None and not isinstance(matchmaker, Matchmaker):
            raise TypeError(
                f"matchmaker must be a swarmavg.abc.Matchmaker, not {type(matchmaker).__name__}"
            )
        if allreduce is not None and not isinstance(allreduce, AllReduceRunner):
            raise TypeError(
                f"allreduce must be a swarmavg.abc.AllReduceRunner, not {type(allreduce).__name__}"
            )
        self.compression = compression
        self.tensor_infos = tensor_infos
        self.error_feedback = ErrorFeedback() if error_feedback else None
        self.dht = dht
        self.prefix = prefix
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.averaging_expiration = averaging_expiration
        self.request_timeout = request_timeout
        self.part_size_bytes = part_size_bytes
        quarter = None if allreduce_timeout is None else allreduce_timeout / 4
        #: what every round of this averager runs with (its part size and timeout are set per
        #: round: see ``_part_size`` and the step's deadline)
        self.round_config = RoundConfig(
            timeout=allreduce_timeout,
            sender_timeout=quarter if sender_timeout is None else sender_timeout,
            reducer_timeout=(
                (None if quarter is None else 2 * quarter)
                if reducer_timeout is None
                else reducer_timeout
            ),
            averaging_alpha=averaging_alpha,
            min_vector_size=min_vector_size,
            max_share=max_share,
            clip_norm=clip_norm,
        )
        #: measures our throughput when no ``bandwidth`` was given (see measured_bandwidth)
        self._throughput = BandwidthEstimator() if bandwidth is None else None
        self._measured_bandwidth: float | None = None
        #: pacing (see ``_upload_rate``): the rate of the last round that was not paced, whether
        #: the round running now is, and the rounds since the last one that was not
        self._unpaced_rate: float | None = None
        self._pacing_round = False
        self._paced_rounds = 0
        client = dht.client_mode if client_mode is None else client_mode
        self.mode = (
            MemberMode.AUX if auxiliary else MemberMode.CLIENT if client else MemberMode.NODE
        )
        self._bits = validate_bits(initial_group_bits)
        self._init_state_sharing(  # (checks its arguments before making anything)
            allow_state_sharing,
            state_sharing_priority,
            declare_state_period,
            next_chunk_timeout,
            max_state_size,
            state_compression,
            state_max_donors,
        )
        self.allreduce = allreduce
        self.matchmaker = matchmaker or DHTMatchmaker(
            dht.dht_node,
            prefix=prefix,
            schema=schema_digest(self.specs),
            schema_text=schema_text(self.specs),
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            request_timeout=request_timeout,
            mode=self.mode,
            bandwidth=bandwidth,
        )
        self._lock = threading.Lock()  # the tensors' lock (get_tensors); also taken by threads
        self._step_lock = anyio.Lock()
        self._live: set[StepControl] = set()  # steps in progress (cancelled at close)
        #: flat copies, one per layout buffer (made when first needed: none for a buffer that
        #: is averaged in place)
        self._buffers: list[npt.NDArray[Any] | None] = [None] * len(self.layout.buffers)
        #: entries into get_tensors (a finished round's results in a tensor averaged in place
        #: are relayed to groupmates only while nobody entered it since)
        self._tensors_epoch = 0
        #: the thread of the round that holds the tensors' lock while it averages in place
        self._in_place_thread: int | None = None
        #: the last round that averaged in place (its results may be relayed to groupmates)
        self._last_in_place: _InPlace | None = None
        self._closed = False
        #: what the steps and downloads did (see :attr:`metrics`)
        self._counter = AveragerCounter(prefix)

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start serving the averager's requests (join requests, state downloads).

        :raises RuntimeError: the DHT is not running, or the averager was closed.
        """
        if self._closed:
            raise RuntimeError("this averager was closed")
        if not self.dht.node.is_running:
            raise RuntimeError(
                "the averager's DHT is not running: enter it first "
                "(`async with swarmavg.aio.DHT(...)`) and leave it after the averager"
            )
        if self.allreduce is None:
            self.allreduce = AllReduceService.for_node(self.dht.node)
        self._state_sharer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop taking part: cancel the steps in progress (their groupmates are told, their
        declarations withdrawn, within about a second) and stop serving join requests.
        Idempotent."""
        if not self._closed:
            self._closed = True
            cancelled = [control for control in list(self._live) if control.cancel()]
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
                for control in cancelled:
                    await control._ended.wait()
            self.matchmaker.close()
            self._state_sharer.stop()

    @property
    def metrics(self) -> AveragerMetrics:
        """What this averager did since it was made: steps by outcome, rounds, group sizes,
        bytes, seconds, state shares (see :class:`swarmavg.metrics.AveragerMetrics` and
        ``docs/guides/metrics.md``). A snapshot, consistent when read from any thread."""
        sharer = self._state_sharer
        return self._counter.snapshot(
            state_requests_served=sharer.requests_served,
            state_bytes_served=sharer.bytes_served,
        )

    @property
    def measured_bandwidth(self) -> float | None:
        """This peer's throughput in bytes/s as measured from its all-reduce rounds, which
        it announces as its ``bandwidth`` in matchmaking (see ``docs/design/averaging.md``,
        "Measured bandwidth"); ``None`` until a round large enough to say something completed,
        and always when ``bandwidth`` was given (nothing is measured then)."""
        return self._measured_bandwidth

    def _measure(self, outcome: AllReduceResult) -> None:
        """Take a completed round's transfers into the throughput estimate and announce it."""
        estimator = self._throughput
        if estimator is None:
            return
        if outcome.wire_sent_log or outcome.wire_received_log:  # (the network's view)
            logs = (outcome.wire_sent_log, outcome.wire_received_log)
        else:
            logs = (outcome.sent_log, outcome.received_log)
        if not self._pacing_round:
            self._unpaced_rate = estimator.round_rate(outcome.started, *logs) or self._unpaced_rate
        report = estimator.add_round(outcome.started, *logs)
        estimate = self._measured_bandwidth = estimator.estimate
        if estimate is None:
            return
        if isinstance(self.matchmaker, DHTMatchmaker):
            self.matchmaker.bandwidth = estimate
        if report:
            logger.info(
                "measured bandwidth %.3g MB/s (the median of the last rounds); announced for"
                " load balancing",
                estimate / 1e6,
            )

    def _upload_rate(self) -> float | None:
        """The upload rate (bytes/s) this round's connections are paced by, or ``None`` (not
        paced): the measured bandwidth, or the last unpaced round's rate if higher. A paced
        round cannot measure more than its caps, so that the estimate can rise when the link
        gets faster, every ``_PROBE_EVERY``-th round is not paced (and measures freely)."""
        if self._measured_bandwidth is None or not getattr(self.allreduce, "paces", False):
            return None
        self._paced_rounds += 1
        if self._paced_rounds >= _PROBE_EVERY:
            self._paced_rounds = 0
            return None
        return max(self._measured_bandwidth, self._unpaced_rate or 0.0)

    # -- tensors and bits ------------------------------------------------------------------------

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked: averaging results are not written while it is held
        (update them in place inside the block). While a step averages tensors in place (see
        the module docstring) this waits for the end of its all-reduce.

        :raises RuntimeError: called on the event loop whose step is averaging the tensors in
            place right now (it would wait for itself): await the step first.
        """
        if not self._lock.acquire(blocking=False):
            if self._in_place_thread == threading.get_ident():
                raise RuntimeError(
                    "get_tensors() was called on the event loop while a step of this averager "
                    "is averaging the tensors in place there: it would wait for itself forever; "
                    "await the step (or its control) first"
                )
            self._lock.acquire()
        try:
            last = self._last_in_place
            if last is not None and last.results_valid():
                # the caller may change the tensors: keep what groupmates may still fetch
                keep = getattr(self.allreduce, "keep_results", None)
                if keep is not None:
                    keep([b for b in last.buffers if b is not None], _RELAY_COPY_MAX)
                self._last_in_place = None
            self._tensors_epoch += 1
            yield self._tensors
        finally:
            self._lock.release()

    def get_group_bits(self) -> str:
        """This peer's current group key bits (without the prefix)."""
        return self._bits

    def set_group_bits(self, bits: str) -> None:
        self._bits = validate_bits(bits)

    def _begin_round(self) -> tuple[list[npt.NDArray[Any]], _InPlace | None]:
        """The round's buffers (see :meth:`_to_buffers`) and, when some are the tensors'
        memory, the lock the round now holds on them (released by :meth:`_end_in_place`)."""
        # (blocks the loop while a training thread holds the tensors, as a copy would)
        self._lock.acquire()
        try:
            own = self._in_place_buffers()
            buffers = self._to_buffers(own)
        except BaseException:
            self._lock.release()
            raise
        if all(buffer is None for buffer in own):
            self._lock.release()
            return buffers, None
        # the round reads and writes the tensors: they stay locked until it ends
        self._in_place_thread = threading.get_ident()
        tensors = [
            tensor
            for tensor, (buffer, _) in zip(self._tensors, self.layout.places, strict=True)
            if own[buffer] is not None
        ]
        return buffers, _InPlace(self, own, tensors, self._tensors_epoch)

    def _end_in_place(self, in_place: _InPlace | None) -> None:
        """The round is over with the tensors it averaged in place: tell autograd they
        changed and unlock them. Idempotent."""
        if in_place is None or in_place.ended:
            return
        in_place.ended = True
        try:
            for tensor in in_place.tensors:
                _written(tensor)
            in_place.versions = [_version(tensor) for tensor in in_place.tensors]
            self._last_in_place = in_place
        finally:
            self._in_place_thread = None
            self._lock.release()

    def _in_place_buffers(self) -> list[npt.NDArray[Any] | None]:
        """For each layout buffer, the tensors' own memory where it can be averaged in place
        (else ``None``): the buffer's tensors are plain contiguous CPU tensors of its dtype
        (float16/32/64) that lie back to back in one storage, in the order they were given:
        one flat tensor, or views of one. Only for runners that work in place. Call it holding
        the tensors' lock."""
        if not self.allreduce.in_place:  # type: ignore[union-attr]
            return [None] * len(self.layout.buffers)
        import torch

        found: list[npt.NDArray[Any] | None] = []
        for index, (_dtype, size) in enumerate(self.layout.buffers):
            members = [
                (tensor, offset)
                for tensor, (buffer, offset) in zip(self._tensors, self.layout.places, strict=True)
                if buffer == index
            ]
            memories = [_cpu_memory(tensor) for tensor, _ in members]
            first = memories[0]
            if first is None or size == 0:
                found.append(None)
                continue
            base = first.ctypes.data
            storage = members[0][0].untyped_storage().data_ptr()
            if not all(
                memory is not None
                and memory.ctypes.data == base + offset * first.itemsize
                and tensor.untyped_storage().data_ptr() == storage
                for (tensor, offset), memory in zip(members, memories, strict=True)
            ):
                found.append(None)
                continue
            if len(members) == 1:
                found.append(first)
                continue
            head = members[0][0]
            whole = torch.empty(0, dtype=head.dtype).set_(
                head.untyped_storage(), head.storage_offset(), (size,), (1,)
            )
            found.append(whole.detach().numpy())
        return found

    def _to_buffers(self, in_place: list[npt.NDArray[Any] | None]) -> list[npt.NDArray[Any]]:
        """The buffers of a round: a tensor's memory where it is averaged in place, else a
        flat copy of the tensors' values (the copies are kept from round to round: fresh ones
        would cost a page fault per 4 KiB each round). Call it holding the tensors' lock."""
        import torch

        buffers: list[npt.NDArray[Any]] = []
        for index, (dtype, size) in enumerate(self.layout.buffers):
            own = in_place[index]
            if own is None:
                own = self._buffers[index]
                if own is None:
                    own = np.empty(size, dtype=np.float32 if dtype == "bfloat16" else dtype)
                    self._buffers[index] = own
            buffers.append(own)
        with torch.no_grad():
            # one copy per tensor, whatever its device, dtype (bfloat16 -> float32) or strides
            for tensor, spec, (buffer, offset) in zip(
                self._tensors, self.specs, self.layout.places, strict=True
            ):
                if in_place[buffer] is not None:
                    continue
                flat = buffers[buffer][offset : offset + spec.numel]
                memory = _cpu_memory(tensor)
                if memory is not None and memory.dtype == flat.dtype:
                    np.copyto(flat, memory)
                else:
                    torch.from_numpy(flat).view(tensor.shape).copy_(tensor.detach())
        return buffers

    def _from_buffers(
        self, buffers: list[npt.NDArray[Any]], in_place: list[npt.NDArray[Any] | None]
    ) -> None:
        """Write the round's results into the tensors (those averaged in place hold them
        already: ``in_place`` as given by :meth:`_in_place_buffers`). Call it holding the
        tensors' lock."""
        import torch

        with torch.no_grad():
            for tensor, spec, (buffer, offset) in zip(
                self._tensors, self.specs, self.layout.places, strict=True
            ):
                if in_place[buffer] is not None:
                    continue  # (see _end_in_place)
                memory = _cpu_memory(tensor)
                if memory is not None:
                    np.copyto(memory, buffers[buffer][offset : offset + spec.numel])
                    _written(tensor)
                else:
                    source = torch.from_numpy(buffers[buffer][offset : offset + spec.numel])
                    if tensor.is_inference():  # (written only in inference mode)
                        with torch.inference_mode():
                            tensor.copy_(source.view(tensor.shape))
                    else:  # (not inference_mode(False): it turns grad mode back on)
                        tensor.copy_(source.view(tensor.shape))

    def _move_on(self) -> None:
        """After an attempt found no group: draw new group bits (of the same length, at
        random; they may come out the same) for the next round, so that a peer left alone
        under its key (the groups there filled up without it) does not stay alone there
        round after round (Moshpit would stall). (Within the step, it looks again under the
        prefix's own key: see :meth:`_step_once`.)"""
        if self._bits:
            width = len(self._bits)
            bits = format(secrets.randbits(width), f"0{width}b")
            logger.info("no group under %s: moving to group bits %s", self._bits, bits)
            self._bits = bits

    def _exclude(self, peers: Iterable[PeerID]) -> None:
        """Leave peers that sent us values that would poison the mean (non-finite, too
        large, or with a weight past ``MAX_WEIGHT``) out of our groups for a while (a
        diverged or malicious peer; every groupmate that saw it does the same)."""
        admission = getattr(self.matchmaker, "admission", None)
        if not isinstance(admission, Admission):
            return
        for peer in peers:
            seconds = admission.exclude(
                peer, get_dht_time(), "it sent non-finite or overflowing values"
            )
            logger.warning(
                "peer %s sent non-finite or overflowing values; left out of our groups for %.0f s",
                peer.short(),
                seconds,
            )

    def _part_size(self, group: Group) -> int:
        """Elements per part: ``part_size_bytes / 4``, or automatically about a quarter of a
        span, a power of two between 1 MiB and 4 MiB of float32: enough parts to overlap
        sending, reducing and receiving, few enough that Python's cost per part stays far
        below the data's. On slow links, smaller (down to 256 KiB): a reducer answers a part
        only once every sender delivered it, and its last part to every sender only after
        the last values came, so the part is held to what the slowest member (by the
        bandwidths announced, when they are rates) sends to all in about ``_PART_TAIL``
        seconds. (Every member must use the same: the automatic size depends only on what
        all members share, the tensors and the group.) Never over ``_MAX_PART_BYTES`` of the
        widest dtype, given or not."""
        itemsize = max((numpy_dtype(d).itemsize for d, _ in self.layout.buffers), default=4)
        largest = max(1, _MAX_PART_BYTES // itemsize)
        if self.part_size_bytes is not None:
            return min(max(1, self.part_size_bytes // 4), largest)
        size = len(group.members)
        quarter_span = max(1, self.layout.numel // (4 * size))
        elements = min(max(1 << (quarter_span - 1).bit_length(), _MIN_PART), _MAX_PART, largest)
        rates = [
            m.bandwidth
            for m in group.members
            if m.bandwidth is not None
            and m.bandwidth >= _MIN_RATE
            and m.mode is not MemberMode.CLIENT
        ]
        if rates and size > 1:
            tail = max(1, int(min(rates) * _PART_TAIL / (size - 1) / 4))
            tail = max(1 << (tail.bit_length() - 1), _MIN_SLOW_PART)  # (a power of two <= it)
            elements = min(elements, tail)
        return elements

    # -- state sharing ---------------------------------------------------------------------------

    def _init_state_sharing(
        self,
        allow: bool | None,
        priority: float,
        period: float,
        next_chunk_timeout: float | None,
        max_state_size: int,
        state_compression: CompressionBase | AdaptiveCompression,
        state_max_donors: int,
    ) -> None:
        if allow is None:
            allow = self.mode is MemberMode.NODE
        if not isinstance(allow, bool):
            raise TypeError(f"allow_state_sharing must be a bool or None, not {allow!r}")
        if allow and self.mode is MemberMode.CLIENT:
            raise ValueError(
                "allow_state_sharing=True: a client-mode averager cannot share its state "
                "(it cannot be dialed)"
            )
        period = _check_seconds("declare_state_period", period)
        chunk_timeout = _check_seconds("next_chunk_timeout", next_chunk_timeout, optional=True)
        max_state_size = _check_count("max_state_size", max_state_size, minimum=0)
        if not isinstance(state_compression, CompressionBase | AdaptiveCompression):
            raise TypeError(
                f"state_compression must be a codec or a chooser, not {state_compression!r:.64}"
            )
        state_max_donors = _check_count("state_max_donors", state_max_donors, minimum=1)
        _check_priority(priority)
        self.state_compression = state_compression
        self.state_max_donors = state_max_donors
        self.next_chunk_timeout = self.request_timeout if chunk_timeout is None else chunk_timeout
        self.max_state_size = max_state_size
        self._state_sharer = StateSharer(
            self.dht,
            self.prefix,
            self.get_current_state,
            enabled=allow,
            priority=priority,
            declare_period=period,
            compression=state_compression,
        )

    @property
    def allow_state_sharing(self) -> bool:
        """Whether this peer declares itself in the DHT and serves its state
        (:meth:`get_current_state`) to peers that :meth:`load_state_from_peers`. Settable (on
        the event loop's thread): turning it off withdraws the declaration."""
        return self._state_sharer._enabled

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"allow_state_sharing must be a bool, not {value!r}")
        if value and self.mode is MemberMode.CLIENT:
            raise ValueError("a client-mode averager cannot share its state (it cannot be dialed)")
        self._state_sharer.enabled = value

    @property
    def state_sharing_priority(self) -> float:
        """Takers try donors with a higher priority first. Settable (declared again at once)."""
        return self._state_sharer.priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._state_sharer.priority = value

    async def get_current_state(
        self,
    ) -> tuple[Any, Sequence[torch.Tensor]] | tuple[Any, Sequence[torch.Tensor], Sequence[Any]]:
        """What this peer serves to peers that load its state: ``(metadata, tensors)``, metadata
        anything msgpack serializes, tensors of any shape and of a plain dtype (float, int,
        bool, complex). Override it to share more (an optimizer's state, a step count). It may
        also return ``(metadata, tensors, infos)``: one
        :class:`~swarmavg.compression.TensorInfo` per tensor, for a ``state_compression``
        chooser.

        By default ``(None, copies of the averaged tensors)`` taken under the
        :meth:`get_tensors` lock (in a worker thread, so that a training thread holding the
        lock does not stall the event loop). The tensors returned are sent as they are after
        this returns: return copies, or tensors that do not change during the transfer (else
        the checksum fails and the taker moves on to another donor)."""
        return None, await anyio.to_thread.run_sync(self._copy_tensors)

    def _copy_tensors(self) -> list[torch.Tensor]:
        with self._lock:
            return [tensor.detach().to("cpu", copy=True) for tensor in self._tensors]

    @overload
    async def load_state_from_peers(
        self, wait: Literal[True] = True, timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]] | None: ...

    @overload
    async def load_state_from_peers(
        self, wait: Literal[False], timeout: float | None = None
    ) -> StateLoad: ...

    async def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]] | StateLoad | None:
        """Download the state of a peer that shares it under our prefix: ``(metadata,
        tensors)`` (CPU tensors), or ``None`` when no peer shares it, every donor failed or
        ``timeout`` passed. The averaged tensors are not changed: copy what you need.

        Donors are tried by :attr:`state_sharing_priority`, highest first, never this peer:
        the state is the best-ranked answering donor's, fetched in disjoint ranges at once from
        it and the others among the best ``state_max_donors`` that hold the very same snapshot.
        A donor that fails, sends garbage (checked before allocating, and each block by its
        checksum) or sends no chunk within ``next_chunk_timeout`` seconds is dropped: its
        ranges go to the others, or to the next donors.

        :param timeout: seconds for the whole (``None``: each donor is still bounded by its
            own timeouts).
        :param wait: ``False`` returns a :class:`~swarmavg.aio.state.StateLoad` at once
            (``await`` it for the result).
        """
        if timeout is not None and (
            isinstance(timeout, bool)
            or not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout))
        ):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if self._closed:
            raise RuntimeError("the averager is closed")
        if wait:
            return await self._load_state(timeout)
        load = StateLoad()
        scope = self.dht.node.spawn(load._run, functools.partial(self._load_state, timeout))
        load._canceller = scope.cancel
        return load

    async def _load_state(self, timeout: float | None) -> tuple[Any, list[torch.Tensor]] | None:
        state = None
        self._counter.state_download_started()
        try:
            with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
                state = await load_state(
                    self.dht,
                    self.prefix,
                    chunk_timeout=self.next_chunk_timeout,
                    max_bytes=self.max_state_size,
                    max_donors=self.state_max_donors,
                )
        finally:
            self._counter.state_download_ended(
                None
                if state is None
                else sum(tensor.numel() * tensor.element_size() for tensor in state[1])
            )
        if scope.cancelled_caught:
            logger.warning("loading the state of %s took over %s s", self.prefix, timeout)
        return state

    # -- stepping --------------------------------------------------------------------------------

    @overload
    async def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        wait: Literal[True] = True,
        scheduled_time: float | None = None,
        require_trigger: bool = False,
    ) -> StepResult: ...

    @overload
    async def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        *,
        wait: Literal[False],
        scheduled_time: float | None = None,
        require_trigger: bool = False,
    ) -> StepControl: ...

    async def step(
        self,
        gather: Any = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        wait: bool = True,
        scheduled_time: float | None = None,
        require_trigger: bool = False,
    ) -> StepResult | StepControl:
        """Find a group and average with it.

        :param gather: metadata (msgpack-serializable) to share with the group; the result maps
            each member's PeerID to what it gathered.
        :param weight: this peer's weight in the mean (default 1; 0 takes the mean without
            contributing; auxiliary peers always 0). Can be changed on the
            :class:`StepControl` until the all-reduce begins.
        :param timeout: seconds for the whole step: finding a group, the all-reduce (at most
            ``allreduce_timeout`` of it) and retries; it returns or raises by then, whatever
            the other peers do (time spent waiting for :meth:`StepControl.allow_allreduce`
            does not count). Default: ``averaging_expiration`` plus ``request_timeout`` to
            find a group, then ``allreduce_timeout`` for the all-reduce.
        :param allow_retries: look again (until ``timeout``) when a group fails to form, or
            when its all-reduce fails as a whole (a partial round is not retried: its result
            says what stayed local).
        :param wait: ``False`` returns a :class:`StepControl` at once (the step runs in the
            background; ``await control`` for the result).
        :param scheduled_time: DHT time by which the group should begin (default: now +
            ``averaging_expiration``, or the end of ``timeout`` if sooner; a time already
            past counts as none).
        :param require_trigger: once in a group, wait for :meth:`StepControl.allow_allreduce`
            before averaging (so a peer can find its group while it still computes).
        :raises MatchmakingFailed: no group formed in time (the message says why: too few
            peers, peers with other tensors, peers left out for sending non-finite values).
        :raises AllReduceFailed: the group formed but the average was not computed.
        :raises NonFiniteTensors: our own tensors hold NaN or an infinity (checked before
            looking for a group; a diverged peer must not spread them).
        """
        if wait and require_trigger:
            raise ValueError("require_trigger=True needs wait=False (to call allow_allreduce())")
        control = self._control(gather, weight, timeout, scheduled_time, require_trigger)
        if wait:
            return await self._run_step(control, allow_retries)
        if self.allreduce is None:
            raise RuntimeError("enter the averager first: `async with averager:`")
        scope = self.dht.node.spawn(self._run_in_background, control, allow_retries)
        control._attach(scope.cancel)
        return control

    def _control(
        self,
        gather: Any,
        weight: float | None,
        timeout: float | None,
        scheduled_time: float | None,
        require_trigger: bool,
    ) -> StepControl:
        """Check a step's arguments (in the caller's thread) and make its control."""
        if self._closed:
            raise RuntimeError("the averager is closed")
        weight = 1.0 if weight is None else weight
        _check_weight(weight)
        try:
            gathered: bytes = msgpack.packb(gather, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"gather must be msgpack-serializable: {exc}") from None
        if timeout is not None and not (
            isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)
        ):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if scheduled_time is not None and not (
            isinstance(scheduled_time, int | float) and math.isfinite(scheduled_time)
        ):
            raise ValueError(f"scheduled_time must be a DHT time (seconds), not {scheduled_time!r}")
        if not isinstance(require_trigger, bool):
            raise TypeError(f"require_trigger must be a bool, not {require_trigger!r}")
        budget = self.averaging_expiration + self.request_timeout if timeout is None else timeout
        return StepControl(
            gathered=gathered,
            weight=0.0 if self.mode is MemberMode.AUX else float(weight),
            budget=float(budget),
            bounds_all=timeout is not None,
            scheduled_time=scheduled_time,
            require_trigger=require_trigger,
            auxiliary=self.mode is MemberMode.AUX,
        )

    async def _run_in_background(self, control: StepControl, allow_retries: bool) -> None:
        try:
            control._set_outcome(await self._run_step(control, allow_retries), None)
        except anyio.get_cancelled_exc_class():
            control._set_outcome(None, concurrent.futures.CancelledError("the step was cancelled"))
            raise
        except Exception as exc:
            control._set_outcome(None, exc)

    async def _run_step(self, control: StepControl, allow_retries: bool) -> StepResult:
        if self.allreduce is None:
            raise RuntimeError("enter the averager first: `async with averager:`")
        control._deadline = anyio.current_time() + control.budget
        self._live.add(control)
        self._counter.step_started()
        try:
            async with self._step_lock:
                if self.mode is not MemberMode.AUX:
                    await self._check_finite()
                result = await self._step_locked(control, allow_retries)
            self._counter.step_succeeded()
            return result
        except anyio.get_cancelled_exc_class():
            self._counter.step_failed("cancelled")
            raise
        except BaseException as exc:
            self._counter.step_failed(step_failure_cause(exc))
            raise
        finally:
            self._live.discard(control)
            control._set_stage(AveragingStage.FINISHED)
            control._ended.set()

    async def _check_finite(self) -> None:
        """Refuse to average tensors that hold NaN or an infinity (a diverged peer would spread
        them to every groupmate, and its groupmates would leave it out anyway).

        :raises NonFiniteTensors: naming the tensors.
        """
        if sum(t.numel() * t.element_size() for t in self._tensors) > _CHECK_IN_THREAD:
            bad = await anyio.to_thread.run_sync(self._nonfinite_tensors)
        else:
            bad = self._nonfinite_tensors()
        if not bad:
            return
        described = "; ".join(
            f"tensor {i} ({spec.dtype}[{','.join(map(str, spec.shape))}]): {count:,} of"
            f" {spec.numel:,} values"
            for i, count, spec in ((i, count, self.specs[i]) for i, count in bad[:4])
        )
        more = f" and {len(bad) - 4} more tensors" if len(bad) > 4 else ""
        raise NonFiniteTensors(
            f"{len(bad)} of the {len(self._tensors)} averaged tensors hold NaN or infinite values"
            f" ({described}{more}): not averaging them, since they would spread to every peer"
            " of the group (training diverged? lower the learning rate or clip gradients, or"
            " load_state_from_peers())",
            [i for i, _ in bad],
        )

    def _nonfinite_tensors(self) -> list[tuple[int, int]]:
        """The averaged tensors that hold NaN or an infinity: (index, how many values)."""
        import torch

        bad = []
        with self._lock:
            for index, tensor in enumerate(self._tensors):
                memory = _cpu_memory(tensor)
                if memory is not None and _all_finite(memory):
                    continue
                finite = torch.isfinite(tensor.detach())
                if not bool(finite.all()):
                    bad.append((index, int(finite.numel() - finite.sum())))
        return bad

    async def _step_locked(self, control: StepControl, allow_retries: bool) -> StepResult:
        """Find a group and average in it; with ``allow_retries``, a round that fails as a
        whole (:class:`AllReduceFailed`: nothing averaged, a timeout) is retried in a new
        group while the step's ``timeout`` lasts (the tensors are untouched until a round
        succeeds). The retry looks under the key where the failed group formed: its other
        members look there again too (under the prefix's own key, where leftovers meet, the
        step's group bits would scatter them)."""
        started = anyio.current_time()
        where = [self._bits]  # (set by _step_once to the bits its group formed under)
        while True:
            try:
                return await self._step_once(control, allow_retries, started, where)
            except AllReduceFailed as exc:
                left = control._deadline - anyio.current_time()
                if not allow_retries or left <= 0:
                    raise
                logger.info("%s; looking for another group (%.1f s left)", exc, left)

    async def _step_once(
        self,
        control: StepControl,
        allow_retries: bool,
        started: float,
        where: list[str],
    ) -> StepResult:
        """One attempt: look for a group under ``where[0]`` (then, after no group formed,
        under the prefix's own key) and average in it; ``where[0]`` becomes the bits the
        group formed under."""
        assert self.allreduce is not None
        control._set_stage(AveragingStage.LOOKING_FOR_GROUP)
        bits = where[0]
        counter = self._counter
        while True:
            searching = anyio.current_time()
            left = control._deadline - searching
            now = get_dht_time()
            begin_at = now + min(self.averaging_expiration, max(left, 0.0))
            if control.scheduled_time is not None and control.scheduled_time > now:
                # (one already past would fail every attempt at once until the timeout)
                begin_at = min(begin_at, control.scheduled_time)
            try:
                with anyio.fail_after(max(left, 0.0) + self.request_timeout):
                    info = await self.matchmaker.look_for_group(
                        bits, gather=control.gathered, begin_at=begin_at
                    )
                break
            except (MatchmakingFailed, TimeoutError) as exc:
                counter.group_search_ended(anyio.current_time() - searching, failed=True)
                self._move_on()
                if not allow_retries or anyio.current_time() >= control._deadline:
                    raise MatchmakingFailed(f"no group within {control.budget} s: {exc}") from None
                # Look again while the step's timeout lasts, under the prefix's own key (no
                # bits), where every peer left alone this round under any key looks too.
                bits = ""
            except BaseException as exc:
                cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
                counter.group_search_ended(anyio.current_time() - searching, failed=not cancelled)
                raise
        where[0] = bits
        matched = anyio.current_time()
        counter.group_search_ended(matched - searching, failed=False)
        group = info.group
        counter.round_started(len(group.members))
        in_place: _InPlace | None = None
        begun: float | None = None  # (when the all-reduce began, after any wait for a trigger)
        try:
            if control.require_trigger and not control.triggered:
                self.allreduce.expect(group)
                control._set_stage(AveragingStage.AWAITING_TRIGGER)
                waiting = anyio.current_time()
                await control._wait_for_trigger()
                # (the wait for the caller's trigger does not count against the step's timeout)
                control._deadline += anyio.current_time() - waiting
            begun = anyio.current_time()
            timeout = self.round_config.timeout
            if control.bounds_all:
                left = max(control._deadline - anyio.current_time(), 1e-3)
                timeout = left if timeout is None else min(timeout, left)
            weight = control._begin_allreduce()
            buffers, in_place = self._begin_round()
            compressing: dict[str, Any] = {}  # (left out when off: runners that predate it)
            if not isinstance(self.compression, NoCompression):
                compressing = {
                    "compression": self.compression,
                    "tensor_infos": self.tensor_infos,
                    "error_feedback": self.error_feedback,
                }
            if in_place is not None:
                compressing["results_valid"] = in_place.results_valid
            upload_rate = self._upload_rate()
            self._pacing_round = upload_rate is not None
            if upload_rate is not None:
                compressing["upload_rate"] = upload_rate
            outcome = await self.allreduce.run(
                group,
                buffers,
                self.layout,
                config=dataclasses.replace(
                    self.round_config,
                    part_size=self._part_size(group),
                    timeout=timeout,
                    # (_run_step checked them; a value changed since is refused where it
                    # arrives: our own span's as it is added, the others' by the groupmates)
                    check_values=False,
                ),
                weight=weight,
                **compressing,
            )
            if in_place is not None and self.mode is not MemberMode.AUX and outcome.contributors:
                self._from_buffers(buffers, in_place.buffers)  # (the tensors not in place)
        except anyio.get_cancelled_exc_class():
            counter.round_ended_without_result(
                0.0 if begun is None else anyio.current_time() - begun, failed=False
            )
            self._end_in_place(in_place)
            await self.allreduce.leave(group, "its step was cancelled")
            raise
        except BaseException:
            counter.round_ended_without_result(
                0.0 if begun is None else anyio.current_time() - begun, failed=True
            )
            raise
        finally:
            self._end_in_place(in_place)
        if in_place is None and self.mode is not MemberMode.AUX and outcome.contributors:
            with self._lock:
                self._from_buffers(buffers, [None] * len(buffers))
        members = group.members
        me = group.index_of(self.dht.peer_id)
        self._bits = next_group_bits(self._bits, group.group_id, me, len(members))
        excluded = {members[i].peer_id for i in outcome.nonfinite if i != me}
        self._exclude(excluded)
        finished = anyio.current_time()
        local_spans = [(members[r].peer_id, why) for r, _, why in outcome.local_spans]
        dropped = [
            (members[r].peer_id, members[d].peer_id, why) for r, d, _, why in outcome.dropped
        ]
        assert begun is not None  # (the all-reduce ran)
        counter.round_completed(
            finished - begun,
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            incomplete=bool(local_spans or dropped),
            peers_excluded=len(excluded),
            faults=[why for *_, why in outcome.local_spans] + [why for *_, why in outcome.dropped],
        )
        if local_spans or dropped:
            logger.warning(
                "averaged with %d peers, not completely: %s",
                len(members),
                _faults_in_words(local_spans, dropped, excluded),
            )
        elif not outcome.relayed:  # (a round a peer failed in says little about our link)
            self._measure(outcome)
        return StepResult(
            local_spans=local_spans,
            dropped=dropped,
            relayed=[(members[r].peer_id, members[by].peer_id) for r, _, _, by in outcome.relayed],
            gathered={peer: _unpack_gathered(peer, raw) for peer, raw in info.gathered.items()},
            group_id=group.group_id,
            contributors=[members[i].peer_id for i in outcome.contributors],
            total_weight=outcome.total_weight,
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            matchmaking_seconds=matched - started,
            allreduce_seconds=finished - matched,
        )


def _faults_in_words(
    local_spans: list[tuple[PeerID, str]],
    dropped: list[tuple[PeerID, PeerID, str]],
    excluded: set[PeerID],
) -> str:
    """What the groupmates of an incomplete round did, one clause per peer: ``peer …4L77
    sent non-finite values: left out (3 of 4 parts of the tensors)``. Peers just excluded for
    non-finite values were named in their own line already."""
    clauses = []
    senders: dict[PeerID, tuple[str, int]] = {}
    for _, sender, why in dropped:
        first, count = senders.get(sender, (why, 0))
        senders[sender] = (first, count + 1)
    for sender, (why, count) in senders.items():
        if sender in excluded:
            continue
        by = "one groupmate" if count == 1 else f"{count} groupmates"
        clauses.append(f"peer {sender.short()}'s values were left out by {by} ({why})")
    for reducer, why in local_spans:
        clauses.append(f"peer {reducer.short()}'s share kept our own values ({why})")
    return "; ".join(clauses) or "peers that sent non-finite values were left out"


class StepControl:
    """A step in progress (``step(wait=False)``): its :attr:`stage`, its :attr:`weight`
    (settable until the all-reduce begins), :meth:`allow_allreduce` (for
    ``require_trigger=True``) and :meth:`cancel`. ``await control`` gives the step's result.

    Thread-safe: the sync facade's handle drives it from the training thread while the step
    runs on the event loop.
    """

    def __init__(
        self,
        *,
        gathered: bytes,
        weight: float,
        budget: float,
        scheduled_time: float | None,
        require_trigger: bool,
        auxiliary: bool = False,
        bounds_all: bool = False,
    ) -> None:
        self.gathered = gathered
        self.budget = budget
        #: whether ``budget`` bounds the whole step (a ``timeout`` was given), not only the
        #: search for a group
        self.bounds_all = bounds_all
        #: ``anyio.current_time()`` by which the step must be done (set when it starts)
        self._deadline = math.inf
        self.scheduled_time = scheduled_time
        self.require_trigger = require_trigger
        self._auxiliary = auxiliary
        self._lock = threading.Lock()
        self._stage = AveragingStage.IDLE
        self._weight = weight
        self._triggered = False
        self._wake: Callable[[], None] | None = None  # wakes a step waiting for its trigger
        self._canceller: Callable[[], object] | None = None
        self._done = anyio.Event()
        #: set when the step's task is over (whoever reads its outcome: the sync facade's
        #: handle holds it, not this control)
        self._ended = anyio.Event()
        self._outcome: tuple[StepResult | None, BaseException | None] | None = None

    def __repr__(self) -> str:
        return f"<StepControl {self.stage.value} weight={self._weight}>"

    @property
    def stage(self) -> AveragingStage:
        return self._stage

    @property
    def weight(self) -> float:
        """This peer's weight in the mean; settable until the all-reduce begins."""
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        value = _check_weight(value)
        with self._lock:
            if self._stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED):
                raise RuntimeError(f"the weight cannot change once the step is {self._stage.value}")
            if not self._auxiliary:
                self._weight = value

    @property
    def triggered(self) -> bool:
        """Whether :meth:`allow_allreduce` was called."""
        return self._triggered

    def allow_allreduce(self) -> None:
        """Let the step average as soon as its group formed (``require_trigger=True``; a
        no-op otherwise). Callable from any thread, before or after the group formed."""
        with self._lock:
            self._triggered = True
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()

    def cancel(self) -> bool:
        """Cancel the step; groupmates are told this peer leaves. ``False`` if it already
        finished (or runs in the caller's own task: ``step(wait=True)``)."""
        if self._outcome is not None or self._canceller is None:
            return False
        self._canceller()
        return True

    def done(self) -> bool:
        return self._outcome is not None

    def __await__(self) -> Generator[Any, None, StepResult]:
        return self._result().__await__()

    async def _result(self) -> StepResult:
        await self._done.wait()
        assert self._outcome is not None
        result, error = self._outcome
        if error is not None:
            raise error
        assert result is not None
        return result

    # -- driven by the averager (event-loop thread) -----------------------------------------------

    def _attach(self, cancel: Callable[[], object]) -> None:
        """How :meth:`cancel` cancels the step's task."""
        self._canceller = cancel

    def _set_outcome(self, result: StepResult | None, error: BaseException | None) -> None:
        if self._outcome is None:
            self._outcome = (result, error)
            self._done.set()

    def _set_stage(self, stage: AveragingStage) -> None:
        with self._lock:
            self._stage = stage

    def _begin_allreduce(self) -> float:
        """Enter RUNNING_ALLREDUCE; the weight from now on."""
        with self._lock:
            self._stage = AveragingStage.RUNNING_ALLREDUCE
            return self._weight

    async def _wait_for_trigger(self) -> None:
        event = anyio.Event()
        loop_thread = threading.get_ident()
        token = anyio.lowlevel.current_token()

        def wake() -> None:
            if threading.get_ident() == loop_thread:
                event.set()
            else:
                with contextlib.suppress(RuntimeError):  # the loop is gone
                    anyio.from_thread.run_sync(event.set, token=token)

        with self._lock:
            if self._triggered:
                return
            self._wake = wake
        try:
            await event.wait()
        finally:
            with self._lock:
                self._wake = None


def _unpack_gathered(peer: PeerID, raw: bytes) -> Any:
    """A member's gathered metadata; ``None`` (and a warning) if it does not decode: another
    peer's garbage must not fail our step after the average was taken."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        logger.debug("the metadata %s gathered does not decode: %s", peer.short(), exc)
        return None
