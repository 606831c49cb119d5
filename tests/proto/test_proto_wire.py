"""Framing: encode_frame / FrameDecoder."""

from __future__ import annotations

import array
import itertools
import time
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmavg.errors import MessageTooLarge, RemoteProtocolError
from swarmavg.proto import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_HEADER_SIZE,
    MAX_FRAME_SIZE_LIMIT,
    FrameDecoder,
    buffers_size,
    encode_frame,
    encode_frame_header,
)


def stream_of(bodies: list[bytes], max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    return b"".join(b"".join(encode_frame([body], max_frame_size)) for body in bodies)


def drain(decoder: FrameDecoder) -> list[bytes]:
    return [bytes(frame) for frame in decoder.frames()]


def test_header_layout_and_constants() -> None:
    assert FRAME_HEADER_SIZE == 4
    assert encode_frame_header(0) == b"\0\0\0\0"
    assert encode_frame_header(0x01020304, MAX_FRAME_SIZE_LIMIT) == b"\x01\x02\x03\x04"
    assert encode_frame_header(DEFAULT_MAX_FRAME_SIZE) == DEFAULT_MAX_FRAME_SIZE.to_bytes(4, "big")


def test_encoding_past_the_cap_raises_message_too_large() -> None:
    with pytest.raises(MessageTooLarge):
        encode_frame_header(DEFAULT_MAX_FRAME_SIZE + 1)
    with pytest.raises(MessageTooLarge):
        encode_frame([b"abc", memoryview(b"de")], max_frame_size=4)
    assert buffers_size(encode_frame([b"abc", memoryview(b"d")], max_frame_size=4)) == 8


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-1,), ValueError),
        ((True,), TypeError),
        ((1.0,), TypeError),
        ((1, -1), ValueError),
        ((1, MAX_FRAME_SIZE_LIMIT + 1), ValueError),
    ],
)
def test_header_argument_validation(args: tuple[object, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        encode_frame_header(*args)  # type: ignore[arg-type]


def test_decoder_argument_validation() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(MAX_FRAME_SIZE_LIMIT + 1)
    with pytest.raises(TypeError):
        FrameDecoder(1.5)  # type: ignore[arg-type]
    assert FrameDecoder(10).max_frame_size == 10


def test_encode_frame_does_not_copy_parts() -> None:
    body = bytearray(b"payload")
    parts = encode_frame([body])
    assert parts[1] is body


BODIES = [b"", b"a", b"hello world", bytes(range(256)) * 3, b"", b"\0\0\0\0"]


def test_split_at_every_position() -> None:
    data = stream_of(BODIES)
    for cut in range(len(data) + 1):
        decoder = FrameDecoder()
        decoder.feed(data[:cut])
        got = drain(decoder)
        decoder.feed(data[cut:])
        got += drain(decoder)
        assert got == BODIES, cut
        assert decoder.buffered == 0
        decoder.feed_eof()


def test_byte_by_byte() -> None:
    data = stream_of(BODIES)
    decoder = FrameDecoder()
    got = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        while (frame := decoder.next_frame()) is not None:
            got.append(bytes(frame))
    assert got == BODIES


@given(
    bodies=st.lists(st.binary(max_size=300), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    kind=st.sampled_from([bytes, bytearray, memoryview]),
)
def test_random_chunking(bodies: list[bytes], cuts: list[int], kind: type) -> None:
    data = stream_of(bodies)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    decoder = FrameDecoder()
    got = []
    for start, stop in itertools.pairwise(points):
        decoder.feed(kind(data[start:stop]))
        got += drain(decoder)
    assert got == bodies
    assert decoder.pending_frames == 0
    assert decoder.buffered == 0


def test_accepts_any_contiguous_buffer() -> None:
    data = stream_of([b"\x01\x00\x00\x00\x02\x00\x00\x00"])
    words = array.array("I")
    words.frombytes(data + bytes(-len(data) % 4))  # a non-byte format
    decoder = FrameDecoder()
    decoder.feed(words)
    assert drain(decoder) == [data[4:]]


def test_non_contiguous_input_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        FrameDecoder().feed(memoryview(b"\0\0\0\0\0\0\0\0")[::2])
    with pytest.raises(TypeError):
        FrameDecoder().feed("text")  # type: ignore[arg-type]


def test_frames_do_not_alias_the_input() -> None:
    data = bytearray(stream_of([b"abcd", b"efgh"]))
    decoder = FrameDecoder()
    decoder.feed(data[:10])  # first frame whole, second split
    decoder.feed(data[10:])
    data[:] = bytes(len(data))  # the caller reuses its buffer; would raise if still exported
    data.extend(b"more")
    assert drain(decoder) == [b"abcd", b"efgh"]


def test_cap_enforced_when_the_header_arrives() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    decoder.feed(stream_of([b"x" * 100], max_frame_size=100))
    header = (101).to_bytes(4, "big")
    with pytest.raises(RemoteProtocolError, match="101"):
        decoder.feed(header)  # no body byte has been sent
    assert decoder.buffered == 0
    assert drain(decoder) == [b"x" * 100]  # frames before the bad header survive
    with pytest.raises(RemoteProtocolError):
        decoder.feed(b"anything")  # the decoder is dead


def test_cap_enforced_on_a_split_header() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    header = (2**32 - 1).to_bytes(4, "big")
    for byte in header[:3]:
        decoder.feed(bytes([byte]))
    with pytest.raises(RemoteProtocolError):
        decoder.feed(header[3:] + b"body")


def test_announced_length_is_not_preallocated() -> None:
    decoder = FrameDecoder()
    tracemalloc.start()
    try:
        decoder.feed(encode_frame_header(DEFAULT_MAX_FRAME_SIZE) + b"0123456789")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoder.buffered == 10
    assert peak < 1024 * 1024  # not 64 MiB


def test_feed_eof() -> None:
    decoder = FrameDecoder()
    decoder.feed(stream_of([b"abc"]))
    decoder.feed_eof()  # on a boundary: fine
    decoder.feed(b"\0\0")
    with pytest.raises(RemoteProtocolError):
        decoder.feed_eof()
    assert drain(decoder) == [b"abc"]

    decoder = FrameDecoder()
    decoder.feed(stream_of([b"abcdef"])[:-1])
    with pytest.raises(RemoteProtocolError):
        decoder.feed_eof()


def test_many_tiny_frames_are_fast() -> None:
    count = 100_000
    data = stream_of([b"x"] * count)
    decoder = FrameDecoder()
    start = time.process_time()  # (CPU time: other processes on a loaded machine do not count)
    decoder.feed(data)
    frames = list(decoder.frames())
    elapsed = time.process_time() - start
    assert len(frames) == count
    assert elapsed < 2.0  # ~0.1 s in practice; quadratic behaviour would take minutes


def test_large_frame_in_small_chunks_is_linear() -> None:
    body = bytes(range(256)) * (32 * 1024)  # 8 MiB
    data = stream_of([body])
    decoder = FrameDecoder()
    start = time.process_time()
    view = memoryview(data)
    for i in range(0, len(data), 4096):
        decoder.feed(view[i : i + 4096])
    elapsed = time.process_time() - start
    frame = decoder.next_frame()
    assert frame is not None
    assert frame == body
    assert not frame.readonly  # assembled in a bytearray that now belongs to us
    assert elapsed < 5.0


@given(garbage=st.binary(max_size=200), cut=st.integers(min_value=0, max_value=200))
def test_garbage_gives_frames_or_remote_protocol_error(garbage: bytes, cut: int) -> None:
    decoder = FrameDecoder(max_frame_size=64)
    try:
        decoder.feed(garbage[:cut])
        decoder.feed(garbage[cut:])
        decoder.feed_eof()
    except RemoteProtocolError:
        pass
    for frame in decoder.frames():
        assert len(frame) <= 64
