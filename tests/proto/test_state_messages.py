"""State sharing's header and range checks (``swarmavg.proto.state_messages``): whatever a
donor sends, a layout within bounds or :class:`StateDownloadFailed`, nothing else."""

from __future__ import annotations

import dataclasses
import hashlib
import math

from hypothesis import given
from hypothesis import strategies as st

from swarmavg.proto import decode_message, encode_message_bytes
from swarmavg.proto.state_messages import (
    DIGEST_SIZE,
    DTYPE_SIZES,
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

DTYPES = [*DTYPE_SIZES, "object", "", "float8"]
CODECS = ["", "none", "float16", "uniform_8bit", "blockwise_8bit", "nope"]
INTS = st.one_of(st.integers(-3, 70), st.integers(-(2**63), 2**63 - 1))
MAX_BYTES = 1 << 20


def _valid(header: StateHeader, layout: StateLayout) -> None:
    """What a layout that passed promises."""
    assert layout.total == header.total_bytes
    assert layout.raw_total <= MAX_BYTES
    assert sum(s.size for s in layout.segments) == layout.total
    offset = 0
    for seg in layout.segments:
        assert seg.offset == offset
        assert 0 <= seg.size <= seg.raw_size
        offset += seg.size
    assert len(layout.digests) == (math.ceil(layout.total / layout.block_size))
    assert hashlib.sha256(b"".join(layout.digests)).digest() == header.checksum


@st.composite
def headers(draw: st.DrawFn) -> StateHeader:
    n = draw(st.integers(0, 4))
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(n)]
    shapes = [draw(st.lists(INTS, max_size=3)) for _ in range(n)]
    encodings = tuple(
        (draw(st.sampled_from(CODECS)), draw(INTS), draw(INTS), draw(INTS), draw(INTS))
        for _ in range(draw(st.sampled_from([0, n, n + 1])))
    )
    total = draw(st.one_of(INTS, st.just(-1)))
    block = draw(INTS)
    digests = draw(st.binary(max_size=5 * DIGEST_SIZE))
    checksum = draw(st.sampled_from([hashlib.sha256(digests).digest(), b"", bytes(DIGEST_SIZE)]))
    snapshot = draw(st.binary(max_size=80))
    return StateHeader(
        draw(st.binary(max_size=8)),
        dtypes,
        shapes,
        total,
        checksum,
        snapshot,
        block,
        digests,
        encodings,
    )


@given(headers())
def test_any_header_gives_a_layout_or_a_refusal(header: StateHeader) -> None:
    try:
        layout = check_header(header, MAX_BYTES)
    except StateDownloadFailed:
        return
    _valid(header, layout)


@st.composite
def valid_headers(draw: st.DrawFn) -> tuple[StateHeader, bytes]:
    n = draw(st.integers(0, 4))
    dtypes = [draw(st.sampled_from(sorted(DTYPE_SIZES))) for _ in range(n)]
    shapes = [draw(st.lists(st.integers(0, 6), max_size=3)) for _ in range(n)]
    total = sum(DTYPE_SIZES[d] * math.prod(s) for d, s in zip(dtypes, shapes, strict=True))
    payload = draw(st.binary(min_size=total, max_size=total))
    block = draw(st.integers(1, 64))
    digests = b"".join(block_digests([payload[:7], payload[7:]], block))
    header = StateHeader(
        b"\xc0", dtypes, shapes, total, hashlib.sha256(digests).digest(), b"", block, digests
    )
    return dataclasses.replace(header, snapshot=snapshot_id(header)), payload


@given(valid_headers(), st.data())
def test_valid_headers_pass_and_one_changed_field_is_caught(
    made: tuple[StateHeader, bytes], data: st.DataObject
) -> None:
    header, payload = made
    layout = check_header(header, MAX_BYTES)
    _valid(header, layout)
    for i, digest in enumerate(layout.digests):  # every block's digest, in order
        start, stop = layout.block_range(i)
        assert hashlib.sha256(payload[start:stop]).digest() == digest
    assert decode_message(encode_message_bytes(header)) == header
    name = data.draw(st.sampled_from(["total_bytes", "block_digests", "checksum"]))
    value = getattr(header, name)
    changed = dataclasses.replace(
        header, **{name: value + 1 if isinstance(value, int) else value + b"\0"}
    )
    if name != "block_digests":  # (which the checksum covers)
        assert snapshot_id(changed) != snapshot_id(header)
    try:
        check_header(changed, MAX_BYTES)
    except StateDownloadFailed:
        pass
    else:
        raise AssertionError(f"a changed {name} passed")


@given(INTS, INTS, st.integers(0, 2**40))
def test_ranges(start: int, stop: int, total: int) -> None:
    try:
        lo, hi = check_range(start, stop, total)
    except StateDownloadFailed:
        assert not (0 <= start <= (total if stop == -1 else stop) <= total)
        return
    assert 0 <= lo <= hi <= total


@given(st.integers(0, 10_000), st.integers(1, 100), st.integers(1, 5))
def test_split_ranges_cover_the_payload_in_whole_blocks(total: int, block: int, n: int) -> None:
    ranges = split_ranges(total, block, n)
    assert [r[0] for r in ranges[1:]] == [r[1] for r in ranges[:-1]]
    assert (ranges[0][0] if ranges else 0) == 0
    assert (ranges[-1][1] if ranges else 0) == total
    assert all(start % block == 0 for start, _ in ranges)


def test_requests_default_to_everything_of_a_fresh_snapshot() -> None:
    assert StateRequest("p") == StateRequest("p", b"", 0, -1)
    assert decode_message(encode_message_bytes(StateRequest("p", b"x", 3, 9))) == StateRequest(
        "p", b"x", 3, 9
    )
