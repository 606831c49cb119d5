"""Length-prefixed framing: the outermost layer of the wire format (sans-IO).

A frame is a 4-byte big-endian unsigned length followed by that many bytes of body::

    +----------------+---------------------------+
    | length (u32be) | body (length bytes)        |
    +----------------+---------------------------+

Every frame has a hard size cap. The sender refuses to announce a body above it
(:class:`~swarmavg.errors.MessageTooLarge`); the receiver rejects such a header as soon as its
four bytes have arrived, before it buffers any of the body
(:class:`~swarmavg.errors.RemoteProtocolError`).

Nothing here does I/O: :func:`encode_frame` returns the buffers to write, and
:class:`FrameDecoder` is fed whatever bytes the transport received and hands back whole frames.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Final

from swarmavg.errors import MessageTooLarge, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FRAME_HEADER_SIZE",
    "MAX_FRAME_SIZE_LIMIT",
    "Buffer",
    "FrameDecoder",
    "buffers_size",
    "encode_frame",
    "encode_frame_header",
]

#: Anything exposing the buffer protocol that can be written to a transport.
Buffer = bytes | bytearray | memoryview

#: Bytes in a frame header: the body length as an unsigned 32-bit big-endian integer.
FRAME_HEADER_SIZE: Final = 4
#: The default cap on a frame body, in bytes (64 MiB).
DEFAULT_MAX_FRAME_SIZE: Final = 64 * 1024 * 1024
#: The largest cap a u32 length can express (4 GiB - 1).
MAX_FRAME_SIZE_LIMIT: Final = 2**32 - 1

_HEADER: Final = struct.Struct(">I")


def _check_cap(max_frame_size: int) -> int:
    if type(max_frame_size) is not int:
        raise TypeError(f"max_frame_size must be an int, not {type(max_frame_size).__name__}")
    if not 0 <= max_frame_size <= MAX_FRAME_SIZE_LIMIT:
        raise ValueError(f"max_frame_size must be in [0, {MAX_FRAME_SIZE_LIMIT}]")
    return max_frame_size


def buffers_size(parts: Sequence[Buffer]) -> int:
    """The total number of bytes in ``parts`` (``memoryview.nbytes``, not ``len``, for views)."""
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


def encode_frame_header(length: int, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """The 4-byte header announcing a body of ``length`` bytes.

    :raises MessageTooLarge: if ``length > max_frame_size``.
    :raises ValueError: if ``length`` is negative or ``max_frame_size`` is out of range.
    :raises TypeError: if either argument is not an ``int``.
    """
    _check_cap(max_frame_size)
    if type(length) is not int:
        raise TypeError(f"length must be an int, not {type(length).__name__}")
    if length < 0:
        raise ValueError("a frame length cannot be negative")
    if length > max_frame_size:
        raise MessageTooLarge(
            f"frame body of {length} bytes exceeds the limit of {max_frame_size} bytes"
        )
    return _HEADER.pack(length)


def encode_frame(
    parts: Sequence[Buffer], max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> list[Buffer]:
    """One frame whose body is the concatenation of ``parts``, as buffers for ``writev``.

    The parts are not copied: the result is ``[header, *parts]``, so they must stay unchanged
    until they have been written.

    :raises MessageTooLarge: if the parts add up to more than ``max_frame_size`` bytes.
    :raises ValueError: if ``max_frame_size`` is out of range.
    """
    return [encode_frame_header(buffers_size(parts), max_frame_size), *parts]


# Theory of operation
# -------------------
# The decoder is a two-state machine fed with arbitrary slices of the byte stream:
#
#   HEADER: collecting the 4 header bytes. A complete header is checked against the cap at once,
#           so an oversized announcement fails after 4 bytes, not after the body has arrived.
#   BODY:   appending to ``_body`` until it holds ``_body_len`` bytes; then the frame is queued
#           and the state returns to HEADER.
#
# ``feed`` runs the machine over all the bytes it is given and queues every completed frame;
# ``next_frame`` only pops the queue. The fast path handles a chunk that holds whole frames
# without any intermediate buffer: it reads each header in place and copies each body once, into
# an immutable ``bytes`` owned by the caller. Only a frame that straddles chunk boundaries goes
# through ``_body``, a ``bytearray`` that grows by appending (amortised linear; on Linux a large
# realloc is an mremap, not a copy). It is never preallocated to the announced length, so a peer
# that sends a 4-byte header claiming 64 MiB costs us nothing until the bytes really arrive.
#
# Frames handed out never alias the caller's input (which a transport may reuse for its next
# receive), and the decoder keeps no reference to them. After a protocol error the decoder is
# dead: every later ``feed`` raises again, because the stream position is lost.


class FrameDecoder:
    """Incremental decoder of length-prefixed frames; no I/O, no clock.

    Usage::

        decoder = FrameDecoder()
        decoder.feed(chunk)                 # any slicing of the stream, any number of times
        while (frame := decoder.next_frame()) is not None:
            handle(frame)                   # a memoryview of one frame body

    Each frame is returned as a :class:`memoryview` of a buffer that belongs to the caller alone
    (the decoder never touches it again): read-only ``bytes`` for frames that arrived within one
    chunk, a writable ``bytearray`` for frames assembled from several.
    """

    __slots__ = ("_body", "_body_len", "_error", "_frames", "_header", "_max")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        """Create a decoder that accepts frame bodies up to ``max_frame_size`` bytes.

        :raises ValueError: if ``max_frame_size`` is not in ``[0, 2**32 - 1]``.
        :raises TypeError: if ``max_frame_size`` is not an ``int``.
        """
        self._max = _check_cap(max_frame_size)
        self._frames: deque[memoryview] = deque()
        self._header = bytearray()  # partial header, < 4 bytes
        self._body: bytearray | None = None  # partial body (state BODY) or None (state HEADER)
        self._body_len = 0
        self._error: RemoteProtocolError | None = None

    @property
    def max_frame_size(self) -> int:
        """The largest frame body this decoder accepts, in bytes."""
        return self._max

    @property
    def buffered(self) -> int:
        """Bytes received that belong to a frame not yet complete."""
        return len(self._header) + (len(self._body) if self._body is not None else 0)

    @property
    def pending_frames(self) -> int:
        """Complete frames waiting to be taken with :meth:`next_frame`."""
        return len(self._frames)

    def feed(self, data: Buffer) -> None:
        """Add received bytes; every frame they complete is queued for :meth:`next_frame`.

        ``data`` is copied as needed and not referenced after the call returns, so the caller may
        reuse its buffer. Frames completed before a bad header stay queued.

        :raises RemoteProtocolError: if a frame header announces more than ``max_frame_size``
            bytes (raised as soon as the header is complete), or if the decoder already failed.
        :raises TypeError: if ``data`` is not a C-contiguous bytes-like object.
        """
        if self._error is not None:
            raise RemoteProtocolError(f"frame decoder already failed: {self._error}")
        with memoryview(data) as raw:
            if not raw.c_contiguous:
                raise TypeError("FrameDecoder.feed needs a C-contiguous buffer")
            if raw.format == "B" and raw.ndim == 1:
                self._feed(raw)
            else:
                with raw.cast("B") as view:
                    self._feed(view)

    def _feed(self, view: memoryview) -> None:
        end = view.nbytes
        pos = 0
        frames = self._frames
        while pos < end:
            body = self._body
            if body is not None:  # state BODY: complete the partial body
                take = min(end - pos, self._body_len - len(body))
                body += view[pos : pos + take]
                pos += take
                if len(body) == self._body_len:
                    frames.append(memoryview(body))
                    self._body = None
                continue
            if self._header or end - pos < FRAME_HEADER_SIZE:  # state HEADER, split header
                take = min(end - pos, FRAME_HEADER_SIZE - len(self._header))
                self._header += view[pos : pos + take]
                pos += take
                if len(self._header) < FRAME_HEADER_SIZE:
                    return
                (length,) = _HEADER.unpack(self._header)
                self._header.clear()
                self._check_length(length)
                self._start_body(length)
                continue
            # fast path: a whole header in this chunk
            (length,) = _HEADER.unpack_from(view, pos)
            self._check_length(length)
            pos += FRAME_HEADER_SIZE
            if end - pos >= length:
                frames.append(memoryview(view[pos : pos + length].tobytes()))
                pos += length
            else:
                self._start_body(length)

    def _check_length(self, length: int) -> None:
        if length > self._max:
            self._error = RemoteProtocolError(
                f"peer announced a frame of {length} bytes; the limit is {self._max} bytes"
            )
            raise self._error

    def _start_body(self, length: int) -> None:
        if length == 0:
            self._frames.append(memoryview(b""))
        else:
            self._body = bytearray()
            self._body_len = length

    def next_frame(self) -> memoryview | None:
        """The next complete frame body, or ``None`` if no complete frame is queued."""
        return self._frames.popleft() if self._frames else None

    def frames(self) -> Iterator[memoryview]:
        """Iterate over (and take) the complete frames queued so far."""
        while self._frames:
            yield self._frames.popleft()

    def feed_eof(self) -> None:
        """Declare that the stream ended; check that it ended on a frame boundary.

        Frames already queued stay available.

        :raises RemoteProtocolError: if the stream stopped inside a frame header or body.
        """
        if self._error is None and self.buffered:
            self._error = RemoteProtocolError(
                f"stream ended inside a frame ({self.buffered} bytes of an incomplete frame)"
            )
            raise self._error
