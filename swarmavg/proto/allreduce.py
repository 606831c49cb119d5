"""The arithmetic of a butterfly all-reduce (sans-IO): who reduces what, in which parts, and the
weighted mean of a part.

In a group of ``n`` members averaging the same tensors, every tensor is flattened into one long
vector (one buffer per dtype: :class:`FlatLayout`), the vector is cut into one *span* per member
(:func:`load_balance`, sized by each member's bandwidth), and each member *reduces* its span: it
receives every sender's values of that span in *parts* (:func:`plan_parts`, at most
``part_size`` elements each, never across a dtype buffer), computes the weighted mean of each
part (:class:`PartReducer`) and sends it back to everyone. Nothing here does I/O; the runner in
:mod:`swarmavg.aio` moves the parts.

Load balancing
--------------
With ``V`` elements in all, a member reducing ``a`` of them receives ``(s - 1)·a`` values from
the other ``s - 1`` senders and sends ``V - a`` of its own, then sends ``(n - 1)·a`` results and
receives ``V - a``: about ``2·((n - 2)·a + V)`` values through a link of bandwidth ``b``. The
split that makes the slowest member fastest gives each member the same time, so
``(n - 2)·a + V`` is proportional to ``b``; members whose share would be negative (too slow to
help) or under ``min_vector_size`` reduce nothing and the others share their part (water
filling). Members with bandwidth 0 (client-mode peers, which nobody can dial) reduce nothing; a
bandwidth of ``None`` means "the mean of the others'".

Bandwidths within a factor of :data:`SAME_BANDWIDTH` (2) of the median of the group's
(positive) ones count as that median. A measured bandwidth is noisy, and the split above
amplifies differences (at ``n = 8`` a member 8% above the others reduces ~18% more than they
do, and the round waits for it): on ``wan`` with 8 peers of equal links, splitting by
measurements 12.1-13.9 MB/s made rounds ~6% slower than the even split. Where the CPU, not a
link, bounds the transfers (loopback, a fast LAN), the measurements of equal peers differ by up
to 2x from round to round (177-379 MB/s in one round of 4 on loopback), and a split that follows
them feeds back: the member given more to reduce keeps the others waiting on it and so measures
the fastest stretch, its estimate grows, and it gets more (on loopback, 4 peers, 64 MiB: one
member came to reduce twice the others' share within 10 rounds, measured at 1047 MB/s against
440-514, and rounds took 0.33 s instead of 0.22 s). Differences that matter (a 1 Gbit/s peer
among 50 Mbit/s ones: 110 and 6 MB/s measured on the lab) are far outside it and kept as they
are.

No member reduces more than ``max_share`` (:data:`MAX_SHARE`, 2) even shares of the vector,
whatever bandwidth it announces: a bandwidth is the member's own word, and one that claims a
huge bandwidth would otherwise reduce everything, and so set every mean.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import statistics
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgpack
import numpy as np
import numpy.typing as npt

from swarmavg.compression import AdaptiveCompression, CompressionBase, TensorInfo

if TYPE_CHECKING:
    from swarmavg.abc._averaging import Group
    from swarmavg.identity import PeerID

__all__ = [
    "MAX_SHARE",
    "MAX_WEIGHT",
    "PACING_MARGIN",
    "PACING_MAX_PEERS",
    "PACING_MAX_RATE",
    "PACING_MIN_BYTES",
    "SAME_BANDWIDTH",
    "AccumulatorPool",
    "FlatLayout",
    "NonFiniteValues",
    "OverflowingValues",
    "Part",
    "PartReducer",
    "TensorSpec",
    "check_tensor_infos",
    "load_balance",
    "numpy_dtype",
    "pacing_plan",
    "part_codecs",
    "plan_parts",
    "schema_digest",
    "schema_text",
]

#: The largest weight a member may give its values (a step's ``weight``, a sender's
#: ``AvgBegin``, a reducer's ``AvgWeights``): weights count samples, and no batch is near 1e9;
#: a larger one is a bad argument here and a breach from a groupmate.
MAX_WEIGHT: Final = 1e9

#: The most a member reduces, in even shares of the vector (``vector_size / group size``),
#: whatever bandwidth it announces: a member that claims a huge bandwidth would otherwise
#: reduce the whole vector, and set every mean (no other member's ``clip_norm`` would apply).
MAX_SHARE: Final = 2.0

#: dtypes that can be averaged, and what their weighted sums accumulate in.
_ACCUMULATE: Final = {
    "float16": np.float32,
    "bfloat16": np.float32,  # (a buffer of it is kept as float32 by the averager)
    "float32": np.float32,
    "float64": np.float64,
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one averaged tensor looks like: its shape and dtype name (``"float32"``, ...)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _ACCUMULATE:
            choices = ", ".join(sorted(_ACCUMULATE))
            raise TypeError(f"tensors of dtype {self.dtype} cannot be averaged (only {choices})")
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"a shape is a tuple of non-negative ints, not {self.shape!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def schema_digest(specs: Sequence[TensorSpec]) -> bytes:
    """A short digest of the tensors' shapes and dtypes, in order: groups form only among peers
    whose digests are equal."""
    packed = msgpack.packb([[list(s.shape), s.dtype] for s in specs], use_bin_type=True)
    return hashlib.sha256(b"swarmavg/schema/1" + packed).digest()[:16]


def schema_text(specs: Sequence[TensorSpec], limit: int = 160) -> str:
    """The tensors' shapes and dtypes in a few words, for error messages:
    ``"3 tensors, 1,050 values: float32[10,100], float32[50], float64[0]"`` (cut at ``limit``
    characters)."""
    total = sum(spec.numel for spec in specs)
    head = f"{len(specs)} tensor{'s' if len(specs) != 1 else ''}, {total:,} values"
    items = ", ".join(f"{s.dtype}[{','.join(map(str, s.shape))}]" for s in specs)
    text = f"{head}: {items}" if items else head
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor lives in the flat vector: tensors of one dtype are laid out one after
    the other in that dtype's buffer, buffers in order of first appearance; the vector is the
    buffers one after the other."""

    specs: tuple[TensorSpec, ...]
    #: (dtype, numel) of each buffer, in vector order
    buffers: tuple[tuple[str, int], ...] = field(init=False)
    #: (buffer index, offset in it) of each tensor
    places: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        order: dict[str, int] = {}
        sizes: list[int] = []
        places = []
        for spec in self.specs:
            index = order.setdefault(spec.dtype, len(order))
            if index == len(sizes):
                sizes.append(0)
            places.append((index, sizes[index]))
            sizes[index] += spec.numel
        object.__setattr__(self, "buffers", tuple(zip(order, sizes, strict=True)))
        object.__setattr__(self, "places", tuple(places))

    @property
    def numel(self) -> int:
        return sum(size for _, size in self.buffers)

    def buffer_start(self, index: int) -> int:
        """Where buffer ``index`` starts in the vector."""
        return sum(size for _, size in self.buffers[:index])


#: bandwidths within this factor of the group's median count as the median (see the module
#: docstring, "Load balancing")
SAME_BANDWIDTH: Final = 2.0


def load_balance(
    vector_size: int,
    bandwidths: Sequence[float | None],
    min_vector_size: int = 0,
    max_share: float | None = MAX_SHARE,
) -> list[int]:
    """How many elements of a ``vector_size`` vector each member reduces (sums to
    ``vector_size``; see the module docstring), each at most ``max_share`` even shares
    (``vector_size / len(bandwidths)``; at least an even share of the members that can reduce,
    so that the vector is covered; ``None``: no cap).

    :raises ValueError: if no member can reduce (all bandwidths 0) while there is something to
        reduce, or an argument is out of range.
    """
    if vector_size < 0 or min_vector_size < 0:
        raise ValueError("vector_size and min_vector_size must be non-negative")
    _check_max_share(max_share)
    n = len(bandwidths)
    if n == 0:
        raise ValueError("a group has at least one member")
    known = [b for b in bandwidths if b is not None]
    for b in known:
        if not (b >= 0 and math.isfinite(b)):
            raise ValueError(f"a bandwidth is a finite number >= 0, not {b!r}")
    default = sum(known) / len(known) if known and sum(known) > 0 else 1.0
    bw = [default if b is None else float(b) for b in bandwidths]
    positive = [b for b in bw if b > 0]
    if positive:  # (within the noise of a measurement: the same)
        median = statistics.median(positive)
        bw = [
            median if b > 0 and median <= b * SAME_BANDWIDTH and b <= median * SAME_BANDWIDTH else b
            for b in bw
        ]
    fastest = max(bw)
    if fastest > 0:  # only ratios matter; this keeps the arithmetic finite
        bw = [b / fastest for b in bw]
    active = [i for i in range(n) if bw[i] > 0]
    if vector_size == 0:
        return [0] * n
    if not active:
        raise ValueError("no member of the group can reduce: every bandwidth is 0")
    while True:
        shares = _equal_time_shares(vector_size, n, [bw[i] for i in active])
        small = [
            i
            for i, share in zip(active, shares, strict=True)
            if share <= 0 or share < min_vector_size
        ]
        if not small or len(active) == 1:
            break
        # drop the slowest of those that fell short (the last on ties), and solve again
        active.remove(min(small, key=lambda i: (bw[i], -i)))
    full = [shares[active.index(i)] if i in active else 0.0 for i in range(n)]
    if max_share is not None:
        # (over every member that can reduce, also those too slow to get a share: a member
        # that claims a huge bandwidth makes all the others look too slow)
        able = [i for i in range(n) if bw[i] > 0]
        _cap(full, able, bw, max(max_share * vector_size / n, vector_size / len(able)))
    return _round_to_total(full)


def _check_max_share(max_share: object) -> None:
    if max_share is not None and (
        isinstance(max_share, bool)
        or not isinstance(max_share, int | float)
        or not 1 <= max_share < math.inf
    ):
        raise ValueError(f"max_share must be None or a number >= 1, not {max_share!r:.40}")


def _cap(shares: list[float], able: list[int], bandwidths: list[float], cap: float) -> None:
    """Hold every share to ``cap`` (at least the mean share of ``able``), in place: what is
    cut goes to the members of ``able`` under it in proportion to their bandwidths (water
    filling; a share given this way may be under ``min_vector_size``)."""
    while True:
        over = [i for i in able if shares[i] > cap]
        if not over:
            return
        excess = sum(shares[i] - cap for i in over)
        for i in over:
            shares[i] = cap
        under = [i for i in able if shares[i] < cap]
        room = sum(bandwidths[i] for i in under)
        for i in under:
            shares[i] += excess * bandwidths[i] / room


def _equal_time_shares(vector_size: int, n: int, bandwidths: list[float]) -> list[float]:
    """Shares of the active members that give each the same transfer time (may be negative)."""
    total = sum(bandwidths)
    if n <= 2:  # every member moves the whole vector whatever its share: split by bandwidth
        return [vector_size * b / total for b in bandwidths]
    k = len(bandwidths)
    # (n - 2)·a_i + V = c·b_i for the active ones, Σ a_i = V
    c = (vector_size * (n - 2) + k * vector_size) / total
    return [(c * b - vector_size) / (n - 2) for b in bandwidths]


def _round_to_total(shares: list[float]) -> list[int]:
    """Round to ints that keep the total (largest remainders first)."""
    total = round(sum(shares))
    floors = [math.floor(s) for s in shares]
    missing = total - sum(floors)
    by_remainder = sorted(range(len(shares)), key=lambda i: (floors[i] - shares[i], i))
    for i in by_remainder[:missing]:
        floors[i] += 1
    return floors


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a span: elements ``[start, stop)`` of buffer ``buffer`` (``start``/``stop``
    are offsets in that buffer); ``reducer`` is the member that reduces it, ``index`` its place
    in the reducer's list of parts."""

    reducer: int
    index: int
    buffer: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_parts(layout: FlatLayout, span_sizes: Sequence[int], part_size: int) -> list[list[Part]]:
    """The parts of each member's span (member ``i`` reduces the ``i``-th span of the vector,
    of ``span_sizes[i]`` elements), each at most ``part_size`` elements and inside one buffer."""
    if part_size < 1:
        raise ValueError(f"part_size must be >= 1, not {part_size}")
    if sum(span_sizes) != layout.numel:
        raise ValueError(f"the spans cover {sum(span_sizes)} elements, not {layout.numel}")
    plans: list[list[Part]] = []
    bounds = []  # (vector start, buffer index) of each buffer
    at = 0
    for index, (_, size) in enumerate(layout.buffers):
        bounds.append((at, index, size))
        at += size
    position = 0
    for member, span in enumerate(span_sizes):
        parts: list[Part] = []
        end = position + span
        for buffer_start, buffer, size in bounds:
            lo = max(position, buffer_start)
            hi = min(end, buffer_start + size)
            for start in range(lo, hi, part_size):
                stop = min(start + part_size, hi)
                parts.append(
                    Part(member, len(parts), buffer, start - buffer_start, stop - buffer_start)
                )
        plans.append(parts)
        position = end
    return plans


class NonFiniteValues(ValueError):
    """Values to average (or a mean) hold NaN or an infinity."""


class OverflowingValues(NonFiniteValues):
    """Values to average are finite but so large (times their weight) that the sum of a part
    could overflow its dtype (see :class:`PartReducer`)."""


class PartReducer:
    """The weighted mean of one part over the senders expected to contribute to it.

    Values arrive as numpy arrays of the part's dtype (float16 ones are widened); the weighted
    sum accumulates in float32 (float64 for float64 parts) in one pass per contribution
    (``acc += w·x`` in cache-sized chunks), without per-element Python.

    The sum cannot overflow, so the mean is finite whatever finite values and weights (at most
    :data:`MAX_WEIGHT`) the senders send: a contribution is refused (:class:`OverflowingValues`,
    blaming its sender alone) if ``w·max|x|`` reaches half the accumulation dtype's largest
    value divided by the number of senders, or (float32 and float64, which accumulate in their
    own dtype) if its values reach half their dtype's largest value. The accepted
    contributions then sum to at most half the accumulator's range, and their mean (a weighted
    average: at most the largest ``|x|``, up to rounding) stays inside the values' range:
    float16's widened to float32 up to its own largest value, the others up to half of it. The
    bound ``max|x|`` costs nothing extra: it is the square root of the sum of squares that
    checks the values are finite (one dot product, see :func:`_magnitude`).

    :param out: where to accumulate (``size`` elements of the accumulation dtype, any content):
        a slice of one array allocated for a whole span saves an allocation per part.
    """

    def __init__(
        self,
        size: int,
        dtype: str,
        senders: Sequence[int],
        out: npt.NDArray[np.floating] | None = None,
    ) -> None:
        if dtype not in _ACCUMULATE:
            raise TypeError(f"cannot reduce dtype {dtype}")
        self.size = size
        self.dtype = dtype
        accumulate = _ACCUMULATE[dtype]
        if out is None:
            out = np.empty(size, dtype=accumulate)
        elif out.shape != (size,) or out.dtype != accumulate:
            raise ValueError(f"out must be {size} {np.dtype(accumulate)}, not {out.dtype}")
        self._accumulator: npt.NDArray[np.floating] = out
        self._empty = True  # nothing accumulated yet (the accumulator holds garbage)
        self.expected = frozenset(senders)
        #: the bounds of the class docstring: on one value (none where the sum is wider than
        #: the values: float16's mean is at most its largest value), on one sender's w·max|x|
        held = numpy_dtype(dtype)
        largest = float(np.finfo(out.dtype).max)
        self._max_value = (
            math.inf if out.dtype.itemsize > held.itemsize else float(np.finfo(held).max) / 2
        )
        self._max_product = largest / 2 / max(len(self.expected), 1)
        self.received: set[int] = set()
        self.total_weight = 0.0

    @property
    def done(self) -> bool:
        """Whether every expected sender contributed."""
        return self.received >= self.expected

    def add(
        self,
        sender: int,
        values: npt.NDArray[np.floating],
        weight: float,
        max_norm: float | None = None,
    ) -> bool:
        """Add ``sender``'s values with ``weight`` (>= 0, at most :data:`MAX_WEIGHT`), scaled
        down to an L2 norm of ``max_norm`` first if they are longer.

        :returns: whether the values were clipped.
        :raises NonFiniteValues: the values hold NaN or an infinity (nothing is added).
        :raises OverflowingValues: they are too large to add (nothing is added; see the class
            docstring).
        :raises ValueError: an unexpected or repeated sender, a wrong size or a bad weight.
        """
        if sender not in self.expected:
            raise ValueError(f"member {sender} does not send this part")
        if sender in self.received:
            raise ValueError(f"member {sender} already sent this part")
        if values.shape != (self.size,):
            raise ValueError(f"a part of {self.size} values, got shape {values.shape}")
        if not (0 <= weight <= MAX_WEIGHT):  # (also NaN)
            raise ValueError(f"a weight is a number from 0 to {MAX_WEIGHT:g}, not {weight!r}")
        if max_norm is not None and not (max_norm >= 0 and math.isfinite(max_norm)):
            raise ValueError(f"max_norm is a finite number >= 0, not {max_norm!r}")
        clipped = False
        accumulator = self._accumulator
        if (
            weight > 0
            and self.size
            and max_norm is None
            and values.dtype == accumulator.dtype
            and not self._empty
        ):
            self._add_checked(sender, values, weight)  # (the usual case, in one pass)
            self.received.add(sender)
            self.total_weight += weight
            return False
        if weight > 0 and self.size:
            magnitude = _magnitude(values)
            if math.isfinite(magnitude) and max_norm is not None:
                norm = _norm(values)
                if norm > max_norm:
                    scale = max_norm / norm
                    values = (values * scale).astype(self._accumulator.dtype)
                    magnitude *= scale
                    clipped = True
            self._check_magnitude(sender, magnitude, weight)
        self.received.add(sender)
        if weight > 0 and self.size:
            if self._empty:
                np.copyto(accumulator, values)
                if weight != 1.0:
                    accumulator *= weight
            elif weight == 1.0 and values.dtype == accumulator.dtype:
                np.add(accumulator, values, out=accumulator)
            else:
                _add_scaled(accumulator, values, weight)
            self._empty = False
        if weight > 0:
            self.total_weight += weight
        return clipped

    def _add_checked(self, sender: int, values: npt.NDArray[np.floating], weight: float) -> None:
        """``acc += weight · values`` with the checks of :meth:`add` fused in, chunk by chunk:
        each chunk is checked (finite, not too large: the same per-element bounds) and then
        added while it is still in the CPU's cache, so the values are read from memory once,
        not once for the check and once for the sum. A chunk that fails takes back what the
        chunks before it added (exact up to rounding) and raises as :meth:`add` does."""
        accumulator = self._accumulator
        size = self.size
        step = _CHUNK
        scratch = None if weight == 1.0 else np.empty(min(step, size), accumulator.dtype)
        added = 0
        try:
            for start in range(0, size, step):
                stop = min(start + step, size)
                chunk = values[start:stop]
                self._check_magnitude(sender, _magnitude(chunk), weight)
                target = accumulator[start:stop]
                if scratch is None:
                    np.add(target, chunk, out=target)
                else:
                    product = scratch[: stop - start]
                    np.multiply(chunk, weight, out=product)
                    np.add(target, product, out=target)
                added = stop
        except NonFiniteValues:
            if added:
                _add_scaled(accumulator[:added], values[:added], -weight)
            raise

    def _check_magnitude(self, sender: int, magnitude: float, weight: float) -> None:
        """Refuse values whose largest ``|x|`` is ``magnitude`` (see :func:`_magnitude`) with
        ``weight``: non-finite, or too large for the sum (the class docstring's bounds)."""
        if not math.isfinite(magnitude):
            raise NonFiniteValues(f"member {sender} sent non-finite values")
        if magnitude >= self._max_value or weight * magnitude >= self._max_product:
            raise OverflowingValues(
                f"member {sender} sent values too large to average (up to {magnitude:.3g}"
                f" with weight {weight:g}: the sum of the part could overflow)"
            )

    def add_nothing(self, sender: int) -> None:
        """``sender`` takes part with weight 0 and sends no values.

        :raises ValueError: an unexpected or repeated sender.
        """
        if sender not in self.expected:
            raise ValueError(f"member {sender} does not send this part")
        if sender in self.received:
            raise ValueError(f"member {sender} already sent this part")
        self.received.add(sender)

    def result(self) -> npt.NDArray[np.floating] | None:
        """``Σ wᵢ·xᵢ / Σ wᵢ`` over the senders so far (in the accumulation dtype), or ``None``
        if their total weight is 0 (then every member keeps its local values). Divides in
        place: call it once, when :attr:`done`."""
        if self.total_weight == 0:
            return None
        mean: npt.NDArray[np.floating] = np.divide(
            self._accumulator, self.total_weight, out=self._accumulator
        )
        return mean


class AccumulatorPool:
    """Accumulators recycled from round to round, so that a round does not page-fault fresh
    memory in: a new span-sized array costs a page fault (and the kernel zeroing the page) per
    4 KiB or 2 MiB page on its first write, which on a VM cost ~4% of a round's CPU (perf, N=4
    peers, 16 Mi float32).

    :meth:`take` hands out an uninitialised array; when the last reference to it (or to any
    view of it, wherever and in whatever thread) goes away, its memory returns to the pool. An
    array still referenced (a mean being sent, a result someone keeps) is thus never reused.

    :param max_cached: bytes of free memory kept for reuse; a block that would exceed it is freed.
    """

    def __init__(self, max_cached: int = 512 << 20) -> None:
        if max_cached < 0:
            raise ValueError(f"max_cached must be >= 0, not {max_cached}")
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self._cached = 0
        self._max_cached = max_cached
        self._lock = threading.Lock()
        #: arrays handed out from recycled memory / from fresh memory
        self.reused = 0
        self.made = 0

    @property
    def cached_bytes(self) -> int:
        """Bytes of free memory held for reuse."""
        return self._cached

    def take(self, size: int, dtype: npt.DTypeLike) -> npt.NDArray[np.floating]:
        """An uninitialised array of ``size`` elements of ``dtype``."""
        dt = np.dtype(dtype)
        nbytes = size * dt.itemsize
        if nbytes == 0:
            return np.empty(size, dt)
        block = None
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                block = free.pop()
                self._cached -= nbytes
        if block is None:
            block = np.empty(nbytes, np.uint8)
            self.made += 1
        else:
            self.reused += 1
        # The array's base is a memoryview of ``holder``, which numpy does not look through:
        # every view of the array keeps the array, hence ``holder``, alive; the finalizer runs
        # once all of them are gone.
        holder = block[:]
        weakref.finalize(holder, self._give_back, block)
        return np.frombuffer(memoryview(holder), dtype=dt, count=size)  # type: ignore[arg-type]

    def _give_back(self, block: npt.NDArray[np.uint8]) -> None:
        with self._lock:
            if self._cached + block.nbytes <= self._max_cached:
                self._free.setdefault(block.nbytes, []).append(block)
                self._cached += block.nbytes

    def clear(self) -> None:
        """Free the memory held for reuse."""
        with self._lock:
            self._free.clear()
            self._cached = 0


#: Elements per chunk of :func:`_add_scaled` (its scratch stays in the CPU's L2 cache).
_CHUNK: Final = 1 << 15


def _add_scaled(
    accumulator: npt.NDArray[np.floating], values: npt.NDArray[np.floating], weight: float
) -> None:
    """``accumulator += weight * values``, chunk by chunk through a small scratch array, so
    that the product never makes a full-size temporary (a pass through memory)."""
    scratch = np.empty(min(_CHUNK, len(values)), dtype=accumulator.dtype)
    for start in range(0, len(values), _CHUNK):
        stop = min(start + _CHUNK, len(values))
        product = scratch[: stop - start]
        np.copyto(product, values[start:stop])  # (widens float16 fast; ufuncs cast slowly)
        product *= weight
        np.add(accumulator[start:stop], product, out=accumulator[start:stop])


def _norm(values: npt.NDArray[np.floating]) -> float:
    """The L2 norm of finite ``values``, in float64 when float32's sum of squares overflows."""
    with np.errstate(over="ignore"):
        squares = float(np.dot(values, values))
    if not math.isfinite(squares):
        wide = values.astype(np.float64)
        squares = float(np.dot(wide, wide))
    return math.sqrt(squares)


#: The exponent bits of an IEEE half: all set for inf and nan.
_F16_EXPONENT: Final = 0x7C00


def _magnitude(values: npt.NDArray[np.floating]) -> float:
    """An upper bound of ``max |x|`` over ``values`` (not finite if a value is not), in one
    vectorized pass without a full-size temporary where the values are small enough: the L2
    norm bounds every element, and its square is the dot product that :func:`_all_finite` uses
    (float32's accumulates in float32, rounded by well under 1% for a part: 1.01 covers it);
    only a sum of squares that overflowed takes the exact, slower way. float16's is exact,
    from the largest magnitude's bits (numpy's float16 reductions are scalar and slow)."""
    if values.size == 0:
        return 0.0
    if values.dtype == np.float16:
        largest = int(np.bitwise_and(values.view(np.uint16), 0x7FFF).max())
        if largest >= _F16_EXPONENT:
            return math.inf
        return float(np.array(largest, np.uint16).view(np.float16))
    with np.errstate(over="ignore", invalid="ignore"):
        squares = float(np.dot(values, values))
    if math.isfinite(squares):
        return math.sqrt(squares) * 1.01
    if not bool(np.isfinite(values).all()):
        return math.inf
    return float(max(values.max(), -values.min()))


def _all_finite(values: npt.NDArray[np.floating]) -> bool:
    """Whether every value is finite, in one vectorized pass without a temporary array: a sum
    (of squares, for float32: BLAS's dot product runs 2.5x as fast as numpy's sum, 33 vs
    85 us per 2 MiB here) is finite when every value is (inf and nan propagate); only a sum
    that overflowed (or a vector that holds a non-finite value) takes the exact, slower
    check. float16 (whose numpy reductions are scalar: ~1 ms per 512K values) is checked
    exactly on its bits instead: a value is inf or nan when its 5 exponent bits are all set
    (~40 us)."""
    if values.dtype == np.float16:
        exponents = np.bitwise_and(values.view(np.uint16), _F16_EXPONENT)
        return bool(exponents.max(initial=0) < _F16_EXPONENT)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.dot(values, values) if values.dtype == np.float32 else np.add.reduce(values)
        if math.isfinite(total):
            return True
    return bool(np.isfinite(values).all())


# -- pacing ---------------------------------------------------------------------------------------


#: Pacing (see ``pacing_plan``): each connection's cap is this times its share of our upload
#: rate. None above: the rate is a peak measurement, already a little above what the link
#: sustains, and caps 10% higher let the connections drift apart again (docs/design/averaging.md).
PACING_MARGIN: Final = 1.0
#: ... only in rounds where we send at least this much (bytes) to at least two members...
PACING_MIN_BYTES: Final = 16 << 20
#: ... and to at most this many: with more connections to share an upload, the flows came out
#: even enough by themselves, and caps cost more at the round's end than they saved (on the
#: network lab, 8% at 6 peers and 9% at 8; docs/design/averaging.md).
PACING_MAX_PEERS: Final = 3
#: ... and only at upload rates (bytes/s) up to this (400 Mbit/s): above it the round is
#: bound by the CPU, not by a shared queue at the access link, and a paced connection costs
#: more CPU per byte (the kernel's timers and smaller bursts). On loopback (2 CPUs, 4 peers,
#: 64 MiB) paced rounds took 0.37 s against 0.21 s unpaced; on the lab's 1 Gbit/s ``lan``
#: paced connections cost ~25% more CPU per byte (docs/design/averaging.md).
PACING_MAX_RATE: Final = 50e6


def pacing_plan(
    group: Group,
    me: int,
    layout: FlatLayout,
    plans: Sequence[Sequence[Part]],
    sends_values: bool,
    upload_rate: float | None,
) -> dict[PeerID, float]:
    """The pacing cap (bytes/s) of our connection to each member this round sends to: our
    ``upload_rate`` split in proportion to what we send each (our values of its span, and
    the means of our span it receives), times ``PACING_MARGIN``; empty (no pacing) without
    a rate or with one over ``PACING_MAX_RATE``, with fewer than two or more than
    ``PACING_MAX_PEERS`` members to send to, or under ``PACING_MIN_BYTES`` in all.

    Why: the connections of one upload share one queue (at the access link, usually
    first-in first-out), and TCP's congestion control does not share it evenly: on the
    network lab one of a host's three connections ran at about twice the rate of the others
    for whole rounds, and the means of the last parts waited for the slowest one. Capped at
    their share, they all finish together."""
    if upload_rate is None or not 0 < upload_rate <= PACING_MAX_RATE:
        return {}
    itemsizes = [numpy_dtype(dtype).itemsize for dtype, _ in layout.buffers]

    def nbytes(parts: Sequence[Part]) -> int:
        return sum(part.size * itemsizes[part.buffer] for part in parts)

    means = nbytes(plans[me])
    senders = set(group.senders)
    carried: dict[PeerID, int] = {}
    for index, member in enumerate(group.members):
        if index == me:
            continue
        amount = (nbytes(plans[index]) if sends_values else 0) + (means if index in senders else 0)
        if amount > 0:
            carried[member.peer_id] = amount
    total = sum(carried.values())
    if not 2 <= len(carried) <= PACING_MAX_PEERS or total < PACING_MIN_BYTES:
        return {}
    return {peer: PACING_MARGIN * upload_rate * amount / total for peer, amount in carried.items()}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a flat buffer of dtype ``name`` is held in (bfloat16 as float32)."""
    return np.dtype(np.float32 if name == "bfloat16" else name)


# -- compression: each part's codec ---------------------------------------------------------------


def part_codecs(
    layout: FlatLayout,
    parts: Sequence[Part],
    compression: CompressionBase | AdaptiveCompression,
    tensor_infos: Sequence[TensorInfo] | None = None,
) -> list[CompressionBase]:
    """The codec of each part: ``compression`` itself, or what an adaptive ``compression``
    chooses for the tensor that holds most of the part's elements (the first one on a tie),
    described by its ``tensor_infos`` entry (default: role ``unspecified``, its size)."""
    if isinstance(compression, CompressionBase):
        return [compression] * len(parts)
    infos = check_tensor_infos(layout, tensor_infos)
    offsets: dict[int, list[int]] = {}
    tensors: dict[int, list[int]] = {}
    for t, (buffer, offset) in enumerate(layout.places):
        offsets.setdefault(buffer, []).append(offset)
        tensors.setdefault(buffer, []).append(t)
    chosen: dict[int, CompressionBase] = {}
    codecs = []
    for part in parts:
        starts, ids = offsets[part.buffer], tensors[part.buffer]
        i = max(bisect.bisect_right(starts, part.start) - 1, 0)
        best, most = ids[i], -1
        while i < len(starts) and starts[i] < part.stop:
            t = ids[i]
            overlap = min(part.stop, starts[i] + layout.specs[t].numel) - max(part.start, starts[i])
            if overlap > most:
                best, most = t, overlap
            i += 1
        if best not in chosen:
            chosen[best] = compression.choose(infos[best])
        codecs.append(chosen[best])
    return codecs


def check_tensor_infos(
    layout: FlatLayout, tensor_infos: Sequence[TensorInfo] | None
) -> Sequence[TensorInfo]:
    if tensor_infos is None:
        return [TensorInfo(size=spec.numel) for spec in layout.specs]
    if len(tensor_infos) != len(layout.specs) or not all(
        isinstance(info, TensorInfo) for info in tensor_infos
    ):
        raise ValueError(f"tensor_infos must hold one TensorInfo per tensor ({len(layout.specs)})")
    return tensor_infos
