"""State sharing's wire messages (``avg.state``, a server-stream call) and their checks.

A donor serves *snapshots* of its state: the tensors, each as its raw bytes or (with
``state_compression``) as a compressed tensor's data, scales and codebook, concatenated into one
*payload*. The payload is cut into blocks of ``block_size`` bytes; the header carries every
block's SHA-256 and ``checksum``, the SHA-256 of those digests (a two-level hash tree): a taker
verifies each block as it arrives, so a bad block is pinned on the donor that sent it.

One call (:class:`StateRequest`):

* ``snapshot=b""``: the donor answers with the :class:`StateHeader` of a recent snapshot (taken
  for this call, or shared with a call of the last seconds), then the payload's bytes
  ``[start, stop)`` as :class:`StateChunk` messages; ``stop=-1`` (the default) is the end, so
  ``StateRequest(prefix)`` downloads everything in one call, and ``stop=0`` asks the header
  alone (a *probe*).
* ``snapshot=<id>`` (the header's ``snapshot``): no header, the bytes ``[start, stop)`` of that
  snapshot, which the donor keeps for a while after each call: ranges of one snapshot can be
  fetched over several calls, from several donors whose snapshots have the same id.

A taker checks a header with :func:`check_header` before it allocates anything and a range
with :func:`check_range`; both raise :class:`StateDownloadFailed` (a :class:`ValueError`) for
anything out of bounds. Sans-IO.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
from numpy.typing import NDArray  # runtime import: the codec resolves the annotations

from swarmavg.compression import codec_names
from swarmavg.errors import SwarmError
from swarmavg.proto.codec import Message, message

__all__ = [
    "DIGEST_SIZE",
    "DTYPE_SIZES",
    "MAX_BLOCKS",
    "MAX_SNAPSHOT_ID",
    "MAX_TENSORS",
    "Segment",
    "StateChunk",
    "StateDownloadFailed",
    "StateHeader",
    "StateLayout",
    "StateRequest",
    "block_digests",
    "check_header",
    "check_range",
    "snapshot_id",
    "split_ranges",
]

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
#: dtypes a codec may encode (the others always travel raw)
CODED_DTYPES: Final = frozenset({"float16", "float32", "float64"})
#: Tensors a header may announce.
MAX_TENSORS: Final = 1 << 16
MAX_NDIM: Final = 32
#: Blocks a header may announce (their digests travel in the header: 32 bytes each).
MAX_BLOCKS: Final = 1 << 13
#: The longest snapshot id a request may name.
MAX_SNAPSHOT_ID: Final = 64
DIGEST_SIZE: Final = 32


class StateDownloadFailed(SwarmError, ValueError):
    """A donor's answer was refused (garbage, over the limits, a wrong checksum)."""


@message("avg.state_request")
@dataclass(frozen=True, slots=True)
class StateRequest(Message):
    """Send me the payload bytes ``[start, stop)`` (``stop=-1``: to the end) of the state of
    the averager under ``prefix``: of the snapshot ``snapshot`` (no header), or, if empty, of a
    recent one, after its header."""

    prefix: str
    snapshot: bytes = b""
    start: int = 0
    stop: int = -1


@message("avg.state_header")
@dataclass(frozen=True, slots=True)
class StateHeader(Message):
    """A snapshot: ``metadata`` (msgpack), each tensor's ``dtypes`` name and ``shapes``,
    ``total_bytes`` of payload, the SHA-256 of each ``block_size`` bytes of it
    (``block_digests``, concatenated), ``checksum`` (the SHA-256 of ``block_digests``), the
    ``snapshot`` id to ask ranges of it with, and per tensor its ``encodings``: ``(codec,
    codec block size, data bytes, scales bytes, codebook bytes)``, codec ``""`` for the raw
    bytes (empty: every tensor raw)."""

    metadata: bytes
    dtypes: list[str]
    shapes: list[list[int]]
    total_bytes: int
    checksum: bytes
    snapshot: bytes = b""
    block_size: int = 0
    block_digests: bytes = b""
    encodings: tuple[tuple[str, int, int, int, int], ...] = ()


@message("avg.state_chunk")
@dataclass(frozen=True, slots=True, eq=False)
class StateChunk(Message):
    """The payload's bytes from ``offset`` on: a 1-D ``uint8`` array."""

    offset: int
    data: NDArray[Any]


@dataclass(frozen=True, slots=True)
class Segment:
    """One tensor's place in the payload: ``[offset, offset + size)``; ``codec`` ``""`` for
    raw bytes, else the compressed tensor's ``parts`` sizes (data, scales, codebook)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    size: int
    raw_size: int
    codec: str = ""
    codec_block: int = 0
    parts: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """A checked header: the tensors' segments, the payload size, the blocks."""

    segments: tuple[Segment, ...]
    total: int
    raw_total: int
    block_size: int
    digests: tuple[bytes, ...]

    def block_range(self, index: int) -> tuple[int, int]:
        start = index * self.block_size
        return start, min(start + self.block_size, self.total)


def block_digests(payload: Sequence[memoryview | bytes], block_size: int) -> list[bytes]:
    """The SHA-256 of each ``block_size`` bytes of the concatenation of ``payload``."""
    if block_size < 1:
        raise ValueError(f"a block size of {block_size}")
    digests = []
    digest = hashlib.sha256()
    filled = 0
    for part in payload:
        view = memoryview(part).cast("B")
        taken = 0
        while taken < len(view):
            n = min(len(view) - taken, block_size - filled)
            digest.update(view[taken : taken + n])
            taken, filled = taken + n, filled + n
            if filled == block_size:
                digests.append(digest.digest())
                digest, filled = hashlib.sha256(), 0
    if filled:
        digests.append(digest.digest())
    return digests


def snapshot_id(header: StateHeader) -> bytes:
    """A digest of everything a header says about its snapshot (but the id itself): two donors
    whose ids are equal serve the same bytes."""
    fields = [
        header.metadata,
        header.dtypes,
        header.shapes,
        header.total_bytes,
        header.checksum,
        header.block_size,
        [list(e) for e in header.encodings],
    ]
    return hashlib.sha256(msgpack.packb(fields, use_bin_type=True)).digest()


def check_header(header: StateHeader, max_bytes: int) -> StateLayout:
    """The header's layout, if it is consistent and within bounds: at most ``max_bytes`` of
    tensors (decoded), every encoded tensor no larger than its raw bytes, the block digests
    matching the checksum.

    :raises StateDownloadFailed: otherwise (before anything the header announces is allocated).
    """
    n = len(header.dtypes)
    if n != len(header.shapes) or n > MAX_TENSORS:
        raise StateDownloadFailed("the header's dtypes and shapes do not match")
    if header.encodings and len(header.encodings) != n:
        raise StateDownloadFailed("the header's encodings do not match its tensors")
    if len(header.checksum) != DIGEST_SIZE:
        raise StateDownloadFailed("the header's checksum is not a SHA-256 digest")
    if len(header.snapshot) > MAX_SNAPSHOT_ID:
        raise StateDownloadFailed("the header's snapshot id is too long")
    known = set(codec_names())
    segments = []
    offset = raw_total = 0
    for i, (dtype, shape) in enumerate(zip(header.dtypes, header.shapes, strict=True)):
        if dtype not in DTYPE_SIZES:
            raise StateDownloadFailed(f"unsupported dtype {dtype[:32]!r}")
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise StateDownloadFailed("a malformed shape")
        raw = DTYPE_SIZES[dtype] * math.prod(shape)  # (Python ints: no overflow)
        raw_total += raw
        if raw_total > max_bytes:
            raise StateDownloadFailed(f"the state is over the limit ({max_bytes} bytes)")
        codec, codec_block, data, scales, codebook = (
            header.encodings[i] if header.encodings else ("", 0, raw, 0, 0)
        )
        parts = (data, scales, codebook)
        size = data + scales + codebook
        if min(parts) < 0 or size > raw:
            raise StateDownloadFailed(f"tensor {i}'s encoding is larger than its raw bytes")
        if codec == "":
            if size != raw or codec_block != 0:
                raise StateDownloadFailed(f"tensor {i} is raw but not {raw} bytes")
        elif codec not in known or dtype not in CODED_DTYPES:
            raise StateDownloadFailed(f"tensor {i}: no codec {codec[:32]!r} for {dtype}")
        segments.append(Segment(dtype, tuple(shape), offset, size, raw, codec, codec_block, parts))
        offset += size
    if offset != header.total_bytes:
        raise StateDownloadFailed(
            f"the header announces {header.total_bytes} bytes, its tensors hold {offset}"
        )
    block = header.block_size
    if offset and block <= 0:
        raise StateDownloadFailed(f"a block size of {block} for {offset} bytes")
    blocks = -(-offset // block) if offset else 0
    if blocks > MAX_BLOCKS or len(header.block_digests) != DIGEST_SIZE * blocks:
        raise StateDownloadFailed(f"the header does not hold {blocks} block digests")
    if hashlib.sha256(header.block_digests).digest() != header.checksum:
        raise StateDownloadFailed("the checksum does not match the block digests")
    digests = tuple(
        header.block_digests[i : i + DIGEST_SIZE]
        for i in range(0, len(header.block_digests), DIGEST_SIZE)
    )
    return StateLayout(tuple(segments), offset, raw_total, max(block, 1), digests)


def check_range(start: int, stop: int, total: int) -> tuple[int, int]:
    """``[start, stop)`` within a payload of ``total`` bytes (``stop=-1``: ``total``)."""
    if stop == -1:
        stop = total
    if not 0 <= start <= stop <= total:
        raise StateDownloadFailed(f"the range [{start}, {stop}) is not within [0, {total})")
    return start, stop


def split_ranges(total: int, block_size: int, blocks_per_range: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ranges of ``blocks_per_range`` whole blocks (the last shorter)."""
    step = max(1, block_size) * max(1, blocks_per_range)
    return [(start, min(start + step, total)) for start in range(0, total, step)]
